//! The engine driven end to end, as the service drives it, against `rebuild`: random histories
//! of a tree (files written, overwritten, copied, deleted) ingested in random batch sizes into
//! live outputs must end with the same rows, column by column, as a `rebuild` of the final
//! tree. Rows are compared by content (positions may differ). Real files, the CPU featuriser,
//! real HDF5, npy and sled.

use super::outcome::Observation;
use super::{Engine, Input};
use crate::config::{DeviceChoice, Settings};
use crate::output::npy::descr;
use crate::output::npy::read_rows;
use crate::output::{ColumnType, ID_BYTES};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

const PATHS: usize = 10;
const CONTENTS: usize = 4;

fn rel(i: usize) -> String {
    let folder = ["LEAK", "NORMAL", "CRACK"][i % 3];
    format!("{folder}/{}", crate::synth::file_name(i, 3))
}

/// Valid rows by content hash: (source_path, label, split, recording_id, features).
type Rows = BTreeMap<Vec<u8>, (String, Vec<u8>, usize, Vec<u8>, Vec<u8>)>;

fn valid_rows(out: &Path, path_bytes: usize) -> Rows {
    let mut rows = Rows::new();
    for split in 0..3 {
        let dir = crate::output::npy_dir(out, split);
        if !dir.join("attributes.json").exists() {
            continue;
        }
        let col = |name: &str, t: ColumnType| read_rows(&dir, name, &descr(t)).unwrap();
        let (hw, hash) = col("blake3", ColumnType::U8);
        let (pw, paths) = col("source_path", ColumnType::Str(path_bytes));
        let (lw, labels) = col("labels", ColumnType::I16);
        let (_, valid) = col("valid", ColumnType::U8);
        let (iw, ids) = col("recording_id", ColumnType::Str(ID_BYTES));
        let (mw, mel) = col("segments_mel", ColumnType::F16);
        for (r, v) in valid.iter().enumerate() {
            if *v == 0 {
                continue;
            }
            let path = String::from_utf8_lossy(&paths[r * pw..(r + 1) * pw])
                .trim_end_matches('\0')
                .to_string();
            let row = (
                path,
                labels[r * lw..(r + 1) * lw].to_vec(),
                split,
                ids[r * iw..(r + 1) * iw].to_vec(),
                mel[r * mw..(r + 1) * mw].to_vec(),
            );
            let prev = rows.insert(hash[r * hw..(r + 1) * hw].to_vec(), row);
            assert!(prev.is_none(), "two valid rows for one content");
        }
    }
    rows
}

fn settings(dir: &Path, name: &str) -> Settings {
    let mut s = Settings::default();
    s.paths.recordings = dir.join("rec");
    s.paths.output = dir.join(name).join("out");
    s.paths.state = dir.join(name).join("state");
    s.ingest.workers = 1;
    s
}

/// Apply `history` (path, content or None for a delete) to the tree, handing each step to a
/// live engine in batches of the given sizes, the way the service hands over settled files.
fn service(dir: &Path, contents: &[Vec<u8>], history: &[(usize, Option<usize>)], sizes: &[usize]) {
    let s = settings(dir, "live");
    let root = &s.paths.recordings;
    std::fs::create_dir_all(root).unwrap();
    let mut engine = Engine::open_live(&s, DeviceChoice::Cpu).unwrap();
    let mut steps = history.iter();
    for &size in sizes.iter().cycle() {
        let mut inputs = Vec::new();
        for &(p, c) in steps.by_ref().take(size) {
            let path = root.join(rel(p));
            match c {
                Some(c) => {
                    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                    std::fs::write(&path, &contents[c]).unwrap();
                    inputs.push(Input::Load {
                        rel: rel(p),
                        seen: None,
                    });
                }
                None if path.exists() => {
                    std::fs::remove_file(&path).unwrap();
                    inputs.push(Input::Observe(Observation::Gone(rel(p))));
                }
                None => {}
            }
        }
        if inputs.is_empty() && steps.len() == 0 {
            break;
        }
        // Batches are not waited for one by one: the next is decided while earlier ones are
        // featurised and committed, as in the service.
        engine.submit(inputs).unwrap();
        let reread: Vec<String> = engine
            .completed()
            .unwrap()
            .into_iter()
            .flat_map(|d| d.reread)
            .collect();
        if !reread.is_empty() {
            load_again(&mut engine, reread);
        }
    }
    load_again(&mut engine, Vec::new());
    engine.finish().unwrap();
}

