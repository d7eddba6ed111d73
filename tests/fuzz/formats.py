"""Pristine samples of each format, and each format's reference reader.

``build(fmt, variant, folder)`` writes a small sample (a few KiB) whose bytes are the same
on every run (no timestamps, a fixed OME UUID), and describes where its stored pieces and
header fields are. ``reference(sample)`` reads the (maybe mutated) files with the format's
own library, strictly: a TIFF that tifffile warns about counts as rejected, since
tifffile fills what it cannot read with zeros.
"""

from __future__ import annotations

import logging
import os
import random
import re
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

from .mutate import Field, Mutation, Region, Sample, boundary_values, read, write

LARGE = 8 << 20  # a reference array larger than this is not read (the sample's pristine array is 11 KiB)

VARIANTS = {
    "tiff": ["plain", "tiled", "zstd", "deflate", "multipage", "ome"],
    "zarr2": ["raw", "zstd", "blosc"],
    "zarr3": ["shard-zstd-crc32c"],
    "hdf5": ["chunked", "gzip", "gzip-shuffle"],
    "npy": ["v1-<u2-C", "v2->i4-F", "v3-<f8-C", "v1-|u1-C", "v1-<c8-F"],
}


class Rejected(Exception):
    """The reference reader would not read the files (what it said is the message).

    ``lenient``: what it read all the same where its complaint was about metadata only (a
    TIFF whose ImageDescription is damaged still has trustworthy pixels).
    """

    def __init__(self, message: str, lenient: list[np.ndarray] | None = None):
        super().__init__(message)
        self.lenient = lenient or []


def pristine() -> np.ndarray:
    """3 x 40 x 48 uint16 values that compress a little and differ from chunk to chunk."""
    n = 3 * 40 * 48
    noise = np.random.default_rng(0).integers(0, 50, n)
    return ((np.arange(n) % 97) * 31 + noise).astype("<u2").reshape(3, 40, 48)


def build(fmt: str, variant: str, folder: Path) -> Sample:
    folder.mkdir(parents=True, exist_ok=True)
    return BUILDERS[fmt](variant, folder)


# -- TIFF -------------------------------------------------------------------------------

_TIFF_ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8, 17: 8, 18: 8}
_OME_UUID = "urn:uuid:00000000-0000-0000-0000-000000000019"


def _tiff(variant: str, folder: Path) -> Sample:
    import tifffile

    data = pristine()
    kw = {"plain": dict(rowsperstrip=8), "tiled": dict(tile=(16, 16)), "zstd": dict(tile=(16, 16), compression="zstd"),
          "deflate": dict(rowsperstrip=8, compression="zlib", predictor=True),
          "multipage": dict(rowsperstrip=16, photometric="minisblack"),  # pages, not one planar RGB page
          "ome": dict(tile=(16, 16), ome=True, metadata={"axes": "ZYX", "UUID": _OME_UUID})}[variant]
    arr = data if variant in ("multipage", "ome") else data[0]
    name = "a.ome.tif" if variant == "ome" else "a.tif"
    tifffile.imwrite(folder / name, arr, **kw)
    sample = Sample("tiff", variant, folder, str(folder / name), arr)
    with tifffile.TiffFile(folder / name) as tf:
        order = "big" if tf.byteorder == ">" else "little"
        sample.fields.append(Field(name, 4, 4, order, "the first IFD's offset"))
        for i, page in enumerate(tf.pages):
            _tiff_page(sample, name, i, page, order)
    sample.header_end = min(r.offset for r in sample.regions)
    if variant in ("zstd", "deflate"):
        import imagecodecs

        sample.encode = ((lambda v: imagecodecs.zstd_encode(v.astype("<u2").tobytes())) if variant == "zstd"
                         else (lambda v: zlib.compress(v.astype("<u2").tobytes())))
    else:
        sample.encode = lambda v: v.astype("<u2").tobytes()
    sample.store = _tiff_store
    sample.extra = [_tiff_swap_offsets, _tiff_cut_at_ifd]
    return sample


