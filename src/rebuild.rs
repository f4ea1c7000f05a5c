//! `ailhd rebuild`: every output regenerated from the tree in one bulk run. A thin driver of
//! the engine: scan the tree, feed it to the engine in path order in chunks, into empty
//! staging outputs and manifest, then swap them in (see [`crate::staging`]).

use crate::config::{DeviceChoice, Settings, SPLITS};
use crate::engine::manifest::{now_ms, Manifest};
use crate::engine::outcome::Observation;
use crate::engine::{Engine, Input};
use crate::features;
use crate::identity::LabelSet;
use crate::lock::WriterLocks;
use crate::shard::{Shard, ShardRecord, SharedContent};
use crate::source::{self, Item, Listing};
use crate::staging;
use std::time::{Duration, Instant};

/// What `rebuild` did; `--json` prints it (docs/json.md: units in the names, per-split and
/// per-stage figures as objects).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RebuildReport {
    pub files: usize,
    #[serde(serialize_with = "crate::json::per_split")]
    pub rows: [u64; 3],
    pub duplicates: usize,
    #[serde(serialize_with = "crate::json::path_reasons")]
    pub quarantined: Vec<(String, String)>,
    pub device: String,
    #[serde(rename = "elapsed_s", serialize_with = "crate::json::seconds")]
    pub elapsed: Duration,
    /// Thread-seconds per stage (summed over the threads that run it).
    #[serde(rename = "stages_s", serialize_with = "crate::json::keyed")]
    pub stages: Vec<(&'static str, f64)>,
    /// Wall-clock seconds of the run's phases: start (lock, scan, featuriser, staging
    /// outputs), ingest (first batch submitted to last batch durable), close (outputs and
    /// manifest closed and synced), swap.
    #[serde(rename = "phases_s", serialize_with = "crate::json::keyed")]
    pub phases: Vec<(&'static str, f64)>,
    pub labels: Vec<String>,
    pub rows_per_label: Vec<u64>,
    /// `rebuild --shard I/N`: the shard, and the files left to the other shards (not counted
    /// in `files`).
    pub shard: Option<String>,
    pub other_shards: usize,
}

impl RebuildReport {
    pub fn files_per_sec(&self) -> f64 {
        self.files as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Files the service quarantined because ailhd stopped while reading them (see
/// [`crate::engine::inflight`]) stay quarantined in the rebuilt outputs while their size and
/// mtime are the same: `rebuild` does not read them (they would stop it too).
fn keep_set_aside(settings: &Settings, old: &Manifest) -> anyhow::Result<()> {
    let mut journal = None;
    // Only the quarantined paths (a tree of their own): not every record of the old manifest.
    for item in old.quarantined() {
        let (rel, _) = item?;
        let Some(rec) = old.get_file(&rel)? else {
            continue;
        };
        let Some(q) = &rec.quarantine else { continue };
        if q.kind == crate::engine::outcome::STOPPED_WHILE_READING {
            journal
                .get_or_insert_with(|| {
                    crate::engine::inflight::Journal::for_state(&settings.paths.state)
                })
                .remember_poison(crate::engine::inflight::Entry {
                    rel,
                    size: rec.size,
                    mtime_ns: rec.mtime_ns,
                    deaths: 2,
                });
        }
    }
    Ok(())
}

pub struct Ui {
    pub progress: bool,
}

pub fn rebuild(
    settings: &Settings,
    device: DeviceChoice,
    ui: &Ui,
) -> anyhow::Result<RebuildReport> {
    rebuild_shard(settings, device, ui, Scope::default())
}

/// What start-up gives: the tree's listing, the labels the old manifest appended, the
/// featuriser and the empty staging stores.
type Started = (
    Listing,
    Before,
    Box<dyn features::Featuriser>,
    crate::engine::BulkStores,
);

/// What the old manifest says: the labels it appended and how many recordings hold a row.
#[derive(Default)]
struct Before {
    appended: Vec<String>,
    committed: u64,
}

/// What a rebuild covers: the whole tree or one shard of it ([`rebuild_shard`]); and whether a
/// recordings folder found empty may empty outputs that hold recordings (`--allow-empty`).
#[derive(Debug, Default, Clone, Copy)]
pub struct Scope {
    pub shard: Option<Shard>,
    pub allow_empty: bool,
}

/// The recordings folder holds nothing while the outputs hold recordings made from it: most
/// likely a disk that is not mounted, so the rebuild stops before anything is replaced (the
/// service takes such a folder the same way: [`crate::engine::TreeAbsent`]).
#[derive(Debug, thiserror::Error)]
#[error(
    "found no recordings under {} while the outputs hold {committed} made from it: is the recordings disk mounted? Nothing was changed. If the recordings were removed on purpose, run `ailhd rebuild --allow-empty` to empty the outputs",
    root.display()
)]
pub struct EmptyTree {
    pub root: std::path::PathBuf,
    pub committed: u64,
}

/// Folders of the tree that could not be listed (no permission, an I/O error): a rebuild
/// would leave their recordings out of outputs made to hold the whole tree, so it refuses.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot list {} under {}: {}{}; a rebuild would leave the recordings under it out, so nothing was changed (the user running ailhd must be able to read every folder under paths.recordings)",
    folder_name(&.folders[0].0), root.display(), .folders[0].1,
    if .folders.len() > 1 { format!(" (and {} more folders)", .folders.len() - 1) } else { String::new() }
)]
pub struct UnlistedFolders {
    pub root: std::path::PathBuf,
    /// (folder relative to the root, why), as [`Listing::unlisted`] has them.
    pub folders: Vec<(String, String)>,
}

