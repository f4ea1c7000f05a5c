//! The picture of one recording (`ailhd inspect FILE.wav --png OUT.png`), top to bottom:
//!
//! - a title: the path, label, sensor, recording id, time and gain from the file name, and a
//!   red banner and frame when the gain is 1 dB (the hydrophone was out of the water);
//! - the decoded waveform (min/max envelope per pixel column);
//! - a spectrogram of the waveform (Hann-windowed STFT, dB re full scale), time and frequency
//!   axes and a colour bar;
//! - the stored features: the row exactly as it is written to the outputs, one column per
//!   short-window frame, laid out by the long window's start time so that it lines up with the
//!   two panels above, mel bins bottom to top, with its own colour bar.

use super::{draw_heatmap, draw_lines, err, Area, Heatmap, FONT, OUT_OF_WATER};
use crate::config::FeatureSettings;
use crate::inspection::Inspection;
use anyhow::Result;
use half::f16;
use plotters::prelude::*;
use std::path::Path;

pub const WIDTH: u32 = 1400;
pub const HEIGHT: u32 = 1100;
const HEADER: u32 = 130;
/// Width of the colour-bar column on the right of the heatmaps (kept empty beside the
/// waveform so the three time axes line up).
const BAR: u32 = 110;

/// Write the picture of a recording: `wave` is the decoded waveform at
/// `features.sample_rate`, `row` the stored features of shape `info.shape`.
pub fn write(
    out: &Path,
    info: &Inspection,
    features: &FeatureSettings,
    wave: &[f32],
    row: &[f16],
) -> Result<()> {
    super::draw_to_file(out, (WIDTH, HEIGHT), |root| {
        root.fill(&WHITE).map_err(err("background"))?;
        let (header, rest) = root.split_vertically(HEADER);
        let (wave_area, rest) = rest.split_vertically(210);
        let (spec_area, mel_area) = rest.split_vertically((HEIGHT - HEADER - 210) / 2);
        draw_header(&header, info)?;
        draw_waveform(&wave_area, wave, features.sample_rate)?;
        draw_spectrogram(&spec_area, wave, features.sample_rate)?;
        draw_features(&mel_area, row, info.shape, features)?;
        if info.gain_db == Some(1.0) {
            // A frame round the whole picture: out-of-water recordings must not pass unnoticed.
            for i in 0..6 {
                root.draw(&Rectangle::new(
                    [(i, i), (WIDTH as i32 - 1 - i, HEIGHT as i32 - 1 - i)],
                    OUT_OF_WATER.stroke_width(1),
                ))
                .map_err(err("frame"))?;
            }
        }
        Ok(())
    })
}

fn draw_header(area: &Area, i: &Inspection) -> Result<()> {
    let grey = RGBColor(80, 80, 80);
    let gain = match i.gain_db {
        Some(g) => format!("{g} dB"),
        None => "- (not in the file name)".into(),
    };
    let or_dash = |s: &str| {
        if s.is_empty() {
            "-".to_string()
        } else {
            s.to_string()
        }
    };
    let mut lines = vec![
        (shorten(&i.file, 110), 22, BLACK),
        (
            format!(
                "label {}   ·   sensor {}   ·   recording {}   ·   recorded {}   ·   gain {}",
                i.label.as_deref().unwrap_or("-"),
                or_dash(&i.sensor_id),
                or_dash(&i.recording_id),
                super::utc(i.recorded_at),
                gain
            ),
            18,
            BLACK,
        ),
    ];
    if i.gain_db == Some(1.0) {
        lines.push((
            "OUT OF WATER: gain 1 dB means the hydrophone was not in the water".into(),
            18,
            OUT_OF_WATER,
        ));
    }
    lines.push((
        format!(
            "{} {} ch, {} Hz, {} bit, {:.3} s   ·   peak {:.4}, rms {:.4}   ·   features {:?} on {}: {:.1} .. {:.1} dB   ·   blake3 {}…",
            i.format,
            i.channels,
            i.sample_rate,
            i.bits_per_sample,
            i.duration_sec,
            i.peak,
            i.rms,
            i.shape,
            i.featuriser,
            i.db_min,
            i.db_max,
            &i.blake3[..i.blake3.len().min(16)]
        ),
        14,
        grey,
    ));
    draw_lines(area, &lines)
}

