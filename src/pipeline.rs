//! The stages between a recording's path and its row, shared by `rebuild` and `run`:
//! load (read + hash) -> decode -> place -> featurise. Each file's failure becomes a
//! quarantine reason; nothing here stops a batch because one file is bad.

use crate::config::{FeatureSettings, FeatureShape};
use crate::decode::{self, Waveform};
use crate::features::Featuriser;
use crate::identity::{self, Hash};
use crate::output::RowMeta;
use anyhow::Context;
use half::f16;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Time spent per stage, summed over threads (nanoseconds), for the closing report.
#[derive(Default, Debug)]
pub struct StageTimes {
    pub read: AtomicU64,
    pub hash: AtomicU64,
    pub decode: AtomicU64,
    pub featurise: AtomicU64,
    pub write: AtomicU64,
    pub manifest: AtomicU64,
}

impl StageTimes {
    pub fn add(counter: &AtomicU64, since: Instant) {
        counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
    /// (stage, seconds) in pipeline order.
    pub fn seconds(&self) -> Vec<(&'static str, f64)> {
        let s = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64 * 1e-9;
        vec![
            ("read", s(&self.read)),
            ("hash", s(&self.hash)),
            ("decode", s(&self.decode)),
            ("featurise", s(&self.featurise)),
            ("write", s(&self.write)),
            ("manifest", s(&self.manifest)),
        ]
    }
}

/// A recording read, hashed and decoded (or the reason it cannot be).
pub struct Prepared {
    pub rel: String,
    pub size: u64,
    pub mtime_ns: i64,
    /// None when the file could not be read.
    pub hash: Option<Hash>,
    /// The file was gone when we came to read it (a removal is on its way): not an error.
    pub vanished: bool,
    pub decoded: Result<Waveform, String>,
}

pub fn mtime_ns(meta: &std::fs::Metadata) -> i64 {
    use std::os::unix::fs::MetadataExt;
    meta.mtime() * 1_000_000_000 + meta.mtime_nsec()
}

/// Read, hash and decode one file. Size and mtime are taken from the open file, so they
/// describe the bytes that were hashed.
pub fn prepare(
    root: &Path,
    rel: &str,
    features: &FeatureSettings,
    shape: &FeatureShape,
    times: &StageTimes,
) -> Prepared {
    let t = Instant::now();
    let read = (|| {
        use std::io::Read;
        let mut f = std::fs::File::open(root.join(rel))?;
        let meta = f.metadata()?;
        // Bounded by the size the file had when opened (+1 to notice growth), not by a header.
        let mut bytes = Vec::with_capacity(meta.len() as usize + 1);
        (&mut f).take(meta.len() + 1).read_to_end(&mut bytes)?;
        Ok::<_, std::io::Error>((bytes, meta))
    })();
    StageTimes::add(&times.read, t);
    let (bytes, meta) = match read {
        Ok(x) => x,
        Err(e) => {
            return Prepared {
                rel: rel.to_string(),
                size: 0,
                mtime_ns: 0,
                hash: None,
                vanished: e.kind() == std::io::ErrorKind::NotFound,
                decoded: Err(format!("cannot read: {e}")),
            }
        }
    };
    let t = Instant::now();
    let hash = identity::content_hash(&bytes);
    StageTimes::add(&times.hash, t);
    let t = Instant::now();
    let decoded = if bytes.len() as u64 != meta.len() {
        Err("file changed while being read (still being written?)".to_string())
    } else {
        decode::decode(&bytes, features.sample_rate, shape.num_samples).map_err(|e| e.to_string())
    };
    StageTimes::add(&times.decode, t);
    Prepared {
        rel: rel.to_string(),
        size: bytes.len() as u64,
        mtime_ns: mtime_ns(&meta),
        hash: Some(hash),
        vanished: false,
        decoded,
    }
}

/// Metadata columns of a row.
pub fn row_meta(rel: &str, hash: &Hash, label: i16) -> RowMeta {
    let file_name = rel.rsplit('/').next().unwrap_or(rel);
    let name = identity::parse_name(file_name);
    RowMeta {
        label,
        blake3: *hash,
        source_path: rel.to_string(),
        sensor_id: name.sensor_id,
        recording_id: name.recording_id,
        recorded_at: name.recorded_at,
        gain_db: name.gain_db,
    }
}

/// Rows for `waves`: the float16 features, and the short windows' samples when the outputs
/// store them (`features.store_waveform`).
pub fn featurise_rows(
    featuriser: &mut dyn Featuriser,
    waves: &[&Waveform],
    features: &FeatureSettings,
) -> anyhow::Result<(Vec<f16>, Option<Vec<f32>>)> {
    let shape = featuriser.shape();
    let mut mel = vec![f16::ZERO; waves.len() * shape.row_len()];
    featuriser
        .featurise(waves, &mut mel)
        .with_context(|| format!("featurising on {}", featuriser.name()))?;
    let waveform = features.store_waveform.then(|| {
        let wl = shape.waveform_len();
        let mut w = vec![0f32; waves.len() * wl];
        for (wave, out) in waves.iter().zip(w.chunks_exact_mut(wl)) {
            segment_waveform(wave, features, &shape, out);
        }
        w
    });
    Ok((mel, waveform))
}

/// `segments_waveform` of one recording: the short windows, `[num_long][num_short][short_window]`.
pub fn segment_waveform(
    w: &Waveform,
    features: &FeatureSettings,
    shape: &FeatureShape,
    out: &mut [f32],
) {
    let sw = shape.short_window;
    for l in 0..shape.num_long {
        for s in 0..shape.num_short {
            let start = l * features.long_hop + s * features.short_hop;
            let at = (l * shape.num_short + s) * sw;
            w.copy_to_f32(start, &mut out[at..at + sw]);
        }
    }
}
