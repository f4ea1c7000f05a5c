//! `ailhd merge DIR... --into OUT`: one set of outputs over several (the shards of a sharded
//! rebuild, or the outputs of several acquisition hosts), without copying features (docs/scale-out.md).
//!
//! Per split, OUT holds an HDF5 file of the usual name whose row datasets are HDF5 virtual
//! datasets (VDS, HDF5 1.10+): input after input in argument order, each input's committed rows
//! at the time of the merge. Three datasets are small real ones:
//! - `valid`: one valid row per content over all inputs and splits. The first input in argument
//!   order that holds the content as a valid row keeps it; the same content in later inputs gets
//!   `valid` = 0 (so do rows that were not valid in their input).
//! - `labels`: a virtual dataset when every input numbers the labels as the merged list does;
//!   otherwise a real dataset with the ids remapped by name (the merged list is the first input's
//!   list, then names first seen in later inputs, in order).
//! - `committed_rows`: the total.
//!
//! The VDS mappings name hard links of the inputs' files under `OUT/.inputs/` ([`Generation`]),
//! by paths relative to OUT, so a merge is a snapshot that an input rebuilt or removed
//! afterwards leaves as it was, and OUT moves alone; an input on another file system is named in
//! place (relative to OUT; HDF5 resolves such paths against the merged file's folder, or
//! `$HDF5_VDS_PREFIX`), with a warning. OUT also gets `MERGED.json` (what was merged, and the
//! rule), which marks it as a merge that a later `merge` may replace. Rows that inputs commit
//! afterwards appear after the merge is run again.
//!
//! `--npy` also writes `npy/<split>/` as copies of the merged rows (the only copies merge makes).

use crate::config::{FeatureSettings, HdfNames, SPLITS};
use crate::output::hdf5::{create_text_attr, read_text_attr};
use crate::output::npy::NpySink;
use crate::output::read::{read_rows, Id};
use crate::output::{label2id_json, labels_json, OutputHeader, RowMeta, SplitSink};
use crate::output::{ID_BYTES, OUTPUT_SCHEMA_VERSION};
use crate::ownership;
use crate::shard::ShardRecord;
use anyhow::{bail, Context, Result};
use hdf5::dataset::Layout;
use hdf5::file::{FileAccess, LibraryVersion, OpenMode};
use hdf5::plist::DatasetCreate;
use hdf5::types::TypeDescriptor;
use hdf5::{Dataset, File, Hyperslab, Selection, SliceOrIndex};
use hdf5_sys::h5d::H5Dget_type;
use hdf5_sys::h5p::H5P_DEFAULT;
use hdf5_sys::h5t::H5Tclose;
use std::ffi::c_void;
use std::path::{Component, Path, PathBuf};

/// The marker and provenance file of a merged folder.
pub const MARKER: &str = "MERGED.json";

/// The inputs cannot be merged (exit 2): what differs, in which file.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

