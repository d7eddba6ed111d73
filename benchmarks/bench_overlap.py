"""Every compute path at the raw-read rate (issue 10): derived computes, callbacks, cache, overlap.

Writes ``--planes`` files of ``--mib`` MiB (uint16 planes) and one big file holding the
same bytes, then times, each beside its naive and raw equivalents in the same run:

- the pinned host->device copy ceiling (GPU);
- one big file and the many plane files, ``from_files(...).compute()``, and the planes' ``persist()``
  (beside dask's own ``dask.persist``);
- a maximum-intensity projection ``planes.max(axis=0)``, its depth map ``planes.argmax(axis=0)``, a slice ``planes[:half]`` (on chunk
  boundaries: the fast path), one off them ``planes[1:half + 1]``, every fourth plane as a list (and the MIP of
  every fourth plane, as a step and as a list), ``big.astype("f8").sum()``
  and ``planes.mean()``; with ``--read-ahead 0,1GiB,4GiB`` (and/or ``--batch-size LIST``) these
  derived rows again under each ``gpulazy.config.set(read_ahead=...)`` (``batch_size=...``);
- the whole read, the MIP and ``map_blocks(b * 2)`` with a callback active (gpulazy's and dask's
  ``ProgressBar`` and a user's no-op ``Callback``), as a ratio to the same compute without it;
- a second MIP over data held in a ``DeviceCache`` against re-reading it;
- read + per-chunk compute with ``gpulazy.prefetch`` (``bench_prefetch.run``), for a
  GPU-bound (``matmul``) and a launch-bound (``launch``) compute, sync and threaded.

"raw" is KvikIO's ``CuFile.pread`` of every file into one preallocated buffer, all in
flight (on ``cpu``: ``np.fromfile`` into a buffer), followed by the same xp operation;
"naive" is ``dask.array`` over ``np.memmap`` with ``map_blocks(xp.asarray)``.
Rates are GB/s of file bytes; best of ``--repeat``. Every row also shows its rate over the
whole-array ``compute()`` of the same files ("x whole"; issue 20: >= 0.9) and over raw KvikIO +
the same op ("x raw").

    python benchmarks/bench_overlap.py                  # GPU if any: 256 x 16 MiB
    python benchmarks/bench_overlap.py --device cpu     # small CPU mode: 16 x 1 MiB
    python benchmarks/bench_overlap.py --json out.json
    python benchmarks/bench_overlap.py --no-overlap --read-ahead 0,1GiB,4GiB    # a read-ahead sweep
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _best(fn: Callable[[], Any], repeat: int, sync: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        del out
    return best


def _write(directory: str, planes: int, shape: tuple[int, int]) -> tuple[list[str], str]:
    rng = np.random.default_rng(0)
    plane = rng.integers(0, 4096, shape, dtype=np.uint16)
    paths = []
    big = os.path.join(directory, "big.raw")
    with open(big, "wb") as fb:
        for i in range(planes):
            data = plane + np.uint16(i)  # planes differ, so a wrong plane order shows in the MIP
            p = os.path.join(directory, f"z{i:05d}.raw")
            data.tofile(p)
            data.tofile(fb)
            paths.append(p)
    return paths, big


def _raw_reader(dev: Any, xp: Any) -> Callable[[list[str], int], Any]:
    """Read whole files into one preallocated buffer, all in flight: KvikIO, or np.fromfile on CPU."""
    if not dev.is_gpu:
        def read(paths: list[str], nbytes: int) -> Any:
            out = np.empty(nbytes * len(paths), np.uint8)
            for i, p in enumerate(paths):
                with open(p, "rb") as f:
                    f.readinto(memoryview(out)[i * nbytes:(i + 1) * nbytes])
            return out
        return read
    import kvikio

    def read(paths: list[str], nbytes: int) -> Any:
        out = xp.empty(nbytes * len(paths), np.uint8)
        files = [kvikio.CuFile(p, "r") for p in paths]
        futs = [f.pread(out[i * nbytes:(i + 1) * nbytes]) for i, f in enumerate(files)]
        for fu in futs:
            fu.get()
        for f in files:
            f.close()
        return out
    return read


def _naive(paths: list[str], shape: tuple[int, int], xp: Any) -> Any:
    import dask.array as da

    stack = [da.from_array(np.memmap(p, np.uint16, "r", shape=shape), chunks=shape) for p in paths]
    return da.stack(stack).map_blocks(xp.asarray, dtype=np.uint16)


def _with_config(fn: Callable, **kv: Any) -> Callable:
    """``fn`` run under ``gpulazy.config.set(**kv)``."""
    import gpulazy

    def run() -> Any:
        with gpulazy.config.set(**kv):
            return fn()
    return run


def _ratios(r: dict[str, float], whole: dict[str, float] | None, raw: float | None = None) -> dict[str, float]:
    """``r`` with its rate over the whole-array compute of the same files (``x_whole``) and over raw
    KvikIO + the same op (``x_raw``; ``raw`` when the row itself measured no raw way)."""
    if whole is not None:
        r["x_whole"] = r["gpulazy"] / whole["gpulazy"]
    raw = r.get("raw", raw)
    if raw:
        r["x_raw"] = r["gpulazy"] / raw
    return r


def _agree(xp: Any, ours: Any, ref: Any) -> bool:
    """gpulazy's result equals the raw way's (integers byte for byte; float sums of integers below
    2**53 are exact, a mean is rounded once), compared where both live."""
    if hasattr(ours, "__dask_graph__"):  # a persisted array: its blocks put together
        ours = ours.compute()
    a, b = xp.asarray(ours), xp.asarray(ref)
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        return a.shape == b.shape and bool(xp.allclose(a, b, rtol=1e-12, atol=0))
    return a.nbytes == b.nbytes and bool((a.reshape(-1).view(xp.uint8) == b.reshape(-1).view(xp.uint8)).all())


def _derived_rows(vol: Any, big: Any, naive: Any, rawv: Callable, raw: Callable, paths: list[str], plane_bytes: int,
                  total: int, pair: tuple[Any, Any], quarters: tuple[Any, ...], xp: Any
                  ) -> dict[str, tuple[Callable, Callable, Callable, int, str]]:
    """The issue-20 rows: name -> (gpulazy, raw KvikIO + the same op, naive dask, source bytes, whole row)."""
    import dask

    half, q = len(paths) // 2, len(paths) // 4
    every4 = list(range(0, len(paths), 4))  # a list of planes: a box each, all read in one pass
    a, b = pair

    def raw_pair() -> Any:
        planes = rawv()
        return (planes[:half] - planes[half:2 * half]).max(axis=0)

    def raw_quarters() -> Any:
        planes = rawv()
        return (planes[:q] + planes[q:2 * q] + planes[2 * q:3 * q] + planes[3 * q:4 * q]).max(axis=0)

    def naive_quarters() -> Any:
        parts = [naive[k * q:(k + 1) * q] for k in range(4)]
        return (parts[0] + parts[1] + parts[2] + parts[3]).max(axis=0).compute()

    return {
        "MIP max(axis=0)": (lambda: vol.max(axis=0).compute(), lambda: rawv().max(axis=0),
                            lambda: naive.max(axis=0).compute(), total, "planes compute()"),
        # Two reductions computed together: one read folds each chunk into both (``share_reads``).
        "dask.compute(min(), max())": (lambda: xp.stack(dask.compute(vol.min(), vol.max())),
                                       lambda: (lambda planes: xp.stack([planes.min(), planes.max()]))(rawv()),
                                       lambda: xp.stack(dask.compute(naive.min(), naive.max())), total,
                                       "planes compute()"),
        # An intensity histogram (NumPy's function of the array): each chunk's counts added up as it lands.
        "np.histogram(bins=256)": (lambda: np.histogram(vol, bins=256, range=(0, 65536))[0].compute(),
                                   lambda: xp.histogram(rawv(), bins=256, range=(0, 65536))[0],
                                   lambda: np.histogram(naive, bins=256, range=(0, 65536))[0].compute(), total,
                                   "planes compute()"),
        # A depth map: the index of each pixel's brightest plane, streamed as the MIP is.
        "argmax(axis=0)": (lambda: vol.argmax(axis=0).compute(), lambda: rawv().argmax(axis=0),
                           lambda: naive.argmax(axis=0).compute(), total, "planes compute()"),
        # Off chunk boundaries: dask slices batched reads (on them, a slice takes the fast path).
        "[1:half+1] compute()": (lambda: vol[1:half + 1].compute(), lambda: raw(paths[1:half + 1], plane_bytes),
                                 lambda: naive[1:half + 1].compute(), half * plane_bytes, "planes compute()"),
        "[every 4th plane as a list] compute()": (lambda: vol[every4].compute(),
                                                  lambda: raw([paths[i] for i in every4], plane_bytes),
                                                  lambda: naive[every4].compute(), len(every4) * plane_bytes,
                                                  "planes compute()"),
        # What is computed from every fourth plane, as a step or as a list: a streamed map of the planes'
        # parts of their chunks (``ChunkSpec.leading`` with a step), those planes alone read.
        "[::4].max(axis=0)": (lambda: vol[::4].max(axis=0).compute(),
                              lambda: _planes_of(raw, [paths[i] for i in every4], plane_bytes, vol).max(axis=0),
                              lambda: naive[::4].max(axis=0).compute(), len(every4) * plane_bytes,
                              "planes compute()"),
        "[every 4th plane as a list].max(axis=0)": (
            lambda: vol[every4].max(axis=0).compute(),
            lambda: _planes_of(raw, [paths[i] for i in every4], plane_bytes, vol).max(axis=0),
            lambda: naive[every4].max(axis=0).compute(), len(every4) * plane_bytes, "planes compute()"),
        "astype(f8).sum()": (lambda: big.astype("f8").sum().compute(), lambda: rawv().astype("f8").sum(),
                             lambda: naive.astype("f8").sum().compute(), total, "one file compute()"),
        "mean()": (lambda: vol.mean().compute(), lambda: rawv().mean(), lambda: naive.mean().compute(), total,
                   "planes compute()"),
        # Each chunk mapped as its read lands (``gpulazy.read.mapped``), into one result.
        "map_blocks(b * 2)": (lambda: vol.map_blocks(_twice, dtype=vol.dtype).compute(), lambda: _twice(rawv()),
                              lambda: naive.map_blocks(_twice, dtype=naive.dtype).compute(), total,
                              "planes compute()"),
        # Elementwise with a scalar: a streamed map (``vol * 2`` is ``map_blocks(b * 2)`` for gpulazy).
        "(vol * 2).max(axis=0)": (lambda: (vol * 2).max(axis=0).compute(), lambda: _twice(rawv()).max(axis=0),
                                  lambda: (naive * 2).max(axis=0).compute(), total, "planes compute()"),
        # A reduction of a map: the map's function folded into the streamed reduction's chain.
        "map_blocks(b * 2).max(axis=0)": (lambda: vol.map_blocks(_twice, dtype=vol.dtype).max(axis=0).compute(),
                                          lambda: _twice(rawv()).max(axis=0),
                                          lambda: naive.map_blocks(_twice, dtype=naive.dtype).max(axis=0).compute(),
                                          total, "planes compute()"),
        # Two arrays (the first and second half of the files): both read in one streamed pass, each
        # block's difference made once both its chunks have landed (``gpulazy.read.pairs``).
        "(a - b).max(axis=0), two arrays": (lambda: (a - b).max(axis=0).compute(), raw_pair,
                                            lambda: (naive[:half] - naive[half:2 * half]).max(axis=0).compute(),
                                            2 * half * plane_bytes, "planes compute()"),
        # Four arrays (the files' quarters): all read in one streamed pass, a block of four chunks.
        "(a + b + c + d).max(axis=0), four arrays": (
            lambda: (quarters[0] + quarters[1] + quarters[2] + quarters[3]).max(axis=0).compute(), raw_quarters,
            naive_quarters, 4 * q * plane_bytes, "planes compute()"),
    }


def _planes_of(raw: Callable, paths: list[str], plane_bytes: int, vol: Any) -> Any:
    """The planes of ``paths`` read by raw KvikIO, as an array of ``vol``'s planes."""
    return raw(paths, plane_bytes).view(np.uint16).reshape(len(paths), *vol.shape[1:])


