//! The per-chunk work on the device: staging buffers and streams
//! ([`Slot`](super::buffers::Slot)), the host copy into pinned memory, the asynchronous upload,
//! the kernels and FFT, the download, and collecting the rows; a batch larger than one chunk is
//! pipelined over the slots.

use super::buffers::{FftBuffers, InFlight, InputPath, Pending};
use super::featuriser::CudaFeaturiser;
use super::FINALIZE_THREADS;
use crate::decode::Waveform;
use anyhow::{anyhow, Context};
use cudarc::driver::{CudaEvent, LaunchConfig, PushKernelArg};
use half::f16;
use rayon::prelude::*;

impl CudaFeaturiser {
    /// Host: copy `files` into slot `s`'s pinned staging (in parallel: at 80 KB a recording this
    /// copy, not the GPU, is the slowest step of a chunk); then queue the upload.
    pub(super) fn stage(&mut self, s: usize, files: &[&Waveform]) -> anyhow::Result<()> {
        let n = self.shape.num_samples;
        let cap = self.chunk_files * n;
        let slot = &mut self.slots[s];
        // The previous upload from this staging must be finished before we overwrite it.
        slot.uploaded.synchronize()?;
        let staging_started = std::time::Instant::now();
        slot.files = files.len();
        slot.path = if files.iter().all(|w| matches!(w, Waveform::Pcm16(_))) {
            InputPath::Pcm16
        } else {
            InputPath::Float
        };
        match slot.path {
            InputPath::Pcm16 => {
                let host = slot.pcm_host.as_mut_slice()?;
                host[..files.len() * n]
                    .par_chunks_mut(n)
                    .zip(files.par_iter())
                    .for_each(|(dst, w)| {
                        if let Waveform::Pcm16(v) = w {
                            dst.copy_from_slice(v);
                        }
                    });
                self.times.stage += staging_started.elapsed().as_secs_f64();
                slot.upload_start.record(&self.upload)?;
                self.upload
                    .memcpy_htod(&host[..files.len() * n], &mut slot.pcm_dev)?;
            }
            InputPath::Float => {
                if slot.float_host.is_none() {
                    // SAFETY: uninitialised pinned memory, zeroed at once.
                    let mut host = unsafe { self.ctx.alloc_pinned::<f32>(cap) }?;
                    host.as_mut_slice()?.fill(0.0);
                    slot.float_dev = Some(self.compute.alloc_zeros::<f32>(cap)?);
                    slot.float_host = Some(host);
                }
                let (Some(host), Some(dev)) = (slot.float_host.as_mut(), slot.float_dev.as_mut())
                else {
                    unreachable!("float staging was just made");
                };
                let host = host.as_mut_slice()?;
                // int16 -> float is exact (a power-of-two scale), as in Waveform::sample.
                host[..files.len() * n]
                    .par_chunks_mut(n)
                    .zip(files.par_iter())
                    .for_each(|(dst, w)| w.copy_to_f32(0, dst));
                self.times.stage += staging_started.elapsed().as_secs_f64();
                slot.upload_start.record(&self.upload)?;
                self.upload.memcpy_htod(&host[..files.len() * n], dev)?;
            }
        }
        slot.uploaded.record(&self.upload)?;
        Ok(())
    }

    /// Device: kernels and FFT for the chunk staged in slot `s`, then queue the download.
    pub(super) fn compute_and_download(&mut self, s: usize) -> anyhow::Result<()> {
        let files = self.slots[s].files;
        let slot = &self.slots[s];
        // Explicitly after the upload (cudarc would also order the kernels after it), so that
        // compute_start marks when the kernels can run.
        self.compute.wait(&slot.uploaded)?;
        slot.compute_start.record(&self.compute)?;
        self.launch_framing(s)?;
        self.run_fft(files)?;
        self.launch_power_mel_db(files)?;
        self.launch_finalize_rows(s)?;
        self.queue_download(s)
    }

    /// `frame_<input>_<precision>`: slot `s`'s recordings into windowed FFT frames.
    fn launch_framing(&mut self, s: usize) -> anyhow::Result<()> {
        let g = self.geometry;
        let slot = &self.slots[s];
        let n = slot.files as i32;
        let frames = slot.files * g.frames_per_file as usize;
        let cfg = self.grid(frames * g.n_fft as usize);
        let (function, what) = match slot.path {
            InputPath::Pcm16 => (&self.kernels.frame_pcm16, "frame_pcm16"),
            InputPath::Float => (&self.kernels.frame_f32, "frame_f32"),
        };
        let mut launch = self.compute.launch_builder(function);
        launch.arg(&g);
        match slot.path {
            InputPath::Pcm16 => launch.arg(&slot.pcm_dev),
            InputPath::Float => launch.arg(slot.float_dev.as_ref().expect("staged as float")),
        };
        match &mut self.fft {
            FftBuffers::F32 { window, frames, .. } => launch.arg(&*window).arg(frames),
            FftBuffers::F64 { window, frames, .. } => launch.arg(&*window).arg(frames),
        };
        launch.arg(&n);
        // SAFETY: arguments match `frame_<input>_<precision>(Geometry, const <input>*, const
        // <real>*, <real>*, int)`; the buffers hold chunk_files recordings >= n.
        unsafe { launch.launch(cfg) }.with_context(|| format!("launching {what}"))?;
        Ok(())
    }

