//! A bulk batch is larger than the descriptors a process may have open (the CPU's batch is 256,
//! a GPU's 1024, the usual soft limit 1024): `rebuild` must not open a whole batch at once, or
//! every file past the limit would be quarantined as unreadable ("Too many open files").
//!
//! It lowers its process's descriptor limit, so it runs alone in a child process (this test
//! binary again, with `CHILD_ENV` set, running this test only): the other tests of the binary
//! run on threads of the parent and would meet the lowered limit.

use ailhd::config::{DeviceChoice, Settings};
use ailhd::rebuild::{rebuild, Ui};
use std::process::Command;

const CHILD_ENV: &str = "AILHD_TEST_DESCRIPTORS_CHILD";

fn open_descriptors() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

#[test]
fn a_batch_larger_than_the_descriptor_limit_is_rebuilt_whole() {
    if std::env::var_os(CHILD_ENV).is_none() {
        let name = crate::common::test_name(
            module_path!(),
            "a_batch_larger_than_the_descriptor_limit_is_rebuilt_whole",
        );
        let out = Command::new(std::env::current_exe().unwrap())
            .args([&name, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{name} in a child process: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            out.status
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = Settings::in_folder(dir.path());
    // 3 labels x 100 clips: one CPU batch of 256 and the rest.
    ailhd::synth::write_tree(&s.paths.recordings, &["LEAK", "NORMAL", "CRACK"], 100, 7).unwrap();

    // Room for the outputs, the manifest and the threads, not for a whole batch of files.
    let limit = open_descriptors() + 200;
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on this process with valid pointers.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut old), 0);
        let lowered = libc::rlimit {
            rlim_cur: limit.min(old.rlim_cur),
            rlim_max: old.rlim_max,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lowered), 0);
    }
    let report = rebuild(&s, DeviceChoice::Cpu, &Ui { progress: false });
    // SAFETY: as above.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &old) };
    let report = report.unwrap();
    assert!(report.quarantined.is_empty(), "{:?}", report.quarantined);
    assert_eq!(report.rows.iter().sum::<u64>(), 300);
}
