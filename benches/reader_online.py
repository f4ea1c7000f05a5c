#!/usr/bin/env python3
"""Online learning as a trainer runs it: DataLoader epochs over the live reader against the same
DataLoader over the same rows held in RAM, and the cost of a refresh after new rows arrive.

    python3 benches/reader_online.py --make 200000 [--bin PATH] [--scratch DIR [--reuse]]

Prints, in one run on the same files:
  - samples/s of a shuffled epoch at batch 5,632 through a torch DataLoader with 4 persistent
    workers (spawn, pin_memory, prefetch_factor 4, `collate`): `LiveDataset` + `LiveSampler` on
    npy and on HDF5, and the same DataLoader over the same rows held in RAM (a numpy array in
    shared memory, `np.take` per batch, PyTorch's RandomSampler): the readers' figures as a
    fraction of it (target >= 0.8). Epochs after the first (persistent workers are warm);
    the loaders take turns, three rounds; also the in-RAM loader gathering into reused output
    buffers, as the reader does (the readers' own overhead);
  - refresh(): the first one (every row), one with nothing new, and one after 1,000 new
    recordings that the real `ailhd run` service appended (three times), for npy and HDF5; and a
    worker catching up (a copy of the dataset from before, asked for a key of a new row).
--make N writes N short clips (0.1 s, zero-padded to 10 s by ailhd: rows as large as real
ones) with splits.ratios training = 100, and rebuilds them.
"""

import argparse
import json
import os
import pickle
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from ailhd_reader import Batch, LiveDataset, LiveSampler, collate  # noqa: E402

BATCH = 5632
WORKERS = 4
LABELS = ["BACKGROUND", "CRACK", "LEAK", "NORMAL", "UNCLASSIFIED"]


def make_clips(root, first, n, seed=0):
    """n distinct 0.1 s clips (4096 Hz, 16-bit), numbered from `first`."""
    sr, length = 4096, 410
    hdr = (b"RIFF" + struct.pack("<I", 36 + 2 * length) + b"WAVE" + b"fmt "
           + struct.pack("<IHHIIHH", 16, 1, 1, sr, sr * 2, 2, 16) + b"data"
           + struct.pack("<I", 2 * length))
    rng = np.random.default_rng(seed + first)
    for lab in LABELS:
        os.makedirs(os.path.join(root, lab), exist_ok=True)
    pcm = rng.integers(-8000, 8000, (n, length), dtype=np.int16).astype("<i2")
    for k in range(n):
        i = first + k
        name = f"S{i % 97:03d}~R{i:07d}~20250101{(i // 3600) % 24:02d}{(i // 60) % 60:02d}{i % 60:02d}~100.wav"
        path = os.path.join(root, LABELS[i % 5], name)
        with open(path + ".part", "wb") as fh:
            fh.write(hdr + pcm[k].tobytes())
        os.replace(path + ".part", path)


def config(root, out, state):
    cfg = os.path.join(os.path.dirname(out), "bench-online.toml")
    with open(cfg, "w") as fh:
        fh.write(f'[paths]\nrecordings = "{root}"\noutput = "{out}"\nstate = "{state}"\n'
                 '[splits.ratios]\ntraining = 100\nvalidation = 0\ntesting = 0\n'
                 '[ingest]\ndevice = "cpu"\nsettle_ms = 100\nmax_batch_latency_ms = 10\n'
                 'rescan_interval_s = 0\n')
    return cfg


def env():
    return {k: v for k, v in os.environ.items() if k != "AILHD_CONFIG"}


class InRam:
    """The same rows held in RAM (shared memory, so spawned workers map it instead of copying)."""

    def __init__(self, feats, labels):
        self.x = feats  # torch tensors in shared memory
        self.y = labels

    def __len__(self):
        return len(self.y)

    def __getitems__(self, idx):
        idx = np.asarray(idx, np.int64)
        return Batch(np.take(self.x.numpy(), idx, axis=0), self.y.numpy()[idx], idx)


class InRamReused(InRam):
    """The same, gathered into reused output buffers as the reader gathers (a fresh batch-sized
    array costs the kernel's zeroing of its pages)."""

    def __getitems__(self, idx):
        from ailhd_reader._live import _Outputs

        if not hasattr(self, "outputs"):
            self.outputs = _Outputs()
        idx = np.asarray(idx, np.int64)
        x = self.x.numpy()
        out = self.outputs.array((len(idx),) + x.shape[1:])
        np.take(x, idx, axis=0, mode="clip", out=out)
        return Batch(out, self.y.numpy()[idx], idx)


