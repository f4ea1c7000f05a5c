//! CPU featuriser: real FFTs, a sparse mel filterbank and a vectorised logarithm, one recording
//! per task on a dedicated rayon pool. This is the bulk-rebuild hot path: nothing here allocates
//! once the featuriser is built.
//!
//! The FFT is our own and "lane-parallel": [`LANES`] STFT frames go through one radix-4 FFT
//! together, frame `l` in SIMD lane `l`, so every butterfly is a full-width vector operation
//! without shuffles, and the spectrum comes out bin-major (`[bin][lane]`), the layout in which
//! the filterbank is one vector multiply-add per weight. (With realfft, one frame at a time, its
//! scalar real-to-complex post-processing and our transposition cost more than the FFT itself.)
//! The FFT runs in f64 or f32 as the accuracy rule requires ([`Precision`](super::Precision)); everything after it
//! (magnitude, filterbank, logarithm) in f32. realfft (f64) remains for FFT sizes that are not a
//! power of two.

use super::mel::{self, SparseMel};
use super::{Featuriser, Precision};
use crate::config::{FeatureSettings, FeatureShape};
use crate::decode::Waveform;
use anyhow::Context;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use realfft::num_complex::Complex;
use realfft::{RealFftPlanner, RealToComplex};
use std::sync::{Arc, Mutex};

/// Frames processed together, one per SIMD lane.
const LANES: usize = 8;
type Lanes = [f32; LANES];

/// The element type of an FFT: f32 or f64 (see [`Precision`](super::Precision)).
trait Real:
    Copy
    + Default
    + Send
    + Sync
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
{
    fn from_f64(x: f64) -> Self;
    fn from_f32(x: f32) -> Self;
    fn from_i16(x: i16) -> Self;
    fn to_f32(self) -> f32;
    fn sqrt(self) -> Self;
}

