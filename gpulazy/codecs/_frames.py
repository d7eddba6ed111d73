"""What a stored piece's own framing says: the decoded size its header declares, and
whether that header fits the piece. One table, read by the host decoders and by the
nvCOMP path alike, so a chunk is held to exactly the bytes its spec needs in one place.

A piece reaches a codec as a buffer of exactly its stored bytes (a view into the
chunk's read buffer), but some C decoders trust their own length field rather than
the buffer's: c-blosc reads ``cbytes`` from its header, nvCOMP's zstd and LZ4 read
past a stream's stated end. So every codec with a length field of its own is checked
here against the piece before it decodes:

- ``zstd``: the frame header's content size (when present) is the decoded size;
- ``lz4`` (numcodecs): the 4-byte little-endian prefix is the decoded size;
- ``blosc``: the 16-byte header's ``nbytes`` is the decoded size, and its ``cbytes``
  must be the piece's length (c-blosc would otherwise read the bytes that follow);
- ``gzip``: the trailer's ISIZE is the decoded size modulo 2**32;
- HDF5's ``lz4`` filter (``imagecodecs_lz4h5``): an 8-byte big-endian decoded size.

A declared size other than the expected one raises ``FrameError`` before any decoder
runs (a short chunk would leave bytes unwritten; a long one overruns or allocates what
a garbled header asks for). ``require_size`` checks what a step really decoded.

>>> import numcodecs
>>> blob = bytes(numcodecs.LZ4().encode(bytes(300)))
>>> declared_size("lz4", blob[:HEAD], blob[-TAIL:], len(blob))
300
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Sequence

import numpy as np

from gpulazy.spec import Codec

__all__ = ["FrameError", "HEAD", "TAIL", "declared_size", "check_declared", "require_size", "zstd_header",
           "ZSTD_MAGIC", "step_sizes", "crc32c"]

HEAD = 64  # header bytes every check may look at (the GPU path fetches this many per piece)
TAIL = 8   # trailer bytes (gzip's CRC-32 and ISIZE)
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_BLOSC_HEADER = 16
#: Steps whose output has as many bytes as their input.
_SIZE_PRESERVING = frozenset({"shuffle", "tiff_predictor", "predictor", "bitshuffle"})
#: Checksums appended to the stored bytes: the step strips this many.
_TRAILERS = {"crc32c": 4, "fletcher32": 4, "adler32": 4, "crc32": 4, "jenkins_lookup3": 4}


class FrameError(ValueError):
    """A piece whose framing does not fit it, or that declares or decodes to the wrong size.

    ``got`` is the decoded size the piece declares or decoded to, when known. The pipeline
    turns it into a ``ChunkDecodeError`` naming the file, offset and sizes.
    """

    def __init__(self, why: str, got: int | None = None):
        super().__init__(why)
        self.got = got


def zstd_header(head: bytes) -> tuple[int, int]:
    """``(header length, checksum length)`` of the zstd frame whose first bytes are ``head``."""
    fhd = head[4]
    single = (fhd >> 5) & 1
    fcs = {0: 1 if single else 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    did = (0, 1, 2, 4)[fhd & 3]
    return 5 + (0 if single else 1) + did + fcs, 4 if fhd & 4 else 0


def _zstd(head: bytes, tail: bytes, size: int) -> int | None:
    if len(head) < 5 or head[:4] != ZSTD_MAGIC:
        return None  # not a standard frame (skippable, legacy, garbage): the decoder says which
    fhd = head[4]
    if fhd & 0x08:
        raise FrameError("its zstd frame header has the reserved bit set (corrupt)")
    single, width = (fhd >> 5) & 1, {0: 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    if width == 0 and single:
        width = 1
    if not width:
        return None  # the frame does not say its content size
    start, _ = zstd_header(head)
    if size < start or len(head) < start:
        raise FrameError(f"its zstd frame header needs {start} bytes but the piece has {size}")
    fcs = int.from_bytes(head[start - width:start], "little")
    return fcs + 256 if width == 2 else fcs


def _lz4(head: bytes, tail: bytes, size: int) -> int:
    if size < 4:
        raise FrameError(f"an lz4 piece of {size} bytes cannot hold its 4-byte size prefix")
    return int.from_bytes(head[:4], "little")


def _blosc(head: bytes, tail: bytes, size: int) -> int:
    # c-blosc 1's header (README_HEADER.rst): version, versionlz, flags, typesize, then
    # nbytes, blocksize and cbytes as little-endian uint32.
    if size < _BLOSC_HEADER:
        raise FrameError(f"a blosc piece of {size} bytes cannot hold its {_BLOSC_HEADER}-byte header")
    nbytes, _, cbytes = struct.unpack_from("<III", head, 4)
    if cbytes != size:
        raise FrameError(f"its blosc header says the piece is {cbytes} bytes long, but it is {size} "
                         "(truncated, overlong, or not blosc)", got=nbytes)
    return nbytes


def _gzip(head: bytes, tail: bytes, size: int) -> int | None:
    if size < 18 or head[:2] != b"\x1f\x8b":
        return None  # not a gzip member: the decoder says why
    return int.from_bytes(tail[-4:], "little")


def _lz4h5(head: bytes, tail: bytes, size: int) -> int:
    # HDF5's lz4 filter: decoded size (8 bytes) and block size (4 bytes), big-endian, then blocks.
    if size < 12:
        raise FrameError(f"an HDF5 lz4 piece of {size} bytes cannot hold its 12-byte header")
    return int.from_bytes(head[:8], "big")


#: codec id -> (the decoded size its framing declares, modulus the field wraps at or None)
_DECLARED: dict[str, tuple[Callable[[bytes, bytes, int], int | None], int | None]] = {
    "zstd": (_zstd, None),
    "imagecodecs_zstd": (_zstd, None),
    "lz4": (_lz4, None),
    "blosc": (_blosc, None),
    "gzip": (_gzip, 1 << 32),
    "imagecodecs_lz4h5": (_lz4h5, None),
}


def declared_size(codec_id: str, head: bytes, tail: bytes, size: int) -> int | None:
    """The decoded size the piece's framing declares (``None``: it declares none).

    ``head``/``tail``: the piece's first ``HEAD`` and last ``TAIL`` bytes (fewer if it is
    shorter); ``size``: its length. Raises ``FrameError`` when the framing cannot be this
    piece's (a blosc header whose length is not the piece's, a prefix that does not fit).
    """
    entry = _DECLARED.get(codec_id)
    return None if entry is None else entry[0](head, tail, size)


def check_declared(codec_id: str, head: bytes, tail: bytes, size: int, expected: int | None) -> int | None:
    """``declared_size``, raising ``FrameError`` when it is not ``expected`` (``None``: unknown)."""
    n = declared_size(codec_id, head, tail, size)
    if n is None or expected is None:
        return n
    wrap = _DECLARED[codec_id][1]
    if n != (expected % wrap if wrap else expected):
        raise FrameError(f"its {codec_id} header says it decodes to {n} bytes", got=n)
    return n


def require_size(got: int, expected: int | None, what: str) -> None:
    """Raise ``FrameError`` unless ``what`` decoded to exactly ``expected`` bytes (``None``: any)."""
    if expected is not None and got != expected:
        raise FrameError(f"{what} decoded to {got} bytes", got=got)


def step_sizes(codec: Sequence[Codec], expected: Sequence[int]) -> list[list[int] | None]:
    """Each step's output size per piece, worked back from the final ``expected`` sizes
    (``None`` where a later step's input size cannot be known, e.g. behind a compressor)."""
    sizes: list[list[int] | None] = [None] * len(codec)
    cur: list[int] | None = [int(n) for n in expected]
    for s in range(len(codec) - 1, -1, -1):
        sizes[s] = cur
        cur = None if cur is None else _input_sizes(codec[s], cur)
    return sizes


def _input_sizes(c: Codec, out: list[int]) -> list[int] | None:
    if c.id in _SIZE_PRESERVING:
        return out
    if c.id in _TRAILERS:
        return [n + _TRAILERS[c.id] for n in out]
    if c.id == "delta":
        try:
            dt = np.dtype(c.get("dtype"))
            at = np.dtype(c.get("astype") or dt)
        except TypeError:
            return None
        return [n // dt.itemsize * at.itemsize for n in out]
    return None


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C (Castagnoli) of ``data`` (bytes or a contiguous NumPy array), continuing from ``crc``:
    Zarr's ``crc32c`` codec where no GPU checks it, and the reference the tests check nvCOMP's against."""
    import google_crc32c

    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8)
    return google_crc32c.extend(crc, data)