def _twice(block: Any) -> Any:
    return block * 2


def measure_paths(*, device: str, planes: int, mib: float, repeat: int, directory: str | None,
                  sweeps: dict[str, list[str]] | None = None) -> dict[str, Any]:
    import dask
    import dask.array as da
    from dask.callbacks import Callback
    from dask.diagnostics import ProgressBar as DaskProgressBar

    import gpulazy
    from gpulazy.cache import DeviceCache
    from gpulazy.device import get_device

    dev = get_device(device)
    xp = dev.xp
    cols = 1024
    rows = max(1, int(mib * (1 << 20)) // (cols * 2))
    shape = (rows, cols)
    plane_bytes = rows * cols * 2
    total = plane_bytes * planes
    tmp = tempfile.TemporaryDirectory(dir=directory)

    def sync() -> None:
        if dev.is_gpu:
            xp.cuda.Device(dev.index).synchronize()

    def gbps(seconds: float, nbytes: int = total) -> float:
        return nbytes / seconds / 1e9

    rows_out: dict[str, dict[str, float]] = {}
    sweeps = sweeps or {}
    try:
        paths, big_path = _write(tmp.name, planes, shape)
        raw = _raw_reader(dev, xp)
        # No cache: every pass reads (cache=None would mean the default cache, resolved at compute time).
        big = gpulazy.from_files(big_path, shape=(planes, *shape), dtype="uint16", device=dev.name, cache=False)
        vol = gpulazy.from_files(paths, shape=shape, dtype="uint16", device=dev.name, cache=False)
        naive = _naive(paths, shape, xp)
        half = planes // 2

        def rawv() -> Any:
            return raw(paths, plane_bytes).view(np.uint16).reshape(planes, *shape)

        # Warm up: page cache, allocator pools, kernel compilation (CuPy compiles on first use).
        for fn in (lambda: vol.compute(), lambda: vol.max(axis=0).compute(), rawv,
                   lambda: rawv().max(axis=0), lambda: big.astype("f8").sum().compute(),
                   lambda: rawv().astype("f8").sum(), lambda: vol[:half].compute(), lambda: vol.mean().compute(),
                   lambda: rawv().mean()):
            fn()
            sync()

        if dev.is_gpu:
            host = xp.cuda.alloc_pinned_memory(total)
            buf = xp.empty(total, np.uint8)
            s = xp.cuda.Stream(non_blocking=True)

            def h2d() -> None:
                xp.cuda.runtime.memcpyAsync(buf.data.ptr, host.ptr, total, xp.cuda.runtime.memcpyHostToDevice, s.ptr)
                s.synchronize()
            rows_out["pinned h2d ceiling"] = {"gpulazy": gbps(_best(h2d, repeat, sync))}
            del host, buf

        def row(name: str, ours: Callable, raw_fn: Callable | None, naive_fn: Callable | None, nbytes: int = total,
                whole: str | None = "planes compute()") -> None:
            r: dict[str, Any] = {"gpulazy": gbps(_best(ours, repeat, sync), nbytes)}
            if raw_fn is not None:
                r["raw"] = gbps(_best(raw_fn, repeat, sync), nbytes)
                r["correct"] = _agree(xp, ours(), raw_fn())
            if naive_fn is not None:
                r["naive"] = gbps(_best(naive_fn, 1, sync), nbytes)
            rows_out[name] = _ratios(r, rows_out.get(whole or name))
            gc.collect()

        row("one file compute()", lambda: big.compute(), lambda: raw([big_path], total), None, whole=None)
        row("planes compute()", lambda: vol.compute(), rawv, lambda: naive.compute(), whole=None)
        # persist(): the same read, held as dask's blocks (views of the result); dask's own, a task a chunk.
        row("planes persist()", lambda: vol.persist(), rawv, lambda: naive.persist())
        rows_out["planes persist(), dask.persist (a task a chunk)"] = _ratios(
            {"gpulazy": gbps(_best(lambda: dask.persist(vol)[0], repeat, sync))}, rows_out["planes compute()"],
            rows_out["planes persist()"].get("raw"))
        pair = tuple(gpulazy.from_files(part, shape=shape, dtype="uint16", device=dev.name, cache=False)
                     for part in (paths[:half], paths[half:2 * half]))
        quarter = len(paths) // 4
        quarters = tuple(gpulazy.from_files(paths[k * quarter:(k + 1) * quarter], shape=shape, dtype="uint16",
                                            device=dev.name, cache=False) for k in range(4))
        derived = _derived_rows(vol, big, naive, rawv, raw, paths, plane_bytes, total, pair, quarters, xp)
        for name, (ours, raw_fn, naive_fn, nbytes, whole) in derived.items():
            row(name, ours, raw_fn, naive_fn, nbytes, whole)
        row("[:half] compute()", lambda: vol[:half].compute(),
            lambda: raw(paths[:half], plane_bytes), lambda: naive[:half].compute(), nbytes=half * plane_bytes)
        # The derived rows again under each read-ahead (and batch size) asked for: one run sweeps them.
        for key, values in sweeps.items():
            for value in values:
                for name, (ours, raw_fn, _, nbytes, whole) in derived.items():
                    under = _with_config(ours, **{key: value})
                    r = {"gpulazy": gbps(_best(under, repeat, sync), nbytes), "correct": _agree(xp, under(), raw_fn())}
                    rows_out[f"{name} {key}={value}"] = _ratios(r, rows_out[whole], rows_out[name].get("raw"))
                    gc.collect()
        # Ablations: the reductions through dask's per-chunk tree (batched reads, the read window),
        # as before they streamed, and the MIP that way without staging.
        with_config = _with_config
        for name in ("MIP max(axis=0)", "argmax(axis=0)", "astype(f8).sum()", "mean()"):
            ours, _, _, nbytes, whole = derived[name]
            rows_out[f"{name}, fused_reductions=False (dask's tree)"] = _ratios({
                "gpulazy": gbps(_best(with_config(ours, fused_reductions=False), repeat, sync), nbytes)},
                rows_out[whole], rows_out[name].get("raw"))
        for name in ("map_blocks(b * 2)", "map_blocks(b * 2).max(axis=0)", "(vol * 2).max(axis=0)",
                     "(a - b).max(axis=0), two arrays", "(a + b + c + d).max(axis=0), four arrays"):
            ours, _, _, nbytes, whole = derived[name]
            rows_out[f"{name}, streamed_maps=False (dask's tasks)"] = _ratios({
                "gpulazy": gbps(_best(with_config(ours, streamed_maps=False), repeat, sync), nbytes)},
                rows_out[whole], rows_out[name].get("raw"))
        rows_out["MIP, dask's tree, staging=never (KvikIO's streams)"] = _ratios({
            "gpulazy": gbps(_best(with_config(lambda: vol.max(axis=0).compute(), fused_reductions=False,
                                              staging="never"), repeat, sync))},
            rows_out["planes compute()"], rows_out["MIP max(axis=0)"]["raw"])
        rows_out["one file compute()"]["naive"] = gbps(
            _best(lambda: xp.asarray(np.fromfile(big_path, np.uint8)), 1, sync))

        # Callbacks: the same compute with and without one active.
        class Noop(Callback):
            def _posttask(self, key, result, dsk, state, worker_id):
                pass

        from gpulazy.widgets import ProgressBar

        # (dask's own ProgressBar joins its 0.1 s refresh thread at the end of every compute.)
        for name, make in (("gpulazy ProgressBar", lambda: ProgressBar(terminal=True, file=io.StringIO())),
                           ("dask ProgressBar", lambda: DaskProgressBar(out=io.StringIO())),
                           ("user Callback", Noop)):
            for what, fn in (("planes compute()", lambda: vol.compute()),
                             ("MIP max(axis=0)", lambda: vol.max(axis=0).compute()),
                             ("map_blocks(b * 2)", lambda: vol.map_blocks(_twice, dtype=vol.dtype).compute())):
                def with_cb(fn=fn, make=make):
                    with make():
                        return fn()
                t_with = _best(with_cb, repeat, sync)
                t_without = _best(fn, repeat, sync)
                rows_out[f"{what} + {name}"] = {"gpulazy": gbps(t_with), "without": gbps(t_without),
                                                "ratio": t_without / t_with}

        # Recompute from a warm device cache against re-reading from the page cache.
        cache = DeviceCache(int(total * 1.5), device=dev, name=f"bench-overlap-{os.getpid()}")
        try:
            cached = gpulazy.from_files(paths, shape=shape, dtype="uint16", device=dev.name, cache=cache)
            t_first = _best(lambda: cached.max(axis=0).compute(), 1, sync)
            t_again = _best(lambda: cached.max(axis=0).compute(), repeat, sync)
            t_reread = _best(lambda: vol.max(axis=0).compute(), repeat, sync)
            # Dask's own floor: the same MIP over a dask array of the same chunks already in
            # device memory (no gpulazy, no reads): what any recompute through dask can reach.
            held = da.from_array(rawv(), chunks=(1, *shape), asarray=False)
            t_floor = _best(lambda: held.max(axis=0).compute(), repeat, sync)
            rows_out["MIP again from DeviceCache"] = _ratios({
                "gpulazy": gbps(t_again), "first": gbps(t_first), "reread": gbps(t_reread),
                "x_reread": t_reread / t_again, "bytes_held": cache.bytes_held,
                "dask_in_memory": gbps(t_floor), "x_reread_floor": t_reread / t_floor},
                rows_out["planes compute()"], rows_out["MIP max(axis=0)"]["raw"])
            del held
        finally:
            cache.close()
        del big, vol, naive
        gc.collect()
    finally:
        tmp.cleanup()
    return {"device": dev.name, "planes": planes, "plane_bytes": plane_bytes, "total_bytes": total,
            "dask": dask.__version__, "rows": rows_out}


def measure_overlap(*, device: str, repeat: int, computes: list[str], schedulers: list[str],
                    chunks: int, chunk_mib: float) -> dict[str, Any]:
    sys.path.insert(0, HERE)
    import bench_prefetch

    out = {}
    for compute in computes:
        for scheduler in schedulers:
            r = bench_prefetch.run(device=device, chunks=chunks, chunk_mib=chunk_mib, depth=8, compute=compute,
                                   scheduler=scheduler, repeat=repeat)
            out[f"{compute}/{scheduler}"] = {k: r[k] for k in (
                "seconds_read", "seconds_compute", "seconds_naive", "seconds_prefetch", "ratio", "ratio_naive",
                "ratio_best", "hit_rate", "compute_iters", "seconds_streamed", "seconds_read_streamed",
                "seconds_compute_loop", "ratio_streamed")}
    return out


def _cell(value: float | None, width: int) -> str:
    return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}}"


