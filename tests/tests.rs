//! The integration tests: one test binary (`cargo test --test tests`), a module per area, so
//! that the static HDF5 and the rest are linked once and not once per file. A test is named by
//! its module: `cargo test --test tests daemon::` runs the daemon tests, `cargo test --test tests
//! gpu_parity::` the GPU parity tests.
//!
//! Cargo.toml sets `autotests = false` and names this file as the only test target: a new
//! `tests/<area>.rs` is added here as `mod <area>;` (`every_test_file_is_a_module` checks it).
//!
//! All the modules run on threads of one process. The tests that need the machine to themselves
//! (they time the service, mount file systems, or start many processes) are `#[serial]`
//! (serial_test): no two of them run at once, while the others run beside them. Nothing here may
//! change the process's own state (environment variables, current folder, limits): a test that
//! needs that runs itself in a child process (see `descriptors`).

mod common;

mod cli;
mod daemon;
mod decode_fixtures;
mod descriptors;
mod faults;
mod features_fixtures;
mod gpu_parity;
mod gpu_readiness;
mod large_files;
mod merge;
mod operations;
mod output_hdf5;
mod output_npy;
mod package;
mod pictures;
mod poison;
mod power_loss;
mod reader;
mod rebuild_fixtures;
mod watch;
mod writers;

/// Every `tests/*.rs` is a module of this binary: with `autotests = false`, a file left out
/// here would not be built or run at all.
#[test]
fn every_test_file_is_a_module() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let this = std::fs::read_to_string(dir.join("tests.rs")).unwrap();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        let is_module = path.extension().is_some_and(|e| e == "rs")
            || (path.is_dir() && path.join("mod.rs").exists());
        if is_module && stem != "tests" && !this.contains(&format!("\nmod {stem};\n")) {
            missing.push(path);
        }
    }
    assert!(
        missing.is_empty(),
        "not declared in tests/tests.rs (add `mod NAME;`): {missing:?}"
    );
}
