"""A chunk's read as a task of its own (``ReadTask``, today) against dask fusing it with what follows, in one process.

    python benchmarks/fusion_ab.py --compute matmul --scheduler sync --repeat 7

gpulazy's read tasks opt out of dask's linear fusion (``gpulazy._readlayer.ReadTask.block_fusion``).
This times, in each round, the passes below with the read tasks unfused and then fused as dask
would fuse them (the property switched for the whole process between passes; the order swapped
every other round), over ``bench_prefetch``'s raw float32 volume (``--chunks`` x ``--chunk-mib``,
warm in the page cache):

- ``read``: ``map_blocks`` of a corner over the gpulazy array (``bench_prefetch``'s read alone);
- ``prefetch``: ``gpulazy.prefetch(depth)`` and a per-chunk compute calibrated to the unfused read;
- ``chain``: ``(vol[1:-1] + 1)`` then the corner (several operations after each read);
- ``slice``: ``(vol[3:-3] * 2)`` then the corner.

The compute alone and ``prefetch_floor``'s floor run once a round. It prints the medians over the
rounds and each pass's median of unfused / fused (below 1: unfused is faster), and the prefetched
pass over max(read, compute) for each setting. (Fused, a prefetched ``map_blocks`` runs an alias
task a chunk: the tree before ``ReadTask`` folded those under prefetch, ``prefetch_floor.py --old``
measures against it.) On the CPU (``--device cpu``) chunks default to 0.25 MiB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PASSES = ("read", "prefetch", "chain", "slice")


def set_fused(fused: bool) -> None:
    """Let dask fuse gpulazy's read tasks (``True``) or not (``False``, the library's choice)."""
    from gpulazy._readlayer import ReadTask

    ReadTask.block_fusion = property(lambda self: not fused)


def run(*, device: str | None = None, chunks: int = 64, chunk_mib: float | None = None, depth: int = 8,
        compute: str = "matmul", scheduler: str = "sync", repeat: int = 7) -> dict[str, Any]:
    """The medians (seconds) of each pass and setting over ``repeat`` rounds, and the ratios."""
    import dask.array as da

    import gpulazy
    from gpulazy._readlayer import ReadTask
    from gpulazy.cache import DeviceCache
    from gpulazy.device import get_device, gpu_count

    gpulazy.config.set(streamed_maps=False)  # these passes time dask's task a chunk (gpulazy.read.mapped)

    sys.path.insert(0, HERE)
    import bench_prefetch as bp
    import prefetch_floor as pfl

    dev = get_device(device or ("cuda:0" if gpu_count() else "cpu"))
    xp, sched = dev.xp, scheduler
    mib = chunk_mib if chunk_mib is not None else (16.0 if dev.is_gpu else 0.25)
    cols = 1024
    rows = max(1, int(mib * (1 << 20)) // (cols * 4))
    nbytes = rows * cols * 4
    tmp = tempfile.TemporaryDirectory()
    path = os.path.join(tmp.name, "fusion.raw")
    np.random.default_rng(0).random((chunks * rows, cols), dtype=np.float32).tofile(path)
    cache = DeviceCache(2 * (depth + 2) * nbytes, device=dev, name=f"fusion-ab-{os.getpid()}")
    reader = pfl.FloorReader(path, nbytes, depth, slots=depth + 32, dev=dev, shape=(rows, cols), ahead=True)
    unfused = ReadTask.__dict__["block_fusion"]
    try:
        vol = gpulazy.from_files(path, shape=(chunks * rows, cols), dtype="float32", chunks=(rows, cols),
                                 device=dev.name, cache=cache)
        floor = pfl.floor_array(reader, chunks, rows, cols)
        corner = bp._corner

        def timed(fn) -> float:
            return bp.time_pass(cache, dev, fn)

        def read() -> None:
            vol.map_blocks(corner, dtype=vol.dtype).compute(scheduler=sched)

        for _ in range(2):
            timed(read)
        t_read = min(timed(read) for _ in range(repeat))
        block = vol[:rows].compute(scheduler="sync")
        mem = da.from_array(xp.concatenate([block] * chunks), chunks=(rows, cols), asarray=False)
        busy, iters, _, _ = bp.calibrate(xp, block, mem, t_read, compute, sched, repeat)
        p, cb = gpulazy.prefetch(depth=depth), pfl.floor_callback(reader)

        def prefetched() -> None:
            with p:
                vol.map_blocks(busy, dtype=vol.dtype).compute(scheduler=sched)

        def chain() -> None:
            (vol[1:-1] + 1).map_blocks(corner, dtype=vol.dtype).compute(scheduler=sched)

        def sliced() -> None:
            (vol[3:-3] * 2).map_blocks(corner, dtype=vol.dtype).compute(scheduler=sched)

        def floored() -> None:
            with cb:
                floor.map_blocks(busy, dtype=floor.dtype).compute(scheduler=sched)

        def compute_alone() -> None:
            mem.map_blocks(busy, dtype=mem.dtype).compute(scheduler=sched)

        passes = {"read": read, "prefetch": prefetched, "chain": chain, "slice": sliced}
        for fused in (False, True):
            set_fused(fused)
            for fn in passes.values():
                timed(fn)  # warm-up
        rounds = []
        for i in range(repeat):
            r: dict[Any, float] = {"compute": timed(compute_alone), "floor": timed(floored)}
            for fused in ((False, True) if i % 2 == 0 else (True, False)):
                set_fused(fused)
                for name, fn in passes.items():
                    r[(name, fused)] = timed(fn)
            rounds.append(r)
    finally:
        ReadTask.block_fusion = unfused
        reader.close()
        cache.close()
        tmp.cleanup()

    def med(key: Any) -> float:
        return statistics.median(r[key] for r in rounds)

    out: dict[str, Any] = {"device": dev.name, "scheduler": sched, "chunks": chunks, "chunk_bytes": nbytes,
                           "depth": depth, "compute": compute, "compute_iters": iters, "repeat": repeat,
                           "seconds_compute": med("compute"), "seconds_floor": med("floor")}
    for name in PASSES:
        out[f"seconds_{name}_unfused"] = med((name, False))
        out[f"seconds_{name}_fused"] = med((name, True))
        out[f"{name}_unfused_over_fused"] = statistics.median(r[(name, False)] / r[(name, True)] for r in rounds)
    for fused, label in ((False, "unfused"), (True, "fused")):
        out[f"ratio_prefetch_{label}"] = statistics.median(
            r[("prefetch", fused)] / max(r[("read", fused)], r["compute"]) for r in rounds)
    out["ratio_floor"] = statistics.median(r["floor"] / max(r[("read", False)], r["compute"]) for r in rounds)
    return out


def table(r: dict[str, Any]) -> str:
    lines = [f"{r['device']}, {r['scheduler']}, {r['chunks']} x {r['chunk_bytes'] / (1 << 20):g} MiB, "
             f"{r['compute']} x {r['compute_iters']} a chunk, {r['repeat']} rounds (ms, medians)",
             f"  compute alone {r['seconds_compute'] * 1e3:7.1f}   floor {r['seconds_floor'] * 1e3:7.1f}"]
    for name in PASSES:
        lines.append(f"  {name:<9} unfused {r[f'seconds_{name}_unfused'] * 1e3:7.1f}   fused "
                     f"{r[f'seconds_{name}_fused'] * 1e3:7.1f}   unfused / fused {r[f'{name}_unfused_over_fused']:.3f}")
    lines.append(f"  prefetch / max(read, compute): unfused {r['ratio_prefetch_unfused']:.3f}, fused "
                 f"{r['ratio_prefetch_fused']:.3f}, the floor {r['ratio_floor']:.3f} (target <= 1.15)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cpu or cuda:N (default: a GPU when usable)")
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-mib", type=float, default=None, help="default 16 on a GPU, 0.25 on the CPU")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--compute", choices=["matmul", "launch", "xp", "sleep"], default="matmul")
    ap.add_argument("--scheduler", choices=["sync", "threads"], default="sync")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    print(table(run(device=args.device, chunks=args.chunks, chunk_mib=args.chunk_mib, depth=args.depth,
                    compute=args.compute, scheduler=args.scheduler, repeat=args.repeat)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
