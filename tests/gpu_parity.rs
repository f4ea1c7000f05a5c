//! GPU featuriser parity: GPU rows against the float64 reference (synthetic recordings) and
//! against the reference fixtures (`../shared/fixtures/features`), for the default and overlap32
//! setups, at 1x the contract's tolerance; rows identical at every batch size.
//! Where there is no GPU (no driver library, or the driver lists no device, and no /dev/nvidia0)
//! the GPU tests print "skipping: no GPU here (<reason>)" and pass; where there is one, a
//! featuriser that cannot be built (NVRTC or cuFFT missing included) or fails its self-check
//! FAILS them. With AILHD_REQUIRE_GPU=1 (benches/gpu/device-run.sh sets it) they never skip.
//! Two checks run everywhere: `CudaFeaturiser::new` fails cleanly without CUDA, and the kernel
//! source itself, compiled for the CPU with g++ and CUDA's built-ins emulated, reproduces the
//! reference fixtures in both precisions (the index arithmetic, filterbank, dB, clamp and float16
//! store; a float64 DFT, rounded to the FFT's precision, stands in for cuFFT).

use crate::common::{read_npy_f32, shared};
use ailhd::config::FeatureSettings;
use ailhd::decode::Waveform;
use ailhd::features::cuda::{
    parity, CudaFeaturiser, KernelTables, FINALIZE_THREADS, KERNEL_ENTRY_POINTS, KERNEL_SOURCE,
};
use ailhd::features::mel::check_accuracy;
use ailhd::features::Featuriser;
use half::f16;
use std::path::{Path, PathBuf};
use std::process::Command;

