//! Background work that gives way to recordings being ingested.
//!
//! A periodic rescan compares the whole tree with the manifest: a listing, a pass over the
//! records and a `stat` per file, seconds of work at a few hundred thousand recordings. Its
//! thread already runs only when nothing else wants the CPU, yet on a small host what it does
//! beside the ingest path (memory and cache traffic, the kernel's folder and inode work) still
//! slows a recording committed meanwhile. So its loops call [`give_way`] per item: while the
//! thread's [`Gate`] says recordings are on their way, it sleeps, for at most [`MAX_PAUSE`] at a
//! time, so that it always ends. Threads it starts take its gate along ([`with_this_gate`]).
//!
//! Threads without a gate (`rebuild`), or with a gate that never shuts (the start-up
//! comparison, which recordings that arrived while the service was down wait for), never pause.
//!
//! The work behind a gate can be called off ([`Gate::call_off`]): whoever must wait for it (the
//! service stopping, or recovering from a failed write) would otherwise wait while it gives way
//! to recordings that wait in turn, up to [`MAX_PAUSE`] per item. Called off, [`give_way`] no
//! longer pauses and returns [`CalledOff`], so the work's loops end at their next item.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest a pause lasts: under a steady stream a rescan still moves on.
pub const MAX_PAUSE: Duration = Duration::from_millis(50);

/// The step a paused thread looks at its gate again.
const STEP: Duration = Duration::from_micros(500);

/// Says whether recordings are on their way now, and counts the pauses it caused.
pub struct Gate {
    busy: Box<dyn Fn() -> bool + Send + Sync>,
    paused_us: AtomicU64,
    pauses: AtomicU64,
    off: AtomicBool,
}

/// The work was called off ([`Gate::call_off`]) before it ended: what it found so far has been
/// handed on, the rest was not looked at.
#[derive(Debug, thiserror::Error)]
#[error("called off")]
pub struct CalledOff;

impl Gate {
    pub fn new(busy: impl Fn() -> bool + Send + Sync + 'static) -> Arc<Gate> {
        Arc::new(Gate {
            busy: Box::new(busy),
            paused_us: AtomicU64::new(0),
            pauses: AtomicU64::new(0),
            off: AtomicBool::new(false),
        })
    }

    /// Call off the work behind this gate: it no longer pauses, and ends at its next check.
    pub fn call_off(&self) {
        self.off.store(true, Ordering::Relaxed);
    }

    /// How long in all, and how many times, the threads behind this gate gave way.
    pub fn paused(&self) -> (Duration, u64) {
        (
            Duration::from_micros(self.paused_us.load(Ordering::Relaxed)),
            self.pauses.load(Ordering::Relaxed),
        )
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Arc<Gate>>> = const { RefCell::new(None) };
}

/// From now on, [`give_way`] on this thread pauses while `gate` is shut (None: never).
pub fn install(gate: Option<Arc<Gate>>) {
    CURRENT.with(|c| *c.borrow_mut() = gate);
}

fn current() -> Option<Arc<Gate>> {
    CURRENT.with(|c| c.borrow().clone())
}

/// `f`, to run on a thread this one starts, under this thread's gate.
pub fn with_this_gate<T>(f: impl FnOnce() -> T) -> impl FnOnce() -> T {
    let gate = current();
    move || {
        install(gate);
        f()
    }
}

/// Pause while this thread's gate says recordings are on their way (at most [`MAX_PAUSE`]);
/// [`CalledOff`] once the work is called off (at once, without pausing). Cheap to call per
/// item: without a gate it does nothing, with one it reads a few atomics.
pub fn give_way() -> Result<(), CalledOff> {
    let Some(gate) = current() else {
        return Ok(());
    };
    let off = || gate.off.load(Ordering::Relaxed);
    if !off() && (gate.busy)() {
        let start = Instant::now();
        while !off() && (gate.busy)() && start.elapsed() < MAX_PAUSE {
            std::thread::sleep(STEP);
        }
        let waited = start.elapsed().as_micros() as u64;
        gate.paused_us.fetch_add(waited, Ordering::Relaxed);
        gate.pauses.fetch_add(1, Ordering::Relaxed);
    }
    if off() {
        Err(CalledOff)
    } else {
        Ok(())
    }
}

/// Whether this thread's work was called off ([`Gate::call_off`]); never without a gate. For
/// the checks between the work's phases, where it does not give way.
pub fn called_off() -> bool {
    current().is_some_and(|g| g.off.load(Ordering::Relaxed))
}

/// [`called_off`] as an error, for `?`.
pub fn go_on() -> Result<(), CalledOff> {
    if called_off() {
        Err(CalledOff)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gate_nothing_pauses() {
        let t = Instant::now();
        for _ in 0..1000 {
            assert!(give_way().is_ok());
        }
        assert!(t.elapsed() < MAX_PAUSE);
    }

    /// A thread waits while its gate is shut, and goes on once it opens; a thread it starts
    /// with the gate waits too.
    #[test]
    fn a_shut_gate_holds_until_it_opens() {
        let busy = Arc::new(AtomicBool::new(true));
        let b = busy.clone();
        let gate = Gate::new(move || b.load(Ordering::Relaxed));
        let g = gate.clone();
        let h = std::thread::spawn(move || {
            install(Some(g));
            std::thread::spawn(with_this_gate(give_way))
                .join()
                .unwrap()
                .unwrap();
        });
        std::thread::sleep(Duration::from_millis(10));
        busy.store(false, Ordering::Relaxed);
        h.join().unwrap();
        let (waited, pauses) = gate.paused();
        assert_eq!(pauses, 1);
        assert!(waited >= Duration::from_millis(5), "{waited:?}");
    }

    /// A gate that never opens holds each call for at most MAX_PAUSE: the work ends.
    #[test]
    fn a_gate_that_stays_shut_holds_no_longer_than_max_pause() {
        let gate = Gate::new(|| true);
        let g = gate.clone();
        let took = std::thread::spawn(move || {
            install(Some(g));
            let t = Instant::now();
            give_way().unwrap();
            give_way().unwrap();
            t.elapsed()
        })
        .join()
        .unwrap();
        assert_eq!(gate.paused().1, 2);
        assert!(took >= 2 * MAX_PAUSE, "{took:?}");
        assert!(took < 2 * MAX_PAUSE + Duration::from_secs(1), "{took:?}");
    }

    /// Work that gives way behind a gate that never opens (recordings waiting for whoever waits
    /// for this work) ends soon after it is called off: 1,000 items would take 50 s paused.
    #[test]
    fn called_off_work_stops_pausing_and_sees_it() {
        let gate = Gate::new(|| true);
        let g = gate.clone();
        let h = std::thread::spawn(move || {
            install(Some(g));
            let mut done = 0;
            for _ in 0..1000 {
                if give_way().is_err() {
                    break;
                }
                done += 1;
            }
            (done, go_on().is_err())
        });
        std::thread::sleep(Duration::from_millis(120));
        let t = Instant::now();
        gate.call_off();
        let (done, off) = h.join().unwrap();
        assert!(off, "the thread sees the call-off");
        assert!(done < 1000, "the loop ended early, after {done} items");
        assert!(t.elapsed() < MAX_PAUSE * 20, "{:?}", t.elapsed());
        assert!(!called_off(), "a thread without a gate is never called off");
    }
}
