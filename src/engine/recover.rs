//! Rebuilding a lost manifest from the outputs (docs/operations.md: a lost state).
//!
//! Rows never move and never disappear while the outputs exist (a trainer may keep row
//! numbers), so a service that finds its state folder missing or unreadable must not start
//! the outputs afresh. Every row already says what it is: its content hash (`blake3`), the path
//! that owns it (`source_path`), its label, whether it is current (`valid`), and its split (the
//! file it is in). From those the manifest is written again, without recomputing a feature or
//! touching a row:
//!
//! - a valid row: its content record (row, label, owner) and its owner's file record;
//! - an invalid row: a content record with no path (its bytes may come back, and the row with
//!   them, exactly as if the manifest had never been lost);
//! - the row count of each split, and the label list of the outputs.
//!
//! What the outputs do not hold — other paths holding the same bytes, quarantined files, sizes
//! and modification times — is found again by the ordinary reconcile with the tree that follows:
//! every recovered file record carries an impossible size, so each recorded path is read and
//! hashed once more (features are not recomputed: unchanged bytes keep their row), and every
//! other file is judged as new.
//!
//! The same columns take over rows that outputs written by an older version of `ailhd` (which
//! committed the outputs before the manifest; today's [`super::commit`] moves `committed_rows`
//! last) had committed and not recorded when the service stopped: rows SWMR readers may have
//! seen. They are not cut: [`adopt_tail`] records them as the ledger had decided them, and the
//! reconcile does the rest of that batch again (its edits of older rows are already in the
//! outputs, and doing them again writes the same values).

use super::manifest::{ContentRecord, FileRecord, Manifest, ManifestBatch, RowRef};
use crate::config::{Settings, SPLITS};
use crate::identity::Hash;
use crate::output::npy::{read_rows, NpySink};
use crate::output::read::{npy_label_names, SwmrSplit};
use crate::output::set::OutputSet;
use crate::output::{ColumnType, OutputHeader};
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// What a recovery found, for the log line.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Rows per split.
    pub rows: [u64; 3],
    /// Valid rows (content and owner recorded).
    pub valid: u64,
    /// Valid rows that named a path another valid row already owns, or repeated a hash: left
    /// as they are in the outputs, with no record (they cannot be told apart).
    pub conflicting: u64,
    /// Where the rows were read from.
    pub source: String,
}

/// One split's identity columns, committed rows only: `blake3` and `source_path` from row
/// `from` on, `labels` and `valid` of every row.
#[derive(Default)]
struct Identity {
    from: u64,
    blake3: Vec<u8>,
    source_path: Vec<String>,
    labels: Vec<i16>,
    valid: Vec<u8>,
}

impl Identity {
    /// The content hash at index `t` of `blake3` (row `from + t`).
    fn hash(&self, t: usize) -> Hash {
        self.blake3[t * 32..t * 32 + 32]
            .try_into()
            .expect("32-byte rows")
    }
}

/// True when `manifest` has never recorded anything: a new or lost state folder.
pub fn is_blank(manifest: &Manifest) -> Result<bool> {
    Ok(manifest.files().next().is_none()
        && manifest.contents().next().is_none()
        && manifest.rows()? == [0; 3]
        && manifest.get_meta("labels")?.is_none())
}

/// Write into the blank `manifest` what the outputs under `settings.paths.output` record.
/// Returns None when there is nothing to recover (no outputs, or no rows in them).
pub fn from_outputs(settings: &Settings, manifest: &Manifest) -> Result<Option<Recovered>> {
    let mut found = Recovered::default();
    let Some((splits, label_names)) = read_committed(settings, &mut found)? else {
        return Ok(None);
    };
    if found.rows == [0; 3] {
        return Ok(None);
    }
    let (contents, owners) = recovered_records(&splits, &mut found);
    let mut batch = ManifestBatch::default();
    for (hash, c) in &contents {
        batch.put_content(hash, c);
    }
    for (path, hash) in &owners {
        batch.put_file(path, &to_read_again(*hash));
    }
    for (split, &rows) in found.rows.iter().enumerate() {
        batch.put_rows(split, rows);
    }
    let labels = label_names.unwrap_or_else(|| settings.labels.names.clone());
    batch.put_labels(&labels, settings.labels.names.len());
    manifest.apply(batch)?;
    manifest.flush()?;
    Ok(Some(found))
}

