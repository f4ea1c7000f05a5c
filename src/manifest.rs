//! Manifest: the single record of what has been ingested (sled). Every file with its hash, size,
//! mtime, label, split, row, state and reason; every content hash with its row. A file counts as
//! ingested exactly when its manifest record says `Committed`.
//!
//! Records are stored as a tagged, versioned enum (`{"v":1,...}`) so the format can change later;
//! `meta/schema_version` is checked on open against `migrations/`.

use crate::identity::Hash;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Version of the manifest layout. The descriptions and upgrade steps live in `migrations/`.
pub const MANIFEST_SCHEMA_VERSION: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileState {
    /// Has a complete row (its own, or the row of identical bytes seen first).
    Committed,
    /// Cannot be used; `reason` says why. Retried when the bytes change.
    Quarantined,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileRecord {
    /// blake3 of the bytes, hex (None when the file could not be read at all).
    pub hash: Option<String>,
    pub size: u64,
    pub mtime_ns: i64,
    pub label: Option<i16>,
    pub split: Option<u8>,
    pub row: Option<u64>,
    pub state: FileState,
    pub reason: Option<String>,
    /// Unix milliseconds when this record was written.
    pub updated_ms: i64,
}

impl FileRecord {
    /// A file that cannot be used, and why. Size and mtime say which bytes were judged, so the
    /// file is retried only when they change.
    pub fn quarantined(hash: Option<&Hash>, size: u64, mtime_ns: i64, reason: &str) -> FileRecord {
        FileRecord {
            hash: hash.map(crate::identity::hex),
            size,
            mtime_ns,
            label: None,
            split: None,
            row: None,
            state: FileState::Quarantined,
            reason: Some(reason.to_string()),
            updated_ms: now_ms(),
        }
    }
}

/// A content hash's row. Rows never move; `valid` mirrors the outputs' `valid` column.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentRecord {
    pub split: u8,
    pub row: u64,
    pub label: i16,
    pub valid: bool,
    /// How many paths hold these bytes now; the row turns invalid when the last one goes.
    pub refs: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "v")]
