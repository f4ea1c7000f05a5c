//! CPU featuriser: real FFTs, a sparse mel filterbank and a vectorised logarithm, one recording
//! per task on a dedicated rayon pool. This is the bulk-rebuild hot path: nothing here allocates
//! once the featuriser is built.
//!
//! The FFT is our own and "lane-parallel": [`LANES`](vector::LANES) STFT frames go through one radix-4 FFT
//! together, frame `l` in SIMD lane `l`, so every butterfly is a full-width vector operation
//! without shuffles, and the spectrum comes out bin-major (`[bin][lane]`), the layout in which
//! the filterbank is one vector multiply-add per weight. (With realfft, one frame at a time, its
//! scalar real-to-complex post-processing and our transposition cost more than the FFT itself.)
//! The FFT runs in f64 or f32 as the accuracy rule requires ([`Precision`](super::Precision)); everything after it
//! (magnitude, filterbank, logarithm) in f32. realfft (f64) remains for FFT sizes that are not a
//! power of two.
//!
//! Files: this one, the featuriser (its thread pool and per-thread scratch); `plan.rs`, one
//! recording to one row; `fft.rs`, the lane FFT; `vector.rs` and `avx.rs`, the SIMD vocabulary
//! the kernels are written in; `tests.rs`, accuracy against the float64 reference.

#[cfg(target_arch = "x86_64")]
mod avx;
mod fft;
mod plan;
#[cfg(test)]
mod tests;
mod vector;

use super::Featuriser;
use crate::config::{FeatureSettings, FeatureShape};
use crate::decode::Waveform;
use anyhow::Context;
use half::f16;
use plan::{Plan, Scratch};
use rayon::prelude::*;
use std::collections::VecDeque;
use std::sync::Mutex;

/// Featurises on the CPU; see the module documentation.
pub struct CpuFeaturiser {
    plan: Plan,
    pool: rayon::ThreadPool,
    /// One per pool thread, picked by `rayon::current_thread_index()`: the pool is ours alone,
    /// so each lock is uncontended; it only proves the exclusivity to the compiler.
    scratch: Vec<Mutex<Scratch>>,
    /// For single-recording batches (the daemon's usual case), done on the caller's thread
    /// without waking the pool.
    local: Scratch,
    /// Rows of submitted batches, made at `submit`, handed back by `finish`.
    done: VecDeque<Vec<f16>>,
}

impl CpuFeaturiser {
    /// `threads`: size of the featuriser's own rayon pool (0 = one per core).
    pub fn new(settings: &FeatureSettings, threads: usize) -> anyhow::Result<Self> {
        let plan = Plan::new(settings)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ailhd-featurise-{i}"))
            .build()
            .context("starting the CPU featuriser's threads")?;
        let scratch = (0..pool.current_num_threads())
            .map(|_| Mutex::new(plan.scratch()))
            .collect();
        log::debug!(
            "CPU featuriser: {}, {} threads, {}",
            plan.engine_name(),
            pool.current_num_threads(),
            plan.simd.name()
        );
        Ok(CpuFeaturiser {
            local: plan.scratch(),
            plan,
            pool,
            scratch,
            done: VecDeque::new(),
        })
    }
}

impl Featuriser for CpuFeaturiser {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn shape(&self) -> FeatureShape {
        self.plan.shape
    }

    fn submit(&mut self, batch: &[&Waveform], mut rows: Vec<f16>) -> anyhow::Result<()> {
        self.featurise_now(batch, &mut rows)?;
        self.done.push_back(rows);
        Ok(())
    }

    fn finish(&mut self) -> anyhow::Result<Option<Vec<f16>>> {
        Ok(self.done.pop_front())
    }

    fn featurise(&mut self, batch: &[&Waveform], out: &mut [f16]) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.done.is_empty(),
            "featurise called while {} submitted batches are not finished",
            self.done.len()
        );
        self.featurise_now(batch, out)
    }
}

impl CpuFeaturiser {
    fn featurise_now(&mut self, batch: &[&Waveform], out: &mut [f16]) -> anyhow::Result<()> {
        let row_len = self.plan.shape.row_len();
        let num_samples = self.plan.shape.num_samples;
        anyhow::ensure!(
            out.len() == batch.len() * row_len,
            "output buffer holds {} values, {} recordings need {}",
            out.len(),
            batch.len(),
            batch.len() * row_len
        );
        if let Some((i, w)) = batch
            .iter()
            .enumerate()
            .find(|(_, w)| w.len() != num_samples)
        {
            anyhow::bail!(
                "recording {i} of the batch has {} samples, the feature settings need \
                 {num_samples} (decode pads or trims to that length)",
                w.len()
            );
        }
        if batch.len() == 1 {
            self.plan.featurise_one(batch[0], &mut self.local, out);
            return Ok(());
        }
        let (plan, scratch) = (&self.plan, &self.scratch);
        self.pool.install(|| {
            out.par_chunks_mut(row_len)
                .zip(batch.par_iter())
                .for_each(|(row, wav)| {
                    let index = rayon::current_thread_index().expect("runs inside the pool");
                    let mut s = scratch[index].lock().unwrap_or_else(|e| e.into_inner());
                    plan.featurise_one(wav, &mut s, row);
                });
        });
        Ok(())
    }
}
