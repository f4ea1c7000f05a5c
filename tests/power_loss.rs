//! Power cuts, a failing disk and SIGKILLs, with the real binary (issue 28).
//!
//! The outputs and the state (`paths.output`, `paths.state`) sit on a test file system served
//! through FUSE from this process (tests/common/faultfs.rs): it keeps only what was made
//! durable (a file's bytes at its fsync, a folder's entries at the folder's fsync), forgets the
//! rest at a power cut, and fails operations with EIO on command. The recordings stay on the
//! normal disk. What the contract promises (docs/reading.md and docs/operations.md, "Durability and failing disks") is checked
//! as a reader and an operator see it:
//!
//! - a reader's view: an SWMR reader in this process samples `committed_rows` and every row
//!   below it (`blake3`, `source_path`, `valid`) all along; no row it saw may change or
//!   disappear, and `committed_rows` never goes down, whatever happens to the service or the
//!   disk (through kills all along; across a power cut, once the restarted service has settled:
//!   until it has recovered, the disk holds only what was durable; while the disk refuses
//!   writes, a dip from a refused publish the reader saw is allowed only if the service then
//!   publishes those rows again: see `failing_disk`);
//! - after a power cut: the service starts by itself; once it has settled (every recording
//!   committed, the files closed while idle) h5py opens every split plainly with exactly
//!   `committed_rows` rows, the outputs hold one row per recording (nothing duplicated) and equal
//!   a `rebuild` of the same tree by content (tests/py/compare_rows.py, npy columns included);
//! - a failing disk: the service stays up, says so (`status --json`, the log), resumes by itself
//!   within seconds of the disk's return, and loses nothing;
//! - a SIGKILL storm (no FUSE): no row a reader saw changes or disappears;
//! - the manifest alone (sled, in a child process), cut at each sync of an open that
//!   deallocates its log's free segments and of the write after it: no acknowledged record lost,
//!   no record other than as it was or as rewritten.
//!
//! Checks are gathered rather than stopping at the first failure, so one run shows every way the
//! service falls short; each test fails at its end with the list. `POWER_LOSS_SEED` repeats a
//! run's random timings (each test prints its seed).

use crate::common::faultfs::{FaultFs, Mode};
use crate::common::service::*;
use crate::common::*;
use ailhd::output::read::SwmrSplit;
use serial_test::serial;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const FAST: &str = "[ingest]\nsettle_ms = 100\nquarantine_after_s = 2\nmax_batch_latency_ms = 10\nrescan_interval_s = 0\ndevice = \"cpu\"\n";
const NAMES: [&str; 3] = [
    "TRAINING_DATASET.H5",
    "VALIDATION_DATASET.H5",
    "TESTING_DATASET.H5",
];
/// How soon after the disk's return the service must be writing again. Its backoff doubles
/// up to 30 s; after ~10 s of failures the next try is at most 8 s away.
const RESUME_WITHIN: Duration = Duration::from_secs(12);

