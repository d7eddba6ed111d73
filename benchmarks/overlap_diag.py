"""Diagnostics behind bench_overlap's rows: where a prefetch pass and a MIP spend their time.

Writes ``DIR/profiles.txt`` (cProfile of the main thread: a MIP on the threaded and sync
schedulers, staged and not, and a prefetch pass with a sleeping compute) and prints the
prefetch pass beside raw KvikIO reading 8 chunks ahead of the same sleep. ``--sweep``
first times the MIP over ``batch_size`` x ``staging`` x scheduler.

    python benchmarks/overlap_diag.py --out DIR [--sweep]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _profile(fn, path, top=35):
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    fn()
    pr.disable()
    wall = time.perf_counter() - t0
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(top)
    s2 = io.StringIO()
    pstats.Stats(pr, stream=s2).sort_stats("tottime").print_stats(top)
    with open(path, "a") as f:
        f.write(f"==== wall {wall:.4f}s\n{s.getvalue()}\n---- tottime\n{s2.getvalue()}\n")
    return wall


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--planes", type=int, default=256)
    ap.add_argument("--sweep", action="store_true", help="time the MIP over batch_size x staging x scheduler")
    args = ap.parse_args()
    import cupy as cp
    import dask
    import dask.array as da

    import gpulazy
    from gpulazy.cache import DeviceCache

    sys.path.insert(0, HERE)
    import bench_prefetch

    gpulazy.config.set(streamed_maps=False)  # dask's task a chunk, as read-ahead works on it

    prof = os.path.join(args.out, "profiles.txt")
    tmp = tempfile.mkdtemp()
    rows, cols = 8192, 1024
    shape = (rows, cols)
    rng = np.random.default_rng(0)
    plane = rng.integers(0, 4096, shape, dtype=np.uint16)
    paths = []
    for i in range(args.planes):
        p = os.path.join(tmp, f"z{i:05d}.raw")
        (plane + np.uint16(i)).tofile(p)
        paths.append(p)
    total = plane.nbytes * args.planes
    vol = gpulazy.from_files(paths, shape=shape, dtype="uint16", device="cuda:0", cache=False)
    sync = cp.cuda.Device(0).synchronize

    def rate(fn, n=3):
        best = 1e9
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return total / best / 1e9

    vol.compute(); sync()
    with gpulazy.config.set(batch_size="512 MiB"):
        vol.max(axis=0).compute(); sync()
    if args.sweep:
        print(f"planes compute {rate(lambda: vol.compute()):.2f} GB/s", flush=True)
        for sched in ("threads", "sync"):
            for staging in ("tasks", "never"):
                for bs in ("64 MiB", "128 MiB", "512 MiB", "2 GiB", "0"):
                    with gpulazy.config.set(batch_size=bs, staging=staging):
                        r = rate(lambda: vol.max(axis=0).compute(scheduler=sched))
                    print(f"MIP {sched:8s} staging={staging:6s} batch={bs:8s} {r:6.2f} GB/s", flush=True)
    opt = dask.optimize(vol.max(axis=0))[0]
    print("tasks in optimized MIP graph:", len(dict(opt.__dask_graph__())), flush=True)
    with open(prof, "w") as f:
        f.write("profiles\n")
    w = _profile(lambda: vol.max(axis=0).compute(), prof)
    print(f"MIP threads under cProfile (main thread): {w:.3f}s", flush=True)
    w = _profile(lambda: vol.max(axis=0).compute(scheduler="sync"), prof)
    print(f"MIP sync under cProfile: {w:.3f}s", flush=True)
    with gpulazy.config.set(staging="never"):
        w = _profile(lambda: vol.max(axis=0).compute(scheduler="sync"), prof)
    print(f"MIP sync staging=never under cProfile: {w:.3f}s", flush=True)

    # Prefetch, sleep compute, sync scheduler, profiled.
    import gpulazy.prefetch as gp
    for compute in ("sleep",):
        r = bench_prefetch.run(device="cuda:0", chunks=64, chunk_mib=16, depth=8, compute=compute,
                               scheduler="sync", repeat=2)
        print(f"prefetch {compute}/sync: read {r['seconds_read']:.4f} compute {r['seconds_compute']:.4f} "
              f"naive {r['seconds_naive']:.4f} prefetch {r['seconds_prefetch']:.4f} ratio {r['ratio']:.2f}", flush=True)
    # Timeline of one prefetch pass with a sleep compute.
    rows2 = 4096
    path = os.path.join(tmp, "pf.raw")
    with open(path, "wb") as f:
        for _ in range(64):
            rng.random((rows2, 1024), dtype=np.float32).tofile(f)
    cache = DeviceCache(20 * rows2 * 4096, device="cuda:0", name="diag")
    v = gpulazy.from_files(path, shape=(64 * rows2, 1024), dtype="float32", chunks=(rows2, 1024),
                           device="cuda:0", cache=cache)

    def busy(b):
        time.sleep(0.0014)
        return b[:1, :1].copy()

    def run_pf():
        cache.clear()
        with gpulazy.prefetch(depth=8):
            v.map_blocks(busy, dtype=v.dtype).compute(scheduler="sync")

    run_pf()
    w = _profile(run_pf, prof)
    print(f"prefetch sleep/sync under cProfile: {w:.3f}s (64 x 1.4 ms sleep = 0.090)", flush=True)
    # raw: KvikIO, 8 reads ahead into pinned memory, the same sleep
    import kvikio
    f = kvikio.CuFile(path, "r")
    host = [cp.cuda.alloc_pinned_memory(rows2 * 4096) for _ in range(9)]
    views = [np.frombuffer(h, np.uint8, rows2 * 4096) for h in host]
    t0 = time.perf_counter()
    futs = {}
    for i in range(8):
        futs[i] = f.pread(views[i % 9], rows2 * 4096, i * rows2 * 4096)
    for i in range(64):
        futs.pop(i).get()
        if i + 8 < 64:
            futs[i + 8] = f.pread(views[(i + 8) % 9], rows2 * 4096, (i + 8) * rows2 * 4096)
        time.sleep(0.0014)
    print(f"raw KvikIO 8 ahead + sleep: {time.perf_counter() - t0:.4f}s", flush=True)
    t0 = time.perf_counter()
    for i in range(64):
        f.pread(views[0], rows2 * 4096, i * rows2 * 4096).get()
    print(f"raw KvikIO one at a time, no compute: {time.perf_counter() - t0:.4f}s", flush=True)
    f.close()
    cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
