//! HDF5 per-split file: one chunked, first-dimension-unlimited dataset per column plus
//! `committed_rows`, written so that an h5py SWMR reader can follow it while it grows and a
//! file left by a killed writer still opens and resumes (docs/reading.md, "Layout on disk").
//!
//! On-disk guarantees and the HDF5 rules behind them:
//! - Format bounds are pinned to v1.10 (`H5Pset_libver_bounds(V110, V110)`): SWMR needs v1.10
//!   structures, and HDF5 2.0's default ("latest") would write objects that 1.10-1.14 readers
//!   cannot open.
//! - No dataset has a variable-length type (SWMR readers fail on them); the string columns are
//!   fixed-length, NUL-padded UTF-8. The attributes that never change are variable-length UTF-8
//!   strings (h5py returns `str`). `labels_json` and `label2id_json` change when a label is
//!   appended, possibly under SWMR: they are fixed-length UTF-8 with room to grow, rewritten in
//!   place (h5py returns `bytes`; `json.loads` takes either). A variable-length attribute
//!   rewritten under SWMR breaks readers: its value moves in the global heap, which SWMR
//!   readers never refresh ("bad heap pointer", seen in testing).
//! - Every `segments_mel` chunk starts at a multiple of the features' row size
//!   (`H5Pset_alignment`, see [`CHUNK_BYTES`]), so readers that map the file gather rows as
//!   whole blocks. Alignment is a setting of the open, not stored in the file: every open for
//!   writing sets it (create and [`Hdf5Sink::open_append`]); the format is unchanged.
//! - File locking is disabled on every open: HDF5's advisory `flock` would let a reader that
//!   holds the file for days (a trainer) block the service from opening it. One writer at a
//!   time is the caller's job (the writer lock under `paths.state`).
//! - Commit order: data and metadata flushed and `fdatasync`ed, then `committed_rows`
//!   written, flushed and synced. Rows below `committed_rows` are therefore complete for a
//!   reader at any moment and after a crash. After each commit every dataset has exactly
//!   `committed_rows` rows.
//! - After a crash HDF5 leaves the superblock's "open for write" flags set. SWMR readers still
//!   open such a file (it was written with SWMR ordering); plain readers refuse it ("may use
//!   h5clear") until [`Hdf5Sink::open_append`] (which clears the flags, as `h5clear -s` does)
//!   and a clean close.

use super::direct::{self, Recycler};
use super::{
    columns, header_attributes, incompatible, label2id_json, labels_json, pack_rows, ColumnSpec,
    ColumnType, OutputHeader, SplitSink, OUTPUT_SCHEMA_VERSION,
};
use anyhow::{bail, Context, Result};
use half::f16;
use hdf5::file::{FileAccess, LibraryVersion};
use hdf5::types::{TypeDescriptor, VarLenUnicode};
use hdf5::{Dataset, Datatype, Extent, File, SimpleExtents};
use hdf5_sys::h5a::{H5Aread, H5Awrite};
use hdf5_sys::h5d::{H5Dget_space, H5Dwrite};
use hdf5_sys::h5f::{
    H5F_scope_t, H5Fflush, H5Fget_vfd_handle, H5Fopen, H5F_ACC_RDWR, H5F_ACC_SWMR_WRITE,
};
use hdf5_sys::h5i::hid_t;
use hdf5_sys::h5p::{H5Pset, H5P_DEFAULT};
use hdf5_sys::h5s::{H5S_seloper_t, H5Sclose, H5Screate_simple, H5Sselect_hyperslab};
use std::ffi::{c_int, c_void, CString};
use std::path::{Path, PathBuf};

/// Target bytes per chunk: 64 KiB, 6 rows of the default `[40, 2, 64, 1]` features. Chosen for
/// the trainer, which reads random rows: h5py reads a whole chunk (through its 1 MiB chunk
/// cache) to return one row, so 1 MiB chunks (102 rows) cost 1 MiB of reading per row.
/// Measured on a 39,563-clip rebuild (27,689 training rows, 2-vCPU VM), random rows/s with
/// h5py one row at a time / sequential batches of 5,632 rows:
/// 1 MiB 2.9k / 76k; 256 KiB 12.5k / 100k; 128 KiB 18k / 87k; 64 KiB 25k / 69k;
/// 32 KiB 28k / 58k; one row (10 KiB) 41k / 39k. Below 64 KiB random reads gain little while
/// sequential reads and bulk writes lose (more chunks to index); rebuild time did not change
/// measurably. Smaller chunks also keep a daemon commit of a few rows cheap (it rewrites each
/// dataset's last, partial chunk). `ailhd_reader` (python/) reads rows by their chunk
/// addresses and does not depend on this choice.
///
/// Every allocation of at least one `segments_mel` chunk is aligned to the row size
/// ([`feature_alignment`]), so every feature row lies at a multiple of its own size and
/// `ailhd_reader` gathers whole rows from a map of the file (`np.take`) instead of fancy
/// indexing a byte view. Measured with `benches/reader.py` on one 39,563-clip rebuild (27,598
/// training rows, 2-vCPU VM, load about 1, three runs): random batches of 5,632 rows at
/// 527k-548k rows/s, 10.6-11.9x the naive h5py loop (44k-50k), against 245k-353k (5.5-7.0x) on
/// an unaligned copy in the same runs; npy 571k-623k. The block is the largest common divisor
/// of the row size and the offsets: with 4 KiB alignment it would be 2 KiB for 10,240-byte rows
/// (and smaller for other feature shapes), and 2 KiB blocks gathered 475k rows/s where whole
/// rows gathered 545k (same file, same batches). Cost: 0.35% bigger files in that rebuild
/// (training 293,990,400 bytes, was 292,954,547) as chunks mostly follow each other at
/// multiples of the row size anyway; about as much in files the service appends to.
const CHUNK_BYTES: usize = 64 << 10;
/// Target bytes per chunk of the narrow columns (`labels`, `valid`, `blake3`, the names...): one
/// page. HDF5 writes a chunk whole whenever it is flushed, so each commit of the service
/// rewrites every column's last, partial chunk: with 64 KiB chunks there, a commit of one row
/// wrote about 390 KB to the training file (8 columns of 4-64 KiB beside the features' 60 KiB)
/// and synced it, about 48 MB/s to the disk at 100 clips/s (strace and vmstat of
/// `benches/reader_latency.py`, docs/benchmarks.md, section `pages-per-commit`). A random
/// row's narrow values cost a page to read instead of up to 64 KiB; reading a whole column
/// costs more chunks (1,563 of `blake3` at 200,000 rows).
const NARROW_CHUNK_BYTES: usize = 4 << 10;
/// Chunk rows cap. It binds no narrow column (`valid`, one byte a row, has 4,096 rows a chunk
/// either way); it bounds the chunks of feature rows under 16 bytes.
const MAX_CHUNK_ROWS: usize = 4096;
/// Per-dataset raw-data chunk cache. Holds a few chunks (16 of the features'), so the partial
/// last chunk of each dataset stays cached between appends instead of being read back from
/// disk; chunks once full are evicted first (`w0` = 1). Appends never read a full chunk again,
/// so a bigger cache only holds written chunks: the 4 MiB this was before filled up as a file
/// grew (9 datasets a split, 108 MiB in all), and `rebuild` of 221,005 recordings peaked 26 MB
/// higher (docs/benchmarks.md) for no gain in speed.
const CHUNK_CACHE_BYTES: usize = 1 << 20;
const CHUNK_CACHE_SLOTS: usize = 521;

