"""Hand-off and scale-out (issue 11): hand-off cost, forced out-of-memory, 2 GPUs against 1.

    python benchmarks/bench_handoff.py [--size 8GiB] [--skip-scale] [--json PATH]

1. Same-device hand-off: a 64 MiB chunk on ``cuda:0`` to torch, JAX and CuPy through
   ``gpulazy.to_*``: median microseconds per call over 1000 calls, and bytes copied
   (pointer equality, device memory allocated before and after).
2. Forced out-of-memory: a cache at 25 % of the working set and a CuPy pool limit that
   leaves no room beside it: the compute must finish with correct values (recoveries counted).
3. Scale-out: ``gpulazy.cluster(n_workers=1)`` against ``n_workers=2`` (dask-cuda, one
   worker per GPU) summing the same raw files from the warm page cache, beside the host's
   page-cache ceiling (32 threads of ``os.preadv`` into host memory) in the same run:
   aggregate GB/s and which of the two binds.
On ``--device cpu`` only the conversion figures that mean something there are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def handoff(device: str, calls: int = 1000) -> dict:
    import gpulazy

    out: dict = {}
    if device == "cpu":
        a = np.zeros(32 << 20, dtype="uint16")
        funcs = {"torch": lambda: gpulazy.to_torch(a, device="cpu")}
        ptr = a.ctypes.data
        get_ptr = {"torch": lambda t: t.data_ptr()}
    else:
        import cupy

        a = cupy.zeros(32 << 20, dtype="uint16")
        ptr = a.data.ptr
        funcs = {"torch": lambda: gpulazy.to_torch(a, device=device), "cupy": lambda: gpulazy.to_cupy(a, device=device)}
        get_ptr = {"torch": lambda t: t.data_ptr(), "cupy": lambda c: c.data.ptr}
        try:
            import jax  # noqa: F401

            funcs["jax"] = lambda: gpulazy.to_jax(a)
            get_ptr["jax"] = lambda j: j.unsafe_buffer_pointer()
        except ImportError:
            pass
    for name, fn in funcs.items():
        fn()
        before = _device_used(device)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            res = fn()
            times.append(time.perf_counter() - t0)
        same = get_ptr[name](res) == ptr
        out[name] = {"median_us": statistics.median(times) * 1e6, "p95_us": sorted(times)[int(0.95 * calls)] * 1e6,
                     "zero_copy": bool(same), "device_bytes_added": _device_used(device) - before}
    return out


def _device_used(device: str) -> int:
    if device == "cpu":
        return 0
    import cupy

    used = cupy.get_default_memory_pool().used_bytes()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        used += torch.cuda.memory_allocated()
    return int(used)


def forced_oom(folder: str) -> dict:
    import cupy

    import gpulazy

    side, n = 1024, 256  # 512 MiB of uint16
    data = np.random.default_rng(1).integers(0, 60000, (n, side, side), dtype="uint16")
    path = os.path.join(folder, "oom.raw")
    data.tofile(path)
    cache = gpulazy.DeviceCache(data.nbytes // 4, device="cuda:0")
    pool = cupy.get_default_memory_pool()
    limit = pool.get_limit()
    try:
        vol = gpulazy.from_files(path, shape=data.shape, dtype="uint16", chunks=(16, side, side), device="cuda:0",
                                 cache=cache)
        vol.max().compute(scheduler="sync")  # fills the cache to its capacity
        pool.free_all_blocks()
        before = gpulazy.stats().snapshot()["oom_recoveries"].get("cuda:0", 0)
        # Room for one step of the compute (a 64 MiB batch read, its float32 copies) but not
        # beside the full cache: the first step runs out, evicts the cache and goes on.
        pool.set_limit(size=pool.used_bytes() + (160 << 20))
        got = vol.astype("float32").max(axis=0).compute(scheduler="sync")
        pool.set_limit(size=limit)
        ok = bool((cupy.asnumpy(got) == data.max(axis=0).astype("float32")).all())
        return {"correct": ok, "recoveries": gpulazy.stats().snapshot()["oom_recoveries"].get("cuda:0", 0) - before,
                "cache_capacity": cache.capacity, "working_set": data.nbytes}
    finally:
        pool.set_limit(size=limit)
        cache.close()


def page_cache_ceiling(paths: list[str], threads: int = 32) -> float:
    size = os.path.getsize(paths[0])
    bufs = [np.empty(size, np.uint8) for _ in range(threads)]

    def read(i_path):
        i, p = i_path
        fd = os.open(p, os.O_RDONLY)
        try:
            os.preadv(fd, [bufs[i % threads]], 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, enumerate(paths)))  # warm
        t0 = time.perf_counter()
        list(pool.map(read, enumerate(paths)))
        return len(paths) * size / (time.perf_counter() - t0) / 1e9


def scale(folder: str, nbytes: int, repeat: int = 3) -> dict:
    import gpulazy

    side = 2048
    plane = np.random.default_rng(2).integers(0, 60000, (side, side), dtype="uint16")
    per_file = 8  # planes per file: 64 MiB files
    nfiles = max(2, nbytes // (per_file * plane.nbytes))
    paths = []
    for i in range(nfiles):
        p = os.path.join(folder, f"s{i:05d}.raw")
        np.broadcast_to(plane, (per_file, side, side)).tofile(p)
        paths.append(p)
    total = nfiles * per_file * plane.nbytes
    ceiling = page_cache_ceiling(paths)
    out = {"bytes": total, "page_cache_ceiling_gbps": ceiling}
    for n in (1, 2):
        client = gpulazy.cluster(n_workers=n, dashboard_address=None, prefetch=False)
        try:
            vol = gpulazy.from_files(paths, shape=(per_file, side, side), dtype="uint16", device="cuda:0",
                                     cache=False, chunks=(1, per_file, side, side))
            s = vol.max()
            s.compute()  # start-up, kernels, page cache
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                s.compute()
                times.append(time.perf_counter() - t0)
            out[f"gpus_{n}_gbps"] = total / min(times) / 1e9
        finally:
            cluster = client.cluster
            client.close()
            cluster.close()
    out["speedup"] = out["gpus_2_gbps"] / out["gpus_1_gbps"]
    out["binds"] = "page cache" if out["gpus_2_gbps"] >= 0.9 * ceiling else "GPUs (reads)"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="8GiB")
    ap.add_argument("--device", default=None)
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import gpulazy

    dev = gpulazy.get_device(args.device)
    result: dict = {"device": dev.name, "handoff": handoff(dev.name)}
    for name, r in result["handoff"].items():
        print(f"hand-off to {name:5s}: median {r['median_us']:.1f} us, p95 {r['p95_us']:.1f} us, "
              f"zero-copy {r['zero_copy']}, device bytes added {r['device_bytes_added']}")
    folder = tempfile.mkdtemp(prefix="gpulazy-bench-handoff-")
    try:
        if dev.is_gpu:
            result["oom"] = forced_oom(folder)
            print(f"forced OOM, cache 25 % of the working set: correct={result['oom']['correct']}, "
                  f"recoveries={result['oom']['recoveries']}")
            from gpulazy.device import gpu_count

            if not args.skip_scale and gpu_count() >= 2:
                r = result["scale"] = scale(folder, gpulazy.config.parse_bytes(args.size))
                print(f"scale-out over {r['bytes'] / 2**30:.1f} GiB: 1 GPU {r['gpus_1_gbps']:.1f} GB/s, "
                      f"2 GPUs {r['gpus_2_gbps']:.1f} GB/s ({r['speedup']:.2f}x); page-cache ceiling "
                      f"{r['page_cache_ceiling_gbps']:.1f} GB/s; binds: {r['binds']}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
