#!/usr/bin/env python3
"""Random-batch and sequential read speed of ailhd's training split, as a PyTorch trainer reads it.

    python3 benches/reader.py --out OUTPUT_DIR            # outputs of an earlier `ailhd rebuild`
    python3 benches/reader.py --make 5000 [--bin PATH]    # synthesise N clips, rebuild, measure

Prints rows/s for, in one run on the same files:
  - naive h5py, one row at a time (the upstream LeakMelDataset pattern: `f["segments_mel"][i]`,
    `f["labels"][i]` per row, h5py's default chunk cache), on the file as ailhd writes it and on
    a copy of `segments_mel` with the 1 MiB chunks ailhd wrote before (102 rows);
  - ailhd_reader.LiveDataset on HDF5 (direct reads; and through h5py, direct=False) and on npy;
  - the reader on a copy of the HDF5 file rewritten by h5py without ailhd's chunk alignment (rows
    at arbitrary offsets: the reader gathers them by fancy indexing instead of whole-row blocks),
    which shows what the alignment buys;
  - sequential epochs (batches in row order) for the naive pattern (slices) and the reader;
  - a torch DataLoader over the reader with worker processes, when torch is installed;
and each figure's ratio to the naive pattern. Batches are 5,632 rows (upstream's batch size).
The naive pattern is measured at the start and again at the end, and the better of the two is the
baseline (the machine's load changes during a run).
"""

import argparse
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from ailhd_reader import LiveDataset, collate  # noqa: E402

BATCH = 5632
LABELS = ["BACKGROUND", "CRACK", "LEAK", "NORMAL", "UNCLASSIFIED"]


def make_tree(root, n, seed=0):
    """n synthetic 10 s, 4096 Hz, 16-bit clips: band-limited noise, band per label."""
    sr, length = 4096, 40960
    rng = np.random.default_rng(seed)
    hdr = (b"RIFF" + struct.pack("<I", 36 + 2 * length) + b"WAVE" + b"fmt "
           + struct.pack("<IHHIIHH", 16, 1, 1, sr, sr * 2, 2, 16) + b"data"
           + struct.pack("<I", 2 * length))
    freqs = np.fft.rfftfreq(length, 1 / sr)
    bases = []
    for k in range(16):
        spec = np.fft.rfft(rng.standard_normal(length))
        lo = 100 + 100 * k
        spec[(freqs < lo) | (freqs > lo + 400)] = 0
        b = np.fft.irfft(spec, length)
        bases.append(b / np.abs(b).max())
    for lab in LABELS:
        os.makedirs(os.path.join(root, lab), exist_ok=True)
    for i in range(n):
        x = 0.4 * bases[i % 16] * rng.uniform(0.2, 1.0) + 0.02 * rng.standard_normal(length)
        pcm = np.clip(np.round(x * 32767), -32768, 32767).astype("<i2")
        name = f"S{i % 97:03d}~R{i:07d}~20250101{(i // 3600) % 24:02d}{(i // 60) % 60:02d}{i % 60:02d}~100.wav"
        with open(os.path.join(root, LABELS[i % 5], name), "wb") as fh:
            fh.write(hdr + pcm.tobytes())


def rebuild(binary, root, out, state):
    cfg = os.path.join(os.path.dirname(out), "bench.toml")
    with open(cfg, "w") as fh:
        fh.write(f'[paths]\nrecordings = "{root}"\noutput = "{out}"\nstate = "{state}"\n'
                 '[ingest]\ndevice = "cpu"\n')
    t = time.perf_counter()
    subprocess.run([binary, "--config", cfg, "rebuild"], check=True, stdout=subprocess.DEVNULL,
                   env={k: v for k, v in os.environ.items() if k != "AILHD_CONFIG"})
    print(f"rebuild of {root}: {time.perf_counter() - t:.1f} s")


def rate(fn, rows, reps):
    """Best rows/s over reps calls of fn (each reads `rows` rows)."""
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = max(best, rows / (time.perf_counter() - t))
    return best


