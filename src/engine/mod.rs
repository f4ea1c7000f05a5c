//! The ingest engine that `rebuild` and `run` both drive. A batch of inputs goes through four
//! stages, each busy at once with bounded queues between them:
//!
//! 1. load ([`stages::load`]): read, hash and decode the complete files, on a worker pool
//!    (the caller's thread waits for it, so the next batch loads while earlier ones go on);
//!    files over [`stages::LANE_ABOVE`] go to the [`lane`] and are decided when loaded; the
//!    files being read are listed in the [`inflight`] journal, for the next start if the
//!    process dies;
//! 2. decide ([`ledger`]): the rules turn the batch's observations into a [`ledger::Plan`];
//! 3. featurise ([`featurise`]): a thread of its own turns the plan's recordings into rows, a
//!    batch at a time through the featuriser's pipelined `submit`/`finish` (large batches in
//!    bulk, each micro-batch at once in the service), reusing the commit stage's row buffers;
//! 4. commit ([`commit`]): a thread of its own appends, edits and records the plan.
//!
//! `rebuild` is "ingest every file of the tree into empty staging outputs, then swap";
//! `run` is "ingest each micro-batch into the live outputs". Errors that stop the engine
//! (outputs or manifest unwritable, the featuriser failing) come back from [`Engine::submit`]
//! and [`Engine::wait`]; problems of one file are outcomes in the plan, never errors.

pub mod commit;
pub mod compact;
pub mod featurise;
pub mod inflight;
pub mod lane;
pub mod ledger;
pub mod manifest;
pub mod outcome;
#[cfg(test)]
mod property;
pub mod reconcile;
pub mod records;
pub mod recover;
pub mod stages;
pub mod trace;

use crate::config::{DeviceChoice, FeatureShape, Settings, SPLITS};
use crate::features::cuda::DeviceTimes;
use crate::features::{self, Featuriser};
use crate::identity::LabelSet;
use crate::output::set::OutputSet;
use crate::output::{check_features, check_label_ids, check_path_bytes, OutputHeader};
use anyhow::{bail, Context};
use commit::{Committer, Featurised};
use crossbeam_channel::{Receiver, Sender};
use ledger::{Counts, Ledger, Plan};
use manifest::Manifest;
use outcome::{Observation, Reason};
use rayon::prelude::*;
pub use reconcile::{reconcile_with, Reconciliation, TreeAbsent};
use stages::StageTimes;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
pub use trace::Trace;

/// Featurised plans that may wait for the commit stage, and be committed together.
const GROUP_MAX: usize = 8;

/// Files of a batch opened and read ahead at once, before the loaders read them.
const OPEN_AHEAD: usize = 128;

/// What the engine is given.
#[derive(Debug)]
pub enum Input {
    /// A complete file to load; `seen` is when it was seen complete (latency figures).
    Load { rel: String, seen: Option<Instant> },
    /// Something learnt without reading (gone, folder gone, rejected by the source).
    Observe(Observation),
}

/// An [`Input`] whose file, if it has one, is open and being read ahead (see [`OPEN_AHEAD`]).
enum OpenedInput {
    Load {
        rel: String,
        seen: Option<Instant>,
        file: stages::Opened,
    },
    Observe(Observation),
}

/// A batch made durable.
#[derive(Debug, Default)]
pub struct Done {
    pub counts: Counts,
    pub quarantined: Vec<(String, Reason)>,
    /// Paths to load again (their bytes' row is made anew in another split).
    pub reread: Vec<String>,
    /// Paths that may have changed without an event (other names of a file written in place:
    /// [`ledger::Plan::recheck`]): to look at again.
    pub recheck: Vec<String>,
    /// Completion-to-commit time of each file that got a row.
    pub latencies: Vec<Duration>,
    /// When the first of those files was seen complete, and when the batch passed each stage
    /// after that (what a slow batch waited for).
    pub first_seen: Option<Instant>,
    pub trace: Trace,
    /// Rows per split after this batch.
    pub rows: [u64; 3],
}

/// The context of an error of the featuriser (not of writing): the engine stopped, and the
/// featuriser was dropped.
#[derive(Debug, thiserror::Error)]
#[error("the featuriser ({device}) failed")]
pub struct FeaturiserFailed {
    pub device: String,
}

/// The featuriser an engine starts with: a new one for a device, or the warm one of a
/// suspended engine (no device set-up again after an idle close or a write failure).
pub enum Warm {
    Build(DeviceChoice),
    Keep(Box<dyn Featuriser>),
    /// After this engine's own clean close ([`Engine::suspend`]).
    Resume(Suspended),
}

/// What [`Engine::suspend`] hands back: the warm featuriser, and the rows each split held when
/// everything was committed, synced and closed. A reopen that finds the manifest at exactly
/// these rows has nothing to recover, adopt, cut or publish, and no write of this process left
/// unsynced: it skips those checks and their syncs (the first recording after an idle spell
/// waits for them; docs/benchmarks.md).
pub struct Suspended {
    featuriser: Box<dyn Featuriser>,
    rows: [u64; 3],
}

/// Empty staging outputs and manifest for `rebuild` ([`Engine::create_bulk`]).
pub struct BulkStores {
    outputs: OutputSet,
    manifest: Manifest,
    /// The label list the outputs were made with.
    labels: Vec<String>,
}

pub struct Engine {
    settings: Settings,
    shape: FeatureShape,
    ledger: Ledger,
    manifest: Arc<Manifest>,
    pool: rayon::ThreadPool,
    times: Arc<StageTimes>,
    device: String,
    to_featurise: Option<Sender<Plan>>,
    done: Receiver<anyhow::Result<Done>>,
    featurising: Option<JoinHandle<featurise::Stopped>>,
    writing: Option<JoinHandle<anyhow::Result<Committer>>>,
    /// Batches submitted and not yet reported done, oldest first (their results come back in
    /// order): the files of each, removals not counted.
    in_flight: std::collections::VecDeque<usize>,
    /// Which files are being read, for the next start if this process dies.
    journal: Arc<inflight::Journal>,
    /// Large files, loaded apart from the batches.
    lane: lane::Lane,
}

