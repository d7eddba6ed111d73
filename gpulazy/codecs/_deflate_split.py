"""Deflate on a GPU host: nvCOMP and the host's cores side by side, the batch split by measured rates.

nvCOMP's Deflate is slow for a GPU (1.7 GB/s of output on an H100, ECOSYSTEM.md), while
libdeflate (the ``deflate`` package) decodes 0.29 GB/s per core here and releases the GIL,
so a 16-core host decodes about as fast as the GPU. ``split`` gives each side a share of a
batch's bytes in proportion to its rate; ``record`` keeps each side's rate as the batches
measure it (both sides running at once, as they do), so the split follows the machine.

>>> split([100, 100, 100, 100], host_rate=1.0, gpu_rate=1.0)
[0, 1]
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Sequence

from gpulazy.spec import Codec

__all__ = ["applies", "split", "record", "rates", "DEFLATE_IDS"]

DEFLATE_IDS = frozenset({"zlib", "gzip", "imagecodecs_zlib", "imagecodecs_deflate"})
#: Starting rates in bytes of output per second: libdeflate per core (measured on this
#: project's 2-core CI machine, ``benchmarks/bench_codecs.py --host-deflate``), Python's zlib
#: per core (ibid.), nvCOMP Deflate on an H100 (ECOSYSTEM.md). Replaced as batches measure.
_LIBDEFLATE_PER_CORE, _ZLIB_PER_CORE, _NVCOMP_DEFLATE = 0.29e9, 0.17e9, 1.7e9
_MIN_SHARE = 0.05  # each side keeps some bytes, so its rate stays measured
_lock = threading.Lock()
_rates: dict[str, float] = {}


def applies(c: Codec, npieces: int) -> bool:
    """Whether a batch of ``npieces`` pieces of ``c`` is split between host and GPU."""
    return c.id in DEFLATE_IDS and npieces > 1


@functools.cache
def _has_libdeflate() -> bool:
    import importlib.util

    return importlib.util.find_spec("deflate") is not None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def rates() -> dict[str, float]:
    """The current ``{"host": ..., "gpu": ...}`` rates in bytes per second."""
    with _lock:
        if not _rates:
            per_core = _LIBDEFLATE_PER_CORE if _has_libdeflate() else _ZLIB_PER_CORE
            _rates.update(host=per_core * _cores(), gpu=_NVCOMP_DEFLATE)
        return dict(_rates)


def record(place: str, nbytes: int, seconds: float) -> None:
    """Fold one batch's measured rate for ``place`` ("host" or "gpu") into the running one."""
    if nbytes <= 0 or seconds <= 0:
        return
    rates()
    with _lock:
        _rates[place] = 0.5 * _rates[place] + 0.5 * nbytes / seconds


def split(sizes: Sequence[int], host_rate: float | None = None, gpu_rate: float | None = None) -> list[int]:
    """Indices of the pieces the host decodes: in order, until its share of the bytes is reached.

    The host's share is ``host_rate / (host_rate + gpu_rate)`` (both finish at once), kept
    within [5 %, 95 %] so that neither side stops being measured.
    """
    if host_rate is None or gpu_rate is None:
        r = rates()
        host_rate, gpu_rate = r["host"], r["gpu"]
    share = min(1 - _MIN_SHARE, max(_MIN_SHARE, host_rate / (host_rate + gpu_rate)))
    goal, taken, picked = share * sum(sizes), 0, []
    for i, n in enumerate(sizes):
        if taken + n / 2 > goal:  # the piece would overshoot the share by more than it fills
            break
        picked.append(i)
        taken += n
    return picked