enum StoredFile {
    #[serde(rename = "1")]
    V1(FileRecord),
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "v")]
enum StoredContent {
    #[serde(rename = "1")]
    V1(ContentRecord),
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

pub struct Manifest {
    path: String,
    db: sled::Db,
    files: sled::Tree,
    content: sled::Tree,
    meta: sled::Tree,
}

/// A set of changes applied atomically per tree (sled batches).
#[derive(Default)]
pub struct ManifestBatch {
    files: sled::Batch,
    content: sled::Batch,
    pub len: usize,
}

impl ManifestBatch {
    pub fn put_file(&mut self, rel: &str, rec: &FileRecord) {
        let bytes = serde_json::to_vec(&StoredFile::V1(rec.clone())).unwrap();
        self.files.insert(rel.as_bytes(), bytes);
        self.len += 1;
    }
    pub fn remove_file(&mut self, rel: &str) {
        self.files.remove(rel.as_bytes());
        self.len += 1;
    }
    pub fn put_content(&mut self, hash: &Hash, rec: &ContentRecord) {
        let bytes = serde_json::to_vec(&StoredContent::V1(rec.clone())).unwrap();
        self.content.insert(&hash[..], bytes);
        self.len += 1;
    }
}

/// sled releases its file lock from a background thread after the last handle is dropped, so a
/// reopen right after a close in the same process can find it still held: wait for it briefly.
/// Another process holding it is refused by the writer lock before we get here.
fn open_db(dir: &Path) -> Result<sled::Db, sled::Error> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    loop {
        match sled::Config::new()
            .path(dir)
            .cache_capacity(64 << 20)
            .open()
        {
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock")
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Manifest {
    /// Open (creating if absent) and check the schema version.
    pub fn open(dir: &Path) -> Result<Manifest, ManifestError> {
        let path = dir.display().to_string();
        let db_err = |source| ManifestError::Db {
            path: path.clone(),
            source,
        };
        let db = open_db(dir).map_err(db_err)?;
        let files = db.open_tree("files").map_err(db_err)?;
        let content = db.open_tree("content").map_err(db_err)?;
        let meta = db.open_tree("meta").map_err(db_err)?;
        let m = Manifest {
            path: path.clone(),
            db,
            files,
            content,
            meta,
        };
        match m.meta.get("schema_version").map_err(db_err)? {
            None if m.files.is_empty() && m.content.is_empty() => {
                m.meta
                    .insert(
                        "schema_version",
                        MANIFEST_SCHEMA_VERSION.to_string().as_bytes(),
                    )
                    .map_err(db_err)?;
            }
            None => {
                return Err(ManifestError::Unknown {
                    path,
                    found: "(missing)".into(),
                })
            }
            Some(v) => {
                let text = String::from_utf8_lossy(&v).to_string();
                let found: u32 = text.parse().map_err(|_| ManifestError::Unknown {
                    path: path.clone(),
                    found: text.clone(),
                })?;
                crate::migrate::check_manifest_version(&path, found)?;
            }
        }
        Ok(m)
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    fn err(&self, source: sled::Error) -> ManifestError {
        ManifestError::Db {
            path: self.path.clone(),
            source,
        }
    }

    pub fn get_meta(&self, key: &str) -> Result<Option<String>, ManifestError> {
        Ok(self
            .meta
            .get(key)
            .map_err(|e| self.err(e))?
            .map(|v| String::from_utf8_lossy(&v).to_string()))
    }

    pub fn set_meta(&self, key: &str, value: &str) -> Result<(), ManifestError> {
        self.meta
            .insert(key, value.as_bytes())
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Labels appended under `labels.unknown = "append"`, in id order after `labels.names`.
    pub fn appended_labels(&self) -> Result<Vec<String>, ManifestError> {
        Ok(self
            .get_meta("appended_labels")?
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or_default())
    }

    pub fn get_file(&self, rel: &str) -> Result<Option<FileRecord>, ManifestError> {
        match self.files.get(rel.as_bytes()).map_err(|e| self.err(e))? {
            None => Ok(None),
            Some(v) => self.decode_file(rel, &v).map(Some),
        }
    }

    fn decode_file(&self, key: &str, v: &[u8]) -> Result<FileRecord, ManifestError> {
        match serde_json::from_slice::<StoredFile>(v) {
            Ok(StoredFile::V1(r)) => Ok(r),
            Err(e) => Err(ManifestError::Corrupt {
                path: self.path.clone(),
                key: key.to_string(),
                message: e.to_string(),
            }),
        }
    }

    pub fn get_content(&self, hash: &Hash) -> Result<Option<ContentRecord>, ManifestError> {
        match self.content.get(&hash[..]).map_err(|e| self.err(e))? {
            None => Ok(None),
            Some(v) => match serde_json::from_slice::<StoredContent>(&v) {
                Ok(StoredContent::V1(r)) => Ok(Some(r)),
                Err(e) => Err(ManifestError::Corrupt {
                    path: self.path.clone(),
                    key: crate::identity::hex(hash),
                    message: e.to_string(),
                }),
            },
        }
    }

    /// Every file record, in path order.
    pub fn files(&self) -> impl Iterator<Item = Result<(String, FileRecord), ManifestError>> + '_ {
        self.files.iter().map(move |kv| {
            let (k, v) = kv.map_err(|e| self.err(e))?;
            let key = String::from_utf8_lossy(&k).to_string();
            let rec = self.decode_file(&key, &v)?;
            Ok((key, rec))
        })
    }

    /// Every content record.
    pub fn contents(
        &self,
    ) -> impl Iterator<Item = Result<(Hash, ContentRecord), ManifestError>> + '_ {
        self.content.iter().map(move |kv| {
            let (k, v) = kv.map_err(|e| self.err(e))?;
            let mut hash = [0u8; 32];
            if k.len() == 32 {
                hash.copy_from_slice(&k);
            }
            match serde_json::from_slice::<StoredContent>(&v) {
                Ok(StoredContent::V1(r)) => Ok((hash, r)),
                Err(e) => Err(ManifestError::Corrupt {
                    path: self.path.clone(),
                    key: crate::identity::hex(&hash),
                    message: e.to_string(),
                }),
            }
        })
    }

    pub fn apply(&self, batch: ManifestBatch) -> Result<(), ManifestError> {
        self.files
            .apply_batch(batch.files)
            .map_err(|e| self.err(e))?;
        self.content
            .apply_batch(batch.content)
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Durable on disk (sled flushes on its own every few hundred ms; commits call this).
    pub fn flush(&self) -> Result<(), ManifestError> {
        self.db.flush().map_err(|e| self.err(e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(state: FileState) -> FileRecord {
        FileRecord {
            hash: Some("ab".into()),
            size: 10,
            mtime_ns: 5,
            label: Some(1),
            split: Some(0),
            row: Some(3),
            state,
            reason: None,
            updated_ms: 0,
        }
    }

    #[test]
    fn records_round_trip_and_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let m = Manifest::open(dir.path()).unwrap();
            let mut b = ManifestBatch::default();
            b.put_file("LEAK/a.wav", &rec(FileState::Committed));
            b.put_content(
                &[7; 32],
                &ContentRecord {
                    split: 0,
                    row: 3,
                    label: 1,
                    valid: true,
                    refs: 1,
                },
            );
            m.apply(b).unwrap();
            m.flush().unwrap();
        }
        let m = Manifest::open(dir.path()).unwrap();
        assert_eq!(
            m.get_file("LEAK/a.wav").unwrap(),
            Some(rec(FileState::Committed))
        );
        assert_eq!(m.get_content(&[7; 32]).unwrap().unwrap().row, 3);
        assert_eq!(m.files().count(), 1);
    }

    #[test]
    fn newer_schema_is_refused_with_advice() {
        let dir = tempfile::tempdir().unwrap();
        {
            let m = Manifest::open(dir.path()).unwrap();
            m.set_meta("schema_version", "99").unwrap();
            m.flush().unwrap();
        }
        let err = Manifest::open(dir.path()).err().unwrap().to_string();
        assert!(err.contains("newer") && err.contains("99"), "{err}");
    }
}
