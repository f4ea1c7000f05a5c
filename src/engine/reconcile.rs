//! The comparison of the tree with the manifest: start-up, lost events, the periodic safety
//! rescan. It only reads the manifest, so a service runs it beside its commits.

use super::manifest::Manifest;
use super::outcome::Observation;
use crate::config::Settings;
use crate::source::Item;
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

/// What the tree holds that the manifest does not know (or knows differently).
#[derive(Debug, Default)]
pub struct Reconciliation {
    /// Recordings new or changed (size or mtime) since they were recorded: to settle.
    pub changed: Vec<String>,
    /// Recorded paths no longer in the tree.
    pub removed: Vec<String>,
    /// Rejected paths not yet recorded with that reason.
    pub rejected: Vec<Observation>,
    /// Folders the listing could not list, with why ([`crate::source::Listing::unlisted`]):
    /// their recorded recordings are kept, and new ones under them are not seen.
    pub unlisted: Vec<(String, String)>,
}

/// The recordings folder holds nothing while the manifest knows recordings. Taken as a disk
/// that is not there (not mounted, say: its mount point is an empty folder), not as every
/// recording deleted: the comparison removes nothing, and a trainer keeps its rows. The watch
/// still reports deletions one by one as they happen; to drop every row of an emptied tree,
/// `ailhd rebuild --allow-empty` makes the outputs anew from it (a plain `rebuild` refuses an
/// empty folder the same way: [`crate::rebuild::EmptyTree`]).
#[derive(Debug)]
pub struct TreeAbsent {
    pub root: std::path::PathBuf,
}

impl std::fmt::Display for TreeAbsent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the recordings folder {} is empty while the manifest knows recordings: taken as a disk that is not there (not mounted?), not as every recording deleted, so no row is let go; the tree is compared again at the next rescan (`ingest.rescan_interval_s`), a reload or a restart. To drop every row of an emptied tree, stop the service and run `ailhd rebuild --allow-empty`",
            self.root.display()
        )
    }
}

impl std::error::Error for TreeAbsent {}

/// `lstat` of paths relative to a root, resolved from an open descriptor of their folder
/// (`fstatat`): paths in listing order share folders, and a lookup of the name alone costs a
/// fraction of a whole path's.
struct FolderStat<'a> {
    root: &'a Path,
    folder: Option<(String, Option<std::fs::File>)>,
}

impl<'a> FolderStat<'a> {
    fn new(root: &'a Path) -> Self {
        FolderStat { root, folder: None }
    }

