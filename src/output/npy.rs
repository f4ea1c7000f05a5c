//! npy column files: `npy/<split>/<column>.npy`, one per HDF5 dataset, plus `attributes.json`
//! (the HDF5 file attributes and `committed_rows`). `numpy.load(path, mmap_mode="r")` opens
//! each file as is, and its header shape is the committed row count (docs/reading.md, "Layout on disk").
//!
//! How a file grows without moving its data: the npy v1.0 header is written once with room for
//! a 20-digit row count (padded with spaces to a multiple of 64 bytes, as numpy pads), rows are
//! appended after the data with positional writes, and a commit `fdatasync`s the data before
//! rewriting the shape in the header in place (through a memory map of the header). A crash
//! therefore leaves every header describing complete rows; reopening truncates what lies past
//! the smallest header shape.

use super::direct::{self, DirectStream};
use super::{
    columns, header_attributes, incompatible, label2id_json, labels_json, pack_rows, ColumnSpec,
    ColumnType, OutputHeader, RowMeta, SplitSink, OUTPUT_SCHEMA_VERSION,
};
use anyhow::{bail, Context, Result};
use half::f16;
use memmap2::{MmapMut, MmapOptions};
use serde_json::{Map, Value};
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const MAGIC: &[u8] = b"\x93NUMPY";
const ATTRIBUTES: &str = "attributes.json";

/// One split's npy columns, open for appending.
pub struct NpySink {
    dir: PathBuf,
    header: OutputHeader,
    cols: Vec<NpyColumn>,
    len: u64,
    committed: u64,
    /// Rows made durable by [`SplitSink::prepare`]: kept by a close (see the HDF5 sink's field).
    prepared: u64,
    /// `attributes.json` without `committed_rows` (added when written).
    attrs: Map<String, Value>,
    labels: Vec<String>,
    /// Rows appended or cells edited since the last commit.
    dirty: bool,
    closed: bool,
    /// A staging output (`rebuild`): no reader sees it before it is swapped in, and a crash
    /// before that discards it, so its commits only count the rows and its close makes every
    /// file durable at once (one `fdatasync` each, instead of two rounds per commit).
    staged: bool,
    /// Feature bytes written directly (bypassing the page cache), for tests and the log.
    direct_bytes: u64,
}

struct NpyColumn {
    spec: ColumnSpec,
    path: PathBuf,
    file: File,
    /// Bytes before the first row; fixed for the life of the file.
    header_len: usize,
    /// The header region, rewritten in place by commits. Never remapped: the header never moves.
    header_map: MmapMut,
    /// Whole-file map for in-place cell edits (`set_valid`, `set_label`), made on first use and
    /// remapped when the edited row lies past its end (the file grows by positional writes).
    edit_map: Option<MmapMut>,
    /// A staging output's feature column: its rows go to the disk directly
    /// ([`super::direct`]), until the close or an edit of one of its cells.
    direct: Option<DirectStream>,
}

impl NpySink {
    /// Create `dir` (an error if it already holds an output) with an empty file per column and
    /// `attributes.json`. Built as `<dir>.partial` and renamed into place when complete.
    pub fn create(dir: &Path, header: &OutputHeader) -> Result<Self> {
        Self::create_with(dir, header, true, false)
    }

    /// [`NpySink::create`] for staging outputs (`rebuild`): the new files are not synced one
    /// by one, since their close syncs every column and `attributes.json` before the
    /// staging folder is swapped in, and a crash before that discards the staging folder.
    /// Its feature columns are written directly to the disk where the file system allows
    /// ([`super::direct`]); `direct: false` writes them through the page cache too.
    pub fn create_staged(dir: &Path, header: &OutputHeader, direct: bool) -> Result<Self> {
        Self::create_with(dir, header, false, direct)
    }

