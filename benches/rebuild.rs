//! Rebuild benchmark: generates a synthetic tree (default 5,000 clips; `-- N` for another size),
//! warms the page cache (and warms it again before every timed run, of either side: on a VM whose
//! host reclaims idle guest memory, a 39,563-clip tree does not stay cached through a baseline
//! run of half a minute), then times `ailhd rebuild` end to end (hashing, decoding, features,
//! HDF5 and npy writes, manifest) and, in the same run, the vectorised numpy + h5py baseline
//! (benches/numpy_baseline.py) on the same tree, taking turns three times; prints the medians'
//! files/s and ratio, the phases of the median run, time per stage and how busy each stage's
//! threads were, and peak memory.
//!
//! cargo bench --bench rebuild [-- N]   (also `-- --ceiling [N]`, `-- --processes [N]`)
//!
//! `-- --ceiling [N]` measures what the host pipeline can do when featurising costs next to
//! nothing, as on a GPU host: the real engine (scan, read, hash, decode, decide, HDF5 + npy
//! writes, manifest, swap) with a pass-through featuriser that emits correctly shaped rows
//! without computing them (this file's [`PassThrough`]; no user option). It takes turns with
//! the real CPU rebuild three times and prints `ceiling: N files/s`, the stage table of the
//! median run, how busy each stage was, and the rate the measured per-stage costs predict for
//! 4, 8 and 16 cores with the stage that would cap it. The stage timers are wall time on
//! threads that share the cores, so that prediction counts what a stage waited for other
//! threads as its own cost (a pessimistic bound); the CPU each group of threads spent during
//! the ingest, sampled from the kernel's accounting every 5 ms (`common::threads`), gives a
//! second prediction that counts no waiting at all, not even for the disk (an optimistic one).
//! Run it under `taskset -c 0-3` etc. to measure core scaling (the engine sizes its threads
//! from the cores it may use).
//!
//! `-- --processes [N]` times what a user waits for: the release `ailhd rebuild --device cpu`
//! and the numpy + h5py baseline as whole processes (exec to exit, Python's imports included),
//! and `ailhd rebuild` held to one core, taking turns five times on the same tree (its page cache
//! warmed before each run); prints the medians' files/s, the ratio to the baseline, the CPU time
//! of the `ailhd` process per file (user + system, from the kernel's accounting of the waited
//! child), and how much faster all cores are than one.

mod common;

use ailhd::config::{DeviceChoice, FeatureShape, Settings};
use ailhd::decode::Waveform;
use ailhd::features::Featuriser;
use ailhd::rebuild::{rebuild, rebuild_with, RebuildReport, Ui};
use half::f16;
use std::time::Instant;

fn peak_rss_mb() -> f64 {
    common::status_mb("self", "VmHWM")
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5000);
    let ceiling_mode = std::env::args().any(|a| a == "--ceiling");
    let processes_mode = std::env::args().any(|a| a == "--processes");
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
    if ceiling_mode {
        ceiling(&s, &ui);
        return;
    }
    if processes_mode {
        processes(dir.path(), files);
        return;
    }
    // First run warms the page cache (and the allocator); then ailhd and the baseline take
    // turns, three times each, and the medians are compared (the machine's load drifts).
    let warm = rebuild(&s, DeviceChoice::Cpu, &ui).unwrap();
    println!("warm-up rebuild: {:.0} files/s", warm.files_per_sec());
    let mut runs = Vec::new();
    let mut baseline = Vec::new();
    for round in 1..=3 {
        warm_cache(&s.paths.recordings);
        let r = rebuild(&s, DeviceChoice::Cpu, &ui).unwrap();
        print!("round {round}: ailhd {:>6.0} files/s", r.files_per_sec());
        runs.push(r);
        warm_cache(&s.paths.recordings);
        match numpy_baseline(dir.path()) {
            Ok(rate) => {
                println!("   numpy+h5py {rate:>6.0} files/s");
                baseline.push(rate);
            }
            Err(e) => println!("   baseline not run: {e}"),
        }
    }
    let r = &median_run(runs);
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
    let ingest = ingest_secs(r);
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
        let runs = baseline.len();
        let b = median(baseline);
        println!("numpy+h5py baseline: {b:.0} files/s (median of {runs})");
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
    for found in ailhd::source::scan(tree).unwrap().iter() {
        buf.clear();
        if let Ok(mut f) = std::fs::File::open(tree.join(found.rel())) {
            let _ = f.read_to_end(&mut buf);
        }
    }
}

