//! What the engine learns about a path, as types: an observation from the source (complete,
//! gone, folder gone, rejected), what loading a complete file gave (vanished, unreadable, read
//! with a decode result), and why a path is quarantined. Text is made from these only at the
//! edge (logs, `status`, the manifest's stored reason).

use crate::decode::{DecodeError, Waveform};
use crate::engine::manifest::StoredReason;
use crate::identity::{Hash, PlacementError};
use std::time::Instant;

/// One thing the engine is told about the tree, relative to `paths.recordings`.
#[derive(Debug)]
pub enum Observation {
    /// A complete recording, loaded (or not: see [`Load`]).
    Loaded(Loaded),
    /// The path no longer holds a recording (deleted, moved away).
    Gone(String),
    /// A folder went away: everything recorded under it.
    FolderGone(String),
    /// The path is not usable as it is (not UTF-8, a symbolic link, never complete); size and
    /// mtime say which state was judged (0 when unknown).
    Rejected {
        rel: String,
        reason: Reason,
        size: u64,
        mtime_ns: i64,
    },
}

impl Observation {
    pub fn rel(&self) -> &str {
        match self {
            Observation::Loaded(l) => &l.rel,
            Observation::Gone(r) | Observation::FolderGone(r) => r,
            Observation::Rejected { rel, .. } => rel,
        }
    }
}

#[derive(Debug)]
pub struct Loaded {
    pub rel: String,
    /// When the file was seen complete (the service's latency clock); None in bulk.
    pub seen: Option<Instant>,
    pub load: Load,
}

/// What reading a complete file gave.
#[derive(Debug)]
pub enum Load {
    /// Gone before it was read: its removal is (or will be) observed too.
    Vanished,
    /// Opening or reading failed.
    Unreadable(String),
    /// Not usable, as its header alone shows: a file too large to read whole
    /// ([`crate::engine::stages::STREAM_ABOVE`]) is not read past its header when that says it
    /// is no WAV (1.5 GB of zeros named `.wav`), so it has no content hash.
    Rejected {
        size: u64,
        mtime_ns: i64,
        reason: Reason,
    },
    /// Read and hashed; decoded, or why not.
    Read {
        size: u64,
        mtime_ns: i64,
        hash: Hash,
        decoded: Result<Waveform, Reason>,
        /// The file has other names (hard links, `st_nlink` > 1): when its bytes change, theirs
        /// change with them, and no event says so for those names.
        linked: bool,
    },
}

/// Why a path is quarantined.
#[derive(Debug, Clone, PartialEq)]
pub enum Reason {
    NotUtf8,
    SymbolicLink,
    /// A `*.wav` that is a named pipe, a socket or a device: never opened (a pipe's open
    /// waits for a writer). What it is, in words.
    NotAFile(&'static str),
    Unreadable(String),
    /// The file grew or shrank while it was read.
    ChangedWhileRead,
    Decode(DecodeError),
    Placement(PlacementError),
    /// Still not complete `after_s` after its last change; `detail` says how (what the header
    /// said, or that a writer still holds it open).
    StillIncomplete {
        after_s: u64,
        detail: crate::source::settle::Incomplete,
    },
    /// ailhd stopped (crashed, aborted, was killed) while reading this file, `deaths` times in a
    /// row, the last time while reading it alone (see [`crate::engine::inflight`]).
    StoppedWhileReading {
        deaths: u32,
    },
    /// Recorded by an older version of ailhd (text only).
    Recorded(StoredReason),
}

/// [`Reason::kind`] of [`Reason::Placement`]: a reason that depends on the configuration (the
/// label list, `outputs.path_bytes`, the split folders), so a start takes such files up again.
pub const PLACEMENT: &str = "placement";

/// [`Reason::kind`] of [`Reason::StoppedWhileReading`].
pub const STOPPED_WHILE_READING: &str = "stopped_while_reading";

impl Reason {
    /// A stable name for the kind of problem (metrics labels, tests).
    pub fn kind(&self) -> &str {
        match self {
            Reason::NotUtf8 => "not_utf8",
            Reason::SymbolicLink => "symbolic_link",
            Reason::NotAFile(_) => "not_a_file",
            Reason::Unreadable(_) => "unreadable",
            Reason::ChangedWhileRead => "changed_while_read",
            Reason::Decode(e) if e.is_incomplete() => "truncated",
            Reason::Decode(_) => "decode",
            Reason::Placement(_) => PLACEMENT,
            Reason::StillIncomplete { .. } => "incomplete",
            Reason::StoppedWhileReading { .. } => STOPPED_WHILE_READING,
            Reason::Recorded(r) => &r.kind,
        }
    }

    pub fn stored(&self) -> StoredReason {
        StoredReason {
            kind: self.kind().to_string(),
            text: self.to_string(),
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::NotUtf8 => write!(f, "path is not valid UTF-8"),
            Reason::SymbolicLink => write!(
                f,
                "symbolic link: not followed (put the recording itself in the tree)"
            ),
            Reason::NotAFile(what) => write!(
                f,
                "{what}, not a regular file: not read (put the recording itself in the tree)"
            ),
            Reason::Unreadable(e) => write!(f, "cannot read: {e}"),
            Reason::ChangedWhileRead => {
                write!(f, "file changed while being read (still being written?)")
            }
            Reason::Decode(e) => write!(f, "{e}"),
            Reason::Placement(e) => write!(f, "{e}"),
            Reason::StillIncomplete { after_s, detail } => {
                write!(
                    f,
                    "still incomplete {after_s} s after its last change: {detail}"
                )
            }
            Reason::StoppedWhileReading { deaths } => write!(
                f,
                "ailhd stopped {} in a row while reading it (a crash, an abort or a kill, out of \
                 memory say); not retried until its bytes change (touch or replace the file to \
                 retry it)",
                match deaths {
                    2 => "twice".to_string(),
                    n => format!("{n} times"),
                }
            ),
            Reason::Recorded(r) => write!(f, "{}", r.text),
        }
    }
}
