"""nvCOMP's batched C API through ctypes: a whole batch decoded asynchronously on a caller's stream.

Why not nvCOMP's Python API (``nvidia.nvcomp.Codec.decode``): its call holds the calling thread
until the decode is done, and calls from several threads ran one after another. On an H100,
4 GiB of zstd (8 MiB pieces) decoded at 21 GB/s from one thread and 17.9 from four, while the
C API's calls on four streams, 128 pieces each, ran side by side at 38.4 GB/s (512 pieces in
one call: 44). ctypes lets go of the GIL during each call, and the calls return once the
kernels are queued. The library is ``libnvcomp`` from the ``nvidia-libnvcomp-cu13`` wheel,
which the ``nvidia-nvcomp-cu13`` Python package installs.

Every decompress-options struct of nvCOMP 6 is 64 bytes whose zeroed form is the default;
Zstd, LZ4 and Deflate share the signatures used here (``nvcomp/zstd.h`` and its siblings).

``crc32c`` checks Zarr's crc32c codec with ``nvcompBatchedCRC32Async`` and its CRC32-C preset
(``nvcomp/crc32.h``; not in nvCOMP's Python API): one call over every piece of a batch, each
read where it lies (an address table), so no piece is copied first.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from typing import Any, NamedTuple, Sequence

import numpy as np

__all__ = ["ALGORITHMS", "NvcompError", "Alignments", "available", "alignments", "crc32c", "crc32c_available",
           "decompress", "STATUS"]

#: The algorithms decoded through this module (nvCOMP's names, as in ``nvcompBatched<name>...``).
ALGORITHMS = ("Zstd", "LZ4", "Deflate")

#: ``nvcompStatus_t`` values (``nvcomp/shared_types.h``) -> names, for messages.
STATUS = {0: "success", 10: "invalid value", 11: "not supported", 12: "cannot decompress", 13: "bad checksum",
          14: "cannot verify checksums", 15: "output buffer too small", 16: "wrong header length",
          17: "alignment", 18: "chunk size too large", 20: "wrong input length", 21: "batch size too large",
          1000: "CUDA error", 10000: "internal error"}


class NvcompError(RuntimeError):
    """A call nvCOMP refused for the whole batch (its status says why)."""


class Alignments(NamedTuple):
    """Byte alignments nvCOMP requires of each input, output and the scratch buffer."""

    input: int
    output: int
    temp: int


class _Opts(ctypes.Structure):
    _fields_ = [("raw", ctypes.c_char * 64)]


class _Align(ctypes.Structure):
    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


_OPTS = _Opts()  # zeroed: the default backend, no bitshuffle, bytes


class _CRC32Spec(ctypes.Structure):
    """``nvcompCRC32Spec_t`` (32 bytes)."""

    _fields_ = [("poly", ctypes.c_uint32), ("init", ctypes.c_uint32), ("ref_in", ctypes.c_bool),
                ("ref_out", ctypes.c_bool), ("xorout", ctypes.c_uint32), ("reserved", ctypes.c_char * 16)]


class _CRC32KernelConf(ctypes.Structure):
    """``nvcompCRC32KernelConf_t`` (32 bytes), filled by ``nvcompBatchedCRC32GetHeuristicConf``."""

    _fields_ = [("kernel_kind", ctypes.c_int32), ("bytes_per_read", ctypes.c_int32),
                ("blocks_per_msg", ctypes.c_int32), ("reserved", ctypes.c_char * 20)]


class _CRC32Opts(ctypes.Structure):
    """``nvcompBatchedCRC32Opts_t`` (128 bytes), passed by value."""

    _fields_ = [("spec", _CRC32Spec), ("kernel_conf", _CRC32KernelConf), ("reserved", ctypes.c_char * 64)]


#: nvCOMP's ``nvcompCRC32_C`` preset (CRC-32/ISCSI, Zarr's crc32c codec), as ``nvcomp/crc32.h`` defines it.
_CRC32C = dict(poly=0x1EDC6F41, init=0xFFFFFFFF, ref_in=True, ref_out=True, xorout=0xFFFFFFFF)
_ONLY_SEGMENT = 0  # nvcompCRC32OnlySegment: each piece is a whole message


@functools.cache
def _library() -> Any:
    """libnvcomp with the three entry points typed per algorithm, or None where it does not load."""
    spec = importlib.util.find_spec("nvidia.libnvcomp") if importlib.util.find_spec("nvidia") else None
    names = ["libnvcomp.so.6", "libnvcomp.so"]
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            lib64 = os.path.join(root, "lib64")
            if os.path.isdir(lib64):
                names[:0] = sorted(os.path.join(lib64, n) for n in os.listdir(lib64) if n.startswith("libnvcomp.so"))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        size, ptr = ctypes.c_size_t, ctypes.c_void_p
        for algo in ALGORITHMS:
            getattr(lib, f"nvcompBatched{algo}DecompressGetRequiredAlignments").argtypes = [_Opts, ctypes.POINTER(_Align)]
            getattr(lib, f"nvcompBatched{algo}DecompressGetTempSize").argtypes = [
                size, size, _Opts, ctypes.POINTER(size), size, ptr]
            getattr(lib, f"nvcompBatched{algo}DecompressAsync").argtypes = [
                ptr, ptr, ptr, ptr, size, ptr, size, ptr, _Opts, ptr, ptr]
        return lib
    return None


@functools.cache
def _crc_library() -> Any:
    """libnvcomp with its CRC32 entry points typed, or None (no libnvcomp, or one without them)."""
    lib = _library()
    if lib is None:
        return None
    size, ptr = ctypes.c_size_t, ctypes.c_void_p
    try:
        lib.nvcompBatchedCRC32GetHeuristicConf.argtypes = [ptr, size, ctypes.POINTER(_CRC32KernelConf), size, ptr]
        lib.nvcompBatchedCRC32Async.argtypes = [ptr, ptr, size, ptr, _CRC32Opts, ctypes.c_int, ptr, ptr]
    except AttributeError:  # an nvCOMP before 5.1
        return None
    return lib


def crc32c_available() -> bool:
    """Whether ``crc32c`` can run here (libnvcomp loads and has ``nvcompBatchedCRC32Async``)."""
    return _crc_library() is not None


def crc32c(ptrs: Sequence[int], sizes: Sequence[int], stream: Any) -> Any:
    """CRC32C of piece ``k`` (``sizes[k]`` bytes at device address ``ptrs[k]``), every piece in one
    nvCOMP call queued on CuPy ``stream``; returns a CuPy uint32 array ordered on ``stream``
    (nothing waited for here)."""
    import cupy

    n = len(ptrs)
    lib = _crc_library()
    opts = _CRC32Opts()
    opts.spec = _CRC32Spec(**_CRC32C)
    # Given the largest size, the heuristic reads nothing on the device and does not synchronize.
    largest = max(1, int(max(sizes, default=1)))
    _check(lib.nvcompBatchedCRC32GetHeuristicConf(None, n, ctypes.byref(opts.kernel_conf), largest, stream.ptr),
           "CRC32", "kernel configuration")
    table = np.empty((2, n), dtype=np.uint64)
    table[0], table[1] = ptrs, sizes
    with stream:
        dev_table = cupy.asarray(table)
        out = cupy.empty(max(n, 1), dtype=np.uint32)
        if n:
            base = dev_table.data.ptr
            _check(lib.nvcompBatchedCRC32Async(base, base + 8 * n, n, out.data.ptr, opts, _ONLY_SEGMENT, None,
                                               stream.ptr), "CRC32", "checksum")
    return out[:n]


def available() -> bool:
    """Whether libnvcomp loads here with every entry point this module calls."""
    try:
        return _library() is not None
    except AttributeError:  # an nvCOMP without one of the symbols
        return False


@functools.cache
def alignments(algorithm: str) -> Alignments:
    """What ``algorithm`` requires of its buffers' addresses."""
    out = _Align()
    _check(getattr(_library(), f"nvcompBatched{algorithm}DecompressGetRequiredAlignments")(_OPTS, ctypes.byref(out)),
           algorithm, "alignments")
    return Alignments(max(1, out.input), max(1, out.output), max(1, out.temp))