    /// Size, mtime and ctime (ns) of `rel`, or None when it is not there (or cannot be looked
    /// at).
    fn stat(&mut self, rel: &str) -> Option<(u64, i64, i64)> {
        use std::os::fd::AsRawFd;
        let (dir, name) = rel.rsplit_once('/').unwrap_or(("", rel));
        if self.folder.as_ref().is_none_or(|(d, _)| d != dir) {
            let file = std::fs::File::open(self.root.join(dir)).ok();
            self.folder = Some((dir.to_string(), file));
        }
        let fd = self.folder.as_ref()?.1.as_ref()?.as_raw_fd();
        let name = std::ffi::CString::new(name).ok()?;
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and NUL-terminated name; `st` is written by the call.
        let rc = unsafe { libc::fstatat(fd, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
        (rc == 0).then(|| {
            (
                st.st_size as u64,
                st.st_mtime * 1_000_000_000 + st.st_mtime_nsec,
                st.st_ctime * 1_000_000_000 + st.st_ctime_nsec,
            )
        })
    }
}

/// How often [`reconcile_with`] hands on what it found so far.
const RECONCILE_REPORT_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

/// Compare the tree with the manifest. Safe beside commits (the service runs it on a thread of
/// its own while recordings keep arriving): a file a commit recorded after the tree was listed
/// is not reported removed (it is checked for again), and one reported changed that a commit
/// recorded meanwhile is found unchanged when it is loaded. It hands its findings to `emit` as it
/// goes, in the order a service wants them:
///
/// 1. what the listing alone tells, with no `stat`: paths the manifest does not know (new
///    recordings: most of what arrives while a service is down) and rejected ones, from one pass
///    over the sorted listing beside the manifest's records in the same order;
/// 2. recordings whose size or mtime differ from their records (one `stat` each), and recorded
///    paths that are gone;
/// 3. at a `start`, rows waiting to be made anew (their owner was to be read again when ailhd
///    stopped; a running engine reads them again itself, so only a start needs to look).
///
/// What it costs grows with the tree (a listing, a pass over the records, a `stat` per file),
/// but nothing waits for it: the first new path goes on as soon as it is found, the rest every
/// [`RECONCILE_REPORT_EVERY`], and the service keeps ingesting beside it. At a `start` (when
/// recordings that arrived while ailhd was down wait for it) the listing and the first two passes
/// use up to [`threads_for`] threads, each over its own folders or range of paths; a periodic
/// rescan uses one, and leaves the other cores to the recordings arriving meanwhile.
///
/// `listed` is a listing of the tree made since its watches were set up (the service's start
/// lists the tree while the engine opens); without one, the tree is listed here.
pub fn reconcile_with(
    settings: &Settings,
    manifest: &Manifest,
    listed: Option<crate::source::Listing>,
    start: bool,
    emit: &mut (dyn FnMut(Reconciliation) + Send),
) -> anyhow::Result<()> {
    let root = &settings.paths.recordings;
    // Test builds: a sleep here holds a rescan (tests/daemon.rs ingests beside it).
    fail::fail_point!("reconcile-listed", |_| Ok(()));
    // Test builds: `reconcile-error=return(WHY)` fails the comparison, as an unreadable
    // manifest would (tests/faults.rs: the recovery is tried again).
    fail::fail_point!("reconcile-error", |why: Option<String>| Err(
        anyhow::anyhow!("{}", why.unwrap_or_default())
    ));
    // Test builds: `reconcile-hold=return(MS)` holds it that long as a long comparison would,
    // giving way and ending once called off (tests/daemon.rs stops the service meanwhile).
    fail::fail_point!("reconcile-hold", |ms: Option<String>| {
        let hold = std::time::Duration::from_millis(ms.and_then(|m| m.parse().ok()).unwrap_or(0));
        let t = Instant::now();
        while t.elapsed() < hold {
            crate::pace::give_way()?;
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(())
    });
    let started = Instant::now();
    let took = || format!("{:.0} ms", started.elapsed().as_secs_f64() * 1e3);
    let found = match listed {
        Some(found) => found,
        None => {
            let found = crate::source::scan_on(root, if start { 4 } else { 1 })?;
            log::debug!("rescan: {} paths listed after {}", found.len(), took());
            found
        }
    };
    crate::pace::go_on()?;
    if found.is_empty() && manifest.files().next().is_some() {
        return Err(TreeAbsent {
            root: root.to_path_buf(),
        }
        .into());
    }
    let out = Mutex::new(Emitter {
        part: Reconciliation::default(),
        // The first finding goes on at once.
        last: Instant::now()
            .checked_sub(RECONCILE_REPORT_EVERY)
            .unwrap_or_else(Instant::now),
        emit,
    });
    if !found.unlisted().is_empty() {
        lock(&out).push(|p| p.unlisted.extend(found.unlisted().iter().cloned()));
    }
    let threads = if start { threads_for(found.len()) } else { 1 };
    let (known, unlisted) = new_paths(manifest, &found, threads, start, &out)?;
    lock(&out).flush(true);
    crate::pace::go_on()?;
    log::debug!(
        "rescan: new paths handed on after {} on {threads} threads",
        took()
    );
    changed_or_gone(root, &found, known, threads, &out);
    for rel in unlisted {
        crate::pace::give_way()?;
        // Gone. A recorded path that cannot be looked at (under a folder the service may not
        // read, or an I/O error) is not taken for deleted: it keeps its row, and the listing
        // said which folder it could not list.
        if let Err(e) = std::fs::symlink_metadata(root.join(&rel)) {
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) {
                lock(&out).push(|p| p.removed.push(rel));
            }
        }
    }
    lock(&out).flush(true);
    crate::pace::go_on()?;
    log::debug!("rescan: changed and gone handed on after {}", took());
    if start {
        let mut out = lock(&out);
        rows_to_remake(manifest, &found, &mut out)?;
        out.flush(true);
    }
    log::debug!("rescan: done after {}", took());
    Ok(())
}

/// Threads for a comparison of `listed` paths: the cores the process may use, at most four,
/// and no more than one per 20,000 paths (a thread costs more than a small tree's pass).
fn threads_for(listed: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.min(4).min(listed / 20_000).max(1)
}

fn lock<'a, 'b>(out: &'a Mutex<Emitter<'b>>) -> std::sync::MutexGuard<'a, Emitter<'b>> {
    out.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hands on what the comparison found, in parts, at most every [`RECONCILE_REPORT_EVERY`].
struct Emitter<'a> {
    part: Reconciliation,
    last: Instant,
    emit: &'a mut (dyn FnMut(Reconciliation) + Send),
}

impl Emitter<'_> {
    /// Add a finding, and hand on the part if it is due.
    fn push(&mut self, add: impl FnOnce(&mut Reconciliation)) {
        add(&mut self.part);
        self.flush(false);
    }

    /// Hand on the part if it is due. Nothing is handed on once the comparison is called off:
    /// whoever called it off is closing the manifest.
    fn flush(&mut self, force: bool) {
        if crate::pace::called_off() {
            return;
        }
        let p = &self.part;
        let any = !p.changed.is_empty()
            || !p.removed.is_empty()
            || !p.rejected.is_empty()
            || !p.unlisted.is_empty();
        if any && (force || self.last.elapsed() >= RECONCILE_REPORT_EVERY) {
            (self.emit)(std::mem::take(&mut self.part));
            self.last = Instant::now();
        }
    }
}

/// Listed recordings that have a record: (index in the listing, recorded size, mtime, and when
/// the record was written, Unix ms).
type Known = Vec<(u32, u64, i64, i64)>;

/// `0..len` in `parts` consecutive ranges as even as can be.
fn ranges(len: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    (0..parts)
        .map(|j| j * len / parts..(j + 1) * len / parts)
        .collect()
}

/// Phase 1: the sorted listing beside the records, in the same (byte) order, in `threads`
/// ranges at once. Hands on new paths and newly rejected ones; returns the listed paths that
/// have records, and the recorded paths that are not listed.
fn new_paths(
    manifest: &Manifest,
    found: &crate::source::Listing,
    threads: usize,
    start: bool,
    out: &Mutex<Emitter>,
) -> anyhow::Result<(Known, Vec<String>)> {
    let mut parts: Vec<_> = ranges(found.len(), threads)
        .into_iter()
        .filter(|r| !r.is_empty())
        .collect();
    if parts.is_empty() {
        parts.push(0..0); // the records alone: every one is unlisted
    }
    let results: Vec<anyhow::Result<(Known, Vec<String>)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = parts
            .iter()
            .enumerate()
            .map(|(j, range)| {
                // Records from this range's first path up to the next range's first path (the
                // first range also takes those before the listing, the last those after it).
                let from = (j > 0).then(|| found.rel(range.start));
                let to = (j + 1 < parts.len()).then(|| found.rel(range.end));
                let range = range.clone();
                scope.spawn(crate::pace::with_this_gate(move || {
                    new_paths_in(manifest, found, range, (from, to), start, out)
                }))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rescan thread panicked"))
            .collect()
    });
    let (mut known, mut unlisted) = (Known::new(), Vec::new());
    for r in results {
        let (k, u) = r?;
        known.extend(k);
        unlisted.extend(u);
    }
    Ok((known, unlisted))
}

/// [`new_paths`] over `found[range]` and the records from `from` (included) to `to` (excluded).
/// At a `start`, a recording quarantined for where it lies (a label folder not in
/// `labels.names`, a path longer than `outputs.path_bytes`, a folder not mapped to a split) is
/// taken up again, as changed: the configuration it was judged by may have changed since, as
/// its reason advises.
fn new_paths_in(
    manifest: &Manifest,
    found: &crate::source::Listing,
    range: std::ops::Range<usize>,
    (from, to): (Option<&str>, Option<&str>),
    start: bool,
    out: &Mutex<Emitter>,
) -> anyhow::Result<(Known, Vec<String>)> {
    let mut known: Known = Vec::new();
    let mut unlisted: Vec<String> = Vec::new();
    let mut records = manifest.files_between(from, to).peekable();
    for i in range {
        crate::pace::give_way()?;
        let item = found.get(i);
        let rel = item.rel();
        // Records before this path are not listed: gone, or recorded after the listing. An
        // error is taken too, and returned.
        let mut record = None;
        while let Some(next) =
            records.next_if(|r| r.as_ref().map_or(true, |(key, _)| key.as_str() <= rel))
        {
            let (key, rec) = next?;
            if key == rel {
                record = Some(rec);
                break;
            }
            unlisted.push(key);
        }
        match (item, record) {
            (Item::Recording(rel), None) => lock(out).push(|p| p.changed.push(rel.to_string())),
            (Item::Recording(rel), Some(rec))
                if start
                    && rec
                        .quarantine
                        .as_ref()
                        .is_some_and(|q| q.kind == crate::engine::outcome::PLACEMENT) =>
            {
                lock(out).push(|p| p.changed.push(rel.to_string()))
            }
            (Item::Recording(_), Some(rec)) => {
                known.push((i as u32, rec.size, rec.mtime_ns, rec.updated_ms));
            }
            (Item::Rejected { rel, reason }, rec) => {
                let same = rec
                    .and_then(|rec| rec.quarantine)
                    .is_some_and(|q| q.kind == reason.kind());
                if !same {
                    lock(out).push(|p| {
                        p.rejected.push(Observation::Rejected {
                            rel: rel.to_string(),
                            reason: reason.clone(),
                            size: 0,
                            mtime_ns: 0,
                        })
                    });
                }
            }
        }
    }
    for item in records {
        unlisted.push(item?.0);
    }
    Ok((known, unlisted))
}

/// Phase 2: changed in place since recorded (one `stat` each, in `threads` ranges at once).
fn changed_or_gone(
    root: &Path,
    found: &crate::source::Listing,
    known: Known,
    threads: usize,
    out: &Mutex<Emitter>,
) {
    let known = &known;
    std::thread::scope(|scope| {
        for range in ranges(known.len(), threads) {
            scope.spawn(crate::pace::with_this_gate(move || {
                let mut folders = FolderStat::new(root);
                for &(i, size, mtime_ns, recorded_ms) in &known[range] {
                    if crate::pace::give_way().is_err() {
                        break;
                    }
                    let rel = found.rel(i as usize);
                    let Some((now_size, now_mtime, ctime_ns)) = folders.stat(rel) else {
                        continue; // gone since the listing: the watcher reports it
                    };
                    // Another size or mtime, or an inode changed after its record was written
                    // (its ctime, which no one can set): bytes written with the mtime put back
                    // (`cp -p`, `touch -r`), a file renamed over it, a chmod, while no event
                    // could say so. Looked at again; the same bytes are found unchanged.
                    let changed = (now_size, now_mtime) != (size, mtime_ns)
                        || ctime_ns.div_euclid(1_000_000) > recorded_ms;
                    if changed {
                        lock(out).push(|p| p.changed.push(rel.to_string()));
                    }
                }
            }));
        }
    });
}

/// Phase 3: a row waiting to be made anew (its owner was to be read again when we stopped).
fn rows_to_remake(
    manifest: &Manifest,
    found: &crate::source::Listing,
    out: &mut Emitter,
) -> anyhow::Result<()> {
    for item in manifest.contents() {
        crate::pace::go_on()?;
        let (_, c) = item?;
        if let (None, Some(owner)) = (c.row, c.owner()) {
            if found
                .find(owner)
                .is_some_and(|i| matches!(found.get(i), Item::Recording(_)))
            {
                out.part.changed.push(owner.to_string());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DeviceChoice;
    use crate::engine::{Engine, Input};

    /// The whole comparison, as at a start, its parts gathered.
    fn reconcile(settings: &Settings, manifest: &Manifest) -> anyhow::Result<Reconciliation> {
        let mut all = Reconciliation::default();
        reconcile_with(settings, manifest, None, true, &mut |part| {
            all.changed.extend(part.changed);
            all.removed.extend(part.removed);
            all.rejected.extend(part.rejected);
        })?;
        Ok(all)
    }

    /// A tree ingested, then changed "while stopped": two new files, one changed in place, one
    /// deleted. Returns (folder, settings, engine, recorded paths, new paths).
    fn changed_while_stopped() -> (
        tempfile::TempDir,
        Settings,
        Engine,
        Vec<String>,
        Vec<String>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        let leak = s.paths.recordings.join("LEAK");
        std::fs::create_dir_all(&leak).unwrap();
        let write = |i: usize| {
            let name = crate::synth::file_name(i, 1);
            let samples = crate::synth::clip("LEAK", i as u64, 4096, 1.0);
            std::fs::write(leak.join(&name), crate::synth::wav_pcm16(&samples, 4096)).unwrap();
            format!("LEAK/{name}")
        };
        let recorded: Vec<String> = (0..6).map(write).collect();
        let mut engine = Engine::open_live(&s, DeviceChoice::Cpu).unwrap();
        engine
            .submit(
                recorded
                    .iter()
                    .map(|rel| Input::Load {
                        rel: rel.clone(),
                        seen: None,
                    })
                    .collect(),
            )
            .unwrap();
        engine.wait().unwrap();
        let new: Vec<String> = (10..12).map(write).collect();
        let t = std::fs::File::options()
            .append(true)
            .open(s.paths.recordings.join(&recorded[2]))
            .unwrap();
        t.set_len(t.metadata().unwrap().len() + 2).unwrap();
        std::fs::remove_file(s.paths.recordings.join(&recorded[4])).unwrap();
        (dir, s, engine, recorded, new)
    }

    /// Called off (the service is closing the manifest), the comparison hands nothing on and
    /// says so; the same comparison let run finds what the tree holds.
    #[test]
    fn a_called_off_comparison_hands_nothing_on() {
        let (_dir, s, engine, _recorded, new) = changed_while_stopped();
        let gate = crate::pace::Gate::new(|| false);
        gate.call_off();
        let g = gate.clone();
        let (parts, result) = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    crate::pace::install(Some(g));
                    let mut parts = Vec::new();
                    let r =
                        reconcile_with(&s, engine.manifest(), None, false, &mut |p| parts.push(p));
                    (parts, r)
                })
                .join()
                .unwrap()
        });
        let e = result.expect_err("called off");
        assert!(e.is::<crate::pace::CalledOff>(), "{e:#}");
        assert!(parts.is_empty(), "handed on: {:?}", parts.len());
        let all = reconcile(&s, engine.manifest()).unwrap();
        assert!(new.iter().all(|p| all.changed.contains(p)));
    }