fn refuse(msg: impl Into<String>) -> anyhow::Error {
    Refused(msg.into()).into()
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct MergeReport {
    pub into: PathBuf,
    pub inputs: Vec<InputReport>,
    pub splits: Vec<SplitReport>,
    pub labels: Vec<String>,
    /// Which rule settled shared bytes (see [`crate::ownership`]), in words.
    pub rule: String,
    /// What the merge noticed and went on with.
    pub warnings: Vec<String>,
    /// Valid rows of the inputs set to `valid` = 0 because another row keeps their bytes.
    pub duplicates: u64,
    /// Contents whose paths have different labels (the first 10 in words, then all, as
    /// `status` lists them).
    pub label_conflicts: u64,
    pub label_conflict_examples: Vec<String>,
    pub label_conflict_list: Vec<crate::status::LabelConflict>,
    /// Which row keeps shared bytes, in a few words (the summary's).
    #[serde(skip)]
    pub keeper: &'static str,
    /// Bytes of the merged HDF5 files (the features stay in the inputs).
    pub hdf5_bytes: u64,
    /// Bytes of the `--npy` copies, when asked for.
    pub npy_copy_bytes: Option<u64>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct InputReport {
    pub dir: PathBuf,
    /// Committed rows per split, as merged.
    #[serde(serialize_with = "crate::json::per_split")]
    pub rows: [u64; 3],
    /// Whether this input's label ids were remapped to the merged list.
    pub labels_remapped: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct SplitReport {
    pub split: &'static str,
    pub file: PathBuf,
    pub rows: u64,
    pub valid: u64,
}

/// One input's file for one split, as read for the merge.
struct Source {
    /// The file as read and as the virtual datasets name it (its link: [`Generation`]),
    /// canonical.
    path: PathBuf,
    /// The input's file, as messages name it.
    named: PathBuf,
    committed: u64,
    labels: Vec<String>,
    fingerprint: String,
    config_json: String,
    /// Row datasets: name -> (type, row dims).
    datasets: Vec<(String, TypeDescriptor, Vec<usize>)>,
    blake3: Vec<[u8; 32]>,
    valid: Vec<u8>,
    label_ids: Vec<i16>,
    /// `source_path` of every row, `path_bytes` each.
    paths: Vec<u8>,
    path_bytes: usize,
    /// What the file says it is when it is a shard's ([`crate::shard::ATTRIBUTE`]).
    shard: Option<ShardRecord>,
}

/// Merge the outputs in `inputs` (folders holding the three split files named `names`) into
/// `into`. With `npy`, also write `npy/<split>/` copies.
pub fn merge(names: &HdfNames, inputs: &[PathBuf], into: &Path, npy: bool) -> Result<MergeReport> {
    let dirs = input_dirs(inputs)?;
    let made_into = !into.exists();
    prepare_into(into, &dirs)?;
    let out = into
        .canonicalize()
        .with_context(|| format!("{}: cannot resolve", into.display()))?;
    let lock = crate::lock::WriterLock::acquire(&out, "merge")?;
    let generation = Generation::new(&out);
    let merged = merge_locked(names, &dirs, &out, npy, &generation);
    match &merged {
        Ok(_) => generation.keep(),
        // A refused or failed merge leaves `into` as it found it: absent, or the previous
        // merge whole (its files are replaced only once the new ones are complete).
        Err(_) if made_into => {
            let _ = std::fs::remove_dir_all(&out);
        }
        Err(_) => generation.discard(),
    }
    drop(lock);
    merged
}

/// The inputs' files as the merge read them, hard-linked under `OUT/.inputs/<generation>/<i>/`:
/// the virtual datasets name these links, so a merge is a snapshot (an input rebuilt or
/// removed afterwards leaves it as it was) and OUT holds all it reads. The links cost no space
/// while the inputs keep the same files; an input on another file system (or one this user may
/// not link) is named in place instead, and the merge says so. The newest two generations are
/// kept: the merge's, and the one before for readers that still hold the previous merged files.
struct Generation {
    dir: PathBuf,
}

const INPUT_LINKS: &str = ".inputs";

impl Generation {
    fn new(out: &Path) -> Generation {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        Generation {
            dir: out.join(INPUT_LINKS).join(format!("{nanos:020}")),
        }
    }

    /// `file` (input `i`'s) as the merge reads it: its link, or the file itself when it cannot
    /// be linked (with why).
    fn link(&self, i: usize, file: &Path) -> (PathBuf, Option<std::io::Error>) {
        let (Some(name), true) = (file.file_name(), file.exists()) else {
            return (file.to_path_buf(), None);
        };
        let link = self.dir.join(i.to_string()).join(name);
        let made = std::fs::create_dir_all(link.parent().unwrap_or(&self.dir))
            .and_then(|_| std::fs::hard_link(file, &link));
        match made {
            Ok(()) => (link, None),
            Err(e) => {
                let _ = link.parent().map(std::fs::remove_dir);
                (file.to_path_buf(), Some(e))
            }
        }
    }

    /// The merge succeeded: older generations but the one before go.
    fn keep(&self) {
        let Some(all) = self.dir.parent() else { return };
        let mut names: Vec<_> = std::fs::read_dir(all)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.file_name()))
            .collect();
        names.sort();
        let mine = self.dir.file_name().unwrap_or_default();
        let older: Vec<_> = names.iter().filter(|n| n.as_os_str() < mine).collect();
        for name in older.iter().rev().skip(1) {
            let _ = std::fs::remove_dir_all(all.join(name));
        }
        // Nothing linked (every input on another file system): no generation.
        let _ = std::fs::remove_dir(&self.dir);
        let _ = std::fs::remove_dir(all);
        let _ = sync_dir(all);
    }

    fn discard(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        // The folder of generations too, when this was the first.
        let _ = self.dir.parent().map(std::fs::remove_dir);
    }
}

fn merge_locked(
    names: &HdfNames,
    dirs: &[PathBuf],
    out: &Path,
    npy: bool,
    generation: &Generation,
) -> Result<MergeReport> {
    let out = out.to_path_buf();
    let (sources, unlinked) = read_inputs(names, dirs, generation)?;
    let grouping = ownership::group(&shard_records(dirs, &sources)?).map_err(refuse)?;
    let (labels, ids) = merged_labels(&sources)?;
    let remapped = |i: usize| {
        (0..3).any(|split| {
            sources[i][split]
                .labels
                .iter()
                .enumerate()
                .any(|(k, name)| labels.get(k) != Some(name))
        })
    };
    let settled = {
        let rows: Vec<[ownership::FileRows; 3]> = sources
            .iter()
            .zip(&ids)
            .map(|(files, ids)| [0, 1, 2].map(|split| file_rows(&files[split], &ids[split])))
            .collect();
        ownership::settle(&rows, &grouping, &labels)
    };
    let created = created_at();
    let marker = serde_json::json!({
        "what": "ailhd merge: virtual datasets over the inputs' files; features are not copied",
        "rule": grouping.rule,
        "created_at_utc": created,
        "ailhd_version": env!("CARGO_PKG_VERSION"),
        "inputs": dirs.iter().enumerate().map(|(i, d)| serde_json::json!({
            "dir": relative_path(&out, d),
            "rows": ([0, 1, 2].map(|s| sources[i][s].committed)),
            "labels_remapped": remapped(i),
            "shard": sources[i][0].shard.as_ref().map(|r| r.shard().to_string()),
        })).collect::<Vec<_>>(),
        "npy_copies": npy,
    });
    let keeper = if grouping.one_tree {
        "the smallest path keeps it"
    } else if grouping.by_path.iter().any(|&b| b) {
        "the smallest path within a tree's shards, else the first input keeps it"
    } else {
        "the first input keeps it"
    };
    let mut report = MergeReport {
        into: out.clone(),
        inputs: dirs
            .iter()
            .enumerate()
            .map(|(i, d)| InputReport {
                dir: d.clone(),
                rows: [0, 1, 2].map(|s| sources[i][s].committed),
                labels_remapped: remapped(i),
            })
            .collect(),
        splits: Vec::new(),
        labels: labels.clone(),
        rule: grouping.rule.clone(),
        warnings: grouping.warnings.iter().chain(&unlinked).cloned().collect(),
        duplicates: settled.duplicates,
        label_conflicts: settled.conflicts.len() as u64,
        label_conflict_examples: settled
            .conflicts
            .iter()
            .take(10)
            .map(conflict_line)
            .collect(),
        label_conflict_list: settled.conflicts,
        keeper,
        hdf5_bytes: 0,
        npy_copy_bytes: None,
    };

    let real_labels = (0..sources.len()).any(remapped);
    (report.splits, report.hdf5_bytes) = write_splits(
        names,
        &out,
        &sources,
        &ids,
        &settled.valid,
        real_labels,
        &labels,
        &created,
    )?;
    write_atomically(&out.join(MARKER), &serde_json::to_vec_pretty(&marker)?)?;

    if npy {
        report.npy_copy_bytes = Some(copy_npy(names, &out, &labels, &sources[0][0])?);
    } else if out.join("npy").exists() {
        // A previous merge's copies would no longer match.
        std::fs::remove_dir_all(out.join("npy"))
            .with_context(|| format!("{}: removing old npy copies", out.display()))?;
    }
    Ok(report)
}

/// Write the three merged split files (`valid`: the settled column of each; `real_labels`:
/// whether `labels` must be a real dataset of the remapped `ids`). Returns what was written
/// and its bytes.
#[allow(clippy::too_many_arguments)]
fn write_splits(
    names: &HdfNames,
    out: &Path,
    sources: &[[Source; 3]],
    ids: &[[Vec<i16>; 3]],
    valid: &[Vec<u8>; 3],
    real_labels: bool,
    labels: &[String],
    created: &str,
) -> Result<(Vec<SplitReport>, u64)> {
    let mut splits = Vec::new();
    let mut bytes = 0;
    for split in 0..3 {
        let path = out.join(names.for_split(split));
        let files: Vec<&Source> = sources.iter().map(|f| &f[split]).collect();
        let merged_ids = real_labels.then(|| {
            ids.iter()
                .flat_map(|per_split| per_split[split].iter().copied())
                .collect::<Vec<i16>>()
        });
        write_merged(
            &path,
            out,
            &files,
            &valid[split],
            merged_ids.as_deref(),
            labels,
            created,
        )?;
        bytes += std::fs::metadata(&path)?.len();
        splits.push(SplitReport {
            split: SPLITS[split],
            file: path,
            rows: valid[split].len() as u64,
            valid: valid[split].iter().map(|&v| v as u64).sum(),
        });
    }
    Ok((splits, bytes))
}

/// Every input's files (attributes, committed rows, blake3, valid, labels, paths), checked to
/// fit together, before anything is written.
/// Each file is read through its link in `generation` (the files the merged view will name),
/// with a warning for each that could not be linked.
fn read_inputs(
    names: &HdfNames,
    dirs: &[PathBuf],
    generation: &Generation,
) -> Result<(Vec<[Source; 3]>, Vec<String>)> {
    let mut sources: Vec<[Source; 3]> = Vec::new();
    let mut unlinked = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        let mut why_not = None;
        let files: Vec<Source> = (0..3)
            .map(|split| {
                let file = dir.join(names.for_split(split));
                let (read_from, why) = generation.link(i, &file);
                why_not = why_not.take().or(why);
                read_source(&read_from, &file)
            })
            .collect::<Result<_>>()?;
        if let Some(e) = why_not {
            unlinked.push(format!(
                "{}: its files cannot be linked into the merge ({e}), so the merged files read \
                 them in place: rebuilding or removing that input changes this merge (merge \
                 again after it). Inputs on the file system of --into are linked: a snapshot",
                dir.display()
            ));
        }
        sources.push(files.try_into().map_err(|_| ()).expect("three splits"));
    }
    let first = &sources[0][0];
    for src in sources.iter().flatten() {
        check_compatible(first, src)?;
    }
    Ok((sources, unlinked))
}

