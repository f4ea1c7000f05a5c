//! One writer per output folder and per state folder: an advisory lock (flock) on
//! `<paths.state>/ailhd.lock` and on `<paths.output>/.ailhd.lock`, held by `run` and `rebuild`
//! for their whole life. A second writer sharing either folder with a running one is refused
//! with the holder's pid and role. The kernel drops a lock when its process dies, so a crash
//! never leaves a stale lock behind.

use crate::config::Settings;
use anyhow::{bail, Context};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Lock file inside `paths.state`.
pub const STATE_LOCK: &str = "ailhd.lock";
/// Lock file inside `paths.output` (hidden: readers list the output folder).
pub const OUTPUT_LOCK: &str = ".ailhd.lock";

pub struct WriterLock {
    _file: File,
    path: PathBuf,
}

/// The locks a writer (`run`, `rebuild`) holds: the state folder's and the output folder's.
pub struct WriterLocks {
    _locks: Vec<WriterLock>,
}

/// How long a writer waits for a lock held by someone else before it says who holds it: longer
/// than any probe of the lock (a shared lock taken and released at once), short enough for a
/// refused writer to answer at once.
const PROBE_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

impl WriterLocks {
    /// Take both locks for `role` ("run", "rebuild"), or say who holds one of them. Folders that
    /// exist are locked before missing ones are created, so a refused writer creates nothing
    /// beside a folder another writer holds.
    pub fn acquire(settings: &Settings, role: &str) -> anyhow::Result<WriterLocks> {
        let mut wanted = vec![
            (&settings.paths.state, STATE_LOCK, "paths.state"),
            (&settings.paths.output, OUTPUT_LOCK, "paths.output"),
        ];
        // Same folder twice (state = output): the two lock files differ, both are taken.
        wanted.sort_by_key(|(dir, _, _)| !dir.is_dir());
        let mut locks = Vec::new();
        for (dir, name, key) in wanted {
            locks.push(WriterLock::acquire_file(dir, name, key, role)?);
        }
        Ok(WriterLocks { _locks: locks })
    }
}

impl WriterLock {
    /// Take the state folder's lock for `role` ("run", "rebuild"), or say who holds it.
    pub fn acquire(state_dir: &Path, role: &str) -> anyhow::Result<WriterLock> {
        Self::acquire_file(state_dir, STATE_LOCK, "paths.state", role)
    }

