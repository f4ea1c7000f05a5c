"""Check deploy/kubernetes/ailhd-shards.yaml, for tests/merge.rs: substitute the parameters as
its header says (only RECORDINGS, WORK, SHARDS, RUN, IMAGE, CLAIM), parse it as YAML, check the
two Jobs (an Indexed Job of SHARDS completions, then the merge), check their shell scripts with
`sh -n` and shellcheck, and run those scripts for real on a small tree: the merge Job's script
first, over DONE files an earlier run left (it must wait, not merge them), then pod I's script
with JOB_COMPLETION_INDEX=I for every I, then the merge Job's script, with `ailhd` on PATH.

usage: merge_deploy_check.py MANIFEST AILHD_BIN_DIR RECORDINGS WORK AILHD_CONFIG
"""
import os
import re
import subprocess
import sys

import yaml

manifest, bin_dir, recordings, work, config = sys.argv[1:6]
shards = 2
params = {"RECORDINGS": recordings, "WORK": work, "SHARDS": str(shards), "RUN": "20261205T120000Z",
          "IMAGE": "registry.example/ailhd:test", "CLAIM": "acoustic-data"}
text = open(manifest).read()
for name in re.findall(r"\$\{([A-Z_]+)\}", text):
    assert name in params, f"{manifest}: ${{{name}}} is not one of the documented parameters"
for k, v in params.items():
    text = text.replace("${" + k + "}", v)
docs = list(yaml.safe_load_all(text))
assert [d["kind"] for d in docs] == ["Job", "Job"], [d.get("kind") for d in docs]
shard_job, merge_job = docs
spec = shard_job["spec"]
assert spec["completionMode"] == "Indexed" and spec["completions"] == shards, spec
assert spec["template"]["spec"]["restartPolicy"] == "Never"


def script(job):
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["/bin/sh", "-c"], c["command"]
    return c["args"][0]


env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], AILHD_CONFIG=config)
for job in docs:
    s = script(job)
    subprocess.run(["sh", "-n", "-c", s], check=True)
    r = subprocess.run(["shellcheck", "-s", "sh", "-"], input=s, text=True, capture_output=True)
    assert r.returncode == 0, f"shellcheck {job['metadata']['name']}:\n{r.stdout}{r.stderr}"
# An earlier run's DONE files in a reused WORK: the merge waits for this run's.
for i in range(shards):
    os.makedirs(os.path.join(work, f"shard-{i}"), exist_ok=True)
    with open(os.path.join(work, f"shard-{i}", "DONE"), "w") as f:
        f.write("20261204T080000Z\n")
try:
    r = subprocess.run(["sh", "-c", script(merge_job)], env=env, capture_output=True, text=True,
                       timeout=3)
    raise AssertionError(f"the merge pod took an earlier run's shards: {r.stdout}{r.stderr}")
except subprocess.TimeoutExpired:
    pass
assert not os.path.exists(os.path.join(work, "merged")), "merged over an earlier run's shards"
for i in range(shards):
    r = subprocess.run(["sh", "-c", script(shard_job)], env=dict(env, JOB_COMPLETION_INDEX=str(i)),
                       capture_output=True, text=True)
    assert r.returncode == 0, f"pod {i}: {r.stdout}{r.stderr}"
    assert f"shard {i}/{shards}" in r.stdout, r.stdout
r = subprocess.run(["sh", "-c", script(merge_job)], env=env, capture_output=True, text=True, timeout=120)
assert r.returncode == 0, f"merge pod: {r.stdout}{r.stderr}"
assert f"merged {shards} inputs" in r.stdout, r.stdout
for n in ("TRAINING_DATASET.H5", "VALIDATION_DATASET.H5", "TESTING_DATASET.H5"):
    assert os.path.exists(os.path.join(work, "merged", n)), n
print(f"ok: {manifest}: two Jobs; {shards} shard pods and the merge pod ran: {r.stdout.splitlines()[0]}")
