"""Formats straight to the device (issues 8, 20, 21): each format beside its reference readers, one run.

    python benchmarks/bench_formats.py [--size 4GiB] [--device cuda:0] [--only tiff,zarr-3d,...]
        [--derived | --ops mip,slice,astype_sum,mean] [--budget-s 400] [--dir /nvme] [--json PATH]

For each format the same realistic volume (a smooth uint16 field plus noise, planes of
``--side`` x ``--side``) is written, then read whole onto the device, warm page cache, best
of ``--repeat``:

| row | gpulazy | reference way(s), same data |
| --- | --- | --- |
| raw | ``from_files(raw).compute()`` — the rate the others are held to | KvikIO ``CuFile.pread`` (CPU: ``np.fromfile``) |
| tiff | a folder of single-page TIFFs | ``tifffile.imread`` → ``cp.asarray``; ``dask_image.imread`` → ``cp.asarray`` |
| zarr | Zarr v3, uncompressed, chunks (8, 512, 512) | zarr-python ``[:]``; ``enable_gpu()`` + ``da.from_zarr``; TensorStore |
| zarr-zstd | Zarr v3, zstd level 1, chunks (8, 512, 512) | same three |
| zarr-zstd-sharded | Zarr v3, zstd level 1, chunks (8, 512, 512) in shards (32, side, side) | same three |
| zarr-3d | Zarr v3, uncompressed, 3D chunks (64, 256, 256) | same three |
| zarr-zstd-3d | Zarr v3, zstd level 1, 3D chunks (64, 256, 256) | same three |
| hdf5 | HDF5 chunked, uncompressed | ``h5py`` → ``cp.asarray`` |
| hdf5-gzip | HDF5 chunked, gzip level 1 | ``h5py`` → ``cp.asarray`` |
| zarr2-blosc | Zarr v2, blosc lz4 level 5 + byte shuffle (Zarr v2's default) | zarr-python, ``enable_gpu``, TensorStore |
| hdf5-bitshuffle | HDF5 chunked, bitshuffle + LZ4 (filter 32008, Dectris detectors) | ``h5py`` + hdf5plugin → ``cp.asarray`` |
| hdf5-blosc | HDF5 chunked, Blosc LZ4 level 5 + byte shuffle (filter 32001) | ``h5py`` + hdf5plugin → ``cp.asarray`` |

Derived rows (``--ops``, or ``--derived`` for all of them): ``max(axis=0)`` (MIP), the slice
``[1:half+1]`` off chunk boundaries, ``astype("f8").sum()``, ``mean()``, ``map_blocks(b * 2)``
(each chunk mapped as its read lands) and its MIP (the map folded into the streamed reduction), each as GB/s of
source bytes, as a ratio to the same format's whole ``compute()`` in the same run (issue 20:
≥ 0.9 for raw, tiff, zarr-3d and zarr-zstd-3d) and beside "raw KvikIO + the same op" (the
raw file read whole with KvikIO into one buffer, then the same CuPy operation); and one plane
``[half:half+1]`` where a chunk begins (a viewer's plane: its milliseconds are the figure, a
compressed chunk decoding its first planes alone). Beside their gpulazy ways, the same work through
dask's tasks in the same run: ``plane_int`` (``vol[half]``, a box read) against ``plane_dask``
(``da.Array.__getitem__``), and ``np_mip`` (``np.max(vol, axis=0)``, the streamed MIP) against
``mip_dask`` (``da.max``, dask's reduction), ``tile`` (``vol[half, :s/2, :s/2]``, a viewer's tile) against
``tile_dask``, ``flip`` (``vol[::-1]``) against ``flip_dask``, ``plane_max`` (``vol[half].max()``, streamed) against ``plane_max_dask``, ``slice_mip`` (``[1:half+1].max(axis=0)``, streamed
over the chunks the box meets) against ``slice_mip_dask``, and ``preview`` (``[::4, ::4, ::4]``) against
``preview_dask``. Every result is checked against the
generated volume.

Slow reference ways read only the first ``--ref-limit`` bytes and are reported as a rate; a
reference not installed is skipped with the reason printed. With ``--dir`` the files are kept
under ``DIR/gpulazy-bench-formats/`` and reused by later runs of the same size (``--fresh``
rewrites them); without it they live in a temporary folder, removed as each format is done.
``--budget-s`` skips the rows left (printing which) once that many seconds have passed.
On ``--device cpu`` the references are the host ones.
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
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

SIDE = 2048
_DISTINCT = 16  # distinct planes, cycled: generating 2048 x 2048 noise per plane costs more than writing it
WRITER_VERSION = 2  # bump when a writer or the generated data changes: kept files of older versions are not reused
_THREADS = min(8, os.cpu_count() or 4)
TARGET_VS_WHOLE = 0.9
TARGET_FORMATS = ("raw", "tiff", "zarr-3d", "zarr-zstd-3d")


@dataclass(frozen=True)
class Geometry:
    """The volume every format holds: ``n`` planes of ``side`` x ``side`` uint16."""

    n: int
    side: int = SIDE

    @property
    def plane(self) -> int:
        return self.side * self.side * 2

    @property
    def nbytes(self) -> int:
        return self.n * self.plane

    @property
    def half(self) -> int:
        return self.n // 2

    def clip(self, chunks: tuple[int, int, int]) -> tuple[int, int, int]:
        return min(chunks[0], self.n), min(chunks[1], self.side), min(chunks[2], self.side)


@functools.cache
def _planes(side: int = SIDE, seed: int = 0) -> tuple[np.ndarray, ...]:
    y, x = np.ogrid[:side, :side]
    base = (np.sin(x / 97.0) + np.cos(y / 131.0)) * 8000 + 20000
    rng = np.random.default_rng(seed)
    return tuple((base + 3000 * np.sin(z / 5.0)).astype(np.uint16) + rng.integers(0, 8, (side, side), dtype=np.uint16)
                 for z in range(_DISTINCT))


def plane(z: int, side: int = SIDE) -> np.ndarray:
    """Plane ``z`` of the volume: a smooth field plus noise (compresses like microscopy data, noise and all)."""
    return _planes(side)[z % _DISTINCT]


def _slab(g: Geometry, z0: int, z1: int) -> np.ndarray:
    return np.stack([plane(z, g.side) for z in range(z0, z1)])


def _in_slabs(g: Geometry, step: int, put: Callable[[int, np.ndarray], None]) -> None:
    """``put(z0, planes z0..z0+step)`` for every slab, ``_THREADS`` at a time: slabs aligned to the
    chunks (or shards) touch distinct stored chunks, so the writes never overlap."""
    with ThreadPoolExecutor(_THREADS) as pool:
        list(pool.map(lambda z0: put(z0, _slab(g, z0, min(z0 + step, g.n))), range(0, g.n, step)))


# -- writers: (folder, geometry) -> the path from_files opens --------------------------------------

def write_raw(folder: str, g: Geometry) -> str:
    path = os.path.join(folder, "vol.raw")
    with open(path, "wb") as f:
        f.truncate(g.nbytes)
    fd = os.open(path, os.O_WRONLY)
    try:
        def put(z: int) -> None:
            view, offset = memoryview(plane(z, g.side)).cast("B"), z * g.plane
            while view:  # pwrite may write less than asked
                done = os.pwrite(fd, view, offset)
                view, offset = view[done:], offset + done
        with ThreadPoolExecutor(_THREADS) as pool:
            list(pool.map(put, range(g.n)))
    finally:
        os.close(fd)
    return path


def write_tiff(folder: str, g: Geometry) -> str:
    import tifffile

    d = os.path.join(folder, "tiff")
    os.makedirs(d)
    with ThreadPoolExecutor(_THREADS) as pool:
        list(pool.map(lambda z: tifffile.imwrite(os.path.join(d, f"z{z:05d}.tif"), plane(z, g.side)), range(g.n)))
    return d


def write_zarr(folder: str, g: Geometry, *, zstd: bool, chunks: tuple[int, int, int],
               shards: tuple[int, int, int] | None = None) -> str:
    import zarr

    path = os.path.join(folder, "vol.zarr")
    kw: dict[str, Any] = {"compressors": [zarr.codecs.ZstdCodec(level=1)] if zstd else None}
    if shards:
        kw["shards"] = g.clip(shards)
    z = zarr.create_array(path, shape=(g.n, g.side, g.side), chunks=g.clip(chunks), dtype="uint16", zarr_format=3,
                          **kw)
    _in_slabs(g, (shards or chunks)[0], lambda z0, slab: z.__setitem__(slice(z0, z0 + len(slab)), slab))
    return path


def write_zarr2_blosc(folder: str, g: Geometry) -> str:
    """Zarr v2 with its default compressor: blosc, lz4 level 5, byte shuffle; chunks of (8, 512, 512)."""
    import numcodecs
    import zarr

    path = os.path.join(folder, "blosc.zarr")
    z = zarr.create_array(path, shape=(g.n, g.side, g.side), chunks=g.clip((8, 512, 512)), dtype="uint16",
                          zarr_format=2,
                          compressors=numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE))
    _in_slabs(g, 8, lambda z0, slab: z.__setitem__(slice(z0, z0 + len(slab)), slab))
    return path


def write_zarr_lz4(folder: str, g: Geometry) -> str:
    """Zarr v3 with numcodecs' LZ4 (level 1) and 2D chunks of (1, 1024, 1024)."""
    import zarr
    from zarr.codecs.numcodecs import LZ4

    path = os.path.join(folder, "lz4.zarr")
    z = zarr.create_array(path, shape=(g.n, g.side, g.side), chunks=g.clip((1, 1024, 1024)), dtype="uint16",
                          zarr_format=3, compressors=[LZ4(acceleration=1)])
    _in_slabs(g, 8, lambda z0, slab: z.__setitem__(slice(z0, z0 + len(slab)), slab))
    return path


