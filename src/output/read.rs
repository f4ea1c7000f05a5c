//! Reading the outputs as a user's reader does, for `status --png` and the live part of `demo`:
//! the narrow per-row columns (label, valid, recorded_at, gain_db, recording_id) of committed
//! rows only.
//!
//! HDF5 files are opened read-only in SWMR mode (`H5F_ACC_RDONLY | H5F_ACC_SWMR_READ`, file
//! locking off), exactly what h5py's `File(p, "r", libver="latest", swmr=True)` does, so this
//! works while `ailhd run` is appending and never stops it from starting or appending
//! (README, "What comes out"). [`SwmrSplit::refresh`] re-reads `committed_rows` after
//! `H5Drefresh`, as `dset.refresh()` does in h5py. When HDF5 output is turned off, the npy
//! columns (whose header shape is the committed row count) are read instead.

use crate::config::{Settings, SPLITS};
pub(crate) use crate::output::hdf5::Id;
use crate::output::hdf5::{read_text_attr, select_rows};
use anyhow::{bail, Context, Result};
use hdf5::file::FileAccess;
use hdf5::types::TypeDescriptor;
use hdf5::{Dataset, File};
use hdf5_sys::h5d::{H5Dget_type, H5Dread, H5Drefresh};
use hdf5_sys::h5f::{H5Fopen, H5F_ACC_RDONLY, H5F_ACC_SWMR_READ};
use hdf5_sys::h5p::H5P_DEFAULT;
use hdf5_sys::h5t::H5Tclose;
use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};

/// The committed rows of one split.
#[derive(Debug, Clone, Default)]
pub struct SplitColumns {
    pub split: &'static str,
    pub labels: Vec<i16>,
    pub valid: Vec<u8>,
    pub recorded_at: Vec<i64>,
    pub gain_db: Vec<f32>,
}

impl SplitColumns {
    pub fn rows(&self) -> usize {
        self.labels.len()
    }
}

/// Every split's committed rows, with the label names of the outputs.
#[derive(Debug, Clone, Default)]
pub struct Columns {
    pub label_names: Vec<String>,
    pub splits: Vec<SplitColumns>,
    /// Where the columns were read from, said in the picture.
    pub source: String,
}

/// Read the committed rows of every split (HDF5 in SWMR mode, else npy). A split whose file
/// does not exist yet has no rows.
pub fn read(settings: &Settings) -> Result<Columns> {
    let out = &settings.paths.output;
    let mut cols = Columns::default();
    if settings.outputs.hdf5 {
        cols.source = format!("HDF5 files under {} (read in SWMR mode)", out.display());
        for (i, split) in SPLITS.iter().enumerate() {
            let path = crate::output::hdf5_path(out, &settings.outputs.hdf5_names, i);
            if !path.exists() {
                cols.splits.push(SplitColumns {
                    split,
                    ..Default::default()
                });
                continue;
            }
            let mut s = SwmrSplit::open(&path)?;
            if cols.label_names.is_empty() {
                cols.label_names = s.label_names()?;
            }
            let n = s.refresh()?;
            cols.splits.push(s.read_rows(split, 0..n)?);
        }
    } else if settings.outputs.npy {
        cols.source = format!("npy columns under {}", out.join("npy").display());
        for (i, split) in SPLITS.iter().enumerate() {
            let dir = crate::output::npy_dir(out, i);
            if !dir.join("attributes.json").exists() {
                cols.splits.push(SplitColumns {
                    split,
                    ..Default::default()
                });
                continue;
            }
            if cols.label_names.is_empty() {
                cols.label_names = npy_label_names(&dir)?;
            }
            cols.splits.push(SplitColumns {
                split,
                labels: npy_column(&dir, "labels", "<i2", i16::from_le_bytes)?,
                valid: npy_column(&dir, "valid", "|u1", u8::from_le_bytes)?,
                recorded_at: npy_column(&dir, "recorded_at", "<i8", i64::from_le_bytes)?,
                gain_db: npy_column(&dir, "gain_db", "<f4", f32::from_le_bytes)?,
            });
        }
    } else {
        bail!("outputs.hdf5 and outputs.npy are both off: there are no outputs to read");
    }
    if cols.label_names.is_empty() {
        cols.label_names = settings.labels.names.clone();
    }
    Ok(cols)
}

/// What one output file records about how it was made (its attributes).
#[derive(Debug, Clone)]
pub struct MadeWith {
    /// The HDF5 file, or the npy split's `attributes.json`.
    pub path: PathBuf,
    pub fingerprint: String,
    /// The feature settings as JSON (`config_json`), when readable.
    pub config_json: Option<String>,
    /// `labels_json`: the label names, position = id.
    pub labels: Vec<String>,
    /// The width of its `source_path` strings (`outputs.path_bytes` when it was made): the
    /// dataset's type, or the npy column's header.
    pub path_bytes: usize,
}

