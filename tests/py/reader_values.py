"""ailhd_reader on the outputs of `ailhd rebuild`: every split, both sources, equal to h5py's raw
reads; then on copies made to look like a writer caught mid-commit (rows past committed_rows,
rows set invalid) that only refresh() may reveal; pickling and worker processes (fork, spawn);
a replaced output; files cut short below rows a snapshot had (an error, never SIGBUS); a
committed count that dips and comes back (waited out) or stays low (withdrawn after wait_s); batch output buffers reused only when free; ailhd's HDF5 rows gathered as
whole-row blocks (its chunks are aligned to the row size), and a copy without that alignment
read by the other path (fancy indexing) with the same values; rows appended after a refresh
found in the file's chunk index (or by guessing and checking, with an older index).
usage: reader_values.py OUTPUT_DIR SCRATCH_DIR"""

import json
import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
import warnings

import h5py
import numpy as np

from ailhd_reader import LiveDataset, OutputsReplaced, RowsWithdrawn
from reader_util import SPLIT_FILES, check_dataset, fail, h5_truth, same_bits, text

GHOST = 7.0  # the value of the rows a "writer" appended past committed_rows


def read_batch(args):
    ds, idx = args
    b = ds.__getitems__(idx)
    return os.getpid(), b.features, b.labels


