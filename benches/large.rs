//! Large files benchmark (one file never stops ailhd): a tree of 60 ordinary clips plus a long
//! WAV (1.5 GB: 51 hours at 4096 Hz, 16-bit mono; a row takes its first 10 s) and 1.5 GB of
//! zeros named `.wav` (what a failed copy leaves), both sparse (no disk used). Runs the real
//! binary (release build; `AILHD_BIN=PATH` runs another, an older build say) and reports:
//!
//! 1. peak RSS (the kernel's maximum resident set, `wait4`) and peak address space (VmPeak) of
//!    `rebuild` and of `run`, on the small tree and on the whole tree;
//! 2. under an address-space limit (`RLIMIT_AS`) of the small tree's peak RSS + 768 MB, or, when
//!    the binary cannot start under that (its allocator and thread stacks reserve more address
//!    space than they use), of the small tree's peak address space + 768 MB: whether `rebuild`
//!    exits 0 with 61 valid rows and the zeros quarantined, and whether `run`, restarted on
//!    failure as systemd's `Restart=on-failure` would for 90 s at most, starts once, stays up,
//!    and ingests the 60 and 20 placed afterwards;
//! 3. recordings arriving at 100/s while the long file is ingested: their latency from the
//!    rename into place to the row a reader sees (the npy columns' committed rows and
//!    `source_path`, polled every 2 ms), p50, p90, p99, and the service's own figures.
//!
//! cargo bench --bench large [-- SIZE_MB [STREAM_FILES]]

mod common;

use std::os::unix::fs::FileExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LONG: &str = "LEAK/S100~R1~20250118120530~100.wav";
const ZEROS: &str = "NORMAL/S100~R2~20250118120530~100.wav";

fn bin() -> PathBuf {
    std::env::var_os("AILHD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ailhd")))
}

struct World {
    dir: PathBuf,
}

impl World {
    fn new(parent: &Path, name: &str) -> World {
        let dir = parent.join(name);
        std::fs::create_dir_all(dir.join("rec")).unwrap();
        common::write_config(&dir);
        World { dir }
    }
    fn rec(&self) -> PathBuf {
        self.dir.join("rec")
    }
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin());
        c.arg("--config")
            .arg(self.dir.join("ailhd.toml"))
            .args(args);
        c.env_remove("AILHD_CONFIG");
        c
    }
    fn fresh(&self) {
        let _ = std::fs::remove_dir_all(self.dir.join("out"));
        let _ = std::fs::remove_dir_all(self.dir.join("state"));
    }
    fn snapshot(&self) -> serde_json::Value {
        std::fs::read_to_string(self.dir.join("state/status.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(serde_json::Value::Null)
    }
    fn status(&self) -> serde_json::Value {
        let o = self.cmd(&["status", "--json"]).output().unwrap();
        serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null)
    }
}

fn committed(s: &serde_json::Value) -> u64 {
    s["files"]["committed"].as_u64().unwrap_or(0)
}