    /// A tree with no recordings left under its folder, while the manifest knows some, is a disk
    /// that is not there: the comparison hands on no removal. One recording left is a tree.
    #[test]
    fn an_empty_tree_is_a_disk_not_there_not_every_recording_deleted() {
        let (_dir, s, engine, recorded, new) = changed_while_stopped();
        let root = &s.paths.recordings;
        for rel in recorded.iter().chain(&new) {
            let _ = std::fs::remove_file(root.join(rel));
        }
        let mut parts = Vec::new();
        let e = reconcile_with(&s, engine.manifest(), None, true, &mut |p| parts.push(p))
            .expect_err("an empty tree");
        assert!(e.is::<TreeAbsent>(), "{e:#}");
        assert!(format!("{e}").contains("not mounted?"), "{e}");
        assert!(parts.is_empty(), "handed on: {parts:?}");
        // The label folders gone too (an empty mount point): the same.
        for entry in std::fs::read_dir(root).unwrap() {
            std::fs::remove_dir_all(entry.unwrap().path()).unwrap();
        }
        let e = reconcile(&s, engine.manifest()).expect_err("an empty tree");
        assert!(e.is::<TreeAbsent>(), "{e:#}");
        // One recording back: every other one is gone indeed.
        std::fs::create_dir_all(root.join("LEAK")).unwrap();
        let samples = crate::synth::clip("LEAK", 10, 4096, 1.0);
        std::fs::write(root.join(&new[0]), crate::synth::wav_pcm16(&samples, 4096)).unwrap();
        let all = reconcile(&s, engine.manifest()).unwrap();
        assert_eq!(all.removed.len(), recorded.len(), "{all:?}");
        assert_eq!(all.changed, vec![new[0].clone()]);
    }

