//! Settle: decides when a touched recording is complete enough to ingest (docs/design.md, "Identity, labels, splits": closed,
//! size stable, header consistent with the size; never ingested truncated), and when a file that
//! never completes must be quarantined. Pure bookkeeping: the caller supplies the clock and a
//! probe of the filesystem, so the rules are tested without sleeping or touching a disk.
//!
//! The rule, per file:
//!
//! - a *written* touch (IN_MODIFY: data went in through a descriptor open for writing) means a
//!   writer holds the file: it is not ready, however long it stays unchanged, until a close after
//!   writing (or a move into place) is seen. A recorder that writes a consistent header and then
//!   fills in its samples, or rewrites the header after every block, looks complete between its
//!   writes; only its close says it is done. If no close comes within `quarantine_after` of the
//!   last write, the file is quarantined ("a writer still holds it open"). When events may have
//!   been lost ([`Settler::events_lost`]: a queue overflow), what was known of open writers is
//!   dropped and the weak rule below applies.
//! - a *weak* touch (created, or found by a directory walk) starts a settle window: the
//!   file is probed once `settle` after the last touch to take a baseline `(size, mtime)`, and is
//!   ready when a probe at least `settle` later sees the same baseline, with no touch in between,
//!   and the header is consistent. So a weakly touched file is ready `2 * settle` after its last
//!   touch at the earliest. The second probe guards writers whose writes raise no inotify event
//!   (network filesystems), and files that arrive without a write (a hard link).
//! - a *strong* touch (closed after writing, moved into place) lets the file go on the first probe
//!   whose header is consistent, without waiting. We still probe, never trust the event alone.
//!   A writer that closes, reopens and appends raises new events, so the file is touched again,
//!   settles again and its new bytes supersede the first ingestion (docs/design.md, "Identity, labels, splits"); it
//!   is never ingested with an inconsistent header.
//! - a header that is malformed (not a WAV, an unsupported encoding, an empty file) cannot be
//!   fixed by waiting: such a file goes like a consistent one, and the engine quarantines it
//!   with the decoder's reason, at once for a closed file.
//! - a header that says "still being written" (placeholder sizes, truncated) keeps the file
//!   waiting and listed as pending, re-probed with a backoff. A closed file (strong touch) that
//!   still says so a settle window after its close is as complete as its writer made it: it goes
//!   on, and the engine quarantines it with the decoder's reason (as `rebuild` does), within a
//!   second. Any other file that stays so for `quarantine_after` since its last change (a touch,
//!   a probe that saw a new size or mtime, or for a listed file its mtime) is quarantined with
//!   the header's reason.
//! - a file that has disappeared is dropped silently: its removal is the watcher's news.

use crate::decode::DecodeError;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// Longest pause between probes of a file whose header is not consistent yet. Bounds how late we
/// notice a writer that finishes without raising an event; short enough to feel immediate, long
/// enough that a stuck file costs a handful of `stat`s a minute.
const MAX_RECHECK: Duration = Duration::from_secs(5);

/// Shortest pause between probes of one file, so `settle = 0` cannot spin.
const MIN_RECHECK: Duration = Duration::from_millis(1);

/// What the filesystem says about a file now. Built by the caller (stat + header check with the
/// decoder), so this module does not depend on how headers are parsed.
#[derive(Debug, Clone, PartialEq)]
pub enum Probe {
    /// The path no longer exists (deleted or moved away).
    Missing,
    Present {
        size: u64,
        mtime: SystemTime,
        /// `Ok` when the header is consistent with `size`; otherwise the decoder's verdict
        /// ([`DecodeError::is_incomplete`] tells waiting from hopeless).
        header: Result<(), DecodeError>,
        /// Whether a process holds the file open for writing, where the kernel says
        /// ([`crate::source::held_for_writing`]); only a yes is acted on.
        held_for_writing: Option<bool>,
    },
}

/// A decision about one file, returned by [`Settler::poll`]. Either way the file is no longer
/// pending; a later [`Settler::note`] starts over.
#[derive(Debug, Clone, PartialEq)]
pub enum Settled {
    /// Complete: ingest it. `size` and `mtime` are what the deciding probe saw, so the ingester can
    /// notice that the file changed again before it read it.
    Ready {
        path: PathBuf,
        size: u64,
        mtime: SystemTime,
    },
    /// Still incomplete `quarantine_after` after its last change; `detail` says how.
    Quarantine {
        path: PathBuf,
        after_s: u64,
        detail: Incomplete,
    },
}

/// Why a file is not complete yet.
#[derive(Debug, Clone, PartialEq)]
pub enum Incomplete {
    /// Its header says it is still being written ([`DecodeError::is_incomplete`]).
    Header(DecodeError),
    /// It was written and no close followed: a writer still holds it open.
    Open,
}

impl std::fmt::Display for Incomplete {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Incomplete::Header(e) => write!(f, "{e}"),
            Incomplete::Open => write!(
                f,
                "written and never closed: a writer still holds it open (it is ingested once \
                 closed)"
            ),
        }
    }
}

/// How a file was touched, as the settle stage weighs it (see the module's rules).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Touch {
    /// Created, or listed in a folder that appeared: nothing says whether a writer holds it.
    Weak,
    /// Written through a descriptor open for writing: complete only once closed.
    Written,
    /// Closed after writing, or moved into place.
    Closed,
}

