#!/usr/bin/env python3
"""Growth benchmark: what the service costs with N recordings already ingested, for several N
side by side ("a year on the acquisition host"). For each N, in `--data DIR/n<N>` (made once,
reused by later runs; `--fresh` makes it anew):

1. a tree of N distinct synthetic recordings (1 s clips, zero-padded to 10 s by the rules: the
   same row shape as real ones, an eighth of the bytes), and `rebuild` of it (files/s, peak RSS);
2. the manifest's size per recording; `status --json` of the stopped service (median time of 5,
   peak RSS);
3. start: exec `run` with a new recording renamed into the tree at once -> that row below
   `committed_rows` as an h5py SWMR reader sees it (median of `--starts` starts);
4. latency as that reader sees it (rename -> row below `committed_rows`, the reader polling
   every millisecond) at 100 recordings/s and at 1,000/s, and the service's RSS;
5. the same at 100/s while the service rescans the whole tree every `--rescan-every` seconds;
6. a soak at 100/s for `--soak` seconds: RSS sampled every 10 s after a warm-up;
7. SIGKILL, restart -> a new recording's row seen;
8. at rest: the restarted service idle for 2 s closes its files and the manifest
   (`idle_close_s`): its RSS then, and the first recording after that (the files reopened):
   the median of `--rest-samples` idle closes, each followed by one recording;
9. the service stopped, `ailhd compact`: its time and peak RSS, and the manifest's size after.

Each run adds a few thousand recordings to the prepared trees (N grows a little: the table
says how many were ingested before each run). A prepared tree that has grown past
`--max-growth` times its N is made anew before it is measured, so that the sizes compared stay
the sizes asked for.

usage: python3 benches/growth.py BIN [--sizes 5000 200000] [--data DIR] [--seconds 20]
       [--soak 300] [--rescan-every 5] [--starts 3] [--rest-samples 5] [--fresh]
       [--max-growth 1.1]
"""
import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reader_latency import NAMES, clip, cpu_model  # noqa: E402

LABELS = ("LEAK", "NORMAL")


def proc_kb(pid, field="VmRSS"):
    """A memory figure of /proc/PID/status in KiB (0 once the process is gone)."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_waited(cmd, env=None):
    """Run to exit; (seconds, peak RSS in MB, exit status). The peak is the process's own
    high-water mark (`VmHWM`), read every 5 ms until it exits: the child's `ru_maxrss` would
    count this Python process's resident memory too (Linux carries the pre-exec high-water mark
    over an exec, vfork or fork), 150 MB here once the 200,000 tree's reader ran."""
    t = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    ended = []
    waiter = threading.Thread(target=lambda: ended.append((p.wait(), time.monotonic())))
    waiter.start()
    peak = 0
    while waiter.is_alive():
        peak = max(peak, proc_kb(p.pid, "VmHWM"))
        time.sleep(0.005)
    code, end = ended[0]
    return end - t, peak / 1024, code


def make_tree(d, n):
    """N distinct 1 s clips, written fast: one noise signal, each clip a window of it with its
    index in the first two samples."""
    rec = os.path.join(d, "rec")
    for label in LABELS:
        os.makedirs(os.path.join(rec, label), exist_ok=True)
    base = np.random.default_rng(1).integers(-3000, 3000, 4096 + 200_000, dtype=np.int16)
    head = clip(0, samples=4096)[:44]
    for i in range(n):
        data = base[i % 200_000:i % 200_000 + 4096].copy()
        data[0], data[1] = i & 0x7FFF, i >> 15
        name = f"S{i % 97:03d}~P{i}~20250118120530~100.wav"
        with open(os.path.join(rec, LABELS[i % 2], name), "wb") as f:
            f.write(head)
            f.write(data.tobytes())


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


def recordings_in(rec):
    """How many recordings a prepared tree holds."""
    return sum(len(os.listdir(os.path.join(rec, label))) for label in LABELS)


