//! What the event loop and the ingest worker exchange: the work handed to the worker, what it
//! reports back, and the figures both keep for `status` and the watchdog.

use crate::config::Settings;
use crate::engine::{Done, Input, Reconciliation};
use crate::source::settle::PendingFile;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

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
    /// The comparison of this number has handed on all it found (sent after its last part).
    Compared(u64),
    Batch(Done),
}

/// State shared with the worker for `status` and the watchdog.
#[derive(Default)]
pub(super) struct Shared {
    /// Files touched and not yet complete (the settle stage), for the queue depth.
    pub(super) settling: AtomicUsize,
    /// Complete files waiting for the worker (then counted in `in_flight_files`).
    pub(super) queued: AtomicUsize,
    /// Batches the worker has handed to the engine and not seen done yet.
    pub(super) in_flight: AtomicUsize,
    /// The files of those batches (and large files still loading): complete, not yet committed.
    pub(super) in_flight_files: AtomicUsize,
    /// When a recording was last closed after writing or moved into place ([`mono_us`]; 0:
    /// none yet): it goes on at once, but is counted as queued only once probed.
    pub(super) arrived_us: AtomicU64,
    /// Last time the worker was seen making progress or idle (ms since the epoch).
    pub(super) alive_ms: AtomicI64,
    /// Files waiting to be complete (the settle stage's list, refreshed now and then).
    pub(super) pending: Mutex<Vec<PendingFile>>,
    /// Counts the times `pending` was written, so that the worker writes its status snapshot
    /// again when the list changed while nothing else did.
    pub(super) pending_version: AtomicU64,
    /// Set while writing fails (for systemd's STATUS=).
    pub(super) fault: Mutex<Option<String>>,
    /// Folders the watcher could not watch (limits), with why.
    pub(super) unwatched: Mutex<Vec<(PathBuf, String)>>,
    /// The comparison of the tree with the manifest under way, until the event loop has taken
    /// all it found (then counted in `settling`): set by the worker as it starts one, cleared
    /// by the event loop at its [`Report::Compared`].
    pub(super) comparing: Mutex<Option<Comparing>>,
}

/// A comparison of the tree with the manifest under way (see [`Shared::comparing`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Comparing {
    /// Its number in this process (a later one may start before an earlier one's end is seen).
    pub(super) number: u64,
    pub(super) since_ms: i64,
    /// `start`, `rescan` or `recovery`.
    pub(super) why: &'static str,
}

/// How long after a recording arrived (closed after writing, moved in) a rescan still gives
/// way to it without seeing it queued: the settle stage probes it within this time.
const ARRIVING: Duration = Duration::from_millis(5);

impl Shared {
    /// Whether recordings are on their way: arrived a moment ago, queued for the worker, or in
    /// the engine. A periodic rescan gives way meanwhile ([`crate::pace`]).
    pub(super) fn busy(&self) -> bool {
        let arrived = self.arrived_us.load(Ordering::Relaxed);
        self.queued.load(Ordering::Relaxed) > 0
            || self.in_flight.load(Ordering::Relaxed) > 0
            || (arrived > 0 && mono_us().saturating_sub(arrived) < ARRIVING.as_micros() as u64)
    }

    /// A comparison under way, if any.
    pub(super) fn comparing(&self) -> Option<Comparing> {
        *self.comparing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The comparison `number` has handed on all it found (a later one, begun meanwhile, stays).
    pub(super) fn compared(&self, number: u64) {
        let mut c = self.comparing.lock().unwrap_or_else(|e| e.into_inner());
        if c.is_some_and(|c| c.number == number) {
            *c = None;
        }
    }

    /// Files complete and not yet committed: waiting for the worker, or in the engine.
    pub(super) fn complete_uncommitted(&self) -> usize {
        self.queued.load(Ordering::Relaxed) + self.in_flight_files.load(Ordering::Relaxed)
    }

    pub(super) fn arrived(&self) {
        // Never 0: that is "nothing arrived yet".
        self.arrived_us.store(mono_us().max(1), Ordering::Relaxed);
    }
}

/// Microseconds on a monotonic clock, from the first call in the process.
fn mono_us() -> u64 {
    static T0: OnceLock<Instant> = OnceLock::new();
    T0.get_or_init(Instant::now).elapsed().as_micros() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_while_a_recording_arrives_waits_or_is_written() {
        let s = Shared::default();
        assert!(!s.busy());
        s.queued.store(1, Ordering::Relaxed);
        assert!(s.busy());
        s.queued.store(0, Ordering::Relaxed);
        s.in_flight.store(2, Ordering::Relaxed);
        assert!(s.busy());
        s.in_flight.store(0, Ordering::Relaxed);
        assert!(!s.busy());
        s.arrived();
        assert!(s.busy(), "a recording that just arrived is on its way");
        std::thread::sleep(ARRIVING + Duration::from_millis(2));
        assert!(
            !s.busy(),
            "once probed it is counted as queued, not as arriving"
        );
    }
}
