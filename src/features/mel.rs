//! The device-independent parts of the feature definition: torchaudio's mel filterbank
//! (`melscale_fbanks`), its periodic Hann window, and the decibel conversion (`AmplitudeToDB`).
//! Both featurisers (CPU and CUDA) build from these, so they cannot disagree on the definition.

use crate::config::{DbMode, FeatureSettings, MelNorm, MelScale};
use half::f16;

/// torchaudio's `_hz_to_mel`.
pub fn hz_to_mel(freq: f64, scale: MelScale) -> f64 {
    match scale {
        MelScale::Htk => 2595.0 * (1.0 + freq / 700.0).log10(),
        MelScale::Slaney => {
            let (f_sp, min_log_hz) = (200.0 / 3.0, 1000.0);
            if freq >= min_log_hz {
                min_log_hz / f_sp + (freq / min_log_hz).ln() / slaney_logstep()
            } else {
                freq / f_sp
            }
        }
    }
}

/// torchaudio's `_mel_to_hz`, the inverse of [`hz_to_mel`].
pub fn mel_to_hz(mel: f64, scale: MelScale) -> f64 {
    match scale {
        MelScale::Htk => 700.0 * (10f64.powf(mel / 2595.0) - 1.0),
        MelScale::Slaney => {
            let (f_sp, min_log_hz) = (200.0 / 3.0, 1000.0);
            let min_log_mel = min_log_hz / f_sp;
            if mel >= min_log_mel {
                min_log_hz * (slaney_logstep() * (mel - min_log_mel)).exp()
            } else {
                f_sp * mel
            }
        }
    }
}

fn slaney_logstep() -> f64 {
    6.4f64.ln() / 27.0
}

/// `torch.linspace(start, end, steps)` in f64: torch fills the second half backwards from `end`,
/// so the last point is exactly `end`.
fn linspace(start: f64, end: f64, steps: usize) -> Vec<f64> {
    if steps == 1 {
        return vec![start];
    }
    let step = (end - start) / (steps - 1) as f64;
    let half = steps / 2;
    (0..steps)
        .map(|i| {
            if i < half {
                start + step * i as f64
            } else {
                end - step * (steps - 1 - i) as f64
            }
        })
        .collect()
}

/// torchaudio.functional.melscale_fbanks semantics, computed in f64: n_freqs = n_fft/2+1 bins,
/// n_mels triangles. Returns `[n_mels][n_freqs]` dense (torch's `fb` transposed: one row per
/// mel). A mel whose triangle falls between two bins is all zeros, as in torchaudio (which only
/// warns about it).
pub fn mel_filterbank(
    n_freqs: usize,
    f_min: f64,
    f_max: f64,
    n_mels: usize,
    sample_rate: u32,
    norm: MelNorm,
    scale: MelScale,
) -> Vec<Vec<f64>> {
    // torchaudio spaces the bins up to `sample_rate // 2` (integer division), not sr / 2.
    let all_freqs = linspace(0.0, (sample_rate / 2) as f64, n_freqs);
    let m_pts = linspace(hz_to_mel(f_min, scale), hz_to_mel(f_max, scale), n_mels + 2);
    let f_pts: Vec<f64> = m_pts.iter().map(|&m| mel_to_hz(m, scale)).collect();
    (0..n_mels)
        .map(|j| {
            let (lo, mid, hi) = (f_pts[j], f_pts[j + 1], f_pts[j + 2]);
            let enorm = match norm {
                MelNorm::None => 1.0,
                MelNorm::Slaney => 2.0 / (hi - lo),
            };
            all_freqs
                .iter()
                .map(|&f| {
                    // torchaudio's _create_triangular_filterbank; its -1 * (lo - f) is f - lo
                    // exactly.
                    let down = (f - lo) / (mid - lo);
                    let up = (hi - f) / (hi - mid);
                    0f64.max(down.min(up)) * enorm
                })
                .collect()
        })
        .collect()
}

/// One mel triangle: its weights start at bin `start` (all other bins weigh zero).
#[derive(Debug, Clone, PartialEq)]
pub struct MelFilter {
    pub start: usize,
    pub weights: Vec<f32>,
}

