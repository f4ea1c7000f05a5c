//! `ailhd inspect FILE.wav`: decode and featurise one recording with the configured settings,
//! and say what came out (header, levels, feature range, name metadata), optionally as a picture.

use crate::config::{DeviceChoice, Settings};
use crate::decode;
use crate::features;
use crate::identity;
use anyhow::Context;
use half::f16;
use std::path::Path;

pub use crate::inspection::Inspection;

/// What `inspect` found, with what the picture needs.
pub struct Inspected {
    pub info: Inspection,
    /// The decoded waveform at `features.sample_rate`, padded or trimmed as featurised.
    pub wave: Vec<f32>,
    /// The row as it is stored, of shape `info.shape`.
    pub row: Vec<f16>,
}

/// The label the file would get: its first folder under `paths.recordings`, or, for a file
/// outside that tree, the name of the folder it is in.
fn label_of(settings: &Settings, file: &Path) -> Option<String> {
    let abs = std::fs::canonicalize(file).ok()?;
    let under = std::fs::canonicalize(&settings.paths.recordings)
        .ok()
        .and_then(|root| abs.strip_prefix(root).ok().map(Path::to_path_buf));
    match under {
        Some(rel) if rel.components().count() >= 2 => rel
            .components()
            .next()
            .map(|c| c.as_os_str().to_string_lossy().into_owned()),
        Some(_) => None,
        None => abs
            .parent()
            .and_then(|p| p.file_name())
            .map(|n| format!("{} (folder; outside paths.recordings)", n.to_string_lossy())),
    }
}

pub fn inspect(settings: &Settings, file: &Path) -> anyhow::Result<Inspected> {
    // One pass in pieces, as the engine reads a large file: memory stays bounded whatever the
    // file's size (a 1.5 GB recording is hashed whole and decoded as far as a row goes).
    let shape = settings.features.shape();
    let read = || -> std::io::Result<decode::Streamed> {
        let f = std::fs::File::open(file)?;
        let len = f.metadata()?.len();
        decode::stream_file(&f, len, settings.features.sample_rate, shape.num_samples)
    };
    let streamed = read().with_context(|| format!("cannot read {}", file.display()))?;
    let (len, hash, info, wave) = match streamed {
        decode::Streamed::BadHeader(e) => {
            return Err(anyhow::Error::new(e).context(format!("{}", file.display())))
        }
        decode::Streamed::Read {
            len,
            hash,
            info,
            wave,
        } => (len, hash, info, wave),
    };
    let wave = wave.with_context(|| format!("{}", file.display()))?;
    let mut feat = features::build(&settings.features, &settings.gpu, DeviceChoice::Cpu, 1)?;
    let mut row = vec![f16::ZERO; shape.row_len()];
    feat.featurise(&[&wave], &mut row)?;
    let n = wave.len().max(1);
    let (mut peak, mut sq) = (0f32, 0f64);
    for i in 0..wave.len() {
        let x = wave.sample(i);
        peak = peak.max(x.abs());
        sq += (x as f64) * (x as f64);
    }
    let vals: Vec<f32> = row.iter().map(|v| v.to_f32()).collect();
    let samples: Vec<f32> = (0..wave.len()).map(|i| wave.sample(i)).collect();
    let name = identity::parse_name(
        &file
            .file_name()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default(),
    );
    Ok(Inspected {
        info: Inspection {
            file: file.display().to_string(),
            label: label_of(settings, file),
            bytes: len,
            blake3: identity::hex(&hash),
            format: format!("{:?}", info.format),
            channels: info.channels,
            sample_rate: info.sample_rate,
            bits_per_sample: info.bits_per_sample,
            duration_sec: info.frames as f64 / info.sample_rate as f64,
            peak,
            rms: (sq / n as f64).sqrt() as f32,
            sensor_id: name.sensor_id,
            recording_id: name.recording_id,
            recorded_at: name.recorded_at,
            gain_db: (!name.gain_db.is_nan()).then_some(name.gain_db),
            shape: shape.row_dims(),
            db_min: vals.iter().copied().fold(f32::INFINITY, f32::min),
            db_max: vals.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            db_mean: vals.iter().sum::<f32>() / vals.len().max(1) as f32,
            featuriser: feat.name(),
        },
        wave: samples,
        row,
    })
}

pub fn render(i: &Inspection) -> String {
    let gain = match i.gain_db {
        Some(1.0) => "1 dB (hydrophone out of the water)".to_string(),
        Some(g) => format!("{g} dB"),
        None => "-".into(),
    };
    format!(
        "{}\n  label {}\n  {} bytes, blake3 {}\n  {} {} ch, {} Hz, {} bit, {:.3} s; peak {:.4}, rms {:.4}\n  name: sensor {:?}, recording {:?}, recorded_at {}, gain {}\n  features {:?} on {}: {:.2} .. {:.2} dB (mean {:.2})\n",
        i.file, i.label.as_deref().unwrap_or("-"), i.bytes, i.blake3, i.format, i.channels, i.sample_rate, i.bits_per_sample, i.duration_sec,
        i.peak, i.rms, i.sensor_id, i.recording_id, i.recorded_at, gain, i.shape, i.featuriser, i.db_min,
        i.db_max, i.db_mean
    )
}

/// Write the picture of an inspected recording (see [`crate::plot::recording`]).
pub fn write_png(settings: &Settings, inspected: &Inspected, out: &Path) -> anyhow::Result<()> {
    crate::plot::recording::write(
        out,
        &inspected.info,
        &settings.features,
        &inspected.wave,
        &inspected.row,
    )
}
