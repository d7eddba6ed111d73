"""Reductions that run as the reads land: ``max``, ``min``, ``sum``, ``mean``, ``var``, ``std``.

Through dask, a reduction over a gpulazy array is one task per chunk and a tree of combine
tasks: on an H100 dask alone took 120 ms for a MIP of 4 GiB of 128 MiB chunks already in
device memory (35.9 GB/s), so no read could make that MIP reach the whole-array read rate
(43 GB/s). Here the whole reduction is one task: the engine reads the chunks in order, a
submission per ``GROUP`` bytes with the next ones in flight (``read_in_order``), and each
chunk is folded into the result as it lands, then dropped. Device memory holds the
accumulator and the chunks in flight (config ``read_ahead``), never the array. Chunks in the
array's cache are folded where they lie (``DeviceCache.visit``: no copy), and chunks read are
offered to it, so a second reduction over the same data reads nothing.

Values equal dask's up to floating-point order: ``max``/``min`` exactly; sums in the
dtype NumPy sums in (``uint16`` -> ``uint64``); ``mean``, ``var``, ``std`` accumulate in
float64 (Chan's parallel update for the variance) and return NumPy's result dtype.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gpulazy.device import Device, get_device, own_stream
from gpulazy.spec import ChunkSpec

__all__ = ["OPS", "result_dtype", "reduce_stream"]

OPS = frozenset({"max", "min", "sum", "mean", "var", "std"})


def result_dtype(op: str, dtype: Any, ndim: int, axis: tuple[int, ...], cast: Any = None) -> np.dtype:
    """The dtype NumPy gives ``op`` over an array of ``dtype`` (``cast`` first, as ``astype`` does)."""
    probe = np.ones((1,) * ndim, dtype=cast if cast is not None else dtype)
    return getattr(np, op)(probe, axis=axis).dtype


def reduce_stream(specs: dict, source: Any, chunks: tuple, dtype: Any, op: str, axis: tuple[int, ...],
                  keepdims: bool = False, ddof: int = 0, cast: Any = None) -> Any:
    """``op`` of the array ``specs`` describes over ``axis``, folded chunk by chunk as the reads land.

    ``cast``: the dtype each chunk is cast to first (``vol.astype(cast).sum()``).
    """
    from gpulazy import config
    from gpulazy.read.whole import read_in_order

    dev = get_device(source.device)
    from gpulazy.integrity import check_all_unchanged

    backend = source.backend_instance()
    cache = source.cache_instance()

    def fold(spec: ChunkSpec, chunk: Any) -> None:
        # On gpulazy's stream, waited for on leaving: the chunk goes back to the pool only
        # once the kernels reading it are done.
        with own_stream(dev):
            acc.fold(spec, chunk)

    def fold_and_keep(spec: ChunkSpec, chunk: Any) -> None:
        fold(spec, chunk)
        cache.get(spec, lambda s: chunk)  # kept (one copy) when there is room: the next compute reads nothing

    check_all_unchanged(specs.values())  # a cached chunk of a file changed since indexing is never used
    with dev.activate():
        acc = _Accumulator(op, chunks, axis, dtype, cast, ddof, dev)
        wanted = [spec for spec in specs.values() if math.prod(spec.shape)]
        if cache is not None:
            wanted = cache.visit(wanted, fold)  # hits folded in place, no copy
        todo = [(spec, None) for spec in wanted]
        limit = max(int(config.get("read_ahead")), 2 * _largest(todo))
        read_in_order(todo, backend, source.verify, fold if cache is None else fold_and_keep, limit)
        out = acc.result()
    if keepdims:
        out = out.reshape(tuple(1 if a in axis else n for a, n in enumerate(map(sum, chunks))))
    return out


def _largest(todo: list) -> int:
    return max((s.out_nbytes + s.nbytes for s, _ in todo), default=0)


class _Accumulator:
    """The running result of ``op``: each chunk folded into the block of the result it maps to."""

    def __init__(self, op: str, chunks: tuple, axis: tuple[int, ...], dtype: Any, cast: Any, ddof: int,
                 dev: Device):
        self.op, self.axis, self.ddof, self.dev, self.xp = op, axis, ddof, dev, dev.xp
        self.cast = np.dtype(cast) if cast is not None else None
        self.kept = [a for a in range(len(chunks)) if a not in axis]
        self.edges = [np.cumsum((0,) + tuple(c)) for c in chunks]
        shape = tuple(int(sum(chunks[a])) for a in self.kept)
        self.out_dtype = result_dtype(op, dtype, len(chunks), axis, cast)
        work = self.out_dtype if op in ("max", "min", "sum") else np.dtype("f8")
        self.shape = shape
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
        if self.cast is not None:
            chunk = chunk.astype(self.cast, copy=False)
        block, region = self._block(spec)
        n = math.prod(chunk.shape[a] for a in axis)
        seen = int(self.count[block])
        dst = self.total[region]
        if op in ("max", "min"):
            part = getattr(xp, op)(chunk, axis=axis)
            if seen == 0:
                dst[...] = part
            else:
                (xp.maximum if op == "max" else xp.minimum)(dst, part, out=dst)
        elif op == "sum":
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

    def result(self) -> Any:
        """The reduction, in an array from the consumer's pool, complete on every stream."""
        xp, op = self.xp, self.op
        if op in ("max", "min", "sum"):
            return self.total
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