impl Engine {
    /// The service's engine: the live outputs and manifest, opened for appending after a clean
    /// stop or a crash alike (the caller holds the writer lock).
    pub fn open_live(settings: &Settings, device: DeviceChoice) -> anyhow::Result<Engine> {
        Self::open_live_with(settings, Warm::Build(device), None)
    }

    /// [`Engine::open_live`] with the featuriser of a suspended engine, or a new one, and the
    /// manifest an abandoned engine handed back ([`Engine::abandon`]) unless sled failed in it.
    pub fn open_live_with(
        settings: &Settings,
        warm: Warm,
        kept: Option<Arc<Manifest>>,
    ) -> anyhow::Result<Engine> {
        // Reopening writes (outputs recovered and synced, the manifest flushed): not on a
        // full disk, where it could only fail half-way.
        for dir in [&settings.paths.output, &settings.paths.state] {
            if dir.exists() {
                commit::ensure_room(dir, commit::RESERVE_BYTES)?;
            }
        }
        crate::staging::finish_pending(settings)?;
        let out_dir = &settings.paths.output;
        // A kept handle saves the reopen, and dropping a manifest while the disk fails is what
        // sled handles worst (see Manifest's Drop). One sled failed in is reopened from disk.
        let manifest = match kept {
            Some(m) if !m.failed() => m,
            _ => Arc::new(open_or_set_aside(&crate::staging::manifest_dir(settings))?),
        };
        // As this process left it (not, say, a manifest removed while the service idled).
        let resume = match &warm {
            Warm::Resume(s) => manifest.rows()? == s.rows,
            _ => false,
        };
        // Outputs that recordings went into, there only in part: refused before the recovery
        // reads them (it would fail on the missing file as on a failing disk, and be retried).
        let ingested = |m: &Manifest| -> anyhow::Result<bool> {
            Ok(m.files().next().is_some() || m.rows()?.iter().any(|&r| r > 0))
        };
        if ingested(&manifest)? {
            crate::output::check_complete(out_dir, &settings.outputs)?;
        }
        if !resume {
            check_agreement(settings, &manifest)?;
            recover_into(settings, &manifest)?;
        }
        let fingerprint = settings.features.fingerprint();
        let known_rows = manifest.rows()?;
        let has_records = ingested(&manifest)?;
        let appended = manifest.appended_labels()?;
        let labels = LabelSet::new(&settings.labels.names, &appended, settings.labels.unknown);
        check_compatible(settings, &manifest, &fingerprint, &labels)?;
        let header = OutputHeader {
            labels: labels.names.clone(),
            features: settings.features.clone(),
            path_bytes: settings.outputs.path_bytes,
        };
        let mut outputs = if resume && OutputSet::exists(out_dir, &settings.outputs) {
            OutputSet::resume(out_dir, &settings.outputs, &header, known_rows)?
        } else if OutputSet::exists(out_dir, &settings.outputs) {
            OutputSet::open_append(out_dir, &settings.outputs, &header, true, Some(known_rows))?
        } else if has_records {
            bail!(
                "the manifest in {} lists ingested files but their outputs are missing from {}: run `ailhd rebuild`",
                settings.paths.state.display(),
                out_dir.display()
            );
        } else {
            OutputSet::create(out_dir, &settings.outputs, &header, true)?
        };
        // Rows committed beyond the manifest's counts were adopted above; open_append cut only
        // uncommitted rows. Fewer rows than the manifest counts means the outputs lost rows the
        // manifest counts as ingested.
        for (split, &known) in known_rows.iter().enumerate() {
            let on_disk = outputs.committed_rows(split);
            if known > on_disk {
                bail!(
                    "the manifest knows {known} {} rows but the outputs hold only {on_disk}: the outputs were changed behind ailhd's back. Run `ailhd rebuild`",
                    SPLITS[split]
                );
            }
        }
        outputs.set_labels(&labels.names)?;
        let wrote = manifest.set_meta("feature_fingerprint", &fingerprint)?
            | manifest.set_meta("labels", &serde_json::to_string(&labels.names)?)?;
        if wrote || !resume {
            manifest.flush()?;
        }
        let featuriser = match warm {
            Warm::Build(device) => features::build(
                &settings.features,
                &settings.gpu,
                device,
                settings.worker_threads(),
            )?,
            Warm::Keep(f) | Warm::Resume(Suspended { featuriser: f, .. }) => f,
        };
        Ok(Engine::start(
            settings, labels, known_rows, manifest, outputs, featuriser, true,
        ))
    }

    /// `rebuild`'s stores: empty outputs in `out_dir` and an empty manifest in `manifest_dir`
    /// (staging, swapped in by the caller once [`Engine::finish`] returns), made with the
    /// label list known so far (`rebuild` makes them while it reads the old manifest for the
    /// labels it appended; [`Engine::open_bulk`] extends the list).
    pub fn create_bulk(
        settings: &Settings,
        out_dir: &Path,
        manifest_dir: &Path,
        labels: &[String],
    ) -> anyhow::Result<BulkStores> {
        let header = OutputHeader {
            labels: labels.to_vec(),
            features: settings.features.clone(),
            path_bytes: settings.outputs.path_bytes,
        };
        Ok(BulkStores {
            outputs: OutputSet::create(out_dir, &settings.outputs, &header, false)?,
            manifest: Manifest::open(manifest_dir)?,
            labels: labels.to_vec(),
        })
    }

    /// `rebuild`'s engine, on the stores of [`Engine::create_bulk`], with the whole label list
    /// (which extends the one they were made with).
    pub fn open_bulk(
        settings: &Settings,
        featuriser: Box<dyn Featuriser>,
        stores: BulkStores,
        labels: LabelSet,
    ) -> anyhow::Result<Engine> {
        let BulkStores {
            mut outputs,
            manifest,
            labels: made_with,
        } = stores;
        if labels.names != made_with {
            outputs.set_labels(&labels.names)?;
        }
        let mut meta = manifest::ManifestBatch::default();
        meta.put_meta("feature_fingerprint", &settings.features.fingerprint());
        meta.put_labels(&labels.names, settings.labels.names.len());
        manifest.apply(meta)?;
        Ok(Engine::start(
            settings,
            labels,
            [0; 3],
            Arc::new(manifest),
            outputs,
            featuriser,
            false,
        ))
    }

