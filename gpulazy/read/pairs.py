"""Chunks of two arrays read in one pass for a function of both (``a - b``, ``np.maximum(a, b)``).

A streamed map's chunks (``gpulazy.read.mapped``, ``gpulazy.read.reduce``) are keyed by block; a block
of an operation between two arrays of files with the same chunks is a pair of chunks, one of each.
Both are read by the same engine pass (the pass reads them in block order, ``a``'s chunk then
``b``'s), and the block is handed on once its second chunk has landed, as the pair ``(a's, b's)``:
device memory holds the chunks of the blocks in flight, not a second pass's worth of ``b``.
"""

from __future__ import annotations

from typing import Any

from gpulazy.spec import ChunkSpec

__all__ = ["Pairs", "members"]


def members(unit: Any) -> tuple[ChunkSpec, ...]:
    """The chunks a block is read from: one, or a pair's two."""
    return unit if isinstance(unit, tuple) else (unit,)


class Pairs:
    """Pairs up chunks as they land: ``add(spec, arr)`` gives ``(spec, block)`` once a block is whole
    (``block`` the chunk itself, or ``(a's, b's)`` for a pair; ``spec`` the block's first chunk), else
    ``None``. In the thread that hands the chunks out (one at a time)."""

    def __init__(self, units: Any):
        self.places: dict[int, tuple[ChunkSpec, int]] = {}  # id of a pair's chunk -> (the pair's first, place)
        self.waiting: dict[int, list] = {}  # id of a pair's first chunk -> the pair's arrays so far
        for unit in units:
            if isinstance(unit, tuple):
                for place, spec in enumerate(unit):
                    self.places[id(spec)] = (unit[0], place)

    def add(self, spec: ChunkSpec, arr: Any) -> tuple[ChunkSpec, Any] | None:
        found = self.places.get(id(spec))
        if found is None:
            return spec, arr
        first, place = found
        got = self.waiting.setdefault(id(first), [None, None])
        got[place] = arr
        if got[0] is None or got[1] is None:
            return None
        del self.waiting[id(first)]
        return first, (got[0], got[1])

    def check_done(self) -> None:
        """Raise if a pair is still waiting for a chunk (every chunk read was to be handed in)."""
        if self.waiting:
            raise RuntimeError(f"{len(self.waiting)} blocks of two arrays' chunks missed one of them")
