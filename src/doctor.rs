//! `ailhd doctor`: what this host offers for featurising (CPU features, CUDA driver, GPU, NVRTC,
//! cuFFT) and a parity self-test: the GPU's and the CPU's rows against the float64 reference
//! ([`crate::features::reference`]) under the contract's accuracy rule, at 1x its tolerance. A host without a GPU
//! is a normal answer, not a failure: the report says so plainly and the command succeeds.

use crate::config::{FeatureSettings, Gpu};
use crate::decode::Waveform;
use crate::features::cpu::CpuFeaturiser;
use crate::features::cuda::{
    self, parity, CudaFeaturiser, CudaProbe, LibrarySearch, LibraryStatus,
};
use crate::features::mel::{self, Accuracy};
use crate::features::{reference, Featuriser};
use anyhow::Context;
use half::f16;
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Debug, Serialize)]
pub struct DoctorReport {
    pub ailhd_version: &'static str,
    pub cpu: CpuReport,
    pub cuda: CudaProbe,
    pub parity: Vec<ParityResult>,
}

#[derive(Debug, Serialize)]
pub struct CpuReport {
    pub arch: &'static str,
    pub threads: usize,
    /// SIMD features the CPU featuriser can use.
    pub features: BTreeMap<&'static str, bool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ParityStatus {
    Passed,
    Failed,
    Skipped,
}

/// GPU and CPU against the float64 reference on the synthetic recordings, for one setup.
#[derive(Debug, Serialize)]
pub struct ParityResult {
    /// "configured", "default" or "overlap32".
    pub setup: String,
    pub row_dims: [usize; 4],
    pub status: ParityStatus,
    /// The GPU featuriser's name (`cuda:<gpu>`), when it started.
    pub device: Option<String>,
    pub recordings: usize,
    /// GPU rows against the reference, all recordings together (`mel::check_accuracy`).
    pub agreement: Option<Agreement>,
    /// CPU rows against the reference, for comparison.
    pub cpu_agreement: Option<Agreement>,
    /// Each recording alone, in a small batch, and in a batch larger than two GPU chunks gave the
    /// same row bytes (the contract: a row never depends on its batch).
    pub batch_independent: Option<bool>,
    /// Why it was skipped or failed.
    pub reason: Option<String>,
}

/// How far a device's rows are from the reference (a `mel::Accuracy`, in a form JSON can carry).
#[derive(Debug, Serialize)]
pub struct Agreement {
    /// Values compared under the strict part of the rule (within 100 dB of the row maximum).
    pub checked: usize,
    pub max_ulps: f64,
    pub max_abs_db: f64,
    /// Largest error as a fraction of the tolerance (the rule holds up to 1).
    pub max_of_tolerance: f64,
    pub violations: usize,
    /// "max ... float16 ulps (... dB) over ... values[, ... outside the rule (first: ...)]".
    pub summary: String,
}

impl From<&Accuracy> for Agreement {
    fn from(a: &Accuracy) -> Self {
        Agreement {
            checked: a.checked,
            max_ulps: a.max_ulps,
            max_abs_db: a.max_abs_db,
            max_of_tolerance: a.max_of_tolerance,
            violations: a.violations,
            summary: parity::summary(a),
        }
    }
}

/// Print the report (human-readable, or one JSON object with `json`). Errors only when a GPU is
/// present and the self-test fails, or the report cannot be written. The CUDA libraries are
/// looked for everywhere the featuriser looks (`gpu` names a folder to search first), and
/// `python3` is asked where its packages are even on a host without the driver.
pub fn run_doctor(settings: &FeatureSettings, gpu: &Gpu, json: bool) -> anyhow::Result<()> {
    let search = LibrarySearch::everywhere(gpu);
    let cuda = cuda::probe_with(&search);
    let mut setups: Vec<(String, FeatureSettings)> = Vec::new();
    let named = [
        ("default", FeatureSettings::default()),
        ("overlap32", FeatureSettings::overlap32()),
    ];
    if !named.iter().any(|(_, s)| s == settings) {
        setups.push(("configured".into(), settings.clone()));
    }
    setups.extend(named.into_iter().map(|(n, s)| (n.to_string(), s)));

    // A host with a GPU whose featuriser cannot start (NVRTC or cuFFT missing included) fails.
    let no_gpu = (!cuda.gpu_present()).then(|| cuda.problems.join("; "));
    let parity = setups
        .iter()
        .map(|(name, s)| parity_for(name, s, &search, no_gpu.as_deref()))
        .collect();
    let report = DoctorReport {
        ailhd_version: env!("CARGO_PKG_VERSION"),
        cpu: cpu_report(),
        cuda,
        parity,
    };
    if json {
        println!(
            "{}",
            crate::json::render(&report).context("writing the report as JSON")?
        );
    } else {
        print!("{}", render(&report));
    }
    let failed: Vec<&str> = report
        .parity
        .iter()
        .filter(|p| p.status == ParityStatus::Failed)
        .map(|p| p.setup.as_str())
        .collect();
    if !failed.is_empty() {
        anyhow::bail!(
            "the GPU/CPU parity self-test failed for {}; featurise with `--device cpu` (or ingest.device = \"cpu\") until this is fixed",
            failed.join(", ")
        );
    }
    Ok(())
}