/// The committed identity columns of each split (None: no output file), from the HDF5 files
/// when they are on, else the npy columns, with the label list of the first split found.
/// Counts the rows into `found`. None when no output is enabled.
#[allow(clippy::type_complexity)]
fn read_committed(
    settings: &Settings,
    found: &mut Recovered,
) -> Result<Option<(Vec<Option<Identity>>, Option<Vec<String>>)>> {
    let out = &settings.paths.output;
    let mut splits = Vec::new();
    let mut label_names: Option<Vec<String>> = None;
    for (split, name) in SPLITS.iter().enumerate() {
        let (labels, ids) = if settings.outputs.hdf5 {
            let path = crate::output::hdf5_path(out, &settings.outputs.hdf5_names, split);
            if !path.exists() {
                splits.push(None);
                continue;
            }
            found.source = "HDF5 files".into();
            read_hdf5(&path, 0)?
        } else if settings.outputs.npy {
            let dir = crate::output::npy_dir(out, split);
            if !dir.join("attributes.json").exists() {
                splits.push(None);
                continue;
            }
            found.source = "npy columns".into();
            read_npy(settings, &dir)?
        } else {
            return Ok(None);
        };
        found.rows[split] = ids.labels.len() as u64;
        log::debug!("{name}: {} rows to recover", ids.labels.len());
        label_names.get_or_insert(labels);
        splits.push(Some(ids));
    }
    Ok(Some((splits, label_names)))
}

/// Contents: the valid row of each hash; otherwise its last invalid row (the one a returning
/// path revives, as the ledger would have kept it). Owners: the path of each valid row, unless
/// another valid row named it or its content first (counted conflicting).
fn recovered_records(
    splits: &[Option<Identity>],
    found: &mut Recovered,
) -> (BTreeMap<Hash, ContentRecord>, BTreeMap<String, Hash>) {
    let mut contents: BTreeMap<Hash, ContentRecord> = BTreeMap::new();
    let mut owners: BTreeMap<String, Hash> = BTreeMap::new();
    for (split, ids) in splits.iter().enumerate() {
        let Some(ids) = ids else { continue };
        for row in 0..ids.labels.len() {
            let hash = ids.hash(row);
            let at = RowRef {
                split: split as u8,
                row: row as u64,
            };
            let path = &ids.source_path[row];
            if ids.valid[row] == 0 {
                contents
                    .entry(hash)
                    .and_modify(|c| {
                        if !c.valid {
                            c.row = Some(at);
                            c.label = ids.labels[row];
                        }
                    })
                    .or_insert(ContentRecord {
                        row: Some(at),
                        label: ids.labels[row],
                        valid: false,
                        paths: Vec::new(),
                    });
                continue;
            }
            let taken = owners.contains_key(path) || contents.get(&hash).is_some_and(|c| c.valid);
            if taken {
                log::warn!(
                    "recovering the manifest: {} row {row} ({path}) repeats a path or content of another valid row; it is left as it is, unrecorded",
                    SPLITS[split]
                );
                found.conflicting += 1;
                continue;
            }
            found.valid += 1;
            owners.insert(path.clone(), hash);
            contents.insert(
                hash,
                ContentRecord {
                    row: Some(at),
                    label: ids.labels[row],
                    valid: true,
                    paths: vec![path.clone()],
                },
            );
        }
    }
    (contents, owners)
}

