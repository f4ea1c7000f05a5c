//! Checking the GPU's rows, and the synthetic recordings used to do so: shared by the start-up
//! self-check, `ailhd doctor` and the parity tests. Rows are held against `features::reference`
//! under the contract's rule as `mel::check_accuracy` implements it; this module adds folding
//! several recordings' results together and a one-line report.

use crate::config::FeatureSettings;
use crate::decode::Waveform;
use crate::features::mel::Accuracy;
use crate::synth::Rng;

/// Fold `other` (another recording) into `total`.
pub fn merge(total: &mut Accuracy, other: &Accuracy) {
    total.checked += other.checked;
    total.max_abs_db = total.max_abs_db.max(other.max_abs_db);
    total.max_ulps = total.max_ulps.max(other.max_ulps);
    total.max_of_tolerance = total.max_of_tolerance.max(other.max_of_tolerance);
    total.violations += other.violations;
    if total.first_violation.is_none() {
        total.first_violation = other.first_violation;
    }
}

/// "max 0.50 float16 ulps (0.0078 dB) over 5120 values[, N outside the rule (first: ...)]".
pub fn summary(acc: &Accuracy) -> String {
    let mut s = format!(
        "max {:.2} float16 ulps ({:.4} dB) over {} values",
        acc.max_ulps, acc.max_abs_db, acc.checked
    );
    if let Some((i, expected, got)) = acc.first_violation {
        s.push_str(&format!(
            ", {} outside the rule (first: value {i} is {got:.4} dB, reference {expected:.4} dB)",
            acc.violations
        ));
    }
    s
}

/// Deterministic recordings of the configured length: a tone, tones with noise, quiet noise,
/// silence (int16, the common path), and a chirp and the noisy tones again as float
/// recordings (the float path).
pub fn synthetic_recordings(settings: &FeatureSettings) -> Vec<(String, Waveform)> {
    let n = settings.shape().num_samples;
    let sr = settings.sample_rate as f64;
    let mut rng = Rng::new(0x6169_6c68);
    let tau = std::f64::consts::TAU;
    let tone = |i: usize, f: f64| (tau * f * i as f64 / sr).sin();
    let to_pcm = |x: &[f64]| {
        Waveform::Pcm16(
            x.iter()
                .map(|v| (v * 32767.0).round().clamp(-32768.0, 32767.0) as i16)
                .collect(),
        )
    };
    let to_float = |x: &[f64]| Waveform::Float(x.iter().map(|&v| v as f32).collect());

    let pure: Vec<f64> = (0..n).map(|i| 0.5 * tone(i, sr * 0.107)).collect();
    let mix: Vec<f64> = (0..n)
        .map(|i| {
            0.3 * tone(i, sr * 0.0517)
                + 0.2 * tone(i, sr * 0.23)
                + 0.1 * tone(i, sr * 0.3711)
                + 0.05 * rng.uniform() as f64
        })
        .collect();
    let quiet: Vec<f64> = (0..n).map(|_| 0.002 * rng.uniform() as f64).collect();
    let duration = n as f64 / sr;
    let (f0, f1) = (0.01 * sr, 0.45 * sr);
    let chirp: Vec<f64> = (0..n)
        .map(|i| {
            let t = i as f64 / sr;
            0.7 * (tau * (f0 * t + (f1 - f0) * t * t / (2.0 * duration))).sin()
        })
        .collect();
    vec![
        ("tone".to_string(), to_pcm(&pure)),
        ("tones and noise".to_string(), to_pcm(&mix)),
        ("quiet noise".to_string(), to_pcm(&quiet)),
        ("silence".to_string(), Waveform::Pcm16(vec![0; n])),
        ("chirp (float)".to_string(), to_float(&chirp)),
        ("tones and noise (float)".to_string(), to_float(&mix)),
    ]
}
