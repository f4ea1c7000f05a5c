"""The same random file operations on two folders (the test file system of tests/common/faultfs.rs
and the normal disk) must give the same results and leave the same bytes: pwrite, append,
truncate, writes through a shared writable mapping with and without msync, rename, unlink.
Run in a process of its own: a FUSE server must never serve page faults of its own process.

usage: fs_differential.py ROOT_A ROOT_B SEED STEPS
"""
import mmap
import os
import random
import sys

a, b, seed, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
names = ["a", "b", "c", "sub/d"]
for root in (a, b):
    os.makedirs(os.path.join(root, "sub"), exist_ok=True)


def run(root, op, name, other, off, length, byte, size, flush):
    p = os.path.join(root, name)
    try:
        if op in (0, 1):
            fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, bytes([byte]) * length, off)
            finally:
                os.close(fd)
        elif op == 2:
            with open(p, "ab") as f:
                f.write(bytes([byte]) * length)
        elif op == 3:
            os.truncate(p, size)
        elif op in (4, 5):
            with open(p, "r+b") as f:
                n = os.fstat(f.fileno()).st_size
                if n:
                    m = mmap.mmap(f.fileno(), n)
                    at = off % n
                    end = min(at + length, n)
                    m[at:end] = bytes([byte]) * (end - at)
                    if flush:
                        m.flush()
                    m.close()
        elif op == 6:
            os.rename(p, os.path.join(root, other))
        else:
            os.unlink(p)
        return "ok"
    except OSError as e:
        return type(e).__name__


def read(root, n):
    try:
        with open(os.path.join(root, n), "rb") as f:
            return f.read()
    except OSError as e:
        return type(e).__name__


log = []
for step in range(steps):
    args = (
        rng.randrange(8),
        rng.choice(names),
        rng.choice(names),
        rng.randrange(150_000),
        rng.randrange(40_000),
        step % 251 + 1,
        rng.randrange(160_000),
        rng.random() < 0.5,
    )
    ra, rb = run(a, *args), run(b, *args)
    log.append((step, args, ra))
    assert ra == rb, f"step {step}: {args[:2]}: {ra} here, {rb} on the normal disk"
    if step % 50 == 49 or step == steps - 1:
        for n in names:
            da, db = read(a, n), read(b, n)
            if da != db:
                if isinstance(da, bytes) and isinstance(db, bytes) and len(da) == len(db):
                    diff = [i for i in range(len(da)) if da[i] != db[i]]
                    print(f"differs at {len(diff)} bytes, {diff[0]}..{diff[-1]}: here {set(da[i] for i in diff)}, normal disk {set(db[i] for i in diff)}")
                for entry in log[-80:]:
                    print(entry)
            assert da == db, f"step {step}: {n} differs: {len(da)} bytes here, {len(db)} on the normal disk"
print(f"ok: {steps} operations, the same results and bytes")
