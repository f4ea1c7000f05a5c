//! Featuriser throughput: prints µs per recording and recordings per second for both setups,
//! on 1 and 2 threads (the target host has 2 cores) and on every core, in batches (the bulk rebuild) and one at a time (the
//! daemon). Run with `cargo bench --bench featurise`; `AILHD_BENCH_SECS` sets the time per figure.

use ailhd::config::FeatureSettings;
use ailhd::decode::Waveform;
use ailhd::features::cpu::CpuFeaturiser;
use ailhd::features::Featuriser;
use half::f16;
use std::time::{Duration, Instant};

/// Deterministic hydrophone-like test clips: a tone over broadband noise, 16-bit.
fn clips(n: usize, num_samples: usize) -> Vec<Waveform> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut noise = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f64 / (1u64 << 24) as f64 - 0.5
    };
    (0..n)
        .map(|c| {
            let f = 50.0 + 37.0 * c as f64;
            Waveform::Pcm16(
                (0..num_samples)
                    .map(|i| {
                        let t = i as f64 / 4096.0;
                        let x = 0.3 * (2.0 * std::f64::consts::PI * f * t).sin() + 0.2 * noise();
                        (x * 32767.0) as i16
                    })
                    .collect(),
            )
        })
        .collect()
}

/// CPU time of the whole process, s: unlike wall time, not inflated by other processes
/// competing for the cores.
fn cpu_time() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Featurise `wavs` in batches of `batch`, in slices of about 0.25 s for `secs` in all:
/// per-slice (wall µs, CPU µs) per recording. Other processes on the host disturb some slices;
/// the best slice is the machine's figure, the median what a busy host gives.
fn measure(f: &mut CpuFeaturiser, wavs: &[Waveform], batch: usize, secs: f64) -> Vec<(f64, f64)> {
    let refs: Vec<&Waveform> = wavs.iter().collect();
    let row_len = f.shape().row_len();
    let mut out = vec![f16::ZERO; batch * row_len];
    // Warm-up: page in buffers, spin up the pool.
    for chunk in refs.chunks(batch) {
        f.featurise(chunk, &mut out[..chunk.len() * row_len])
            .unwrap();
    }
    let mut slices = Vec::new();
    let end = Instant::now() + Duration::from_secs_f64(secs);
    while Instant::now() < end {
        let (start, cpu0, mut done) = (Instant::now(), cpu_time(), 0usize);
        while start.elapsed() < Duration::from_millis(250) {
            for chunk in refs.chunks(batch) {
                f.featurise(chunk, &mut out[..chunk.len() * row_len])
                    .unwrap();
                done += chunk.len();
            }
        }
        let wall = start.elapsed().as_secs_f64() * 1e6 / done as f64;
        slices.push((wall, (cpu_time() - cpu0) * 1e6 / done as f64));
    }
    std::hint::black_box(&out);
    slices.sort_by(|a, b| a.0.total_cmp(&b.0));
    slices
}

fn main() {
    let secs: f64 = std::env::var("AILHD_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("CPU featuriser, {cores} cores available, {secs} s per figure");
    for (name, settings) in [
        ("default", FeatureSettings::default()),
        ("overlap32", FeatureSettings::overlap32()),
    ] {
        let shape = settings.shape();
        let wavs = clips(256, shape.num_samples);
        println!(
            "{name}: rows {:?}, {} FFTs of {} per recording",
            shape.row_dims(),
            shape.num_windows() * shape.t_frames,
            settings.n_fft
        );
        let mut runs = vec![(1, 256), (1, 1), (2, 256)];
        if cores > 2 {
            runs.push((cores, 256));
        }
        for (threads, batch) in runs {
            let mut f = CpuFeaturiser::new(&settings, threads).unwrap();
            let slices = measure(&mut f, &wavs, batch, secs);
            let (best, median) = (slices[0], slices[slices.len() / 2]);
            println!(
                "  {threads} thread(s), batches of {batch:3}: best {:6.2} µs/recording wall \
                 ({:6.2} CPU-µs), {:6.0} recordings/s; median {:6.2} µs, {:6.0}/s",
                best.0,
                best.1,
                1e6 / best.0,
                median.0,
                1e6 / median.0
            );
        }
    }
}
