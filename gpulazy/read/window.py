"""A window of one compute's read batches: each submitted whole, ``read_ahead`` bytes started early.

``ReadWindow`` holds the batches of one compute's ``read_batch`` tasks (made when the graph
is culled, ``gpulazy._readlayer``). Its batches are submitted one whole batch at a time
(each one engine submission, ``gpulazy.read.cached.CachedBatch``), and each task starts the
batches likely to run next, up to config ``read_ahead`` bytes. Measured on an H100
(``benchmarks/overlap_timeline.py``): batch tasks that each submitted their own batch, eight
at once from eight scheduler threads, took 1 to 45 ms to submit and their reads landed
interleaved, the last batch 130 ms in, where the whole-array read, which submits everything
in order from one thread, lands chunk after chunk and ends at 96 ms. Under the sync scheduler
the read-ahead is also what overlaps reading the next batches with computing on this one.

A compute that reads more bytes through a cache than the cache holds is a pass an LRU cannot
keep (``DeviceCache.keeps``): each chunk would be copied into the cache (``DeviceCache.get`` keeps a
copy of what it hands out) and evicted before any reuse. Its chunks are handed to their ``pick``
tasks as read, uncached (``CachedBatch.start(keep=False)``), as ``gpulazy.prefetch`` and streamed
reductions do for such a pass. On an H200 host the copy and its wait had taken 0.1 ms of the task's
thread a chunk of 16 MiB on the sync scheduler, 1.7 ms on the threaded one, where the tasks' threads
wait for the GIL; a ``map_blocks`` over 1 GiB through a 320 MiB cache took 0.80-0.94 of the time
without them (benchmarks/RESULTS.md, twenty-third and twenty-fourth sessions).
A window exists only in the process that culled the graph: pickled (to ``dask.distributed``
workers) it becomes ``None`` and every batch task reads its own batch and returns its arrays
(a batch in flight cannot travel to another worker). Batches started and never claimed, or
claimed and never picked (a compute that failed elsewhere), go with the graph: the backend's
batch waits for its reads before its buffers are freed.
"""

from __future__ import annotations

import threading
from typing import Any

from gpulazy.read.cached import CachedBatch
from gpulazy.spec import ChunkSpec

__all__ = ["ReadWindow"]


class ReadWindow:
    """The read batches of one compute, each submitted whole, with ``read_ahead`` bytes started early.

    ``claim(j)`` is batch ``j``'s task: it claims the batch (starting it if nobody had)
    and starts the batches expected to run next while the started and unclaimed ones
    stay within ``ahead`` bytes; the batch's ``pick`` tasks then wait for their own
    chunks. Every submission happens under one lock, so the reads of concurrent batch
    tasks never interleave in the I/O queue: each batch lands as a whole, in the order
    they were started. A read-ahead that fails to start (no memory, a file gone) is
    dropped: that batch's task reads it and raises then.

    Which batches run next: the order dask will run them in, when a ``gpulazy.prefetch``
    has given it (``set_order``, from ``dask.order``). Otherwise a guess: on, cyclically,
    from the batch claimed last in the direction the claims have been moving, and downwards
    at first. Dask orders independent roots as the rest of the graph suits it, and mostly
    from the last down (found with ``ReadWindow.claim`` logged, 8 batches):
    ``sum``, ``std``, ``astype().sum`` and ``rechunk`` 7, 6, ..., 0; ``map_blocks`` and
    ``mean(axis=(1, 2))`` 1, 0, 7, 6, ..., 2; a MIP 7, 6, 4, 5, 1, 0, 3, 2.
    A batch the guess did not start waits behind the read-ahead already queued.
    """

    def __init__(self, batches: list[tuple[ChunkSpec, ...]], source: Any, ahead: int):
        self.batches, self.source, self.ahead = batches, source, ahead
        self._lock = threading.Lock()
        self._state: list[Any] = [None] * len(batches)  # None: not started; CachedBatch; True: claimed
        self._inflight = 0                               # bytes started and not yet claimed
        self._last: int | None = None                    # the batch claimed last
        self._order: list[int] | None = None             # the run order, when known
        self._keep: bool | None = None                   # whether its chunks go into the cache
        #: Batches started ahead of their tasks, and those their task had to start itself.
        self.read_ahead = self.started_by_task = 0

    def __reduce__(self) -> tuple:
        return _no_window, ()  # another process: each batch task reads its own batch

    def load(self, j: int) -> list[Any]:
        """Batch ``j``'s arrays, in order (``claim(j).result()``)."""
        return self.claim(j).result()

    def claim(self, j: int) -> CachedBatch:
        """Batch ``j``, started (now, unless read ahead already), and the read-ahead after it."""
        with self._lock:
            mine = self._state[j]
            if isinstance(mine, CachedBatch):
                self._inflight -= _nbytes(mine.specs)
            self._state[j] = True
            if not isinstance(mine, CachedBatch):  # not started yet (or a task run again)
                mine = CachedBatch.start(self.source, self.batches[j], keep=self._kept())
                self.started_by_task += 1
            self._top_up(self._next(j))
            self._last = j
        return mine

    def set_order(self, order: list[int]) -> None:
        """The batches in the order their tasks will run; start the first ``ahead`` bytes of them now."""
        with self._lock:
            self._order = [j for j in order if 0 <= j < len(self.batches)]
            self._top_up(iter(self._order))

    def _next(self, j: int) -> Any:
        # Lock held. The batches expected after ``j``, nearest first.
        if self._order is not None:
            return iter(self._order)  # the claimed and started ones are skipped
        n, last = len(self.batches), self._last
        step = 1 if last is not None and (j - last) % n < (last - j) % n else -1
        return ((j + step * k) % n for k in range(1, n))

    def _kept(self) -> bool:
        # Lock held. Whether the chunks go into their cache: only when the whole compute fits it.
        if self._keep is None:
            cache = self.source.cache_instance()
            self._keep = cache is None or cache.keeps(sum(map(_nbytes, self.batches)))
        return self._keep

    def _top_up(self, upcoming: Any) -> None:
        # Lock held. Start the unstarted batches of ``upcoming``, in order, while they fit.
        state = self._state
        for i in upcoming:
            if state[i] is not None:
                continue
            nbytes = _nbytes(self.batches[i])
            if self._inflight + nbytes > self.ahead:
                return
            try:
                state[i] = CachedBatch.start(self.source, self.batches[i], keep=self._kept())
            except Exception:
                return  # its own task reads it, and raises there
            self._inflight += nbytes
            self.read_ahead += 1


def _nbytes(specs: tuple[ChunkSpec, ...]) -> int:
    return sum(s.out_nbytes for s in specs)


def _no_window() -> None:
    return None
