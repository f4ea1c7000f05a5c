//! Ledger: the one place that decides what observations mean for rows, the manifest and the
//! quarantine (docs/design.md, "Identity, labels, splits"). `rebuild` and `run` both feed it; nothing
//! else decides. Given a batch of observations it returns a [`Plan`]: rows to append (with the
//! decoded recordings to featurise), in-place edits of existing rows, and the records to store.
//! The commit stage carries a plan out; the ledger never writes.
//!
//! The rules:
//! - identity is content: a path holds the row of its bytes; the bytes' live paths are kept in
//!   byte order and the first (smallest) owns the row: its label, `source_path` and file-name
//!   columns are the row's. When the owner goes, the next path takes the row over in place;
//!   when none is left the row turns invalid (and valid again if the bytes come back).
//! - new bytes at a known path leave the old bytes' row (superseded) and get their own;
//! - a path that cannot be used (unreadable, not decodable, not placeable, rejected by the
//!   source) is quarantined, and lets go of any row it held;
//! - the split is the owner's (hash, sensor or directory mode): a row never moves, so when a new
//!   owner belongs to another split the row is retired (invalid) and a new one is made there.
//!
//! Decisions of batches not yet committed stay in a write-back cache, so the next batch can be
//! decided while the previous one is still being featurised and written (stages overlap).
//! Entries leave the cache once the commit stage reports their batch durable.

use crate::config::Settings;
use crate::decode::Waveform;
use crate::engine::manifest::{now_ms, ContentRecord, FileRecord, Manifest, RowRef};
use crate::engine::outcome::{Load, Loaded, Observation, Reason};
use crate::identity::{self, Hash, LabelSet, Placement, PlacementError};
use crate::output::RowMeta;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Where the ledger reads what was committed before (the manifest; a map in tests).
pub trait Store {
    fn file(&self, rel: &str) -> anyhow::Result<Option<FileRecord>>;
    fn content(&self, hash: &Hash) -> anyhow::Result<Option<ContentRecord>>;
    /// Paths recorded under `folder`.
    fn files_under(&self, folder: &str) -> anyhow::Result<Vec<String>>;
}

impl Store for Manifest {
    fn file(&self, rel: &str) -> anyhow::Result<Option<FileRecord>> {
        Ok(self.get_file(rel)?)
    }
    fn content(&self, hash: &Hash) -> anyhow::Result<Option<ContentRecord>> {
        Ok(self.get_content(hash)?)
    }
    fn files_under(&self, folder: &str) -> anyhow::Result<Vec<String>> {
        Ok(Manifest::files_under(self, folder)?)
    }
}

/// A row to append: where it goes, its columns, and the recording to featurise.
#[derive(Debug)]
pub struct NewRow {
    pub row: u64,
    pub meta: RowMeta,
    pub wave: Waveform,
}

/// A change to a row that exists.
#[derive(Debug, Clone, PartialEq)]
pub enum Edit {
    Valid {
        at: RowRef,
        valid: bool,
    },
    /// The row has a new owner (or label): rewrite its label and path columns.
    Owner {
        at: RowRef,
        meta: RowMeta,
    },
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Rows appended.
    pub new_rows: usize,
    /// Paths that now hold bytes another path (or an earlier version) already had a row for.
    pub attached: usize,
    /// Paths seen again with the bytes they had.
    pub unchanged: usize,
    pub removed: usize,
    pub quarantined: usize,
}

/// What one batch of observations changes. Carried out by the commit stage in this order:
/// append `new_rows`, apply `edits`, commit the outputs, then store the records.
#[derive(Debug, Default)]
pub struct Plan {
    /// Batch number (the cache entries this plan wrote carry it).
    pub gen: u64,
    pub new_rows: [Vec<NewRow>; 3],
    pub edits: Vec<Edit>,
    pub files: Vec<(String, Option<FileRecord>)>,
    pub contents: Vec<(Hash, Option<ContentRecord>)>,
    /// The whole label list, when this batch appended labels.
    pub labels: Option<Vec<String>>,
    /// Rows per split once this plan is carried out.
    pub rows: [u64; 3],
    pub quarantined: Vec<(String, Reason)>,
    /// Paths to read again: their bytes' row must be made anew (in another split).
    pub reread: Vec<String>,
    /// Paths to look at again: they held the bytes a path with other names (hard links) no
    /// longer holds, so they may have changed with it without an event of their own.
    pub recheck: Vec<String>,
    /// When each path that now holds a row was seen complete (latency figures).
    pub seen: Vec<Instant>,
    pub counts: Counts,
    /// When the plan passed each stage (filled in by the stages).
    pub trace: super::Trace,
}

/// The rules, with their write-back cache.
pub struct Ledger {
    settings: Settings,
    labels: LabelSet,
    /// Rows per split, counting the plans decided so far.
    rows: [u64; 3],
    gen: u64,
    /// Decided records not yet known durable, with the batch that wrote them (None = removed).
    files: HashMap<String, (Option<FileRecord>, u64)>,
    contents: HashMap<Hash, (Option<ContentRecord>, u64)>,
    /// The newest batch the commit stage has made durable.
    committed: Arc<AtomicU64>,
    /// For a store that began empty and that only this ledger writes to (`rebuild`'s staging
    /// manifest): what it has decided so far. A key it never decided is not in the store, so
    /// most lookups (every new path, every new content) skip it.
    decided: Option<Decided>,
}

/// Fingerprints of the keys a [`Ledger`] decided. A fingerprint that matches (the key was
/// decided, or, rarely, another one shares its fingerprint) sends the lookup to the store, so
/// the answers are the store's own.
#[derive(Default)]
struct Decided {
    paths: HashSet<u64>,
    /// The first 8 bytes of the content hash (blake3: already uniform).
    contents: HashSet<u64>,
    hasher: std::hash::RandomState,
}

impl Decided {
    fn path_key(&self, rel: &str) -> u64 {
        self.hasher.hash_one(rel)
    }
    fn content_key(hash: &Hash) -> u64 {
        u64::from_le_bytes(hash[..8].try_into().expect("32 bytes"))
    }
}

/// How a path comes out of one observation.
enum Binding {
    Nothing,
    Quarantine {
        reason: Reason,
        hash: Option<Hash>,
        size: u64,
        mtime_ns: i64,
    },
    Holds {
        hash: Hash,
        size: u64,
        mtime_ns: i64,
    },
}

