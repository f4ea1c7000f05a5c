//! Helpers shared by the behaviour tests: the real binary, temporary trees, configurations,
//! the shared fixtures, and Python readers (h5py, numpy) as users run them.
#![allow(dead_code)]

pub mod faultfs;
pub mod output;
pub mod service;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output};

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_ailhd"))
}

/// `../shared` beside the repository (CI), or `$AILHD_SHARED`, or `/work/shared`.
pub fn shared() -> PathBuf {
    let candidates = [
        std::env::var_os("AILHD_SHARED").map(PathBuf::from),
        Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared")),
        Some(PathBuf::from("/work/shared")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|p| p.join("fixtures/features/cases.json").exists())
        .expect(
            "shared fixtures not found: set AILHD_SHARED to the folder holding fixtures/features",
        )
}

pub fn fixtures() -> PathBuf {
    shared().join("fixtures/features")
}

pub fn cases() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json")).unwrap()).unwrap()
}

/// A temporary world: recordings, output and state folders, and a configuration file.
pub struct World {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    out: PathBuf,
    state: PathBuf,
}

impl World {
    pub fn new(extra_toml: &str) -> World {
        World::with_paths(extra_toml, "out", "state")
    }
    /// A world whose output and state folders are `out` and `state` under its root (say, on a
    /// file system mounted there).
    pub fn with_paths(extra_toml: &str, out: &str, state: &str) -> World {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("rec")).unwrap();
        let config = root.join("ailhd.toml");
        let (out, state) = (root.join(out), root.join(state));
        let text = format!(
            "[paths]\nrecordings = {:?}\noutput = {out:?}\nstate = {state:?}\n{extra_toml}\n",
            root.join("rec"),
        );
        std::fs::write(&config, text).unwrap();
        World {
            dir,
            config,
            out,
            state,
        }
    }
    pub fn rec(&self) -> PathBuf {
        self.dir.path().join("rec")
    }
    pub fn out(&self) -> PathBuf {
        self.out.clone()
    }
    pub fn state(&self) -> PathBuf {
        self.state.clone()
    }
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin());
        c.arg("--config").arg(&self.config).args(args);
        c.env_remove("AILHD_CONFIG");
        c
    }
    /// [`World::cmd`] run by a wrapper command (`sh -c '...; exec "$@"' sh`, say), which gets
    /// the program and its arguments after its own.
    pub fn cmd_under(&self, wrapper: &[&str], args: &[&str]) -> Command {
        let inner = self.cmd(args);
        let mut c = Command::new(wrapper[0]);
        c.args(&wrapper[1..])
            .arg(inner.get_program())
            .args(inner.get_args())
            .env_remove("AILHD_CONFIG");
        c
    }
    pub fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().unwrap()
    }
    pub fn status_json(&self) -> serde_json::Value {
        let o = self.run(&["status", "--json"]);
        assert!(
            o.status.success(),
            "status failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        serde_json::from_slice(&o.stdout).unwrap()
    }
}

/// A float32 little-endian, C-order .npy: (shape, data).
pub fn read_npy_f32(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..6], b"\x93NUMPY", "{}: not a .npy", path.display());
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize,
            12,
        ),
    };
    let header = std::str::from_utf8(&bytes[start..start + header_len]).unwrap();
    assert!(header.contains("'descr': '<f4'"), "{header}");
    assert!(header.contains("'fortran_order': False"), "{header}");
    let dims = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .unwrap_or_else(|| panic!("no shape in {header}"));
    let shape: Vec<usize> = dims
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let data: Vec<f32> = bytes[start + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(
        data.len(),
        shape.iter().product::<usize>(),
        "{}",
        path.display()
    );
    (shape, data)
}

pub fn copy_fixture(name: &str, to: &Path) {
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(fixtures().join("wav").join(format!("{name}.wav")), to).unwrap();
}

/// Run a Python checker from tests/py with arguments; panics with its output on failure. The
/// package in python/ (`ailhd_reader`, not an installed copy) and tests/py come first on
/// PYTHONPATH, then whatever the caller had (e.g. where torch is installed).
pub fn python<A: AsRef<std::ffi::OsStr>>(script: &str, args: &[A]) -> String {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths = vec![repo.join("python"), repo.join("tests/py")];
    if let Some(p) = std::env::var_os("PYTHONPATH") {
        paths.extend(std::env::split_paths(&p));
    }
    let out = Command::new("python3")
        .arg(repo.join("tests/py").join(script))
        .args(args)
        .env("PYTHONPATH", std::env::join_paths(paths).unwrap())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("AILHD_CONFIG")
        .output()
        .expect("python3 is needed for the reader tests (. .ci/setup installs numpy and h5py)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script} failed:\n{text}");
    text
}

pub fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// The name libtest gives a test of this binary (`daemon::some_test`), from the `module_path!()`
/// of its module (`tests::daemon`): for a test that runs one of this binary's tests alone in a
/// child process (`current_exe() NAME --exact`).
pub fn test_name(module_path: &str, test: &str) -> String {
    let module = module_path.split_once("::").map_or("", |(_, m)| m);
    format!("{module}::{test}")
}

/// Waits up to `limit` for `child` to exit; past it, kills (and reaps) it and returns None.
pub fn exit_within(child: &mut Child, limit: std::time::Duration) -> Option<ExitStatus> {
    let t = std::time::Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
