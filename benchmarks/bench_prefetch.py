"""Read-ahead benchmark: a read-then-compute pass, with and without ``gpulazy.prefetch``.

The design target (docs/ARCHITECTURE.md, "Targets"): with prefetch on, a read-then-compute loop takes
at most 1.15 x max(read time, compute time). This script builds a raw float32 volume
(warm in the page cache after writing), calibrates a per-chunk compute to take about as
long as reading that chunk, and times four passes over all chunks, in rounds (the four in
turn, ``--repeat`` rounds):

- read only (each chunk read through the cache, no read-ahead),
- compute only (the same compute on a block already in memory, same task count),
- read + compute without prefetch (about read + compute when the loop is sequential),
- read + compute with ``gpulazy.prefetch(depth)`` (about max(read, compute) when it works).

Those four run on dask's scheduler (config ``streamed_maps=False``): a task a chunk, read ahead
by the prefetcher. Three more passes time what ``vol.map_blocks(f).compute()`` does by default,
which calls ``f`` on each chunk as its read lands (``gpulazy.read.mapped``) without a dask task:

- streamed read + compute (``vol.map_blocks(busy).compute()``),
- streamed read only (``vol.map_blocks(corner).compute()``),
- the compute alone as a plain loop over the blocks in memory (no dask).

``ratio_streamed`` is the median of each round's streamed pass over max(the faster read alone,
the faster compute alone): the denominator is the least either could take, by either way.

The ratio reported is the median over the rounds of each round's prefetch / max(read, compute):
passes timed side by side, since a shared host drifts by a fifth between seconds (the best pass
of each kind over the rounds, the figure before 2026-11-25, is ``ratio_best``).

It prints a table and, with ``--json PATH`` (``-`` for stdout), writes every figure.
Runs on CPU (small sizes by default) and on a GPU (``--device cuda:0``, the default
when one is usable).

    python benchmarks/bench_prefetch.py                       # GPU if any, else CPU
    python benchmarks/bench_prefetch.py --device cpu --chunks 16 --chunk-mib 0.5
    python benchmarks/bench_prefetch.py --json out/prefetch.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

TARGET_RATIO = 1.15


# --------------------------------------------------------------------------- compute


def make_compute(xp: Any, iters: int, mode: str, sleep_s: float):
    """A per-chunk compute: ``iters`` passes of elementwise math (or a sleep), then a corner.

    Returning a 1 x 1 corner keeps the graph's results tiny, so only reads and compute
    are timed. On a GPU the function synchronises: its time is the chunk's compute time.
    """

    streams = threading.local()

    def busy_compute(block):
        if mode == "sleep":
            time.sleep(sleep_s)
            return block[:1, :1].copy()
        if mode == "xp-stream" and xp.__name__ == "cupy":
            # Compute on a non-blocking stream of this thread's own: kernels on the legacy
            # default stream serialise with copies on blocking streams (KvikIO's compat-mode
            # copies among them), which hides the overlap read-ahead is there to give.
            xp.cuda.get_current_stream().synchronize()  # the block's own copy is done
            if not hasattr(streams, "s"):
                streams.s = xp.cuda.Stream(non_blocking=True)
            with streams.s:
                return _busy(block)
        return _busy(block)

    def _busy(block):
        x = block
        if mode == "matmul":  # GPU-bound: a few large kernels, the host idle meanwhile
            n = min(block.shape)
            sq = block[:n, :n]
            for _ in range(iters):
                x = sq @ sq
        elif mode == "launch":  # launch-bound: many tiny kernels, the host busy in Python
            x = block[:8, :8]
            for _ in range(iters):
                x = x + 1.0
        else:
            for _ in range(iters):
                x = xp.sqrt(x * x + 1.0)
        out = x[:1, :1].copy()
        if xp.__name__ == "cupy":
            xp.cuda.get_current_stream().synchronize()
        return out

    return busy_compute


def _corner(block):
    return block[:1, :1].copy()


def _time_one_iteration(xp: Any, block: Any, mode: str = "xp") -> float:
    one = make_compute(xp, 1, mode if mode in ("matmul", "launch") else "xp", 0.0)
    one(block)  # warm-up (kernel compilation on a GPU)
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        one(block)
    return (time.perf_counter() - t0) / reps


# --------------------------------------------------------------------------- measuring


class PeakSampler:
    """Samples ``bytes_held + bytes_reserved`` of a cache every millisecond."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self.cache.stats()
            self.peak = max(self.peak, s["bytes_held"] + s["bytes_reserved"])
            self._stop.wait(0.001)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def time_pass(cache: Any, dev: Any, fn: Callable[[], Any]) -> float:
    """Seconds of one pass ``fn()``: the cache emptied and the device idle before, its work waited for after."""
    cache.clear()
    dev.wait_all()
    t0 = time.perf_counter()
    fn()
    dev.wait_all()
    return time.perf_counter() - t0


