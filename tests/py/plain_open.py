"""Open every split's HDF5 file plainly (no SWMR), as any HDF5 reader does once the service is
idle or stopped (h5py without swmr=True, HDFView...): it must open, and every dataset must have
exactly committed_rows rows. Prints the committed rows per split and their total.

usage: plain_open.py OUTPUT_DIR
"""
import os
import sys

import h5py

out = sys.argv[1]
total = 0
per = []
for n in ["TRAINING_DATASET.H5", "VALIDATION_DATASET.H5", "TESTING_DATASET.H5"]:
    p = os.path.join(out, n)
    try:
        f = h5py.File(p, "r")
    except Exception as e:  # noqa: BLE001 - the message is the evidence
        sys.exit(f"{n}: a plain reader cannot open it: {e}")
    with f:
        c = int(f["committed_rows"][0])
        for d in f:
            if d != "committed_rows":
                assert f[d].shape[0] == c, f"{n}:{d} has {f[d].shape[0]} rows, committed {c}"
    per.append(c)
    total += c
print(f"committed rows {per}, total {total}")
