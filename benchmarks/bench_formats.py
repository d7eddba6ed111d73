"""Formats straight to the device (issue 8): each format beside its reference reader, one run.

    python benchmarks/bench_formats.py [--size 4GiB] [--device cuda:0] [--only tiff,zarr,...] [--json PATH]

For each format the same realistic volume (a smooth uint16 field plus noise) is written,
then read whole onto the device, warm page cache, best of ``--repeat``:

| row | gpulazy | reference way(s), same data |
| --- | --- | --- |
| raw | ``from_files(raw).compute()`` — the rate the others are held to | KvikIO ``CuFile.pread`` |
| tiff | a stack of single-page TIFFs | ``tifffile.imread`` → ``cp.asarray``; ``dask_image.imread`` → ``cp.asarray`` when installed |
| zarr | Zarr v3, uncompressed | zarr-python ``enable_gpu()`` + ``da.from_zarr``; TensorStore → ``cp.asarray`` |
| zarr-zstd | Zarr v3, zstd level 1 | same three |
| zarr-zstd-sharded | Zarr v3, zstd level 1, sharded | same three |
| hdf5 | HDF5 chunked, uncompressed | ``h5py`` → ``cp.asarray`` |
| hdf5-gzip | HDF5 chunked, gzip level 1 | ``h5py`` → ``cp.asarray`` |
| zarr2-blosc | Zarr v2, blosc lz4 level 5 + byte shuffle (Zarr v2's default) | zarr-python, ``enable_gpu`` + ``da.from_zarr``, TensorStore |
| hdf5-bitshuffle | HDF5 chunked, bitshuffle + LZ4 (filter 32008, Dectris detectors) | ``h5py`` + hdf5plugin → ``cp.asarray`` |

Slow reference ways (below ~1 GB/s) read only the first ``--ref-limit`` bytes and are
reported as a rate. Prints GB/s of decoded output, gpulazy's ratio to each reference and
to the raw rate, and the compression ratio. On ``--device cpu`` the references are the
host ones.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

SIDE = 2048
PLANE = SIDE * SIDE * 2


_DISTINCT = 16  # distinct planes, cycled: generating 2048 x 2048 noise per plane costs more than writing it


@functools.cache
def _planes(seed: int = 0) -> tuple[np.ndarray, ...]:
    y, x = np.ogrid[:SIDE, :SIDE]
    base = (np.sin(x / 97.0) + np.cos(y / 131.0)) * 8000 + 20000
    rng = np.random.default_rng(seed)
    return tuple((base + 3000 * np.sin(z / 5.0)).astype(np.uint16) + rng.integers(0, 8, (SIDE, SIDE), dtype=np.uint16)
                 for z in range(_DISTINCT))


def volume_planes(nplanes: int, seed: int = 0):
    """Planes of a smooth field plus noise (compresses like real microscopy data, noise and all)."""
    planes = _planes(seed)
    for z in range(nplanes):
        yield planes[z % _DISTINCT]


# -- writers ------------------------------------------------------------------------------------

def write_raw(folder: str, n: int) -> str:
    path = os.path.join(folder, "vol.raw")
    with open(path, "wb") as f:
        for p in volume_planes(n):
            f.write(p.tobytes())
    return path


def write_tiff(folder: str, n: int) -> str:
    import tifffile

    d = os.path.join(folder, "tiff")
    os.makedirs(d)
    for i, p in enumerate(volume_planes(n)):
        tifffile.imwrite(os.path.join(d, f"z{i:05d}.tif"), p)
    return d


def write_zarr(folder: str, n: int, name: str, *, zstd: bool, shards: bool) -> str:
    import zarr

    path = os.path.join(folder, f"{name}.zarr")
    kw: dict[str, Any] = {"compressors": [zarr.codecs.ZstdCodec(level=1)] if zstd else None}
    chunks = (8, 512, 512)
    if shards:
        kw["shards"] = (32, SIDE, SIDE)
    z = zarr.create_array(path, shape=(n, SIDE, SIDE), chunks=chunks, dtype="uint16", zarr_format=3, **kw)
    batch = []
    start = 0
    for p in volume_planes(n):
        batch.append(p)
        if len(batch) == 32:
            z[start:start + 32] = np.stack(batch)
            start += 32
            batch = []
    if batch:
        z[start:start + len(batch)] = np.stack(batch)
    return path


def write_zarr2_blosc(folder: str, n: int) -> str:
    """Zarr v2 with its default compressor: blosc, lz4 level 5, byte shuffle; chunks of (8, 512, 512)."""
    import numcodecs
    import zarr

    path = os.path.join(folder, "blosc.zarr")
    z = zarr.create_array(path, shape=(n, SIDE, SIDE), chunks=(8, 512, 512), dtype="uint16", zarr_format=2,
                          compressors=numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE))
    planes = volume_planes(n)
    for z0 in range(0, n, 32):
        z[z0:z0 + 32] = np.stack([next(planes) for _ in range(min(32, n - z0))])
    return path


def write_hdf5_bitshuffle(folder: str, n: int) -> str:
    """HDF5 chunks of (8, 512, 512) through hdf5plugin's bitshuffle + LZ4 filter (as Dectris writes)."""
    import h5py
    import hdf5plugin

    path = os.path.join(folder, "bitshuffle.h5")
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("data", shape=(n, SIDE, SIDE), dtype="uint16", chunks=(8, 512, 512),
                              **hdf5plugin.Bitshuffle(nelems=0, cname="lz4"))
        planes = volume_planes(n)
        for z0 in range(0, n, 8):
            ds[z0:z0 + 8] = np.stack([next(planes) for _ in range(min(8, n - z0))])
    return path


