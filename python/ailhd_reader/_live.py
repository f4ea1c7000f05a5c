"""LiveDataset: ailhd's per-split outputs as a map-style dataset (ailhd README, "Reading from
Python"; the file layout is in its "Outputs" section).

How it reads, and why:

- A snapshot (which rows are visible, their label ids, where their features lie) is taken by
  `refresh()` and only then. It is plain data, pickled into DataLoader workers, so every worker
  serves the same rows as the main process until the next `refresh()`.
- `committed_rows` (HDF5) or `attributes.json` and the npy headers (npy) are read first, then the
  other columns: rows below the committed count are complete; rows past it are never served.
  Rows with `valid = 0` (superseded, deleted) are left out.
- Files are opened lazily in each process (the pid is checked), never inherited through fork.
- Features are read straight from the file's pages through a memory map: for npy at
  `header + row * row_bytes`; for HDF5 at the row's chunk address (asked from HDF5 for each
  chunk, once) plus its place in the chunk. A batch is then one numpy gather. This is used only
  when the dataset's chunks are stored raw (no filter, little-endian float16, whole rows per
  chunk), and each refresh checks a few rows against h5py's own reads; otherwise rows are read
  through h5py (sorted, runs of consecutive rows in one call, chunk cache off for unfiltered
  chunks so that a row costs a row and not a chunk).
- A batch is gathered with `np.take` into an output array that is reused once nothing refers to
  it any more (`_Outputs`): a fresh 57 MB array costs the kernel's zeroing of its pages, as much
  as the gather itself. HDF5 rows are gathered the same way when every row's offset is a multiple
  of a block of >= 256 bytes: ailhd aligns its `segments_mel` chunks to the row size (HDF5's
  file-space alignment, in `rebuild` and in the service alike), so its rows are whole blocks.
  Files from other writers (or from ailhd before it aligned them) are read by fancy indexing a
  byte view into a new array (0.5-0.7x as fast, benches/reader.py). Each refresh checks rows
  read both ways against h5py's reads.

Rows never move or disappear. A service killed after committing a batch to the outputs and
before recording it in its manifest adopts those rows when it starts again (ailhd README,
"Outputs"). Known limit: with both HDF5 and npy outputs enabled, the two commit a batch side by
side, and a kill in the moment between their two commits leaves rows committed in one and not
the other; the next start takes those rows back. A process still reading a snapshot that
covers them reads freed bytes until the next `refresh()`; for npy the file was cut short there,
and touching those pages raises SIGBUS.
"""

import collections.abc
import io
import json
import mmap
import os
import sys
import threading
import time
import warnings

import numpy as np

SPLITS = ("training", "validation", "testing")
SOURCES = ("npy", "hdf5")
#: The HDF5 file names ailhd writes by default (`outputs.hdf5_names`).
HDF5_NAMES = {
    "training": "TRAINING_DATASET.H5",
    "validation": "VALIDATION_DATASET.H5",
    "testing": "TESTING_DATASET.H5",
}
META_COLUMNS = ("source_path", "sensor_id", "recording_id", "recorded_at", "gain_db", "blake3")
_STRING_COLUMNS = ("source_path", "sensor_id", "recording_id")


class OutputsReplaced(RuntimeError):
    """The files changed identity (a `rebuild` replaced them) after the last `refresh()`."""


class Batch(collections.abc.Sequence):
    """What `__getitems__` returns: a sequence of `(features, label)` pairs, as PyTorch's
    default collate expects, backed by one array of features `[B, ...]` and one of labels `[B]`
    (`collate` turns these into two tensors without touching each row)."""

    __slots__ = ("features", "labels")

    def __init__(self, features, labels):
        self.features = features
        self.labels = labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        return self.features[k], int(self.labels[k])


def collate(batch):
    """`collate_fn` for a PyTorch DataLoader over a LiveDataset: a `Batch` becomes
    `(features: float16 tensor [B, ...], labels: int64 tensor [B])` without a per-row copy;
    anything else goes to PyTorch's default collate."""
    import torch

    if isinstance(batch, Batch):
        return torch.from_numpy(batch.features), torch.from_numpy(batch.labels)
    return torch.utils.data.default_collate(batch)