    fn create_with(dir: &Path, header: &OutputHeader, sync: bool, direct: bool) -> Result<Self> {
        if dir.join(ATTRIBUTES).exists() {
            bail!(
                "{}: already holds an npy output; not overwriting it",
                dir.display()
            );
        }
        let partial = partial_path(dir);
        if partial.exists() {
            log::info!(
                "removing {} left by an interrupted create",
                partial.display()
            );
            std::fs::remove_dir_all(&partial)
                .with_context(|| format!("removing {}", partial.display()))?;
        }
        std::fs::create_dir_all(&partial)
            .with_context(|| format!("creating {}", partial.display()))?;
        for spec in columns(header) {
            let path = partial.join(format!("{}.npy", spec.name));
            let file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .with_context(|| format!("creating {}", path.display()))?;
            let header_len = header_len_for(&spec);
            file.write_all_at(&npy_header(&spec, 0, header_len), 0)
                .and_then(|()| if sync { file.sync_all() } else { Ok(()) })
                .with_context(|| format!("writing {}", path.display()))?;
        }
        let mut attrs = Map::new();
        for (name, value) in header_attributes(header) {
            attrs.insert(name.to_string(), Value::from(value));
        }
        attrs.insert("schema_version".into(), Value::from(OUTPUT_SCHEMA_VERSION));
        write_attributes(&partial, &attrs, 0, sync)?;
        if dir.exists() {
            // An empty directory (nothing above found attributes.json): replace it.
            std::fs::remove_dir(dir).with_context(|| {
                format!(
                    "{}: exists and is not an npy output; move it away",
                    dir.display()
                )
            })?;
        }
        std::fs::rename(&partial, dir)
            .with_context(|| format!("renaming {} into place", partial.display()))?;
        if sync {
            sync_dir(dir.parent().unwrap_or(Path::new(".")))?;
        }
        // New columns hold no rows: nothing to cut back (and to sync) when staged.
        let mut sink = Self::open(dir, header, None, if sync { Open::Cut } else { Open::AsIs })?;
        sink.staged = !sync;
        if sink.staged && direct {
            for c in sink.cols.iter_mut().filter(|c| c.spec.is_features()) {
                c.direct = DirectStream::open(&c.path, c.data_offset(0))
                    .with_context(|| format!("opening {} for direct writes", c.path.display()))?;
            }
        }
        Ok(sink)
    }

    /// The rows [`NpySink::open_append`] takes as committed (the smallest header shape of the
    /// columns), read without opening anything for writing.
    pub fn committed_rows_on_disk(dir: &Path, header: &OutputHeader) -> Result<u64> {
        let mut rows = u64::MAX;
        for spec in columns(header) {
            let path = dir.join(format!("{}.npy", spec.name));
            let mut file =
                File::open(&path).with_context(|| format!("opening {}", path.display()))?;
            rows = rows.min(read_npy_header(&mut file, &spec, &path)?.1);
        }
        Ok(if rows == u64::MAX { 0 } else { rows })
    }

    /// Reopen `dir` for appending: check `schema_version` and `feature_fingerprint` against
    /// `header` (an error that says to run `ailhd rebuild` if they differ) and each column's
    /// header against the layout, then cut every column back to the committed rows (the
    /// smallest header shape; rows past it are a crashed writer's partial batch).
    ///
    /// `keep`: as for [`super::hdf5::Hdf5Sink::open_append`], rows past it are reclaimed too.
    pub fn open_append(dir: &Path, header: &OutputHeader, keep: Option<u64>) -> Result<Self> {
        Self::open(dir, header, keep, Open::Cut)
    }

    /// [`NpySink::open_append`] after this process closed the split cleanly at `rows` (every
    /// write synced): columns that still hold exactly those rows are taken as they are, with no
    /// sync; anything else goes the way of [`NpySink::open_append`].
    pub fn resume(dir: &Path, header: &OutputHeader, rows: u64) -> Result<Self> {
        Self::open(dir, header, Some(rows), Open::Resume)
    }