/// Smallest capacity of the `labels_json` / `label2id_json` attributes, in bytes (about 200
/// label names). They are created with twice their first value's length, at least this.
const LABEL_ATTR_MIN_BYTES: usize = 4096;

/// An HDF5 call on an output failed in this process (see [`failed_in_this_process`]).
static FAILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether an HDF5 call on an output file failed in this process. HDF5 keeps an open file's
/// state in the process, shared by every later open of the same file, and after a failed write
/// that state can be broken: reopening such a file in the same process has crashed
/// (SIGSEGV). The service starts a fresh process image instead (see `daemon`).
pub fn failed_in_this_process() -> bool {
    FAILED.load(std::sync::atomic::Ordering::Acquire)
}

/// Name of HDF5's (private) file-access property that `h5clear -s` sets to clear the superblock
/// status flags of a file a writer left open (it is in every file-access property list).
const CLEAR_STATUS_FLAGS: &str = "clear_status_flags";

/// One split's HDF5 file, open for appending.
pub struct Hdf5Sink {
    /// Row columns in [`columns`] order, each with the in-memory type its bytes are written as.
    cols: Vec<Column>,
    /// The `committed_rows` dataset (compact layout: its value lives in the dataset's object
    /// header, which SWMR readers read with checksums and retries, so it is never torn).
    committed_ds: Option<Dataset>,
    /// Declared after the datasets so they are closed first.
    file: Option<File>,
    path: PathBuf,
    swmr: bool,
    /// Rows appended (extent of every row dataset).
    len: u64,
    committed: u64,
    /// Rows made durable by [`SplitSink::prepare`]: after a failure between it and the publish,
    /// the manifest may have recorded them, so a close keeps them (the next open publishes or
    /// cuts them by what the manifest says).
    prepared: u64,
    labels: Vec<String>,
    /// Rows appended or cells written since the last commit.
    dirty: bool,
    /// What the rows must look like (checked against the file by `open_append`).
    header: OutputHeader,
    /// A staging output (`rebuild`): no reader opens it before it is swapped in, and a crash
    /// before that discards it, so its commits write `committed_rows` without flushing, and its
    /// close writes everything and syncs the file once.
    staged: bool,
    /// A staging file gives its page cache back a batch behind ([`Recycler`]).
    recycler: Recycler,
    /// An HDF5 call on this file failed (an I/O error, say): the library's state of the file
    /// may be inconsistent, and touching it again has crashed (`H5Dget_space` after a failed
    /// resize). Nothing is done with it but closing; the next open cuts what was not committed.
    broken: bool,
}

struct Column {
    spec: ColumnSpec,
    ds: Dataset,
    mem_type: Datatype,
}

impl Hdf5Sink {
    /// Create a new file at `path` (an error if it exists) with every dataset and attribute,
    /// then, if `swmr`, switch it to SWMR writing so readers can follow it.
    ///
    /// The file is built under `<path>.partial` and renamed into place once complete, so a
    /// crash while creating never leaves a half-made file under the name readers open.
    pub fn create(path: &Path, header: &OutputHeader, swmr: bool) -> Result<Self> {
        Self::create_with(path, header, swmr, true)
    }

    /// [`Hdf5Sink::create`] for a staging output (`rebuild`): not synced when made, since the
    /// close syncs it before the staging folder is swapped in, and a crash before that
    /// discards the staging folder.
    pub fn create_staged(path: &Path, header: &OutputHeader) -> Result<Self> {
        Self::create_with(path, header, false, false)
    }

