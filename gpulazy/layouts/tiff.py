"""TIFF: one multi-page file, or a glob/folder/list of files stacked along a new axis 0.

tifffile parses the IFDs (``dataoffsets``, ``databytecounts``, shapes, compression,
predictor, byte order, series and pyramid levels); no pixel data is read here. The array
is tifffile's series shape (``(T, Z, Y, X)`` for an ImageJ or OME hyperstack, samples as
a last axis for contiguous RGB), so it equals ``tifffile.imread``.

- Uncompressed pages whose strips lie back to back become plain byte ranges, one run
  per page or longer (pages written one after another merge): no assembly, raw speed.
- Anything else (compressed, predicted, scattered strips, tiles) becomes a grid of
  stored pieces (``layouts._grid``): each strip or tile is a ``Tile`` with the codec
  pipeline in decode order (``zlib``, ``zstd``, imagecodecs' LZW/packbits/JPEG/...,
  then ``tiff_predictor`` for predictors 2 and 3).
- Dask chunks are unions of whole pages along the page axes and whole strips/tiles
  inside a page; any ``chunks=`` is snapped to those boundaries.

>>> import numpy as np, tifffile, tempfile, os, gpulazy
>>> p = os.path.join(tempfile.mkdtemp(), "a.tif")
>>> tifffile.imwrite(p, np.arange(24, dtype="u2").reshape(2, 3, 4))
>>> vol = gpulazy.from_files(p, device="cpu", cache=False)
>>> vol.shape, vol.chunk_index.specs[0, 0, 0].tiles
((2, 3, 4), ())
>>> int(vol.sum().compute())
276
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from gpulazy.errors import LayoutError
from gpulazy.layouts._base import Index, Layout
from gpulazy.layouts._common import c_ranges, check_dtype, check_order, check_shape
from gpulazy.layouts._grid import grid_chunks, grid_specs
from gpulazy.spec import ByteRange, ChunkSpec, Codec, FileIdentity

__all__ = ["TiffLayout"]

_MAGIC = (b"II*\0", b"MM\0*", b"II+\0", b"MM\0+")  # classic and BigTIFF, both byte orders

# TIFF compression tag -> codec id (numcodecs ids, or imagecodecs' for TIFF's own)
_CODECS = {
    8: "zlib", 32946: "zlib",  # Adobe deflate, old-style deflate: both zlib streams
    50000: "zstd", 34926: "zstd",
    5: "imagecodecs_lzw",
    32773: "imagecodecs_packbits",
    34925: "imagecodecs_lzma",
    34933: "imagecodecs_png",
    50001: "imagecodecs_webp",
    50002: "imagecodecs_jpegxl", 52546: "imagecodecs_jpegxl",
    33003: "imagecodecs_jpeg2k", 33004: "imagecodecs_jpeg2k", 33005: "imagecodecs_jpeg2k",
    34712: "imagecodecs_jpeg2k",
    34887: "imagecodecs_lerc",
}
_JPEG = (7, 6)  # new- and old-style JPEG
_IMAGE_CODECS = {7, 6, 34933, 50001, 50002, 52546, 33003, 33004, 33005, 34712, 34887}
# The most a codec's output can exceed its input (deflate's limit is 1032:1; zstd's RLE blocks
# ~43690:1; LZW with 12-bit codes ~1300:1; packbits 64:1); others get the largest.
_MAX_RATIO = {"zlib": 1100, "zstd": 1 << 16, "imagecodecs_lzw": 4096, "imagecodecs_packbits": 80,
              "tiff_predictor": 1, "imagecodecs_bitorder": 1}
# Predictor tag -> (kind, dist): 2 horizontal differencing, 3 floating point; 3489x Adobe's
_PREDICTORS = {2: (2, 1), 3: (3, 1), 34892: (2, 2), 34893: (2, 4), 34894: (3, 2), 34895: (3, 4)}


class TiffLayout(Layout):
    """TIFF, BigTIFF, ImageJ and OME-TIFF files (tifffile parses them; no pixels are read).

    Options of ``index`` and ``levels``: ``series`` (which tifffile series, default 0),
    ``level`` (pyramid level of ``index``, default 0: full resolution), ``chunks``
    (dask-style, snapped to whole pages/strips/tiles); ``dtype`` and ``shape``, if given,
    must match the file.
    """

    name = "tiff"
    extensions = (".tif", ".tiff", ".btf", ".tf8", ".ome.tif", ".ome.tiff")

    @classmethod
    def guess_can_open(cls, path: str) -> bool:
        try:
            with open(path, "rb") as f:
                return f.read(4) in _MAGIC
        except (OSError, ValueError, TypeError):
            return False

    def index(self, paths: Sequence[str], *, series: int = 0, level: int = 0, chunks: Any = None,
              dtype: Any = None, shape: Any = None, order: str | None = None, stack: bool | None = None,
              **unknown: Any) -> Index:
        _check_options(unknown, order)
        found = [_scan(p, series, (level,))[0] for p in paths]
        return _to_index(found, self.name, chunks, dtype, shape, stack)

    def levels(self, paths: Sequence[str], *, series: int = 0, chunks: Any = None, dtype: Any = None,
               shape: Any = None, order: str | None = None, stack: bool | None = None, **unknown: Any
               ) -> list[Index]:
        """One ``Index`` per pyramid level (SubIFDs or series levels), full resolution first."""
        _check_options(unknown, order)
        per_file = [_scan(p, series, None) for p in paths]
        count = min(len(f) for f in per_file)  # levels every file has
        out = [_to_index([f[i] for f in per_file], self.name, chunks, dtype if i == 0 else None,
                         shape if i == 0 else None, stack) for i in range(count)]
        return out


def _check_options(unknown: dict, order: str | None) -> None:
    if unknown.pop("offset", None):
        raise LayoutError("TIFF files say where their data is; offset= cannot be used with them "
                          "(pass layout='raw' to read their bytes raw)")
    if unknown:
        raise TypeError(f"the tiff layout got unexpected options {sorted(unknown)}; it takes series=, level=, "
                        "chunks= (and dtype=, shape= to check the file)")
    if order is not None and check_order(order) != "C":
        raise LayoutError("TIFF pages are stored in C order; order='F' cannot be used with them")


# -- what one file says ---------------------------------------------------------------------

@dataclass(frozen=True)
class _Geometry:
    """Where a page's stored pieces (strips or tiles) lie in the page's array."""

    page_shape: tuple[int, ...]   # tifffile's (squeezed) page shape
    stored: tuple[int, ...]       # a strip's or tile's shape, in page axes
    seg_strides: tuple[int, ...]  # segment number = sum(grid index * stride), per page axis
    rows_axis: int | None         # for strips: the page axis of image rows (last strip is shorter)
    nsegments: int
    whole: bool = False           # one piece holding the whole series (see ``_reshaped``)
    in_order: bool = True         # pieces back to back are the page in C order (strips; tiles as wide as the page)


@dataclass
class _Found:
    """One series level of one file: its shape, pieces, codec and metadata."""

    path: str
    identity: FileIdentity            # of the file, as stat'ed before tifffile parsed it
    shape: tuple[int, ...]
    axes: str
    dtype: np.dtype                   # in the file, byte order included
    geometry: _Geometry
    offsets: np.ndarray               # (pages, segments) int64
    counts: np.ndarray
    codec: tuple[Codec, ...] | None
    fill_value: Any
    codec_name: str
    attrs: dict = field(default_factory=dict)
    inserted: tuple[int, ...] = ()    # size-1 axes of ``shape`` that are neither pages nor page axes

    def describe(self) -> tuple:
        return (self.shape, self.dtype.str, self.geometry, self.codec)


def _scan(path: str, series: int, levels: Sequence[int] | None) -> list[_Found]:
    """Each requested level (``None``: all) of ``series`` in ``path``, checked against the file size."""
    import tifffile

    st = os.stat(path)  # a missing or unreadable file is an OSError of its own (resolve_paths checked)
    try:
        with _TagComplaints(path) as complaints, tifffile.TiffFile(path) as tif:
            _check_ifd_chain(tif, path, st.st_size)
            complaints.check(tif)
            _check_declared_pages(tif, None, path)  # before tifffile builds series of what is there
            s = _series(tif, path, series)
            _check_declared_pages(tif, s, path)
            chosen = range(len(s.levels)) if levels is None else levels
            meta = _metadata(tif, s, series)
            found = []
            for lv in chosen:
                if not 0 <= lv < len(s.levels):
                    raise LayoutError(f"TIFF {path!r} series {series} has {len(s.levels)} pyramid level(s); "
                                      f"level={lv} does not exist")
                found.append(_level(path, FileIdentity.from_stat(path, st), s.levels[lv],
                                    _level_metadata(meta, s, s.levels[lv])))
            return found
    except LayoutError:
        raise
    except Exception as e:
        # tifffile raises many kinds (TiffFileError, struct.error, IndexError, KeyError, ValueError,
        # OSError from a seek to a negative offset...) on a corrupt header: all mean the same here.
        raise LayoutError(f"cannot parse the TIFF header of {path!r} ({st.st_size} bytes): {type(e).__name__}: {e}; "
                          "the file is truncated or corrupt") from e


# -- tags tifffile could not read -------------------------------------------------------------
#: Tags that say where a page's pixels are and how they are stored. tifffile logs a tag it
#: cannot read (a count, type or value offset out of range) and goes on without it: a page whose
#: Predictor or byte counts were dropped would then be read as other pixels.
_PIXEL_TAGS = frozenset({254, 256, 257, 258, 259, 262, 273, 277, 278, 279, 284, 317, 322, 323, 324, 325, 338, 339,
                         32997, 32998})


class _TagComplaints(logging.Handler):
    """Collects what tifffile logs, in this thread, while a file is parsed; ``check`` refuses the
    file when a complaint names a tag of ``_PIXEL_TAGS``."""

    def __init__(self, path: str):
        super().__init__(logging.WARNING)
        self.path, self.thread, self.said = path, threading.get_ident(), []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.said.append(record.getMessage())

    def __enter__(self) -> _TagComplaints:
        logging.getLogger("tifffile").addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger("tifffile").removeHandler(self)

    def check(self, tif: Any) -> None:
        len(tif.pages)  # every IFD parsed: its complaints are in
        for message in self.said:
            tag = re.search(r"TiffTag (\d+)", message)
            if tag and int(tag.group(1)) in _PIXEL_TAGS:
                raise LayoutError(f"TIFF {self.path!r}: tag {tag.group(1)}, which says where or how pixels are "
                                  f"stored, cannot be read ({message}); the file is corrupt")


# -- pages the file lacks ----------------------------------------------------------------
# tifffile reads what it can of a truncated file and logs the rest: a multi-page file cut
# short opens as its first pages (often one 2-D page) and the metadata that declares the
# others (OME-XML, ImageJ's ``images=``, tifffile's own shape) is lost or ignored. These
# checks refuse such a file, saying what it declares and what it holds.

def _check_ifd_chain(tif: Any, path: str, size: int) -> None:
    """Raise when the chain of IFDs (page headers) goes on past the last one tifffile could read."""
    found = len(tif.pages)  # follows the chain to its end or the first IFD it cannot read
    at = tif.pages.next_page_offset  # where that last IFD stores the offset of the next (0: none)
    fh, offsetsize = tif.filehandle, tif.tiff.offsetsize
    fh.seek(at)
    raw = fh.read(offsetsize)
    if len(raw) == offsetsize:
        import struct

        nxt = struct.unpack(tif.tiff.offsetformat, raw)[0]
        if nxt == 0:
            return
        where = f"continues at offset {nxt}, " + ("past its end" if nxt >= size else "where no IFD can be read")
    else:
        where = "is cut off in the middle of a page header"
    raise LayoutError(f"TIFF {path!r} ({size} bytes) is truncated or corrupt: after {found} page(s) its chain of IFDs "
                      f"(page headers) {where}{_declared_text(tif, tif.series[0] if tif.series else None)}; "
                      "gpulazy does not open it as fewer pages. Copy or write the file again")


def _check_declared_pages(tif: Any, s: Any, path: str) -> None:
    """Raise when the metadata declares more pages (or a bigger shape) than series ``s`` holds
    (``None``: than the file holds IFDs)."""
    declared = _declared(tif, s)
    if declared is None:
        return
    npages, what = declared
    if s is None:
        holds, where = len(tif.pages), "page(s)"
    else:
        holds = math.prod(s.shape) // (math.prod(s.keyframe.shape) or 1)
        where = (f"page(s) of shape {tuple(s.keyframe.shape)} in its series (shape {tuple(s.shape)}, "
                 f"{len(tif.pages)} page(s) in the file)")
    if npages > holds:
        raise LayoutError(f"TIFF {path!r} holds {holds} {where} but its {what} declares {npages}: the file is "
                          "truncated or its metadata is wrong; gpulazy does not open it as fewer pages")


def _declared(tif: Any, s: Any) -> tuple[int, str] | None:
    """``(pages, whose metadata)`` that the file's metadata declares for series ``s``, if it does.

    ImageJ's ``images=``: against the file's IFDs before the series are built (``s`` None;
    one IFD may describe them all, so only when there are several), and against the series
    unless tifffile made its ImageJ series of them (then the byte ranges are checked against
    the file's size); tifffile's own ``{"shape": ...}``. OME-XML's SizeZ/SizeC/SizeT size
    tifffile's OME series, whose pages the file lacks are ``None`` (``_pieces`` refuses them).
    """
    from tifffile.tifffile import shaped_description_metadata

    try:
        if tif.is_imagej and tif.imagej_metadata and (len(tif.pages) > 1 if s is None else s.kind != "imagej"):
            return int(tif.imagej_metadata.get("images", 1)), "ImageJ metadata (images=)"
        if s is not None and s.kind == "shaped" and s.keyframe.shaped_description:
            shape = shaped_description_metadata(s.keyframe.shaped_description)["shape"]
            return math.prod(shape) // (math.prod(s.keyframe.shape) or 1), f"shape metadata {tuple(shape)}"
    except (ValueError, TypeError, KeyError, AttributeError):
        return None  # metadata that cannot be read declares nothing
    return None


def _declared_text(tif: Any, s: Any) -> str:
    declared = _declared(tif, s) if s is not None else None
    return f"; its {declared[1]} declares {declared[0]} page(s)" if declared else ""


def _series(tif: Any, path: str, series: int) -> Any:
    all_series = tif.series
    if not all_series:
        raise LayoutError(f"TIFF {path!r} holds no image series (no pages with image data)")
    if not isinstance(series, int) or not 0 <= series < len(all_series):
        raise LayoutError(f"TIFF {path!r} has {len(all_series)} series; series={series!r} does not exist")
    return all_series[series]


def _level(path: str, identity: FileIdentity, s: Any, meta: dict) -> _Found:
    kf = s.keyframe
    dtype = _file_dtype(kf, path, tif_byteorder=s.parent.byteorder)
    geometry = _geometry(kf, path)
    shape = tuple(int(n) for n in s.shape)
    lead = len(shape) - len(geometry.page_shape)
    npages = math.prod(shape[:lead]) if lead >= 0 else 0
    truncated = bool(getattr(s, "is_truncated", False)) and len(s) == 1
    codec, codec_name = _codec(kf, path, dtype)
    inserted: tuple[int, ...] = ()
    if lead < 0 or shape[lead:] != geometry.page_shape or (npages != len(s) and not truncated):
        inserted = _inserted_axes(shape, geometry.page_shape, len(s))
        if inserted is None:
            return _reshaped(path, identity, s, shape, dtype, codec, meta)
        npages = len(s)
    _check_counts(path, identity.size, npages, geometry.nsegments, kf.nbytes if truncated else 0)
    offsets, counts = _pieces(s, kf, npages, geometry.nsegments, path, truncated)
    _check_pieces(path, identity.size, offsets, counts, geometry, dtype, codec)
    if not truncated:
        if codec is None:
            _check_one_run(path, s, offsets, counts, math.prod(geometry.page_shape) * dtype.itemsize)
        _check_page_runs(path, kf, offsets, geometry, dtype)
    return _Found(path, identity, shape, s.axes, dtype, geometry, offsets, counts, codec,
                  kf.nodata if kf.nodata is not None else 0, codec_name, dict(meta), inserted)


def _check_one_run(path: str, s: Any, offsets: np.ndarray, counts: np.ndarray, page_nbytes: int) -> None:
    """Refuse a series tifffile reads as one run whose IFDs place a piece elsewhere.

    tifffile reads an uncompressed series it finds stored as one run (``series.dataoffset``; for an
    ImageJ or shaped series of one strip a page, from what the first pages say) from that offset,
    whatever the later pages' IFDs say; gpulazy reads each piece where its IFD says. On an intact
    file the two are the same bytes. On one with a damaged offset they are not (found by fuzzing:
    an ImageJ page's strip offset moved), and either reading would be wrong data without an error.
    ``_check_page_runs`` is the same rule a page at a time.
    """
    start = getattr(s, "dataoffset", None)
    if start is None or not offsets.size:
        return
    within = np.concatenate([np.zeros((len(counts), 1), np.int64), np.cumsum(counts[:, :-1], axis=1)], axis=1)
    want = start + page_nbytes * np.arange(len(offsets), dtype=np.int64)[:, None] + within
    _refuse_off_run(path, offsets, want, lambda page: f"the series is stored as one run from byte {start}")


def _check_page_runs(path: str, kf: Any, offsets: np.ndarray, g: _Geometry, dtype: np.dtype) -> None:
    """Refuse a page whose pieces are not back to back where tifffile reads each page as one run.

    When a series' first page is stored as one run (``TiffPage.is_contiguous``: uncompressed,
    whatever its predictor or fill order), tifffile reads every page of the series (a
    ``TiffFrame`` takes its keyframe's answer) from that page's first piece, whatever its other
    offsets and byte counts say; a series whose pages also follow each other it reads as one run
    from the first (``series.dataoffset``, which checks only each page's first piece). gpulazy
    reads each piece where its IFD says. On an intact file these are the same bytes; on one with a
    damaged piece offset they are not, and either reading would be wrong data without an error
    (found by fuzzing: a later page's strip offset moved, in a plain, an OME and a FillOrder=2 file).
    """
    if offsets.shape[1] < 2 or not kf.is_contiguous:
        return
    need = _raw_sizes(g, dtype)
    want = offsets[:, :1] + np.concatenate([np.zeros(1, np.int64), np.cumsum(need[:-1])])[None, :]
    _refuse_off_run(path, offsets, want,
                    lambda page: f"the page is stored as one run from byte {int(offsets[page, 0])}")


def _refuse_off_run(path: str, offsets: np.ndarray, want: np.ndarray, run: Any) -> None:
    """A ``LayoutError`` naming the first piece whose offset is not ``want``'s (``run(page)`` says where
    tifffile reads that page from)."""
    wrong = np.argwhere(offsets != want)
    if wrong.size:
        page, piece = (int(i) for i in wrong[0])
        raise LayoutError(f"TIFF {path!r}: page {page} piece {piece} starts at byte {int(offsets[page, piece])} by its "
                          f"IFD, but {run(page)}, where that piece is at byte {int(want[page, piece])} (tifffile "
                          "reads it there); an offset is damaged: the file is corrupt")


def _inserted_axes(shape: tuple[int, ...], page_shape: tuple[int, ...], npages: int) -> tuple[int, ...] | None:
    """Where tifffile put extra size-1 axes among the page axes (``(2, 3, 1)``: ``YXQ``), or None.

    Matches the page axes from the right; size-1 axes that match none are the inserted ones,
    and what is left of them must be the pages (product ``npages``).
    """
    i, j, inserted = len(shape) - 1, len(page_shape) - 1, []
    while j >= 0:
        if i < 0:
            return None
        if shape[i] == page_shape[j]:
            j -= 1
        elif shape[i] == 1:
            inserted.append(i)
        else:
            return None
        i -= 1
    return tuple(sorted(inserted)) if math.prod(shape[: i + 1]) == npages else None


def _reshaped(path: str, identity: FileIdentity, s: Any, shape: tuple[int, ...], dtype: np.dtype, codec: Any,
              meta: dict) -> _Found:
    """A series whose shape is not whole pages stacked (tifffile reshapes, e.g. ``(1, 2, 1)``).

    Readable when its data is one uncompressed run: then it is a C-order array at that offset.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if codec is not None or s.dataoffset is None or math.prod(shape) != len(s) * math.prod(s.keyframe.shape):
        raise LayoutError(f"TIFF {path!r}: series shape {shape} is not whole pages of shape {s.keyframe.shape} "
                          "stacked, and its data is not one uncompressed run; this layout is not supported")
    geometry = _Geometry(shape, (1,) * len(shape), (0,) * len(shape), None, 1, whole=True)
    offsets = np.array([[s.dataoffset]], np.int64)
    counts = np.array([[nbytes]], np.int64)
    _check_pieces(path, identity.size, offsets, counts, geometry, dtype, None)
    return _Found(path, identity, shape, s.axes, dtype, geometry, offsets, counts, None, 0, "none", dict(meta))


def _file_dtype(kf: Any, path: str, tif_byteorder: str) -> np.dtype:
    dt = kf.dtype
    if dt is None or kf.bitspersample not in (8, 16, 32, 64, 128) or (kf.sampleformat == 5):
        raise LayoutError(f"TIFF {path!r} stores {kf.bitspersample}-bit samples of sample format "
                          f"{kf.sampleformat}: packed, complex-integer or odd bit depths are not supported "
                          "(read it with tifffile.imread)")
    if kf.is_subsampled and kf.compression not in _JPEG:
        raise LayoutError(f"TIFF {path!r} holds chroma-subsampled (YCbCr) data without JPEG; not supported")
    return np.dtype(dt).newbyteorder(tif_byteorder)


def _geometry(kf: Any, path: str) -> _Geometry:
    # tifffile's full page shape is (separate samples, depth, rows, columns, contiguous samples);
    # its page shape drops the size-1 ones among them, axis letters say which remain.
    ssep, depth, length, width, scontig = (int(n) for n in kf.shaped)
    if not kf.is_tiled and any(tag in kf.tags for tag in (322, 323)):
        # A TileWidth or TileLength tifffile cannot use (0, say): it then takes the page for
        # strips, and tiles read as strips are other pixels (tifffile.imread raises on it).
        raise LayoutError(f"TIFF {path!r} has tile tags (TileWidth {kf.tilewidth}, TileLength {kf.tilelength}) "
                          "that do not describe tiles; the header is corrupt")
    if kf.is_tiled:
        stored5 = (1, int(kf.tiledepth), int(kf.tilelength), int(kf.tilewidth), scontig)
    else:
        rps = max(1, min(int(kf.rowsperstrip or length), length or 1))
        stored5 = (1, 1, rps, width, scontig)
    full5 = (ssep, depth, length, width, scontig)
    grid5 = tuple(-(-n // s) if n else 0 for n, s in zip(full5, stored5))
    strides5 = (grid5[1] * grid5[2] * grid5[3], grid5[2] * grid5[3], grid5[3], 1, 0)
    axes = kf.axes
    page_shape = tuple(int(n) for n in kf.shape)
    where = []  # the full-shape position of each page axis
    for i, letter in enumerate(axes):
        pos = {"Z": 1, "Y": 2, "X": 3}.get(letter)
        if letter == "S":
            pos = 0 if kf.planarconfig == 2 else 4
        if pos is None or pos in where:
            raise LayoutError(f"TIFF {path!r}: page axes {axes!r} are not supported")
        where.append(pos)
    dropped = [full5[j] for j in range(5) if j not in where]
    if len(axes) != len(page_shape) or any(page_shape[i] != full5[j] for i, j in enumerate(where)) or \
            any(n != 1 for n in dropped) or any(stored5[j] != 1 for j in range(5) if j not in where):
        raise LayoutError(f"TIFF {path!r}: page shape {page_shape} ({axes}) does not match its stored "
                          f"layout {full5}; not supported")
    # tifffile's rule (TiffPage.is_contiguous): tiles as wide as the image, whole tiles down it
    in_order = not kf.is_tiled or (stored5[3] == width and length % stored5[2] == 0 and
                                   (depth == 1 or (stored5[2] == length and depth % stored5[1] == 0)))
    return _Geometry(page_shape, tuple(stored5[j] for j in where), tuple(strides5[j] for j in where),
                     (where.index(2) if not kf.is_tiled else None), math.prod(grid5[:4]), in_order=in_order)


def _check_counts(path: str, size: int, npages: int, nseg: int, page_nbytes: int) -> None:
    """Refuse, before allocating tables for them, more pieces than the file has room to describe."""
    # Each piece has an offset and a byte count of >= 2 bytes each in some IFD; the pages of
    # a truncated series (no IFDs of their own) must each fit their data in the file.
    if nseg > size // 4 or (page_nbytes == 0 and npages * nseg > size // 4) or npages * page_nbytes > size:
        raise LayoutError(f"TIFF {path!r} ({size} bytes) claims {npages} page(s) of {nseg} strips/tiles each, "
                          "more than the file can hold; its header is corrupt")


def _pieces(s: Any, kf: Any, npages: int, nseg: int, path: str, truncated: bool
            ) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, counts)`` of every page's segments; zeros for a page the series lacks."""
    from tifffile import TiffPage  # a TiffFrame shares its keyframe's tags; a TiffPage has its own

    offsets = np.zeros((npages, nseg), np.int64)
    counts = np.zeros((npages, nseg), np.int64)
    if truncated:
        # ImageJ > 4 GiB and tifffile's truncated series: one IFD, pages back to back after it.
        if s.dataoffset is None:
            raise LayoutError(f"TIFF {path!r}: truncated series without contiguous data is not supported")
        first = np.asarray(kf.dataoffsets, np.int64)
        step = kf.nbytes
        offsets[:] = first[None, :] + step * np.arange(npages, dtype=np.int64)[:, None]
        counts[:] = np.asarray(kf.databytecounts, np.int64)[None, :]
        return offsets, counts
    lacking = [i for i, page in enumerate(s) if page is None]
    if lacking:  # an OME series whose IFDs the file lacks: tifffile would read them as zeros
        raise LayoutError(f"TIFF {path!r}: its OME-XML declares {len(s)} page(s) for series shape {tuple(s.shape)} "
                          f"but {len(lacking)} of them (page {lacking[0]} first) are not in the file "
                          f"({len(s.parent.pages)} page(s) found); the file is truncated or its metadata is wrong")
    for i, page in enumerate(s):
        if page.parent is not s.parent:  # multi-file OME-TIFF: this page's offsets are in another file
            raise LayoutError(f"TIFF {path!r} is a multi-file OME-TIFF (page {i} lies in "
                              f"{page.parent.filehandle.path!r}); not supported yet: open a single-file one")
        if page is not kf and isinstance(page, TiffPage) and _decoding(page) != _decoding(kf):
            raise LayoutError(f"TIFF {path!r} page {i} is stored unlike page 0 of its series ({_decoding(page)} "
                              f"vs {_decoding(kf)}); pages that differ in layout or compression are not supported")
        off, cnt = page.dataoffsets, page.databytecounts
        if len(off) != nseg or len(cnt) != nseg:
            raise LayoutError(f"TIFF {path!r} page {i} has {len(off)} data offsets and {len(cnt)} byte counts; "
                              f"its shape needs {nseg}; the file is corrupt")
        offsets[i] = off
        counts[i] = cnt
    return offsets, counts


def _decoding(page: Any) -> tuple:
    """What decoding a page's pieces depends on."""
    return (page.shaped, page.dtype, page.compression, page.predictor, page.fillorder, page.planarconfig,
            page.tile if page.is_tiled else page.rowsperstrip)


def _check_pieces(path: str, size: int, offsets: np.ndarray, counts: np.ndarray, g: _Geometry,
                  dtype: np.dtype, codec: tuple[Codec, ...] | None) -> None:
    """Every piece inside the file, big enough uncompressed, and not decoding to more than its
    codec can make of its bytes (so a corrupt header cannot ask for terabytes); sparse is (0, 0)."""
    present = counts > 0
    # (0, 0) is a sparse piece; a count of 0 elsewhere is corrupt (readers disagree on it).
    bad = (present & ((offsets < 8) | (offsets + counts > size))) | (counts < 0) | ((counts == 0) & (offsets != 0))
    if np.any(bad):
        page, seg = np.argwhere(bad)[0].tolist()
        off, cnt = int(offsets[page, seg]), int(counts[page, seg])
        what = "has no bytes but an offset" if cnt == 0 else f"lies outside the file ({size} bytes)"
        raise LayoutError(f"TIFF {path!r} page {page} piece {seg} ({cnt} bytes at offset {off}) {what}; the file "
                          "is truncated or its header is corrupt")
    _check_overlap(path, offsets, counts, present)
    need = _raw_sizes(g, dtype)
    if codec is None:
        short = present & (counts < need[None, :])
        if np.any(short):
            page, seg = np.argwhere(short)[0].tolist()
            raise LayoutError(f"TIFF {path!r} page {page} piece {seg} has {counts[page, seg]} bytes but its shape "
                              f"needs {need[seg]} uncompressed; the byte counts do not match the image")
        return
    ratio = max(_MAX_RATIO.get(c.id, 1 << 16) for c in codec)
    over = present & (need[None, :] > counts * ratio + 4096)
    if np.any(over):
        page, seg = np.argwhere(over)[0].tolist()
        raise LayoutError(f"TIFF {path!r} page {page} piece {seg}: {counts[page, seg]} stored bytes cannot decode "
                          f"to the {need[seg]} its shape needs ({codec[0].id} expands at most ~{ratio}x); the "
                          "header is corrupt")


def _check_overlap(path: str, offsets: np.ndarray, counts: np.ndarray, present: np.ndarray) -> None:
    """No two pieces of a page share some bytes but not all (writers that store identical tiles
    once point them at the same bytes; a piece starting inside another is a corrupt offset, and
    readers then disagree: tifffile reads a shaped series as one block and ignores it)."""
    if offsets.shape[1] < 2:
        return
    key = np.where(present, offsets, np.iinfo(np.int64).max)
    order = np.argsort(key, axis=1, kind="stable")
    o, c = np.take_along_axis(offsets, order, 1), np.take_along_axis(counts, order, 1)
    both = np.take_along_axis(present, order, 1)
    same = (o[:, 1:] == o[:, :-1]) & (c[:, 1:] == c[:, :-1])
    clash = both[:, 1:] & both[:, :-1] & (o[:, 1:] < o[:, :-1] + c[:, :-1]) & ~same
    if np.any(clash):
        page, k = np.argwhere(clash)[0].tolist()
        a, b = order[page, k], order[page, k + 1]
        raise LayoutError(f"TIFF {path!r} page {page}: piece {b} (bytes {o[page, k + 1]}..{o[page, k + 1] + c[page, k + 1]}) "
                          f"starts inside piece {a} (bytes {o[page, k]}..{o[page, k] + c[page, k]}); the header is "
                          "corrupt")


def _raw_sizes(g: _Geometry, dtype: np.dtype) -> np.ndarray:
    """Each segment's uncompressed size: a full tile, or a strip (the last of a plane shorter)."""
    sizes = np.full(g.nsegments, math.prod(g.page_shape if g.whole else g.stored) * dtype.itemsize, np.int64)
    if g.rows_axis is not None:
        for seg in range(g.nsegments):
            sizes[seg] = math.prod(_strip_shape(g, seg)) * dtype.itemsize
    return sizes


def _strip_shape(g: _Geometry, seg: int) -> tuple[int, ...]:
    rows, stride = g.stored[g.rows_axis], g.seg_strides[g.rows_axis]
    nstrips = -(-g.page_shape[g.rows_axis] // rows)
    k = (seg // stride) % nstrips
    out = list(g.stored)
    out[g.rows_axis] = min(rows, g.page_shape[g.rows_axis] - k * rows)
    return tuple(out)


def _codec(kf: Any, path: str, dtype: np.dtype) -> tuple[tuple[Codec, ...] | None, str]:
    """The decode pipeline of every piece (``None``: raw bytes) and a readable name."""
    import tifffile

    from gpulazy.codecs import check_supported

    comp, pred = int(kf.compression), int(kf.predictor)
    try:
        comp_name = tifffile.COMPRESSION(comp).name
    except ValueError:
        comp_name = str(comp)
    steps: list[Codec] = []
    if kf.fillorder == 2 and comp not in _JPEG:
        steps.append(Codec("imagecodecs_bitorder"))  # bits of each byte stored in reverse
    if comp in _JPEG:
        steps.append(_jpeg(kf))
    elif comp in _CODECS:
        steps.append(Codec(_CODECS[comp]))
    elif comp != 1:
        raise LayoutError(f"TIFF {path!r} uses compression {comp_name} ({comp}), which gpulazy cannot decode "
                          "(read it with tifffile.imread, or convert it)")
    if pred != 1 and comp == 1:
        # tifffile undoes a predictor on an uncompressed page read as one run: across rows on a
        # single page, on other bytes for big-endian floats; the TIFF specification row by row.
        # No reading matches both (found by fuzzing: 32 of 237 such files read otherwise).
        raise LayoutError(f"TIFF {path!r} is uncompressed but has predictor {pred}; tifffile and the TIFF "
                          "specification read such pages differently, so gpulazy does not read them "
                          "(rewrite it without the predictor)")
    if pred != 1 and comp not in _IMAGE_CODECS:
        if pred not in _PREDICTORS:
            raise LayoutError(f"TIFF {path!r} uses predictor {pred}, which gpulazy cannot undo")
        kind, dist = _PREDICTORS[pred]
        width = int(kf.tilewidth if kf.is_tiled else kf.imagewidth)
        samples = int(kf.samplesperpixel if kf.planarconfig == 1 else 1)
        steps.append(Codec.of("tiff_predictor", kind=kind, dist=dist, dtype=dtype.str, width=width,
                              samples=samples))
    if not steps:
        return None, "none"
    try:
        check_supported(steps, path)
    except LayoutError as e:
        raise LayoutError(f"TIFF {path!r} (compression {comp_name}): {e}") from e
    name = comp_name.lower() + (f"+predictor{pred}" if pred != 1 else "")
    return tuple(steps), name


def _jpeg(kf: Any) -> Codec:
    import tifffile

    colorspace, outcolorspace = tifffile.tifffile.jpeg_decode_colorspace(
        kf.photometric, kf.planarconfig, kf.extrasamples, kf.is_jfif)
    return Codec.of("imagecodecs_jpeg", tables=kf.jpegtables, colorspace=colorspace,
                    outcolorspace=outcolorspace, bitspersample=int(kf.bitspersample))


# -- metadata -------------------------------------------------------------------------------

_OME_SIZES = {"x": "PhysicalSizeX", "y": "PhysicalSizeY", "z": "PhysicalSizeZ", "t": "TimeIncrement"}


def _metadata(tif: Any, s: Any, series: int) -> dict:
    """``scale``/``units`` per axis letter from OME-XML or ImageJ metadata, where the file has them."""
    try:
        if tif.is_ome and tif.ome_metadata:
            return _ome_metadata(tif.ome_metadata, series)
        if tif.is_imagej and tif.imagej_metadata:
            return _imagej_metadata(tif.imagej_metadata, s.keyframe)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, ZeroDivisionError, SyntaxError):
        pass  # metadata we cannot read costs the scale, not the data
    return {}


def _ome_metadata(xml: str, series: int) -> dict:
    import tifffile

    images = tifffile.xml2dict(xml)["OME"]["Image"]
    image = images[series] if isinstance(images, list) else images
    pixels = image["Pixels"]
    scale, units = {}, {}
    for axis, key in _OME_SIZES.items():
        if key in pixels:
            scale[axis] = float(pixels[key])
            units[axis] = str(pixels.get(key + "Unit", "s" if axis == "t" else "µm"))
    return {"scale": scale, "units": units, "name": image.get("Name")}


def _imagej_metadata(meta: dict, kf: Any) -> dict:
    scale, units = {}, {}
    unit = meta.get("unit")
    if "spacing" in meta:
        scale["z"] = float(meta["spacing"])
    for axis, tag in (("x", "XResolution"), ("y", "YResolution")):
        res = kf.tags.valueof(tag)
        if res and res[0] and tuple(res) != (1, 1):
            scale[axis] = res[1] / res[0]
    if unit:
        units = {a: str(unit) for a in scale}
    if "finterval" in meta:
        scale["t"], units["t"] = float(meta["finterval"]), "s"
    return {"scale": scale, "units": units}


def _level_metadata(meta: dict, top: Any, level: Any) -> dict:
    """A pyramid level's scale: full resolution's times how much smaller the level is along each axis."""
    scale = meta.get("scale")
    if not scale or level is top or level.axes != top.axes:
        return meta
    factor = {a.lower(): n / m for a, n, m in zip(top.axes, top.shape, level.shape) if m}
    return {**meta, "scale": {a: v * factor.get(a, 1.0) for a, v in scale.items()}}


def _attrs(f: _Found, stacked: bool, stored: tuple[int, ...]) -> dict:
    axes = (("i",) if stacked else ()) + tuple(a.lower() for a in f.axes)
    out: dict = {"axes": axes, "codec": f.codec_name, "stored_chunks": stored}
    scale = f.attrs.get("scale") or {}
    if scale:
        out["scale"] = tuple(float(scale.get(a, 1.0)) for a in axes)
        units = f.attrs.get("units") or {}
        out["units"] = tuple(units.get(a) for a in axes)
    if f.attrs.get("name"):
        out["name"] = f.attrs["name"]
    return out


# -- the index ------------------------------------------------------------------------------

def _to_index(found: list[_Found], layout: str, chunks: Any, dtype: Any, shape: Any,
              stack: bool | None = None) -> Index:
    """``stack``: a collection (folder, glob, list) stacks along a new axis 0 even of one file
    (``layouts.index`` passes it); ``None``: when there are several files."""
    first = found[0]
    for f in found[1:]:
        if f.describe() != first.describe():
            raise LayoutError(_mismatch(f, first))
    stacked = stack if stack is not None else len(found) > 1
    full = ((len(found),) if stacked else ()) + first.shape
    extra = tuple(a + stacked for a in first.inserted)  # size-1 axes the pieces know nothing of
    nat = tuple(n for a, n in enumerate(full) if a not in extra)
    lead = len(nat) - len(first.geometry.page_shape)
    native = first.dtype.newbyteorder("=")
    _check_requested(first.path, full, native, dtype, shape)
    stored = _insert((1,) * lead + first.geometry.stored, extra, 1)
    norm = grid_chunks(full, stored, native, chunks)
    nat_chunks = tuple(c for a, c in enumerate(norm) if a not in extra)
    pages = _PageTable.of(found)
    if first.codec is None and pages.starts is not None:
        specs = _plain_specs(nat, lead, nat_chunks, first, pages)
    else:
        specs = _grid_specs(nat, lead, nat_chunks, first, pages)
    if extra:
        specs = {_insert(i, extra, 0): _spec_with_axes(sp, extra) for i, sp in specs.items()}
    return Index(shape=full, dtype=native, chunks=norm, specs=specs, layout=layout, order="C",
                 stacked=stacked, paths=tuple(f.path for f in found), attrs=_attrs(first, stacked, stored))


def _insert(values: tuple, positions: tuple[int, ...], fill: Any) -> tuple:
    """``values`` with ``fill`` inserted so that it lands at each of ``positions`` (sorted)."""
    out = list(values)
    for p in positions:
        out.insert(p, fill)
    return tuple(out)


def _spec_with_axes(spec: ChunkSpec, extra: tuple[int, ...]) -> ChunkSpec:
    # Size-1 axes change neither the bytes nor their C order: insert them everywhere.
    tiles = tuple(replace(t, shape=_insert(t.shape, extra, 1), origin=_insert(t.origin, extra, 0))
                  for t in spec.tiles)
    return ChunkSpec(spec.ranges, _insert(spec.shape, extra, 1), spec.dtype, spec.order, spec.codec,
                     spec.identity, _insert(spec.index, extra, 0), tiles, spec.fill_value)


def _mismatch(f: _Found, first: _Found) -> str:
    what = [(n, a, b) for n, a, b in (("shape", f.shape, first.shape), ("dtype", f.dtype.str, first.dtype.str),
                                      ("codec", f.codec_name, first.codec_name))
            if a != b] or [("strip/tile layout", f.geometry.stored, first.geometry.stored)]
    name, a, b = what[0]
    return (f"TIFF {f.path!r} has {name} {a!r} but {first.path!r} has {b!r}; stacked TIFF files must agree on "
            "page shape, dtype, compression and strips/tiles")


def _check_requested(path: str, full: tuple, native: np.dtype, dtype: Any, shape: Any) -> None:
    if dtype is not None and check_dtype(dtype).newbyteorder("=") != native:
        raise LayoutError(f"TIFF {path!r} holds dtype {native.str!r}, not the requested {dtype!r}; leave dtype "
                          "unset for TIFF files")
    if shape is not None and check_shape(shape) != full:
        raise LayoutError(f"TIFF {path!r} holds shape {full}, not the requested {shape!r}; leave shape unset")


@dataclass
class _PageTable:
    """Every page of the array, in C order of the page axes: its file, pieces and raw start."""

    paths: list[str]              # per page
    identity: dict[str, FileIdentity]  # path -> its identity
    offsets: np.ndarray           # (pages, segments)
    counts: np.ndarray
    starts: np.ndarray | None     # where each page's raw elements start, if every page is contiguous

    @classmethod
    def of(cls, found: list[_Found]) -> _PageTable:
        paths = [f.path for f in found for _ in range(len(f.offsets))]
        offsets = np.concatenate([f.offsets for f in found])
        counts = np.concatenate([f.counts for f in found])
        first = found[0]
        starts = None
        if first.codec is None and first.geometry.in_order:
            starts = _contiguous_starts(offsets, counts, math.prod(first.geometry.page_shape) * first.dtype.itemsize)
        return cls(paths, {f.path: f.identity for f in found}, offsets, counts, starts)


def _contiguous_starts(offsets: np.ndarray, counts: np.ndarray, page_nbytes: int) -> np.ndarray | None:
    """Each page's first byte when every page's pieces lie back to back in order (strips of an image)."""
    if offsets.shape[1] == 1:
        return offsets[:, 0] if bool(np.all(counts[:, 0] >= page_nbytes)) else None
    follows = np.all(offsets[:, 1:] == offsets[:, :-1] + counts[:, :-1])
    if follows and bool(np.all(counts.sum(axis=1) == page_nbytes)):
        return offsets[:, 0]
    return None


def _bounds(chunks: Sequence[int]) -> list[tuple[int, int]]:
    edges = list(itertools.accumulate(chunks, initial=0))
    return list(zip(edges[:-1], edges[1:]))


def _plain_specs(full: tuple, lead: int, chunks: tuple, f: _Found, pages: _PageTable) -> dict:
    """Uncompressed contiguous pages: each block is the C-order runs of its pages, merged where adjacent."""
    bounds = [_bounds(c) for c in chunks]
    lead_shape, page_shape = full[:lead], full[lead:]
    lead_strides = [math.prod(lead_shape[k + 1:]) for k in range(lead)]
    itemsize, dt = f.dtype.itemsize, f.dtype.str
    inner_runs: dict = {}  # within-page runs depend only on the in-page block: compute once each
    specs: dict = {}
    for idx in itertools.product(*(range(len(b)) for b in bounds)):
        bnd = [bounds[a][i] for a, i in enumerate(idx)]
        inner = tuple(bnd[lead:])
        runs = inner_runs.get(inner)
        if runs is None:
            runs = inner_runs[inner] = c_ranges(page_shape, [a for a, _ in inner], [b for _, b in inner], itemsize)
        out: list[list] = []  # [path, offset, nbytes], merged as they follow each other
        for page_idx in itertools.product(*(range(a, b) for a, b in bnd[:lead])):
            page = sum(i * s for i, s in zip(page_idx, lead_strides))
            path, start = pages.paths[page], int(pages.starts[page])
            for off, nb in runs:
                if out and out[-1][0] == path and out[-1][1] + out[-1][2] == start + off:
                    out[-1][2] += nb
                else:
                    out.append([path, start + off, nb])
        ranges = tuple(ByteRange(p, o, n) for p, o, n in out)
        ident = tuple(pages.identity[p] for p in dict.fromkeys(r.path for r in ranges))
        shape = tuple(b - a for a, b in bnd)
        specs[idx] = ChunkSpec(ranges, shape, dt, "C", None, ident, idx)
    return specs


def _grid_specs(full: tuple, lead: int, chunks: tuple, f: _Found, pages: _PageTable) -> dict:
    """Compressed, predicted, tiled or scattered pieces: one ``Tile`` per strip/tile (raw ones trimmed)."""
    g, lead_shape = f.geometry, full[:lead]
    lead_strides = [math.prod(lead_shape[k + 1:]) for k in range(lead)]
    raw_sizes = _raw_sizes(g, f.dtype) if f.codec is None else None

    def segment(sidx: tuple[int, ...]) -> tuple[int, int]:
        page = sum(i * s for i, s in zip(sidx[:lead], lead_strides))
        return page, sum(i * s for i, s in zip(sidx[lead:], g.seg_strides))

    def tile_at(sidx: tuple[int, ...]) -> ByteRange | None:
        page, seg = segment(sidx)
        count = int(pages.counts[page, seg])
        if count == 0:
            return None  # sparse: never written (reads as the fill value, like tifffile)
        if raw_sizes is not None:
            count = int(raw_sizes[seg])  # an uncompressed piece may be padded: read what it holds
        return ByteRange(pages.paths[page], int(pages.offsets[page, seg]), count)

    def tile_shape(sidx: tuple[int, ...]) -> tuple[int, ...]:
        if g.rows_axis is None:
            return (1,) * lead + g.stored
        return (1,) * lead + _strip_shape(g, segment(sidx)[1])

    def absent(sidx: tuple[int, ...]) -> FileIdentity:
        # A sparse piece reads as the fill value because its page's byte counts say so: a block of
        # such pieces alone depends on that file all the same (rewritten, it is stale).
        return pages.identity[pages.paths[segment(sidx)[0]]]

    return grid_specs(full, (1,) * lead + g.stored, chunks, dtype=f.dtype, tile_at=tile_at, codec=f.codec,
                      fill_value=f.fill_value, tile_shape=tile_shape, identity=pages.identity.__getitem__,
                      absent=absent)
