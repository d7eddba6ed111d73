"""Reductions that run as the reads land: ``max``, ``min``, ``sum``, ``mean``, ``var``, ``std``, ``argmax``,
``argmin``, ``any``, ``all``.

Through dask, a reduction over a gpulazy array is one task per chunk and a tree of combine
tasks: on an H100 dask alone took 120 ms for a MIP of 4 GiB of 128 MiB chunks already in
device memory (35.9 GB/s), so no read could make that MIP reach the whole-array read rate
(43 GB/s). Here a reduction is a chain of ``STEPS`` dask tasks (``ReduceStream``; more for an
array of more than ``STEPS * MOST_GROUP`` bytes): each reads the next groups of chunks through
the engine, in block order, and folds a group into the result as its reads land, then drops it.
Device memory holds the accumulator, the group being folded (at most ``MOST_GROUP`` decoded
bytes) and the reads in flight (config ``read_ahead``, or an eighth of free device memory), never
the array. Chunks
in the array's cache are folded where they lie (``DeviceCache.visit``: no copy), and chunks read
are offered to it, so a second reduction over the same data reads nothing.

A reduction of a streamed map (``vol.map_blocks(f).max(axis=0)``) is the same chain with ``f`` called
on each chunk first (``mapped.MapBlocks``), on the stream the fold runs on: no block of the map
outlives its fold.

Values equal dask's up to floating-point order: ``max``/``min`` exactly; sums in the
dtype NumPy sums in (``uint16`` -> ``uint64``); ``mean``, ``var``, ``std`` accumulate in
float64 (Chan's parallel update for the variance) and return NumPy's result dtype; ``argmax`` and
``argmin`` (over one axis or all of them, as dask allows) exactly, the first of equal extremes
(and the first NaN) as NumPy picks it, whatever order the chunks fold in; ``any``/``all`` exactly.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from typing import Any, NamedTuple

import numpy as np

from gpulazy.device import Device, get_device, own_stream
from gpulazy.read import whole
from gpulazy.read.mapped import MapBlocks
from gpulazy.read.pairs import Pairs, members
from gpulazy.read.whole import groups_by_bytes, held_bytes, inflight_room
from gpulazy.spec import ChunkSpec

__all__ = ["result_dtype", "groups_of", "ReduceStream", "stream_start", "stream_start_shared", "stream_step",
           "stream_result", "run_stream", "Chain", "chain_graph", "holds_chains", "share_reads"]


#: Reductions giving the place of an extreme: over one axis, or all of them (a flat index).
ARG_OPS = ("argmax", "argmin")


def result_dtype(op: Any, dtype: Any, ndim: int, axis: tuple[int, ...], cast: Any = None) -> np.dtype:
    """The dtype NumPy gives ``op`` over an array of ``dtype`` (``cast`` first, as ``astype`` does)."""
    probe = np.ones((1,) * ndim, dtype=cast if cast is not None else dtype)
    if isinstance(op, tuple):  # ("histogram", bins, range): its counts
        return np.histogram(probe, bins=op[1], range=op[2])[0].dtype
    if op in ARG_OPS:  # (one axis or none)
        return getattr(np, op)(probe, axis=axis[0] if len(axis) == 1 else None).dtype
    return getattr(np, op)(probe, axis=axis).dtype


#: Most steps a streamed reduction of up to ``STEPS * MOST_GROUP`` bytes takes (bigger groups for
#: a bigger array): each step is a dask task, and dask's own cost per task is what a reduction
#: over cached chunks is held to.
STEPS = 8

#: Most bytes a group decodes to: a group's chunks are read into device memory together, so an
#: array of 200 GB in ``STEPS`` groups would have held 25 GB at once. Bigger arrays take more steps.
MOST_GROUP = 1 << 30

#: Least stored bytes in a group of chunks that decode: a group is one nvCOMP call (per codec),
#: which decodes one piece per thread block, so it needs many pieces. On an H100 (one process
#: alternating), the MIP of a 2 GiB zstd Zarr of 8 MiB pieces ran at 15.8 GB/s in groups of
#: 256 MiB (0.65 of its whole read) and at 23.2 in groups of 512 MiB (0.94); 1 GiB gave 23.3.
DECODE_GROUP = 512 << 20


def groups_of(specs: dict) -> list[tuple]:
    """The blocks of ``specs`` (a chunk each, or a pair of two arrays' chunks: ``pairs``) in block
    order, in groups of about ``GROUP`` stored bytes (more for an array of more than ``STEPS`` groups;
    at least ``DECODE_GROUP`` for chunks that decode), none decoding to more than ``MOST_GROUP`` bytes
    (one block always): one step each."""
    wanted = [unit for unit in specs.values() if math.prod(members(unit)[0].shape)]
    size = max(whole.GROUP, -(-sum(map(_stored, wanted)) // STEPS))
    if any(s.codec is not None for unit in wanted for s in members(unit)):
        size = max(size, DECODE_GROUP)
    groups = groups_by_bytes(wanted, _stored, size, bound=(_decoded, MOST_GROUP))
    return [tuple(g) for g in groups]


def _stored(unit: Any) -> int:
    return sum(s.nbytes for s in members(unit))


def _decoded(unit: Any) -> int:
    return sum(s.out_nbytes for s in members(unit))


class ReduceStream:
    """A reduction in progress: groups of chunks read ahead, folded one group per ``step``.

    A compute runs ``start``, then ``step(k)`` for each group in order (a dask task each: an
    interrupt or a failure stops between groups, and a progress bar sees each one), then
    ``result``. Each step finishes its group (cached chunks folded where they lie, the others
    as their reads land, then offered to the cache unless the reduction reads more than the
    cache holds) and first submits the groups after it
    while the bytes held by reads in flight stay within config ``read_ahead``, so reading the
    next groups overlaps folding this one. Sent to another process between steps (a
    ``dask.distributed`` worker), it finishes its reads in flight and travels as its running
    result.
    """

    def __init__(self, groups: list, source: Any, chunks: tuple, dtype: Any, ops: list[tuple],
                 mapping: tuple | None = None):
        from gpulazy import config

        self.groups, self.source, self.chunks, self.ops = groups, source, chunks, ops
        self.mapping = mapping  # (func, kwargs): a streamed map's function, called on each chunk first
        self.pairs = Pairs(unit for g in groups for unit in g)  # (a pair's block folds once both have landed)
        self.dev = get_device(source.device)
        # (a map's blocks are checked against every reduction's kept axes: the axes all of them reduce)
        reduced = tuple(a for a in range(len(chunks)) if all(a in axis for _, axis, _, _ in ops))
        self.blocks = None if mapping is None else MapBlocks(mapping, chunks, reduced, self.dev)
        self.backend = source.backend_instance()
        self.cache = source.cache_instance()
        # A reduction over more bytes than its cache holds offers it nothing it reads: each chunk
        # would be copied in and evicted before any reuse (``DeviceCache.keeps``).
        flat = [s for g in groups for unit in g for s in members(unit)]
        self.offer = self.cache is not None and self.cache.keeps(sum(s.out_nbytes for s in flat))
        with self.dev.activate():  # one a reduction: each chunk read once, folded into each
            self.accs = [_Accumulator(op, chunks, axis, dtype, cast, ddof, self.dev) for op, axis, ddof, cast in ops]
        largest = max((s.out_nbytes + s.nbytes for s in flat), default=0)
        self.limit = max(int(config.get("read_ahead")), inflight_room(self.dev), 2 * largest)
        # group -> (reads, misses, bytes, what waits until its chunks are decoded)
        self.pending: dict[int, tuple[Any, list[ChunkSpec], int, Any]] = {}
        self.next = 0
        self.held = 0

    def __reduce__(self):
        # To another process (a dask.distributed worker that takes the next step): the reads in
        # flight cannot travel, so they are finished and folded here, and the running result goes
        # as host arrays; the steps of those groups then have nothing left to do.
        with self.dev.activate():
            for k in sorted(self.pending):
                self._finish(k)
        states = [({name: _to_host(getattr(acc, name)) for name in ("total", "mean", "arg") if hasattr(acc, name)},
                   acc.count) for acc in self.accs]
        return (_rebuilt, (self.groups, self.source, self.chunks, self.accs[0].dtype_in, self.ops, states, self.next,
                           self.mapping))

    def step(self, k: int) -> ReduceStream:
        """Finish group ``k`` (submitting the next groups first); ``self``, for the next step."""
        with self.dev.activate():
            while self.next < len(self.groups) and (self.next <= k or self.held + _bytes(self.groups[self.next])
                                                    <= self.limit):
                self._submit(self.next)
            self._finish(k)
        return self

    def result(self, keepdims: bool, which: int = 0) -> Any:
        """Reduction ``which``'s result."""
        self.pairs.check_done()
        with self.dev.activate():
            out = self.accs[which].result()
        if keepdims:
            axis = self.ops[which][1]
            out = out.reshape(tuple(1 if a in axis else n for a, n in enumerate(map(sum, self.chunks))))
        return out

    def _fold(self, spec: ChunkSpec, chunk: Any) -> None:
        for acc in self.accs:
            acc.fold(spec, chunk)

    def _fold_cached(self, group: list[ChunkSpec]) -> list[ChunkSpec]:
        """Fold the chunks of ``group`` the cache holds, where they lie (no copy); the others."""
        from gpulazy.device import gpulazy_stream
        from gpulazy.integrity import check_all_unchanged, check_unchanged

        if self.blocks is not None:  # the map's function gets copies, as it would from dask
            copies = self.cache.get_cached(group)
            hits = [(spec, arr) for spec, arr in zip(group, copies) if arr is not None]
            check_all_unchanged([spec for spec, _ in hits])
            self._fold_mapped(hits, offer=False)
            return [spec for spec, arr in zip(group, copies) if arr is None]

        def fold(spec: ChunkSpec, chunk: Any) -> None:
            check_unchanged(spec)  # a cached chunk of a file changed since indexing is never used
            with own_stream(self.dev, wait=False):
                self._fold(spec, chunk)

        def wait() -> None:  # the folds are done before the entries may be evicted
            if self.dev.is_gpu:
                gpulazy_stream(self.dev).synchronize()

        return self.cache.visit(group, fold, after=wait)

    def _submit(self, j: int) -> None:
        from gpulazy.read.engine import start_retrying

        group = [s for unit in self.groups[j] for s in members(unit)]
        misses = self._fold_cached(group) if self.cache is not None else group
        reads = None
        if misses:
            reads = start_retrying(misses, self.backend, verify=self.source.verify, staged=False)
        nbytes = _bytes(misses)
        # Chunks that decode settle on the settle threads, so group j decodes while this thread
        # folds the groups before it; chunks read as stored have nothing to decode.
        settled = None
        if reads is not None and any(s.is_assembled for s in misses):
            # (held bytes already bound what is in flight here: ``step``)
            calls = whole.stream_calls(misses, sum(s.nbytes for s in misses))
            slots = whole.settle_slots(max(whole.SETTLERS, calls))
            settled = whole.settle_later(reads, slots)
        self.pending[j] = (reads, misses, nbytes, settled)
        self.held += nbytes
        self.next = j + 1

    def _finish(self, k: int) -> None:
        if k not in self.pending:  # finished before this stream was sent to another process
            return
        reads, misses, nbytes, settled = self.pending.pop(k)
        self.held -= nbytes
        if reads is None:
            return
        if settled is not None:
            settled()
        try:
            arrays = reads.result()  # every read of the group settled before an error is raised
        except BaseException:
            self._settle()
            raise
        if self.blocks is not None:
            self._fold_mapped(list(zip(misses, arrays)), offer=self.offer)
            return
        with own_stream(self.dev):  # one wait for the group's folds
            for spec, arr in zip(misses, arrays):
                self._fold(spec, arr)
        if self.offer:
            for spec, arr in zip(misses, arrays):
                self.cache.get(spec, lambda s, a=arr: a)  # kept (one copy) when there is room

    def _fold_mapped(self, chunks: list[tuple[ChunkSpec, Any]], offer: bool) -> None:
        """Fold the map's block of each chunk (of each pair of chunks once both are in), in block order.
        Chunks read are offered to the cache first (the map's function may write into its input; the
        cache keeps the chunk and hands out a copy)."""
        if offer:
            chunks = [(spec, self.cache.get(spec, lambda s, a=arr: a)) for spec, arr in chunks]
        chunks = [block for block in (self.pairs.add(spec, arr) for spec, arr in chunks) if block is not None]
        with own_stream(self.dev):  # one wait for the group's calls and folds
            for spec, block in self.blocks.made(chunks):
                self._fold(spec, block)

    def close(self) -> None:
        """Let go of the threads the map's function ran on (a local compute's, ``run_stream``)."""
        if self.blocks is not None:
            self.blocks.close()

    def _settle(self) -> None:
        """Wait for every group in flight (a step failed: nothing may write into dropped buffers)."""
        for reads, _, _, settled in self.pending.values():
            if settled is not None:
                settled()
            if reads is not None:
                reads.settle()
        self.pending.clear()


def _strides(shape: tuple[int, ...]) -> list[int]:
    """Elements between neighbours along each axis of a C-ordered array of ``shape``."""
    return list(itertools.accumulate(shape[:0:-1], operator.mul, initial=1))[::-1]


def _to_host(arr: Any) -> np.ndarray:
    return arr.get() if hasattr(arr, "get") else np.asarray(arr)


def _rebuilt(groups: list, source: Any, chunks: tuple, dtype: Any, ops: list, states: list, next_group: int,
             mapping: tuple | None) -> ReduceStream:
    """A stream unpickled in another process: its running results on this process's device."""
    stream = ReduceStream(groups, source, chunks, dtype, ops, mapping)
    with stream.dev.activate():
        for acc, (state, count) in zip(stream.accs, states):
            for name, host in state.items():
                getattr(acc, name)[...] = stream.dev.xp.asarray(host)
            acc.count[...] = count
    stream.next = next_group
    return stream


def _bytes(specs: Any) -> int:
    """Bytes the engine holds for ``specs`` (chunks, or blocks: ``groups_of``) until they are folded
    (their arrays, their stored bytes)."""
    return sum(held_bytes(s) for unit in specs for s in members(unit))


def stream_start(groups: list, source: Any, chunks: tuple, dtype: Any, op: str, axis: tuple[int, ...], ddof: int,
                 cast: Any, mapping: tuple | None = None) -> ReduceStream:
    """The dask task that begins a streamed reduction (no read yet: the first step submits)."""
    return ReduceStream(groups, source, chunks, dtype, [(op, axis, ddof, cast)], mapping)


def stream_start_shared(groups: list, source: Any, chunks: tuple, dtype: Any, ops: list,
                        mapping: tuple | None = None) -> ReduceStream:
    """The dask task that begins the reductions ``ops`` (``(op, axis, ddof, cast)`` each) of the same chunks,
    each chunk read once and folded into each (``share_reads``)."""
    return ReduceStream(groups, source, chunks, dtype, ops, mapping)


def stream_step(stream: ReduceStream, k: int, nchunks: int = 0) -> ReduceStream:
    """The dask task that folds group ``k`` (``nchunks`` chunks: what a progress bar counts)."""
    return stream.step(k)


def stream_result(stream: ReduceStream, keepdims: bool, which: int = 0) -> Any:
    """The dask task that hands out reduction ``which`` of the stream."""
    return stream.result(keepdims, which)


def run_stream(chain: Chain, threaded: bool = False) -> Any:
    """The whole ``chain`` (start, each step, its one result) in the calling thread, as a local compute with
    no dask callback runs it: through dask (its optimising, ordering and a thread hand-off per task)
    the first read of a 2 GiB Zarr's MIP was submitted 3.2-4.2 ms after ``compute()`` on the CPU box,
    here 0.34-0.56 ms (``benchmarks/read_timeline.py --first``). An interrupt or a failure settles
    the reads in flight before it propagates, as a failing step does. ``threaded`` (dask's threaded
    scheduler): a map's function runs on ``num_workers`` threads on ``"cpu"``, as dask's tasks would
    (``mapped.workers``)."""
    stream = ReduceStream(chain.groups, chain.source, chain.chunks, chain.dtype, chain.ops, chain.mapping)
    if stream.blocks is not None:
        stream.blocks.use_threads(threaded)
    try:
        for k in range(len(chain.groups)):
            stream.step(k)
    except BaseException:
        stream._settle()
        raise
    finally:
        stream.close()
    ((which, keepdims),) = chain.results.values()
    return stream.result(keepdims, which)


#: Reduced axes spanning at most this many slices fold slice by slice (``_Accumulator._planes``).
_MOST_PLANES = 64


class _Accumulator:
    """The running result of ``op``: each chunk folded into the block of the result it maps to."""

    def __init__(self, op: Any, chunks: tuple, axis: tuple[int, ...], dtype: Any, cast: Any, ddof: int,
                 dev: Device):
        self.out_dtype = result_dtype(op, dtype, len(chunks), axis, cast)
        if isinstance(op, tuple):  # ("histogram", bins, range): counts of every chunk's values, added up
            op, self.bins, self.range = op
            axis = tuple(range(len(chunks)))
        self.op, self.axis, self.ddof, self.dev, self.xp = op, axis, ddof, dev, dev.xp
        self.dtype_in = np.dtype(dtype)
        self.cast = np.dtype(cast) if cast is not None else None
        self.kept = [a for a in range(len(chunks)) if a not in axis]
        self.edges = [np.cumsum((0,) + tuple(c)) for c in chunks]
        shape = tuple(int(sum(chunks[a])) for a in self.kept)
        if op == "histogram":
            shape = (np.size(self.bins) - 1 if np.ndim(self.bins) else int(self.bins),)
            if np.ndim(self.bins):
                self.bins = dev.xp.asarray(self.bins)
        work = self.out_dtype if op in ("max", "min", "sum", "any", "all", "histogram") else np.dtype("f8")
        self.shape = shape
        if op in ARG_OPS:  # the extreme so far (in the chunks' dtype) and its index
            work = self.cast if self.cast is not None else self.dtype_in
            self.arg = self._zeros(shape, self.out_dtype)
            self.whole = tuple(int(sum(c)) for c in chunks)
        self.total = self._zeros(shape, work)
        if op in ("var", "std"):
            self.mean = self._zeros(shape, np.dtype("f8"))
        self.count = np.zeros(tuple(len(chunks[a]) for a in self.kept), dtype=np.int64)  # per result block

    def _zeros(self, shape: tuple, dtype: np.dtype) -> Any:
        """Zeros from the consumer's pool (``Device.alloc``), written on gpulazy's stream."""
        arr = self.dev.alloc(shape, dtype)
        with own_stream(self.dev):
            arr[...] = 0
        return arr

    def _block(self, spec: ChunkSpec) -> tuple[tuple, tuple]:
        kept_index = tuple(spec.index[a] for a in self.kept)
        region = tuple(slice(int(self.edges[a][spec.index[a]]), int(self.edges[a][spec.index[a] + 1]))
                       for a in self.kept)
        return kept_index, region + (Ellipsis,)  # a view even when the result is 0-d

    def fold(self, spec: ChunkSpec, chunk: Any) -> None:
        xp, op, axis = self.xp, self.op, self.axis
        # A float cast of a max, min or sum happens as they fold: no cast copy of the chunk. (Not for
        # the others: a cast to a narrower float can make two extremes equal, or a tiny value 0.)
        late = self.cast is not None and self.cast.kind == "f" and op in ("max", "min", "sum", "mean", "var", "std")
        if self.cast is not None and not late:
            chunk = chunk.astype(self.cast, copy=False)
        block, region = self._block(spec)
        n = math.prod(chunk.shape[a] for a in axis)
        seen = int(self.count[block])
        dst = self.total[region]
        planes = self._planes(chunk) if op in ("max", "min", "sum", "mean") else None
        if planes is not None:
            self._fold_planes(planes, dst, seen)
        elif op in ("max", "min"):
            part = getattr(xp, op)(chunk, axis=axis)
            if late:  # a float cast is monotonic: the extreme of the cast is the cast of the extreme
                part = part.astype(self.cast)
            if seen == 0:
                dst[...] = part
            else:
                (xp.maximum if op == "max" else xp.minimum)(dst, part, out=dst)
        elif op in ARG_OPS:
            self._fold_arg(spec, chunk, dst, self.arg[region], seen)
        elif op == "histogram":  # each chunk's counts as dask's task for its block counts them
            dst += xp.histogram(chunk, bins=self.bins, range=self.range)[0]
        elif op in ("any", "all"):
            part = getattr(xp, op)(chunk, axis=axis)
            if seen == 0:
                dst[...] = part
            else:
                (xp.logical_or if op == "any" else xp.logical_and)(dst, part, out=dst)
        elif op == "sum":  # each element converted to the sum's dtype as it is added: what a cast gives
            dst += xp.sum(chunk, axis=axis, dtype=self.out_dtype)
        elif op == "mean":
            dst += xp.sum(chunk, axis=axis, dtype="f8")
        else:  # Chan et al.: merge (count, mean, M2) of the block so far with the chunk's
            mean_b = xp.mean(chunk, axis=axis, dtype="f8")
            m2_b = xp.var(chunk, axis=axis, dtype="f8") * n
            mean_a = self.mean[region]
            delta = mean_b - mean_a
            total = seen + n
            mean_a += delta * (n / total)
            dst += m2_b + delta * delta * (seen * n / total)
        self.count[block] = seen + n

    def _fold_arg(self, spec: ChunkSpec, chunk: Any, best: Any, arg: Any, seen: int) -> None:
        """Fold ``chunk``'s extremes and their indices in the whole array into ``best`` and ``arg``: a
        chunk's extreme replaces the one so far where it is further out, or equal (both NaN: the first
        NaN is NumPy's pick) at a smaller index."""
        xp, axis = self.xp, self.axis
        offsets = [int(self.edges[a][i]) for a, i in enumerate(spec.index)]
        extreme = xp.max if self.op == "argmax" else xp.min  # (NaN where there is one, as argmax picks it)
        if len(axis) == 1:
            a = axis[0]
            val, where = extreme(chunk, axis=a), getattr(xp, self.op)(chunk, axis=a) + offsets[a]
        else:  # a flat index into the whole array, from the chunk's own
            val, local = extreme(chunk), getattr(xp, self.op)(chunk)
            where = 0
            for n, off, size, stride in zip(chunk.shape, offsets, self.whole, _strides(chunk.shape)):
                where = where * size + (local // stride) % n + off
        if seen == 0:
            best[...] = val
            arg[...] = where
            return
        further = (xp.greater if self.op == "argmax" else xp.less)(val, best)
        better = further | ((val == best) & (where < arg))
        if best.dtype.kind in "fc":
            nan_val, nan_best = xp.isnan(val), xp.isnan(best)
            better = xp.where(nan_best, nan_val & (where < arg), nan_val | better)
        xp.copyto(best, val, where=better)
        xp.copyto(arg, xp.asarray(where, dtype=arg.dtype), where=better)

    def _planes(self, chunk: Any) -> Any:
        """``chunk`` as a stack of the slices it reduces over, when the reduced axes lead and are few
        (a MIP of planes): folding them one elementwise kernel each beats a reduction kernel along a
        strided axis (on an H100 a MIP of 128 MiB chunks ran at 0.8 of the read rate that way). On a
        GPU the whole stack folds in one launch (``_fold_gpu``), so there the slices may be many."""
        axis = self.axis
        if not axis or axis != tuple(range(len(axis))) or len(axis) == chunk.ndim or not chunk.flags.c_contiguous:
            return None
        n = math.prod(chunk.shape[: len(axis)])
        if n > _MOST_PLANES and not self._one_launch(chunk.dtype):
            return None
        return chunk.reshape((n,) + chunk.shape[len(axis):])

    def _one_launch(self, dtype: Any) -> bool:
        """Whether a stack of slices of ``dtype`` folds in one kernel launch (``_fold_gpu``), however many."""
        if not self.dev.is_gpu:
            return False
        from gpulazy.read import _fold_gpu

        return _fold_gpu.folds("sum" if self.op == "mean" else self.op, dtype, self.total.dtype)

    def _fold_planes(self, planes: Any, dst: Any, seen: int) -> None:
        xp, op = self.xp, self.op
        if self._one_launch(planes.dtype):
            from gpulazy.read import _fold_gpu

            _fold_gpu.fold_planes("sum" if op == "mean" else op, planes, dst, first=seen == 0)
            return
        if op in ("max", "min"):
            pick = xp.maximum if op == "max" else xp.minimum
            first = 0
            if seen == 0:
                dst[...] = planes[0]  # converted to a float cast's dtype as it is copied
                first = 1
            for plane in planes[first:]:  # (a float cast: compared in the wider type, stored in the cast's)
                pick(dst, plane, out=dst)
        else:  # sum, mean: each element converted to the accumulator's dtype as it is added
            for plane in planes:
                xp.add(dst, plane, out=dst, casting="unsafe")

    def result(self) -> Any:
        """The reduction, in an array from the consumer's pool, complete on every stream."""
        xp, op = self.xp, self.op
        if op in ("max", "min", "sum", "any", "all", "histogram"):
            return self.total
        if op in ARG_OPS:
            return self.arg
        out = self.dev.alloc(self.shape, self.out_dtype)
        with own_stream(self.dev):  # temporaries stay in gpulazy's pool; ``out`` is the consumer's
            counts = self._counts()
            if op == "mean":
                out[...] = self.total / counts
            else:
                var = self.total / xp.maximum(counts - self.ddof, 0)
                out[...] = xp.sqrt(var) if op == "std" else var
        return out

    def _counts(self) -> Any:
        """Elements folded into each element of the result (per block, broadcast over it)."""
        xp = self.xp
        if not self.kept:
            return xp.asarray(float(self.count.reshape(())))
        full = self.count
        for k, a in enumerate(self.kept):
            full = np.repeat(full, np.diff(self.edges[a]), axis=k)
        return xp.asarray(full.astype("f8"))


# -- the chain as a dask graph; several chains over the same chunks as one --------------------

class Chain(NamedTuple):
    """What a chain of tasks reduces: ``ops`` (``(op, axis, ddof, cast)`` each: cast to ``cast`` first) of the
    chunks ``specs`` describes (``groups_of(specs)``, a streamed map's function called on each first:
    ``mapping``), and ``results``, the key of each result's task -> ``(which op, keepdims)``."""

    specs: dict
    groups: list
    source: Any
    chunks: tuple
    dtype: Any
    mapping: tuple | None
    ops: list
    results: dict

    def joins(self, other: Chain) -> bool:
        """Whether ``other`` reads what this chain reads, the same way, so one stream can fold for both."""
        same_map = self.mapping is other.mapping or (
            self.mapping is not None and other.mapping is not None
            and all(a is b for a, b in zip(self.mapping, other.mapping)))
        return (self.specs is other.specs and self.source is other.source and self.chunks == other.chunks
                and np.dtype(self.dtype) == np.dtype(other.dtype) and same_map)


def chain_graph(name: str, chain: Chain) -> Any:
    """A ``HighLevelGraph`` of one layer ``name``: the chain's tasks (``_chain_tasks``), the chain kept on the
    layer for ``share_reads``."""
    from dask.highlevelgraph import HighLevelGraph

    layer = _chain_layer_class()(_chain_tasks(name, chain), chain=chain)
    return HighLevelGraph({name: layer}, {name: set()})


def _chain_tasks(name: str, chain: Chain) -> dict:
    from dask._task_spec import DataNode, Task, TaskRef

    step = f"{name}-step"
    groups = chain.groups
    start = (stream_start_shared, DataNode(None, groups), chain.source, DataNode(None, chain.chunks), chain.dtype,
             DataNode(None, chain.ops), DataNode(None, chain.mapping))
    layer: dict = {(step, -1): Task((step, -1), *start)}
    for k in range(len(groups)):
        # Each step also depends on a node of its own: dask fuses a linear chain into one task,
        # which would leave an interrupt nothing to stop between.
        layer[(f"{step}-group", k)] = DataNode((f"{step}-group", k), k)
        layer[(step, k)] = Task((step, k), stream_step, TaskRef((step, k - 1)), TaskRef((f"{step}-group", k)),
                                len(groups[k]))
    for key, (which, keepdims) in chain.results.items():
        layer[key] = Task(key, stream_result, TaskRef((step, len(groups) - 1)), keepdims, which)
    return layer


@functools.cache
def _chain_layer_class() -> type:
    from dask.highlevelgraph import MaterializedLayer

    class ChainLayer(MaterializedLayer):
        """A chain's tasks, with the ``Chain`` they were made of."""

        def __init__(self, mapping: dict, chain: Chain):
            super().__init__(mapping)
            self.chain = chain

    return ChainLayer


def holds_chains(hlg: Any) -> bool:
    """Whether the graph ``hlg`` holds a chain's layer."""
    layer_class = _chain_layer_class()
    return any(isinstance(layer, layer_class) for layer in getattr(hlg, "layers", {}).values())


def share_reads(hlg: Any) -> Any:
    """``hlg`` with the chains that read the same chunks the same way (``Chain.joins``) made one chain whose
    stream folds each chunk into every reduction: ``dask.compute(vol.min(), vol.max())`` and ``vol.max() -
    vol.min()`` read ``vol`` once, as dask's own tree reductions share their chunk tasks. Each chain's layer
    keeps its name and result keys, its results now taken from the shared stream's last step."""
    from dask._task_spec import Task, TaskRef
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    layer_class = _chain_layer_class()
    chains = [(name, layer.chain) for name, layer in hlg.layers.items() if isinstance(layer, layer_class)]
    buckets: list[list[tuple[str, Chain]]] = []
    for name, chain in chains:
        bucket = next((b for b in buckets if b[0][1].joins(chain)), None)
        if bucket is None:
            buckets.append([(name, chain)])
        else:
            bucket.append((name, chain))
    if all(len(b) == 1 for b in buckets):
        return hlg
    layers, dependencies = dict(hlg.layers), {k: set(v) for k, v in hlg.dependencies.items()}
    for bucket in buckets:
        if len(bucket) == 1:
            continue
        ops, places = [], []
        for name, chain in bucket:
            results = chain.results.items()
            places.append((name, {key: (len(ops) + which, keepdims) for key, (which, keepdims) in results}))
            ops.extend(chain.ops)
        shared = "shared-streamed-" + tokenize(*(name for name, _ in bucket))
        steps = _chain_tasks(shared, bucket[0][1]._replace(ops=ops, results={}))
        layers[shared], dependencies[shared] = MaterializedLayer(steps), set()
        last = TaskRef((f"{shared}-step", len(bucket[0][1].groups) - 1))
        # Each chain's layer keeps its name and keys (a blockwise layer names its inputs' layers), now its
        # results alone, taken from the shared stream.
        for name, results in places:
            layers[name] = MaterializedLayer({key: Task(key, stream_result, last, keepdims, which)
                                              for key, (which, keepdims) in results.items()})
            dependencies[name] = {shared}
    return HighLevelGraph(layers, dependencies)
