//! The watcher on real inotify: a temporary tree, real writers (copy, slow chunks, temp name then
//! rename, `mkdir -p` then write, moves of files and whole folders), and the events that come out.
//! Every receive has a timeout, so a missing event fails the test instead of hanging it.

use serial_test::serial;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ailhd::source::watch::{errno_advice, explain, TouchKind, WatchError, WatchEvent, Watcher};
use crossbeam_channel::{Receiver, RecvTimeoutError};

/// Long enough for inotify on a loaded CI box; a passing test never waits this long.
const TIMEOUT: Duration = Duration::from_secs(10);
/// No event for this long means the burst is over.
const QUIET: Duration = Duration::from_millis(300);

/// A tree to watch (`root`) and a sibling outside it on the same filesystem, so renames between
/// the two are real moves into and out of the tree.
struct Tree {
    _dir: tempfile::TempDir,
    root: PathBuf,
    outside: PathBuf,
}

fn tree(folders: &[&str]) -> Tree {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("MASTER_DATASET");
    let outside = dir.path().join("staging");
    fs::create_dir(&root).unwrap();
    fs::create_dir(&outside).unwrap();
    for f in folders {
        fs::create_dir_all(root.join(f)).unwrap();
    }
    Tree {
        _dir: dir,
        root,
        outside,
    }
}

fn watch(root: &Path) -> (Watcher, Receiver<WatchEvent>) {
    let (tx, rx) = crossbeam_channel::unbounded();
    let watcher = Watcher::start(root, tx).expect("start watcher");
    (watcher, rx)
}

/// Collects events until none arrives for QUIET (or TIMEOUT in all).
fn until_quiet(rx: &Receiver<WatchEvent>) -> Vec<WatchEvent> {
    let start = Instant::now();
    let mut events = Vec::new();
    while start.elapsed() < TIMEOUT {
        match rx.recv_timeout(QUIET) {
            Ok(event) => events.push(event),
            Err(_) => break,
        }
    }
    events
}

/// Collects events until `done` holds for what was collected; panics with them after TIMEOUT.
fn until(
    rx: &Receiver<WatchEvent>,
    what: &str,
    done: impl Fn(&[WatchEvent]) -> bool,
) -> Vec<WatchEvent> {
    let deadline = Instant::now() + TIMEOUT;
    let mut events = Vec::new();
    while !done(&events) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(event) => events.push(event),
            Err(_) => panic!("timed out waiting for {what}; got {events:#?}"),
        }
    }
    events
}

fn touched(path: &str, kind: TouchKind) -> WatchEvent {
    WatchEvent::Touched {
        path: path.into(),
        kind,
    }
}

fn has(events: &[WatchEvent], event: &WatchEvent) -> bool {
    events.contains(event)
}

/// Every path an event names (Rescan names none).
fn paths(events: &[WatchEvent]) -> Vec<&Path> {
    events
        .iter()
        .filter_map(|e| match e {
            WatchEvent::Touched { path, .. }
            | WatchEvent::Removed(path)
            | WatchEvent::RemovedDir(path)
            | WatchEvent::Attributes(path) => Some(path.as_path()),
            WatchEvent::Rescan { .. } => None,
        })
        .collect()
}

fn no_rescan(events: &[WatchEvent]) {
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, WatchEvent::Rescan { .. })),
        "unexpected rescan: {events:#?}"
    );
}

#[test]
#[serial]
fn copied_file_is_touched_then_closed() {
    let t = tree(&["LEAK"]);
    let src = t.outside.join("src.wav");
    fs::write(&src, vec![7u8; 81_964]).unwrap();
    let (_w, rx) = watch(&t.root);

    fs::copy(&src, t.root.join("LEAK/a.wav")).unwrap();

    let closed = touched("LEAK/a.wav", TouchKind::Closed);
    let mut events = until(&rx, "close of the copy", |e| has(e, &closed));
    events.extend(until_quiet(&rx));
    assert!(
        paths(&events).iter().all(|p| *p == Path::new("LEAK/a.wav")),
        "{events:#?}"
    );
    assert_eq!(
        events.last(),
        Some(&closed),
        "close is the last word: {events:#?}"
    );
    no_rescan(&events);
}

