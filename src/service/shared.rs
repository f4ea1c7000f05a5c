//! What the event loop and the ingest worker exchange: the work handed to the worker, what it
//! reports back, and the figures both keep for `status` and the watchdog.

use crate::config::Settings;
use crate::engine::{Done, Input, Reconciliation};
use crate::source::settle::PendingFile;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicUsize};
use std::sync::Mutex;

/// What the worker is asked to do.
pub(super) enum Work {
    Op(Input),
    /// Compare the whole tree with the manifest (start-up, overflow, periodic).
    Rescan,
    Reload(Box<Settings>),
}

/// What the worker tells the event loop.
pub(super) enum Report {
    Reconciled(Reconciliation),
    Batch(Done),
}

/// State shared with the worker for `status` and the watchdog.
#[derive(Default)]
pub(super) struct Shared {
    /// Files touched and not yet complete (the settle stage), for the queue depth.
    pub(super) settling: AtomicUsize,
    /// Complete files waiting for the worker.
    pub(super) queued: AtomicUsize,
    /// Last time the worker was seen making progress or idle (ms since the epoch).
    pub(super) alive_ms: AtomicI64,
    /// Files waiting to be complete (the settle stage's list, refreshed now and then).
    pub(super) pending: Mutex<Vec<PendingFile>>,
    /// Set while writing fails (for systemd's STATUS=).
    pub(super) fault: Mutex<Option<String>>,
    /// Folders the watcher could not watch (limits), with why.
    pub(super) unwatched: Mutex<Vec<(PathBuf, String)>>,
}
