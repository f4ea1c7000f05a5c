//! Manifest: the durable record of what has been ingested (sled), written only by the engine's
//! commit stage. Every path the engine has judged (the bytes it holds, or why it is quarantined),
//! every content hash with its row and the paths that hold it, and the row count of each split.
//! A path counts as ingested exactly when its record holds a hash and no quarantine reason.
//!
//! Values are a version byte followed by the record in postcard (a compact serde format: cheap
//! to write on the bulk path); `meta/schema_version` is checked on open, and older layouts are
//! upgraded in place (see `migrations/` and [`Manifest::upgrade`]).

use crate::identity::Hash;
use serde::{Deserialize, Serialize};
use std::mem::ManuallyDrop;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use super::records::decode;
pub use super::records::{
    encode, ContentRecord, FileRecord, ManifestError, RowRef, StoredReason, MANIFEST_SCHEMA_VERSION,
};

/// The sled database and its trees. The handles are dropped by [`Manifest`]'s own `Drop`, where
/// a panic of sled's is contained (see there).
pub struct Manifest {
    path: String,
    db: ManuallyDrop<sled::Db>,
    files: ManuallyDrop<sled::Tree>,
    content: ManuallyDrop<sled::Tree>,
    meta: ManuallyDrop<sled::Tree>,
    /// Quarantined paths and why (path -> reason text): what `status` lists.
    quarantine: ManuallyDrop<sled::Tree>,
    /// Content hashes held by two paths or more (hash -> nothing): where `status` looks for
    /// label conflicts.
    shared: ManuallyDrop<sled::Tree>,
    /// The counts `status` shows, kept by every [`Manifest::apply`] (stored as `meta/summary`
    /// with each batch), so that nothing reads every record while recordings wait.
    summary: std::sync::Mutex<Summary>,
    /// sled's log file and its folder, synced by [`Manifest::flush`] (see there).
    log_file: Option<(std::fs::File, std::fs::File)>,
    /// sled returned an I/O error: this handle may hold changes it could not write, and sled
    /// refuses further work once its log failed. The owner reopens the manifest from the disk.
    failed: AtomicBool,
}

/// What `status` counts, kept up to date by every [`Manifest::apply`] instead of read from every
/// record: files holding a row and quarantined ones, and per split the valid rows and the
/// valid rows per label id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    pub committed: u64,
    pub quarantined: u64,
    pub valid: [u64; 3],
    pub per_label: [std::collections::BTreeMap<i16, u64>; 3],
}

impl Summary {
    fn file(&mut self, rec: &FileRecord, sign: i64) {
        let n = if rec.quarantine.is_some() {
            &mut self.quarantined
        } else {
            &mut self.committed
        };
        *n = n.wrapping_add_signed(sign);
    }

    fn content(&mut self, rec: &ContentRecord, sign: i64) {
        let Some(at) = rec.row.filter(|_| rec.valid) else {
            return;
        };
        let split = at.split as usize % 3;
        self.valid[split] = self.valid[split].wrapping_add_signed(sign);
        let per = self.per_label[split].entry(rec.label).or_default();
        *per = per.wrapping_add_signed(sign);
        if *per == 0 {
            self.per_label[split].remove(&rec.label);
        }
    }

    /// Count every record (a manifest without a summary, and the tests' oracle).
    pub fn count(m: &Manifest) -> Result<Summary, ManifestError> {
        let mut s = Summary::default();
        for f in m.files() {
            s.file(&f?.1, 1);
        }
        for c in m.contents() {
            s.content(&c?.1, 1);
        }
        Ok(s)
    }
}

/// A set of changes applied atomically per tree (sled batches).
#[derive(Default)]
pub struct ManifestBatch {
    files: Vec<(String, Option<FileRecord>)>,
    content: Vec<(Hash, Option<ContentRecord>)>,
    rows: Vec<(usize, u64)>,
    meta: sled::Batch,
    pub len: usize,
}

impl ManifestBatch {
    pub fn put_file(&mut self, rel: &str, rec: &FileRecord) {
        self.files.push((rel.to_string(), Some(rec.clone())));
        self.len += 1;
    }
    pub fn remove_file(&mut self, rel: &str) {
        self.files.push((rel.to_string(), None));
        self.len += 1;
    }
    pub fn put_content(&mut self, hash: &Hash, rec: &ContentRecord) {
        self.content.push((*hash, Some(rec.clone())));
        self.len += 1;
    }
    pub fn remove_content(&mut self, hash: &Hash) {
        self.content.push((*hash, None));
        self.len += 1;
    }
    /// Rows of `split` once this batch is applied. Kept in the content tree (short keys never
    /// clash with 32-byte hashes) so it lands atomically with the content records.
    pub fn put_rows(&mut self, split: usize, rows: u64) {
        self.rows.push((split, rows));
        self.len += 1;
    }
    pub fn put_meta(&mut self, key: &str, value: &str) {
        self.meta.insert(key.as_bytes(), value.as_bytes());
        self.len += 1;
    }
    /// The whole label list (`labels`), and the names past the first `configured` (the
    /// configured `labels.names`) as `appended_labels`, which keep their ids across rebuilds.
    pub fn put_labels(&mut self, labels: &[String], configured: usize) {
        let appended = &labels[configured.min(labels.len())..];
        let json = |l: &[String]| serde_json::to_string(l).expect("strings serialise");
        self.put_meta("labels", &json(labels));
        self.put_meta("appended_labels", &json(appended));
    }
}

/// Bytes of records sled keeps decoded in memory, per open manifest ([`set_cache_mb`]).
static CACHE_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(4 << 20);

