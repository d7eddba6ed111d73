"""What every decode path shares: the host thread pool, error messages that name the file,
the one warning per codec that decodes on the host, and the decode figures in ``stats()``.

Below both ``_pipeline`` (which picks host or GPU for a batch) and ``gpu`` (which runs a
batch on the device and sends what it cannot decode to the host).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from gpulazy.codecs import host
from gpulazy.codecs._frames import FrameError
from gpulazy.device import Device
from gpulazy.errors import ChunkDecodeError, PerformanceWarning
from gpulazy.spec import ByteRange, Codec

__all__ = ["cores", "host_map", "host_pool", "decode_error", "size_error", "warn_host_fallback"]


def host_map(fn: Callable[[Any], Any], jobs: Sequence[Any]) -> list[Any]:
    """``[fn(j) for j in jobs]``, on every core when there are several jobs.

    numcodecs, imagecodecs and libdeflate release the GIL while they decode, so the pieces
    of one batch (a chunk's TIFF tiles, a whole-array read's HDF5 chunks) decode side by
    side. The first failing job's error is raised, as a loop would.
    """
    if len(jobs) <= 1:
        return [fn(j) for j in jobs]
    return list(host_pool().map(fn, jobs))


@functools.cache
def cores() -> int:
    """The cores this process may run on: ``host_pool``'s threads."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, n)


@functools.cache
def host_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The host decoders' threads: one per core this process may run on."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=cores(), thread_name_prefix="gpulazy-host-decode")


def _pad(where: Sequence[Any], n: int) -> list[Any]:
    return list(where) + [None] * (n - len(where))


def _host_one(piece: np.ndarray, codec: Sequence[Codec], expected: int | None, where: ByteRange | None,
              into: np.ndarray | None = None) -> np.ndarray:
    """``piece`` decoded through ``codec`` on this thread; errors name ``where``. ``into``: for a head
    (``codec`` is ``Codec("head", ...)`` alone), the 1-D uint8 buffer of ``expected`` bytes it decodes
    straight into (a slot of ``_beside.HostShare``'s pinned buffer: no buffer a head), returned."""
    try:
        if into is not None:
            assert len(codec) == 1 and codec[0].id == "head" and into.size == expected
            host.head_into(piece, codec[0], into)
            return into
        return host.decode(piece, codec, expected)
    except ChunkDecodeError:
        raise
    except FrameError as e:
        raise size_error(where, codec, expected, e.got, str(e)) from e
    except Exception as e:
        raise decode_error(where, codec, e) from e


def _names(codec: Sequence[Codec]) -> str:
    # "blosc_checked" is blosc decoded by gpulazy's checked fallback, "head" the first planes of a
    # chunk (ChunkSpec.head): the file says blosc, or the compressor the head is of.
    return "+".join(str(c.get("of")) if c.id == "head" else c.id.removesuffix("_checked") for c in codec) \
        or "uncompressed"


def size_error(where: ByteRange | None, codec: Sequence[Codec], expected: int | None, got: int | None,
               why: str) -> ChunkDecodeError:
    """The error for a piece whose framing or decoded size is not what its chunk needs."""
    want = "" if expected is None else f", expected {expected}"
    if where is None:
        return ChunkDecodeError(f"a {_names(codec)} chunk: {why}{want}; the data is corrupt", expected=expected,
                                got=got)
    return ChunkDecodeError(
        f"the {_names(codec)} chunk of {where.path!r} at offset {where.offset} ({where.nbytes} stored bytes): "
        f"{why}{want}; the file is corrupt or its metadata does not describe it",
        path=where.path, offset=where.offset, expected=expected, got=got)


def decode_error(where: ByteRange | None, codec: Sequence[Codec], e: BaseException) -> ChunkDecodeError:
    names = _names(codec)
    if where is None:
        return ChunkDecodeError(f"cannot decode a {names} chunk: {type(e).__name__}: {e}")
    return ChunkDecodeError(
        f"cannot decode the {names} chunk of {where.path!r} at offset {where.offset} ({where.nbytes} bytes): "
        f"{type(e).__name__}: {e}; the file is corrupt or its metadata names the wrong codec",
        path=where.path, offset=where.offset, expected=None, got=where.nbytes)


def warn_host_fallback(codec: Codec, device: Device) -> None:
    """Say once per codec id that it decodes on the host for a GPU array (not for a chunk's head, which
    decodes there by choice: a few stored bytes each, see ``ChunkSpec.head``)."""
    if codec.id == "head":
        return
    _warn_once(codec.id, device.name)


@functools.cache
def _warn_once(codec_id: str, device: str) -> None:
    warnings.warn(f"codec {codec_id!r} has no GPU decoder here: its chunks decode on the host and are copied "
                  f"to {device} (slower); nvCOMP (nvidia-nvcomp-cu13) decodes zstd, lz4, zlib, gzip and blosc "
                  "with lz4 or zstd inside and HDF5 bitshuffle+lz4 on the GPU",
                  PerformanceWarning, stacklevel=4)


def _record(nbytes: int, started: float, codec: Sequence[Codec], where: str, device: Device) -> None:
    from gpulazy.stats import default_stats

    rec = getattr(default_stats(), "record_decode", None)
    if rec is not None:
        rec(nbytes=nbytes, seconds=time.perf_counter() - started, codec="+".join(c.id for c in codec),
            where=where, device=device.name)
