//! The HDF5 writer as readers see it: files written by `Hdf5Sink` read back with h5py (plain
//! and SWMR), an h5py SWMR reader following a live writer, files left by a SIGKILLed writer,
//! and refusal of files made with other settings.

use crate::common::output as support;

use ailhd::config::FeatureSettings;
use ailhd::output::hdf5::Hdf5Sink;
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

fn labels_arg(labels: &[&str]) -> String {
    serde_json::to_string(labels).unwrap()
}

#[test]
fn written_rows_read_back_with_h5py() {
    rows_read_back_with_h5py(false);
}

/// A staging output (`rebuild`) skips the syncs of its commits; after its close, readers see
/// the same file.
#[test]
fn staged_rows_read_back_with_h5py() {
    rows_read_back_with_h5py(true);
}

fn rows_read_back_with_h5py(staged: bool) {
    if !python_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("TRAINING_DATASET.H5");
    let h = header(false);
    let mut sink = if staged {
        Hdf5Sink::create_staged(&path, &h).unwrap()
    } else {
        Hdf5Sink::create(&path, &h, false).unwrap()
    };
    assert_eq!(append(&mut sink, &h, 100), 0);
    assert_eq!(append(&mut sink, &h, 1), 100);
    sink.commit().unwrap();
    assert_eq!(append(&mut sink, &h, 149), 101);
    sink.set_valid(3, false).unwrap();
    sink.write_cell("labels", 4, &2i16.to_le_bytes()).unwrap();
    sink.set_valid(200, false).unwrap(); // an appended, not yet committed row
    sink.commit().unwrap();
    assert_eq!((sink.len(), sink.committed_rows()), (250, 250));
    let mut labels: Vec<String> = h.labels.clone();
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
        "hdf5",
        path.to_str().unwrap(),
        "--rows",
        "250",
        "--labels",
        &labels_arg(&want),
        "--valid-zero",
        "[3, 200]",
        "--relabel",
        r#"{"4": 2}"#,
    ]);
    // v1.10 format: superblock version 3, bounds (v110, v110) - readable by HDF5 1.10+.
    assert_eq!(out["superblock"], 3, "{out}");
    assert_eq!(
        out["datasets"]["segments_mel"][0],
        serde_json::json!([250, 40, 2, 64, 1])
    );
    eprintln!("h5py read back: {out}");
}

