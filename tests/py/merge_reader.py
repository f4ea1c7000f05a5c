"""A merge read with ailhd_reader, as a trainer reads it: every split opens with its rows and
without warnings (a merge's virtual rows are read through h5py by design); with the merge's
inputs gone (its hard links under .inputs/ moved away), a new LiveDataset refuses it, naming the
missing input, instead of serving HDF5's zeros for its rows. The links are put back after.
usage: merge_reader.py MERGED_DIR"""

import os
import sys
import warnings

from ailhd_reader import LiveDataset, OutputsChanged

merged = sys.argv[1]
warnings.simplefilter("error")
sizes = {}
for split in ("training", "validation", "testing"):
    ds = LiveDataset(merged, split=split, source="hdf5")
    sizes[split] = len(ds)
    if len(ds):
        features, label = ds[len(ds) - 1]
        assert features.any(), f"{split}: the last row reads as zeros"
        assert ds.meta(len(ds) - 1)["blake3"].strip("0"), f"{split}: an all-zero blake3"
assert sum(sizes.values()) > 0, sizes

links, away = os.path.join(merged, ".inputs"), os.path.join(merged, ".inputs-away")
os.rename(links, away)
try:
    try:
        ds = LiveDataset(merged, split="training", source="hdf5")
        print(f"served {len(ds)} rows, first label {ds[0][1]}")
        sys.exit("a merge whose inputs are gone was served")
    except OutputsChanged as e:
        assert "an input of this merge, is not there" in str(e), e
        print(f"refused: {e}")
finally:
    os.rename(away, links)
print(f"ok: {sizes}")
