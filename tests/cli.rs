//! The command line as an operator meets it: configuration sources and overrides, exit codes,
//! `demo`, `inspect`, the writer lock, and a rebuild interrupted by SIGKILL.

use crate::common::*;
use std::time::Duration;

#[test]
fn check_config_accepts_the_shipped_files_and_names_bad_keys() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    // check-config also checks the folders: point them at a temporary world.
    let folders = World::new("");
    for f in ["config/ailhd.toml", "config/overlap32.toml"] {
        let o = std::process::Command::new(bin())
            .arg("--config")
            .arg(repo.join(f))
            .arg("check-config")
            .env("AILHD_PATHS__RECORDINGS", folders.rec())
            .env("AILHD_PATHS__OUTPUT", folders.out())
            .env("AILHD_PATHS__STATE", folders.state())
            .output()
            .unwrap();
        ok(&o);
    }
    let world = World::new("[features]\nshort_window = 4096\n");
    let o = world.run(&["check-config"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("features.short_window"), "{err}");

    let world = World::new("[ingest]\nbatch_size = 3\n");
    let o = world.run(&["check-config"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("batch_size"));

    // A label list in the environment written with spaces or as JSON: refused, with how to
    // write it (its names would match no folder); the plain form is taken.
    let world = World::new("");
    for (list, code) in [
        ("CRACK, NORMAL", Some(2)),
        ("[\"CRACK\",\"NORMAL\"]", Some(2)),
        ("CRACK,NORMAL", Some(0)),
    ] {
        let o = world
            .cmd(&["check-config"])
            .env("AILHD_LABELS__NAMES", list)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), code, "{list}: {err}");
        if code == Some(2) {
            assert!(
                err.contains("labels.names") && err.contains("A,B,C"),
                "{err}"
            );
        }
    }

    // A value that is none of a key's: the key, and the values it accepts.
    for (toml, key, values) in [
        (
            "[splits]\nmode = \"foo\"\n",
            "splits.mode",
            "\"hash\", \"sensor\", \"directory\"",
        ),
        (
            "[ingest]\ndevice = \"gpu\"\n",
            "ingest.device",
            "\"auto\", \"cpu\", \"cuda\"",
        ),
    ] {
        let o = World::new(toml).run(&["check-config"]);
        assert_eq!(o.status.code(), Some(2));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(key) && err.contains(values), "{err}");
    }
}

/// `check-config` with `ingest.device = "cuda"` says so where featurising on a GPU is not
/// possible (it passes: a driver may come later), and says nothing where it is.
#[test]
fn check_config_warns_of_a_cuda_device_that_cannot_work_here() {
    let world = World::new("[ingest]\ndevice = \"cuda\"\n");
    let text = ok(&world.run(&["check-config"]));
    let search = ailhd::features::cuda::LibrarySearch::for_featuriser(&Default::default());
    let problems = ailhd::features::cuda::probe_with(&search).problems;
    let warned = text.contains("warning: ingest.device = cuda");
    assert_eq!(warned, !problems.is_empty(), "{problems:?}: {text}");
    if warned {
        assert!(text.contains(&problems[0]), "{text}");
    }
    let text = ok(&World::new("[ingest]\ndevice = \"cpu\"\n").run(&["check-config"]));
    assert!(!text.contains("warning"), "{text}");
}