/// The numpy + h5py baseline (benches/numpy_baseline.py) on the tree `dir/rec`, writing
/// `dir/baseline.h5`.
fn numpy_command(dir: &std::path::Path) -> std::process::Command {
    let mut c = std::process::Command::new("python3");
    c.arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/numpy_baseline.py"))
        .arg(dir.join("rec"))
        .arg(dir.join("baseline.h5"));
    c
}

/// One run of the numpy + h5py baseline; its files/s.
fn numpy_baseline(dir: &std::path::Path) -> Result<f64, String> {
    let o = numpy_command(dir)
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

/// A featuriser that computes nothing: each row is its recording's samples, reinterpreted as
/// finite float16 values and repeated to the row's length (bytes as varied as real rows, so the
/// sinks' costs are real). Its batches are the GPU's bulk size.
struct PassThrough {
    shape: FeatureShape,
    done: std::collections::VecDeque<Vec<f16>>,
}

impl Featuriser for PassThrough {
    fn name(&self) -> String {
        "pass-through (ceiling benchmark)".into()
    }
    fn shape(&self) -> FeatureShape {
        self.shape
    }
    fn featurise(&mut self, batch: &[&Waveform], out: &mut [f16]) -> anyhow::Result<()> {
        let row_len = self.shape.row_len();
        for (w, row) in batch.iter().zip(out.chunks_mut(row_len)) {
            match w {
                Waveform::Pcm16(v) => {
                    for (dst, src) in row.iter_mut().zip(v.iter().cycle()) {
                        // Clear the sign and the exponent's low bit: never Inf or NaN.
                        *dst = f16::from_bits(*src as u16 & 0x7BFF);
                    }
                }
                Waveform::Float(v) => {
                    for (dst, src) in row.iter_mut().zip(v.iter().cycle()) {
                        *dst = f16::from_f32(*src);
                    }
                }
            }
        }
        Ok(())
    }
    fn submit(&mut self, batch: &[&Waveform], mut rows: Vec<f16>) -> anyhow::Result<()> {
        self.featurise(batch, &mut rows)?;
        self.done.push_back(rows);
        Ok(())
    }
    fn finish(&mut self) -> anyhow::Result<Option<Vec<f16>>> {
        Ok(self.done.pop_front())
    }
    fn bulk_batch(&self) -> usize {
        1024
    }
}

fn pass_through(s: &Settings) -> anyhow::Result<Box<dyn Featuriser>> {
    Ok(Box::new(PassThrough {
        shape: s.features.shape(),
        done: Default::default(),
    }))
}

/// Wall seconds of the run's ingest phase.
fn ingest_secs(r: &RebuildReport) -> f64 {
    r.phases
        .iter()
        .find(|(p, _)| *p == "ingest")
        .map(|(_, s)| *s)
        .unwrap_or(f64::NAN)
}

/// Seconds per file of each stage (thread time summed over threads).
fn per_file(r: &RebuildReport, names: &[&str]) -> f64 {
    r.stages
        .iter()
        .filter(|(n, _)| names.contains(n))
        .map(|(_, s)| s)
        .sum::<f64>()
        / r.files as f64
}

fn median_run(mut runs: Vec<RebuildReport>) -> RebuildReport {
    runs.sort_by_key(|r| r.elapsed);
    runs.swap_remove(runs.len() / 2)
}

/// One finished child process: wall seconds from spawn to exit, and its CPU seconds (user +
/// system).
struct Timed {
    wall: f64,
    cpu: f64,
}

/// User + system seconds of every waited-for child of this process so far.
fn children_cpu() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut u);
        u
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(u.ru_utime) + secs(u.ru_stime)
}

