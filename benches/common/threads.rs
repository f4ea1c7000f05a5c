//! CPU time per thread of this process, sampled from `/proc/self/task/<tid>/schedstat` (time
//! on a CPU and time runnable but waiting for one, in nanoseconds), so that a benchmark can say
//! what each stage's threads cost in CPU, apart from the time they spent waiting: the stage
//! timers of `rebuild` are wall time on threads that share the cores, and include both.
//!
//! Threads are grouped by name without a trailing `-<number>` (`ailhd-load-0` and
//! `ailhd-load-1` are `ailhd-load`). A thread that ends between two samples loses what it ran
//! after the last one (at most one sampling interval each).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The sampler's own thread name (left out of every figure).
const NAME: &str = "bench-sampler";

/// One thread at one instant: (name, ns on a CPU, ns runnable and waiting for a CPU).
type Seen = (String, u64, u64);

struct Sample {
    /// Seconds since the sampler started.
    at: f64,
    threads: HashMap<i32, Seen>,
}

/// Samples every thread of the process until [`Sampler::stop`].
pub struct Sampler {
    t0: Instant,
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<Vec<Sample>>,
}

/// A group of threads between two instants.
#[derive(Debug, Clone)]
pub struct Group {
    pub name: String,
    pub threads: usize,
    /// Seconds on a CPU.
    pub cpu: f64,
    /// Seconds runnable but waiting for a CPU (the cores were busy with other threads).
    pub waiting: f64,
}

/// What a [`Sampler`] saw.
pub struct Samples {
    t0: Instant,
    samples: Vec<Sample>,
}

fn group_name(comm: &str) -> String {
    // The kernel keeps 15 bytes of a name: `ailhd-manifest-0` is `ailhd-manifest-`.
    let head = comm.trim_end_matches(|c: char| c.is_ascii_digit());
    match head.strip_suffix('-') {
        Some(h) if !h.is_empty() => h.to_string(),
        _ => comm.to_string(),
    }
}

fn snapshot() -> HashMap<i32, Seen> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(tid) = entry
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<i32>().ok())
        else {
            continue;
        };
        // Read each time: a thread is named a moment after it starts, and a thread id is
        // used again by a later thread.
        let name = if tid as u32 == std::process::id() {
            "main".to_string()
        } else {
            std::fs::read_to_string(entry.path().join("comm"))
                .map(|c| c.trim().to_string())
                .unwrap_or_default()
        };
        if name == NAME {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("schedstat")) else {
            continue;
        };
        let mut fields = stat
            .split_whitespace()
            .map(|f| f.parse::<u64>().unwrap_or(0));
        let (cpu, wait) = (fields.next().unwrap_or(0), fields.next().unwrap_or(0));
        out.insert(tid, (name, cpu, wait));
    }
    out
}

impl Sampler {
    /// Start sampling every `every` (5 ms costs about a tenth of one core with ~40 threads).
    pub fn start(every: Duration) -> Sampler {
        let t0 = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name(NAME.into())
            .spawn(move || {
                let mut samples = Vec::new();
                loop {
                    let threads = snapshot();
                    samples.push(Sample {
                        at: t0.elapsed().as_secs_f64(),
                        threads,
                    });
                    if flag.load(Ordering::Relaxed) {
                        return samples;
                    }
                    std::thread::sleep(every);
                }
            })
            .expect("sampler thread starts");
        Sampler { t0, stop, handle }
    }

    /// Stop (after one last sample) and hand back what was seen.
    pub fn stop(self) -> Samples {
        self.stop.store(true, Ordering::Relaxed);
        Samples {
            t0: self.t0,
            samples: self.handle.join().expect("sampler thread"),
        }
    }
}

impl Samples {
    /// Seconds since the sampler started, of `at`.
    pub fn since_start(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.t0).as_secs_f64()
    }

    /// CPU and waiting of each group of threads between `from` and `to` (seconds since the
    /// sampler started), the nearest samples outside the interval taken as its ends; largest
    /// CPU first.
    pub fn between(&self, from: f64, to: f64) -> Vec<Group> {
        if self.samples.is_empty() {
            return Vec::new();
        }
        let first = self.samples.iter().rposition(|s| s.at <= from).unwrap_or(0);
        let last = self
            .samples
            .iter()
            .position(|s| s.at >= to)
            .unwrap_or(self.samples.len() - 1);
        let base = &self.samples[first].threads;
        // Each thread's latest values up to `last` (a thread that ended keeps its last sample).
        let mut latest: HashMap<i32, &Seen> = HashMap::new();
        for s in &self.samples[first..=last] {
            for (tid, seen) in &s.threads {
                latest.insert(*tid, seen);
            }
        }
        let mut groups: HashMap<String, Group> = HashMap::new();
        for (tid, (name, cpu, wait)) in latest {
            let (cpu0, wait0) = base.get(&tid).map_or((0, 0), |b| (b.1, b.2));
            let g = groups.entry(group_name(name)).or_insert_with(|| Group {
                name: group_name(name),
                threads: 0,
                cpu: 0.0,
                waiting: 0.0,
            });
            g.threads += 1;
            g.cpu += cpu.saturating_sub(cpu0) as f64 * 1e-9;
            g.waiting += wait.saturating_sub(wait0) as f64 * 1e-9;
        }
        let mut v: Vec<Group> = groups.into_values().filter(|g| g.cpu > 0.0).collect();
        v.sort_by(|a, b| b.cpu.total_cmp(&a.cpu));
        v
    }
}
