"""Online learning as a trainer runs it: a real torch DataLoader over ailhd_reader.LiveDataset with
LiveSampler, npy and hdf5, persistent_workers True and False, fork and spawn, pin_memory and
prefetch_factor, while the real `ailhd run` service appends between and during epochs (and
supersedes and deletes a recording during one): every epoch serves exactly the rows valid at its
start, each once, with h5py's bytes and the label they had then, and no error. Then what the
service does to a running epoch: a clean stop, an idle close and reopen (`ingest.idle_close_s`),
a kill and restart, and an `ailhd rebuild` that swaps the files while persistent workers read
them; a plain shuffled DataLoader with persistent workers and `refresh()` between epochs (no
IndexError); recency-weighted replay; the distributed form (two ranks, torch.distributed over
gloo with a file:// rendezvous). torch is required: this test fails without it.
usage: reader_online.py AILHD_BIN CONFIG OUTPUT RECORDINGS POOL STATE"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

try:
    import torch
    from torch.utils.data import DataLoader
except ImportError:
    raise SystemExit("FAILED: torch is not installed (. .ci/setup installs it); this test needs a "
                     "real DataLoader")

from ailhd_reader import Batch, LiveDataset, LiveSampler
from reader_util import fail, h5_truth, same_bits, text

BIN, CONFIG, OUT, REC, POOL, STATE = sys.argv[1:7]
SOURCES = ("npy", "hdf5")
TIMEOUT = 90


def collate_rows(batch):
    """The default `collate`, plus the rows served (a test's view of what each batch held)."""
    assert isinstance(batch, Batch), type(batch)
    return (torch.from_numpy(batch.features), torch.from_numpy(batch.labels),
            torch.from_numpy(np.asarray(batch.rows, np.int64)))


class Service:
    def __init__(self, n):
        try:
            os.remove(os.path.join(STATE, "status.json"))
        except FileNotFoundError:
            pass
        self.log = os.path.join(os.path.dirname(STATE), f"online-run-{n}.log")
        env = {k: v for k, v in os.environ.items() if k != "AILHD_CONFIG"}
        self.p = subprocess.Popen([BIN, "--config", CONFIG, "--verbose", "run"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        t = time.time()
        while True:
            try:
                if "service" in json.load(open(os.path.join(STATE, "status.json"))):
                    return
            except (OSError, ValueError):
                pass
            if self.p.poll() is not None or time.time() - t > TIMEOUT:
                fail(f"service did not come up; log:\n{open(self.log).read()}")
            time.sleep(0.05)

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        rc = self.p.wait(60)
        if rc != 0:
            fail(f"run exited {rc}; log:\n{open(self.log).read()}")

    def kill(self):
        self.p.kill()
        self.p.wait(60)


POOL_FILES = sorted(os.path.relpath(os.path.join(d, f), POOL)
                    for d, _, fs in os.walk(POOL) for f in fs if f.endswith(".wav"))
pool_iter = iter(POOL_FILES)


def put(rel, src):
    """Deliver a recording as a recorder does: write under a temporary name, rename into place."""
    dst = os.path.join(REC, rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy(src, dst + ".part")
    os.replace(dst + ".part", dst)


def deliver(k, pause=0.0):
    out = []
    for _ in range(k):
        rel = next(pool_iter)
        put(rel, os.path.join(POOL, rel))
        out.append(rel)
        if pause:
            time.sleep(pause)
    return out


def tree_size():
    return sum(1 for _, _, fs in os.walk(REC) for f in fs if f.endswith(".wav"))


def wait_committed(what, invalid=()):
    """Until every recording in the tree has its valid row in both outputs, and the rows
    `invalid` (of recordings deleted or superseded) are no longer valid: the count alone can
    match while the service has ingested a new file but not yet seen a deletion."""
    t = time.time()
    while True:
        n = tree_size()
        tr = h5_truth(OUT, "training")
        npy = npy_committed()
        if len(tr["visible"]) == n and npy == tr["committed"] and \
                not any(tr["valid"][r] for r in invalid):
            return tr
        if time.time() - t > TIMEOUT:
            fail(f"{what}: {len(tr['visible'])} valid rows for {n} recordings after {TIMEOUT} s")
        time.sleep(0.05)


def npy_committed():
    try:
        return int(json.load(open(os.path.join(OUT, "npy", "training", "attributes.json")))
                   ["committed_rows"])
    except (OSError, ValueError):
        return -1


def check_epoch(what, sampler, served, before, after, old_truth=None):
    """served: (rows, labels, features) of one epoch. The epoch's population is the sampler's
    snapshot; it must hold every row valid before the epoch began that is still valid after it,
    only rows valid before it or committed since, and be served exactly once each; features are
    h5py's bytes of those rows, labels the rows' labels at the epoch's start."""
    rows, labels, feats = served
    pop = np.asarray(sampler.epoch_rows)
    if not np.array_equal(np.sort(rows), np.sort(pop)):
        extra = sorted(set(rows.tolist()) - set(pop.tolist()))[:10]
        missing = sorted(set(pop.tolist()) - set(rows.tolist()))[:10]
        fail(f"{what}: served {len(rows)} rows, the epoch's snapshot has {len(pop)}; "
             f"extra {extra}, missing {missing}, repeated "
             f"{len(rows) - len(set(rows.tolist()))}")
    c = sampler.epoch_committed
    if c < before["committed"] or (pop.size and pop.max() >= c):
        fail(f"{what}: epoch committed {c}, before it {before['committed']}, max row {pop.max()}")
    must = set(before["visible"].tolist()) & set(after["visible"].tolist())
    if not must <= set(pop.tolist()):
        fail(f"{what}: rows valid before the epoch and after it were not served: "
             f"{sorted(must - set(pop.tolist()))[:10]}")
    may = set(before["visible"].tolist()) | set(range(before["committed"], c))
    if not set(pop.tolist()) <= may:
        fail(f"{what}: rows invalid before the epoch were served: "
             f"{sorted(set(pop.tolist()) - may)[:10]}")
    truth = old_truth or after
    if not same_bits(feats, truth["segments_mel"][rows]):
        fail(f"{what}: features served differ from h5py's rows")
    if not np.array_equal(labels, truth["labels"][rows]):
        fail(f"{what}: labels served differ from the rows' labels")


def run_epoch(loader, during=None):
    """One epoch: (rows, labels, features) served; during(k) is called after batch k."""
    rows, labels, feats = [], [], []
    for k, (x, y, r) in enumerate(loader):
        if x.dtype != torch.float16 or y.dtype != torch.int64:
            fail(f"batch dtypes {x.dtype} {y.dtype}")
        rows.append(r.numpy().copy())
        labels.append(y.numpy().copy())
        feats.append(x.numpy().copy())
        if during is not None:
            during(k)
    return np.concatenate(rows), np.concatenate(labels), np.concatenate(feats)


def loader_for(ds, sampler, persistent, ctx, batch=5):
    return DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=2,
                      persistent_workers=persistent, pin_memory=True, prefetch_factor=2,
                      multiprocessing_context=ctx, collate_fn=collate_rows)


def online(source, persistent, ctx):
    """3 epochs: recordings delivered and committed between epochs (they must be served in the
    next one), and delivered while an epoch runs (they must not be served in it); in the second
    epoch a served recording is superseded and another deleted (both still served in it, as of
    its start, and gone from the next)."""
    what = f"{source}, persistent_workers={persistent}, {ctx}"
    ds = LiveDataset(OUT, "training", source)
    sampler = LiveSampler(ds, seed=1)
    loader = loader_for(ds, sampler, persistent, ctx)
    changed = {}
    t0 = time.time()
    for epoch in range(3):
        new = deliver(2)
        before = wait_committed(f"{what}: before epoch {epoch}")
        new_rows = set(np.flatnonzero(before["valid"]).tolist()) - set(ds.rows.tolist())
        writer = threading.Thread(target=deliver, args=(2, 0.1))

        def during(k, epoch=epoch):
            if k == 0:
                writer.start()
            if epoch == 1 and k == 1:
                # Supersede one served recording (new bytes at its path), delete another.
                meta = {ds.meta(i)["source_path"]: int(ds.rows[i]) for i in range(len(ds))}
                paths = sorted(p for p in meta if os.path.exists(os.path.join(REC, p)))
                sup, gone = paths[0], paths[1]
                put(sup, os.path.join(POOL, next(pool_iter)))
                os.remove(os.path.join(REC, gone))
                changed.update(sup=meta[sup], gone=meta[gone])

        served = run_epoch(loader, during)
        writer.join()
        after = wait_committed(f"{what}: after epoch {epoch}",
                               changed.values() if epoch == 1 else ())
        check_epoch(f"{what}, epoch {epoch}", sampler, served, before, after)
        if not new_rows <= set(sampler.epoch_rows.tolist()) or len(new) != 2:
            fail(f"{what}, epoch {epoch}: rows committed before it were not served: {new_rows}")
        if epoch == 1:
            for k, r in changed.items():
                if r not in served[0]:
                    fail(f"{what}: the row {k} during the epoch was not served in it")
                if after["valid"][r]:
                    fail(f"{what}: the row {k} during the epoch is still valid")
        if epoch == 2:
            for k, r in changed.items():
                if r in served[0]:
                    fail(f"{what}: the row {k} in the previous epoch was served again")
    print(f"{what}: 3 epochs, each exactly the rows valid at its start "
          f"({len(sampler.epoch_rows)} in the last), {time.time() - t0:.1f} s")
    return loader


def drop_and_relabel():
    """Delete one recording of the training split and move another into another label's folder
    (its row keeps its place and takes that label): rows drop out of the snapshot and positions
    shift. Returns (the deleted one's row, the moved one's row and its new label id)."""
    t = h5_truth(OUT, "training")
    rels = {r: text(t["source_path"][r]) for r in t["visible"]}
    # Recordings of the pool's, whose file name no other label folder holds.
    ours = [r for r, rel in rels.items() if rel in POOL_FILES]
    gone, moved = ours[0], ours[len(ours) // 2]
    os.remove(os.path.join(REC, rels[gone]))
    label, name = rels[moved].split("/", 1)
    other = next(n for n in t["names"] if n != label and
                 not os.path.exists(os.path.join(REC, n, name)))
    os.makedirs(os.path.join(REC, other), exist_ok=True)
    os.replace(os.path.join(REC, rels[moved]), os.path.join(REC, other, name))
    return gone, moved, t["names"].index(other)


def plain_shuffle(source, ctx):
    """The upstream loop: shuffle=True, persistent workers, refresh() between epochs. Each epoch
    serves exactly the rows of the main process's snapshot, with their labels, also after rows
    dropped out and changed label while the workers kept older snapshots (no IndexError either:
    workers behind it catch up)."""
    ds = LiveDataset(OUT, "training", source)
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True,
                        prefetch_factor=2, multiprocessing_context=ctx,
                        collate_fn=collate_rows)
    what = f"plain loop ({source}, {ctx})"
    for epoch in range(4):
        deliver(3)
        invalid, relabelled = (), None
        if epoch >= 2:
            gone, moved, label = drop_and_relabel()
            invalid, relabelled = (gone,), (moved, label)
        t = wait_committed(f"{what}: before epoch {epoch}", invalid)
        while relabelled and t["labels"][relabelled[0]] != relabelled[1]:
            time.sleep(0.05)
            t = wait_committed(f"{what}: the move before epoch {epoch}", invalid)
        ds.refresh()
        if not np.array_equal(ds.rows, t["visible"]):
            fail(f"{what}, epoch {epoch}: the snapshot is not the valid committed rows")
        rows, labels, feats = run_epoch(loader)
        order = np.argsort(rows)
        if not np.array_equal(rows[order], t["visible"]):
            extra = sorted(set(rows.tolist()) - set(t["visible"].tolist()))[:10]
            missing = sorted(set(t["visible"].tolist()) - set(rows.tolist()))[:10]
            fail(f"{what}, epoch {epoch}: served {len(rows)} rows for {len(t['visible'])}; "
                 f"not valid {extra}, valid not served {missing}")
        if not np.array_equal(labels, t["labels"][rows]):
            bad = int(np.count_nonzero(labels != t["labels"][rows]))
            fail(f"{what}, epoch {epoch}: {bad} rows served with another label than theirs")
        if not same_bits(feats, t["segments_mel"][rows]):
            fail(f"{what}: features differ from h5py's")
    print(f"{what}, persistent workers, refresh() between epochs, rows dropped out and "
          "relabelled: each epoch exactly the main process's snapshot")


def service_events(source, svc):
    """Persistent spawn workers; mid-epoch: a clean stop, an idle close and reopen, a kill and
    restart, a rebuild that swaps the files. Each epoch serves its snapshot; the one after the
    rebuild serves the new files."""
    what = f"service events ({source})"
    ds = LiveDataset(OUT, "training", source)
    sampler = LiveSampler(ds, seed=2)
    loader = loader_for(ds, sampler, True, "spawn", batch=3)
    state = {"svc": svc}

    def one(name, action, at=2):
        before = wait_committed(f"{what}: before {name}") if state["svc"] else h5_truth(
            OUT, "training")
        served = run_epoch(loader, lambda k: action() if k == at else None)
        after = h5_truth(OUT, "training")
        if state["svc"]:
            after = wait_committed(f"{what}: after {name}")
        return before, served, after

    def stop():
        state["svc"].stop()
        state["svc"] = None

    def restart():
        state["svc"] = Service(f"{source}-restart")
        deliver(2)

    before, served, after = one("stop", stop)
    check_epoch(f"{what}: a clean stop mid-epoch", sampler, served, before, after)
    before, served, after = one("start", restart)
    check_epoch(f"{what}: a restart mid-epoch", sampler, served, before, after)
    # Idle close: idle_close_s = 1 in this test's config; wait for the service to close its
    # files (a plain open then works), then deliver mid-epoch (it reopens them).
    time.sleep(2.5)
    plain = subprocess.run([sys.executable, "-c", "import h5py, sys; h5py.File(sys.argv[1], 'r')",
                            os.path.join(OUT, "TRAINING_DATASET.H5")], capture_output=True)
    if plain.returncode != 0:
        fail(f"{what}: the service did not close its files when idle: {plain.stderr}")
    before, served, after = one("idle reopen", lambda: deliver(2))
    check_epoch(f"{what}: an idle close, then a reopen mid-epoch", sampler, served, before, after)

    def kill_restart():
        state["svc"].kill()
        state["svc"] = Service(f"{source}-after-kill")
        deliver(1)

    before, served, after = one("kill", kill_restart)
    check_epoch(f"{what}: a kill and a restart mid-epoch", sampler, served, before, after)

    # A rebuild swaps the files mid-epoch (the service must be stopped: one writer per output).
    stop()
    old = h5_truth(OUT, "training")

    def rebuild():
        env = {k: v for k, v in os.environ.items() if k != "AILHD_CONFIG"}
        r = subprocess.run([BIN, "--config", CONFIG, "rebuild"], env=env, capture_output=True,
                           text=True)
        if r.returncode != 0:
            fail(f"rebuild failed: {r.stderr}")

    ident = os.stat(os.path.join(OUT, "TRAINING_DATASET.H5")).st_ino
    before, served, after = one("rebuild", rebuild)
    if os.stat(os.path.join(OUT, "TRAINING_DATASET.H5")).st_ino == ident:
        fail("the rebuild did not replace the files")
    check_epoch(f"{what}: a rebuild swapping the files mid-epoch (old files served)", sampler,
                served, before, before, old_truth=old)
    new = h5_truth(OUT, "training")
    served = run_epoch(loader)
    check_epoch(f"{what}: the epoch after the rebuild (new files)", sampler, served, new, new)
    state["svc"] = Service(f"{source}-after-rebuild")
    print(f"{what}: stop, restart, idle close and reopen, kill and restart, rebuild mid-epoch: "
          "each epoch served its snapshot, no error")
    return state["svc"]


def replay():
    """recent_share: the epoch is one pass over every row plus draws from the rows new since the
    previous epoch, which make up the chosen share; none in the first epoch."""
    ds = LiveDataset(OUT, "training", "npy")
    s = LiveSampler(ds, recent_share=0.5)
    first = s.draw()
    if len(first) != len(ds):
        fail(f"replay: first epoch {len(first)} samples for {len(ds)} rows")
    before = ds.committed_rows
    deliver(3)
    wait_committed("replay")
    plan = s.draw()
    n = len(ds)
    rows = (plan & ((1 << 32) - 1))
    counts = np.bincount(rows, minlength=ds.committed_rows)
    if len(plan) != 2 * n or not np.all(counts[ds.rows] >= 1):
        fail(f"replay: {len(plan)} samples for {n} rows (want {2 * n}, every row at least once)")
    extra = counts.copy()
    extra[ds.rows] -= 1
    if extra[:before].any() or extra.sum() != n:
        fail("replay: extra draws from rows that are not new")
    keep = LiveSampler(ds, recent_share=0.25, recent_rows=2)
    plan = keep.draw()
    rows = plan & ((1 << 32) - 1)
    top = set(ds.rows[-2:].tolist())
    extra = len(plan) - len(ds)
    if extra != round(len(ds) / 3) or sum(r in top for r in rows.tolist()) != extra + 2:
        fail(f"replay: recent_rows=2 drew {extra} extra samples")
    print(f"recency-weighted replay: {n} rows + {n} draws from the {counts[before:].size} new rows")


def rank_main(rank, world, init, out_q):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ds = LiveDataset(OUT, "training", "hdf5")
    s = LiveSampler(ds, seed=5)
    loader = DataLoader(ds, batch_size=3, sampler=s, num_workers=1, collate_fn=collate_rows)
    got = []
    for epoch in range(2):
        s.set_epoch(epoch)
        rows = run_epoch(loader)[0]
        got.append((rows.tolist(), s.epoch_rows.tolist(), len(s)))
    out_q.put((rank, got))
    dist.barrier()
    dist.destroy_process_group()


def distributed():
    """Two ranks (gloo, file:// rendezvous): the same epoch split between them, rank 0's
    snapshot for both, with a recording delivered while the ranks start."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    tmpdir = tempfile.mkdtemp()
    init = "file://" + os.path.join(tmpdir, "rendezvous")
    procs = [ctx.Process(target=rank_main, args=(r, 2, init, q)) for r in range(2)]
    for p in procs:
        p.start()
    deliver(1)
    res = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            fail(f"distributed: a rank exited {p.exitcode}")
    for epoch in range(2):
        (r0, pop0, n0), (r1, pop1, n1) = res[0][epoch], res[1][epoch]
        if pop0 != pop1:
            fail(f"distributed, epoch {epoch}: the ranks drew from different snapshots")
        if n0 != n1 or len(r0) != n0 or len(r1) != n1:
            fail(f"distributed, epoch {epoch}: {len(r0)} and {len(r1)} samples, len {n0} {n1}")
        if sorted(set(r0) | set(r1)) != sorted(pop0) or len(r0) + len(r1) - len(pop0) > 1:
            fail(f"distributed, epoch {epoch}: the ranks' samples do not split the epoch")
    print(f"distributed: 2 ranks split each epoch of rank 0's snapshot ({len(pop0)} rows)")


def main():
    svc = Service(0)
    try:
        t = time.time()
        while not (os.path.exists(os.path.join(OUT, "TRAINING_DATASET.H5"))
                   and os.path.exists(os.path.join(OUT, "npy", "training", "attributes.json"))):
            if time.time() - t > TIMEOUT:
                fail("the service made no outputs")
            time.sleep(0.05)
        wait_committed("initial recordings")
        for source in SOURCES:
            for persistent in (True, False):
                for ctx in ("fork", "spawn"):
                    online(source, persistent, ctx)
        for source, ctx in zip(SOURCES, ("fork", "spawn")):
            plain_shuffle(source, ctx)
        for source in SOURCES:
            svc = service_events(source, svc)
        replay()
        distributed()
        svc.stop()
    except BaseException:
        svc.p.kill()
        print(f"service log:\n{open(svc.log).read()[-5000:]}", file=sys.stderr)
        raise
    print("reader_online: OK")


if __name__ == "__main__":
    main()
