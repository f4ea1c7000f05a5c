//! The device-side state of the CUDA featuriser: the staging slots, the kernels of one
//! precision, the FFT buffers, and the ring of chunks in flight. [`super::featuriser`] owns
//! them; [`super::pipeline`] drives them.

use cudarc::cufft;
use cudarc::driver::{CudaEvent, CudaFunction, CudaSlice, PinnedHostSlice};
use half::f16;
use std::collections::VecDeque;

/// Which kernel 1 a staged chunk needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum InputPath {
    /// Every recording in the chunk is int16: upload int16 (half the bytes of float).
    Pcm16,
    /// At least one float recording: upload the whole chunk as float (int16 converts exactly).
    Float,
}

/// Staging for one in-flight chunk. There are [`SLOTS`](super::SLOTS), so chunk k+1 is staged and uploaded while
/// chunk k computes.
pub(super) struct Slot {
    pub(super) pcm_host: PinnedHostSlice<i16>,
    pub(super) pcm_dev: CudaSlice<i16>,
    /// Float path buffers, made the first time this slot stages a float recording (for one
    /// slot, that is the start-up self-check): these are twice the size of the int16 ones, and
    /// the other slots' are only needed by hosts that see float recordings.
    pub(super) float_host: Option<PinnedHostSlice<f32>>,
    pub(super) float_dev: Option<CudaSlice<f32>>,
    pub(super) rows_dev: CudaSlice<u16>,
    pub(super) rows_host: PinnedHostSlice<u16>,
    /// Recorded after the upload from `*_host`: the host waits on it before restaging. (cudarc
    /// tracks device buffers itself, but not plain slices of pinned memory, which is what we copy
    /// so that a partial chunk transfers only its own bytes.)
    pub(super) uploaded: CudaEvent,
    /// Timing marks (see [`DeviceTimes`](super::DeviceTimes)): before the upload, when the kernels may start (the
    /// upload is done), after the last kernel.
    pub(super) upload_start: CudaEvent,
    pub(super) compute_start: CudaEvent,
    pub(super) compute_end: CudaEvent,
    /// Recorded after the download into `rows_host`: the host waits on it before reading.
    pub(super) downloaded: CudaEvent,
    pub(super) files: usize,
    pub(super) path: InputPath,
}

/// The kernels of one precision (`frame_pcm16_f64` etc. for [`Precision::F64`](crate::features::Precision::F64)).
pub(super) struct Kernels {
    pub(super) frame_pcm16: CudaFunction,
    pub(super) frame_f32: CudaFunction,
    pub(super) power_mel_db: CudaFunction,
    pub(super) finalize_rows: CudaFunction,
}

/// The FFT stage's buffers in the precision the accuracy rule needs: the window, one chunk's
/// frames and their spectra (scratch of the compute stream, shared by the slots).
pub(super) enum FftBuffers {
    F32 {
        window: CudaSlice<f32>,
        frames: CudaSlice<f32>,
        spectrum: CudaSlice<cufft::sys::float2>,
    },
    F64 {
        window: CudaSlice<f64>,
        frames: CudaSlice<f64>,
        spectrum: CudaSlice<cufft::sys::double2>,
    },
}

/// What is on the device, oldest first, and the submitted batches waiting for their rows.
#[derive(Default)]
pub(super) struct Ring {
    pub(super) in_flight: VecDeque<InFlight>,
    pub(super) pending: VecDeque<Pending>,
    /// The slot the next chunk goes through (round robin: the oldest chunk in flight holds it
    /// when all slots are busy).
    pub(super) next_slot: usize,
    pub(super) next_batch: u64,
}

/// One chunk on the device.
pub(super) struct InFlight {
    pub(super) slot: usize,
    /// The submitted batch it belongs to; None for the running `featurise` call.
    pub(super) batch: Option<u64>,
    /// Where its rows go in that batch's rows (values).
    pub(super) offset: usize,
    pub(super) len: usize,
}

/// A submitted batch: its rows, filled as its chunks are collected.
pub(super) struct Pending {
    pub(super) seq: u64,
    pub(super) rows: Vec<f16>,
    pub(super) chunks_left: usize,
}