impl Ledger {
    pub fn new(settings: &Settings, labels: LabelSet, rows: [u64; 3]) -> Ledger {
        Ledger {
            settings: settings.clone(),
            labels,
            rows,
            gen: 0,
            files: HashMap::new(),
            contents: HashMap::new(),
            committed: Arc::new(AtomicU64::new(0)),
            decided: None,
        }
    }

    /// A ledger over an empty store that only it will write to (`rebuild` into staging): it
    /// asks the store only about keys it has decided before.
    pub fn for_empty_store(settings: &Settings, labels: LabelSet) -> Ledger {
        Ledger {
            decided: Some(Decided::default()),
            ..Ledger::new(settings, labels, [0; 3])
        }
    }

    /// The counter the commit stage advances when a plan is durable.
    pub fn committed_handle(&self) -> Arc<AtomicU64> {
        self.committed.clone()
    }

    pub fn labels(&self) -> &[String] {
        &self.labels.names
    }

    pub fn rows(&self) -> [u64; 3] {
        self.rows
    }

    /// Forget every decision not yet durable (the commit stage failed): the store is the truth
    /// again, and the outputs are cut back to its row counts by whoever reopens them.
    pub fn reset(&mut self, labels: LabelSet, rows: [u64; 3]) {
        self.files.clear();
        self.contents.clear();
        self.labels = labels;
        self.rows = rows;
    }

    /// What is recorded of `rel`, decided (durable or not) or stored.
    pub fn recorded(&self, store: &dyn Store, rel: &str) -> anyhow::Result<Option<FileRecord>> {
        self.file(store, rel)
    }

    fn file(&self, store: &dyn Store, rel: &str) -> anyhow::Result<Option<FileRecord>> {
        match (self.files.get(rel), &self.decided) {
            (Some((r, _)), _) => Ok(r.clone()),
            (None, Some(d)) if !d.paths.contains(&d.path_key(rel)) => Ok(None),
            (None, _) => store.file(rel),
        }
    }

    fn content(&self, store: &dyn Store, hash: &Hash) -> anyhow::Result<Option<ContentRecord>> {
        match (self.contents.get(hash), &self.decided) {
            (Some((c, _)), _) => Ok(c.clone()),
            (None, Some(d)) if !d.contents.contains(&Decided::content_key(hash)) => Ok(None),
            (None, _) => store.content(hash),
        }
    }

    fn paths_under(&self, store: &dyn Store, folder: &str) -> anyhow::Result<BTreeSet<String>> {
        let prefix = format!("{}/", folder.trim_end_matches('/'));
        let mut paths: BTreeSet<String> = store
            .files_under(folder)?
            .into_iter()
            .filter(|p| !matches!(self.files.get(p), Some((None, _))))
            .collect();
        for (p, (rec, _)) in &self.files {
            if rec.is_some() && p.starts_with(&prefix) {
                paths.insert(p.clone());
            }
        }
        Ok(paths)
    }

    fn place(&mut self, rel: &str, hash: &Hash) -> Result<Placement, PlacementError> {
        identity::place(&self.settings, &mut self.labels, rel, hash)
    }

    /// Take a content into this batch's working set, remembering how it was before.
    fn touch(&self, store: &dyn Store, work: &mut Batch, h: Hash) -> anyhow::Result<()> {
        if let std::collections::btree_map::Entry::Vacant(e) = work.before.entry(h) {
            let c = self.content(store, &h)?;
            work.current.insert(
                h,
                c.clone().unwrap_or(ContentRecord {
                    row: None,
                    label: 0,
                    valid: false,
                    paths: Vec::new(),
                }),
            );
            e.insert(c);
        }
        Ok(())
    }

    /// Decide a batch. Within a batch, the last observation of a path counts.
    pub fn decide(&mut self, store: &dyn Store, batch: Vec<Observation>) -> anyhow::Result<Plan> {
        let mut work = self.begin_batch();
        let labels_before = self.labels.names.len();
        for (rel, o) in self.last_per_path(store, batch)? {
            self.observe(store, &mut work, rel, o)?;
        }
        let contents = self.settle_contents(&mut work)?;
        Ok(self.finish(work, contents, labels_before))
    }

    /// Drop the cache entries that are durable now and open the next batch.
    fn begin_batch(&mut self) -> Batch {
        let durable = self.committed.load(Ordering::Acquire);
        self.files.retain(|_, (_, g)| *g > durable);
        self.contents.retain(|_, (_, g)| *g > durable);
        self.gen += 1;
        Batch {
            plan: Plan {
                gen: self.gen,
                ..Plan::default()
            },
            ..Batch::default()
        }
    }

    /// The last observation of each path, with a gone folder expanded to its recorded paths.
    fn last_per_path(
        &self,
        store: &dyn Store,
        batch: Vec<Observation>,
    ) -> anyhow::Result<BTreeMap<String, Observation>> {
        let mut last: BTreeMap<String, Observation> = BTreeMap::new();
        for o in batch {
            if let Observation::FolderGone(folder) = &o {
                for rel in self.paths_under(store, folder)? {
                    last.insert(rel.clone(), Observation::Gone(rel));
                }
            } else {
                last.insert(o.rel().to_string(), o);
            }
        }
        Ok(last)
    }

    /// One path's observation: what it binds the path to, letting go of the bytes it held.
    fn observe(
        &mut self,
        store: &dyn Store,
        work: &mut Batch,
        rel: String,
        o: Observation,
    ) -> anyhow::Result<()> {
        let old = self.file(store, &rel)?;
        let old_hold = old.as_ref().and_then(|f| f.holds().copied());
        let linked = matches!(
            &o,
            Observation::Loaded(Loaded {
                load: Load::Read { linked: true, .. },
                ..
            })
        );
        let binding = self.bind(&rel, o, work);
        let holds_now = match &binding {
            Binding::Holds { hash, .. } => Some(*hash),
            _ => None,
        };
        if let Some(h) = old_hold.filter(|h| Some(*h) != holds_now) {
            self.let_go(store, work, h, &rel)?;
            if linked {
                // Written in place through one of its names: the others that held these bytes
                // may be names of the same file.
                let others = &work.current.get(&h).expect("touched").paths;
                work.plan.recheck.extend(others.iter().cloned());
            }
        }
        match binding {
            Binding::Nothing => record_nothing(work, rel, old.is_some()),
            Binding::Quarantine {
                reason,
                hash,
                size,
                mtime_ns,
            } => record_quarantine(work, rel, reason, hash, size, mtime_ns),
            Binding::Holds {
                hash,
                size,
                mtime_ns,
            } => self.record_holds(store, work, rel, old_hold, hash, size, mtime_ns)?,
        }
        Ok(())
    }

