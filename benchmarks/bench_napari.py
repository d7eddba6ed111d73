"""napari plane latency: gpulazy (device cache + motion prefetch) beside plain dask, in one run.

A float32 volume of ``--planes`` planes of ``--size`` x ``--size`` (default 512 x 2048 x 2048,
8 GiB: the GPU target) is written once as raw + sidecar. A napari ``ViewerModel`` (no
window: slicing is the same code, rendering is not timed) steps through it; each step's
latency is the time ``viewer.dims.set_current_step`` takes, i.e. napari slicing the layer,
which reads the plane (``np.asarray(data[z])``). Two ways of opening the same file:

- **gpulazy**: the plugin reader (``napari_gpulazy.read_layers``) on ``--device``: chunks
  read into the device cache, only the shown plane copied to the host;
- **dask**: ``da.from_array(np.memmap(...), chunks=<the same chunks>)`` handed to napari,
  as users do today (napari's own dask cache on, as by default; emptied before each cold pass).

Passes, each from plane ``--start`` forward at ``--rate`` planes/s for ``--steps`` planes,
then a jump to ``--jump-to`` and ``--after-jump`` more steps:

- ``cold``: empty gpulazy cache (the page cache stays warm unless ``--drop-page-cache``),
  no prefetch;
- ``cached``: the same again, the chunks now cached;
- ``prefetch``: empty cache, motion prefetch on (``napari_gpulazy.attach``).

It prints p50/p95 per pass (forward steps and the steps after the jump apart), the hit
rate and the ratios, and writes everything with ``--json PATH``. ``--repeat N`` runs each
pass N times (the jump's latency is then the median of N, and its max is shown);
``--compare`` runs gpulazy twice, reading a plane's chunks one after another as before
(``gpulazy-serial``: ``napari_gpulazy._view.PLANE_FIRST = False``) and plane first.
``--floor`` (raw only) also steps through the volume held in host memory as a NumPy array:
napari's own cost per step, below which no reader can show a plane.

``--drop-page-cache`` evicts every file of the volume (each Zarr chunk file too) before each
cold and prefetch pass, checks with ``mincore`` that at most ``--resident-max`` of its pages
stayed resident (an error otherwise: a "cold" figure read from memory is worse than none),
and the summary compares prefetch with plain dask on those cold passes.

    python benchmarks/bench_napari.py                                  # GPU host: 8 GiB
    python benchmarks/bench_napari.py --device cpu --size 512 --planes 128 --steps 64 --chunk-mib 8
    python benchmarks/bench_napari.py --preset gpu-raw  --dir /data --keep                    # 8 GiB raw
    python benchmarks/bench_napari.py --preset gpu-zstd --dir /data --keep --drop-page-cache  # 4 GiB zstd
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

TARGET_P95_MS = 20.0
TARGET_HIT_RATE = 0.95
TARGET_SPEEDUP = 10.0
TARGET_JUMP_MS = 100.0

#: The issue's GPU volumes: ``--preset NAME`` sets these (flags given explicitly still win).
PRESETS = {
    "gpu-raw": {"format": "raw", "planes": 512, "size": 2048, "chunk_mib": 128.0},          # 8 GiB float32
    "gpu-zstd": {"format": "zarr-zstd", "planes": 512, "size": 2048, "chunks": "32,512,512"},  # 4 GiB uint16
}


def write_volume(folder: str, planes: int, size: int) -> str:
    """The raw float32 volume with its sidecar (reused when it is already there)."""
    from gpulazy.layouts.raw import write_sidecar

    path = os.path.join(folder, f"bench-napari-{planes}x{size}x{size}.raw")
    if os.path.exists(path) and os.path.getsize(path) == planes * size * size * 4 and os.path.exists(path + ".json"):
        return path
    row = np.arange(size, dtype=np.float32)
    with open(path + ".partial", "wb") as f:
        for z in range(planes):  # plane z holds z + x / size: each plane differs, checkable
            np.broadcast_to(z + row / size, (size, size)).astype(np.float32).tofile(f)
    os.replace(path + ".partial", path)
    write_sidecar(path, shape=(planes, size, size), dtype="float32", axes=("z", "y", "x"))
    return path


def _size(path: str) -> int:
    return sum(os.path.getsize(f) for f in volume_files(path))


def volume_files(path: str) -> list[str]:
    """Every file of the volume: the file and its sidecar, or each file of a store (chunk files too)."""
    if os.path.isfile(path):
        return [p for p in (path, path + ".json") if os.path.isfile(p)]
    return sorted(os.path.join(d, n) for d, _, names in os.walk(path) for n in names)


def resident_fraction(files: list[str]) -> float:
    """Share of the files' pages in the page cache now (``mincore`` over a read-only mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    resident = total = 0
    for f in files:
        size = os.path.getsize(f)
        if size == 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {f} for mincore failed")
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {f} failed")
                resident += sum(b & 1 for b in bytes(vec))
                total += pages
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def drop_volume_pages(path: str, resident_max: float) -> float:
    """Evict the volume's pages (``posix_fadvise(DONTNEED)`` on each of its files); the share
    still resident after, which must be at most ``resident_max``."""
    from gpulazy._bench import drop_page_cache

    files = volume_files(path)
    drop_page_cache(files)
    left = resident_fraction(files)
    if left > resident_max:
        raise RuntimeError(f"--drop-page-cache: {100 * left:.1f}% of {path}'s pages are still in the page "
                           f"cache after POSIX_FADV_DONTNEED (allowed {100 * resident_max:g}%): cold figures "
                           "would be read from memory")
    return left