/// The input folders, canonical; each given once.
fn input_dirs(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    if inputs.is_empty() {
        return Err(refuse("merge: no input folders given"));
    }
    let mut dirs = Vec::new();
    for dir in inputs {
        let canon = dir
            .canonicalize()
            .map_err(|e| refuse(format!("{}: {e}", dir.display())))?;
        if !canon.is_dir() {
            return Err(refuse(format!("{}: not a folder", dir.display())));
        }
        if dirs.contains(&canon) {
            return Err(refuse(format!(
                "{}: given twice (as {})",
                dir.display(),
                canon.display()
            )));
        }
        dirs.push(canon);
    }
    Ok(dirs)
}

/// Each input's shard record (None: not a shard); its three files must name the same shard.
fn shard_records(
    dirs: &[PathBuf],
    sources: &[[Source; 3]],
) -> Result<Vec<(PathBuf, Option<ShardRecord>)>> {
    let same = |a: &Option<ShardRecord>, b: &Option<ShardRecord>| match (a, b) {
        (Some(a), Some(b)) => (a.shard(), &a.tree) == (b.shard(), &b.tree),
        (a, b) => a.is_none() && b.is_none(),
    };
    dirs.iter()
        .zip(sources)
        .map(|(dir, files)| {
            if let Some(f) = files[1..].iter().find(|f| !same(&f.shard, &files[0].shard)) {
                return Err(refuse(format!(
                    "{} and {} are not of the same shard (one folder must hold one rebuild's \
                     files)",
                    files[0].named.display(),
                    f.named.display()
                )));
            }
            Ok((dir.clone(), files[0].shard.clone()))
        })
        .collect()
}

