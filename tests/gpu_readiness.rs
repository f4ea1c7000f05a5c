//! What can be checked of the GPU path without a GPU (issue 21):
//! - `kernels/*.cu` compiled by a real NVRTC (PyPI's `nvidia-cuda-nvrtc`, which `.ci/setup`
//!   installs) through the code's own [`compile`] (its option list included), for every
//!   architecture the project claims for that NVRTC and the newest it knows, as a CUBIN and as PTX:
//!   an error, any text in NVRTC's log (a warning) or a register spill (NVRTC's own ptxas, asked
//!   with `--ptxas-options=-v`) fails. Broken sources fed through the same check show it fails.
//!   Without NVRTC the tests fail where `CI` is set, and skip (saying how to install it) elsewhere.
//! - `ailhd doctor --json` finds NVRTC and cuFFT where the Python wheels put them (through
//!   `python3`, `gpu.library_path`, `$VIRTUAL_ENV`) and says where.
//! - `run`, `rebuild` and `demo` on a host without a usable GPU log one short fallback line.

use crate::common::{bin, ok, World};
use ailhd::features::cuda::{
    self, compile, supported_architectures, KernelImage, ARCHITECTURES, KERNEL_ENTRY_POINTS,
};
use std::path::{Path, PathBuf};
use std::process::Command;

const INSTALL: &str = "install it with `python3 -m pip install nvidia-cuda-nvrtc` (or source \
    .ci/setup), or set AILHD_GPU__LIBRARY_PATH to the folder holding libnvrtc.so.13";

fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

/// A check that cannot run: a failure in CI (the project's rule: only a missing GPU may skip
/// there), a printed skip elsewhere.
fn cannot_run(why: &str) {
    if in_ci() {
        panic!("{why}");
    }
    println!("skipping: {why}");
}

/// The search the tests use: everywhere, and `$AILHD_GPU__LIBRARY_PATH` first.
fn search() -> cuda::LibrarySearch {
    cuda::LibrarySearch {
        library_path: std::env::var_os("AILHD_GPU__LIBRARY_PATH")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from),
        ask_python: cuda::AskPython::Always,
    }
}

/// NVRTC loaded (for cudarc), its version; None (after `cannot_run`) where it is missing.
fn nvrtc() -> Option<String> {
    let libs = cuda::probe_libraries_with(&search());
    let nvrtc = libs.iter().find(|l| l.library == "NVRTC").unwrap();
    if nvrtc.loaded.is_none() {
        cannot_run(&format!(
            "NVRTC is needed to compile the kernels and was not found ({}); {INSTALL}",
            nvrtc.missing_reason()
        ));
        return None;
    }
    let version = cuda::nvrtc_version().expect("NVRTC answers its version");
    println!(
        "NVRTC {version}: {} ({}), builtins {:?}",
        nvrtc.path.as_deref().unwrap_or("?"),
        nvrtc.found_by.as_deref().unwrap_or("?"),
        nvrtc.builtins
    );
    Some(version)
}

/// Compile `source` for `arch` as start-up does, as a CUBIN and as PTX, and once more asking
/// ptxas for its report: every problem found, each naming the file and the target.
fn check(name: &str, source: &str, arch: i32) -> (Vec<String>, Vec<String>) {
    let mut problems = Vec::new();
    let mut usage = Vec::new();
    for target in [format!("sm_{arch}"), format!("compute_{arch}")] {
        match compile(source, name, &target, &[]) {
            Err(e) => problems.push(format!("{e:#}")),
            Ok(c) if !c.log.is_empty() => {
                problems.push(format!("{name} for {target}: NVRTC warned:\n{}", c.log))
            }
            Ok(c) => {
                if let KernelImage::Ptx(ptx) = &c.image {
                    for entry in KERNEL_ENTRY_POINTS {
                        if source.contains(entry) && !ptx.contains(&format!(".entry {entry}(")) {
                            problems.push(format!("{name} for {target}: no entry point {entry}"));
                        }
                    }
                }
            }
        }
    }
    // The CUBIN again, with ptxas' report: registers, stack, spills.
    let target = format!("sm_{arch}");
    if let Ok(c) = compile(source, name, &target, &["--ptxas-options=-v"]) {
        let mut function = String::new();
        for line in c.log.lines() {
            if let Some(f) = line.split("Function properties for ").nth(1) {
                function = f.trim().to_string();
            } else if line.contains("spill stores") {
                let bytes: Vec<u64> = line
                    .split(',')
                    .filter(|part| part.contains("spill"))
                    .filter_map(|part| part.split_whitespace().find_map(|w| w.parse().ok()))
                    .collect();
                if bytes.iter().any(|&b| b > 0) {
                    problems.push(format!(
                        "{name} for {target}: {function} spills registers: {}",
                        line.trim_start_matches("ptxas")
                            .trim_start_matches([' ', '.'])
                    ));
                }
            } else if let Some(used) = line.split("Used ").nth(1) {
                let registers = used.split(',').next().unwrap_or("").to_string();
                usage.push(format!("{function} {registers}"));
            } else if !line.starts_with("ptxas info") && !line.trim().is_empty() {
                problems.push(format!("{name} for {target}: ptxas said: {line}"));
            }
        }
    }
    (problems, usage)
}

