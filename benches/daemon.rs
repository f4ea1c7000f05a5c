//! Service benchmark: runs the real `ailhd run` (release build) on a temporary tree and reports
//! 1. latency from a recording's arrival (rename into place = close) to its commit, for a steady
//!    stream of 100 recordings/s (p50, p90, p99, as the service measures them: from the inotify
//!    event of the rename to the manifest commit);
//! 2. throughput of a burst of 10,000 recordings dropped at once, against `ailhd rebuild` of the
//!    same tree in the same run;
//! 3. CPU time and memory while idle.
//!
//! cargo bench --bench daemon [-- STREAM_FILES BURST_FILES]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_ailhd"))
}

fn status(cfg: &Path) -> serde_json::Value {
    let o = Command::new(bin())
        .arg("--config")
        .arg(cfg)
        .args(["status", "--json"])
        .output()
        .unwrap();
    serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null)
}

fn snapshot(state: &Path) -> serde_json::Value {
    std::fs::read_to_string(state.join("status.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(serde_json::Value::Null)
}

fn committed(s: &serde_json::Value) -> u64 {
    s["files"]["committed"].as_u64().unwrap_or(0)
}

/// Rows committed to the outputs, as a reader sees them (the npy columns' `committed_rows`,
/// written at each commit; `status.json` is written every 2 s at most, too coarse to time a
/// burst by).
fn rows_committed(out: &Path) -> u64 {
    (0..3)
        .map(|split| {
            std::fs::read_to_string(ailhd::output::npy_dir(out, split).join("attributes.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .and_then(|v| v["committed_rows"].as_u64())
                .unwrap_or(0)
        })
        .sum()
}

fn proc_cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + fields
            .get(12)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
    ticks / 100.0
}

fn rss_mb(pid: u32) -> f64 {
    common::status_mb(&pid.to_string(), "VmRSS")
}

fn clip(i: usize, seed: u64) -> Vec<u8> {
    let labels = ["LEAK", "NORMAL", "CRACK", "BACKGROUND"];
    ailhd::synth::wav_pcm16(
        &ailhd::synth::clip(labels[i % 4], seed * 1_000_003 + i as u64, 4096, 10.0),
        4096,
    )
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let stream_n = args.first().copied().unwrap_or(1000);
    let burst_n = args.get(1).copied().unwrap_or(10_000);
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("rec");
    let state = dir.path().join("state");
    let out = dir.path().join("out");
    std::fs::create_dir_all(rec.join("LEAK")).unwrap();
    let cfg = common::write_config(dir.path());
    let mut child: Child = Command::new(bin())
        .arg("--config")
        .arg(&cfg)
        .arg("run")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    while !snapshot(&state)["service"].is_object() {
        std::thread::sleep(Duration::from_millis(20));
    }

    // 1. Steady stream, 100 files/s, written under a temporary name and renamed into place,
    // after a first recording that the start-up (a GPU featuriser's, say) may still hold up.
    let staging = dir.path().join("staging");
    std::fs::create_dir_all(&staging).unwrap();
    let t_first = Instant::now();
    let first = staging.join("first.wav");
    std::fs::write(&first, clip(stream_n + burst_n + 1, 1)).unwrap();
    std::fs::rename(
        &first,
        rec.join("LEAK")
            .join(ailhd::synth::file_name(stream_n + burst_n + 1, 1)),
    )
    .unwrap();
    while rows_committed(&out) < 1 {
        std::thread::sleep(Duration::from_millis(1));
    }
    println!(
        "start: a first recording committed {:.0} ms after the service's first status snapshot",
        t_first.elapsed().as_secs_f64() * 1e3
    );
    let clips: Vec<Vec<u8>> = (0..stream_n).map(|i| clip(i, 1)).collect();
    let t0 = Instant::now();
    for (i, bytes) in clips.iter().enumerate() {
        let due = t0 + Duration::from_millis(10 * i as u64);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let tmp = staging.join(format!("{i}.wav"));
        std::fs::write(&tmp, bytes).unwrap();
        std::fs::rename(&tmp, rec.join("LEAK").join(ailhd::synth::file_name(i, 1))).unwrap();
    }
    while committed(&snapshot(&state)) < stream_n as u64 + 1 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let stream_secs = t0.elapsed().as_secs_f64();
    // Let the service write a snapshot with the final latencies.
    std::thread::sleep(Duration::from_millis(2500));
    let s = snapshot(&state);
    let svc = &s["service"];
    println!(
        "stream: {stream_n} files at 100/s ({stream_secs:.1} s); close-to-commit latency measured by the service: p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms",
        svc["latency_ms_p50"].as_f64().unwrap_or(f64::NAN),
        svc["latency_ms_p90"].as_f64().unwrap_or(f64::NAN),
        svc["latency_ms_p99"].as_f64().unwrap_or(f64::NAN)
    );

    // 2. Idle.
    let c0 = proc_cpu_secs(pid);
    let idle = Duration::from_secs(10);
    std::thread::sleep(idle);
    let c1 = proc_cpu_secs(pid);
    println!(
        "idle: {:.2}% of one core over {} s, RSS {:.0} MB",
        100.0 * (c1 - c0) / idle.as_secs_f64(),
        idle.as_secs(),
        rss_mb(pid)
    );

    // 3. Burst: a folder of burst_n files moved into the tree at once.
    let burst_dir = dir.path().join("burst");
    std::fs::create_dir_all(&burst_dir).unwrap();
    for i in 0..burst_n {
        std::fs::write(
            burst_dir.join(ailhd::synth::file_name(100_000 + i, 2)),
            clip(100_000 + i, 2),
        )
        .unwrap();
    }
    let before = rows_committed(&out);
    let c0 = proc_cpu_secs(pid);
    let t = Instant::now();
    std::fs::rename(&burst_dir, rec.join("NORMAL")).unwrap();
    while rows_committed(&out) < before + burst_n as u64 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let burst_secs = t.elapsed().as_secs_f64();
    let burst_rate = burst_n as f64 / burst_secs;
    println!(
        "burst: {burst_n} files in {burst_secs:.2} s = {burst_rate:.0} files/s (service CPU {:.1} s), RSS {:.0} MB",
        proc_cpu_secs(pid) - c0,
        rss_mb(pid)
    );
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    child.wait().unwrap();

    // The same files by `rebuild`, in this run, for the comparison.
    std::fs::remove_dir_all(rec.join("LEAK")).unwrap();
    let t = Instant::now();
    let o = Command::new(bin())
        .arg("--config")
        .arg(&cfg)
        .args(["rebuild", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rebuild_rate = burst_n as f64 / t.elapsed().as_secs_f64();
    println!(
        "rebuild of the burst's {burst_n} files: {rebuild_rate:.0} files/s (whole process); burst / rebuild = {:.0}%",
        100.0 * burst_rate / rebuild_rate
    );
    let _ = status(&cfg);
}