def _tiff_page(sample: Sample, name: str, i: int, page, order: str) -> None:
    tags = list(page.tags)
    for t in tags:
        label = f"page {i} tag {t.code} ({t.name})"
        sample.fields += [Field(name, t.offset, 2, order, f"{label} code"), Field(name, t.offset + 2, 2, order,
                          f"{label} type"), Field(name, t.offset + 4, 4, order, f"{label} count")]
        size = _TIFF_ITEMSIZE.get(t.dtype, 1)
        if t.dtype in (3, 4, 16):  # SHORT, LONG, LONG8: the numbers gpulazy reads
            sample.fields += [Field(name, t.valueoffset + k * size, size, order, f"{label} value {k}")
                              for k in range(min(t.count, 16))]
    sample.fields.append(Field(name, page.offset + 2 + 12 * len(tags), 4, order, f"page {i} next-IFD offset"))
    tiled = page.is_tiled
    per_piece = (page.tilelength * page.tilewidth) if tiled else page.rowsperstrip * page.imagewidth
    offsets_tag, counts_tag = (324, 325) if tiled else (273, 279)
    ot, ct = page.tags[offsets_tag], page.tags[counts_tag]
    for k, (off, n) in enumerate(zip(page.dataoffsets, page.databytecounts)):
        elements = per_piece if tiled else min(page.rowsperstrip, page.imagelength - k * page.rowsperstrip) * page.imagewidth
        sample.regions.append(Region(name, off, n, elements, f"page {i} {'tile' if tiled else 'strip'} {k}"))
    sample.piece_fields.extend(
        (Field(name, ot.valueoffset + k * _TIFF_ITEMSIZE[ot.dtype], _TIFF_ITEMSIZE[ot.dtype], order, "offset"),
         Field(name, ct.valueoffset + k * _TIFF_ITEMSIZE[ct.dtype], _TIFF_ITEMSIZE[ct.dtype], order, "count"))
        for k in range(len(page.dataoffsets)))


def _put(blob: bytearray, f: Field, value: int) -> None:
    blob[f.offset: f.offset + f.size] = value.to_bytes(f.size, f.byteorder)


def _tiff_store(sample: Sample, region: Region, piece: bytes, rng: random.Random) -> str | None:
    """The new piece appended to the file, the piece's offset and byte count pointed at it."""
    k = sample.regions.index(region)
    off_f, cnt_f = sample.piece_fields[k]
    if len(piece) >= 1 << (8 * cnt_f.size):
        return None
    blob = read(sample, region.file)
    at = len(blob) + (len(blob) & 1)
    blob += b"\0" * (at - len(blob)) + piece
    _put(blob, off_f, at)
    _put(blob, cnt_f, len(piece))
    write(sample, region.file, blob)
    return f"{len(piece)} bytes at {at}"


def _tiff_swap_offsets(sample: Sample, rng: random.Random) -> Mutation | None:
    """Two pieces' offsets swapped, with their byte counts (a valid file, pieces permuted) or without."""
    pieces = sample.piece_fields
    if len(pieces) < 2:
        return None
    a, b = rng.sample(range(len(pieces)), 2)
    with_counts = rng.random() < 0.5
    blob = read(sample, sample.regions[a].file)
    for f_a, f_b in [(pieces[a][0], pieces[b][0])] + ([(pieces[a][1], pieces[b][1])] if with_counts else []):
        va, vb = (int.from_bytes(blob[f.offset: f.offset + f.size], f.byteorder) for f in (f_a, f_b))
        _put(blob, f_a, vb)
        _put(blob, f_b, va)
    write(sample, sample.regions[a].file, blob)
    return Mutation("swap-offsets", f"swap the offsets{' and byte counts' if with_counts else ''} of "
                    f"{sample.regions[a].name} and {sample.regions[b].name}")


