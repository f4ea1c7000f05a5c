//! The CPU featuriser against the float64 reference, across precisions, builds, batches and threads.

use super::fft::Power;
use super::plan::{Engine, Simd};
use super::vector::{Bin, PortableIsa, LANES};
use super::*;
use crate::config::{DbMode, MelNorm, MelScale};
use crate::features::{mel, Precision};
use half::slice::HalfFloatSliceExt;
use realfft::RealFftPlanner;

/// xorshift64*: reproducible test signals without a dependency.
struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform().max(1e-300), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

use crate::features::reference::row as reference;

fn run(settings: &FeatureSettings, wav: &Waveform) -> Vec<f16> {
    let mut f = CpuFeaturiser::new(settings, 1).unwrap();
    let mut out = vec![f16::ZERO; f.shape().row_len()];
    f.featurise(&[wav], &mut out).unwrap();
    out
}

/// Test signals with the features that stress float32: white noise at full scale; a loud
/// tone over noise 100 dB down; a band-limited float signal whose spectrum falls off steeply
/// (no quantisation noise to hide the FFT's rounding); one loud stretch in quiet.
fn signals(num_samples: usize) -> Vec<(&'static str, Waveform)> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let tau = 2.0 * std::f64::consts::PI;
    let noise: Vec<i16> = (0..num_samples)
        .map(|_| (rng.normal() * 8000.0).clamp(-32768.0, 32767.0) as i16)
        .collect();
    let tone: Vec<f32> = (0..num_samples)
        .map(|i| (0.9 * (tau * 440.3 * i as f64 / 4096.0).sin() + 1e-5 * rng.normal()) as f32)
        .collect();
    let band: Vec<f32> = {
        let parts: Vec<(f64, f64)> = (0..40)
            .map(|_| (20.0 + 900.0 * rng.uniform(), tau * rng.uniform()))
            .collect();
        (0..num_samples)
            .map(|i| {
                let t = i as f64 / 4096.0;
                (parts
                    .iter()
                    .map(|(f, ph)| (tau * f * t + ph).sin())
                    .sum::<f64>()
                    / 40.0) as f32
            })
            .collect()
    };
    let burst: Vec<i16> = (0..num_samples)
        .map(|i| {
            let a = if (8192..9216).contains(&i) {
                30000.0
            } else {
                3.0
            };
            (rng.normal() * a).clamp(-32768.0, 32767.0) as i16
        })
        .collect();
    vec![
        ("noise", Waveform::Pcm16(noise)),
        ("tone", Waveform::Float(tone)),
        ("band", Waveform::Float(band)),
        ("burst", Waveform::Pcm16(burst)),
        ("silence", Waveform::Pcm16(vec![0; num_samples])),
    ]
}

fn assert_meets_rule(settings: &FeatureSettings, what: &str) {
    for (name, wav) in signals(settings.shape().num_samples) {
        let exact = reference(&wav, settings);
        let acc = mel::check_accuracy(&exact, &run(settings, &wav));
        eprintln!("{what} {name}: {acc:?}");
        assert_eq!(acc.violations, 0, "{what} {name}: {acc:?}");
    }
}

#[test]
fn default_setup_matches_the_f64_reference() {
    assert_meets_rule(&FeatureSettings::default(), "default");
}

#[test]
fn overlap32_setup_matches_the_f64_reference() {
    assert_meets_rule(&FeatureSettings::overlap32(), "overlap32");
}

/// Several STFT frames per short window (t_frames > 1), the other scale and norm, a
/// non-power-of-two FFT (realfft engine), an unusual power, a band-limited filterbank, a mel
/// count that is not a multiple of the lane count.
#[test]
fn other_settings_match_the_f64_reference() {
    let base = FeatureSettings {
        duration_sec: 2.0,
        ..FeatureSettings::default()
    };
    let cases = [
        FeatureSettings {
            n_fft: 256,
            hop_length: 64,
            mel_scale: MelScale::Slaney,
            mel_norm: MelNorm::Slaney,
            ..base.clone()
        },
        FeatureSettings {
            n_fft: 384,
            hop_length: 64,
            n_mels: 40,
            power: 1.5,
            f_min: 20.0,
            f_max: Some(1800.0),
            db: DbMode::AmplitudeToDb,
            top_db: Some(60.0),
            ..base.clone()
        },
        FeatureSettings {
            n_mels: 20,
            mel_scale: MelScale::Slaney,
            ..base.clone()
        },
        FeatureSettings {
            n_fft: 8,
            short_window: 32,
            short_hop: 16,
            long_window: 64,
            long_hop: 64,
            hop_length: 8,
            n_mels: 2,
            ..base.clone()
        },
    ];
    for (i, settings) in cases.iter().enumerate() {
        assert_meets_rule(settings, &format!("case {i}"));
    }
}

