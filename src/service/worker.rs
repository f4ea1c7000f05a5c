//! The ingest worker: a thread that drives the [`Engine`]. It gathers what the event loop hands
//! it into micro-batches by the rules of [`super::batch`], closes the outputs when idle (plain
//! readers open them then), and rides out failures to write: it says so, backs off, probes the
//! disk, reopens, and compares the tree with the manifest again, which finds whatever was
//! dropped meanwhile.

use super::batch::{Batcher, Load, Next, Policy};
use super::shared::{Report, Shared, Work};
use crate::config::Settings;
use crate::engine::manifest::now_ms;
use crate::engine::{Done, Engine, Input};
use crate::status::{self, ServiceStatus};
use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// A failure to write (disk full, I/O error, the featuriser failing) the worker is riding out.
pub(super) struct Fault {
    pub(super) since_ms: i64,
    pub(super) error: String,
    /// The next attempt to reopen the outputs.
    pub(super) retry_at: Instant,
    /// Writing failed (not the featuriser): the disk is probed every second ([`disk_answers`]),
    /// and the next attempt comes as soon as a probe that failed succeeds again, not only at
    /// `retry_at` (which grows to 30 s while attempts fail).
    pub(super) disk: bool,
    /// A probe failed since the last attempt.
    pub(super) probe_failed: bool,
}

/// Replace this process with a fresh image of itself (same PID, arguments and environment):
/// how the service reopens its HDF5 files after a failed write (see
/// [`crate::output::hdf5::failed_in_this_process`]). What was not committed is lost as in a
/// kill, and found again by the start's comparison of the tree with the manifest; descriptors
/// (the writer locks among them) close on exec. Returns only if the exec fails.
/// Not once a stop was asked for ([`super::STOP_ASKED`]): the fresh image would not know of
/// it, and the service would go on after a SIGTERM. Returns false then, true when the exec
/// failed.
fn reexec(why: &str) -> bool {
    log::warn!("{why}");
    // Test builds (feature `failpoints`): `FAILPOINTS=reexec=sleep(MS)` holds the worker here,
    // where a SIGTERM must still stop the service.
    #[cfg(feature = "failpoints")]
    fail::fail_point!("reexec");
    // From here to execve a stop signal ends up pending on this thread (see REEXEC_TID), and
    // the fresh image, which starts with it held, stops once its handlers are in place.
    super::hold_signals_here(true);
    // SAFETY: gettid has no arguments and cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as i32;
    super::REEXEC_TID.store(tid, Ordering::SeqCst);
    let done = |restarting: bool| {
        super::REEXEC_TID.store(0, Ordering::SeqCst);
        super::hold_signals_here(false); // a signal sent on meanwhile is handled now
        restarting
    };
    if super::STOP_ASKED.load(Ordering::SeqCst) {
        log::info!("not restarting the process: stopping");
        return done(false);
    }
    // Test builds: `FAILPOINTS=reexec-exec=sleep(MS)` holds the instant between the last look
    // at STOP_ASKED and execve open.
    #[cfg(feature = "failpoints")]
    fail::fail_point!("reexec-exec");
    let e = exec_self();
    log::error!("cannot restart the process ({e}); reopening in place");
    done(true)
}

/// execv of this program with its own arguments and environment: not `Command::exec`, which
/// empties the signal mask before `execve`, so that a stop signal held pending would be handled
/// by this image, which is going, instead of the fresh one. Returns only on failure.
pub(super) fn exec_self() -> std::io::Error {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let args: Vec<CString> = match std::env::args_os()
        .map(|a| CString::new(a.as_bytes()))
        .collect()
    {
        Ok(args) => args,
        Err(e) => return e.into(),
    };
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    // SAFETY: a NUL-terminated path and a NULL-terminated array of NUL-terminated strings that
    // outlive the call; execv returns only on failure.
    unsafe { libc::execv(c"/proc/self/exe".as_ptr(), argv.as_ptr()) };
    std::io::Error::last_os_error()
}

/// Whether the output and state folders take a small synced write now: a probe file written,
/// synced and removed in each.
fn disk_answers(settings: &Settings) -> bool {
    [&settings.paths.output, &settings.paths.state]
        .iter()
        .all(|dir| {
            let probe = dir.join(".ailhd-probe");
            let ok = std::fs::write(&probe, b"probe")
                .and_then(|()| std::fs::File::open(&probe)?.sync_all())
                .is_ok();
            let _ = std::fs::remove_file(&probe);
            ok
        })
}

/// A comparison of the tree with the manifest running on a thread of its own, with the gate
/// it gives way at, which calls it off. Its thread returns how it failed, if it did.
pub(super) struct Rescan {
    handle: std::thread::JoinHandle<RescanEnd>,
    gate: Arc<crate::pace::Gate>,
    /// Its number ([`super::shared::Comparing`]).
    number: u64,
}

