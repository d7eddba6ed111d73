"""The layout contract: from files to ``ChunkSpec``s, without reading the data.

A layout answers two questions. ``guess_can_open(path)``: is this file mine? (cheap:
magic bytes at most, never raises for an unreadable file). ``index(paths, **opts)``:
where is every chunk's data? The answer is an ``Index``: the array's full shape, its
native dtype, dask ``chunks`` and one ``ChunkSpec`` per block index.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Sequence

import numpy as np

from gpulazy.spec import ChunkSpec

__all__ = ["Layout", "Index"]


@dataclass(frozen=True)
class Index:
    """What a layout found: the array's geometry and where each chunk's bytes are.

    Parameters
    ----------
    shape
        Full shape of the array.
    dtype
        The array's dtype, native byte order (what chunks come back as).
    chunks
        Dask chunks: one tuple of block lengths per axis.
    specs
        ``{block index: ChunkSpec}`` for every block, in C order of block indices.
    layout
        Name of the layout that built it.
    order
        ``"C"`` or ``"F"``: element order of the chunks' bytes.
    stacked
        True when several files were stacked along a new axis 0.
    paths
        The files read, in order.
    attrs
        What the format says about the array beyond its geometry: ``axes`` (names such
        as ``("z", "y", "x")``), ``scale`` (physical size per element, per axis),
        ``translation``, ``units``, ``codec`` (the stored codec, a readable string),
        ``stored_chunks`` (the stored chunk shape), ``name``. Keys absent when unknown.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[tuple[int, ...], ...]
    specs: Mapping[tuple[int, ...], ChunkSpec]
    layout: str = ""
    order: str = "C"
    stacked: bool = False
    paths: tuple[str, ...] = ()
    attrs: Mapping[str, object] = field(default_factory=dict, compare=False)
    _token: list = field(default_factory=list, repr=False, compare=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numblocks(self) -> tuple[int, ...]:
        return tuple(len(c) for c in self.chunks)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def token(self) -> str:
        """A stable hash of every chunk's key (which includes file identities)."""
        if not self._token:
            h = hashlib.blake2b(digest_size=16)
            h.update(repr((self.layout, self.shape, self.dtype.str, self.chunks)).encode())
            for spec in self.specs.values():
                h.update(spec.key.encode())
            self._token.append(h.hexdigest())
        return self._token[0]


class Layout(ABC):
    """A file format: recognise its files and index their chunks.

    Subclasses set ``name`` (and optionally ``extensions``) and implement
    ``guess_can_open`` and ``index``. Register third-party layouts in the
    ``gpulazy.layouts`` entry-point group (``name = "pkg.module:Class"``).
    """

    name: ClassVar[str]
    extensions: ClassVar[tuple[str, ...]] = ()
    #: Whether ``guess_can_open`` can recognise files on its own (raw cannot).
    guessable: ClassVar[bool] = True
    #: Whether a directory is one dataset of this format (a Zarr store), not a folder of files.
    opens_directories: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def guess_can_open(cls, path: str) -> bool:
        """True if ``path`` looks like this format; reads at most a few magic bytes."""

    @abstractmethod
    def index(self, paths: Sequence[str], **opts) -> Index:
        """The ``Index`` of ``paths`` (already resolved to regular files, in order).

        A layout that reads one array per file and stacks several files takes a
        ``stack: bool | None = None`` option: ``layouts.index`` passes ``stack=True``
        when the user named a collection (a folder, a glob or a list), so the files
        stack along a new axis 0 even when there is only one, and ``stack=False`` for a
        single path. ``None`` (a direct call) stacks when there are several files.
        ``gpulazy.layouts._common.stacks`` implements that rule.
        """

    def levels(self, paths: Sequence[str], **opts) -> list[Index]:
        """Every resolution level, full resolution first; formats with pyramids override it."""
        return [self.index(paths, **opts)]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
