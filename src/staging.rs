//! Swap-in of a rebuild: new outputs and manifest are built beside the old ones, then moved into
//! place by a roll-forward journal (`<state>/swap.pending`). A rebuild interrupted before the
//! journal exists leaves the old outputs untouched (its staging is removed by the next `run`,
//! `rebuild` or `check-config`: [`remove_stale`]); one interrupted during the swap is finished
//! by the next `rebuild` or `run`.

use crate::config::{Settings, SPLITS};
use crate::output::{hdf5_path, npy_dir};
use anyhow::Context;
use std::path::{Path, PathBuf};

const STAGING_DIR: &str = ".ailhd-staging";

pub fn output_staging(settings: &Settings) -> PathBuf {
    settings.paths.output.join(STAGING_DIR)
}

pub fn manifest_dir(settings: &Settings) -> PathBuf {
    settings.paths.state.join("manifest")
}

pub fn manifest_staging(settings: &Settings) -> PathBuf {
    settings.paths.state.join("manifest.staging")
}

fn journal(settings: &Settings) -> PathBuf {
    settings.paths.state.join("swap.pending")
}

/// (staged, final) pairs: every output file or folder, then the manifest last, so a manifest
/// in place always describes outputs already in place.
fn moves(settings: &Settings) -> Vec<(PathBuf, PathBuf)> {
    let stage = output_staging(settings);
    let out = &settings.paths.output;
    let mut v = Vec::new();
    for split in 0..SPLITS.len() {
        v.push((
            hdf5_path(&stage, &settings.outputs.hdf5_names, split),
            hdf5_path(out, &settings.outputs.hdf5_names, split),
        ));
        v.push((npy_dir(&stage, split), npy_dir(out, split)));
    }
    v.push((manifest_staging(settings), manifest_dir(settings)));
    v
}

/// Clear leftovers of an interrupted rebuild (never the journal's business: call
/// [`finish_pending`] first) and prepare empty staging places.
pub fn prepare(settings: &Settings) -> anyhow::Result<()> {
    discard(settings)?;
    std::fs::create_dir_all(output_staging(settings))
        .with_context(|| format!("cannot create {}", output_staging(settings).display()))?;
    Ok(())
}

/// Staged outputs are complete: record the intent, then move everything into place.
pub fn swap_in(settings: &Settings) -> anyhow::Result<()> {
    // Staging outputs are made without syncs (their close syncs their contents and
    // their npy folders): the folder entries that name them are made durable here, before the
    // journal makes them the outputs.
    let staged = output_staging(settings);
    for dir in [staged.join("npy"), staged] {
        if dir.is_dir() {
            sync_dir(&dir);
        }
    }
    write_journal(settings)?;
    finish_pending(settings)
}

/// The journal survives a power cut (its bytes, then the state folder, synced) before anything
/// moves. It names what is staged by identity, which tells a roll-forward whether a staged path
/// still holds the new output or, exchanged, the old one.
fn write_journal(settings: &Settings) -> anyhow::Result<()> {
    let mut text = b"rebuild swap in progress\n".to_vec();
    for (staged, _) in moves(settings) {
        if let Some((dev, ino)) = identity(&staged) {
            text.extend_from_slice(format!("{dev}:{ino} ").as_bytes());
            text.extend_from_slice(staged.as_os_str().as_encoded_bytes());
            text.push(b'\n');
        }
    }
    crate::durable::replace(&journal(settings), &text, crate::durable::Sync::Full)?;
    Ok(())
}

/// A path's (device, inode): what stays with a file or folder when it is renamed or exchanged.
fn identity(p: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    p.symlink_metadata().ok().map(|m| (m.dev(), m.ino()))
}

/// The staged paths a journal names, with their identities when the swap began. Empty for a
/// journal an older version wrote: its swap never exchanged, so a staged path that is there
/// still holds the new output.
fn journal_identities(j: &Path) -> std::collections::HashMap<Vec<u8>, (u64, u64)> {
    let text = std::fs::read(j).unwrap_or_default();
    text.split(|&b| b == b'\n')
        .filter_map(|line| {
            let space = line.iter().position(|&b| b == b' ')?;
            let (id, path) = (
                std::str::from_utf8(&line[..space]).ok()?,
                &line[space + 1..],
            );
            let (dev, ino) = id.split_once(':')?;
            Some((path.to_vec(), (dev.parse().ok()?, ino.parse().ok()?)))
        })
        .collect()
}