    fn create_with(path: &Path, header: &OutputHeader, swmr: bool, sync: bool) -> Result<Self> {
        if path.exists() {
            bail!(
                "{}: already exists; not overwriting an existing output",
                path.display()
            );
        }
        let partial = partial_path(path);
        match std::fs::remove_file(&partial) {
            Ok(()) => log::info!(
                "removed {} left by an interrupted create",
                partial.display()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", partial.display())),
        }
        let file = File::with_options()
            .set_fapl(&file_access(header, !sync)?)?
            .create_excl(&partial)
            .with_context(|| format!("{}: creating HDF5 file", partial.display()))?;
        let specs = columns(header);
        let mut cols = Vec::with_capacity(specs.len());
        for spec in specs {
            let mem_type = memory_type(spec.dtype)?;
            let chunk_rows = chunk_rows(&spec);
            let mut extents = vec![Extent::resizable(0)];
            extents.extend(spec.row_dims.iter().map(|&d| Extent::fixed(d)));
            let mut chunk = vec![chunk_rows];
            chunk.extend(&spec.row_dims);
            let ds = file
                .new_dataset_builder()
                .empty_as(&mem_type.to_descriptor()?)
                .shape(SimpleExtents::from_vec(extents))
                .chunk(chunk)
                // Every element is written before `committed_rows` covers it: filling new
                // chunks first would only double the writes.
                .fill_time(hdf5::dataset::FillTime::Never)
                .create(spec.name)
                .with_context(|| {
                    format!("{}: creating dataset {}", partial.display(), spec.name)
                })?;
            cols.push(Column { spec, ds, mem_type });
        }
        let committed_ds = file
            .new_dataset::<i64>()
            .shape(1)
            .layout(hdf5::dataset::Layout::Compact)
            .create("committed_rows")?;
        committed_ds.write(&[0i64])?;
        for (name, value) in header_attributes(header) {
            create_text_attr(&file, name, &value)?;
        }
        file.new_attr::<u32>()
            .create("schema_version")?
            .write_scalar(&OUTPUT_SCHEMA_VERSION)?;
        let mut sink = Hdf5Sink {
            cols,
            committed_ds: Some(committed_ds),
            file: Some(file),
            path: path.to_path_buf(),
            swmr: false,
            len: 0,
            committed: 0,
            prepared: 0,
            labels: header.labels.clone(),
            dirty: false,
            header: header.clone(),
            staged: !sync,
            recycler: Recycler::default(),
            broken: false,
        };
        if sync {
            sink.flush_and_sync()?;
        } else {
            sink.file()?.flush()?;
        }
        std::fs::rename(&partial, path)
            .with_context(|| format!("renaming {} into place", partial.display()))?;
        if sync {
            sync_parent_dir(path)?;
            // Open again under its real name: HDF5 names a file in its errors by the name it
            // was opened with, and the service's errors must name the file that exists.
            drop(sink);
            return Self::open_append(path, header, swmr, None);
        }
        if swmr {
            sink.start_swmr()?;
        }
        Ok(sink)
    }

    /// Reopen an existing file for appending (a daemon restart): check that it was made by this
    /// layout with the same feature settings (otherwise an error that says to run
    /// `ailhd rebuild`), reclaim rows past `committed_rows` left by a crash, then start SWMR
    /// writing if `swmr`.
    ///
    /// A file whose writer was killed (even in SWMR mode, at any instant) opens without
    /// `h5clear`: if HDF5 refuses it because its superblock still says "open for write", it is
    /// reopened with the status flags cleared, as `h5clear -s` does. That flag is HDF5's only
    /// guard against two writers; with file locking disabled, the caller's writer lock is what
    /// makes overriding it safe.
    ///
    /// `keep`: the rows the caller's own records account for (the daemon's manifest); rows past
    /// it are reclaimed as well, even if they were committed here (a batch committed to the
    /// outputs but not yet to the manifest when the writer died).
    pub fn open_append(
        path: &Path,
        header: &OutputHeader,
        swmr: bool,
        keep: Option<u64>,
    ) -> Result<Self> {
        Self::open_append_after(path, header, swmr, keep, false)
    }

    /// [`Hdf5Sink::open_append`] in SWMR mode after this process closed the file cleanly at
    /// `rows` (every write synced): no write failure of an earlier life can be pending, so
    /// none is taken from the kernel first.
    pub fn resume(path: &Path, header: &OutputHeader, rows: u64) -> Result<Self> {
        Self::open_append_after(path, header, true, Some(rows), true)
    }

    fn open_append_after(
        path: &Path,
        header: &OutputHeader,
        swmr: bool,
        keep: Option<u64>,
        clean_close: bool,
    ) -> Result<Self> {
        if !path.exists() {
            bail!("{}: no such file", path.display());
        }
        if !clean_close {
            super::take_stale_write_error(path);
        }
        if swmr {
            if let Some(sink) = Self::open_swmr(path, header, keep)? {
                return Ok(sink);
            }
        }
        let file = open_recovering(path, header, H5F_ACC_RDWR)?;
        let mut sink = Self::adopt(path, header, file, false, keep)?;
        sink.ensure_label_room()?;
        sink.flush_and_sync()?;
        if swmr {
            sink.start_swmr()?;
        }
        sink.broken = false;
        Ok(sink)
    }

    /// Open a file straight for SWMR writing (read-write and SWMR write at once), and bring its
    /// rows to `keep` there. Opened read-write first and switched to SWMR writing after, its
    /// superblock says "open for write" without SWMR in between, and HDF5 refuses every SWMR
    /// reader that opens it then ("file is not already open for SWMR writing"): a trainer
    /// starting while the service reopens its files after an idle close or a restart, or for
    /// as long as a writer killed in between leaves it so. Rows are only cut past
    /// `committed_rows` or published below the rows written, which SWMR readers never read
    /// past. None when the file needs the plain open of [`Hdf5Sink::open_append`]: HDF5
    /// refuses the open even with the status flags cleared, or its label attributes must grow
    /// (a change of the file's structure); the file is then closed again, as it was.
    fn open_swmr(path: &Path, header: &OutputHeader, keep: Option<u64>) -> Result<Option<Self>> {
        let file = match open_recovering(path, header, H5F_ACC_RDWR | H5F_ACC_SWMR_WRITE) {
            Ok(f) => f,
            Err(e) => {
                log::debug!(
                    "{}: not opened straight for SWMR writing ({e:#})",
                    path.display()
                );
                return Ok(None);
            }
        };
        // Room to grow the label list (or not: the plain open makes it, or says what is wrong
        // with the file).
        if !label_room(&file).unwrap_or(false) {
            return Ok(None);
        }
        let mut sink = Self::adopt(path, header, file, true, keep)?;
        sink.flush_and_sync()?;
        sink.broken = false;
        Ok(Some(sink))
    }

    /// A sink over `file`, just opened for appending (`swmr`: for SWMR writing too): its layout
    /// checked, its rows brought to `keep` ([`Hdf5Sink::settle_rows`]). Marked broken until the
    /// caller has done the rest of the open.
    fn adopt(
        path: &Path,
        header: &OutputHeader,
        file: File,
        swmr: bool,
        keep: Option<u64>,
    ) -> Result<Self> {
        let labels = check_layout(path, &file, header)?;
        let (committed_ds, committed) = read_committed_rows(path, &file)?;
        let cols = open_columns(path, &file, header, committed, keep)?;
        let mut sink = Hdf5Sink {
            cols,
            committed_ds: Some(committed_ds),
            file: Some(file),
            path: path.to_path_buf(),
            swmr,
            len: committed,
            committed,
            prepared: committed,
            labels,
            dirty: false,
            header: header.clone(),
            staged: false,
            recycler: Recycler::default(),
            // Until it is fully open: an error on the way only closes the file.
            broken: true,
        };
        sink.settle_rows(keep)?;
        Ok(sink)
    }

    /// Bring a reopened file's rows to what the caller's records account for (`keep`), or to
    /// `committed_rows` without records.
    fn settle_rows(&mut self, keep: Option<u64>) -> Result<()> {
        let committed = self.committed;
        let path = &self.path;
        match keep {
            // The service stopped after the manifest recorded a batch and before the outputs
            // published it (SplitSink::publish): its rows were made durable first, so they are
            // there; publish them now (readers may have seen them in an earlier life of the
            // file). Rows the manifest does not account for were never published under this
            // protocol (outputs of an older version, which committed them first, are adopted
            // into the manifest before this): they are cut.
            Some(k) if k != committed => {
                if k > committed {
                    if let Some(c) = self.cols.iter().find(|c| (c.ds.shape()[0] as u64) < k) {
                        bail!(
                            "{}: dataset {} has {} rows, fewer than the {k} the manifest records; \
                             the file is damaged: move it away and run `ailhd rebuild`",
                            path.display(),
                            c.spec.name,
                            c.ds.shape()[0]
                        );
                    }
                    log::info!(
                        "{}: publishing rows {committed}..{k}, recorded in the manifest before the service stopped",
                        path.display()
                    );
                } else {
                    log::warn!(
                        "{}: cutting rows {k}..{committed}, never recorded in the manifest",
                        path.display()
                    );
                }
                self.resize_all(k)?;
                self.dirty = true;
                self.commit_now()
            }
            // Rows past committed_rows are the partial batch of a crashed writer: drop them so
            // that every dataset again has exactly committed_rows rows.
            _ => self.resize_all(committed),
        }
    }

    /// Run `f`, remembering a failure ([`Hdf5Sink::broken`]); refuse once broken.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.broken {
            bail!(
                "{}: an earlier HDF5 call on this file failed; it is reopened first",
                self.path.display()
            );
        }
        let r = f(self);
        if r.is_err() {
            self.broken = true;
        }
        r
    }

    fn mark_failed(&self) {
        FAILED.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Replace the `labels_json` / `label2id_json` attributes (a label folder appended under
    /// `labels.unknown = "append"`). Ids are never renumbered, so `labels` must extend the
    /// current list.
    ///
    /// Works in SWMR mode: both attributes are fixed-length strings overwritten in place, so
    /// the file's structure does not change (SWMR writers may not add or resize objects) and
    /// readers see the old or the new list, never an error. A SWMR reader keeps the file's
    /// root metadata cached: it sees the new list once it reopens the file.
    ///
    /// The attributes have room for about twice the label list they were created with (at least
    /// 4 KiB). Past that, they are recreated bigger when not in SWMR mode; in SWMR mode that
    /// would change the file's structure under the readers, so it is an error that says to
    /// restart the service (which reopens the file and grows them before starting SWMR).
    pub fn set_labels(&mut self, labels: &[String]) -> Result<()> {
        super::check_labels_extend(&self.path, &self.labels, labels)?;
        if labels == self.labels {
            return Ok(());
        }
        let values = [labels_json(labels), label2id_json(labels)];
        let file = self.file()?;
        for (name, value) in LABEL_ATTRS.iter().zip(&values) {
            let capacity = file.attr(name)?.dtype()?.size();
            if value.len() <= capacity {
                continue;
            }
            if self.swmr {
                bail!(
                    "{}: the new label list needs {} bytes in attribute {name}, which holds \
                     {capacity}; it cannot grow while SWMR readers may be reading: restart \
                     ailhd to grow it",
                    self.path.display(),
                    value.len()
                );
            }
            file.delete_attr(name)?;
            file.new_attr_builder()
                .empty_as(TypeDescriptor::FixedUnicode(2 * value.len()))
                .create(*name)?;
        }
        for (name, value) in LABEL_ATTRS.iter().zip(&values) {
            write_fixed_text_attr(file, name, value)
                .with_context(|| format!("{}: writing attribute {name}", self.path.display()))?;
        }
        if !self.staged {
            self.flush_and_sync()?;
        }
        self.labels = labels.to_vec();
        Ok(())
    }

    /// Before SWMR starts (when the file's structure may still change): make sure the label
    /// attributes have room for the label list to double, recreating them bigger if not.
    fn ensure_label_room(&mut self) -> Result<()> {
        let file = self.file()?;
        for name in LABEL_ATTRS {
            if label_attr_has_room(file, name)? {
                continue;
            }
            let value = read_text_attr(file, name)?;
            file.delete_attr(name)?;
            let capacity = (2 * value.len()).max(LABEL_ATTR_MIN_BYTES);
            file.new_attr_builder()
                .empty_as(TypeDescriptor::FixedUnicode(capacity))
                .create(name)?;
            write_fixed_text_attr(file, name, &value)?;
        }
        Ok(())
    }

    /// The label names in the file (`labels_json`), which may extend the configured list.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn file(&self) -> Result<&File> {
        self.file
            .as_ref()
            .with_context(|| format!("{}: already closed", self.path.display()))
    }

    fn start_swmr(&mut self) -> Result<()> {
        // H5Fstart_swmr_write refuses while attributes are open; none are kept open here.
        self.file()?
            .start_swmr()
            .with_context(|| format!("{}: starting SWMR writing", self.path.display()))?;
        self.swmr = true;
        Ok(())
    }

    fn resize_all(&mut self, rows: u64) -> Result<()> {
        for c in &self.cols {
            let mut shape = c.ds.shape();
            if shape[0] as u64 != rows {
                shape[0] = rows as usize;
                c.ds.resize(shape).with_context(|| {
                    format!("{}: resizing {}", self.path.display(), c.spec.name)
                })?;
            }
        }
        self.len = rows;
        Ok(())
    }

    /// The file descriptor of HDF5's sec2 driver.
    fn fd(&self) -> Result<c_int> {
        let file = self.file()?;
        hdf5::sync::sync(|| unsafe {
            let mut handle: *mut c_void = std::ptr::null_mut();
            hdf5::h5check(H5Fget_vfd_handle(file.id(), H5P_DEFAULT, &mut handle))?;
            // The sec2 driver's handle is a pointer to its file descriptor.
            Ok::<c_int, anyhow::Error>(*(handle as *const c_int))
        })
        .with_context(|| format!("{}: file descriptor", self.path.display()))
    }

    /// Write every cached byte to the file (H5Fflush: raw-data chunk caches, metadata,
    /// superblock), without waiting for the disk.
    fn flush(&self) -> Result<()> {
        let file = self.file()?;
        hdf5::sync::sync(|| unsafe {
            hdf5::h5check(H5Fflush(file.id(), H5F_scope_t::H5F_SCOPE_LOCAL)).map(drop)
        })
        .with_context(|| format!("{}: flushing", self.path.display()))
    }

    /// [`Hdf5Sink::flush`], then `fdatasync`, so that what follows is ordered after it on disk.
    fn flush_and_sync(&self) -> Result<()> {
        let file = self.file()?;
        let fd = self.fd()?;
        hdf5::sync::sync(|| unsafe {
            hdf5::h5check(H5Fflush(file.id(), H5F_scope_t::H5F_SCOPE_LOCAL))?;
            if libc::fdatasync(fd) != 0 {
                return Err(anyhow::Error::from(std::io::Error::last_os_error()));
            }
            Ok(())
        })
        .with_context(|| format!("{}: flushing to disk", self.path.display()))
    }

    fn write_committed_rows(&self) -> Result<()> {
        self.committed_ds
            .as_ref()
            .context("closed")?
            .write(&[self.len as i64])
            .with_context(|| format!("{}: writing committed_rows", self.path.display()))
    }

    /// Shrink away uncommitted rows, flush, close. Idempotent. A broken file (or one whose
    /// shrink or flush fails here) is let go of without a close.
    fn finish(&mut self) -> Result<()> {
        if self.file.is_none() {
            return Ok(());
        }
        let keep = self.committed.max(self.prepared);
        if self.len > keep && !self.broken {
            super::log_dropped_rows(&self.path, self.len - keep, self.staged);
        }
        let result = if self.broken {
            Ok(())
        } else {
            self.resize_all(keep).and_then(|()| {
                if self.staged {
                    Ok(())
                } else {
                    self.flush_and_sync()
                }
            })
        };
        if result.is_err() {
            // A failed call here (a failing disk) leaves the file as broken as any other.
            self.broken = true;
        }
        if self.broken {
            // Not even closed: closing flushes HDF5's cache of the file, which a failed write
            // left inconsistent (closing after write errors has crashed the process). The
            // handles are let go of; the service starts a fresh process before it opens the
            // file again (see `failed_in_this_process`), and the next open cuts what was not
            // committed.
            self.mark_failed();
            std::mem::forget(std::mem::take(&mut self.cols));
            std::mem::forget(self.committed_ds.take());
            std::mem::forget(self.file.take());
            log::warn!(
                "{}: left open after a failed HDF5 call; reopened by a fresh process",
                self.path.display()
            );
            return result.with_context(|| format!("{}: closing", self.path.display()));
        }
        self.cols.clear();
        self.committed_ds = None;
        let file = self.file.take().expect("checked above");
        if let Err(e) = file.close() {
            self.mark_failed();
            return Err(e).with_context(|| format!("{}: closing", self.path.display()));
        }
        if self.staged {
            // Closing wrote everything out; one sync, outside HDF5's lock, makes it durable.
            std::fs::File::open(&self.path)
                .and_then(|f| f.sync_data())
                .with_context(|| format!("{}: syncing", self.path.display()))?;
        }
        Ok(())
    }
}