    fn acquire_file(dir: &Path, name: &str, key: &str, role: &str) -> anyhow::Result<WriterLock> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the {key} folder {}", dir.display()))?;
        let path = dir.join(name);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("cannot open the lock file {}", path.display()))?;
        // A writer holds the lock for as long as it runs; `status`, `check-config` and
        // `reload` hold it shared for a moment to see whether one does. A lock still held after
        // PROBE_WAIT is a writer's.
        let started = std::time::Instant::now();
        let rc = loop {
            // SAFETY: flock on a file descriptor we own; no memory is involved.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            let busy = rc != 0
                && std::io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK);
            if !busy || started.elapsed() >= PROBE_WAIT {
                break rc;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                bail!(
                    "another ailhd is writing to the {key} folder {}: {} is held by {}. Only one `run` or `rebuild` per output folder and per state folder; stop it first (e.g. `systemctl stop ailhd`)",
                    dir.display(),
                    path.display(),
                    describe_holder(&read_holder(&mut file)),
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

    /// Who holds the state lock right now, if anyone (for `status`).
    pub fn holder(state_dir: &Path) -> Option<String> {
        Self::holder_of(state_dir).map(|(described, _)| described)
    }

    /// The pid of the process holding the state lock, if any.
    pub fn holder_pid(state_dir: &Path) -> Option<u32> {
        Self::holder_info(state_dir).map(|(pid, _)| pid)
    }

    /// Pid and role ("run", "rebuild") of the state lock's holder, if any (for `ailhd reload`).
    pub fn holder_info(state_dir: &Path) -> Option<(u32, String)> {
        let (_, pid, role) = Self::holder_described(state_dir)?;
        Some((pid?, role))
    }

    /// The state lock's holder, if any: its description ("pid N (ailhd run)"), pid and role.
    pub fn holder_described(state_dir: &Path) -> Option<(String, Option<u32>, String)> {
        let (described, text) = Self::holder_of(state_dir)?;
        let mut it = text.split_whitespace();
        let pid = it.next().and_then(|p| p.parse().ok());
        Some((described, pid, it.next().unwrap_or("").to_string()))
    }

    /// (description, raw "pid role" text) of the state lock's holder.
    fn holder_of(dir: &Path) -> Option<(String, String)> {
        let mut file = File::open(dir.join(STATE_LOCK)).ok()?;
        // SAFETY: as above; a shared probe lock released at once.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
        if rc == 0 {
            unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
            return None;
        }
        let text = read_holder(&mut file);
        Some((describe_holder(&text), text))
    }
}

/// The lock file's "pid role" line. A holder that has just taken the lock may not have written
/// it yet (the file is empty, or still names the previous holder, whose process is gone): look
/// again for a moment.
fn read_holder(file: &mut File) -> String {
    let mut text = String::new();
    for _ in 0..20 {
        text.clear();
        let _ = file.rewind();
        let _ = file.read_to_string(&mut text);
        let pid = text.split_whitespace().next().and_then(|p| p.parse().ok());
        if pid.is_some_and(alive) {
            return text;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    text
}

/// Whether a process with this pid exists (one of another user's included).
fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists; nothing is sent.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

fn describe_holder(text: &str) -> String {
    let mut it = text.split_whitespace();
    match (it.next(), it.next()) {
        (Some(pid), Some(role)) => format!("pid {pid} (ailhd {role})"),
        _ => "an unknown process".to_string(),
    }
}

/// Whether any process holds the lock file `dir/name` now (a probe; takes nothing).
pub fn is_held(dir: &Path, name: &str) -> bool {
    let Ok(file) = File::open(dir.join(name)) else {
        return false;
    };
    // SAFETY: as above; a shared probe lock released at once.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
    if rc == 0 {
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
        return false;
    }
    true
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
        let pid = std::process::id();
        assert!(
            err.contains(&format!("is held by pid {pid} (ailhd run)")),
            "{err}"
        );
        assert_eq!(WriterLock::holder_pid(dir.path()), Some(pid));
        assert!(WriterLock::holder(dir.path()).is_some());
        drop(first);
        assert!(WriterLock::holder(dir.path()).is_none());
        WriterLock::acquire(dir.path(), "rebuild").unwrap();
    }

    /// `status` probing the lock (a shared lock for a moment) as a writer starts does not turn
    /// the writer away (a kill audit saw one refused, naming the pid of a writer long gone).
    #[test]
    fn a_writer_waits_out_a_probe_of_its_lock() {
        let dir = tempfile::tempdir().unwrap();
        drop(WriterLock::acquire(dir.path(), "run").unwrap());
        let probe = File::open(dir.path().join(STATE_LOCK)).unwrap();
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(unsafe { libc::flock(probe.as_raw_fd(), libc::LOCK_SH) }, 0);
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(100));
            drop(probe);
        });
        WriterLock::acquire(dir.path(), "rebuild").unwrap();
        release.join().unwrap();
    }

    #[test]
    fn both_folders_are_locked_and_either_one_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = Settings::default();
        a.paths.output = dir.path().join("out");
        a.paths.state = dir.path().join("state");
        let held = WriterLocks::acquire(&a, "run").unwrap();
        assert!(is_held(&a.paths.output, OUTPUT_LOCK) && is_held(&a.paths.state, STATE_LOCK));
        let mut same_out = a.clone();
        same_out.paths.state = dir.path().join("state2");
        let err = WriterLocks::acquire(&same_out, "rebuild")
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("paths.output") && err.contains("(ailhd run)"),
            "{err}"
        );
        let mut same_state = a.clone();
        same_state.paths.output = dir.path().join("out2");
        let err = WriterLocks::acquire(&same_state, "rebuild")
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("paths.state") && err.contains("(ailhd run)"),
            "{err}"
        );
        // The existing, held folder is tried first: the missing one is not created.
        assert!(!same_state.paths.output.exists());
        drop(held);
        assert!(!is_held(&a.paths.output, OUTPUT_LOCK));
        // One folder for both: two lock files, both taken by the one writer.
        let mut one = a.clone();
        one.paths.output = one.paths.state.clone();
        let _both = WriterLocks::acquire(&one, "run").unwrap();
    }
}