fn folder_name(rel: &str) -> String {
    match rel {
        "" => "the recordings folder".into(),
        rel => format!("the folder {rel}"),
    }
}

/// Start-up work runs side by side: opening the old manifest (for the labels it appended,
/// which keep their ids across rebuilds; tens of ms while sled recovers its log), building the
/// featuriser (a GPU's takes a good part of a second: context, NVRTC, plans, self-check),
/// making the empty staging outputs and manifest (with the configured labels; appended ones
/// are added later), and listing the tree.
fn start_up(
    settings: &Settings,
    make_featuriser: impl FnOnce(usize) -> anyhow::Result<Box<dyn features::Featuriser>> + Send,
) -> anyhow::Result<Started> {
    let threads = settings.worker_threads();
    let (found, before, featuriser, stores) = std::thread::scope(|scope| {
        let before = scope.spawn(|| -> anyhow::Result<Before> {
            let old_manifest = staging::manifest_dir(settings);
            Ok(if old_manifest.exists() {
                let old = Manifest::open(&old_manifest)?;
                keep_set_aside(settings, &old)?;
                Before {
                    appended: old.appended_labels()?,
                    committed: old.summary().committed,
                }
            } else {
                Before::default()
            })
        });
        let featuriser = scope.spawn(|| make_featuriser(threads));
        // The staging outputs are made once the old manifest is closed again: sled writes while
        // it opens (recovering its log, writing a snapshot), and a rebuild killed in that window
        // left the live manifest unreadable ("Read corrupted data": sled read its half-written
        // snapshot, which it now ignores, vendor/README.md). Not overlapping the two keeps that
        // window before anything of the rebuild is on disk.
        let stores = scope.spawn(|| {
            let before = before.join().expect("reading the old manifest panicked");
            let stores = Engine::create_bulk(
                settings,
                &staging::output_staging(settings),
                &staging::manifest_staging(settings),
                &settings.labels.names,
            );
            (before, stores)
        });
        let found = source::scan(&settings.paths.recordings);
        let (before, stores) = stores.join().expect("making the staging outputs panicked");
        (
            found,
            before,
            featuriser.join().expect("featuriser start-up panicked"),
            stores,
        )
    });
    Ok((found?, before?, featuriser?, stores?))
}

/// `rebuild --shard I/N` (`shard` given): only the recordings that shard I of N owns, decided
/// from their paths (see [`crate::shard`]), as an ordinary set of outputs whose HDF5 files say
/// which shard they are ([`crate::shard::ShardRecord`]). Every shard lists the whole tree (so
/// that appended labels get the same ids everywhere) and reads only its own files.
pub fn rebuild_shard(
    settings: &Settings,
    device: DeviceChoice,
    ui: &Ui,
    scope: Scope,
) -> anyhow::Result<RebuildReport> {
    rebuild_with(settings, ui, scope, |threads| {
        features::build(&settings.features, &settings.gpu, device, threads)
    })
}