def write_tiff_deflate(folder: str, g: Geometry) -> str:
    """One multi-page TIFF, each page in 512 x 512 tiles compressed with deflate (zlib level 1)."""
    import tifffile

    path = os.path.join(folder, "deflate.tif")
    t = 512 if g.side % 512 == 0 else 16  # TIFF tiles are multiples of 16
    tiles = (plane(z, g.side)[y:y + t, x:x + t] for z in range(g.n)
             for y in range(0, g.side, t) for x in range(0, g.side, t))  # one at a time: never the whole volume
    with tifffile.TiffWriter(path, bigtiff=True) as w:
        w.write(tiles, shape=(g.n, g.side, g.side), dtype="uint16", tile=(t, t), compression="zlib", compressionargs={"level": 1},
                maxworkers=_THREADS)
    return path


def write_hdf5_bitshuffle(folder: str, g: Geometry) -> str:
    """HDF5 chunks of (8, 512, 512) through hdf5plugin's bitshuffle + LZ4 filter (as Dectris writes)."""
    import h5py
    import hdf5plugin

    path = os.path.join(folder, "bitshuffle.h5")
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("data", shape=(g.n, g.side, g.side), dtype="uint16", chunks=g.clip((8, 512, 512)),
                              **hdf5plugin.Bitshuffle(nelems=0, cname="lz4"))
        for z0 in range(0, g.n, 8):  # h5py serialises every call: no thread pool
            ds[z0:z0 + 8] = _slab(g, z0, min(z0 + 8, g.n))
    return path


