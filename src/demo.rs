//! `ailhd demo [DIR]`: the first thing a new user runs. Makes a small synthetic labelled tree
//! (a few hundred clips that sound different per label, plus a duplicate and a broken file to
//! show what happens to those), writes a configuration for it, rebuilds it, then shows the
//! service at work: it starts `ailhd run` on the tree, drops a few new recordings in and prints
//! them arriving as a trainer's SWMR reader sees them, and stops the service. Last, it draws
//! the pictures (`status --png`, `inspect --png`) and says where everything is.
//!
//! The service runs as a child process of this same binary, started the way systemd starts it
//! (`ailhd --config FILE run`) and stopped the way systemd stops it (SIGTERM, then a clean
//! drain), so what the user sees is the real service. The reader stays in this process and is
//! a separate process from the writer, as a trainer is: HDF5 lets one process hold a file in
//! SWMR-write and another in SWMR-read mode, not one process both.

use crate::config::{DeviceChoice, Settings, SPLITS};
use crate::output::read::SwmrSplit;
use crate::rebuild::{self, Ui};
use crate::synth;
use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const DEMO_LABELS: [&str; 5] = ["BACKGROUND", "CRACK", "LEAK", "NORMAL", "UNCLASSIFIED"];
const PER_LABEL: usize = 60;

pub fn run(dir: &Path, device: DeviceChoice, ui: &Ui) -> anyhow::Result<()> {
    let recordings = dir.join("MASTER_DATASET");
    if recordings.exists() {
        anyhow::bail!(
            "{} already exists: give `ailhd demo` a new folder (or remove that one)",
            recordings.display()
        );
    }
    let written = synth::write_tree(&recordings, &DEMO_LABELS, PER_LABEL, 7)
        .with_context(|| format!("cannot write the demo tree under {}", recordings.display()))?;
    // A copy of a leak under another name (one row, two paths) and a truncated recording
    // (quarantined with its reason).
    std::fs::copy(
        &written[2 * PER_LABEL],
        recordings.join("LEAK").join("copy_of_a_leak.wav"),
    )?;
    let bytes = std::fs::read(&written[0])?;
    std::fs::write(
        recordings.join("NORMAL").join("cut_short.wav"),
        &bytes[..bytes.len() / 3],
    )?;

    let abs = std::fs::canonicalize(dir)?;
    let mut settings = Settings::default();
    settings.paths.recordings = abs.join("MASTER_DATASET");
    settings.paths.output = abs.join("output");
    settings.paths.state = abs.join("state");
    let config_path = abs.join("ailhd.toml");
    std::fs::write(
        &config_path,
        format!(
            "# Written by `ailhd demo`; every other key has its default (see config/ailhd.toml).\n[paths]\nrecordings = {:?}\noutput = {:?}\nstate = {:?}\n",
            settings.paths.recordings, settings.paths.output, settings.paths.state
        ),
    )?;
    println!(
        "demo: wrote {} synthetic recordings under {}",
        written.len() + 2,
        settings.paths.recordings.display()
    );
    let report = rebuild::rebuild(&settings, device, ui)?;
    print!("{}", rebuild::summary(&settings, &report));

    live(&settings, &config_path, device, &abs)?;

    let status_png = abs.join("status.png");
    let status = crate::status::load(&settings)?;
    crate::status::write_png(&settings, &status, &status_png)?;
    let inspected = crate::inspect::inspect(&settings, &written[2 * PER_LABEL])?;
    let inspect_png = abs.join("inspect.png");
    crate::inspect::write_png(&settings, &inspected, &inspect_png)?;
    println!(
        "\nPictures:\n  {}   the dataset (ailhd status --png)\n  {}  one recording (ailhd inspect --png)",
        status_png.display(),
        inspect_png.display()
    );
    let h5 = crate::output::hdf5_path(&settings.paths.output, &settings.outputs.hdf5_names, 0);
    println!(
        "\nRead it as the trainer does:\n  python3 -c 'import h5py; f = h5py.File(\"{}\", \"r\"); print(f[\"segments_mel\"].shape, f.attrs[\"labels_json\"])'\n  python3 -c 'import numpy as np; print(np.load(\"{}/segments_mel.npy\", mmap_mode=\"r\").shape)'\nMore:\n  ailhd --config {} status\n  ailhd --config {} inspect {}\n  ailhd --config {} run      # watch the tree and ingest new recordings as they land",
        h5.display(),
        crate::output::npy_dir(&settings.paths.output, 0).display(),
        config_path.display(),
        config_path.display(),
        written[2 * PER_LABEL].display(),
        config_path.display(),
    );
    Ok(())
}