/// The memory a manifest opened from now on may keep as a cache of its records
/// (`ingest.manifest_cache_mb`, in sled's count of the bytes on disk: about twice that resident).
/// sled's own bookkeeping comes on top: a structure per page of the open manifest. A pass over the
/// records keeps no more than the cache with the sled this crate carries (vendor/README.md); sled
/// as published kept up to ~35 MB of the pages a pass read (docs/operations.md, "Start-up,
/// rescans, one writer, a lost state").
pub fn set_cache_mb(mb: u64) {
    CACHE_BYTES.store(mb.max(1) << 20, Ordering::Relaxed);
}

/// sled releases its file lock from a background thread after the last handle is dropped, so a
/// reopen right after a close in the same process can find it still held: wait for it briefly.
/// Another process holding it is refused by the writer lock before we get here.
pub(super) fn open_db(dir: &Path) -> Result<sled::Db, sled::Error> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    loop {
        match sled::Config::new()
            .path(dir)
            .cache_capacity(CACHE_BYTES.load(Ordering::Relaxed))
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

/// Make a folder sled just created (or `compact` just filled) durable: its files' contents and
/// those of its `blobs` folder, their entries, and its own entry in its parent.
pub(super) fn sync_new_folder(dir: &Path) -> std::io::Result<()> {
    for folder in [dir.join("blobs"), dir.to_path_buf()] {
        if !folder.exists() {
            continue;
        }
        for entry in std::fs::read_dir(&folder)? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                std::fs::File::open(entry.path())?.sync_all()?;
            }
        }
        std::fs::File::open(&folder)?.sync_all()?;
    }
    match dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => std::fs::File::open(parent)?.sync_all(),
        None => Ok(()),
    }
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Manifest {
    /// Open (creating if absent), check the schema version, upgrade an older layout.
    pub fn open(dir: &Path) -> Result<Manifest, ManifestError> {
        let path = dir.display().to_string();
        let db_err = |source| ManifestError::Db {
            path: path.clone(),
            source,
        };
        super::compact::restore(dir);
        let created = !dir.exists();
        for file in ["db", "conf"] {
            crate::output::take_stale_write_error(&dir.join(file));
        }
        let db = open_db(dir).map_err(db_err)?;
        if created {
            // sled syncs what it writes into its files, not the folder entries that name them:
            // without this, a power cut soon after the first start can lose the whole manifest.
            sync_new_folder(dir).map_err(|e| db_err(sled::Error::Io(e)))?;
        }
        let files = db.open_tree("files").map_err(db_err)?;
        let content = db.open_tree("content").map_err(db_err)?;
        let meta = db.open_tree("meta").map_err(db_err)?;
        let quarantine = db.open_tree("quarantine").map_err(db_err)?;
        let shared = db.open_tree("shared").map_err(db_err)?;
        let m = Manifest {
            path: path.clone(),
            db: ManuallyDrop::new(db),
            files: ManuallyDrop::new(files),
            content: ManuallyDrop::new(content),
            meta: ManuallyDrop::new(meta),
            quarantine: ManuallyDrop::new(quarantine),
            shared: ManuallyDrop::new(shared),
            summary: Default::default(),
            log_file: std::fs::File::open(dir.join("db"))
                .and_then(|f| Ok((f, std::fs::File::open(dir)?)))
                .ok(),
            failed: AtomicBool::new(false),
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
                super::records::check_version(&path, found)?;
                if found < MANIFEST_SCHEMA_VERSION {
                    m.upgrade(found)?;
                }
            }
        }
        if let Some(v) = m.meta.get("summary").map_err(db_err)? {
            let summary = decode(&v).map_err(|e| m.corrupt("meta/summary".into(), e))?;
            *m.summary.lock().unwrap_or_else(|p| p.into_inner()) = summary;
        }
        Ok(m)
    }

    /// Open the closed manifest in `dir` and close it again, so that sled folds the log written
    /// since its last open into a new snapshot (it does so only when it opens: 25-35 ms at
    /// 240,000 recordings, against 11-16 ms for an open with nothing to fold; docs/benchmarks.md).
    /// Called where nothing waits (the service's idle close), so that the reopen the next
    /// recording waits for has nothing to fold. Only sled's own files change; a failure is
    /// logged and left to that reopen, which meets the same work and any error again. sled can
    /// panic when its files fail half-way through an open (see the [`Drop`] below): that panic
    /// is contained here too, and the service goes on.
    pub fn fold_log(dir: &Path) {
        let t = std::time::Instant::now();
        let folded = crate::logging::contain(|| {
            // Test builds (feature `failpoints`): `FAILPOINTS=fold-log=panic` panics here, as
            // sled would on a disk that fails while it opens (tests/faults.rs).
            fail::fail_point!("fold-log");
            Manifest::open(dir).map(drop)
        });
        match folded {
            Ok(Ok(())) => log::debug!(
                "manifest {}: log folded into its snapshot in {:.0} ms",
                dir.display(),
                t.elapsed().as_secs_f64() * 1e3
            ),
            Ok(Err(e)) => log::debug!("manifest {}: not folded while idle: {e}", dir.display()),
            Err(_) => log::warn!(
                "manifest {}: sled failed while folding its log at the idle close (a disk error?): left to the next open",
                dir.display()
            ),
        }
    }

    /// The counts `status` shows (see [`Summary`]).
    pub fn summary(&self) -> Summary {
        self.summary
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Quarantined paths with their reasons, in path order.
    pub fn quarantined(
        &self,
    ) -> impl Iterator<Item = Result<(String, String), ManifestError>> + '_ {
        self.quarantine.iter().map(move |kv| {
            let (k, v) = kv.map_err(|e| self.err(e))?;
            Ok((
                String::from_utf8_lossy(&k).to_string(),
                String::from_utf8_lossy(&v).to_string(),
            ))
        })
    }

    /// Content records whose bytes two paths or more hold.
    pub fn shared_contents(
        &self,
    ) -> impl Iterator<Item = Result<(Hash, ContentRecord), ManifestError>> + '_ {
        self.shared.iter().filter_map(move |kv| {
            let hash: Hash = match kv {
                Ok((k, _)) => k.as_ref().try_into().ok()?,
                Err(e) => return Some(Err(self.err(e))),
            };
            self.get_content(&hash)
                .transpose()
                .map(|r| r.map(|c| (hash, c)))
        })
    }

    /// The derived trees and the summary, made from every record: the upgrade from version 2,
    /// which had neither.
    pub(crate) fn derive_summary(&self) -> Result<(), ManifestError> {
        let mut quarantine = sled::Batch::default();
        for f in self.files() {
            let (path, rec) = f?;
            if let Some(q) = rec.quarantine {
                quarantine.insert(path.as_bytes(), q.text.as_bytes());
            }
        }
        let mut shared = sled::Batch::default();
        for c in self.contents() {
            let (hash, rec) = c?;
            if rec.paths.len() > 1 {
                shared.insert(&hash[..], &[][..]);
            }
        }
        let summary = Summary::count(self)?;
        self.quarantine
            .apply_batch(quarantine)
            .map_err(|e| self.err(e))?;
        self.shared.apply_batch(shared).map_err(|e| self.err(e))?;
        self.meta
            .insert("summary", encode(&summary))
            .map_err(|e| self.err(e))?;
        *self.summary.lock().unwrap_or_else(|p| p.into_inner()) = summary;
        Ok(())
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub(crate) fn err(&self, source: sled::Error) -> ManifestError {
        if matches!(source, sled::Error::Io(_)) {
            self.failed.store(true, Ordering::Release);
        }
        ManifestError::Db {
            path: self.path.clone(),
            source,
        }
    }

    /// Upgrade an older layout in place, one version at a time (see `migrations/`). 1 -> 2 is
    /// [`crate::migrate`]'s, on the raw trees; 2 -> 3 derives the summary `status` reads and the
    /// trees of quarantined paths and shared contents from the records. Idempotent: a step
    /// interrupted before its version is written runs again.
    fn upgrade(&self, from: u32) -> Result<(), ManifestError> {
        if from == 1 {
            crate::migrate::upgrade_manifest_1_to_2(&crate::migrate::Trees {
                path: &self.path,
                files: &self.files,
                content: &self.content,
                meta: &self.meta,
            })?;
            self.flush()?;
            log::info!(
                "manifest {}: upgraded from schema version 1 to 2",
                self.path
            );
        }
        self.derive_summary()?;
        self.meta
            .insert("schema_version", b"3")
            .map_err(|e| self.err(e))?;
        self.flush()?;
        log::info!(
            "manifest {}: upgraded from schema version 2 to 3",
            self.path
        );
        Ok(())
    }

    /// sled met an I/O error through this handle: what it holds in memory may differ from the
    /// disk, so it must not be used again; reopen the manifest (dropping this handle does no I/O
    /// once sled has failed, and a panic of sled's while closing is contained).
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    fn corrupt(&self, key: String, message: String) -> ManifestError {
        ManifestError::Corrupt {
            path: self.path.clone(),
            key,
            message,
        }
    }

    pub fn get_meta(&self, key: &str) -> Result<Option<String>, ManifestError> {
        Ok(self
            .meta
            .get(key)
            .map_err(|e| self.err(e))?
            .map(|v| String::from_utf8_lossy(&v).to_string()))
    }

    /// Store `key` = `value`; a value stored already is not written again (a reopen of the
    /// service sets the same settings each time).
    pub fn set_meta(&self, key: &str, value: &str) -> Result<bool, ManifestError> {
        if self.get_meta(key)?.as_deref() == Some(value) {
            return Ok(false);
        }
        self.meta
            .insert(key, value.as_bytes())
            .map_err(|e| self.err(e))?;
        Ok(true)
    }

    /// The whole label list the outputs were written with (their `labels_json`), in id order;
    /// None for a manifest that never stored it.
    pub fn stored_labels(&self) -> Result<Option<Vec<String>>, ManifestError> {
        self.get_meta("labels")?
            .map(|s| {
                serde_json::from_str(&s)
                    .map_err(|e| self.corrupt("meta/labels".into(), e.to_string()))
            })
            .transpose()
    }

    /// Labels appended under `labels.unknown = "append"`, in id order after `labels.names`.
    pub fn appended_labels(&self) -> Result<Vec<String>, ManifestError> {
        Ok(self
            .get_meta("appended_labels")?
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or_default())
    }

    /// Rows each split's outputs hold as of the last commit (rows never move, so this only grows).
    pub fn rows(&self) -> Result<[u64; 3], ManifestError> {
        let mut rows = [0u64; 3];
        for (split, n) in rows.iter_mut().enumerate() {
            let key = format!("rows_{split}");
            let v = self
                .content
                .get(key.as_bytes())
                .map_err(|e| self.err(e))?
                .map(|v| String::from_utf8_lossy(&v).to_string());
            if let Some(v) = v {
                *n = v
                    .parse()
                    .map_err(|_| self.corrupt(format!("content/rows_{split}"), v))?;
            }
        }
        Ok(rows)
    }

    pub fn get_file(&self, rel: &str) -> Result<Option<FileRecord>, ManifestError> {
        match self.files.get(rel.as_bytes()).map_err(|e| self.err(e))? {
            None => Ok(None),
            Some(v) => decode(&v)
                .map(Some)
                .map_err(|m| self.corrupt(rel.to_string(), m)),
        }
    }

    pub fn get_content(&self, hash: &Hash) -> Result<Option<ContentRecord>, ManifestError> {
        match self.content.get(&hash[..]).map_err(|e| self.err(e))? {
            None => Ok(None),
            Some(v) => decode(&v)
                .map(Some)
                .map_err(|m| self.corrupt(crate::identity::hex(hash), m)),
        }
    }

    /// Paths recorded under folder `prefix` (relative, without the trailing `/`).
    pub fn files_under(&self, prefix: &str) -> Result<Vec<String>, ManifestError> {
        let p = format!("{}/", prefix.trim_end_matches('/'));
        self.files
            .scan_prefix(p.as_bytes())
            .keys()
            .map(|k| {
                k.map(|k| String::from_utf8_lossy(&k).to_string())
                    .map_err(|e| self.err(e))
            })
            .collect()
    }

    /// Every file record, in path order.
    pub fn files(&self) -> impl Iterator<Item = Result<(String, FileRecord), ManifestError>> + '_ {
        self.files.iter().map(move |kv| self.file_entry(kv))
    }

    /// The file records from path `from` (included; None: the first) to `to` (excluded; None:
    /// past the last), in path order.
    pub fn files_between(
        &self,
        from: Option<&str>,
        to: Option<&str>,
    ) -> impl Iterator<Item = Result<(String, FileRecord), ManifestError>> + '_ {
        use std::ops::Bound;
        let from = from.map_or(Bound::Unbounded, |p| Bound::Included(p.as_bytes().to_vec()));
        let to = to.map_or(Bound::Unbounded, |p| Bound::Excluded(p.as_bytes().to_vec()));
        self.files
            .range::<Vec<u8>, _>((from, to))
            .map(move |kv| self.file_entry(kv))
    }

    fn file_entry(
        &self,
        kv: sled::Result<(sled::IVec, sled::IVec)>,
    ) -> Result<(String, FileRecord), ManifestError> {
        let (k, v) = kv.map_err(|e| self.err(e))?;
        let key = String::from_utf8_lossy(&k).to_string();
        let rec = decode(&v).map_err(|m| self.corrupt(key.clone(), m))?;
        Ok((key, rec))
    }

    /// Every content record.
    pub fn contents(
        &self,
    ) -> impl Iterator<Item = Result<(Hash, ContentRecord), ManifestError>> + '_ {
        self.content.iter().filter_map(move |kv| {
            let (k, v) = match kv {
                Ok(kv) => kv,
                Err(e) => return Some(Err(self.err(e))),
            };
            if k.len() != 32 {
                return None; // the row counts
            }
            let mut hash = [0u8; 32];
            hash.copy_from_slice(&k);
            Some(
                decode(&v)
                    .map(|rec| (hash, rec))
                    .map_err(|m| self.corrupt(crate::identity::hex(&hash), m)),
            )
        })
    }

    /// Apply `batch`, keeping the [`Summary`] and the trees derived from the records (the
    /// quarantined paths, the shared contents) in step: each changed record's old value is read
    /// (a point read per change; what the same batch changed before counts as old).
    pub fn apply(&self, batch: ManifestBatch) -> Result<(), ManifestError> {
        let mut guard = self.summary.lock().unwrap_or_else(|p| p.into_inner());
        let mut summary = guard.clone();
        let [content, shared, files, quarantine, mut meta] = self.changes(batch, &mut summary)?;
        if summary != *guard {
            meta.insert("summary", encode(&summary));
        }
        self.commit_transaction([
            (&*self.content, content),
            (&*self.shared, shared),
            (&*self.files, files),
            (&*self.quarantine, quarantine),
            (&*self.meta, meta),
        ])?;
        *guard = summary;
        Ok(())
    }

    /// [`Manifest::apply`] for a manifest that is thrown away whole unless it is complete (the
    /// staging manifest of `rebuild`, swapped in only at the end): the same records, derived
    /// trees and summary, without the transaction, and written by the threads of `pool` at
    /// once. sled serialises batches and transactions on one lock but lets plain inserts run
    /// side by side, so on a many-core host this is what keeps the manifest from capping the
    /// bulk pipeline (`docs/benchmarks.md`). Each thread owns the keys that hash to it, so the
    /// changes to one key stay in batch order; each change's old value is what its insert or
    /// remove returns (no separate read).
    pub fn apply_bulk(
        &self,
        batch: ManifestBatch,
        pool: &rayon::ThreadPool,
    ) -> Result<(), ManifestError> {
        let parts = pool.current_num_threads().max(1);
        let file_part = |rel: &str| {
            // FNV-1a: cheap and spread enough for paths.
            let h = rel.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            });
            (h % parts as u64) as usize
        };
        let content_part = |hash: &Hash| {
            (u64::from_le_bytes(hash[..8].try_into().expect("8 bytes")) % parts as u64) as usize
        };
        type Olds<T> = Result<Vec<(usize, Option<T>)>, ManifestError>;
        let mut olds: Vec<(Olds<FileRecord>, Olds<ContentRecord>)> = Vec::new();
        pool.install(|| {
            use rayon::prelude::*;
            (0..parts)
                .into_par_iter()
                .map(|part| {
                    let files = batch
                        .files
                        .iter()
                        .enumerate()
                        .filter(|(_, (rel, _))| file_part(rel) == part)
                        .map(|(i, (rel, new))| Ok((i, self.put_file_bulk(rel, new.as_ref())?)))
                        .collect();
                    let content = batch
                        .content
                        .iter()
                        .enumerate()
                        .filter(|(_, (hash, _))| content_part(hash) == part)
                        .map(|(i, (hash, new))| Ok((i, self.put_content_bulk(hash, new.as_ref())?)))
                        .collect();
                    (files, content)
                })
                .collect_into_vec(&mut olds);
        });
        let mut guard = self.summary.lock().unwrap_or_else(|p| p.into_inner());
        let mut summary = guard.clone();
        for (files, content) in olds {
            for (i, old) in files? {
                if let Some(old) = &old {
                    summary.file(old, -1);
                }
                if let Some(new) = &batch.files[i].1 {
                    summary.file(new, 1);
                }
            }
            for (i, old) in content? {
                if let Some(old) = &old {
                    summary.content(old, -1);
                }
                if let Some(new) = &batch.content[i].1 {
                    summary.content(new, 1);
                }
            }
        }
        for (split, rows) in &batch.rows {
            self.content
                .insert(
                    format!("rows_{split}").as_bytes(),
                    rows.to_string().as_bytes(),
                )
                .map_err(|e| self.err(e))?;
        }
        let mut meta = batch.meta;
        if summary != *guard {
            meta.insert("summary", encode(&summary));
        }
        self.meta.apply_batch(meta).map_err(|e| self.err(e))?;
        *guard = summary;
        Ok(())
    }

    /// One file record of [`Manifest::apply_bulk`] and its quarantine entry; the old record.
    fn put_file_bulk(
        &self,
        rel: &str,
        new: Option<&FileRecord>,
    ) -> Result<Option<FileRecord>, ManifestError> {
        let key = rel.as_bytes();
        let old = match new {
            Some(rec) => self.files.insert(key, encode(rec)),
            None => self.files.remove(key),
        }
        .map_err(|e| self.err(e))?
        .map(|v| decode::<FileRecord>(&v).map_err(|m| self.corrupt(rel.to_string(), m)))
        .transpose()?;
        let was_quarantined = old.as_ref().is_some_and(|o| o.quarantine.is_some());
        match new.and_then(|r| r.quarantine.as_ref()) {
            Some(q) => {
                self.quarantine
                    .insert(key, q.text.as_bytes())
                    .map_err(|e| self.err(e))?;
            }
            None if was_quarantined => {
                self.quarantine.remove(key).map_err(|e| self.err(e))?;
            }
            None => {}
        }
        Ok(old)
    }

    /// One content record of [`Manifest::apply_bulk`] and its shared entry; the old record.
    fn put_content_bulk(
        &self,
        hash: &Hash,
        new: Option<&ContentRecord>,
    ) -> Result<Option<ContentRecord>, ManifestError> {
        let key = &hash[..];
        let old = match new {
            Some(rec) => self.content.insert(key, encode(rec)),
            None => self.content.remove(key),
        }
        .map_err(|e| self.err(e))?
        .map(|v| {
            decode::<ContentRecord>(&v).map_err(|m| self.corrupt(crate::identity::hex(hash), m))
        })
        .transpose()?;
        let was_shared = old.as_ref().is_some_and(|o| o.paths.len() > 1);
        match new {
            Some(rec) if rec.paths.len() > 1 => {
                self.shared.insert(key, &[][..]).map_err(|e| self.err(e))?;
            }
            _ if was_shared => {
                self.shared.remove(key).map_err(|e| self.err(e))?;
            }
            _ => {}
        }
        Ok(old)
    }

    /// The sled batches of `batch` for the content, shared, files, quarantine and meta trees,
    /// and `summary` moved by the records it replaces and adds.
    fn changes(
        &self,
        batch: ManifestBatch,
        summary: &mut Summary,
    ) -> Result<[sled::Batch; 5], ManifestError> {
        let (mut files, mut quarantine) = (sled::Batch::default(), sled::Batch::default());
        let mut seen_files: std::collections::HashMap<&str, Option<&FileRecord>> =
            Default::default();
        for (rel, new) in &batch.files {
            let old = match seen_files.get(rel.as_str()) {
                Some(old) => old.cloned(),
                None => self.get_file(rel)?,
            };
            if let Some(old) = &old {
                summary.file(old, -1);
            }
            match new {
                Some(rec) => {
                    summary.file(rec, 1);
                    files.insert(rel.as_bytes(), encode(rec));
                    match &rec.quarantine {
                        Some(q) => quarantine.insert(rel.as_bytes(), q.text.as_bytes()),
                        None => quarantine.remove(rel.as_bytes()),
                    }
                }
                None => {
                    files.remove(rel.as_bytes());
                    quarantine.remove(rel.as_bytes());
                }
            }
            seen_files.insert(rel, new.as_ref());
        }
        let (mut content, mut shared) = (sled::Batch::default(), sled::Batch::default());
        let mut seen: std::collections::HashMap<&Hash, Option<&ContentRecord>> = Default::default();
        for (hash, new) in &batch.content {
            let old = match seen.get(hash) {
                Some(old) => old.cloned(),
                None => self.get_content(hash)?,
            };
            if let Some(old) = &old {
                summary.content(old, -1);
            }
            match new {
                Some(rec) => {
                    summary.content(rec, 1);
                    content.insert(&hash[..], encode(rec));
                    if rec.paths.len() > 1 {
                        shared.insert(&hash[..], &[][..]);
                    } else {
                        shared.remove(&hash[..]);
                    }
                }
                None => {
                    content.remove(&hash[..]);
                    shared.remove(&hash[..]);
                }
            }
            seen.insert(hash, new.as_ref());
        }
        for (split, rows) in &batch.rows {
            content.insert(
                format!("rows_{split}").as_bytes(),
                rows.to_string().as_bytes(),
            );
        }
        Ok([content, shared, files, quarantine, batch.meta])
    }

    /// One transaction over the five trees: a crash keeps all of the batch or none of it, so
    /// the summary never drifts from the records it counts.
    fn commit_transaction(
        &self,
        trees: [(&sled::Tree, sled::Batch); 5],
    ) -> Result<(), ManifestError> {
        use sled::transaction::{ConflictableTransactionError, TransactionError};
        use sled::Transactional;
        let [(c0, content), (s0, shared), (f0, files), (q0, quarantine), (m0, meta)] = trees;
        (c0, s0, f0, q0, m0)
            .transaction(|(c, s, f, q, m)| {
                c.apply_batch(&content)?;
                s.apply_batch(&shared)?;
                f.apply_batch(&files)?;
                q.apply_batch(&quarantine)?;
                m.apply_batch(&meta)?;
                Ok::<(), ConflictableTransactionError<()>>(())
            })
            .map_err(|e| match e {
                TransactionError::Storage(e) => self.err(e),
                TransactionError::Abort(()) => unreachable!("the transaction never aborts"),
            })
    }

    /// Durable on disk (sled flushes on its own every few hundred ms; commits call this).
    ///
    /// sled 0.34 makes its log stable with `sync_file_range` on Linux, which neither writes the
    /// file's metadata (its size, as the log grows) nor flushes the disk's cache: durable across
    /// a crash of the process, not a power cut (the power-cut tests lost flushed batches). So
    /// the log file is synced here as well, and its folder, whose entries sled changes when it
    /// writes a snapshot (renamed into place, without a sync of the folder).
    pub fn flush(&self) -> Result<(), ManifestError> {
        self.db.flush().map_err(|e| self.err(e))?;
        if let Some((log, dir)) = &self.log_file {
            log.sync_data()
                .and_then(|()| dir.sync_all())
                .map_err(|e| self.err(sled::Error::Io(e)))?;
        }
        Ok(())
    }
}

