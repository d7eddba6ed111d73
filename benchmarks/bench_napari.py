"""napari plane latency: gpulazy (device cache + motion prefetch) beside plain dask, in one run.

A float32 volume of ``--planes`` planes of ``--size`` x ``--size`` (default 512 x 2048 x 2048,
8 GiB: the GPU target) is written once as raw + sidecar. A napari ``ViewerModel`` (no
window: slicing is the same code, rendering is not timed) steps through it; each step's
latency is the time ``viewer.dims.set_current_step`` takes, i.e. napari slicing the layer,
which reads the plane (``np.asarray(data[z])``). Two ways of opening the same file:

- **gpulazy**: the plugin reader (``napari_gpulazy.read_layers``) on ``--device``: chunks
  read into the device cache, only the shown plane copied to the host;
- **dask**: ``da.from_array(np.memmap(...), chunks=<the same chunks>)`` handed to napari,
  as users do today (napari's own dask cache on, as by default).

Passes, each from plane ``--start`` forward at ``--rate`` planes/s for ``--steps`` planes,
then a jump to ``--jump-to`` and ``--after-jump`` more steps:

- ``cold``: empty gpulazy cache (the page cache stays warm unless ``--drop-page-cache``),
  no prefetch;
- ``cached``: the same again, the chunks now cached;
- ``prefetch``: empty cache, motion prefetch on (``napari_gpulazy.attach``).

It prints p50/p95 per pass (forward steps and the steps after the jump apart), the hit
rate and the ratios, and writes everything with ``--json PATH``.

    python benchmarks/bench_napari.py                                  # GPU host: 8 GiB
    python benchmarks/bench_napari.py --device cpu --size 512 --planes 128 --steps 64 --chunk-mib 8
"""

from __future__ import annotations

import argparse
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
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file()) + sum(
        _size(e.path) for e in os.scandir(path) if e.is_dir())


def plane_values(z: int, size: int, dtype: Any) -> np.ndarray:
    """What plane ``z`` holds: every pixel differs from its neighbours and from other planes'."""
    if np.dtype(dtype).kind == "f":
        return np.broadcast_to(z + np.arange(size, dtype=np.float32) / size, (size, size))
    y, x = np.ogrid[:size, :size]
    return ((z * 131 + y * 7 + x) % 65521).astype(np.uint16)


def write_zarr(folder: str, planes: int, size: int, chunks: tuple[int, ...]) -> str:
    """A zstd-1 Zarr v3 uint16 store of ``plane_values`` in ``chunks`` (reused when there)."""
    import zarr
    from zarr.codecs import ZstdCodec

    path = os.path.join(folder, f"bench-napari-{planes}x{size}x{size}-{'x'.join(map(str, chunks))}.zarr")
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

    path = os.path.join(folder, f"bench-napari-{planes}x{size}x{size}-tile{tile}.tif")
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


def run_way(way: str, path: str, args: argparse.Namespace, planes: list[int], split: int) -> dict[str, Any]:
    """Every pass for one way of opening the file; its latencies and cache figures."""
    from napari.components import ViewerModel

    import gpulazy
    from gpulazy._bench import drop_page_cache

    viewer = ViewerModel()
    cache = None
    if way == "gpulazy":
        import napari_gpulazy

        cache = gpulazy.DeviceCache(args.cache, device=args.device, name="bench-napari")
        ((data, kwargs, _),) = napari_gpulazy.read_layers(path, device=args.device, cache=cache, prefetch=False)
        chunks = data.array.chunks
    elif args.format in ("zarr-zstd", "tiff"):
        import dask.array as da

        if args.format == "tiff":
            import tifffile

            data = da.from_zarr(tifffile.imread(path, aszarr=True))
        else:
            data = da.from_zarr(path)
        chunks = data.chunks
        kwargs = {"name": "dask"}
    else:
        import dask.array as da

        shape = (args.planes, args.size, args.size)
        chunks = gpulazy.from_files(path, device="cpu", cache=False).chunks  # the same chunks
        data = da.from_array(np.memmap(path, dtype=np.float32, mode="r", shape=shape), chunks=chunks)
        kwargs = {"name": "dask"}
    kwargs["contrast_limits"] = (0.0, float(args.planes if args.format == "raw" else 65535))  # no guess
    layer = viewer.add_image(data, **kwargs)
    itemsize = 4 if args.format == "raw" else 2
    out: dict[str, Any] = {"chunks": [int(c[0]) for c in chunks],
                           "chunk_bytes": int(np.prod([c[0] for c in chunks])) * itemsize}
    for name in ("cold", "cached", "prefetch"):
        if way == "dask" and name == "prefetch":
            continue  # plain dask has no read-ahead: stepping is its cold pass
        hook = None
        if name != "cached":
            if cache is not None:
                cache.clear()
            if args.drop_page_cache:
                drop_page_cache([path])
        if name == "prefetch":
            import napari_gpulazy

            hook = napari_gpulazy.attach(viewer, depth=args.depth)
        viewer.dims.set_current_step(0, planes[0] - 1)  # a step away: the first timed step is an event
        if cache is not None:
            time.sleep(0.2)
            cache.reset_stats()
        ms = step_pass(viewer, layer, planes, args.rate, args.check)
        row = {"forward": percentiles(ms[:split]), "after_jump": percentiles(ms[split + 1:]),
               "jump_ms": ms[split] if split < len(ms) else float("nan")}
        if cache is not None:
            s = cache.stats()
            row.update(hit_rate=s["hit_rate"], hits=s["hits"], misses=s["misses"], prefetched=s["prefetched"],
                       prefetch_hits=s["prefetch_hits"], cancelled=s["cancelled"], evictions=s["evictions"])
        if hook is not None:
            row["motion"] = hook.totals()
            napari_gpulazy.detach(viewer)
            cache.cancel()
        out[name] = row
        print(f"  {way:8s} {name:9s} forward p50 {row['forward']['p50_ms']:8.2f} ms  p95 "
              f"{row['forward']['p95_ms']:8.2f} ms  jump {row['jump_ms']:8.2f} ms"
              + (f"  hit rate {row['hit_rate']:.3f}" if "hit_rate" in row else ""), flush=True)
    viewer.layers.clear()
    if cache is not None:
        cache.close()
    return out


