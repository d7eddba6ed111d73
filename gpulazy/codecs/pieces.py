"""A batch of stored or decoded pieces as one table: where each piece's bytes are, not an array each.

A decode batch holds thousands of pieces (the 2,048 chunk files of a 4 GiB LZ4 Zarr go to one
nvCOMP call). An array per piece costs Python on the thread that decodes: a CuPy slice is a few
microseconds, and a piece was sliced three times on its way from the read buffer through nvCOMP
to its chunk, its address and size read back from each slice. With thousands of pieces a batch
and the reads' own Python on other threads, that time holds the GIL the whole read waits on.

``Pieces`` holds the arrays that own the memory (``owners``, 1-D uint8, on the host or a GPU)
and, per piece, NumPy columns: which owner, where in it the piece starts, how many bytes. The
pieces' addresses come from the owners' at once (``ptrs``); an array of one piece is made only
where a step asks for it (``pieces[i]``: the host decoders), as before.

>>> import numpy as np
>>> p = Pieces.of([np.arange(4, dtype=np.uint8), np.arange(3, dtype=np.uint8)])
>>> len(p), p.sizes.tolist(), p[1].tolist()
(2, [4, 3], [0, 1, 2])
>>> q = p.take([1]).replaced([0], [np.full(2, 7, np.uint8)])
>>> [a.tolist() for a in q]
[[7, 7]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Iterator

import numpy as np

__all__ = ["Pieces", "address", "aligned_starts", "flat"]


def address(a: Any) -> int:
    """Where array ``a``'s first byte is (a device address for CuPy, a host one for NumPy)."""
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)
    return int(ptr) if ptr is not None else int(a.__array_interface__["data"][0])


def flat(a: Any) -> Any:
    """Array ``a``'s bytes in C order as a 1-D uint8 array: a view, or a copy where they are not
    contiguous (a piece's address and size alone would not say where its bytes are)."""
    if a.ndim == 1 and a.dtype == np.uint8 and a.flags.c_contiguous:
        return a
    if not a.flags.c_contiguous:
        a = a.copy()
    return a.reshape(-1).view(np.uint8)


def aligned_starts(sizes: Any, align: int) -> tuple[np.ndarray, int]:
    """Where pieces of ``sizes`` bytes start when packed in order into one buffer, each start a
    multiple of ``align`` (int64), and the bytes that buffer spans. An empty piece takes no room:
    it starts where the next one does."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    padded = -(-sizes // align) * align
    ends = np.cumsum(padded)
    return ends - padded, int(ends[-1]) if len(ends) else 0


class Pieces(Sequence):
    """``len(sizes)`` pieces: piece ``i`` is ``owners[owner[i]][starts[i]:starts[i] + sizes[i]]``."""

    __slots__ = ("owners", "owner", "starts", "sizes", "_ptrs")

    def __init__(self, owners: Sequence[Any], owner: Any, starts: Any, sizes: Any):
        self.owners = list(owners)
        self.owner = np.asarray(owner, dtype=np.int64).reshape(-1)
        self.starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        self.sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
        self._ptrs: np.ndarray | None = None

    @classmethod
    def of(cls, arrays: Sequence[Any]) -> Pieces:
        """Each array (any shape and dtype, contiguous) as a piece of its bytes; ``Pieces`` as they are."""
        if isinstance(arrays, Pieces):
            return arrays
        arrays = [flat(a) for a in arrays]
        n = len(arrays)
        return cls(arrays, np.arange(n), np.zeros(n, np.int64), np.fromiter((a.size for a in arrays), np.int64, n))

    @classmethod
    def carved(cls, buffer: Any, starts: Any, sizes: Any) -> Pieces:
        """Pieces of one buffer."""
        starts = np.asarray(starts, dtype=np.int64)
        return cls([buffer], np.zeros(len(starts), np.int64), starts, sizes)

    @property
    def ptrs(self) -> np.ndarray:
        """Every piece's address (uint64), worked out once from its owner's."""
        if self._ptrs is None:
            base = np.fromiter((address(o) for o in self.owners), np.uint64, len(self.owners))
            self._ptrs = base[self.owner] + self.starts.astype(np.uint64) if len(self.owner) \
                else np.zeros(0, np.uint64)
        return self._ptrs

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        at = int(self.starts[i])
        return self.owners[int(self.owner[i])][at:at + int(self.sizes[i])]

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def take(self, idx: Any) -> Pieces:
        """The pieces ``idx`` (indices or a mask), in that order."""
        idx = np.asarray(idx)
        idx = idx if idx.dtype == bool else idx.astype(np.int64, copy=False)
        out = Pieces(self.owners, self.owner[idx], self.starts[idx], self.sizes[idx])
        if self._ptrs is not None:
            out._ptrs = self._ptrs[idx]
        return out

    def within(self, idx: Any, offsets: Any, sizes: Any) -> Pieces:
        """Spans of these pieces: span ``k`` is ``sizes[k]`` bytes from ``offsets[k]`` into piece ``idx[k]``."""
        idx = np.asarray(idx, dtype=np.int64)
        return Pieces(self.owners, self.owner[idx], self.starts[idx] + np.asarray(offsets, dtype=np.int64), sizes)

    def filled(self, parts: Sequence[tuple[Any, Pieces]]) -> Pieces:
        """These pieces with those of ``parts`` (each ``(indices, pieces)``, as ``gather``) in their places."""
        keep = np.ones(len(self), bool)
        for idx, _ in parts:
            keep[np.asarray(idx, dtype=np.int64)] = False
        return Pieces.gather(len(self), [(np.flatnonzero(keep), self.take(keep)), *parts])

    def replaced(self, idx: Sequence[int], arrays: Sequence[Any]) -> Pieces:
        """These pieces with piece ``idx[j]`` replaced by ``arrays[j]`` (each a piece of its own)."""
        if not len(idx):
            return self
        arrays = [flat(a) for a in arrays]
        idx = np.asarray(idx, dtype=np.int64)
        owner, starts, sizes = self.owner.copy(), self.starts.copy(), self.sizes.copy()
        owner[idx] = len(self.owners) + np.arange(len(arrays))
        starts[idx] = 0
        sizes[idx] = [a.size for a in arrays]
        return Pieces(self.owners + arrays, owner, starts, sizes)

    @classmethod
    def gather(cls, n: int, parts: Sequence[tuple[Any, Pieces]]) -> Pieces:
        """``n`` pieces from ``parts``, each ``(indices, pieces)``: ``pieces[j]`` is piece ``indices[j]``.
        Every index below ``n`` must be given once."""
        owners: list[Any] = []
        owner, starts, sizes = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
        for idx, p in parts:
            idx = np.asarray(idx, dtype=np.int64)
            owner[idx] = p.owner + len(owners)
            starts[idx], sizes[idx] = p.starts, p.sizes
            owners.extend(p.owners)
        return cls(owners, owner, starts, sizes)