/// Pages of the first `len` bytes of `file` that are in the page cache (`mincore`).
fn resident_pages(file: &std::fs::File, len: usize) -> std::io::Result<usize> {
    let map = unsafe { memmap2::MmapOptions::new().len(len).map(file) }?;
    let mut resident = vec![0u8; len.div_ceil(4096)];
    // SAFETY: `map` is a live mapping of `len` bytes; `resident` has a byte per page.
    let r = unsafe {
        libc::mincore(
            map.as_ptr() as *mut libc::c_void,
            len,
            resident.as_mut_ptr(),
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(resident.iter().filter(|&&b| b & 1 == 1).count())
}

/// A staging file gives its page cache back a batch behind when asked to write back (as
/// `rebuild` does after each batch): few of its pages stay cached, where the same file written
/// without those calls keeps nearly all; and h5py reads every row back after the close (HDF5
/// rewrites its metadata in place, over pages that were dropped).
#[test]
fn a_staging_file_gives_its_page_cache_back_and_reads_back_with_h5py() {
    if !python_ready() {
        return;
    }
    let h = header(false);
    let mut resident = Vec::new();
    for writeback in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("TRAINING_DATASET.H5");
        let mut sink = Hdf5Sink::create_staged(&path, &h).unwrap();
        for _ in 0..20 {
            append(&mut sink, &h, 97);
            if writeback {
                sink.start_writeback().unwrap();
            }
        }
        // Chunks HDF5 still caches are written now (a staging commit flushes nothing).
        let file = std::fs::File::open(&path).unwrap();
        let len = file.metadata().unwrap().len() as usize;
        let pages = len.div_ceil(4096);
        let cached = resident_pages(&file, len).unwrap();
        eprintln!("writeback {writeback}: {cached} of {pages} pages cached");
        resident.push((cached, pages));
        sink.commit().unwrap();
        Box::new(sink).close().unwrap();
        py(&["hdf5", path.to_str().unwrap(), "--rows", "1940"]);
    }
    let [(recycled, pages), (kept, _)] = resident[..] else {
        unreachable!()
    };
    assert!(
        pages > 3000,
        "about 16 MB written past the chunk cache ({pages} pages)"
    );
    assert!(
        recycled < pages / 4,
        "given back a batch behind: {recycled} of {pages} pages still cached"
    );
    assert!(
        kept > pages * 3 / 4,
        "without writeback calls the pages stay ({kept} of {pages}): the check above measures \
         the recycling"
    );
}

#[test]
fn waveform_column_and_swmr_created_file_read_plainly_after_close() {
    if !python_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("VALIDATION_DATASET.H5");
    let h = header(true);
    let mut sink = Hdf5Sink::create(&path, &h, true).unwrap();
    append(&mut sink, &h, 7);
    sink.commit().unwrap();
    append(&mut sink, &h, 5);
    // Uncommitted rows are dropped by close: readers see exactly committed_rows rows.
    Box::new(sink).close().unwrap();
    let out = py(&[
        "hdf5",
        path.to_str().unwrap(),
        "--rows",
        "7",
        "--waveform",
        "1",
    ]);
    assert_eq!(
        out["datasets"]["segments_waveform"][0],
        serde_json::json!([7, 40, 2, 512])
    );

    // Reopen, append, and the new rows follow the old ones.
    let mut sink = Hdf5Sink::open_append(&path, &h, true, None).unwrap();
    assert_eq!((sink.len(), sink.committed_rows()), (7, 7));
    assert_eq!(append(&mut sink, &h, 3), 7);
    sink.commit().unwrap();
    drop(sink); // Drop closes like close()
    py(&[
        "hdf5",
        path.to_str().unwrap(),
        "--rows",
        "10",
        "--waveform",
        "1",
    ]);
}

#[test]
fn label_attributes_grow_outside_swmr_and_refuse_to_inside() {
    if !python_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("TRAINING_DATASET.H5");
    let h = header(false);
    let many = |n: usize| -> Vec<String> {
        let mut l = h.labels.clone();
        l.extend((l.len()..n).map(|i| format!("FOLDER_NUMBER_{i:05}_ÄÖÜ")));
        l
    };
    let mut sink = Hdf5Sink::create(&path, &h, false).unwrap();
    sink.set_labels(&many(300)).unwrap(); // ~9 KB of JSON: recreated bigger
    drop(sink);
    let mut sink = Hdf5Sink::open_append(&path, &h, true, None).unwrap();
    assert_eq!(sink.labels().len(), 300);
    sink.set_labels(&many(400)).unwrap(); // in place, under SWMR
    let e = sink
        .set_labels(&many(5000))
        .expect_err("no room under SWMR");
    assert!(format!("{e:#}").contains("restart ailhd"), "{e:#}");
    drop(sink);
    let labels = many(400);
    py(&[
        "hdf5",
        path.to_str().unwrap(),
        "--labels",
        &serde_json::to_string(&labels).unwrap(),
    ]);
}

#[test]
fn readers_holding_the_file_do_not_block_the_writer() {
    if !python_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("TRAINING_DATASET.H5");
    let h = header(false);
    let mut sink = Hdf5Sink::create(&path, &h, false).unwrap();
    append(&mut sink, &h, 3);
    sink.commit().unwrap();
    drop(sink);
    // A plain reader (h5py's default: with file locking) holds the closed file; the service
    // restarts and appends in SWMR mode. Then the same with a SWMR reader.
    for (mode, rows) in [("plain", 3), ("swmr", 6)] {
        let mut reader = support::checker()
            .args([
                "hold",
                path.to_str().unwrap(),
                "--mode",
                mode,
                "--timeout",
                "60",
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let line = BufReader::new(reader.stdout.take().unwrap())
            .lines()
            .next()
            .unwrap()
            .unwrap();
        assert_eq!(line, format!("holding {rows}"));
        let mut sink = Hdf5Sink::open_append(&path, &h, true, None).unwrap();
        append(&mut sink, &h, 3);
        sink.commit().unwrap();
        drop(sink);
        reader.kill().unwrap();
        reader.wait().unwrap();
    }
    py(&["hdf5", path.to_str().unwrap(), "--rows", "9"]);
}

#[test]
fn refuses_to_append_with_other_settings() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("TESTING_DATASET.H5");
    let h = header(false);
    let mut sink = Hdf5Sink::create(&path, &h, false).unwrap();
    append(&mut sink, &h, 2);
    sink.commit().unwrap();
    Box::new(sink).close().unwrap();

    let e = Hdf5Sink::create(&path, &h, false).err().expect("exists");
    assert!(e.to_string().contains("already exists"), "{e:#}");

    let other = OutputHeader {
        features: FeatureSettings {
            n_mels: 32,
            ..FeatureSettings::default()
        },
        ..h.clone()
    };
    let e = Hdf5Sink::open_append(&path, &other, false, None)
        .err()
        .expect("refused");
    assert!(format!("{e:#}").contains("ailhd rebuild"), "{e:#}");

    let wider = OutputHeader {
        path_bytes: 512,
        ..h.clone()
    };
    let e = Hdf5Sink::open_append(&path, &wider, true, None)
        .err()
        .expect("refused");
    assert!(format!("{e:#}").contains("rebuild"), "{e:#}");

    // Still fine with the original settings.
    let sink = Hdf5Sink::open_append(&path, &h, false, None).unwrap();
    assert_eq!(sink.committed_rows(), 2);
}

#[test]
fn swmr_reader_follows_the_writer() {
    if !python_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("TRAINING_DATASET.H5");
    let h = header(false);
    let mut sink = Hdf5Sink::create(&path, &h, true).unwrap();
    let target = 1500u64;
    let reader = support::checker()
        .args([
            "swmr-follow",
            path.to_str().unwrap(),
            "--target",
            &target.to_string(),
        ])
        .args(["--timeout", "120", "--interval", "0.002"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300)); // let it open the file first
    let mut valid_zero = Vec::new();
    let mut relabel = serde_json::Map::new();
    let mut labels = h.labels.clone();
    let mut step = 0u64;
    while sink.len() < target {
        step += 1;
        let n = (1 + step % 23).min(target - sink.len()) as usize;
        append(&mut sink, &h, n);
        if step.is_multiple_of(7) {
            // In-place edits of committed rows while the reader reads them.
            let row = (step * 31) % sink.committed_rows().max(1);
            sink.set_valid(row, false).unwrap();
            valid_zero.push(row);
            let label = (step % 5) as i16;
            sink.write_cell("labels", row, &label.to_le_bytes())
                .unwrap();
            relabel.insert(row.to_string(), label.into());
        }
        if step == 40 {
            labels.push("DRIP".into());
            sink.set_labels(&labels).unwrap();
        }
        sink.commit().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let out = reader.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "SWMR reader failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "SWMR reader: {} (writer made {step} commits)",
        String::from_utf8_lossy(&out.stdout).trim()
    );
    Box::new(sink).close().unwrap();
    let mut want = BASE_LABELS.to_vec();
    want.push("DRIP");
    py(&[
        "hdf5",
        path.to_str().unwrap(),
        "--rows",
        &target.to_string(),
        "--labels",
        &labels_arg(&want),
        "--valid-zero",
        &serde_json::to_string(&valid_zero).unwrap(),
        "--relabel",
        &serde_json::Value::Object(relabel).to_string(),
    ]);
}

const CHILD_ENV: &str = "AILHD_TEST_KILL_CHILD";

/// Not a test on its own: the writer process that `reopen_after_sigkill_*` start (this test
/// binary with `CHILD_ENV` set) and kill. It appends and commits forever, printing each
/// committed count.
#[test]
fn kill_child_writer() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let swmr = std::env::var("AILHD_TEST_SWMR").unwrap() == "1";
    let path = Path::new(&path);
    let h = header(false);
    let mut sink = if path.exists() {
        Hdf5Sink::open_append(path, &h, swmr, None).unwrap()
    } else {
        Hdf5Sink::create(path, &h, swmr).unwrap()
    };
    println!("opened {}", sink.committed_rows());
    // Rows made up front, so that the process spends its time in the writer, where the kill
    // should land, rather than in making rows.
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

/// Start the child writer, let it commit at least `min_rows` (when given; otherwise do not wait
/// for anything, so the kill may land while it creates or reopens the file), SIGKILL it after
/// `delay`. Returns the last committed count it reported.
fn run_and_kill(path: &Path, swmr: bool, min_rows: Option<u64>, delay: Duration) -> u64 {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            &crate::common::test_name(module_path!(), "kill_child_writer"),
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, path)
        .env("AILHD_TEST_SWMR", if swmr { "1" } else { "0" })
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut committed = 0;
    let started = Instant::now();
    while min_rows.is_some_and(|m| committed < m) {
        let line = lines.next().expect("child ended early").unwrap();
        if let Some(n) = line.strip_prefix("committed ") {
            committed = n.parse().unwrap();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "child too slow"
        );
    }
    // Drain output in the background so the child never blocks on a full pipe.
    let drain = std::thread::spawn(move || {
        let mut last = None;
        for l in lines.map_while(Result::ok) {
            if let Some(n) = l.strip_prefix("committed ") {
                last = Some(n.parse::<u64>().unwrap());
            }
        }
        last
    });
    std::thread::sleep(delay);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    drain.join().unwrap().unwrap_or(committed).max(committed)
}

fn reopen_after_sigkill(swmr: bool) {
    if !python_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("TRAINING_DATASET.H5");
    let h = header(false);
    let mut at_least = 0;
    // (wait for rows, kill delay): some kills land while the child creates or reopens the file.
    let rounds = [
        (false, 40),
        (true, 0),
        (true, 3),
        (false, 60),
        (true, 7),
        (true, 13),
        (false, 90),
        (true, 29),
        (true, 51),
    ];
    for (round, (wait, delay_ms)) in rounds.into_iter().enumerate() {
        let min_rows = wait.then_some(at_least + 50);
        let reported = run_and_kill(&path, swmr, min_rows, Duration::from_millis(delay_ms));
        if !path.exists() {
            eprintln!("round {round} (swmr={swmr}): killed before the file was created");
            continue;
        }
        // How readers fare with the file exactly as the killed writer left it.
        let before = py(&["try-open", path.to_str().unwrap()]);
        eprintln!("round {round} (swmr={swmr}), killed after {reported}+ committed rows: {before}");
        if swmr && wait {
            assert_eq!(
                before["swmr"]["ok"], true,
                "SWMR reader after kill: {before}"
            );
            assert!(before["swmr"]["committed"].as_u64().unwrap() >= reported);
        }
        let mut sink = Hdf5Sink::open_append(&path, &h, swmr, None)
            .unwrap_or_else(|e| panic!("open_append after kill (round {round}): {e:#}"));
        let committed = sink.committed_rows();
        assert!(committed >= reported, "{committed} < {reported}");
        assert_eq!(sink.len(), committed, "uncommitted rows reclaimed");
        append(&mut sink, &h, 7);
        sink.commit().unwrap();
        at_least = sink.committed_rows();
        // Verify (plainly) with the writer closed, then hand the file to the next child.
        Box::new(sink).close().unwrap();
        py(&[
            "hdf5",
            path.to_str().unwrap(),
            "--rows",
            &at_least.to_string(),
        ]);
    }
}

#[test]
fn reopen_after_sigkill_swmr() {
    reopen_after_sigkill(true);
}

#[test]
fn reopen_after_sigkill_without_swmr() {
    reopen_after_sigkill(false);
}

/// Cost of a daemon-sized commit (a few rows): `cargo test --release --test tests --
/// --ignored --nocapture output_hdf5::small_commit_latency`. Prints figures.
#[test]
#[ignore]
fn small_commit_latency() {
    let dir = tempfile::tempdir().unwrap();
    let h = header(false);
    let mut sink = Hdf5Sink::create(&dir.path().join("small.h5"), &h, true).unwrap();
    let commits = 200;
    let t = Instant::now();
    for _ in 0..commits {
        append(&mut sink, &h, 4);
        sink.commit().unwrap();
    }
    eprintln!(
        "hdf5: {commits} commits of 4 rows: {:.2} ms per append + commit",
        t.elapsed().as_secs_f64() * 1e3 / commits as f64
    );
}

/// Throughput of bulk appends (what `rebuild` does): `cargo test --release --test tests --
/// --ignored --nocapture output_hdf5::append_throughput`. Prints figures; asserts nothing about
/// speed.
#[test]
#[ignore]
fn append_throughput() {
    let dir = tempfile::tempdir().unwrap();
    let h = header(false);
    let batch = rows(&h, 0, 1000);
    let row_bytes = 2 * h.shape().row_len();
    for swmr in [false, true] {
        let path = dir.path().join(format!("bench-{swmr}.h5"));
        let mut sink = Hdf5Sink::create(&path, &h, swmr).unwrap();
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
            "hdf5 swmr={swmr}: {n} rows of {row_bytes} B mel in {s:.2} s ({:.2} s appending, \
             {:.2} s committing): {:.0} rows/s, {:.0} MB/s of mel (commit + fdatasync every 1000 \
             rows)",
            in_append.as_secs_f64(),
            in_commit.as_secs_f64(),
            n / s,
            n * row_bytes as f64 / s / 1e6
        );
    }
}