/// [`rebuild_shard`] with the featuriser `make_featuriser(worker threads)` returns, built while
/// the tree is listed. For benchmarks that put another featuriser in the real pipeline
/// (`cargo bench --bench rebuild -- --ceiling`); users choose with `--device`.
pub fn rebuild_with(
    settings: &Settings,
    ui: &Ui,
    scope: Scope,
    make_featuriser: impl FnOnce(usize) -> anyhow::Result<Box<dyn features::Featuriser>> + Send,
) -> anyhow::Result<RebuildReport> {
    let started = Instant::now();
    let shard = scope.shard;
    if shard.is_some() && !settings.outputs.hdf5 {
        return Err(crate::config::ConfigError::Invalid {
            key: "outputs.hdf5".into(),
            message: "rebuild --shard needs HDF5 outputs (true): merge reads the shards' HDF5 \
                      files"
                .into(),
        }
        .into());
    }
    // The recordings, output and state folders first, as `check-config` checks them: a
    // recordings folder that is missing or is a file is refused (exit 2) before anything is
    // locked, made or staged.
    settings.check_data_folders()?;
    let _lock = WriterLocks::acquire(settings, "rebuild")?;
    crate::engine::manifest::set_cache_mb(settings.ingest.manifest_cache_mb);
    staging::finish_pending(settings)?;
    staging::prepare(settings)?;
    let (mut report, close_start, status_report) =
        match build_staged(settings, ui, scope, make_featuriser, started) {
            Ok(built) => built,
            Err(e) => {
                // Everything the build opened is closed by now: staging outputs that will never
                // be swapped in go (the old outputs were not touched), so that a failed rebuild
                // (a full disk, a featuriser that cannot start) leaves nothing behind.
                match staging::discard(settings) {
                    Ok(()) => log::warn!(
                        "rebuild failed: its staging outputs are removed, the outputs in {} are \
                         as they were",
                        settings.paths.output.display()
                    ),
                    Err(d) => log::warn!("could not remove the staging outputs: {d:#}"),
                }
                return Err(e);
            }
        };
    let swap_start = Instant::now();
    staging::swap_in(settings)?;
    if let Err(e) = status_report.and_then(|r| Ok(crate::status::save_stopped(settings, &r)?)) {
        log::debug!("cannot keep the status report of the rebuilt manifest: {e:#}");
    }
    report.elapsed = started.elapsed();
    report.phases.extend([
        ("close", (swap_start - close_start).as_secs_f64()),
        ("swap", swap_start.elapsed().as_secs_f64()),
    ]);
    Ok(report)
}

