"""Check `ailhd merge` outputs as a trainer reads them (h5py, numpy), for tests/merge.rs.

usage: merge_check.py same SPEC.json | merge_check.py hosts SPEC.json

same:  {"merged": dir, "reference": dir, "names": [3 file names], "npy": bool,
        "h5dump": {file name: {"segments_mel": bin, "blake3": bin}}}
  - every merged file opens plainly and in SWMR mode (with the same values);
  - every dataset has committed_rows rows, the total of merged_from_json;
  - the row datasets are virtual, `valid` and `committed_rows` are real;
  - per content: split, label (by name), features and file-name columns equal the reference
    rebuild's (one rebuild of the whole tree), and every content has one valid row;
  - the bytes h5dump (HDF5 1.10) wrote from the merged files equal what h5py reads;
  - with npy, the npy copies equal the merged HDF5 columns.
  Prints a digest of every merged column (rows in place), to compare two merges.
hosts: {"merged": dir, "inputs": [dirs in merge order], "names": [...],
        "labels": [expected merged names], "remapped": bool}
  - one valid row per content over all splits, for exactly the contents valid in some input;
  - each kept row lies in the block of the first input (in merge order) holding the content,
    with that input's label name and source_path;
  - `labels` is a real dataset exactly when ids were remapped, and names resolve through the
    merged labels_json.
"""
import hashlib
import json
import os
import sys

import h5py
import numpy as np

COLS = ["segments_mel", "labels", "valid", "blake3", "source_path", "sensor_id",
        "recording_id", "recorded_at", "gain_db"]


def read(path, swmr=False):
    kw = dict(libver="latest", swmr=True) if swmr else {}
    with h5py.File(path, "r", **kw) as f:
        c = int(f["committed_rows"][0])
        for name in f:
            if swmr:
                f[name].refresh()
            assert f[name].shape[0] == (1 if name == "committed_rows" else c), \
                f"{path}:{name} has {f[name].shape[0]} rows, committed_rows {c}"
        data = {k: f[k][...] for k in COLS}
        attrs = {k: f.attrs[k] for k in f.attrs}
        virtual = {k: f[k].is_virtual for k in f}
    labels = json.loads(attrs["labels_json"])
    return c, data, attrs, virtual, labels


def per_content(out, names, only_valid=True):
    """content hex -> (split, label name, mel bytes, metadata) of its valid row."""
    res = {}
    for split, name in enumerate(names):
        c, d, _, _, labels = read(os.path.join(out, name))
        for i in range(c):
            if only_valid and not d["valid"][i]:
                continue
            h = bytes(d["blake3"][i]).hex()
            assert h not in res, f"{out}: content {h} has two valid rows"
            res[h] = (split, labels[int(d["labels"][i])], d["segments_mel"][i].tobytes(),
                      bytes(d["source_path"][i]), bytes(d["sensor_id"][i]),
                      bytes(d["recording_id"][i]), int(d["recorded_at"][i]),
                      np.float32(d["gain_db"][i]).tobytes())
    return res


