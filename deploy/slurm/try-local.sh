#!/usr/bin/env bash
# Run deploy/slurm/submit.sh on a throwaway single-node Slurm cluster on this machine (Debian's
# slurm-wlm: `apt-get install slurm-wlm`; needs root, no munge: auth/none), then check that the
# shards and the merge ran. A check of the deploy files against a real Slurm, not a CI test.
#   usage: sudo deploy/slurm/try-local.sh AILHD_BIN RECORDINGS WORK [SHARDS=4]
set -euo pipefail
bin=$(realpath "$1")
recordings=$(realpath "$2")
work=$3
shards=${4:-4}
here=$(cd "$(dirname "$0")" && pwd)
d=$(mktemp -d /tmp/ailhd-slurm.XXXXXX)
node=$(hostname -s)
cpus=$(nproc)
mem=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2))
mkdir -p "$d/state" "$d/spool"
cat >"$d/slurm.conf" <<CONF
ClusterName=ailhd-try
SlurmctldHost=$node
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/none
CredType=cred/none
SlurmUser=root
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd.pid
SlurmctldLogFile=$d/slurmctld.log
SlurmdLogFile=$d/slurmd.log
NodeName=$node CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=try Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$d/slurm.conf
slurmctld -D -i >"$d/ctld.out" 2>&1 &
ctld=$!
slurmd -D >"$d/slurmd.out" 2>&1 &
slurmd_pid=$!
stop() {
    kill "$slurmd_pid" "$ctld" 2>/dev/null || true
    wait "$slurmd_pid" "$ctld" 2>/dev/null || true
}
trap stop EXIT
for _ in $(seq 60); do
    sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed)' && break
    sleep 1
done
sinfo
started=$(date +%s)
AILHD=$bin AILHD_SBATCH_ARGS="--cpus-per-task=1 --mem=1G" \
    "$here/submit.sh" "$recordings" "$work" "$shards"
while [ -n "$(squeue -h)" ]; do sleep 1; done
echo "all jobs finished in $(($(date +%s) - started)) s; logs: $work/ailhd-*.out, $d"
for ((i = 0; i < shards; i++)); do
    [ -f "$work/shard-$i/DONE" ] || { echo "shard $i did not finish" >&2; exit 1; }
done
cat "$work"/ailhd-*.out | grep -E '^(rebuilt|merged|  shard|  rule|  same content)' || true
for f in "$work"/merged/*.H5; do
    [ -f "$f" ] || { echo "no merged files in $work/merged" >&2; exit 1; }
done
echo "ok: $shards shards and the merge ran under Slurm"