/// The end of a long path, which is the part that tells files apart.
fn shorten(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        s.to_string()
    } else {
        format!("…{}", s.chars().skip(n - max + 1).collect::<String>())
    }
}

fn draw_waveform(area: &Area, wave: &[f32], sample_rate: u32) -> Result<()> {
    let (w, _) = area.dim_in_pixel();
    let (main, _) = area.split_horizontally(w - BAR);
    let secs = wave.len() as f64 / sample_rate as f64;
    let peak = wave.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-4) as f64 * 1.05;
    let mut chart = ChartBuilder::on(&main)
        .caption(
            format!("waveform (decoded, mono, {sample_rate} Hz)"),
            (FONT, 18),
        )
        .margin(6)
        .x_label_area_size(42)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..secs.max(1e-3), -peak..peak)
        .map_err(err("waveform axes"))?;
    chart
        .configure_mesh()
        .x_desc("time, s")
        .y_desc("amplitude")
        .y_labels(7)
        .y_label_formatter(&|v| {
            // As many decimals as the tick step needs; no "-0.00".
            let decimals = (-(peak / 3.0).log10().floor()).clamp(0.0, 8.0) as usize;
            let text = format!("{v:.decimals$}");
            if text
                .trim_start_matches('-')
                .trim_matches(['0', '.'])
                .is_empty()
            {
                "0".to_string()
            } else {
                text
            }
        })
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .light_line_style(WHITE)
        .draw()
        .map_err(err("waveform axes"))?;
    // One vertical stroke per pixel column, from the column's minimum to its maximum.
    let columns = (w - BAR).max(1) as usize;
    let per = wave.len().div_ceil(columns).max(1);
    let blue = RGBColor(31, 119, 180);
    chart
        .draw_series(wave.chunks(per).enumerate().map(|(k, c)| {
            let lo = c.iter().copied().fold(f32::INFINITY, f32::min) as f64;
            let hi = c.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let t = (k * per) as f64 / sample_rate as f64;
            PathElement::new(vec![(t, lo), (t, hi)], blue)
        }))
        .map_err(err("waveform"))?;
    Ok(())
}

/// Hann-windowed short-time Fourier transform, in dB re a full-scale sine. Returns the
/// values (`[frame][bin]`), the FFT length and the hop.
pub fn spectrogram(wave: &[f32], sample_rate: u32) -> (Vec<f32>, usize, usize) {
    // About 16 Hz per bin at 4096 Hz; a quarter-window hop.
    let n_fft = ((sample_rate / 16) as usize)
        .next_power_of_two()
        .clamp(64, 8192);
    let hop = n_fft / 4;
    let bins = n_fft / 2 + 1;
    let window: Vec<f64> = (0..n_fft)
        .map(|i| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / n_fft as f64).cos())
        .collect();
    let gain = window.iter().sum::<f64>() / 2.0;
    let mut planner = realfft::RealFftPlanner::<f64>::new();
    let fft = planner.plan_fft_forward(n_fft);
    let mut input = fft.make_input_vec();
    let mut spectrum = fft.make_output_vec();
    let frames = if wave.len() >= n_fft {
        1 + (wave.len() - n_fft) / hop
    } else {
        0
    };
    let mut out = Vec::with_capacity(frames * bins);
    for f in 0..frames {
        for (i, x) in input.iter_mut().enumerate() {
            *x = wave[f * hop + i] as f64 * window[i];
        }
        fft.process(&mut input, &mut spectrum)
            .expect("buffers made by the planner");
        out.extend(
            spectrum
                .iter()
                .map(|c| (20.0 * (c.norm() / gain).max(1e-12).log10()) as f32),
        );
    }
    (out, n_fft, hop)
}

