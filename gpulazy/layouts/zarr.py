"""Zarr v2 and v3 stores on local disk, v3 sharding, and OME-Zarr (NGFF 0.4/0.5) pyramids.

A store is a directory. Its metadata is read with the ``zarr`` package; every stored
chunk's file and byte range is worked out here without reading chunk data (a shard's
index is read once per shard). Dask chunks are unions of whole stored chunks (whole
shards by default when a shard fits ``config chunk_size``), so nothing is read or
decoded twice. A chunk file that does not exist reads as the array's ``fill_value``.

Uncompressed chunks that already are a dask block's elements in order become plain
byte ranges (read straight into place); compressed ones become one ``Tile`` per stored
chunk with codec steps such as ``(Codec("zstd"),)`` that ``gpulazy.codecs`` decodes (in
batches on the GPU where nvCOMP can).

Options: ``path=`` (or ``array=``) picks an array or a multiscale group inside the
store (``path="labels/cells"``); ``chunks=`` as in ``from_files``.

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
from gpulazy.spec import ByteRange, ChunkSpec

__all__ = ["ZarrLayout"]

_META_FILES = ("zarr.json", ".zarray", ".zgroup")
#: More stored chunks than this is metadata no graph can hold (and corrupt metadata can
#: claim any shape): refuse it rather than spend minutes listing chunks.
MAX_CHUNKS = 1 << 24
#: A stored chunk decodes whole into memory; past this its metadata is not believed.
MAX_CHUNK_BYTES = 1 << 34


class ZarrLayout(Layout):
    """Zarr v2/v3 arrays and groups (a directory, or its ``zarr.json``/``.zarray``/``.zgroup``).

    A group opens its OME-Zarr full resolution (dataset 0 of the first multiscale), or
    its only array; ``levels`` gives every level of the pyramid.

    Options (of ``index`` and ``levels``): ``chunks`` (dask-style; each block edge moves
    up to a stored chunk's edge), ``path`` or ``array`` (an array or multiscale group
    inside the store, ``"labels/cells"``), and ``dtype``/``shape``/``order``, which
    must match the store's when given.
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
                 offset: int = 0, **unknown: Any) -> list[Index]:
        if unknown:
            raise TypeError(f"the zarr layout got unexpected options {sorted(unknown)}; it takes chunks=, path= "
                            "(or array=), dtype=, shape=, order=")
        root = _root(paths)
        if offset:
            raise LayoutError(f"Zarr stores carry their own metadata; offset={offset!r} cannot be used with {root!r}")
        out = []
        for node_dir, arr, extra in _arrays(root, _sub_path(path, array), first_only=first_only):
            meta = _read_meta(arr, node_dir)
            _check_requested(meta, dtype, shape, order)
            out.append(_index(meta, chunks, {**_array_attrs(arr, meta), **extra}))
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

def _index(meta: ZarrMeta, chunks: Any, attrs: dict) -> Index:
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
        files = _Files()
        tile_at = _ShardTiles(meta, files) if meta.shard is not None else _ChunkTiles(meta, files)
        specs = grid_specs(meta.shape, tile, norm, dtype=meta.dtype, tile_at=tile_at, codec=meta.codec,
                           fill_value=meta.fill_value, order=meta.order, identity=files.identity)
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
    """``os.stat`` of each chunk or shard file, once: its size, or ``None`` when it was never written."""

    def __init__(self) -> None:
        self.stats: dict[str, os.stat_result | None] = {}

    def size(self, path: str) -> int | None:
        if path not in self.stats:
            try:
                self.stats[path] = os.stat(path)
            except FileNotFoundError:
                self.stats[path] = None
            except OSError as e:
                raise LayoutError(f"cannot read the Zarr chunk file {path!r}: {e}") from e
        st = self.stats[path]
        return None if st is None else st.st_size

    def identity(self, path: str) -> tuple[str, int, int]:
        st = self.stats[path]
        return (path, st.st_size, st.st_mtime_ns)


def _chunk_path(meta: ZarrMeta, coords: Sequence[int]) -> str:
    return os.path.join(meta.path, *meta.chunk_key(coords).split("/"))


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
        path = _chunk_path(self.meta, coords)
        size = self.files.size(path)
        if size is None:
            return None
        _check_raw_size(self.meta, self.want, path, size)
        return ByteRange(path, 0, size)


class _ShardTiles:
    """Inner chunk coords -> its bytes inside its shard file (each shard's index read once)."""

    def __init__(self, meta: ZarrMeta, files: _Files) -> None:
        self.meta, self.files, self.want = meta, files, meta.raw_tile_nbytes
        self.indexes: dict[tuple[int, ...], tuple[str, np.ndarray] | None] = {}

    def __call__(self, coords: tuple[int, ...]) -> ByteRange | None:
        per = self.meta.shard.per_shard
        shard = tuple(c // p for c, p in zip(coords, per))
        found = self._index(shard)
        if found is None:
            return None
        path, entries = found
        off, nb = (int(v) for v in entries[tuple(c % p for c, p in zip(coords, per))])
        if off < 0:
            return None
        _check_raw_size(self.meta, self.want, path, nb, where=f" (inner chunk {coords} at offset {off})")
        return ByteRange(path, off, nb)

    def _index(self, shard: tuple[int, ...]) -> tuple[str, np.ndarray] | None:
        if shard not in self.indexes:
            path = _chunk_path(self.meta, shard)
            size = self.files.size(path)
            self.indexes[shard] = None if size is None else (path, read_shard_index(path, size, self.meta.shard))
        return self.indexes[shard]
