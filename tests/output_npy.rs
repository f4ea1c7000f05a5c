//! The npy writer as readers see it: columns written by `NpySink` loaded with
//! `numpy.load(mmap_mode="r")` (after close, while uncommitted rows exist, while a writer is
//! appending), recovery from a SIGKILLed writer, and refusal of other settings.

use crate::common::output as support;

use ailhd::config::FeatureSettings;
use ailhd::output::npy::NpySink;
use ailhd::output::{OutputHeader, SplitSink};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{header, py, python_ready, rows, BASE_LABELS};

fn append(sink: &mut dyn SplitSink, h: &OutputHeader, n: usize) -> u64 {
    let r = rows(h, sink.len(), n);
    sink.append(&r.mel, r.waveform.as_deref(), &r.meta).unwrap()
}

fn file_len(dir: &Path, name: &str) -> u64 {
    std::fs::metadata(dir.join(format!("{name}.npy")))
        .unwrap()
        .len()
}

#[test]
fn written_rows_load_with_numpy() {
    rows_load_with_numpy(None);
}

/// A staging output (`rebuild`) skips the syncs of its commits; after its close, readers see
/// the same columns.
#[test]
fn staged_rows_load_with_numpy() {
    rows_load_with_numpy(Some(true));
}

/// As where the file system refuses `O_DIRECT`.
#[test]
fn staged_rows_through_the_page_cache_load_with_numpy() {
    rows_load_with_numpy(Some(false));
}

/// `staged`: `Some(direct)` for a staging output (`rebuild`).
fn rows_load_with_numpy(staged: Option<bool>) {
    if !python_ready() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("npy/training");
    let h = header(false);
    let mut sink = match staged {
        Some(direct) => NpySink::create_staged(&dir, &h, direct).unwrap(),
        None => NpySink::create(&dir, &h).unwrap(),
    };
    assert_eq!(append(&mut sink, &h, 100), 0);
    sink.commit().unwrap();
    assert_eq!(append(&mut sink, &h, 150), 100);
    // The feature rows after the first 4 KiB block, less the last partial one, go directly.
    let direct = if staged == Some(true) {
        (128 + 250 * 10240) / 4096 * 4096 - 4096
    } else {
        0
    };
    assert_eq!(
        sink.direct_bytes(),
        direct,
        "features written directly exactly when asked for (a staging output on a file system \
         without O_DIRECT cannot run this check)"
    );
    sink.set_valid(3, false).unwrap();
    sink.write_cell("labels", 4, &2i16.to_le_bytes()).unwrap();
    sink.set_valid(200, false).unwrap(); // appended after the edit map was made
    sink.write_cell("labels", 249, &1i16.to_le_bytes()).unwrap();
    sink.commit().unwrap();
    let mut labels = h.labels.clone();
    labels.push("DRIP".into());
    sink.set_labels(&labels).unwrap();
    assert!(
        sink.set_labels(&labels[1..]).is_err(),
        "renumbering refused"
    );
    Box::new(sink).close().unwrap();

    let mut want = BASE_LABELS.to_vec();
    want.push("DRIP");
    let out = py(&[
        "npy",
        dir.to_str().unwrap(),
        "--rows",
        "250",
        "--labels",
        &serde_json::to_string(&want).unwrap(),
        "--valid-zero",
        "[3, 200]",
        "--relabel",
        r#"{"4": 2, "249": 1}"#,
    ]);
    assert_eq!(
        out["shapes"]["segments_mel"],
        serde_json::json!([250, 40, 2, 64, 1])
    );
    assert_eq!(out["shapes"]["blake3"], serde_json::json!([250, 32]));
    // Data starts on a 64-byte boundary, as numpy aligns it; here the header is 128 bytes.
    assert_eq!(file_len(&dir, "segments_mel"), 128 + 250 * 10240);
}

/// A feature cell written while the end of the column waits for a direct write: what waits
/// is written first, the column goes on through the page cache, and every row loads.
#[test]
fn a_feature_cell_edited_while_rows_wait_loads_with_numpy() {
    if !python_ready() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("npy/training");
    let h = header(false);
    let mut sink = NpySink::create_staged(&dir, &h, true).unwrap();
    append(&mut sink, &h, 40);
    let direct = sink.direct_bytes();
    assert_eq!(direct, (128 + 40 * 10240) / 4096 * 4096 - 4096);
    let row = rows(&h, 39, 1);
    let bytes: &[u8] = bytemuck::cast_slice(&row.mel);
    sink.write_cell("segments_mel", 39, bytes).unwrap();
    append(&mut sink, &h, 30);
    sink.commit().unwrap();
    assert_eq!(
        sink.direct_bytes(),
        direct,
        "no direct writes after the edit"
    );
    Box::new(sink).close().unwrap();
    py(&["npy", dir.to_str().unwrap(), "--rows", "70"]);
    assert_eq!(file_len(&dir, "segments_mel"), 128 + 70 * 10240);
}