class LiveDataset:
    """Valid committed rows of one split of ailhd's outputs, as a map-style dataset.

    `output_dir`: ailhd's `paths.output`. `split`: "training", "validation" or "testing".
    `source`: "npy" (the `npy/<split>/` columns) or "hdf5" (the split's HDF5 file, named
    `hdf5_name` when `outputs.hdf5_names` is not the default). `direct=False` reads HDF5 rows
    through h5py only (slower; for comparison).

    `len(ds)`, `ds[i] -> (features float16 [num_long, num_short, n_mels, t_frames], label id)`,
    `ds.labels` (names by id), `ds.meta(i)`, `ds.refresh()`; `ds.rows` (row numbers in the
    files) and `ds.targets` (label ids) of the visible rows.
    """

    def __init__(self, output_dir, split="training", source="npy", *, hdf5_name=None, direct=True):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, not {source!r}")
        self.output_dir = os.fspath(output_dir)
        self.split = split
        self.source = source
        if source == "hdf5":
            self.path = os.path.join(self.output_dir, hdf5_name or HDF5_NAMES[split])
        else:
            self.path = os.path.join(self.output_dir, "npy", split)
        self._direct_allowed = bool(direct)
        # The snapshot: plain data, pickled into worker processes.
        self._rows = np.empty(0, np.int64)
        self._targets = np.empty(0, np.int64)
        self._offsets = None  # HDF5 direct reads: file offset of each visible row
        self._block = 0  # ... and the block size they are all multiples of (offsets_block)
        self._labels = []
        self._row_shape = None
        self._committed = 0
        self._identity = None
        self._chunk_addr = np.empty(0, np.int64)  # HDF5: known chunk addresses (cache)
        self._chunk_rows = None
        # Per-process files.
        self._files = None
        self._pid = None
        self.refresh()

    # ----- the map-style dataset -----

    def __len__(self):
        return len(self._rows)

    def __getitem__(self, i):
        i = self._index(i)
        feats = self._read(np.array([i], np.int64))[0]
        return feats, int(self._targets[i])

    def __getitems__(self, indices):
        """A whole batch in one read (PyTorch's DataLoader calls this when it exists)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self._rows)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"index out of range for {n} rows")
        idx = np.where(idx < 0, idx + n, idx)
        return Batch(self._read(idx), self._targets[idx])

    @property
    def labels(self):
        """Label names by id (`labels_json`)."""
        return list(self._labels)

    @property
    def rows(self):
        """Row numbers (in the files) of the visible rows, ascending; `ds[i]` is row `rows[i]`."""
        v = self._rows.view()
        v.flags.writeable = False
        return v

    @property
    def targets(self):
        """Label id of each visible row (as of the last `refresh()`)."""
        v = self._targets.view()
        v.flags.writeable = False
        return v

    @property
    def committed_rows(self):
        """The committed row count seen by the last `refresh()`."""
        return self._committed

    @property
    def direct(self):
        """True when features are read straight from the file's pages (always for npy)."""
        return self.source == "npy" or self._offsets is not None

    def meta(self, i):
        """What is known about row `ds[i]`: a dict with `row` (its number in the files), `label`
        (id), `label_name`, `source_path`, `sensor_id`, `recording_id` ("" when the file name
        does not follow the convention), `recorded_at` (Unix seconds UTC, -1 when absent),
        `gain_db` (NaN when absent) and `blake3` (hex). Read now, so a row moved to another path
        or label since the last refresh shows its new path."""
        i = self._index(i)
        row = int(self._rows[i])
        raw = self._open().meta(row)
        out = {"row": row, "label": int(self._targets[i])}
        out["label_name"] = self._labels[out["label"]] if 0 <= out["label"] < len(self._labels) else None
        for c in _STRING_COLUMNS:
            out[c] = _text(raw[c])
        out["recorded_at"] = int(raw["recorded_at"])
        out["gain_db"] = float(raw["gain_db"])
        out["blake3"] = bytes(np.asarray(raw["blake3"], np.uint8)).hex()
        return out

    def refresh(self):
        """Look at the files again: rows committed since the last call appear, rows superseded or
        deleted since drop out. Returns how many rows became visible. Call it in the main
        process (between epochs); workers pick the new snapshot up when the DataLoader next
        starts them (not with `persistent_workers=True`). If a `rebuild` replaced the files, it
        starts over and returns the number of rows now visible."""
        if self._files is not None and self._pid == os.getpid():
            self._files.close()
        self._files = None
        files = (_Hdf5Files if self.source == "hdf5" else _NpyFiles)(self.path)
        try:
            snap = files.snapshot()
        except BaseException:
            files.close()
            raise
        old = self._rows
        if snap["identity"] != self._identity:
            old = np.empty(0, np.int64)
            self._chunk_addr = np.empty(0, np.int64)
        elif snap["committed"] < self._committed:
            # Rows taken back (a writer recovering from a crash reclaims rows its own records
            # do not cover): chunks past them may have been freed and written elsewhere since.
            self._chunk_addr = np.empty(0, np.int64)
        rows = np.flatnonzero(snap["valid"]).astype(np.int64)
        self._identity = snap["identity"]
        self._committed = snap["committed"]
        self._labels = snap["labels"]
        self._row_shape = snap["row_shape"]
        self._targets = snap["label_ids"][rows].astype(np.int64)
        self._rows = rows
        self._offsets = None
        self._block = 0
        if self.source == "hdf5" and self._direct_allowed:
            self._offsets = self._hdf5_offsets(files, rows)
            if self._offsets is not None:
                self._block = offsets_block(self._offsets, files.row_bytes())
        self._files = files
        self._pid = os.getpid()
        return int(np.setdiff1d(rows, old, assume_unique=True).size)

    # ----- internals -----

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_files"] = None
        state["_pid"] = None
        return state

    def __repr__(self):
        return (f"LiveDataset({self.output_dir!r}, split={self.split!r}, source={self.source!r}: "
                f"{len(self)} rows of {self._row_shape}, committed {self._committed}, "
                f"{'direct' if self.direct else 'h5py'} reads)")

    def _index(self, i):
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"LiveDataset indices are integers, not {type(i).__name__}")
        n = len(self._rows)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} rows")
        return int(i) + n if i < 0 else int(i)

    def _open(self):
        """This process's files, opened on first use (a DataLoader worker opens its own)."""
        if self._files is None or self._pid != os.getpid():
            self._files = None
            files = (_Hdf5Files if self.source == "hdf5" else _NpyFiles)(self.path)
            if files.identity() != self._identity:
                files.close()
                raise OutputsReplaced(
                    f"{self.path}: replaced (by `ailhd rebuild`?) since this dataset's last "
                    "refresh(); call refresh() in the main process")
            self._files = files
            self._pid = os.getpid()
        return self._files

    def _read(self, idx):
        files = self._open()
        if idx.size == 0:
            return np.empty((0,) + self._row_shape, np.float16)
        if self.source == "npy":
            return files.gather_rows(self._rows[idx], self._committed)
        if self._offsets is not None:
            return files.gather_offsets(self._offsets[idx], self._row_shape, self._block)
        return files.read_rows(self._rows[idx])

    def _hdf5_offsets(self, files, rows):
        """File offset of each visible row's features, or None when they cannot be read raw."""
        why = files.raw_layout_problem()
        if why is None:
            cr = files.chunk_rows()
            need = -(-self._committed // cr)
            if self._chunk_rows != cr:
                self._chunk_addr = np.empty(0, np.int64)
                self._chunk_rows = cr
            # Chunks are allocated once and never move (raw data, no filter): keep the
            # addresses already known, ask only for the chunks that are new (the last known one
            # again, in case it was not allocated yet).
            known = self._chunk_addr[: max(0, len(self._chunk_addr) - 1)]
            addr, why = files.chunk_addresses(len(known), need)
            if why is None:
                self._chunk_addr = np.concatenate([known, addr])
        if why is None:
            rb = files.row_bytes()
            offs = self._chunk_addr[rows // cr] + (rows % cr) * rb
            why = files.check_offsets(rows, offs, self._row_shape)
            if why is None:
                return offs
        self._chunk_addr = np.empty(0, np.int64)
        warnings.warn(f"{self.path}: reading segments_mel through h5py ({why})", stacklevel=3)
        return None


def _text(v):
    if isinstance(v, np.ndarray):
        v = v.tobytes()
    if isinstance(v, (bytes, np.bytes_)):
        return bytes(v).rstrip(b"\0").decode("utf-8")
    return str(v).rstrip("\0")


def _json_text(v):
    if isinstance(v, (bytes, np.bytes_)):
        v = bytes(v).rstrip(b"\0").decode("utf-8")
    return json.loads(str(v).rstrip("\0"))


def _map_file(path):
    """A read-only map of the whole file as it is now (None when empty) and its identity."""
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        if st.st_size == 0:
            return None, (st.st_dev, st.st_ino)
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), (st.st_dev, st.st_ino)


def _byte_rows(m, row_bytes):
    """Every byte offset of the map as the start of a row: `view[offsets]` gathers rows at
    arbitrary offsets in one call (read-only, overlapping rows)."""
    buf = np.frombuffer(m, np.uint8)
    return np.lib.stride_tricks.as_strided(
        buf, shape=(max(0, len(buf) - row_bytes + 1), row_bytes), strides=(1, 1), writeable=False)


def _refs(items, k):
    return sys.getrefcount(items[k])


#: What `_refs` says of an array held by a list and by nothing else (measured, not assumed: it
#: differs between Python versions).
_FREE_REFS = _refs([np.empty(1)], 0)
#: Free-threaded Python: a count taken while another thread makes a view could be stale.
_CAN_REUSE = getattr(sys, "_is_gil_enabled", lambda: True)()


def _take(src, idx, out):
    """`out[k] = src[idx[k]]` along the first axis, for indices the caller has checked (mode
    "clip": with "raise", numpy gathers into a temporary and copies it, 2x slower). Splitting
    the gather over two threads did not help on the 2-vCPU machine the benchmark ran on: it is
    bound by memory bandwidth."""
    np.take(src, idx, axis=0, mode="clip", out=out)


class _Outputs:
    """Output arrays for batches, reused once nothing refers to them any more.

    A batch's features are a view of one of a few buffers kept here. Every view, and every
    object that borrows the memory (a torch tensor from `torch.from_numpy`, a memoryview), holds
    a reference to the buffer, so a buffer whose reference count is back to the pool's own
    reference is no longer seen by anyone and can be written again. A buffer still in use is
    never written: a new one is made (and the pool forgets the oldest, which lives on with its
    users). Reusing matters because a fresh array of a batch's size (57 MB) costs the kernel
    zeroing and mapping its pages, about as long as gathering the rows (benches/reader.py)."""

    KEEP = 2
    MIN_BYTES = 64 << 10  # smaller outputs (a single row) are plain new arrays

    def __init__(self):
        self._bufs = []
        self._lock = threading.Lock()

    def array(self, shape, dtype=np.float16):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < self.MIN_BYTES or not _CAN_REUSE:
            return np.empty(shape, dtype)
        with self._lock:  # two threads must not both take the same free buffer
            bufs = self._bufs
            for k in range(len(bufs)):
                if bufs[k].nbytes >= nbytes and _refs(bufs, k) <= _FREE_REFS:
                    buf = bufs[k]
                    break
            else:
                buf = np.empty(nbytes, np.uint8)
                if len(bufs) >= self.KEEP:
                    del bufs[0]
                bufs.append(buf)
            return buf[:nbytes].view(dtype).reshape(shape)


class _Hdf5Files:
    """One process's view of a split's HDF5 file: an h5py SWMR handle and a map of the file."""

    def __init__(self, path):
        import h5py

        self.path = path
        self._h5py = h5py
        self.f = _open_h5(h5py, path)
        self.map = None
        self.view = None
        self.blocks = None
        self.outputs = _Outputs()
        self._ident = None

    def identity(self):
        if self._ident is None:
            st = os.stat(self.path)
            self._ident = (st.st_dev, st.st_ino)
        return self._ident

    def close(self):
        self.view = None
        self.blocks = None
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # an array returned earlier still uses it; the GC closes it
                pass
            self.map = None
        if self.f is not None:
            try:
                self.f.close()
            except Exception:
                pass
            self.f = None

    def snapshot(self):
        f = self.f
        for name in ("committed_rows", "segments_mel", "labels", "valid"):
            if name not in f:
                raise ValueError(f"{self.path}: no dataset {name!r}; not an ailhd output")
        c = f["committed_rows"]
        _refresh(c)
        committed = int(c[0])
        lengths = []
        for name in ("segments_mel", "labels", "valid"):
            _refresh(f[name])
            lengths.append(f[name].shape[0])
        if min(lengths) < committed:
            raise ValueError(f"{self.path}: committed_rows says {committed} but the datasets hold "
                             f"{min(lengths)} rows")
        mel = f["segments_mel"]
        if mel.dtype != np.float16:
            raise ValueError(f"{self.path}: segments_mel is {mel.dtype}, expected float16")
        return {
            "identity": self.identity(),
            "committed": committed,
            "valid": f["valid"][:committed] != 0,
            "label_ids": f["labels"][:committed],
            "labels": _json_text(f.attrs["labels_json"]),
            "row_shape": tuple(mel.shape[1:]),
        }

    # Direct reads.

    def row_bytes(self):
        mel = self.f["segments_mel"]
        return int(np.prod(mel.shape[1:])) * mel.dtype.itemsize

    def chunk_rows(self):
        return self.f["segments_mel"].chunks[0]

    def raw_layout_problem(self):
        f, mel = self.f, self.f["segments_mel"]
        if mel.chunks is None or tuple(mel.chunks[1:]) != tuple(mel.shape[1:]):
            return f"chunks {mel.chunks} do not hold whole rows"
        if mel.dtype.str != "<f2":
            return f"dtype {mel.dtype.str}"
        if mel.id.get_create_plist().get_nfilters() != 0:
            return "its chunks are filtered (compressed)"
        if f.userblock_size != 0:
            return "the file has a user block"
        if not hasattr(mel.id, "get_chunk_info_by_coord"):
            return "this h5py cannot tell chunk addresses"
        return None

    def chunk_addresses(self, first, end):
        """Addresses of chunks first..end of segments_mel: (int64 array, None) or (None, why)."""
        mel = self.f["segments_mel"]
        cr = mel.chunks[0]
        nbytes = cr * self.row_bytes()
        tail = (0,) * (len(mel.shape) - 1)
        out = np.empty(max(0, end - first), np.int64)
        if out.size == 0:
            return out, None
        bad = []
        if hasattr(mel.id, "chunk_iter") and end - first > 64:
            seen = np.zeros(out.size, bool)

            def visit(info):
                k = info.chunk_offset[0] // cr - first
                if 0 <= k < out.size:
                    if info.byte_offset is None or info.filter_mask != 0 or info.size != nbytes:
                        bad.append(info)
                    else:
                        out[k] = info.byte_offset
                        seen[k] = True

            mel.id.chunk_iter(visit)
            if not seen.all():
                return None, f"{int((~seen).sum())} chunks below committed_rows not allocated"
        else:
            for k in range(out.size):
                info = mel.id.get_chunk_info_by_coord(((first + k) * cr,) + tail)
                if info.byte_offset is None or info.filter_mask != 0 or info.size != nbytes:
                    bad.append(info)
                    break
                out[k] = info.byte_offset
        if bad:
            return None, f"chunk {bad[0]} is not stored raw"
        return out, None

    def check_offsets(self, rows, offs, row_shape):
        """Map the file and compare a few rows read raw with h5py's reads of them."""
        if rows.size == 0:
            return None
        rb = self.row_bytes()
        self.map, ident = _map_file(self.path)
        if ident != self.identity():
            return "the file was replaced while being opened"
        if self.map is None or int(offs.max()) + rb > len(self.map):
            return "a chunk lies past the end of the file"
        self.view = _byte_rows(self.map, rb)
        probe = np.unique(np.array([0, rows.size // 2, rows.size - 1]))
        ref = self.f["segments_mel"][np.sort(rows[probe])]
        for block in {0, offsets_block(offs, rb)}:
            raw = self.gather_offsets(offs[probe], row_shape, block)
            if not np.array_equal(raw.view(np.uint16), ref.view(np.uint16)):
                self.view = None
                return "raw chunk bytes differ from h5py's reads"
        return None

    def gather_offsets(self, offs, row_shape, block=0):
        """Rows at these file offsets. `block` (from `offsets_block`, 0 for none): every offset
        and the row size are multiples of it, so the file is an array of blocks and rows are
        runs of whole blocks, gathered by `np.take` into a reused output; otherwise by fancy
        indexing a byte view of the file (a new array)."""
        rb = self.row_bytes()
        if self.view is None:  # a worker: map the file now
            self.map, ident = _map_file(self.path)
            if self.map is None:
                raise OutputsReplaced(f"{self.path}: empty; call refresh()")
            self.view = _byte_rows(self.map, rb)
        if int(offs.max()) + rb > len(self.map):
            raise OutputsReplaced(f"{self.path}: shorter than this dataset's snapshot; "
                                  "call refresh()")
        shape = (len(offs),) + tuple(row_shape)
        if not block:
            return self.view[offs].view("<f2").reshape(shape)
        if self.blocks is None or self.blocks.shape[1] != block:
            buf = np.frombuffer(self.map, np.uint8)
            self.blocks = buf[: len(buf) // block * block].reshape(-1, block)
        per_row = rb // block
        idx = (offs // block)[:, None] + np.arange(per_row)
        out = self.outputs.array(shape)
        _take(self.blocks, idx.reshape(-1),
              out.reshape(len(offs), -1).view(np.uint8).reshape(-1, block))
        return out

    # Reads through h5py.

    def read_rows(self, rows):
        """Rows in any order: sorted, runs of consecutive rows in one read each."""
        mel = self.f["segments_mel"]
        _refresh(mel)
        order = np.argsort(rows, kind="stable")
        srt = rows[order]
        out = np.empty((len(rows),) + mel.shape[1:], np.float16)
        breaks = np.flatnonzero(np.diff(srt) != 1) + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [len(srt)]])
        for a, b in zip(starts.tolist(), ends.tolist()):
            r = int(srt[a])
            # (`read_direct` into a slice of `out` was 4x slower: HDF5 builds a selection of
            # the whole destination each time.)
            out[order[a:b]] = mel[r:r + (b - a)]
        return out

    def meta(self, row):
        out = {}
        for c in META_COLUMNS:
            d = self.f[c]
            _refresh(d)
            out[c] = d[row]
        return out


def offsets_block(offs, row_bytes, smallest=256):
    """The largest block size that divides the row size and every row offset, or 0 when that is
    below `smallest` bytes (rows would be too many small copies: fancy indexing is faster)."""
    if len(offs) == 0:
        return 0
    g = int(np.gcd.reduce(np.append(offs, row_bytes).astype(np.int64)))
    return g if g >= smallest else 0


def _refresh(dset):
    if dset.file.swmr_mode:
        dset.refresh()


def _open_h5(h5py, path):
    """SWMR read open (works whether or not a writer is appending), without HDF5's file lock.
    Retried for a moment: the service may be between creating a file and starting SWMR."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file (is outputs.hdf5 on, and is this ailhd's "
                                "paths.output? hdf5_name= names a file of outputs.hdf5_names)")
    # HDF5 keeps one open file per process: when this process already holds the file with other
    # settings (plain, or with file locking), open it the way it is already open. A plain open
    # sees what that handle sees, not later appends.
    # No chunk cache: ailhd's chunks are stored raw, and HDF5 reads a raw chunk bigger than the
    # cache in part, straight from the file, so a random row costs a row and not its whole chunk
    # (h5py's default 1 MiB cache made a row of 1 MiB chunks cost 1 MiB; benches/reader.py).
    ways = [dict(libver="latest", swmr=True, locking=False), dict(libver="latest", swmr=True),
            dict(locking=False), {}]
    ways = [dict(kw, rdcc_nbytes=0) for kw in ways]
    last = None
    for attempt in range(20):
        for kw in ways:
            try:
                return h5py.File(path, "r", **kw)
            except TypeError:  # h5py < 3.5: no locking argument
                continue
            except OSError as e:
                last = e
                text = str(e)
                if "not the same" in text or "don't match" in text or "do not match" in text:
                    continue
                break
        time.sleep(0.1)
    raise OSError(f"{path}: cannot be opened for reading: {last}") from last


class _NpyColumn:
    """One `.npy` column mapped read-only: rows below the header's (committed) count."""

    def __init__(self, path):
        self.path = path
        self.header_len, self.rows, self.dtype, self.row_shape = _npy_header(path)
        self.map, self.ident = _map_file(path)
        size = len(self.map) if self.map is not None else 0
        row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        have = (size - self.header_len) // row_bytes if row_bytes and size >= self.header_len else 0
        self.rows = min(self.rows, have)
        if self.rows > 0:
            self.array = np.ndarray((self.rows,) + self.row_shape, self.dtype, buffer=self.map,
                                    offset=self.header_len)
        else:
            self.array = np.empty((0,) + self.row_shape, self.dtype)

    def close(self):
        self.array = None
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                pass
            self.map = None


def _npy_header(path):
    """(header length, rows, dtype, row shape) of an npy v1/v2 file, read until two reads agree
    (the writer rewrites the shape in place at each commit)."""
    last = None
    for _ in range(100):
        with open(path, "rb") as fh:
            pre = fh.read(12)
            if len(pre) < 10 or pre[:6] != b"\x93NUMPY":
                raise ValueError(f"{path}: not an npy file")
            if pre[6] == 1:
                hl = 10 + int.from_bytes(pre[8:10], "little")
            else:
                hl = 12 + int.from_bytes(pre[8:12], "little")
            fh.seek(0)
            raw = fh.read(hl)
        if raw == last:
            bio = io.BytesIO(raw)
            version = np.lib.format.read_magic(bio)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read(bio)
            if fortran or not shape:
                raise ValueError(f"{path}: not a C-order array with rows")
            return hl, int(shape[0]), np.dtype(dtype), tuple(int(s) for s in shape[1:])
        last = raw
    raise ValueError(f"{path}: the header keeps changing")


class _NpyFiles:
    """One process's view of `npy/<split>/`."""

    def __init__(self, path):
        self.path = path
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such folder (is outputs.npy on, and is this "
                                    "ailhd's paths.output? source='hdf5' reads the HDF5 files)")
        self.cols = {}
        self.outputs = _Outputs()

    def col(self, name):
        c = self.cols.get(name)
        if c is None:
            c = self.cols[name] = _NpyColumn(os.path.join(self.path, name + ".npy"))
        return c

    def identity(self):
        st = os.stat(os.path.join(self.path, "segments_mel.npy"))
        return (st.st_dev, st.st_ino)

    def close(self):
        for c in self.cols.values():
            c.close()
        self.cols = {}

    def snapshot(self):
        with open(os.path.join(self.path, "attributes.json"), "rb") as fh:
            attrs = json.load(fh)
        committed = int(attrs["committed_rows"])
        mel = self.col("segments_mel")
        if mel.ident != self.identity():
            raise OutputsReplaced(f"{self.path}: replaced while being opened; call refresh() again")
        if mel.dtype != np.float16:
            raise ValueError(f"{mel.path}: dtype {mel.dtype}, expected float16")
        labels, valid = self.col("labels"), self.col("valid")
        n = min(committed, mel.rows, labels.rows, valid.rows)
        return {
            "identity": mel.ident,
            "committed": n,
            "valid": np.array(valid.array[:n]) != 0,
            "label_ids": np.array(labels.array[:n]),
            "labels": _json_text(attrs["labels_json"]),
            "row_shape": mel.row_shape,
        }

    def gather_rows(self, rows, committed):
        mel = self.col("segments_mel")
        if mel.rows < committed:
            raise OutputsReplaced(f"{mel.path}: holds {mel.rows} rows, fewer than this "
                                  f"dataset's snapshot ({committed}); call refresh()")
        out = self.outputs.array((len(rows),) + mel.row_shape, mel.dtype)
        _take(mel.array.reshape(mel.rows, -1), rows, out.reshape(len(rows), -1))
        return out

    def meta(self, row):
        out = {}
        for c in META_COLUMNS:
            col = self.col(c)
            if row >= col.rows:  # committed after this process mapped the column
                col.close()
                col = self.cols[c] = _NpyColumn(col.path)
            out[c] = col.array[row]
        return out
