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

mod buffers;
mod compile;
mod featuriser;
mod libraries;
pub mod parity;
mod pipeline;
mod tables;

pub use compile::{
    compile, compile_options, supported_architectures, Compiled, KernelImage, ARCHITECTURES,
};
pub use featuriser::{CudaFeaturiser, DeviceTimes};
pub use libraries::{
    nvrtc_version, probe, probe_libraries, probe_libraries_with, probe_with, AskPython, CudaProbe,
    GpuInfo, LibrarySearch, LibraryStatus,
};
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

/// The GPU cannot be used because CUDA libraries are missing: every reason in full (`doctor`,
/// `--device cuda`'s error) and the first in a few words (the one log line of a CPU fallback).
#[derive(Debug)]
pub struct Unavailable {
    pub first: String,
    pub all: Vec<String>,
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.all.join("; "))
    }
}

impl std::error::Error for Unavailable {}

/// The longest [`fallback_line`], in characters.
pub const FALLBACK_LINE_MAX: usize = 160;

/// The one line `auto` logs when it featurises on the CPU because the GPU featuriser could not
/// start: the first reason, shortened to fit [`FALLBACK_LINE_MAX`]; `ailhd doctor` has them all.
pub fn fallback_line(error: &anyhow::Error) -> String {
    let reason = match error.downcast_ref::<Unavailable>() {
        Some(u) => u.first.clone(),
        None => format!("{error:#}")
            .lines()
            .next()
            .unwrap_or("")
            .to_string(),
    };
    let (head, tail) = (
        "no usable GPU (",
        "); featurising on the CPU \u{2014} see ailhd doctor",
    );
    let room = FALLBACK_LINE_MAX - head.chars().count() - tail.chars().count();
    let reason = if reason.chars().count() > room {
        let cut: String = reason.chars().take(room - 1).collect();
        format!("{}\u{2026}", cut.trim_end())
    } else {
        reason
    };
    format!("{head}{reason}{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fallback_line_is_short_and_names_the_first_reason() {
        let missing = anyhow::Error::new(Unavailable {
            first: "CUDA driver not found (libcuda.so.1)".into(),
            all: vec!["a very long reason ".repeat(40), "another".into()],
        });
        assert_eq!(
            fallback_line(&missing),
            "no usable GPU (CUDA driver not found (libcuda.so.1)); featurising on the CPU \u{2014} see ailhd doctor"
        );
        let long = anyhow::anyhow!("{}", "x".repeat(500)).context("GPU start-up self-check");
        let line = fallback_line(&long);
        assert_eq!(line.chars().count(), FALLBACK_LINE_MAX, "{line}");
        assert!(
            line.starts_with("no usable GPU (GPU start-up self-check: xxx"),
            "{line}"
        );
        assert!(
            line.ends_with("\u{2026}); featurising on the CPU \u{2014} see ailhd doctor"),
            "{line}"
        );
    }
}