/// A loud tone over a faint noise floor (16-bit quantisation or below): the case that needs
/// the f64 FFT for magnitude spectrograms (see [`Precision`](super::Precision)).
fn tonal(num_samples: usize, count: usize) -> Vec<(String, Waveform)> {
    let mut rng = Rng(12345);
    let tau = 2.0 * std::f64::consts::PI;
    (0..count)
        .map(|i| {
            let f0 = 30.0 + 1900.0 * rng.uniform();
            let amp = 0.05 + 0.9 * rng.uniform();
            let noise = 10f64.powf(-4.0 - 2.5 * rng.uniform());
            let x: Vec<f64> = (0..num_samples)
                .map(|t| amp * (tau * f0 * t as f64 / 4096.0).sin() + noise * rng.normal())
                .collect();
            let name = format!("tone {f0:.0} Hz x {amp:.2} + noise {noise:.0e}");
            let wav = if i % 2 == 0 {
                Waveform::Pcm16(
                    x.iter()
                        .map(|v| (v * 32768.0).round().clamp(-32768.0, 32767.0) as i16)
                        .collect(),
                )
            } else {
                Waveform::Float(x.iter().map(|&v| v as f32).collect())
            };
            (name, wav)
        })
        .collect()
}

/// Rule violations of `plan` over `signals`, and the largest f32 error (before float16
/// rounding) as a fraction of the tolerance, max(1 ulp, 0.005 dB), over the checked values.
fn violations(plan: &Plan, signals: &[(String, Waveform)]) -> (usize, f64) {
    let mut s = plan.scratch();
    let (mut count, mut worst) = (0, 0f64);
    for (name, wav) in signals {
        let exact = reference(wav, &plan.settings);
        plan.db_row(wav, &mut s);
        let max = exact.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        for (&e, &y) in exact.iter().zip(&s.row) {
            if e >= max - 100.0 {
                worst = worst.max((y as f64 - e).abs() / mel::f16_ulp(e).max(0.005));
            }
        }
        let mut out = vec![f16::ZERO; s.row.len()];
        out.convert_from_f32_slice(&s.row);
        let acc = mel::check_accuracy(&exact, &out);
        eprintln!("{name}: {acc:?}");
        count += acc.violations;
    }
    (count, worst)
}

#[test]
fn precision_follows_the_checked_depth() {
    let p2_unclamped = FeatureSettings {
        db: DbMode::Log10,
        top_db: None,
        ..FeatureSettings::overlap32()
    };
    assert_eq!(
        Precision::for_settings(&FeatureSettings::default()),
        Precision::F64
    );
    assert_eq!(
        Precision::for_settings(&FeatureSettings::overlap32()),
        Precision::F32
    );
    assert_eq!(Precision::for_settings(&p2_unclamped), Precision::F64);
}

/// Tonal recordings meet the rule with the precision each setup gets, with margin: the f32
/// error before float16 rounding stays under half the tolerance.
#[test]
fn tonal_recordings_meet_the_rule() {
    let p2_unclamped = FeatureSettings {
        db: DbMode::Log10,
        top_db: None,
        ..FeatureSettings::overlap32()
    };
    for settings in [
        FeatureSettings::default(),
        FeatureSettings::overlap32(),
        p2_unclamped,
    ] {
        let plan = Plan::new(&settings).unwrap();
        let (count, worst) = violations(&plan, &tonal(settings.shape().num_samples, 6));
        eprintln!(
            "{}: {count} violations, f32 error {worst:.3} of the tolerance",
            plan.engine_name()
        );
        assert_eq!(count, 0);
        assert!(worst < 0.5, "{worst}");
    }
}

/// Why the default setup gets an f64 FFT: with an f32 one, tonal 16-bit recordings break the
/// rule.
#[test]
fn f32_fft_is_not_enough_for_magnitude_spectrograms() {
    let settings = FeatureSettings::default();
    let signals = tonal(settings.shape().num_samples, 20);
    let f32_plan = Plan::with_precision(&settings, Precision::F32).unwrap();
    let (count, worst) = violations(&f32_plan, &signals);
    eprintln!("f32 FFT: {count} violations, error up to {worst:.2} of the tolerance");
    assert!(count > 0);
    let f64_plan = Plan::with_precision(&settings, Precision::F64).unwrap();
    let (count, worst) = violations(&f64_plan, &signals);
    eprintln!("f64 FFT: {count} violations, error up to {worst:.4} of the tolerance");
    assert_eq!(count, 0);
}

/// Every build of the featuriser this CPU runs (portable, AVX2, AVX-512) gives the same bits.
#[test]
fn simd_builds_agree_bit_for_bit() {
    let builds = Simd::available();
    if builds.len() == 1 {
        eprintln!("no AVX2 here: only the portable build runs, nothing to compare");
        return;
    }
    for settings in [FeatureSettings::default(), FeatureSettings::overlap32()] {
        for precision in [Precision::F32, Precision::F64] {
            let mut plan = Plan::with_precision(&settings, precision).unwrap();
            let mut reference = plan.scratch();
            let mut s = plan.scratch();
            for (name, wav) in signals(settings.shape().num_samples) {
                plan.simd = Simd::Portable;
                plan.db_row(&wav, &mut reference);
                for &simd in &builds[1..] {
                    plan.simd = simd;
                    plan.db_row(&wav, &mut s);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&s.row),
                        bits(&reference.row),
                        "{name} {precision:?} {simd:?}"
                    );
                }
            }
        }
    }
}