def all_splits(out, rng):
    seen = 0
    for split in SPLIT_FILES:
        t = h5_truth(out, split)
        for source in ("npy", "hdf5"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the direct path must be taken, not fall back
                ds = LiveDataset(out, split, source)
            if not ds.direct:
                fail(f"{split}/{source}: not reading direct")
            row_bytes = int(np.prod(t["segments_mel"].shape[1:])) * 2
            if source == "hdf5" and len(ds) and ds._block != row_bytes:
                fail(f"{split}/hdf5: rows gathered in blocks of {ds._block} bytes, not whole rows "
                     f"({row_bytes}): ailhd's chunks are no longer aligned to the row size?")
            check_dataset(ds, t, f"{split}/{source}", rng)
            seen += len(ds)
        slow = LiveDataset(out, split, "hdf5", direct=False)
        if slow.direct:
            fail("direct=False still reads direct")
        check_dataset(slow, t, f"{split}/hdf5 via h5py", rng)
        print(f"{split}: {len(t['visible'])} rows, both sources equal h5py's reads")
    if seen == 0:
        fail("no rows at all: the test tree did not produce outputs")


def workers(out, rng):
    """Pickled datasets read in fork and spawn worker processes (as DataLoader workers do)."""
    t = h5_truth(out, "training")
    for source in ("npy", "hdf5"):
        ds = LiveDataset(out, "training", source)
        ds[0]  # files open in this process: a fork must not use them
        clone = pickle.loads(pickle.dumps(ds))
        check_dataset(clone, t, f"unpickled {source}", rng, full=False)
        jobs = [(ds, rng.choice(len(ds), min(len(ds), 7), replace=False).tolist()) for _ in range(6)]
        for method in ("fork", "spawn"):
            with mp.get_context(method).Pool(2) as pool:
                res = pool.map(read_batch, jobs)
            pids = {pid for pid, _, _ in res}
            if os.getpid() in pids:
                fail(f"{method}: work ran in the main process")
            for (pid, feats, labels), (_, idx) in zip(res, jobs):
                rows = t["visible"][idx]
                if not same_bits(feats, t["segments_mel"][rows]) or not np.array_equal(
                        labels, t["labels"][rows]):
                    fail(f"{source} in a {method} worker: rows {rows} differ from h5py's")
        print(f"{source}: pickled, fork and spawn workers read the same rows")


def npy_set_rows(path, rows):
    """Rewrite the row count in an npy header in place (as ailhd's commit does)."""
    with open(path, "r+b") as fh:
        raw = fh.read(4096)
        hl = 10 + int.from_bytes(raw[8:10], "little")
        head = raw[10:hl].decode("latin1")
        start = head.index("'shape': (") + len("'shape': (")
        end = start + len(head[start:].split(",")[0].split(")")[0])
        new = head[:start] + str(rows) + head[end:]
        new = new.rstrip() + " " * (len(head) - len(new.rstrip()) - 1) + "\n"
        assert len(new) == len(head)
        fh.seek(10)
        fh.write(new.encode("latin1"))


def in_child(fn, *args):
    """Run fn(*args) in another process: HDF5 lets no process write a file it holds open for
    reading, and the writer is another process anyway. The writers here stand in for ailhd and
    open the files as it does, without file locking: the readers hold shared locks (h5py's
    default, as the README's snippet opens the files)."""
    p = mp.get_context("spawn").Process(target=fn, args=args)
    p.start()
    p.join()
    if p.exitcode != 0:
        fail(f"{fn.__name__}{args} failed in a child process")


def h5_append_ghosts(path):
    with h5py.File(path, "r+", locking=False) as f:
        n = int(f["committed_rows"][0])
        for name, ds in f.items():
            if name == "committed_rows":
                continue
            ds.resize(n + 3, axis=0)
            if name == "segments_mel":
                ds[n:] = np.full((3,) + ds.shape[1:], GHOST, np.float16)
            elif name == "valid":
                ds[n:] = 1
            elif name in ("source_path", "sensor_id", "recording_id"):
                ds[n:] = [b"ghost"] * 3


def h5_invalidate(path, rows):
    with h5py.File(path, "r+", locking=False) as f:
        for r in rows:
            f["valid"][r] = 0


def h5_commit(path, n):
    with h5py.File(path, "r+", locking=False) as f:
        f["committed_rows"][0] = n


def mid_commit_hdf5(out, scratch, rng):
    """A file with 3 rows written past committed_rows, then 2 rows set invalid, then committed."""
    d = os.path.join(scratch, "h5copy")
    os.makedirs(d)
    path = os.path.join(d, SPLIT_FILES["training"])
    shutil.copy(os.path.join(out, SPLIT_FILES["training"]), path)
    n = h5_truth(d, "training")["committed"]
    in_child(h5_append_ghosts, path)
    ds = {s: LiveDataset(d, "training", "hdf5", direct=(s == "direct")) for s in ("direct", "h5py")}
    for k, v in ds.items():
        if len(v) != n or v.rows.max() >= n:
            fail(f"hdf5 {k}: rows past committed_rows ({n}) are served: len {len(v)}")
        check_dataset(v, h5_truth(d, "training"), f"hdf5 {k} with uncommitted rows", rng, full=False)
    gone = sorted(rng.choice(n, 2, replace=False).tolist())
    in_child(h5_invalidate, path, gone)
    for k, v in ds.items():
        got = v.refresh()
        if got != 0 or len(v) != n - 2 or set(gone) & set(v.rows.tolist()):
            fail(f"hdf5 {k}: after 2 rows went invalid: refresh {got}, len {len(v)}, rows {gone} "
                 "still served?")
    in_child(h5_commit, path, n + 3)
    for k, v in ds.items():
        got = v.refresh()
        if got != 3 or len(v) != n + 1:
            fail(f"hdf5 {k}: after committing 3 rows refresh() = {got}, len {len(v)} (want 3, {n + 1})")
        x, _ = v[-1]
        if not np.all(x == GHOST) or v.meta(-1)["source_path"] != "ghost":
            fail(f"hdf5 {k}: the newly committed last row is not the one written")
        check_dataset(v, h5_truth(d, "training"), f"hdf5 {k} after commit", rng, full=False)
    print("hdf5: rows past committed_rows hidden until committed; invalid rows drop out on refresh")


def mid_commit_npy(out, scratch, rng):
    d = os.path.join(scratch, "npycopy")
    src = os.path.join(out, "npy", "training")
    dst = os.path.join(d, "npy", "training")
    shutil.copytree(src, dst)
    attrs_path = os.path.join(dst, "attributes.json")
    attrs = json.load(open(attrs_path))
    n = int(attrs["committed_rows"])
    # Rows appended past the headers' count (the writer's positional writes before a commit).
    for name in os.listdir(dst):
        if not name.endswith(".npy"):
            continue
        arr = np.load(os.path.join(dst, name), mmap_mode="r")
        row = np.full(arr.shape[1:], GHOST, arr.dtype) if name == "segments_mel.npy" else \
            np.ones(arr.shape[1:], arr.dtype)
        with open(os.path.join(dst, name), "ab") as fh:
            fh.write(np.stack([row] * 3).tobytes())
    ds = LiveDataset(d, "training", "npy")
    if len(ds) != n:
        fail(f"npy: rows past the header count served: len {len(ds)}, committed {n}")
    # Headers say n + 3 but attributes.json (written last by a commit) still n: not yet.
    for name in os.listdir(dst):
        if name.endswith(".npy"):
            npy_set_rows(os.path.join(dst, name), n + 3)
    if ds.refresh() != 0 or len(ds) != n:
        fail("npy: rows served before attributes.json's committed_rows covers them")
    valid = np.load(os.path.join(dst, "valid.npy"), mmap_mode="r+")
    gone = sorted(rng.choice(n, 2, replace=False).tolist())
    valid[gone] = 0
    valid.flush()
    del valid
    got = ds.refresh()
    if got != 0 or len(ds) != n - 2 or set(gone) & set(ds.rows.tolist()):
        fail(f"npy: after 2 rows went invalid: refresh {got}, len {len(ds)}")
    attrs["committed_rows"] = n + 3
    json.dump(attrs, open(attrs_path, "w"))
    got = ds.refresh()
    if got != 3 or len(ds) != n + 1 or not np.all(ds[-1][0] == GHOST):
        fail(f"npy: after commit refresh() = {got}, len {len(ds)}")
    print("npy: rows past the committed count hidden until committed; invalid rows drop out")


def replaced(out, scratch, rng):
    """A rebuild replaces the files: a stale pickled snapshot says so, refresh() starts over."""
    d = os.path.join(scratch, "replaced")
    os.makedirs(d)
    path = os.path.join(d, SPLIT_FILES["training"])
    shutil.copy(os.path.join(out, SPLIT_FILES["training"]), path)
    shutil.copytree(os.path.join(out, "npy"), os.path.join(d, "npy"))
    for source in ("hdf5", "npy"):
        ds = LiveDataset(d, "training", source)
        blob = pickle.dumps(ds)
        if source == "hdf5":
            shutil.copy(path, path + ".new")
            os.replace(path + ".new", path)
        else:
            p = os.path.join(d, "npy", "training")
            shutil.copytree(p, p + ".new")
            shutil.rmtree(p)
            os.replace(p + ".new", p)
        stale = pickle.loads(blob)
        try:
            stale[0]
        except OutputsReplaced as e:
            print(f"{source}: stale snapshot refused: {e}")
        else:
            fail(f"{source}: a snapshot of replaced files still served rows")
        if ds.refresh() != len(ds) or len(ds) == 0:
            fail(f"{source}: refresh() after a replacement did not start over")
        check_dataset(ds, h5_truth(d, "training"), f"{source} after replacement", rng, full=False)


def cut_short(out, scratch, rng):
    """Files cut short below rows a snapshot saw committed (what a writer taking rows back after a
    crash does): reading those rows raises RowsWithdrawn, by positions and by keys, from the map
    and from the pread path alike; never SIGBUS (which would kill this process)."""
    d = os.path.join(scratch, "cut")
    os.makedirs(d)
    shutil.copy(os.path.join(out, SPLIT_FILES["training"]), os.path.join(d, SPLIT_FILES["training"]))
    shutil.copytree(os.path.join(out, "npy"), os.path.join(d, "npy"))
    for source in ("npy", "hdf5"):
        for how in ("map", "pread"):
            ds = LiveDataset(d, "training", source)
            n = len(ds)
            keys = ds.keys
            ds[n - 1]  # files open, rows known
            files = ds._files
            path = files.mel_path if source == "npy" else files.path
            size = os.path.getsize(path)
            backup = path + ".bak"
            shutil.copy(path, backup)
            last = int(ds.rows[-1])
            offs = (files.header_len + last * files.row_bytes if source == "npy"
                    else int(files.offsets(np.array([last]))[0]))
            os.truncate(path, offs)
            for what, read in (("position", lambda: ds[n - 1]),
                               ("key", lambda: ds[int(keys[-1])]),
                               ("batch", lambda: ds.__getitems__(list(range(n))))):
                if how == "pread":
                    files.settled = 0  # (a pread re-reads the counts, which settles them again)
                try:
                    read()
                except RowsWithdrawn as e:
                    print(f"{source}, {how}: {what} past the cut refused: {e}")
                else:
                    fail(f"{source}, {how}: a {what} past the end of a cut file was served")
            ok = ds.__getitems__([0])  # rows before the cut are still served
            if not same_bits(ok.features, h5_truth(out, "training")["segments_mel"][ds.rows[:1]]):
                fail(f"{source}, {how}: row 0 differs after the cut")
            files.close()
            ds._files = None
            os.replace(backup, path)
            assert os.path.getsize(path) == size


def set_committed(d, source, rows):
    """Make the copy's files count `rows` committed rows, as a reader sees a count refused by a
    failing disk (npy: attributes.json; HDF5: committed_rows, written by another process without
    HDF5's locks, as the service writes it)."""
    if source == "npy":
        path = os.path.join(d, "npy", "training", "attributes.json")
        attrs = json.load(open(path))
        attrs["committed_rows"] = rows
        with open(path + ".tmp", "w") as fh:
            json.dump(attrs, fh)
        os.replace(path + ".tmp", path)
        return
    code = ("import h5py, sys\n"
            "with h5py.File(sys.argv[1], 'r+', locking=False) as f:\n"
            "    f['committed_rows'][0] = int(sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", code, os.path.join(d, SPLIT_FILES["training"]),
                    str(rows)], check=True)