    fn start(
        settings: &Settings,
        labels: LabelSet,
        rows: [u64; 3],
        manifest: Arc<Manifest>,
        outputs: OutputSet,
        featuriser: Box<dyn Featuriser>,
        live: bool,
    ) -> Engine {
        let ledger = if live {
            Ledger::new(settings, labels, rows)
        } else {
            Ledger::for_empty_store(settings, labels)
        };
        let times = Arc::new(StageTimes::default());
        let device = featuriser.name();
        let shape = featuriser.shape();
        let journal = inflight::Journal::for_state(&settings.paths.state);
        let lane = lane::Lane::new(lane::Context {
            features: settings.features.clone(),
            shape,
            times: times.clone(),
            journal: journal.clone(),
        });
        let threads = settings.worker_threads();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ailhd-load-{i}"))
            .build()
            .expect("worker threads start");
        // One plan waiting for the featuriser (it holds its recordings' samples: enough to keep
        // every stage busy, little memory held); a few featurised ones for the commit stage,
        // which commits whatever has queued up as one group.
        let (plan_tx, plan_rx) = crossbeam_channel::bounded::<Plan>(1);
        let (feat_tx, feat_rx) =
            crossbeam_channel::bounded::<anyhow::Result<Featurised>>(GROUP_MAX);
        let (done_tx, done_rx) = crossbeam_channel::unbounded::<anyhow::Result<Done>>();
        let (recycle_tx, recycle_rx) = crossbeam_channel::bounded(featurise::RECYCLED);
        let featurising = {
            let stage = featurise::Stage {
                featuriser,
                features: settings.features.clone(),
                times: times.clone(),
                recycled: recycle_rx,
            };
            std::thread::Builder::new()
                .name("ailhd-featurise".into())
                .spawn(move || stage.run(plan_rx, feat_tx))
                .expect("featuriser thread starts")
        };
        let committer = Committer {
            room: live.then(|| commit::Room {
                output: settings.paths.output.clone(),
                state: settings.paths.state.clone(),
                copies: settings.outputs.hdf5 as u64 + settings.outputs.npy as u64,
                path_bytes: settings.outputs.path_bytes as u64,
            }),
            outputs,
            manifest: manifest.clone(),
            live,
            path_bytes: settings.outputs.path_bytes,
            committed: ledger.committed_handle(),
            times: times.clone(),
            configured_labels: settings.labels.names.len(),
        };
        let writing = std::thread::Builder::new()
            .name("ailhd-commit".into())
            .spawn(move || commit_loop(committer, live, feat_rx, done_tx, recycle_tx))
            .expect("commit thread starts");
        Engine {
            settings: settings.clone(),
            shape,
            ledger,
            manifest,
            pool,
            times,
            device,
            to_featurise: Some(plan_tx),
            done: done_rx,
            featurising: Some(featurising),
            writing: Some(writing),
            in_flight: Default::default(),
            journal,
            lane,
        }
    }

    pub fn device(&self) -> &str {
        &self.device
    }

    pub fn labels(&self) -> &[String] {
        self.ledger.labels()
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn times(&self) -> &StageTimes {
        &self.times
    }

    /// Batches submitted and not yet reported done, and large files still loading.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len() + self.lane.pending()
    }

