//! `ailhd run`: the ingestion service. Two threads of control with one job each:
//!
//! - the event loop (tokio) follows the tree (watch -> settle), signals (SIGTERM drains and
//!   exits, SIGHUP reloads), timers (safety rescan, systemd watchdog) and tells systemd how it
//!   is doing (READY, STATUS, STOPPING);
//! - the ingest worker (a thread driving the [`Engine`]: manifest, outputs, warm featuriser)
//!   hands complete files to it in micro-batches; the engine's stages overlap, so the next
//!   batch loads while the previous one is featurised and committed.
//!
//! Shutdown comes in as a future, so tests stop the service the way systemd does.

use crate::config::Settings;
use crate::engine::manifest::now_ms;
use crate::engine::outcome::{Observation, Reason};
use crate::engine::{Done, Engine, Input, Reconciliation};
use crate::lock::WriterLocks;
use crate::source::settle::{PendingFile, Settled, Settler};
use crate::source::watch::{WatchEvent, Watcher};
use crate::source::{self, Found};
use crate::status::{self, ServiceStatus};
use anyhow::Context;
use sd_notify::NotifyState;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Entry point of `ailhd run`: a runtime, the service, and the process signals as shutdown.
pub fn run(settings: Settings, config_path: Option<PathBuf>) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the event loop")?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => log::info!("SIGTERM: draining and stopping"),
                _ = tokio::signal::ctrl_c() => log::info!("interrupted: draining and stopping"),
            }
        };
        serve(settings, config_path, shutdown).await
    })
}

/// What the worker is asked to do.
enum Work {
    Op(Input),
    /// Compare the whole tree with the manifest (start-up, overflow, periodic).
    Rescan,
    Reload(Box<Settings>),
}

/// What the worker tells the event loop.
enum Report {
    Reconciled(Reconciliation),
    Batch(Done),
}

/// State shared with the worker for `status` and the watchdog.
#[derive(Default)]
struct Shared {
    /// Files touched and not yet complete (the settle stage), for the queue depth.
    settling: AtomicUsize,
    /// Complete files waiting for the worker.
    queued: AtomicUsize,
    /// Last time the worker was seen making progress or idle (ms since the epoch).
    alive_ms: AtomicI64,
    /// Files waiting to be complete (the settle stage's list, refreshed now and then).
    pending: Mutex<Vec<PendingFile>>,
    /// Set while writing fails (for systemd's STATUS=).
    fault: Mutex<Option<String>>,
    /// Folders the watcher could not watch (limits), with why.
    unwatched: Mutex<Vec<(PathBuf, String)>>,
}

