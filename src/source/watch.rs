//! Watch: the first stage. Follows the recordings tree through inotify (notify's watcher, one
//! watch per folder) and reports what happened to `.wav` files and to folders as [`WatchEvent`]s. It says
//! what changed, never whether a file is complete: that is [`crate::source::settle`].
//!
//! Paths in events are **relative to the watched root** (`LEAK/S001~R1~20250118120530~100.wav`),
//! the same key the manifest and the `source_path` column use; join them to
//! [`Watcher::root`] to open the file.
//!
//! What the consumer can rely on:
//!
//! - every `.wav` (any case) created, written, closed after writing or moved into the tree gives a
//!   [`WatchEvent::Touched`], at least once; duplicates are normal and the consumer dedupes;
//! - a `.wav` deleted or moved away gives [`WatchEvent::Removed`]; a folder deleted or moved away
//!   gives [`WatchEvent::RemovedDir`] (everything under it is gone, whatever else was reported);
//! - whenever events may have been lost (kernel queue overflow, watch limit, any watcher error),
//!   a [`WatchEvent::Rescan`] says why: the consumer then rescans the whole tree. Runtime trouble
//!   never stops the watcher (watchexec's split: only [`Watcher::start`] fails, critically).
//!
//! Files that exist when [`Watcher::start`] returns are not reported: start the watcher first,
//! then scan the tree, so nothing falls between the two.
//!
//! Threads: notify's inotify loop hands raw events to one worker of ours (`ailhd-watch`), which
//! translates them and may walk a new folder; stopping joins it.

use std::collections::{BTreeMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};

use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind, RemoveKind, RenameMode};
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher as _};
use walkdir::WalkDir;

/// How a file was touched. The settle stage treats [`is_strong`](TouchKind::is_strong) kinds as
/// evidence that the writer is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TouchKind {
    /// Created (IN_CREATE): a writer may follow, or none (a hard link).
    Created,
    /// Written (IN_MODIFY): a writer holds it open; it is done once a close follows.
    Written,
    /// Closed after writing (IN_CLOSE_WRITE).
    Closed,
    /// Renamed into place (the target of a rename, IN_MOVED_TO).
    MovedIn,
    /// Listed by a walk of a folder that was created; its state is unknown.
    Found,
}

impl TouchKind {
    /// Closed after writing or moved into place.
    pub fn is_strong(self) -> bool {
        matches!(self, TouchKind::Closed | TouchKind::MovedIn)
    }

    /// How the settle stage weighs it.
    pub fn touch(self) -> crate::source::settle::Touch {
        use crate::source::settle::Touch;
        match self {
            TouchKind::Created | TouchKind::Found => Touch::Weak,
            TouchKind::Written => Touch::Written,
            TouchKind::Closed | TouchKind::MovedIn => Touch::Closed,
        }
    }
}

/// What happened under the root. Paths are relative to the root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// A `.wav` was created, written, closed after writing, moved in, or listed in a folder that
    /// appeared (created or moved in). Says nothing about completeness: see [`crate::source::settle`].
    Touched { path: PathBuf, kind: TouchKind },
    /// A `.wav` file was deleted or moved away (the source of a rename).
    Removed(PathBuf),
    /// A folder was deleted or moved away: every file under it is gone. Events for the files
    /// inside may or may not precede it (a deletion reports them, a move does not).
    RemovedDir(PathBuf),
    /// Events may have been lost (queue overflow, watch limit, watcher error, the root itself
    /// removed): rescan the whole tree. `reason` is for the log and carries the advice.
    Rescan { reason: String },
    /// A `.wav`'s attributes changed (chmod, chown, times), not its bytes: one that could not
    /// be read for want of a permission may be readable now.
    Attributes(PathBuf),
}

/// Where a [`Watcher`] delivers its events: a channel sender. `send_event` returns false once the
/// receiver is gone, and the watcher then stops delivering. Use an unbounded channel, or keep
/// draining until [`Watcher::stop`] returns: stopping waits for a send in progress.
pub trait EventSink: Send + 'static {
    fn send_event(&self, event: WatchEvent) -> bool;
}

