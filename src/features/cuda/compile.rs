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
pub(super) fn load_kernels(ctx: &Arc<CudaContext>) -> anyhow::Result<(Arc<CudaModule>, String)> {
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
