//! The CUDA featuriser: built once (context, kernels, FFT plan, every buffer), checked against the
//! float64 reference before anyone relies on it, then kept warm; `featurise` hands batches to
//! the chunk pipeline (`pipeline.rs`).

use super::buffers::{FftBuffers, InputPath, Kernels, Ring, Slot};
use super::compile::{load_kernels, nvrtc_compile, targets_for};
use super::libraries::{guarded, panic_message, probe_libraries_with, LibrarySearch};
use super::parity;
use super::tables::{chunk_files_for, device_bytes, Geometry, KernelTables};
use super::Unavailable;
use super::{BLOCK_THREADS, PLAN_FILES, SLOTS};
use crate::config::{FeatureSettings, FeatureShape};
use crate::decode::Waveform;
use crate::features::{mel, reference, Featuriser, Precision};
use anyhow::{anyhow, bail, ensure, Context};
use cudarc::cufft::{self, CudaFft};
use cudarc::driver::{sys as dsys, CudaContext, CudaSlice, CudaStream, LaunchConfig};
use half::f16;
use serde::Serialize;
use std::sync::Arc;
/// Featurises on one NVIDIA GPU (ordinal 0). Built once, then kept warm.
pub struct CudaFeaturiser {
    pub(super) shape: FeatureShape,
    pub(super) geometry: Geometry,
    /// `cuda:<gpu name>`.
    pub(super) name: String,
    /// Recordings per chunk (see [`chunk_files_for`]); bigger batches are pipelined chunk by chunk.
    pub(super) chunk_files: usize,
    /// Caps the grid of the grid-stride kernels.
    pub(super) sm_count: u32,
    pub(super) kernels: Kernels,
    /// One batched R2C or D2Z plan for [`PLAN_FILES`] recordings, run group by group over a
    /// chunk, whatever the batch size. Made in `new`; `None` only while dropping.
    pub(super) plan: Option<CudaFft>,
    /// Recordings the plan transforms per execution: always [`PLAN_FILES`].
    pub(super) plan_files: usize,
    pub(super) fft: FftBuffers,
    pub(super) mel_start: CudaSlice<i32>,
    pub(super) mel_offset: CudaSlice<i32>,
    pub(super) mel_weights: CudaSlice<f32>,
    /// Scratch of the compute stream, shared by the slots (kernels run one chunk at a time).
    pub(super) mel_db: CudaSlice<f32>,
    /// [`SLOTS`] staging slots, used round robin.
    pub(super) slots: Vec<Slot>,
    /// The chunks on the device and the submitted batches waiting for their rows.
    pub(super) ring: Ring,
    pub(super) compute: Arc<CudaStream>,
    pub(super) upload: Arc<CudaStream>,
    pub(super) download: Arc<CudaStream>,
    pub(super) ctx: Arc<CudaContext>,
    /// Set when cudarc panicked mid-batch: the device state is unknown, so refuse further work.
    pub(super) poisoned: Option<String>,
    pub(super) times: DeviceTimes,
}

/// Where a chunk's time goes, summed over chunks (seconds): the host copying recordings into
/// pinned staging; the upload (host to device); the kernels and FFT; the download of the rows
/// (from the last kernel's end, so it includes any wait for the download stream); and `wait`,
/// the host's time blocked waiting for rows (near 0 when the pipeline keeps the GPU ahead).
/// Upload, compute and download are device times and overlap each other across chunks.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct DeviceTimes {
    pub stage: f64,
    pub upload: f64,
    pub compute: f64,
    pub download: f64,
    pub wait: f64,
    pub chunks: u64,
    /// Building the featuriser: context, NVRTC, plans, buffers and the self-check.
    pub start: f64,
}

impl CudaFeaturiser {
    /// Build the featuriser on GPU 0: probe the libraries, compile the kernels, plan the FFTs,
    /// allocate every buffer, then check a few recordings against the CPU featuriser. Any failure
    /// (no driver, no GPU, NVRTC or cuFFT missing, out of memory, a mismatch) is an error that
    /// says what went wrong; it never panics. The libraries are looked for as the dynamic loader
    /// finds them and in Python environments ([`LibrarySearch::default`]).
    pub fn new(settings: &FeatureSettings) -> anyhow::Result<Self> {
        Self::with_libraries(settings, &LibrarySearch::default())
    }

