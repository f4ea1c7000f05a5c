"""A labelled tree of N synthetic 10 s clips (mono int16, 4096 Hz), written by every core at once:
the same layout, names and signal model as the project's dataset generator (band-limited
noise with a slow envelope plus white noise), but the noise comes from windows of one long
precomputed signal so that a file costs microseconds of numpy, not a fresh FFT. Every clip's
bytes are distinct (a per-clip gain and noise offset).

usage: make_tree.py ROOT N_FILES [SEED]
"""
import os
import struct
import sys
from multiprocessing import Pool

import numpy as np

LABELS = ["BACKGROUND", "CRACK", "LEAK", "NORMAL", "UNCLASSIFIED"]
SR, N = 4096, 40960
NOISE = 1 << 20


def header(nbytes):
    return (b"RIFF" + struct.pack("<I", 36 + nbytes) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, SR, SR * 2, 2, 16) + b"data" + struct.pack("<I", nbytes))


def signals(seed):
    rng = np.random.default_rng(seed)
    t = np.arange(N) / SR
    f = np.fft.rfftfreq(N, 1 / SR)
    bases = []
    for k in range(16):
        w = np.fft.rfft(rng.standard_normal(N))
        lo = 100 + 100 * k
        w[(f < lo) | (f > lo + 400)] = 0
        b = np.fft.irfft(w, N)
        b /= np.abs(b).max()
        bases.append(b * (0.6 + 0.4 * np.sin(2 * np.pi * (0.1 + 0.05 * k) * t)))
    return np.array(bases), rng.standard_normal(NOISE + N)


def write(args):
    root, lo, hi, seed = args
    bases, noise = signals(seed)
    rng = np.random.default_rng(seed * 1_000_003 + lo)
    hdr = header(2 * N)
    for i in range(lo, hi):
        lab = LABELS[i % len(LABELS)]
        off = int(rng.integers(0, NOISE))
        x = 0.4 * bases[i % 16] * rng.uniform(0.2, 1.0) + 0.02 * noise[off:off + N]
        pcm = np.clip(np.round(x * 32768), -32768, 32767).astype("<i2")
        name = (f"S{i % 97:03d}~R{i:07d}~2025{(i // 86400) % 12 + 1:02d}{(i // 3600) % 28 + 1:02d}"
                f"{(i // 60) % 24:02d}{i % 60:02d}00~{int(rng.integers(40, 180))}.wav")
        with open(os.path.join(root, lab, name), "wb") as fh:
            fh.write(hdr + pcm.tobytes())
    return hi - lo


def main(root, n, seed=0):
    for lab in LABELS:
        os.makedirs(os.path.join(root, lab), exist_ok=True)
    jobs = max(1, os.cpu_count() or 1)
    step = -(-n // (jobs * 4))
    parts = [(root, lo, min(n, lo + step), seed) for lo in range(0, n, step)]
    with Pool(jobs) as pool:
        done = sum(pool.map(write, parts))
    print(f"wrote {done} recordings under {root} ({jobs} processes)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
