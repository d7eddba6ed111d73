"""Shared layout machinery: path resolution, chunking, byte ranges of a chunk.

Raw and ``.npy`` files are both "a block of elements at an offset in a file"; one or
several equally shaped files (stacked along a new axis 0). ``FileStack`` describes that
and ``FileStack.index`` turns it into ChunkSpecs.
"""

from __future__ import annotations

import glob
import itertools
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from gpulazy import config
from gpulazy.layouts._slabs import default_chunks, slab_sizes
from gpulazy.errors import LayoutError, NoFilesError
from gpulazy.layouts._base import Index
from gpulazy.spec import ByteRange, ChunkSpec, FileIdentity

__all__ = [
    "resolve_paths",
    "names_collection",
    "natural_key",
    "check_dtype",
    "default_chunks",
    "normalize_chunks",
    "c_ranges",
    "FileStack",
    "stacks",
]

_DTYPE_EXAMPLES = "'uint8', 'uint16', '>u2' (big-endian), 'int32', 'float32', '<f8', 'complex64'"
_NUMERIC_KINDS = "biufc"


# -- paths ----------------------------------------------------------------------------
def natural_key(path: str) -> tuple:
    """Sort key putting ``z2`` before ``z10`` (digit runs compare as numbers)."""
    parts = re.split(r"(\d+)", path)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), path


