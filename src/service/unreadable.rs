//! Recordings quarantined because reading them failed (an I/O error, a permission refused):
//! unlike a file that is not a usable WAV, such a condition may pass, so the service reads each
//! again after a while, besides when it changes. The first retry comes after
//! `ingest.unreadable_retry_s`, each later one after twice the wait before, up to an hour; a
//! path that was not refused for two hours starts again from the first wait. A change of its
//! attributes (a chmod, a chown) has it read again at once.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The longest wait between two tries.
pub const MAX_WAIT: Duration = Duration::from_secs(3600);

#[derive(Default)]
pub struct Unreadable {
    /// Refusals in a row by path, and when the last one came.
    refused: HashMap<String, (u32, Instant)>,
    /// Paths to read again, and when.
    due: Vec<(Instant, String)>,
}

impl Unreadable {
    /// `rel` could not be read at `now`: when it is read again (None: never, `first` is 0 or
    /// it is already waiting).
    pub fn refused(&mut self, rel: &str, now: Instant, first: Duration) -> Option<Duration> {
        if first.is_zero() || self.due.iter().any(|(_, r)| r == rel) {
            return None;
        }
        self.refused
            .retain(|_, (_, last)| now.duration_since(*last) < 2 * MAX_WAIT);
        let (n, last) = self.refused.entry(rel.to_string()).or_insert((0, now));
        *n += 1;
        *last = now;
        let wait = first
            .saturating_mul(1 << (*n - 1).min(16))
            .min(MAX_WAIT.max(first));
        self.due.push((now + wait, rel.to_string()));
        Some(wait)
    }

    /// When the next retry is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.due.iter().map(|(t, _)| *t).min()
    }

    /// Whether `rel` waits for a retry; if so, it is taken off the list (to be read now).
    pub fn take(&mut self, rel: &str) -> bool {
        let before = self.due.len();
        self.due.retain(|(_, r)| r != rel);
        self.due.len() < before
    }

    /// The paths whose retry is due at `now`, taken off the list.
    pub fn take_due(&mut self, now: Instant) -> Vec<String> {
        let (due, later): (Vec<_>, Vec<_>) = self.due.drain(..).partition(|(t, _)| *t <= now);
        self.due = later;
        due.into_iter().map(|(_, rel)| rel).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn each_refusal_in_a_row_waits_twice_as_long_up_to_an_hour() {
        let mut u = Unreadable::default();
        let t0 = Instant::now();
        let mut now = t0;
        let mut waits = Vec::new();
        for _ in 0..10 {
            let wait = u.refused("LEAK/a.wav", now, 30 * S).unwrap();
            waits.push(wait.as_secs());
            assert_eq!(u.next_due(), Some(now + wait));
            assert!(
                u.take_due(now + wait - S).is_empty(),
                "not before it is due"
            );
            now += wait;
            assert_eq!(u.take_due(now), vec!["LEAK/a.wav".to_string()]);
            assert_eq!(u.next_due(), None);
        }
        assert_eq!(
            waits,
            vec![30, 60, 120, 240, 480, 960, 1920, 3600, 3600, 3600]
        );
    }

    #[test]
    fn a_path_waits_once_and_others_keep_their_own_count() {
        let mut u = Unreadable::default();
        let now = Instant::now();
        assert_eq!(u.refused("a", now, 30 * S), Some(30 * S));
        assert_eq!(u.refused("a", now + S, 30 * S), None, "already waiting");
        assert_eq!(u.refused("b", now + S, 30 * S), Some(30 * S));
        assert_eq!(u.next_due(), Some(now + 30 * S));
        assert_eq!(u.take_due(now + 30 * S), vec!["a".to_string()]);
        assert_eq!(u.take_due(now + 31 * S), vec!["b".to_string()]);
        // Refused again: the second wait for each.
        assert_eq!(u.refused("a", now + 40 * S, 30 * S), Some(60 * S));
    }

    #[test]
    fn two_hours_without_a_refusal_start_the_count_again() {
        let mut u = Unreadable::default();
        let now = Instant::now();
        u.refused("a", now, 30 * S);
        u.take_due(now + 30 * S);
        assert_eq!(u.refused("a", now + 60 * S, 30 * S), Some(60 * S));
        u.take_due(now + 120 * S);
        let later = now + 60 * S + 2 * MAX_WAIT;
        assert_eq!(u.refused("a", later, 30 * S), Some(30 * S));
    }

    #[test]
    fn a_path_taken_early_keeps_its_count() {
        let mut u = Unreadable::default();
        let now = Instant::now();
        u.refused("a", now, 30 * S);
        assert!(!u.take("b"));
        assert!(u.take("a"));
        assert!(!u.take("a"), "taken once");
        assert_eq!(u.next_due(), None);
        assert_eq!(u.refused("a", now + S, 30 * S), Some(60 * S));
    }

    #[test]
    fn a_zero_first_wait_turns_retries_off() {
        let mut u = Unreadable::default();
        assert_eq!(u.refused("a", Instant::now(), Duration::ZERO), None);
        assert_eq!(u.next_due(), None);
    }
}
