//! Migrations: the version check run whenever a persisted store is opened, and the upgrade
//! steps between versions. The layouts themselves are described in `migrations/`.

use crate::engine::records::{
    encode, ContentRecord, FileRecord, ManifestError, RowRef, StoredReason,
};
use std::collections::BTreeMap;

/// Version 1 records (JSON, `refs` counts) as they were written.
#[derive(serde::Deserialize)]
struct FileV1 {
    hash: Option<String>,
    size: u64,
    mtime_ns: i64,
    state: String,
    reason: Option<String>,
    updated_ms: i64,
}

#[derive(serde::Deserialize)]
struct ContentV1 {
    split: u8,
    row: u64,
    label: i16,
    valid: bool,
}

/// The manifest's trees, as the upgrades read and write them (below the manifest's own type,
/// which calls the upgrades when it opens an older layout).
pub struct Trees<'a> {
    pub path: &'a str,
    pub files: &'a sled::Tree,
    pub content: &'a sled::Tree,
    pub meta: &'a sled::Tree,
}

/// 1 -> 2: records become postcard with a version byte; a content record lists the paths
/// holding its bytes (v1 kept a count), in byte order so the first is the owner; the row count
/// of each split is recorded. Idempotent: a step interrupted before the version is written runs
/// again from the v1 records it left. The caller flushes.
pub fn upgrade_manifest_1_to_2(t: &Trees) -> Result<(), ManifestError> {
    let (files, content, meta) = (t.files, t.content, t.meta);
    let db = |source| ManifestError::Db {
        path: t.path.to_string(),
        source,
    };
    let corrupt = |key: &[u8], e: serde_json::Error| ManifestError::Corrupt {
        path: t.path.to_string(),
        key: String::from_utf8_lossy(key).to_string(),
        message: format!("version 1 record: {e}"),
    };
    let is_v1 = |v: &[u8]| v.first() == Some(&b'{');
    let mut paths: BTreeMap<[u8; 32], Vec<String>> = BTreeMap::new();
    let mut new_files = sled::Batch::default();
    for kv in files.iter() {
        let (k, v) = kv.map_err(db)?;
        if !is_v1(&v) {
            continue;
        }
        let old: FileV1 = serde_json::from_slice(&v).map_err(|e| corrupt(&k, e))?;
        let hash = old
            .hash
            .as_deref()
            .and_then(|h| blake3::Hash::from_hex(h).ok())
            .map(|h| *h.as_bytes());
        let quarantine = (old.state != "committed").then(|| StoredReason {
            kind: "unknown".into(),
            text: old.reason.unwrap_or_default(),
        });
        if let (None, Some(h)) = (&quarantine, hash) {
            paths
                .entry(h)
                .or_default()
                .push(String::from_utf8_lossy(&k).to_string());
        }
        let rec = FileRecord {
            hash,
            size: old.size,
            mtime_ns: old.mtime_ns,
            quarantine,
            updated_ms: old.updated_ms,
        };
        new_files.insert(k, encode(&rec));
    }
    let mut rows = [0u64; 3];
    let mut new_content = sled::Batch::default();
    for kv in content.iter() {
        let (k, v) = kv.map_err(db)?;
        if !is_v1(&v) || k.len() != 32 {
            continue;
        }
        let old: ContentV1 = serde_json::from_slice(&v).map_err(|e| corrupt(&k, e))?;
        let mut hash = [0u8; 32];
        hash.copy_from_slice(&k);
        let mut p = paths.remove(&hash).unwrap_or_default();
        p.sort_unstable();
        let split = old.split.min(2);
        rows[split as usize] = rows[split as usize].max(old.row + 1);
        let rec = ContentRecord {
            row: Some(RowRef {
                split,
                row: old.row,
            }),
            label: old.label,
            valid: old.valid && !p.is_empty(),
            paths: p,
        };
        new_content.insert(k, encode(&rec));
    }
    files.apply_batch(new_files).map_err(db)?;
    content.apply_batch(new_content).map_err(db)?;
    for (split, n) in rows.iter().enumerate() {
        let key = format!("rows_{split}");
        if content.get(&key).map_err(db)?.is_none() {
            content.insert(key, n.to_string().as_bytes()).map_err(db)?;
        }
    }
    meta.insert("schema_version", b"2").map_err(db)?;
    Ok(())
}

/// The same rule for an output file's `schema_version` attribute: one check, beside the
/// output layout, that every reader of outputs calls.
pub use crate::output::check_output_version;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::OUTPUT_SCHEMA_VERSION;

    fn newest(prefix: &str) -> u32 {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().into_string().unwrap();
                name.strip_prefix(prefix)?.strip_suffix(".md")?.parse().ok()
            })
            .max()
            .unwrap()
    }

    #[test]
    fn code_versions_match_the_newest_description() {
        assert_eq!(
            newest("manifest-v"),
            crate::engine::records::MANIFEST_SCHEMA_VERSION
        );
        assert_eq!(newest("outputs-v"), OUTPUT_SCHEMA_VERSION);
    }

    #[test]
    fn newer_and_zero_versions_are_refused() {
        use crate::engine::records::{check_version, MANIFEST_SCHEMA_VERSION};
        assert!(check_version("m", MANIFEST_SCHEMA_VERSION).is_ok());
        assert!(check_version("m", MANIFEST_SCHEMA_VERSION + 1).is_err());
        assert!(check_version("m", 0).is_err());
        assert!(check_output_version(
            std::path::Path::new("o"),
            Ok(u64::from(OUTPUT_SCHEMA_VERSION) + 1)
        )
        .unwrap_err()
        .to_string()
        .contains("newer"));
    }
}