/// The three engines compute the same power spectrum: f32 lanes to f32 rounding, f64 lanes
/// and realfft (f64) to the final rounding to f32.
#[test]
fn engines_agree() {
    let settings = FeatureSettings::default();
    let mut plans: Vec<Plan> = [Precision::F32, Precision::F64]
        .iter()
        .map(|&p| Plan::with_precision(&settings, p).unwrap())
        .collect();
    let mut realfft = Plan::new(&settings).unwrap();
    realfft.engine = Engine::RealFft {
        fft: RealFftPlanner::<f64>::new().plan_fft_forward(512),
        window: mel::hann_periodic(512),
    };
    plans.push(realfft);
    let mut rng = Rng(7);
    let wav = Waveform::Float((0..40960).map(|_| rng.normal() as f32).collect());
    let offsets: [usize; LANES] = std::array::from_fn(|l| 1000 * l + 3);
    let spectra: Vec<Vec<Bin>> = plans
        .iter_mut()
        .map(|plan| {
            plan.power = Power::Energy;
            let mut s = plan.scratch();
            plan.spectrogram::<PortableIsa>(&wav, &offsets, &mut s);
            s.spec
        })
        .collect();
    let scale = spectra[2].iter().flat_map(|b| b.0).fold(0f32, f32::max);
    for (which, tolerance) in [(0, 1e-5), (1, 1e-7)] {
        for (k, (a, b)) in spectra[which].iter().zip(&spectra[2]).enumerate() {
            for l in 0..LANES {
                let (a, b) = (a.0[l], b.0[l]);
                assert!(
                    (a - b).abs() <= tolerance * scale,
                    "engine {which} bin {k} lane {l}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn featurise_rejects_wrong_lengths() {
    let settings = FeatureSettings::default();
    let mut f = CpuFeaturiser::new(&settings, 2).unwrap();
    let short = Waveform::Pcm16(vec![0; 100]);
    let good = Waveform::Pcm16(vec![0; 40960]);
    let mut out = vec![f16::ZERO; 2 * f.shape().row_len()];
    let err = f
        .featurise(&[&good, &short], &mut out)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("recording 1") && err.contains("100 samples"),
        "{err}"
    );
    let err = f.featurise(&[&good], &mut out).unwrap_err().to_string();
    assert!(err.contains("output buffer"), "{err}");
}

/// Rows do not depend on the batch: alone, in a batch, at any position, any thread count.
#[test]
fn rows_do_not_depend_on_batch_or_threads() {
    let settings = FeatureSettings::overlap32();
    let sigs = signals(settings.shape().num_samples);
    let wavs: Vec<&Waveform> = sigs.iter().map(|(_, w)| w).collect();
    let row_len = settings.shape().row_len();
    let alone: Vec<Vec<f16>> = wavs.iter().map(|w| run(&settings, w)).collect();
    for threads in [1, 3] {
        let mut f = CpuFeaturiser::new(&settings, threads).unwrap();
        let mut batch = wavs.clone();
        batch.extend(wavs.iter().rev());
        let mut out = vec![f16::ZERO; batch.len() * row_len];
        f.featurise(&batch, &mut out).unwrap();
        for (i, row) in out.chunks(row_len).enumerate() {
            let k = if i < wavs.len() {
                i
            } else {
                2 * wavs.len() - 1 - i
            };
            assert!(
                row.iter()
                    .zip(&alone[k])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "row {i}"
            );
        }
    }
}

/// The pipelined interface gives `featurise`'s rows, oldest batch first, and `featurise` waits
/// until every submitted batch is finished.
#[test]
fn submit_and_finish_give_featurise_rows_in_order() {
    let settings = FeatureSettings::overlap32();
    let sigs = signals(settings.shape().num_samples);
    let wavs: Vec<&Waveform> = sigs.iter().map(|(_, w)| w).collect();
    let row_len = settings.shape().row_len();
    let mut f = CpuFeaturiser::new(&settings, 2).unwrap();
    let mut expected = vec![f16::ZERO; wavs.len() * row_len];
    f.featurise(&wavs, &mut expected).unwrap();
    let batches: Vec<&[&Waveform]> = vec![&wavs[..1], &wavs[1..], &wavs[..0], &wavs[2..4]];
    for b in &batches {
        f.submit(b, vec![f16::ZERO; b.len() * row_len]).unwrap();
    }
    let mut one = vec![f16::ZERO; row_len];
    let err = f.featurise(&wavs[..1], &mut one).unwrap_err().to_string();
    assert!(err.contains("4 submitted batches"), "{err}");
    let starts = [0, 1, 0, 2];
    for (b, start) in batches.iter().zip(starts) {
        let rows = f.finish().unwrap().expect("a batch is pending");
        assert_eq!(rows.len(), b.len() * row_len);
        let want = &expected[start * row_len..(start + b.len()) * row_len];
        assert!(rows
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    assert!(f.finish().unwrap().is_none());
    f.featurise(&wavs[..1], &mut one).unwrap();
    assert!(f.submit(&wavs[..1], vec![f16::ZERO; 3]).is_err());
}
