//! Write: rows -> the per-split outputs (docs/reading.md, "Layout on disk"): one HDF5 file per split
//! ([`hdf5`]) and `npy/<split>/` column files ([`npy`]). Both implement [`SplitSink`]; an
//! [`set::OutputSet`] drives the enabled ones together so they always hold the same rows.

pub mod direct;
pub mod hdf5;
pub mod npy;
pub mod read;
pub mod set;
mod version;

pub use version::check_output_version;

use crate::config::{FeatureSettings, FeatureShape};
use half::f16;
use std::path::{Path, PathBuf};

/// Version of the on-disk output layout (`schema_version` attribute, npy `attributes.json`).
/// See `migrations/`.
pub const OUTPUT_SCHEMA_VERSION: u32 = 1;

/// Width of the `sensor_id` and `recording_id` strings.
pub const ID_BYTES: usize = 32;

/// Everything about a row except its features.
#[derive(Debug, Clone, PartialEq)]
pub struct RowMeta {
    pub label: i16,
    pub blake3: [u8; 32],
    /// Relative to `paths.recordings`; at most `outputs.path_bytes` bytes (checked upstream).
    pub source_path: String,
    pub sensor_id: String,
    pub recording_id: String,
    /// Unix seconds UTC, -1 when absent.
    pub recorded_at: i64,
    /// NaN when absent.
    pub gain_db: f32,
}

/// What a new output file records about how it was made (file attributes in HDF5,
/// `attributes.json` beside the npy columns).
#[derive(Debug, Clone)]
pub struct OutputHeader {
    pub labels: Vec<String>,
    pub features: FeatureSettings,
    pub path_bytes: usize,
}

impl OutputHeader {
    pub fn shape(&self) -> FeatureShape {
        self.features.shape()
    }
    pub fn labels_json(&self) -> String {
        labels_json(&self.labels)
    }
    pub fn label2id_json(&self) -> String {
        label2id_json(&self.labels)
    }
}

/// `labels_json`: the label names, position = id.
pub fn labels_json(labels: &[String]) -> String {
    serde_json::to_string(labels).unwrap()
}

/// `label2id_json`: name -> id.
pub fn label2id_json(labels: &[String]) -> String {
    let map: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .enumerate()
        .map(|(i, n)| (n.clone(), serde_json::Value::from(i)))
        .collect();
    serde_json::Value::Object(map).to_string()
}