/// What [`adopt_tail`] took over, for the log line.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Adopted {
    /// Rows adopted, per split.
    pub rows: [u64; 3],
    /// Of them, rows whose bytes already had a row of their own in the same split (the ledger
    /// never makes two): recorded as superseded, invalid.
    pub superseded: u64,
}

/// A file record the reconcile reads and hashes again (no file has a negative size or this
/// mtime).
fn to_read_again(hash: Hash) -> FileRecord {
    FileRecord {
        hash: Some(hash),
        size: u64::MAX,
        mtime_ns: i64::MIN,
        quarantine: None,
        updated_ms: super::manifest::now_ms(),
    }
}

/// Adopt the rows the outputs committed beyond the manifest's row counts: the last batch of a
/// service stopped between committing the outputs and flushing the manifest. Readers may have
/// seen those rows, and rows never move nor disappear, so instead of being cut they are recorded
/// from their own columns, as the ledger decided them:
///
/// - a valid row is its bytes' row, owned by its `source_path`; the bytes' other recorded paths
///   stay with it, and a row the bytes had in another split was retired by that batch (it is
///   invalid in the outputs already; written so again);
/// - its owner let go of the bytes it held before: that content loses the path, and its row
///   turns invalid (no path left) or belongs to the next path (whose label the row already has),
///   as that batch wrote in the outputs;
/// - a valid row whose bytes already have a row in the same split cannot be the ledger's (it
///   never makes two): it is turned invalid and left unrecorded, as a superseded row;
/// - an invalid row is recorded as its bytes' row only when they have none.
///
/// Every path recorded here is read and hashed again by the reconcile that follows (no
/// feature is recomputed: unchanged bytes keep their row), which also does again whatever else
/// that batch did. Rows the enabled outputs do not all hold committed (HDF5 and npy commit side
/// by side) were never there for some readers and are cut as before. Returns None when the
/// outputs hold no rows beyond the manifest's.
pub fn adopt_tail(settings: &Settings, manifest: &Manifest) -> Result<Option<Adopted>> {
    let known = manifest.rows()?;
    let (on_disk, label_names) = committed_on_disk(settings)?;
    if (0..3).all(|s| on_disk[s] <= known[s]) {
        return Ok(None);
    }
    let splits = tail_identities(settings, known)?;
    let mut adoption = Adoption {
        manifest,
        splits: &splits,
        contents: BTreeMap::new(),
        files: BTreeMap::new(),
        invalid: Vec::new(),
        found: Adopted::default(),
    };
    for split in 0..SPLITS.len() {
        for row in known[split]..on_disk[split].max(known[split]) {
            adoption.row(split, row)?;
        }
    }

    // The outputs first: stopped half-way, the next start adopts the same rows again.
    let keep: [u64; 3] = std::array::from_fn(|s| on_disk[s].max(known[s]));
    let labels = label_names.unwrap_or_else(|| settings.labels.names.clone());
    invalidate_in_outputs(settings, &labels, keep, &adoption.invalid)?;

    let mut batch = ManifestBatch::default();
    for (hash, c) in &adoption.contents {
        batch.put_content(hash, c);
    }
    for (path, f) in &adoption.files {
        batch.put_file(path, f);
    }
    for (split, &rows) in keep.iter().enumerate() {
        batch.put_rows(split, rows);
    }
    // Labels the lost batch appended (labels.unknown = "append") are in the outputs already.
    let stored: Vec<String> = manifest
        .get_meta("labels")?
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    if labels.len() > stored.len() && labels.starts_with(&stored) {
        batch.put_labels(&labels, settings.labels.names.len());
    }
    manifest.apply(batch)?;
    manifest.flush()?;
    Ok(Some(adoption.found))
}

