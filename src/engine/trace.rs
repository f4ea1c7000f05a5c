//! When a batch reached each stage of the engine, so that the service can say what a recording
//! that waited long waited for (its line about a slow batch, docs/operations.md "Metrics").

use std::time::{Duration, Instant};

/// The instants a batch reached, stage by stage. A stage the batch did not pass (a batch of
/// removals is not featurised, say) stays None, and its time counts in the next one's.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Trace {
    /// The engine took the batch: its files began to load.
    pub taken: Option<Instant>,
    /// Loaded and decided, queued for the featuriser.
    pub decided: Option<Instant>,
    /// Featurised, queued for the commit stage.
    pub featurised: Option<Instant>,
    /// Its rows written to every output and synced there (with its commit group).
    pub written: Option<Instant>,
    /// Its records in the manifest, flushed.
    pub recorded: Option<Instant>,
    /// Published: readers see its rows.
    pub published: Option<Instant>,
}

impl Trace {
    /// The stages from `seen` (when the batch's first recording was seen complete) to the
    /// publish, each with the time since the stage before it, in milliseconds:
    /// "waiting for the engine 3 ms, loading and deciding 1 ms, ...".
    pub fn describe(&self, seen: Instant) -> String {
        let steps = [
            ("waiting for the engine", self.taken),
            ("loading and deciding", self.decided),
            ("featurising", self.featurised),
            ("writing and syncing the outputs", self.written),
            ("the manifest", self.recorded),
            ("publishing", self.published),
        ];
        let mut last = seen;
        let mut parts = Vec::new();
        for (name, at) in steps {
            let Some(at) = at else { continue };
            parts.push(format!("{name} {}", ms(at.saturating_duration_since(last))));
            last = last.max(at);
        }
        parts.join(", ")
    }
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stage_gets_the_time_since_the_one_before_and_a_missing_one_goes_to_the_next() {
        let t0 = Instant::now();
        let at = |ms: u64| Some(t0 + Duration::from_millis(ms));
        let full = Trace {
            taken: at(2),
            decided: at(5),
            featurised: at(9),
            written: at(19),
            recorded: at(319),
            published: at(320),
        };
        assert_eq!(
            full.describe(t0),
            "waiting for the engine 2 ms, loading and deciding 3 ms, featurising 4 ms, \
             writing and syncing the outputs 10 ms, the manifest 300 ms, publishing 1 ms"
        );
        let removals = Trace {
            featurised: None,
            ..full
        };
        assert_eq!(
            removals.describe(t0),
            "waiting for the engine 2 ms, loading and deciding 3 ms, \
             writing and syncing the outputs 14 ms, the manifest 300 ms, publishing 1 ms"
        );
        // A recording seen after the engine took its batch (a lane's large file) counts nothing
        // before it.
        assert!(full
            .describe(t0 + Duration::from_millis(4))
            .starts_with("waiting for the engine 0 ms, loading and deciding 1 ms,"));
    }
}
