//! Rebuild benchmark: generates a synthetic tree (default 5,000 clips; `-- N` for another size),
//! warms the page cache, then times `ailhd rebuild` end to end (hashing, decoding, features,
//! HDF5 and npy writes, manifest) and, in the same run, the vectorised numpy + h5py baseline
//! (benches/numpy_baseline.py) on the same tree. Prints files/s, the ratio, time per stage and
//! peak memory.
//!
//! cargo bench --bench rebuild [-- N]

use ailhd::config::{DeviceChoice, Settings};
use ailhd::rebuild::{rebuild, Ui};
use std::time::Instant;

fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|k| k.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5000);
    let dir = tempfile::tempdir().unwrap();
    let labels = ["BACKGROUND", "CRACK", "LEAK", "NORMAL", "UNCLASSIFIED"];
    let t = Instant::now();
    ailhd::synth::write_tree(
        &dir.path().join("rec"),
        &labels,
        n.div_ceil(labels.len()),
        11,
    )
    .unwrap();
    let files = ailhd::source::scan(&dir.path().join("rec")).unwrap().len();
    println!(
        "tree: {files} clips written in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    let mut s = Settings::default();
    s.paths.recordings = dir.path().join("rec");
    s.paths.output = dir.path().join("out");
    s.paths.state = dir.path().join("state");
    let ui = Ui { progress: false };
    // First run warms the page cache (and the allocator); the second is measured.
    let warm = rebuild(&s, DeviceChoice::Cpu, &ui).unwrap();
    println!("warm-up rebuild: {:.0} files/s", warm.files_per_sec());
    let mut best = None::<ailhd::rebuild::RebuildReport>;
    for _ in 0..3 {
        let r = rebuild(&s, DeviceChoice::Cpu, &ui).unwrap();
        if best.as_ref().is_none_or(|b| r.elapsed < b.elapsed) {
            best = Some(r);
        }
    }
    let r = best.unwrap();
    let threads = s.worker_threads();
    println!(
        "ailhd rebuild (cpu, {threads} threads): {} files in {:.3} s = {:.0} files/s (best of 3)",
        r.files,
        r.elapsed.as_secs_f64(),
        r.files_per_sec()
    );
    println!("  time per stage (thread-seconds; read/hash/decode run on {threads} threads, write+manifest on the writer thread):");
    for (stage, secs) in &r.stages {
        println!(
            "    {stage:<10} {secs:>8.3} s  {:>7.1} us/file",
            secs * 1e6 / r.files as f64
        );
    }
    println!("  peak RSS: {:.0} MB", peak_rss_mb());

    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/numpy_baseline.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg(dir.path().join("rec"))
        .arg(dir.path().join("baseline.h5"))
        .output();
    match out {
        Ok(o) if o.status.success() => {
            let text = String::from_utf8_lossy(&o.stdout);
            print!("{text}");
            if let Some(rate) = text
                .split('=')
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .and_then(|s| s.parse::<f64>().ok())
            {
                println!(
                    "ratio ailhd / numpy baseline: {:.1}x",
                    r.files_per_sec() / rate
                );
            }
        }
        Ok(o) => println!("baseline failed: {}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => println!("baseline not run (python3: {e})"),
    }
}