/// One split's storage. Rows are appended, then made visible by [`SplitSink::commit`], which
/// advances `committed_rows` only after the data below it is written. Rows never move.
pub trait SplitSink: Send {
    /// Rows appended so far (committed or not).
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Rows below this index are complete on disk.
    fn committed_rows(&self) -> u64;
    /// Append rows: `mel` holds `meta.len() * row_len` values; `waveform` (when the outputs
    /// store it) `meta.len() * waveform_len`. Returns the index of the first new row.
    fn append(
        &mut self,
        mel: &[f16],
        waveform: Option<&[f32]>,
        meta: &[RowMeta],
    ) -> anyhow::Result<u64>;
    /// Mark a row current (1) or superseded/deleted (0).
    fn set_valid(&mut self, row: u64, valid: bool) -> anyhow::Result<()>;
    /// Overwrite one row's bytes of column `name` in place.
    fn write_cell(&mut self, name: &str, row: u64, bytes: &[u8]) -> anyhow::Result<()>;
    /// The row has a new owner (docs/design.md, "Identity, labels, splits"): rewrite its label and
    /// path columns in place; features and hash stay.
    fn set_owner(&mut self, row: u64, meta: &RowMeta, path_bytes: usize) -> anyhow::Result<()> {
        for (name, bytes) in owner_cells(meta, path_bytes)? {
            self.write_cell(name, row, &bytes)?;
        }
        Ok(())
    }
    /// Replace the label list attributes; `labels` extends the current list (ids never change).
    fn set_labels(&mut self, labels: &[String]) -> anyhow::Result<()>;
    /// Make every appended row durable and visible: flush data, then `committed_rows`.
    fn commit(&mut self) -> anyhow::Result<()>;
    /// The first half of the service's commit: every appended row and edited cell durable on
    /// disk, `committed_rows` not moved (readers see nothing new yet).
    fn prepare(&mut self) -> anyhow::Result<()>;
    /// The second half, once the manifest holds the batch durably: move `committed_rows` to
    /// the rows appended, so readers see them. Not synced: a start after a crash moves it again
    /// to what the manifest records (`open_append`'s `keep`), from the rows `prepare` made
    /// durable.
    fn publish(&mut self) -> anyhow::Result<()>;
    /// Start writing what was appended to disk, without waiting for it. A bulk run calls this
    /// after each batch, so that the closing sync finds little left to write and the disk
    /// works while the next batches are computed.
    fn start_writeback(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
    /// Close cleanly (after this, plain readers see exactly `committed_rows` rows).
    fn close(self: Box<Self>) -> anyhow::Result<()>;
}

/// Before a file is opened again after a write failure: take the error the kernel kept for it.
/// When writing back a file's cached pages fails, Linux reports that once, to the next `fsync`
/// of the file through any descriptor opened later; it would fail the first sync of the reopen
/// although the disk works again (and, one file per attempt, hold the service back for minutes).
/// The pages it concerns were written after the last successful sync: rows and edits never
/// committed, which the reopen cuts and the comparison with the tree does again.
pub(crate) fn take_stale_write_error(path: &Path) {
    if let Ok(f) = std::fs::File::open(path) {
        if let Err(e) = f.sync_all() {
            log::info!(
                "{}: an earlier write failure was reported now ({e}); what it concerned was never committed",
                path.display()
            );
        }
    }
}

/// `sync_file_range(SYNC_FILE_RANGE_WRITE)` over the whole file open as `fd`: queue its dirty
/// pages for writing and return without waiting.
fn start_writeback(fd: std::os::fd::RawFd, path: &Path) -> anyhow::Result<()> {
    // SAFETY: a plain system call on a descriptor the caller holds open.
    let r = unsafe { libc::sync_file_range(fd, 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        anyhow::bail!("{}: starting writeback: {e}", path.display());
    }
    Ok(())
}

/// A sink closing with rows it never committed drops them: a warning for the live outputs (a
/// failing disk, a stop in mid-batch), a debug line for a staging output, whose failed rebuild
/// says so once for all of them.
pub(crate) fn log_dropped_rows(path: &Path, rows: u64, staged: bool) {
    let level = if staged {
        log::Level::Debug
    } else {
        log::Level::Warn
    };
    log::log!(
        level,
        "{}: closing with {rows} uncommitted rows; dropping them",
        path.display()
    );
}

/// Where split `split` (0..3) of each kind lives under an output directory.
pub fn hdf5_path(output: &Path, names: &crate::config::HdfNames, split: usize) -> PathBuf {
    output.join(names.for_split(split))
}

pub fn npy_dir(output: &Path, split: usize) -> PathBuf {
    output.join("npy").join(crate::config::SPLITS[split])
}

/// Outputs that only `ailhd rebuild` can mend: recordings were ingested into them, some of them
/// are under the output folder, and a file or folder the configuration names is missing or empty. `run` refuses to start (exit 2,
/// which the unit does not retry) and `check-config` says the same.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct OutputsIncomplete(String);

/// [`OutputsIncomplete`] when the outputs under `dir` are there in part: a split's HDF5 file
/// missing or empty, or its npy folder (its `attributes.json`) missing, while others are there.
pub fn check_complete(
    dir: &Path,
    outputs: &crate::config::Outputs,
) -> Result<(), OutputsIncomplete> {
    if !set::OutputSet::exists(dir, outputs) {
        return Ok(());
    }
    let mut missing = Vec::new();
    for split in 0..3 {
        if outputs.hdf5 {
            let path = hdf5_path(dir, &outputs.hdf5_names, split);
            match std::fs::metadata(&path) {
                Ok(m) if m.len() > 0 => {}
                Ok(_) => missing.push(format!("{} (empty)", path.display())),
                Err(_) => missing.push(format!("{} (missing)", path.display())),
            }
        }
        if outputs.npy {
            let path = npy_dir(dir, split).join("attributes.json");
            if std::fs::metadata(&path).is_err() {
                missing.push(format!("{} (missing)", path.display()));
            }
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(OutputsIncomplete(format!(
        "the outputs in {} are there only in part: {}. They were removed or emptied behind \
         ailhd's back (or `outputs.hdf5` / `outputs.npy` was turned on after they were made), \
         and their rows cannot be appended to: stop the service and run `ailhd rebuild`",
        dir.display(),
        missing.join(", ")
    )))
}

// The writers store the in-memory bytes of f16/i16/i64/f32 as the little-endian types the
// files declare ('<f2', H5T_IEEE_F16LE-shaped, ...); a big-endian host would need byte swaps.
#[cfg(not(target_endian = "little"))]
compile_error!("ailhd's output writers assume a little-endian host");

impl RowMeta {
    /// Why this row cannot be stored with string columns of `path_bytes` (source_path) and
    /// [`ID_BYTES`] (sensor_id, recording_id) bytes, if it cannot. Upstream quarantines such a
    /// recording with this reason; the writers refuse the whole `append` otherwise.
    pub fn check_fits(&self, path_bytes: usize) -> Result<(), String> {
        let fields = [
            (
                "relative path",
                &self.source_path,
                path_bytes,
                "outputs.path_bytes",
            ),
            (
                "sensor id",
                &self.sensor_id,
                ID_BYTES,
                "the fixed sensor_id width",
            ),
            (
                "recording id",
                &self.recording_id,
                ID_BYTES,
                "the fixed recording_id width",
            ),
        ];
        for (what, value, width, limit) in fields {
            if value.len() > width {
                return Err(format!(
                    "{what} is {} bytes in UTF-8, longer than {limit} ({width} bytes)",
                    value.len()
                ));
            }
            // NULL-padded strings end at the first NUL: one inside would truncate the value.
            if value.contains('\0') {
                return Err(format!("{what} contains a NUL character"));
            }
        }
        Ok(())
    }
}

/// The bytes of the columns an owner decides, for one row (same packing as [`pack_rows`]).
pub fn owner_cells(
    meta: &RowMeta,
    path_bytes: usize,
) -> anyhow::Result<Vec<(&'static str, Vec<u8>)>> {
    if let Err(why) = meta.check_fits(path_bytes) {
        anyhow::bail!("row for {:?} does not fit: {why}", meta.source_path);
    }
    let fixed = |width: usize, s: &str| {
        let mut out = vec![0u8; width];
        out[..s.len()].copy_from_slice(s.as_bytes());
        out
    };
    Ok(vec![
        ("labels", meta.label.to_le_bytes().to_vec()),
        ("source_path", fixed(path_bytes, &meta.source_path)),
        ("sensor_id", fixed(ID_BYTES, &meta.sensor_id)),
        ("recording_id", fixed(ID_BYTES, &meta.recording_id)),
        ("recorded_at", meta.recorded_at.to_le_bytes().to_vec()),
        ("gain_db", meta.gain_db.to_le_bytes().to_vec()),
    ])
}

/// Element type of one output column, as both writers store it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnType {
    F16,
    I16,
    U8,
    I64,
    F32,
    /// Fixed-length UTF-8, NUL padded, of this many bytes.
    Str(usize),
}

impl ColumnType {
    pub fn size(self) -> usize {
        match self {
            ColumnType::F16 | ColumnType::I16 => 2,
            ColumnType::U8 => 1,
            ColumnType::I64 => 8,
            ColumnType::F32 => 4,
            ColumnType::Str(n) => n,
        }
    }
}

/// One column of the output (an HDF5 dataset, an npy file): its name, element type, and the
/// shape of one row (empty for a scalar per row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnSpec {
    pub name: &'static str,
    pub dtype: ColumnType,
    pub row_dims: Vec<usize>,
}

impl ColumnSpec {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.dtype.size() * self.row_dims.iter().product::<usize>()
    }

    /// A feature column (`segments_mel`, `segments_waveform`): most of a row's bytes, written
    /// once and never edited in place.
    pub fn is_features(&self) -> bool {
        self.name.starts_with("segments_")
    }
}

/// The row columns of an output with this header, in the order of docs/reading.md, "Layout on disk". `committed_rows`
/// is not a row column and is not listed.
pub fn columns(header: &OutputHeader) -> Vec<ColumnSpec> {
    let shape = header.shape();
    let col = |name, dtype, row_dims: &[usize]| ColumnSpec {
        name,
        dtype,
        row_dims: row_dims.to_vec(),
    };
    let mut cols = vec![
        col("segments_mel", ColumnType::F16, &shape.row_dims()),
        col("labels", ColumnType::I16, &[]),
        col("valid", ColumnType::U8, &[]),
        col("blake3", ColumnType::U8, &[32]),
        col("source_path", ColumnType::Str(header.path_bytes), &[]),
        col("sensor_id", ColumnType::Str(ID_BYTES), &[]),
        col("recording_id", ColumnType::Str(ID_BYTES), &[]),
        col("recorded_at", ColumnType::I64, &[]),
        col("gain_db", ColumnType::F32, &[]),
    ];
    if header.features.store_waveform {
        cols.push(col(
            "segments_waveform",
            ColumnType::F32,
            &[shape.num_long, shape.num_short, shape.short_window],
        ));
    }
    cols
}

/// The bytes `append` writes to each column (same order as [`columns`]), checked against the
/// header. Both writers store exactly these bytes, so the HDF5 file and the npy columns hold
/// the same rows. The features are borrowed, not copied (they are most of the bytes).
pub fn pack_rows<'a>(
    header: &OutputHeader,
    mel: &'a [f16],
    waveform: Option<&'a [f32]>,
    meta: &[RowMeta],
) -> anyhow::Result<Vec<std::borrow::Cow<'a, [u8]>>> {
    use anyhow::bail;
    use std::borrow::Cow;
    let shape = header.shape();
    let n = meta.len();
    if mel.len() != n * shape.row_len() {
        bail!(
            "append: {} mel values for {n} rows of {} values each",
            mel.len(),
            shape.row_len()
        );
    }
    match (header.features.store_waveform, waveform) {
        (true, Some(w)) if w.len() != n * shape.waveform_len() => bail!(
            "append: {} waveform values for {n} rows of {} values each",
            w.len(),
            shape.waveform_len()
        ),
        (true, None) => bail!("append: features.store_waveform is on but no waveform was given"),
        (false, Some(_)) => {
            bail!("append: a waveform was given but features.store_waveform is off")
        }
        _ => {}
    }
    for m in meta {
        if let Err(why) = m.check_fits(header.path_bytes) {
            bail!("append: row for {:?} does not fit: {why}", m.source_path);
        }
    }
    let fixed = |width: usize, get: &dyn Fn(&RowMeta) -> &str| -> Vec<u8> {
        let mut out = vec![0u8; n * width];
        for (row, m) in out.chunks_exact_mut(width).zip(meta) {
            let s = get(m).as_bytes();
            row[..s.len()].copy_from_slice(s);
        }
        out
    };
    let mut cols: Vec<Cow<'a, [u8]>> = vec![
        Cow::Borrowed(bytemuck::cast_slice(mel)),
        Cow::Owned(meta.iter().flat_map(|m| m.label.to_le_bytes()).collect()),
        Cow::Owned(vec![1u8; n]),
        Cow::Owned(meta.iter().flat_map(|m| m.blake3).collect()),
        Cow::Owned(fixed(header.path_bytes, &|m| &m.source_path)),
        Cow::Owned(fixed(ID_BYTES, &|m| &m.sensor_id)),
        Cow::Owned(fixed(ID_BYTES, &|m| &m.recording_id)),
        Cow::Owned(
            meta.iter()
                .flat_map(|m| m.recorded_at.to_le_bytes())
                .collect(),
        ),
        Cow::Owned(meta.iter().flat_map(|m| m.gain_db.to_le_bytes()).collect()),
    ];
    if let Some(w) = waveform {
        cols.push(Cow::Borrowed(bytemuck::cast_slice(w)));
    }
    Ok(cols)
}