def write_hdf5_blosc(folder: str, g: Geometry) -> str:
    """HDF5 chunks of (8, 512, 512) through the Blosc filter (32001): LZ4 level 5 with byte shuffle.

    Chunks are compressed by numcodecs' Blosc (the bytes HDF5's blosc filter writes) in a thread
    pool and written with ``write_direct_chunk``: no HDF5 plugin is needed to write the file (the
    GPU host's hdf5plugin build lacks the filter), only to read it with h5py.
    """
    import h5py
    from numcodecs import Blosc

    codec = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE)
    path = os.path.join(folder, "blosc.h5")
    cz, cy, cx = chunks = g.clip((8, 512, 512))
    # cd_values as hdf5-blosc sets them: filter and blosc format versions, type size, chunk bytes,
    # level, shuffle, compressor (1: lz4).
    cd = (2, 2, 2, cz * cy * cx * 2, 5, 1, 1)
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("data", shape=(g.n, g.side, g.side), dtype="uint16", chunks=chunks,
                              compression=32001, compression_opts=cd, allow_unknown_filter=True)
        _write_direct_chunks(ds, g, chunks, codec.encode)
    return path


def write_hdf5(folder: str, g: Geometry, *, gzip: bool) -> str:
    """Chunks of (8, 512, 512); gzip chunks compressed in a thread pool and written with
    ``write_direct_chunk`` (h5py's own gzip is single-threaded: 335 s per GiB)."""
    import zlib

    import h5py

    path = os.path.join(folder, "vol.h5")
    chunks = g.clip((8, 512, 512))
    cz = chunks[0]
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("data", shape=(g.n, g.side, g.side), dtype="uint16", chunks=chunks,
                              compression="gzip" if gzip else None, compression_opts=1 if gzip else None)
        if gzip:
            _write_direct_chunks(ds, g, chunks, lambda block: zlib.compress(block.tobytes(), 1))
        else:
            for z0 in range(0, g.n, cz):
                ds[z0:min(z0 + cz, g.n)] = _slab(g, z0, min(z0 + cz, g.n))
    return path


def _write_direct_chunks(ds: Any, g: Geometry, chunks: tuple[int, int, int], encode: Callable[[np.ndarray], bytes]
                         ) -> None:
    """Every chunk of ``ds`` as ``encode(chunk)`` bytes, encoded in a thread pool, written with
    ``write_direct_chunk`` (HDF5 stores edge chunks whole: the last slab is padded with zeros)."""
    cz, cy, cx = chunks
    with ThreadPoolExecutor(_THREADS) as pool:
        for z0 in range(0, g.n, cz):
            slab = _slab(g, z0, min(z0 + cz, g.n))
            if len(slab) < cz:
                slab = np.concatenate([slab, np.zeros((cz - len(slab), g.side, g.side), np.uint16)])
            blocks = [(y, x, np.ascontiguousarray(slab[:, y:y + cy, x:x + cx]))
                      for y in range(0, g.side, cy) for x in range(0, g.side, cx)]
            for (y, x, _), data in zip(blocks, pool.map(lambda b: encode(b[2]), blocks)):
                ds.id.write_direct_chunk((z0, y, x), data)


WRITERS: dict[str, Callable[[str, Geometry], str]] = {
    "raw": write_raw,
    "tiff": write_tiff,
    "zarr": lambda d, g: write_zarr(d, g, zstd=False, chunks=(8, 512, 512)),
    "zarr-zstd": lambda d, g: write_zarr(d, g, zstd=True, chunks=(8, 512, 512)),
    "zarr-zstd-sharded": lambda d, g: write_zarr(d, g, zstd=True, chunks=(8, 512, 512), shards=(32, g.side, g.side)),
    "zarr-3d": lambda d, g: write_zarr(d, g, zstd=False, chunks=(64, 256, 256)),
    "zarr-zstd-3d": lambda d, g: write_zarr(d, g, zstd=True, chunks=(64, 256, 256)),
    "hdf5": lambda d, g: write_hdf5(d, g, gzip=False),
    "hdf5-gzip": lambda d, g: write_hdf5(d, g, gzip=True),
    "zarr2-blosc": write_zarr2_blosc,
    "hdf5-bitshuffle": write_hdf5_bitshuffle,
    "hdf5-blosc": write_hdf5_blosc,
    "zarr-lz4": write_zarr_lz4,
    "tiff-deflate": write_tiff_deflate,
}
DEFAULT_ONLY = ("raw,tiff,zarr,zarr-zstd,zarr-zstd-sharded,zarr-3d,zarr-zstd-3d,hdf5,hdf5-gzip,zarr2-blosc,"
                "hdf5-bitshuffle,hdf5-blosc,zarr-lz4,tiff-deflate")


class Store:
    """Where the formats' files live. With a folder they are kept and reused by the next run of the
    same geometry (a marker written after the writer finishes says the files are whole)."""

    def __init__(self, directory: str | None, *, fresh: bool = False):
        self.keep, self.fresh = directory is not None, fresh
        self.written: set[str] = set()  # formats written by this run: reused within it even when not kept
        if self.keep:
            self.root = os.path.join(directory, "gpulazy-bench-formats")
            os.makedirs(self.root, exist_ok=True)
        else:
            self.root = tempfile.mkdtemp(prefix="gpulazy-bench-formats-")

    def _folder(self, fmt: str, g: Geometry) -> str:
        return os.path.join(self.root, f"{fmt}-{g.n}x{g.side}x{g.side}-v{WRITER_VERSION}")

    def prepare(self, fmt: str, g: Geometry) -> tuple[str, float, bool]:
        """(path, seconds the writing took, whether an earlier run's files were reused)."""
        folder = self._folder(fmt, g)
        marker = folder + ".json"
        if os.path.exists(marker) and (folder in self.written or (self.keep and not self.fresh)):
            with open(marker) as f:
                m = json.load(f)
            path = os.path.join(folder, m["name"])
            if os.path.exists(path):
                return path, m["write_seconds"], True
        shutil.rmtree(folder, ignore_errors=True)
        if os.path.exists(marker):
            os.remove(marker)
        os.makedirs(folder)
        t0 = time.perf_counter()
        path = WRITERS[fmt](folder, g)
        seconds = time.perf_counter() - t0
        with open(marker, "w") as f:
            json.dump({"name": os.path.basename(path), "write_seconds": seconds}, f)
        self.written.add(folder)
        return path, seconds, False

    def release(self, fmt: str, g: Geometry) -> None:
        if not self.keep:
            folder = self._folder(fmt, g)
            shutil.rmtree(folder, ignore_errors=True)
            if os.path.exists(folder + ".json"):
                os.remove(folder + ".json")

    def close(self) -> None:
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)