fn quarantined(s: &serde_json::Value) -> Vec<(String, String)> {
    s["quarantined"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|q| {
                    (
                        q["path"].as_str().unwrap_or("").to_string(),
                        q["reason"].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn rows(s: &serde_json::Value) -> u64 {
    ["training", "validation", "testing"]
        .iter()
        .map(|k| s["splits"][k]["rows"].as_u64().unwrap_or(0))
        .sum()
}

fn clip(i: usize) -> (String, Vec<u8>) {
    let label = ["LEAK", "NORMAL"][i % 2];
    let bytes = ailhd::synth::wav_pcm16(
        &ailhd::synth::clip(label, 7700 + i as u64, 4096, 10.0),
        4096,
    );
    (format!("{label}/{}", ailhd::synth::file_name(i, 77)), bytes)
}

fn place(rec: &Path, rel: &str, bytes: &[u8], staging: &Path) {
    let dst = rec.join(rel);
    std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
    let tmp = staging.join(rel.replace('/', "_"));
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, &dst).unwrap();
}

/// The long WAV: a 10 s clip, then silence (a hole) to `len` bytes.
fn long_wav(path: &Path, len: u64) {
    let (_, clip) = clip(9999);
    let mut bytes = clip[..44].to_vec();
    bytes[4..8].copy_from_slice(&((len - 8) as u32).to_le_bytes());
    bytes[40..44].copy_from_slice(&((len - 44) as u32).to_le_bytes());
    bytes.extend_from_slice(&clip[44..]);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, &bytes).unwrap();
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.set_len(len).unwrap();
}

fn zeros(path: &Path, len: u64) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::File::create(path).unwrap().set_len(len).unwrap();
}

fn proc_kb(pid: u32, key: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with(key))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// A memory limit the binary runs under.
#[derive(Clone, Copy)]
enum Limit<'a> {
    None,
    /// `RLIMIT_AS`, bytes.
    AddressSpace(u64),
    /// A memory cgroup (what systemd's `MemoryMax=` sets).
    Cgroup(&'a Cgroup),
}

impl Limit<'_> {
    fn command(&self, world: &World, args: &[&str]) -> Command {
        match self {
            Limit::None => world.cmd(args),
            Limit::AddressSpace(bytes) => {
                let mut c = world.cmd(args);
                limit_address_space(&mut c, *bytes);
                c
            }
            Limit::Cgroup(cg) => {
                let inner = world.cmd(args);
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("echo $$ > {:?} && exec \"$@\"", cg.procs))
                    .arg("sh")
                    .arg(inner.get_program())
                    .args(inner.get_args())
                    .env_remove("AILHD_CONFIG");
                c
            }
        }
    }
}

/// A memory cgroup of its own (v2 where the memory controller is there, else v1), removed at
/// the end.
struct Cgroup {
    dir: PathBuf,
    procs: PathBuf,
    v2: bool,
}

