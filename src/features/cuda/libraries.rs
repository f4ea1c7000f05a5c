//! Finding the CUDA driver, NVRTC and cuFFT the way cudarc loads them, and what the driver says
//! about its GPUs: `doctor`'s report, and the check `CudaFeaturiser::new` makes before touching
//! cudarc (which panics on a missing library).

use crate::config::Gpu;
use anyhow::{anyhow, Context};
use cudarc::cufft;
use cudarc::driver::{self, sys as dsys};
use cudarc::nvrtc;
use serde::Serialize;
use std::ffi::c_int;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

// Finding the libraries. cudarc resolves libraries lazily, by name, and panics when one is
// missing, so we look for them first, with the very names and order cudarc uses
// (`get_lib_name_candidates`). Where the dynamic loader cannot find NVRTC or cuFFT by name, we
// look in folders (`gpu.library_path`; Python environments' `site-packages/nvidia/*/lib`, where
// PyTorch's wheels put CUDA) and load the file found there by its full path: the loader then
// answers cudarc's request by name (its soname, e.g. `libnvrtc.so.13`) with that library.

/// One shared library that cudarc loads at run time, and what happened when we looked for it.
#[derive(Debug, Clone, Serialize)]
pub struct LibraryStatus {
    /// What it is, for people: "CUDA driver", "NVRTC", "cuFFT".
    pub library: &'static str,
    /// The first name in `tried` that the dynamic loader accepted: the one cudarc will load.
    pub loaded: Option<String>,
    /// Where that library is on disk.
    pub path: Option<String>,
    /// How it was found: "gpu.library_path", "the dynamic loader" (system folders, ldconfig,
    /// LD_LIBRARY_PATH) or `Python site-packages (<how that folder was found>)`.
    pub found_by: Option<String>,
    /// NVRTC only: its builtins library (`libnvrtc-builtins.so.<major>.<minor>`), which NVRTC
    /// loads when it compiles, found beside it.
    pub builtins: Option<String>,
    /// Every name tried, in cudarc's order.
    pub tried: Vec<String>,
    /// The folders looked in besides the dynamic loader's own search, in order, each with how
    /// it was found ("gpu.library_path", "VIRTUAL_ENV", "user site-packages", "python3" ...).
    pub searched: Vec<String>,
    /// The loader's complaint about a name that exists but did not load (wrong architecture,
    /// missing dependency): more useful to an operator than "not found".
    pub error: Option<String>,
}

impl LibraryStatus {
    /// The Linux sonames among `tried`: the full list (34 names for the driver) is in
    /// `doctor --json`; these are the ones an operator can act on.
    pub fn sonames(&self) -> Vec<&str> {
        let prefix = format!("lib{}.so", self.spec().stem);
        self.tried
            .iter()
            .map(String::as_str)
            .filter(|n| n.starts_with(&prefix))
            .collect()
    }

    fn spec(&self) -> &'static LibrarySpec {
        LIBRARIES
            .iter()
            .find(|l| l.library == self.library)
            .expect("a known library")
    }

    /// What to do when it is missing.
    pub fn advice(&self) -> &'static str {
        match self.library {
            "CUDA driver" => "install the NVIDIA driver (it provides libcuda.so.1)",
            "NVRTC" => {
                "install the CUDA 13 runtime compiler (package cuda-nvrtc-13-0, or \
                 `pip install nvidia-cuda-nvrtc` in the Python environment) or set \
                 gpu.library_path to the folder holding libnvrtc.so.13"
            }
            _ => {
                "install cuFFT from CUDA 13 (package libcufft-13-0, or `pip install \
                 nvidia-cufft` in the Python environment) or set gpu.library_path to the folder \
                 holding libcufft.so.12"
            }
        }
    }

    /// Why the library is unusable, with what to do about it: every name and folder tried.
    pub fn missing_reason(&self) -> String {
        let mut reason = format!(
            "{} library not found (tried {})",
            self.library,
            self.sonames().join(", ")
        );
        if !self.searched.is_empty() {
            reason.push_str(&format!(" by name and in {}", self.searched.join(", ")));
        }
        if let Some(e) = &self.error {
            reason.push_str(&format!("; the loader said: {e}"));
        }
        reason.push_str(&format!(": {}", self.advice()));
        reason
    }

    /// The same in a few words, for the one log line of a CPU fallback: "CUDA driver not found
    /// (libcuda.so.1)".
    pub fn short_reason(&self) -> String {
        let spec = self.spec();
        match &self.error {
            Some(_) => format!("{} {} does not load", self.library, spec.soname),
            None => format!("{} not found ({})", self.library, spec.soname),
        }
    }
}

