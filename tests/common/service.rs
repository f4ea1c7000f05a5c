//! `ailhd run` started as systemd starts it, on a [`World`], with its log in a file and its
//! status snapshot (`<state>/status.json`) as the way to wait for what it has done.

use super::World;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

pub struct Service {
    pub child: Child,
    pub log: PathBuf,
    state: PathBuf,
}

impl Service {
    /// Start `run` and wait until it is up: its first status snapshot (written after the
    /// start-up rescan) is there.
    pub fn start(world: &World) -> Service {
        let s = Service::spawn(world);
        s.wait("service up", |st| st["service"].is_object());
        s
    }

    /// Start `run` without waiting for anything.
    pub fn spawn(world: &World) -> Service {
        // A snapshot left by an earlier (killed) run must not pass for this one's.
        let _ = std::fs::remove_file(world.state().join("status.json"));
        let n = std::fs::read_dir(world.dir.path()).unwrap().count();
        let log = world.dir.path().join(format!("run-{n}.log"));
        let child = world
            .cmd(&["--verbose", "run"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Service {
            child,
            log,
            state: world.state(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The latest status snapshot, if one can be read.
    pub fn snapshot(&self) -> Option<serde_json::Value> {
        std::fs::read_to_string(self.state.join("status.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    }

    /// Wait (60 s at most, then fail with the log) until the status snapshot satisfies `f`.
    pub fn wait(
        &self,
        what: &str,
        mut f: impl FnMut(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let mut last = None;
        self.wait_for(what, || {
            last = self.snapshot().filter(|s| f(s));
            last.is_some()
        });
        last.expect("waited for")
    }

    /// Wait (60 s at most, then fail with the log) until `f` holds.
    pub fn wait_for(&self, what: &str, mut f: impl FnMut() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "timed out waiting for {what}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM, as `systemctl stop`: it must exit 0. Returns the log.
    pub fn terminate(mut self) -> String {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().unwrap();
        let log = self.log();
        assert!(status.success(), "run exited with {status:?}; log:\n{log}");
        log
    }

    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        // A failed test must not leave a service running.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