/// A comparison that failed (not one called off). A recovery's own failure is a failure of
/// writing again, retried with it; any other was logged where it happened, and `status` lists it.
pub(super) struct RescanFailed {
    error: anyhow::Error,
    recovery: bool,
}

/// How a comparison of the tree with the manifest ended: failed, and the folders it could not
/// list (relative, with why), which `status` lists among the errors.
pub(super) struct RescanEnd {
    failed: Option<RescanFailed>,
    unlisted: Vec<(String, String)>,
}

/// The ingest worker: drives the engine, closes it when idle, and rides out write failures.
pub(super) struct Worker {
    pub(super) settings: Settings,
    pub(super) shared: Arc<Shared>,
    pub(super) report: mpsc::UnboundedSender<Report>,
    /// None while closed (idle, or after a failure).
    pub(super) engine: Option<Engine>,
    /// The warm featuriser of a closed engine (and what its clean close left, after an idle
    /// close).
    pub(super) warm: Option<crate::engine::Warm>,
    /// The manifest of an engine abandoned after a failure, kept for the next open (dropping
    /// it while the disk fails is what sled handles worst).
    pub(super) kept_manifest: Option<Arc<crate::engine::manifest::Manifest>>,
    /// The stage times of the engines closed so far in this process (an idle close, a failure):
    /// `ailhd_stage_seconds` and the stop's log line count from the process's start.
    pub(super) closed_stages: Vec<(&'static str, f64)>,
    /// The last status snapshot could not be written to the state folder (warned once).
    pub(super) snapshot_failing: bool,
    /// The comparison of the tree with the manifest, running beside the ingest on a thread of
    /// its own (start-up, periodic rescans, the recovery after a failure): new recordings are
    /// taken meanwhile.
    pub(super) reconciling: Option<Rescan>,
    /// The next comparison is the recovery's after a failure (see `retry`).
    pub(super) recovering: bool,
    /// A rescan was asked for while one ran: run another when it ends.
    pub(super) rescan_again: bool,
    /// When the disk was last probed while writing failed.
    pub(super) last_probe: Instant,
    pub(super) fault: Option<Fault>,
    /// Failures since the last batch committed: the backoff grows with them.
    pub(super) failures: u32,
    /// Changes dropped while writing failed: the rescan after recovery finds them again.
    pub(super) dropped: usize,
    pub(super) recent: Recent,
    pub(super) ingested: u64,
    /// The manifest's part of the last snapshot (kept while the engine is closed).
    pub(super) last_report: status::StatusReport,
    /// The label names as of the last snapshot (every one gets an `ailhd_rows` series).
    pub(super) labels: Vec<String>,
    pub(super) dirty: bool,
    /// `Shared::pending_version` when the last snapshot took the list of pending files.
    pending_seen: u64,
    pub(super) last_snapshot: Instant,
    pub(super) snapshot_cost: Duration,
    pub(super) last_work: Instant,
    pub(super) device: String,
    /// The start's listing of the tree, made while the engine opened: the first rescan's.
    pub(super) listed: Option<crate::source::Listing>,
    /// The next rescan is the start's (see [`crate::engine::reconcile_with`]).
    pub(super) start: bool,
    /// Comparisons of the tree with the manifest started so far (each one's number).
    pub(super) comparisons: u64,
    pub(super) slow: super::slow::SlowBatches,
    /// The state folder the service started with (device, inode), and when it was last looked
    /// at: one removed or replaced while the service runs (its manifest and writer locks gone
    /// with it) is met by a restart of the process (see [`Worker::check_state_folder`]).
    state_id: Option<(u64, u64)>,
    state_checked: Instant,
}

impl Worker {
    /// Backoff before reopening after the n-th failure in a row: 1, 2, 4 ... 30 s.
    fn backoff(failures: u32) -> Duration {
        Duration::from_secs((1u64 << failures.saturating_sub(1).min(5)).min(30))
    }

    /// The engine taken out to be closed, its stage times kept with those of the engines
    /// closed before it.
    fn take_engine(&mut self) -> Option<Engine> {
        let engine = self.engine.take()?;
        self.closed_stages = self.stage_seconds_with(Some(&engine));
        Some(engine)
    }

    /// Seconds per stage since the process started: the closed engines' and the open one's.
    fn stage_seconds(&self) -> Vec<(&'static str, f64)> {
        self.stage_seconds_with(self.engine.as_ref())
    }

    fn stage_seconds_with(&self, engine: Option<&Engine>) -> Vec<(&'static str, f64)> {
        let mut total = engine.map_or_else(
            || crate::engine::stages::StageTimes::default().seconds(),
            |e| e.times().seconds(),
        );
        for ((_, t), (_, closed)) in total.iter_mut().zip(&self.closed_stages) {
            *t += closed;
        }
        total
    }

