"""ailhd_reader and the README's own h5py snippet in one Python process, in either order, while
the real `ailhd run` service appends, and after it closed its files when idle and reopened them
for new recordings. HDF5 keeps one open file per process and refuses a second open with other
settings ("file locking flag values don't match"): the reader opens the files as the snippet
does, `h5py.File(path, "r", libver="latest", swmr=True)`. Order A runs in this process (reader
first), order B in a fresh one (snippet first). Every split is "training" here.
usage: reader_beside_h5py.py AILHD_BIN CONFIG OUTPUT RECORDINGS POOL STATE"""

import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np

from ailhd_reader import LiveDataset
from reader_util import fail, status, tree_count, same_bits

TIMEOUT = 90


def args():
    return sys.argv[1:7]


def h5_path(out):
    return os.path.join(out, "TRAINING_DATASET.H5")


def snippet_open(out):
    """The README's snippet, word for word."""
    return h5py.File(h5_path(out), "r", libver="latest", swmr=True)


def snippet_read(f):
    """Rows as the README reads them: committed_rows first, then the other datasets."""
    f["committed_rows"].refresh()
    n = int(f["committed_rows"][0])
    f["segments_mel"].refresh()
    x = f["segments_mel"][:n]
    f["valid"].refresh()
    valid = f["valid"][:n].astype(bool)
    return n, x, valid




def put_from_pool(rec, pool, k):
    """Deliver the next k recordings of the pool as a recorder does (temporary name, rename)."""
    left = sorted(os.path.relpath(os.path.join(d, f), pool)
                  for d, _, fs in os.walk(pool) for f in fs if f.endswith(".wav"))
    for rel in left[:k]:
        dst = os.path.join(rec, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy(os.path.join(pool, rel), dst + ".part")
        os.replace(dst + ".part", dst)
        os.remove(os.path.join(pool, rel))




def follow(what, ds_list, f, want):
    """Refresh the readers and the snippet's handle until each sees `want` valid rows; then they
    must agree row for row and bit for bit."""
    t = time.time()
    while True:
        for ds in ds_list:
            ds.refresh()
        n, x, valid = snippet_read(f)
        if int(valid.sum()) == want and all(len(ds) == want for ds in ds_list):
            break
        if time.time() - t > TIMEOUT:
            fail(f"{what}: h5py sees {int(valid.sum())} valid of {n} rows, the readers "
                 f"{[len(ds) for ds in ds_list]}; want {want}")
        time.sleep(0.05)
    rows = np.flatnonzero(valid)
    for ds in ds_list:
        if list(ds.rows) != list(rows):
            fail(f"{what} ({ds.source}): rows {list(ds.rows)} != h5py's valid rows {list(rows)}")
        b = ds.__getitems__(np.arange(len(ds)))
        if not same_bits(b.features, x[rows]):
            fail(f"{what} ({ds.source}): features differ from h5py's")
    print(f"{what}: reader ({', '.join(ds.source for ds in ds_list)}) and h5py agree on "
          f"{want} rows after {time.time() - t:.1f} s")


def wait_idle_close(what, state):
    """Until the service has closed its files after the last append (a snapshot written since
    then says so)."""
    t = time.time()
    while True:
        svc = status(state).get("service", {})
        if not svc.get("outputs_open", True) and svc.get("updated_ms", 0) > t * 1e3:
            return
        if time.time() - t > TIMEOUT:
            fail(f"{what}: the service never closed its files when idle")
        time.sleep(0.1)


def order_a(out, rec, pool, state):
    """Reader first (both sources), then the snippet; appends, an idle close, a reopen."""
    want = tree_count(rec)
    readers = [LiveDataset(out, "training", source="hdf5"),
               LiveDataset(out, "training", source="npy")]
    try:
        f = snippet_open(out)
    except OSError as e:
        fail(f"reader first, then the README's h5py.File: {e}")
    follow("order A: reader, then h5py", readers, f, want)
    put_from_pool(rec, pool, 6)
    follow("order A: while the service appends", readers, f, want + 6)
    wait_idle_close("order A", state)
    put_from_pool(rec, pool, 4)
    follow("order A: after the idle close and reopen", readers, f, want + 10)
    f.close()


def order_b(out, rec, pool, state):
    """A fresh process: the snippet first, then the reader; an append, an idle close, a reopen."""
    want = tree_count(rec)
    f = snippet_open(out)
    try:
        readers = [LiveDataset(out, "training", source="hdf5"),
                   LiveDataset(out, "training", source="npy")]
    except OSError as e:
        fail(f"the README's h5py.File, then the reader: {e}")
    follow("order B: h5py, then reader", readers, f, want)
    put_from_pool(rec, pool, 3)
    follow("order B: while the service appends", readers, f, want + 3)
    wait_idle_close("order B", state)
    put_from_pool(rec, pool, 3)
    follow("order B: after the idle close and reopen", readers, f, want + 6)
    f.close()


def main():
    binary, config, out, rec, pool, state = args()
    try:
        os.remove(os.path.join(state, "status.json"))
    except FileNotFoundError:
        pass
    log = os.path.join(os.path.dirname(state), "reader-beside-h5py.log")
    env = {k: v for k, v in os.environ.items() if k != "AILHD_CONFIG"}
    svc = subprocess.Popen([binary, "--config", config, "--verbose", "run"], env=env,
                           stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    try:
        t = time.time()
        while status(state).get("files", {}).get("committed", 0) < tree_count(rec):
            if svc.poll() is not None or time.time() - t > TIMEOUT:
                fail(f"the service did not ingest the first recordings; log:\n{open(log).read()}")
            time.sleep(0.05)
        order_a(out, rec, pool, state)
        child = mp.get_context("spawn").Process(target=order_b, args=(out, rec, pool, state))
        child.start()
        child.join(4 * TIMEOUT)
        if child.exitcode != 0:
            fail(f"order B (a fresh process) failed: exit code {child.exitcode}")
        svc.send_signal(signal.SIGTERM)
        if svc.wait(60) != 0:
            fail(f"run exited {svc.returncode}")
    except BaseException:
        svc.kill()
        print(f"service log:\n{open(log).read()[-5000:]}", file=sys.stderr)
        raise
    print("reader_beside_h5py: OK")


if __name__ == "__main__":
    main()