def plane_values(z: int, size: int, dtype: Any) -> np.ndarray:
    """What plane ``z`` holds: every pixel differs from its neighbours and from other planes'.

    Integer planes: a smooth high byte and a hashed (noise-like) low byte, so zstd stores about
    half of the bytes, as with camera data, and a cold page cache means reading the disk (a
    pattern zstd squeezes to nothing would leave nothing to read). A few ms a 2048 x 2048
    plane: every shown plane is checked between steps.
    """
    if np.dtype(dtype).kind == "f":
        return np.broadcast_to(z + np.arange(size, dtype=np.float32) / size, (size, size))
    smooth, hashed = _plane_parts(size)
    high = smooth + np.uint16(z * 131 % 251)
    high -= np.where(high >= 251, np.uint16(251), np.uint16(0))
    low = (hashed + np.uint32(z * 1_000_003 * 2_654_435_761 % 2**32)) >> np.uint32(24)  # wraps mod 2**32
    return high << np.uint16(8) | low.astype(np.uint16)


@functools.lru_cache(maxsize=2)
def _plane_parts(size: int) -> tuple[np.ndarray, np.ndarray]:
    """The parts of ``plane_values`` that do not depend on the plane: ``(y*7 + x) % 251`` and the
    pixel's multiplicative hash ``(y*size + x) * 2654435761 mod 2**32``."""
    y, x = np.ogrid[:size, :size]
    smooth = ((y * 7 + x) % 251).astype(np.uint16)
    hashed = ((y * size + x) * 2_654_435_761 % 2**32).astype(np.uint32)
    return smooth, hashed


def write_zarr(folder: str, planes: int, size: int, chunks: tuple[int, ...]) -> str:
    """A zstd-1 Zarr v3 uint16 store of ``plane_values`` in ``chunks`` (reused when there)."""
    import zarr
    from zarr.codecs import ZstdCodec

    path = os.path.join(folder, f"bench-napari-{planes}x{size}x{size}-{'x'.join(map(str, chunks))}-v2.zarr")
    if os.path.exists(os.path.join(path, "done")):
        return path
    z = zarr.create_array(path, shape=(planes, size, size), chunks=chunks, dtype="uint16",
                          compressors=ZstdCodec(level=1), overwrite=True)
    for a in range(0, planes, chunks[0]):
        b = min(planes, a + chunks[0])
        z[a:b] = np.stack([plane_values(k, size, "uint16") for k in range(a, b)])
    open(os.path.join(path, "done"), "w").close()
    return path


def write_tiff(folder: str, planes: int, size: int, tile: int) -> str:
    """A multi-page uint16 TIFF of ``plane_values`` in ``tile`` x ``tile`` tiles (reused when there)."""
    import tifffile

    path = os.path.join(folder, f"bench-napari-{planes}x{size}x{size}-tile{tile}-v2.tif")
    if os.path.exists(path + ".done"):
        return path
    volume = np.stack([plane_values(k, size, "uint16") for k in range(planes)])  # one series of pages
    tifffile.imwrite(path, volume, tile=(tile, tile), bigtiff=True)
    open(path + ".done", "w").close()
    return path


