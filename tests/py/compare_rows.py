"""Compare the daemon's outputs with a rebuild of the same tree, and with what the tree holds.

usage: compare_rows.py SPEC.json
SPEC: {"daemon_out": dir, "rebuild_out": dir, "expect": {hex: [label ids allowed]}, "swmr": bool}
- every dataset of every split has exactly committed_rows rows (the service is stopped or idle);
- the valid rows hold each expected hash exactly once, with an allowed label, and nothing else;
- each valid row equals the rebuild's row for the same hash in every column (features byte for
  byte, split, label, source_path, sensor_id, recording_id, recorded_at, gain_db): run and
  rebuild agree whatever the order in which files arrived;
- the npy columns equal the HDF5 columns.
"""
import json
import os
import sys

import h5py
import numpy as np

spec = json.load(open(sys.argv[1]))
names = ["TRAINING_DATASET.H5", "VALIDATION_DATASET.H5", "TESTING_DATASET.H5"]
splits = ["training", "validation", "testing"]


def rows(out, check_npy):
    res = {}
    valid_hashes = []
    for name, split in zip(names, splits):
        # The service may still be running (idle): read as the trainer does, in SWMR mode.
        with h5py.File(os.path.join(out, name), "r", libver="latest", swmr=check_npy) as f:
            c = int(f["committed_rows"][0])
            for d in f:
                if d != "committed_rows":
                    assert f[d].shape[0] == c, f"{out}/{name}:{d} has {f[d].shape[0]} rows, committed {c}"
            mel = f["segments_mel"][...]
            keys = ("blake3", "valid", "labels", "source_path", "sensor_id", "recording_id", "recorded_at", "gain_db")
            cols = {k: f[k][...] for k in keys}
        if check_npy:
            for col, arr in [("segments_mel", mel)] + list(cols.items()):
                m = np.load(os.path.join(out, "npy", split, col + ".npy"), mmap_mode="r")
                assert m.shape == arr.shape, f"npy {split}/{col} {m.shape} != {arr.shape}"
                assert np.array_equal(np.asarray(m).view(np.uint8), np.asarray(arr).view(np.uint8)), f"npy {split}/{col} differs"
        for i in range(c):
            h = bytes(cols["blake3"][i]).hex()
            if cols["valid"][i]:
                valid_hashes.append(h)
                res[h] = (
                    int(cols["labels"][i]),
                    mel[i].tobytes(),
                    cols["source_path"][i].decode(),
                    {
                        "split": split,
                        "sensor_id": bytes(cols["sensor_id"][i]),
                        "recording_id": bytes(cols["recording_id"][i]),
                        "recorded_at": int(cols["recorded_at"][i]),
                        "gain_db": np.asarray(cols["gain_db"][i]).tobytes(),
                    },
                )
    return res, valid_hashes


d, dh = rows(spec["daemon_out"], True)
r, _ = rows(spec["rebuild_out"], False)
dup = {h for h in dh if dh.count(h) > 1}
assert not dup, f"bytes with more than one valid row: {sorted(dup)[:3]}"
expect = spec["expect"]
missing = set(expect) - set(d)
extra = set(d) - set(expect)
assert not missing, f"{len(missing)} files without a valid row, e.g. {sorted(missing)[:3]}"
assert not extra, f"{len(extra)} valid rows for bytes no longer in the tree, e.g. {[d[h][2] for h in sorted(extra)[:3]]}"
for h, allowed in expect.items():
    assert d[h][0] in allowed, f"{d[h][2]}: label {d[h][0]} not in {allowed}"
    assert h in r, f"{d[h][2]}: rebuild has no row for it"
    assert d[h][1] == r[h][1], f"{d[h][2]}: features differ from rebuild"
    assert d[h][0] == r[h][0], f"{d[h][2]}: label {d[h][0]}, rebuild says {r[h][0]} ({r[h][2]})"
    assert d[h][2] == r[h][2], f"source_path {d[h][2]}, rebuild says {r[h][2]}"
    assert d[h][3] == r[h][3], f"{d[h][2]}: columns {d[h][3]} != rebuild {r[h][3]}"
print(f"ok: {len(d)} valid rows, each once, equal to rebuild's in every column")
