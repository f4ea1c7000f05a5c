//! Source: where recordings come from, and the one rule for what a recording is. A recording
//! is a regular file named `*.wav` (any case) under `paths.recordings`, reached without
//! following a symbolic link, whose path is valid UTF-8. A `*.wav` that is a symbolic link, a
//! named pipe, a socket or a device, or whose path is not UTF-8, is *rejected* (quarantined
//! with that reason, never opened), never skipped silently.
//!
//! [`scan`] lists the tree for `rebuild` and the service's reconcile; [`watch`] follows it with
//! inotify; [`settle`] decides when a touched file is complete, from [`probe`], which reads the
//! size and a bounded part of the header (never the whole file).

pub mod listing;
pub mod settle;
pub mod watch;

use crate::decode::{self, DecodeError};
use crate::engine::outcome::Reason;
pub use listing::{Item, Listing};
use settle::Probe;
use std::fs::{File, FileType};
use std::path::{Path, PathBuf};

/// What the source found at a path.
#[derive(Debug, Clone, PartialEq)]
pub enum Found {
    Recording(String),
    /// A `*.wav` path that is not a recording; `rel` has `\xNN` escapes when the path is not
    /// UTF-8 ([`crate::identity::rel_key`]).
    Rejected {
        rel: String,
        reason: Reason,
    },
}

impl Found {
    pub fn rel(&self) -> &str {
        match self {
            Found::Recording(r) | Found::Rejected { rel: r, .. } => r,
        }
    }
}

/// True for `*.wav`, any case, on the raw name bytes.
pub fn is_wav_name(name: &[u8]) -> bool {
    name.len() > 4 && name[name.len() - 4..].eq_ignore_ascii_case(b".wav")
}

/// The rule, for a path relative to the root and what `lstat` says of it. None: not ours (a
/// folder, another kind of file, another name).
pub fn classify(rel: &Path, file_type: FileType) -> Option<Found> {
    let name = rel.file_name()?.as_encoded_bytes();
    if !is_wav_name(name) {
        return None;
    }
    if file_type.is_symlink() {
        return Some(Found::Rejected {
            rel: crate::identity::rel_key(rel),
            reason: Reason::SymbolicLink,
        });
    }
    if !file_type.is_file() {
        return not_a_file(file_type).map(|what| Found::Rejected {
            rel: crate::identity::rel_key(rel),
            reason: Reason::NotAFile(what),
        });
    }
    Some(match crate::identity::rel_string(rel) {
        Ok(s) => Found::Recording(s),
        Err(_) => Found::Rejected {
            rel: crate::identity::rel_key(rel),
            reason: Reason::NotUtf8,
        },
    })
}

/// What a `*.wav` that is neither a regular file, a folder nor a link is, in words (None for
/// those three).
fn not_a_file(file_type: FileType) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    Some(if file_type.is_fifo() {
        "a named pipe (FIFO)"
    } else if file_type.is_socket() {
        "a socket"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else {
        return None;
    })
}

/// The rule applied to a path the watcher reported (None: gone again, or not ours).
pub fn classify_path(root: &Path, rel: &Path) -> Option<Found> {
    let meta = std::fs::symlink_metadata(root.join(rel)).ok()?;
    classify(rel, meta.file_type())
}

/// Every recording (and rejected `*.wav`) under `root`, sorted by relative path.
///
/// One `readdir` pass: entries are told apart by the type the listing gives (no `stat`, no
/// link followed), and relative paths are built as strings folder by folder (what [`classify`]
/// decides, without its per-path parsing: 200,000 recordings are listed in a fraction of the
/// time). The listing keeps its paths in a few large pieces of text ([`Listing`]).
pub fn scan(root: &Path) -> anyhow::Result<Listing> {
    scan_on(root, 4)
}

/// [`scan`] on at most `threads` threads (and the cores the process may use).
pub fn scan_on(root: &Path, threads: usize) -> anyhow::Result<Listing> {
    anyhow::ensure!(
        root.exists(),
        "the recordings folder {} is not there (is its disk mounted?)",
        root.display()
    );
    anyhow::ensure!(
        root.is_dir(),
        "paths.recordings = {} is not a folder (set it in the configuration)",
        root.display()
    );
    let (mut found, mut folders) = (Listing::default(), Vec::new());
    scan_folder(
        root,
        &mut String::new(),
        true,
        &mut found,
        Some(&mut folders),
    );
    // The top folders (one per label) are listed side by side, each sorted on its thread; the
    // largest listing takes the others' entries (their text is not copied), and the stable sort
    // then only merges the sorted runs.
    let mut lists = scan_folders(&folders, threads);
    lists.push(found);
    let largest = (0..lists.len())
        .max_by_key(|&i| lists[i].len())
        .unwrap_or(0);
    let mut found = lists.swap_remove(largest);
    for list in lists {
        found.append(list);
    }
    found.sort();
    Ok(found)
}

