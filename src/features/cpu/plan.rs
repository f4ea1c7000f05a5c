//! One recording at a time: the [`Plan`] (frame offsets, FFT engine, sparse mel filterbank) turns
//! a waveform into its row of dB values in per-thread [`Scratch`] memory: spectra of eight frames
//! at once, the filterbank as vector multiply-adds, 8x8 transposes into row order, the logarithm.

#[cfg(target_arch = "x86_64")]
use super::avx;
use super::fft::{Cx, LaneFft, Power};
use super::vector::{Bin, Isa, Lanes, PortableIsa, Vector, LANES};
use crate::config::{FeatureSettings, FeatureShape};
use crate::decode::Waveform;
use crate::features::mel::{self, SparseMel};
use crate::features::Precision;
use half::f16;
use half::slice::HalfFloatSliceExt;
use realfft::num_complex::Complex;
use realfft::{RealFftPlanner, RealToComplex};
use std::sync::Arc;

/// How a spectrum is computed.
pub(super) enum Engine {
    F32(LaneFft<f32>),
    F64(LaneFft<f64>),
    /// Sizes the lane FFT does not take (not a power of two, or below 8): realfft, in f64, one
    /// frame at a time.
    RealFft {
        fft: Arc<dyn RealToComplex<f64>>,
        window: Vec<f64>,
    },
}

/// Everything that does not change between recordings, shared read-only by the pool's threads.
pub(super) struct Plan {
    pub(super) settings: FeatureSettings,
    pub(super) shape: FeatureShape,
    pub(super) engine: Engine,
    /// Per STFT frame, in row order: where it starts in the waveform, and where its mel 0 goes in
    /// the row (mel j at `+ j * t_frames`).
    pub(super) frames: Vec<(usize, usize)>,
    pub(super) mel: SparseMel,
    pub(super) power: Power,
    /// Which build of the same code runs (checked once, here).
    pub(super) simd: Simd,
}

/// Per-thread working memory, sized once.
pub(super) struct Scratch {
    /// The lane FFT's points (n_fft / 2), in the engine's precision.
    pub(super) z32: Vec<Cx<f32>>,
    pub(super) z64: Vec<Cx<f64>>,
    /// realfft engine: one frame, its spectrum, realfft's scratch.
    pub(super) frame: Vec<f64>,
    pub(super) spectrum: Vec<Complex<f64>>,
    pub(super) fft_scratch: Vec<Complex<f64>>,
    /// Spectrogram values of the frames in flight, `[n_freqs]` bins of [`LANES`] frames.
    pub(super) spec: Vec<Bin>,
    /// Their mel values, `[n_mels]`.
    pub(super) mels: Vec<Bin>,
    /// One recording's mel values (then dB), f32, in row order.
    pub(super) row: Vec<f32>,
}

impl Plan {
    pub(super) fn new(settings: &FeatureSettings) -> anyhow::Result<Plan> {
        Plan::with_precision(settings, Precision::for_settings(settings))
    }

