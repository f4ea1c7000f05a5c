//! A service that waits before it starts, for something that may pass (folders that cannot be
//! used yet, a GPU that cannot be used yet: `service::wait_for_paths`, `service::wait_for_gpu`),
//! tells `ailhd status` so in a note: `<paths.state>/waiting.json` and a copy in the runtime
//! folder (where the status snapshot's second copy goes: it stays writable when the state
//! folder cannot be used, which may be what the service waits for). Both written best effort,
//! removed when the wait ends; a note whose process is gone is not read.

use crate::config::Settings;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// What the waiting service says (docs/json.md, `status --json`'s `waiting`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Waiting {
    pub pid: u32,
    /// When the wait began, Unix milliseconds (kept across the fresh images the GPU's wait
    /// starts under the same pid).
    pub since_ms: i64,
    pub reason: String,
}

fn paths(settings: &Settings) -> [PathBuf; 2] {
    [
        settings.paths.state.join("waiting.json"),
        crate::status::runtime_path(settings, "waiting"),
    ]
}

impl Waiting {
    /// Note that this process waits for `reason` (since it began waiting, if it already was).
    pub fn record(settings: &Settings, reason: &str) {
        let pid = std::process::id();
        let since_ms = Waiting::read(settings)
            .filter(|w| w.pid == pid)
            .map_or_else(crate::engine::manifest::now_ms, |w| w.since_ms);
        let note = Waiting {
            pid,
            since_ms,
            reason: reason.to_string(),
        };
        let json = serde_json::to_vec(&note).expect("a plain struct serialises");
        for path in paths(settings) {
            // Not synced: of no use after a power cut, which ends the wait too. The folders are
            // made as the service would make them (the state folder may not be there yet).
            let _ = path
                .parent()
                .map(std::fs::create_dir_all)
                .transpose()
                .and_then(|_| crate::durable::replace(&path, &json, crate::durable::Sync::None));
        }
    }

    /// The wait is over (the service goes on, or stops).
    pub fn clear(settings: &Settings) {
        for path in paths(settings) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// The note of a service waiting now: its process is there, and runs `ailhd` (its first
    /// argument names it).
    pub fn read(settings: &Settings) -> Option<Waiting> {
        paths(settings).iter().find_map(|path| {
            let note: Waiting = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
            let cmdline = std::fs::read(format!("/proc/{}/cmdline", note.pid)).ok()?;
            let program = cmdline.split(|&b| b == 0).next()?;
            let name = program.rsplit(|&b| b == b'/').next()?;
            name.starts_with(b"ailhd").then_some(note)
        })
    }

    /// `the service (pid N) has been waiting for 12 s: <reason>`
    pub fn describe(&self) -> String {
        let waited_ms = (crate::engine::manifest::now_ms() - self.since_ms).max(0);
        format!(
            "the service (pid {}) has been waiting for {:.0} s: {}",
            self.pid,
            waited_ms as f64 / 1e3,
            self.reason
        )
    }
}