    /// How an observation binds its path, by its kind.
    fn bind(&mut self, rel: &str, o: Observation, work: &mut Batch) -> Binding {
        match o {
            Observation::Gone(_)
            | Observation::Loaded(Loaded {
                load: Load::Vanished,
                ..
            }) => Binding::Nothing,
            Observation::FolderGone(_) => unreachable!("expanded by last_per_path"),
            Observation::Rejected {
                reason,
                size,
                mtime_ns,
                ..
            } => Binding::quarantine(reason, None, size, mtime_ns),
            Observation::Loaded(Loaded {
                load: Load::Unreadable(e),
                ..
            }) => Binding::quarantine(Reason::Unreadable(e), None, 0, 0),
            Observation::Loaded(Loaded {
                load:
                    Load::Rejected {
                        size,
                        mtime_ns,
                        reason,
                    },
                ..
            }) => Binding::quarantine(reason, None, size, mtime_ns),
            Observation::Loaded(Loaded {
                seen,
                load:
                    Load::Read {
                        size,
                        mtime_ns,
                        hash,
                        decoded,
                        ..
                    },
                ..
            }) => self.bind_read(rel, seen, (size, mtime_ns, hash), decoded, work),
        }
    }

    /// Bytes read: held when decoded and placeable (the wave kept for the row), else
    /// quarantined with their hash.
    fn bind_read(
        &mut self,
        rel: &str,
        seen: Option<Instant>,
        (size, mtime_ns, hash): (u64, i64, Hash),
        decoded: Result<Waveform, Reason>,
        work: &mut Batch,
    ) -> Binding {
        let placed =
            decoded.and_then(|w| self.place(rel, &hash).map(|_| w).map_err(Reason::Placement));
        match placed {
            Err(reason) => Binding::quarantine(reason, Some(hash), size, mtime_ns),
            Ok(wave) => {
                work.waves.entry(hash).or_insert(wave);
                if let Some(t) = seen {
                    work.seen.insert(rel.to_string(), t);
                }
                Binding::Holds {
                    hash,
                    size,
                    mtime_ns,
                }
            }
        }
    }

    /// `rel` no longer holds the bytes `h`: it leaves their paths.
    fn let_go(
        &self,
        store: &dyn Store,
        work: &mut Batch,
        h: Hash,
        rel: &str,
    ) -> anyhow::Result<()> {
        self.touch(store, work, h)?;
        let paths = &mut work.current.get_mut(&h).expect("touched").paths;
        if let Ok(i) = paths.binary_search_by(|p| p.as_str().cmp(rel)) {
            paths.remove(i);
        }
        Ok(())
    }

    /// `rel` holds `hash`: recorded, and among the bytes' paths (unchanged when it held them).
    #[allow(clippy::too_many_arguments)]
    fn record_holds(
        &self,
        store: &dyn Store,
        work: &mut Batch,
        rel: String,
        old_hold: Option<Hash>,
        hash: Hash,
        size: u64,
        mtime_ns: i64,
    ) -> anyhow::Result<()> {
        if old_hold == Some(hash) {
            work.plan.counts.unchanged += 1;
            // Its row may be waiting to be made anew (a reread).
            if self.content(store, &hash)?.is_none_or(|c| c.row.is_none()) {
                self.touch(store, work, hash)?;
            }
        } else {
            self.touch(store, work, hash)?;
            let paths = &mut work.current.get_mut(&hash).expect("touched").paths;
            if let Err(i) = paths.binary_search(&rel) {
                paths.insert(i, rel.clone());
            }
        }
        work.files.insert(
            rel,
            Some(FileRecord {
                hash: Some(hash),
                size,
                mtime_ns,
                quarantine: None,
                updated_ms: now_ms(),
            }),
        );
        Ok(())
    }

    /// Each touched content: who owns it now, and what its row needs.
    fn settle_contents(
        &mut self,
        work: &mut Batch,
    ) -> anyhow::Result<Vec<(Hash, Option<ContentRecord>)>> {
        let mut contents = Vec::new();
        for (hash, was) in std::mem::take(&mut work.before) {
            let c = work.current.remove(&hash).expect("touched");
            let settled = match c.paths.first().cloned() {
                None => orphaned(&mut work.plan, c, was.is_some()),
                Some(owner) => Some(self.owned(work, hash, c, was.as_ref(), owner)?),
            };
            if let Some(c) = settled {
                contents.push((hash, c));
            }
        }
        Ok(contents)
    }

    /// A content with an owner: its row stays when the owner's split is the row's, else it is
    /// retired and made anew in the owner's split.
    fn owned(
        &mut self,
        work: &mut Batch,
        hash: Hash,
        mut c: ContentRecord,
        was: Option<&ContentRecord>,
        owner: String,
    ) -> anyhow::Result<Option<ContentRecord>> {
        let placement = self
            .place(&owner, &hash)
            .map_err(|e| anyhow::anyhow!("{owner} was placed, now: {e}"))?;
        let meta = row_meta(&owner, &hash, placement.label);
        match c.row {
            Some(at) if at.split as usize == placement.split => {
                keep_row(&mut work.plan, &mut c, at, was, meta);
            }
            _ => self.remake_row(work, &mut c, hash, owner, meta, placement.split),
        }
        Ok(Some(c))
    }