def later(seconds, what):
    """Run what() after `seconds` on a thread; returns the thread."""
    t = threading.Timer(seconds, what)
    t.start()
    return t


def timed(what):
    t0 = time.monotonic()
    return what(), time.monotonic() - t0


def read_item(args):
    ds, i = args
    return ds[i][0]


_HELD = None


def _hold(ds):
    global _HELD
    _HELD = ds


def held_item(i):
    return _HELD[i][0]


def in_held_worker(ds, i, then, seconds, dip):
    """A persistent DataLoader worker: a forked process that keeps ds as it was when it started
    (and has read from it), while the main process refreshes ds once then() has restored the
    count (the sampler's refresh) and dip() lowers it again; then ds[i], a position of the main
    process's newer snapshot, read in the worker while then() runs on a thread after `seconds`.
    Returns (features, seconds the read took)."""
    with mp.get_context("fork").Pool(1, initializer=_hold, initargs=(ds,)) as pool:
        pool.apply(held_item, (0,))
        then()
        ds.refresh()
        dip()
        timer = later(seconds, then)
        got, took = timed(lambda: pool.apply(held_item, (i,)))
        timer.join()
    return got, took


def in_worker(ds, i, then, seconds):
    """ds[i]'s features read in a forked worker process (its own files, opened there), while
    then() runs on a thread after `seconds`; returns (features, seconds the read took)."""
    timer = later(seconds, then)
    with mp.get_context("fork").Pool(1) as pool:
        pool.map(len, [[]])  # (the worker is up: time only the read)
        got, took = timed(lambda: pool.map(read_item, [(ds, i)])[0])
    timer.join()
    return got, took