def epoch(loader):
    """samples/s of one epoch."""
    t = time.perf_counter()
    n = sum(len(y) for _, y in loader)
    return n / (time.perf_counter() - t)


def epoch_bench(out_dir, rounds):
    import torch
    from torch.utils.data import DataLoader

    ds = {s: LiveDataset(out_dir, "training", s) for s in ("npy", "hdf5")}
    n = len(ds["npy"])
    t = time.perf_counter()
    feats = torch.from_numpy(ds["npy"].__getitems__(np.arange(n)).features.copy()).share_memory_()
    labels = torch.from_numpy(ds["npy"].targets.copy()).share_memory_()
    print(f"  (rows held in RAM: {feats.numel() * 2 / 1e9:.2f} GB in shared memory, loaded in "
          f"{time.perf_counter() - t:.1f} s)")
    kw = dict(batch_size=BATCH, num_workers=WORKERS, persistent_workers=True, pin_memory=True,
              prefetch_factor=4, multiprocessing_context="spawn", collate_fn=collate)
    loaders = {
        "in RAM (numpy, RandomSampler)": DataLoader(InRam(feats, labels), shuffle=True, **kw),
        "in RAM, reused output buffers": DataLoader(InRamReused(feats, labels), shuffle=True,
                                                    **kw),
        "LiveDataset npy + LiveSampler": DataLoader(ds["npy"], sampler=LiveSampler(ds["npy"]), **kw),
        "LiveDataset hdf5 + LiveSampler": DataLoader(ds["hdf5"], sampler=LiveSampler(ds["hdf5"]),
                                                     **kw),
    }
    for name, dl in loaders.items():
        print(f"  (first epoch, starting the workers: {name}: {epoch(dl):,.0f} samples/s)")
    figures = {name: [] for name in loaders}
    for r in range(rounds):
        for name, dl in loaders.items():
            figures[name].append(epoch(dl))
    base = statistics.median(figures["in RAM (numpy, RandomSampler)"])
    print(f"  {'loader':34s} {'median':>10s}  {'epochs (samples/s)':s}")
    for name, f in figures.items():
        med = statistics.median(f)
        print(f"  {name:34s} {med:10,.0f}  {', '.join(f'{x:,.0f}' for x in f)}  "
              f"= {med / base:.2f} of in RAM")
    reused = statistics.median(figures["in RAM, reused output buffers"])
    for name in ("LiveDataset npy + LiveSampler", "LiveDataset hdf5 + LiveSampler"):
        r = statistics.median(figures[name]) / base
        print(f"  target >= 0.8 of in RAM: {name}: {r:.2f} ({'meets' if r >= 0.8 else 'BELOW'}); "
              f"{statistics.median(figures[name]) / reused:.2f} of in RAM with reused buffers")
    return ds


def committed(out_dir):
    try:
        a = json.load(open(os.path.join(out_dir, "npy", "training", "attributes.json")))
        return int(a["committed_rows"])
    except (OSError, ValueError):
        return -1


def timed(fn):
    t = time.perf_counter()
    r = fn()
    return (time.perf_counter() - t) * 1e3, r