impl SplitSink for Hdf5Sink {
    fn len(&self) -> u64 {
        self.len
    }

    fn committed_rows(&self) -> u64 {
        self.committed
    }

    fn append(
        &mut self,
        mel: &[f16],
        waveform: Option<&[f32]>,
        meta: &[super::RowMeta],
    ) -> Result<u64> {
        let first = self.len;
        let bytes = pack_rows(&self.header, mel, waveform, meta)?;
        if meta.is_empty() {
            return Ok(first);
        }
        let n = meta.len() as u64;
        // A failure leaves the sink broken (no further HDF5 call on it): the engine drops it,
        // and the next open cuts the rows past committed_rows.
        self.guarded(|s| {
            s.dirty = true;
            s.resize_all(first + n)?;
            s.cols.iter().zip(&bytes).try_for_each(|(c, b)| {
                write_rows(&c.ds, &c.mem_type, first, n, b).with_context(|| {
                    format!("{}: writing {n} rows of {}", s.path.display(), c.spec.name)
                })
            })
        })
        .map(|()| first)
    }

    fn set_valid(&mut self, row: u64, valid: bool) -> Result<()> {
        self.write_cell("valid", row, &[valid as u8])
    }

    fn write_cell(&mut self, name: &str, row: u64, bytes: &[u8]) -> Result<()> {
        self.guarded(|s| Hdf5Sink::write_cell(s, name, row, bytes))
    }

