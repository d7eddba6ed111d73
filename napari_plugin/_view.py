"""What napari is handed: a host view of a device array, and a pyramid built from cached chunks.

napari renders host arrays: slicing calls ``np.asarray(data[slices])``, and CuPy refuses
implicit conversion. ``HostView`` wraps the lazy device array: indexing stays lazy, and
``np.asarray`` computes only the selected region (its chunks come from the gpulazy device
cache, which keeps them whole for the next plane and for computation) and copies only
that region to the host. ``HostView.transfers`` counts what crossed.

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

    def __init__(self, array: Any, *, label: str, target: Any = None, transfers: Transfers | None = None):
        self.array = array
        self.label = label
        self.target = target
        self.transfers = transfers if transfers is not None else Transfers()

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
        return HostView(self.array[key], label=self.label, transfers=self.transfers)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        host = self.to_host()
        return host if dtype is None else host.astype(dtype, copy=False)

    def to_host(self) -> np.ndarray:
        """Compute the region on its device and copy just it to the host."""
        try:
            region = self.array.compute(scheduler="threads")
        except Exception as e:
            notify_read_error(self.label, e)
            raise
        host = _host_copy(region)
        self.transfers.add(host.nbytes)
        return host


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
