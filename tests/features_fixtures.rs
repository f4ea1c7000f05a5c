//! The CPU featuriser against the shared reference features (`shared/fixtures/features`):
//! every valid recording, both setups, decoded by `ailhd::decode` and compared under the
//! tolerance `cases.json` gives for it. Also: a row never depends on its batch.

use crate::common::{cases, fixtures, read_npy_f32};
use ailhd::config::FeatureSettings;
use ailhd::decode::{decode, Waveform};
use ailhd::features::cpu::CpuFeaturiser;
use ailhd::features::mel::check_accuracy;
use ailhd::features::Featuriser;
use half::f16;
use serde_json::Value;

fn setups() -> Vec<(&'static str, FeatureSettings)> {
    vec![
        ("default", FeatureSettings::default()),
        ("overlap32", FeatureSettings::overlap32()),
    ]
}

fn valid_cases() -> Vec<(String, String)> {
    let cases = cases();
    let mut v: Vec<(String, String)> = cases["cases"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, c)| c["kind"] == "valid")
        .map(|(name, c)| (name.clone(), c["tolerance"].as_str().unwrap().to_string()))
        .collect();
    v.sort();
    assert!(v.len() >= 14, "only {} valid cases", v.len());
    v
}

fn load(name: &str, settings: &FeatureSettings) -> Waveform {
    let path = fixtures().join("wav").join(format!("{name}.wav"));
    let bytes = std::fs::read(&path).unwrap();
    decode(&bytes, settings.sample_rate, settings.shape().num_samples)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn featurise(f: &mut CpuFeaturiser, batch: &[&Waveform]) -> Vec<f16> {
    let mut out = vec![f16::ZERO; batch.len() * f.shape().row_len()];
    f.featurise(batch, &mut out).unwrap();
    out
}

/// The setups in `cases.json` are the ones the code calls `default` and `overlap32`.
#[test]
fn fixture_configs_are_the_builtin_setups() {
    let cases = cases();
    let configs = cases["configs"].as_object().unwrap();
    assert_eq!(configs.len(), setups().len());
    for (name, settings) in setups() {
        let ours: Value = serde_json::from_str(&settings.to_json()).unwrap();
        let theirs = configs[name].as_object().unwrap();
        for (key, want) in theirs {
            let got = &ours[key.as_str()];
            let same = match (got, want) {
                (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
                // The fixtures write "no normalisation" as null, the configuration as "none".
                (Value::String(a), Value::Null) => a == "none",
                (a, b) => a == b,
            };
            assert!(same, "{name}.{key}: fixtures {want}, FeatureSettings {got}");
        }
        for key in ours.as_object().unwrap().keys() {
            assert!(
                theirs.contains_key(key) || key == "store_waveform",
                "{name}: fixtures do not set {key}"
            );
        }
    }
}

#[test]
fn every_valid_fixture_meets_its_tolerance() {
    let mut failures = Vec::new();
    for (setup, settings) in setups() {
        let shape = settings.shape();
        let mut f = CpuFeaturiser::new(&settings, 2).unwrap();
        let (mut worst_db, mut worst_ulps, mut worst_tolerance) = (0f64, 0f64, 0f64);
        for (name, tolerance) in valid_cases() {
            let wav = load(&name, &settings);
            let row = featurise(&mut f, &[&wav]);
            let path = fixtures().join(format!("expected/{setup}/{name}.npy"));
            let (dims, exact) = read_npy_f32(&path);
            assert_eq!(dims, shape.row_dims(), "{}", path.display());
            let exact: Vec<f64> = exact.iter().map(|&x| x as f64).collect();
            if tolerance.starts_with("f16ulp") {
                let acc = check_accuracy(&exact, &row);
                eprintln!(
                    "{setup:9} {name:16} checked {:5}  max err {:.5} dB = {:.3} f16 ulp, \
                     {:.3} of the tolerance",
                    acc.checked, acc.max_abs_db, acc.max_ulps, acc.max_of_tolerance
                );
                worst_db = worst_db.max(acc.max_abs_db);
                worst_ulps = worst_ulps.max(acc.max_ulps);
                worst_tolerance = worst_tolerance.max(acc.max_of_tolerance);
                if acc.violations > 0 {
                    failures.push(format!(
                        "{setup}/{name}: {} values off; first (index, exact, stored) {:?}",
                        acc.violations, acc.first_violation
                    ));
                }
            } else if tolerance.starts_with("resampled") {
                // Within 0.5 dB where the reference is within 40 dB of its maximum; elsewhere
                // at least 30 dB below that maximum (no aliasing).
                let max = exact.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let mut off = 0;
                let mut err = 0f64;
                for (&e, s) in exact.iter().zip(&row) {
                    let s = s.to_f64();
                    if e >= max - 40.0 {
                        err = err.max((s - e).abs());
                        off += usize::from((s - e).abs() > 0.5);
                    } else {
                        off += usize::from(s > max - 30.0);
                    }
                }
                eprintln!("{setup:9} {name:16} resampled: max err {err:.4} dB (top 40 dB)");
                if off > 0 {
                    failures.push(format!("{setup}/{name}: {off} values off"));
                }
            } else {
                panic!("{name}: unknown tolerance {tolerance:?}");
            }
        }
        eprintln!(
            "{setup}: worst {worst_db:.5} dB, {worst_ulps:.3} f16 ulp, \
             {worst_tolerance:.3} of the tolerance"
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A row's bytes do not depend on what else is in the batch, its position, or the thread count.
#[test]
fn rows_do_not_depend_on_the_batch() {
    for (_, settings) in setups() {
        let wavs: Vec<(String, Waveform)> = valid_cases()
            .into_iter()
            .map(|(name, _)| {
                let w = load(&name, &settings);
                (name, w)
            })
            .collect();
        let row_len = settings.shape().row_len();
        let mut one = CpuFeaturiser::new(&settings, 1).unwrap();
        let alone: Vec<Vec<f16>> = wavs
            .iter()
            .map(|(_, w)| featurise(&mut one, &[w]))
            .collect();
        let mut two = CpuFeaturiser::new(&settings, 2).unwrap();
        let forward: Vec<&Waveform> = wavs.iter().map(|(_, w)| w).collect();
        let backward: Vec<&Waveform> = forward.iter().rev().cloned().collect();
        let rows_fwd = featurise(&mut two, &forward);
        let rows_bwd = featurise(&mut one, &backward);
        let n = wavs.len();
        for (i, (name, _)) in wavs.iter().enumerate() {
            let bits = |r: &[f16]| r.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
            let fwd = &rows_fwd[i * row_len..(i + 1) * row_len];
            let bwd = &rows_bwd[(n - 1 - i) * row_len..(n - i) * row_len];
            assert_eq!(bits(fwd), bits(&alone[i]), "{name}: batch vs alone");
            assert_eq!(
                bits(bwd),
                bits(&alone[i]),
                "{name}: reversed batch vs alone"
            );
        }
    }
}
