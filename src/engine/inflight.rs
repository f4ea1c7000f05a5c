//! The in-flight journal: which recordings ailhd was reading when it last died, so that one
//! file never stops it for good (the poison-message rule of queue systems: a message in flight
//! when a consumer died too often goes to a dead-letter queue instead of being delivered again).
//!
//! `<paths.state>/inflight` lists the files being read (opened, hashed, decoded) at each moment:
//! written before a group of files is read and cleared once they are, by one `pwrite` each,
//! without `fsync` (a death of the process leaves the page cache to the kernel; after a power
//! cut the list may be older, or empty, which at worst costs one more start). A clean stop
//! leaves it empty. At start, what it lists was in flight when ailhd died:
//!
//! - each of those files becomes a *suspect* and is read again *alone* (no other file is read at
//!   the same time: a group of 128 files read together does not put the 127 others under
//!   suspicion a second time);
//! - a file listed alone, as a suspect, was being read when ailhd died twice in a row: it is
//!   quarantined ([`Reason::StoppedWhileReading`]) through the ledger, as any unusable file
//!   (`status`, the journal and the metrics show it), and not read again until its size or mtime
//!   changes (touch or replace it to retry).
//!
//! Nothing is judged from a file's name alone: each entry carries the size and mtime of the
//! file when it was read, and a file that changed since is an ordinary file again.
//!
//! One journal per state folder and process, shared by the engines that process opens in turn
//! (the service closes its engine when idle and after write failures): what the start-up found
//! is kept until it is used.

use crate::engine::outcome::Reason;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// A file being read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub rel: String,
    pub size: u64,
    pub mtime_ns: i64,
    /// Deaths in a row, before this read, at which this file was in flight (0 for an ordinary
    /// read, 1 or more for a suspect read alone).
    pub deaths: u32,
}

impl Entry {
    pub fn new(rel: &str, meta: &std::fs::Metadata, deaths: u32) -> Entry {
        Entry {
            rel: rel.to_string(),
            size: meta.len(),
            mtime_ns: crate::engine::stages::mtime_ns(meta),
            deaths,
        }
    }

    fn same_bytes(&self, meta: &std::fs::Metadata) -> bool {
        self.size == meta.len() && self.mtime_ns == crate::engine::stages::mtime_ns(meta)
    }
}

/// Who is reading: each writes its own list, the file holds them all.
#[derive(Debug, Clone, Copy)]
pub enum Slot {
    /// The files of a batch, read together.
    Batch = 0,
    /// A large file on its lane ([`crate::engine::lane`]).
    Lane = 1,
    /// A suspect, read alone.
    Alone = 2,
}

/// What the journal says of a file about to be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Ordinary,
    /// In flight at `deaths` deaths in a row (the last time with others): read it alone.
    Suspect {
        deaths: u32,
    },
    /// In flight at `deaths` deaths in a row, the last time alone: quarantine it.
    Poison {
        deaths: u32,
    },
}

const MAGIC: &[u8; 8] = b"AILHDIF1";
/// Magic, payload length (u32), the payload's blake3 (first 8 bytes).
const HEADER: usize = 8 + 4 + 8;
const FILE_NAME: &str = "inflight";

pub struct Journal {
    path: PathBuf,
    /// Device and inode of the file, to tell a state folder made anew (tests) from this one.
    id: (u64, u64),
    state: Mutex<State>,
    /// Files are read under a shared hold; a suspect under an exclusive one.
    gate: RwLock<()>,
    /// Whether there are suspects or poison to look for (most of the time not: no lookup).
    verdicts: AtomicBool,
}

struct State {
    file: Option<File>,
    slots: [Vec<Entry>; 3],
    buf: Vec<u8>,
    suspects: HashMap<String, Entry>,
    poison: HashMap<String, Entry>,
    /// A write failed (logged once).
    failed: bool,
}

