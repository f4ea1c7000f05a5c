"""Reader-side checks for the output writer tests (tests/output_*.rs).

Reads an ailhd output the way a user does (h5py, numpy.load with mmap_mode="r") and compares
every column with the rows the Rust tests generate (`expected_*` mirrors
tests/common/output.rs). Prints one JSON object; exits non-zero with a message on a mismatch.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np

BASE_LABELS = ["BACKGROUND", "CRACK", "LEAK", "NORMAL", "UNCLASSIFIED"]


def expected_mel(i, row_len):
    j = np.arange(row_len, dtype=np.int64)
    return (((i * 7 + j) % 1000) * 0.25 - 50.0).astype(np.float16)


def expected_waveform(i, n):
    j = np.arange(n, dtype=np.int64)
    return (((i * 3 + j) % 100) / 100.0).astype(np.float32)


def expected_meta(i):
    absent = i % 3 == 0
    return dict(
        label=i % 5,
        blake3=np.array([(i + k) % 256 for k in range(32)], dtype=np.uint8),
        source_path=f"LEAK/Ünïcødé €-{i}.wav",
        sensor_id="" if absent else f"S{i:03}ü",
        recording_id="" if absent else f"R{i}",
        recorded_at=-1 if absent else 1_700_000_000 + i,
        gain_db=float("nan") if absent else i * 0.5,
    )


class Mismatch(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Mismatch(what)


def decode(raw):
    # Fixed-length NUL-padded UTF-8: numpy/h5py give bytes with the padding stripped.
    return bytes(raw).rstrip(b"\0").decode("utf-8")


def check_rows(cols, lo, hi, valid_zero, relabel):
    """cols: name -> array-like indexable by a slice (h5py dataset or numpy array)."""
    if hi <= lo:
        return
    mel = np.asarray(cols["segments_mel"][lo:hi])
    row_len = int(np.prod(mel.shape[1:]))
    labels = np.asarray(cols["labels"][lo:hi])
    valid = np.asarray(cols["valid"][lo:hi])
    blake3 = np.asarray(cols["blake3"][lo:hi])
    paths = cols["source_path"][lo:hi]
    sensors = cols["sensor_id"][lo:hi]
    recs = cols["recording_id"][lo:hi]
    at = np.asarray(cols["recorded_at"][lo:hi])
    gain = np.asarray(cols["gain_db"][lo:hi])
    wave = np.asarray(cols["segments_waveform"][lo:hi]) if "segments_waveform" in cols else None
    for k, i in enumerate(range(lo, hi)):
        e = expected_meta(i)
        check(np.array_equal(mel[k].reshape(-1), expected_mel(i, row_len)), f"segments_mel[{i}]")
        check(int(labels[k]) == relabel.get(i, e["label"]), f"labels[{i}] = {labels[k]}")
        check(int(valid[k]) == (0 if i in valid_zero else 1), f"valid[{i}] = {valid[k]}")
        check(np.array_equal(blake3[k], e["blake3"]), f"blake3[{i}]")
        check(decode(paths[k]) == e["source_path"], f"source_path[{i}] = {paths[k]!r}")
        check(decode(sensors[k]) == e["sensor_id"], f"sensor_id[{i}] = {sensors[k]!r}")
        check(decode(recs[k]) == e["recording_id"], f"recording_id[{i}] = {recs[k]!r}")
        check(int(at[k]) == e["recorded_at"], f"recorded_at[{i}] = {at[k]}")
        g = float(gain[k])
        check(
            (math.isnan(g) and math.isnan(e["gain_db"])) or g == e["gain_db"],
            f"gain_db[{i}] = {g}",
        )
        if wave is not None:
            n = int(np.prod(wave.shape[1:]))
            check(np.array_equal(wave[k].reshape(-1), expected_waveform(i, n)), f"segments_waveform[{i}]")


def expected_dtypes(path_bytes):
    return {
        "segments_mel": np.dtype("<f2"),
        "labels": np.dtype("<i2"),
        "valid": np.dtype("u1"),
        "blake3": np.dtype("u1"),
        "source_path": np.dtype(f"S{path_bytes}"),
        "sensor_id": np.dtype("S32"),
        "recording_id": np.dtype("S32"),
        "recorded_at": np.dtype("<i8"),
        "gain_db": np.dtype("<f4"),
        "segments_waveform": np.dtype("<f4"),
    }


def check_attrs(attrs, args):
    labels = json.loads(attrs["labels_json"])
    check(labels == args.labels, f"labels_json = {labels}")
    check(json.loads(attrs["label2id_json"]) == {n: i for i, n in enumerate(args.labels)}, "label2id_json")
    config = json.loads(attrs["config_json"])
    check(config["n_mels"] == args.n_mels, f"config_json n_mels = {config['n_mels']}")
    check(len(attrs["feature_fingerprint"]) == 64, "feature_fingerprint")
    check(int(attrs["schema_version"]) == 1, "schema_version")
    check(attrs["created_at_utc"].endswith("Z") and "T" in attrs["created_at_utc"], "created_at_utc")
    check(isinstance(attrs["ailhd_version"], str) and attrs["ailhd_version"], "ailhd_version")


def cmd_hdf5(args):
    import h5py

    kw = dict(libver="latest", swmr=True) if args.mode == "swmr" else {}
    with h5py.File(args.path, "r", **kw) as f:
        attrs = {k: f.attrs[k] for k in f.attrs}
        for k in ["config_json", "created_at_utc", "ailhd_version", "feature_fingerprint"]:
            check(isinstance(attrs[k], str), f"attribute {k} is {type(attrs[k])}, not str")
        # Rewritten in place when labels are appended: fixed-length UTF-8, read as bytes.
        for k in ["labels_json", "label2id_json"]:
            t = f.attrs.get_id(k).get_type()
            check(not t.is_variable_str() and t.get_cset() == h5py.h5t.CSET_UTF8, f"attribute {k} type")
            check(isinstance(attrs[k], bytes), f"attribute {k} is {type(attrs[k])}")
        check_attrs(attrs, args)
        committed = int(f["committed_rows"][0])
        check(f["committed_rows"].dtype == np.dtype("<i8") and f["committed_rows"].shape == (1,), "committed_rows")
        check(committed == args.rows, f"committed_rows = {committed}, expected {args.rows}")
        names = set(f.keys()) - {"committed_rows"}
        want = set(expected_dtypes(0)) - (set() if args.waveform else {"segments_waveform"})
        check(names == want, f"datasets {sorted(names)}")
        dts = expected_dtypes(args.path_bytes)
        info = {}
        for name in names:
            d = f[name]
            check(d.dtype == dts[name], f"{name} dtype {d.dtype}")
            check(d.shape[0] == committed, f"{name} has {d.shape[0]} rows, committed_rows = {committed}")
            check(d.maxshape[0] is None and d.chunks is not None, f"{name} not chunked/unlimited")
            info[name] = [list(d.shape), d.chunks[0]]
        for name in ["source_path", "sensor_id", "recording_id"]:
            t = f[name].id.get_type()
            check(t.get_cset() == h5py.h5t.CSET_UTF8, f"{name} charset")
            check(t.get_strpad() == h5py.h5t.STR_NULLPAD, f"{name} padding")
            check(not t.is_variable_str(), f"{name} variable length")
        # Non-ASCII paths through h5py's own decoding too.
        if committed:
            check(f["source_path"].asstr()[0] == expected_meta(0)["source_path"], "asstr()")
        cols = {n: f[n] for n in names}
        check_rows(cols, 0, committed, args.valid_zero, args.relabel)
        superblock = f.id.get_create_plist().get_version()[0]
    print(json.dumps(dict(committed=committed, datasets=info, superblock=superblock)))


def cmd_npy(args):
    d = args.path
    with open(f"{d}/attributes.json") as fh:
        attrs = json.load(fh)
    check_attrs(attrs, args)
    committed = attrs["committed_rows"]
    check(committed == args.rows, f"committed_rows = {committed}, expected {args.rows}")
    dts = expected_dtypes(args.path_bytes)
    names = list(dts) if args.waveform else [n for n in dts if n != "segments_waveform"]
    cols, info = {}, {}
    for name in names:
        a = np.load(f"{d}/{name}.npy", mmap_mode="r")
        check(a.dtype == dts[name], f"{name} dtype {a.dtype}")
        check(a.shape[0] == committed, f"{name}.npy shape {a.shape}, committed_rows = {committed}")
        cols[name] = a
        info[name] = list(a.shape)
    check_rows(cols, 0, committed, args.valid_zero, args.relabel)
    print(json.dumps(dict(committed=committed, shapes=info)))


def cmd_try_open(args):
    """How each kind of reader fares with a file as it lies (e.g. after a killed writer)."""
    import h5py

    out = {}
    for mode, kw in [("plain", {}), ("swmr", dict(libver="latest", swmr=True))]:
        try:
            with h5py.File(args.path, "r", **kw) as f:
                committed = int(f["committed_rows"][0])
                cols = {n: f[n] for n in f.keys() if n != "committed_rows"}
                rows = {n: c.shape[0] for n, c in cols.items()}
                check(min(rows.values()) >= committed, f"datasets shorter than committed_rows: {rows}")
                check_rows(cols, 0, committed, set(), {})
                out[mode] = dict(ok=True, committed=committed, rows=rows)
        except Mismatch:
            raise
        except Exception as e:  # noqa: BLE001 - reported, not raised: this is what we measure
            out[mode] = dict(ok=False, error=str(e))
    print(json.dumps(out))


def cmd_swmr_follow(args):
    """An h5py SWMR reader following a growing file, as a trainer does: refresh
    committed_rows first, then the datasets; every row below committed_rows must be complete."""
    import h5py

    deadline = time.time() + args.timeout
    while True:
        try:
            f = h5py.File(args.path, "r", libver="latest", swmr=True)
            break
        except OSError:
            # The writer may still be creating the file.
            check(time.time() < deadline, "file never became readable")
            time.sleep(0.01)
    checked, polls, grew, max_seen, attr_reads = 0, 0, 0, 0, 0
    cr = f["committed_rows"]
    names = [n for n in f.keys() if n != "committed_rows"]
    cols = {n: f[n] for n in names}
    rng = np.random.default_rng(1)
    while True:
        polls += 1
        cr.refresh()
        committed = int(cr[0])
        check(committed >= max_seen, f"committed_rows went back from {max_seen} to {committed}")
        for d in cols.values():
            d.refresh()
        for n, d in cols.items():
            check(d.shape[0] >= committed, f"{n} has {d.shape[0]} rows < committed_rows {committed}")
        if committed > checked:
            grew += 1
        # New rows fully; one old row again (its chunk may be rewritten by later appends).
        # valid/labels may have been edited in place by the writer: any 0/1, any label id.
        check_edit_tolerant(cols, checked, committed)
        if committed:
            i = int(rng.integers(0, committed))
            check_edit_tolerant(cols, i, i + 1)
        checked = max_seen = committed
        if polls % 10 == 0:
            labels = json.loads(f.attrs["labels_json"])
            check(labels[: len(BASE_LABELS)] == BASE_LABELS, f"labels_json = {labels}")
            attr_reads += 1
        if committed >= args.target:
            break
        check(time.time() < deadline, f"timed out at committed_rows = {committed}")
        time.sleep(args.interval)
    f.close()
    print(json.dumps(dict(polls=polls, grew=grew, committed=committed, attr_reads=attr_reads)))


def cmd_npy_follow(args):
    """A numpy reader following growing npy columns: load every column with mmap_mode="r"
    again and again; each load must succeed and every row below its header shape be complete."""
    deadline = time.time() + args.timeout
    names = list(expected_dtypes(0))[:-1]
    checked, polls, grew = 0, 0, 0
    while True:
        polls += 1
        cols = {n: np.load(f"{args.path}/{n}.npy", mmap_mode="r") for n in names}
        committed = min(a.shape[0] for a in cols.values())
        check(committed >= checked, f"rows went back from {checked} to {committed}")
        if committed > checked:
            grew += 1
        check_edit_tolerant(cols, checked, committed)
        checked = committed
        del cols
        if committed >= args.target:
            break
        check(time.time() < deadline, f"timed out at {committed} rows")
        time.sleep(args.interval)
    print(json.dumps(dict(polls=polls, grew=grew, committed=committed)))


def cmd_hold(args):
    """Open the file (h5py defaults: file locking on) and keep it open, as a long training run
    does, until killed."""
    import h5py

    kw = dict(libver="latest", swmr=True) if args.mode == "swmr" else {}
    f = h5py.File(args.path, "r", **kw)
    print(f"holding {int(f['committed_rows'][0])}", flush=True)
    time.sleep(args.timeout)
    f.close()


def cmd_chunks(args):
    """Where each chunked dataset's chunks lie in the file (HDF5's chunk index, through h5py):
    {name: {"row_bytes", "chunk_rows", "offsets": [byte offset of each chunk, in row order]}}
    and the file's size."""
    import h5py

    kw = dict(libver="latest", swmr=True) if args.mode == "swmr" else {}
    out = {}
    with h5py.File(args.path, "r", locking=False, **kw) as f:
        for name, d in f.items():
            if d.chunks is None:
                continue
            found = []

            def visit(info, found=found):
                found.append((info.chunk_offset[0], info.byte_offset))

            d.id.chunk_iter(visit)
            out[name] = dict(
                row_bytes=int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize,
                chunk_rows=d.chunks[0],
                rows=d.shape[0],
                offsets=[int(o) for _, o in sorted(found)],
            )
    print(json.dumps(dict(datasets=out, file_bytes=os.path.getsize(args.path))))


