#!/usr/bin/env python3
"""The cost of `LiveDataset.refresh()` after new rows from the real service, for two versions of
`ailhd_reader` side by side (issue 31: "a refresh after 1,000 new rows in a few milliseconds").

    python3 benches/reader_refresh.py --scratch DIR [--make 200000] [--bin PATH]
        [--baseline PYTHON_DIR] [--rounds 8] [--new 1000]

--scratch: the folder `benches/reader_online.py --scratch DIR` uses (rec/, out/, state/); with
--make N it is (re)made first, as reader_online.py makes it. Each version runs in a process of
its own (HDF5 shares one open file, and its metadata cache, within a process), holding a
`LiveDataset` per source (npy, HDF5) and a pickled copy of each as a worker holds it; it times
the first refresh (opening the files) and refreshes with nothing new (median of 5). Each
round, `ailhd run` appends --new recordings; once both outputs have committed them, every
process refreshes each source (the versions take turns going first), and the worker copies are
asked for a new row's key (catch-up and one row; each round's copy is made after the previous
round, so it also reads the chunk index once). Prints each figure per round and the medians.
REFRESH_PARTS=columns,_extend_chunks,... adds the time spent in those methods of
`_Hdf5Files` (or `module:Class.method`) to each round's line; REFRESH_PROFILE=hdf5 prints a
cProfile of each HDF5 refresh.
"""

import argparse
import json
import os
import pickle
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("npy", "hdf5")