class Site:
    """A prepared tree, its outputs and the service's configuration."""

    def __init__(self, d, binary):
        self.d, self.binary = d, binary
        self.rec, self.out, self.state = (os.path.join(d, x) for x in ("rec", "out", "state"))
        self.cfg = os.path.join(d, "ailhd.toml")
        self.env = dict(os.environ, RUNTIME_DIRECTORY=os.path.join(d, "run"))
        self.log = open(os.path.join(d, "run.log"), "a")
        self.serial = int(time.time() * 1000) % 10**9 * 1000
        os.makedirs(os.path.join(d, "incoming"), exist_ok=True)

    def next_body(self):
        self.serial += 1
        return self.serial, clip(self.serial, samples=4096)

    def place(self, rel, body):
        tmp = os.path.join(self.d, "incoming", os.path.basename(rel))
        with open(tmp, "wb") as f:
            f.write(body)
        t = time.monotonic()
        os.rename(tmp, os.path.join(self.rec, rel))
        return t

    def start(self, extra_env=None):
        env = dict(self.env, **(extra_env or {}))
        return subprocess.Popen([self.binary, "--config", self.cfg, "run"], stdout=self.log,
                                stderr=self.log, env=env)

    def stop(self, svc, sig=signal.SIGTERM):
        svc.send_signal(sig)
        svc.wait(timeout=300)

    def recordings(self):
        return recordings_in(self.rec)


def stream(site, reader, svc, rate, seconds, sample_rss=None):
    """Feed `rate` recordings/s for `seconds`; latencies as the reader sees them."""
    n = int(rate * seconds)
    bodies = [site.next_body() for _ in range(n)]
    renamed = {}

    def feed():
        t1 = time.monotonic()
        for i, (serial, body) in enumerate(bodies):
            rel = f"{LABELS[i % 2]}/S{i % 50:03d}~N{serial}~20250118120530~100.wav"
            renamed[rel] = site.place(rel, body)
            time.sleep(max(0.0, t1 + (i + 1) / rate - time.monotonic()))

    feeder = threading.Thread(target=feed)
    feeder.start()
    next_sample = time.monotonic()
    while feeder.is_alive():
        reader.poll()
        if sample_rss is not None and time.monotonic() >= next_sample:
            sample_rss.append((time.monotonic(), proc_kb(svc.pid) / 1024))
            next_sample += 10
        time.sleep(0.001)
    for rel in list(renamed):
        reader.wait_for(rel, limit=30)
    lat = sorted((reader.seen[p] - t) * 1e3 for p, t in renamed.items() if p in reader.seen)
    q = lambda x: lat[min(len(lat) - 1, int(x * len(lat)))]
    return {"p50": q(0.5), "p99": q(0.99), "max": lat[-1], "never seen": len(renamed) - len(lat)}


def start_probe(site, reader, tag, label="LEAK", extra_env=None):
    """exec -> a recording renamed into the tree at once shows as a row: (service, ms)."""
    t0 = time.monotonic()
    svc = site.start(extra_env)
    serial, body = site.next_body()
    rel = f"{label}/S000~{tag}{serial}~20250118120530~100.wav"
    site.place(rel, body)
    seen = reader.wait_for(rel)
    return svc, ((seen - t0) * 1e3 if seen else float("nan"))


IDLE_CLOSE_S = 2


def idle_closes(site):
    """How many idle closes the service's log holds so far."""
    site.log.flush()
    with open(os.path.join(site.d, "run.log"), errors="replace") as f:
        return f.read().count("outputs closed")


def at_rest(site, reader, svc, closes_before):
    """The service at rest: once idle for IDLE_CLOSE_S it closes its files and the manifest.
    Its RSS then, and what the first recording after that waits (the files reopened)."""
    end = time.monotonic() + 60
    while idle_closes(site) <= closes_before and time.monotonic() < end:
        time.sleep(0.1)
    time.sleep(0.5)
    rss = proc_kb(svc.pid) / 1024
    serial, body = site.next_body()
    rel = f"LEAK/S000~rest{serial}~20250118120530~100.wav"
    placed = site.place(rel, body)
    seen = reader.wait_for(rel)
    return {
        "RSS at rest (idle close) MB": rss,
        "first recording after the idle close ms": (seen - placed) * 1e3 if seen else float("nan"),
    }