def refresh_bench(binary, cfg, root, out_dir, first, rounds=3, new=1000):
    ds = {}
    for s in ("npy", "hdf5"):
        ms, d = timed(lambda s=s: LiveDataset(out_dir, "training", s))
        ds[s] = d
        print(f"  {s:4s}: first refresh (opening, {len(d):,} rows, committed {d.committed_rows:,}): "
              f"{ms:.1f} ms")
    for s, d in ds.items():
        ms = [timed(d.refresh)[0] for _ in range(5)]
        print(f"  {s:4s}: refresh with nothing new: {statistics.median(ms):.2f} ms (median of 5: "
              f"{', '.join(f'{m:.2f}' for m in ms)})")
    clones = {s: pickle.loads(pickle.dumps(d)) for s, d in ds.items()}
    for c in clones.values():
        c[0]  # files open in this copy, as in a worker that served a batch
    log = open(os.path.join(os.path.dirname(out_dir), "bench-online-run.log"), "w")
    t = time.perf_counter()
    svc = subprocess.Popen([binary, "--config", cfg, "run"], env=env(), stdout=subprocess.DEVNULL,
                           stderr=log)
    try:
        for r in range(rounds):
            target = committed(out_dir) + new
            make_clips(root, first + r * new, new, seed=99)
            t = time.perf_counter()
            while committed(out_dir) < target:
                if svc.poll() is not None or time.perf_counter() - t > 600:
                    raise SystemExit(f"the service did not commit {new} new rows "
                                     f"(exit {svc.poll()}); see {log.name}")
                time.sleep(0.05)
            time.sleep(0.3)  # both outputs committed
            for s, d in ds.items():
                before = d.committed_rows
                ms, got = timed(d.refresh)
                extra = f", {d._files.lookups} chunk addresses asked from HDF5 so far" \
                    if s == "hdf5" else ""
                print(f"  {s:4s}: refresh after {new:,} new rows ({before:,} -> "
                      f"{d.committed_rows:,} committed): {ms:.2f} ms, {got:,} rows appeared{extra}")
            if r == 0:
                for s, c in clones.items():
                    key = int(ds[s].keys[-1])
                    ms, _ = timed(lambda c=c, key=key: c[key])
                    print(f"  {s:4s}: a worker's copy from before, asked for a new row's key: "
                          f"{ms:.2f} ms (catch-up and one row)")
    finally:
        svc.send_signal(signal.SIGTERM)
        svc.wait(120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--make", type=int, required=True,
                    help="synthesise this many clips and rebuild them first")
    ap.add_argument("--reuse", action="store_true",
                    help="use the clips and outputs an earlier run left in --scratch")
    default_bin = os.path.join(HERE, "..", "target", "release", "ailhd")
    if not os.path.exists(default_bin):
        default_bin = os.path.join(HERE, "..", "target", "debug", "ailhd")
    ap.add_argument("--bin", default=default_bin)
    ap.add_argument("--rounds", type=int, default=3, help="epochs per loader")
    ap.add_argument("--scratch", help="folder for generated data (default: a temporary one)")
    a = ap.parse_args()
    binary = os.path.abspath(a.bin)
    scratch = a.scratch or tempfile.mkdtemp(prefix="ailhd-online-bench-")
    os.makedirs(scratch, exist_ok=True)
    root, out_dir, state = (os.path.join(scratch, x) for x in ("rec", "out", "state"))
    cfg = config(root, out_dir, state)
    if not (a.reuse and os.path.exists(os.path.join(out_dir, "TRAINING_DATASET.H5"))):
        for d in (root, out_dir, state):
            shutil.rmtree(d, ignore_errors=True)
        t = time.perf_counter()
        make_clips(root, 0, a.make)
        print(f"made {a.make:,} clips in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        subprocess.run([binary, "--config", cfg, "rebuild"], check=True, env=env(),
                       stdout=subprocess.DEVNULL)
        print(f"rebuild ({binary}): {time.perf_counter() - t:.1f} s")
    first = sum(len(fs) for _, _, fs in os.walk(root))
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines()
                  if ln.startswith("Model name")), "?")
    import torch

    print(f"machine: {model}, {os.cpu_count()} CPUs; torch {torch.__version__}; "
          f"{time.strftime('%Y-%m-%d')}")
    ds = LiveDataset(out_dir, "training", "npy")
    rows = len(ds)
    print(f"{out_dir}: {rows:,} training rows of {ds[0][0].shape} float16 "
          f"({rows * ds[0][0].nbytes / 1e9:.2f} GB per source)")
    for p in (os.path.join(out_dir, "TRAINING_DATASET.H5"),
              os.path.join(out_dir, "npy", "training", "segments_mel.npy")):
        with open(p, "rb") as fh:  # warm the page cache, as a trainer's second epoch finds it
            while fh.read(1 << 24):
                pass
    print(f"DataLoader epochs: batch {BATCH}, {WORKERS} persistent workers (spawn), "
          "pin_memory=True, prefetch_factor=4, shuffled:")
    epoch_bench(out_dir, a.rounds)
    print("refresh():")
    refresh_bench(binary, cfg, root, out_dir, first)


if __name__ == "__main__":
    main()
