//! CUDA featuriser: the rows of the CPU path, computed on an NVIDIA GPU through cudarc. Everything
//! is built once in [`CudaFeaturiser::new`] (context, NVRTC-compiled kernels, cuFFT plans, the mel
//! filterbank, pinned staging and device buffers) and reused; `featurise` only copies and launches.
//! The CUDA libraries are loaded at run time: on a host without them `new` returns an error naming
//! what is missing, and [`super::build`] falls back to the CPU.
//!
//! Per chunk of recordings: int16 (or float) samples -> pinned staging -> device (upload stream);
//! `frame_*` (frames x periodic Hann) -> cuFFT R2C or D2Z (the FFT precision the accuracy rule
//! needs, [`super::Precision`]) -> `power_mel_db_*` ->
//! `finalize_rows` (per-recording top_db clamp, float16) on the compute stream; rows -> pinned ->
//! `out` (download stream). A batch larger than one chunk is pipelined: the host stages chunk k+1
//! and its upload runs while chunk k computes. Kernels: `kernels/features.cu`.

use super::{mel, reference, Featuriser, Precision};
use crate::config::{DbMode, FeatureSettings, FeatureShape};
use crate::decode::Waveform;
use anyhow::{anyhow, bail, ensure, Context};
use cudarc::cufft::{self, CudaFft};
use cudarc::driver::{
    self, sys as dsys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream,
    DeviceRepr, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc;
use half::f16;
use rayon::prelude::*;
use serde::Serialize;
use std::ffi::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// The kernels, compiled by NVRTC at start-up (not at build time: no CUDA toolkit is needed to
/// build, and the code is compiled for the GPU actually present).
pub const KERNEL_SOURCE: &str = include_str!("../../kernels/features.cu");

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

// ---------------------------------------------------------------------------------------------
// Finding the libraries. cudarc resolves libraries lazily and panics when one is missing, so we
// look for them first, with the very names and order cudarc uses (`get_lib_name_candidates`).

/// One shared library that cudarc loads at run time, and what happened when we looked for it.
#[derive(Debug, Clone, Serialize)]
pub struct LibraryStatus {
    /// What it is, for people: "CUDA driver", "NVRTC", "cuFFT".
    pub library: &'static str,
    /// The first name in `tried` that the dynamic loader accepted: the one cudarc will load.
    pub loaded: Option<String>,
    /// Where that library is on disk.
    pub path: Option<String>,
    /// Every name tried, in cudarc's order.
    pub tried: Vec<String>,
    /// The loader's complaint about a name that exists but did not load (wrong architecture,
    /// missing dependency): more useful to an operator than "not found".
    pub error: Option<String>,
}

impl LibraryStatus {
    /// The Linux sonames among `tried`: the full list (34 names for the driver) is in
    /// `doctor --json`; these are the ones an operator can act on.
    pub fn sonames(&self) -> Vec<&str> {
        let stem = match self.library {
            "CUDA driver" => "cuda",
            "NVRTC" => "nvrtc",
            _ => "cufft",
        };
        let prefix = format!("lib{stem}.so");
        self.tried
            .iter()
            .map(String::as_str)
            .filter(|n| n.starts_with(&prefix))
            .collect()
    }

    /// What to do when it is missing.
    pub fn advice(&self) -> &'static str {
        match self.library {
            "CUDA driver" => "install the NVIDIA driver (it provides libcuda.so.1)",
            "NVRTC" => {
                "install the CUDA 13 runtime compiler (package cuda-nvrtc-13-0, libnvrtc.so.13) \
                 or add its directory to LD_LIBRARY_PATH"
            }
            _ => {
                "install cuFFT from CUDA 13 (package libcufft-13-0, libcufft.so.12) or add its \
                 directory to LD_LIBRARY_PATH"
            }
        }
    }

    /// Why the library is unusable, with what to do about it.
    pub fn missing_reason(&self) -> String {
        let mut reason = format!(
            "{} library not found (tried {})",
            self.library,
            self.sonames().join(", ")
        );
        if let Some(e) = &self.error {
            reason.push_str(&format!("; the loader said: {e}"));
        }
        reason.push_str(&format!(": {}", self.advice()));
        reason
    }
}

/// (what, cudarc's library stems, a symbol to locate the file on disk)
const LIBRARIES: [(&str, &[&str], &str); 3] = [
    ("CUDA driver", &["cuda", "nvcuda"], "cuInit"),
    ("NVRTC", &["nvrtc"], "nvrtcVersion"),
    ("cuFFT", &["cufft"], "cufftGetVersion"),
];

/// Look for the driver, NVRTC and cuFFT the way cudarc will. Never panics.
pub fn probe_libraries() -> Vec<LibraryStatus> {
    LIBRARIES
        .iter()
        .map(|&(library, stems, symbol)| {
            let mut tried: Vec<String> = Vec::new();
            for stem in stems {
                for name in cudarc::get_lib_name_candidates(stem) {
                    if !tried.contains(&name) {
                        tried.push(name);
                    }
                }
            }
            let mut status = LibraryStatus {
                library,
                loaded: None,
                path: None,
                tried,
                error: None,
            };
            for name in &status.tried {
                match dl_probe(name, symbol) {
                    Ok(path) => {
                        status.loaded = Some(name.clone());
                        status.path = path;
                        break;
                    }
                    Err(Some(e)) if !e.contains("No such file") && status.error.is_none() => {
                        status.error = Some(e);
                    }
                    Err(_) => {}
                }
            }
            status
        })
        .collect()
}

