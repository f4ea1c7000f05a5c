"""Label names the service appends (`labels.unknown = "append"`) reach a LiveDataset that stays
open, from either source, and a second one made in the same process: `ds.labels` grows, and
every row's label id names a label (`ds.labels[label]`, `meta()["label_name"]`). Two rounds
beside the real `ailhd run`: one new label folder while the service runs (the attribute is
rewritten in its room), then long names past that room and a restart (the service gives the
attribute more room at its start). A README-style h5py SWMR handle is open throughout: HDF5
shares one open file per process, so the reader must refresh what that handle cached too.
usage: reader_appended_labels.py AILHD_BIN CONFIG OUTPUT RECORDINGS POOL STATE"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py

from ailhd_reader import LiveDataset
from reader_util import fail, status, tree_count

TIMEOUT = 90




def deliver(rec, pool, label, k):
    """The next k recordings of the pool into the folder `label`, as a recorder delivers them
    (temporary name, rename)."""
    left = sorted(os.path.join(d, f) for d, _, fs in os.walk(pool) for f in fs
                  if f.endswith(".wav"))
    if len(left) < k:
        fail(f"the pool has {len(left)} recordings, {k} wanted")
    os.makedirs(os.path.join(rec, label), exist_ok=True)
    for src in left[:k]:
        dst = os.path.join(rec, label, os.path.basename(src))
        shutil.copy(src, dst + ".part")
        os.replace(dst + ".part", dst)
        os.remove(src)




def wait_committed(state, want, svc, log):
    t = time.time()
    while status(state).get("files", {}).get("committed", 0) < want:
        if svc.poll() is not None or time.time() - t > TIMEOUT:
            fail(f"the service did not ingest {want} recordings; log:\n{open(log).read()}")
        time.sleep(0.05)


def check(what, ds, names_wanted):
    """After refresh(): every wanted name is in ds.labels, and every row's label id names one."""
    t = time.time()
    while True:
        ds.refresh()
        # Every training row is valid here (one recording per content), so the reader serves
        # as many rows as the tree holds once the service has committed them all.
        if all(n in ds.labels for n in names_wanted) or time.time() - t > TIMEOUT:
            break
        time.sleep(0.05)
    missing = [n for n in names_wanted if n not in ds.labels]
    if missing:
        fail(f"{what} ({ds.source}): ds.labels {ds.labels} lacks {missing}")
    for i in range(len(ds)):
        _, label = ds[i]
        if not 0 <= label < len(ds.labels):
            fail(f"{what} ({ds.source}): row {i} has label id {label}, ds.labels has "
                 f"{len(ds.labels)} names")
        folder = ds.meta(i)["source_path"].split("/")[0]
        if ds.labels[label] != folder or ds.meta(i)["label_name"] != folder:
            fail(f"{what} ({ds.source}): row {i} of {folder}/ is labelled "
                 f"{ds.labels[label]!r} (meta: {ds.meta(i)['label_name']!r})")
    print(f"{what} ({ds.source}): {len(ds)} rows, {len(ds.labels)} label names")


def main():
    binary, config, out, rec, pool, state = sys.argv[1:7]
    log = os.path.join(os.path.dirname(state), "reader-appended-labels.log")
    env = {k: v for k, v in os.environ.items() if k != "AILHD_CONFIG"}

    def start():
        try:
            os.remove(os.path.join(state, "status.json"))
        except FileNotFoundError:
            pass
        return subprocess.Popen([binary, "--config", config, "--verbose", "run"], env=env,
                                stdout=subprocess.DEVNULL, stderr=open(log, "a"))

    svc = start()
    try:
        wait_committed(state, tree_count(rec), svc, log)
        snippet = h5py.File(os.path.join(out, "TRAINING_DATASET.H5"), "r", libver="latest",
                            swmr=True)
        readers = [LiveDataset(out, "training", source=s) for s in ("hdf5", "npy")]
        first = list(readers[0].labels)
        # Round 1: a new label folder while the service runs.
        deliver(rec, pool, "HUMPBACK", 3)
        wait_committed(state, tree_count(rec), svc, log)
        for ds in readers:
            check("a label appended while the service runs", ds, ["HUMPBACK"])
        check("a new reader in the same process", LiveDataset(out, "training", source="hdf5"),
              ["HUMPBACK"])
        # Round 2: names past the attribute's room, then a restart.
        long_names = [f"A_VERY_LONG_LABEL_FOLDER_NAME_NUMBER_{i:02d}" for i in range(8)]
        for name in long_names:
            deliver(rec, pool, name, 1)
        wait_committed(state, tree_count(rec), svc, log)
        svc.send_signal(signal.SIGTERM)
        if svc.wait(60) != 0:
            fail(f"run exited {svc.returncode}")
        svc = start()
        deliver(rec, pool, "HUMPBACK", 1)
        wait_committed(state, tree_count(rec), svc, log)
        for ds in readers:
            check("names past the attribute's room, after a restart", ds,
                  ["HUMPBACK"] + long_names)
        if readers[0].labels[:len(first)] != first:
            fail(f"the first names changed: {first} -> {readers[0].labels}")
        snippet.close()
        svc.send_signal(signal.SIGTERM)
        if svc.wait(60) != 0:
            fail(f"run exited {svc.returncode}")
    except BaseException:
        svc.kill()
        print(f"service log:\n{open(log).read()[-5000:]}", file=sys.stderr)
        raise
    print("reader_appended_labels: OK")


if __name__ == "__main__":
    main()
