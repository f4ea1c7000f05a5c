//! Commit: carries out a featurised [`Plan`] with one protocol for `rebuild` and `run`:
//!
//! 1. append the new rows (their row numbers were fixed by the ledger; checked here);
//! 2. apply in-place edits (`valid`, new owners) and appended labels;
//! 3. live: prepare the outputs: every appended row and edit durable on disk, `committed_rows`
//!    not moved (readers see nothing new);
//! 4. store the records and the row counts in the manifest; live: flush. This is the commit
//!    point: after a crash, whatever the manifest does not record is ingested again, and rows
//!    it records are there (step 3);
//! 5. live: publish: `committed_rows` moves to the new rows, last. A reader therefore never
//!    sees a row the manifest does not hold, and no row it saw is ever taken back: a start
//!    after a crash between 4 and 5 publishes the rows the manifest records
//!    (`open_append`'s `keep`), and cuts only rows no reader saw.
//!
//! In bulk (`rebuild` into staging) steps 3 to 5 happen once at the end: the staging outputs
//! are swapped in only when complete.

use crate::engine::ledger::{Edit, Plan};
use crate::engine::manifest::{Manifest, ManifestBatch};
use crate::engine::stages::StageTimes;
use crate::output::set::{OutputSet, SplitRows};
use crate::output::RowMeta;
use anyhow::{ensure, Context};
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
    /// Live: the output and state folders, checked for room before every batch.
    pub room: Option<Room>,
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
    /// Carry out `group`, plans in the order they were decided. Live, the whole group is made
    /// durable with one commit of the outputs and one flush of the manifest (a group commit:
    /// when plans queue up behind a commit, as in a burst, the syncs are shared; a lone plan
    /// is committed at once). Each plan's trace gets the group's instants.
    pub fn commit_group(&mut self, group: &mut [Featurised]) -> anyhow::Result<()> {
        let Some(last) = group.last() else {
            return Ok(());
        };
        if !self.live {
            return group.iter().try_for_each(|f| self.commit_staged(f));
        }
        let t = Instant::now();
        if let Some(room) = &self.room {
            room.check(group)?;
        }
        // sled writes back on its own too: the manifest must not get ahead of the outputs.
        for f in group.iter() {
            self.write(f)?;
        }
        self.outputs.prepare()?;
        let written = Instant::now();
        // Test builds (feature `failpoints`): a sleep here holds the service between the
        // outputs' prepare and the manifest (tests/daemon.rs kills it there), in a group that
        // appended rows.
        let appends = group
            .iter()
            .any(|f| f.plan.new_rows.iter().any(|r| !r.is_empty()));
        fail::fail_point!("commit-before-manifest", appends, |_| Ok(()));
        StageTimes::add(&self.times.write, t);
        // From here on the rows are on disk: a failure leaves them there, and the next open
        // publishes or cuts them by what the manifest holds.
        let (recorded, published) = self
            .record_and_publish(group, appends)
            .map_err(|e| anyhow::Error::new(Unpublished).context(format!("{e:#}")))?;
        self.committed.store(last.plan.gen, Ordering::Release);
        for f in group {
            let trace = &mut f.plan.trace;
            (trace.written, trace.recorded) = (Some(written), Some(recorded));
            trace.published = Some(published);
        }
        Ok(())
    }

    /// Steps 4 and 5 of the live protocol (see the module notes). Returns when each ended.
    #[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
    fn record_and_publish(
        &mut self,
        group: &[Featurised],
        appends: bool,
    ) -> anyhow::Result<(Instant, Instant)> {
        let t = Instant::now();
        for f in group {
            self.manifest.apply(self.manifest_batch(&f.plan))?;
        }
        self.manifest.flush()?;
        StageTimes::add(&self.times.manifest, t);
        let recorded = Instant::now();
        // The same, between the manifest and the publish.
        fail::fail_point!("commit-before-publish", appends, |_| Ok((
            recorded, recorded
        )));
        let t = Instant::now();
        self.outputs.publish()?;
        StageTimes::add(&self.times.write, t);
        Ok((recorded, Instant::now()))
    }

    /// One plan into staging outputs, which are swapped in only when complete: the records go
    /// into the manifest beside the rows, on an output thread ([`crate::output::set::io_pool`]).
    fn commit_staged(&mut self, f: &Featurised) -> anyhow::Result<()> {
        let t = Instant::now();
        let batch = self.manifest_batch(&f.plan);
        let (manifest, times) = (self.manifest.clone(), self.times.clone());
        let mut recorded = None;
        let mut written = None;
        crate::output::set::io_pool().in_place_scope(|scope| {
            scope.spawn(|_| {
                let t = Instant::now();
                recorded = Some(manifest.apply_bulk(batch, crate::engine::manifest::bulk_pool()));
                StageTimes::add(&times.manifest, t);
            });
            written = Some(self.write(f).and_then(|()| self.outputs.start_writeback()));
        });
        written.expect("written")?;
        recorded.expect("recorded")?;
        StageTimes::add(&self.times.write, t);
        self.committed.store(f.plan.gen, Ordering::Release);
        Ok(())
    }

    fn write(&mut self, f: &Featurised) -> anyhow::Result<()> {
        let plan = &f.plan;
        let mut metas: [Vec<RowMeta>; 3] = Default::default();
        for (split, rows) in plan.new_rows.iter().enumerate() {
            let Some(first) = rows.first() else { continue };
            let at = self.outputs.len(split);
            ensure!(
                at == first.row,
                "the ledger placed row {} but the outputs hold {at} rows",
                first.row
            );
            metas[split] = rows.iter().map(|r| r.meta.clone()).collect();
        }
        let parts: Vec<SplitRows<'_>> = (0..3)
            .filter(|&s| !plan.new_rows[s].is_empty())
            .map(|s| (s, &f.mel[s][..], f.waveform[s].as_deref(), &metas[s][..]))
            .collect();
        self.outputs.append_splits(&parts)?;
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
            b.put_labels(labels, self.configured_labels);
        }
        b
    }

    /// Everything durable, files closed (plain readers see exactly `committed_rows` rows).
    pub fn close(mut self) -> anyhow::Result<()> {
        self.outputs.prepare()?;
        self.manifest.flush()?;
        self.outputs.commit()?;
        self.outputs.close()
    }
}