#[test]
#[serial]
fn slow_writer_is_modified_while_writing_and_closed_at_the_end() {
    let t = tree(&["LEAK"]);
    let (_w, rx) = watch(&t.root);
    let path = t.root.join("LEAK/slow.WAV");

    let mut file = fs::File::create(&path).unwrap();
    file.write_all(&[1u8; 44]).unwrap();
    let first = until(&rx, "the first write", |e| {
        has(e, &touched("LEAK/slow.WAV", TouchKind::Written))
    });
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(150));
        file.write_all(&[2u8; 4096]).unwrap();
    }
    let during = until_quiet(&rx);
    let all_during: Vec<_> = first.iter().chain(&during).collect();
    assert!(
        all_during
            .iter()
            .all(|e| [TouchKind::Created, TouchKind::Written]
                .iter()
                .any(|&k| **e == touched("LEAK/slow.WAV", k))),
        "only a creation and writes while the writer holds the file: {all_during:#?}"
    );
    assert!(!during.is_empty(), "later writes are reported too");

    drop(file);
    let after = until(&rx, "the close", |e| {
        has(e, &touched("LEAK/slow.WAV", TouchKind::Closed))
    });
    assert_eq!(
        after.last(),
        Some(&touched("LEAK/slow.WAV", TouchKind::Closed))
    );
}

#[test]
#[serial]
fn temp_name_then_rename_reports_only_the_final_name() {
    let t = tree(&["NORMAL"]);
    let (_w, rx) = watch(&t.root);

    fs::write(t.root.join("NORMAL/x.wav.part"), vec![0u8; 1000]).unwrap();
    fs::rename(
        t.root.join("NORMAL/x.wav.part"),
        t.root.join("NORMAL/x.wav"),
    )
    .unwrap();

    let moved = touched("NORMAL/x.wav", TouchKind::MovedIn);
    let mut events = until(&rx, "the rename target", |e| has(e, &moved));
    events.extend(until_quiet(&rx));
    assert_eq!(events, [moved], "nothing about the .part file");
}

#[test]
#[serial]
fn file_written_right_after_mkdir_p_is_seen_every_time() {
    let t = tree(&[]);
    let (_w, rx) = watch(&t.root);

    // The race: files created in a new folder before notify has added its watch. Fast, many
    // times, at several depths.
    let mut expected = Vec::new();
    for i in 0..50 {
        let dir = format!("LEAK/run{i}/b/c");
        fs::create_dir_all(t.root.join(&dir)).unwrap();
        let file = format!("{dir}/S{i:03}~R1~20250118120530~100.wav");
        fs::write(t.root.join(&file), vec![0u8; 128]).unwrap();
        expected.push(PathBuf::from(file));
    }
    let events = until(&rx, "a touch for each of the 50 files", |e| {
        let seen = paths(e);
        expected.iter().all(|p| seen.contains(&p.as_path()))
    });
    no_rescan(&events);
}

#[test]
#[serial]
fn delete_is_removed() {
    let t = tree(&["LEAK"]);
    fs::write(t.root.join("LEAK/a.wav"), b"RIFF").unwrap();
    let (_w, rx) = watch(&t.root);

    fs::remove_file(t.root.join("LEAK/a.wav")).unwrap();

    let mut events = until(&rx, "the removal", |e| {
        has(e, &WatchEvent::Removed("LEAK/a.wav".into()))
    });
    events.extend(until_quiet(&rx));
    assert_eq!(events, [WatchEvent::Removed("LEAK/a.wav".into())]);
}

#[test]
#[serial]
fn move_between_folders_is_removed_then_moved_in() {
    let t = tree(&["LEAK", "NORMAL"]);
    fs::write(t.root.join("LEAK/a.wav"), b"RIFF").unwrap();
    let (_w, rx) = watch(&t.root);

    fs::rename(t.root.join("LEAK/a.wav"), t.root.join("NORMAL/a.wav")).unwrap();

    let mut events = until(&rx, "both sides of the move", |e| e.len() >= 2);
    events.extend(until_quiet(&rx));
    assert_eq!(
        events,
        [
            WatchEvent::Removed("LEAK/a.wav".into()),
            touched("NORMAL/a.wav", TouchKind::MovedIn)
        ]
    );
}

#[test]
#[serial]
fn file_moved_in_and_out_of_the_tree() {
    let t = tree(&["LEAK"]);
    fs::write(t.outside.join("in.wav"), b"RIFF").unwrap();
    let (_w, rx) = watch(&t.root);

    fs::rename(t.outside.join("in.wav"), t.root.join("LEAK/in.wav")).unwrap();
    let moved = touched("LEAK/in.wav", TouchKind::MovedIn);
    until(&rx, "the move in", |e| has(e, &moved));

    fs::rename(t.root.join("LEAK/in.wav"), t.outside.join("out.wav")).unwrap();
    let gone = WatchEvent::Removed("LEAK/in.wav".into());
    until(&rx, "the move out", |e| has(e, &gone));
}