def same(spec):
    names = spec["names"]
    digest = hashlib.blake2b()
    for name in names:
        path = os.path.join(spec["merged"], name)
        c, d, attrs, virtual, _ = read(path)
        c2, d2, _, _, _ = read(path, swmr=True)
        # Compared as bytes: gain_db is NaN where a name has no gain.
        assert c == c2 and all(d[k].tobytes() == d2[k].tobytes() for k in COLS), f"{path}: SWMR read differs"
        for k in COLS:
            digest.update(np.ascontiguousarray(d[k]).tobytes())
        blocks = json.loads(attrs["merged_from_json"])
        assert sum(b["rows"] for b in blocks) == c, f"{path}: merged_from_json {blocks} vs {c} rows"
        for k in COLS:  # shards number labels alike: `labels` stays virtual
            if k == "valid":
                assert not virtual[k], f"{path}:{k} should be a real dataset"
            else:
                assert virtual[k] == (c > 0), f"{path}:{k} virtual={virtual[k]} with {c} rows"
        assert not virtual["committed_rows"]
        _, _, ref_attrs, _, _ = read(os.path.join(spec["reference"], name))
        for k in ("labels_json", "label2id_json", "config_json", "created_at_utc",
                  "ailhd_version", "schema_version", "feature_fingerprint"):
            assert k in attrs, f"{path}: no attribute {k}"
            # A reader's code (`.decode()` of the label list, say) works on both files alike.
            assert type(attrs[k]) is type(ref_attrs[k]), \
                f"{path}: attribute {k} reads as {type(attrs[k]).__name__}, " \
                f"{type(ref_attrs[k]).__name__} in one rebuild's file"
        dump = spec.get("h5dump", {}).get(name)
        if dump:
            for col, bin_path in dump.items():
                raw = open(bin_path, "rb").read()
                assert raw == np.ascontiguousarray(d[col]).tobytes(), \
                    f"{path}:{col}: h5dump's bytes ({len(raw)}) differ from h5py's"
        if spec.get("npy"):
            split = ["training", "validation", "testing"][names.index(name)]
            for k in COLS:
                m = np.load(os.path.join(spec["merged"], "npy", split, k + ".npy"), mmap_mode="r")
                assert m.shape == d[k].shape, f"npy {split}/{k} {m.shape} != {d[k].shape}"
                assert np.asarray(m).tobytes() == np.ascontiguousarray(d[k]).tobytes(), f"npy {split}/{k} differs"
    m = per_content(spec["merged"], names)
    r = per_content(spec["reference"], names)
    assert set(m) == set(r), f"contents differ: {len(set(m) - set(r))} extra, {len(set(r) - set(m))} missing"
    for h in r:
        assert m[h] == r[h], f"content {h} ({r[h][3]!r}): merged row differs from the rebuild's " \
            f"(split {m[h][0]} vs {r[h][0]}, label {m[h][1]} vs {r[h][1]}, features equal: {m[h][2] == r[h][2]})"
    print(f"ok: {len(m)} contents, each one valid row, equal to one rebuild")
    print(f"merged view digest: {digest.hexdigest()}")


def hosts(spec):
    names = spec["names"]
    inputs = [per_content(d, names) for d in spec["inputs"]]
    expected = {}
    for i, rows in enumerate(inputs):
        for h, row in rows.items():
            expected.setdefault(h, (i, row))
    seen = {}
    for split, name in enumerate(names):
        c, d, attrs, virtual, labels = read(os.path.join(spec["merged"], name))
        assert labels == spec["labels"], f"labels_json {labels} != {spec['labels']}"
        assert virtual["labels"] == (not spec["remapped"] and c > 0), \
            f"{name}: labels virtual={virtual['labels']}, remapped={spec['remapped']}"
        blocks = json.loads(attrs["merged_from_json"])
        assert len(blocks) == len(spec["inputs"])
        for i in range(c):
            if not d["valid"][i]:
                continue
            h = bytes(d["blake3"][i]).hex()
            assert h not in seen, f"content {h} valid twice ({seen[h]} and {name}[{i}])"
            seen[h] = f"{name}[{i}]"
            block = next(k for k, b in enumerate(blocks) if b["first_row"] <= i < b["first_row"] + b["rows"])
            want_input, want = expected[h]
            assert block == want_input, f"{name}[{i}] ({h}) kept from input {block}, expected the first holder {want_input}"
            assert (split, labels[int(d["labels"][i])], bytes(d["source_path"][i])) == (want[0], want[1], want[3]), \
                f"{name}[{i}]: split/label/path {(split, labels[int(d['labels'][i])], bytes(d['source_path'][i]))} != {(want[0], want[1], want[3])}"
    missing = set(expected) - set(seen)
    assert not missing, f"{len(missing)} contents without a valid row"
    print(f"ok: {len(seen)} contents over {len(inputs)} inputs, one valid row each, first input wins")


spec = json.load(open(sys.argv[2]))
{"same": same, "hosts": hosts}[sys.argv[1]](spec)