    /// The frames of `files` recordings into spectra: one plan, group by group (see
    /// PLAN_FILES). The last group's frames beyond the chunk's are stale; their spectra are
    /// never read.
    fn run_fft(&mut self, files: usize) -> anyhow::Result<()> {
        let g = self.geometry;
        let plan = self.plan.as_ref().expect("plan lives until drop");
        let group_frames = self.plan_files * g.frames_per_file as usize;
        let (real_len, bins_len) = (
            group_frames * g.n_fft as usize,
            group_frames * g.n_freqs as usize,
        );
        for group in 0..files.div_ceil(self.plan_files) {
            let (r, b) = (group * real_len, group * bins_len);
            match &mut self.fft {
                FftBuffers::F32 {
                    frames, spectrum, ..
                } => plan
                    .exec_r2c(
                        &frames.slice(r..r + real_len),
                        &mut spectrum.slice_mut(b..b + bins_len),
                    )
                    .map_err(|e| anyhow!("cuFFT R2C failed: {e}"))?,
                FftBuffers::F64 {
                    frames, spectrum, ..
                } => plan
                    .exec_d2z(
                        &frames.slice(r..r + real_len),
                        &mut spectrum.slice_mut(b..b + bins_len),
                    )
                    .map_err(|e| anyhow!("cuFFT D2Z failed: {e}"))?,
            }
        }
        Ok(())
    }

    /// `power_mel_db_<precision>`: the spectra of `files` recordings into mel dB.
    fn launch_power_mel_db(&mut self, files: usize) -> anyhow::Result<()> {
        let g = self.geometry;
        let n = files as i32;
        let frames = files * g.frames_per_file as usize;
        let cfg = self.grid(frames * g.n_mels as usize);
        let mut launch = self.compute.launch_builder(&self.kernels.power_mel_db);
        launch.arg(&g);
        match &self.fft {
            FftBuffers::F32 { spectrum, .. } => launch.arg(spectrum),
            FftBuffers::F64 { spectrum, .. } => launch.arg(spectrum),
        };
        launch
            .arg(&self.mel_start)
            .arg(&self.mel_offset)
            .arg(&self.mel_weights)
            .arg(&mut self.mel_db)
            .arg(&n);
        // SAFETY: `power_mel_db_<precision>(Geometry, const <real>* (interleaved complex), const
        // int*, const int*, const float*, float*, int)`.
        unsafe { launch.launch(cfg) }.context("launching power_mel_db")?;
        Ok(())
    }