def _tiff_cut_at_ifd(sample: Sample, rng: random.Random) -> Mutation | None:
    """The file cut where a later page's IFD begins (or just after): what an interrupted writer leaves."""
    import tifffile

    with tifffile.TiffFile(sample.target) as tf:
        starts = [p.offset for p in tf.pages][1:]
    if not starts:
        return None
    at = rng.choice(starts) + rng.choice([0, 0, 1, 2])
    size = os.path.getsize(sample.target)
    os.truncate(sample.target, at)
    return Mutation("truncate-ifd", f"truncate {os.path.basename(sample.target)} from {size} to {at} bytes, at a "
                    "later page's IFD")


def _tiff_reference(sample: Sample) -> list[np.ndarray]:
    """tifffile's first series; also the stack of every page, the other fair reading of a
    multi-page file whose shape description is damaged."""
    import tifffile

    with _TifffileStrict() as strict:
        with tifffile.TiffFile(sample.target) as tf:
            series = tf.series[0]
            _small_enough(int(np.prod(series.shape)) * series.dtype.itemsize)
            out = strict.arrays
            out.append(series.asarray())
            pages = list(tf.pages)
            if len(pages) > 1 and len({(p.shape, p.dtype) for p in pages}) == 1:
                _small_enough(len(pages) * pages[0].size * pages[0].dtype.itemsize)
                out.append(np.stack([p.asarray() for p in pages]))
    return out


# Tags that say where the pixels are and how to decode them: a complaint about any other
# (ImageDescription, Software, the OME-XML) leaves tifffile's pixels trustworthy.
_DATA_TAGS = {254, 256, 257, 258, 259, 262, 273, 277, 278, 279, 284, 317, 322, 323, 324, 325, 338, 339, 32997, 32998}


def _about_pixels(message: str) -> bool:
    tag = re.search(r"TiffTag (\d+)", message)
    if tag:
        return int(tag.group(1)) in _DATA_TAGS
    return not re.search(r"OME series|shaped series|ImageJ|imagej|description", message)


class _TifffileStrict(logging.Handler):
    """Inside it, a warning or error tifffile logs (it then fills what it cannot read with zeros)
    rejects the file; where every complaint is about metadata only, the pixels it read are kept
    as ``Rejected.lenient``."""

    def __enter__(self):
        self.said: list[str] = []
        self.arrays: list[np.ndarray] = []
        logging.getLogger("tifffile").addHandler(self)
        return self

    def emit(self, record):
        if record.levelno >= logging.WARNING:
            self.said.append(record.getMessage())

    def __exit__(self, *exc):
        logging.getLogger("tifffile").removeHandler(self)
        if exc[0] is None and self.said:
            lenient = [] if any(_about_pixels(m) for m in self.said) else self.arrays
            raise Rejected("tifffile logged: " + "; ".join(self.said)[:300], lenient)
        return False


# -- Zarr -------------------------------------------------------------------------------

def _zarr2(variant: str, folder: Path) -> Sample:
    import numcodecs
    import zarr

    data = pristine()
    codec = {"raw": None, "zstd": numcodecs.Zstd(level=1), "blosc": numcodecs.Blosc(cname="lz4", shuffle=1)}[variant]
    store = folder / "a.zarr"
    z = zarr.create_array(store, shape=data.shape, chunks=(1, 16, 16), dtype="<u2", zarr_format=2,
                          compressors=codec, fill_value=0)
    z[:] = data
    sample = Sample("zarr2", variant, folder, str(store), data)
    files = sample.files()
    sample.meta_files = [f for f in files if os.path.basename(f).startswith(".z")]
    sample.chunk_files = [f for f in files if f not in sample.meta_files]
    sample.regions = [Region(f, 0, os.path.getsize(folder / f), 16 * 16, f) for f in sample.chunk_files]
    sample.encode = (lambda v: v.astype("<u2").tobytes()) if codec is None else \
        (lambda v: bytes(codec.encode(v.astype("<u2"))))
    sample.store = _file_store
    return sample


def _file_store(sample: Sample, region: Region, piece: bytes, rng: random.Random) -> str | None:
    write(sample, region.file, piece)
    return f"{len(piece)} bytes written to {region.file}"


