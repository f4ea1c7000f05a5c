"""LiveDataset: ailhd's per-split outputs as a map-style dataset (ailhd docs/reading.md;
the file layout is in the README, "What comes out").

How it reads, and why:

- A snapshot (which rows are visible, their label ids) is taken by `refresh()`. It is plain
  data, pickled into DataLoader workers. `refresh()` is incremental: it reads the committed count,
  then the `valid` and `labels` columns of the committed rows (1 byte and 2 bytes a row: 0.6 MB
  at 200,000 rows, read whole because any old row may have been superseded, deleted or moved to
  another label since), and redoes only what changed: rows appended since the last refresh are
  appended to the snapshot, and only when an old row's `valid` or label changed is the visible
  list recomputed (one vectorised pass). Files stay open from one refresh to the next. In
  ailhd's HDF5 files these three are read straight from the file (the count from its object
  header, the columns from their raw chunks at the addresses of their chunk indexes), checked
  against h5py's reads when first read and for each chunk new to a column: through h5py, the
  same reads cost 2-3 ms at 200,000 rows while the service appends.
- Rows never move: a row number names the same recording for as long as the files exist. So a
  sampler hands out *keys* (`ds.keys`, `LiveSampler`): a key is an int that holds the row number,
  the label id the row had in the snapshot it was drawn from, and a tag of the files' identity.
  `ds[key]` serves that row in any process whatever that process's snapshot is: the features
  are read at the row's place in the files, the label is the key's. A worker asked for a row
  past the committed count it knows catches up by itself (it reads only the committed count and,
  for HDF5, the addresses of the chunks that are new), so the main process and the workers
  serve exactly the rows the main process drew. Plain positions (`ds[i]`, 0 <= i < len) are the
  positions of the snapshot of the process that last called `refresh()` (the trainer's main
  process, whose sampler drew them): `refresh()` publishes its snapshot as keys to a file in the
  temporary folder (8 bytes a row, written only when the snapshot changed, removed when the
  dataset goes), and a DataLoader worker maps positions through the latest one it finds there
  (one `stat` per batch), so a plain shuffled sampler gets exactly the rows and labels of the
  main process's snapshot even after rows dropped out or changed label. Without that file (it
  could not be written), a worker serves positions of its own snapshot and refreshes itself when
  asked for a position past it.
- `committed_rows` (HDF5) or `attributes.json` and the npy headers (npy) are read first, then
  the other columns: rows below the committed count are complete; rows past it are never served.
- Features are read straight from the files: for npy at `header + row * row_bytes`; for HDF5 at
  the row's chunk address plus its place in the chunk. Chunk addresses are asked from HDF5 all at
  once at the first refresh; later ones, when a chunk first shows up, are read from the file's
  own chunk index (an extensible array in ailhd's files: a few reads, where HDF5's API walks the
  whole index for each chunk), or guessed and checked in files with another index. This is used
  only when the dataset's chunks are stored raw (no filter, little-endian float16, whole rows per
  chunk), and rows read this way are checked against h5py's own reads; otherwise rows are read
  through h5py (sorted, runs of consecutive rows in one call, chunk cache off for unfiltered
  chunks so that a row costs a row and not a chunk).
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
- A committed count lower than one seen, in the same files, is waited out (up to `wait_s`): a
  disk that refuses writes can show readers a publish of `committed_rows` that it then refuses,
  so the count reads one batch lower until ailhd publishes that batch again (its rows were
  synced and recorded before; ailhd's docs/operations.md). A read of such rows (`meta()` too), a
  `refresh()` and a worker's catch-up wait for the count to come back; only past `wait_s` are the rows
  taken as withdrawn.
"""