def write_hdf5(folder: str, n: int, name: str, *, gzip: bool) -> str:
    """Chunks of (8, 512, 512); gzip chunks compressed in a thread pool and written with
    ``write_direct_chunk`` (h5py's own gzip is single-threaded: 335 s per GiB)."""
    import zlib

    import h5py

    path = os.path.join(folder, f"{name}.h5")
    chunks = (8, 512, 512)
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("data", shape=(n, SIDE, SIDE), dtype="uint16", chunks=chunks,
                              compression="gzip" if gzip else None, compression_opts=1 if gzip else None)
        planes = volume_planes(n)
        with ThreadPoolExecutor(16) as pool:
            for z0 in range(0, n, 8):
                slab = np.stack([next(planes) for _ in range(min(8, n - z0))])
                if not gzip:
                    ds[z0:z0 + len(slab)] = slab
                    continue
                if len(slab) < 8:
                    slab = np.concatenate([slab, np.zeros((8 - len(slab), SIDE, SIDE), np.uint16)])
                blocks = [(y, x, np.ascontiguousarray(slab[:, y:y + 512, x:x + 512]))
                          for y in range(0, SIDE, 512) for x in range(0, SIDE, 512)]
                for (y, x, _), data in zip(blocks, pool.map(lambda b: zlib.compress(b[2].tobytes(), 1), blocks)):
                    ds.id.write_direct_chunk((z0, y, x), data)
    return path


# -- readers --------------------------------------------------------------------------------------

def _sync(x: Any) -> Any:
    if hasattr(x, "device") and type(x).__module__.startswith("cupy"):
        import cupy

        cupy.cuda.get_current_stream().synchronize()
    return x


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        out = None
        t0 = time.perf_counter()
        out = _sync(fn())
        best = min(best, time.perf_counter() - t0)
    return best, out


def to_device(a: np.ndarray, device: str) -> Any:
    if device == "cpu":
        return a
    import cupy

    return cupy.asarray(a)


def _refs(fmt: str, path: str, device: str, n: int, limit: int) -> dict[str, tuple[Callable[[], Any], int]]:
    """Reference ways for ``fmt``: name -> (read, planes it reads). Slow ways read ``limit`` planes."""
    small = min(n, limit)
    refs: dict[str, tuple[Callable[[], Any], int]] = {}
    if fmt == "raw" and device != "cpu":
        refs["KvikIO CuFile.pread"] = (lambda: _kvikio_read(path), n)
    if fmt == "tiff":
        import tifffile

        full = [os.path.join(path, f) for f in sorted(os.listdir(path))]
        refs["tifffile.imread -> cp.asarray"] = (lambda: to_device(tifffile.imread(full[:small]), device), small)
        try:
            import dask_image.imread as dimread

            refs["dask_image.imread -> cp.asarray"] = (lambda: to_device(
                dimread.imread(os.path.join(path, "*.tif"))[:small].compute(), device), small)
        except ImportError:
            pass
    if fmt.startswith("zarr"):
        import dask.array as da
        import zarr

        refs["zarr-python [:] -> cp.asarray"] = (
            lambda: to_device(zarr.open_array(path, mode="r")[:small], device), small)
        if device != "cpu":
            def gpu_zarr() -> Any:
                with zarr.config.enable_gpu():
                    return da.from_zarr(path)[:n].compute()

            refs["zarr enable_gpu + da.from_zarr"] = (gpu_zarr, n)
        try:
            import tensorstore as ts

            driver = "zarr" if fmt == "zarr2-blosc" else "zarr3"

            def tstore() -> Any:
                t = ts.open({"driver": driver, "kvstore": {"driver": "file", "path": path}}).result()
                return to_device(t[:n].read().result(), device)

            refs["TensorStore -> cp.asarray"] = (tstore, n)
        except ImportError:
            pass
    if fmt.startswith("hdf5"):
        import h5py

        if fmt == "hdf5-bitshuffle":
            import hdf5plugin  # noqa: F401  (registers the filter with HDF5)

        def h5() -> Any:
            with h5py.File(path, "r") as f:
                return to_device(f["data"][:small], device)

        refs["h5py -> cp.asarray"] = (h5, small)
    return refs