/// Wait for everything submitted, loading again the paths the engine asks to read again (as
/// the service does), until none is left.
fn load_again(engine: &mut Engine, mut reread: Vec<String>) {
    loop {
        reread.extend(engine.wait().unwrap().into_iter().flat_map(|d| d.reread));
        if reread.is_empty() {
            return;
        }
        let inputs = reread
            .drain(..)
            .map(|rel| Input::Load { rel, seen: None })
            .collect();
        engine.submit(inputs).unwrap();
    }
}

fn history() -> impl Strategy<Value = (Vec<(usize, Option<usize>)>, Vec<usize>)> {
    (
        proptest::collection::vec(
            (0..PATHS, proptest::option::weighted(0.75, 0..CONTENTS)),
            1..24,
        ),
        proptest::collection::vec(1usize..6, 1..6),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn the_service_ends_with_the_rows_rebuild_makes_of_the_final_tree((history, sizes) in history()) {
        let dir = tempfile::tempdir().unwrap();
        // The last content is not a WAV file: the paths holding it are quarantined.
        let contents: Vec<Vec<u8>> = (0..CONTENTS)
            .map(|c| match c {
                c if c + 1 == CONTENTS => b"not a recording".to_vec(),
                c => crate::synth::wav_pcm16(
                    &crate::synth::clip("LEAK", 7 + c as u64, 4096, 10.0),
                    4096,
                ),
            })
            .collect();
        service(dir.path(), &contents, &history, &sizes);
        let bulk = settings(dir.path(), "bulk");
        crate::rebuild::rebuild(&bulk, DeviceChoice::Cpu, &crate::rebuild::Ui { progress: false })
            .unwrap();
        let path_bytes = bulk.outputs.path_bytes;
        let live = valid_rows(&settings(dir.path(), "live").paths.output, path_bytes);
        let rebuilt = valid_rows(&bulk.paths.output, path_bytes);
        prop_assert_eq!(live.len(), rebuilt.len(), "valid rows");
        for (hash, want) in &rebuilt {
            let got = live.get(hash);
            prop_assert!(got.is_some(), "content of {} has no valid row in the service's outputs", want.0);
            let got = got.unwrap();
            prop_assert_eq!(&got.0, &want.0, "source_path");
            prop_assert_eq!(&got.1, &want.1, "label of {}", want.0);
            prop_assert_eq!(got.2, want.2, "split of {}", want.0);
            prop_assert_eq!(&got.3, &want.3, "recording_id of {}", want.0);
            prop_assert!(got.4 == want.4, "features of {}", want.0);
        }
        for name in ["live", "bulk"] {
            summary_agrees_with_a_full_count(&settings(dir.path(), name));
        }
    }
}

/// The summary `status` reads, kept by every apply, equals a count of every record, and the
/// derived trees hold exactly the quarantined paths and the contents several paths hold.
fn summary_agrees_with_a_full_count(s: &Settings) {
    let m = crate::engine::manifest::Manifest::open(&crate::staging::manifest_dir(s)).unwrap();
    let full = crate::engine::manifest::Summary::count(&m).unwrap();
    assert_eq!(m.summary(), full, "{}", s.paths.state.display());
    let quarantined: Vec<(String, String)> = m
        .files()
        .map(Result::unwrap)
        .filter_map(|(p, f)| f.quarantine.map(|q| (p, q.text)))
        .collect();
    assert_eq!(
        m.quarantined().map(Result::unwrap).collect::<Vec<_>>(),
        quarantined
    );
    let shared: Vec<_> = m
        .contents()
        .map(Result::unwrap)
        .filter(|(_, c)| c.paths.len() > 1)
        .map(|(h, _)| h)
        .collect();
    assert_eq!(
        m.shared_contents()
            .map(|r| r.unwrap().0)
            .collect::<Vec<_>>(),
        shared
    );
}