fn draw_spectrogram(area: &Area, wave: &[f32], sample_rate: u32) -> Result<()> {
    let (values, n_fft, hop) = spectrogram(wave, sample_rate);
    let bins = n_fft / 2 + 1;
    let frames = values.len() / bins;
    let hi = values.iter().copied().fold(-240f32, f32::max);
    // At most 100 dB of range; a flat (or empty) spectrogram still gets a 1 dB scale.
    let lo = values
        .iter()
        .copied()
        .fold(f32::INFINITY, f32::min)
        .max(hi - 100.0)
        .min(hi - 1.0);
    let sr = sample_rate as f64;
    let bin_hz = sr / n_fft as f64;
    draw_heatmap(
        area,
        &Heatmap {
            caption: format!(
                "spectrogram (Hann window {n_fft}, hop {hop}: {:.1} Hz × {:.0} ms cells)",
                bin_hz,
                hop as f64 / sr * 1e3
            ),
            values: &values,
            cols: frames,
            rows: bins,
            // Each frame one hop wide, centred on its window's centre; each bin centred on its
            // frequency; the axis spans the whole waveform, as the panels above and below.
            x: (
                (n_fft - hop) as f64 / 2.0 / sr,
                ((n_fft - hop) as f64 / 2.0 + (frames * hop) as f64) / sr,
            ),
            x_axis: Some((0.0, wave.len() as f64 / sr)),
            y: (-bin_hz / 2.0, bins as f64 * bin_hz - bin_hz / 2.0),
            x_desc: "time, s".into(),
            y_desc: "frequency, Hz".into(),
            lo,
            hi,
            unit: "dB re full scale",
        },
    )
}

fn draw_features(area: &Area, row: &[f16], shape: [usize; 4], f: &FeatureSettings) -> Result<()> {
    let [nl, ns, nm, nt] = shape;
    let per_long = ns * nt;
    let cols = nl * per_long;
    // Stored layout [long][short][mel][frame] -> columns (long, short, frame), rows mel.
    let mut values = vec![0f32; cols * nm];
    for l in 0..nl {
        for s in 0..ns {
            for m in 0..nm {
                for t in 0..nt {
                    let v = row[((l * ns + s) * nm + m) * nt + t].to_f32();
                    values[((l * ns + s) * nt + t) * nm + m] = v;
                }
            }
        }
    }
    let finite = values.iter().copied().filter(|v| v.is_finite());
    let hi = finite.clone().fold(f32::NEG_INFINITY, f32::max);
    let lo = finite
        .fold(f32::INFINITY, f32::min)
        .max(hi - 100.0)
        .min(hi - 1.0);
    let (hi, lo) = if hi.is_finite() {
        (hi, lo)
    } else {
        (0.0, -1.0)
    };
    let step = f.long_hop as f64 / f.sample_rate as f64;
    let f_max = f.f_max.unwrap_or(f.sample_rate as f64 / 2.0);
    draw_heatmap(
        area,
        &Heatmap {
            caption: format!(
                "stored features {shape:?}: {nl} long windows × {ns} short windows × {nt} frame(s), {nm} mel bands"
            ),
            values: &values,
            cols,
            rows: nm,
            x: (0.0, nl as f64 * step),
            x_axis: Some((0.0, (nl as f64 * step).max(f.duration_sec))),
            y: (0.0, nm as f64),
            x_desc: format!(
                "long window start, s (every {} ms; each split into {ns} short windows)",
                (step * 1e3).round()
            ),
            y_desc: format!("mel band ({:.0}-{:.0} Hz)", f.f_min, f_max),
            lo,
            hi,
            unit: "stored value, dB",
        },
    )
}
