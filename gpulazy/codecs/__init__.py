"""Codecs: from a chunk's stored bytes to its values. Knows no file format.

A chunk spec with ``tiles`` (or a ``codec``) is read as one buffer holding each stored
piece's bytes back to back; ``assemble`` decodes every piece through the spec's codec
pipeline, byte-swaps to native order, and places it in the chunk (elements no piece
covers get the spec's ``fill_value``).

Every piece must decode to exactly the bytes its tile needs, on the host and the GPU
alike: a short or long one, or one whose own header declares another size (or, for
blosc, another length than the piece's), raises ``ChunkDecodeError`` naming the file,
offset and both sizes (``gpulazy.codecs._frames`` holds what each codec's framing
declares). Each codec sees exactly its piece's bytes, never the next piece's.

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
from gpulazy.codecs.pieces import Pieces, flat
from gpulazy.device import Device, own_stream
from gpulazy.spec import ChunkSpec, Tile
from gpulazy.stats import record_fills

__all__ = ["assemble", "assemble_batch", "byteswap", "decode_pieces", "check_supported", "gpu_codecs", "decoded_on",
           "stream_bound"]


def assemble(buf: Any, spec: ChunkSpec, device: Device) -> Any:
    """The chunk's array (native byte order, ``spec.shape``) from its stored bytes ``buf``."""
    return assemble_batch([buf], [spec], device)[0]


def assemble_batch(bufs: Sequence[Any], specs: Sequence[ChunkSpec], device: Device,
                   outs: Sequence[Any] | None = None) -> list[Any]:
    """Several chunks from their stored bytes, each pipeline step run once over all their pieces.

    ``outs[i]``, when given (an array of ``specs[i].shape`` and native dtype on ``device``),
    receives chunk ``i`` in place; otherwise it is allocated. Returns the chunks. Batching
    across chunks is what lets nvCOMP see many pieces per call; the pieces go from ``bufs`` to
    the chunks as one table (``gpulazy.codecs.pieces``), not an array each.
    """
    outs = list(outs) if outs is not None else [None] * len(specs)
    groups: dict[tuple, list[tuple[int, Tile, int, int]]] = {}
    for k, spec in enumerate(specs):
        segments = spec.tile_segments() if spec.tiles else [(_whole(spec), 0, spec.nbytes)]
        groups.setdefault(tuple(spec.codec or ()), []).extend((k, t, a, n) for t, a, n in segments)
    owners = [flat(b) for b in bufs]
    itemsizes = [np.dtype(spec.dtype).itemsize for spec in specs]
    # Decoding, filling and placing run on gpulazy's own stream, never the caller's: a chunk
    # assembled on the caller's (legacy) stream was copied into the cache on gpulazy's stream
    # before it was complete (napari showed rows of zeros and other planes' pixels).
    placed: list[tuple[list[tuple[int, Tile, int, int]], Pieces]] = []
    with own_stream(device):
        results = [_prepare(device.alloc(spec.shape, spec.out_dtype) if out is None else out, spec)
                   for spec, out in zip(specs, outs)]
        for codec, members in groups.items():
            m = len(members)
            stored = Pieces(owners, np.fromiter((k for k, _, _, _ in members), np.int64, m),
                            np.fromiter((a for _, _, a, _ in members), np.int64, m),
                            np.fromiter((n for _, _, _, n in members), np.int64, m))
            expected = [math.prod(t.shape) * itemsizes[k] for k, t, _, _ in members]
            # each decoded piece is exactly its tile's bytes (``decode_pieces`` checks)
            placed.append((members, decode_pieces(stored, codec, expected, device,
                                                  where=[t.range for _, t, _, _ in members])))
        for members, pieces in placed:
            _place_all(members, pieces, results, specs, device)
    record_fills(specs)  # pieces never written, handed out as the fill value: gpulazy.stats()["chunks_filled"]
    return results


def _prepare(out: Any, spec: ChunkSpec) -> Any:
    """An output array, pre-filled where no tile will land."""
    if spec.tiles and not _covered(spec):
        out[...] = spec.fill_value
    return out


def _whole(spec: ChunkSpec) -> Tile:
    first = spec.ranges[0] if spec.ranges else None
    return Tile(first, spec.shape, (0,) * len(spec.shape), spec.order)