/// Sparse form of [`mel_filterbank`]: per mel, the first nonzero bin and its weights (f32).
/// A triangle covers a few bins only, so this is ~n_freqs/n_mels times less work than the
/// dense product.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseMel {
    pub n_freqs: usize,
    pub filters: Vec<MelFilter>,
}

impl SparseMel {
    pub fn new(settings: &FeatureSettings) -> Self {
        let n_freqs = settings.n_fft / 2 + 1;
        // torchaudio's default f_max is float(sample_rate // 2).
        let f_max = settings.f_max.unwrap_or((settings.sample_rate / 2) as f64);
        let dense = mel_filterbank(
            n_freqs,
            settings.f_min,
            f_max,
            settings.n_mels,
            settings.sample_rate,
            settings.mel_norm,
            settings.mel_scale,
        );
        let filters = dense
            .iter()
            .map(|row| {
                let first = row.iter().position(|&w| w != 0.0);
                let last = row.iter().rposition(|&w| w != 0.0);
                match (first, last) {
                    (Some(a), Some(b)) => MelFilter {
                        start: a,
                        weights: row[a..=b].iter().map(|&w| w as f32).collect(),
                    },
                    _ => MelFilter {
                        start: 0,
                        weights: Vec::new(),
                    },
                }
            })
            .collect();
        SparseMel { n_freqs, filters }
    }
}

/// Periodic Hann window of length n (`torch.hann_window(n, periodic=True)`), f64.
pub fn hann_periodic(n: usize) -> Vec<f64> {
    if n == 1 {
        return vec![1.0];
    }
    (0..n)
        .map(|i| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / n as f64).cos())
        .collect()
}

/// AmplitudeToDB's floor (`amin`): values below it are taken as it.
pub const DB_FLOOR: f32 = 1e-10;

/// dB per decade: 10 for a power spectrogram (power = 2), 20 otherwise (AmplitudeToDB's
/// stype "power" vs "magnitude"; the contract uses the same rule for `db = "log10"`).
pub fn db_multiplier(settings: &FeatureSettings) -> f64 {
    if settings.power == 2.0 {
        10.0
    } else {
        20.0
    }
}

/// dB conversion per the contract, applied to one recording's mel values in place: multiplier m
/// (10 when power == 2.0 else 20), floor 1e-10, then the optional top_db clamp against the
/// maximum over the whole recording (only with `db = "amplitude_to_db"`). NaN stays NaN.
/// `inline(always)` so that it vectorises to the width of the caller's target features.
#[inline(always)]
pub fn to_db_in_place(values: &mut [f32], settings: &FeatureSettings) {
    // m * log10(x) = (m * log10(e)) * ln(x): one multiply after the logarithm.
    let scale = (db_multiplier(settings) * std::f64::consts::LOG10_E) as f32;
    for v in values.iter_mut() {
        // Written as a select (not f32::max) so that NaN propagates, as torch's clamp does.
        let x = if *v < DB_FLOOR { DB_FLOOR } else { *v };
        *v = scale * ln_f32(x);
    }
    if let (DbMode::AmplitudeToDb, Some(top_db)) = (settings.db, settings.top_db) {
        let max = values.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let low = max - top_db as f32;
        for v in values.iter_mut() {
            if *v < low {
                *v = low;
            }
        }
    }
}

/// Natural logarithm for positive f32, branch-free so that loops over it vectorise (std's `ln`
/// is a libm call per value, the larger part of the featuriser's time otherwise). Cephes'
/// `logf` polynomial: within 2 ulp of the exact value for every positive normal input; infinity
/// and NaN pass through. Not for zero, negatives or subnormals (the dB floor keeps them out).
#[inline(always)]
pub fn ln_f32(x: f32) -> f32 {
    const SQRT_HALF: f32 = std::f32::consts::FRAC_1_SQRT_2;
    let bits = x.to_bits();
    // x = m * 2^e with m in [0.5, 1).
    let mut e = ((bits >> 23) & 0xff) as i32 - 126;
    let m = f32::from_bits((bits & 0x007f_ffff) | 0x3f00_0000);
    // Shift m into [sqrt(1/2), sqrt(2)) so that f = m - 1 is small on both sides of zero.
    let small = m < SQRT_HALF;
    let f = if small { m + m - 1.0 } else { m - 1.0 };
    e -= small as i32;
    let e = e as f32;
    let z = f * f;
    let mut y = 0.070_376_836;
    y = y * f - 0.115_146_1;
    y = y * f + 0.116_769_984;
    y = y * f - 0.124_201_41;
    y = y * f + 0.142_493_23;
    y = y * f - 0.166_680_57;
    y = y * f + 0.200_007_14;
    y = y * f - 0.249_999_94;
    y = y * f + 0.333_333_3;
    y = y * f * z;
    // ln 2 = LN2_HI + LN2_LO, LN2_HI = 355/512 exactly, so that e * LN2_HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -0.000_212_194_44;
    y += LN2_LO * e;
    y += -0.5 * z;
    let r = f + y + LN2_HI * e;
    if bits >= 0x7f80_0000 {
        x
    } else {
        r
    }
}

