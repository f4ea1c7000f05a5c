//! `ailhd run` started as systemd starts it, on a [`World`], with its log in a file and its
//! status snapshot (`<state>/status.json`) as the way to wait for what it has done.

use super::{fixtures, ok, python, World};
use std::collections::BTreeMap;
use std::path::Path;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

pub struct Service {
    pub child: Child,
    pub log: PathBuf,
    state: PathBuf,
}

impl Service {
    /// Start `run` and wait until it is up: its first status snapshot (written after the
    /// start-up rescan) is there.
    pub fn start(world: &World) -> Service {
        let s = Service::spawn(world);
        s.wait("service up", |st| st["service"].is_object());
        s
    }

    /// Start `run` under a wrapper command (`sh -c '...; exec "$@"' sh`, say), and wait until
    /// it is up.
    pub fn start_under(world: &World, wrapper: &[&str]) -> Service {
        let s = Service::spawn_cmd(world, world.cmd_under(wrapper, &["--verbose", "run"]));
        s.wait("service up", |st| st["service"].is_object());
        s
    }

    /// Start `run` without waiting for anything.
    pub fn spawn(world: &World) -> Service {
        Service::spawn_cmd(world, world.cmd(&["--verbose", "run"]))
    }

    /// Start `ailhd <args>` (`["--debug", "run"]`, say) without waiting for anything.
    pub fn spawn_args(world: &World, args: &[&str]) -> Service {
        Service::spawn_cmd(world, world.cmd(args))
    }

    /// Start `run` with fail points (`FAILPOINTS`, see the `failpoints` feature in Cargo.toml:
    /// the binary `cargo test` builds has them), and wait until it is up.
    pub fn start_failing(world: &World, failpoints: &str) -> Service {
        let s = Service::spawn_failing(world, failpoints);
        s.wait("service up", |st| st["service"].is_object());
        s
    }

    /// [`Service::start_failing`] without the wait: returns at once.
    pub fn spawn_failing(world: &World, failpoints: &str) -> Service {
        let mut cmd = world.cmd(&["--verbose", "run"]);
        cmd.env("FAILPOINTS", failpoints);
        Service::spawn_cmd(world, cmd)
    }