fn cpu_report() -> CpuReport {
    #[allow(unused_mut)]
    let mut features = BTreeMap::new();
    #[cfg(target_arch = "x86_64")]
    {
        features.insert("avx2", std::arch::is_x86_feature_detected!("avx2"));
        features.insert("fma", std::arch::is_x86_feature_detected!("fma"));
        features.insert("avx512f", std::arch::is_x86_feature_detected!("avx512f"));
    }
    #[cfg(target_arch = "aarch64")]
    {
        features.insert("neon", std::arch::is_aarch64_feature_detected!("neon"));
    }
    CpuReport {
        arch: std::env::consts::ARCH,
        threads: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        features,
    }
}

fn parity_for(
    setup: &str,
    settings: &FeatureSettings,
    search: &LibrarySearch,
    no_gpu: Option<&str>,
) -> ParityResult {
    let recordings = parity::synthetic_recordings(settings);
    let mut result = ParityResult {
        setup: setup.to_string(),
        row_dims: settings.shape().row_dims(),
        status: ParityStatus::Skipped,
        device: None,
        recordings: recordings.len(),
        agreement: None,
        cpu_agreement: None,
        batch_independent: None,
        reason: None,
    };
    if let Some(why) = no_gpu {
        result.reason = Some(format!("no usable GPU ({why})"));
        return result;
    }
    match compare(settings, search, &recordings, &mut result) {
        Ok(()) => {
            let agreed = result.agreement.as_ref().is_some_and(|a| a.violations == 0);
            let independent = result.batch_independent.unwrap_or(false);
            result.status = if agreed && independent {
                ParityStatus::Passed
            } else {
                ParityStatus::Failed
            };
            if !independent {
                result.reason = Some("a large batch gave different rows than a small one".into());
            }
        }
        Err(e) => {
            result.status = ParityStatus::Failed;
            result.reason = Some(format!("{e:#}"));
        }
    }
    result
}

fn compare(
    settings: &FeatureSettings,
    search: &LibrarySearch,
    recordings: &[(String, Waveform)],
    result: &mut ParityResult,
) -> anyhow::Result<()> {
    let row_len = settings.shape().row_len();
    let batch: Vec<&Waveform> = recordings.iter().map(|(_, w)| w).collect();
    let mut gpu =
        CudaFeaturiser::with_libraries(settings, search).context("starting the GPU featuriser")?;
    result.device = Some(gpu.name());
    let mut gpu_rows = vec![f16::ZERO; batch.len() * row_len];
    gpu.featurise(&batch, &mut gpu_rows)?;
    let mut cpu_rows = vec![f16::ZERO; batch.len() * row_len];
    CpuFeaturiser::new(
        settings,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    )
    .and_then(|mut cpu| cpu.featurise(&batch, &mut cpu_rows))
    .context("CPU featuriser")?;
    let (mut on_gpu, mut on_cpu) = (Accuracy::default(), Accuracy::default());
    for (i, wav) in batch.iter().enumerate() {
        let exact = reference::row(wav, settings);
        let span = i * row_len..(i + 1) * row_len;
        parity::merge(
            &mut on_gpu,
            &mel::check_accuracy(&exact, &gpu_rows[span.clone()]),
        );
        parity::merge(&mut on_cpu, &mel::check_accuracy(&exact, &cpu_rows[span]));
    }
    result.agreement = Some(Agreement::from(&on_gpu));
    result.cpu_agreement = Some(Agreement::from(&on_cpu));

    // Each recording alone; then more than two chunks, so both staging slots are reused, the
    // pipeline runs in full and every recording sits at other positions of the FFT groups.
    let mut independent = true;
    for (i, wav) in batch.iter().enumerate() {
        let mut one = vec![f16::ZERO; row_len];
        gpu.featurise(&[wav], &mut one)?;
        independent &= one[..] == gpu_rows[i * row_len..(i + 1) * row_len];
    }
    let big: Vec<&Waveform> = batch
        .iter()
        .copied()
        .cycle()
        .take(2 * gpu.chunk_files() + 3)
        .collect();
    let mut big_rows = vec![f16::ZERO; big.len() * row_len];
    gpu.featurise(&big, &mut big_rows)?;
    independent &= big_rows
        .chunks(row_len)
        .enumerate()
        .all(|(i, row)| row == &gpu_rows[(i % batch.len()) * row_len..][..row_len]);
    result.batch_independent = Some(independent);
    Ok(())
}