#[test]
fn environment_overrides_and_config_search_order() {
    let world = World::new("");
    // An override that makes the configuration impossible proves the variable is read.
    let o = world
        .cmd(&["check-config"])
        .env("AILHD_SPLITS__RATIOS__TRAINING", "90")
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("splits.ratios"));
    // A value that does not parse is blamed on the variable, not on the configuration file.
    let o = world
        .cmd(&["check-config"])
        .env("AILHD_INGEST__WORKERS", "many")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("environment variable AILHD_INGEST__WORKERS")
            && err.contains("\"many\"")
            && !err.contains("configuration file"),
        "{err}"
    );
    // So is a key that does not exist (the file has no such key).
    let o = world
        .cmd(&["check-config"])
        .env("AILHD_FEATURES__NMELS", "32")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("environment variable AILHD_FEATURES__NMELS: unknown key features.nmels")
            && err.contains("n_mels")
            && !err.contains("configuration file"),
        "{err}"
    );
    // And a value none of a setting's accepted ones.
    let o = world
        .cmd(&["check-config"])
        .env("AILHD_INGEST__DEVICE", "gpu")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("environment variable AILHD_INGEST__DEVICE")
            && err.contains("\"cuda\"")
            && !err.contains("configuration file"),
        "{err}"
    );
    let o = world
        .cmd(&["check-config"])
        .env("AILHD_PATHS__OUTPUT", "/tmp/elsewhere")
        .output()
        .unwrap();
    assert!(ok(&o).contains("/tmp/elsewhere"));
    // $AILHD_CONFIG is used when --config is absent.
    let o = std::process::Command::new(bin())
        .arg("check-config")
        .env("AILHD_CONFIG", &world.config)
        .output()
        .unwrap();
    assert!(ok(&o).contains(world.rec().to_str().unwrap()));
    // A named file that does not exist is a configuration error.
    let o = std::process::Command::new(bin())
        .args(["--config", "/nonexistent/ailhd.toml", "check-config"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
}

/// A closed stdout (`ailhd completions bash | head -1`) ends the command quietly, as Unix tools
/// do: no panic, no backtrace.
#[test]
fn a_closed_stdout_ends_quietly() {
    let mut child = std::process::Command::new(bin())
        .args(["completions", "bash"])
        .env("RUST_BACKTRACE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes away before the command writes.
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.is_empty(), "{err}");
    use std::os::unix::process::ExitStatusExt;
    assert!(
        o.status.success() || o.status.signal() == Some(libc::SIGPIPE),
        "{:?}",
        o.status
    );
}

#[test]
fn bad_usage_exits_2() {
    let o = std::process::Command::new(bin())
        .arg("frobnicate")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let world = World::new("");
    let o = world.run(&["rebuild", "--device", "tpu"]);
    assert_eq!(o.status.code(), Some(2));
}

/// A symbolic link to a folder is not followed (as a link named `*.wav` is not), and says so:
/// the recordings behind it are not skipped in silence.
#[test]
fn a_linked_folder_is_not_followed_and_said() {
    let world = World::new("");
    let elsewhere = world.dir.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    copy_fixture(
        "tone_pcm16",
        &elsewhere.join("S001~R1~20250118120530~100.wav"),
    );
    copy_fixture(
        "leak_pcm16",
        &world.rec().join("LEAK/S002~R2~20250118120530~100.wav"),
    );
    std::os::unix::fs::symlink(&elsewhere, world.rec().join("NORMAL")).unwrap();
    let o = world.run(&["rebuild", "--device", "cpu"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "{}: a symbolic link to a folder, not followed",
            world.rec().join("NORMAL").display()
        )),
        "{err}"
    );
    assert_eq!(world.status_json()["files"]["committed"], 1);
}

/// `demo` into a folder that cannot be one (a file) or that holds a demo already says which and
/// why, and writes nothing.
#[test]
fn demo_refuses_a_file_or_an_existing_demo_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a_file");
    std::fs::write(&file, "not a folder").unwrap();
    let existing = dir.path().join("d");
    std::fs::create_dir_all(existing.join("MASTER_DATASET")).unwrap();
    for (target, why) in [(&file, "File exists"), (&existing, "already exists")] {
        let o = std::process::Command::new(bin())
            .arg("demo")
            .arg(target)
            .env_remove("AILHD_CONFIG")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains(target.to_str().unwrap()) && err.contains(why),
            "{err}"
        );
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "not a folder");
    assert_eq!(std::fs::read_dir(&existing).unwrap().count(), 1);
}

