#!/usr/bin/env bash
# Submit a sharded ailhd rebuild to Slurm: an array job of SHARDS tasks, then a merge job that
# runs once every task has succeeded. The merged outputs land in WORK/merged.
#   usage: submit.sh RECORDINGS WORK SHARDS
# Environment passed to the jobs: AILHD (binary), AILHD_CONFIG (settings, the same for every
# shard), AILHD_MERGE_ARGS (e.g. --npy). RECORDINGS and WORK must be seen by every node.
# AILHD_SBATCH_ARGS: extra sbatch options for both jobs (e.g. "--partition=cpu --account=x
# --cpus-per-task=8"), which override the script's #SBATCH lines.
set -euo pipefail
if [ $# -ne 3 ]; then
    sed -n '4p' "$0" >&2
    exit 2
fi
recordings=$1
work=$2
shards=$3
deploy=$(cd "$(dirname "$0")/.." && pwd)
script="$deploy/slurm/ailhd-shards.sbatch"
mkdir -p "$work"
# The tasks run in WORK (--chdir): every path they are given is made absolute here.
work=$(cd "$work" && pwd)
recordings=$(cd "$recordings" && pwd) || {
    echo "submit.sh: the recordings folder $1 is not there" >&2
    exit 2
}
for var in AILHD AILHD_CONFIG; do
    if [ -n "${!var:-}" ] && [ -e "${!var}" ]; then
        export "$var=$(realpath "${!var}")"
    fi
done
# shellcheck disable=SC2206 # a list of options
extra=(${AILHD_SBATCH_ARGS:-})
array=$(sbatch "${extra[@]}" --parsable --chdir="$work" --array="0-$((shards - 1))" \
    --export="ALL,AILHD_DEPLOY=$deploy" "$script" shard "$recordings" "$work")
array=${array%%;*}
merge=$(sbatch "${extra[@]}" --parsable --chdir="$work" --job-name=ailhd-merge --dependency="afterok:$array" \
    --export="ALL,AILHD_DEPLOY=$deploy" "$script" merge "$work" "$shards")
echo "submitted shards: job $array (array 0-$((shards - 1))); merge: job ${merge%%;*}"
