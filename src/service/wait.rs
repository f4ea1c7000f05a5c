//! What `ailhd run` waits out before the service starts, for reasons that may pass: folders that
//! cannot be used yet (a disk mounted late, a file system read-only after errors) and, with
//! `ingest.device = "cuda"`, a GPU that cannot be used yet (a driver installed or loaded later).
//! Either is said once in the log, to systemd (ready, with the reason as its status line, and
//! the watchdog fed) and to `ailhd status` ([`Waiting`]), and looked at again until it passes;
//! the service then starts without a restart. A stop signal meanwhile ends the process (exit 0).
//! A SIGHUP (`ailhd reload`) reads the configuration file again: one that loads is answered as
//! accepted and the program starts afresh with it under the same pid (a changed folder or
//! device may be what was missing); one that does not is refused, and the wait goes on with
//! the configuration in force. Both run with the service's signals held
//! ([`super::hold_signals`]).

use super::{answered_set, ANSWERED};
use crate::config::{DeviceChoice, Settings};
use crate::waiting::Waiting;
use sd_notify::NotifyState;
use std::path::Path;
use std::time::{Duration, Instant};

/// [`wait_for_paths`], then [`wait_for_gpu`]: true once the service can start, with no note of
/// a wait left behind (the fresh image a reload starts may find at once what its predecessor
/// waited for, under other folders even); false when a stop came meanwhile.
pub fn wait_until_startable(settings: &Settings, config: Option<&Path>) -> anyhow::Result<bool> {
    if !wait_for_paths(settings, config)? || !wait_for_gpu(settings, config)? {
        return Ok(false);
    }
    Waiting::clear(settings);
    Ok(true)
}

/// How often [`wait_for_paths`] checks the folders again.
const PATHS_RECHECK: Duration = Duration::from_secs(5);

/// How often [`wait_for_gpu`] looks for a usable GPU again.
const GPU_RECHECK: Duration = Duration::from_secs(10);

/// Set in the environment of the fresh image [`wait_for_gpu`] starts to look again: why the
/// image before it waited, so that a wait is logged once, not at every look.
const GPU_WAIT_ENV: &str = "AILHD_WAITING_FOR_GPU";

/// `run`'s check of its folders ([`Settings::check_paths_for_run`]), waiting while one cannot
/// be used for a reason that may pass (a file system read-only after disk errors, an I/O
/// error), checked again every [`PATHS_RECHECK`], and gone on from as soon as the folders can
/// be used, without a restart. A configuration error is returned (exit 2). Returns false when a
/// SIGTERM or SIGINT came meanwhile: the service stops there (exit 0). `config` is the
/// configuration file given on the command line (read again at a SIGHUP).
pub fn wait_for_paths(settings: &Settings, config: Option<&Path>) -> anyhow::Result<bool> {
    use crate::config::PathsError;
    let mut waiting = false;
    loop {
        let why = match settings.check_paths_for_run() {
            Ok(()) => {
                if waiting {
                    log::warn!("the folders can be used now: starting");
                }
                return Ok(true);
            }
            Err(PathsError::Unavailable(why)) => why,
            Err(e) => return Err(e.into()),
        };
        if !waiting {
            log::warn!(
                "{why}: waiting for it (checked again every {} s)",
                PATHS_RECHECK.as_secs()
            );
            announce(settings, &why.to_string());
            waiting = true;
        }
        match pause(settings, config, PATHS_RECHECK, "the folders") {
            Pause::Elapsed => {}
            Pause::Stop => return Ok(false),
            Pause::Reread => start_again("to read the configuration again")?,
        }
    }
}

/// With `ingest.device = "cuda"`, wait while featurising on a GPU is not possible here (no
/// driver, a missing library, no GPU listed: [`crate::features::cuda::probe_with`]'s problems),
/// which may pass: a driver installed or loaded after the service started. Every
/// [`GPU_RECHECK`] this program starts afresh under the same pid (systemd sees no restart) and
/// looks again, with the configuration as it is then (an operator who sets `device = "auto"`
/// is heard): a process that looked once may not see a driver loaded since (the CUDA
/// libraries, once loaded or found missing, and `cuInit`'s answer may stay as they were for
/// the life of a process). Returns false when a SIGTERM or SIGINT came meanwhile (exit 0).
pub fn wait_for_gpu(settings: &Settings, config: Option<&Path>) -> anyhow::Result<bool> {
    let before = std::env::var(GPU_WAIT_ENV).ok();
    // Not passed on to a later restart in place of the running service.
    std::env::remove_var(GPU_WAIT_ENV);
    let cuda = settings.ingest.device == DeviceChoice::Cuda;
    let problems = match cuda {
        true => {
            let search = crate::features::cuda::LibrarySearch::for_featuriser(&settings.gpu);
            crate::features::cuda::probe_with(&search).problems
        }
        false => Vec::new(),
    };
    if problems.is_empty() {
        if before.is_some() {
            match cuda {
                true => log::warn!("a GPU can be used now: starting"),
                false => log::warn!("ingest.device is no longer cuda: starting"),
            }
        }
        return Ok(true);
    }
    let why = format!(
        "ingest.device = cuda, but featurising on a GPU is not possible here now: {}",
        problems.join("; ")
    );
    if before.as_deref() == Some(why.as_str()) {
        log::debug!("{why}: still waiting");
    } else {
        log::warn!(
            "{why}: waiting for it (looked for again every {} s, with the configuration read \
             again; `ailhd doctor` says more, and ingest.device = \"auto\" would use the CPU \
             meanwhile)",
            GPU_RECHECK.as_secs()
        );
    }
    announce(settings, &why);
    let mut unreadable = None;
    loop {
        match pause(settings, config, GPU_RECHECK, "a GPU") {
            Pause::Stop => return Ok(false),
            Pause::Reread => {}
            Pause::Elapsed => {
                // The fresh image reads the configuration: one that cannot be read now (an
                // edit under way) would end the service (exit 2), so it is looked at first.
                if let Err(e) = Settings::load(config) {
                    let e = format!("{e:#}");
                    if unreadable.as_ref() != Some(&e) {
                        log::warn!("the configuration cannot be read now ({e}): looking for a GPU again once it can");
                    }
                    unreadable = Some(e);
                    continue;
                }
            }
        }
        std::env::set_var(GPU_WAIT_ENV, &why);
        start_again("to look for a GPU again")?;
    }
}

