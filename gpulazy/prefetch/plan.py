"""The read-ahead policy, shared by every adapter: ``ReadAheadPlan``, ``find_reads``, ``ReadAhead``.

The bottom of ``gpulazy.prefetch``: it imports neither Dask nor the adapters
(``local``: the dask callback; ``distributed``: the worker plugin), which import it.

Why half the cache: a plain LRU cache evicts the entry used least recently. A chunk
warmed ahead has not been used yet, so it is older than the chunks the scheduler has
just consumed; if the look-ahead could fill the cache, the next insertion would evict a
warmed chunk needed *before* the one being warmed. With at most ``budget`` bytes warmed
and not yet used, the entries newer than the oldest such chunk hold at most
``2 * budget`` bytes (the warmed ones, plus those consumed since it was warmed, which
were ahead of it in the same window), so ``budget <= capacity / 2`` means eviction
always finds an older, already-used entry first.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Hashable, Iterable, Iterator

from gpulazy.spec import ChunkSpec

__all__ = ["ReadAheadPlan", "find_reads", "window_batch", "ReadAhead", "CACHE_FRACTION"]

#: The look-ahead never holds more than this fraction of a cache (see the module docstring).
CACHE_FRACTION = 0.5

# --------------------------------------------------------------------------- the policy


class ReadAheadPlan:
    """Which chunk reads to start next, given the order a scheduler will run them in.

    The plan walks the reads not yet consumed (started by the scheduler), in order, and
    keeps a *window*: at most ``depth`` reads whose decoded sizes sum to at most
    ``budget`` bytes. Reads in the window that are neither issued already nor cached are
    returned by ``next_reads`` and count as issued until ``consume`` says the scheduler
    started them. So the bytes warmed and not yet used never exceed ``budget``, and a
    read is never issued while an earlier one that is not cached waits outside the window.

    Parameters
    ----------
    reads
        The reads in the order they will run: ``ChunkSpec`` objects (identified by
        ``spec.key``) or ``(read_id, spec)`` pairs.
    depth
        Most reads in the window.
    budget
        Most bytes (``spec.out_nbytes``, what the cache holds) in the window. Keep it
        below the cache's capacity (``prefetch`` uses half of it).

    Examples
    --------
    >>> from gpulazy.spec import ByteRange, ChunkSpec
    >>> specs = [ChunkSpec((ByteRange("f", 100 * i, 100),), (100,), "u1") for i in range(6)]
    >>> plan = ReadAheadPlan(specs, depth=4, budget=250)
    >>> [s.ranges[0].offset for _, s in plan.next_reads()]       # 2 x 100 bytes fit
    [0, 100]
    >>> plan.consume([specs[0].key])                             # the scheduler starts chunk 0
    >>> [s.ranges[0].offset for _, s in plan.next_reads()]
    [200]
    >>> plan.outstanding_bytes
    200
    >>> [s.ranges[0].offset for s in plan.set_order(specs[4:])]  # order changed: cancel these
    [100, 200]
    """

    def __init__(self, reads: Iterable[ChunkSpec | tuple[Hashable, ChunkSpec]] = (), *,
                 depth: int, budget: int):
        if int(depth) < 0 or int(budget) < 0:
            raise ValueError(f"depth and budget must be >= 0, got depth={depth!r}, budget={budget!r}")
        self.depth = int(depth)
        self.budget = int(budget)
        self._order: list[Hashable] = []
        self._specs: dict[Hashable, ChunkSpec] = {}
        self._cursor = 0
        self._consumed: set[Hashable] = set()
        self._issued: dict[Hashable, ChunkSpec] = {}
        #: Totals since creation, for reports and tests.
        self.issued_total = 0
        self.peak_outstanding_bytes = 0
        self.set_order(reads)

    # -- inputs

    def set_order(self, reads: Iterable[ChunkSpec | tuple[Hashable, ChunkSpec]]) -> list[ChunkSpec]:
        """Replace the upcoming reads; return issued reads that are no longer wanted.

        The caller should cancel the returned specs (``cache.cancel(specs)``): they are
        outside the new window, and were forgotten by the plan. Reads already consumed
        stay consumed.
        """
        order: list[Hashable] = []
        specs: dict[Hashable, ChunkSpec] = {}
        for rid, spec in _normalise(reads):
            if rid not in specs:
                order.append(rid)
                specs[rid] = spec
        self._order, self._specs, self._cursor = order, specs, 0
        self._consumed &= specs.keys()
        self._advance()
        wanted = {rid for rid, _, _ in self._window(None)}
        stale = [rid for rid in self._issued if rid not in wanted]
        return [self._issued.pop(rid) for rid in stale]

    def consume(self, read_ids: Iterable[Hashable]) -> None:
        """The scheduler started these reads: they leave the window (and the budget)."""
        for rid in read_ids:
            self._issued.pop(rid, None)
            if rid in self._specs:
                self._consumed.add(rid)
        self._advance()

    # -- decisions

    def next_reads(self, is_cached: Callable[[ChunkSpec], bool] | None = None, *, gather: bool = False
                   ) -> list[tuple[Hashable, ChunkSpec]]:
        """The reads to start now, in order; they count as issued from now on.

        ``is_cached(spec)`` says whether a chunk is already in (or on its way into) the
        cache; such chunks are not issued but still take their place in the window,
        since they must stay cached until used.

        ``gather``: start nothing until half the window is due (one submission of several
        chunks costs the thread that submits about what one costs), unless the read needed
        next is among them or the window holds the last reads. The look-ahead then swings
        between half the window and all of it.
        """
        window = list(self._window(is_cached))
        due = [(rid, spec) for rid, spec, cached in window if rid not in self._issued and not cached]
        if (gather and due and 2 * len(due) < len(window) and due[0][0] != window[0][0]
                and not self._reaches_end(window)):
            return []
        out = due
        for rid, spec in out:
            self._issued[rid] = spec
        self.issued_total += len(out)
        self.peak_outstanding_bytes = max(self.peak_outstanding_bytes, self.outstanding_bytes)
        return out

    def cancel_all(self) -> list[ChunkSpec]:
        """Forget every issued read not yet consumed and return them (to cancel)."""
        out = list(self._issued.values())
        self._issued.clear()
        return out

    @property
    def consumed(self) -> list[ChunkSpec]:
        """The reads the scheduler has started."""
        return [self._specs[rid] for rid in self._consumed]

    # -- views

    @property
    def outstanding(self) -> list[ChunkSpec]:
        """Issued reads the scheduler has not started yet."""
        return list(self._issued.values())

    @property
    def outstanding_bytes(self) -> int:
        """Decoded bytes of ``outstanding``: never more than ``budget``."""
        return sum(s.out_nbytes for s in self._issued.values())

    @property
    def remaining(self) -> int:
        """Reads not consumed yet."""
        return len(self._order) - len(self._consumed)

    def window(self) -> list[Hashable]:
        """Read ids in the current window (issued or not)."""
        return [rid for rid, _, _ in self._window(None)]

    def __repr__(self) -> str:
        return (f"ReadAheadPlan(depth={self.depth}, budget={self.budget}, remaining={self.remaining}, "
                f"outstanding={len(self._issued)} ({self.outstanding_bytes} bytes))")

    # -- internals

    def _reaches_end(self, window: list) -> bool:
        """Whether ``window`` holds every read not consumed yet."""
        return len(window) >= self.remaining

    def _advance(self) -> None:
        while self._cursor < len(self._order) and self._order[self._cursor] in self._consumed:
            self._cursor += 1

    def _window(self, is_cached: Callable[[ChunkSpec], bool] | None
                ) -> Iterator[tuple[Hashable, ChunkSpec, bool]]:
        count = used = 0
        for i in range(self._cursor, len(self._order)):
            if count >= self.depth:
                return
            rid = self._order[i]
            if rid in self._consumed:
                continue
            spec = self._specs[rid]
            size = spec.out_nbytes
            if used + size > self.budget:
                return  # order first: nothing later jumps a chunk that does not fit
            used += size
            count += 1
            cached = rid not in self._issued and is_cached is not None and is_cached(spec)
            yield rid, spec, cached


def _normalise(reads: Iterable[Any]) -> Iterator[tuple[Hashable, ChunkSpec]]:
    for r in reads:
        if isinstance(r, ChunkSpec):
            yield r.key, r
        else:
            rid, spec = r
            yield rid, spec


# --------------------------------------------------------------------------- finding reads


def window_batch(task: Any) -> tuple[Any, int] | None:
    """``(window, j)`` when ``task`` is batch ``j`` of a compute's ``ReadWindow``, else None.

    Such a batch is read ahead by its window (``gpulazy._batchread``), not through the cache.
    """
    from gpulazy._tasks import read_batch

    if getattr(task, "func", None) is not read_batch:
        return None
    args = getattr(task, "args", ())
    if len(args) < 4:
        return None
    window, j = _literal(args[2]), _literal(args[3])
    return (window, j) if window is not None and isinstance(j, int) else None


def find_reads(task: Any) -> list[tuple[ChunkSpec, Any]]:
    """``(spec, source)`` of every ``load_chunk`` call inside one task, in order.

    Understands ``dask._task_spec`` objects (``Task``, fused ``_execute_subgraph`` tasks
    holding a dict of inner tasks, nested containers, ``DataNode`` arguments) and
    old-style tuples, without importing Dask.

    Examples
    --------
    >>> from gpulazy.array import ChunkSource, load_chunk
    >>> from gpulazy.spec import ByteRange, ChunkSpec
    >>> spec = ChunkSpec((ByteRange("f", 0, 8),), (8,), "u1")
    >>> task = (sum, [(load_chunk, spec, ChunkSource("cpu"))])
    >>> [(s.shape, src.device) for s, src in find_reads(task)]
    [((8,), 'cpu')]
    """
    from gpulazy._tasks import load_chunk, read_batch

    out: list[tuple[ChunkSpec, Any]] = []
    _walk(task, (load_chunk, read_batch), out, 0)
    return out


_MAX_NESTING = 64


def _walk(obj: Any, load: tuple[Callable, Callable], out: list, depth: int) -> None:
    if depth > _MAX_NESTING:
        return
    kind = type(obj)
    if kind is tuple and obj and callable(obj[0]):  # old-style task
        if _is_load(obj[0], load):
            _add_read(obj[1:], {}, out)
        else:
            for a in obj[1:]:
                _walk(a, load, out, depth + 1)
    elif kind in (list, tuple, set, frozenset):
        for a in obj:
            _walk(a, load, out, depth + 1)
    elif kind is dict:  # the inner graph of a fused task
        for v in obj.values():
            _walk(v, load, out, depth + 1)
    else:
        func, args = getattr(obj, "func", None), getattr(obj, "args", None)
        if func is None or not isinstance(args, tuple):  # not a dask._task_spec.Task
            return
        kwargs = getattr(obj, "kwargs", None) or {}
        if _is_load(func, load):
            _add_read(args, kwargs, out)
            return
        for a in args:
            _walk(a, load, out, depth + 1)
        for v in kwargs.values():
            _walk(v, load, out, depth + 1)


def _is_load(func: Any, load: tuple[Callable, Callable]) -> bool:
    while hasattr(func, "func") and hasattr(func, "args") and not hasattr(func, "key"):
        func = func.func  # functools.partial(load_chunk, ...)
    return func is load[0] or func is load[1]


def _literal(x: Any) -> Any:
    # New-style graphs may wrap literal arguments in a DataNode.
    return x.value if type(x).__name__ == "DataNode" else x


def _add_read(args: tuple, kwargs: dict, out: list) -> None:
    spec = _literal(args[0] if args else kwargs.get("spec"))
    source = _literal(args[1] if len(args) > 1 else kwargs.get("source"))
    if source is None:
        return
    # ``load_chunk(spec, source)`` or ``read_batch((spec, ...), source)``
    for s in (spec if isinstance(spec, tuple) else (spec,)):
        if isinstance(s, ChunkSpec):
            out.append((s, source))


# --------------------------------------------------------------------------- issuing


class ReadAhead:
    """A ``ReadAheadPlan`` wired to the caches: issues, cancels and reports.

    Shared by the local callback and the distributed worker plugin. Reads whose source
    has no cache (``cache=False``), or another cache than ``only`` when it is given,
    are left to their tasks.
    """

    def __init__(self, *, depth: int, capacity: int | None = None, only: Any = None, inline: bool = True):
        self.depth = depth
        self.capacity = capacity
        self.only = only
        #: Start reads in the calling thread (the local scheduler's); ``False`` hands them to
        #: the caches' worker threads (a dask.distributed worker's event loop must not block).
        self.inline = inline
        self.plan: ReadAheadPlan | None = None
        self._where: dict[Hashable, tuple[Any, Any]] = {}   # read id -> (source, cache)
        self._caches: dict[Any, Any] = {}                    # source -> its cache (or None)
        self._by_spec: dict[str, Any] = {}                   # spec.key -> cache
        #: Local scheduler: ``{task_key: [(read_id, spec), ...]}`` (see ``plan_graph``).
        self.by_task: dict[Any, list[tuple[Hashable, ChunkSpec]]] = {}
        #: Local scheduler: the ``ReadWindow``s whose batches this computation runs (ordered by it).
        self.windows: list[Any] = []
        self.failed: BaseException | None = None
        self.reads_total = 0
        self._bytes: dict[int, int] = {}                     # id(cache) -> bytes of the reads through it
        self._uses: dict[str, int] = {}                      # spec.key -> reads of it
        #: Read ids whose chunk goes to its task as read, uncached (``cache.prefetch(keep=False)``).
        self.one_use: set[Hashable] = set()

    # -- planning

    def cache_for(self, source: Any) -> Any:
        """The cache ``source`` reads through, if read-ahead applies to it, else None."""
        try:
            return self._caches[source]
        except KeyError:
            pass
        cache = None
        try:
            cache = source.cache_instance()
        except Exception:  # a source we cannot resolve is simply not warmed
            cache = None
        if cache is not None and self.only is not None and cache is not self.only:
            cache = None
        self._caches[source] = cache
        return cache

    def budget(self) -> int:
        """Bytes the look-ahead may hold: ``capacity``, at most half of each cache used."""
        caps = [int(c.capacity * CACHE_FRACTION) for c in {id(c): c for c in self._caches.values()
                                                              if c is not None}.values()]
        if self.capacity is not None:
            caps.append(self.capacity)
        return min(caps) if caps else 0

    def keep(self, reads: Iterable[tuple[Hashable, ChunkSpec, Any]]) -> list[tuple[Hashable, ChunkSpec]]:
        """Record where each ``(read_id, spec, source)`` goes; return the warmable ones."""
        out = []
        for rid, spec, source in reads:
            cache = self.cache_for(source)
            if cache is None:
                continue
            self._where[rid] = (source, cache)
            self._by_spec[spec.key] = cache
            self._bytes[id(cache)] = self._bytes.get(id(cache), 0) + spec.out_nbytes
            self._uses[spec.key] = self._uses.get(spec.key, 0) + 1
            out.append((rid, spec))
        self.reads_total += len(out)
        return out

    def start(self, reads: list[tuple[Hashable, ChunkSpec]]) -> None:
        """Begin with ``reads`` in run order and issue the first window.

        A computation that reads more bytes through a cache than it holds is a pass an LRU
        cannot keep: each chunk would be evicted before it could be used again. Its chunks
        read once are then handed to their tasks as read (``cache.prefetch(keep=False)``), with
        no copy out of the cache and nothing evicted for them; a chunk several tasks read is
        cached as usual. Only reads started in this thread (``inline``) can be handed over.
        """
        if self.inline:
            caches = {id(c): c for _, c in self._where.values()}
            kept = {key: cache.keeps(self._bytes[key]) for key, cache in caches.items()}
            self.one_use = {rid for rid, spec in reads if self._uses.get(spec.key) == 1
                            and not kept[id(self._where[rid][1])]}
        self.plan = ReadAheadPlan(reads, depth=self.depth, budget=self.budget())
        self.issue()

    # -- events

    def reorder(self, reads: list[tuple[Hashable, ChunkSpec]]) -> None:
        """The upcoming reads changed: cancel stale prefetches, issue what is now next."""
        if self.plan is None:
            self.start(reads)
            return
        self.plan.budget = self.budget()  # a new cache may have appeared
        self._cancel(self.plan.set_order(reads))
        self.issue()

    def started(self, read_ids: Iterable[Hashable]) -> None:
        """The scheduler started these reads: slide the window."""
        if self.plan is None:
            return
        self.plan.consume(read_ids)
        self.issue()

    def stop(self) -> int:
        """Cancel every prefetch still queued for this plan and settle the reads it started;
        returns how many were cancelled.

        A read-ahead of a chunk whose task has started is normally taken by that task, but
        not when the computation failed first, or when the task read the chunk its own way
        (a streamed reduction reads what is not cached yet): such a read would stay in
        flight, holding its share of the cache, until a later computation polled it. It is
        settled here (cached, or its error recorded), so no read outlives its computation.
        """
        if self.plan is None:
            return 0
        n = self._cancel(self.plan.cancel_all())
        return n + self._cancel(self.plan.consumed)

    def forget(self, reads: Iterable[tuple[Hashable, ChunkSpec]]) -> None:
        """Drop the bookkeeping of reads that are done with (long-lived planners)."""
        for rid, spec in reads:
            self._where.pop(rid, None)
            self._by_spec.pop(spec.key, None)

    # -- cache calls

    def issue(self) -> None:
        if self.plan is None or self.failed is not None:
            return
        try:
            # Chunks already cached are issued too: the cache skips them but moves them
            # to the young end of its LRU, so they stay until used.
            # Reads are started here, in the scheduler's thread (``start``), and finished by
            # the task that asks for the chunk, or by ``poll`` on a later event: no thread
            # of ours needs the GIL while a compute holds it.
            if self.inline:
                for cache in {id(c): c for c in self._caches.values() if c is not None}.values():
                    cache.poll()
            reads = self.plan.next_reads(gather=True)
            for (source, cache, keep), specs in self._group(reads).items():
                start = getattr(source, "start", None) if self.inline else None
                cache.prefetch(specs, source.read, start=start, keep=keep or start is None)
        except Exception as e:  # read-ahead must never break the computation it serves
            self.failed = e
            warnings.warn(f"gpulazy.prefetch: read-ahead stopped for this computation: {e!r}",
                          RuntimeWarning, stacklevel=2)

    def _cancel(self, specs: list[ChunkSpec]) -> int:
        n = 0
        by_cache: dict[int, tuple[Any, list]] = {}
        for spec in specs:
            cache = self._by_spec.get(spec.key)
            if cache is not None:
                by_cache.setdefault(id(cache), (cache, []))[1].append(spec)
        for cache, group in by_cache.values():
            try:
                n += int(cache.cancel(group) or 0)
            except Exception:  # cancelling is best effort; the cache stays consistent
                pass
        return n

    def _group(self, reads: list[tuple[Hashable, ChunkSpec]]) -> dict[tuple[Any, Any, bool], list[ChunkSpec]]:
        groups: dict[tuple[Any, Any, bool], list[ChunkSpec]] = {}
        for rid, spec in reads:
            source, cache = self._where[rid]
            groups.setdefault((source, _Id(cache), rid not in self.one_use), []).append(spec)
        return {(source, ref.obj, keep): specs for (source, ref, keep), specs in groups.items()}

    def summary(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "depth": plan.depth if plan else self.depth,
            "budget": plan.budget if plan else 0,
            "reads": self.reads_total,
            "issued": plan.issued_total if plan else 0,
            "peak_outstanding_bytes": plan.peak_outstanding_bytes if plan else 0,
            "error": repr(self.failed) if self.failed else None,
        }


class _Id:
    """Hash a cache by identity (caches need not be hashable)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Id) and other.obj is self.obj
