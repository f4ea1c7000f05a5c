"""A trainer-like SWMR reader: polls the per-split HDF5 files while `ailhd run` appends, until
STOPFILE exists. Every row below committed_rows must be complete and consistent: its hash is not
all zeros, its path is set, its features are finite, and no read ever raises.

usage: swmr_reader.py OUTPUT_DIR STOPFILE
"""
import os
import sys
import time

import h5py
import numpy as np

out, stop = sys.argv[1], sys.argv[2]
names = ["TRAINING_DATASET.H5", "VALIDATION_DATASET.H5", "TESTING_DATASET.H5"]
files = {}
polls = 0
max_rows = 0
last = {}
while True:
    for n in names:
        p = os.path.join(out, n)
        if n not in files:
            if not os.path.exists(p):
                continue
            files[n] = h5py.File(p, "r", libver="latest", swmr=True)
        f = files[n]
        for d in ("committed_rows", "segments_mel", "blake3", "source_path", "labels", "valid"):
            f[d].refresh()
        c = int(f["committed_rows"][0])
        assert f["segments_mel"].shape[0] >= c, f"{n}: {f['segments_mel'].shape[0]} rows < committed {c}"
        if c:
            mel = f["segments_mel"][:c].astype(np.float32)
            assert np.isfinite(mel).all(), f"{n}: non-finite features below committed_rows"
            h = f["blake3"][:c]
            assert (h.any(axis=1)).all(), f"{n}: a committed row has no hash (torn row)"
            sp = f["source_path"][:c]
            assert all(len(s) > 0 for s in sp), f"{n}: a committed row has no source_path"
        max_rows = max(max_rows, c)
        last[n] = c
    polls += 1
    if os.path.exists(stop):
        break
    time.sleep(0.02)
print(f"ok: {polls} polls, up to {max_rows} committed rows seen, no error; final committed rows: {sum(last.values())}")
