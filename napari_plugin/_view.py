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
from typing import Any, Callable

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
    #: Boxes read straight from a plain chunk's bytes, not waiting for the whole chunk (``_part_read``).
    part_reads: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.count += 1
            self.bytes += int(nbytes)
            self.largest = max(self.largest, int(nbytes))

    def add_part_read(self) -> None:
        with self._lock:
            self.part_reads += 1

    def reset(self) -> None:
        with self._lock:
            self.count = self.bytes = self.largest = self.part_reads = 0


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

    Attributes
    ----------
    claim
        ``claim(specs)``, set by the viewer's motion prefetch (``MotionPrefetch.claim``): called
        before a plane is read whose chunks are neither cached nor on their way; its slices
        inherit it.
    defer
        ``defer(view)``, set by the 3-D view's coarse level (``_volume.VolumeSwap``): when it
        says so, converting the view reads nothing and gives zeros of its shape that take no
        memory (``np.broadcast_to``): napari slicing the whole full-resolution volume on
        entering 3-D, just before the coarse level replaces it in the same event. Its slices
        inherit it.
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
        self.claim: Callable[[list], Any] | None = None
        self.defer: Callable[[HostView], bool] | None = None

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
        view = HostView(self.array[key], label=self.label, transfers=self.transfers, key=direct)
        view.claim, view.defer = self.claim, self.defer
        return view

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if self.defer is not None and self.defer(self):
            return np.broadcast_to(np.zeros((), dtype=dtype or self.dtype), self.shape)
        host = self.to_host()
        return host if dtype is None else host.astype(dtype, copy=False)

    def to_host(self) -> np.ndarray:
        """Compute the region on its device and copy just it to the host."""
        try:
            if self._direct is not None:
                region = _read_box(*self._direct, claim=self.claim, transfers=self.transfers)
            else:
                region = self.array.compute(scheduler="threads")
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


def _read_box(array: Any, box: list, *, claim: Callable[[list], Any] | None = None,
              transfers: Transfers | None = None) -> Any:
    """The box of ``array`` (ints drop their axis), its chunks read through the cache.

    The result is allocated once, in the caller's memory pool, and each chunk's part of the
    box is copied straight into it on gpulazy's stream (``DeviceCache.get_region(out=)``): one
    copy per chunk, no per-chunk temporaries, and every byte in place when this returns
    (docs/streams.md).

    The plane on screen comes first. Chunks of the box that are neither cached nor on their
    way (a jump, or read-ahead fallen behind) are read at once, together, by this thread in one
    engine submission (``_read_together``: their pieces decode in one codec call), after
    ``claim([])`` (the viewer's motion prefetch, ``MotionPrefetch.claim``) dropped the read-ahead
    queued before them. A plain chunk (uncompressed, untiled: ``_part_read``) of which the box needs little
    is not waited for at all: the box's byte range is read straight into the result and the
    whole chunk is warmed behind it, for the next plane. So is a zstd chunk whose first planes
    hold the box (``_head_read``): only those decode, from a head of its stored bytes.

    Every read this function waits on goes through the view lane (``ChunkSource.for_viewer``):
    a backend's queue is first in, first out, and a plane queued behind the read-ahead a jump
    started waited for all of it.
    """
    from gpulazy.device import get_device, own_stream
    from gpulazy.integrity import check_unchanged

    source = array.chunk_source
    view = source.for_viewer()
    cache = source.cache_instance()
    dev = get_device(source.device)
    pieces, shape = _pieces(array, box)
    out = dev.alloc(shape, array.dtype)
    if cache is None:
        for spec, region, at in pieces:
            chunk = view.read(spec)
            with own_stream(dev):
                out[at] = chunk[region]
        return out
    uncached = [p for p in pieces if PLANE_FIRST and p[0] not in cache]
    parts = {id(p): part for p in uncached if (part := _part_read(*p[:2])) is not None}
    # Chunks no one is reading yet (a jump, or read-ahead fallen behind); a plain chunk's part
    # is read here even while its whole chunk is on its way.
    absent = [p[0] for p in uncached if not cache.holds(p[0])]
    whole = [p[0] for p in uncached if id(p) not in parts and not cache.holds(p[0])]
    if claim is not None and absent:
        claim([])                # the read-ahead queued before this plane is stale: dropped
    heads = _read_heads([part[0] for part in parts.values() if part[0].is_head], view)
    read = _read_together(whole, view) if len(whole) > 1 else {}
    for p in pieces:
        spec, region, at = p
        part = parts.get(id(p))
        if spec.key in read:
            with own_stream(dev):
                out[at] = read[spec.key][region]
            continue
        if part is None:
            cache.get_region(spec, view.read, region, out=out[at], check=check_unchanged)
            continue
        sub, sub_region = part
        chunk = heads[sub.key] if sub.is_head else view.read(sub)
        with own_stream(dev):
            out[at] = chunk[sub_region]
        if transfers is not None:
            transfers.add_part_read()
    if parts:
        cache.prefetch([p[0] for p in uncached if id(p) in parts], source.read)  # warmed behind the plane
    return out