impl EventSink for crossbeam_channel::Sender<WatchEvent> {
    fn send_event(&self, event: WatchEvent) -> bool {
        self.send(event).is_ok()
    }
}

impl EventSink for std::sync::mpsc::Sender<WatchEvent> {
    fn send_event(&self, event: WatchEvent) -> bool {
        self.send(event).is_ok()
    }
}

impl EventSink for tokio::sync::mpsc::UnboundedSender<WatchEvent> {
    fn send_event(&self, event: WatchEvent) -> bool {
        self.send(event).is_ok()
    }
}

/// A watcher that could not start. Its Display names the path and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("cannot watch {}: not a directory (check paths.recordings)", .path.display())]
    NotADirectory { path: PathBuf },
    #[error("cannot watch {}: {advice}", .path.display())]
    Watch {
        path: PathBuf,
        /// What went wrong, in words an operator can act on (see [`explain`]).
        advice: String,
        #[source]
        source: notify::Error,
    },
}

impl WatchError {
    fn from_notify(root: &Path, err: notify::Error) -> WatchError {
        WatchError::Watch {
            // notify names the sub-folder that failed (e.g. the one that hit the limit).
            path: err.paths.first().cloned().unwrap_or_else(|| root.into()),
            advice: explain(&err),
            source: err,
        }
    }
}

/// Advice for the errno values inotify is known to fail with, as watchexec does: the kernel's
/// own words ("No space left on device" for a watch limit) send operators the wrong way.
pub fn errno_advice(errno: i32) -> Option<&'static str> {
    Some(match errno {
        libc::ENOSPC => {
            "inotify watch limit reached: raise fs.inotify.max_user_watches \
             (sysctl fs.inotify.max_user_watches=524288)"
        }
        libc::EMFILE => {
            "too many inotify instances: raise fs.inotify.max_user_instances \
             (sysctl fs.inotify.max_user_instances=512), or the open-file limit \
             (LimitNOFILE= in the systemd unit)"
        }
        libc::ENFILE => "system-wide open-file limit reached: raise fs.file-max",
        libc::ENOMEM => "the kernel is out of memory for inotify watches",
        libc::EACCES | libc::EPERM => {
            "permission denied: the service user must be able to read every folder under \
             paths.recordings"
        }
        libc::ENOENT => "no such file or directory (check paths.recordings)",
        _ => return None,
    })
}

/// One line for a notify error: advice where we have it, notify's words otherwise.
pub fn explain(err: &notify::Error) -> String {
    match &err.kind {
        // notify turns ENOSPC from inotify_add_watch into this kind.
        notify::ErrorKind::MaxFilesWatch => errno_advice(libc::ENOSPC).unwrap_or_default().into(),
        notify::ErrorKind::PathNotFound => errno_advice(libc::ENOENT).unwrap_or_default().into(),
        notify::ErrorKind::Io(io) => explain_io(io),
        notify::ErrorKind::Generic(text) => text.clone(),
        _ => err.to_string(),
    }
}

fn explain_io(err: &io::Error) -> String {
    match err.raw_os_error().and_then(errno_advice) {
        Some(advice) => advice.into(),
        None => err.to_string(),
    }
}

const QUEUE_OVERFLOW: &str = "inotify event queue overflowed, events were lost \
     (if this repeats, raise fs.inotify.max_queued_events)";

/// True for `*.wav`, any case: the only files this daemon ingests. The rescan uses it too, so the
/// watcher and the scan agree on what a recording is.
pub fn is_wav(path: &Path) -> bool {
    path.extension()
        .is_some_and(|ext| ext.eq_ignore_ascii_case("wav"))
}

/// Folders that could not be watched (inotify's limits), with the reason: the service retries
/// them and rescans meanwhile (docs/operations.md).
pub type Unwatched = Arc<Mutex<BTreeMap<PathBuf, String>>>;

/// True for the errors a watch limit gives (as opposed to a missing or unreadable folder).
pub fn is_limit(err: &notify::Error) -> bool {
    match &err.kind {
        notify::ErrorKind::MaxFilesWatch => true,
        notify::ErrorKind::Io(io) => matches!(
            io.raw_os_error(),
            Some(libc::ENOSPC | libc::EMFILE | libc::ENFILE | libc::ENOMEM)
        ),
        _ => false,
    }
}