/// The journal of each state folder this process opened.
static OPEN: Mutex<Vec<Arc<Journal>>> = Mutex::new(Vec::new());

impl Journal {
    /// The journal of `state` (the folder of `paths.state`): opened and read, the first time in
    /// this process, its verdicts made and logged, and the file cleared.
    pub fn for_state(state: &Path) -> Arc<Journal> {
        let path = state.join(FILE_NAME);
        let id = std::fs::metadata(&path).ok().map(|m| (m.dev(), m.ino()));
        let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(j) = open.iter().find(|j| j.path == path && Some(j.id) == id) {
            return j.clone();
        }
        open.retain(|j| j.path != path);
        let j = Arc::new(Journal::open(&path));
        open.push(j.clone());
        j
    }

    fn open(path: &Path) -> Journal {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path);
        let (file, entries) = match file {
            Ok(f) => {
                let entries = read_entries(&f).unwrap_or_else(|why| {
                    log::warn!(
                        "{}: {why}; ignored (it only says which recordings were being read when ailhd last stopped)",
                        path.display()
                    );
                    Vec::new()
                });
                (Some(f), entries)
            }
            Err(e) => {
                log::warn!(
                    "cannot open {}: {e}; without it, a recording that makes ailhd stop is not set aside",
                    path.display()
                );
                (None, Vec::new())
            }
        };
        let id = file
            .as_ref()
            .and_then(|f| f.metadata().ok())
            .map_or((0, 0), |m| (m.dev(), m.ino()));
        let (suspects, poison) = judge(entries);
        if !suspects.is_empty() {
            let mut names: Vec<&str> = suspects.keys().map(String::as_str).collect();
            names.sort_unstable();
            let more = names.len().saturating_sub(5);
            names.truncate(5);
            log::warn!(
                "ailhd stopped while reading {} recording{} ({}{}): each is read again alone first; one that stops ailhd again is quarantined",
                suspects.len(),
                if suspects.len() == 1 { "" } else { "s" },
                names.join(", "),
                if more > 0 { format!(" and {more} more") } else { String::new() },
            );
        }
        for e in poison.values() {
            log::warn!(
                "{}: ailhd stopped {} times in a row while reading it, the last time reading it alone: it is quarantined",
                e.rel,
                e.deaths
            );
        }
        let journal = Journal {
            path: path.to_path_buf(),
            id,
            verdicts: AtomicBool::new(!suspects.is_empty() || !poison.is_empty()),
            state: Mutex::new(State {
                file,
                slots: Default::default(),
                buf: Vec::new(),
                suspects,
                poison,
                failed: false,
            }),
            gate: RwLock::new(()),
        };
        journal.lock().write();
        journal
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether any file has a verdict other than [`Verdict::Ordinary`].
    pub fn has_verdicts(&self) -> bool {
        self.verdicts.load(Ordering::Relaxed)
    }

    /// The verdict on `rel`, whose file is now `meta`. A suspect is handed out once (the
    /// caller reads it alone now); a file that changed since it was judged is ordinary again.
    pub fn verdict(&self, rel: &str, meta: &std::fs::Metadata) -> Verdict {
        if !self.has_verdicts() {
            return Verdict::Ordinary;
        }
        let mut s = self.lock();
        let verdict = if let Some(e) = s.poison.get(rel) {
            if e.same_bytes(meta) {
                Verdict::Poison { deaths: e.deaths }
            } else {
                s.poison.remove(rel);
                Verdict::Ordinary
            }
        } else {
            match s.suspects.remove(rel) {
                Some(e) if e.same_bytes(meta) => Verdict::Suspect { deaths: e.deaths },
                _ => Verdict::Ordinary,
            }
        };
        self.verdicts.store(
            !s.suspects.is_empty() || !s.poison.is_empty(),
            Ordering::Relaxed,
        );
        verdict
    }

