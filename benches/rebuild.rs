//! Rebuild benchmark: generates a synthetic tree (default 5,000 clips; `-- N` for another size),
//! warms the page cache (and warms it again before every timed run, of either side: on a VM whose
//! host reclaims idle guest memory, a 39,563-clip tree does not stay cached through a baseline
//! run of half a minute), then times `ailhd rebuild` end to end (hashing, decoding, features,
//! HDF5 and npy writes, manifest) and, in the same run, the vectorised numpy + h5py baseline
//! (benches/numpy_baseline.py) on the same tree, taking turns three times; prints the medians'
//! files/s and ratio, the phases of the median run, time per stage and how busy each stage's
//! threads were, and peak memory.
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

    let s = Settings::in_folder(dir.path());
    let ui = Ui { progress: false };
    // First run warms the page cache (and the allocator); then ailhd and the baseline take
    // turns, three times each, and the medians are compared (the machine's load drifts).
    let warm = rebuild(&s, DeviceChoice::Cpu, &ui).unwrap();
    println!("warm-up rebuild: {:.0} files/s", warm.files_per_sec());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/numpy_baseline.py");
    let mut runs = Vec::new();
    let mut baseline = Vec::new();
    for round in 1..=3 {
        warm_cache(&s.paths.recordings);
        let r = rebuild(&s, DeviceChoice::Cpu, &ui).unwrap();
        print!("round {round}: ailhd {:>6.0} files/s", r.files_per_sec());
        runs.push(r);
        warm_cache(&s.paths.recordings);
        match numpy_baseline(
            &script,
            &dir.path().join("rec"),
            &dir.path().join("baseline.h5"),
        ) {
            Ok(rate) => {
                println!("   numpy+h5py {rate:>6.0} files/s");
                baseline.push(rate);
            }
            Err(e) => println!("   baseline not run: {e}"),
        }
    }
    runs.sort_by_key(|r| r.elapsed);
    let r = &runs[runs.len() / 2];
    let threads = s.worker_threads();
    println!(
        "ailhd rebuild (cpu, {threads} threads): {} files in {:.3} s = {:.0} files/s (median of 3)",
        r.files,
        r.elapsed.as_secs_f64(),
        r.files_per_sec()
    );
    println!("  phases (wall seconds):");
    for (phase, secs) in &r.phases {
        println!("    {phase:<10} {secs:>8.3} s");
    }
    let ingest = r
        .phases
        .iter()
        .find(|(p, _)| *p == "ingest")
        .map(|(_, s)| *s)
        .unwrap_or(f64::NAN);
    println!(
        "  time per stage (thread-seconds, us per file, and how busy the stage's threads were during ingest; read/hash/decode share {threads} loader threads, featurise has its own, write+manifest the commit thread):"
    );
    let sum = |names: &[&str]| -> f64 {
        r.stages
            .iter()
            .filter(|(n, _)| names.contains(n))
            .map(|(_, s)| s)
            .sum()
    };
    for (stage, secs) in &r.stages {
        println!(
            "    {stage:<10} {secs:>8.3} s  {:>7.1} us/file",
            secs * 1e6 / r.files as f64
        );
    }
    println!(
        "  busy: loaders {:.0}%  featuriser {:.0}%  commit {:.0}%",
        100.0 * sum(&["read", "hash", "decode"]) / (threads as f64 * ingest),
        100.0 * sum(&["featurise"]) / ingest,
        100.0 * sum(&["write", "manifest"]) / ingest,
    );
    println!(
        "  peak RSS of this process (tree, rebuilds): {:.0} MB",
        peak_rss_mb()
    );
    if !baseline.is_empty() {
        baseline.sort_by(f64::total_cmp);
        let b = baseline[baseline.len() / 2];
        println!(
            "numpy+h5py baseline: {b:.0} files/s (median of {})",
            baseline.len()
        );
        println!(
            "ratio ailhd / numpy baseline: {:.1}x",
            r.files_per_sec() / b
        );
    }
}

/// Read every recording under `tree` (the files `rebuild` reads, as its scan lists them) into
/// one reused buffer, so that the next run finds them in the page cache.
fn warm_cache(tree: &std::path::Path) {
    use std::io::Read;
    let mut buf = Vec::new();
    for found in ailhd::source::scan(tree).unwrap() {
        buf.clear();
        if let Ok(mut f) = std::fs::File::open(tree.join(found.rel())) {
            let _ = f.read_to_end(&mut buf);
        }
    }
}

/// One run of the numpy + h5py baseline; its files/s.
fn numpy_baseline(
    script: &std::path::Path,
    tree: &std::path::Path,
    out: &std::path::Path,
) -> Result<f64, String> {
    let o = std::process::Command::new("python3")
        .arg(script)
        .arg(tree)
        .arg(out)
        .output()
        .map_err(|e| format!("python3: {e}"))?;
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    let text = String::from_utf8_lossy(&o.stdout);
    text.split('=')
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse::<f64>().ok())
        .ok_or_else(|| format!("unexpected output: {text}"))
}