def manifest_sizes(site):
    """The manifest's bytes per recording: apparent, and what the disk holds (`du`: sled's
    free log segments are holes)."""
    files = [os.stat(os.path.join(r, f))
             for r, _, fs in os.walk(os.path.join(site.state, "manifest")) for f in fs]
    n = site.recordings()
    return (sum(st.st_size for st in files) / n, sum(st.st_blocks * 512 for st in files) / n)


def prepare(d, n, binary, fresh, max_growth):
    made = {}
    if not fresh and max_growth > 0 and os.path.exists(os.path.join(d, "prepared")):
        held = recordings_in(os.path.join(d, "rec"))
        if held > max_growth * n:
            print(f"# the tree for {n:,} holds {held:,} recordings (earlier runs added them): "
                  "made anew", flush=True)
            fresh = True
    if fresh and os.path.exists(d):
        shutil.rmtree(d)
    if not os.path.exists(os.path.join(d, "prepared")):
        os.makedirs(d, exist_ok=True)
        t = time.monotonic()
        make_tree(d, n)
        made["tree s"] = time.monotonic() - t
        with open(os.path.join(d, "ailhd.toml"), "w") as f:
            f.write(f'[paths]\nrecordings = "{d}/rec"\noutput = "{d}/out"\nstate = "{d}/state"\n')
            f.write('[ingest]\ndevice = "cpu"\nrescan_interval_s = 0\n')
        secs, rss, code = run_waited([binary, "--config", os.path.join(d, "ailhd.toml"), "rebuild"])
        assert code == 0, f"rebuild exited {code}"
        made["rebuild files/s"] = n / secs
        made["rebuild peak RSS MB"] = rss
        open(os.path.join(d, "prepared"), "w").close()
    return made