/// Watches a tree until stopped or dropped. Events go to the sink given to [`Watcher::start`].
pub struct Watcher {
    /// Folders not watched for now (limits); see [`Watcher::retry_unwatched`].
    unwatched: Unwatched,
    root: PathBuf,
    /// `None` once stopped. Shared with the worker, which adds watches for new folders itself;
    /// taking it out (and dropping it) is what ends the worker.
    notify: Arc<Mutex<Option<RecommendedWatcher>>>,
    /// Tells the worker to stop mid-walk: a folder of 100 000 files moved in should not delay
    /// shutdown.
    stopping: Arc<AtomicBool>,
    worker: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Starts watching `root` and every folder below it. Returns once every existing folder is
    /// watched (without a stat of any file: see [`watch_tree`]); events
    /// from then on go to `sink`, with paths relative to `root`. Fails when `root` cannot be
    /// watched (missing, not a folder, unreadable, inotify limits): the error says what to do.
    pub fn start(root: &Path, sink: impl EventSink) -> Result<Watcher, WatchError> {
        let root = std::path::absolute(root).map_err(|e| WatchError::Watch {
            path: root.into(),
            advice: explain_io(&e),
            source: notify::Error::io(e),
        })?;
        match std::fs::metadata(&root) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => return Err(WatchError::NotADirectory { path: root }),
            Err(e) => {
                return Err(WatchError::Watch {
                    path: root,
                    advice: explain_io(&e),
                    source: notify::Error::io(e),
                })
            }
        }

        // notify calls the handler on its own thread; hand the raw events to our worker so
        // walking a new folder never holds up notify's read of the kernel queue.
        let (raw_tx, raw_rx) = crossbeam_channel::unbounded();
        // Symbolic links are not followed (docs/design.md, "Identity, labels, splits"): a link named
        // `*.wav` is reported like a file and rejected by the source rule.
        let mut inner = RecommendedWatcher::new(
            move |res| {
                let _ = raw_tx.send(res);
            },
            notify::Config::default().with_follow_symlinks(false),
        )
        .map_err(|e| WatchError::from_notify(&root, e))?;
        let unwatched = Unwatched::default();
        let dirs = watch_tree(&mut inner, &root, &unwatched)?;

        let notify = Arc::new(Mutex::new(Some(inner)));
        let stopping = Arc::new(AtomicBool::new(false));
        let rewatch = {
            let notify = Arc::clone(&notify);
            move |dir: &Path| match notify
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_mut()
            {
                Some(watcher) => watcher.watch(dir, RecursiveMode::Recursive),
                None => Ok(()),
            }
        };
        let translator = Translator {
            root: root.clone(),
            dirs,
            rewatch: Box::new(rewatch),
            stopping: Arc::clone(&stopping),
            unwatched: Arc::clone(&unwatched),
        };