class Budget:
    """Seconds the run may take; ``spent(what)`` records and prints what it skips once they are gone."""

    def __init__(self, seconds: float | None):
        self.seconds, self.t0, self.skipped = seconds, time.perf_counter(), []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def spent(self, what: str) -> bool:
        if self.seconds is None or self.elapsed() < self.seconds:
            return False
        self.skipped.append(what)
        print(f"    skipped {what}: the budget of {self.seconds:g} s is spent ({self.elapsed():.0f} s)", flush=True)
        return True


# -- timing -----------------------------------------------------------------------------------------

def _sync(x: Any) -> Any:
    """``x`` once all its work is done: the whole device, since gpulazy works on streams of its own."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        cupy.cuda.Device().synchronize()
    return x


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        out = None
        t0 = time.perf_counter()
        out = _sync(fn())
        best = min(best, time.perf_counter() - t0)
    return best, out


def _free_device_pool(device: str) -> None:
    """Give a reference way's device buffers back, so the next rows start from the same free memory."""
    if device != "cpu":
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()


def to_device(a: np.ndarray, device: str) -> Any:
    if device == "cpu":
        return a
    import cupy

    return cupy.asarray(a)


def _host(x: Any) -> np.ndarray:
    return x.get() if type(x).__module__.startswith("cupy") else np.asarray(x)


# -- derived operations ------------------------------------------------------------------------------

OPS: dict[str, tuple[str, Callable[[Any, Geometry], Any]]] = {
    "mip": ("max(axis=0)", lambda a, g: a.max(axis=0)),
    "slice": ("[1:half+1]", lambda a, g: a[1:g.half + 1]),
    "astype_sum": ('astype("f8").sum()', lambda a, g: a.astype("f8").sum()),
    "mean": ("mean()", lambda a, g: a.mean()),
    # One plane where a chunk begins (a viewer's plane): a compressed chunk decodes its first planes
    # alone (``ChunkSpec.head``) or whole. Not held to the whole read's rate: it is a latency.
    "plane": ("[half:half+1]", lambda a, g: a[g.half:g.half + 1]),
    # Each chunk mapped as its read lands (``gpulazy.read.mapped``); the raw reference maps its one buffer.
    "map": ("map_blocks(b * 2)", lambda a, g: a.map_blocks(_twice, dtype=a.dtype) if hasattr(a, "map_blocks")
            else _twice(a)),
    # A reduction of a map: the map's function folded into the streamed reduction.
    "map_mip": ("map_blocks(b * 2).max(axis=0)", lambda a, g: a.map_blocks(_twice, dtype=a.dtype).max(axis=0)
                if hasattr(a, "map_blocks") else _twice(a).max(axis=0)),
    # A plane by an integer (a notebook's ``vol[k]``), read as a box; beside it the same index through
    # dask's getitem tasks (what it was before the twenty-seventh session), in the same run.
    # (``_measure_op`` warms an op up on the first planes alone: their last plane there.)
    "plane_int": ("[half]", lambda a, g: a[min(g.half, a.shape[0] - 1)]),
    "plane_dask": ("[half] by dask's tasks", lambda a, g: _dask_getitem(a, min(g.half, a.shape[0] - 1))),
    # A viewer's tile of that plane (its top-left quarter): a chunk of planes stored as is reads the
    # plane alone whatever the tile cuts along the later axes; beside dask's getitem tasks.
    "tile": ("[half, :s/2, :s/2]", lambda a, g: a[_tile(a, g)]),
    "tile_dask": ("[half, :s/2, :s/2] by dask", lambda a, g: _dask_getitem(a, _tile(a, g))),
    # The plane's brightest pixel (a contrast limit): a streamed map of the chunks the plane cuts; beside
    # dask's getitem tasks and reduction.
    "plane_max": ("[half].max()", lambda a, g: a[min(g.half, a.shape[0] - 1)].max()),
    "plane_max_dask": ("[half].max() by dask", lambda a, g: _dask_getitem(a, min(g.half, a.shape[0] - 1)).max()),
    # NumPy's function (``vol.max``'s streamed reduction) against dask's ``da.max`` (dask's tasks).
    "np_mip": ("np.max(vol, axis=0)", lambda a, g: np.max(a, axis=0)),
    "mip_dask": ("da.max(vol, axis=0)", lambda a, g: _dask_max(a)),
    # The MIP of a box off the chunk boundaries (a streamed map of the chunks it meets, each cut), beside
    # the same through dask's tasks (a getitem, then dask's reduction), in the same run.
    "slice_mip": ("[1:half+1].max(axis=0)", lambda a, g: a[1:g.half + 1].max(axis=0)),
    "slice_mip_dask": ("[1:half+1].max by dask", lambda a, g: _dask_getitem(a, slice(1, g.half + 1)).max(axis=0)),
    # A preview, every 4th element along each axis (a streamed map of the chunks it picks from), beside
    # dask's getitem tasks; GB/s of the whole volume's bytes (a folder of planes reads a quarter of them).
    "preview": ("[::4, ::4, ::4]", lambda a, g: a[::4, ::4, ::4]),
    "preview_dask": ("[::4, ::4, ::4] by dask", lambda a, g: _dask_getitem(a, (slice(None, None, 4),) * 3)),
    # The volume flipped along axis 0 (a streamed map of every chunk, from the last, each flipped as a
    # view, copied into one result), beside dask's getitem tasks.
    "flip": ("[::-1]", lambda a, g: a[::-1]),
    "flip_dask": ("[::-1] by dask", lambda a, g: _dask_getitem(a, slice(None, None, -1))),
}


