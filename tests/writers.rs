//! One writer per output folder and per state folder, with the real binary: while a `run` or a
//! `rebuild` holds a world, a second `run` or `rebuild` that shares its output folder or its
//! state folder (or both) is refused with exit 1, names the holder's pid and role, and changes
//! nothing. The holder is stopped (SIGSTOP) during the attempts, so that nothing moves by itself
//! and the before/after comparison is exact.

use crate::common::*;
use serial_test::serial;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const FAST: &str = "[ingest]\nsettle_ms = 100\nrescan_interval_s = 0\ndevice = \"cpu\"\n";

/// Every file under `dir` with its bytes' hash (an absent folder is an empty map).
fn tree(dir: &Path) -> BTreeMap<PathBuf, String> {
    let mut m = BTreeMap::new();
    for e in walkdir::WalkDir::new(dir).into_iter().flatten() {
        if e.file_type().is_file() {
            let bytes = std::fs::read(e.path()).unwrap();
            m.insert(
                e.path().strip_prefix(dir).unwrap().to_path_buf(),
                blake3::hash(&bytes).to_hex().to_string(),
            );
        }
    }
    m
}

fn add_recordings(world: &World, n: usize) {
    let src = fixtures().join("wav/leak_pcm16.wav");
    let bytes = std::fs::read(src).unwrap();
    for i in 0..n {
        let label = ["LEAK", "NORMAL"][i % 2];
        let dir = world.rec().join(label);
        std::fs::create_dir_all(&dir).unwrap();
        // Distinct bytes: a different trailing sample per file.
        let mut b = bytes.clone();
        let last = b.len() - 2;
        b[last..].copy_from_slice(&(i as u16).to_le_bytes());
        std::fs::write(dir.join(format!("S{i:03}~R{i}~20250118120530~100.wav")), b).unwrap();
    }
}

/// A configuration beside the world's with one path replaced.
fn variant(world: &World, name: &str, out: &Path, state: &Path) -> PathBuf {
    let p = world.dir.path().join(name);
    std::fs::write(
        &p,
        format!(
            "[paths]\nrecordings = {:?}\noutput = {:?}\nstate = {:?}\n{FAST}",
            world.rec(),
            out,
            state
        ),
    )
    .unwrap();
    p
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

/// SIGSTOP, and wait until every thread of `child` has stopped. kill(2) returns before they
/// do: the thread picked to take the signal may be in an uninterruptible call (an fsync on a
/// busy disk) for a while, and the others go on working until it takes it (a `rebuild` went on
/// to its next output meanwhile, in CI).
fn stop(child: &Child) {
    signal(child, libc::SIGSTOP);
    let tasks = PathBuf::from(format!("/proc/{}/task", child.id()));
    let t = Instant::now();
    loop {
        let states: Vec<char> = std::fs::read_dir(&tasks)
            .unwrap()
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("stat")).ok())
            .filter_map(|stat| stat.rsplit_once(')')?.1.trim_start().chars().next())
            .collect();
        if !states.is_empty() && states.iter().all(|&c| c == 'T' || c == 't') {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "pid {} did not stop in 60 s (thread states {states:?})",
            child.id()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The lock file line "pid role" once the holder has written it.
fn wait_for_lock(path: &Path, role: &str, child: &mut Child) {
    let t = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            if text.trim() == format!("{} {role}", child.id()) {
                return;
            }
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("the holder exited ({st}) before taking {}", path.display());
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{} never held",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Second writers of both kinds, on both folders, against a held (and stopped) world.
fn second_writers_are_refused(world: &World, holder: &Child, role: &str) {
    let other_out = world.dir.path().join("out-other");
    let other_state = world.dir.path().join("state-other");
    let configs = [
        ("the same folders", world.config.clone(), "paths."),
        (
            "the same output, another state",
            variant(world, "same-out.toml", &world.out(), &other_state),
            "paths.output",
        ),
        (
            "the same state, another output",
            variant(world, "same-state.toml", &other_out, &world.state()),
            "paths.state",
        ),
    ];
    let before = (tree(&world.out()), tree(&world.state()));
    assert!(!before.0.is_empty() && !before.1.is_empty());
    for (what, config, key) in &configs {
        for cmd in [&["run"][..], &["rebuild", "--device", "cpu"][..]] {
            let o = std::process::Command::new(bin())
                .arg("--config")
                .arg(config)
                .args(cmd)
                .env_remove("AILHD_CONFIG")
                .stdin(Stdio::null())
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(
                o.status.code(),
                Some(1),
                "{cmd:?} with {what} while `{role}` holds: {err}"
            );
            let held_by = format!("is held by pid {} (ailhd {role})", holder.id());
            assert!(
                err.contains(&held_by) && err.contains(key),
                "{cmd:?} with {what}: expected {held_by:?} naming {key}, got: {err}"
            );
            assert_eq!(
                (tree(&world.out()), tree(&world.state())),
                before,
                "{cmd:?} with {what} changed the held folders"
            );
            // The folder not shared with the holder was not even created.
            assert!(
                !other_out.exists() && !other_state.exists(),
                "{cmd:?} with {what} created a folder"
            );
        }
    }
}

#[test]
#[serial]
fn a_second_writer_beside_a_running_service_is_refused_and_changes_nothing() {
    let world = World::new(FAST);
    add_recordings(&world, 4);
    let log = world.dir.path().join("run.log");
    let mut svc = world
        .cmd(&["--verbose", "run"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    // Up and idle: the four recordings are committed.
    let t = Instant::now();
    loop {
        let snap = std::fs::read_to_string(world.state().join("status.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
        if snap.is_some_and(|s| s["files"]["committed"] == 4 && s["service"].is_object()) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "service not up: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_for_lock(&world.out().join(".ailhd.lock"), "run", &mut svc);
    stop(&svc);
    second_writers_are_refused(&world, &svc, "run");
    signal(&svc, libc::SIGCONT);
    signal(&svc, libc::SIGTERM);
    let st = svc.wait().unwrap();
    assert!(
        st.success(),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    // Released with the process: a writer on the same folders now goes ahead.
    ok(&world.run(&["rebuild", "--device", "cpu"]));
}

#[test]
#[serial]
fn a_second_writer_beside_a_running_rebuild_is_refused_and_changes_nothing() {
    let world = World::new(FAST);
    add_recordings(&world, 200);
    // Outputs and manifest from a first rebuild, so that there is something to keep intact.
    ok(&world.run(&["rebuild", "--device", "cpu"]));
    let mut rebuild = world
        .cmd(&["rebuild", "--device", "cpu"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_lock(&world.out().join(".ailhd.lock"), "rebuild", &mut rebuild);
    stop(&rebuild);
    second_writers_are_refused(&world, &rebuild, "rebuild");
    signal(&rebuild, libc::SIGCONT);
    assert!(rebuild.wait().unwrap().success());
    assert_eq!(world.status_json()["files"]["committed"], 200);
}
