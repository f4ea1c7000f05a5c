//! The large-file lane: files above [`LANE_ABOVE`](crate::engine::stages::LANE_ABOVE) are loaded
//! by a thread of their own, one at a time, so that the batch they arrived in (and the batches
//! after it) do not wait for their hash: a 1.5 GB file takes about a second to hash, the
//! recordings beside it are committed on time. Its results are decided as batches of their own
//! when they are ready.
//!
//! Order: a later input about the same path (new bytes, a removal, the folder gone) makes the
//! lane's result for it stale, and a stale result is dropped; so every path's last input counts,
//! as it does within one batch, and the ledger's rules make the end state independent of the
//! order in which paths were decided (run == rebuild).

use crate::config::{FeatureSettings, FeatureShape};
use crate::engine::inflight::{Entry, Journal, Slot};
use crate::engine::outcome::Observation;
use crate::engine::stages::{self, StageTimes};
use crossbeam_channel::{Receiver, Sender};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// A large file, open, to load.
pub struct Job {
    pub rel: String,
    pub seen: Option<Instant>,
    pub file: std::fs::File,
    pub meta: std::fs::Metadata,
}

/// What loading a job gave.
pub struct Finished {
    gen: u64,
    pub observation: Observation,
}

/// What the lane's thread needs.
pub struct Context {
    pub features: FeatureSettings,
    pub shape: FeatureShape,
    pub times: Arc<StageTimes>,
    pub journal: Arc<Journal>,
}

pub struct Lane {
    context: Option<Context>,
    jobs: Option<Sender<(u64, Job)>>,
    results: Receiver<Finished>,
    results_tx: Sender<Finished>,
    thread: Option<JoinHandle<()>>,
    /// Jobs sent whose results were not taken yet.
    pending: usize,
    /// The generation of each path's newest job (absent: its result, if any, is stale).
    latest: HashMap<String, u64>,
    next: u64,
    /// Set when the engine goes: the jobs queued are dropped unread.
    stop: Arc<AtomicBool>,
}

impl Lane {
    pub fn new(context: Context) -> Lane {
        let (results_tx, results) = crossbeam_channel::unbounded();
        Lane {
            context: Some(context),
            jobs: None,
            results,
            results_tx,
            thread: None,
            pending: 0,
            latest: HashMap::new(),
            next: 0,
            stop: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Jobs whose results were not taken yet.
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// Where results arrive (to wait on with others).
    pub fn results(&self) -> &Receiver<Finished> {
        &self.results
    }

    /// Load `job` on the lane (the thread starts with the first job).
    pub fn send(&mut self, job: Job) {
        if self.jobs.is_none() {
            let (tx, rx) = crossbeam_channel::unbounded::<(u64, Job)>();
            let ctx = self.context.take().expect("the lane starts once");
            let out = self.results_tx.clone();
            let stop = self.stop.clone();
            self.thread = Some(
                std::thread::Builder::new()
                    .name("ailhd-large".into())
                    .spawn(move || run(ctx, rx, out, stop))
                    .expect("the large-file lane starts"),
            );
            self.jobs = Some(tx);
        }
        self.next += 1;
        self.latest.insert(job.rel.clone(), self.next);
        self.pending += 1;
        let sent = self
            .jobs
            .as_ref()
            .expect("started above")
            .send((self.next, job));
        if sent.is_err() {
            // The thread is gone (it panicked): nothing comes back for this job.
            self.pending -= 1;
        }
    }

    /// A later input about `rel` (None: about everything under `folder`) makes the lane's
    /// pending result for it stale.
    pub fn supersede(&mut self, rel: &str, folder: bool) {
        if self.latest.is_empty() {
            return;
        }
        if folder {
            let prefix = format!("{}/", rel.trim_end_matches('/'));
            self.latest.retain(|p, _| !p.starts_with(&prefix));
        } else {
            self.latest.remove(rel);
        }
    }

    /// A result received from [`Lane::results`]: its observation, unless a later input made it
    /// stale.
    pub fn take(&mut self, f: Finished) -> Option<Observation> {
        self.pending = self.pending.saturating_sub(1);
        let rel = f.observation.rel();
        if self.latest.get(rel) == Some(&f.gen) {
            self.latest.remove(rel);
            Some(f.observation)
        } else {
            None
        }
    }

    /// The results ready now.
    pub fn ready(&mut self) -> Vec<Observation> {
        let mut out = Vec::new();
        while let Ok(f) = self.results.try_recv() {
            out.extend(self.take(f));
        }
        out
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.jobs = None;
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.thread.take() {
            // The file being loaded is finished (at most a few seconds); the jobs queued behind
            // it are dropped unread.
            let _ = h.join();
        }
    }
}

fn run(ctx: Context, jobs: Receiver<(u64, Job)>, out: Sender<Finished>, stop: Arc<AtomicBool>) {
    // Below the batches in CPU priority (and so in I/O priority, which follows it where the
    // I/O scheduler has priorities): on a busy host the large file waits, the clips do not.
    // SAFETY: a plain system call on this thread; only a priority, so its result is not needed.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10);
    }
    while let Ok((gen, job)) = jobs.recv() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let entry = Entry::new(&job.rel, &job.meta, 0);
        let observation = {
            let _reading = ctx.journal.reading(Slot::Lane, vec![entry]);
            stages::load(
                Ok((job.file, job.meta)),
                job.rel,
                job.seen,
                &ctx.features,
                &ctx.shape,
                &ctx.times,
            )
        };
        if out.send(Finished { gen, observation }).is_err() {
            return;
        }
    }
}