/// Move `staged` to `fin`, and the output `fin` named to `old`. Where the file system can, the
/// two are exchanged in one step, so `fin` names the old or the new output at every instant
/// (a reader opening it never finds nothing), and the old one is then renamed `old`. Otherwise
/// (a file system without exchange) the old one is renamed `old` first, leaving `fin` missing
/// for the moment until the second rename. Returns whether something was set aside.
fn put_in_place(staged: &Path, fin: &Path, old: &Path) -> anyhow::Result<bool> {
    // Test builds (feature `failpoints`): `FAILPOINTS=swap-move=return` stops the process in
    // the middle of the first move, as a kill would (tests/cli.rs).
    let fail_point = || {
        #[cfg(feature = "failpoints")]
        fail::fail_point!("swap-move", |_| {
            log::error!(
                "fail point swap-move: aborting while moving {}",
                fin.display()
            );
            std::process::abort()
        });
    };
    if fin.symlink_metadata().is_err() {
        std::fs::rename(staged, fin)
            .with_context(|| format!("cannot move {} into place", staged.display()))?;
        return Ok(false);
    }
    let exchanged = exchange(staged, fin)
        .with_context(|| format!("cannot move {} into place", staged.display()))?;
    if exchanged {
        fail_point();
        std::fs::rename(staged, old)
            .with_context(|| format!("cannot move the old {} aside", fin.display()))?;
    } else {
        std::fs::rename(fin, old)
            .with_context(|| format!("cannot move {} aside", fin.display()))?;
        fail_point();
        std::fs::rename(staged, fin)
            .with_context(|| format!("cannot move {} into place", staged.display()))?;
    }
    Ok(true)
}

/// [`crate::durable::exchange`]. Test builds (feature `failpoints`):
/// `FAILPOINTS=swap-no-exchange=return` plays a file system that cannot exchange.
fn exchange(a: &Path, b: &Path) -> std::io::Result<bool> {
    #[cfg(feature = "failpoints")]
    fail::fail_point!("swap-no-exchange", |_| Ok(false));
    crate::durable::exchange(a, b)
}

/// A rebuild stopped while it moved its outputs into place: some are the new ones, some the
/// old ones, until `run` or `rebuild` rolls the swap forward. What to tell the user then (None:
/// no swap pending).
pub fn swap_pending(settings: &Settings) -> Option<String> {
    let j = journal(settings);
    j.exists().then(|| {
        format!(
            "a rebuild stopped while it moved its outputs into place ({}): `ailhd run` (the \
             service's start) or `ailhd rebuild` finishes that first",
            j.display()
        )
    })
}

/// Roll forward a swap whose journal exists. Idempotent: each move checks what is left.
pub fn finish_pending(settings: &Settings) -> anyhow::Result<()> {
    let j = journal(settings);
    if !j.exists() {
        return Ok(());
    }
    let recorded = journal_identities(&j);
    // The replaced outputs are moved aside, and removed together once everything is in place:
    // removing them frees their pages, the larger part of a swap, and the files go in parallel.
    let mut aside = Vec::new();
    let mut parents = std::collections::BTreeSet::new();
    for (staged, fin) in moves(settings) {
        let old = aside_path(&fin);
        let Some(now) = identity(&staged) else {
            // Already moved; its predecessor may still be aside after a crash.
            if old.symlink_metadata().is_ok() {
                aside.push(old);
            }
            continue;
        };
        // remove_any: an `old` left by an earlier stop is not this swap's to keep.
        remove_any(&old)?;
        let key = staged.as_os_str().as_encoded_bytes();
        if recorded.get(key).is_some_and(|&id| id != now) {
            // Exchanged, then stopped: the staged path holds the output it replaced.
            std::fs::rename(&staged, &old)
                .with_context(|| format!("cannot move the old {} aside", fin.display()))?;
            aside.push(old);
        } else {
            if let Some(parent) = fin.parent() {
                std::fs::create_dir_all(parent)?;
            }
            if put_in_place(&staged, &fin, &old)? {
                aside.push(old);
            }
        }
        parents.extend(fin.parent().map(Path::to_path_buf));
    }
    for parent in &parents {
        sync_dir(parent);
    }
    std::thread::scope(|scope| {
        let removals: Vec<_> = aside
            .iter()
            .map(|old| scope.spawn(move || remove_any(old)))
            .collect();
        removals
            .into_iter()
            .try_for_each(|r| r.join().expect("removing an old output panicked"))
    })?;
    remove_any(&output_staging(settings))?;
    std::fs::remove_file(&j).with_context(|| format!("cannot remove {}", j.display()))?;
    sync_dir(&settings.paths.state);
    Ok(())
}

