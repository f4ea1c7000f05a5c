"""Compare the rows of an ailhd output folder with reference features, and optionally with the
rows of another output folder (same tree, other device), as a user would read them (h5py).

usage: parity.py OUTPUT EXPECTED_DIR [OTHER_OUTPUT]
EXPECTED_DIR holds NAME.npy (float32, computed in float64) and ../../cases.json; a row whose
source_path's file stem is NAME is checked with the case's tolerance: "f16ulp" (the contract's
rule: within max(one float16 ulp, 0.005 dB) wherever the reference lies within 100 dB of the
recording's maximum, and more than 90 dB below it elsewhere) or "resampled" (within 0.5 dB where
the reference is within 40 dB of its maximum, at least 30 dB below it elsewhere).
Prints one line per case and a summary; exits 1 on any violation, a row missing from OTHER_OUTPUT,
or when no row has a reference.
"""
import os
import sys

import h5py
import numpy as np

NAMES = ["TRAINING_DATASET.H5", "VALIDATION_DATASET.H5", "TESTING_DATASET.H5"]


def rows(out):
    got = {}
    for name in NAMES:
        p = os.path.join(out, name)
        if not os.path.exists(p):
            continue
        with h5py.File(p, "r") as f:
            n = int(f["committed_rows"][0])
            valid = f["valid"][:n]
            paths = f["source_path"][:n]
            mel = f["segments_mel"][:n]
            for i in range(n):
                if valid[i]:
                    sp = paths[i].decode() if isinstance(paths[i], bytes) else str(paths[i])
                    got[sp] = mel[i]
    return got


def check(got, ref, resampled):
    got = got.astype(np.float64).ravel()
    ref = ref.astype(np.float64).ravel()
    top = ref.max()
    if resampled:
        near = ref >= top - 40.0
        err = np.abs(got - ref)
        bad = int((near & (err > 0.5)).sum()) + int(((~near) & (got > top - 30.0)).sum())
        return bad, float(err[near].max() / 0.5)
    near = ref >= top - 100.0
    ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    tol = np.maximum(ulp, 0.005)
    err = np.abs(got - ref)
    bad = int((near & (err > tol)).sum()) + int(((~near) & (got >= top - 90.0)).sum())
    frac = float((err[near] / tol[near]).max()) if near.any() else 0.0
    return bad, frac


def main():
    out, expected = sys.argv[1], sys.argv[2]
    other = rows(sys.argv[3]) if len(sys.argv) > 3 else None
    got = rows(out)
    import json
    cases = json.load(open(os.path.join(expected, "..", "..", "cases.json")))["cases"]
    failures = 0
    worst = 0.0
    checked = 0
    for sp in sorted(got):
        stem = os.path.splitext(os.path.basename(sp))[0]
        ref_path = os.path.join(expected, stem + ".npy")
        line = f"{sp:40s}"
        if os.path.exists(ref_path):
            ref = np.load(ref_path)
            resampled = cases.get(stem, {}).get("tolerance", "").startswith("resampled")
            bad, frac = check(got[sp], ref, resampled)
            worst = max(worst, frac)
            failures += bad > 0
            checked += 1
            line += f" ref: {'FAIL ' + str(bad) if bad else 'ok'} (worst {frac:.3f} of tolerance)"
        if other is not None and sp not in other:
            failures += 1
            line += " vs other: MISSING there"
        elif other is not None:
            a = got[sp].astype(np.float64)
            b = other[sp].astype(np.float64)
            same = np.array_equal(got[sp].view(np.uint16), other[sp].view(np.uint16))
            line += f" vs other: {'identical' if same else 'max diff %.4f dB, %d values differ' % (np.nanmax(np.abs(a - b)), int((got[sp].view(np.uint16) != other[sp].view(np.uint16)).sum()))}"
        print(line)
    print(f"parity: {len(got)} rows, {checked} with a reference, {failures} with violations, "
          f"worst {worst:.3f} of tolerance")
    if checked == 0:
        print(f"parity: FAILED, no row of {out} has a reference (missing or empty output?)")
    sys.exit(1 if failures or checked == 0 else 0)


if __name__ == "__main__":
    main()