impl Real for f32 {
    #[inline(always)]
    fn from_f64(x: f64) -> f32 {
        x as f32
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn from_i16(x: i16) -> f32 {
        x as f32
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
}

impl Real for f64 {
    #[inline(always)]
    fn from_f64(x: f64) -> f64 {
        x
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f64 {
        x as f64
    }
    #[inline(always)]
    fn from_i16(x: i16) -> f64 {
        x as f64
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
}

/// One complex value per lane. Aligned to a cache line (one line per point in f32).
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Cx<E> {
    re: [E; LANES],
    im: [E; LANES],
}

/// One f32 value per lane, aligned for whole-register loads.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
struct Bin(Lanes);

/// [`LANES`] lanes of one element type and the operations the kernels use. Kernels are generic
/// over it and `inline(always)`, so each is compiled once per implementation: [`Portable`]
/// (plain arrays, any CPU) and the AVX ones. All perform the same IEEE operations in the same
/// order (Rust never fuses a * b + c), so every build gives the same bits.
///
/// The per-recording path avoids closures and `std::array::from_fn`: LLVM may decline to inline
/// those, and an AVX intrinsic left in a function compiled without AVX becomes a call (seen:
/// 5x slower overall).
trait Vector: Copy {
    type Elem: Real;
    fn splat(x: Self::Elem) -> Self;
    fn load(a: &[Self::Elem; LANES]) -> Self;
    fn store(self, a: &mut [Self::Elem; LANES]);
    /// The first [`LANES`] samples of `a`, converted.
    fn from_i16(a: &[i16]) -> Self;
    fn from_f32(a: &[f32]) -> Self;
    /// Rounded to nearest.
    fn to_f32(self) -> Lanes;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn sqrt(self) -> Self;
    /// Lane l of row i -> lane i of row l.
    fn transpose(rows: [Self; LANES]) -> [Self; LANES];
}

/// The vector types of one build.
trait Isa {
    type F32: Vector<Elem = f32>;
    type F64: Vector<Elem = f64>;
}

/// Plain arrays: the reference build, and the one for CPUs without AVX2.
#[derive(Clone, Copy)]
struct Portable<E>([E; LANES]);

struct PortableIsa;
impl Isa for PortableIsa {
    type F32 = Portable<f32>;
    type F64 = Portable<f64>;
}

impl<E: Real> Vector for Portable<E> {
    type Elem = E;
    #[inline(always)]
    fn splat(x: E) -> Self {
        Portable([x; LANES])
    }
    #[inline(always)]
    fn load(a: &[E; LANES]) -> Self {
        Portable(*a)
    }
    #[inline(always)]
    fn store(self, a: &mut [E; LANES]) {
        *a = self.0;
    }
    #[inline(always)]
    fn from_i16(a: &[i16]) -> Self {
        let mut r = [E::default(); LANES];
        for (x, &q) in r.iter_mut().zip(&a[..LANES]) {
            *x = E::from_i16(q);
        }
        Portable(r)
    }
    #[inline(always)]
    fn from_f32(a: &[f32]) -> Self {
        let mut r = [E::default(); LANES];
        for (x, &q) in r.iter_mut().zip(&a[..LANES]) {
            *x = E::from_f32(q);
        }
        Portable(r)
    }
    #[inline(always)]
    fn to_f32(self) -> Lanes {
        let mut r = [0.0; LANES];
        for (x, &q) in r.iter_mut().zip(&self.0) {
            *x = q.to_f32();
        }
        r
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        let mut r = self.0;
        for (x, &y) in r.iter_mut().zip(&o.0) {
            *x = *x + y;
        }
        Portable(r)
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        let mut r = self.0;
        for (x, &y) in r.iter_mut().zip(&o.0) {
            *x = *x - y;
        }
        Portable(r)
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        let mut r = self.0;
        for (x, &y) in r.iter_mut().zip(&o.0) {
            *x = *x * y;
        }
        Portable(r)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        let mut r = self.0;
        for x in r.iter_mut() {
            *x = x.sqrt();
        }
        Portable(r)
    }
    #[inline(always)]
    fn transpose(rows: [Self; LANES]) -> [Self; LANES] {
        let mut cols = rows;
        for (l, col) in cols.iter_mut().enumerate() {
            for (i, x) in col.0.iter_mut().enumerate() {
                *x = rows[i].0[l];
            }
        }
        cols
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    //! SAFETY (for every `unsafe` block here): these types are only used through `AvxIsa`,
    //! which only `Plan::db_row_avx2` instantiates, and that runs only on CPUs with AVX2.
    use super::{Isa, Lanes, Vector, LANES};
    use std::arch::x86_64::*;

    pub(super) struct AvxIsa;
    impl Isa for AvxIsa {
        type F32 = Avx32;
        type F64 = Avx64;
    }

    #[derive(Clone, Copy)]
    pub(super) struct Avx32(__m256);

    impl Vector for Avx32 {
        type Elem = f32;
        #[inline(always)]
        fn splat(x: f32) -> Self {
            unsafe { Avx32(_mm256_set1_ps(x)) }
        }
        #[inline(always)]
        fn load(a: &Lanes) -> Self {
            unsafe { Avx32(_mm256_loadu_ps(a.as_ptr())) }
        }
        #[inline(always)]
        fn store(self, a: &mut Lanes) {
            unsafe { _mm256_storeu_ps(a.as_mut_ptr(), self.0) }
        }
        #[inline(always)]
        fn from_i16(a: &[i16]) -> Self {
            let a = &a[..LANES];
            unsafe {
                let q = _mm_loadu_si128(a.as_ptr().cast());
                Avx32(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(q)))
            }
        }
        #[inline(always)]
        fn from_f32(a: &[f32]) -> Self {
            Self::load(a[..LANES].try_into().expect("8 lanes"))
        }
        #[inline(always)]
        fn to_f32(self) -> Lanes {
            let mut a = [0.0; LANES];
            self.store(&mut a);
            a
        }
        #[inline(always)]
        fn add(self, o: Self) -> Self {
            unsafe { Avx32(_mm256_add_ps(self.0, o.0)) }
        }
        #[inline(always)]
        fn sub(self, o: Self) -> Self {
            unsafe { Avx32(_mm256_sub_ps(self.0, o.0)) }
        }
        #[inline(always)]
        fn mul(self, o: Self) -> Self {
            unsafe { Avx32(_mm256_mul_ps(self.0, o.0)) }
        }
        #[inline(always)]
        fn sqrt(self) -> Self {
            unsafe { Avx32(_mm256_sqrt_ps(self.0)) }
        }
        /// The classic unpack / shuffle / permute transpose: 24 shuffles.
        #[inline(always)]
        fn transpose(r: [Self; LANES]) -> [Self; LANES] {
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
                    Avx32(_mm256_permute2f128_ps::<0x20>(s0, s4)),
                    Avx32(_mm256_permute2f128_ps::<0x20>(s1, s5)),
                    Avx32(_mm256_permute2f128_ps::<0x20>(s2, s6)),
                    Avx32(_mm256_permute2f128_ps::<0x20>(s3, s7)),
                    Avx32(_mm256_permute2f128_ps::<0x31>(s0, s4)),
                    Avx32(_mm256_permute2f128_ps::<0x31>(s1, s5)),
                    Avx32(_mm256_permute2f128_ps::<0x31>(s2, s6)),
                    Avx32(_mm256_permute2f128_ps::<0x31>(s3, s7)),
                ]
            }
        }
    }

    /// Eight f64 in two registers: lanes 0-3, lanes 4-7.
    #[derive(Clone, Copy)]
    pub(super) struct Avx64(__m256d, __m256d);

    /// 4x4 transpose of f64 rows.
    #[inline(always)]
    unsafe fn transpose4(a: __m256d, b: __m256d, c: __m256d, d: __m256d) -> [__m256d; 4] {
        let t0 = _mm256_unpacklo_pd(a, b);
        let t1 = _mm256_unpackhi_pd(a, b);
        let t2 = _mm256_unpacklo_pd(c, d);
        let t3 = _mm256_unpackhi_pd(c, d);
        [
            _mm256_permute2f128_pd::<0x20>(t0, t2),
            _mm256_permute2f128_pd::<0x20>(t1, t3),
            _mm256_permute2f128_pd::<0x31>(t0, t2),
            _mm256_permute2f128_pd::<0x31>(t1, t3),
        ]
    }

    impl Vector for Avx64 {
        type Elem = f64;
        #[inline(always)]
        fn splat(x: f64) -> Self {
            unsafe { Avx64(_mm256_set1_pd(x), _mm256_set1_pd(x)) }
        }
        #[inline(always)]
        fn load(a: &[f64; LANES]) -> Self {
            unsafe {
                Avx64(
                    _mm256_loadu_pd(a.as_ptr()),
                    _mm256_loadu_pd(a[4..].as_ptr()),
                )
            }
        }
        #[inline(always)]
        fn store(self, a: &mut [f64; LANES]) {
            unsafe {
                _mm256_storeu_pd(a.as_mut_ptr(), self.0);
                _mm256_storeu_pd(a[4..].as_mut_ptr(), self.1);
            }
        }
        #[inline(always)]
        fn from_i16(a: &[i16]) -> Self {
            let a = &a[..LANES];
            unsafe {
                let q = _mm_loadu_si128(a.as_ptr().cast());
                Avx64(
                    _mm256_cvtepi32_pd(_mm_cvtepi16_epi32(q)),
                    _mm256_cvtepi32_pd(_mm_cvtepi16_epi32(_mm_srli_si128::<8>(q))),
                )
            }
        }
        #[inline(always)]
        fn from_f32(a: &[f32]) -> Self {
            let a = &a[..LANES];
            unsafe {
                Avx64(
                    _mm256_cvtps_pd(_mm_loadu_ps(a.as_ptr())),
                    _mm256_cvtps_pd(_mm_loadu_ps(a[4..].as_ptr())),
                )
            }
        }
        #[inline(always)]
        fn to_f32(self) -> Lanes {
            let mut a = [0.0; LANES];
            unsafe {
                _mm_storeu_ps(a.as_mut_ptr(), _mm256_cvtpd_ps(self.0));
                _mm_storeu_ps(a[4..].as_mut_ptr(), _mm256_cvtpd_ps(self.1));
            }
            a
        }
        #[inline(always)]
        fn add(self, o: Self) -> Self {
            unsafe { Avx64(_mm256_add_pd(self.0, o.0), _mm256_add_pd(self.1, o.1)) }
        }
        #[inline(always)]
        fn sub(self, o: Self) -> Self {
            unsafe { Avx64(_mm256_sub_pd(self.0, o.0), _mm256_sub_pd(self.1, o.1)) }
        }
        #[inline(always)]
        fn mul(self, o: Self) -> Self {
            unsafe { Avx64(_mm256_mul_pd(self.0, o.0), _mm256_mul_pd(self.1, o.1)) }
        }
        #[inline(always)]
        fn sqrt(self) -> Self {
            unsafe { Avx64(_mm256_sqrt_pd(self.0), _mm256_sqrt_pd(self.1)) }
        }
        /// Four 4x4 transposes: the quadrants swap across the diagonal.
        #[inline(always)]
        fn transpose(r: [Self; LANES]) -> [Self; LANES] {
            unsafe {
                let top_lo = transpose4(r[0].0, r[1].0, r[2].0, r[3].0);
                let bottom_lo = transpose4(r[4].0, r[5].0, r[6].0, r[7].0);
                let top_hi = transpose4(r[0].1, r[1].1, r[2].1, r[3].1);
                let bottom_hi = transpose4(r[4].1, r[5].1, r[6].1, r[7].1);
                [
                    Avx64(top_lo[0], bottom_lo[0]),
                    Avx64(top_lo[1], bottom_lo[1]),
                    Avx64(top_lo[2], bottom_lo[2]),
                    Avx64(top_lo[3], bottom_lo[3]),
                    Avx64(top_hi[0], bottom_hi[0]),
                    Avx64(top_hi[1], bottom_hi[1]),
                    Avx64(top_hi[2], bottom_hi[2]),
                    Avx64(top_hi[3], bottom_hi[3]),
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
    fn load(c: &Cx<V::Elem>) -> Self {
        Cv {
            re: V::load(&c.re),
            im: V::load(&c.im),
        }
    }
    #[inline(always)]
    fn store(self, c: &mut Cx<V::Elem>) {
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
    fn mul_w(self, w: (V::Elem, V::Elem)) -> Self {
        let (c, s) = (V::splat(w.0), V::splat(w.1));
        Cv {
            re: self.re.mul(c).sub(self.im.mul(s)),
            im: self.re.mul(s).add(self.im.mul(c)),
        }
    }
    /// |self|^2.
    #[inline(always)]
    fn norm_sqr(self) -> V {
        self.re.mul(self.re).add(self.im.mul(self.im))
    }
}

/// exp(-2 pi i k / n), computed in f64 and rounded once.
fn twiddle<E: Real>(k: usize, n: usize) -> (E, E) {
    let a = -2.0 * std::f64::consts::PI * k as f64 / n as f64;
    (E::from_f64(a.cos()), E::from_f64(a.sin()))
}

/// One in-place decimation-in-frequency pass: every block of `span` points is split into 4 (or,
/// for span 2, 2) interleaved sub-transforms of span / 4 points.
struct Pass<E> {
    span: usize,
    /// (w^p, w^2p, w^3p) for p in 0..span/4, w = exp(-2 pi i / span).
    twiddles: Vec<[(E, E); 3]>,
}

/// Windowed real FFT of a power-of-two length `n` >= 8, in element type E, for [`LANES`] frames
/// at once: the n real samples are packed as n/2 complex ones (even + j odd), transformed in
/// place, and untangled into the n/2 + 1 bins of the real spectrum (realfft's algorithm,
/// vectorised across frames).
struct LaneFft<E> {
    n: usize,
    /// The periodic Hann window, and the same divided by 32768 so that int16 samples are scaled
    /// and windowed in one multiply (the same bits: a power-of-two scale is exact).
    window: Vec<E>,
    window_pcm16: Vec<E>,
    passes: Vec<Pass<E>>,
    /// Where frequency k lands: in-place DIF leaves the output in digit-reversed order, which
    /// the untangling step reads through this table instead of reordering.
    position: Vec<usize>,
    /// 0.5 * exp(-2 pi i k / n) for k in 0..=n/4: the untangling twiddles (the 0.5 is exact).
    untangle_twiddles: Vec<(E, E)>,
}

impl<E: Real> LaneFft<E> {
    /// Powers of two, from 8: `pack` works in blocks of 8 samples.
    fn supports(n: usize) -> bool {
        n.is_power_of_two() && n >= 8
    }

    fn new(n: usize) -> LaneFft<E> {
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
                let (c, s) = twiddle::<f64>(k, n);
                (E::from_f64(0.5 * c), E::from_f64(0.5 * s))
            })
            .collect();
        let hann = mel::hann_periodic(n);
        LaneFft {
            n,
            window: hann.iter().map(|&w| E::from_f64(w)).collect(),
            window_pcm16: hann.iter().map(|&w| E::from_f64(w / 32768.0)).collect(),
            passes,
            position,
            untangle_twiddles,
        }
    }

    /// The frames at `offsets`, windowed, packed and transformed into `z`.
    #[inline(always)]
    fn transform_frames<F: Vector<Elem = f32>, V: Vector<Elem = E>>(
        &self,
        wav: &Waveform,
        offsets: &[usize; LANES],
        z: &mut [Cx<E>],
    ) {
        match wav {
            Waveform::Pcm16(v) => pack::<F, V, _>(v, offsets, &self.window_pcm16, z, F::from_i16),
            Waveform::Float(v) => pack::<F, V, _>(v, offsets, &self.window, z, F::from_f32),
        }
        self.transform::<V>(z);
    }

    /// In-place complex FFT of the n/2 points in `z`, output in digit-reversed order.
    #[inline(always)]
    fn transform<V: Vector<Elem = E>>(&self, z: &mut [Cx<E>]) {
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
                for ((((x0, x1), x2), x3), w) in points.zip(&pass.twiddles) {
                    let (a, b) = (Cv::<V>::load(x0), Cv::<V>::load(x1));
                    let (c, d) = (Cv::<V>::load(x2), Cv::<V>::load(x3));
                    let (apc, amc) = (a.add(c), a.sub(c));
                    let (bpd, bmd) = (b.add(d), b.sub(d));
                    let (y0, y1) = (apc.add(bpd), amc.sub_j(bmd));
                    let (y2, y3) = (apc.sub(bpd), amc.add_j(bmd));
                    y0.store(x0);
                    if quarter == 1 {
                        // The last pass: every twiddle is 1.
                        y1.store(x1);
                        y2.store(x2);
                        y3.store(x3);
                    } else {
                        y1.mul_w(w[0]).store(x1);
                        y2.mul_w(w[1]).store(x2);
                        y3.mul_w(w[2]).store(x3);
                    }
                }
            }
        }
    }

    /// Z (the transform of the packed even + j odd samples) -> `power` applied to |X_k|^2
    /// rounded to f32, for k in 0..=n/2, where X_k = (Z_k + conj Z_{m-k}) / 2 - j w^k (Z_k - conj Z_{m-k})
    /// / 2, w = exp(-2 pi i / n). Bins k and m - k share their inputs, so they are made together.
    #[inline(always)]
    fn untangle<V: Vector<Elem = E>, F: Vector<Elem = f32>>(
        &self,
        z: &[Cx<E>],
        out: &mut [Bin],
        power: Power,
    ) {
        let m = self.n / 2;
        let z0 = Cv::<V>::load(&z[0]);
        let (first, last) = (z0.re.add(z0.im), z0.re.sub(z0.im));
        power.store::<V, F>(first.mul(first), &mut out[0]);
        power.store::<V, F>(last.mul(last), &mut out[m]);
        let half = V::splat(E::from_f64(0.5));
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
            power.store::<V, F>(x.norm_sqr(), &mut out[k]);
            power.store::<V, F>(y.norm_sqr(), &mut out[m - k]);
        }
    }
}

/// Windowed frames -> the FFT's packed input: point m of lane l is
/// `x_l[2m] w[2m] + j x_l[2m+1] w[2m+1]`, `x_l` the frame at `offsets[l]`. Works in 8x8 blocks
/// (8 samples of each of the 8 frames), transposed in registers as f32 (exact for every input:
/// int16 and f32 samples are f32 values), then widened to the FFT's precision and windowed.
#[inline(always)]
fn pack<F: Vector<Elem = f32>, V: Vector, T>(
    samples: &[T],
    offsets: &[usize; LANES],
    window: &[V::Elem],
    z: &mut [Cx<V::Elem>],
    load8: impl Fn(&[T]) -> F,
) {
    let n = window.len();
    let mut frames: [&[T]; LANES] = [&[]; LANES];
    for (frame, &offset) in frames.iter_mut().zip(offsets) {
        *frame = &samples[offset..offset + n];
    }
    for (blk, (w, out)) in window
        .chunks_exact(8)
        .zip(z.chunks_exact_mut(4))
        .enumerate()
    {
        let mut rows = [F::splat(0.0); LANES];
        for (row, frame) in rows.iter_mut().zip(&frames) {
            *row = load8(&frame[blk * 8..]);
        }
        let cols = F::transpose(rows);
        for (i, point) in out.iter_mut().enumerate() {
            let (even, odd) = (cols[2 * i].to_f32(), cols[2 * i + 1].to_f32());
            let re = V::from_f32(&even).mul(V::splat(w[2 * i]));
            let im = V::from_f32(&odd).mul(V::splat(w[2 * i + 1]));
            re.store(&mut point.re);
            im.store(&mut point.im);
        }
    }
}

/// How a spectrum is computed.
enum Engine {
    F32(LaneFft<f32>),
    F64(LaneFft<f64>),
    /// Sizes the lane FFT does not take (not a power of two, or below 8): realfft, in f64, one
    /// frame at a time.
    RealFft {
        fft: Arc<dyn RealToComplex<f64>>,
        window: Vec<f64>,
    },
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

impl Power {
    /// |X|^2 -> the spectrogram value.
    #[inline(always)]
    fn apply<F: Vector<Elem = f32>>(self, p: F) -> F {
        match self {
            Power::Magnitude => p.sqrt(),
            Power::Energy => p,
            Power::Other(e) => {
                let mut a = p.to_f32();
                for x in a.iter_mut() {
                    *x = x.powf(e);
                }
                F::load(&a)
            }
        }
    }

    /// |X|^2 in the FFT's precision -> f32 -> the spectrogram value, into `bin`.
    #[inline(always)]
    fn store<V: Vector, F: Vector<Elem = f32>>(self, p: V, bin: &mut Bin) {
        self.apply(F::load(&p.to_f32())).store(&mut bin.0);
    }
}

/// Everything that does not change between recordings, shared read-only by the pool's threads.
struct Plan {
    settings: FeatureSettings,
    shape: FeatureShape,
    engine: Engine,
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
    /// The lane FFT's points (n_fft / 2), in the engine's precision.
    z32: Vec<Cx<f32>>,
    z64: Vec<Cx<f64>>,
    /// realfft engine: one frame, its spectrum, realfft's scratch.
    frame: Vec<f64>,
    spectrum: Vec<Complex<f64>>,
    fft_scratch: Vec<Complex<f64>>,
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
        Plan::with_precision(settings, Precision::for_settings(settings))
    }

    fn with_precision(settings: &FeatureSettings, precision: Precision) -> anyhow::Result<Plan> {
        let shape = settings.shape();
        let n_fft = settings.n_fft;
        let engine = match precision {
            _ if !LaneFft::<f32>::supports(n_fft) => Engine::RealFft {
                fft: RealFftPlanner::<f64>::new().plan_fft_forward(n_fft),
                window: mel::hann_periodic(n_fft),
            },
            Precision::F32 => Engine::F32(LaneFft::new(n_fft)),
            Precision::F64 => Engine::F64(LaneFft::new(n_fft)),
        };
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
            frames,
            mel: SparseMel::new(settings),
            power,
            avx2: avx2_available(),
        })
    }