def one_size(a, n):
    d = os.path.join(a.data, f"n{n}")
    res = prepare(d, n, a.binary, a.fresh, a.max_growth)
    site = Site(d, a.binary)
    res["recordings before this run"] = site.recordings()
    if a.rebuild:
        secs, rss, code = run_waited([a.binary, "--config", site.cfg, "rebuild"], site.env)
        assert code == 0, f"rebuild exited {code}"
        res["rebuild files/s"] = site.recordings() / secs
        res["rebuild peak RSS MB"] = rss
    res["manifest B/recording"], res["manifest B/recording on disk"] = manifest_sizes(site)
    times, peak = [], 0
    for _ in range(5):
        secs, rss, code = run_waited([a.binary, "--config", site.cfg, "status", "--json"], site.env)
        assert code == 0, f"status exited {code}"
        times.append(secs)
        peak = max(peak, rss)
    res["status (stopped) ms"] = statistics.median(times) * 1e3
    res["status peak RSS MB"] = peak

    reader = Reader(site.out)
    starts = []
    for k in range(a.starts):
        svc, ms = start_probe(site, reader, f"start{k}x")
        starts.append(ms)
        if k + 1 < a.starts:
            site.stop(svc)
    res["start: exec -> new row ms"] = statistics.median(starts)
    res["start: each run ms"] = " / ".join(f"{x:.0f}" for x in starts)

    rss0 = proc_kb(svc.pid) / 1024
    r100 = stream(site, reader, svc, 100, a.seconds)
    res["100/s p50 / p99 / max ms"] = f"{r100['p50']:.1f} / {r100['p99']:.1f} / {r100['max']:.0f}"
    r1000 = stream(site, reader, svc, 1000, max(2.0, a.seconds / 4))
    res["1,000/s p50 / p99 / max ms"] = f"{r1000['p50']:.1f} / {r1000['p99']:.1f} / {r1000['max']:.0f}"
    res["RSS after start / after the streams MB"] = f"{rss0:.0f} / {proc_kb(svc.pid) / 1024:.0f}"
    res["  of which anonymous / file / shared MB"] = " / ".join(
        f"{proc_kb(svc.pid, f) / 1024:.0f}" for f in ("RssAnon", "RssFile", "RssShmem")
    )
    never = r100["never seen"] + r1000["never seen"]

    if a.soak > 0:
        samples = []
        soak = stream(site, reader, svc, 100, a.soak, samples)
        warm = [mb for t, mb in samples if t - samples[0][0] >= 60] or [samples[-1][1]]
        res["soak 100/s p99 ms"] = soak["p99"]
        res["soak RSS after 1 min -> end MB"] = f"{warm[0]:.0f} -> {warm[-1]:.0f} (max {max(warm):.0f})"
        never += soak["never seen"]

    if a.rescan_every > 0:
        site.stop(svc)
        svc, _ = start_probe(site, reader, "rescan", "NORMAL",
                             {"AILHD_INGEST__RESCAN_INTERVAL_S": str(a.rescan_every)})
        rr = stream(site, reader, svc, 100, max(a.seconds, 3 * a.rescan_every))
        res[f"100/s with a rescan every {a.rescan_every} s: p50 / p99 / max ms"] = (
            f"{rr['p50']:.1f} / {rr['p99']:.1f} / {rr['max']:.0f}")
        never += rr["never seen"]

    site.stop(svc, signal.SIGKILL)
    closes = idle_closes(site)
    svc, res["after SIGKILL: exec -> new row ms"] = start_probe(
        site, reader, "killed", "NORMAL", {"AILHD_INGEST__IDLE_CLOSE_S": str(IDLE_CLOSE_S)})
    rests = []
    for _ in range(a.rest_samples):
        rests.append(at_rest(site, reader, svc, closes))
        closes = idle_closes(site)
    res["RSS at rest (idle close) MB"] = rests[0]["RSS at rest (idle close) MB"]
    first = sorted(r["first recording after the idle close ms"] for r in rests)
    res["first recording after the idle close ms"] = (
        f"{statistics.median(first):.1f} ({first[0]:.1f}-{first[-1]:.1f}, {len(first)} closes)")
    site.stop(svc)
    reader.close()
    # The state folder as `ailhd compact` leaves it (the service stopped).
    secs, rss, code = run_waited([a.binary, "--config", site.cfg, "compact"], site.env)
    assert code == 0, f"compact exited {code}"
    sizes = manifest_sizes(site)
    res["manifest B/recording after `ailhd compact` (on disk)"] = f"{sizes[0]:.0f} ({sizes[1]:.0f})"
    res["`ailhd compact` s / peak RSS MB"] = f"{secs:.1f} / {rss:.0f}"
    res["never seen"] = never
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--sizes", type=int, nargs="+", default=[5000, 200000])
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "ailhd-growth"))
    ap.add_argument("--seconds", type=float, default=20, help="length of the 100/s stream")
    ap.add_argument("--soak", type=float, default=0, help="seconds of a 100/s soak (0: none)")
    ap.add_argument("--rescan-every", type=int, default=5)
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--rest-samples", type=int, default=5,
                    help="idle closes, each followed by one recording (its median is printed)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the prepared tree again")
    ap.add_argument("--fresh", action="store_true", help="make the trees anew")
    ap.add_argument("--max-growth", type=float, default=1.1,
                    help="make a tree anew once it holds more than this times its N (0: never)")
    a = ap.parse_args()
    a.binary = os.path.abspath(a.binary)
    print(f"# {cpu_model()}, {os.cpu_count()} cores; {a.binary}; data in {a.data}", flush=True)
    results = {}
    for n in a.sizes:
        results[n] = one_size(a, n)
        print(f"# {n} done: {results[n]}", flush=True)
    keys = []
    for n in a.sizes:
        keys += [k for k in results[n] if k not in keys]
    print(f"| | {' | '.join(f'{n:,}' for n in a.sizes)} |")
    print(f"|---|{'---|' * len(a.sizes)}")
    for k in keys:
        cells = []
        for n in a.sizes:
            v = results[n].get(k, "")
            cells.append(f"{v:,.1f}" if isinstance(v, float) else str(v))
        print(f"| {k} | {' | '.join(cells)} |")
    if any(r["never seen"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
