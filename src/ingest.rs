//! Ingest: the service's single writer. Applies batches of operations (a file is complete, a
//! file or folder is gone) to the outputs and the manifest with one commit protocol:
//!
//! 1. new rows are appended and in-place edits (`valid`, `labels`) written to the outputs;
//! 2. the outputs commit (`committed_rows` advances after the data is flushed);
//! 3. the manifest records the batch: content records, then file records, then a flush.
//!
//! Step 3 is the commit point. After a crash, [`Ingestor::open`] cuts every output back to the
//! rows the manifest knows, so a row appended but not recorded is reclaimed and its file is
//! ingested again; a content record without its file record is found again by hash.

use crate::config::{DeviceChoice, Settings, SPLITS};
use crate::decode::Waveform;
use crate::features::{self, Featuriser};
use crate::identity::{self, Hash, LabelSet};
use crate::manifest::{now_ms, ContentRecord, FileRecord, FileState, Manifest, ManifestBatch};
use crate::output::set::OutputSet;
use crate::output::{OutputHeader, RowMeta};
use crate::pipeline::{self, StageTimes};
use crate::rebuild;
use crate::staging;
use anyhow::{bail, Context};
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

/// One thing that happened in the tree, relative to `paths.recordings`.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// The file is complete: ingest it (or notice it is unchanged). `seen` is when it was
    /// complete, for the latency figures.
    Ingest {
        rel: String,
        seen: Instant,
    },
    Remove {
        rel: String,
    },
    /// A folder went away: everything the manifest has under it.
    RemoveDir {
        rel: String,
    },
}

#[derive(Debug, Default)]
pub struct BatchOutcome {
    /// New rows appended.
    pub new_rows: usize,
    /// Files that found their bytes already ingested (a copy, a move, a restore).
    pub attached: usize,
    pub unchanged: usize,
    pub removed: usize,
    pub quarantined: Vec<(String, String)>,
    /// Completion-to-commit time of each file of the batch that got a row.
    pub latencies: Vec<Duration>,
}

/// What the tree holds that the manifest does not know (or knows differently).
#[derive(Debug, Default)]
pub struct Reconciliation {
    pub changed: Vec<String>,
    pub removed: Vec<String>,
}

pub struct Ingestor {
    settings: Settings,
    manifest: Manifest,
    outputs: OutputSet,
    featuriser: Box<dyn Featuriser>,
    labels: LabelSet,
    pool: rayon::ThreadPool,
    times: StageTimes,
}

