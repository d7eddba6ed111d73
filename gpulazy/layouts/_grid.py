"""A stored-chunk grid: dask chunks that are unions of whole stored chunks, and their specs.

Chunked formats (Zarr, HDF5, tiled TIFF) store an array as a regular grid of pieces,
each read and decoded as a whole. A dask chunk that cut a stored chunk would read and
decode it twice, so every dask chunk here is a box of whole stored chunks (clipped at
the array's edge). ``grid_specs`` turns such a chunking into ``ChunkSpec``s whose
``tiles`` are the stored chunks; where the stored bytes need no decoding and already
are the block's elements in order, the spec is a plain list of ranges instead (read
straight into place, no assembly).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Callable, Sequence

import numpy as np

from gpulazy import config
from gpulazy.layouts._chunk_notice import warn_if_enlarged
from gpulazy.layouts._common import coalesce, normalize_chunks, slab_sizes
from gpulazy.layouts._limits import check_stored_chunks
from gpulazy.spec import ByteRange, ChunkSpec, Codec, FileIdentity, Tile

__all__ = ["grid_chunks", "grid_specs"]


def grid_chunks(shape: Sequence[int], stored: Sequence[int], dtype: np.dtype, chunks: Any = None
                ) -> tuple[tuple[int, ...], ...]:
    """Dask chunks over ``shape`` whose blocks are whole stored chunks of shape ``stored``.

    ``chunks=None``/``"auto"``: about ``config chunk_size`` bytes per block, growing
    along the leading axes. Any dask spelling is accepted and each block boundary is
    moved up to the next stored-chunk boundary (a ``ChunksEnlargedWarning`` says so when
    that changes blocks given in elements).

    >>> grid_chunks((10, 10), (4, 4), np.dtype("u1"), chunks=(5, 10))
    ((8, 2), (10,))
    """
    shape, stored = tuple(shape), tuple(max(1, s) for s in stored)
    grid = tuple(-(-n // s) for n, s in zip(shape, stored))
    asked = chunks
    if chunks is None or (isinstance(chunks, str) and chunks == "auto"):
        unit = math.prod(stored) * dtype.itemsize
        counts = slab_sizes(grid, unit, int(config.get("chunk_size"))) if all(grid) else grid
        chunks = tuple(min(n, c * s) if n else 0 for n, c, s in zip(shape, counts, stored))
    norm = normalize_chunks(chunks, shape, dtype)
    out = tuple(_snap(axis, n, s) for axis, n, s in zip(norm, shape, stored))
    warn_if_enlarged(asked, norm, out, stored)  # say so when a requested block size was not kept
    return out


def _snap(axis: Sequence[int], n: int, s: int) -> tuple[int, ...]:
    if n == 0:
        return (0,)
    edges = sorted({min(n, -(-e // s) * s) for e in itertools.accumulate(axis)} | {n})
    return tuple(b - a for a, b in zip([0, *edges[:-1]], edges) if b > a)


def grid_specs(shape: Sequence[int], stored: Sequence[int], chunks: tuple[tuple[int, ...], ...], *,
               dtype: np.dtype, tile_at: Callable[[tuple[int, ...]], ByteRange | None],
               codec: tuple[Codec, ...] | None = None, fill_value: Any = 0, order: str = "C",
               tile_shape: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None,
               identity: Callable[[str], FileIdentity] | None = None,
               absent: Callable[[tuple[int, ...]], FileIdentity | None] | None = None,
               ) -> dict[tuple[int, ...], ChunkSpec]:
    """One ``ChunkSpec`` per block of ``chunks`` (from ``grid_chunks``).

    Parameters
    ----------
    shape, stored
        The array's shape and the stored chunk shape.
    dtype
        The dtype in the file, byte order included.
    tile_at
        Stored-chunk grid index -> its stored bytes, or ``None`` if it was never written.
    codec
        Decoding steps shared by every stored chunk (``None``: raw bytes).
    fill_value
        Value of elements in missing stored chunks.
    order
        Element order inside a stored chunk.
    tile_shape
        Grid index -> shape its bytes decode to (default ``stored``; a TIFF's last strip
        is shorter).
    identity
        Path -> its ``FileIdentity``, for the chunk keys and the checks on reading
        (default: ``FileIdentity.of``, once per file).
    absent
        Grid index of a piece never written -> the identity of the file that says so: the
        ``FileIdentity.absent`` of a Zarr chunk file never written (if it appears later, the
        chunk is stale), or the identity of the file whose index or byte counts say so (a
        shard, an HDF5 file, a TIFF page's file), so that a block of such pieces alone, which
        reads no byte, still depends on it; ``None`` when nothing does.
    """
    shape, stored = tuple(shape), tuple(max(1, s) for s in stored)
    check_stored_chunks(shape, stored, dtype)  # before a Tile (and a stat) is made per stored chunk
    ident = identity or functools.cache(FileIdentity.of)  # one stat per file, not per tile
    dt = np.dtype(dtype).str
    edges = [list(itertools.accumulate(c, initial=0)) for c in chunks]
    specs: dict[tuple[int, ...], ChunkSpec] = {}
    for idx in itertools.product(*(range(len(c)) for c in chunks)):
        start = tuple(edges[a][i] for a, i in enumerate(idx))
        stop = tuple(edges[a][i + 1] for a, i in enumerate(idx))
        bshape = tuple(b - a for a, b in zip(start, stop))
        tiles, gone = [], []
        for sidx in itertools.product(*(range(a // s, -(-b // s)) for a, b, s in zip(start, stop, stored))):
            tshape = tile_shape(sidx) if tile_shape is not None else stored
            origin = tuple(i * s - a for i, s, a in zip(sidx, stored, start))
            r = tile_at(sidx)
            if r is None and absent is not None:
                gone.append(absent(sidx))
            tiles.append(Tile(r, tuple(tshape), origin, order))
        specs[idx] = _spec(tuple(tiles), bshape, dt, codec, fill_value, idx, ident,
                           tuple(dict.fromkeys(g for g in gone if g is not None)))  # a shard: many pieces
    return specs


def _spec(tiles: tuple[Tile, ...], bshape: tuple[int, ...], dt: str, codec: Any, fill_value: Any,
          idx: tuple[int, ...], ident: Callable, also: tuple[FileIdentity, ...]) -> ChunkSpec:
    if not tiles:  # an empty block (a zero-length axis): nothing to read
        return ChunkSpec((), bshape, dt, "C", None, (), idx)
    present = [t.range for t in tiles if t.range is not None]
    paths = tuple(dict.fromkeys(r.path for r in present))
    identity = tuple(dict.fromkeys(tuple(ident(p) for p in paths) + also))  # (a file's pieces and its holes)
    if codec is None and _in_order(tiles, bshape):
        # The stored bytes, concatenated, are the block's elements: a plain read, no assembly.
        runs = coalesce((r.offset, r.nbytes) for r in present) if len(paths) == 1 else None
        ranges = (tuple(ByteRange(present[0].path, o, n) for o, n in runs) if runs is not None
                  else tuple(present))
        return ChunkSpec(ranges, bshape, dt, tiles[0].order, None, identity, idx)
    # The pieces in file order, so that pieces stored one after another read as one range: zarr-python
    # writes a shard's chunks in Morton order, and in grid order the 32 pieces of a chunk of a sharded
    # 4 GiB store were 32 reads (1024 in all, each about 0.2 ms of the submitting thread on an H100).
    tiles = tuple(sorted(tiles, key=_file_position))
    present = [t.range for t in tiles if t.range is not None]
    return ChunkSpec(tuple(present), bshape, dt, "C", codec, identity, idx, tiles, fill_value)


def _file_position(tile: Tile) -> tuple:
    """Where a piece's bytes are (pieces never written last)."""
    r = tile.range
    return (0, r.path, r.offset) if r is not None else (1, "", 0)


def _in_order(tiles: Sequence[Tile], bshape: tuple[int, ...]) -> bool:
    """Whether raw tiles, concatenated, are exactly the block's elements in one order."""
    if any(t.range is None or any(o != 0 for o in t.origin[1:]) for t in tiles):
        return False
    if len(tiles) == 1:
        t = tiles[0]
        return t.shape == bshape and t.origin == (0,) * len(bshape)
    # Several: C order, each spanning the whole block beyond axis 0, stacked along it.
    at = 0
    for t in tiles:
        if t.order != "C" or t.shape[1:] != bshape[1:] or t.origin[0] != at:
            return False
        at += t.shape[0]
    return at == bshape[0]

