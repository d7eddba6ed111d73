"""Codecs: from a chunk's stored bytes to its values. Knows no file format.

A chunk spec with ``tiles`` (or a ``codec``) is read as one buffer holding each stored
piece's bytes back to back; ``assemble`` decodes every piece through the spec's codec
pipeline, byte-swaps to native order, and places it in the chunk (elements no piece
covers get the spec's ``fill_value``).

Decoding runs where the chunk lives. On ``"cpu"`` every codec decodes with numcodecs
(imagecodecs for TIFF's own). On a GPU, codecs nvCOMP can decode run there in batches
(``gpulazy.codecs.nvcomp``), filters run as CuPy kernels; the rest decode on the host
and are copied up, with one ``PerformanceWarning`` per codec and the path recorded in
``gpulazy.stats()``.

>>> import numpy as np, numcodecs
>>> from gpulazy.spec import ByteRange, ChunkSpec, Codec, Tile
>>> from gpulazy.device import get_device
>>> data = np.arange(6, dtype="<u2")
>>> blob = np.frombuffer(numcodecs.Zstd().encode(data.tobytes()), "u1")
>>> tile = Tile(ByteRange("f", 0, blob.size), (6,), (0,))
>>> spec = ChunkSpec((tile.range,), (4,), "<u2", codec=(Codec("zstd"),), tiles=(tile,))
>>> assemble(blob.copy(), spec, get_device("cpu")).tolist()
[0, 1, 2, 3]
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from gpulazy.codecs._pipeline import check_supported, decode_pieces, gpu_codecs
from gpulazy.device import Device
from gpulazy.errors import ChunkDecodeError
from gpulazy.spec import ChunkSpec, Tile

__all__ = ["assemble", "decode_pieces", "check_supported", "gpu_codecs", "decoded_on"]


def assemble(buf: Any, spec: ChunkSpec, device: Device) -> Any:
    """The chunk's array (native byte order, ``spec.shape``) from its stored bytes ``buf``."""
    dt = np.dtype(spec.dtype)
    segments = spec.tile_segments() if spec.tiles else [(_whole(spec), 0, spec.nbytes)]
    expected = [math.prod(t.shape) * dt.itemsize for t, _, _ in segments]
    with device.activate():
        pieces = decode_pieces([buf[a:a + n] for _, a, n in segments], spec.codec or (), expected, device,
                               where=[t.range for t, _, _ in segments])
        out = _allocate(spec, device)
        for (tile, _, _), raw, want in zip(segments, pieces, expected):
            if raw.size != want:
                r = tile.range
                raise ChunkDecodeError(
                    f"stored chunk of {r.path!r} at offset {r.offset} ({r.nbytes} bytes) decoded to {raw.size} "
                    f"bytes, expected {want} (shape {tile.shape} of {dt.str!r}); the file is corrupt or its "
                    "metadata does not describe it", path=r.path, offset=r.offset, expected=want, got=raw.size)
            _place(out, _typed(raw, dt, tile, device), tile)
    return out


def _whole(spec: ChunkSpec) -> Tile:
    first = spec.ranges[0] if spec.ranges else None
    return Tile(first, spec.shape, (0,) * len(spec.shape), spec.order)


def _allocate(spec: ChunkSpec, device: Device) -> Any:
    xp, native = device.xp, spec.out_dtype
    if not spec.tiles or _covered(spec):
        return xp.empty(spec.shape, dtype=native)
    return xp.full(spec.shape, spec.fill_value, dtype=native)


def _covered(spec: ChunkSpec) -> bool:
    if any(t.range is None for t in spec.tiles):
        return False
    inside = sum(math.prod(max(0, min(o + n, s) - max(o, 0)) for o, n, s in zip(t.origin, t.shape, spec.shape))
                 for t in spec.tiles)
    return inside >= math.prod(spec.shape)  # tiles of a grid never overlap


def _typed(raw: Any, dt: np.dtype, tile: Tile, device: Device) -> Any:
    if dt.itemsize > 1 and not dt.isnative:
        from gpulazy.io._read import _byteswap

        raw = _byteswap(raw, dt, device)
    arr = raw.view(dt.newbyteorder("="))
    if tile.order == "F":
        return arr.reshape(tile.shape[::-1]).transpose()
    return arr.reshape(tile.shape)


def _place(out: Any, arr: Any, tile: Tile) -> None:
    dst, src = [], []
    for o, n, s in zip(tile.origin, tile.shape, out.shape):
        a, b = max(o, 0), min(o + n, s)
        if b <= a:
            return
        dst.append(slice(a, b))
        src.append(slice(a - o, b - o))
    out[tuple(dst)] = arr[tuple(src)]


def decoded_on(codec: Sequence[Any] | None, device: Device) -> str:
    """``"gpu"``, ``"host"`` or ``"none"``: where a pipeline decodes for ``device``."""
    if not codec:
        return "none"
    if not device.is_gpu:
        return "host"
    from gpulazy.codecs.gpu import runs_on_gpu

    return "gpu" if all(runs_on_gpu(c) for c in codec) else "host"
