"""Host decoding: numcodecs for Zarr/HDF5 codecs, imagecodecs for TIFF's, plus a few of our own.

Used for every codec on ``"cpu"``, and on a GPU for what nvCOMP cannot decode. A codec
is built once per distinct ``Codec`` value (they are hashable). Before a C decoder runs,
the size its piece's framing declares is checked (``gpulazy.codecs._frames``); after it,
what it decoded: a step never hands on more or fewer bytes than the chunk needs.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Sequence

import numpy as np

from gpulazy.codecs._frames import (HEAD, TAIL, FrameError, check_declared, crc32c, require_size, step_sizes,
                                    zstd_header)
from gpulazy.spec import Codec

__all__ = ["decode", "decode_step", "head_into", "unsupported_reason", "SPECIAL", "HeadShort"]


def _strip_crc32c(data: np.ndarray, codec: Codec, expected: int | None) -> np.ndarray:
    # Zarr v3's crc32c codec appends the CRC32C of the bytes before it (little-endian): a
    # step of the chain like any other, so it is checked on every read, as zarr-python does
    # (a corrupt chunk read as data when only verify=True checked it).
    if data.size < 4:
        raise FrameError(f"a crc32c piece of {data.size} bytes cannot hold its 4-byte checksum")
    payload = data[:-4]
    stored = int.from_bytes(data[-4:].tobytes(), "little")
    got = crc32c(payload)
    if got != stored:
        raise FrameError(f"its crc32c checksum does not match: stored {stored:#010x}, computed {got:#010x}")
    return payload


def _tiff_predictor(data: np.ndarray, codec: Codec, expected: int | None) -> np.ndarray:
    # TIFF predictors work along each row of a strip/tile (params dtype, width, samples, kind
    # 2 = horizontal differencing, 3 = floating point; dist). imagecodecs' delta_decode and
    # floatpred_decode are what tifffile uses; they run on native-order values, so the bytes
    # go to native order and back to the file's (the pipeline byte-swaps after decoding).
    import imagecodecs

    dt = np.dtype(codec.get("dtype"))
    width, samples, dist = int(codec.get("width")), int(codec.get("samples")), int(codec.get("dist", 1))
    require_size(data.size, expected, "the piece before its predictor")  # never undo a short or long row
    values = data.view(dt.newbyteorder("=") if codec.get("kind") == 3 else dt).reshape(-1, width, samples)
    values = values.astype(dt.newbyteorder("="), copy=True)  # writable, native
    undo = imagecodecs.floatpred_decode if codec.get("kind") == 3 else imagecodecs.delta_decode
    values = undo(values, axis=-2, dist=dist, out=values)
    return values.astype(dt, copy=False).reshape(-1).view(np.uint8)


def _blosc_checked(data: np.ndarray, codec: Codec, expected: int | None) -> np.ndarray:
    from gpulazy.codecs import blosc

    out = blosc.decode_checked(data, codec, expected)
    return decode_step(data, Codec("blosc"), expected) if out is None else out


class HeadShort(FrameError):
    """A head of a stored piece (``ChunkSpec.head``) did not decode to the bytes asked of it: its
    frame needs more stored bytes than ``head_allowance`` gives (another encoder's), or cannot be
    checked or decoded from a head. The reader reads the whole chunk instead."""


def _head(data: np.ndarray, codec: Codec, expected: int | None) -> np.ndarray:
    # The first ``expected`` decoded bytes of a zstd frame of which ``data`` is the first stored bytes.
    if expected is None:
        raise FrameError(f"a head of unknown size of a {codec.get('size')}-byte chunk")
    out = np.empty(expected, np.uint8)
    head_into(data, codec, out)
    return out


def head_into(data: np.ndarray, codec: Codec, out: np.ndarray) -> None:
    """The first ``out.size`` decoded bytes of a zstd frame of which ``data`` is the first stored
    bytes (``ChunkSpec.head``; ``codec``: its ``Codec("head", of=..., size=...)``), into ``out``
    (1-D uint8). Whatever it cannot decode or check from them (a frame that needs more, a garbled
    one, one with a checksum of its content, which covers every byte, or without its decoded
    size, which must be the chunk's) is ``HeadShort``: the reader reads the whole chunk instead,
    which decodes it or says what is wrong with it."""
    size, expected = int(codec.get("size")), int(out.size)
    if expected > size:
        raise FrameError(f"a head of {expected} bytes of a {size}-byte chunk")
    head = data[:HEAD].tobytes()
    try:
        declared = check_declared("zstd", head, b"", int(data.size), size)
    except FrameError as e:
        raise HeadShort(str(e), got=e.got) from e
    if declared is None:  # the whole read is what checks the frame decodes to the chunk's size
        raise HeadShort("its zstd frame does not say how many bytes it decodes to")
    if zstd_header(head)[1]:  # (a standard frame: it declared its size)
        raise HeadShort("its zstd frame has a checksum of its content, which a head cannot check")
    try:
        got = _zstd_head(data, out)
    except Exception as e:
        raise HeadShort(f"{type(e).__name__}: {e}") from e
    if got < expected:
        raise HeadShort(f"its zstd frame ended after {got} decoded bytes of {data.size} stored", got=got)


def _zstd_head(data: np.ndarray, out: np.ndarray) -> int:
    # python-zstandard decodes block by block into ``out`` and stops once it is full (numcodecs
    # and imagecodecs decode whole frames only); it releases the GIL while it decodes.
    reader = _zstd_decompressor().stream_reader(data, read_across_frames=True)
    got = 0
    while got < out.size:
        n = reader.readinto(out[got:])
        if not n:
            break
        got += n
    return got


_local = threading.local()


def _zstd_decompressor() -> Any:
    # One per thread, kept: a decompressor holds its frame's window (a whole 8 MiB chunk for
    # zarr's single-segment frames), which one made per head allocated each time. The heads of
    # one plane of a 2 GiB zstd Zarr (64 of 128 KiB, 16 threads of an H100 host) took 0.71 ms
    # each against 1.02 (0.2 ms on an idle core of another machine).
    d = getattr(_local, "zstd", None)
    if d is None:
        import zstandard

        d = _local.zstd = zstandard.ZstdDecompressor()
    return d


def _bitshuffle_lz4(data: np.ndarray, codec: Codec, expected: int | None) -> np.ndarray:
    from gpulazy.codecs import bitshuffle

    return bitshuffle.decode_host(data, codec, expected)


#: Steps gpulazy decodes itself: ``fn(data, codec, expected_nbytes) -> uint8 array``.
SPECIAL: dict[str, Callable[[np.ndarray, Codec, int | None], np.ndarray]] = {
    "crc32c": _strip_crc32c,
    "tiff_predictor": _tiff_predictor,
    "blosc_checked": _blosc_checked,  # blosc pieces the GPU refused: every stream checked (codecs.blosc)
    "bitshuffle_lz4": _bitshuffle_lz4,  # HDF5 filter 32008 (codecs.bitshuffle)
    "head": _head,  # the first planes of a zstd chunk from a head of its bytes (ChunkSpec.head)
}
#: The package a special step needs, for ``unsupported_reason``.
_SPECIAL_NEEDS = {"tiff_predictor": "imagecodecs", "bitshuffle_lz4": "lz4", "blosc_checked": "lz4",
                  "head": "zstandard"}
#: Codecs whose C decoder enforces the size their framing declares, so they may decode
#: straight into a buffer of that size (no copy) once ``check_declared`` has passed.
_ENFORCES_DECLARED = frozenset({"zstd", "lz4", "blosc"})


def decode(data: Any, codec: Sequence[Codec], expected: int | None) -> np.ndarray:
    """``data`` (uint8, host) through every step of ``codec``; a 1-D uint8 array.

    ``expected``: the decoded size in bytes, or ``None`` when unknown. Every step whose
    output size follows from it (``step_sizes``) must produce exactly
    that many bytes, and a framing that declares another size is refused before its
    decoder runs: ``FrameError`` (the pipeline names the file).
    """
    out = np.asarray(data).reshape(-1).view(np.uint8)
    sizes = step_sizes(codec, [expected]) if expected is not None else [None] * len(codec)
    for c, want in zip(codec, sizes):
        out = decode_step(out, c, None if want is None else want[0])
    # imagecodecs hands back bytes (read-only); assembly byte-swaps big-endian data in place.
    return out if out.flags.writeable else out.copy()


def decode_step(data: np.ndarray, c: Codec, want: int | None) -> np.ndarray:
    """One step over one piece (an exact-length uint8 view), held to ``want`` bytes when known."""
    special = SPECIAL.get(c.id)
    if special is not None:
        out = special(data, c, want)
    else:
        size = int(data.size)
        declared = check_declared(c.id, data[:HEAD].tobytes(), data[max(0, size - TAIL):].tobytes(), size, want)
        out = _inflate(data, c, want)
        if out is not None:
            pass
        elif declared is not None and declared == want and c.id in _ENFORCES_DECLARED:
            out = _as_bytes(_build(c).decode(data, out=np.empty(want, np.uint8)))
        else:  # the decoder sizes its own output: what it returns is what it decoded
            out = _as_bytes(_build(c).decode(data))
    require_size(int(out.size), want, f"its {c.id} step")
    return out


#: Deflate-family codec id -> the libdeflate function for its framing.
_LIBDEFLATE = {"zlib": "zlib_decompress", "gzip": "gzip_decompress", "imagecodecs_zlib": "zlib_decompress",
               "imagecodecs_deflate": "zlib_decompress"}


def _inflate(data: np.ndarray, c: Codec, want: int | None) -> np.ndarray | None:
    """A Deflate-family piece through libdeflate (the ``deflate`` package), or None to use the
    codec's own decoder.

    libdeflate decodes zlib/gzip/raw Deflate into a buffer of the known decoded size, verifies
    the Adler-32/CRC-32 trailer, and releases the GIL: 2.3x Python's zlib on one core here
    (``benchmarks/bench_codecs.py --host-deflate``), and the pieces of a batch decode on all
    cores (``_run.host_pool``). A stream it refuses (corrupt, a preset dictionary, several
    gzip members) goes to the codec's own decoder, which decodes it or says what is wrong.
    """
    if want is None or c.id not in _LIBDEFLATE:
        return None
    try:
        import deflate
    except ImportError:  # an optional speed-up: numcodecs/imagecodecs decode without it
        return None
    fn = getattr(deflate, "deflate_decompress" if c.get("raw") else _LIBDEFLATE[c.id])
    try:
        out = fn(data, want)  # a stream that decodes short returns fewer bytes: require_size says so
    except deflate.DeflateError:
        return None
    return np.frombuffer(out, np.uint8)


def _as_bytes(x: Any) -> np.ndarray:
    from numcodecs.compat import ensure_ndarray

    out = ensure_ndarray(x).reshape(-1).view(np.uint8)
    # Codecs that return ``bytes`` (GZip, Zlib) give a read-only view; the byte swap after
    # decoding works in place.
    return out if out.flags.writeable else out.copy()


@functools.cache
def _build(c: Codec) -> Any:
    if c.id.startswith("imagecodecs_"):
        return _Imagecodec(c.id.removeprefix("imagecodecs_"), dict(c.params))
    import numcodecs

    return numcodecs.get_codec(c.config())


class _Imagecodec:
    """An imagecodecs ``<name>_decode`` function with the numcodecs ``decode`` signature."""

    def __init__(self, name: str, params: dict):
        import imagecodecs

        self.fn = getattr(imagecodecs, f"{name}_decode")
        self.params = params

    def decode(self, buf: Any, out: Any = None) -> Any:
        return self.fn(bytes(buf) if not isinstance(buf, (bytes, np.ndarray)) else buf, **self.params)


def unsupported_reason(c: Codec) -> str:
    """Why ``c`` cannot be decoded on the host here, or ``""`` when it can."""
    if c.id in SPECIAL:
        return _missing(_SPECIAL_NEEDS.get(c.id))
    try:
        _build(c)
    except ImportError as e:
        pkg = "imagecodecs" if c.id.startswith("imagecodecs_") else "numcodecs"
        return f"{e}; install it with: pip install {pkg}"
    except Exception as e:  # numcodecs raises ValueError for an unknown id
        return (f"{type(e).__name__}: {e}; no installed codec library knows it (numcodecs, imagecodecs: "
                "pip install numcodecs imagecodecs)")
    return ""


def _missing(package: str | None) -> str:
    import importlib.util

    if package is None or importlib.util.find_spec(package) is not None:
        return ""
    return f"it needs the package {package!r}; install it with: pip install {package}"