fn setups() -> [(&'static str, FeatureSettings); 2] {
    [
        ("default", FeatureSettings::default()),
        ("overlap32", FeatureSettings::overlap32()),
    ]
}

/// The GPU featuriser, or None (with the reason printed) where this host has no GPU at all.
/// A host with a GPU whose featuriser cannot be built is a failure, not a skip.
fn gpu_or_skip(settings: &FeatureSettings) -> Option<CudaFeaturiser> {
    let probe = ailhd::features::cuda::probe();
    let required = std::env::var("AILHD_REQUIRE_GPU").is_ok_and(|v| !v.is_empty() && v != "0");
    if !probe.gpu_present() && !required {
        println!("skipping: no GPU here ({})", probe.problems.join("; "));
        return None;
    }
    match CudaFeaturiser::new(settings) {
        Ok(f) => Some(f),
        Err(e) if probe.gpu_present() => panic!(
            "a GPU is present ({:?}) but the CUDA featuriser failed: {e:#}",
            probe.gpus.iter().map(|g| &g.name).collect::<Vec<_>>()
        ),
        Err(e) => panic!("AILHD_REQUIRE_GPU is set but the CUDA featuriser failed: {e:#}"),
    }
}

fn featurise(f: &mut dyn Featuriser, batch: &[&Waveform]) -> Vec<f16> {
    let mut out = vec![f16::ZERO; batch.len() * f.shape().row_len()];
    f.featurise(batch, &mut out)
        .unwrap_or_else(|e| panic!("{} featuriser: {e:#}", f.name()));
    out
}

// ---------------------------------------------------------------------------------------------
// Without a GPU.

#[test]
fn without_a_gpu_new_fails_and_says_what_is_missing() {
    let result = std::panic::catch_unwind(|| CudaFeaturiser::new(&FeatureSettings::default()));
    let result = result.expect("CudaFeaturiser::new must not panic");
    match result {
        Ok(f) => println!("a GPU is usable here ({}); nothing to check", f.name()),
        Err(e) => {
            let message = format!("{e:#}");
            println!("CudaFeaturiser::new: {message}");
            let driver_missing = ailhd::features::cuda::probe_libraries()
                .iter()
                .any(|l| l.library == "CUDA driver" && l.loaded.is_none());
            if driver_missing {
                assert!(
                    message.contains("CUDA driver library not found")
                        && message.contains("libcuda.so.1")
                        && message.contains("install the NVIDIA driver"),
                    "{message}"
                );
                // NVRTC and cuFFT are not looked for everywhere without a driver (`doctor`
                // may find them): not named as missing.
                assert!(
                    !message.contains("NVRTC") && !message.contains("cuFFT"),
                    "{message}"
                );
            } else {
                assert!(
                    ["libnvrtc", "libcufft", "GPU", "CUDA", "NVRTC", "cuFFT"]
                        .iter()
                        .any(|w| message.contains(w)),
                    "{message}"
                );
            }
        }
    }
}

#[test]
fn doctor_succeeds_and_reports_the_host() {
    // On a host without a GPU the doctor says so and succeeds; with one, the self-test must pass.
    ailhd::doctor::run_doctor(&FeatureSettings::default(), &Default::default(), true).unwrap();
}

#[test]
fn kernel_source_names_its_entry_points() {
    assert!(!KERNEL_SOURCE.trim().is_empty());
    for name in KERNEL_ENTRY_POINTS {
        // Defined directly, or by one of the source's per-precision macros.
        let direct = format!("extern \"C\" __global__ void {name}(");
        let by_macro = format!("_KERNEL({name},");
        assert!(
            KERNEL_SOURCE.contains(&direct) || KERNEL_SOURCE.contains(&by_macro),
            "kernels/features.cu has no entry point {name}"
        );
    }
    assert!(KERNEL_SOURCE.contains(&format!("#define FINALIZE_THREADS {FINALIZE_THREADS}")));
}

// ---------------------------------------------------------------------------------------------
// With a GPU.

#[test]
fn gpu_rows_meet_the_rule_on_synthetic_recordings_at_every_batch_size() {
    for (setup, settings) in setups() {
        let Some(mut gpu) = gpu_or_skip(&settings) else {
            return;
        };
        let recordings = parity::synthetic_recordings(&settings);
        let batch: Vec<&Waveform> = recordings.iter().map(|(_, w)| w).collect();
        let gpu_rows = featurise(&mut gpu, &batch);
        let row_len = settings.shape().row_len();
        for (i, (name, wav)) in recordings.iter().enumerate() {
            let exact = ailhd::features::reference::row(wav, &settings);
            let a = check_accuracy(&exact, &gpu_rows[i * row_len..(i + 1) * row_len]);
            println!("{setup} {name}: {}", parity::summary(&a));
            assert!(a.violations == 0, "{setup} {name}: {}", parity::summary(&a));
        }

        // Rows must not depend on the batch: each recording alone, batches that end inside an
        // FFT group or just past one, and more than two chunks (both staging slots reused).
        for (i, wav) in batch.iter().enumerate() {
            let alone = featurise(&mut gpu, &[wav]);
            assert!(
                alone[..] == gpu_rows[i * row_len..(i + 1) * row_len],
                "{setup}: recording {i} alone differs from the batch"
            );
        }
        for size in [3, 65, 2 * gpu.chunk_files() + 3] {
            let big: Vec<&Waveform> = batch.iter().copied().cycle().take(size).collect();
            let big_rows = featurise(&mut gpu, &big);
            for (i, row) in big_rows.chunks(row_len).enumerate() {
                let j = i % batch.len();
                assert!(
                    row == &gpu_rows[j * row_len..(j + 1) * row_len],
                    "{setup}: recording {i} of a batch of {size} differs from the small batch"
                );
            }
        }

        // The pipelined interface: more batches in flight than staging slots, of every kind of
        // size (empty, one, several chunks), finished oldest first with the same rows.
        let sizes = [1, 0, 3, gpu.chunk_files() + 5, 2, 65, 1, 7];
        assert!(sizes.len() > gpu.depth());
        let mut offset = 0;
        let mut submitted = Vec::new();
        for &size in &sizes {
            let b: Vec<&Waveform> = batch
                .iter()
                .copied()
                .cycle()
                .skip(offset)
                .take(size)
                .collect();
            gpu.submit(&b, vec![f16::ZERO; size * row_len])
                .unwrap_or_else(|e| panic!("{setup}: submit: {e:#}"));
            submitted.push((offset, size));
            offset += size;
        }
        for (k, &(first, size)) in submitted.iter().enumerate() {
            let rows = gpu.finish().unwrap().expect("a batch is pending");
            assert_eq!(rows.len(), size * row_len);
            for (i, row) in rows.chunks(row_len).enumerate() {
                let j = (first + i) % batch.len();
                assert!(
                    row == &gpu_rows[j * row_len..(j + 1) * row_len],
                    "{setup}: submitted batch {k}, recording {i} differs from the small batch"
                );
            }
        }
        assert!(gpu.finish().unwrap().is_none());

        // The device's stage times come from CUDA events: they must have been measured.
        let t = gpu.device_times();
        println!("{setup}: {t:?}");
        assert!(t.chunks > 0 && t.upload > 0.0 && t.compute > 0.0, "{t:?}");
    }
}

#[test]
fn gpu_rows_match_the_reference_fixtures() {
    for (setup, settings) in setups() {
        let Some(mut gpu) = gpu_or_skip(&settings) else {
            return;
        };
        let cases = valid_cases(&settings);
        let all: Vec<&Waveform> = cases.iter().map(|c| &c.waveform).collect();
        let rows = featurise(&mut gpu, &all);
        let row_len = settings.shape().row_len();
        for (i, case) in cases.iter().enumerate() {
            match case.check(setup, &rows[i * row_len..(i + 1) * row_len]) {
                Ok(text) => println!("{setup} {} (GPU vs reference): {text}", case.name),
                Err(text) => panic!("{setup} {} (GPU vs reference): {text}", case.name),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The kernel source on the CPU.

/// Emulates the CUDA built-ins the kernels use, then includes kernels/features.cu. Grid-stride
/// kernels run thread by thread; finalize_rows runs each block's threads as real threads so
/// __syncthreads is a real barrier. Deliberately small grids make every grid-stride loop iterate.
const HARNESS: &str = r#"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <barrier>
#include <thread>
#include <vector>

struct ailhd_dim3 { unsigned x, y, z; };
static thread_local ailhd_dim3 threadIdx, blockIdx;
static ailhd_dim3 blockDim, gridDim;
static thread_local std::barrier<>* block_barrier = nullptr;

#define AILHD_HOST_EMULATION 1
#define AILHD_DEVICE static inline
#define __global__
#define __device__
#define __restrict__ __restrict
#define __shared__ static
static inline void __syncthreads() { block_barrier->arrive_and_wait(); }
static inline unsigned short f32_to_f16_rn(float x) {
    _Float16 h = (_Float16)x;  // IEEE round to nearest even, like cvt.rn.f16.f32
    unsigned short u;
    memcpy(&u, &h, 2);
    return u;
}

#include "features.cu"

template <class F> static void launch(unsigned grid, unsigned block, F f) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; ++b)
        for (unsigned t = 0; t < block; ++t) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
            f();
        }
}

template <class F> static void launch_with_barriers(unsigned grid, unsigned block, F f) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; ++b) {
        std::barrier<> bar(block);
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < block; ++t)
            threads.emplace_back([&, b, t] {
                blockIdx = {b, 0, 0};
                threadIdx = {t, 0, 0};
                block_barrier = &bar;
                f();
            });
        for (auto& th : threads) th.join();
    }
}

