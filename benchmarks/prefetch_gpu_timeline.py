"""GPU timeline of a read + compute pass: where a prefetched pass's time goes, from CUDA events.

``bench_prefetch``'s setup (a raw float32 volume warm in the page cache, a matmul compute per
chunk calibrated to the chunk's read time), timed three ways: the compute alone over the same
blocks in device memory, read + compute without prefetch, and with ``gpulazy.prefetch(depth=8)``.
CUDA events (timing on) are recorded around each compute's kernels on the task's stream and
around each staged host-to-device copy on gpulazy's staging stream (``_kvikio._copy_async``
wrapped here, nothing changed in the library). For the fastest of 3 passes of each, it prints
the wall time, the GPU time of the computes, the time between one compute's end and the next
one's start (sync scheduler: host work between tasks; threads: overlapping, not meaningful),
when the first compute started, the copies' total time, how much of it ran under a compute,
and how long a copy waited between being issued and starting. ``--json DIR`` writes every
event (kind, host time issued, GPU start, GPU end, ms from the pass's start).

    python benchmarks/prefetch_gpu_timeline.py sync 64 16 [--json DIR]
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

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scheduler", choices=["sync", "threads"])
    ap.add_argument("chunks", type=int)
    ap.add_argument("chunk_mib", type=float)
    ap.add_argument("--json", default=None, metavar="DIR")
    args = ap.parse_args(argv)

    import cupy
    import dask.array as da

    import gpulazy
    from gpulazy.cache import DeviceCache
    from gpulazy.io import _kvikio

    gpulazy.config.set(streamed_maps=False)  # these passes time dask's task a chunk (gpulazy.read.mapped)

    sys.path.insert(0, HERE)
    import bench_prefetch as bp

    chunks, sched = args.chunks, args.scheduler
    rows, cols = int(args.chunk_mib * (1 << 20)) // 4096, 1024
    tmp = tempfile.TemporaryDirectory()
    path = os.path.join(tmp.name, "a.raw")
    np.random.default_rng(0).random((chunks * rows, cols), dtype=np.float32).tofile(path)
    cache = DeviceCache(2 * 10 * rows * cols * 4, device="cuda:0", name="gpu-timeline")
    vol = gpulazy.from_files(path, shape=(chunks * rows, cols), dtype="float32", chunks=(rows, cols),
                             device="cuda:0", cache=cache)
    block = vol[:rows].compute(scheduler="sync")
    mem = da.from_array(cupy.concatenate([block] * chunks), chunks=(rows, cols), asarray=False)

    def read_only():
        cache.clear()
        return vol.map_blocks(bp._corner, dtype=vol.dtype).compute(scheduler=sched)

    read_only()
    t0 = time.perf_counter()
    read_only()
    t_read = time.perf_counter() - t0
    iters = max(1, round(t_read / chunks / bp._time_one_iteration(cupy, block, "matmul")))

    events: list[tuple[str, float, object, object]] = []  # (kind, host time issued, start, end)
    lock = threading.Lock()
    real_copy = _kvikio._copy_async

    def copy_async(out, host, at, nbytes, stream):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        issued = time.perf_counter()
        a.record(stream)
        real_copy(out, host, at, nbytes, stream)
        b.record(stream)
        with lock:
            events.append(("h2d", issued, a, b))

    def busy(x):
        if x.size == 0:  # dask's call on an empty meta
            return x[:1, :1].copy()
        s = cupy.cuda.get_current_stream()
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        issued = time.perf_counter()
        a.record(s)
        n = min(x.shape)
        sq = y = x[:n, :n]
        for _ in range(iters):
            y = sq @ sq
        b.record(s)
        with lock:
            events.append(("compute", issued, a, b))
        out = y[:1, :1].copy()
        s.synchronize()
        return out

    p = gpulazy.prefetch(depth=8)
    passes = {
        "compute": lambda: mem.map_blocks(busy, dtype=vol.dtype).compute(scheduler=sched),
        "naive": lambda: vol.map_blocks(busy, dtype=vol.dtype).compute(scheduler=sched),
        "prefetch": lambda: _with(p, lambda: vol.map_blocks(busy, dtype=vol.dtype).compute(scheduler=sched)),
    }

    def one(run):
        cache.clear()
        events.clear()
        cupy.cuda.Device().synchronize()
        zero = cupy.cuda.Event()
        zero.record(cupy.cuda.Stream.null)
        h0 = time.perf_counter()
        run()
        wall = (time.perf_counter() - h0) * 1e3
        cupy.cuda.Device().synchronize()
        return wall, [(k, (h - h0) * 1e3, cupy.cuda.get_elapsed_time(zero, a), cupy.cuda.get_elapsed_time(zero, b))
                      for k, h, a, b in events]

    _kvikio._copy_async = copy_async
    try:
        for name, run in passes.items():
            one(run)
            wall, ev = min((one(run) for _ in range(3)), key=lambda r: r[0])
            print(_summary(name, sched, chunks, args.chunk_mib, wall, ev, t_read), flush=True)
            if args.json:
                os.makedirs(args.json, exist_ok=True)
                with open(os.path.join(args.json, f"gpu-timeline-{name}-{sched}-{chunks}x{args.chunk_mib:g}.json"),
                          "w") as f:
                    json.dump({"wall_ms": wall, "read_alone_ms": t_read * 1e3, "events": ev}, f)
    finally:
        _kvikio._copy_async = real_copy
        cache.close()
        tmp.cleanup()
    return 0


def _with(p, fn):
    with p:
        return fn()


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


def _summary(name: str, sched: str, chunks: int, mib: float, wall: float, ev: list, t_read: float) -> str:
    comp = sorted((s, e) for k, _, s, e in ev if k == "compute")
    copies = [(h, s, e) for k, h, s, e in ev if k == "h2d"]
    under = sum(max(0.0, min(e, ce) - max(s, cs)) for _, s, e in copies for cs, ce in comp)
    gaps = [b[0] - a[1] for a, b in zip(comp, comp[1:])]
    waits = [s - h for h, s, _ in copies]
    return (f"{name:9s} {sched} {chunks} x {mib:g} MiB: wall {wall:6.1f} ms (read alone {t_read * 1e3:.1f}) | "
            f"GPU compute {sum(e - s for s, e in comp):6.1f} ms in {len(comp)}, first at {comp[0][0]:.1f} ms, "
            f"between computes median {_median(gaps):.3f} ms, sum {sum(gaps):.1f} | "
            f"{len(copies)} copies {sum(e - s for _, s, e in copies):5.1f} ms, {under:5.1f} ms under a compute, "
            f"issued to started median {_median(waits):.3f} ms")


if __name__ == "__main__":
    sys.exit(main())