    /// [`new`](Self::new), the CUDA libraries looked for as `search` says (`gpu.library_path`).
    /// Missing libraries are an [`Unavailable`] error.
    pub fn with_libraries(
        settings: &FeatureSettings,
        search: &LibrarySearch,
    ) -> anyhow::Result<Self> {
        let started = std::time::Instant::now();
        let tables = KernelTables::new(settings)?;
        let mut missing: Vec<_> = probe_libraries_with(search)
            .into_iter()
            .filter(|l| l.loaded.is_none())
            .collect();
        // Without the driver, NVRTC and cuFFT were not looked for everywhere (`python3` is not
        // asked on such a host): only the driver is named, not libraries `doctor` may well find.
        if missing.iter().any(|l| l.library == "CUDA driver") {
            missing.retain(|l| l.library == "CUDA driver");
        }
        if let Some(first) = missing.first() {
            return Err(Unavailable {
                first: first.short_reason(),
                all: missing.iter().map(|l| l.missing_reason()).collect(),
            }
            .into());
        }
        let mut featuriser = guarded(|| Self::build(settings, &tables))?;
        let built = started.elapsed().as_secs_f64();
        featuriser
            .self_check(settings)
            .context("GPU start-up self-check")?;
        featuriser.times = DeviceTimes {
            start: started.elapsed().as_secs_f64(),
            ..DeviceTimes::default()
        };
        log::info!(
            "CUDA featuriser ready on {} ({} recordings per chunk, {:?} FFT) in {:.2} s ({:.2} s to build, the rest self-check)",
            featuriser.name,
            featuriser.chunk_files,
            featuriser.geometry_precision(),
            featuriser.times.start,
            built
        );
        Ok(featuriser)
    }

    fn build(settings: &FeatureSettings, tables: &KernelTables) -> anyhow::Result<Self> {
        let count = CudaContext::device_count().context("initialising the CUDA driver (cuInit)")?;
        ensure!(count > 0, "the CUDA driver reports no GPU");
        let (major, minor) = compute_capability(0)?;
        let targets = targets_for(major, minor)?;
        // NVRTC needs no context: the kernels compile while the context opens and the buffers
        // and FFT plan are made (each is a good part of the start-up).
        std::thread::scope(|scope| {
            let compiling = scope.spawn(|| {
                let t = std::time::Instant::now();
                (nvrtc_compile(&targets[0]), t.elapsed().as_secs_f64())
            });
            Self::build_beside(settings, tables, &targets, compiling)
        })
    }

