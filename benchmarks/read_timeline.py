"""How a read of a store spends its time: each op's median, and a timeline of its engine submissions.

    python benchmarks/bench_formats.py --size 2GiB --only zarr-3d,zarr-zstd-3d --ops slice --dir /tmp/bf
    python benchmarks/read_timeline.py /tmp/bf/gpulazy-bench-formats/zarr-3d-*/vol.zarr
    python benchmarks/read_timeline.py /tmp/bf/gpulazy-bench-formats/zarr-zstd-3d-*/vol.zarr --sweep

Ops, for ``n`` planes and ``half = n // 2``: the whole array, the slice ``[1:half+1]``, the first
two chunk rows' planes ``[0:half]``, the MIP ``max(axis=0)``, ``mean()`` and ``astype("f8").sum()``.
Prints each op's median over ``--rounds`` (after two warm-up passes) and its rate as a fraction of the whole read's.
Then, for one pass of each op in ``--timeline``, every ``gpulazy.read.engine.start`` (a
submission: from when it is called to when it returns), every ``Reads._finish`` (waiting for a
submission's reads, decoding and placing them) and every call of ``CALLS``, in ms from the op's
start, with the thread (and a submission's chunks and their stored MiB). The time to build the
slice (``vol[1:half+1]``, nothing read) is printed apart.

``--first`` times, for each op, how long after its ``compute()`` call its first submission is
made (the op is stopped there, nothing read): the host's work before any byte moves, medians of
``--rounds`` x 5 tries.

``--sweep`` times the whole read, the slice and ``[0:half]`` under several settings of the first
submission's size (``gpulazy.read.whole.GROUP``), the largest decoding submission
(``DECODE_GROUP``) and the submissions settling at once (``SETTLERS``), set at run time in one
process, rounds alternating between settings.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import threading
import time
from typing import Any, Callable

MIB = 1 << 20
#: ``--sweep``'s settings: (first submission bytes, largest decoding submission bytes, settle threads).
SWEEP = {"256M 1G 2": (256 * MIB, 1024 * MIB, 2), "128M 1G 2": (128 * MIB, 1024 * MIB, 2),
         "64M 1G 2": (64 * MIB, 1024 * MIB, 2), "128M 512M 2": (128 * MIB, 512 * MIB, 2),
         "256M 256M 2": (256 * MIB, 256 * MIB, 2), "128M 256M 3": (128 * MIB, 256 * MIB, 3),
         "128M 512M 3": (128 * MIB, 512 * MIB, 3), "64M 256M 4": (64 * MIB, 256 * MIB, 4),
         # Few large calls: on an H200 one nvCOMP call of 64 or 128 frames of 8 MiB took 19-21 ms alone.
         "512M 1G 2": (512 * MIB, 1024 * MIB, 2), "1G 1G 2": (1024 * MIB, 1024 * MIB, 2)}


def ops_of(vol: Any) -> dict[str, tuple[Callable[[], Any], float]]:
    """Each op and the share of the array's bytes it reads."""
    half = vol.shape[0] // 2
    return {"whole": (lambda: vol.compute(), 1.0),
            "slice": (lambda: vol[1:half + 1].compute(), half / vol.shape[0]),
            "rows": (lambda: vol[0:half].compute(), half / vol.shape[0]),
            "mip": (lambda: vol.max(axis=0).compute(), 1.0),
            "mean": (lambda: vol.mean().compute(), 1.0),
            "astype_sum": (lambda: vol.astype("f8").sum().compute(), 1.0)}


def timed(fn: Callable[[], Any], dev: Any) -> float:
    dev.wait_all()
    t0 = time.perf_counter()
    fn()
    dev.wait_all()
    return time.perf_counter() - t0


def medians(cases: dict[str, Callable[[], Any]], dev: Any, rounds: int) -> dict[str, float]:
    for fn in cases.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(timed(fn, dev))
    return {name: statistics.median(ts) for name, ts in times.items()}


#: Functions whose calls the timeline shows too (module, attribute path): what comes before the
#: first submission, and what a submission's finish does once its reads are in (placing, stats, copies).
CALLS = [("gpulazy.read.whole", "inflight_room"), ("gpulazy.read.whole", "part_of"),
         ("gpulazy.read.whole", "read_in_order"), ("gpulazy.device", "Device.alloc_many"),
         # A finish's reads are all in when it starts placing (``_place``); its files are stat'ed after.
         ("gpulazy.read.engine", "Reads._place"), ("gpulazy.read.engine", "Reads._check_landed"),
         ("gpulazy.read.whole", "_copy_part")]


