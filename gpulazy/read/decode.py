"""The engine's decode step: bytes that landed, into the chunks' destinations.

Runs inside ``own_stream`` (``gpulazy.read.engine.Reads._finish``): every kernel and copy
here is gpulazy's, waited for before a chunk is handed out. A chunk read as stored is
byte-swapped in place (its bytes usually landed in its destination already); chunks of
stored pieces are decoded together, one codec call per codec for the whole batch
(``gpulazy.codecs.assemble_batch``), each into its destination.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from gpulazy.codecs import assemble_batch, byteswap
from gpulazy.device import Device
from gpulazy.spec import ChunkSpec

__all__ = ["place_plain", "assemble_into", "count"]


def count(kind: str, n: int = 1) -> None:
    """Count buffers the engine makes (``gpulazy.stats()["buffers"]``); see ``Stats.record_buffer``."""
    from gpulazy.stats import default_stats

    default_stats().record_buffer(kind, n)


def place_plain(buf: Any, dest: Any, spec: ChunkSpec, device: Device, inplace: bool) -> Any:
    """The chunk read as stored from ``buf`` (1-D uint8): native byte order, in ``dest`` when given.

    ``inplace``: ``buf`` is ``dest``'s own memory (the read landed where the chunk lives).
    """
    raw = buf[: spec.out_nbytes]
    if spec.needs_byteswap:
        raw = byteswap(raw, np.dtype(spec.dtype), device)
    if inplace:
        return dest
    arr = raw.view(spec.out_dtype)
    arr = arr.reshape(spec.shape[::-1]).transpose() if spec.order == "F" else arr.reshape(spec.shape)
    if dest is None:
        return arr
    dest[...] = arr  # a destination not contiguous in the chunk's order (a napari region, an F slice)
    count("copies")
    return dest


def assemble_into(bufs: Sequence[Any], specs: Sequence[ChunkSpec], dests: Sequence[Any], device: Device) -> list[Any]:
    """Chunks of stored pieces decoded from their stored bytes into ``dests`` (allocated where ``None``).

    One ``assemble_batch`` call for all of them: each codec decodes every piece of the batch
    at once. Should that call fail, each chunk is decoded alone, so the error is its own
    chunk's and the others are handed out.
    """
    outs = []
    for spec, dest in zip(specs, dests):
        if dest is None:
            dest = device.alloc(spec.shape, spec.out_dtype, "F" if spec.order == "F" else "C")
            count("outputs")
        outs.append(dest)
    count("copies", sum(max(1, len(s.tile_segments())) for s in specs))  # each piece placed once
    try:
        return assemble_batch(bufs, specs, device, outs)
    except Exception:
        if len(specs) == 1:
            raise
    results: list[Any] = []
    for buf, spec, out in zip(bufs, specs, outs):
        try:
            results.append(assemble_batch([buf], [spec], device, [out])[0])
        except Exception as e:
            results.append(e)
    return results