    /// The comparison with the manifest hands on new paths before it looks at any recorded
    /// file (its first part holds them, and nothing else about recordings), then what changed
    /// in place and what is gone; and it agrees with what the tree holds.
    #[test]
    fn a_reconcile_hands_on_new_paths_first_then_changes_and_removals() {
        let (_dir, s, engine, recorded, new) = changed_while_stopped();
        let changed = &recorded[2];
        let mut parts = Vec::new();
        reconcile_with(&s, engine.manifest(), None, true, &mut |p| parts.push(p)).unwrap();
        // In the order handed on: both new paths before the changed one and the removal.
        let order: Vec<&String> = parts
            .iter()
            .flat_map(|p| p.changed.iter().chain(&p.removed))
            .collect();
        assert_eq!(order.len(), 4, "{order:?}");
        let mut first_two: Vec<String> = order[..2].iter().map(|s| s.to_string()).collect();
        first_two.sort();
        assert_eq!(first_two, new, "new paths come first: {order:?}");
        let all = reconcile(&s, engine.manifest()).unwrap();
        let mut changed_all = all.changed.clone();
        changed_all.sort();
        let mut want = new.clone();
        want.push(changed.clone());
        want.sort();
        assert_eq!(changed_all, want);
        assert_eq!(all.removed, vec![recorded[4].clone()]);
        assert!(all.rejected.is_empty());
    }

