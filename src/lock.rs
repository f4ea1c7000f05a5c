//! One writer: an advisory lock (flock) on `<paths.state>/ailhd.lock`, held by `run` and
//! `rebuild` for their whole life. The kernel drops it when the process dies, so a crash never
//! leaves a stale lock behind.

use anyhow::{bail, Context};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

pub struct WriterLock {
    _file: File,
    path: PathBuf,
}

impl WriterLock {
    /// Take the lock for `role` ("run", "rebuild"), or say who holds it.
    pub fn acquire(state_dir: &Path, role: &str) -> anyhow::Result<WriterLock> {
        std::fs::create_dir_all(state_dir).with_context(|| {
            format!("cannot create the state directory {}", state_dir.display())
        })?;
        let path = state_dir.join("ailhd.lock");
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("cannot open the lock file {}", path.display()))?;
        // SAFETY: flock on a file descriptor we own; no memory is involved.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                bail!(
                    "another ailhd is writing to these outputs ({}; lock {}): only one `run` or `rebuild` at a time. Stop it first (e.g. `systemctl stop ailhd`)",
                    describe_holder(&holder),
                    path.display()
                );
            }
            return Err(err).with_context(|| format!("cannot lock {}", path.display()));
        }
        file.set_len(0)?;
        file.rewind()?;
        writeln!(file, "{} {}", std::process::id(), role)?;
        file.flush()?;
        Ok(WriterLock { _file: file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Who holds the lock right now, if anyone (for `status`).
    pub fn holder(state_dir: &Path) -> Option<String> {
        let path = state_dir.join("ailhd.lock");
        let mut file = File::open(&path).ok()?;
        // SAFETY: as above; a shared probe lock released at once.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
        if rc == 0 {
            unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
            return None;
        }
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        Some(describe_holder(&holder))
    }
}

fn describe_holder(text: &str) -> String {
    let mut it = text.split_whitespace();
    match (it.next(), it.next()) {
        (Some(pid), Some(role)) => format!("pid {pid}, `ailhd {role}`"),
        _ => "an unknown process".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_writer_is_refused_with_the_holder_named() {
        let dir = tempfile::tempdir().unwrap();
        let first = WriterLock::acquire(dir.path(), "run").unwrap();
        let err = WriterLock::acquire(dir.path(), "rebuild")
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("ailhd run") && err.contains(&std::process::id().to_string()),
            "{err}"
        );
        assert!(WriterLock::holder(dir.path()).is_some());
        drop(first);
        assert!(WriterLock::holder(dir.path()).is_none());
        WriterLock::acquire(dir.path(), "rebuild").unwrap();
    }
}
