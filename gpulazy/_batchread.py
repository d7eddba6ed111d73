"""Batched reads of a compute: a batch started now and finished later, and a window of them.

``PendingBatch`` is ``ChunkSource.load_many`` split in two: ``start`` serves what the
cache holds and submits the other chunks' reads from the calling thread; ``result()``
waits for them, checks them and offers them to the cache; ``chunk(i)`` does the same for
one chunk, so each ``pick`` task of a windowed batch waits for its own read only.

``ReadWindow`` holds the batches of one compute's ``read_batch`` tasks (made when the
graph is culled, ``gpulazy._readlayer``). Its batches are submitted one whole batch at a
time, and each task starts the batches likely to run next, up to config ``read_ahead``
bytes. Measured on an H100 (``benchmarks/overlap_timeline.py``): batch tasks that each
submitted their own batch, eight at once from eight scheduler threads, took 1 to 45 ms
to submit and their reads landed interleaved, the last batch 130 ms in, where the
whole-array read, which submits everything in order from one thread, lands chunk
after chunk and ends at 96 ms. Under the sync scheduler the read-ahead is also what
overlaps reading the next batches with computing on this one.

A window exists only in the process that culled the graph: pickled (to
``dask.distributed`` workers) it becomes ``None`` and every batch task reads its own
batch and returns its arrays (a batch in flight cannot travel to another worker).
Batches started and never claimed, or claimed and never picked (a compute that failed
elsewhere), go with the graph: the backend's batch waits for its reads before its
buffers are freed.
"""

from __future__ import annotations

import threading
from typing import Any

from gpulazy import config
from gpulazy.spec import ChunkSpec

__all__ = ["PendingBatch", "ReadWindow"]


class PendingBatch:
    """Chunks of one batch: served from the cache or in flight; ``result()`` gives their arrays."""

    __slots__ = ("source", "specs", "arrays", "held", "todo", "pending", "slot")

    def __init__(self, source: Any, specs: tuple[ChunkSpec, ...]):
        self.source, self.specs = source, specs
        self.arrays: list[Any] = [None] * len(specs)
        self.held: list[int] = []      # chunks a prefetch of the cache is reading
        self.todo: list[int] = []      # chunks read here
        self.pending: list[Any] = []   # their ``PendingChunk``s
        self.slot: dict[int, int] = {} # chunk -> its place in ``todo`` and ``pending``

    @classmethod
    def start(cls, source: Any, specs: tuple[ChunkSpec, ...]) -> PendingBatch:
        """Serve the cached chunks of ``specs`` and submit reads for the rest, from this thread."""
        self = cls(source, specs)
        from gpulazy.integrity import check_all_unchanged

        check_all_unchanged(specs)  # a cached chunk of a file changed since indexing is never served
        cache = source.cache_instance()
        if cache is not None:
            self.arrays = cache.get_cached(specs)
        for i, spec in enumerate(specs):
            if self.arrays[i] is None:
                (self.held if cache is not None and cache.holds(spec) else self.todo).append(i)
        if self.todo:
            self.pending = self._submit([specs[i] for i in self.todo])
            self.slot = {i: k for k, i in enumerate(self.todo)}
        return self

    def _submit(self, batch: list[ChunkSpec]) -> list[Any]:
        from gpulazy.device import get_device
        from gpulazy.io import start_chunks
        from gpulazy.memory import retry_on_oom

        source, first = self.source, batch[0]
        try:
            return retry_on_oom(
                lambda: start_chunks(batch, source.backend_instance(), staged=config.get("staging") != "never",
                                     verify=source.verify),  # verified as each read lands; no cache then
                device=get_device(source.device), nbytes=sum(s.out_nbytes for s in batch),
                what=f"reading {len(batch)} chunks from {first.index} of {first.paths[0]!r}" if first.ranges
                else "reading chunks")
        except OSError as e:
            _raise_read_error(e, first)

    def result(self) -> list[Any]:
        """The arrays, in order, each complete on every stream; raises the first read's error."""
        source, specs, arrays = self.source, self.specs, self.arrays
        cache = source.cache_instance()
        for i in self.held:
            arrays[i] = cache.get(specs[i], source.read)  # a hit (or, if evicted meanwhile, a read)
        if self.todo:
            read = self._finish()
            from gpulazy.integrity import check_all_unchanged

            check_all_unchanged([specs[i] for i in self.todo])  # written to during the read: mixed bytes
            for i, arr in zip(self.todo, read):
                arrays[i] = arr if cache is None else cache.get(specs[i], lambda s, a=arr: a)
        return arrays

    def chunk(self, i: int) -> Any:
        """Chunk ``i``'s array as soon as its own read is in; the rest of the batch may still be reading.

        The ``pick`` task of one chunk calls this, so a compute on a batch's first chunk
        starts when that chunk lands, not when the whole batch has. Safe from several
        threads at once (for different chunks, or the same one twice).
        """
        source, spec = self.source, self.specs[i]
        arr = self.arrays[i]
        if arr is not None:
            return arr
        cache = source.cache_instance()
        k = self.slot.get(i)
        if k is None:  # held: a prefetch of the cache is reading it
            return cache.get(spec, source.read)
        try:
            read = self.pending[k].result()
        except OSError as e:
            _raise_read_error(e, spec)
        from gpulazy.integrity import check_all_unchanged

        check_all_unchanged((spec,))  # written to during the read: mixed bytes
        return read if cache is None else cache.get(spec, lambda s, a=read: a)

    def _finish(self) -> list[Any]:
        from gpulazy.io import finish_chunks

        try:
            return finish_chunks(self.pending)
        except OSError as e:
            _raise_read_error(e, self.specs[self.todo[0]])


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
        self._state: list[Any] = [None] * len(batches)  # None: not started; PendingBatch; True: claimed
        self._inflight = 0                               # bytes started and not yet claimed
        self._last: int | None = None                    # the batch claimed last
        self._order: list[int] | None = None             # the run order, when known
        #: Batches started ahead of their tasks, and those their task had to start itself.
        self.read_ahead = self.started_by_task = 0

    def __reduce__(self) -> tuple:
        return _no_window, ()  # another process: each batch task reads its own batch

    def load(self, j: int) -> list[Any]:
        """Batch ``j``'s arrays, in order (``claim(j).result()``)."""
        return self.claim(j).result()

    def claim(self, j: int) -> PendingBatch:
        """Batch ``j``, started (now, unless read ahead already), and the read-ahead after it."""
        with self._lock:
            mine = self._state[j]
            if isinstance(mine, PendingBatch):
                self._inflight -= _nbytes(mine.specs)
            self._state[j] = True
            if not isinstance(mine, PendingBatch):  # not started yet (or a task run again)
                mine = PendingBatch.start(self.source, self.batches[j])
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
                state[i] = PendingBatch.start(self.source, self.batches[i])
            except Exception:
                return  # its own task reads it, and raises there
            self._inflight += nbytes
            self.read_ahead += 1


def _raise_read_error(error: OSError, spec: ChunkSpec) -> None:
    """Raise ``error`` as a ``ChunkReadError`` naming ``spec``'s file (itself if it is one already)."""
    from gpulazy.integrity import as_read_error

    err = as_read_error(error, spec)
    if err is error:
        raise error
    raise err from error


def _nbytes(specs: tuple[ChunkSpec, ...]) -> int:
    return sum(s.out_nbytes for s in specs)


def _no_window() -> None:
    return None
