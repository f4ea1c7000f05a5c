//! The load stage (read, hash, decode a complete file), the short windows a row stores, and the
//! time each stage takes. Each file's failure becomes an outcome of that file; nothing here
//! stops a batch because one file is bad.

use crate::config::{FeatureSettings, FeatureShape};
use crate::decode::{self, FileBytes, Streamed, Waveform};
use crate::engine::outcome::{Load, Loaded, Observation, Reason};
use crate::identity;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Time spent per stage, summed over threads (nanoseconds), for the closing report.
#[derive(Default, Debug)]
pub struct StageTimes {
    pub read: AtomicU64,
    pub hash: AtomicU64,
    pub decode: AtomicU64,
    pub decide: AtomicU64,
    pub featurise: AtomicU64,
    pub write: AtomicU64,
    pub manifest: AtomicU64,
}

impl StageTimes {
    pub fn add(counter: &AtomicU64, since: Instant) {
        counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
    /// (stage, seconds) in pipeline order.
    pub fn seconds(&self) -> Vec<(&'static str, f64)> {
        let s = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64 * 1e-9;
        vec![
            ("read", s(&self.read)),
            ("hash", s(&self.hash)),
            ("decode", s(&self.decode)),
            ("decide", s(&self.decide)),
            ("featurise", s(&self.featurise)),
            ("write", s(&self.write)),
            ("manifest", s(&self.manifest)),
        ]
    }
}

pub fn mtime_ns(meta: &std::fs::Metadata) -> i64 {
    use std::os::unix::fs::MetadataExt;
    meta.mtime() * 1_000_000_000 + meta.mtime_nsec()
}

/// A file of a batch, opened and its reading started ([`open`]), or why it could not be opened.
pub type Opened = std::io::Result<(std::fs::File, std::fs::Metadata)>;

/// Files above this size are read in pieces ([`crate::decode::stream_file`]): memory per
/// recording stays bounded whatever the file's size (the pieces' buffer and the samples a row
/// needs). A file at most this size (an ordinary 10 s clip is 80 KB) is read whole into a pooled
/// sample buffer and, 16-bit mono at the rate, decoded where it was read.
pub const STREAM_ABOVE: u64 = 1 << 20;

/// Files above this size are loaded on a lane of their own ([`crate::engine::lane`]), so that the
/// recordings of a batch do not wait for their hash (about 1 s for 1.5 GB).
pub const LANE_ABOVE: u64 = 64 << 20;

/// Open a file to load and ask the kernel to read it ahead (`POSIX_FADV_WILLNEED`, which
/// returns at once): a batch's files are all opened this way before any is read. The file is
/// also marked as read once (`POSIX_FADV_NOREUSE`, Linux 6.3 and later): its cached pages are
/// not promoted on the kernel's LRU lists, bookkeeping that cost about 5% of a rebuild's CPU
/// time (perf, 39,563 clips) and buys nothing, as ingest reads each recording once. A file read
/// in pieces is read ahead only as far as a piece goes, and marked as read in order
/// (`POSIX_FADV_SEQUENTIAL`): the whole of a 1.5 GB file is not asked for at once.
pub fn open(root: &Path, rel: &str, times: &StageTimes) -> Opened {
    let t = Instant::now();
    let opened = (|| {
        let f = std::fs::File::open(root.join(rel))?;
        let meta = f.metadata()?;
        use std::os::fd::AsRawFd;
        // SAFETY: plain system calls on an open descriptor; only advice, so their results are
        // not needed.
        unsafe {
            let fd = f.as_raw_fd();
            if meta.len() > STREAM_ABOVE {
                libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_SEQUENTIAL);
                let ahead = crate::decode::STREAM_PIECE as libc::off_t;
                libc::posix_fadvise(fd, 0, ahead, libc::POSIX_FADV_WILLNEED);
            } else {
                libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_WILLNEED);
            }
            libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_NOREUSE);
        }
        Ok((f, meta))
    })();
    StageTimes::add(&times.read, t);
    opened
}

/// The load stage for one complete file, [`open`]ed: read, hash, decode. Size and mtime are
/// taken from the open file, so they describe the bytes that were hashed. Never fails: every
/// problem is an outcome of this file.
pub fn load(
    file: Opened,
    rel: String,
    seen: Option<Instant>,
    features: &FeatureSettings,
    shape: &FeatureShape,
    times: &StageTimes,
) -> Observation {
    fail_while_reading(&rel);
    if let Some(error) = failed_read(&rel) {
        return Observation::Loaded(Loaded {
            load: Load::Unreadable(error),
            rel,
            seen,
        });
    }
    Observation::Loaded(Loaded {
        load: load_file(file, features, shape, times),
        rel,
        seen,
    })
}

