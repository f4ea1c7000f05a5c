//! Decode: WAV bytes -> mono waveform at `sample_rate`, padded or trimmed to `num_samples`
//! (CONTRACT.md, "Features", first paragraph). Every malformed input is a [`DecodeError`] that
//! says what is wrong; nothing here panics or allocates more than the input justifies.

/// A decoded recording, ready to featurise: mono, at the configured sample rate, exactly
/// `num_samples` long. 16-bit mono PCM at the target rate stays integer (the GPU path uploads
/// int16, half the bytes); everything else is float in [-1, 1).
#[derive(Debug, Clone, PartialEq)]
pub enum Waveform {
    /// Integer samples; the value is `s / 32768`.
    Pcm16(Vec<i16>),
    Float(Vec<f32>),
}

impl Waveform {
    pub fn len(&self) -> usize {
        match self {
            Waveform::Pcm16(v) => v.len(),
            Waveform::Float(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Sample i as float in [-1, 1).
    #[inline]
    pub fn sample(&self, i: usize) -> f32 {
        match self {
            Waveform::Pcm16(v) => v[i] as f32 * (1.0 / 32768.0),
            Waveform::Float(v) => v[i],
        }
    }
    /// Copy samples `start..start + dst.len()` into `dst` as float.
    pub fn copy_to_f32(&self, start: usize, dst: &mut [f32]) {
        match self {
            Waveform::Pcm16(v) => {
                let n = dst.len();
                for (d, s) in dst.iter_mut().zip(&v[start..start + n]) {
                    *d = *s as f32 * (1.0 / 32768.0);
                }
            }
            Waveform::Float(v) => dst.copy_from_slice(&v[start..start + dst.len()]),
        }
    }
}
