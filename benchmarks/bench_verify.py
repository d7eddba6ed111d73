"""What ``verify=True`` and the file-identity checks cost, against the plain read.

Writes one file of ``--size`` bytes and its checksum manifest, then times
``from_files(...).compute()`` (best of ``--repeat``, warm page cache, no cache) with
``verify=False`` and ``verify=True``, on the whole-array fast path and through dask's
threaded scheduler, and the cost of one identity check (a ``stat`` per file of a chunk).
The target (DESIGN.md): a verified read at least 0.85 x the rate without it. On a GPU,
``verify_hashes_on`` says whether the XXH3 kernel hashed the blocks or the host did.

    python benchmarks/bench_verify.py --device cuda:0 --size 4GiB --json verify.json
    python benchmarks/bench_verify.py --device cpu --size 256MiB
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpulazy  # noqa: E402
from gpulazy.checksums import write_manifest  # noqa: E402
from gpulazy.integrity import check_unchanged  # noqa: E402


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(size: int, device: str, repeat: int, folder: str) -> dict:
    path = os.path.join(folder, "data.raw")
    n = size // 4
    np.random.default_rng(0).integers(0, 1 << 30, n, dtype="<u4").tofile(path)
    t0 = time.perf_counter()
    write_manifest([path])
    manifest_s = time.perf_counter() - t0
    out = {"device": device, "bytes": n * 4, "manifest_seconds": manifest_s}
    dev = gpulazy.device.get_device(device)
    if dev.is_gpu:  # which path the verified reads measure: the XXH3 kernel, or hashing on the host
        from gpulazy import _xxh3_gpu

        out["verify_hashes_on"] = "gpu" if _xxh3_gpu.usable(dev.index) else "host"
    for way, compute in (("fast", lambda v: v.compute()), ("threads", lambda v: (v + 0).compute(scheduler="threads"))):
        for verify in (False, True):
            vol = gpulazy.from_files(path, dtype="<u4", chunks=16 << 20, device=device, cache=False, verify=verify)

            def once():
                compute(vol)
                dev.synchronize()

            once()  # warm the page cache and any first-use compilation
            s = _best(once, repeat)
            out[f"{way}_{'verify' if verify else 'plain'}_seconds"] = s
            out[f"{way}_{'verify' if verify else 'plain'}_gbps"] = n * 4 / s / 1e9
        out[f"{way}_verify_overhead"] = out[f"{way}_verify_seconds"] / out[f"{way}_plain_seconds"] - 1
    spec = next(iter(gpulazy.from_files(path, dtype="<u4", device=device).chunk_index.specs.values()))
    k = 20000
    t0 = time.perf_counter()
    for _ in range(k):
        check_unchanged(spec)
    out["identity_check_us"] = (time.perf_counter() - t0) / k * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="256MiB")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", help="where the file is written (default: a temporary folder)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="gpulazy-bench-verify-", dir=args.dir)
    try:
        out = run(gpulazy.config.parse_bytes(args.size), args.device, args.repeat, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
