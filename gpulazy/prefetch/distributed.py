"""Read-ahead on ``dask.distributed`` workers (``gpulazy.prefetch.install(client)``).

Each worker runs a ``PrefetchPlugin``: it watches the tasks the scheduler hands that
worker, finds their chunk reads (``find_reads``), keeps them in priority order (the order
the worker will run them) and warms the first ``depth`` of them, within the byte budget,
into the worker's own cache — the same ``ReadAhead`` machinery as the local callback.

A worker can only read ahead as far as the tasks it has been given. With the
scheduler's default ``worker-saturation`` of 1.1 that is about one task beyond those
running, so ``install`` raises the saturation (``1 + depth / nthreads``) unless told
not to. Each plugin records how many chunk-reading tasks were waiting on its worker
each time one started (``summary()["ahead_max"]``, ``["ahead_mean"]``): that is how far
ahead the worker could see.

This module imports ``distributed`` and the planner (``gpulazy.prefetch.plan``);
``prefetch.install`` imports it only when asked.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from typing import Any, Hashable

from distributed import WorkerPlugin

from gpulazy import config
from gpulazy.prefetch.plan import ReadAhead, find_reads

__all__ = ["PrefetchPlugin", "install", "uninstall", "PLUGIN_NAME"]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "gpulazy-prefetch"

# Worker task states in which a task is assigned to this worker but not started yet.
_PENDING = frozenset({"waiting", "ready", "constrained"})
_STARTED = frozenset({"executing", "long-running"})


class PrefetchPlugin(WorkerPlugin):
    """Warm the chunks of the tasks assigned to this worker, in the order it will run them.

    Parameters
    ----------
    depth
        How many chunk reads to run ahead of the tasks executing.
    capacity
        Most bytes of chunks read ahead and not yet used (further held to half of the
        cache's capacity, as in ``gpulazy.prefetch``); ``None``: only that bound.
    """

    idempotent = False
    name = PLUGIN_NAME

    def __init__(self, depth: int, capacity: int | None = None):
        self.depth = int(depth)
        self.capacity = capacity
        self.worker: Any = None
        self._reset()

    def _reset(self) -> None:
        # Its hooks run on the worker's event loop: reads go to the caches' threads (inline=False).
        self._run = ReadAhead(depth=self.depth, capacity=self.capacity, inline=False)
        self._pending: list[tuple[Any, int, Hashable]] = []            # (priority, seq, key), sorted
        self._tracked: dict[Hashable, tuple[tuple, list]] = {}        # key -> (pending item, reads)
        self._seq = itertools.count()
        self._ahead: list[int] = []

    def __getstate__(self) -> dict[str, Any]:
        return {"depth": self.depth, "capacity": self.capacity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["depth"], state["capacity"])  # type: ignore[misc]

    # -- WorkerPlugin hooks

    def setup(self, worker: Any) -> None:
        self.worker = worker
        self._reset()

    def teardown(self, worker: Any) -> None:
        self._run.stop()

    def transition(self, key: Hashable, start: str, finish: str, **kwargs: Any) -> None:
        try:
            self._transition(key, finish)
        except Exception:  # read-ahead must never disturb the worker
            logger.warning("gpulazy prefetch: ignoring an error while planning for %r", key, exc_info=True)

    # -- planning

    def _transition(self, key: Hashable, finish: str) -> None:
        if finish in _PENDING:
            if key not in self._tracked:
                self._track(key)
            return
        tracked = self._tracked.pop(key, None)
        if tracked is None:
            return
        item, reads = tracked
        self._pending.pop(bisect.bisect_left(self._pending, item))
        rids = [rid for rid, _ in reads]
        if finish in _STARTED:
            self._ahead.append(len(self._pending))
            if self._run.plan is not None:
                self._run.plan.consume(rids)
        # A task released before it ran drops out of the order: its queued prefetch is
        # cancelled by the replan below, as stale.
        self._replan()
        self._run.forget(reads)

    def _track(self, key: Hashable) -> None:
        ts = self.worker.state.tasks.get(key)
        if ts is None or ts.run_spec is None:
            return
        found = find_reads(ts.run_spec)
        if not found:
            return
        reads = self._run.keep(((key, i), spec, source) for i, (spec, source) in enumerate(found))
        if not reads:
            return
        item = (tuple(ts.priority or ()), next(self._seq), key)
        bisect.insort(self._pending, item)
        self._tracked[key] = (item, reads)
        self._replan()

    def _replan(self) -> None:
        # Only the first ``depth`` reads can be in the window: pass no more.
        upcoming: list = []
        for _, _, key in self._pending:
            upcoming.extend(self._tracked[key][1])
            if len(upcoming) >= self.depth:
                break
        self._run.reorder(upcoming)

    # -- reporting

    def summary(self) -> dict[str, Any]:
        """Counters for this worker: the ``ReadAhead`` summary plus look-ahead figures.

        ``ahead_max`` / ``ahead_mean``: chunk-reading tasks already assigned to this
        worker and waiting, each time one started — how far ahead it could read.
        """
        out = self._run.summary()
        ahead = self._ahead
        out.update(
            tasks_started=len(ahead),
            ahead_max=max(ahead, default=0),
            ahead_mean=(sum(ahead) / len(ahead)) if ahead else 0.0,
            pending=len(self._pending),
        )
        return out


# --------------------------------------------------------------------------- install


def install(client: Any, depth: int | None = None, capacity: int | str | None = None, *,
            saturation: float | str | None = "auto") -> dict[str, Any]:
    """Register ``PrefetchPlugin`` on every worker (present and future) of ``client``.

    See ``gpulazy.prefetch.install`` for the parameters. Call it while no computation
    runs (it may change the scheduler's ``worker-saturation``).
    """
    depth = int(depth) if depth is not None else int(config.get("prefetch_depth"))
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth!r}")
    cap = None if capacity is None else config.parse_bytes(capacity)
    if saturation not in (None, "auto"):
        try:
            saturation = float(saturation)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise ValueError(f"saturation must be 'auto', None or a number > 0, got {saturation!r}") from e
        if not saturation > 0:
            raise ValueError(f"saturation must be 'auto', None or a number > 0, got {saturation!r}")
    before, after = client.run_on_scheduler(_set_saturation, depth=depth, saturation=saturation)
    client.register_plugin(PrefetchPlugin(depth, cap), name=PLUGIN_NAME)
    return {"depth": depth, "capacity": cap, "saturation": (before, after)}


def uninstall(client: Any) -> None:
    """Remove the plugin (queued prefetches are cancelled) and restore the saturation."""
    client.run_on_scheduler(_restore_saturation)
    client.unregister_worker_plugin(PLUGIN_NAME)


def summaries(client: Any) -> dict[str, dict[str, Any]]:
    """``PrefetchPlugin.summary()`` of each worker, by worker address."""
    return client.run(_worker_summary)


def _worker_summary(dask_worker: Any) -> dict[str, Any] | None:
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return plugin.summary() if plugin is not None else None


_SAVED = "_gpulazy_saturation_before"


def _set_saturation(dask_scheduler: Any, depth: int, saturation: float | str | None) -> tuple[float, float]:
    before = dask_scheduler.WORKER_SATURATION
    if saturation is None:
        return before, before
    if saturation == "auto":
        if math.isinf(before):
            return before, before
        nthreads = [ws.nthreads for ws in dask_scheduler.workers.values()] or [1]
        after = max(before, 1.0 + depth / max(1, min(nthreads)))
    else:
        after = float(saturation)
    if math.isinf(after) != math.isinf(before) and (dask_scheduler.queued or dask_scheduler.unrunnable):
        # The scheduler keeps queued tasks only under a finite saturation.
        raise RuntimeError("cannot switch worker-saturation to or from inf while tasks are queued; "
                           "install the prefetcher before computing")
    if not hasattr(dask_scheduler, _SAVED):
        setattr(dask_scheduler, _SAVED, before)
    dask_scheduler.WORKER_SATURATION = after
    return before, after


def _restore_saturation(dask_scheduler: Any) -> float:
    if hasattr(dask_scheduler, _SAVED):
        dask_scheduler.WORKER_SATURATION = getattr(dask_scheduler, _SAVED)
        delattr(dask_scheduler, _SAVED)
    return dask_scheduler.WORKER_SATURATION
