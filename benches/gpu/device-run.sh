#!/usr/bin/env bash
# GPU checks and figures for docs/gpu.md, on a CUDA host with no Rust toolchain.
# Prepare the carry first, here: benches/gpu/prepare-carry.sh (release binary, the test binary
# (its gpu_parity:: tests run here) and daemon benchmark executables, fixtures, make_dataset.py, overlap32.toml in $CARRY, default
# .device-carry). Then, on the device, from the repository root:
#   benches/gpu/device-run.sh [STEP...]
# Steps (default: all, in this order; each can run on its own, the device tool allows 10 minutes
# a call, so a session usually runs "info doctor tests parity", then "dataset", then "bench", then
# "daemon"):
#   info     the GPU, driver, CPU count, CUDA libraries
#   doctor   `ailhd doctor` (libraries, self-test of both setups against the float64 reference)
#   tests    the gpu_parity:: tests with AILHD_REQUIRE_GPU=1 (fail, never skip)
#   parity   rebuild of the fixture tree with --device cuda and cpu, both setups; rows against
#            the reference fixtures and cuda against cpu, read with h5py (parity.py)
#   dataset  the benchmark tree: $N clips (default 39,563) made by make_tree.py (every core)
#   bench    two rounds of: rebuild --device cuda (peak GPU memory sampled), rebuild --device
#            cpu, the torchaudio implementation of the same job (torchaudio_baseline.py)
#   daemon   the service at 100 clips/s and a burst, featurising on the GPU (daemon benchmark)
#   latency  the warm service at 100 and 1,000 clips/s as an h5py SWMR reader sees it, cuda and
#            cpu (benches/reader_latency.py); with a baseline, both builds taking turns
#   ceiling  benches/rebuild.rs --ceiling on 4, 8 and all cores (carried as rebuild_bench); with
#            a baseline, its rebuild_bench first at each core count
#   compare  the benchmark tree rebuilt by a baseline build and by this one, whole processes
#            taking turns, $ROUNDS rounds (default 3) on each of $DEVICES (default "cpu cuda");
#            wall, files/s and the report's phases and stages per run
#   storage  whether the disk caps rebuild: dd's write rates where $WORK is, then the tree
#            rebuilt by each build with its outputs there and in memory (/dev/shm)
# Baselines (builds before a change, measured in the same call): $BASE, one folder or several
# separated by spaces (default $CARRY/base), each holding its ailhd and rebuild_bench, which may
# be gzipped (the carry's 64 MiB); runs are labelled by the folder's name. The ceiling and
# latency steps take the first.
# Results and logs go to $OUT (default /tmp/ailhd-gpu); scratch to $WORK (default /tmp/ailhd-work).
set -uo pipefail
CARRY=${CARRY:-.device-carry}
OUT=${OUT:-/tmp/ailhd-gpu}
W=${WORK:-/tmp/ailhd-work}
N=${N:-39563}
BASE=${BASE:-$CARRY/base}
HERE=$(dirname "$(realpath "$0")")
[ -x "$CARRY/ailhd" ] || { echo "no $CARRY/ailhd: run benches/gpu/prepare-carry.sh first and carry $CARRY" >&2; exit 1; }
BIN=$(realpath "$CARRY/ailhd")
mkdir -p "$W" "$OUT"
read -r -a BASES <<<"$BASE"
for b in "${BASES[@]}"; do
    for f in "$b"/*.gz; do [ -e "$f" ] && gunzip -f "$f" && chmod +x "${f%.gz}"; done
done
BASE=${BASES[0]:-}
steps=${*:-info doctor tests parity dataset bench daemon}
failed=0

conf() { # conf NAME TREE OUTDIR [features-toml]
    {
        printf '[paths]\nrecordings = "%s"\noutput = "%s"\nstate = "%s.state"\n' "$2" "$3" "$3"
        if [ -n "${4:-}" ]; then cat "$4"; fi
    } >"$W/$1.toml"
    echo "$W/$1.toml"
}

# timed LOG CMD...: run CMD, stdout to LOG; prints wall seconds and, where GNU time exists, peak RSS.
timed() {
    local log=$1; shift
    local t0 t1 rc
    t0=$(date +%s.%N)
    if [ -x /usr/bin/time ]; then
        /usr/bin/time -f "%M" -o "$log.rss" "$@" >"$log" 2>"$log.err"; rc=$?
    else
        "$@" >"$log" 2>"$log.err"; rc=$?
    fi
    t1=$(date +%s.%N)
    printf '%.2f s wall' "$(echo "$t1 - $t0" | bc -l 2>/dev/null || python3 -c "print($t1 - $t0)")"
    [ -f "$log.rss" ] && printf ', %s KB peak RSS' "$(tail -1 "$log.rss")"
    [ $rc -eq 0 ] || { printf ' FAILED (exit %s)' $rc; failed=1; }
    echo
}

# summarise REPORT: one line of a `rebuild --json` report (files/s, phases, stages per file).
summarise() {
    python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
f = r["files"]
print("   %d files, %.0f files/s; phases %s; us/file %s" % (f, f / r["elapsed_s"],
      " ".join("%s %.3f" % kv for kv in r["phases_s"].items()),
      " ".join("%s %.1f" % (k, v * 1e6 / f) for k, v in r["stages_s"].items())))' "$1" 2>&1 | cut -c1-400
}

for step in $steps; do
echo "=== $step"
case $step in
info)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/info.txt"
    { nproc; lscpu | grep -m1 'Model name'; free -g | head -2; ldconfig -p | grep -E 'libcuda\.so|libnvrtc|libcufft' | head
      timeout 20 find /usr /opt -xdev \( -name 'libnvrtc.so*' -o -name 'libcufft.so*' \) 2>/dev/null | head; } | tee -a "$OUT/info.txt"
    ;;
doctor)
    "$BIN" doctor 2>&1 | tee "$OUT/doctor.txt" || failed=1
    ;;
tests)
    AILHD_REQUIRE_GPU=1 AILHD_SHARED="$CARRY/shared" "$CARRY/tests" gpu_parity:: --test-threads 1 --nocapture \
        >"$OUT/tests.txt" 2>&1 || failed=1
    grep -E "^test |test result|skipping|panicked|GPU vs reference|DeviceTimes" "$OUT/tests.txt" | head -80
    ;;
parity)
    rm -rf "$W/fx"; mkdir -p "$W/fx/LEAK"; cp "$CARRY"/shared/fixtures/features/wav/*.wav "$W/fx/LEAK/"
    for setup in default overlap32; do
        feat=""; [ $setup = overlap32 ] && feat="$CARRY/overlap32.toml"
        for dev in cuda cpu; do
            rm -rf "$W/out-$setup-$dev" "$W/out-$setup-$dev.state"
            c=$(conf "$setup-$dev" "$W/fx" "$W/out-$setup-$dev" "$feat")
            printf 'rebuild %s --device %s: ' $setup $dev
            timed "$OUT/parity-$setup-$dev.log" "$BIN" --config "$c" rebuild --device $dev
        done
        echo "== $setup: cuda vs reference (and vs cpu)"
        python3 "$HERE/parity.py" "$W/out-$setup-cuda" "$CARRY/shared/fixtures/features/expected/$setup" "$W/out-$setup-cpu" \
            >"$OUT/parity-$setup.txt" 2>&1 || failed=1
        tail -25 "$OUT/parity-$setup.txt"
    done
    ;;
dataset)
    if [ -d "$W/tree" ] && [ "$(find "$W/tree" -name '*.wav' | wc -l)" -eq "$N" ]; then
        echo "tree of $N clips already at $W/tree"
    else
        rm -rf "$W/tree"
        printf 'make_tree.py, %s clips: ' "$N"
        timed "$OUT/dataset.log" python3 "$HERE/make_tree.py" "$W/tree" "$N" 1
    fi
    du -sh "$W/tree"
    ;;
bench)
    [ -d "$W/tree" ] || { echo "no tree: run the dataset step first"; failed=1; continue; }
    find "$W/tree" -type f -exec cat {} + >/dev/null  # warm page cache, as for the CPU figures
    for round in 1 2; do
        for dev in cuda cpu; do
            rm -rf "$W/big-$dev" "$W/big-$dev.state"
            c=$(conf "big-$dev" "$W/tree" "$W/big-$dev")
            smi=""
            if [ $dev = cuda ]; then
                nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 \
                    >"$OUT/gpu-memory-$round.csv" 2>/dev/null &
                smi=$!
            fi
            printf 'rebuild --device %s round %s: ' $dev $round
            timed "$OUT/bench-$dev-$round.json" "$BIN" --verbose --config "$c" rebuild --device $dev --json
            grep -h -E "CUDA start-up|featuriser ready|GPU featuriser," "$OUT/bench-$dev-$round.json.err" | cut -c1-400
            if [ -n "$smi" ]; then
                kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
                echo "  peak GPU memory in use (whole GPU, MiB): $(sort -n "$OUT/gpu-memory-$round.csv" | tail -1)"
            fi
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r[k] for k in r if k not in ('quarantined',)})" \
                "$OUT/bench-$dev-$round.json" 2>&1 | cut -c1-1500
        done
        python3 "$HERE/torchaudio_baseline.py" "$W/tree" "$W/torchaudio.h5" >"$OUT/torchaudio-$round.txt" 2>&1 || failed=1
        echo "torchaudio round $round: $(tail -1 "$OUT/torchaudio-$round.txt")"
    done
    ;;
daemon)
    # The benchmark runs the binary at the path cargo baked into it; put ours there.
    exe=$(cat "$CARRY/daemon_bench.ailhd-path" 2>/dev/null || grep -a -o -m1 '/[A-Za-z0-9_/.-]*/release/ailhd' "$CARRY/daemon_bench" | head -1)
    mkdir -p "$(dirname "$exe")" && cp "$BIN" "$exe"
    read -r -a dargs <<<"${DAEMON_ARGS:-1000 5000}"  # stream clips at 100/s, burst clips
    # The benchmark waits for the service to start: bounded, in case `ailhd run` cannot.
    AILHD_INGEST__DEVICE=cuda timeout "${DAEMON_TIMEOUT:-500}" "$CARRY/daemon_bench" "${dargs[@]}" \
        >"$OUT/daemon-cuda.txt" 2>&1 || { echo "daemon benchmark FAILED (exit $?)"; failed=1; }
    tail -20 "$OUT/daemon-cuda.txt"
    ;;
