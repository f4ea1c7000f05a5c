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
use crate::shard::Shard;
use crate::source::{self, Found};
use crate::staging;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, serde::Serialize)]
pub struct RebuildReport {
    pub files: usize,
    pub rows: [u64; 3],
    pub duplicates: usize,
    pub quarantined: Vec<(String, String)>,
    pub device: String,
    pub elapsed: Duration,
    /// Thread-seconds per stage (summed over the threads that run it).
    pub stages: Vec<(&'static str, f64)>,
    /// Wall-clock seconds of the run's phases: start (lock, scan, featuriser, staging
    /// outputs), ingest (first batch submitted to last batch durable), close (outputs and
    /// manifest closed and synced), swap.
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

pub struct Ui {
    pub progress: bool,
}

pub fn rebuild(
    settings: &Settings,
    device: DeviceChoice,
    ui: &Ui,
) -> anyhow::Result<RebuildReport> {
    rebuild_shard(settings, device, ui, Shard::ALL)
}

/// `rebuild --shard I/N`: only the recordings that shard I of N owns (by content hash, see
/// [`crate::shard`]), as an ordinary set of outputs. Files of other shards are hashed and
/// skipped before decoding; files without a hash (unreadable, rejected paths) go to shard 0.
pub fn rebuild_shard(
    settings: &Settings,
    device: DeviceChoice,
    ui: &Ui,
    shard: Shard,
) -> anyhow::Result<RebuildReport> {
    let started = Instant::now();
    let _lock = WriterLocks::acquire(settings, "rebuild")?;
    staging::finish_pending(settings)?;
    staging::prepare(settings)?;

    // Appended labels keep their ids across rebuilds. Opening the old manifest (tens of ms:
    // sled recovers its log) runs while the tree is scanned and the featuriser is built.
    let old_manifest = staging::manifest_dir(settings);
    let appended_before = std::thread::spawn(move || -> anyhow::Result<Vec<String>> {
        Ok(if old_manifest.exists() {
            Manifest::open(&old_manifest)?.appended_labels()?
        } else {
            Vec::new()
        })
    });
    // Building a GPU featuriser (context, NVRTC, plans, self-check) takes a good part of a
    // second: it runs while the tree is scanned.
    let threads = settings.worker_threads();
    let featuriser_start = {
        let features = settings.features.clone();
        std::thread::spawn(move || features::build(&features, device, threads))
    };
    let found = source::scan(&settings.paths.recordings)?;
    let appended_before = appended_before
        .join()
        .expect("reading the old manifest panicked")?;
    let mut labels = LabelSet::new(
        &settings.labels.names,
        &appended_before,
        settings.labels.unknown,
    );
    // Folders appended under `labels.unknown = "append"` get ids in path order.
    for f in &found {
        if let Some(folder) = crate::identity::label_folder(settings, f.rel()) {
            let _ = labels.resolve(folder);
        }
    }
    let featuriser = featuriser_start
        .join()
        .expect("featuriser start-up panicked")?;
    let batch = featuriser.bulk_batch().max(1);
    log::info!(
        "rebuild: {} recordings under {}, featurising on {}",
        found.len(),
        settings.paths.recordings.display(),
        featuriser.name()
    );
    let mut engine = Engine::open_bulk(
        settings,
        featuriser,
        &staging::output_staging(settings),
        &staging::manifest_staging(settings),
        labels,
    )?;
    engine.set_shard(shard);
    let bar = progress_bar(ui.progress, found.len() as u64);
    let ingest_start = Instant::now();
    let mut report = RebuildReport {
        files: found.len(),
        rows: [0; 3],
        duplicates: 0,
        quarantined: Vec::new(),
        device: engine.device().to_string(),
        elapsed: Duration::ZERO,
        stages: Vec::new(),
        phases: Vec::new(),
        labels: engine.labels().to_vec(),
        rows_per_label: Vec::new(),
        shard: (!shard.is_all()).then(|| shard.to_string()),
        other_shards: 0,
    };
    let record = |done: Vec<crate::engine::Done>, report: &mut RebuildReport| {
        for d in done {
            report.rows = d.rows;
            report.other_shards += d.other_shards;
            report
                .quarantined
                .extend(d.quarantined.into_iter().map(|(p, r)| (p, r.to_string())));
        }
    };
    for names in found.chunks(batch) {
        let inputs = names
            .iter()
            .map(|f| match f {
                Found::Recording(rel) => Input::Load {
                    rel: rel.clone(),
                    seen: None,
                },
                Found::Rejected { rel, reason } => Input::Observe(Observation::Rejected {
                    rel: rel.clone(),
                    reason: reason.clone(),
                    size: 0,
                    mtime_ns: 0,
                }),
            })
            .collect();
        engine.submit(inputs)?;
        record(engine.completed()?, &mut report);
        if let Some(b) = &bar {
            b.inc(names.len() as u64);
        }
    }
    record(engine.wait()?, &mut report);
    report.files -= report.other_shards;
    report.labels = engine.labels().to_vec();
    (report.rows_per_label, report.duplicates) =
        rows_per_label(engine.manifest(), report.labels.len())?;
    engine
        .manifest()
        .set_meta("rebuilt_at_ms", &now_ms().to_string())?;
    let stage_times = engine.times().seconds();
    let close_start = Instant::now();
    let device_times = engine.finish()?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    for (rel, reason) in &report.quarantined {
        log::warn!(file = rel.as_str(), reason = reason.as_str(); "quarantined {rel}: {reason}");
    }
    let swap_start = Instant::now();
    staging::swap_in(settings)?;
    report.elapsed = started.elapsed();
    report.phases = vec![
        ("start", (ingest_start - started).as_secs_f64()),
        ("ingest", (close_start - ingest_start).as_secs_f64()),
        ("close", (swap_start - close_start).as_secs_f64()),
        ("swap", swap_start.elapsed().as_secs_f64()),
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
    Ok(report)
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