/// Test builds (feature `failpoints`): `FAILPOINTS=load-file=return(REL)` aborts the process
/// while it reads the recording at the relative path REL, as a crash in a decoder or an
/// out-of-memory kill would (tests/poison.rs).
fn fail_while_reading(rel: &str) {
    #[cfg(not(feature = "failpoints"))]
    let _ = rel;
    (|| {
        fail::fail_point!("load-file", |target: Option<String>| {
            if target.as_deref() == Some(rel) {
                log::error!("fail point load-file: aborting while reading {rel}");
                std::process::abort();
            }
        });
    })();
}

/// Test builds (feature `failpoints`): `FAILPOINTS=read-error=return(REL)` makes reading the
/// recording at the relative path REL fail with an I/O error, as a failing disk or a permission
/// refused would (tests/faults.rs; `1*return(REL)`: the first file loaded, if it is REL).
fn failed_read(rel: &str) -> Option<String> {
    #[cfg(not(feature = "failpoints"))]
    let _ = rel;
    (|| {
        fail::fail_point!("read-error", |target: Option<String>| {
            (target.as_deref() == Some(rel)).then(|| "Input/output error (os error 5)".to_string())
        });
        None
    })()
}

fn load_file(
    file: Opened,
    features: &FeatureSettings,
    shape: &FeatureShape,
    times: &StageTimes,
) -> Load {
    if let Ok((f, meta)) = &file {
        if meta.len() > STREAM_ABOVE {
            return load_streaming(f, meta, features, shape, times);
        }
    }
    let t = Instant::now();
    // Read into a sample buffer of the decoder's pool: a 16-bit mono file at the target rate
    // becomes its waveform where it was read (decode::FileBytes). Bounded by the size the file
    // had when opened (+1 to notice growth), not by a header.
    let read = file.and_then(|(f, meta)| Ok((FileBytes::read(&f, meta.len() + 1)?, meta)));
    StageTimes::add(&times.read, t);
    let (bytes, meta) = match read {
        Ok(r) => r,
        Err(e) => return unread(e),
    };
    let t = Instant::now();
    let hash = identity::content_hash(bytes.bytes());
    StageTimes::add(&times.hash, t);
    let t = Instant::now();
    let size = bytes.bytes().len() as u64;
    let decoded = if size != meta.len() {
        Err(Reason::ChangedWhileRead)
    } else {
        bytes
            .decode(features.sample_rate, shape.num_samples)
            .map_err(Reason::Decode)
    };
    StageTimes::add(&times.decode, t);
    Load::Read {
        size,
        mtime_ns: mtime_ns(&meta),
        hash,
        decoded,
        linked: meta.nlink() > 1,
    }
}

fn unread(e: std::io::Error) -> Load {
    if e.kind() == std::io::ErrorKind::NotFound {
        Load::Vanished
    } else {
        Load::Unreadable(e.to_string())
    }
}

/// [`load_file`] of a file above [`STREAM_ABOVE`]: one pass in pieces, hashing as they pass and
/// decoding only what the row needs; a file whose header says it is not usable is not read
/// further (and has no hash). Its time counts as reading (hashing and decoding go with it).
fn load_streaming(
    f: &std::fs::File,
    meta: &std::fs::Metadata,
    features: &FeatureSettings,
    shape: &FeatureShape,
    times: &StageTimes,
) -> Load {
    let t = Instant::now();
    let streamed = decode::stream_file(f, meta.len(), features.sample_rate, shape.num_samples);
    StageTimes::add(&times.read, t);
    match streamed {
        Err(e) => unread(e),
        Ok(Streamed::BadHeader(e)) => Load::Rejected {
            size: meta.len(),
            mtime_ns: mtime_ns(meta),
            reason: Reason::Decode(e),
        },
        Ok(Streamed::Read {
            len, hash, wave, ..
        }) => {
            let decoded = if len != meta.len() {
                if let Ok(w) = wave {
                    w.recycle();
                }
                Err(Reason::ChangedWhileRead)
            } else {
                wave.map_err(Reason::Decode)
            };
            Load::Read {
                size: len,
                mtime_ns: mtime_ns(meta),
                hash,
                decoded,
                linked: meta.nlink() > 1,
            }
        }
    }
}

/// `segments_waveform` of one recording: the short windows, `[num_long][num_short][short_window]`.
pub fn segment_waveform(
    w: &Waveform,
    features: &FeatureSettings,
    shape: &FeatureShape,
    out: &mut [f32],
) {
    let sw = shape.short_window;
    for l in 0..shape.num_long {
        for s in 0..shape.num_short {
            let start = l * features.long_hop + s * features.short_hop;
            let at = (l * shape.num_short + s) * sw;
            w.copy_to_f32(start, &mut out[at..at + sw]);
        }
    }
}
