"""LiveDataset: ailhd's per-split outputs as a map-style dataset (ailhd README, "Reading from
Python"; the file layout is in its "Outputs" section).

How it reads, and why:

- A snapshot (which rows are visible, their label ids) is taken by `refresh()`. It is plain
  data, pickled into DataLoader workers. `refresh()` is incremental: it reads the committed count,
  then the `valid` and `labels` columns of the committed rows (1 byte and 2 bytes a row: 0.6 MB
  at 200,000 rows, read whole because any old row may have been superseded, deleted or moved to
  another label since), and redoes only what changed: rows appended since the last refresh are
  appended to the snapshot, and only when an old row's `valid` or label changed is the visible
  list recomputed (one vectorised pass). Files stay open from one refresh to the next.
- Rows never move: a row number names the same recording for as long as the files exist. So a
  sampler hands out *keys* (`ds.keys`, `LiveSampler`): a key is an int that holds the row number,
  the label id the row had in the snapshot it was drawn from, and a tag of the files' identity.
  `ds[key]` serves that row in any process whatever that process's snapshot is: the features
  are read at the row's place in the files, the label is the key's. A worker asked for a row
  past the committed count it knows catches up by itself (it reads only the committed count and,
  for HDF5, the addresses of the chunks that are new), so the main process and the workers
  serve exactly the rows the main process drew. Plain positions (`ds[i]`, 0 <= i < len) are the
  positions of the process's own snapshot; a worker asked for a position past its snapshot
  refreshes itself (incrementally) instead of failing.
- `committed_rows` (HDF5) or `attributes.json` and the npy headers (npy) are read first, then
  the other columns: rows below the committed count are complete; rows past it are never served.
- Features are read straight from the files: for npy at `header + row * row_bytes`; for HDF5 at
  the row's chunk address (asked from HDF5 once per chunk, when it first shows up) plus its place
  in the chunk. This is used only when the dataset's chunks are stored raw (no filter,
  little-endian float16, whole rows per chunk), and rows read this way are checked against
  h5py's own reads; otherwise rows are read through h5py (sorted, runs of consecutive rows in one
  call, chunk cache off for unfiltered chunks so that a row costs a row and not a chunk).
- Never SIGBUS: reading a memory map of a file that was cut short below the map kills the
  process (SIGBUS). ailhd cuts rows back in one case (a kill between the HDF5 and the npy commit
  of the same batch: at its next start, the rows that not every enabled output had committed are
  cut from the outputs that had). Rows below the committed count of *every* output of the split
  ("settled" rows) are never cut, and are gathered from a memory map; the others (the last batch,
  for the milliseconds between the two commits, or all new rows when the other output is
  disabled but its old files remain) are read with `pread`, which returns a short read instead
  of faulting, after checking that the committed count still covers them. Before every gather
  the file's size is checked (`fstat`) against the rows asked for. An HDF5 reader reads npy's
  `attributes.json` for this, an npy reader the HDF5 file's `committed_rows`.
- A batch is gathered with `np.take` into an output array that is reused once nothing refers to
  it any more (`_Outputs`): a fresh 57 MB array costs the kernel's zeroing of its pages, as much
  as the gather itself. HDF5 rows are gathered the same way when every row's offset is a multiple
  of a block of >= 256 bytes: ailhd aligns its `segments_mel` chunks to the row size (HDF5's
  file-space alignment, in `rebuild` and in the service alike), so its rows are whole blocks.
  Files from other writers (or from ailhd before it aligned them) are read by fancy indexing a
  byte view into a new array (0.5-0.7x as fast, benches/reader.py).
- Files replaced (a `rebuild` renames new files into place): a process that has the old files
  open goes on serving the snapshot it has from them (the old files stay readable while open);
  `refresh()` starts over on the new files; a key of files this process does not have open, or
  a position in a snapshot of replaced files, raises `OutputsReplaced`. Rows a snapshot saw
  committed that are no longer in the files raise `RowsWithdrawn`.
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

# Keys: bit 62 set (never a valid position), 16 bits of the files' identity tag, 14 bits of the
# label id, 32 bits of the row number. Plain Python ints: they pickle small and go through
# PyTorch's samplers and BatchSampler unchanged.
KEY_FLAG = 1 << 62
_TAG_SHIFT = 46
_LABEL_SHIFT = 32
_ROW_MASK = (1 << 32) - 1
_LABEL_MASK = (1 << 14) - 1
_TAG_MASK = (1 << 16) - 1


class OutputsChanged(RuntimeError):
    """The files no longer hold what a snapshot or a key refers to."""


class OutputsReplaced(OutputsChanged):
    """The files changed identity (a `rebuild` replaced them) after the snapshot was taken."""


class RowsWithdrawn(OutputsChanged):
    """Rows a snapshot saw committed are no longer in the files (cut back by the writer)."""


def _tag(identity):
    """16 bits of a file's inode number, the same in every process (and on every client of a
    network file system, where st_dev differs)."""
    h = (int(identity[1]) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    return (h >> 40) & _TAG_MASK


def make_keys(rows, labels, tag):
    """Keys of these rows (int64 array) with these label ids, for files of this tag."""
    rows = np.asarray(rows, np.int64)
    labels = np.asarray(labels, np.int64)
    if rows.size and (rows.max() > _ROW_MASK or rows.min() < 0):
        raise ValueError("row numbers beyond 2**32 cannot be keyed")
    if labels.size and (labels.min() < 0 or labels.max() > _LABEL_MASK):
        raise ValueError(f"label ids must lie in 0..{_LABEL_MASK}")
    return KEY_FLAG | (int(tag) << _TAG_SHIFT) | (labels << _LABEL_SHIFT) | rows


def split_keys(keys):
    """(rows, labels, tags) of an int64 array of keys."""
    keys = np.asarray(keys, np.int64)
    return (keys & _ROW_MASK, (keys >> _LABEL_SHIFT) & _LABEL_MASK,
            (keys >> _TAG_SHIFT) & _TAG_MASK)


def is_key(i):
    return int(i) >= KEY_FLAG


class Batch(collections.abc.Sequence):
    """What `__getitems__` returns: a sequence of `(features, label)` pairs, as PyTorch's
    default collate expects, backed by one array of features `[B, ...]`, one of labels `[B]` and
    one of the rows' numbers in the files `[B]` (`collate` turns the first two into tensors
    without touching each row)."""

    __slots__ = ("features", "labels", "rows")

    def __init__(self, features, labels, rows=None):
        self.features = features
        self.labels = labels
        self.rows = rows

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

    `len(ds)`, `ds[i] -> (features float16 [num_long, num_short, n_mels, t_frames], label id)`
    for a position 0 <= i < len(ds) or a key (`ds.keys`, `LiveSampler`), `ds.labels` (names by
    id), `ds.meta(i)`, `ds.refresh()`; `ds.rows` (row numbers in the files), `ds.targets` (label
    ids) and `ds.keys` of the visible rows.
    """

    def __init__(self, output_dir, split="training", source="npy", *, hdf5_name=None, direct=True):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, not {source!r}")
        self.output_dir = os.fspath(output_dir)
        self.split = split
        self.source = source
        self._h5_path = os.path.join(self.output_dir, hdf5_name or HDF5_NAMES[split])
        self._npy_path = os.path.join(self.output_dir, "npy", split)
        self.path = self._h5_path if source == "hdf5" else self._npy_path
        self._direct_allowed = bool(direct)
        # The snapshot: plain data, pickled into worker processes.
        self._committed = 0
        self._valid = np.empty(0, np.uint8)  # the `valid` column of the committed rows
        self._label_col = np.empty(0, np.int16)  # the `labels` column of the committed rows
        self._rows = np.empty(0, np.int64)
        self._targets = np.empty(0, np.int64)
        self._labels = []
        self._row_shape = None
        self._identity = None
        self._layout = None  # HDF5 direct reads: dict(chunk_rows, chunk_addr, block) or None
        self._block = 0  # HDF5 direct reads: offsets and row size are multiples of it (0: none)
        # Per-process files.
        self._files = None
        self._pid = None
        self._home = None  # the process whose refresh() made the snapshot
        self.refresh()

    # ----- the map-style dataset -----

    def __len__(self):
        return len(self._rows)

    def __getitem__(self, i):
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"LiveDataset indices are integers, not {type(i).__name__}")
        if is_key(i):
            b = self._read_keys(np.array([i], np.int64))
            return b.features[0], int(b.labels[0])
        i = self._index(i)
        feats = self._read_positions(np.array([i], np.int64)).features[0]
        return feats, int(self._targets[i])

    def __getitems__(self, indices):
        """A whole batch in one read (PyTorch's DataLoader calls this when it exists): positions
        of this process's snapshot, or keys."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and idx.max() >= KEY_FLAG:
            if idx.min() < KEY_FLAG:
                raise ValueError("a batch mixes keys and positions")
            return self._read_keys(idx)
        return self._read_positions(idx)

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
    def keys(self):
        """Keys of the visible rows (int64): `ds[keys[i]]` is `ds[i]`, in any process, also
        after later refreshes (the row and its label as of this snapshot)."""
        return make_keys(self._rows, self._targets, _tag(self._identity))

    @property
    def committed_rows(self):
        """The committed row count seen by the last `refresh()`."""
        return self._committed

    @property
    def direct(self):
        """True when features are read straight from the files (always for npy)."""
        return self.source == "npy" or self._layout is not None

    def meta(self, i):
        """What is known about row `ds[i]` (a position or a key): a dict with `row` (its number
        in the files), `label` (id), `label_name`, `source_path`, `sensor_id`, `recording_id`
        ("" when the file name does not follow the convention), `recorded_at` (Unix seconds UTC,
        -1 when absent), `gain_db` (NaN when absent) and `blake3` (hex). Read now, so a row moved
        to another path or label since the last refresh shows its new path."""
        if is_key(i):
            rows, labels, tags = split_keys([i])
            row, label = int(rows[0]), int(labels[0])
            files = self._files_for_tag(int(tags[0]), row + 1)
        else:
            i = self._index(i)
            row, label = int(self._rows[i]), int(self._targets[i])
            files = self._open()
        raw = files.meta(row)
        out = {"row": row, "label": label}
        out["label_name"] = self._labels[label] if 0 <= label < len(self._labels) else None
        for c in _STRING_COLUMNS:
            out[c] = _text(raw[c])
        out["recorded_at"] = int(raw["recorded_at"])
        out["gain_db"] = float(raw["gain_db"])
        out["blake3"] = bytes(np.asarray(raw["blake3"], np.uint8)).hex()
        return out

    def refresh(self):
        """Look at the files again: rows committed since the last call appear, rows superseded or
        deleted since drop out, rows moved to another label show it. Returns how many rows
        became visible. Its cost grows with the rows committed since the last call (plus a
        read of the `valid` and `labels` columns: 3 bytes a row). A DataLoader worker calls it
        by itself when asked for a position past its snapshot; `LiveSampler` calls it at the
        start of each epoch. If a `rebuild` replaced the files, it starts over and returns the
        number of rows now visible."""
        self._home = os.getpid()
        return self._refresh()

    def _refresh(self):
        files = self._open(check=False)
        if files.broken or not files.same_path():
            # Other files at the path (a rebuild replaced them), or this handle failed: reopen.
            self._close_files()
            files = self._open(check=False)
        try:
            cols = files.columns()
        except OutputsChanged:
            self._close_files()
            files = self._open(check=False)
            cols = files.columns()
        if files.identity != self._identity:
            self._forget()
            self._identity = files.identity
        committed = cols["committed"]
        valid = (cols["valid"] != 0).view(np.uint8)
        labels = cols["labels"]
        old_n = min(self._committed, committed)
        gained = 0
        same_old = (committed >= self._committed
                    and np.array_equal(valid[:old_n], self._valid[:old_n])
                    and np.array_equal(labels[:old_n], self._label_col[:old_n]))
        if same_old:
            # Only appended rows: extend the snapshot.
            tail = np.flatnonzero(valid[old_n:]).astype(np.int64) + old_n
            if tail.size:
                self._rows = np.concatenate([self._rows, tail])
                self._targets = np.concatenate([self._targets, labels[tail].astype(np.int64)])
            gained = int(tail.size)
        else:
            was = np.zeros(committed, bool)
            was[:old_n] = self._valid[:old_n] != 0
            now = valid != 0
            gained = int(np.count_nonzero(now & ~was))
            self._rows = np.flatnonzero(now).astype(np.int64)
            self._targets = labels[self._rows].astype(np.int64)
        if committed < self._committed:
            # Rows taken back: their chunks may have been freed and written elsewhere since.
            self._layout = None
        self._committed = committed
        self._valid = valid
        self._label_col = labels
        self._labels = cols["names"]
        self._row_shape = cols["row_shape"]
        if self.source == "hdf5":
            self._layout = files.layout(self._layout if self._direct_allowed else False,
                                        committed, self._rows)
            self._block = self._layout["block"] if self._layout else 0
        return gained

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

    def _forget(self):
        self._committed = 0
        self._valid = np.empty(0, np.uint8)
        self._label_col = np.empty(0, np.int16)
        self._rows = np.empty(0, np.int64)
        self._targets = np.empty(0, np.int64)
        self._layout = None
        self._block = 0

    def _index(self, i):
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"LiveDataset indices are integers, not {type(i).__name__}")
        n = len(self._rows)
        if not -n <= i < n:
            if 0 <= i and self._catch_up(lambda: int(i) < len(self._rows)):
                return int(i)
            n = len(self._rows)
            raise IndexError(f"index {i} out of range for {n} rows")
        return int(i) + n if i < 0 else int(i)

    def _catch_up(self, done):
        """A position past this snapshot. In a process other than the one whose `refresh()` made
        it (a DataLoader worker, whose sampler drew from the main process's newer snapshot):
        refresh and look again. In that process: no (its snapshot changes only when asked)."""
        if os.getpid() == self._home:
            return False
        self._refresh()
        return done()

    def _close_files(self):
        if self._files is not None and self._pid == os.getpid():
            self._files.close()
        self._files = None

    def _new_files(self, path=None):
        if self.source == "hdf5":
            return _Hdf5Files(path or self._h5_path, self._npy_path, self._direct_allowed)
        return _NpyFiles(path or self._npy_path, self._h5_path)

    def _open(self, check=True):
        """This process's files, opened on first use (a DataLoader worker opens its own)."""
        if self._files is None or self._pid != os.getpid():
            self._files = None
            files = self._new_files()
            if check and files.identity != self._identity:
                files.close()
                raise OutputsReplaced(
                    f"{self.path}: replaced (by `ailhd rebuild`?) since this dataset's last "
                    "refresh(); call refresh() (LiveSampler does at each epoch)")
            if self.source == "hdf5" and files.identity == self._identity:
                files.seed(self._layout)
            self._files = files
            self._pid = os.getpid()
        return self._files

    def _files_for_tag(self, tag, need_rows):
        """Files of this tag with at least need_rows committed rows (catching up if needed)."""
        files = self._open(check=False)
        if files.tag != tag:
            # A key of other files: the current files at the path (a rebuild since this
            # process's snapshot), unless they are ours already.
            fresh = self._new_files()
            if fresh.tag != tag:
                fresh.close()
                raise OutputsReplaced(
                    f"{self.path}: a key names rows of files that were replaced (by `ailhd "
                    "rebuild`?) and that this process does not have open; the sampler's next "
                    "epoch (it refreshes) draws from the new files")
            files.close()
            self._files = files = fresh
            self._pid = os.getpid()
        elif not files.replaced_checked and not files.same_path():
            # Replaced at the path, but the key is of the files this process has open: go on
            # serving them (unless both have the same tag, which would be ambiguous).
            other = self._new_files()
            ambiguous = other.tag == tag and other.identity != files.identity
            other.close()
            files.replaced_checked = not ambiguous
            if ambiguous:
                raise OutputsReplaced(f"{self.path}: replaced by files with the same identity "
                                      "tag; refresh() to go on")
        files.ensure(need_rows)
        return files

    def _read_positions(self, idx):
        n = len(self._rows)
        if idx.size:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < -n or hi >= n:
                if lo >= -n and self._catch_up(lambda: hi < len(self._rows)):
                    n = len(self._rows)
                else:
                    raise IndexError(f"index out of range for {len(self._rows)} rows")
            idx = np.where(idx < 0, idx + n, idx)
        files = self._open()
        if idx.size == 0:
            return Batch(np.empty((0,) + self._row_shape, np.float16), np.empty(0, np.int64),
                         np.empty(0, np.int64))
        rows = self._rows[idx]
        files.ensure(int(rows.max()) + 1)
        return Batch(files.gather(rows), self._targets[idx], rows)

    def _read_keys(self, keys):
        rows, labels, tags = split_keys(keys)
        tag = int(tags[0])
        if (tags != tag).any():
            raise ValueError("a batch mixes keys of different files")
        files = self._files_for_tag(tag, int(rows.max()) + 1)
        return Batch(files.gather(rows), labels, rows)


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


def _identity(st):
    return (st.st_dev, st.st_ino)


def _byte_rows(buf, row_bytes):
    """Every byte offset of the buffer as the start of a row: `view[offsets]` gathers rows at
    arbitrary offsets in one call (read-only, overlapping rows)."""
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


class _Mapped:
    """A file read at byte offsets: a read-only memory map for rows that the writer never cuts,
    `pread` for the others. The map covers the file as it was when last (re)mapped and is remade
    when asked for offsets past it. Never SIGBUS: the map is read only below the file's current
    size (checked with fstat before each gather), and only for rows that are never cut."""

    def __init__(self, fd, path):
        self.fd = fd
        self.path = path
        self.map = None
        self.buf = None  # uint8 view of the map
        self.blocks = None
        self.outputs = _Outputs()

    def close(self):
        self.buf = None
        self.blocks = None
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # an array returned earlier still uses it; the GC closes it
                pass
            self.map = None

    def _ensure_map(self, end):
        if self.buf is not None and len(self.buf) >= end:
            return
        size = os.fstat(self.fd).st_size
        if size < end:
            raise RowsWithdrawn(f"{self.path}: {size} bytes, shorter than the committed rows "
                                f"need ({end}): rows were taken back, or the file was cut")
        self.buf = None
        self.blocks = None
        self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        self.buf = np.frombuffer(self.map, np.uint8)

    def gather(self, offs, row_bytes, shape, late=None, block=0, pre_pread=None):
        """Rows of row_bytes at these byte offsets, as a float16 array of shape. Rows where `late`
        (a bool array, or None for none) are read with pread (after pre_pread(), which checks
        that they are still committed), the others gathered from the map."""
        n = len(offs)
        end = int(offs.max()) + row_bytes
        if late is not None and late.any():
            if pre_pread is not None:
                pre_pread()
            out = self.outputs.array(shape)
            flat = out.reshape(n, -1).view(np.uint8)
            early = np.flatnonzero(~late)
            if early.size:
                flat[early] = self._gather_mapped(offs[early], row_bytes, int(
                    offs[early].max()) + row_bytes, (early.size,) + tuple(shape[1:]),
                    block).reshape(early.size, -1).view(np.uint8)
            fd = self.fd
            for k in np.flatnonzero(late).tolist():
                got = os.preadv(fd, [flat[k]], int(offs[k]))
                if got != row_bytes:
                    raise RowsWithdrawn(f"{self.path}: the file ends before a committed row "
                                        "(rows taken back after a crash?)")
            return out
        return self._gather_mapped(offs, row_bytes, end, shape, block)

    def _gather_mapped(self, offs, row_bytes, end, shape, block):
        self._ensure_map(end)
        if os.fstat(self.fd).st_size < end:  # cut behind the writer's protocol: no SIGBUS
            raise RowsWithdrawn(f"{self.path}: cut below the rows asked for")
        if not block:
            view = _byte_rows(self.buf, row_bytes)
            return view[offs].view("<f2").reshape(shape)
        if self.blocks is None or self.blocks.shape[1] != block:
            self.blocks = self.buf[: len(self.buf) // block * block].reshape(-1, block)
        per_row = row_bytes // block
        idx = (offs // block)[:, None] + np.arange(per_row)
        out = self.outputs.array(shape)
        _take(self.blocks, idx.reshape(-1), out.reshape(len(offs), -1).view(np.uint8)
              .reshape(-1, block))
        return out


def _read_json(path):
    """A JSON file the writer replaces or rewrites: retried while it reads incomplete."""
    last = None
    for _ in range(50):
        try:
            with open(path, "rb") as fh:
                return json.load(fh)
        except ValueError as e:
            last = e
            time.sleep(0.01)
    raise ValueError(f"{path}: not valid JSON: {last}")


def _npy_committed(folder):
    """The committed row count of an npy folder (attributes.json, segments_mel's header), or None
    when there is none."""
    try:
        attrs = _read_json(os.path.join(folder, "attributes.json"))
        rows = _npy_header(os.path.join(folder, "segments_mel.npy"))[1]
    except (OSError, ValueError, KeyError):
        return None
    return min(int(attrs["committed_rows"]), rows)


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


class _OtherHdf5:
    """The HDF5 file's committed_rows, for an npy reader's settled count (None: no file)."""

    def __init__(self, path):
        self.path = path
        self.f = None
        self.ident = None

    def committed(self):
        try:
            st = os.stat(self.path)
        except OSError:
            self.close()
            return None
        try:
            if self.f is None or self.ident != _identity(st):
                self.close()
                import h5py

                self.f = _open_h5(h5py, self.path)
                self.ident = _identity(st)
            c = self.f["committed_rows"]
            _refresh(c)
            return int(c[0])
        except Exception:  # not readable now: treat every npy row past the settled ones as late
            self.close()
            return 0

    def close(self):
        if self.f is not None:
            try:
                self.f.close()
            except Exception:
                pass
        self.f = None


def _npy_header(path, fd=None):
    """(header length, rows, dtype, row shape) of an npy v1/v2 file, read until two reads agree
    (the writer rewrites the shape in place at each commit)."""
    last = None
    own = fd is None
    if own:
        fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(100):
            pre = os.pread(fd, 12, 0)
            if len(pre) < 10 or pre[:6] != b"\x93NUMPY":
                raise ValueError(f"{path}: not an npy file")
            if pre[6] == 1:
                hl = 10 + int.from_bytes(pre[8:10], "little")
            else:
                hl = 12 + int.from_bytes(pre[8:12], "little")
            raw = os.pread(fd, hl, 0)
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
    finally:
        if own:
            os.close(fd)
    raise ValueError(f"{path}: the header keeps changing")


def _npy_read_rows(path, start, count):
    """Rows start..start+count of an npy column, read with pread (never a map: no SIGBUS if the
    file is cut meanwhile); fewer when the file ends before."""
    fd = os.open(path, os.O_RDONLY)
    try:
        hl, rows, dtype, shape = _npy_header(path, fd)
        row_bytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        count = max(0, min(count, rows - start))
        raw = os.pread(fd, count * row_bytes, hl + start * row_bytes) if count else b""
        got = len(raw) // row_bytes if row_bytes else 0
        return np.frombuffer(raw[: got * row_bytes], dtype).reshape((got,) + shape), rows
    finally:
        os.close(fd)


class _NpyFiles:
    """One process's view of `npy/<split>/`: segments_mel.npy open for gathers; the other
    columns read with pread when needed."""

    def __init__(self, path, h5_path):
        self.path = path
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such folder (is outputs.npy on, and is this "
                                    "ailhd's paths.output? source='hdf5' reads the HDF5 files)")
        self.mel_path = os.path.join(path, "segments_mel.npy")
        self.fd = os.open(self.mel_path, os.O_RDONLY)
        self.identity = _identity(os.fstat(self.fd))
        self.tag = _tag(self.identity)
        self.header_len, _, self.dtype, self.row_shape = _npy_header(self.mel_path, self.fd)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        self.data = _Mapped(self.fd, self.mel_path)
        self.other = _OtherHdf5(h5_path)
        self.known_committed = 0
        self.settled = 0
        self.broken = False
        self.replaced_checked = False  # (a key of these files after a rebuild replaced them)

    def same_path(self):
        try:
            return _identity(os.stat(self.mel_path)) == self.identity
        except OSError:
            return False

    def close(self):
        self.data.close()
        self.other.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _committed(self):
        """(committed rows, attributes.json) of these files; (rows, None) when they were replaced
        (a rebuild): their last header is their committed count, and it no longer changes."""
        rows = _npy_header(self.mel_path, self.fd)[1]
        if self.same_path():
            attrs = _read_json(os.path.join(self.path, "attributes.json"))
            if self.same_path():  # (the folder is swapped whole: attrs are these files')
                return min(int(attrs["committed_rows"]), rows), attrs
        return rows, None

    def catch_up(self):
        """The committed count now, and the settled one (what every output has committed)."""
        committed, attrs = self._committed()
        other = None if attrs is None else self.other.committed()
        self.known_committed = committed
        self.settled = committed if other is None else min(committed, other)
        return committed, attrs

    def columns(self):
        if _identity(os.stat(self.mel_path)) != self.identity:
            raise OutputsReplaced(f"{self.path}: replaced while being opened")
        if self.dtype != np.float16:
            raise ValueError(f"{self.mel_path}: dtype {self.dtype}, expected float16")
        committed, attrs = self._committed()
        if attrs is None:
            raise OutputsReplaced(f"{self.path}: replaced while being read")
        self.known_committed = committed
        valid, _ = _npy_read_rows(os.path.join(self.path, "valid.npy"), 0, committed)
        labels, _ = _npy_read_rows(os.path.join(self.path, "labels.npy"), 0, committed)
        n = min(committed, len(valid), len(labels))
        other = self.other.committed()
        self.known_committed = n
        self.settled = n if other is None else min(n, other)
        return {
            "committed": n,
            "valid": np.ascontiguousarray(valid[:n]),
            "labels": np.ascontiguousarray(labels[:n]).astype(np.int16, copy=False),
            "names": _json_text(attrs["labels_json"]),
            "row_shape": self.row_shape,
        }

    def ensure(self, need_rows):
        """At least need_rows committed rows (catching up when this process knows fewer)."""
        if need_rows > self.known_committed:
            self.catch_up()
            if need_rows > self.known_committed:
                raise RowsWithdrawn(
                    f"{self.path}: row {need_rows - 1} asked for, but the files commit only "
                    f"{self.known_committed} rows (were rows taken back after a crash?)")

    def gather(self, rows):
        offs = self.header_len + rows * self.row_bytes
        return self.data.gather(offs, self.row_bytes, (len(rows),) + self.row_shape,
                                rows >= self.settled, pre_pread=lambda: self._still_committed(rows))

    def _still_committed(self, rows):
        committed, _ = self.catch_up()
        if int(rows.max()) >= committed:
            raise RowsWithdrawn(f"{self.path}: row {int(rows.max())} is no longer committed")

    def meta(self, row):
        out = {}
        for c in META_COLUMNS:
            vals, rows = _npy_read_rows(os.path.join(self.path, c + ".npy"), row, 1)
            if len(vals) != 1:
                raise RowsWithdrawn(f"{self.path}/{c}.npy: no row {row} (holds {rows})")
            out[c] = vals[0]
        return out


class _Hdf5Files:
    """One process's view of a split's HDF5 file: an h5py SWMR handle, and a descriptor of the
    same file for direct reads of features."""

    def __init__(self, path, npy_path, direct=True):
        import h5py

        self.path = path
        self.npy_path = npy_path
        self._h5py = h5py
        self.f = _open_h5(h5py, path)
        self.fd = None
        try:
            fd = self.f.id.get_vfd_handle()
            self.fd = os.dup(fd) if isinstance(fd, int) and fd >= 0 else None
        except Exception:
            self.fd = None
        if self.fd is None:
            self.fd = os.open(path, os.O_RDONLY)
        self.identity = _identity(os.fstat(self.fd))
        self.tag = _tag(self.identity)
        self.data = _Mapped(self.fd, path)
        self.known_committed = 0
        self.settled = 0
        self.broken = False
        self.replaced_checked = False  # (a key of these files after a rebuild replaced them)
        self.chunk_rows = None
        self.chunk_addr = None  # None: read through h5py
        self.verified_rows = 0  # rows whose bytes were found at their chunk's address
        self.lookups = 0  # chunks whose guessed address was wrong (HDF5 was asked)
        self.block = 0
        self.row_shape = None
        self.rb = 0

    def same_path(self):
        try:
            return _identity(os.stat(self.path)) == self.identity
        except OSError:
            return False

    def close(self):
        self.data.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.f is not None:
            try:
                self.f.close()
            except Exception:
                pass
            self.f = None

    def _committed(self):
        c = self.f["committed_rows"]
        _refresh(c)
        return int(c[0])

    def catch_up(self):
        """The committed count now, the settled one, and addresses of the chunks that are new."""
        try:
            committed = self._committed()
        except Exception as e:
            self.broken = True
            raise OutputsChanged(f"{self.path}: cannot read committed_rows: {e}") from e
        if self.chunk_addr is not None:
            self._trim(committed)
            why = self._extend_chunks(committed)
            if why is not None:
                self.broken = True
                raise OutputsChanged(f"{self.path}: {why}")
        self.known_committed = committed
        self._settle()
        return committed

    ensure = _NpyFiles.ensure

    def _trim(self, committed):
        """Forget the addresses of chunks past the committed rows (rows taken back: their chunks
        may have been freed and reused)."""
        keep = -(-committed // self.chunk_rows)
        if len(self.chunk_addr) > keep:
            self.chunk_addr = self.chunk_addr[:keep]
        self.verified_rows = min(self.verified_rows, committed)

    def _settle(self):
        # (Files a rebuild replaced are never cut: all their rows are settled.)
        other = _npy_committed(self.npy_path) if os.path.isdir(self.npy_path) \
            and self.same_path() else None
        self.settled = self.known_committed if other is None else min(self.known_committed, other)

    def columns(self):
        f = self.f
        try:
            for name in ("committed_rows", "segments_mel", "labels", "valid"):
                if name not in f:
                    raise ValueError(f"{self.path}: no dataset {name!r}; not an ailhd output")
            committed = self._committed()
            lengths = []
            for name in ("segments_mel", "labels", "valid"):
                _refresh(f[name])
                lengths.append(f[name].shape[0])
            if min(lengths) < committed:
                raise ValueError(f"{self.path}: committed_rows says {committed} but the datasets "
                                 f"hold {min(lengths)} rows")
            mel = f["segments_mel"]
            if mel.dtype != np.float16:
                raise ValueError(f"{self.path}: segments_mel is {mel.dtype}, expected float16")
            valid = f["valid"][:committed]
            labels = f["labels"][:committed]
            names = _json_text(f.attrs["labels_json"])
        except (KeyError, OSError, RuntimeError) as e:
            self.broken = True
            raise OutputsChanged(f"{self.path}: {e}") from e
        self.row_shape = tuple(mel.shape[1:])
        self.rb = int(np.prod(self.row_shape)) * 2
        self.known_committed = committed
        self._settle()
        return {"committed": committed, "valid": valid, "labels": labels.astype(np.int16),
                "names": names, "row_shape": self.row_shape}

    # Direct reads.

    def seed(self, layout):
        """Chunk addresses known from the snapshot (pickled into a worker)."""
        if layout:
            self._seed_addresses(layout)
            self.row_shape = tuple(layout["row_shape"])
            self.rb = int(np.prod(self.row_shape)) * 2
            self.known_committed = layout["committed"]
            self._settle()

    def layout(self, known, committed, rows):
        """Chunk addresses of the committed rows (extending `known`, the snapshot's); None when
        rows cannot be read raw (or `known` is False)."""
        if known is False:
            self.chunk_addr = None
            return None
        why = None
        first_time = self.chunk_addr is None
        if first_time:
            why = self.raw_layout_problem()
            if why is None:
                self.chunk_rows = self.f["segments_mel"].chunks[0]
                if known and known["chunk_rows"] == self.chunk_rows:
                    self._seed_addresses(known)
                else:
                    self.chunk_addr = np.empty(0, np.int64)
                    self.block = self.rb
                    self.verified_rows = 0
        if why is None:
            self._trim(committed)
            why = self._extend_chunks(committed)
        if why is None and first_time and len(rows):
            # Rows read raw, both ways of gathering, against h5py's reads of them.
            why = self.check(np.unique(rows[[0, len(rows) // 2, -1]]))
        if why is None:
            return {"chunk_rows": self.chunk_rows, "chunk_addr": self.chunk_addr.copy(),
                    "block": self.block, "committed": committed, "row_shape": self.row_shape,
                    "verified": self.verified_rows}
        self.chunk_addr = None
        warnings.warn(f"{self.path}: reading segments_mel through h5py ({why})", stacklevel=4)
        return None

    def _seed_addresses(self, layout):
        self.chunk_rows = layout["chunk_rows"]
        self.chunk_addr = layout["chunk_addr"].copy()
        self.block = layout["block"]
        self.verified_rows = layout["verified"]

    def _append_addresses(self, addr):
        if not len(addr):
            return
        self.chunk_addr = np.concatenate([self.chunk_addr, np.asarray(addr, np.int64)])
        g = offsets_block(np.asarray(addr, np.int64), self.rb)
        self.block = int(np.gcd(self.block, g)) if self.block and g else 0
        if self.block and self.block < 256:
            self.block = 0

    def _extend_chunks(self, committed):
        """Addresses of the chunks that hold rows committed since the last call.

        HDF5 tells a chunk's address only by going through the chunk index (2.9 ms per chunk at
        the end of a 33,000-chunk dataset, HDF5 2.0), so the addresses of new chunks are guessed
        and checked: a chunk is guessed to follow the previous one in the file (as HDF5 allocates
        them while ailhd appends), and the guess is kept when the bytes there equal the chunk's
        committed rows as HDF5 reads them (`read_direct_chunk`, which finds a chunk directly);
        otherwise they are looked for in the next MiB of the file (HDF5 puts metadata between
        chunks now and then), and only then (and for chunks whose rows are all one byte value)
        HDF5 is asked. Rows committed later into a chunk already known are checked the same
        way. When many chunks are new (the first refresh), HDF5 is asked for all of them in one
        pass."""
        cr, rb = self.chunk_rows, self.rb
        cb = cr * rb
        need = -(-committed // cr)
        have = len(self.chunk_addr)
        if have == 0 or need - have > max(64, have // 4):
            addr, why = self.chunk_addresses(have, need)
            if why is not None:
                return why
            self._append_addresses(addr)
            self.verified_rows = committed
            return None
        if self.verified_rows >= committed:
            return None
        mel = self.f["segments_mel"]
        _refresh(mel)
        tail = (0,) * (len(mel.shape) - 1)
        addrs = list(self.chunk_addr[have - 1:].tolist())  # the last known one, then new ones
        base = have - 1
        verified = self.verified_rows
        k = verified // cr
        # Reused buffers (fresh 60 KiB buffers for each chunk cost as much as the reads), compared
        # as bytearrays (memcmp; memoryviews compare byte by byte, 100x slower).
        chunk, there = bytearray(cb), bytearray(cb)
        while k < need:
            lo = verified - k * cr
            hi = min(committed, (k + 1) * cr) - k * cr
            try:
                fm, raw = mel.id.read_direct_chunk((k * cr,) + tail, out=chunk)
            except TypeError:  # an h5py without out=
                fm, raw = mel.id.read_direct_chunk((k * cr,) + tail)
                chunk[:] = raw
            if fm != 0 or len(raw) != cb:
                return f"chunk {k} is not stored raw"
            whole = lo == 0 and hi == cr
            part = chunk if whole else chunk[lo * rb: hi * rb]
            known = k - base < len(addrs)
            guess = addrs[k - base] if known else addrs[-1] + cb
            found = False
            view = memoryview(part)
            if view[1:] != view[:-1]:  # (not one byte value throughout; stops at the first)
                if whole:
                    found = os.preadv(self.fd, [there], guess) == cb and there == chunk
                else:
                    found = os.pread(self.fd, len(part), guess + lo * rb) == part
                if not found and not known:
                    at = self._search(bytes(part), guess + lo * rb, lo * rb)
                    found = at >= 0
                    guess = at if found else guess
            if not found:
                info = mel.id.get_chunk_info_by_coord((k * cr,) + tail)
                self.lookups += 1
                if info.byte_offset is None or info.filter_mask != 0 or info.size != cb:
                    return f"chunk {info} is not stored raw"
                guess = int(info.byte_offset)
                if os.pread(self.fd, len(part), guess + lo * rb) != part:
                    return "raw chunk bytes differ from h5py's reads"
            if known:
                if guess != addrs[k - base]:  # (a guess that matched by chance before)
                    return f"chunk {k} is not where it was thought to be"
            else:
                addrs.append(guess)
            verified = k * cr + hi
            k += 1
        self._append_addresses(addrs[have - base:])
        self.verified_rows = verified
        return None

    def _search(self, part, start, skip, window=1 << 20):
        """The address of the chunk whose bytes from `skip` on are `part`, looked for in the
        `window` bytes of the file after `start` (HDF5 puts some metadata between chunks now
        and then), at the alignment all chunks share; -1 when not found there."""
        win = os.pread(self.fd, window + len(part), start)
        align = self.block or 1
        head = part[:256]
        pos = win.find(head)
        while pos >= 0:
            addr = start + pos - skip
            if addr % align == 0 and win[pos:pos + len(part)] == part:
                return addr
            pos = win.find(head, pos + 1)
        return -1

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
        _refresh(mel)
        cr = mel.chunks[0]
        nbytes = cr * self.rb
        tail = (0,) * (len(mel.shape) - 1)
        out = np.empty(max(0, end - first), np.int64)
        if out.size == 0:
            return out, None
        bad = []
        if hasattr(mel.id, "chunk_iter") and end - first > 64 and end - first > 0.2 * end:
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

    def offsets(self, rows):
        cr = self.chunk_rows
        return self.chunk_addr[rows // cr] + (rows % cr) * self.rb

    def check(self, probe):
        """Rows read raw (both ways of gathering) equal h5py's reads of them."""
        if probe.size == 0:
            return None
        ref = self.f["segments_mel"][np.sort(probe)]
        offs = self.offsets(np.sort(probe))
        try:
            for block in {0, self.block}:
                raw = self.data.gather(offs, self.rb, (len(probe),) + self.row_shape,
                                       np.sort(probe) >= self.settled, block)
                if not np.array_equal(raw.view(np.uint16), ref.view(np.uint16)):
                    return "raw chunk bytes differ from h5py's reads"
        except RowsWithdrawn:
            return "a chunk lies past the end of the file"
        return None

    def gather(self, rows):
        if self.chunk_addr is None:
            return self.read_rows(rows)
        if int(rows.max()) >= len(self.chunk_addr) * self.chunk_rows:
            self.catch_up()
        # A settled row's chunk is never freed, so the file never ends before it.
        return self.data.gather(self.offsets(rows), self.rb, (len(rows),) + self.row_shape,
                                rows >= self.settled, self.block,
                                pre_pread=lambda: self._still_committed(rows))

    def _still_committed(self, rows):
        committed = self.catch_up()
        if int(rows.max()) >= committed:
            raise RowsWithdrawn(f"{self.path}: row {int(rows.max())} is no longer committed")

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
