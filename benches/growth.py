#!/usr/bin/env python3
"""Growth benchmark: what the service costs with N recordings already ingested, for several N
side by side (issue: "a year on the acquisition host"). For each N, in one temporary folder:

1. a tree of N distinct synthetic recordings (1 s clips, zero-padded to 10 s by the rules: the
   same row shape as real ones, an eighth of the bytes), and `rebuild` of it (peak RSS);
2. the manifest's size per recording; `status --json` of the stopped service (time, RSS);
3. start: exec `run` with a new recording renamed into the tree at once -> that row below
   `committed_rows` as an h5py SWMR reader sees it;
4. latency as that reader sees it (rename -> row below `committed_rows`) at `--rate`
   recordings/s for `--seconds`, and the service's RSS before and after;
5. SIGKILL, restart -> a new recording's row seen.

usage: python3 benches/growth.py BIN [--sizes 5000 200000] [--rate 100] [--seconds 20]
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reader_latency import NAMES, clip, cpu_model  # noqa: E402


def short_clip(i):
    """A distinct 1 s clip (zero-padded to 10 s by the rules)."""
    return clip(i, samples=4096)


def rss_kb(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_waited(cmd, env=None):
    """Run to exit; (seconds, peak RSS in MB, exit status)."""
    t = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    return time.monotonic() - t, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


class Reader:
    """An h5py SWMR reader noting when each source_path first shows below committed_rows."""

    def __init__(self, out):
        self.files = [h5py.File(os.path.join(out, n), "r", libver="latest", swmr=True) for n in NAMES]
        self.done = [int(f["committed_rows"][0]) for f in self.files]
        self.seen = {}

    def poll(self):
        now = time.monotonic()
        for k, f in enumerate(self.files):
            f["committed_rows"].refresh()
            c = int(f["committed_rows"][0])
            if c > self.done[k]:
                f["source_path"].refresh()
                for p in f["source_path"][self.done[k]:c]:
                    self.seen.setdefault(p.decode().rstrip("\0"), now)
                self.done[k] = c

    def wait_for(self, rel, limit=120):
        end = time.monotonic() + limit
        while rel not in self.seen and time.monotonic() < end:
            self.poll()
            time.sleep(0.001)
        return self.seen.get(rel)

    def close(self):
        for f in self.files:
            f.close()


def place(rec, d, rel, body):
    tmp = os.path.join(d, "incoming", os.path.basename(rel))
    with open(tmp, "wb") as f:
        f.write(body)
    t = time.monotonic()
    os.rename(tmp, os.path.join(rec, rel))
    return t


def one_size(binary, n, rate, seconds):
    res = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as d:
        rec, out, state = (os.path.join(d, x) for x in ("rec", "out", "state"))
        for label in ("LEAK", "NORMAL"):
            os.makedirs(os.path.join(rec, label))
        os.makedirs(os.path.join(d, "incoming"))
        t = time.monotonic()
        for i in range(n):
            label = ("LEAK", "NORMAL")[i % 2]
            with open(os.path.join(rec, label, f"S{i % 97:03d}~P{i}~20250118120530~100.wav"), "wb") as f:
                f.write(short_clip(i))
        res["tree s"] = time.monotonic() - t
        cfg = os.path.join(d, "ailhd.toml")
        with open(cfg, "w") as f:
            f.write(f'[paths]\nrecordings = "{rec}"\noutput = "{out}"\nstate = "{state}"\n')
            f.write('[ingest]\ndevice = "cpu"\nrescan_interval_s = 0\n')
        env = dict(os.environ, RUNTIME_DIRECTORY=os.path.join(d, "run"))
        secs, rss, code = run_waited([binary, "--config", cfg, "rebuild"], env)
        assert code == 0, f"rebuild exited {code}"
        res["rebuild files/s"] = n / secs
        res["rebuild peak RSS MB"] = rss
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(state, "manifest")) for f in fs)
        res["manifest B/recording"] = size / n
        times = []
        for _ in range(3):
            secs, rss, code = run_waited([binary, "--config", cfg, "status", "--json"], env)
            assert code == 0, f"status exited {code}"
            times.append(secs)
        res["status (stopped) ms"] = sorted(times)[1] * 1e3
        res["status RSS MB"] = rss

        log = open(os.path.join(d, "run.log"), "w")
        reader = Reader(out)
        t0 = time.monotonic()
        svc = subprocess.Popen([binary, "--config", cfg, "run"], stdout=log, stderr=log, env=env)
        first = "LEAK/S000~new0~20250118120530~100.wav"
        place(rec, d, first, clip(10_000_000 + n))
        seen = reader.wait_for(first)
        res["start: exec -> new row ms"] = (seen - t0) * 1e3 if seen else float("nan")

        bodies = [clip(20_000_000 + n + i) for i in range(int(rate * seconds))]
        renamed = {}
        rss_at = [rss_kb(svc.pid)]

        def feed():
            t1 = time.monotonic()
            for i, body in enumerate(bodies):
                rel = f"{('LEAK', 'NORMAL')[i % 2]}/S{i % 50:03d}~N{i}~20250118120530~100.wav"
                renamed[rel] = place(rec, d, rel, body)
                time.sleep(max(0.0, t1 + (i + 1) / rate - time.monotonic()))

        feeder = threading.Thread(target=feed)
        feeder.start()
        while feeder.is_alive():
            reader.poll()
            time.sleep(0.001)
        for rel in list(renamed):
            reader.wait_for(rel, limit=30)
        rss_at.append(rss_kb(svc.pid))
        lat = sorted((reader.seen[p] - t) * 1e3 for p, t in renamed.items() if p in reader.seen)
        res["p50 ms"] = lat[len(lat) // 2]
        res["p99 ms"] = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        res["never seen"] = len(renamed) - len(lat)
        res["RSS start / end MB"] = f"{rss_at[0] / 1024:.0f} / {rss_at[1] / 1024:.0f}"

        svc.send_signal(signal.SIGKILL)
        svc.wait()
        t0 = time.monotonic()
        svc = subprocess.Popen([binary, "--config", cfg, "run"], stdout=log, stderr=log, env=env)
        again = "NORMAL/S000~new1~20250118120530~100.wav"
        place(rec, d, again, clip(30_000_000 + n))
        seen = reader.wait_for(again)
        res["after SIGKILL: exec -> new row ms"] = (seen - t0) * 1e3 if seen else float("nan")
        svc.send_signal(signal.SIGTERM)
        svc.wait(timeout=120)
        reader.close()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--sizes", type=int, nargs="+", default=[5000, 200000])
    ap.add_argument("--rate", type=float, default=100)
    ap.add_argument("--seconds", type=float, default=20)
    a = ap.parse_args()
    print(f"# {cpu_model()}, {os.cpu_count()} cores; {a.binary}; stream {a.rate:g}/s for {a.seconds:g} s")
    results = {}
    for n in a.sizes:
        results[n] = one_size(a.binary, n, a.rate, a.seconds)
        print(f"# {n} done", flush=True)
    keys = list(results[a.sizes[0]])
    print(f"| | {' | '.join(f'{n:,}' for n in a.sizes)} |")
    print(f"|---|{'---|' * len(a.sizes)}")
    for k in keys:
        cells = []
        for n in a.sizes:
            v = results[n][k]
            cells.append(f"{v:,.1f}" if isinstance(v, float) else str(v))
        print(f"| {k} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