// Kernels 1 and 2 in precision Real, with cuFFT R2C/D2Z's output layout (n_freqs interleaved
// complex bins per frame) computed by a float64 DFT and rounded to Real, as cuFFT's output is.
template <class Real, class FramePcm, class FrameF32, class Mel>
static void spectra(const Geometry& g, int n, bool float_path, const std::vector<short>& pcm,
                    const std::vector<float>& samples, const std::vector<Real>& window,
                    const std::vector<int>& mel_start, const std::vector<int>& mel_offset,
                    const std::vector<float>& mel_weights, std::vector<float>& mel_db,
                    FramePcm frame_pcm16, FrameF32 frame_f32, Mel power_mel_db) {
    const size_t n_frames = (size_t)n * g.frames_per_file;
    std::vector<Real> frames(n_frames * g.n_fft);
    if (float_path)
        launch(3, 64, [&] { frame_f32(g, samples.data(), window.data(), frames.data(), n); });
    else
        launch(3, 64, [&] { frame_pcm16(g, pcm.data(), window.data(), frames.data(), n); });
    std::vector<double> c(g.n_fft), s(g.n_fft);
    for (int j = 0; j < g.n_fft; ++j) {
        c[j] = cos(2.0 * M_PI * j / g.n_fft);
        s[j] = sin(2.0 * M_PI * j / g.n_fft);
    }
    std::vector<Real> spectrum(2 * n_frames * g.n_freqs);
    for (size_t fr = 0; fr < n_frames; ++fr) {
        const Real* x = &frames[fr * g.n_fft];
        for (int k = 0; k < g.n_freqs; ++k) {
            double re = 0, im = 0;
            for (int i = 0; i < g.n_fft; ++i) {
                const int j = (int)(((long long)k * i) % g.n_fft);
                re += x[i] * c[j];
                im -= x[i] * s[j];
            }
            spectrum[2 * (fr * g.n_freqs + k)] = (Real)re;
            spectrum[2 * (fr * g.n_freqs + k) + 1] = (Real)im;
        }
    }
    launch(5, 32, [&] {
        power_mel_db(g, spectrum.data(), mel_start.data(), mel_offset.data(), mel_weights.data(),
                     mel_db.data(), n);
    });
}