def old_layout_copy(path, scratch):
    """segments_mel and labels with the chunks ailhd wrote before this layout: 1 MiB (102 rows of
    the default features)."""
    dst = os.path.join(scratch, "old_layout.h5")
    with h5py.File(path, "r", libver="latest", swmr=True) as f, \
            h5py.File(dst, "w", libver=("v110", "v110")) as g:
        n = int(f["committed_rows"][0])
        mel = f["segments_mel"]
        row_bytes = int(np.prod(mel.shape[1:])) * 2
        rows = max(1, (1 << 20) // row_bytes)
        d = g.create_dataset("segments_mel", shape=(n,) + mel.shape[1:],
                             maxshape=(None,) + mel.shape[1:], chunks=(rows,) + mel.shape[1:],
                             dtype="<f2")
        for a in range(0, n, 4096):
            d[a:a + 4096] = mel[a:min(n, a + 4096)]
        g.create_dataset("labels", data=f["labels"][:n], maxshape=(None,), chunks=(4096,))
    return dst, rows


def unaligned_copy(path, scratch):
    """The whole file, rewritten by h5py with the same chunks but no file-space alignment (as
    ailhd wrote its files before it aligned the feature chunks to the row size)."""
    dst = os.path.join(scratch, "unaligned", os.path.basename(path))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        with h5py.File(dst, "w", libver=("v110", "v110")) as g:
            for name, d in f.items():
                kw = {} if d.chunks is None else {"chunks": d.chunks, "maxshape": d.maxshape}
                g.create_dataset(name, data=d[:], **kw)
            for k, v in f.attrs.items():
                g.attrs[k] = v
    return os.path.dirname(dst)


def naive_child(file, idx_file, reps):
    """The upstream pattern on one batch: plain open (default chunk cache, no SWMR), then
    `f["segments_mel"][i]`, `f["labels"][i]` per row. Prints the best rows/s over reps."""
    idx = np.load(idx_file)
    with h5py.File(file, "r") as f:
        mel, lab = f["segments_mel"], f["labels"]

        def one_batch():
            for i in idx.tolist():
                x = mel[i]
                y = int(lab[i])
            return x, y
        print(rate(one_batch, len(idx), reps))


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--naive-child":
        return naive_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="ailhd output folder (paths.output) to read")
    ap.add_argument("--make", type=int, help="synthesise this many clips and rebuild them first")
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "target", "release", "ailhd"))
    ap.add_argument("--split", default="training")
    ap.add_argument("--batches", type=int, default=5, help="random batches per reader figure")
    ap.add_argument("--scratch", help="folder for generated data (default: a temporary one)")
    a = ap.parse_args()
    scratch = a.scratch or tempfile.mkdtemp(prefix="ailhd-reader-bench-")
    os.makedirs(scratch, exist_ok=True)
    out = a.out
    if out is None:
        if not a.make:
            ap.error("give --out DIR or --make N")
        root, out = os.path.join(scratch, "rec"), os.path.join(scratch, "out")
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(os.path.join(scratch, "state"), ignore_errors=True)
        t = time.perf_counter()
        make_tree(root, a.make)
        print(f"made {a.make} clips in {time.perf_counter() - t:.1f} s")
        rebuild(os.path.abspath(a.bin), root, out, os.path.join(scratch, "state"))

    names = {"training": "TRAINING_DATASET.H5", "validation": "VALIDATION_DATASET.H5",
             "testing": "TESTING_DATASET.H5"}
    path = os.path.join(out, names[a.split])
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        n = int(f["committed_rows"][0])
        chunks = f["segments_mel"].chunks
        shape = f["segments_mel"].shape[1:]
    batch = min(BATCH, n)
    print(f"{path}: {n} rows of {shape} float16 ({n * np.prod(shape) * 2 / 1e6:.0f} MB), "
          f"segments_mel chunks of {chunks[0]} rows; batches of {batch} random rows")
    for s in ("training", "validation", "testing"):
        p = os.path.join(out, names[s])
        print(f"  {names[s]}: {os.path.getsize(p):,} bytes")
    rng = np.random.default_rng(0)
    batches = [rng.choice(n, batch, replace=False) for _ in range(a.batches)]
    # Warm the page cache, as a trainer's second epoch finds it.
    for p in [path] + [os.path.join(out, "npy", a.split, c) for c in ("segments_mel.npy",)]:
        with open(p, "rb") as fh:
            while fh.read(1 << 24):
                pass

    results = []

    def report(name, value, base=None):
        results.append((name, value))
        ratio = f"{value / base:8.1f}x naive" if base else ""
        print(f"  {name:58s} {value:12,.0f} rows/s {ratio}", flush=True)

    def epoch(read, total):
        """Every row in batches in row order; each batch dropped before the next (a trainer)."""
        for a in range(0, total, batch):
            read(a, min(total, a + batch))

    idx_file = os.path.join(scratch, "batch0.npy")
    np.save(idx_file, batches[0])

    def naive_rate(file, reps):
        # In a child process: HDF5 refuses a second open of a file with other settings, and the
        # readers hold this one open by the time of the last measurement.
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--naive-child", file,
                              idx_file, str(reps)], check=True, capture_output=True, text=True)
        return float(res.stdout.split()[-1])

    print("random batches:")
    naive = naive_rate(path, 2)
    report("naive h5py per row (upstream LeakMelDataset), this layout", naive)
    unaligned_dir = unaligned_copy(path, scratch)
    old_path, old_rows = old_layout_copy(path, scratch)
    naive_old = naive_rate(old_path, 1)
    report(f"naive h5py per row, previous layout ({old_rows}-row chunks)", naive_old)
    os.remove(old_path)

    # (Before any reader opens the file: HDF5 refuses a second open with other settings.)
    with h5py.File(path, "r") as f:
        mel = f["segments_mel"]
        seq_naive = rate(lambda: epoch(lambda a, b: mel[a:b], n), n, 2)

    readers = {
        "reader, HDF5 (direct reads)": LiveDataset(out, a.split, "hdf5"),
        "reader, HDF5 through h5py (direct=False)": LiveDataset(out, a.split, "hdf5", direct=False),
        "reader, npy": LiveDataset(out, a.split, "npy"),
        "reader, HDF5 copy without chunk alignment": LiveDataset(
            unaligned_dir, a.split, "hdf5", hdf5_name=os.path.basename(path)),
    }
    for name, ds in readers.items():
        if ds.source == "hdf5" and ds.direct:
            how = f"blocks of {ds._block} bytes" if ds._block else "fancy indexing (unaligned)"
            print(f"  ({name}: rows gathered by {how})")
    figures = {}
    for name, ds in readers.items():
        it = iter(range(10 ** 9))

        def one(ds=ds, it=it):
            ds.__getitems__(batches[next(it) % len(batches)])
        reps = 2 if "through h5py" in name else a.batches
        figures[name] = rate(one, batch, reps)
        report(name, figures[name], naive)

    naive_end = naive_rate(path, 2)
    report("naive h5py per row, this layout, again at the end", naive_end)
    if naive_end > naive:
        naive = naive_end
        print(f"  (baseline: the figure at the end, {naive:,.0f} rows/s)")
        for name in readers:
            report(name, figures[name], naive)

    print("sequential epochs (batches in row order):")
    report("naive h5py slices", seq_naive, naive)
    for name in ("reader, HDF5 (direct reads)", "reader, npy"):
        ds = readers[name]
        seq = rate(lambda ds=ds: epoch(lambda a, b: ds.__getitems__(np.arange(a, b)), len(ds)),
                   len(ds), 3)
        report(name, seq, naive)

    try:
        import torch
        from torch.utils.data import DataLoader
    except ImportError:
        print("torch is not installed: DataLoader figures skipped")
    else:
        print(f"torch {torch.__version__} DataLoader, shuffled, batch {batch}, 2 workers "
              "(fork), second epoch (persistent workers):")
        for name in ("reader, HDF5 (direct reads)", "reader, npy"):
            dl = DataLoader(readers[name], batch_size=batch, shuffle=True, num_workers=2,
                            collate_fn=collate, persistent_workers=True)
            for epoch in range(2):
                t = time.perf_counter()
                rows = sum(len(y) for _, y in dl)
                dt = time.perf_counter() - t
            report(f"{name}, DataLoader", rows / dt, naive)

    print("targets: reader on HDF5 >= 10x naive, reader on npy >= 30x naive")
    for name, want in (("reader, HDF5 (direct reads)", 10), ("reader, npy", 30)):
        for label, base in (("this layout", naive), ("previous layout", naive_old)):
            r = figures[name] / base
            print(f"  {name:32s} vs naive on {label:16s} {r:7.1f}x  "
                  f"({'meets' if r >= want else 'BELOW'} {want}x)")
    for ds in readers.values():
        ds._files.close()
    shutil.rmtree(unaligned_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
