//! Synthetic recordings that sound different per label, for `demo`, the benchmarks and the
//! tests: deterministic (seeded), 16-bit mono WAVs named by the acquisition convention.

use std::path::{Path, PathBuf};

/// A small, fast, seedable generator (splitmix64): the demo must be the same on every host.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// 16-bit PCM mono WAV bytes.
pub fn wav_pcm16(samples: &[i16], sample_rate: u32) -> Vec<u8> {
    let data_len = (samples.len() * 2) as u32;
    let mut b = Vec::with_capacity(44 + data_len as usize);
    b.extend_from_slice(b"RIFF");
    b.extend_from_slice(&(36 + data_len).to_le_bytes());
    b.extend_from_slice(b"WAVEfmt ");
    b.extend_from_slice(&16u32.to_le_bytes());
    b.extend_from_slice(&1u16.to_le_bytes()); // PCM
    b.extend_from_slice(&1u16.to_le_bytes()); // mono
    b.extend_from_slice(&sample_rate.to_le_bytes());
    b.extend_from_slice(&(sample_rate * 2).to_le_bytes());
    b.extend_from_slice(&2u16.to_le_bytes());
    b.extend_from_slice(&16u16.to_le_bytes());
    b.extend_from_slice(b"data");
    b.extend_from_slice(&data_len.to_le_bytes());
    for s in samples {
        b.extend_from_slice(&s.to_le_bytes());
    }
    b
}

/// One clip of `label`'s character: leaks hiss (broadband, loud), normal pipes hum, cracks
/// click, background is faint noise, anything else sweeps.
pub fn clip(label: &str, seed: u64, sample_rate: u32, seconds: f64) -> Vec<i16> {
    let n = (sample_rate as f64 * seconds).round() as usize;
    let mut rng = Rng::new(seed);
    let sr = sample_rate as f32;
    let f0 = 80.0 + (rng.next_u64() % 400) as f32;
    let phase = rng.uniform() * std::f32::consts::PI;
    let mut lp = 0f32;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let t = i as f32 / sr;
        let noise = rng.uniform();
        let x = match label {
            "LEAK" => {
                lp = 0.7 * lp + 0.3 * noise;
                0.25 * lp + 0.05 * (2.0 * std::f32::consts::PI * (f0 * 3.0) * t + phase).sin()
            }
            "NORMAL" => {
                0.1 * (2.0 * std::f32::consts::PI * 50.0 * t + phase).sin()
                    + 0.04 * (2.0 * std::f32::consts::PI * 150.0 * t).sin()
                    + 0.005 * noise
            }
            "CRACK" => {
                let click = if rng.next_u64().is_multiple_of(2000) {
                    0.8
                } else {
                    0.0
                };
                lp = 0.95 * lp + click;
                lp * (2.0 * std::f32::consts::PI * f0 * 4.0 * t).sin() + 0.01 * noise
            }
            "BACKGROUND" => 0.01 * noise,
            _ => {
                let f = 20.0 + (sr / 2.0 - 40.0) * (t / seconds as f32);
                0.1 * (2.0 * std::f32::consts::PI * f * t * 0.5).sin() + 0.01 * noise
            }
        };
        out.push((x.clamp(-1.0, 1.0) * 32767.0) as i16);
    }
    out
}

/// File name by the acquisition convention; gain 1 dB now and then (out of the water).
pub fn file_name(index: usize, seed: u64) -> String {
    let sensor = index % 17 + 1;
    let secs = 1_737_201_930 + index as i64 * 60;
    let dt = time::OffsetDateTime::from_unix_timestamp(secs).unwrap();
    let gain = if (seed + index as u64).is_multiple_of(23) {
        1
    } else {
        100
    };
    format!(
        "S{sensor:03}~R{index:06}~{:04}{:02}{:02}{:02}{:02}{:02}~{gain}.wav",
        dt.year(),
        dt.month() as u8,
        dt.day(),
        dt.hour(),
        dt.minute(),
        dt.second()
    )
}

/// Write `per_label` clips for each label under `root/<label>/`. Returns the paths written.
pub fn write_tree(
    root: &Path,
    labels: &[&str],
    per_label: usize,
    seed: u64,
) -> std::io::Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for (li, label) in labels.iter().enumerate() {
        let dir = root.join(label);
        std::fs::create_dir_all(&dir)?;
        for k in 0..per_label {
            let index = li * per_label + k;
            let s = seed.wrapping_mul(1_000_003).wrapping_add(index as u64);
            let path = dir.join(file_name(index, seed));
            std::fs::write(&path, wav_pcm16(&clip(label, s, 4096, 10.0), 4096))?;
            paths.push(path);
        }
    }
    Ok(paths)
}