/// The merged label list (the first input's, then names first seen in later inputs, in
/// order), and every file's label ids in it.
#[allow(clippy::type_complexity)]
fn merged_labels(sources: &[[Source; 3]]) -> Result<(Vec<String>, Vec<[Vec<i16>; 3]>)> {
    let mut labels: Vec<String> = sources[0][0].labels.clone();
    for src in sources.iter().flatten() {
        for name in &src.labels {
            if !labels.contains(name) {
                labels.push(name.clone());
            }
        }
    }
    if labels.len() > i16::MAX as usize {
        return Err(refuse("merge: more than 32767 label names over the inputs"));
    }
    let ids = sources
        .iter()
        .map(|files| {
            files.each_ref().map(|src| {
                let map: Vec<i16> = src
                    .labels
                    .iter()
                    .map(|n| labels.iter().position(|m| m == n).expect("merged") as i16)
                    .collect();
                src.label_ids
                    .iter()
                    .map(|&id| {
                        usize::try_from(id)
                            .ok()
                            .and_then(|k| map.get(k).copied())
                            .unwrap_or(id)
                    })
                    .collect()
            })
        })
        .collect();
    Ok((labels, ids))
}

/// One file's columns as the ownership rule reads them (`ids`: its labels, merged numbering).
fn file_rows<'a>(src: &'a Source, ids: &'a [i16]) -> ownership::FileRows<'a> {
    ownership::FileRows {
        blake3: &src.blake3,
        valid: &src.valid,
        labels: ids,
        paths: &src.paths,
        path_bytes: src.path_bytes,
        shared: src.shard.as_ref().map_or(&[][..], |r| &r.shared[..]),
    }
}

/// A label conflict in `status`'s words.
fn conflict_line(c: &crate::status::LabelConflict) -> String {
    let paths: Vec<String> = c
        .paths
        .iter()
        .map(|p| format!("{} ({})", p.path, p.label))
        .collect();
    format!(
        "same bytes under {} (the first owns the row)",
        paths.join(", ")
    )
}

/// The merged files' `created_at_utc`, as outputs write it.
fn created_at() -> String {
    crate::output::header_attributes(&OutputHeader {
        labels: Vec::new(),
        features: FeatureSettings::default(),
        path_bytes: 0,
    })
    .into_iter()
    .find(|(k, _)| *k == "created_at_utc")
    .map(|(_, v)| v)
    .unwrap_or_default()
}

/// Make sure `into` may receive a merge: absent, empty, or a previous merge (it has
/// [`MARKER`]); not one of the inputs, not inside one.
fn prepare_into(into: &Path, inputs: &[PathBuf]) -> Result<()> {
    // Where `into` is or would be, spelled as the inputs are (they are canonical).
    let canon = crate::config::resolved(into);
    if let Some(d) = inputs.iter().find(|d| canon.starts_with(d)) {
        return Err(refuse(format!(
            "--into {}: is (inside) the input {}; merge into a folder of its own",
            into.display(),
            d.display()
        )));
    }
    if into.exists() {
        let mut entries = std::fs::read_dir(into)
            .with_context(|| format!("--into {}", into.display()))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .filter(|n| n != "ailhd.lock");
        let empty = entries.next().is_none();
        if !empty && !into.join(MARKER).exists() {
            return Err(refuse(format!(
                "--into {}: not empty and not a previous merge (no {MARKER}); refusing to \
                 overwrite it (it may hold real outputs): choose an empty folder",
                into.display()
            )));
        }
    }
    std::fs::create_dir_all(into).with_context(|| format!("creating {}", into.display()))
}

fn file_access() -> Result<FileAccess> {
    Ok(FileAccess::build()
        .libver_bounds(LibraryVersion::V110, LibraryVersion::V110)
        .file_locking(false)
        .finish()?)
}

/// Open an input read-only, without taking a file lock (a writer may be appending to it: then
/// in SWMR mode, which is how HDF5 lets a file open for writing be read).
fn open_input(path: &Path, named: &Path) -> Result<File> {
    if !path.exists() {
        return Err(refuse(format!(
            "{}: no such file; each input must be an ailhd output folder holding the three \
             split files (outputs.hdf5_names)",
            named.display()
        )));
    }
    let fapl = file_access()?;
    match File::with_options().set_fapl(&fapl)?.open(path) {
        Ok(f) => Ok(f),
        Err(plain) => File::with_options()
            .set_fapl(&fapl)?
            .open_as(path, OpenMode::ReadSWMR)
            .map_err(|swmr| {
                refuse(format!(
                    "{}: cannot be opened as HDF5 ({plain}; in SWMR mode: {swmr})",
                    named.display()
                ))
            }),
    }
}