/// Tracks files that were touched and are not yet complete. Paths are opaque keys: whatever the
/// caller passes to [`note`](Settler::note) is what the probe receives and what comes back.
#[derive(Debug)]
pub struct Settler {
    settle: Duration,
    quarantine_after: Duration,
    pending: HashMap<PathBuf, Pending>,
    /// (due, path) for every pending file, so the next deadline and the due files are found
    /// without scanning: a bulk copy can leave thousands of files pending at once.
    schedule: BTreeSet<(Instant, PathBuf)>,
    /// Counts the calls that may have changed what [`pending`](Settler::pending) lists, so that
    /// a caller listing it now and then knows when its copy is stale.
    changes: u64,
}

#[derive(Debug)]
struct Pending {
    /// The latest touch was a close-after-write or a move into place, and no unexplained change
    /// was seen since: the file may go without the settle window.
    strong: bool,
    /// Written since its last close (a writer holds it): not ready until a close is seen.
    open: bool,
    /// When the latest strong touch came, while `strong` holds: a header still incomplete a
    /// settle window later is as complete as its writer made it.
    closed_at: Option<Instant>,
    /// Starts the quarantine clock again: the latest touch, or the latest probe that saw a new
    /// size or mtime. A file that keeps changing is being written, not stuck.
    last_change: Instant,
    /// The first probe since the latest touch, and what it saw; `None` until then. Readiness
    /// compares against it, so a baseline is never older than the latest touch.
    baseline: Option<Baseline>,
    /// When this file is probed next; mirrored in `Settler::schedule`.
    due: Instant,
    /// Pause before the next probe while the header is inconsistent; doubles up to MAX_RECHECK.
    recheck: Duration,
    /// When this file was first touched since it was last decided (for `status`).
    since: SystemTime,
    /// What the latest probe found still incomplete, if anything.
    waiting_for: Option<Incomplete>,
    /// Listed, not touched ([`Settler::found`]): the wall-clock time of the listing, against
    /// which the first probe's mtime may stand for a baseline taken earlier.
    found_at: Option<(Instant, SystemTime)>,
}

/// A file waiting to be complete, as `status` lists it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PendingFile {
    pub path: String,
    /// Unix milliseconds of the first touch.
    pub since_ms: i64,
    pub why: String,
}

#[derive(Debug, Clone, Copy)]
struct Baseline {
    size: u64,
    mtime: SystemTime,
    at: Instant,
}

/// What one probe of a present file saw ([`Probe::Present`]).
struct Seen {
    size: u64,
    mtime: SystemTime,
    header: Result<(), DecodeError>,
    held_for_writing: Option<bool>,
}

/// What [`Pending::step`] decided for a file after a probe.
enum Step {
    Ready,
    Quarantine(Incomplete),
    /// Not yet: probe it again then.
    Probe(Instant),
}

impl Pending {
    /// One probe's verdict by the module's rules, with what it taught about the file kept.
    fn step(
        &mut self,
        settle: Duration,
        quarantine_after: Duration,
        now: Instant,
        seen: Seen,
    ) -> Step {
        if seen.held_for_writing == Some(true) {
            // A writer the events did not show (it began before the watch on its folder, or
            // before the service started), or a second descriptor after a close: its close
            // will be seen.
            self.open = true;
            self.strong = false;
            self.closed_at = None;
        }
        let no_writer = seen.held_for_writing == Some(false);
        let baseline = self.baseline(settle, quarantine_after, now, seen.size, seen.mtime);
        // A malformed header will not get better by waiting: the file goes as it is.
        let header = seen
            .header
            .or_else(|e| if e.is_incomplete() { Err(e) } else { Ok(()) });
        // Unfinished by its header, and no process here holds it open for writing (a file
        // closed before its folder's watch was set up, say): taken as closed now. Only to be
        // quarantined a window later, never to be ingested sooner (a writer on another host of
        // some network file systems is not counted), and a change starts it over.
        if no_writer && header.is_err() && !self.open && self.closed_at.is_none() {
            self.closed_at = Some(now);
        }
        // A closed file still incomplete a settle window after its close: its writer is done
        // with it, so it goes, and the engine quarantines it with the decoder's reason.
        let closed_for_a_window = self.closed_at.map(|at| (at, now >= at + settle));
        match (self.open, header) {
            (false, Ok(())) if self.strong || now.duration_since(baseline.at) >= settle => {
                Step::Ready
            }
            // Consistent but not yet seen stable for the whole window.
            (false, Ok(())) => Step::Probe((baseline.at + settle).max(now + MIN_RECHECK)),
            (false, Err(_)) if matches!(closed_for_a_window, Some((_, true))) => Step::Ready,
            (open, header) => {
                let detail = match header {
                    Err(e) if !open => Incomplete::Header(e),
                    _ => Incomplete::Open,
                };
                let deadline = self.last_change + quarantine_after;
                if now >= deadline {
                    return Step::Quarantine(detail);
                }
                self.waiting_for = Some(detail);
                let mut next = (now + self.recheck).min(deadline);
                if let Some((closed_at, _)) = closed_for_a_window {
                    next = next.min((closed_at + settle).max(now + MIN_RECHECK));
                }
                self.recheck = (self.recheck * 2).min(MAX_RECHECK.max(settle));
                Step::Probe(next)
            }
        }
    }