/// New recordings dropped in while the service runs.
const LIVE_FILES: usize = 6;
/// Time between two of them.
const LIVE_GAP: Duration = Duration::from_millis(400);

/// One new recording: where it went and when it was complete (closed).
struct Dropped {
    recording_id: String,
    closed: Instant,
    seen: bool,
}

/// Kill the child if the demo fails part-way, so it never outlives `ailhd demo`.
struct Service(Option<Child>);

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn device_name(d: DeviceChoice) -> &'static str {
    match d {
        DeviceChoice::Auto => "auto",
        DeviceChoice::Cpu => "cpu",
        DeviceChoice::Cuda => "cuda",
    }
}

/// The service part of the demo (see the module notes).
fn live(
    settings: &Settings,
    config_path: &Path,
    device: DeviceChoice,
    dir: &Path,
) -> anyhow::Result<()> {
    let log_path = dir.join("service.log");
    let started = Instant::now();
    let mut service = start_service(config_path, device, &log_path)?;
    let pid = service.0.as_ref().map(|c| c.id()).unwrap_or(0);
    wait_ready(settings, &mut service, pid, &log_path)?;
    println!(
        "  running (pid {pid}), ready after {:.1} s; a trainer's SWMR reader follows committed_rows of each split",
        started.elapsed().as_secs_f64()
    );

    let mut latencies = watch_arrivals(settings, &mut service, &log_path)?;
    latencies.sort_by(f64::total_cmp);
    println!(
        "  completion-to-commit as the reader saw it (file closed -> row below committed_rows, polled every 5 ms): median {:.0} ms, max {:.0} ms",
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1]
    );

    let stop = Instant::now();
    stop_service(&mut service, &log_path)?;
    println!(
        "  stopped cleanly (SIGTERM, exit 0) in {:.2} s; `ailhd status` now counts {} rows",
        stop.elapsed().as_secs_f64(),
        crate::status::load(settings)?
            .splits
            .values()
            .map(|s| s.rows)
            .sum::<u64>()
    );
    Ok(())
}

/// Start `ailhd --config FILE run` as systemd would, its log in `log_path`.
fn start_service(
    config_path: &Path,
    device: DeviceChoice,
    log_path: &Path,
) -> anyhow::Result<Service> {
    let log = std::fs::File::create(log_path)
        .with_context(|| format!("cannot create {}", log_path.display()))?;
    let exe = std::env::current_exe().context("cannot find the ailhd executable")?;
    let mut cmd = Command::new(exe);
    // Only the demo's configuration: no AILHD_* override from the caller's environment may
    // point the service elsewhere; the device is the one the rebuild used.
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("AILHD_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("AILHD_INGEST__DEVICE", device_name(device))
        .arg("--config")
        .arg(config_path)
        .arg("--verbose")
        .arg("run")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    // Stopped with SIGTERM, as systemd would, also when the demo itself ends without its own
    // cleanup (killed, or ended by SIGPIPE when its output is piped into `head`).
    // SAFETY: prctl between fork and exec touches no memory of the parent's.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    println!(
        "\nThe service: `ailhd --config {} run` (log: {})",
        config_path.display(),
        log_path.display()
    );
    Ok(Service(Some(
        cmd.spawn().context("cannot start `ailhd run`")?,
    )))
}

