//! CPU featuriser: float32 real FFTs, a sparse mel filterbank and a vectorised logarithm, one
//! recording per task on a dedicated rayon pool. This is the bulk-rebuild hot path: nothing here
//! allocates once the featuriser is built.
//!
//! The FFT is our own and "lane-parallel": [`LANES`] STFT frames go through one radix-4 FFT
//! together, frame `l` in SIMD lane `l`, so every butterfly is a full-width vector operation
//! without shuffles, and the spectrum comes out bin-major (`[bin][lane]`), the layout in which
//! the filterbank is one vector multiply-add per weight. (With realfft, one frame at a time, its
//! scalar real-to-complex post-processing and our transposition cost more than the FFT itself.)
//! realfft remains for FFT sizes that are not a power of two.

use super::mel::{self, SparseMel};
use super::Featuriser;
use crate::config::{FeatureSettings, FeatureShape};
use crate::decode::Waveform;
use anyhow::Context;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use realfft::num_complex::Complex;
use realfft::{RealFftPlanner, RealToComplex};
use std::sync::{Arc, Mutex};

/// Frames processed together, one per SIMD lane: 8 f32 fill an AVX register.
const LANES: usize = 8;
type Lanes = [f32; LANES];

/// One complex value per lane. 64 bytes, aligned: one FFT point is one cache line.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct C {
    re: Lanes,
    im: Lanes,
}

/// One real value per lane, aligned for whole-register loads.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
struct Bin(Lanes);

/// The lane-wise operations the kernels use, with two implementations: [`Portable`] (plain
/// arrays, any CPU) and `Avx` (256-bit registers). Kernels are generic over it and
/// `inline(always)`, so each is compiled once per implementation. Both perform the same IEEE
/// operations in the same order (Rust never fuses a * b + c), so they give the same bits.
trait Vector: Copy {
    fn splat(x: f32) -> Self;
    fn load(a: &Lanes) -> Self;
    fn store(self, a: &mut Lanes);
    /// Eight int16 samples, as f32.
    fn from_i16(a: &[i16]) -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn sqrt(self) -> Self;
    /// Row i, lane l -> row l, lane i.
    fn transpose(rows: [Self; 8]) -> [Self; 8];
}

/// Plain arrays: the reference implementation, and the build for CPUs without AVX2.
#[derive(Clone, Copy)]
struct Portable(Lanes);

impl Portable {
    #[inline(always)]
    fn map(self, o: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        let mut r = self.0;
        for (x, y) in r.iter_mut().zip(o.0) {
            *x = f(*x, y);
        }
        Portable(r)
    }
}

