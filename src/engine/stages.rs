//! The work of the stages around the ledger: load (read, hash, decode a complete file) and
//! featurise (waveforms to rows), with the time each takes. Each file's failure becomes an
//! outcome of that file; nothing here stops a batch because one file is bad.

use crate::config::{FeatureSettings, FeatureShape};
use crate::decode::{self, Waveform};
use crate::engine::outcome::{Load, Loaded, Observation, Reason};
use crate::features::Featuriser;
use crate::identity;
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
    pub decide: AtomicU64,
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
            ("decide", s(&self.decide)),
            ("featurise", s(&self.featurise)),
            ("write", s(&self.write)),
            ("manifest", s(&self.manifest)),
        ]
    }
}

pub fn mtime_ns(meta: &std::fs::Metadata) -> i64 {
    use std::os::unix::fs::MetadataExt;
    meta.mtime() * 1_000_000_000 + meta.mtime_nsec()
}

thread_local! {
    /// Each loader thread reads into the same buffer file after file (no fresh pages per file).
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The load stage for one complete file: read, hash, decode. Size and mtime are taken from the
/// open file, so they describe the bytes that were hashed. Never fails: every problem is an
/// outcome of this file.
pub fn load(
    root: &Path,
    rel: &str,
    seen: Option<Instant>,
    features: &FeatureSettings,
    shape: &FeatureShape,
    times: &StageTimes,
    shard: crate::shard::Shard,
) -> Observation {
    let load = READ_BUF
        .with_borrow_mut(|bytes| load_into(root, rel, features, shape, times, shard, bytes));
    Observation::Loaded(Loaded {
        rel: rel.to_string(),
        seen,
        load,
    })
}

fn load_into(
    root: &Path,
    rel: &str,
    features: &FeatureSettings,
    shape: &FeatureShape,
    times: &StageTimes,
    shard: crate::shard::Shard,
    bytes: &mut Vec<u8>,
) -> Load {
    let t = Instant::now();
    let read = (|| {
        use std::io::Read;
        let mut f = std::fs::File::open(root.join(rel))?;
        let meta = f.metadata()?;
        bytes.clear();
        // Bounded by the size the file had when opened (+1 to notice growth), not by a header.
        (&mut f).take(meta.len() + 1).read_to_end(bytes)?;
        Ok::<_, std::io::Error>(meta)
    })();
    StageTimes::add(&times.read, t);
    let meta = match read {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Load::Vanished,
        Err(e) => return Load::Unreadable(e.to_string()),
    };
    let t = Instant::now();
    let hash = identity::content_hash(bytes);
    StageTimes::add(&times.hash, t);
    if !shard.contains(&hash) {
        return Load::OtherShard;
    }
    let t = Instant::now();
    let decoded = if bytes.len() as u64 != meta.len() {
        Err(Reason::ChangedWhileRead)
    } else {
        decode::decode(bytes, features.sample_rate, shape.num_samples).map_err(Reason::Decode)
    };
    StageTimes::add(&times.decode, t);
    Load::Read {
        size: bytes.len() as u64,
        mtime_ns: mtime_ns(&meta),
        hash,
        decoded,
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
    // Test builds (feature `failpoints`): FAILPOINTS='featurise=N*return(why)' makes the next
    // N batches fail here as a failing featuriser would (tests/faults.rs).
    fail::fail_point!("featurise", |why| Err(anyhow::anyhow!(
        "fail point: {}",
        why.unwrap_or_default()
    ))
    .with_context(|| format!("featurising on {}", featuriser.name())));
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