struct Reader {
    std::vector<char> data;
    size_t pos = 0;
    template <class T> T get() { T v; memcpy(&v, &data[pos], sizeof(T)); pos += sizeof(T); return v; }
    template <class T> std::vector<T> array(size_t n) {
        std::vector<T> v(n);
        memcpy(v.data(), &data[pos], n * sizeof(T));
        pos += n * sizeof(T);
        return v;
    }
};

int main(int argc, char** argv) {
    if (argc != 3) { fprintf(stderr, "usage: harness IN OUT\n"); return 2; }
    FILE* f = fopen(argv[1], "rb");
    if (!f) { perror(argv[1]); return 1; }
    Reader r;
    char buf[1 << 16];
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, f)) > 0) r.data.insert(r.data.end(), buf, buf + got);
    fclose(f);

    const uint32_t n_files = r.get<uint32_t>();
    const uint32_t float_path = r.get<uint32_t>();
    const uint32_t f64 = r.get<uint32_t>();
    const uint32_t geometry_bytes = r.get<uint32_t>();
    if (geometry_bytes != sizeof(Geometry)) { fprintf(stderr, "Geometry size mismatch\n"); return 1; }
    const Geometry g = r.get<Geometry>();
    const auto window = r.array<float>(g.n_fft);
    const auto window_f64 = r.array<double>(g.n_fft);
    const auto mel_start = r.array<int>(g.n_mels);
    const auto mel_offset = r.array<int>(g.n_mels + 1);
    const auto mel_weights = r.array<float>(r.get<uint32_t>());
    const size_t n_samples = (size_t)n_files * g.num_samples;
    const auto pcm = float_path ? std::vector<short>() : r.array<short>(n_samples);
    const auto samples = float_path ? r.array<float>(n_samples) : std::vector<float>();
    const int n = (int)n_files;

    std::vector<float> mel_db((size_t)n_files * g.row_len);
    if (f64)
        spectra<double>(g, n, float_path, pcm, samples, window_f64, mel_start, mel_offset,
                        mel_weights, mel_db, frame_pcm16_f64, frame_f32_f64, power_mel_db_f64);
    else
        spectra<float>(g, n, float_path, pcm, samples, window, mel_start, mel_offset,
                       mel_weights, mel_db, frame_pcm16_f32, frame_f32_f32, power_mel_db_f32);
    std::vector<unsigned short> rows((size_t)n_files * g.row_len);
    launch_with_barriers(2, FINALIZE_THREADS,
                         [&] { finalize_rows(g, mel_db.data(), rows.data(), n); });

    FILE* o = fopen(argv[2], "wb");
    if (!o) { perror(argv[2]); return 1; }
    fwrite(rows.data(), sizeof(unsigned short), rows.size(), o);
    fclose(o);
    return 0;
}
"#;

