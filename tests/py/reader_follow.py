"""ailhd_reader.LiveDataset following `ailhd run` while its disk refuses writes (tests/power_loss.rs):
both sources of every split, refresh() every 20 ms and every row of the snapshot read each time,
until STOPFILE exists. Fails on any exception, on a snapshot that shrinks, and on a row whose bytes
change. Prints the rows seen, how long the slowest refresh() took, and the counts that dipped below
a snapshot and how long refresh() waited for them to come back.
usage: reader_follow.py OUTPUT_DIR STOPFILE"""

import os
import sys
import time

import numpy as np

from ailhd_reader import LiveDataset
from reader_util import fail

SPLITS = ("training", "validation", "testing")
WAITS = []  # (dataset, seconds): refresh() found fewer rows than its snapshot and waited


def counted(wait):
    def wrapper(self, files, cols):
        t0 = time.monotonic()
        try:
            return wait(self, files, cols)
        finally:
            WAITS.append((f"{self.split}/{self.source}", round(time.monotonic() - t0, 2)))
    return wrapper


LiveDataset._wait_for_count = counted(LiveDataset._wait_for_count)


def main():
    out, stop = sys.argv[1], sys.argv[2]
    sets = {}
    seen = {}  # (split, source) -> {row: bytes}
    slowest = 0.0
    polls = 0
    while not os.path.exists(stop):
        for split in SPLITS:
            for source in ("npy", "hdf5"):
                at = (split, source)
                if at not in sets:
                    try:
                        sets[at] = LiveDataset(out, split, source, wait_s=60)
                    except (FileNotFoundError, OSError):
                        continue  # (not made yet)
                    seen[at] = {}
                ds = sets[at]
                before = len(ds)
                t0 = time.monotonic()
                ds.refresh()
                slowest = max(slowest, time.monotonic() - t0)
                if len(ds) < before:
                    fail(f"{split}/{source}: the snapshot shrank from {before} to {len(ds)} rows")
                if len(ds) == 0:
                    continue
                batch = ds.__getitems__(list(range(len(ds))))
                for row, feats in zip(batch.rows.tolist(), batch.features):
                    b = feats.tobytes()
                    if seen[at].setdefault(row, b) != b:
                        fail(f"{split}/{source}: row {row} changed")
        polls += 1
        time.sleep(0.02)
    rows = {f"{s}/{src}": len(v) for (s, src), v in seen.items()}
    print(f"reader_follow: {polls} polls, rows seen {rows}, slowest refresh {slowest:.2f} s, "
          f"counts that dipped, waited out: {WAITS}")
    print("reader_follow: OK")


if __name__ == "__main__":
    main()
