//! `ailhd rebuild`: every output regenerated from the recording tree in one bulk run.
//! Files are taken in path order, in chunks: a parallel stage reads, hashes and decodes a chunk;
//! duplicates and placements are settled in order; the featuriser turns the chunk into rows;
//! a writer thread appends them while the next chunk is prepared. The result is swapped in
//! only when complete (see [`crate::staging`]).

use crate::config::{DeviceChoice, Settings, SplitMode, SPLITS};
use crate::features::{self, Featuriser};
use crate::identity::{self, Hash, LabelSet};
use crate::lock::WriterLocks;
use crate::manifest::{now_ms, ContentRecord, FileRecord, FileState, Manifest, ManifestBatch};
use crate::output::set::OutputSet;
use crate::output::{OutputHeader, RowMeta};
use crate::pipeline::{self, StageTimes};
use crate::staging;
use anyhow::{ensure, Context};
use half::f16;
use rayon::prelude::*;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

/// Files per chunk: large enough to fill every core and the GPU, small enough to bound memory
/// (a chunk holds its waveforms and rows: about 0.1 MB per file), and small enough that the
/// allocator reuses the same memory chunk after chunk instead of faulting in fresh pages.
const CHUNK: usize = 512;

#[derive(Debug, Clone, serde::Serialize)]
pub struct RebuildReport {
    pub files: usize,
    pub rows: [u64; 3],
    pub duplicates: usize,
    pub quarantined: Vec<(String, String)>,
    pub device: String,
    pub elapsed: Duration,
    pub stages: Vec<(&'static str, f64)>,
    pub labels: Vec<String>,
    pub rows_per_label: Vec<u64>,
}

impl RebuildReport {
    pub fn files_per_sec(&self) -> f64 {
        self.files as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// The `.wav` files under `root`, relative, `/`-separated, sorted. Paths that are not UTF-8
/// are returned separately (they are quarantined: the outputs store UTF-8).
pub fn scan(root: &Path) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    anyhow::ensure!(
        root.is_dir(),
        "paths.recordings = {} is not a folder (set it in the configuration)",
        root.display()
    );
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for entry in walkdir::WalkDir::new(root).follow_links(false) {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                log::warn!("scanning {}: {e}", root.display());
                continue;
            }
        };
        if !entry.file_type().is_file() || !is_wav_name(entry.file_name().as_encoded_bytes()) {
            continue;
        }
        let rel = entry.path().strip_prefix(root).unwrap_or(entry.path());
        match identity::rel_string(rel) {
            Ok(s) => good.push(s),
            Err(_) => bad.push(rel.to_string_lossy().to_string()),
        }
    }
    good.sort_unstable();
    Ok((good, bad))
}

pub fn is_wav_name(name: &[u8]) -> bool {
    name.len() > 4 && name[name.len() - 4..].eq_ignore_ascii_case(b".wav")
}

/// The label folder of a relative path, if it has one.
fn label_folder<'a>(settings: &Settings, rel: &'a str) -> Option<&'a str> {
    let parts: Vec<&str> = rel.split('/').collect();
    match settings.splits.mode {
        SplitMode::Hash if parts.len() >= 2 => Some(parts[0]),
        SplitMode::Directory if parts.len() >= 3 => Some(parts[1]),
        _ => None,
    }
}

/// One chunk's work for the writer, in path order.
struct Chunk {
    /// Rows to append per split, with their metadata, and their mel values in the same order.
    new_rows: [Vec<(RowMeta, FileRecord)>; 3],
    mel: [Vec<f16>; 3],
    waveform: [Vec<f32>; 3],
    /// The decoded recordings of `new_rows`, until the featuriser has turned them into `mel`.
    waves: [Vec<crate::decode::Waveform>; 3],
    /// Files whose bytes were seen earlier: they share the first one's row.
    duplicates: Vec<(String, Hash, FileRecord)>,
    quarantined: Vec<(String, FileRecord)>,
}

pub struct Ui {
    pub progress: bool,
}

