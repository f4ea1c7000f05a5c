#!/usr/bin/env bash
# Build here what benches/gpu/device-run.sh needs on a CUDA host that has no Rust toolchain, into
# $CARRY (default .device-carry, git-ignored): the release binary, the release builds of the
# test binary (tests/tests.rs: device-run.sh runs its gpu_parity:: tests) and of the daemon
# benchmark, the shared fixtures, make_dataset.py and the overlap32 setup. The device tool carries at most 64 MiB: this script fails above that.
# Run from the repository root after `. .ci/setup`; SHARED (default ../shared) holds fixtures/ and tools/.
set -euo pipefail
CARRY=${CARRY:-.device-carry}
SHARED=${SHARED:-../shared}
TARGET=${CARGO_TARGET_DIR:-target}
[ -f "$SHARED/fixtures/features/cases.json" ] || { echo "no fixtures under $SHARED (set SHARED)" >&2; exit 1; }

cargo build --release --bin ailhd
# The test and bench executables: cargo prints their paths as JSON messages.
exe_of() { # exe_of NAME KIND cargo-args...
    local name=$1 kind=$2; shift 2
    cargo "$@" --no-run --message-format=json | python3 -c '
import json, sys
name, kind = sys.argv[1], sys.argv[2]
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and t.get("name") == name and kind in t.get("kind", []) and m.get("executable"):
        print(m["executable"])
' "$name" "$kind" | tail -1
}
tests_exe=$(exe_of tests test test --release --test tests)
daemon_exe=$(exe_of daemon bench bench --bench daemon)  # the bench profile: release settings
rebuild_exe=$(exe_of rebuild bench bench --bench rebuild)
if [ -z "$tests_exe" ] || [ -z "$daemon_exe" ] || [ -z "$rebuild_exe" ]; then
    echo "could not find the test/bench executables" >&2
    exit 1
fi

rm -rf "$CARRY"
mkdir -p "$CARRY/shared/fixtures" "$CARRY/shared/tools"
cp "$TARGET/release/ailhd" "$CARRY/ailhd"
cp "$tests_exe" "$CARRY/tests"
cp "$daemon_exe" "$CARRY/daemon_bench"
cp "$rebuild_exe" "$CARRY/rebuild_bench"
strip "$CARRY/rebuild_bench" "$CARRY/daemon_bench" "$CARRY/tests" 2>/dev/null || true
# The daemon benchmark runs the binary at the path cargo baked into it (CARGO_BIN_EXE_ailhd).
realpath "$TARGET/release/ailhd" >"$CARRY/daemon_bench.ailhd-path"
cp -r "$SHARED/fixtures/features" "$CARRY/shared/fixtures/"
cp "$SHARED/tools/make_dataset.py" "$CARRY/make_dataset.py"
cp config/overlap32.toml "$CARRY/overlap32.toml"
ls -la "$CARRY"
size=$(du -sbL "$CARRY" | cut -f1)
echo "carry: $((size / 1048576)) MiB in $CARRY (ailhd alone: $(($(stat -c %s "$CARRY/ailhd") / 1048576)) MiB)"
[ "$size" -le $((64 * 1048576)) ] || { echo "more than the 64 MiB the device tool carries" >&2; exit 1; }