_SHARD = (1, 16, 32)
_INNER = (1, 8, 16)
_N_INNER = 4  # inner chunks per shard


def _zarr3(variant: str, folder: Path) -> Sample:
    import zarr
    from zarr.codecs import Crc32cCodec, ZstdCodec

    data = pristine()
    store = folder / "a.zarr"
    z = zarr.create_array(store, shape=data.shape, chunks=_INNER, shards=_SHARD, dtype="<u2", zarr_format=3,
                          compressors=[ZstdCodec(level=1), Crc32cCodec()], fill_value=0)
    z[:] = data
    sample = Sample("zarr3", variant, folder, str(store), data, meta_files=["a.zarr/zarr.json"])
    sample.chunk_files = [f for f in sample.files() if f not in sample.meta_files]
    for f in sample.chunk_files:
        for k, (off, n) in enumerate(_shard_index(folder / f)):
            if off != 2 ** 64 - 1:
                sample.regions.append(Region(f, off, n, int(np.prod(_INNER)), f"{f} inner chunk {k}"))
        index_at = os.path.getsize(folder / f) - 16 * _N_INNER - 4
        sample.fields += [Field(f, index_at + 8 * j, 8, "little", f"{f} index {'offset' if j % 2 == 0 else 'nbytes'} "
                                f"of inner chunk {j // 2}") for j in range(2 * _N_INNER)]
    sample.encode = _zarr3_encode
    sample.store = _zarr3_store
    sample.extra = [_zarr3_index_with_crc]
    return sample


def _crc32c(data: bytes) -> bytes:
    import google_crc32c

    return google_crc32c.value(bytes(data)).to_bytes(4, "little")


def _zarr3_encode(values: np.ndarray) -> bytes:
    import numcodecs

    body = bytes(numcodecs.Zstd(level=1).encode(values.astype("<u2")))
    return body + _crc32c(body)


def _shard_index(path: Path) -> list[tuple[int, int]]:
    blob = path.read_bytes()
    raw = np.frombuffer(blob[-16 * _N_INNER - 4: -4], "<u8").reshape(-1, 2)
    return [(int(o), int(n)) for o, n in raw]


def _write_shard(path: Path, pieces: list[bytes | None]) -> None:
    body, index = b"", []
    for p in pieces:
        index.append((2 ** 64 - 1, 2 ** 64 - 1) if p is None else (len(body), len(p)))
        body += p or b""
    raw = np.array(index, "<u8").tobytes()
    path.write_bytes(body + raw + _crc32c(raw))


def _zarr3_store(sample: Sample, region: Region, piece: bytes, rng: random.Random) -> str | None:
    """The shard written again with a valid index (and its crc32c) around the new piece."""
    path = sample.path(region.file)
    blob = path.read_bytes()
    pieces = [None if o == 2 ** 64 - 1 else blob[o: o + n] for o, n in _shard_index(path)]
    k = next(k for k, (o, n) in enumerate(_shard_index(path)) if o == region.offset)
    pieces[k] = piece
    _write_shard(path, pieces)
    return f"{region.file} rewritten with a valid index"


def _zarr3_index_with_crc(sample: Sample, rng: random.Random) -> Mutation | None:
    """An index entry changed and the index's crc32c made to match: only bounds checks can tell."""
    f = rng.choice(sample.fields)
    blob = read(sample, f.file)
    old = int.from_bytes(blob[f.offset: f.offset + 8], "little")
    new = rng.choice(boundary_values(old, 8, rng, len(blob)))
    blob[f.offset: f.offset + 8] = new.to_bytes(8, "little")
    start = len(blob) - 16 * _N_INNER - 4
    blob[-4:] = _crc32c(blob[start:-4])
    write(sample, f.file, blob)
    return Mutation("index+crc", f"set {f.name} from {old} to {new} and fix the index's crc32c")


def _zarr_reference(sample: Sample) -> list[np.ndarray]:
    import zarr

    if sample.variant == "blosc":
        _blosc_frames_whole(sample)
    z = zarr.open_array(sample.target, mode="r")
    _small_enough(z.nbytes)
    return [np.asarray(z[...])]