/// The threads [`Manifest::apply_bulk`] writes with: one per core this process may use, at most
/// eight (sled's inserts stop scaling before that; `benches/rebuild.rs --ceiling`). Kept for the
/// life of the process; idle, they sleep.
pub fn bulk_pool() -> &'static rayon::ThreadPool {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        rayon::ThreadPoolBuilder::new()
            .num_threads(cores.clamp(1, 8))
            .thread_name(|i| format!("ailhd-manifest-{i}"))
            .build()
            .expect("manifest threads start")
    })
}

/// sled 0.34 flushes and fsyncs in its log's `Drop` and panics there when the disk fails
/// (`sync_all().unwrap()`, sled's pagecache/logger.rs): dropping a manifest while the disk fails
/// would kill the service. So the manifest is flushed here first, with the error handled, and
/// sled's handles are dropped where a panic is contained. Nothing recorded is lost either way:
/// what sled had made durable stays, and the rest (never acknowledged) is found again by the
/// next start's comparison with the tree. A panic inside that drop is printed by the panic hook
/// and logged here; the process goes on.
impl Drop for Manifest {
    fn drop(&mut self) {
        if !self.failed() {
            if let Err(e) = self.db.flush() {
                log::warn!("manifest {}: flushing before closing: {e}", self.path);
            }
        }
        // SAFETY: each handle is taken once, here, and the struct is never used again.
        let handles = unsafe {
            (
                ManuallyDrop::take(&mut self.shared),
                ManuallyDrop::take(&mut self.quarantine),
                ManuallyDrop::take(&mut self.meta),
                ManuallyDrop::take(&mut self.content),
                ManuallyDrop::take(&mut self.files),
                ManuallyDrop::take(&mut self.db),
            )
        };
        if crate::logging::contain(move || drop(handles)).is_err() {
            log::error!(
                "manifest {}: sled failed while closing (a disk error): what it had made durable is kept, the rest is taken up again at the next open",
                self.path
            );
        }
    }
}

