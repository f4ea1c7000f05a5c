//! NVRTC: the kernel source compiled at start-up for the GPU actually present (a CUBIN for its
//! exact architecture where NVRTC knows it, else PTX the driver JIT-compiles), then loaded.

use super::libraries::nvrtc_version;
use super::KERNEL_SOURCE;
use anyhow::{anyhow, bail, Context};
use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc;
use std::ffi::{c_char, c_int};
use std::sync::Arc;

/// The GPU's architecture as NVRTC numbers it (8.9 -> 89).
fn arch_number(major: i32, minor: i32) -> i32 {
    major * 10 + minor
}

/// The GPU architectures (compute capability x 10) the project claims, each with the NVRTC major
/// versions that compile for it. CUDA 13's NVRTC dropped Volta (sm_70 and sm_72; its oldest is
/// sm_75): a Volta GPU needs NVRTC 12 (cudarc loads `libnvrtc.so.12` where `libnvrtc.so.13` is
/// absent) and cuFFT from CUDA 12. `tests/gpu_readiness.rs` compiles the kernels for each
/// architecture the NVRTC at hand is claimed for, and for the newest it knows.
pub const ARCHITECTURES: [(i32, std::ops::RangeInclusive<u32>); 8] = [
    (70, 11..=12),
    (75, 11..=13),
    (80, 11..=13),
    (86, 11..=13),
    (89, 12..=13),
    (90, 12..=13),
    (100, 12..=13),
    (120, 12..=13),
];

/// Every option the kernels are compiled with, for `arch` ("sm_90" or "compute_90"): the one list,
/// used at start-up and by the tests that compile the kernels with a real NVRTC.
///
/// float32 semantics as written: no fast-math, IEEE division/sqrt, denormals kept. The accuracy
/// rule (within one float16 ulp of the float64 value) is met by float32 arithmetic, not by
/// approximate intrinsics.
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--fmad=true".to_string(),
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
    ]
}

/// What NVRTC made of a source for one target: a CUBIN ("sm_*") or PTX ("compute_*"), and the
/// compiler's log (empty when there is nothing to say: a warning is text here).
pub struct Compiled {
    pub image: KernelImage,
    pub log: String,
}

pub enum KernelImage {
    Cubin(Vec<u8>),
    Ptx(String),
}

/// The architectures this NVRTC compiles for (compute capability x 10, oldest first). Needs
/// NVRTC loaded (see [`super::probe_libraries`]); cudarc panics otherwise.
pub fn supported_architectures() -> anyhow::Result<Vec<i32>> {
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

/// Compile `source` (called `name` in messages) for `arch` ("sm_90": a CUBIN for exactly this
/// GPU; "compute_90": PTX the driver JIT-compiles) with [`compile_options`], plus `extra` (the
/// tests add `--ptxas-options=-v` to read register use and spills; start-up adds nothing). A
/// CUBIN is preferred at start-up: it loads on any driver of the same CUDA major version, while
/// PTX from a newer NVRTC than the driver is refused. An error carries NVRTC's log.
pub fn compile(source: &str, name: &str, arch: &str, extra: &[&str]) -> anyhow::Result<Compiled> {
    use std::ffi::CString;
    struct Program(nvrtc::sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: created by create_program below and destroyed only here.
            let _ = unsafe { nvrtc::result::destroy_program(self.0) };
        }
    }
    let src = CString::new(source).with_context(|| format!("{name} contains a NUL byte"))?;
    let cname = CString::new(name).context("a file name with a NUL byte")?;
    let prog = Program(nvrtc::result::create_program(&src, Some(&cname))?);
    let mut options = compile_options(arch);
    options.extend(extra.iter().map(|o| o.to_string()));
    // SAFETY: `prog` is alive until the end of this function; `src`/`cname` outlive it.
    unsafe {
        let compiled = nvrtc::result::compile_program(prog.0, &options);
        let log = nvrtc::result::get_program_log(prog.0)
            .map(|l| c_chars_to_string(&l))
            .unwrap_or_default();
        if let Err(e) = compiled {
            bail!(
                "NVRTC could not compile {name} for {arch}: {e}\n{}",
                log.trim_end()
            );
        }
        let image = if arch.starts_with("sm_") {
            let mut size = 0usize;
            nvrtc::sys::nvrtcGetCUBINSize(prog.0, &mut size).result()?;
            let mut cubin = vec![0u8; size];
            nvrtc::sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut c_char).result()?;
            KernelImage::Cubin(cubin)
        } else {
            KernelImage::Ptx(c_chars_to_string(&nvrtc::result::get_ptx(prog.0)?))
        };
        Ok(Compiled {
            image,
            log: log.trim().to_string(),
        })
    }
}