/// Input file `named` (what messages name), read from `path` (its link, or itself).
fn read_source(path: &Path, named: &Path) -> Result<Source> {
    let file = open_input(path, named)?;
    let path = path.canonicalize()?;
    let bad = |what: String| refuse(format!("{}: {what}", named.display()));
    if path.to_str().is_none() {
        // The virtual datasets name their sources by UTF-8 paths.
        return Err(bad("the path is not valid UTF-8".into()));
    }
    check_mergeable(&file, &path, &bad)?;
    let text = |name: &str| read_text_attr(&file, name).map_err(|e| bad(format!("{e:#}")));
    let fingerprint = text("feature_fingerprint")?;
    let config_json = text("config_json")?;
    let labels: Vec<String> = serde_json::from_str(&text("labels_json")?)
        .map_err(|e| bad(format!("labels_json is not a JSON list of names ({e})")))?;
    let committed = source_committed_rows(&file, &bad)?;
    let datasets = source_datasets(&file, committed, &bad)?;
    let raw = |name: &str| -> Result<Vec<u8>> {
        let ds = file.dataset(name)?;
        read_rows(&ds, 0, committed).with_context(|| format!("{}: reading {name}", named.display()))
    };
    let blake3 = raw("blake3")?
        .chunks_exact(32)
        .map(|c| c.try_into().unwrap())
        .collect();
    let valid = raw("valid")?;
    let label_ids = raw("labels")?
        .chunks_exact(2)
        .map(|c| i16::from_le_bytes([c[0], c[1]]))
        .collect();
    let paths = raw("source_path")?;
    let path_bytes = paths.len().checked_div(committed as usize).unwrap_or(0);
    let shard = match read_text_attr(&file, crate::shard::ATTRIBUTE) {
        Err(_) => None,
        Ok(json) => Some(serde_json::from_str::<ShardRecord>(&json).map_err(|e| {
            bad(format!(
                "attribute {} is not a shard record this ailhd reads ({e})",
                crate::shard::ATTRIBUTE
            ))
        })?),
    };
    Ok(Source {
        path,
        named: named.to_path_buf(),
        committed,
        labels,
        fingerprint,
        config_json,
        datasets,
        blake3,
        valid,
        label_ids,
        paths,
        path_bytes,
        shard,
    })
}

/// An input this ailhd merges: an output of this layout version, not itself a merge.
fn check_mergeable(file: &File, path: &Path, bad: &dyn Fn(String) -> anyhow::Error) -> Result<()> {
    let schema = file
        .attr("schema_version")
        .and_then(|a| a.read_scalar::<u32>())
        .map(u64::from)
        .map_err(|e| e.to_string());
    crate::output::check_output_version(path, schema).map_err(|e| refuse(format!("{e:#}")))?;
    if file.attr("merged_from_json").is_ok() {
        return Err(bad(
            "is itself a merge; merge the original outputs instead (a merge of merges would \
             chain virtual datasets)"
                .into(),
        ));
    }
    Ok(())
}

fn source_committed_rows(file: &File, bad: &dyn Fn(String) -> anyhow::Error) -> Result<u64> {
    match file
        .dataset("committed_rows")
        .and_then(|d| d.read_raw::<i64>())
        .map_err(|e| bad(format!("no committed_rows ({e})")))?
        .as_slice()
    {
        [c] if *c >= 0 => Ok(*c as u64),
        other => Err(bad(format!(
            "committed_rows holds {other:?}, not one count"
        ))),
    }
}

/// The row datasets of an input (name, type, row dims), each with at least `committed` rows,
/// the ones every output has among them.
#[allow(clippy::type_complexity)]
fn source_datasets(
    file: &File,
    committed: u64,
    bad: &dyn Fn(String) -> anyhow::Error,
) -> Result<Vec<(String, TypeDescriptor, Vec<usize>)>> {
    let mut datasets = Vec::new();
    for name in file.member_names()? {
        if name == "committed_rows" {
            continue;
        }
        let ds = file
            .dataset(&name)
            .map_err(|e| bad(format!("{name}: {e}")))?;
        let shape = ds.shape();
        if shape.is_empty() || (shape[0] as u64) < committed {
            return Err(bad(format!(
                "dataset {name} has shape {shape:?}, fewer than committed_rows = {committed} rows"
            )));
        }
        datasets.push((name, ds.dtype()?.to_descriptor()?, shape[1..].to_vec()));
    }
    for need in ["blake3", "valid", "labels", "segments_mel", "source_path"] {
        if !datasets.iter().any(|(n, _, _)| n == need) {
            return Err(bad(format!("no dataset {need}: not an ailhd output")));
        }
    }
    Ok(datasets)
}