    /// Batches submitted and not yet durable (not counting large files still loading on the
    /// lane): what the service's batching policy waits for.
    pub fn batches_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Files handed to the engine and not yet committed: those of the batches in flight (not
    /// counting removals) and large files still loading on their own.
    pub fn files_in_flight(&self) -> usize {
        self.in_flight.iter().sum::<usize>() + self.lane.pending()
    }

    /// One batch's result came back (results come in the order the batches went).
    fn batch_done(&mut self) {
        self.in_flight.pop_front();
    }

    /// Settings that may change while running (SIGHUP); the rest need a restart.
    pub fn update_live_settings(&mut self, s: &Settings) {
        self.settings.ingest = s.ingest.clone();
    }

    /// Load, decide and hand one batch on. Returns once the batch is queued for featurising
    /// (waits while the queue is full). Large files ([`stages::LANE_ABOVE`]) go to the lane and
    /// are decided when they are loaded, in a later batch.
    pub fn submit(&mut self, inputs: Vec<Input>) -> anyhow::Result<()> {
        if inputs.is_empty() {
            return Ok(());
        }
        let taken = Instant::now();
        if self.lane.pending() > 0 {
            for input in &inputs {
                match input {
                    Input::Load { rel, .. } => self.lane.supersede(rel, false),
                    Input::Observe(Observation::FolderGone(folder)) => {
                        self.lane.supersede(folder, true)
                    }
                    Input::Observe(o) => self.lane.supersede(o.rel(), false),
                }
            }
        }
        let mut observations: Vec<Observation> = Vec::with_capacity(inputs.len());
        self.take_lane(None, &mut observations);
        let inputs = self.screen(inputs, &mut observations)?;
        let root = self.settings.paths.recordings.clone();
        let features = &self.settings.features;
        let shape = &self.shape;
        let times = &*self.times;
        let journal = &*self.journal;
        let lane = &mut self.lane;
        let load = |input: OpenedInput| match input {
            OpenedInput::Load { rel, seen, file } => {
                stages::load(file, rel, seen, features, shape, times)
            }
            OpenedInput::Observe(o) => o,
        };
        let mut inputs = inputs.into_iter().peekable();
        self.pool.install(|| {
            while inputs.peek().is_some() {
                // The files of up to OPEN_AHEAD inputs are opened and their reading started
                // first (readahead), so that a tree that is not in the page cache is read with
                // that many requests in flight, not one per loader; at most that many are open
                // at once (a GPU's bulk batch of 1024 would meet the usual limit of 1024
                // descriptors).
                let opened: Vec<OpenedInput> = inputs
                    .by_ref()
                    .take(OPEN_AHEAD)
                    .collect::<Vec<_>>()
                    .into_par_iter()
                    .map(|input| match input {
                        Input::Load { rel, seen } => OpenedInput::Load {
                            file: stages::open(&root, &rel, times),
                            rel,
                            seen,
                        },
                        Input::Observe(o) => OpenedInput::Observe(o),
                    })
                    .collect();
                // Large files to their lane; the others are listed in the in-flight journal
                // while they are read.
                let mut group = Vec::with_capacity(opened.len());
                let mut reading = Vec::new();
                for o in opened {
                    let o = match o {
                        OpenedInput::Load {
                            rel,
                            seen,
                            file: Ok((file, meta)),
                        } if meta.len() > stages::LANE_ABOVE => {
                            lane.send(lane::Job {
                                rel,
                                seen,
                                file,
                                meta,
                            });
                            continue;
                        }
                        o => o,
                    };
                    if let OpenedInput::Load {
                        rel,
                        file: Ok((_, meta)),
                        ..
                    } = &o
                    {
                        reading.push(inflight::Entry::new(rel, meta, 0));
                    }
                    group.push(o);
                }
                let _reading = journal.reading(inflight::Slot::Batch, reading);
                observations.par_extend(group.into_par_iter().map(load));
            }
        });
        self.dispatch(observations, Some(taken))
    }

    /// Inputs as the in-flight journal and the manifest judge them: a file that made ailhd stop
    /// twice in a row is quarantined without being read (the first time) or left alone (it is
    /// quarantined already, and has not changed); a suspect is read alone, now. Returns the
    /// inputs to load as usual.
    fn screen(
        &mut self,
        inputs: Vec<Input>,
        observations: &mut Vec<Observation>,
    ) -> anyhow::Result<Vec<Input>> {
        let root = &self.settings.paths.recordings;
        let mut rest = Vec::with_capacity(inputs.len());
        for input in inputs {
            let Input::Load { rel, seen } = input else {
                rest.push(input);
                continue;
            };
            let recorded = self.ledger.recorded(&*self.manifest, &rel)?;
            let set_aside = recorded.as_ref().is_some_and(|r| {
                r.quarantine
                    .as_ref()
                    .is_some_and(|q| q.kind == outcome::STOPPED_WHILE_READING)
            });
            let verdicts = self.journal.has_verdicts();
            if !set_aside && !verdicts {
                rest.push(Input::Load { rel, seen });
                continue;
            }
            let Ok(meta) = std::fs::symlink_metadata(root.join(&rel)) else {
                rest.push(Input::Load { rel, seen });
                continue;
            };
            if let Some(r) = recorded.filter(|_| set_aside) {
                if r.size == meta.len() && r.mtime_ns == stages::mtime_ns(&meta) {
                    continue; // quarantined as it is: not read again
                }
            }
            match self.journal.verdict(&rel, &meta) {
                inflight::Verdict::Ordinary => rest.push(Input::Load { rel, seen }),
                inflight::Verdict::Poison { deaths } => {
                    let o = Observation::Rejected {
                        rel,
                        reason: inflight::reason(deaths),
                        size: meta.len(),
                        mtime_ns: stages::mtime_ns(&meta),
                    };
                    observations.push(o);
                }
                inflight::Verdict::Suspect { deaths } => {
                    let file = stages::open(root, &rel, &self.times);
                    let entry = match &file {
                        Ok((_, meta)) => inflight::Entry::new(&rel, meta, deaths),
                        Err(_) => inflight::Entry::new(&rel, &meta, deaths),
                    };
                    log::info!("reading {rel} alone (ailhd stopped while reading it)");
                    let o = {
                        let _alone = self.journal.reading_alone(entry);
                        stages::load(
                            file,
                            rel,
                            seen,
                            &self.settings.features,
                            &self.shape,
                            &self.times,
                        )
                    };
                    observations.push(o);
                }
            }
        }
        Ok(rest)
    }

    /// Decide `observations` (whose loading began at `taken`) and hand the plan on.
    fn dispatch(
        &mut self,
        observations: Vec<Observation>,
        taken: Option<Instant>,
    ) -> anyhow::Result<()> {
        let t = Instant::now();
        let files = observations
            .iter()
            .filter(|o| !matches!(o, Observation::Gone(_) | Observation::FolderGone(_)))
            .count();
        let mut plan = self.ledger.decide(&*self.manifest, observations)?;
        StageTimes::add(&self.times.decide, t);
        plan.trace.taken = taken;
        plan.trace.decided = Some(Instant::now());
        let tx = self
            .to_featurise
            .as_ref()
            .context("the engine is finished")?;
        if tx.send(plan).is_err() {
            return Err(self.stopped());
        }
        self.in_flight.push_back(files);
        Ok(())
    }

    /// The lane's results ready now (and `first`, one just received), into `observations`.
    /// Returns whether there was any.
    fn take_lane(
        &mut self,
        first: Option<lane::Finished>,
        observations: &mut Vec<Observation>,
    ) -> bool {
        let mut taken: Vec<Observation> =
            first.and_then(|f| self.lane.take(f)).into_iter().collect();
        if self.lane.pending() > 0 {
            taken.extend(self.lane.ready());
        }
        let any = !taken.is_empty();
        observations.extend(taken);
        any
    }

    /// Decide and hand on what the lane has loaded (`first`, and whatever else is ready).
    fn dispatch_lane(&mut self, first: Option<lane::Finished>) -> anyhow::Result<()> {
        if first.is_none() && self.lane.pending() == 0 {
            return Ok(());
        }
        let mut observations = Vec::new();
        if self.take_lane(first, &mut observations) {
            self.dispatch(observations, None)?;
        }
        Ok(())
    }

    /// Batches made durable since the last call, without waiting. An error here stops the engine.
    pub fn completed(&mut self) -> anyhow::Result<Vec<Done>> {
        self.dispatch_lane(None)?;
        let mut out = Vec::new();
        while let Ok(r) = self.done.try_recv() {
            self.batch_done();
            out.push(r?);
        }
        Ok(out)
    }

    /// Wait until every submitted batch is durable (large files on the lane too).
    pub fn wait(&mut self) -> anyhow::Result<Vec<Done>> {
        let mut out = Vec::new();
        loop {
            self.dispatch_lane(None)?;
            if self.in_flight.is_empty() && self.lane.pending() == 0 {
                return Ok(out);
            }
            let lane = self.lane.results().clone();
            let done = self.done.clone();
            crossbeam_channel::select! {
                recv(done) -> r => match r {
                    Ok(r) => {
                        self.batch_done();
                        out.push(r?);
                    }
                    Err(_) => return Err(self.stopped()),
                },
                recv(lane) -> f => {
                    if let Ok(f) = f {
                        self.dispatch_lane(Some(f))?;
                    }
                }
            }
        }
    }

    /// Why the engine stopped: the failing stage's own error, its types kept (so that a caller
    /// tells a featuriser that failed, [`FeaturiserFailed`], from outputs that could not be
    /// written), or a generic one.
    ///
    /// The stage that failed hands its error to the commit thread, which passes it on before it
    /// ends: this waits for it, past the results of batches made durable before it (the caller
    /// abandons the engine and rescans, which finds what those results would have asked for).
    fn stopped(&mut self) -> anyhow::Error {
        while let Ok(r) = self.done.recv() {
            self.batch_done();
            if let Err(e) = r {
                return e.context("the engine stopped");
            }
        }
        anyhow::anyhow!("the engine stopped: a stage failed (see the log)")
    }

    /// Drain, commit everything, close the outputs. Returns the GPU's stage times, if any.
    pub fn finish(self) -> anyhow::Result<Option<DeviceTimes>> {
        let (times, _) = self.stop()?;
        Ok(times)
    }

    /// Drain, commit everything, close the outputs and the manifest, and hand back the warm
    /// featuriser and the rows committed, for [`Engine::open_live_with`].
    ///
    /// The manifest is then opened and closed once more ([`Manifest::fold_log`]): sled folds
    /// what was written since its last open into a new snapshot now, while nothing waits, instead
    /// of at the reopen that the next recording waits for.
    pub fn suspend(self) -> anyhow::Result<Suspended> {
        let manifest = self.manifest.clone();
        let dir = crate::staging::manifest_dir(&self.settings);
        let state = self.settings.paths.state.clone();
        let (_, featuriser) = self.stop()?;
        let featuriser = featuriser.context("the featuriser thread stopped")?;
        // Every commit synced the manifest; this one syncs whatever else it holds, so that a
        // resume finding these rows may take it as closed cleanly.
        manifest.flush()?;
        let rows = manifest.rows()?;
        // Only once closed here (a handle held elsewhere would keep sled's lock), and not on a
        // disk too full for the reopen (which would refuse to write), as the fold writes too.
        if let Ok(closed) = Arc::try_unwrap(manifest) {
            drop(closed);
            if commit::ensure_room(&state, commit::RESERVE_BYTES).is_ok() {
                Manifest::fold_log(&dir);
            }
        }
        Ok(Suspended { featuriser, rows })
    }

    /// After a failure: drop whatever is in flight (nothing of it is recorded) and hand back
    /// the featuriser, if its thread still has it: not after the featuriser itself failed
    /// (then None, and the next [`Engine::open_live_with`] must build a new one); and the
    /// manifest, for the next open.
    pub fn abandon(mut self) -> (Option<Box<dyn Featuriser>>, Arc<Manifest>) {
        let manifest = self.manifest.clone();
        self.to_featurise = None;
        let featuriser = self
            .featurising
            .take()
            .and_then(|h| h.join().ok())
            .and_then(|(_, f)| f);
        if let Some(h) = self.writing.take() {
            // Ok: the commit thread stopped without a failure; dropping its committer without
            // a commit cuts back whatever was appended and not committed.
            let _ = h.join();
        }
        (featuriser, manifest)
    }

    fn stop(mut self) -> anyhow::Result<featurise::Stopped> {
        let waited = self.wait();
        self.to_featurise = None;
        let (device_times, featuriser) = match self.featurising.take() {
            Some(h) => h.join().expect("featuriser thread panicked"),
            None => (None, None),
        };
        let committer = self
            .writing
            .take()
            .expect("not finished twice")
            .join()
            .expect("commit thread panicked");
        waited?;
        committer?.close()?;
        Ok((device_times, featuriser))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.to_featurise = None;
        if let Some(h) = self.featurising.take() {
            let _ = h.join();
        }
        if let Some(h) = self.writing.take() {
            if let Ok(Ok(c)) = h.join() {
                if let Err(e) = c.close() {
                    log::error!("closing the outputs: {e:#}");
                }
            }
        }
    }
}

/// Whether an error of the engine may pass by itself: a full disk, or an I/O error of the disk,
/// of sled or of HDF5 (which reports one as a failed call). The service says so and retries
/// instead of stopping; anything else (outputs of other feature settings, a configuration that
/// cannot work) stops it.
pub fn may_pass(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.is::<commit::NoRoom>()
            || c.is::<hdf5::Error>()
            || c.downcast_ref::<std::io::Error>()
                .is_some_and(|io| !crate::config::is_configuration(io))
            || matches!(c.downcast_ref::<sled::Error>(), Some(sled::Error::Io(_)))
    })
}