    fn scratch(&self) -> Scratch {
        let half = self.settings.n_fft / 2;
        let mut s = Scratch {
            z32: Vec::new(),
            z64: Vec::new(),
            frame: Vec::new(),
            spectrum: Vec::new(),
            fft_scratch: Vec::new(),
            spec: vec![Bin::default(); self.mel.n_freqs],
            mels: vec![Bin::default(); self.mel.filters.len()],
            row: vec![0.0; self.shape.row_len()],
        };
        match &self.engine {
            Engine::F32(_) => s.z32 = vec![Cx::default(); half],
            Engine::F64(_) => s.z64 = vec![Cx::default(); half],
            Engine::RealFft { fft, .. } => {
                s.frame = fft.make_input_vec();
                s.spectrum = fft.make_output_vec();
                s.fft_scratch = fft.make_scratch_vec();
            }
        }
        s
    }

    /// For logs and tests: which FFT runs.
    fn engine_name(&self) -> &'static str {
        match self.engine {
            Engine::F32(_) => "f32 lane FFT",
            Engine::F64(_) => "f64 lane FFT",
            Engine::RealFft { .. } => "realfft (f64)",
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
        self.db_row_with::<PortableIsa>(wav, s)
    }

    /// The same code as the portable build, with 256-bit vectors.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn db_row_avx2(&self, wav: &Waveform, s: &mut Scratch) {
        self.db_row_with::<avx::AvxIsa>(wav, s)
    }

    #[inline(always)]
    fn db_row_with<I: Isa>(&self, wav: &Waveform, s: &mut Scratch) {
        let t_frames = self.shape.t_frames;
        for group in self.frames.chunks(LANES) {
            // Lanes past the last frame redo the group's first frame; their results are dropped.
            let mut offsets = [group[0].0; LANES];
            for (offset, frame) in offsets.iter_mut().zip(group) {
                *offset = frame.0;
            }
            self.spectrogram::<I>(wav, &offsets, s);
            for (filter, out) in self.mel.filters.iter().zip(s.mels.iter_mut()) {
                let mut acc = I::F32::splat(0.0);
                for (&w, bin) in filter.weights.iter().zip(&s.spec[filter.start..]) {
                    acc = acc.add(I::F32::splat(w).mul(I::F32::load(&bin.0)));
                }
                acc.store(&mut out.0);
            }
            if t_frames == 1 && group.len() == LANES {
                // Each frame's mels are contiguous in the row: transpose 8 mels x 8 frames
                // blocks in registers and store whole vectors.
                for (j0, block) in s.mels.chunks(LANES).enumerate() {
                    let mut rows = [I::F32::splat(0.0); LANES];
                    for (row, m) in rows.iter_mut().zip(block) {
                        *row = I::F32::load(&m.0);
                    }
                    let cols = I::F32::transpose(rows);
                    for (col, &(_, base)) in cols.iter().zip(group) {
                        let start = base + j0 * LANES;
                        let lanes = block.len();
                        if lanes == LANES {
                            let dst: &mut Lanes = (&mut s.row[start..start + LANES])
                                .try_into()
                                .expect("8 values");
                            col.store(dst);
                        } else {
                            s.row[start..start + lanes].copy_from_slice(&col.to_f32()[..lanes]);
                        }
                    }
                }
            } else {
                for (lane, &(_, base)) in group.iter().enumerate() {
                    for (j, m) in s.mels.iter().enumerate() {
                        s.row[base + j * t_frames] = m.0[lane];
                    }
                }
            }
        }
        mel::to_db_in_place(&mut s.row, &self.settings);
    }

    /// The spectrogram values (|X|^power, f32) of the frames at `offsets`, into `s.spec`.
    #[inline(always)]
    fn spectrogram<I: Isa>(&self, wav: &Waveform, offsets: &[usize; LANES], s: &mut Scratch) {
        let power = self.power;
        match &self.engine {
            Engine::F32(fft) => {
                fft.transform_frames::<I::F32, I::F32>(wav, offsets, &mut s.z32);
                fft.untangle::<I::F32, I::F32>(&s.z32, &mut s.spec, power);
            }
            Engine::F64(fft) => {
                fft.transform_frames::<I::F32, I::F64>(wav, offsets, &mut s.z64);
                fft.untangle::<I::F64, I::F32>(&s.z64, &mut s.spec, power);
            }
            Engine::RealFft { fft, window } => {
                for (lane, &offset) in offsets.iter().enumerate() {
                    let n = window.len();
                    for (i, (x, &w)) in s.frame.iter_mut().zip(window).enumerate() {
                        *x = match wav {
                            Waveform::Pcm16(v) => v[offset + i] as f64 / 32768.0,
                            Waveform::Float(v) => v[offset + i] as f64,
                        } * w;
                    }
                    debug_assert_eq!(s.frame.len(), n);
                    fft.process_with_scratch(&mut s.frame, &mut s.spectrum, &mut s.fft_scratch)
                        .expect("FFT buffers are made by the plan itself");
                    for (dst, c) in s.spec.iter_mut().zip(&s.spectrum) {
                        dst.0[lane] = (c.re * c.re + c.im * c.im) as f32;
                    }
                }
                for bin in s.spec.iter_mut() {
                    power.apply(I::F32::load(&bin.0)).store(&mut bin.0);
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
        log::debug!(
            "CPU featuriser: {}, {} threads, {}",
            plan.engine_name(),
            pool.current_num_threads(),
            if plan.avx2 {
                "AVX2"
            } else {
                "portable build (no AVX2)"
            }
        );
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
    pub(super) struct Rng(pub(super) u64);
    impl Rng {
        pub(super) fn uniform(&mut self) -> f64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
        }
        pub(super) fn normal(&mut self) -> f64 {
            let (u, v) = (self.uniform().max(1e-300), self.uniform());
            (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
        }
    }

    use crate::features::reference::row as reference;

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
    /// non-power-of-two FFT (realfft engine), an unusual power, a band-limited filterbank, a mel
    /// count that is not a multiple of the lane count.
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
                n_mels: 20,
                mel_scale: MelScale::Slaney,
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

    /// A loud tone over a faint noise floor (16-bit quantisation or below): the case that needs
    /// the f64 FFT for magnitude spectrograms (see [`Precision`](super::Precision)).
    fn tonal(num_samples: usize, count: usize) -> Vec<(String, Waveform)> {
        let mut rng = Rng(12345);
        let tau = 2.0 * std::f64::consts::PI;
        (0..count)
            .map(|i| {
                let f0 = 30.0 + 1900.0 * rng.uniform();
                let amp = 0.05 + 0.9 * rng.uniform();
                let noise = 10f64.powf(-4.0 - 2.5 * rng.uniform());
                let x: Vec<f64> = (0..num_samples)
                    .map(|t| amp * (tau * f0 * t as f64 / 4096.0).sin() + noise * rng.normal())
                    .collect();
                let name = format!("tone {f0:.0} Hz x {amp:.2} + noise {noise:.0e}");
                let wav = if i % 2 == 0 {
                    Waveform::Pcm16(
                        x.iter()
                            .map(|v| (v * 32768.0).round().clamp(-32768.0, 32767.0) as i16)
                            .collect(),
                    )
                } else {
                    Waveform::Float(x.iter().map(|&v| v as f32).collect())
                };
                (name, wav)
            })
            .collect()
    }

    /// Rule violations of `plan` over `signals`, and the largest f32 error (before float16
    /// rounding) as a fraction of the tolerance, max(1 ulp, 0.005 dB), over the checked values.
    fn violations(plan: &Plan, signals: &[(String, Waveform)]) -> (usize, f64) {
        let mut s = plan.scratch();
        let (mut count, mut worst) = (0, 0f64);
        for (name, wav) in signals {
            let exact = reference(wav, &plan.settings);
            plan.db_row(wav, &mut s);
            let max = exact.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            for (&e, &y) in exact.iter().zip(&s.row) {
                if e >= max - 100.0 {
                    worst = worst.max((y as f64 - e).abs() / mel::f16_ulp(e).max(0.005));
                }
            }
            let mut out = vec![f16::ZERO; s.row.len()];
            out.convert_from_f32_slice(&s.row);
            let acc = mel::check_accuracy(&exact, &out);
            eprintln!("{name}: {acc:?}");
            count += acc.violations;
        }
        (count, worst)
    }

    #[test]
    fn precision_follows_the_checked_depth() {
        let p2_unclamped = FeatureSettings {
            db: DbMode::Log10,
            top_db: None,
            ..FeatureSettings::overlap32()
        };
        assert_eq!(
            Precision::for_settings(&FeatureSettings::default()),
            Precision::F64
        );
        assert_eq!(
            Precision::for_settings(&FeatureSettings::overlap32()),
            Precision::F32
        );
        assert_eq!(Precision::for_settings(&p2_unclamped), Precision::F64);
    }

    /// Tonal recordings meet the rule with the precision each setup gets, with margin: the f32
    /// error before float16 rounding stays under half the tolerance.
    #[test]
    fn tonal_recordings_meet_the_rule() {
        let p2_unclamped = FeatureSettings {
            db: DbMode::Log10,
            top_db: None,
            ..FeatureSettings::overlap32()
        };
        for settings in [
            FeatureSettings::default(),
            FeatureSettings::overlap32(),
            p2_unclamped,
        ] {
            let plan = Plan::new(&settings).unwrap();
            let (count, worst) = violations(&plan, &tonal(settings.shape().num_samples, 6));
            eprintln!(
                "{}: {count} violations, f32 error {worst:.3} of the tolerance",
                plan.engine_name()
            );
            assert_eq!(count, 0);
            assert!(worst < 0.5, "{worst}");
        }
    }

    /// Why the default setup gets an f64 FFT: with an f32 one, tonal 16-bit recordings break the
    /// rule.
    #[test]
    fn f32_fft_is_not_enough_for_magnitude_spectrograms() {
        let settings = FeatureSettings::default();
        let signals = tonal(settings.shape().num_samples, 20);
        let f32_plan = Plan::with_precision(&settings, Precision::F32).unwrap();
        let (count, worst) = violations(&f32_plan, &signals);
        eprintln!("f32 FFT: {count} violations, error up to {worst:.2} of the tolerance");
        assert!(count > 0);
        let f64_plan = Plan::with_precision(&settings, Precision::F64).unwrap();
        let (count, worst) = violations(&f64_plan, &signals);
        eprintln!("f64 FFT: {count} violations, error up to {worst:.4} of the tolerance");
        assert_eq!(count, 0);
    }

    /// The AVX2 build and the portable build of the featuriser give the same bits.
    #[test]
    fn avx2_and_portable_agree_bit_for_bit() {
        for settings in [FeatureSettings::default(), FeatureSettings::overlap32()] {
            for precision in [Precision::F32, Precision::F64] {
                let plan = Plan::with_precision(&settings, precision).unwrap();
                if !plan.avx2 {
                    eprintln!("no AVX2 here: nothing to compare");
                    return;
                }
                let (mut s1, mut s2) = (plan.scratch(), plan.scratch());
                for (name, wav) in signals(settings.shape().num_samples) {
                    plan.db_row(&wav, &mut s1);
                    plan.db_row_with::<PortableIsa>(&wav, &mut s2);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&s1.row), bits(&s2.row), "{name} {precision:?}");
                }
            }
        }
    }

    /// The three engines compute the same power spectrum: f32 lanes to f32 rounding, f64 lanes
    /// and realfft (f64) to the final rounding to f32.
    #[test]
    fn engines_agree() {
        let settings = FeatureSettings::default();
        let mut plans: Vec<Plan> = [Precision::F32, Precision::F64]
            .iter()
            .map(|&p| Plan::with_precision(&settings, p).unwrap())
            .collect();
        let mut realfft = Plan::new(&settings).unwrap();
        realfft.engine = Engine::RealFft {
            fft: RealFftPlanner::<f64>::new().plan_fft_forward(512),
            window: mel::hann_periodic(512),
        };
        plans.push(realfft);
        let mut rng = Rng(7);
        let wav = Waveform::Float((0..40960).map(|_| rng.normal() as f32).collect());
        let offsets: [usize; LANES] = std::array::from_fn(|l| 1000 * l + 3);
        let spectra: Vec<Vec<Bin>> = plans
            .iter_mut()
            .map(|plan| {
                plan.power = Power::Energy;
                let mut s = plan.scratch();
                plan.spectrogram::<PortableIsa>(&wav, &offsets, &mut s);
                s.spec
            })
            .collect();
        let scale = spectra[2].iter().flat_map(|b| b.0).fold(0f32, f32::max);
        for (which, tolerance) in [(0, 1e-5), (1, 1e-7)] {
            for (k, (a, b)) in spectra[which].iter().zip(&spectra[2]).enumerate() {
                for l in 0..LANES {
                    let (a, b) = (a.0[l], b.0[l]);
                    assert!(
                        (a - b).abs() <= tolerance * scale,
                        "engine {which} bin {k} lane {l}: {a} vs {b}"
                    );
                }
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