    /// The owner's split is not the row's (or there is no row): the old row is retired, and a
    /// new one made from this batch's wave, or the owner is read again to make it.
    fn remake_row(
        &mut self,
        work: &mut Batch,
        c: &mut ContentRecord,
        hash: Hash,
        owner: String,
        meta: RowMeta,
        split: usize,
    ) {
        if let (Some(at), true) = (c.row, c.valid) {
            work.plan.edits.push(Edit::Valid { at, valid: false });
        }
        match work.waves.remove(&hash) {
            Some(wave) => {
                let row = self.rows[split];
                self.rows[split] += 1;
                c.row = Some(RowRef {
                    split: split as u8,
                    row,
                });
                c.valid = true;
                c.label = meta.label;
                work.plan.new_rows[split].push(NewRow { row, meta, wave });
                work.plan.counts.new_rows += 1;
            }
            None => {
                // The old row (if any) is retired above; the new one waits for the owner to
                // be read again.
                c.row = None;
                c.valid = false;
                work.plan.reread.push(owner);
            }
        }
    }

    /// The plan's records, written into the cache too, with the latency instants of the paths
    /// that hold rows, the label list when it grew and the row counts.
    fn finish(
        &mut self,
        work: Batch,
        contents: Vec<(Hash, Option<ContentRecord>)>,
        labels_before: usize,
    ) -> Plan {
        let Batch {
            mut plan,
            files,
            seen,
            ..
        } = work;
        for (rel, rec) in &files {
            if rec.as_ref().is_some_and(|r| r.holds().is_some()) {
                if let Some(t) = seen.get(rel) {
                    plan.seen.push(*t);
                }
            }
        }
        for (rel, rec) in files {
            if let Some(d) = &mut self.decided {
                d.paths.insert(d.path_key(&rel));
            }
            self.files.insert(rel.clone(), (rec.clone(), plan.gen));
            plan.files.push((rel, rec));
        }
        for (hash, c) in contents {
            if let Some(d) = &mut self.decided {
                d.contents.insert(Decided::content_key(&hash));
            }
            self.contents.insert(hash, (c.clone(), plan.gen));
            plan.contents.push((hash, c));
        }
        if self.labels.names.len() != labels_before {
            plan.labels = Some(self.labels.names.clone());
        }
        plan.rows = self.rows;
        plan
    }
}

/// One batch's working state while it is decided.
#[derive(Default)]
struct Batch {
    plan: Plan,
    /// Contents this batch touched, as they were before it.
    before: BTreeMap<Hash, Option<ContentRecord>>,
    /// The same contents as this batch leaves them.
    current: HashMap<Hash, ContentRecord>,
    /// The decoded recordings of the bytes read in this batch.
    waves: HashMap<Hash, Waveform>,
    files: BTreeMap<String, Option<FileRecord>>,
    /// When each path read in this batch was seen complete.
    seen: HashMap<String, Instant>,
}

impl Binding {
    fn quarantine(reason: Reason, hash: Option<Hash>, size: u64, mtime_ns: i64) -> Binding {
        Binding::Quarantine {
            reason,
            hash,
            size,
            mtime_ns,
        }
    }
}

/// A path that holds nothing: its record goes (it is counted removed) if it had one.
fn record_nothing(work: &mut Batch, rel: String, had_record: bool) {
    if had_record {
        work.plan.counts.removed += 1;
        work.files.insert(rel, None);
    }
}

/// A path that cannot be used: recorded with the reason (and the hash when its bytes were read).
fn record_quarantine(
    work: &mut Batch,
    rel: String,
    reason: Reason,
    hash: Option<Hash>,
    size: u64,
    mtime_ns: i64,
) {
    work.files.insert(
        rel.clone(),
        Some(FileRecord {
            hash,
            size,
            mtime_ns,
            quarantine: Some(reason.stored()),
            updated_ms: now_ms(),
        }),
    );
    work.plan.counts.quarantined += 1;
    work.plan.quarantined.push((rel, reason));
}

/// A content no path holds: its row turns invalid (the record stays, for when the bytes come
/// back); without a row its record goes (None: nothing to store). The outer Option is whether
/// anything is stored.
fn orphaned(
    plan: &mut Plan,
    mut c: ContentRecord,
    was_recorded: bool,
) -> Option<Option<ContentRecord>> {
    match c.row {
        Some(at) => {
            if c.valid {
                plan.edits.push(Edit::Valid { at, valid: false });
                c.valid = false;
            }
            Some(Some(c))
        }
        None if was_recorded => Some(None),
        None => None,
    }
}

/// The owner's split is the row's: the row is valid, and its label and path columns are
/// rewritten in place when the owner or its label changed.
fn keep_row(
    plan: &mut Plan,
    c: &mut ContentRecord,
    at: RowRef,
    was: Option<&ContentRecord>,
    meta: RowMeta,
) {
    if !c.valid {
        plan.edits.push(Edit::Valid { at, valid: true });
        c.valid = true;
    }
    let was_owner = was.and_then(|w| w.owner());
    if was_owner != Some(meta.source_path.as_str()) || c.label != meta.label {
        c.label = meta.label;
        plan.edits.push(Edit::Owner { at, meta });
    }
    plan.counts.attached += 1;
}

