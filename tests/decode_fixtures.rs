//! The shared fixture recordings through `ailhd::decode`: every valid one decodes to 10 s at
//! 4096 Hz with the values its encoding implies, every invalid one is rejected with a reason that
//! names its problem. The list comes from `cases.json`, so a new fixture without an expectation
//! here fails the test instead of going unchecked.

use crate::common::fixtures;
use ailhd::decode::{decode, parse_header, SampleFormat, Waveform};

const RATE: u32 = 4096;
const N: usize = 40960; // 10 s

fn read(name: &str) -> Vec<u8> {
    let path = fixtures().join("wav").join(format!("{name}.wav"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn samples(name: &str) -> Vec<f32> {
    let w = decode(&read(name), RATE, N).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut v = vec![0.0; w.len()];
    w.copy_to_f32(0, &mut v);
    v
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The words an operator must find in the reason a fixture is rejected with.
fn expected_reason(name: &str) -> Option<&'static [&'static str]> {
    Some(match name {
        "truncated" => &["truncated", "data chunk declares 81920 bytes"],
        "empty" => &["empty file"],
        "not_a_wav" => &["not a WAV file"],
        "zero_channels" => &["0 channels"],
        "recording_in_progress" => &["recording in progress", "placeholder"],
        "no_data_chunk" => &["no data chunk"],
        "alaw" => &["unsupported encoding", "A-law"],
        "huge_fmt" => &["chunk `fmt` claims", "more than the file"],
        _ => return None,
    })
}

fn cases() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(fixtures().join("cases.json")).expect("cases.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("cases.json is JSON");
    let cases = json["cases"].as_object().expect("cases.json has `cases`");
    cases
        .iter()
        .map(|(name, case)| {
            let kind = case["kind"].as_str().expect("every case has a kind");
            (name.clone(), kind.to_string())
        })
        .collect()
}

#[test]
fn valid_fixtures_decode_to_ten_seconds_at_4096_hz() {
    let mut seen = 0;
    for (name, kind) in cases() {
        if kind != "valid" {
            continue;
        }
        seen += 1;
        let bytes = read(&name);
        let info = parse_header(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let w = decode(&bytes, RATE, N).unwrap();
        assert_eq!(w.len(), N, "{name}");
        // The common case stays integer; everything else is float.
        let fast =
            info.format == SampleFormat::Pcm16 && info.channels == 1 && info.sample_rate == RATE;
        assert_eq!(matches!(w, Waveform::Pcm16(_)), fast, "{name}");
        let v = samples(&name);
        assert!(
            v.iter().all(|x| x.is_finite() && x.abs() <= 1.0),
            "{name}: out of range"
        );
        let rms = (v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / N as f64).sqrt();
        if name.starts_with("silence") {
            assert_eq!(rms, 0.0, "{name}");
        } else {
            assert!(rms > 0.01, "{name}: rms {rms}");
        }
    }
    assert!(seen >= 10, "only {seen} valid fixtures found");
}

#[test]
fn invalid_fixtures_are_rejected_with_their_problem() {
    let mut seen = 0;
    for (name, kind) in cases() {
        if kind != "invalid" {
            continue;
        }
        seen += 1;
        let words = expected_reason(&name)
            .unwrap_or_else(|| panic!("new invalid fixture {name}: add its expected reason"));
        let bytes = read(&name);
        let e = decode(&bytes, RATE, N).expect_err(&name);
        assert_eq!(parse_header(&bytes).expect_err(&name), e, "{name}");
        let msg = e.to_string();
        for w in words {
            assert!(msg.contains(w), "{name}: {msg:?} does not mention {w:?}");
        }
        // A watcher waits for these instead of quarantining them at once.
        let incomplete = matches!(name.as_str(), "truncated" | "recording_in_progress");
        assert_eq!(e.is_incomplete(), incomplete, "{name}: {msg}");
    }
    assert!(seen >= 8, "only {seen} invalid fixtures found");
}

/// Several fixtures hold the same recording in another encoding or layout: they must agree to
/// within the coarser encoding's quantisation.
#[test]
fn encodings_of_one_recording_agree() {
    let leak = samples("leak_pcm16");
    let tone = samples("tone_pcm16");
    let half_lsb16 = 1.0 / 65536.0;
    assert_eq!(samples("leak_extensible"), leak);
    assert_eq!(samples("tone_listchunk"), tone);
    assert!(max_diff(&samples("leak_float32"), &leak) <= half_lsb16);
    assert!(max_diff(&samples("tone_pcm32"), &tone) <= half_lsb16);
    assert!(max_diff(&samples("chirp_pcm24"), &samples("chirp_pcm16")) <= half_lsb16);
    assert!(max_diff(&samples("tone_u8"), &tone) <= 1.0 / 256.0);
    // 12 s trimmed to the first 10 s; 7 s padded with silence.
    assert_eq!(samples("long12s_pcm16"), leak);
    let short = samples("short7s_pcm16");
    assert_eq!(short[..7 * 4096], leak[..7 * 4096]);
    assert!(short[7 * 4096..].iter().all(|x| *x == 0.0));
}

#[test]
fn stereo_is_the_average_of_its_channels() {
    let bytes = read("stereo_pcm16");
    let info = parse_header(&bytes).unwrap();
    assert_eq!(info.channels, 2);
    let data = &bytes[info.data_offset..info.data_offset + info.data_len];
    let want: Vec<f32> = data
        .chunks_exact(4)
        .map(|f| {
            let l = i16::from_le_bytes([f[0], f[1]]) as f32;
            let r = i16::from_le_bytes([f[2], f[3]]) as f32;
            (l + r) / 2.0 / 32768.0
        })
        .collect();
    assert_eq!(samples("stereo_pcm16"), want);
}

/// Amplitude of the component at `f` Hz in a signal sampled at 4096 Hz (a Hann-windowed DFT bin).
fn amplitude_at(x: &[f32], f: f64) -> f64 {
    let n = x.len() as f64;
    let (mut re, mut im, mut wsum) = (0.0, 0.0, 0.0);
    for (i, &v) in x.iter().enumerate() {
        let w = 0.5 - 0.5 * (std::f64::consts::TAU * i as f64 / n).cos();
        let ph = std::f64::consts::TAU * f * i as f64 / f64::from(RATE);
        re += w * f64::from(v) * ph.cos();
        im -= w * f64::from(v) * ph.sin();
        wsum += w;
    }
    2.0 * (re * re + im * im).sqrt() / wsum
}

#[test]
fn tone_8192hz_is_resampled_without_aliasing() {
    let bytes = read("tone_8192hz");
    assert_eq!(parse_header(&bytes).unwrap().sample_rate, 8192);
    let v = samples("tone_8192hz");
    // The recording holds ~451 Hz plus 3 kHz; 3 kHz is above the new Nyquist frequency (2048 Hz)
    // and would fold to 4096 - 3000 = 1096 Hz without an anti-aliasing filter.
    let main = amplitude_at(&v, 451.2);
    let alias = amplitude_at(&v, 1096.0);
    let db = 20.0 * (alias / main).log10();
    assert!(main > 0.1, "main component {main}");
    assert!(
        db < -30.0,
        "alias at 1096 Hz only {db:.1} dB below the main component"
    );
}