def serve(python_dir, out_dir):
    """A version's process: commands on stdin, one JSON answer per line on stdout."""
    sys.path.insert(0, python_dir)
    from ailhd_reader import LiveDataset

    parts = {}
    if os.environ.get("REFRESH_PARTS"):  # time spent in each of these methods, per refresh
        from ailhd_reader import _live

        def timed(name, fn):
            def w(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    parts[name] = parts.get(name, 0) + (time.perf_counter() - t) * 1e3
            return w

        for name in os.environ["REFRESH_PARTS"].split(","):
            cls, _, meth = name.rpartition(".")
            mod, _, cls = cls.rpartition(":")
            cls = getattr(__import__(mod, fromlist=["x"]) if mod else _live, cls or "_Hdf5Files")
            if hasattr(cls, meth):
                setattr(cls, meth, timed(name, getattr(cls, meth)))
    ds, start = {}, {}
    for s in SOURCES:
        t = time.perf_counter()
        ds[s] = LiveDataset(out_dir, "training", s)
        start[f"{s} first"] = (time.perf_counter() - t) * 1e3
    for s in SOURCES:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            ds[s].refresh()
            times.append((time.perf_counter() - t) * 1e3)
        start[f"{s} nothing new"] = statistics.median(times)
    clones = {}

    def clone():
        for s, d in ds.items():
            clones[s] = pickle.loads(pickle.dumps(d))
            clones[s][0]  # files open in the copy, as in a worker that served a batch

    clone()
    start["committed"] = {s: d.committed_rows for s, d in ds.items()}
    print(json.dumps(start), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "refresh":
            d = ds[cmd[1]]
            parts.clear()
            from ailhd_reader import _live

            marks = getattr(_live, "MARKS", None)  # (an instrumented copy, to find slow lines)
            if marks is not None:
                marks.clear()
                _live._M0()
            prof = None
            if os.environ.get("REFRESH_PROFILE") == cmd[1]:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            t, c = time.perf_counter(), time.process_time()
            d.refresh()
            ms = (time.perf_counter() - t) * 1e3
            cpu = (time.process_time() - c) * 1e3
            if marks is not None:
                parts.update((k, v) for k, v in marks.items() if v >= 0.1)
            if prof is not None:
                import pstats

                prof.disable()
                pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
            print(json.dumps({"ms": ms, "cpu": cpu, "committed": d.committed_rows, "parts": parts,
                              "lookups": getattr(d._files, "lookups", 0)}), flush=True)
        elif cmd[0] == "catchup":
            c = clones[cmd[1]]
            key = int(ds[cmd[1]].keys[-1])
            t = time.perf_counter()
            c[key]
            print(json.dumps({"ms": (time.perf_counter() - t) * 1e3}), flush=True)
        elif cmd[0] == "clone":
            clone()
            print("{}", flush=True)


class Version:
    def __init__(self, name, python_dir, out_dir):
        self.name = name
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve",
                                   python_dir, out_dir], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        self.start = json.loads(self.p.stdout.readline())

    def ask(self, *cmd):
        self.p.stdin.write(" ".join(cmd) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait(60)


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        return serve(sys.argv[2], sys.argv[3])
    sys.path.insert(0, HERE)
    import reader_online as ro

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scratch", required=True)
    ap.add_argument("--make", type=int, help="make the scratch folder first with this many clips")
    default_bin = os.path.join(HERE, "..", "target", "release", "ailhd")
    ap.add_argument("--bin", default=default_bin)
    ap.add_argument("--baseline", help="a python/ folder of another version of ailhd_reader")
    ap.add_argument("--this", default=os.path.join(HERE, "..", "python"),
                    help="the python/ folder of the version measured (default: this tree's)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--new", type=int, default=1000)
    a = ap.parse_args()
    binary = os.path.abspath(a.bin)
    root, out_dir, state = (os.path.join(a.scratch, x) for x in ("rec", "out", "state"))
    cfg = ro.config(root, out_dir, state)
    if a.make:
        import shutil

        for d in (root, out_dir, state):
            shutil.rmtree(d, ignore_errors=True)
        ro.make_clips(root, 0, a.make)
        subprocess.run([binary, "--config", cfg, "rebuild"], check=True, env=ro.env(),
                       stdout=subprocess.DEVNULL)
    first = sum(len(fs) for _, _, fs in os.walk(root))
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines()
                  if ln.startswith("Model name")), "?")
    print(f"machine: {model}, {os.cpu_count()} CPUs; load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}; {time.strftime('%Y-%m-%d')}")
    versions = [Version("this", os.path.abspath(a.this), out_dir)]
    if a.baseline:
        versions.insert(0, Version("baseline", os.path.abspath(a.baseline), out_dir))
    print(f"{out_dir}: committed {versions[-1].start['committed']}")
    for v in versions:  # (the service is not running yet: nothing new)
        print(f"  {v.name}: " + ", ".join(f"{k} {x:.2f} ms" for k, x in v.start.items()
                                         if k != "committed")
              + " (the first refresh opens the files; nothing new: median of 5)")
    figures = {(v.name, s, what): [] for v in versions for s in SOURCES
               for what in ("refresh", "cpu", "catch-up")}
    log = open(os.path.join(a.scratch, "bench-refresh-run.log"), "w")
    svc = subprocess.Popen([binary, "--config", cfg, "run"], env=ro.env(),
                           stdout=subprocess.DEVNULL, stderr=log)

    def h5_committed():
        import h5py

        with h5py.File(os.path.join(out_dir, "TRAINING_DATASET.H5"), "r", swmr=True,
                       libver="latest", locking=False) as f:
            return int(f["committed_rows"][0])

    try:
        for r in range(a.rounds):
            target = ro.committed(out_dir) + a.new
            ro.make_clips(root, first + r * a.new, a.new, seed=99 + r)
            t = time.perf_counter()
            while ro.committed(out_dir) < target:
                if svc.poll() is not None or time.perf_counter() - t > 600:
                    raise SystemExit(f"the service did not commit {a.new} new rows "
                                     f"(exit {svc.poll()}); see {log.name}")
                time.sleep(0.05)
            while h5_committed() < target:
                time.sleep(0.05)
            time.sleep(0.3)
            order = versions if r % 2 == 0 else versions[::-1]
            line = []
            for s in SOURCES:
                for v in order:
                    got = v.ask("refresh", s)
                    figures[(v.name, s, "refresh")].append(got["ms"])
                    figures[(v.name, s, "cpu")].append(got["cpu"])
                    line.append(f"{v.name} {s} {got['ms']:.2f} ms (cpu {got['cpu']:.2f}, -> "
                                f"{got['committed']:,}"
                                + (f", {got['lookups']} asked" if s == "hdf5" else "") + ")"
                                + "".join(f" {k} {x:.2f}" for k, x in got["parts"].items()))
            for s in SOURCES:
                for v in order:
                    figures[(v.name, s, "catch-up")].append(v.ask("catchup", s)["ms"])
            for v in versions:
                v.ask("clone")
            print(f"round {r}: " + "; ".join(line), flush=True)
    finally:
        svc.send_signal(signal.SIGTERM)
        svc.wait(120)
        for v in versions:
            v.close()
    print(f"medians of {a.rounds} rounds: refresh after {a.new:,} new rows (wall clock; cpu: the "
          "process's CPU time during it, user and system) / a worker's copy asked for a new "
          "row's key:")
    for (name, s, what), xs in figures.items():
        print(f"  {name:8s} {s:4s} {what:8s}: median {statistics.median(xs):6.2f} ms  "
              f"(min {min(xs):.2f}, max {max(xs):.2f})")


if __name__ == "__main__":
    main()