    /// Quarantine `entry` when it is seen with the same size and mtime (`rebuild` keeps what
    /// the service set aside: the old manifest's quarantines of this kind).
    pub fn remember_poison(&self, entry: Entry) {
        let mut s = self.lock();
        s.poison.insert(entry.rel.clone(), entry);
        self.verdicts.store(true, Ordering::Relaxed);
    }

    /// Files about to be read together (or on the lane): listed until the guard is dropped.
    /// Holds the gate shared, so that no suspect is read meanwhile.
    pub fn reading(&self, slot: Slot, entries: Vec<Entry>) -> Reading<'_> {
        let shared = self.gate.read().unwrap_or_else(|p| p.into_inner());
        self.set(slot, entries);
        Reading {
            journal: self,
            slot,
            _shared: Some(shared),
            _alone: None,
        }
    }

    /// A suspect about to be read alone: waits until no other file is being read, and keeps
    /// others from being read until the guard is dropped.
    pub fn reading_alone(&self, entry: Entry) -> Reading<'_> {
        let alone = self.gate.write().unwrap_or_else(|p| p.into_inner());
        self.set(Slot::Alone, vec![entry]);
        Reading {
            journal: self,
            slot: Slot::Alone,
            _shared: None,
            _alone: Some(alone),
        }
    }

    fn set(&self, slot: Slot, entries: Vec<Entry>) {
        let mut s = self.lock();
        if entries.is_empty() && s.slots[slot as usize].is_empty() {
            return;
        }
        s.slots[slot as usize] = entries;
        s.write();
    }
}

/// Files listed as being read; cleared from the journal when dropped (before the gate is let go).
pub struct Reading<'a> {
    journal: &'a Journal,
    slot: Slot,
    _shared: Option<RwLockReadGuard<'a, ()>>,
    _alone: Option<RwLockWriteGuard<'a, ()>>,
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.journal.set(self.slot, Vec::new());
    }
}

impl State {
    /// Write every slot's list over the file's start: one `pwrite`. Stale bytes past the new end
    /// are ignored (the header gives the length).
    fn write(&mut self) {
        let Some(file) = &self.file else {
            return;
        };
        let all: Vec<&Entry> = self.slots.iter().flatten().collect();
        self.buf.clear();
        self.buf.resize(HEADER, 0);
        let payload = match postcard::to_extend(&all, std::mem::take(&mut self.buf)) {
            Ok(b) => b,
            Err(e) => {
                log::warn!("in-flight journal: {e}");
                return;
            }
        };
        self.buf = payload;
        let len = (self.buf.len() - HEADER) as u32;
        let sum = blake3::hash(&self.buf[HEADER..]);
        self.buf[..8].copy_from_slice(MAGIC);
        self.buf[8..12].copy_from_slice(&len.to_le_bytes());
        self.buf[12..20].copy_from_slice(&sum.as_bytes()[..8]);
        if let Err(e) = file.write_all_at(&self.buf, 0) {
            if !self.failed {
                log::warn!(
                    "cannot write the in-flight journal: {e}; a recording that makes ailhd stop may be read again after a restart"
                );
                self.failed = true;
            }
        } else {
            self.failed = false;
        }
    }
}

/// The files listed in a journal file (none when it is empty or new).
fn read_entries(f: &File) -> Result<Vec<Entry>, String> {
    let mut header = [0u8; HEADER];
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    if len == 0 {
        return Ok(Vec::new());
    }
    f.read_exact_at(&mut header, 0)
        .map_err(|e| format!("unreadable ({e})"))?;
    if &header[..8] != MAGIC {
        return Err("not an in-flight journal of this version".into());
    }
    let n = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")) as usize;
    if n as u64 > len - HEADER as u64 {
        return Err("cut short".into());
    }
    let mut payload = vec![0u8; n];
    f.read_exact_at(&mut payload, HEADER as u64)
        .map_err(|e| format!("unreadable ({e})"))?;
    if blake3::hash(&payload).as_bytes()[..8] != header[12..20] {
        return Err("damaged (checksum)".into());
    }
    postcard::from_bytes(&payload).map_err(|e| format!("damaged ({e})"))
}