#[test]
fn header_shape_is_the_committed_count() {
    if !python_ready() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("validation");
    let h = header(true);
    let mut sink = NpySink::create(&dir, &h).unwrap();
    append(&mut sink, &h, 10);
    sink.commit().unwrap();
    append(&mut sink, &h, 5);
    // Uncommitted rows are in the files but not in their headers.
    py(&[
        "npy",
        dir.to_str().unwrap(),
        "--rows",
        "10",
        "--waveform",
        "1",
    ]);
    Box::new(sink).close().unwrap();
    assert_eq!(
        file_len(&dir, "labels"),
        128 + 10 * 2,
        "close drops uncommitted rows"
    );
    let mut sink = NpySink::open_append(&dir, &h, None).unwrap();
    assert_eq!((sink.len(), sink.committed_rows()), (10, 10));
    append(&mut sink, &h, 3);
    sink.commit().unwrap();
    drop(sink);
    py(&[
        "npy",
        dir.to_str().unwrap(),
        "--rows",
        "13",
        "--waveform",
        "1",
    ]);
}

#[test]
fn refuses_other_settings_and_existing_outputs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("testing");
    let h = header(false);
    let mut sink = NpySink::create(&dir, &h).unwrap();
    append(&mut sink, &h, 2);
    sink.commit().unwrap();
    drop(sink);
    let e = NpySink::create(&dir, &h).err().expect("exists");
    assert!(e.to_string().contains("already holds"), "{e:#}");
    let other = OutputHeader {
        features: FeatureSettings {
            hop_length: 64,
            ..FeatureSettings::default()
        },
        ..h.clone()
    };
    let e = NpySink::open_append(&dir, &other, None)
        .err()
        .expect("refused");
    assert!(format!("{e:#}").contains("ailhd rebuild"), "{e:#}");
    let wider = OutputHeader {
        path_bytes: 300,
        ..h.clone()
    };
    let e = NpySink::open_append(&dir, &wider, None)
        .err()
        .expect("refused");
    assert!(format!("{e:#}").contains("rebuild"), "{e:#}");
    assert_eq!(
        NpySink::open_append(&dir, &h, None)
            .unwrap()
            .committed_rows(),
        2
    );
}