    /// Open the engine if it is closed, with the warm featuriser when there is one.
    fn open(&mut self) -> anyhow::Result<&mut Engine> {
        if self.engine.is_none() && crate::output::hdf5::failed_in_this_process() {
            // Never reopen in place after a failed HDF5 call (see `reexec`).
            if !disk_answers(&self.settings) {
                anyhow::bail!("the output or state folder does not take a synced write yet");
            }
            if !reexec(
                "the disk answers again: restarting the service's process to reopen its HDF5 \
                 files (an HDF5 file cannot be reopened safely in a process where writing it \
                 failed)",
            ) {
                anyhow::bail!("stopping: the outputs are not reopened");
            }
        }
        if self.engine.is_none() {
            let warm = self
                .warm
                .take()
                .unwrap_or(crate::engine::Warm::Build(self.settings.ingest.device));
            let engine = Engine::open_live_with(&self.settings, warm, self.kept_manifest.take())?;
            self.device = engine.device().to_string();
            crate::metrics::outputs_open(true);
            self.engine = Some(engine);
        }
        Ok(self.engine.as_mut().expect("opened above"))
    }

    /// Writing failed: drop what is in flight (nothing of it was recorded, the outputs are cut
    /// back to their committed rows), report, and retry later.
    fn fail(&mut self, e: anyhow::Error) {
        // The first failure since a batch last committed (a retry that reopens the outputs and
        // then fails at the next batch, as a broken featuriser does, is the same failure).
        let first = self.failures == 0;
        self.failures += 1;
        let wait = Self::backoff(self.failures);
        let error = format!("{e:#}");
        // What failed, as the log says it and as the errors metric counts it.
        let (what, metric) = match e.downcast_ref::<crate::engine::FeaturiserFailed>() {
            Some(_) => ("featurising", "featurise"),
            None => ("writing", "write"),
        };
        let recorded = if e
            .downcast_ref::<crate::engine::commit::Unpublished>()
            .is_some()
        {
            "the batch's rows are on disk and the reopen publishes them if the manifest recorded the batch"
        } else {
            "nothing of the batch was recorded"
        };
        // Said before anything is closed: closing may fail too, and takes time.
        crate::metrics::write_failing(true);
        if first {
            log::error!(
                "{what} failed, {recorded}: {error}; the service stays up and tries again in {} s",
                wait.as_secs()
            );
            crate::metrics::error(metric);
            self.recent.push_error(format!("{what}: {error}"));
        } else {
            log::warn!(
                "{what} still fails: {error}; next try in {} s",
                wait.as_secs()
            );
        }
        let since_ms = self.fault.as_ref().map_or(now_ms(), |f| f.since_ms);
        *self.shared.fault.lock().unwrap_or_else(|p| p.into_inner()) = Some(error.clone());
        self.fault = Some(Fault {
            since_ms,
            error,
            retry_at: Instant::now() + wait,
            disk: metric == "write",
            probe_failed: false,
        });
        // Roll back: what is in flight is dropped (its sinks cut to their committed rows, as
        // far as the disk lets them; the next open does the rest). The recovery rescans.
        self.end_reconcile();
        self.rescan_again = false;
        self.listed = None; // the recovery lists the tree again
        if let Some(engine) = self.take_engine() {
            let (warm, manifest) = engine.abandon();
            self.warm = warm.map(crate::engine::Warm::Keep);
            self.kept_manifest = Some(manifest);
        }
        crate::metrics::outputs_open(false);
        self.dirty = true;
        self.snapshot();
    }

    /// Reopen after a failure; on success, compare the tree with the manifest, which finds
    /// every change dropped meanwhile. The comparison runs beside the ingest, as the start's
    /// does (seconds at a few hundred thousand recordings): recordings that arrive meanwhile are
    /// taken at once. Should it fail, writing is taken as failing still (see `tick`).
    fn retry(&mut self) {
        self.check_state_folder();
        if let Err(e) = self.open() {
            return self.fail(e);
        }
        let f = self.fault.take().expect("retrying a fault");
        *self.shared.fault.lock().unwrap_or_else(|p| p.into_inner()) = None;
        crate::metrics::write_failing(false);
        log::warn!(
            "writing works again after {:.0} s; {} changes seen meanwhile are taken up again (the tree is compared with the manifest)",
            (now_ms() - f.since_ms) as f64 / 1e3,
            self.dropped
        );
        self.dropped = 0;
        self.dirty = true;
        // The whole comparison, as at start (rows to remake included), from a new listing
        // (`fail` dropped the start's).
        self.start = true;
        self.recovering = true;
        self.start_reconcile();
    }