/// Remove what a killed `rebuild` left behind (`.ailhd-staging/` under the output folder, the
/// staged manifest), when no writer holds either folder. Takes nothing and creates nothing: the
/// existing lock files are probed (and held during the removal) through read-only descriptors,
/// so `check-config` run by another user cannot leave a lock file the service cannot open.
/// A staged swap whose journal exists is complete and is left for the roll-forward.
/// Returns the paths removed.
pub fn remove_stale(settings: &Settings) -> anyhow::Result<Vec<PathBuf>> {
    let leftovers: Vec<PathBuf> = [output_staging(settings), manifest_staging(settings)]
        .into_iter()
        .filter(|p| p.symlink_metadata().is_ok())
        .collect();
    if leftovers.is_empty() || journal(settings).exists() {
        return Ok(Vec::new());
    }
    let mut probes = Vec::new();
    for lock in [
        settings.paths.state.join(crate::lock::STATE_LOCK),
        settings.paths.output.join(crate::lock::OUTPUT_LOCK),
    ] {
        let Ok(f) = std::fs::File::open(&lock) else {
            continue;
        };
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a descriptor we own; released when `probes` is dropped.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Ok(Vec::new()); // a writer is at work: its staging is not stale
        }
        probes.push(f);
    }
    for p in &leftovers {
        remove_any(p)?;
    }
    Ok(leftovers)
}

/// Remove the staging outputs and manifest (a rebuild's leftovers, or its own when it stops
/// before its swap), holding the writer locks.
pub fn discard(settings: &Settings) -> anyhow::Result<()> {
    for p in [output_staging(settings), manifest_staging(settings)] {
        remove_any(&p)?;
    }
    Ok(())
}

/// Where a replaced output waits for its removal: its name + `.old`.
fn aside_path(fin: &Path) -> PathBuf {
    let mut name = fin.as_os_str().to_os_string();
    name.push(".old");
    PathBuf::from(name)
}

fn remove_any(p: &Path) -> anyhow::Result<()> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => {
            std::fs::remove_dir_all(p).with_context(|| format!("cannot remove {}", p.display()))
        }
        Ok(_) => std::fs::remove_file(p).with_context(|| format!("cannot remove {}", p.display())),
        Err(_) => Ok(()),
    }
}

