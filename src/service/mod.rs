//! `ailhd run`: the ingestion service. Two threads of control with one job each:
//!
//! - the event loop (tokio, this module) follows the tree (watch -> settle), signals (SIGTERM
//!   drains and exits, SIGHUP reloads), timers (safety rescan, systemd watchdog) and tells
//!   systemd how it is doing (READY, STATUS, STOPPING);
//! - the ingest worker ([`worker`]: a thread driving the [`Engine`]: manifest, outputs, warm
//!   featuriser) gathers complete files into micro-batches by the rules of [`batch`] (the cap,
//!   a removal held for its arrival, group commit) and hands them to the engine, whose stages
//!   overlap: the next batch loads while the previous one is featurised and committed. It keeps
//!   the status snapshot. What the two share is in [`shared`].
//!
//! Shutdown comes in as a future, so tests stop the service the way systemd does.

pub mod batch;
mod shared;
mod slow;
mod unreadable;
mod wait;
mod worker;

pub use wait::{wait_for_gpu, wait_for_paths, wait_until_startable};

use self::shared::{Report, Shared, Work};
use crate::config::Settings;
use crate::engine::manifest::now_ms;
use crate::engine::outcome::{Observation, Reason};
use crate::engine::{Engine, Input};
use crate::lock::WriterLocks;
use crate::source::settle::{Settled, Settler};
use crate::source::watch::{WatchEvent, Watcher};
use crate::source::{self, Found};
use anyhow::Context;
use sd_notify::NotifyState;
use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Set by the signal handler itself as a SIGTERM or SIGINT arrives (the event loop learns of it
/// a moment later): the worker then no longer replaces the process with a fresh image of
/// itself (`worker::reexec`), which would not know of the stop and go on running.
pub(crate) static STOP_ASKED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// The thread replacing the process with a fresh image (`worker::reexec`), 0 when none is: it
/// holds the stop signals blocked from before it looks at [`STOP_ASKED`] until `execve`, and a
/// stop signal handled meanwhile by another thread is sent on to it, where it stays pending
/// across `execve`; the fresh image receives it once its own handlers are in place.
pub(crate) static REEXEC_TID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// What a stop signal does at once, inside its handler (async-signal-safe: atomics and one
/// system call).
fn on_stop_signal(sig: libc::c_int) {
    STOP_ASKED.store(true, Ordering::SeqCst);
    let tid = REEXEC_TID.load(Ordering::SeqCst);
    if tid != 0 {
        // SAFETY: tgkill sends a signal to a thread of this process; nothing else is touched.
        unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, sig) };
    }
}

/// Hold (true) or let through (false) the service's signals on the calling thread: around
/// `worker::reexec`'s last look at [`STOP_ASKED`] and its `execve`.
pub(crate) fn hold_signals_here(hold: bool) {
    signal_mask(if hold {
        libc::SIG_BLOCK
    } else {
        libc::SIG_UNBLOCK
    });
}

/// A process started again in place (`worker::reexec`, `wait_for_gpu`) runs `/proc/self/exe`,
/// and the kernel names it after that file: `exe` in `ps`, `top` and the journal's `_COMM`. Name
/// it after the program it was started as (its first argument), as it was before.
pub fn name_after_program() {
    let Some(program) = std::env::args_os().next() else {
        return;
    };
    let program = std::path::PathBuf::from(program);
    let Some(name) = program.file_name() else {
        return;
    };
    // The kernel keeps 15 bytes of a name.
    let mut name: Vec<u8> = name.as_encoded_bytes().iter().copied().take(15).collect();
    if name.contains(&0) {
        return;
    }
    name.push(0);
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr()) };
}

/// The signals the service answers: SIGTERM and SIGINT stop it, SIGHUP reloads.
pub(super) const ANSWERED: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// Hold the service's signals from the first moment of `ailhd run` (`main`, right after the
/// command line is parsed) until [`run`] has its handlers: a `systemctl stop` or `reload` while
/// the process is still loading its configuration then waits for them rather than killing it
/// (the default action of all three).
pub fn hold_signals() {
    signal_mask(libc::SIG_BLOCK);
}

fn signal_mask(how: libc::c_int) {
    let set = answered_set();
    // SAFETY: an initialised signal set, and the calling thread's own mask.
    unsafe { libc::pthread_sigmask(how, &set, std::ptr::null_mut()) };
}