/// A folder whose listing was left for later: (path, relative path ending with `/`, UTF-8).
type Deferred = (PathBuf, String, bool);

/// Lists each of `folders` (and what is below it), on up to `threads` threads (no more than the
/// process may use); each listing sorted.
fn scan_folders(folders: &[Deferred], threads: usize) -> Vec<Listing> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores.min(threads).min(folders.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut lists: Vec<(usize, Listing)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(crate::pace::with_this_gate(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((dir, rel, utf8)) = folders.get(i) else {
                            return done;
                        };
                        let mut list = Listing::default();
                        scan_folder(dir, &mut rel.clone(), *utf8, &mut list, None);
                        list.sort();
                        done.push((i, list));
                    }
                }))
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a listing thread panicked"))
            .collect()
    });
    lists.sort_unstable_by_key(|(i, _)| *i);
    lists.into_iter().map(|(_, list)| list).collect()
}

/// Lists `dir` (relative path `rel`, ending with `/` unless empty; `utf8`: every folder name
/// on the way is valid UTF-8) into `found`, and its sub-folders in turn (or, with `defer`,
/// leaves them there for [`scan_folders`]).
fn scan_folder(
    dir: &Path,
    rel: &mut String,
    utf8: bool,
    found: &mut Listing,
    mut defer: Option<&mut Vec<Deferred>>,
) {
    // A folder that cannot be listed (no permission, an I/O error) is said, and kept in the
    // listing's `unlisted`: what is below it is not there to the listing, not gone.
    let unlisted = |found: &mut Listing, rel: &str, e: std::io::Error| {
        log::warn!(
            "cannot list {}: {e}; the recordings under it are not looked at (the service user \
             must be able to read every folder under paths.recordings)",
            dir.display()
        );
        found.push_unlisted(rel, e.to_string());
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        // Gone since its parent was listed: as if it had not been there.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => return unlisted(found, rel, e),
    };
    let base = rel.len();
    for entry in entries {
        if crate::pace::give_way().is_err() {
            return; // the comparison that asked for this listing ends without it
        }
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                rel.truncate(base);
                return unlisted(found, rel, e);
            }
        };
        // The type from the listing (d_type); std asks lstat only where a file system gives none.
        let Ok(file_type) = entry.file_type() else {
            continue;
        };
        let name = entry.file_name();
        let name_utf8 = name.to_str();
        rel.truncate(base);
        match name_utf8 {
            Some(n) => rel.push_str(n),
            None => crate::identity::push_escaped(rel, name.as_encoded_bytes()),
        }
        let utf8 = utf8 && name_utf8.is_some();
        if file_type.is_dir() {
            rel.push('/');
            match defer.as_deref_mut() {
                Some(later) => later.push((entry.path(), rel.clone(), utf8)),
                None => scan_folder(&entry.path(), rel, utf8, found, None),
            }
            continue;
        }
        if !is_wav_name(name.as_encoded_bytes()) {
            // A link to a folder is not followed either: said, so that the recordings behind
            // it are not skipped in silence (at each listing: every start and rescan).
            if file_type.is_symlink() && std::fs::metadata(entry.path()).is_ok_and(|m| m.is_dir()) {
                log::warn!(
                    "{}: a symbolic link to a folder, not followed: the recordings under it are \
                     not ingested (put the folder itself in the tree)",
                    entry.path().display()
                );
            }
            continue;
        }
        if file_type.is_symlink() {
            found.push_rejected(rel, Reason::SymbolicLink);
        } else if file_type.is_file() {
            match utf8 {
                true => found.push_recording(rel),
                false => found.push_rejected(rel, Reason::NotUtf8),
            }
        } else if let Some(what) = not_a_file(file_type) {
            found.push_rejected(rel, Reason::NotAFile(what));
        }
    }
    rel.truncate(base);
}

