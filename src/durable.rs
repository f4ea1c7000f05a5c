//! Durable file writes: the one place that writes a whole file by replacing it (a temporary
//! file beside it, renamed over it, so a reader sees the old or the new bytes, never a part),
//! and syncs folders. Each caller says how durable the new file must be ([`Sync`]).

use std::io::Write;
use std::path::{Path, PathBuf};

/// How durable a replaced file is once [`replace`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sync {
    /// Atomic for readers, not across a power cut (status snapshots, rewritten every few
    /// seconds: a cut loses one, the next start writes another).
    None,
    /// The file's bytes are synced before the rename, and its folder after: both the new name
    /// and its bytes survive a power cut.
    Full,
}

/// The temporary name beside `path` (hidden, and unique to this process).
fn temporary(path: &Path) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

/// Replace `path` with `bytes` (see the module). On an error the old file is left as it was
/// and the temporary file is removed.
pub fn replace(path: &Path, bytes: &[u8], sync: Sync) -> std::io::Result<()> {
    let tmp = temporary(path);
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        if sync == Sync::Full {
            f.sync_all()?;
        }
        drop(f);
        std::fs::rename(&tmp, path)?;
        if sync == Sync::Full {
            sync_dir(
                path.parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .unwrap_or(Path::new(".")),
            )?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Make a folder's entries (names created, renamed or removed in it) durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_file_holds_the_new_bytes_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("status.json");
        for (bytes, sync) in [(&b"old"[..], Sync::Full), (&b"new bytes"[..], Sync::None)] {
            replace(&p, bytes, sync).unwrap();
            assert_eq!(std::fs::read(&p).unwrap(), bytes);
        }
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["status.json"]);
    }

    #[test]
    fn a_failed_replace_keeps_the_old_file_and_names_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.json");
        replace(&p, b"old", Sync::Full).unwrap();
        // A folder where the new file would go: the rename fails.
        let blocked = dir.path().join("d");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("inside"), b"").unwrap();
        assert!(replace(&blocked, b"new", Sync::Full).is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        let tmps = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".tmp")
            })
            .count();
        assert_eq!(tmps, 0);
        assert!(replace(&dir.path().join("no/such/folder.json"), b"x", Sync::None).is_err());
    }
}