/// The file attributes (HDF5) / `attributes.json` entries (npy) of a new output, as
/// (name, value) pairs; `schema_version` is stored as a number, everything else as text.
pub fn header_attributes(header: &OutputHeader) -> Vec<(&'static str, String)> {
    let created = time::OffsetDateTime::now_utc()
        .format(time::macros::format_description!(
            "[year]-[month]-[day]T[hour]:[minute]:[second]Z"
        ))
        .expect("UTC timestamp formats");
    vec![
        ("labels_json", header.labels_json()),
        ("label2id_json", header.label2id_json()),
        ("config_json", header.features.to_json()),
        ("created_at_utc", created),
        ("ailhd_version", env!("CARGO_PKG_VERSION").to_string()),
        ("feature_fingerprint", header.features.fingerprint()),
    ]
}

/// A sink's label list only grows (labels appended under `labels.unknown = "append"`): `new`
/// must extend `current`, since label ids are never renumbered.
pub fn check_labels_extend(path: &Path, current: &[String], new: &[String]) -> anyhow::Result<()> {
    if !new.starts_with(current) {
        anyhow::bail!(
            "{}: new label list {new:?} does not extend the current {current:?}: label ids are \
             never renumbered",
            path.display()
        );
    }
    Ok(())
}

/// The message of every "this output cannot be appended to" error: what differs, and what to do.
pub fn incompatible(path: &Path, what: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!(
        "{}: {what}; this output was made with other settings or another ailhd layout and cannot \
         be appended to: run `ailhd rebuild` to regenerate the outputs",
        path.display()
    )
}