def _blosc_frames_whole(sample: Sample) -> None:
    """numcodecs hands blosc a frame without its length, so a frame cut short decodes from
    whatever memory follows it: such a chunk file is one zarr-python cannot judge."""
    for rel in sample.chunk_files:
        path = sample.path(rel)
        if not path.exists():
            continue
        size = os.path.getsize(path)
        head = path.read_bytes()[:16]
        cbytes = int.from_bytes(head[12:16], "little") if len(head) == 16 else None
        if cbytes is not None and cbytes != size:
            raise Rejected(f"the blosc frame of {rel} says it is {cbytes} bytes but the file has {size}")


# -- HDF5 -------------------------------------------------------------------------------

def _hdf5(variant: str, folder: Path) -> Sample:
    import h5py
    import numcodecs

    data = pristine()
    kw = {"chunked": {}, "gzip": dict(compression="gzip"), "gzip-shuffle": dict(compression="gzip", shuffle=True)}
    path = folder / "a.h5"
    with h5py.File(path, "w", track_order=False) as f:
        f.create_dataset("data", data=data, chunks=(1, 16, 16), track_times=False, **kw[variant])
    sample = Sample("hdf5", variant, folder, str(path), data, read_kw={"dataset": "/data"})
    with h5py.File(path, "r") as f:
        ds = f["data"]
        for i in range(ds.id.get_num_chunks()):
            info = ds.id.get_chunk_info(i)
            sample.regions.append(Region("a.h5", info.byte_offset, info.size, 16 * 16, f"chunk {info.chunk_offset}"))
    if variant != "chunked":
        shuffle = numcodecs.Shuffle(elementsize=2) if variant == "gzip-shuffle" else None
        sample.encode = lambda v: zlib.compress(bytes(shuffle.encode(v.astype("<u2"))) if shuffle else
                                                v.astype("<u2").tobytes(), 4)
        sample.store = _hdf5_store
    sample.extra = [_hdf5_metadata_word]
    return sample


def _hdf5_store(sample: Sample, region: Region, piece: bytes, rng: random.Random) -> str | None:
    """In place (the chunk index keeps the stored size): only a piece that fits."""
    if len(piece) > region.nbytes:
        return None
    blob = read(sample, region.file)
    blob[region.offset: region.offset + len(piece)] = piece
    write(sample, region.file, blob)
    return f"{len(piece)} of the {region.nbytes} stored bytes overwritten"


def _hdf5_metadata_word(sample: Sample, rng: random.Random) -> Mutation | None:
    """An aligned word outside every chunk (superblock, object headers, B-tree) set to a boundary value."""
    blob = read(sample, "a.h5")
    inside = np.zeros(len(blob), bool)
    for r in sample.regions:
        inside[r.offset: r.offset + r.nbytes] = True
    size = rng.choice([1, 2, 4, 8])
    candidates = [i for i in range(0, len(blob) - size, size) if not inside[i: i + size].any()]
    at = rng.choice(candidates)
    old = int.from_bytes(blob[at: at + size], "little")
    new = rng.choice(boundary_values(old, size, rng, len(blob)))
    blob[at: at + size] = new.to_bytes(size, "little")
    write(sample, "a.h5", blob)
    return Mutation("h5-word", f"set the {size}-byte metadata word at {at} from {old} to {new}")


def _hdf5_reference(sample: Sample) -> list[np.ndarray]:
    import h5py

    with h5py.File(sample.target, "r") as f:
        ds = f["data"]
        _small_enough(int(np.prod(ds.shape)) * ds.dtype.itemsize)
        return [ds[()]]


# -- .npy -------------------------------------------------------------------------------