/// A library cudarc loads: what it is, cudarc's stems, a symbol to locate the file on disk, the
/// soname CUDA 13 installs, and whether Python wheels provide it.
struct LibrarySpec {
    library: &'static str,
    stem: &'static str,
    stems: &'static [&'static str],
    symbol: &'static str,
    soname: &'static str,
    in_wheels: bool,
}

const LIBRARIES: [LibrarySpec; 3] = [
    LibrarySpec {
        library: "CUDA driver",
        stem: "cuda",
        stems: &["cuda", "nvcuda"],
        symbol: "cuInit",
        soname: "libcuda.so.1",
        // The driver comes with the kernel module, never from a wheel.
        in_wheels: false,
    },
    LibrarySpec {
        library: "NVRTC",
        stem: "nvrtc",
        stems: &["nvrtc"],
        symbol: "nvrtcVersion",
        soname: "libnvrtc.so.13",
        in_wheels: true,
    },
    LibrarySpec {
        library: "cuFFT",
        stem: "cufft",
        stems: &["cufft"],
        symbol: "cufftGetVersion",
        soname: "libcufft.so.12",
        in_wheels: true,
    },
];

/// When the search may start `python3` to ask where its packages are (tens of milliseconds,
/// once per process): the other places (`gpu.library_path`, the loader, `$VIRTUAL_ENV`,
/// `$CONDA_PREFIX`, the user's site-packages) cost only a few `stat`s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AskPython {
    Never,
    /// Only when the CUDA driver was found: a host without one featurises on the CPU whatever
    /// else is installed, and its start must not pay for asking.
    WhenDriverFound,
    Always,
}

/// Where to look for the CUDA libraries besides the dynamic loader's search.
#[derive(Debug, Clone)]
pub struct LibrarySearch {
    /// `gpu.library_path`: searched before anything else.
    pub library_path: Option<PathBuf>,
    pub ask_python: AskPython,
}

impl LibrarySearch {
    /// `doctor`'s search (and tests'): every place, `python3` asked when needed.
    pub fn everywhere(gpu: &Gpu) -> LibrarySearch {
        LibrarySearch {
            library_path: gpu.library_path.clone(),
            ask_python: AskPython::Always,
        }
    }

    /// The featuriser's search: `python3` is asked only on a host with the CUDA driver.
    pub fn for_featuriser(gpu: &Gpu) -> LibrarySearch {
        LibrarySearch {
            library_path: gpu.library_path.clone(),
            ask_python: AskPython::WhenDriverFound,
        }
    }
}

impl Default for LibrarySearch {
    fn default() -> Self {
        LibrarySearch::everywhere(&Gpu::default())
    }
}

/// Look for the driver, NVRTC and cuFFT everywhere, as `doctor` does. Never panics.
pub fn probe_libraries() -> Vec<LibraryStatus> {
    probe_libraries_with(&LibrarySearch::default())
}

