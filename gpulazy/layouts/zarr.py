"""Zarr v2 and v3 stores on local disk, v3 sharding, and OME-Zarr (NGFF 0.4/0.5) pyramids.

A store is a directory. Its metadata is read with the ``zarr`` package; every stored
chunk's file and byte range is worked out here without reading chunk data (a shard's
index is read once per shard). Dask chunks are unions of whole stored chunks (whole
shards by default when a shard fits ``config chunk_size``), so nothing is read or
decoded twice. A chunk file that does not exist reads as the array's ``fill_value`` (or,
with ``missing="error"``, raises); every chunk and shard file's ``FileIdentity``, and that
of each file found missing, is in the chunk keys and checked on every read.

Uncompressed chunks that already are a dask block's elements in order become plain
byte ranges (read straight into place); compressed ones become one ``Tile`` per stored
chunk with codec steps such as ``(Codec("zstd"),)`` that ``gpulazy.codecs`` decodes (in
batches on the GPU where nvCOMP can).

Options: ``path=`` (or ``array=``) picks an array or a multiscale group inside the
store (``path="labels/cells"``); ``missing="error"`` refuses chunk files that do not
exist; ``chunks=`` as in ``from_files``.

>>> import numpy as np, tempfile, os, zarr
>>> d = os.path.join(tempfile.mkdtemp(), "a.zarr")
>>> z = zarr.create_array(d, shape=(6, 4), chunks=(3, 4), dtype="u2", compressors=None)
>>> z[:] = np.arange(24).reshape(6, 4)
>>> from gpulazy import layouts
>>> ix = layouts.index(d)
>>> ix.layout, ix.shape, ix.chunks, ix.attrs["stored_chunks"]
('zarr', (6, 4), ((6,), (4,)), (3, 4))
"""

from __future__ import annotations

import math
import os
import stat
from typing import Any, Sequence

import numpy as np

from gpulazy import config
from gpulazy.errors import LayoutError
from gpulazy.layouts._base import Index, Layout
from gpulazy.layouts._common import check_order, check_shape, check_dtype
from gpulazy.layouts._grid import grid_chunks, grid_specs
from gpulazy.layouts._ngff import multiscale_levels
from gpulazy.layouts._zarr_meta import ZarrMeta, meta_from_dict
from gpulazy.layouts._zarr_shard import read_shard_index
from gpulazy.spec import ByteRange, ChunkSpec, FileIdentity

__all__ = ["ZarrLayout"]

_META_FILES = ("zarr.json", ".zarray", ".zgroup")
#: More stored chunks than this is metadata no graph can hold (and corrupt metadata can
#: claim any shape): refuse it rather than spend minutes listing chunks.
MAX_CHUNKS = 1 << 24
#: A stored chunk decodes whole into memory; past this its metadata is not believed.
MAX_CHUNK_BYTES = 1 << 34
#: What a chunk file that does not exist reads as (the ``missing=`` option).
MISSING = ("fill", "error")


class ZarrLayout(Layout):
    """Zarr v2/v3 arrays and groups (a directory, or its ``zarr.json``/``.zarray``/``.zgroup``).

    A group opens its OME-Zarr full resolution (dataset 0 of the first multiscale), or
    its only array; ``levels`` gives every level of the pyramid.

    Options (of ``index`` and ``levels``): ``chunks`` (dask-style; each block edge moves
    up to a stored chunk's edge), ``path`` or ``array`` (an array or multiscale group
    inside the store, ``"labels/cells"``), ``missing`` (``"fill"``: a chunk or shard file
    that does not exist reads as the fill value, as the Zarr spec says, and counts in
    ``gpulazy.stats()["chunks_filled"]``; ``"error"``: it raises ``LayoutError`` naming the
    file; an inner chunk that a shard's index marks as never written reads as the fill
    value either way), and ``dtype``/``shape``/``order``, which must match the store's
    when given.
    """

    name = "zarr"
    extensions = (".zarr",)
    opens_directories = True

    @classmethod
    def guess_can_open(cls, path: str) -> bool:
        try:
            if os.path.isdir(path):
                return any(os.path.isfile(os.path.join(path, m)) for m in _META_FILES)
            return os.path.basename(path) in _META_FILES and os.path.isfile(path)
        except (OSError, ValueError, TypeError):
            return False

    def index(self, paths: Sequence[str], **opts: Any) -> Index:
        return self._indexes(paths, True, **opts)[0]

    def levels(self, paths: Sequence[str], **opts: Any) -> list[Index]:
        return self._indexes(paths, False, **opts)

    def _indexes(self, paths: Sequence[str], first_only: bool, *, chunks: Any = None, path: str | None = None,
                 array: str | None = None, dtype: Any = None, shape: Any = None, order: str | None = None,
                 offset: int = 0, missing: str = "fill", **unknown: Any) -> list[Index]:
        if unknown:
            raise TypeError(f"the zarr layout got unexpected options {sorted(unknown)}; it takes chunks=, path= "
                            "(or array=), missing=, dtype=, shape=, order=")
        if missing not in MISSING:
            raise LayoutError(f"missing={missing!r} is not one of {MISSING}: 'fill' reads a chunk file that does "
                              "not exist as the fill value (the Zarr spec), 'error' raises naming it")
        root = _root(paths)
        if offset:
            raise LayoutError(f"Zarr stores carry their own metadata; offset={offset!r} cannot be used with {root!r}")
        out = []
        for node_dir, arr, extra in _arrays(root, _sub_path(path, array), first_only=first_only):
            meta = _read_meta(arr, node_dir)
            _check_requested(meta, dtype, shape, order)
            out.append(_index(meta, chunks, {**_array_attrs(arr, meta), **extra}, missing))
        return out