/// The configuration disagrees with what existing outputs (or their manifest) were made with: a
/// feature setting, the order of `labels.names`, or `outputs.path_bytes` (the width of
/// `source_path`). Not a condition that may pass: only the configuration mends it (restore the
/// setting, or `ailhd rebuild`), so it is reported as a configuration error (exit 2, which
/// systemd does not restart; exit 1 would restart `run` every few seconds for ever). `run` (the
/// manifest at every open, each output file as it is reopened) and `check-config` both refuse
/// through [`check_features`], [`check_label_ids`] and [`check_path_bytes`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SettingsDiffer(String);

/// Outputs recorded with feature settings `stored_fingerprint` (at `path`: a file, or the
/// manifest's folder) take the rows of the `configured` settings only when the fingerprints are
/// equal. `stored_json`, the outputs' `config_json` when known, names the keys that differ.
pub fn check_features(
    path: &Path,
    stored_fingerprint: &str,
    stored_json: Option<&str>,
    configured: &FeatureSettings,
) -> Result<(), SettingsDiffer> {
    let fingerprint = configured.fingerprint();
    if configured.made(stored_fingerprint) {
        return Ok(());
    }
    let object = |text: &str| {
        serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(text).unwrap_or_default()
    };
    let (configured_json, stored) = (
        object(&configured.to_json()),
        object(stored_json.unwrap_or("{}")),
    );
    let changed: Vec<String> = configured_json
        .iter()
        .filter(|(key, value)| stored.get(*key).is_some_and(|s| s != *value))
        .map(|(key, value)| {
            format!(
                "features.{key} = {value} in the configuration, {} in the outputs",
                stored[key]
            )
        })
        .collect();
    let what = if changed.is_empty() {
        format!("feature fingerprint {fingerprint} in the configuration, {stored_fingerprint} in the outputs")
    } else {
        changed.join("; ")
    };
    Err(SettingsDiffer(format!(
        "{}: the configured feature settings differ from those the outputs were made with \
         ({what}): these outputs cannot be appended to. Restore the setting, or run `ailhd \
         rebuild` to regenerate the outputs with the new settings",
        path.display()
    )))
}

