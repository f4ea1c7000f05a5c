//! The enabled outputs of every split, driven together: an append goes to the HDF5 file and to
//! the npy columns of its split, so both always hold the same rows at the same indices. The
//! sinks of an append or a commit work at the same time, each on its own thread: writing both
//! outputs would otherwise cost their sum on the writer's critical path.

use super::hdf5::Hdf5Sink;
use super::npy::NpySink;
use super::{hdf5_path, npy_dir, OutputHeader, RowMeta, SplitSink};
use crate::config::{Outputs, SPLITS};
use anyhow::{ensure, Context};
use half::f16;
use std::path::Path;

/// One split's part of a batch for [`OutputSet::append_splits`]: the split, its rows' features
/// (and waveforms, when stored) and metadata.
pub type SplitRows<'a> = (usize, &'a [f16], Option<&'a [f32]>, &'a [RowMeta]);

pub struct OutputSet {
    /// Per split, the enabled sinks (HDF5 first, then npy).
    splits: Vec<Vec<Box<dyn SplitSink>>>,
}

impl OutputSet {
    /// New, empty outputs under `dir` (which must not hold them yet).
    pub fn create(
        dir: &Path,
        outputs: &Outputs,
        header: &OutputHeader,
        swmr: bool,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        Self::build(dir, outputs, |kind, _, path| match kind {
            // Live outputs are synced as they are made; staging ones once, by their close.
            Kind::Hdf5 if swmr => {
                Ok(Box::new(Hdf5Sink::create(path, header, true)?) as Box<dyn SplitSink>)
            }
            Kind::Hdf5 => {
                Ok(Box::new(Hdf5Sink::create_staged(path, header)?) as Box<dyn SplitSink>)
            }
            Kind::Npy if swmr => Ok(Box::new(NpySink::create(path, header)?) as Box<dyn SplitSink>),
            Kind::Npy => {
                Ok(Box::new(NpySink::create_staged(path, header, true)?) as Box<dyn SplitSink>)
            }
        })
    }

    /// Existing outputs, reopened for appending: refuses outputs made with other feature
    /// settings, and reclaims rows past `committed_rows` left by a crash, and past `keep[split]`
    /// (what the manifest accounts for) when given.
    pub fn open_append(
        dir: &Path,
        outputs: &Outputs,
        header: &OutputHeader,
        swmr: bool,
        keep: Option<[u64; 3]>,
    ) -> anyhow::Result<Self> {
        let set = Self::build(dir, outputs, |kind, split, path| {
            let k = keep.map(|k| k[split]);
            Ok(match kind {
                Kind::Hdf5 => {
                    Box::new(Hdf5Sink::open_append(path, header, swmr, k)?) as Box<dyn SplitSink>
                }
                Kind::Npy => Box::new(NpySink::open_append(path, header, k)?) as Box<dyn SplitSink>,
            })
        })?;
        for (split, sinks) in set.splits.iter().enumerate() {
            let rows: Vec<u64> = sinks.iter().map(|s| s.committed_rows()).collect();
            ensure!(
                rows.windows(2).all(|w| w[0] == w[1]),
                "the {} outputs disagree on committed rows ({rows:?}): run `ailhd rebuild`",
                SPLITS[split]
            );
        }
        Ok(set)
    }

    /// [`OutputSet::open_append`] in SWMR mode after this process closed the outputs cleanly
    /// with `rows` committed per split ([`crate::engine::Suspended`]): what still holds
    /// exactly those rows is opened without the recovery's syncs.
    pub fn resume(
        dir: &Path,
        outputs: &Outputs,
        header: &OutputHeader,
        rows: [u64; 3],
    ) -> anyhow::Result<Self> {
        Self::build(dir, outputs, |kind, split, path| {
            Ok(match kind {
                Kind::Hdf5 => {
                    Box::new(Hdf5Sink::resume(path, header, rows[split])?) as Box<dyn SplitSink>
                }
                Kind::Npy => {
                    Box::new(NpySink::resume(path, header, rows[split])?) as Box<dyn SplitSink>
                }
            })
        })
    }

    /// Whether outputs exist under `dir` (any enabled kind, any split).
    pub fn exists(dir: &Path, outputs: &Outputs) -> bool {
        (0..3).any(|s| {
            (outputs.hdf5 && hdf5_path(dir, &outputs.hdf5_names, s).exists())
                || (outputs.npy && npy_dir(dir, s).exists())
        })
    }

    fn build(
        dir: &Path,
        outputs: &Outputs,
        mut open: impl FnMut(Kind, usize, &Path) -> anyhow::Result<Box<dyn SplitSink>>,
    ) -> anyhow::Result<Self> {
        let mut splits = Vec::with_capacity(3);
        for split in 0..3 {
            let mut sinks = Vec::new();
            if outputs.hdf5 {
                sinks.push(open(
                    Kind::Hdf5,
                    split,
                    &hdf5_path(dir, &outputs.hdf5_names, split),
                )?);
            }
            if outputs.npy {
                sinks.push(open(Kind::Npy, split, &npy_dir(dir, split))?);
            }
            splits.push(sinks);
        }
        Ok(OutputSet { splits })
    }

    /// Rows appended to `split` so far.
    pub fn len(&self, split: usize) -> u64 {
        self.splits[split][0].len()
    }

    pub fn committed_rows(&self, split: usize) -> u64 {
        self.splits[split][0].committed_rows()
    }