/// [`KERNEL_SOURCE`] for `arch`, as start-up loads it. NVRTC's log (a warning) goes to the debug
/// log: the kernels compile without one (`tests/gpu_readiness.rs`). Needs no CUDA context: start-up
/// runs it beside the context's creation.
pub(super) fn nvrtc_compile(arch: &str) -> anyhow::Result<nvrtc::Ptx> {
    let compiled = compile(KERNEL_SOURCE, "kernels/features.cu", arch, &[])?;
    if !compiled.log.is_empty() {
        log::debug!("NVRTC on kernels/features.cu for {arch}: {}", compiled.log);
    }
    Ok(match compiled.image {
        KernelImage::Cubin(cubin) => nvrtc::Ptx::from_binary(cubin),
        KernelImage::Ptx(ptx) => nvrtc::Ptx::from_src(ptx),
    })
}

/// What to compile the kernels for on a GPU of compute capability `major.minor`, best first: a
/// CUBIN for its exact architecture when NVRTC supports it, then PTX for the newest architecture
/// NVRTC knows that the GPU can run.
pub(super) fn targets_for(major: i32, minor: i32) -> anyhow::Result<Vec<String>> {
    let cc = arch_number(major, minor);
    let archs = supported_architectures().context("asking NVRTC which GPUs it supports")?;
    let mut targets = Vec::new();
    if archs.contains(&cc) {
        targets.push(format!("sm_{cc}"));
    }
    if let Some(best) = archs.iter().copied().filter(|&a| a <= cc).max() {
        targets.push(format!("compute_{best}"));
    }
    if targets.is_empty() {
        bail!(
            "this GPU (compute capability {major}.{minor}) is older than anything NVRTC {} supports (oldest: {}.{}); a Volta GPU (7.x) needs NVRTC 12 and cuFFT from CUDA 12: CUDA 13 dropped it",
            nvrtc_version().unwrap_or_else(|_| "?".into()),
            archs.iter().min().map_or(0, |a| a / 10),
            archs.iter().min().map_or(0, |a| a % 10)
        );
    }
    Ok(targets)
}

/// Load the kernels into `ctx`: `first` is what NVRTC made for `targets[0]` (compiled while the
/// context was created); when the driver refuses it, the next targets are compiled and tried.
pub(super) fn load_kernels(
    ctx: &Arc<CudaContext>,
    targets: &[String],
    first: anyhow::Result<nvrtc::Ptx>,
) -> anyhow::Result<(Arc<CudaModule>, String)> {
    let mut failures = Vec::new();
    let mut first = Some(first);
    for target in targets {
        let image = first.take().unwrap_or_else(|| nvrtc_compile(target));
        let loaded = image.and_then(|image| {
            ctx.load_module(image)
                .map_err(|e| anyhow!("the driver refused the compiled kernels: {e}"))
        });
        match loaded {
            Ok(module) => return Ok((module, target.clone())),
            Err(e) => {
                log::warn!("CUDA kernels for {target}: {e:#}");
                failures.push(format!("{target}: {e:#}"));
            }
        }
    }
    bail!("could not build the CUDA kernels: {}", failures.join("; "))
}
