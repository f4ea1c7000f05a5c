//! The lane-parallel FFT: [`LANES`] STFT frames windowed, packed and transformed together, frame
//! `l` in SIMD lane `l`, then untangled into the real spectrum bin-major (`[bin][lane]`) and turned
//! into spectrogram values ([`Power`]). Radix-4 decimation in frequency, in f32 or f64.

use super::vector::{Bin, Real, Vector, LANES};
use crate::decode::Waveform;
use crate::features::mel;

/// One complex value per lane. Aligned to a cache line (one line per point in f32).
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub(super) struct Cx<E> {
    pub(super) re: [E; LANES],
    pub(super) im: [E; LANES],
}

/// A complex value per lane, in registers.
#[derive(Clone, Copy)]
pub(super) struct Cv<V> {
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
pub(super) struct LaneFft<E> {
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
    pub(super) fn supports(n: usize) -> bool {
        n.is_power_of_two() && n >= 8
    }

    pub(super) fn new(n: usize) -> LaneFft<E> {
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
    pub(super) fn transform_frames<F: Vector<Elem = f32>, V: Vector<Elem = E>>(
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
    pub(super) fn untangle<V: Vector<Elem = E>, F: Vector<Elem = f32>>(
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

/// How |X|^2 becomes a spectrogram value (torchaudio: `abs().pow(power)`).
#[derive(Debug, Clone, Copy)]
pub(super) enum Power {
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
    pub(super) fn apply<F: Vector<Elem = f32>>(self, p: F) -> F {
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