def percentiles(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {"n": 0, "p50_ms": float("nan"), "p95_ms": float("nan"), "max_ms": float("nan")}
    a = np.asarray(ms)
    return {"n": len(ms), "p50_ms": float(np.percentile(a, 50)), "p95_ms": float(np.percentile(a, 95)),
            "max_ms": float(a.max())}


def step_pass(viewer: Any, layer: Any, planes: list[int], rate: float, check: bool) -> list[float]:
    """Step through ``planes`` at ``rate`` planes/s; the latency of each step in ms."""
    out = []
    period = 1.0 / rate if rate > 0 else 0.0
    next_t = time.perf_counter()
    for z in planes:
        delay = next_t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        next_t = max(next_t + period, time.perf_counter())
        t0 = time.perf_counter()
        viewer.dims.set_current_step(0, z)
        out.append(1e3 * (time.perf_counter() - t0))
        if check:  # every pixel of the plane napari shows, against what the file holds
            shown = np.asarray(layer._slice.image.view)
            want = plane_values(z, shown.shape[-1], shown.dtype)
            if not np.array_equal(shown, want):
                bad = np.argwhere(shown != want)
                raise AssertionError(f"plane {z}: napari shows {len(bad)} pixels unlike the file, "
                                     f"first at {tuple(bad[0])}: {shown[tuple(bad[0])]} != {want[tuple(bad[0])]}")
    return out


def open_way(way: str, path: str, args: argparse.Namespace, cache: Any) -> tuple[Any, dict[str, Any], Any]:
    """``(data, layer kwargs, chunks)`` for one way of opening the file."""
    import gpulazy

    if way.startswith("gpulazy"):
        import napari_gpulazy

        ((data, kwargs, _),) = napari_gpulazy.read_layers(path, device=args.device, cache=cache, prefetch=False)
        return data, kwargs, data.array.chunks
    import dask.array as da

    if way == "memory":  # napari's own floor: the whole volume in host memory, no reader at all
        data = np.fromfile(path, dtype=np.float32).reshape(args.planes, args.size, args.size)
        return data, {"name": "memory"}, tuple((n,) for n in data.shape)
    if args.format == "tiff":
        import tifffile

        data = da.from_zarr(tifffile.imread(path, aszarr=True))
    elif args.format == "zarr-zstd":
        data = da.from_zarr(path)
    else:
        shape = (args.planes, args.size, args.size)
        chunks = gpulazy.from_files(path, device="cpu", cache=False).chunks  # the same chunks
        data = da.from_array(np.memmap(path, dtype=np.float32, mode="r", shape=shape), chunks=chunks)
    return data, {"name": "dask"}, data.chunks


def run_ways(ways: list[str], path: str, args: argparse.Namespace, planes: list[int], split: int
             ) -> dict[str, dict[str, Any]]:
    """Every pass for each way of opening the file; their latencies and cache figures.

    ``ways``: ``gpulazy`` (plane first), ``gpulazy-serial`` (a plane's chunks read one after
    another, as before) and ``dask``. Each way has its own viewer (and gpulazy cache, all of
    one capacity); the ways take turns pass by pass and repeat by repeat, so a machine busy
    with other work slows them alike.
    """
    from napari.components import ViewerModel
    from napari_gpulazy import _view

    import gpulazy

    opened: dict[str, tuple[Any, Any, Any]] = {}
    out: dict[str, dict[str, Any]] = {}
    capacity: Any = args.cache
    try:
        for way in ways:
            cache = None
            if way.startswith("gpulazy"):
                cache = gpulazy.DeviceCache(capacity, device=args.device, name=f"bench-napari-{way}")
                capacity = cache.capacity  # "50%" of what the first left would halve the second
            data, kwargs, chunks = open_way(way, path, args, cache)
            kwargs["contrast_limits"] = (0.0, float(args.planes if args.format == "raw" else 65535))  # no guess
            viewer = ViewerModel()
            opened[way] = (viewer, viewer.add_image(data, **kwargs), cache)
            itemsize = 4 if args.format == "raw" else 2
            out[way] = {"chunks": [int(c[0]) for c in chunks],
                        "chunk_bytes": int(np.prod([c[0] for c in chunks])) * itemsize}
        for name in ("cold", "cached", "prefetch"):
            runs: dict[str, list] = {w: [] for w in ways if not (w in ("dask", "memory") and name == "prefetch")}
            for _ in range(args.repeat):  # plain dask has no read-ahead: stepping is its cold pass
                for way, done in runs.items():
                    _view.PLANE_FIRST = way != "gpulazy-serial"
                    done.append(one_pass(*opened[way], name, path, args, planes))
            for way, done in runs.items():
                out[way][name] = row = summarise(done, split, planes)
                print(f"  {way:14s} {name:9s} forward p50 {row['forward']['p50_ms']:8.2f} ms  p95 "
                      f"{row['forward']['p95_ms']:8.2f} ms  jump {row['jump_ms']:8.2f} ms "
                      f"(max {row['jump_max_ms']:.2f})"
                      + (f"  hit rate {row['hit_rate']:.3f}" if "hit_rate" in row else "")
                      + (f"  page cache {100 * row['resident_after_drop']:.1f}% left" if args.drop_page_cache
                         and name != "cached" else ""), flush=True)
    finally:
        _view.PLANE_FIRST = True
        for viewer, _, cache in opened.values():
            viewer.layers.clear()
            if cache is not None:
                cache.close()
    return out


def one_pass(viewer: Any, layer: Any, cache: Any, name: str, path: str, args: argparse.Namespace,
             planes: list[int]) -> dict[str, Any]:
    """One pass: step latencies, cache counters, motion totals, page cache left after dropping."""
    run: dict[str, Any] = {}
    hook = None
    if name != "cached":
        if cache is not None:
            cache.clear()
        else:  # plain dask: napari's own dask cache would serve the repeats of a cold pass
            from napari.utils import resize_dask_cache

            resize_dask_cache().cache.clear()
        if args.drop_page_cache:
            run["resident_after_drop"] = drop_volume_pages(path, args.resident_max)
    if name == "prefetch":
        import napari_gpulazy

        hook = napari_gpulazy.attach(viewer, depth=args.depth, unsure=args.unsure or None)
    viewer.dims.set_current_step(0, planes[0] - 1)  # a step away: the first timed step is an event
    if cache is not None:
        from gpulazy.testing import wait_for_idle

        wait_for_idle(cache)  # the read-ahead of that step away is not timed
        cache.reset_stats()
    run["ms"] = step_pass(viewer, layer, planes, args.rate, args.check)
    if cache is not None:
        run["stats"] = cache.stats()
    if hook is not None:
        import napari_gpulazy

        run["motion"] = hook.totals()
        napari_gpulazy.detach(viewer)
        cache.cancel()
    return run


def summarise(runs: list[dict[str, Any]], split: int, planes: list[int]) -> dict[str, Any]:
    """One row from the repeats of a pass: latencies pooled, the jump's median and max, and the
    slowest steps (``[plane, ms]``): with 20 steps after a jump, one slow step sets their p95."""
    forward = [m for r in runs for m in r["ms"][:split]]
    after = [m for r in runs for m in r["ms"][split + 1:]]
    jumps = [r["ms"][split] for r in runs if split < len(r["ms"])]
    row: dict[str, Any] = {"forward": percentiles(forward), "after_jump": percentiles(after),
                           "jump_ms": float(np.median(jumps)) if jumps else float("nan"),
                           "jump_max_ms": max(jumps) if jumps else float("nan"), "jumps_ms": jumps,
                           "slowest": slowest(runs, planes)}
    if "resident_after_drop" in runs[0]:
        row["resident_after_drop"] = max(r["resident_after_drop"] for r in runs)
    if "stats" in runs[0]:
        keys = ("hits", "misses", "prefetched", "prefetch_hits", "cancelled", "evictions")
        row.update({k: sum(r["stats"][k] for r in runs) for k in keys})
        looked = row["hits"] + row["misses"]
        row["hit_rate"] = row["hits"] / looked if looked else 0.0
    if "motion" in runs[0]:
        row["motion"] = {k: sum(r["motion"][k] for r in runs) for k in runs[0]["motion"]}
    return row


def slowest(runs: list[dict[str, Any]], planes: list[int], n: int = 6) -> list[list[float]]:
    """The ``n`` slowest steps of the repeats, ``[plane, ms]``, slowest first."""
    steps = [(ms, z) for r in runs for z, ms in zip(planes, r["ms"])]
    return [[z, round(ms, 2)] for ms, z in sorted(steps, reverse=True)[:n]]


def table(result: dict[str, Any]) -> str:
    lines = ["| way | pass | forward p50 ms | forward p95 ms | jump ms | after jump p95 ms | hit rate |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for way in ("gpulazy-serial", "gpulazy", "dask", "memory"):
        for name in ("cold", "cached", "prefetch"):
            row = result.get(way, {}).get(name)
            if row is None:
                continue
            hit = f"{row['hit_rate']:.3f}" if "hit_rate" in row else "—"
            lines.append(f"| {way} | {name} | {row['forward']['p50_ms']:.2f} | {row['forward']['p95_ms']:.2f} | "
                         f"{row['jump_ms']:.2f} | {row['after_jump']['p95_ms']:.2f} | {hit} |")
    return "\n".join(lines)


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, from the prefetch pass and plain dask's cold pass (the page cache
    dropped before both with ``--drop-page-cache``)."""
    pre = result["gpulazy"]["prefetch"]
    dask_p95 = result["dask"]["cold"]["forward"]["p95_ms"]
    p95 = pre["forward"]["p95_ms"]
    return {"page_cache": "dropped" if result["args"]["drop_page_cache"] else "warm",
            "prefetch_p95_ms": p95, "p95_target_ms": TARGET_P95_MS, "p95_ok": p95 < TARGET_P95_MS,
            "jump_ms": pre["jump_ms"], "jump_ok": pre["jump_ms"] < TARGET_JUMP_MS,
            "after_jump_p95_ms": pre["after_jump"]["p95_ms"],
            "hit_rate": pre["hit_rate"], "hit_rate_ok": pre["hit_rate"] >= TARGET_HIT_RATE,
            "dask_p95_ms": dask_p95, "dask_over_gpulazy_p95": dask_p95 / p95 if p95 > 0 else float("inf"),
            "speedup_ok": dask_p95 >= TARGET_SPEEDUP * p95,
            # napari's own cost of a step over a volume already in host memory: what no reader goes below
            "memory_p95_ms": result.get("memory", {}).get("cached", {}).get("forward", {}).get("p95_ms")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="the issue's GPU volumes: gpu-raw (512 x 2048 x 2048 float32, 8 GiB) or gpu-zstd "
                         "(512 x 2048 x 2048 uint16 zstd Zarr in (32, 512, 512) chunks, 4 GiB); flags given win")
    ap.add_argument("--planes", type=int, default=512)
    ap.add_argument("--size", type=int, default=2048, help="plane side in pixels")
    ap.add_argument("--steps", type=int, default=200, help="forward steps before the jump")
    ap.add_argument("--after-jump", type=int, default=20)
    ap.add_argument("--start", type=int, default=None, help="first plane (default: a tenth in)")
    ap.add_argument("--jump-to", type=int, default=None, help="plane jumped to (default: 3/4 of the way)")
    ap.add_argument("--rate", type=float, default=20.0, help="planes per second")
    ap.add_argument("--depth", type=int, default=16, help="planes warmed ahead (prefetch pass)")
    ap.add_argument("--unsure", type=int, default=None,
                    help="planes warmed each side while the direction is unknown (default: --depth, as the "
                         "plugin does)")
    ap.add_argument("--chunk-mib", type=float, default=128.0, help="target chunk size (gpulazy's default 128)")
    ap.add_argument("--format", choices=("raw", "zarr-zstd", "tiff"), default="raw",
                    help="raw float32 + sidecar, a zstd-1 Zarr v3 uint16 store in --chunks, or a multi-page "
                         "uint16 TIFF in tiles of the last --chunks entry")
    ap.add_argument("--chunks", default="32,512,512", help="Zarr chunks (z,y,x): a plane spans several")
    ap.add_argument("--device", default=None, help="'cpu' or 'cuda:N' (default: a GPU when usable)")
    ap.add_argument("--cache", default="50%", help="gpulazy cache capacity ('8 GiB', '50%%' of free memory)")
    ap.add_argument("--dir", default=None, help="where the volume is written (default: the temp folder)")
    ap.add_argument("--drop-page-cache", action="store_true",
                    help="evict every file of the volume from the page cache before each cold and prefetch pass")
    ap.add_argument("--resident-max", type=float, default=0.02,
                    help="with --drop-page-cache: most share of the volume's pages left resident (checked)")
    ap.add_argument("--repeat", type=int, default=1, help="run each pass this many times (jump: median)")
    ap.add_argument("--compare", action="store_true",
                    help="also run gpulazy reading a plane's chunks one after another (as before plane first)")
    ap.add_argument("--floor", action="store_true",
                    help="also step through the volume held in host memory (raw only): napari's own cost per step")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip checking the shown planes")
    ap.add_argument("--keep", action="store_true", help="keep the volume file")
    ap.add_argument("--json", default=None, help="write every figure here ('-' for stdout)")
    args = ap.parse_args(argv)
    if args.preset:
        words = argv if argv is not None else sys.argv[1:]
        given = {a.dest for a in ap._actions for o in a.option_strings
                 if any(w == o or w.startswith(o + "=") for w in words)}
        for key, value in PRESETS[args.preset].items():
            if key not in given:
                setattr(args, key, value)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.floor and args.format != "raw":
        ap.error("--floor holds the raw volume in memory: --format raw only")

    import gpulazy

    args.device = gpulazy.get_device(args.device).name
    gpulazy.config.set(chunk_size=int(args.chunk_mib * 2**20))
    start = args.start if args.start is not None else args.planes // 10
    jump = args.jump_to if args.jump_to is not None else (3 * args.planes) // 4
    forward = [z for z in range(start, start + args.steps) if z < args.planes]
    after = [z for z in range(jump, jump + args.after_jump + 1) if z < args.planes]
    if not forward or not after:
        ap.error("--start/--steps/--jump-to leave no planes to step through")
    folder = args.dir or tempfile.gettempdir()
    t0 = time.perf_counter()
    if args.format == "raw":
        path = write_volume(folder, args.planes, args.size)
    elif args.format == "tiff":
        path = write_tiff(folder, args.planes, args.size, int(args.chunks.split(",")[-1]))
    else:
        path = write_zarr(folder, args.planes, args.size, tuple(int(c) for c in args.chunks.split(",")))
    print(f"volume {path}: {args.planes} x {args.size} x {args.size} {args.format} "
          f"({_size(path) / 2**30:.2f} GiB, ready in {time.perf_counter() - t0:.1f} s); "
          f"device {args.device}; {len(forward)} steps at {args.rate:g} planes/s, then a jump to {jump}", flush=True)
    result: dict[str, Any] = {"args": vars(args), "volume_bytes": _size(path), "python": sys.version.split()[0]}
    try:
        ways = (["gpulazy-serial"] if args.compare else []) + ["gpulazy", "dask"] + (["memory"] if args.floor else [])
        result.update(run_ways(ways, path, args, forward + after, len(forward)))
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else None
            for p in (path, path + ".json", path + ".done"):
                if os.path.isfile(p):
                    os.remove(p)
    result["targets"] = targets(result)
    print()
    print(table(result))
    t = result["targets"]
    print(f"\npage cache {t['page_cache']}: prefetch forward p95 {t['prefetch_p95_ms']:.2f} ms "
          f"(target < {TARGET_P95_MS:g}) · jump {t['jump_ms']:.2f} ms (target < {TARGET_JUMP_MS:g}) · after jump p95 "
          f"{t['after_jump_p95_ms']:.2f} ms · hit rate {t['hit_rate']:.3f} (target >= {TARGET_HIT_RATE}) · plain dask "
          f"p95 {t['dask_p95_ms']:.2f} ms = {t['dask_over_gpulazy_p95']:.1f}x gpulazy prefetch (target >= "
          f"{TARGET_SPEEDUP:g})")
    if t["memory_p95_ms"] is not None:
        print(f"napari stepping through the volume held in host memory: p95 {t['memory_p95_ms']:.2f} ms "
              f"(no reader can show a plane faster)")
    if args.json:
        text = json.dumps(result, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