fn check_compatible(first: &Source, src: &Source) -> Result<()> {
    if src.fingerprint != first.fingerprint {
        return Err(refuse(format!(
            "{} and {} were made with different feature settings (feature_fingerprint {} vs \
             {}; config_json {} vs {}): their rows cannot be merged",
            first.named.display(),
            src.named.display(),
            first.fingerprint,
            src.fingerprint,
            first.config_json,
            src.config_json
        )));
    }
    let names = |s: &Source| s.datasets.iter().map(|d| d.0.clone()).collect::<Vec<_>>();
    if names(src) != names(first) {
        return Err(refuse(format!(
            "{} has datasets {:?}, {} has {:?}: not the same output layout",
            first.named.display(),
            names(first),
            src.named.display(),
            names(src)
        )));
    }
    for (a, b) in first.datasets.iter().zip(&src.datasets) {
        if a != b {
            let hint = if a.0 == "source_path" {
                " (outputs.path_bytes differs: set it alike on every host and rebuild)"
            } else {
                ""
            };
            return Err(refuse(format!(
                "dataset {}: {:?} rows of {:?} in {}, {:?} rows of {:?} in {}{hint}",
                a.0,
                a.1,
                a.2,
                first.named.display(),
                b.1,
                b.2,
                src.named.display()
            )));
        }
    }
    Ok(())
}

/// Write one merged split file: built as `<path>.partial`, renamed into place when complete.
#[allow(clippy::too_many_arguments)]
fn write_merged(
    path: &Path,
    out: &Path,
    files: &[&Source],
    valid: &[u8],
    real_labels: Option<&[i16]>,
    labels: &[String],
    created: &str,
) -> Result<()> {
    let partial = path.with_file_name(format!(
        "{}.partial",
        path.file_name().unwrap_or_default().to_string_lossy()
    ));
    let _ = std::fs::remove_file(&partial);
    let total: u64 = files.iter().map(|f| f.committed).sum();
    let inputs_json: Vec<serde_json::Value> = {
        let mut first_row = 0;
        files
            .iter()
            .map(|f| {
                let v = serde_json::json!({
                    "file": relative_path(out, &f.path),
                    "first_row": first_row,
                    "rows": f.committed,
                });
                first_row += f.committed;
                v
            })
            .collect()
    };
    let build = || -> Result<()> {
        let file = File::with_options()
            .set_fapl(&file_access()?)?
            .create_excl(&partial)
            .with_context(|| format!("{}: creating", partial.display()))?;
        for (name, dtype, row_dims) in &files[0].datasets {
            let mut shape = vec![total as usize];
            shape.extend(row_dims);
            match name.as_str() {
                "valid" => real_dataset(&file, name, dtype, &shape, valid)?,
                "labels" if real_labels.is_some() => {
                    let ids = real_labels.unwrap();
                    real_dataset(&file, name, dtype, &shape, bytemuck::cast_slice(ids))?
                }
                _ => virtual_dataset(&file, name, dtype, &shape, out, files)?,
            }
        }
        let committed = file
            .new_dataset::<i64>()
            .shape(1)
            .layout(Layout::Compact)
            .create("committed_rows")?;
        committed.write(&[total as i64])?;
        let first = files[0];
        let attrs = [
            ("labels_json", labels_json(labels)),
            ("label2id_json", label2id_json(labels)),
            ("config_json", first.config_json.clone()),
            ("created_at_utc", created.to_string()),
            ("ailhd_version", env!("CARGO_PKG_VERSION").to_string()),
            ("feature_fingerprint", first.fingerprint.clone()),
            (
                "merged_from_json",
                serde_json::to_string(&inputs_json).unwrap(),
            ),
        ];
        for (name, value) in attrs {
            create_text_attr(&file, name, &value).with_context(|| format!("attribute {name}"))?;
        }
        file.new_attr::<u32>()
            .create("schema_version")?
            .write_scalar(&OUTPUT_SCHEMA_VERSION)?;
        file.flush()?;
        file.close()?;
        Ok(())
    };
    build().with_context(|| format!("{}: writing the merged file", partial.display()))?;
    std::fs::File::open(&partial)?.sync_all()?;
    std::fs::rename(&partial, path)
        .with_context(|| format!("renaming {} into place", partial.display()))?;
    sync_dir(out)
}

fn real_dataset(
    file: &File,
    name: &str,
    dtype: &TypeDescriptor,
    shape: &[usize],
    bytes: &[u8],
) -> Result<()> {
    let ds = file
        .new_dataset_builder()
        .empty_as(dtype)
        .shape(shape.to_vec())
        .create(name)?;
    if !bytes.is_empty() {
        write_all(&ds, bytes)?;
    }
    Ok(())
}

/// A virtual dataset of `shape` over dataset `name` of every file, row blocks in order.
fn virtual_dataset(
    file: &File,
    name: &str,
    dtype: &TypeDescriptor,
    shape: &[usize],
    out: &Path,
    files: &[&Source],
) -> Result<()> {
    let mut dcpl = DatasetCreate::build();
    dcpl.layout(Layout::Virtual);
    let mut first = 0usize;
    for f in files {
        let rows = f.committed as usize;
        if rows == 0 {
            continue;
        }
        let mut src_shape = vec![rows];
        src_shape.extend(&shape[1..]);
        let rows_of = |start: usize, dims: &[usize]| -> Selection {
            let mut s = vec![SliceOrIndex::SliceTo {
                start,
                step: 1,
                end: start + dims[0],
                block: 1,
            }];
            s.extend(dims[1..].iter().map(|&d| SliceOrIndex::SliceTo {
                start: 0,
                step: 1,
                end: d,
                block: 1,
            }));
            Selection::Hyperslab(Hyperslab::from(s))
        };
        let source = relative_path(out, &f.path);
        // HDF5 reads `%` in a source file name as a printf-style field (`%b`); `%%` is a `%`.
        let source = source.replace('%', "%%");
        dcpl.virtual_map(
            &source,
            name,
            src_shape.clone(),
            rows_of(0, &src_shape),
            shape.to_vec(),
            rows_of(first, &src_shape),
        );
        first += rows;
    }
    let dcpl = dcpl.finish()?;
    file.new_dataset_builder()
        .empty_as(dtype)
        .shape(shape.to_vec())
        .set_dcpl(&dcpl)
        .create(name)
        .with_context(|| format!("creating virtual dataset {name}"))?;
    Ok(())
}