/// One float16 ulp at `x`: the spacing of float16 values in x's binade (2^-24 below the
/// normal range).
pub fn f16_ulp(x: f64) -> f64 {
    let a = x.abs();
    if a < 2f64.powi(-14) {
        2f64.powi(-24)
    } else {
        2f64.powi(a.log2().floor() as i32 - 10)
    }
}

/// How far stored values are from exact ones, under the contract's accuracy rule.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Accuracy {
    /// Values whose exact value lies within 100 dB of the maximum (the checked region).
    pub checked: usize,
    /// Largest |stored - exact| in dB over the checked region.
    pub max_abs_db: f64,
    /// Largest |stored - exact| in float16 ulps of the exact value, over the checked region.
    pub max_ulps: f64,
    /// Largest |stored - exact| as a fraction of the tolerance, max(1 ulp, 0.005 dB), over the
    /// checked region: the rule holds there while this is at most 1.
    pub max_of_tolerance: f64,
    /// Values that break the rule, and the first of them: (index, exact, stored).
    pub violations: usize,
    pub first_violation: Option<(usize, f64, f64)>,
}

/// The contract's accuracy rule, for one recording: wherever the exact value lies within 100 dB
/// of the recording's maximum, the stored value is within max(one float16 ulp of the exact
/// value, 0.005 dB) of it; further below, the stored value also lies more than 90 dB below that
/// maximum. Shared by the tests of every featuriser and by the CPU/GPU parity self-test.
pub fn check_accuracy(exact: &[f64], stored: &[f16]) -> Accuracy {
    assert_eq!(
        exact.len(),
        stored.len(),
        "exact and stored rows differ in length"
    );
    let max = exact.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut acc = Accuracy::default();
    for (i, (&e, &s)) in exact.iter().zip(stored).enumerate() {
        let s = s.to_f64();
        let ok = if e >= max - 100.0 {
            let err = (s - e).abs();
            acc.checked += 1;
            acc.max_abs_db = acc.max_abs_db.max(err);
            acc.max_ulps = acc.max_ulps.max(err / f16_ulp(e));
            let tolerance = f16_ulp(e).max(0.005);
            acc.max_of_tolerance = acc.max_of_tolerance.max(err / tolerance);
            err <= tolerance
        } else {
            s < max - 90.0
        };
        if !ok {
            acc.violations += 1;
            acc.first_violation.get_or_insert((i, e, s));
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(settings: &FeatureSettings) -> Vec<Vec<f64>> {
        mel_filterbank(
            settings.n_fft / 2 + 1,
            settings.f_min,
            settings.f_max_hz(),
            settings.n_mels,
            settings.sample_rate,
            settings.mel_norm,
            settings.mel_scale,
        )
    }

    #[test]
    fn mel_scales_round_trip_and_match_known_points() {
        for scale in [MelScale::Htk, MelScale::Slaney] {
            for f in [0.0, 1.0, 440.0, 999.0, 1000.0, 1500.0, 2048.0, 8000.0] {
                let back = mel_to_hz(hz_to_mel(f, scale), scale);
                assert!((back - f).abs() < 1e-9, "{scale:?} {f} -> {back}");
            }
        }
        // HTK: 1000 Hz is 1000 mel by construction of the 2595/700 constants (to ~0.1 mel).
        assert!((hz_to_mel(1000.0, MelScale::Htk) - 999.9855).abs() < 1e-3);
        // Slaney: linear up to 1000 Hz = 15 mel, then log steps of ln(6.4)/27.
        assert!((hz_to_mel(1000.0, MelScale::Slaney) - 15.0).abs() < 1e-12);
        assert!((hz_to_mel(500.0, MelScale::Slaney) - 7.5).abs() < 1e-12);
        assert!((hz_to_mel(6400.0, MelScale::Slaney) - 42.0).abs() < 1e-12);
    }

    #[test]
    fn linspace_ends_exactly_and_matches_torch() {
        let v = linspace(0.0, 2048.0, 257);
        assert_eq!(v[0], 0.0);
        assert_eq!(v[256], 2048.0);
        assert_eq!(v[1], 8.0);
        assert_eq!(v[128], 1024.0);
        assert_eq!(linspace(3.0, 5.0, 1), vec![3.0]);
    }

    #[test]
    fn hann_is_periodic() {
        let w = hann_periodic(8);
        let expect = [0.0, 0.146447, 0.5, 0.853553, 1.0, 0.853553, 0.5, 0.146447];
        for (a, b) in w.iter().zip(expect) {
            assert!((a - b).abs() < 1e-6, "{w:?}");
        }
        assert_eq!(hann_periodic(1), vec![1.0]);
    }

    /// Unnormalised triangles peak at 1 exactly where a bin falls on a centre frequency and are
    /// continuous: neighbouring filters cross, so each interior bin's weights over the two
    /// filters it falls in sum to 1 (a partition of unity between the first and last centre).
    #[test]
    fn htk_triangles_partition_unity() {
        let s = FeatureSettings::default();
        let fb = dense(&s);
        assert_eq!(fb.len(), 64);
        assert!(fb.iter().all(|r| r.len() == 257));
        let m_pts = linspace(0.0, hz_to_mel(2048.0, MelScale::Htk), 66);
        let f_pts: Vec<f64> = m_pts.iter().map(|&m| mel_to_hz(m, MelScale::Htk)).collect();
        for k in 0..257 {
            let f = k as f64 * 8.0;
            let col: f64 = fb.iter().map(|r| r[k]).sum();
            if f >= f_pts[1] && f <= f_pts[64] {
                assert!((col - 1.0).abs() < 1e-12, "bin {k}: {col}");
            }
            assert!(col <= 1.0 + 1e-12);
            // At most two filters overlap at any bin.
            assert!(fb.iter().filter(|r| r[k] > 0.0).count() <= 2);
        }
        for (j, row) in fb.iter().enumerate() {
            let peak = row.iter().cloned().fold(0.0, f64::max);
            assert!(peak > 0.0 && peak <= 1.0, "mel {j} peak {peak}");
            for (k, &w) in row.iter().enumerate() {
                let f = k as f64 * 8.0;
                let expect = ((f - f_pts[j]) / (f_pts[j + 1] - f_pts[j]))
                    .min((f_pts[j + 2] - f) / (f_pts[j + 2] - f_pts[j + 1]))
                    .max(0.0);
                assert!((w - expect).abs() < 1e-15);
            }
        }
        // f_pts[1] for 64 HTK mels up to 2048 Hz, by hand: mel(2048) = 2595 log10(1 + 2048/700)
        // = 1541.2 mel; /65 = 23.711 mel -> 700 (10^(23.711/2595) - 1) = 14.88 Hz.
        assert!((f_pts[1] - 14.88).abs() < 0.01, "{}", f_pts[1]);
        // Bin 1 (8 Hz) is on the rising side of filter 0: 8 / 14.88.
        assert!((fb[0][1] - 8.0 / f_pts[1]).abs() < 1e-12);
    }

    /// Slaney normalisation scales each triangle to unit area in Hz: the area of a triangle of
    /// height 2/(hi-lo) over [lo, hi] is 1; sampled every 8 Hz its Riemann sum is 1/8.
    #[test]
    fn slaney_norm_gives_unit_area() {
        let s = FeatureSettings::overlap32();
        let fb = dense(&s);
        assert_eq!(fb.len(), 32);
        for (j, row) in fb.iter().enumerate().skip(1) {
            let riemann: f64 = row.iter().sum::<f64>() * 8.0;
            // Narrow low triangles are coarsely sampled; the error bound is loose there.
            assert!((riemann - 1.0).abs() < 0.05, "mel {j}: area {riemann}");
        }
        let plain = mel_filterbank(257, 0.0, 2048.0, 32, 4096, MelNorm::None, MelScale::Htk);
        let m_pts = linspace(0.0, hz_to_mel(2048.0, MelScale::Htk), 34);
        let f_pts: Vec<f64> = m_pts.iter().map(|&m| mel_to_hz(m, MelScale::Htk)).collect();
        for j in 0..32 {
            let enorm = 2.0 / (f_pts[j + 2] - f_pts[j]);
            for k in 0..257 {
                assert!((fb[j][k] - plain[j][k] * enorm).abs() < 1e-15);
            }
        }
    }

    #[test]
    fn slaney_scale_filterbank_is_triangular() {
        let s = FeatureSettings {
            mel_scale: MelScale::Slaney,
            n_mels: 40,
            ..FeatureSettings::default()
        };
        let fb = dense(&s);
        for row in &fb {
            // One rise then one fall: the nonzero weights are unimodal.
            let nz: Vec<f64> = row.iter().cloned().filter(|&w| w > 0.0).collect();
            let peak = nz
                .iter()
                .enumerate()
                .fold((0, 0.0), |a, (i, &w)| if w > a.1 { (i, w) } else { a })
                .0;
            assert!(nz[..=peak].windows(2).all(|p| p[0] <= p[1]));
            assert!(nz[peak..].windows(2).all(|p| p[0] >= p[1]));
        }
    }

    #[test]
    fn sparse_mel_matches_dense() {
        for s in [FeatureSettings::default(), FeatureSettings::overlap32()] {
            let fb = dense(&s);
            let sp = SparseMel::new(&s);
            assert_eq!(sp.n_freqs, 257);
            assert_eq!(sp.filters.len(), s.n_mels);
            for (f, row) in sp.filters.iter().zip(&fb) {
                for (k, &w) in row.iter().enumerate() {
                    let got = if k >= f.start && k < f.start + f.weights.len() {
                        f.weights[k - f.start]
                    } else {
                        0.0
                    };
                    assert_eq!(got, w as f32);
                }
            }
            let total: usize = sp.filters.iter().map(|f| f.weights.len()).sum();
            assert!(total < 2 * 257, "{total} weights");
        }
    }

    #[test]
    fn empty_triangles_stay_empty() {
        // 128 mels over 33 bins: the lowest triangles fall between bins, as torchaudio warns.
        let s = FeatureSettings {
            n_fft: 64,
            n_mels: 128,
            ..FeatureSettings::default()
        };
        let sp = SparseMel::new(&s);
        assert!(sp.filters.iter().any(|f| f.weights.is_empty()));
    }

    #[test]
    fn fast_ln_is_within_two_ulp() {
        let mut worst = 0f64;
        let mut x = 1e-10f32;
        while x < 1e10 {
            let exact = (x as f64).ln();
            let got = ln_f32(x) as f64;
            let ulp = (exact.abs() as f32).max(f32::MIN_POSITIVE);
            let ulp = (f32::from_bits(ulp.to_bits() + 1) - ulp) as f64;
            worst = worst.max((got - exact).abs() / ulp);
            x = f32::from_bits(x.to_bits() + 997);
        }
        assert!(worst <= 2.0, "worst {worst} ulp");
        assert_eq!(ln_f32(1.0), 0.0);
        assert_eq!(ln_f32(f32::INFINITY), f32::INFINITY);
        assert!(ln_f32(f32::NAN).is_nan());
    }

    #[test]
    fn db_conversion_follows_the_contract() {
        let mut s = FeatureSettings::default();
        let mut v = vec![1.0, 10.0, 0.0, 1e-12, 100.0];
        to_db_in_place(&mut v, &s);
        let want = [0.0, 20.0, -200.0, -200.0, 40.0];
        for (a, b) in v.iter().zip(want) {
            assert!((a - b).abs() < 1e-4, "{v:?}");
        }
        s = FeatureSettings::overlap32();
        let mut v = vec![1.0, 10.0, 0.0, 1e-5, 100.0, f32::NAN];
        to_db_in_place(&mut v, &s);
        // power 2 -> 10 dB/decade; top_db 80 below the maximum (20 dB) clamps at -60.
        let want = [0.0, 10.0, -60.0, -50.0, 20.0];
        for (a, b) in v.iter().zip(want) {
            assert!((a - b).abs() < 1e-4, "{v:?}");
        }
        assert!(v[5].is_nan());
    }
}
