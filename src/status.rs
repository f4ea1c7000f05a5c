//! `ailhd status`: files per state, rows per split and label, quarantined files with reasons,
//! and (while the service runs) its queue depth, ingest latency and last errors. The manifest
//! can only be opened by one process, so while `run` holds it, `status` reads the snapshot the
//! service keeps in `<state>/status.json` and says how old it is (`service.age_s`). The
//! `--json` schema: docs/json.md.

use crate::config::{Settings, SPLITS};
use crate::engine::manifest::Manifest;
use crate::lock::WriterLock;
use crate::source::settle::PendingFile;
use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SplitRows {
    pub rows: u64,
    pub valid: u64,
    /// Valid rows per label name.
    pub per_label: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Quarantined {
    pub path: String,
    pub reason: String,
}

/// What the running service adds (absent when it is not running).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ServiceStatus {
    pub pid: u32,
    pub device: String,
    pub queue_depth: usize,
    pub ingested: u64,
    /// Close-to-commit latency of recent files, milliseconds.
    pub latency_ms_p50: Option<f64>,
    pub latency_ms_p90: Option<f64>,
    pub latency_ms_p99: Option<f64>,
    pub last_errors: Vec<String>,
    /// Files waiting to be complete (at most 200, oldest first).
    #[serde(default)]
    pub pending: Vec<PendingFile>,
    /// When the service wrote these figures, Unix milliseconds.
    pub updated_ms: i64,
    /// Seconds from `updated_ms` to the moment `status` read them (the figures of a running
    /// service are a snapshot, rewritten at most every 2 s while recordings arrive).
    #[serde(default)]
    pub age_s: f64,
    /// False while the files are closed (idle for `ingest.idle_close_s`, or writing fails).
    #[serde(default)]
    pub outputs_open: bool,
    /// Set while writing fails (disk full, I/O error): the service retries by itself.
    #[serde(default)]
    pub write_failing: Option<WriteFailing>,
    /// Folders not watched for now (inotify limits, no permission): retried, and the tree
    /// rescanned meanwhile.
    #[serde(default)]
    pub unwatched: Vec<Unwatched>,
    /// Set while the service compares the tree with the manifest (at its start, in a rescan,
    /// in the recovery after a failure): what that finds is counted in `queue_depth` only once
    /// handed on, so the service has caught up with the tree when this is None and the queue
    /// is empty.
    #[serde(default)]
    pub comparing: Option<Comparing>,
}

/// A comparison of the tree with the manifest under way.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Comparing {
    /// Unix milliseconds when it began.
    pub since_ms: i64,
    /// `start`, `rescan` or `recovery`.
    pub why: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Unwatched {
    pub path: String,
    pub reason: String,
}

/// A write failure the service is riding out.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WriteFailing {
    /// Unix milliseconds of the first failure.
    pub since_ms: i64,
    pub error: String,
    /// Seconds to the next attempt.
    pub retry_in_s: f64,
    /// Changes seen meanwhile, taken up again by the rescan once writing works.
    pub dropped: usize,
}