    fn set_labels(&mut self, labels: &[String]) -> Result<()> {
        self.guarded(|s| Hdf5Sink::set_labels(s, labels))
    }

    fn commit(&mut self) -> Result<()> {
        if !self.dirty {
            return Ok(());
        }
        self.guarded(|s| s.commit_now())
    }

    fn prepare(&mut self) -> Result<()> {
        if self.dirty && !self.staged {
            self.guarded(|s| s.flush_and_sync())?;
            self.prepared = self.len;
        }
        Ok(())
    }

    fn publish(&mut self) -> Result<()> {
        if !self.dirty {
            return Ok(());
        }
        if !self.staged {
            // Written and flushed to the file (SWMR readers read it there), not synced: see
            // SplitSink::publish.
            self.guarded(|s| {
                s.write_committed_rows()?;
                s.flush()
            })?;
        }
        self.committed = self.len;
        self.dirty = false;
        Ok(())
    }

    fn close(mut self: Box<Self>) -> Result<()> {
        self.finish()
    }

    fn start_writeback(&mut self) -> Result<()> {
        let fd = self.fd()?;
        if self.staged {
            self.recycler
                .recycle(fd)
                .with_context(|| format!("{}: writing back", self.path.display()))?;
        }
        // Chunks still in HDF5's cache are written by the commit; this starts on the rest.
        super::start_writeback(fd, &self.path)
    }
}

impl Drop for Hdf5Sink {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            log::error!("{}: closing: {e:#}", self.path.display());
        }
    }
}

impl Hdf5Sink {
    fn commit_now(&mut self) -> Result<()> {
        if self.staged {
            // Nobody opens a staging output before its close has synced it.
            self.write_committed_rows()?;
            self.committed = self.len;
            self.dirty = false;
            return Ok(());
        }
        // Data first, durably; only then the count that makes it visible.
        self.flush_and_sync()?;
        self.write_committed_rows()?;
        self.flush_and_sync()?;
        self.committed = self.len;
        self.dirty = false;
        Ok(())
    }

