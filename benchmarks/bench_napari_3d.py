"""napari's 3-D view of a large volume: gpulazy's coarse level against napari over dask.

Writes a raw float32 volume (``--planes`` x ``--size``², warm in the page cache), opens it on
a napari ``ViewerModel`` (no canvas: what is timed is the data napari is handed, not drawing)
and times switching to 3-D:

- gpulazy: ``read_layers`` + the plugin's viewer hook, which shows a coarse level in 3-D
  (``napari_gpulazy._volume``), the first time and again after going back to 2-D;
- napari over dask: ``da.from_array(np.memmap(...))``, which napari renders whole.

Each shown volume is checked against the file (block means for the coarse level, on a
sample of voxels). ``--skip-dask`` leaves out the dask way (it reads the whole volume to
the host and holds it).

    python benchmarks/bench_napari_3d.py --device cuda:0 --planes 512 --size 2048   # 8 GiB
    python benchmarks/bench_napari_3d.py --device cpu --planes 64 --size 512
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_volume(folder: str, planes: int, size: int) -> str:
    path = os.path.join(folder, "vol3d.npy")
    out = np.lib.format.open_memmap(path, mode="w+", dtype="f4", shape=(planes, size, size))
    ramp = np.linspace(0, 1, size, dtype="f4")
    for z in range(planes):
        out[z] = ramp[None, :] * (z + 1) + ramp[:, None]
    out.flush()
    del out
    return path


def check(shown: np.ndarray, path: str, factors: tuple[int, ...], samples: int = 64) -> bool:
    """A sample of the shown voxels equals the means over the file's blocks."""
    data = np.load(path, mmap_mode="r")
    rng = np.random.default_rng(0)
    for _ in range(samples):
        idx = tuple(int(rng.integers(0, n)) for n in shown.shape)
        block = data[tuple(slice(i * f, (i + 1) * f) for i, f in zip(idx, factors))]
        if not np.isclose(shown[idx], block.astype("f8").mean(), rtol=1e-5):
            return False
    return True


def run(path: str, device: str, skip_dask: bool) -> dict:
    import dask.array as da
    from napari.components import ViewerModel

    import gpulazy
    from napari_gpulazy import attach, detach, read_layers

    out: dict = {"device": device, "bytes": os.path.getsize(path)}
    viewer = ViewerModel()
    hook = attach(viewer)
    ((view, kwargs, _),) = read_layers(path, device=device, prefetch=False)
    layer = viewer.add_image(view, **kwargs)
    for name in ("gpulazy first 3-D", "gpulazy 3-D again"):
        t0 = time.perf_counter()
        viewer.dims.ndisplay = 3
        shown = np.asarray(layer._slice.image.raw)
        out[name + " s"] = time.perf_counter() - t0
        volume = layer.metadata["gpulazy"].get("volume", {})
        out["coarse shape"], out["factors"] = list(shown.shape), list(volume.get("factors", (1, 1, 1)))
        out[name + " correct"] = check(shown, path, tuple(out["factors"]))
        viewer.dims.ndisplay = 2
    out["host bytes shown"] = int(shown.nbytes)
    detach(viewer)
    viewer.layers.clear()
    gpulazy.cache.default_cache(device).clear()
    if not skip_dask:
        arr = da.from_array(np.load(path, mmap_mode="r"), chunks=(32, -1, -1))
        layer = viewer.add_image(arr, contrast_limits=kwargs.get("contrast_limits"))
        t0 = time.perf_counter()
        viewer.dims.ndisplay = 3
        shown = np.asarray(layer._slice.image.raw)
        out["napari over dask 3-D s"] = time.perf_counter() - t0
        out["napari over dask host bytes"] = int(shown.nbytes)
        out["dask over gpulazy"] = out["napari over dask 3-D s"] / out["gpulazy first 3-D s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--planes", type=int, default=512)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--skip-dask", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from gpulazy.device import gpu_count

    device = args.device or ("cuda:0" if gpu_count() else "cpu")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        t0 = time.perf_counter()
        path = write_volume(folder, args.planes, args.size)
        print(f"wrote {os.path.getsize(path) / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)
        out = run(path, device, args.skip_dask)
    for k, v in out.items():
        print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
