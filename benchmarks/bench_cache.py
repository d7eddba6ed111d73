"""Recomputing a cached array against its first compute (issue target: ≥ 10× faster).

    python benchmarks/bench_cache.py [--device cpu|cuda:N] [--size 1GiB] [--json PATH]

Writes a volume of raw slices, builds ``from_files(..., cache=DeviceCache(2 × size))``
and times ``vol.sum().compute()`` twice: the first reads every chunk (misses), the
second finds every chunk in the device cache (hits); a first compute after dropping the
page cache is timed as well. Prints both, the ratio, and the
cache's figures (bytes held never above capacity). The page cache is warm for both, so
the warm ratio is device cache against page cache, the hardest case for the cache; the
cold one (page cache dropped before the first compute) is what a volume bigger than RAM sees.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

TARGET = 10.0


def run(device: str | None = None, size: str = "1GiB", repeat: int = 3) -> dict:
    import gpulazy
    from gpulazy.cache import DeviceCache

    dev = gpulazy.get_device(device)
    nbytes = gpulazy.config.parse_bytes(size)
    side = 1024
    planes = max(1, nbytes // (side * side * 2))
    folder = tempfile.mkdtemp(prefix="gpulazy-bench-cache-")
    try:
        plane = np.arange(side * side, dtype=np.uint16).reshape(side, side)
        paths = []
        for i in range(planes):
            p = os.path.join(folder, f"z{i:05d}.raw")
            plane.tofile(p)
            paths.append(p)
        want = int(plane.astype(np.int64).sum()) * planes
        cache = DeviceCache(2 * planes * plane.nbytes, device=dev.name)
        vol = gpulazy.from_files(paths, shape=(side, side), dtype="uint16", device=dev.name, cache=cache,
                                 chunks=(16, side, side))

        def timed() -> float:
            t0 = time.perf_counter()
            got = int(vol.sum(dtype="int64").compute())
            dev.synchronize()
            seconds = time.perf_counter() - t0
            assert got == want, (got, want)
            return seconds

        vol[:1].sum(dtype="int64").compute()  # start-up (CUDA, backend, this kernel) is not measured
        from gpulazy._bench import drop_page_cache

        cache.clear()
        drop_page_cache(paths)
        first_cold = timed()
        cache.clear()
        cache.reset_stats()
        first = timed()
        cached = min(timed() for _ in range(repeat))
        stats = cache.stats()
        cache.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"device": dev.name, "bytes": planes * plane.nbytes, "chunks": vol.npartitions,
            "first_seconds": first, "first_cold_seconds": first_cold, "cached_seconds": cached,
            "speedup": first / cached, "speedup_cold": first_cold / cached,
            "target": TARGET, "meets_target": first / cached >= TARGET, "hits": stats["hits"],
            "misses": stats["misses"], "bytes_held": stats["bytes_held"], "capacity": stats["capacity"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    r = run(args.device, args.size)
    gb = r["bytes"] / 1e9
    print(f"cache benchmark: {r['device']}, {r['bytes'] / 2**30:.2f} GiB in {r['chunks']} chunks, vol.sum()")
    print(f"first compute, cold:     {r['first_cold_seconds']:.4f} s  ({gb / r['first_cold_seconds']:.1f} GB/s)")
    print(f"first compute, warm:     {r['first_seconds']:.4f} s  ({gb / r['first_seconds']:.1f} GB/s)")
    print(f"recompute (cache hits):  {r['cached_seconds']:.4f} s  ({gb / r['cached_seconds']:.1f} GB/s)")
    print(f"speedup over a cold first compute {r['speedup_cold']:.1f}x, over a warm one {r['speedup']:.1f}x "
          f"({'meets' if r['meets_target'] else 'MISSES'} target >= {TARGET:g}x even warm); "
          f"hits {r['hits']}, misses {r['misses']}; held {r['bytes_held']} of {r['capacity']} bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
