"""``gpulazy.prefetch`` for Dask's local schedulers: a scheduler callback over ``ReadAhead``.

Imports the planner (``plan``) only; the distributed adapter is imported when
``install`` is called. No Dask import at import time: ``import gpulazy`` imports this.
"""

from __future__ import annotations

import threading
from typing import Any, Hashable, Iterator

from gpulazy import config
from gpulazy.prefetch.plan import ReadAhead, find_reads, window_batch
from gpulazy.spec import ChunkSpec

__all__ = ["prefetch", "plan_graph", "scan_graph"]

# --------------------------------------------------------------------------- local scheduler


class prefetch:  # noqa: N801 - used like a function: ``with gpulazy.prefetch():``
    """Read ahead of Dask's local scheduler into the caches the chunk tasks read from.

    While active, each computation on the ``threads`` or ``sync`` scheduler is planned
    once (``dask.order.order`` predicts the run order; the scheduler's ready list holds it
    when the reads are the graph's roots: ``plan_graph``); as each chunk task starts, the
    next reads within ``depth`` chunks and the byte budget are started in the background
    (``cache.prefetch``), so a task finds its chunk cached or on its way. Queued
    prefetches are cancelled when the computation ends, also when it fails. Nothing runs
    when no prefetch is active.

    Parameters
    ----------
    depth
        How many chunk reads to run ahead of the tasks running. Default:
        ``config.get("prefetch_depth")``, raised to twice the number of tasks seen
        running at once (a large thread pool starts tasks as fast as it has threads).
    capacity
        Most bytes (``"2 GiB"`` or an int) of chunks read ahead and not yet used. The
        look-ahead is further held to half of the capacity of the cache it warms, so it
        never makes an LRU cache evict a chunk needed sooner; size the cache itself with
        ``config.set(cache=...)`` or the array's own ``DeviceCache``.
    cache
        A ``DeviceCache`` (or its name): warm only the reads that go through this cache.
        By default every read that goes through a cache is warmed, each into its own
        (a read built with ``cache=False`` is never warmed: there is nowhere to keep it).

    Notes
    -----
    Registered (``with``, ``register``) while dask culls the graph, it keeps one read
    task per chunk of a gpulazy array and warms them as above. Passed as
    ``compute(callbacks=[p])`` it arrives after culling: the reads are batched then, and
    it gives each compute's read window (``gpulazy._batchread.ReadWindow``) the order
    ``dask.order`` predicts instead of warming the same chunks through the cache.

    Use ``with gpulazy.prefetch():``, ``p.register()`` / ``p.unregister()``, or per
    computation ``x.compute(callbacks=[gpulazy.prefetch()])`` (best when several threads
    compute at once: Dask's active callbacks are process-global). The ``processes``
    scheduler runs tasks in other processes, whose caches this one cannot warm; for
    ``dask.distributed`` use ``gpulazy.prefetch.install(client)``.

    Examples
    --------
    >>> import gpulazy, numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp(); np.arange(64, dtype="uint16").tofile(os.path.join(d, "a.raw"))
    >>> vol = gpulazy.from_files(os.path.join(d, "a.raw"), shape=(8, 8), dtype="uint16",
    ...                          chunks=(2, 8), device="cpu")
    >>> with gpulazy.prefetch(depth=2):
    ...     int(vol.sum().compute())
    2016
    """

    def __init__(self, depth: int | None = None, capacity: int | str | None = None,
                 cache: Any = None):
        if depth is not None and int(depth) < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth!r}")
        self.depth = None if depth is None else int(depth)
        self.capacity = None if capacity is None else config.parse_bytes(capacity)
        self.cache = cache
        self._runs: dict[int, ReadAhead] = {}
        self._lock = threading.Lock()
        #: ``ReadAhead.summary()`` of the last computation that finished.
        self.last_summary: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"gpulazy.prefetch(depth={self.depth}, capacity={self.capacity}, cache={self.cache!r})"

    # -- activation (duck-typed dask Callback: no Dask import when gpulazy is imported)

    @property
    def _callback(self) -> tuple:
        return (None, self._start_state, self._pretask, None, self._finish)

    # ``compute(callbacks=[p])`` hands ``p`` to the scheduler as a 5-tuple of hooks.
    def __iter__(self) -> Iterator:
        return iter(self._callback)

    def __getitem__(self, i: int) -> Any:
        return self._callback[i]

    def __len__(self) -> int:
        return 5

    def register(self) -> None:
        """Turn read-ahead on for every local computation until ``unregister``."""
        from dask.callbacks import Callback

        Callback.active.add(self._callback)

    def unregister(self) -> None:
        """Turn it off again."""
        from dask.callbacks import Callback

        Callback.active.discard(self._callback)

    def __enter__(self) -> prefetch:
        self.register()
        return self

    def __exit__(self, *exc: object) -> None:
        self.unregister()

    # -- dask hooks

    def _start_state(self, dsk: dict, state: dict) -> None:
        depth = self.depth or config.get("prefetch_depth")
        only = self._only_cache()
        run = ReadAhead(depth=depth, capacity=self.capacity, only=only)
        windows: dict[int, tuple[Any, list[int]]] = {}
        by_task = plan_graph(dsk, run, windows, ready=state.get("ready"))
        if not by_task and not windows:
            return
        run.by_task = by_task
        run.windows = [window for window, _ in windows.values()]
        with self._lock:
            self._runs[id(state)] = run
        for window, order in windows.values():
            if self.capacity is not None:
                window.ahead = min(window.ahead, self.capacity)
            window.set_order(order)  # its first batches start now, before the first task
        if by_task:
            run.start([r for rids in by_task.values() for r in rids])

    def _pretask(self, key: Any, dsk: dict, state: dict) -> None:
        run = self._runs.get(id(state))
        if run is not None:
            reads = run.by_task.get(key)
            if reads:
                if self.depth is None and run.plan is not None:
                    # Many tasks at once (a big thread pool) consume the window as fast:
                    # keep twice as many reads ahead as run together (budget still bounds).
                    run.plan.depth = max(run.plan.depth, 2 * len(state.get("running", ())))
                run.started(rid for rid, _ in reads)

    def _finish(self, dsk: dict, state: dict, errored: bool) -> None:
        with self._lock:
            run = self._runs.pop(id(state), None)
        if run is not None:
            run.stop()
            windows = run.windows
            self.last_summary = dict(run.summary(), errored=bool(errored),
                                     batches=sum(len(w.batches) for w in windows),
                                     batches_read_ahead=sum(w.read_ahead for w in windows),
                                     batches_started_by_task=sum(w.started_by_task for w in windows))

    def _only_cache(self) -> Any:
        if self.cache is None or not isinstance(self.cache, str):
            return self.cache
        from gpulazy.cache import cache_by_name

        return cache_by_name(self.cache)

    # -- dask.distributed

    @staticmethod
    def install(client: Any, depth: int | None = None, capacity: int | str | None = None, *,
                saturation: float | str | None = "auto") -> dict[str, Any]:
        """Read ahead on every worker of a ``dask.distributed`` cluster.

        Registers a worker plugin: each worker plans from the tasks the scheduler has
        assigned to it (in priority order) and warms their chunks into its own cache.
        With the scheduler's default ``worker-saturation`` (1.1) a worker holds about one
        task beyond those running, which is all it could read ahead, so by default
        (``saturation="auto"``) the scheduler's saturation is raised to
        ``1 + depth / nthreads`` (``nthreads`` of the smallest worker), enough for
        ``depth`` queued tasks per worker and still bounded. Pass a number to choose it,
        or ``None`` to leave the scheduler alone. ``uninstall`` undoes both.

        Returns ``{"saturation": (before, after)}``.
        """
        from gpulazy.prefetch.distributed import install

        return install(client, depth=depth, capacity=capacity, saturation=saturation)

    @staticmethod
    def uninstall(client: Any) -> None:
        """Remove the worker plugin and restore the scheduler's saturation."""
        from gpulazy.prefetch.distributed import uninstall

        uninstall(client)

    @staticmethod
    def summaries(client: Any) -> dict[str, dict[str, Any] | None]:
        """Each worker's read-ahead counters, by address (``None`` where not installed).

        Includes ``ahead_max`` / ``ahead_mean``: how many chunk-reading tasks were
        already assigned to the worker each time one started, i.e. how far it could
        read ahead.
        """
        from gpulazy.prefetch.distributed import summaries

        return summaries(client)


