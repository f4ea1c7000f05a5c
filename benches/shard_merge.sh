#!/usr/bin/env bash
# Sharded rebuild + merge against one rebuild of the same tree, on this machine (docs/scale-out.md). Prints wall times (best of ROUNDS) and the merged files' size.
#   usage: benches/shard_merge.sh AILHD_BIN RECORDINGS [SHARDS=4] [ROUNDS=3]
# Make a tree with e.g. `python3 tools/make_dataset.py REC 5000` or `ailhd demo`.
set -euo pipefail
bin=$1
rec=$2
n=${3:-4}
rounds=${4:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

conf() { # conf NAME -> a configuration writing under $work/NAME
    mkdir -p "$work/$1"
    printf '[paths]\nrecordings = "%s"\noutput = "%s/%s/out"\nstate = "%s/%s/state"\n[ingest]\ndevice = "cpu"\n' \
        "$rec" "$work" "$1" "$work" "$1" >"$work/$1.toml"
    echo "$work/$1.toml"
}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { print b - a }'; }
clean() { rm -rf "$work"/full "$work"/shard-* "$work"/merged; }
best() { printf '%s\n' "$@" | sort -g | head -1; }

full=() seq_t=() par_t=() merge_t=()
for ((r = 0; r < rounds; r++)); do
    clean
    t=$(now); "$bin" --config "$(conf full)" rebuild >/dev/null; full+=("$(since "$t")")
    clean
    t=$(now)
    for ((i = 0; i < n; i++)); do "$bin" --config "$(conf "shard-$i")" rebuild --shard "$i/$n" >/dev/null; done
    seq_t+=("$(since "$t")")
    clean
    t=$(now)
    pids=()
    for ((i = 0; i < n; i++)); do "$bin" --config "$(conf "shard-$i")" rebuild --shard "$i/$n" >/dev/null & pids+=($!); done
    for p in "${pids[@]}"; do wait "$p"; done
    par_t+=("$(since "$t")")
    inputs=()
    for ((i = 0; i < n; i++)); do inputs+=("$work/shard-$i/out"); done
    t=$(now); "$bin" --config "$work/full.toml" merge "${inputs[@]}" --into "$work/merged" >/dev/null
    merge_t+=("$(since "$t")")
done
files=$(find "$rec" -name '*.wav' | wc -l)
merged_bytes=$(du -cb "$work"/merged/*.H5 | tail -1 | cut -f1)
shard_bytes=$(du -cb "$work"/shard-*/out/*.H5 | tail -1 | cut -f1)
t=$(now); "$bin" --config "$work/full.toml" merge "${inputs[@]}" --into "$work/merged" --npy >/dev/null
npy_t=$(since "$t")
printf 'tree: %s files; %s shards; best of %s rounds; %s CPUs\n' "$files" "$n" "$rounds" "$(nproc)"
printf '%-44s %8.2f s\n' "one rebuild" "$(best "${full[@]}")"
printf '%-44s %8.2f s\n' "$n shards one after the other" "$(best "${seq_t[@]}")"
printf '%-44s %8.2f s\n' "$n shards in parallel" "$(best "${par_t[@]}")"
printf '%-44s %8.2f s\n' "merge (virtual datasets)" "$(best "${merge_t[@]}")"
printf '%-44s %8.2f s\n' "merge --npy (copies)" "$npy_t"
printf '%-44s %8d bytes (%s per input)\n' "merged HDF5 files (3 splits)" "$merged_bytes" "$((merged_bytes / n))"
printf '%-44s %8d bytes\n' "the shards' HDF5 files" "$shard_bytes"
