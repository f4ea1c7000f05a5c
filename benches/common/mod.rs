//! What the benchmark programs share (each uses a part of it).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub mod threads;

/// Write `DIR/ailhd.toml` for a tree at `DIR/rec` with outputs in `DIR/out` and state in
/// `DIR/state`, featurising on the CPU, with no periodic rescan; returns its path.
pub fn write_config(dir: &Path) -> PathBuf {
    let cfg = dir.join("ailhd.toml");
    std::fs::write(
        &cfg,
        format!(
            "[paths]\nrecordings = {:?}\noutput = {:?}\nstate = {:?}\n[ingest]\ndevice = \"cpu\"\nrescan_interval_s = 0\n",
            dir.join("rec"),
            dir.join("out"),
            dir.join("state")
        ),
    )
    .unwrap();
    cfg
}

/// The CPU's model name, from `/proc/cpuinfo`.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// A memory figure of `/proc/<pid>/status` (`VmRSS`, `VmHWM`, ...) in MB, for `pid` a process
/// id or "self"; NaN when it cannot be read.
pub fn status_mb(pid: &str, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|k| k.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}