# -- finding the arrays ---------------------------------------------------------------------

def _root(paths: Sequence[str]) -> str:
    if len(paths) != 1:
        raise LayoutError(f"a Zarr store is one directory; got {len(paths)} paths ({paths[0]!r}, ...)")
    p = os.fspath(paths[0])
    if os.path.basename(p) in _META_FILES and os.path.isfile(p):
        return os.path.dirname(p) or "."
    return p


def _sub_path(path: str | None, array: str | None) -> str | None:
    if path is not None and array is not None and path.strip("/") != array.strip("/"):
        raise TypeError(f"path={path!r} and array={array!r} name different arrays; pass one of them")
    sub = path if path is not None else array
    return (sub.strip("/") or None) if sub is not None else None


def _open(where: str) -> Any:
    """The zarr ``Array`` or ``Group`` at directory ``where``; ``LayoutError`` naming its metadata."""
    import zarr

    if not any(os.path.isfile(os.path.join(where, m)) for m in _META_FILES):
        raise LayoutError(f"{where!r} is not a Zarr array or group: it has no zarr.json, .zarray or .zgroup")
    try:
        return zarr.open(store=where, mode="r")
    except Exception as e:  # zarr raises many kinds (JSON, validation, unknown codec ...) for bad metadata
        raise LayoutError(f"cannot read the Zarr metadata of {_meta_file(where)!r}: {type(e).__name__}: {e}"
                          f"{_codec_hint(e)}") from e


def _codec_hint(e: Exception) -> str:
    text = f"{type(e).__name__} {e}".lower()
    if isinstance(e, ImportError) or any(s in text for s in ("unknowncodec", "unknown codec", "codec not available")):
        return ("; if it is a numcodecs or imagecodecs codec, install the package that provides it "
                "(pip install numcodecs imagecodecs)")
    return ""


def _meta_file(where: str) -> str:
    for m in _META_FILES:
        p = os.path.join(where, m)
        if os.path.isfile(p):
            return p
    return where


def _arrays(root: str, sub: str | None, *, first_only: bool) -> list[tuple[str, Any, dict]]:
    """``(directory, zarr array, extra attrs)`` of what ``root``/``sub`` names, full resolution first."""
    import zarr

    where = os.path.join(root, *sub.split("/")) if sub else root
    if sub and not os.path.isdir(where):
        raise LayoutError(f"{sub!r} is not in the Zarr store {root!r}; its arrays are: {_list_arrays(root)}")
    node = _open(where)
    if isinstance(node, zarr.Array):
        return [(where, node, {})]
    levels = multiscale_levels(_attrs(node, where), _meta_file(where))
    if levels is not None:
        out = []
        for lv in levels[:1] if first_only else levels:
            level_dir = os.path.join(where, *lv.path.split("/"))
            arr = _open(level_dir) if os.path.isdir(level_dir) else None
            if not isinstance(arr, zarr.Array):
                raise LayoutError(f"{_meta_file(where)!r}: multiscale dataset {lv.path!r} is not an array in the "
                                  f"store; its arrays are: {_list_arrays(where)}")
            out.append((level_dir, arr, dict(lv.attrs)))
        return out
    names = _array_names(node, where)
    if len(names) == 1:
        return [(os.path.join(where, *names[0].split("/")), node[names[0]], {})]
    if not names:
        raise LayoutError(f"the Zarr group {where!r} holds no arrays")
    listing = ", ".join(repr(n) for n in names)
    raise LayoutError(f"the Zarr group {where!r} has no OME-Zarr multiscales and {len(names)} arrays ({listing}); "
                      f"pick one with path=, e.g. path={names[0]!r}")


