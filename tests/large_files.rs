//! One large file never stops ailhd: memory per recording is bounded whatever the file's size.
//! A tree of ordinary clips plus a long WAV (hours at 4096 Hz: a row takes its first 10 s) and
//! zeros named `.wav` (what a failed copy leaves), both large and sparse (no disk used), under
//! an address-space limit (`RLIMIT_AS`, as a small host or a unit's memory limit gives) well
//! below their size: `rebuild` and `run` go through, the long file trimmed to its first row, the
//! zeros quarantined with the reason. (`benches/large.rs` measures the same at 1.5 GB.)

use crate::common::service::*;
use crate::common::*;
use serial_test::serial;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const FAST: &str = "[ingest]\nsettle_ms = 100\nquarantine_after_s = 2\nmax_batch_latency_ms = 10\nrescan_interval_s = 0\ndevice = \"cpu\"\n";

/// Size of each of the two large files.
const BIG: u64 = 320 << 20;
/// What the limit leaves above the small tree's peak: less than either large file.
const MARGIN: u64 = 192 << 20;

const LONG: &str = "LEAK/S100~R1~20250118120530~100.wav";
const ZEROS: &str = "NORMAL/S100~R2~20250118120530~100.wav";

fn add_clips(world: &World, range: std::ops::Range<usize>) {
    for i in range {
        let (label, rel) = alternating(i, 31);
        write_via_rename(&world.rec(), &rel, &clip_wav(label, 3100 + i as u64));
    }
}

/// A 16-bit mono 4096 Hz WAV of `len` bytes whose first 10 s are a clip's and the rest silence
/// (a hole in the file: no disk used); and the same first 10 s as a WAV of its own.
fn long_wav(path: &Path, len: u64) -> Vec<u8> {
    let clip = clip_wav("LEAK", 3199);
    let samples = &clip[44..];
    let header = |data: u64| -> Vec<u8> {
        let mut h = clip[..44].to_vec();
        h[4..8].copy_from_slice(&((data + 36) as u32).to_le_bytes());
        h[40..44].copy_from_slice(&(data as u32).to_le_bytes());
        h
    };
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut bytes = header(len - 44);
    bytes.extend_from_slice(samples);
    std::fs::write(path, &bytes).unwrap();
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
    let mut first = header(samples.len() as u64);
    first.extend_from_slice(samples);
    first
}

fn zeros(path: &Path, len: u64) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::File::create(path).unwrap().set_len(len).unwrap();
}

