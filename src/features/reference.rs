//! The feature definition (docs/design.md, "What a row is") computed plainly in float64: the yardstick
//! both featurisers are held against at start-up (`CudaFeaturiser`'s self-check), in `doctor` and
//! in the tests, with the contract's accuracy rule ([`super::mel::check_accuracy`]). It shares no
//! arithmetic with either featuriser: realfft in f64 (neither fast path uses it for the contract's
//! power-of-two sizes), the dense f64 filterbank, f64 logarithms.

use super::mel;
use crate::config::{DbMode, FeatureSettings};
use crate::decode::Waveform;
use realfft::RealFftPlanner;

/// The exact row of one recording, `[num_long][num_short][n_mels][t_frames]`, in dB.
pub fn row(wav: &Waveform, settings: &FeatureSettings) -> Vec<f64> {
    let shape = settings.shape();
    let n = settings.n_fft;
    let n_freqs = n / 2 + 1;
    let hann = mel::hann_periodic(n);
    let filterbank = mel::mel_filterbank(
        n_freqs,
        settings.f_min,
        settings.f_max_hz(),
        settings.n_mels,
        settings.sample_rate,
        settings.mel_norm,
        settings.mel_scale,
    );
    let fft = RealFftPlanner::<f64>::new().plan_fft_forward(n);
    let mut frame = fft.make_input_vec();
    let mut spectrum = fft.make_output_vec();
    let mut value = vec![0f64; n_freqs];
    let m = mel::db_multiplier(settings);
    let mut out = vec![0f64; shape.row_len()];
    for l in 0..shape.num_long {
        for s in 0..shape.num_short {
            for t in 0..shape.t_frames {
                let start =
                    l * settings.long_hop + s * settings.short_hop + t * settings.hop_length;
                for (i, x) in frame.iter_mut().enumerate() {
                    *x = wav.sample(start + i) as f64 * hann[i];
                }
                fft.process(&mut frame, &mut spectrum)
                    .expect("buffers come from the plan");
                for (v, c) in value.iter_mut().zip(&spectrum) {
                    *v = c.norm().powf(settings.power);
                }
                for (j, weights) in filterbank.iter().enumerate() {
                    let v: f64 = weights.iter().zip(&value).map(|(w, x)| w * x).sum();
                    let at = ((l * shape.num_short + s) * shape.n_mels + j) * shape.t_frames + t;
                    out[at] = m * v.max(1e-10).log10();
                }
            }
        }
    }
    if let (DbMode::AmplitudeToDb, Some(top_db)) = (settings.db, settings.top_db) {
        let floor = out.iter().copied().fold(f64::NEG_INFINITY, f64::max) - top_db;
        out.iter_mut().for_each(|v| *v = v.max(floor));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{MelNorm, MelScale};
    use crate::synth::Rng;

    /// The definition with a naive DFT per frame: slow and obviously right.
    fn naive(wav: &Waveform, settings: &FeatureSettings) -> Vec<f64> {
        let shape = settings.shape();
        let n = settings.n_fft;
        let n_freqs = n / 2 + 1;
        let hann = mel::hann_periodic(n);
        let fb = mel::mel_filterbank(
            n_freqs,
            settings.f_min,
            settings.f_max_hz(),
            settings.n_mels,
            settings.sample_rate,
            settings.mel_norm,
            settings.mel_scale,
        );
        let (cos, sin): (Vec<f64>, Vec<f64>) = (0..n)
            .map(|i| {
                let a = 2.0 * std::f64::consts::PI * i as f64 / n as f64;
                (a.cos(), a.sin())
            })
            .unzip();
        let sample = |i: usize| match wav {
            Waveform::Pcm16(v) => v[i] as f64 / 32768.0,
            Waveform::Float(v) => v[i] as f64,
        };
        let m = mel::db_multiplier(settings);
        let mut row = vec![0.0; shape.row_len()];
        for l in 0..shape.num_long {
            for s in 0..shape.num_short {
                for t in 0..shape.t_frames {
                    let off =
                        l * settings.long_hop + s * settings.short_hop + t * settings.hop_length;
                    let x: Vec<f64> = (0..n).map(|i| sample(off + i) * hann[i]).collect();
                    let spec: Vec<f64> = (0..n_freqs)
                        .map(|k| {
                            let (mut re, mut im) = (0.0, 0.0);
                            for (i, &xi) in x.iter().enumerate() {
                                re += xi * cos[(k * i) % n];
                                im -= xi * sin[(k * i) % n];
                            }
                            (re * re + im * im).sqrt().powf(settings.power)
                        })
                        .collect();
                    for (j, w) in fb.iter().enumerate() {
                        let v: f64 = w.iter().zip(&spec).map(|(a, b)| a * b).sum();
                        let idx =
                            ((l * shape.num_short + s) * shape.n_mels + j) * shape.t_frames + t;
                        row[idx] = m * v.max(1e-10).log10();
                    }
                }
            }
        }
        if let (DbMode::AmplitudeToDb, Some(top)) = (settings.db, settings.top_db) {
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            row.iter_mut().for_each(|v| *v = v.max(max - top));
        }
        row
    }

    /// realfft's f64 transform changes nothing that matters: the fast reference equals the naive
    /// DFT to ~1e-9 dB wherever the rule looks (values within 100 dB of the maximum).
    #[test]
    fn equals_the_naive_dft() {
        let mut rng = Rng::new(7);
        for settings in [
            FeatureSettings {
                duration_sec: 1.0,
                ..FeatureSettings::default()
            },
            FeatureSettings {
                duration_sec: 1.0,
                n_fft: 384,
                hop_length: 64,
                mel_scale: MelScale::Slaney,
                mel_norm: MelNorm::Slaney,
                power: 2.0,
                db: DbMode::AmplitudeToDb,
                top_db: Some(80.0),
                ..FeatureSettings::default()
            },
        ] {
            let n = settings.shape().num_samples;
            let wav = Waveform::Float(
                (0..n)
                    .map(|i| (0.5 * (i as f64 * 0.3).sin() + 0.01 * rng.uniform() as f64) as f32)
                    .collect(),
            );
            let (fast, slow) = (row(&wav, &settings), naive(&wav, &settings));
            let max = slow.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            for (a, b) in fast.iter().zip(&slow) {
                if *b >= max - 100.0 {
                    assert!((a - b).abs() < 1e-6, "{a} vs {b}");
                }
            }
        }
    }
}