/// dlopen `name` as libloading (cudarc's loader) does; Ok(path on disk) when it loads.
/// Err(Some(loader message)) when it does not.
#[cfg(unix)]
fn dl_probe(name: &str, symbol: &str) -> Result<Option<String>, Option<String>> {
    use std::ffi::{CStr, CString};
    let cname = CString::new(name).map_err(|_| None)?;
    let csym = CString::new(symbol).map_err(|_| None)?;
    // SAFETY: valid NUL-terminated strings; dli_fname is copied before returning. The handle is
    // deliberately not closed: cudarc is about to load the same library, and unloading driver
    // libraries is not something they are all safe for.
    unsafe {
        let handle = libc::dlopen(cname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            let err = libc::dlerror();
            return Err(
                (!err.is_null()).then(|| CStr::from_ptr(err).to_string_lossy().into_owned())
            );
        }
        let sym = libc::dlsym(handle, csym.as_ptr());
        if sym.is_null() {
            return Ok(None);
        }
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(sym, &mut info) != 0 && !info.dli_fname.is_null() {
            return Ok(Some(
                CStr::from_ptr(info.dli_fname)
                    .to_string_lossy()
                    .into_owned(),
            ));
        }
        Ok(None)
    }
}

/// Elsewhere we cannot probe cheaply; cudarc's own loading runs under catch_unwind anyway.
#[cfg(not(unix))]
fn dl_probe(_name: &str, _symbol: &str) -> Result<Option<String>, Option<String>> {
    Ok(None)
}

/// Everything `doctor` reports about CUDA on this host.
#[derive(Debug, Clone, Serialize)]
pub struct CudaProbe {
    pub libraries: Vec<LibraryStatus>,
    /// e.g. "13.0" (the CUDA version the driver supports).
    pub driver_version: Option<String>,
    pub nvrtc_version: Option<String>,
    /// e.g. "12.0.0" (cuFFT numbers its releases apart from CUDA: CUDA 13.0 ships cuFFT 12.0).
    pub cufft_version: Option<String>,
    pub gpus: Vec<GpuInfo>,
    /// Why featurising on the GPU is impossible here (a missing library, no GPU, a driver that
    /// fails); empty when the libraries load and a GPU is present (whether the featuriser then
    /// works is what `CudaFeaturiser::new` finds out).
    pub problems: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub total_memory_bytes: usize,
    /// "major.minor"
    pub compute_capability: String,
}

/// Query the libraries, driver and GPUs without creating a context. Never panics.
pub fn probe() -> CudaProbe {
    let libraries = probe_libraries();
    let loaded = |what: &str| {
        libraries
            .iter()
            .any(|l| l.library == what && l.loaded.is_some())
    };
    let mut problems: Vec<String> = libraries
        .iter()
        .filter(|l| l.loaded.is_none())
        .map(LibraryStatus::missing_reason)
        .collect();
    let mut probe = CudaProbe {
        driver_version: None,
        nvrtc_version: None,
        cufft_version: None,
        gpus: Vec::new(),
        problems: Vec::new(),
        libraries: libraries.clone(),
    };
    if loaded("CUDA driver") {
        match guarded(query_driver) {
            Ok((version, gpus)) => {
                probe.driver_version = Some(version);
                if gpus.is_empty() {
                    problems.push("the CUDA driver reports no GPU".into());
                }
                probe.gpus = gpus;
            }
            Err(e) => problems.push(format!("the CUDA driver does not work: {e:#}")),
        }
    }
    if loaded("NVRTC") {
        match guarded(nvrtc_version) {
            Ok(v) => probe.nvrtc_version = Some(v),
            Err(e) => problems.push(format!("NVRTC does not work: {e:#}")),
        }
    }
    if loaded("cuFFT") {
        match guarded(cufft_version) {
            Ok(v) => probe.cufft_version = Some(v),
            Err(e) => problems.push(format!("cuFFT does not work: {e:#}")),
        }
    }
    probe.problems = problems;
    probe
}

fn query_driver() -> anyhow::Result<(String, Vec<GpuInfo>)> {
    let mut v: c_int = 0;
    // SAFETY: plain out-parameter call; valid before cuInit.
    unsafe { dsys::cuDriverGetVersion(&mut v) }
        .result()
        .context("cuDriverGetVersion")?;
    let version = format!("{}.{}", v / 1000, (v % 1000) / 10);
    driver::result::init().context("cuInit")?;
    let count = driver::result::device::get_count().context("cuDeviceGetCount")?;
    let mut gpus = Vec::new();
    for ordinal in 0..count {
        let dev = driver::result::device::get(ordinal)?;
        let name = driver::result::device::get_name(dev)?;
        // SAFETY: `dev` came from cuDeviceGet.
        let (mem, major, minor) = unsafe {
            (
                driver::result::device::total_mem(dev)?,
                driver::result::device::get_attribute(
                    dev,
                    dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                )?,
                driver::result::device::get_attribute(
                    dev,
                    dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                )?,
            )
        };
        gpus.push(GpuInfo {
            ordinal: ordinal as usize,
            name,
            total_memory_bytes: mem,
            compute_capability: format!("{major}.{minor}"),
        });
    }
    Ok((version, gpus))
}

fn nvrtc_version() -> anyhow::Result<String> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: plain out-parameter call.
    unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }.result()?;
    Ok(format!("{major}.{minor}"))
}

fn cufft_version() -> anyhow::Result<String> {
    use cufft::sys::libraryPropertyType as P;
    let major = cufft::result::get_property(P::MAJOR_VERSION)?;
    let minor = cufft::result::get_property(P::MINOR_VERSION)?;
    let patch = cufft::result::get_property(P::PATCH_LEVEL)?;
    Ok(format!("{major}.{minor}.{patch}"))
}

/// Run `f`, turning a panic (cudarc panics on a missing symbol or library) into an error.
fn guarded<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => Err(anyhow!("cudarc panicked: {}", panic_message(&*payload))),
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

