//! Write: rows -> the per-split outputs (CONTRACT.md, "Outputs"): one HDF5 file per split
//! ([`hdf5`]) and `npy/<split>/` column files ([`npy`]). Both implement [`SplitSink`]; a
//! [`SplitOutputs`] drives the enabled ones together so they always hold the same rows.

pub mod hdf5;
pub mod npy;
pub mod set;

use crate::config::{FeatureSettings, FeatureShape};
use half::f16;
use std::path::{Path, PathBuf};

/// Version of the on-disk output layout (`schema_version` attribute, npy `layout.json`).
/// See `migrations/`.
pub const OUTPUT_SCHEMA_VERSION: u32 = 1;

/// Width of the `sensor_id` and `recording_id` strings.
pub const ID_BYTES: usize = 32;

/// Everything about a row except its features.
#[derive(Debug, Clone, PartialEq)]
pub struct RowMeta {
    pub label: i16,
    pub blake3: [u8; 32],
    /// Relative to `paths.recordings`; at most `outputs.path_bytes` bytes (checked upstream).
    pub source_path: String,
    pub sensor_id: String,
    pub recording_id: String,
    /// Unix seconds UTC, -1 when absent.
    pub recorded_at: i64,
    /// NaN when absent.
    pub gain_db: f32,
}

/// What a new output file records about how it was made (file attributes in HDF5,
/// `attributes.json` beside the npy columns).
#[derive(Debug, Clone)]
pub struct OutputHeader {
    pub labels: Vec<String>,
    pub features: FeatureSettings,
    pub path_bytes: usize,
}

impl OutputHeader {
    pub fn shape(&self) -> FeatureShape {
        self.features.shape()
    }
    pub fn labels_json(&self) -> String {
        serde_json::to_string(&self.labels).unwrap()
    }
    pub fn label2id_json(&self) -> String {
        let map: serde_json::Map<String, serde_json::Value> = self
            .labels
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), serde_json::Value::from(i)))
            .collect();
        serde_json::Value::Object(map).to_string()
    }
}

/// One split's storage. Rows are appended, then made visible by [`SplitSink::commit`], which
/// advances `committed_rows` only after the data below it is written. Rows never move.
pub trait SplitSink: Send {
    /// Rows appended so far (committed or not).
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Rows below this index are complete on disk.
    fn committed_rows(&self) -> u64;
    /// Append rows: `mel` holds `meta.len() * row_len` values; `waveform` (when the outputs
    /// store it) `meta.len() * waveform_len`. Returns the index of the first new row.
    fn append(
        &mut self,
        mel: &[f16],
        waveform: Option<&[f32]>,
        meta: &[RowMeta],
    ) -> anyhow::Result<u64>;
    /// Mark a row current (1) or superseded/deleted (0).
    fn set_valid(&mut self, row: u64, valid: bool) -> anyhow::Result<()>;
    /// Relabel a row in place (a file moved between label folders).
    fn set_label(&mut self, row: u64, label: i16) -> anyhow::Result<()>;
    /// Make every appended row durable and visible: flush data, then `committed_rows`.
    fn commit(&mut self) -> anyhow::Result<()>;
    /// Close cleanly (after this, plain readers see exactly `committed_rows` rows).
    fn close(self: Box<Self>) -> anyhow::Result<()>;
}

/// Where split `split` (0..3) of each kind lives under an output directory.
pub fn hdf5_path(output: &Path, names: &crate::config::HdfNames, split: usize) -> PathBuf {
    output.join(names.for_split(split))
}

pub fn npy_dir(output: &Path, split: usize) -> PathBuf {
    output.join("npy").join(crate::config::SPLITS[split])
}