/// What [`rebuild_with`] builds in the staging folders, up to the swap: the report (all but the
/// close's and the swap's times and the elapsed time), when the close began and what `status`
/// will show of the new manifest.
fn build_staged(
    settings: &Settings,
    ui: &Ui,
    scope: Scope,
    make_featuriser: impl FnOnce(usize) -> anyhow::Result<Box<dyn features::Featuriser>> + Send,
    started: Instant,
) -> anyhow::Result<(
    RebuildReport,
    Instant,
    anyhow::Result<crate::status::StatusReport>,
)> {
    let shard = scope.shard;
    let (mut found, before, featuriser, stores) = start_up(settings, make_featuriser)?;
    if !found.unlisted().is_empty() {
        return Err(UnlistedFolders {
            root: settings.paths.recordings.clone(),
            folders: found.unlisted().to_vec(),
        }
        .into());
    }
    if found.is_empty() && before.committed > 0 && !scope.allow_empty {
        return Err(EmptyTree {
            root: settings.paths.recordings.clone(),
            committed: before.committed,
        }
        .into());
    }
    let labels = label_ids(settings, &found, &before.appended);
    let record = shard.map(|s| {
        let record = ShardRecord::new(
            s,
            &settings.paths.recordings,
            found.iter().map(|f| f.rel()),
            settings,
        );
        found.retain(|rel| s.contains(rel));
        record
    });
    let batch = featuriser.bulk_batch().max(1);
    log::info!(
        "rebuild: {} recordings under {}{}, featurising on {}",
        found.len(),
        settings.paths.recordings.display(),
        shard.map_or(String::new(), |s| format!(" in shard {s}")),
        featuriser.name()
    );
    let mut engine = Engine::open_bulk(settings, featuriser, stores, labels)?;
    let mut report = RebuildReport {
        files: found.len(),
        device: engine.device().to_string(),
        labels: engine.labels().to_vec(),
        shard: shard.map(|s| s.to_string()),
        other_shards: record
            .as_ref()
            .map_or(0, |r| r.listed as usize - found.len()),
        ..RebuildReport::default()
    };
    let ingest_start = Instant::now();
    ingest(&mut engine, &found, batch, ui, &mut report)?;
    report.labels = engine.labels().to_vec();
    (report.rows_per_label, report.duplicates) =
        rows_per_label(engine.manifest(), report.labels.len())?;
    engine
        .manifest()
        .set_meta("rebuilt_at_ms", &now_ms().to_string())?;
    if let Some(s) = shard {
        // What `status` of the folder says it is.
        engine.manifest().set_meta("shard", &s.to_string())?;
    }
    let shared = match &record {
        Some(_) => Some(shared_by_split(engine.manifest(), settings)?),
        None => None,
    };
    let stage_times = engine.times().seconds();
    // What `status` shows of the rebuilt manifest, kept once it is closed and in place (so that
    // `status` need not open it).
    let status_report = crate::status::collect(engine.manifest(), engine.labels(), settings);
    let close_start = Instant::now();
    let device_times = engine.finish()?;
    report.phases = vec![
        ("start", (ingest_start - started).as_secs_f64()),
        ("ingest", (close_start - ingest_start).as_secs_f64()),
    ];
    report.stages = stage_times;
    if let Some(d) = device_times {
        report.stages.extend([
            ("gpu_start", d.start),
            ("gpu_staging", d.stage),
            ("gpu_upload", d.upload),
            ("gpu_kernels", d.compute),
            ("gpu_download", d.download),
        ]);
    }
    for (rel, reason) in &report.quarantined {
        log::warn!(file = rel.as_str(), reason = reason.as_str(); "quarantined {rel}: {reason}");
    }
    if let (Some(record), Some(shared)) = (record, shared) {
        write_shard_records(settings, record, shared)?;
    }
    Ok((report, close_start, status_report))
}

/// The label ids: the configured names, those the old manifest appended, then folders appended
/// under `labels.unknown = "append"` in path order (over the whole tree, so that every shard
/// numbers them alike).
fn label_ids(settings: &Settings, found: &Listing, appended_before: &[String]) -> LabelSet {
    let mut labels = LabelSet::new(
        &settings.labels.names,
        appended_before,
        settings.labels.unknown,
    );
    for f in found.iter() {
        if let Some(folder) = crate::identity::label_folder(settings, f.rel()) {
            let _ = labels.resolve(folder);
        }
    }
    labels
}

/// Feed the engine `found` in path order, `batch` files at a time, and wait until every batch
/// is durable; rows and quarantined files into `report`.
fn ingest(
    engine: &mut Engine,
    found: &Listing,
    batch: usize,
    ui: &Ui,
    report: &mut RebuildReport,
) -> anyhow::Result<()> {
    let bar = progress_bar(ui.progress, found.len() as u64);
    let record = |done: Vec<crate::engine::Done>, report: &mut RebuildReport| {
        for d in done {
            report.rows = d.rows;
            report
                .quarantined
                .extend(d.quarantined.into_iter().map(|(p, r)| (p, r.to_string())));
        }
    };
    for first in (0..found.len()).step_by(batch) {
        let names = first..(first + batch).min(found.len());
        let n = names.len();
        let inputs = names
            .map(|i| match found.get(i) {
                Item::Recording(rel) => Input::Load {
                    rel: rel.to_string(),
                    seen: None,
                },
                Item::Rejected { rel, reason } => Input::Observe(Observation::Rejected {
                    rel: rel.to_string(),
                    reason: reason.clone(),
                    size: 0,
                    mtime_ns: 0,
                }),
            })
            .collect();
        engine.submit(inputs)?;
        record(engine.completed()?, report);
        if let Some(b) = &bar {
            b.inc(n as u64);
        }
    }
    record(engine.wait()?, report);
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(())
}