def plan_graph(dsk: dict, run: ReadAhead, windows: dict | None = None,
               ready: list | None = None) -> dict[Any, list[tuple[Hashable, ChunkSpec]]]:
    """Read tasks of ``dsk`` in run order: ``{task_key: [(read_id, spec), ...]}``.

    Only reads that ``run`` can warm are kept; an empty result means there is nothing
    to read ahead (and ``dask.order`` is not even called). The batches of a compute's
    ``ReadWindow`` are left to their window; given ``windows``, it is filled with
    ``{id(window): (window, [batch, ...] in run order)}``.

    ``ready``: the local scheduler's ready tasks (``state["ready"]``), which it keeps sorted by
    ``dask.order``'s priorities, last to run first. When every read task is among them (reads
    are the graph's roots), their order is taken from it instead of ordering the graph again:
    ``dask.order`` over the graph of a 64-chunk compute cost about as much as a chunk's read.
    """
    found, batches = scan_graph(dsk)
    if not found and not (batches and windows is not None):
        return {}
    priority = _ready_rank(ready, found, batches)
    if priority is None:
        from dask.order import order

        priority = order(dsk)
    if windows is not None:
        for key in sorted(batches, key=lambda k: priority.get(k, 0)):
            window, j = batches[key]
            if run.only is None or run.cache_for(window.source) is not None:  # ``prefetch(cache=...)``
                windows.setdefault(id(window), (window, []))[1].append(j)
    by_task: dict[Any, list[tuple[Hashable, ChunkSpec]]] = {}
    for key in sorted(found, key=lambda k: priority.get(k, 0)):
        kept = run.keep(((key, i), spec, source) for i, (spec, source) in enumerate(found[key]))
        if kept:
            by_task[key] = kept
    return by_task


def scan_graph(dsk: dict) -> tuple[dict, dict]:
    """``(found, batches)``: each task's gpulazy reads (``{key: [(spec, source), ...]}``, tasks with
    some) and the tasks that are batches of a ``ReadWindow`` (``{key: (window, j)}``)."""
    found, batches = {}, {}
    for key, task in dsk.items():
        in_window = window_batch(task)
        if in_window is not None:
            batches[key] = in_window
            continue
        reads = find_reads(task)
        if reads:
            found[key] = reads
    return found, batches


def _ready_rank(ready: list | None, *groups: dict) -> dict | None:
    """Each key's place in the run order of ``ready`` (the scheduler's ready list, last to run
    first), when every key of ``groups`` is in it; else None."""
    if not ready:
        return None
    rank = {key: i for i, key in enumerate(reversed(ready))}
    if any(key not in rank for group in groups for key in group):
        return None
    return rank