/// Look for the driver, NVRTC and cuFFT the way cudarc will, and in `search`'s folders; a
/// library found in a folder is loaded from there, so cudarc gets it. Never panics.
pub fn probe_libraries_with(search: &LibrarySearch) -> Vec<LibraryStatus> {
    let mut found: Vec<LibraryStatus> = Vec::new();
    for spec in &LIBRARIES {
        let mut tried: Vec<String> = Vec::new();
        for stem in spec.stems {
            for name in cudarc::get_lib_name_candidates(stem) {
                if !tried.contains(&name) {
                    tried.push(name);
                }
            }
        }
        let mut status = LibraryStatus {
            library: spec.library,
            loaded: None,
            path: None,
            found_by: None,
            builtins: None,
            tried,
            searched: Vec::new(),
            error: None,
        };
        // The folders the library may be loaded from, with how each was found.
        let mut folders: Vec<(PathBuf, String)> = Vec::new();
        if let Some(dir) = &search.library_path {
            status
                .searched
                .push(format!("{} (gpu.library_path)", dir.display()));
            folders.push((dir.clone(), "gpu.library_path".into()));
            preload_from(dir, spec, &mut status);
        }
        load_by_name(spec, &mut status);
        if status.loaded.is_none() && spec.in_wheels {
            let driver = found
                .iter()
                .any(|l| l.library == "CUDA driver" && l.loaded.is_some());
            let ask = match search.ask_python {
                AskPython::Never => false,
                AskPython::WhenDriverFound => driver,
                AskPython::Always => true,
            };
            let mut sites = cheap_site_packages();
            if ask {
                for site in python_site_packages() {
                    if !sites.iter().any(|(p, _)| p == &site.0) {
                        sites.push(site.clone());
                    }
                }
            }
            'sites: for (site, how) in sites {
                for dir in nvidia_lib_dirs(&site) {
                    status.searched.push(format!("{} ({how})", dir.display()));
                    folders.push((dir.clone(), format!("Python site-packages ({how})")));
                    if preload_from(&dir, spec, &mut status) {
                        load_by_name(spec, &mut status);
                        if status.loaded.is_some() {
                            break 'sites;
                        }
                    }
                }
            }
        }
        if let Some(path) = &status.path {
            let dir = Path::new(path).parent().map(canonical);
            let mut preloaded = PRELOADED.lock().unwrap_or_else(|e| e.into_inner());
            // This search's folders, then those an earlier search in this process loaded from.
            let how = folders
                .iter()
                .chain(preloaded.iter())
                .find(|(f, _)| Some(canonical(f)) == dir)
                .map(|(f, how)| (f.clone(), how.clone()));
            status.found_by = Some(match how {
                Some((folder, how)) => {
                    if !preloaded.iter().any(|(f, _)| f == &folder) {
                        preloaded.push((folder, how.clone()));
                    }
                    how
                }
                None => "the dynamic loader".into(),
            });
            if spec.library == "NVRTC" {
                status.builtins = Path::new(path)
                    .parent()
                    .and_then(|d| nvrtc_builtins_in(d, status.loaded.as_deref()?))
                    .map(|p| p.display().to_string());
            }
        } else if status.loaded.is_some() {
            status.found_by = Some("the dynamic loader".into());
        }
        found.push(status);
    }
    found
}

/// The folders libraries were loaded from in this process, with how each was found: a later
/// search (the featuriser's after `doctor`'s, say) finds them by name and still says where from.
static PRELOADED: std::sync::Mutex<Vec<(PathBuf, String)>> = std::sync::Mutex::new(Vec::new());

fn canonical(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Try cudarc's names, in cudarc's order, as cudarc will: the first that loads is the one
/// cudarc gets.
fn load_by_name(spec: &LibrarySpec, status: &mut LibraryStatus) {
    for name in &status.tried {
        match dl_probe(name, spec.symbol) {
            Ok(path) => {
                status.loaded = Some(name.clone());
                status.path = path;
                return;
            }
            Err(Some(e)) if !e.contains("No such file") && status.error.is_none() => {
                status.error = Some(e);
            }
            Err(_) => {}
        }
    }
}

/// Load the first of cudarc's names present in `dir` (and, for NVRTC, its builtins beside it)
/// by full path. True when one loaded.
fn preload_from(dir: &Path, spec: &LibrarySpec, status: &mut LibraryStatus) -> bool {
    for name in &status.tried {
        let file = dir.join(name);
        if !file.is_file() {
            continue;
        }
        if spec.library == "NVRTC" {
            // NVRTC loads its builtins by name when it compiles; the wheels' NVRTC finds them
            // beside itself ($ORIGIN), but loading them first costs nothing and holds anywhere.
            if let Some(builtins) = nvrtc_builtins_in(dir, name) {
                let _ = dl_open_path(&builtins);
            }
        }
        match dl_open_path(&file) {
            Ok(()) => return true,
            Err(e) => {
                if status.error.is_none() {
                    status.error = Some(e);
                }
            }
        }
    }
    false
}

/// `libnvrtc-builtins.so.<major>.<minor>` in `dir`, for the NVRTC file named `nvrtc`
/// (`libnvrtc.so.13`: major 13; unversioned: any).
fn nvrtc_builtins_in(dir: &Path, nvrtc: &str) -> Option<PathBuf> {
    let major = nvrtc.strip_prefix("libnvrtc.so.").unwrap_or("");
    let prefix = if major.is_empty() {
        "libnvrtc-builtins.so.".to_string()
    } else {
        format!("libnvrtc-builtins.so.{major}.")
    };
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.len() > prefix.len())
        })
        .collect();
    found.sort();
    found.pop()
}

