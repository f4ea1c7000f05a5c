"""A reader that keeps row numbers, as a trainer may: polls the per-split HDF5 files in SWMR mode
until STOPFILE exists, and fails if a row it has seen ever holds other bytes (its blake3 changed:
a row moved) or if committed_rows ever goes down (rows disappeared). Files that are replaced or
vanish while it polls are a failure too.

usage: rows_keep.py OUTPUT_DIR STOPFILE   (creates STOPFILE.open once the files are open)
"""
import os
import sys
import time

import h5py

out, stop = sys.argv[1], sys.argv[2]
names = ["TRAINING_DATASET.H5", "VALIDATION_DATASET.H5", "TESTING_DATASET.H5"]
files = {n: h5py.File(os.path.join(out, n), "r", libver="latest", swmr=True) for n in names}
inodes = {n: os.stat(os.path.join(out, n)).st_ino for n in names}
open(stop + ".open", "w").close()  # the test goes on once the files are open
seen = {n: [] for n in names}
committed = {n: 0 for n in names}
polls = 0
while True:
    for n, f in files.items():
        assert os.stat(os.path.join(out, n)).st_ino == inodes[n], f"{n} was replaced"
        for d in ("committed_rows", "blake3"):
            f[d].refresh()
        c = int(f["committed_rows"][0])
        assert c >= committed[n], f"{n}: committed_rows went down from {committed[n]} to {c}"
        committed[n] = c
        hashes = [bytes(h).hex() for h in f["blake3"][:c]]
        for i, h in enumerate(seen[n]):
            assert hashes[i] == h, f"{n}: row {i} held {h[:12]}, now {hashes[i][:12]} (a row moved)"
        seen[n] = hashes
    polls += 1
    if os.path.exists(stop):
        break
    time.sleep(0.02)
print(f"ok: {polls} polls, committed rows {committed}, no row moved")
