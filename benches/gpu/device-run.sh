#!/usr/bin/env bash
# GPU checks and figures on a CUDA host with no Rust toolchain: the release binary, the shared
# fixtures (shared/fixtures/features), make_dataset.py, and optionally the release builds of the
# gpu_parity test and the daemon benchmark are carried in $CARRY (default .device-carry). Steps
# (names on the command line, default all): info, doctor, tests, parity, bench, daemon. Logs go to $OUT (or /tmp/ailhd-gpu).
set -uo pipefail
CARRY=${CARRY:-.device-carry}
OUT=${OUT:-/tmp/ailhd-gpu}
BIN=$(realpath "$CARRY/ailhd")
HERE=$(dirname "$(realpath "$0")")
W=${WORK:-/tmp/ailhd-work}
mkdir -p "$W" "$OUT"
N=${N:-39563}
steps=${*:-info doctor parity bench}

conf() { # conf NAME TREE OUTDIR [features-toml]
    cat >"$W/$1.toml" <<EOT
[paths]
recordings = "$2"
output = "$3"
state = "$3.state"
$(cat "${4:-/dev/null}" 2>/dev/null)
EOT
    echo "$W/$1.toml"
}

for step in $steps; do case $step in
info)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
    nproc; free -g | head -2
    ldconfig -p | grep -E 'libcuda\.so|libnvrtc|libcufft' | head
    ;;
doctor)
    "$BIN" doctor 2>&1 | tee "$OUT/doctor.txt"
    ;;
parity)
    rm -rf "$W/fx"; mkdir -p "$W/fx/LEAK"; cp "$CARRY"/shared/fixtures/features/wav/*.wav "$W/fx/LEAK/"
    for setup in default overlap32; do
        feat=/dev/null; [ $setup = overlap32 ] && feat="$CARRY/overlap32.toml"
        for dev in cuda cpu; do
            rm -rf "$W/out-$setup-$dev" "$W/out-$setup-$dev.state"
            c=$(conf "$setup-$dev" "$W/fx" "$W/out-$setup-$dev" "$feat")
            "$BIN" --config "$c" rebuild --device $dev >"$OUT/parity-$setup-$dev.log" 2>&1 \
                || { echo "rebuild $setup $dev FAILED"; tail -20 "$OUT/parity-$setup-$dev.log"; }
        done
        echo "== $setup: cuda vs reference (and vs cpu)"
        python3 "$HERE/parity.py" "$W/out-$setup-cuda" "$CARRY/shared/fixtures/features/expected/$setup" "$W/out-$setup-cpu" | tee "$OUT/parity-$setup.txt" | tail -25
    done
    ;;
bench)
    [ -d "$W/tree" ] || python3 "$CARRY/make_dataset.py" "$W/tree" "$N" 1 >/dev/null
    find "$W/tree" -type f -exec cat {} + >/dev/null  # warm page cache
    for round in 1 2; do
        for dev in cuda cpu; do
            rm -rf "$W/big-$dev" "$W/big-$dev.state"
            c=$(conf "big-$dev" "$W/tree" "$W/big-$dev")
            /usr/bin/time -f "%e s wall, %M KB peak RSS" "$BIN" --config "$c" rebuild --device $dev --json \
                >"$OUT/bench-$dev-$round.json" 2>"$OUT/bench-$dev-$round.err"
            echo "rebuild --device $dev round $round: $(tail -1 "$OUT/bench-$dev-$round.err")"
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r[k] for k in r if k not in ('quarantined',)})" "$OUT/bench-$dev-$round.json" 2>&1 | cut -c1-900
        done
        python3 "$HERE/torchaudio_baseline.py" "$W/tree" "$W/torchaudio.h5" 2>&1 | tail -2
    done
    ;;
tests)
    # The GPU tests, release build: they fail (not skip) when the GPU is present but unusable.
    AILHD_SHARED="$CARRY/shared" "$CARRY/gpu_parity" --test-threads 1 --nocapture 2>&1 | tee "$OUT/tests.txt" | grep -E "^test |test result|skipping|panicked|GPU vs reference" | head -60
    ;;
daemon)
    # The service's latency at 100 clips/s and a burst, featurising on the GPU. The benchmark
    # runs the binary at the path cargo baked into it.
    exe=$(strings "$CARRY/daemon_bench" | grep -o -m1 '/[A-Za-z0-9_/.-]*/target/release/ailhd' | head -1)
    mkdir -p "$(dirname "$exe")"; cp "$BIN" "$exe"
    AILHD_INGEST__DEVICE=cuda "$CARRY/daemon_bench" ${DAEMON_ARGS:-1000 5000} 2>&1 | tee "$OUT/daemon-cuda.txt" | tail -20
    ;;
esac; done
