//! The featurise stage: a thread of its own that turns each plan's new rows into features and
//! hands the plan on to the commit stage.
//!
//! It drives the featuriser's pipelined form ([`Featuriser::submit`] / [`Featuriser::finish`]):
//! up to [`Featuriser::depth`] batches are in the device at once (on the CPU, one: `submit`
//! does the work), and a batch is finished as soon as no further plan is waiting, so a lone
//! micro-batch of the service is never held back for company. The row buffers come back from
//! the commit stage once written and are reused, as are the waveforms' sample buffers once
//! submitted: no batch faults in fresh memory.

use super::commit::Featurised;
use super::ledger::Plan;
use super::stages::{segment_waveform, StageTimes};
use super::FeaturiserFailed;
use crate::config::FeatureSettings;
use crate::features::cuda::DeviceTimes;
use crate::features::Featuriser;
use anyhow::Context;
use crossbeam_channel::{Receiver, Sender};
use half::f16;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// Row buffers handed back by the commit stage: two plans' worth of splits is enough for the
/// queue between the stages.
pub const RECYCLED: usize = 8;

/// What the featurise stage hands back when it stops, and with it a stopped engine: the GPU's
/// stage times, and the featuriser unless it failed.
pub type Stopped = (Option<DeviceTimes>, Option<Box<dyn Featuriser>>);

/// A plan whose rows are in the featuriser.
struct InFlight {
    plan: Plan,
    /// Splits submitted, in order (their rows come back from `finish` in this order).
    splits: Vec<usize>,
    waveform: [Option<Vec<f32>>; 3],
}

pub struct Stage {
    pub featuriser: Box<dyn Featuriser>,
    pub features: FeatureSettings,
    pub times: Arc<StageTimes>,
    /// Row buffers written out by the commit stage.
    pub recycled: Receiver<Vec<f16>>,
}

impl Stage {
    /// Run until `plans` is closed and everything submitted is handed on, or `out` is closed,
    /// or a batch fails: its error is handed on (as [`FeaturiserFailed`]) and the featuriser,
    /// which may be left in any state (a GPU context lost, say), is dropped; whoever opens the
    /// engine again builds a new one. Returns the device's stage times and the featuriser.
    pub fn run(
        mut self,
        plans: Receiver<Plan>,
        out: Sender<anyhow::Result<Featurised>>,
    ) -> Stopped {
        let depth = self.featuriser.depth().max(1);
        let mut flight: VecDeque<InFlight> = VecDeque::new();
        loop {
            // Wait for a plan only when nothing is in the device; otherwise take one that is
            // already waiting, else finish the oldest batch now.
            let next = if flight.is_empty() {
                match plans.recv() {
                    Ok(p) => Some(p),
                    Err(_) => break,
                }
            } else {
                plans.try_recv().ok()
            };
            if let Some(plan) = next {
                let t = Instant::now();
                let submitted = self.submit(plan);
                StageTimes::add(&self.times.featurise, t);
                match submitted {
                    Ok(f) => flight.push_back(f),
                    Err(e) => return self.failed(e, &out),
                }
                if flight.len() < depth {
                    continue;
                }
            }
            let oldest = flight.pop_front().expect("a batch in flight");
            let t = Instant::now();
            let finished = self.finish(oldest);
            StageTimes::add(&self.times.featurise, t);
            match finished {
                Ok(mut f) => {
                    f.plan.trace.featurised = Some(Instant::now());
                    if out.send(Ok(f)).is_err() {
                        break;
                    }
                }
                Err(e) => return self.failed(e, &out),
            }
        }
        // Leave the featuriser with nothing in flight (the batches of a run stopped early are
        // not carried out), so that it can be used again.
        while let Ok(Some(_)) = self.featuriser.finish() {}
        (self.featuriser.device_times(), Some(self.featuriser))
    }

    fn failed(self, e: anyhow::Error, out: &Sender<anyhow::Result<Featurised>>) -> Stopped {
        let device = self.featuriser.name();
        log::warn!(
            "the featuriser ({device}) failed: dropped, a new one is built when ingest resumes"
        );
        let _ = out.send(Err(e.context(FeaturiserFailed { device })));
        (self.featuriser.device_times(), None)
    }

    fn submit(&mut self, mut plan: Plan) -> anyhow::Result<InFlight> {
        let shape = self.featuriser.shape();
        let mut splits = Vec::new();
        let mut waveform: [Option<Vec<f32>>; 3] = Default::default();
        for (split, rows) in plan.new_rows.iter_mut().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let waves: Vec<&crate::decode::Waveform> = rows.iter().map(|r| &r.wave).collect();
            if self.features.store_waveform {
                let wl = shape.waveform_len();
                let mut w = vec![0f32; waves.len() * wl];
                for (wave, out) in waves.iter().zip(w.chunks_exact_mut(wl)) {
                    segment_waveform(wave, &self.features, &shape, out);
                }
                waveform[split] = Some(w);
            }
            let mut buffer = self.recycled.try_recv().unwrap_or_default();
            buffer.clear();
            buffer.resize(waves.len() * shape.row_len(), f16::ZERO);
            // Test builds (feature `failpoints`): FAILPOINTS='featurise=N*return(why)' makes the
            // next N batches fail here as a failing featuriser would (tests/faults.rs).
            fail::fail_point!("featurise", |why| Err(anyhow::anyhow!(
                "fail point: {}",
                why.unwrap_or_default()
            ))
            .with_context(|| format!("featurising on {}", self.featuriser.name())));
            self.featuriser
                .submit(&waves, buffer)
                .with_context(|| format!("featurising on {}", self.featuriser.name()))?;
            splits.push(split);
            // The samples are not needed past this point: their buffers go to the next decodes.
            for r in rows.iter_mut() {
                std::mem::take(&mut r.wave).recycle();
            }
        }
        Ok(InFlight {
            plan,
            splits,
            waveform,
        })
    }

    fn finish(&mut self, f: InFlight) -> anyhow::Result<Featurised> {
        let mut mel: [Vec<f16>; 3] = Default::default();
        for &split in &f.splits {
            mel[split] = self
                .featuriser
                .finish()
                .with_context(|| format!("featurising on {}", self.featuriser.name()))?
                .context("the featuriser lost a submitted batch")?;
        }
        Ok(Featurised {
            plan: f.plan,
            mel,
            waveform: f.waveform,
        })
    }
}
