//! Featurise: decoded waveforms -> rows of float16 decibel mel spectrograms, shaped
//! `[num_long, num_short, n_mels, t_frames]` (CONTRACT.md, "Features"). The CPU and CUDA paths
//! are two implementations of one [`Featuriser`] interface; both must give the same rows.

pub mod cpu;
pub mod cuda;
pub mod mel;

use crate::config::{DeviceChoice, FeatureSettings, FeatureShape};
use crate::decode::Waveform;
use half::f16;

/// Turns a batch of decoded recordings into rows. Implementations are built once (warm: FFT
/// plans, filterbank, device buffers) and reused for every batch.
pub trait Featuriser: Send {
    /// "cpu" or "cuda:<gpu name>", for logs and `status`.
    fn name(&self) -> String;
    fn shape(&self) -> FeatureShape;
    /// Featurise `batch`; `out` holds `batch.len() * shape().row_len()` values, row i at
    /// `i * row_len`. A row depends only on its own waveform (never on the rest of the batch).
    fn featurise(&mut self, batch: &[&Waveform], out: &mut [f16]) -> anyhow::Result<()>;
}

/// Build the featuriser for `choice`: `Cpu` always works; `Cuda` fails with the reason when no
/// usable GPU is present; `Auto` tries CUDA and falls back to the CPU with one log line.
pub fn build(
    settings: &FeatureSettings,
    choice: DeviceChoice,
    threads: usize,
) -> anyhow::Result<Box<dyn Featuriser>> {
    match choice {
        DeviceChoice::Cpu => Ok(Box::new(cpu::CpuFeaturiser::new(settings, threads)?)),
        DeviceChoice::Cuda => Ok(Box::new(cuda::CudaFeaturiser::new(settings)?)),
        DeviceChoice::Auto => match cuda::CudaFeaturiser::new(settings) {
            Ok(f) => Ok(Box::new(f)),
            Err(e) => {
                log::warn!("no usable GPU, featurising on the CPU: {e:#}");
                Ok(Box::new(cpu::CpuFeaturiser::new(settings, threads)?))
            }
        },
    }
}
