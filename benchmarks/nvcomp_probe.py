"""nvCOMP alone on 1 GiB of bench_formats-like uint16 data, by piece count and size, in one call per
case: how its Deflate and zstd rates grow with the number of streams (GPU host only).

    python benchmarks/nvcomp_probe.py            # Deflate (zlib-1) and zstd-1 rows
    python benchmarks/nvcomp_probe.py --codec zstd
    python benchmarks/nvcomp_probe.py --codec zstd-latency   # one call's time by count of 8 MiB frames
    python benchmarks/nvcomp_probe.py --codec zstd-latency --capi   # and gpulazy's own call beside it

``zstd-latency`` decodes 1 to 256 zstd-1 frames of 8 MiB (bench_formats' Zarr chunks) in one call
each: a call takes about as long for one frame as for a hundred when nvCOMP gives a frame one
thread block, so that time is the least any read of such a chunk waits for its decode.
"""

from __future__ import annotations

import argparse
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

CASES = {"deflate": [(64 << 10, 8192), (128 << 10, 8192), (256 << 10, 4096), (512 << 10, 2048), (1 << 20, 1024),
                     (4 << 20, 256)],
         "zstd-latency": [(8 << 20, n) for n in (1, 4, 16, 64, 128, 256)],
         "zstd": [(16 << 20, 16), (16 << 20, 64), (8 << 20, 128), (2 << 20, 16), (2 << 20, 128), (2 << 20, 512),
                  (512 << 10, 2048), (128 << 10, 8192)]}


def _data() -> bytes:
    y, x = np.ogrid[:1024, :1024]
    base = (np.sin(x / 97.0) + np.cos(y / 131.0)) * 8000 + 20000
    rng = np.random.default_rng(0)
    return b"".join(((base + 3000 * np.sin(z / 5)).astype(np.uint16)
                     + rng.integers(0, 8, (1024, 1024), dtype=np.uint16)).tobytes() for z in range(512))


def probe(codec_name: str, data: bytes, capi_too: bool = False) -> None:
    import cupy as cp
    import numcodecs
    from nvidia import nvcomp

    algo = {"deflate": "Deflate", "zstd": "Zstd", "zstd-latency": "Zstd"}[codec_name]
    codec = nvcomp.Codec(algorithm=algo, device_id=0, bitstream_kind=nvcomp.BitstreamKind.RAW)
    zstd = numcodecs.Zstd(level=1)
    encode = (lambda b: zlib.compress(b, 1)[2:-4]) if codec_name == "deflate" else zstd.encode
    decode = (lambda c, n: zlib.decompress(c, -15, n)) if codec_name == "deflate" else (lambda c, n: zstd.decode(c))
    for size, n in CASES[codec_name]:
        have = len(data) // size  # more frames than the data holds repeat it
        with ThreadPoolExecutor(16) as pool:
            comp = list(pool.map(lambda i: encode(data[i % have * size:(i % have + 1) * size]), range(n)))
        padded = [c + b"\0" * (-len(c) % 8) for c in comp]  # nvCOMP wants aligned inputs
        offs = np.cumsum([0] + [len(c) for c in padded])
        buf = cp.asarray(np.frombuffer(b"".join(padded), np.uint8))
        out = cp.empty(n * size, np.uint8)
        stream = cp.cuda.get_current_stream()

        def run() -> None:
            batch = nvcomp.as_arrays(buf, offs[:-1].tolist(), [len(c) for c in comp], stream.ptr)
            dst = nvcomp.as_arrays(out, [i * size for i in range(n)], [size] * n, stream.ptr)
            codec.decode(batch, out=dst)
            stream.synchronize()

        def capi() -> None:  # gpulazy's own call (ctypes, nvCOMP's C API), as the read engine makes it
            from gpulazy.codecs import _nvcomp_c

            _nvcomp_c.decompress(algo, (buf.data.ptr + offs[:-1]).tolist(), [len(c) for c in comp],
                                 [out.data.ptr + i * size for i in range(n)], [size] * n, stream)

        if capi_too:
            capi()
            t = time.perf_counter()
            capi()
            dc = time.perf_counter() - t
            print(f"{codec_name} {n} x {size >> 10} KiB: gpulazy's C API call {n * size / dc / 1e9:.2f} GB/s "
                  f"({dc * 1e3:.1f} ms)", flush=True)
        run()
        t = time.perf_counter()
        run()
        dt = time.perf_counter() - t
        ok = bytes(out[:size].get()) == data[:size]
        with ThreadPoolExecutor(16) as pool:
            t = time.perf_counter()
            list(pool.map(lambda c: decode(c, size), comp))
            host = time.perf_counter() - t
        print(f"{codec_name} {n} x {size >> 10} KiB: nvCOMP {n * size / dt / 1e9:.2f} GB/s ({dt * 1e3:.1f} ms), "
              f"host 16 threads {n * size / host / 1e9:.2f} GB/s, bytes equal {ok}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codec", choices=["deflate", "zstd", "zstd-latency", "both"], default="both")
    ap.add_argument("--capi", action="store_true", help="also time gpulazy's C API call (codecs._nvcomp_c)")
    args = ap.parse_args()
    data = _data()
    for name in (["deflate", "zstd"] if args.codec == "both" else [args.codec]):
        probe(name, data, args.capi)


if __name__ == "__main__":
    main()
