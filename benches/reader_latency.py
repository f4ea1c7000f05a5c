#!/usr/bin/env python3
"""Service latency as a trainer's h5py SWMR reader sees it: from a recording renamed into the
tree to its row below `committed_rows` (not as the service counts it).

Runs each given `ailhd` binary in turn on a fresh tree (alternating, `--rounds` times), feeds
`--rate` recordings/s for `--seconds`, while one h5py SWMR reader polls the three split files
every millisecond, and prints p50 / p90 / p99 / max per run and the medians per binary, with
what the service wrote to the disk per recording (its `write_bytes`, syncs included) and the
CPU time it used per recording (user + system, every thread) over the stream.

Before the timed stream, one recording is fed and waited for (its time from the outputs'
appearance is printed as "first row"): a GPU featuriser may still be starting then, and the
stream measures the warm service.

usage: python3 benches/reader_latency.py BIN [BIN ...] [--rate 100] [--seconds 20] [--rounds 2]
                                         [--device cpu|cuda|auto] [--log-dir DIR]
                                         [--ingest KEY=VALUE ...] [--idle-first S]
                                         [--stall-ms MS]

`--idle-first S`: in the first round, the service idles S seconds after its first row before the
stream (it closes its files after `ingest.idle_close_s`, 60 s by default), as after a quiet spell.

Beside each stream a probe process sleeps 1 ms at a time and notes every wake-up more than 20 ms
late (`--stall-ms`): a stall of the whole machine (this VM's host, say) shows there too, one of
the service alone does not. Each run prints how many such gaps there were, and whether one
overlapped the slowest recording's wait; `--log-dir` keeps them too (CLOCK_MONOTONIC, as the
recordings' times).
"""
import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import h5py
import numpy as np

NAMES = ["TRAINING_DATASET.H5", "VALIDATION_DATASET.H5", "TESTING_DATASET.H5"]


def clip(seed, samples=40960):
    """A 4096 Hz, 16-bit mono WAV of noise (10 s unless told), distinct per seed."""
    data = np.random.default_rng(seed).integers(-3000, 3000, samples, dtype=np.int16).tobytes()
    head = b"RIFF" + (36 + len(data)).to_bytes(4, "little") + b"WAVEfmt "
    head += (16).to_bytes(4, "little") + (1).to_bytes(2, "little") + (1).to_bytes(2, "little")
    head += (4096).to_bytes(4, "little") + (8192).to_bytes(4, "little")
    head += (2).to_bytes(2, "little") + (16).to_bytes(2, "little")
    return head + b"data" + len(data).to_bytes(4, "little") + data


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


# The machine-stall probe: a process of its own (not a thread of this one, which the reader's
# loop keeps busy), printing the CLOCK_MONOTONIC start and length of every late wake-up.
PROBE = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
late = float(sys.argv[1]) / 1e3
t = time.monotonic()
while True:
    time.sleep(0.001)
    n = time.monotonic()
    if n - t > late:
        print(f"{t:.4f} {(n - t) * 1e3:.1f}", flush=True)
    t = n
