//! The x86 implementations of [`Vector`]: eight f32 in one 256-bit register; eight f64 in two
//! 256-bit registers (AVX2, [`AvxIsa`]) or in one 512-bit register (AVX-512, [`Avx512Isa`]: half
//! the instructions and register pressure of the f64 FFT, which dominates the default settings).
//! Only compiled for x86_64 and only run where the CPU has the instructions (`Plan::db_row`).
//!
//! SAFETY (for every `unsafe` block here): these types are only used through `AvxIsa` and
//! `Avx512Isa`, which only `Plan::db_row_avx2` and `Plan::db_row_avx512` instantiate, and those
//! run only on CPUs with AVX2, respectively AVX-512F (`Simd::detect`).

use super::vector::{Isa, Lanes, Vector, LANES};
use std::arch::x86_64::*;

pub(super) struct AvxIsa;
impl Isa for AvxIsa {
    type F32 = Avx32;
    type F64 = Avx64;
}

/// AVX-512F: f32 as in AVX2, f64 in one 512-bit register. The same IEEE operations in the same
/// order as the other builds, so the same bits.
pub(super) struct Avx512Isa;
impl Isa for Avx512Isa {
    type F32 = Avx32;
    type F64 = Avx512d;
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

/// Eight f64 in one 512-bit register.
#[derive(Clone, Copy)]
pub(super) struct Avx512d(__m512d);

impl Vector for Avx512d {
    type Elem = f64;
    #[inline(always)]
    fn splat(x: f64) -> Self {
        unsafe { Avx512d(_mm512_set1_pd(x)) }
    }
    #[inline(always)]
    fn load(a: &[f64; LANES]) -> Self {
        unsafe { Avx512d(_mm512_loadu_pd(a.as_ptr())) }
    }
    #[inline(always)]
    fn store(self, a: &mut [f64; LANES]) {
        unsafe { _mm512_storeu_pd(a.as_mut_ptr(), self.0) }
    }
    #[inline(always)]
    fn from_i16(a: &[i16]) -> Self {
        let a = &a[..LANES];
        unsafe {
            let q = _mm_loadu_si128(a.as_ptr().cast());
            Avx512d(_mm512_cvtepi32_pd(_mm256_cvtepi16_epi32(q)))
        }
    }
    #[inline(always)]
    fn from_f32(a: &[f32]) -> Self {
        let a = &a[..LANES];
        unsafe { Avx512d(_mm512_cvtps_pd(_mm256_loadu_ps(a.as_ptr()))) }
    }
    #[inline(always)]
    fn to_f32(self) -> Lanes {
        let mut a = [0.0; LANES];
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), _mm512_cvtpd_ps(self.0)) };
        a
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        unsafe { Avx512d(_mm512_add_pd(self.0, o.0)) }
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        unsafe { Avx512d(_mm512_sub_pd(self.0, o.0)) }
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        unsafe { Avx512d(_mm512_mul_pd(self.0, o.0)) }
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        unsafe { Avx512d(_mm512_sqrt_pd(self.0)) }
    }
    /// Through memory: no kernel transposes f64 rows (the window loader transposes f32).
    #[inline(always)]
    fn transpose(r: [Self; LANES]) -> [Self; LANES] {
        let mut rows = [[0.0; LANES]; LANES];
        for (row, v) in rows.iter_mut().zip(r) {
            v.store(row);
        }
        let mut cols = r;
        for (l, col) in cols.iter_mut().enumerate() {
            let mut c = [0.0; LANES];
            for (x, row) in c.iter_mut().zip(&rows) {
                *x = row[l];
            }
            *col = Self::load(&c);
        }
        cols
    }
}
