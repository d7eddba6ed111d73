"""Device memory: give it back on request (``release``) and recover from running out of it.

Out-of-memory recovery: a read or a cache insertion that raises ``MemoryError`` (CuPy's
``OutOfMemoryError`` is one) makes room — the caches on that device drop their entries
and queued read-ahead, their read-ahead budget halves, CuPy's pools return free blocks —
and is retried once. If it fails again the error says how many bytes were asked for,
how many are free and how many gpulazy still holds.

>>> import gpulazy
>>> report = gpulazy.release()
>>> sorted(report)
['cache_bytes', 'caches', 'pinned_blocks', 'pool_bytes']
"""

from __future__ import annotations

import sys
from typing import Any, Callable, TypeVar

from gpulazy.device import Device, get_device
from gpulazy.errors import DeviceMemoryError

__all__ = ["release", "retry_on_oom", "make_room"]

T = TypeVar("T")


def _caches(device: Device | None) -> list[Any]:
    from gpulazy.cache import open_caches

    return [c for c in open_caches() if device is None or c.device == device]


def _free_pools() -> tuple[int, int]:
    """Return CuPy's free pool blocks: (device bytes, pinned blocks) given back. CuPy is not imported here."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return 0, 0
    from gpulazy.device import gpu_count

    if gpu_count() == 0:  # CuPy imported (dask does) but no device: its pools were never used
        return 0, 0
    pool, pinned = cupy.get_default_memory_pool(), cupy.get_default_pinned_memory_pool()
    before = pool.total_bytes() - pool.used_bytes()
    pinned_before = pinned.n_free_blocks()
    pool.free_all_blocks()
    pinned.free_all_blocks()
    # CuPy's pinned pool reports how many blocks it holds, not their bytes.
    return int(before), int(pinned_before)


def release(device: Any = None) -> dict[str, int]:
    """Empty gpulazy's caches and return CuPy's free pool blocks; what was freed.

    Parameters
    ----------
    device
        Only the caches on this device (``"cuda:1"``); ``None``: every device.

    Returns
    -------
    dict
        ``cache_bytes`` (bytes the caches held), ``caches`` (how many were emptied),
        ``pool_bytes`` (free CuPy pool bytes given back to the driver), ``pinned_blocks``
        (free pinned host blocks given back; CuPy does not report their bytes).
    """
    dev = get_device(device) if device is not None else None
    caches = _caches(dev)
    held = 0
    for cache in caches:
        held += cache.bytes_held
        cache.clear()
    pool, pinned = _free_pools()
    return {"cache_bytes": held, "caches": len(caches), "pool_bytes": pool, "pinned_blocks": pinned}


def make_room(device: Device) -> int:
    """After an out-of-memory: evict the caches on ``device``, halve their read-ahead, free pools."""
    freed = 0
    for cache in _caches(device):
        cache.cancel()
        freed += cache.bytes_held
        cache.clear()
        cache.shrink_readahead()
    freed += _free_pools()[0]
    return freed


def retry_on_oom(fn: Callable[[], T], *, device: Device, nbytes: int, what: str) -> T:
    """``fn()``, retried once after ``make_room`` if it runs out of memory.

    Raises ``DeviceMemoryError`` (a ``MemoryError``) with the requested, free and cached
    bytes when the second try fails too.
    """
    try:
        return fn()
    except MemoryError:
        pass  # handled outside the except block, so the first error's frames are released
    from gpulazy.stats import default_stats

    make_room(device)
    record = getattr(default_stats(), "record_oom", None)
    if record is not None:
        record(device=device.name)
    try:
        return fn()
    except MemoryError as e:
        free, total = device.memory()
        cached = sum(c.bytes_held for c in _caches(device))
        raise DeviceMemoryError(
            f"out of memory on {device.name} while {what}: {nbytes} bytes requested, {free} of {total} free, "
            f"{cached} held by gpulazy's caches after evicting them; use smaller chunks (chunks=), a smaller "
            "cache (gpulazy.config.set(cache='4 GiB')) or free memory held elsewhere (gpulazy.release())") from e
