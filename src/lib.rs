//! ailhd: acoustic leak detection ingestion.
//!
//! A recording travels: watch -> identify (hash, manifest) -> decode -> featurise (cpu | cuda)
//! -> write (hdf5 | npy) -> commit. One module per stage:
//!
//! - [`watch`]: inotify events under the tree; [`settle`]: when a touched file is complete;
//! - [`config`]: settings and their validation (parsing only validates);
//! - [`identity`]: content hash, label, split, file-name metadata;
//! - [`manifest`]: the sled record of every file and row (the commit point);
//! - [`decode`]: WAV bytes -> mono waveform at the configured rate;
//! - [`features`]: waveforms -> float16 dB mel rows ([`features::cpu`], [`features::cuda`]);
//! - [`output`]: rows -> per-split HDF5 files and npy memmaps;
//! - [`pipeline`]: the stages from a path to a row, shared by the two drivers:
//! - [`rebuild`] (bulk, swapped in by [`staging`]) and [`daemon`] (the service).
//!
//! Around them: [`lock`] (one writer), [`migrate`] (schema versions), [`status`], [`inspect`],
//! [`demo`] with [`synth`] (synthetic recordings), [`doctor`], [`logging`].
pub mod config;
pub mod daemon;
pub mod decode;
pub mod demo;
pub mod doctor;
pub mod features;
pub mod identity;
pub mod ingest;
pub mod inspect;
pub mod lock;
pub mod logging;
pub mod manifest;
pub mod metrics;
pub mod migrate;
pub mod output;
pub mod pipeline;
pub mod rebuild;
pub mod reload;
pub mod settle;
pub mod staging;
pub mod status;
pub mod synth;
pub mod watch;