def _timed(fn, repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(*, device: str | None = None, chunks: int = 32, chunk_mib: float = 1.0, depth: int = 8,
        capacity: str | int | None = None, compute: str = "xp", scheduler: str = "sync", repeat: int = 5,
        directory: str | None = None) -> dict[str, Any]:
    """Run the benchmark and return its figures (see the module docstring).

    Parameters
    ----------
    device
        ``"cpu"``, ``"cuda:N"`` or ``None`` (a GPU when usable, else the CPU).
    chunks, chunk_mib
        Number of chunks, and MiB per chunk (rounded down to whole 4 KiB rows of
        1024 float32).
    depth
        Prefetch depth.
    capacity
        Cache capacity; default ``2 * (depth + 2)`` chunks (the look-ahead may hold half).
    compute
        ``"xp"``: elementwise math on the device, calibrated to the per-chunk read time;
        ``"sleep"``: a sleep of that time (an idle host, like a GPU kernel would leave it).
    scheduler
        Dask scheduler: ``"sync"`` (a sequential read-then-compute loop) or ``"threads"``.
    repeat
        Rounds of the four passes, timed in turn. ``ratio`` is the median over the rounds of
        each round's prefetch / max(read, compute) (passes timed side by side, so a host's drift
        between rounds cancels); ``seconds_*`` are each pass's fastest, ``ratio_best`` their ratio.

    Examples
    --------
    >>> r = run(device="cpu", chunks=4, chunk_mib=0.0625, depth=2, repeat=1)
    >>> sorted(k for k in r if k.startswith("seconds_"))
    ['seconds_compute', 'seconds_compute_loop', 'seconds_naive', 'seconds_prefetch', 'seconds_read', 'seconds_read_streamed', 'seconds_streamed']
    """
    import gpulazy
    from gpulazy.cache import DeviceCache
    from gpulazy.device import get_device, gpu_count

    dev = get_device(device if device is not None else ("cuda:0" if gpu_count() else "cpu"))
    xp = dev.xp
    cols = 1024
    rows = max(1, int(chunk_mib * (1 << 20)) // (cols * 4))
    chunk_bytes = rows * cols * 4
    cap = capacity if capacity is not None else 2 * (depth + 2) * chunk_bytes
    tmp = tempfile.TemporaryDirectory(dir=directory)
    try:
        path = os.path.join(tmp.name, "prefetch-bench.raw")
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:  # warm in the page cache from here on
            for _ in range(chunks):
                rng.random((rows, cols), dtype=np.float32).tofile(f)
        cache = DeviceCache(cap, device=dev, name=f"bench-prefetch-{os.getpid()}")
        try:
            vol = gpulazy.from_files(path, shape=(chunks * rows, cols), dtype="float32", chunks=(rows, cols),
                                     device=dev.name, cache=cache)
            return _measure(gpulazy, vol, cache, xp, dev, chunks, rows, cols, chunk_bytes, depth, compute,
                            scheduler, repeat)
        finally:
            cache.close()
    finally:
        tmp.cleanup()


def calibrate(xp: Any, block: Any, mem: Any, t_read: float, compute: str, scheduler: str,
              repeat: int) -> tuple[Callable, int, float, float]:
    """A per-chunk compute whose pass over ``mem`` (a dask array of blocks in memory) takes about
    ``t_read``: a first guess from one iteration, then one correction from a measured pass.
    Returns ``(busy, iterations, sleep seconds, the pass's seconds)``."""
    chunks = mem.numblocks[0]

    def compute_only(busy):
        return _timed(lambda: mem.map_blocks(busy, dtype=mem.dtype).compute(scheduler=scheduler), repeat)[0]

    per_chunk_read = t_read / chunks
    t_iter = _time_one_iteration(xp, block, compute)
    iters = max(1, round(per_chunk_read / t_iter)) if compute != "sleep" else 0
    sleep_s = per_chunk_read
    busy = make_compute(xp, iters, compute, sleep_s)
    t_compute = compute_only(busy)
    scale = t_read / t_compute
    if abs(scale - 1) > 0.15:
        if compute != "sleep":
            iters = max(1, round(iters * scale))
        else:
            sleep_s = max(0.0, sleep_s * (1 + (t_read - t_compute) / chunks / max(sleep_s, 1e-9)))
        busy = make_compute(xp, iters, compute, sleep_s)
        t_compute = compute_only(busy)
    return busy, iters, sleep_s, t_compute


def _measure(gpulazy, vol, cache, xp, dev, chunks, rows, cols, chunk_bytes, depth, compute, scheduler,
             repeat) -> dict[str, Any]:
    import dask.array as da

    def fresh():
        cache.clear()
        cache.reset_stats()

    def on_dask(make: Callable[[], Any]) -> Any:
        with gpulazy.config.set(streamed_maps=False):  # a task a chunk, as read-ahead works on it
            return make()

    def read_only():
        fresh()
        return on_dask(lambda: vol.map_blocks(_corner, dtype=vol.dtype)).compute(scheduler=scheduler)

    read_only()  # warm-up: backend threads, allocator pools
    t_read, _ = _timed(read_only, repeat)

    block = vol[:rows].compute(scheduler="sync")
    # Compute only: the same tasks over the same bytes already in device memory (no reads),
    # so both passes pay the same scheduling overheads.
    whole = xp.concatenate([block] * chunks)
    mem = da.from_array(whole, chunks=(rows, cols), asarray=False)

    busy, iters, sleep_s, t_compute = calibrate(xp, block, mem, t_read, compute, scheduler, repeat)

    p = gpulazy.prefetch(depth=depth)
    best = {"t": float("inf")}

    def with_prefetch() -> float:
        fresh()
        with PeakSampler(cache) as sampler, p:
            t0 = time.perf_counter()
            on_dask(lambda: vol.map_blocks(busy, dtype=vol.dtype)).compute(scheduler=scheduler)
            t = time.perf_counter() - t0
        if t < best["t"]:
            best.update(t=t, stats=cache.stats(), peak=sampler.peak, summary=dict(p.last_summary or {}))
        return t

    def clocked(fn: Callable[[], Any]) -> Callable[[], float]:
        # A pass, as ``with_prefetch`` times it: emptying the cache (and, there, the peak
        # sampler's thread) stays outside every pass's time.
        def run() -> float:
            fresh()
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return run

    def on(graph: Any) -> Callable[[], Any]:
        return lambda: graph.compute(scheduler=scheduler)

    # Rounds of the four passes in turn: a shared host drifts by a fifth between seconds, so each
    # round's ratio compares passes timed side by side, and the median of the rounds is the figure.
    passes = {"read": clocked(on(on_dask(lambda: vol.map_blocks(_corner, dtype=vol.dtype)))),
              "compute": clocked(on(mem.map_blocks(busy, dtype=vol.dtype))),
              "naive": clocked(on(on_dask(lambda: vol.map_blocks(busy, dtype=vol.dtype)))), "prefetch": with_prefetch,
              **{name: clocked(fn) for name, fn in streamed_passes(vol, busy, whole, rows, scheduler).items()}}
    rounds = [{name: fn() for name, fn in passes.items()} for _ in range(repeat)]
    t_read, t_compute, t_naive = (min(r[k] for r in rounds) for k in ("read", "compute", "naive"))
    stats, t_pf = best["stats"], best["t"]
    gets = stats["hits"] + stats["misses"]
    bound = max(t_read, t_compute)
    ratio = statistics.median(r["prefetch"] / max(r["read"], r["compute"]) for r in rounds)
    ratio_naive = statistics.median(r["naive"] / max(r["read"], r["compute"]) for r in rounds)
    return {
        "device": dev.name,
        "scheduler": scheduler,
        "chunks": chunks,
        "chunk_bytes": chunk_bytes,
        "chunk_shape": [rows, cols],
        "depth": depth,
        "compute": compute,
        "compute_iters": iters,
        "compute_sleep_s": sleep_s if compute == "sleep" else 0.0,
        "cache_capacity": cache.capacity,
        "seconds_read": t_read,
        "seconds_compute": t_compute,
        "seconds_naive": t_naive,
        "seconds_prefetch": t_pf,
        "ratio": ratio,
        "ratio_naive": ratio_naive,
        "ratio_best": t_pf / bound,
        "seconds_streamed": min(r["streamed"] for r in rounds),
        "seconds_read_streamed": min(r["read streamed"] for r in rounds),
        "seconds_compute_loop": min(r["compute loop"] for r in rounds),
        "ratio_streamed": statistics.median(streamed_ratio(r) for r in rounds),
        "rounds": rounds,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
        "speedup": t_naive / t_pf,
        "read_seconds_in_prefetch_pass": stats["read_seconds"],
        "hit_rate": stats["prefetch_hits"] / gets if gets else 0.0,
        "prefetched": stats["prefetched"],
        "misses": stats["misses"],
        "cache_peak_bytes": best["peak"],
        "cache_peak_within_capacity": best["peak"] <= cache.capacity,
        "lookahead_budget": best["summary"].get("budget"),
        "lookahead_peak_bytes": best["summary"].get("peak_outstanding_bytes"),
    }


def streamed_passes(vol: Any, busy: Callable, whole: Any, rows: int, scheduler: str) -> dict[str, Callable[[], Any]]:
    """The passes ``vol.map_blocks(f).compute()`` runs by default (``gpulazy.read.mapped``: ``f`` on
    each chunk as its read lands), and the compute alone as a plain loop over ``whole``'s blocks."""
    streamed = vol.map_blocks(busy, dtype=vol.dtype)
    streamed_read = vol.map_blocks(_corner, dtype=vol.dtype)
    blocks = [whole[i:i + rows] for i in range(0, whole.shape[0], rows)]

    def streamed_pass(graph: Any) -> Callable[[], Any]:
        def run() -> Any:
            out = graph.compute(scheduler=scheduler)
            if graph.compute_path != "fast":
                raise RuntimeError("the streamed map did not run: is config streamed_maps off?")
            return out
        return run

    def loop() -> None:
        for b in blocks:
            busy(b)

    return {"streamed": streamed_pass(streamed), "read streamed": streamed_pass(streamed_read), "compute loop": loop}


def streamed_ratio(r: dict[str, float], name: str = "streamed") -> float:
    """A round's pass ``name`` (the streamed pass) over max(the faster read alone, the faster compute alone)."""
    return r[name] / max(min(r["read"], r["read streamed"]), min(r["compute"], r["compute loop"]))


# --------------------------------------------------------------------------- output


def table(r: dict[str, Any]) -> str:
    mib = 1 << 20
    verdict = "meets" if r["meets_target"] else "MISSES"
    lines = [
        f"prefetch benchmark: {r['device']}, {r['chunks']} chunks x {r['chunk_bytes'] / mib:.2f} MiB float32, "
        f"depth {r['depth']}, cache {r['cache_capacity'] / mib:.1f} MiB, scheduler {r['scheduler']}, "
        f"compute {r['compute']!r} ({r['compute_iters']} iterations/chunk), warm page cache",
        f"{'pass':<36}{'seconds':>10}",
        f"{'read only':<36}{r['seconds_read']:>10.4f}",
        f"{'compute only':<36}{r['seconds_compute']:>10.4f}",
        f"{'read + compute, no prefetch':<36}{r['seconds_naive']:>10.4f}",
        f"{'read + compute, prefetch':<36}{r['seconds_prefetch']:>10.4f}",
        f"ratio prefetch / max(read, compute), median of {len(r['rounds'])} rounds: {r['ratio']:.3f} "
        f"({verdict} target <= {r['target_ratio']}); without prefetch: {r['ratio_naive']:.3f}; "
        f"best pass over best passes {r['ratio_best']:.3f}; speedup {r['speedup']:.2f}x",
        f"{'streamed read + compute (the default)':<36}{r['seconds_streamed']:>10.4f}",
        f"{'streamed read only':<36}{r['seconds_read_streamed']:>10.4f}",
        f"{'compute only, a plain loop':<36}{r['seconds_compute_loop']:>10.4f}",
        f"ratio streamed / max(faster read, faster compute), median: {r['ratio_streamed']:.3f} "
        f"({'meets' if r['ratio_streamed'] <= r['target_ratio'] else 'MISSES'} target <= {r['target_ratio']})",
        f"hit rate (gets served by prefetched chunks): {r['hit_rate']:.1%} "
        f"({r['prefetched']} prefetched, {r['misses']} misses)",
        f"cache peak {r['cache_peak_bytes'] / mib:.1f} MiB of {r['cache_capacity'] / mib:.1f} MiB "
        f"({'within' if r['cache_peak_within_capacity'] else 'OVER'} capacity); look-ahead peak "
        f"{(r['lookahead_peak_bytes'] or 0) / mib:.1f} MiB of a {(r['lookahead_budget'] or 0) / mib:.1f} MiB budget",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cpu or cuda:N (default: a GPU when usable)")
    ap.add_argument("--chunks", type=int, default=None, help="number of chunks (default 64 on a GPU, 32 on CPU)")
    ap.add_argument("--chunk-mib", type=float, default=None, help="MiB per chunk (default 16 on a GPU, 1 on CPU)")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--capacity", default=None, help="cache capacity (default 2 x (depth + 2) chunks)")
    ap.add_argument("--compute", choices=["xp", "xp-stream", "matmul", "launch", "sleep"], default="xp",
                    help="xp: array math on the current stream; xp-stream: on a non-blocking CUDA stream "
                         "per thread; matmul: GPU-bound matrix products; launch: launch-bound tiny kernels; "
                         "sleep: a calibrated sleep")
    ap.add_argument("--scheduler", choices=["sync", "threads"], default="sync")
    ap.add_argument("--repeat", type=int, default=5, help="rounds of the four passes (the ratio is their median)")
    ap.add_argument("--dir", default=None, help="where to write the test file (default: the temp dir)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON ('-': stdout)")
    args = ap.parse_args(argv)

    from gpulazy.device import get_device, gpu_count

    device = args.device or ("cuda:0" if gpu_count() else "cpu")
    on_gpu = get_device(device).is_gpu
    result = run(device=device, chunks=args.chunks or (64 if on_gpu else 32),
                 chunk_mib=args.chunk_mib or (16.0 if on_gpu else 1.0), depth=args.depth, capacity=args.capacity,
                 compute=args.compute, scheduler=args.scheduler, repeat=args.repeat, directory=args.dir)
    print(table(result))
    if args.json == "-":
        print(json.dumps(result, indent=2))
    elif args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