fn vm_peak_kb(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with("VmPeak:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Run `ailhd ARGS` to its end; its output and its peak address space (read from /proc while it
/// runs: the last reading before it exits).
fn run_measured(world: &World, args: &[&str], limit: Option<u64>) -> (std::process::Output, u64) {
    let mut cmd = world.cmd(args);
    if let Some(bytes) = limit {
        limit_address_space(&mut cmd, bytes);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut peak = 0;
    while child.try_wait().unwrap().is_none() {
        if let Some(kb) = vm_peak_kb(pid) {
            peak = peak.max(kb);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    (child.wait_with_output().unwrap(), peak * 1024)
}

fn limit_address_space(cmd: &mut Command, bytes: u64) {
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn rows(st: &serde_json::Value) -> u64 {
    ["training", "validation", "testing"]
        .iter()
        .map(|k| st["splits"][k]["rows"].as_u64().unwrap_or(0))
        .sum()
}

fn zeros_reason(st: &serde_json::Value) -> String {
    quarantined(st)
        .get(ZEROS)
        .cloned()
        .unwrap_or_else(|| panic!("{ZEROS} not quarantined: {st}"))
}

#[test]
#[serial]
fn rebuild_and_run_stay_within_a_memory_limit_below_the_size_of_one_file() {
    let world = World::new(FAST);
    add_clips(&world, 0..60);
    // The small tree's peak, for rebuild and for the service.
    let (o, rebuild_peak) = run_measured(&world, &["rebuild"], None);
    ok(&o);
    let svc = Service::start(&world);
    svc.wait("60 committed", |s| committed(s) == 60);
    let run_peak = vm_peak_kb(svc.pid()).unwrap() * 1024;
    svc.terminate();
    println!(
        "small tree: peak address space of rebuild {} MB, of run {} MB",
        rebuild_peak >> 20,
        run_peak >> 20
    );

    long_wav(&world.rec().join(LONG), BIG);
    zeros(&world.rec().join(ZEROS), BIG);
    let limit = rebuild_peak + MARGIN;
    let (o, peak) = run_measured(&world, &["rebuild", "--json"], Some(limit));
    ok(&o);
    println!(
        "with two files of {} MB each, under a limit of {} MB: rebuild peaked at {} MB",
        BIG >> 20,
        limit >> 20,
        peak >> 20
    );
    let st = world.status_json();
    assert_eq!(rows(&st), 61, "{st}");
    assert_eq!(st["files"]["committed"].as_u64(), Some(61), "{st}");
    let reason = zeros_reason(&st);
    assert!(reason.contains("not a WAV file"), "{reason}");

    // The service, from nothing, under its own limit: it starts once, stays up, ingests the
    // tree and what is placed afterwards.
    std::fs::remove_dir_all(world.out()).unwrap();
    std::fs::remove_dir_all(world.state()).unwrap();
    let limit = run_peak + MARGIN;
    let limit_arg = format!("--as={limit}");
    let svc = Service::start_under(&world, &["prlimit", &limit_arg, "--"]);
    let snap = svc.wait("61 committed, the zeros quarantined", |s| {
        committed(s) == 61 && quarantined(s).contains_key(ZEROS)
    });
    assert!(zeros_reason(&snap).contains("not a WAV file"));
    add_clips(&world, 60..80);
    svc.wait("the 20 placed afterwards", |s| committed(s) == 81);
    let pid = svc.pid();
    let peak = vm_peak_kb(pid).unwrap() * 1024;
    println!(
        "run under a limit of {} MB peaked at {} MB",
        limit >> 20,
        peak >> 20
    );
    let log = svc.terminate();
    assert!(!log.contains("memory allocation"), "{log}");
}

/// A long recording's row is that of its first 10 s as a file of its own, and the file is
/// hashed whole (its own row, not the short file's).
#[test]
#[serial]
fn a_long_recording_gives_the_row_of_its_first_ten_seconds() {
    let world = World::new(FAST);
    let first = long_wav(&world.rec().join(LONG), 96 << 20);
    write_via_rename(&world.rec(), "LEAK/first-10s.wav", &first);
    ok(&world.run(&["rebuild"]));
    let script = r#"
import os, sys
import h5py, numpy as np
out, a, b = sys.argv[1:4]
rows = {}
for n in ["TRAINING_DATASET.H5", "VALIDATION_DATASET.H5", "TESTING_DATASET.H5"]:
    with h5py.File(os.path.join(out, n), "r") as f:
        for i in range(int(f["committed_rows"][0])):
            rows[f["source_path"][i].decode()] = (f["segments_mel"][i], bytes(f["blake3"][i]))
assert set(rows) == {a, b}, rows.keys()
assert rows[a][1] != rows[b][1], "distinct files, distinct hashes"
assert rows[a][0].tobytes() == rows[b][0].tobytes(), "rows differ"
assert np.abs(rows[a][0].astype(np.float32)).max() > 0
print("equal rows")
"#;
    let o = Command::new("python3")
        .args(["-c", script, world.out().to_str().unwrap(), LONG])
        .arg("LEAK/first-10s.wav")
        .output()
        .unwrap();
    assert!(ok(&o).contains("equal rows"));
    // The hash is of the whole file.
    let st = world.status_json();
    assert_eq!(st["files"]["committed"].as_u64(), Some(2), "{st}");
    let inspect = ok(&world.run(&[
        "inspect",
        "--json",
        world.rec().join(LONG).to_str().unwrap(),
    ]));
    let v: serde_json::Value = serde_json::from_str(&inspect).unwrap();
    assert_eq!(v["bytes"].as_u64(), Some(96 << 20), "{v}");
    let whole = std::fs::read(world.rec().join(LONG)).unwrap();
    assert_eq!(
        v["blake3"].as_str().unwrap(),
        ailhd::identity::hex(&ailhd::identity::content_hash(&whole))
    );
}
