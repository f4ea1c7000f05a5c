//! ailhd: acoustic leak detection ingestion.
//!
//! A recording travels: watch -> identify (hash, manifest) -> decode -> featurise (cpu | cuda)
//! -> write (hdf5 | npy) -> commit. One module per stage:
//!
//! - [`config`]: settings and their validation;
//! - [`decode`]: WAV bytes -> mono waveform at the configured rate;
//! - [`features`]: waveforms -> float16 dB mel rows ([`features::cpu`], [`features::cuda`]);
//! - [`output`]: rows -> per-split HDF5 files and npy memmaps;
//! - [`doctor`]: what this host offers (CPU features, CUDA) and a CPU/GPU parity self-test.
pub mod config;
pub mod decode;
pub mod doctor;
pub mod features;
pub mod output;
