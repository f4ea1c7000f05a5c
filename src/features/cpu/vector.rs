//! The SIMD vocabulary of the CPU featuriser: [`LANES`] values side by side ([`Vector`]), in f32
//! or f64 ([`Real`]), with one portable implementation (plain arrays) and one per instruction set
//! (`avx.rs`). Kernels are written once against these traits.

/// Frames processed together, one per SIMD lane.
pub(super) const LANES: usize = 8;
pub(super) type Lanes = [f32; LANES];

/// The element type of an FFT: f32 or f64 (see [`Precision`](crate::features::Precision)).
pub(super) trait Real:
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

/// One f32 value per lane, aligned for whole-register loads.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
pub(super) struct Bin(pub(super) Lanes);

/// [`LANES`] lanes of one element type and the operations the kernels use. Kernels are generic
/// over it and `inline(always)`, so each is compiled once per implementation: [`Portable`]
/// (plain arrays, any CPU) and the AVX ones. All perform the same IEEE operations in the same
/// order (Rust never fuses a * b + c), so every build gives the same bits.
///
/// The per-recording path avoids closures and `std::array::from_fn`: LLVM may decline to inline
/// those, and an AVX intrinsic left in a function compiled without AVX becomes a call (seen:
/// 5x slower overall).
pub(super) trait Vector: Copy {
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
pub(super) trait Isa {
    type F32: Vector<Elem = f32>;
    type F64: Vector<Elem = f64>;
}

/// Plain arrays: the reference build, and the one for CPUs without AVX2.
#[derive(Clone, Copy)]
pub(super) struct Portable<E>([E; LANES]);

pub(super) struct PortableIsa;
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