/// What each existing output file of the enabled kinds under `paths.output` was made with (HDF5
/// in SWMR mode, so also while `ailhd run` appends; npy from `attributes.json` and the header
/// of `source_path.npy`). A file that cannot be read is an error (a condition that may pass, or
/// a damaged file; not the configuration's fault).
pub fn made_with(settings: &Settings) -> Result<Vec<MadeWith>> {
    let out = &settings.paths.output;
    let mut found = Vec::new();
    for split in 0..SPLITS.len() {
        let path = crate::output::hdf5_path(out, &settings.outputs.hdf5_names, split);
        if settings.outputs.hdf5 && path.exists() {
            let s = SwmrSplit::open(&path)?;
            let attr = |name| {
                read_text_attr(&s.file, name)
                    .with_context(|| format!("{}: reading {name}", path.display()))
            };
            found.push(MadeWith {
                fingerprint: attr("feature_fingerprint")?,
                config_json: attr("config_json").ok(),
                labels: s.label_names()?,
                path_bytes: s.path_bytes()?,
                path,
            });
        }
        let dir = crate::output::npy_dir(out, split);
        if settings.outputs.npy && dir.join("attributes.json").exists() {
            let (path, attrs) = npy_attributes(&dir)?;
            let text = |name: &str| attrs[name].as_str().map(str::to_string);
            found.push(MadeWith {
                fingerprint: text("feature_fingerprint")
                    .with_context(|| format!("{}: no feature_fingerprint", path.display()))?,
                config_json: text("config_json"),
                labels: npy_labels(&path, &attrs)?,
                path_bytes: crate::output::npy::source_path_width(&dir)?,
                path,
            });
        }
    }
    Ok(found)
}

/// One split's HDF5 file, open read-only in SWMR mode.
pub struct SwmrSplit {
    path: PathBuf,
    committed: Dataset,
    /// Declared after the datasets so it is closed last.
    file: File,
}

