//! `ailhd reload` (the unit's ExecReload): send SIGHUP to the running service and wait for its
//! answer, so that `systemctl reload ailhd` fails when the new configuration is refused.
//!
//! The service answers in `<paths.state>/reload.json` (written atomically): a generation that
//! grows by one with every SIGHUP it handles, its pid, and whether the configuration was
//! accepted, with the reason when it was not.

use crate::config::Settings;
use crate::lock::WriterLock;
use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReloadResult {
    pub generation: u64,
    pub pid: u32,
    pub accepted: bool,
    pub message: String,
    pub at_ms: i64,
}

pub fn result_path(settings: &Settings) -> PathBuf {
    settings.paths.state.join("reload.json")
}

pub fn read(settings: &Settings) -> Option<ReloadResult> {
    let text = std::fs::read_to_string(result_path(settings)).ok()?;
    serde_json::from_str(&text).ok()
}

/// The service's side: record how a SIGHUP was handled (and count it in the metrics).
pub fn record(settings: &Settings, accepted: bool, message: &str) {
    crate::metrics::reload(accepted);
    let r = ReloadResult {
        generation: read(settings).map_or(0, |r| r.generation) + 1,
        pid: std::process::id(),
        accepted,
        message: message.to_string(),
        at_ms: crate::engine::manifest::now_ms(),
    };
    let path = result_path(settings);
    // Atomic for the waiting client, not synced: a reply read within seconds, of no use after
    // a power cut.
    let written = serde_json::to_vec(&r)
        .map_err(std::io::Error::other)
        .and_then(|b| crate::durable::replace(&path, &b, crate::durable::Sync::None));
    if let Err(e) = written {
        log::warn!("cannot write the reload result {}: {e}", path.display());
    }
}

/// How a reload request ended.
pub enum Outcome {
    Accepted(ReloadResult),
    Refused(ReloadResult),
}

/// The client's side: find the service (the holder of the state lock, which must be `run`;
/// `expected_pid` is systemd's $MAINPID when given), signal it, wait for its answer.
pub fn request(
    settings: &Settings,
    expected_pid: Option<u32>,
    timeout: Duration,
) -> anyhow::Result<Outcome> {
    let state = &settings.paths.state;
    // A service waiting before it takes the folders (`service::wait_for_paths`, `wait_for_gpu`)
    // answers too: it reads the configuration again.
    let held = WriterLock::holder_info(state)
        .or_else(|| crate::waiting::Waiting::read(settings).map(|w| (w.pid, "run".to_string())));
    let Some((pid, role)) = held else {
        bail!(
            "no running `ailhd run` holds {} (paths.state): nothing to reload",
            state.display()
        );
    };
    if role != "run" {
        bail!(
            "{} is held by pid {pid} (ailhd {role}), not by the service",
            state.display()
        );
    }
    if let Some(want) = expected_pid {
        if want != pid {
            bail!(
                "the service (pid {want}) does not hold {} (paths.state), pid {pid} does: was paths.state changed? That needs a restart (systemctl restart ailhd)",
                state.display()
            );
        }
    }
    let before = read(settings).map_or(0, |r| r.generation);
    // SAFETY: kill(2) with a pid and a signal number; no memory is involved.
    if unsafe { libc::kill(pid as libc::pid_t, libc::SIGHUP) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("cannot send SIGHUP to pid {pid}"));
    }
    let t = Instant::now();
    loop {
        if let Some(r) = read(settings) {
            if r.generation > before && r.pid == pid {
                return Ok(if r.accepted {
                    Outcome::Accepted(r)
                } else {
                    Outcome::Refused(r)
                });
            }
        }
        if t.elapsed() > timeout {
            bail!(
                "pid {pid} did not answer the reload within {} s (see its log)",
                timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