/// The daemon's manifest can account for fewer rows than a file committed (killed between the
/// two commits): `keep` cuts those rows off too, and the count on disk follows.
#[test]
fn open_append_reclaims_rows_past_keep() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("T.H5");
    let h = header(false);
    let mut sink = Hdf5Sink::create(&path, &h, true).unwrap();
    append(&mut sink, &h, 5);
    sink.commit().unwrap();
    Box::new(sink).close().unwrap();
    let sink = Hdf5Sink::open_append(&path, &h, true, Some(3)).unwrap();
    assert_eq!(sink.committed_rows(), 3);
    assert_eq!(sink.len(), 3);
    Box::new(sink).close().unwrap();
    let sink = Hdf5Sink::open_append(&path, &h, false, None).unwrap();
    assert_eq!(sink.committed_rows(), 3);
}

/// Where HDF5 put `segments_mel`'s chunks (h5py's chunk index query): asserts that there is one
/// per `chunk_rows` rows and that each starts at a multiple of the row size, so that every row
/// does and `ailhd_reader` gathers whole rows from a map of the file. Also asserts that the
/// padding this costs is small: the file is at most 4% + 64 KiB bigger than its chunks (with a
/// threshold that let small objects be aligned too, each would be padded to a row: +8% here),
/// and that the other columns' chunks are a page at most.
fn assert_feature_rows_aligned(path: &Path, rows: u64, what: &str) {
    let out = py(&["chunks", path.to_str().unwrap()]);
    let mel = &out["datasets"]["segments_mel"];
    let row_bytes = mel["row_bytes"].as_u64().unwrap();
    let chunk_rows = mel["chunk_rows"].as_u64().unwrap();
    let offsets: Vec<u64> = mel["offsets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(mel["rows"].as_u64(), Some(rows), "{what}: {mel}");
    assert_eq!(
        offsets.len() as u64,
        rows.div_ceil(chunk_rows),
        "{what}: {mel}"
    );
    let off: Vec<(usize, u64)> = offsets
        .iter()
        .enumerate()
        .filter(|(_, &o)| o % row_bytes != 0)
        .map(|(k, &o)| (k, o))
        .collect();
    assert!(
        off.is_empty(),
        "{what}: {} of {} segments_mel chunks do not start at a multiple of the row size \
         ({row_bytes} bytes); (chunk, offset): {off:?}",
        off.len(),
        offsets.len()
    );
    // The narrow columns' chunks are a page at most: each commit of the service rewrites the
    // last, partial chunk of every column (docs/reading.md, "Layout on disk").
    for (name, d) in out["datasets"].as_object().unwrap() {
        let bytes = d["chunk_rows"].as_u64().unwrap() * d["row_bytes"].as_u64().unwrap();
        if !name.starts_with("segments_") {
            assert!(
                bytes <= 4096,
                "{what}: {name} has chunks of {bytes} bytes: {d}"
            );
        }
    }
    let chunks: u64 = out["datasets"]
        .as_object()
        .unwrap()
        .values()
        .map(|d| {
            d["offsets"].as_array().unwrap().len() as u64
                * d["chunk_rows"].as_u64().unwrap()
                * d["row_bytes"].as_u64().unwrap()
        })
        .sum();
    let file = out["file_bytes"].as_u64().unwrap();
    eprintln!("{what}: file {file} bytes, chunks {chunks} bytes");
    assert!(
        file <= chunks + chunks / 25 + (64 << 10),
        "{what}: the file has {file} bytes for {chunks} bytes of chunks"
    );
}

/// Every `segments_mel` chunk starts at a multiple of the features' row size: in a file written
/// in bulk (as `rebuild` writes), then appended to a few rows per commit in SWMR mode after a
/// reopen (as the service appends), and in a file the service creates; for the default
/// features (rows of 10,240 bytes) and for rows of 7,680 bytes with the waveform stored (so a
/// power-of-two alignment would not do).
#[test]
fn feature_chunks_start_at_multiples_of_the_row_size() {
    let dir = tempfile::tempdir().unwrap();
    let other = OutputHeader {
        features: FeatureSettings {
            n_mels: 48,
            store_waveform: true,
            ..FeatureSettings::default()
        },
        ..header(false)
    };
    for (what, h) in [("default", header(false)), ("n_mels 48 + waveform", other)] {
        let bulk = dir.path().join(format!("{what}-bulk.H5"));
        let mut sink = Hdf5Sink::create(&bulk, &h, false).unwrap();
        for _ in 0..5 {
            append(&mut sink, &h, 100);
        }
        sink.commit().unwrap();
        Box::new(sink).close().unwrap();
        assert_feature_rows_aligned(&bulk, 500, &format!("{what}, bulk"));

        let mut n = 500;
        let mut sink = Hdf5Sink::open_append(&bulk, &h, true, None).unwrap();
        for k in 0..40 {
            n += 1 + k % 3;
            append(&mut sink, &h, 1 + k as usize % 3);
            if k % 7 == 0 {
                sink.set_valid(k, false).unwrap();
            }
            sink.commit().unwrap();
        }
        Box::new(sink).close().unwrap();
        assert_feature_rows_aligned(&bulk, n, &format!("{what}, bulk then appended"));

        let live = dir.path().join(format!("{what}-live.H5"));
        let mut sink = Hdf5Sink::create(&live, &h, true).unwrap();
        for k in 0..60 {
            append(&mut sink, &h, 1 + k % 2);
            sink.commit().unwrap();
        }
        Box::new(sink).close().unwrap();
        let mut sink = Hdf5Sink::open_append(&live, &h, true, None).unwrap();
        for _ in 0..10 {
            append(&mut sink, &h, 1);
            sink.commit().unwrap();
        }
        Box::new(sink).close().unwrap();
        assert_feature_rows_aligned(&live, 100, &format!("{what}, service-made"));
    }
}

/// Bob Jenkins' lookup3 `hashlittle`, HDF5's checksum of its metadata (`H5_checksum_lookup3`).
fn lookup3(key: &[u8]) -> u32 {
    fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
        *a = a.wrapping_sub(*c) ^ c.rotate_left(4);
        *c = c.wrapping_add(*b);
        *b = b.wrapping_sub(*a) ^ a.rotate_left(6);
        *a = a.wrapping_add(*c);
        *c = c.wrapping_sub(*b) ^ b.rotate_left(8);
        *b = b.wrapping_add(*a);
        *a = a.wrapping_sub(*c) ^ c.rotate_left(16);
        *c = c.wrapping_add(*b);
        *b = b.wrapping_sub(*a) ^ a.rotate_left(19);
        *a = a.wrapping_add(*c);
        *c = c.wrapping_sub(*b) ^ b.rotate_left(4);
        *b = b.wrapping_add(*a);
    }
    let word = |k: &[u8]| {
        let mut w = [0u8; 4];
        w[..k.len()].copy_from_slice(k);
        u32::from_le_bytes(w)
    };
    let init = 0xdead_beef_u32.wrapping_add(key.len() as u32);
    let (mut a, mut b, mut c) = (init, init, init);
    let mut k = key;
    while k.len() > 12 {
        a = a.wrapping_add(word(&k[0..4]));
        b = b.wrapping_add(word(&k[4..8]));
        c = c.wrapping_add(word(&k[8..12]));
        mix(&mut a, &mut b, &mut c);
        k = &k[12..];
    }
    if k.is_empty() {
        return c;
    }
    a = a.wrapping_add(word(&k[..k.len().min(4)]));
    if k.len() > 4 {
        b = b.wrapping_add(word(&k[4..k.len().min(8)]));
    }
    if k.len() > 8 {
        c = c.wrapping_add(word(&k[8..]));
    }
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(14));
    a ^= c;
    a = a.wrapping_sub(c.rotate_left(11));
    b ^= a;
    b = b.wrapping_sub(a.rotate_left(25));
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(16));
    a ^= c;
    a = a.wrapping_sub(c.rotate_left(4));
    b ^= a;
    b = b.wrapping_sub(a.rotate_left(14));
    c ^= b;
    c.wrapping_sub(b.rotate_left(24))
}

