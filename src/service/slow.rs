//! The service's line about a slow batch: when a recording waited long from complete to
//! committed, what the batch it was in waited for, stage by stage (docs/operations.md,
//! "Metrics"). The latency histogram says how often; this line says where the time went.

use crate::engine::Done;
use std::time::{Duration, Instant};

/// A batch whose slowest recording took longer than this from complete to committed is slow
/// (the service's p99 goal at 1,000 recordings/s, four times the one at 100/s).
pub const SLOW_BATCH: Duration = Duration::from_millis(100);

/// At most one line this often: a burst (thousands of files moved in at once) makes every batch
/// slow, and the line after it counts those it did not describe.
pub const LINE_EVERY: Duration = Duration::from_secs(30);

#[derive(Default)]
pub struct SlowBatches {
    last_line: Option<Instant>,
    unsaid: u64,
}

impl SlowBatches {
    /// The line about `done` made durable at `now`, when it was slow and no line was written in
    /// the last [`LINE_EVERY`].
    pub fn line(&mut self, done: &Done, now: Instant) -> Option<String> {
        let slowest = done.latencies.iter().max()?;
        let seen = done.first_seen?;
        if *slowest < SLOW_BATCH {
            return None;
        }
        if self
            .last_line
            .is_some_and(|t| now.saturating_duration_since(t) < LINE_EVERY)
        {
            self.unsaid += 1;
            return None;
        }
        self.last_line = Some(now);
        let unsaid = match std::mem::take(&mut self.unsaid) {
            0 => String::new(),
            n => format!(" ({n} more slow batches since the last such line)"),
        };
        let n = done.latencies.len();
        Some(format!(
            "slow batch: {n} recording{}, the slowest committed {:.0} ms after it was complete: {}{unsaid}",
            if n == 1 { "" } else { "s" },
            slowest.as_secs_f64() * 1e3,
            done.trace.describe(seen),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Trace;

    fn done(t0: Instant, slowest_ms: u64) -> Done {
        let at = |ms: u64| Some(t0 + Duration::from_millis(ms));
        Done {
            latencies: vec![Duration::from_millis(3), Duration::from_millis(slowest_ms)],
            first_seen: Some(t0),
            trace: Trace {
                taken: at(1),
                decided: at(2),
                featurised: at(3),
                written: at(slowest_ms - 2),
                recorded: at(slowest_ms - 1),
                published: at(slowest_ms),
            },
            ..Done::default()
        }
    }

    #[test]
    fn a_slow_batch_is_described_once_in_a_while_and_the_next_line_counts_the_rest() {
        let t0 = Instant::now();
        let mut slow = SlowBatches::default();
        assert_eq!(slow.line(&done(t0, 40), t0), None, "a fast batch");
        let first = slow.line(&done(t0, 400), t0).expect("a slow batch");
        assert_eq!(
            first,
            "slow batch: 2 recordings, the slowest committed 400 ms after it was complete: \
             waiting for the engine 1 ms, loading and deciding 1 ms, featurising 1 ms, \
             writing and syncing the outputs 395 ms, the manifest 1 ms, publishing 1 ms"
        );
        for s in 1..=3 {
            let now = t0 + Duration::from_secs(s);
            assert_eq!(
                slow.line(&done(t0, 400), now),
                None,
                "within {LINE_EVERY:?}"
            );
        }
        let later = slow
            .line(&done(t0, 300), t0 + LINE_EVERY)
            .expect("a line again");
        assert!(
            later.ends_with("(3 more slow batches since the last such line)"),
            "{later}"
        );
        assert_eq!(
            slow.line(&Done::default(), t0 + 3 * LINE_EVERY),
            None,
            "a batch without rows"
        );
    }
}