    fn open(dir: &Path, header: &OutputHeader, keep: Option<u64>, how: Open) -> Result<Self> {
        let Attributes {
            attrs,
            labels,
            committed: attrs_rows,
        } = read_attributes(dir, header)?;
        let (cols, on_disk, uniform) = open_columns(dir, header, how == Open::Cut)?;
        let committed = keep.unwrap_or(on_disk);
        let mut exact = uniform && committed == on_disk && attrs_rows == Some(committed);
        for c in &cols {
            exact &= c.check_size(committed)?;
        }
        if how == Open::Resume && !exact {
            // Not as this process left it: the way of any reopen, whose stale write errors are
            // taken before the columns are opened.
            drop(cols);
            return Self::open(dir, header, keep, Open::Cut);
        }
        // Rows past the headers that the manifest records (`keep`) were made durable before the
        // manifest recorded them (SplitSink::prepare), and the service stopped before it
        // published them: they are kept (the size check above finds them, or a damaged file).
        if committed > on_disk {
            log::info!(
                "{}: publishing rows {on_disk}..{committed}, recorded in the manifest before the service stopped",
                dir.display()
            );
        } else if committed < on_disk {
            log::warn!(
                "{}: cutting rows {committed}..{on_disk}, never recorded in the manifest",
                dir.display()
            );
        }
        let mut sink = NpySink {
            dir: dir.to_path_buf(),
            header: header.clone(),
            cols,
            len: committed,
            committed,
            prepared: committed,
            attrs,
            labels,
            dirty: false,
            closed: false,
            staged: false,
            direct_bytes: 0,
        };
        match how {
            // New, or as this process left it (the process that synced every write of it).
            Open::AsIs | Open::Resume => {}
            // Nothing to cut (as after a clean stop): the columns' data and headers were made
            // durable by the fsync of each column at open (open_columns), and attributes.json's
            // replacement by this sync of its folder.
            Open::Cut if exact => sync_dir(dir)?,
            Open::Cut => sink.cut_to(committed, committed)?,
        }
        Ok(sink)
    }

    /// Replace `labels_json` / `label2id_json` in `attributes.json` (labels appended under
    /// `labels.unknown = "append"`); `labels` must extend the current list.
    pub fn set_labels(&mut self, labels: &[String]) -> Result<()> {
        super::check_labels_extend(&self.dir, &self.labels, labels)?;
        if labels == self.labels {
            return Ok(());
        }
        self.attrs
            .insert("labels_json".into(), Value::from(labels_json(labels)));
        self.attrs
            .insert("label2id_json".into(), Value::from(label2id_json(labels)));
        write_attributes(&self.dir, &self.attrs, self.committed, !self.staged)?;
        self.labels = labels.to_vec();
        Ok(())
    }

    /// The label names in `attributes.json`, which may extend the configured list.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Feature bytes written directly to the disk so far ([`super::direct`]).
    pub fn direct_bytes(&self) -> u64 {
        self.direct_bytes
    }

    /// Make `rows` the committed length of every column, durably: truncate the data past
    /// `keep` rows (at least `rows`), rewrite the headers and `attributes.json`.
    fn cut_to(&mut self, rows: u64, keep: u64) -> Result<()> {
        let sync = !self.staged;
        for c in &mut self.cols {
            c.edit_map = None;
            c.file
                .set_len(c.data_offset(keep.max(rows)))
                .and_then(|()| if sync { c.file.sync_all() } else { Ok(()) })
                .with_context(|| format!("truncating {}", c.path.display()))?;
            c.write_shape(rows, sync)?;
        }
        write_attributes(&self.dir, &self.attrs, rows, sync)?;
        if !sync {
            self.sync_staged()?;
        }
        self.len = rows;
        self.committed = rows;
        Ok(())
    }