    /// The passes shared among threads, each over its own range of paths and records, find
    /// what one thread finds, whatever the number of ranges (more ranges than paths too).
    #[test]
    fn the_passes_find_the_same_on_any_number_of_threads() {
        let (_dir, s, engine, recorded, new) = changed_while_stopped();
        let root = &s.paths.recordings;
        let found = crate::source::scan(root).unwrap();
        let run = |threads: usize| {
            let mut parts = Vec::new();
            let mut emit = |p: Reconciliation| parts.push(p);
            let out = Mutex::new(Emitter {
                part: Reconciliation::default(),
                last: Instant::now(),
                emit: &mut emit,
            });
            let (mut known, mut unlisted) =
                new_paths(engine.manifest(), &found, threads, true, &out).unwrap();
            changed_or_gone(root, &found, known.clone(), threads, &out);
            lock(&out).flush(true);
            drop(out);
            known.sort();
            unlisted.sort();
            let mut changed: Vec<String> = parts.into_iter().flat_map(|p| p.changed).collect();
            changed.sort();
            (known, unlisted, changed)
        };
        let one = run(1);
        let mut want = new.clone();
        want.push(recorded[2].clone());
        want.sort();
        assert_eq!(one.2, want);
        assert_eq!(one.1, vec![recorded[4].clone()]);
        assert_eq!(one.0.len(), 5);
        for threads in [2, 3, 4, 9, 20] {
            assert_eq!(run(threads), one, "{threads} threads");
        }
    }

    #[test]
    fn ranges_cover_every_index_once() {
        for len in [0, 1, 5, 20_001] {
            for parts in 1..6 {
                let r = ranges(len, parts);
                assert_eq!(r.len(), parts);
                assert_eq!(r.first().unwrap().start, 0);
                assert_eq!(r.last().unwrap().end, len);
                assert!(r.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
        assert_eq!(threads_for(19_999), 1);
    }
}