def _attrs(group: Any, where: str) -> dict:
    try:
        return dict(group.attrs)
    except Exception as e:  # zarr parses attributes lazily for v2
        raise LayoutError(f"cannot read the attributes of the Zarr group {where!r}: {e}") from e


def _array_names(group: Any, where: str) -> list[str]:
    import zarr

    try:
        return sorted(name for name, m in group.members(max_depth=None) if isinstance(m, zarr.Array))
    except Exception as e:
        raise LayoutError(f"cannot list the arrays of the Zarr group {where!r}: {type(e).__name__}: {e}") from e


def _list_arrays(root: str) -> str:
    try:
        import zarr

        node = zarr.open(store=root, mode="r")
        names = [""] if isinstance(node, zarr.Array) else _array_names(node, root)
    except Exception:  # only for an error message: never mask the error being reported
        return "(the store's metadata cannot be read)"
    return ", ".join(repr(n) for n in names) or "none"


# -- metadata -------------------------------------------------------------------------------

def _read_meta(arr: Any, where: str) -> ZarrMeta:
    from gpulazy.codecs import check_supported

    meta_file = _meta_file(where)
    try:
        d = arr.metadata.to_dict()
        dtype, fill = arr.dtype, arr.metadata.fill_value
    except Exception as e:
        raise LayoutError(f"cannot read the Zarr metadata of {meta_file!r}: {type(e).__name__}: {e}") from e
    meta = meta_from_dict(d, dtype=dtype, fill_value=fill, path=where, meta_file=meta_file)
    check_supported(meta.codec, where)
    return meta


def _array_attrs(arr: Any, meta: ZarrMeta) -> dict:
    attrs: dict[str, Any] = {
        "codec": meta.describe_codec(),
        "stored_chunks": meta.tile,
        "zarr_format": meta.zarr_format,
        "fill_value": meta.fill_value,
        "store": meta.path,
    }
    if meta.shard is not None:
        attrs["shards"] = meta.chunks
    axes = meta.dimension_names
    if axes is None and meta.zarr_format == 2:
        dims = _safe_attr(arr, "_ARRAY_DIMENSIONS")  # xarray's convention for v2
        axes = tuple(dims) if isinstance(dims, list) and len(dims) == len(meta.shape) else None
    if axes is not None:
        attrs["axes"] = axes
    return attrs


def _safe_attr(arr: Any, name: str) -> Any:
    try:
        return arr.attrs.get(name)
    except Exception:  # optional metadata: an unreadable .zattrs only loses the axis names
        return None


def _check_requested(meta: ZarrMeta, dtype: Any, shape: Any, order: str | None) -> None:
    native = meta.dtype.newbyteorder("=")
    if dtype is not None and check_dtype(dtype).newbyteorder("=") != native:
        raise LayoutError(f"the Zarr array {meta.path!r} holds dtype {meta.dtype.str!r}, not the requested "
                          f"{dtype!r}; leave dtype unset for Zarr stores")
    if shape is not None and check_shape(shape) != meta.shape:
        raise LayoutError(f"the Zarr array {meta.path!r} has shape {meta.shape}, not the requested {shape!r}")
    if order is not None and check_order(order) != meta.order:
        raise LayoutError(f"the Zarr array {meta.path!r} is stored in {meta.order} order, not the requested "
                          f"{order!r}; leave order unset for Zarr stores")


# -- chunks ---------------------------------------------------------------------------------