    /// A staging output's close: every column (rows, cell edits and header, all written through
    /// the page cache, which `fdatasync` writes back whether they came by `pwrite` or through a
    /// shared map, unmapped or not), `attributes.json`, and the folder, each synced once.
    fn sync_staged(&self) -> Result<()> {
        for c in &self.cols {
            c.file
                .sync_data()
                .with_context(|| format!("syncing {}", c.path.display()))?;
        }
        let attributes = self.dir.join(ATTRIBUTES);
        File::open(&attributes)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("syncing {}", attributes.display()))?;
        sync_dir(&self.dir)
    }

    /// Start writing every column's dirty pages to disk without waiting
    /// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`).
    fn queue_writeback(&self) -> Result<()> {
        for c in &self.cols {
            super::start_writeback(c.file.as_raw_fd(), &c.path)?;
        }
        Ok(())
    }

    /// Appended rows and in-place edits of every column durable on disk. Every column's pages
    /// are queued for writing first ([`NpySink::queue_writeback`]), so that the disk writes them
    /// together and the syncs after the first find little left to do (presumably because its
    /// journal commit also covers the other columns' new sizes; measured in docs/benchmarks.md,
    /// "The npy commit's syncs").
    fn sync_data(&self) -> Result<()> {
        self.queue_writeback()?;
        for c in &self.cols {
            if let Some(m) = &c.edit_map {
                m.flush()
                    .with_context(|| format!("flushing {}", c.path.display()))?;
            }
            c.file
                .sync_data()
                .with_context(|| format!("syncing {}", c.path.display()))?;
        }
        Ok(())
    }

    fn write_cell(&mut self, name: &str, row: u64, bytes: &[u8]) -> Result<()> {
        if row >= self.len {
            bail!(
                "{}: row {row} does not exist ({} rows)",
                self.dir.display(),
                self.len
            );
        }
        let c = self
            .cols
            .iter_mut()
            .find(|c| c.spec.name == name)
            .expect("every layout has this column");
        // The cell may still be in the direct stream's buffer: the column's rows go through
        // the page cache from here on.
        c.end_direct()?;
        let at = c.data_offset(row) as usize;
        let end = at + bytes.len();
        if c.edit_map.as_ref().is_none_or(|m| m.len() < end) {
            // The row was appended after the map was made (or there is none yet).
            c.edit_map = Some(
                unsafe { MmapOptions::new().map_mut(&c.file) }
                    .with_context(|| format!("mapping {}", c.path.display()))?,
            );
        }
        c.edit_map.as_mut().expect("just made")[at..end].copy_from_slice(bytes);
        self.dirty = true;
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        for c in &mut self.cols {
            c.end_direct()?;
        }
        if self.direct_bytes > 0 {
            log::debug!(
                "{}: {} feature bytes written directly",
                self.dir.display(),
                self.direct_bytes
            );
        }
        if self.len > self.committed {
            super::log_dropped_rows(&self.dir, self.len - self.committed, self.staged);
        }
        // Cell edits are in place (not transactional): make them durable too (a staging
        // output's are, by the syncs of its cut).
        if !self.staged {
            for c in &self.cols {
                if let Some(m) = &c.edit_map {
                    m.flush()
                        .with_context(|| format!("flushing {}", c.path.display()))?;
                }
            }
        }
        let (committed, keep) = (self.committed, self.committed.max(self.prepared));
        self.cut_to(committed, keep)
    }
}

impl NpyColumn {
    /// The file holds at least `committed` rows (an error when fewer; bytes past them are
    /// logged as reclaimed). Returns whether it holds exactly that many.
    fn check_size(&self, committed: u64) -> Result<bool> {
        let size = self.file.metadata()?.len();
        let want = self.data_offset(committed);
        if size < want {
            bail!(
                "{}: {size} bytes, too short for its {committed} committed rows; the output \
                 is damaged: move it away and run `ailhd rebuild`",
                self.path.display()
            );
        }
        if size > want {
            log::info!(
                "{}: reclaiming {} bytes of uncommitted rows",
                self.path.display(),
                size - want
            );
        }
        Ok(size == want)
    }

    fn data_offset(&self, row: u64) -> u64 {
        self.header_len as u64 + row * self.spec.row_bytes() as u64
    }

    /// Append `bytes` at `offset` (the end of the rows), directly if the column is written
    /// that way; where the file system refuses, the column goes through the page cache from
    /// here on. Returns the bytes that went directly.
    fn append_at(&mut self, bytes: &[u8], offset: u64) -> std::io::Result<u64> {
        if let Some(d) = &mut self.direct {
            let before = d.written;
            match d.append(&self.file, bytes, offset) {
                Ok(()) => return Ok(d.written - before),
                Err(e) if direct::refused(&e) => {
                    log::info!(
                        "{}: direct writes refused ({e}); writing through the page cache",
                        self.path.display()
                    );
                    self.end_direct()?;
                }
                Err(e) => return Err(e),
            }
        }
        self.file.write_all_at(bytes, offset).map(|()| 0)
    }

