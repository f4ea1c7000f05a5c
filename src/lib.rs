//! ailhd: acoustic leak detection ingestion.
//!
//! A recording travels: source (scan | watch -> settle) -> engine [load (read, hash, decode) ->
//! decide (the ledger's rules) -> featurise (cpu | cuda) -> commit (hdf5 + npy, then the
//! manifest)]. `rebuild` and `run` are thin drivers of the same engine.
//!
//! - [`source`]: what a recording is, [`source::scan`] of the tree, [`source::watch`]
//!   (inotify), [`source::settle`] (when a touched file is complete);
//! - [`engine`]: the stages and their threads; [`engine::ledger`] (the one place that decides
//!   rows, ownership, moves and quarantine), [`engine::featurise`] (batches through the
//!   featuriser's `submit`/`finish`), [`engine::commit`] (the one commit protocol),
//!   [`engine::manifest`] (sled, the commit point), [`engine::outcome`] (typed outcomes),
//!   [`engine::recover`] (a lost manifest rebuilt from the outputs), [`engine::lane`] (large
//!   files loaded apart, so they hold up no batch), [`engine::inflight`] (what was being read
//!   when ailhd died: no crash loop);
//! - [`decode`]: WAV bytes -> mono waveform at the configured rate; a large file read once in
//!   pieces ([`decode::stream_file`]), memory bounded whatever its size;
//! - [`features`]: waveforms -> float16 dB mel rows ([`features::cpu`], [`features::cuda`]);
//! - [`identity`]: content hash, label, split, file-name metadata;
//! - [`output`]: rows -> per-split HDF5 files and npy memmaps; [`output::read`] reads them back
//!   as a user's reader does (SWMR); [`output::direct`] keeps `rebuild`'s writes out of the page
//!   cache;
//! - the commands: [`rebuild`] (bulk into staging, swapped in by [`staging`]) and [`service`]
//!   (`run`: the event loop, the ingest worker, the micro-batching policy, riding out write
//!   failures), [`status`], [`inspect`], [`demo`] with [`synth`], [`doctor`].
//!
//!   [`plot`] draws the pictures of `inspect` and `status`.
//! - beyond one machine: [`shard`] (which recordings `rebuild --shard I/N` reads, by path) and
//!   [`merge`] (one set of outputs over several, as virtual datasets), whose
//!   [`ownership`] settles shared bytes across shards and refuses incomplete or mixed sets.
//!
//! Around them: [`config`], [`lock`] (one writer), [`migrate`] (schema versions), [`logging`],
//! [`json`] (what `--json` prints).

// The library serves the binary and its tests; its docs are for the people working on it and are
// built with the private items (`cargo doc --document-private-items`, checked by `.ci/run`), so
// public items may link to private ones.
#![allow(rustdoc::private_intra_doc_links)]
pub mod config;
pub mod decode;
pub mod demo;
pub mod doctor;
pub mod durable;
pub mod engine;
pub mod features;
pub mod identity;
pub mod inspect;
pub mod inspection;
pub mod json;
pub mod lock;
pub mod logging;
pub mod memory;
pub mod merge;
pub mod metrics;
pub mod migrate;
pub mod output;
pub mod ownership;
pub mod pace;
pub mod plot;
pub mod rebuild;
pub mod reload;
pub mod service;
pub mod shard;
pub mod source;
pub mod staging;
pub mod status;
pub mod synth;
pub mod waiting;