import collections.abc
import io
import json
import mmap
import os
import secrets
import sys
import tempfile
import threading
import time
import warnings
import weakref

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

    `wait_s`: how long a read, a `refresh()` or a worker's catch-up waits when the files count
    fewer committed rows than this process has seen (a disk refusing writes shows that for a
    while; the rows come back when ailhd publishes them again) before the rows count as
    withdrawn (`RowsWithdrawn`, or a smaller snapshot for `refresh()`).
    """

    def __init__(self, output_dir, split="training", source="npy", *, hdf5_name=None, direct=True,
                 wait_s=60.0):
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
        self._wait_s = float(wait_s)
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
        # The snapshot as keys, published for this process's DataLoader workers (see the module
        # notes): the file and how much of the snapshot it holds; in a worker, what was read
        # from it and that file's stat stamp.
        self._token = secrets.token_hex(8)
        self._shared_path = None
        self._shared_n = 0  # keys in the file; the snapshot's first rows when _shared_ok
        self._shared_ok = False
        self._shared_keys = None
        self._shared_stamp = None
        self.refresh()

    # ----- the map-style dataset -----

    def __len__(self):
        return len(self._rows)

    def __getitem__(self, i):
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"LiveDataset indices are integers, not {type(i).__name__}")
        if is_key(i):
            b = self._read_keys(np.array([i], np.int64))
        else:
            b = self._read_positions(np.array([i], np.int64))
        return b.features[0], int(b.labels[0])

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
        home = None if is_key(i) else self._home_keys()
        if home is not None:
            i = int(home[_position(i, len(home))])
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
        gained = self._refresh()
        self._publish()
        return gained

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
        elif cols["committed"] < self._committed:
            cols = self._wait_for_count(files, cols)
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
            self._shared_ok = False  # not only appended: the published keys are written anew
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

    def _wait_for_count(self, files, cols):
        """The same files count fewer rows than this snapshot: wait (up to wait_s) until they
        count them again, then read the columns once more. Past wait_s the lower count stands."""
        if _wait_for_rows(files, self._committed):
            cols = files.columns()
        if cols["committed"] < self._committed:
            warnings.warn(f"{self.path}: {self._committed} rows were committed, the files now "
                          f"count {cols['committed']} (after {self._wait_s:g} s); taking the "
                          "rows past it as withdrawn", stacklevel=4)
        return cols

    def _publish(self):
        """Write this snapshot's keys for the DataLoader workers of this process (see the module
        notes), when it changed since they were last written: only the new rows' keys when rows
        were only appended (a refresh after new rows costs what they cost), else the whole
        snapshot, replaced at once. A failure only costs the workers' exactness for plain
        positions: it is warned about once, not raised."""
        n = len(self._rows)
        pid = os.getpid()
        path = os.path.join(tempfile.gettempdir(),
                            f"ailhd-reader-{pid}-{self._token}-{self.split}.keys")
        tag = _tag(self._identity)
        try:
            if path == self._shared_path and self._shared_ok and self._shared_n <= n:
                if self._shared_n < n:
                    with open(path, "ab") as f:
                        f.write(make_keys(self._rows[self._shared_n:],
                                          self._targets[self._shared_n:], tag).tobytes())
            else:
                part = f"{path}.part"
                make_keys(self._rows, self._targets, tag).tofile(part)
                os.replace(part, path)
        except (OSError, ValueError) as e:
            if self._shared_path != "failed":
                warnings.warn(f"{self.path}: cannot publish the snapshot for DataLoader workers "
                              f"({e}); they serve plain positions of their own snapshots",
                              stacklevel=3)
            self._shared_path = "failed"
            self._shared_ok = False
            return
        if self._shared_path != path:
            weakref.finalize(self, _remove_published, path, pid)
        self._shared_path = path
        self._shared_n = n
        self._shared_ok = True

    def _home_keys(self):
        """In a process other than the one whose `refresh()` made the snapshot (a DataLoader
        worker): that process's snapshot as keys, as last published; None where there is none
        (then positions are this process's own)."""
        path = self._shared_path
        if path is None or path == "failed" or os.getpid() == self._home:
            return None
        try:
            st = os.stat(path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp != self._shared_stamp:
                self._shared_keys = np.fromfile(path, np.int64)
                self._shared_stamp = stamp
        except OSError:
            return None
        return self._shared_keys

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_files"] = None
        state["_pid"] = None
        state["_shared_keys"] = None
        state["_shared_stamp"] = None
        return state

    def __repr__(self):
        return (f"LiveDataset({self.output_dir!r}, split={self.split!r}, source={self.source!r}: "
                f"{len(self)} rows of {self._row_shape}, committed {self._committed}, "
                f"{'direct' if self.direct else 'h5py'} reads)")

    def __setstate__(self, state):
        self.__dict__.update(state)
        # A copy publishes a snapshot of its own (copy.deepcopy in the same process, say).
        self._token = secrets.token_hex(8)

    def _forget(self):
        self._shared_ok = False  # other files: every key changes
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
        if i >= len(self._rows) and self._catch_up(lambda: int(i) < len(self._rows)):
            return int(i)
        return _position(i, len(self._rows))

    def _catch_up(self, done):
        """A position past this snapshot. In a process other than the one whose `refresh()` made
        it (a DataLoader worker, whose sampler drew from the main process's newer snapshot):
        refresh and look again. In that process: no (its snapshot changes only when asked)."""
        if os.getpid() == self._home:
            return False
        # The main process may have seen a count that the files show lower for a while (a disk
        # refusing writes): look again until wait_s has passed.
        def refreshed():
            self._refresh()
            return done()

        return _poll(refreshed, time.monotonic() + self._wait_s)

    def _close_files(self):
        if self._files is not None and self._pid == os.getpid():
            self._files.close()
        self._files = None

    def _new_files(self, path=None):
        if self.source == "hdf5":
            files = _Hdf5Files(path or self._h5_path, self._npy_path, self._direct_allowed)
        else:
            files = _NpyFiles(path or self._npy_path, self._h5_path)
        files.wait_s = self._wait_s
        return files

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
        home = self._home_keys()
        if home is not None and idx.size:
            n = len(home)
            if int(idx.min()) < -n or int(idx.max()) >= n:
                raise IndexError(f"index out of range for {n} rows")
            return self._read_keys(home[np.where(idx < 0, idx + n, idx)])
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


def _position(i, n):
    """Position i (negative from the end) among n, or IndexError."""
    if not -n <= i < n:
        raise IndexError(f"index {i} out of range for {n} rows")
    return int(i) + n if i < 0 else int(i)


def _remove_published(path, pid):
    """Remove a snapshot file `_publish` wrote, in the process that wrote it only (a forked
    worker inherits the finalizer)."""
    if os.getpid() == pid:
        try:
            os.remove(path)
        except OSError:
            pass


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


def _poll(attempt, deadline, give_up=lambda: False):
    """Whether attempt() succeeds before time.monotonic() reaches deadline: tried at once, then
    again after pauses of 10 ms doubling up to 250 ms, until give_up() says it never will."""
    pause = 0.01
    while not attempt():
        left = deadline - time.monotonic()
        if left <= 0 or give_up():
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.25)
    return True


def _wait_for_rows(files, need_rows):
    """Whether the files count need_rows committed rows, looking again for up to files.wait_s
    while they count fewer (ailhd publishes a batch again when a disk refused its count; files
    replaced at their path are not waited for)."""
    def counted():
        files.catch_up()
        return files.known_committed >= need_rows

    return _poll(counted, time.monotonic() + files.wait_s, lambda: not files.same_path())


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
        fd = os.open(path, os.O_RDONLY)
        try:
            return json.loads(_read_all(fd))
        except ValueError as e:
            last = e
            time.sleep(0.01)
        finally:
            _close_fd(fd)
    raise ValueError(f"{path}: not valid JSON: {last}")


def _read_all(fd):
    parts = []
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            return b"".join(parts)
        parts.append(b)


def _close_fd(fd):
    """Close a descriptor this reader opened read-only. An error from close() says nothing of
    what was read (a FUSE or network file system reports there a write of the file that failed in
    another process, the service's on a failing disk), so it is not raised."""
    try:
        os.close(fd)
    except OSError:
        pass


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


_H5O_REFRESH = None


def _refresh_attributes(f):
    """The root group's attributes as the file holds them now. A SWMR reader keeps the root
    group's object header as first read, so a label name the service appends to `labels_json`
    stays unseen, even by another h5py handle on the file in this process (HDF5 shares it);
    HDF5's H5Orefresh reads the header again. h5py offers it for datasets only, so it is taken
    from the HDF5 library h5py itself loaded. Returns the root group; False from the refresh
    (no such function, or it failed) leaves the cached attributes."""
    global _H5O_REFRESH
    root = f["/"]
    if not f.swmr_mode:
        return root
    if _H5O_REFRESH is None:
        try:
            import ctypes
            import h5py
            fn = ctypes.CDLL(h5py.h5o.__file__).H5Orefresh  # (its dependency, libhdf5)
            fn.argtypes = [ctypes.c_int64]  # hid_t since HDF5 1.10
            fn.restype = ctypes.c_int
            _H5O_REFRESH = fn
        except (OSError, AttributeError):
            _H5O_REFRESH = False
    if _H5O_REFRESH:
        from h5py._objects import phil  # (h5py's lock around HDF5 calls: threads share it)
        with phil:
            _H5O_REFRESH(root.id.id)
    return root


def _check_merge_inputs(path, f):
    """A merged file's inputs (`merged_from_json`) are there: HDF5 reads a missing source of a
    virtual dataset as zeros, which would pass for rows (all-zero features, label 0)."""
    if "merged_from_json" not in f.attrs or os.environ.get("HDF5_VDS_PREFIX"):
        return
    base = os.path.dirname(os.path.abspath(path))
    for block in _json_text(f.attrs["merged_from_json"]):
        source = os.path.normpath(os.path.join(base, block["file"]))
        if block.get("rows") and not os.path.exists(source):
            raise OutputsChanged(
                f"{source}, an input of this merge, is not there, and HDF5 would read its "
                "rows as zeros; merge again, or restore the input (see docs/scale-out.md)")


def _open_h5(h5py, path):
    """SWMR read open (works whether or not a writer is appending), as the ailhd README's h5py
    snippet opens it: `h5py.File(path, "r", libver="latest", swmr=True)`, HDF5's default file
    locking included, so the two can share the file in one process in either order (HDF5 keeps
    one open file per process and refuses a second open with other locking settings). The
    service opens its files without locks, so a reader's shared lock never stops it. Retried
    for a moment: the service may be between creating a file and starting SWMR."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file (is outputs.hdf5 on, and is this ailhd's "
                                "paths.output? hdf5_name= names a file of outputs.hdf5_names)")
    # HDF5 keeps one open file per process: when this process already holds the file with other
    # settings (plain, or without file locking), open it the way it is already open. A plain
    # open sees what that handle sees, not later appends. Without locking, too, where the file
    # system refuses locks.
    # No chunk cache: ailhd's chunks are stored raw, and HDF5 reads a raw chunk bigger than the
    # cache in part, straight from the file, so a random row costs a row and not its whole chunk
    # (h5py's default 1 MiB cache made a row of 1 MiB chunks cost 1 MiB; benches/reader.py).
    ways = [dict(libver="latest", swmr=True), dict(libver="latest", swmr=True, locking=False),
            {}, dict(locking=False)]
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
                if ("not the same" in text or "don't match" in text or "do not match" in text
                        or "lock" in text):
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
            _close_fd(fd)
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
        _close_fd(fd)


class _NpyFiles:
    """One process's view of `npy/<split>/`: segments_mel.npy open for gathers; the other
    columns read with pread when needed."""

    wait_s = 0.0  # (set by LiveDataset: see _wait_for_rows)

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
            _close_fd(self.fd)
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
        if need_rows > self.known_committed and not _wait_for_rows(self, need_rows):
            raise RowsWithdrawn(
                f"{self.path}: row {need_rows - 1} asked for, but the files commit only "
                f"{self.known_committed} rows after {self.wait_s:g} s (were rows taken back "
                "after a crash?)")

    def gather(self, rows):
        offs = self.header_len + rows * self.row_bytes
        return self.data.gather(offs, self.row_bytes, (len(rows),) + self.row_shape,
                                rows >= self.settled, pre_pread=lambda: self._still_committed(rows))

    def _still_committed(self, rows):
        if not _wait_for_rows(self, int(rows.max()) + 1):
            raise RowsWithdrawn(f"{self.path}: row {int(rows.max())} is no longer committed")

    def meta(self, row):
        """Row `row` of each metadata column; a column whose header counts fewer rows (a
        publish a failing disk refused) is read again for up to wait_s (see _wait_for_rows)."""
        out = {}
        deadline = time.monotonic() + self.wait_s
        for c in META_COLUMNS:
            read = []

            def one():
                read[:] = _npy_read_rows(os.path.join(self.path, c + ".npy"), row, 1)
                return len(read[0]) == 1

            if not _poll(one, deadline, lambda: not self.same_path()):
                raise RowsWithdrawn(f"{self.path}/{c}.npy: no row {row} (holds {read[1]})")
            out[c] = read[0][0]
        return out


def _ohdr_messages(fd, ohdr_addr):
    """(type, body) of every message of an object header of version 2 (chunk 0 and its
    continuations), read until two reads of chunk 0 agree (a writer may be rewriting it)."""
    last = None
    for _ in range(20):
        head = os.pread(fd, 64, ohdr_addr)
        if head[:4] != b"OHDR" or head[4] != 2:
            raise ValueError("object header is not of version 2")
        flags = head[5]
        at = 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
        width = 1 << (flags & 3)
        size = int.from_bytes(head[at:at + width], "little")
        raw = os.pread(fd, at + width + size, ohdr_addr)
        if raw == last:
            break
        last = raw
    else:
        raise ValueError("the object header keeps changing")
    order = 2 if flags & 0x04 else 0
    blocks = [raw[at + width:]]
    out = []
    while blocks and len(out) < 4096:
        raw = blocks.pop(0)
        pos = 0
        while pos + 4 + order <= len(raw):
            mtype, msize = raw[pos], int.from_bytes(raw[pos + 1:pos + 3], "little")
            body = raw[pos + 4 + order:pos + 4 + order + msize]
            pos += 4 + order + msize
            if mtype == 0x10:  # continuation: an OCHK block (past its signature, checksum)
                addr, length = int.from_bytes(body[:8], "little"), \
                    int.from_bytes(body[8:16], "little")
                blocks.append(os.pread(fd, length - 8, addr + 4))
            else:
                out.append((mtype, body))
    return out


def _layout_message(fd, ohdr_addr):
    for mtype, body in _ohdr_messages(fd, ohdr_addr):
        if mtype == 0x08:
            return body
    raise ValueError("no layout message found")


class _RawColumn:
    """A 1-D chunked column (`valid`, `labels`) read straight from its raw chunks, at the
    addresses its chunk index (an _EaIndex) gives; chunks are told apart by HDF5 once, when
    first seen (checked against h5py's read of their rows by the caller)."""

    def __init__(self, fd, dset):
        if len(dset.shape) != 1 or dset.chunks is None or \
                dset.id.get_create_plist().get_nfilters() != 0:
            raise ValueError(f"{dset.name}: not a 1-D column of raw chunks")
        self.dtype = np.dtype(dset.dtype).newbyteorder("<")
        if dset.dtype.kind not in "iub" or dset.dtype.byteorder == ">":
            raise ValueError(f"{dset.name}: dtype {dset.dtype}")
        self.fd = fd
        self.name = dset.name
        self.cr = dset.chunks[0]
        self.index = _EaIndex(fd, _ohdr_addr(dset))
        self.addr = np.empty(0, np.int64)

    def read(self, rows):
        """(the column's first `rows` values, the first row of the chunks new to it)."""
        need = -(-rows // self.cr)
        have = min(len(self.addr), need)
        self.addr = self.addr[:need]  # (rows taken back: their chunks may be freed)
        if need > have:
            new = self.index.addresses(have, need)
            if new.min() <= 0 or int(new.max()) + self.cr * self.dtype.itemsize > \
                    os.fstat(self.fd).st_size:
                raise ValueError(f"{self.name}: the index names chunks outside the file")
            self.addr = np.concatenate([self.addr, new])
        cb = self.cr * self.dtype.itemsize
        fd, pread = self.fd, os.pread
        raw = b"".join([pread(fd, cb, a) for a in self.addr.tolist()])
        if len(raw) != need * cb:
            raise ValueError(f"{self.name}: a chunk lies past the end of the file")
        return np.frombuffer(raw, self.dtype, rows), have * self.cr


def _ohdr_addr(dset):
    """The address of a dataset's object header (AttributeError where h5py does not tell)."""
    import h5py

    return h5py.h5o.get_info(dset.id).addr


_UNDEF = (1 << 64) - 1


class _EaIndex:
    """Chunk addresses read from the file's own chunk index, where it is an extensible array
    (HDF5 1.10 format, one unlimited dimension: what ailhd writes), as HDF5 itself finds them
    (H5EA__lookup_elmt): the array's header, its index block, a super block and a data block
    (page). HDF5's API tells a chunk's address only by walking the whole index (4 ms a chunk at
    34,000 chunks), this a few reads. Raw (unfiltered) chunks of 8-byte addresses and 8-byte
    lengths only; anything else raises ValueError (the caller then guesses and checks, as
    before). What it returns is checked by the caller against HDF5's reads."""

    def __init__(self, fd, ohdr_addr):
        self.fd = fd
        self.addr = self._layout_index(ohdr_addr)
        hdr = os.pread(fd, 72, self.addr)
        if len(hdr) != 72 or hdr[:4] != b"EAHD" or hdr[4] != 0:
            raise ValueError("no extensible array header at the layout's index address")
        cls, esize, max_bits, self.iblk_elmts, self.dmin, smin, page_bits = hdr[5:12]
        if cls != 0 or esize != 8:  # (class 0: chunks without filters, one address each)
            raise ValueError(f"extensible array of class {cls}, elements of {esize} bytes")
        self.iblock = int.from_bytes(hdr[60:68], "little")
        self.page_n = 1 << page_bits
        self.off_size = (max_bits + 7) // 8
        nsblks = 1 + max_bits - (self.dmin.bit_length() - 1)
        self.sblk = []  # per super block: (data blocks, elements per data block, first element)
        start = 0
        for u in range(nsblks):
            nd, nel = 1 << (u // 2), (1 << ((u + 1) // 2)) * self.dmin
            self.sblk.append((nd, nel, start))
            start += nd * nel
        self.ib_nsblks = 2 * (smin.bit_length() - 1)
        self.ib_ndblks = 2 * (smin - 1)
        self.ib_nsblk_addrs = nsblks - self.ib_nsblks

    def _layout_index(self, ohdr_addr):
        """The index address in the dataset's layout message (object header version 2)."""
        body = _layout_message(self.fd, ohdr_addr)
        if body[0] != 4 or body[1] != 2:
            raise ValueError(f"layout message version {body[0]}, class {body[1]}")
        at = 5 + body[3] * body[4]
        if body[at] != 4:
            raise ValueError(f"chunk index of type {body[at]}, not an extensible array")
        return int.from_bytes(body[at + 6:at + 14], "little")

    def addresses(self, first, end):
        """Addresses of chunks first..end (int64 array); ValueError when one is not there."""
        fd, pread = self.fd, os.pread
        ib_size = 14 + 8 * (self.iblk_elmts + self.ib_ndblks + self.ib_nsblk_addrs) + 4
        ib = pread(fd, ib_size, self.iblock)
        if len(ib) != ib_size or ib[:4] != b"EAIB":
            raise ValueError("no extensible array index block")
        ib_elmts = np.frombuffer(ib, "<u8", self.iblk_elmts, 14)
        ib_dblks = np.frombuffer(ib, "<u8", self.ib_ndblks, 14 + 8 * self.iblk_elmts)
        ib_sblks = np.frombuffer(ib, "<u8", self.ib_nsblk_addrs,
                                 14 + 8 * (self.iblk_elmts + self.ib_ndblks))
        parts = []
        idx = first
        while idx < end:
            if idx < self.iblk_elmts:
                n = min(end, self.iblk_elmts) - idx
                parts.append(ib_elmts[idx:idx + n])
                idx += n
                continue
            j = idx - self.iblk_elmts
            s = (j // self.dmin + 1).bit_length() - 1
            nd, nel, start = self.sblk[s]
            e = j - start
            if s < self.ib_nsblks:
                dblk = int(ib_dblks[sum(self.sblk[u][0] for u in range(s)) + e // nel])
            else:
                sb_addr = int(ib_sblks[s - self.ib_nsblks])
                if sb_addr == _UNDEF:
                    raise ValueError(f"chunk {idx}: no super block {s}")
                npages = nel // self.page_n if nel > self.page_n else 0
                bitmaps = nd * ((npages + 7) // 8) if npages else 0
                sb_pre = 14 + self.off_size + bitmaps
                sb = pread(fd, sb_pre + 8 * nd, sb_addr)
                if sb[:4] != b"EASB" or len(sb) != sb_pre + 8 * nd:
                    raise ValueError(f"chunk {idx}: no super block at {sb_addr}")
                dblk = int.from_bytes(sb[sb_pre + 8 * (e // nel):sb_pre + 8 * (e // nel) + 8],
                                      "little")
            if dblk == _UNDEF:
                raise ValueError(f"chunk {idx}: no data block")
            e %= nel
            if nel > self.page_n:  # paged: a prefix (with its checksum), then pages
                page, e = divmod(e, self.page_n)
                at = dblk + 18 + self.off_size + page * (8 * self.page_n + 4) + 8 * e
                n = min(end - idx, self.page_n - e)
            else:
                at = dblk + 14 + self.off_size + 8 * e
                n = min(end - idx, nel - e)
                if e == 0 or idx == first:
                    if pread(fd, 4, dblk) != b"EADB":
                        raise ValueError(f"chunk {idx}: no data block at {dblk}")
            raw = pread(fd, 8 * n, at)
            if len(raw) != 8 * n:
                raise ValueError(f"chunk {idx}: the index lies past the end of the file")
            parts.append(np.frombuffer(raw, "<u8"))
            idx += n
        out = np.concatenate(parts) if parts else np.empty(0, np.uint64)
        if (out == _UNDEF).any():
            raise ValueError("a chunk below committed_rows has no address")
        return out.astype(np.int64)


class _Hdf5Files:
    """One process's view of a split's HDF5 file: an h5py SWMR handle, and a descriptor of the
    same file for direct reads of features."""

    wait_s = 0.0  # (set by LiveDataset: see _wait_for_rows)

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
        self.mel = None  # segments_mel, from columns() to layout() (see _extend_chunks)
        self.index = None  # _EaIndex of segments_mel's chunks; False: none (guess and check)
        self._uniform = False  # (what _check_whole last saw: bytes of one value throughout)
        self.names_checked = False
        self.names = None  # labels_json, as last read
        # committed_rows, valid, labels read straight from the file (their object headers and
        # chunk indexes: 0.1 ms where h5py took 2-3 ms while the service appends); None: not
        # set up yet, False: read through h5py.
        self.raw = None
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
            _close_fd(self.fd)
            self.fd = None
        if self.f is not None:
            try:
                self.f.close()
            except Exception:
                pass
            self.f = None

    def _committed(self):
        if self.raw:
            try:
                return self._raw_committed()
            except (ValueError, OSError):
                self.raw = False
        c = self.f["committed_rows"]
        _refresh(c)
        return int(c[0])

    def _raw_committed(self):
        """committed_rows from its dataset's object header (compact layout: the value lives in
        the layout message), read until two reads agree."""
        body = _layout_message(self.fd, self.raw["committed_rows"])
        if body[0] not in (3, 4) or body[1] != 0 or int.from_bytes(body[2:4], "little") != 8:
            raise ValueError("committed_rows is no longer one compact int64")
        return int.from_bytes(body[4:12], "little", signed=True)

    def _raw_setup(self, committed, valid, labels):
        """What refresh() needs to read committed_rows, valid and labels straight from the file
        (a dict), checked against h5py's reads of them; False when it cannot."""
        try:
            f = self.f
            c = f["committed_rows"]
            if c.id.get_create_plist().get_layout() != self._h5py.h5d.COMPACT or \
                    c.dtype != np.dtype("<i8"):
                return False
            raw = {"committed_rows": _ohdr_addr(c)}
            self.raw = raw
            if self._raw_committed() != committed:
                return False
            for name, want in (("valid", valid), ("labels", labels)):
                col = raw[name] = _RawColumn(self.fd, f[name])
                got, _ = col.read(committed)
                if not np.array_equal(got, want):
                    return False
            return raw
        except Exception:  # (other layouts, index types, an older h5py: read through h5py)
            return False
        finally:
            self.raw = None

    def _raw_columns(self):
        """(committed, valid, labels) read straight from the file; the rows of chunks new to
        a column checked against h5py's read of them."""
        committed = self._raw_committed()
        out = [committed]
        for name in ("valid", "labels"):
            col = self.raw[name]
            values, new_from = col.read(committed)
            if new_from < committed:
                d = self.f[name]
                _refresh(d)
                if not np.array_equal(d[new_from:committed], values[new_from:]):
                    raise ValueError(f"{name}: raw chunks differ from h5py's reads")
            out.append(values)
        return out

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
            if not self.names_checked:
                for name in ("committed_rows", "segments_mel", "labels", "valid"):
                    if name not in f:
                        raise ValueError(f"{self.path}: no dataset {name!r}; not an ailhd output")
                _check_merge_inputs(self.path, f)
                self.names_checked = True
            got = None
            if self.raw:
                try:
                    got = self._raw_columns()
                except ValueError:
                    self.raw = False  # (from now on through h5py)
            if got is not None:
                committed, valid, labels = got
            else:
                # Each dataset looked up once (60-200 us each while the service appends).
                committed = self._committed()
                mel, labels, valid = f["segments_mel"], f["labels"], f["valid"]
                self.mel = mel  # (for layout(), which comes next; not kept past it)
                for d in (mel, labels, valid):
                    _refresh(d)
                rows = min(d.shape[0] for d in (mel, labels, valid))
                if rows < committed:
                    raise ValueError(f"{self.path}: committed_rows says {committed} but the "
                                     f"datasets hold {rows} rows")
                if mel.dtype != np.float16:
                    raise ValueError(f"{self.path}: segments_mel is {mel.dtype}, expected "
                                     "float16")
                valid = valid[:committed]
                labels = labels[:committed]
                self.row_shape = tuple(mel.shape[1:])
                if self.raw is None:
                    self.raw = self._raw_setup(committed, valid, labels)
            if self.names is None or (len(labels) and int(labels.max()) >= len(self.names)):
                # (Names are only ever appended: read again when a row has a label id past them.)
                self.names = _json_text(f.attrs["labels_json"])
                if len(labels) and int(labels.max()) >= len(self.names):
                    self.names = _json_text(_refresh_attributes(f).attrs["labels_json"])
        except (KeyError, OSError, RuntimeError) as e:
            self.broken = True
            raise OutputsChanged(f"{self.path}: {e}") from e
        self.rb = int(np.prod(self.row_shape)) * 2
        self.known_committed = committed
        self._settle()
        return {"committed": committed, "valid": valid, "labels": labels.astype(np.int16),
                "names": list(self.names), "row_shape": self.row_shape}

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
        mel, self.mel = self.mel, None
        if known is False:
            self.chunk_addr = None
            return None
        why = None
        first_time = self.chunk_addr is None
        if first_time:
            mel = None  # (one handle of the dataset open at a time: see _extend_chunks)
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
            why = self._extend_chunks(committed, mel)
        if why is None and first_time and len(rows):
            # Rows read raw, both ways of gathering, against h5py's reads of them.
            why = self.check(np.unique(rows[[0, len(rows) // 2, -1]]))
        if why is None:
            return {"chunk_rows": self.chunk_rows, "chunk_addr": self.chunk_addr.copy(),
                    "block": self.block, "committed": committed, "row_shape": self.row_shape,
                    "verified": self.verified_rows}
        self.chunk_addr = None
        if not self.f["segments_mel"].is_virtual:
            # (A merge's rows are read through h5py by design: no warning for those.)
            warnings.warn(f"{self.path}: reading segments_mel through h5py ({why})",
                          stacklevel=4)
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

    #: Bytes at the start of each new row that HDF5 reads for the check of a chunk's address (the
    #: row's first long windows; a whole row when rows are smaller).
    HEAD_BYTES = 256

    def _extend_chunks(self, committed, mel=None):
        """Addresses of the chunks that hold rows committed since the last call.

        When many chunks are new (the first refresh), HDF5 is asked for all of them in one pass
        (`chunk_iter`). Otherwise they are read from the file's chunk index where it is an
        extensible array, as ailhd's files have (`_EaIndex`, checked against every address
        HDF5 gave before; `_extend_from_index`). Where it is not (files of other writers),
        they are guessed and checked, since HDF5 tells one chunk's address only by walking its
        whole index (4 ms per chunk at the end of a 34,000-chunk dataset, HDF5 2.0): a chunk is
        guessed to follow the previous one in the file (as HDF5 allocates them while rows are
        appended), and the guess is kept when the first bytes (`HEAD_BYTES`) of the chunk's
        first and last new rows there equal HDF5's read of them (one read of the heads of all
        new rows: HDF5 finds each chunk through its index directly). Otherwise the chunk is
        looked for in the next MiB of the file (HDF5 puts metadata between chunks now and then),
        at the alignment all chunks share, and only then HDF5 is asked. A chunk whose heads do
        not tell rows apart (one value throughout, or its first and last new rows alike:
        silence, padding) is checked whole against HDF5's read of the chunk
        (`read_direct_chunk`) instead, and HDF5 is asked for its address when it is one byte
        value throughout. Rows committed later into a chunk already known are checked the same
        way."""
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
        # (Dataset handles are not kept from one refresh to the next: with two handles of a
        # dataset open in one process, HDF5 2.0 fails reads of rows appended since ("can't insert
        # duplicate key"), and two LiveDatasets of one file in a process would hold two.)
        if mel is None:
            mel = self.f["segments_mel"]
            _refresh(mel)
        if self.index is None:
            self.index = self._read_index(mel)
        if self.index:
            why = self._extend_from_index(mel, committed, have, need)
            if why is None:
                return None
            warnings.warn(f"{self.path}: chunk index not understood ({why}); chunk addresses are "
                          "guessed and checked instead", stacklevel=5)
            self.index = False
        first = self.verified_rows
        heads, hb, why = self._heads(mel, first, committed)
        if why is not None:
            return why
        addrs = self.chunk_addr[have - 1:].tolist()  # the last known one, then new ones
        base = have - 1
        fd, pread = self.fd, os.pread
        k = first // cr
        while k < need:
            r0 = max(first, k * cr)  # the chunk's first and last rows to check
            r1 = min(committed, (k + 1) * cr) - 1
            lo, hi = r0 - k * cr, r1 - k * cr
            a = heads[(r0 - first) * hb:(r0 - first + 1) * hb]
            b = heads[(r1 - first) * hb:(r1 - first + 1) * hb]
            known = k - base < len(addrs)
            guess = addrs[k - base] if known else addrs[-1] + cb
            if a[:2] * (hb // 2) != a and b[:2] * (hb // 2) != b and (r0 == r1 or a != b):
                found = pread(fd, hb, guess + lo * rb) == a and \
                    (r0 == r1 or pread(fd, hb, guess + hi * rb) == b)
                if not found and not known:
                    at = self._search(a, b, (hi - lo) * rb, guess + lo * rb, lo * rb)
                    found = at >= 0
                    guess = at if found else guess
                why = None
            else:  # heads that cannot tell the rows apart: the whole chunk
                found, why = self._check_whole(mel, k, lo, hi + 1, guess)
            if why is None and not found:
                guess, why = self._ask_hdf5(mel, k, lo, hi + 1)
            if why is not None:
                return why
            if known:
                if guess != addrs[k - base]:  # (a guess that matched by chance before)
                    return f"chunk {k} is not where it was thought to be"
            else:
                addrs.append(guess)
            k += 1
        self._append_addresses(addrs[have - base:])
        self.verified_rows = committed
        return None

    def _read_index(self, mel):
        """segments_mel's chunk index (an _EaIndex) when this file has one it can read, checked
        against the chunk addresses known so far (HDF5's): the first 64 and the last 4,096
        (0.1 ms; all 33,000 at 200,000 rows took 1 ms, in each worker); False otherwise."""
        try:
            index = _EaIndex(self.fd, _ohdr_addr(mel))
            n = len(self.chunk_addr)
            for lo, hi in ((0, min(n, 64)), (max(0, n - 4096), n)):
                if not np.array_equal(index.addresses(lo, hi), self.chunk_addr[lo:hi]):
                    return False
            return index
        except Exception:  # (another index type, an older h5py, a file it does not understand)
            return False

    def _extend_from_index(self, mel, committed, have, need):
        """Addresses of the chunks holding rows verified_rows..committed from the file's chunk
        index (a few reads: 0.05 ms for 167 chunks, where asking HDF5 chunk by chunk took 4 ms
        each). Every address lies inside the file; the first and the last chunk, the first of
        each run of chunks that follow each other in the file (up to 8) and one chunk in 256
        have their new rows checked against HDF5's read of the chunk. None, or why not."""
        cr = self.chunk_rows
        cb = cr * self.rb
        first = self.verified_rows
        k0 = first // cr
        try:
            addr = self.index.addresses(k0, need)
        except ValueError as e:
            return str(e)
        if not np.array_equal(addr[:have - k0], self.chunk_addr[k0:have]):
            return "known chunks are elsewhere in the index"
        if addr.min() <= 0 or int(addr.max()) + cb > os.fstat(self.fd).st_size:
            return "the index names chunks outside the file"
        runs = np.flatnonzero(np.diff(addr) != cb) + 1
        for j in sorted({0, len(addr) - 1, *runs[:8].tolist(), *range(0, len(addr), 256)}):
            k = k0 + j
            lo = max(first, k * cr) - k * cr
            hi = min(committed, (k + 1) * cr) - k * cr
            found, why = self._check_whole(mel, k, lo, hi, int(addr[j]))
            if why is not None:
                return why
            if not found and self._uniform is False:
                return f"chunk {k} is not where the index says"
        self._append_addresses(addr[have - k0:])
        self.verified_rows = committed
        return None

    def _heads(self, mel, first, end):
        """HDF5's read of the first bytes of rows first..end of segments_mel, in one call:
        (bytes, bytes per row, None) or (None, 0, why)."""
        shape = mel.shape
        if len(shape) < 2:
            sel = (end - first,)
        else:
            per = self.rb // shape[1]  # bytes of one step of the second dimension
            sel = (end - first, min(shape[1], -(-self.HEAD_BYTES // per))) + tuple(shape[2:])
        try:
            space = mel.id.get_space()
            space.select_hyperslab((first,) + (0,) * (len(shape) - 1), sel)
            out = np.empty(sel, np.float16)
            mel.id.read(self._h5py.h5s.create_simple(sel), space, out)
        except Exception as e:  # (rows not allocated: not what ailhd writes)
            return None, 0, f"reading rows {first}..{end} through h5py failed: {e}"
        return out.tobytes(), out[0].nbytes if len(out) else 0, None

    def _check_whole(self, mel, k, lo, hi, guess):
        """Rows lo..hi of chunk k at `guess` against HDF5's read of the chunk: (found, why).
        Not found when those bytes are one value throughout (they would match anywhere)."""
        cr, rb = self.chunk_rows, self.rb
        tail = (0,) * (len(mel.shape) - 1)
        try:
            fm, raw = mel.id.read_direct_chunk((k * cr,) + tail)
        except Exception as e:
            return False, f"chunk {k}: {e}"
        if fm != 0 or len(raw) != cr * rb:
            return False, f"chunk {k} is not stored raw"
        part = bytes(raw[lo * rb:hi * rb])
        self._uniform = part[:1] * len(part) == part
        if self._uniform:
            return False, None
        return os.pread(self.fd, len(part), guess + lo * rb) == part, None

    def _ask_hdf5(self, mel, k, lo, hi):
        """Chunk k's address from HDF5's chunk index, and rows lo..hi there checked whole:
        (address, None) or (None, why)."""
        cr, rb = self.chunk_rows, self.rb
        tail = (0,) * (len(mel.shape) - 1)
        info = mel.id.get_chunk_info_by_coord((k * cr,) + tail)
        self.lookups += 1
        if info.byte_offset is None or info.filter_mask != 0 or info.size != cr * rb:
            return None, f"chunk {info} is not stored raw"
        addr = int(info.byte_offset)
        fm, raw = mel.id.read_direct_chunk((k * cr,) + tail)
        if fm != 0 or os.pread(self.fd, (hi - lo) * rb, addr + lo * rb) != \
                bytes(raw[lo * rb:hi * rb]):
            return None, "raw chunk bytes differ from h5py's reads"
        return addr, None

    def _search(self, a, b, gap, start, skip, window=1 << 20):
        """The address of the chunk whose row at `skip` bytes from its start begins with `a` and
        whose row `gap` bytes further begins with `b`, looked for in the `window` bytes of the
        file after `start` (HDF5 puts some metadata between chunks now and then: most often
        80 KiB), at the alignment all chunks share; -1 when not found there. With an alignment of
        at least 4 KiB (ailhd's chunks: the row size), only the aligned places are read, nearest
        first; otherwise the window is read whole and searched."""
        align = self.block or 1
        fd, pread, hb = self.fd, os.pread, len(a)
        if align >= 4096 and (start - skip) % align == 0:
            for at in range(start + align, start + window + 1, align):
                if pread(fd, hb, at) == a and (not gap or pread(fd, hb, at + gap) == b):
                    return at - skip
            return -1
        win = pread(fd, window + hb, start)
        pos = win.find(a)
        while pos >= 0:
            addr = start + pos - skip
            if addr % align == 0 and (not gap or pread(fd, hb, start + pos + gap) == b):
                return addr
            pos = win.find(a, pos + 1)
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

    _still_committed = _NpyFiles._still_committed

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