/// The signals the service answers ([`ANSWERED`]), as a signal set.
pub(super) fn answered_set() -> libc::sigset_t {
    // SAFETY: a local signal set, initialised by sigemptyset before it is added to.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in ANSWERED {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Entry point of `ailhd run`: a runtime, the service, and the process signals as shutdown.
pub fn run(settings: Settings, config_path: Option<PathBuf>) -> anyhow::Result<()> {
    // The settle stage asks the kernel whether a writer holds a recording by taking a read lease
    // for an instant (`source::held_for_writing`); a writer opening the file in that instant
    // makes the kernel send SIGIO, whose default action would end the service.
    // SAFETY: setting a signal's disposition to "ignore" touches no memory of ours.
    unsafe { libc::signal(libc::SIGIO, libc::SIG_IGN) };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the event loop")?;
    rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        // Every handler in place before the signals held since `main` are let through: one that
        // came in meanwhile is delivered now, to its handler.
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let hup = signal(SignalKind::hangup())?;
        for stop in [libc::SIGTERM, libc::SIGINT] {
            // Safety: the action only stores to an atomic (async-signal-safe).
            unsafe { signal_hook_registry::register(stop, move || on_stop_signal(stop)) }
                .context("cannot install the stop signals' handler")?;
        }
        signal_mask(libc::SIG_UNBLOCK);
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => log::info!("SIGTERM: draining and stopping"),
                _ = int.recv() => log::info!("interrupted: draining and stopping"),
            }
        };
        serve(settings, config_path, hup, shutdown).await
    })
}

/// The service until `shutdown` completes; `hup` is the reload signal.
pub async fn serve(
    settings: Settings,
    config_path: Option<PathBuf>,
    mut hup: tokio::signal::unix::Signal,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    for p in crate::staging::remove_stale(&settings)? {
        log::warn!("removed {}, left by an interrupted rebuild", p.display());
    }
    let _lock = WriterLocks::acquire(&settings, "run")?;
    crate::engine::manifest::set_cache_mb(settings.ingest.manifest_cache_mb);
    let _metrics = crate::metrics::Exporter::start(&settings.metrics)?;
    let root = std::path::absolute(&settings.paths.recordings)?;
    let (watch_tx, mut watch_rx) = mpsc::unbounded_channel::<WatchEvent>();
    let (engine, watcher, listed) = open_and_watch(&settings, &root, watch_tx.clone())?;
    let device = engine
        .as_ref()
        .map_or_else(|_| "-".to_string(), |e| e.device().to_string());
    crate::metrics::device(&device);

    let shared = Arc::new(Shared::default());
    shared.alive_ms.store(now_ms(), Ordering::Relaxed);
    let (work_tx, work_rx) = crossbeam_channel::unbounded::<Work>();
    let (report_tx, mut report_rx) = mpsc::unbounded_channel::<Report>();
    let worker = {
        let (shared, settings) = (shared.clone(), settings.clone());
        let work =
            move || worker::worker_loop(engine, listed, settings, work_rx, report_tx, shared);
        std::thread::Builder::new()
            .name("ailhd-ingest".into())
            .spawn(work)?
    };
    *shared.unwatched.lock().unwrap_or_else(|e| e.into_inner()) = watcher.unwatched();
    let mut ev = EventLoop {
        settler: new_settler(&settings),
        next_rescan: rescan_deadline(&settings),
        settings,
        config_path,
        strong_at: HashMap::new(),
        work_tx,
        shared,
        watcher,
        ingested: 0,
        pending_listed: Instant::now(),
        listed_changes: 0,
        unwatched_listed: Instant::now(),
        device,
        unreadable: unreadable::Unreadable::default(),
        root_id: folder_id(&root),
        watch_tx,
        root,
    };
    ev.ready();

    let watchdog = sd_notify::watchdog_enabled();
    tokio::pin!(shutdown);
    let mut watchdog_tick =
        tokio::time::interval(watchdog.map(|d| d / 2).unwrap_or(Duration::from_secs(3600)));
    let mut unwatched_tick = tokio::time::interval(UNWATCHED_RETRY);
    loop {
        let settle_at = ev.settler.next_deadline();
        let rescan_at = ev.next_rescan;
        let retry_at = ev.unreadable.next_due();
        let listing_at = ev.listing_due();
        tokio::select! {
            _ = &mut shutdown => break,
            _ = hup.recv() => ev.reload(),
            event = watch_rx.recv() => {
                let Some(event) = event else { anyhow::bail!("the watcher stopped unexpectedly") };
                ev.on_watch(event);
            }
            _ = sleep_until(settle_at) => ev.settle().await?,
            report = report_rx.recv() => {
                let Some(report) = report else {
                    anyhow::bail!("the ingest worker stopped: see the error above")
                };
                ev.on_report(report);
            }
            _ = sleep_until(rescan_at) => {
                ev.send(Work::Rescan);
                ev.next_rescan = rescan_deadline(&ev.settings);
            }
            _ = unwatched_tick.tick() => {
                ev.retry_unwatched();
                ev.check_root();
            }
            _ = sleep_until(retry_at) => ev.retry_unreadable(),
            // Nothing else to do: the list of pending files is taken below.
            _ = sleep_until(listing_at) => {}
            _ = watchdog_tick.tick(), if watchdog.is_some() => feed_watchdog(&ev.shared, watchdog),
        }
        ev.tell_systemd();
    }

    let _ = sd_notify::notify(&[NotifyState::Stopping]);
    let EventLoop {
        watcher, work_tx, ..
    } = ev;
    watcher.stop();
    drop(work_tx);
    // The worker drains what is queued, commits, closes the outputs.
    let joined = tokio::task::spawn_blocking(move || worker.join()).await?;
    match joined {
        Ok(result) => result,
        Err(_) => anyhow::bail!("the ingest worker panicked"),
    }
}