def decompress(algorithm: str, src: Sequence[int], csizes: Sequence[int], dst: Sequence[int], dsizes: Sequence[int],
               stream: Any) -> tuple[np.ndarray, np.ndarray]:
    """Decode piece ``k`` (``csizes[k]`` bytes at device address ``src[k]``) into ``dsizes[k]`` bytes at
    ``dst[k]``, every piece in one call queued on CuPy ``stream``, then wait for it.

    Returns ``(decoded sizes, statuses)`` as host arrays: piece ``k`` is good where its status is
    0 and its size is ``dsizes[k]``. Raises ``NvcompError`` when nvCOMP refuses the whole call.
    Addresses must meet ``alignments(algorithm)``. Scratch comes from CuPy's pool on ``stream``.
    """
    import cupy

    n = len(src)
    lib = _library()
    table = np.empty((4, n), dtype=np.uint64)
    table[0], table[1], table[2], table[3] = src, csizes, dst, dsizes
    temp_bytes = ctypes.c_size_t(0)
    largest, total = int(np.max(dsizes)), int(np.sum(dsizes))
    _check(getattr(lib, f"nvcompBatched{algorithm}DecompressGetTempSize")(
        n, largest, _OPTS, ctypes.byref(temp_bytes), total, stream.ptr), algorithm, "scratch size")
    with stream:  # the pool hands these to this stream's later allocations only: ordered after the call
        dev_table = cupy.asarray(table)
        results = cupy.zeros(n * 2, dtype=np.uint64)  # decoded sizes, then statuses (as 8-byte slots)
        temp = cupy.empty(max(1, temp_bytes.value) + alignments(algorithm).temp, dtype=np.uint8)
        temp_at = -temp.data.ptr % alignments(algorithm).temp
        base = dev_table.data.ptr
        _check(getattr(lib, f"nvcompBatched{algorithm}DecompressAsync")(
            base, base + 8 * n, base + 24 * n, results.data.ptr, n, temp.data.ptr + temp_at, temp_bytes.value,
            base + 16 * n, _OPTS, results.data.ptr + 8 * n, stream.ptr), algorithm, "decompress")
        stream.synchronize()  # through CuPy, which lets go of the GIL meanwhile
        host = results.get(stream=stream)
    statuses = host[n:].view(np.int32)[:n].copy()  # an int32 per piece, packed from the start of the slots
    return host[:n].astype(np.int64), statuses


def _check(status: int, algorithm: str, what: str) -> None:
    if status != 0:
        raise NvcompError(f"nvCOMP {algorithm} {what}: status {status} ({STATUS.get(status, 'unknown')})")