def table(result: dict[str, Any]) -> str:
    p = result["paths"]
    lines = [(f"bench_overlap: {p['device']}, {p['planes']} planes x {p['plane_bytes'] / 2**20:.1f} MiB "
              f"({p['total_bytes'] / 2**30:.2f} GiB), warm page cache, GB/s (best of {result['repeat']})"),
             "x whole: over the whole compute() of the same files; x raw: over raw KvikIO + the same op",
             f"{'path':<46}{'gpulazy':>9}{'raw':>9}{'naive':>9}{'x whole':>9}{'x raw':>7}  notes"]
    columns = ("gpulazy", "raw", "naive", "x_whole", "x_raw", "correct")
    for name, r in p["rows"].items():
        notes = ", ".join(f"{k} {v:.3g}" for k, v in r.items() if k not in columns)
        notes += "  VALUES DIFFER from the raw way" if r.get("correct") is False else ""
        lines.append(f"{name:<46}{r['gpulazy']:>9.2f}{_cell(r.get('raw'), 9)}{_cell(r.get('naive'), 9)}"
                     f"{_cell(r.get('x_whole'), 9)}{_cell(r.get('x_raw'), 7)}"
                     f"  {notes}")
    ov = result.get("overlap") or {}
    if ov:
        lines.append(f"{'read + compute, prefetch':<30}{'read s':>9}{'comp s':>9}{'naive x':>9}{'prefetch x':>11}"
                     f"{'hits':>7}{'streamed x':>11}   (x = wall / max(read, compute); target <= 1.15; streamed: "
                     f"the default map_blocks, over the faster read and compute of either way)")
        for name, r in ov.items():
            lines.append(f"{name:<30}{r['seconds_read']:>9.3f}{r['seconds_compute']:>9.3f}{r['ratio_naive']:>9.2f}"
                         f"{r['ratio']:>11.2f}{r['hit_rate']:>7.0%}{r['ratio_streamed']:>11.2f}")
    return "\n".join(lines)


