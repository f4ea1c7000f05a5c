//! Compaction of a closed manifest (`ailhd compact`): its records copied in key order into a
//! fresh sled database, which then takes the old one's place.
//!
//! sled gives back the space of the pages it rewrote only once a segment of its log is half
//! empty, and ingesting rewrites leaves over and over (a recording's hash lands anywhere in the
//! `content` tree): a manifest written by `rebuild` or by the service for a while holds 700-900
//! bytes a recording on disk, a fresh copy 330-340 (docs/benchmarks.md, "`ailhd compact`").
//!
//! The swap, and what a power cut or a crash at any point leaves (see [`restore`]):
//! 1. the copy is made in `manifest.compacting`, compared record for record with the original,
//!    and synced (files, folder, its entry in the state folder);
//! 2. `manifest` and `manifest.compacting` are exchanged in one step (Linux `renameat2`), so
//!    `manifest` names a whole database at every instant, for `status` too; the state folder
//!    is synced; 3. `manifest.compacting`, now the original, is removed.
//!
//! On a file system that cannot exchange, step 2 is two renames: `manifest` to
//! `manifest.compacted-away`, then the copy to `manifest`.
//!
//! Nothing writes the manifest meanwhile (the caller holds the writer lock), so both copies
//! hold the same records: a cut at any point leaves one of them named `manifest` (put back by
//! name from `compacted-away` if the cut fell between the two renames of the fallback); what is
//! left beside it is removed at the next open.

use std::path::{Path, PathBuf};

/// Records copied a batch at a time.
const BATCH: usize = 4096;

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    dir.with_file_name(format!("{}.{suffix}", name.unwrap_or_default()))
}

/// Where the copy is made.
pub fn fresh_dir(dir: &Path) -> PathBuf {
    sibling(dir, "compacting")
}

/// Where the old manifest waits for its removal during the swap.
pub fn aside_dir(dir: &Path) -> PathBuf {
    sibling(dir, "compacted-away")
}

/// Before a manifest is opened: finish or undo a swap a crash interrupted. `dir` missing with
/// the old one set aside (a cut between steps 2 and 3): the old one goes back. Then whatever
/// is left of a copy or of an old manifest is removed. Only one writer opens `dir` at a time
/// (the writer lock), and a reader opens it only while no writer holds the lock.
pub fn restore(dir: &Path) {
    let (fresh, aside) = (fresh_dir(dir), aside_dir(dir));
    if !dir.exists() && aside.exists() {
        match std::fs::rename(&aside, dir) {
            Ok(()) => {
                log::warn!(
                    "manifest {}: a compaction was interrupted; the manifest from before it is back",
                    dir.display()
                );
                let _ = sync_parent(dir);
            }
            Err(e) => log::warn!(
                "manifest {}: a compaction was interrupted and its original {} cannot be moved back: {e}",
                dir.display(),
                aside.display()
            ),
        }
    }
    let left: Vec<PathBuf> = [fresh, aside].into_iter().filter(|p| p.exists()).collect();
    if !dir.exists() || left.is_empty() {
        return;
    }
    // The names as they are now made durable first: the old manifest's files are removed only
    // once no power cut can bring back the name `manifest` for them.
    if let Err(e) = sync_parent(dir) {
        log::warn!(
            "manifest {}: the state folder cannot be synced ({e}); what a compaction left beside it is kept for now",
            dir.display()
        );
        return;
    }
    for left in left {
        if let Err(e) = std::fs::remove_dir_all(&left) {
            log::warn!("{}: left by a compaction, not removed: {e}", left.display());
        }
    }
}

fn sync_parent(dir: &Path) -> std::io::Result<()> {
    match dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => crate::durable::sync_dir(parent),
        None => crate::durable::sync_dir(Path::new(".")),
    }
}

/// Bytes the files of `dir` (and of its `blobs` folder) take on disk.
pub fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for folder in [dir.to_path_buf(), dir.join("blobs")] {
        let Ok(entries) = std::fs::read_dir(&folder) else {
            continue;
        };
        for entry in entries.flatten() {
            if let Ok(m) = entry.metadata() {
                if m.is_file() {
                    total += m.blocks() * 512;
                }
            }
        }
    }
    total
}