/// The columns of a row owned by `rel`.
pub fn row_meta(rel: &str, hash: &Hash, label: i16) -> RowMeta {
    let file_name = rel.rsplit('/').next().unwrap_or(rel);
    let name = identity::parse_name(file_name);
    RowMeta {
        label,
        blake3: *hash,
        source_path: rel.to_string(),
        sensor_id: name.sensor_id,
        recording_id: name.recording_id,
        recorded_at: name.recorded_at,
        gain_db: name.gain_db,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::SplitMode;
    use crate::decode::DecodeError;

    /// The committed state, as the commit stage would leave it, plus the rows as a reader sees
    /// them (valid, label, source_path per (split, row)).
    #[derive(Default)]
    pub(crate) struct Model {
        pub files: BTreeMap<String, FileRecord>,
        pub contents: BTreeMap<Hash, ContentRecord>,
        pub rows: BTreeMap<RowRef, (bool, RowMeta)>,
    }

    impl Store for Model {
        fn file(&self, rel: &str) -> anyhow::Result<Option<FileRecord>> {
            Ok(self.files.get(rel).cloned())
        }
        fn content(&self, hash: &Hash) -> anyhow::Result<Option<ContentRecord>> {
            Ok(self.contents.get(hash).cloned())
        }
        fn files_under(&self, folder: &str) -> anyhow::Result<Vec<String>> {
            let p = format!("{folder}/");
            Ok(self
                .files
                .keys()
                .filter(|k| k.starts_with(&p))
                .cloned()
                .collect())
        }
    }

    impl Model {
        pub(crate) fn commit(&mut self, plan: Plan, ledger: &Ledger) {
            for (split, rows) in plan.new_rows.into_iter().enumerate() {
                for r in rows {
                    let at = RowRef {
                        split: split as u8,
                        row: r.row,
                    };
                    assert!(!self.rows.contains_key(&at), "row {at:?} written twice");
                    self.rows.insert(at, (true, r.meta));
                }
            }
            for e in plan.edits {
                match e {
                    Edit::Valid { at, valid } => self.rows.get_mut(&at).expect("row").0 = valid,
                    Edit::Owner { at, meta } => {
                        let row = self.rows.get_mut(&at).expect("row");
                        assert_eq!(row.1.blake3, meta.blake3, "an owner edit keeps the content");
                        row.1 = meta;
                    }
                }
            }
            for (rel, rec) in plan.files {
                match rec {
                    Some(r) => self.files.insert(rel, r),
                    None => self.files.remove(&rel),
                };
            }
            for (h, c) in plan.contents {
                match c {
                    Some(c) => self.contents.insert(h, c),
                    None => self.contents.remove(&h),
                };
            }
            ledger.committed.store(plan.gen, Ordering::Release);
        }

        /// (source_path, label) of every valid row, by content.
        pub(crate) fn valid_rows(&self) -> BTreeMap<Hash, (String, i16, u8)> {
            let mut out = BTreeMap::new();
            for (at, (valid, meta)) in &self.rows {
                if *valid {
                    let prev = out.insert(
                        meta.blake3,
                        (meta.source_path.clone(), meta.label, at.split),
                    );
                    assert!(prev.is_none(), "two valid rows for one content");
                }
            }
            out
        }
    }

    pub(crate) fn wave() -> Waveform {
        Waveform::Pcm16(vec![0; 4])
    }

    pub(crate) fn read(rel: &str, bytes: &[u8]) -> Observation {
        Observation::Loaded(Loaded {
            rel: rel.into(),
            seen: None,
            load: Load::Read {
                size: bytes.len() as u64,
                mtime_ns: 1,
                hash: identity::content_hash(bytes),
                decoded: Ok(wave()),
                linked: false,
            },
        })
    }

    fn gone(rel: &str) -> Observation {
        Observation::Gone(rel.into())
    }

    fn h(bytes: &[u8]) -> Hash {
        identity::content_hash(bytes)
    }

    struct World {
        ledger: Ledger,
        model: Model,
    }

    impl World {
        fn new(mode: SplitMode) -> World {
            let mut s = Settings::default();
            s.splits.mode = mode;
            s.splits.directories.insert("a".into(), "training".into());
            s.splits.directories.insert("b".into(), "testing".into());
            let labels = LabelSet::new(&s.labels.names, &[], s.labels.unknown);
            World {
                ledger: Ledger::new(&s, labels, [0; 3]),
                model: Model::default(),
            }
        }
        fn apply(&mut self, obs: Vec<Observation>) -> (Counts, Vec<Edit>, Vec<String>) {
            let plan = self.ledger.decide(&self.model, obs).unwrap();
            let out = (plan.counts, plan.edits.clone(), plan.reread.clone());
            self.model.commit(plan, &self.ledger);
            out
        }
        fn row_of(&self, bytes: &[u8]) -> Option<(String, i16, u8)> {
            self.model.valid_rows().get(&h(bytes)).cloned()
        }
    }

    const LEAK: i16 = 2;
    const NORMAL: i16 = 3;

    /// A store that counts the lookups it answers, by key.
    struct Asked<'a> {
        model: &'a Model,
        keys: std::cell::RefCell<Vec<String>>,
    }

    impl Store for Asked<'_> {
        fn file(&self, rel: &str) -> anyhow::Result<Option<FileRecord>> {
            self.keys.borrow_mut().push(rel.to_string());
            self.model.file(rel)
        }
        fn content(&self, hash: &Hash) -> anyhow::Result<Option<ContentRecord>> {
            self.keys.borrow_mut().push(format!("{:02x}", hash[0]));
            self.model.content(hash)
        }
        fn files_under(&self, folder: &str) -> anyhow::Result<Vec<String>> {
            self.model.files_under(folder)
        }
    }

    /// `rebuild`'s ledger skips the store for keys it never decided (its store began empty),
    /// and still finds the ones it did once their cache entries are gone (durable).
    #[test]
    fn a_ledger_over_an_empty_store_asks_it_only_about_what_it_decided() {
        let s = Settings::default();
        let labels = LabelSet::new(&s.labels.names, &[], s.labels.unknown);
        let mut ledger = Ledger::for_empty_store(&s, labels);
        let mut model = Model::default();
        let decide = |ledger: &mut Ledger, model: &Model, obs| {
            let asked = Asked {
                model,
                keys: Default::default(),
            };
            let plan = ledger.decide(&asked, obs).unwrap();
            (plan, asked.keys.into_inner())
        };
        let (plan, asked) = decide(
            &mut ledger,
            &model,
            vec![read("LEAK/a.wav", b"x"), read("LEAK/b.wav", b"y")],
        );
        assert_eq!(plan.counts.new_rows, 2);
        assert!(
            asked.is_empty(),
            "nothing decided yet, nothing asked: {asked:?}"
        );
        model.commit(plan, &ledger);
        // x's records are durable (out of the cache): its copy must find them in the store.
        let (plan, asked) = decide(
            &mut ledger,
            &model,
            vec![read("NORMAL/c.wav", b"x"), read("NORMAL/d.wav", b"z")],
        );
        assert_eq!(plan.counts.new_rows, 1, "the copy of x shares x's row");
        assert_eq!(asked, [format!("{:02x}", h(b"x")[0])]);
        model.commit(plan, &ledger);
        // A path decided before is looked up (here: it is gone, and x's row goes to c).
        let (plan, asked) = decide(&mut ledger, &model, vec![gone("LEAK/a.wav")]);
        assert!(asked.contains(&"LEAK/a.wav".to_string()), "{asked:?}");
        model.commit(plan, &ledger);
        assert_eq!(model.valid_rows()[&h(b"x")].0, "NORMAL/c.wav");
    }

    #[test]
    fn the_smallest_path_owns_shared_bytes_and_hands_over_in_place() {
        let mut w = World::new(SplitMode::Hash);
        let (c, _, _) = w.apply(vec![read("NORMAL/x.wav", b"x")]);
        assert_eq!(c.new_rows, 1);
        // A copy under a smaller path takes the row over: label and path follow it, in place.
        let (c, edits, _) = w.apply(vec![read("LEAK/copy.wav", b"x")]);
        assert_eq!(c.new_rows, 0);
        assert!(
            matches!(&edits[..], [Edit::Owner { meta, .. }] if meta.source_path == "LEAK/copy.wav")
        );
        assert_eq!(w.row_of(b"x").unwrap().0, "LEAK/copy.wav");
        assert_eq!(w.row_of(b"x").unwrap().1, LEAK);
        // The copy goes: the row returns to the other path, same row.
        w.apply(vec![gone("LEAK/copy.wav")]);
        assert_eq!(w.row_of(b"x").unwrap().0, "NORMAL/x.wav");
        assert_eq!(w.row_of(b"x").unwrap().1, NORMAL);
        assert_eq!(w.model.rows.len(), 1, "no row was added");
        // The last path goes: the row turns invalid; the bytes come back: valid again.
        w.apply(vec![gone("NORMAL/x.wav")]);
        assert_eq!(w.row_of(b"x"), None);
        let (c, _, _) = w.apply(vec![read("NORMAL/y.wav", b"x")]);
        assert_eq!((c.new_rows, w.model.rows.len()), (0, 1));
        assert_eq!(w.row_of(b"x").unwrap().0, "NORMAL/y.wav");
    }

    #[test]
    fn a_larger_copy_changes_nothing_in_the_row() {
        let mut w = World::new(SplitMode::Hash);
        w.apply(vec![read("LEAK/a.wav", b"x")]);
        let (_, edits, _) = w.apply(vec![read("NORMAL/b.wav", b"x")]);
        assert!(edits.is_empty(), "{edits:?}");
        assert_eq!(
            w.model.contents[&h(b"x")].paths,
            ["LEAK/a.wav", "NORMAL/b.wav"]
        );
    }

    #[test]
    fn moves_of_files_and_folders_keep_the_row_and_update_path_and_label() {
        let mut w = World::new(SplitMode::Hash);
        w.apply(vec![read("LEAK/a.wav", b"a"), read("LEAK/sub/b.wav", b"b")]);
        // A file moved: the old path goes, the new one arrives (same batch or not).
        w.apply(vec![gone("LEAK/a.wav"), read("NORMAL/a.wav", b"a")]);
        assert_eq!(
            w.row_of(b"a").unwrap(),
            ("NORMAL/a.wav".into(), NORMAL, w.row_of(b"a").unwrap().2)
        );
        // A label folder moved into another label.
        w.apply(vec![Observation::FolderGone("LEAK".into())]);
        assert_eq!(w.row_of(b"b"), None);
        let (c, _, _) = w.apply(vec![read("NORMAL/LEAK_old/sub/b.wav", b"b")]);
        assert_eq!(c.new_rows, 0);
        assert_eq!(w.row_of(b"b").unwrap().0, "NORMAL/LEAK_old/sub/b.wav");
        assert_eq!(w.row_of(b"b").unwrap().1, NORMAL);
        assert_eq!(w.model.rows.len(), 2);
        assert!(!w.model.files.contains_key("LEAK/sub/b.wav"));
    }

    #[test]
    fn new_bytes_supersede_and_a_delete_invalidates() {
        let mut w = World::new(SplitMode::Hash);
        w.apply(vec![read("LEAK/a.wav", b"v1")]);
        let (c, edits, _) = w.apply(vec![read("LEAK/a.wav", b"v2")]);
        assert_eq!(c.new_rows, 1);
        assert!(edits
            .iter()
            .any(|e| matches!(e, Edit::Valid { valid: false, .. })));
        assert_eq!(w.row_of(b"v1"), None);
        assert_eq!(w.row_of(b"v2").unwrap().0, "LEAK/a.wav");
        w.apply(vec![gone("LEAK/a.wav")]);
        assert!(w.model.valid_rows().is_empty());
        assert_eq!(w.model.rows.len(), 2, "rows never disappear");
    }

    #[test]
    fn new_bytes_through_a_linked_name_ask_for_a_look_at_the_other_names() {
        let mut w = World::new(SplitMode::Hash);
        w.apply(vec![
            read("LEAK/a.wav", b"v1"),
            read("NORMAL/b.wav", b"v1"),
            read("NORMAL/c.wav", b"v1"),
        ]);
        let linked = |rel: &str, bytes: &[u8]| {
            let mut o = read(rel, bytes);
            if let Observation::Loaded(Loaded {
                load: Load::Read { linked, .. },
                ..
            }) = &mut o
            {
                *linked = true;
            }
            o
        };
        // Unchanged, or new bytes at a file with one name: nothing to look at.
        let plan = w.ledger.decide(&w.model, vec![linked("LEAK/a.wav", b"v1")]);
        assert!(plan.unwrap().recheck.is_empty());
        let plan = w
            .ledger
            .decide(&w.model, vec![read("NORMAL/c.wav", b"v3")])
            .unwrap();
        assert!(plan.recheck.is_empty());
        w.model.commit(plan, &w.ledger);
        // New bytes at a file with other names: the paths left on the old bytes.
        let plan = w
            .ledger
            .decide(&w.model, vec![linked("LEAK/a.wav", b"v2")])
            .unwrap();
        assert_eq!(plan.recheck, vec!["NORMAL/b.wav".to_string()]);
    }

    #[test]
    fn unusable_files_are_quarantined_let_go_of_rows_and_are_retried() {
        let mut w = World::new(SplitMode::Hash);
        w.apply(vec![read("LEAK/a.wav", b"good")]);
        let bad = Observation::Loaded(Loaded {
            rel: "LEAK/a.wav".into(),
            seen: None,
            load: Load::Read {
                size: 3,
                mtime_ns: 2,
                hash: h(b"bad"),
                decoded: Err(Reason::Decode(DecodeError::NotWav)),
                linked: false,
            },
        });
        let (c, _, _) = w.apply(vec![bad]);
        assert_eq!(c.quarantined, 1);
        assert_eq!(w.row_of(b"good"), None, "the old row is superseded");
        let rec = &w.model.files["LEAK/a.wav"];
        assert_eq!(rec.quarantine.as_ref().unwrap().kind, "decode");
        // Unknown label folder, no label folder, symbolic link: quarantined with the reason.
        let (c, _, _) = w.apply(vec![
            read("ELSEWHERE/b.wav", b"b"),
            read("c.wav", b"c"),
            Observation::Rejected {
                rel: "LEAK/link.wav".into(),
                reason: Reason::SymbolicLink,
                size: 0,
                mtime_ns: 0,
            },
        ]);
        assert_eq!(c.quarantined, 3);
        assert!(w.model.files["ELSEWHERE/b.wav"]
            .quarantine
            .as_ref()
            .unwrap()
            .text
            .contains("not in labels.names"));
        // Fixed bytes: ingested.
        let (c, _, _) = w.apply(vec![read("LEAK/a.wav", b"fixed")]);
        assert_eq!(c.new_rows, 1);
        assert!(w.model.files["LEAK/a.wav"].quarantine.is_none());
    }

    #[test]
    fn a_new_owner_in_another_split_retires_the_row_and_makes_one_there() {
        let mut w = World::new(SplitMode::Directory);
        w.apply(vec![read("b/LEAK/x.wav", b"x")]);
        assert_eq!(w.row_of(b"x").unwrap().2, 2);
        // A smaller path in the training folder: the row moves to training (recomputed from the
        // wave read in this batch).
        let (c, _, _) = w.apply(vec![read("a/LEAK/x.wav", b"x")]);
        assert_eq!(c.new_rows, 1);
        assert_eq!(w.row_of(b"x").unwrap(), ("a/LEAK/x.wav".into(), LEAK, 0));
        // The owner goes: the next path is in testing, whose wave is not in the batch: reread.
        let (_, _, reread) = w.apply(vec![gone("a/LEAK/x.wav")]);
        assert_eq!(reread, ["b/LEAK/x.wav"]);
        assert_eq!(w.row_of(b"x"), None);
        let (c, _, _) = w.apply(vec![read("b/LEAK/x.wav", b"x")]);
        assert_eq!(c.new_rows, 1);
        assert_eq!(w.row_of(b"x").unwrap(), ("b/LEAK/x.wav".into(), LEAK, 2));
        assert_eq!(w.model.rows.len(), 3);
    }

    #[test]
    fn undecided_batches_are_seen_by_the_next_one_before_they_are_durable() {
        let mut w = World::new(SplitMode::Hash);
        let p1 = w
            .ledger
            .decide(&w.model, vec![read("LEAK/a.wav", b"a")])
            .unwrap();
        // Not committed yet: a copy in the next batch must share the row, not make another.
        let p2 = w
            .ledger
            .decide(&w.model, vec![read("NORMAL/a.wav", b"a")])
            .unwrap();
        assert_eq!(p2.counts.new_rows, 0);
        w.model.commit(p1, &w.ledger);
        w.model.commit(p2, &w.ledger);
        assert_eq!(w.model.contents[&h(b"a")].paths.len(), 2);
        w.apply(vec![]);
        assert!(w.ledger.files.len() <= 1, "durable entries leave the cache");
    }

    /// bind: a read that finds the file gone binds the path to nothing, like a delete.
    #[test]
    fn a_vanished_read_lets_go_like_a_delete() {
        let mut w = World::new(SplitMode::Hash);
        w.apply(vec![read("LEAK/a.wav", b"a")]);
        let vanished = Observation::Loaded(Loaded {
            rel: "LEAK/a.wav".into(),
            seen: None,
            load: Load::Vanished,
        });
        let (c, edits, _) = w.apply(vec![vanished]);
        assert_eq!((c.removed, c.quarantined), (1, 0));
        assert!(matches!(&edits[..], [Edit::Valid { valid: false, .. }]));
        assert!(!w.model.files.contains_key("LEAK/a.wav"));
        assert_eq!(w.row_of(b"a"), None);
    }

    /// record_nothing: a path never recorded that goes changes nothing.
    #[test]
    fn an_unknown_path_that_goes_changes_nothing() {
        let mut w = World::new(SplitMode::Hash);
        let plan = w
            .ledger
            .decide(&w.model, vec![gone("LEAK/never.wav")])
            .unwrap();
        assert_eq!(plan.counts, Counts::default());
        assert!(plan.files.is_empty() && plan.contents.is_empty() && plan.edits.is_empty());
    }

    /// bind: unreadable files and files rejected by their header are quarantined without a hash
    /// (the header's size and mtime kept), and let go of the row they held.
    #[test]
    fn unreadable_and_header_rejected_files_are_quarantined_without_a_hash() {
        let mut w = World::new(SplitMode::Hash);
        w.apply(vec![read("LEAK/a.wav", b"a"), read("LEAK/b.wav", b"b")]);
        let unreadable = Observation::Loaded(Loaded {
            rel: "LEAK/a.wav".into(),
            seen: None,
            load: Load::Unreadable("EIO".into()),
        });
        let rejected = Observation::Loaded(Loaded {
            rel: "LEAK/b.wav".into(),
            seen: None,
            load: Load::Rejected {
                size: 7,
                mtime_ns: 9,
                reason: Reason::Decode(DecodeError::NotWav),
            },
        });
        let (c, _, _) = w.apply(vec![unreadable, rejected]);
        assert_eq!(c.quarantined, 2);
        let a = &w.model.files["LEAK/a.wav"];
        assert_eq!((a.hash, a.size, a.mtime_ns), (None, 0, 0));
        assert_eq!(a.quarantine.as_ref().unwrap().kind, "unreadable");
        let b = &w.model.files["LEAK/b.wav"];
        assert_eq!((b.hash, b.size, b.mtime_ns), (None, 7, 9));
        assert_eq!(b.quarantine.as_ref().unwrap().kind, "decode");
        assert!(w.model.valid_rows().is_empty(), "both rows let go");
    }

    /// orphaned: a content waiting for a reread (no row) whose last path goes leaves no record.
    #[test]
    fn a_content_without_row_or_paths_leaves_no_record() {
        let mut w = World::new(SplitMode::Directory);
        w.apply(vec![read("b/LEAK/x.wav", b"x")]);
        w.apply(vec![read("a/LEAK/x.wav", b"x")]);
        let (_, _, reread) = w.apply(vec![gone("a/LEAK/x.wav")]);
        assert_eq!(reread, ["b/LEAK/x.wav"]);
        assert!(w.model.contents[&h(b"x")].row.is_none());
        let (c, edits, _) = w.apply(vec![gone("b/LEAK/x.wav")]);
        assert_eq!(c.removed, 1);
        assert!(edits.is_empty(), "no row to retire: {edits:?}");
        assert!(!w.model.contents.contains_key(&h(b"x")));
    }

    /// finish: the plan carries the latency instants of the paths that hold rows only, and the
    /// label list only when it grew.
    #[test]
    fn a_plan_carries_instants_of_held_paths_and_grown_labels() {
        let mut w = World::new(SplitMode::Hash);
        let t = Instant::now();
        let seen = |rel: &str, bytes: &[u8], decoded| {
            Observation::Loaded(Loaded {
                rel: rel.into(),
                seen: Some(t),
                load: Load::Read {
                    size: bytes.len() as u64,
                    mtime_ns: 1,
                    hash: h(bytes),
                    decoded,
                    linked: false,
                },
            })
        };
        let plan = w
            .ledger
            .decide(
                &w.model,
                vec![
                    seen("LEAK/a.wav", b"a", Ok(wave())),
                    seen("LEAK/b.wav", b"b", Err(Reason::Decode(DecodeError::NotWav))),
                ],
            )
            .unwrap();
        assert_eq!(plan.seen, [t]);
        assert_eq!(plan.labels, None, "LEAK is a configured label");
        assert_eq!(plan.rows.iter().sum::<u64>(), 1, "one row made");
    }

    mod model_based {
        use super::*;
        use proptest::prelude::*;

        /// Steps of the tree's history (path index, content index or None = delete), batch
        /// sizes, and the split mode.
        type History = (Vec<(usize, Option<u8>)>, Vec<usize>, SplitMode);

        fn history() -> impl Strategy<Value = History> {
            (
                proptest::collection::vec((0usize..12, proptest::option::of(0u8..6)), 1..60),
                proptest::collection::vec(1usize..8, 1..20),
                prop_oneof![
                    Just(SplitMode::Hash),
                    Just(SplitMode::Sensor),
                    Just(SplitMode::Directory)
                ],
            )
        }

        fn path(i: usize, mode: SplitMode) -> String {
            let labels = ["LEAK", "NORMAL", "CRACK"];
            let top = if mode == SplitMode::Directory {
                if i.is_multiple_of(2) {
                    "a/"
                } else {
                    "b/"
                }
            } else {
                ""
            };
            format!(
                "{top}{}/S{:02}~R{i}~20250118120530~100.wav",
                labels[i % 3],
                i % 4
            )
        }

        /// The service's ledger, or (`bulk`) `rebuild`'s, over an empty store.
        fn world(mode: SplitMode, bulk: bool) -> (Ledger, Model) {
            let mut s = Settings::default();
            s.splits.mode = mode;
            s.splits.directories.insert("a".into(), "training".into());
            s.splits.directories.insert("b".into(), "testing".into());
            let labels = LabelSet::new(&s.labels.names, &[], s.labels.unknown);
            let ledger = if bulk {
                Ledger::for_empty_store(&s, labels)
            } else {
                Ledger::new(&s, labels, [0; 3])
            };
            (ledger, Model::default())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(300))]
            /// The service (any arrival order, any batch sizes, rereads queued like the daemon
            /// does) ends with the same valid rows, column by column, as a rebuild of the
            /// final tree (in path order, in batches, by its own ledger); and a row is never
            /// written twice or lost.
            #[test]
            fn service_history_ends_where_rebuild_of_the_final_tree_does(
                (steps, sizes, mode) in history()
            ) {
                let (mut ledger, mut model) = world(mode, false);
                // The tree as it is while the service runs; each step changes it and is observed.
                let mut tree: BTreeMap<String, u8> = BTreeMap::new();
                let mut steps = steps.into_iter().peekable();
                let mut size = sizes.iter().cycle();
                let mut rereads: Vec<String> = Vec::new();
                while steps.peek().is_some() || !rereads.is_empty() {
                    // Rereads were queued first: they read the tree as it is now.
                    let mut batch: Vec<Observation> = rereads
                        .drain(..)
                        .map(|rel| match tree.get(&rel) {
                            Some(c) => read(&rel, &[*c]),
                            None => gone(&rel),
                        })
                        .collect();
                    for (i, c) in steps.by_ref().take(*size.next().unwrap()) {
                        let p = path(i, mode);
                        batch.push(match c {
                            Some(c) => {
                                tree.insert(p.clone(), c);
                                read(&p, &[c])
                            }
                            None => {
                                tree.remove(&p);
                                gone(&p)
                            }
                        });
                    }
                    let plan = ledger.decide(&model, batch).unwrap();
                    rereads.extend(plan.reread.iter().cloned());
                    model.commit(plan, &ledger);
                }
                // The rebuild: the final tree in path order, in batches, each made durable.
                let (mut bulk, mut bulk_model) = world(mode, true);
                let mut finals = tree.iter().map(|(p, c)| read(p, &[*c])).peekable();
                while finals.peek().is_some() {
                    let batch: Vec<Observation> = finals.by_ref().take(*size.next().unwrap()).collect();
                    let plan = bulk.decide(&bulk_model, batch).unwrap();
                    prop_assert!(plan.reread.is_empty());
                    bulk_model.commit(plan, &bulk);
                }
                prop_assert_eq!(model.valid_rows(), bulk_model.valid_rows());
                let live_files: BTreeMap<_, _> = model.files.iter().map(|(k, v)| (k.clone(), v.hash)).collect();
                let bulk_files: BTreeMap<_, _> = bulk_model.files.iter().map(|(k, v)| (k.clone(), v.hash)).collect();
                prop_assert_eq!(live_files, bulk_files);
                for (h, c) in &model.contents {
                    prop_assert_eq!(&c.paths, &bulk_model.contents.get(h).map(|c| c.paths.clone()).unwrap_or_default());
                }
            }
        }
    }
}