pub async fn serve(
    settings: Settings,
    config_path: Option<PathBuf>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    for p in crate::staging::remove_stale(&settings)? {
        log::warn!("removed {}, left by an interrupted rebuild", p.display());
    }
    let _lock = WriterLocks::acquire(&settings, "run")?;
    crate::engine::manifest::set_cache_mb(settings.ingest.manifest_cache_mb);
    let _metrics = crate::metrics::Exporter::start(&settings.metrics)?;
    let root = std::path::absolute(&settings.paths.recordings)?;
    // Watch first, then scan: nothing falls between the two. The engine opens (manifest,
    // outputs, featuriser) while the watches are set up: the two are the start-up's longest
    // steps on a large tree, and neither needs the other.
    let (watch_tx, mut watch_rx) = mpsc::unbounded_channel::<WatchEvent>();
    let (engine, watcher) = std::thread::scope(|scope| {
        let engine = scope.spawn(|| Engine::open_live(&settings, settings.ingest.device));
        let watcher = Watcher::start(&root, watch_tx);
        (engine.join().expect("opening the engine panicked"), watcher)
    });
    // A full disk or a failing one does not stop the service from starting: it says so and
    // retries (see Worker). Anything else (outputs of other feature settings, say) is an error.
    let engine = match engine {
        Err(e) if !crate::engine::may_pass(&e) => return Err(e),
        other => other,
    };
    let watcher = watcher?;
    let device = engine
        .as_ref()
        .map_or_else(|_| "-".to_string(), |e| e.device().to_string());
    crate::metrics::device(&device);

    let shared = Arc::new(Shared::default());
    shared.alive_ms.store(now_ms(), Ordering::Relaxed);
    let (work_tx, work_rx) = crossbeam_channel::unbounded::<Work>();
    let (report_tx, mut report_rx) = mpsc::unbounded_channel::<Report>();
    let worker = {
        let shared = shared.clone();
        let settings = settings.clone();
        std::thread::Builder::new()
            .name("ailhd-ingest".into())
            .spawn(move || worker_loop(engine, settings, work_rx, report_tx, shared))?
    };
    let send = |w: Work| {
        if matches!(w, Work::Op(Input::Load { .. })) {
            shared.queued.fetch_add(1, Ordering::Relaxed);
        }
        let _ = work_tx.send(w);
    };
    *shared.unwatched.lock().unwrap_or_else(|e| e.into_inner()) = watcher.unwatched();
    send(Work::Rescan);

    let mut settings = settings;
    let mut settler = Settler::new(
        Duration::from_millis(settings.ingest.settle_ms),
        Duration::from_secs(settings.ingest.quarantine_after_s),
    );
    let mut strong_at: HashMap<PathBuf, Instant> = HashMap::new();
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    let watchdog = sd_notify::watchdog_enabled();
    let mut ingested: u64 = 0;
    let mut pending_listed = Instant::now();
    let mut gone: Vec<Observation> = Vec::new();
    let mut gone_due: Option<Instant> = None;
    log::info!(
        "watching {} on {device}; outputs in {}",
        root.display(),
        settings.paths.output.display()
    );
    let _ = sd_notify::notify(&[
        NotifyState::Ready,
        NotifyState::Status(&format!("watching, on {device}")),
    ]);

    tokio::pin!(shutdown);
    let mut next_rescan = rescan_deadline(&settings);
    let mut watchdog_tick =
        tokio::time::interval(watchdog.map(|d| d / 2).unwrap_or(Duration::from_secs(3600)));
    let mut unwatched_tick = tokio::time::interval(UNWATCHED_RETRY);
    loop {
        let settle_at = settler.next_deadline();
        tokio::select! {
            _ = &mut shutdown => break,
            _ = hup.recv() => {
                match Settings::load(config_path.as_deref()) {
                    Ok(new) => {
                        if new.paths != settings.paths || new.features != settings.features || new.labels != settings.labels
                            || new.splits != settings.splits || new.outputs != settings.outputs || new.gpu != settings.gpu {
                            log::warn!("reload: only [ingest] settings change live; paths, labels, splits, features, outputs and gpu need a restart (and features a rebuild)");
                        }
                        settler = Settler::new(Duration::from_millis(new.ingest.settle_ms), Duration::from_secs(new.ingest.quarantine_after_s));
                        send(Work::Rescan); // what was settling is picked up again by the rescan
                        settings.ingest = new.ingest.clone();
                        // For the manifest opened next (after an idle close, say).
                        crate::engine::manifest::set_cache_mb(settings.ingest.manifest_cache_mb);
                        next_rescan = rescan_deadline(&settings);
                        send(Work::Reload(Box::new(new)));
                        log::info!("configuration reloaded");
                        crate::reload::record(&settings, true, "configuration reloaded");
                    }
                    Err(e) => {
                        log::error!("reload refused, keeping the running configuration: {e}");
                        crate::reload::record(&settings, false, &e.to_string());
                    }
                }
            }
            ev = watch_rx.recv() => {
                let Some(ev) = ev else { anyhow::bail!("the watcher stopped unexpectedly") };
                let now = Instant::now();
                match ev {
                    WatchEvent::Touched { path, kind } => match source::classify_path(&root, &path) {
                        Some(Found::Recording(_)) => {
                            if kind.is_strong() {
                                strong_at.insert(path.clone(), now);
                            }
                            // A file touched while a removal is held may be the other half of
                            // a move: hold the removal until it has settled.
                            if !gone.is_empty() {
                                gone_due = Some(now + gone_hold(&settings, true));
                            }
                            settler.note(&path, kind.is_strong(), now);
                        }
                        // A link or a non-UTF-8 name: quarantined at once.
                        Some(Found::Rejected { rel, reason }) => {
                            send(Work::Op(Input::Observe(Observation::Rejected { rel, reason, size: 0, mtime_ns: 0 })));
                        }
                        None => {}
                    },
                    WatchEvent::Removed(path) => {
                        settler.forget(&path);
                        strong_at.remove(&path);
                        // Often half of a move: held a moment, so that it reaches the engine in
                        // the same batch as the arrival (the row is handed over, never invalid).
                        gone.push(Observation::Gone(lossy(&path)));
                        // The arrival may have been seen first (listed in a new folder, say)
                        // and still be settling: then hold until it is ready.
                        gone_due.get_or_insert(now + gone_hold(&settings, !settler.is_empty()));
                    }
                    WatchEvent::RemovedDir(path) => {
                        send(Work::Op(Input::Observe(Observation::FolderGone(lossy(&path)))));
                    }
                    WatchEvent::Rescan { reason } => {
                        log::warn!("rescanning the whole tree: {reason}");
                        send(Work::Rescan);
                    }
                }
            }
            _ = sleep_until(gone_due) => {
                for o in gone.drain(..) {
                    send(Work::Op(Input::Observe(o)));
                }
                gone_due = None;
            }
            _ = sleep_until(settle_at) => {
                let now = Instant::now();
                // Probes touch the disk: off the event loop's thread.
                let probe_root = root.clone();
                let (back, decisions) = tokio::task::spawn_blocking(move || {
                    let decisions = settler.poll(now, |p| source::probe(&probe_root, p));
                    (settler, decisions)
                })
                .await?;
                settler = back;
                for decision in decisions {
                    match decision {
                        Settled::Ready { path, .. } => {
                            let seen = strong_at.remove(&path).unwrap_or(now);
                            // The other half of a move, if one is held, goes first: a batch
                            // that starts with a removal waits for what follows it, so the
                            // worker cannot take the arrival alone.
                            for o in gone.drain(..) {
                                send(Work::Op(Input::Observe(o)));
                            }
                            gone_due = None;
                            if let Some(rel) = rel_str(&path) {
                                send(Work::Op(Input::Load { rel, seen: Some(seen) }));
                            }
                        }
                        Settled::Quarantine { path, after_s, detail } => {
                            strong_at.remove(&path);
                            let (size, mtime_ns) = std::fs::symlink_metadata(root.join(&path))
                                .map(|m| (m.len(), crate::engine::stages::mtime_ns(&m)))
                                .unwrap_or((0, 0));
                            send(Work::Op(Input::Observe(Observation::Rejected {
                                rel: lossy(&path),
                                reason: Reason::StillIncomplete { after_s, detail },
                                size,
                                mtime_ns,
                            })));
                        }
                    }
                }
            }
            report = report_rx.recv() => {
                match report {
                    Some(Report::Reconciled(r)) => {
                        let now = Instant::now();
                        // Found by a listing, not by an event: probed at once, and ready at
                        // once when nothing has written it for a settle period (see Settler::found).
                        for rel in r.changed {
                            settler.found(Path::new(&rel), now, std::time::SystemTime::now());
                        }
                        for rel in r.removed {
                            send(Work::Op(Input::Observe(Observation::Gone(rel))));
                        }
                        for o in r.rejected {
                            send(Work::Op(Input::Observe(o)));
                        }
                    }
                    Some(Report::Batch(done)) => {
                        ingested += (done.counts.new_rows + done.counts.attached) as u64;
                        for rel in done.reread {
                            send(Work::Op(Input::Load { rel, seen: None }));
                        }
                    }
                    None => anyhow::bail!("the ingest worker stopped: see the error above"),
                }
            }
            _ = sleep_until(next_rescan) => {
                send(Work::Rescan);
                next_rescan = rescan_deadline(&settings);
            }
            _ = unwatched_tick.tick() => {
                // Folders a watch limit left unwatched: try again, and rescan meanwhile (after
                // a success too: their events until now were missed).
                if !watcher.unwatched().is_empty() {
                    watcher.retry_unwatched();
                    *shared.unwatched.lock().unwrap_or_else(|e| e.into_inner()) = watcher.unwatched();
                    send(Work::Rescan);
                }
            }
            _ = watchdog_tick.tick(), if watchdog.is_some() => {
                // Fed only while the worker makes progress (or waits idle).
                let age = now_ms() - shared.alive_ms.load(Ordering::Relaxed);
                if (age as u128) < watchdog.unwrap().as_millis() {
                    let _ = sd_notify::notify(&[NotifyState::Watchdog]);
                } else {
                    log::error!("ingest worker has made no progress for {age} ms; not feeding the watchdog");
                }
            }
        }
        shared.settling.store(settler.len(), Ordering::Relaxed);
        if pending_listed.elapsed() > Duration::from_millis(500) {
            let mut list = settler.pending();
            list.truncate(200);
            *shared.pending.lock().unwrap_or_else(|e| e.into_inner()) = list;
            let unwatched = watcher.unwatched();
            crate::metrics::unwatched(unwatched.len());
            *shared.unwatched.lock().unwrap_or_else(|e| e.into_inner()) = unwatched;
            pending_listed = Instant::now();
        }
        let queue = settler.len() + shared.queued.load(Ordering::Relaxed);
        let text = match &*shared.fault.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => format!("WRITING FAILS, retrying: {e}; queue {queue}, ingested {ingested}"),
            None => format!("queue {queue}, ingested {ingested}, on {device}"),
        };
        let _ = sd_notify::notify(&[NotifyState::Status(&text)]);
    }

    for o in gone.drain(..) {
        send(Work::Op(Input::Observe(o)));
    }
    let _ = sd_notify::notify(&[NotifyState::Stopping]);
    watcher.stop();
    drop(work_tx);
    // The worker drains what is queued, commits, closes the outputs.
    let joined = tokio::task::spawn_blocking(move || worker.join()).await?;
    match joined {
        Ok(result) => result,
        Err(_) => anyhow::bail!("the ingest worker panicked"),
    }
}

