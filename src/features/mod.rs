//! Featurise: decoded waveforms -> rows of float16 decibel mel spectrograms, shaped
//! `[num_long, num_short, n_mels, t_frames]` (docs/design.md, "What a row is"). The CPU and CUDA paths
//! are two implementations of one [`Featuriser`] interface; both must give the same rows.

pub mod cpu;
pub mod cuda;
pub mod mel;
pub mod reference;

use crate::config::{DbMode, DeviceChoice, FeatureSettings, FeatureShape, Gpu};
use crate::decode::Waveform;
use half::f16;

/// Turns a batch of decoded recordings into rows. Implementations are built once (warm: FFT
/// plans, filterbank, device buffers) and reused for every batch.
pub trait Featuriser: Send {
    /// `cpu` or `cuda:<gpu name>`, for logs and `status`.
    fn name(&self) -> String;
    fn shape(&self) -> FeatureShape;
    /// Featurise `batch`; `out` holds `batch.len() * shape().row_len()` values, row i at
    /// `i * row_len`. A row depends only on its own waveform (never on the rest of the batch).
    fn featurise(&mut self, batch: &[&Waveform], out: &mut [f16]) -> anyhow::Result<()>;

    /// The pipelined form of [`featurise`](Featuriser::featurise), for a stage that keeps the
    /// device busy while it prepares the next batch: `submit` starts `batch` into `rows`
    /// (`batch.len() * row_len` values, taken over; the waveforms are no longer needed when it
    /// returns) and [`finish`](Featuriser::finish) hands the rows back, oldest batch first, the
    /// same rows `featurise` gives. Up to [`depth`](Featuriser::depth) batches can be in flight
    /// before `submit` itself waits for the device. On the CPU, `submit` does the work and
    /// `finish` only returns it. `featurise` refuses to run while submitted batches are not
    /// finished.
    fn submit(&mut self, batch: &[&Waveform], rows: Vec<f16>) -> anyhow::Result<()>;
    /// The rows of the oldest submitted batch (waiting for the device); None when none is left.
    fn finish(&mut self) -> anyhow::Result<Option<Vec<f16>>>;
    /// How many submitted batches the device overlaps (1 where `submit` does the work itself).
    fn depth(&self) -> usize {
        1
    }
    /// Recordings per batch in a bulk run. On the CPU, small enough that filling and draining
    /// the pipeline costs little and the batches in flight hold little memory (a recording
    /// holds about 90 KB until featurised); a GPU wants larger ones.
    fn bulk_batch(&self) -> usize {
        256
    }
    /// A GPU's own stage times (staging, upload, kernels, download); None on the CPU.
    fn device_times(&self) -> Option<cuda::DeviceTimes> {
        None
    }
}

/// Build the featuriser for `choice`: `Cpu` always works; `Cuda` fails with the reason when no
/// usable GPU is present; `Auto` tries CUDA and falls back to the CPU with one short log line
/// ([`cuda::fallback_line`]; every reason at debug level and in `ailhd doctor`). `gpu` says where
/// else to look for the CUDA libraries; `Cpu` looks for nothing.
pub fn build(
    settings: &FeatureSettings,
    gpu: &Gpu,
    choice: DeviceChoice,
    threads: usize,
) -> anyhow::Result<Box<dyn Featuriser>> {
    let search = cuda::LibrarySearch::for_featuriser(gpu);
    match choice {
        DeviceChoice::Cpu => Ok(Box::new(cpu::CpuFeaturiser::new(settings, threads)?)),
        DeviceChoice::Cuda => Ok(Box::new(cuda::CudaFeaturiser::with_libraries(
            settings, &search,
        )?)),
        DeviceChoice::Auto => match cuda::CudaFeaturiser::with_libraries(settings, &search) {
            Ok(f) => Ok(Box::new(f)),
            Err(e) => {
                log::warn!("{}", cuda::fallback_line(&e));
                log::debug!("why the GPU is not used: {e:#}");
                Ok(Box::new(cpu::CpuFeaturiser::new(settings, threads)?))
            }
        },
    }
}

/// The FFT's element type, on every device. f32 rounding puts an error of ~1e-8 of a frame's
/// largest bin into every bin. The accuracy rule looks at values down to 100 dB (1e-5 in amplitude) below the
/// recording's maximum, with ~1e-3 relative precision: for a magnitude spectrogram of a tonal
/// 16-bit recording, the quantisation floor lands right there and an f32 FFT breaks the rule
/// (test `f32_fft_is_not_enough_for_magnitude_spectrograms` in `cpu`: errors up to 1.9x the
/// tolerance; f64: 0.0005x; on an H100, cuFFT's R2C broke it by up to 52x on the `tone_8192hz`
/// fixture, its D2Z held). Where a top_db clamp of at most 80 dB replaces everything deeper by a
/// constant, f32 stays under 0.1x the tolerance on the same signals and is twice as fast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    F64,
}

impl Precision {
    pub fn for_settings(settings: &FeatureSettings) -> Precision {
        let depth = match (settings.db, settings.top_db) {
            (DbMode::AmplitudeToDb, Some(top_db)) => top_db.min(100.0),
            _ => 100.0,
        };
        if depth <= 80.0 {
            Precision::F32
        } else {
            Precision::F64
        }
    }
}
