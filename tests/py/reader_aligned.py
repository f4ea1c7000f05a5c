"""ailhd's HDF5 outputs keep every feature row at a multiple of the row size, as the writer
promises (src/output/hdf5.rs, `feature_alignment`): every segments_mel chunk starts at such an
offset (HDF5's chunk index, through h5py), ailhd_reader reads the rows as whole-row blocks (its
fast path, no fallback warning) and serves exactly h5py's reads; with BIN_DIR, the bytes Debian's
h5dump 1.10 dumped (`h5dump -d segments_mel -b FILE -o BIN_DIR/<file>.bin`) equal h5py's too.
Works while the service appends (SWMR opens).
usage: reader_aligned.py OUTPUT_DIR [BIN_DIR]"""

import os
import sys
import warnings

import h5py
import numpy as np

from ailhd_reader import LiveDataset
from reader_util import SPLIT_FILES, check_dataset, fail, h5_truth


def chunk_offsets(path):
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        mel = f["segments_mel"]
        mel.refresh()
        found = []

        def visit(info):
            found.append((info.chunk_offset[0], info.byte_offset))

        mel.id.chunk_iter(visit)
        row_bytes = int(np.prod(mel.shape[1:])) * mel.dtype.itemsize
        return row_bytes, mel.chunks[0], mel.shape[0], [o for _, o in sorted(found)]


def main():
    out = sys.argv[1]
    bins = sys.argv[2] if len(sys.argv) > 2 else None
    rng = np.random.default_rng(5)
    total = 0
    for split, name in SPLIT_FILES.items():
        path = os.path.join(out, name)
        row_bytes, chunk_rows, rows, offs = chunk_offsets(path)
        if len(offs) != -(-rows // chunk_rows):
            fail(f"{name}: {len(offs)} chunks for {rows} rows of {chunk_rows} per chunk")
        bad = [(k, o) for k, o in enumerate(offs) if o % row_bytes]
        if bad:
            fail(f"{name}: {len(bad)} of {len(offs)} segments_mel chunks do not start at a "
                 f"multiple of the row size {row_bytes}: (chunk, offset) {bad[:10]}")
        t = h5_truth(out, split)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback to h5py reads warns
            ds = LiveDataset(out, split, "hdf5")
        if len(ds) and ds._block != row_bytes:
            fail(f"{name}: ailhd_reader gathers rows in blocks of {ds._block} bytes, not whole "
                 f"rows ({row_bytes}): direct={ds.direct}")
        check_dataset(ds, t, f"{split}/hdf5", rng)
        if bins:
            dumped = np.fromfile(os.path.join(bins, name + ".bin"), "<f2")
            want = t["segments_mel"]
            if dumped.size != want.size or not np.array_equal(
                    dumped.view(np.uint16), want.reshape(-1).view(np.uint16)):
                fail(f"{name}: h5dump's segments_mel ({dumped.size} values) differs from "
                     f"h5py's ({want.size})")
        total += t["committed"]
        print(f"{name}: {rows} rows in {len(offs)} chunks, all at multiples of {row_bytes} bytes; "
              f"reader blocks {ds._block}" + (", h5dump's bytes equal" if bins else ""))
    if total == 0:
        fail("no rows at all")
    print(f"reader_aligned: OK ({total} rows)")


if __name__ == "__main__":
    main()