/// Open the engine (manifest, outputs, featuriser) while the watches are set up and the tree
/// is listed for the first comparison with the manifest: the three are the start-up's longest
/// steps on a large tree, and only the listing needs another (the watches, so that nothing falls
/// between the two). A full or failing disk does not stop the service from starting (the
/// engine's error goes to the worker, which says so and retries); anything else (outputs of
/// other feature settings, say) is an error. A listing that fails is made again, and its error
/// reported, by the rescan.
type Started = (
    anyhow::Result<Engine>,
    Watcher,
    Option<crate::source::Listing>,
);

fn open_and_watch(
    settings: &Settings,
    root: &Path,
    watch_tx: mpsc::UnboundedSender<WatchEvent>,
) -> anyhow::Result<Started> {
    let (engine, watcher, listed) = std::thread::scope(|scope| {
        let engine = scope.spawn(|| Engine::open_live(settings, settings.ingest.device));
        let watcher = Watcher::start(root, watch_tx);
        let t = Instant::now();
        let listed = watcher
            .is_ok()
            .then(|| crate::source::scan(root).ok())
            .flatten();
        if let Some(found) = &listed {
            log::debug!(
                "start: {} paths listed in {:.0} ms, beside the engine's opening",
                found.len(),
                t.elapsed().as_secs_f64() * 1e3
            );
        }
        let engine = engine.join().expect("opening the engine panicked");
        (engine, watcher, listed)
    });
    let engine = match engine {
        Err(e) if !crate::engine::may_pass(&e) => return Err(e),
        other => other,
    };
    let watcher = match watcher {
        // Not there (yet): the folder is watched once it appears (`EventLoop::check_root`).
        Err(_) if !root.exists() => Watcher::waiting(root),
        other => other?,
    };
    Ok((engine, watcher, listed))
}

fn new_settler(settings: &Settings) -> Settler {
    Settler::new(
        Duration::from_millis(settings.ingest.settle_ms),
        Duration::from_secs(settings.ingest.quarantine_after_s),
    )
}

/// Fed only while the worker makes progress (or waits idle).
fn feed_watchdog(shared: &Shared, watchdog: Option<Duration>) {
    let Some(limit) = watchdog else { return };
    let age = now_ms() - shared.alive_ms.load(Ordering::Relaxed);
    if (age as u128) < limit.as_millis() {
        let _ = sd_notify::notify(&[NotifyState::Watchdog]);
    } else {
        log::error!("ingest worker has made no progress for {age} ms; not feeding the watchdog");
    }
}

/// The event loop's state: the tree as the watcher and the settle stage see it, and what it
/// has handed to the worker.
struct EventLoop {
    root: PathBuf,
    settings: Settings,
    config_path: Option<PathBuf>,
    settler: Settler,
    /// When a strong event (a close after writing, a rename into the tree) saw each file: its
    /// latency clock.
    strong_at: HashMap<PathBuf, Instant>,
    work_tx: crossbeam_channel::Sender<Work>,
    shared: Arc<Shared>,
    watcher: Watcher,
    ingested: u64,
    pending_listed: Instant,
    /// The settle stage's [`changes`](source::settle::Settler::changes) when `status`'s list of
    /// pending files was last taken from it.
    listed_changes: u64,
    /// When the list of unwatched folders was last taken for `status` and the metrics.
    unwatched_listed: Instant,
    next_rescan: Option<Instant>,
    device: String,
    /// Files quarantined because reading them failed, to read again after a while.
    unreadable: unreadable::Unreadable,
    /// The recordings folder's device and inode as watched (see [`EventLoop::check_root`]).
    root_id: Option<(u64, u64)>,
    /// Where a watcher made anew sends its events.
    watch_tx: mpsc::UnboundedSender<WatchEvent>,
}

