//! What the manifest costs on disk per recording, and why: the manifest's own records written
//! through [`Manifest`] in micro-batches as the service commits them (and in bulk batches as
//! `rebuild` does), beside two layouts written straight into sled with the same record sizes:
//!
//! - `paths only`: one record per recording keyed by its path (what a layout without a content
//!   index would cost);
//! - `paths + hash index`: the same, plus a record per content keyed by its hash (the manifest's
//!   shape: a content's row is found from its bytes' hash).
//!
//! Prints bytes per recording (the state folder's size after a flush), the write time, the open
//! time and a pass over the paths' keys.
//!
//! Then, for the manifest written in bulk: its resident memory once opened, after a pass over the
//! path records (what every comparison of the tree with the manifest reads) and after a pass over
//! the content records, with the service's allocator (mimalloc, freed pages handed back before
//! each reading). sled keeps a structure for every page it has read until the manifest closes.
//! First of all, what the first open of a manifest in a process costs (sled's process-wide
//! allocations: 21.5 MB of metrics histograms before Cargo.toml turned them into zeroed memory).
//!
//! usage: cargo bench --bench manifest_space [-- N]   (default N = 200000)

mod common;

use ailhd::engine::manifest::{ContentRecord, FileRecord, Manifest, ManifestBatch, RowRef};
use std::path::Path;
use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc; // (the service's allocator)

/// This process's resident memory in MB, after handing freed pages back.
fn rss_mb() -> f64 {
    ailhd::memory::release_free_memory();
    common::status_mb("self", "VmRSS")
}

/// Resident memory (MB) and seconds of each pass over a manifest written in bulk.
fn memory_of_passes(dir: &Path) {
    let base = rss_mb();
    let t = Instant::now();
    let m = Manifest::open(dir).expect("manifest opens");
    let open = (rss_mb() - base, t.elapsed().as_secs_f64());
    let t = Instant::now();
    assert!(m.files().count() > 0);
    let files = (rss_mb() - base, t.elapsed().as_secs_f64());
    let t = Instant::now();
    assert!(m.contents().count() > 0);
    let contents = (rss_mb() - base, t.elapsed().as_secs_f64());
    drop(m);
    let closed = rss_mb() - base;
    println!();
    println!("| manifest written in bulk | resident MB above the process's | seconds |");
    println!("|---|---|---|");
    for (what, (mb, s)) in [
        ("opened", open),
        ("after a pass over the path records", files),
        ("after a pass over the content records too", contents),
    ] {
        println!("| {what} | {mb:.1} | {s:.3} |");
    }
    println!("| closed | {closed:.1} | |");
}