/// What the harness needs from the host compiler: C++20's std::barrier and _Float16 (GCC 12+,
/// Clang 15+).
const COMPILER_PROBE: &str = r#"
#include <barrier>
int main() { std::barrier<> b(1); b.arrive_and_wait(); _Float16 h = (_Float16)1.0f; return (int)h - 1; }
"#;

fn gxx(args: &[&std::ffi::OsStr]) -> std::io::Result<std::process::Output> {
    Command::new("g++")
        .args(["-std=c++20", "-O2", "-pthread"])
        .args(args)
        .output()
}

/// Build the harness; None (with the reason printed) when the host has no suitable C++
/// compiler. Once the compiler is known to be suitable, the kernel source must compile.
fn build_harness(dir: &Path) -> Option<PathBuf> {
    let probe = dir.join("probe.cpp");
    std::fs::write(&probe, COMPILER_PROBE).unwrap();
    let probe_exe = dir.join("probe");
    match gxx(&[probe.as_os_str(), "-o".as_ref(), probe_exe.as_os_str()]) {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            println!(
                "skipping: g++ lacks C++20 <barrier> or _Float16:\n{}",
                String::from_utf8_lossy(&o.stderr)
            );
            return None;
        }
        Err(e) => {
            println!("skipping: no g++ to compile the kernel source on the host ({e})");
            return None;
        }
    }
    let src = dir.join("harness.cpp");
    std::fs::write(&src, HARNESS).unwrap();
    let exe = dir.join("harness");
    let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let o = gxx(&[
        "-I".as_ref(),
        kernels.as_os_str(),
        src.as_os_str(),
        "-o".as_ref(),
        exe.as_os_str(),
    ])
    .unwrap();
    assert!(
        o.status.success(),
        "kernels/features.cu does not compile on the host:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    Some(exe)
}

/// Run the kernels on the host for `waveforms` (all int16 on the int16 path, or all on the float
/// path) and return their rows.
fn run_harness(
    exe: &Path,
    dir: &Path,
    tables: &KernelTables,
    waveforms: &[&Waveform],
    float_path: bool,
) -> Vec<f16> {
    let mut input: Vec<u8> = Vec::new();
    let push_u32 = |v: &mut Vec<u8>, x: u32| v.extend_from_slice(&x.to_le_bytes());
    push_u32(&mut input, waveforms.len() as u32);
    push_u32(&mut input, float_path as u32);
    push_u32(
        &mut input,
        (tables.precision == ailhd::features::Precision::F64) as u32,
    );
    push_u32(&mut input, std::mem::size_of_val(&tables.geometry) as u32);
    input.extend_from_slice(bytemuck::bytes_of(&tables.geometry));
    input.extend_from_slice(bytemuck::cast_slice(&tables.window));
    input.extend_from_slice(bytemuck::cast_slice(&tables.window_f64));
    input.extend_from_slice(bytemuck::cast_slice(&tables.mel_start));
    input.extend_from_slice(bytemuck::cast_slice(&tables.mel_offset));
    push_u32(&mut input, tables.mel_weights.len() as u32);
    input.extend_from_slice(bytemuck::cast_slice(&tables.mel_weights));
    for w in waveforms {
        match (w, float_path) {
            (Waveform::Pcm16(v), false) => input.extend_from_slice(bytemuck::cast_slice(v)),
            (_, true) => {
                let mut f = vec![0f32; w.len()];
                w.copy_to_f32(0, &mut f);
                input.extend_from_slice(bytemuck::cast_slice(&f));
            }
            (Waveform::Float(_), false) => panic!("float recording on the int16 path"),
        }
    }
    let (in_path, out_path) = (dir.join("in.bin"), dir.join("out.bin"));
    std::fs::write(&in_path, input).unwrap();
    let status = Command::new(exe)
        .arg(&in_path)
        .arg(&out_path)
        .status()
        .unwrap();
    assert!(status.success(), "harness failed");
    let bytes = std::fs::read(&out_path).unwrap();
    let bits: Vec<u16> = bytes
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    bits.into_iter().map(f16::from_bits).collect()
}

