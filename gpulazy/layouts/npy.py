"""NumPy ``.npy`` files (format versions 1.0, 2.0 and 3.0), one or several stacked.

The header is parsed with ``numpy.lib.format``; the data is read from where the header
ends. C and Fortran order are both read without copies on the host; big-endian
dtypes come back in native byte order. Several files stack along a new axis 0 and
must agree on shape, dtype and order.
"""

from __future__ import annotations

import io
import math
import os
import struct
from typing import Any, Sequence

import numpy as np
import numpy.lib.format as npformat

from gpulazy.errors import LayoutError
from gpulazy.layouts._base import Index, Layout
from gpulazy.layouts._common import FileEntry, FileStack, check_dtype, check_order, check_shape, stacks
from gpulazy.spec import file_identity

__all__ = ["NpyLayout", "read_npy_header"]

_MAGIC = b"\x93NUMPY"


class NpyLayout(Layout):
    """``.npy`` files. ``dtype``, ``shape`` and ``order`` may be given; they must match.

    ``stack``: see ``Layout.index``.
    """

    name = "npy"
    extensions = (".npy",)

    @classmethod
    def guess_can_open(cls, path: str) -> bool:
        try:
            with open(path, "rb") as f:
                return f.read(len(_MAGIC)) == _MAGIC
        except OSError:
            return False

    def index(self, paths: Sequence[str], *, dtype: Any = None, shape: Any = None, offset: int = 0,
              order: str | None = None, chunks: Any = None, stack: bool | None = None, **unknown: Any) -> Index:
        if unknown:
            raise TypeError(f"the npy layout got unexpected options {sorted(unknown)}")
        if offset:
            raise LayoutError(f".npy files carry their own header; offset={offset!r} cannot be used "
                              f"with {paths[0]!r} (to read its bytes raw, pass layout='raw')")
        headers = [read_npy_header(p) for p in paths]
        first = headers[0]
        for p, h in zip(paths[1:], headers[1:]):
            _check_same(p, h, paths[0], first)
        file_shape, dt, fortran, _ = first
        _check_requested(paths[0], file_shape, dt, fortran, dtype, shape, order)
        files = tuple(FileEntry(p, h[3], file_identity(p)) for p, h in zip(paths, headers))
        fs = FileStack(files, file_shape, dt, "F" if fortran else "C", stacked=stacks(stack, paths))
        return fs.index(chunks, layout=self.name)


