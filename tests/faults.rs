//! Faults an acquisition host meets, with the real binary: the output disk filling up (a real
//! tmpfs of a few MiB), and the service idle for `ingest.idle_close_s` with readers holding the
//! files (plain h5py, HDF5 1.10's h5dump, and an h5py SWMR reader that never closes them).
//! A lost state folder is in `daemon.rs`, next to the other restarts.

use crate::common::service::*;
use crate::common::*;
use serial_test::serial;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const FAST: &str = "[ingest]\nsettle_ms = 100\nquarantine_after_s = 2\nmax_batch_latency_ms = 10\nrescan_interval_s = 0\ndevice = \"cpu\"\n";

fn clip(label: &str, i: usize) -> Vec<u8> {
    clip_wav(label, 900 + i as u64)
}

fn add(world: &World, range: std::ops::Range<usize>) {
    for i in range {
        let (label, rel) = alternating(i, 4);
        write_via_rename(&world.rec(), &rel, &clip(label, i));
    }
}

/// A tmpfs mounted on a folder for the test's life.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let o = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("mount(8) is needed for the disk-full test");
        assert!(
            o.status.success(),
            "the disk-full test mounts a small tmpfs as the output folder and needs root (or CAP_SYS_ADMIN) for it: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Fill the file system holding `dir` to the last byte; returns the filler's path.
fn fill(dir: &Path) -> PathBuf {
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let block = vec![0x5Au8; 1 << 16];
    while f.write_all(&block).is_ok() {}
    let mut small = vec![0u8; 512];
    while f.write_all(&small[..1]).is_ok() {
        small[0] = 1;
    }
    path
}

#[test]
#[serial]
fn a_full_output_disk_is_ridden_out_and_nothing_is_lost_or_torn() {
    let metrics = tempfile::tempdir().unwrap();
    let prom = metrics.path().join("ailhd.prom");
    let world = World::new(&format!("{FAST}[metrics]\ntextfile = {prom:?}\n"));
    let _tmpfs = Tmpfs::mount(&world.out(), "24m");
    add(&world, 0..4);
    let svc = Service::start(&world);
    svc.wait("4 files committed", |s| committed(s) == 4);
    let reader = PyReader::start(&world, "swmr_reader.py");

    let filler = fill(&world.out());
    add(&world, 4..7);
    let snap = svc.wait("the write failure reported", |s| {
        s["service"]["write_failing"].is_object()
    });
    let error = snap["service"]["write_failing"]["error"].as_str().unwrap();
    assert!(error.contains("disk full"), "{snap}");
    assert!(
        error.contains(world.out().to_str().unwrap()),
        "names the folder: {error}"
    );
    // Still up, saying so everywhere an operator looks.
    std::thread::sleep(Duration::from_millis(1500));
    let mut child_alive = Command::new("kill")
        .args(["-0", &svc.pid().to_string()])
        .status()
        .unwrap();
    assert!(child_alive.success(), "the service died: {}", svc.log());
    let text = ok(&world.run(&["status"]));
    assert!(text.contains("WRITING FAILS"), "{text}");
    svc.wait_for("the metrics say so", || {
        std::fs::read_to_string(&prom)
            .unwrap_or_default()
            .contains("ailhd_write_failing 1")
    });
    assert!(committed(&svc.snapshot().unwrap()) == 4);

    // Room again: it resumes by itself and takes up what arrived meanwhile.
    std::fs::remove_file(&filler).unwrap();
    svc.wait("the 3 new files committed", |s| {
        committed(s) == 7 && s["service"]["write_failing"].is_null()
    });
    child_alive = Command::new("kill")
        .args(["-0", &svc.pid().to_string()])
        .status()
        .unwrap();
    assert!(child_alive.success());
    let out = reader.finish();
    println!("{out}");
    let log = svc.terminate();
    assert!(log.contains("writing works again"), "{log}");
    let metrics = std::fs::read_to_string(&prom).unwrap();
    assert!(metrics.contains("ailhd_write_failing 0"), "{metrics}");
    let _ = std::fs::remove_file(&prom);
    compare_with_rebuild(&world);
}

#[test]
#[serial]
fn a_featuriser_failing_mid_run_is_ridden_out_and_nothing_is_lost() {
    let metrics = tempfile::tempdir().unwrap();
    let prom = metrics.path().join("ailhd.prom");
    let world = World::new(&format!("{FAST}[metrics]\ntextfile = {prom:?}\n"));
    add(&world, 0..4);
    let svc = Service::start(&world);
    svc.wait("4 files committed", |s| committed(s) == 4);
    svc.terminate();
    // The real CPU featuriser cannot be made to fail: the binary `cargo test` builds has a fail
    // point in the featurise stage (Cargo.toml, feature `failpoints`), here failing the next 3
    // batches featurised, as a featuriser that lost its device would.
    let svc = Service::start_failing(&world, "featurise=3*return(the device is gone)");
    let reader = PyReader::start_opened(&world, "rows_keep.py");
    add(&world, 4..7);
    let snap = svc.wait("the failure reported", |s| {
        s["service"]["write_failing"].is_object()
    });
    let error = snap["service"]["write_failing"]["error"].as_str().unwrap();
    assert!(
        error.contains("the featuriser (cpu) failed") && error.contains("the device is gone"),
        "{snap}"
    );
    // Still up, saying so in `status` (each retry reopens the outputs, which works, and fails
    // again at the next batch: asked between the two, `status` has nothing to report).
    svc.wait_for("`status` to report it", || {
        let text = ok(&world.run(&["status"]));
        text.contains("WRITING FAILS") && text.contains("the featuriser (cpu) failed")
    });
    assert_eq!(committed(&svc.snapshot().unwrap()), 4);
    // More arrive while it fails; it retries with a growing backoff, the featuriser failing at
    // each try until the third, then resumes by itself and takes up everything.
    add(&world, 7..9);
    svc.wait("all 9 committed, the failure over", |s| {
        committed(s) == 9 && s["service"]["write_failing"].is_null()
    });
    let out = reader.finish();
    println!("{out}");
    let log = svc.terminate();
    assert!(
        log.contains("featurising failed, nothing of the batch was recorded")
            && log.matches("featurising still fails").count() == 2
            && log.contains("next try in 2 s")
            && log.contains("next try in 4 s")
            && log.contains("writing works again"),
        "{log}"
    );
    // Each failed featuriser was dropped, and a new one built for the next try.
    assert_eq!(
        log.matches("the featuriser (cpu) failed: dropped, a new one is built")
            .count(),
        3,
        "{log}"
    );
    let metrics = std::fs::read_to_string(&prom).unwrap();
    assert!(
        metrics.contains("ailhd_errors_total{kind=\"featurise\"} 1")
            && metrics.contains("ailhd_write_failing 0"),
        "{metrics}"
    );
    let _ = std::fs::remove_file(&prom);
    // Every file has its row, once, equal to a rebuild's; no row was left from the rolled-back
    // batches (the outputs hold exactly the 9 rows).
    let rows: u64 = ["training", "validation", "testing"]
        .iter()
        .map(|k| world.status_json()["splits"][k]["rows"].as_u64().unwrap())
        .sum();
    assert_eq!(rows, 9);
    compare_with_rebuild(&world);
}

/// Once writing works again, the service compares the tree with the manifest to take up what
/// it dropped meanwhile: a comparison that takes seconds at a few hundred thousand recordings.
/// It runs beside the ingest, so a recording that arrives meanwhile is committed at once.
#[test]
#[serial]
fn the_recovery_takes_new_recordings_while_it_compares_the_tree() {
    let world = World::new(FAST);
    // The first batch's featuriser fails; the recovery's comparison (the second one: the
    // start's is the first) is held 10 s, as one of a very large tree would take.
    let svc = Service::start_failing(
        &world,
        "featurise=1*return(the device is gone);reconcile-listed=1*off->1*sleep(10000)",
    );
    add(&world, 0..1);
    svc.wait("the failure reported", |s| {
        s["service"]["write_failing"].is_object()
    });
    // The retry comes after 1 s: by now the outputs are open again and the comparison runs.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        svc.log().contains("writing works again"),
        "the recovery waits for its comparison; log:\n{}",
        svc.log()
    );
    add(&world, 1..2);
    svc.wait_for_within(
        "the new recording committed while the comparison is held",
        Duration::from_secs(6),
        || svc.snapshot().is_some_and(|s| committed(&s) == 1),
    );
    // The recording whose batch failed, the comparison finds once it goes on.
    svc.wait("both committed", |s| committed(s) == 2);
    let log = svc.terminate();
    assert!(
        log.contains("featurising failed, nothing of the batch was recorded")
            && log.contains("changes seen meanwhile are taken up again")
            && log.contains("rescan: 1 new or changed"),
        "{log}"
    );
    compare_with_rebuild(&world);
}