def _byte_list(text: str, ap: argparse.ArgumentParser, flag: str) -> list[str]:
    """``"0,1GiB"`` as ``["0", "1GiB"]``, each checked to be a byte count now rather than mid-run."""
    from gpulazy.config import parse_bytes
    from gpulazy.errors import ConfigError

    values = [v.strip() for v in text.split(",") if v.strip()]
    for v in values:
        try:
            parse_bytes(v)
        except ConfigError as e:
            ap.error(f"{flag}: {e}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--planes", type=int, default=None, help="default 256 on a GPU, 16 on CPU")
    ap.add_argument("--mib", type=float, default=None, help="MiB per plane (default 16 on a GPU, 1 on CPU)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--no-overlap", action="store_true", help="leave out the read + compute rows")
    ap.add_argument("--computes", default=None, help="comma list of bench_prefetch compute kinds")
    ap.add_argument("--read-ahead", default=None, metavar="LIST",
                    help="repeat the derived rows under each gpulazy.config read_ahead, e.g. 0,1GiB,4GiB")
    ap.add_argument("--batch-size", default=None, metavar="LIST",
                    help="repeat the derived rows under each gpulazy.config batch_size, e.g. 256MiB,1GiB")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    sweeps = {key: _byte_list(text, ap, flag) for key, text, flag in (
        ("read_ahead", args.read_ahead, "--read-ahead"), ("batch_size", args.batch_size, "--batch-size")) if text}

    from gpulazy.device import get_device, gpu_count

    device = args.device or ("cuda:0" if gpu_count() else "cpu")
    gpu = get_device(device).is_gpu
    result: dict[str, Any] = {"repeat": args.repeat, "date": time.strftime("%Y-%m-%d")}
    result["paths"] = measure_paths(device=device, planes=args.planes or (256 if gpu else 16),
                                    mib=args.mib or (16.0 if gpu else 1.0), repeat=args.repeat, directory=args.dir,
                                    sweeps=sweeps)
    if not args.no_overlap:
        print(table(result), flush=True)  # early, in case the overlap rows run out of time
        computes = (args.computes or ("matmul,launch" if gpu else "xp,sleep")).split(",")
        result["overlap"] = measure_overlap(device=device, repeat=max(1, args.repeat - 1), computes=computes,
                                            schedulers=["sync", "threads"], chunks=64 if gpu else 16,
                                            chunk_mib=16.0 if gpu else 0.5)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
