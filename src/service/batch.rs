//! The service's micro-batching policy: when the ingest worker hands what it has gathered to the
//! engine. Pure: it is driven by the time and by what arrives, and unit tests step through it
//! without threads or files.
//!
//! The rules, in the order they are checked:
//!
//! 1. **The cap**: a batch closes at `max_files` inputs.
//! 2. **A removal is half of a move**: a path that went away is often a recording moved
//!    elsewhere in the tree, whose arrival is a moment behind (it is probed before it is
//!    handed on). A batch holding a removal closes when an arrival came after the last removal
//!    and nothing is settling any more, or once the removal has been held
//!    [`Policy::gone_hold`] with nothing settling, or at the latest `gone_hold + 2 x settle`
//!    after it (a file still settling then is not waited for). The row is then handed over in
//!    one batch and never shows as invalid in between.
//! 3. **Group commit**: with no batch of the engine's in flight, a batch closes at once: waiting
//!    would gain nothing, and a recording's latency is then what its own commit costs. While
//!    batches are in flight, what arrives gathers until they are done, or until the first input
//!    has waited `max_wait` (`ingest.max_batch_latency_ms`), so that a burst is committed in
//!    few large batches sharing their syncs.

use crate::engine::outcome::Observation;
use crate::engine::Input;
use std::time::{Duration, Instant};

/// The settings the policy follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// `ingest.max_batch_files`.
    pub max_files: usize,
    /// `ingest.max_batch_latency_ms`: the longest the first input waits while batches are in
    /// flight.
    pub max_wait: Duration,
    /// How long a removal waits for the arrival that would make it a move.
    pub gone_hold: Duration,
    /// `ingest.settle_ms`: a removal waits up to `gone_hold + 2 x settle` while files settle.
    pub settle: Duration,
}

/// How long a removal waits for the arrival that would make it a move, when nothing settles.
pub const GONE_HOLD: Duration = Duration::from_millis(50);

impl Policy {
    pub fn from_settings(ingest: &crate::config::Ingest) -> Policy {
        Policy {
            max_files: ingest.max_batch_files.max(1),
            max_wait: Duration::from_millis(ingest.max_batch_latency_ms),
            gone_hold: GONE_HOLD,
            settle: Duration::from_millis(ingest.settle_ms),
        }
    }
}

/// What the worker does next with the batch it gathers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Nothing gathered.
    Empty,
    /// Hand the batch to the engine now.
    Close,
    /// Gather more until then (or until something arrives, or the engine's batches are done).
    WaitUntil(Instant),
}

/// What the engine and the event loop are doing, as the policy needs it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// The engine's batches submitted and not yet durable.
    pub in_flight: usize,
    /// Files seen and not yet complete (the settle stage): arrivals on their way.
    pub settling: usize,
}

/// The batch being gathered.
#[derive(Debug)]
pub struct Batcher {
    policy: Policy,
    inputs: Vec<Input>,
    first_at: Option<Instant>,
    /// When the last removal came, while no arrival has come after it.
    removal_at: Option<Instant>,
    /// An arrival came after the last removal.
    arrived_after_removal: bool,
}

fn is_removal(input: &Input) -> bool {
    matches!(
        input,
        Input::Observe(Observation::Gone(_) | Observation::FolderGone(_))
    )
}

impl Batcher {
    pub fn new(policy: Policy) -> Batcher {
        Batcher {
            policy,
            inputs: Vec::new(),
            first_at: None,
            removal_at: None,
            arrived_after_removal: false,
        }
    }

    /// New settings (a reload): they apply to what is gathered from now on too.
    pub fn set_policy(&mut self, policy: Policy) {
        self.policy = policy;
    }

    pub fn len(&self) -> usize {
        self.inputs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }

    /// Room left before the cap.
    pub fn room(&self) -> usize {
        self.policy.max_files.saturating_sub(self.inputs.len())
    }

    pub fn push(&mut self, input: Input, now: Instant) {
        self.first_at.get_or_insert(now);
        if is_removal(&input) {
            self.removal_at = Some(now);
            self.arrived_after_removal = false;
        } else if matches!(input, Input::Load { .. }) {
            self.arrived_after_removal = true;
        }
        self.inputs.push(input);
    }