#[test]
fn numpy_reader_follows_the_writer() {
    if !python_ready() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("training");
    let h = header(false);
    let mut sink = NpySink::create(&dir, &h).unwrap();
    let target = 1500u64;
    let reader = support::checker()
        .args([
            "npy-follow",
            dir.to_str().unwrap(),
            "--target",
            &target.to_string(),
        ])
        .args(["--timeout", "120", "--interval", "0.001"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut step = 0u64;
    while sink.len() < target {
        step += 1;
        let n = (1 + step % 23).min(target - sink.len()) as usize;
        append(&mut sink, &h, n);
        if step.is_multiple_of(7) {
            let row = (step * 31) % sink.committed_rows().max(1);
            sink.set_valid(row, false).unwrap();
            sink.write_cell("labels", row, &((step % 5) as i16).to_le_bytes())
                .unwrap();
        }
        sink.commit().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let out = reader.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "numpy reader failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "numpy reader: {} (writer made {step} commits)",
        String::from_utf8_lossy(&out.stdout).trim()
    );
}

const CHILD_ENV: &str = "AILHD_TEST_NPY_KILL_CHILD";

/// Not a test on its own: the writer process `reopen_after_sigkill` starts and kills.
#[test]
fn npy_kill_child_writer() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let dir = Path::new(&dir);
    let h = header(false);
    let mut sink = if dir.exists() {
        NpySink::open_append(dir, &h, None).unwrap()
    } else {
        NpySink::create(dir, &h).unwrap()
    };
    let first = sink.len();
    let pool = rows(&h, first, 1500);
    let row_len = h.shape().row_len();
    for step in 0u64.. {
        let n = 1 + (step * 17 % 60) as usize;
        let at = (sink.len() - first) as usize;
        if at + n <= pool.meta.len() {
            let mel = &pool.mel[at * row_len..(at + n) * row_len];
            sink.append(mel, None, &pool.meta[at..at + n]).unwrap();
        } else {
            append(&mut sink, &h, n);
        }
        if step % 3 != 2 {
            sink.commit().unwrap();
            println!("committed {}", sink.committed_rows());
        }
    }
}

#[test]
fn reopen_after_sigkill() {
    if !python_ready() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("training");
    let h = header(false);
    let mut at_least = 0;
    for (round, (wait, delay_ms)) in [
        (false, 30),
        (true, 0),
        (true, 5),
        (false, 50),
        (true, 17),
        (true, 41),
    ]
    .into_iter()
    .enumerate()
    {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                &crate::common::test_name(module_path!(), "npy_kill_child_writer"),
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, &dir)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut reported = 0;
        let started = Instant::now();
        while wait && reported < at_least + 50 {
            if let Some(n) = lines
                .next()
                .expect("child ended early")
                .unwrap()
                .strip_prefix("committed ")
            {
                reported = n.parse().unwrap();
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "child too slow"
            );
        }
        let drain = std::thread::spawn(move || {
            lines
                .map_while(Result::ok)
                .filter_map(|l| {
                    l.strip_prefix("committed ")
                        .map(|n| n.parse::<u64>().unwrap())
                })
                .last()
        });
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
        let reported = drain.join().unwrap().unwrap_or(reported).max(reported);
        if !dir.exists() {
            eprintln!("round {round}: killed before the output was created");
            continue;
        }
        let mut sink = NpySink::open_append(&dir, &h, None)
            .unwrap_or_else(|e| panic!("open_append after kill (round {round}): {e:#}"));
        let committed = sink.committed_rows();
        eprintln!(
            "round {round}: killed after {reported}+ committed rows; reopened with {committed}"
        );
        assert!(committed >= reported, "{committed} < {reported}");
        assert_eq!(
            file_len(&dir, "segments_mel"),
            128 + committed * 10240,
            "reclaimed"
        );
        append(&mut sink, &h, 7);
        sink.commit().unwrap();
        at_least = sink.committed_rows();
        Box::new(sink).close().unwrap();
        py(&[
            "npy",
            dir.to_str().unwrap(),
            "--rows",
            &at_least.to_string(),
        ]);
    }
}

/// Cost of a daemon-sized commit (a few rows): `cargo test --release --test tests --
/// --ignored --nocapture output_npy::small_commit_latency`. Prints figures.
#[test]
#[ignore]
fn small_commit_latency() {
    let dir = tempfile::tempdir().unwrap();
    let h = header(false);
    let mut sink = NpySink::create(&dir.path().join("small"), &h).unwrap();
    let commits = 200;
    let t = Instant::now();
    for _ in 0..commits {
        append(&mut sink, &h, 4);
        sink.commit().unwrap();
    }
    eprintln!(
        "npy: {commits} commits of 4 rows: {:.2} ms per append + commit",
        t.elapsed().as_secs_f64() * 1e3 / commits as f64
    );
}

/// Throughput of bulk appends: `cargo test --release --test tests -- --ignored --nocapture
/// output_npy::append_throughput`. Prints figures; asserts nothing about speed.
#[test]
#[ignore]
fn append_throughput() {
    let tmp = tempfile::tempdir().unwrap();
    let h = header(false);
    let batch = rows(&h, 0, 1000);
    let row_bytes = 2 * h.shape().row_len();
    let mut sink = NpySink::create(&tmp.path().join("bench"), &h).unwrap();
    let batches = 30;
    let (mut in_append, mut in_commit) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..batches {
        let t = Instant::now();
        sink.append(&batch.mel, None, &batch.meta).unwrap();
        in_append += t.elapsed();
        let t = Instant::now();
        sink.commit().unwrap();
        in_commit += t.elapsed();
    }
    let s = (in_append + in_commit).as_secs_f64();
    let n = (batches * 1000) as f64;
    eprintln!(
        "npy: {n} rows of {row_bytes} B mel in {s:.2} s ({:.2} s appending, {:.2} s \
         committing): {:.0} rows/s, {:.0} MB/s of mel (commit + fdatasync every 1000 rows)",
        in_append.as_secs_f64(),
        in_commit.as_secs_f64(),
        n / s,
        n * row_bytes as f64 / s / 1e6
    );
}