impl EventLoop {
    /// The first comparison of the tree with the manifest is asked for, and systemd told.
    fn ready(&self) {
        self.send(Work::Rescan);
        log::info!(
            "watching {} on {}; outputs in {}",
            self.root.display(),
            self.device,
            self.settings.paths.output.display()
        );
        let _ = sd_notify::notify(&[
            NotifyState::Ready,
            NotifyState::Status(&format!("watching, on {}", self.device)),
        ]);
    }

    fn send(&self, w: Work) {
        if matches!(w, Work::Op(Input::Load { .. })) {
            self.shared.queued.fetch_add(1, Ordering::Relaxed);
        }
        let _ = self.work_tx.send(w);
    }

    fn observe(&self, o: Observation) {
        self.send(Work::Op(Input::Observe(o)));
    }

    /// SIGHUP: read the configuration again; only `[ingest]` changes live (its `device` but at
    /// a start).
    fn reload(&mut self) {
        let new = match Settings::load(self.config_path.as_deref()) {
            Ok(new) => new,
            Err(e) => {
                log::error!("reload refused, keeping the running configuration: {e}");
                crate::reload::record(&self.settings, false, &e.to_string());
                return;
            }
        };
        let s = &self.settings;
        let fixed: Vec<&str> = [
            ("[paths]", new.paths != s.paths),
            ("[labels]", new.labels != s.labels),
            ("[splits]", new.splits != s.splits),
            ("[features]", new.features != s.features),
            ("[outputs]", new.outputs != s.outputs),
            ("[metrics]", new.metrics != s.metrics),
            ("[gpu]", new.gpu != s.gpu),
            ("[ingest] device", new.ingest.device != s.ingest.device),
        ]
        .into_iter()
        .filter_map(|(section, changed)| changed.then_some(section))
        .collect();
        if !fixed.is_empty() {
            // Applying only the [ingest] part would answer "reloaded" for a configuration that
            // is not in force: refuse it whole, and say what to do.
            let why = format!(
                "only [ingest] settings (but its device) change live, and {} changed: nothing was applied; restart the service to apply them (a changed [features] setting also needs `ailhd rebuild`)",
                fixed.join(", ")
            );
            log::error!("reload refused, keeping the running configuration: {why}");
            crate::reload::record(&self.settings, false, &why);
            return;
        }
        self.settler.set_windows(
            Duration::from_millis(new.ingest.settle_ms),
            Duration::from_secs(new.ingest.quarantine_after_s),
        );
        self.settings.ingest = new.ingest.clone();
        // For the manifest opened next (after an idle close, say).
        crate::engine::manifest::set_cache_mb(self.settings.ingest.manifest_cache_mb);
        self.next_rescan = rescan_deadline(&self.settings);
        self.send(Work::Reload(Box::new(new)));
        log::info!("configuration reloaded");
        crate::reload::record(&self.settings, true, "configuration reloaded");
    }

    fn on_watch(&mut self, event: WatchEvent) {
        match event {
            WatchEvent::Touched { path, kind } => match source::classify_path(&self.root, &path) {
                Some(Found::Recording(_)) => {
                    if kind.is_strong() {
                        self.strong_at.insert(path.clone(), Instant::now());
                        self.shared.arrived();
                    }
                    self.settler.note(&path, kind.touch(), Instant::now());
                }
                // A link or a non-UTF-8 name: quarantined at once.
                Some(Found::Rejected { rel, reason }) => self.observe(Observation::Rejected {
                    rel,
                    reason,
                    size: 0,
                    mtime_ns: 0,
                }),
                None => {}
            },
            WatchEvent::Removed(path) => {
                self.settler.forget(&path);
                self.strong_at.remove(&path);
                // Often half of a move: the worker holds it for its arrival (see batch).
                self.observe(Observation::Gone(lossy(&path)));
            }
            WatchEvent::RemovedDir(path) => self.observe(Observation::FolderGone(lossy(&path))),
            WatchEvent::Rescan { reason } => {
                log::warn!("rescanning the whole tree: {reason}");
                // A close may have been among the events lost.
                self.settler.events_lost();
                self.send(Work::Rescan);
            }
            // A file that could not be read, given a permission now perhaps: read it at once.
            WatchEvent::Attributes(path) => {
                if let Some(rel) = rel_str(&path).filter(|rel| self.unreadable.take(rel)) {
                    self.send(Work::Op(Input::Load { rel, seen: None }));
                }
            }
        }
    }