/// Per split, the contents of the shard's rows that several of its paths hold (every path
/// with its label folder), for `merge` to list label conflicts as one rebuild would.
fn shared_by_split(
    manifest: &Manifest,
    settings: &Settings,
) -> anyhow::Result<[Vec<SharedContent>; 3]> {
    let mut out: [Vec<SharedContent>; 3] = Default::default();
    for item in manifest.shared_contents() {
        let (hash, c) = item?;
        let Some(row) = c.row else { continue };
        out[row.split as usize].push(SharedContent {
            blake3: crate::identity::hex(&hash),
            paths: c
                .paths
                .iter()
                .map(|p| {
                    let folder = crate::identity::label_folder(settings, p).unwrap_or("");
                    (p.clone(), folder.to_string())
                })
                .collect(),
        });
    }
    Ok(out)
}

/// Write `record` (with each split's shared contents) into the staged HDF5 files as the
/// attribute [`crate::shard::ATTRIBUTE`], before they are swapped in.
fn write_shard_records(
    settings: &Settings,
    mut record: ShardRecord,
    shared: [Vec<SharedContent>; 3],
) -> anyhow::Result<()> {
    use anyhow::Context;
    let stage = staging::output_staging(settings);
    for (split, contents) in shared.into_iter().enumerate() {
        let path = crate::output::hdf5_path(&stage, &settings.outputs.hdf5_names, split);
        record.shared = contents;
        let json: hdf5::types::VarLenUnicode = serde_json::to_string(&record)?
            .parse()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let write = || -> anyhow::Result<()> {
            let fapl = hdf5::file::FileAccess::build()
                .libver_bounds(
                    hdf5::file::LibraryVersion::V110,
                    hdf5::file::LibraryVersion::V110,
                )
                .finish()?;
            let file = hdf5::File::with_options().set_fapl(&fapl)?.open_rw(&path)?;
            file.new_attr::<hdf5::types::VarLenUnicode>()
                .create(crate::shard::ATTRIBUTE)?
                .write_scalar(&json)?;
            file.close()?;
            std::fs::File::open(&path)?.sync_all()?;
            Ok(())
        };
        write().with_context(|| format!("{}: recording the shard", path.display()))?;
    }
    Ok(())
}

/// Valid rows per label id, and paths that share another path's row.
fn rows_per_label(manifest: &Manifest, labels: usize) -> anyhow::Result<(Vec<u64>, usize)> {
    let mut out = vec![0u64; labels];
    let mut duplicates = 0;
    for item in manifest.contents() {
        let (_, c) = item?;
        duplicates += c.paths.len().saturating_sub(1);
        if c.valid {
            if let Some(n) = out.get_mut(c.label as usize) {
                *n += 1;
            }
        }
    }
    Ok((out, duplicates))
}

fn progress_bar(enabled: bool, len: u64) -> Option<indicatif::ProgressBar> {
    if !enabled {
        return None;
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} files {per_sec} ETA {eta}",
        )
        .unwrap(),
    );
    Some(bar)
}

