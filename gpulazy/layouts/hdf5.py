"""HDF5 datasets: byte offsets from h5py's metadata, never a data read through h5py.

h5py (the HDF5 library) is asked only where things are: a contiguous dataset's offset,
a chunked dataset's chunk index (``chunk_iter``: grid position, byte offset, size and
filter mask of every allocated chunk) and its filter pipeline. The bytes are then read
by gpulazy's own backends, and filtered chunks decoded by ``gpulazy.codecs``:

=========================  ===============================================
HDF5 filter (id)           decoded as
=========================  ===============================================
deflate / gzip (1)         ``zlib`` (numcodecs; nvCOMP on a GPU)
shuffle (2)                ``shuffle`` with the filter's element size
fletcher32 (3)             ``fletcher32`` (checksum verified, then stripped)
szip (4)                   ``imagecodecs_szip`` (libaec)
lzf (32000)                ``imagecodecs_lzf``
blosc (32001)              ``blosc`` (numcodecs)
lz4 (32004)                ``imagecodecs_lz4h5`` (HDF5's own lz4 framing)
bitshuffle + lz4 (32008)   ``bitshuffle_lz4`` (``gpulazy.codecs.bitshuffle``; nvCOMP on a GPU)
zstd (32015)               ``zstd``
=========================  ===============================================

Any other filter (nbit, scale-offset, bitshuffle without LZ4, blosc2, zfp, ...) is refused at
index time, naming the file, the dataset and the filter. A chunk stored with an optional
filter skipped (HDF5 does so when e.g. lzf or blosc would grow it) decodes without that
step; as a block's tiles share one codec, a dataset with such chunks gets one stored chunk
per block by default (and a ``chunks=`` that would mix them is refused). Edge chunks that
``H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS`` left unfiltered are read raw. Unallocated chunks
read as the dataset's fill value. Several files holding the same dataset (name, shape,
dtype, chunking, filters and fill value) stack along a new axis 0.

>>> import h5py, numpy as np, tempfile, os
>>> from gpulazy import layouts
>>> p = os.path.join(tempfile.mkdtemp(), "run.h5")
>>> with h5py.File(p, "w") as f:
...     _ = f.create_dataset("entry/data", data=np.arange(12, dtype="u2").reshape(3, 4), chunks=(2, 2))
>>> ix = layouts.index(p, dataset="/entry/data")
>>> ix.layout, ix.shape, ix.dtype, ix.attrs["stored_chunks"]
('hdf5', (3, 4), dtype('uint16'), (2, 2))
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from gpulazy.errors import LayoutError
from gpulazy.layouts._base import Index, Layout
from gpulazy.layouts._common import FileEntry, FileStack, check_dtype, check_shape, slab_sizes
from gpulazy.spec import ByteRange, ChunkSpec, Codec, file_identity

__all__ = ["Hdf5Layout", "Hdf5Dataset", "describe", "image_datasets"]

_SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: The superblock may follow a user block of 512, 1024, 2048, ... bytes; probe that far.
_MAX_USERBLOCK = 1 << 24
_MAX_LISTED = 40
#: Every stored chunk becomes a ``Tile``; beyond this many, indexing takes minutes and gigabytes.
_MAX_STORED_CHUNKS = 20_000_000

_H5_FILTERS = {  # id: name, for messages (https://github.com/HDFGroup/hdf5_plugins registry)
    1: "deflate", 2: "shuffle", 3: "fletcher32", 4: "szip", 5: "nbit", 6: "scaleoffset",
    307: "bzip2", 32000: "lzf", 32001: "blosc", 32004: "lz4", 32008: "bitshuffle", 32013: "zfp",
    32015: "zstd", 32017: "sz", 32018: "fcidecomp", 32026: "blosc2", 32028: "sz3",
}
_SUPPORTED = "deflate/gzip, shuffle, fletcher32, szip, lzf, blosc, lz4, bitshuffle+lz4, zstd"


@dataclass(frozen=True)
class Hdf5Dataset:
    """Where one file's dataset lives (what ``describe`` found; no data read).

    ``storage`` is ``"contiguous"``, ``"chunked"`` or ``"unallocated"`` (never written:
    all fill value). ``table`` maps a stored-chunk grid index to ``(offset, nbytes,
    filter_mask)`` for every allocated chunk; ``filters`` is the pipeline in write order
    as ``(filter_id, cd_values)``.
    """

    path: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    storage: str
    offset: int | None = None
    chunks: tuple[int, ...] | None = None
    filters: tuple[tuple[int, tuple[int, ...]], ...] = ()
    table: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    fill_value: Any = 0
    _codecs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def codec(self, mask: int = 0) -> tuple[Codec, ...] | None:
        """Decode steps of a chunk stored with filter ``mask`` (bit i: filter i skipped)."""
        if mask not in self._codecs:
            steps = [_filter_codec(fid, cd, self) for i, (fid, cd) in enumerate(self.filters)
                     if not mask >> i & 1]
            self._codecs[mask] = tuple(reversed(steps)) or None
        return self._codecs[mask]


class Hdf5Layout(Layout):
    """HDF5 files. ``dataset=`` names the dataset (optional when the file holds one array).

    ``dtype`` and ``shape`` may be given; they must match the dataset's.
    """

    name = "hdf5"
    extensions = (".h5", ".hdf5", ".hdf", ".he5", ".nxs")

    @classmethod
    def guess_can_open(cls, path: str) -> bool:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                at = 0
                while at + len(_SIGNATURE) <= min(size, _MAX_USERBLOCK):
                    f.seek(at)
                    if f.read(len(_SIGNATURE)) == _SIGNATURE:
                        return True
                    at = 512 if at == 0 else at * 2
        except (OSError, ValueError):
            return False
        return False

    def index(self, paths: Sequence[str], *, dataset: str | None = None, chunks: Any = None, dtype: Any = None,
              shape: Any = None, stack: bool | None = None, **unknown: Any) -> Index:
        """The ``Index`` of ``dataset`` in each of ``paths`` (stacked along axis 0 when several).

        Parameters
        ----------
        dataset
            Path of the dataset in the file (``"/entry/data"``); optional when the file
            holds exactly one numeric array dataset.
        chunks
            Dask-style chunks. Contiguous data: any chunking (default: slabs of about
            ``config chunk_size``). Chunked data: each block is moved out to whole stored
            chunks (default: about ``config chunk_size`` of them).
        dtype, shape
            Optional: checked against the dataset's (``LayoutError`` if they differ).
        stack
            Stack along a new axis 0 (``layouts.index`` passes ``True`` for a folder, glob or
            list, even of one file); ``None``: when there are several files.
        """
        if unknown:
            raise TypeError(f"the hdf5 layout got unexpected options {sorted(unknown)} (it takes dataset=, "
                            "chunks=, and dtype=/shape= to check)")
        found = [describe(p, dataset) for p in paths]
        stacked = stack if stack is not None else len(found) > 1
        first = found[0]
        for d in found[1:]:
            _check_same(d, first)
        _check_requested(first, dtype, shape)
        if all(d.storage == "contiguous" for d in found) or math.prod(first.shape) == 0:
            # No stored chunks to respect (or no elements at all): plain ranges, any chunking.
            files = tuple(FileEntry(d.path, d.offset or 0, file_identity(d.path)) for d in found)
            ix = FileStack(files, first.shape, first.dtype, "C", stacked=stacked).index(chunks, layout=self.name)
        else:
            ix = _grid_index(found, chunks, self.name, stacked)
        return dataclasses.replace(ix, attrs=_attrs(first))


# -- reading the metadata -----------------------------------------------------------------------

def describe(path: str, dataset: str | None = None) -> Hdf5Dataset:
    """Where ``dataset`` of the HDF5 file ``path`` is stored; ``LayoutError`` naming the file if anything is off."""
    try:
        import h5py
    except ImportError as e:  # a core dependency, but say so plainly if it is gone
        from gpulazy.errors import missing_dependency

        raise missing_dependency("h5py", "all", "reading HDF5 files") from e
    f = _open(h5py, path)
    try:
        with f:
            dset = _pick(f, path, dataset)
            # An external link leads to a dataset of another file: its offsets are in that file.
            data_path = _target_file(dset, path)
            return _storage(dset, data_path, os.path.getsize(data_path))
    except LayoutError:
        raise
    except Exception as e:  # a corrupt object header or chunk index fails anywhere inside HDF5
        where = f" dataset {dataset!r} of" if dataset else ""
        raise LayoutError(f"cannot read the metadata of{where} {path!r} ({type(e).__name__}: {e}); "
                          "the file is corrupt or truncated") from e


def image_datasets(path: str) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """``(name, shape, dtype)`` of every image-like dataset of ``path``, largest first.

    Image-like: numeric, at least 2-D, with planes of more than one row and column (a
    viewer shows these; 1-D axis arrays, scalars and tables are left out). Only metadata
    is read. ``LayoutError`` naming the file if it cannot be opened.
    """
    import h5py

    with _open(h5py, path) as f:
        found = [(d.name, tuple(int(n) for n in d.shape), d.dtype) for d in _datasets(f)
                 if _is_numeric_array(d) and len(d.shape) >= 2 and min(d.shape[-2:]) > 1]
    return sorted(found, key=lambda t: -math.prod(t[1]) * t[2].itemsize)


def _open(h5py: Any, path: str) -> Any:
    try:
        try:
            return h5py.File(path, "r")
        except OSError as e:
            # HDF5 shares one handle per file in a process: match the locking of a caller's open
            # h5py.File, or read where locks fail (some network file systems).
            if "lock" not in str(e).lower():
                raise
            return h5py.File(path, "r", locking=False)
    except Exception as e:  # h5py raises OSError, but corrupt files reach other types too
        raise LayoutError(f"cannot open {path!r} as an HDF5 file ({type(e).__name__}: {e}); "
                          "it is truncated, corrupt or not HDF5") from e


def _pick(f: Any, path: str, dataset: str | None) -> Any:
    import h5py

    if dataset is None:
        arrays = [d for d in _datasets(f) if _is_numeric_array(d)]
        if len(arrays) == 1:
            return arrays[0]
        what = "no numeric array dataset" if not arrays else f"{len(arrays)} numeric array datasets"
        raise LayoutError(f"{path!r} holds {what}; pass dataset= naming one (gpulazy info: --dataset NAME). "
                          f"Datasets: {_listing(f)}")
    obj = f.get(dataset)
    if obj is None:
        raise LayoutError(f"{path!r} has no dataset {dataset!r}; datasets there: {_listing(f)}")
    if not isinstance(obj, h5py.Dataset):
        raise LayoutError(f"{dataset!r} in {path!r} is a {type(obj).__name__.lower()}, not a dataset; "
                          f"datasets there: {_listing(f)}")
    return obj


def _target_file(d: Any, path: str) -> str:
    target = d.file.filename
    if os.path.exists(target) and os.path.samefile(target, path):
        return path
    return target


def _datasets(f: Any) -> list[Any]:
    import h5py

    out: list[Any] = []
    f.visititems(lambda name, obj: out.append(obj) if isinstance(obj, h5py.Dataset) else None)
    return out


def _is_numeric_array(d: Any) -> bool:
    return d.shape is not None and len(d.shape) > 0 and d.dtype.kind in "biufc" and d.dtype.fields is None


def _listing(f: Any) -> str:
    items = [f"{d.name} {d.shape} {d.dtype}" for d in _datasets(f)]
    if not items:
        return "(none)"
    more = f", ... ({len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return ", ".join(items[:_MAX_LISTED]) + more


def _storage(d: Any, path: str, size: int) -> Hdf5Dataset:
    import h5py

    name = d.name
    where = f"dataset {name!r} of {path!r}"
    if d.shape is None:
        raise LayoutError(f"{where} has a null dataspace (no elements, no shape); nothing to read")
    dtype = check_dtype(d.dtype, what=f"the dtype of {where}")
    shape = tuple(int(n) for n in d.shape)
    nbytes = math.prod(shape) * dtype.itemsize
    dcpl = d.id.get_create_plist()
    kind = dcpl.get_layout()
    base = dict(path=path, name=name, shape=shape, dtype=dtype, fill_value=_fill(d, dcpl))
    if kind == h5py.h5d.COMPACT:
        raise LayoutError(f"{where} is stored compact (inside the file's metadata), which has no byte range "
                          "to read; it is small (under 64 KiB): read it with h5py (h5py.File(path)[name][()])")
    if kind == h5py.h5d.VIRTUAL:
        sources = sorted({dcpl.get_virtual_filename(i) for i in range(dcpl.get_virtual_count())})
        raise LayoutError(f"{where} is a virtual dataset (its data lives in {len(sources)} other file(s): "
                          f"{sources[:5]}); index those source files and datasets directly")
    if dcpl.get_external_count():
        ext = [(os.fsdecode(n), int(o), int(s)) for n, o, s in
               (dcpl.get_external(i) for i in range(dcpl.get_external_count()))]
        raise LayoutError(f"{where} keeps its data in external file(s) (name, offset, size): {ext}; read "
                          f"such a file as raw binary: from_files(name, dtype={dtype.str!r}, shape={shape}, "
                          "offset=offset)")
    unallocated = d.id.get_space_status() == h5py.h5d.SPACE_STATUS_NOT_ALLOCATED
    if kind == h5py.h5d.CONTIGUOUS:
        if unallocated or nbytes == 0:
            return Hdf5Dataset(storage="unallocated", **base)
        offset = int(d.id.get_offset())
        _check_inside(where, offset, nbytes, size, "its data")
        return Hdf5Dataset(storage="contiguous", offset=offset, **base)
    chunks = tuple(int(c) for c in d.chunks)
    filters = tuple((int(fid), tuple(int(v) for v in cd)) for fid, _, cd, _ in
                    (dcpl.get_filter(i) for i in range(dcpl.get_nfilters())))
    ds = Hdf5Dataset(storage="chunked", chunks=chunks, filters=filters, **base)
    ds.codec(0)  # refuse unsupported filters now, before reading the chunk index
    if not unallocated:
        from gpulazy.layouts._limits import check_stored_chunks

        check_stored_chunks(shape, chunks, dtype)  # before a row per chunk of the index
    table = {} if unallocated else _chunk_table(d, where, shape, chunks, size)
    if filters and _partial_chunks_unfiltered(dcpl):
        # H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS: edge chunks are stored raw, yet their filter mask
        # says 0; mark every filter skipped so they are not "decoded" (a shuffle would be silent).
        skipped = (1 << len(filters)) - 1
        table = {idx: (o, n, skipped if _is_partial(idx, shape, chunks) else m) for idx, (o, n, m) in table.items()}
    _check_chunk_sizes(ds, table, where)
    return dataclasses.replace(ds, table=table)


def _partial_chunks_unfiltered(dcpl: Any) -> bool:
    """Whether the dataset was made with ``H5Pset_chunk_opts(H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS)``.

    h5py does not wrap ``H5Pget_chunk_opts``; call it in the HDF5 library h5py loaded (found
    through its extension module). Where that fails (HDF5 1.8 has no such option; Windows
    does not resolve symbols through dependencies) the answer is "no": a raw edge chunk then
    fails to decode loudly unless the only filters are shuffle/fletcher32.
    """
    import ctypes

    import h5py

    try:
        fn = ctypes.CDLL(h5py.h5p.__file__).H5Pget_chunk_opts
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_uint)]  # hid_t is 64-bit since HDF5 1.10
    fn.restype = ctypes.c_int
    opts = ctypes.c_uint(0)
    return fn(dcpl.id, ctypes.byref(opts)) >= 0 and bool(opts.value & 0x2)


def _is_partial(idx: tuple[int, ...], shape: tuple[int, ...], chunks: tuple[int, ...]) -> bool:
    return any((i + 1) * c > n for i, c, n in zip(idx, chunks, shape))


def _fill(d: Any, dcpl: Any) -> Any:
    import h5py

    # Ask first whether a fill value was set: HDF5 checks the fill-value message here and raises
    # on a corrupt one, where fetching the value (H5Pget_fill_value) was seen to crash instead.
    if dcpl.fill_value_defined() != h5py.h5d.FILL_VALUE_USER_DEFINED:
        return 0  # the default fill value is zeros (and "undefined" reads as zeros in h5py too)
    v = d.fillvalue
    return v.item() if isinstance(v, np.generic) else v


def _check_inside(where: str, offset: int, nbytes: int, size: int, what: str) -> None:
    if offset < 0 or offset + nbytes > size:
        raise LayoutError(f"{what} of {where} (bytes {offset} to {offset + nbytes}) lie beyond the end of the "
                          f"file ({size} bytes); the file is truncated or corrupt")


def _chunk_table(d: Any, where: str, shape: tuple[int, ...], chunks: tuple[int, ...], size: int
                 ) -> dict[tuple[int, ...], tuple[int, int, int]]:
    """``{grid index: (offset, nbytes, filter_mask)}`` of every allocated chunk, checked."""
    rows: list[tuple] = []

    def add(info: Any) -> None:  # runs once per chunk: collect now, check in bulk below
        if info.chunk_offset is not None and info.byte_offset is not None:
            rows.append((*info.chunk_offset, info.byte_offset, info.size, info.filter_mask))

    if hasattr(d.id, "chunk_iter"):  # one pass over the index (HDF5 >= 1.12.3 / 1.14)
        d.id.chunk_iter(add)
    else:  # get_chunk_info(i) walks the index for each i: slower, same answer
        for i in range(d.id.get_num_chunks()):
            add(d.id.get_chunk_info(i))
    ndim = len(chunks)
    if not rows:
        return {}
    if any(len(r) != ndim + 3 for r in rows):
        raise LayoutError(f"the chunk index of {where} lists chunks of another rank than the dataset's "
                          f"{ndim}; the file is corrupt")
    table = np.array(rows, dtype=np.int64).reshape(len(rows), ndim + 3)
    start, offset, nbytes = table[:, :ndim], table[:, ndim], table[:, ndim + 1]
    idx = start // np.array(chunks, dtype=np.int64)
    grid = np.array([-(-n // c) for n, c in zip(shape, chunks)], dtype=np.int64)
    bad = ((start % np.array(chunks, dtype=np.int64)).any(axis=1) | (idx < 0).any(axis=1)
           | (idx >= grid).any(axis=1))
    if bad.any():
        at = tuple(start[np.argmax(bad)].tolist())
        raise LayoutError(f"the chunk index of {where} lists a chunk at {at}, which is not a chunk of a "
                          f"{shape} array in {chunks} chunks; the file is corrupt")
    beyond = (offset < 0) | (nbytes < 0) | (offset + nbytes > size)
    if beyond.any():
        i = int(np.argmax(beyond))
        _check_inside(where, int(offset[i]), int(nbytes[i]), size, f"the chunk at {tuple(start[i].tolist())}")
    keys = list(map(tuple, idx.tolist()))
    out = dict(zip(keys, map(tuple, table[:, ndim:].tolist())))
    if len(out) != len(keys):
        raise LayoutError(f"the chunk index of {where} lists a chunk twice; the file is corrupt")
    _check_found(d, where, start)
    return out


def _check_found(d: Any, where: str, start: np.ndarray) -> None:
    """Refuse a chunk the index lists that HDF5's own reads cannot find.

    ``chunk_iter`` walks every leaf of the chunk index; ``H5Dread`` (h5py's reads) finds a chunk by
    looking its coordinates up from the root. A damaged key (found by fuzzing: in a leaf, or inside
    the index) leaves a chunk listed that the lookup misses, so h5py reads the fill value there
    while gpulazy would read the chunk's bytes: the data as written, or data from another place.
    Each listed chunk is looked up as the reads look it up (``read_direct_chunk``, whose storage-size
    lookup is ``H5Dread``'s) with a one-byte buffer: a chunk found is too big for it and nothing is
    read. About 4 us a chunk (8,000 chunks: 35 ms, beside 9 ms of ``chunk_iter``).
    """
    probe = np.empty(1, np.uint8)
    lookup = d.id.read_direct_chunk
    for row in start.tolist():
        at = tuple(row)
        try:
            lookup(at, out=probe)
        except ValueError:  # found: "out buffer is only 1 bytes, N bytes required"
            continue
        except Exception as e:
            raise LayoutError(f"the chunk index of {where} lists a chunk at {at} that HDF5's own lookup does not "
                              f"find there ({e}); h5py reads the fill value where gpulazy would read that chunk's "
                              "bytes: the index is damaged, the file is corrupt") from None


def _check_chunk_sizes(ds: Hdf5Dataset, table: dict, where: str) -> None:
    """A chunk stored without filters must hold exactly one chunk's bytes."""
    want = math.prod(ds.chunks or ()) * ds.dtype.itemsize
    raw = {mask: ds.codec(mask) is None for mask in {m for _, _, m in table.values()}}
    for idx, (offset, nbytes, mask) in table.items():
        if raw[mask] and nbytes != want:
            raise LayoutError(f"the unfiltered chunk {idx} of {where} at offset {offset} holds {nbytes} bytes, "
                              f"expected {want} (chunk shape {ds.chunks} of {ds.dtype.str!r}); the file is corrupt")


def _filter_codec(fid: int, cd: tuple[int, ...], ds: Hdf5Dataset) -> Codec:
    """The gpulazy codec decoding HDF5 filter ``fid``, or a ``LayoutError`` saying why not."""
    chunk_nbytes = math.prod(ds.chunks or ()) * ds.dtype.itemsize
    if fid == 1:
        codec = Codec.of("zlib")
    elif fid == 2:
        codec = Codec.of("shuffle", elementsize=cd[0] if cd else ds.dtype.itemsize)
    elif fid == 3:
        codec = Codec.of("fletcher32")
    elif fid == 4 and len(cd) >= 4:
        # HDF5's szip filter: a 4-byte size header, then libaec's stream with these parameters.
        codec = Codec.of("imagecodecs_szip", options_mask=cd[0], pixels_per_block=cd[1], bits_per_pixel=cd[2],
                         pixels_per_scanline=cd[3], header=True)
    elif fid == 32000:
        codec = Codec.of("imagecodecs_lzf", out=chunk_nbytes)  # raw LZF needs the decoded size
    elif fid == 32001:
        codec = Codec.of("blosc")
    elif fid == 32004:
        # HDF5's lz4 filter frames blocks with big-endian sizes, unlike numcodecs' LZ4.
        codec = Codec.of("imagecodecs_lz4h5")
    elif fid == 32015:
        codec = Codec.of("zstd")
    elif fid == 32008 and len(cd) > 4 and cd[4] == 2:
        # bitshuffle + LZ4 (Dectris detectors, hdf5plugin.Bitshuffle): cd = (version, version, element
        # size, block size, 2 = LZ4); the block size is read from each chunk's own header.
        codec = Codec.of("bitshuffle_lz4", elementsize=cd[2] or ds.dtype.itemsize)
    else:
        name = _H5_FILTERS.get(fid, "unregistered")
        raise LayoutError(f"dataset {ds.name!r} of {ds.path!r} uses HDF5 filter {fid} ({name}), which gpulazy "
                          f"cannot decode (it decodes {_SUPPORTED}); rewrite the dataset with one of those "
                          "(e.g. h5repack -f GZIP=1 or -f UD=32015,0,1,3 for zstd) or read it with h5py")
    _check_decodable(codec, fid, ds)
    return codec


def _check_decodable(codec: Codec, fid: int, ds: Hdf5Dataset) -> None:
    from gpulazy.codecs.host import unsupported_reason

    why = unsupported_reason(codec)
    if why:
        raise LayoutError(f"dataset {ds.name!r} of {ds.path!r} uses HDF5 filter {fid} "
                          f"({_H5_FILTERS.get(fid, '?')}), which cannot be decoded here: {why}")


# -- from metadata to chunk specs -----------------------------------------------------------------

def _check_same(d: Hdf5Dataset, first: Hdf5Dataset) -> None:
    # One fill value per stack: a block's missing chunks may come from several files.
    for what in ("name", "shape", "dtype", "storage", "chunks", "codec", "fill_value"):
        a, b = ((d.codec(0), first.codec(0)) if what == "codec" else (getattr(d, what), getattr(first, what)))
        if repr(a) != repr(b):  # repr: a NaN fill value equals itself
            raise LayoutError(f"dataset {d.name!r} of {d.path!r} has {what} {a!r} but {first.name!r} of "
                              f"{first.path!r} has {b!r}; stacked HDF5 files must agree on dataset, shape, "
                              "dtype, storage, chunk shape, filters and fill value")


def _check_requested(d: Hdf5Dataset, dtype: Any, shape: Any) -> None:
    if dtype is not None and check_dtype(dtype) != d.dtype:
        raise LayoutError(f"dataset {d.name!r} of {d.path!r} holds dtype {d.dtype.str!r}, not the requested "
                          f"{dtype!r}; leave dtype unset for HDF5 files")
    if shape is not None and check_shape(shape) != d.shape:
        raise LayoutError(f"dataset {d.name!r} of {d.path!r} has shape {d.shape}, not the requested {shape!r}; "
                          "leave shape unset for HDF5 files")


def _grid_index(found: Sequence[Hdf5Dataset], chunks: Any, layout: str, stacked: bool) -> Index:
    from gpulazy import config
    from gpulazy.layouts._grid import grid_chunks

    first = found[0]
    stored = first.chunks or slab_sizes(first.shape, first.dtype.itemsize, int(config.get("chunk_size")))
    shape = ((len(found),) + first.shape) if stacked else first.shape
    stored = ((1,) + tuple(stored)) if stacked else tuple(stored)
    native = first.dtype.newbyteorder("=")
    count = math.prod(-(-n // c) for n, c in zip(shape, stored))
    if count > _MAX_STORED_CHUNKS:  # a corrupt shape, or a grid too fine to index chunk by chunk
        raise LayoutError(f"dataset {first.name!r} of {first.path!r} (shape {first.shape}) has {count:,} stored "
                          f"chunks of {stored}; gpulazy indexes at most {_MAX_STORED_CHUNKS:,} (is the file "
                          "corrupt? otherwise rechunk it, e.g. h5repack -l CHUNK=...)")
    norm = grid_chunks(shape, stored, native, chunks)
    specs = _specs(found, shape, stored, norm, stacked)
    if specs is None:  # a block mixes chunks stored with different filters skipped
        if chunks is not None:
            raise LayoutError(
                f"dataset {first.name!r} of {first.path!r} has chunks stored with different optional filters "
                f"skipped, and chunks={chunks!r} puts such chunks in one block; pass chunks={stored} (the "
                "stored chunk shape) or leave chunks unset")
        norm = grid_chunks(shape, stored, native, stored)
        specs = _specs(found, shape, stored, norm, stacked)
    return Index(shape=shape, dtype=native, chunks=norm, specs=specs, layout=layout, order="C", stacked=stacked,
                 paths=tuple(d.path for d in found))


def _specs(found: Sequence[Hdf5Dataset], shape: tuple[int, ...], stored: tuple[int, ...],
           chunks: tuple[tuple[int, ...], ...], stacked: bool) -> dict[tuple[int, ...], ChunkSpec] | None:
    """Specs of every block, each with the codec of its chunks' filter mask; None if a block mixes masks."""
    from gpulazy.layouts._grid import grid_specs

    first = found[0]
    masks: dict[tuple[str, int], int] = {}

    def tile_at(sidx: tuple[int, ...]) -> ByteRange | None:
        d, inner = (found[sidx[0]], sidx[1:]) if stacked else (first, sidx)
        hit = d.table.get(inner)
        if hit is None:
            return None
        masks[(d.path, hit[0])] = hit[2]
        return ByteRange(d.path, hit[0], hit[1])

    ident = functools.cache(file_identity)

    def table_of(sidx: tuple[int, ...]) -> Any:
        # A chunk never written reads as the fill value because the file's chunk table says so: a
        # block of such chunks alone depends on the file all the same (rewritten, it is stale).
        return ident((found[sidx[0]] if stacked else first).path)

    specs = grid_specs(shape, stored, chunks, dtype=first.dtype, tile_at=tile_at, codec=first.codec(0),
                       fill_value=first.fill_value, identity=ident, absent=table_of)
    if not any(masks.values()):
        return specs
    return _apply_masks(specs, masks, first.codec)


def _apply_masks(specs: dict, masks: dict, codec_of: Callable[[int], Any]) -> dict | None:
    out = {}
    for idx, spec in specs.items():
        seen = {masks[(r.path, r.offset)] for r in spec.ranges}
        if len(seen) > 1:
            return None
        mask = seen.pop() if seen else 0
        out[idx] = dataclasses.replace(spec, codec=codec_of(mask)) if mask else spec
    return out


def _attrs(d: Hdf5Dataset) -> dict[str, object]:
    codec = d.codec(0)
    attrs: dict[str, object] = {"name": d.name, "storage": d.storage, "fill_value": d.fill_value,
                                "filters": tuple(_H5_FILTERS.get(fid, str(fid)) for fid, _ in d.filters)}
    if d.chunks is not None:
        attrs["stored_chunks"] = d.chunks
    if codec:
        attrs["codec"] = "+".join(c.id for c in codec)
    return attrs