def _index(meta: ZarrMeta, chunks: Any, attrs: dict, missing: str = "fill") -> Index:
    native = meta.dtype.newbyteorder("=")
    tile = meta.tile
    count = math.prod(-(-n // t) for n, t in zip(meta.shape, tile))
    if count > MAX_CHUNKS:
        raise LayoutError(f"the Zarr array {meta.path!r} (shape {meta.shape}, chunks {tile}) has {count} stored "
                          f"chunks, more than gpulazy indexes ({MAX_CHUNKS}); is {meta.meta_file!r} corrupt?")
    tile_bytes = math.prod(tile) * native.itemsize
    if tile_bytes > MAX_CHUNK_BYTES:
        raise LayoutError(f"the Zarr array {meta.path!r} has stored chunks of shape {tile} ({tile_bytes} bytes), "
                          f"too big to decode into memory (at most {MAX_CHUNK_BYTES}); is {meta.meta_file!r} corrupt?")
    norm = _chunks(meta, chunks, native)
    if 0 in meta.shape:
        specs = _empty_specs(meta, norm)
    else:
        files = _Files(meta, missing)
        tile_at = _ShardTiles(meta, files) if meta.shard is not None else _ChunkTiles(meta, files)
        specs = grid_specs(meta.shape, tile, norm, dtype=meta.dtype, tile_at=tile_at, codec=meta.codec,
                           fill_value=meta.fill_value, order=meta.order, identity=files.found.__getitem__,
                           absent=tile_at.absent)
    return Index(shape=meta.shape, dtype=native, chunks=norm, specs=specs, layout="zarr", order=meta.order,
                 paths=(meta.path,), attrs=attrs)


def _chunks(meta: ZarrMeta, chunks: Any, native: np.dtype) -> tuple[tuple[int, ...], ...]:
    if chunks is None and meta.shard is not None:
        # Whole shards when one fits a chunk: a shard's inner chunks are read together.
        if math.prod(meta.chunks) * native.itemsize <= int(config.get("chunk_size")):
            return grid_chunks(meta.shape, meta.chunks, native, None)
    try:
        return grid_chunks(meta.shape, meta.tile, native, chunks)
    except LayoutError as e:
        raise LayoutError(f"the Zarr array {meta.path!r}: {e}") from e


def _empty_specs(meta: ZarrMeta, chunks: tuple[tuple[int, ...], ...]) -> dict:
    # A zero-size array has nothing to read; one empty spec per (empty) block.
    import itertools

    out = {}
    for idx in itertools.product(*(range(len(c)) for c in chunks)):
        shape = tuple(c[i] for c, i in zip(chunks, idx))
        out[idx] = ChunkSpec((), shape, meta.dtype.str, meta.order, None, (), idx)
    return out


class _Files:
    """The ``FileIdentity`` of each chunk or shard file, ``None`` for one never written.

    Where a folder holds many chunk files it is listed once: a chunk never written then
    costs a dict lookup rather than a failed ``stat``, and a present one a single
    ``stat`` (none on Windows, where ``os.scandir``'s listing carries it). Where each
    folder holds a few (``c/i/j/k`` keys of a grid thin along its last axis), listing
    would cost more than it saves, and each file is ``stat``-ed. (100,000 chunk files:
    about 1.5 s of indexing, most of it building the specs, not the ``stat`` calls.)
    """

    #: Files per folder from which listing the folder pays.
    LIST_FROM = 32

    def __init__(self, meta: ZarrMeta, missing: str) -> None:
        self.meta, self.missing = meta, missing
        self.base = os.path.join(meta.path, "")
        grid = [-(-n // c) for n, c in zip(meta.shape, meta.chunks)]  # chunk (or shard) files per axis
        per_folder = math.prod(grid) if meta.key_separator != "/" else (grid[-1] if grid else 1)
        self.listing = per_folder >= self.LIST_FROM
        self.folders: dict[str, dict[str, os.DirEntry | None]] = {}
        self.found: dict[str, FileIdentity] = {}

    def path(self, coords: Sequence[int]) -> str:
        """The path of the file of stored chunk (or shard) ``coords``."""
        return self.base + self.meta.chunk_key(coords).replace("/", os.sep)

    def find(self, coords: Sequence[int], what: str = "chunk") -> FileIdentity | None:
        """The identity of the file of ``coords``; ``None`` (or ``LayoutError`` with
        ``missing="error"``) when it does not exist."""
        path = self.path(coords)
        try:
            st = self._listed_stat(path) if self.listing else os.stat(path)
        except FileNotFoundError:
            st = None  # never written (or deleted since its folder was listed)
        except OSError as e:
            raise LayoutError(f"cannot read the Zarr {what} file {path!r}: {e}") from e
        if st is None:
            if self.missing == "error":
                raise LayoutError(f"Zarr {what} file {path!r} ({what} {tuple(coords)} of {self.meta.path!r}) does not "
                                  f"exist and missing='error' was given; with missing='fill' it reads as the fill "
                                  f"value {self.meta.fill_value!r}, as the Zarr spec says")
            return None
        if not stat.S_ISREG(st.st_mode):
            raise LayoutError(f"{path!r} is where a Zarr {what} file belongs but it is not a regular file")
        ident = self.found[path] = FileIdentity.from_stat(path, st)
        return ident

    def _listed_stat(self, path: str) -> os.stat_result | None:
        folder, _, name = path.rpartition(os.sep)
        entries = self.folders.get(folder)
        if entries is None:
            entries = self.folders[folder] = _list_folder(folder)
        if name not in entries:
            return None
        entry = entries[name]
        return os.stat(path) if entry is None else entry.stat()  # both follow a symbolic link, as a read does


def _list_folder(folder: str) -> dict[str, os.DirEntry | None]:
    """The names in ``folder``, with ``os.scandir``'s entries where they carry the ``stat``."""
    try:
        if os.name == "nt":
            with os.scandir(folder) as it:
                return {e.name: e for e in it}
        # Elsewhere an entry's stat() is a system call like os.stat, and names alone list twice as fast.
        return dict.fromkeys(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return {}  # no chunk under it was ever written
    except OSError as e:
        raise LayoutError(f"cannot list the Zarr chunk folder {folder!r}: {e}") from e


def _check_raw_size(meta: ZarrMeta, want: int | None, path: str, nbytes: int, where: str = "") -> None:
    if want is not None and nbytes != want:
        raise LayoutError(
            f"Zarr chunk file {path!r}{where} has {nbytes} bytes but {meta.meta_file!r} says an uncompressed chunk "
            f"of shape {meta.tile} and dtype {meta.dtype.str!r} takes {want}; the chunk is "
            f"{'truncated' if nbytes < want else 'longer than its metadata says'}")


class _ChunkTiles:
    """Stored chunk coords -> the chunk file's bytes (``None``: never written)."""

    def __init__(self, meta: ZarrMeta, files: _Files) -> None:
        self.meta, self.files, self.want = meta, files, meta.raw_tile_nbytes

    def __call__(self, coords: tuple[int, ...]) -> ByteRange | None:
        ident = self.files.find(coords)
        if ident is None:
            return None
        _check_raw_size(self.meta, self.want, ident.path, ident.size)
        return ByteRange(ident.path, 0, ident.size)

    def absent(self, coords: tuple[int, ...]) -> FileIdentity:
        """The chunk file never written: if it appears, the chunks reading it as fill are stale."""
        return FileIdentity.absent(self.files.path(coords))


class _ShardTiles:
    """Inner chunk coords -> its bytes inside its shard file (each shard's index read once)."""

    def __init__(self, meta: ZarrMeta, files: _Files) -> None:
        self.meta, self.files, self.want = meta, files, meta.raw_tile_nbytes
        self.indexes: dict[tuple[int, ...], tuple[str, np.ndarray] | None] = {}

    def __call__(self, coords: tuple[int, ...]) -> ByteRange | None:
        per = self.meta.shard.per_shard
        found = self._index(self._shard(coords))
        if found is None:
            return None
        path, entries = found
        off, nb = (int(v) for v in entries[tuple(c % p for c, p in zip(coords, per))])
        if off < 0:
            return None
        _check_raw_size(self.meta, self.want, path, nb, where=f" (inner chunk {coords} at offset {off})")
        return ByteRange(path, off, nb)

    def absent(self, coords: tuple[int, ...]) -> FileIdentity | None:
        """The shard file never written; else the present shard's identity, whose index says so
        (a block of inner chunks all missing reads no byte of the shard, yet depends on it)."""
        shard = self._shard(coords)
        found = self.indexes[shard]
        return FileIdentity.absent(self.files.path(shard)) if found is None else self.files.found[found[0]]

    def _shard(self, coords: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(c // p for c, p in zip(coords, self.meta.shard.per_shard))

    def _index(self, shard: tuple[int, ...]) -> tuple[str, np.ndarray] | None:
        if shard not in self.indexes:
            ident = self.files.find(shard, "shard")
            self.indexes[shard] = None if ident is None else (
                ident.path, read_shard_index(ident.path, ident.size, self.meta.shard))
        return self.indexes[shard]