/// Human summary of a rebuild (stdout of `rebuild` and `demo`).
pub fn summary(settings: &Settings, r: &RebuildReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let total_rows: u64 = r.rows.iter().sum();
    let _ = writeln!(
        s,
        "rebuilt {} recordings -> {} rows in {:.2} s ({:.0} files/s) on {}",
        r.files,
        total_rows,
        r.elapsed.as_secs_f64(),
        r.files_per_sec(),
        r.device
    );
    if let Some(shard) = &r.shard {
        let _ = writeln!(
            s,
            "  shard {shard}: {} other files left to the other shards",
            r.other_shards
        );
    }
    let _ = writeln!(s, "  duplicates (same bytes, one row): {}", r.duplicates);
    for (split, name) in SPLITS.iter().enumerate() {
        let mut where_ = Vec::new();
        if settings.outputs.hdf5 {
            where_.push(
                crate::output::hdf5_path(
                    &settings.paths.output,
                    &settings.outputs.hdf5_names,
                    split,
                )
                .display()
                .to_string(),
            );
        }
        if settings.outputs.npy {
            where_.push(
                crate::output::npy_dir(&settings.paths.output, split)
                    .display()
                    .to_string()
                    + "/",
            );
        }
        let _ = writeln!(
            s,
            "  {name:<10} {:>7} rows  {}",
            r.rows[split],
            where_.join("  ")
        );
    }
    let _ = writeln!(s, "  rows per label:");
    for (i, l) in r.labels.iter().enumerate() {
        let _ = writeln!(
            s,
            "    {i:>2} {l:<14} {}",
            r.rows_per_label.get(i).copied().unwrap_or(0)
        );
    }
    let _ = writeln!(s, "  quarantined: {}", r.quarantined.len());
    for (rel, reason) in r.quarantined.iter().take(20) {
        let _ = writeln!(s, "    {rel}: {reason}");
    }
    if r.quarantined.len() > 20 {
        let _ = writeln!(
            s,
            "    ... and {} more (ailhd status)",
            r.quarantined.len() - 20
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::UnknownLabel;

    /// A rebuild whose start-up fails (here its featuriser, as `--device cuda` does on a host
    /// without CUDA) leaves the outputs it had and no staging outputs behind.
    #[test]
    fn a_failed_start_up_leaves_no_staging_and_the_old_outputs() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        crate::synth::write_tree(&s.paths.recordings, &["LEAK"], 3, 1).unwrap();
        let ui = Ui { progress: false };
        let first = rebuild(&s, DeviceChoice::Cpu, &ui).unwrap();
        let h5 = s.paths.output.join(&s.outputs.hdf5_names.training);
        let before = std::fs::read(&h5).unwrap();
        let err = rebuild_with(&s, &ui, Scope::default(), |_| {
            anyhow::bail!("no featuriser here")
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("no featuriser here"), "{err:#}");
        for p in [staging::output_staging(&s), staging::manifest_staging(&s)] {
            assert!(!p.exists(), "{} left behind", p.display());
        }
        assert_eq!(
            std::fs::read(&h5).unwrap(),
            before,
            "the old outputs changed"
        );
        assert!(first.files > 0);
    }

    /// The labels in an npy output's `attributes.json`.
    fn npy_labels(s: &Settings, split: usize) -> Vec<String> {
        let attrs = crate::output::npy_dir(&s.paths.output, split).join("attributes.json");
        let attrs: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(attrs).unwrap()).unwrap();
        serde_json::from_str(attrs["labels_json"].as_str().unwrap()).unwrap()
    }

    /// Under `labels.unknown = "append"`, a label folder gets the next id, in path order, and
    /// keeps it in later rebuilds, even once its folder is gone (ids are never renumbered). The
    /// staging outputs are made with the configured labels while the old manifest is read:
    /// the appended ones must reach them (and the manifest) all the same.
    #[test]
    fn appended_labels_keep_their_ids_across_rebuilds() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Settings::in_folder(dir.path());
        s.labels.unknown = UnknownLabel::Append;
        s.outputs.npy = true;
        let rec = &s.paths.recordings;
        crate::synth::write_tree(rec, &["LEAK", "VALVE"], 2, 1).unwrap();
        crate::synth::write_tree(rec, &["PUMP"], 2, 2).unwrap();
        let ui = Ui { progress: false };
        let configured = s.labels.names.clone();
        let with = |extra: &[&str]| -> Vec<String> {
            let mut l = configured.clone();
            l.extend(extra.iter().map(|x| x.to_string()));
            l
        };

        let first = rebuild(&s, DeviceChoice::Cpu, &ui).unwrap();
        assert_eq!(first.labels, with(&["PUMP", "VALVE"]));
        std::fs::remove_dir_all(rec.join("PUMP")).unwrap();
        crate::synth::write_tree(rec, &["DRIP"], 2, 3).unwrap();
        let second = rebuild(&s, DeviceChoice::Cpu, &ui).unwrap();
        let want = with(&["PUMP", "VALVE", "DRIP"]);
        assert_eq!(second.labels, want);
        for split in 0..3 {
            assert_eq!(npy_labels(&s, split), want, "split {split}");
        }
        let manifest = Manifest::open(&staging::manifest_dir(&s)).unwrap();
        assert_eq!(
            manifest.appended_labels().unwrap(),
            ["PUMP", "VALVE", "DRIP"]
        );
        // Rows carry the kept ids: VALVE's are 6 in both runs.
        let valve = want.iter().position(|l| l == "VALVE").unwrap();
        assert_eq!(first.rows_per_label[valve], 2);
        assert_eq!(second.rows_per_label[valve], 2);
        assert_eq!(second.rows_per_label[configured.len()], 0, "PUMP is gone");
    }
}