def resolve_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The files named by ``paths``: a glob, a directory, one file or a sequence of files.

    A glob or a directory gives its regular files (hidden ones skipped for a directory)
    in natural order; a sequence keeps its order. Raises ``NoFilesError`` naming the
    pattern when nothing matches, ``LayoutError`` for a directory inside a sequence.
    """
    if isinstance(paths, (str, os.PathLike)):
        return _resolve_one(os.fspath(paths))
    try:
        items = [os.fspath(p) for p in paths]
    except TypeError as e:
        raise TypeError(f"paths must be a path, a glob, a directory or a sequence of paths; got {paths!r}") from e
    if not items:
        raise NoFilesError("no files given: the sequence of paths is empty")
    for p in items:
        _check_file(p, listed=True)
    return items


def names_collection(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> bool:
    """Whether ``paths`` names a collection of files (a directory, a glob or a sequence).

    A collection always stacks along a new leading axis, even when it holds one file, so
    an array's shape does not depend on how many files matched; a single file does not
    stack. A path that exists as a file is a single file even if it contains ``*`` or ``[``.

    >>> names_collection("scan/*.raw"), names_collection(["a.raw"]), names_collection("a.raw")
    (True, True, False)
    """
    if not isinstance(paths, (str, os.PathLike)):
        return True
    path = os.path.expanduser(os.fspath(paths))
    if os.path.isdir(path):
        return True
    return not os.path.exists(path) and glob.has_magic(path)


def _resolve_one(path: str) -> list[str]:
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        names = [os.path.join(path, n) for n in os.listdir(path) if not n.startswith(".")]
        files = sorted((p for p in names if os.path.isfile(p)), key=natural_key)
        if not files:
            raise NoFilesError(f"directory {path!r} holds no regular (non-hidden) files")
        for p in files:
            _check_readable(p)
        return files
    if os.path.exists(path):
        _check_file(path, listed=False)
        return [path]
    if glob.has_magic(path):
        files = sorted((p for p in glob.glob(path) if os.path.isfile(p)), key=natural_key)
        if not files:
            raise NoFilesError(f"no files match the pattern {path!r}")
        for p in files:
            _check_readable(p)
        return files
    raise NoFilesError(f"no such file or directory: {path!r}")


def _check_file(path: str, *, listed: bool) -> None:
    if os.path.isdir(path):
        hint = ("pass the directory on its own to read every file in it" if listed
                else "pass a file, a glob or a directory")
        raise LayoutError(f"{path!r} is a directory where a file was expected; {hint}")
    if not os.path.exists(path):
        raise NoFilesError(f"no such file: {path!r}")
    if not os.path.isfile(path):
        raise LayoutError(f"{path!r} is not a regular file (a device, socket or pipe cannot be indexed)")
    _check_readable(path)


def _check_readable(path: str) -> None:
    if not os.access(path, os.R_OK):
        raise NoFilesError(f"file {path!r} is not readable (permission denied); check its permissions")


# -- dtypes ---------------------------------------------------------------------------
def check_dtype(dtype: Any, *, what: str = "dtype") -> np.dtype:
    """``dtype`` as a NumPy dtype with its byte order, or a ``LayoutError`` listing valid ones."""
    if dtype is None:
        raise LayoutError(f"{what} is required; pass e.g. {_DTYPE_EXAMPLES}")
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise LayoutError(f"unknown {what} {dtype!r}; valid examples: {_DTYPE_EXAMPLES}") from e
    if dt.kind not in _NUMERIC_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise LayoutError(
            f"{what} {dt!r} is not supported: only plain boolean, integer, float and complex dtypes "
            f"can be read (no object, string or structured dtypes); e.g. {_DTYPE_EXAMPLES}")
    return dt


def check_shape(shape: Any, *, what: str = "shape") -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        out = tuple(int(n) for n in shape)
    except TypeError as e:
        raise LayoutError(f"{what} must be a tuple of non-negative integers, got {shape!r}") from e
    if any(n < 0 for n in out):
        raise LayoutError(f"{what} must be non-negative, got {shape!r}")
    return out


def check_order(order: Any) -> str:
    if order not in ("C", "F"):
        raise LayoutError(f"order must be 'C' (row-major) or 'F' (column-major), got {order!r}")
    return order


# -- chunking -------------------------------------------------------------------------
_CHUNK_FORMS = ("an int (-1: the whole axis), 'auto', a byte size such as '16MiB', None, a tuple with one "
                "of those per axis or the block lengths of each axis, or a dict {axis: one of those}")


def normalize_chunks(chunks: Any, shape: Sequence[int], dtype: np.dtype, *, order: str = "C",
                     stacked: bool = False) -> tuple[tuple[int, ...], ...]:
    """Every chunk spelling ``dask.array`` accepts, as a tuple of tuples.

    ``None``, ``"auto"`` and a byte size (``"16MiB"``) give contiguous slabs of about
    ``config chunk_size`` (or that size) bytes (``default_chunks``). Per axis: an int
    (``-1``: the whole axis), ``None`` (the whole axis), ``"auto"``, a byte size (all
    byte sizes in one spelling must agree: it is the block's limit) or the block lengths.
    A dict ``{axis: ...}`` fills the axes it does not name from ``default_chunks``. A
    multi-file Fortran-order stack always gets one file per block along axis 0. Errors
    are ``LayoutError`` saying which axis and value is wrong.

    >>> normalize_chunks({0: 2, 1: -1}, (5, 4), np.dtype("u2"))
    ((2, 2, 1), (4,))
    >>> normalize_chunks("64B", (8, 8), np.dtype("u1"))
    ((8,), (8,))
    """
    from dask.array.core import normalize_chunks as dask_normalize

    shape = tuple(shape)
    _check_block_count(chunks, shape, dtype, order, stacked)
    limit = _chunk_limit(chunks, shape)
    default = default_chunks(shape, dtype.itemsize, order=order, stacked=stacked, target=limit)
    if chunks is None or isinstance(chunks, str):
        return default  # "auto" or a byte size: contiguous slabs, not dask's square blocks
    if isinstance(chunks, dict):
        bad = [a for a in chunks if not isinstance(a, int) or not -len(shape) <= a < len(shape)]
        if bad:
            raise LayoutError(f"chunks dict names axes {bad!r} outside the array's {len(shape)} axes "
                              f"(shape {shape})")
        chunks = {a % len(shape): c for a, c in chunks.items()}
        chunks = tuple(chunks.get(a, default[a]) for a in range(len(shape)))
    per_axis = _check_chunk_spelling(chunks, shape)
    # Byte sizes become "auto" under dask's limit (dask refuses a byte size beside a limit).
    per_axis = tuple("auto" if isinstance(c, str) else c for c in per_axis)
    try:
        out = dask_normalize(per_axis, shape, limit=limit or int(config.get("chunk_size")), dtype=dtype)
    except (ValueError, TypeError, NotImplementedError) as e:
        # Our checks passed, so this is a case they do not know: say it in our words, keep dask's as the cause.
        raise LayoutError(f"chunks {chunks!r} cannot chunk an array of shape {shape} and dtype {dtype}; "
                          f"use {_CHUNK_FORMS}") from e
    out = tuple(tuple(int(c) for c in axis) for axis in out)
    if order == "F" and stacked and shape and any(c != 1 for c in out[0]):
        out = ((1,) * shape[0] if shape[0] else (0,),) + out[1:]
    return out


def _check_block_count(chunks: Any, shape: tuple[int, ...], dtype: np.dtype, order: str, stacked: bool) -> None:
    """Refuse a spelling that makes more than config ``max_chunks`` blocks before dask lists them.

    (dask's ``normalize_chunks`` builds a tuple per axis: 1e9 bytes in chunks of 1 was a bare
    ``MemoryError``.)
    """
    from gpulazy.layouts._limits import check_pieces, spelled_block_count, suggest_chunks

    count = spelled_block_count(chunks, shape)
    if count > 1:
        check_pieces(count, what="dask chunks", shape=shape, dtype=dtype, pieces=repr(chunks),
                     fix=lambda: f"pass chunks={suggest_chunks(shape, dtype, order=order, stacked=stacked)}")


def _chunk_limit(chunks: Any, shape: tuple[int, ...]) -> int | None:
    """The byte size a spelling gives (``"16MiB"``, or one per axis), or ``None``."""
    if isinstance(chunks, str):
        items = [chunks]
    elif isinstance(chunks, dict):
        items = list(chunks.values())
    elif isinstance(chunks, (tuple, list)):
        items = list(chunks)
    else:
        return None
    sizes = {}
    for c in items:
        if isinstance(c, str) and c != "auto":
            try:
                sizes[c] = config.parse_bytes(c)
            except Exception as e:
                raise LayoutError(f"chunks {chunks!r}: cannot read {c!r} as a byte size; write e.g. "
                                  f"'16MiB' or 'auto'") from e
            if sizes[c] <= 0:
                raise LayoutError(f"chunks {chunks!r}: the byte size {c!r} must be positive")
    if len(set(sizes.values())) > 1:
        raise LayoutError(f"chunks {chunks!r} give different byte sizes ({', '.join(sizes)}); a byte size is "
                          "the limit of one block, so give it once (the other axes as 'auto' or lengths)")
    return next(iter(sizes.values()), None)


def _check_chunk_spelling(chunks: Any, shape: tuple[int, ...]) -> tuple:
    """``chunks`` (an int or one entry per axis) as one checked entry per axis."""
    if isinstance(chunks, (bool, np.bool_)) or not isinstance(chunks, (int, np.integer, tuple, list)):
        raise LayoutError(f"chunks {chunks!r} is not a chunk spelling; use {_CHUNK_FORMS}")
    given = chunks
    if isinstance(chunks, (int, np.integer)):
        chunks = (chunks,) * len(shape)
    if len(chunks) != len(shape):
        raise LayoutError(f"chunks {tuple(chunks)!r} has {len(chunks)} entries but the array has {len(shape)} "
                          f"axes (shape {shape}); give one entry per axis, or a dict {{axis: size}}")
    return tuple(_check_axis_chunks(c, n, axis, given) for axis, (c, n) in enumerate(zip(chunks, shape)))


def _check_axis_chunks(c: Any, n: int, axis: int, chunks: Any) -> Any:
    where = f"chunks {chunks!r}, axis {axis} (length {n})"
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, (bool, np.bool_)):
        raise LayoutError(f"{where}: {c!r} is not a block length")
    if isinstance(c, (int, np.integer)):
        if c == -1 or c > 0 or (c == 0 and n == 0):
            return int(c)
        raise LayoutError(f"{where}: block length {c} must be positive (or -1 for the whole axis)")
    if isinstance(c, float) and c.is_integer() and c > 0:
        return int(c)
    if isinstance(c, (tuple, list)):
        if not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 0 for b in c):
            raise LayoutError(f"{where}: block lengths {tuple(c)!r} must be non-negative integers")
        if sum(c) != n:
            raise LayoutError(f"{where}: block lengths {tuple(c)!r} add up to {sum(c)}, not {n}")
        return tuple(int(b) for b in c)
    raise LayoutError(f"{where}: {c!r} is not a chunk size; use an int, -1, None, 'auto', a byte size "
                      "or the block lengths")


# -- byte ranges ----------------------------------------------------------------------
def c_ranges(shape: Sequence[int], start: Sequence[int], stop: Sequence[int],
             itemsize: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` runs, in C order, of the block ``start:stop`` of a C array.

    The fewest runs: the axes after the last partial one are whole, so each run covers
    them; one run per index of the axes before it. Adjacent runs are merged.
    """
    n = len(shape)
    if n == 0:
        return [(0, itemsize)]
    if any(b <= a for a, b in zip(start, stop)):
        return []
    k = n - 1
    while k > 0 and start[k] == 0 and stop[k] == shape[k]:
        k -= 1
    strides = [0] * n
    acc = itemsize
    for i in range(n - 1, -1, -1):
        strides[i] = acc
        acc *= shape[i]
    run = (stop[k] - start[k]) * strides[k]
    first = start[k] * strides[k]
    if k == 0:
        return [(first, run)]
    outer = itertools.product(*(range(start[i] * strides[i], stop[i] * strides[i], strides[i]) for i in range(k)))
    return coalesce((first + sum(o), run) for o in outer)


def coalesce(runs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge runs that follow each other directly."""
    out: list[tuple[int, int]] = []
    for off, nb in runs:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + nb)
        else:
            out.append((off, nb))
    return out


def _bounds(chunks: Sequence[int]) -> list[tuple[int, int]]:
    edges = list(itertools.accumulate(chunks, initial=0))
    return list(zip(edges[:-1], edges[1:]))


# -- a stack of equally shaped files ----------------------------------------------------
def stacks(stack: bool | None, files: Sequence[Any]) -> bool:
    """Whether ``files`` stack along a new axis 0.

    ``stack`` is what ``layouts.index`` passes (``names_collection`` of the user's
    paths): a folder, glob or list stacks even when it holds one file. ``None`` (a
    layout called directly) stacks when there are several files.
    """
    if stack is None:
        return len(files) > 1
    if not stack and len(files) > 1:
        raise LayoutError(f"stack=False needs exactly one file, but {len(files)} were given "
                          f"({files[0]!r}, ...); leave stack unset to stack them along a new axis 0")
    return bool(stack)


@dataclass(frozen=True)
class FileEntry:
    """One file: its path, where its elements start, and its identity (chunk keys, checks on reading)."""

    path: str
    offset: int
    identity: FileIdentity


@dataclass(frozen=True)
class FileStack:
    """One file (the whole array) or several files stacked along a new axis 0.

    ``file_shape`` is the shape of each file's elements, stored in ``order``;
    ``dtype`` is the file's dtype with its byte order.
    """

    files: tuple[FileEntry, ...]
    file_shape: tuple[int, ...]
    dtype: np.dtype
    order: str
    stacked: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return ((len(self.files),) + self.file_shape) if self.stacked else self.file_shape

    def index(self, chunks: Any, *, layout: str) -> Index:
        """The ``Index`` for user ``chunks`` (dask-style, or None for the default)."""
        shape = self.shape
        native = self.dtype.newbyteorder("=")
        norm = normalize_chunks(chunks, shape, native, order=self.order, stacked=self.stacked)
        self._check_runs(norm)
        specs = self._specs(norm)
        return Index(shape=shape, dtype=native, chunks=norm, specs=specs, layout=layout,
                     order=self.order, stacked=self.stacked, paths=tuple(f.path for f in self.files))

    def _check_runs(self, chunks: tuple[tuple[int, ...], ...]) -> None:
        """Refuse a chunking of more byte runs than config ``max_chunks``, before any is made.

        Counted from the first block (the largest): ``(n, m)`` in chunks of ``(n, 1)`` is one
        block per column but ``n`` runs each.
        """
        from gpulazy.layouts._limits import check_pieces, runs_per_block, suggest_chunks

        if not chunks or 0 in self.shape:
            return
        inner = tuple(c[0] for c in chunks[1:]) if self.stacked else tuple(c[0] for c in chunks)
        fshape = self.file_shape
        if self.order == "F":  # the file is the C-order array of the reversed shape
            inner, fshape = inner[::-1], fshape[::-1]
        inner_blocks = math.prod(len(c) for c in (chunks[1:] if self.stacked else chunks))
        count = runs_per_block(fshape, inner) * inner_blocks * (len(self.files) if self.stacked else 1)
        check_pieces(count, what="byte runs", shape=self.shape, dtype=self.dtype,
                     pieces=tuple(c[0] for c in chunks), where=self.files[0].path,
                     fix=lambda: "pass chunks={} (contiguous slabs)".format(
                         suggest_chunks(self.shape, self.dtype, order=self.order, stacked=self.stacked)))

    def _file_runs(self, inner_bounds: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Runs of one file for a block whose per-axis bounds (within the file) are given."""
        start = [a for a, _ in inner_bounds]
        stop = [b for _, b in inner_bounds]
        shape = self.file_shape
        if self.order == "F":  # the file is the C-order array of the reversed shape
            shape, start, stop = shape[::-1], start[::-1], stop[::-1]
        return c_ranges(shape, start, stop, self.dtype.itemsize)

    def _specs(self, chunks: tuple[tuple[int, ...], ...]) -> dict[tuple[int, ...], ChunkSpec]:
        if self.stacked:
            return self._stacked_specs(chunks)
        return self._single_specs(chunks)

    def _single_specs(self, chunks: tuple[tuple[int, ...], ...]) -> dict[tuple[int, ...], ChunkSpec]:
        # The runs of a block depend on its position along the file's outermost axis (axis
        # 0 of the C view, the last array axis for F order) only by a shift: compute them
        # once per (extent there, other bounds) and shift, so 100,000 blocks stay cheap.
        bounds = [_bounds(c) for c in chunks]
        f = self.files[0]
        ident = (f.identity,)
        dt, order = self.dtype.str, self.order
        outer = (len(chunks) - 1 if order == "F" else 0) if chunks else None
        step = (math.prod(self.file_shape) // max(self.file_shape[outer], 1) * self.dtype.itemsize
                if outer is not None else 0)
        memo: dict[tuple, tuple[tuple[int, ...], list[tuple[int, int]]]] = {}
        specs: dict[tuple[int, ...], ChunkSpec] = {}
        path, offset = f.path, f.offset
        blocks = itertools.product(*(range(len(b)) for b in bounds))
        for idx, bnd in zip(blocks, itertools.product(*bounds)):
            shift = 0
            if outer is not None:
                s0, e0 = bnd[outer]
                bnd = bnd[:outer] + ((0, e0 - s0),) + bnd[outer + 1:]
                shift = s0 * step
            hit = memo.get(bnd)
            if hit is None:
                hit = memo[bnd] = (tuple([b - a for a, b in bnd]), self._file_runs(bnd))
            shape, runs = hit
            base = offset + shift
            ranges = tuple([ByteRange(path, base + off, nb) for off, nb in runs])
            specs[idx] = ChunkSpec(ranges, shape, dt, order, None, ident, idx)
        return specs

    def _stacked_specs(self, chunks: tuple[tuple[int, ...], ...]) -> dict[tuple[int, ...], ChunkSpec]:
        # The runs within a file depend only on the inner block; compute them once each.
        bounds = [_bounds(c) for c in chunks]
        dt, order = self.dtype.str, self.order
        inner_runs = {}
        for inner in itertools.product(*(range(len(b)) for b in bounds[1:])):
            bnd = [bounds[a + 1][i] for a, i in enumerate(inner)]
            inner_runs[inner] = (tuple(b - a for a, b in bnd), self._file_runs(bnd))
        specs: dict[tuple[int, ...], ChunkSpec] = {}
        for i0, (f0, f1) in enumerate(bounds[0]):
            files = self.files[f0:f1]
            ident = tuple(f.identity for f in files)
            for inner, (ishape, runs) in inner_runs.items():
                ranges = tuple([ByteRange(f.path, f.offset + off, nb) for f in files for off, nb in runs])
                idx = (i0,) + inner
                specs[idx] = ChunkSpec(ranges, (f1 - f0,) + ishape, dt, order, None, ident, idx)
        return specs