def table(result: dict[str, Any]) -> str:
    lines = ["| way | pass | forward p50 ms | forward p95 ms | jump ms | after jump p95 ms | hit rate |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for way in ("gpulazy", "dask"):
        for name in ("cold", "cached", "prefetch"):
            row = result[way].get(name)
            if row is None:
                continue
            hit = f"{row['hit_rate']:.3f}" if "hit_rate" in row else "—"
            lines.append(f"| {way} | {name} | {row['forward']['p50_ms']:.2f} | {row['forward']['p95_ms']:.2f} | "
                         f"{row['jump_ms']:.2f} | {row['after_jump']['p95_ms']:.2f} | {hit} |")
    return "\n".join(lines)


def targets(result: dict[str, Any]) -> dict[str, Any]:
    pre = result["gpulazy"]["prefetch"]
    dask_p95 = result["dask"]["cold"]["forward"]["p95_ms"]
    p95 = pre["forward"]["p95_ms"]
    return {"prefetch_p95_ms": p95, "p95_target_ms": TARGET_P95_MS, "p95_ok": p95 < TARGET_P95_MS,
            "hit_rate": pre["hit_rate"], "hit_rate_ok": pre["hit_rate"] >= TARGET_HIT_RATE,
            "dask_over_gpulazy_p95": dask_p95 / p95 if p95 > 0 else float("inf"),
            "speedup_ok": dask_p95 >= TARGET_SPEEDUP * p95}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--planes", type=int, default=512)
    ap.add_argument("--size", type=int, default=2048, help="plane side in pixels")
    ap.add_argument("--steps", type=int, default=200, help="forward steps before the jump")
    ap.add_argument("--after-jump", type=int, default=20)
    ap.add_argument("--start", type=int, default=None, help="first plane (default: a tenth in)")
    ap.add_argument("--jump-to", type=int, default=None, help="plane jumped to (default: 3/4 of the way)")
    ap.add_argument("--rate", type=float, default=20.0, help="planes per second")
    ap.add_argument("--depth", type=int, default=16, help="planes warmed ahead (prefetch pass)")
    ap.add_argument("--chunk-mib", type=float, default=128.0, help="target chunk size (gpulazy's default 128)")
    ap.add_argument("--format", choices=("raw", "zarr-zstd", "tiff"), default="raw",
                    help="raw float32 + sidecar, a zstd-1 Zarr v3 uint16 store in --chunks, or a multi-page "
                         "uint16 TIFF in tiles of the last --chunks entry")
    ap.add_argument("--chunks", default="32,512,512", help="Zarr chunks (z,y,x): a plane spans several")
    ap.add_argument("--device", default=None, help="'cpu' or 'cuda:N' (default: a GPU when usable)")
    ap.add_argument("--cache", default="50%", help="gpulazy cache capacity ('8 GiB', '50%%' of free memory)")
    ap.add_argument("--dir", default=None, help="where the volume is written (default: the temp folder)")
    ap.add_argument("--drop-page-cache", action="store_true", help="drop the file's pages before cold passes")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip checking the shown planes")
    ap.add_argument("--keep", action="store_true", help="keep the volume file")
    ap.add_argument("--json", default=None, help="write every figure here ('-' for stdout)")
    args = ap.parse_args(argv)

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
        for way in ("gpulazy", "dask"):
            result[way] = run_way(way, path, args, forward + after, len(forward))
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
    print(f"\nprefetch p95 {t['prefetch_p95_ms']:.2f} ms (target < {TARGET_P95_MS:g}) · hit rate {t['hit_rate']:.3f} "
          f"(target >= {TARGET_HIT_RATE}) · dask p95 / gpulazy prefetch p95 = {t['dask_over_gpulazy_p95']:.1f}x "
          f"(target >= {TARGET_SPEEDUP:g})")
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
