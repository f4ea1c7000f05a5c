//! No crash loop: a recording that makes ailhd die while reading it (a crash in a decoder or a
//! library, an abort, an out-of-memory kill) is quarantined after two deaths in a row, and
//! everything else arrives. The binary `cargo test` builds has a fail point that aborts the
//! process while it reads a named recording (`FAILPOINTS=load-file=return(REL)`, see
//! `engine::stages::load`).

use crate::common::service::*;
use crate::common::*;
use serial_test::serial;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

const FAST: &str = "[ingest]\nsettle_ms = 100\nquarantine_after_s = 2\nmax_batch_latency_ms = 10\nrescan_interval_s = 0\ndevice = \"cpu\"\n";
const POISON: &str = "LEAK/S009~R999~20250118120530~100.wav";
const FAIL: &str = "load-file=return(LEAK/S009~R999~20250118120530~100.wav)";

fn add(world: &World, range: std::ops::Range<usize>) {
    for i in range {
        let (label, rel) = alternating(i, 29);
        write_via_rename(&world.rec(), &rel, &clip_wav(label, 2900 + i as u64));
    }
}

/// Run `ailhd ARGS` with the fail point armed until it exits (60 s at most); its status and
/// what it logged.
fn run_failing(world: &World, args: &[&str]) -> (ExitStatus, String) {
    let log = world.dir.path().join("failing.log");
    let mut child = world
        .cmd(args)
        .env("FAILPOINTS", FAIL)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let status = exit_within(&mut child, Duration::from_secs(60)).unwrap_or_else(|| {
        panic!(
            "ailhd {args:?} did not stop; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    });
    (status, std::fs::read_to_string(&log).unwrap_or_default())
}

fn aborted(status: &ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.signal() == Some(libc::SIGABRT)
}

fn quarantine_reason(s: &serde_json::Value) -> Option<String> {
    quarantined(s).get(POISON).cloned()
}

fn expect_reason(reason: &str) {
    assert!(
        reason.contains("stopped twice in a row while reading it")
            && reason.contains("not retried until its bytes change"),
        "{reason}"
    );
}

#[test]
#[serial]
fn a_recording_that_stops_the_service_twice_is_quarantined_and_the_rest_arrives() {
    let metrics = tempfile::tempdir().unwrap();
    let prom = metrics.path().join("ailhd.prom");
    let world = World::new(&format!("{FAST}[metrics]\ntextfile = {prom:?}\n"));
    add(&world, 0..30);
    write_via_rename(&world.rec(), POISON, &clip_wav("LEAK", 2999));

    // First start: it dies while reading the recording, with the others of its batch.
    let (status, log) = run_failing(&world, &["--verbose", "run"]);
    assert!(aborted(&status), "{status:?}\n{log}");
    assert!(log.contains("aborting while reading"), "{log}");
    // Second start: what was in flight is read again, each file alone; it dies again, reading
    // that one file alone.
    let (status, log) = run_failing(&world, &["--verbose", "run"]);
    assert!(aborted(&status), "{status:?}\n{log}");
    assert!(
        log.contains("ailhd stopped while reading") && log.contains("read again alone first"),
        "{log}"
    );
    assert!(log.contains(&format!("reading {POISON} alone")), "{log}");

    // Third start: quarantined, not read (the fail point stays armed), and every other
    // recording arrives, and those placed afterwards.
    let svc = Service::start_failing(&world, FAIL);
    let snap = svc.wait("the 30 others committed, the one quarantined", |s| {
        committed(s) == 30 && quarantine_reason(s).is_some()
    });
    expect_reason(&quarantine_reason(&snap).unwrap());
    add(&world, 30..50);
    svc.wait("the 20 placed afterwards", |s| committed(s) == 50);
    svc.wait_for("the metrics count it", || {
        std::fs::read_to_string(&prom)
            .unwrap_or_default()
            .contains("ailhd_files_quarantined_total{reason=\"stopped_while_reading\"} 1")
    });
    let text = ok(&world.run(&["status"]));
    assert!(
        text.contains(POISON) && text.contains("stopped twice in a row while reading it"),
        "{text}"
    );
    let log = svc.terminate();
    assert!(
        log.contains(&format!("quarantined {POISON}: ailhd stopped twice")),
        "{log}"
    );
    let _ = std::fs::remove_file(&prom);

    // Started again, it does not read the file again while it is unchanged.
    let svc = Service::start_failing(&world, FAIL);
    write_via_rename(&world.rec(), "NORMAL/later.wav", &clip_wav("NORMAL", 2998));
    svc.wait("one more", |s| committed(s) == 51);
    let snap = svc.snapshot().unwrap();
    expect_reason(&quarantine_reason(&snap).unwrap());
    svc.terminate();

    // Nor does `rebuild`: it keeps the quarantine.
    let (status, log) = run_failing(&world, &["rebuild"]);
    assert!(status.success(), "{status:?}\n{log}");
    let st = world.status_json();
    expect_reason(&quarantine_reason(&st).unwrap());

    // Touched (new mtime), it is read again: here, without the fail point, it has its row.
    let f = std::fs::File::options()
        .append(true)
        .open(world.rec().join(POISON))
        .unwrap();
    f.set_modified(std::time::SystemTime::now() + Duration::from_secs(5))
        .unwrap();
    drop(f);
    let svc = Service::start(&world);
    svc.wait("the touched file committed", |s| {
        committed(s) == 52 && quarantine_reason(s).is_none()
    });
    svc.terminate();
    // run == rebuild, for every recording.
    compare_with_rebuild(&world);
}

#[test]
#[serial]
fn a_recording_that_stops_rebuild_twice_is_quarantined_by_the_third() {
    let world = World::new(FAST);
    add(&world, 0..40);
    write_via_rename(&world.rec(), POISON, &clip_wav("LEAK", 2999));
    for _ in 0..2 {
        let (status, log) = run_failing(&world, &["rebuild"]);
        assert!(aborted(&status), "{status:?}\n{log}");
    }
    let (status, log) = run_failing(&world, &["rebuild"]);
    assert!(status.success(), "{status:?}\n{log}");
    assert!(log.contains("stopped 2 times in a row"), "{log}");
    let st = world.status_json();
    expect_reason(&quarantine_reason(&st).unwrap());
    assert_eq!(st["files"]["committed"].as_u64(), Some(40), "{st}");
    // Its bytes unchanged, a rebuild without the fail point keeps it set aside too.
    ok(&world.run(&["rebuild"]));
    expect_reason(&quarantine_reason(&world.status_json()).unwrap());
}
