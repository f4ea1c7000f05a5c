//! Commit: carries out a featurised [`Plan`] with one protocol for `rebuild` and `run`:
//!
//! 1. append the new rows (their row numbers were fixed by the ledger; checked here);
//! 2. apply in-place edits (`valid`, new owners) and appended labels;
//! 3. live: commit the outputs (flush, then `committed_rows`);
//! 4. store the records and the row counts in the manifest; live: flush. This is the commit
//!    point: after a crash, the outputs are cut back to the manifest's row counts and whatever
//!    the manifest does not record is ingested again.
//!
//! In bulk (`rebuild` into staging) steps 3 and the flush happen once at the end: the staging
//! outputs are swapped in only when complete.

use crate::engine::ledger::{Edit, Plan};
use crate::engine::manifest::{Manifest, ManifestBatch};
use crate::engine::stages::StageTimes;
use crate::output::set::OutputSet;
use crate::output::RowMeta;
use anyhow::ensure;
use half::f16;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A plan with its rows' features, per split (same order as `plan.new_rows`).
pub struct Featurised {
    pub plan: Plan,
    pub mel: [Vec<f16>; 3],
    pub waveform: [Option<Vec<f32>>; 3],
}

pub struct Committer {
    pub outputs: OutputSet,
    pub manifest: Arc<Manifest>,
    /// Commit the outputs and flush the manifest after every plan (the service).
    pub live: bool,
    pub path_bytes: usize,
    /// Advanced to a plan's batch number once it is durable (the ledger's cache reads it).
    pub committed: Arc<AtomicU64>,
    pub times: Arc<StageTimes>,
    /// Configured label names: what is appended beyond them is recorded as appended.
    pub configured_labels: usize,
}

impl Committer {
    pub fn commit(&mut self, f: &Featurised) -> anyhow::Result<()> {
        let plan = &f.plan;
        let t = Instant::now();
        let batch = self.manifest_batch(plan);
        if self.live {
            // sled writes back on its own too: the manifest must not get ahead of the outputs.
            self.write(f)?;
            self.outputs.commit()?;
            StageTimes::add(&self.times.write, t);
            let t = Instant::now();
            self.manifest.apply(batch)?;
            self.manifest.flush()?;
            StageTimes::add(&self.times.manifest, t);
        } else {
            // Staging is swapped in only when complete: the records go beside the rows.
            let manifest = self.manifest.clone();
            let times = self.times.clone();
            std::thread::scope(|scope| -> anyhow::Result<()> {
                let recorded = scope.spawn(move || -> anyhow::Result<()> {
                    let t = Instant::now();
                    manifest.apply(batch)?;
                    StageTimes::add(&times.manifest, t);
                    Ok(())
                });
                let written = self.write(f);
                let recorded = recorded.join().expect("manifest writer panicked");
                written?;
                recorded
            })?;
            StageTimes::add(&self.times.write, t);
        }
        self.committed.store(plan.gen, Ordering::Release);
        Ok(())
    }

    fn write(&mut self, f: &Featurised) -> anyhow::Result<()> {
        let plan = &f.plan;
        for (split, rows) in plan.new_rows.iter().enumerate() {
            let Some(first) = rows.first() else { continue };
            let at = self.outputs.len(split);
            ensure!(
                at == first.row,
                "the ledger placed row {} but the outputs hold {at} rows",
                first.row
            );
            let metas: Vec<RowMeta> = rows.iter().map(|r| r.meta.clone()).collect();
            self.outputs
                .append(split, &f.mel[split], f.waveform[split].as_deref(), &metas)?;
        }
        for e in &plan.edits {
            match e {
                Edit::Valid { at, valid } => {
                    self.outputs.set_valid(at.split as usize, at.row, *valid)?
                }
                Edit::Owner { at, meta } => {
                    self.outputs
                        .set_owner(at.split as usize, at.row, meta, self.path_bytes)?
                }
            }
        }
        if let Some(labels) = &plan.labels {
            self.outputs.set_labels(labels)?;
        }
        Ok(())
    }

    fn manifest_batch(&self, plan: &Plan) -> ManifestBatch {
        let mut b = ManifestBatch::default();
        for (hash, c) in &plan.contents {
            match c {
                Some(c) => b.put_content(hash, c),
                None => b.remove_content(hash),
            }
        }
        for (rel, rec) in &plan.files {
            match rec {
                Some(r) => b.put_file(rel, r),
                None => b.remove_file(rel),
            }
        }
        for (split, n) in plan.rows.iter().enumerate() {
            b.put_rows(split, *n);
        }
        if let Some(labels) = &plan.labels {
            let appended = &labels[self.configured_labels.min(labels.len())..];
            b.put_meta(
                "appended_labels",
                &serde_json::to_string(appended).expect("strings serialise"),
            );
            b.put_meta(
                "labels",
                &serde_json::to_string(labels).expect("strings serialise"),
            );
        }
        b
    }

    /// Everything durable, files closed (plain readers see exactly `committed_rows` rows).
    pub fn close(mut self) -> anyhow::Result<()> {
        self.outputs.commit()?;
        self.manifest.flush()?;
        self.outputs.close()
    }
}