/// Run `cmd` to its exit (its output discarded; a failure ends the benchmark with its stderr).
fn time_process(mut cmd: std::process::Command) -> Timed {
    let cpu0 = children_cpu();
    let t = Instant::now();
    let o = cmd
        .stdout(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let wall = t.elapsed().as_secs_f64();
    assert!(
        o.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Timed {
        wall,
        cpu: children_cpu() - cpu0,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `--processes`: `ailhd rebuild` on every core, the numpy baseline, and `ailhd rebuild` on one
/// core, as whole processes taking turns.
fn processes(dir: &std::path::Path, files: usize) {
    use std::os::unix::process::CommandExt;
    let cfg = common::write_config(dir);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "machine: {}, {cores} cores this process may use",
        common::cpu_model()
    );
    let ailhd = |one_core: bool| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_ailhd"));
        c.arg("--config")
            .arg(&cfg)
            .args(["rebuild", "--device", "cpu"]);
        if one_core {
            // SAFETY: only an async-signal-safe system call between fork and exec.
            unsafe {
                c.pre_exec(|| {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::CPU_SET(0, &mut set);
                    if libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        c
    };
    warm_cache(&dir.join("rec"));
    time_process(ailhd(false));
    let (mut all, mut base, mut one) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=5 {
        let run = |cmd| {
            warm_cache(&dir.join("rec"));
            time_process(cmd)
        };
        let (a, b, o) = (run(ailhd(false)), run(numpy_command(dir)), run(ailhd(true)));
        println!(
            "round {round}: ailhd {:.3} s ({:.1} s CPU)   numpy+h5py {:.3} s   ailhd on one core {:.3} s",
            a.wall, a.cpu, b.wall, o.wall
        );
        all.push(a);
        base.push(b);
        one.push(o);
    }
    let wall = |v: &[Timed]| median(v.iter().map(|t| t.wall).collect());
    let cpu_us = |v: &[Timed]| median(v.iter().map(|t| t.cpu).collect()) * 1e6 / files as f64;
    let (a, b, o) = (wall(&all), wall(&base), wall(&one));
    let rate = |secs: f64| files as f64 / secs;
    println!("whole processes, {files} files, medians of 5:");
    println!(
        "  ailhd rebuild ({cores} cores)   {a:.3} s  {:>7.0} files/s  CPU {:.0} us/file",
        rate(a),
        cpu_us(&all)
    );
    println!(
        "  ailhd rebuild (1 core)    {o:.3} s  {:>7.0} files/s  CPU {:.0} us/file",
        rate(o),
        cpu_us(&one)
    );
    println!(
        "  numpy+h5py baseline       {b:.3} s  {:>7.0} files/s  CPU {:.0} us/file",
        rate(b),
        cpu_us(&base)
    );
    println!("ratio ailhd / numpy baseline: {:.1}x", b / a);
    println!("1 -> {cores} cores: {:.2}x", o / a);
}

/// `--ceiling`: the pass-through pipeline and the real CPU one, taking turns.
fn ceiling(s: &Settings, ui: &Ui) {
    let threads = s.worker_threads();
    println!(
        "machine: {}, {threads} cores this process may use",
        common::cpu_model()
    );
    let through =
        |s: &Settings| rebuild_with(s, ui, Default::default(), |_| pass_through(s)).unwrap();
    let warm = through(s);
    println!(
        "warm-up (pass-through): {:.0} files/s",
        warm.files_per_sec()
    );
    let (mut fast, mut real) = (Vec::new(), Vec::new());
    for round in 1..=3 {
        warm_cache(&s.paths.recordings);
        let r = sampled(|| through(s));
        print!(
            "round {round}: pass-through {:>7.0} files/s",
            r.0.files_per_sec()
        );
        fast.push(r);
        warm_cache(&s.paths.recordings);
        let r = sampled(|| rebuild(s, DeviceChoice::Cpu, ui).unwrap());
        println!("   real cpu {:>7.0} files/s", r.0.files_per_sec());
        real.push(r);
    }
    let ((r, groups), (cpu_run, cpu_groups)) = (median_sampled(fast), median_sampled(real));
    println!("ceiling: {:.0} files/s", r.files_per_sec());
    println!(
        "  real cpu rebuild, same tree: {:.0} files/s (median of 3)",
        cpu_run.files_per_sec()
    );
    println!(
        "  {} files in {:.3} s; phases (wall seconds): {}",
        r.files,
        r.elapsed.as_secs_f64(),
        r.phases
            .iter()
            .map(|(p, s)| format!("{p} {s:.3}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let ingest = ingest_secs(&r);
    println!("  stage        us/file (thread time; pass-through | real cpu)");
    for ((stage, secs), (_, real_secs)) in r.stages.iter().zip(&cpu_run.stages) {
        println!(
            "    {stage:<10} {:>7.1} | {:>7.1}",
            secs * 1e6 / r.files as f64,
            real_secs * 1e6 / cpu_run.files as f64
        );
    }
    let load = per_file(&r, &["read", "hash", "decode"]);
    let decide = per_file(&r, &["decide"]);
    let featurise = per_file(&r, &["featurise"]);
    // In bulk the commit thread writes a plan's rows while an output thread records it in the
    // manifest: "write" is the commit thread's whole time per plan (its wait for the manifest
    // included), "manifest" the output thread's.
    let (write, manifest) = (per_file(&r, &["write"]), per_file(&r, &["manifest"]));
    let files = r.files as f64;
    let ingest_rate = files / ingest;
    println!(
        "  busy during ingest: loaders {:.0}% of {threads} threads, decide {:.0}%, featurise {:.0}%, commit {:.0}% (manifest {:.0}%)",
        100.0 * load * ingest_rate / threads as f64,
        100.0 * decide * ingest_rate,
        100.0 * featurise * ingest_rate,
        100.0 * write * ingest_rate,
        100.0 * manifest * ingest_rate,
    );
    let fixed = r.elapsed.as_secs_f64() - ingest;
    println!(
        "  ingest phase {ingest_rate:.0} files/s; the fixed phases (start, close, swap) {:.0} ms",
        fixed * 1e3
    );
    // The prediction: loaders share the cores; decide (the submitting thread), featurise (its
    // own thread, feeding the GPU), commit and the manifest (one thread each) are serial; all
    // of it together uses at most the cores there are; the fixed phases as measured here.
    println!(
        "  predicted with a GPU featuriser from these per-stage costs, {} files:",
        r.files
    );
    for cores in [threads, 4, 8, 16] {
        let caps = [
            (
                "all stages' CPU",
                cores as f64 / (load + decide + featurise + write + manifest),
            ),
            ("load (read+hash+decode)", cores as f64 / load),
            ("decide", 1.0 / decide),
            ("featurise hand-off", 1.0 / featurise),
            ("commit (write)", 1.0 / write),
            ("manifest", 1.0 / manifest),
        ];
        print_prediction(cores, &caps, files, fixed);
    }
    thread_cpu(&r, &groups, &cpu_run, &cpu_groups, threads, decide, fixed);
}

/// One line of a prediction: the lowest of `caps` (files/s during ingest) and the whole run's
/// rate with the fixed phases as measured.
fn print_prediction(cores: usize, caps: &[(&str, f64)], files: f64, fixed: f64) {
    let (what, cap) = caps
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .copied()
        .unwrap();
    let whole = files / (fixed + files / cap);
    println!(
        "    {cores:>2} cores: ingest {cap:>7.0} files/s, capped by {what}; whole run {whole:>7.0} files/s"
    );
}

/// `run` with every thread's CPU sampled: the report, and each group of threads' CPU and
/// waiting during the run's ingest phase.
fn sampled(run: impl FnOnce() -> RebuildReport) -> (RebuildReport, Vec<common::threads::Group>) {
    let sampler = common::threads::Sampler::start(std::time::Duration::from_millis(5));
    let started = Instant::now();
    let r = run();
    let samples = sampler.stop();
    let phase = |name: &str| {
        r.phases
            .iter()
            .find(|(p, _)| *p == name)
            .map_or(0.0, |(_, s)| *s)
    };
    let from = samples.since_start(started) + phase("start");
    let groups = samples.between(from, from + phase("ingest"));
    (r, groups)
}

fn median_sampled(
    mut runs: Vec<(RebuildReport, Vec<common::threads::Group>)>,
) -> (RebuildReport, Vec<common::threads::Group>) {
    runs.sort_by_key(|r| r.0.elapsed);
    runs.swap_remove(runs.len() / 2)
}

/// What each group of threads cost in CPU during the ingest (sampled from the kernel's
/// accounting, not the stage timers, whose wall time includes waiting for the other threads
/// on the same cores), and the prediction from those costs: a stage on one thread caps the
/// rate at one over its CPU a file, a pool at its threads over its CPU a file, and everything
/// together at the cores over the whole CPU a file. It leaves out what a stage waits for the
/// disk, so it is the optimistic bound where the prediction above is the pessimistic one.
fn thread_cpu(
    r: &RebuildReport,
    groups: &[common::threads::Group],
    cpu_run: &RebuildReport,
    cpu_groups: &[common::threads::Group],
    cores_here: usize,
    decide: f64,
    fixed: f64,
) {
    let files = r.files as f64;
    println!("  CPU a file by thread during ingest (us on a CPU / us runnable and waiting for one (threads); pass-through | real cpu):");
    let real: std::collections::HashMap<&str, &common::threads::Group> =
        cpu_groups.iter().map(|g| (g.name.as_str(), g)).collect();
    let mut names: Vec<&str> = groups.iter().map(|g| g.name.as_str()).collect();
    names.extend(
        cpu_groups
            .iter()
            .map(|g| g.name.as_str())
            .filter(|n| !groups.iter().any(|g| g.name == *n)),
    );
    let us = |g: Option<&common::threads::Group>, n: f64| {
        g.map_or("-".to_string(), |g| {
            format!(
                "{:.1} / {:.1} ({})",
                g.cpu * 1e6 / n,
                g.waiting * 1e6 / n,
                g.threads
            )
        })
    };
    for name in names {
        let here = groups.iter().find(|g| g.name == name);
        println!(
            "    {name:<16} {:>20} | {:>20}",
            us(here, files),
            us(real.get(name).copied(), cpu_run.files as f64)
        );
    }
    let cpu = |name: &str| {
        groups
            .iter()
            .find(|g| g.name == name)
            .map_or(0.0, |g| g.cpu / files)
    };
    let total: f64 = groups.iter().map(|g| g.cpu).sum::<f64>() / files;
    let io_threads = ailhd::output::set::io_pool().current_num_threads();
    println!(
        "  predicted with a GPU featuriser from the CPU a file above (no waiting for the disk), {} files:",
        r.files
    );
    for cores in [cores_here, 4, 8, 16] {
        let manifest_threads = cores.clamp(1, 8) as f64;
        let caps = [
            ("all threads' CPU", cores as f64 / total),
            ("load (read+hash+decode)", cores as f64 / cpu("ailhd-load")),
            ("decide", 1.0 / decide),
            ("featurise hand-off", 1.0 / cpu("ailhd-featurise")),
            ("commit thread", 1.0 / cpu("ailhd-commit")),
            (
                "output threads",
                io_threads.min(cores) as f64 / cpu("ailhd-io"),
            ),
            ("manifest threads", manifest_threads / cpu("ailhd-manifest")),
        ];
        print_prediction(cores, &caps, files, fixed);
    }
}