// ---------------------------------------------------------------------------------------------
// What the kernels are given.

/// Declares a `#[repr(C)]` struct shared with the kernel source together with its field list,
/// so a test can check the two declarations agree field for field.
macro_rules! kernel_struct {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* pub $field:ident: $ty:ty,)* }
     fields = $fields:ident;) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub struct $name { $($(#[$fmeta])* pub $field: $ty,)* }
        /// (field, Rust type) of the struct, in declaration order.
        pub const $fields: &[(&str, &str)] = &[$((stringify!($field), stringify!($ty)),)*];
    };
}

kernel_struct! {
    /// Shapes and constants of one feature setup, passed by value to every kernel. Must match
    /// `struct Geometry` in `kernels/features.cu`; all fields are 4 bytes, so there is no padding.
    pub struct Geometry {
        /// Samples per recording after pad/trim.
        pub num_samples: i32,
        pub num_long: i32,
        pub num_short: i32,
        pub t_frames: i32,
        pub long_hop: i32,
        pub short_hop: i32,
        pub hop_length: i32,
        pub n_fft: i32,
        /// n_fft / 2 + 1: complex bins per frame out of cuFFT R2C.
        pub n_freqs: i32,
        pub n_mels: i32,
        /// num_long * num_short * t_frames.
        pub frames_per_file: i32,
        /// num_long * num_short * n_mels * t_frames.
        pub row_len: i32,
        pub power: f32,
        /// 10 when power == 2, else 20 (mel::db_multiplier).
        pub db_multiplier: f32,
        /// AmplitudeToDB's amin: values below it are taken as it (mel::DB_FLOOR).
        pub db_floor: f32,
        pub top_db: f32,
        /// 1: clamp each recording at its maximum - top_db (amplitude_to_db with top_db set).
        pub use_top_db: i32,
    }
    fields = GEOMETRY_FIELDS;
}

// SAFETY: #[repr(C)], only i32/f32 fields (no padding, every bit pattern valid).
unsafe impl DeviceRepr for Geometry {}
unsafe impl bytemuck::Zeroable for Geometry {}
unsafe impl bytemuck::Pod for Geometry {}

/// Everything the kernels read besides the samples: geometry, window and the mel filterbank as
/// CSR. Public so the host-emulation test (tests/gpu_parity.rs) drives the kernel source with
/// exactly what the GPU gets.
#[derive(Debug, Clone)]
pub struct KernelTables {
    pub geometry: Geometry,
    /// The FFT's element type (float frames and R2C, or double frames and D2Z).
    pub precision: Precision,
    /// Periodic Hann window, n_fft values, for float frames.
    pub window: Vec<f32>,
    /// The same window for double frames.
    pub window_f64: Vec<f64>,
    /// First FFT bin of each mel filter.
    pub mel_start: Vec<i32>,
    /// Filter m's weights are mel_weights[mel_offset[m]..mel_offset[m + 1]]; n_mels + 1 values.
    pub mel_offset: Vec<i32>,
    pub mel_weights: Vec<f32>,
}

impl KernelTables {
    /// Built from the CPU path's filterbank and window (features::mel), so both devices use the
    /// same float32 weights.
    pub fn new(settings: &FeatureSettings) -> anyhow::Result<KernelTables> {
        let shape = settings.shape();
        let n_freqs = settings.n_fft / 2 + 1;
        let int = |name: &str, v: usize| {
            i32::try_from(v).map_err(|_| {
                anyhow!(
                    "{name} = {v} is too large for the CUDA featuriser (at most {})",
                    i32::MAX
                )
            })
        };
        let frames_per_file = shape.num_windows() * shape.t_frames;
        let (top_db, use_top_db) = match (settings.db, settings.top_db) {
            (DbMode::AmplitudeToDb, Some(t)) => (t as f32, 1),
            _ => (0.0, 0),
        };
        let geometry = Geometry {
            num_samples: int("samples per recording", shape.num_samples)?,
            num_long: int("num_long", shape.num_long)?,
            num_short: int("num_short", shape.num_short)?,
            t_frames: int("t_frames", shape.t_frames)?,
            long_hop: int("features.long_hop", settings.long_hop)?,
            short_hop: int("features.short_hop", settings.short_hop)?,
            hop_length: int("features.hop_length", settings.hop_length)?,
            n_fft: int("features.n_fft", settings.n_fft)?,
            n_freqs: int("n_fft / 2 + 1", n_freqs)?,
            n_mels: int("features.n_mels", settings.n_mels)?,
            frames_per_file: int("frames per recording", frames_per_file)?,
            row_len: int("values per row", shape.row_len())?,
            power: settings.power as f32,
            db_multiplier: mel::db_multiplier(settings) as f32,
            db_floor: mel::DB_FLOOR,
            top_db,
            use_top_db,
        };
        // The kernels do not bounds-check their reads: prove here that the last frame of a
        // recording ends inside it.
        let last_end = (shape.num_long - 1) * settings.long_hop
            + (shape.num_short - 1) * settings.short_hop
            + (shape.t_frames - 1) * settings.hop_length
            + settings.n_fft;
        ensure!(
            shape.num_long >= 1 && shape.num_short >= 1 && shape.t_frames >= 1,
            "feature settings give an empty row ({:?})",
            shape.row_dims()
        );
        ensure!(
            last_end <= shape.num_samples,
            "feature settings read past the end of a recording ({last_end} > {} samples)",
            shape.num_samples
        );

        let window_f64 = mel::hann_periodic(settings.n_fft);
        let window: Vec<f32> = window_f64.iter().map(|&w| w as f32).collect();
        ensure!(
            window.len() == settings.n_fft,
            "Hann window has the wrong length"
        );

        let sparse = mel::SparseMel::new(settings);
        ensure!(
            sparse.n_freqs == n_freqs && sparse.filters.len() == settings.n_mels,
            "mel filterbank is {} filters x {} bins, expected {} x {}",
            sparse.filters.len(),
            sparse.n_freqs,
            settings.n_mels,
            n_freqs
        );
        let mut mel_start = Vec::with_capacity(settings.n_mels);
        let mut mel_offset = Vec::with_capacity(settings.n_mels + 1);
        let mut mel_weights = Vec::new();
        mel_offset.push(0);
        for (m, filter) in sparse.filters.iter().enumerate() {
            ensure!(
                filter.start + filter.weights.len() <= n_freqs,
                "mel filter {m} runs past the last FFT bin"
            );
            mel_start.push(int("mel filter start", filter.start)?);
            mel_weights.extend_from_slice(&filter.weights);
            mel_offset.push(int("mel filterbank size", mel_weights.len())?);
        }
        Ok(KernelTables {
            geometry,
            precision: Precision::for_settings(settings),
            window,
            window_f64,
            mel_start,
            mel_offset,
            mel_weights,
        })
    }
}

/// Recordings per chunk: as many as the frames budget allows, a power of two (a whole number of
/// [`PLAN_FILES`] groups), at most [`MAX_CHUNK_FILES`].
fn chunk_files_for(geometry: &Geometry) -> usize {
    let per_file = (geometry.frames_per_file as usize * geometry.n_fft as usize).max(1);
    let files = (FRAME_BUDGET_SAMPLES / per_file).clamp(1, MAX_CHUNK_FILES);
    1 << (usize::BITS - 1 - files.leading_zeros())
}

/// Device bytes for a chunk of `files` recordings (cuFFT's work area not included).
fn device_bytes(g: &Geometry, precision: Precision, files: usize) -> usize {
    let frames = files * g.frames_per_file as usize;
    let row = files * g.row_len as usize;
    let real = match precision {
        Precision::F32 => 4,
        Precision::F64 => 8,
    };
    frames * g.n_fft as usize * real
        + frames * g.n_freqs as usize * 2 * real
        + row * 4
        + 2 * (files * g.num_samples as usize * 2 + row * 2)
}

// ---------------------------------------------------------------------------------------------
// NVRTC.

/// The GPU's architecture as NVRTC numbers it (8.9 -> 89).
fn arch_number(major: i32, minor: i32) -> i32 {
    major * 10 + minor
}

fn nvrtc_supported_archs() -> anyhow::Result<Vec<i32>> {
    let mut n: c_int = 0;
    // SAFETY: out-parameter calls; the buffer holds the count NVRTC reported.
    unsafe { nvrtc::sys::nvrtcGetNumSupportedArchs(&mut n) }.result()?;
    let mut archs = vec![0 as c_int; n.max(0) as usize];
    if n > 0 {
        unsafe { nvrtc::sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }.result()?;
    }
    Ok(archs)
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compile [`KERNEL_SOURCE`] for `arch` ("sm_90": a CUBIN for exactly this GPU; "compute_90":
/// PTX the driver JIT-compiles). A CUBIN is preferred: it loads on any driver of the same CUDA
/// major version, while PTX from a newer NVRTC than the driver is refused.
fn nvrtc_compile(arch: &str) -> anyhow::Result<nvrtc::Ptx> {
    use std::ffi::CString;
    struct Program(nvrtc::sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: created by create_program below and destroyed only here.
            let _ = unsafe { nvrtc::result::destroy_program(self.0) };
        }
    }
    let src = CString::new(KERNEL_SOURCE).context("kernel source contains a NUL byte")?;
    let name = CString::new("features.cu").expect("no NUL");
    let prog = Program(nvrtc::result::create_program(&src, Some(&name))?);
    // float32 semantics as written: no fast-math, IEEE division/sqrt, denormals kept. The
    // accuracy rule (within one float16 ulp of the float64 value) is met by float32 arithmetic,
    // not by approximate intrinsics.
    let options = [
        format!("--gpu-architecture={arch}"),
        "--fmad=true".to_string(),
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
    ];
    // SAFETY: `prog` is alive until the end of this function; `src`/`name` outlive it.
    unsafe {
        if let Err(e) = nvrtc::result::compile_program(prog.0, &options) {
            let log = nvrtc::result::get_program_log(prog.0)
                .map(|l| c_chars_to_string(&l))
                .unwrap_or_default();
            bail!("NVRTC could not compile kernels/features.cu for {arch}: {e}\n{log}");
        }
        if arch.starts_with("sm_") {
            let mut size = 0usize;
            nvrtc::sys::nvrtcGetCUBINSize(prog.0, &mut size).result()?;
            let mut cubin = vec![0u8; size];
            nvrtc::sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut c_char).result()?;
            Ok(nvrtc::Ptx::from_binary(cubin))
        } else {
            let ptx = nvrtc::result::get_ptx(prog.0)?;
            Ok(nvrtc::Ptx::from_src(c_chars_to_string(&ptx)))
        }
    }
}

/// Compile and load the kernels for this GPU: a CUBIN for its exact architecture when NVRTC
/// supports it, else PTX for the newest architecture NVRTC knows that the GPU can run.
fn load_kernels(ctx: &Arc<CudaContext>) -> anyhow::Result<(Arc<CudaModule>, String)> {
    let (major, minor) = ctx.compute_capability()?;
    let cc = arch_number(major, minor);
    let archs = nvrtc_supported_archs().context("asking NVRTC which GPUs it supports")?;
    let mut targets = Vec::new();
    if archs.contains(&cc) {
        targets.push(format!("sm_{cc}"));
    }
    if let Some(best) = archs.iter().copied().filter(|&a| a <= cc).max() {
        targets.push(format!("compute_{best}"));
    }
    if targets.is_empty() {
        bail!(
            "this GPU (compute capability {major}.{minor}) is older than anything NVRTC {} supports (oldest: {}.{})",
            nvrtc_version().unwrap_or_else(|_| "?".into()),
            archs.iter().min().map_or(0, |a| a / 10),
            archs.iter().min().map_or(0, |a| a % 10)
        );
    }
    let mut failures = Vec::new();
    for target in targets {
        let loaded = nvrtc_compile(&target).and_then(|image| {
            ctx.load_module(image)
                .map_err(|e| anyhow!("the driver refused the compiled kernels: {e}"))
        });
        match loaded {
            Ok(module) => return Ok((module, target)),
            Err(e) => {
                log::warn!("CUDA kernels for {target}: {e:#}");
                failures.push(format!("{target}: {e:#}"));
            }
        }
    }
    bail!("could not build the CUDA kernels: {}", failures.join("; "))
}

// ---------------------------------------------------------------------------------------------
// The featuriser.

/// Which kernel 1 a staged chunk needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InputPath {
    /// Every recording in the chunk is int16: upload int16 (half the bytes of float).
    Pcm16,
    /// At least one float recording: upload the whole chunk as float (int16 converts exactly).
    Float,
}