    /// The baseline a probe that saw `(size, mtime)` compares against: the one taken since the
    /// latest touch if the file is unchanged, else a new one (a change with no event about it
    /// starts the windows over).
    fn baseline(
        &mut self,
        settle: Duration,
        quarantine_after: Duration,
        now: Instant,
        size: u64,
        mtime: SystemTime,
    ) -> Baseline {
        let previous = match self.baseline {
            Some(b) if b.size == size && b.mtime == mtime => return b,
            previous => previous,
        };
        if previous.is_some() {
            // Changed with no event about it: someone is writing where inotify does not see
            // it. Whatever a close told us is stale.
            self.strong = false;
            self.closed_at = None;
            self.last_change = now;
            self.recheck = settle.max(MIN_RECHECK);
        }
        // A listed file's mtime says how long nothing has written it (the listing's wall clock,
        // moved on by the monotonic time since): that long counts as seen stable, up to the
        // whole window, and as time since its last change (a file found incomplete long after
        // its last write is not waited for again at every start), up to `quarantine_after`.
        let unchanged_for = match self.found_at.take() {
            Some((at, wall)) if previous.is_none() => {
                let wall_now = wall + now.saturating_duration_since(at);
                wall_now.duration_since(mtime).unwrap_or_default()
            }
            _ => Duration::ZERO,
        };
        if !unchanged_for.is_zero() {
            let since = unchanged_for.min(quarantine_after);
            self.last_change = now.checked_sub(since).unwrap_or(self.last_change);
        }
        let stable_for = unchanged_for.min(settle);
        let b = Baseline {
            size,
            mtime,
            at: now.checked_sub(stable_for).unwrap_or(now),
        };
        self.baseline = Some(b);
        b
    }
}

impl Settler {
    /// `settle`: how long `(size, mtime)` must stay unchanged after a weak touch
    /// (`ingest.settle_ms`). `quarantine_after`: how long a file may stay incomplete after its
    /// last change before it is quarantined (`ingest.quarantine_after_s`).
    pub fn new(settle: Duration, quarantine_after: Duration) -> Settler {
        Settler {
            settle,
            quarantine_after,
            pending: HashMap::new(),
            schedule: BTreeSet::new(),
            changes: 0,
        }
    }

    /// New windows (a reload of `ingest.settle_ms`, `ingest.quarantine_after_s`), from the next
    /// probe of each pending file on; what is known of each file is kept (a writer that holds
    /// one open still does).
    pub fn set_windows(&mut self, settle: Duration, quarantine_after: Duration) {
        self.settle = settle;
        self.quarantine_after = quarantine_after;
    }

    /// Records that `path` was touched at `now` (see [`Touch`]). A weak or written touch after a
    /// strong one cancels the fast path (the writer came back).
    pub fn note(&mut self, path: &Path, touch: Touch, now: Instant) {
        self.changes += 1;
        let strong = touch == Touch::Closed;
        let due = if strong { now } else { now + self.settle };
        let first_recheck = self.settle.max(MIN_RECHECK);
        let entry = self
            .pending
            .entry(path.to_path_buf())
            .or_insert_with(|| Pending {
                strong,
                open: false,
                closed_at: None,
                last_change: now,
                baseline: None,
                due,
                recheck: first_recheck,
                since: SystemTime::now(),
                waiting_for: None,
                found_at: None,
            });
        entry.strong = strong;
        // A creation is a new file at this path: what was known of the old one's writer goes.
        entry.open = touch == Touch::Written;
        entry.closed_at = strong.then_some(now);
        entry.found_at = None;
        entry.last_change = now;
        entry.baseline = None;
        entry.recheck = first_recheck;
        reschedule(&mut self.schedule, path, entry, due);
    }

    /// Events may have been lost (the watcher's queue overflowed): a close may have gone
    /// unseen, so no pending file is taken as held open any more; the weak rule applies to them.
    pub fn events_lost(&mut self) {
        for entry in self.pending.values_mut().filter(|e| e.open) {
            entry.open = false;
            self.changes += 1;
        }
    }

    /// Records that a listing (the comparison of the tree with the manifest, at start-up or in a
    /// rescan) found `path` new or changed at `now` (`wall`: the wall clock then). No event says
    /// whether a writer holds it, so the weak rule applies, with one difference: the file is
    /// probed at once, and a file whose mtime is already `settle` old at that probe has not been
    /// written for a whole settle window, so the probe stands for the second of the two (ready
    /// when the header is consistent). A younger file is ready `settle` after its mtime, once a
    /// probe then sees the same size and mtime. A file already pending keeps the rule its touch
    /// gave it.
    pub fn found(&mut self, path: &Path, now: Instant, wall: SystemTime) {
        if self.pending.contains_key(path) {
            return;
        }
        self.changes += 1;
        let entry = Pending {
            strong: false,
            open: false,
            closed_at: None,
            last_change: now,
            baseline: None,
            due: now,
            recheck: self.settle.max(MIN_RECHECK),
            since: wall,
            waiting_for: None,
            found_at: Some((now, wall)),
        };
        self.schedule.insert((now, path.to_path_buf()));
        self.pending.insert(path.to_path_buf(), entry);
    }