/// Say that the service waits, and why: to systemd (ready, so that `systemctl start` returns,
/// with the reason as the status line) and to `ailhd status` ([`Waiting`]); and show that the
/// held signals are answered.
fn announce(settings: &Settings, why: &str) {
    let status = format!("waiting: {why}");
    let _ = sd_notify::notify(&[NotifyState::Ready, NotifyState::Status(&status)]);
    Waiting::record(settings, why);
    catch_held_signals();
}

/// How a [`pause`] ended.
enum Pause {
    /// Its time went by.
    Elapsed,
    /// A SIGTERM or SIGINT: the service stops (its note removed).
    Stop,
    /// A SIGHUP, and the configuration file loads: answered as accepted.
    Reread,
}

/// Wait `limit` (feeding the watchdog) for a held signal. A SIGHUP reads the configuration
/// again and answers `ailhd reload` ([`crate::reload::record`]): accepted when it loads (it is
/// then the fresh image's), refused otherwise (the wait goes on).
fn pause(settings: &Settings, config: Option<&Path>, limit: Duration, what: &str) -> Pause {
    let deadline = Instant::now() + limit;
    loop {
        let _ = sd_notify::notify(&[NotifyState::Watchdog]);
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Pause::Elapsed;
        }
        match held_signal_within(left.min(PATHS_RECHECK)) {
            None => {}
            Some(libc::SIGHUP) => match Settings::load(config) {
                Ok(_) => {
                    log::info!("SIGHUP while waiting for {what}: starting again with the configuration as it is now");
                    crate::reload::record(
                        settings,
                        true,
                        &format!("read again while waiting for {what}: the service starts with it"),
                    );
                    // The new configuration may name another state folder: the fresh image
                    // notes its own wait, if it waits.
                    Waiting::clear(settings);
                    return Pause::Reread;
                }
                Err(e) => {
                    log::warn!("SIGHUP while waiting for {what}: the new configuration is refused, the one in force stays: {e:#}");
                    crate::reload::record(settings, false, &format!("{e:#}"));
                }
            },
            Some(_) => {
                log::info!("stopping while waiting for {what}");
                Waiting::clear(settings);
                return Pause::Stop;
            }
        }
    }
}

/// Replace this process with a fresh start of this program (same pid, arguments and
/// environment; the held signals stay held, and one pending stays pending). Returns only on
/// failure, as an error.
fn start_again(why: &str) -> anyhow::Result<()> {
    let e = super::worker::exec_self();
    anyhow::bail!("cannot start this program again {why}: {e}")
}

/// A handler that does nothing for each held signal ([`ANSWERED`]): they stay held and are taken
/// by [`held_signal_within`] (or, once the service runs, by its own handlers, which replace
/// these), but the process shows that it answers them (`SigCgt`), which `sigtimedwait` alone
/// does not while it waits.
fn catch_held_signals() {
    extern "C" fn nothing(_: libc::c_int) {}
    for s in ANSWERED {
        // SAFETY: a handler that touches nothing, for signals this thread holds.
        unsafe { libc::signal(s, nothing as *const () as libc::sighandler_t) };
    }
}

/// The first of the held signals ([`ANSWERED`]) that comes within `limit`, taken.
fn held_signal_within(limit: Duration) -> Option<libc::c_int> {
    let set = answered_set();
    let timeout = libc::timespec {
        tv_sec: limit.as_secs() as libc::time_t,
        tv_nsec: limit.subsec_nanos() as libc::c_long,
    };
    // SAFETY: an initialised signal set and timeout; the signals are blocked in this thread
    // (hold_signals), as sigtimedwait requires.
    let sig = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &timeout) };
    (sig > 0).then_some(sig)
}