fn kernel_sources() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut sources: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .map(|p| {
            (
                format!("kernels/{}", p.file_name().unwrap().to_string_lossy()),
                std::fs::read_to_string(&p).unwrap(),
            )
        })
        .collect();
    sources.sort();
    assert!(!sources.is_empty(), "no kernels in {}", dir.display());
    sources
}

/// The architectures to compile for with this NVRTC: those claimed for its major version (each
/// must be supported) and the newest it knows.
fn targets(version: &str) -> Vec<i32> {
    let major: u32 = version.split('.').next().unwrap().parse().unwrap();
    let supported = supported_architectures().expect("NVRTC lists its architectures");
    println!("NVRTC {version} compiles for {supported:?}");
    let mut archs = Vec::new();
    for (arch, majors) in ARCHITECTURES {
        if majors.contains(&major) {
            assert!(
                supported.contains(&arch),
                "sm_{arch} is claimed for NVRTC {major} (features::cuda::ARCHITECTURES), but NVRTC {version} does not support it (it knows {supported:?})"
            );
            archs.push(arch);
        } else {
            println!(
                "sm_{arch}: claimed for NVRTC {}-{} only, not checked with NVRTC {version}{}",
                majors.start(),
                majors.end(),
                if supported.contains(&arch) {
                    ""
                } else {
                    " (which does not support it)"
                }
            );
        }
    }
    let newest = *supported.iter().max().expect("at least one architecture");
    if !archs.contains(&newest) {
        archs.push(newest);
    }
    archs
}

/// Run `check` for each architecture on a few threads (NVRTC compiles programs concurrently).
fn check_all(name: &str, source: &str, archs: &[i32]) -> Vec<String> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(archs.len()));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Some(&arch) = archs.get(i) else { break };
                let found = check(name, source, arch);
                results.lock().unwrap().push((arch, found));
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(arch, _)| *arch);
    let mut problems = Vec::new();
    for (arch, (p, usage)) in results {
        println!("{name} sm_{arch}: {}", usage.join(", "));
        problems.extend(p);
    }
    problems
}

#[test]
fn kernels_compile_with_nvrtc_for_every_claimed_architecture() {
    let Some(version) = nvrtc() else { return };
    let archs = targets(&version);
    let mut problems = Vec::new();
    for (name, source) in kernel_sources() {
        problems.extend(check_all(&name, &source, &archs));
    }
    assert!(
        problems.is_empty(),
        "with NVRTC {version}:\n{}",
        problems.join("\n")
    );
}

