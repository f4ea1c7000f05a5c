#!/usr/bin/env bash
# Sharded rebuild + merge against one rebuild of the same tree, on this machine
# (docs/scale-out.md). Prints wall times (best of ROUNDS), the bytes each process read (rchar of
# /proc/<pid>/io: every read(2), page cache or not) against the tree's bytes, and the merged
# files' size.
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
# measured FILE CMD...: run CMD, then write the bytes it read (rchar) to FILE. The shell reaps
# CMD, which adds CMD's counts to its own; the shell's own reads are a few KB.
measured() {
    local file=$1
    shift
    # shellcheck disable=SC2016 # $$ and $@ are the inner shell's
    sh -c '"$@" >/dev/null; awk "/^rchar/ {print \$2}" /proc/$$/io' sh "$@" >"$file"
}

full=() seq_t=() par_t=() merge_t=()
for ((r = 0; r < rounds; r++)); do
    clean
    t=$(now); measured "$work/rchar-full" "$bin" --config "$(conf full)" rebuild; full+=("$(since "$t")")
    clean
    t=$(now)
    for ((i = 0; i < n; i++)); do "$bin" --config "$(conf "shard-$i")" rebuild --shard "$i/$n" >/dev/null; done
    seq_t+=("$(since "$t")")
    clean
    t=$(now)
    pids=()
    for ((i = 0; i < n; i++)); do
        measured "$work/rchar-$i" "$bin" --config "$(conf "shard-$i")" rebuild --shard "$i/$n" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    par_t+=("$(since "$t")")
    inputs=()
    for ((i = 0; i < n; i++)); do inputs+=("$work/shard-$i/out"); done
    t=$(now); "$bin" --config "$work/full.toml" merge "${inputs[@]}" --into "$work/merged" >/dev/null
    merge_t+=("$(since "$t")")
done
files=$(find "$rec" -name '*.wav' | wc -l)
tree_bytes=$(find "$rec" -name '*.wav' -type f -printf '%s\n' | awk '{s += $1} END {print s}')
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
share() { awk -v a="$1" -v b="$tree_bytes" 'BEGIN { printf "%.3f", a / b }'; }
printf 'bytes read (rchar), last round; the tree: %s bytes in its *.wav files\n' "$tree_bytes"
printf '  %-42s %12d bytes = %s of the tree\n' "one rebuild" "$(cat "$work/rchar-full")" \
    "$(share "$(cat "$work/rchar-full")")"
for ((i = 0; i < n; i++)); do
    r=$(cat "$work/rchar-$i")
    printf '  %-42s %12d bytes = %s of the tree (target <= %s)\n' "shard $i/$n" "$r" "$(share "$r")" \
        "$(awk -v n="$n" 'BEGIN { printf "%.3f", 1.5 / n }')"
done