/// A file whose superblock records an end of file short of its last blocks, as a SWMR writer
/// killed mid-append leaves it (its chunks and their index entries written, the superblock not
/// yet rewritten by a flush; seen once in `reopen_after_sigkill_swmr`): the reopen takes the
/// file's real end, appends, and h5py reads every row.
#[test]
fn a_superblock_end_short_of_the_last_blocks_is_extended_at_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("TRAINING_DATASET.H5");
    let h = header(false);
    let mut sink = Hdf5Sink::create(&path, &h, true).unwrap();
    append(&mut sink, &h, 40);
    sink.commit().unwrap();
    Box::new(sink).close().unwrap();

    // Superblock version 2 or 3 at 0: signature, version, two sizes, flags, base address,
    // extension address, end-of-file address (at 28), root group address, checksum (at 44).
    let mut block = [0u8; 48];
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    use std::io::{Read, Seek, Write};
    file.read_exact(&mut block).unwrap();
    assert_eq!(&block[..8], b"\x89HDF\r\n\x1a\n");
    assert!(matches!(block[8], 2 | 3), "superblock version {}", block[8]);
    assert_eq!(
        u32::from_le_bytes(block[44..48].try_into().unwrap()),
        lookup3(&block[..44]),
        "the checksum as HDF5 computes it"
    );
    let end = u64::from_le_bytes(block[28..36].try_into().unwrap());
    assert_eq!(end, file.metadata().unwrap().len());
    let short = end - 64 * 1024;
    block[28..36].copy_from_slice(&short.to_le_bytes());
    let sum = lookup3(&block[..44]);
    block[44..48].copy_from_slice(&sum.to_le_bytes());
    file.rewind().unwrap();
    file.write_all(&block).unwrap();
    drop(file);

    let mut sink = Hdf5Sink::open_append(&path, &h, true, None).unwrap();
    assert_eq!(sink.committed_rows(), 40);
    append(&mut sink, &h, 7);
    sink.commit().unwrap();
    Box::new(sink).close().unwrap();
    if python_ready() {
        py(&["hdf5", path.to_str().unwrap(), "--rows", "47"]);
    }
}
