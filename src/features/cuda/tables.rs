//! What the kernels are given: the [`Geometry`] of a feature setup (shared field for field with
//! `kernels/features.cu`), the window and the mel filterbank as CSR ([`KernelTables`]), and how
//! many recordings a chunk of device buffers holds.

use super::{FRAME_BUDGET_SAMPLES, MAX_CHUNK_FILES, SLOTS};
use crate::config::{DbMode, FeatureSettings};
use crate::features::{mel, Precision};
use anyhow::{anyhow, ensure};
use cudarc::driver::DeviceRepr;

/// Declares a `#[repr(C)]` struct shared with the kernel source together with its field list,
/// so a test can check the two declarations agree field for field.
macro_rules! kernel_struct {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* pub $field:ident: $ty:ty,)* }
     fields = $fields:ident;) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub struct $name { $($(#[$fmeta])* pub $field: $ty,)* }
        /// (field, Rust type) of the struct, in declaration order.
        pub const $fields: &[(&str, &str)] = &[$((stringify!($field), stringify!($ty)),)*];
    };
}

kernel_struct! {
    /// Shapes and constants of one feature setup, passed by value to every kernel. Must match
    /// `struct Geometry` in `kernels/features.cu`; all fields are 4 bytes, so there is no padding.
    pub struct Geometry {
        /// Samples per recording after pad/trim.
        pub num_samples: i32,
        pub num_long: i32,
        pub num_short: i32,
        pub t_frames: i32,
        pub long_hop: i32,
        pub short_hop: i32,
        pub hop_length: i32,
        pub n_fft: i32,
        /// n_fft / 2 + 1: complex bins per frame out of cuFFT R2C.
        pub n_freqs: i32,
        pub n_mels: i32,
        /// num_long * num_short * t_frames.
        pub frames_per_file: i32,
        /// num_long * num_short * n_mels * t_frames.
        pub row_len: i32,
        pub power: f32,
        /// 10 when power == 2, else 20 (mel::db_multiplier).
        pub db_multiplier: f32,
        /// AmplitudeToDB's amin: values below it are taken as it (mel::DB_FLOOR).
        pub db_floor: f32,
        pub top_db: f32,
        /// 1: clamp each recording at its maximum - top_db (amplitude_to_db with top_db set).
        pub use_top_db: i32,
    }
    fields = GEOMETRY_FIELDS;
}

// SAFETY: #[repr(C)], only i32/f32 fields (no padding, every bit pattern valid).
unsafe impl DeviceRepr for Geometry {}
unsafe impl bytemuck::Zeroable for Geometry {}
unsafe impl bytemuck::Pod for Geometry {}

/// Everything the kernels read besides the samples: geometry, window and the mel filterbank as
/// CSR. Public so the host-emulation test (tests/gpu_parity.rs) drives the kernel source with
/// exactly what the GPU gets.
#[derive(Debug, Clone)]
pub struct KernelTables {
    pub geometry: Geometry,
    /// The FFT's element type (float frames and R2C, or double frames and D2Z).
    pub precision: Precision,
    /// Periodic Hann window, n_fft values, for float frames.
    pub window: Vec<f32>,
    /// The same window for double frames.
    pub window_f64: Vec<f64>,
    /// First FFT bin of each mel filter.
    pub mel_start: Vec<i32>,
    /// Filter m's weights are `mel_weights[mel_offset[m]..mel_offset[m + 1]]`; n_mels + 1 values.
    pub mel_offset: Vec<i32>,
    pub mel_weights: Vec<f32>,
}

impl KernelTables {
    /// Built from the CPU path's filterbank and window (features::mel), so both devices use the
    /// same float32 weights.
    pub fn new(settings: &FeatureSettings) -> anyhow::Result<KernelTables> {
        let shape = settings.shape();
        let n_freqs = settings.n_fft / 2 + 1;
        let int = |name: &str, v: usize| {
            i32::try_from(v).map_err(|_| {
                anyhow!(
                    "{name} = {v} is too large for the CUDA featuriser (at most {})",
                    i32::MAX
                )
            })
        };
        let frames_per_file = shape.num_windows() * shape.t_frames;
        let (top_db, use_top_db) = match (settings.db, settings.top_db) {
            (DbMode::AmplitudeToDb, Some(t)) => (t as f32, 1),
            _ => (0.0, 0),
        };
        let geometry = Geometry {
            num_samples: int("samples per recording", shape.num_samples)?,
            num_long: int("num_long", shape.num_long)?,
            num_short: int("num_short", shape.num_short)?,
            t_frames: int("t_frames", shape.t_frames)?,
            long_hop: int("features.long_hop", settings.long_hop)?,
            short_hop: int("features.short_hop", settings.short_hop)?,
            hop_length: int("features.hop_length", settings.hop_length)?,
            n_fft: int("features.n_fft", settings.n_fft)?,
            n_freqs: int("n_fft / 2 + 1", n_freqs)?,
            n_mels: int("features.n_mels", settings.n_mels)?,
            frames_per_file: int("frames per recording", frames_per_file)?,
            row_len: int("values per row", shape.row_len())?,
            power: settings.power as f32,
            db_multiplier: mel::db_multiplier(settings) as f32,
            db_floor: mel::DB_FLOOR,
            top_db,
            use_top_db,
        };
        // The kernels do not bounds-check their reads: prove here that the last frame of a
        // recording ends inside it.
        let last_end = (shape.num_long - 1) * settings.long_hop
            + (shape.num_short - 1) * settings.short_hop
            + (shape.t_frames - 1) * settings.hop_length
            + settings.n_fft;
        ensure!(
            shape.num_long >= 1 && shape.num_short >= 1 && shape.t_frames >= 1,
            "feature settings give an empty row ({:?})",
            shape.row_dims()
        );
        ensure!(
            last_end <= shape.num_samples,
            "feature settings read past the end of a recording ({last_end} > {} samples)",
            shape.num_samples
        );

        let window_f64 = mel::hann_periodic(settings.n_fft);
        let window: Vec<f32> = window_f64.iter().map(|&w| w as f32).collect();
        ensure!(
            window.len() == settings.n_fft,
            "Hann window has the wrong length"
        );

        let sparse = mel::SparseMel::new(settings);
        ensure!(
            sparse.n_freqs == n_freqs && sparse.filters.len() == settings.n_mels,
            "mel filterbank is {} filters x {} bins, expected {} x {}",
            sparse.filters.len(),
            sparse.n_freqs,
            settings.n_mels,
            n_freqs
        );
        let mut mel_start = Vec::with_capacity(settings.n_mels);
        let mut mel_offset = Vec::with_capacity(settings.n_mels + 1);
        let mut mel_weights = Vec::new();
        mel_offset.push(0);
        for (m, filter) in sparse.filters.iter().enumerate() {
            ensure!(
                filter.start + filter.weights.len() <= n_freqs,
                "mel filter {m} runs past the last FFT bin"
            );
            mel_start.push(int("mel filter start", filter.start)?);
            mel_weights.extend_from_slice(&filter.weights);
            mel_offset.push(int("mel filterbank size", mel_weights.len())?);
        }
        Ok(KernelTables {
            geometry,
            precision: Precision::for_settings(settings),
            window,
            window_f64,
            mel_start,
            mel_offset,
            mel_weights,
        })
    }
}

/// Recordings per chunk: as many as the frames budget allows, a power of two (a whole number of
/// [`PLAN_FILES`](super::PLAN_FILES) groups), at most [`MAX_CHUNK_FILES`].
pub(super) fn chunk_files_for(geometry: &Geometry) -> usize {
    let per_file = (geometry.frames_per_file as usize * geometry.n_fft as usize).max(1);
    let files = (FRAME_BUDGET_SAMPLES / per_file).clamp(1, MAX_CHUNK_FILES);
    1 << (usize::BITS - 1 - files.leading_zeros())
}

/// Device bytes for a chunk of `files` recordings (cuFFT's work area not included).
pub(super) fn device_bytes(g: &Geometry, precision: Precision, files: usize) -> usize {
    let frames = files * g.frames_per_file as usize;
    let row = files * g.row_len as usize;
    let real = match precision {
        Precision::F32 => 4,
        Precision::F64 => 8,
    };
    frames * g.n_fft as usize * real
        + frames * g.n_freqs as usize * 2 * real
        + row * 4
        + SLOTS * (files * g.num_samples as usize * 2 + row * 2)
}

#[cfg(test)]
mod tests {
    use super::super::{FINALIZE_THREADS, KERNEL_SOURCE, PLAN_FILES};
    use super::*;

    /// `struct Geometry` in the kernel source, as (name, C type) pairs.
    fn kernel_geometry_fields() -> Vec<(String, String)> {
        let start = KERNEL_SOURCE
            .find("struct Geometry {")
            .expect("kernel source declares struct Geometry");
        let body = &KERNEL_SOURCE[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
        body.lines()
            .map(|l| l.split("//").next().unwrap().trim())
            .filter(|l| !l.is_empty())
            .map(|l| {
                let l = l.trim_end_matches(';');
                let (ty, name) = l.rsplit_once(' ').expect("`type name;`");
                (name.trim().to_string(), ty.trim().to_string())
            })
            .collect()
    }

    #[test]
    fn geometry_matches_the_kernel_struct_field_for_field() {
        let rust: Vec<(String, String)> = GEOMETRY_FIELDS
            .iter()
            .map(|&(name, ty)| {
                let c = match ty {
                    "i32" => "int",
                    "f32" => "float",
                    other => panic!("Geometry field {name}: {other} has no agreed C type"),
                };
                (name.to_string(), c.to_string())
            })
            .collect();
        assert_eq!(rust, kernel_geometry_fields());
        assert_eq!(std::mem::size_of::<Geometry>(), 4 * GEOMETRY_FIELDS.len());
    }

    #[test]
    fn finalize_block_size_matches_the_kernel() {
        assert!(KERNEL_SOURCE.contains(&format!("#define FINALIZE_THREADS {FINALIZE_THREADS}")));
        assert!(FINALIZE_THREADS.is_power_of_two());
    }

    #[test]
    fn chunks_fit_the_frame_budget_and_are_whole_fft_groups() {
        let default = KernelTables::new(&FeatureSettings::default())
            .unwrap()
            .geometry;
        let overlap = KernelTables::new(&FeatureSettings::overlap32())
            .unwrap()
            .geometry;
        assert_eq!(default.frames_per_file, 80);
        assert_eq!(overlap.frames_per_file, 237);
        assert_eq!(chunk_files_for(&default), 512);
        assert_eq!(chunk_files_for(&overlap), 256);
        for g in [default, overlap] {
            assert_eq!(chunk_files_for(&g) % PLAN_FILES, 0, "{g:?}");
        }
    }

    #[test]
    fn tables_follow_the_settings() {
        let t = KernelTables::new(&FeatureSettings::overlap32()).unwrap();
        let g = t.geometry;
        assert_eq!(
            (g.num_long, g.num_short, g.t_frames, g.n_mels, g.row_len),
            (79, 3, 1, 32, 79 * 3 * 32)
        );
        assert_eq!(
            (g.power, g.db_multiplier, g.top_db, g.use_top_db),
            (2.0, 10.0, 80.0, 1)
        );
        assert_eq!(t.window.len(), 512);
        assert_eq!(t.window_f64.len(), 512);
        assert_eq!(t.precision, Precision::F32);
        let default = KernelTables::new(&FeatureSettings::default()).unwrap();
        assert_eq!(
            default.precision,
            Precision::F64,
            "power 1 without a clamp needs D2Z"
        );
        assert_eq!(t.mel_offset.len(), 33);
        assert_eq!(*t.mel_offset.last().unwrap() as usize, t.mel_weights.len());
        for m in 0..32 {
            let len = t.mel_offset[m + 1] - t.mel_offset[m];
            assert!(
                t.mel_start[m] + len <= g.n_freqs,
                "filter {m} inside the spectrum"
            );
        }
        let d = KernelTables::new(&FeatureSettings::default())
            .unwrap()
            .geometry;
        assert_eq!((d.power, d.db_multiplier, d.use_top_db), (1.0, 20.0, 0));
    }
}
