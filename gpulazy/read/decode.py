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


def place_plain(bufs: Sequence[Any], dests: Sequence[Any], specs: Sequence[ChunkSpec], device: Device,
                inplace: Sequence[bool]) -> list[Any]:
    """Chunks read as stored, each from its buffer (1-D uint8): native byte order, in its
    destination when given. ``inplace[i]``: ``bufs[i]`` is ``dests[i]``'s own memory (the read
    landed where the chunk lives). A chunk that fails gets its error in its place.

    Destinations not contiguous in the chunk's order (a tile of a result, a napari region)
    are filled together: on a GPU in one launch (``gpulazy.codecs.place``), since a CuPy
    assignment per chunk costs a launch and tens of microseconds of Python (placing the 2,048
    decoded tiles of a 4 GiB Zarr one by one took 80 ms on an H100).
    """
    from gpulazy.codecs import place

    outs: list[Any] = []
    copies: list[tuple[Any, Any, tuple]] = []
    for buf, dest, spec, done in zip(bufs, dests, specs, inplace):
        if done and not spec.needs_byteswap:
            outs.append(dest)  # landed where it lives
            continue
        try:
            raw = buf[: spec.out_nbytes]
            if spec.needs_byteswap:
                raw = byteswap(raw, np.dtype(spec.dtype), device)
        except Exception as e:
            outs.append(e)
            continue
        if done:
            outs.append(dest)
            continue
        arr = raw.view(spec.out_dtype)
        arr = arr.reshape(spec.shape[::-1]).transpose() if spec.order == "F" else arr.reshape(spec.shape)
        if dest is None:
            outs.append(arr)
            continue
        copies.append((dest, arr, (0,) * arr.ndim))
        outs.append(dest)
    if copies:
        if device.is_gpu:
            place.place(copies)
        else:
            for dest, arr, _ in copies:
                dest[...] = arr
        count("copies", len(copies))
    return outs


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