    /// [`build`](Self::build) once the compile of the kernels is under way in `compiling`.
    fn build_beside(
        settings: &FeatureSettings,
        tables: &KernelTables,
        targets: &[String],
        compiling: std::thread::ScopedJoinHandle<'_, (anyhow::Result<cudarc::nvrtc::Ptx>, f64)>,
    ) -> anyhow::Result<Self> {
        let started = std::time::Instant::now();
        let ctx = CudaContext::new(0).context("could not open GPU 0")?;
        let opened = started.elapsed().as_secs_f64();
        let gpu = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let sm_count = ctx
            .attribute(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as u32;
        // Three streams: uploads, kernels and downloads of different chunks overlap. cudarc
        // orders work on device buffers across streams with events it records per buffer.
        let compute = ctx.new_stream()?;
        let upload = ctx.new_stream()?;
        let download = ctx.new_stream()?;

        let g = tables.geometry;
        let chunk_files = chunk_files_fitting(&ctx, tables)?;
        let plan_files = PLAN_FILES;

        let mut weights = tables.mel_weights.clone();
        if weights.is_empty() {
            weights.push(0.0); // a zero-length allocation is an error in CUDA
        }
        let mel_start = compute.clone_htod(&tables.mel_start)?;
        let mel_offset = compute.clone_htod(&tables.mel_offset)?;
        let mel_weights = compute.clone_htod(&weights)?;

        let fft = fft_buffers(&compute, tables, chunk_files)?;
        let mel_db = compute.alloc_zeros::<f32>(chunk_files * g.row_len as usize)?;
        let slots = (0..SLOTS)
            .map(|_| make_slot(&ctx, &compute, &g, chunk_files))
            .collect::<anyhow::Result<_>>()?;
        let plan = fft_plan(&compute, tables, plan_files)?;
        compute.synchronize()?;
        let allocated = started.elapsed().as_secs_f64();

        let (first, compile_s) = compiling
            .join()
            .map_err(|p| anyhow!("NVRTC panicked: {}", panic_message(&*p)))?;
        let (module, target) = load_kernels(&ctx, targets, first)?;
        let kernels = kernel_functions(&module, tables.precision)?;
        log::info!(
            "CUDA start-up on {gpu}: context {opened:.3} s, buffers and FFT plan {:.3} s, kernels for {target} compiled in {compile_s:.3} s beside them and loaded by {:.3} s",
            allocated - opened,
            started.elapsed().as_secs_f64()
        );

        Ok(CudaFeaturiser {
            shape: settings.shape(),
            geometry: g,
            name: format!("cuda:{gpu}"),
            chunk_files,
            sm_count,
            kernels,
            plan: Some(plan),
            plan_files,
            fft,
            mel_start,
            mel_offset,
            mel_weights,
            mel_db,
            slots,
            ring: Ring::default(),
            compute,
            upload,
            download,
            ctx,
            poisoned: None,
            times: DeviceTimes::default(),
        })
    }

    /// Before anyone relies on it: silence must give exactly the log floor everywhere, and a few
    /// synthetic recordings (both input paths, tones among them) must meet the contract's
    /// accuracy rule against the float64 reference ([`reference::row`]), at 1x its tolerance.
    /// This runs every kernel and resolves every library symbol once, so a broken install fails
    /// here, where `features::build` can still fall back to the CPU, not in the middle of a run.
    fn self_check(&mut self, settings: &FeatureSettings) -> anyhow::Result<()> {
        let row_len = self.shape.row_len();
        let silence = Waveform::Pcm16(vec![0; self.shape.num_samples]);
        let mut rows = vec![f16::ZERO; row_len];
        self.featurise(&[&silence], &mut rows)?;
        let floor = f16::from_f32(-10.0 * self.geometry.db_multiplier);
        if let Some(i) = rows.iter().position(|&v| v != floor) {
            bail!(
                "silence gave {} at value {i}, expected the log floor {floor}",
                rows[i]
            );
        }

        let recordings = parity::synthetic_recordings(settings);
        let batch: Vec<&Waveform> = recordings.iter().map(|(_, w)| w).collect();
        let mut gpu = vec![f16::ZERO; batch.len() * row_len];
        self.featurise(&batch, &mut gpu)?;
        for (i, (name, wav)) in recordings.iter().enumerate() {
            let exact = reference::row(wav, settings);
            let accuracy = mel::check_accuracy(&exact, &gpu[i * row_len..(i + 1) * row_len]);
            if accuracy.violations > 0 {
                bail!(
                    "the GPU's rows break the accuracy rule on the synthetic recording \"{name}\": {}",
                    parity::summary(&accuracy)
                );
            }
        }
        Ok(())
    }

    fn geometry_precision(&self) -> Precision {
        match self.fft {
            FftBuffers::F32 { .. } => Precision::F32,
            FftBuffers::F64 { .. } => Precision::F64,
        }
    }

    /// Device times so far (see [`DeviceTimes`]).
    pub fn device_times(&self) -> DeviceTimes {
        self.times
    }

    /// Recordings per chunk (the device buffers hold this many; bigger batches are pipelined).
    pub fn chunk_files(&self) -> usize {
        self.chunk_files
    }

    pub(super) fn grid(&self, total: usize) -> LaunchConfig {
        let blocks = total
            .div_ceil(BLOCK_THREADS as usize)
            .clamp(1, self.sm_count as usize * 16) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl Featuriser for CudaFeaturiser {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn device_times(&self) -> Option<DeviceTimes> {
        Some(self.times)
    }

    fn shape(&self) -> FeatureShape {
        self.shape
    }

    fn featurise(&mut self, batch: &[&Waveform], out: &mut [f16]) -> anyhow::Result<()> {
        self.check_batch(batch, out.len())?;
        ensure!(
            self.ring.pending.is_empty(),
            "featurise called while {} submitted batches are not finished",
            self.ring.pending.len()
        );
        self.on_device(|f| f.run_batch(batch, out))
    }

    fn depth(&self) -> usize {
        SLOTS
    }

    fn bulk_batch(&self) -> usize {
        1024
    }

    fn submit(&mut self, batch: &[&Waveform], rows: Vec<f16>) -> anyhow::Result<()> {
        self.check_batch(batch, rows.len())?;
        self.on_device(|f| f.submit_batch(batch, rows))
    }

    fn finish(&mut self) -> anyhow::Result<Option<Vec<f16>>> {
        self.on_device(|f| f.finish_batch())
    }
}

impl CudaFeaturiser {
    /// Refuse a batch the device buffers were not made for (before anything is queued).
    fn check_batch(&self, batch: &[&Waveform], out_len: usize) -> anyhow::Result<()> {
        if let Some(why) = &self.poisoned {
            bail!("the CUDA featuriser is disabled after an earlier failure ({why})");
        }
        let row_len = self.shape.row_len();
        ensure!(
            out_len == batch.len() * row_len,
            "output holds {out_len} values, {} recordings need {}",
            batch.len(),
            batch.len() * row_len
        );
        for (i, w) in batch.iter().enumerate() {
            ensure!(
                w.len() == self.shape.num_samples,
                "recording {i} of the batch has {} samples, expected {} (decode pads or trims)",
                w.len(),
                self.shape.num_samples
            );
        }
        Ok(())
    }

    /// Run device work. A failure (an error or a cudarc panic) leaves chunks of unknown state
    /// in the ring and, with CUDA, usually a broken context: the featuriser refuses further work.
    fn on_device<T>(
        &mut self,
        work: impl FnOnce(&mut Self) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        if let Some(why) = &self.poisoned {
            bail!("the CUDA featuriser is disabled after an earlier failure ({why})");
        }
        let why = match crate::logging::contain(|| work(&mut *self)) {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) => format!("{e:#}"),
            Err(payload) => format!("cudarc panicked: {}", panic_message(&*payload)),
        };
        self.poisoned = Some(why.clone());
        bail!("CUDA featuriser failed: {why}")
    }
}

impl Drop for CudaFeaturiser {
    fn drop(&mut self) {
        let t = self.times;
        if t.chunks > 0 {
            log::info!(
                "GPU featuriser, {} chunks: staging {:.3} s, upload {:.3} s, kernels and FFT {:.3} s, download {:.3} s, host waiting {:.3} s (start-up {:.2} s)",
                t.chunks, t.stage, t.upload, t.compute, t.download, t.wait, t.start
            );
        }
        // Copies may still be in flight after an error; the pinned buffers must outlive them.
        let healthy = self.ctx.synchronize().is_ok() && self.poisoned.is_none();
        if !healthy {
            // cudarc's CudaFft unwraps cufftDestroy in its Drop; on a failed context that would
            // panic (and abort during unwinding). Leaking a plan of a dead context costs nothing.
            if let Some(plan) = self.plan.take() {
                std::mem::forget(plan);
            }
        }
    }
}

/// Compute capability of GPU `ordinal`, asked of the driver without a context (the kernels
/// compile for it while the context opens).
fn compute_capability(ordinal: i32) -> anyhow::Result<(i32, i32)> {
    use cudarc::driver::result::device;
    let dev = device::get(ordinal).context("asking the driver for GPU 0")?;
    let attr = |a| {
        // SAFETY: `dev` came from cuDeviceGet.
        unsafe { device::get_attribute(dev, a) }
            .context("asking the driver for GPU 0's compute capability")
    };
    Ok((
        attr(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attr(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// Recordings per chunk on this GPU: [`chunk_files_for`] the geometry, halved while a chunk
/// would take more than half of the free memory (room for cuFFT's work areas and other
/// processes), never below one FFT group: the plan (and so every row's arithmetic) is the same
/// on every GPU and at every batch size.
fn chunk_files_fitting(ctx: &Arc<CudaContext>, tables: &KernelTables) -> anyhow::Result<usize> {
    let (g, precision) = (&tables.geometry, tables.precision);
    let mut chunk_files = chunk_files_for(g);
    let (free, _total) = ctx.mem_get_info()?;
    while chunk_files > PLAN_FILES && device_bytes(g, precision, chunk_files) > free / 2 {
        chunk_files /= 2;
    }
    let chunk_files = chunk_files.max(PLAN_FILES);
    ensure!(
        device_bytes(g, precision, chunk_files) <= free,
        "not enough GPU memory: {} MiB free, a chunk of {chunk_files} recordings needs {} MiB",
        free >> 20,
        device_bytes(g, precision, chunk_files) >> 20
    );
    Ok(chunk_files)
}

/// The window, one chunk's frames and their spectra, in the FFT's precision.
fn fft_buffers(
    compute: &Arc<CudaStream>,
    tables: &KernelTables,
    chunk_files: usize,
) -> anyhow::Result<FftBuffers> {
    let g = &tables.geometry;
    let frames_cap = chunk_files * g.frames_per_file as usize;
    let (frames_len, bins_len) = (
        frames_cap * g.n_fft as usize,
        frames_cap * g.n_freqs as usize,
    );
    Ok(match tables.precision {
        Precision::F32 => FftBuffers::F32 {
            window: compute.clone_htod(&tables.window)?,
            frames: compute.alloc_zeros::<f32>(frames_len)?,
            spectrum: compute.alloc_zeros::<cufft::sys::float2>(bins_len)?,
        },
        Precision::F64 => FftBuffers::F64 {
            window: compute.clone_htod(&tables.window_f64)?,
            frames: compute.alloc_zeros::<f64>(frames_len)?,
            spectrum: compute.alloc_zeros::<cufft::sys::double2>(bins_len)?,
        },
    })
}

/// One staging slot for chunks of `chunk_files` recordings.
fn make_slot(
    ctx: &Arc<CudaContext>,
    compute: &Arc<CudaStream>,
    g: &Geometry,
    chunk_files: usize,
) -> anyhow::Result<Slot> {
    let samples_cap = chunk_files * g.num_samples as usize;
    let rows_cap = chunk_files * g.row_len as usize;
    // SAFETY (alloc_pinned*): the memory is uninitialised; it is zeroed at once.
    // Write-combined for the input: the host only writes it, sequentially, and the
    // device reads it faster. Plain pinned for the rows, which the host reads.
    let mut pcm_host = unsafe { ctx.alloc_pinned::<i16>(samples_cap) }?;
    pcm_host.as_mut_slice()?.fill(0);
    let mut rows_host = unsafe { ctx.alloc_pinned_with_flags::<u16>(rows_cap, 0) }?;
    rows_host.as_mut_slice()?.fill(0);
    // Events the host waits on block (instead of spinning a core); the timing marks
    // need timing enabled (cudarc's default flags disable it, and elapsed_ms then fails).
    let blocking = Some(dsys::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
    let timing = Some(dsys::CUevent_flags::CU_EVENT_DEFAULT);
    Ok(Slot {
        pcm_host,
        pcm_dev: compute.alloc_zeros::<i16>(samples_cap)?,
        float_host: None,
        float_dev: None,
        rows_dev: compute.alloc_zeros::<u16>(rows_cap)?,
        rows_host,
        uploaded: ctx.new_event(blocking)?,
        upload_start: ctx.new_event(timing)?,
        compute_start: ctx.new_event(timing)?,
        compute_end: ctx.new_event(timing)?,
        downloaded: ctx.new_event(blocking)?,
        files: 0,
        path: InputPath::Pcm16,
    })
}

/// The one batched R2C (float32) or D2Z (float64) plan for `plan_files` recordings.
fn fft_plan(
    compute: &Arc<CudaStream>,
    tables: &KernelTables,
    plan_files: usize,
) -> anyhow::Result<CudaFft> {
    let g = &tables.geometry;
    let batch =
        i32::try_from(plan_files * g.frames_per_file as usize).context("FFT batch too large")?;
    let kind = match tables.precision {
        Precision::F32 => cufft::sys::cufftType::CUFFT_R2C,
        Precision::F64 => cufft::sys::cufftType::CUFFT_D2Z,
    };
    CudaFft::plan_1d(g.n_fft, kind, batch, compute.clone()).map_err(|e| {
        anyhow!(
            "cuFFT could not plan {batch} {kind:?} transforms of {}: {e}",
            g.n_fft
        )
    })
}

/// The kernels of `precision` in the loaded module.
fn kernel_functions(
    module: &Arc<cudarc::driver::CudaModule>,
    precision: Precision,
) -> anyhow::Result<Kernels> {
    let suffix = match precision {
        Precision::F32 => "f32",
        Precision::F64 => "f64",
    };
    Ok(Kernels {
        frame_pcm16: module.load_function(&format!("frame_pcm16_{suffix}"))?,
        frame_f32: module.load_function(&format!("frame_f32_{suffix}"))?,
        power_mel_db: module.load_function(&format!("power_mel_db_{suffix}"))?,
        finalize_rows: module.load_function("finalize_rows")?,
    })
}
