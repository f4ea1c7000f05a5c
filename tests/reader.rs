//! The trainer's reader, `ailhd_reader` (python/), on outputs made by the real binary: equal to
//! h5py's raw reads on every split and both sources, committed and valid rows only, worker
//! processes; following the real `ailhd run` service while it appends, supersedes, deletes,
//! moves, stops and restarts; and the package installs with pip.

mod common;
use common::*;
use std::path::PathBuf;
use std::process::Command;

const FAST: &str = "[ingest]\nsettle_ms = 100\nquarantine_after_s = 2\nmax_batch_latency_ms = 10\nrescan_interval_s = 0\ndevice = \"cpu\"\n";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn reader_serves_what_h5py_reads_on_a_rebuild() {
    let world = World::new("[ingest]\ndevice = \"cpu\"\n");
    let labels = ["BACKGROUND", "CRACK", "LEAK", "NORMAL", "UNCLASSIFIED"];
    let written = ailhd::synth::write_tree(&world.rec(), &labels, 12, 5).unwrap();
    // A duplicate (one row, two paths) and a file that is no recording (quarantined, no row).
    std::fs::copy(&written[0], world.rec().join("LEAK/copy.wav")).unwrap();
    std::fs::write(world.rec().join("LEAK/broken.wav"), b"RIFF....WAVE").unwrap();
    ok(&world.run(&["rebuild"]));
    let scratch = world.dir.path().join("scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    let text = python("reader_values.py", &[&world.out(), &scratch]);
    println!("{text}");
    assert!(text.contains("reader_values: OK"), "{text}");
}

#[test]
fn reader_follows_the_running_service() {
    let world = World::new(&format!(
        "{FAST}[splits.ratios]\ntraining = 100\nvalidation = 0\ntesting = 0\n"
    ));
    let pool = world.dir.path().join("pool");
    // 40 recordings not yet in the tree; the first 4 are there from the start.
    let files = ailhd::synth::write_tree(&pool, &["LEAK", "NORMAL"], 20, 11).unwrap();
    let mut initial = files.clone();
    initial.sort();
    for f in &initial[..4] {
        let rel = f.strip_prefix(&pool).unwrap();
        std::fs::create_dir_all(world.rec().join(rel).parent().unwrap()).unwrap();
        std::fs::rename(f, world.rec().join(rel)).unwrap();
    }
    let text = python(
        "reader_live.py",
        &[
            &bin(),
            &world.config,
            &world.out(),
            &world.rec(),
            &pool,
            &world.state(),
        ],
    );
    println!("{text}");
    assert!(text.contains("reader_live: OK"), "{text}");
}

/// `pip install ./python` works: build the wheel (no network: the build backend installed
/// here), install it into a folder, and import the installed copy.
#[test]
fn reader_package_installs_with_pip() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("site");
    // A copy of python/: setuptools writes build/ and *.egg-info beside the sources.
    let src = tmp.path().join("src");
    std::fs::create_dir_all(src.join("ailhd_reader")).unwrap();
    for f in ["pyproject.toml", "README.md"] {
        std::fs::copy(repo().join("python").join(f), src.join(f)).unwrap();
    }
    for e in std::fs::read_dir(repo().join("python/ailhd_reader")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "py") {
            std::fs::copy(&p, src.join("ailhd_reader").join(p.file_name().unwrap())).unwrap();
        }
    }
    let pip = |extra: &[&str]| {
        Command::new("python3")
            .args([
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--disable-pip-version-check",
                "-q",
            ])
            .args(extra)
            .arg("--target")
            .arg(&target)
            .arg(&src)
            .env("PIP_NO_INPUT", "1")
            .output()
            .expect("python3 -m pip")
    };
    // Without build isolation when setuptools and wheel are here (no network needed); else
    // as a user runs it, with pip fetching the build backend.
    let mut out = pip(&["--no-build-isolation"]);
    if !out.status.success() {
        out = pip(&[]);
    }
    assert!(
        out.status.success(),
        "pip install ./python failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let check = Command::new("python3")
        .args([
            "-c",
            "import ailhd_reader, sys; print(ailhd_reader.__file__); \
             assert ailhd_reader.__file__.startswith(sys.argv[1]), 'not the installed copy'; \
             assert callable(ailhd_reader.LiveDataset) and callable(ailhd_reader.collate)",
        ])
        .arg(&target)
        .env("PYTHONPATH", &target)
        .current_dir(tmp.path())
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "the installed package does not import:\n{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
}