pub fn rebuild(
    settings: &Settings,
    device: DeviceChoice,
    ui: &Ui,
) -> anyhow::Result<RebuildReport> {
    let started = Instant::now();
    let _lock = WriterLocks::acquire(settings, "rebuild")?;
    staging::finish_pending(settings)?;
    staging::prepare(settings)?;

    // Appended labels keep their ids across rebuilds.
    let old_manifest = staging::manifest_dir(settings);
    let appended_before = if old_manifest.exists() {
        Manifest::open(&old_manifest)?.appended_labels()?
    } else {
        Vec::new()
    };
    // Building a GPU featuriser (context, NVRTC, plans, self-check) takes a good part of a
    // second: it runs while the tree is scanned and the first chunk is read.
    let threads = settings.worker_threads();
    let featuriser_start = {
        let features = settings.features.clone();
        std::thread::spawn(move || features::build(&features, device, threads))
    };
    let (files, not_utf8) = scan(&settings.paths.recordings)?;
    let mut labels = LabelSet::new(
        &settings.labels.names,
        &appended_before,
        settings.labels.unknown,
    );
    for rel in &files {
        if let Some(folder) = label_folder(settings, rel) {
            let _ = labels.resolve(folder);
        }
    }
    let appended: Vec<String> = labels.names[settings.labels.names.len()..].to_vec();

    let mut featuriser = featuriser_start
        .join()
        .expect("featuriser start-up panicked")?;
    log::info!(
        "rebuild: {} recordings under {}, featurising on {}",
        files.len(),
        settings.paths.recordings.display(),
        featuriser.name()
    );
    let header = OutputHeader {
        labels: labels.names.clone(),
        features: settings.features.clone(),
        path_bytes: settings.outputs.path_bytes,
    };
    let stage_dir = staging::output_staging(settings);
    let outputs = OutputSet::create(&stage_dir, &settings.outputs, &header, false)?;
    let manifest = Manifest::open(&staging::manifest_staging(settings))?;
    manifest.set_meta("feature_fingerprint", &settings.features.fingerprint())?;
    manifest.set_meta("appended_labels", &serde_json::to_string(&appended)?)?;

    let times = StageTimes::default();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("cannot start worker threads")?;
    let bar = progress_bar(ui.progress, files.len() as u64);

    let mut report = RebuildReport {
        files: files.len() + not_utf8.len(),
        rows: [0; 3],
        duplicates: 0,
        quarantined: Vec::new(),
        device: featuriser.name(),
        elapsed: Duration::ZERO,
        stages: Vec::new(),
        labels: labels.names.clone(),
        rows_per_label: vec![0; labels.names.len()],
    };
    for rel in &not_utf8 {
        report
            .quarantined
            .push((rel.clone(), "path is not valid UTF-8".into()));
    }

    // Three stages at once, with a chunk in flight between each: read/hash/decode on the pool
    // (this thread), featurise (its own thread), write (its own thread).
    let (tx, rx) = crossbeam_channel::bounded::<Chunk>(1);
    let (featurised_tx, featurised_rx) = crossbeam_channel::bounded::<Chunk>(1);
    let shape = featuriser.shape();
    let writer_result = std::thread::scope(|scope| {
        let times_ref = &times;
        let manifest_ref = &manifest;
        let writer =
            scope.spawn(move || write_chunks(featurised_rx, outputs, manifest_ref, times_ref));
        let featurising = scope.spawn(move || -> anyhow::Result<_> {
            for mut chunk in rx {
                featurise_chunk(&mut chunk, featuriser.as_mut(), settings, times_ref)?;
                if featurised_tx.send(chunk).is_err() {
                    break; // the writer failed; its error is reported below
                }
            }
            Ok(featuriser.device_times())
        });

        let mut seen: HashSet<Hash> = HashSet::new();
        let mut produce = || -> anyhow::Result<()> {
            for names in files.chunks(CHUNK) {
                let chunk = prepare_chunk(
                    settings,
                    names,
                    &mut labels,
                    &mut seen,
                    &shape,
                    &pool,
                    &times,
                )?;
                if tx.send(chunk).is_err() {
                    break; // a later stage failed; its error is reported below
                }
                if let Some(b) = &bar {
                    b.inc(names.len() as u64);
                }
            }
            Ok(())
        };
        let produced = produce();
        drop(tx);
        let featurised = featurising.join().expect("featuriser thread panicked");
        let written = writer.join().expect("writer thread panicked");
        // The first failure in pipeline order is the cause; later ones are its echoes.
        produced.and_then(|()| Ok((featurised?, written?)))
    });
    let (device_times, (rows, dups, quarantined, per_label)) = writer_result?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    report.rows = rows;
    report.duplicates = dups;
    report.quarantined.extend(quarantined);
    for (l, n) in per_label {
        if let Some(slot) = report.rows_per_label.get_mut(l as usize) {
            *slot += n;
        }
    }
    for (rel, reason) in &report.quarantined {
        log::warn!("quarantined {rel}: {reason}");
    }
    // Non-UTF-8 paths are recorded too, so `status` lists them.
    let mut batch = ManifestBatch::default();
    for rel in &not_utf8 {
        batch.put_file(
            rel,
            &FileRecord::quarantined(None, 0, 0, "path is not valid UTF-8"),
        );
    }
    manifest.apply(batch)?;
    manifest.set_meta("rebuilt_at_ms", &now_ms().to_string())?;
    manifest.flush()?;
    drop(manifest);
    staging::swap_in(settings)?;
    report.elapsed = started.elapsed();
    report.stages = times.seconds();
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

#[allow(clippy::too_many_arguments)]
fn prepare_chunk(
    settings: &Settings,
    names: &[String],
    labels: &mut LabelSet,
    seen: &mut HashSet<Hash>,
    shape: &crate::config::FeatureShape,
    pool: &rayon::ThreadPool,
    times: &StageTimes,
) -> anyhow::Result<Chunk> {
    let root = &settings.paths.recordings;
    let prepared: Vec<pipeline::Prepared> = pool.install(|| {
        names
            .par_iter()
            .map(|rel| pipeline::prepare(root, rel, &settings.features, shape, times))
            .collect()
    });

    let mut chunk = Chunk {
        new_rows: Default::default(),
        mel: Default::default(),
        waveform: Default::default(),
        waves: Default::default(),
        duplicates: Vec::new(),
        quarantined: Vec::new(),
    };
    for p in prepared {
        let Some(hash) = p.hash else {
            if p.vanished {
                continue; // deleted while we were scanning: nothing to ingest
            }
            let reason = p.decoded.as_ref().err().cloned().unwrap_or_default();
            chunk
                .quarantined
                .push((p.rel.clone(), FileRecord::quarantined(None, 0, 0, &reason)));
            continue;
        };
        let base = FileRecord {
            hash: Some(identity::hex(&hash)),
            size: p.size,
            mtime_ns: p.mtime_ns,
            label: None,
            split: None,
            row: None,
            state: FileState::Committed,
            reason: None,
            updated_ms: now_ms(),
        };
        let waveform = match p.decoded {
            Ok(w) => w,
            Err(reason) => {
                chunk.quarantined.push((
                    p.rel.clone(),
                    FileRecord::quarantined(Some(&hash), p.size, p.mtime_ns, &reason),
                ));
                continue;
            }
        };
        let placement = match identity::place(settings, labels, &p.rel, &hash) {
            Ok(pl) => pl,
            Err(e) => {
                let reason = e.to_string();
                chunk.quarantined.push((
                    p.rel.clone(),
                    FileRecord::quarantined(Some(&hash), p.size, p.mtime_ns, &reason),
                ));
                continue;
            }
        };
        if !seen.insert(hash) {
            chunk.duplicates.push((p.rel.clone(), hash, base));
            continue;
        }
        let meta = pipeline::row_meta(&p.rel, &hash, placement.label);
        let rec = FileRecord {
            label: Some(placement.label),
            split: Some(placement.split as u8),
            ..base
        };
        chunk.new_rows[placement.split].push((meta, rec));
        chunk.waves[placement.split].push(waveform);
    }
    Ok(chunk)
}

/// The featuriser's stage: rows for a chunk's decoded recordings, on its own thread, so that
/// reading the next chunk and writing the previous one go on meanwhile.
fn featurise_chunk(
    chunk: &mut Chunk,
    featuriser: &mut dyn Featuriser,
    settings: &Settings,
    times: &StageTimes,
) -> anyhow::Result<()> {
    let t = Instant::now();
    for split in 0..3 {
        let waves = std::mem::take(&mut chunk.waves[split]);
        if waves.is_empty() {
            continue;
        }
        let batch: Vec<&crate::decode::Waveform> = waves.iter().collect();
        let (mel, waveform) = pipeline::featurise_rows(featuriser, &batch, &settings.features)?;
        chunk.mel[split] = mel;
        chunk.waveform[split] = waveform.unwrap_or_default();
    }
    StageTimes::add(&times.featurise, t);
    Ok(())
}

type WriterOutcome = ([u64; 3], usize, Vec<(String, String)>, HashMap<i16, u64>);

fn write_chunks(
    rx: crossbeam_channel::Receiver<Chunk>,
    mut outputs: OutputSet,
    manifest: &Manifest,
    times: &StageTimes,
) -> anyhow::Result<WriterOutcome> {
    let mut rows_of: HashMap<Hash, ContentRecord> = HashMap::new();
    let mut dups = 0;
    let mut quarantined = Vec::new();
    let mut per_label: HashMap<i16, u64> = HashMap::new();
    for chunk in rx {
        // Row numbers are known before the append (the outputs' length), so the manifest's
        // records of a chunk are written on a second thread while the outputs take its rows.
        let mut batch = ManifestBatch::default();
        for split in 0..3 {
            let first = outputs.len(split);
            for (i, (meta, rec)) in chunk.new_rows[split].iter().enumerate() {
                let row = first + i as u64;
                let content = ContentRecord {
                    split: split as u8,
                    row,
                    label: meta.label,
                    valid: true,
                    refs: 1,
                };
                batch.put_content(&meta.blake3, &content);
                rows_of.insert(meta.blake3, content);
                batch.put_file(
                    &meta.source_path,
                    &FileRecord {
                        row: Some(row),
                        ..rec.clone()
                    },
                );
                *per_label.entry(meta.label).or_default() += 1;
            }
        }
        for (rel, hash, rec) in &chunk.duplicates {
            let c = rows_of
                .get_mut(hash)
                .expect("a duplicate follows its first copy");
            c.refs += 1;
            batch.put_content(hash, c);
            dups += 1;
            batch.put_file(
                rel,
                &FileRecord {
                    label: Some(c.label),
                    split: Some(c.split),
                    row: Some(c.row),
                    ..rec.clone()
                },
            );
        }
        for (rel, rec) in &chunk.quarantined {
            quarantined.push((rel.clone(), rec.reason.clone().unwrap_or_default()));
            batch.put_file(rel, rec);
        }
        std::thread::scope(|scope| -> anyhow::Result<()> {
            let recorded = scope.spawn(|| {
                let t = Instant::now();
                let r = manifest.apply(batch);
                StageTimes::add(&times.manifest, t);
                r
            });
            let t = Instant::now();
            for (split, (rows, name)) in chunk.new_rows.iter().zip(SPLITS).enumerate() {
                if rows.is_empty() {
                    continue;
                }
                let metas: Vec<RowMeta> = rows.iter().map(|(m, _)| m.clone()).collect();
                let waveform =
                    (!chunk.waveform[split].is_empty()).then_some(&chunk.waveform[split][..]);
                let expected = outputs.len(split);
                let first = outputs.append(split, &chunk.mel[split], waveform, &metas)?;
                ensure!(
                    first == expected,
                    "the {name} outputs appended at row {first}, the manifest recorded {expected}"
                );
            }
            StageTimes::add(&times.write, t);
            recorded.join().expect("manifest writer panicked")?;
            Ok(())
        })?;
    }
    let t = Instant::now();
    outputs.commit()?;
    let rows = [outputs.len(0), outputs.len(1), outputs.len(2)];
    outputs.close()?;
    StageTimes::add(&times.write, t);
    Ok((rows, dups, quarantined, per_label))
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
