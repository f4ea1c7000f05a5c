//! What `ailhd inspect` found in one recording: the report [`crate::inspect`] makes, prints
//! and serialises, and [`crate::plot::recording`] draws. Data only, below both.

use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct Inspection {
    pub file: String,
    /// First folder under `paths.recordings` (the label), or the folder's name with a note
    /// when the file is outside the tree.
    pub label: Option<String>,
    pub bytes: u64,
    pub blake3: String,
    pub format: String,
    pub channels: u16,
    pub sample_rate: u32,
    pub bits_per_sample: u16,
    pub duration_sec: f64,
    pub peak: f32,
    pub rms: f32,
    pub sensor_id: String,
    pub recording_id: String,
    pub recorded_at: i64,
    pub gain_db: Option<f32>,
    pub shape: [usize; 4],
    pub db_min: f32,
    pub db_max: f32,
    pub db_mean: f32,
    pub featuriser: String,
}