/// What [`compact`] did: bytes on disk before and after, records copied.
#[derive(Debug, PartialEq)]
pub struct Compacted {
    pub before: u64,
    pub after: u64,
    pub records: u64,
    /// False when the copy would save less than a tenth of the original's space: the original
    /// is kept (a small manifest, or one compacted already, takes whole segments of sled's log
    /// either way).
    pub swapped: bool,
}

/// Compact the closed manifest in `dir` (see the module); the caller holds the writer lock. A
/// failure (a disk error; sled's panics on a failing disk are contained here, as in
/// `Manifest::fold_log`) leaves the manifest as it was, and what was copied is removed.
pub fn compact(dir: &Path) -> anyhow::Result<Compacted> {
    restore(dir);
    anyhow::ensure!(dir.join("db").exists(), "no manifest at {}", dir.display());
    let before = disk_bytes(dir);
    let run = crate::logging::contain(|| copy_and_swap(dir));
    let outcome = match run {
        Ok(Ok((records, swapped))) => {
            return Ok(Compacted {
                before,
                after: disk_bytes(dir),
                records,
                swapped,
            })
        }
        Ok(Err(e)) => Err(e),
        Err(_) => Err(anyhow::anyhow!(
            "sled failed while compacting (a disk error?)"
        )),
    };
    let fresh = fresh_dir(dir);
    if fresh.exists() {
        let _ = std::fs::remove_dir_all(&fresh);
    }
    restore(dir);
    outcome.map_err(|e| e.context(format!("{}: not compacted, left as it was", dir.display())))
}