/// `to` relative to the folder `from` (both absolute, canonical), `/`-separated.
fn relative_path(from: &Path, to: &Path) -> String {
    let a: Vec<Component> = from.components().collect();
    let b: Vec<Component> = to.components().collect();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let mut parts: Vec<String> = vec!["..".into(); a.len() - common];
    parts.extend(
        b[common..]
            .iter()
            .map(|c| c.as_os_str().to_string_lossy().into_owned()),
    );
    if parts.is_empty() {
        ".".into()
    } else {
        parts.join("/")
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    crate::durable::replace(path, bytes, crate::durable::Sync::Full)
        .with_context(|| format!("writing {}", path.display()))
}

fn sync_dir(dir: &Path) -> Result<()> {
    crate::durable::sync_dir(dir).with_context(|| format!("syncing {}", dir.display()))
}

/// Copy the merged rows into `npy/<split>/` (through the merged files' virtual datasets).
/// Built beside the old copies and swapped in when complete. Returns the bytes written.
fn copy_npy(names: &HdfNames, out: &Path, labels: &[String], first: &Source) -> Result<u64> {
    let header = npy_header(labels, first)?;
    let building = out.join("npy.partial");
    if building.exists() {
        std::fs::remove_dir_all(&building)?;
    }
    let mut bytes = 0;
    for (split, split_name) in SPLITS.iter().enumerate() {
        let dir = building.join(split_name);
        std::fs::create_dir_all(&building)?;
        let file = File::with_options()
            .set_fapl(&file_access()?)?
            .open(out.join(names.for_split(split)))?;
        copy_split_npy(&file, &dir, &header)?;
        for e in std::fs::read_dir(&dir)? {
            bytes += e?.metadata()?.len();
        }
    }
    swap_in_npy(out, &building)?;
    Ok(bytes)
}

/// The npy copies' header: the inputs' feature settings (read back from their `config_json`,
/// which must give their fingerprint) and `source_path` width.
fn npy_header(labels: &[String], first: &Source) -> Result<OutputHeader> {
    let features: FeatureSettings = serde_json::from_str(&first.config_json).map_err(|e| {
        refuse(format!(
            "--npy: config_json of {} cannot be read by this ailhd ({e}); merge without --npy",
            first.named.display()
        ))
    })?;
    if features.fingerprint() != first.fingerprint {
        return Err(refuse(
            "--npy: the inputs' feature settings were fingerprinted by another ailhd version; \
             merge without --npy",
        ));
    }
    let path_bytes = first
        .datasets
        .iter()
        .find(|d| d.0 == "source_path")
        .map(|d| match d.1 {
            TypeDescriptor::FixedUnicode(n) | TypeDescriptor::FixedAscii(n) => n,
            _ => 0,
        })
        .unwrap_or(0);
    Ok(OutputHeader {
        labels: labels.to_vec(),
        features,
        path_bytes,
    })
}

/// Copy one merged split file's committed rows into a new npy split at `dir`, a block at a
/// time.
fn copy_split_npy(file: &File, dir: &Path, header: &OutputHeader) -> Result<()> {
    let mut sink = NpySink::create(dir, header)?;
    let n = file.dataset("committed_rows")?.read_raw::<i64>()?[0] as u64;
    const BLOCK: u64 = 1024;
    let mut row = 0;
    while row < n {
        let k = BLOCK.min(n - row);
        let block = read_block(file, row, k, header)?;
        let first_row = sink.append(&block.mel, block.waveform.as_deref(), &block.meta)?;
        for (i, &v) in block.valid.iter().enumerate() {
            if v == 0 {
                sink.set_valid(first_row + i as u64, false)?;
            }
        }
        row += k;
    }
    sink.commit()?;
    Box::new(sink).close()
}

/// Rows of a merged file, as a sink appends them.
struct Block {
    mel: Vec<half::f16>,
    waveform: Option<Vec<f32>>,
    meta: Vec<RowMeta>,
    valid: Vec<u8>,
}

/// Read rows `row..row + k` of every column of a merged split file.
fn read_block(file: &File, row: u64, k: u64, header: &OutputHeader) -> Result<Block> {
    let path_bytes = header.path_bytes;
    let col = |name: &str| -> Result<Vec<u8>> { read_rows(&file.dataset(name)?, row, k) };
    let (mel, labels_b, valid, blake3) = (
        col("segments_mel")?,
        col("labels")?,
        col("valid")?,
        col("blake3")?,
    );
    let (paths, sensors, recs) = (col("source_path")?, col("sensor_id")?, col("recording_id")?);
    let (at, gain) = (col("recorded_at")?, col("gain_db")?);
    let waveform = if header.features.store_waveform {
        Some(
            col("segments_waveform")?
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect::<Vec<f32>>(),
        )
    } else {
        None
    };
    let text = |b: &[u8]| -> String {
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        String::from_utf8_lossy(&b[..end]).into_owned()
    };
    let meta: Vec<RowMeta> = (0..k as usize)
        .map(|i| RowMeta {
            label: i16::from_le_bytes([labels_b[2 * i], labels_b[2 * i + 1]]),
            blake3: blake3[32 * i..32 * i + 32].try_into().unwrap(),
            source_path: text(&paths[path_bytes * i..path_bytes * (i + 1)]),
            sensor_id: text(&sensors[ID_BYTES * i..ID_BYTES * (i + 1)]),
            recording_id: text(&recs[ID_BYTES * i..ID_BYTES * (i + 1)]),
            recorded_at: i64::from_le_bytes(at[8 * i..8 * i + 8].try_into().unwrap()),
            gain_db: f32::from_le_bytes(gain[4 * i..4 * i + 4].try_into().unwrap()),
        })
        .collect();
    let mel: Vec<half::f16> = mel
        .chunks_exact(2)
        .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    Ok(Block {
        mel,
        waveform,
        meta,
        valid,
    })
}

/// Put the complete copies built in `building` in place of `out/npy`.
fn swap_in_npy(out: &Path, building: &Path) -> Result<()> {
    let old = out.join("npy.old");
    if old.exists() {
        std::fs::remove_dir_all(&old)?;
    }
    if out.join("npy").exists() {
        std::fs::rename(out.join("npy"), &old)?;
    }
    std::fs::rename(building, out.join("npy"))?;
    sync_dir(out)?;
    if old.exists() {
        std::fs::remove_dir_all(&old)?;
    }
    Ok(())
}

/// Write the whole of `ds` from `bytes` (its own element type).
fn write_all(ds: &Dataset, bytes: &[u8]) -> Result<()> {
    hdf5::sync::sync(|| unsafe {
        let dtype = Id(hdf5::h5check(H5Dget_type(ds.id()))?, H5Tclose);
        let size = hdf5_sys::h5t::H5Tget_size(dtype.0);
        let elements: usize = ds.shape().iter().product();
        if size * elements != bytes.len() {
            bail!(
                "{} bytes for {elements} elements of {size} bytes",
                bytes.len()
            );
        }
        hdf5::h5check(hdf5_sys::h5d::H5Dwrite(
            ds.id(),
            dtype.0,
            hdf5_sys::h5s::H5S_ALL,
            hdf5_sys::h5s::H5S_ALL,
            H5P_DEFAULT,
            bytes.as_ptr() as *const c_void,
        ))?;
        Ok(())
    })
}

/// Human summary of a merge (stdout of `merge`).
pub fn summary(r: &MergeReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let rows: u64 = r.splits.iter().map(|x| x.rows).sum();
    let valid: u64 = r.splits.iter().map(|x| x.valid).sum();
    let _ = writeln!(
        s,
        "merged {} inputs -> {} rows ({} valid) in {} (virtual datasets: features not copied; \
         {:.1} KB of HDF5)",
        r.inputs.len(),
        rows,
        valid,
        r.into.display(),
        r.hdf5_bytes as f64 / 1e3
    );
    for i in &r.inputs {
        let _ = writeln!(
            s,
            "  input {}: {} / {} / {} rows{}",
            i.dir.display(),
            i.rows[0],
            i.rows[1],
            i.rows[2],
            if i.labels_remapped {
                " (label ids remapped)"
            } else {
                ""
            }
        );
    }
    for x in &r.splits {
        let _ = writeln!(
            s,
            "  {:<10} {:>8} rows {:>8} valid  {}",
            x.split,
            x.rows,
            x.valid,
            x.file.display()
        );
    }
    let _ = writeln!(s, "  rule: {}", r.rule);
    for w in &r.warnings {
        let _ = writeln!(s, "  warning: {w}");
    }
    let _ = writeln!(
        s,
        "  same content in several inputs: {} rows set valid = 0 ({})",
        r.duplicates, r.keeper
    );
    if r.label_conflicts > 0 {
        let _ = writeln!(
            s,
            "  label conflicts (same content, other label): {}",
            r.label_conflicts
        );
        for c in &r.label_conflict_list {
            let _ = writeln!(s, "    {}", conflict_line(c));
        }
    }
    match r.npy_copy_bytes {
        Some(b) => {
            let _ = writeln!(
                s,
                "  npy: {}/npy/ written as COPIES of the merged rows ({:.1} MB)",
                r.into.display(),
                b as f64 / 1e6
            );
        }
        None => {
            let _ = writeln!(s, "  npy: none (ask with --npy; they are copies)");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_climb_to_the_common_folder() {
        let p = |s: &str| PathBuf::from(s);
        assert_eq!(
            relative_path(&p("/a/b/merged"), &p("/a/b/shard-0/T.H5")),
            "../shard-0/T.H5"
        );
        assert_eq!(relative_path(&p("/a"), &p("/a/x/T.H5")), "x/T.H5");
        assert_eq!(
            relative_path(&p("/a/b/c"), &p("/d/T.H5")),
            "../../../d/T.H5"
        );
    }
}