/// Recording or publishing a group failed after its rows were made durable: the outputs keep
/// them, and the next open publishes them if the manifest recorded the group (cuts them if not).
#[derive(Debug, thiserror::Error)]
#[error("the batch's rows are on disk: the reopen makes them visible if the manifest recorded the batch, and cuts them if not")]
pub struct Unpublished;

/// Free space the service keeps in hand on the output and state folders: a batch is written
/// only when its rows fit with this to spare, so a filling disk stops the service before
/// HDF5 or sled ever meet ENOSPC half-way through a write (their files stay whole).
pub const RESERVE_BYTES: u64 = 4 << 20;

/// The folders a live commit writes to, and how many copies of each row it writes.
pub struct Room {
    pub output: std::path::PathBuf,
    pub state: std::path::PathBuf,
    /// Enabled outputs (HDF5, npy): each holds every row.
    pub copies: u64,
    pub path_bytes: u64,
}

impl Room {
    /// Refuse batches that would not leave [`RESERVE_BYTES`] free (the error says where and
    /// how much).
    pub fn check(&self, group: &[Featurised]) -> anyhow::Result<()> {
        let rows: u64 = group
            .iter()
            .flat_map(|f| &f.plan.new_rows)
            .map(|r| r.len() as u64)
            .sum();
        let data: u64 = group
            .iter()
            .map(|f| {
                f.mel.iter().map(|m| (m.len() * 2) as u64).sum::<u64>()
                    + f.waveform
                        .iter()
                        .flatten()
                        .map(|w| (w.len() * 4) as u64)
                        .sum::<u64>()
            })
            .sum();
        // The narrow columns of a row: source_path plus about 100 bytes of the others.
        let need = self.copies * (data + rows * (self.path_bytes + 100)) + RESERVE_BYTES;
        for (dir, need) in [(&self.output, need), (&self.state, RESERVE_BYTES)] {
            ensure_room(dir, need)?;
        }
        Ok(())
    }
}

/// The file system holding `dir` has less than `need` bytes free.
#[derive(Debug, thiserror::Error)]
#[error("no room to write: {dir} has {} free, {} needed (with {} kept in hand): disk full", human(*.free), human(*.need), human(RESERVE_BYTES))]
pub struct NoRoom {
    pub dir: String,
    pub free: u64,
    pub need: u64,
}

/// Fail with [`NoRoom`] unless `dir`'s file system has `need` bytes free.
pub fn ensure_room(dir: &std::path::Path, need: u64) -> anyhow::Result<()> {
    let free = free_bytes(dir)?;
    if free < need {
        return Err(NoRoom {
            dir: dir.display().to_string(),
            free,
            need,
        }
        .into());
    }
    Ok(())
}