/// The same bytes under paths with different labels: one row, labelled by the smallest path.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LabelConflict {
    pub blake3: String,
    /// Every path holding the bytes, with its label folder; the first owns the row.
    pub paths: Vec<LabelledPath>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LabelledPath {
    pub path: String,
    pub label: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StatusReport {
    pub writer: Option<String>,
    pub files: BTreeMap<String, u64>,
    pub splits: BTreeMap<String, SplitRows>,
    pub quarantined: Vec<Quarantined>,
    #[serde(default)]
    pub label_conflicts: Vec<LabelConflict>,
    pub service: Option<ServiceStatus>,
    pub feature_fingerprint: Option<String>,
    /// `I/N` for the outputs of `rebuild --shard I/N` (one part of the tree).
    #[serde(default)]
    pub shard: Option<String>,
    /// A service started and waiting, before it takes the folders, for something that may pass
    /// (folders that cannot be used yet, a GPU).
    #[serde(default)]
    pub waiting: Option<crate::waiting::Waiting>,
}

pub fn snapshot_path(settings: &Settings) -> PathBuf {
    settings.paths.state.join("status.json")
}

/// The running service's second copy of its snapshot, in a runtime folder
/// (`$RUNTIME_DIRECTORY`, which the unit's `RuntimeDirectory=` sets, else `/run/ailhd`): a
/// tmpfs that stays writable when the state folder's disk fails, so `status` shows a failing
/// disk live.
pub fn runtime_snapshot_path(settings: &Settings) -> PathBuf {
    runtime_path(settings, "status")
}

/// `<runtime folder>/<stem>-<key>.json` (see [`runtime_snapshot_path`]): named after the state
/// folder, so that several services on a host keep apart.
pub(crate) fn runtime_path(settings: &Settings, stem: &str) -> PathBuf {
    let dir = std::env::var_os("RUNTIME_DIRECTORY")
        .and_then(|d| {
            d.to_string_lossy()
                .split(':')
                .next()
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from("/run/ailhd"));
    let state =
        std::path::absolute(&settings.paths.state).unwrap_or_else(|_| settings.paths.state.clone());
    let key = blake3::hash(state.as_os_str().as_encoded_bytes()).to_hex();
    dir.join(format!("{stem}-{}.json", &key[..16]))
}

/// The newest snapshot of the running service (of the state folder's and the runtime copy).
fn read_snapshot(settings: &Settings) -> anyhow::Result<StatusReport> {
    let mut best: Option<StatusReport> = None;
    let mut first_error = None;
    for path in [snapshot_path(settings), runtime_snapshot_path(settings)] {
        let parsed = std::fs::read_to_string(&path)
            .with_context(|| format!("has not written {} yet", path.display()))
            .and_then(|t| {
                serde_json::from_str::<StatusReport>(&t)
                    .with_context(|| format!("cannot parse {}", path.display()))
            });
        match parsed {
            Ok(r) => {
                let when = |r: &StatusReport| r.service.as_ref().map_or(0, |s| s.updated_ms);
                if best.as_ref().is_none_or(|b| when(&r) > when(b)) {
                    best = Some(r);
                }
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    best.ok_or_else(|| first_error.expect("two paths tried"))
}

/// The running service's snapshot, once the process holding the lock (`pid`) has written one:
/// right after a start, the snapshot there is its predecessor's (another pid, other counts)
/// until the new service writes its own, within moments of taking the lock.
fn snapshot_of(settings: &Settings, pid: Option<u32>) -> anyhow::Result<StatusReport> {
    let started = std::time::Instant::now();
    loop {
        let r = read_snapshot(settings);
        let theirs = |r: &StatusReport| pid.is_none() || r.service.as_ref().map(|s| s.pid) == pid;
        match r {
            Ok(r) if theirs(&r) => return Ok(r),
            _ if started.elapsed() < SNAPSHOT_WAIT => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            Ok(_) => anyhow::bail!(
                "it is starting and has not written its status yet (the snapshot there is an earlier process's): try again in a moment"
            ),
            Err(e) => return Err(e),
        }
    }
}

/// How long `status` waits for a service that has just started to write its first snapshot.
const SNAPSHOT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The report from the manifest's [`Summary`](crate::engine::manifest::Summary) and its derived
/// trees: what it costs grows with the quarantined files and the contents several paths hold,
/// not with the dataset (the service builds one every few seconds while recordings arrive).
pub fn collect(
    manifest: &Manifest,
    labels: &[String],
    settings: &Settings,
) -> anyhow::Result<StatusReport> {
    let mut r = StatusReport::default();
    let summary = manifest.summary();
    for (state, n) in [
        ("committed", summary.committed),
        ("quarantined", summary.quarantined),
    ] {
        r.files.insert(state.to_string(), n);
    }
    for item in manifest.quarantined() {
        let (path, reason) = item?;
        r.quarantined.push(Quarantined { path, reason });
    }
    for item in manifest.shared_contents() {
        let (hash, c) = item?;
        let folders: Vec<LabelledPath> = c
            .paths
            .iter()
            .map(|p| LabelledPath {
                path: p.clone(),
                label: crate::identity::label_folder(settings, p)
                    .unwrap_or("")
                    .to_string(),
            })
            .collect();
        if folders.iter().any(|f| f.label != folders[0].label) {
            r.label_conflicts.push(LabelConflict {
                blake3: crate::identity::hex(&hash),
                paths: folders,
            });
        }
    }
    for (split, (name, rows)) in SPLITS.iter().zip(manifest.rows()?).enumerate() {
        // Every label of the outputs, with none of its rows valid shown as 0 (docs/json.md: a
        // value is never left out).
        let mut per_label: BTreeMap<String, u64> = labels.iter().map(|l| (l.clone(), 0)).collect();
        for (&label, &n) in &summary.per_label[split] {
            let name = labels
                .get(label as usize)
                .cloned()
                .unwrap_or_else(|| format!("#{label}"));
            *per_label.entry(name).or_default() += n;
        }
        r.splits.insert(
            name.to_string(),
            SplitRows {
                rows,
                valid: summary.valid[split],
                per_label,
            },
        );
    }
    r.feature_fingerprint = manifest.get_meta("feature_fingerprint")?;
    r.shard = manifest.get_meta("shard")?;
    Ok(r)
}

/// The report as `status` shows it: from the manifest when no writer holds it, else from the
/// running service's snapshot. A stopped service's report is read from the one kept beside the
/// manifest ([`save_stopped`]) while the manifest's files are as they were when it was made:
/// opening the manifest costs time that grows with it (sled reads its page table), a kept
/// report does not.
pub fn load(settings: &Settings) -> anyhow::Result<StatusReport> {
    if let Some((holder, pid, role)) = WriterLock::holder_described(&settings.paths.state) {
        // Only the service writes snapshots; another holder's would be an older process's.
        match role.as_str() {
            "run" => {}
            "rebuild" => anyhow::bail!(
                "{holder} is rebuilding the outputs and holds the manifest: `status` reports once it is done"
            ),
            _ => anyhow::bail!("{holder} holds the manifest: `status` reports once it is done"),
        }
        let mut r =
            snapshot_of(settings, pid).with_context(|| format!("{holder} holds the manifest"))?;
        r.writer = Some(holder);
        if let Some(svc) = r.service.as_mut() {
            let age_ms = crate::engine::manifest::now_ms() - svc.updated_ms;
            svc.age_s = age_ms.max(0) as f64 / 1e3;
        }
        return Ok(r);
    }
    if let Some(pending) = crate::staging::swap_pending(settings) {
        anyhow::bail!("{pending}; status reports after it");
    }
    let waiting = crate::waiting::Waiting::read(settings);
    let dir = crate::staging::manifest_dir(settings);
    if !dir.exists() {
        match &waiting {
            Some(w) => anyhow::bail!("{}; nothing has been ingested yet", w.describe()),
            None => anyhow::bail!(
                "no manifest at {}: nothing has been ingested yet (run `ailhd rebuild` or start `ailhd run`)",
                dir.display()
            ),
        }
    }
    let mut r = match read_stopped(settings) {
        Some(r) => r,
        None => {
            let r = collect_closed(settings)?;
            // Kept for the next `status` (best effort: who runs `status` may not write the
            // state folder).
            let _ = save_stopped(settings, &r);
            r
        }
    };
    r.waiting = waiting;
    Ok(r)
}

/// The report made from the manifest, opened for it and closed again. Labels are named as the
/// outputs name them (the list the manifest stored with them), whatever the configuration that
/// runs `status` says: ids are never renumbered, and the report is kept for the next `status`.
fn collect_closed(settings: &Settings) -> anyhow::Result<StatusReport> {
    let manifest = Manifest::open(&crate::staging::manifest_dir(settings))?;
    let labels = match manifest.stored_labels()? {
        Some(labels) => labels,
        None => {
            let appended = manifest.appended_labels()?;
            let u = settings.labels.unknown;
            crate::identity::LabelSet::new(&settings.labels.names, &appended, u).names
        }
    };
    collect(&manifest, &labels, settings)
}

/// A report of a closed manifest, with what its files looked like then.
#[derive(Serialize, Deserialize)]
struct StoppedReport {
    manifest: String,
    report: StatusReport,
}

fn stopped_path(settings: &Settings) -> PathBuf {
    settings.paths.state.join("status-stopped.json")
}

/// What the manifest's files look like: name, size and mtime of each (sled writes its log,
/// snapshots and blobs there), as one digest. Any write to the manifest changes it.
fn manifest_stamp(settings: &Settings) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let dir = crate::staging::manifest_dir(settings);
    let mut seen = Vec::new();
    for folder in [dir.clone(), dir.join("blobs")] {
        for entry in std::fs::read_dir(&folder).ok()? {
            let entry = entry.ok()?;
            let meta = entry.metadata().ok()?;
            if meta.is_file() {
                seen.push(format!(
                    "{}/{} {} {}.{}",
                    folder.display(),
                    entry.file_name().to_string_lossy(),
                    meta.len(),
                    meta.mtime(),
                    meta.mtime_nsec()
                ));
            }
        }
    }
    seen.sort();
    Some(
        blake3::hash(seen.join("\n").as_bytes())
            .to_hex()
            .to_string(),
    )
}

/// Keep `report` as the stopped service's: call it once the manifest it was made from is
/// closed, and nothing else writes it (the writer lock is held, or nobody holds it).
pub fn save_stopped(settings: &Settings, report: &StatusReport) -> std::io::Result<()> {
    wait_until_closed(&crate::staging::manifest_dir(settings).join("db"));
    let manifest = manifest_stamp(settings).ok_or_else(|| std::io::Error::other("no manifest"))?;
    let mut report = report.clone();
    report.service = None;
    report.writer = None;
    report.waiting = None;
    let json = serde_json::to_vec(&StoppedReport { manifest, report })?;
    crate::durable::replace(&stopped_path(settings), &json, crate::durable::Sync::None)
}

/// sled writes its last bytes and releases its lock on `db` (flock) from a background thread
/// after its last handle is dropped: wait (up to 3 s) until the lock is free, so that the
/// stamp is taken of the files as sled left them. False: still held after 3 s.
pub(crate) fn wait_until_closed(db: &std::path::Path) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(file) = std::fs::File::open(db) else {
        return true;
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    // SAFETY: flock on a descriptor this function owns.
    while unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    // SAFETY: as above.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
    true
}

/// The kept report, if the manifest has not changed since it was made.
pub fn read_stopped(settings: &Settings) -> Option<StatusReport> {
    let kept: StoppedReport =
        serde_json::from_slice(&std::fs::read(stopped_path(settings)).ok()?).ok()?;
    (manifest_stamp(settings)? == kept.manifest).then_some(kept.report)
}

pub fn render(r: &StatusReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    match &r.writer {
        Some(w) => {
            let _ = writeln!(s, "writer: {w}");
        }
        None => match &r.waiting {
            Some(w) => {
                let _ = writeln!(s, "writer: none ({})", w.describe());
            }
            None => {
                let _ = writeln!(s, "writer: none (service not running)");
            }
        },
    }
    if let Some(shard) = &r.shard {
        let _ = writeln!(
            s,
            "shard: {shard} of the tree (`rebuild --shard`): `ailhd merge` the shards for the whole dataset"
        );
    }
    if let Some(svc) = &r.service {
        render_service(&mut s, svc);
    }
    render_dataset(&mut s, r);
    s
}

/// The running service's own figures: latency, write failures, unwatched folders, errors and
/// pending paths.
fn render_service(s: &mut String, svc: &ServiceStatus) {
    use std::fmt::Write;
    let ms = |v: Option<f64>| {
        v.map(|x| format!("{x:.1} ms"))
            .unwrap_or_else(|| "-".into())
    };
    let _ = writeln!(
        s,
        "service: pid {} on {}, queue {}, ingested {}, latency p50 {} p90 {} p99 {} \
         (figures of {:.1} s ago)",
        svc.pid,
        svc.device,
        svc.queue_depth,
        svc.ingested,
        ms(svc.latency_ms_p50),
        ms(svc.latency_ms_p90),
        ms(svc.latency_ms_p99),
        svc.age_s
    );
    if let Some(f) = &svc.write_failing {
        let _ = writeln!(
            s,
            "WRITING FAILS for {:.0} s, nothing lost, next try in {:.0} s: {}",
            (crate::engine::manifest::now_ms() - f.since_ms) as f64 / 1e3,
            f.retry_in_s,
            f.error
        );
    } else if !svc.outputs_open {
        let _ = writeln!(s, "outputs: closed while idle (plain readers open them)");
    }
    if let Some(c) = &svc.comparing {
        let _ = writeln!(
            s,
            "comparing the tree with the manifest ({}) for {:.1} s: what it finds is not in the queue yet",
            c.why,
            (crate::engine::manifest::now_ms() - c.since_ms).max(0) as f64 / 1e3
        );
    }
    for u in &svc.unwatched {
        let _ = writeln!(
            s,
            "NOT WATCHED (retried and rescanned every 10 s): {}",
            u.reason
        );
    }
    for e in &svc.last_errors {
        let _ = writeln!(s, "  recent error: {e}");
    }
    let _ = writeln!(s, "pending: {}", svc.pending.len());
    let now = crate::engine::manifest::now_ms();
    for p in &svc.pending {
        let _ = writeln!(
            s,
            "  {}: {} (for {:.1} s)",
            p.path,
            p.why,
            (now - p.since_ms) as f64 / 1e3
        );
    }
}

/// The recorded dataset: files per state, rows per split and label, quarantine and label
/// conflicts.
fn render_dataset(s: &mut String, r: &StatusReport) {
    use std::fmt::Write;
    let files: Vec<String> = r.files.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let _ = writeln!(
        s,
        "files: {}",
        if files.is_empty() {
            "none".into()
        } else {
            files.join(", ")
        }
    );
    for name in SPLITS {
        if let Some(sp) = r.splits.get(name) {
            let labels: Vec<String> = sp
                .per_label
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            let _ = writeln!(
                s,
                "{name:<10} rows {:>7} (valid {:>7})  {}",
                sp.rows,
                sp.valid,
                labels.join(", ")
            );
        }
    }
    let _ = writeln!(s, "quarantined: {}", r.quarantined.len());
    for q in &r.quarantined {
        let _ = writeln!(s, "  {}: {}", q.path, q.reason);
    }
    let _ = writeln!(s, "label conflicts: {}", r.label_conflicts.len());
    for c in &r.label_conflicts {
        let paths: Vec<String> = c
            .paths
            .iter()
            .map(|p| format!("{} ({})", p.path, p.label))
            .collect();
        let _ = writeln!(
            s,
            "  same bytes under {} (the first owns the row)",
            paths.join(", ")
        );
    }
}

/// `status --png OUT.png`: the picture of the dataset (see [`crate::plot::dataset`]), from the
/// outputs' own columns read as a reader reads them (HDF5 in SWMR mode, else npy), and the
/// report's file counts.
pub fn write_png(
    settings: &Settings,
    report: &StatusReport,
    out: &std::path::Path,
) -> anyhow::Result<()> {
    let cols = crate::output::read::read(settings)?;
    let title = crate::plot::dataset::Title {
        files: &report.files,
        writer: report.writer.as_deref(),
    };
    crate::plot::dataset::write(out, &settings.paths.output, &title, &cols)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::manifest::{FileRecord, ManifestBatch};

    fn record(m: &Manifest, rel: &str) {
        let mut b = ManifestBatch::default();
        b.put_file(
            rel,
            &FileRecord {
                hash: Some([1; 32]),
                size: 1,
                mtime_ns: 1,
                quarantine: None,
                updated_ms: 0,
            },
        );
        m.apply(b).unwrap();
        m.flush().unwrap();
    }

    /// `status` of a stopped service reads the kept report while the manifest is as it was,
    /// and counts anew (and keeps that) once the manifest changed.
    #[test]
    fn a_kept_report_serves_until_the_manifest_changes() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        std::fs::create_dir_all(&s.paths.state).unwrap();
        let mdir = crate::staging::manifest_dir(&s);
        record(&Manifest::open(&mdir).unwrap(), "LEAK/a.wav");
        let counted = collect_closed(&s).unwrap();
        assert_eq!(counted.files.get("committed"), Some(&1));
        // A kept report that says something else shows it is the kept one that is read.
        let mut kept = counted.clone();
        kept.files.insert("committed".into(), 41);
        save_stopped(&s, &kept).unwrap();
        assert_eq!(load(&s).unwrap().files.get("committed"), Some(&41));
        // The manifest changes: counted again, and that report kept.
        record(&Manifest::open(&mdir).unwrap(), "LEAK/b.wav");
        assert_eq!(load(&s).unwrap().files.get("committed"), Some(&2));
        assert_eq!(read_stopped(&s).unwrap().files.get("committed"), Some(&2));
    }

    /// Right after a start, the snapshot in the state folder is the previous process's: `status`
    /// waits for the one the lock's holder writes, and says the holder is starting if none
    /// comes. A kill audit saw the previous pid and counts shown for 10-40 ms after a start.
    #[test]
    fn a_running_service_is_reported_from_its_own_snapshot_only() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        std::fs::create_dir_all(&s.paths.state).unwrap();
        let path = snapshot_path(&s);
        let snapshot = move |pid: u32, committed: u64| {
            let mut r = StatusReport::default();
            r.files.insert("committed".into(), committed);
            r.service = Some(ServiceStatus {
                pid,
                updated_ms: crate::engine::manifest::now_ms(),
                ..Default::default()
            });
            std::fs::write(&path, serde_json::to_vec(&r).unwrap()).unwrap();
        };
        let me = std::process::id();
        snapshot(me.wrapping_add(1), 7); // the predecessor's
        let _lock = WriterLock::acquire(&s.paths.state, "run").unwrap();
        let err = format!("{:#}", load(&s).unwrap_err());
        assert!(err.contains("is starting"), "{err}");
        let writer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            snapshot(me, 9);
        });
        let r = load(&s).unwrap();
        writer.join().unwrap();
        assert_eq!(r.files.get("committed"), Some(&9));
        assert_eq!(r.service.unwrap().pid, me);
    }

    #[test]
    fn a_running_rebuild_is_named_not_an_older_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        let lock = WriterLock::acquire(&s.paths.state, "rebuild").unwrap();
        let err = format!("{:#}", load(&s).unwrap_err());
        assert!(err.contains("(ailhd rebuild) is rebuilding"), "{err}");
        drop(lock);
        // Nor a compaction's: it writes no snapshot, so none is waited for.
        let _lock = WriterLock::acquire(&s.paths.state, "compact").unwrap();
        let asked = std::time::Instant::now();
        let err = format!("{:#}", load(&s).unwrap_err());
        assert!(err.contains("(ailhd compact) holds the manifest"), "{err}");
        assert!(asked.elapsed() < SNAPSHOT_WAIT, "{:?}", asked.elapsed());
    }
}