def count_dip(out, scratch, rng):
    """A committed count that reads lower than one seen, in the same files (a disk refusing writes
    shows a reader a publish it then refuses, until the service publishes that batch again): a
    read of rows past it waits for it to come back, by key and by position, in a worker that opens
    the files during the dip and in one whose snapshot is older than the sampler's; refresh() and
    npy's meta() wait too, and the snapshot does not shrink. A count that stays lower past `wait_s` raises RowsWithdrawn (refresh(): a
    smaller snapshot, with a warning)."""
    d = os.path.join(scratch, "dip")
    os.makedirs(d)
    shutil.copy(os.path.join(out, SPLIT_FILES["training"]), os.path.join(d, SPLIT_FILES["training"]))
    shutil.copytree(os.path.join(out, "npy"), os.path.join(d, "npy"))
    t = h5_truth(out, "training")
    n_rows = t["committed"]
    back = 1.0  # the count comes back after this long
    for source in ("npy", "hdf5"):
        ds = LiveDataset(d, "training", source, wait_s=30)
        n = len(ds)
        last = int(ds.rows[-1])
        low = last  # the last visible row is past the lowered count
        if n < 2 or int(ds.rows[-2]) >= low:
            fail(f"{source}: the test tree has too few rows for a dip ({n})")
        key = int(ds.keys[-1])
        want = t["segments_mel"][last]
        # A read by key, and by position, in a worker that opens the files while the count is
        # low: served, after waiting for the count where the worker reads it (npy; an HDF5
        # worker knows the snapshot's chunks and count, and serves their rows at once).
        for what, i in (("key", key), ("position", n - 1)):
            set_committed(d, source, low)
            got, took = in_worker(ds, i, lambda: set_committed(d, source, n_rows), back)
            if not same_bits(got, want) or (source == "npy" and took < back * 0.8):
                fail(f"{source}: a worker's read by {what} during a dip took {took:.2f} s (the "
                     f"count came back after {back} s) or read other bytes")
        # refresh() during a dip: waits, and the snapshot keeps its rows.
        set_committed(d, source, low)
        later(back, lambda: set_committed(d, source, n_rows))
        got, took = timed(ds.refresh)
        if got != 0 or len(ds) != n or took < back * 0.8:
            fail(f"{source}: refresh() during a dip: {got} new, len {len(ds)} of {n}, took "
                 f"{took:.2f} s")
        # A worker whose snapshot was taken at the lower count, asked for a position of the
        # main process's snapshot (a persistent DataLoader worker after the sampler's refresh)
        # while the files still read low.
        set_committed(d, source, low)
        small = LiveDataset(d, "training", source, wait_s=30)
        if len(small) >= n:
            fail(f"{source}: a dataset opened at a count of {low} has {len(small)} rows")
        got, took = in_held_worker(small, n - 1, lambda: set_committed(d, source, n_rows), back,
                                   lambda: set_committed(d, source, low))
        if not same_bits(got, want) or took < back * 0.8:
            fail(f"{source}: a worker asked for a position past its snapshot during a dip took "
                 f"{took:.2f} s or read other bytes")
        # meta() of that row while a metadata column's npy header counts fewer rows (npy: the
        # headers are written by the same publish; HDF5's metadata is not).
        if source == "npy":
            col = os.path.join(d, "npy", "training", "source_path.npy")
            npy_set_rows(col, low)
            later(back, lambda: npy_set_rows(col, n_rows))
            got, took = timed(lambda: ds.meta(key))
            if got["source_path"] != text(t["source_path"][last]) or took < back * 0.8:
                fail(f"npy: meta() during a dip of a column's header took {took:.2f} s or read "
                     f"{got['source_path']!r}")
        # The count stays low: rows withdrawn once wait_s has passed.
        set_committed(d, source, low)
        ds._wait_s = ds._files.wait_s = 0.5
        ds._files.known_committed = 0  # (as a process that opens the files now)
        try:
            _, took = timed(lambda: ds[key])
        except RowsWithdrawn as e:
            print(f"{source}: rows past a count that stayed low refused: {e}")
        else:
            fail(f"{source}: a row past a count that stayed low was served")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds.refresh()
        if len(ds) != n - 1 or not any("withdrawn" in str(w.message) for w in caught):
            fail(f"{source}: refresh() after the count stayed low: len {len(ds)} of {n}, "
                 f"warnings {[str(w.message) for w in caught]}")
        set_committed(d, source, n_rows)
        ds._files.close()
        small._close_files()
        print(f"{source}: reads and refresh() wait out a count that dips and comes back "
              f"(1 s); rows withdrawn after wait_s")


