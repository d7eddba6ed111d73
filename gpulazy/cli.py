"""The ``gpulazy`` command: ``info``, ``bench``, ``demo`` and ``index`` (and ``--version``).

``gpulazy info`` says which versions, devices and backend it found and why (``gpulazy info
PATH``: what a file holds, its codec and whether it decodes on the GPU);
``gpulazy bench`` measures this machine's ways of reading files onto a device side by
side; ``gpulazy demo`` runs the main job on a generated volume; ``gpulazy index PATH``
writes the checksum manifest that ``verify=True`` reads check against. Errors print one line on
stderr and exit with status 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from gpulazy import _bench, config
from gpulazy.device import Device, get_device, gpu_count, gpu_unavailable_reason

__all__ = ["main", "build_parser", "collect_info", "describe_index", "describe_levels", "stored_count"]

PACKAGES = ["numpy", "dask", "distributed", "cupy", "kvikio", "torch", "tqdm"]
EXIT_ERROR = 2


# -- info -------------------------------------------------------------------------------
@functools.cache
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # scans every installed package: once


def _version(module: str) -> str:
    """A package's version without importing it; ``"not installed"`` when absent."""
    try:
        dists = _distributions().get(module) or [module]
        return importlib.metadata.version(dists[0])
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device_info(device: Device) -> dict[str, Any]:
    row: dict[str, Any] = {"name": device.name}
    try:
        row["free_bytes"], row["total_bytes"] = device.memory()
        if device.is_gpu:
            import cupy

            props = cupy.cuda.runtime.getDeviceProperties(device.index)
            row["model"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception as e:  # a broken driver shows as a reason, not a crash
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def _gds_status(device: Device) -> dict[str, Any]:
    """Whether reads onto ``device`` go through GPUDirect Storage, and why not."""
    if not device.is_gpu:
        return {"active": False, "mode": None,
                "reason": f"no GPU: {gpu_unavailable_reason() or 'device is cpu'}"}
    from gpulazy.io import backend_class, get_backend

    try:
        ok, why = backend_class("kvikio").availability(device)
    except Exception as e:
        ok, why = False, f"{type(e).__name__}: {e}"
    if not ok:
        return {"active": False, "mode": None, "reason": f"KvikIO not usable: {why}"}
    why = f"{why}; {backend_class('kvikio').gds_details()}"  # opens the cuFile driver: here only
    try:
        mode = get_backend("kvikio", device).mode
    except Exception as e:
        return {"active": False, "mode": None, "reason": f"KvikIO failed to start: {type(e).__name__}: {e}"}
    if mode.startswith("gds"):  # "gds", or "gds+compat" when some reads fell back
        return {"active": True, "mode": mode, "reason": f"cuFile/GPUDirect Storage in use, {mode} ({why})"}
    return {"active": False, "mode": mode, "reason": f"KvikIO {mode} mode: cuFile not usable ({why})"}


def collect_info(device: str | None = None) -> dict[str, Any]:
    """Everything ``gpulazy info`` shows, as a JSON-ready dict."""
    from gpulazy import __version__
    from gpulazy.io import select_backend

    n = gpu_count()
    dev = get_device(device)
    name, because = select_backend(dev)
    return {
        "gpulazy": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in PACKAGES},
        "gpu_count": n,
        "gpu_unavailable_reason": gpu_unavailable_reason(),
        "devices": [_device_info(Device("cpu"))] + [_device_info(Device("cuda", i)) for i in range(n)],
        "device": dev.name,
        "backend": {"name": name, "reason": because},
        "gds": _gds_status(dev),
        "config": {k: v for k, v in config.as_dict().items()},
    }


def _fmt_memory(row: dict[str, Any]) -> str:
    if "error" in row:
        return row["error"]
    model = f"{row['model']}, " if row.get("model") else ""
    return f"{model}{_bench._fmt_bytes(row['free_bytes'])} free of {_bench._fmt_bytes(row['total_bytes'])}"