impl Vector for Portable {
    #[inline(always)]
    fn splat(x: f32) -> Self {
        Portable([x; LANES])
    }
    #[inline(always)]
    fn load(a: &Lanes) -> Self {
        Portable(*a)
    }
    #[inline(always)]
    fn store(self, a: &mut Lanes) {
        *a = self.0;
    }
    #[inline(always)]
    fn from_i16(a: &[i16]) -> Self {
        let mut r = [0.0; LANES];
        for (x, &q) in r.iter_mut().zip(&a[..LANES]) {
            *x = q as f32;
        }
        Portable(r)
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        self.map(o, |a, b| a + b)
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        self.map(o, |a, b| a - b)
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        self.map(o, |a, b| a * b)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        self.map(self, |a, _| a.sqrt())
    }
    #[inline(always)]
    fn transpose(rows: [Self; 8]) -> [Self; 8] {
        let mut cols = [Portable([0.0; LANES]); 8];
        for (i, col) in cols.iter_mut().enumerate() {
            for (l, x) in col.0.iter_mut().enumerate() {
                *x = rows[l].0[i];
            }
        }
        cols
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    //! SAFETY (for every `unsafe` block here): `Avx` values are only made inside
    //! `Plan::db_row_avx2`, which runs only on CPUs that have AVX2.
    use super::{Lanes, Vector};
    use std::arch::x86_64::*;

    #[derive(Clone, Copy)]
    pub(super) struct Avx(__m256);

    impl Vector for Avx {
        #[inline(always)]
        fn splat(x: f32) -> Self {
            unsafe { Avx(_mm256_set1_ps(x)) }
        }
        #[inline(always)]
        fn load(a: &Lanes) -> Self {
            unsafe { Avx(_mm256_loadu_ps(a.as_ptr())) }
        }
        #[inline(always)]
        fn store(self, a: &mut Lanes) {
            unsafe { _mm256_storeu_ps(a.as_mut_ptr(), self.0) }
        }
        #[inline(always)]
        fn from_i16(a: &[i16]) -> Self {
            let a = &a[..8];
            unsafe {
                let q = _mm_loadu_si128(a.as_ptr().cast());
                Avx(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(q)))
            }
        }
        #[inline(always)]
        fn add(self, o: Self) -> Self {
            unsafe { Avx(_mm256_add_ps(self.0, o.0)) }
        }
        #[inline(always)]
        fn sub(self, o: Self) -> Self {
            unsafe { Avx(_mm256_sub_ps(self.0, o.0)) }
        }
        #[inline(always)]
        fn mul(self, o: Self) -> Self {
            unsafe { Avx(_mm256_mul_ps(self.0, o.0)) }
        }
        #[inline(always)]
        fn sqrt(self) -> Self {
            unsafe { Avx(_mm256_sqrt_ps(self.0)) }
        }
        /// The classic unpack / shuffle / permute transpose: 24 shuffles.
        #[inline(always)]
        fn transpose(r: [Self; 8]) -> [Self; 8] {
            unsafe {
                let t0 = _mm256_unpacklo_ps(r[0].0, r[1].0);
                let t1 = _mm256_unpackhi_ps(r[0].0, r[1].0);
                let t2 = _mm256_unpacklo_ps(r[2].0, r[3].0);
                let t3 = _mm256_unpackhi_ps(r[2].0, r[3].0);
                let t4 = _mm256_unpacklo_ps(r[4].0, r[5].0);
                let t5 = _mm256_unpackhi_ps(r[4].0, r[5].0);
                let t6 = _mm256_unpacklo_ps(r[6].0, r[7].0);
                let t7 = _mm256_unpackhi_ps(r[6].0, r[7].0);
                let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                [
                    Avx(_mm256_permute2f128_ps::<0x20>(s0, s4)),
                    Avx(_mm256_permute2f128_ps::<0x20>(s1, s5)),
                    Avx(_mm256_permute2f128_ps::<0x20>(s2, s6)),
                    Avx(_mm256_permute2f128_ps::<0x20>(s3, s7)),
                    Avx(_mm256_permute2f128_ps::<0x31>(s0, s4)),
                    Avx(_mm256_permute2f128_ps::<0x31>(s1, s5)),
                    Avx(_mm256_permute2f128_ps::<0x31>(s2, s6)),
                    Avx(_mm256_permute2f128_ps::<0x31>(s3, s7)),
                ]
            }
        }
    }
}

/// A complex value per lane, in registers.
#[derive(Clone, Copy)]
struct Cv<V> {
    re: V,
    im: V,
}

impl<V: Vector> Cv<V> {
    #[inline(always)]
    fn load(c: &C) -> Self {
        Cv {
            re: V::load(&c.re),
            im: V::load(&c.im),
        }
    }
    #[inline(always)]
    fn store(self, c: &mut C) {
        self.re.store(&mut c.re);
        self.im.store(&mut c.im);
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        Cv {
            re: self.re.add(o.re),
            im: self.im.add(o.im),
        }
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        Cv {
            re: self.re.sub(o.re),
            im: self.im.sub(o.im),
        }
    }
    /// self - j o.
    #[inline(always)]
    fn sub_j(self, o: Self) -> Self {
        Cv {
            re: self.re.add(o.im),
            im: self.im.sub(o.re),
        }
    }
    /// self + j o.
    #[inline(always)]
    fn add_j(self, o: Self) -> Self {
        Cv {
            re: self.re.sub(o.im),
            im: self.im.add(o.re),
        }
    }
    /// self * w, w the same for every lane.
    #[inline(always)]
    fn mul_w(self, w: &(V, V)) -> Self {
        Cv {
            re: self.re.mul(w.0).sub(self.im.mul(w.1)),
            im: self.re.mul(w.1).add(self.im.mul(w.0)),
        }
    }
    /// |self|^2.
    #[inline(always)]
    fn norm_sqr(self) -> V {
        self.re.mul(self.re).add(self.im.mul(self.im))
    }
}

/// exp(-2 pi i k / n), computed in f64 and rounded once.
fn twiddle(k: usize, n: usize) -> (f32, f32) {
    let a = -2.0 * std::f64::consts::PI * k as f64 / n as f64;
    (a.cos() as f32, a.sin() as f32)
}

/// One in-place decimation-in-frequency pass: every block of `span` points is split into 4 (or,
/// for span 2, 2) interleaved sub-transforms of span / 4 points.
struct Pass {
    span: usize,
    /// (w^p, w^2p, w^3p) for p in 0..span/4, w = exp(-2 pi i / span).
    twiddles: Vec<[(f32, f32); 3]>,
}