    /// Probe the files whose settle time has come (off the event loop's thread: probes touch
    /// the disk) and hand on those that are complete.
    async fn settle(&mut self) -> anyhow::Result<()> {
        let now = Instant::now();
        let root = self.root.clone();
        let mut settler = std::mem::replace(&mut self.settler, new_settler(&self.settings));
        let (settler, decisions) = tokio::task::spawn_blocking(move || {
            let decisions = settler.poll(now, |p| source::probe(&root, p));
            (settler, decisions)
        })
        .await?;
        self.settler = settler;
        for decision in decisions {
            match decision {
                Settled::Ready { path, .. } => {
                    let seen = self.strong_at.remove(&path).unwrap_or(now);
                    if let Some(rel) = rel_str(&path) {
                        self.send(Work::Op(Input::Load {
                            rel,
                            seen: Some(seen),
                        }));
                    }
                }
                Settled::Quarantine {
                    path,
                    after_s,
                    detail,
                } => {
                    self.strong_at.remove(&path);
                    let (size, mtime_ns) = std::fs::symlink_metadata(self.root.join(&path))
                        .map(|m| (m.len(), crate::engine::stages::mtime_ns(&m)))
                        .unwrap_or((0, 0));
                    self.observe(Observation::Rejected {
                        rel: lossy(&path),
                        reason: Reason::StillIncomplete { after_s, detail },
                        size,
                        mtime_ns,
                    });
                }
            }
        }
        Ok(())
    }

    fn on_report(&mut self, report: Report) {
        match report {
            Report::Reconciled(r) => {
                let now = Instant::now();
                // Found by a listing, not by an event: probed at once, and ready at once when
                // nothing has written it for a settle period (see Settler::found).
                for rel in r.changed {
                    self.settler
                        .found(Path::new(&rel), now, std::time::SystemTime::now());
                }
                for rel in r.removed {
                    self.observe(Observation::Gone(rel));
                }
                for o in r.rejected {
                    self.observe(o);
                }
            }
            Report::Compared(number) => {
                // All it found is in the settle stage now: counted in the queue before the
                // comparison stops being reported, and a new snapshot written (the worker
                // writes one when the pending list's version moves).
                self.shared
                    .settling
                    .store(self.settler.len(), Ordering::Relaxed);
                self.shared.compared(number);
                self.shared.pending_version.fetch_add(1, Ordering::Relaxed);
            }
            Report::Batch(done) => {
                self.ingested += (done.counts.new_rows + done.counts.attached) as u64;
                for rel in done.reread {
                    self.send(Work::Op(Input::Load { rel, seen: None }));
                }
                // Other names of a file written in place through one of them: looked at as a
                // listing that found them changed would (the same bytes are seen unchanged).
                let now = Instant::now();
                for rel in done.recheck {
                    log::debug!("{rel}: looked at again (another name of its file was written)");
                    self.settler
                        .found(Path::new(&rel), now, std::time::SystemTime::now());
                }
                let first = Duration::from_secs(self.settings.ingest.unreadable_retry_s);
                for (rel, reason) in &done.quarantined {
                    if !matches!(reason, Reason::Unreadable(_)) {
                        continue;
                    }
                    if let Some(wait) = self.unreadable.refused(rel, Instant::now(), first) {
                        log::info!("{rel}: reading it is tried again in {} s", wait.as_secs());
                    }
                }
            }
        }
    }

    /// Read again the files that could not be read, whose wait is over (see [`unreadable`]).
    fn retry_unreadable(&mut self) {
        for rel in self.unreadable.take_due(Instant::now()) {
            self.send(Work::Op(Input::Load { rel, seen: None }));
        }
    }