def _npy(variant: str, folder: Path) -> Sample:
    import numpy.lib.format as npformat

    version, dtype, order = variant.split("-")
    data = np.asarray(pristine()[:, :20, :24].astype(dtype), order=order)
    path = folder / "a.npy"
    with open(path, "wb") as f:
        npformat.write_array(f, data, version=(int(version[1]), 0))
    blob = path.read_bytes()
    hlen_size = 2 if version == "v1" else 4
    header_end = 8 + hlen_size + int.from_bytes(blob[8: 8 + hlen_size], "little")
    sample = Sample("npy", variant, folder, str(path), data, header_end=header_end)
    sample.fields = [Field("a.npy", 8, hlen_size, "little", "header length"),
                     Field("a.npy", 6, 1, "little", "major version"), Field("a.npy", 7, 1, "little", "minor version")]
    sample.regions = [Region("a.npy", header_end, len(blob) - header_end, data.size, "the data")]
    sample.extra = [_npy_dict_edit]
    return sample


_NPY_EDITS = [("'fortran_order': False", "'fortran_order': True"), ("'fortran_order': True", "'fortran_order': False"),
              ("(3, ", "(4, "), ("(3, ", "(2, "), (", 24)", ", 25)"), (", 24)", ", 2400000000)"), ("(3, ", "(-3, "),
              ("}", " "), ("'descr': '", "'descr': '>"), ("<u2", "<u4"), ("<u2", "<f2"), ("<f8", "<f4"),
              (">i4", "<i4"), ("|u1", "<u8"), ("<c8", "<c16"), ("(3, 20, 24)", "()"), ("(3, 20, 24)", "(0, 20, 24)"),
              ("'shape': ", "'shape': 5, 'x': "), ("'descr'", "'dtype'"), ("False", "0"), (")", "")]


def _npy_dict_edit(sample: Sample, rng: random.Random) -> Mutation | None:
    """The header's dict literal edited as text (length kept when it can be: padding absorbs it)."""
    blob = read(sample, "a.npy")
    head = bytes(blob[: sample.header_end]).decode("latin1")
    old, new = rng.choice(_NPY_EDITS)
    if old not in head:
        return None
    edited = head.replace(old, new, 1)
    pad = len(head) - len(edited)
    if pad > 0:
        edited = edited[:-1] + " " * pad + "\n"
    elif pad < 0 and edited[-1 + pad: -1].strip() == "":
        edited = edited[: pad - 1] + "\n"
    blob[: sample.header_end] = edited.encode("latin1")
    write(sample, "a.npy", blob)
    return Mutation("npy-dict", f"edit the header: {old!r} -> {new!r}")


def _npy_reference(sample: Sample) -> list[np.ndarray]:
    mm = np.load(sample.target, mmap_mode="r", allow_pickle=False)  # checks the size before reading
    _small_enough(mm.nbytes)
    return [np.load(sample.target, allow_pickle=False)]


# -- shared -----------------------------------------------------------------------------

def _small_enough(nbytes: int) -> None:
    if nbytes > LARGE:
        raise TooLarge(nbytes)


class TooLarge(Exception):
    """The files describe more than ``LARGE`` bytes: the reference reader is not asked to read them."""

    def __init__(self, nbytes: int):
        super().__init__(f"the reference reader's array would be {nbytes} bytes")
        self.nbytes = nbytes


BUILDERS: dict[str, Callable[[str, Path], Sample]] = {"tiff": _tiff, "zarr2": _zarr2, "zarr3": _zarr3,
                                                      "hdf5": _hdf5, "npy": _npy}
READERS = {"tiff": _tiff_reference, "zarr2": _zarr_reference, "zarr3": _zarr_reference, "hdf5": _hdf5_reference,
           "npy": _npy_reference}


def reference(sample: Sample) -> list[np.ndarray]:
    """The arrays the format's own reader reads (any one is a fair reading); raises ``Rejected`` or ``TooLarge``."""
    try:
        return READERS[sample.fmt](sample)
    except (Rejected, TooLarge):
        raise
    except Exception as e:  # noqa: BLE001 -- any error of the reference reader is its rejection
        raise Rejected(f"{type(e).__name__}: {e}"[:300]) from e


__all__ = ["VARIANTS", "build", "reference", "pristine", "Rejected", "TooLarge", "LARGE"]