/// Real FFT of a power-of-two length `n` >= 16 for [`LANES`] frames at once: the n real samples
/// are packed as n/2 complex ones (even + j odd), transformed in place, and untangled into the
/// n/2 + 1 bins of the real spectrum (realfft's algorithm, vectorised across frames).
struct LaneFft {
    n: usize,
    passes: Vec<Pass>,
    /// Where frequency k lands: in-place DIF leaves the output in digit-reversed order, which
    /// the untangling step reads through this table instead of reordering.
    position: Vec<usize>,
    /// 0.5 * exp(-2 pi i k / n) for k in 0..=n/4: the untangling twiddles (the 0.5 is exact).
    untangle_twiddles: Vec<(f32, f32)>,
}

impl LaneFft {
    fn supports(n: usize) -> bool {
        n.is_power_of_two() && n >= 16
    }

    fn new(n: usize) -> LaneFft {
        let m = n / 2;
        let mut passes = Vec::new();
        let mut span = m;
        while span >= 4 {
            let twiddles = (0..span / 4)
                .map(|p| [twiddle(p, span), twiddle(2 * p, span), twiddle(3 * p, span)])
                .collect();
            passes.push(Pass { span, twiddles });
            span /= 4;
        }
        if span == 2 {
            passes.push(Pass {
                span: 2,
                twiddles: Vec::new(),
            });
        }
        // Output position p = sum of d_s * (m / (r_1 ... r_s)) holds frequency
        // k = d_1 + r_1 d_2 + r_1 r_2 d_3 + ..., d_s the digit of pass s (radix r_s).
        let mut position = vec![0; m];
        for pos in 0..m {
            let (mut rest, mut block, mut k, mut weight) = (pos, m, 0, 1);
            for pass in &passes {
                let radix = pass.span.min(4);
                block /= radix;
                k += weight * (rest / block);
                rest %= block;
                weight *= radix;
            }
            position[k] = pos;
        }
        let untangle_twiddles = (0..=m / 2)
            .map(|k| {
                let (c, s) = twiddle(k, n);
                (0.5 * c, 0.5 * s)
            })
            .collect();
        LaneFft {
            n,
            passes,
            position,
            untangle_twiddles,
        }
    }

    /// In-place complex FFT of the n/2 points in `z`, output in digit-reversed order.
    #[inline(always)]
    fn transform<V: Vector>(&self, z: &mut [C]) {
        for pass in &self.passes {
            if pass.span == 2 {
                for pair in z.chunks_exact_mut(2) {
                    let (a, b) = (Cv::<V>::load(&pair[0]), Cv::<V>::load(&pair[1]));
                    a.add(b).store(&mut pair[0]);
                    a.sub(b).store(&mut pair[1]);
                }
                continue;
            }
            let quarter = pass.span / 4;
            for block in z.chunks_exact_mut(pass.span) {
                let (x0, rest) = block.split_at_mut(quarter);
                let (x1, rest) = rest.split_at_mut(quarter);
                let (x2, x3) = rest.split_at_mut(quarter);
                let points = x0.iter_mut().zip(x1).zip(x2).zip(x3);
                for (p, (((x0, x1), x2), x3)) in points.enumerate() {
                    let (a, b) = (Cv::<V>::load(x0), Cv::<V>::load(x1));
                    let (c, d) = (Cv::<V>::load(x2), Cv::<V>::load(x3));
                    let (apc, amc) = (a.add(c), a.sub(c));
                    let (bpd, bmd) = (b.add(d), b.sub(d));
                    let (y0, y1) = (apc.add(bpd), amc.sub_j(bmd));
                    let (y2, y3) = (apc.sub(bpd), amc.add_j(bmd));
                    y0.store(x0);
                    if p == 0 {
                        // w^0 = 1 (always so in the last pass, where quarter = 1).
                        y1.store(x1);
                        y2.store(x2);
                        y3.store(x3);
                    } else {
                        let w = pass.twiddles[p].map(|(c, s)| (V::splat(c), V::splat(s)));
                        y1.mul_w(&w[0]).store(x1);
                        y2.mul_w(&w[1]).store(x2);
                        y3.mul_w(&w[2]).store(x3);
                    }
                }
            }
        }
    }