    fn spawn_cmd(world: &World, mut cmd: std::process::Command) -> Service {
        // A snapshot left by an earlier (killed) run must not pass for this one's.
        let _ = std::fs::remove_file(world.state().join("status.json"));
        let n = std::fs::read_dir(world.dir.path()).unwrap().count();
        let log = world.dir.path().join(format!("run-{n}.log"));
        let child = cmd
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Service {
            child,
            log,
            state: world.state(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The latest status snapshot, if one can be read.
    pub fn snapshot(&self) -> Option<serde_json::Value> {
        std::fs::read_to_string(self.state.join("status.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    }

    /// Wait (60 s at most, then fail with the log) until the status snapshot satisfies `f`.
    pub fn wait(
        &self,
        what: &str,
        mut f: impl FnMut(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let mut last = None;
        self.wait_for(what, || {
            last = self.snapshot().filter(|s| f(s));
            last.is_some()
        });
        last.expect("waited for")
    }

    /// Wait (60 s at most, then fail with the log) until `f` holds.
    pub fn wait_for(&self, what: &str, f: impl FnMut() -> bool) {
        self.wait_for_within(what, Duration::from_secs(60), f)
    }

    /// Wait (`limit` at most, then fail with the log) until `f` holds.
    pub fn wait_for_within(&self, what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(
                t.elapsed() < limit,
                "timed out waiting for {what}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM, as `systemctl stop`: it must exit 0. Returns the log.
    pub fn terminate(mut self) -> String {
        self.sigterm();
        let status = self.child.wait().unwrap();
        let log = self.log();
        assert!(status.success(), "run exited with {status:?}; log:\n{log}");
        log
    }

    /// Send SIGTERM once the process holds or catches it (`ailhd run` holds it from the line
    /// after parsing its command line): before that, in the exec and the loader, no program can
    /// answer it, and systemd counts that death as a clean stop too.
    pub fn sigterm(&mut self) {
        self.signal_once_answered(libc::SIGTERM);
    }

    /// Send `sig` as soon as the process holds or catches it.
    pub fn signal_once_answered(&mut self, sig: libc::c_int) {
        self.signal_once(sig, &["SigBlk", "SigCgt"]);
    }

    /// Send `sig` as soon as the process holds (blocks) it.
    pub fn signal_once_held(&mut self, sig: libc::c_int) {
        self.signal_once(sig, &["SigBlk"]);
    }

    /// Send `sig` as soon as one of the `/proc/PID/status` masks `masks` has it.
    fn signal_once(&mut self, sig: libc::c_int, masks: &[&str]) {
        let pid = self.child.id();
        let t = Instant::now();
        while !in_signal_masks(pid, sig, masks) && matches!(self.child.try_wait(), Ok(None)) {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "pid {pid} has not signal {sig} in {masks:?}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        unsafe { libc::kill(pid as i32, sig) };
    }

    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether one of the signal masks `masks` of `/proc/PID/status` (`SigBlk`: blocked, `SigCgt`:
/// caught) of process `pid` has `sig`.
fn in_signal_masks(pid: u32, sig: libc::c_int, masks: &[&str]) -> bool {
    let bit = 1u64 << (sig - 1);
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (key, mask) = l.split_once(':')?;
            masks
                .contains(&key)
                .then(|| u64::from_str_radix(mask.trim(), 16).ok())?
        })
        .any(|mask| mask & bit != 0)
}

impl Drop for Service {
    fn drop(&mut self) {
        // A failed test must not leave a service running.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Files holding a row, per the status snapshot.
pub fn committed(s: &serde_json::Value) -> u64 {
    s["files"]["committed"].as_u64().unwrap_or(0)
}

pub fn quarantined(s: &serde_json::Value) -> BTreeMap<String, String> {
    s["quarantined"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|q| {
                    (
                        q["path"].as_str().unwrap().to_string(),
                        q["reason"].as_str().unwrap().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

pub fn fixture_bytes(name: &str) -> Vec<u8> {
    std::fs::read(fixtures().join("wav").join(format!("{name}.wav"))).unwrap()
}

/// A synthetic 10 s clip of `label` (4096 Hz, 16-bit), as WAV bytes; `seed` makes it unique.
pub fn clip_wav(label: &str, seed: u64) -> Vec<u8> {
    ailhd::synth::wav_pcm16(&ailhd::synth::clip(label, seed, 4096, 10.0), 4096)
}

/// The label and the path of recording `i` of a series that alternates LEAK and NORMAL (its
/// file name from `synth::file_name(i, series)`).
pub fn alternating(i: usize, series: u64) -> (&'static str, String) {
    let label = ["LEAK", "NORMAL"][i % 2];
    (
        label,
        format!("{label}/{}", ailhd::synth::file_name(i, series)),
    )
}

pub fn write_via_rename(rec: &Path, rel: &str, bytes: &[u8]) {
    let dst = rec.join(rel);
    std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
    let tmp = dst.with_extension("wav.part");
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, &dst).unwrap();
}

/// What the tree holds now: hash -> labels its paths allow.
pub fn expected(world: &World) -> serde_json::Value {
    expected_in(world, 0)
}

/// [`expected`] for a tree whose label folders are at depth `label_at` (1 in directory split
/// mode: `SPLIT/LABEL/...`).
pub fn expected_in(world: &World, label_at: usize) -> serde_json::Value {
    let names = ailhd::config::Settings::default().labels.names;
    let mut map: BTreeMap<String, Vec<i16>> = BTreeMap::new();
    let files = ailhd::source::scan(&world.rec()).unwrap();
    for found in files.iter() {
        let ailhd::source::Item::Recording(rel) = found else {
            continue;
        };
        let bytes = std::fs::read(world.rec().join(rel)).unwrap();
        if ailhd::decode::decode(&bytes, 4096, 40960).is_err() {
            continue;
        }
        let Some(label) = names
            .iter()
            .position(|n| rel.split('/').nth(label_at) == Some(n.as_str()))
        else {
            continue;
        };
        if !rel.contains('/') {
            continue;
        }
        map.entry(ailhd::identity::hex(&ailhd::identity::content_hash(&bytes)))
            .or_default()
            .push(label as i16);
    }
    serde_json::to_value(map).unwrap()
}

/// Rebuild the same tree elsewhere and compare row by row with the daemon's outputs.
pub fn compare_with_rebuild(world: &World) {
    compare_with_rebuild_as(world, "", 0)
}

/// [`compare_with_rebuild`] with `splits_toml` (a `[splits]` table, or nothing) in the
/// rebuild's configuration, for a tree whose label folders are at depth `label_at`.
pub fn compare_with_rebuild_as(world: &World, splits_toml: &str, label_at: usize) {
    let other = World::new("");
    let cfg = format!(
        "[paths]\nrecordings = {:?}\noutput = {:?}\nstate = {:?}\n[ingest]\ndevice = \"cpu\"\n{splits_toml}",
        world.rec(),
        other.out(),
        other.state()
    );
    std::fs::write(&other.config, cfg).unwrap();
    ok(&other.run(&["rebuild"]));
    let spec = serde_json::json!({"daemon_out": world.out(), "rebuild_out": other.out(), "expect": expected_in(world, label_at)});
    let p = world.dir.path().join("compare.json");
    std::fs::write(&p, serde_json::to_vec(&spec).unwrap()).unwrap();
    println!("{}", python("compare_rows.py", &[p.to_str().unwrap()]));
}

/// A Python reader from tests/py (`swmr_reader.py`, `rows_keep.py`) following the outputs until
/// it is told to stop; it fails on anything a reader must never see.
pub struct PyReader {
    child: Child,
    script: &'static str,
    stop: PathBuf,
}

impl PyReader {
    /// Start `script OUTPUT_DIR STOPFILE`.
    pub fn start(world: &World, script: &'static str) -> PyReader {
        let stop = world.dir.path().join(format!("stop-{script}"));
        let child = std::process::Command::new("python3")
            .arg(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/py")
                    .join(script),
            )
            .arg(world.out())
            .arg(&stop)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        PyReader {
            child,
            script,
            stop,
        }
    }

    /// [`PyReader::start`], and wait until the script says it has opened the files (it creates
    /// `STOPFILE.open`): what the test does next (restart the service, say) cannot race its
    /// open.
    pub fn start_opened(world: &World, script: &'static str) -> PyReader {
        let mut reader = PyReader::start(world, script);
        let opened = PathBuf::from(format!("{}.open", reader.stop.display()));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !opened.exists() {
            if let Ok(Some(status)) = reader.child.try_wait() {
                panic!("{script} exited ({status}) before opening the files");
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{script} did not open the files within 120 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        reader
    }

    /// Tell it to stop; it must exit 0. Returns what it printed.
    pub fn finish(self) -> String {
        std::fs::write(&self.stop, b"").unwrap();
        let out = self.child.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{} failed:\n{text}", self.script);
        text
    }
}

/// Committed rows per split of the HDF5 outputs, read as a SWMR reader does (the service may run).
pub fn committed_rows(world: &World) -> Vec<u64> {
    per_split(world, |f| f.refresh())
}

/// `f` of each split's HDF5 file, opened as an SWMR reader.
pub fn per_split(
    world: &World,
    f: impl Fn(&mut ailhd::output::read::SwmrSplit) -> anyhow::Result<u64>,
) -> Vec<u64> {
    [
        "TRAINING_DATASET.H5",
        "VALIDATION_DATASET.H5",
        "TESTING_DATASET.H5",
    ]
    .iter()
    .map(|n| {
        ailhd::output::read::SwmrSplit::open(&world.out().join(n))
            .and_then(|mut s| f(&mut s))
            .unwrap()
    })
    .collect()
}

/// Rows each split's HDF5 file holds (its datasets' extent), committed or not.
pub fn hdf5_extents(world: &World) -> Vec<u64> {
    per_split(world, |f| f.extent("blake3"))
}
