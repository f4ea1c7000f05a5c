//! ailhd: acoustic leak detection ingestion.
//!
//! A recording travels: watch -> identify (hash, manifest) -> decode -> featurise (cpu | cuda)
//! -> write (hdf5 | npy) -> commit. One module per stage:
//!
//! - [`config`]: settings and their validation;
//! - [`decode`]: WAV bytes -> mono waveform at the configured rate;
//! - [`features`]: waveforms -> float16 dB mel rows ([`features::cpu`], [`features::cuda`]);
//! - [`output`]: rows -> per-split HDF5 files and npy memmaps;
pub mod config;
pub mod decode;
pub mod features;
pub mod output;
pub mod settle;
pub mod watch;