    /// Compare the tree with the manifest on a thread of its own, at a lower CPU priority,
    /// while recordings keep arriving; what it finds reaches the event loop, which hands it on
    /// by the same rules as the watcher's events. One at a time: asked again meanwhile, it runs
    /// again once this one ends.
    fn start_reconcile(&mut self) {
        if self.rescanning() {
            self.rescan_again = true;
            return;
        }
        // A recovery's comparison that failed is a failure: the retry compares again. (None
        // runs now, so none is left to end.)
        self.reap_reconcile();
        if self.fault.is_some() {
            return;
        }
        self.rescan_again = false;
        let manifest = match self.open() {
            Ok(engine) => engine.manifest_handle(),
            Err(e) => return self.fail(e),
        };
        let settings = self.settings.clone();
        let report = self.report.clone();
        let listed = self.listed.take();
        let start = std::mem::take(&mut self.start);
        let recovery = std::mem::take(&mut self.recovering);
        // A periodic rescan gives way to recordings on their way; the start's does not (those
        // that arrived while the service was down wait for it). Either can be called off.
        let gate = if start {
            crate::pace::Gate::new(|| false)
        } else {
            let shared = self.shared.clone();
            crate::pace::Gate::new(move || shared.busy())
        };
        let kept = gate.clone();
        self.comparisons += 1;
        let number = self.comparisons;
        let why = match (start, recovery) {
            (_, true) => "recovery",
            (true, false) => "start",
            (false, false) => "rescan",
        };
        // Noted before the thread starts: its end (`Report::Compared`) may reach the event
        // loop before this thread runs again, and must find the note to clear.
        *self
            .shared
            .comparing
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(super::shared::Comparing {
            number,
            since_ms: now_ms(),
            why,
        });
        self.dirty = true;
        let spawned = std::thread::Builder::new()
            .name("ailhd-rescan".into())
            .spawn(move || {
                lower_priority();
                crate::pace::install(Some(gate.clone()));
                // What it finds goes on at once, part by part: new recordings first.
                let (mut changed, mut gone, mut unlisted) = (0, 0, Vec::new());
                let result = crate::engine::reconcile_with(
                    &settings,
                    &manifest,
                    listed,
                    start,
                    &mut |mut part| {
                        changed += part.changed.len();
                        gone += part.removed.len();
                        unlisted.append(&mut part.unlisted);
                        let _ = report.send(Report::Reconciled(part));
                    },
                );
                let failed = match result {
                    Ok(()) => {
                        if changed > 0 || gone > 0 {
                            log::info!("rescan: {changed} new or changed, {gone} gone");
                        }
                        if !start {
                            let (paused, pauses) = gate.paused();
                            log::debug!(
                                "rescan: gave way to recordings {pauses} times, {:.0} ms in all",
                                paused.as_secs_f64() * 1e3
                            );
                        }
                        None
                    }
                    Err(e) if e.is::<crate::pace::CalledOff>() => {
                        log::info!("rescan called off (the manifest is being closed): the next comparison covers what it had not looked at");
                        None
                    }
                    Err(e) => {
                        // A recovery's own failure: the worker retries the recovery, and says
                        // so. Any other is said here, and `status` lists it (`reap_reconcile`).
                        let absent = e.is::<crate::engine::TreeAbsent>();
                        let recovery = recovery && !absent;
                        if !recovery {
                            let what = if absent { "rescan" } else { "rescan failed" };
                            log::error!("{what}: {e:#}");
                            crate::metrics::error("rescan");
                        }
                        Some(RescanFailed { error: e, recovery })
                    }
                };
                // After its last part: `status` reports the comparison until the event loop
                // has taken all it found.
                let _ = report.send(Report::Compared(number));
                // The listing of the whole tree is freed: give its pages back.
                crate::memory::release_free_memory();
                RescanEnd { failed, unlisted }
            });
        match spawned {
            Ok(handle) => {
                self.reconciling = Some(Rescan {
                    handle,
                    gate: kept,
                    number,
                })
            }
            Err(e) => {
                self.shared.compared(number);
                if recovery {
                    self.fail(anyhow::anyhow!(
                        "cannot start the thread that compares the tree with the manifest: {e}"
                    ))
                } else {
                    log::error!("rescan failed: cannot start its thread: {e}")
                }
            }
        }
    }

    fn rescanning(&self) -> bool {
        self.reconciling
            .as_ref()
            .is_some_and(|r| !r.handle.is_finished())
    }

    /// A comparison that ended: a recovery's that failed means writing fails still (the
    /// manifest could not be read, say), and the recovery is tried again after the backoff;
    /// another that failed goes into `status`'s last errors.
    fn reap_reconcile(&mut self) {
        if !self
            .reconciling
            .as_ref()
            .is_some_and(|r| r.handle.is_finished())
        {
            return;
        }
        let r = self.reconciling.take().expect("checked above");
        let Ok(end) = r.handle.join() else {
            // It panicked before it could say it ended: `status` stops reporting it.
            self.shared.compared(r.number);
            self.dirty = true;
            return;
        };
        for (folder, why) in end.unlisted {
            crate::metrics::error("rescan");
            self.recent.push_error(format!(
                "rescan: cannot list {}/{folder}: {why}; the recordings under it keep their rows, and new ones are not seen until it can be read",
                self.settings.paths.recordings.display()
            ));
            self.dirty = true;
        }
        match end.failed {
            Some(RescanFailed {
                error,
                recovery: true,
            }) => {
                self.fail(error.context("comparing the tree with the manifest after the recovery"))
            }
            Some(RescanFailed { error, .. }) => {
                self.recent.push_error(format!("rescan: {error:#}"));
                self.dirty = true;
            }
            None => {}
        }
    }