latency)
    # As a trainer's h5py SWMR reader sees it (rename -> row below committed_rows), the warm
    # service on each device, after a first recording (its "first row" includes the start-up);
    # with a baseline, its binary and this one take turns ($LATENCY_ROUNDS rounds, default 1).
    bins=("$BIN"); [ -x "$BASE/ailhd" ] && bins=("$(realpath "$BASE/ailhd")" "$BIN")
    for rate in 100 1000; do
        secs=10; [ $rate = 1000 ] && secs=5
        for dev in cuda cpu; do
            echo "reader latency, $rate/s, --device $dev:"
            python3 "$HERE/../reader_latency.py" "${bins[@]}" --device $dev --rate $rate --seconds $secs \
                --rounds "${LATENCY_ROUNDS:-1}" >"$OUT/latency-$dev-$rate.txt" 2>&1 || failed=1
            grep -E "round [0-9]+:" "$OUT/latency-$dev-$rate.txt" | sed -E 's|^[^:]*/([^/]*/ailhd):|  \1:|'
        done
    done
    ;;
ceiling)
    # The host pipeline with a pass-through featuriser (benches/rebuild.rs --ceiling) on 4, 8
    # and all cores.
    builds="new"; [ -x "$BASE/rebuild_bench" ] && builds="base new"
    for cores in 4 8 "$(nproc)"; do
        for who in $builds; do
            echo "-- ceiling on $cores cores, $who build"
            exe="$CARRY/rebuild_bench"; [ "$who" = base ] && exe="$BASE/rebuild_bench"
            taskset -c "0-$((cores - 1))" "$exe" --ceiling 5000 >"$OUT/ceiling-$who-$cores.txt" 2>&1 || failed=1
            grep -E "^machine|^ceiling|real cpu rebuild|^  (ingest|busy)|    (read|hash|decode|decide|featurise|write|manifest) " "$OUT/ceiling-$who-$cores.txt"
        done
    done
    ;;