/// How often folders a watch limit left unwatched are retried (and the tree rescanned).
const UNWATCHED_RETRY: Duration = Duration::from_secs(10);

/// How long a removal waits for the arrival that would make it a move.
const GONE_HOLD: Duration = Duration::from_millis(50);

/// How long removals are held: [`GONE_HOLD`], and while files are settling (one of them may be
/// the other half of a move) long enough for them to be ready; a file that becomes ready sends
/// the held removals with it.
fn gone_hold(settings: &Settings, settling: bool) -> Duration {
    if settling {
        GONE_HOLD + 2 * Duration::from_millis(settings.ingest.settle_ms)
    } else {
        GONE_HOLD
    }
}

fn rescan_deadline(settings: &Settings) -> Option<Instant> {
    (settings.ingest.rescan_interval_s > 0)
        .then(|| Instant::now() + Duration::from_secs(settings.ingest.rescan_interval_s))
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}

fn rel_str(path: &Path) -> Option<String> {
    crate::identity::rel_string(path).ok()
}

/// A relative path as the manifest keys it (lossy only for names that are not UTF-8).
fn lossy(path: &Path) -> String {
    rel_str(path).unwrap_or_else(|| path.to_string_lossy().to_string())
}

/// Recent completion-to-commit latencies and errors, for `status`.
struct Recent {
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

/// A failure to write (disk full, I/O error, the featuriser failing) the worker is riding out.
struct Fault {
    since_ms: i64,
    error: String,
    /// The next attempt to reopen the outputs.
    retry_at: Instant,
    /// Writing failed (not the featuriser): the disk is probed every second ([`disk_answers`]),
    /// and the next attempt comes as soon as a probe that failed succeeds again, not only at
    /// `retry_at` (which grows to 30 s while attempts fail).
    disk: bool,
    /// A probe failed since the last attempt.
    probe_failed: bool,
}

/// Replace this process with a fresh image of itself (same PID, arguments and environment):
/// how the service reopens its HDF5 files after a failed write (see
/// [`crate::output::hdf5::failed_in_this_process`]). What was not committed is lost as in a
/// kill, and found again by the start's comparison of the tree with the manifest; descriptors
/// (the writer locks among them) close on exec. Returns only if the exec fails.
fn reexec() {
    use std::os::unix::process::CommandExt;
    log::warn!(
        "the disk answers again: restarting the service's process to reopen its HDF5 files (an HDF5 file cannot be reopened safely in a process where writing it failed)"
    );
    let e = std::process::Command::new("/proc/self/exe")
        .args(std::env::args_os().skip(1))
        .exec();
    log::error!("cannot restart the process ({e}); reopening in place");
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

/// The ingest worker: drives the engine, closes it when idle, and rides out write failures.
struct Worker {
    settings: Settings,
    shared: Arc<Shared>,
    report: mpsc::UnboundedSender<Report>,
    /// None while closed (idle, or after a failure).
    engine: Option<Engine>,
    /// The warm featuriser of a closed engine.
    warm: Option<Box<dyn crate::features::Featuriser>>,
    /// The manifest of an engine abandoned after a failure, kept for the next open (dropping
    /// it while the disk fails is what sled handles worst).
    kept_manifest: Option<Arc<crate::engine::manifest::Manifest>>,
    /// The last status snapshot could not be written to the state folder (warned once).
    snapshot_failing: bool,
    /// The comparison of the tree with the manifest, running beside the ingest on a thread of
    /// its own (start-up, periodic rescans): new recordings are taken meanwhile.
    reconciling: Option<std::thread::JoinHandle<()>>,
    /// A rescan was asked for while one ran: run another when it ends.
    rescan_again: bool,
    /// When the disk was last probed while writing failed.
    last_probe: Instant,
    fault: Option<Fault>,
    /// Failures since the last batch committed: the backoff grows with them.
    failures: u32,
    /// Changes dropped while writing failed: the rescan after recovery finds them again.
    dropped: usize,
    recent: Recent,
    ingested: u64,
    /// The manifest's part of the last snapshot (kept while the engine is closed).
    last_report: status::StatusReport,
    /// The label names as of the last snapshot (every one gets an `ailhd_rows` series).
    labels: Vec<String>,
    dirty: bool,
    last_snapshot: Instant,
    snapshot_cost: Duration,
    last_work: Instant,
    device: String,
}

impl Worker {
    /// Backoff before reopening after the n-th failure in a row: 1, 2, 4 ... 30 s.
    fn backoff(failures: u32) -> Duration {
        Duration::from_secs((1u64 << failures.saturating_sub(1).min(5)).min(30))
    }

    /// Open the engine if it is closed, with the warm featuriser when there is one.
    fn open(&mut self) -> anyhow::Result<&mut Engine> {
        if self.engine.is_none() && crate::output::hdf5::failed_in_this_process() {
            // Never reopen in place after a failed HDF5 call (see `reexec`).
            if !disk_answers(&self.settings) {
                anyhow::bail!("the output or state folder does not take a synced write yet");
            }
            reexec();
        }
        if self.engine.is_none() {
            let warm = match self.warm.take() {
                Some(f) => crate::engine::Warm::Keep(f),
                None => crate::engine::Warm::Build(self.settings.ingest.device),
            };
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
        if let Some(engine) = self.engine.take() {
            let (warm, manifest) = engine.abandon();
            self.warm = warm;
            self.kept_manifest = Some(manifest);
        }
        crate::metrics::outputs_open(false);
        self.dirty = true;
        self.snapshot();
    }

    /// Reopen after a failure; on success, compare the tree with the manifest, which finds
    /// every change dropped meanwhile.
    fn retry(&mut self) {
        let result = self.open().and_then(|engine| engine.reconcile());
        match result {
            Ok(r) => {
                if !r.changed.is_empty() || !r.removed.is_empty() {
                    log::info!(
                        "rescan: {} new or changed, {} gone",
                        r.changed.len(),
                        r.removed.len()
                    );
                }
                let f = self.fault.take().expect("retrying a fault");
                *self.shared.fault.lock().unwrap_or_else(|p| p.into_inner()) = None;
                crate::metrics::write_failing(false);
                log::warn!(
                    "writing works again after {:.0} s; {} changes seen meanwhile are taken up again",
                    (now_ms() - f.since_ms) as f64 / 1e3,
                    self.dropped
                );
                self.dropped = 0;
                let _ = self.report.send(Report::Reconciled(r));
                self.dirty = true;
            }
            Err(e) => self.fail(e),
        }
    }

    /// Compare the tree with the manifest on a thread of its own, at a lower CPU priority,
    /// while recordings keep arriving; what it finds reaches the event loop, which hands it on
    /// by the same rules as the watcher's events. One at a time: asked again meanwhile, it runs
    /// again once this one ends.
    fn start_reconcile(&mut self) {
        if self.reconciling.as_ref().is_some_and(|h| !h.is_finished()) {
            self.rescan_again = true;
            return;
        }
        self.rescan_again = false;
        self.end_reconcile();
        let manifest = match self.open() {
            Ok(engine) => engine.manifest_handle(),
            Err(e) => return self.fail(e),
        };
        let settings = self.settings.clone();
        let report = self.report.clone();
        let spawned = std::thread::Builder::new()
            .name("ailhd-rescan".into())
            .spawn(move || {
                // SAFETY: plain system calls about the calling thread.
                unsafe {
                    let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                    libc::setpriority(libc::PRIO_PROCESS, tid, 10);
                }
                // What it finds goes on at once, part by part: new recordings first.
                let (mut changed, mut gone) = (0, 0);
                let result = crate::engine::reconcile_with(&settings, &manifest, &mut |part| {
                    changed += part.changed.len();
                    gone += part.removed.len();
                    let _ = report.send(Report::Reconciled(part));
                });
                match result {
                    Ok(()) => {
                        if changed > 0 || gone > 0 {
                            log::info!("rescan: {changed} new or changed, {gone} gone");
                        }
                    }
                    Err(e) => {
                        log::error!("rescan failed: {e:#}");
                        crate::metrics::error("rescan");
                    }
                }
            });
        match spawned {
            Ok(h) => self.reconciling = Some(h),
            Err(e) => log::error!("rescan failed: cannot start its thread: {e}"),
        }
    }

    /// Wait for a running rescan (before the manifest is closed).
    fn end_reconcile(&mut self) {
        if let Some(h) = self.reconciling.take() {
            let _ = h.join();
        }
    }

    /// Idle long enough: commit, close the files cleanly (plain readers open them), keep the
    /// featuriser warm for the next file.
    fn close_idle(&mut self) {
        // The manifest is closed with the engine: no rescan may hold it.
        self.end_reconcile();
        self.snapshot();
        let Some(engine) = self.engine.take() else {
            return;
        };
        match engine.suspend() {
            Ok(f) => {
                self.warm = Some(f);
                crate::metrics::outputs_open(false);
                log::info!(
                    "idle for {} s: outputs closed (plain HDF5 readers open them); the next file reopens them",
                    self.settings.ingest.idle_close_s
                );
                self.dirty = true;
                self.snapshot();
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

    fn snapshot(&mut self) {
        if let Some(engine) = &self.engine {
            match status::collect(engine.manifest(), engine.labels(), &self.settings) {
                Ok(r) => self.last_report = r,
                Err(e) => log::warn!("cannot read the manifest for the status snapshot: {e:#}"),
            }
            self.labels = engine.labels().to_vec();
            for (stage, secs) in engine.times().seconds() {
                crate::metrics::stage_seconds(stage, secs);
            }
        }
        let mut r = self.last_report.clone();
        crate::metrics::record_status(&r, &self.labels);
        let shared = &self.shared;
        let queue = shared.settling.load(Ordering::Relaxed) + shared.queued.load(Ordering::Relaxed);
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
}

fn worker_loop(
    engine: anyhow::Result<Engine>,
    settings: Settings,
    rx: crossbeam_channel::Receiver<Work>,
    report: mpsc::UnboundedSender<Report>,
    shared: Arc<Shared>,
) -> anyhow::Result<()> {
    let labels = settings.labels.names.clone();
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
        snapshot_failing: false,
        reconciling: None,
        rescan_again: false,
        last_probe: Instant::now(),
        fault: None,
        failures: 0,
        dropped: 0,
        recent: Recent {
            latencies: VecDeque::new(),
            errors: VecDeque::new(),
        },
        ingested: 0,
        last_report: status::StatusReport::default(),
        labels,
        dirty: true,
        last_snapshot: Instant::now() - Duration::from_secs(3600),
        snapshot_cost: Duration::ZERO,
        last_work: Instant::now(),
    };
    match engine {
        Ok(e) => {
            crate::metrics::outputs_open(true);
            w.engine = Some(e);
        }
        // Only a full or failing disk gets here (serve() stops on anything else): wait for it.
        Err(e) => w.fail(e),
    }
    let mut deferred: VecDeque<Work> = VecDeque::new();
    loop {
        w.shared.alive_ms.store(now_ms(), Ordering::Relaxed);
        w.take_completed();
        if w.rescan_again
            && w.fault.is_none()
            && w.reconciling.as_ref().is_none_or(|h| h.is_finished())
        {
            w.start_reconcile();
        }
        let due = match &mut w.fault {
            Some(f) if Instant::now() >= f.retry_at => true,
            Some(f) if f.disk && w.last_probe.elapsed() >= Duration::from_secs(1) => {
                w.last_probe = Instant::now();
                let answers = disk_answers(&w.settings);
                let back = answers && f.probe_failed;
                f.probe_failed = !answers;
                back
            }
            _ => false,
        };
        if due {
            w.retry();
        }
        let first = match deferred.pop_front() {
            Some(work) => work,
            None => {
                // Batches in flight: wait for them a little, so their figures come in promptly.
                let wait = match &w.fault {
                    _ if w.in_flight() > 0 => Duration::from_millis(5),
                    Some(f) => f
                        .retry_at
                        .saturating_duration_since(Instant::now())
                        .min(Duration::from_secs(1)),
                    None => Duration::from_secs(1),
                };
                match rx.recv_timeout(wait) {
                    Ok(work) => work,
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                        if w.in_flight() > 0 {
                            // Never block on the engine here: new files must be taken at once.
                            continue;
                        }
                        // Idle: a good moment for the status snapshot, or to close the files.
                        if w.dirty {
                            w.snapshot();
                        }
                        let idle_close = w.settings.ingest.idle_close_s;
                        if w.engine.is_some()
                            && idle_close > 0
                            && w.last_work.elapsed() >= Duration::from_secs(idle_close)
                        {
                            w.close_idle();
                        }
                        continue;
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
                }
            }
        };
        match first {
            Work::Op(op) => {
                w.last_work = Instant::now();
                let loads = |o: &Input| matches!(o, Input::Load { .. });
                if w.fault.is_some() {
                    // Nothing can be written: the rescan after recovery takes it up again.
                    if loads(&op) {
                        w.shared.queued.fetch_sub(
                            1.min(w.shared.queued.load(Ordering::Relaxed)),
                            Ordering::Relaxed,
                        );
                    }
                    w.dropped += 1;
                    continue;
                }
                // Micro-batch: everything already queued, up to max_batch_files; while files are
                // still settling, wait up to max_batch_latency_ms after the first for more.
                let started = Instant::now();
                let deadline =
                    started + Duration::from_millis(w.settings.ingest.max_batch_latency_ms);
                // A removal is often half of a move whose other half (the file arriving
                // elsewhere) is a moment behind it: wait for it, so the row is handed over in one
                // batch and never shows as invalid in between.
                let removal = matches!(
                    op,
                    Input::Observe(Observation::Gone(_) | Observation::FolderGone(_))
                );
                let mut ops = vec![op];
                while ops.len() < w.settings.ingest.max_batch_files {
                    let next = match rx.try_recv() {
                        Ok(work) => Some(work),
                        Err(_)
                            if (removal || w.shared.settling.load(Ordering::Relaxed) > 0)
                                && Instant::now() < deadline =>
                        {
                            rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                                .ok()
                        }
                        Err(_) => None,
                    };
                    match next {
                        Some(Work::Op(op)) => ops.push(op),
                        Some(other) => {
                            deferred.push_back(other);
                            break;
                        }
                        None => break,
                    }
                }
                let n_loads = ops.iter().filter(|o| loads(o)).count();
                w.shared.queued.fetch_sub(
                    n_loads.min(w.shared.queued.load(Ordering::Relaxed)),
                    Ordering::Relaxed,
                );
                let n_ops = ops.len();
                let submitted = w.open().and_then(|engine| engine.submit(ops));
                if let Err(e) = submitted {
                    w.dropped += n_ops;
                    w.fail(e);
                }
                w.dirty = true;
            }
            Work::Rescan => {
                w.dirty = true;
                if w.fault.is_some() {
                    continue; // the recovery rescans
                }
                w.start_reconcile();
            }
            Work::Reload(new) => {
                if let Some(engine) = w.engine.as_mut() {
                    engine.update_live_settings(&new);
                }
                w.settings.ingest = new.ingest.clone();
            }
        }
        // Snapshot at most every 2 s, and never more than ~10% of the time.
        if w.dirty && w.last_snapshot.elapsed() > (w.snapshot_cost * 10).max(Duration::from_secs(2))
        {
            let t = Instant::now();
            w.snapshot();
            w.snapshot_cost = t.elapsed();
        }
    }
    w.end_reconcile();
    w.wait_all();
    w.snapshot();
    if let Some(f) = &w.fault {
        log::warn!(
            "stopping while writing fails ({}): what was not recorded is ingested at the next start",
            f.error
        );
    }
    let Some(engine) = w.engine.take() else {
        return Ok(());
    };
    let stages: Vec<String> = engine
        .times()
        .seconds()
        .iter()
        .map(|(k, v)| format!("{k} {v:.3}s"))
        .collect();
    log::info!(
        "stopping: {} files ingested this run; time per stage: {}",
        w.ingested,
        stages.join(", ")
    );
    engine.finish()?;
    // The manifest is closed: keep the report for `status` of the stopped service.
    if let Err(e) = status::save_stopped(&w.settings, &w.last_report) {
        log::debug!("cannot keep the status report for the stopped service: {e}");
    }
    Ok(())
}