    fn write_cell(&mut self, name: &str, row: u64, bytes: &[u8]) -> Result<()> {
        if row >= self.len {
            bail!(
                "{}: row {row} does not exist ({} rows)",
                self.path.display(),
                self.len
            );
        }
        let c = self
            .cols
            .iter()
            .find(|c| c.spec.name == name)
            .expect("every layout has this column");
        self.dirty = true;
        write_rows(&c.ds, &c.mem_type, row, 1, bytes)
            .with_context(|| format!("{}: writing {name}[{row}]", self.path.display()))
    }
}

/// Write `rows` rows starting at `first` of dataset `ds` (whose extent already covers them)
/// from `bytes`, laid out as `mem_type`: one hyperslab, one H5Dwrite. The memory types are
/// the ones the datasets were created with, so HDF5 copies without converting.
fn write_rows(
    ds: &Dataset,
    mem_type: &Datatype,
    first: u64,
    rows: u64,
    bytes: &[u8],
) -> Result<()> {
    let Some(sel) = select_rows(ds, first, rows)? else {
        assert!(bytes.is_empty(), "row bytes for no rows");
        return Ok(());
    };
    let expected = mem_type.size() * sel.elements as usize;
    assert_eq!(bytes.len(), expected, "row bytes do not match the dataset");
    hdf5::sync::sync(|| unsafe {
        hdf5::h5check(H5Dwrite(
            ds.id(),
            mem_type.id(),
            sel.mem.0,
            sel.file.0,
            H5P_DEFAULT,
            bytes.as_ptr() as *const c_void,
        ))?;
        Ok(())
    })
}

/// Whole rows of a dataset, selected for one H5Dread or H5Dwrite ([`select_rows`]).
pub(crate) struct RowSelection {
    pub file: Id,
    pub mem: Id,
    /// Elements selected (rows times the elements of a row).
    pub elements: u64,
}

/// Rows `first..first + rows` of `ds`: the file's dataspace with that hyperslab of whole rows
/// selected, and the matching memory space. None when the selection holds no element.
pub(crate) fn select_rows(ds: &Dataset, first: u64, rows: u64) -> Result<Option<RowSelection>> {
    let row_dims: Vec<u64> = ds.shape()[1..].iter().map(|&d| d as u64).collect();
    let mut start = vec![first];
    start.extend(row_dims.iter().map(|_| 0));
    let mut count = vec![rows];
    count.extend(&row_dims);
    let elements: u64 = count.iter().product();
    if elements == 0 {
        return Ok(None);
    }
    let spaces = hdf5::sync::sync(|| unsafe {
        let file = Id(hdf5::h5check(H5Dget_space(ds.id()))?, H5Sclose);
        hdf5::h5check(H5Sselect_hyperslab(
            file.0,
            H5S_seloper_t::H5S_SELECT_SET,
            start.as_ptr(),
            std::ptr::null(),
            count.as_ptr(),
            std::ptr::null(),
        ))?;
        let mem = Id(
            hdf5::h5check(H5Screate_simple(
                count.len() as c_int,
                count.as_ptr(),
                std::ptr::null(),
            ))?,
            H5Sclose,
        );
        Ok::<_, hdf5::Error>((file, mem))
    })?;
    Ok(Some(RowSelection {
        file: spaces.0,
        mem: spaces.1,
        elements,
    }))
}

/// An HDF5 id closed on drop by its close function.
pub(crate) struct Id(
    pub hid_t,
    pub unsafe extern "C" fn(hid_t) -> hdf5_sys::h5::herr_t,
);

impl Drop for Id {
    fn drop(&mut self) {
        // Under the hdf5 crate's lock, like every HDF5 call: the library is not thread-safe
        // by itself, and sinks on other threads call it at the same time (seen crash: two
        // staging sinks on threads of their own, one closing a selection while the other
        // wrote).
        hdf5::sync::sync(|| unsafe {
            (self.1)(self.0);
        });
    }
}

/// The HDF5 type of one element of a column (also the file type the column is created with).
fn memory_type(t: ColumnType) -> Result<Datatype> {
    Ok(match t {
        ColumnType::F16 => Datatype::from_type::<f16>()?,
        ColumnType::I16 => Datatype::from_type::<i16>()?,
        ColumnType::U8 => Datatype::from_type::<u8>()?,
        ColumnType::I64 => Datatype::from_type::<i64>()?,
        ColumnType::F32 => Datatype::from_type::<f32>()?,
        ColumnType::Str(n) => Datatype::from_descriptor(&TypeDescriptor::FixedUnicode(n))?,
    })
}

/// Rows per chunk of a column: [`CHUNK_BYTES`] of whole rows for the features,
/// [`NARROW_CHUNK_BYTES`] for the other columns; at least one.
fn chunk_rows(spec: &ColumnSpec) -> usize {
    let target = if spec.is_features() {
        CHUNK_BYTES
    } else {
        NARROW_CHUNK_BYTES
    };
    (target / spec.row_bytes()).clamp(1, MAX_CHUNK_ROWS)
}

/// `(threshold, alignment)` for `H5Pset_alignment`: every allocation at least as big as a
/// `segments_mel` chunk starts at a multiple of the features' row size, so every row of
/// `segments_mel` lies at a multiple of its own size in the file (see [`CHUNK_BYTES`]).
/// Smaller objects (metadata, the narrow columns' chunks of [`NARROW_CHUNK_BYTES`]) are not
/// padded.
/// Alignment is a property of the open, not of the file: every open for writing (create,
/// `open_append`) sets it, so chunks the service appends are aligned as `rebuild`'s are.
fn feature_alignment(header: &OutputHeader) -> (u64, u64) {
    let mel = columns(header)
        .into_iter()
        .find(|c| c.name == "segments_mel")
        .expect("every layout has segments_mel");
    let row = mel.row_bytes() as u64;
    (chunk_rows(&mel) as u64 * row, row)
}