def check_edit_tolerant(cols, lo, hi):
    """check_rows where valid/labels may have been edited in place by the writer. The two
    editable columns are copied once, so the expectation and the check read the same values."""
    cols = dict(cols)
    cols["valid"] = np.array(cols["valid"])
    cols["labels"] = np.array(cols["labels"])
    valid = np.asarray(cols["valid"][lo:hi])
    check(np.isin(valid, [0, 1]).all(), f"valid[{lo}:{hi}] = {valid}")
    labels = np.asarray(cols["labels"][lo:hi])
    check(((labels >= 0) & (labels < 16)).all(), f"labels[{lo}:{hi}] = {labels}")
    relabel = {i: int(labels[k]) for k, i in enumerate(range(lo, hi))}
    check_rows(cols, lo, hi, {i for k, i in enumerate(range(lo, hi)) if valid[k] == 0}, relabel)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["hdf5", "npy", "try-open", "swmr-follow", "npy-follow", "hold", "chunks"])
    p.add_argument("path")
    p.add_argument("--rows", type=int, default=0)
    p.add_argument("--mode", choices=["plain", "swmr"], default="plain")
    p.add_argument("--labels", type=json.loads, default=BASE_LABELS)
    p.add_argument("--n-mels", type=int, default=64)
    p.add_argument("--waveform", type=int, default=0)
    p.add_argument("--path-bytes", type=int, default=256)
    p.add_argument("--valid-zero", type=lambda s: set(json.loads(s)), default=set())
    p.add_argument("--relabel", type=lambda s: {int(k): v for k, v in json.loads(s).items()}, default={})
    p.add_argument("--target", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=0.0)
    args = p.parse_args()
    try:
        commands = {
            "hdf5": cmd_hdf5,
            "npy": cmd_npy,
            "try-open": cmd_try_open,
            "swmr-follow": cmd_swmr_follow,
            "npy-follow": cmd_npy_follow,
            "hold": cmd_hold,
            "chunks": cmd_chunks,
        }
        commands[args.command](args)
    except Mismatch as e:
        print(f"MISMATCH: {e}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