        let worker = thread::Builder::new()
            .name("ailhd-watch".into())
            .spawn(move || translator.run(raw_rx, sink))
            .map_err(|e| WatchError::Watch {
                path: root.clone(),
                advice: explain_io(&e),
                source: notify::Error::io(e),
            })?;
        Ok(Watcher {
            unwatched,
            root,
            notify,
            stopping,
            worker: Some(worker),
        })
    }

    /// A watcher of `root` that watches nothing yet: for a recordings folder that is not there
    /// when the service starts (a disk not mounted yet). The service starts a real one once the
    /// folder appears ([`Watcher::start`]).
    pub fn waiting(root: &Path) -> Watcher {
        Watcher {
            unwatched: Unwatched::default(),
            root: std::path::absolute(root).unwrap_or_else(|_| root.to_path_buf()),
            notify: Arc::new(Mutex::new(None)),
            stopping: Arc::new(AtomicBool::new(false)),
            worker: None,
        }
    }

    /// The watched root, made absolute. Event paths are relative to it.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Folders not watched for now, with why.
    pub fn unwatched(&self) -> Vec<(PathBuf, String)> {
        let list = self
            .unwatched
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        list.iter().map(|(p, r)| (p.clone(), r.clone())).collect()
    }

    /// Try to watch the unwatched folders again; returns how many are watched now (events in
    /// them may have been missed meanwhile: rescan).
    pub fn retry_unwatched(&self) -> usize {
        let dirs: Vec<PathBuf> = self
            .unwatched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect();
        let mut watched = 0;
        for dir in dirs {
            let result = match self
                .notify
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_mut()
            {
                Some(w) if dir.is_dir() => w.watch(&dir, RecursiveMode::Recursive),
                // Gone, or stopping: nothing to watch.
                _ => Ok(()),
            };
            let mut list = self
                .unwatched
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            match result {
                Ok(()) => {
                    list.remove(&dir);
                    watched += 1;
                    log::info!("{} is watched now", dir.display());
                }
                Err(e) => {
                    list.insert(dir.clone(), WatchError::from_notify(&dir, e).to_string());
                }
            }
        }
        watched
    }

    /// Stops watching. When it returns, no further event will be sent and the sink is dropped
    /// (a receiver sees the channel close). Dropping the watcher does the same.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stopping.store(true, Ordering::Relaxed);
        // Dropping notify's watcher ends its thread, which drops our handler and so closes the
        // raw channel: that is what lets the worker's loop end.
        let inner = self
            .notify
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(inner);
        if let Some(worker) = self.worker.take() {
            if worker.join().is_err() {
                log::error!("the file watcher's worker thread panicked");
            }
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Watches `root` and every folder below it, one non-recursive watch each, and returns the
/// folders (relative; the root is not among them). Folders are told apart by their directory
/// entries' types: notify's recursive watch stats every file of the tree, which cost 0.7 s of
/// CPU at 200,000 recordings before the service could take a new file. Each folder is watched
/// before it is listed, so a sub-folder created meanwhile is either listed here or reported by
/// its parent's watch (and then watched by [`Translator::dir_appeared`]).
///
/// Only the root's failure is fatal. A folder a watch limit refuses, or one that cannot be
/// watched or listed for now (no permission, an I/O error), is left in `unwatched` (the service
/// retries it and rescans meanwhile, and its recorded recordings keep their rows); one that
/// vanished meanwhile is skipped.
fn watch_tree(
    inner: &mut RecommendedWatcher,
    root: &Path,
    unwatched: &Unwatched,
) -> Result<HashSet<PathBuf>, WatchError> {
    let mut dirs = HashSet::new();
    let mut queue = std::collections::VecDeque::from([root.to_path_buf()]);
    while let Some(dir) = queue.pop_front() {
        let is_root = dir == root;
        let not_now = |e: WatchError| {
            log::warn!("{e}; retrying, and rescanning the tree until it is watched");
            unwatched
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(dir.clone(), e.to_string());
        };
        match inner.watch(&dir, RecursiveMode::NonRecursive) {
            Ok(()) => {}
            Err(e) if !is_root && matches!(e.kind, notify::ErrorKind::PathNotFound) => continue,
            Err(e) if !is_root && is_not_found(&e) => continue,
            // A limit is not a reason to stop: the folder is retried and rescanned meanwhile.
            Err(e) if is_limit(&e) => not_now(WatchError::from_notify(&dir, e)),
            // Nor is one folder that cannot be watched (no permission, say): the others are.
            // It cannot be listed either, so its sub-folders wait for it.
            Err(e) if !is_root => {
                not_now(WatchError::from_notify(&dir, e));
                continue;
            }
            Err(e) => return Err(WatchError::from_notify(&dir, e)),
        }
        // A folder's link count is 2 + its sub-folders on the usual Linux file systems (ext4,
        // xfs, tmpfs): 2 means none, and its (often huge) listing is skipped. A sub-folder made
        // after this is reported by the folder's watch, set up above. Other counts (btrfs and
        // some FUSE file systems say 1) mean "unknown": listed.
        if !is_root && has_no_subfolders(&dir) {
            continue;
        }
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if !is_root && e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                let e = WatchError::Watch {
                    path: dir.clone(),
                    advice: explain_io(&e),
                    source: notify::Error::io(e),
                };
                if is_root {
                    return Err(e);
                }
                not_now(e);
                continue;
            }
        };
        for entry in entries.flatten() {
            // The entry's type comes with the listing (d_type): no stat. Links are not followed.
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                let path = entry.path();
                if let Ok(rel) = path.strip_prefix(root) {
                    dirs.insert(rel.to_path_buf());
                }
                queue.push_back(path);
            }
        }
    }
    Ok(dirs)
}

