//! Migrations: the version check run whenever a persisted store is opened, and the upgrade
//! steps between versions. The layouts themselves are described in `migrations/`.

use crate::engine::manifest::{
    encode, ContentRecord, FileRecord, Manifest, ManifestError, RowRef, StoredReason,
    MANIFEST_SCHEMA_VERSION,
};
use std::collections::BTreeMap;

/// Refuse a manifest newer than this binary (older ones are upgraded by [`upgrade_manifest`]).
pub fn check_manifest_version(path: &str, found: u32) -> Result<(), ManifestError> {
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

/// Upgrade a manifest in place, one version at a time (2 -> 3 below). 1 -> 2: records become postcard with a
/// version byte; a content record lists the paths holding its bytes (v1 kept a count), in byte
/// order so the first is the owner; the row count of each split is recorded. Idempotent: a
/// step interrupted before the version is written runs again from the v1 records it left.
pub fn upgrade_manifest(m: &Manifest, from: u32) -> Result<(), ManifestError> {
    if from == 1 {
        upgrade_manifest_1_to_2(m)?;
    }
    // 2 -> 3: the summary `status` reads and the trees of quarantined paths and shared
    // contents, derived from the records. Idempotent: derived again if interrupted.
    m.derive_summary()?;
    m.trees()
        .2
        .insert("schema_version", b"3")
        .map_err(|e| m.err(e))?;
    m.flush()?;
    log::info!("manifest {}: upgraded from schema version 2 to 3", m.path());
    Ok(())
}

fn upgrade_manifest_1_to_2(m: &Manifest) -> Result<(), ManifestError> {
    let (files, content, meta) = m.trees();
    let corrupt = |key: &[u8], e: serde_json::Error| ManifestError::Corrupt {
        path: m.path().to_string(),
        key: String::from_utf8_lossy(key).to_string(),
        message: format!("version 1 record: {e}"),
    };
    let is_v1 = |v: &[u8]| v.first() == Some(&b'{');
    let mut paths: BTreeMap<[u8; 32], Vec<String>> = BTreeMap::new();
    let mut new_files = sled::Batch::default();
    for kv in files.iter() {
        let (k, v) = kv.map_err(|e| m.err(e))?;
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
        let (k, v) = kv.map_err(|e| m.err(e))?;
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
    files.apply_batch(new_files).map_err(|e| m.err(e))?;
    content.apply_batch(new_content).map_err(|e| m.err(e))?;
    for (split, n) in rows.iter().enumerate() {
        let key = format!("rows_{split}");
        if content.get(&key).map_err(|e| m.err(e))?.is_none() {
            content
                .insert(key, n.to_string().as_bytes())
                .map_err(|e| m.err(e))?;
        }
    }
    meta.insert("schema_version", b"2").map_err(|e| m.err(e))?;
    m.flush()?;
    log::info!("manifest {}: upgraded from schema version 1 to 2", m.path());
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
        assert_eq!(newest("manifest-v"), MANIFEST_SCHEMA_VERSION);
        assert_eq!(newest("outputs-v"), OUTPUT_SCHEMA_VERSION);
    }

    #[test]
    fn a_version_1_manifest_is_upgraded_with_paths_and_row_counts() {
        let dir = tempfile::tempdir().unwrap();
        let h = [5u8; 32];
        let hex = crate::identity::hex(&h);
        {
            let db = sled::open(dir.path()).unwrap();
            let meta = db.open_tree("meta").unwrap();
            meta.insert("schema_version", b"1").unwrap();
            let files = db.open_tree("files").unwrap();
            for p in ["NORMAL/b.wav", "LEAK/a.wav"] {
                let v = format!(
                    r#"{{"v":"1","hash":"{hex}","size":3,"mtime_ns":4,"label":2,"split":1,"row":7,"state":"committed","reason":null,"updated_ms":1}}"#
                );
                files.insert(p, v.as_bytes()).unwrap();
            }
            files
                .insert("LEAK/bad.wav", &br#"{"v":"1","hash":null,"size":0,"mtime_ns":0,"label":null,"split":null,"row":null,"state":"quarantined","reason":"not a WAV file","updated_ms":1}"#[..])
                .unwrap();
            let content = db.open_tree("content").unwrap();
            content
                .insert(
                    &h[..],
                    &br#"{"v":"1","split":1,"row":7,"label":2,"valid":true,"refs":2}"#[..],
                )
                .unwrap();
            db.flush().unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        let m = Manifest::open(dir.path()).unwrap();
        assert_eq!(m.get_meta("schema_version").unwrap().as_deref(), Some("3"));
        let c = m.get_content(&h).unwrap().unwrap();
        assert_eq!(c.paths, vec!["LEAK/a.wav", "NORMAL/b.wav"]);
        assert_eq!(c.row, Some(RowRef { split: 1, row: 7 }));
        assert_eq!(m.rows().unwrap(), [0, 8, 0]);
        let bad = m.get_file("LEAK/bad.wav").unwrap().unwrap();
        assert_eq!(bad.quarantine.unwrap().text, "not a WAV file");
        assert_eq!(m.get_file("LEAK/a.wav").unwrap().unwrap().holds(), Some(&h));
        // 2 -> 3: the summary and the derived trees.
        let s = m.summary();
        assert_eq!((s.committed, s.quarantined, s.valid), (2, 1, [0, 1, 0]));
        assert_eq!(s.per_label[1].get(&2), Some(&1));
        let q: Vec<_> = m.quarantined().map(Result::unwrap).collect();
        assert_eq!(
            q,
            vec![("LEAK/bad.wav".to_string(), "not a WAV file".to_string())]
        );
        assert_eq!(m.shared_contents().count(), 1);
    }

    #[test]
    fn newer_and_zero_versions_are_refused() {
        assert!(check_manifest_version("m", MANIFEST_SCHEMA_VERSION).is_ok());
        assert!(check_manifest_version("m", MANIFEST_SCHEMA_VERSION + 1).is_err());
        assert!(check_manifest_version("m", 0).is_err());
        assert!(check_output_version(
            std::path::Path::new("o"),
            Ok(u64::from(OUTPUT_SCHEMA_VERSION) + 1)
        )
        .unwrap_err()
        .to_string()
        .contains("newer"));
    }
}