/// The verdicts on what was in flight at a death: a file listed alone that was already a
/// suspect is poison; everything else listed is a suspect, one death more.
fn judge(entries: Vec<Entry>) -> (HashMap<String, Entry>, HashMap<String, Entry>) {
    let mut suspects = HashMap::new();
    let mut poison = HashMap::new();
    let alone = entries.len() == 1;
    for mut e in entries {
        e.deaths = e.deaths.saturating_add(1);
        if alone && e.deaths >= 2 {
            poison.insert(e.rel.clone(), e);
        } else {
            suspects.insert(e.rel.clone(), e);
        }
    }
    (suspects, poison)
}

/// The reason a poison file is quarantined with.
pub fn reason(deaths: u32) -> Reason {
    Reason::StoppedWhileReading { deaths }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(rel: &str, deaths: u32) -> Entry {
        Entry {
            rel: rel.into(),
            size: 10,
            mtime_ns: 20,
            deaths,
        }
    }

    #[test]
    fn a_file_alone_in_flight_at_a_second_death_is_poison_others_are_suspects() {
        let (s, p) = judge(vec![entry("a", 0), entry("b", 0)]);
        assert_eq!((s.len(), p.len()), (2, 0));
        assert_eq!(s["a"].deaths, 1);
        // Alone, but at a first death: a suspect (read alone once more).
        let (s, p) = judge(vec![entry("a", 0)]);
        assert_eq!((s.len(), p.len()), (1, 0));
        let (s, p) = judge(vec![entry("a", 1)]);
        assert_eq!((s.len(), p.len()), (0, 1));
        assert_eq!(p["a"].deaths, 2);
        // With others (cannot happen while suspects are read alone): suspects still.
        let (s, p) = judge(vec![entry("a", 1), entry("b", 0)]);
        assert_eq!((s.len(), p.len()), (2, 0));
    }

    /// What a dead process left is read back by the next; a clean one leaves nothing; a file
    /// that changed is ordinary again.
    #[test]
    fn the_journal_survives_its_process_and_judges_by_size_and_mtime() {
        let dir = tempfile::tempdir().unwrap();
        let rec = dir.path().join("x.wav");
        std::fs::write(&rec, b"0123456789").unwrap();
        let meta = std::fs::metadata(&rec).unwrap();
        let path = dir.path().join(FILE_NAME);
        {
            let j = Journal::open(&path);
            let r = j.reading(Slot::Batch, vec![Entry::new("x.wav", &meta, 0)]);
            // A death now: the guard is never dropped.
            std::mem::forget(r);
        }
        let j = Journal::open(&path);
        assert_eq!(j.verdict("x.wav", &meta), Verdict::Suspect { deaths: 1 });
        assert_eq!(
            j.verdict("x.wav", &meta),
            Verdict::Ordinary,
            "handed out once"
        );
        std::mem::forget(j.reading_alone(Entry::new("x.wav", &meta, 1)));
        let j = Journal::open(&path);
        assert_eq!(j.verdict("x.wav", &meta), Verdict::Poison { deaths: 2 });
        assert_eq!(j.verdict("x.wav", &meta), Verdict::Poison { deaths: 2 });
        {
            let _r = j.reading(Slot::Lane, vec![entry("y.wav", 0)]);
        }
        std::fs::write(&rec, b"01234567890").unwrap();
        let changed = std::fs::metadata(&rec).unwrap();
        assert_eq!(j.verdict("x.wav", &changed), Verdict::Ordinary);
        assert!(!j.has_verdicts());
        // Cleared when the guard went: nothing for the next start.
        let j = Journal::open(&path);
        assert!(!j.has_verdicts());
        // Garbage is ignored.
        std::fs::write(&path, b"garbage, not a journal").unwrap();
        assert!(!Journal::open(&path).has_verdicts());
    }
}