    /// The recordings folder is another one than the one watched (a disk mounted on it, or
    /// unmounted from it; the folder made anew): its watches are gone with the old one, so it
    /// is watched anew and the tree compared. Runs every 10 s.
    fn check_root(&mut self) {
        let Some(id) = folder_id(&self.root) else {
            return; // not there: the comparisons say so, and the next look finds it back
        };
        if self.root_id == Some(id) {
            return;
        }
        match Watcher::start(&self.root, self.watch_tx.clone()) {
            Ok(watcher) => {
                if self.root_id.is_none() {
                    log::warn!(
                        "the recordings folder {} is there now: watching it and comparing it with the manifest",
                        self.root.display()
                    );
                } else {
                    log::warn!(
                        "the recordings folder {} is another folder now (a disk mounted on it or taken away, or the folder made anew): watching it anew and comparing it with the manifest",
                        self.root.display()
                    );
                }
                self.rewatch(watcher, id);
            }
            Err(e) => log::warn!("cannot watch the recordings folder again yet: {e}"),
        }
    }

    /// Watch the recordings folder with `watcher` from now on (its device and inode are `id`),
    /// and compare the tree with the manifest: events until now were missed.
    fn rewatch(&mut self, watcher: Watcher, id: (u64, u64)) {
        std::mem::replace(&mut self.watcher, watcher).stop();
        self.root_id = Some(id);
        *self
            .shared
            .unwatched
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = self.watcher.unwatched();
        self.send(Work::Rescan);
    }

    /// Folders a watch limit left unwatched: try again, and rescan meanwhile (after a success
    /// too: their events until now were missed).
    fn retry_unwatched(&mut self) {
        if !self.watcher.unwatched().is_empty() {
            self.watcher.retry_unwatched();
            *self
                .shared
                .unwatched
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = self.watcher.unwatched();
            self.send(Work::Rescan);
        }
    }

    /// When the list of pending files `status` shows is due to be taken again: it changed since
    /// it was last taken, which is at most every [`LISTING_EVERY`] (a bulk copy can leave
    /// thousands of files pending), or at once when nothing is pending any more (an empty list
    /// costs nothing). A list that changed is always taken in the end, also when no event
    /// follows: a file that was committed is not left listed as pending.
    fn listing_due(&self) -> Option<Instant> {
        if self.settler.changes() == self.listed_changes {
            None
        } else if self.settler.is_empty() {
            Some(Instant::now())
        } else {
            Some(self.pending_listed + LISTING_EVERY)
        }
    }

    /// The queue and the settle stage's list for `status`, and systemd's STATUS= line.
    fn tell_systemd(&mut self) {
        if self.listing_due().is_some_and(|at| at <= Instant::now()) {
            let mut list = self.settler.pending();
            list.truncate(200);
            *self
                .shared
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = list;
            self.listed_changes = self.settler.changes();
            self.pending_listed = Instant::now();
            // The worker writes a new snapshot once it sees this (see `Worker::on_idle`).
            self.shared.pending_version.fetch_add(1, Ordering::Relaxed);
        }
        let shared = &self.shared;
        shared.settling.store(self.settler.len(), Ordering::Relaxed);
        if self.unwatched_listed.elapsed() >= LISTING_EVERY {
            let unwatched = self.watcher.unwatched();
            crate::metrics::unwatched(unwatched.len());
            *shared.unwatched.lock().unwrap_or_else(|e| e.into_inner()) = unwatched;
            self.unwatched_listed = Instant::now();
        }
        let queue = self.settler.len() + shared.complete_uncommitted();
        let (ingested, device) = (self.ingested, &self.device);
        let text = match &*shared.fault.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => format!("WRITING FAILS, retrying: {e}; queue {queue}, ingested {ingested}"),
            None => format!("queue {queue}, ingested {ingested}, on {device}"),
        };
        let _ = sd_notify::notify(&[NotifyState::Status(&text)]);
    }
}

/// How often, at most, the list of pending files (and of unwatched folders) is taken for
/// `status`.
const LISTING_EVERY: Duration = Duration::from_millis(500);

/// How often folders a watch limit left unwatched are retried (and the tree rescanned).
const UNWATCHED_RETRY: Duration = Duration::from_secs(10);

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

/// A folder's device and inode, if it is one.
fn folder_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .ok()
        .filter(|m| m.is_dir())
        .map(|m| (m.dev(), m.ino()))
}

fn rel_str(path: &Path) -> Option<String> {
    crate::identity::rel_string(path).ok()
}

/// A relative path as the manifest keys it ([`crate::identity::rel_key`]).
fn lossy(path: &Path) -> String {
    crate::identity::rel_key(path)
}
