"""Confirm the two causes of issue 10 with KvikIO and CuPy alone (no gpulazy code).

1. Streams: KvikIO's compat-mode copies run on blocking per-thread streams, which
   serialise with kernels on CuPy's legacy default stream. Timed: matmuls alone, reads
   alone, both together (reads in a thread), with the matmuls on the legacy stream and
   on a non-blocking stream, and with the reads done as KvikIO *host* reads into pinned
   memory followed by our own copy on a non-blocking stream (the design candidate).
2. The GIL: a pure-Python loop beside reads submitted one file at a time (open, pread,
   wait, close each) and beside the same reads submitted all at once, then waited.

Prints one JSON object (also to ``--json PATH``). GPU only.

    python benchmarks/overlap_probe.py --files 128 --mib 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _together(read, compute) -> float:
    box = {}

    def reader():
        box["t"] = _timed(read)

    t0 = time.perf_counter()
    th = threading.Thread(target=reader)
    th.start()
    compute()
    th.join()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=128)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import cupy as cp
    import kvikio
    import kvikio.defaults

    kvikio.defaults.set({"num_threads": 32})
    nbytes = args.mib << 20
    tmp = tempfile.mkdtemp(dir=args.dir)
    paths = []
    block = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    for i in range(args.files):
        p = os.path.join(tmp, f"p{i:04d}.raw")
        block.tofile(p)
        paths.append(p)
    total = nbytes * args.files
    dev = cp.empty(total, dtype=cp.uint8)
    pinned_mem = cp.cuda.alloc_pinned_memory(total)
    pinned = np.frombuffer(pinned_mem, np.uint8, total)
    nb = cp.cuda.Stream(non_blocking=True)
    res: dict = {"files": args.files, "mib": args.mib, "gib": total / 2**30, "kvikio": kvikio.__version__}

    def read_device():  # KvikIO into device memory: compat-mode copies on its blocking streams
        fs = [kvikio.CuFile(p, "r") for p in paths]
        futs = [f.pread(dev[i * nbytes:(i + 1) * nbytes]) for i, f in enumerate(fs)]
        for fu in futs:
            fu.get()
        for f in fs:
            f.close()

    def read_staged():  # KvikIO into pinned host memory, then one copy per file on a non-blocking stream
        fs = [kvikio.CuFile(p, "r") for p in paths]
        futs = [f.pread(pinned[i * nbytes:(i + 1) * nbytes]) for i, f in enumerate(fs)]
        for i, fu in enumerate(futs):
            fu.get()
            cp.cuda.runtime.memcpyAsync(dev.data.ptr + i * nbytes, pinned_mem.ptr + i * nbytes, nbytes,
                                        cp.cuda.runtime.memcpyHostToDevice, nb.ptr)
        nb.synchronize()
        for f in fs:
            f.close()

    def read_one_by_one():  # open, submit, wait, close per file: the GIL per file
        for i, p in enumerate(paths):
            f = kvikio.CuFile(p, "r")
            f.pread(dev[i * nbytes:(i + 1) * nbytes]).get()
            f.close()

    def h2d():
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, pinned_mem.ptr, total, cp.cuda.runtime.memcpyHostToDevice, nb.ptr)
        nb.synchronize()

    for fn in (read_device, read_staged, read_one_by_one, h2d):
        fn()  # warm: page cache, pools
    res["gbps_pinned_h2d"] = total / min(_timed(h2d) for _ in range(3)) / 1e9
    t_dev = min(_timed(read_device) for _ in range(3))
    t_staged = min(_timed(read_staged) for _ in range(3))
    t_1by1 = min(_timed(read_one_by_one) for _ in range(2))
    res.update(gbps_read_device=total / t_dev / 1e9, gbps_read_staged=total / t_staged / 1e9,
               gbps_read_one_by_one=total / t_1by1 / 1e9)
    ok = bool((dev[:nbytes].get() == block).all())
    res["staged_bytes_equal"] = ok

    # 1. Streams: GPU-bound matmuls beside the reads.
    a = cp.random.random((4096, 4096), dtype=cp.float32)
    (a @ a).sum().item()

    def matmuls(stream=None):
        def run():
            s = stream or cp.cuda.Stream.null
            with s:
                x = a
                for _ in range(40):
                    x = a @ a
                s.synchronize()
        return run

    # Launch-bound: many tiny kernels (Python-busy).
    small = cp.zeros(64, cp.float32)

    def tiny(stream=None):
        def run():
            s = stream or cp.cuda.Stream.null
            with s:
                for _ in range(20000):
                    small.__iadd__(1)
                s.synchronize()
        return run

    matmuls()()
    tiny()()
    t_mm = min(_timed(matmuls()) for _ in range(2))
    t_tiny = min(_timed(tiny()) for _ in range(2))
    res.update(t_read_device=t_dev, t_read_staged=t_staged, t_matmul=t_mm, t_tiny=t_tiny)
    for cname, comp, t_c in (("matmul", matmuls, t_mm), ("tiny", tiny, t_tiny)):
        for rname, read, t_r in (("device", read_device, t_dev), ("staged", read_staged, t_staged)):
            for sname, stream in (("legacy", None), ("nonblocking", cp.cuda.Stream(non_blocking=True))):
                t = min(_together(read, comp(stream)) for _ in range(2))
                res[f"{cname}+{rname}@{sname}"] = {"seconds": t, "x_max": t / max(t_r, t_c),
                                                  "x_sum": t / (t_r + t_c)}

    # 2. The GIL: a pure-Python loop beside per-file and batched submission.
    def py_busy(n):
        def run():
            s = 0
            for i in range(n):
                s += i * i
        return run

    n = 10**6
    t1 = _timed(py_busy(n))
    n = max(1, int(n * t_1by1 / t1))
    t_py = _timed(py_busy(n))
    res["t_python"] = t_py
    for rname, read, t_r in (("one_by_one", read_one_by_one, t_1by1), ("batched_device", read_device, t_dev),
                             ("batched_staged", read_staged, t_staged)):
        t = _together(read, py_busy(n))
        res[f"python+{rname}"] = {"seconds": t, "t_read": t_r, "x_max": t / max(t_r, t_py),
                                  "x_sum": t / (t_r + t_py)}

    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    for p in paths:
        os.unlink(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