/// The check above fails on a kernel that does not compile, one NVRTC warns about, and one that
/// spills registers: each fed through the same path, with the message naming the problem.
#[test]
fn the_nvrtc_check_fails_on_an_error_a_warning_and_a_spill() {
    let Some(_) = nvrtc() else { return };
    let source = cuda::KERNEL_SOURCE;
    let cases = [
        (
            "extern \"C\" __global__ void broken(float* o) { o[0] = undeclared_thing; }",
            ["NVRTC could not compile kernels/broken.cu for sm_90", "identifier \"undeclared_thing\" is undefined"],
        ),
        (
            "extern \"C\" __global__ void warns(float* o) { int unused_here; o[0] = 1.0f; }",
            ["kernels/broken.cu for sm_90: NVRTC warned", "\"unused_here\" was declared but never referenced"],
        ),
        (
            // 96 values live at once in at most 32 registers (1024 threads, 2 blocks per SM).
            "extern \"C\" __global__ void __launch_bounds__(1024, 2) spills(float* o, const float* in) {\n\
               float v[96];\n\
               #pragma unroll\n\
               for (int i = 0; i < 96; i++) v[i] = in[threadIdx.x + i * 1024];\n\
               float s = 0.0f;\n\
               #pragma unroll\n\
               for (int i = 0; i < 96; i++) s += v[i] * v[(i * 7) % 96];\n\
               #pragma unroll\n\
               for (int i = 0; i < 96; i++) o[threadIdx.x + i * 1024] = v[i] * s;\n\
             }",
            ["kernels/broken.cu for sm_90: spills spills registers", "bytes spill stores"],
        ),
    ];
    for (addition, expected) in cases {
        let broken = format!("{source}\n{addition}\n");
        let problems = check_all("kernels/broken.cu", &broken, &[90]);
        let text = problems.join("\n");
        for e in expected {
            assert!(text.contains(e), "expected {e:?} among:\n{text}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// doctor finds the wheels' libraries.

fn doctor(env: &[(&str, &str)], path: Option<&str>) -> serde_json::Value {
    let mut cmd = Command::new(bin());
    cmd.args(["doctor", "--json"])
        .env_remove("AILHD_CONFIG")
        .env_remove("AILHD_GPU__LIBRARY_PATH")
        .env_remove("VIRTUAL_ENV")
        .env_remove("CONDA_PREFIX");
    for (k, v) in env {
        cmd.env(k, v);
    }
    if let Some(p) = path {
        cmd.env("PATH", p);
    }
    serde_json::from_str(&ok(&cmd.output().unwrap())).unwrap()
}

fn library<'a>(report: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    report["cuda"]["libraries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["library"] == name)
        .unwrap()
}

#[test]
fn doctor_finds_nvrtc_and_cufft_where_the_python_wheels_put_them() {
    // Where pip put them (`.ci/setup` installs nvidia-cuda-nvrtc and nvidia-cufft).
    let report = doctor(&[], None);
    let (nvrtc, cufft) = (library(&report, "NVRTC"), library(&report, "cuFFT"));
    let in_wheel = |l: &serde_json::Value| {
        l["path"]
            .as_str()
            .is_some_and(|p| p.contains("site-packages/nvidia/"))
    };
    if !(in_wheel(nvrtc) && in_wheel(cufft)) {
        if nvrtc["found_by"] == "the dynamic loader" && cufft["found_by"] == "the dynamic loader" {
            println!("skipping: system CUDA found first ({nvrtc} {cufft})");
            return;
        }
        cannot_run(&format!(
            "doctor did not find NVRTC and cuFFT in Python's site-packages (NVRTC: {nvrtc}; cuFFT: {cufft}); install them with `python3 -m pip install nvidia-cuda-nvrtc nvidia-cufft` (or source .ci/setup)"
        ));
        return;
    }
    for l in [nvrtc, cufft] {
        assert!(
            l["found_by"]
                .as_str()
                .unwrap()
                .starts_with("Python site-packages ("),
            "{l}"
        );
    }
    assert_eq!(nvrtc["loaded"], "libnvrtc.so.13", "{nvrtc}");
    assert_eq!(cufft["loaded"], "libcufft.so.12", "{cufft}");
    assert!(report["cuda"]["nvrtc_version"]
        .as_str()
        .unwrap()
        .starts_with("13."));
    assert!(report["cuda"]["cufft_version"].is_string(), "{report}");
    let builtins = nvrtc["builtins"]
        .as_str()
        .expect("builtins found beside NVRTC");
    assert!(builtins.contains("libnvrtc-builtins.so.13."), "{builtins}");
    let nvrtc_dir = Path::new(nvrtc["path"].as_str().unwrap()).parent().unwrap();
    let cufft_dir = Path::new(cufft["path"].as_str().unwrap()).parent().unwrap();
    let site = nvrtc_dir.ancestors().nth(3).unwrap();
    assert!(site.ends_with("site-packages"), "{}", site.display());

    // gpu.library_path (from the environment, as every key), with no python3 to ask.
    let empty = tempfile::tempdir().unwrap();
    let no_python = empty.path().to_str().unwrap();
    let report = doctor(
        &[("AILHD_GPU__LIBRARY_PATH", nvrtc_dir.to_str().unwrap())],
        Some(no_python),
    );
    let l = library(&report, "NVRTC");
    assert_eq!(l["found_by"], "gpu.library_path", "{l}");
    assert_eq!(
        l["path"],
        nvrtc_dir.join("libnvrtc.so.13").to_str().unwrap()
    );

    // A virtual environment's layout, found from $VIRTUAL_ENV alone (no python3 either).
    let venv = tempfile::tempdir().unwrap();
    for (dir, files) in [(nvrtc_dir, "libnvrtc"), (cufft_dir, "libcufft.so")] {
        let to = venv
            .path()
            .join("lib/python3.99/site-packages/nvidia")
            .join(dir.parent().unwrap().file_name().unwrap())
            .join("lib");
        std::fs::create_dir_all(&to).unwrap();
        for f in std::fs::read_dir(dir).unwrap().flatten() {
            if f.file_name().to_string_lossy().starts_with(files)
                && !to.join(f.file_name()).exists()
            {
                std::os::unix::fs::symlink(f.path(), to.join(f.file_name())).unwrap();
            }
        }
    }
    let report = doctor(
        &[
            ("VIRTUAL_ENV", venv.path().to_str().unwrap()),
            ("HOME", no_python),
        ],
        Some(no_python),
    );
    for name in ["NVRTC", "cuFFT"] {
        let l = library(&report, name);
        assert_eq!(l["found_by"], "Python site-packages (VIRTUAL_ENV)", "{l}");
        assert!(
            l["path"]
                .as_str()
                .unwrap()
                .starts_with(venv.path().to_str().unwrap()),
            "{l}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// One line when the GPU cannot be used.

/// The fallback lines in a log: exactly one, short, naming the first reason.
fn one_fallback_line(command: &str, log: &str) {
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("GPU")).collect();
    let probe = cuda::probe();
    if probe.gpu_present() && probe.problems.is_empty() {
        println!("{command}: a GPU is usable here; no fallback line to check");
        return;
    }
    assert_eq!(
        lines.len(),
        1,
        "{command}: one line about the GPU, got:\n{log}"
    );
    let line = lines[0];
    let message = &line[line.find("no usable GPU (").expect(line)..];
    assert!(
        message.chars().count() <= cuda::FALLBACK_LINE_MAX,
        "{command}: {} characters: {message}",
        message.chars().count()
    );
    assert!(
        message.ends_with("); featurising on the CPU \u{2014} see ailhd doctor"),
        "{command}: {message}"
    );
    let driver_missing = probe
        .libraries
        .iter()
        .any(|l| l.library == "CUDA driver" && l.loaded.is_none());
    if driver_missing {
        assert!(
            message.starts_with("no usable GPU (CUDA driver not found (libcuda.so.1))"),
            "{command}: {message}"
        );
    }
    println!("{command}: {line}");
}

#[test]
fn without_a_usable_gpu_run_rebuild_and_demo_say_so_in_one_short_line() {
    let world = World::new("[ingest]\ndevice = \"auto\"\n");
    crate::common::copy_fixture(
        "leak_pcm16",
        &world.rec().join("LEAK/s1~r1~20240101000000~0.wav"),
    );
    let o = world.run(&["rebuild", "--device", "auto"]);
    ok(&o);
    one_fallback_line("rebuild", &String::from_utf8_lossy(&o.stderr));

    let demo = tempfile::tempdir().unwrap();
    let o = Command::new(bin())
        .env_remove("AILHD_CONFIG")
        .args(["demo", demo.path().join("d").to_str().unwrap()])
        .output()
        .unwrap();
    ok(&o);
    one_fallback_line("demo", &String::from_utf8_lossy(&o.stderr));

    let service = crate::common::service::Service::start(&world);
    let log = service.terminate();
    one_fallback_line("run", &log);
}
