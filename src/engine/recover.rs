//! Rebuilding a lost manifest from the outputs (README, "Operations": a lost state).
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

use super::manifest::{ContentRecord, FileRecord, Manifest, ManifestBatch, RowRef};
use crate::config::{Settings, SPLITS};
use crate::identity::Hash;
use crate::output::read::{npy_label_names, npy_rows, SwmrSplit};
use crate::output::ColumnType;
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

/// One split's identity columns, committed rows only.
struct Identity {
    blake3: Vec<u8>,
    source_path: Vec<String>,
    labels: Vec<i16>,
    valid: Vec<u8>,
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
    let out = &settings.paths.output;
    let mut found = Recovered::default();
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
            read_hdf5(&path)?
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
    if found.rows == [0; 3] {
        return Ok(None);
    }

    // Contents: the valid row of each hash; otherwise its last invalid row (the one a returning
    // path revives, as the ledger would have kept it).
    let mut contents: BTreeMap<Hash, ContentRecord> = BTreeMap::new();
    let mut owners: BTreeMap<String, Hash> = BTreeMap::new();
    for (split, ids) in splits.iter().enumerate() {
        let Some(ids) = ids else { continue };
        for row in 0..ids.labels.len() {
            let hash: Hash = ids.blake3[row * 32..row * 32 + 32]
                .try_into()
                .expect("32-byte rows");
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

    let mut batch = ManifestBatch::default();
    for (hash, c) in &contents {
        batch.put_content(hash, c);
    }
    for (path, hash) in &owners {
        batch.put_file(
            path,
            &FileRecord {
                hash: Some(*hash),
                // No file has a negative size or this mtime: the reconcile reads it again.
                size: u64::MAX,
                mtime_ns: i64::MIN,
                quarantine: None,
                updated_ms: super::manifest::now_ms(),
            },
        );
    }
    for (split, &rows) in found.rows.iter().enumerate() {
        batch.put_rows(split, rows);
    }
    let labels = label_names.unwrap_or_else(|| settings.labels.names.clone());
    let configured = settings.labels.names.len().min(labels.len());
    batch.put_meta("labels", &serde_json::to_string(&labels)?);
    batch.put_meta(
        "appended_labels",
        &serde_json::to_string(&labels[configured..])?,
    );
    manifest.apply(batch)?;
    manifest.flush()?;
    Ok(Some(found))
}

fn read_hdf5(path: &Path) -> Result<(Vec<String>, Identity)> {
    let mut f = SwmrSplit::open(path)?;
    let labels = f.label_names()?;
    let n = f.refresh()?;
    let (width, blake3) = f.read_bytes("blake3", 0..n)?;
    if width != 32 {
        bail!("{}: blake3 rows of {width} bytes, not 32", path.display());
    }
    let narrow = f.read_rows("", 0..n)?;
    Ok((
        labels,
        Identity {
            blake3,
            source_path: f.read_strings("source_path", 0..n)?,
            labels: narrow.labels,
            valid: narrow.valid,
        },
    ))
}

fn read_npy(settings: &Settings, dir: &Path) -> Result<(Vec<String>, Identity)> {
    let descr = |t| crate::output::npy::descr(t);
    let path_type = ColumnType::Str(settings.outputs.path_bytes);
    let (_, blake3) = npy_rows(dir, "blake3", &descr(ColumnType::U8))?;
    let (width, paths) = npy_rows(dir, "source_path", &descr(path_type))?;
    let (_, labels) = npy_rows(dir, "labels", &descr(ColumnType::I16))?;
    let (_, valid) = npy_rows(dir, "valid", &descr(ColumnType::U8))?;
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