    /// End a running rescan (before the manifest is closed): call it off and wait for it. Let
    /// run, it could take long: a periodic rescan gives way to recordings, and those would wait
    /// for this thread. What it has not looked at, the next comparison does (the recovery's
    /// after a failure, the next start's after a stop).
    fn end_reconcile(&mut self) {
        if let Some(r) = self.reconciling.take() {
            if !r.handle.is_finished() {
                log::debug!("calling off the running rescan");
                r.gate.call_off();
            }
            let _ = r.handle.join();
        }
    }

    /// Idle long enough: commit, close the files cleanly (plain readers open them), keep the
    /// featuriser warm for the next file.
    fn close_idle(&mut self) {
        // The manifest is closed with the engine: no rescan may hold it.
        self.end_reconcile();
        self.snapshot();
        let Some(engine) = self.take_engine() else {
            return;
        };
        match engine.suspend() {
            Ok(s) => {
                self.warm = Some(crate::engine::Warm::Resume(s));
                crate::metrics::outputs_open(false);
                log::info!(
                    "idle for {} s: outputs closed (plain HDF5 readers open them); the next file reopens them",
                    self.settings.ingest.idle_close_s
                );
                self.dirty = true;
                self.snapshot();
                // What the manifest and the outputs held goes back to the system now: an idle
                // service makes no later allocation that would (at ~236,000 recordings: 29-37 MB
                // resident at rest instead of 102-104; docs/benchmarks.md).
                crate::memory::release_free_memory();
            }
            Err(e) => self.fail(e),
        }
    }

    /// What the engine reports done: figures for `status`, rereads, the queue depth.
    fn on_done(&mut self, done: Done) {
        self.failures = 0;
        let n = (done.counts.new_rows + done.counts.attached) as u64;
        self.ingested += n;
        crate::metrics::file_ingested(n);
        for l in &done.latencies {
            self.recent.push_latency(l.as_secs_f64() * 1e3);
            crate::metrics::commit_latency(l.as_secs_f64());
        }
        if let Some(line) = self.slow.line(&done, Instant::now()) {
            log::info!("{line}");
        }
        for (rel, reason) in &done.quarantined {
            crate::metrics::file_quarantined(&reason.to_string());
            log::warn!(file = rel.as_str(), reason = reason.to_string().as_str(); "quarantined {rel}: {reason}");
            self.recent.push_error(format!("{rel}: {reason}"));
        }
        log::debug!(
            "batch: {} new rows, {} attached, {} unchanged, {} removed, {} quarantined",
            done.counts.new_rows,
            done.counts.attached,
            done.counts.unchanged,
            done.counts.removed,
            done.counts.quarantined
        );
        let _ = self.report.send(Report::Batch(done));
        self.dirty = true;
    }

    /// What the engine holds, for `status` and the rescan's pace ([`Shared::busy`]).
    fn count_in_flight(&self) {
        self.shared
            .in_flight
            .store(self.in_flight(), Ordering::Relaxed);
        let files = self.engine.as_ref().map_or(0, |e| e.files_in_flight());
        self.shared.in_flight_files.store(files, Ordering::Relaxed);
    }

    fn in_flight(&self) -> usize {
        self.engine.as_ref().map_or(0, |e| e.in_flight())
    }

    fn take_completed(&mut self) {
        let Some(engine) = self.engine.as_mut() else {
            return;
        };
        match engine.completed() {
            Ok(done) => done.into_iter().for_each(|d| self.on_done(d)),
            Err(e) => self.fail(e),
        }
    }

    fn wait_all(&mut self) -> bool {
        let Some(engine) = self.engine.as_mut() else {
            return self.fault.is_none();
        };
        match engine.wait() {
            Ok(done) => {
                done.into_iter().for_each(|d| self.on_done(d));
                true
            }
            Err(e) => {
                self.fail(e);
                false
            }
        }
    }
}

impl Worker {
    fn new(
        engine: anyhow::Result<Engine>,
        listed: Option<crate::source::Listing>,
        settings: Settings,
        report: mpsc::UnboundedSender<Report>,
        shared: Arc<Shared>,
    ) -> Worker {
        let labels = settings.labels.names.clone();
        let state_id = super::folder_id(&settings.paths.state);
        let mut w = Worker {
            device: engine
                .as_ref()
                .map_or_else(|_| "-".to_string(), |e| e.device().to_string()),
            settings,
            shared,
            report,
            engine: None,
            warm: None,
            kept_manifest: None,
            closed_stages: Vec::new(),
            snapshot_failing: false,
            reconciling: None,
            comparisons: 0,
            recovering: false,
            rescan_again: false,
            last_probe: Instant::now(),
            fault: None,
            failures: 0,
            dropped: 0,
            recent: Recent::default(),
            ingested: 0,
            last_report: status::StatusReport::default(),
            labels,
            dirty: true,
            pending_seen: 0,
            last_snapshot: Instant::now() - Duration::from_secs(3600),
            snapshot_cost: Duration::ZERO,
            last_work: Instant::now(),
            listed,
            start: true,
            slow: Default::default(),
            state_id,
            state_checked: Instant::now(),
        };
        match engine {
            Ok(e) => {
                crate::metrics::outputs_open(true);
                w.engine = Some(e);
            }
            // Only a full or failing disk gets here (serve() stops on anything else): wait for it.
            Err(e) => w.fail(e),
        }
        w
    }