    /// Append a batch's rows to the splits it has rows for (`(split, mel, waveform, meta)`, each
    /// split once): every sink of every split at the same time, so one split's npy columns are
    /// written while another's HDF5 file is (HDF5 calls still take turns on the library's lock).
    /// Each split's sinks must agree on where its rows went.
    pub fn append_splits(&mut self, rows: &[SplitRows<'_>]) -> anyhow::Result<()> {
        let mut jobs: Vec<(&mut Box<dyn SplitSink>, &SplitRows<'_>)> = Vec::new();
        for (split, sinks) in self.splits.iter_mut().enumerate() {
            if let Some(r) = rows.iter().find(|r| r.0 == split) {
                jobs.extend(sinks.iter_mut().map(|s| (s, r)));
            }
        }
        let at = concurrently(&mut jobs, |(sink, (_, mel, wave, meta))| {
            sink.append(mel, *wave, meta)
        })?;
        // Results in job order, so each split's sinks are side by side.
        let placed: Vec<(usize, u64)> = jobs.iter().map(|(_, r)| r.0).zip(at).collect();
        for split in placed.chunk_by(|a, b| a.0 == b.0) {
            ensure!(
                split.windows(2).all(|w| w[0].1 == w[1].1),
                "outputs of split {} out of step ({:?})",
                SPLITS[split[0].0],
                split.iter().map(|&(_, at)| at).collect::<Vec<u64>>()
            );
        }
        Ok(())
    }

    /// The label list grew (`labels.unknown = "append"`): rewrite the label attributes.
    pub fn set_labels(&mut self, labels: &[String]) -> anyhow::Result<()> {
        for sink in self.splits.iter_mut().flatten() {
            sink.set_labels(labels)?;
        }
        Ok(())
    }

    pub fn set_valid(&mut self, split: usize, row: u64, valid: bool) -> anyhow::Result<()> {
        self.splits[split]
            .iter_mut()
            .try_for_each(|s| s.set_valid(row, valid))
    }

    pub fn set_owner(
        &mut self,
        split: usize,
        row: u64,
        meta: &RowMeta,
        path_bytes: usize,
    ) -> anyhow::Result<()> {
        self.splits[split]
            .iter_mut()
            .try_for_each(|s| s.set_owner(row, meta, path_bytes))
    }

    /// Make every appended row of every split durable and visible.
    pub fn commit(&mut self) -> anyhow::Result<()> {
        self.on_every_sink(|sink| sink.commit())
    }

    /// [`SplitSink::prepare`] on every sink at once: every appended row and edit durable,
    /// nothing new visible to readers yet.
    pub fn prepare(&mut self) -> anyhow::Result<()> {
        self.on_every_sink(|sink| sink.prepare())
    }

    /// [`SplitSink::publish`] on every sink: readers see the prepared rows.
    pub fn publish(&mut self) -> anyhow::Result<()> {
        self.on_every_sink(|sink| sink.publish())
    }

    /// `f` on every sink at once ([`concurrently`]); the first error wins.
    fn on_every_sink(
        &mut self,
        f: impl Fn(&mut dyn SplitSink) -> anyhow::Result<()> + Sync,
    ) -> anyhow::Result<()> {
        let mut all: Vec<&mut dyn SplitSink> = self
            .splits
            .iter_mut()
            .flatten()
            .map(|s| &mut **s as &mut dyn SplitSink)
            .collect();
        concurrently(&mut all, |sink| f(&mut **sink)).map(drop)
    }

    /// [`SplitSink::start_writeback`] on every sink.
    pub fn start_writeback(&mut self) -> anyhow::Result<()> {
        self.on_every_sink(|sink| sink.start_writeback())
    }

    /// Close every sink, all at once: their closing syncs wait on the disk together. Every sink
    /// is closed whatever the others do; the first error (in sink order) is returned.
    pub fn close(self) -> anyhow::Result<()> {
        std::thread::scope(|scope| {
            let closing: Vec<_> = self
                .splits
                .into_iter()
                .flatten()
                .map(|sink| scope.spawn(move || sink.close()))
                .collect();
            closing
                .into_iter()
                .map(|h| h.join().expect("closing an output panicked"))
                .collect::<anyhow::Result<Vec<()>>>()
        })
        .map(drop)
    }
}

enum Kind {
    Hdf5,
    Npy,
}

/// Threads for the output work that runs beside the writer's own: the other sinks of an append
/// or a commit, and the manifest's records (`rebuild`). Kept for the life of the process, so
/// that a batch costs no thread start and its allocations reuse the threads' warm heaps; idle,
/// they sleep.
pub fn io_pool() -> &'static rayon::ThreadPool {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .thread_name(|i| format!("ailhd-io-{i}"))
            .build()
            .expect("output threads start")
    })
}

/// `f` on every item (a sink, or a sink with its work) at once: the first on this thread, the
/// others on [`io_pool`] (HDF5 calls serialise on the library's lock; npy and fsyncs run beside
/// them). Results in item order; the first error wins.
fn concurrently<S, T>(
    items: &mut [S],
    f: impl Fn(&mut S) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<Vec<T>>
where
    S: Send,
    T: Send,
{
    let Some((first, rest)) = items.split_first_mut() else {
        return Ok(Vec::new());
    };
    let f = &f;
    let mut others: Vec<Option<anyhow::Result<T>>> = rest.iter().map(|_| None).collect();
    let mut own = None;
    io_pool().in_place_scope(|scope| {
        for (item, slot) in rest.iter_mut().zip(&mut others) {
            scope.spawn(move |_| *slot = Some(f(item)));
        }
        own = Some(f(first));
    });
    std::iter::once(own)
        .chain(others)
        .map(|r| r.expect("every item ran"))
        .collect()
}