/// The folder's link count says it has no sub-folders (see [`watch_tree`]).
fn has_no_subfolders(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir() && m.nlink() == 2)
}

fn is_not_found(err: &notify::Error) -> bool {
    matches!(&err.kind, notify::ErrorKind::Io(io) if io.kind() == io::ErrorKind::NotFound)
}

type Rewatch = Box<dyn FnMut(&Path) -> notify::Result<()> + Send>;

/// Turns notify's raw events into [`WatchEvent`]s. Separate from the thread that drives it so its
/// rules can be tested on made-up events.
struct Translator {
    /// Absolute; notify reports absolute paths under it.
    root: PathBuf,
    /// Every folder under the root (relative), so the source of a rename can be told apart: notify
    /// does not say whether a path moved away was a file or a folder, and it is gone when we ask.
    dirs: HashSet<PathBuf>,
    /// Adds a recursive watch on a folder and returns once it exists.
    rewatch: Rewatch,
    stopping: Arc<AtomicBool>,
    unwatched: Unwatched,
}

impl Translator {
    fn run(
        mut self,
        raw: crossbeam_channel::Receiver<notify::Result<notify::Event>>,
        sink: impl EventSink,
    ) {
        let mut open = true;
        for res in raw.iter() {
            if self.stopping.load(Ordering::Relaxed) {
                break;
            }
            self.handle(res, &mut |event| {
                if open {
                    log::trace!("watch: {event:?}");
                    open = sink.send_event(event);
                }
            });
            if !open {
                log::debug!("watch: the event receiver is gone, no longer delivering");
                break;
            }
        }
    }