    /// Write what the direct stream still holds; the column's rows go through the page cache
    /// from here on.
    fn end_direct(&mut self) -> std::io::Result<()> {
        match self.direct.take() {
            Some(d) => d.finish(&self.file),
            None => Ok(()),
        }
    }

    /// Rewrite the shape in the header, in place; with `sync`, wait for it to reach the disk.
    fn write_shape(&mut self, rows: u64, sync: bool) -> Result<()> {
        self.header_map
            .copy_from_slice(&npy_header(&self.spec, rows, self.header_len));
        if !sync {
            return Ok(());
        }
        self.header_map
            .flush()
            .with_context(|| format!("writing the header of {}", self.path.display()))
    }
}

impl SplitSink for NpySink {
    fn len(&self) -> u64 {
        self.len
    }

    fn committed_rows(&self) -> u64 {
        self.committed
    }

    fn append(&mut self, mel: &[f16], waveform: Option<&[f32]>, meta: &[RowMeta]) -> Result<u64> {
        let first = self.len;
        let bytes = pack_rows(&self.header, mel, waveform, meta)?;
        if meta.is_empty() {
            return Ok(first);
        }
        // Positional writes past the committed rows: a failed append leaves bytes that the next
        // append overwrites, a commit never covers, and a reopen truncates (so after a failure
        // no column is left mid-stream: the next append rewrites these rows in place).
        let mut failed = None;
        for (c, b) in self.cols.iter_mut().zip(&bytes) {
            let at = c.data_offset(first);
            match c.append_at(b, at) {
                Ok(n) => self.direct_bytes += n,
                Err(e) => {
                    failed = Some(anyhow::Error::from(e).context(format!(
                        "appending {} rows to {}",
                        meta.len(),
                        c.path.display()
                    )));
                    break;
                }
            }
        }
        if let Some(e) = failed {
            for c in &mut self.cols {
                let _ = c.end_direct();
            }
            return Err(e);
        }
        self.len = first + meta.len() as u64;
        self.dirty = true;
        Ok(first)
    }

    fn set_valid(&mut self, row: u64, valid: bool) -> Result<()> {
        self.write_cell("valid", row, &[valid as u8])
    }

    fn write_cell(&mut self, name: &str, row: u64, bytes: &[u8]) -> Result<()> {
        Self::write_cell(self, name, row, bytes)
    }

    fn set_labels(&mut self, labels: &[String]) -> Result<()> {
        NpySink::set_labels(self, labels)
    }

    fn commit(&mut self) -> Result<()> {
        if !self.dirty {
            return Ok(());
        }
        if self.staged {
            // Nobody reads a staging output before its close has synced it: the rows count
            // at once.
            self.committed = self.len;
            self.dirty = false;
            return Ok(());
        }
        // Data (appended rows and in-place edits) durable in every column before any header
        // says it is there.
        self.sync_data()?;
        let rows = self.len;
        for c in &mut self.cols {
            c.write_shape(rows, true)?;
        }
        write_attributes(&self.dir, &self.attrs, rows, true)?;
        self.committed = rows;
        self.dirty = false;
        Ok(())
    }

    fn prepare(&mut self) -> Result<()> {
        if self.dirty && !self.staged {
            self.sync_data()?;
            self.prepared = self.len;
        }
        Ok(())
    }

    fn publish(&mut self) -> Result<()> {
        if !self.dirty {
            return Ok(());
        }
        let rows = self.len;
        if !self.staged {
            // In place, not synced: see SplitSink::publish.
            for c in &mut self.cols {
                c.write_shape(rows, false)?;
            }
            write_attributes(&self.dir, &self.attrs, rows, false)?;
        }
        self.committed = rows;
        self.dirty = false;
        Ok(())
    }