    /// Probes every file that is due at `now` and returns those that are ready or must be
    /// quarantined. The others are rescheduled; [`next_deadline`](Settler::next_deadline) says
    /// when to call again.
    pub fn poll(&mut self, now: Instant, mut probe: impl FnMut(&Path) -> Probe) -> Vec<Settled> {
        let mut decided = Vec::new();
        while let Some((due, _)) = self.schedule.first() {
            if *due > now {
                break;
            }
            // A probe may decide the file or change why it waits.
            self.changes += 1;
            let (_, path) = self.schedule.pop_first().expect("first() was Some");
            let Some(entry) = self.pending.get_mut(&path) else {
                continue;
            };
            let Probe::Present {
                size,
                mtime,
                header,
                held_for_writing,
            } = probe(&path)
            else {
                self.pending.remove(&path);
                continue;
            };
            let seen = Seen {
                size,
                mtime,
                header,
                held_for_writing,
            };
            match entry.step(self.settle, self.quarantine_after, now, seen) {
                Step::Probe(next) => {
                    entry.due = next;
                    self.schedule.insert((next, path));
                }
                Step::Ready => {
                    self.pending.remove(&path);
                    decided.push(Settled::Ready { path, size, mtime });
                }
                Step::Quarantine(detail) => {
                    self.pending.remove(&path);
                    decided.push(Settled::Quarantine {
                        path,
                        after_s: self.quarantine_after.as_secs(),
                        detail,
                    });
                }
            }
        }
        decided
    }

    /// When [`poll`](Settler::poll) has something to do next; `None` when nothing is pending, so
    /// an idle daemon sleeps until the next event instead of polling.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.schedule.first().map(|(due, _)| *due)
    }

    /// Stops tracking `path` (it was removed, or the caller decided otherwise). Files under a
    /// removed directory need not be forgotten one by one: their next probe finds them missing.
    pub fn forget(&mut self, path: &Path) {
        if let Some(entry) = self.pending.remove(path) {
            self.changes += 1;
            self.schedule.remove(&(entry.due, path.to_path_buf()));
        }
    }

    /// Grows with every change to what [`pending`](Settler::pending) lists (and with every
    /// probe, which may change why a file waits).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Files touched and not yet decided, with why they wait, oldest first.
    pub fn pending(&self) -> Vec<PendingFile> {
        let mut out: Vec<PendingFile> = self
            .pending
            .iter()
            .map(|(path, p)| PendingFile {
                path: crate::identity::rel_key(path),
                since_ms: p
                    .since
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as i64)
                    .unwrap_or(0),
                why: match (&p.waiting_for, p.strong) {
                    _ if p.open => {
                        "being written: waiting for its writer to close it (it is not ingested \
                         before)"
                            .into()
                    }
                    (Some(Incomplete::Header(e)), _) => {
                        format!("header says still being written: {e}")
                    }
                    (_, true) => "closed; checking the header".into(),
                    (_, false) => format!(
                        "written recently; waiting for it to close or stay unchanged for {} ms",
                        self.settle.as_millis()
                    ),
                },
            })
            .collect();
        out.sort_by_key(|p| p.since_ms);
        out
    }

    /// Files touched and not yet decided.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