#[test]
fn kernel_source_on_the_host_reproduces_the_reference_fixtures() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = build_harness(dir.path()) else {
        return;
    };
    for (setup, settings) in setups() {
        let tables = KernelTables::new(&settings).unwrap();
        let row_len = settings.shape().row_len();
        let cases = valid_cases(&settings);
        assert!(
            cases.len() >= 8,
            "too few fixtures decoded ({})",
            cases.len()
        );

        let pcm: Vec<&Case> = cases
            .iter()
            .filter(|c| matches!(c.waveform, Waveform::Pcm16(_)))
            .collect();
        let pcm_waves: Vec<&Waveform> = pcm.iter().map(|c| &c.waveform).collect();
        let all_waves: Vec<&Waveform> = cases.iter().map(|c| &c.waveform).collect();
        let pcm_rows = run_harness(&exe, dir.path(), &tables, &pcm_waves, false);
        let float_rows = run_harness(&exe, dir.path(), &tables, &all_waves, true);

        // int16 is scaled exactly, so both input paths give the same bytes.
        for (i, case) in pcm.iter().enumerate() {
            let j = cases.iter().position(|c| c.name == case.name).unwrap();
            assert!(
                pcm_rows[i * row_len..(i + 1) * row_len]
                    == float_rows[j * row_len..(j + 1) * row_len],
                "{setup} {}: int16 and float paths differ",
                case.name
            );
        }
        for (j, case) in cases.iter().enumerate() {
            match case.check(setup, &float_rows[j * row_len..(j + 1) * row_len]) {
                Ok(text) => println!("{setup} {} (host-emulated kernels): {text}", case.name),
                Err(text) => panic!("{setup} {} (host-emulated kernels): {text}", case.name),
            }
        }
    }
}

/// Both contract setups have one time frame per short window, so they cannot tell the row's
/// [mel][t] order from [t][mel]. This setup has 5 frames per window, uneven hops, power 1.5 (the
/// general |X|^p branch), the Slaney scale and a top_db clamp, checked against a plain float64
/// computation of the contract's definition.
fn awkward_settings() -> FeatureSettings {
    FeatureSettings {
        duration_sec: 2.0,
        long_window: 2048,
        long_hop: 1536,
        short_window: 1024,
        short_hop: 384,
        n_fft: 256,
        hop_length: 160,
        n_mels: 40,
        power: 1.5,
        mel_scale: ailhd::config::MelScale::Slaney,
        mel_norm: ailhd::config::MelNorm::Slaney,
        db: ailhd::config::DbMode::AmplitudeToDb,
        top_db: Some(60.0),
        ..FeatureSettings::default()
    }
}