/// Open the manifest in `dir`; when it cannot be read (damaged, unknown layout), move it aside
/// (`manifest.unreadable-<unix seconds>`, kept for inspection) and start a blank one, which
/// [`recover::from_outputs`] then fills. A manifest of a newer ailhd is refused, never set aside.
fn open_or_set_aside(dir: &Path) -> anyhow::Result<Manifest> {
    use manifest::ManifestError;
    match Manifest::open(dir) {
        Ok(m) => Ok(m),
        Err(
            e @ (ManifestError::Unknown { .. }
            | ManifestError::Corrupt { .. }
            | ManifestError::Db {
                source:
                    sled::Error::Corruption { .. }
                    | sled::Error::Unsupported(_)
                    | sled::Error::ReportableBug(_),
                ..
            }),
        ) => {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let aside = dir.with_file_name(format!("manifest.unreadable-{secs}"));
            std::fs::rename(dir, &aside).with_context(|| {
                format!("{e}; and it cannot be moved aside to {}", aside.display())
            })?;
            log::warn!(
                "{e}: moved it aside to {} and starting a new one",
                aside.display()
            );
            Ok(Manifest::open(dir)?)
        }
        Err(e) => Err(e.into()),
    }
}

fn done_of(plan: Plan) -> Done {
    let now = Instant::now();
    Done {
        counts: plan.counts,
        quarantined: plan.quarantined,
        reread: plan.reread,
        recheck: plan.recheck,
        latencies: plan.seen.iter().map(|t| now.duration_since(*t)).collect(),
        first_seen: plan.seen.iter().min().copied(),
        trace: plan.trace,
        rows: plan.rows,
    }
}

