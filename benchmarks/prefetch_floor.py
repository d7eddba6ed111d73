"""The floor under the prefetch target: the least read-ahead a dask task can do, beside gpulazy's.

    python benchmarks/prefetch_floor.py --compute matmul --scheduler sync --repeat 7

``bench_prefetch``'s setup (a raw float32 volume of ``--chunks`` x ``--chunk-mib`` warm in the page
cache, a per-chunk compute calibrated to gpulazy's read alone) and its ratio, read + compute over
max(read alone, compute alone), for two read-aheads in the same rounds:

- ``prefetch``: ``gpulazy.prefetch(depth)`` over a gpulazy array, as ``bench_prefetch`` times it.
- ``floor``: a dask array over the same file whose chunk tasks do the least a read can: a dask
  callback keeps ``depth`` reads in flight in the order dask runs the tasks (``dask.order``), each
  a KvikIO host read into a pinned slot issued as a task starts; the copies of the reads already
  in go into new device arrays on a non-blocking stream as each task starts (``--copy ahead``,
  as gpulazy does; ``--copy load``: by the chunk's own task), and a chunk's task waits for its
  read and its copy. No cache, no chunk specs, no check of the file, no error reporting beyond
  raising. (On the CPU: a thread pool's ``preadv`` into host slots, and a NumPy copy.)

Both run on dask's scheduler (config ``streamed_maps=False``). Beside them, ``bench_prefetch``'s
streamed passes: ``vol.map_blocks(f).compute()`` as it runs by default (``f`` on each chunk as its
read lands, no dask task), its read alone, and the compute alone as a plain loop; ``ratio_streamed``
is the streamed pass over max(the faster read alone, the faster compute alone). And the floor under
that pass (``MapFloor``, ``ratio_streamed_floor`` over the same): every chunk's read submitted at once
into destinations made before the passes, ``f`` on each chunk in turn as its read is in.

What is left when everything but reading, copying and waiting is taken out: where the floor
misses the target too, no leaner gpulazy would meet it with that read-ahead on that host, and
the gap between the two rows, measured in the same rounds (so a host's drift cancels), is what
gpulazy's own work costs. Each process prints the median over ``--repeat`` rounds of each round's
ratio.

``--old REV`` adds REV's ``gpulazy.prefetch`` over the same file as a third pass (that commit's
package imported beside this one, ``_old_tree``), and prints the median of new / old: a change
measured in the same rounds, old and new taking each other's place every other round.

    python benchmarks/prefetch_floor.py --compute launch --scheduler threads --old f62d462
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


class _RawFile:
    """A raw file opened for a floor's reads: a KvikIO ``CuFile`` on a GPU, a descriptor and a pool of
    8 threads for ``preadv`` on the CPU."""

    def __init__(self, path: str, dev: Any):
        self.dev = dev
        if dev.is_gpu:
            import kvikio

            self._file = kvikio.CuFile(path, "r")
        else:
            self._fd = os.open(path, os.O_RDONLY)
            self._pool = ThreadPoolExecutor(8)

    def close(self) -> None:
        if self.dev.is_gpu:
            self._file.close()
        else:
            self._pool.shutdown()
            os.close(self._fd)


class FloorReader(_RawFile):
    """Reads chunk ``k`` of a raw file (``nbytes`` each) into pinned slots, ``depth`` ahead of the tasks."""

    def __init__(self, path: str, nbytes: int, depth: int, slots: int, dev: Any, *, shape: tuple, ahead: bool):
        super().__init__(path, dev)
        self.nbytes, self.depth = nbytes, depth
        self.shape, self.ahead = shape, ahead
        self._lock = threading.Lock()
        self._inflight: dict[int, list] = {}  # chunk -> [slot, read future, device array, copy event]
        self._order: list[int] = []
        self._next = 0
        if dev.is_gpu:
            import cupy

            self._mem = [cupy.cuda.alloc_pinned_memory(nbytes) for _ in range(slots)]
            self._host = [np.frombuffer(m, np.uint8, nbytes) for m in self._mem]
            with dev.activate():
                self._stream = cupy.cuda.Stream(non_blocking=True)
        else:
            self._host = [np.empty(nbytes, np.uint8) for _ in range(slots)]
        self._free = list(range(slots))

    def start_pass(self, order: list[int]) -> None:
        with self._lock:
            self._order, self._next = order, 0
            self._fill()

    def _submit(self, k: int) -> None:
        # Lock held.
        slot = self._free.pop()
        if self.dev.is_gpu:
            fut = self._file.pread(self._host[slot], self.nbytes, k * self.nbytes)
        else:
            fut = self._pool.submit(os.preadv, self._fd, [self._host[slot]], k * self.nbytes)
        self._inflight[k] = [slot, fut, None, None]

    def _fill(self) -> None:
        # Lock held: keep ``depth`` reads in flight, in the order the tasks run.
        while len(self._inflight) < self.depth and self._next < len(self._order) and self._free:
            k = self._order[self._next]
            self._next += 1
            if k not in self._inflight:
                self._submit(k)

    def pretask(self) -> None:
        with self._lock:
            self._fill()
            if self.ahead:  # the copies of the reads already in, issued now (not when their task asks)
                for entry in self._inflight.values():
                    if entry[2] is None and entry[1].done():
                        self._copy(entry)

    def load(self, k: int) -> Any:
        """Chunk ``k`` as a device array (read now if it was not read ahead)."""
        with self._lock:
            if k not in self._inflight:
                self._submit(k)
            entry = self._inflight.pop(k)
        if entry[2] is None:
            self._copy(entry)
        out, event = entry[2], entry[3]
        if event is not None:
            event.synchronize()
        with self._lock:
            self._free.append(entry[0])
            self._fill()
        return out

    def _copy(self, entry: list) -> None:
        slot, fut = entry[0], entry[1]
        got = fut.get() if self.dev.is_gpu else fut.result()
        if got != self.nbytes:
            raise OSError(f"short read: {got} of {self.nbytes} bytes")
        host = self._host[slot]
        if not self.dev.is_gpu:
            entry[2] = host.view(np.float32).reshape(self.shape).copy()
            return
        import cupy

        with self.dev.activate():
            out = cupy.empty(self.shape, np.float32)
            cupy.cuda.runtime.memcpyAsync(out.data.ptr, host.ctypes.data, self.nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice, self._stream.ptr)
            event = cupy.cuda.Event(disable_timing=True)
            event.record(self._stream)
        entry[2], entry[3] = out, event


class MapFloor(_RawFile):
    """The least a streamed map can do: every chunk's read submitted at once into a destination allocated
    once (before any pass), then ``f`` called on each chunk in turn as its read is in (on a GPU on a
    non-blocking stream, as ``gpulazy.read.mapped`` calls it). No allocation a pass, no chunk specs, no
    check of the file, nothing put together: what ``vol.map_blocks(f).compute()`` is measured against.
    (On the CPU: a thread pool's ``preadv`` into host arrays.)"""

    def __init__(self, path: str, nbytes: int, chunks: int, dev: Any, *, shape: tuple):
        super().__init__(path, dev)
        self.nbytes, self.chunks = nbytes, chunks
        if dev.is_gpu:
            import cupy

            with dev.activate():
                self.dests = [cupy.empty(shape, np.float32) for _ in range(chunks)]
                self._stream = cupy.cuda.Stream(non_blocking=True)
        else:
            self.dests = [np.empty(shape, np.float32) for _ in range(chunks)]

    def run(self, f: Any) -> None:
        """One pass: read every chunk, ``f`` on each as its read is in."""
        if not self.dev.is_gpu:
            futures = [self._pool.submit(os.preadv, self._fd, [self.dests[k]], k * self.nbytes)
                       for k in range(self.chunks)]
            for k, fut in enumerate(futures):
                self._check(fut.result())
                f(self.dests[k])
            return
        futures = [self._file.pread(self.dests[k], self.nbytes, k * self.nbytes) for k in range(self.chunks)]
        with self.dev.activate(), self._stream:
            for k, fut in enumerate(futures):
                self._check(fut.get())
                f(self.dests[k])
        self._stream.synchronize()

    def _check(self, got: int) -> None:
        if got != self.nbytes:
            raise OSError(f"short read: {got} of {self.nbytes} bytes")


def floor_array(reader: FloorReader, chunks: int, rows: int, cols: int) -> Any:
    """A dask array over the reader's file: chunk ``k``'s task is ``reader.load(k)``."""
    import dask.array as da

    def block(block_id=None):
        return reader.load(block_id[0])

    return da.map_blocks(block, dtype=np.float32, chunks=((rows,) * chunks, (cols,)), meta=np.empty((0, 0),
                                                                                                     np.float32))


def floor_callback(reader: FloorReader) -> Any:
    """A dask callback that hands the reader the run order at the start and fills its reads at each task."""
    from dask.callbacks import Callback
    from dask.order import order

    def start_state(dsk: dict, state: dict) -> None:
        prio = order(dsk)
        seen: dict[int, None] = {}
        for key in sorted((k for k in dsk if isinstance(k, tuple) and len(k) == 3), key=prio.get):
            seen.setdefault(key[1], None)
        reader.start_pass(list(seen))

    def pretask(key: Any, dsk: dict, state: dict) -> None:
        reader.pretask()

    return Callback(start_state=start_state, pretask=pretask)


def run(*, device: str | None = None, chunks: int = 64, chunk_mib: float = 16.0, depth: int = 8,
        compute: str = "matmul", scheduler: str = "sync", repeat: int = 7, copy: str = "ahead",
        old: str | None = None) -> dict[str, Any]:
    """Time the passes in ``repeat`` rounds; returns the medians (seconds) and the ratios.

    ``old``: a commit whose ``gpulazy.prefetch`` is timed too (``new_over_old``: the median over
    the rounds of this tree's pass over that one's)."""
    import dask.array as da

    import gpulazy
    from gpulazy.cache import DeviceCache
    from gpulazy.device import get_device, gpu_count

    sys.path.insert(0, HERE)
    import bench_prefetch as bp

    dev = get_device(device or ("cuda:0" if gpu_count() else "cpu"))
    xp, sched = dev.xp, scheduler
    cols = 1024
    rows = max(1, int(chunk_mib * (1 << 20)) // (cols * 4))
    nbytes = rows * cols * 4
    tmp = tempfile.TemporaryDirectory()
    path = os.path.join(tmp.name, "floor.raw")
    np.random.default_rng(0).random((chunks * rows, cols), dtype=np.float32).tofile(path)  # warm from here on
    cache = DeviceCache(2 * (depth + 2) * nbytes, device=dev, name=f"prefetch-floor-{os.getpid()}")
    reader = FloorReader(path, nbytes, depth, slots=depth + 32, dev=dev, shape=(rows, cols), ahead=copy == "ahead")
    map_floor = MapFloor(path, nbytes, chunks, dev, shape=(rows, cols))
    caches = [cache]
    try:
        vol = gpulazy.from_files(path, shape=(chunks * rows, cols), dtype="float32", chunks=(rows, cols),
                                 device=dev.name, cache=cache)
        floor = floor_array(reader, chunks, rows, cols)

        def timed(fn) -> Any:
            def one() -> float:
                for c in caches[1:]:
                    c.clear()
                return bp.time_pass(cache, dev, fn)
            return one

        def on_dask(func: Any) -> Any:
            with gpulazy.config.set(streamed_maps=False):  # a task a chunk, as read-ahead works on it
                return vol.map_blocks(func, dtype=vol.dtype)

        read = timed(lambda: on_dask(bp._corner).compute(scheduler=sched))
        for _ in range(2):
            read()
        t_read = min(read() for _ in range(repeat))
        block = vol[:rows].compute(scheduler="sync")
        whole = xp.concatenate([block] * chunks)
        mem = da.from_array(whole, chunks=(rows, cols), asarray=False)
        busy, iters, _, _ = bp.calibrate(xp, block, mem, t_read, compute, sched, repeat)
        p = gpulazy.prefetch(depth=depth)
        cb = floor_callback(reader)

        def prefetched() -> None:
            with p:
                on_dask(busy).compute(scheduler=sched)

        def floored() -> None:
            with cb:
                floor.map_blocks(busy, dtype=floor.dtype).compute(scheduler=sched)

        def floor_read() -> None:
            with cb:
                floor.map_blocks(bp._corner, dtype=floor.dtype).compute(scheduler=sched)

        def compute_alone() -> None:
            mem.map_blocks(busy, dtype=mem.dtype).compute(scheduler=sched)

        passes = {"read": read, "compute": timed(compute_alone), "prefetch": timed(prefetched), "floor": timed(floored),
                  "floor read": timed(floor_read),
                  **{name: timed(fn) for name, fn in bp.streamed_passes(vol, busy, whole, rows, sched).items()},
                  "streamed floor": timed(lambda: map_floor.run(busy))}
        if old is not None:
            passes["prefetch old"] = timed(_old_pass(old, path, chunks, rows, cols, depth, dev, busy, sched, caches))
        for fn in passes.values():
            fn()  # warm-up
        rounds = [{name: passes[name]() for name in _round_order(list(passes), i)} for i in range(repeat)]
        with cb:  # the bytes the timed passes' read-ahead hands out (copies issued ahead included)
            whole = floor.compute(scheduler=sched)
        whole = xp.asnumpy(whole) if dev.is_gpu else whole
        mapped = xp.concatenate(map_floor.dests)  # what the streamed floor's last pass read
        mapped = xp.asnumpy(mapped) if dev.is_gpu else mapped
    finally:
        reader.close()
        map_floor.close()
        for c in caches:
            c.close()
    expect = np.fromfile(path, np.float32).reshape(chunks * rows, cols)
    tmp.cleanup()
    return {"device": dev.name, "scheduler": sched, "chunks": chunks, "chunk_bytes": nbytes, "depth": depth,
            "compute": compute, "compute_iters": iters, "copy": copy, "rounds": rounds,
            "floor_bytes_equal": bool(np.array_equal(whole, expect) and np.array_equal(mapped, expect)),
            **{f"seconds_{name.replace(' ', '_')}": statistics.median(r[name] for r in rounds) for name in passes},
            **{f"ratio_{name.replace(' ', '_')}": statistics.median(r[name] / max(r["read"], r["compute"])
                                                                    for r in rounds)
               for name in ("prefetch", "floor", "prefetch old") if name in passes},
            "ratio_streamed": statistics.median(bp.streamed_ratio(r) for r in rounds),
            "ratio_streamed_floor": statistics.median(bp.streamed_ratio(r, "streamed floor") for r in rounds),
            # Each way over its floor in the same round: the figure that moves least between processes (each
            # calibrates its compute; a cell's ratios moved by 0.3 between two processes on one H200 host).
            **{f"{name}_over_floor": statistics.median(r[name] / r[floor_of] for r in rounds)
               for name, floor_of in (("prefetch", "floor"), ("streamed", "streamed floor"))},
            **({"old": old, "new_over_old": statistics.median(r["prefetch"] / r["prefetch old"] for r in rounds)}
               if old is not None else {}),
            "target_ratio": bp.TARGET_RATIO}


def _old_pass(rev: str, path: str, chunks: int, rows: int, cols: int, depth: int, dev: Any, busy: Any, sched: str,
              caches: list) -> Any:
    """Commit ``rev``'s prefetched pass over ``path`` (its cache joins ``caches``, emptied before every pass)."""
    from _old_tree import load_old_tree

    old = load_old_tree(rev)
    cache = old.cache.DeviceCache(caches[0].capacity, device=dev.name, name=f"prefetch-floor-old-{os.getpid()}")
    caches.append(cache)
    vol = old.from_files(path, shape=(chunks * rows, cols), dtype="float32", chunks=(rows, cols), device=dev.name,
                         cache=cache)
    p = old.prefetch(depth=depth)

    def prefetched_old() -> None:
        with p:
            vol.map_blocks(busy, dtype=vol.dtype).compute(scheduler=sched)

    return prefetched_old


def _round_order(names: list[str], i: int) -> list[str]:
    """The passes of round ``i``: with an old tree, its pass and this tree's swap places every other round
    (the pass after another pays for the garbage that one left)."""
    if "prefetch old" not in names or i % 2 == 0:
        return names
    a, b = names.index("prefetch"), names.index("prefetch old")
    names = list(names)
    names[a], names[b] = names[b], names[a]
    return names


def table(r: dict[str, Any]) -> str:
    lines = [f"{r['device']}, {r['scheduler']}, {r['chunks']} x {r['chunk_bytes'] / (1 << 20):g} MiB, depth "
             f"{r['depth']}, {r['compute']} x {r['compute_iters']} a chunk, {len(r['rounds'])} rounds, the floor's "
             f"copies {r['copy']}"]
    for name in ("read", "compute", "prefetch", "floor", "floor read", "prefetch old", "streamed", "read streamed",
                 "compute loop", "streamed floor"):
        if "seconds_" + name.replace(" ", "_") in r:
            lines.append(f"  {name:<12} median {r['seconds_' + name.replace(' ', '_')] * 1e3:7.1f} ms")
    for name in ("prefetch", "floor", "prefetch old"):
        if "ratio_" + name.replace(" ", "_") in r:
            lines.append(f"ratio {name:<12} / max(read, compute): {r['ratio_' + name.replace(' ', '_')]:.3f} "
                         f"(target <= {r['target_ratio']})")
    lines.append(f"ratio streamed     / max(faster read, faster compute): {r['ratio_streamed']:.3f} (the default "
                 f"vol.map_blocks(f).compute(); faster of read and read streamed, of compute and compute loop)")
    lines.append(f"ratio streamed floor / the same: {r['ratio_streamed_floor']:.3f} (every read submitted at once "
                 f"into destinations made once, f on each chunk as it is in: the least a streamed map can take)")
    lines.append(f"each over its floor in the same round, median: prefetch / floor {r['prefetch_over_floor']:.3f}, "
                 f"streamed / streamed floor {r['streamed_over_floor']:.3f}")
    if "new_over_old" in r:
        lines.append(f"this tree's prefetched pass / {r['old']}'s, median of the rounds: {r['new_over_old']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cpu or cuda:N (default: a GPU when usable)")
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-mib", type=float, default=16.0)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--compute", choices=["matmul", "launch", "xp", "sleep"], default="matmul")
    ap.add_argument("--scheduler", choices=["sync", "threads"], default="sync")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--copy", choices=["ahead", "load"], default="ahead",
                    help="the floor's host-to-device copy: issued at each task start for the reads already in "
                         "(as gpulazy does), or by the chunk's own task")
    ap.add_argument("--old", default=None, metavar="REV",
                    help="also time commit REV's gpulazy.prefetch in the same rounds (git archive, imported beside)")
    args = ap.parse_args(argv)
    r = run(device=args.device, chunks=args.chunks, chunk_mib=args.chunk_mib, depth=args.depth, compute=args.compute,
            scheduler=args.scheduler, repeat=args.repeat, copy=args.copy, old=args.old)
    if not r["floor_bytes_equal"]:
        raise SystemExit("the floor's reader read the wrong bytes")
    print(table(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
