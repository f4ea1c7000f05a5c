//! What an operator meets around the service, with the real binary: `check-config` checking
//! the folders the service needs, a killed rebuild's staging cleaned up, `ailhd reload`
//! reporting an accepted and a refused configuration through its exit status, and the metrics
//! textfile the running service keeps.

use crate::common::service::{
    clip_wav, committed, compare_with_rebuild, write_via_rename, Service,
};
use crate::common::*;
use serial_test::serial;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

const FAST: &str = "[ingest]\nsettle_ms = 100\nrescan_interval_s = 0\ndevice = \"cpu\"\n";

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn set_path(world: &World, key: &str, value: &Path) {
    let text = std::fs::read_to_string(&world.config).unwrap();
    let text = text
        .lines()
        .map(|l| {
            if l.starts_with(&format!("{key} =")) {
                format!("{key} = {value:?}")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&world.config, text + "\n").unwrap();
}

fn refused(world: &World, key: &str, path: &Path) {
    refused_by(world, &["check-config"], key, path);
}

/// `args` exits 2 naming `key` and `path`.
fn refused_by(world: &World, args: &[&str], key: &str, path: &Path) {
    let o = world.run(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}, {key}: {err}");
    assert!(
        err.contains(key) && err.contains(path.to_str().unwrap()),
        "expected {key} and {} in: {err}",
        path.display()
    );
}

#[test]
#[serial]
fn check_config_checks_the_folders_the_service_needs() {
    let world = World::new("");
    // Missing output and state whose parent is writable: fine, and not created by the check.
    ok(&world.run(&["check-config"]));
    assert!(!world.out().exists() && !world.state().exists());
    assert_eq!(
        std::fs::read_dir(world.dir.path()).unwrap().count(),
        2,
        "the probe file was left behind"
    );

    // Recordings: missing, or not a folder.
    let missing = world.dir.path().join("no-such-tree");
    set_path(&world, "recordings", &missing);
    refused(&world, "paths.recordings", &missing);
    let file = world.dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    set_path(&world, "recordings", &file);
    refused(&world, "paths.recordings", &file);
    // `rebuild` refuses both the same way, before it makes, locks or stages anything.
    for bad in [&missing, &file] {
        set_path(&world, "recordings", bad);
        refused_by(
            &world,
            &["rebuild", "--device", "cpu"],
            "paths.recordings",
            bad,
        );
        assert!(
            !world.out().exists() && !world.state().exists(),
            "a refused rebuild made the output or state folder"
        );
    }
    set_path(&world, "recordings", &world.rec());

    // Output that cannot be created (under a file), or in a folder nobody may write (/proc
    // refuses new files even to root).
    let under_file = file.join("out");
    set_path(&world, "output", &under_file);
    refused(&world, "paths.output", &under_file);
    let proc_out = Path::new("/proc/ailhd-check-output");
    set_path(&world, "output", proc_out);
    refused(&world, "paths.output", proc_out);
    set_path(&world, "output", &world.out());
    ok(&world.run(&["check-config"]));
}

#[test]
#[serial]
fn check_config_refuses_a_state_folder_the_service_user_cannot_write() {
    let world = World::new("");
    std::fs::create_dir_all(world.out()).unwrap();
    std::fs::set_permissions(world.out(), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::create_dir_all(world.state()).unwrap();
    std::fs::set_permissions(world.state(), std::fs::Permissions::from_mode(0o555)).unwrap();
    // Root writes anywhere: check as an unprivileged user then (the service's own situation),
    // with a copy of the binary that user can reach (the build folder may be private).
    let root = unsafe { libc::geteuid() } == 0;
    let mut cmd = world.cmd(&["check-config"]);
    if root {
        std::fs::set_permissions(world.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let copy = world.dir.path().join("ailhd");
        std::fs::copy(bin(), &copy).unwrap();
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
        cmd = std::process::Command::new(&copy);
        cmd.arg("--config")
            .arg(&world.config)
            .arg("check-config")
            .env_remove("AILHD_CONFIG");
        use std::os::unix::process::CommandExt;
        cmd.uid(65534).gid(65534);
    }
    let o = cmd.output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("paths.state")
            && err.contains(world.state().to_str().unwrap())
            && err.contains("not writable"),
        "{err}"
    );
    std::fs::set_permissions(world.state(), std::fs::Permissions::from_mode(0o755)).unwrap();
    ok(&world.run(&["check-config"]));
}

fn add_recordings(world: &World, n: usize) {
    let bytes = std::fs::read(fixtures().join("wav/leak_pcm16.wav")).unwrap();
    for i in 0..n {
        let dir = world.rec().join(["LEAK", "NORMAL"][i % 2]);
        std::fs::create_dir_all(&dir).unwrap();
        let mut b = bytes.clone();
        let last = b.len() - 2;
        b[last..].copy_from_slice(&(i as u16).to_le_bytes());
        std::fs::write(dir.join(format!("S{i:03}~R{i}~20250118120530~100.wav")), b).unwrap();
    }
}

#[test]
#[serial]
fn a_killed_rebuild_leaves_no_staging_behind_after_check_config_or_run() {
    let world = World::new(FAST);
    add_recordings(&world, 300);
    let staging = world.out().join(".ailhd-staging");
    let kill_mid_rebuild = || {
        let mut child = world
            .cmd(&["rebuild", "--device", "cpu"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !staging.exists() {
            assert!(child.try_wait().unwrap().is_none(), "rebuild ended first");
            assert!(t.elapsed() < Duration::from_secs(60));
            std::thread::sleep(Duration::from_millis(2));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(staging.exists());
    };
    kill_mid_rebuild();
    // While a writer holds the folders, its staging is not stale.
    {
        let s = ailhd::config::Settings::load(Some(&world.config)).unwrap();
        let _held = ailhd::lock::WriterLocks::acquire(&s, "rebuild").unwrap();
        let o = ok(&world.run(&["check-config"]));
        assert!(!o.contains("removed") && staging.exists(), "{o}");
    }
    let o = ok(&world.run(&["check-config"]));
    assert!(o.contains("left by an interrupted rebuild"), "{o}");
    assert!(!staging.exists());

    kill_mid_rebuild();
    let log = world.dir.path().join("run.log");
    let mut svc = world
        .cmd(&["run"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while staging.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "run left the staging"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    unsafe { libc::kill(svc.id() as i32, libc::SIGTERM) };
    assert!(svc.wait().unwrap().success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("left by an interrupted rebuild"), "{text}");
}

/// `run` with the world's configuration: its exit status and stderr (it must end by itself).
fn run_exits(world: &World) -> (Option<i32>, String) {
    let log = world.dir.path().join("run.log");
    let mut child = world
        .cmd(&["run"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let status = exit_within(&mut child, Duration::from_secs(60)).expect("run did not end");
    (status.code(), std::fs::read_to_string(&log).unwrap())
}

/// A configuration that disagrees with the existing outputs (a feature setting, the order of
/// `labels.names`, `outputs.path_bytes`: the width of `source_path`, in the HDF5 files and in
/// the npy columns) cannot pass by waiting: `run` exits 2 (systemd does not restart it) and
/// `check-config` says the same, naming the key; from the manifest, from the outputs alone (a
/// lost state), and while the running service holds the manifest. `rebuild` takes a new width.
/// An output that cannot be read is not the configuration's fault (exit 1).
#[test]
#[serial]
fn settings_that_disagree_with_the_outputs_are_a_configuration_error() {
    let world = World::new(FAST);
    add_recordings(&world, 4);
    ok(&world.run(&["rebuild", "--device", "cpu"]));
    let good = std::fs::read_to_string(&world.config).unwrap();
    let refused = |expect: &[&str]| {
        let o = world.run(&["check-config"]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "check-config: {err}");
        assert!(expect.iter().all(|e| err.contains(e)), "{expect:?}: {err}");
        let (code, err) = run_exits(&world);
        assert_eq!(code, Some(2), "run: {err}");
        assert!(expect.iter().all(|e| err.contains(e)), "{expect:?}: {err}");
    };
    let n_mels = [
        "features.n_mels = 32 in the configuration, 64",
        "ailhd rebuild",
    ];
    std::fs::write(&world.config, good.clone() + "[features]\nn_mels = 32\n").unwrap();
    refused(&n_mels);
    let reordered =
        "[labels]\nnames = [\"BACKGROUND\", \"CRACK\", \"NORMAL\", \"LEAK\", \"UNCLASSIFIED\"]\n";
    std::fs::write(&world.config, good.clone() + reordered).unwrap();
    refused(&["labels.names changed the ids", "ailhd rebuild"]);
    let path_bytes = [
        "outputs.path_bytes = 300 in the configuration, 256 in the outputs",
        "ailhd rebuild",
    ];
    let wider = "[outputs]\npath_bytes = 300\n";
    let npy_wider = "[outputs]\nhdf5 = false\npath_bytes = 300\n";
    std::fs::write(&world.config, good.clone() + wider).unwrap();
    refused(&path_bytes);
    std::fs::write(&world.config, good.clone() + npy_wider).unwrap();
    refused(&path_bytes);

    // While the service runs (it holds the manifest), check-config reads the outputs.
    std::fs::write(&world.config, &good).unwrap();
    let svc = Service::start(&world);
    std::fs::write(&world.config, good.clone() + "[features]\nn_mels = 32\n").unwrap();
    let o = world.run(&["check-config"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains(n_mels[0]), "{}", stderr(&o));
    std::fs::write(&world.config, good.clone() + reordered).unwrap();
    let o = world.run(&["check-config"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("changed the ids"), "{}", stderr(&o));
    std::fs::write(&world.config, good.clone() + wider).unwrap();
    let o = world.run(&["check-config"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains(path_bytes[0]), "{}", stderr(&o));
    std::fs::write(&world.config, &good).unwrap();
    svc.terminate();
    ok(&world.run(&["check-config"]));

    // A lost state: the outputs' own attributes.
    std::fs::remove_dir_all(world.state()).unwrap();
    std::fs::write(&world.config, good.clone() + "[features]\nn_mels = 32\n").unwrap();
    refused(&n_mels);
    std::fs::write(&world.config, good.clone() + wider).unwrap();
    refused(&path_bytes);
    std::fs::write(&world.config, good.clone() + npy_wider).unwrap();
    refused(&path_bytes);

    // `rebuild` regenerates the outputs with the new width; then the old one is refused.
    std::fs::write(&world.config, good.clone() + wider).unwrap();
    ok(&world.run(&["rebuild", "--device", "cpu"]));
    ok(&world.run(&["check-config"]));
    std::fs::write(&world.config, &good).unwrap();
    refused(&[
        "outputs.path_bytes = 256 in the configuration, 300 in the outputs",
        "ailhd rebuild",
    ]);

    // A damaged output is no configuration error.
    std::fs::write(&world.config, &good).unwrap();
    std::fs::write(world.out().join("TRAINING_DATASET.H5"), b"not an HDF5 file").unwrap();
    let o = world.run(&["check-config"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
}

#[test]
#[serial]
fn reload_reports_accepted_and_refused_configurations_through_its_exit_status() {
    let world = World::new(FAST);
    let o = world.run(&["reload"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("nothing to reload"), "{}", stderr(&o));

    let svc = Service::start(&world);
    let pid = svc.pid().to_string();
    let o = ok(&world.run(&["reload", "--pid", &pid]));
    assert!(o.contains("configuration reloaded"), "{o}");
    // A pid that is not the holder (systemd's $MAINPID after paths.state changed).
    let o = world.run(&["reload", "--pid", "1"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));

    // A broken configuration: the service refuses it, keeps running, and reload says so.
    let good = std::fs::read_to_string(&world.config).unwrap();
    let text = good.replace("settle_ms = 100", "settle_ms = \"soon\"");
    assert_ne!(text, good);
    std::fs::write(&world.config, &text).unwrap();
    // The client itself cannot load it either: refused before any signal, exit 2.
    let o = world.run(&["reload"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("settle_ms"), "{}", stderr(&o));
    // A configuration the client loads but the service refuses (the service reads its own
    // --config file, which is the broken one; the client is given a good copy).
    let good_copy = world.dir.path().join("good.toml");
    std::fs::write(&good_copy, &good).unwrap();
    let o = std::process::Command::new(bin())
        .arg("--config")
        .arg(&good_copy)
        .args(["reload", "--pid", &pid])
        .env_remove("AILHD_CONFIG")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("refused") && stderr(&o).contains("settle_ms"),
        "{}",
        stderr(&o)
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(world.state().join("reload.json")).unwrap())
            .unwrap();
    assert_eq!(r["generation"], 2);
    assert_eq!(r["accepted"], false);
    // A changed feature setting cannot change live: refused whole (nothing applied), not
    // answered "reloaded", and it says what to do.
    std::fs::write(&world.config, format!("{good}[features]\nn_mels = 32\n")).unwrap();
    let o = world.run(&["reload", "--pid", &pid]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("[features]") && stderr(&o).contains("restart"),
        "{}",
        stderr(&o)
    );
    // Nor can the metrics' textfile and listener, or the featurising device: both refused,
    // named (they were answered "reloaded" and left as they were).
    let prom = world.dir.path().join("b.prom");
    for (text, named) in [
        (
            format!("{good}[metrics]\ntextfile = {prom:?}\n"),
            "[metrics]",
        ),
        (
            good.replace("device = \"cpu\"", "device = \"auto\""),
            "[ingest] device",
        ),
    ] {
        assert_ne!(text, good);
        std::fs::write(&world.config, &text).unwrap();
        let o = world.run(&["reload", "--pid", &pid]);
        assert_eq!(o.status.code(), Some(2), "{named}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(named) && stderr(&o).contains("restart"),
            "{}",
            stderr(&o)
        );
    }
    // Still running, and a good configuration is accepted again.
    std::fs::write(&world.config, &good).unwrap();
    ok(&world.run(&["reload", "--pid", &pid]));
    let log = svc.terminate();
    assert!(log.contains("reload refused"), "{log}");
}

/// `ailhd_stage_seconds` counts from the process's start: an idle close (the outputs and the
/// manifest closed, reopened for the next recording) does not take it back, and the stop's log
/// line counts the same.
#[test]
#[serial]
fn stage_seconds_keep_growing_across_an_idle_close() {
    let dir = tempfile::tempdir().unwrap();
    let prom = dir.path().join("ailhd.prom");
    let world = World::new(&format!(
        "{FAST}idle_close_s = 1\n[metrics]\ntextfile = {prom:?}\n"
    ));
    add_recordings(&world, 20);
    let svc = Service::start(&world);
    let metric = |name: &str| -> Option<f64> {
        let text = std::fs::read_to_string(&prom).ok()?;
        let line = text.lines().find(|l| l.starts_with(name))?;
        line.rsplit(' ').next()?.parse().ok()
    };
    let featurise = "ailhd_stage_seconds{stage=\"featurise\"} ";
    let wait = |what: &str, done: &dyn Fn() -> bool| {
        let t = Instant::now();
        while !done() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "waited for {what}:\n{}\nlog:\n{}",
                std::fs::read_to_string(&prom).unwrap_or_default(),
                svc.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait("20 recordings ingested and their featurise time", &|| {
        metric("ailhd_files_ingested_total ") == Some(20.0)
            && metric(featurise).is_some_and(|v| v > 0.0)
    });
    wait("the idle close", &|| svc.log().contains("outputs closed"));
    let before = metric(featurise).unwrap();
    write_via_rename(
        &world.rec(),
        "LEAK/S100~R100~20250118120530~100.wav",
        &clip_wav("LEAK", 930),
    );
    wait("the new recording's featurise time added", &|| {
        let now = metric(featurise).unwrap_or(before);
        assert!(
            now >= before,
            "ailhd_stage_seconds fell from {before} to {now} after the idle close"
        );
        now > before && metric("ailhd_files_ingested_total ") == Some(21.0)
    });
    let after = metric(featurise).unwrap();
    let log = svc.terminate();
    let line = log
        .lines()
        .find(|l| l.contains("stopping:"))
        .unwrap_or_else(|| panic!("no stopping line: {log}"));
    let logged: f64 = line
        .split("featurise ")
        .nth(1)
        .and_then(|r| r.split('s').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no featurise time in {line}"));
    assert!(
        (logged - after).abs() < 0.002 && logged > 0.0,
        "the stop logs featurise {logged} s, the metric said {after} s: {line}"
    );
}

#[test]
#[serial]
fn the_service_keeps_a_prometheus_textfile() {
    let dir = tempfile::tempdir().unwrap();
    let prom = dir.path().join("ailhd.prom");
    // A file present at start that cannot be used waits in the settle stage until
    // quarantine_after_s: keep that short.
    let world = World::new(&format!(
        "{FAST}quarantine_after_s = 2\n[metrics]\ntextfile = {prom:?}\n"
    ));
    add_recordings(&world, 6);
    std::fs::create_dir_all(world.rec().join("LEAK")).unwrap();
    std::fs::write(world.rec().join("LEAK/broken.wav"), b"not a wav at all").unwrap();
    let svc = Service::start(&world);
    let has = |want: &[&str]| {
        let text = std::fs::read_to_string(&prom).unwrap_or_default();
        want.iter().all(|w| text.contains(w))
    };
    let want = [
        "ailhd_up 1",
        "ailhd_files_ingested_total 6",
        "ailhd_files_quarantined_total{reason=",
        "ailhd_files{state=\"committed\"} 6",
        "ailhd_files{state=\"quarantined\"} 1",
        "ailhd_device_info{device=\"cpu\"} 1",
        "ailhd_commit_latency_seconds_count 6",
        "ailhd_queue_depth 0",
        "ailhd_rows{split=",
        "ailhd_stage_seconds{stage=",
    ];
    let t = Instant::now();
    while !has(&want) {
        let text = std::fs::read_to_string(&prom).unwrap_or_default();
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "textfile lacks some of {want:?}:\n{text}\nlog:\n{}",
            svc.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let text = std::fs::read_to_string(&prom).unwrap();
    let rows: f64 = text
        .lines()
        .filter(|l| l.starts_with("ailhd_rows{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(rows, 6.0, "{text}");
    svc.terminate();
    assert!(has(&["ailhd_up 0", "ailhd_files_ingested_total 6"]));
}

/// The metric families docs/operations.md documents (its table's first column).
fn documented_families() -> Vec<String> {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md"))
            .unwrap();
    let mut names = Vec::new();
    for line in doc.lines().filter(|l| l.starts_with("| `ailhd_")) {
        let cell = line.split('|').nth(1).unwrap();
        for (i, part) in cell.split('`').enumerate() {
            if i % 2 == 1 {
                names.push(part.split('{').next().unwrap().to_string());
            }
        }
    }
    assert!(names.len() >= 15, "metrics table not found: {names:?}");
    names
}

/// `promtool check metrics` on `text`, where promtool is installed; else fails in CI and says it
/// skipped elsewhere.
fn promtool_check(what: &str, text: &str) {
    use std::io::Write;
    let child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        let why = format!(
            "promtool check of {what}: promtool not found (Debian's prometheus package has it; \
             .ci/setup puts it on PATH)"
        );
        assert!(
            std::env::var_os("CI").is_none_or(|v| v.is_empty()),
            "cannot run: {why}"
        );
        println!("SKIPPED {why}");
        return;
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "promtool check metrics of {what}:\n{}{}\n{text}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    println!("promtool check metrics of {what}: clean");
}

/// `GET /metrics` from the endpoint on `port`: the whole answer, or None when nothing listens.
fn get_metrics(port: u16) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut page = String::new();
    s.read_to_string(&mut page).unwrap();
    Some(page)
}

/// A metrics address that is taken does not stop the service (ingestion is what it is for): it
/// says so, ingests, and serves the endpoint once the address comes free.
#[test]
#[serial]
fn a_taken_metrics_address_is_retried_while_the_service_ingests() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    let world = World::new(&format!("{FAST}[metrics]\nlisten = \"127.0.0.1:{port}\"\n"));
    let svc = Service::start(&world);
    assert!(
        svc.log().contains("cannot listen there"),
        "no warning about the address; log:\n{}",
        svc.log()
    );
    add_recordings(&world, 2);
    svc.wait("the recordings committed without the endpoint", |s| {
        committed(s) == 2
    });
    drop(holder);
    let mut page = None;
    svc.wait_for("the endpoint once the address was free", || {
        page = get_metrics(port);
        page.is_some()
    });
    let page = page.unwrap();
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    assert!(page.contains("ailhd_files_ingested_total 2"), "{page}");
    svc.terminate();
}

/// Every documented family is in the first answer to a scrape of `/metrics` and in the first
/// textfile, before any event (counters at 0, an empty histogram), and both pass promtool.
#[test]
#[serial]
fn every_documented_metric_family_is_there_from_the_first_scrape() {
    let dir = tempfile::tempdir().unwrap();
    let prom = dir.path().join("ailhd.prom");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let world = World::new(&format!(
        "{FAST}[metrics]\ntextfile = {prom:?}\nlisten = \"127.0.0.1:{port}\"\n"
    ));
    add_recordings(&world, 3);
    ok(&world.run(&["rebuild"]));
    let svc = Service::spawn(&world);
    // The first scrape: as soon as the port takes a connection.
    let t = Instant::now();
    let scrape = loop {
        if let Some(page) = get_metrics(port) {
            assert!(page.starts_with("HTTP/1.1 200"), "{page}");
            break page[page.find("\r\n\r\n").unwrap() + 4..].to_string();
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no endpoint; log:\n{}",
            svc.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    // The first textfile: as soon as it is there (it is replaced whole, never written in place).
    let first_file = loop {
        if let Ok(text) = std::fs::read_to_string(&prom) {
            break text;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no textfile; log:\n{}",
            svc.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    for (what, text) in [
        ("the first scrape", &scrape),
        ("the first textfile", &first_file),
    ] {
        for family in documented_families() {
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "{what} lacks {family}:\n{text}"
            );
        }
        for zero in [
            "ailhd_files_ingested_total 0",
            "ailhd_write_failing 0",
            "ailhd_commit_latency_seconds_count 0",
            "ailhd_errors_total{kind=\"write\"} 0",
            "ailhd_files{state=\"committed\"} 3",
        ] {
            assert!(text.contains(zero), "{what} lacks {zero:?}:\n{text}");
        }
        promtool_check(what, text);
    }
    svc.terminate();
}

/// `ailhd compact` (the service stopped) puts a fresh copy of the manifest in its place with
/// every record, or leaves it as it was when the copy would be no smaller (as here: a few
/// recordings, written once): `status` reports the same, a start takes new recordings with it,
/// and the outputs still agree with a rebuild. While the service runs it is refused. (The swap
/// itself: engine::compact's tests and power_loss's compaction test.)
#[test]
#[serial]
fn compact_replaces_the_manifest_with_a_copy_that_keeps_every_record() {
    let world = World::new(FAST);
    add_recordings(&world, 6);
    ok(&world.run(&["rebuild", "--device", "cpu"]));
    let before = world.status_json();
    let said = ok(&world.run(&["compact"]));
    assert!(
        said.contains("compacted from") || said.contains("left as it was"),
        "{said}"
    );
    let names: Vec<String> = std::fs::read_dir(world.state())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("manifest"))
        .collect();
    assert_eq!(names, ["manifest"], "nothing left beside it");
    let after = world.status_json();
    for key in ["files", "splits"] {
        assert_eq!(after[key], before[key], "{key}: {after}");
    }

    let svc = Service::start(&world);
    let o = world.run(&["compact"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("held by pid"), "{}", stderr(&o));
    let rec = world.rec();
    for (i, label) in [(1, "LEAK"), (2, "NORMAL")] {
        let rel = format!("{label}/S80{i}~R80{i}~20250118120530~100.wav");
        write_via_rename(&rec, &rel, &clip_wav(label, 8000 + i));
    }
    svc.wait("eight recordings", |s| committed(s) == 8);
    svc.terminate();
    assert!(world.status_json()["quarantined"]
        .as_array()
        .unwrap()
        .is_empty());
    compare_with_rebuild(&world);
}
