"""Read ailhd outputs as the trainer does (h5py, numpy memmaps) and check them against a spec.

usage: check_outputs.py SPEC.json

SPEC: {"output": dir, "hdf5_names": [3 names], "labels": [...], "shape": [4 ints],
       "expected_dir": dir or null, "rows": {source_path: {"label": id, "case": name or null,
       "tolerance": "f16ulp" | "resampled", "blake3": hex, "sensor_id": s, "recording_id": s,
       "recorded_at": int, "gain_db": float or null}},
       "fingerprint": hex, "swmr": bool}
Checks: every file and dataset of the contract with its dtype and shape, the attributes, that every
expected source_path has exactly one valid row with the right metadata, that features match the
reference within the contract's tolerance, and that the npy columns equal the HDF5 columns.
"""
import json
import math
import os
import sys

import h5py
import numpy as np

SPLITS = ["training", "validation", "testing"]


def check_f16ulp(got, ref, where):
    got = got.astype(np.float64)
    ref = ref.astype(np.float64)
    top = ref.max()
    near = ref >= top - 100.0
    ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    tol = np.maximum(ulp, 0.005)
    err = np.abs(got - ref)
    bad = near & (err > tol)
    assert not bad.any(), f"{where}: {bad.sum()} values off by more than one f16 ulp; worst {err[near].max():.5f} dB at ref {ref[bad][0]:.3f}, got {got[bad][0]:.3f}"
    far_bad = (~near) & (got >= top - 90.0)
    assert not far_bad.any(), f"{where}: {far_bad.sum()} noise-floor values not 90 dB below the maximum"
    return float(err[near].max()) if near.any() else 0.0


def check_resampled(got, ref, where):
    got = got.astype(np.float64)
    ref = ref.astype(np.float64)
    top = ref.max()
    near = ref >= top - 40.0
    err = np.abs(got - ref)
    assert (err[near] <= 0.5).all(), f"{where}: off by {err[near].max():.3f} dB where the reference is within 40 dB of its maximum"
    assert (got[~near] <= top - 30.0).all(), f"{where}: aliasing: values above max-30 dB where the reference is low"
    return float(err[near].max())


def text(a):
    return a.decode("utf-8") if isinstance(a, bytes) else str(a)


def main():
    spec = json.load(open(sys.argv[1]))
    out = spec["output"]
    shape = tuple(spec["shape"])
    found = {}
    worst = 0.0
    for split, name in zip(SPLITS, spec["hdf5_names"]):
        path = os.path.join(out, name)
        kw = dict(libver="latest", swmr=True) if spec.get("swmr") else {}
        with h5py.File(path, "r", **kw) as f:
            n = int(f["committed_rows"][0])
            assert f["committed_rows"].dtype == np.int64
            expect = {
                "segments_mel": (np.float16, (n,) + shape),
                "labels": (np.int16, (n,)),
                "valid": (np.uint8, (n,)),
                "blake3": (np.uint8, (n, 32)),
                "recorded_at": (np.int64, (n,)),
                "gain_db": (np.float32, (n,)),
            }
            for ds, (dt, shp) in expect.items():
                assert f[ds].dtype == dt, f"{path}:{ds} dtype {f[ds].dtype}"
                assert f[ds].shape == shp, f"{path}:{ds} shape {f[ds].shape} != {shp}"
                assert f[ds].maxshape[0] is None, f"{path}:{ds} not unlimited"
            assert f["segments_mel"].chunks is not None
            for ds, width in (("source_path", spec["path_bytes"]), ("sensor_id", 32), ("recording_id", 32)):
                d = f[ds]
                assert d.shape == (n,), f"{path}:{ds} shape"
                assert d.dtype.kind == "S" and d.dtype.itemsize == width, f"{path}:{ds} dtype {d.dtype}"
                assert h5py.check_string_dtype(d.dtype).encoding == "utf-8", f"{path}:{ds} not UTF-8"
                assert not h5py.check_vlen_dtype(d.dtype), f"{path}:{ds} is variable-length"
            attrs = {k: text(f.attrs[k]) for k in f.attrs}
            for k in ["labels_json", "label2id_json", "config_json", "created_at_utc", "ailhd_version", "schema_version", "feature_fingerprint"]:
                assert k in attrs, f"{path}: attribute {k} missing ({sorted(attrs)})"
            assert json.loads(attrs["labels_json"]) == spec["labels"], attrs["labels_json"]
            assert json.loads(attrs["label2id_json"]) == {l: i for i, l in enumerate(spec["labels"])}
            assert attrs["feature_fingerprint"] == spec["fingerprint"]
            assert int(attrs["schema_version"]) == 1
            cfg = json.loads(attrs["config_json"])
            assert cfg["n_mels"] == shape[2]
            mel = f["segments_mel"][...]
            cols = {k: f[k][...] for k in ["labels", "valid", "blake3", "source_path", "sensor_id", "recording_id", "recorded_at", "gain_db"]}

        # npy memmaps hold the same columns
        npdir = os.path.join(out, "npy", split)
        for col, arr in [("segments_mel", mel)] + list(cols.items()):
            m = np.load(os.path.join(npdir, col + ".npy"), mmap_mode="r")
            assert m.shape == arr.shape, f"npy {split}/{col} shape {m.shape} != {arr.shape}"
            assert m.dtype == arr.dtype or (m.dtype.kind == "S" and arr.dtype.kind == "S" and m.dtype.itemsize == arr.dtype.itemsize), f"npy {split}/{col} dtype {m.dtype} vs {arr.dtype}"
            assert np.array_equal(np.asarray(m).view(np.uint8), np.asarray(arr).view(np.uint8)), f"npy {split}/{col} differs from HDF5"
        npattrs = json.load(open(os.path.join(npdir, "attributes.json")))
        assert int(npattrs["committed_rows"]) == n

        for i in range(n):
            sp = text(cols["source_path"][i])
            assert sp not in found, f"{sp} has two rows"
            found[sp] = (split, i)
            if not cols["valid"][i]:
                continue
            want = spec["rows"].get(sp)
            if want is None:
                continue
            assert int(cols["labels"][i]) == want["label"], f"{sp}: label {cols['labels'][i]} != {want['label']}"
            assert bytes(cols["blake3"][i]).hex() == want["blake3"], f"{sp}: blake3"
            assert text(cols["sensor_id"][i]) == want["sensor_id"], f"{sp}: sensor_id {cols['sensor_id'][i]!r}"
            assert text(cols["recording_id"][i]) == want["recording_id"]
            assert int(cols["recorded_at"][i]) == want["recorded_at"], f"{sp}: recorded_at"
            g = float(cols["gain_db"][i])
            assert (math.isnan(g) and want["gain_db"] is None) or g == want["gain_db"], f"{sp}: gain {g}"
            if want.get("case") and spec.get("expected_dir"):
                ref = np.load(os.path.join(spec["expected_dir"], want["case"] + ".npy"))
                assert ref.shape == shape, f"reference {want['case']} shape {ref.shape}"
                check = check_resampled if want["tolerance"] == "resampled" else check_f16ulp
                worst = max(worst, check(mel[i], ref, sp))
    missing = [p for p in spec["rows"] if p not in found]
    assert not missing, f"no row for {missing}"
    print(f"ok: {len(found)} rows checked, worst error within tolerance {worst:.5f} dB")


if __name__ == "__main__":
    main()