fn du(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => du(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

fn path(k: usize) -> String {
    let label = ["LEAK", "NORMAL"][k % 2];
    format!("{label}/S{:03}~P{k}~20250118120530~100.wav", k % 97)
}

fn hash(k: usize) -> [u8; 32] {
    *blake3::hash(&k.to_le_bytes()).as_bytes()
}

/// The real manifest, `batch` recordings per commit.
fn manifest(dir: &Path, n: usize, batch: usize) -> f64 {
    let t = Instant::now();
    let m = Manifest::open(dir).expect("manifest opens");
    for start in (0..n).step_by(batch) {
        let mut b = ManifestBatch::default();
        for k in start..(start + batch).min(n) {
            let (rel, h) = (path(k), hash(k));
            b.put_file(
                &rel,
                &FileRecord {
                    hash: Some(h),
                    size: 81_964,
                    mtime_ns: 1_737_201_930_000_000_000 + k as i64,
                    quarantine: None,
                    updated_ms: 1_737_201_930_000 + k as i64,
                },
            );
            b.put_content(
                &h,
                &ContentRecord {
                    row: Some(RowRef {
                        split: (k % 3) as u8,
                        row: k as u64 / 3,
                    }),
                    label: (k % 2) as i16,
                    valid: true,
                    paths: vec![rel],
                },
            );
        }
        m.apply(b).expect("batch applies");
        if batch < 100 {
            m.flush().expect("manifest flushes");
        }
    }
    m.flush().expect("manifest flushes");
    t.elapsed().as_secs_f64()
}

/// Raw sled, records of the manifest's sizes: a path record (~60 bytes), and with `index` a
/// hash-keyed record (~45 bytes) too.
fn raw(dir: &Path, n: usize, batch: usize, index: bool) -> f64 {
    let t = Instant::now();
    let db = sled::Config::new()
        .path(dir)
        .cache_capacity(4 << 20)
        .open()
        .expect("sled opens");
    let files = db.open_tree("files").expect("tree opens");
    let content = db.open_tree("content").expect("tree opens");
    for start in (0..n).step_by(batch) {
        let (mut fb, mut cb) = (sled::Batch::default(), sled::Batch::default());
        for k in start..(start + batch).min(n) {
            let (rel, h) = (path(k), hash(k));
            let mut v = vec![2u8];
            v.extend_from_slice(&h);
            v.extend_from_slice(&[7u8; 27]);
            fb.insert(rel.as_bytes(), v);
            if index {
                cb.insert(&h[..], vec![5u8; 45]);
            }
        }
        files.apply_batch(fb).expect("batch applies");
        content.apply_batch(cb).expect("batch applies");
        if batch < 100 {
            db.flush().expect("sled flushes");
        }
    }
    db.flush().expect("sled flushes");
    t.elapsed().as_secs_f64()
}

fn reopen_and_scan(dir: &Path, raw: bool) -> (f64, f64) {
    let t = Instant::now();
    if raw {
        let db = sled::Config::new().path(dir).open().expect("sled opens");
        let files = db.open_tree("files").expect("tree opens");
        let open = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let n = files.iter().keys().count();
        assert!(n > 0);
        (open, t.elapsed().as_secs_f64())
    } else {
        let m = Manifest::open(dir).expect("manifest opens");
        let open = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let n = m.files().count();
        assert!(n > 0);
        (open, t.elapsed().as_secs_f64())
    }
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(200_000);
    let cpu = common::cpu_model();
    println!("# manifest space, {n} recordings; {cpu}");
    let empty = tempfile::tempdir().expect("temporary folder");
    let before = rss_mb();
    drop(Manifest::open(empty.path()).expect("manifest opens"));
    println!(
        "first open of a manifest in this process (empty): {:.1} MB resident",
        rss_mb() - before
    );
    println!("| layout | batch | bytes per recording | write s | open s | pass over paths s |");
    println!("|---|---|---|---|---|---|");
    let root = tempfile::tempdir().expect("temporary folder");
    let cases: [(&str, usize, u8); 6] = [
        ("ailhd manifest (files + content + derived trees)", 1000, 0),
        ("ailhd manifest (files + content + derived trees)", 2, 0),
        ("paths only (raw sled)", 1000, 1),
        ("paths only (raw sled)", 2, 1),
        ("paths + hash index (raw sled)", 1000, 2),
        ("paths + hash index (raw sled)", 2, 2),
    ];
    for (i, (name, batch, kind)) in cases.into_iter().enumerate() {
        let dir = root.path().join(format!("case{i}"));
        // Micro-batches of 2 with a flush each, as the service at 100/s: a tenth of N.
        let count = if batch < 100 { n / 10 } else { n };
        let write = match kind {
            0 => manifest(&dir, count, batch),
            1 => raw(&dir, count, batch, false),
            _ => raw(&dir, count, batch, true),
        };
        let bytes = du(&dir) as f64 / count as f64;
        let (open, scan) = reopen_and_scan(&dir, kind != 0);
        println!(
            "| {name} | {batch} (N = {count}) | {bytes:.0} | {write:.2} | {open:.3} | {scan:.3} |"
        );
        if i > 0 {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    memory_of_passes(&root.path().join("case0"));
}