/// Staging for one in-flight chunk. There are two, so chunk k+1 is staged and uploaded while
/// chunk k computes.
struct Slot {
    pcm_host: PinnedHostSlice<i16>,
    pcm_dev: CudaSlice<i16>,
    /// Float path buffers, made the first time this slot stages a float recording (for slot 0,
    /// that is the start-up self-check): these are twice the size of the int16 ones, and slot 1's
    /// are only needed by hosts that see float recordings in big batches.
    float_host: Option<PinnedHostSlice<f32>>,
    float_dev: Option<CudaSlice<f32>>,
    rows_dev: CudaSlice<u16>,
    rows_host: PinnedHostSlice<u16>,
    /// Recorded after the upload from `*_host`: the host waits on it before restaging. (cudarc
    /// tracks device buffers itself, but not plain slices of pinned memory, which is what we copy
    /// so that a partial chunk transfers only its own bytes.)
    uploaded: CudaEvent,
    /// Timing marks (see [`DeviceTimes`]): before the upload, when the kernels may start (the
    /// upload is done), after the last kernel.
    upload_start: CudaEvent,
    compute_start: CudaEvent,
    compute_end: CudaEvent,
    /// Recorded after the download into `rows_host`: the host waits on it before reading.
    downloaded: CudaEvent,
    files: usize,
    path: InputPath,
}

