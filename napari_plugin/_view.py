"""What napari is handed: a host view of a device array, and a pyramid built from cached chunks.

napari renders host arrays: slicing calls ``np.asarray(data[slices])``, and CuPy refuses
implicit conversion. ``HostView`` wraps the lazy device array: indexing stays lazy, and
``np.asarray`` reads only the selected region and copies only it to the host. A plain box
(ints and step-1 slices) of a gpulazy array is read chunk by chunk straight from the device
cache (``DeviceCache.get_region``: the chunk stays whole in the cache for the next plane and
for computation, and only the box is copied out), with no dask graph per plane; anything else
(a pyramid level, fancy indexing) is computed by dask. ``HostView.transfers`` counts what
crossed to the host.

A read error during that conversion reaches the user as a napari notification naming the
file, then propagates (never a zero-filled plane).

Imports neither napari nor Qt at import time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["HostView", "Transfers", "pyramid", "PYRAMID_MIN_SIDE"]

#: A plane with a side longer than this gets a lazy pyramid when the file has none; levels
#: are added until the longest side is at most half of it.
PYRAMID_MIN_SIDE = 4096


@dataclass
class Transfers:
    """Device -> host copies made for display: how many, and their bytes (thread-safe)."""

    count: int = 0
    bytes: int = 0
    largest: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.count += 1
            self.bytes += int(nbytes)
            self.largest = max(self.largest, int(nbytes))

    def reset(self) -> None:
        with self._lock:
            self.count = self.bytes = self.largest = 0


class HostView:
    """A lazy array napari can slice and convert; only the region asked for reaches the host.

    Parameters
    ----------
    array
        A dask array with NumPy or CuPy chunks (what ``gpulazy.from_files`` returns, or
        a pyramid level built from it).
    label
        The file(s) it reads, for messages.
    target
        The gpulazy array whose chunks this view reads (for motion prefetch); ``None``
        for a view that is not worth warming (a slice).
    transfers
        The counter shared by a view and its slices.
    """

    def __init__(self, array: Any, *, label: str, target: Any = None, transfers: Transfers | None = None,
                 key: tuple | None = None):
        self.array = array
        self.label = label
        self.target = target
        self.transfers = transfers if transfers is not None else Transfers()
        #: ``(base, per-axis int or range)`` when this view is a plain box of a gpulazy
        #: array: it is then read chunk by chunk from the cache, without a dask graph.
        self._direct = key

    # -- the array-like surface napari reads ------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.array.dtype)

    @property
    def ndim(self) -> int:
        return len(self.array.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<gpulazy HostView {self.shape} {self.dtype} of {self.label}>"

    def __getitem__(self, key: Any) -> HostView:
        direct = _box(self.array, key) if self._direct is None and self.target is self.array else None
        return HostView(self.array[key], label=self.label, transfers=self.transfers, key=direct)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        host = self.to_host()
        return host if dtype is None else host.astype(dtype, copy=False)

    def to_host(self) -> np.ndarray:
        """Compute the region on its device and copy just it to the host."""
        try:
            region = _read_box(*self._direct) if self._direct is not None else \
                self.array.compute(scheduler="threads")
        except Exception as e:
            notify_read_error(self.label, e)
            raise
        host = _host_copy(region)
        self.transfers.add(host.nbytes)
        return host


def _box(array: Any, key: Any) -> tuple | None:
    """``(array, [int | range per axis])`` for a basic index (ints, step-1 slices, ``...``), else None."""
    if getattr(array, "chunk_index", None) is None:
        return None
    key = key if isinstance(key, tuple) else (key,)
    if sum(k is Ellipsis for k in key) > 1:
        return None
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (array.ndim - len(key) + 1) + key[i + 1:]
    key = key + (slice(None),) * (array.ndim - len(key))
    if len(key) != array.ndim:
        return None
    out: list[int | range] = []
    for k, n in zip(key, array.shape):
        if isinstance(k, (int, np.integer)) and not isinstance(k, bool) and -n <= k < n:
            out.append(int(k) % n)
        elif isinstance(k, slice) and k.step in (None, 1):
            out.append(range(*k.indices(n)))
        else:
            return None  # fancy, stepped or out of range: dask handles (or refuses) it
    return array, out


def _read_box(array: Any, box: list) -> Any:
    """The box of ``array`` (ints drop their axis), its chunks read through the cache.

    The result is allocated once, in the caller's memory pool, and each chunk's part of the
    box is copied straight into it on gpulazy's stream (``DeviceCache.get_region(out=)``): one
    copy per chunk, no per-chunk temporaries, and every byte in place when this returns
    (docs/streams.md).
    """
    import itertools

    from gpulazy.device import get_device, own_stream

    source = array.chunk_source
    cache = source.cache_instance()
    dev = get_device(source.device)
    edges = [np.cumsum((0,) + tuple(c)) for c in array.chunks]
    spans = [range(b, b + 1) if isinstance(b, int) else b for b in box]
    kept = [not isinstance(b, int) for b in box]  # axes the result keeps
    out = dev.alloc(tuple(len(s) for s, k in zip(spans, kept) if k), array.dtype)
    for idx in itertools.product(*(_blocks(e, s) for e, s in zip(edges, spans))):
        region = tuple(slice(max(s.start, e[i]) - e[i], min(s.stop, e[i + 1]) - e[i])
                       for s, e, i in zip(spans, edges, idx))
        at = tuple(slice(e[i] + r.start - s.start, e[i] + r.stop - s.start)
                   for s, e, i, r, k in zip(spans, edges, idx, region, kept) if k) + (Ellipsis,)  # a view, 0-d too
        region = tuple(r if k else r.start for r, k in zip(region, kept))
        spec = array.chunk_index.specs[idx]
        if cache is not None:
            cache.get_region(spec, source.read, region, out=out[at])
        else:
            chunk = source.read(spec)
            with own_stream(dev):
                out[at] = chunk[region]
    return out


def _blocks(edges: np.ndarray, span: range) -> range:
    """Block indices along one axis (block ``i`` spans ``edges[i]:edges[i + 1]``) that ``span`` meets."""
    if not len(span):
        return range(0)
    first = int(np.searchsorted(edges, span.start, "right")) - 1
    return range(first, int(np.searchsorted(edges, span.stop - 1, "right")))


def _host_copy(region: Any) -> np.ndarray:
    if isinstance(region, np.ndarray):
        # A slice of a chunk is a view that would keep the whole chunk alive on the host.
        return region if region.base is None else region.copy()
    from gpulazy.convert import to_numpy

    return to_numpy(region)


def notify_read_error(label: str, error: BaseException) -> None:
    """Tell the napari user that reading ``label`` failed (a no-op outside napari)."""
    where = getattr(error, "path", None) or label
    try:
        from napari.utils.notifications import show_error
    except ImportError:
        return
    show_error(f"gpulazy could not read {where}: {type(error).__name__}: {error}")


# -- a pyramid for data that has none ------------------------------------------------------

def _mean_keep_dtype(block: Any, axis: tuple[int, ...] | None = None, dtype: Any = None) -> Any:
    # Runs on the block's device (CuPy methods on a GPU, NumPy on the host). dask calls it
    # once without ``axis`` on a tiny NumPy array to learn the result's type.
    dtype = block.dtype if dtype is None else dtype
    out = block.mean(axis=axis, dtype="float32" if np.dtype(dtype).itemsize <= 2 else "float64")
    if np.dtype(dtype).kind in "iub":
        out = out.round()
    return out.astype(dtype, copy=False)


def pyramid(array: Any, *, min_side: int = PYRAMID_MIN_SIDE) -> list[Any]:
    """``[array, half, quarter, ...]`` over the last two axes, when a plane is larger than ``min_side``.

    Levels halve until the plane's longest side is at most ``min_side // 2`` (2048 px by
    default: a size napari draws at once).

    Each level is the 2 x 2 mean of the one before, computed lazily by dask from the
    full-resolution chunks (read through the device cache) on their device; only the
    last two axes shrink, so stepping through planes of a zoomed-out view reads each
    plane once. Returns ``[array]`` when the planes are small enough to show as they are.
    """
    import dask.array as da

    if array.ndim < 2 or max(array.shape[-2:]) <= min_side:
        return [array]
    axes = {array.ndim - 2: 2, array.ndim - 1: 2}
    levels = [array]
    while max(levels[-1].shape[-2:]) > min_side // 2 and min(levels[-1].shape[-2:]) >= 2:
        levels.append(da.coarsen(_mean_keep_dtype, levels[-1], axes, trim_excess=True, dtype=array.dtype))
    return levels