/// `site-packages/nvidia/*/lib` (the wheels' layout: `nvidia/cu13/lib`, `nvidia/cuda_nvrtc/lib`,
/// `nvidia/cufft/lib` ...), in name order.
fn nvidia_lib_dirs(site: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(site.join("nvidia")) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path().join("lib"))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// The site-packages folders found without starting Python: the active virtual environment's
/// (`$VIRTUAL_ENV`), conda's (`$CONDA_PREFIX`), the user's (`$PYTHONUSERBASE` or `~/.local`).
fn cheap_site_packages() -> Vec<(PathBuf, String)> {
    let mut sites = Vec::new();
    let prefixes = [
        (std::env::var_os("VIRTUAL_ENV"), "VIRTUAL_ENV"),
        (std::env::var_os("CONDA_PREFIX"), "CONDA_PREFIX"),
        (
            std::env::var_os("PYTHONUSERBASE")
                .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".local").into())),
            "user site-packages",
        ),
    ];
    for (prefix, how) in prefixes {
        let Some(prefix) = prefix.filter(|p| !p.is_empty()) else {
            continue;
        };
        for lib in ["lib", "lib64"] {
            let Ok(entries) = std::fs::read_dir(Path::new(&prefix).join(lib)) else {
                continue;
            };
            let mut found: Vec<PathBuf> = entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
                .map(|e| e.path().join("site-packages"))
                .filter(|p| p.is_dir())
                .collect();
            found.sort();
            // The newest Python first.
            for site in found.into_iter().rev() {
                if !sites.iter().any(|(p, _)| p == &site) {
                    sites.push((site, how.to_string()));
                }
            }
        }
    }
    sites
}

/// The folders `python3` imports from (its `sys.path`, site-packages and the user's), asked once
/// per process, with a time limit; none when there is no `python3` or it does not answer.
fn python_site_packages() -> &'static [(PathBuf, String)] {
    static SITES: OnceLock<Vec<(PathBuf, String)>> = OnceLock::new();
    SITES.get_or_init(|| {
        const SCRIPT: &str = "import site, sys\n\
            p = list(sys.path)\n\
            try: p += site.getsitepackages()\n\
            except Exception: pass\n\
            try: p.append(site.getusersitepackages())\n\
            except Exception: pass\n\
            print('\\n'.join(p))\n";
        let Some(out) = run_with_limit(
            std::process::Command::new("python3").args(["-c", SCRIPT]),
            Duration::from_secs(5),
        ) else {
            return Vec::new();
        };
        let mut sites: Vec<(PathBuf, String)> = Vec::new();
        for line in out.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let p = PathBuf::from(line);
            if p.join("nvidia").is_dir() && !sites.iter().any(|(s, _)| s == &p) {
                sites.push((p, "python3".into()));
            }
        }
        sites
    })
}

/// Run `cmd` and return its standard output, or None when it cannot start, fails, or takes
/// longer than `limit` (it is then killed).
fn run_with_limit(cmd: &mut std::process::Command, limit: Duration) -> Option<String> {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut stdout = child.stdout.take()?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let started = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let out = reader.join().ok()?;
                return status.success().then_some(out);
            }
            Ok(None) if started.elapsed() < limit => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                log::debug!("python3 did not say where its packages are within {limit:?}");
                return None;
            }
        }
    }
}

/// dlopen a file by path, keeping it loaded for cudarc to find by its soname.
#[cfg(unix)]
fn dl_open_path(path: &Path) -> Result<(), String> {
    use std::ffi::{CStr, CString};
    use std::os::unix::ffi::OsStrExt;
    let cpath = CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: a valid NUL-terminated path; the handle is deliberately never closed (see dl_probe).
    unsafe {
        let handle = libc::dlopen(cpath.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            let err = libc::dlerror();
            return Err(if err.is_null() {
                format!("{} does not load", path.display())
            } else {
                CStr::from_ptr(err).to_string_lossy().into_owned()
            });
        }
    }
    Ok(())
}

#[cfg(not(unix))]
fn dl_open_path(path: &Path) -> Result<(), String> {
    Err(format!(
        "{}: loading by path is not supported here",
        path.display()
    ))
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

/// Query the libraries (searched everywhere), driver and GPUs without creating a context.
/// Never panics.
pub fn probe() -> CudaProbe {
    probe_with(&LibrarySearch::default())
}

/// [`probe`] with `search`'s folders (`gpu.library_path`).
pub fn probe_with(search: &LibrarySearch) -> CudaProbe {
    let libraries = probe_libraries_with(search);
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

pub fn nvrtc_version() -> anyhow::Result<String> {
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
    match crate::logging::contain(f) {
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