fn sync_dir(p: &Path) {
    let _ = crate::durable::sync_dir(p);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_staging_is_removed_only_without_a_writer_and_without_a_journal() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        assert!(remove_stale(&s).unwrap().is_empty());
        std::fs::create_dir_all(output_staging(&s).join("npy")).unwrap();
        std::fs::create_dir_all(manifest_staging(&s)).unwrap();
        {
            let _writer = crate::lock::WriterLocks::acquire(&s, "rebuild").unwrap();
            assert!(remove_stale(&s).unwrap().is_empty());
            assert!(output_staging(&s).exists());
        }
        std::fs::write(journal(&s), b"x").unwrap();
        assert!(remove_stale(&s).unwrap().is_empty());
        std::fs::remove_file(journal(&s)).unwrap();
        assert_eq!(remove_stale(&s).unwrap().len(), 2);
        assert!(!output_staging(&s).exists() && !manifest_staging(&s).exists());
        // Nothing was created: the lock files are the writer's, from above.
        assert!(s.paths.output.join(crate::lock::OUTPUT_LOCK).exists());
    }

    #[test]
    fn swap_moves_staged_outputs_over_old_ones_and_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        std::fs::create_dir_all(npy_dir(&s.paths.output, 0)).unwrap();
        std::fs::write(npy_dir(&s.paths.output, 0).join("labels.npy"), b"old").unwrap();
        std::fs::write(hdf5_path(&s.paths.output, &s.outputs.hdf5_names, 0), b"old").unwrap();
        std::fs::create_dir_all(manifest_dir(&s)).unwrap();
        prepare(&s).unwrap();
        let stage = output_staging(&s);
        std::fs::create_dir_all(npy_dir(&stage, 0)).unwrap();
        std::fs::write(npy_dir(&stage, 0).join("labels.npy"), b"new").unwrap();
        std::fs::write(hdf5_path(&stage, &s.outputs.hdf5_names, 0), b"new").unwrap();
        std::fs::create_dir_all(manifest_staging(&s)).unwrap();
        std::fs::write(manifest_staging(&s).join("db"), b"new").unwrap();

        // Without the journal nothing moves (an interrupted rebuild changes nothing).
        finish_pending(&s).unwrap();
        assert_eq!(
            std::fs::read(hdf5_path(&s.paths.output, &s.outputs.hdf5_names, 0)).unwrap(),
            b"old"
        );

        swap_in(&s).unwrap();
        assert_eq!(
            std::fs::read(hdf5_path(&s.paths.output, &s.outputs.hdf5_names, 0)).unwrap(),
            b"new"
        );
        assert_eq!(
            std::fs::read(npy_dir(&s.paths.output, 0).join("labels.npy")).unwrap(),
            b"new"
        );
        assert_eq!(std::fs::read(manifest_dir(&s).join("db")).unwrap(), b"new");
        assert!(!stage.exists() && !journal(&s).exists());
        for (_, fin) in moves(&s) {
            assert!(!aside_path(&fin).exists(), "{} left aside", fin.display());
        }
        // A journal left by a crash after the moves: rolling forward again changes nothing.
        std::fs::write(journal(&s), b"x").unwrap();
        finish_pending(&s).unwrap();
        assert_eq!(
            std::fs::read(npy_dir(&s.paths.output, 0).join("labels.npy")).unwrap(),
            b"new"
        );
    }

    /// A crash between an exchange and the rename that sets the old output aside: the staged
    /// path holds the old output, the output's path the new one. Rolling forward keeps the new
    /// one in place (an exchange again would bring the old one back).
    #[test]
    fn swap_rolls_forward_from_a_crash_right_after_an_exchange() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        prepare(&s).unwrap();
        std::fs::create_dir_all(&s.paths.state).unwrap();
        let stage = output_staging(&s);
        let (h0, staged_h0) = (
            hdf5_path(&s.paths.output, &s.outputs.hdf5_names, 0),
            hdf5_path(&stage, &s.outputs.hdf5_names, 0),
        );
        let (n0, staged_n0) = (npy_dir(&s.paths.output, 0), npy_dir(&stage, 0));
        for (path, npy, bytes) in [(&h0, &n0, b"old"), (&staged_h0, &staged_n0, b"new")] {
            std::fs::write(path, bytes).unwrap();
            std::fs::create_dir_all(npy).unwrap();
            std::fs::write(npy.join("labels.npy"), bytes).unwrap();
        }
        write_journal(&s).unwrap();
        assert!(crate::durable::exchange(&staged_h0, &h0).unwrap());
        assert!(crate::durable::exchange(&staged_n0, &n0).unwrap());

        finish_pending(&s).unwrap();
        assert_eq!(std::fs::read(&h0).unwrap(), b"new");
        assert_eq!(std::fs::read(n0.join("labels.npy")).unwrap(), b"new");
        for (_, fin) in moves(&s) {
            assert!(!aside_path(&fin).exists(), "{} left aside", fin.display());
        }
        assert!(!stage.exists() && !journal(&s).exists());
    }

    /// A crash in the middle of a swap: one output moved aside and not yet replaced, another
    /// replaced with its predecessor still aside. Rolling forward puts every staged output in
    /// place and removes what was aside.
    #[test]
    fn swap_rolls_forward_from_a_crash_between_its_moves() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        prepare(&s).unwrap();
        let stage = output_staging(&s);
        let h0 = hdf5_path(&s.paths.output, &s.outputs.hdf5_names, 0);
        let h1 = hdf5_path(&s.paths.output, &s.outputs.hdf5_names, 1);
        // Split 0: moved aside, the staged file not moved in yet.
        std::fs::write(aside_path(&h0), b"old").unwrap();
        std::fs::write(hdf5_path(&stage, &s.outputs.hdf5_names, 0), b"new").unwrap();
        // Split 1: moved in, its predecessor still aside.
        std::fs::write(&h1, b"new").unwrap();
        std::fs::write(aside_path(&h1), b"old").unwrap();
        std::fs::create_dir_all(aside_path(&npy_dir(&s.paths.output, 2))).unwrap();
        std::fs::create_dir_all(&s.paths.state).unwrap();
        std::fs::write(journal(&s), b"x").unwrap();

        finish_pending(&s).unwrap();
        assert_eq!(std::fs::read(&h0).unwrap(), b"new");
        assert_eq!(std::fs::read(&h1).unwrap(), b"new");
        for (_, fin) in moves(&s) {
            assert!(!aside_path(&fin).exists(), "{} left aside", fin.display());
        }
        assert!(!journal(&s).exists());
    }
}
