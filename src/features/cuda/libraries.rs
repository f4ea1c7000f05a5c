//! Finding the CUDA driver, NVRTC and cuFFT the way cudarc loads them, and what the driver says
//! about its GPUs: `doctor`'s report, and the check `CudaFeaturiser::new` makes before touching
//! cudarc (which panics on a missing library).

use anyhow::{anyhow, Context};
use cudarc::cufft;
use cudarc::driver::{self, sys as dsys};
use cudarc::nvrtc;
use serde::Serialize;
use std::ffi::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};

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

impl CudaProbe {
    /// Whether this host has an NVIDIA GPU at all: the driver lists one, or the kernel driver's
    /// device node exists (a GPU whose user-space libraries are missing or broken is still a
    /// GPU: featurising on it failing is a fault to report, not a host without a GPU).
    pub fn gpu_present(&self) -> bool {
        !self.gpus.is_empty() || std::path::Path::new("/dev/nvidia0").exists()
    }
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

pub(super) fn nvrtc_version() -> anyhow::Result<String> {
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
pub(super) fn guarded<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => Err(anyhow!("cudarc panicked: {}", panic_message(&*payload))),
    }
}

pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
