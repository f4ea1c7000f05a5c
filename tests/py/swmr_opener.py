"""A reader that opens the outputs anew, again and again, as a trainer starting (or a worker
reopening its files) does at any moment: h5py in SWMR mode, as the README's snippet opens them.
Polls until STOPFILE exists; fails if HDF5 ever refuses an open (say "file is not already open
for SWMR writing", while the service reopens its files).

usage: swmr_opener.py OUTPUT_DIR STOPFILE
"""
import collections
import os
import sys

import h5py

out, stop = sys.argv[1], sys.argv[2]
names = ["TRAINING_DATASET.H5", "VALIDATION_DATASET.H5", "TESTING_DATASET.H5"]
refused = collections.Counter()
opens = 0
while not os.path.exists(stop):
    for n in names:
        try:
            with h5py.File(os.path.join(out, n), "r", libver="latest", swmr=True) as f:
                int(f["committed_rows"][0])
            opens += 1
        except OSError as e:
            refused[f"{n}: {e}"] += 1
assert opens > 0, "no open at all"
assert not refused, f"{sum(refused.values())} opens of {opens + sum(refused.values())} refused: {dict(refused)}"
print(f"ok: {opens} opens, none refused")
