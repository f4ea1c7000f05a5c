#!/usr/bin/env bash
# One step of a sharded rebuild, for any scheduler that runs one command per partition
# (docs/scale-out.md). Paths and counts are the only parameters.
#
#   run-shard.sh shard RECORDINGS WORK [SHARDS]
#       Rebuild the shard this task owns (the recordings whose paths fall in it; it reads no
#       other file) from RECORDINGS into WORK/shard-I/{out,state}, then mark it done
#       (WORK/shard-I/DONE). The index I comes from the scheduler: SLURM_ARRAY_TASK_ID (minus
#       SLURM_ARRAY_TASK_MIN) or JOB_COMPLETION_INDEX; the count from SHARDS, else
#       SLURM_ARRAY_TASK_COUNT. Every task must see RECORDINGS under the same path: it names
#       the tree, and merge settles the shards of one tree together.
#   run-shard.sh merge WORK SHARDS
#       Wait until the SHARDS shards are done (at most $AILHD_MERGE_WAIT_S seconds, default 0:
#       no waiting, for schedulers that order the steps themselves), then merge them into
#       WORK/merged (HDF5 virtual datasets over WORK/shard-*/out: move WORK as a whole), as one
#       rebuild of the tree (merge refuses an incomplete or mixed set of shards).
#
# Environment: AILHD (the binary, default `ailhd` on PATH); AILHD_CONFIG (feature, label and
# split settings: the same file for every shard); AILHD_MERGE_ARGS (extra merge flags, e.g.
# --npy). The rebuild device comes from the configuration (ingest.device).
set -euo pipefail

ailhd=${AILHD:-ailhd}

usage() {
    sed -n '4,16p' "$0" >&2
    exit 2
}

index() {
    if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
        echo $((SLURM_ARRAY_TASK_ID - ${SLURM_ARRAY_TASK_MIN:-0}))
    elif [ -n "${JOB_COMPLETION_INDEX:-}" ]; then
        echo "$JOB_COMPLETION_INDEX"
    else
        echo "run-shard.sh: neither SLURM_ARRAY_TASK_ID nor JOB_COMPLETION_INDEX is set" >&2
        exit 2
    fi
}

case "${1:-}" in
shard)
    [ $# -ge 3 ] || usage
    recordings=$2
    work=$3
    count=${4:-${SLURM_ARRAY_TASK_COUNT:-}}
    [ -n "$count" ] || { echo "run-shard.sh: give SHARDS" >&2; exit 2; }
    i=$(index)
    dir="$work/shard-$i"
    mkdir -p "$dir"
    rm -f "$dir/DONE"
    AILHD_PATHS__RECORDINGS="$recordings" \
        AILHD_PATHS__OUTPUT="$dir/out" \
        AILHD_PATHS__STATE="$dir/state" \
        "$ailhd" rebuild --shard "auto/$count"
    date -u +%Y-%m-%dT%H:%M:%SZ >"$dir/DONE"
    ;;
merge)
    [ $# -eq 3 ] || usage
    work=$2
    count=$3
    waited=0
    inputs=()
    for ((i = 0; i < count; i++)); do
        while [ ! -f "$work/shard-$i/DONE" ]; do
            if [ "$waited" -ge "${AILHD_MERGE_WAIT_S:-0}" ]; then
                echo "run-shard.sh: shard $i of $count is not done ($work/shard-$i/DONE missing)" >&2
                exit 1
            fi
            sleep 10
            waited=$((waited + 10))
        done
        inputs+=("$work/shard-$i/out")
    done
    # shellcheck disable=SC2086 # AILHD_MERGE_ARGS is a list of flags
    "$ailhd" merge "${inputs[@]}" --into "$work/merged" ${AILHD_MERGE_ARGS:-}
    ;;
*)
    usage
    ;;
esac
