//! `ailhd rebuild` on a tree built from the shared fixtures, checked as users read it: h5py for
//! the HDF5 files, numpy memmaps for the npy columns, `status --json` for the quarantine.

use crate::common::*;
use std::collections::BTreeMap;
use std::path::Path;

/// Lay the fixtures out as an acquisition tree. Returns (valid rows expected: path -> (label,
/// case), invalid fixtures: path -> case).
fn build_tree(rec: &Path) -> (BTreeMap<String, (i16, String)>, BTreeMap<String, String>) {
    let cases = cases();
    let mut valid = BTreeMap::new();
    let mut invalid = BTreeMap::new();
    for (name, case) in cases["cases"].as_object().unwrap() {
        match case["kind"].as_str().unwrap() {
            "valid" => {
                let rel = match name.as_str() {
                    "leak_pcm16" => "LEAK/S001~R123~20250118120530~100.wav".to_string(),
                    "chirp_pcm16" => "CRACK/S002~R7~20240229235959~1.wav".to_string(),
                    _ => format!("LEAK/{name}.wav"),
                };
                let label = if rel.starts_with("CRACK") { 1 } else { 2 };
                copy_fixture(name, &rec.join(&rel));
                valid.insert(rel, (label, name.clone()));
            }
            _ => {
                let rel = format!("NORMAL/{name}.wav");
                copy_fixture(name, &rec.join(&rel));
                invalid.insert(rel, name.clone());
            }
        }
    }
    // Same bytes as LEAK/tone_pcm16.wav (which sorts first): one row, two paths.
    copy_fixture("tone_pcm16", &rec.join("NORMAL/copy_of_tone.wav"));
    // Not in a label folder; in a folder that is not a label.
    copy_fixture("tone_pcm32", &rec.join("stray.wav"));
    copy_fixture("tone_u8", &rec.join("PUMP/tone_u8.wav"));
    // Not a recording at all: ignored.
    std::fs::write(rec.join("LEAK/notes.txt"), "field notes").unwrap();
    (valid, invalid)
}

fn spec(
    world: &World,
    valid: &BTreeMap<String, (i16, String)>,
    setup: &str,
    shape: [usize; 4],
    features: &ailhd::config::FeatureSettings,
) -> std::path::PathBuf {
    let cases = cases();
    let mut rows = serde_json::Map::new();
    for (rel, (label, case)) in valid {
        let bytes = std::fs::read(world.rec().join(rel)).unwrap();
        let name = ailhd::identity::parse_name(rel.rsplit('/').next().unwrap());
        let tolerance = cases["cases"][case]["tolerance"].as_str().unwrap();
        rows.insert(
            rel.clone(),
            serde_json::json!({
                "label": label,
                "case": case,
                "tolerance": if tolerance.starts_with("resampled") { "resampled" } else { "f16ulp" },
                "blake3": ailhd::identity::hex(&ailhd::identity::content_hash(&bytes)),
                "sensor_id": name.sensor_id,
                "recording_id": name.recording_id,
                "recorded_at": name.recorded_at,
                "gain_db": if name.gain_db.is_nan() { None } else { Some(name.gain_db) },
            }),
        );
    }
    let spec = serde_json::json!({
        "output": world.out(),
        "hdf5_names": ["TRAINING_DATASET.H5", "VALIDATION_DATASET.H5", "TESTING_DATASET.H5"],
        "labels": ["BACKGROUND", "CRACK", "LEAK", "NORMAL", "UNCLASSIFIED"],
        "shape": shape,
        "path_bytes": 256,
        "expected_dir": fixtures().join("expected").join(setup),
        "rows": rows,
        "fingerprint": features.fingerprint(),
    });
    let path = world.dir.path().join("spec.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    path
}

/// Words that must appear in the quarantine reason of each invalid fixture (any of them).
fn reason_words(case: &str) -> &'static [&'static str] {
    match case {
        "truncated" => &["truncated"],
        "empty" => &["empty", "0 bytes"],
        "not_a_wav" => &["not a wav", "riff"],
        "zero_channels" => &["0 channels", "zero channels"],
        "recording_in_progress" => &["in progress"],
        "no_data_chunk" => &["no data chunk", "data chunk"],
        "alaw" => &["a-law", "unsupported"],
        "huge_fmt" => &["fmt"],
        other => panic!("no expectation for invalid case {other}"),
    }
}

fn rebuild_and_check(setup: &str, extra: &str, features: ailhd::config::FeatureSettings) {
    let world = World::new(extra);
    let (valid, invalid) = build_tree(&world.rec());
    let out = ok(&world.run(&["rebuild", "--device", "cpu"]));
    assert!(out.contains("duplicates (same bytes, one row): 1"), "{out}");
    let shape = features.shape().row_dims();
    let spec = spec(&world, &valid, setup, shape, &features);
    println!("{}", python("check_outputs.py", &[spec.to_str().unwrap()]));

    let status = world.status_json();
    let q: BTreeMap<String, String> = status["quarantined"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| {
            (
                q["path"].as_str().unwrap().to_string(),
                q["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for (rel, case) in &invalid {
        let reason = q
            .get(rel)
            .unwrap_or_else(|| panic!("{rel} ({case}) not quarantined: {q:?}"))
            .to_lowercase();
        assert!(
            reason_words(case).iter().any(|w| reason.contains(w)),
            "{rel}: reason {reason:?} does not say what is wrong"
        );
    }
    assert!(q["stray.wav"].contains("label folder"), "{q:?}");
    assert!(q["PUMP/tone_u8.wav"].contains("PUMP"), "{q:?}");
    assert_eq!(q.len(), invalid.len() + 2, "{q:?}");
    let committed = status["files"]["committed"].as_u64().unwrap();
    assert_eq!(
        committed as usize,
        valid.len() + 1,
        "valid files plus the duplicate"
    );
    let rows: u64 = ["training", "validation", "testing"]
        .iter()
        .map(|s| status["splits"][s]["rows"].as_u64().unwrap())
        .sum();
    assert_eq!(rows as usize, valid.len());
}

#[test]
fn default_setup_matches_references_and_quarantines_invalid_files() {
    rebuild_and_check("default", "", ailhd::config::FeatureSettings::default());
}

#[test]
fn overlap32_setup_matches_references() {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("config/overlap32.toml"),
    )
    .unwrap();
    rebuild_and_check(
        "overlap32",
        &text,
        ailhd::config::FeatureSettings::overlap32(),
    );
}