#[test]
#[serial]
fn folder_moved_in_reports_every_wav_inside_as_moved_in() {
    let t = tree(&["LEAK"]);
    let d = t.outside.join("day1");
    fs::create_dir_all(d.join("sub/deeper")).unwrap();
    fs::write(d.join("a.wav"), b"RIFF").unwrap();
    fs::write(d.join("sub/b.WAV"), b"RIFF").unwrap();
    fs::write(d.join("sub/deeper/c.wav"), b"RIFF").unwrap();
    fs::write(d.join("sub/notes.txt"), b"no").unwrap();
    let (_w, rx) = watch(&t.root);

    fs::rename(&d, t.root.join("LEAK/day1")).unwrap();

    let want = [
        "LEAK/day1/a.wav",
        "LEAK/day1/sub/b.WAV",
        "LEAK/day1/sub/deeper/c.wav",
    ];
    let mut events = until(&rx, "the three recordings", |e| {
        want.iter().all(|p| has(e, &touched(p, TouchKind::MovedIn)))
    });
    events.extend(until_quiet(&rx));
    for p in paths(&events) {
        assert!(
            want.contains(&p.to_str().unwrap()),
            "unexpected {p:?}: {events:#?}"
        );
    }

    // The moved-in folder is watched: a file written into it later is seen.
    fs::write(t.root.join("LEAK/day1/sub/deeper/new.wav"), b"RIFF").unwrap();
    until(&rx, "a write inside the moved-in folder", |e| {
        has(
            e,
            &touched("LEAK/day1/sub/deeper/new.wav", TouchKind::Closed),
        )
    });
}

#[test]
#[serial]
fn folder_moved_away_or_deleted_is_removed_dir() {
    let t = tree(&["LEAK/day1/sub", "LEAK/day2"]);
    fs::write(t.root.join("LEAK/day1/sub/a.wav"), b"RIFF").unwrap();
    fs::write(t.root.join("LEAK/day2/b.wav"), b"RIFF").unwrap();
    let (_w, rx) = watch(&t.root);

    // Moved out of the tree: the files inside get no event of their own.
    fs::rename(t.root.join("LEAK/day1"), t.outside.join("day1")).unwrap();
    let mut events = until(&rx, "the folder moved away", |e| {
        has(e, &WatchEvent::RemovedDir("LEAK/day1".into()))
    });
    events.extend(until_quiet(&rx));
    assert!(
        events
            .iter()
            .all(|e| *e == WatchEvent::RemovedDir("LEAK/day1".into())),
        "{events:#?}"
    );

    // Deleted: the files inside are reported as they go, then the folder.
    fs::remove_dir_all(t.root.join("LEAK/day2")).unwrap();
    let events = until(&rx, "the folder deleted", |e| {
        has(e, &WatchEvent::RemovedDir("LEAK/day2".into()))
            && has(e, &WatchEvent::Removed("LEAK/day2/b.wav".into()))
    });
    no_rescan(&events);
}

#[test]
#[serial]
fn folder_renamed_within_the_tree_is_removed_then_moved_in() {
    let t = tree(&["LEAK/day1", "NORMAL"]);
    fs::write(t.root.join("LEAK/day1/a.wav"), b"RIFF").unwrap();
    let (_w, rx) = watch(&t.root);

    fs::rename(t.root.join("LEAK/day1"), t.root.join("NORMAL/day1")).unwrap();

    let mut events = until(&rx, "old folder gone, file found at the new place", |e| {
        has(e, &WatchEvent::RemovedDir("LEAK/day1".into()))
            && has(e, &touched("NORMAL/day1/a.wav", TouchKind::MovedIn))
    });
    events.extend(until_quiet(&rx));
    let gone = events
        .iter()
        .position(|e| *e == WatchEvent::RemovedDir("LEAK/day1".into()))
        .unwrap();
    let found = events
        .iter()
        .position(|e| *e == touched("NORMAL/day1/a.wav", TouchKind::MovedIn))
        .unwrap();
    assert!(
        gone < found,
        "removal first, so the consumer does not undo the find: {events:#?}"
    );
    // Nothing under the new name is reported gone (notify's stale MOVE_SELF must not leak out).
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, WatchEvent::RemovedDir(p) if p.starts_with("NORMAL"))),
        "{events:#?}"
    );
}

