//! The trainer's reader, `ailhd_reader` (python/), on outputs made by the real binary: equal to
//! h5py's raw reads on every split and both sources, committed and valid rows only, worker
//! processes; following the real `ailhd run` service while it appends, supersedes, deletes,
//! moves, stops and restarts; the feature rows of files `rebuild` wrote and the service then
//! appended to stay aligned (the reader's fast path) and readable by Debian's h5dump 1.10; a real
//! torch DataLoader with LiveSampler while the service appends, stops, idles, is killed and
//! rebuilt (online learning); the reader beside the README's own h5py open in one process; and
//! the package installs with pip.

use crate::common::service::*;
use crate::common::*;
use serial_test::serial;
use std::path::{Path, PathBuf};
use std::process::Command;

const FAST: &str = "[ingest]\nsettle_ms = 100\nquarantine_after_s = 2\nmax_batch_latency_ms = 10\nrescan_interval_s = 0\ndevice = \"cpu\"\n";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
#[serial]
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
#[serial]
fn reader_follows_the_running_service() {
    // 40 recordings, 4 of them in the tree from the start.
    live_script("reader_live", "", 20, 11, 4);
}

/// Online learning as a trainer runs it (tests/py/reader_online.py): a real torch `DataLoader`
/// with `LiveSampler` over both sources, persistent workers or not, fork and spawn, while the
/// service appends between and during epochs; every epoch serves exactly the rows valid at its
/// start. Then a stop, an idle close and reopen, a kill and restart and a `rebuild` in the middle
/// of epochs, the plain shuffled loop with persistent workers, replay and two DDP ranks. Needs
/// torch (`.ci/setup` installs it): without it the script fails, it does not skip.
#[test]
#[serial]
fn reader_online_learning_with_a_real_dataloader() {
    // 200 recordings, 12 of them in the tree from the start.
    live_script("reader_online", "idle_close_s = 1\n", 100, 31, 12);
}

/// The reader and the README's h5py snippet (`h5py.File(p, "r", libver="latest", swmr=True)`)
/// in one Python process, in either order, while the real service appends, and after it closed
/// its files when idle and reopened them (tests/py/reader_beside_h5py.py).
#[test]
#[serial]
fn reader_and_the_readme_h5py_snippet_share_one_process() {
    // 40 recordings, 8 of them in the tree from the start.
    live_script("reader_beside_h5py", "idle_close_s = 1\n", 20, 41, 8);
}

/// Label names the service appends (`labels.unknown = "append"`) reach LiveDatasets that stay
/// open, from both sources, beside a README-style h5py handle in the same process: in the
/// attribute's room while the service runs, and past it after a restart
/// (tests/py/reader_appended_labels.py).
#[test]
#[serial]
fn appended_label_names_reach_open_readers() {
    live_script(
        "reader_appended_labels",
        "idle_close_s = 60\n[labels]\nunknown = \"append\"\n",
        10,
        43,
        6,
    );
}

/// Run `tests/py/NAME.py` beside a service it starts itself: every row goes to training (plus
/// `ingest` lines of the `[ingest]` table), `per_label` recordings per label wait in a pool
/// outside the tree, and the first `initial` of them (in path order) are in the tree already.
/// The script prints `NAME: OK` when every check passed.
fn live_script(name: &str, ingest: &str, per_label: usize, seed: u64, initial: usize) {
    let world = World::new(&format!(
        "{FAST}{ingest}[splits.ratios]\ntraining = 100\nvalidation = 0\ntesting = 0\n"
    ));
    let pool = world.dir.path().join("pool");
    let mut files = ailhd::synth::write_tree(&pool, &["LEAK", "NORMAL"], per_label, seed).unwrap();
    files.sort();
    for f in &files[..initial] {
        let rel = f.strip_prefix(&pool).unwrap();
        std::fs::create_dir_all(world.rec().join(rel).parent().unwrap()).unwrap();
        std::fs::rename(f, world.rec().join(rel)).unwrap();
    }
    let text = python(
        &format!("{name}.py"),
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
    assert!(text.contains(&format!("{name}: OK")), "{text}");
}

/// `h5dump -d segments_mel -b FILE` (HDF5 1.10's own reader; `-b FILE`: the bytes as stored)
/// of every split into `bins`, as `<file name>.bin`.
fn h5dump_features(out: &Path, bins: &Path) {
    std::fs::create_dir_all(bins).unwrap();
    for name in [
        "TRAINING_DATASET.H5",
        "VALIDATION_DATASET.H5",
        "TESTING_DATASET.H5",
    ] {
        let o = Command::new("h5dump")
            .args(["-d", "segments_mel", "-b", "FILE", "-o"])
            .arg(bins.join(format!("{name}.bin")))
            .arg(out.join(name))
            .output()
            .expect("h5dump (Debian's hdf5-tools, HDF5 1.10) is needed: .ci/setup installs it");
        ok(&o);
    }
}

/// The files `rebuild` writes and the service then appends to keep every `segments_mel` chunk
/// at a multiple of the row size (so the reader gathers whole rows: its fast path), checked
/// after the rebuild, while the service appends, and after it stops; and h5dump 1.10 reads
/// the appended file's features as h5py does.
#[test]
#[serial]
fn rebuilt_then_appended_files_keep_feature_rows_aligned() {
    let world = World::new(FAST);
    let labels = ["BACKGROUND", "LEAK", "NORMAL"];
    let written = ailhd::synth::write_tree(&world.rec(), &labels, 10, 21).unwrap();
    ok(&world.run(&["rebuild"]));
    let text = python("reader_aligned.py", &[&world.out()]);
    println!("after rebuild:\n{text}");

    let svc = Service::start(&world);
    let n = written.len();
    for i in 0..24 {
        let label = labels[i % 3];
        let bytes = ailhd::synth::wav_pcm16(
            &ailhd::synth::clip(label, 7000 + i as u64, 4096, 10.0),
            4096,
        );
        write_via_rename(
            &world.rec(),
            &format!("{label}/{}", ailhd::synth::file_name(1000 + i, 21)),
            &bytes,
        );
        if i % 5 == 4 {
            std::thread::sleep(std::time::Duration::from_millis(150));
        }
    }
    svc.wait("24 more files committed", |s| {
        committed(s) == (n + 24) as u64
    });
    let text = python("reader_aligned.py", &[&world.out()]);
    println!("while the service runs:\n{text}");
    svc.terminate();
    let bins = world.dir.path().join("h5dump");
    h5dump_features(&world.out(), &bins);
    let text = python("reader_aligned.py", &[&world.out(), &bins]);
    println!("after it stopped:\n{text}");
}

/// `pip install ./python` works: build the wheel (no network: the build backend installed
/// here), install it into a folder, and import the installed copy.
#[test]
#[serial]
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