def _kvikio_read(path: str) -> Any:
    import cupy
    import kvikio

    n = os.path.getsize(path)
    buf = cupy.empty(n, dtype=cupy.uint8)
    with kvikio.CuFile(path, "r") as f:
        f.pread(buf, n, task_size=4 << 20).get()
    return buf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--device", default=None)
    ap.add_argument("--only", default="raw,tiff,zarr,zarr-zstd,zarr-zstd-sharded,hdf5,hdf5-gzip,zarr2-blosc,"
                                      "hdf5-bitshuffle")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ref-limit", default="1GiB", help="bytes the slow reference ways read")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import gpulazy

    dev = gpulazy.get_device(args.device)
    nplanes = max(8, gpulazy.config.parse_bytes(args.size) // PLANE // 8 * 8)
    limit = max(8, gpulazy.config.parse_bytes(args.ref_limit) // PLANE)
    folder = tempfile.mkdtemp(prefix="gpulazy-bench-formats-", dir=args.dir)
    writers = {
        "raw": lambda: write_raw(folder, nplanes),
        "tiff": lambda: write_tiff(folder, nplanes),
        "zarr": lambda: write_zarr(folder, nplanes, "plain", zstd=False, shards=False),
        "zarr-zstd": lambda: write_zarr(folder, nplanes, "zstd", zstd=True, shards=False),
        "zarr-zstd-sharded": lambda: write_zarr(folder, nplanes, "sharded", zstd=True, shards=True),
        "hdf5": lambda: write_hdf5(folder, nplanes, "plain", gzip=False),
        "hdf5-gzip": lambda: write_hdf5(folder, nplanes, "gzip", gzip=True),
        "zarr2-blosc": lambda: write_zarr2_blosc(folder, nplanes),
        "hdf5-bitshuffle": lambda: write_hdf5_bitshuffle(folder, nplanes),
    }
    nbytes = nplanes * PLANE
    rows: list[dict[str, Any]] = []
    raw_rate = None
    print(f"device {dev.name}, {nplanes} planes of {SIDE}x{SIDE} uint16 = {nbytes / 2**30:.2f} GiB per format")
    try:
        for fmt in args.only.split(","):
            t0 = time.perf_counter()
            path = writers[fmt]()
            stored = _stored_bytes(path)
            row: dict[str, Any] = {"format": fmt, "bytes": nbytes, "stored_bytes": stored,
                                   "compression_ratio": nbytes / stored, "write_seconds": time.perf_counter() - t0}
            vol = gpulazy.from_files(path, device=dev.name, cache=False) if fmt != "raw" else \
                gpulazy.from_files(path, shape=(nplanes, SIDE, SIDE), dtype="uint16", device=dev.name, cache=False)
            row["layout"] = vol.chunk_index.layout if vol.chunk_index is not None else "?"
            vol[:8].compute()  # start-up: backend, kernels, decoders
            seconds, out = timed(vol.compute, args.repeat)
            row["gpulazy_gbps"] = nbytes / seconds / 1e9
            row["correct"] = _check(out, nplanes)
            del out
            if fmt == "raw":
                raw_rate = row["gpulazy_gbps"]
            row["vs_raw"] = row["gpulazy_gbps"] / raw_rate if raw_rate else None
            row["refs"] = {}
            for name, (fn, planes) in _refs(fmt, path, dev.name, nplanes, limit).items():
                try:
                    s, _ = timed(fn, args.repeat)
                    rate = planes * PLANE / s / 1e9
                    row["refs"][name] = {"gbps": rate, "ratio": row["gpulazy_gbps"] / rate, "planes": planes}
                except Exception as e:  # a reference way that fails here is reported, not fatal
                    row["refs"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            _print_row(row)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": dev.name, "rows": rows}, f, indent=2)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _check(out: Any, nplanes: int) -> bool:
    """The first and last planes equal the generated ones."""
    import gpulazy

    want = list(volume_planes(nplanes)) if nplanes <= 64 else None
    first = gpulazy.to_numpy(out[0])
    if want is None:
        gen = volume_planes(nplanes)
        return bool((first == next(gen)).all())
    return bool((first == want[0]).all() and (gpulazy.to_numpy(out[-1]) == want[-1]).all())


def _stored_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _print_row(row: dict[str, Any]) -> None:
    vs = f", {row['vs_raw']:.2f}x raw" if row.get("vs_raw") else ""
    vs += "" if row.get("correct") else "  VALUES DIFFER"
    print(f"{row['format']:18s} gpulazy {row['gpulazy_gbps']:6.2f} GB/s{vs} (compression {row['compression_ratio']:.2f}x, "
          f"layout {row['layout']})")
    for name, r in row["refs"].items():
        if "error" in r:
            print(f"    {name:36s} failed: {r['error']}")
        else:
            print(f"    {name:36s} {r['gbps']:6.2f} GB/s -> gpulazy {r['ratio']:5.1f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