impl SwmrSplit {
    pub fn open(path: &Path) -> Result<SwmrSplit> {
        let fapl = FileAccess::build().file_locking(false).finish()?;
        let name = CString::new(path.as_os_str().as_encoded_bytes())
            .with_context(|| format!("{}: path contains a NUL byte", path.display()))?;
        let file = hdf5::sync::sync(|| unsafe {
            let id = hdf5::h5check(H5Fopen(
                name.as_ptr(),
                H5F_ACC_RDONLY | H5F_ACC_SWMR_READ,
                fapl.id(),
            ))?;
            hdf5::from_id::<File>(id)
        })
        .with_context(|| format!("{}: opening the HDF5 file in SWMR mode", path.display()))?;
        let committed = file
            .dataset("committed_rows")
            .with_context(|| format!("{}: no committed_rows dataset", path.display()))?;
        Ok(SwmrSplit {
            path: path.to_path_buf(),
            committed,
            file,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The label names (`labels_json`, a fixed- or variable-length string attribute).
    pub fn label_names(&self) -> Result<Vec<String>> {
        let text = read_text_attr(&self.file, "labels_json")
            .with_context(|| format!("{}: reading labels_json", self.path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{}: labels_json is not a JSON list", self.path.display()))
    }

    /// Refresh `committed_rows` (as h5py's `dset.refresh()`) and return it.
    pub fn refresh(&mut self) -> Result<u64> {
        refresh(&self.committed)?;
        let v = self
            .committed
            .read_raw::<i64>()
            .with_context(|| format!("{}: reading committed_rows", self.path.display()))?;
        Ok(v.first().copied().unwrap_or(0).max(0) as u64)
    }

    /// Rows dataset `name` holds now, committed or not: a writer extends its datasets (and
    /// syncs their rows) before it moves `committed_rows` over them.
    pub fn extent(&self, name: &str) -> Result<u64> {
        Ok(self.dataset(name)?.shape().first().copied().unwrap_or(0) as u64)
    }

    fn dataset(&self, name: &str) -> Result<Dataset> {
        let ds = self
            .file
            .dataset(name)
            .with_context(|| format!("{}: no {name} dataset", self.path.display()))?;
        refresh(&ds)?;
        Ok(ds)
    }

    /// Rows `range` (below the last [`refresh`](Self::refresh)ed `committed_rows`) of the
    /// narrow columns.
    pub fn read_rows(
        &self,
        split: &'static str,
        range: std::ops::Range<u64>,
    ) -> Result<SplitColumns> {
        let r = range.start as usize..range.end as usize;
        let ctx = |c: &str| format!("{}: reading {c} rows {r:?}", self.path.display());
        Ok(SplitColumns {
            split,
            labels: self
                .dataset("labels")?
                .read_slice_1d::<i16, _>(r.clone())
                .with_context(|| ctx("labels"))?
                .to_vec(),
            valid: self
                .dataset("valid")?
                .read_slice_1d::<u8, _>(r.clone())
                .with_context(|| ctx("valid"))?
                .to_vec(),
            recorded_at: self
                .dataset("recorded_at")?
                .read_slice_1d::<i64, _>(r.clone())
                .with_context(|| ctx("recorded_at"))?
                .to_vec(),
            gain_db: self
                .dataset("gain_db")?
                .read_slice_1d::<f32, _>(r.clone())
                .with_context(|| ctx("gain_db"))?
                .to_vec(),
        })
    }

    /// The width of the `source_path` strings (`outputs.path_bytes` when the file was made),
    /// from the dataset's type alone.
    pub fn path_bytes(&self) -> Result<usize> {
        let ds = self
            .file
            .dataset("source_path")
            .with_context(|| format!("{}: no source_path dataset", self.path.display()))?;
        self.string_width(&ds, "source_path")
    }

    fn string_width(&self, ds: &Dataset, name: &str) -> Result<usize> {
        match ds.dtype()?.to_descriptor()? {
            TypeDescriptor::FixedUnicode(n) | TypeDescriptor::FixedAscii(n) => Ok(n),
            other => bail!(
                "{}: {name} is {other:?}, not a fixed-length string",
                self.path.display()
            ),
        }
    }

    /// Rows `range` of a fixed-length string column (`recording_id`, `source_path`...).
    pub fn read_strings(&self, name: &str, range: std::ops::Range<u64>) -> Result<Vec<String>> {
        let ds = self.dataset(name)?;
        let width = self.string_width(&ds, name)?;
        let bytes = read_rows(&ds, range.start, range.end.saturating_sub(range.start))
            .with_context(|| format!("{}: reading {name} rows {range:?}", self.path.display()))?;
        Ok(bytes.chunks(width.max(1)).map(nul_trimmed).collect())
    }

    /// Rows `range` of any column of fixed-size elements, as the stored bytes (little-endian
    /// numbers, NUL-padded strings): the bytes of one row, and all of them in row order.
    pub fn read_bytes(&self, name: &str, range: std::ops::Range<u64>) -> Result<(usize, Vec<u8>)> {
        let ds = self.dataset(name)?;
        let row_bytes = ds.dtype()?.size() * ds.shape()[1..].iter().product::<usize>();
        let bytes = read_rows(&ds, range.start, range.end.saturating_sub(range.start))
            .with_context(|| format!("{}: reading {name} rows {range:?}", self.path.display()))?;
        Ok((row_bytes, bytes))
    }
}

/// Rows `first..first + rows` of `ds` as the bytes of its own element type (no conversion).
pub fn read_rows(ds: &Dataset, first: u64, rows: u64) -> Result<Vec<u8>> {
    let Some(sel) = select_rows(ds, first, rows)? else {
        return Ok(Vec::new());
    };
    hdf5::sync::sync(|| unsafe {
        let dtype = Id(hdf5::h5check(H5Dget_type(ds.id()))?, H5Tclose);
        let size = hdf5_sys::h5t::H5Tget_size(dtype.0);
        let mut buf = vec![0u8; size * sel.elements as usize];
        hdf5::h5check(H5Dread(
            ds.id(),
            dtype.0,
            sel.mem.0,
            sel.file.0,
            H5P_DEFAULT,
            buf.as_mut_ptr() as *mut c_void,
        ))?;
        Ok(buf)
    })
}

fn refresh(ds: &Dataset) -> Result<()> {
    hdf5::sync::sync(|| unsafe { hdf5::h5check(H5Drefresh(ds.id())) })?;
    Ok(())
}

fn nul_trimmed(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

pub fn npy_label_names(dir: &Path) -> Result<Vec<String>> {
    let (path, attrs) = npy_attributes(dir)?;
    npy_labels(&path, &attrs)
}

/// An npy split's `attributes.json` (its path, and its entries).
fn npy_attributes(dir: &Path) -> Result<(PathBuf, serde_json::Value)> {
    let path = dir.join("attributes.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let attrs =
        serde_json::from_str(&text).with_context(|| format!("cannot parse {}", path.display()))?;
    Ok((path, attrs))
}

/// The label names (`labels_json`) of an npy split's attributes, read from `path`.
fn npy_labels(path: &Path, attrs: &serde_json::Value) -> Result<Vec<String>> {
    let labels = attrs["labels_json"]
        .as_str()
        .with_context(|| format!("{}: no labels_json", path.display()))?;
    serde_json::from_str(labels)
        .with_context(|| format!("{}: labels_json is not a JSON list", path.display()))
}

/// A one-dimensional npy column: check the header's dtype, read its committed rows (the
/// header shape).
fn npy_column<T, const N: usize>(
    dir: &Path,
    name: &str,
    descr: &str,
    from: fn([u8; N]) -> T,
) -> Result<Vec<T>> {
    let (row_bytes, bytes) = super::npy::read_rows(dir, name, descr)?;
    if row_bytes != N {
        bail!(
            "{}: rows of {row_bytes} bytes, expected {N}",
            dir.join(format!("{name}.npy")).display()
        );
    }
    Ok(bytes
        .chunks_exact(N)
        .map(|c| from(c.try_into().expect("chunks of N bytes")))
        .collect())
}