/// The kernels of one precision (`frame_pcm16_f64` etc. for [`Precision::F64`]).
struct Kernels {
    frame_pcm16: CudaFunction,
    frame_f32: CudaFunction,
    power_mel_db: CudaFunction,
    finalize_rows: CudaFunction,
}

/// The FFT stage's buffers in the precision the accuracy rule needs: the window, one chunk's
/// frames and their spectra (scratch of the compute stream, shared by both slots).
enum FftBuffers {
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

/// Featurises on one NVIDIA GPU (ordinal 0). Built once, then kept warm.
pub struct CudaFeaturiser {
    shape: FeatureShape,
    geometry: Geometry,
    /// "cuda:<gpu name>".
    name: String,
    /// Recordings per chunk (see [`chunk_files_for`]); bigger batches are pipelined chunk by chunk.
    chunk_files: usize,
    /// Caps the grid of the grid-stride kernels.
    sm_count: u32,
    kernels: Kernels,
    /// One batched R2C or D2Z plan for [`PLAN_FILES`] recordings (fewer when a chunk is
    /// smaller), run group by group over a chunk. Made in `new`; `None` only while dropping.
    plan: Option<CudaFft>,
    /// Recordings the plan transforms per execution.
    plan_files: usize,
    fft: FftBuffers,
    mel_start: CudaSlice<i32>,
    mel_offset: CudaSlice<i32>,
    mel_weights: CudaSlice<f32>,
    /// Scratch of the compute stream, shared by both slots (kernels run one chunk at a time).
    mel_db: CudaSlice<f32>,
    slots: [Slot; 2],
    compute: Arc<CudaStream>,
    upload: Arc<CudaStream>,
    download: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    /// Set when cudarc panicked mid-batch: the device state is unknown, so refuse further work.
    poisoned: Option<String>,
    times: DeviceTimes,
}

/// Where a chunk's time goes, summed over chunks (seconds): the host copying recordings into
/// pinned staging; the upload (host to device); the kernels and FFT; the download of the rows
/// (from the last kernel's end, so it includes any wait for the download stream).
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct DeviceTimes {
    pub stage: f64,
    pub upload: f64,
    pub compute: f64,
    pub download: f64,
    pub chunks: u64,
    /// Building the featuriser: context, NVRTC, plans, buffers and the self-check.
    pub start: f64,
}

impl CudaFeaturiser {
    /// Build the featuriser on GPU 0: probe the libraries, compile the kernels, plan the FFTs,
    /// allocate every buffer, then check a few recordings against the CPU featuriser. Any failure
    /// (no driver, no GPU, NVRTC or cuFFT missing, out of memory, a mismatch) is an error that
    /// says what went wrong; it never panics.
    pub fn new(settings: &FeatureSettings) -> anyhow::Result<Self> {
        let started = std::time::Instant::now();
        let tables = KernelTables::new(settings)?;
        let missing: Vec<String> = probe_libraries()
            .iter()
            .filter(|l| l.loaded.is_none())
            .map(LibraryStatus::missing_reason)
            .collect();
        if !missing.is_empty() {
            bail!("{}", missing.join("; "));
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
        let ctx = CudaContext::new(0).context("could not open GPU 0")?;
        let gpu = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let sm_count = ctx
            .attribute(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as u32;
        let (module, target) = load_kernels(&ctx)?;
        log::debug!("CUDA kernels built for {target} on {gpu}");
        let suffix = match tables.precision {
            Precision::F32 => "f32",
            Precision::F64 => "f64",
        };
        let kernels = Kernels {
            frame_pcm16: module.load_function(&format!("frame_pcm16_{suffix}"))?,
            frame_f32: module.load_function(&format!("frame_f32_{suffix}"))?,
            power_mel_db: module.load_function(&format!("power_mel_db_{suffix}"))?,
            finalize_rows: module.load_function("finalize_rows")?,
        };
        // Three streams: uploads, kernels and downloads of different chunks overlap. cudarc
        // orders work on device buffers across streams with events it records per buffer.
        let compute = ctx.new_stream()?;
        let upload = ctx.new_stream()?;
        let download = ctx.new_stream()?;

        let g = tables.geometry;
        let precision = tables.precision;
        let mut chunk_files = chunk_files_for(&g);
        let (free, _total) = ctx.mem_get_info()?;
        // Leave room for cuFFT's work areas and other processes: use at most half of what is free.
        while chunk_files > 1 && device_bytes(&g, precision, chunk_files) > free / 2 {
            chunk_files /= 2;
        }
        ensure!(
            device_bytes(&g, precision, chunk_files) <= free,
            "not enough GPU memory: {} MiB free, one recording needs {} MiB",
            free >> 20,
            device_bytes(&g, precision, 1) >> 20
        );
        let plan_files = PLAN_FILES.min(chunk_files);

        let mut weights = tables.mel_weights.clone();
        if weights.is_empty() {
            weights.push(0.0); // a zero-length allocation is an error in CUDA
        }
        let mel_start = compute.clone_htod(&tables.mel_start)?;
        let mel_offset = compute.clone_htod(&tables.mel_offset)?;
        let mel_weights = compute.clone_htod(&weights)?;

        let frames_cap = chunk_files * g.frames_per_file as usize;
        let (frames_len, bins_len) = (
            frames_cap * g.n_fft as usize,
            frames_cap * g.n_freqs as usize,
        );
        let fft = match precision {
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
        };
        let mel_db = compute.alloc_zeros::<f32>(chunk_files * g.row_len as usize)?;

        let samples_cap = chunk_files * g.num_samples as usize;
        let rows_cap = chunk_files * g.row_len as usize;
        let make_slot = || -> anyhow::Result<Slot> {
            // SAFETY (alloc_pinned*): the memory is uninitialised; it is zeroed at once.
            // Write-combined for the input: the host only writes it, sequentially, and the
            // device reads it faster. Plain pinned for the rows, which the host reads.
            let mut pcm_host = unsafe { ctx.alloc_pinned::<i16>(samples_cap) }?;
            pcm_host.as_mut_slice()?.fill(0);
            let mut rows_host = unsafe { ctx.alloc_pinned_with_flags::<u16>(rows_cap, 0) }?;
            rows_host.as_mut_slice()?.fill(0);
            let blocking = Some(dsys::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
            Ok(Slot {
                pcm_host,
                pcm_dev: compute.alloc_zeros::<i16>(samples_cap)?,
                float_host: None,
                float_dev: None,
                rows_dev: compute.alloc_zeros::<u16>(rows_cap)?,
                rows_host,
                uploaded: ctx.new_event(blocking)?,
                upload_start: ctx.new_event(None)?,
                compute_start: ctx.new_event(None)?,
                compute_end: ctx.new_event(None)?,
                downloaded: ctx.new_event(blocking)?,
                files: 0,
                path: InputPath::Pcm16,
            })
        };
        let slots = [make_slot()?, make_slot()?];

        let batch = i32::try_from(plan_files * g.frames_per_file as usize)
            .context("FFT batch too large")?;
        let kind = match precision {
            Precision::F32 => cufft::sys::cufftType::CUFFT_R2C,
            Precision::F64 => cufft::sys::cufftType::CUFFT_D2Z,
        };
        let plan = CudaFft::plan_1d(g.n_fft, kind, batch, compute.clone()).map_err(|e| {
            anyhow!(
                "cuFFT could not plan {batch} {kind:?} transforms of {}: {e}",
                g.n_fft
            )
        })?;
        compute.synchronize()?;

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

    fn grid(&self, total: usize) -> LaunchConfig {
        let blocks = total
            .div_ceil(BLOCK_THREADS as usize)
            .clamp(1, self.sm_count as usize * 16) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Host: copy `files` into slot `s`'s pinned staging (in parallel: at 80 KB a recording this
    /// copy, not the GPU, is the slowest step of a chunk); then queue the upload.
    fn stage(&mut self, s: usize, files: &[&Waveform]) -> anyhow::Result<()> {
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
    fn compute_and_download(&mut self, s: usize) -> anyhow::Result<()> {
        let g = self.geometry;
        let files = self.slots[s].files;
        let n = files as i32;
        let frames = files * g.frames_per_file as usize;

        let slot = &self.slots[s];
        // Explicitly after the upload (cudarc would also order the kernels after it), so that
        // compute_start marks when the kernels can run.
        self.compute.wait(&slot.uploaded)?;
        slot.compute_start.record(&self.compute)?;
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

        // One plan, group by group (see PLAN_FILES). The last group's frames beyond `frames` are
        // stale; their spectra are never read.
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
        let len = files * g.row_len as usize;
        let host = slot.rows_host.as_mut_slice()?;
        let rows = slot.rows_dev.slice(0..len);
        self.download.memcpy_dtoh(&rows, &mut host[..len])?;
        slot.downloaded.record(&self.download)?;
        Ok(())
    }

    /// Host: wait for slot `s`'s rows and copy them out.
    fn collect(&mut self, s: usize, out: &mut [f16]) -> anyhow::Result<()> {
        let slot = &mut self.slots[s];
        slot.downloaded
            .synchronize()
            .context("waiting for the GPU (an earlier kernel may have failed)")?;
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

    fn run_batch(&mut self, batch: &[&Waveform], out: &mut [f16]) -> anyhow::Result<()> {
        self.ctx.bind_to_thread()?;
        let row_len = self.shape.row_len();
        let chunks: Vec<(usize, usize)> = (0..batch.len())
            .step_by(self.chunk_files)
            .map(|start| (start, (start + self.chunk_files).min(batch.len())))
            .collect();
        let Some(&(first_start, first_end)) = chunks.first() else {
            return Ok(());
        };
        // Pipeline: the host stages chunk k+1 (copy into pinned memory, async upload) while the
        // GPU computes chunk k, and collects chunk k-1 meanwhile. Uploads and downloads have
        // their own streams, so the upload of k+1 never queues behind the download of k (which
        // waits for k's kernels).
        self.stage(0, &batch[first_start..first_end])?;
        for (k, &(start, end)) in chunks.iter().enumerate() {
            self.compute_and_download(k % 2)?;
            if let Some(&(next_start, next_end)) = chunks.get(k + 1) {
                self.stage((k + 1) % 2, &batch[next_start..next_end])?;
            }
            if k >= 1 {
                let (prev_start, prev_end) = chunks[k - 1];
                self.collect(
                    (k - 1) % 2,
                    &mut out[prev_start * row_len..prev_end * row_len],
                )?;
            }
            if k + 1 == chunks.len() {
                self.collect(k % 2, &mut out[start * row_len..end * row_len])?;
            }
        }
        // Errors cudarc recorded where it could not return them (event records in drops).
        self.ctx.check_err()?;
        Ok(())
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
        if let Some(why) = &self.poisoned {
            bail!("the CUDA featuriser is disabled after an earlier failure ({why})");
        }
        let row_len = self.shape.row_len();
        ensure!(
            out.len() == batch.len() * row_len,
            "output holds {} values, {} recordings need {}",
            out.len(),
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
        match catch_unwind(AssertUnwindSafe(|| self.run_batch(batch, out))) {
            Ok(result) => result,
            Err(payload) => {
                let why = format!("cudarc panicked: {}", panic_message(&*payload));
                self.poisoned = Some(why.clone());
                bail!("CUDA featuriser failed: {why}")
            }
        }
    }
}

impl Drop for CudaFeaturiser {
    fn drop(&mut self) {
        let t = self.times;
        if t.chunks > 0 {
            log::info!(
                "GPU featuriser, {} chunks: staging {:.3} s, upload {:.3} s, kernels and FFT {:.3} s, download {:.3} s (start-up {:.2} s)",
                t.chunks, t.stage, t.upload, t.compute, t.download, t.start
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

// ---------------------------------------------------------------------------------------------

/// Checking the GPU's rows, and the synthetic recordings used to do so: shared by the start-up
/// self-check, `ailhd doctor` and the parity tests. Rows are held against [`reference::row`]
/// under the contract's rule as [`mel::check_accuracy`] implements it; this module adds folding
/// several recordings' results together and a one-line report.
pub mod parity {
    use crate::config::FeatureSettings;
    use crate::decode::Waveform;
    use crate::features::mel::Accuracy;
    use crate::synth::Rng;

    /// Fold `other` (another recording) into `total`.
    pub fn merge(total: &mut Accuracy, other: &Accuracy) {
        total.checked += other.checked;
        total.max_abs_db = total.max_abs_db.max(other.max_abs_db);
        total.max_ulps = total.max_ulps.max(other.max_ulps);
        total.max_of_tolerance = total.max_of_tolerance.max(other.max_of_tolerance);
        total.violations += other.violations;
        if total.first_violation.is_none() {
            total.first_violation = other.first_violation;
        }
    }

    /// "max 0.50 float16 ulps (0.0078 dB) over 5120 values[, N outside the rule (first: ...)]".
    pub fn summary(acc: &Accuracy) -> String {
        let mut s = format!(
            "max {:.2} float16 ulps ({:.4} dB) over {} values",
            acc.max_ulps, acc.max_abs_db, acc.checked
        );
        if let Some((i, expected, got)) = acc.first_violation {
            s.push_str(&format!(
                ", {} outside the rule (first: value {i} is {got:.4} dB, reference {expected:.4} dB)",
                acc.violations
            ));
        }
        s
    }

    /// Deterministic recordings of the configured length: a tone, tones with noise, quiet noise,
    /// silence (int16, the common path), and a chirp and the noisy tones again as float
    /// recordings (the float path).
    pub fn synthetic_recordings(settings: &FeatureSettings) -> Vec<(String, Waveform)> {
        let n = settings.shape().num_samples;
        let sr = settings.sample_rate as f64;
        let mut rng = Rng::new(0x6169_6c68);
        let tau = std::f64::consts::TAU;
        let tone = |i: usize, f: f64| (tau * f * i as f64 / sr).sin();
        let to_pcm = |x: &[f64]| {
            Waveform::Pcm16(
                x.iter()
                    .map(|v| (v * 32767.0).round().clamp(-32768.0, 32767.0) as i16)
                    .collect(),
            )
        };
        let to_float = |x: &[f64]| Waveform::Float(x.iter().map(|&v| v as f32).collect());

        let pure: Vec<f64> = (0..n).map(|i| 0.5 * tone(i, sr * 0.107)).collect();
        let mix: Vec<f64> = (0..n)
            .map(|i| {
                0.3 * tone(i, sr * 0.0517)
                    + 0.2 * tone(i, sr * 0.23)
                    + 0.1 * tone(i, sr * 0.3711)
                    + 0.05 * rng.uniform() as f64
            })
            .collect();
        let quiet: Vec<f64> = (0..n).map(|_| 0.002 * rng.uniform() as f64).collect();
        let duration = n as f64 / sr;
        let (f0, f1) = (0.01 * sr, 0.45 * sr);
        let chirp: Vec<f64> = (0..n)
            .map(|i| {
                let t = i as f64 / sr;
                0.7 * (tau * (f0 * t + (f1 - f0) * t * t / (2.0 * duration))).sin()
            })
            .collect();
        vec![
            ("tone".to_string(), to_pcm(&pure)),
            ("tones and noise".to_string(), to_pcm(&mix)),
            ("quiet noise".to_string(), to_pcm(&quiet)),
            ("silence".to_string(), Waveform::Pcm16(vec![0; n])),
            ("chirp (float)".to_string(), to_float(&chirp)),
            ("tones and noise (float)".to_string(), to_float(&mix)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `struct Geometry` in the kernel source, as (name, C type) pairs.
    fn kernel_geometry_fields() -> Vec<(String, String)> {
        let start = KERNEL_SOURCE
            .find("struct Geometry {")
            .expect("kernel source declares struct Geometry");
        let body = &KERNEL_SOURCE[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
        body.lines()
            .map(|l| l.split("//").next().unwrap().trim())
            .filter(|l| !l.is_empty())
            .map(|l| {
                let l = l.trim_end_matches(';');
                let (ty, name) = l.rsplit_once(' ').expect("`type name;`");
                (name.trim().to_string(), ty.trim().to_string())
            })
            .collect()
    }

    #[test]
    fn geometry_matches_the_kernel_struct_field_for_field() {
        let rust: Vec<(String, String)> = GEOMETRY_FIELDS
            .iter()
            .map(|&(name, ty)| {
                let c = match ty {
                    "i32" => "int",
                    "f32" => "float",
                    other => panic!("Geometry field {name}: {other} has no agreed C type"),
                };
                (name.to_string(), c.to_string())
            })
            .collect();
        assert_eq!(rust, kernel_geometry_fields());
        assert_eq!(std::mem::size_of::<Geometry>(), 4 * GEOMETRY_FIELDS.len());
    }

    #[test]
    fn finalize_block_size_matches_the_kernel() {
        assert!(KERNEL_SOURCE.contains(&format!("#define FINALIZE_THREADS {FINALIZE_THREADS}")));
        assert!(FINALIZE_THREADS.is_power_of_two());
    }

    #[test]
    fn chunks_fit_the_frame_budget_and_are_whole_fft_groups() {
        let default = KernelTables::new(&FeatureSettings::default())
            .unwrap()
            .geometry;
        let overlap = KernelTables::new(&FeatureSettings::overlap32())
            .unwrap()
            .geometry;
        assert_eq!(default.frames_per_file, 80);
        assert_eq!(overlap.frames_per_file, 237);
        assert_eq!(chunk_files_for(&default), 512);
        assert_eq!(chunk_files_for(&overlap), 256);
        for g in [default, overlap] {
            assert_eq!(chunk_files_for(&g) % PLAN_FILES, 0, "{g:?}");
        }
    }

    #[test]
    fn tables_follow_the_settings() {
        let t = KernelTables::new(&FeatureSettings::overlap32()).unwrap();
        let g = t.geometry;
        assert_eq!(
            (g.num_long, g.num_short, g.t_frames, g.n_mels, g.row_len),
            (79, 3, 1, 32, 79 * 3 * 32)
        );
        assert_eq!(
            (g.power, g.db_multiplier, g.top_db, g.use_top_db),
            (2.0, 10.0, 80.0, 1)
        );
        assert_eq!(t.window.len(), 512);
        assert_eq!(t.window_f64.len(), 512);
        assert_eq!(t.precision, Precision::F32);
        let default = KernelTables::new(&FeatureSettings::default()).unwrap();
        assert_eq!(
            default.precision,
            Precision::F64,
            "power 1 without a clamp needs D2Z"
        );
        assert_eq!(t.mel_offset.len(), 33);
        assert_eq!(*t.mel_offset.last().unwrap() as usize, t.mel_weights.len());
        for m in 0..32 {
            let len = t.mel_offset[m + 1] - t.mel_offset[m];
            assert!(
                t.mel_start[m] + len <= g.n_freqs,
                "filter {m} inside the spectrum"
            );
        }
        let d = KernelTables::new(&FeatureSettings::default())
            .unwrap()
            .geometry;
        assert_eq!((d.power, d.db_multiplier, d.use_top_db), (1.0, 20.0, 0));
    }

    #[test]
    fn library_names_are_the_ones_cuda_13_installs() {
        // With the cuda-13000 feature cudarc tries, among others, these sonames: the driver's
        // libcuda.so.1, CUDA 13's libnvrtc.so.13 and libcufft.so.12 (cuFFT 12.0 ships with CUDA
        // 13.0), with libnvrtc.so.12 as a fallback. Changing the feature changes this list.
        let libs = probe_libraries();
        let tried = |what: &str| {
            libs.iter()
                .find(|l| l.library == what)
                .unwrap()
                .tried
                .clone()
        };
        assert!(tried("CUDA driver").contains(&"libcuda.so.1".to_string()));
        assert!(tried("NVRTC").contains(&"libnvrtc.so.13".to_string()));
        assert!(tried("NVRTC").contains(&"libnvrtc.so.12".to_string()));
        assert!(tried("cuFFT").contains(&"libcufft.so.12".to_string()));
    }
}