    fn handle(&mut self, res: notify::Result<notify::Event>, emit: &mut dyn FnMut(WatchEvent)) {
        let event = match res {
            Ok(event) => event,
            Err(err) => {
                let reason = match err.paths.first() {
                    Some(path) => format!(
                        "file watcher error at {}: {}",
                        path.display(),
                        explain(&err)
                    ),
                    None => format!("file watcher error: {}", explain(&err)),
                };
                emit(WatchEvent::Rescan { reason });
                return;
            }
        };
        if event.need_rescan() {
            emit(WatchEvent::Rescan {
                reason: QUEUE_OVERFLOW.into(),
            });
        }
        // A rename pair is also reported as separate From and To events; handle those.
        if let EventKind::Modify(ModifyKind::Name(RenameMode::Both)) = event.kind {
            return;
        }
        for abs in &event.paths {
            let Ok(rel) = abs.strip_prefix(&self.root) else {
                log::debug!("watch: event outside the root: {}", abs.display());
                continue;
            };
            let rel = rel.to_path_buf();
            if rel.as_os_str().is_empty() {
                if matches!(
                    event.kind,
                    EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_))
                ) {
                    emit(WatchEvent::Rescan {
                        reason: format!(
                            "the recordings root {} was removed or moved away; nothing is watched \
                             there until it is back (the service looks every 10 s, and watches \
                             it anew)",
                            self.root.display()
                        ),
                    });
                }
                continue;
            }
            match event.kind {
                EventKind::Create(CreateKind::Folder) => {
                    self.dir_appeared(abs, rel, TouchKind::Found, emit)
                }
                EventKind::Create(_) => touched(rel, TouchKind::Created, emit),
                EventKind::Modify(ModifyKind::Data(_)) => touched(rel, TouchKind::Written, emit),
                EventKind::Access(AccessKind::Close(AccessMode::Write)) => {
                    touched(rel, TouchKind::Closed, emit)
                }
                EventKind::Modify(ModifyKind::Name(RenameMode::From)) => self.gone(rel, emit),
                EventKind::Modify(ModifyKind::Name(RenameMode::To)) => self.arrived(abs, rel, emit),
                // Not produced by the inotify backend, which always says which side it is.
                EventKind::Modify(ModifyKind::Name(_)) => {
                    if abs.exists() {
                        self.arrived(abs, rel, emit)
                    } else {
                        self.gone(rel, emit)
                    }
                }
                EventKind::Remove(RemoveKind::Folder) => self.dir_gone(rel, emit),
                EventKind::Remove(_) => self.gone(rel, emit),
                EventKind::Modify(ModifyKind::Metadata(_)) if is_wav(&rel) => {
                    emit(WatchEvent::Attributes(rel))
                }
                // Opens and read-only closes (and a folder's attributes): the bytes did not change.
                _ => {}
            }
        }
    }

    /// A folder created (its files are `Found`: some may still be written) or moved in (its
    /// files are `MovedIn`: renamed into place with the folder).
    fn dir_appeared(
        &mut self,
        abs: &Path,
        rel: PathBuf,
        files: TouchKind,
        emit: &mut dyn FnMut(WatchEvent),
    ) {
        self.dirs.insert(rel.clone());
        // notify adds the watch for a new folder only after it has handed out the batch of events
        // that announced the folder, so files written right after `mkdir -p` can be created
        // unseen. Add the watch ourselves (this returns once it exists), then list what is
        // already there: anything created later raises its own events.
        if let Err(err) = (self.rewatch)(abs) {
            match err.kind {
                // Gone again already; its removal is (or will be) reported.
                notify::ErrorKind::PathNotFound => return,
                _ if is_not_found(&err) => return,
                // A limit, or a folder that cannot be watched for now (no permission, say):
                // retried, and the tree rescanned meanwhile.
                _ => {
                    let reason = WatchError::from_notify(abs, err).to_string();
                    self.unwatched
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(abs.to_path_buf(), reason.clone());
                    emit(WatchEvent::Rescan {
                        reason: format!(
                            "cannot watch new folder {}: {reason}; retrying",
                            rel.display()
                        ),
                    })
                }
            }
        }
        self.walk(abs, Some(files), emit);
    }

    fn arrived(&mut self, abs: &Path, rel: PathBuf, emit: &mut dyn FnMut(WatchEvent)) {
        match std::fs::symlink_metadata(abs) {
            // A folder moved in: its files were renamed into place with it, as complete as a
            // file renamed alone (docs/design.md: a complete file is one "closed, or renamed into
            // place"). Each is still probed (header consistent with its size) before it goes, and a
            // writer that goes on writing raises events in the now-watched folder, so its new
            // bytes supersede the row.
            Ok(meta) if meta.is_dir() => self.dir_appeared(abs, rel, TouchKind::MovedIn, emit),
            _ => touched(rel, TouchKind::MovedIn, emit),
        }
    }

    fn gone(&mut self, rel: PathBuf, emit: &mut dyn FnMut(WatchEvent)) {
        if self.dirs.contains(&rel) {
            self.dir_gone(rel, emit);
        } else if is_wav(&rel) {
            emit(WatchEvent::Removed(rel));
        }
    }

    fn dir_gone(&mut self, rel: PathBuf, emit: &mut dyn FnMut(WatchEvent)) {
        self.dirs.retain(|dir| !dir.starts_with(&rel));
        emit(WatchEvent::RemovedDir(rel));
    }

    /// Records every folder under `abs` and, with `files`, reports every `.wav` in it as touched
    /// that way.
    fn walk(&mut self, abs: &Path, files: Option<TouchKind>, emit: &mut dyn FnMut(WatchEvent)) {
        // Links are not followed, as notify is told.
        for entry in WalkDir::new(abs).follow_links(false) {
            if self.stopping.load(Ordering::Relaxed) {
                return;
            }
            let entry = match entry {
                Ok(entry) => entry,
                Err(err) => {
                    // Vanishing entries are normal while the tree changes; anything else (an
                    // unreadable folder) is worth a line, and the rescan will meet it too.
                    if err.io_error().map(io::Error::kind) != Some(io::ErrorKind::NotFound) {
                        log::warn!("watch: cannot list {}: {err}", abs.display());
                    }
                    continue;
                }
            };
            let Ok(rel) = entry.path().strip_prefix(&self.root) else {
                continue;
            };
            let file_type = entry.file_type();
            if file_type.is_dir() {
                self.dirs.insert(rel.to_path_buf());
            } else if let Some(kind) = files.filter(|_| is_wav(rel)) {
                emit(WatchEvent::Touched {
                    path: rel.to_path_buf(),
                    kind,
                });
            }
        }
    }
}