    pub(super) fn with_precision(
        settings: &FeatureSettings,
        precision: Precision,
    ) -> anyhow::Result<Plan> {
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
            simd: Simd::detect(),
        })
    }

    pub(super) fn scratch(&self) -> Scratch {
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
    pub(super) fn engine_name(&self) -> &'static str {
        match self.engine {
            Engine::F32(_) => "f32 lane FFT",
            Engine::F64(_) => "f64 lane FFT",
            Engine::RealFft { .. } => "realfft (f64)",
        }
    }

    pub(super) fn featurise_one(&self, wav: &Waveform, s: &mut Scratch, out: &mut [f16]) {
        self.db_row(wav, s);
        out.convert_from_f32_slice(&s.row);
    }

    /// One recording's dB values, f32, into `s.row`. Deterministic: a value's arithmetic depends
    /// only on its own frame (lanes never mix), never on the batch, the thread or the build.
    pub(super) fn db_row(&self, wav: &Waveform, s: &mut Scratch) {
        match self.simd {
            // SAFETY: `Simd::detect` only picks these where the CPU has the instructions.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => unsafe { self.db_row_avx512(wav, s) },
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => unsafe { self.db_row_avx2(wav, s) },
            _ => self.db_row_with::<PortableIsa>(wav, s),
        }
    }

    /// The same code as the portable build, with 256-bit vectors.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn db_row_avx2(&self, wav: &Waveform, s: &mut Scratch) {
        self.db_row_with::<avx::AvxIsa>(wav, s)
    }

    /// The same code as the portable build, f64 in 512-bit vectors.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,avx512f")]
    pub(super) unsafe fn db_row_avx512(&self, wav: &Waveform, s: &mut Scratch) {
        self.db_row_with::<avx::Avx512Isa>(wav, s)
    }

    #[inline(always)]
    pub(super) fn db_row_with<I: Isa>(&self, wav: &Waveform, s: &mut Scratch) {
        let t_frames = self.shape.t_frames;
        let n = self.settings.n_fft;
        let mut groups = self.frames.chunks(LANES).peekable();
        if let Some(first) = groups.peek() {
            prefetch(wav, first, n);
        }
        while let Some(group) = groups.next() {
            if let Some(next) = groups.peek() {
                prefetch(wav, next, n);
            }
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
    pub(super) fn spectrogram<I: Isa>(
        &self,
        wav: &Waveform,
        offsets: &[usize; LANES],
        s: &mut Scratch,
    ) {
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

/// Asks the CPU to start fetching the samples of `frames` (`n` each) into its nearest cache while
/// it transforms the group before them. The waveform was decoded on another core (a loader
/// thread), so its lines sit in that core's cache or the shared one, and reading them on demand
/// cost about a third of the featuriser's time (measured with `benches/featurise.rs`: 44.5 µs
/// per recording with 20 MB of clips, 31.7 µs with clips that fit the core's own cache; one group
/// ahead took the first to 43 µs, two groups ahead did no better). A prefetch changes no result
/// and never faults.
#[inline(always)]
fn prefetch(wav: &Waveform, frames: &[(usize, usize)], n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        const LINE: usize = 64;
        let (base, size): (*const u8, usize) = match wav {
            Waveform::Pcm16(v) => (v.as_ptr().cast(), 2),
            Waveform::Float(v) => (v.as_ptr().cast(), 4),
        };
        // Frames of a group overlap or follow each other: each line is asked for once.
        let mut next = 0;
        for &(offset, _) in frames {
            let end = (offset + n) * size;
            let mut line = (offset * size).max(next) / LINE * LINE;
            while line < end {
                // SAFETY: a prefetch reads nothing architecturally and never faults; the address
                // is only computed (wrapping_add), never dereferenced.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(line).cast()) };
                line += LINE;
            }
            next = next.max(end);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (wav, frames, n);
}

/// The builds of the per-recording code; all give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Simd {
    /// Plain arrays: any CPU.
    Portable,
    /// 256-bit vectors.
    Avx2,
    /// f64 in 512-bit vectors (f32 as AVX2).
    Avx512,
}

impl Simd {
    /// The widest build this CPU runs.
    pub(super) fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx2")
            {
                return Simd::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Simd::Avx2;
            }
        }
        Simd::Portable
    }

    /// Every build this CPU runs, narrowest first (for the tests that compare them).
    #[cfg(test)]
    pub(super) fn available() -> Vec<Simd> {
        let widest = Simd::detect();
        [Simd::Portable, Simd::Avx2, Simd::Avx512]
            .into_iter()
            .filter(|&s| s as u8 <= widest as u8)
            .collect()
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Simd::Portable => "portable build (no AVX2)",
            Simd::Avx2 => "AVX2",
            Simd::Avx512 => "AVX-512",
        }
    }
}