/// The rows each split has committed in every enabled output (the least of them), and the
/// label list of the first output found.
fn committed_on_disk(settings: &Settings) -> Result<([u64; 3], Option<Vec<String>>)> {
    let out = &settings.paths.output;
    let mut on_disk = [0u64; 3];
    let mut label_names: Option<Vec<String>> = None;
    for (split, rows) in on_disk.iter_mut().enumerate() {
        let mut least = u64::MAX;
        if settings.outputs.hdf5 {
            let path = crate::output::hdf5_path(out, &settings.outputs.hdf5_names, split);
            if !path.exists() {
                continue;
            }
            let mut f = open_split(&path)?;
            least = least.min(f.refresh()?);
            if label_names.is_none() {
                label_names = Some(f.label_names()?);
            }
        }
        if settings.outputs.npy {
            let dir = crate::output::npy_dir(out, split);
            if !dir.join("attributes.json").exists() {
                continue;
            }
            let labels = npy_label_names(&dir)?;
            let header = OutputHeader {
                labels: labels.clone(),
                features: settings.features.clone(),
                path_bytes: settings.outputs.path_bytes,
            };
            least = least.min(NpySink::committed_rows_on_disk(&dir, &header)?);
            label_names.get_or_insert(labels);
        }
        if least != u64::MAX {
            *rows = least;
        }
    }
    Ok((on_disk, label_names))
}

/// Each split's identity columns from the manifest's row count `known` on (labels and
/// validity of every row), from the HDF5 file when it is on, else the npy columns.
fn tail_identities(settings: &Settings, known: [u64; 3]) -> Result<Vec<Identity>> {
    let out = &settings.paths.output;
    let mut splits = Vec::new();
    for (split, &recorded) in known.iter().enumerate() {
        let hdf5 = crate::output::hdf5_path(out, &settings.outputs.hdf5_names, split);
        let npy = crate::output::npy_dir(out, split);
        let ids = if settings.outputs.hdf5 && hdf5.exists() {
            read_hdf5(&hdf5, recorded)?.1
        } else if !settings.outputs.hdf5 && npy.join("attributes.json").exists() {
            let mut ids = read_npy(settings, &npy)?.1;
            let from = recorded.min(ids.source_path.len() as u64);
            ids.blake3.drain(..from as usize * 32);
            ids.source_path.drain(..from as usize);
            ids.from = from;
            ids
        } else {
            Identity::default()
        };
        splits.push(ids);
    }
    Ok(splits)
}

/// Open the outputs cut to `keep` rows per split, turn the rows `invalid`, and commit.
fn invalidate_in_outputs(
    settings: &Settings,
    labels: &[String],
    keep: [u64; 3],
    invalid: &[RowRef],
) -> Result<()> {
    let header = OutputHeader {
        labels: labels.to_vec(),
        features: settings.features.clone(),
        path_bytes: settings.outputs.path_bytes,
    };
    let out = &settings.paths.output;
    let mut outputs = OutputSet::open_append(out, &settings.outputs, &header, false, Some(keep))?;
    for r in invalid {
        outputs.set_valid(r.split as usize, r.row, false)?;
    }
    outputs.commit()?;
    outputs.close()
}

/// The records [`adopt_tail`] makes, row by row.
struct Adoption<'a> {
    manifest: &'a Manifest,
    splits: &'a [Identity],
    /// Records as adopted so far (read from the manifest on first use).
    contents: BTreeMap<Hash, ContentRecord>,
    files: BTreeMap<String, FileRecord>,
    /// Rows to write invalid (most already are: written again, the same value).
    invalid: Vec<RowRef>,
    found: Adopted,
}

