//! A bulk batch is larger than the descriptors a process may have open (the CPU's batch is 256,
//! a GPU's 1024, the usual soft limit 1024): `rebuild` must not open a whole batch at once, or
//! every file past the limit would be quarantined as unreadable ("Too many open files").
//!
//! Alone in its test binary: it lowers this process's descriptor limit.

use ailhd::config::{DeviceChoice, Settings};
use ailhd::rebuild::{rebuild, Ui};

fn open_descriptors() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

#[test]
fn a_batch_larger_than_the_descriptor_limit_is_rebuilt_whole() {
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