/// What the settle stage needs to know about a file now: size, mtime, and whether its header
/// agrees with the size. Reads the chunk headers, the fmt chunk and a few bytes around the end
/// of the audio (what [`decode::parse_header`] looks at), not the audio. A file that cannot be
/// opened or read is reported consistent: the engine reads it and quarantines it with the error.
pub fn probe(root: &Path, rel: &Path) -> Probe {
    let path = root.join(rel);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Probe::Missing,
        Err(_) => {
            return match std::fs::symlink_metadata(&path) {
                Ok(meta) => Probe::Present {
                    size: meta.len(),
                    mtime: meta.modified().unwrap_or(std::time::UNIX_EPOCH),
                    header: Ok(()),
                    held_for_writing: None,
                },
                Err(_) => Probe::Missing,
            }
        }
    };
    let Ok(meta) = file.metadata() else {
        return Probe::Missing;
    };
    Probe::Present {
        size: meta.len(),
        mtime: meta.modified().unwrap_or(std::time::UNIX_EPOCH),
        header: header_of(&file, meta.len()).unwrap_or(Ok(())),
        held_for_writing: held_for_writing(&file),
    }
}

/// Whether a process on this host holds `file` open for writing, where the kernel says so:
/// Linux refuses a read lease (`F_SETLEASE`, `F_RDLCK`) with EAGAIN while any descriptor open
/// for writing exists. Some(true) then; Some(false) when the lease was granted (and released at
/// once); None where leases cannot be taken (another user's file without CAP_LEASE, which the
/// unit grants; a file system without leases). Only Some(true) is relied on: a writer on another
/// host of a network file system is not counted, so a granted lease proves nothing.
///
/// A writer that opens the file in the microseconds the lease is held waits for its release,
/// and the kernel signals this process (SIGIO, which `ailhd run` ignores: see
/// [`crate::service::run`]).
pub fn held_for_writing(file: &File) -> Option<bool> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function borrows; a lease is released before return.
    match unsafe { libc::fcntl(fd, libc::F_SETLEASE, libc::F_RDLCK) } {
        0 => {
            // SAFETY: as above.
            unsafe { libc::fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK) };
            Some(false)
        }
        _ => match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EAGAIN) => Some(true),
            _ => None,
        },
    }
}