#[test]
fn kernel_source_on_the_host_follows_the_definition_with_several_frames_per_window() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = build_harness(dir.path()) else {
        return;
    };
    let settings = awkward_settings();
    let shape = settings.shape();
    assert_eq!(shape.row_dims(), [5, 3, 40, 5]);
    let tables = KernelTables::new(&settings).unwrap();
    let recordings = parity::synthetic_recordings(&settings);
    let pcm: Vec<&Waveform> = recordings
        .iter()
        .map(|(_, w)| w)
        .filter(|w| matches!(w, Waveform::Pcm16(_)))
        .collect();
    let rows = run_harness(&exe, dir.path(), &tables, &pcm, false);
    for (i, w) in pcm.iter().enumerate() {
        let row = &rows[i * shape.row_len()..(i + 1) * shape.row_len()];
        let a = check_accuracy(&ailhd::features::reference::row(w, &settings), row);
        println!("awkward setup, recording {i}: {}", parity::summary(&a));
        assert!(a.violations == 0, "recording {i}: {}", parity::summary(&a));
    }
}

// ---------------------------------------------------------------------------------------------
// Fixtures.

struct Case {
    name: String,
    waveform: Waveform,
    /// cases.json's tolerance: "f16ulp: ..." (the contract rule) or "resampled: ..." (the
    /// decoder's resampler is checked loosely; the featuriser must still follow it exactly).
    resampled: bool,
}

impl Case {
    /// Check `rows` against the reference under this case's tolerance; Err(description).
    fn check(&self, setup: &str, rows: &[f16]) -> Result<String, String> {
        let expected = self.expected(setup);
        if self.resampled {
            return check_resampled(&expected, rows);
        }
        let a = check_accuracy(&expected, rows);
        let text = parity::summary(&a);
        if a.violations == 0 {
            Ok(text)
        } else {
            Err(text)
        }
    }
}

/// cases.json, "resampled": within 0.5 dB where the reference is within 40 dB of its maximum;
/// elsewhere at least 30 dB below that maximum (no aliasing).
fn check_resampled(expected: &[f64], rows: &[f16]) -> Result<String, String> {
    let max = expected.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut worst: f64 = 0.0;
    for (i, (&e, s)) in expected.iter().zip(rows).enumerate() {
        let s = s.to_f64();
        let ok = if e >= max - 40.0 {
            worst = worst.max((s - e).abs());
            (s - e).abs() <= 0.5
        } else {
            s <= max - 30.0
        };
        if !ok {
            return Err(format!(
                "value {i} is {s:.3} dB, reference {e:.3} dB (max {max:.3})"
            ));
        }
    }
    Ok(format!(
        "resampled rule: max {worst:.3} dB within 40 dB of the maximum"
    ))
}

impl Case {
    /// Reference values (float64 computation stored as float32) for `setup`.
    fn expected(&self, setup: &str) -> Vec<f64> {
        let path = shared()
            .join("fixtures/features/expected")
            .join(setup)
            .join(format!("{}.npy", self.name));
        read_npy_f32(&path).1.into_iter().map(f64::from).collect()
    }
}

/// The valid fixtures, decoded by the project's decoder (docs/design.md, "What a row is").
fn valid_cases(settings: &FeatureSettings) -> Vec<Case> {
    let root = shared().join("fixtures/features");
    let text = std::fs::read_to_string(root.join("cases.json"))
        .unwrap_or_else(|e| panic!("{}: {e}", root.join("cases.json").display()));
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let num_samples = settings.shape().num_samples;
    json["cases"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, case)| case["kind"] == "valid")
        .map(|(name, case)| {
            let path = root.join("wav").join(format!("{name}.wav"));
            let bytes = std::fs::read(&path).unwrap();
            let waveform = ailhd::decode::decode(&bytes, settings.sample_rate, num_samples)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let tolerance = case["tolerance"].as_str().unwrap_or_default();
            Case {
                name: name.clone(),
                waveform,
                resampled: tolerance.starts_with("resampled"),
            }
        })
        .collect()
}