def reused_outputs(ds, t, what, rng):
    """Batches gathered into reused buffers (npy; HDF5 read by whole blocks): a batch, a row of
    it or a memoryview of it still referred to is never written again; one let go is reused."""
    row_bytes = int(np.prod(ds[0][0].shape)) * 2
    size = max(8, (1 << 17) // row_bytes)  # above the size below which outputs are not reused

    def batch():
        idx = rng.choice(len(ds), size)
        return ds.__getitems__(idx), t["segments_mel"][t["visible"][idx]]

    (b1, w1), (b2, w2) = batch(), batch()
    if np.shares_memory(b1.features, b2.features):
        fail(f"{what}: two batches held at once share memory")
    row, view = b1[1][0], memoryview(b2.features)
    del b1, b2
    later = [batch() for _ in range(4)]
    if not same_bits(row, w1[1]) or not same_bits(np.asarray(view), w2):
        fail(f"{what}: a row or a memoryview still held was overwritten by later batches")
    for b, w in later:
        if not same_bits(b.features, w):
            fail(f"{what}: a held batch was overwritten")
    addrs = {b.features.ctypes.data for b, _ in later}
    del later, b, w
    b, w = batch()
    if b.features.ctypes.data not in addrs or not same_bits(b.features, w):
        fail(f"{what}: a batch no longer referred to was not reused (or read wrong)")
    print(f"{what}: batch outputs reused only once nothing refers to them")


def copy_rewritten(src, dst, libver=("v110", "v110")):
    """src's datasets, rewritten by h5py with the same chunks but no file-space alignment (as
    other writers, and ailhd before it aligned its chunks, lay them out), in the file format of
    `libver` ("earliest": HDF5's oldest, whose chunk index is a B-tree)."""
    with h5py.File(src, "r", libver="latest", swmr=True) as f, h5py.File(
            dst, "w", libver=libver) as g:
        for name, d in f.items():
            if d.chunks is None:
                g.create_dataset(name, data=d[:])
            else:
                g.create_dataset(name, data=d[:], chunks=d.chunks, maxshape=d.maxshape)
        for k, v in f.attrs.items():
            g.attrs[k] = v


def unaligned_hdf5(out, scratch, rng):
    """A file whose chunks lie at arbitrary offsets is read by the fancy-indexing path and gives
    the same rows."""
    d = os.path.join(scratch, "unaligned")
    os.makedirs(d)
    src = os.path.join(out, SPLIT_FILES["training"])
    in_child(copy_rewritten, src, os.path.join(d, SPLIT_FILES["training"]))
    ds = LiveDataset(d, "training", "hdf5")
    if not ds.direct or ds._block != 0:
        fail(f"unaligned copy: direct {ds.direct}, blocks of {ds._block} (expected the "
             "fancy-indexing path: the copy's chunks should not all lie at multiples of 256)")
    check_dataset(ds, h5_truth(d, "training"), "hdf5 unaligned copy", rng)
    print("hdf5 with chunks at arbitrary offsets: read by fancy indexing, same values")


def chunk_iter_addresses(path):
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        mel = f["segments_mel"]
        cr = mel.chunks[0]
        found = {}
        mel.id.chunk_iter(lambda i: found.__setitem__(i.chunk_offset[0] // cr, i.byte_offset))
        return np.array([found[k] for k in range(len(found))], np.int64)


def h5_append_rows(path, counts, seed):
    """Rows of distinct values appended to every dataset and committed, `counts` at a time (each
    a commit of its own: the chunk index, and the chunks of the other datasets, grow between)."""
    rng = np.random.default_rng(seed)
    with h5py.File(path, "r+", locking=False) as f:
        for count in counts:
            n = int(f["committed_rows"][0])
            for name, ds in f.items():
                if name == "committed_rows":
                    continue
                ds.resize(n + count, axis=0)
                if name == "segments_mel":
                    ds[n:] = rng.normal(0, 10, (count,) + ds.shape[1:]).astype(np.float16)
                elif name == "valid":
                    ds[n:] = 1
                elif name in ("source_path", "sensor_id", "recording_id"):
                    ds[n:] = [b"appended"] * count
            f["committed_rows"][0] = n + count
            f.flush()


def appended_chunks(out, scratch, rng):
    """Rows appended after a refresh: their chunks are found in the file's chunk index (an
    extensible array) where there is one, by guessing and checking where there is none (a file
    with HDF5's older B-tree index), and both equal HDF5's own chunk addresses and reads;
    committed_rows, valid and labels are read straight from the file in the first, through h5py
    in the other; the index is read right across super blocks and paged data blocks."""
    src = os.path.join(out, SPLIT_FILES["training"])
    for kind in ("ailhd", "btree"):
        d = os.path.join(scratch, f"appended-{kind}")
        os.makedirs(d)
        path = os.path.join(d, SPLIT_FILES["training"])
        if kind == "ailhd":
            shutil.copy(src, path)
        else:
            in_child(copy_rewritten, src, path, "earliest")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ds = LiveDataset(d, "training", "hdf5")
            for r, counts in enumerate(([1], [7, 40], [1, 1, 100])):
                in_child(h5_append_rows, path, counts, r)
                got = ds.refresh()
                if got != sum(counts):
                    fail(f"{kind}: refresh() after {counts} rows says {got}")
                files = ds._files
                if bool(files.index) != (kind == "ailhd") or bool(files.raw) != (kind == "ailhd"):
                    fail(f"{kind}: chunk index used: {files.index!r}, columns read raw: "
                         f"{files.raw!r}")
                if not np.array_equal(files.chunk_addr, chunk_iter_addresses(path)):
                    fail(f"{kind}: chunk addresses differ from HDF5's after {counts} rows")
                check_dataset(ds, h5_truth(d, "training"), f"{kind} after appending {counts}",
                              rng, full=False)
        print(f"hdf5 ({kind}): appended rows' chunks found, equal to HDF5's addresses and reads")
    # The index right across the larger super blocks (paged data blocks from 131,056 chunks on).
    from ailhd_reader._live import _EaIndex

    path = os.path.join(scratch, "many-chunks.h5")
    n = 140000
    with h5py.File(path, "w", libver="latest") as f:
        x = f.create_dataset("segments_mel", (0, 2), np.float16, chunks=(1, 2), maxshape=(None, 2))
        for at in range(0, n, 35000):
            x.resize(at + 35000, axis=0)
            x[at:] = rng.normal(0, 1, (35000, 2))
    truth = chunk_iter_addresses(path)
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        fd = os.open(path, os.O_RDONLY)
        try:
            index = _EaIndex(fd, h5py.h5o.get_info(f["segments_mel"].id).addr)
            if not np.array_equal(index.addresses(0, n), truth):
                fail("the chunk index read raw differs from HDF5's addresses (140,000 chunks)")
            for lo, hi in ((0, 3), (3, 21), (65000, 66600), (131000, 131100), (n - 1000, n)):
                if not np.array_equal(index.addresses(lo, hi), truth[lo:hi]):
                    fail(f"the chunk index read raw differs from HDF5's for chunks {lo}..{hi}")
        finally:
            os.close(fd)
    print("chunk index read raw: equal to HDF5's addresses over 140,000 chunks")


def main():
    out, scratch = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(7)
    all_splits(out, rng)
    workers(out, rng)
    mid_commit_hdf5(out, scratch, rng)
    mid_commit_npy(out, scratch, rng)
    replaced(out, scratch, rng)
    cut_short(out, scratch, rng)
    count_dip(out, scratch, rng)
    t = h5_truth(out, "training")
    reused_outputs(LiveDataset(out, "training", "npy"), t, "npy", rng)
    reused_outputs(LiveDataset(out, "training", "hdf5"), t, "hdf5", rng)
    unaligned_hdf5(out, scratch, rng)
    appended_chunks(out, scratch, rng)
    for bad, kw in (("nowhere", {}), (out, {"split": "train"}), (out, {"source": "zarr"})):
        try:
            LiveDataset(bad, **kw)
        except (FileNotFoundError, ValueError) as e:
            print(f"refused: {e}")
        else:
            fail(f"LiveDataset({bad!r}, {kw}) did not refuse")
    print("reader_values: OK")


if __name__ == "__main__":
    main()