    fn close(mut self: Box<Self>) -> Result<()> {
        self.finish()
    }

    fn start_writeback(&mut self) -> Result<()> {
        self.queue_writeback()
    }
}

impl Drop for NpySink {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            log::error!("{}: closing: {e:#}", self.dir.display());
        }
    }
}

pub(crate) fn descr(t: ColumnType) -> String {
    match t {
        ColumnType::F16 => "<f2".into(),
        ColumnType::I16 => "<i2".into(),
        ColumnType::U8 => "|u1".into(),
        ColumnType::I64 => "<i8".into(),
        ColumnType::F32 => "<f4".into(),
        ColumnType::Str(n) => format!("|S{n}"),
    }
}

/// The header dictionary numpy writes for `rows` rows of `spec`.
fn npy_dict(spec: &ColumnSpec, rows: u64) -> String {
    let mut shape = rows.to_string();
    for d in &spec.row_dims {
        shape.push_str(&format!(", {d}"));
    }
    if spec.row_dims.is_empty() {
        shape.push(',');
    }
    format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': ({shape}), }}",
        descr(spec.dtype)
    )
}

/// Header bytes (magic, version 1.0, length, dictionary, space padding, newline) for the
/// largest possible row count, rounded up to a multiple of 64 as numpy aligns its data.
fn header_len_for(spec: &ColumnSpec) -> usize {
    (MAGIC.len() + 4 + npy_dict(spec, u64::MAX).len() + 1).div_ceil(64) * 64
}

fn npy_header(spec: &ColumnSpec, rows: u64, header_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(header_len);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&((header_len - 10) as u16).to_le_bytes());
    out.extend_from_slice(npy_dict(spec, rows).as_bytes());
    out.resize(header_len - 1, b' ');
    out.push(b'\n');
    out
}

/// A reopened split's `attributes.json`, checked for this layout version and the configured
/// feature settings.
struct Attributes {
    /// Less its `committed_rows` (the column headers hold them; added when written).
    attrs: Map<String, Value>,
    labels: Vec<String>,
    /// The `committed_rows` it was written with.
    committed: Option<u64>,
}

fn read_attributes(dir: &Path, header: &OutputHeader) -> Result<Attributes> {
    let attrs_path = dir.join(ATTRIBUTES);
    let text = std::fs::read_to_string(&attrs_path)
        .with_context(|| format!("reading {}", attrs_path.display()))?;
    let mut attrs: Map<String, Value> = serde_json::from_str(&text)
        .map_err(|e| incompatible(&attrs_path, format_args!("not a JSON object ({e})")))?;
    let schema = attrs
        .get("schema_version")
        .map(|v| v.as_u64().ok_or(format!("{v} is not a version number")))
        .unwrap_or(Err("missing".into()));
    super::check_output_version(&attrs_path, schema)?;
    let fingerprint = attrs
        .get("feature_fingerprint")
        .and_then(Value::as_str)
        .ok_or_else(|| incompatible(&attrs_path, "no feature_fingerprint"))?;
    let stored = attrs.get("config_json").and_then(Value::as_str);
    super::check_features(&attrs_path, fingerprint, stored, &header.features)?;
    let labels: Vec<String> = attrs
        .get("labels_json")
        .and_then(Value::as_str)
        .and_then(|s| serde_json::from_str(s).ok())
        .with_context(|| {
            format!(
                "{}: labels_json is missing or not a JSON list",
                attrs_path.display()
            )
        })?;
    let committed = attrs.remove("committed_rows").and_then(|v| v.as_u64());
    Ok(Attributes {
        attrs,
        labels,
        committed,
    })
}

/// How [`NpySink::open`] treats the rows it finds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    /// As they are: a new split, staged (nothing to cut or sync).
    AsIs,
    /// Cut back to the committed rows, durably, after whatever life the split had before.
    Cut,
    /// As they are if they are exactly the rows this process closed the split at; else `Cut`.
    Resume,
}