/// Copy, compare, sync and swap (steps 1-3 of the module): the records copied, and whether the
/// copy took the original's place (only when it saves a tenth of the space or more).
fn copy_and_swap(dir: &Path) -> anyhow::Result<(u64, bool)> {
    use anyhow::Context;
    let fresh = fresh_dir(dir);
    let src =
        super::manifest::open_db(dir).with_context(|| format!("opening {}", dir.display()))?;
    let dst = sled::Config::new()
        .path(&fresh)
        .cache_capacity(1 << 20)
        .open()
        .with_context(|| format!("creating {}", fresh.display()))?;
    let mut records = 0u64;
    for name in src.tree_names() {
        let (from, to) = (src.open_tree(&name)?, dst.open_tree(&name)?);
        let mut batch = sled::Batch::default();
        let mut n = 0;
        for kv in from.iter() {
            let (k, v) = kv?;
            batch.insert(k, v);
            n += 1;
            if n == BATCH {
                to.apply_batch(std::mem::take(&mut batch))?;
                records += n as u64;
                n = 0;
            }
        }
        to.apply_batch(batch)?;
        records += n as u64;
    }
    dst.flush()?;
    // Record for record, before the original goes: a copy that differs is never swapped in.
    for name in src.tree_names() {
        let (a, b) = (src.open_tree(&name)?, dst.open_tree(&name)?);
        let mut copied = b.iter();
        for kv in a.iter() {
            let (k, v) = kv?;
            match copied.next().transpose()? {
                Some((k2, v2)) if k2 == k && v2 == v => {}
                _ => anyhow::bail!(
                    "the copy of tree {} differs from the original",
                    String::from_utf8_lossy(&name)
                ),
            }
        }
        if copied.next().is_some() {
            anyhow::bail!(
                "the copy of tree {} has records the original has not",
                String::from_utf8_lossy(&name)
            );
        }
    }
    drop(src);
    drop(dst);
    // Opened once more (open_db waits for the lock the copy's close still holds), sled folds
    // the copy's log into a snapshot and gives back the segments it did not fill, so that the
    // service's first open has nothing to fold.
    drop(super::manifest::open_db(&fresh)?);
    // sled writes its last bytes from a thread of its own after the last handle goes.
    for db in [dir.join("db"), fresh.join("db")] {
        if !crate::status::wait_until_closed(&db) {
            anyhow::bail!("{} still held by sled after 3 s", db.display());
        }
    }
    // A copy that saves less than a tenth is not worth a swap: sizes move by a segment of
    // sled's log either way (a manifest compacted already, or a small one written once).
    if disk_bytes(&fresh) * 10 > disk_bytes(dir) * 9 {
        std::fs::remove_dir_all(&fresh)
            .with_context(|| format!("removing the copy {}", fresh.display()))?;
        return Ok((records, false));
    }
    super::manifest::sync_new_folder(&fresh)?;
    // One step where the file system can: `manifest` names the original or the copy at every
    // instant, and the original, now named `manifest.compacting`, goes below.
    if !crate::durable::exchange(&fresh, dir).context("moving the copy into place")? {
        std::fs::rename(dir, aside_dir(dir)).context("setting the old manifest aside")?;
        if let Err(e) = std::fs::rename(&fresh, dir) {
            let _ = std::fs::rename(aside_dir(dir), dir);
            return Err(e).context("moving the copy into place");
        }
    }
    // The copy is in place: the original goes once the swap is durable (a state folder that
    // cannot be synced now keeps it, for the next open to remove).
    restore(dir);
    Ok((records, true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::manifest::{Manifest, ManifestBatch};
    use crate::engine::records::{ContentRecord, FileRecord, RowRef};

    fn path(i: u32) -> String {
        format!("LEAK/S{:03}~R{i}~20250118120530~100.wav", i % 97)
    }

    /// A manifest of `n` recordings written as the service writes them (a few at a time, in
    /// no order of their hashes), so that sled's log holds many rewritten pages; its records.
    fn written(dir: &Path, n: u32) -> Vec<(String, FileRecord)> {
        written_from(dir, 0, n)
    }

    fn written_from(dir: &Path, first: u32, n: u32) -> Vec<(String, FileRecord)> {
        let m = Manifest::open(dir).unwrap();
        for start in (first..n).step_by(20) {
            let mut b = ManifestBatch::default();
            for i in start..(start + 20).min(n) {
                let hash = *blake3::hash(&i.to_le_bytes()).as_bytes();
                let rec = FileRecord {
                    hash: Some(hash),
                    size: 81_964,
                    mtime_ns: 1_700_000_000_000_000_000 + i64::from(i),
                    quarantine: None,
                    updated_ms: 1_700_000_000_000,
                };
                b.put_file(&path(i), &rec);
                b.put_content(
                    &hash,
                    &ContentRecord {
                        row: Some(RowRef {
                            split: (i % 3) as u8,
                            row: u64::from(i),
                        }),
                        label: 0,
                        valid: true,
                        paths: vec![path(i)],
                    },
                );
            }
            b.put_rows(0, u64::from(start));
            m.apply(b).unwrap();
        }
        m.flush().unwrap();
        m.files().map(|r| r.unwrap()).collect()
    }

    type Contents = Vec<(crate::identity::Hash, ContentRecord)>;

    fn everything(dir: &Path) -> (Vec<(String, FileRecord)>, Contents, [u64; 3]) {
        let m = Manifest::open(dir).unwrap();
        let files = m.files().map(|r| r.unwrap()).collect();
        let contents = m.contents().map(|r| r.unwrap()).collect();
        (files, contents, m.rows().unwrap())
    }

    #[test]
    fn a_compacted_manifest_holds_the_same_records_in_less_space() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("manifest");
        let files = written(&dir, 20_000);
        let before = everything(&dir);
        assert_eq!(before.0, files);
        let size = disk_bytes(&dir);
        let done = compact(&dir).unwrap();
        assert_eq!(done.before, size);
        assert!(done.records >= 40_000 && done.swapped, "{done:?}");
        assert_eq!(everything(&dir), before);
        eprintln!("{size} bytes on disk, {} compacted", done.after);
        assert!(done.after < size * 3 / 4, "{done:?}");
        assert_eq!(done.after, disk_bytes(&dir));
        // Nothing left beside it.
        assert!(!fresh_dir(&dir).exists() && !aside_dir(&dir).exists());
        // Compacted again, it never grows (a copy is swapped in only when it saves a tenth).
        let again = compact(&dir).unwrap();
        assert!(again.after <= again.before, "{again:?}");
        assert_eq!(everything(&dir), before);
        assert!(!fresh_dir(&dir).exists() && !aside_dir(&dir).exists());
        // It takes new records as before.
        let more = written_from(&dir, 20_000, 20_100);
        assert_eq!(more.len(), 20_100);
    }

    /// A manifest written in one go (as `rebuild` writes one) is about as compact as a copy:
    /// it is kept, not replaced by a copy that saves next to nothing or takes more whole
    /// segments of sled's log (a kill audit saw `compact` grow a 2,500-recording manifest from
    /// 1.9 to 2.1 MB).
    #[test]
    fn a_manifest_no_copy_would_shrink_much_is_left_as_it_was() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("manifest");
        let m = Manifest::open(&dir).unwrap();
        let mut b = ManifestBatch::default();
        for i in 0..2_500u32 {
            let hash = *blake3::hash(&i.to_le_bytes()).as_bytes();
            let rec = FileRecord {
                hash: Some(hash),
                size: 81_964,
                mtime_ns: 1_700_000_000_000_000_000,
                quarantine: None,
                updated_ms: 1_700_000_000_000,
            };
            b.put_file(&path(i), &rec);
        }
        m.apply(b).unwrap();
        m.flush().unwrap();
        drop(m);
        let before = everything(&dir);
        let size = disk_bytes(&dir);
        let done = compact(&dir).unwrap();
        assert!(!done.swapped, "{done:?}");
        // Opening it may give back free segments of sled's log (the vendored punch): never more.
        assert_eq!(done.before, size);
        assert!(done.after <= size, "{done:?}");
        assert_eq!(everything(&dir), before);
        assert!(!fresh_dir(&dir).exists() && !aside_dir(&dir).exists());
    }

    #[test]
    fn a_failed_compaction_leaves_the_manifest_as_it_was() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("manifest");
        written(&dir, 3000);
        let before = everything(&dir);
        // The copy cannot be made: a file where its folder goes.
        std::fs::write(fresh_dir(&dir), b"in the way").unwrap();
        let e = compact(&dir).unwrap_err();
        assert!(
            format!("{e:#}").contains("not compacted, left as it was"),
            "{e:#}"
        );
        assert_eq!(everything(&dir), before);
        assert!(compact(&tmp.path().join("none")).is_err());
    }

    /// A cut between the two renames of the fallback swap leaves no `manifest`: the next open
    /// puts the original back; one after them leaves the original set aside, removed by the next
    /// open. A cut before the swap leaves an unfinished copy, removed too, and one right after an
    /// exchange the original under the copy's name, removed likewise.
    #[test]
    fn an_interrupted_swap_is_undone_or_finished_at_the_next_open() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("manifest");
        written(&dir, 500);
        let before = everything(&dir);
        let copy = |from: &Path, to: &Path| {
            std::fs::create_dir_all(to).unwrap();
            for e in std::fs::read_dir(from).unwrap() {
                let e = e.unwrap();
                if e.file_type().unwrap().is_file() {
                    std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
                }
            }
        };
        // Cut before the swap: a copy half made.
        copy(&dir, &fresh_dir(&dir));
        std::fs::write(fresh_dir(&dir).join("db"), b"half").unwrap();
        assert_eq!(everything(&dir), before);
        assert!(!fresh_dir(&dir).exists());
        // Cut right after the exchange: the original, complete, named as the copy was.
        copy(&dir, &fresh_dir(&dir));
        assert_eq!(everything(&dir), before);
        assert!(!fresh_dir(&dir).exists());
        // Cut between the fallback's renames: the original aside, the copy complete.
        copy(&dir, &fresh_dir(&dir));
        std::fs::rename(&dir, aside_dir(&dir)).unwrap();
        assert_eq!(everything(&dir), before);
        assert!(!fresh_dir(&dir).exists() && !aside_dir(&dir).exists());
        // Cut after them: the copy in place, the original still aside.
        copy(&dir, &aside_dir(&dir));
        assert_eq!(everything(&dir), before);
        assert!(!aside_dir(&dir).exists());
    }
}
