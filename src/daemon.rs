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
    let _metrics = crate::metrics::Exporter::start(&settings.metrics)?;
    let engine = Engine::open_live(&settings, settings.ingest.device)?;
    let device = engine.device().to_string();
    crate::metrics::device(&device);
    let root = std::path::absolute(&settings.paths.recordings)?;

    // Watch first, then scan: nothing falls between the two.
    let (watch_tx, mut watch_rx) = mpsc::unbounded_channel::<WatchEvent>();
    let watcher = Watcher::start(&root, watch_tx)?;

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
    loop {
        let settle_at = settler.next_deadline();
        tokio::select! {
            _ = &mut shutdown => break,
            _ = hup.recv() => {
                match Settings::load(config_path.as_deref()) {
                    Ok(new) => {
                        if new.paths != settings.paths || new.features != settings.features || new.labels != settings.labels
                            || new.splits != settings.splits || new.outputs != settings.outputs {
                            log::warn!("reload: only [ingest] settings change live; paths, labels, splits, features and outputs need a restart (and features a rebuild)");
                        }
                        settler = Settler::new(Duration::from_millis(new.ingest.settle_ms), Duration::from_secs(new.ingest.quarantine_after_s));
                        send(Work::Rescan); // what was settling is picked up again by the rescan
                        settings.ingest = new.ingest.clone();
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
                        gone_due.get_or_insert(now + GONE_HOLD);
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
                            if let Some(rel) = rel_str(&path) {
                                send(Work::Op(Input::Load { rel, seen: Some(seen) }));
                            }
                            // The other half of a move, if one is held.
                            for o in gone.drain(..) {
                                send(Work::Op(Input::Observe(o)));
                            }
                            gone_due = None;
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
                        if !r.changed.is_empty() || !r.removed.is_empty() {
                            log::info!("rescan: {} new or changed, {} gone", r.changed.len(), r.removed.len());
                        }
                        for rel in r.changed {
                            settler.note(Path::new(&rel), false, now);
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
            pending_listed = Instant::now();
        }
        let queue = settler.len() + shared.queued.load(Ordering::Relaxed);
        let _ = sd_notify::notify(&[NotifyState::Status(&format!(
            "queue {queue}, ingested {ingested}, on {device}"
        ))]);
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

/// How long a removal waits for the arrival that would make it a move.
const GONE_HOLD: Duration = Duration::from_millis(50);

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

fn worker_loop(
    mut engine: Engine,
    mut settings: Settings,
    rx: crossbeam_channel::Receiver<Work>,
    report: mpsc::UnboundedSender<Report>,
    shared: Arc<Shared>,
) -> anyhow::Result<()> {
    let mut recent = Recent {
        latencies: VecDeque::new(),
        errors: VecDeque::new(),
    };
    let mut ingested = 0u64;
    let mut last_snapshot = Instant::now() - Duration::from_secs(3600);
    let mut snapshot_cost = Duration::ZERO;
    let mut dirty = true;
    let mut deferred: VecDeque<Work> = VecDeque::new();
    // What the engine reports done: figures for `status`, rereads, the queue depth.
    let on_done = |done: Done, recent: &mut Recent, ingested: &mut u64| {
        *ingested += (done.counts.new_rows + done.counts.attached) as u64;
        crate::metrics::file_ingested((done.counts.new_rows + done.counts.attached) as u64);
        for l in &done.latencies {
            recent.push_latency(l.as_secs_f64() * 1e3);
            crate::metrics::commit_latency(l.as_secs_f64());
        }
        for (rel, reason) in &done.quarantined {
            crate::metrics::file_quarantined(&reason.to_string());
            log::warn!(file = rel.as_str(), reason = reason.to_string().as_str(); "quarantined {rel}: {reason}");
            recent.push_error(format!("{rel}: {reason}"));
        }
        log::debug!(
            "batch: {} new rows, {} attached, {} unchanged, {} removed, {} quarantined",
            done.counts.new_rows,
            done.counts.attached,
            done.counts.unchanged,
            done.counts.removed,
            done.counts.quarantined
        );
        let _ = report.send(Report::Batch(done));
    };
    loop {
        shared.alive_ms.store(now_ms(), Ordering::Relaxed);
        for done in engine.completed()? {
            on_done(done, &mut recent, &mut ingested);
            dirty = true;
        }
        let first = match deferred.pop_front() {
            Some(w) => w,
            None => {
                // Batches in flight: wait for them a little, so their figures come in promptly.
                let wait = if engine.in_flight() > 0 { 5 } else { 1000 };
                match rx.recv_timeout(Duration::from_millis(wait)) {
                    Ok(w) => w,
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                        if engine.in_flight() > 0 {
                            // Never block on the engine here: new files must be taken at once.
                            continue;
                        }
                        // Idle: a good moment for the status snapshot.
                        if dirty {
                            write_snapshot(&engine, &settings, &shared, &recent, ingested);
                            dirty = false;
                        }
                        continue;
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
                }
            }
        };
        match first {
            Work::Op(op) => {
                // Micro-batch: everything already queued, up to max_batch_files; while files are
                // still settling, wait up to max_batch_latency_ms after the first for more.
                let started = Instant::now();
                let deadline =
                    started + Duration::from_millis(settings.ingest.max_batch_latency_ms);
                // A removal is often half of a move whose other half (the file arriving
                // elsewhere) is a moment behind it: wait for it, so the row is handed over in one
                // batch and never shows as invalid in between.
                let removal = matches!(
                    op,
                    Input::Observe(Observation::Gone(_) | Observation::FolderGone(_))
                );
                let mut ops = vec![op];
                while ops.len() < settings.ingest.max_batch_files {
                    let next = match rx.try_recv() {
                        Ok(w) => Some(w),
                        Err(_)
                            if (removal || shared.settling.load(Ordering::Relaxed) > 0)
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
                let n_loads = ops
                    .iter()
                    .filter(|o| matches!(o, Input::Load { .. }))
                    .count();
                if let Err(e) = engine.submit(ops) {
                    // Outputs or manifest failed (disk full, I/O error): nothing of the batch
                    // was recorded, so a restart ingests it again. Stop here.
                    log::error!("ingest failed, stopping: {e:#}");
                    crate::metrics::error("write");
                    return Err(e);
                }
                shared.queued.fetch_sub(
                    n_loads.min(shared.queued.load(Ordering::Relaxed)),
                    Ordering::Relaxed,
                );
                dirty = true;
            }
            Work::Rescan => {
                // The comparison reads the manifest: let what is in flight land first.
                for done in engine.wait()? {
                    on_done(done, &mut recent, &mut ingested);
                }
                match engine.reconcile() {
                    Ok(r) => {
                        let _ = report.send(Report::Reconciled(r));
                    }
                    Err(e) => {
                        log::error!("rescan failed: {e:#}");
                        crate::metrics::error("rescan");
                        recent.push_error(format!("rescan: {e:#}"));
                    }
                }
            }
            Work::Reload(new) => {
                engine.update_live_settings(&new);
                settings.ingest = new.ingest.clone();
            }
        }
        // Snapshot at most every 2 s, and never more than ~10% of the time.
        if dirty && last_snapshot.elapsed() > (snapshot_cost * 10).max(Duration::from_secs(2)) {
            let t = Instant::now();
            write_snapshot(&engine, &settings, &shared, &recent, ingested);
            snapshot_cost = t.elapsed();
            last_snapshot = Instant::now();
            dirty = false;
        }
    }
    for done in engine.wait()? {
        on_done(done, &mut recent, &mut ingested);
    }
    write_snapshot(&engine, &settings, &shared, &recent, ingested);
    let stages: Vec<String> = engine
        .times()
        .seconds()
        .iter()
        .map(|(k, v)| format!("{k} {v:.3}s"))
        .collect();
    log::info!(
        "stopping: {ingested} files ingested this run; time per stage: {}",
        stages.join(", ")
    );
    engine.finish().map(drop)
}

fn write_snapshot(
    engine: &Engine,
    settings: &Settings,
    shared: &Shared,
    recent: &Recent,
    ingested: u64,
) {
    let result = (|| -> anyhow::Result<()> {
        let mut r = status::collect(engine.manifest(), engine.labels(), settings)?;
        crate::metrics::record_status(&r);
        crate::metrics::pending(shared.settling.load(Ordering::Relaxed));
        crate::metrics::queue_depth(
            shared.settling.load(Ordering::Relaxed) + shared.queued.load(Ordering::Relaxed),
        );
        for (stage, secs) in engine.times().seconds() {
            crate::metrics::stage_seconds(stage, secs);
        }
        r.service = Some(ServiceStatus {
            pid: std::process::id(),
            device: engine.device().to_string(),
            queue_depth: shared.settling.load(Ordering::Relaxed)
                + shared.queued.load(Ordering::Relaxed),
            ingested,
            latency_ms_p50: recent.percentile(0.5),
            latency_ms_p90: recent.percentile(0.9),
            latency_ms_p99: recent.percentile(0.99),
            last_errors: recent.errors.iter().cloned().collect(),
            pending: shared
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            updated_ms: now_ms(),
        });
        let path = status::snapshot_path(settings);
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&r)?)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    })();
    if let Err(e) = result {
        log::warn!("cannot write the status snapshot: {e:#}");
    }
}
