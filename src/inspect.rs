//! `ailhd inspect FILE.wav`: decode and featurise one recording with the configured settings,
//! and say what came out (header, levels, feature range, name metadata), optionally as a picture.

use crate::config::{DeviceChoice, Settings};
use crate::decode;
use crate::features;
use crate::identity;
use anyhow::Context;
use half::f16;
use serde::Serialize;
use std::path::Path;

#[derive(Debug, Serialize)]
pub struct Inspection {
    pub file: String,
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

/// Returns the inspection and the row (for the picture).
pub fn inspect(settings: &Settings, file: &Path) -> anyhow::Result<(Inspection, Vec<f16>)> {
    let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let info = decode::parse_header(&bytes).with_context(|| format!("{}", file.display()))?;
    let shape = settings.features.shape();
    let wave = decode::decode(&bytes, settings.features.sample_rate, shape.num_samples)
        .with_context(|| format!("{}", file.display()))?;
    let mut feat = features::build(&settings.features, DeviceChoice::Cpu, 1)?;
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
    let name = identity::parse_name(
        &file
            .file_name()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default(),
    );
    Ok((
        Inspection {
            file: file.display().to_string(),
            bytes: bytes.len() as u64,
            blake3: identity::hex(&identity::content_hash(&bytes)),
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
        row,
    ))
}

pub fn render(i: &Inspection) -> String {
    let gain = match i.gain_db {
        Some(1.0) => "1 dB (hydrophone out of the water)".to_string(),
        Some(g) => format!("{g} dB"),
        None => "-".into(),
    };
    format!(
        "{}\n  {} bytes, blake3 {}\n  {} {} ch, {} Hz, {} bit, {:.3} s; peak {:.4}, rms {:.4}\n  name: sensor {:?}, recording {:?}, recorded_at {}, gain {}\n  features {:?} on {}: {:.2} .. {:.2} dB (mean {:.2})\n",
        i.file, i.bytes, i.blake3, i.format, i.channels, i.sample_rate, i.bits_per_sample, i.duration_sec,
        i.peak, i.rms, i.sensor_id, i.recording_id, i.recorded_at, gain, i.shape, i.featuriser, i.db_min,
        i.db_max, i.db_mean
    )
}

/// A greyscale picture of the row: time (windows, frames) left to right, mel bins bottom to top,
/// each window scaled up so the picture is readable.
pub fn write_png(row: &[f16], shape: [usize; 4], out: &Path) -> anyhow::Result<()> {
    let [nl, ns, nm, nt] = shape;
    let cols = nl * ns * nt;
    let (sx, sy) = (
        (800 / cols.max(1)).clamp(1, 16),
        (256 / nm.max(1)).clamp(1, 8),
    );
    let (w, h) = (cols * sx, nm * sy);
    let vals: Vec<f32> = row.iter().map(|v| v.to_f32()).collect();
    let hi = vals.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lo = (hi - 80.0).max(vals.iter().copied().fold(f32::INFINITY, f32::min));
    let mut img = vec![0u8; w * h];
    for win in 0..nl * ns {
        for m in 0..nm {
            for t in 0..nt {
                let v = vals[(win * nm + m) * nt + t];
                let g = (((v - lo) / (hi - lo).max(1e-6)).clamp(0.0, 1.0) * 255.0) as u8;
                let col = win * nt + t;
                for y in 0..sy {
                    let row_px = h - 1 - (m * sy + y);
                    img[row_px * w + col * sx..row_px * w + (col + 1) * sx].fill(g);
                }
            }
        }
    }
    let file =
        std::fs::File::create(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w as u32, h as u32);
    enc.set_color(png::ColorType::Grayscale);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()?.write_image_data(&img)?;
    Ok(())
}