def format_info(info: dict[str, Any]) -> str:
    lines = [f"gpulazy {info['gpulazy']} on Python {info['python']} ({info['platform']})", "packages:"]
    lines += [f"  {k:<12} {v}" for k, v in info["packages"].items()]
    lines.append("devices:")
    lines += [f"  {d['name']:<12} {_fmt_memory(d)}" for d in info["devices"]]
    if not info["gpu_count"]:
        lines.append(f"  (no GPU: {info['gpu_unavailable_reason']})")
    lines.append(f"default device: {info['device']}")
    lines.append(f"backend (auto): {info['backend']['name']} — {info['backend']['reason']}")
    gds = info["gds"]
    lines.append(f"GPUDirect Storage: {'active' if gds['active'] else 'not active'} — {gds['reason']}")
    lines.append("config (set with gpulazy.config.set(...) or GPULAZY_<KEY>):")
    lines += [f"  {k:<15} {v!r}" for k, v in info["config"].items()]
    return "\n".join(lines)


def describe_index(idx: Any, device: str | None = None) -> dict[str, Any]:
    """What ``gpulazy info PATH`` says about an indexed file: geometry, storage, codec, where it decodes."""
    from gpulazy.codecs import decoded_on

    dev = get_device(device)
    specs = list(idx.specs.values())
    codec = next((s.codec for s in specs if s.codec), None)
    missing = sum(t.range is None for s in specs for t in s.tiles)
    ids = "+".join(c.id for c in codec or ())
    stored_shape = idx.attrs.get("stored_chunks")
    return {"paths": list(idx.paths), "layout": idx.layout, "shape": list(idx.shape), "dtype": str(idx.dtype),
            "chunks": [c[0] if c else 0 for c in idx.chunks], "dask_chunks": len(specs),
            "stored_chunk_shape": stored_shape, "stored_chunks": stored_count(idx) - missing,
            "missing_chunks": missing, "codec": str(idx.attrs.get("codec") or ids or "none"),
            "decodes_on": decoded_on(codec, dev), "device": dev.name, **_physical(idx.attrs)}