    /// What to do now (see the module notes for the rules).
    pub fn next(&self, now: Instant, load: Load) -> Next {
        let Some(first_at) = self.first_at else {
            return Next::Empty;
        };
        let p = &self.policy;
        if self.inputs.len() >= p.max_files {
            return Next::Close;
        }
        if let Some(removed) = self.removal_at {
            let settled = load.settling == 0;
            let held = removed + p.gone_hold;
            let longest = held + 2 * p.settle;
            if (settled && (self.arrived_after_removal || now >= held)) || now >= longest {
                return Next::Close;
            }
            return Next::WaitUntil(if settled { held } else { longest });
        }
        let deadline = first_at + p.max_wait;
        if load.in_flight == 0 || now >= deadline {
            Next::Close
        } else {
            Next::WaitUntil(deadline)
        }
    }

    /// The batch, handed on; gathering starts anew.
    pub fn take(&mut self) -> Vec<Input> {
        self.first_at = None;
        self.removal_at = None;
        self.arrived_after_removal = false;
        std::mem::take(&mut self.inputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy {
            max_files: 4,
            max_wait: Duration::from_millis(20),
            gone_hold: Duration::from_millis(50),
            settle: Duration::from_millis(200),
        }
    }

    fn load(rel: &str) -> Input {
        Input::Load {
            rel: rel.into(),
            seen: None,
        }
    }

    fn gone(rel: &str) -> Input {
        Input::Observe(Observation::Gone(rel.into()))
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    const IDLE: Load = Load {
        in_flight: 0,
        settling: 0,
    };
    const BUSY: Load = Load {
        in_flight: 1,
        settling: 0,
    };

    fn rels(batch: &[Input]) -> Vec<String> {
        batch
            .iter()
            .map(|i| match i {
                Input::Load { rel, .. } => format!("+{rel}"),
                Input::Observe(o) => format!("-{}", o.rel()),
            })
            .collect()
    }

    #[test]
    fn empty_until_something_arrives() {
        let b = Batcher::new(policy());
        assert_eq!(b.next(Instant::now(), IDLE), Next::Empty);
    }

    #[test]
    fn a_lone_arrival_goes_at_once_when_the_engine_is_idle() {
        let t0 = Instant::now();
        let mut b = Batcher::new(policy());
        b.push(load("LEAK/a.wav"), t0);
        assert_eq!(b.next(t0, IDLE), Next::Close);
        // Files settling elsewhere do not hold it either.
        let settling = Load {
            in_flight: 0,
            settling: 3,
        };
        assert_eq!(b.next(t0, settling), Next::Close);
        assert_eq!(rels(&b.take()), ["+LEAK/a.wav"]);
        assert_eq!(b.next(t0, IDLE), Next::Empty);
    }

    #[test]
    fn arrivals_gather_while_batches_are_in_flight_until_they_are_done_or_max_wait() {
        let t0 = Instant::now();
        let mut b = Batcher::new(policy());
        b.push(load("a"), t0);
        assert_eq!(b.next(t0, BUSY), Next::WaitUntil(t0 + ms(20)));
        b.push(load("b"), t0 + ms(5));
        // The deadline stays the first input's.
        assert_eq!(b.next(t0 + ms(5), BUSY), Next::WaitUntil(t0 + ms(20)));
        // The engine's batch is done: close.
        assert_eq!(b.next(t0 + ms(6), IDLE), Next::Close);
        // Or the engine stays busy: close at the deadline.
        assert_eq!(b.next(t0 + ms(20), BUSY), Next::Close);
        assert_eq!(rels(&b.take()), ["+a", "+b"]);
        // The next batch has a deadline of its own.
        b.push(load("c"), t0 + ms(30));
        assert_eq!(b.next(t0 + ms(30), BUSY), Next::WaitUntil(t0 + ms(50)));
    }

    #[test]
    fn the_cap_closes_a_batch_even_when_busy_or_holding_a_removal() {
        let t0 = Instant::now();
        let mut b = Batcher::new(policy());
        b.push(gone("x"), t0);
        let busy_settling = Load {
            in_flight: 2,
            settling: 5,
        };
        for k in 0..3 {
            assert_ne!(b.next(t0, busy_settling), Next::Close);
            b.push(load(&format!("f{k}")), t0);
        }
        assert_eq!(b.room(), 0);
        assert_eq!(b.next(t0, busy_settling), Next::Close);
        assert_eq!(b.take().len(), 4);
    }

    #[test]
    fn a_removal_and_its_arrival_go_in_one_batch() {
        let t0 = Instant::now();
        let mut b = Batcher::new(policy());
        b.push(gone("LEAK/a.wav"), t0);
        // The arrival is still being probed: wait, even with the engine idle.
        let settling = Load {
            in_flight: 0,
            settling: 1,
        };
        assert_eq!(b.next(t0 + ms(1), settling), Next::WaitUntil(t0 + ms(450)));
        b.push(load("NORMAL/a.wav"), t0 + ms(3));
        // It came, and nothing else is settling: the two go together.
        assert_eq!(b.next(t0 + ms(3), IDLE), Next::Close);
        assert_eq!(rels(&b.take()), ["-LEAK/a.wav", "+NORMAL/a.wav"]);
    }

    #[test]
    fn a_lone_removal_is_released_after_its_hold() {
        let t0 = Instant::now();
        let mut b = Batcher::new(policy());
        b.push(gone("LEAK/a.wav"), t0);
        assert_eq!(b.next(t0, IDLE), Next::WaitUntil(t0 + ms(50)));
        assert_eq!(b.next(t0 + ms(49), IDLE), Next::WaitUntil(t0 + ms(50)));
        assert_eq!(b.next(t0 + ms(50), IDLE), Next::Close);
        assert_eq!(rels(&b.take()), ["-LEAK/a.wav"]);
    }

    #[test]
    fn a_removal_waits_longer_while_files_settle_but_not_forever() {
        let t0 = Instant::now();
        let mut b = Batcher::new(policy());
        b.push(gone("LEAK/a.wav"), t0);
        let settling = Load {
            in_flight: 0,
            settling: 1,
        };
        assert_eq!(b.next(t0 + ms(60), settling), Next::WaitUntil(t0 + ms(450)));
        // An arrival that is not the other half, while another file still settles: keep holding.
        b.push(load("LEAK/b.wav"), t0 + ms(70));
        assert_eq!(b.next(t0 + ms(70), settling), Next::WaitUntil(t0 + ms(450)));
        // Settling ends: release.
        assert_eq!(b.next(t0 + ms(80), IDLE), Next::Close);
        // Or it never ends: released at gone_hold + 2 x settle.
        assert_eq!(b.next(t0 + ms(450), settling), Next::Close);
    }

    #[test]
    fn a_later_removal_holds_the_batch_again() {
        let t0 = Instant::now();
        let mut b = Batcher::new(policy());
        b.push(gone("a"), t0);
        b.push(load("b"), t0 + ms(2));
        b.push(gone("c"), t0 + ms(10));
        assert_eq!(b.next(t0 + ms(10), IDLE), Next::WaitUntil(t0 + ms(60)));
        b.push(load("d"), t0 + ms(12));
        assert_eq!(b.next(t0 + ms(12), IDLE), Next::Close);
        assert_eq!(rels(&b.take()), ["-a", "+b", "-c", "+d"]);
    }

    #[test]
    fn other_observations_do_not_count_as_arrivals() {
        let t0 = Instant::now();
        let mut b = Batcher::new(policy());
        b.push(gone("a"), t0);
        b.push(
            Input::Observe(Observation::Rejected {
                rel: "b".into(),
                reason: crate::engine::outcome::Reason::NotUtf8,
                size: 0,
                mtime_ns: 0,
            }),
            t0 + ms(1),
        );
        assert_eq!(b.next(t0 + ms(1), IDLE), Next::WaitUntil(t0 + ms(50)));
    }
}
