"""Decoding for chunks that live on a GPU.

For now every step decodes on the host and the result is copied up (one
``PerformanceWarning`` per codec); nvCOMP batches and CuPy filters replace that step by
step (``gpulazy.codecs.nvcomp``).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from gpulazy.device import Device
from gpulazy.spec import ByteRange, Codec

__all__ = ["decode_pieces"]


def decode_pieces(pieces: Sequence[Any], codec: tuple[Codec, ...], expected: Sequence[int], device: Device, *,
                  where: Sequence[ByteRange | None] = ()) -> list[Any]:
    from gpulazy.codecs._pipeline import _host_one, _pad, _record, warn_host_fallback

    import cupy

    started = time.perf_counter()
    warn_host_fallback(codec[0], device)
    out = []
    for p, n, w in zip(pieces, expected, _pad(where, len(pieces))):
        host = _host_one(cupy.asnumpy(p), codec, n, w)
        out.append(cupy.asarray(np.ascontiguousarray(host)))
    _record(sum(expected), started, codec, "host", device)
    return out
