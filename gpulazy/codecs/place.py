"""Decoded tiles placed in their chunks: on a GPU, every tile of a batch in one kernel launch.

A tile's values go to a box of its chunk (clipped where the tile overhangs the chunk's
edge). On the host each box is one NumPy assignment. On a GPU a CuPy assignment per tile
costs a launch and about 40 µs of Python: the 2,048 tiles of a 4 GiB LZ4 Zarr took 80 ms
that way, a third of what decoding them took. ``place`` copies every box of a batch in one
launch: the boxes are cut into rows along an axis contiguous in both the tile and the chunk,
and a row into ``runs`` units of at most ``RUN`` words (up to 16 bytes each); a thread copies a
unit's words, ``runs`` apart, so neighbouring threads touch neighbouring words. With a thread a
word, finding each word's box and row took most of the kernel's time: on an H200 it placed the
(64, 256, 256) uint16 tiles of an uncompressed Zarr at about a third of the memory's rate.

``plan`` builds the launch's table from plain integers (addresses, strides in bytes), with
NumPy over every tile of one layout at once, so the table is tested on the host; the kernel
only walks it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from gpulazy.codecs.pieces import Pieces

__all__ = ["COLS", "MAXD", "RUN", "Layout", "assign", "overlap", "place", "place_decoded", "plan", "runs"]

#: Most axes besides the row axis a box may have (more fall back to one assignment each).
MAXD = 8
#: int64 columns of a table row: unit start, source, destination, words per row, axes, then
#: MAXD extents, MAXD source strides and MAXD destination strides (bytes), innermost first.
COLS = 5 + 3 * MAXD
#: Most words a thread copies of a row: a row of ``words`` is ``runs(words)`` units.
RUN = 8
_WORDS = {16: "uint4", 8: "unsigned long long", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}


class Layout(NamedTuple):
    """Tiles of one shape and strides placed into chunks of one shape and strides (strides in
    bytes, elements of ``itemsize`` bytes): what every tile of a batch of one codec and chunking
    shares, so the boxes of all of them are worked out at once."""

    chunk_shape: tuple[int, ...]
    chunk_strides: tuple[int, ...]
    tile_shape: tuple[int, ...]
    tile_strides: tuple[int, ...]
    itemsize: int


def overlap(origin: Sequence[int], tile_shape: Sequence[int], chunk_shape: Sequence[int]
            ) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """``(slices of the chunk, slices of the tile)`` where a tile at ``origin`` meets its chunk, or
    None when no element of it falls inside."""
    dst, src = [], []
    for o, n, s in zip(origin, tile_shape, chunk_shape):
        a, b = max(o, 0), min(o + n, s)
        if b <= a:
            return None
        dst.append(slice(a, b))
        src.append(slice(a - o, b - o))
    return tuple(dst), tuple(src)


def _row_axis(lay: Layout) -> int | None:
    """The axis rows run along: contiguous in both the tile and the chunk (the last such), or None."""
    for ax in range(len(lay.tile_shape) - 1, -1, -1):
        if lay.tile_strides[ax] == lay.itemsize and lay.chunk_strides[ax] == lay.itemsize:
            return ax
    return None


def runs(words: Any) -> Any:
    """Units a row of ``words`` words is copied in (a thread each): at most ``RUN`` words each."""
    return (words + RUN - 1) // RUN


def plan(batches: Sequence[tuple[Layout, Any, Any, Any]]) -> tuple[np.ndarray, int, int, list[tuple[int, int]]]:
    """``(table, word bytes, total units, tiles left over)`` for one launch placing every tile of
    ``batches``: each ``(layout, chunk addresses, tile addresses, origins)``, one entry per tile
    (``origins``: its place in its chunk, one row per tile). A tile wholly outside its chunk is
    in neither the table nor the leftovers; a leftover is ``(batch, tile)``: no axis is
    contiguous on both sides, or more than ``MAXD`` others (the caller assigns it).

    Worked out with NumPy over each batch's tiles at once: a box a tile, in Python, cost the
    2,048 tiles of a 4 GiB LZ4 Zarr about 25 ms of the thread that decodes (H100 host).
    """
    parts, rest = [], []
    g = 0
    for b, (lay, chunk_ptrs, tile_ptrs, origins) in enumerate(batches):
        nd = len(lay.chunk_shape)
        m = len(chunk_ptrs)
        org = np.asarray(origins, dtype=np.int64).reshape(m, nd)
        lo = np.maximum(org, 0)
        hi = np.minimum(org + np.asarray(lay.tile_shape, np.int64), np.asarray(lay.chunk_shape, np.int64))
        idx = np.flatnonzero(np.all(hi > lo, axis=1))
        lo, ext = lo[idx], (hi - lo)[idx]
        src = np.asarray(tile_ptrs, np.int64)[idx] + (lo - org[idx]) @ np.asarray(lay.tile_strides, np.int64)
        dst = np.asarray(chunk_ptrs, np.int64)[idx] + lo @ np.asarray(lay.chunk_strides, np.int64)
        ax = _row_axis(lay)
        fits = np.ones(len(idx), bool) if nd - 1 <= MAXD else np.zeros(len(idx), bool)
        if ax is None:  # a box of one element copies along any axis
            ax = nd - 1
            fits &= np.all(ext == 1, axis=1) if nd else False
        rest.extend((b, int(k)) for k in idx[~fits])
        if not fits.any():
            continue
        src, dst, ext = src[fits], dst[fits], ext[fits]
        outer = [k for k in range(nd - 1, -1, -1) if k != ax]  # innermost first
        g = np.gcd.reduce(np.concatenate([[g], src, dst, ext[:, ax] * lay.itemsize]))
        for k in outer:
            if (ext[:, k] > 1).any():
                g = np.gcd.reduce([g, lay.tile_strides[k], lay.chunk_strides[k]])
        parts.append((lay, src, dst, ext, ax, outer))
    word = max(w for w in _WORDS if int(g) % w == 0) if g else 16
    table = np.zeros((sum(len(p[1]) for p in parts), COLS), dtype=np.int64)
    row = 0
    for lay, src, dst, ext, ax, outer in parts:
        t = table[row:row + len(src)]
        row += len(src)
        t[:, 1], t[:, 2], t[:, 3], t[:, 4] = src, dst, ext[:, ax] * lay.itemsize // word, len(outer)
        t[:, 5:5 + len(outer)] = ext[:, outer]
        t[:, 5 + MAXD:5 + MAXD + len(outer)] = [lay.tile_strides[k] for k in outer]
        t[:, 5 + 2 * MAXD:5 + 2 * MAXD + len(outer)] = [lay.chunk_strides[k] for k in outer]
    units = runs(table[:, 3]) * np.prod(table[:, 5:5 + MAXD] + (table[:, 5:5 + MAXD] == 0), axis=1)
    table[:, 0] = np.cumsum(units) - units
    return table, word, int(units.sum()), rest


def _source(word: int) -> str:
    return rf"""
