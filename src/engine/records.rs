//! The manifest's records as stored, their versions and errors: what the manifest
//! ([`super::manifest`]) and the upgrades of older layouts ([`crate::migrate`]) both read.
//!
//! Values are a version byte followed by the record in postcard (a compact serde format: cheap
//! to write on the bulk path).

use crate::identity::Hash;
use serde::{Deserialize, Serialize};

/// Version of the manifest layout. The descriptions and upgrade steps live in `migrations/`.
pub const MANIFEST_SCHEMA_VERSION: u32 = 3;

/// First byte of every stored record: the layout it was written with.
const RECORD_VERSION: u8 = 2;

/// Why a path has no row, as stored: a stable kind (for metrics and tests) and the text an
/// operator reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredReason {
    pub kind: String,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileRecord {
    /// blake3 of the bytes (None when the file could not be read at all).
    pub hash: Option<Hash>,
    /// Size and mtime of the bytes judged: the file is looked at again only when they change.
    pub size: u64,
    pub mtime_ns: i64,
    /// Set when the path is quarantined; None when it holds a row (its content's).
    pub quarantine: Option<StoredReason>,
    /// Unix milliseconds when this record was written.
    pub updated_ms: i64,
}

impl FileRecord {
    /// The row this path holds, if it holds one.
    pub fn holds(&self) -> Option<&Hash> {
        match self.quarantine {
            None => self.hash.as_ref(),
            Some(_) => None,
        }
    }
}

/// Where a content's row is. Rows never move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RowRef {
    pub split: u8,
    pub row: u64,
}

/// A content hash: its row, and the live paths holding these bytes, in byte order. The first
/// path owns the row (its label and file-name columns are the row's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentRecord {
    /// None only while the row is being (re)made: its owner is queued for reading.
    pub row: Option<RowRef>,
    /// Label id written in the row.
    pub label: i16,
    /// Mirrors the outputs' `valid` column.
    pub valid: bool,
    pub paths: Vec<String>,
}

impl ContentRecord {
    pub fn owner(&self) -> Option<&str> {
        self.paths.first().map(|s| s.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest {path}: {source}")]
    Db { path: String, source: sled::Error },
    #[error("manifest {path} has schema version {found}, newer than this ailhd supports ({supported}): upgrade ailhd, or move the state directory away and run `ailhd rebuild`")]
    TooNew {
        path: String,
        found: u32,
        supported: u32,
    },
    #[error("manifest {path} has unknown schema version `{found}`: move the state directory away and run `ailhd rebuild`")]
    Unknown { path: String, found: String },
    #[error("manifest {path}: corrupt record for `{key}`: {message}")]
    Corrupt {
        path: String,
        key: String,
        message: String,
    },
}

pub fn encode<T: Serialize>(rec: &T) -> Vec<u8> {
    let mut out = vec![RECORD_VERSION];
    // Serialising plain structs into a Vec cannot fail.
    out.extend(postcard::to_stdvec(rec).expect("records serialise"));
    out
}

pub(crate) fn decode<T: for<'de> Deserialize<'de>>(v: &[u8]) -> Result<T, String> {
    match v.split_first() {
        Some((&RECORD_VERSION, body)) => postcard::from_bytes(body).map_err(|e| e.to_string()),
        Some((other, _)) => Err(format!("record version {other}")),
        None => Err("empty record".into()),
    }
}

/// Refuse a manifest newer than this binary (older ones are upgraded in place).
pub fn check_version(path: &str, found: u32) -> Result<(), ManifestError> {
    if found > MANIFEST_SCHEMA_VERSION {
        return Err(ManifestError::TooNew {
            path: path.to_string(),
            found,
            supported: MANIFEST_SCHEMA_VERSION,
        });
    }
    if found == 0 {
        return Err(ManifestError::Unknown {
            path: path.to_string(),
            found: found.to_string(),
        });
    }
    Ok(())
}