    /// Z (the transform of the packed even + j odd samples) -> `finish(|X_k|^2)` for k in
    /// 0..=n/2, where X_k = (Z_k + conj Z_{m-k}) / 2 - j w^k (Z_k - conj Z_{m-k}) / 2,
    /// w = exp(-2 pi i / n). Bins k and m - k share their inputs, so they are made together.
    #[inline(always)]
    fn untangle<V: Vector>(&self, z: &[C], out: &mut [Bin], finish: impl Fn(V) -> V) {
        let m = self.n / 2;
        let z0 = Cv::<V>::load(&z[0]);
        let (first, last) = (z0.re.add(z0.im), z0.re.sub(z0.im));
        finish(first.mul(first)).store(&mut out[0].0);
        finish(last.mul(last)).store(&mut out[m].0);
        let half = V::splat(0.5);
        for k in 1..=m / 2 {
            let a = Cv::<V>::load(&z[self.position[k]]);
            let b = Cv::<V>::load(&z[self.position[m - k]]);
            let (hr, hi) = self.untangle_twiddles[k];
            let (hr, hi) = (V::splat(hr), V::splat(hi));
            // S = A + conj B, D = A - conj B; X_k = S/2 + T with T = -j h D, and, because
            // w^(m-k) = -conj w^k, X_{m-k} = conj(S)/2 - conj T.
            let half_s = Cv {
                re: half.mul(a.re.add(b.re)),
                im: half.mul(a.im.sub(b.im)),
            };
            let (dr, di) = (a.re.sub(b.re), a.im.add(b.im));
            let t = Cv {
                re: hr.mul(di).add(hi.mul(dr)),
                im: hi.mul(di).sub(hr.mul(dr)),
            };
            let x = Cv {
                re: half_s.re.add(t.re),
                im: half_s.im.add(t.im),
            };
            let y = Cv {
                re: half_s.re.sub(t.re),
                im: t.im.sub(half_s.im),
            };
            finish(x.norm_sqr()).store(&mut out[k].0);
            finish(y.norm_sqr()).store(&mut out[m - k].0);
        }
    }
}

/// Windowed frames -> the FFT's packed input: point m of lane l is
/// `x_l[2m] w[2m] + j x_l[2m+1] w[2m+1]`, `x_l` the frame at `offsets[l]`. Works in 8x8 blocks
/// (8 samples of each of the 8 frames), transposed in registers.
#[inline(always)]
fn pack<V: Vector, T>(
    samples: &[T],
    offsets: &[usize; LANES],
    window: &[f32],
    z: &mut [C],
    load8: impl Fn(&[T]) -> V,
) {
    let n = window.len();
    let frames: [&[T]; LANES] = std::array::from_fn(|l| &samples[offsets[l]..offsets[l] + n]);
    for (blk, (w, out)) in window
        .chunks_exact(8)
        .zip(z.chunks_exact_mut(4))
        .enumerate()
    {
        let w = V::load(w.try_into().expect("chunks of 8"));
        let rows: [V; 8] = std::array::from_fn(|l| load8(&frames[l][blk * 8..]).mul(w));
        let cols = V::transpose(rows);
        for (i, point) in out.iter_mut().enumerate() {
            cols[2 * i].store(&mut point.re);
            cols[2 * i + 1].store(&mut point.im);
        }
    }
}

/// How a spectrum is computed.
enum Engine {
    Lanes(LaneFft),
    /// Other lengths: realfft, one frame at a time.
    RealFft(Arc<dyn RealToComplex<f32>>),
}

/// How |X|^2 becomes a spectrogram value (torchaudio: `abs().pow(power)`).
#[derive(Debug, Clone, Copy)]
enum Power {
    /// power = 1: |X|.
    Magnitude,
    /// power = 2: |X|^2 as it is.
    Energy,
    /// Anything else: (|X|^2)^(p/2).
    Other(f32),
}

/// Everything that does not change between recordings, shared read-only by the pool's threads.
struct Plan {
    settings: FeatureSettings,
    shape: FeatureShape,
    engine: Engine,
    /// Periodic Hann window, and the same divided by 32768 so that int16 samples are scaled and
    /// windowed in one multiply (the same bits: a power-of-two scale is exact).
    window: Vec<f32>,
    window_pcm16: Vec<f32>,
    /// Per STFT frame, in row order: where it starts in the waveform, and where its mel 0 goes in
    /// the row (mel j at `+ j * t_frames`).
    frames: Vec<(usize, usize)>,
    mel: SparseMel,
    power: Power,
    /// Run the AVX2 build of the same code (checked once, here).
    avx2: bool,
}

/// Per-thread working memory, sized once.
struct Scratch {
    /// The lane FFT's points (n_fft / 2).
    z: Vec<C>,
    /// realfft engine: one frame, its spectrum, realfft's scratch.
    frame: Vec<f32>,
    spectrum: Vec<Complex<f32>>,
    fft_scratch: Vec<Complex<f32>>,
    /// Spectrogram values of the frames in flight, `[n_freqs]` bins of [`LANES`] frames.
    spec: Vec<Bin>,
    /// Their mel values, `[n_mels]`.
    mels: Vec<Bin>,
    /// One recording's mel values (then dB), f32, in row order.
    row: Vec<f32>,
}

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
}

