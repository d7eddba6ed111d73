"""Run a codec pipeline over a batch of stored pieces, on the host or the GPU."""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from gpulazy.codecs import host
from gpulazy.codecs._run import _host_one, _pad, _record, host_map, size_error
from gpulazy.codecs.pieces import Pieces
from gpulazy.device import Device
from gpulazy.errors import LayoutError
from gpulazy.spec import ByteRange, Codec

__all__ = ["decode_pieces", "check_supported", "gpu_codecs"]


def gpu_codecs() -> frozenset[str]:
    """Codec ids that decode on the GPU here: nvCOMP's and the CuPy filters' (empty without a GPU)."""
    from gpulazy.codecs import bitshuffle, blosc, filters, nvcomp

    framed = {c.id for c in (Codec("blosc"), Codec("bitshuffle_lz4")) if blosc.handles(c) or bitshuffle.handles(c)}
    return nvcomp.supported() | filters.supported() | framed


def check_supported(codec: Sequence[Codec] | None, path: str) -> None:
    """Raise a ``LayoutError`` naming ``path`` if any step cannot be decoded here at all."""
    for c in codec or ():
        why = host.unsupported_reason(c)
        if why:
            raise LayoutError(f"{path!r} is compressed with {c.id!r}, which cannot be decoded here: {why}")


def decode_pieces(pieces: Sequence[Any], codec: Sequence[Codec], expected: Sequence[int], device: Device, *,
                  where: Sequence[ByteRange | None] = ()) -> Pieces:
    """Each stored piece decoded through ``codec``: ``Pieces`` (a sequence of 1-D uint8 arrays on
    ``device``). ``pieces``: ``Pieces`` or arrays.

    ``expected`` is each piece's decoded size in bytes: every piece must decode to exactly
    that many, on the host and on the GPU alike, or ``ChunkDecodeError`` names its file,
    offset and both sizes (a short piece would otherwise leave bytes unwritten, a long one
    belongs to another layout). A piece that fails to decode raises the same error.
    """
    where = _pad(where, len(pieces))
    if not codec:
        out = Pieces.of(pieces)
    elif device.is_gpu:
        from gpulazy.codecs import gpu

        out = gpu.decode_pieces(pieces, tuple(codec), expected, device, where=where)
    else:
        started = time.perf_counter()
        out = Pieces.of(host_map(lambda j: _host_one(j[0], codec, j[1], j[2]), list(zip(pieces, expected, where))))
        _record(sum(expected), started, codec, "host", device)
    want = np.asarray(expected, dtype=np.int64).reshape(-1)
    for i in np.flatnonzero(out.sizes != want).tolist():
        got = int(out.sizes[i])
        raise size_error(where[i], codec, int(want[i]), got, f"it decoded to {got} bytes")
    return out
