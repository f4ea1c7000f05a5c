//! `ailhd run` as systemd runs it, on a temporary tree: files arrive in every way a recorder or
//! an operator delivers them, while an h5py SWMR reader follows the outputs; then stop, change
//! the tree while stopped, restart; and SIGKILL at random instants during a stream.

use crate::common::service::*;
use crate::common::*;
use serial_test::serial;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

const FAST: &str = "[ingest]\nsettle_ms = 100\nquarantine_after_s = 2\nmax_batch_latency_ms = 10\nrescan_interval_s = 0\ndevice = \"cpu\"\n";
/// [`FAST`], but an incomplete file waits a minute before it is quarantined: what a test sees
/// within seconds is the settle stage's own decision, not the quarantine's deadline.
const PATIENT: &str = "[ingest]\nsettle_ms = 100\nquarantine_after_s = 60\nmax_batch_latency_ms = 10\nrescan_interval_s = 0\ndevice = \"cpu\"\n";

#[test]
#[serial]
fn ingests_every_kind_of_arrival_and_survives_a_restart() {
    let world = World::new(FAST);
    let rec = world.rec();
    std::fs::create_dir_all(rec.join("LEAK")).unwrap();
    let svc = Service::start(&world);
    std::fs::create_dir_all(world.out()).unwrap();
    let reader = PyReader::start(&world, "swmr_reader.py");

    // cp
    std::fs::copy(
        fixtures().join("wav/tone_pcm16.wav"),
        rec.join("LEAK/cp.wav"),
    )
    .unwrap();
    // a slow writer holding the file open, in chunks
    let slow = fixture_bytes("leak_pcm16");
    {
        let mut f = std::fs::File::create(rec.join("LEAK/slow.wav")).unwrap();
        for chunk in slow.chunks(slow.len() / 8 + 1) {
            f.write_all(chunk).unwrap();
            f.flush().unwrap();
            std::thread::sleep(Duration::from_millis(120));
        }
    }
    // temp name, then rename into place
    write_via_rename(&rec, "LEAK/renamed.wav", &fixture_bytes("chirp_pcm16"));
    // a fresh deep folder, written right after mkdir -p
    let deep = rec.join("NORMAL/site9/2025/01");
    std::fs::create_dir_all(&deep).unwrap();
    std::fs::write(
        deep.join("S009~R1~20250101000000~100.wav"),
        fixture_bytes("stereo_pcm16"),
    )
    .unwrap();
    // a duplicate of cp.wav under another label
    std::fs::copy(rec.join("LEAK/cp.wav"), rec.join("NORMAL/dup.wav")).unwrap();
    let s = svc.wait("5 files committed", |s| committed(s) == 5);
    let rows: u64 = ["training", "validation", "testing"]
        .iter()
        .map(|k| s["splits"][k]["rows"].as_u64().unwrap())
        .sum();
    assert_eq!(rows, 4, "the duplicate shares its row: {s}");

    // move between labels: same row, label updated
    std::fs::create_dir_all(rec.join("CRACK")).unwrap();
    std::fs::rename(rec.join("LEAK/renamed.wav"), rec.join("CRACK/renamed.wav")).unwrap();
    svc.wait("move relabelled", |s| {
        s["splits"]
            .as_object()
            .unwrap()
            .values()
            .any(|v| v["per_label"]["CRACK"].as_u64() == Some(1))
    });
    // new bytes at a known path; a deletion
    std::fs::write(
        deep.join("S009~R1~20250101000000~100.wav"),
        fixture_bytes("tone_pcm32"),
    )
    .unwrap();
    std::fs::remove_file(rec.join("LEAK/slow.wav")).unwrap();
    // every invalid fixture
    let cases = cases();
    let invalid: Vec<String> = cases["cases"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, c)| c["kind"] == "invalid")
        .map(|(n, _)| n.clone())
        .collect();
    for name in &invalid {
        std::fs::copy(
            fixtures().join(format!("wav/{name}.wav")),
            rec.join(format!("LEAK/bad_{name}.wav")),
        )
        .unwrap();
    }
    let s = svc.wait("invalid files quarantined", |s| {
        quarantined(s).len() == invalid.len()
    });
    let q = quarantined(&s);
    for name in &invalid {
        let reason = &q[&format!("LEAK/bad_{name}.wav")];
        assert!(!reason.is_empty(), "{name}: no reason");
    }
    assert!(
        q["LEAK/bad_truncated.wav"]
            .to_lowercase()
            .contains("truncated"),
        "{q:?}"
    );
    assert!(
        q["LEAK/bad_recording_in_progress.wav"]
            .to_lowercase()
            .contains("in progress"),
        "{q:?}"
    );
    svc.wait("overwrite and delete applied", |s| {
        let valid: u64 = ["training", "validation", "testing"]
            .iter()
            .map(|k| s["splits"][k]["valid"].as_u64().unwrap())
            .sum();
        let rows: u64 = ["training", "validation", "testing"]
            .iter()
            .map(|k| s["splits"][k]["rows"].as_u64().unwrap())
            .sum();
        committed(s) == 4 && rows == 5 && valid == 3
    });
    let log = svc.terminate();
    reader.finish();
    assert!(log.contains("quarantined"), "{log}");
    compare_with_rebuild(&world);

    // Changes while stopped: a new file, a deletion, a modification. Restart reconciles.
    std::fs::copy(
        fixtures().join("wav/tone_u8.wav"),
        rec.join("CRACK/while_down.wav"),
    )
    .unwrap();
    std::fs::remove_file(rec.join("NORMAL/dup.wav")).unwrap();
    std::fs::write(rec.join("LEAK/cp.wav"), fixture_bytes("leak_float32")).unwrap();
    let svc = Service::start(&world);
    svc.wait("reconciled", |s| {
        let valid: u64 = ["training", "validation", "testing"]
            .iter()
            .map(|k| s["splits"][k]["valid"].as_u64().unwrap())
            .sum();
        committed(s) == 4 && valid == 4
    });
    svc.terminate();
    compare_with_rebuild(&world);
}