impl Engine {
    /// The manifest, for work beside the engine that only reads it ([`reconcile_with`]: the
    /// comparison of the tree with it at start-up, in periodic rescans, after a failure).
    pub fn manifest_handle(&self) -> Arc<Manifest> {
        self.manifest.clone()
    }
}

/// A manifest that was lost is rebuilt from the outputs' own columns; rows the outputs committed
/// that the manifest did not record (an older ailhd stopped between its two commits) are
/// adopted. Each says so in the log.
fn recover_into(settings: &Settings, manifest: &Manifest) -> anyhow::Result<()> {
    let out_dir = &settings.paths.output;
    if OutputSet::exists(out_dir, &settings.outputs) && recover::is_blank(manifest)? {
        if let Some(r) = recover::from_outputs(settings, manifest)? {
            log::warn!(
                "the manifest in {} was missing: rebuilt it from the {} under {} ({} rows: {} training, {} validation, {} testing; {} valid{}); no feature recomputed, no row moved. Checking the tree against it",
                settings.paths.state.display(),
                r.source,
                out_dir.display(),
                r.rows.iter().sum::<u64>(),
                r.rows[0],
                r.rows[1],
                r.rows[2],
                r.valid,
                if r.conflicting > 0 {
                    format!(", {} left unrecorded (see above)", r.conflicting)
                } else {
                    String::new()
                }
            );
        }
    }
    if OutputSet::exists(out_dir, &settings.outputs) {
        if let Some(a) = recover::adopt_tail(settings, manifest)? {
            let n: u64 = a.rows.iter().sum();
            log::warn!(
                "the outputs in {} had committed {n} rows the manifest had not recorded (an older ailhd stopped between its two commits of a batch): adopted them ({} training, {} validation, {} testing{}), no row cut. Checking the tree against them",
                out_dir.display(),
                a.rows[0],
                a.rows[1],
                a.rows[2],
                if a.superseded > 0 {
                    format!("; {} of them superseded, turned invalid (see above)", a.superseded)
                } else {
                    String::new()
                }
            );
        }
    }
    Ok(())
}

/// The outputs were made with these feature settings, and the configured labels keep the ids
/// they were given (`run` at every open, and before a recovery reads the outputs through
/// [`check_agreement`]; `check-config` through [`check_outputs`]). The rules
/// are [`check_features`] and [`check_label_ids`], which also check each output file as it is
/// reopened. The manifest does not record `outputs.path_bytes`: [`check_path_bytes`] checks it
/// against each output as it is reopened (or read by a recovery), and in [`check_made_with`].
fn check_compatible(
    settings: &Settings,
    manifest: &Manifest,
    fingerprint: &str,
    labels: &LabelSet,
) -> anyhow::Result<()> {
    let out = &settings.paths.output;
    if let Some(f) = manifest.get_meta("feature_fingerprint")? {
        if f != fingerprint {
            // The manifest records only the fingerprint: an output file made with it names the
            // keys that differ (best effort: the refusal stands without it).
            let made = crate::output::read::made_with(settings).unwrap_or_default();
            let stored = made.into_iter().find(|m| m.fingerprint == f);
            let json = stored.and_then(|m| m.config_json);
            check_features(out, &f, json.as_deref(), &settings.features)?;
        }
    }
    if let Some(stored) = manifest.get_meta("labels")? {
        let stored: Vec<String> = serde_json::from_str(&stored).unwrap_or_default();
        check_label_ids(out, &stored, &labels.names)?;
    }
    Ok(())
}

/// `check-config`: the configuration agrees with the outputs already under `paths.output` and
/// with their manifest, by the checks `run` makes when it opens them ([`check_agreement`], and
/// each output file's feature settings, label ids and `source_path` width as its reopen checks
/// them). A mismatch is a [`SettingsDiffer`](crate::output::SettingsDiffer); an output or
/// manifest that cannot be read is an ordinary (run-time) error.
///
/// With a rebuild's swap pending ([`crate::staging::swap_pending`]), the outputs are half old,
/// half new until `run` or `rebuild` rolls it forward: they are not checked, and what to tell
/// the user is returned instead.
pub fn check_outputs(settings: &Settings) -> anyhow::Result<Option<String>> {
    if let Some(pending) = crate::staging::swap_pending(settings) {
        return Ok(Some(pending));
    }
    let dir = crate::staging::manifest_dir(settings);
    // A running writer holds the manifest (sled locks it): then the outputs are asked instead,
    // as for a lost state.
    // Outputs there in part are refused once recordings were ingested into them (as `run`
    // refuses them); a manifest a running writer holds counts as such.
    let mut ingested = true;
    if dir.exists() && crate::lock::WriterLock::holder(&settings.paths.state).is_none() {
        let manifest = Manifest::open(&dir)?;
        check_agreement(settings, &manifest)?;
        ingested = manifest.files().next().is_some() || manifest.rows()?.iter().any(|&r| r > 0);
    }
    if ingested {
        crate::output::check_complete(&settings.paths.output, &settings.outputs)?;
    }
    check_made_with(settings)?;
    Ok(None)
}