typedef {_WORDS[word]} W;
extern "C" __global__ void gl_place_{word}(const long long* tab, int count, long long total) {{
    const int C = {COLS}, D = {MAXD};  // a unit: every runs-th word of a row from its r-th
    for (long long u = blockIdx.x * (long long)blockDim.x + threadIdx.x; u < total;
         u += (long long)gridDim.x * blockDim.x) {{
        int lo = 0, hi = count - 1;  // the last box whose first word is at or before u
        while (lo < hi) {{
            int mid = (lo + hi + 1) >> 1;
            if (tab[(long long)mid * C] <= u) lo = mid; else hi = mid - 1;
        }}
        const long long* t = tab + (long long)lo * C;
        long long local = u - t[0], words = t[3];
        long long runs = (words + {RUN} - 1) / {RUN};
        long long row = local / runs, r = local - row * runs;
        long long so = 0, dof = 0;
        for (int d = 0; d < (int)t[4]; ++d) {{
            long long n = t[5 + d], i = row % n;
            row /= n;
            so += i * t[5 + D + d];
            dof += i * t[5 + 2 * D + d];
        }}
        const W* __restrict__ src = (const W*)(t[1] + so);
        W* __restrict__ dst = (W*)(t[2] + dof);
        #pragma unroll
        for (int k = 0; k < {RUN}; ++k) {{  // (restrict, unrolled: the loads go out together)
            long long w = r + k * runs;
            if (w < words) dst[w] = src[w];
        }}
    }}
}}
"""


def place(pairs: Sequence[tuple[Any, Any, Sequence[int]]]) -> None:
    """Copy each ``(chunk, tile, origin)``: the CuPy ``tile`` (its values, the chunk's dtype) into
    the CuPy ``chunk`` at ``origin`` (clipped to the chunk), in one launch on the current stream."""
    _place([(chunk, tile.data.ptr, tile.shape, tile.strides, origin) for chunk, tile, origin in pairs],
           lambda i: pairs[i])


def place_decoded(chunks: Sequence[Any], pieces: Pieces, shapes: Sequence[tuple[int, ...]], orders: Sequence[str],
                  origins: Sequence[Sequence[int]]) -> None:
    """Copy each decoded piece into its chunk, in one launch on the current stream: ``pieces[j]``
    (``gpulazy.codecs.pieces``: contiguous bytes) holds a tile of ``shapes[j]`` in ``orders[j]``
    (``"C"``/``"F"``) of the chunk's dtype, placed in the CuPy ``chunks[j]`` at ``origins[j]``.
    Only the pieces' addresses are read: an array a tile (a view and a reshape) cost the 2,048
    tiles of a 4 GiB LZ4 Zarr several milliseconds of the thread that decodes (H100 host)."""
    strides: dict[tuple, tuple[int, ...]] = {}
    entries = []
    for chunk, ptr, shape, order, origin in zip(chunks, pieces.ptrs.tolist(), shapes, orders, origins):
        key = (shape, order, chunk.itemsize)
        st = strides.get(key)
        if st is None:
            st = strides[key] = _contiguous_strides(shape, order, chunk.itemsize)
        entries.append((chunk, ptr, shape, st, origin))

    def pair(j: int) -> tuple[Any, Any, Sequence[int]]:
        chunk, shape = chunks[j], shapes[j]
        typed = pieces[j].view(chunk.dtype)
        return chunk, typed.reshape(shape[::-1]).T if orders[j] == "F" else typed.reshape(shape), origins[j]

    _place(entries, pair)


def _contiguous_strides(shape: tuple[int, ...], order: str, itemsize: int) -> tuple[int, ...]:
    """Byte strides of a contiguous array of ``shape`` in ``order``."""
    out, step = [0] * len(shape), itemsize
    for ax in (range(len(shape)) if order == "F" else range(len(shape) - 1, -1, -1)):
        out[ax] = step
        step *= shape[ax]
    return tuple(out)


def _place(entries: list[tuple[Any, int, tuple[int, ...], tuple[int, ...], Sequence[int]]], pair: Any) -> None:
    """One launch for ``entries`` (chunk, tile address, tile shape, tile byte strides, origin);
    ``pair(i)`` gives entry ``i`` as arrays for the tiles the launch leaves over (``assign``)."""
    import cupy

    from gpulazy.codecs.filters import kernel

    chunks: dict[int, tuple] = {}  # the chunks of a batch are few; their tiles many
    batches: dict[tuple, tuple[list, list, list, list]] = {}
    for i, (chunk, tile_ptr, tile_shape, tile_strides, origin) in enumerate(entries):
        c = chunks.get(id(chunk))
        if c is None:
            c = chunks[id(chunk)] = (chunk.shape, chunk.strides, chunk.itemsize, chunk.data.ptr)
        b = batches.setdefault((c[0], c[1], tile_shape, tile_strides, c[2]), ([], [], [], []))
        b[0].append(c[3])
        b[1].append(tile_ptr)
        b[2].append(origin)
        b[3].append(i)
    keys = list(batches)
    table, word, total, rest = plan([(Layout(*key), *batches[key][:3]) for key in keys])
    if total:
        k = kernel(f"place_{word}", _source(word))
        threads = 256
        k((max(1, min(-(-total // threads), 1 << 16)),), (threads,),
          (cupy.asarray(table), np.int32(len(table)), np.int64(total)))
    for b, t in rest:
        assign(*pair(batches[keys[b]][3][t]))


def assign(chunk: Any, tile: Any, origin: Sequence[int]) -> None:
    """One tile into its chunk by array assignment (the host's way, and the GPU's for odd layouts)."""
    cut = overlap(origin, tile.shape, chunk.shape)
    if cut is not None:
        chunk[cut[0]] = tile[cut[1]]