/// A service stopped between the manifest and the publish of a batch (src/engine/commit.rs):
/// `prepare` made the batch's rows durable, no header covers them yet. Reopened with the count
/// the manifest records (`keep`), they are published, bytes intact; reopened without one (the
/// manifest never recorded them), they are cut, as rows no reader saw.
#[test]
fn prepared_rows_are_published_by_a_reopen_that_keeps_them_and_cut_otherwise() {
    let tmp = tempfile::tempdir().unwrap();
    let h = header(true);
    for keep in [Some(7), None] {
        let dir = tmp.path().join(format!("training-{keep:?}"));
        let mut sink = NpySink::create(&dir, &h).unwrap();
        append(&mut sink, &h, 4);
        sink.commit().unwrap();
        append(&mut sink, &h, 3);
        sink.prepare().unwrap();
        assert_eq!(sink.committed_rows(), 4);
        // The process dies here: nothing is closed or cut.
        std::mem::forget(sink);
        assert_eq!(
            NpySink::committed_rows_on_disk(&dir, &h).unwrap(),
            4,
            "prepare moves no header"
        );
        let sink = NpySink::open_append(&dir, &h, keep).unwrap();
        let want = keep.unwrap_or(4);
        assert_eq!((sink.len(), sink.committed_rows()), (want, want));
        drop(sink);
        assert_eq!(NpySink::committed_rows_on_disk(&dir, &h).unwrap(), want);
        assert_eq!(file_len(&dir, "labels"), 128 + want * 2);
        py(&[
            "npy",
            dir.to_str().unwrap(),
            "--rows",
            &want.to_string(),
            "--waveform",
            "1",
        ]);
    }
}

/// A split of four committed rows, closed.
fn four_rows_closed() -> (tempfile::TempDir, std::path::PathBuf, OutputHeader) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("training");
    let h = header(false);
    let mut sink = NpySink::create(&dir, &h).unwrap();
    append(&mut sink, &h, 4);
    sink.commit().unwrap();
    Box::new(sink).close().unwrap();
    (tmp, dir, h)
}

fn attributes_inode(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir.join("attributes.json"))
        .unwrap()
        .ino()
}

/// A reopen of a split that holds exactly its committed rows (as after the service's own idle
/// close) cuts and rewrites nothing; one whose `attributes.json` disagrees with the column
/// headers is brought back in line as before.
#[test]
fn a_reopen_of_exactly_the_committed_rows_rewrites_nothing() {
    let (_tmp, dir, h) = four_rows_closed();
    let attrs = dir.join("attributes.json");
    let inode = || attributes_inode(&dir);
    let committed_in_attrs = || {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&attrs).unwrap()).unwrap();
        v["committed_rows"].as_u64()
    };
    let before = (inode(), file_len(&dir, "labels"));

    let sink = NpySink::open_append(&dir, &h, Some(4)).unwrap();
    assert_eq!((sink.len(), sink.committed_rows()), (4, 4));
    assert_eq!(
        (inode(), file_len(&dir, "labels")),
        before,
        "attributes.json replaced or a column cut"
    );
    Box::new(sink).close().unwrap();

    // attributes.json out of step with the headers (written in place, same inode).
    let text = std::fs::read_to_string(&attrs).unwrap();
    std::fs::write(
        &attrs,
        text.replace("\"committed_rows\": 4", "\"committed_rows\": 3"),
    )
    .unwrap();
    assert_eq!(committed_in_attrs(), Some(3));
    let sink = NpySink::open_append(&dir, &h, Some(4)).unwrap();
    assert_eq!(sink.committed_rows(), 4);
    assert_eq!(committed_in_attrs(), Some(4), "attributes.json rewritten");
    Box::new(sink).close().unwrap();
}

/// A resume (the same process reopening a split it closed cleanly) takes a split that holds
/// exactly the rows it closed at as it is; a split that holds others (here one row more than the
/// resume expects) is cut back as any reopen cuts it.
#[test]
fn a_resume_takes_its_own_rows_as_they_are_and_cuts_anything_else() {
    let (_tmp, dir, h) = four_rows_closed();
    let inode = || attributes_inode(&dir);
    let before = (inode(), file_len(&dir, "labels"));

    let sink = NpySink::resume(&dir, &h, 4).unwrap();
    assert_eq!((sink.len(), sink.committed_rows()), (4, 4));
    assert_eq!((inode(), file_len(&dir, "labels")), before);
    Box::new(sink).close().unwrap();

    let sink = NpySink::resume(&dir, &h, 3).unwrap();
    assert_eq!((sink.len(), sink.committed_rows()), (3, 3));
    assert!(file_len(&dir, "labels") < before.1, "the fourth row cut");
    Box::new(sink).close().unwrap();
    let sink = NpySink::open_append(&dir, &h, None).unwrap();
    assert_eq!(sink.committed_rows(), 3);
    Box::new(sink).close().unwrap();
}