    /// Between two waits: take the engine's finished batches, start a rescan that was asked
    /// for meanwhile, retry after a failure when it is time.
    fn tick(&mut self) {
        self.shared.alive_ms.store(now_ms(), Ordering::Relaxed);
        self.take_completed();
        self.reap_reconcile();
        self.count_in_flight();
        if self.rescan_again && self.fault.is_none() && !self.rescanning() {
            self.start_reconcile();
        }
        let due = match &mut self.fault {
            Some(f) if Instant::now() >= f.retry_at => true,
            Some(f) if f.disk && self.last_probe.elapsed() >= Duration::from_secs(1) => {
                self.last_probe = Instant::now();
                let answers = disk_answers(&self.settings);
                let back = answers && f.probe_failed;
                f.probe_failed = !answers;
                back
            }
            _ => false,
        };
        if due {
            self.retry();
        }
    }

    /// What the batching policy needs to know of the engine and the event loop.
    fn load(&self) -> Load {
        Load {
            in_flight: self.engine.as_ref().map_or(0, |e| e.batches_in_flight()),
            settling: self.shared.settling.load(Ordering::Relaxed),
        }
    }

    /// How long to wait for the next work, given what the batch being gathered waits for.
    fn wait(&self, next: Next) -> Duration {
        let in_flight = self.in_flight() > 0;
        match next {
            // Batches in flight: look again soon, so that their figures come in promptly and
            // a batch waiting for them closes once they are done.
            Next::WaitUntil(t) if in_flight => t
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(1)),
            Next::WaitUntil(t) => t.saturating_duration_since(Instant::now()),
            _ if in_flight => Duration::from_millis(5),
            _ => match &self.fault {
                Some(f) => f
                    .retry_at
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_secs(1)),
                None => Duration::from_secs(1),
            },
        }
    }

    /// Gather `op` into the batch, unless nothing can be written now (the rescan after the
    /// recovery takes it up again).
    fn gather(&mut self, op: Input, batch: &mut Batcher) {
        self.last_work = Instant::now();
        if self.fault.is_some() {
            if matches!(op, Input::Load { .. }) {
                self.unqueue(1);
            }
            self.dropped += 1;
            return;
        }
        batch.push(op, Instant::now());
    }

    fn unqueue(&self, loads: usize) {
        let queued = &self.shared.queued;
        queued.fetch_sub(loads.min(queued.load(Ordering::Relaxed)), Ordering::Relaxed);
    }

    /// Hand a closed batch to the engine.
    fn submit(&mut self, ops: Vec<Input>) {
        if ops.is_empty() {
            return;
        }
        self.unqueue(
            ops.iter()
                .filter(|o| matches!(o, Input::Load { .. }))
                .count(),
        );
        let n_ops = ops.len();
        if let Err(e) = self.open().and_then(|engine| engine.submit(ops)) {
            self.dropped += n_ops;
            self.fail(e);
        }
        self.count_in_flight();
        self.dirty = true;
    }

    /// Nothing arrived and nothing is gathered: a good moment for the status snapshot, or to
    /// close the files.
    fn on_idle(&mut self) {
        if self.in_flight() > 0 {
            // Never block on the engine here: new files must be taken at once.
            return;
        }
        if self.state_checked.elapsed() >= STATE_CHECK_EVERY {
            self.check_state_folder();
        }
        if self.dirty {
            self.snapshot();
            crate::memory::release_free_memory();
        } else if self.shared.pending_version.load(Ordering::Relaxed) != self.pending_seen {
            // Only the list of pending files changed (a file committed since the last snapshot
            // left it): `status` must not go on listing it.
            self.snapshot();
        }
        let idle_close = self.settings.ingest.idle_close_s;
        // The manifest closes with the files, so a running rescan would have to end first:
        // waiting for it here would hold every recording that arrives meanwhile (seconds at a
        // few hundred thousand recordings). Close once it is done (this runs every second).
        if self.engine.is_some()
            && idle_close > 0
            && !self.rescanning()
            && self.last_work.elapsed() >= Duration::from_secs(idle_close)
        {
            self.close_idle();
        }
    }

    /// Work that is not a recording's: a rescan, a reload.
    fn handle(&mut self, work: Work, batch: &mut Batcher) {
        match work {
            Work::Op(op) => self.gather(op, batch),
            Work::Rescan => {
                self.dirty = true;
                if self.fault.is_none() {
                    self.start_reconcile(); // else the recovery rescans
                }
            }
            Work::Reload(new) => {
                if let Some(engine) = self.engine.as_mut() {
                    engine.update_live_settings(&new);
                }
                batch.set_policy(Policy::from_settings(&new.ingest));
                self.settings.ingest = new.ingest.clone();
            }
        }
    }

    /// The channel closed (shutdown): drain, commit, close the outputs, keep the report.
    fn stop(mut self) -> anyhow::Result<()> {
        self.end_reconcile();
        self.wait_all();
        self.snapshot();
        if let Some(f) = &self.fault {
            log::warn!(
                "stopping while writing fails ({}): what was not recorded is ingested at the next start",
                f.error
            );
        }
        let stages: Vec<String> = self
            .stage_seconds()
            .iter()
            .map(|(k, v)| format!("{k} {v:.3}s"))
            .collect();
        let Some(engine) = self.engine.take() else {
            log::info!(
                "stopping: {} files ingested this run; time per stage: {}",
                self.ingested,
                stages.join(", ")
            );
            return Ok(());
        };
        log::info!(
            "stopping: {} files ingested this run; time per stage: {}",
            self.ingested,
            stages.join(", ")
        );
        engine.finish()?;
        // The manifest is closed: keep the report for `status` of the stopped service.
        if let Err(e) = status::save_stopped(&self.settings, &self.last_report) {
            log::debug!("cannot keep the status report for the stopped service: {e}");
        }
        Ok(())
    }
}