impl Plan {
    fn new(settings: &FeatureSettings) -> anyhow::Result<Plan> {
        let shape = settings.shape();
        let n_fft = settings.n_fft;
        let engine = if LaneFft::supports(n_fft) {
            Engine::Lanes(LaneFft::new(n_fft))
        } else {
            Engine::RealFft(RealFftPlanner::<f32>::new().plan_fft_forward(n_fft))
        };
        let hann = mel::hann_periodic(n_fft);
        let window = hann.iter().map(|&w| w as f32).collect();
        let window_pcm16 = hann.iter().map(|&w| (w / 32768.0) as f32).collect();
        let mut frames = Vec::with_capacity(shape.num_windows() * shape.t_frames);
        for l in 0..shape.num_long {
            for s in 0..shape.num_short {
                let block = (l * shape.num_short + s) * shape.n_mels * shape.t_frames;
                for t in 0..shape.t_frames {
                    let offset =
                        l * settings.long_hop + s * settings.short_hop + t * settings.hop_length;
                    frames.push((offset, block + t));
                }
            }
        }
        let end = frames.last().map_or(0, |f| f.0 + n_fft);
        anyhow::ensure!(
            end <= shape.num_samples,
            "feature settings cut past the end of the clip ({end} > {} samples)",
            shape.num_samples
        );
        let power = if settings.power == 1.0 {
            Power::Magnitude
        } else if settings.power == 2.0 {
            Power::Energy
        } else {
            Power::Other((settings.power / 2.0) as f32)
        };
        Ok(Plan {
            settings: settings.clone(),
            shape,
            engine,
            window,
            window_pcm16,
            frames,
            mel: SparseMel::new(settings),
            power,
            avx2: avx2_available(),
        })
    }

    fn scratch(&self) -> Scratch {
        let (z, frame, spectrum, fft_scratch) = match &self.engine {
            Engine::Lanes(fft) => (
                vec![C::default(); fft.n / 2],
                Vec::new(),
                Vec::new(),
                Vec::new(),
            ),
            Engine::RealFft(fft) => (
                Vec::new(),
                fft.make_input_vec(),
                fft.make_output_vec(),
                fft.make_scratch_vec(),
            ),
        };
        Scratch {
            z,
            frame,
            spectrum,
            fft_scratch,
            spec: vec![Bin::default(); self.mel.n_freqs],
            mels: vec![Bin::default(); self.mel.filters.len()],
            row: vec![0.0; self.shape.row_len()],
        }
    }

    fn featurise_one(&self, wav: &Waveform, s: &mut Scratch, out: &mut [f16]) {
        self.db_row(wav, s);
        out.convert_from_f32_slice(&s.row);
    }