/// The header's verdict for a file of `len` bytes, reading only what the parser looks at
/// (whatever the file's size). Err: I/O failed.
fn header_of(file: &File, len: u64) -> std::io::Result<Result<(), DecodeError>> {
    Ok(decode::parse_file_header(file, len)?.map(drop))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_says_whether_a_writer_holds_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.wav");
        std::fs::write(&path, b"RIFF").unwrap();
        let read = File::open(&path).unwrap();
        // Our own file: its lease is ours to take.
        assert_eq!(held_for_writing(&read), Some(false));
        let writer = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        assert_eq!(held_for_writing(&read), Some(true));
        drop(writer);
        assert_eq!(held_for_writing(&read), Some(false));
        // A lease taken and released leaves the file to writers at once.
        let t = std::time::Instant::now();
        drop(
            std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .unwrap(),
        );
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
    }

    fn wav(data_len: u32, extra: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend(b"RIFF");
        v.extend((36 + data_len + extra.len() as u32).to_le_bytes());
        v.extend(b"WAVEfmt ");
        v.extend(16u32.to_le_bytes());
        v.extend(1u16.to_le_bytes());
        v.extend(1u16.to_le_bytes());
        v.extend(4096u32.to_le_bytes());
        v.extend(8192u32.to_le_bytes());
        v.extend(2u16.to_le_bytes());
        v.extend(16u16.to_le_bytes());
        v.extend(b"data");
        v.extend(data_len.to_le_bytes());
        v.extend((0..data_len).map(|i| (i * 7) as u8));
        v.extend(extra);
        v
    }

    /// The bounded probe agrees with parsing the whole file, for every prefix of a long file
    /// (a writer caught at any moment), with and without a trailing chunk.
    #[test]
    fn bounded_header_probe_agrees_with_the_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.wav");
        for extra in [&b""[..], &b"LIST\x04\x00\x00\x00abcd"[..]] {
            let full = wav(81920, extra);
            let cuts = (0..full.len())
                .step_by(997)
                .chain([full.len() - 1, full.len()]);
            for cut in cuts {
                std::fs::write(&path, &full[..cut]).unwrap();
                let file = File::open(&path).unwrap();
                let got = header_of(&file, cut as u64).unwrap();
                let want = decode::parse_header(&full[..cut]).map(drop);
                assert_eq!(got, want, "cut at {cut}");
            }
        }
    }

    /// The listing agrees with the rule applied path by path ([`classify`] over a walk): nested
    /// folders, a non-UTF-8 folder, links to files and folders, names of any case, other files.
    #[test]
    fn the_listing_agrees_with_the_rule_path_by_path() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for d in ["LEAK/deep/er", "NORMAL", "LEAK-x", "LEAK0", "e.wav"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        let odd_dir = root.join(std::ffi::OsStr::from_bytes(b"NORMAL/\xfe"));
        std::fs::create_dir_all(&odd_dir).unwrap();
        for f in [
            "LEAK/a.wav",
            "LEAK/B.WAV",
            "LEAK/deep/c.Wav",
            "LEAK/deep/er/d.wav",
            "LEAK/deep/notes.txt",
            "LEAK-x/z.wav",
            "LEAK0/y.wav",
            "NORMAL/n.wav",
            "top.wav",
            ".wav",
        ] {
            std::fs::write(root.join(f), b"x").unwrap();
        }
        std::fs::write(odd_dir.join("o.wav"), b"x").unwrap();
        std::os::unix::fs::symlink(root.join("LEAK/a.wav"), root.join("NORMAL/l.wav")).unwrap();
        std::os::unix::fs::symlink(root.join("LEAK"), root.join("NORMAL/dir.wav")).unwrap();
        std::os::unix::fs::symlink(root.join("LEAK"), root.join("NORMAL/dirlink")).unwrap();
        let mut expected: Vec<Found> = walkdir::WalkDir::new(root)
            .follow_links(false)
            .into_iter()
            .filter_map(|e| {
                let e = e.unwrap();
                classify(e.path().strip_prefix(root).unwrap(), e.file_type())
            })
            .collect();
        expected.sort_by(|a, b| a.rel().cmp(b.rel()));
        let found = scan(root).unwrap().to_vec();
        assert_eq!(found, expected);
        assert_eq!(found.len(), 11, "{found:?}");
        assert!(found.windows(2).all(|w| w[0].rel() < w[1].rel()));
    }

    #[test]
    fn links_pipes_sockets_and_non_utf8_names_are_rejected_not_skipped() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("LEAK")).unwrap();
        std::fs::write(root.join("LEAK/a.wav"), b"x").unwrap();
        std::fs::write(root.join("LEAK/notes.txt"), b"x").unwrap();
        std::os::unix::fs::symlink(root.join("LEAK/a.wav"), root.join("LEAK/link.wav")).unwrap();
        let odd = std::ffi::OsStr::from_bytes(b"LEAK/\xff.wav");
        std::fs::write(root.join(odd), b"x").unwrap();
        let fifo = std::ffi::CString::new(root.join("LEAK/pipe.wav").as_os_str().as_bytes());
        assert_eq!(unsafe { libc::mkfifo(fifo.unwrap().as_ptr(), 0o644) }, 0);
        let _socket = std::os::unix::net::UnixListener::bind(root.join("LEAK/sock.wav")).unwrap();
        let found = scan(root).unwrap().to_vec();
        assert_eq!(found.len(), 5, "{found:?}");
        for (rel, what) in [
            ("LEAK/pipe.wav", "a named pipe (FIFO)"),
            ("LEAK/sock.wav", "a socket"),
        ] {
            let rejected = Found::Rejected {
                rel: rel.into(),
                reason: Reason::NotAFile(what),
            };
            assert!(found.contains(&rejected), "{found:?}");
            assert_eq!(classify_path(root, Path::new(rel)), Some(rejected));
        }
        assert!(found.contains(&Found::Recording("LEAK/a.wav".into())));
        assert!(found.contains(&Found::Rejected {
            rel: "LEAK/link.wav".into(),
            reason: Reason::SymbolicLink
        }));
        assert!(found.contains(&Found::Rejected {
            rel: "LEAK/\\xff.wav".into(),
            reason: Reason::NotUtf8
        }));
        assert_eq!(
            classify_path(root, Path::new("LEAK/link.wav")),
            Some(Found::Rejected {
                rel: "LEAK/link.wav".into(),
                reason: Reason::SymbolicLink
            })
        );
    }
}
