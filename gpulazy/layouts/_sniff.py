"""What a file looks like, from its first bytes: for error messages, not for reading.

When no layout recognises a file, ``describe`` names the format its magic bytes (or its
place in a Zarr store) show and what reads it: a gpulazy layout when one is registered
under that name, else the library to use. ``mixed_kinds`` finds the files of a folder or
glob that differ from the rest. A small hand-written table, because the libraries that
sniff formats (``filetype``, ``python-magic``) know no scientific formats (HDF5, Zarr,
NetCDF, FITS, NRRD, MRC) and would be one more dependency for an error message.

>>> import tempfile, os
>>> p = os.path.join(tempfile.mkdtemp(), "a.png")
>>> open(p, "wb").write(b"\\x89PNG\\r\\n\\x1a\\n" + bytes(8))
16
>>> sniff(p).name
'PNG image'
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["Format", "sniff", "zarr_store_of", "describe", "looks_like", "mixed_kinds"]

_HEAD = 1024  # bytes read: enough for every magic below (MRC's is at 208)


@dataclass(frozen=True)
class Format:
    """A recognised format: its name, the gpulazy layout that reads it (if any) and what else does."""

    name: str
    layout: str | None = None
    other: str = ""
    path: str | None = None  # the dataset to name instead of the file (a Zarr store)


def _at(offset: int, *magics: bytes) -> Callable[[bytes], bool]:
    return lambda head: any(head[offset:offset + len(m)] == m for m in magics)


def _bmp(head: bytes) -> bool:  # "BM" alone is too weak: the reserved bytes 6..9 are zero
    return head[:2] == b"BM" and head[6:10] == b"\0\0\0\0" and len(head) >= 26


_IMAGE = "imageio (imageio.v3.imread) or Pillow"
_TABLE: tuple[tuple[Callable[[bytes], bool], Format], ...] = (
    (_at(0, b"\x93NUMPY"), Format("NumPy .npy file", "npy", "numpy.load")),
    (_at(0, b"II*\0", b"MM\0*", b"II+\0", b"MM\0+"),
     Format("TIFF file", "tiff", "tifffile (tifffile.imread, or tifffile.imread(path, aszarr=True) with "
            "dask.array.from_zarr)")),
    (_at(0, b"\x89HDF\r\n\x1a\n"), Format("HDF5 file (or NetCDF-4)", "hdf5", "h5py (or xarray for NetCDF-4)")),
    (_at(512, b"\x89HDF\r\n\x1a\n"), Format("HDF5 file (with a user block)", "hdf5", "h5py")),
    (_at(0, b"CDF\x01", b"CDF\x02", b"CDF\x05"), Format("NetCDF classic file", None,
                                                       "xarray.open_dataset (scipy or netCDF4 engine)")),
    (_at(0, b"SIMPLE  ="), Format("FITS file", None, "astropy.io.fits")),
    (_at(0, b"NRRD000"), Format("NRRD file", None, "pynrrd (nrrd.read)")),
    (_at(208, b"MAP "), Format("MRC file (electron microscopy)", None, "mrcfile")),
    (_at(128, b"DICM"), Format("DICOM file", None, "pydicom")),
    (_at(344, b"n+1\0", b"ni1\0"), Format("NIfTI-1 image", None, "nibabel")),
    (_at(0, b"\x89PNG\r\n\x1a\n"), Format("PNG image", None, _IMAGE)),
    (_at(0, b"\xff\xd8\xff"), Format("JPEG image", None, _IMAGE)),
    (_at(0, b"GIF87a", b"GIF89a"), Format("GIF image", None, _IMAGE)),
    (_bmp, Format("BMP image", None, _IMAGE)),
    (_at(0, b"\0\0\0\x0cjP  \r\n\x87\n"), Format("JPEG 2000 image", None, "imagecodecs or glymur")),
    (_at(0, b"PK\x03\x04"), Format("zip archive (an .npz or zipped Zarr store?)", None,
                                   "numpy.load for .npz; otherwise unzip it and read the files inside")),
    (_at(0, b"\x1f\x8b"), Format("gzip-compressed file", None,
                                 "gzip -d to decompress it first (gpulazy reads uncompressed bytes)")),
    (_at(0, b"\x28\xb5\x2f\xfd"), Format("zstd-compressed file", None, "zstd -d to decompress it first")),
    (_at(0, b"BZh"), Format("bzip2-compressed file", None, "bunzip2 to decompress it first")),
    (_at(0, b"\xfd7zXZ\0"), Format("xz-compressed file", None, "xz -d to decompress it first")),
)
_ZARR_FILES = {"zarr.json": "Zarr v3 store", ".zarray": "Zarr v2 store", ".zgroup": "Zarr v2 store",
               ".zattrs": "Zarr v2 store", ".zmetadata": "Zarr v2 store"}
_ZARR_OTHER = "zarr-python (zarr.open), or dask.array.from_zarr"


def _head(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(_HEAD)
    except OSError:
        return b""


def zarr_store_of(path: str) -> Format | None:
    """The Zarr store ``path`` is, or lies inside (its metadata file, a chunk), or ``None``."""
    here = os.path.abspath(path)
    if os.path.basename(here) in _ZARR_FILES:
        here = os.path.dirname(here)
    elif not os.path.isdir(here):
        here = os.path.dirname(here)
    found = None
    for _ in range(8):  # chunk keys nest a few levels (c/0/0/0); stop well before the root
        for name, kind in _ZARR_FILES.items():
            if os.path.isfile(os.path.join(here, name)):
                found = Format(kind, "zarr", _ZARR_OTHER, path=here)
                break
        parent = os.path.dirname(here)
        if parent == here or (found and not _holds_zarr(parent)):
            break
        here = parent
    return found


def _holds_zarr(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, n)) for n in _ZARR_FILES)


def sniff(path: str) -> Format | None:
    """The format ``path`` looks like (from a Zarr store around it or its first bytes), or ``None``."""
    store = zarr_store_of(path)
    if store is not None:
        return store
    head = _head(path)
    for test, fmt in _TABLE:
        if test(head):
            return fmt
    if head and _is_text(head):
        return Format("text file", None, "numpy.loadtxt or pandas.read_csv for tables of numbers")
    return None


def _is_text(head: bytes) -> bool:
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(c.isprintable() or c in "\r\n\t" for c in text)


def _a(name: str) -> str:
    return ("an " if name[:1] in "AEIOUaeiou" or name.startswith(("HDF", "NRRD", "MRC", "NIfTI", "xz")) else "a ") + name


# Formats a gpulazy layout is planned for: "not yet"; the others: "does not read".
_PLANNED = {"tiff", "hdf5", "zarr", "npy"}


def describe(path: str, known: Sequence[str]) -> str:
    """Why ``path`` cannot be read as it is, and what would read it (``known``: layout names)."""
    fmt = sniff(path)
    if fmt is None:
        return (f"cannot tell how to read {path!r}: its first bytes match none of the formats gpulazy "
                f"recognises ({', '.join(known)}) nor a known other format; to read it as raw binary, pass "
                f"dtype= (and shape=, and offset= for a header) or write a sidecar {path + '.json'!r} "
                "(gpulazy.layouts.raw.write_sidecar)")
    if fmt.path is not None and os.path.abspath(path) == fmt.path:
        head = f"cannot read {path!r}: it is {_a(fmt.name)}, which"
        target = "it"
    elif fmt.path is not None:
        head = f"cannot read {path!r} on its own: it is part of the {fmt.name} {fmt.path!r}, which"
        target = f"the store folder {fmt.path!r}"
    else:
        head = f"cannot tell how to read {path!r}: it looks like {_a(fmt.name)}, which"
        target = "it"
    return f"{head} {_what_reads(fmt, known, target)}"


def _what_reads(fmt: Format, known: Sequence[str], target: str = "it") -> str:
    if fmt.layout in known:
        return f"gpulazy reads with layout={fmt.layout!r}: pass {target} with layout={fmt.layout!r}"
    yet = " yet" if fmt.layout in _PLANNED else ""
    return f"gpulazy does not read{yet}; read it with {fmt.other}"


def looks_like(path: str, known: Sequence[str]) -> str | None:
    """``"it looks like a TIFF file, which ..."`` when ``path`` is of a known non-raw format, else ``None``.

    For errors about raw reads of such a file: a header-offset hint would be misleading.
    """
    fmt = sniff(path)
    if fmt is None or fmt.path is not None or fmt.name == "text file":
        return None
    return f"it looks like {_a(fmt.name)}, which {_what_reads(fmt, known)}"


def _kind(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    return "." + "0" * len(ext[1:]) if re.fullmatch(r"\.\d+", ext) else ext  # img.001, img.002: one kind


def _plural(label: str, n: int) -> str:
    for word in ("file", "image", "archive"):
        if n > 1 and word in label:
            return label.replace(word, word + "s", 1)
    return label


def mixed_kinds(files: Sequence[str]) -> str | None:
    """A sentence naming the groups of ``files`` that differ in kind, with a glob for the largest; or ``None``.

    Files with one extension are one kind without reading them (a folder of 100,000
    slices costs nothing); otherwise each file's magic bytes decide.
    """
    if len({_kind(p) for p in files}) <= 1:
        return None
    groups: dict[str, list[str]] = defaultdict(list)
    for p in files:
        fmt = sniff(p)
        label = (fmt.name if fmt is not None and fmt.path is None
                 else f"{_kind(p) or 'extensionless'} file of no format gpulazy recognises")
        groups[label].append(p)
    if len(groups) <= 1:
        return None
    ordered = sorted(groups.items(), key=lambda kv: -len(kv[1]))
    parts = []
    for label, paths in ordered:
        names = ", ".join(os.path.basename(p) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
        parts.append(f"{len(paths)} {_plural(label, len(paths))} ({names})")
    biggest = ordered[0][1]
    folder = os.path.dirname(biggest[0])
    ext = os.path.splitext(biggest[0])[1]
    hint = (f"; to read only the first group, pass a glob such as {os.path.join(folder, '*' + ext)!r}"
            if ext and all(os.path.splitext(p)[1] == ext for p in biggest) else
            "; pass a glob or a list naming only the files of one kind")
    return f"the files are not all of one kind: {'; '.join(parts)}{hint}"