impl Adoption<'_> {
    fn content(&self, h: &Hash) -> Result<Option<ContentRecord>> {
        Ok(match self.contents.get(h) {
            Some(c) => Some(c.clone()),
            None => self.manifest.get_content(h)?,
        })
    }

    fn file(&self, path: &str) -> Result<Option<FileRecord>> {
        Ok(match self.files.get(path) {
            Some(f) => Some(f.clone()),
            None => self.manifest.get_file(path)?,
        })
    }

    /// Adopt one row beyond the manifest's count.
    fn row(&mut self, split: usize, row: u64) -> Result<()> {
        let ids = &self.splits[split];
        let r = row as usize;
        let hash = ids.hash((row - ids.from) as usize);
        let path = ids.source_path[(row - ids.from) as usize].clone();
        let (label, valid) = (ids.labels[r], ids.valid[r] != 0);
        let at = RowRef {
            split: split as u8,
            row,
        };
        self.found.rows[split] += 1;
        let cur = self.content(&hash)?;
        if !valid || path.is_empty() {
            self.invalid_row(at, hash, label, valid, cur);
        } else if cur
            .as_ref()
            .and_then(|c| c.row)
            .is_some_and(|r0| r0.split == at.split && r0 != at)
        {
            log::warn!(
                "adopting {} row {row} ({path}): its bytes have a row in that split already; turned invalid, as superseded",
                SPLITS[split]
            );
            self.invalid.push(at);
            self.found.superseded += 1;
        } else {
            self.valid_row(at, hash, path, label, cur)?;
        }
        Ok(())
    }

    /// An invalid row (or one without a path, written invalid): its bytes' row only when they
    /// have none.
    fn invalid_row(
        &mut self,
        at: RowRef,
        hash: Hash,
        label: i16,
        valid: bool,
        cur: Option<ContentRecord>,
    ) {
        if valid {
            self.invalid.push(at);
        }
        if cur.is_none() {
            self.contents.insert(
                hash,
                ContentRecord {
                    row: Some(at),
                    label,
                    valid: false,
                    paths: Vec::new(),
                },
            );
        }
    }

    /// A valid row: its bytes' row, owned by `path` (a row they had elsewhere retired), every
    /// path of the bytes to be read again.
    fn valid_row(
        &mut self,
        at: RowRef,
        hash: Hash,
        path: String,
        label: i16,
        cur: Option<ContentRecord>,
    ) -> Result<()> {
        let mut c = cur.unwrap_or(ContentRecord {
            row: None,
            label,
            valid: false,
            paths: Vec::new(),
        });
        if let Some(r0) = c.row.filter(|r0| *r0 != at) {
            self.invalid.push(r0);
        }
        self.let_go(&path, hash)?;
        c.row = Some(at);
        c.label = label;
        c.valid = true;
        if let Err(i) = c.paths.binary_search(&path) {
            c.paths.insert(i, path.clone());
        }
        for p in &c.paths {
            self.files.insert(p.clone(), to_read_again(hash));
        }
        self.contents.insert(hash, c);
        Ok(())
    }

    /// `path` now holds `hash`: the bytes it held before lose it; their row turns invalid (no
    /// path left) or takes the next path's label, already in the outputs, when it was the owner.
    fn let_go(&mut self, path: &str, hash: Hash) -> Result<()> {
        let Some(h0) = self
            .file(path)?
            .and_then(|f| f.holds().copied())
            .filter(|h0| *h0 != hash)
        else {
            return Ok(());
        };
        let Some(mut c0) = self.content(&h0)? else {
            return Ok(());
        };
        let was_owner = c0.owner() == Some(path);
        c0.paths.retain(|p| *p != path);
        if let Some(r0) = c0.row {
            if c0.paths.is_empty() {
                if c0.valid {
                    c0.valid = false;
                    self.invalid.push(r0);
                }
            } else if was_owner {
                if let Some(&l) = self.splits[r0.split as usize].labels.get(r0.row as usize) {
                    c0.label = l;
                }
            }
        }
        self.contents.insert(h0, c0);
        Ok(())
    }
}

/// One split's HDF5 file, opened to read it as a recovery does: a file whose writer was killed
/// during a plain (not SWMR) open has status flags that refuse every reader; they are cleared
/// first (the caller holds the writer lock).
fn open_split(path: &Path) -> Result<SwmrSplit> {
    SwmrSplit::open(path).or_else(|first| {
        log::warn!("{first:#}; clearing HDF5's status flags (its last writer was killed)");
        crate::output::hdf5::clear_status_flags(path)?;
        SwmrSplit::open(path)
    })
}

