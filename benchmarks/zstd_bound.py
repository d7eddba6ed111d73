"""The least time a read of a zstd Zarr can take on a GPU host, and so the most its half can reach.

    python benchmarks/bench_formats.py --size 2GiB --only zarr-zstd-3d --ops slice --dir /tmp/bf
    python benchmarks/zstd_bound.py /tmp/bf/gpulazy-bench-formats/zarr-zstd-3d-*/vol.zarr

nvCOMP decodes a zstd frame in one thread block: an 8 MiB frame takes it about as long alone as
among a hundred (``nvcomp_probe.py --codec zstd-latency``). A read of such chunks therefore ends no
sooner than its last stored byte lands plus one frame's decode. This prints both, measured here:
raw KvikIO (16 threads) reading the chunk files of the first two 64-plane slabs (the frames
``[1:129]`` and ``[0:128]`` decode whole) and of all of them into one device buffer, all reads in
flight, medians of 7; and one nvCOMP call of one frame, and of as many frames as the slabs hold.
Then the bound on the half's rate over the whole read's: ``T_whole / (2 * (T_land_half + T_frame))``,
with the whole read at its own bound and at a time given with ``--whole-ms`` (measured gpulazy).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import time

import numpy as np


def land_ms(files: list[str], rounds: int = 7) -> tuple[float, int]:
    """Median ms for raw KvikIO to read ``files`` whole into one device buffer, all in flight."""
    import cupy as cp
    import kvikio

    sizes = [os.path.getsize(f) for f in files]
    buf = cp.empty(sum(sizes), cp.uint8)
    handles = [kvikio.CuFile(f, "r") for f in files]
    try:
        def once() -> float:
            futures, at = [], 0
            t0 = time.perf_counter()
            for h, n in zip(handles, sizes):
                futures.append(h.pread(buf[at:at + n], n, 0))
                at += n
            for f in futures:
                f.get()
            cp.cuda.Device().synchronize()
            return time.perf_counter() - t0

        once()
        once()
        return statistics.median(once() for _ in range(rounds)) * 1e3, sum(sizes)
    finally:
        for h in handles:
            h.close()


def frame_ms(files: list[str], n: int) -> float:
    """ms of one nvCOMP call decoding the first ``n`` of ``files`` (zstd frames), the second of two."""
    import cupy as cp
    from nvidia import nvcomp

    blobs = [open(f, "rb").read() for f in files[:n]]
    sizes = [len(b) for b in blobs]
    padded = [b + b"\0" * (-len(b) % 8) for b in blobs]
    offsets = np.cumsum([0] + [len(b) for b in padded])
    src = cp.asarray(np.frombuffer(b"".join(padded), np.uint8))
    codec = nvcomp.Codec(algorithm="Zstd", device_id=0, bitstream_kind=nvcomp.BitstreamKind.RAW)
    stream = cp.cuda.get_current_stream()
    decoded = None

    def once() -> float:
        nonlocal decoded
        t0 = time.perf_counter()
        batch = nvcomp.as_arrays(src, offsets[:-1].tolist(), sizes, stream.ptr)
        decoded = codec.decode(batch)
        stream.synchronize()
        return time.perf_counter() - t0

    once()
    return once() * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--whole-ms", type=float, default=None, help="gpulazy's whole read, to bound the half against")
    args = ap.parse_args()
    import kvikio.defaults

    kvikio.defaults.set({"num_threads": 16})
    store = glob.glob(args.store)[0]
    slabs = sorted(os.listdir(os.path.join(store, "c")), key=int)

    def files_of(keys: list[str]) -> list[str]:
        return sorted(f for k in keys for f in glob.glob(os.path.join(store, "c", k, "**"), recursive=True)
                      if os.path.isfile(f))

    half, every = files_of(slabs[:len(slabs) // 2]), files_of(slabs)
    t_half, b_half = land_ms(half)
    t_all, b_all = land_ms(every)
    print(f"land, half ({len(half)} frames, {b_half / 2**20:.0f} MiB stored): {t_half:.1f} ms "
          f"({b_half / t_half / 1e6:.1f} GB/s)")
    print(f"land, all ({len(every)} frames, {b_all / 2**20:.0f} MiB stored): {t_all:.1f} ms "
          f"({b_all / t_all / 1e6:.1f} GB/s)")
    one, many = frame_ms(every, 1), frame_ms(every, len(half))
    print(f"nvCOMP: one frame {one:.1f} ms, {len(half)} frames in one call {many:.1f} ms")
    t_frame = one
    low_half, low_all = t_half + t_frame, t_all + t_frame
    print(f"least times: half {low_half:.1f} ms, whole {low_all:.1f} ms; both at their bound, the half reaches "
          f"{low_all / (2 * low_half):.2f} x the whole read's rate")
    if args.whole_ms:
        print(f"against a whole read of {args.whole_ms:.1f} ms: at most {args.whole_ms / (2 * low_half):.2f} x")


if __name__ == "__main__":
    main()