#[test]
#[serial]
fn non_wav_files_raise_no_events() {
    let t = tree(&["LEAK"]);
    fs::write(t.root.join("LEAK/old.txt"), b"x").unwrap();
    fs::write(t.root.join("LEAK/rec.wav"), b"RIFF").unwrap();
    let (_w, rx) = watch(&t.root);

    fs::write(t.root.join("LEAK/notes.txt"), b"hello").unwrap();
    fs::rename(t.root.join("LEAK/notes.txt"), t.root.join("LEAK/notes.md")).unwrap();
    fs::remove_file(t.root.join("LEAK/notes.md")).unwrap();
    fs::write(t.root.join("LEAK/x.wav.part"), b"RIFF").unwrap();
    fs::remove_file(t.root.join("LEAK/x.wav.part")).unwrap();
    fs::remove_file(t.root.join("LEAK/old.txt")).unwrap();
    fs::write(t.root.join("LEAK/wav"), b"no extension").unwrap();
    // Reading a recording is not news; changing only its metadata is said as that alone (its
    // bytes did not change: nothing is touched).
    let rec = t.root.join("LEAK/rec.wav");
    drop(fs::read(&rec).unwrap());
    let mut perms = fs::metadata(&rec).unwrap().permissions();
    perms.set_readonly(true);
    fs::set_permissions(&rec, perms).unwrap();

    let events = until_quiet(&rx);
    assert_eq!(
        events,
        [WatchEvent::Attributes(PathBuf::from("LEAK/rec.wav"))],
        "no events for non-.wav files or reads, only the attributes for a chmod"
    );
}

#[test]
#[serial]
fn stopping_closes_the_channel_and_sends_nothing_more() {
    let t = tree(&["LEAK"]);
    let (w, rx) = watch(&t.root);
    w.stop();
    fs::write(t.root.join("LEAK/after.wav"), b"RIFF").unwrap();
    match rx.recv_timeout(TIMEOUT) {
        Err(RecvTimeoutError::Disconnected) => {}
        other => panic!("expected the channel to close, got {other:?}"),
    }

    // Dropping does the same.
    let (w, rx) = watch(&t.root);
    drop(w);
    assert_eq!(
        rx.recv_timeout(TIMEOUT),
        Err(RecvTimeoutError::Disconnected)
    );
}

#[tokio::test]
async fn delivers_into_a_tokio_channel() {
    let t = tree(&["LEAK"]);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let _w = Watcher::start(&t.root, tx).unwrap();
    fs::write(t.root.join("LEAK/a.wav"), b"RIFF").unwrap();
    let closed = touched("LEAK/a.wav", TouchKind::Closed);
    let wait = async {
        while let Some(e) = rx.recv().await {
            if e == closed {
                return;
            }
        }
        panic!("channel closed");
    };
    tokio::time::timeout(TIMEOUT, wait)
        .await
        .expect("no close event");
}

#[test]
#[serial]
fn start_fails_with_a_clear_message() {
    let t = tree(&[]);
    let missing = t.root.join("nope");
    let err = Watcher::start(&missing, crossbeam_channel::unbounded().0)
        .err()
        .unwrap();
    let text = err.to_string();
    assert!(text.contains(&*missing.to_string_lossy()), "{text}");
    assert!(text.contains("paths.recordings"), "{text}");

    let file = t.root.join("file.wav");
    fs::write(&file, b"RIFF").unwrap();
    let err = Watcher::start(&file, crossbeam_channel::unbounded().0)
        .err()
        .unwrap();
    assert!(matches!(err, WatchError::NotADirectory { .. }), "{err:?}");
    assert!(err.to_string().contains("not a directory"), "{err}");
}

#[test]
#[serial]
fn errno_values_become_advice() {
    let enospc = errno_advice(libc::ENOSPC).unwrap();
    assert!(
        enospc.starts_with("inotify watch limit reached"),
        "{enospc}"
    );
    assert!(
        enospc.contains("sysctl fs.inotify.max_user_watches=524288"),
        "{enospc}"
    );
    let emfile = errno_advice(libc::EMFILE).unwrap();
    assert!(
        emfile.starts_with("too many inotify instances: raise fs.inotify.max_user_instances"),
        "{emfile}"
    );
    assert_eq!(errno_advice(libc::EINTR), None);

    // notify reports ENOSPC from inotify_add_watch as MaxFilesWatch, and EMFILE from
    // inotify_init as a plain io::Error: both get the advice.
    let limit = notify::Error::new(notify::ErrorKind::MaxFilesWatch);
    assert_eq!(explain(&limit), enospc);
    let instances = notify::Error::io(std::io::Error::from_raw_os_error(libc::EMFILE));
    assert_eq!(explain(&instances), emfile);
    let other = notify::Error::io(std::io::Error::from_raw_os_error(libc::EIO));
    assert!(
        explain(&other).contains("Input/output error"),
        "{}",
        explain(&other)
    );

    // And the Display of a start failure carries it, with the folder.
    let err = WatchError::Watch {
        path: "/data/MASTER_DATASET/LEAK".into(),
        advice: explain(&limit),
        source: limit,
    };
    assert_eq!(
        err.to_string(),
        format!("cannot watch /data/MASTER_DATASET/LEAK: {enospc}")
    );
}