/// File-access settings for every open: v1.10 format, no file locking, bigger chunk cache,
/// feature chunks aligned to rows ([`feature_alignment`]); in a staging file, to a multiple of
/// both the row size and the page size, so that no page holds both feature rows and other
/// bytes, and the pages [`Recycler`] drops are never written again (HDF5 rewrites its metadata
/// in place, features never).
fn file_access(header: &OutputHeader, staged: bool) -> Result<FileAccess> {
    let (threshold, mut alignment) = feature_alignment(header);
    if staged {
        // The least common multiple of the row size and the page size.
        let page = direct::BLOCK as u64;
        alignment = alignment / crate::decode::gcd(alignment, page) * page;
    }
    Ok(FileAccess::build()
        .libver_bounds(LibraryVersion::V110, LibraryVersion::V110)
        .file_locking(false)
        .chunk_cache(CHUNK_CACHE_SLOTS, CHUNK_CACHE_BYTES, 1.0)
        .alignment(threshold, alignment)
        .finish()?)
}

/// Open an existing file with `flags` (read-write, and SWMR writing with
/// `H5F_ACC_SWMR_WRITE`); a file HDF5 refuses (HDF5's "file is already open for write (may use
/// `h5clear file` ...)", or "file is not already open for SWMR writing": a writer without SWMR
/// was killed, as a plain open for a label list's room was) is tried once more with the status
/// flags cleared.
fn open_recovering(path: &Path, header: &OutputHeader, flags: std::ffi::c_uint) -> Result<File> {
    match open_with(path, header, flags, false) {
        Ok(f) => Ok(f),
        Err(first) => {
            log::warn!(
                "{}: {first:#}; assuming its writer was killed and recovering it",
                path.display()
            );
            open_with(path, header, flags, true).with_context(|| {
                format!(
                    "{}: cannot be opened for appending even with HDF5's status flags \
                     cleared (first attempt: {first:#}); if it stays unreadable, move it away \
                     and run `ailhd rebuild`",
                    path.display()
                )
            })
        }
    }
}

/// Check that a reopened file has this layout version and the configured feature settings;
/// returns its label list.
fn check_layout(path: &Path, file: &File, header: &OutputHeader) -> Result<Vec<String>> {
    let schema = file
        .attr("schema_version")
        .and_then(|a| a.read_scalar::<u32>())
        .map(u64::from)
        .map_err(|e| e.to_string());
    super::check_output_version(path, schema)?;
    let fingerprint = read_text_attr(file, "feature_fingerprint")
        .map_err(|e| incompatible(path, format_args!("no readable feature_fingerprint ({e})")))?;
    if !header.features.made(&fingerprint) {
        let stored = read_text_attr(file, "config_json").ok();
        super::check_features(path, &fingerprint, stored.as_deref(), &header.features)?;
    }
    let labels_text = read_text_attr(file, "labels_json")?;
    serde_json::from_str(&labels_text)
        .with_context(|| format!("{}: labels_json is not a JSON list", path.display()))
}

/// The `committed_rows` dataset and the count it holds.
fn read_committed_rows(path: &Path, file: &File) -> Result<(Dataset, u64)> {
    let committed_ds = file
        .dataset("committed_rows")
        .map_err(|e| incompatible(path, format_args!("no committed_rows dataset ({e})")))?;
    let committed = match committed_ds.read_raw::<i64>()?.as_slice() {
        [c] if *c >= 0 => *c as u64,
        other => bail!(
            "{}: committed_rows holds {other:?}, not one count; the file is damaged: move it \
             away and run `ailhd rebuild`",
            path.display()
        ),
    };
    Ok((committed_ds, committed))
}

/// The datasets of a reopened file, each checked for its type, row shape and a row count of
/// at least `committed` (rows past `keep`, or past `committed` without it, are logged as
/// reclaimed).
fn open_columns(
    path: &Path,
    file: &File,
    header: &OutputHeader,
    committed: u64,
    keep: Option<u64>,
) -> Result<Vec<Column>> {
    let mut cols = Vec::new();
    for spec in columns(header) {
        let ds = file
            .dataset(spec.name)
            .map_err(|e| incompatible(path, format_args!("no dataset {} ({e})", spec.name)))?;
        let mem_type = memory_type(spec.dtype)?;
        let found = ds.dtype()?.to_descriptor()?;
        // Its width is the configuration's (outputs.path_bytes), not the file's damage.
        if let (
            ColumnType::Str(configured),
            TypeDescriptor::FixedUnicode(stored) | TypeDescriptor::FixedAscii(stored),
        ) = (spec.dtype, &found)
        {
            if spec.name == "source_path" {
                super::check_path_bytes(path, *stored, configured)?;
            }
        }
        let shape = ds.shape();
        if found != mem_type.to_descriptor()? || shape[1..] != spec.row_dims[..] {
            return Err(incompatible(
                path,
                format_args!(
                    "dataset {} is {found:?} with shape {shape:?}, expected {:?} rows of {:?}",
                    spec.name,
                    mem_type.to_descriptor()?,
                    spec.row_dims
                ),
            ));
        }
        if (shape[0] as u64) < committed {
            bail!(
                "{}: dataset {} has {} rows, fewer than committed_rows = {committed}; the file \
                 is damaged: move it away and run `ailhd rebuild`",
                path.display(),
                spec.name,
                shape[0]
            );
        }
        if shape[0] as u64 > keep.unwrap_or(committed).max(committed) {
            log::info!(
                "{}: reclaiming {} uncommitted rows of {}",
                path.display(),
                shape[0] as u64 - keep.unwrap_or(committed).max(committed),
                spec.name
            );
        }
        cols.push(Column { spec, ds, mem_type });
    }
    Ok(cols)
}

/// Open with `flags` for appending; with `clear_flags`, first clear the superblock's "open for
/// write" status flags a killed writer left (what `h5clear -s` does, through the same property).
fn open_with(
    path: &Path,
    header: &OutputHeader,
    flags: std::ffi::c_uint,
    clear_flags: bool,
) -> Result<File> {
    h5fopen(path, &file_access(header, false)?, flags, clear_flags)
        .with_context(|| format!("{}: opening HDF5 file for appending", path.display()))
}