compare)
    [ -x "$BASE/ailhd" ] || { echo "no baseline build at $BASE/ailhd"; failed=1; continue; }
    [ -d "$W/tree" ] || { echo "no tree: run the dataset step first"; failed=1; continue; }
    find "$W/tree" -type f -exec cat {} + >/dev/null
    for dev in ${DEVICES:-cpu cuda}; do
        for round in $(seq "${ROUNDS:-3}"); do
            for b in "${BASES[@]}" new; do
                who=$(basename "$b"); bin=$BIN; [ "$b" = new ] || bin=$(realpath "$b/ailhd")
                rm -rf "$W/cmp" "$W/cmp.state"
                c=$(conf cmp "$W/tree" "$W/cmp")
                printf '%s --device %s round %s: ' $who "$dev" "$round"
                timed "$OUT/cmp-$who-$dev-$round.json" "$bin" --config "$c" rebuild --device "$dev" --json
                summarise "$OUT/cmp-$who-$dev-$round.json"
            done
        done
    done
    ;;
storage)
    # Whether the disk caps `rebuild`: dd's write rates on the work folder's file system (through
    # the page cache with a closing fdatasync, and O_DIRECT), then the benchmark tree rebuilt
    # with the outputs and state there and in memory (/dev/shm), every build in turn.
    [ -d "$W/tree" ] || { echo "no tree: run the dataset step first"; failed=1; continue; }
    df -h "$W" /dev/shm | sed 1d
    printf 'dd 2 GiB, page cache + fdatasync: '; dd if=/dev/zero of="$W/dd" bs=2M count=1024 conv=fdatasync 2>&1 | tail -1
    printf 'dd 2 GiB, O_DIRECT: '; dd if=/dev/zero of="$W/dd" bs=2M count=1024 oflag=direct 2>&1 | tail -1
    rm -f "$W/dd"
    find "$W/tree" -type f -exec cat {} + >/dev/null
    for round in 1 2; do
        for place in "$W" /dev/shm; do
            for dev in ${DEVICES:-cpu cuda}; do
                for b in "${BASES[@]}" new; do
                    who=$(basename "$b"); bin=$BIN; [ "$b" = new ] || bin=$(realpath "$b/ailhd")
                    rm -rf "$place/sto" "$place/sto.state"
                    c=$(conf sto "$W/tree" "$place/sto")
                    printf '%s --device %s, outputs in %s, round %s: ' "$who" "$dev" "$place" $round
                    timed "$OUT/sto-$who-$dev-${place//\//_}-$round.json" "$bin" --config "$c" rebuild --device "$dev" --json
                    summarise "$OUT/sto-$who-$dev-${place//\//_}-$round.json"
                done
            done
        done
    done
    rm -rf /dev/shm/sto /dev/shm/sto.state
    ;;
*)
    echo "unknown step $step"; failed=1
    ;;
esac
done
exit $failed
