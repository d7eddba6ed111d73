"""Reproduce (or show fixed) wrong napari planes on a GPU: planes of a zstd Zarr volume whose
planes span 4 x 4 chunks, read through ``napari_gpulazy``'s ``HostView`` from a device cache,
while CuPy's legacy default stream (where napari's thread works) is busy. Counts the planes
that differ from the file on first read and on re-read from the cache.

    python benchmarks/region_race.py                 # exit 1 when a plane is wrong
    CUDA_LAUNCH_BLOCKING=1 python benchmarks/region_race.py
    compute-sanitizer --tool racecheck python benchmarks/region_race.py --planes 8 --busy-ms 0
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--planes", type=int, default=32)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--chunks", default="8,128,128")
    ap.add_argument("--busy-ms", type=float, default=2.0,
                    help="length of each kernel that keeps the legacy stream busy during the reads (0: none)")
    ap.add_argument("--host-decode", action="store_true", help="decode on the host (config gpu_decode=False)")
    args = ap.parse_args(argv)

    import cupy as cp
    import zarr
    from zarr.codecs import ZstdCodec

    import gpulazy
    from napari_gpulazy._view import HostView

    gpulazy.config.set(gpu_decode=not args.host_decode)
    chunks = tuple(int(c) for c in args.chunks.split(","))
    data = np.random.default_rng(0).integers(0, 4000, (args.planes, args.size, args.size), dtype=np.uint16)
    path = os.path.join(tempfile.mkdtemp(), "race.zarr")
    z = zarr.create_array(path, shape=data.shape, chunks=chunks, dtype="uint16", compressors=ZstdCodec(level=1))
    z[...] = data
    spin = cp.RawKernel('extern "C" __global__ void spin(long long n)'
                        '{ long long t = clock64(); while (clock64() - t < n) {} }', "spin")
    cycles = np.int64(args.busy_ms * 1e-3 * cp.cuda.runtime.getDeviceProperties(0)["clockRate"] * 1000)
    stop = threading.Event()

    def keep_legacy_busy():  # one short kernel after another on the legacy stream, from another thread
        with cp.cuda.Device(0):
            queued = []
            for _ in range(100_000):
                if stop.is_set():
                    break
                spin((1,), (1,), (cycles,), stream=cp.cuda.Stream.null)
                event = cp.cuda.Event(disable_timing=True)
                event.record(cp.cuda.Stream.null)
                queued.append(event)
                if len(queued) == 2:  # two queued: the stream is never idle, yet never far ahead
                    queued.pop(0).synchronize()
            for event in queued:
                event.synchronize()

    busy = threading.Thread(target=keep_legacy_busy, daemon=True)
    if args.busy_ms:
        busy.start()
    cache = gpulazy.DeviceCache("1 GiB", device="cuda:0")
    vol = gpulazy.from_files(path, device="cuda:0", cache=cache)
    view = HostView(vol, label=path, target=vol)
    wrong = {"first": [], "again": []}
    for what in ("first", "again"):
        for k in range(args.planes):
            if not np.array_equal(np.asarray(view[k]), data[k]):
                wrong[what].append(k)
    stop.set()
    busy.join() if busy.is_alive() else None
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    cache.close()
    print(f"gpulazy {gpulazy.__file__} {args.size}x{args.size} planes in chunks {chunks}, "
          f"{'host' if args.host_decode else 'GPU'} decode, legacy stream busy {args.busy_ms} ms: planes wrong on first read {len(wrong['first'])}/{args.planes} "
          f"{wrong['first'][:8]}, on re-read {len(wrong['again'])}/{args.planes} {wrong['again'][:8]}")
    return 1 if wrong["first"] or wrong["again"] else 0


if __name__ == "__main__":
    sys.exit(main())