/// Before `run` reads the outputs with the configured settings (a recovery of the manifest
/// reads their columns), so that a configuration that disagrees with them is refused as such,
/// not as a damaged output: [`check_compatible`] when the manifest records what the outputs
/// were made with, else (a new or lost state) [`check_made_with`].
fn check_agreement(settings: &Settings, manifest: &Manifest) -> anyhow::Result<()> {
    if manifest.get_meta("labels")?.is_none() {
        return check_made_with(settings);
    }
    let appended = manifest.appended_labels()?;
    let labels = LabelSet::new(&settings.labels.names, &appended, settings.labels.unknown);
    check_compatible(
        settings,
        manifest,
        &settings.features.fingerprint(),
        &labels,
    )
}

/// The configuration agrees with the attributes of each output file: its feature settings, the
/// ids of its labels (those past the configured ones taken as appended, as a recovery of the
/// manifest takes them), and the width of its `source_path` column (`outputs.path_bytes`).
fn check_made_with(settings: &Settings) -> anyhow::Result<()> {
    let made = crate::output::read::made_with(settings)?;
    for m in &made {
        let json = m.config_json.as_deref();
        check_features(&m.path, &m.fingerprint, json, &settings.features)?;
        let appended = m
            .labels
            .get(settings.labels.names.len()..)
            .unwrap_or_default();
        let labels = LabelSet::new(&settings.labels.names, appended, settings.labels.unknown);
        check_label_ids(&m.path, &m.labels, &labels.names)?;
        check_path_bytes(&m.path, m.path_bytes, settings.outputs.path_bytes)?;
    }
    Ok(())
}

