//! CUDA featuriser: the rows of the CPU path, computed on an NVIDIA GPU through cudarc. Everything
//! is built once in [`CudaFeaturiser::new`] (context, NVRTC-compiled kernels, cuFFT plans, the mel
//! filterbank, pinned staging and device buffers) and reused; `featurise` only copies and launches.
//! The CUDA libraries are loaded at run time: on a host without them `new` returns an error naming
//! what is missing, and [`super::build`] falls back to the CPU.
//!
//! Per chunk of recordings: int16 (or float) samples -> pinned staging -> device (upload stream);
//! `frame_*` (frames x periodic Hann) -> cuFFT R2C or D2Z (the FFT precision the accuracy rule
//! needs, [`super::Precision`]; one plan of [`PLAN_FILES`] recordings for every batch size) ->
//! `power_mel_db_*` -> `finalize_rows` (per-recording top_db clamp, float16) on the compute
//! stream; rows -> pinned (download stream) -> the caller. Chunks go round robin through
//! [`SLOTS`] staging slots: the host copies chunk k while the GPU uploads, computes and downloads
//! the chunks before it, and waits only when it needs a slot back. `featurise` waits for its own
//! last chunks; `submit`/`finish` (the [`Featuriser`](super::Featuriser) trait) keep batches in
//! flight across calls, so consecutive batches overlap too. Kernels: `kernels/features.cu`.
//!
//! Files: this one, the constants shared by the host code and the kernels; `libraries.rs`, finding
//! the CUDA libraries and GPUs (`doctor` and start-up); `tables.rs`, what the kernels are given
//! (geometry, window, filterbank) and how much a chunk holds; `compile.rs`, NVRTC; `featuriser.rs`,
//! building the featuriser and its start-up self-check; `pipeline.rs`, staging, streams and the
//! per-chunk work; `parity.rs`, checking rows against the float64 reference.

mod compile;
mod featuriser;
mod libraries;
pub mod parity;
mod pipeline;
mod tables;

pub use featuriser::{CudaFeaturiser, DeviceTimes};
pub use libraries::{probe, probe_libraries, CudaProbe, GpuInfo, LibraryStatus};
pub use tables::{Geometry, KernelTables, GEOMETRY_FIELDS};

/// The kernels, compiled by NVRTC at start-up (not at build time: no CUDA toolkit is needed to
/// build, and the code is compiled for the GPU actually present).
pub const KERNEL_SOURCE: &str = include_str!("../../../kernels/features.cu");

/// Entry points of [`KERNEL_SOURCE`], in pipeline order.
pub const KERNEL_ENTRY_POINTS: [&str; 7] = [
    "frame_pcm16_f32",
    "frame_f32_f32",
    "frame_pcm16_f64",
    "frame_f32_f64",
    "power_mel_db_f32",
    "power_mel_db_f64",
    "finalize_rows",
];

/// Threads per block of `finalize_rows`; must equal `FINALIZE_THREADS` in the kernel source,
/// whose shared-memory reduction is sized by it.
pub const FINALIZE_THREADS: u32 = 256;

/// Threads per block of the grid-stride kernels.
const BLOCK_THREADS: u32 = 256;

/// Frames buffer budget, in samples per chunk (128 MiB as float32, 256 MiB as float64; the
/// spectrum takes about as much again). Bounds device memory whatever the batch size: bigger batches are cut into chunks.
const FRAME_BUDGET_SAMPLES: usize = 1 << 25;

/// Upper bound on recordings per chunk (the "max batch").
const MAX_CHUNK_FILES: usize = 4096;

/// Recordings per cuFFT execution. A chunk is transformed in groups of this many with ONE plan,
/// whatever the batch size, so a recording's spectrum never depends on how many others came with
/// it (the determinism rule: plans for other batch sizes may pick other algorithms). A small
/// batch transforms one whole group, idle frames included (tens of microseconds on an H100).
const PLAN_FILES: usize = 64;

/// Staging slots: triple buffering. While the host copies chunk k into one slot, the GPU works
/// on chunks k-1 and k-2 in the others (upload, kernels and download on three streams).
const SLOTS: usize = 3;