/// A recovery whose comparison fails is no recovery: writing is reported failing again and
/// the whole recovery is tried again after the backoff, until its comparison succeeds.
#[test]
#[serial]
fn a_recovery_whose_comparison_fails_is_tried_again() {
    let world = World::new(FAST);
    let svc = Service::start_failing(
        &world,
        "featurise=1*return(the device is gone);reconcile-error=1*off->1*return(the manifest cannot be read)",
    );
    add(&world, 0..1);
    svc.wait("the failure reported", |s| {
        s["service"]["write_failing"].is_object()
    });
    svc.wait_for("the recovery's comparison to fail", || {
        svc.log().contains("the manifest cannot be read")
    });
    add(&world, 1..3);
    svc.wait("all 3 committed, the failure over", |s| {
        committed(s) == 3 && s["service"]["write_failing"].is_null()
    });
    let log = svc.terminate();
    assert!(
        log.contains(
            "still fails: comparing the tree with the manifest after the recovery: the manifest cannot be read; next try in 2 s"
        ) && log.matches("writing works again").count() == 2,
        "{log}"
    );
    compare_with_rebuild(&world);
}

/// A recording that cannot be read (an I/O error, a permission refused) is quarantined with the
/// reason, and read again after `ingest.unreadable_retry_s`: a condition that passes ends with
/// the recording's row, the file unchanged.
#[test]
#[serial]
fn an_unreadable_recording_is_read_again_after_a_while() {
    let world = World::new(&format!("{FAST}unreadable_retry_s = 2\n"));
    let rel = "LEAK/S001~R1~20250118120530~100.wav";
    // Reading it fails once (the first file loaded), as a disk that failed a read would.
    let svc = Service::start_failing(&world, &format!("read-error=1*return({rel})"));
    write_via_rename(&world.rec(), rel, &clip("LEAK", 0));
    let snap = svc.wait("the recording quarantined", |s| {
        s["files"]["quarantined"] == 1
    });
    let reason = snap["quarantined"][0]["reason"]
        .as_str()
        .unwrap_or_default();
    assert!(
        snap["quarantined"][0]["path"] == rel && reason.contains("Input/output error"),
        "{snap}"
    );
    // Nothing changes the file: the retry alone reads it.
    svc.wait("the recording committed", |s| {
        committed(s) == 1 && s["files"]["quarantined"] == 0
    });
    let log = svc.terminate();
    assert!(
        log.contains(&format!("{rel}: reading it is tried again in 2 s")),
        "{log}"
    );
    compare_with_rebuild(&world);
}