fn reschedule(
    schedule: &mut BTreeSet<(Instant, PathBuf)>,
    path: &Path,
    entry: &mut Pending,
    due: Instant,
) {
    let key = (entry.due, path.to_path_buf());
    schedule.remove(&key);
    entry.due = due;
    schedule.insert((due, key.1));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    const SETTLE: Duration = Duration::from_millis(200);
    const QUARANTINE: Duration = Duration::from_secs(300);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A fake filesystem: path -> probe result, changed by the test between polls.
    struct FakeFs(RefCell<HashMap<PathBuf, Probe>>);

    impl FakeFs {
        fn new() -> FakeFs {
            FakeFs(RefCell::new(HashMap::new()))
        }
        fn set(&self, path: &str, size: u64, mtime_s: u64, header: Result<(), DecodeError>) {
            self.set_held(path, size, mtime_s, header, None);
        }
        fn set_held(
            &self,
            path: &str,
            size: u64,
            mtime_s: u64,
            header: Result<(), DecodeError>,
            held_for_writing: Option<bool>,
        ) {
            self.0.borrow_mut().insert(
                PathBuf::from(path),
                Probe::Present {
                    size,
                    mtime: SystemTime::UNIX_EPOCH + Duration::from_secs(mtime_s),
                    header,
                    held_for_writing,
                },
            );
        }
        fn remove(&self, path: &str) {
            self.0.borrow_mut().remove(Path::new(path));
        }
        fn probe(&self) -> impl FnMut(&Path) -> Probe + '_ {
            |p| self.0.borrow().get(p).cloned().unwrap_or(Probe::Missing)
        }
    }

    fn ready_paths(out: &[Settled]) -> Vec<&Path> {
        out.iter()
            .filter_map(|s| match s {
                Settled::Ready { path, .. } => Some(path.as_path()),
                Settled::Quarantine { .. } => None,
            })
            .collect()
    }

    #[test]
    fn idle_settler_has_no_deadline() {
        let s = Settler::new(SETTLE, QUARANTINE);
        assert_eq!(s.next_deadline(), None);
        assert!(s.is_empty());
    }

    #[test]
    fn weak_touch_is_ready_after_two_stable_probes() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("a.wav", 100, 1, Ok(()));
        s.note(Path::new("a.wav"), Touch::Weak, t0);
        assert_eq!(s.next_deadline(), Some(t0 + SETTLE));

        // Nothing is due before the window ends: no probe at all.
        let out = s.poll(t0 + ms(100), |_| panic!("probed too early"));
        assert!(out.is_empty());

        // First probe takes the baseline.
        assert!(s.poll(t0 + SETTLE, fs.probe()).is_empty());
        assert_eq!(s.next_deadline(), Some(t0 + 2 * SETTLE));

        let out = s.poll(t0 + 2 * SETTLE, fs.probe());
        assert_eq!(
            out,
            vec![Settled::Ready {
                path: "a.wav".into(),
                size: 100,
                mtime: SystemTime::UNIX_EPOCH + Duration::from_secs(1),
            }]
        );
        assert_eq!(s.next_deadline(), None);
        assert!(s.is_empty());
    }

    /// The wall clock `s` seconds after the epoch (the fake files' mtimes are whole seconds).
    fn wall(s: f64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs_f64(s)
    }

    #[test]
    fn a_listed_file_untouched_for_a_settle_window_goes_on_the_first_probe() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("old.wav", 100, 1, Ok(()));
        // Listed 0.5 s after its last write: probed at once, and ready.
        s.found(Path::new("old.wav"), t0, wall(1.5));
        assert_eq!(s.next_deadline(), Some(t0));
        assert_eq!(ready_paths(&s.poll(t0, fs.probe())), [Path::new("old.wav")]);
        assert!(s.is_empty());
    }

    #[test]
    fn a_listed_file_written_just_before_waits_for_a_window_after_its_mtime() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("new.wav", 100, 1, Ok(()));
        // Listed 50 ms after its last write: not yet stable for a whole window.
        s.found(Path::new("new.wav"), t0, wall(1.05));
        assert!(s.poll(t0, fs.probe()).is_empty());
        // Due 150 ms later (200 ms after the mtime), when a probe must see it unchanged.
        assert_eq!(s.next_deadline(), Some(t0 + ms(150)));
        let out = s.poll(t0 + ms(150), fs.probe());
        assert_eq!(ready_paths(&out), [Path::new("new.wav")]);
    }

    #[test]
    fn a_listed_file_that_changes_at_its_probe_settles_as_after_a_weak_touch() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("w.wav", 100, 1, Ok(()));
        s.found(Path::new("w.wav"), t0, wall(1.05));
        assert!(s.poll(t0, fs.probe()).is_empty());
        // A writer that raises no event goes on: the next probe sees a new size.
        fs.set("w.wav", 200, 1, Ok(()));
        assert!(s.poll(t0 + ms(150), fs.probe()).is_empty());
        assert_eq!(s.next_deadline(), Some(t0 + ms(350)));
        let out = s.poll(t0 + ms(350), fs.probe());
        assert_eq!(ready_paths(&out), [Path::new("w.wav")]);
    }

    #[test]
    fn a_touch_keeps_its_rule_when_a_listing_finds_the_file_too() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("a.wav", 100, 1, Ok(()));
        s.note(Path::new("a.wav"), Touch::Weak, t0);
        s.found(Path::new("a.wav"), t0, wall(100.0));
        assert_eq!(s.next_deadline(), Some(t0 + SETTLE));
        assert!(s.poll(t0 + SETTLE, fs.probe()).is_empty());
        // And a touch after a listing cancels the listing's shortcut.
        s.found(Path::new("b.wav"), t0, wall(100.0));
        fs.set("b.wav", 100, 1, Ok(()));
        s.note(Path::new("b.wav"), Touch::Weak, t0 + ms(1));
        let out = s.poll(t0 + ms(1) + SETTLE, fs.probe());
        assert!(ready_paths(&out).is_empty(), "{out:?}");
    }

    #[test]
    fn strong_touch_goes_on_the_first_consistent_probe() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("a.wav", 100, 1, Ok(()));
        s.note(Path::new("a.wav"), Touch::Weak, t0);
        s.note(Path::new("a.wav"), Touch::Closed, t0 + ms(10));
        assert_eq!(s.next_deadline(), Some(t0 + ms(10)));
        assert_eq!(
            ready_paths(&s.poll(t0 + ms(10), fs.probe())),
            [Path::new("a.wav")]
        );
    }

    #[test]
    fn strong_touch_still_needs_a_consistent_header() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("a.wav", 44, 1, Err(DecodeError::PlaceholderSizes));
        s.note(Path::new("a.wav"), Touch::Closed, t0);
        assert!(s.poll(t0, fs.probe()).is_empty());
        // The writer fixes the header without an event we saw; size changes too.
        fs.set("a.wav", 81964, 2, Ok(()));
        let due = s.next_deadline().unwrap();
        assert!(due > t0);
        // The unexplained change cancels the fast path: a full window of stability is needed.
        assert!(s.poll(due, fs.probe()).is_empty());
        let out = s.poll(due + SETTLE, fs.probe());
        assert_eq!(ready_paths(&out), [Path::new("a.wav")]);
    }

    #[test]
    fn a_closed_file_with_a_hopeless_header_goes_at_once_and_waiting_ones_are_listed() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("text.wav", 12, 1, Err(DecodeError::NotWav));
        fs.set(
            "alaw.wav",
            80,
            1,
            Err(DecodeError::UnsupportedEncoding { tag: 6, bits: 8 }),
        );
        fs.set("growing.wav", 44, 1, Err(DecodeError::PlaceholderSizes));
        for p in ["text.wav", "alaw.wav", "growing.wav"] {
            s.note(Path::new(p), Touch::Closed, t0);
        }
        let decided = s.poll(t0, fs.probe());
        let mut out = ready_paths(&decided);
        out.sort();
        assert_eq!(out, [Path::new("alaw.wav"), Path::new("text.wav")]);
        let pending = s.pending();
        assert_eq!(pending.len(), 1);
        assert_eq!(pending[0].path, "growing.wav");
        assert!(
            pending[0].why.contains("still being written"),
            "{}",
            pending[0].why
        );
    }

    #[test]
    fn weak_touch_after_strong_cancels_fast_path() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("a.wav", 100, 1, Ok(()));
        s.note(Path::new("a.wav"), Touch::Closed, t0);
        s.note(Path::new("a.wav"), Touch::Weak, t0 + ms(1));
        assert!(s.poll(t0 + ms(1), fs.probe()).is_empty());
        assert_eq!(s.next_deadline(), Some(t0 + ms(1) + SETTLE));
    }

    #[test]
    fn growing_file_waits_until_it_stops() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        let path = Path::new("LEAK/a.wav");
        fs.set("LEAK/a.wav", 1000, 1, Ok(()));
        s.note(path, Touch::Weak, t0);
        let mut now = t0 + SETTLE;
        assert!(s.poll(now, fs.probe()).is_empty());
        // Grows between every probe (a writer invisible to inotify), header consistent each time.
        for size in [2000, 3000, 4000] {
            fs.set("LEAK/a.wav", size, size, Ok(()));
            now = s.next_deadline().unwrap();
            assert!(s.poll(now, fs.probe()).is_empty(), "ready while growing");
        }
        now = s.next_deadline().unwrap();
        let out = s.poll(now, fs.probe());
        assert_eq!(
            out,
            vec![Settled::Ready {
                path: path.into(),
                size: 4000,
                mtime: SystemTime::UNIX_EPOCH + Duration::from_secs(4000),
            }]
        );
    }

    #[test]
    fn touch_resets_the_settle_window() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("a.wav", 100, 1, Ok(()));
        s.note(Path::new("a.wav"), Touch::Weak, t0);
        assert!(s.poll(t0 + SETTLE, fs.probe()).is_empty());
        // Touched again just before the confirming probe: the baseline is void.
        s.note(Path::new("a.wav"), Touch::Weak, t0 + 2 * SETTLE - ms(1));
        assert!(s.poll(t0 + 2 * SETTLE, fs.probe()).is_empty());
        assert_eq!(s.next_deadline(), Some(t0 + 3 * SETTLE - ms(1)));
        assert!(s.poll(t0 + 3 * SETTLE - ms(1), fs.probe()).is_empty());
        let out = s.poll(t0 + 4 * SETTLE - ms(1), fs.probe());
        assert_eq!(ready_paths(&out), [Path::new("a.wav")]);
    }

    #[test]
    fn stuck_in_progress_is_quarantined_at_the_deadline_with_its_reason() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("a.wav", 44, 1, Err(DecodeError::PlaceholderSizes));
        // Created and never closed (no close seen, no write seen: a link, say).
        s.note(Path::new("a.wav"), Touch::Weak, t0);
        let mut probes = 0;
        loop {
            let now = s.next_deadline().expect("still pending");
            assert!(now <= t0 + QUARANTINE, "deadline passed without quarantine");
            let out = s.poll(now, |p| {
                probes += 1;
                fs.probe()(p)
            });
            if now < t0 + QUARANTINE {
                assert!(out.is_empty(), "decided before the deadline: {out:?}");
                continue;
            }
            assert_eq!(now, t0 + QUARANTINE);
            match out.as_slice() {
                [Settled::Quarantine {
                    path,
                    after_s,
                    detail,
                }] => {
                    let reason = format!("{after_s} s: {detail}");
                    assert_eq!(path, Path::new("a.wav"));
                    assert!(reason.contains("recording in progress"), "{reason}");
                    assert!(reason.contains("300 s"), "{reason}");
                    let _ = path;
                }
                other => panic!("expected a quarantine, got {other:?}"),
            }
            break;
        }
        assert_eq!(s.next_deadline(), None);
        // Backoff: a stuck file is probed a few dozen times in 5 minutes, not 1500.
        assert!(probes < 100, "{probes} probes");
    }

    #[test]
    fn change_restarts_the_quarantine_clock() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set(
            "a.wav",
            1000,
            1,
            Err(DecodeError::TruncatedChunkHeader { file_len: 3 }),
        );
        s.note(Path::new("a.wav"), Touch::Weak, t0);
        // Poll until halfway, then the file grows without an event (probe-observed change).
        let half = t0 + QUARANTINE / 2;
        while s.next_deadline().unwrap() < half {
            let now = s.next_deadline().unwrap();
            assert!(s.poll(now, fs.probe()).is_empty());
        }
        fs.set(
            "a.wav",
            2000,
            2,
            Err(DecodeError::TruncatedChunkHeader { file_len: 3 }),
        );
        let changed_at = s.next_deadline().unwrap();
        assert!(s.poll(changed_at, fs.probe()).is_empty());
        // Past the original deadline: still waiting.
        while s.next_deadline().unwrap() < changed_at + QUARANTINE {
            let now = s.next_deadline().unwrap();
            assert!(s.poll(now, fs.probe()).is_empty(), "quarantined early");
        }
        assert_eq!(s.next_deadline(), Some(changed_at + QUARANTINE));
        let out = s.poll(changed_at + QUARANTINE, fs.probe());
        assert!(matches!(out.as_slice(), [Settled::Quarantine { .. }]));

        // A write restarts it as well.
        s.note(Path::new("a.wav"), Touch::Written, t0);
        let mut now = t0;
        while now < t0 + QUARANTINE / 2 {
            assert!(s.poll(now, fs.probe()).is_empty());
            now = s.next_deadline().unwrap();
        }
        let touched_at = now;
        s.note(Path::new("a.wav"), Touch::Written, touched_at);
        while s.next_deadline().unwrap() < touched_at + QUARANTINE {
            let now = s.next_deadline().unwrap();
            assert!(s.poll(now, fs.probe()).is_empty(), "quarantined early");
        }
        assert_eq!(s.next_deadline(), Some(touched_at + QUARANTINE));
    }

    #[test]
    fn removed_file_is_dropped_silently() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("a.wav", 100, 1, Ok(()));
        s.note(Path::new("a.wav"), Touch::Weak, t0);
        assert!(s.poll(t0 + SETTLE, fs.probe()).is_empty());
        fs.remove("a.wav");
        assert!(s.poll(t0 + 2 * SETTLE, fs.probe()).is_empty());
        assert_eq!(s.next_deadline(), None);
        assert!(s.is_empty());
    }

    #[test]
    fn forget_stops_tracking() {
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        s.note(Path::new("a.wav"), Touch::Weak, t0);
        s.note(Path::new("b.wav"), Touch::Weak, t0 + ms(50));
        assert_eq!(s.len(), 2);
        s.forget(Path::new("a.wav"));
        assert_eq!(s.next_deadline(), Some(t0 + ms(50) + SETTLE));
        s.forget(Path::new("b.wav"));
        s.forget(Path::new("never-seen.wav"));
        assert_eq!(s.next_deadline(), None);
        assert!(s
            .poll(t0 + QUARANTINE, |_| panic!("probed a forgotten file"))
            .is_empty());
    }

    #[test]
    fn next_deadline_is_the_earliest_of_many() {
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        s.note(Path::new("late.wav"), Touch::Weak, t0 + ms(100));
        s.note(Path::new("early.wav"), Touch::Weak, t0);
        assert_eq!(s.next_deadline(), Some(t0 + SETTLE));
        // Re-noting moves a file's deadline rather than adding a second one.
        s.note(Path::new("early.wav"), Touch::Weak, t0 + ms(500));
        assert_eq!(s.next_deadline(), Some(t0 + ms(100) + SETTLE));
        assert_eq!(s.len(), 2);
        s.note(Path::new("strong.wav"), Touch::Closed, t0 + ms(1));
        assert_eq!(s.next_deadline(), Some(t0 + ms(1)));
    }

    #[test]
    fn zero_settle_does_not_spin() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(Duration::ZERO, Duration::from_secs(1));
        fs.set("a.wav", 44, 1, Err(DecodeError::PlaceholderSizes));
        s.note(Path::new("a.wav"), Touch::Weak, t0);
        assert!(s.poll(t0, fs.probe()).is_empty());
        assert!(s.next_deadline().unwrap() > t0);
        fs.set("b.wav", 100, 1, Ok(()));
        s.note(Path::new("b.wav"), Touch::Weak, t0);
        assert_eq!(ready_paths(&s.poll(t0, fs.probe())), [Path::new("b.wav")]);
    }

    /// Polls at every deadline up to `until` (included) and returns what was decided.
    fn poll_until(s: &mut Settler, fs: &FakeFs, until: Instant) -> Vec<Settled> {
        let mut out = Vec::new();
        while let Some(due) = s.next_deadline().filter(|d| *d <= until) {
            out.extend(s.poll(due, fs.probe()));
        }
        out
    }

    #[test]
    fn a_written_file_waits_for_its_close_however_long_it_looks_complete() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        // A recorder that wrote a consistent header and the file's whole length, and fills in
        // its samples a block a second: between its writes the file looks complete.
        fs.set("a.wav", 81964, 1, Ok(()));
        s.note(Path::new("a.wav"), Touch::Weak, t0);
        s.note(Path::new("a.wav"), Touch::Written, t0 + ms(1));
        let out = poll_until(&mut s, &fs, t0 + 50 * SETTLE);
        assert!(out.is_empty(), "ingested while a writer holds it: {out:?}");
        let pending = s.pending();
        assert_eq!(pending.len(), 1);
        assert!(
            pending[0]
                .why
                .contains("waiting for its writer to close it"),
            "{}",
            pending[0].why
        );
        // Its close lets it go on the first probe.
        s.note(Path::new("a.wav"), Touch::Closed, t0 + 50 * SETTLE);
        assert_eq!(
            ready_paths(&s.poll(t0 + 50 * SETTLE, fs.probe())),
            [Path::new("a.wav")]
        );
    }

    #[test]
    fn a_file_written_and_never_closed_is_quarantined_as_held_open() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("a.wav", 81964, 1, Ok(()));
        s.note(Path::new("a.wav"), Touch::Written, t0);
        assert!(poll_until(&mut s, &fs, t0 + QUARANTINE - ms(1)).is_empty());
        match poll_until(&mut s, &fs, t0 + QUARANTINE).as_slice() {
            [Settled::Quarantine {
                path,
                after_s: 300,
                detail: Incomplete::Open,
            }] => assert_eq!(path, Path::new("a.wav")),
            other => panic!("expected a quarantine as held open, got {other:?}"),
        }
        assert!(Incomplete::Open.to_string().contains("never closed"));
    }

    #[test]
    fn lost_events_drop_what_was_known_of_open_writers() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        fs.set("a.wav", 81964, 1, Ok(()));
        s.note(Path::new("a.wav"), Touch::Written, t0);
        assert!(poll_until(&mut s, &fs, t0 + 3 * SETTLE).is_empty());
        // The queue overflowed: the close may have been among the events lost, so the file
        // settles by the weak rule (unchanged for a whole window).
        s.events_lost();
        let out = poll_until(&mut s, &fs, t0 + 10 * SETTLE);
        assert_eq!(ready_paths(&out), [Path::new("a.wav")]);
    }

    #[test]
    fn a_closed_file_still_truncated_a_window_after_its_close_goes_to_be_quarantined() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let mut s = Settler::new(SETTLE, QUARANTINE);
        let truncated = DecodeError::Truncated {
            chunk: crate::decode::ChunkId(*b"data"),
            declared: 81920,
            present: 30000,
        };
        fs.set("cut.wav", 30044, 1, Err(truncated.clone()));
        fs.set("fixed.wav", 30044, 1, Err(truncated));
        s.note(Path::new("cut.wav"), Touch::Closed, t0);
        s.note(Path::new("fixed.wav"), Touch::Closed, t0);
        assert!(
            s.poll(t0, fs.probe()).is_empty(),
            "a window for a writer to come back"
        );
        // One writer reopens at once to finish its file: its touch cancels the close's window.
        s.note(Path::new("fixed.wav"), Touch::Written, t0 + ms(50));
        // The other goes a window after its close (the engine quarantines it with the decoder's
        // reason, as `rebuild` does), not after `quarantine_after`.
        let out = poll_until(&mut s, &fs, t0 + SETTLE);
        assert_eq!(ready_paths(&out), [Path::new("cut.wav")]);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn a_listed_file_incomplete_since_long_before_is_quarantined_at_its_first_probe() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
        let mut s = Settler::new(SETTLE, QUARANTINE);
        // Last written an hour before the listing, and one written a minute before it.
        fs.set(
            "old.wav",
            44,
            10_000 - 3600,
            Err(DecodeError::PlaceholderSizes),
        );
        fs.set(
            "young.wav",
            44,
            10_000 - 60,
            Err(DecodeError::PlaceholderSizes),
        );
        s.found(Path::new("old.wav"), t0, wall);
        s.found(Path::new("young.wav"), t0, wall);
        let out = s.poll(t0, fs.probe());
        assert!(
            matches!(out.as_slice(), [Settled::Quarantine { path, .. }] if path == Path::new("old.wav")),
            "{out:?}"
        );
        // The younger one waits out what is left of the time since its mtime.
        let left = QUARANTINE - Duration::from_secs(60);
        assert!(poll_until(&mut s, &fs, t0 + left - ms(1)).is_empty());
        assert!(matches!(
            poll_until(&mut s, &fs, t0 + left).as_slice(),
            [Settled::Quarantine { .. }]
        ));
    }

    #[test]
    fn a_listed_file_the_kernel_says_is_held_for_writing_waits_for_its_close() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
        let mut s = Settler::new(SETTLE, QUARANTINE);
        // Found in a folder that appeared with it, unchanged for a minute, its header
        // consistent: by the weak rule it would go at once. A writer holds it.
        fs.set_held("a.wav", 81964, 10_000 - 60, Ok(()), Some(true));
        // Granted leases (Some(false)) prove nothing (a writer on another host of a network
        // file system is not counted): the weak rule applies.
        fs.set_held("b.wav", 81964, 10_000 - 60, Ok(()), Some(false));
        s.found(Path::new("a.wav"), t0, wall);
        s.found(Path::new("b.wav"), t0, wall);
        assert_eq!(ready_paths(&s.poll(t0, fs.probe())), [Path::new("b.wav")]);
        fs.set_held("a.wav", 81964, 10_000 - 60, Ok(()), None);
        assert!(poll_until(&mut s, &fs, t0 + 20 * SETTLE).is_empty());
        s.note(Path::new("a.wav"), Touch::Closed, t0 + 20 * SETTLE);
        assert_eq!(
            ready_paths(&s.poll(t0 + 20 * SETTLE, fs.probe())),
            [Path::new("a.wav")]
        );
    }

    #[test]
    fn an_unfinished_file_no_process_holds_goes_to_be_quarantined_a_window_later() {
        let fs = FakeFs::new();
        let t0 = Instant::now();
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
        let mut s = Settler::new(SETTLE, QUARANTINE);
        // Found (its close came before the watch on its folder), truncated, written a moment
        // before: no writer holds it, so it is as complete as it will get.
        let cut = Err(DecodeError::PlaceholderSizes);
        fs.set_held("cut.wav", 30044, 10_000, cut.clone(), Some(false));
        // The kernel cannot say for this one: it waits for its header as before.
        fs.set_held("unknown.wav", 30044, 10_000, cut, None);
        s.found(Path::new("cut.wav"), t0, wall);
        s.found(Path::new("unknown.wav"), t0, wall);
        assert!(s.poll(t0, fs.probe()).is_empty());
        let out = poll_until(&mut s, &fs, t0 + SETTLE);
        assert_eq!(ready_paths(&out), [Path::new("cut.wav")]);
        assert!(poll_until(&mut s, &fs, t0 + 100 * SETTLE).is_empty());
    }
}
