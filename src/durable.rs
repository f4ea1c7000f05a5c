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

/// Swap what two paths name, in one step (Linux `renameat2` with `RENAME_EXCHANGE`): a reader
/// opening either path meanwhile finds the one or the other, never nothing. Works for files and
/// folders alike (rename() cannot replace a non-empty folder). `Ok(false)` where the file system
/// cannot exchange (it said EINVAL or EOPNOTSUPP, or the kernel lacks the call): nothing moved.
pub fn exchange(a: &Path, b: &Path) -> std::io::Result<bool> {
    use std::os::unix::ffi::OsStrExt;
    let a = std::ffi::CString::new(a.as_os_str().as_bytes())?;
    let b = std::ffi::CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: two NUL-terminated paths that outlive the call; the call reads nothing else.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS) => Ok(false),
        _ => Err(e),
    }
}

/// Make a folder's entries (names created, renamed or removed in it) durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exchange_swaps_a_file_and_a_folder_in_one_step() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, b"file").unwrap();
        std::fs::create_dir(&b).unwrap();
        std::fs::write(b.join("inside"), b"x").unwrap();
        // tempdir() is on /tmp: tmpfs and ext4 both exchange (Linux 3.15 and later).
        assert!(
            exchange(&a, &b).unwrap(),
            "this file system cannot exchange"
        );
        assert!(a.join("inside").is_file());
        assert_eq!(std::fs::read(&b).unwrap(), b"file");
        let missing = dir.path().join("missing");
        assert!(exchange(&a, &missing).is_err(), "exchanged with nothing");
        assert!(a.is_dir());
    }

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
