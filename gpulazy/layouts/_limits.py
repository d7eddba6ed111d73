"""How many pieces one array may be indexed into, checked before any per-piece object is made.

An index holds Python objects per piece: a ``ChunkSpec`` and a dask task per dask chunk,
a ``Tile`` (and a ``stat``) per stored chunk, a ``ByteRange`` per run of bytes. A Zarr v2
store of shape ``(4_000_000,)`` in chunks of ``(1,)`` took 45 s and 1.8 GiB to open that
way; raw bytes in chunks of 1 ended in a bare ``MemoryError`` inside dask. So every
layout counts its pieces from shapes alone first (``check_pieces``) and refuses, with a
``LayoutError`` that names the count, the chunking and one that works, any array of
more than config ``max_chunks`` pieces. ``layouts.index`` adds the path when the check
ran where it is not known (``TooManyChunksError.at``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from gpulazy import config
from gpulazy.errors import TooManyChunksError

__all__ = ["TooManyChunksError", "check_pieces", "check_stored_chunks", "suggest_chunks", "spelled_block_count",
           "max_chunks", "runs_per_block"]


def max_chunks() -> int:
    """Config ``max_chunks``: the most pieces one array is indexed into."""
    return int(config.get("max_chunks"))


def check_pieces(count: int, *, what: str, shape: Sequence[int], dtype: np.dtype, pieces: Sequence[int] | str,
                 fix: Callable[[], str], where: str | None = None) -> None:
    """Raise ``TooManyChunksError`` when ``count`` pieces exceed config ``max_chunks``.

    ``what`` names the pieces (``"stored chunks"``); ``pieces`` their shape or a
    description; ``fix()`` says what to do (called only to raise; see ``suggest_chunks``).
    """
    limit = max_chunks()
    if count <= limit:
        return
    shape = tuple(int(n) for n in shape)
    fix_text = fix()
    raise TooManyChunksError(
        f"an array of shape {shape} and dtype {np.dtype(dtype).str!r} in {what} of {_shape_text(pieces)} makes "
        f"{count:,} {what}; gpulazy indexes at most {limit:,} (config max_chunks: it holds Python objects "
        f"per piece, ~11 us and ~450 bytes each to open); {fix_text}, or raise the limit with "
        f"gpulazy.config.set(max_chunks={count})", where)


def check_stored_chunks(shape: Sequence[int], stored: Sequence[int], dtype: np.dtype) -> None:
    """``check_pieces`` for a grid of stored chunks: only rewriting the data in larger ones helps."""
    count = math.prod(-(-int(n) // max(1, int(s))) for n, s in zip(shape, stored))
    check_pieces(count, what="stored chunks", shape=shape, dtype=dtype, pieces=stored,
                 fix=lambda: "no chunks= changes how the data is stored: rewrite it in larger stored chunks, e.g. "
                             f"{suggest_chunks(shape, dtype, smallest=4 << 20)}")


def _shape_text(pieces: Sequence[int] | str) -> str:
    return pieces if isinstance(pieces, str) else str(tuple(int(p) for p in pieces))


def suggest_chunks(shape: Sequence[int], dtype: np.dtype, *, order: str = "C", stacked: bool = False,
                   smallest: int | None = None) -> tuple:
    """The shape of contiguous slabs (``default_chunks``) few enough for the limit, to pass as ``chunks=``.

    Slabs of at least ``smallest`` bytes (default config ``chunk_size``), doubled until
    their count is within config ``max_chunks``.
    """
    from gpulazy.layouts._slabs import default_chunks

    shape = tuple(shape)
    itemsize = np.dtype(dtype).itemsize
    limit = max_chunks()
    target = max(smallest or int(config.get("chunk_size")), -(-math.prod(shape) * itemsize // limit))
    while True:
        chunks = default_chunks(shape, itemsize, order=order, stacked=stacked, target=target)
        if math.prod(len(c) for c in chunks) <= limit or target >= math.prod(shape) * itemsize:
            return tuple(c[0] for c in chunks)
        target *= 2


def spelled_block_count(chunks: Any, shape: Sequence[int]) -> int:
    """The fewest dask blocks a chunk spelling can give, from the spelling alone (no lists made).

    Per axis: an int ``c`` gives ``ceil(n / c)`` blocks, block lengths give their number,
    ``-1``/``None``/``"auto"``/a byte size count as one (the fewest they may give).
    """
    shape = tuple(shape)
    if isinstance(chunks, dict):
        per = [chunks.get(a, chunks.get(a - len(shape))) for a in range(len(shape))]
    elif isinstance(chunks, (int, np.integer)) and not isinstance(chunks, bool):
        per = [chunks] * len(shape)
    elif isinstance(chunks, (tuple, list)) and len(chunks) == len(shape):
        per = list(chunks)
    else:
        return 1  # None, "auto", a byte size, or a spelling the chunk checks refuse
    count = 1
    for c, n in zip(per, shape):
        if isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c > 0:
            count *= max(1, -(-int(n) // int(c)))
        elif isinstance(c, (tuple, list)):
            count *= max(1, len(c))
    return count


def runs_per_block(shape: Sequence[int], block: Sequence[int]) -> int:
    """Byte runs of one C-order block of ``shape`` (what ``c_ranges`` gives, counted, not listed).

    The axes after the last one the block cuts are whole; one run per index of the
    axes before it.
    """
    k = len(shape) - 1
    while k > 0 and block[k] == shape[k]:
        k -= 1
    return math.prod(int(b) for b in block[:k]) if k > 0 else 1