impl Cgroup {
    fn new(name: &str, bytes: u64) -> Option<Cgroup> {
        let v2 = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .is_ok_and(|c| c.split_whitespace().any(|w| w == "memory"));
        let (dir, file) = if v2 {
            (Path::new("/sys/fs/cgroup").join(name), "memory.max")
        } else {
            (
                Path::new("/sys/fs/cgroup/memory").join(name),
                "memory.limit_in_bytes",
            )
        };
        std::fs::create_dir_all(&dir).ok()?;
        if std::fs::write(dir.join(file), bytes.to_string()).is_err() {
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        if v2 {
            let _ = std::fs::write(dir.join("memory.swap.max"), "0");
        }
        Some(Cgroup {
            procs: dir.join("cgroup.procs"),
            dir,
            v2,
        })
    }

    /// OOM kills (v2) or allocations that hit the limit (v1) so far.
    fn events(&self) -> String {
        if self.v2 {
            std::fs::read_to_string(self.dir.join("memory.events"))
                .unwrap_or_default()
                .lines()
                .find(|l| l.starts_with("oom_kill "))
                .map(|l| format!("{} OOM kill(s)", l.split_whitespace().nth(1).unwrap_or("?")))
                .unwrap_or_default()
        } else {
            let failcnt =
                std::fs::read_to_string(self.dir.join("memory.failcnt")).unwrap_or_default();
            let oom = std::fs::read_to_string(self.dir.join("memory.oom_control"))
                .unwrap_or_default()
                .lines()
                .find(|l| l.starts_with("oom_kill "))
                .map(|l| l.split_whitespace().nth(1).unwrap_or("?").to_string())
                .unwrap_or_else(|| "?".into());
            format!("{oom} OOM kill(s), limit hit {} times", failcnt.trim())
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
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

/// A child's end: exit code (or signal), peak RSS (kB, from wait4) and peak address space (kB,
/// the last VmPeak read while it ran).
struct Ended {
    code: Option<i32>,
    signal: Option<i32>,
    max_rss_kb: u64,
    vm_peak_kb: u64,
}

impl Ended {
    fn ok(&self) -> bool {
        self.code == Some(0)
    }
    fn describe(&self) -> String {
        match (self.code, self.signal) {
            (Some(c), _) => format!("exit {c}"),
            (_, Some(s)) => format!("killed by signal {s}"),
            _ => "?".into(),
        }
    }
}

/// Wait for `child` (polling its VmPeak meanwhile; `until` is polled too and may return true
/// to have it sent SIGTERM).
fn reap(child: Child, mut until: impl FnMut() -> bool) -> Ended {
    let pid = child.id() as i32;
    let mut vm_peak = 0;
    let mut termed = false;
    loop {
        if let Some(kb) = proc_kb(pid as u32, "VmPeak:") {
            vm_peak = kb.max(vm_peak);
        }
        let mut status = 0;
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: plain system call on our own child.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            std::mem::forget(child);
            return Ended {
                code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
                signal: libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status)),
                max_rss_kb: usage.ru_maxrss as u64,
                vm_peak_kb: vm_peak,
            };
        }
        if !termed && until() {
            unsafe { libc::kill(pid, libc::SIGTERM) };
            termed = true;
        }
        std::thread::sleep(Duration::from_millis(3));
    }
}

fn rebuild(world: &World, limit: Limit) -> (Ended, String) {
    let mut cmd = limit.command(world, &["rebuild"]);
    let err = world.dir.join("rebuild.log");
    let child = cmd
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let ended = reap(child, || false);
    (ended, std::fs::read_to_string(&err).unwrap_or_default())
}

/// `run`, restarted when it fails as `Restart=on-failure` would (for `deadline` at most), until
/// `done(snapshot)`; then `more` is called once (placing files) and it runs until `done_more`.
/// Returns (starts, the last process's end, whether the targets were met).
fn service(
    world: &World,
    limit: Limit,
    deadline: Duration,
    done: &dyn Fn(&serde_json::Value) -> bool,
    more: &dyn Fn(),
    done_more: &dyn Fn(&serde_json::Value) -> bool,
) -> (usize, Ended, bool) {
    let t = Instant::now();
    let mut starts = 0;
    let mut stage = 0;
    loop {
        let _ = std::fs::remove_file(world.dir.join("state/status.json"));
        let child = limit
            .command(world, &["run"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        starts += 1;
        let mut met = false;
        let ended = reap(child, || {
            let s = world.snapshot();
            if stage == 0 && done(&s) {
                more();
                stage = 1;
            }
            if stage == 1 && done_more(&s) {
                met = true;
                return true;
            }
            t.elapsed() > deadline
        });
        if met || t.elapsed() > deadline || ended.ok() {
            return (starts, ended, met);
        }
        std::thread::sleep(Duration::from_millis(100)); // RestartSec=100ms, systemd's default
    }
}

/// Rows visible to a reader: (source_path, first seen), from the npy columns.
struct Reader {
    out: PathBuf,
    known: [u64; 3],
    seen: std::collections::HashMap<String, Instant>,
}

impl Reader {
    fn poll(&mut self) {
        for split in 0..3 {
            let dir = ailhd::output::npy_dir(&self.out, split);
            let Some(n) = std::fs::read_to_string(dir.join("attributes.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .and_then(|v| v["committed_rows"].as_u64())
            else {
                continue;
            };
            if n <= self.known[split] {
                continue;
            }
            let Ok(f) = std::fs::File::open(dir.join("source_path.npy")) else {
                continue;
            };
            let mut head = [0u8; 12];
            if f.read_exact_at(&mut head, 0).is_err() {
                continue;
            }
            let (hlen, hstart) = match head[6] {
                1 => (u16::from_le_bytes([head[8], head[9]]) as u64, 10),
                _ => (
                    u32::from_le_bytes(head[8..12].try_into().unwrap()) as u64,
                    12,
                ),
            };
            let width = 256u64;
            let from = self.known[split];
            let mut buf = vec![0u8; ((n - from) * width) as usize];
            if f.read_exact_at(&mut buf, hstart + hlen + from * width)
                .is_err()
            {
                continue;
            }
            let now = Instant::now();
            for row in buf.chunks(width as usize) {
                let end = row.iter().position(|b| *b == 0).unwrap_or(row.len());
                let path = String::from_utf8_lossy(&row[..end]).to_string();
                self.seen.entry(path).or_insert(now);
            }
            self.known[split] = n;
        }
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn mb(kb: u64) -> f64 {
    kb as f64 / 1024.0
}

/// What the in-flight journal costs a batch: listing its files before they are read and
/// clearing the list after (two `pwrite`s, no `fsync`), for a micro-batch of the service and for
/// a group of 128 files of `rebuild`.
fn journal_cost(dir: &Path) {
    use ailhd::engine::inflight::{Entry, Journal, Slot};
    let state = dir.join("journal-state");
    std::fs::create_dir_all(&state).unwrap();
    let journal = Journal::for_state(&state);
    for files in [1usize, 128] {
        let entries: Vec<Entry> = (0..files)
            .map(|i| Entry {
                rel: format!("LEAK/{}", ailhd::synth::file_name(i, 1)),
                size: 81964,
                mtime_ns: 1_700_000_000_000_000_000 + i as i64,
                deaths: 0,
            })
            .collect();
        let n = 20_000 / files.max(10);
        let t = Instant::now();
        for _ in 0..n {
            drop(journal.reading(Slot::Batch, entries.clone()));
        }
        let per = t.elapsed().as_secs_f64() / n as f64;
        println!(
            "in-flight journal: {:.1} us per batch of {files} file(s) (written and cleared): {:.3}% of a core at 100 batches/s, {:.3}% at 6,000 files/s in groups of 128",
            per * 1e6,
            per * 100.0 * 100.0,
            per * 6000.0 / files as f64 * 100.0
        );
    }
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let size = args.first().copied().unwrap_or(1536) << 20;
    let stream_n = args.get(1).copied().unwrap_or(1000) as usize;
    println!("binary: {}", bin().display());
    let tmp = tempfile::tempdir().unwrap();
    journal_cost(tmp.path());
    let world = World::new(tmp.path(), "tree");
    let staging = tmp.path().join("staging");
    std::fs::create_dir_all(&staging).unwrap();
    for i in 0..60 {
        let (rel, bytes) = clip(i);
        place(&world.rec(), &rel, &bytes, &staging);
    }

    // 1. Peaks on the small tree.
    let (small_rb, log) = rebuild(&world, Limit::None);
    assert!(small_rb.ok(), "{log}");
    world.fresh();
    let (_, small_run, met) = service(
        &world,
        Limit::None,
        Duration::from_secs(120),
        &|s| committed(s) >= 60,
        &|| {},
        &|s| committed(s) >= 60,
    );
    assert!(met, "the service did not ingest the small tree");
    println!(
        "small tree (60 clips): rebuild peak RSS {:.0} MB (address space {:.0} MB); run peak RSS {:.0} MB (address space {:.0} MB)",
        mb(small_rb.max_rss_kb),
        mb(small_rb.vm_peak_kb),
        mb(small_run.max_rss_kb),
        mb(small_run.vm_peak_kb)
    );

    // 2. The whole tree, no limit.
    long_wav(&world.rec().join(LONG), size);
    zeros(&world.rec().join(ZEROS), size);
    let t = Instant::now();
    let (big_rb, log) = rebuild(&world, Limit::None);
    let rb_secs = t.elapsed().as_secs_f64();
    let st = world.status();
    println!(
        "whole tree (+ {} MB WAV + {} MB zeros): rebuild {} in {rb_secs:.1} s, peak RSS {:.0} MB (+{:.0} MB; address space {:.0} MB), {} rows, quarantined {:?}",
        size >> 20,
        size >> 20,
        big_rb.describe(),
        mb(big_rb.max_rss_kb),
        mb(big_rb.max_rss_kb) - mb(small_rb.max_rss_kb),
        mb(big_rb.vm_peak_kb),
        rows(&st),
        quarantined(&st)
    );
    if !big_rb.ok() {
        println!("  rebuild log: {}", log.lines().last().unwrap_or(""));
    }
    world.fresh();
    let (starts, big_run, met) = service(
        &world,
        Limit::None,
        Duration::from_secs(120),
        &|s| committed(s) >= 61,
        &|| {},
        &|s| committed(s) >= 61,
    );
    println!(
        "whole tree: run ingested it: {met} ({starts} start(s)), peak RSS {:.0} MB (+{:.0} MB; address space {:.0} MB)",
        mb(big_run.max_rss_kb),
        mb(big_run.max_rss_kb) - mb(small_run.max_rss_kb),
        mb(big_run.vm_peak_kb)
    );

    // 3. Under a memory limit: an address-space limit (the small tree's peak address space +
    // 768 MB: under its peak RSS + 768 MB, threads and the allocators' reservations fail at
    // random, whatever the files), and a memory cgroup (the small tree's peak RSS + 768 MB).
    let small_rss = small_rb.max_rss_kb.max(small_run.max_rss_kb) << 10;
    let small_vm = small_rb.vm_peak_kb.max(small_run.vm_peak_kb) << 10;
    let cgroup = Cgroup::new(
        &format!("ailhd-large-{}", std::process::id()),
        small_rss + (768 << 20),
    );
    let mut limits = vec![(
        format!(
            "RLIMIT_AS {} MB (the small tree's peak address space + 768 MB)",
            (small_vm + (768 << 20)) >> 20
        ),
        Limit::AddressSpace(small_vm + (768 << 20)),
    )];
    match &cgroup {
        Some(cg) => limits.push((
            format!(
                "a memory cgroup (v{}) of {} MB (the small tree's peak RSS + 768 MB)",
                if cg.v2 { 2 } else { 1 },
                (small_rss + (768 << 20)) >> 20
            ),
            Limit::Cgroup(cg),
        )),
        None => println!("no memory cgroup could be made here: that limit is not measured"),
    }
    let rec = world.rec();
    for (what, limit) in limits {
        println!("under {what}:");
        world.fresh();
        let (lim_rb, log) = rebuild(&world, limit);
        let st = world.status();
        println!(
            "  rebuild: {}, peak RSS {:.0} MB, {} valid rows, quarantined {:?}",
            lim_rb.describe(),
            mb(lim_rb.max_rss_kb),
            rows(&st),
            quarantined(&st)
        );
        if !lim_rb.ok() {
            println!(
                "  rebuild log: {}",
                log.lines().find(|l| !l.trim().is_empty()).unwrap_or("")
            );
        }
        world.fresh();
        let more = || {
            for i in 60..80 {
                let (rel, bytes) = clip(i);
                place(&rec, &rel, &bytes, &staging);
            }
        };
        let (starts, ended, met) = service(
            &world,
            limit,
            Duration::from_secs(90),
            &|s| committed(s) >= 60,
            &more,
            &|s| committed(s) >= 80,
        );
        let st = world.status();
        println!(
            "  run (restarted on failure, 90 s at most): {starts} start(s); the 60 and the 20 placed afterwards ingested: {met}; {} files committed, quarantined {:?}; peak RSS {:.0} MB",
            committed(&st),
            quarantined(&st),
            mb(ended.max_rss_kb)
        );
        if let Limit::Cgroup(cg) = limit {
            println!("  cgroup: {}", cg.events());
        }
        for i in 60..80 {
            let (rel, _) = clip(i);
            let _ = std::fs::remove_file(rec.join(rel));
        }
    }
    drop(cgroup);

    // 4. 100 recordings/s arriving while the long file is ingested.
    let world = World::new(tmp.path(), "latency");
    for i in 0..60 {
        let (rel, bytes) = clip(i);
        place(&world.rec(), &rel, &bytes, &staging);
    }
    let child = world
        .cmd(&["run"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    while committed(&world.snapshot()) < 60 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let long_staged = staging.join("long.wav");
    long_wav(&long_staged, size);
    // A file just written (copied, recorded) is in the page cache: so is this one, unless
    // LARGE_COLD=1 (then its holes are read for the first time, the kernel filling 1.5 GB of
    // pages while the stream runs).
    if std::env::var_os("LARGE_COLD").is_none() {
        let mut f = std::fs::File::open(&long_staged).unwrap();
        std::io::copy(&mut f, &mut std::io::sink()).unwrap();
    }
    // The same stream without the long file first, as a control (the host's load varies).
    for (first, with_long) in [(1000, false), (1000 + stream_n, true)] {
        let clips: Vec<(String, Vec<u8>)> = (first..first + stream_n).map(clip).collect();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let stop = stop.clone();
            let mut r = Reader {
                out: world.dir.join("out"),
                known: [0; 3],
                seen: Default::default(),
            };
            r.poll();
            r.seen.clear();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    r.poll();
                    std::thread::sleep(Duration::from_millis(2));
                }
                r.poll();
                r.seen
            })
        };
        let before = committed(&world.snapshot());
        let t0 = Instant::now();
        if with_long {
            std::fs::rename(&long_staged, world.rec().join(LONG)).unwrap();
        }
        let mut placed = Vec::with_capacity(stream_n);
        for (i, (rel, bytes)) in clips.iter().enumerate() {
            let due = t0 + Duration::from_millis(10 * i as u64);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            place(&world.rec(), rel, bytes, &staging);
            placed.push((rel.clone(), Instant::now()));
        }
        let want = before + stream_n as u64 + u64::from(with_long);
        let deadline = Instant::now() + Duration::from_secs(120);
        while committed(&world.snapshot()) < want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let seen = reader.join().unwrap();
        let mut lat: Vec<f64> = placed
            .iter()
            .filter_map(|(rel, at)| {
                seen.get(rel)
                    .map(|t| t.saturating_duration_since(*at).as_secs_f64() * 1e3)
            })
            .collect();
        lat.sort_by(|a, b| a.total_cmp(b));
        let long_ms = seen
            .get(LONG)
            .map(|t| t.duration_since(t0).as_secs_f64() * 1e3);
        println!(
            "stream of {stream_n} recordings at 100/s{}: {} seen by the reader; rename-to-visible p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms{}",
            if with_long {
                format!(", placed with the {} MB WAV", size >> 20)
            } else {
                " (control: no large file)".into()
            },
            lat.len(),
            percentile(&lat, 0.5),
            percentile(&lat, 0.9),
            percentile(&lat, 0.99),
            lat.last().copied().unwrap_or(f64::NAN),
            if with_long {
                format!(
                    "; the long WAV visible after {}",
                    long_ms.map_or("never".to_string(), |ms| format!("{ms:.0} ms"))
                )
            } else {
                String::new()
            },
        );
    }
    std::thread::sleep(Duration::from_millis(2500)); // a snapshot with the final figures
    let s = world.snapshot();
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let ended = reap(child, || false);
    println!(
        "  the service's own close-to-commit figures (its last 2,000 files): p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms; run {} (peak RSS {:.0} MB)",
        s["service"]["latency_ms_p50"].as_f64().unwrap_or(f64::NAN),
        s["service"]["latency_ms_p90"].as_f64().unwrap_or(f64::NAN),
        s["service"]["latency_ms_p99"].as_f64().unwrap_or(f64::NAN),
        ended.describe(),
        mb(ended.max_rss_kb)
    );
}