fn touched(rel: PathBuf, kind: TouchKind, emit: &mut dyn FnMut(WatchEvent)) {
    if is_wav(&rel) {
        emit(WatchEvent::Touched { path: rel, kind });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use notify::event::{DataChange, Flag, MetadataKind};
    use notify::Event;

    fn translator(root: &Path) -> Translator {
        Translator {
            root: root.into(),
            dirs: HashSet::new(),
            rewatch: Box::new(|_| Ok(())),
            stopping: Arc::new(AtomicBool::new(false)),
            unwatched: Unwatched::default(),
        }
    }

    fn feed(tr: &mut Translator, res: notify::Result<Event>) -> Vec<WatchEvent> {
        let mut out = Vec::new();
        tr.handle(res, &mut |e| out.push(e));
        out
    }

    fn ev(kind: EventKind, path: &str) -> notify::Result<Event> {
        Ok(Event::new(kind).add_path(PathBuf::from(path)))
    }

    fn touch(path: &str, kind: TouchKind) -> WatchEvent {
        WatchEvent::Touched {
            path: path.into(),
            kind,
        }
    }

    #[test]
    fn wav_extension_any_case() {
        assert!(is_wav(Path::new("LEAK/a.wav")));
        assert!(is_wav(Path::new("LEAK/a.WAV")));
        assert!(is_wav(Path::new("a.Wav")));
        assert!(!is_wav(Path::new("a.wav.part")));
        assert!(!is_wav(Path::new("wav")));
        assert!(!is_wav(Path::new(".wav")));
        assert!(!is_wav(Path::new("LEAK/a.txt")));
    }

    #[test]
    fn file_events_map_to_touch_kinds() {
        let mut tr = translator(Path::new("/r"));
        let close = EventKind::Access(AccessKind::Close(AccessMode::Write));
        let data = EventKind::Modify(ModifyKind::Data(DataChange::Any));
        assert_eq!(
            feed(
                &mut tr,
                ev(EventKind::Create(CreateKind::File), "/r/L/a.wav")
            ),
            [touch("L/a.wav", TouchKind::Created)]
        );
        assert_eq!(
            feed(&mut tr, ev(data, "/r/L/a.wav")),
            [touch("L/a.wav", TouchKind::Written)]
        );
        assert_eq!(
            feed(&mut tr, ev(close, "/r/L/a.wav")),
            [touch("L/a.wav", TouchKind::Closed)]
        );
        assert_eq!(feed(&mut tr, ev(close, "/r/L/a.txt")), []);
        let read_close = EventKind::Access(AccessKind::Close(AccessMode::Read));
        assert_eq!(feed(&mut tr, ev(read_close, "/r/L/a.wav")), []);
        // chmod, chown, utime: said apart from the bytes' changes, for .wav files only.
        let attrib = EventKind::Modify(ModifyKind::Metadata(MetadataKind::Any));
        assert_eq!(
            feed(&mut tr, ev(attrib, "/r/L/a.wav")),
            [WatchEvent::Attributes(PathBuf::from("L/a.wav"))]
        );
        assert_eq!(feed(&mut tr, ev(attrib, "/r/L")), []);
    }

    #[test]
    fn overflow_and_errors_ask_for_a_rescan_with_advice() {
        let mut tr = translator(Path::new("/r"));
        let overflow = Event::new(EventKind::Other).set_flag(Flag::Rescan);
        match feed(&mut tr, Ok(overflow)).as_slice() {
            [WatchEvent::Rescan { reason }] => assert!(reason.contains("overflow"), "{reason}"),
            other => panic!("{other:?}"),
        }
        let limit = notify::Error::new(notify::ErrorKind::MaxFilesWatch)
            .add_path(PathBuf::from("/r/L/deep"));
        match feed(&mut tr, Err(limit)).as_slice() {
            [WatchEvent::Rescan { reason }] => {
                assert!(reason.contains("/r/L/deep"), "{reason}");
                assert!(reason.contains("fs.inotify.max_user_watches"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn limit_on_a_new_folder_asks_for_a_rescan() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("L")).unwrap();
        std::fs::write(root.path().join("L/a.wav"), b"x").unwrap();
        let mut tr = translator(root.path());
        tr.rewatch = Box::new(|_| Err(notify::Error::new(notify::ErrorKind::MaxFilesWatch)));
        let out = feed(
            &mut tr,
            Ok(Event::new(EventKind::Create(CreateKind::Folder)).add_path(root.path().join("L"))),
        );
        assert!(
            matches!(&out[0], WatchEvent::Rescan { reason } if reason.contains("max_user_watches")),
            "{out:?}"
        );
        // Still lists what is there, and keeps the folder for a retry.
        assert_eq!(out[1..], [touch("L/a.wav", TouchKind::Found)]);
        let unwatched = tr.unwatched.lock().unwrap();
        assert_eq!(
            unwatched.keys().cloned().collect::<Vec<_>>(),
            [root.path().join("L")]
        );
        assert!(unwatched[&root.path().join("L")].contains("max_user_watches"));
    }

    #[test]
    fn files_of_a_folder_moved_in_are_moved_in_and_of_a_created_one_found() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("L/day/sub")).unwrap();
        std::fs::write(root.path().join("L/day/a.wav"), b"x").unwrap();
        std::fs::write(root.path().join("L/day/sub/b.wav"), b"x").unwrap();
        std::fs::create_dir(root.path().join("M")).unwrap();
        std::fs::write(root.path().join("M/c.wav"), b"x").unwrap();
        let mut tr = translator(root.path());
        tr.rewatch = Box::new(|_| Ok(()));
        let to = EventKind::Modify(ModifyKind::Name(RenameMode::To));
        let mut out = feed(
            &mut tr,
            Ok(Event::new(to).add_path(root.path().join("L/day"))),
        );
        out.sort_by_key(|e| format!("{e:?}"));
        assert_eq!(
            out,
            [
                touch("L/day/a.wav", TouchKind::MovedIn),
                touch("L/day/sub/b.wav", TouchKind::MovedIn)
            ]
        );
        assert!(tr.dirs.contains(Path::new("L/day/sub")));
        let out = feed(
            &mut tr,
            Ok(Event::new(EventKind::Create(CreateKind::Folder)).add_path(root.path().join("M"))),
        );
        assert_eq!(out, [touch("M/c.wav", TouchKind::Found)]);
    }

    #[test]
    fn rename_source_is_a_folder_only_if_we_know_it() {
        let mut tr = translator(Path::new("/r"));
        tr.dirs.insert("L/day1".into());
        tr.dirs.insert("L/day1/sub".into());
        let from = EventKind::Modify(ModifyKind::Name(RenameMode::From));
        assert_eq!(
            feed(&mut tr, ev(from, "/r/L/day1")),
            [WatchEvent::RemovedDir("L/day1".into())]
        );
        assert!(tr.dirs.is_empty());
        assert_eq!(
            feed(&mut tr, ev(from, "/r/L/a.wav")),
            [WatchEvent::Removed("L/a.wav".into())]
        );
        // An unknown non-.wav source (a temp file) is nobody's business.
        assert_eq!(feed(&mut tr, ev(from, "/r/L/a.wav.part")), []);
    }

    #[test]
    fn removing_or_moving_the_root_asks_for_a_rescan() {
        let mut tr = translator(Path::new("/r"));
        for kind in [
            EventKind::Remove(RemoveKind::Folder),
            EventKind::Modify(ModifyKind::Name(RenameMode::From)),
        ] {
            assert!(matches!(
                feed(&mut tr, ev(kind, "/r")).as_slice(),
                [WatchEvent::Rescan { .. }]
            ));
        }
    }

    #[test]
    fn rename_pair_is_not_reported_twice() {
        let mut tr = translator(Path::new("/r"));
        let both = Event::new(EventKind::Modify(ModifyKind::Name(RenameMode::Both)))
            .add_path("/r/a.wav".into())
            .add_path("/r/b.wav".into());
        assert_eq!(feed(&mut tr, Ok(both)), []);
    }
}