/// Bytes an unprivileged writer may still use on the file system holding `dir`.
pub fn free_bytes(dir: &std::path::Path) -> anyhow::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a zeroed struct statvfs for the kernel to fill.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("cannot read the free space of {}", dir.display()));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

fn human(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;
    use crate::engine::ledger::{tests::read, Ledger};
    use crate::identity::LabelSet;
    use crate::output::OutputHeader;
    use std::path::Path;

    fn live(dir: &Path) -> (Committer, Ledger, Settings) {
        let s = Settings::default();
        let labels = LabelSet::new(&s.labels.names, &[], s.labels.unknown);
        let header = OutputHeader {
            labels: labels.names.clone(),
            features: s.features.clone(),
            path_bytes: s.outputs.path_bytes,
        };
        let outputs = OutputSet::create(&dir.join("out"), &s.outputs, &header, true).unwrap();
        let manifest = Arc::new(Manifest::open(&dir.join("manifest")).unwrap());
        let ledger = Ledger::new(&s, labels, [0; 3]);
        let committer = Committer {
            outputs,
            room: None,
            manifest,
            live: true,
            path_bytes: s.outputs.path_bytes,
            committed: ledger.committed_handle(),
            times: Arc::default(),
            configured_labels: s.labels.names.len(),
        };
        (committer, ledger, s)
    }

    /// One decided plan for a new recording, with features of the right size (`short` makes
    /// them one value short, which the outputs refuse).
    fn featurised(
        c: &Committer,
        ledger: &mut Ledger,
        s: &Settings,
        i: usize,
        short: bool,
    ) -> Featurised {
        let rel = format!("LEAK/S00{i}~R{i}~20250118120530~100.wav");
        let plan = ledger
            .decide(&*c.manifest, vec![read(&rel, rel.as_bytes())])
            .unwrap();
        let row_len = s.features.shape().row_len();
        let mut mel: [Vec<f16>; 3] = Default::default();
        for (split, rows) in plan.new_rows.iter().enumerate() {
            mel[split] = vec![f16::ONE; (rows.len() * row_len).saturating_sub(short as usize)];
        }
        Featurised {
            plan,
            mel,
            waveform: Default::default(),
        }
    }

    fn committed_rows(dir: &Path, s: &Settings) -> u64 {
        let header = OutputHeader {
            labels: s.labels.names.clone(),
            features: s.features.clone(),
            path_bytes: s.outputs.path_bytes,
        };
        let outputs =
            OutputSet::open_append(&dir.join("out"), &s.outputs, &header, false, None).unwrap();
        (0..3).map(|split| outputs.committed_rows(split)).sum()
    }

    #[test]
    fn a_group_is_committed_whole_and_recorded_up_to_its_last_plan() {
        let dir = tempfile::tempdir().unwrap();
        let (mut c, mut ledger, s) = live(dir.path());
        let mut group: Vec<Featurised> = (0..3)
            .map(|i| featurised(&c, &mut ledger, &s, i, false))
            .collect();
        let last = group.last().unwrap().plan.gen;
        c.commit_group(&mut group).unwrap();
        let trace = group[0].plan.trace;
        assert!(trace.written.is_some() && trace.written <= trace.recorded);
        assert!(trace.recorded <= trace.published);
        assert_eq!(c.committed.load(Ordering::Acquire), last);
        assert_eq!(c.manifest.files().count(), 3);
        assert_eq!(c.manifest.rows().unwrap().iter().sum::<u64>(), 3);
        c.close().unwrap();
        assert_eq!(committed_rows(dir.path(), &s), 3);
    }

    #[test]
    fn a_group_that_fails_half_way_leaves_neither_rows_nor_records() {
        let dir = tempfile::tempdir().unwrap();
        let (mut c, mut ledger, s) = live(dir.path());
        let mut group = vec![
            featurised(&c, &mut ledger, &s, 0, false),
            featurised(&c, &mut ledger, &s, 1, true),
            featurised(&c, &mut ledger, &s, 2, false),
        ];
        let e = c.commit_group(&mut group).unwrap_err();
        assert!(format!("{e:#}").contains("mel values"), "{e:#}");
        assert_eq!(c.committed.load(Ordering::Acquire), 0);
        let manifest = c.manifest.clone();
        // What the engine does on a failure: drop the committer without a commit.
        drop(c);
        assert_eq!(
            manifest.files().count(),
            0,
            "the manifest saw nothing of the group"
        );
        drop(manifest);
        assert_eq!(
            committed_rows(dir.path(), &s),
            0,
            "the first plan's rows were cut back"
        );
    }
}
