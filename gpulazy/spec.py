"""``ChunkSpec``: an immutable description of one chunk and where its bytes are.

A spec is a value: frozen, slotted, picklable and tokenizable, so dask graph names are
deterministic and tasks travel to ``dask.distributed`` workers. Its ``key`` includes the
identity of every file read (path, size, mtime), so a changed file never hits a stale
cache entry (napari's dask cache is global and keyed by task key).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ByteRange", "ChunkSpec", "file_identity"]


@dataclass(frozen=True, slots=True)
class ByteRange:
    """``nbytes`` bytes of ``path`` starting at ``offset``."""

    path: str
    offset: int
    nbytes: int


def file_identity(path: str) -> tuple[str, int, int]:
    """``(path, size, mtime_ns)``: what makes a file's bytes the same bytes as before."""
    st = os.stat(path)
    return (path, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """One chunk: byte ranges that, concatenated in order, are the chunk's bytes.

    Parameters
    ----------
    ranges
        Byte ranges read one after another into the chunk's buffer.
    shape
        The chunk's shape.
    dtype
        The dtype *in the file*, byte order included (``">u2"``); arrays handed out
        are in native byte order (see ``out_dtype``).
    order
        ``"C"`` or ``"F"``: the order of the elements in the concatenated bytes.
    codec
        Name of a codec the bytes must go through, or ``None`` for raw bytes.
    identity
        ``(path, size, mtime_ns)`` of each file read; part of ``key``.
    index
        The chunk's block index in its array (informational; not part of ``key``).
    """

    ranges: tuple[ByteRange, ...]
    shape: tuple[int, ...]
    dtype: str
    order: str = "C"
    codec: str | None = None
    identity: tuple[tuple[str, int, int], ...] = ()
    index: tuple[int, ...] = ()
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        h = hashlib.blake2b(digest_size=16)
        # Plain tuples: their repr runs in C, ~3x faster than the dataclasses' (100k-chunk graphs).
        ranges = tuple((r.path, r.offset, r.nbytes) for r in self.ranges)
        h.update(repr((ranges, self.shape, self.dtype, self.order, self.codec, self.identity)).encode())
        object.__setattr__(self, "key", h.hexdigest())

    @property
    def nbytes(self) -> int:
        """Bytes read from files (what the backend moves)."""
        return sum(r.nbytes for r in self.ranges)

    @property
    def out_dtype(self) -> np.dtype:
        """The dtype of the array handed out: the file's dtype in native byte order."""
        return np.dtype(self.dtype).newbyteorder("=")

    @property
    def out_nbytes(self) -> int:
        """Bytes of the decoded chunk."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def paths(self) -> tuple[str, ...]:
        """The files this chunk reads, in order, without repeats."""
        return tuple(dict.fromkeys(r.path for r in self.ranges))

    @property
    def needs_byteswap(self) -> bool:
        dt = np.dtype(self.dtype)
        return dt.itemsize > 1 and not dt.isnative

    def __dask_tokenize__(self) -> str:
        return self.key