fn render(report: &DoctorReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "ailhd {} doctor\n", report.ailhd_version);
    render_cpu(&mut s, &report.cpu);
    render_cuda(&mut s, &report.cuda);
    render_parity(&mut s, &report.parity);
    s
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn render_cpu(s: &mut String, cpu: &CpuReport) {
    use std::fmt::Write;
    let features: Vec<String> = cpu
        .features
        .iter()
        .map(|(name, &on)| format!("{name} {}", yes(on)))
        .collect();
    let _ = writeln!(s, "CPU");
    let _ = writeln!(
        s,
        "  {}, {} threads; {}",
        cpu.arch,
        cpu.threads,
        if features.is_empty() {
            "no SIMD features checked on this architecture".to_string()
        } else {
            features.join(", ")
        }
    );
}

fn render_cuda(s: &mut String, cuda: &CudaProbe) {
    use std::fmt::Write;
    let _ = writeln!(s, "\nCUDA");
    for lib in &cuda.libraries {
        let _ = writeln!(s, "  {:<13}{}", lib.library, library_line(cuda, lib));
    }
    for gpu in &cuda.gpus {
        let _ = writeln!(
            s,
            "  {:<13}{}, {:.1} GiB, compute capability {}",
            format!("GPU {}", gpu.ordinal),
            gpu.name,
            gpu.total_memory_bytes as f64 / (1u64 << 30) as f64,
            gpu.compute_capability
        );
    }
    if !cuda.problems.is_empty() {
        let _ = writeln!(s, "  No usable GPU: featurising runs on the CPU.");
        // Missing libraries are on their own lines above.
        let missing: Vec<String> = cuda
            .libraries
            .iter()
            .filter(|l| l.loaded.is_none())
            .map(|l| l.missing_reason())
            .collect();
        for problem in cuda.problems.iter().filter(|p| !missing.contains(p)) {
            let _ = writeln!(s, "  - {problem}");
        }
    } else {
        let _ = writeln!(
            s,
            "  The GPU featuriser can be used (ingest.device = \"auto\" picks it)."
        );
    }
}

/// One CUDA library: what was loaded (where from, its version, how it was found), or what was
/// tried and what to do.
fn library_line(cuda: &CudaProbe, lib: &LibraryStatus) -> String {
    let version = match lib.library {
        "CUDA driver" => cuda.driver_version.as_ref().map(|v| format!("CUDA {v}")),
        "NVRTC" => cuda.nvrtc_version.clone(),
        _ => cuda.cufft_version.clone(),
    };
    match &lib.loaded {
        Some(name) => format!(
            "{name}{}{}{}{}",
            lib.path
                .as_ref()
                .map(|p| format!(" ({p})"))
                .unwrap_or_default(),
            version
                .map(|v| format!(", version {v}"))
                .unwrap_or_default(),
            lib.found_by
                .as_ref()
                .map(|by| format!(", found by {by}"))
                .unwrap_or_default(),
            lib.builtins
                .as_ref()
                .map(|b| format!("; builtins {b}"))
                .unwrap_or_default(),
        ),
        None => format!(
            "not found (tried {}{}): {}",
            lib.sonames().join(", "),
            if lib.searched.is_empty() {
                String::new()
            } else {
                format!(" by name and in {}", lib.searched.join(", "))
            },
            lib.advice()
        ),
    }
}

fn render_parity(s: &mut String, parity: &[ParityResult]) {
    use std::fmt::Write;
    let _ = writeln!(
        s,
        "\nGPU parity: rows against the float64 reference, contract tolerance at 1x\n(synthetic recordings: tones, noise, silence, chirp)"
    );
    for p in parity {
        let dims = format!("{:?}", p.row_dims);
        let verdict = match p.status {
            ParityStatus::Passed => "passed",
            ParityStatus::Failed => "FAILED",
            ParityStatus::Skipped => "skipped",
        };
        let mut detail = Vec::new();
        if let Some(a) = &p.agreement {
            detail.push(format!(
                "GPU {:.3} of the tolerance ({})",
                a.max_of_tolerance, a.summary
            ));
        }
        if let Some(a) = &p.cpu_agreement {
            detail.push(format!("CPU {:.3}", a.max_of_tolerance));
        }
        if p.batch_independent == Some(true) {
            detail.push("same rows at any batch size".into());
        }
        match (&p.reason, p.status) {
            // The reasons are in the CUDA section; `--json` has them in full here too.
            (Some(_), ParityStatus::Skipped) => detail.push("no usable GPU".into()),
            (Some(r), _) => detail.push(r.clone()),
            (None, _) => {}
        }
        let _ = writeln!(
            s,
            "  {:<11}{:<17}{verdict}: {}",
            p.setup,
            dims,
            detail.join("; ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_host_without_a_gpu_plainly() {
        let settings = FeatureSettings::default();
        let report = DoctorReport {
            ailhd_version: "test",
            cpu: cpu_report(),
            cuda: cuda::probe(),
            parity: vec![parity_for(
                "default",
                &settings,
                &LibrarySearch::default(),
                Some("CUDA driver library not found"),
            )],
        };
        let text = render(&report);
        assert!(text.contains("CPU"), "{text}");
        assert!(text.contains("skipped: no usable GPU"), "{text}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["parity"][0]["status"], "skipped");
        assert!(json["cuda"]["libraries"].as_array().unwrap().len() == 3);
    }
}