/// One split's file as a trainer's reader holds it, with the rows it has seen.
type Reader = (&'static str, SwmrSplit, u64);

/// Drop the new recordings in one by one while a SWMR reader follows each split, printing
/// the rows as they arrive. Returns the milliseconds from each file's close to its row.
fn watch_arrivals(
    settings: &Settings,
    service: &mut Service,
    log_path: &Path,
) -> anyhow::Result<Vec<f64>> {
    // The reader, as a trainer holds it: each split's file open in SWMR mode, committed_rows
    // refreshed to see new rows.
    let mut readers: Vec<Reader> = Vec::new();
    for (i, &split) in SPLITS.iter().enumerate() {
        let path =
            crate::output::hdf5_path(&settings.paths.output, &settings.outputs.hdf5_names, i);
        let mut r = SwmrSplit::open(&path)?;
        let n = r.refresh()?;
        readers.push((split, r, n));
    }
    let labels = readers[0].1.label_names()?;
    let mut dropped: Vec<Dropped> = Vec::new();
    let mut latencies: Vec<f64> = Vec::new();
    let t0 = Instant::now();
    let deadline = t0 + LIVE_GAP * LIVE_FILES as u32 + Duration::from_secs(15);
    while dropped.iter().filter(|d| d.seen).count() < LIVE_FILES {
        if Instant::now() > deadline {
            bail!(
                "the service did not commit the new recordings within 15 s (see {})",
                log_path.display()
            );
        }
        if let Some(status) = service.0.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
            bail!(
                "the service stopped ({status}) before the new recordings arrived: see {}",
                log_path.display()
            );
        }
        let k = dropped.len();
        if k < LIVE_FILES && t0.elapsed() >= LIVE_GAP * k as u32 {
            dropped.push(drop_recording(settings, k, t0)?);
        }
        for reader in readers.iter_mut() {
            report_new_rows(reader, &labels, &mut dropped, &mut latencies, t0)?;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(latencies)
}

/// Write the `k`th new recording into the tree.
fn drop_recording(settings: &Settings, k: usize, t0: Instant) -> anyhow::Result<Dropped> {
    let live_labels = [
        "LEAK",
        "NORMAL",
        "CRACK",
        "BACKGROUND",
        "LEAK",
        "UNCLASSIFIED",
    ];
    let label = live_labels[k % live_labels.len()];
    // Named after the tree's own recordings (one a minute), so they follow them in time.
    let index = DEMO_LABELS.len() * PER_LABEL + k;
    let name = synth::file_name(index, 7);
    let rel = format!("{label}/{name}");
    let bytes = synth::wav_pcm16(&synth::clip(label, 77_000 + k as u64, 4096, 10.0), 4096);
    std::fs::write(settings.paths.recordings.join(&rel), bytes)?;
    let closed = Instant::now();
    println!("  {:>5.2} s  dropped   {rel}", t0.elapsed().as_secs_f64());
    Ok(Dropped {
        recording_id: format!("R{index:06}"),
        closed,
        seen: false,
    })
}

/// Print the rows a split committed since the reader last looked; a row of a dropped
/// recording marks it seen, with its latency.
fn report_new_rows(
    (split, reader, seen): &mut Reader,
    labels: &[String],
    dropped: &mut [Dropped],
    latencies: &mut Vec<f64>,
    t0: Instant,
) -> anyhow::Result<()> {
    let n = reader.refresh()?;
    if n <= *seen {
        return Ok(());
    }
    let now = Instant::now();
    let ids = reader.read_strings("recording_id", *seen..n)?;
    let cols = reader.read_rows(split, *seen..n)?;
    let file = reader
        .path()
        .file_name()
        .unwrap_or_default()
        .to_string_lossy();
    for (j, id) in ids.iter().enumerate() {
        let row = *seen + j as u64;
        let label = labels
            .get(cols.labels[j].max(0) as usize)
            .map(String::as_str)
            .unwrap_or("?");
        match dropped
            .iter_mut()
            .find(|d| &d.recording_id == id && !d.seen)
        {
            Some(d) => {
                d.seen = true;
                let ms = now.duration_since(d.closed).as_secs_f64() * 1e3;
                latencies.push(ms);
                println!(
                    "  {:>5.2} s  committed row {row} of {file} ({label}, {id}), {ms:.0} ms after the file was closed",
                    t0.elapsed().as_secs_f64(),
                );
            }
            None => println!(
                "  {:>5.2} s  row {row} of {file} ({split}, {label}): recording {id}",
                t0.elapsed().as_secs_f64(),
            ),
        }
    }
    *seen = n;
    Ok(())
}

/// Stop the service as systemd does: SIGTERM, then it drains and exits (0, within 20 s).
fn stop_service(service: &mut Service, log_path: &Path) -> anyhow::Result<()> {
    let stop = Instant::now();
    let mut child = service.0.take().expect("the service is running");
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if stop.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the service did not stop within 20 s of SIGTERM (see {})",
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    if !status.success() {
        bail!(
            "the service exited with {status} (see {})",
            log_path.display()
        );
    }
    Ok(())
}

/// Wait until the service has written its status snapshot (it does once it is up and idle).
fn wait_ready(
    settings: &Settings,
    service: &mut Service,
    pid: u32,
    log: &Path,
) -> anyhow::Result<()> {
    let snapshot: PathBuf = crate::status::snapshot_path(settings);
    let t = Instant::now();
    loop {
        if let Some(status) = service.0.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            bail!(
                "`ailhd run` stopped at once ({status}): {}",
                text.lines().last().unwrap_or("see the log")
            );
        }
        let ours = std::fs::read_to_string(&snapshot)
            .ok()
            .and_then(|s| serde_json::from_str::<crate::status::StatusReport>(&s).ok())
            .and_then(|r| r.service)
            .is_some_and(|svc| svc.pid == pid);
        if ours {
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!(
                "`ailhd run` was not ready within 30 s (see {})",
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
