"""Zarr array metadata (v2 ``.zarray``, v3 ``zarr.json``) as what a chunk read needs.

zarr-python parses and validates the metadata; this module turns its spec-level JSON
(``metadata.to_dict()``, the form the Zarr specifications define, stable across
zarr-python releases) into a ``ZarrMeta``: the stored chunk grid, the file's dtype with
its byte order, the element order, the codec pipeline as ``gpulazy.spec.Codec`` steps in
*decode* order, the chunk key encoding and, for v3 ``sharding_indexed``, the shard index.

Codec ids are numcodecs' (what ``gpulazy.codecs`` decodes), so a v2 compressor or
filter maps one to one and a v3 codec by its numcodecs name (``zstd``, ``gzip``,
``blosc``, ``numcodecs.<id>``); ``crc32c`` is gpulazy's own step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from gpulazy.errors import LayoutError
from gpulazy.layouts._common import check_dtype
from gpulazy.spec import Codec

__all__ = ["ZarrMeta", "ShardMeta", "meta_from_dict"]

#: Parameters that only steer encoding: dropped so equal data decodes under one codec
#: value (one chunk key) and the GPU decoder sees a plain ``Codec("zstd")``.
_ENCODE_ONLY = {
    "zstd": {"level", "checksum"},
    "gzip": {"level"},
    "zlib": {"level"},
    "bz2": {"level"},
    "lz4": {"acceleration"},
    "blosc": {"cname", "clevel", "shuffle", "blocksize", "typesize"},  # blosc's header carries them
}
_BLOSC_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
_EMPTY = ()


@dataclass(frozen=True)
class ShardMeta:
    """A v3 ``sharding_indexed`` codec: inner chunks and where the shard index is."""

    inner: tuple[int, ...]          # inner chunk shape
    per_shard: tuple[int, ...]      # inner chunks per shard, per axis
    index_at_end: bool
    index_endian: str               # "<" or ">"
    index_crc32c: bool

    @property
    def index_nbytes(self) -> int:
        return 16 * math.prod(self.per_shard) + (4 if self.index_crc32c else 0)


@dataclass(frozen=True)
class ZarrMeta:
    """One Zarr array as gpulazy reads it.

    ``chunks`` is the stored chunk grid (the shard shape when sharded); ``tile`` is the
    shape each stored piece decodes to (the inner chunk shape when sharded).
    """

    path: str                       # the array's directory
    meta_file: str                  # its zarr.json / .zarray
    zarr_format: int
    shape: tuple[int, ...]
    dtype: np.dtype                 # byte order as stored
    chunks: tuple[int, ...]
    order: str
    codec: tuple[Codec, ...] | None
    fill_value: Any
    key_prefix: str | None          # "c" for v3 default keys, None for v2-style keys
    key_separator: str
    shard: ShardMeta | None = None
    dimension_names: tuple[str, ...] | None = None

    @property
    def tile(self) -> tuple[int, ...]:
        return self.shard.inner if self.shard is not None else self.chunks

    def chunk_key(self, coords: Sequence[int]) -> str:
        """The store key of stored chunk ``coords`` (Zarr's chunk key encodings)."""
        parts = [str(c) for c in coords]
        if self.key_prefix is not None:
            return self.key_separator.join([self.key_prefix, *parts])
        return self.key_separator.join(parts) if parts else "0"

    @property
    def raw_tile_nbytes(self) -> int | None:
        """Stored size of a piece when the pipeline keeps sizes fixed (raw, crc32c); else None."""
        steps = self.codec or _EMPTY
        if any(c.id != "crc32c" for c in steps):
            return None
        return math.prod(self.tile) * self.dtype.itemsize + 4 * len(steps)

    def describe_codec(self) -> str:
        names = [c.id for c in self.codec or _EMPTY]
        text = "+".join(names) if names else "none"
        return f"sharding_indexed({text})" if self.shard is not None else text


def meta_from_dict(d: Mapping[str, Any], *, dtype: Any, fill_value: Any, path: str, meta_file: str) -> ZarrMeta:
    """A ``ZarrMeta`` from a zarr-python ``metadata.to_dict()``; ``LayoutError`` naming ``meta_file``."""
    try:
        fmt = int(d["zarr_format"])
        shape = tuple(int(n) for n in d["shape"])
        if fmt == 2:
            return _v2(d, shape, dtype, fill_value, path, meta_file)
        if fmt == 3:
            return _v3(d, shape, dtype, fill_value, path, meta_file)
        raise LayoutError(f"{meta_file!r}: unknown zarr_format {fmt!r} (gpulazy reads Zarr v2 and v3)")
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        if isinstance(e, LayoutError):
            raise
        raise LayoutError(f"cannot interpret the Zarr metadata in {meta_file!r}: {type(e).__name__}: {e}") from e


# -- v2 -------------------------------------------------------------------------------------

def _v2(d: Mapping[str, Any], shape: tuple[int, ...], dtype: Any, fill_value: Any, path: str,
        meta_file: str) -> ZarrMeta:
    dt = _dtype(dtype, meta_file)
    chunks = _chunk_shape(d["chunks"], shape, meta_file)
    order = d.get("order") or "C"
    if order not in ("C", "F"):
        raise LayoutError(f"{meta_file!r}: order must be 'C' or 'F', not {order!r}")
    steps = []
    if d.get("compressor"):
        steps.append(_numcodecs_step(d["compressor"]))
    steps += [_numcodecs_step(f) for f in reversed(d.get("filters") or ())]  # filters decode last-first
    sep = d.get("dimension_separator") or "."
    return ZarrMeta(path, meta_file, 2, shape, dt, chunks, order, tuple(steps) or None,
                    _fill(fill_value, dt), None, sep)


def _numcodecs_step(config: Mapping[str, Any]) -> Codec:
    params = {k: v for k, v in config.items() if k != "id"}
    return _codec(str(config["id"]), params)


def _codec(cid: str, params: Mapping[str, Any]) -> Codec:
    drop = _ENCODE_ONLY.get(cid, ())
    return Codec.of(cid, **{k: v for k, v in params.items() if k not in drop})


# -- v3 -------------------------------------------------------------------------------------

def _v3(d: Mapping[str, Any], shape: tuple[int, ...], dtype: Any, fill_value: Any, path: str,
        meta_file: str) -> ZarrMeta:
    if d.get("storage_transformers"):
        raise LayoutError(f"{meta_file!r}: storage transformers {list(d['storage_transformers'])!r} are not "
                          "supported")
    grid = d["chunk_grid"]
    if grid.get("name") != "regular":
        raise LayoutError(f"{meta_file!r}: chunk grid {grid.get('name')!r} is not supported (only 'regular')")
    chunks = _chunk_shape(grid["configuration"]["chunk_shape"], shape, meta_file)
    enc = d.get("chunk_key_encoding") or {"name": "default"}
    conf = enc.get("configuration") or {}
    if enc.get("name") == "default":
        prefix, sep = "c", conf.get("separator", "/")
    elif enc.get("name") == "v2":
        prefix, sep = None, conf.get("separator", ".")
    else:
        raise LayoutError(f"{meta_file!r}: chunk key encoding {enc.get('name')!r} is not supported "
                          "(only 'default' and 'v2')")
    if sep not in ("/", "."):
        raise LayoutError(f"{meta_file!r}: chunk key separator {sep!r} is not '/' or '.'")
    pipe = _Pipeline.parse(d["codecs"], len(shape), meta_file)
    shard = None
    if pipe.sharding is not None:
        if pipe.order != "C" or pipe.steps:
            raise LayoutError(f"{meta_file!r}: codecs around 'sharding_indexed' other than plain 'bytes' are not "
                              "supported; put them inside the sharding codec")
        shard, pipe = _sharding(pipe.sharding, chunks, meta_file)
    dt = _dtype(dtype, meta_file)
    if dt.itemsize > 1:
        dt = dt.newbyteorder(pipe.endian)
    names = d.get("dimension_names")
    dims = tuple(names) if names and all(isinstance(n, str) for n in names) else None
    return ZarrMeta(path, meta_file, 3, shape, dt, chunks, pipe.order, pipe.steps or None, _fill(fill_value, dt),
                    prefix, sep, shard, dims)


@dataclass
class _Pipeline:
    """A v3 codec list read in its three stages: array->array, array->bytes, bytes->bytes."""

    order: str = "C"
    endian: str = "<"
    steps: tuple[Codec, ...] = ()     # decode order
    sharding: Mapping[str, Any] | None = None

    @classmethod
    def parse(cls, codecs: Sequence[Mapping[str, Any]], ndim: int, meta_file: str) -> _Pipeline:
        out = cls()
        perm = list(range(ndim))
        array_steps: list[Codec] = []
        serializer_seen = False
        bytes_steps: list[Codec] = []
        for c in codecs:
            name, conf = c["name"], c.get("configuration") or {}
            if not serializer_seen:
                if name == "transpose":
                    if array_steps:
                        raise LayoutError(f"{meta_file!r}: a 'transpose' after an array filter is not supported")
                    perm = [perm[int(i)] for i in conf["order"]]
                elif name == "bytes":
                    out.endian = "<" if conf.get("endian", "little") == "little" else ">"
                    serializer_seen = True
                elif name == "sharding_indexed":
                    out.sharding = conf
                    serializer_seen = True
                else:  # an array->array numcodecs filter (delta, fixedscaleoffset, ...)
                    array_steps.append(_v3_codec(name, conf))
            else:
                bytes_steps.append(_v3_codec(name, conf))
        if not serializer_seen:
            raise LayoutError(f"{meta_file!r}: the codec list has no 'bytes' or 'sharding_indexed' serializer")
        out.order = _order_of(perm, meta_file)
        if array_steps and out.endian == ">":
            # Array filters run on native-order values; gpulazy swaps bytes after the whole pipeline.
            raise LayoutError(f"{meta_file!r}: array filters {[s.id for s in array_steps]} on a big-endian "
                              "'bytes' codec are not supported")
        out.steps = tuple(reversed(bytes_steps)) + tuple(reversed(array_steps))
        return out


def _v3_codec(name: str, conf: Mapping[str, Any]) -> Codec:
    if name == "crc32c":
        return Codec("crc32c")
    if name == "blosc":
        conf = dict(conf, shuffle=_BLOSC_SHUFFLE.get(conf.get("shuffle"), conf.get("shuffle")))
    return _codec(name.removeprefix("numcodecs."), conf)


def _order_of(perm: Sequence[int], meta_file: str) -> str:
    if list(perm) == sorted(perm):
        return "C"
    if list(perm) == sorted(perm, reverse=True):
        return "F"
    raise LayoutError(f"{meta_file!r}: transpose order {list(perm)} is neither C nor F order; gpulazy reads "
                      "only identity or fully reversed transposes")


def _sharding(conf: Mapping[str, Any], shard: tuple[int, ...], meta_file: str) -> tuple[ShardMeta, _Pipeline]:
    inner = _chunk_shape(conf["chunk_shape"], shard, meta_file)
    if any(s % i for s, i in zip(shard, inner)):
        raise LayoutError(f"{meta_file!r}: shard shape {shard} is not a multiple of the inner chunk shape {inner}")
    pipe = _Pipeline.parse(conf.get("codecs") or [{"name": "bytes"}], len(shard), meta_file)
    if pipe.sharding is not None:
        raise LayoutError(f"{meta_file!r}: nested 'sharding_indexed' codecs are not supported")
    index = _Pipeline.parse(conf.get("index_codecs") or [{"name": "bytes"}, {"name": "crc32c"}], len(shard) + 1,
                            meta_file)
    if index.order != "C" or index.sharding is not None or any(s.id != "crc32c" for s in index.steps) \
            or len(index.steps) > 1:
        raise LayoutError(f"{meta_file!r}: shard index codecs {conf.get('index_codecs')!r} are not supported "
                          "(only 'bytes' optionally followed by 'crc32c')")
    location = conf.get("index_location", "end")
    if location not in ("start", "end"):
        raise LayoutError(f"{meta_file!r}: shard index_location {location!r} is not 'start' or 'end'")
    per_shard = tuple(s // i for s, i in zip(shard, inner))
    return ShardMeta(inner, per_shard, location == "end", index.endian, bool(index.steps)), pipe


# -- shared ---------------------------------------------------------------------------------

def _chunk_shape(chunks: Sequence[Any], shape: tuple[int, ...], meta_file: str) -> tuple[int, ...]:
    out = tuple(int(c) for c in chunks)
    if len(out) != len(shape) or any(c < 1 for c in out):
        raise LayoutError(f"{meta_file!r}: chunk shape {list(chunks)} does not fit an array of shape {shape} "
                          "(one positive length per axis)")
    return out


def _dtype(dtype: Any, meta_file: str) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise LayoutError(f"{meta_file!r}: data type {dtype!r} has no NumPy dtype: {e}") from e
    return check_dtype(dt, what=f"data type of {meta_file!r}")


def _fill(value: Any, dt: np.dtype) -> Any:
    # A Python scalar: hashable, picklable, a stable repr in the chunk key. zarr-python
    # reads the chunks of a v2 array whose fill_value is null as zeros.
    if value is None:
        return 0
    return np.asarray(value).astype(dt.newbyteorder("=")).item()