impl Ingestor {
    /// Open the manifest and outputs for appending, after a clean stop or a crash alike. The
    /// caller holds the writer lock.
    pub fn open(settings: &Settings, device: DeviceChoice) -> anyhow::Result<Ingestor> {
        staging::finish_pending(settings)?;
        let manifest = Manifest::open(&staging::manifest_dir(settings))?;
        let fingerprint = settings.features.fingerprint();
        let known_rows = rows_in_manifest(&manifest)?;
        let has_records = manifest.files().next().is_some() || known_rows.iter().any(|&r| r > 0);
        match manifest.get_meta("feature_fingerprint")? {
            Some(f) if f != fingerprint => bail!(
                "the feature settings changed since the outputs in {} were written: `ailhd run` will not append rows of another kind. Run `ailhd rebuild` to regenerate them with the new settings",
                settings.paths.output.display()
            ),
            _ => {}
        }
        let appended = manifest.appended_labels()?;
        let labels = LabelSet::new(&settings.labels.names, &appended, settings.labels.unknown);
        if let Some(stored) = manifest.get_meta("labels")? {
            let stored: Vec<String> = serde_json::from_str(&stored).unwrap_or_default();
            if labels.names.len() < stored.len() || labels.names[..stored.len()] != stored[..] {
                bail!(
                    "labels.names changed the ids of existing labels (outputs have {stored:?}, the configuration gives {:?}); ids are never renumbered: restore the order (new names go at the end) or run `ailhd rebuild`",
                    labels.names
                );
            }
        }
        let header = OutputHeader {
            labels: labels.names.clone(),
            features: settings.features.clone(),
            path_bytes: settings.outputs.path_bytes,
        };
        let out_dir = &settings.paths.output;
        let mut outputs = if OutputSet::exists(out_dir, &settings.outputs) {
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
        // open_append cut every split back to what the manifest accounts for; fewer rows than
        // that means the outputs lost rows the manifest counts as ingested.
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
        manifest.set_meta("feature_fingerprint", &fingerprint)?;
        manifest.set_meta("labels", &serde_json::to_string(&labels.names)?)?;
        manifest.flush()?;
        let threads = settings.worker_threads();
        let featuriser = features::build(&settings.features, device, threads)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .context("cannot start worker threads")?;
        Ok(Ingestor {
            settings: settings.clone(),
            manifest,
            outputs,
            featuriser,
            labels,
            pool,
            times: StageTimes::default(),
        })
    }

    pub fn device(&self) -> String {
        self.featuriser.name()
    }

    pub fn labels(&self) -> &[String] {
        &self.labels.names
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Settings that may change while running (SIGHUP); the rest need a restart.
    pub fn update_live_settings(&mut self, s: &Settings) {
        self.settings.ingest = s.ingest.clone();
    }

    /// Compare the tree with the manifest: files new or changed (size or mtime) since they were
    /// recorded, and records whose file is gone.
    pub fn reconcile(&mut self) -> anyhow::Result<Reconciliation> {
        let root = &self.settings.paths.recordings;
        let (present, not_utf8) = rebuild::scan(root)?;
        let mut r = Reconciliation::default();
        let mut batch = ManifestBatch::default();
        for rel in &not_utf8 {
            if self.manifest.get_file(rel)?.is_none() {
                log::warn!(file = rel.as_str(); "quarantined {rel}: path is not valid UTF-8");
                batch.put_file(
                    rel,
                    &FileRecord::quarantined(None, 0, 0, "path is not valid UTF-8"),
                );
            }
        }
        self.manifest.apply(batch)?;
        let present_set: HashSet<&str> = present.iter().map(|s| s.as_str()).collect();
        for rel in &present {
            let meta = match std::fs::metadata(root.join(rel)) {
                Ok(m) => m,
                Err(_) => continue,
            };
            let same = self.manifest.get_file(rel)?.is_some_and(|rec| {
                rec.size == meta.len() && rec.mtime_ns == pipeline::mtime_ns(&meta)
            });
            if !same {
                r.changed.push(rel.clone());
            }
        }
        for item in self.manifest.files() {
            let (rel, _) = item?;
            if !present_set.contains(rel.as_str()) && !not_utf8.contains(&rel) {
                r.removed.push(rel);
            }
        }
        Ok(r)
    }

    /// Apply one batch (see the module comment for the protocol).
    pub fn apply(&mut self, ops: Vec<Op>) -> anyhow::Result<BatchOutcome> {
        let mut out = BatchOutcome::default();
        let (removes, ingests) = self.coalesce(ops)?;
        let mut tx = Tx::default();

        for rel in &removes {
            if let Some(old) = tx.file(&self.manifest, rel)? {
                if old.state == FileState::Committed {
                    self.release(&mut tx, &old)?;
                }
                tx.files.insert(rel.clone(), None);
                out.removed += 1;
            }
        }

        let shape = self.featuriser.shape();
        let root = self.settings.paths.recordings.clone();
        let features = self.settings.features.clone();
        let times = &self.times;
        let prepared: Vec<pipeline::Prepared> = self.pool.install(|| {
            ingests
                .par_iter()
                .map(|(rel, _)| pipeline::prepare(&root, rel, &features, &shape, times))
                .collect()
        });

        // New bytes of this batch, per split, in order: (hash, meta, waveform index).
        let mut fresh: [Vec<(Hash, RowMeta, usize)>; 3] = Default::default();
        let mut fresh_index: HashMap<Hash, (usize, usize)> = HashMap::new();
        let mut seen_at: HashMap<String, Instant> = HashMap::new();
        let mut appended_label = false;
        for (i, (p, (_, seen))) in prepared.iter().zip(&ingests).enumerate() {
            if p.vanished {
                continue; // gone before we read it; its removal is queued
            }
            let old = tx.file(&self.manifest, &p.rel)?;
            let Some(hash) = p.hash else {
                let reason = p.decoded.as_ref().err().cloned().unwrap_or_default();
                if let Some(old) = &old {
                    if old.state == FileState::Committed {
                        self.release(&mut tx, old)?;
                    }
                }
                self.quarantine(&mut tx, &mut out, &p.rel, None, 0, 0, &reason);
                continue;
            };
            let hex = identity::hex(&hash);
            if let Some(old) = &old {
                if old.hash.as_deref() == Some(hex.as_str()) && old.state == FileState::Committed {
                    // Same bytes at the same path (a touch, or a rescan): nothing to do.
                    tx.files.insert(
                        p.rel.clone(),
                        Some(FileRecord {
                            size: p.size,
                            mtime_ns: p.mtime_ns,
                            ..old.clone()
                        }),
                    );
                    out.unchanged += 1;
                    continue;
                }
                if old.state == FileState::Committed {
                    self.release(&mut tx, old)?;
                }
            }
            if let Err(reason) = &p.decoded {
                self.quarantine(
                    &mut tx,
                    &mut out,
                    &p.rel,
                    Some(&hash),
                    p.size,
                    p.mtime_ns,
                    reason,
                );
                continue;
            }
            let before = self.labels.names.len();
            let placement = match identity::place(&self.settings, &mut self.labels, &p.rel, &hash) {
                Ok(pl) => pl,
                Err(e) => {
                    self.quarantine(
                        &mut tx,
                        &mut out,
                        &p.rel,
                        Some(&hash),
                        p.size,
                        p.mtime_ns,
                        &e.to_string(),
                    );
                    continue;
                }
            };
            appended_label |= self.labels.names.len() != before;
            let mut rec = FileRecord {
                hash: Some(hex),
                size: p.size,
                mtime_ns: p.mtime_ns,
                label: Some(placement.label),
                split: Some(placement.split as u8),
                row: None,
                state: FileState::Committed,
                reason: None,
                updated_ms: now_ms(),
            };
            if let Some(mut c) = tx.content(&self.manifest, &hash)? {
                // Known bytes (a copy, a move between labels, a file restored): the row stays,
                // its label follows the newest path, features are not recomputed.
                c.refs += 1;
                c.valid = true;
                c.label = placement.label;
                rec.split = Some(c.split);
                rec.row = Some(c.row);
                tx.contents.insert(hash, c);
                out.attached += 1;
            } else if let Some(&(split, _)) = fresh_index.get(&hash) {
                rec.split = Some(split as u8);
                out.attached += 1;
            } else {
                let idx = fresh[placement.split].len();
                fresh_index.insert(hash, (placement.split, idx));
                let meta = pipeline::row_meta(&p.rel, &hash, placement.label);
                fresh[placement.split].push((hash, meta, i));
            }
            seen_at.insert(p.rel.clone(), *seen);
            tx.files.insert(p.rel.clone(), Some(rec));
        }

        // Featurise and append the new bytes, split by split.
        for (split, rows) in fresh.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let waves: Vec<&Waveform> = rows
                .iter()
                .map(|(_, _, i)| prepared[*i].decoded.as_ref().expect("decoded"))
                .collect();
            let t = Instant::now();
            let (mel, waveform) = pipeline::featurise_rows(
                self.featuriser.as_mut(),
                &waves,
                &self.settings.features,
            )?;
            StageTimes::add(&self.times.featurise, t);
            let metas: Vec<RowMeta> = rows.iter().map(|(_, m, _)| m.clone()).collect();
            let t = Instant::now();
            let first = self
                .outputs
                .append(split, &mel, waveform.as_deref(), &metas)?;
            StageTimes::add(&self.times.write, t);
            for (i, (hash, meta, _)) in rows.iter().enumerate() {
                tx.contents.insert(
                    *hash,
                    ContentRecord {
                        split: split as u8,
                        row: first + i as u64,
                        label: meta.label,
                        valid: true,
                        refs: 0,
                    },
                );
                out.new_rows += 1;
            }
        }
        // File records of fresh rows (and in-batch copies of them) get their row and refs now.
        for (rel, rec) in tx.files.iter_mut() {
            let Some(rec) = rec else { continue };
            if rec.row.is_some() || rec.state != FileState::Committed {
                continue;
            }
            let hash = parse_hex(rec.hash.as_deref().unwrap_or_default());
            let c = tx
                .contents
                .get_mut(&hash)
                .with_context(|| format!("no row for {rel}"))?;
            c.refs += 1;
            rec.row = Some(c.row);
        }

        // In-place edits of rows that existed before this batch.
        let t = Instant::now();
        for (hash, c) in &tx.contents {
            let Some(before) = tx.original.get(hash) else {
                continue;
            };
            if before.valid != c.valid {
                self.outputs.set_valid(c.split as usize, c.row, c.valid)?;
            }
            if before.label != c.label {
                self.outputs.set_label(c.split as usize, c.row, c.label)?;
            }
        }
        if appended_label {
            self.outputs.set_labels(&self.labels.names)?;
        }
        self.outputs.commit()?;
        StageTimes::add(&self.times.write, t);

        // The commit point.
        let t = Instant::now();
        let mut contents = ManifestBatch::default();
        for (hash, c) in &tx.contents {
            contents.put_content(hash, c);
        }
        let mut files = ManifestBatch::default();
        for (rel, rec) in &tx.files {
            match rec {
                Some(r) => files.put_file(rel, r),
                None => files.remove_file(rel),
            }
        }
        if appended_label {
            let appended = &self.labels.names[self.settings.labels.names.len()..];
            self.manifest
                .set_meta("appended_labels", &serde_json::to_string(appended)?)?;
            self.manifest
                .set_meta("labels", &serde_json::to_string(&self.labels.names)?)?;
        }
        self.manifest.apply(contents)?;
        self.manifest.apply(files)?;
        self.manifest.flush()?;
        StageTimes::add(&self.times.manifest, t);
        let now = Instant::now();
        for (rel, rec) in &tx.files {
            if let (Some(r), Some(seen)) = (rec, seen_at.get(rel)) {
                if r.state == FileState::Committed {
                    out.latencies.push(now.duration_since(*seen));
                }
            }
        }
        Ok(out)
    }

    /// Last operation per path wins; folder removals expand to the files under them.
    #[allow(clippy::type_complexity)]
    fn coalesce(&self, ops: Vec<Op>) -> anyhow::Result<(Vec<String>, Vec<(String, Instant)>)> {
        let mut last: BTreeMap<String, Option<Instant>> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Ingest { rel, seen } => {
                    let keep = match last.get(&rel) {
                        Some(Some(prev)) => (*prev).min(seen),
                        _ => seen,
                    };
                    last.insert(rel, Some(keep));
                }
                Op::Remove { rel } => {
                    last.insert(rel, None);
                }
                Op::RemoveDir { rel } => {
                    let prefix = format!("{}/", rel.trim_end_matches('/'));
                    for item in self.manifest.files() {
                        let (path, _) = item?;
                        if path.starts_with(&prefix) {
                            last.insert(path, None);
                        }
                    }
                }
            }
        }
        let mut removes = Vec::new();
        let mut ingests = Vec::new();
        for (rel, op) in last {
            match op {
                Some(seen) => ingests.push((rel, seen)),
                None => removes.push(rel),
            }
        }
        Ok((removes, ingests))
    }

    /// A path lets go of its bytes: the row turns invalid when no path holds them any more.
    fn release(&self, tx: &mut Tx, old: &FileRecord) -> anyhow::Result<()> {
        let hash = parse_hex(old.hash.as_deref().unwrap_or_default());
        if let Some(mut c) = tx.content(&self.manifest, &hash)? {
            c.refs = c.refs.saturating_sub(1);
            if c.refs == 0 {
                c.valid = false;
            }
            tx.contents.insert(hash, c);
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn quarantine(
        &self,
        tx: &mut Tx,
        out: &mut BatchOutcome,
        rel: &str,
        hash: Option<&Hash>,
        size: u64,
        mtime_ns: i64,
        reason: &str,
    ) {
        log::warn!(file = rel, reason = reason; "quarantined {rel}: {reason}");
        tx.files.insert(
            rel.to_string(),
            Some(FileRecord::quarantined(hash, size, mtime_ns, reason)),
        );
        out.quarantined.push((rel.to_string(), reason.to_string()));
    }

    /// Record a file that never became complete.
    pub fn quarantine_incomplete(&mut self, rel: &str, reason: &str) -> anyhow::Result<()> {
        let mut tx = Tx::default();
        let mut out = BatchOutcome::default();
        if let Some(old) = tx.file(&self.manifest, rel)? {
            if old.state == FileState::Committed {
                // An ingested file rewritten and left incomplete: its old row is superseded.
                self.release(&mut tx, &old)?;
                for (hash, c) in &tx.contents {
                    if tx.original.get(hash).is_some_and(|b| b.valid != c.valid) {
                        self.outputs.set_valid(c.split as usize, c.row, c.valid)?;
                    }
                }
                self.outputs.commit()?;
            }
        }
        // Size and mtime as they are now, so the file is retried only when it changes again.
        let (size, mtime_ns) = std::fs::metadata(self.settings.paths.recordings.join(rel))
            .map(|m| (m.len(), pipeline::mtime_ns(&m)))
            .unwrap_or((0, 0));
        self.quarantine(&mut tx, &mut out, rel, None, size, mtime_ns, reason);
        let mut batch = ManifestBatch::default();
        for (hash, c) in &tx.contents {
            batch.put_content(hash, c);
        }
        for (rel, rec) in &tx.files {
            if let Some(r) = rec {
                batch.put_file(rel, r);
            }
        }
        self.manifest.apply(batch)?;
        self.manifest.flush()?;
        Ok(())
    }

    pub fn stage_seconds(&self) -> Vec<(&'static str, f64)> {
        self.times.seconds()
    }

    /// Close cleanly: plain HDF5 readers see exactly `committed_rows` rows afterwards.
    pub fn close(self) -> anyhow::Result<()> {
        self.manifest.flush()?;
        self.outputs.close()
    }
}

fn parse_hex(s: &str) -> Hash {
    blake3::Hash::from_hex(s)
        .map(|h| *h.as_bytes())
        .unwrap_or([0; 32])
}

/// Rows per split that the manifest accounts for (one past the highest row it records).
fn rows_in_manifest(m: &Manifest) -> anyhow::Result<[u64; 3]> {
    let mut rows = [0u64; 3];
    for item in m.contents() {
        let (_, c) = item?;
        let s = (c.split as usize).min(2);
        rows[s] = rows[s].max(c.row + 1);
    }
    Ok(rows)
}

/// A batch's view of the manifest: its own changes over the stored records.
#[derive(Default)]
struct Tx {
    files: BTreeMap<String, Option<FileRecord>>,
    contents: BTreeMap<Hash, ContentRecord>,
    /// Content records as they were before the batch (to write only what changed).
    original: HashMap<Hash, ContentRecord>,
}

impl Tx {
    fn file(&self, m: &Manifest, rel: &str) -> anyhow::Result<Option<FileRecord>> {
        match self.files.get(rel) {
            Some(r) => Ok(r.clone()),
            None => Ok(m.get_file(rel)?),
        }
    }
    fn content(&mut self, m: &Manifest, hash: &Hash) -> anyhow::Result<Option<ContentRecord>> {
        if let Some(c) = self.contents.get(hash) {
            return Ok(Some(c.clone()));
        }
        let stored = m.get_content(hash)?;
        if let Some(c) = &stored {
            self.original.insert(*hash, c.clone());
        }
        Ok(stored)
    }
}
