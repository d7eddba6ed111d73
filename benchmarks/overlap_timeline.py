"""Timelines of derived computes: when each read batch is submitted, lands, and is consumed.

For the whole-array read, a MIP, ``[:half]`` and ``astype("f8").sum()`` over ``--planes``
files of 16 MiB (threaded scheduler), prints the wall time, the time spent building and
optimising the graph, and per task kind the first start, last end and busy time (a dask
``Callback``), plus per KvikIO batch the time its submission took and when its last job
landed (``_Batch`` wrapped here, nothing changed in the library). Run it once per
``GPULAZY_THREADS`` value to see what the I/O thread count does. ``--cached`` adds a MIP
from a warm ``DeviceCache`` beside the same MIP over the same chunks held in a dask array.

    GPULAZY_THREADS=16 python benchmarks/overlap_timeline.py [--planes 256] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections import defaultdict

import numpy as np


def _instrument_batches(log: list) -> None:
    from gpulazy.io import _kvikio

    submit, close = _kvikio._Batch._submit, _kvikio._Batch._close

    def timed_submit(self):
        t0 = time.perf_counter()
        submit(self)
        self._diag = [t0, time.perf_counter(), len(self.jobs), self.staged]

    def timed_close(self):
        close(self)
        d = getattr(self, "_diag", None)
        if d is not None:
            log.append((*d, time.perf_counter()))

    _kvikio._Batch._submit, _kvikio._Batch._close = timed_submit, timed_close


def _tasks_callback(spans: list):
    from dask.callbacks import Callback

    starts: dict = {}
    lock = threading.Lock()

    def pre(key, dsk, state):
        starts[key] = time.perf_counter()

    def post(key, result, dsk, state, worker_id):
        name = re.sub(r"-[0-9a-f]{8,}", "", str(key[0] if isinstance(key, tuple) else key))
        with lock:
            spans.append((name[:40], starts.pop(key, None), time.perf_counter()))

    return Callback(pretask=pre, posttask=post)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--planes", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--dir", help="where the planes are written (kept, and reused by a later run)")
    ap.add_argument("--device", default="cuda:0", help="cpu: check this script without a GPU (no batch timings)")
    ap.add_argument("--cached", action="store_true",
                    help="also a MIP from a warm DeviceCache and one over the same chunks held by dask")
    ap.add_argument("--shape", default="8192,1024", help="one plane (uint16)")
    args = ap.parse_args()
    import dask

    import gpulazy

    shape = tuple(int(n) for n in args.shape.split(","))
    tmp = args.dir or tempfile.mkdtemp()
    os.makedirs(tmp, exist_ok=True)
    plane = np.random.default_rng(0).integers(0, 4096, shape, dtype=np.uint16)
    paths = []
    for i in range(args.planes):
        p = os.path.join(tmp, f"z{i:05d}.raw")
        if not os.path.exists(p) or os.path.getsize(p) != plane.nbytes:
            (plane + np.uint16(i)).tofile(p)
        paths.append(p)
    total = plane.nbytes * args.planes
    vol = gpulazy.from_files(paths, shape=shape, dtype="uint16", device=args.device, cache=False)
    half = args.planes // 2
    batches: list = []
    if args.device == "cpu":
        def sync():
            pass
    else:
        import cupy as cp

        sync = cp.cuda.Device(int(args.device.partition(":")[2] or 0)).synchronize
        _instrument_batches(batches)
    cases = {
        "whole": (lambda: vol, 1.0),
        "mip": (lambda: vol.max(axis=0), 1.0),
        "half": (lambda: vol[:half], half / args.planes),
        "astype_sum": (lambda: vol.astype("f8").sum(), 1.0),
        "mip_sync": (lambda: vol.max(axis=0), 1.0),
    }
    if args.cached:
        import dask.array as da

        cache = gpulazy.DeviceCache(int(total * 1.1), device=args.device, name="timeline")
        held = gpulazy.from_files(paths, shape=shape, dtype="uint16", device=args.device, cache=cache)
        held.max(axis=0).compute()  # warm: every chunk in the cache
        in_memory = da.from_array(held.compute(), chunks=held.chunks, asarray=False)
        cases.update({
            # the floor dask itself sets: the same chunks already in device memory
            "mip_dask_in_memory": (lambda: in_memory.max(axis=0), 1.0),
            "mip_cached": (lambda: held.max(axis=0), 1.0),
        })
    out = {"threads": gpulazy.config.get("threads"), "chunks": len(vol.chunks[0]), "cases": {}}
    print(f"threads={out['threads']} chunks={out['chunks']} batch_size={gpulazy.config.get('batch_size')}", flush=True)
    for name, (make, frac) in cases.items():
        make().compute()
        sync()
        best = None
        for _ in range(args.repeat):
            batches.clear()
            spans: list = []
            t0 = time.perf_counter()
            arr = make()
            t_graph = time.perf_counter()
            (opt,) = dask.optimize(arr)
            t_opt = time.perf_counter()
            del opt
            with _tasks_callback(spans):
                t1 = time.perf_counter()
                res = arr.compute(scheduler="sync" if name.endswith("_sync") else None)
                sync()
            t2 = time.perf_counter()
            del res
            row = {"gbps": total * frac / (t2 - t1) / 1e9, "wall": t2 - t1, "build": t_graph - t0,
                   "optimize": t_opt - t_graph, "path": getattr(arr, "compute_path", None)}
            kinds = defaultdict(lambda: [1e9, 0.0, 0.0, 0])
            for k, s, e in spans:
                if s is None:
                    continue
                d = kinds[k]
                d[0], d[1], d[2], d[3] = min(d[0], s - t1), max(d[1], e - t1), d[2] + e - s, d[3] + 1
            row["tasks"] = {k: {"first_start": round(v[0] * 1e3, 2), "last_end": round(v[1] * 1e3, 2),
                                "busy_ms": round(v[2] * 1e3, 2), "n": v[3]} for k, v in kinds.items()}
            row["batches"] = [{"submit_at": round((s - t1) * 1e3, 2), "submit_ms": round((se - s) * 1e3, 2),
                               "jobs": n, "staged": st, "closed_at": round((c - t1) * 1e3, 2)}
                              for s, se, n, st, c in sorted(batches)]
            if best is None or row["wall"] < best["wall"]:
                best = row
        out["cases"][name] = best
        print(f"{name:11s} {best['gbps']:6.2f} GB/s wall {best['wall'] * 1e3:7.1f} ms (graph {best['build'] * 1e3:.1f} "
              f"+ optimize {best['optimize'] * 1e3:.1f} ms outside) path={best['path']}", flush=True)
        for k, v in best["tasks"].items():
            print(f"    task {k:40s} n={v['n']:4d} start {v['first_start']:7.1f} end {v['last_end']:7.1f} "
                  f"busy {v['busy_ms']:8.1f} ms", flush=True)
        for b in best["batches"]:
            print(f"    batch submit@{b['submit_at']:7.1f} took {b['submit_ms']:6.2f} ms, {b['jobs']:3d} jobs "
                  f"staged={b['staged']}, last landed@{b['closed_at']:7.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
