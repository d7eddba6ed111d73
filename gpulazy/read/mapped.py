"""``map_blocks`` as the reads land: ``vol.map_blocks(func).compute()`` without a dask task a chunk.

Through dask, a ``map_blocks`` over a gpulazy array costs two tasks a chunk (its read, then
``func``) and dask's own work for each: on an H200, 1 GiB of 16 MiB chunks took 51-64 ms that way
against 24 ms for the whole read. Here the chunks are read as the whole-array path reads them
(``whole.read_in_order``: submissions of 256 MiB in block order, as much in flight as the
device's free memory allows) and ``func`` is called on each chunk as its own read lands, while
the later reads go on; each block ``func`` returns is copied into its place in the result,
allocated once, and dropped. What a block costs is one ``func`` call and one copy, and device
memory holds the result, the reads in flight and the blocks being made, never every block at once
(dask's ``compute`` holds every block and then concatenates them).

``func`` sees what a dask task would give it: a chunk of its own (a cached chunk is copied out
of the cache first, so ``func`` may write into its input), on the device the array lives on. On
a GPU its kernels run on a non-blocking stream kept for maps (``_MapStream``), so they
overlap the copies of the next reads, and the result is complete on every stream when the
compute returns; the calls are made in the calling thread. On ``"cpu"`` with the threaded
scheduler (dask's default for arrays) they run on ``num_workers`` threads, as dask's would
(``workers``). A block of another shape, dtype or array type than the result's is kept as it
is, and the result is then put together as dask puts it together (``concatenate3``).

``GpulazyArray.map_blocks`` takes this path only where dask's graph would be one call per chunk
with nothing else to know: one array (``chunks=`` may give the blocks other lengths), no
``drop_axis``, ``new_axis`` or ``enforce_ndim``, no ``block_info``/``block_id`` parameter and no
dask collection among the keywords; its ``compute()`` only on a local scheduler (config
``streamed_maps=False`` turns it off). Active dask callbacks (a progress bar) are told of each
chunk's tasks (``_hooks.ChunkHooks``). Elementwise operations with scalars and arrays in memory
(``vol * 2``, ``vol.astype(...)``) are such maps too (``array._Elementwise``). A map of such a map
is one call a chunk (the functions in turn), and a reduction of one is ``gpulazy.read.reduce``'s
chain with the function called on each chunk before its fold (``MapBlocks``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
from typing import Any, Callable, Iterator

import numpy as np

from gpulazy.device import Device, get_device
from gpulazy.read.pairs import Pairs, members
from gpulazy.read.whole import STAGED, groups_by_bytes, held_bytes, inflight_room, read_in_order
from gpulazy.spec import ChunkSpec

__all__ = ["run_map", "workers", "MapBlocks"]


def run_map(specs: dict, source: Any, chunks: tuple, func: Callable, kwargs: dict, dtype: Any,
            threaded: bool = False, hooks: Any = None) -> Any:
    """``func(chunk, **kwargs)`` of every chunk of ``specs``, put together as dask's ``map_blocks`` would.

    ``threaded`` (dask's threaded scheduler): on ``"cpu"``, ``func`` runs on dask's ``num_workers``
    threads; on a GPU, and otherwise, in the calling thread (``workers``). Chunks ``source``'s cache holds
    are copied out and mapped while the first reads are in flight; the others are read (and
    offered to the cache unless the map reads more than it holds, ``DeviceCache.keeps``). The
    first error (a read's, ``func``'s) is raised once every read has settled and every call
    already started has returned. ``hooks`` (a ``gpulazy._hooks.ChunkHooks``) hears of each chunk's
    read task as the chunk is handed out and of its map's tasks around the call: a progress bar
    follows the map without sending it back to dask's tasks.
    """
    dev = get_device(source.device)
    cache = source.cache_instance()
    backend = source.backend_instance()
    pairs = Pairs(specs.values())  # (a block of two arrays' chunks is mapped once both have landed)
    flat = [spec for unit in specs.values() for spec in members(unit)]
    with dev.activate():
        result = _Result(chunks, dtype, dev)
        calls = _Calls(func, kwargs, result, workers(dev, threaded), dev, hooks)

        def put(spec: ChunkSpec, arr: Any) -> None:
            block = pairs.add(spec, arr)
            if block is not None:
                calls.map(*block)

        try:
            cached, todo = _split(flat, cache)
            hits = _hits(cached, source, cache)  # (a generator: mapped once, then empty)
            offer = cache is not None and cache.keeps(sum(s.out_nbytes for s in flat))

            def landed(spec: ChunkSpec, arr: Any) -> None:
                for hit in hits:  # mapped once the first reads are in flight
                    put(*hit)
                if offer:
                    arr = cache.get(spec, lambda s, a=arr: a)  # kept; ``func`` gets a copy
                put(spec, arr)

            if todo:
                # In the calling thread: with the reads waited for and finished on a thread of their
                # own, every pass measured was slower (the two threads took turns at the GIL).
                largest = max(held_bytes(s) for s, _ in todo)
                read_in_order(todo, backend, source.verify, landed, max(STAGED, inflight_room(dev), 2 * largest),
                              each=True)
            for hit in hits:  # (nothing was read)
                put(*hit)
            pairs.check_done()
        except BaseException:
            calls.close(cancel=True)
            raise
        calls.close()
        return result.value()


def workers(dev: Device, threaded: bool) -> int:
    """Threads calling a map's function (0: the calling thread).

    On ``"cpu"`` with the threaded scheduler, dask's ``num_workers``, as dask would run the calls: a
    host function that releases the GIL (NumPy, SciPy) runs on every core. On a GPU the calling
    thread: ``func`` queues its kernels and returns, and more threads only contend for the GIL (on
    an H200, 64 chunks of 16 MiB each given a few matmuls and a wait took 69-81 ms on 16 threads,
    36 ms in the calling thread, in one process; ``.run/maptl.py`` in the twenty-fifth session's results).
    """
    if not threaded or dev.is_gpu:
        return 0
    import dask
    from dask.system import CPU_COUNT

    return int(dask.config.get("num_workers", None) or CPU_COUNT)


def _split(specs: list[ChunkSpec], cache: Any) -> tuple[list[ChunkSpec], list[tuple[ChunkSpec, None]]]:
    """The chunks ``cache`` holds or is reading, and the rest as ``read_in_order``'s work (the engine
    allocates each)."""
    if cache is None:
        return [], [(spec, None) for spec in specs]
    cached, todo = [], []
    for spec in specs:
        if spec in cache or cache.holds(spec):
            cached.append(spec)
        else:
            todo.append((spec, None))
    return cached, todo


def _hits(specs: list[ChunkSpec], source: Any, cache: Any) -> Iterator[tuple[ChunkSpec, Any]]:
    """``(spec, a copy of its chunk)`` for each of ``specs``, copied out of ``cache`` a group of ``GROUP``
    bytes at a time (all at once, a map over cached data held a second copy of it beside the
    result); a chunk evicted meanwhile is read again, one a prefetch of the cache is reading is
    waited for."""
    from gpulazy.integrity import check_all_unchanged

    for group in groups_by_bytes(specs, lambda s: s.out_nbytes):
        copies = cache.get_cached(group)
        # A cached chunk of a file changed since indexing is never used; the engine checks the files
        # of what it reads after the reads.
        check_all_unchanged([s for s, a in zip(group, copies) if a is not None])
        for spec, arr in zip(group, copies):
            yield spec, arr if arr is not None else cache.get(spec, source.read)


def _caller(func: Callable, kwargs: dict) -> Callable[[Any, tuple[int, ...]], Any]:
    """``call(chunk, index)``: ``func(chunk, **kwargs)``, given the block's ``index`` too when it is one
    of gpulazy's own functions that needs it (``takes_index``: an elementwise operation with an array
    in memory takes that block's part of it)."""
    if getattr(func, "takes_index", False):
        return lambda chunk, index: func(chunk, index=index, **kwargs)
    return lambda chunk, index: func(chunk, **kwargs)


class _Result:
    """The mapped array: blocks copied into one array as they come, or kept when one does not fit."""

    def __init__(self, chunks: tuple, dtype: Any, dev: Device):
        self.dev = dev
        self.edges = [list(itertools.accumulate(c, initial=0)) for c in chunks]
        self.numblocks = tuple(len(c) for c in chunks)
        self.out = dev.alloc(tuple(e[-1] for e in self.edges), np.dtype(dtype))
        self.placed: set[tuple[int, ...]] = set()
        self.kept: dict[tuple[int, ...], Any] | None = None  # every block's array once one did not fit
        self.lock = threading.Lock()

    def _region(self, index: tuple[int, ...]) -> tuple:
        # (the Ellipsis keeps a 0-d block a view, not a scalar copy)
        return tuple(slice(e[i], e[i + 1]) for e, i in zip(self.edges, index)) + (Ellipsis,)

    def put(self, index: tuple[int, ...], block: Any) -> None:
        # (the region's shape from the edges: a view of the result made only to be written)
        shape = tuple(e[i + 1] - e[i] for e, i in zip(self.edges, index))
        fits = type(block) is type(self.out) and block.shape == shape and block.dtype == self.out.dtype
        if fits and self.kept is None:
            self.out[self._region(index)] = block
            with self.lock:
                if self.kept is None:
                    self.placed.add(index)
                    return
        with self.lock:
            if self.kept is None:  # the blocks placed so far, as views of where they lie
                self.kept = {i: self.out[self._region(i)] for i in self.placed}
            self.kept[index] = block

    def value(self) -> Any:
        if self.kept is None:
            return self.out
        joined = self._joined()
        if joined is not None:
            return joined
        from dask.array.core import concatenate3

        def nest(prefix: tuple[int, ...]) -> Any:
            if len(prefix) == len(self.numblocks):
                return self.kept[prefix]
            return [nest(prefix + (i,)) for i in range(self.numblocks[len(prefix)])]

        return concatenate3(nest(()))


    def _joined(self) -> Any:
        """The kept blocks joined into one array when they tile one (each axis's block lengths the
        same across the other axes; the result's array type, one dtype): what ``concatenate3``
        gives, with one concatenation an axis of more than one block. ``concatenate3`` concatenates
        every row of blocks, however short: 65 concatenations for 64 blocks of 1 x 1, 7 % of a
        streamed map's calling thread under cProfile on an H200; copying each block into one
        allocation still took 1.8 ms for those 64 (twenty-sixth session, ``mapprof``, ``mapparts``)."""
        kept = self.kept
        first = next(iter(kept.values()))
        lengths: list[dict[int, int]] = [{} for _ in self.numblocks]
        for index, block in kept.items():
            if type(block) is not type(self.out) or block.dtype != first.dtype or block.ndim != len(index):
                return None
            for a, (i, n) in enumerate(zip(index, block.shape)):
                if lengths[a].setdefault(i, n) != n:
                    return None
        concatenate = self.dev.xp.concatenate

        def join(prefix: tuple[int, ...]) -> Any:
            axis = len(prefix)
            if axis == len(self.numblocks):
                return kept[prefix]
            parts = [join(prefix + (i,)) for i in range(self.numblocks[axis])]
            return parts[0] if len(parts) == 1 else concatenate(parts, axis=axis)

        return join(())


class _Calls:
    """``func`` called on each chunk handed to ``map``: in this thread, or on ``workers`` threads
    (at most two calls a thread waiting, so chunks read do not pile up behind a slow ``func``)."""

    def __init__(self, func: Callable, kwargs: dict, result: _Result, workers: int, dev: Device, hooks: Any = None):
        self.result, self.dev, self.hooks = result, dev, hooks
        self.call = _caller(func, kwargs)
        self.stream = _MapStream(dev) if dev.is_gpu else None
        self.pool = None
        self.errors: list[BaseException] = []
        if workers > 0:
            self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="gpulazy-map")
            self.room = threading.BoundedSemaphore(2 * workers)

    def map(self, spec: ChunkSpec, chunk: Any) -> None:
        if self.hooks is not None:
            self.hooks.read(spec.index, chunk)
        if self.pool is None:
            self._call(spec, chunk)
            return
        if self.errors:
            raise self.errors[0]
        self.room.acquire()
        if self.errors:
            self.room.release()
            raise self.errors[0]
        self.pool.submit(self._pooled, spec, chunk)

    def _call(self, spec: ChunkSpec, chunk: Any) -> None:
        if self.hooks is not None:
            self.hooks.calling(spec.index)
        if self.stream is None:
            block = self.call(chunk, spec.index)
            self.result.put(spec.index, block)
        else:
            with self.stream.stream:
                block = self.call(chunk, spec.index)
                self.result.put(spec.index, block)
            self.stream.keep(chunk)
        if self.hooks is not None:
            self.hooks.called(spec.index, block)

    def _pooled(self, spec: ChunkSpec, chunk: Any) -> None:
        try:
            if not self.errors:
                with self.dev.activate():
                    self._call(spec, chunk)
        except BaseException as e:  # raised by ``map`` or ``close`` in the calling thread
            self.errors.append(e)
        finally:
            self.room.release()

    def close(self, cancel: bool = False) -> None:
        """Wait for every call (``cancel``: every call running; an error is on its way) and its device
        work, and raise the first error one raised."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=cancel)
        if self.stream is not None:
            self.stream.finish()
        if self.errors and not cancel:
            raise self.errors[0]


class _MapStream:
    """The non-blocking CUDA stream ``func``'s kernels and the blocks' copies run on (a GPU only:
    the calling thread's ``map_stream``, where ``func`` is called).

    On CuPy's legacy stream they would wait for the copies KvikIO makes of the next chunks on
    its blocking streams, and those for them: on an H200, a pass calling a matmul on each of
    64 chunks of 16 MiB took as long as its read and its compute one after the other (1.9-2.1 x
    the longer of them). Memory the map's kernels read that came from another stream's pool (a
    chunk the engine read, a copy out of the cache) is held until the kernels queued so far are
    done, so nothing reuses it under them; the result, from the consumer's pool, is written only
    after the consumer's kernels queued before it. ``finish()`` waits for the stream: the result
    is complete on every stream when the compute returns.
    """

    def __init__(self, dev: Device):
        from gpulazy.device import after_consumer, map_stream

        with dev.activate():
            self.stream = map_stream(dev)
            self.stream.wait_event(after_consumer(dev))
        self.held: collections.deque = collections.deque()  # (event, arrays) in the order recorded
        self.waiting: list[Any] = []  # arrays held, their event not recorded yet

    def keep(self, arr: Any) -> None:
        """Hold ``arr`` until the stream's work queued so far is done (an event every ``HELD_EVERY``
        arrays: an event made, recorded and asked for each chunk took 39 us of it on an H200)."""
        self.waiting.append(arr)
        if len(self.waiting) < HELD_EVERY:
            return
        import cupy

        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(self.stream)
        self.held.append((event, self.waiting))
        self.waiting = []
        while self.held and self.held[0][0].done:
            self.held.popleft()

    def finish(self) -> None:
        self.stream.synchronize()
        self.held.clear()
        self.waiting = []


#: Arrays ``_MapStream.keep`` holds under one event.
HELD_EVERY = 8


class MapBlocks:
    """A streamed map's function made into blocks for a consumer that folds them (a streamed
    reduction of the map, ``gpulazy.read.reduce``), each checked against what the fold needs.

    ``made(chunks)`` yields ``(spec, block)`` in the order given: in the calling thread, or, once
    ``use_threads(True)`` on ``"cpu"``, on ``num_workers`` threads (at most two calls a thread
    ahead of the fold), as dask's threaded scheduler would run the map's tasks. Each chunk must be
    the caller's own (``func`` may write into it).
    """

    def __init__(self, mapping: tuple, chunks: tuple, axis: tuple[int, ...], dev: Device):
        self.func, self.kwargs = mapping
        self.call = _caller(self.func, self.kwargs)
        self.chunks, self.axis, self.dev = chunks, axis, dev
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.window = 0

    def use_threads(self, threaded: bool) -> None:
        n = workers(self.dev, threaded)
        if n > 0:
            self.pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="gpulazy-map")
            self.window = 2 * n

    def made(self, chunks: list[tuple[ChunkSpec, Any]]) -> Iterator[tuple[ChunkSpec, Any]]:
        if self.pool is None:
            for spec, chunk in chunks:
                yield spec, self.block(spec, chunk)
            return
        ahead: collections.deque = collections.deque()
        todo = iter(chunks)
        try:
            for spec, chunk in itertools.islice(todo, self.window):
                ahead.append((spec, self.pool.submit(self.block, spec, chunk)))
            while ahead:
                spec, future = ahead.popleft()
                nxt = next(todo, None)
                if nxt is not None:
                    ahead.append((nxt[0], self.pool.submit(self.block, *nxt)))
                yield spec, future.result()
        finally:
            for _, future in ahead:  # an error or an interrupt: no call left running on dropped chunks
                future.cancel()
            concurrent.futures.wait([f for _, f in ahead])

    def block(self, spec: ChunkSpec, chunk: Any) -> Any:
        """``func``'s block of ``chunk``. The reduced axes may change length (the fold counts what the
        block holds, as dask's reduction would); the kept axes may not: the block's partial result
        goes to the part of the result its declared block covers."""
        block = self.call(chunk, spec.index)
        xp = self.dev.xp
        declared = tuple(c[i] for c, i in zip(self.chunks, spec.index))  # (its ``chunks=``, or the chunk's)
        # (a plane's cut drops the axes its integers index: the declared blocks give the dimensions)
        if not isinstance(block, xp.ndarray) or block.ndim != len(declared) or any(
                block.shape[a] != declared[a] for a in range(len(declared)) if a not in self.axis):
            name = getattr(self.func, "__name__", repr(self.func))
            got = f"a {type(block).__module__}.{type(block).__name__} of shape {getattr(block, 'shape', ())}"
            raise ValueError(f"map_blocks({name}) gave {got} for block {spec.index} (shape {declared}) of "
                             f"{spec.paths[0] if spec.paths else '?'!r}; a reduction over axis {self.axis} of "
                             f"the map needs {xp.__name__} blocks with the other axes as declared "
                             f"(give map_blocks the chunks= its blocks have)")
        return block

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