/// `H5Fopen` with `flags` (read-write, perhaps SWMR writing too) and `fapl`, clearing the
/// status flags first when asked.
fn h5fopen(
    path: &Path,
    fapl: &FileAccess,
    flags: std::ffi::c_uint,
    clear_flags: bool,
) -> Result<File> {
    let name = CString::new(path.as_os_str().as_encoded_bytes())
        .with_context(|| format!("{}: path contains a NUL byte", path.display()))?;
    let prop = CString::new(CLEAR_STATUS_FLAGS).unwrap();
    hdf5::sync::sync(|| unsafe {
        if clear_flags {
            let mut yes = true;
            hdf5::h5check(H5Pset(
                fapl.id(),
                prop.as_ptr(),
                &mut yes as *mut bool as *mut c_void,
            ))?;
        }
        let id = hdf5::h5check(H5Fopen(name.as_ptr(), flags, fapl.id()))?;
        let file = hdf5::from_id::<File>(id)?;
        // A SWMR writer killed mid-append can leave chunks (and the index entries pointing at
        // them) past the end of the file its superblock records, which is only rewritten at a
        // flush: every write into such a chunk would fail ("addr overflow"). Take the end as
        // the larger of the two, as `h5clear --increment=0` does; a no-op for a file closed
        // cleanly.
        hdf5::h5check(H5Fincrement_filesize(id, 0))?;
        Ok::<_, hdf5::Error>(file)
    })
    .map_err(anyhow::Error::from)
}

/// Whether a label attribute (`labels_json`, `label2id_json`) is a fixed-length string with room
/// for twice its text, so that a SWMR writer can rewrite it in place
/// ([`Hdf5Sink::set_labels`]).
fn label_attr_has_room(file: &File, name: &str) -> Result<bool> {
    let value = read_text_attr(file, name)?;
    let dtype = file.attr(name)?.dtype()?;
    let fixed = matches!(dtype.to_descriptor()?, TypeDescriptor::FixedUnicode(_));
    Ok(fixed && dtype.size() >= 2 * value.len())
}

/// [`label_attr_has_room`] for every label attribute.
fn label_room(file: &File) -> Result<bool> {
    for name in LABEL_ATTRS {
        if !label_attr_has_room(file, name)? {
            return Ok(false);
        }
    }
    Ok(true)
}

extern "C" {
    // In HDF5 since 1.10.2 (the library is built from source with the crate); hdf5-sys has no
    // binding for it.
    fn H5Fincrement_filesize(
        file_id: hid_t,
        increment: hdf5_sys::h5::hsize_t,
    ) -> hdf5_sys::h5::herr_t;
}

/// Clear the superblock's "open for write" status flags a killed writer left (`h5clear -s`),
/// so that readers open the file again: a writer killed while it had the file open without SWMR
/// (a plain open, as for a grown label list's room, or one of an older version) leaves flags
/// that SWMR readers refuse too ("file is not already open for SWMR writing"). Only for the
/// holder of the writer lock (see [`Hdf5Sink::open_append`]).
pub fn clear_status_flags(path: &Path) -> Result<()> {
    let fapl = FileAccess::build()
        .libver_bounds(LibraryVersion::V110, LibraryVersion::V110)
        .file_locking(false)
        .finish()?;
    h5fopen(path, &fapl, H5F_ACC_RDWR, true)
        .and_then(|file| Ok(file.close()?))
        .with_context(|| format!("{}: clearing HDF5's status flags", path.display()))
}

/// The attributes rewritten by [`Hdf5Sink::set_labels`] (fixed-length, see the module notes).
const LABEL_ATTRS: [&str; 2] = ["labels_json", "label2id_json"];

/// Create the string attribute `name` holding `value`, of the type every output file gives it
/// (the module notes): the label attributes fixed-length with room to grow, the others
/// variable-length. Also used by `merge`, so that a reader gets the same Python types from a
/// merged file as from the service's.
pub fn create_text_attr(file: &File, name: &str, value: &str) -> Result<()> {
    if LABEL_ATTRS.contains(&name) {
        let capacity = (2 * value.len()).max(LABEL_ATTR_MIN_BYTES);
        file.new_attr_builder()
            .empty_as(TypeDescriptor::FixedUnicode(capacity))
            .create(name)?;
        write_fixed_text_attr(file, name, value)
    } else {
        file.new_attr::<VarLenUnicode>()
            .create(name)?
            .write_scalar(&vlen(value)?)?;
        Ok(())
    }
}

/// Read a string attribute, variable- or fixed-length (NUL padding removed). Also used by
/// `merge` to read its inputs' attributes.
pub fn read_text_attr(file: &File, name: &str) -> Result<String> {
    let attr = file
        .attr(name)
        .map_err(|e| anyhow::anyhow!("no attribute {name} ({e})"))?;
    let dtype = attr.dtype()?;
    match dtype.to_descriptor()? {
        TypeDescriptor::VarLenUnicode => Ok(attr.read_scalar::<VarLenUnicode>()?.as_str().into()),
        TypeDescriptor::FixedUnicode(n) | TypeDescriptor::FixedAscii(n) => {
            let mut buf = vec![0u8; n];
            hdf5::sync::sync(|| unsafe {
                hdf5::h5check(H5Aread(
                    attr.id(),
                    dtype.id(),
                    buf.as_mut_ptr() as *mut c_void,
                ))
            })?;
            let end = buf.iter().position(|&b| b == 0).unwrap_or(n);
            buf.truncate(end);
            String::from_utf8(buf).with_context(|| format!("attribute {name} is not UTF-8"))
        }
        other => bail!("attribute {name} is {other:?}, not a string"),
    }
}

/// Overwrite a fixed-length string attribute in place with `value`, NUL padded.
fn write_fixed_text_attr(file: &File, name: &str, value: &str) -> Result<()> {
    let attr = file.attr(name)?;
    let dtype = attr.dtype()?;
    let mut buf = value.as_bytes().to_vec();
    if buf.len() > dtype.size() {
        bail!(
            "{} bytes do not fit attribute {name} ({} bytes)",
            buf.len(),
            dtype.size()
        );
    }
    buf.resize(dtype.size(), 0);
    hdf5::sync::sync(|| unsafe {
        hdf5::h5check(H5Awrite(
            attr.id(),
            dtype.id(),
            buf.as_ptr() as *const c_void,
        ))
    })?;
    Ok(())
}

fn vlen(s: &str) -> Result<VarLenUnicode> {
    s.parse::<VarLenUnicode>()
        .map_err(|e| anyhow::anyhow!("attribute value {s:?}: {e}"))
}

fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    path.with_file_name(name)
}

/// Make a rename in `path`'s directory durable.
fn sync_parent_dir(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing directory {}", dir.display()))
}