    /// One recording's dB values, f32, into `s.row`. Deterministic: a value's arithmetic depends
    /// only on its own frame (lanes never mix), never on the batch, the thread or the build.
    fn db_row(&self, wav: &Waveform, s: &mut Scratch) {
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: `avx2` is only set when the CPU has AVX2 (`avx2_available`).
            return unsafe { self.db_row_avx2(wav, s) };
        }
        self.db_row_with::<Portable>(wav, s)
    }

    /// The same code as the portable build, with 256-bit vectors.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn db_row_avx2(&self, wav: &Waveform, s: &mut Scratch) {
        self.db_row_with::<avx::Avx>(wav, s)
    }

    #[inline(always)]
    fn db_row_with<V: Vector>(&self, wav: &Waveform, s: &mut Scratch) {
        let t_frames = self.shape.t_frames;
        for group in self.frames.chunks(LANES) {
            // Lanes past the last frame redo the group's first frame; their results are dropped.
            let offsets: [usize; LANES] =
                std::array::from_fn(|l| group.get(l).unwrap_or(&group[0]).0);
            self.spectrogram::<V>(wav, &offsets, s);
            for (filter, out) in self.mel.filters.iter().zip(s.mels.iter_mut()) {
                let mut acc = V::splat(0.0);
                for (&w, bin) in filter.weights.iter().zip(&s.spec[filter.start..]) {
                    acc = acc.add(V::splat(w).mul(V::load(&bin.0)));
                }
                acc.store(&mut out.0);
            }
            for (lane, &(_, base)) in group.iter().enumerate() {
                for (j, m) in s.mels.iter().enumerate() {
                    s.row[base + j * t_frames] = m.0[lane];
                }
            }
        }
        mel::to_db_in_place(&mut s.row, &self.settings);
    }

    /// The spectrogram values (|X|^power) of the frames at `offsets`, into `s.spec`.
    #[inline(always)]
    fn spectrogram<V: Vector>(&self, wav: &Waveform, offsets: &[usize; LANES], s: &mut Scratch) {
        match &self.engine {
            Engine::Lanes(fft) => {
                match wav {
                    Waveform::Pcm16(v) => {
                        pack(v, offsets, &self.window_pcm16, &mut s.z, V::from_i16)
                    }
                    Waveform::Float(v) => pack(v, offsets, &self.window, &mut s.z, |x| {
                        V::load(x[..LANES].try_into().expect("8 samples"))
                    }),
                }
                fft.transform::<V>(&mut s.z);
                match self.power {
                    Power::Magnitude => fft.untangle::<V>(&s.z, &mut s.spec, V::sqrt),
                    Power::Energy => fft.untangle::<V>(&s.z, &mut s.spec, |p| p),
                    Power::Other(e) => fft.untangle::<V>(&s.z, &mut s.spec, |p| {
                        let mut a = [0.0; LANES];
                        p.store(&mut a);
                        V::load(&a.map(|x| x.powf(e)))
                    }),
                }
            }
            Engine::RealFft(fft) => {
                for (lane, &offset) in offsets.iter().enumerate() {
                    let (buf, n) = (&mut s.frame, self.settings.n_fft);
                    match wav {
                        Waveform::Pcm16(v) => {
                            let src = &v[offset..offset + n];
                            for ((x, &w), &q) in buf.iter_mut().zip(&self.window_pcm16).zip(src) {
                                *x = q as f32 * w;
                            }
                        }
                        Waveform::Float(v) => {
                            let src = &v[offset..offset + n];
                            for ((x, &w), &q) in buf.iter_mut().zip(&self.window).zip(src) {
                                *x = q * w;
                            }
                        }
                    }
                    fft.process_with_scratch(&mut s.frame, &mut s.spectrum, &mut s.fft_scratch)
                        .expect("FFT buffers are made by the plan itself");
                    for (dst, c) in s.spec.iter_mut().zip(&s.spectrum) {
                        let p = c.re * c.re + c.im * c.im;
                        dst.0[lane] = match self.power {
                            Power::Magnitude => p.sqrt(),
                            Power::Energy => p,
                            Power::Other(e) => p.powf(e),
                        };
                    }
                }
            }
        }
    }
}

fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
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
        Ok(CpuFeaturiser {
            local: plan.scratch(),
            plan,
            pool,
            scratch,
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

    fn featurise(&mut self, batch: &[&Waveform], out: &mut [f16]) -> anyhow::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DbMode, MelNorm, MelScale};

    /// xorshift64*: reproducible test signals without a dependency.
    struct Rng(u64);
    impl Rng {
        fn uniform(&mut self) -> f64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
        }
        fn normal(&mut self) -> f64 {
            let (u, v) = (self.uniform().max(1e-300), self.uniform());
            (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
        }
    }

    /// The feature definition written out plainly in f64: a naive DFT per frame, the dense
    /// filterbank, f64 logarithms. Slow and obviously right; the fast path is held against it.
    fn reference(wav: &Waveform, settings: &FeatureSettings) -> Vec<f64> {
        let shape = settings.shape();
        let n = settings.n_fft;
        let n_freqs = n / 2 + 1;
        let hann = mel::hann_periodic(n);
        let fb = mel::mel_filterbank(
            n_freqs,
            settings.f_min,
            settings.f_max_hz(),
            settings.n_mels,
            settings.sample_rate,
            settings.mel_norm,
            settings.mel_scale,
        );
        let (cos, sin): (Vec<f64>, Vec<f64>) = (0..n)
            .map(|i| {
                let a = 2.0 * std::f64::consts::PI * i as f64 / n as f64;
                (a.cos(), a.sin())
            })
            .unzip();
        let sample = |i: usize| match wav {
            Waveform::Pcm16(v) => v[i] as f64 / 32768.0,
            Waveform::Float(v) => v[i] as f64,
        };
        let m = mel::db_multiplier(settings);
        let mut row = vec![0.0; shape.row_len()];
        for l in 0..shape.num_long {
            for s in 0..shape.num_short {
                for t in 0..shape.t_frames {
                    let off =
                        l * settings.long_hop + s * settings.short_hop + t * settings.hop_length;
                    let x: Vec<f64> = (0..n).map(|i| sample(off + i) * hann[i]).collect();
                    let spec: Vec<f64> = (0..n_freqs)
                        .map(|k| {
                            let (mut re, mut im) = (0.0, 0.0);
                            for (i, &xi) in x.iter().enumerate() {
                                re += xi * cos[(k * i) % n];
                                im -= xi * sin[(k * i) % n];
                            }
                            (re * re + im * im).sqrt().powf(settings.power)
                        })
                        .collect();
                    for (j, w) in fb.iter().enumerate() {
                        let v: f64 = w.iter().zip(&spec).map(|(a, b)| a * b).sum();
                        let idx =
                            ((l * shape.num_short + s) * shape.n_mels + j) * shape.t_frames + t;
                        row[idx] = m * v.max(1e-10).log10();
                    }
                }
            }
        }
        if let (DbMode::AmplitudeToDb, Some(top)) = (settings.db, settings.top_db) {
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            row.iter_mut().for_each(|v| *v = v.max(max - top));
        }
        row
    }

    fn run(settings: &FeatureSettings, wav: &Waveform) -> Vec<f16> {
        let mut f = CpuFeaturiser::new(settings, 1).unwrap();
        let mut out = vec![f16::ZERO; f.shape().row_len()];
        f.featurise(&[wav], &mut out).unwrap();
        out
    }

    /// Test signals with the features that stress float32: white noise at full scale; a loud
    /// tone over noise 100 dB down; a band-limited float signal whose spectrum falls off steeply
    /// (no quantisation noise to hide the FFT's rounding); one loud stretch in quiet.
    fn signals(num_samples: usize) -> Vec<(&'static str, Waveform)> {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let tau = 2.0 * std::f64::consts::PI;
        let noise: Vec<i16> = (0..num_samples)
            .map(|_| (rng.normal() * 8000.0).clamp(-32768.0, 32767.0) as i16)
            .collect();
        let tone: Vec<f32> = (0..num_samples)
            .map(|i| (0.9 * (tau * 440.3 * i as f64 / 4096.0).sin() + 1e-5 * rng.normal()) as f32)
            .collect();
        let band: Vec<f32> = {
            let parts: Vec<(f64, f64)> = (0..40)
                .map(|_| (20.0 + 900.0 * rng.uniform(), tau * rng.uniform()))
                .collect();
            (0..num_samples)
                .map(|i| {
                    let t = i as f64 / 4096.0;
                    (parts
                        .iter()
                        .map(|(f, ph)| (tau * f * t + ph).sin())
                        .sum::<f64>()
                        / 40.0) as f32
                })
                .collect()
        };
        let burst: Vec<i16> = (0..num_samples)
            .map(|i| {
                let a = if (8192..9216).contains(&i) {
                    30000.0
                } else {
                    3.0
                };
                (rng.normal() * a).clamp(-32768.0, 32767.0) as i16
            })
            .collect();
        vec![
            ("noise", Waveform::Pcm16(noise)),
            ("tone", Waveform::Float(tone)),
            ("band", Waveform::Float(band)),
            ("burst", Waveform::Pcm16(burst)),
            ("silence", Waveform::Pcm16(vec![0; num_samples])),
        ]
    }

    fn assert_meets_rule(settings: &FeatureSettings, what: &str) {
        for (name, wav) in signals(settings.shape().num_samples) {
            let exact = reference(&wav, settings);
            let acc = mel::check_accuracy(&exact, &run(settings, &wav));
            eprintln!("{what} {name}: {acc:?}");
            assert_eq!(acc.violations, 0, "{what} {name}: {acc:?}");
        }
    }

    #[test]
    fn default_setup_matches_the_f64_reference() {
        assert_meets_rule(&FeatureSettings::default(), "default");
    }

    #[test]
    fn overlap32_setup_matches_the_f64_reference() {
        assert_meets_rule(&FeatureSettings::overlap32(), "overlap32");
    }

    /// Several STFT frames per short window (t_frames > 1), the other scale and norm, a
    /// non-power-of-two FFT (realfft engine), an unusual power and a band-limited filterbank.
    #[test]
    fn other_settings_match_the_f64_reference() {
        let base = FeatureSettings {
            duration_sec: 2.0,
            ..FeatureSettings::default()
        };
        let cases = [
            FeatureSettings {
                n_fft: 256,
                hop_length: 64,
                mel_scale: MelScale::Slaney,
                mel_norm: MelNorm::Slaney,
                ..base.clone()
            },
            FeatureSettings {
                n_fft: 384,
                hop_length: 64,
                n_mels: 40,
                power: 1.5,
                f_min: 20.0,
                f_max: Some(1800.0),
                db: DbMode::AmplitudeToDb,
                top_db: Some(60.0),
                ..base.clone()
            },
            FeatureSettings {
                n_fft: 8,
                short_window: 32,
                short_hop: 16,
                long_window: 64,
                long_hop: 64,
                hop_length: 8,
                n_mels: 2,
                ..base.clone()
            },
        ];
        for (i, settings) in cases.iter().enumerate() {
            assert_meets_rule(settings, &format!("case {i}"));
        }
    }

    /// The AVX2 build and the portable build of the featuriser give the same bits.
    #[test]
    fn avx2_and_portable_agree_bit_for_bit() {
        for settings in [FeatureSettings::default(), FeatureSettings::overlap32()] {
            let plan = Plan::new(&settings).unwrap();
            if !plan.avx2 {
                eprintln!("no AVX2 here: nothing to compare");
                return;
            }
            let (mut s1, mut s2) = (plan.scratch(), plan.scratch());
            for (name, wav) in signals(settings.shape().num_samples) {
                plan.db_row(&wav, &mut s1);
                plan.db_row_with::<Portable>(&wav, &mut s2);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&s1.row), bits(&s2.row), "{name}");
            }
        }
    }

    /// The lane FFT agrees with realfft (which it replaces for powers of two) to float32
    /// rounding.
    #[test]
    fn lane_fft_agrees_with_realfft() {
        let settings = FeatureSettings::default();
        let mut lane_plan = Plan::new(&settings).unwrap();
        assert!(matches!(lane_plan.engine, Engine::Lanes(_)));
        lane_plan.power = Power::Energy;
        let mut rf_plan = Plan::new(&settings).unwrap();
        rf_plan.engine = Engine::RealFft(RealFftPlanner::<f32>::new().plan_fft_forward(512));
        rf_plan.power = Power::Energy;
        let (mut s1, mut s2) = (lane_plan.scratch(), rf_plan.scratch());
        let mut rng = Rng(7);
        let wav = Waveform::Float((0..40960).map(|_| rng.normal() as f32).collect());
        let offsets: [usize; LANES] = std::array::from_fn(|l| 1000 * l + 3);
        lane_plan.spectrogram::<Portable>(&wav, &offsets, &mut s1);
        rf_plan.spectrogram::<Portable>(&wav, &offsets, &mut s2);
        let scale = s2.spec.iter().flat_map(|b| b.0).fold(0f32, f32::max);
        for (k, (a, b)) in s1.spec.iter().zip(&s2.spec).enumerate() {
            for l in 0..LANES {
                assert!(
                    (a.0[l] - b.0[l]).abs() <= 1e-5 * scale,
                    "bin {k} lane {l}: {} vs {}",
                    a.0[l],
                    b.0[l]
                );
            }
        }
    }

    #[test]
    fn featurise_rejects_wrong_lengths() {
        let settings = FeatureSettings::default();
        let mut f = CpuFeaturiser::new(&settings, 2).unwrap();
        let short = Waveform::Pcm16(vec![0; 100]);
        let good = Waveform::Pcm16(vec![0; 40960]);
        let mut out = vec![f16::ZERO; 2 * f.shape().row_len()];
        let err = f
            .featurise(&[&good, &short], &mut out)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("recording 1") && err.contains("100 samples"),
            "{err}"
        );
        let err = f.featurise(&[&good], &mut out).unwrap_err().to_string();
        assert!(err.contains("output buffer"), "{err}");
    }

    /// Rows do not depend on the batch: alone, in a batch, at any position, any thread count.
    #[test]
    fn rows_do_not_depend_on_batch_or_threads() {
        let settings = FeatureSettings::overlap32();
        let sigs = signals(settings.shape().num_samples);
        let wavs: Vec<&Waveform> = sigs.iter().map(|(_, w)| w).collect();
        let row_len = settings.shape().row_len();
        let alone: Vec<Vec<f16>> = wavs.iter().map(|w| run(&settings, w)).collect();
        for threads in [1, 3] {
            let mut f = CpuFeaturiser::new(&settings, threads).unwrap();
            let mut batch = wavs.clone();
            batch.extend(wavs.iter().rev());
            let mut out = vec![f16::ZERO; batch.len() * row_len];
            f.featurise(&batch, &mut out).unwrap();
            for (i, row) in out.chunks(row_len).enumerate() {
                let k = if i < wavs.len() {
                    i
                } else {
                    2 * wavs.len() - 1 - i
                };
                assert!(
                    row.iter()
                        .zip(&alone[k])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "row {i}"
                );
            }
        }
    }
}