def read_npy_header(path: str) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """``(shape, dtype, fortran_order, data_offset)`` of a ``.npy`` file; checks its size.

    Any malformed header raises ``LayoutError`` naming the file, whatever the parser
    tripped on (numpy's Python 2 header filter lets ``tokenize.TokenError`` escape, deep
    nesting raises ``RecursionError``...). At most ``_MAX_HEADER`` bytes are read: the
    header's own length field is checked against the file's size first, so a corrupt
    length cannot make us allocate gigabytes.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header = _header_bytes(f, path, size)
            data_offset = len(header)
        stream = io.BytesIO(header)
        version = npformat.read_magic(stream)
        shape, fortran, dtype = _read_header(stream, version)
        if stream.tell() != data_offset:
            raise ValueError(f"the header's dict ends at byte {stream.tell()}, not at {data_offset}")
    except LayoutError:
        raise
    except OSError as e:
        raise LayoutError(f"cannot read the .npy header of {path!r}: {e}") from e
    except Exception as e:  # every parser failure, whatever its type, is a bad header
        raise LayoutError(f"cannot parse the .npy header of {path!r}: {type(e).__name__}: {e}") from e
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise LayoutError(f"file {path!r} holds dtype {dtype!r}: object and structured dtypes cannot be "
                          "read as GPU arrays; only plain numeric dtypes")
    dtype = check_dtype(dtype, what=f"dtype of {path!r}")
    if any(n < 0 for n in shape):
        raise LayoutError(f"file {path!r} has a .npy header with a negative shape {shape}; the file is corrupt")
    expected = data_offset + math.prod(shape) * dtype.itemsize
    if size != expected:
        raise LayoutError(f"file {path!r} has {size} bytes but its .npy header (shape {shape}, dtype "
                          f"{dtype.str!r}, data at byte {data_offset}) needs {expected}; the file is "
                          f"{'truncated' if size < expected else 'longer than its header says'}")
    return tuple(shape), dtype, bool(fortran), data_offset


#: numpy's own limit on a header's dict (``numpy.lib.format._MAX_HEADER_SIZE``), plus its prefix.
_MAX_HEADER = 10_000 + 12
_LENGTH_FIELD = {1: "<H", 2: "<I", 3: "<I"}


def _header_bytes(f: Any, path: str, size: int) -> bytes:
    """The magic, version, length field and header dict: bounded by the file's size."""
    prefix = f.read(len(_MAGIC) + 2)
    if prefix[: len(_MAGIC)] != _MAGIC:
        raise LayoutError(f"file {path!r} is not a .npy file (no \\x93NUMPY magic)")
    if len(prefix) < len(_MAGIC) + 2 or prefix[-1] != 0 or prefix[-2] not in _LENGTH_FIELD:
        raise LayoutError(f"file {path!r} has an unknown .npy format version {tuple(prefix[len(_MAGIC):])}; "
                          "known: (1, 0), (2, 0), (3, 0)")
    fmt = _LENGTH_FIELD[prefix[-2]]
    field = f.read(struct.calcsize(fmt))
    if len(field) < struct.calcsize(fmt):
        raise LayoutError(f"file {path!r} ends inside its .npy header ({size} bytes)")
    (length,) = struct.unpack(fmt, field)
    start = len(prefix) + len(field)
    if start + length > min(size, _MAX_HEADER):
        raise LayoutError(f"file {path!r} says its .npy header is {length} bytes long, but the file has "
                          f"{size} bytes (and a header may hold at most {_MAX_HEADER - 12}); the file is corrupt "
                          "or truncated")
    body = f.read(length)
    if len(body) != length:
        raise LayoutError(f"file {path!r} ends inside its .npy header (read {len(body)} of {length} bytes)")
    return prefix + field + body


def _read_header(f, version: tuple[int, int]):
    if version == (1, 0):
        return npformat.read_array_header_1_0(f)
    if version == (2, 0):
        return npformat.read_array_header_2_0(f)
    # 3.0 (utf-8 field names) has no public reader; numpy's private one handles it.
    reader = getattr(npformat, "_read_array_header", None)
    if reader is None:
        from numpy.lib import _format_impl

        reader = _format_impl._read_array_header
    return reader(f, version)


def _check_same(path: str, h: tuple, first_path: str, first: tuple) -> None:
    names = ("shape", "dtype", "fortran_order")
    for name, a, b in zip(names, h[:3], first[:3]):
        if a != b:
            raise LayoutError(f"file {path!r} has {name} {a!r} but {first_path!r} has {b!r}; "
                              "stacked .npy files must agree on shape, dtype and order")


def _check_requested(path: str, shape: tuple, dt: np.dtype, fortran: bool, dtype: Any, want_shape: Any,
                     order: str | None) -> None:
    if dtype is not None and check_dtype(dtype) != dt:
        raise LayoutError(f"file {path!r} holds dtype {dt.str!r}, not the requested {dtype!r}; "
                          "leave dtype unset for .npy files (or pass layout='raw' to reinterpret bytes)")
    if want_shape is not None and check_shape(want_shape) != tuple(shape):
        raise LayoutError(f"file {path!r} holds shape {tuple(shape)}, not the requested {want_shape!r}; "
                          "leave shape unset for .npy files")
    if order is not None and check_order(order) != ("F" if fortran else "C"):
        raise LayoutError(f"file {path!r} is stored in {'F' if fortran else 'C'} order, not the requested "
                          f"{order!r}; leave order unset for .npy files")