def _head_read(spec: Any, region: tuple) -> tuple[Any, tuple] | None:
    """``(sub-spec, region in it)`` decoding only a compressed chunk's planes up to the region's
    last (``ChunkSpec.head``: zstd, from a head of its stored bytes), when those are at most
    ``HEAD_READ_SHARE`` of its planes; else ``None``."""
    first = region[0]
    lo, hi = (first, first + 1) if isinstance(first, int) else (first.start, first.stop)
    if not spec.shape or hi > HEAD_READ_SHARE * spec.shape[0]:
        return None
    found = spec.head(lo, hi)
    if found is None:
        return None
    at, sub = found
    shifted = first - at if isinstance(first, int) else slice(lo - at, hi - at)
    return sub, (shifted,) + tuple(region[1:])


def _read_heads(specs: list, source: Any) -> dict:
    """``{key: array}`` of ``_head_read`` sub-specs, read in one engine submission (their pieces decode
    together) and not cached (each is a plane's worth, the whole chunk is warmed behind it); a head
    whose frame cannot serve it (``HeadShort``) the engine reads as its whole chunk."""
    return {spec.key: pending.result() for spec, pending in zip(specs, source.start(specs) if specs else ())}


def _read_together(specs: list, source: Any) -> dict:
    """``{key: chunk}`` for chunks the box needs that no one is reading: one engine submission,
    their stored pieces decoded in one codec call per codec (nvCOMP sees them all at once), each
    chunk offered to the cache as it is handed out (``ChunkSource.start_many``). On an H100 a
    jump to a plane of 16 zstd chunks took 235 ms as one read per chunk, against 138 ms for dask.
    """
    arrays = source.start_many(tuple(specs)).result()
    return {spec.key: arr for spec, arr in zip(specs, arrays)}


def _pieces(array: Any, box: list) -> tuple[list[tuple[Any, tuple, tuple]], tuple[int, ...]]:
    """``([(spec, region in the chunk, where in the result), ...], result shape)`` for a box."""
    import itertools

    edges = [np.cumsum((0,) + tuple(c)) for c in array.chunks]
    spans = [range(b, b + 1) if isinstance(b, int) else b for b in box]
    kept = [not isinstance(b, int) for b in box]  # axes the result keeps
    pieces = []
    for idx in itertools.product(*(_blocks(e, s) for e, s in zip(edges, spans))):
        region = tuple(slice(int(max(s.start, e[i]) - e[i]), int(min(s.stop, e[i + 1]) - e[i]))
                       for s, e, i in zip(spans, edges, idx))
        at = tuple(slice(int(e[i] + r.start - s.start), int(e[i] + r.stop - s.start))
                   for s, e, i, r, k in zip(spans, edges, idx, region, kept) if k) + (Ellipsis,)  # a view, 0-d too
        region = tuple(r if k else r.start for r, k in zip(region, kept))
        pieces.append((array.chunk_index.specs[idx], region, at))
    return pieces, tuple(len(s) for s, k in zip(spans, kept) if k)


#: A box reads its own bytes of a plain chunk only when they are at most this share of the chunk.
PART_READ_SHARE = 0.5
#: A box decodes the first planes of a zstd chunk alone (``_head_read``) only when they are at most
#: this share of the chunk: a head decodes on one host core, a whole chunk's pieces on the GPU.
HEAD_READ_SHARE = 0.25
#: ``False``: read a box's chunks one after another through the cache, as before the plane
#: came first (``benchmarks/bench_napari.py --compare`` measures both ways in one run).
PLANE_FIRST = True


def _part_read(spec: Any, region: tuple) -> tuple[Any, tuple] | None:
    """``(sub-spec, region in it)`` reading only the bytes ``region`` spans, or ``None``.

    Only for a plain chunk: one byte range holding its elements in C order, no codec, no tiles
    (raw, ``.npy``, uncompressed contiguous data). The sub-spec is the run of elements from the
    region's first to its last: whole rows of the first axis along which the region has more
    than one element (``region`` axes before it are single indices), e.g. the rows of one plane
    of a 3-D chunk. ``None`` when that run is more than ``PART_READ_SHARE`` of the chunk. A
    compressed chunk's part is ``_head_read``'s.
    """
    from gpulazy.spec import ByteRange, ChunkSpec

    if spec.codec is not None:
        return _head_read(spec, region)
    if spec.tiles or spec.order != "C" or len(spec.ranges) != 1:
        return None
    (rng,) = spec.ranges
    if rng.nbytes != spec.out_nbytes or not spec.shape:
        return None
    sels = [(r, r + 1) if isinstance(r, int) else (r.start, r.stop) for r in region]
    k = next((a for a, (lo, hi) in enumerate(sels) if hi - lo != 1), len(sels) - 1)
    strides = [int(np.prod(spec.shape[a + 1:], dtype=np.int64)) for a in range(len(spec.shape))]
    first = sum(sels[a][0] * strides[a] for a in range(k + 1))
    count = (sels[k][1] - sels[k][0]) * strides[k]
    itemsize = np.dtype(spec.dtype).itemsize
    if count * itemsize > PART_READ_SHARE * spec.out_nbytes:
        return None
    sub = ChunkSpec((ByteRange(rng.path, rng.offset + first * itemsize, count * itemsize),),
                    (sels[k][1] - sels[k][0],) + tuple(spec.shape[k + 1:]), spec.dtype,
                    identity=spec.identity, index=spec.index)
    # Axes before k are single elements of the chunk: those the result keeps come back as
    # length-1 axes when the part is copied into the result's view (broadcast).
    at_k = 0 if isinstance(region[k], int) else slice(None)
    return sub, (at_k,) + tuple(region[k + 1:])


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