/// The identity columns of one split's HDF5 file (`blake3` and `source_path` from row `from`).
fn read_hdf5(path: &Path, from: u64) -> Result<(Vec<String>, Identity)> {
    let mut f = open_split(path)?;
    let labels = f.label_names()?;
    let n = f.refresh()?;
    let from = from.min(n);
    let (width, blake3) = f.read_bytes("blake3", from..n)?;
    if width != 32 {
        bail!("{}: blake3 rows of {width} bytes, not 32", path.display());
    }
    let narrow = f.read_rows("", 0..n)?;
    Ok((
        labels,
        Identity {
            from,
            blake3,
            source_path: f.read_strings("source_path", from..n)?,
            labels: narrow.labels,
            valid: narrow.valid,
        },
    ))
}

fn read_npy(settings: &Settings, dir: &Path) -> Result<(Vec<String>, Identity)> {
    let descr = |t| crate::output::npy::descr(t);
    let path_bytes = settings.outputs.path_bytes;
    let stored = crate::output::npy::source_path_width(dir)?;
    crate::output::check_path_bytes(&dir.join("source_path.npy"), stored, path_bytes)?;
    let path_type = ColumnType::Str(path_bytes);
    let (_, blake3) = read_rows(dir, "blake3", &descr(ColumnType::U8))?;
    let (width, paths) = read_rows(dir, "source_path", &descr(path_type))?;
    let (_, labels) = read_rows(dir, "labels", &descr(ColumnType::I16))?;
    let (_, valid) = read_rows(dir, "valid", &descr(ColumnType::U8))?;
    let n = valid.len();
    if blake3.len() != n * 32 || paths.len() != n * width || labels.len() != n * 2 {
        bail!(
            "{}: the columns blake3, source_path, labels and valid hold different row counts",
            dir.display()
        );
    }
    let names = npy_label_names(dir)?;
    Ok((
        names,
        Identity {
            from: 0,
            blake3,
            source_path: paths
                .chunks(width.max(1))
                .map(|b| {
                    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
                    String::from_utf8_lossy(&b[..end]).into_owned()
                })
                .collect(),
            labels: labels
                .chunks_exact(2)
                .map(|b| i16::from_le_bytes([b[0], b[1]]))
                .collect(),
            valid,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ledger::row_meta;
    use half::f16;

    fn append(outputs: &mut OutputSet, settings: &Settings, split: usize, rows: &[(&str, u8)]) {
        let row_len = settings.features.shape().row_len();
        let metas: Vec<_> = rows
            .iter()
            .map(|(path, h)| row_meta(path, &[*h; 32], (split as i16 + 1) % 3))
            .collect();
        let mel = vec![f16::ZERO; rows.len() * row_len];
        outputs
            .append_splits(&[(split, &mel, None, &metas)])
            .unwrap();
    }

    fn record(batch: &mut ManifestBatch, h: u8, at: (u8, u64), label: i16, paths: &[&str]) {
        batch.put_content(
            &[h; 32],
            &ContentRecord {
                row: Some(RowRef {
                    split: at.0,
                    row: at.1,
                }),
                label,
                valid: true,
                paths: paths.iter().map(|p| p.to_string()).collect(),
            },
        );
        for p in paths {
            batch.put_file(
                p,
                &FileRecord {
                    hash: Some([h; 32]),
                    size: 100,
                    mtime_ns: 1,
                    quarantine: None,
                    updated_ms: 0,
                },
            );
        }
    }

    /// A batch committed to the outputs and lost by the manifest, with each case of
    /// [`adopt_tail`]: new bytes at a recorded path (its old row turns invalid), bytes whose
    /// row moved to another split (the old one retired), and a second valid row for bytes that
    /// have one in that split (which the ledger never makes: superseded).
    #[test]
    fn a_lost_batch_is_adopted_as_the_ledger_decided_it() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::in_folder(dir.path());
        let header = OutputHeader {
            labels: s.labels.names.clone(),
            features: s.features.clone(),
            path_bytes: s.outputs.path_bytes,
        };
        let manifest = Manifest::open(&crate::staging::manifest_dir(&s)).unwrap();
        let mut outputs = OutputSet::create(&s.paths.output, &s.outputs, &header, false).unwrap();
        // Recorded: A (LEAK/a.wav) and B (LEAK/b.wav) in training, C in validation.
        append(
            &mut outputs,
            &s,
            0,
            &[("LEAK/a.wav", 0xA), ("LEAK/b.wav", 0xB)],
        );
        append(&mut outputs, &s, 1, &[("NORMAL/c.wav", 0xC)]);
        outputs.commit().unwrap();
        let mut batch = ManifestBatch::default();
        record(&mut batch, 0xA, (0, 0), 1, &["LEAK/a.wav"]);
        record(&mut batch, 0xB, (0, 1), 1, &["LEAK/b.wav"]);
        record(&mut batch, 0xC, (1, 0), 2, &["NORMAL/c.wav"]);
        for (split, n) in [2, 1, 0].into_iter().enumerate() {
            batch.put_rows(split, n);
        }
        batch.put_meta("labels", &serde_json::to_string(&s.labels.names).unwrap());
        manifest.apply(batch).unwrap();
        // The lost batch: a second row for A in training, LEAK/a.wav now holding D, and B's
        // row made anew in validation for NORMAL/b2.wav (its training row retired: invalid).
        append(
            &mut outputs,
            &s,
            0,
            &[("LEAK/z.wav", 0xA), ("LEAK/a.wav", 0xD)],
        );
        append(&mut outputs, &s, 1, &[("NORMAL/b2.wav", 0xB)]);
        outputs.set_valid(0, 1, false).unwrap();
        outputs.commit().unwrap();
        outputs.close().unwrap();

        let adopted = adopt_tail(&s, &manifest).unwrap().expect("rows to adopt");
        assert_eq!(
            adopted,
            Adopted {
                rows: [2, 1, 0],
                superseded: 1
            }
        );
        assert_eq!(manifest.rows().unwrap(), [4, 2, 0]);
        let content = |h: u8| manifest.get_content(&[h; 32]).unwrap().unwrap();
        let at = |split, row| Some(RowRef { split, row });
        // A lost its only path to D: invalid, its row kept. The second A row is nobody's.
        assert_eq!((content(0xA).row, content(0xA).valid), (at(0, 0), false));
        assert!(content(0xA).paths.is_empty());
        assert_eq!(content(0xD).row, at(0, 3));
        assert!(content(0xD).valid && content(0xD).paths == ["LEAK/a.wav"]);
        // B's row is the new one; LEAK/b.wav left B in that batch, and is read again.
        assert_eq!((content(0xB).row, content(0xB).valid), (at(1, 1), true));
        assert_eq!(content(0xB).paths, ["LEAK/b.wav", "NORMAL/b2.wav"]);
        assert_eq!(content(0xC).row, at(1, 0));
        for p in ["LEAK/a.wav", "LEAK/b.wav", "NORMAL/b2.wav"] {
            assert_eq!(manifest.get_file(p).unwrap().unwrap().size, u64::MAX, "{p}");
        }
        assert!(manifest.get_file("LEAK/z.wav").unwrap().is_none());
        assert_eq!(
            manifest.get_file("NORMAL/c.wav").unwrap().unwrap().size,
            100
        );
        // The outputs: the retired, emptied and superseded rows invalid, no row cut.
        let cols = crate::output::read::read(&s).unwrap();
        let valid: Vec<Vec<u8>> = cols.splits.iter().map(|c| c.valid.clone()).collect();
        assert_eq!(valid[0], [0, 0, 0, 1]);
        assert_eq!(valid[1], [1, 1]);
        // Done: nothing left to adopt.
        assert!(adopt_tail(&s, &manifest).unwrap().is_none());
    }
}
