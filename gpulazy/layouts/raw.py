"""Raw binary files: elements of a known dtype and shape, after an optional header.

One file is the whole array (``shape`` is its shape); several files each hold one
array of ``shape`` and stack along a new axis 0. Every file's size must be exactly
``offset + prod(shape) * itemsize``, checked when indexing (not at compute). Without a
``dtype``, the first file's sidecar ``<file>.json`` says how to read the files
(``gpulazy/layouts/_sidecar.py``); options given explicitly win over it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

from gpulazy.errors import LayoutError
from gpulazy.layouts._base import Index, Layout
from gpulazy.layouts._common import FileEntry, FileStack, check_dtype, check_order, check_shape, stacks
from gpulazy.layouts._sidecar import read_sidecar, sidecar_path, write_sidecar
from gpulazy.spec import identity_from_stat

__all__ = ["RawLayout", "read_sidecar", "write_sidecar"]


class RawLayout(Layout):
    """Headerless (or fixed-header) binary files; needs ``dtype`` and usually ``shape``.

    Options of ``index``: ``dtype`` (required; byte order honoured, ``">u2"``),
    ``shape`` (of one file; default 1-D from the file size), ``offset`` (header bytes
    to skip, default 0), ``order`` (``"C"`` or ``"F"``), ``chunks`` (dask-style),
    ``stack`` (see ``Layout.index``). Without ``dtype`` they come from the sidecar
    ``<first file>.json``, which also gives the index its ``attrs`` (``axes``, ``scale``...).
    """

    name = "raw"
    extensions = (".raw", ".bin", ".dat")
    guessable = False  # raw bytes have no magic; chosen when a dtype is given

    @classmethod
    def guess_can_open(cls, path: str) -> bool:
        return sidecar_path(path) is not None  # bytes alone say nothing; a sidecar does

    def index(self, paths: Sequence[str], *, dtype: Any = None, shape: Any = None, offset: int = 0,
              order: str | None = None, chunks: Any = None, stack: bool | None = None,
              **unknown: Any) -> Index:
        if unknown:
            raise TypeError(f"the raw layout got unexpected options {sorted(unknown)}")
        attrs: dict = {}
        if dtype is None and paths and sidecar_path(paths[0]) is not None:
            side = read_sidecar(paths[0])
            dtype, attrs = side.dtype, side.attrs
            shape = side.shape if shape is None else shape
            offset = offset or side.offset
            order = order or side.order
        order = order or "C"
        if dtype is None and paths:
            raise LayoutError(f"raw file {paths[0]!r}: dtype is required; pass dtype= (and shape=), or write "
                              f"a sidecar {paths[0] + '.json'!r} (see gpulazy.layouts.raw.write_sidecar)")
        dt = check_dtype(dtype)
        order = check_order(order)
        offset = _check_offset(offset)
        if not paths:
            raise LayoutError("the raw layout needs at least one file")
        sizes = [os.stat(p) for p in paths]
        if shape is None:
            file_shape = _shape_from_size(paths[0], sizes[0].st_size, offset, dt.itemsize)
        else:
            file_shape = check_shape(shape)
        expected = offset + math.prod(file_shape) * dt.itemsize
        files = []
        for p, st in zip(paths, sizes):
            if st.st_size != expected:
                raise _size_error(p, st.st_size, expected, file_shape, dt, offset, len(paths))
            files.append(FileEntry(p, offset, identity_from_stat(p, st)))
        fs = FileStack(tuple(files), file_shape, dt, order, stacked=stacks(stack, paths))
        idx = fs.index(chunks, layout=self.name)
        return dataclasses.replace(idx, attrs=_stack_attrs(attrs, idx.stacked)) if attrs else idx


def _stack_attrs(attrs: dict, stacked: bool) -> dict:
    """Sidecar attrs (one file's axes) for the array: a stack gains a leading axis."""
    if not stacked:
        return dict(attrs)
    lead = {"axes": "file", "scale": 1.0, "translation": 0.0, "units": ""}
    return {k: (v if k == "name" else (lead[k], *v)) for k, v in attrs.items()}


def _check_offset(offset: Any) -> int:
    try:
        value = int(offset)
    except (TypeError, ValueError) as e:
        raise LayoutError(f"offset must be a non-negative number of bytes, got {offset!r}") from e
    if value < 0 or value != offset:
        raise LayoutError(f"offset must be a non-negative number of bytes, got {offset!r}")
    return value


def _shape_from_size(path: str, size: int, offset: int, itemsize: int) -> tuple[int, ...]:
    data = size - offset
    if data < 0 or data % itemsize:
        raise LayoutError(
            f"file {path!r} has {size} bytes; after the {offset}-byte offset that is not a whole number "
            f"of {itemsize}-byte elements; pass shape= (and check dtype= and offset=)")
    return (data // itemsize,)


def _looks_like(path: str) -> str | None:
    from gpulazy.layouts import layout_names
    from gpulazy.layouts._sniff import looks_like

    return looks_like(path, [n for n in layout_names() if n != "raw"])


def _size_error(path: str, actual: int, expected: int, shape: tuple[int, ...], dt: Any, offset: int,
                nfiles: int) -> LayoutError:
    what = "each file" if nfiles > 1 else "the file"
    hint = ""
    extra = actual - expected
    looks = _looks_like(path)
    if looks:  # a TIFF read as raw: name the format, not a header size that fits by chance
        hint = f"; {looks}"
    elif extra > 0 and offset == 0:
        hint = f"; if the file starts with a {extra}-byte header, pass offset={extra}"
    return LayoutError(
        f"file {path!r} has {actual} bytes but {expected} were expected "
        f"({what} holds shape {shape} of dtype {dt.str!r} after offset {offset}: "
        f"{offset} + {math.prod(shape)} x {dt.itemsize} bytes){hint}")
