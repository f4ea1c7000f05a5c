//! Shared by tests/output_hdf5.rs and tests/output_npy.rs: the rows the tests write (mirrored
//! by `expected_*` in tests/py/ailhd_check.py) and the way they run the Python reader checks.
#![allow(dead_code)]

use ailhd::config::FeatureSettings;
use ailhd::output::{OutputHeader, RowMeta};
use half::f16;
use std::path::Path;
use std::process::Command;

pub const BASE_LABELS: [&str; 5] = ["BACKGROUND", "CRACK", "LEAK", "NORMAL", "UNCLASSIFIED"];

pub fn header(store_waveform: bool) -> OutputHeader {
    let features = FeatureSettings {
        store_waveform,
        ..FeatureSettings::default()
    };
    OutputHeader {
        labels: BASE_LABELS.iter().map(|s| s.to_string()).collect(),
        features,
        path_bytes: 256,
    }
}

pub struct Rows {
    pub mel: Vec<f16>,
    pub waveform: Option<Vec<f32>>,
    pub meta: Vec<RowMeta>,
}

/// Rows `first..first + n`: every value a function of the row index, so a reader can tell a
/// complete row from a torn or misplaced one.
pub fn rows(header: &OutputHeader, first: u64, n: usize) -> Rows {
    let shape = header.shape();
    let row_len = shape.row_len();
    let mut mel = Vec::with_capacity(n * row_len);
    let mut waveform = header
        .features
        .store_waveform
        .then(|| Vec::with_capacity(n * shape.waveform_len()));
    let mut meta = Vec::with_capacity(n);
    for i in first..first + n as u64 {
        mel.extend(
            (0..row_len as u64).map(|j| f16::from_f32(((i * 7 + j) % 1000) as f32 * 0.25 - 50.0)),
        );
        if let Some(w) = waveform.as_mut() {
            w.extend(
                (0..shape.waveform_len() as u64)
                    .map(|j| (((i * 3 + j) % 100) as f64 / 100.0) as f32),
            );
        }
        let absent = i % 3 == 0;
        meta.push(RowMeta {
            label: (i % 5) as i16,
            blake3: std::array::from_fn(|k| ((i + k as u64) % 256) as u8),
            source_path: format!("LEAK/Ünïcødé €-{i}.wav"),
            sensor_id: if absent {
                String::new()
            } else {
                format!("S{i:03}ü")
            },
            recording_id: if absent {
                String::new()
            } else {
                format!("R{i}")
            },
            recorded_at: if absent { -1 } else { 1_700_000_000 + i as i64 },
            gain_db: if absent { f32::NAN } else { i as f32 * 0.5 },
        });
    }
    Rows {
        mel,
        waveform,
        meta,
    }
}

/// Whether python3 with numpy and h5py is here; if not, says the test is skipped.
pub fn python_ready() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import h5py, numpy"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("SKIPPED: python3 with numpy and h5py is not available");
    }
    ok
}

pub fn checker() -> Command {
    let mut c = Command::new("python3");
    c.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/ailhd_check.py"));
    c
}

/// Run the checker to completion; panic with its output unless it succeeds; return its JSON.
pub fn py(args: &[&str]) -> serde_json::Value {
    let out = checker().args(args).output().expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ailhd_check.py {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}