def _tile(a: Any, g: Geometry) -> tuple:
    return min(g.half, a.shape[0] - 1), slice(0, g.side // 2), slice(0, g.side // 2)


def _dask_getitem(a: Any, index: Any) -> Any:
    import dask.array as da

    return da.Array.__getitem__(a, index) if isinstance(a, da.Array) else a[index]


def _dask_max(a: Any) -> Any:
    import dask.array as da

    return da.max(a, axis=0) if isinstance(a, da.Array) else a.max(axis=0)


def _twice(block: Any) -> Any:
    return block * 2
#: The operations issue 20 holds to ``TARGET_VS_WHOLE``.
TARGET_OPS = ("mip", "slice", "astype_sum", "mean")


def op_bytes(op: str, g: Geometry) -> int:
    """Source bytes an operation reads: the slice reads half the planes, the plane one, the others all."""
    return {"slice": g.half * g.plane, "slice_mip": g.half * g.plane, "slice_mip_dask": g.half * g.plane,
            "plane": g.plane, "plane_int": g.plane, "plane_dask": g.plane, "tile": g.plane // 4,
            "tile_dask": g.plane // 4, "plane_max": g.plane, "plane_max_dask": g.plane}.get(op, g.nbytes)


def _planes_equal(out: Any, first: int, g: Geometry, times: int = 1) -> bool:
    """Every plane of ``out`` equals generated plane ``first + i`` (times ``times``, in its dtype), compared
    where ``out`` lives (the distinct planes go to the device once: comparing there costs no host copy
    of the result)."""
    on_gpu = type(out).__module__.startswith("cupy")
    if on_gpu:
        import cupy

        want = [cupy.asarray(plane(z, g.side) * np.uint16(times)) for z in range(_DISTINCT)]
    else:
        want = [p * np.uint16(times) for p in _planes(g.side)]
    return all(bool((out[i] == want[(first + i) % _DISTINCT]).all()) for i in range(len(out)))


def check_whole(out: Any, g: Geometry) -> bool:
    """Every plane equals the generated one."""
    return tuple(out.shape) == (g.n, g.side, g.side) and _planes_equal(out, 0, g)


def check_op(op: str, out: Any, g: Geometry) -> bool:
    """``out`` equals the operation on the generated volume (sums of integers below 2**53 are exact in f8)."""
    if op in ("plane_int", "plane_dask"):
        return tuple(out.shape) == (g.side, g.side) and _planes_equal(out[None], g.half, g)
    if op in ("tile", "tile_dask"):
        h = g.side // 2
        return tuple(out.shape) == (h, h) and np.array_equal(_host(out), plane(g.half, g.side)[:h, :h])
    if op in ("plane_max", "plane_max_dask"):
        return int(_host(out)) == int(plane(g.half, g.side).max())
    if op in ("flip", "flip_dask"):
        n = len(out)
        return tuple(out.shape[1:]) == (g.side, g.side) and _planes_equal(out[::-1], g.n - n, g)
    if op in ("preview", "preview_dask"):
        n, m = len(range(0, g.n, 4)), len(range(0, g.side, 4))
        host = _host(out)
        return host.shape == (n, m, m) and all(np.array_equal(host[i], plane(4 * i, g.side)[::4, ::4]) for i in range(n))
    if op in ("slice_mip", "slice_mip_dask"):
        want = np.maximum.reduce([plane(z, g.side) for z in range(1, 1 + min(g.half, _DISTINCT))])
        return tuple(out.shape) == (g.side, g.side) and np.array_equal(_host(out), want)
    if op in ("mip", "map_mip", "np_mip", "mip_dask"):
        times = np.uint16(2 if op == "map_mip" else 1)  # (wrapping as uint16 does, before the max)
        want = np.maximum.reduce([plane(z, g.side) * times for z in range(min(g.n, _DISTINCT))])
        return bool(np.array_equal(_host(out), want))
    if op == "slice":
        return tuple(out.shape) == (g.half, g.side, g.side) and _planes_equal(out, 1, g)
    if op == "plane":
        return tuple(out.shape) == (1, g.side, g.side) and _planes_equal(out, g.half, g)
    if op == "map":
        return tuple(out.shape) == (g.n, g.side, g.side) and _planes_equal(out, 0, g, times=2)
    sums = [int(plane(z, g.side).sum(dtype=np.int64)) for z in range(_DISTINCT)]
    exact = sum(sums[z % _DISTINCT] for z in range(g.n))
    value = float(_host(out))
    if op == "astype_sum":
        return value == float(exact)
    return bool(np.isclose(value, exact / (g.n * g.side * g.side), rtol=1e-12, atol=0))


def read_raw(path: str, g: Geometry, device: str, start: int = 0, count: int | None = None) -> Any:
    """Planes ``start..start+count`` of the raw file in one buffer: KvikIO on a GPU, ``np.fromfile`` on the host."""
    count = g.n - start if count is None else count
    if device == "cpu":
        return np.fromfile(path, np.uint16, count=count * g.side * g.side, offset=start * g.plane).reshape(
            count, g.side, g.side)
    import cupy
    import kvikio
    import kvikio.defaults

    import gpulazy

    # KvikIO's pool is process-wide and starts at one thread; gpulazy's backend sets it to its
    # ``threads`` when made. The reference gets the same threads, also when it runs first.
    threads = gpulazy.config.get("threads")
    if int(kvikio.defaults.get("num_threads")) != threads:
        kvikio.defaults.set({"num_threads": threads})
    buf = cupy.empty(count * g.plane, dtype=cupy.uint8)
    with kvikio.CuFile(path, "r") as f:
        f.pread(buf, buf.nbytes, file_offset=start * g.plane, task_size=4 << 20).get()
    return buf.view(cupy.uint16).reshape(count, g.side, g.side)


def raw_reference_name(device: str) -> str:
    return "np.fromfile + same op" if device == "cpu" else "raw KvikIO + same op"


def raw_reference_skip(device: str) -> str | None:
    if device == "cpu":
        return None
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return "kvikio is not installed"
    return None


def raw_op(op: str, path: str, g: Geometry, device: str) -> Callable[[], Any]:
    """The raw reference of ``op``: the slice is a read of those planes alone; the others read all, then compute."""
    if op == "slice":
        return lambda: read_raw(path, g, device, 1, g.half)
    if op in ("preview", "preview_dask"):
        return lambda: read_raw(path, g, device)[::4, ::4, ::4]
    if op in ("flip", "flip_dask"):
        return lambda: read_raw(path, g, device)[::-1]
    if op in ("slice_mip", "slice_mip_dask"):
        return lambda: read_raw(path, g, device, 1, g.half).max(axis=0)
    if op == "plane":
        return lambda: read_raw(path, g, device, g.half, 1)
    if op in ("plane_int", "plane_dask"):
        return lambda: read_raw(path, g, device, g.half, 1)[0]
    if op in ("tile", "tile_dask"):
        return lambda: read_raw(path, g, device, g.half, 1)[0, :g.side // 2, :g.side // 2]
    if op in ("plane_max", "plane_max_dask"):
        return lambda: read_raw(path, g, device, g.half, 1)[0].max()
    fn = OPS[op][1]
    return lambda: fn(read_raw(path, g, device), g)


def measure_raw_refs(path: str, g: Geometry, device: str, ops: list[str], repeat: int,
                     budget: Budget) -> dict[str, dict[str, Any]]:
    """GB/s of the raw reference for every op, measured once per run and shown beside every format."""
    reason = raw_reference_skip(device)
    out: dict[str, dict[str, Any]] = {}
    if reason:
        print(f"{raw_reference_name(device)}: skipped ({reason})")
        return {op: {"skipped": reason} for op in ops}
    read_raw(path, g, device)  # warm: page cache, KvikIO's threads
    for op in ops:
        if budget.spent(f"{raw_reference_name(device)} {op}"):
            out[op] = {"skipped": "budget spent"}
            continue
        try:
            seconds, res = timed(raw_op(op, path, g, device), repeat)
        except Exception as e:  # reported; the formats' rows still run
            out[op] = {"error": _error(e)}
            continue
        out[op] = {"gbps": op_bytes(op, g) / seconds / 1e9, "correct": check_op(op, res, g)}
        del res
        _free_device_pool(device)
    print(f"{raw_reference_name(device)}: " + ", ".join(
        f"{op} {r['gbps']:.2f} GB/s" + ("" if r["correct"] else " VALUES DIFFER") if "gbps" in r
        else f"{op} {r.get('error', r.get('skipped'))}" for op, r in out.items()), flush=True)
    return out


# -- reference readers of a whole format --------------------------------------------------------------

def _refs(fmt: str, path: str, device: str, g: Geometry, limit: int) -> dict[str, Any]:
    """Reference ways for ``fmt``: name -> (read, planes it reads), or name -> the reason it is skipped.
    Slow ways read ``limit`` planes."""
    n, small = g.n, min(g.n, limit)
    refs: dict[str, Any] = {}
    if fmt == "raw":
        if device == "cpu":
            refs["np.fromfile"] = (lambda: read_raw(path, g, device), n)
        else:
            refs["KvikIO CuFile.pread"] = raw_reference_skip(device) or (lambda: read_raw(path, g, device), n)
    if fmt == "tiff-deflate":
        import tifffile

        refs["tifffile.imread -> cp.asarray"] = (lambda: to_device(tifffile.imread(path, key=range(small)), device),
                                                 small)
    if fmt == "tiff":
        import tifffile

        full = [os.path.join(path, f) for f in sorted(os.listdir(path))]
        refs["tifffile.imread -> cp.asarray"] = (lambda: to_device(tifffile.imread(full[:small]), device), small)
        try:
            import dask_image.imread as dimread

            refs["dask_image.imread -> cp.asarray"] = (lambda: to_device(
                dimread.imread(os.path.join(path, "*.tif"))[:small].compute(), device), small)
        except ImportError:
            refs["dask_image.imread -> cp.asarray"] = "dask-image is not installed"
    if fmt.startswith("zarr"):
        refs.update(_zarr_refs(fmt, path, device, n, small))
    if fmt.startswith("hdf5"):
        import h5py

        if fmt in ("hdf5-bitshuffle", "hdf5-blosc"):
            import hdf5plugin  # noqa: F401  (registers the filter with HDF5)

            if fmt == "hdf5-blosc" and not h5py.h5z.filter_avail(32001):
                refs["h5py -> cp.asarray"] = "HDF5's blosc filter is not available here (hdf5plugin)"
                return refs

        def h5() -> Any:
            with h5py.File(path, "r") as f:
                return to_device(f["data"][:small], device)

        refs["h5py -> cp.asarray"] = (h5, small)
    return refs


def _zarr_refs(fmt: str, path: str, device: str, n: int, small: int) -> dict[str, Any]:
    import dask.array as da
    import zarr

    refs: dict[str, Any] = {
        "zarr-python [:] -> cp.asarray": (lambda: to_device(zarr.open_array(path, mode="r")[:small], device), small)}
    if device == "cpu":
        refs["zarr enable_gpu + da.from_zarr"] = "needs a GPU"
    else:
        def gpu_zarr() -> Any:
            with zarr.config.enable_gpu():
                return da.from_zarr(path)[:n].compute()

        refs["zarr enable_gpu + da.from_zarr"] = (gpu_zarr, n)
    try:
        import tensorstore as ts
    except ImportError:
        refs["TensorStore -> cp.asarray"] = "tensorstore is not installed"
        return refs
    driver = "zarr" if fmt == "zarr2-blosc" else "zarr3"

    def tstore() -> Any:
        t = ts.open({"driver": driver, "kvstore": {"driver": "file", "path": path}}).result()
        return to_device(t[:n].read().result(), device)

    refs["TensorStore -> cp.asarray"] = (tstore, n)
    return refs


# -- one format ---------------------------------------------------------------------------------------

@dataclass
class Run:
    """What every format's rows share."""

    g: Geometry
    device: str
    ops: list[str]
    repeat: int
    ref_limit: int
    refs: bool
    budget: Budget
    store: Store
    raw_rate: float | None = None
    raw_refs: dict[str, dict[str, Any]] | None = None


def _open(fmt: str, path: str, run: Run) -> Any:
    import gpulazy

    if fmt == "raw":
        return gpulazy.from_files(path, shape=(run.g.n, run.g.side, run.g.side), dtype="uint16", device=run.device,
                                  cache=False)
    return gpulazy.from_files(path, device=run.device, cache=False)


def measure_format(fmt: str, run: Run) -> dict[str, Any]:
    g = run.g
    try:
        path, write_seconds, reused = run.store.prepare(fmt, g)
    except ImportError as e:
        reason = f"{e.name or e} is not installed"
        print(f"{fmt:18s} skipped: {reason}", flush=True)
        return {"format": fmt, "skipped": reason}
    except OSError as e:  # a full disk, say: the formats after this one may still fit
        print(f"{fmt:18s} writing failed: {_error(e)}", flush=True)
        run.store.release(fmt, g)
        return {"format": fmt, "error": f"writing: {_error(e)}"}
    stored = _stored_bytes(path)
    row: dict[str, Any] = {"format": fmt, "bytes": g.nbytes, "stored_bytes": stored,
                           "compression_ratio": g.nbytes / stored, "write_seconds": write_seconds, "reused": reused}
    try:
        try:
            vol = _open(fmt, path, run)
            row["layout"] = vol.chunk_index.layout if vol.chunk_index is not None else "?"
            row["chunks"] = [list(c[:1]) + [len(c)] for c in vol.chunks]  # first chunk and count per axis
            vol[:min(8, g.n)].compute()  # start-up: backend, kernels, decoders
            seconds, out = timed(vol.compute, run.repeat)
        except Exception as e:  # one format failing is reported and the run goes on to the next
            row["error"] = _error(e)
            print(f"{fmt:18s} compute() failed: {row['error']}", flush=True)
            return row
        row["gpulazy_gbps"] = g.nbytes / seconds / 1e9
        row["correct"] = check_whole(out, g)
        del out
        _free_device_pool(run.device)
        if fmt == "raw":
            run.raw_rate = row["gpulazy_gbps"]
        row["vs_raw"] = row["gpulazy_gbps"] / run.raw_rate if run.raw_rate else None
        _print_whole(row)
        row["ops"] = {op: _measure_op(fmt, op, vol, row["gpulazy_gbps"], run) for op in run.ops}
        del vol
        row["refs"] = _measure_refs(fmt, path, row["gpulazy_gbps"], run) if run.refs else {}
    finally:
        run.store.release(fmt, g)
    return row


def _measure_op(fmt: str, op: str, vol: Any, whole_gbps: float, run: Run) -> dict[str, Any]:
    label, fn = OPS[op]
    if run.budget.spent(f"{fmt} {op}"):
        return {"skipped": "budget spent"}
    try:
        fn(vol[:min(8, run.g.n)], run.g).compute()  # start-up: the op's kernels, on a few planes
        seconds, out = timed(lambda: fn(vol, run.g).compute(), run.repeat)
    except Exception as e:  # reported beside the row; the other rows still run
        print(f"    {op:10s} {label:20s} failed: {_error(e)}", flush=True)
        return {"error": _error(e)}
    r: dict[str, Any] = {"gbps": op_bytes(op, run.g) / seconds / 1e9, "ms": seconds * 1e3,
                         "correct": check_op(op, out, run.g)}
    del out
    _free_device_pool(run.device)
    r["x_whole"] = r["gbps"] / whole_gbps
    if fmt in TARGET_FORMATS and op in TARGET_OPS:
        r["meets_target"] = r["x_whole"] >= TARGET_VS_WHOLE
    ref = (run.raw_refs or {}).get(op, {})
    if "gbps" in ref:
        r["raw_ref_gbps"] = ref["gbps"]
        r["x_raw_ref"] = r["gbps"] / ref["gbps"]
    _print_op(op, label, r, run.device)
    return r


def _measure_refs(fmt: str, path: str, gbps: float, run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {}
    limit_planes = max(2, run.ref_limit // run.g.plane)
    for name, ref in _refs(fmt, path, run.device, run.g, limit_planes).items():
        if isinstance(ref, str):
            out[name] = {"skipped": ref}
        elif run.budget.spent(f"{fmt} {name}"):
            out[name] = {"skipped": "budget spent"}
            continue  # spent() printed it
        else:
            fn, planes = ref
            try:
                s, _ = timed(fn, run.repeat)
                rate = planes * run.g.plane / s / 1e9
                out[name] = {"gbps": rate, "ratio": gbps / rate, "planes": planes}
            except Exception as e:  # a reference way that fails here is reported, not fatal
                out[name] = {"error": _error(e)}
            _free_device_pool(run.device)
        _print_ref(name, out[name])
    return out


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def _stored_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# -- printing ---------------------------------------------------------------------------------------

def _print_whole(row: dict[str, Any]) -> None:
    vs = f", {row['vs_raw']:.2f}x raw" if row.get("vs_raw") else ""
    vs += "" if row.get("correct") else "  VALUES DIFFER"
    wrote = f"{'files reused, written' if row['reused'] else 'written'} in {row['write_seconds']:.1f} s"
    print(f"{row['format']:18s} compute() {row['gpulazy_gbps']:6.2f} GB/s{vs} (compression "
          f"{row['compression_ratio']:.2f}x, layout {row['layout']}, {wrote})", flush=True)


def _print_op(op: str, label: str, r: dict[str, Any], device: str) -> None:
    target = ""
    if "meets_target" in r:
        target = f" [target {TARGET_VS_WHOLE}x: {'ok' if r['meets_target'] else 'MISS'}]"
    ref = ""
    if "raw_ref_gbps" in r:
        ref = f"   {raw_reference_name(device)} {r['raw_ref_gbps']:6.2f} GB/s -> {r['x_raw_ref']:.2f}x"
    bad = "" if r["correct"] else "  VALUES DIFFER"
    print(f"    {op:10s} {label:20s} {r['gbps']:6.2f} GB/s {r['x_whole']:5.2f}x whole ({r['ms']:.1f} ms){target}{ref}{bad}",
          flush=True)


def _print_ref(name: str, r: dict[str, Any]) -> None:
    if "skipped" in r:
        print(f"    {name:36s} skipped: {r['skipped']}")
    elif "error" in r:
        print(f"    {name:36s} failed: {r['error']}")
    else:
        print(f"    {name:36s} {r['gbps']:6.2f} GB/s -> gpulazy {r['ratio']:5.1f}x ({r['planes']} planes)")
    sys.stdout.flush()


def summary(rows: list[dict[str, Any]], ops: list[str]) -> str:
    """Derived / whole compute() per format and op: the issue-20 table."""
    lines = [f"derived op rate / whole compute() rate (target >= {TARGET_VS_WHOLE} for {', '.join(TARGET_FORMATS)}):",
             f"{'format':18s}" + "".join(f"{op:>{_width(op)}s}" for op in ops)]
    for row in rows:
        if "ops" not in row:
            continue
        cells = []
        for op in ops:
            r, w = row["ops"].get(op, {}), _width(op)
            cells.append(f"{r['x_whole']:>{w - 1}.2f}" + ("!" if r.get("meets_target") is False else " ")
                         if "x_whole" in r else f"{'-':>{w}s}")
        lines.append(f"{row['format']:18s}" + "".join(cells))
    return "\n".join(lines)


def _width(op: str) -> int:
    return max(12, len(op) + 2)


# -- command line -------------------------------------------------------------------------------------

def _pick(text: str, valid: Any, what: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in valid]
    if bad:
        raise SystemExit(f"unknown {what} {', '.join(bad)}; choose from {', '.join(valid)}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4GiB", help="bytes per format (issue 21: >= 4 GiB)")
    ap.add_argument("--side", type=int, default=SIDE, help="plane side in pixels (small for CPU tests)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--only", default=DEFAULT_ONLY, help=f"comma list of: {DEFAULT_ONLY}")
    ap.add_argument("--derived", action="store_true", help="add every derived row: " + ",".join(OPS))
    ap.add_argument("--ops", default=None, help=f"comma list of derived rows: {','.join(OPS)}")
    ap.add_argument("--no-refs", action="store_true", help="leave out the reference readers of each format")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ref-limit", default="1GiB", help="bytes the slow reference ways read")
    ap.add_argument("--budget-s", type=float, default=None, help="skip the rows left after this many seconds")
    ap.add_argument("--dir", default=None, help="keep the files under DIR/gpulazy-bench-formats and reuse them")
    ap.add_argument("--fresh", action="store_true", help="rewrite kept files")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import gpulazy

    formats = _pick(args.only, WRITERS, "format")
    ops = list(OPS) if args.derived else _pick(args.ops or "", OPS, "op")
    dev = gpulazy.get_device(args.device)
    g = Geometry(max(8, gpulazy.config.parse_bytes(args.size) // (args.side * args.side * 2) // 8 * 8), args.side)
    run = Run(g=g, device=dev.name, ops=ops, repeat=args.repeat, refs=not args.no_refs, budget=Budget(args.budget_s),
              ref_limit=gpulazy.config.parse_bytes(args.ref_limit), store=Store(args.dir, fresh=args.fresh))
    result: dict[str, Any] = {"device": dev.name, "planes": g.n, "side": g.side, "bytes_per_format": g.nbytes,
                              "ops": ops, "rows": [], "skipped": run.budget.skipped}
    print(f"device {dev.name}, {g.n} planes of {g.side}x{g.side} uint16 = {g.nbytes / 2**30:.2f} GiB per format, "
          f"best of {args.repeat}, warm page cache" + (f", budget {args.budget_s:g} s" if args.budget_s else ""))
    if ops and dev.is_gpu:
        result["kernel_warmup_seconds"] = _warm_kernels()
    try:
        if ops:
            result["raw_refs"] = run.raw_refs = _raw_refs(run)
        for fmt in formats:
            if run.budget.spent(f"{fmt} (all rows)"):
                result["rows"].append({"format": fmt, "skipped": "budget spent"})
                continue
            result["rows"].append(measure_format(fmt, run))
            _write_json(args.json, result)
    finally:
        run.store.close()
    if ops:
        print(summary(result["rows"], ops))
    if run.budget.skipped:
        print(f"skipped for the budget: {'; '.join(run.budget.skipped)}")
    print(f"total {run.budget.elapsed():.0f} s")
    _write_json(args.json, result)
    return 0


def _warm_kernels() -> float:
    """Compile the CuPy reductions the derived rows use, timed apart: a fresh host compiles each
    once with NVRTC (a first ``mean()`` took 48 s on an H100 host), then reads its kernel cache."""
    import cupy

    t0 = time.perf_counter()
    a = cupy.arange(4 * 16 * 16, dtype=cupy.uint16).reshape(4, 16, 16)
    for x in (a, a.astype("f8")):
        x.max(axis=0), x.sum(), x.mean(), x.sum(axis=(0, 1, 2), keepdims=True), x.sum(axis=0, keepdims=True)
    cupy.cuda.Device().synchronize()
    seconds = time.perf_counter() - t0
    print(f"CuPy reduction kernels ready in {seconds:.1f} s (compiled once per host, then cached)", flush=True)
    return seconds


def _raw_refs(run: Run) -> dict[str, dict[str, Any]]:
    """The raw file (reused or written, timed) and the raw reference of every op."""
    path, seconds, reused = run.store.prepare("raw", run.g)
    print(f"raw file for the references {'reused' if reused else 'written'} ({seconds:.1f} s)")
    return measure_raw_refs(path, run.g, run.device, run.ops, run.repeat, run.budget)


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
