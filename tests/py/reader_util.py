"""Shared by the ailhd_reader tests: the truth as h5py and numpy read it, and the comparison of a
LiveDataset with it."""

import json
import os

import h5py
import numpy as np

SPLIT_FILES = {
    "training": "TRAINING_DATASET.H5",
    "validation": "VALIDATION_DATASET.H5",
    "testing": "TESTING_DATASET.H5",
}
META = ("source_path", "sensor_id", "recording_id", "recorded_at", "gain_db", "blake3")


def fail(msg):
    raise AssertionError(msg)


def h5_truth(out, split):
    """Everything in a split's HDF5 file, read with h5py as the README says (SWMR, committed_rows
    first, then refresh): dict of committed, valid, labels, mel, meta columns, label names."""
    path = os.path.join(out, SPLIT_FILES[split])
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        f["committed_rows"].refresh()
        n = int(f["committed_rows"][0])
        t = {"committed": n}
        for name in ("segments_mel", "labels", "valid") + META:
            f[name].refresh()
            t[name] = f[name][:n]
        t["names"] = json.loads(bytes(f.attrs["labels_json"]).rstrip(b"\0").decode())
    t["visible"] = np.flatnonzero(t["valid"])
    return t


def text(b):
    return bytes(b).rstrip(b"\0").decode()


def same_bits(a, b):
    a = np.asarray(a)
    b = np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        a.view(np.uint16), b.view(np.uint16))


def check_dataset(ds, t, what, rng, full=True):
    """ds serves exactly the valid committed rows of truth t, with their values and metadata."""
    if list(ds.rows) != list(t["visible"]):
        fail(f"{what}: rows {list(ds.rows)[:20]}... != valid committed rows {list(t['visible'])[:20]}...")
    if len(ds) != len(t["visible"]):
        fail(f"{what}: len {len(ds)} != {len(t['visible'])}")
    if ds.labels != t["names"]:
        fail(f"{what}: labels {ds.labels} != {t['names']}")
    n = len(ds)
    if n == 0:
        return
    each = range(n) if full else rng.choice(n, min(n, 50), replace=False)
    for i in each:
        x, label = ds[int(i)]
        r = t["visible"][i]
        if not same_bits(x, t["segments_mel"][r]):
            fail(f"{what}: ds[{i}] (row {r}) differs from h5py's segments_mel[{r}]")
        if not isinstance(label, int) or label != int(t["labels"][r]):
            fail(f"{what}: label of ds[{i}] is {label!r}, h5py says {t['labels'][r]}")
    # A shuffled batch with a repeat and negative indices, in one call.
    idx = rng.permutation(n)
    idx = np.concatenate([idx, idx[:1], [-1]])
    batch = ds.__getitems__(idx.tolist())
    if len(batch) != len(idx):
        fail(f"{what}: batch of {len(idx)} has {len(batch)} items")
    want = t["segments_mel"][t["visible"][idx]]
    if not same_bits(batch.features, want):
        fail(f"{what}: __getitems__ features differ from h5py's rows")
    if batch.features.shape[1:] != t["segments_mel"].shape[1:] or batch.features.dtype != np.float16:
        fail(f"{what}: batch features {batch.features.shape} {batch.features.dtype}")
    if not np.array_equal(batch.labels, t["labels"][t["visible"][idx]]):
        fail(f"{what}: __getitems__ labels differ")
    x0, l0 = batch[0]
    if not same_bits(x0, want[0]) or l0 != int(t["labels"][t["visible"][idx[0]]]):
        fail(f"{what}: batch[0] differs")
    for i in ([0, n - 1] + list(rng.choice(n, min(n, 5), replace=False))):
        i = int(i)
        m = ds.meta(i)
        r = t["visible"][i]
        for c in ("source_path", "sensor_id", "recording_id"):
            if m[c] != text(t[c][r]):
                fail(f"{what}: meta({i})[{c}] = {m[c]!r}, h5py says {text(t[c][r])!r}")
        if m["recorded_at"] != int(t["recorded_at"][r]):
            fail(f"{what}: meta({i}) recorded_at {m['recorded_at']} != {t['recorded_at'][r]}")
        g = float(t["gain_db"][r])
        if not (m["gain_db"] == g or (np.isnan(g) and np.isnan(m["gain_db"]))):
            fail(f"{what}: meta({i}) gain_db {m['gain_db']} != {g}")
        if m["blake3"] != bytes(t["blake3"][r]).hex():
            fail(f"{what}: meta({i}) blake3 {m['blake3']} != {bytes(t['blake3'][r]).hex()}")
        if m["row"] != r or m["label"] != int(t["labels"][r]):
            fail(f"{what}: meta({i}) row/label {m['row']}/{m['label']} != {r}/{t['labels'][r]}")
    for bad in (n, -n - 1):
        try:
            ds[bad]
        except IndexError:
            pass
        else:
            fail(f"{what}: ds[{bad}] with {n} rows did not raise IndexError")


def status(state):
    """The status snapshot the running service keeps in its state folder ({} until there is one)."""
    try:
        with open(os.path.join(state, "status.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def tree_count(rec):
    """The *.wav files under the recordings folder."""
    return sum(f.endswith(".wav") for _, _, fs in os.walk(rec) for f in fs)