/// Open every column of a reopened split, its header checked and mapped; returns them, the
/// rows their headers agree on (the smallest shape), and whether every header says that.
/// `cut`: a stale write error of an earlier life is dropped (the columns are cut back).
fn open_columns(
    dir: &Path,
    header: &OutputHeader,
    cut: bool,
) -> Result<(Vec<NpyColumn>, u64, bool)> {
    let mut cols = Vec::new();
    let mut shapes = Vec::new();
    for spec in columns(header) {
        let path = dir.join(format!("{}.npy", spec.name));
        if cut {
            super::take_stale_write_error(&path);
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let (header_len, rows) = read_npy_header(&mut file, &spec, &path)?;
        let header_map = unsafe { MmapOptions::new().len(header_len).map_mut(&file) }
            .with_context(|| format!("mapping the header of {}", path.display()))?;
        shapes.push(rows);
        cols.push(NpyColumn {
            spec,
            path,
            file,
            header_len,
            header_map,
            edit_map: None,
            direct: None,
        });
    }
    let on_disk = shapes.iter().copied().min().unwrap_or(0);
    let uniform = shapes.iter().all(|&rows| rows == on_disk);
    Ok((cols, on_disk, uniform))
}

/// Read a column's npy header (version 1.0, as ailhd writes them): returns (header length,
/// its dictionary less the padding).
fn read_dict(file: &mut File, path: &Path) -> Result<(usize, String)> {
    let mut pre = [0u8; 10];
    file.read_exact(&mut pre)
        .with_context(|| format!("reading {}", path.display()))?;
    if &pre[..6] != MAGIC || pre[6..8] != [1, 0] {
        return Err(incompatible(path, "not an npy version 1.0 file"));
    }
    let header_len = 10 + u16::from_le_bytes([pre[8], pre[9]]) as usize;
    let mut dict = vec![0u8; header_len - 10];
    file.read_exact(&mut dict)
        .with_context(|| format!("reading {}", path.display()))?;
    let dict = String::from_utf8_lossy(&dict).trim_end().to_string();
    Ok((header_len, dict))
}

/// The dtype a header dictionary names (`'descr': '<f2'`).
fn dict_descr(dict: &str) -> Option<&str> {
    let (_, rest) = dict.split_once("'descr': '")?;
    Some(rest.split_once('\'')?.0)
}

/// The shape a header dictionary gives (`'shape': (12, 40, 2, 64, 1)`; `(12,)` for a column of
/// scalars).
fn dict_shape(dict: &str) -> Option<Vec<usize>> {
    let (_, rest) = dict.split_once("'shape': (")?;
    let shape = rest
        .split_once(')')?
        .0
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse().ok())
        .collect::<Option<Vec<usize>>>()?;
    (!shape.is_empty()).then_some(shape)
}

/// The width of a fixed-length string column, as its header dictionary gives it
/// (`'descr': '|S256'`).
fn dict_str_width(dict: &str) -> Option<usize> {
    dict_descr(dict)?.strip_prefix("|S")?.parse().ok()
}

/// The committed rows of the npy column `name` in `dir` (its header's shape) as stored bytes,
/// after checking that the header's dtype is `descr`: the bytes of one row, and all of them in
/// row order. For those that read a column back whole (recovering a lost manifest, tests).
pub fn read_rows(dir: &Path, name: &str, descr: &str) -> Result<(usize, Vec<u8>)> {
    let path = dir.join(format!("{name}.npy"));
    let mut file = File::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let (_, dict) = read_dict(&mut file, &path)?;
    if dict_descr(&dict) != Some(descr) {
        return Err(incompatible(
            &path,
            format_args!("expected dtype {descr}, header {dict:?}"),
        ));
    }
    let shape = dict_shape(&dict)
        .ok_or_else(|| incompatible(&path, format_args!("no row count in header {dict:?}")))?;
    let item: usize = descr
        .trim_start_matches(['<', '>', '|', '='])
        .trim_start_matches(|c: char| c.is_ascii_alphabetic())
        .parse()
        .map_err(|_| incompatible(&path, format_args!("unsupported dtype {descr}")))?;
    let row_bytes = item * shape[1..].iter().product::<usize>();
    let len = shape[0] * row_bytes;
    let mut bytes = Vec::with_capacity(len);
    (&mut file)
        .take(len as u64)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {}", path.display()))?;
    if bytes.len() < len {
        return Err(incompatible(
            &path,
            format_args!("header says {} rows, data holds fewer", shape[0]),
        ));
    }
    Ok((row_bytes, bytes))
}