/// Label ids are positions in the label list and are never renumbered: `names` (the configured
/// `labels.names` with the labels appended since) must begin with `stored`, the list the outputs
/// at `path` were made with.
pub fn check_label_ids(
    path: &Path,
    stored: &[String],
    names: &[String],
) -> Result<(), SettingsDiffer> {
    if names.starts_with(stored) {
        return Ok(());
    }
    Err(SettingsDiffer(format!(
        "{}: labels.names changed the ids of existing labels (the outputs have {stored:?}, the \
         configuration gives {names:?}); ids are never renumbered: restore the order (new names \
         go at the end) or run `ailhd rebuild`",
        path.display()
    )))
}

/// The `source_path` column of the outputs at `path` (a file, or an npy split's column) holds
/// strings of `stored` bytes, fixed when they were made: they take the rows of a configuration
/// whose `outputs.path_bytes` is `configured` only when the two are equal.
pub fn check_path_bytes(
    path: &Path,
    stored: usize,
    configured: usize,
) -> Result<(), SettingsDiffer> {
    if stored == configured {
        return Ok(());
    }
    Err(SettingsDiffer(format!(
        "{}: outputs.path_bytes = {configured} in the configuration, {stored} in the outputs (the \
         fixed width of their source_path column): these outputs cannot be appended to. Restore \
         the setting, or run `ailhd rebuild` to regenerate the outputs with the new width",
        path.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_path_width_is_named_as_a_configuration_error() {
        let p = Path::new("/out/npy/training/source_path.npy");
        assert!(check_path_bytes(p, 256, 256).is_ok());
        let e = check_path_bytes(p, 256, 300).unwrap_err().to_string();
        assert!(
            e.contains("/out/npy/training/source_path.npy")
                && e.contains("outputs.path_bytes = 300 in the configuration, 256 in the outputs")
                && e.contains("ailhd rebuild"),
            "{e}"
        );
    }

    #[test]
    fn a_changed_feature_setting_is_named_as_a_configuration_error() {
        let built = FeatureSettings::default();
        let p = Path::new("/out/TRAINING_DATASET.H5");
        let same = check_features(p, &built.fingerprint(), Some(&built.to_json()), &built);
        assert!(same.is_ok());
        let configured = FeatureSettings {
            n_mels: 32,
            ..built.clone()
        };
        let e = check_features(p, &built.fingerprint(), Some(&built.to_json()), &configured)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/out/TRAINING_DATASET.H5")
                && e.contains("features.n_mels = 32 in the configuration, 64 in the outputs")
                && e.contains("ailhd rebuild")
                && !e.contains("features.power"),
            "{e}"
        );
        // Without the outputs' config_json (the manifest records only the fingerprint).
        let e = check_features(p, &built.fingerprint(), None, &configured)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&built.fingerprint()), "{e}");
    }

    #[test]
    fn label_ids_are_checked_against_the_stored_list() {
        let l = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let p = Path::new("/out");
        assert!(check_label_ids(p, &l(&["A", "B"]), &l(&["A", "B", "C"])).is_ok());
        let e = check_label_ids(p, &l(&["A", "B"]), &l(&["B", "A"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("labels.names changed the ids"), "{e}");
        assert!(check_label_ids(p, &l(&["A", "B"]), &l(&["A"])).is_err());
    }

    #[test]
    fn a_label_list_may_only_grow_at_its_end() {
        let l = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let p = Path::new("/out/npy/training");
        assert!(check_labels_extend(p, &l(&["A", "B"]), &l(&["A", "B"])).is_ok());
        assert!(check_labels_extend(p, &l(&["A", "B"]), &l(&["A", "B", "C"])).is_ok());
        let e = check_labels_extend(p, &l(&["A", "B"]), &l(&["B", "A", "C"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/out/npy/training") && e.contains("does not extend"),
            "{e}"
        );
        assert!(check_labels_extend(p, &l(&["A", "B"]), &l(&["A"])).is_err());
    }

    fn header(store_waveform: bool) -> OutputHeader {
        OutputHeader {
            labels: vec!["A".into(), "B".into()],
            features: FeatureSettings {
                store_waveform,
                ..FeatureSettings::default()
            },
            path_bytes: 16,
        }
    }

    fn meta(path: &str) -> RowMeta {
        RowMeta {
            label: 1,
            blake3: [7; 32],
            source_path: path.into(),
            sensor_id: "S1".into(),
            recording_id: String::new(),
            recorded_at: -1,
            gain_db: f32::NAN,
        }
    }

    #[test]
    fn rows_that_do_not_fit_say_why() {
        assert!(meta("A/ü.wav").check_fits(16).is_ok());
        let e = meta("A/abcdefghijklmnop.wav").check_fits(16).unwrap_err();
        assert!(e.contains("outputs.path_bytes"), "{e}");
        assert!(meta("A/\0.wav").check_fits(16).unwrap_err().contains("NUL"));
    }

    #[test]
    fn packed_columns_follow_the_layout() {
        let h = header(false);
        let n = h.shape().row_len();
        let mel = vec![f16::from_f32(1.5); 2 * n];
        let cols = pack_rows(&h, &mel, None, &[meta("A/x.wav"), meta("B/ü")]).unwrap();
        let specs = columns(&h);
        assert_eq!(cols.len(), specs.len());
        for (c, s) in cols.iter().zip(&specs) {
            assert_eq!(c.len(), 2 * s.row_bytes(), "{}", s.name);
        }
        assert_eq!(&cols[4][16..20], "B/ü".as_bytes());
        assert!(cols[4][20..32].iter().all(|&b| b == 0), "NUL padded");
        assert!(pack_rows(&h, &mel[1..], None, &[meta("a"), meta("b")]).is_err());
        assert!(pack_rows(&h, &mel, Some(&[0.0]), &[meta("a"), meta("b")]).is_err());
        assert!(pack_rows(&header(true), &mel, None, &[meta("a"), meta("b")]).is_err());
    }
}