fn seed(test: &str) -> u64 {
    let s = std::env::var("POWER_LOSS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("{test}: seed {s} (POWER_LOSS_SEED={s} repeats its timings)");
    s
}

fn tail(text: &str, lines: usize) -> String {
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// Failed checks, gathered.
#[derive(Default)]
struct Checks {
    failures: Vec<String>,
}

impl Checks {
    fn fail(&mut self, what: impl Into<String>) {
        let what = what.into();
        eprintln!("power_loss: CHECK FAILED: {what}");
        self.failures.push(what);
    }
    fn check(&mut self, r: Result<(), String>) {
        if let Err(e) = r {
            self.fail(e);
        }
    }
    fn finish(self, test: &str) {
        if !self.failures.is_empty() {
            let mut text = format!("{test}: {} checks failed:\n", self.failures.len());
            for (i, f) in self.failures.iter().enumerate() {
                text += &format!("--- {}: {}\n", i + 1, tail(f, 40));
            }
            panic!("{text}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Recordings arriving

/// Recordings written into the tree (the normal disk): recording i is `alternating(i, 8)`
/// with bytes of its own, renamed into place.
#[derive(Clone)]
struct Feed {
    rec: PathBuf,
    written: Arc<AtomicUsize>,
}

impl Feed {
    fn new(world: &World) -> Feed {
        Feed {
            rec: world.rec(),
            written: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn count(&self) -> usize {
        self.written.load(Ordering::SeqCst)
    }

    fn write_next(&self) {
        let i = self.count();
        let (label, rel) = alternating(i, 8);
        write_via_rename(&self.rec, &rel, &clip_wav(label, 60_000 + i as u64));
        self.written.store(i + 1, Ordering::SeqCst);
    }

    /// `n` recordings now.
    fn add(&self, n: usize) {
        for _ in 0..n {
            self.write_next();
        }
    }

    /// Recordings at `per_s` a second from a thread, until stopped.
    fn stream(&self, per_s: u64) -> Stream {
        let stop = Arc::new(AtomicBool::new(false));
        let rate = Arc::new(AtomicU64::new(per_s));
        let (feed, stop2, rate2) = (self.clone(), stop.clone(), rate.clone());
        let handle = std::thread::spawn(move || {
            let mut next = Instant::now();
            while !stop2.load(Ordering::SeqCst) {
                feed.write_next();
                next += Duration::from_secs_f64(1.0 / rate2.load(Ordering::SeqCst).max(1) as f64);
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                } else {
                    next = now;
                }
            }
        });
        Stream {
            stop,
            rate,
            handle: Some(handle),
        }
    }
}

struct Stream {
    stop: Arc<AtomicBool>,
    rate: Arc<AtomicU64>,
    handle: Option<JoinHandle<()>>,
}

impl Stream {
    fn set_rate(&self, per_s: u64) {
        self.rate.store(per_s, Ordering::SeqCst);
    }
    fn finish(mut self) {
        self.end();
    }
    fn end(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            h.join().expect("the recording stream panicked");
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.end();
    }
}

// ---------------------------------------------------------------------------------------------
// A reader keeping row numbers

#[derive(Clone, PartialEq, Debug)]
struct Row {
    hash: [u8; 32],
    path: String,
    valid: u8,
}

impl std::fmt::Display for Row {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let h: String = self.hash[..6].iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "{h}.. {} valid={}", self.path, self.valid)
    }
}

/// Every row a reader has seen below `committed_rows`, per split.
#[derive(Clone, Default)]
struct Seen {
    rows: [Vec<Row>; 3],
}

impl Seen {
    fn total(&self) -> usize {
        self.rows.iter().map(Vec::len).sum()
    }
}

fn read_split(f: &mut SwmrSplit) -> anyhow::Result<Vec<Row>> {
    let c = f.refresh()?;
    let (_, hashes) = f.read_bytes("blake3", 0..c)?;
    let paths = f.read_strings("source_path", 0..c)?;
    let (_, valid) = f.read_bytes("valid", 0..c)?;
    anyhow::ensure!(
        hashes.len() == 32 * c as usize && paths.len() == c as usize && valid.len() == c as usize,
        "{}: short read below committed_rows {c}",
        f.path().display()
    );
    Ok((0..c as usize)
        .map(|i| Row {
            hash: hashes[32 * i..32 * i + 32].try_into().unwrap(),
            path: paths[i].clone(),
            valid: valid[i],
        })
        .collect())
}

/// A count a reader saw and then saw lower, while the disk refused writes: `(from, to)`.
type Dip = (usize, usize);

/// Compare what a reader sees now with what it saw; what it sees is added. A count lower than
/// the one seen is a violation, or, given `dips` (a disk that refuses writes: see
/// [`failing_disk`]), a dip recorded there, which the test then holds to account.
fn compare_rows(
    split: &str,
    seen: &mut Vec<Row>,
    now: Vec<Row>,
    violations: &mut BTreeSet<String>,
    dips: Option<&mut Vec<Dip>>,
) {
    if now.len() < seen.len() {
        match dips {
            Some(d) => {
                if d.last() != Some(&(seen.len(), now.len())) {
                    d.push((seen.len(), now.len()));
                }
            }
            None => {
                violations.insert(format!(
                    "{split}: committed_rows went down from {} (seen by the reader) to {}",
                    seen.len(),
                    now.len()
                ));
            }
        }
    }
    for (i, (a, b)) in seen.iter().zip(&now).enumerate() {
        if a != b {
            violations.insert(format!(
                "{split}: row {i} changed under the reader: it held {a}, now {b}"
            ));
        }
    }
    for (i, r) in now.iter().enumerate() {
        if r.hash == [0; 32] || r.path.is_empty() {
            violations.insert(format!(
                "{split}: row {i} below committed_rows {} is torn ({r})",
                now.len()
            ));
        }
    }
    if now.len() >= seen.len() {
        *seen = now;
    }
}

struct ReaderOut {
    seen: Seen,
    violations: BTreeSet<String>,
    /// Per split, where the reader was started with `dips`.
    dips: [Vec<Dip>; 3],
    samples: u64,
    errors: u64,
    last_error: Option<String>,
}

/// An SWMR reader in a thread of its own, sampling every split every ~25 ms and holding the
/// files open (reopened after an error), as a trainer does.
struct SwmrReader {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<ReaderOut>>,
}

impl SwmrReader {
    fn start(out: PathBuf, seen: Seen) -> SwmrReader {
        Self::start_with(out, seen, false)
    }

    /// `dips`: a count lower than one seen is recorded ([`ReaderOut::dips`]), not a violation.
    fn start_with(out: PathBuf, seen: Seen, dips: bool) -> SwmrReader {
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut r = ReaderOut {
                seen,
                violations: BTreeSet::new(),
                dips: Default::default(),
                samples: 0,
                errors: 0,
                last_error: None,
            };
            let mut files: [Option<SwmrSplit>; 3] = [None, None, None];
            while !stop2.load(Ordering::SeqCst) {
                for (i, name) in NAMES.iter().enumerate() {
                    let path = out.join(name);
                    if files[i].is_none() {
                        if !path.exists() {
                            continue;
                        }
                        match SwmrSplit::open(&path) {
                            Ok(f) => files[i] = Some(f),
                            Err(e) => {
                                r.errors += 1;
                                r.last_error = Some(format!("{e:#}"));
                                continue;
                            }
                        }
                    }
                    match read_split(files[i].as_mut().unwrap()) {
                        Ok(now) => compare_rows(
                            name,
                            &mut r.seen.rows[i],
                            now,
                            &mut r.violations,
                            dips.then_some(&mut r.dips[i]),
                        ),
                        Err(e) => {
                            r.errors += 1;
                            r.last_error = Some(format!("{e:#}"));
                            files[i] = None;
                        }
                    }
                }
                r.samples += 1;
                std::thread::sleep(Duration::from_millis(25));
            }
            r
        });
        SwmrReader {
            stop,
            handle: Some(handle),
        }
    }

    /// Stop it (its files are closed) and take what it saw.
    fn finish(mut self) -> ReaderOut {
        self.stop.store(true, Ordering::SeqCst);
        self.handle
            .take()
            .unwrap()
            .join()
            .expect("the reader panicked")
    }
}

impl Drop for SwmrReader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// One look at every split by a reader opening them now (SWMR): it must open them, and
/// what it saw before must still be there. Returns the violations.
fn look(out: &Path, seen: &mut Seen) -> Vec<String> {
    let mut v = BTreeSet::new();
    for (i, name) in NAMES.iter().enumerate() {
        let path = out.join(name);
        if !path.exists() && seen.rows[i].is_empty() {
            continue;
        }
        match SwmrSplit::open(&path).and_then(|mut f| read_split(&mut f)) {
            Ok(now) => compare_rows(name, &mut seen.rows[i], now, &mut v, None),
            Err(e) => {
                v.insert(format!("{name}: an SWMR reader cannot read it: {e:#}"));
            }
        }
    }
    v.into_iter().collect()
}

fn reader_report(phase: &str, r: &ReaderOut, checks: &mut Checks) {
    for v in &r.violations {
        checks.fail(format!("{phase}: reader: {v}"));
    }
    if r.samples == 0 {
        checks.fail(format!("{phase}: the reader took no sample"));
    }
}

// ---------------------------------------------------------------------------------------------
// The service

/// Start `run` and wait until it is up; fail fast (with the log) if it exits.
fn start(world: &World) -> Result<Service, String> {
    let mut svc = Service::spawn(world);
    let t = Instant::now();
    loop {
        if let Ok(Some(status)) = svc.child.try_wait() {
            return Err(format!(
                "the service exited at start ({status}); log:\n{}",
                tail(&svc.log(), 25)
            ));
        }
        if svc.snapshot().is_some_and(|s| s["service"].is_object()) {
            return Ok(svc);
        }
        if t.elapsed() > Duration::from_secs(60) {
            return Err(format!(
                "the service did not come up in 60 s; log:\n{}",
                tail(&svc.log(), 25)
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn alive(svc: &mut Service) -> Result<(), String> {
    match svc.child.try_wait() {
        Ok(None) => Ok(()),
        Ok(Some(status)) => Err(format!(
            "the service exited ({status}); log:\n{}",
            tail(&svc.log(), 25)
        )),
        Err(e) => Err(format!("waiting for the service: {e}")),
    }
}

/// Wait until its status snapshot satisfies `f` (the service must stay up meanwhile).
fn wait(
    svc: &mut Service,
    what: &str,
    limit: Duration,
    mut f: impl FnMut(&serde_json::Value) -> bool,
) -> Result<serde_json::Value, String> {
    let t = Instant::now();
    let mut last = None;
    loop {
        alive(svc).map_err(|e| format!("waiting for {what}: {e}"))?;
        if let Some(s) = svc.snapshot() {
            if f(&s) {
                return Ok(s);
            }
            last = Some(s);
        }
        if t.elapsed() > limit {
            return Err(format!(
                "waited {} s for {what}; last status: {}; log:\n{}",
                limit.as_secs(),
                last.map(|s| s.to_string()).unwrap_or_default(),
                tail(&svc.log(), 25)
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every recording committed, nothing queued, the outputs closed while idle.
fn settled(files: usize) -> impl FnMut(&serde_json::Value) -> bool {
    move |s| {
        committed(s) == files as u64
            && s["service"]["queue_depth"] == 0
            && s["service"]["outputs_open"] == false
            && s["service"]["write_failing"].is_null()
    }
}

/// A Python checker from tests/py, as `common::python` runs it, but returning its failure.
fn py(script: &str, args: &[&Path]) -> Result<String, String> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths = vec![repo.join("python"), repo.join("tests/py")];
    if let Some(p) = std::env::var_os("PYTHONPATH") {
        paths.extend(std::env::split_paths(&p));
    }
    let o = Command::new("python3")
        .arg(repo.join("tests/py").join(script))
        .args(args)
        .env("PYTHONPATH", std::env::join_paths(paths).unwrap())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 with h5py and numpy (. .ci/setup)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    if o.status.success() {
        Ok(text)
    } else {
        Err(format!("{script}: {}", tail(&text, 120)))
    }
}

/// h5py opens every split plainly, each dataset with exactly `committed_rows` rows, and the
/// outputs hold one row per recording.
fn plain_readers(world: &World, files: usize) -> Result<(), String> {
    let text = py("plain_open.py", &[&world.out()])?;
    let total: usize = text
        .rsplit("total ")
        .next()
        .and_then(|t| t.trim().parse().ok())
        .ok_or_else(|| format!("plain_open.py said {text}"))?;
    if total != files {
        return Err(format!(
            "the outputs hold {total} rows for {files} recordings (each was written once, none deleted): {text}"
        ));
    }
    Ok(())
}

/// The outputs equal a rebuild of the same tree by content (common::compare_with_rebuild,
/// whose failure is a panic: caught and returned).
fn equals_rebuild(world: &World) -> Result<(), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| compare_with_rebuild(world))).map_err(
        |p| {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            format!(
                "the outputs differ from a rebuild of the same tree: {}",
                tail(&msg, 12)
            )
        },
    )
}

// ---------------------------------------------------------------------------------------------
// The file system itself

#[test]
#[serial]
fn faultfs_keeps_only_what_was_made_durable_and_fails_on_command() {
    let dir = tempfile::tempdir().unwrap();
    let mut fs = FaultFs::mount(&dir.path().join("m"));
    let m = fs.path().to_path_buf();
    let sync_dir = |p: &Path| std::fs::File::open(p).unwrap().sync_all().unwrap();
    let write_sync = |p: &Path, b: &[u8]| {
        std::fs::write(p, b).unwrap();
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .sync_all()
            .unwrap();
    };

    // Durable: written, synced, its folder synced.
    std::fs::create_dir(m.join("d")).unwrap();
    sync_dir(&m);
    write_sync(&m.join("d/kept"), b"kept");
    write_sync(&m.join("d/old"), b"old bytes");
    write_sync(&m.join("d/removed"), b"removed");
    write_sync(&m.join("d/trunc"), &[7u8; 50_000]);
    write_sync(&m.join("d/mapped"), &[0u8; 40_000]);
    write_sync(&m.join("d/holes"), &[9u8; 60_000]);
    sync_dir(&m.join("d"));
    // Written over without a sync: the old bytes come back.
    std::fs::write(m.join("d/old"), b"new bytes, longer").unwrap();
    // Removed without a folder sync: back.
    std::fs::remove_file(m.join("d/removed")).unwrap();
    // A new file synced, but not its folder: gone.
    write_sync(&m.join("d/new"), b"new");
    // Renamed over a durable file, the folder not synced: the old one stays.
    write_sync(&m.join("d/tmp"), b"replacement");
    std::fs::rename(m.join("d/tmp"), m.join("d/kept")).unwrap();
    // A folder made and synced inside, but the parent not synced: gone with its file.
    std::fs::create_dir(m.join("lost")).unwrap();
    write_sync(&m.join("lost/f"), b"f");
    sync_dir(&m.join("lost"));
    // Truncated and synced: the size is durable; truncated again, not synced: not.
    {
        let f = std::fs::File::options()
            .write(true)
            .open(m.join("d/trunc"))
            .unwrap();
        f.set_len(20_000).unwrap();
        f.sync_all().unwrap();
        f.set_len(10).unwrap();
    }
    // Holes punched (`fallocate(PUNCH_HOLE | KEEP_SIZE)`, as sled frees a log segment): read
    // as zeros at once, size kept; durable at the file's sync, like a write.
    {
        use std::os::fd::AsRawFd;
        let f = std::fs::File::options()
            .write(true)
            .open(m.join("d/holes"))
            .unwrap();
        let punch = |at: i64, len: i64| {
            let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, at, len) };
            assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        };
        punch(100, 40_000);
        f.sync_all().unwrap();
        punch(50_000, 20_000);
    }
    let holes = std::fs::read(m.join("d/holes")).unwrap();
    assert_eq!(holes.len(), 60_000, "the size is kept");
    assert!(holes[..100].iter().all(|&b| b == 9) && holes[40_100..50_000].iter().all(|&b| b == 9));
    assert!(holes[100..40_100].iter().all(|&b| b == 0) && holes[50_000..].iter().all(|&b| b == 0));
    assert_eq!(fs.stats().punches, 2);
    // Shared writable mapping: msync makes it durable, an unsynced change is lost. (Mapped by
    // another process: a FUSE server must not serve page faults of its own process.)
    let mmap = r#"
import mmap, sys
with open(sys.argv[1], "r+b") as f:
    m = mmap.mmap(f.fileno(), 0)
    m[100] = 1
    m[39999] = 2
    m.flush()
    m[200] = 3
    m.close()
"#;
    let o = Command::new("python3")
        .args(["-c", mmap])
        .arg(m.join("d/mapped"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // O_DIRECT is refused as tmpfs does; statfs says there is room; flock works locally.
    use std::os::unix::fs::OpenOptionsExt;
    let e = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.join("d/kept"))
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
    let c = std::ffi::CString::new(m.as_os_str().as_encoded_bytes()).unwrap();
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    assert!(st.f_bavail as u64 * st.f_frsize as u64 > 1 << 40);
    {
        use std::os::fd::AsRawFd;
        let a = std::fs::File::open(m.join("d/kept")).unwrap();
        let b = std::fs::File::open(m.join("d/kept")).unwrap();
        assert_eq!(
            unsafe { libc::flock(a.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
            0
        );
        assert_ne!(
            unsafe { libc::flock(b.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
            0
        );
    }
    assert_eq!(std::fs::read(m.join("d/kept")).unwrap(), b"replacement");

    fs.cut();
    let names: BTreeSet<String> = std::fs::read_dir(m.join("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(
        names,
        ["holes", "kept", "mapped", "old", "removed", "trunc"]
            .map(String::from)
            .into(),
        "after the cut"
    );
    assert_eq!(std::fs::read(m.join("d/kept")).unwrap(), b"kept");
    assert_eq!(std::fs::read(m.join("d/old")).unwrap(), b"old bytes");
    assert_eq!(std::fs::read(m.join("d/removed")).unwrap(), b"removed");
    assert!(!m.join("lost").exists());
    assert_eq!(std::fs::read(m.join("d/trunc")).unwrap(), vec![7u8; 20_000]);
    let mapped = std::fs::read(m.join("d/mapped")).unwrap();
    assert_eq!((mapped[100], mapped[39_999], mapped[200]), (1, 2, 0));
    let holes = std::fs::read(m.join("d/holes")).unwrap();
    let nines = |r: std::ops::Range<usize>| holes[r].iter().all(|&b| b == 9);
    assert_eq!(holes.len(), 60_000);
    assert!(
        holes[100..40_100].iter().all(|&b| b == 0),
        "the synced hole"
    );
    assert!(
        nines(0..100) && nines(40_100..60_000),
        "the unsynced hole is gone"
    );

    // EIO on command, and back.
    fs.fail(Mode::AllWrites);
    let eio = |r: std::io::Result<()>| {
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EIO));
    };
    eio(std::fs::write(m.join("d/kept"), b"x"));
    eio(std::fs::File::create(m.join("d/x")).map(drop));
    eio(std::fs::create_dir(m.join("e")));
    eio(std::fs::rename(m.join("d/kept"), m.join("d/k2")));
    eio(std::fs::remove_file(m.join("d/old")));
    eio(std::fs::File::open(m.join("d")).and_then(|f| f.sync_all()));
    assert_eq!(
        std::fs::read(m.join("d/kept")).unwrap(),
        b"kept",
        "reads work"
    );
    fs.fail(Mode::FsyncOnly);
    std::fs::write(m.join("d/kept"), b"written").unwrap();
    eio(std::fs::File::options()
        .write(true)
        .open(m.join("d/kept"))
        .and_then(|f| f.sync_all()));
    eio(std::fs::File::open(m.join("d")).and_then(|f| f.sync_all()));
    fs.fail(Mode::None);
    write_sync(&m.join("d/kept"), b"works again");
    assert!(fs.stats().failed >= 8, "{:?}", fs.stats());

    // A cut at a given sync: the state just before it.
    let base = fs.stats().syncs();
    write_sync(&m.join("d/a"), b"a");
    sync_dir(&m.join("d"));
    fs.cut_at_sync(base + 4);
    write_sync(&m.join("d/b"), b"b");
    let r = std::fs::File::open(m.join("d")).and_then(|f| f.sync_all());
    assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EIO));
    assert!(fs.is_off());
    assert!(std::fs::read(m.join("d/a")).is_err(), "the power is off");
    fs.cut();
    assert_eq!(std::fs::read(m.join("d/a")).unwrap(), b"a");
    assert!(!m.join("d/b").exists());
    assert_eq!(std::fs::read(m.join("d/kept")).unwrap(), b"works again");
    println!("faultfs: {:?}", fs.stats());
}

/// The same random operations (pwrite, append, truncate, writes through a shared mapping with
/// and without msync, rename, unlink) on the test file system and on the normal disk give the
/// same results and leave the same bytes (tests/py/fs_differential.py, in a process of its own):
/// what the service writes reads back as from a local disk.
#[test]
#[serial]
fn faultfs_reads_back_what_was_written_as_a_local_disk_does() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::mount(&dir.path().join("m"));
    let plain = dir.path().join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    let seed = seed("faultfs_differential") % 1_000_000_007;
    let out = py(
        "fs_differential.py",
        &[
            fs.path(),
            &plain,
            Path::new(&seed.to_string()),
            Path::new("2000"),
        ],
    );
    match out {
        Ok(text) => println!("faultfs: {}; {:?}", text.trim(), fs.stats()),
        Err(e) => panic!("{e}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Power cuts

/// The service with its outputs and state on the fault file system. Fields drop in order: the
/// service, then the file system (unmounted), then the world's folder.
struct Rig {
    svc: Option<Service>,
    fs: FaultFs,
    world: World,
    feed: Feed,
    /// What the reader has seen so far, carried across cuts.
    seen: Seen,
    checks: Checks,
    rng: ailhd::synth::Rng,
}

impl Rig {
    fn new(extra_toml: &str, seed: u64) -> Rig {
        let world = World::with_paths(extra_toml, "fs/out", "fs/state");
        let fs = FaultFs::mount(&world.dir.path().join("fs"));
        // The folders exist, durably, before the service first starts (the package's
        // tmpfiles.d makes /var/lib/ailhd/... at install): what it makes inside them is its own.
        std::fs::create_dir(world.out()).unwrap();
        std::fs::create_dir(world.state()).unwrap();
        std::fs::File::open(fs.path()).unwrap().sync_all().unwrap();
        let feed = Feed::new(&world);
        Rig {
            svc: None,
            fs,
            world,
            feed,
            seen: Seen::default(),
            checks: Checks::default(),
            rng: ailhd::synth::Rng::new(seed),
        }
    }

    fn rand(&mut self, below: u64) -> u64 {
        self.rng.next_u64() % below.max(1)
    }

    fn svc(&mut self) -> &mut Service {
        self.svc.as_mut().expect("the service is running")
    }

    /// The power goes (or has gone): the service dies with it, then the cut and the remount.
    fn cut(&mut self) {
        self.fs.power_off();
        if let Some(svc) = self.svc.take() {
            svc.kill9();
        }
        self.fs.cut();
    }

    /// Wait until the power has gone or `done` holds of the status snapshot (`limit` at most);
    /// whether the power went.
    fn until_off_or(
        &mut self,
        limit: Duration,
        mut done: impl FnMut(&serde_json::Value) -> bool,
    ) -> bool {
        let t = Instant::now();
        while t.elapsed() < limit {
            if self.fs.is_off() {
                return true;
            }
            if self.svc().snapshot().is_some_and(|s| done(&s)) {
                return self.fs.is_off();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.fs.is_off()
    }

    /// After a cut: the service starts by itself; once it has settled (every recording
    /// committed, the files closed while idle) the rows the reader saw before the cut are all
    /// there unchanged (`keep_rows`), plain readers open every split, there is one row per
    /// recording, and the outputs equal a rebuild. False if the service could not be started.
    fn restart_and_check(&mut self, what: &str, keep_rows: bool) -> bool {
        let files = self.feed.count();
        match start(&self.world) {
            Ok(svc) => self.svc = Some(svc),
            Err(e) => {
                self.checks.fail(format!(
                    "{what}: the service does not start after the power cut: {e}"
                ));
                return false;
            }
        }
        let settled = wait(
            self.svc(),
            "every recording committed and the outputs closed while idle",
            Duration::from_secs(120),
            settled(files),
        );
        // The rows the reader saw before the cut, once the service has recovered and settled
        // (between the power's return and the recovery, the disk holds only what was durable:
        // no service can keep a reader from seeing that).
        if keep_rows {
            for v in look(&self.world.out(), &mut self.seen) {
                self.checks
                    .fail(format!("{what}: once the service is up again: {v}"));
            }
        }
        match settled {
            Ok(_) => {
                let r = plain_readers(&self.world, files);
                self.checks.check(r.map_err(|e| format!("{what}: {e}")));
                let r = equals_rebuild(&self.world);
                self.checks.check(r.map_err(|e| format!("{what}: {e}")));
            }
            Err(e) => {
                self.checks.fail(format!("{what}: {e}"));
                if alive(self.svc()).is_err() {
                    // Dead: one more start, as systemd would, so the phase goes on if it can.
                    self.svc = start(&self.world).ok();
                    return self.svc.is_some();
                }
            }
        }
        if !keep_rows {
            self.seen = Seen::default();
            let _ = look(&self.world.out(), &mut self.seen);
        }
        true
    }

    /// Cuts while recordings arrive at 100/s: at a random time, or at a random sync.
    fn ingest_cuts(&mut self, n: usize) -> usize {
        let mut done = 0;
        let mut syncs_per_s = None;
        for k in 0..n {
            let reader = SwmrReader::start(self.world.out(), self.seen.clone());
            let base = self.fs.stats().syncs();
            let before = self.feed.count();
            let t0 = Instant::now();
            let stream = self.feed.stream(100);
            let point = match syncs_per_s {
                Some(rate) if k % 2 == 1 => {
                    let x = 1 + self.rand((rate * 1.2) as u64);
                    self.fs.cut_at_sync(base + x);
                    if self.until_off_or(Duration::from_secs(3), |_| false) {
                        format!("at sync +{x}")
                    } else {
                        format!("at 3 s (sync +{x} did not come)")
                    }
                }
                _ => {
                    let ms = 150 + self.rand(1200);
                    std::thread::sleep(Duration::from_millis(ms));
                    format!("at {ms} ms")
                }
            };
            self.fs.power_off();
            let elapsed = t0.elapsed();
            let syncs = self.fs.stats().syncs() - base;
            syncs_per_s.get_or_insert(syncs as f64 / elapsed.as_secs_f64());
            if let Some(svc) = self.svc.take() {
                svc.kill9();
            }
            stream.finish();
            let r = reader.finish();
            reader_report(&format!("ingest cut {k}"), &r, &mut self.checks);
            self.seen = r.seen;
            self.cut();
            done += 1;
            println!(
                "power_loss: ingest cut {k}: {point} into a 100/s stream: {} recordings arrived, {syncs} syncs, the reader had seen {} rows ({} samples, {} read errors)",
                self.feed.count() - before,
                self.seen.total(),
                r.samples,
                r.errors
            );
            if !self.restart_and_check(&format!("ingest cut {k} ({point})"), true) {
                break;
            }
        }
        done
    }

    /// Cuts in the idle close (`ingest.idle_close_s`) and in the reopen by the next file.
    fn idle_cuts(&mut self, n: usize) -> usize {
        // How many syncs a reopen (to the commit of its file) and an idle close take.
        let b0 = self.fs.stats().syncs();
        self.feed.add(2);
        let files = self.feed.count();
        let r = wait(self.svc(), "the reopen", Duration::from_secs(60), |s| {
            committed(s) == files as u64
        });
        if let Err(e) = r {
            self.checks.fail(format!("idle: {e}"));
            return 0;
        }
        let b1 = self.fs.stats().syncs();
        let r = wait(self.svc(), "the idle close", Duration::from_secs(60), |s| {
            s["service"]["outputs_open"] == false
        });
        if let Err(e) = r {
            self.checks.fail(format!("idle: {e}"));
            return 0;
        }
        let (reopen, close) = (b1 - b0, self.fs.stats().syncs() - b1);
        println!("power_loss: idle: a reopen takes {reopen} syncs, an idle close {close}");
        let mut done = 0;
        for k in 0..n {
            let reader = SwmrReader::start(self.world.out(), self.seen.clone());
            let point = if k % 2 == 0 {
                self.feed.add(2);
                let files = self.feed.count() as u64;
                let r = wait(self.svc(), "the new files", Duration::from_secs(60), |s| {
                    committed(s) == files
                });
                self.checks
                    .check(r.map(drop).map_err(|e| format!("idle cut {k}: {e}")));
                if close > 0 && k % 4 == 0 {
                    let x = 1 + self.rand(close);
                    self.fs.cut_at_sync(self.fs.stats().syncs() + x);
                    if self.until_off_or(Duration::from_secs(10), |s| {
                        s["service"]["outputs_open"] == false
                    }) {
                        format!("in the idle close, at sync +{x} of {close}")
                    } else {
                        "just after the idle close".to_string()
                    }
                } else {
                    // Around the close (1 s after the last work): before, during or after it.
                    let ms = 500 + self.rand(1200);
                    std::thread::sleep(Duration::from_millis(ms));
                    format!("{ms} ms after the last commit, around the idle close (at ~1000 ms, {close} syncs)")
                }
            } else {
                let x = 1 + self.rand(reopen);
                self.fs.cut_at_sync(self.fs.stats().syncs() + x);
                self.feed.add(2);
                let files = self.feed.count() as u64;
                if self.until_off_or(Duration::from_secs(10), |s| committed(s) == files) {
                    format!("in the reopen by a new file, at sync +{x} of {reopen}")
                } else {
                    "just after the reopen".to_string()
                }
            };
            self.fs.power_off();
            if let Some(svc) = self.svc.take() {
                svc.kill9();
            }
            let r = reader.finish();
            reader_report(&format!("idle cut {k}"), &r, &mut self.checks);
            self.seen = r.seen;
            self.cut();
            done += 1;
            println!(
                "power_loss: idle cut {k}: {point}; the reader had seen {} rows",
                self.seen.total()
            );
            if !self.restart_and_check(&format!("idle cut {k} ({point})"), true) {
                break;
            }
        }
        done
    }

    /// Stop the service as systemd does (SIGTERM): it must exit 0.
    fn stop(&mut self) {
        if let Some(mut svc) = self.svc.take() {
            svc.sigterm();
            let status = svc.child.wait().unwrap();
            if !status.success() {
                self.checks.fail(format!(
                    "stopping the service: {status}; log:\n{}",
                    tail(&svc.log(), 25)
                ));
            }
        }
    }

    /// Cuts in `ailhd rebuild` (the service stopped, as it must be), spread over its syncs and
    /// weighted to the last ones: its swap.
    fn rebuild_cuts(&mut self, n: usize) -> usize {
        self.stop();
        let base = self.fs.stats().syncs();
        let o = self.world.run(&["rebuild"]);
        if !o.status.success() {
            self.checks.fail(format!(
                "rebuild on the test file system failed: {}",
                String::from_utf8_lossy(&o.stderr)
            ));
            return 0;
        }
        let total = (self.fs.stats().syncs() - base).max(1);
        println!(
            "power_loss: rebuild: a rebuild of {} recordings takes {total} syncs",
            self.feed.count()
        );
        let mut done = 0;
        for k in 0..n {
            let x = match k % 6 {
                0..=2 => 1 + (k as u64 % 3) * total / 3 + self.rand(total / 3),
                _ => total - self.rand(total.min(8)),
            }
            .clamp(1, total);
            let base = self.fs.stats().syncs();
            self.fs.cut_at_sync(base + x);
            let log = self.world.dir.path().join(format!("rebuild-{k}.log"));
            let mut child = self
                .world
                .cmd(&["rebuild"])
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap();
            let t = Instant::now();
            let mut exited = None;
            while !self.fs.is_off() && t.elapsed() < Duration::from_secs(120) {
                if let Ok(Some(s)) = child.try_wait() {
                    exited = Some(s);
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let point = match exited {
                Some(s) if !self.fs.is_off() => {
                    format!("after the rebuild ended ({s}) before sync {x} of {total}")
                }
                _ => format!("at sync {x} of {total}"),
            };
            self.fs.power_off();
            let _ = child.kill();
            let _ = child.wait();
            self.cut();
            done += 1;
            println!("power_loss: rebuild cut {k}: {point}");
            if !self.restart_and_check(&format!("rebuild cut {k} ({point})"), false) {
                break;
            }
            if k + 1 < n {
                self.stop();
            }
        }
        done
    }
}

/// Power cuts at 24 points: 12 while recordings arrive, 6 in the idle close and the reopen,
/// 6 in a `rebuild` (its swap included). After each: the checks of [`Rig::restart_and_check`].
/// Each phase has a world of its own, so one that breaks the outputs for good does not keep
/// the others from running.
#[test]
#[serial]
fn power_cuts_lose_nothing_a_reader_saw_and_leave_outputs_equal_to_a_rebuild() {
    let seed = seed("power_cuts");
    let t = Instant::now();
    let mut checks = Checks::default();
    let mut recordings = 0;
    let mut phase = |name: &str, first: usize, seed: u64, run: &dyn Fn(&mut Rig) -> usize| {
        let mut rig = Rig::new(&format!("{FAST}idle_close_s = 1\n"), seed);
        rig.feed.add(first);
        let n = match start(&rig.world) {
            Ok(svc) => {
                rig.svc = Some(svc);
                match wait(
                    rig.svc(),
                    "the first recordings",
                    Duration::from_secs(120),
                    settled(first),
                ) {
                    Ok(_) => {
                        let _ = look(&rig.world.out(), &mut rig.seen);
                        let n = run(&mut rig);
                        rig.stop();
                        n
                    }
                    Err(e) => {
                        rig.checks.fail(format!("{name}: {e}"));
                        0
                    }
                }
            }
            Err(e) => {
                rig.checks.fail(format!(
                    "{name}: the service does not start on the test file system: {e}"
                ));
                0
            }
        };
        println!(
            "power_loss: {name}: {n} cut points, {} recordings; file system: {:?}",
            rig.feed.count(),
            rig.fs.stats()
        );
        recordings += rig.feed.count();
        checks.failures.append(&mut rig.checks.failures);
        n
    };
    let ingest = phase("ingest", 20, seed, &|rig| rig.ingest_cuts(12));
    let idle = phase("idle", 20, seed ^ 1, &|rig| rig.idle_cuts(6));
    let rebuild = phase("rebuild", 150, seed ^ 2, &|rig| rig.rebuild_cuts(6));
    let total = ingest + idle + rebuild;
    println!(
        "power_loss: {total} cut points: ingest {ingest}, rebuild {rebuild}, idle {idle} ({recordings} recordings, {:.0} s)",
        t.elapsed().as_secs_f64(),
    );
    if total < 20 {
        checks.fail(format!(
            "only {total} cut points ran (the phases stopped early)"
        ));
    }
    checks.finish("power cuts");
}

// ---------------------------------------------------------------------------------------------
// A failing disk

/// Each dip of the reader's count (`ReaderOut::dips`) must be a refused publish that the
/// service redid (see [`failing_disk`]): its log says `<file>: publishing rows <to>..<k>`
/// with `k` at least the count seen.
fn explain_dips(test: &str, r: &ReaderOut, log: &str, checks: &mut Checks) {
    for (i, name) in NAMES.iter().enumerate() {
        for &(from, to) in &r.dips[i] {
            let needle = format!("{name}: publishing rows {to}..");
            let redone = log.match_indices(&needle).any(|(at, _)| {
                let rest = &log[at + needle.len()..];
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse::<usize>().is_ok_and(|k| k >= from)
            });
            if !redone {
                checks.fail(format!(
                    "{test}: reader: {name}: committed_rows went down from {from} (seen by the reader) to {to}, and the log shows no publish of rows {to}..{from} redone; log:\n{}",
                    tail(log, 25)
                ));
            }
        }
    }
}

/// `rounds` faults (`mode`) of 6-10 s each, at a random moment of a 100/s stream (which slows
/// to 10/s after the fault's first second). Each round: the service stays up, `status --json`
/// and the log say writing fails, it resumes within [`RESUME_WITHIN`] of the disk's return and
/// takes up every recording. Throughout: the reader's rows. At the end: plain readers, one row
/// per recording, equal to a rebuild.
///
/// A disk that refuses writes shows them to readers all the same while they are under way: the
/// kernel copies a write into its page cache before the file system answers, and a reader reads
/// a cached page without waiting for the write (it drops the page once the write fails). Through
/// this file system, with every write refused, a reader of the bytes being rewritten in a loop
/// saw the refused bytes in 29% of its reads (0.62 of 2.1 million, 2-vCPU VM). So a reader may
/// see `committed_rows` of a publish that the disk then refused, and after it the count on disk,
/// a batch lower. That batch's rows were synced and recorded in the manifest before the publish
/// (docs/operations.md, "Durability and failing disks"), and the service publishes them again
/// when the disk answers. The reader records such a dip instead of failing at once, and the test
/// holds each one to account: the log must show that publish redone from the lower count to at
/// least the count seen, and a reader opening the files at the end must find every row it saw.
/// Anything else (rows cut, a count that stays lower) fails.
fn failing_disk(test: &str, mode: Mode, rounds: usize) {
    let seed = seed(test);
    let mut rig = Rig::new(FAST, seed);
    rig.feed.add(20);
    match start(&rig.world) {
        Ok(svc) => rig.svc = Some(svc),
        Err(e) => panic!("the service does not start on the test file system: {e}"),
    }
    let first = wait(
        rig.svc(),
        "the first recordings",
        Duration::from_secs(60),
        |s| committed(s) == 20,
    );
    if let Err(e) = first {
        panic!("{e}");
    }
    let reader = SwmrReader::start_with(rig.world.out(), Seen::default(), true);
    let t_all = Instant::now();
    let mut resumes = Vec::new();
    let mut ran = 0;
    for round in 0..rounds {
        ran += 1;
        let what = format!("{test} round {round}");
        let stream = rig.feed.stream(100);
        std::thread::sleep(Duration::from_millis(200 + rig.rand(1300)));
        let fault = Duration::from_millis(6000 + rig.rand(4001));
        rig.fs.fail(mode);
        let t0 = Instant::now();
        let mut said = None::<String>;
        let mut status_errors = Vec::new();
        let mut died = None;
        while t0.elapsed() < fault {
            if t0.elapsed() > Duration::from_secs(1) {
                stream.set_rate(10);
            }
            if died.is_none() {
                if let Err(e) = alive(rig.svc()) {
                    died = Some(e);
                }
            }
            if said.is_none() {
                let o = rig.world.run(&["status", "--json"]);
                match serde_json::from_slice::<serde_json::Value>(&o.stdout) {
                    Ok(s) if o.status.success() => {
                        if s["service"]["write_failing"].is_object() {
                            said = Some(s["service"]["write_failing"].to_string());
                        }
                    }
                    _ => status_errors.push(format!(
                        "{}: {}",
                        o.status,
                        tail(&String::from_utf8_lossy(&o.stderr), 3)
                    )),
                }
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        stream.finish();
        rig.fs.fail(Mode::None);
        let t1 = Instant::now();
        let log = rig.svc().log();
        if let Some(e) = died {
            rig.checks.fail(format!(
                "{what}: the service died while the disk failed ({mode:?}): {e}"
            ));
            // Started again, as systemd would, to see what else holds.
            match start(&rig.world) {
                Ok(svc) => rig.svc = Some(svc),
                Err(e) => {
                    rig.checks
                        .fail(format!("{what}: and does not start again: {e}"));
                    break;
                }
            }
        } else {
            match &said {
                Some(_) => {}
                None => rig.checks.fail(format!(
                    "{what}: `status --json` never said writing fails in {:.0} s of {mode:?} (write_failing stayed null{})",
                    fault.as_secs_f64(),
                    if status_errors.is_empty() {
                        String::new()
                    } else {
                        format!("; status failed {} times: {}", status_errors.len(), status_errors[0])
                    }
                )),
            }
            if !log.contains("writing failed") {
                rig.checks.fail(format!(
                    "{what}: the log does not say writing failed; log:\n{}",
                    tail(&log, 10)
                ));
            }
            // sled's background threads log each failed flush or fsync (every 500 ms while the
            // disk fails); the service says it itself, once and at each retry.
            let sled = log.matches("periodic flush thread").count();
            if sled > 0 {
                rig.checks.fail(format!(
                    "{what}: sled's own messages reach the log ({sled} lines about its periodic flush thread)"
                ));
            }
        }
        let files = rig.feed.count() as u64;
        let resumed = wait(rig.svc(), "writing again", RESUME_WITHIN, |s| {
            committed(s) == files && s["service"]["write_failing"].is_null()
        });
        match resumed {
            Ok(_) => resumes.push(t1.elapsed().as_secs_f64()),
            Err(e) => {
                rig.checks.fail(format!(
                    "{what}: not writing again {} s after the disk's return: {e}",
                    RESUME_WITHIN.as_secs()
                ));
                // Give it a while longer so that the next rounds still say something.
                let more = wait(rig.svc(), "writing again", Duration::from_secs(60), |s| {
                    committed(s) == files && s["service"]["write_failing"].is_null()
                });
                if let Err(e) = more {
                    rig.checks.fail(format!("{what}: {e}"));
                    if alive(rig.svc()).is_err() {
                        match start(&rig.world) {
                            Ok(svc) => rig.svc = Some(svc),
                            Err(_) => break,
                        }
                    }
                }
            }
        }
        println!(
            "power_loss: {what}: {mode:?} for {:.1} s; status said {}; writing again {:.1} s after the disk's return",
            fault.as_secs_f64(),
            said.as_deref().unwrap_or("nothing"),
            t1.elapsed().as_secs_f64()
        );
    }
    let mut read = reader.finish();
    reader_report(test, &read, &mut rig.checks);
    let dips = read.dips.iter().map(Vec::len).sum::<usize>();
    if dips > 0 {
        let log = rig.svc().log();
        explain_dips(test, &read, &log, &mut rig.checks);
    }
    println!(
        "power_loss: {test}: {dips} dips of committed_rows (refused publishes, see failing_disk)"
    );
    println!(
        "power_loss: {test}: {ran} rounds of {rounds} in {:.0} s, {} recordings; writing again after {resumes:.1?} s; reader: {} samples, {} rows seen, {} read errors{}",
        t_all.elapsed().as_secs_f64(),
        rig.feed.count(),
        read.samples,
        read.seen.total(),
        read.errors,
        read.last_error.map(|e| format!(" (last: {e})")).unwrap_or_default()
    );
    if ran < rounds {
        rig.checks
            .fail(format!("{test}: only {ran} of {rounds} rounds ran"));
    }
    let files = rig.feed.count();
    if rig.svc.is_some() && alive(rig.svc()).is_err() {
        // Dead at the end: started again as systemd would, to see what it recovers.
        rig.svc = start(&rig.world)
            .map_err(|e| rig.checks.fail(format!("{test}: at the end: {e}")))
            .ok();
    }
    if rig.svc.is_some() {
        let r = wait(
            rig.svc(),
            "everything committed",
            Duration::from_secs(60),
            |s| committed(s) == files as u64 && s["service"]["queue_depth"] == 0,
        );
        rig.checks
            .check(r.map(drop).map_err(|e| format!("{test}: at the end: {e}")));
        // Every row the reader saw, dips or not, is there again.
        for v in look(&rig.world.out(), &mut read.seen) {
            rig.checks.fail(format!(
                "{test}: at the end, a reader opening the files: {v}"
            ));
        }
        rig.stop();
        let r = plain_readers(&rig.world, files);
        rig.checks
            .check(r.map_err(|e| format!("{test}: at the end: {e}")));
        let r = equals_rebuild(&rig.world);
        rig.checks
            .check(r.map_err(|e| format!("{test}: at the end: {e}")));
    }
    let checks = std::mem::take(&mut rig.checks);
    drop(rig);
    checks.finish(test);
}

/// A publish the disk refuses, seen by a reader while its write was under way (see
/// [`failing_disk`]), is published again once the disk answers: the count comes back to what the
/// reader saw, from the manifest's record, and no row is cut. Made to happen, not waited for: a
/// fail point holds the first batch between the manifest's flush and the publish while the disk
/// starts refusing writes, slowly enough for the reader to catch the refused count. ailhd_reader
/// follows the service all along, both sources (its close of a file it only read reports the
/// service's refused writes through this file system: it must not fail on that).
#[test]
#[serial]
fn a_refused_publish_a_reader_saw_is_redone_when_the_disk_answers() {
    let test = "refused_publish";
    let seed = seed(test);
    let mut rig = Rig::new(FAST, seed);
    rig.feed.add(20);
    // Test builds (feature `failpoints`): the first batch that appends rows sleeps between the
    // manifest's flush and the outputs' publish.
    rig.svc = Some(Service::start_failing(
        &rig.world,
        "commit-before-publish=1*sleep(3000)",
    ));
    let reader = SwmrReader::start_with(rig.world.out(), Seen::default(), true);
    // ailhd_reader beside it, as a trainer runs it: its snapshots never shrink, and no read
    // fails or changes (tests/py/reader_follow.py).
    let stop = rig.world.dir.path().join("reader_follow.stop");
    let follow = {
        let (out, stop) = (rig.world.out(), stop.clone());
        std::thread::spawn(move || python("reader_follow.py", &[out.as_os_str(), stop.as_os_str()]))
    };
    // Rows on disk beyond committed_rows: the held batch.
    let held = |out: &Path| -> bool {
        NAMES.iter().any(|n| {
            SwmrSplit::open(&out.join(n))
                .and_then(|mut f| Ok(f.extent("valid")? > f.refresh()?))
                .unwrap_or(false)
        })
    };
    let out = rig.world.out();
    rig.svc()
        .wait_for("a batch held before its publish", || held(&out));
    // The manifest records the batch a moment after its rows are on disk; then the disk fails.
    std::thread::sleep(Duration::from_millis(500));
    rig.fs.refuse_slowly(Duration::from_millis(300));
    rig.fs.fail(Mode::AllWrites);
    let svc = rig.svc.as_ref().expect("started above");
    svc.wait_for_within("the publish to fail", Duration::from_secs(20), || {
        svc.log().contains("writing failed")
    });
    std::thread::sleep(Duration::from_millis(500));
    rig.fs.fail(Mode::None);
    rig.fs.refuse_slowly(Duration::ZERO);
    let r = wait(rig.svc(), "writing again", Duration::from_secs(30), |s| {
        committed(s) == 20 && s["service"]["write_failing"].is_null()
    });
    rig.checks.check(r.map(drop));
    std::thread::sleep(Duration::from_millis(200));
    let mut read = reader.finish();
    std::fs::write(&stop, b"").unwrap();
    match follow.join() {
        Ok(text) => println!("power_loss: {test}: {}", text.trim()),
        Err(_) => rig.checks.fail(format!(
            "{test}: ailhd_reader failed while following the service (its output is above)"
        )),
    }
    reader_report(test, &read, &mut rig.checks);
    let log = rig.svc().log();
    let dips: Vec<_> = read.dips.iter().flatten().collect();
    println!("power_loss: {test}: the reader's dips: {dips:?}");
    if dips.is_empty() {
        rig.checks.fail(format!(
            "{test}: the reader never saw the refused publish, so this tested nothing; log:\n{}",
            tail(&log, 25)
        ));
    }
    explain_dips(test, &read, &log, &mut rig.checks);
    if log.contains("never recorded in the manifest") {
        rig.checks
            .fail(format!("{test}: rows were cut; log:\n{}", tail(&log, 25)));
    }
    for v in look(&rig.world.out(), &mut read.seen) {
        rig.checks.fail(format!(
            "{test}: after the disk's return, a reader opening the files: {v}"
        ));
    }
    if read.seen.total() != 20 {
        rig.checks.fail(format!(
            "{test}: the reader sees {} rows at the end, not 20",
            read.seen.total()
        ));
    }
    let checks = std::mem::take(&mut rig.checks);
    drop(rig);
    checks.finish(test);
}

#[test]
#[serial]
fn every_write_failing_for_seconds_is_ridden_out_and_nothing_is_lost() {
    failing_disk("eio_all_writes", Mode::AllWrites, 10);
}

#[test]
#[serial]
fn fsync_alone_failing_for_seconds_is_ridden_out_and_nothing_is_lost() {
    failing_disk("eio_fsync_only", Mode::FsyncOnly, 10);
}

// ---------------------------------------------------------------------------------------------
// SIGKILL storm

/// kill -9 at random moments of a 100/s stream (the normal disk), 15 times, an SWMR reader
/// following the outputs all along: no row it saw changes or disappears; then every recording
/// has its one row, equal to a rebuild's.
#[test]
#[serial]
fn a_sigkill_storm_takes_back_no_row_a_reader_saw() {
    let seed = seed("sigkill_storm");
    let mut rng = ailhd::synth::Rng::new(seed);
    let world = World::new(FAST);
    let feed = Feed::new(&world);
    let mut checks = Checks::default();
    feed.add(20);
    let svc = start(&world).unwrap_or_else(|e| panic!("{e}"));
    svc.wait("the first recordings", |s| committed(s) == 20);
    let reader = SwmrReader::start(world.out(), Seen::default());
    let stream = feed.stream(100);
    svc.kill9();
    let kills = 15;
    for k in 0..kills {
        // Mostly once it is up and working; every third time while it starts (recovering).
        let s = if k % 3 == 2 {
            Some(Service::spawn(&world))
        } else {
            match start(&world) {
                Ok(s) => Some(s),
                Err(e) => {
                    checks.fail(format!("kill {k}: the service does not start again: {e}"));
                    None
                }
            }
        };
        let Some(s) = s else { break };
        let ms = if k % 3 == 2 {
            20 + rng.next_u64() % 300
        } else {
            100 + rng.next_u64() % 900
        };
        std::thread::sleep(Duration::from_millis(ms));
        s.kill9();
    }
    let svc = match start(&world) {
        Ok(s) => Some(s),
        Err(e) => {
            checks.fail(format!("after the storm the service does not start: {e}"));
            None
        }
    };
    stream.finish();
    let files = feed.count();
    let mut svc = svc;
    if let Some(s) = svc.as_mut() {
        let r = wait(s, "everything committed", Duration::from_secs(120), |s| {
            committed(s) == files as u64 && s["service"]["queue_depth"] == 0
        });
        checks.check(r.map(drop));
        std::thread::sleep(Duration::from_millis(300));
    }
    let r = reader.finish();
    reader_report("sigkill storm", &r, &mut checks);
    println!(
        "power_loss: sigkill storm: {kills} kills, {files} recordings; reader: {} samples, {} rows seen, {} read errors{}",
        r.samples,
        r.seen.total(),
        r.errors,
        r.last_error.map(|e| format!(" (last: {e})")).unwrap_or_default()
    );
    if let Some(s) = svc {
        s.terminate();
        checks.check(plain_readers(&world, files));
        checks.check(equals_rebuild(&world));
    }
    checks.finish("sigkill storm");
}

/// The role a re-run of this test binary plays in
/// [`power_cuts_around_sleds_punched_segments_lose_no_acknowledged_record`]: `fill`, `touch
/// ROUND`, `check`. sled runs in that child, never in this process: this process serves the
/// file system, and a cut unmounts it, which sled's own threads holding files open would stop.
const MANIFEST_CHILD: &str = "AILHD_POWER_LOSS_MANIFEST_CHILD";
/// Records of the manifest the cuts are made around; the first [`TOUCHED`] are rewritten after
/// every cut.
const RECORDS: usize = 4_000;
const TOUCHED: usize = 100;
const FILL_ROUNDS: u64 = 12;

fn manifest_record(round: u64) -> ailhd::engine::manifest::FileRecord {
    ailhd::engine::manifest::FileRecord {
        hash: Some([7; 32]),
        size: 81_964 + round,
        mtime_ns: 5,
        quarantine: None,
        updated_ms: 0,
    }
}

fn manifest_path(i: usize) -> String {
    format!("LEAK/S{i:05}~R1~20250118120530~100.wav")
}

/// The child's side: prints `child: ...` lines, exits 0 when everything it did succeeded.
fn manifest_child(role: &str, dir: &Path) -> ! {
    use ailhd::engine::manifest::{Manifest, ManifestBatch};
    let run = || -> Result<(), String> {
        if role == "compact" {
            // Opens the manifest itself, and leaves it closed.
            let done = ailhd::engine::compact::compact(dir).map_err(|e| format!("{e:#}"))?;
            println!("child: compacted {} swapped {}", done.records, done.swapped);
            return Ok(());
        }
        let m = Manifest::open(dir).map_err(|e| format!("open: {e}"))?;
        let mut words = role.split(' ');
        match (
            words.next(),
            words.next().and_then(|w| w.parse::<u64>().ok()),
        ) {
            (Some("fill"), _) => {
                // Every record rewritten round after round: sled's log ends up with free
                // segments, which each later open deallocates.
                for round in 0..FILL_ROUNDS {
                    for chunk in (0..RECORDS).collect::<Vec<_>>().chunks(500) {
                        let mut b = ManifestBatch::default();
                        for &i in chunk {
                            b.put_file(&manifest_path(i), &manifest_record(round));
                        }
                        m.apply(b).map_err(|e| e.to_string())?;
                        m.flush().map_err(|e| e.to_string())?;
                    }
                }
            }
            (Some("touch"), Some(round)) => {
                let mut b = ManifestBatch::default();
                for i in 0..TOUCHED {
                    b.put_file(&manifest_path(i), &manifest_record(round));
                }
                m.apply(b).map_err(|e| format!("apply: {e}"))?;
                m.flush().map_err(|e| format!("flush: {e}"))?;
                println!("child: flushed");
            }
            (Some("check"), _) => {
                let mut sizes = Vec::new();
                for r in m.files() {
                    let (rel, rec) = r.map_err(|e| e.to_string())?;
                    sizes.push(format!("{rel}={}", rec.size));
                }
                println!("child: records {}", sizes.join(" "));
            }
            _ => return Err(format!("unknown role {role:?}")),
        }
        Ok(())
    };
    let code = match run() {
        Ok(()) => 0,
        Err(e) => {
            println!("child: failed: {e}");
            1
        }
    };
    std::process::exit(code)
}

/// For test `test` of the manifest under power cuts: in its child process, play
/// [`manifest_child`]'s role (and exit); in the test itself, a manifest filled by a child on a
/// test file system mounted in `tmp`, and its folder.
fn filled_manifest(test: &str, tmp: &Path) -> (FaultFs, PathBuf) {
    if let Ok(role) = std::env::var(MANIFEST_CHILD) {
        let dir = PathBuf::from(std::env::var_os("AILHD_POWER_LOSS_MANIFEST_DIR").unwrap());
        manifest_child(&role, &dir);
    }
    let fs = FaultFs::mount(&tmp.join("m"));
    let dir = fs.path().join("state");
    let (ok, lines) = run_manifest_child(test, "fill", &dir);
    assert!(ok, "filling the manifest: {lines:?}");
    (fs, dir)
}

/// Runs this test binary again as [`manifest_child`]; (exited 0, its `child:` lines).
fn run_manifest_child(test: &str, role: &str, dir: &Path) -> (bool, Vec<String>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(MANIFEST_CHILD, role)
        .env("AILHD_POWER_LOSS_MANIFEST_DIR", dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = String::new();
    use std::io::Read;
    let reader = {
        let mut stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            let _ = stdout.read_to_string(&mut out);
            out
        })
    };
    let status = exit_within(&mut child, Duration::from_secs(120))
        .unwrap_or_else(|| panic!("the manifest child `{role}` did not end within 120 s"));
    let out = reader.join().unwrap();
    let lines = out
        .lines()
        // (The harness's "test ... " precedes the first line.)
        .filter_map(|l| l.split_once("child: ").map(|(_, rest)| rest.to_string()))
        .collect();
    (status.success(), lines)
}

/// sled deallocates its log's free segments at every open (vendor/README.md): a power cut at
/// each sync of an open and of the write after it, on the test file system, loses no record a
/// flush had acknowledged and leaves every other record as it was or as it was rewritten, never
/// something else; and every open reads the manifest whole again.
#[test]
#[serial]
fn power_cuts_around_sleds_punched_segments_lose_no_acknowledged_record() {
    let test = "power_loss::power_cuts_around_sleds_punched_segments_lose_no_acknowledged_record";
    let tmp = tempfile::tempdir().unwrap();
    let (mut fs, dir) = filled_manifest(test, tmp.path());
    // What each record must hold now, and what it may hold besides (a rewrite not acknowledged).
    let mut durable: Vec<u64> = vec![FILL_ROUNDS - 1; RECORDS];
    let (mut cuts_after_a_punch, mut punches) = (0, 0);
    for x in 1..=16u64 {
        let round = 100 + x;
        let before = fs.stats();
        fs.cut_at_sync(before.syncs() + x);
        let (_, lines) = run_manifest_child(test, &format!("touch {round}"), &dir);
        let after = fs.stats();
        let punched = after.punches - before.punches;
        punches += punched;
        let went = fs.is_off();
        if went && punched > 0 {
            cuts_after_a_punch += 1;
        }
        let flushed = lines.iter().any(|l| l == "flushed");
        fs.cut();
        let (ok, lines) = run_manifest_child(test, "check", &dir);
        assert!(
            ok,
            "round {round}, after a cut at sync {x} of the reopen: {lines:?}"
        );
        let records: Vec<(String, u64)> = lines
            .iter()
            .find_map(|l| l.strip_prefix("records "))
            .unwrap_or_else(|| panic!("round {round}: no records in {lines:?}"))
            .split(' ')
            .map(|kv| {
                let (k, v) = kv.rsplit_once('=').unwrap();
                (k.to_string(), v.parse::<u64>().unwrap() - 81_964)
            })
            .collect();
        assert_eq!(records.len(), RECORDS, "round {round}: records lost");
        for (i, (rel, got)) in records.iter().enumerate() {
            assert_eq!(rel, &manifest_path(i));
            let new = i < TOUCHED;
            assert!(
                *got == durable[i] || (new && *got == round),
                "round {round}, cut at sync {x}: {rel} holds round {got}, expected {}{}",
                durable[i],
                if new {
                    format!(" or {round}")
                } else {
                    String::new()
                }
            );
            if new && flushed {
                assert_eq!(
                    *got, round,
                    "round {round}: {rel}: an acknowledged flush was lost"
                );
            }
            durable[i] = *got;
        }
        println!(
            "power_loss: manifest round {round}: cut at sync {x}: power went {went}, {punched} \
             segments punched, flush acknowledged {flushed}"
        );
        if !went {
            break; // the open and the write made fewer syncs than x: every instant was cut
        }
    }
    println!("power_loss: manifest: {:?}", fs.stats());
    assert!(
        punches > 0,
        "no open deallocated a free segment: the fill left none"
    );
    assert!(
        cuts_after_a_punch > 0,
        "no cut came after a punch: the new path was not cut around"
    );
}

/// `ailhd compact` (engine::compact) cut by a power cut at each of its syncs, on the test file
/// system: every record is still there afterwards, as it was, whether the cut left the original
/// or the copy; nothing is left beside the manifest once it is opened; and a compaction that
/// runs to its end leaves the records too.
#[test]
#[serial]
fn power_cuts_during_a_compaction_leave_one_whole_manifest() {
    let test = "power_loss::power_cuts_during_a_compaction_leave_one_whole_manifest";
    let tmp = tempfile::tempdir().unwrap();
    let (mut fs, dir) = filled_manifest(test, tmp.path());
    let (mut cuts, mut finished) = (0, false);
    for x in 1..=200u64 {
        let before = fs.stats();
        fs.cut_at_sync(before.syncs() + x);
        let (ok, lines) = run_manifest_child(test, "compact", &dir);
        let went = fs.is_off();
        fs.cut();
        if !went {
            // Fewer syncs than x: it ran to its end, and put the copy in place (the records
            // rewritten round after round take the original far more space).
            assert!(ok, "compacting without a cut: {lines:?}");
            assert!(
                lines.iter().any(|l| l.ends_with("swapped true")),
                "the copy was not swapped in: {lines:?}"
            );
            finished = true;
        } else {
            cuts += 1;
        }
        let (ok, lines) = run_manifest_child(test, "check", &dir);
        assert!(ok, "after a cut at sync {x} of a compaction: {lines:?}");
        let records: Vec<&str> = lines
            .iter()
            .find_map(|l| l.strip_prefix("records "))
            .unwrap_or_else(|| panic!("cut at sync {x}: no records in {lines:?}"))
            .split(' ')
            .collect();
        assert_eq!(records.len(), RECORDS, "cut at sync {x}: records lost");
        for (i, kv) in records.iter().enumerate() {
            let expected = format!("{}={}", manifest_path(i), 81_964 + FILL_ROUNDS - 1);
            assert_eq!(*kv, expected, "cut at sync {x}");
        }
        let beside: Vec<String> = std::fs::read_dir(fs.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("state."))
            .collect();
        assert!(beside.is_empty(), "cut at sync {x}: left {beside:?}");
        if finished {
            break;
        }
    }
    println!(
        "power_loss: compaction: {cuts} cuts, then one to its end; {:?}",
        fs.stats()
    );
    assert!(finished, "200 cuts and the compaction never ran to its end");
    assert!(cuts >= 3, "only {cuts} syncs were cut around");
}
