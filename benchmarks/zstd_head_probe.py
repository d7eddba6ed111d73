"""Reads of a zstd Zarr with ``ChunkSpec.head`` on and off, alternating in one process.

    python benchmarks/bench_formats.py --size 2GiB --only zarr-zstd-3d --ops plane --dir /tmp/bf
    python benchmarks/zstd_head_probe.py /tmp/bf/gpulazy-bench-formats/zarr-zstd-3d-*/vol.zarr

Cases, for ``n`` planes and ``half = n // 2`` (the bench's 256 x 2048 x 2048 volume in (64, 256,
256) chunks: ``half`` is where chunk row 2 begins): the whole array, the slice ``[1:half+1]``
(row 0 cut after its plane 0, row 2 after its first plane), ``[1:half]`` (without that plane),
``[half:half+1]`` (one plane) and ``[half:half+2, 5:-5]`` (a box). Prints each case's median and
fastest time over ``--rounds`` (the first dropped) and the bytes read. Heads off is
``gpulazy.spec.STREAMED`` emptied, so no chunk has a head.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    import gpulazy
    import gpulazy.spec as spec
    from gpulazy.device import get_device

    dev = get_device(args.device)
    vol = gpulazy.from_files(glob.glob(args.store)[0], device=args.device, cache=False)
    print(vol.shape, vol.chunksize, vol.numblocks, flush=True)
    half = vol.shape[0] // 2
    cases = {"whole": lambda: vol.compute(), "slice": lambda: vol[1:half + 1].compute(),
             "rows01cut": lambda: vol[1:half].compute(), "row2plane": lambda: vol[half:half + 1].compute(),
             "row2box": lambda: vol[half:half + 2, 5:-5].compute()}
    on = spec.STREAMED
    res: dict[tuple[str, bool], list[tuple[float, int]]] = {}
    for _ in range(args.rounds):
        for heads in (True, False):
            spec.STREAMED = on if heads else frozenset()
            for name, fn in cases.items():
                dev.synchronize()
                before = gpulazy.stats().snapshot()["bytes_read"]
                t0 = time.perf_counter()
                fn()
                dev.synchronize()
                res.setdefault((name, heads), []).append((time.perf_counter() - t0,
                                                          gpulazy.stats().snapshot()["bytes_read"] - before))
    spec.STREAMED = on
    print_rows(res)
    return 0


def print_rows(res: dict) -> None:
    for (name, heads), xs in sorted(res.items()):
        ms = [t * 1e3 for t, _ in xs[1:]] or [xs[0][0] * 1e3]
        print(f"{name:10s} heads={heads!s:5s} ms median {statistics.median(ms):7.2f} min {min(ms):7.2f}  "
              f"bytes {xs[-1][1] / 2**20:8.1f} MiB")


if __name__ == "__main__":
    raise SystemExit(main())
