//! The status snapshot the worker keeps for `ailhd status` and the metrics: the manifest's
//! counts (kept by every commit, never counted while recordings wait), the service's figures,
//! and what it is riding out.

use super::worker::Worker;
use crate::engine::manifest::now_ms;
use crate::status::{self, ServiceStatus};
use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Recent completion-to-commit latencies and errors, for `status`.
#[derive(Default)]
pub(super) struct Recent {
    pub(super) latencies: VecDeque<f64>,
    pub(super) errors: VecDeque<String>,
}

impl Recent {
    const KEEP: usize = 2000;
    pub(super) fn push_latency(&mut self, ms: f64) {
        if self.latencies.len() == Self::KEEP {
            self.latencies.pop_front();
        }
        self.latencies.push_back(ms);
    }
    pub(super) fn push_error(&mut self, e: String) {
        if self.errors.len() == 10 {
            self.errors.pop_front();
        }
        self.errors.push_back(e);
    }
    fn percentile(&self, q: f64) -> Option<f64> {
        if self.latencies.is_empty() {
            return None;
        }
        let mut v: Vec<f64> = self.latencies.iter().copied().collect();
        v.sort_by(|a, b| a.total_cmp(b));
        Some(v[((v.len() - 1) as f64 * q).round() as usize])
    }
}

impl Worker {
    pub(super) fn snapshot(&mut self) {
        if let Some(engine) = &self.engine {
            match status::collect(engine.manifest(), engine.labels(), &self.settings) {
                Ok(r) => self.last_report = r,
                Err(e) => log::warn!("cannot read the manifest for the status snapshot: {e:#}"),
            }
            self.labels = engine.labels().to_vec();
            for (stage, secs) in engine.times().seconds() {
                crate::metrics::stage_seconds(stage, secs);
            }
        }
        let mut r = self.last_report.clone();
        crate::metrics::record_status(&r, &self.labels);
        let shared = &self.shared;
        let queue = shared.settling.load(Ordering::Relaxed) + shared.queued.load(Ordering::Relaxed);
        crate::metrics::pending(shared.settling.load(Ordering::Relaxed));
        crate::metrics::queue_depth(queue);
        crate::metrics::ready();
        r.service = Some(ServiceStatus {
            pid: std::process::id(),
            device: self.device.clone(),
            queue_depth: queue,
            ingested: self.ingested,
            latency_ms_p50: self.recent.percentile(0.5),
            latency_ms_p90: self.recent.percentile(0.9),
            latency_ms_p99: self.recent.percentile(0.99),
            last_errors: self.recent.errors.iter().cloned().collect(),
            pending: shared
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            updated_ms: now_ms(),
            age_s: 0.0,
            outputs_open: self.engine.is_some(),
            unwatched: shared
                .unwatched
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|(p, r)| status::Unwatched {
                    path: p.display().to_string(),
                    reason: r.clone(),
                })
                .collect(),
            write_failing: self.fault.as_ref().map(|f| status::WriteFailing {
                since_ms: f.since_ms,
                error: f.error.clone(),
                retry_in_s: f
                    .retry_at
                    .saturating_duration_since(Instant::now())
                    .as_secs_f64(),
                dropped: self.dropped,
            }),
        });
        let json = serde_json::to_vec_pretty(&r).expect("the report serialises");
        // Rewritten every few seconds: atomic for readers, not synced (a power cut loses one
        // snapshot; the next start writes another).
        let write = |path: &Path| crate::durable::replace(path, &json, crate::durable::Sync::None);
        // The runtime copy first: it is what `status` reads when the state folder's disk fails.
        let runtime = status::runtime_snapshot_path(&self.settings);
        let _ = runtime
            .parent()
            .map(std::fs::create_dir_all)
            .transpose()
            .and_then(|_| write(&runtime));
        let path = status::snapshot_path(&self.settings);
        match write(&path) {
            Ok(()) => self.snapshot_failing = false,
            Err(e) if !self.snapshot_failing => {
                self.snapshot_failing = true;
                log::warn!(
                    "cannot write the status snapshot {}: {e}; `ailhd status` reads {} meanwhile",
                    path.display(),
                    runtime.display()
                );
            }
            Err(_) => {}
        }
        self.dirty = false;
        self.last_snapshot = Instant::now();
    }

    /// Snapshot at most every 2 s, and never more than ~10% of the time.
    pub(super) fn snapshot_if_due(&mut self) {
        if self.dirty
            && self.last_snapshot.elapsed() > (self.snapshot_cost * 10).max(Duration::from_secs(2))
        {
            let t = Instant::now();
            self.snapshot();
            self.snapshot_cost = t.elapsed();
        }
    }
}