/// The names of sled's snapshot files in the manifest folder `dir`, sorted (tests).
#[cfg(test)]
pub(crate) fn snapshot_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("snap."))
        .collect();
    names.sort();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> FileRecord {
        FileRecord {
            hash: Some([7; 32]),
            size: 10,
            mtime_ns: 5,
            quarantine: None,
            updated_ms: 0,
        }
    }

    #[test]
    fn records_round_trip_and_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let m = Manifest::open(dir.path()).unwrap();
            let mut b = ManifestBatch::default();
            b.put_file("LEAK/a.wav", &rec());
            b.put_content(
                &[7; 32],
                &ContentRecord {
                    row: Some(RowRef { split: 0, row: 3 }),
                    label: 1,
                    valid: true,
                    paths: vec!["LEAK/a.wav".into()],
                },
            );
            b.put_rows(0, 4);
            m.apply(b).unwrap();
            m.flush().unwrap();
        }
        let m = Manifest::open(dir.path()).unwrap();
        assert_eq!(m.get_file("LEAK/a.wav").unwrap(), Some(rec()));
        let c = m.get_content(&[7; 32]).unwrap().unwrap();
        assert_eq!(c.row, Some(RowRef { split: 0, row: 3 }));
        assert_eq!(c.owner(), Some("LEAK/a.wav"));
        assert_eq!(m.rows().unwrap(), [4, 0, 0]);
        assert_eq!(m.files().count(), 1);
        assert_eq!(m.files_under("LEAK").unwrap(), vec!["LEAK/a.wav"]);
        assert!(m.files_under("LEA").unwrap().is_empty());
    }

    /// A process stopped while sled wrote a snapshot of its page table (at an open that
    /// recovered log, at a close, every so many writes) leaves `snap.<lsn>.generating` half
    /// written. sled as published read it as the newest snapshot and refused every later open
    /// ("Read corrupted data": `status` failed, `rebuild` refused to start, and `run` set the
    /// manifest aside). It is ignored, and removed with the next snapshot.
    #[test]
    fn a_snapshot_left_half_written_by_a_kill_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let put = |m: &Manifest, name: &str| {
            let mut b = ManifestBatch::default();
            b.put_file(name, &rec());
            m.apply(b).unwrap();
            m.flush().unwrap();
        };
        put(&Manifest::open(dir.path()).unwrap(), "LEAK/a.wav");
        // The open after a write recovers the log and writes a snapshot of it.
        drop(Manifest::open(dir.path()).unwrap());
        let snapshots = || snapshot_names(dir.path());
        let done = snapshots();
        assert_eq!(done.len(), 1, "one snapshot after a reopen: {done:?}");
        let bytes = std::fs::read(dir.path().join(&done[0])).unwrap();
        let leftover = dir.path().join("snap.00000000FFFFFFFF.generating");
        std::fs::write(&leftover, &bytes[..bytes.len() / 2]).unwrap();

        let m = Manifest::open(dir.path()).expect("a half-written snapshot stops no open");
        assert_eq!(m.get_file("LEAK/a.wav").unwrap(), Some(rec()));
        put(&m, "LEAK/b.wav");
        drop(m);
        let m = Manifest::open(dir.path()).unwrap();
        assert_eq!(m.files().count(), 2);
        drop(m);
        assert!(
            !leftover.exists(),
            "the next snapshot removes the leftover: {:?}",
            snapshots()
        );
    }

    /// Bytes of `dir`'s files: their sizes, and the blocks the file system holds for them.
    fn sizes_on_disk(dir: &Path) -> (u64, u64) {
        use std::os::unix::fs::MetadataExt;
        let (mut len, mut held) = (0, 0);
        for e in std::fs::read_dir(dir).unwrap() {
            let m = e.unwrap().metadata().unwrap();
            if m.is_file() {
                len += m.len();
                held += m.blocks() * 512;
            }
        }
        (len, held)
    }

    /// A manifest whose records were rewritten until sled's log has free segments: every open
    /// leaves those segments deallocated (holes) instead of writing them full of zeros again,
    /// and every record survives the reopens. With sled as published, each open wrote every
    /// free segment (~50 MB at 200,000 recordings) and the file held all of its blocks.
    #[test]
    fn reopening_leaves_the_logs_free_segments_unwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = |i: usize| format!("LEAK/S{i:05}~R1~20250118120530~100.wav");
        let record = |round: u64| FileRecord {
            size: 81_964 + round,
            ..rec()
        };
        let rounds = 12;
        {
            let m = Manifest::open(dir.path()).unwrap();
            for round in 0..rounds {
                for chunk in (0..4_000).collect::<Vec<_>>().chunks(500) {
                    let mut b = ManifestBatch::default();
                    for &i in chunk {
                        b.put_file(&path(i), &record(round));
                    }
                    m.apply(b).unwrap();
                    m.flush().unwrap();
                }
            }
        }
        let db = dir.path().join("db");
        let segment = 512 * 1024;
        for reopen in 0..3 {
            let m = Manifest::open(dir.path()).unwrap();
            m.flush().unwrap();
            drop(m);
            // sled closes from a background thread: the next open waits for its lock.
            let (len, held) = sizes_on_disk(dir.path());
            let db_len = std::fs::metadata(&db).unwrap().len();
            assert!(
                len >= held + segment,
                "reopen {reopen}: the manifest's files hold {held} of their {len} bytes \
                 (db {db_len}): no free segment of the log was left unallocated"
            );
        }
        let m = Manifest::open(dir.path()).unwrap();
        assert_eq!(m.files().count(), 4_000);
        for i in (0..4_000).step_by(397) {
            assert_eq!(m.get_file(&path(i)).unwrap(), Some(record(rounds - 1)));
        }
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

    #[test]
    fn a_record_of_another_version_is_reported_corrupt_not_misread() {
        let dir = tempfile::tempdir().unwrap();
        let m = Manifest::open(dir.path()).unwrap();
        m.files.insert("LEAK/a.wav", vec![9u8, 1, 2]).unwrap();
        let err = m.get_file("LEAK/a.wav").unwrap_err().to_string();
        assert!(
            err.contains("LEAK/a.wav") && err.contains("version 9"),
            "{err}"
        );
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

    /// One change of a random history for [`apply_bulk_matches_apply`]: a file (of 8 paths)
    /// put or removed, or a content (of 5) put or removed, with quarantines, shared contents,
    /// invalid rows and several labels among them.
    #[derive(Debug, Clone)]
    enum Change {
        File(u8, Option<(u8, bool)>),
        Content(u8, Option<(u8, u8, bool, u8)>),
    }

    fn change() -> impl proptest::strategy::Strategy<Value = Change> {
        use proptest::prelude::*;
        prop_oneof![
            (0..8u8, proptest::option::of((0..5u8, any::<bool>())))
                .prop_map(|(p, r)| Change::File(p, r)),
            (
                0..5u8,
                proptest::option::of((0..3u8, 0..3u8, any::<bool>(), 0..4u8))
            )
                .prop_map(|(h, r)| Change::Content(h, r)),
        ]
    }

    fn batch_of(changes: &[Change], rows: u64) -> ManifestBatch {
        let path = |p: u8| format!("L{}/f{p}.wav", p % 3);
        let mut b = ManifestBatch::default();
        for c in changes {
            match c {
                Change::File(p, None) => b.remove_file(&path(*p)),
                Change::File(p, Some((h, quarantined))) => b.put_file(
                    &path(*p),
                    &FileRecord {
                        hash: Some([*h; 32]),
                        quarantine: quarantined.then(|| StoredReason {
                            kind: "decode".into(),
                            text: format!("bad {p}"),
                        }),
                        ..rec()
                    },
                ),
                Change::Content(h, None) => b.remove_content(&[*h; 32]),
                Change::Content(h, Some((split, label, valid, paths))) => b.put_content(
                    &[*h; 32],
                    &ContentRecord {
                        row: Some(RowRef {
                            split: *split,
                            row: u64::from(*h),
                        }),
                        label: i16::from(*label),
                        valid: *valid,
                        paths: (0..*paths).map(path).collect(),
                    },
                ),
            }
        }
        b.put_rows(0, rows);
        b
    }

    fn trees(m: &Manifest) -> Vec<Vec<(sled::IVec, sled::IVec)>> {
        [&m.files, &m.content, &m.meta, &m.quarantine, &m.shared]
            .iter()
            .map(|t| t.iter().map(Result::unwrap).collect())
            .collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(60))]
        /// The bulk path (no transaction, several threads, old values from the inserts) leaves
        /// exactly the trees and summary of the transactional one, for any history of batches,
        /// repeated keys within a batch included; and the summary counts what the records say.
        #[test]
        fn apply_bulk_matches_apply(
            history in proptest::collection::vec(proptest::collection::vec(change(), 0..12), 1..6)
        ) {
            let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            let (one, bulk) = (Manifest::open(a.path()).unwrap(), Manifest::open(b.path()).unwrap());
            let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
            for (i, changes) in history.iter().enumerate() {
                one.apply(batch_of(changes, i as u64)).unwrap();
                bulk.apply_bulk(batch_of(changes, i as u64), &pool).unwrap();
            }
            proptest::prop_assert_eq!(trees(&one), trees(&bulk));
            let summary = bulk.summary.lock().unwrap().clone();
            proptest::prop_assert_eq!(&summary, &*one.summary.lock().unwrap());
            proptest::prop_assert_eq!(summary, Summary::count(&bulk).unwrap());
        }
    }

    /// Bytes the process's allocator holds for live allocations (glibc's count; the library's
    /// tests allocate through it).
    fn heap_in_use() -> usize {
        // SAFETY: mallinfo2 only reads the allocator's own statistics.
        let info = unsafe { libc::mallinfo2() };
        info.uordblks + info.hblkhd
    }

    use rusty_fork::rusty_fork_test;

    rusty_fork_test! {
        /// A pass over every record (the start's comparison of the tree with the manifest, a
        /// rescan) keeps no more of the manifest in memory than `ingest.manifest_cache_mb` says,
        /// whatever the manifest's size. sled 0.34 as published kept every page a pass read
        /// until 64 reads had queued in each of its cache's 256 shards: up to ~16,000 pages (35
        /// MB at 200,000 recordings), 14 MB of the 30,000 recordings here; vendor/README.md.
        /// In a process of its own (rusty-fork): the heap count is the whole process's.
        #[test]
        fn a_pass_over_the_records_keeps_no_more_than_the_cache() {
            const N: usize = 30_000;
            set_cache_mb(1);
            let dir = tempfile::tempdir().unwrap();
            {
                let m = Manifest::open(dir.path()).unwrap();
                for start in (0..N).step_by(1_000) {
                    let mut b = ManifestBatch::default();
                    for k in start..start + 1_000 {
                        let rel = format!("LEAK/S{:03}~R{k}~20250118120530~100.wav", k % 97);
                        let hash = *blake3::hash(&k.to_le_bytes()).as_bytes();
                        b.put_file(&rel, &FileRecord { hash: Some(hash), ..rec() });
                        b.put_content(
                            &hash,
                            &ContentRecord {
                                row: Some(RowRef { split: (k % 3) as u8, row: k as u64 }),
                                label: 0,
                                valid: true,
                                paths: vec![rel],
                            },
                        );
                    }
                    m.apply(b).unwrap();
                }
                m.flush().unwrap();
            }
            let m = Manifest::open(dir.path()).unwrap();
            let before = heap_in_use();
            assert_eq!(m.files().count(), N);
            assert_eq!(m.contents().count(), N);
            let kept = heap_in_use().saturating_sub(before);
            eprintln!("a pass over {N} recordings keeps {:.1} MB", kept as f64 / 1e6);
            // 1 MiB of cache in sled's count is about 2.5 MB of nodes (2.7 MB measured); sled as
            // published kept 14.0 MB here.
            assert!(kept < 5_000_000, "a pass kept {kept} bytes of the manifest in memory");
        }
    }
}