    /// `finalize_rows`: mel dB into slot `s`'s f16 rows; marks the end of the computing.
    fn launch_finalize_rows(&mut self, s: usize) -> anyhow::Result<()> {
        let g = self.geometry;
        let files = self.slots[s].files;
        let n = files as i32;
        let cfg = LaunchConfig {
            grid_dim: (files.min(self.sm_count as usize * 8).max(1) as u32, 1, 1),
            block_dim: (FINALIZE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let slot = &mut self.slots[s];
        let mut launch = self.compute.launch_builder(&self.kernels.finalize_rows);
        launch
            .arg(&g)
            .arg(&self.mel_db)
            .arg(&mut slot.rows_dev)
            .arg(&n);
        // SAFETY: `finalize_rows(Geometry, const float*, unsigned short*, int)` with exactly
        // FINALIZE_THREADS threads per block.
        unsafe { launch.launch(cfg) }.context("launching finalize_rows")?;
        slot.compute_end.record(&self.compute)?;
        Ok(())
    }

    /// Queue the copy of slot `s`'s rows to the host.
    fn queue_download(&mut self, s: usize) -> anyhow::Result<()> {
        let slot = &mut self.slots[s];
        let len = slot.files * self.geometry.row_len as usize;
        let host = slot.rows_host.as_mut_slice()?;
        let rows = slot.rows_dev.slice(0..len);
        self.download.memcpy_dtoh(&rows, &mut host[..len])?;
        slot.downloaded.record(&self.download)?;
        Ok(())
    }

    /// Host: wait for slot `s`'s rows and copy them out.
    pub(super) fn collect(&mut self, s: usize, out: &mut [f16]) -> anyhow::Result<()> {
        let slot = &mut self.slots[s];
        let waiting = std::time::Instant::now();
        slot.downloaded
            .synchronize()
            .context("waiting for the GPU (an earlier kernel may have failed)")?;
        self.times.wait += waiting.elapsed().as_secs_f64();
        // All of the slot's events have completed: add up its device times.
        let ms = |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).map(|t| t as f64 * 1e-3);
        self.times.upload += ms(&slot.upload_start, &slot.uploaded)?;
        self.times.compute += ms(&slot.compute_start, &slot.compute_end)?;
        self.times.download += ms(&slot.compute_end, &slot.downloaded)?;
        self.times.chunks += 1;
        let host = slot.rows_host.as_slice()?;
        let len = out.len();
        bytemuck::cast_slice_mut::<f16, u16>(out).copy_from_slice(&host[..len]);
        Ok(())
    }

    /// The chunk `files` (recordings `offset / row_len ..` of its batch) onto the device through
    /// the next slot: when that slot still holds an earlier chunk, its rows are collected first
    /// (into `out` for a `featurise` call, into its batch's buffer for a submitted one). The host
    /// copy of this chunk then runs while the GPU works on the chunks already queued.
    fn launch_chunk(
        &mut self,
        files: &[&Waveform],
        batch: Option<u64>,
        offset: usize,
        out: &mut [f16],
    ) -> anyhow::Result<()> {
        let s = self.ring.next_slot;
        if self.ring.in_flight.len() == self.slots.len() {
            self.collect_oldest(out)?;
        }
        debug_assert!(self.ring.in_flight.iter().all(|c| c.slot != s));
        self.stage(s, files)?;
        self.compute_and_download(s)?;
        self.ring.in_flight.push_back(InFlight {
            slot: s,
            batch,
            offset,
            len: files.len() * self.shape.row_len(),
        });
        self.ring.next_slot = (s + 1) % self.slots.len();
        Ok(())
    }

    /// Wait for the oldest chunk on the device and copy its rows to where they belong.
    fn collect_oldest(&mut self, out: &mut [f16]) -> anyhow::Result<()> {
        let c = self
            .ring
            .in_flight
            .pop_front()
            .expect("a chunk is in flight");
        match c.batch {
            None => self.collect(c.slot, &mut out[c.offset..c.offset + c.len]),
            Some(seq) => {
                let first = self.ring.pending.front().expect("its batch is pending").seq;
                let i = usize::try_from(seq - first).expect("pending batches are few");
                let mut rows = std::mem::take(&mut self.ring.pending[i].rows);
                let collected = self.collect(c.slot, &mut rows[c.offset..c.offset + c.len]);
                let pending = &mut self.ring.pending[i];
                pending.rows = rows;
                pending.chunks_left -= 1;
                collected
            }
        }
    }

    /// `featurise`: every chunk through the ring, then wait for the last ones.
    pub(super) fn run_batch(&mut self, batch: &[&Waveform], out: &mut [f16]) -> anyhow::Result<()> {
        debug_assert!(self.ring.pending.is_empty());
        self.ctx.bind_to_thread()?;
        let row_len = self.shape.row_len();
        for start in (0..batch.len()).step_by(self.chunk_files) {
            let end = (start + self.chunk_files).min(batch.len());
            self.launch_chunk(&batch[start..end], None, start * row_len, out)?;
        }
        while !self.ring.in_flight.is_empty() {
            self.collect_oldest(out)?;
        }
        // Errors cudarc recorded where it could not return them (event records in drops).
        self.ctx.check_err()?;
        Ok(())
    }

    /// `submit`: queue the batch's chunks; nothing waits but for a slot to reuse.
    pub(super) fn submit_batch(
        &mut self,
        batch: &[&Waveform],
        rows: Vec<f16>,
    ) -> anyhow::Result<()> {
        self.ctx.bind_to_thread()?;
        let seq = self.ring.next_batch;
        self.ring.next_batch += 1;
        self.ring.pending.push_back(Pending {
            seq,
            rows,
            chunks_left: batch.len().div_ceil(self.chunk_files),
        });
        let row_len = self.shape.row_len();
        for start in (0..batch.len()).step_by(self.chunk_files) {
            let end = (start + self.chunk_files).min(batch.len());
            // A submitted batch never has a `featurise` chunk before it: no `out` needed.
            self.launch_chunk(&batch[start..end], Some(seq), start * row_len, &mut [])?;
        }
        Ok(())
    }

    /// `finish`: the oldest submitted batch's rows, once all its chunks are collected.
    pub(super) fn finish_batch(&mut self) -> anyhow::Result<Option<Vec<f16>>> {
        while self.ring.pending.front().is_some_and(|p| p.chunks_left > 0) {
            self.collect_oldest(&mut [])?;
        }
        self.ctx.check_err()?;
        Ok(self.ring.pending.pop_front().map(|p| p.rows))
    }
}
