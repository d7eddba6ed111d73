"""Where the scheduler's thread spends a prefetched pass: each of gpulazy's read-ahead functions timed.

    python benchmarks/prefetch_host_time.py sync --passes 7

``bench_prefetch``'s setup (a raw float32 volume warm in the page cache, a matmul compute per
chunk calibrated to the read alone), three passes timed ``--passes`` times each: the compute
alone over the same blocks in memory, read + compute without prefetch, and with
``gpulazy.prefetch(depth=8)``. While a pass runs, the functions in ``TIMED`` are wrapped to add up
their time, inclusive (a function's time holds the functions it calls), and their calls. Prints
each pass's median and, per pass, each function's ms and calls, the scheduler's thread apart from
the others (``w:``). The wrappers add about a microsecond a call; they are removed after.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

#: (module, attribute path) of each function timed.
TIMED = [("gpulazy.prefetch.local", "prefetch._pretask"), ("gpulazy.prefetch.local", "prefetch._start_state"),
         ("gpulazy.prefetch.plan", "ReadAhead.issue"), ("gpulazy.prefetch.plan", "ReadAheadPlan.next_reads"),
         ("gpulazy.cache", "DeviceCache.poll"), ("gpulazy.cache", "DeviceCache.prefetch"),
         ("gpulazy.cache", "DeviceCache.get"), ("gpulazy.cache", "DeviceCache._copy_out"),
         ("gpulazy.cache", "DeviceCache._store"), ("gpulazy._tasks", "ChunkSource.start"),
         ("gpulazy._tasks", "ChunkSource.load"), ("gpulazy.read.engine", "Reads.__init__"),
         ("gpulazy.read.engine", "Reads._finish"), ("gpulazy.read.engine", "Reads.done"),
         ("gpulazy.integrity", "check_unchanged"), ("gpulazy.device", "Device.alloc_many"),
         ("gpulazy.io._kvikio", "_Batch._submit"), ("gpulazy.io._kvikio", "_Batch.wait"),
         ("gpulazy.io._kvikio", "_Batch.progress")]


class Clock:
    """Wraps ``TIMED`` while ``on``: ``{label: [seconds, calls]}`` in ``spent``."""

    def __init__(self) -> None:
        self.spent: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
        self.on = False
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Clock:
        import importlib

        main = threading.main_thread()
        for module, path in TIMED:
            *outer, name = path.split(".")
            try:
                owner = importlib.import_module(module)
                for part in outer:
                    owner = getattr(owner, part)
                real = getattr(owner, name)
            except (ImportError, AttributeError):  # not in this version of gpulazy
                continue
            self._saved.append((owner, name, real))
            setattr(owner, name, self._wrap(real, path, main))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)
        self._saved.clear()

    def _wrap(self, real: Any, label: str, main: threading.Thread) -> Any:
        spent, clock = self.spent, self

        @functools.wraps(real)
        def timed(*args, **kwargs):
            if not clock.on:
                return real(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                entry = spent[label if threading.current_thread() is main else "w:" + label]
                entry[0] += time.perf_counter() - t0
                entry[1] += 1

        return timed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scheduler", choices=["sync", "threads"])
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-mib", type=float, default=16)
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args(argv)
    import dask.array as da

    import gpulazy
    from gpulazy.cache import DeviceCache
    from gpulazy.device import get_device

    gpulazy.config.set(streamed_maps=False)  # these passes time dask's task a chunk (gpulazy.read.mapped)

    sys.path.insert(0, HERE)
    import bench_prefetch as bp

    dev = get_device(args.device)
    xp, sched, chunks = dev.xp, args.scheduler, args.chunks
    rows, cols = int(args.chunk_mib * (1 << 20)) // 4096, 1024
    tmp = tempfile.TemporaryDirectory()
    path = os.path.join(tmp.name, "a.raw")
    np.random.default_rng(0).random((chunks * rows, cols), dtype=np.float32).tofile(path)
    cache = DeviceCache(2 * 10 * rows * cols * 4, device=args.device, name="prefetch-host-time")  # bench_prefetch's
    try:
        vol = gpulazy.from_files(path, shape=(chunks * rows, cols), dtype="float32", chunks=(rows, cols),
                                 device=args.device, cache=cache)
        block = vol[:rows].compute(scheduler="sync")
        mem = da.from_array(xp.concatenate([block] * chunks), chunks=(rows, cols), asarray=False)

        def run(fn) -> float:
            return bp.time_pass(cache, dev, fn)

        read = lambda: vol.map_blocks(bp._corner, dtype=vol.dtype).compute(scheduler=sched)  # noqa: E731
        for _ in range(2):
            run(read)
        t_read = statistics.median(run(read) for _ in range(5))
        iters = max(1, round(t_read / chunks / bp._time_one_iteration(xp, block, "matmul")))
        busy = bp.make_compute(xp, iters, "matmul", 0.0)
        p = gpulazy.prefetch(depth=8)

        def prefetched() -> None:
            with p:
                vol.map_blocks(busy, dtype=vol.dtype).compute(scheduler=sched)

        passes = {"compute alone": lambda: mem.map_blocks(busy, dtype=vol.dtype).compute(scheduler=sched),
                  "without prefetch": lambda: vol.map_blocks(busy, dtype=vol.dtype).compute(scheduler=sched),
                  "prefetch": prefetched}
        print(f"{args.device}, {sched}, {chunks} x {args.chunk_mib:g} MiB, read alone {t_read * 1e3:.1f} ms, "
              f"matmul x {iters} a chunk", flush=True)
        with Clock() as clock:
            for name, fn in passes.items():
                run(fn)
                clock.spent.clear()
                clock.on = True
                times = [run(fn) for _ in range(args.passes)]
                clock.on = False
                print(f"== {name}: median {statistics.median(times) * 1e3:.1f} ms, fastest {min(times) * 1e3:.1f}"
                      f" (ms a pass, calls a pass, inclusive)")
                for label, (seconds, calls) in sorted(clock.spent.items(), key=lambda kv: -kv[1][0]):
                    print(f"   {seconds / args.passes * 1e3:8.2f} ms {calls / args.passes:7.1f}  {label}")
        print("prefetch summary:", p.last_summary)
    finally:
        cache.close()
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