/// `ailhd demo | head`: the demo ends when its reader goes away, and the service it started
/// goes with it (it is not left running on the demo's folders).
#[test]
fn a_demo_whose_reader_goes_away_leaves_no_service_running() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let demo = dir.path().join("d");
    let mut child = std::process::Command::new(bin())
        .arg("demo")
        .arg(&demo)
        .env_remove("AILHD_CONFIG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    // Read until the service has been started, then go away as `head` does.
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.contains("The service:"))),
        "the demo never started its service"
    );
    drop(lines);
    let status = exit_within(&mut child, Duration::from_secs(60)).expect("the demo ended");
    assert!(!status.success(), "ended by its closed output: {status:?}");
    let config = demo.join("ailhd.toml").display().to_string();
    let running = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|p| std::fs::read(p.path().join("cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .any(|c| c.contains(&config) && c.contains(" run"))
    };
    let t = std::time::Instant::now();
    while running() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the demo's service is still running"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn demo_builds_a_tree_a_user_can_read() {
    let dir = tempfile::tempdir().unwrap();
    let o = std::process::Command::new(bin())
        .args(["demo"])
        .arg(dir.path().join("d"))
        .env_remove("AILHD_CONFIG")
        .output()
        .unwrap();
    let text = ok(&o);
    assert!(
        text.contains("rebuilt 302 recordings -> 300 rows"),
        "{text}"
    );
    assert!(
        text.contains("cut_short.wav"),
        "the broken file is reported: {text}"
    );
    // The service part: six recordings dropped in, each seen committed by the SWMR reader,
    // then a clean stop.
    assert_eq!(text.matches("  dropped   ").count(), 6, "{text}");
    assert_eq!(
        text.matches("ms after the file was closed").count(),
        6,
        "{text}"
    );
    assert!(
        text.contains("stopped cleanly (SIGTERM, exit 0)") && text.contains("counts 306 rows"),
        "{text}"
    );
    for png in ["status.png", "inspect.png"] {
        let bytes = std::fs::read(dir.path().join("d").join(png)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{png}");
        let info = png::Decoder::new(std::io::Cursor::new(bytes))
            .read_info()
            .unwrap();
        let (w, h) = (info.info().width, info.info().height);
        assert!(w >= 800 && h >= 500, "{png} is {w}x{h}");
    }
    let h5 = dir.path().join("d/output/TRAINING_DATASET.H5");
    let script = format!(
        "import h5py, numpy as np\nf = h5py.File({h5:?}, 'r')\nm = f['segments_mel']\nassert m.shape[1:] == (40, 2, 64, 1), m.shape\nassert m.shape[0] > 150\nl = f['labels'][...]\nassert set(np.unique(l)) == {{0, 1, 2, 3, 4}}\n# labels sound different: leaks are louder than background\nmean = {{k: float(m[np.where(l == k)[0][:20]].astype('f4').mean()) for k in (0, 2)}}\nassert mean[2] > mean[0] + 10, mean\nprint('ok')\n"
    );
    let py = std::process::Command::new("python3")
        .arg("-c")
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        py.status.success(),
        "{}",
        String::from_utf8_lossy(&py.stderr)
    );
    // inspect on one of the demo files, with a picture
    let cfg = dir.path().join("d/ailhd.toml");
    let wav = std::fs::read_dir(dir.path().join("d/MASTER_DATASET/LEAK"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let png = dir.path().join("x.png");
    let o = std::process::Command::new(bin())
        .arg("--config")
        .arg(&cfg)
        .args(["inspect", "--json", "--png"])
        .arg(&png)
        .arg(&wav)
        .output()
        .unwrap();
    let info: serde_json::Value = serde_json::from_str(&ok(&o)).unwrap();
    assert_eq!(info["shape"], serde_json::json!([40, 2, 64, 1]));
    assert_eq!(info["sample_rate"], 4096);
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
}

#[test]
fn inspect_says_what_is_wrong_with_a_bad_file() {
    let world = World::new("");
    let bad = world.dir.path().join("truncated.wav");
    copy_fixture("truncated", &bad);
    let o = world.run(&["inspect", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr).to_lowercase();
    assert!(
        err.contains("truncated.wav") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn interrupted_rebuild_leaves_the_old_outputs_in_place() {
    let world = World::new("");
    ailhd::synth::write_tree(&world.rec(), &["LEAK", "NORMAL"], 20, 1).unwrap();
    ok(&world.run(&["rebuild", "--device", "cpu"]));
    let before = world.status_json();
    let h5 = world.out().join("TRAINING_DATASET.H5");
    let bytes_before = std::fs::read(&h5).unwrap();
    // A much bigger tree, and a rebuild killed part-way.
    ailhd::synth::write_tree(&world.rec(), &["BACKGROUND", "CRACK"], 1500, 2).unwrap();
    let mut child = world.cmd(&["rebuild", "--device", "cpu"]).spawn().unwrap();
    // Kill it as soon as its staged outputs exist (it has thousands of files still to do).
    let staged = world.out().join(".ailhd-staging/TRAINING_DATASET.H5");
    let t = std::time::Instant::now();
    while !staged.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the rebuild never started writing"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the rebuild finished before it could be interrupted"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(
        std::fs::read(&h5).unwrap(),
        bytes_before,
        "old outputs were touched"
    );
    let after = world.status_json();
    assert_eq!(before["splits"], after["splits"]);
    // The next rebuild completes and takes in everything.
    ok(&world.run(&["rebuild", "--device", "cpu"]));
    assert_eq!(world.status_json()["files"]["committed"], 3040);
}

/// A rebuild stopped in the middle of its swap (some outputs new, some old, the manifest not
/// yet moved): every output is still there (each is exchanged with its replacement in one
/// step; before, each was moved aside and then replaced, and a stop between left it missing),
/// `check-config` says so and passes, `status` says what finishes it, and the service's start
/// rolls the swap forward and goes on; the result equals a rebuild. Before, `check-config`
/// refused the half-moved outputs with exit 2 ("there only in part", advising a rebuild) and
/// `status` said nothing had been ingested (a kill audit).
#[test]
fn a_rebuild_stopped_during_its_swap_is_finished_by_the_next_start() {
    stop_a_swap_and_start(false);
}

/// The same on a file system that cannot exchange (a fail point plays one): the output being
/// replaced is missing until the roll-forward, which finishes the swap all the same.
#[test]
fn a_swap_stopped_without_exchange_is_finished_by_the_next_start() {
    stop_a_swap_and_start(true);
}

fn stop_a_swap_and_start(without_exchange: bool) {
    use crate::common::service::{committed, compare_with_rebuild, Service};
    let world = World::new("[ingest]\ndevice = \"cpu\"\nsettle_ms = 100\n");
    ailhd::synth::write_tree(&world.rec(), &["LEAK", "NORMAL"], 10, 1).unwrap();
    ok(&world.run(&["rebuild"]));
    ailhd::synth::write_tree(&world.rec(), &["BACKGROUND", "CRACK"], 10, 2).unwrap();
    let failpoints = match without_exchange {
        false => "swap-move=return",
        true => "swap-move=return;swap-no-exchange=return",
    };
    let o = world
        .cmd(&["rebuild"])
        .env("FAILPOINTS", failpoints)
        .output()
        .unwrap();
    assert!(
        !o.status.success(),
        "the fail point did not stop the rebuild"
    );
    assert!(world.state().join("swap.pending").exists());
    // The first output moved is the training split's HDF5 file.
    let out = world.out();
    for name in [
        "TRAINING_DATASET.H5",
        "VALIDATION_DATASET.H5",
        "TESTING_DATASET.H5",
        "npy/training/labels.npy",
        "npy/validation/labels.npy",
    ] {
        let missing = without_exchange && name == "TRAINING_DATASET.H5";
        assert_eq!(out.join(name).is_file(), !missing, "{name} after the stop");
    }
    assert!(world.state().join("manifest/db").is_file());

    let o = world.run(&["check-config"]);
    let text = ok(&o);
    assert!(
        text.contains("stopped while it moved its outputs"),
        "{text}"
    );
    let o = world.run(&["status"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("moved its outputs into place"), "{err}");

    let svc = Service::start(&world);
    svc.wait("every recording committed", |s| committed(s) == 40);
    svc.terminate();
    assert!(!world.state().join("swap.pending").exists());
    compare_with_rebuild(&world);
}

#[test]
fn one_writer_at_a_time() {
    let world = World::new("");
    std::fs::create_dir_all(world.state()).unwrap();
    let _held = ailhd::lock::WriterLock::acquire(&world.state(), "run").unwrap();
    let o = world.run(&["rebuild"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("another ailhd") && err.contains("ailhd run"),
        "{err}"
    );
}

/// `status` names each label as the outputs do (their stored label list), whichever
/// configuration runs it: one whose `labels.names` is shorter or in another order neither
/// renames the counts nor leaves its names in the report kept for the next `status`.
#[test]
fn status_names_labels_as_the_outputs_do_whatever_the_configuration() {
    let world = World::new("[ingest]\ndevice = \"cpu\"\n");
    for (i, label) in ["CRACK", "CRACK", "LEAK", "NORMAL"].iter().enumerate() {
        let dir = world.rec().join(label);
        std::fs::create_dir_all(&dir).unwrap();
        let bytes = ailhd::synth::wav_pcm16(&ailhd::synth::clip(label, i as u64, 4096, 10.0), 4096);
        std::fs::write(dir.join(ailhd::synth::file_name(i, 31)), bytes).unwrap();
    }
    ok(&world.run(&["rebuild"]));
    let per_label = |s: &serde_json::Value| {
        let mut counts = std::collections::BTreeMap::new();
        for split in s["splits"].as_object().unwrap().values() {
            for (name, n) in split["per_label"].as_object().unwrap() {
                *counts.entry(name.clone()).or_insert(0) += n.as_u64().unwrap();
            }
        }
        counts
    };
    // Every label of the outputs is there, those without a valid row as 0.
    let expected: std::collections::BTreeMap<String, u64> = [
        ("BACKGROUND".to_string(), 0),
        ("CRACK".to_string(), 2),
        ("LEAK".to_string(), 1),
        ("NORMAL".to_string(), 1),
        ("UNCLASSIFIED".to_string(), 0),
    ]
    .into();
    // Another configuration for the same folders: fewer names, in another order.
    let other = world.dir.path().join("other.toml");
    let text = std::fs::read_to_string(&world.config).unwrap()
        + "[labels]\nnames = [\"NORMAL\", \"BACKGROUND\"]\n";
    std::fs::write(&other, text).unwrap();
    let o = std::process::Command::new(bin())
        .arg("--config")
        .arg(&other)
        .args(["status", "--json"])
        .env_remove("AILHD_CONFIG")
        .output()
        .unwrap();
    let s: serde_json::Value = serde_json::from_slice(ok(&o).as_bytes()).unwrap();
    assert_eq!(per_label(&s), expected, "{s}");
    assert_eq!(per_label(&world.status_json()), expected);
}

/// Every command's `--json` starts with `schema_version`, carries plain units (seconds as
/// `*_s` numbers, per-split and per-stage figures as objects, files as objects), and names no
/// field that docs/json.md does not document in that command's section; `status` of a
/// running service says how old its figures are.
#[test]
fn json_output_is_documented_and_in_plain_units() {
    let world = World::new("[ingest]\ndevice = \"cpu\"\nsettle_ms = 100\n");
    let written = ailhd::synth::write_tree(&world.rec(), &["LEAK", "NORMAL"], 6, 3).unwrap();
    // A label conflict (the same bytes under two labels) and a quarantined file.
    let other = if written[0].starts_with(world.rec().join("LEAK")) {
        "NORMAL"
    } else {
        "LEAK"
    };
    std::fs::copy(&written[0], world.rec().join(other).join("copy.wav")).unwrap();
    std::fs::write(world.rec().join("LEAK/broken.wav"), b"RIFF....WAVE").unwrap();
    let json = |args: &[&str]| -> serde_json::Value {
        let text = ok(&world.run(args));
        assert!(
            text.starts_with("{\n  \"schema_version\": 1,"),
            "{args:?}: {text}"
        );
        serde_json::from_str(&text).unwrap()
    };
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/json.md"),
    )
    .unwrap();
    let documented = |command: &str, v: &serde_json::Value| {
        let start = doc
            .find(&format!("## `{command}"))
            .unwrap_or_else(|| panic!("docs/json.md has no section for {command}"));
        let section = &doc[start..];
        let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
        for key in v.as_object().unwrap().keys() {
            assert!(
                section.contains(&format!("`{key}`")),
                "{command} --json prints {key:?}, which docs/json.md does not document"
            );
        }
    };

    let rebuild = json(&["rebuild", "--json"]);
    documented("rebuild", &rebuild);
    assert!(rebuild["elapsed_s"].as_f64().unwrap() > 0.0, "{rebuild}");
    assert!(rebuild["stages_s"]["featurise"].is_number(), "{rebuild}");
    assert!(rebuild["phases_s"]["swap"].is_number(), "{rebuild}");
    let rows = &rebuild["rows"];
    let total: u64 = ["training", "validation", "testing"]
        .iter()
        .map(|s| rows[s].as_u64().unwrap())
        .sum();
    assert_eq!(total, written.len() as u64, "{rebuild}");
    assert!(
        rebuild["quarantined"][0]["path"]
            .as_str()
            .unwrap()
            .ends_with("broken.wav"),
        "{rebuild}"
    );

    let status = json(&["status", "--json"]);
    documented("status", &status);
    assert_eq!(status["files"]["quarantined"], 1, "{status}");
    assert!(status["service"].is_null(), "{status}");
    let conflict = &status["label_conflicts"][0]["paths"];
    assert!(
        conflict[0]["path"].is_string() && conflict[1]["label"].is_string(),
        "{status}"
    );

    let merged = world.dir.path().join("merged");
    let out = world.out();
    let merge = json(&[
        "merge",
        out.to_str().unwrap(),
        "--into",
        merged.to_str().unwrap(),
        "--json",
    ]);
    documented("merge", &merge);
    assert!(merge["inputs"][0]["rows"]["training"].is_u64(), "{merge}");

    let doctor = json(&["doctor", "--json"]);
    documented("doctor", &doctor);
    let inspect = json(&["inspect", written[1].to_str().unwrap(), "--json"]);
    documented("inspect", &inspect);

    // A running service: its figures, and how old they are.
    let svc = crate::common::service::Service::start(&world);
    let status = json(&["status", "--json"]);
    documented("status", &status);
    let service = &status["service"];
    let doc_service = &doc[doc.find("`service`, while").unwrap()..];
    for key in service.as_object().unwrap().keys() {
        assert!(
            doc_service.contains(&format!("`{key}`")),
            "status --json prints service.{key}, which docs/json.md does not document"
        );
    }
    let age = service["age_s"].as_f64().unwrap();
    assert!((0.0..60.0).contains(&age), "{status}");
    svc.terminate();
}