def stored_count(idx: Any) -> int:
    """How many pieces the format stores: the stored-chunk grid over the whole array.

    Counted from the grid, not from the dask specs: uncompressed TIFF pages read as plain
    byte runs carry no per-piece tiles, so counting specs gave the dask chunk count
    (a 256-page file showed "2 stored chunks"). Formats without a chunk grid (raw,
    ``.npy``) store one contiguous block per file.
    """
    stored = idx.attrs.get("stored_chunks")
    if not stored:
        return len(idx.paths) or 1
    stored = (1,) * (len(idx.shape) - len(stored)) + tuple(stored)  # stacked files: one per file on axis 0
    return math.prod(-(-n // max(1, s)) for n, s in zip(idx.shape, stored))


def _physical(attrs: Any) -> dict[str, Any]:
    """Axis names, physical scale, units and translation, as the format states them (OME, ImageJ, sidecar)."""
    return {k: list(attrs[k]) for k in ("axes", "scale", "units", "translation") if attrs.get(k) is not None}


def describe_levels(levels: Sequence[Any], device: str | None = None) -> dict[str, Any]:
    """``describe_index`` of the full-resolution level, with every pyramid level's shape and scale."""
    d = describe_index(levels[0], device)
    if len(levels) > 1:
        d["levels"] = [{"shape": list(lv.shape), "chunks": [c[0] if c else 0 for c in lv.chunks],
                        **{k: v for k, v in _physical(lv.attrs).items() if k == "scale"}} for lv in levels]
    return d


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _fmt_axes(d: dict[str, Any]) -> str | None:
    if not d.get("axes") and not d.get("scale"):
        return None
    parts = [f"axes: {', '.join(map(str, d['axes']))}"] if d.get("axes") else []
    if d.get("scale"):
        units = [u for u in d.get("units") or () if u]
        unit = f" ({', '.join(dict.fromkeys(units))})" if units else ""
        parts.append(f"scale: {tuple(d['scale'])}{unit}")
    if d.get("translation") and any(d["translation"]):
        parts.append(f"translation: {tuple(d['translation'])}")
    return "  ".join(parts)


def format_description(d: dict[str, Any]) -> str:
    where = {"gpu": f"decodes on the GPU ({d['device']})", "none": "stored as is, nothing to decode",
             "host": f"decodes on the host, then copied to {d['device']}" if d["device"] != "cpu"
             else "decodes on the host"}[d["decodes_on"]]
    first = d["paths"][0] if d["paths"] else "?"
    more = f" (+{len(d['paths']) - 1} more files)" if len(d["paths"]) > 1 else ""
    if d["stored_chunk_shape"]:
        stored = f"{_plural(d['stored_chunks'], 'stored chunk')} of {tuple(d['stored_chunk_shape'])}"
    else:
        stored = f"stored contiguously, {_plural(d['stored_chunks'], 'file')}"
    if d["missing_chunks"]:
        stored += f", {d['missing_chunks']} missing (read as the fill value)"
    lines = [f"{first}{more}", f"layout: {d['layout']}", f"shape: {tuple(d['shape'])}  dtype: {d['dtype']}"]
    lines += [x for x in (_fmt_axes(d),) if x]
    lines += [f"chunks: {tuple(d['chunks'])} ({_plural(d['dask_chunks'], 'dask chunk')}); {stored}",
              f"codec: {d['codec']}; {where}"]
    for i, lv in enumerate(d.get("levels") or ()):
        scale = f"  scale {tuple(lv['scale'])}" if lv.get("scale") else ""
        lines.append(f"{'levels:' if i == 0 else '':<8}{i}: {tuple(lv['shape'])}  chunks {tuple(lv['chunks'])}{scale}")
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    if getattr(args, "path", None):
        from gpulazy import layouts

        opts = {"dataset": args.dataset} if getattr(args, "dataset", None) else {}
        d = describe_levels(layouts.levels(args.path, **opts), args.device)
        print(json.dumps(d, indent=2, default=str) if args.json else format_description(d))
        return 0
    if getattr(args, "dataset", None):
        raise ValueError(f"--dataset {args.dataset!r} names a dataset inside a file: give the file too "
                         "(gpulazy info PATH --dataset NAME)")
    info = collect_info(args.device)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(format_info(info))
    return 0


# -- bench ------------------------------------------------------------------------------
def _datasets(args: argparse.Namespace, folder: str) -> list[_bench.Dataset]:
    if args.path:
        return [_bench.open_path(args.path)]
    size = config.parse_bytes(args.generate)
    files = args.files or max(1, size // (16 << 20))
    out = [_bench.generate(os.path.join(folder, "one"), size, 1)]
    if files > 1:
        out.append(_bench.generate(os.path.join(folder, "many"), size, files))
    return out


def _bench_dir(args: argparse.Namespace) -> str:
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        return tempfile.mkdtemp(prefix="gpulazy-bench-", dir=args.dir)
    return tempfile.mkdtemp(prefix="gpulazy-bench-")


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the side-by-side benchmark the arguments describe; returns the JSON document."""
    dev = get_device(args.device)
    modes = [m for m, on in (("warm", args.warm), ("cold", args.cold)) if on] or ["warm", "cold"]
    methods = args.methods.split(",") if args.methods else None
    for m in methods or ():
        if m not in _bench.METHODS:
            raise ValueError(f"unknown method {m!r}; valid: {', '.join(_bench.METHODS)}")
    folder = _bench_dir(args) if not args.path else ""
    try:
        datasets = _datasets(args, folder)
        fs = _bench.filesystem_type(datasets[0].paths[0])
        notes = []
        if fs == "tmpfs" and "cold" in modes:
            notes.append("the files are on tmpfs: cold runs cannot drop them from memory")
        rows = _bench.run_suite(datasets, dev, modes=modes, methods=methods, repeat=args.repeat)
    finally:
        if folder and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    if folder and args.keep:
        notes.append(f"kept the generated files in {folder}")
    return {"device": dev.name, "filesystem": fs, "notes": notes, "repeat": args.repeat,
            "datasets": [ds.describe() for ds in datasets], "results": rows,
            "ratios": _bench.ratios(rows), "info": collect_info(dev.name)}


def cmd_bench(args: argparse.Namespace) -> int:
    doc = run_bench(args)
    print(_bench.format_table(doc["results"]))
    for note in doc["notes"]:
        print(f"note: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2, default=str)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {_bench.plot_results(doc['results'], args.plot)}")
    return 0


# -- demo -------------------------------------------------------------------------------
def _slice_side(size: int) -> int:
    # 2048 × 2048 uint16 slices (8 MiB), smaller for small volumes so there are >= 16.
    side = 2048
    while side > 64 and size // (side * side * 2) < 16:
        side //= 2
    return side


def write_volume(folder: str, size: int, show_progress: bool = True) -> tuple[list[str], int, np.ndarray]:
    """Write raw uint16 slices totalling about ``size`` bytes.

    Slice ``i`` is a fixed random image plus ``(3 * i) % 60000``, so the maximum-intensity
    projection is known without reading the files back. Returns (paths, side, expected MIP).
    """
    side = _slice_side(size)
    count = max(1, size // (side * side * 2))
    base = np.random.default_rng(0).integers(0, 4096, size=(side, side), dtype=np.uint16)
    buf = np.empty_like(base)
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"slice_{i:05d}.raw") for i in range(count)]
    for i, p in enumerate(_bench.progress(paths, desc="writing slices", unit="slice", enabled=show_progress)):
        np.add(base, (3 * i) % 60000, out=buf)
        buf.tofile(p)
    top = max((3 * i) % 60000 for i in range(count))
    return paths, side, base + np.uint16(top)


def compute_with_progress(arr: Any, desc: str) -> Any:
    """``arr.compute()`` with a terminal progress bar (gpulazy.widgets.ProgressBar when available)."""
    try:
        from gpulazy.widgets import ProgressBar
    except Exception:  # widgets not there: a tqdm bar over dask's tasks
        ProgressBar = None  # noqa: N806
    if ProgressBar is not None:
        try:
            bar = ProgressBar(terminal=True)
        except TypeError:
            bar = None
        if bar is not None:
            return arr.compute(callbacks=[bar])
    return arr.compute(callbacks=[_TqdmCallback(desc)])


def _TqdmCallback(desc: str) -> Any:  # noqa: N802 - a class built lazily (dask.callbacks)
    from dask.callbacks import Callback

    class TqdmCallback(Callback):
        def _start_state(self, dsk: Any, state: Any) -> None:
            self._bar = _bench.progress(total=sum(len(state[k]) for k in ("ready", "waiting", "running")),
                                        desc=desc, unit="task")

        def _posttask(self, key: Any, result: Any, dsk: Any, state: Any, worker_id: Any) -> None:
            self._bar.update(1)

        def _finish(self, dsk: Any, state: Any, errored: bool) -> None:
            self._bar.close()

    return TqdmCallback()


def _read_path_summary() -> str:
    import gpulazy

    snap = gpulazy.stats().snapshot()
    parts = [f"{b} ({', '.join(f'{m}' for m in t.get('modes', {}))})" if isinstance(t, dict) and t.get("modes")
             else str(b) for b, t in snap.get("by_backend", {}).items()]
    return ", ".join(parts) or str(snap.get("last_backend"))


def _timed_read(vol: Any, dev: Any) -> tuple[float, int]:
    """Seconds for ``vol.compute()`` (synchronised) and the bytes it produced."""
    t0 = time.perf_counter()
    data = vol.compute()
    dev.wait_all()
    seconds = time.perf_counter() - t0
    return seconds, int(data.nbytes)


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    import gpulazy

    dev = get_device(args.device)
    size = config.parse_bytes(args.size)
    folder = tempfile.mkdtemp(prefix="gpulazy-demo-", dir=args.dir)
    try:
        t0 = time.perf_counter()
        paths, side, expected = write_volume(folder, size)
        write_s = time.perf_counter() - t0
        print(f"wrote {len(paths)} slices of {side}×{side} uint16 ({_bench._fmt_bytes(len(paths) * side * side * 2)}) "
              f"to {folder} in {write_s:.1f} s")
        vol = gpulazy.from_files(paths, shape=(side, side), dtype="uint16", device=dev.name)
        print(f"lazy array: shape {vol.shape}, dtype {vol.dtype}, {vol.npartitions} chunks, device {dev.name}")
        gpulazy.stats().reset()
        # The whole-array read is timed twice, without a progress bar: dask callbacks (a
        # bar among them) turn off compute()'s fast path, and the first read also pays
        # for starting CUDA and the I/O backend.
        first_s, nbytes = _timed_read(vol, dev)
        read_s, _ = _timed_read(vol, dev)
        t0 = time.perf_counter()
        mip = compute_with_progress(vol.max(axis=0), "max projection")
        dev.wait_all()
        mip_s = time.perf_counter() - t0
        mip_host = mip.get() if hasattr(mip, "get") and not isinstance(mip, np.ndarray) else np.asarray(mip)
        if not np.array_equal(mip_host, expected):
            raise AssertionError("the max-intensity projection differs from the generated volume's")
        result = {"device": dev.name, "bytes": nbytes, "files": len(paths), "slice_shape": [side, side],
                  "read_seconds": read_s, "read_gbps": nbytes / read_s / 1e9, "first_read_seconds": first_s,
                  "first_read_gbps": nbytes / first_s / 1e9, "mip_seconds": mip_s,
                  "backends": _read_path_summary(), "gds": _gds_status(dev)["reason"], "folder": folder}
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return result


def cmd_demo(args: argparse.Namespace) -> int:
    r = run_demo(args)
    print(f"read {_bench._fmt_bytes(r['bytes'])} onto {r['device']} in {r['read_seconds']:.2f} s: "
          f"{r['read_gbps']:.2f} GB/s (warm page cache; the first read, start-up included: "
          f"{r['first_read_seconds']:.2f} s, {r['first_read_gbps']:.2f} GB/s)")
    print(f"max-intensity projection {r['slice_shape'][0]}×{r['slice_shape'][1]} in {r['mip_seconds']:.2f} s "
          "(checked against the generated pattern)")
    print(f"backend: {r['backends']}; GPUDirect Storage: {r['gds']}")
    print(f"kept {r['folder']}" if args.keep else "removed the sample volume")
    return 0


# -- index ------------------------------------------------------------------------------
def cmd_index(args: argparse.Namespace) -> int:
    """Write the checksum manifest of ``PATH``: the one index there is, so no flag is needed.

    ``--checksum`` is still accepted (it was required before); without it the command
    used to stop with "nothing to do", which only made a newcomer type it twice.
    """
    from gpulazy.checksums import write_manifest

    block = config.parse_bytes(args.block_size)
    print(f"checksumming {args.path} in blocks of {args.block_size} (reads every byte once)")
    started = time.perf_counter()
    written = write_manifest(args.path, block_size=block)
    for m in written:
        print(f"wrote {m}")
    print(f"checksummed in {time.perf_counter() - started:.2f} s; read with from_files(..., verify=True)")
    return 0


# -- parser -----------------------------------------------------------------------------
def _gpulazy_version() -> str:
    from gpulazy import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpulazy", description="gpulazy: files read straight into GPU memory "
                                "as lazy Dask arrays. Errors exit with status 2.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.add_argument("--version", action="version", version=f"gpulazy {_gpulazy_version()}")
    # --debug is accepted after the sub-command too; SUPPRESS keeps it from resetting the flag.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True, metavar="{info,bench,demo,index}")

    info = sub.add_parser("info", parents=[common], help="versions, devices, backend and GDS status, config; "
                          "or, given a PATH, what that file holds and whether it decodes on the GPU")
    info.add_argument("path", nargs="?", help="a file, folder or store to describe (layout, shape, dtype, chunks, "
                      "codec, where it decodes)")
    info.add_argument("--dataset", metavar="NAME", help="the dataset of an HDF5 file holding several "
                      "(e.g. entry/data; an error without it lists them)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--device", help="device to report on (default: a GPU if usable, else cpu)")
    info.set_defaults(func=cmd_info)

    bench = sub.add_parser("bench", parents=[common],
                           help="gpulazy against the naive ways of reading files, side by side")
    src = bench.add_mutually_exclusive_group()
    src.add_argument("path", nargs="?", help="a file, or a folder of equally sized files, to read")
    src.add_argument("--generate", metavar="SIZE", help="write SIZE of data (one file and N slice files) "
                     "and read that (default: 4GiB on a GPU, 1GiB on cpu)")
    bench.add_argument("--files", type=int, help="number of slice files for --generate (default SIZE/16MiB)")
    bench.add_argument("--warm", action="store_true", help="only warm page-cache runs")
    bench.add_argument("--cold", action="store_true", help="only cold runs (page cache dropped before each)")
    bench.add_argument("--repeat", type=int, default=3, help="timed runs per method (best is reported)")
    bench.add_argument("--methods", help=f"comma-separated subset of: {', '.join(_bench.METHODS)}")
    bench.add_argument("--device", help="'cpu' or 'cuda:N' (default: a GPU if usable, else cpu)")
    bench.add_argument("--dir", help="where --generate writes (default: a temporary folder)")
    bench.add_argument("--keep", action="store_true", help="keep the generated files")
    bench.add_argument("--json", metavar="FILE", help="write the results as JSON")
    bench.add_argument("--plot", metavar="PNG", help="save a bar chart of the results (matplotlib)")
    bench.set_defaults(func=cmd_bench)

    demo = sub.add_parser("demo", parents=[common],
                          help="read a generated volume onto the device and project it")
    demo.add_argument("--size", default="2GiB", help="volume size (default 2GiB)")
    demo.add_argument("--device", help="'cpu' or 'cuda:N' (default: a GPU if usable, else cpu)")
    demo.add_argument("--dir", help="where to write the volume (default: a temporary folder)")
    demo.add_argument("--keep", action="store_true", help="keep the generated volume")
    demo.set_defaults(func=cmd_demo)

    index = sub.add_parser("index", parents=[common], help="write the checksum manifest of files (an XXH3-128 "
                           "hash per block), which from_files(..., verify=True) checks every read against")
    index.add_argument("path", help="a file, a glob, or a folder (every file under it)")
    index.add_argument("--checksum", action="store_true", help="(the default, kept for old scripts) write "
                       ".gpulazy-checksums.json next to the files")
    index.add_argument("--block-size", default="256KiB", help="bytes per hash (default 256KiB)")
    index.set_defaults(func=cmd_index)
    return p


def _check_args(args: argparse.Namespace) -> None:
    if args.command == "bench":
        if args.repeat < 1:
            raise ValueError(f"--repeat must be at least 1, got {args.repeat}")
        if args.files is not None and args.files < 1:
            raise ValueError(f"--files must be at least 1, got {args.files}")
        if args.path and not os.path.exists(args.path):
            raise FileNotFoundError(f"no such file or folder: {args.path!r}")
        if not args.path and not args.generate:
            args.generate = "4GiB" if get_device(args.device).is_gpu else "1GiB"
        # Everything a run needs at its end is checked before it starts (it can take minutes).
        if args.plot:
            from gpulazy.convert import _require

            _require("matplotlib", "notebook", "gpulazy bench --plot")
        for flag, out in (("--plot", args.plot), ("--json", args.json)):
            _check_writable(flag, out)


def _check_writable(flag: str, path: str | None) -> None:
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{flag} {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"{flag} {path!r}: the folder {folder!r} is not writable")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 error, 130 interrupted)."""
    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("gpulazy: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"gpulazy {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