def _covered(spec: ChunkSpec) -> bool:
    if len(spec.tiles) == 1:  # most chunks (one stored piece each): no arrays to build
        t = spec.tiles[0]
        return t.range is not None and all(o <= 0 and o + n >= s for o, n, s in zip(t.origin, t.shape, spec.shape))
    if any(t.range is None for t in spec.tiles):
        return False
    # NumPy over the tiles at once: a generator a tile cost a 4 GiB LZ4 Zarr's 2,048 tiles a few
    # milliseconds of the thread that decodes, on every read.
    origins = np.array([t.origin for t in spec.tiles], dtype=np.int64).reshape(len(spec.tiles), len(spec.shape))
    shapes = np.array([t.shape for t in spec.tiles], dtype=np.int64).reshape(origins.shape)
    size = np.asarray(spec.shape, dtype=np.int64)
    inside = np.clip(np.minimum(origins + shapes, size) - np.maximum(origins, 0), 0, None).prod(axis=1).sum()
    return int(inside) >= math.prod(spec.shape)  # tiles of a grid never overlap


def _typed(raw: Any, dt: np.dtype, tile: Tile) -> Any:
    arr = raw.view(dt.newbyteorder("="))
    if tile.order == "F":
        return arr.reshape(tile.shape[::-1]).transpose()
    return arr.reshape(tile.shape)


def _place_all(members: list[tuple[int, Tile, int, int]], pieces: Pieces, results: list[Any],
               specs: Sequence[ChunkSpec], device: Device) -> None:
    """Every decoded tile (``members[j]``: its chunk's index and tile; ``pieces[j]``: its bytes, in
    the file's byte order) into its chunk: one kernel launch on a GPU, an assignment each on the host."""
    from gpulazy.codecs import place

    dtypes = [np.dtype(spec.dtype) for spec in specs]
    for j, (k, _, _, _) in enumerate(members):
        dt = dtypes[k]
        if dt.itemsize > 1 and not dt.isnative:
            byteswap(pieces[j], dt, device)  # in place, in the decoded buffer
    if device.is_gpu:
        place.place_decoded([results[k] for k, _, _, _ in members], pieces, [t.shape for _, t, _, _ in members],
                            [t.order for _, t, _, _ in members], [t.origin for _, t, _, _ in members])
    else:
        for j, (k, tile, _, _) in enumerate(members):
            place.assign(results[k], _typed(pieces[j], dtypes[k], tile), tile.origin)


def stream_bound(spec: ChunkSpec) -> bool:
    """Whether a GPU decodes ``spec``'s pieces at one stream's pace each, however many go together
    (Deflate: nvCOMP decodes each stream in one thread block, 6 to 12 MB/s), so a call takes about
    as long for 1,000 pieces as for 10, and many calls side by side are as fast as one large call.
    On an H100, 2 MiB gzip-1 pieces: one call of 256 decoded at 3.0 GB/s, of 2,048 at 12.9; four
    calls of 512 at once 12.6. Readers decode submissions of such chunks several at once when each
    holds too few pieces to keep nvCOMP busy (``gpulazy.read.whole.stream_calls``)."""
    from gpulazy.codecs._split import family

    return spec.codec is not None and any(family(c) == "deflate" for c in spec.codec)


def decoded_on(codec: Sequence[Any] | None, device: Device) -> str:
    """``"gpu"``, ``"host"`` or ``"none"``: where a pipeline decodes for ``device``."""
    if not codec:
        return "none"
    if not device.is_gpu:
        return "host"
    from gpulazy.codecs.gpu import runs_on_gpu

    return "gpu" if all(runs_on_gpu(c) for c in codec) else "host"


def byteswap(raw: Any, dt: np.dtype, device: Device) -> Any:
    # In place: reverse the bytes of every element. Works for NumPy and CuPy alike
    # (CuPy has no ndarray.byteswap); complex types swap each half on its own.
    unit = dt.itemsize // 2 if dt.kind == "c" else dt.itemsize
    with own_stream(device):  # not the legacy stream; done before the chunk is handed out
        lanes = raw.reshape(-1, unit)
        lanes[...] = lanes[:, ::-1].copy()
    return raw