/// The width of the `source_path` strings of the npy split in `dir` (`outputs.path_bytes` when
/// it was made), from the header of `source_path.npy` alone.
pub fn source_path_width(dir: &Path) -> Result<usize> {
    let path = dir.join("source_path.npy");
    let mut file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let (_, dict) = read_dict(&mut file, &path)?;
    dict_str_width(&dict).ok_or_else(|| {
        incompatible(
            &path,
            format_args!("header {dict:?} does not describe fixed-length strings"),
        )
    })
}

/// Read and check a column's npy header: returns (header length, row count).
fn read_npy_header(file: &mut File, spec: &ColumnSpec, path: &Path) -> Result<(usize, u64)> {
    let (header_len, dict) = read_dict(file, path)?;
    let dict = dict.as_str();
    // Its width is the configuration's (outputs.path_bytes), not the file's damage.
    if let (ColumnType::Str(configured), Some(stored)) = (spec.dtype, dict_str_width(dict)) {
        if spec.name == "source_path" {
            super::check_path_bytes(path, stored, configured)?;
        }
    }
    let rows = dict_shape(dict).map(|shape| shape[0] as u64);
    match rows {
        Some(rows) if dict == npy_dict(spec, rows) && header_len >= header_len_for(spec) => {
            Ok((header_len, rows))
        }
        _ => Err(incompatible(
            path,
            format_args!(
                "header {dict:?} does not describe rows of {} {:?}",
                descr(spec.dtype),
                spec.row_dims
            ),
        )),
    }
}

/// Write `attributes.json` (with `committed_rows`) atomically ([`crate::durable::replace`]):
/// [`Sync::Full`](crate::durable::Sync::Full), its bytes and the folder synced; `sync` false (a
/// staging output, synced by its close): without syncs.
fn write_attributes(
    dir: &Path,
    attrs: &Map<String, Value>,
    committed: u64,
    sync: bool,
) -> Result<()> {
    let mut all = attrs.clone();
    all.insert("committed_rows".into(), Value::from(committed));
    let text = serde_json::to_string_pretty(&Value::Object(all)).expect("JSON serialises");
    let path = dir.join(ATTRIBUTES);
    let durability = if sync {
        crate::durable::Sync::Full
    } else {
        crate::durable::Sync::None
    };
    crate::durable::replace(&path, text.as_bytes(), durability)
        .with_context(|| format!("writing {}", path.display()))
}

fn sync_dir(dir: &Path) -> Result<()> {
    crate::durable::sync_dir(dir).with_context(|| format!("syncing directory {}", dir.display()))
}

fn partial_path(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    dir.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_have_room_for_any_row_count() {
        let header = OutputHeader {
            labels: vec![],
            features: Default::default(),
            path_bytes: 4096,
        };
        for spec in columns(&header) {
            let len = header_len_for(&spec);
            assert_eq!(len % 64, 0);
            let h = npy_header(&spec, u64::MAX, len);
            assert_eq!(h.len(), len);
            assert_eq!(h[len - 1], b'\n');
        }
        let labels = &columns(&header)[1];
        let h = npy_header(labels, 12, 128);
        assert!(String::from_utf8_lossy(&h)
            .contains("{'descr': '<i2', 'fortran_order': False, 'shape': (12,), }"));
    }

    #[test]
    fn a_string_column_says_its_width() {
        let header = OutputHeader {
            labels: vec![],
            features: Default::default(),
            path_bytes: 300,
        };
        let source_path = &columns(&header)[4];
        assert_eq!(source_path.name, "source_path");
        assert_eq!(dict_str_width(&npy_dict(source_path, 7)), Some(300));
        assert_eq!(dict_str_width(&npy_dict(&columns(&header)[1], 7)), None);
    }
}