/// A chmod (or chown) of a file that could not be read has it read at once: the retry does not
/// wait for its time.
#[test]
#[serial]
fn a_chmod_has_an_unreadable_recording_read_at_once() {
    let world = World::new(&format!("{FAST}unreadable_retry_s = 600\n"));
    let rel = "LEAK/S001~R1~20250118120530~100.wav";
    let svc = Service::start_failing(&world, &format!("read-error=1*return({rel})"));
    let path = world.rec().join(rel);
    write_via_rename(&world.rec(), rel, &clip("LEAK", 0));
    svc.wait("the recording quarantined", |s| {
        s["files"]["quarantined"] == 1
    });
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
    let t = std::time::Instant::now();
    svc.wait("the recording committed", |s| {
        committed(s) == 1 && s["files"]["quarantined"] == 0
    });
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "committed after {:?}: the chmod did not have it read",
        t.elapsed()
    );
    let log = svc.terminate();
    assert!(
        log.contains(&format!("{rel}: reading it is tried again in 600 s")),
        "{log}"
    );
    compare_with_rebuild(&world);
}

/// `rebuild` with the recordings folder empty (an unmounted disk's mount point) while the
/// outputs hold recordings stops before replacing anything and says why; `--allow-empty`
/// empties the outputs on purpose.
#[test]
fn a_rebuild_of_an_empty_recordings_folder_changes_nothing_unless_allowed() {
    let world = World::new(FAST);
    add(&world, 0..4);
    ok(&world.run(&["rebuild", "--device", "cpu"]));
    let training = world.out().join("TRAINING_DATASET.H5");
    let before = std::fs::read(&training).unwrap();
    let away = world.dir.path().join("away");
    std::fs::rename(world.rec(), &away).unwrap();
    std::fs::create_dir(world.rec()).unwrap();
    let o = world.run(&["rebuild", "--device", "cpu"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("is the recordings disk mounted?"), "{err}");
    assert!(err.contains(&world.rec().display().to_string()), "{err}");
    assert_eq!(committed(&world.status_json()), 4);
    assert!(
        std::fs::read(&training).unwrap() == before,
        "the outputs changed"
    );
    assert!(
        !world.out().join(".ailhd-staging").exists(),
        "the refused rebuild left its staging outputs"
    );
    ok(&world.run(&["rebuild", "--device", "cpu", "--allow-empty"]));
    let s = world.status_json();
    assert_eq!(committed(&s), 0, "{s}");
    assert_eq!(s["splits"]["training"]["rows"].as_u64(), Some(0), "{s}");
}

/// A `rebuild` that fills the output disk part way through fails, saying so and naming the
/// folder; the outputs it was to replace stay as they were, and its staging outputs are
/// removed, so the disk has its space back (a full disk left full by a failed rebuild would stop
/// the service too).
#[test]
#[serial]
fn a_rebuild_that_fills_the_output_disk_leaves_the_outputs_and_the_space() {
    let world = World::new(FAST);
    let _tmpfs = Tmpfs::mount(&world.out(), "4m");
    add(&world, 0..4);
    ok(&world.run(&["rebuild", "--device", "cpu"]));
    let training = world.out().join("TRAINING_DATASET.H5");
    let before = std::fs::read(&training).unwrap();
    let listing = |dir: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let names = listing(&world.out());
    // Twice the features the 4 MiB disk can hold (each clip's rows take ~20 KB in the HDF5 file
    // and the npy columns together).
    add(&world, 4..404);
    let o = world.run(&["rebuild", "--device", "cpu"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(world.out().to_str().unwrap()),
        "names the folder: {err}"
    );
    assert!(
        err.to_lowercase().contains("no space left") || err.contains("disk full"),
        "says the disk is full: {err}"
    );
    assert_eq!(listing(&world.out()), names, "the output folder changed");
    assert!(
        std::fs::read(&training).unwrap() == before,
        "the outputs changed"
    );
    assert_eq!(committed(&world.status_json()), 4);
    // Room again (the 400 recordings moved elsewhere): the next rebuild works.
    let away = world.dir.path().join("away");
    std::fs::create_dir_all(&away).unwrap();
    for i in 4..404 {
        let (_, rel) = alternating(i, 4);
        let from = world.rec().join(&rel);
        std::fs::rename(&from, away.join(format!("{i}.wav"))).unwrap();
    }
    ok(&world.run(&["rebuild", "--device", "cpu"]));
    assert_eq!(committed(&world.status_json()), 4);
}

/// The recordings' disk unmounted under a running service leaves an empty mount point: that is
/// a disk not there, not every recording deleted. The service notices the folder is another one
/// (it looks every 10 s), compares it, lets go of no row (a trainer keeps its dataset) and says
/// why; mounted again, the folder is watched anew without a restart.
#[test]
#[serial]
fn an_unmounted_recordings_disk_is_not_taken_as_every_recording_deleted() {
    let world = World::new(FAST);
    let rec = world.rec();
    let disk = Tmpfs::mount(&rec, "16m");
    add(&world, 0..4);
    let svc = Service::start(&world);
    svc.wait("4 files committed", |s| committed(s) == 4);
    let valid = |world: &World| -> u64 {
        let s = world.status_json();
        ["training", "validation", "testing"]
            .iter()
            .map(|k| s["splits"][k]["valid"].as_u64().unwrap())
            .sum()
    };
    assert_eq!(valid(&world), 4);
    // Keep the recordings to put back, then unmount (lazily, as a disk going away would).
    let kept = world.dir.path().join("kept");
    let copy = Command::new("cp")
        .arg("-a")
        .arg(&rec)
        .arg(&kept)
        .status()
        .unwrap();
    assert!(copy.success());
    let umount = Command::new("umount").arg("-l").arg(&rec).status().unwrap();
    assert!(umount.success(), "umount {}", rec.display());
    svc.wait_for("the comparison to refuse the empty folder", || {
        svc.log()
            .contains("is empty while the manifest knows recordings")
    });
    std::thread::sleep(Duration::from_millis(1500));
    let snap = svc.wait("`status` to list why", |s| {
        s["service"]["last_errors"].as_array().is_some_and(|l| {
            l.iter()
                .any(|e| e.as_str().unwrap_or("").contains("is empty"))
        })
    });
    assert_eq!(committed(&snap), 4, "{snap}");
    assert_eq!(valid(&world), 4, "rows let go while the disk was away");
    // The disk back, mounted anew (the old mount's watches are gone), and a new recording.
    let _disk = Tmpfs::mount(&rec, "16m");
    let back = Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", kept.display()))
        .arg(&rec)
        .status()
        .unwrap();
    assert!(back.success());
    add(&world, 4..5);
    svc.wait("the new recording committed", |s| committed(s) == 5);
    assert_eq!(valid(&world), 5);
    // And one more, seen by the new watches.
    let t = std::time::Instant::now();
    add(&world, 5..6);
    svc.wait("the next one committed", |s| committed(s) == 6);
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
    let log = svc.terminate();
    assert_eq!(log.matches("is another folder now").count(), 2, "{log}");
    compare_with_rebuild(&world);
    drop(disk);
}

/// A recordings folder that is not there when the service starts (its disk not mounted yet at
/// boot, the folder on it) does not keep the service down: `run` starts, says why it takes
/// nothing, and watches the folder once it appears (it looks every 10 s), without a restart.
/// `check-config` still refuses the missing folder, saying that `run` waits for it.
#[test]
#[serial]
fn a_recordings_folder_missing_at_start_is_waited_for() {
    let world = World::new(FAST);
    let rec = world.rec();
    std::fs::remove_dir(&rec).unwrap();
    let checked = world.run(&["check-config"]);
    let said = String::from_utf8_lossy(&checked.stderr).to_string();
    assert_eq!(checked.status.code(), Some(2), "{said}");
    assert!(said.contains("waits for it"), "{said}");
    let svc = Service::start(&world);
    assert!(
        svc.log().contains("no such folder (is its disk mounted?)"),
        "{}",
        svc.log()
    );
    std::fs::create_dir_all(rec.join("LEAK")).unwrap();
    add(&world, 0..3);
    svc.wait("the recordings of the folder that appeared", |s| {
        committed(s) == 3
    });
    // And one more, seen by the watches set up on it.
    let t = std::time::Instant::now();
    add(&world, 3..4);
    svc.wait("the next one committed", |s| committed(s) == 4);
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
    let log = svc.terminate();
    assert_eq!(log.matches("is there now").count(), 1, "{log}");
    compare_with_rebuild(&world);
}

/// Open every split's file as plain (non-SWMR) readers do, with h5py and with HDF5 1.10's
/// h5dump, and check every dataset has exactly committed_rows rows.
fn plain_readers_open(world: &World) -> String {
    let script = r#"
import os, sys
import h5py
out = sys.argv[1]
total = 0
for n in ["TRAINING_DATASET.H5", "VALIDATION_DATASET.H5", "TESTING_DATASET.H5"]:
    with h5py.File(os.path.join(out, n), "r") as f:
        c = int(f["committed_rows"][0])
        for d in f:
            if d != "committed_rows":
                assert f[d].shape[0] == c, f"{n}:{d} has {f[d].shape[0]} rows, committed {c}"
        total += c
print(total)
"#;
    let o = Command::new("python3")
        .args(["-c", script, world.out().to_str().unwrap()])
        .output()
        .unwrap();
    let rows = ok(&o);
    for n in [
        "TRAINING_DATASET.H5",
        "VALIDATION_DATASET.H5",
        "TESTING_DATASET.H5",
    ] {
        let o = Command::new("h5dump")
            .args(["-H"])
            .arg(world.out().join(n))
            .output()
            .expect("h5dump (Debian's hdf5-tools, HDF5 1.10) is needed: .ci/setup installs it");
        ok(&o);
    }
    rows.trim().to_string()
}

/// An output file removed or emptied behind the service's back (an operator's `rm` while it
/// idles): only `ailhd rebuild` mends that. The running service names the file and the remedy
/// (it was a bare "no such file", retried for ever), `check-config` agrees, and a start is
/// refused with exit 2, which the unit does not retry (it was exit 1: a restart every 2 s).
/// After the rebuild the service takes recordings again.
#[test]
#[serial]
fn an_output_file_removed_or_emptied_is_named_with_its_remedy() {
    let world = World::new(&format!("{FAST}idle_close_s = 1\n"));
    add(&world, 0..4);
    let svc = Service::start(&world);
    svc.wait("4 files committed", |s| committed(s) == 4);
    svc.wait("closed while idle", |s| {
        s["service"]["outputs_open"] == false
    });
    let training = world.out().join("TRAINING_DATASET.H5");
    std::fs::remove_file(&training).unwrap();
    add(&world, 4..6);
    let snap = svc.wait("the reopen refused, saying why", |s| {
        s["service"]["write_failing"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("ailhd rebuild"))
    });
    let error = snap["service"]["write_failing"]["error"].as_str().unwrap();
    assert!(
        error.contains("TRAINING_DATASET.H5 (missing)"),
        "the error names the file: {error}"
    );
    svc.terminate();
    let refused = |what: &str| {
        for args in [&["check-config"][..], &["run"][..]] {
            let o = world.run(args);
            let err = String::from_utf8_lossy(&o.stderr).to_string();
            assert_eq!(o.status.code(), Some(2), "{what}: {args:?}: {err}");
            assert!(
                err.contains("ailhd rebuild") && err.contains(what),
                "{what}: {args:?}: {err}"
            );
        }
    };
    refused("TRAINING_DATASET.H5 (missing)");
    ok(&world.run(&["rebuild"]));
    // Emptied while stopped: the same.
    std::fs::write(world.out().join("VALIDATION_DATASET.H5"), b"").unwrap();
    refused("VALIDATION_DATASET.H5 (empty)");
    ok(&world.run(&["rebuild"]));
    let svc = Service::start(&world);
    add(&world, 6..7);
    svc.wait("7 files committed", |s| committed(s) == 7);
    svc.terminate();
    compare_with_rebuild(&world);
}

#[test]
#[serial]
fn idle_files_are_closed_for_plain_readers_and_reopened_under_a_swmr_reader() {
    let world = World::new(&format!("{FAST}idle_close_s = 1\n"));
    add(&world, 0..3);
    let svc = Service::start(&world);
    svc.wait("3 files committed", |s| committed(s) == 3);
    let reader = PyReader::start(&world, "swmr_reader.py");
    svc.wait("closed while idle", |s| {
        s["service"]["outputs_open"] == false && s["service"]["write_failing"].is_null()
    });
    assert!(svc.log().contains("outputs closed"), "{}", svc.log());
    assert_eq!(plain_readers_open(&world), "3");

    // The next file reopens them; the SWMR reader, which kept them open all along, sees it.
    add(&world, 3..5);
    svc.wait("5 files committed", |s| committed(s) == 5);
    svc.wait("closed again", |s| s["service"]["outputs_open"] == false);
    let out = reader.finish();
    assert!(out.contains("final committed rows: 5"), "{out}");
    // A kill while idle leaves files any reader opens.
    svc.kill9();
    assert_eq!(plain_readers_open(&world), "5");
    compare_with_rebuild(&world);
}

/// A reader may open the files at any moment: while the service reopens them after an idle close
/// (each recording here arrives after one) or after a kill, also one that left rows to
/// publish, HDF5 must never refuse a SWMR open. A file opened
/// read-write without SWMR first, and switched to SWMR writing after, is refused to SWMR readers
/// in between ("file is not already open for SWMR writing").
#[test]
#[serial]
fn swmr_readers_open_the_files_while_the_service_reopens_them() {
    let world = World::new(&format!("{FAST}idle_close_s = 1\n"));
    add(&world, 0..2);
    let svc = Service::start(&world);
    svc.wait("2 files committed", |s| committed(s) == 2);
    let opener = PyReader::start(&world, "swmr_opener.py");
    for i in 2..10 {
        svc.wait("closed while idle", |s| {
            s["service"]["outputs_open"] == false
        });
        add(&world, i..i + 1);
        svc.wait("the next file committed", |s| committed(s) == i as u64 + 1);
    }
    assert!(
        svc.log().matches("outputs closed").count() >= 8,
        "{}",
        svc.log()
    );
    // Killed with the files open (no idle close now), then started again: the restart reopens
    // them too, its writer's status flags left in them.
    let config = std::fs::read_to_string(&world.config).unwrap();
    std::fs::write(
        &world.config,
        config.replace("idle_close_s = 1", "idle_close_s = 600"),
    )
    .unwrap();
    ok(&world.run(&["reload", "--pid", &svc.pid().to_string()]));
    add(&world, 10..11);
    svc.wait("the file before the kill committed", |s| {
        committed(s) == 11 && s["service"]["outputs_open"] == true
    });
    svc.kill9();
    let svc = Service::start(&world);
    add(&world, 11..12);
    svc.wait("the file after the restart committed", |s| {
        committed(s) == 12
    });
    assert!(
        svc.log().contains("assuming its writer was killed"),
        "{}",
        svc.log()
    );
    // Killed with a batch's rows written past committed_rows (a fail point of test builds
    // holds the batch between the manifest's flush and the publish), four times: each restart
    // publishes them, the files open for SWMR writing all along.
    let mut svc = svc;
    for i in 12..16 {
        svc.terminate();
        let stalled = Service::start_failing(&world, "commit-before-publish=1*sleep(120000)");
        add(&world, i..i + 1);
        stalled.wait_for("the batch's rows on disk, beyond committed_rows", || {
            hdf5_extents(&world).iter().sum::<u64>() > i as u64
        });
        std::thread::sleep(Duration::from_millis(500));
        stalled.kill9();
        svc = Service::start(&world);
        svc.wait("the batch published", |s| committed(s) == i as u64 + 1);
        assert!(svc.log().contains("publishing rows"), "{}", svc.log());
    }
    println!("{}", opener.finish());
    svc.terminate();
    compare_with_rebuild(&world);
}

/// sled panicking while the idle close folds its log (`Manifest::fold_log`, as on a disk that
/// fails while sled opens) does not stop the service: it says so in a line of its own (the
/// panic's message only at debug level), and the next recording is taken as usual.
#[test]
#[serial]
fn a_panic_in_sled_while_the_idle_close_folds_its_log_stops_nothing() {
    let world = World::new(&format!("{FAST}idle_close_s = 1\n"));
    add(&world, 0..2);
    let svc = Service::start_failing(&world, "fold-log=panic");
    svc.wait("2 files committed", |s| committed(s) == 2);
    svc.wait("closed while idle", |s| {
        s["service"]["outputs_open"] == false
    });
    assert!(
        svc.log().contains("sled failed while folding its log"),
        "{}",
        svc.log()
    );
    // The service's own line says what failed; the panic's message is not printed as a crash's
    // would be ("thread ... panicked at", with a backtrace hint) in the journal.
    assert!(!svc.log().contains("panicked at"), "{}", svc.log());
    add(&world, 2..4);
    svc.wait("4 files committed", |s| committed(s) == 4);
    svc.wait("closed again", |s| s["service"]["outputs_open"] == false);
    svc.terminate();
    compare_with_rebuild(&world);
}

#[test]
#[serial]
fn folders_past_the_watch_limit_are_reported_rescanned_and_retried() {
    // A real inotify limit without touching the host's: in a user namespace of its own, the
    // service may hold 3 watches (the root, and two of the three label folders).
    let world = World::new(FAST);
    for label in ["CRACK", "LEAK", "NORMAL"] {
        std::fs::create_dir_all(world.rec().join(label)).unwrap();
    }
    let limit = [
        "unshare",
        "--user",
        "--map-root-user",
        "sh",
        "-c",
        "echo 3 > /proc/sys/user/max_inotify_watches && exec \"$@\"",
        "sh",
    ];
    let probe = Command::new(limit[0])
        .args(&limit[1..])
        .arg("true")
        .output();
    assert!(
        probe.as_ref().is_ok_and(|o| o.status.success()),
        "this test runs the service in a user namespace with a small inotify limit (unshare -Ur, /proc/sys/user/max_inotify_watches): {probe:?}"
    );
    let svc = Service::start_under(&world, &limit);
    let snap = svc.wait("an unwatched folder reported", |s| {
        s["service"]["unwatched"]
            .as_array()
            .is_some_and(|a| a.len() == 1)
    });
    let folder = PathBuf::from(snap["service"]["unwatched"][0]["path"].as_str().unwrap());
    let reason = snap["service"]["unwatched"][0]["reason"].as_str().unwrap();
    assert!(reason.contains("max_user_watches"), "{snap}");
    let text = ok(&world.run(&["status"]));
    assert!(text.contains("NOT WATCHED"), "{text}");
    // A recording in it still arrives, through the rescans.
    let label = folder
        .strip_prefix(world.rec())
        .expect("a label folder, not the root")
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        ["CRACK", "LEAK", "NORMAL"].contains(&label.as_str()),
        "{label}"
    );
    write_via_rename(&world.rec(), &format!("{label}/late.wav"), &clip(&label, 1));
    svc.wait("the recording in the unwatched folder", |s| {
        committed(s) == 1
    });
    // A watch freed (a folder removed): the next retry watches it, and says so.
    let other = ["CRACK", "LEAK", "NORMAL"]
        .into_iter()
        .find(|l| *l != label)
        .unwrap();
    std::fs::remove_dir(world.rec().join(other)).unwrap();
    svc.wait("watched after the retry", |s| {
        s["service"]["unwatched"]
            .as_array()
            .is_some_and(|a| a.is_empty())
    });
    // Watched now: a new file is seen at once (no rescan needed).
    write_via_rename(
        &world.rec(),
        &format!("{label}/later.wav"),
        &clip(&label, 2),
    );
    svc.wait("the next recording", |s| committed(s) == 2);
    let log = svc.terminate();
    assert!(log.contains("is watched now"), "{log}");
}

/// A label folder the service user may not read (a `chmod 000`, a wrong owner) is not every
/// recording in it deleted: its rows stay, through rescans and a restart; the service starts
/// and takes the other folders, lists the folder as not watched (with why), and takes it back
/// once it can read it, without a restart. `rebuild` refuses to make outputs without it.
#[test]
#[serial]
fn a_folder_the_service_may_not_read_keeps_its_rows_and_stops_nothing() {
    use std::os::unix::fs::PermissionsExt;
    if unsafe { libc::geteuid() } != 0 {
        panic!("this test runs the service as another user (nobody) than the folders' owner: run it as root");
    }
    let world = World::new(&FAST.replace("rescan_interval_s = 0", "rescan_interval_s = 1"));
    add(&world, 0..6);
    // The service runs as nobody, as the packaged unit runs as its own user: a copy of the
    // binary it can reach, and a world it owns.
    let copy = world.dir.path().join("ailhd");
    std::fs::copy(bin(), &copy).unwrap();
    let chown = Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(world.dir.path())
        .status()
        .unwrap();
    assert!(chown.success());
    std::fs::set_permissions(world.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let copy = copy.to_str().unwrap();
    let nobody = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "sh",
        "-c",
        "shift; exec \"$0\" \"$@\"",
        copy,
    ];
    let leak = world.rec().join("LEAK");
    let svc = Service::start_under(&world, &nobody);
    svc.wait("6 committed", |s| committed(s) == 6);

    // Unreadable under the running service: rescans (every second) take nothing away.
    std::fs::set_permissions(&leak, std::fs::Permissions::from_mode(0o000)).unwrap();
    svc.wait_for("a rescan that could not list it", || {
        svc.log().contains("cannot list")
    });
    svc.wait_for("two more rescans", || {
        svc.log().matches("cannot list").count() >= 3
    });
    let snap = svc.wait("status naming the folder", |s| {
        s["service"]["last_errors"].as_array().is_some_and(|a| {
            a.iter()
                .any(|e| e.as_str().unwrap().contains("cannot list"))
        })
    });
    assert_eq!(committed(&snap), 6, "{snap}\n{}", svc.log());
    let text = ok(&world.run(&["status"]));
    assert!(
        text.contains(&format!("cannot list {}/", leak.display())),
        "{text}"
    );
    svc.terminate();

    // A start with it unreadable: up, the folder listed as not watched, the others taken.
    let svc = Service::start_under(&world, &nobody);
    let snap = svc.wait("the folder reported not watched", |s| {
        s["service"]["unwatched"]
            .as_array()
            .is_some_and(|a| a.len() == 1)
    });
    assert_eq!(
        snap["service"]["unwatched"][0]["path"].as_str(),
        leak.to_str(),
        "{snap}"
    );
    let reason = snap["service"]["unwatched"][0]["reason"].as_str().unwrap();
    assert!(reason.contains("permission denied"), "{reason}");
    assert_eq!(committed(&snap), 6, "{snap}");
    let (label, rel) = alternating(7, 4);
    assert_eq!(label, "NORMAL");
    write_via_rename(&world.rec(), &rel, &clip(label, 7));
    svc.wait("a recording in a readable folder", |s| committed(s) == 7);

    // Readable again: a recording placed there meanwhile arrives without a restart.
    std::fs::set_permissions(&leak, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (label, rel) = alternating(8, 4);
    write_via_rename(&world.rec(), &rel, &clip(label, 8));
    svc.wait("the folder watched again and its new recording", |s| {
        committed(s) == 8
            && s["service"]["unwatched"]
                .as_array()
                .is_some_and(|a| a.is_empty())
    });
    svc.terminate();

    // `rebuild` with the folder unreadable: refused, naming it; the outputs unchanged.
    std::fs::set_permissions(&leak, std::fs::Permissions::from_mode(0o000)).unwrap();
    let before = committed_rows(&world);
    let o = world.cmd_under(&nobody, &["rebuild"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot list the folder LEAK/") && err.contains("nothing was changed"),
        "{err}"
    );
    assert_eq!(committed_rows(&world), before);
    std::fs::set_permissions(&leak, std::fs::Permissions::from_mode(0o755)).unwrap();
    compare_with_rebuild(&world);
}

fn mount(args: &[&str], dir: &Path) {
    let o = Command::new("mount").args(args).arg(dir).output().unwrap();
    assert!(
        o.status.success(),
        "mount {args:?} {}: {}",
        dir.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// An output folder on a file system read-only as a whole (the kernel remounts one so after
/// disk errors) is a condition that may pass: `check-config` says so (exit 1, not 2), and `run`
/// starts, says what it waits for, stops cleanly on SIGTERM meanwhile, and goes on once the file
/// system is writable, without a restart. A read-only mount over a writable file system (what a
/// unit's ProtectSystem makes of a path outside its ReadWritePaths) stays a configuration error.
#[test]
#[serial]
fn an_output_file_system_read_only_at_start_is_waited_for() {
    let world = World::new(FAST);
    add(&world, 0..3);
    let out = world.out();
    let _tmpfs = Tmpfs::mount(&out, "64m");
    mount(&["-o", "remount,ro"], &out);

    let checked = world.run(&["check-config"]);
    let said = String::from_utf8_lossy(&checked.stderr).to_string();
    assert_eq!(checked.status.code(), Some(1), "{said}");
    assert!(
        said.contains("Read-only file system")
            && said.contains("the whole file system is read-only"),
        "{said}"
    );
    let waiting = |svc: &Service| {
        svc.wait_for("the service waiting for the output folder", || {
            svc.log().contains("waiting for it")
        })
    };
    let svc = Service::spawn(&world);
    waiting(&svc);
    let log = svc.terminate();
    assert!(log.contains("stopping while waiting"), "{log}");

    let mut svc = Service::spawn(&world);
    waiting(&svc);
    // `ailhd reload` reaches the waiting service: the configuration is read again, and it
    // starts afresh with it under the same pid, waiting on.
    let reloaded = ok(&world.run(&["reload", "--pid", &svc.pid().to_string()]));
    assert!(
        reloaded.contains("read again while waiting for the folders"),
        "{reloaded}"
    );
    std::thread::sleep(Duration::from_secs(6));
    assert!(svc.child.try_wait().unwrap().is_none(), "{}", svc.log());
    assert_eq!(
        svc.log().matches("waiting for it (checked again").count(),
        2
    );
    mount(&["-o", "remount,rw"], &out);
    svc.wait("the recordings, once writable", |s| committed(s) == 3);
    let log = svc.terminate();
    assert!(log.contains("the folders can be used now"), "{log}");

    // A read-only bind mount of the folder over its writable file system: configuration.
    mount(&["--bind", out.to_str().unwrap()], &out);
    mount(&["-o", "remount,bind,ro"], &out);
    let checked = world.run(&["check-config"]);
    let ran = exit_within(
        &mut world
            .cmd(&["run"])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
        Duration::from_secs(30),
    );
    let _ = Command::new("umount").arg(&out).status();
    let said = String::from_utf8_lossy(&checked.stderr).to_string();
    assert_eq!(checked.status.code(), Some(2), "{said}");
    assert!(said.contains("Read-only file system"), "{said}");
    assert_eq!(ran.and_then(|s| s.code()), Some(2));
    compare_with_rebuild(&world);
}

/// A reload that names an output folder that can be used ends a wait for a read-only one: the
/// fresh image starts at once under the same pid, and no note of the wait is left for `status`.
#[test]
#[serial]
fn a_reload_naming_a_usable_folder_ends_the_wait() {
    let world = World::new(FAST);
    add(&world, 0..2);
    let out = world.out();
    let _tmpfs = Tmpfs::mount(&out, "64m");
    mount(&["-o", "remount,ro"], &out);
    let svc = Service::spawn(&world);
    svc.wait_for("the service waiting for the output folder", || {
        svc.log().contains("waiting for it")
    });
    let note = world.state().join("waiting.json");
    assert!(note.exists());
    let config = std::fs::read_to_string(&world.config).unwrap();
    let other = world.dir.path().join("out-elsewhere");
    std::fs::write(
        &world.config,
        config.replace(&format!("{out:?}"), &format!("{other:?}")),
    )
    .unwrap();
    ok(&world.run(&["reload", "--pid", &svc.pid().to_string()]));
    let st = svc.wait("the recordings, in the other folder", |s| committed(s) == 2);
    assert_eq!(st["service"]["pid"].as_u64(), Some(svc.pid() as u64));
    assert!(!note.exists(), "{}", svc.log());
    let waiting = world.status_json()["waiting"].clone();
    assert!(waiting.is_null(), "{waiting}");
    svc.terminate();
}

/// `ingest.device = "cuda"` where no GPU can be used (this machine, and CI's) is a condition that
/// may pass (a driver installed later): `run` says so once, to its log, to systemd and to
/// `status` (`waiting`, kept across its looks), looks again every 10 s in a fresh image of itself
/// under the same pid, stops cleanly on SIGTERM meanwhile, and starts on the CPU once its
/// configuration says `device = "cpu"` (read again at a SIGHUP), without a restart.
#[test]
#[serial]
fn a_gpu_that_cannot_be_used_is_waited_for_and_a_new_configuration_heard() {
    let search = ailhd::features::cuda::LibrarySearch::for_featuriser(&Default::default());
    if ailhd::features::cuda::probe_with(&search)
        .problems
        .is_empty()
    {
        eprintln!("skipped: a GPU can be used here, and this test needs a host where none can");
        return;
    }
    let world = World::new(&FAST.replace("device = \"cpu\"", "device = \"cuda\""));
    add(&world, 0..3);
    let built = world.run(&["rebuild", "--device", "cpu"]);
    assert!(built.status.success(), "{built:?}");
    add(&world, 3..5);
    let waiting = |svc: &Service| {
        svc.wait_for("the service waiting for a GPU", || {
            svc.log().contains("waiting for it")
        })
    };
    let note = |world: &World| {
        let st = world.status_json();
        serde_json::from_value::<Option<ailhd::waiting::Waiting>>(st["waiting"].clone()).unwrap()
    };

    // Stopped while it waits: exit 0, and `status` no longer says it waits.
    let svc = Service::spawn(&world);
    waiting(&svc);
    let w = note(&world).expect("status names the waiting service");
    assert_eq!(w.pid, svc.pid());
    assert!(w.reason.starts_with("ingest.device = cuda"), "{w:?}");
    let text = String::from_utf8_lossy(&world.run(&["status"]).stdout).to_string();
    assert!(
        text.contains(&format!("the service (pid {}) has been waiting", svc.pid())),
        "{text}"
    );
    let log = svc.terminate();
    assert!(log.contains("stopping while waiting for a GPU"), "{log}");
    assert_eq!(note(&world), None);

    // Left waiting: it looks again in a fresh image (its debug line), warns once, keeps its note.
    let mut svc = Service::spawn_args(&world, &["--debug", "run"]);
    waiting(&svc);
    let first = note(&world).expect("a note");
    svc.wait_for_within("a second look", Duration::from_secs(30), || {
        svc.log().contains("still waiting")
    });
    assert!(svc.child.try_wait().unwrap().is_none(), "{}", svc.log());
    // Named as it was started (the kernel names an exec of /proc/self/exe `exe`).
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", svc.pid())).unwrap();
    assert_eq!(comm.trim_end(), "ailhd");
    assert_eq!(note(&world), Some(first));
    assert_eq!(svc.log().matches("waiting for it (looked for").count(), 1);
    assert_eq!(committed(&world.status_json()), 3);

    // `ailhd reload` (systemd's ExecReload) reaches it: a configuration that does not load is
    // refused and the wait goes on; one that says `device = "cpu"` is taken, and the recordings
    // waiting with it.
    let config = std::fs::read_to_string(&world.config).unwrap();
    let pid = svc.pid().to_string();
    let reload = |world: &World, device: &str| {
        let text = config.replace("device = \"cuda\"", &format!("device = \"{device}\""));
        std::fs::write(&world.config, text).unwrap();
        world.run(&["reload", "--pid", &pid])
    };
    let refused = reload(&world, "gpu");
    let said = String::from_utf8_lossy(&refused.stderr).to_string();
    assert_eq!(refused.status.code(), Some(2), "{said}");
    assert!(said.contains("ingest.device"), "{said}");
    // A SIGHUP sent some other way meets the same file in the service itself.
    svc.signal_once_answered(libc::SIGHUP);
    svc.wait_for("the configuration refused", || {
        svc.log().contains("the new configuration is refused")
    });
    assert!(svc.child.try_wait().unwrap().is_none(), "{}", svc.log());
    let kept: ailhd::waiting::Waiting =
        serde_json::from_slice(&std::fs::read(world.state().join("waiting.json")).unwrap())
            .unwrap();
    assert_eq!(kept.pid, svc.pid());
    ok(&reload(&world, "cpu"));
    let st = svc.wait("the recordings, on the CPU", |s| committed(s) == 5);
    assert_eq!(st["service"]["pid"].as_u64(), Some(svc.pid() as u64));
    let log = svc.terminate();
    assert!(
        log.contains("ingest.device is no longer cuda: starting"),
        "{log}"
    );
    assert_eq!(note(&world), None);
    compare_with_rebuild(&world);
}

/// The kernel's own case of [`an_output_file_system_read_only_at_start_is_waited_for`]: ext4
/// mounted `errors=remount-ro` stops writing after an error (Linux 6.x says `emergency_ro`
/// beside `rw`). `run` started then waits without holding a file on the disk, so the operator
/// can unmount it, repair it and mount it again; the service then starts by itself.
#[test]
#[serial]
fn an_ext4_disk_stopped_after_an_error_is_waited_for_and_can_be_repaired() {
    let world = World::with_paths(FAST, "disk/out", "disk/state");
    add(&world, 0..3);
    let disk = world.dir.path().join("disk");
    std::fs::create_dir_all(&disk).unwrap();
    let img = world.dir.path().join("ext4.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let mkfs = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&img)
        .status();
    assert!(
        mkfs.is_ok_and(|s| s.success()),
        "this test needs mkfs.ext4 (e2fsprogs) and loop devices"
    );
    let img_arg = img.to_str().unwrap();
    mount(&["-o", "loop,errors=remount-ro", img_arg], &disk);
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let mounted = Unmount(&disk);
    let source = Command::new("findmnt")
        .args(["-n", "-o", "SOURCE"])
        .arg(&disk)
        .output()
        .unwrap();
    let dev = String::from_utf8_lossy(&source.stdout)
        .trim()
        .replace("/dev/", "");
    std::fs::write(format!("/sys/fs/ext4/{dev}/trigger_fs_error"), "1")
        .expect("this test makes ext4 stop writing through /sys/fs/ext4/<dev>/trigger_fs_error");

    let checked = world.run(&["check-config"]);
    let said = String::from_utf8_lossy(&checked.stderr).to_string();
    assert_eq!(checked.status.code(), Some(1), "{said}");
    let mut svc = Service::spawn(&world);
    svc.wait_for("the service waiting for the disk", || {
        svc.log().contains("waiting for it")
    });
    // It holds nothing there: the disk can be unmounted, repaired and mounted again.
    drop(mounted);
    let fsck = Command::new("e2fsck")
        .arg("-fy")
        .arg(&img)
        .output()
        .unwrap();
    assert!(fsck.status.code().is_some_and(|c| c <= 1), "{fsck:?}");
    mount(&["-o", "loop", img_arg], &disk);
    let _mounted = Unmount(&disk);
    svc.wait("the recordings, once the disk is back", |s| {
        committed(s) == 3
    });
    assert!(svc.child.try_wait().unwrap().is_none());
    svc.terminate();
    compare_with_rebuild(&world);
}