class Timeline:
    """Records engine submissions and finishes, and the calls of ``CALLS``, while active (``with``)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, str, str, int, int]] = []
        self.t0 = 0.0

    def __enter__(self) -> Timeline:
        import importlib

        from gpulazy.read import engine

        self._saved = (engine.start, engine.Reads._finish)
        real_start, real_finish = self._saved
        events, me = self.events, self
        self._calls = []
        for module, path in CALLS:
            owner = importlib.import_module(module)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            real = getattr(owner, name)
            self._calls.append((owner, name, real))

            def call(*args, _real=real, _path=path, **kwargs):
                t = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    events.append((t - me.t0, time.perf_counter() - me.t0, _path, threading.current_thread().name,
                                   0, 0))

            setattr(owner, name, call)

        def start(specs, *args, **kwargs):
            t = time.perf_counter()
            reads = real_start(specs, *args, **kwargs)
            events.append((t - me.t0, time.perf_counter() - me.t0, "submit", threading.current_thread().name,
                           len(specs), sum(s.nbytes for s in specs) // MIB))
            return reads

        def finish(reads, idx):
            t = time.perf_counter()
            real_finish(reads, idx)
            events.append((t - me.t0, time.perf_counter() - me.t0, "finish", threading.current_thread().name,
                           len(idx), sum(reads.specs[i].nbytes for i in idx) // MIB))

        engine.start, engine.Reads._finish = start, finish
        return self

    def __exit__(self, *exc: object) -> None:
        from gpulazy.read import engine

        engine.start, engine.Reads._finish = self._saved
        for owner, name, real in reversed(self._calls):
            setattr(owner, name, real)

    def run(self, fn: Callable[[], Any], dev: Any) -> float:
        self.events.clear()
        dev.wait_all()
        self.t0 = time.perf_counter()
        fn()
        dev.wait_all()
        return time.perf_counter() - self.t0


class _Submitted(BaseException):
    """Raised by the first submission under ``first_submission`` (a ``BaseException``: no handler
    of an op's own may take it for a read error)."""


def first_submission(ops: dict[str, Callable[[], Any]], tries: int) -> dict[str, float]:
    """Median seconds from each op's call to its first ``engine.start`` (stopped there)."""
    from gpulazy.read import engine

    real = engine.start

    def stop(*args: Any, **kwargs: Any) -> Any:
        raise _Submitted(time.perf_counter())

    def until_submitted(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        try:
            fn()
        except _Submitted as e:
            return e.args[0] - t0
        raise RuntimeError("the op made no engine submission")

    engine.start = stop
    try:
        for fn in ops.values():
            until_submitted(fn)  # warm-up
        return {name: statistics.median(until_submitted(fn) for _ in range(tries)) for name, fn in ops.items()}
    finally:
        engine.start = real


def sweep(vol: Any, dev: Any, rounds: int) -> None:
    from gpulazy.read import whole

    ops = ops_of(vol)
    cases = {name: ops[name][0] for name in ("whole", "slice", "rows")}
    saved = (whole.GROUP, whole.DECODE_GROUP, whole.SETTLERS)
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for fn in cases.values():
            fn()
        for _ in range(rounds):
            for setting, values in SWEEP.items():
                whole.GROUP, whole.DECODE_GROUP, whole.SETTLERS = values
                for name, fn in cases.items():
                    times.setdefault((setting, name), []).append(timed(fn, dev))
    finally:
        whole.GROUP, whole.DECODE_GROUP, whole.SETTLERS = saved
    share = ops["slice"][1]
    print(f"{'first, most, settlers':22s} {'whole ms':>9s} {'slice ms':>9s} {'rows ms':>9s}  slice / whole rate")
    for setting in SWEEP:
        w, s, r = (statistics.median(times[(setting, name)]) * 1e3 for name in cases)
        ratio = statistics.median(share * b / a for a, b in zip(times[(setting, "slice")], times[(setting, "whole")]))
        print(f"{setting:22s} {w:9.1f} {s:9.1f} {r:9.1f}  {ratio:.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--timeline", default="whole,slice,mip", help="comma list of ops to draw ('' for none)")
    ap.add_argument("--sweep", action="store_true", help="also time whole, slice and rows under SWEEP's settings")
    ap.add_argument("--first", action="store_true", help="also time each op up to its first submission")
    args = ap.parse_args(argv)
    import gpulazy
    from gpulazy.device import get_device

    dev = get_device(args.device)
    vol = gpulazy.from_files(glob.glob(args.store)[0], device=args.device, cache=False)
    print(f"{args.store}: {vol.shape} {vol.dtype}, dask chunks {vol.chunksize}, {vol.nbytes / 2**30:.2f} GiB",
          flush=True)
    ops = ops_of(vol)
    got = medians({name: fn for name, (fn, _) in ops.items()}, dev, args.rounds)
    for name, (_, share) in ops.items():
        print(f"{name:10s} {got[name] * 1e3:8.1f} ms  {share * got['whole'] / got[name]:.2f} x the whole read's rate")
    half = vol.shape[0] // 2
    index = statistics.median(timed(lambda: vol[1:half + 1], dev) for _ in range(args.rounds))
    print(f"building the slice [1:{half + 1}] (no read): {index * 1e3:.2f} ms")
    with Timeline() as tl:
        for name in filter(None, args.timeline.split(",")):
            total = min(tl.run(ops[name][0], dev) for _ in range(3))  # the events are the last pass's
            print(f"-- {name}: {total * 1e3:.1f} ms (fastest of 3), the last pass's events:")
            for a, b, kind, thread, n, mib in sorted(tl.events):
                what = f"{n:4d} chunks {mib:6d} MiB stored" if kind in ("submit", "finish") else ""
                print(f"   {a * 1e3:8.2f} -> {b * 1e3:8.2f} ms  {kind:6s} {thread:24s} {what}")
    if args.first:
        for name, t in first_submission({name: fn for name, (fn, _) in ops.items()}, 5 * args.rounds).items():
            print(f"{name:10s} first submission {t * 1e3:.3f} ms after compute() (median)")
    if args.sweep:
        sweep(vol, dev, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