/// The commit stage's thread: commits what the featurise stage hands on (live, the plans already
/// featurised behind one join its commit as a group), reports each batch done, and hands the
/// row buffers back. A failure rolls the group back and ends the stage.
fn commit_loop(
    mut committer: Committer,
    live: bool,
    feat_rx: crossbeam_channel::Receiver<anyhow::Result<Featurised>>,
    done_tx: crossbeam_channel::Sender<anyhow::Result<Done>>,
    recycle_tx: crossbeam_channel::Sender<Vec<half::f16>>,
) -> anyhow::Result<Committer> {
    while let Ok(first) = feat_rx.recv() {
        // Live: the plans already featurised behind this one join its commit.
        let mut group = vec![first];
        while live && group.len() < GROUP_MAX && group.last().is_some_and(|f| f.is_ok()) {
            match feat_rx.try_recv() {
                Ok(f) => group.push(f),
                Err(_) => break,
            }
        }
        // A featuriser failure ends the group: the plans before it are committed.
        let failed = match group.last() {
            Some(Err(_)) => group.pop().and_then(|f| f.err()),
            _ => None,
        };
        let mut plans: Vec<Featurised> = group.into_iter().flatten().collect();
        let error = match committer.commit_group(&mut plans) {
            Err(e) => Some(e),
            Ok(()) => {
                for f in plans {
                    // The row buffers go back to the featurise stage.
                    for m in f.mel {
                        if m.capacity() > 0 {
                            let _ = recycle_tx.try_send(m);
                        }
                    }
                    if done_tx.send(Ok(done_of(f.plan))).is_err() {
                        return Ok(committer);
                    }
                }
                failed
            }
        };
        if let Some(e) = error {
            // Roll back: the committer is dropped without a commit, which cuts
            // every output back to its committed rows; the manifest never saw
            // the group. Batches decided after it are not carried out.
            let text = format!("{e:#}");
            let _ = done_tx.send(Err(e));
            drop(committer);
            bail!("{text}");
        }
    }
    Ok(committer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::Waveform;
    use half::f16;

    /// A featuriser whose device is gone: every batch fails.
    struct Gone(FeatureShape);

    impl Featuriser for Gone {
        fn name(&self) -> String {
            "gone".into()
        }
        fn shape(&self) -> FeatureShape {
            self.0
        }
        fn featurise(&mut self, _: &[&Waveform], _: &mut [f16]) -> anyhow::Result<()> {
            bail!("the device is gone")
        }
        fn submit(&mut self, _: &[&Waveform], _: Vec<f16>) -> anyhow::Result<()> {
            bail!("the device is gone")
        }
        fn finish(&mut self) -> anyhow::Result<Option<Vec<f16>>> {
            Ok(None)
        }
    }

    /// A WAV of `len` bytes (a hole after its header: silence, no disk used).
    fn sparse_wav(path: &Path, len: u64) {
        let mut h = crate::synth::wav_pcm16(&[0; 2], 4096);
        h.truncate(44);
        h[4..8].copy_from_slice(&((len - 8) as u32).to_le_bytes());
        h[40..44].copy_from_slice(&((len - 44) as u32).to_le_bytes());
        std::fs::write(path, &h).unwrap();
        std::fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_len(len)
            .unwrap();
    }

    /// Write clip `i` under `leak` (the LEAK folder): its load, for the engine.
    fn leak_clip(leak: &Path, i: usize) -> Input {
        let name = crate::synth::file_name(i, 1);
        let samples = crate::synth::clip("LEAK", i as u64, 4096, 10.0);
        std::fs::write(leak.join(&name), crate::synth::wav_pcm16(&samples, 4096)).unwrap();
        Input::Load {
            rel: format!("LEAK/{name}"),
            seen: None,
        }
    }

    /// A large file goes to its lane: the recordings of its batch are decided and committed
    /// without waiting for it, it follows in a batch of its own; and a later input about its
    /// path (here its removal) makes the lane's result stale.
    #[test]
    fn a_large_file_does_not_hold_up_its_batch_and_the_last_input_of_a_path_counts() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        let leak = s.paths.recordings.join("LEAK");
        std::fs::create_dir_all(&leak).unwrap();
        sparse_wav(&leak.join("big.wav"), stages::LANE_ABOVE + (4 << 20));
        sparse_wav(&leak.join("big2.wav"), stages::LANE_ABOVE + (6 << 20));
        let mut inputs = vec![Input::Load {
            rel: "LEAK/big.wav".into(),
            seen: None,
        }];
        for i in 0..3 {
            let name = crate::synth::file_name(i, 1);
            let samples = crate::synth::clip("LEAK", i as u64, 4096, 10.0);
            std::fs::write(leak.join(&name), crate::synth::wav_pcm16(&samples, 4096)).unwrap();
            inputs.push(Input::Load {
                rel: format!("LEAK/{name}"),
                seen: None,
            });
        }
        let mut engine = Engine::open_live(&s, DeviceChoice::Cpu).unwrap();
        engine.submit(inputs).unwrap();
        assert_eq!(
            engine.in_flight(),
            2,
            "the batch, and the large file on its lane"
        );
        let mut done = Vec::new();
        while done.is_empty() {
            done = engine.completed().unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            done[0].counts.new_rows, 3,
            "the batch went without the large file"
        );
        done.extend(engine.wait().unwrap());
        let rows: usize = done.iter().map(|d| d.counts.new_rows).sum();
        assert_eq!(rows, 4);
        assert!(engine
            .manifest()
            .get_file("LEAK/big.wav")
            .unwrap()
            .is_some());

        engine
            .submit(vec![Input::Load {
                rel: "LEAK/big2.wav".into(),
                seen: None,
            }])
            .unwrap();
        engine
            .submit(vec![Input::Observe(Observation::Gone(
                "LEAK/big2.wav".into(),
            ))])
            .unwrap();
        engine.wait().unwrap();
        assert_eq!(engine.in_flight(), 0);
        assert!(engine
            .manifest()
            .get_file("LEAK/big2.wav")
            .unwrap()
            .is_none());
        assert_eq!(engine.manifest().rows().unwrap().iter().sum::<u64>(), 4);
    }

    /// A resume after the engine's own clean close finds its rows and takes them as they are;
    /// one that finds the manifest changed since (here removed while the service idled) goes
    /// the way of any open: the manifest is rebuilt from the outputs, and no row is lost (taken
    /// as clean, the outputs would have been cut to the empty manifest's rows).
    #[test]
    fn a_resume_that_finds_the_manifest_changed_recovers_as_any_open_does() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        let leak = s.paths.recordings.join("LEAK");
        std::fs::create_dir_all(&leak).unwrap();
        let ingest = |engine: &mut Engine, from: usize, to: usize| {
            for i in from..to {
                engine.submit(vec![leak_clip(&leak, i)]).unwrap();
            }
            engine.wait().unwrap();
        };
        let total = |engine: &Engine| engine.manifest().rows().unwrap().iter().sum::<u64>();

        let mut engine = Engine::open_live(&s, DeviceChoice::Cpu).unwrap();
        ingest(&mut engine, 0, 4);
        let closed = engine.suspend().unwrap();
        assert_eq!(closed.rows.iter().sum::<u64>(), 4);

        let mut engine = Engine::open_live_with(&s, Warm::Resume(closed), None).unwrap();
        assert_eq!(total(&engine), 4);
        ingest(&mut engine, 4, 6);
        assert_eq!(total(&engine), 6);
        let closed = engine.suspend().unwrap();

        std::fs::remove_dir_all(crate::staging::manifest_dir(&s)).unwrap();
        let mut engine = Engine::open_live_with(&s, Warm::Resume(closed), None).unwrap();
        assert_eq!(
            total(&engine),
            6,
            "the manifest rebuilt from the outputs' 6 rows"
        );
        let first = format!("LEAK/{}", crate::synth::file_name(0, 1));
        assert!(engine.manifest().get_file(&first).unwrap().is_some());
        ingest(&mut engine, 6, 7);
        assert_eq!(total(&engine), 7);
        engine.finish().unwrap();
    }

    /// The engine's idle close leaves sled nothing to fold at the next open: that open writes
    /// no new snapshot (sled names each after the log position it covers), so the recording
    /// that waits for it does not wait for the fold. Without the fold at the close, the reopen
    /// after a batch was recorded makes a new one.
    #[test]
    fn an_idle_close_leaves_the_manifest_nothing_to_fold_at_its_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        let leak = s.paths.recordings.join("LEAK");
        std::fs::create_dir_all(&leak).unwrap();
        let snapshots = || manifest::snapshot_names(&crate::staging::manifest_dir(&s));
        let mut engine = Engine::open_live(&s, DeviceChoice::Cpu).unwrap();
        for round in 0..2 {
            let before = snapshots();
            engine.submit(vec![leak_clip(&leak, round)]).unwrap();
            engine.wait().unwrap();
            let closed = engine.suspend().unwrap();
            let folded = snapshots();
            assert_eq!(folded.len(), 1, "one snapshot: {folded:?}");
            assert_ne!(folded, before, "the recorded batch is folded at the close");
            engine = Engine::open_live_with(&s, Warm::Resume(closed), None).unwrap();
            assert_eq!(snapshots(), folded, "the reopen had nothing to fold");
        }
        assert_eq!(engine.manifest().rows().unwrap().iter().sum::<u64>(), 2);
        engine.finish().unwrap();
    }

    /// Whichever call meets the stopped engine (the next submit or the wait), its error is the
    /// featuriser's, typed as such (the service tells it from a write failure by the type), and
    /// nothing was recorded.
    #[test]
    fn a_failed_featuriser_stops_the_engine_with_its_own_error() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        let leak = s.paths.recordings.join("LEAK");
        std::fs::create_dir_all(&leak).unwrap();
        let shape = s.features.shape();
        let mut engine =
            Engine::open_live_with(&s, Warm::Keep(Box::new(Gone(shape))), None).unwrap();
        let mut error = None;
        for i in 0..50 {
            let input = leak_clip(&leak, i);
            if let Err(e) = engine.submit(vec![input]) {
                error = Some(e);
                break;
            }
        }
        let error = error
            .or_else(|| engine.wait().err())
            .expect("the engine stops");
        assert!(
            error.downcast_ref::<FeaturiserFailed>().is_some(),
            "{error:#}"
        );
        assert!(
            format!("{error:#}").contains("the device is gone"),
            "{error:#}"
        );
        assert_eq!(engine.manifest().rows().unwrap(), [0, 0, 0]);
    }
}
