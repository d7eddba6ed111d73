"""Chunks of several arrays read in one pass for a function of them (``a - b``, ``np.maximum(a, b)``,
``a + b + c``).

A streamed map's chunks (``gpulazy.read.mapped``, ``gpulazy.read.reduce``) are keyed by block; a block
of an operation between arrays of files with the same chunks is a tuple of chunks, one of each array
(of each array's files: ``(a - b) * c`` is ``(a's, b's, c's)``). All are read by the same engine pass
(the pass reads them in block order, each block's chunks in turn), and the block is handed on once its
last chunk has landed, as the tuple of them: device memory holds the chunks of the blocks in flight,
not a second pass's worth of ``b``.
"""

from __future__ import annotations

from typing import Any

from gpulazy.spec import ChunkSpec

__all__ = ["Pairs", "members"]


def members(unit: Any) -> tuple[ChunkSpec, ...]:
    """The chunks a block is read from: one, or a tuple's, each once (``(a - b) / (a + b)``: ``a``'s chunk
    is in the block twice, read once)."""
    if not isinstance(unit, tuple):
        return (unit,)
    return tuple({id(spec): spec for spec in unit}.values())


class Pairs:
    """Puts blocks together from chunks as they land: ``add(spec, arr)`` gives ``(spec, block)`` once a
    block is whole (``block`` the chunk itself, or the tuple of its chunks' arrays in the block's order,
    a chunk in each of its places; ``spec`` the block's first chunk), else ``None``. In the thread that
    hands the chunks out (one at a time). A block's chunks are told apart by identity: one object in two
    places of a block is one chunk (read once), two objects of one key are two."""

    def __init__(self, units: Any):
        # id of a chunk -> (its block's first chunk, a place of it in the block, the block's size), each place
        self.places: dict[int, list[tuple[ChunkSpec, int, int]]] = {}
        self.waiting: dict[int, list] = {}  # id of a block's first chunk -> its arrays so far
        for unit in units:
            if isinstance(unit, tuple):
                for place, spec in enumerate(unit):
                    self.places.setdefault(id(spec), []).append((unit[0], place, len(unit)))

    def add(self, spec: ChunkSpec, arr: Any) -> tuple[ChunkSpec, Any] | None:
        found = self.places.get(id(spec))
        if found is None:
            return spec, arr
        first, _, size = found[0]
        got = self.waiting.setdefault(id(first), [_MISSING] * size)
        for _, place, _ in found:
            got[place] = arr
        if any(a is _MISSING for a in got):
            return None
        del self.waiting[id(first)]
        return first, tuple(got)

    def check_done(self) -> None:
        """Raise if a block is still waiting for a chunk (every chunk read was to be handed in)."""
        if self.waiting:
            raise RuntimeError(f"{len(self.waiting)} blocks of several arrays' chunks missed one of them")


_MISSING = object()