/// The worker thread's loop: gather, close batches by the policy, hand them to the engine.
pub(super) fn worker_loop(
    engine: anyhow::Result<Engine>,
    listed: Option<crate::source::Listing>,
    settings: Settings,
    rx: crossbeam_channel::Receiver<Work>,
    report: mpsc::UnboundedSender<Report>,
    shared: Arc<Shared>,
) -> anyhow::Result<()> {
    let mut batch = Batcher::new(Policy::from_settings(&settings.ingest));
    let mut w = Worker::new(engine, listed, settings, report, shared);
    // Work that is not a recording's, met while draining the channel into a batch.
    let mut deferred: VecDeque<Work> = VecDeque::new();
    loop {
        w.tick();
        let next = batch.next(Instant::now(), w.load());
        if next == Next::Close {
            w.submit(batch.take());
            w.snapshot_if_due();
            continue;
        }
        let work = match deferred.pop_front() {
            Some(work) => work,
            None => match rx.recv_timeout(w.wait(next)) {
                Ok(work) => work,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    if next == Next::Empty {
                        w.on_idle();
                    }
                    continue;
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
            },
        };
        match work {
            Work::Op(op) => {
                w.gather(op, &mut batch);
                // Everything queued already joins it, up to the cap.
                while batch.room() > 0 {
                    match rx.try_recv() {
                        Ok(Work::Op(op)) => w.gather(op, &mut batch),
                        Ok(other) => {
                            deferred.push_back(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
            }
            other => {
                // A rescan or a reload comes after what was gathered before it.
                w.submit(batch.take());
                w.handle(other, &mut batch);
            }
        }
        w.snapshot_if_due();
    }
    w.submit(batch.take());
    w.stop()
}

#[derive(Default)]
pub(super) struct Recent {
    latencies: VecDeque<f64>,
    errors: VecDeque<String>,
}

impl Recent {
    const KEEP: usize = 2000;
    fn push_latency(&mut self, ms: f64) {
        if self.latencies.len() == Self::KEEP {
            self.latencies.pop_front();
        }
        self.latencies.push_back(ms);
    }
    fn push_error(&mut self, e: String) {
        if self.errors.len() == 10 {
            self.errors.pop_front();
        }
        self.errors.push_back(e);
    }
    fn percentile(&self, q: f64) -> Option<f64> {
        if self.latencies.is_empty() {
            return None;
        }
        let mut v: Vec<f64> = self.latencies.iter().copied().collect();
        v.sort_by(|a, b| a.total_cmp(b));
        Some(v[((v.len() - 1) as f64 * q).round() as usize])
    }
}

impl Worker {
    /// The status snapshot `ailhd status` and the metrics read: the manifest's counts (kept by
    /// every commit, never counted while recordings wait), the service's figures, and what it is
    /// riding out.
    fn snapshot(&mut self) {
        if let Some(engine) = &self.engine {
            match status::collect(engine.manifest(), engine.labels(), &self.settings) {
                Ok(r) => self.last_report = r,
                Err(e) => log::warn!("cannot read the manifest for the status snapshot: {e:#}"),
            }
            self.labels = engine.labels().to_vec();
            for (stage, secs) in self.stage_seconds() {
                crate::metrics::stage_seconds(stage, secs);
            }
        }
        let mut r = self.last_report.clone();
        crate::metrics::record_status(&r, &self.labels);
        let shared = &self.shared;
        self.pending_seen = shared.pending_version.load(Ordering::Relaxed);
        let queue = shared.settling.load(Ordering::Relaxed) + shared.complete_uncommitted();
        crate::metrics::pending(shared.settling.load(Ordering::Relaxed));
        crate::metrics::queue_depth(queue);
        crate::metrics::ready();
        r.service = Some(ServiceStatus {
            pid: std::process::id(),
            device: self.device.clone(),
            queue_depth: queue,
            ingested: self.ingested,
            latency_ms_p50: self.recent.percentile(0.5),
            latency_ms_p90: self.recent.percentile(0.9),
            latency_ms_p99: self.recent.percentile(0.99),
            last_errors: self.recent.errors.iter().cloned().collect(),
            pending: shared
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            updated_ms: now_ms(),
            age_s: 0.0,
            outputs_open: self.engine.is_some(),
            unwatched: shared
                .unwatched
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|(p, r)| status::Unwatched {
                    path: p.display().to_string(),
                    reason: r.clone(),
                })
                .collect(),
            comparing: shared.comparing().map(|c| status::Comparing {
                since_ms: c.since_ms,
                why: c.why.to_string(),
            }),
            write_failing: self.fault.as_ref().map(|f| status::WriteFailing {
                since_ms: f.since_ms,
                error: f.error.clone(),
                retry_in_s: f
                    .retry_at
                    .saturating_duration_since(Instant::now())
                    .as_secs_f64(),
                dropped: self.dropped,
            }),
        });
        let json = serde_json::to_vec_pretty(&r).expect("the report serialises");
        // Rewritten every few seconds: atomic for readers, not synced (a power cut loses one
        // snapshot; the next start writes another).
        let write = |path: &Path| crate::durable::replace(path, &json, crate::durable::Sync::None);
        // The runtime copy first: it is what `status` reads when the state folder's disk fails.
        let runtime = status::runtime_snapshot_path(&self.settings);
        let _ = runtime
            .parent()
            .map(std::fs::create_dir_all)
            .transpose()
            .and_then(|_| write(&runtime));
        let path = status::snapshot_path(&self.settings);
        match write(&path) {
            Ok(()) => self.snapshot_failing = false,
            Err(e) if !self.snapshot_failing => {
                self.snapshot_failing = true;
                log::warn!(
                    "cannot write the status snapshot {}: {e}; `ailhd status` reads {} meanwhile",
                    path.display(),
                    runtime.display()
                );
            }
            Err(_) => {}
        }
        self.dirty = false;
        self.last_snapshot = Instant::now();
    }

    /// A state folder removed or replaced while the service runs took the manifest and the
    /// writer locks with it: the open manifest writes to files nobody can open again, and
    /// every retry after a failure would reopen that same handle. The process restarts in place
    /// instead (same PID), as a fresh start it finds the state missing and rebuilds the
    /// manifest from the outputs, without recomputing features or moving a row
    /// (docs/operations.md). A state folder that cannot be looked at (a failing disk) is left
    /// to the usual retries.
    fn check_state_folder(&mut self) {
        self.state_checked = Instant::now();
        let dir = self.settings.paths.state.clone();
        let gone = match std::fs::metadata(&dir) {
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
            Ok(m) => {
                use std::os::unix::fs::MetadataExt;
                self.state_id
                    .is_some_and(|id| !m.is_dir() || (m.dev(), m.ino()) != id)
            }
        };
        if !gone {
            return;
        }
        if self.fault.is_none() {
            // Nothing in flight (idle): close the outputs cleanly first.
            self.end_reconcile();
            if let Some(engine) = self.engine.take() {
                if let Err(e) = engine.finish() {
                    log::debug!("closing before the restart: {e:#}");
                }
            }
        }
        reexec(&format!(
            "the state folder {} was removed or replaced while the service ran: restarting \
             the service's process, which rebuilds the manifest from the outputs (no feature \
             recomputed, no row moved)",
            dir.display()
        ));
    }

    /// Snapshot at most every 2 s, and never more than ~10% of the time.
    fn snapshot_if_due(&mut self) {
        if self.dirty
            && self.last_snapshot.elapsed() > (self.snapshot_cost * 10).max(Duration::from_secs(2))
        {
            let t = Instant::now();
            self.snapshot();
            self.snapshot_cost = t.elapsed();
        }
    }
}

/// How often an idle service looks at whether its state folder is still the one it started with.
const STATE_CHECK_EVERY: Duration = Duration::from_secs(5);

/// The calling thread runs only when nothing else wants the CPU (`SCHED_IDLE`; where that is
/// refused, nice 19): a rescan must not take time from recordings that wait.
fn lower_priority() {
    // SAFETY: plain system calls about the calling thread (0: this thread).
    unsafe {
        let param = libc::sched_param { sched_priority: 0 };
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, 19);
        }
    }
}