"""


def machine_gaps(probe):
    """Stop the probe; its late wake-ups as (start, ms)."""
    probe.send_signal(signal.SIGTERM)
    out, _ = probe.communicate(timeout=10)
    return [(float(t), float(ms)) for t, ms in (line.split() for line in out.splitlines())]


def one_run(binary, rate, seconds, seed, device="cpu", log_dir=None, ingest=(), idle=0.0,
            stall_ms=20.0):
    with tempfile.TemporaryDirectory() as d:
        rec, out, state = (os.path.join(d, x) for x in ("rec", "out", "state"))
        for label in ("LEAK", "NORMAL"):
            os.makedirs(os.path.join(rec, label))
        os.makedirs(os.path.join(d, "incoming"))
        cfg = os.path.join(d, "ailhd.toml")
        with open(cfg, "w") as f:
            f.write(f'[paths]\nrecordings = "{rec}"\noutput = "{out}"\nstate = "{state}"\n')
            f.write(f'[ingest]\ndevice = "{device}"\nrescan_interval_s = 0\n')
            f.writelines(f"{kv}\n" for kv in ingest)
        env = dict(os.environ, RUNTIME_DIRECTORY=os.path.join(d, "run"))
        log = open(os.path.join(d, "run.log"), "w")
        svc = subprocess.Popen([binary, "--config", cfg, "run"], stdout=log, stderr=log, env=env)
        try:
            deadline = time.time() + 30
            while not all(os.path.exists(os.path.join(out, n)) for n in NAMES):
                assert time.time() < deadline, "the service did not create its outputs"
                time.sleep(0.05)
            appeared = time.monotonic()
            files = [open_swmr(os.path.join(out, n)) for n in NAMES]
            first = first_row(files, os.path.join(d, "incoming"), rec, seed)
            first_ms = (first - appeared) * 1e3
            # The service (and the machine) idle before the stream, as after a quiet night: the
            # service closes its files after `idle_close_s` and reopens them for the stream.
            time.sleep(idle)
            n = int(rate * seconds)
            renamed, seen = {}, {}
            bodies = [clip(seed * 1_000_000 + i) for i in range(n)]

            def feed():
                t0 = time.monotonic()
                for i in range(n):
                    label = ("LEAK", "NORMAL")[i % 2]
                    name = f"S{i % 50:03d}~R{i}~20250118120530~100.wav"
                    tmp = os.path.join(d, "incoming", name)
                    with open(tmp, "wb") as f:
                        f.write(bodies[i])
                    rel = f"{label}/{name}"
                    renamed[rel] = time.monotonic()
                    os.rename(tmp, os.path.join(rec, rel))
                    time.sleep(max(0.0, t0 + (i + 1) / rate - time.monotonic()))

            probe = subprocess.Popen([sys.executable, "-c", PROBE, str(stall_ms)],
                                     stdout=subprocess.PIPE, text=True)
            written0, cpu0 = disk_writes(svc.pid), cpu_seconds(svc.pid)
            feeder = threading.Thread(target=feed)
            feeder.start()
            done = [int(f["committed_rows"][0]) for f in files]
            end = None
            while len(seen) < n:
                now = time.monotonic()
                if not feeder.is_alive():
                    end = end or now + 30
                    if now > end:
                        break
                for k, f in enumerate(files):
                    f["committed_rows"].refresh()
                    c = int(f["committed_rows"][0])
                    if c > done[k]:
                        f["source_path"].refresh()
                        for p in f["source_path"][done[k]:c]:
                            seen.setdefault(p.decode().rstrip("\0"), now)
                        done[k] = c
                time.sleep(0.001)
            feeder.join()
            written = disk_writes(svc.pid) - written0
            cpu = cpu_seconds(svc.pid) - cpu0
            gaps = machine_gaps(probe)
            for f in files:
                f.close()
        finally:
            svc.send_signal(signal.SIGTERM)
            svc.wait(timeout=60)
            log.close()
            if log_dir:
                # The service's log and each recording's (renamed, seen) times, for a look at a
                # tail (CLOCK_MONOTONIC too, to line them up with other probes of the machine).
                tag = f"{device}-{rate:g}-{seed}"
                os.makedirs(log_dir, exist_ok=True)
                with open(os.path.join(d, "run.log")) as src, \
                        open(os.path.join(log_dir, f"service-{tag}.log"), "w") as dst:
                    dst.write(src.read())
                with open(os.path.join(log_dir, f"stalls-{tag}.txt"), "w") as f:
                    f.write("start_monotonic_s ms\n")
                    f.writelines(f"{t:.4f} {ms:.1f}\n" for t, ms in gaps)
                t0 = min(renamed.values(), default=0.0)
                with open(os.path.join(log_dir, f"latency-{tag}.csv"), "w") as f:
                    f.write("renamed_s,latency_ms,path,renamed_monotonic_s\n")
                    for p, t in sorted(renamed.items(), key=lambda kv: kv[1]):
                        lat_ms = (seen[p] - t) * 1e3 if p in seen else float("nan")
                        f.write(f"{t - t0:.4f},{lat_ms:.2f},{p},{t:.4f}\n")
        lat = sorted((seen[p] - t) * 1e3 for p, t in renamed.items() if p in seen)
        missing = len(renamed) - len(lat)
        q = lambda x: lat[min(len(lat) - 1, int(x * len(lat)))]
        # Did the machine stall while the slowest recording waited?
        slowest = max((p for p in renamed if p in seen), key=lambda p: seen[p] - renamed[p])
        overlap = [ms for t, ms in gaps if t < seen[slowest] and t + ms / 1e3 > renamed[slowest]]
        return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": lat[-1], "missing": missing,
                "first": first_ms, "gaps": [ms for _, ms in gaps], "gaps_at_max": overlap,
                "disk_kb": written / 1e3 / max(1, len(lat)), "stall_ms": stall_ms,
                "cpu_ms": cpu * 1e3 / max(1, len(lat))}


def cpu_seconds(pid):
    """CPU time process `pid` has used so far, user + system, all its threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def disk_writes(pid):
    """Bytes process `pid` has caused to be written to storage (`write_bytes` of /proc/PID/io:
    what its writes and syncs sent to the disk, the file system's journal aside)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def open_swmr(path, limit=30):
    """An h5py SWMR reader of `path`, once the service has switched it to SWMR writing (the
    file may appear a moment before)."""
    end = time.monotonic() + limit
    while True:
        try:
            return h5py.File(path, "r", libver="latest", swmr=True)
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.01)


def first_row(files, incoming, rec, seed, limit=60):
    """Feed one recording and wait until a reader sees a row; when it did."""
    name = "S999~R999999~20250118120530~100.wav"
    tmp = os.path.join(incoming, name)
    with open(tmp, "wb") as f:
        f.write(clip(seed * 1_000_000 + 999_999))
    os.rename(tmp, os.path.join(rec, "LEAK", name))
    end = time.monotonic() + limit
    while time.monotonic() < end:
        for f in files:
            f["committed_rows"].refresh()
            if int(f["committed_rows"][0]) > 0:
                return time.monotonic()
        time.sleep(0.001)
    raise AssertionError("the first recording never showed")


def machine(res):
    """The probe's findings, in words."""
    gaps = res["gaps"]
    if not gaps:
        return f"the machine never stalled over {res['stall_ms']:g} ms"
    at_max = (f"one of {max(res['gaps_at_max']):.0f} ms while the slowest recording waited"
              if res["gaps_at_max"] else "none while the slowest recording waited")
    return (f"the machine stalled {len(gaps)} times over {res['stall_ms']:g} ms "
            f"(max {max(gaps):.0f} ms), {at_max}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bins", nargs="+")
    ap.add_argument("--rate", type=float, default=100)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--log-dir", help="keep each run's service log and per-recording times here")
    ap.add_argument("--ingest", action="append", default=[], metavar="KEY=VALUE",
                    help="an [ingest] setting for every run, e.g. max_batch_latency_ms=5")
    ap.add_argument("--stall-ms", type=float, default=20, metavar="MS",
                    help="the stall probe notes every wake-up this much later than asked")
    ap.add_argument("--idle-first", type=float, default=0, metavar="S",
                    help="the first round idles S seconds after its first row before the stream")
    a = ap.parse_args()
    print(f"# {cpu_model()}, {os.cpu_count()} cores; {a.rate:g} recordings/s for {a.seconds:g} s; "
          f"device {a.device}" + (f"; the first round idles {a.idle_first:g} s before its stream"
                                  if a.idle_first else ""))
    results = {b: [] for b in a.bins}
    for r in range(a.rounds):
        for b in a.bins:
            res = one_run(b, a.rate, a.seconds, seed=r + 1, device=a.device, log_dir=a.log_dir,
                          ingest=a.ingest, idle=a.idle_first if r == 0 else 0.0,
                          stall_ms=a.stall_ms)
            results[b].append(res)
            print(f"{b}: round {r + 1}: p50 {res['p50']:.1f} ms, p90 {res['p90']:.1f} ms, "
                  f"p99 {res['p99']:.1f} ms, max {res['max']:.1f} ms, never seen {res['missing']}; "
                  f"{res['disk_kb']:.0f} KB written to disk and {res['cpu_ms']:.2f} ms of CPU "
                  f"a recording; "
                  f"first row {res['first']:.0f} ms after the outputs appeared; {machine(res)}",
                  flush=True)
    for b, rs in results.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("p50", "p90", "p99", "max")}
        print(f"{b}: median of {len(rs)}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items())
              + f", {statistics.median(x['disk_kb'] for x in rs):.0f} KB written to disk and "
              f"{statistics.median(x['cpu_ms'] for x in rs):.2f} ms of CPU a recording")
    if any(x["missing"] for rs in results.values() for x in rs):
        sys.exit(1)


if __name__ == "__main__":
    main()