#[test]
#[serial]
fn second_writer_and_changed_settings_are_refused() {
    let world = World::new(FAST);
    let svc = Service::start(&world);
    let o = world.run(&["rebuild"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("another ailhd"));
    let o = world.run(&["run"]);
    assert_eq!(o.status.code(), Some(1));
    // status works while the service holds the manifest
    let st = world.status_json();
    assert!(st["writer"].as_str().unwrap().contains("ailhd run"), "{st}");
    svc.terminate();
    // other feature settings: run refuses and says to rebuild, as a configuration error (exit
    // 2: systemd does not restart it)
    let text = std::fs::read_to_string(&world.config).unwrap() + "[features]\nn_mels = 32\n";
    std::fs::write(&world.config, text).unwrap();
    let o = world.run(&["run"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("rebuild"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
#[serial]
fn sigkill_at_random_instants_loses_and_duplicates_nothing() {
    let world = World::new(FAST);
    let rec = world.rec();
    let labels = ["LEAK", "NORMAL", "CRACK"];
    let total = 300usize;
    let writer_rec = rec.clone();
    let writer = std::thread::spawn(move || {
        for i in 0..total {
            let label = labels[i % 3];
            let samples = ailhd::synth::clip(label, 1000 + i as u64, 4096, 10.0);
            let bytes = ailhd::synth::wav_pcm16(&samples, 4096);
            write_via_rename(
                &writer_rec,
                &format!("{label}/{}", ailhd::synth::file_name(i, 3)),
                &bytes,
            );
            std::thread::sleep(Duration::from_millis(4));
        }
    });
    let mut rng = ailhd::synth::Rng::new(42);
    for _ in 0..6 {
        let svc = Service::start(&world);
        std::thread::sleep(Duration::from_millis(50 + rng.next_u64() % 400));
        svc.kill9();
    }
    writer.join().unwrap();
    let svc = Service::start(&world);
    svc.wait("all files committed", |s| committed(s) == total as u64);
    svc.terminate();
    compare_with_rebuild(&world);
}

/// The rules of identity while the service runs (docs/design.md, "Identity, labels, splits"), each
/// checked against a rebuild of the same tree: shared bytes are owned by the smallest path and
/// handed back when it goes; a label folder moved into another label keeps its rows with new
/// paths and labels; symbolic links are not followed; a non-UTF-8 name and complete but
/// unusable files are quarantined at once (here `quarantine_after_s` is 300 s), with the reason.
#[test]
#[serial]
fn shared_bytes_moves_links_and_unusable_files_follow_one_set_of_rules() {
    let world = World::new(
        "[ingest]\nsettle_ms = 100\nquarantine_after_s = 300\nmax_batch_latency_ms = 10\nrescan_interval_s = 0\ndevice = \"cpu\"\n",
    );
    let rec = world.rec();
    for (rel, fixture) in [
        ("NORMAL/x.wav", "leak_pcm16"),
        ("LEAK/y.wav", "tone_pcm16"),
        ("LEAK/sub/z.wav", "chirp_pcm16"),
    ] {
        write_via_rename(&rec, rel, &fixture_bytes(fixture));
    }
    let svc = Service::start(&world);
    svc.wait("3 files", |s| committed(s) == 3);
    let conflicts = |s: &serde_json::Value| s["label_conflicts"].as_array().map_or(0, |a| a.len());

    // A copy under a smaller path (LEAK/ < NORMAL/) takes the row over; it is a label conflict.
    std::fs::copy(rec.join("NORMAL/x.wav"), rec.join("LEAK/copy.wav")).unwrap();
    svc.wait("the copy", |s| committed(s) == 4 && conflicts(s) == 1);
    compare_with_rebuild(&world);
    // The copy goes: the row is handed back to NORMAL/x.wav.
    std::fs::remove_file(rec.join("LEAK/copy.wav")).unwrap();
    svc.wait("the copy gone", |s| committed(s) == 3 && conflicts(s) == 0);
    compare_with_rebuild(&world);

    // A label folder moved into another label.
    let before = svc.wait("idle", |s| s["service"]["queue_depth"] == 0)["service"]["ingested"]
        .as_u64()
        .unwrap();
    std::fs::rename(rec.join("LEAK"), rec.join("NORMAL/LEAK_old")).unwrap();
    svc.wait("the moved folder", |s| {
        s["service"]["ingested"].as_u64().unwrap() >= before + 2
            && s["service"]["queue_depth"] == 0
            && committed(s) == 3
    });
    compare_with_rebuild(&world);

    // Links (to a file outside the tree, to one inside), a non-UTF-8 name, unusable files.
    let outside = world.dir.path().join("outside.wav");
    std::fs::write(&outside, fixture_bytes("tone_pcm16")).unwrap();
    std::fs::create_dir_all(rec.join("LEAK")).unwrap();
    std::os::unix::fs::symlink(&outside, rec.join("LEAK/link_out.wav")).unwrap();
    std::os::unix::fs::symlink(rec.join("NORMAL/x.wav"), rec.join("LEAK/link_in.wav")).unwrap();
    {
        use std::os::unix::ffi::OsStrExt;
        let odd = std::ffi::OsStr::from_bytes(b"LEAK/\xff.wav");
        std::fs::write(rec.join(odd), fixture_bytes("silence_pcm16")).unwrap();
    }
    std::fs::write(rec.join("LEAK/text.wav"), fixture_bytes("not_a_wav")).unwrap();
    std::fs::write(rec.join("LEAK/alaw.wav"), fixture_bytes("alaw")).unwrap();
    std::fs::write(rec.join("LEAK/empty.wav"), b"").unwrap();
    // A named pipe: never opened (its open would wait for a writer), listed all the same.
    let fifo =
        std::os::unix::ffi::OsStringExt::into_vec(rec.join("LEAK/pipe.wav").into_os_string());
    let fifo = std::ffi::CString::new(fifo);
    assert_eq!(unsafe { libc::mkfifo(fifo.unwrap().as_ptr(), 0o644) }, 0);
    let t = Instant::now();
    let snap = svc.wait("seven quarantined", |s| quarantined(s).len() == 7);
    let waited = t.elapsed();
    let q = quarantined(&snap);
    for link in ["LEAK/link_out.wav", "LEAK/link_in.wav"] {
        assert!(q[link].contains("symbolic link"), "{link}: {}", q[link]);
    }
    assert!(q.values().any(|r| r.contains("not valid UTF-8")), "{q:?}");
    assert!(q["LEAK/text.wav"].contains("not a WAV"), "{q:?}");
    assert!(q["LEAK/alaw.wav"].contains("A-law"), "{q:?}");
    assert!(q["LEAK/empty.wav"].contains("empty"), "{q:?}");
    assert!(q["LEAK/pipe.wav"].contains("named pipe"), "{q:?}");
    assert!(
        q.values().all(|r| !r.contains("still incomplete")),
        "complete files are judged by what they are, not by time: {q:?}"
    );
    assert!(
        waited < Duration::from_secs(30),
        "took {waited:?}, not at once"
    );
    assert_eq!(committed(&snap), 3, "links add no rows");
    compare_with_rebuild(&world);
    svc.terminate();
}

/// Two names that differ only in bytes that are not UTF-8 are two quarantined files, each listed
/// (those bytes as `\xNN`) until it is deleted, before and after a restart. Their lossy names
/// were one record: `status` listed one, and deleting either file un-listed the other.
#[test]
#[serial]
fn names_that_differ_only_in_bytes_not_utf8_are_listed_apart() {
    use std::os::unix::ffi::OsStrExt;
    let world = World::new(FAST);
    let rec = world.rec();
    std::fs::create_dir_all(rec.join("LEAK")).unwrap();
    let svc = Service::start(&world);
    let name = |b: &[u8]| rec.join(std::ffi::OsStr::from_bytes(b));
    std::fs::write(name(b"LEAK/x\xff.wav"), fixture_bytes("silence_pcm16")).unwrap();
    std::fs::write(name(b"LEAK/x\xfe.wav"), fixture_bytes("tone_pcm16")).unwrap();
    let snap = svc.wait("both quarantined", |s| quarantined(s).len() == 2);
    let q = quarantined(&snap);
    for key in ["LEAK/x\\xff.wav", "LEAK/x\\xfe.wav"] {
        assert!(q[key].contains("not valid UTF-8"), "{q:?}");
    }
    std::fs::remove_file(name(b"LEAK/x\xff.wav")).unwrap();
    svc.wait("the deleted one no longer listed", |s| {
        !quarantined(s).contains_key("LEAK/x\\xff.wav")
    });
    let left = |s: &serde_json::Value| quarantined(s).into_keys().collect::<Vec<_>>();
    std::thread::sleep(Duration::from_millis(2500)); // a snapshot or more later
    assert_eq!(left(&svc.snapshot().unwrap()), ["LEAK/x\\xfe.wav"]);
    svc.terminate();
    let svc = Service::start(&world);
    std::thread::sleep(Duration::from_millis(2500));
    let snap = svc.wait("the start's comparison", |s| {
        s["service"]["queue_depth"] == 0
    });
    assert_eq!(left(&snap), ["LEAK/x\\xfe.wav"]);
    svc.terminate();
}

/// A recording with a second name (a hard link under another label) written in place through
/// one name: the event names that one only, but both names hold the new bytes, as a rebuild
/// finds. Without a look at the other name it kept the old bytes' row valid, under its label.
#[test]
#[serial]
fn a_hard_linked_recording_written_in_place_changes_under_every_name() {
    let world = World::new(PATIENT);
    let rec = world.rec();
    write_via_rename(&rec, "LEAK/a.wav", &clip_wav("LEAK", 1));
    let svc = Service::start(&world);
    svc.wait("the recording", |s| committed(s) == 1);
    std::fs::create_dir_all(rec.join("NORMAL")).unwrap();
    std::fs::hard_link(rec.join("LEAK/a.wav"), rec.join("NORMAL/b.wav")).unwrap();
    let conflicts = |s: &serde_json::Value| s["label_conflicts"].as_array().map_or(0, |a| a.len());
    svc.wait("the second name, a label conflict", |s| {
        committed(s) == 2 && conflicts(s) == 1
    });
    compare_with_rebuild(&world);

    // Written in place through the first name: the second holds the new bytes too (the label
    // conflict is theirs now).
    let new = clip_wav("LEAK", 2);
    let new_hash = ailhd::identity::hex(&ailhd::identity::content_hash(&new));
    std::fs::write(rec.join("LEAK/a.wav"), &new).unwrap();
    let snap = svc.wait("both names on the new bytes", |s| {
        s["label_conflicts"][0]["blake3"] == new_hash.as_str() && s["service"]["queue_depth"] == 0
    });
    assert_eq!((committed(&snap), conflicts(&snap)), (2, 1), "{snap}");
    compare_with_rebuild(&world);
    svc.terminate();
}

/// New bytes written while the service was stopped, with the file's size and mtime as they were
/// (`cp -p`, `touch -r`: every clip of the same length has the same size), are found at the
/// next start by the inode's change time, which no one can set back, and supersede the old row
/// as a rebuild's would. A change of attributes alone (a chmod) is looked at once and found
/// unchanged.
#[test]
#[serial]
fn bytes_changed_with_the_mtime_put_back_while_stopped_are_found_at_the_start() {
    let world = World::new(PATIENT);
    let rec = world.rec();
    write_via_rename(&rec, "LEAK/a.wav", &clip_wav("LEAK", 11));
    write_via_rename(&rec, "NORMAL/b.wav", &clip_wav("NORMAL", 12));
    let svc = Service::start(&world);
    svc.wait("the recordings", |s| committed(s) == 2);
    svc.terminate();

    let path = rec.join("LEAK/a.wav");
    let (size, mtime) = {
        let m = std::fs::metadata(&path).unwrap();
        (m.len(), m.modified().unwrap())
    };
    std::thread::sleep(Duration::from_millis(20));
    let new = clip_wav("LEAK", 13);
    assert_eq!(new.len() as u64, size);
    std::fs::write(&path, &new).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        rec.join("NORMAL/b.wav"),
        std::fs::Permissions::from_mode(0o640),
    )
    .unwrap();
    let ingested = |s: &serde_json::Value| s["service"]["ingested"].as_u64().unwrap_or(0);
    let svc = Service::start(&world);
    let snap = svc.wait("the new bytes at the start", |s| {
        ingested(s) >= 1 && s["service"]["queue_depth"] == 0
    });
    assert_eq!(committed(&snap), 2, "{snap}");
    svc.terminate();
    compare_with_rebuild(&world);
}

/// Every row of the outputs, read plainly (the service stopped): per split, (blake3 hex,
/// source_path, label, valid).
fn all_rows(world: &World) -> Vec<Vec<(String, String, i64, i64)>> {
    let script = r#"
import json, os, sys
import h5py
out = sys.argv[1]
res = []
for n in ["TRAINING_DATASET.H5", "VALIDATION_DATASET.H5", "TESTING_DATASET.H5"]:
    with h5py.File(os.path.join(out, n), "r") as f:
        c = int(f["committed_rows"][0])
        res.append([[bytes(f["blake3"][i]).hex(), f["source_path"][i].decode(), int(f["labels"][i]), int(f["valid"][i])] for i in range(c)])
print(json.dumps(res))
"#;
    let o = std::process::Command::new("python3")
        .args(["-c", script, world.out().to_str().unwrap()])
        .output()
        .unwrap();
    serde_json::from_slice(&ok(&o).into_bytes()).unwrap()
}

/// The state folder removed while the service runs (an operator's clean-up gone wrong): the
/// service does not go on writing a manifest nobody can open, nor retry that same handle
/// forever; it restarts its process in place (same PID), rebuilds the manifest from the
/// outputs as a start does, and takes the recordings that arrive.
#[test]
#[serial]
fn a_state_folder_removed_under_the_running_service_is_rebuilt_from_the_outputs() {
    let world = World::new(FAST);
    let rec = world.rec();
    let mut svc = Service::start(&world);
    for (i, label) in ["LEAK", "NORMAL"].iter().enumerate() {
        write_via_rename(
            &rec,
            &format!("{label}/S00{i}~R{i}~20250118120530~100.wav"),
            &clip_wav(label, 910 + i as u64),
        );
    }
    svc.wait("two recordings committed", |s| committed(s) == 2);
    let before = committed_rows(&world);
    let pid = svc.pid();
    std::fs::remove_dir_all(world.state()).unwrap();
    write_via_rename(
        &rec,
        "LEAK/S009~R9~20250118120530~100.wav",
        &clip_wav("LEAK", 919),
    );
    svc.wait("the third recording committed after the restart", |s| {
        committed(s) == 3
    });
    assert!(
        svc.child.try_wait().unwrap().is_none(),
        "the service exited; log:\n{}",
        svc.log()
    );
    assert_eq!(svc.pid(), pid);
    let log = svc.log();
    assert!(
        log.contains("was removed or replaced while the service ran")
            && log.contains("rebuilt it from the"),
        "{log}"
    );
    let after = committed_rows(&world);
    assert_eq!(after.iter().sum::<u64>(), 3, "{after:?}");
    assert!(
        before.iter().zip(&after).all(|(b, a)| a >= b),
        "rows went away: {before:?} -> {after:?}"
    );
    svc.terminate();
    compare_with_rebuild(&world);
}

/// A SIGTERM that arrives as the service is about to restart its process (here after its
/// state folder was removed; after a failed HDF5 write the same way) stops it: the fresh image
/// did not know of the stop and went on running (an audit saw it once in six tries, at a
/// random instant; a fail point holds the instant open here).
#[test]
#[serial]
fn a_stop_asked_while_the_process_restarts_is_obeyed() {
    let log = stop_while_restarting("reexec");
    assert!(
        log.contains("not restarting the process: stopping"),
        "{log}"
    );
}

/// The same SIGTERM a moment later, after the service's last look at whether a stop was asked
/// and before its `execve` (a fail point holds that instant open): it is kept pending across
/// the exec, and the fresh image stops once its handlers are in place. Before, that image did
/// not know of the stop and went on running.
#[test]
#[serial]
fn a_stop_asked_as_the_process_is_replaced_reaches_the_new_image() {
    let log = stop_while_restarting("reexec-exec");
    assert!(
        !log.contains("not restarting the process: stopping"),
        "the stop was seen before the exec, not after: {log}"
    );
    assert!(log.contains("SIGTERM: draining and stopping"), "{log}");
}

/// Start a service whose restart in place waits 3 s at `fail_point`, remove its state folder
/// (which makes it restart), send SIGTERM 0.5 s into the wait; it must exit 0. Its log.
fn stop_while_restarting(fail_point: &str) -> String {
    let world = World::new(FAST);
    let rec = world.rec();
    let mut svc = Service::start_failing(&world, &format!("{fail_point}=sleep(3000)"));
    write_via_rename(
        &rec,
        "LEAK/S001~R1~20250118120530~100.wav",
        &clip_wav("LEAK", 931),
    );
    svc.wait("one recording committed", |s| committed(s) == 1);
    std::fs::remove_dir_all(world.state()).unwrap();
    svc.wait_for("the restart to begin", || {
        svc.log().contains("restarting the service's process")
    });
    std::thread::sleep(Duration::from_millis(500)); // into the fail point's sleep
    svc.sigterm();
    let status = exit_within(&mut svc.child, Duration::from_secs(30)).unwrap_or_else(|| {
        let _ = svc.child.kill();
        panic!("the service went on after SIGTERM; log:\n{}", svc.log())
    });
    let log = svc.log();
    assert!(status.success(), "{status:?}; log:\n{log}");
    log
}

#[test]
#[serial]
fn a_lost_state_is_rebuilt_from_the_outputs_and_no_row_moves() {
    let world = World::new(FAST);
    let rec = world.rec();
    let clip = |label: &str, i: u64| clip_wav(label, 500 + i);
    let names: Vec<String> = (0..8).map(|i| alternating(i, 1).1).collect();
    for i in 0..8 {
        let (label, rel) = alternating(i, 1);
        write_via_rename(&rec, &rel, &clip(label, i as u64));
    }
    // The same bytes under a second, larger path (it owns nothing), and a file that is no WAV.
    write_via_rename(&rec, "NORMAL/zz_copy.wav", &clip("LEAK", 0));
    write_via_rename(&rec, "LEAK/broken.wav", b"not a wav at all");
    let svc = Service::start(&world);
    svc.wait("9 files committed", |s| {
        committed(s) == 9 && quarantined(s).len() == 1
    });
    // New bytes at a known path (its old row becomes invalid) and a deleted file.
    write_via_rename(&rec, &names[1], &clip("NORMAL", 99));
    let deleted = std::fs::read(rec.join(&names[2])).unwrap();
    std::fs::remove_file(rec.join(&names[2])).unwrap();
    svc.wait("supersede and delete", |s| {
        let valid: u64 = ["training", "validation", "testing"]
            .iter()
            .map(|k| s["splits"][k]["valid"].as_u64().unwrap())
            .sum();
        committed(s) == 8 && valid == 7
    });
    svc.terminate();
    let before = all_rows(&world);
    assert_eq!(before.iter().map(Vec::len).sum::<usize>(), 9, "{before:?}");

    // A trainer keeps reading by row number while the state folder is lost and the service
    // starts again.
    let reader = PyReader::start_opened(&world, "rows_keep.py");
    std::fs::remove_dir_all(world.state()).unwrap();
    let svc = Service::start(&world);
    let snap = svc.wait("the tree checked against the recovered manifest", |s| {
        committed(s) == 8 && quarantined(s).len() == 1 && s["service"]["queue_depth"] == 0
    });
    let log = svc.log();
    assert!(
        log.contains("was missing: rebuilt it from the HDF5 files") && log.contains("9 rows"),
        "{log}"
    );
    assert!(quarantined(&snap).contains_key("LEAK/broken.wav"), "{snap}");
    let rows: u64 = ["training", "validation", "testing"]
        .iter()
        .map(|k| snap["splits"][k]["rows"].as_u64().unwrap())
        .sum();
    assert_eq!(
        rows, 9,
        "no row added: nothing was featurised again\n{snap}"
    );

    // The recovered manifest works as the lost one did: a deleted file's bytes coming back
    // revive its row, new bytes get a new row at the end, the copy still shares its row.
    write_via_rename(&rec, &names[2], &deleted);
    write_via_rename(&rec, "CRACK/new.wav", &clip("CRACK", 7));
    std::fs::remove_file(rec.join(&names[0])).unwrap();
    svc.wait("revived, new, handed over", |s| {
        let valid: u64 = ["training", "validation", "testing"]
            .iter()
            .map(|k| s["splits"][k]["valid"].as_u64().unwrap())
            .sum();
        committed(s) == 9 && valid == 9
    });
    reader.finish();
    svc.terminate();

    let after = all_rows(&world);
    for (split, (b, a)) in before.iter().zip(&after).enumerate() {
        assert!(a.len() >= b.len(), "split {split}: {a:?}");
        for (i, (rb, ra)) in b.iter().zip(a).enumerate() {
            assert_eq!(rb.0, ra.0, "split {split} row {i} holds other bytes");
        }
    }
    assert_eq!(after.iter().map(Vec::len).sum::<usize>(), 10, "{after:?}");
    // The deleted file's row is valid again, in place; the copy took over the first file's row.
    let row_of = |path: &str| {
        after
            .iter()
            .flatten()
            .find(|r| r.1 == path && r.3 == 1)
            .cloned()
    };
    assert!(row_of(&names[2]).is_some(), "{after:?}");
    assert!(row_of("NORMAL/zz_copy.wav").is_some(), "{after:?}");
    compare_with_rebuild(&world);
}

/// The window between the manifest and the publish of a batch (src/engine/commit.rs): the
/// manifest has recorded it, its rows are durable in the outputs, `committed_rows` has not
/// moved yet, and the service is killed. The next start publishes those rows: committed_rows
/// never falls, no seen row changes, nothing is featurised twice, and the outputs equal a
/// rebuild's.
#[test]
#[serial]
fn rows_recorded_before_a_kill_in_the_publish_window_are_published_not_cut() {
    let world = World::new(FAST);
    let rec = world.rec();
    let clip = |label: &str, i: u64| clip_wav(label, 700 + i);
    let names: Vec<String> = (0..6).map(|i| alternating(i, 2).1).collect();
    for i in 0..6 {
        let (label, rel) = alternating(i, 2);
        write_via_rename(&rec, &rel, &clip(label, i as u64));
    }
    // The same bytes as names[0] under a larger path (it owns nothing yet).
    write_via_rename(&rec, "NORMAL/zz_copy.wav", &clip("LEAK", 0));
    let svc = Service::start(&world);
    svc.wait("7 files committed", |s| committed(s) == 7);
    svc.terminate();
    let before = all_rows(&world);
    assert_eq!(before.iter().map(Vec::len).sum::<usize>(), 6, "{before:?}");

    // While stopped: new bytes at the owner of shared bytes (the copy takes its row over, with
    // its own label), new bytes at another path (its old row turns invalid), a new file. The
    // start-up rescan hands all three on at once.
    write_via_rename(&rec, &names[0], &clip("LEAK", 50));
    write_via_rename(&rec, &names[1], &clip("NORMAL", 51));
    write_via_rename(&rec, "CRACK/new.wav", &clip("CRACK", 52));
    let reader = PyReader::start_opened(&world, "rows_keep.py");
    // Test builds have a fail point there (Cargo.toml, feature `failpoints`): the first batch
    // that appends rows sleeps between the manifest's flush and the outputs' publish.
    let svc = Service::start_failing(&world, "commit-before-publish=1*sleep(120000)");
    svc.wait_for("the batch's rows on disk, beyond committed_rows", || {
        hdf5_extents(&world).iter().sum::<u64>() > 6
    });
    // The manifest records the batch in a moment (the log of the next start says whether the
    // kill came after it: "publishing rows"); the reader has had time to look.
    std::thread::sleep(Duration::from_millis(1000));
    let seen = committed_rows(&world);
    assert_eq!(
        seen.iter().sum::<u64>(),
        6,
        "committed_rows moved before the publish: {seen:?}"
    );
    svc.kill9();

    let svc = Service::start(&world);
    let snap = svc.wait("the tree checked against the published rows", |s| {
        let valid: u64 = ["training", "validation", "testing"]
            .iter()
            .map(|k| s["splits"][k]["valid"].as_u64().unwrap())
            .sum();
        committed(s) == 8 && valid == 8 && s["service"]["queue_depth"] == 0
    });
    let log = svc.log();
    assert!(
        log.contains("publishing rows") && log.contains("recorded in the manifest"),
        "{log}"
    );
    assert!(!log.contains("never recorded in the manifest"), "{log}");
    let rows: u64 = ["training", "validation", "testing"]
        .iter()
        .map(|k| snap["splits"][k]["rows"].as_u64().unwrap())
        .sum();
    assert_eq!(rows, 9, "3 new rows, none featurised twice: {snap}");
    let now = committed_rows(&world);
    for (split, (s, n)) in seen.iter().zip(&now).enumerate() {
        assert!(n >= s, "split {split}: {seen:?} -> {now:?}");
    }
    let out = reader.finish();
    println!("{out}");
    svc.terminate();
    let after = all_rows(&world);
    for (split, (b, a)) in before.iter().zip(&after).enumerate() {
        for (i, (rb, ra)) in b.iter().zip(a).enumerate() {
            assert_eq!(rb.0, ra.0, "split {split} row {i} holds other bytes");
        }
    }
    compare_with_rebuild(&world);
}

/// The window between the outputs' prepare and the manifest (src/engine/commit.rs): a batch's
/// rows are on disk, nothing records them, and `committed_rows` has not moved. Killed there, the
/// service never showed them to a reader; the next start cuts them and ingests the file again.
#[test]
#[serial]
fn rows_prepared_before_a_kill_in_the_manifest_window_were_never_visible() {
    let world = World::new(FAST);
    let rec = world.rec();
    for i in 0..4usize {
        let (label, rel) = alternating(i, 2);
        write_via_rename(&rec, &rel, &clip_wav(label, 800 + i as u64));
    }
    let svc = Service::start(&world);
    svc.wait("4 files committed", |s| committed(s) == 4);
    svc.terminate();
    let reader = PyReader::start_opened(&world, "rows_keep.py");
    // The first batch that appends rows sleeps between the outputs' prepare and the manifest.
    let svc = Service::start_failing(&world, "commit-before-manifest=1*sleep(120000)");
    write_via_rename(&rec, "CRACK/late.wav", &clip_wav("CRACK", 810));
    svc.wait_for(
        "the late file's rows on disk, beyond committed_rows",
        || hdf5_extents(&world).iter().sum::<u64>() > 4,
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(committed_rows(&world).iter().sum::<u64>(), 4);
    svc.kill9();

    let svc = Service::start(&world);
    svc.wait("the late file ingested again", |s| {
        committed(s) == 5 && s["service"]["queue_depth"] == 0
    });
    assert!(svc.log().contains("reclaiming"), "{}", svc.log());
    println!("{}", reader.finish());
    svc.terminate();
    compare_with_rebuild(&world);
}

/// A batch that took long is described in the log, stage by stage: here the manifest's step,
/// which a fail point holds for 700 ms, gets the time, and the others do not.
#[test]
#[serial]
fn a_slow_batch_is_logged_with_the_stage_that_took_the_time() {
    let world = World::new(FAST);
    let svc = Service::start_failing(&world, "commit-before-manifest=1*sleep(700)");
    write_via_rename(&world.rec(), "LEAK/slow.wav", &clip_wav("LEAK", 900));
    svc.wait("the file committed", |s| committed(s) == 1);
    let log = svc.log();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("slow batch:")).collect();
    assert_eq!(lines.len(), 1, "one batch was slow: {log}");
    println!("{}", lines[0]);
    let stage_ms = |stage: &str| -> f64 {
        let at = lines[0].find(&format!("{stage} ")).unwrap_or_else(|| {
            panic!("`{stage}` missing: {}", lines[0]);
        });
        let rest = &lines[0][at + stage.len() + 1..];
        rest[..rest.find(" ms").unwrap()].parse().unwrap()
    };
    assert!(stage_ms("the manifest") >= 700.0, "{}", lines[0]);
    for other in ["loading and deciding", "featurising", "publishing"] {
        assert!(stage_ms(other) < 500.0, "{other}: {}", lines[0]);
    }
    svc.terminate();
}

/// The comparison of the tree with the manifest at start-up runs beside the ingest: a recording
/// that arrives while it runs is committed at once, and what the comparison finds follows.
#[test]
#[serial]
fn a_recording_arriving_during_the_start_up_rescan_is_ingested_at_once() {
    let world = World::new(FAST);
    let rec = world.rec();
    // In the tree before the start: only the start-up rescan finds it.
    write_via_rename(
        &rec,
        "LEAK/S001~R1~20250118120530~100.wav",
        &clip_wav("LEAK", 900),
    );
    // The rescan sleeps 8 s once it starts (a fail point of test builds).
    let svc = Service::start_failing(&world, "reconcile-listed=1*sleep(8000)");
    write_via_rename(
        &rec,
        "NORMAL/S002~R2~20250118120530~100.wav",
        &clip_wav("NORMAL", 901),
    );
    let snap = svc.wait("the new recording committed", |s| committed(s) >= 1);
    assert_eq!(
        committed(&snap),
        1,
        "the new recording waited for the rescan: {snap}"
    );
    svc.wait("the rescan's recording committed too", |s| {
        committed(s) == 2
    });
    svc.terminate();
    compare_with_rebuild(&world);
}

/// While the start-up comparison runs, `status` says so (`service.comparing`) and keeps saying
/// so until all it found is in the queue, so that a script (or an operator) that waits for
/// `comparing` to be null and the queue to be empty finds every recording of the tree
/// committed. Before, the snapshot of a restarted service showed an empty queue while its
/// comparison had yet to hand on the recordings that arrived while it was down, and again while
/// the engine held them (the queue counted files only until they were handed to the engine), and
/// a script that stopped it then left them for the next start.
#[test]
#[serial]
fn status_reports_the_comparison_until_what_it_found_is_queued() {
    let world = World::new(FAST);
    let rec = world.rec();
    // In the tree before the start: only the start-up comparison finds them.
    for k in 0..3 {
        write_via_rename(
            &rec,
            &format!("LEAK/S001~R{k}~20250118120530~100.wav"),
            &clip_wav("LEAK", 910 + k as u64),
        );
    }
    // The comparison sleeps 3 s once it has listed the tree, and the commit of what it found
    // 3 s before its manifest records go in, long enough for a snapshot meanwhile (fail points
    // of test builds).
    let svc = Service::start_failing(
        &world,
        "reconcile-listed=1*sleep(3000);commit-before-manifest=1*sleep(3000)",
    );
    let during = svc.wait("the comparison reported", |s| {
        !s["service"]["comparing"].is_null()
    });
    assert_eq!(during["service"]["comparing"]["why"], "start", "{during}");
    assert!(
        during["service"]["comparing"]["since_ms"]
            .as_i64()
            .unwrap_or(0)
            > 0,
        "{during}"
    );
    let text = String::from_utf8_lossy(&world.run(&["status"]).stdout).into_owned();
    assert!(
        text.contains("comparing the tree with the manifest (start)"),
        "{text}"
    );
    // Every snapshot from here on: one that looks caught up holds all three.
    svc.wait("a snapshot that looks caught up", |s| {
        let service = &s["service"];
        let caught_up = service["comparing"].is_null()
            && service["queue_depth"].as_u64() == Some(0)
            && service["pending"].as_array().is_some_and(|p| p.is_empty());
        if caught_up {
            assert_eq!(committed(s), 3, "caught up, and yet: {s}");
        }
        caught_up
    });
    let text = String::from_utf8_lossy(&world.run(&["status"]).stdout).into_owned();
    assert!(!text.contains("comparing the tree"), "{text}");
    svc.terminate();
}

/// `status` lists a recording still being written as pending, with why and since when, and no
/// longer once it is committed, also when nothing happens afterwards (the list, taken from the
/// settle stage at most every 500 ms, was once left as it was before the file's close: a
/// committed recording stayed "pending" until the next event).
#[test]
#[serial]
fn status_lists_a_recording_being_written_until_it_is_committed() {
    let world = World::new(
        "[ingest]\nsettle_ms = 100\nquarantine_after_s = 60\nidle_close_s = 0\nrescan_interval_s = 0\ndevice = \"cpu\"\n",
    );
    let svc = Service::start(&world);
    let rel = "LEAK/S001~R1~20250118120530~100.wav";
    let bytes = clip_wav("LEAK", 902);
    let dst = world.rec().join(rel);
    std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
    let mut f = std::fs::File::create(&dst).unwrap();
    let half = bytes.len() / 2;
    f.write_all(&bytes[..half]).unwrap();
    f.flush().unwrap();
    let before_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let listed = svc.wait("the half-written recording listed as pending", |s| {
        s["service"]["pending"]
            .as_array()
            .is_some_and(|p| !p.is_empty())
    });
    let pending = &listed["service"]["pending"][0];
    assert_eq!(pending["path"], rel, "{listed}");
    assert!(
        pending["why"].as_str().unwrap_or("").contains("written"),
        "{listed}"
    );
    let since = pending["since_ms"].as_i64().unwrap();
    assert!(
        (before_ms - 5_000..=before_ms + 1_000).contains(&since),
        "{listed}"
    );
    assert_eq!(committed(&listed), 0, "{listed}");
    // Wait past the listing's period, so that the close's event is the last to take the list.
    std::thread::sleep(Duration::from_millis(700));
    f.write_all(&bytes[half..]).unwrap();
    drop(f);
    svc.wait("the recording committed", |s| committed(s) == 1);
    // Nothing else happens (the files stay open: no idle close comes to write a snapshot),
    // and the snapshot comes to say that nothing is pending.
    svc.wait("the committed recording no longer listed as pending", |s| {
        s["service"]["pending"]
            .as_array()
            .is_some_and(|p| p.is_empty())
    });
    let st = world.status_json();
    assert_eq!(st["service"]["pending"], serde_json::json!([]), "{st}");
    svc.terminate();
}

/// A recorder that writes a consistent header and the file's whole length first, then fills in
/// its samples a block at a time with pauses longer than the settle window, keeps the file open
/// until the last block: between its writes the file looks complete (its size stable, its
/// header consistent). Nothing of it is ingested before its close; after it, exactly one row.
/// Two such recorders: one in a label folder that was there before (its every event is seen),
/// one in a folder made a moment before the file (the folder's walk finds the file, with no
/// event to say a writer holds it: the kernel says so).
#[test]
#[serial]
fn a_recording_held_open_by_its_writer_is_ingested_once_it_is_closed() {
    use std::io::{Seek, SeekFrom};
    let world = World::new(PATIENT);
    let rels = [
        "LEAK/S001~R7~20250118120530~100.wav",
        "NORMAL/S002~R7~20250118120530~100.wav",
    ];
    std::fs::create_dir_all(world.rec().join("LEAK")).unwrap();
    let svc = Service::start(&world);
    std::fs::create_dir_all(world.rec().join("NORMAL")).unwrap();
    const HEADER: usize = 44;
    let mut writers: Vec<_> = rels
        .iter()
        .enumerate()
        .map(|(i, rel)| {
            let bytes = clip_wav(rel.split('/').next().unwrap(), 907 + i as u64);
            let mut f = std::fs::File::create(world.rec().join(rel)).unwrap();
            f.write_all(&bytes[..HEADER]).unwrap();
            f.write_all(&vec![0u8; bytes.len() - HEADER]).unwrap();
            f.flush().unwrap();
            (f, bytes)
        })
        .collect();
    let blocks = 4;
    for k in 0..blocks {
        // Three settle windows of quiet: the unchanged-size rule took the files after two.
        std::thread::sleep(Duration::from_millis(350));
        let snap = svc.snapshot().unwrap_or_default();
        assert_eq!(committed(&snap), 0, "ingested while held open: {snap}");
        for p in snap["service"]["pending"]
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            assert!(
                p["why"]
                    .as_str()
                    .unwrap_or("")
                    .contains("waiting for its writer to close it"),
                "{snap}"
            );
        }
        for (f, bytes) in &mut writers {
            let block = (bytes.len() - HEADER).div_ceil(blocks);
            let start = HEADER + k * block;
            let end = (start + block).min(bytes.len());
            f.seek(SeekFrom::Start(start as u64)).unwrap();
            f.write_all(&bytes[start..end]).unwrap();
            f.flush().unwrap();
        }
    }
    std::thread::sleep(Duration::from_millis(350));
    assert_eq!(
        committed_rows(&world).iter().sum::<u64>(),
        0,
        "a row was made of a file while its writer held it open; log:\n{}",
        svc.log()
    );
    drop(writers);
    svc.wait("the closed recordings committed", |s| committed(s) == 2);
    assert_eq!(
        committed_rows(&world).iter().sum::<u64>(),
        2,
        "exactly one row each, of the whole recording"
    );
    svc.terminate();
}

/// A file closed after writing whose header says it is truncated is as complete as its writer
/// made it: quarantined at once (within a second or two), with the decoder's reason, as
/// `rebuild` quarantines it; not left pending for `quarantine_after_s`.
#[test]
#[serial]
fn a_closed_truncated_recording_is_quarantined_at_once() {
    let world = World::new(PATIENT);
    let svc = Service::start(&world);
    let rel = "LEAK/S001~R8~20250118120530~100.wav";
    let bytes = clip_wav("LEAK", 908);
    let dst = world.rec().join(rel);
    std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
    std::fs::write(&dst, &bytes[..30_000]).unwrap();
    let t = Instant::now();
    svc.wait_for_within(
        "the truncated recording quarantined",
        Duration::from_secs(10),
        || {
            svc.snapshot()
                .is_some_and(|s| quarantined(&s).contains_key(rel))
        },
    );
    let snap = svc.snapshot().unwrap();
    let reason = &quarantined(&snap)[rel];
    assert!(reason.contains("truncated"), "{reason}");
    assert!(t.elapsed() < Duration::from_secs(10));
    assert_eq!(committed(&snap), 0, "{snap}");
    svc.terminate();
}

/// A recording quarantined because its label folder is not in `labels.names` is taken up at the
/// next start once the configuration allows it, as its reason advises: no rebuild is needed.
#[test]
#[serial]
fn a_recording_quarantined_for_its_label_is_taken_once_a_restart_allows_it() {
    let world = World::new(FAST);
    let rel = "ODDLABEL/S001~R9~20250118120530~100.wav";
    write_via_rename(&world.rec(), rel, &clip_wav("LEAK", 909));
    let svc = Service::start(&world);
    svc.wait("the recording quarantined for its label", |s| {
        quarantined(s)
            .get(rel)
            .is_some_and(|r| r.contains("labels.names"))
    });
    svc.terminate();
    // The operator follows the advice, and restarts the service.
    let text = std::fs::read_to_string(&world.config)
        .unwrap()
        .replace("[ingest]", "[labels]\nunknown = \"append\"\n[ingest]");
    std::fs::write(&world.config, text).unwrap();
    let svc = Service::start(&world);
    let s = svc.wait("the recording committed under its appended label", |s| {
        committed(s) == 1 && quarantined(s).is_empty()
    });
    assert_eq!(committed_rows(&world).iter().sum::<u64>(), 1, "{s}");
    svc.terminate();
}

/// Idle for `idle_close_s` while a rescan runs, the service does not wait for the rescan to
/// close its files: a recording that arrives meanwhile is committed at once.
#[test]
#[serial]
fn the_idle_close_does_not_hold_recordings_behind_a_running_rescan() {
    let world = World::new(&format!("{FAST}idle_close_s = 1\n"));
    let rec = world.rec();
    // In the tree before the start: only the start-up rescan finds it, once its sleep ends.
    write_via_rename(
        &rec,
        "LEAK/S001~R1~20250118120530~100.wav",
        &clip_wav("LEAK", 910),
    );
    let svc = Service::start_failing(&world, "reconcile-listed=1*sleep(10000)");
    // Idle past idle_close_s while the rescan sleeps.
    std::thread::sleep(std::time::Duration::from_millis(2500));
    write_via_rename(
        &rec,
        "NORMAL/S002~R2~20250118120530~100.wav",
        &clip_wav("NORMAL", 911),
    );
    svc.wait("the new recording committed", |s| committed(s) >= 1);
    // Had the new recording waited for the rescan, the rescan's own would follow at once.
    std::thread::sleep(std::time::Duration::from_millis(1000));
    let snap = svc.snapshot().expect("a status snapshot");
    assert_eq!(
        committed(&snap),
        1,
        "the new recording was committed only once the rescan ended: {snap}"
    );
    svc.wait("the rescan's recording committed too", |s| {
        committed(s) == 2
    });
    let log = svc.terminate();
    assert!(
        log.contains("outputs closed"),
        "the idle close still happens: {log}"
    );
    compare_with_rebuild(&world);
}

/// A stop does not wait for a long comparison of the tree with the manifest: it is called off
/// (the next start compares again), and the service exits cleanly at once.
#[test]
#[serial]
fn a_stop_calls_off_a_running_rescan() {
    let world = World::new(FAST);
    write_via_rename(
        &world.rec(),
        "LEAK/S001~R1~20250118120530~100.wav",
        &clip_wav("LEAK", 920),
    );
    // The start's comparison takes 60 s, as one of a very large tree could.
    let svc = Service::start_failing(&world, "reconcile-hold=1*return(60000)");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let t = std::time::Instant::now();
    let log = svc.terminate();
    let took = t.elapsed();
    assert!(
        took < std::time::Duration::from_secs(20),
        "the stop waited {took:?} for the rescan; log:\n{log}"
    );
    assert!(log.contains("rescan called off"), "{log}");
    // What it did not look at, the next start finds.
    let svc = Service::start(&world);
    svc.wait("the recording committed", |s| committed(s) == 1);
    svc.terminate();
    compare_with_rebuild(&world);
}

/// `systemctl reload` and `stop` while `ailhd run` is still loading its configuration (held
/// there 300 ms by a fail point) do not kill it, the default action of both: the process holds
/// them from the line after parsing its command line. The stop drains (the reload before it may
/// be passed over), the exit is 0, and nothing is lost.
#[test]
#[serial]
fn signals_while_the_service_starts_are_answered_not_fatal() {
    let world = World::new(FAST);
    write_via_rename(
        &world.rec(),
        "LEAK/S001~R1~20250118120530~100.wav",
        &clip_wav("LEAK", 921),
    );
    for (round, stop) in [libc::SIGTERM, libc::SIGINT, libc::SIGTERM]
        .into_iter()
        .enumerate()
    {
        let mut svc = Service::spawn_failing(&world, "run-configure=sleep(300)");
        svc.signal_once_held(libc::SIGHUP);
        svc.signal_once_held(stop);
        let status = svc.child.wait().unwrap();
        let log = svc.log();
        assert!(
            status.success(),
            "round {round}: signal {stop} at the start: {status:?}; log:\n{log}"
        );
        assert!(
            log.contains("draining and stopping"),
            "round {round}: {log}"
        );
    }
    let svc = Service::start(&world);
    svc.wait("the recording committed", |s| committed(s) == 1);
    svc.terminate();
    compare_with_rebuild(&world);
}

#[test]
#[serial]
fn an_unreadable_manifest_is_set_aside_and_rebuilt_from_the_outputs() {
    let world = World::new(FAST);
    for i in 0..4usize {
        let (label, rel) = alternating(i, 2);
        write_via_rename(&world.rec(), &rel, &clip_wav(label, 700 + i as u64));
    }
    let svc = Service::start(&world);
    svc.wait("4 files committed", |s| committed(s) == 4);
    svc.terminate();
    let before = all_rows(&world);
    // Damage every file of the sled database.
    for entry in walk(&world.state().join("manifest")) {
        let len = std::fs::metadata(&entry).unwrap().len() as usize;
        std::fs::write(&entry, vec![0xA5u8; len.max(64)]).unwrap();
    }
    let svc = Service::start(&world);
    svc.wait("the tree checked", |s| {
        committed(s) == 4 && s["service"]["queue_depth"] == 0
    });
    let log = svc.terminate();
    assert!(log.contains("moved it aside"), "{log}");
    assert!(log.contains("rebuilt it from the HDF5 files"), "{log}");
    let aside = std::fs::read_dir(world.state())
        .unwrap()
        .filter_map(|e| e.ok())
        .any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("manifest.unreadable-")
        });
    assert!(aside, "the damaged manifest is kept for inspection");
    assert_eq!(all_rows(&world), before);
}

/// Every kind of change at random, in one stream, while the service is killed (SIGKILL) and
/// stopped (SIGTERM, exit 0) at random and started again at once, rescans the tree every 2 s and
/// closes its files after 1 s idle: new recordings (renamed in, or written in two parts),
/// copies of recordings (shared bytes), moves between labels, deletions, contents rewritten in
/// place, files that are not recordings, folders of recordings moved in; `status` asked and the
/// configuration reloaded (a changed setting) on the way. Two SWMR readers follow
/// the outputs throughout: no row they saw may move or vanish, and no committed row may be
/// incomplete. At the end every file in the tree is accounted for (a row or quarantined) and
/// the outputs equal a rebuild's, row by row.
#[test]
#[serial]
fn random_changes_with_kills_and_restarts_end_equal_to_a_rebuild() {
    random_changes("", &[""], 7);
}

/// [`random_changes_with_kills_and_restarts_end_equal_to_a_rebuild`] with the splits taken from
/// the tree's top folders (`splits.mode = "directory"`): moves between those folders move
/// recordings between splits.
#[test]
#[serial]
fn random_changes_with_directory_splits_end_equal_to_a_rebuild() {
    random_changes(
        "[splits]\nmode = \"directory\"\ndirectories = { train = \"training\", val = \"validation\", test = \"testing\" }\n",
        &["train/", "val/", "test/"],
        11,
    );
}

/// The stream of [`random_changes_with_kills_and_restarts_end_equal_to_a_rebuild`]: `splits`
/// is the configuration's `[splits]` table (or nothing), `tops` the folders above the label
/// folders (each empty or ending with `/`).
fn random_changes(splits: &str, tops: &[&str], seed: u64) {
    const LABELS: [&str; 3] = ["LEAK", "NORMAL", "CRACK"];
    let config = format!("[ingest]\nsettle_ms = 100\nquarantine_after_s = 2\nmax_batch_latency_ms = 10\nrescan_interval_s = 2\nidle_close_s = 1\ndevice = \"cpu\"\n{splits}");
    let world = World::new(&config);
    let rec = world.rec();
    let label_at = usize::from(!tops[0].is_empty());
    let mut rng = ailhd::synth::Rng::new(seed);
    // A label folder, under one of the top folders.
    let folder = |rng: &mut ailhd::synth::Rng| {
        let top = tops[rng.next_u64() as usize % tops.len()];
        let label = LABELS[rng.next_u64() as usize % LABELS.len()];
        (label, format!("{top}{label}"))
    };
    let mut serial = 0usize;
    let mut new_path = |rng: &mut ailhd::synth::Rng| {
        serial += 1;
        let (label, dir) = folder(rng);
        (
            label,
            format!("{dir}/{}", ailhd::synth::file_name(serial, 5)),
        )
    };
    for _ in 0..40 {
        let (label, rel) = new_path(&mut rng);
        write_via_rename(&rec, &rel, &clip_wav(label, rng.next_u64()));
    }
    let mut svc = Service::start(&world);
    let readers = [
        PyReader::start_opened(&world, "rows_keep.py"),
        PyReader::start(&world, "swmr_reader.py"),
    ];
    let recordings = |rec: &Path| -> Vec<String> {
        let mut v: Vec<String> = walk(rec)
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "wav"))
            .map(|p| p.strip_prefix(rec).unwrap().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let mut done = BTreeMap::<&str, usize>::new();
    let mut folders = 0;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(12) {
        let files = recordings(&rec);
        let pick = |rng: &mut ailhd::synth::Rng| {
            (!files.is_empty()).then(|| files[rng.next_u64() as usize % files.len()].clone())
        };
        let op = match rng.next_u64() % 100 {
            0..=39 => "new",
            40..=47 => "in two parts",
            48..=55 => "copy",
            56..=65 => "move",
            66..=75 => "delete",
            76..=83 => "rewrite",
            84..=88 => "not a recording",
            89..=90 => "folder",
            91..=92 => "status",
            93 => "reload",
            94..=96 => "kill",
            _ => "stop",
        };
        match op {
            "new" => {
                let (label, rel) = new_path(&mut rng);
                write_via_rename(&rec, &rel, &clip_wav(label, rng.next_u64()));
            }
            "in two parts" => {
                let (label, rel) = new_path(&mut rng);
                let bytes = clip_wav(label, rng.next_u64());
                let mut f = std::fs::File::create(rec.join(&rel)).unwrap();
                f.write_all(&bytes[..bytes.len() / 3]).unwrap();
                std::thread::sleep(Duration::from_millis(30));
                f.write_all(&bytes[bytes.len() / 3..]).unwrap();
            }
            "copy" => {
                if let Some(src) = pick(&mut rng) {
                    let (_, rel) = new_path(&mut rng);
                    if let Ok(bytes) = std::fs::read(rec.join(&src)) {
                        write_via_rename(&rec, &rel, &bytes);
                    }
                }
            }
            "move" => {
                if let Some(src) = pick(&mut rng) {
                    let (_, dir) = folder(&mut rng);
                    let name = Path::new(&src).file_name().unwrap();
                    let dst = rec.join(dir).join(name);
                    if !dst.exists() {
                        let _ = std::fs::rename(rec.join(&src), dst);
                    }
                }
            }
            "delete" => {
                if let Some(src) = pick(&mut rng) {
                    let _ = std::fs::remove_file(rec.join(src));
                }
            }
            "rewrite" => {
                if let Some(src) = pick(&mut rng) {
                    let label = src.split('/').nth(label_at).unwrap();
                    // Rewritten in place: truncated, then the new bytes.
                    if let Ok(mut f) = std::fs::OpenOptions::new()
                        .write(true)
                        .truncate(true)
                        .open(rec.join(&src))
                    {
                        f.write_all(&clip_wav(label, rng.next_u64())).unwrap();
                    }
                }
            }
            "not a recording" => {
                let (_, rel) = new_path(&mut rng);
                let len = 10 + rng.next_u64() as usize % 4000;
                let junk: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
                write_via_rename(&rec, &rel, &junk);
            }
            "folder" => {
                let (label, dir) = folder(&mut rng);
                folders += 1;
                let staged = world.dir.path().join(format!("folder-{folders}"));
                std::fs::create_dir(&staged).unwrap();
                for _ in 0..1 + rng.next_u64() % 4 {
                    let (_, rel) = new_path(&mut rng);
                    let name = Path::new(&rel).file_name().unwrap();
                    std::fs::write(staged.join(name), clip_wav(label, rng.next_u64())).unwrap();
                }
                std::fs::rename(&staged, rec.join(dir).join(staged.file_name().unwrap())).unwrap();
            }
            "status" => {
                // Answers at any time, the service up, starting or just killed.
                world.status_json();
            }
            "reload" => {
                // Once the service is up: a changed setting, accepted.
                svc.wait("service up", |st| st["service"].is_object());
                let settle = 100 + rng.next_u64() % 100;
                let text = std::fs::read_to_string(&world.config).unwrap();
                let (head, tail) = text.split_once("settle_ms = ").unwrap();
                let rest = tail.split_once('\n').unwrap().1;
                std::fs::write(&world.config, format!("{head}settle_ms = {settle}\n{rest}"))
                    .unwrap();
                ok(&world.run(&["reload", "--pid", &svc.pid().to_string()]));
            }
            "kill" => {
                svc.kill9();
                svc = Service::spawn(&world);
            }
            _ => {
                svc.terminate();
                svc = Service::spawn(&world);
            }
        }
        *done.entry(op).or_default() += 1;
        std::thread::sleep(Duration::from_millis(rng.next_u64() % 40));
    }
    println!("changes made: {done:?}");
    let total = recordings(&rec).len() as u64;
    svc.wait("every file committed or quarantined", |s| {
        committed(s) + s["files"]["quarantined"].as_u64().unwrap_or(0) == total
            && s["service"]["queue_depth"] == 0
    });
    svc.terminate();
    for reader in readers {
        println!("{}", reader.finish());
    }
    // `status` of the stopped service (the counters it kept commit by commit) agrees with a
    // count of the tree: one valid row per distinct usable content.
    let st = world.status_json();
    let valid: u64 = ["training", "validation", "testing"]
        .iter()
        .map(|split| st["splits"][split]["valid"].as_u64().unwrap())
        .sum();
    let contents = expected_in(&world, label_at).as_object().unwrap().len() as u64;
    assert_eq!(valid, contents, "{st}");
    compare_with_rebuild_as(&world, splits, label_at);
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
