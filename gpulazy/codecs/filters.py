"""Filters as CuPy kernels, each one launch for a whole batch of pieces.

- ``shuffle`` (numcodecs ``Shuffle(elementsize)``, HDF5's shuffle filter): bytes regrouped
  by position within an element; trailing bytes that make no whole element stay in place
  (HDF5's rule; numcodecs refuses such a piece outright).
- ``delta`` (numcodecs ``Delta(dtype, astype)``): a running sum. Integers sum with
  wrap-around in a block-wide scan, exactly what NumPy's ``cumsum`` cast to ``dtype``
  gives; floats (``dtype == astype``) sum one element after the other in one thread per
  piece, because a parallel scan would round differently from NumPy's sequential one.
- ``crc32c`` (Zarr v3): the 4-byte checksum checked (one nvCOMP CRC32 call over the batch) and
  stripped (a view); a mismatch goes to the host, which names the file.

The kernels take tables of device pointers, so one launch covers pieces that live in
different buffers. They are written here rather than taken from a library because no
installed package decodes these numcodecs filters on the GPU (kvikio's nvCOMP codecs
cover only compressors), and CuPy's own ``cumsum``/transpose would cost a launch or
more per piece.

>>> from gpulazy.codecs import filters
>>> from gpulazy.spec import Codec
>>> filters.handles(Codec.of("shuffle", elementsize=2)) in (True, False)
True
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from gpulazy.codecs.pieces import Pieces, aligned_starts
from gpulazy.spec import Codec

__all__ = ["supported", "handles", "decode", "aligned", "carve", "slots", "pointer_table", "kernel", "IDS"]

IDS = frozenset({"shuffle", "delta", "crc32c"})
_MAX_Y = 65535  # CUDA's grid y limit: batches larger than this launch in parts


@functools.cache
def supported() -> frozenset[str]:
    """Filter ids that run on the GPU here (empty without CuPy or a GPU)."""
    from gpulazy.device import gpu_count

    return IDS if gpu_count() > 0 else frozenset()


def handles(c: Codec) -> bool:
    """Whether this filter, with these parameters, has a GPU kernel."""
    if c.id not in supported():
        return False
    if c.id == "delta":
        return _delta_kind(c) is not None
    if c.id == "shuffle":
        return int(c.get("elementsize", 4)) >= 1
    return True


def decode(pieces: Sequence[Any], c: Codec) -> list[Any]:
    """Every piece (1-D CuPy uint8) through filter ``c``, one kernel launch for the batch."""
    if c.id == "crc32c":
        return _checked_crc32c(pieces)
    if c.id == "shuffle":
        es = int(c.get("elementsize", 4))
        if es <= 1:
            return list(pieces)
        _, views = carve([int(p.size) for p in pieces])
        _launch("unshuffle", _UNSHUFFLE, pieces, views, extra=(np.int64(es),), grid_x=_grid_x(pieces))
        return views
    if c.id == "delta":
        return _delta(pieces, c)
    raise ValueError(f"no GPU kernel for {c.id!r}")


def _checked_crc32c(pieces: Sequence[Any]) -> list[Any]:
    """Each piece without its 4-byte CRC32C trailer, the trailer checked on the GPU: one nvCOMP
    call over every payload where it lies (``_nvcomp_c.crc32c``), compared with the trailers on
    the device, one flag read back. A mismatch, a piece too short or no nvCOMP CRC32 here raises
    ``ValueError``: the host then decodes those pieces and names the file."""
    import cupy

    from gpulazy.codecs import _nvcomp_c

    if any(int(p.size) < 4 for p in pieces):
        raise ValueError("a crc32c piece shorter than its checksum")
    if not pieces or not _nvcomp_c.crc32c_available():
        raise ValueError("nvCOMP's CRC32 is not available here")
    payloads = [p[: p.size - 4] for p in pieces]
    stream = cupy.cuda.get_current_stream()
    got = _nvcomp_c.crc32c([p.data.ptr for p in payloads], [int(p.size) for p in payloads], stream)
    with stream:
        stored = cupy.concatenate([p[p.size - 4:] for p in pieces]).view(cupy.uint32)  # little-endian, as stored
        bad = bool((got != stored).any())
    if bad:
        raise ValueError("a crc32c checksum does not match")
    return payloads


def aligned(pieces: Sequence[Any], align: int) -> list[Any]:
    """``pieces`` with every start a multiple of ``align`` bytes (misaligned ones copied, in one launch)."""
    if align <= 1:
        return list(pieces)
    bad = [i for i, p in enumerate(pieces) if p.data.ptr % align]
    if not bad:
        return list(pieces)
    out = list(pieces)
    _, views = carve([int(pieces[i].size) for i in bad], align=max(align, 256))
    _launch("copy", _COPY, [pieces[i] for i in bad], views, grid_x=_grid_x([pieces[i] for i in bad]))
    for i, v in zip(bad, views):
        out[i] = v
    return out


# -- delta --------------------------------------------------------------------------------

_CTYPES = {"i1": "signed char", "u1": "unsigned char", "i2": "short", "u2": "unsigned short", "i4": "int",
           "u4": "unsigned int", "i8": "long long", "u8": "unsigned long long", "f4": "float", "f8": "double"}


def _delta_kind(c: Codec) -> str | None:
    """``"int"``, ``"float"`` or ``None`` (host only) for a Delta codec's dtypes."""
    try:
        dt = np.dtype(c.get("dtype"))
        at = np.dtype(c.get("astype") or dt)
    except TypeError:
        return None
    if not (dt.isnative and at.isnative) or dt.str[1:] not in _CTYPES or at.str[1:] not in _CTYPES:
        return None
    if dt.kind in "iu" and at.kind in "iu":
        return "int"
    if dt.kind == "f" and dt == at:
        return "float"
    return None


def _delta(pieces: Sequence[Any], c: Codec) -> list[Any]:
    dt = np.dtype(c.get("dtype"))
    at = np.dtype(c.get("astype") or dt)
    counts = [int(p.size) // at.itemsize for p in pieces]
    for p in pieces:
        if p.size % at.itemsize:
            raise ValueError(f"delta piece of {p.size} bytes is not a whole number of {at.str!r} elements")
    _, views = carve([n * dt.itemsize for n in counts])
    if _delta_kind(c) == "int":
        acc = "unsigned long long" if dt.itemsize == 8 else "unsigned int"
        src = _DELTA_INT.format(ti=_CTYPES[at.str[1:]], u=_CTYPES["u" + str(dt.itemsize)], acc=acc)
        _launch_blocks(f"delta_int_{at.str}_{dt.str}", src, pieces, views, counts, threads=1024)
    else:
        src = _DELTA_SEQ.format(t=_CTYPES[dt.str[1:]])
        _launch_threads(f"delta_seq_{dt.str}", src, pieces, views, counts)
    return views


# -- launching ----------------------------------------------------------------------------

def slots(sizes: Sequence[int], align: int = 256) -> Pieces:
    """One device buffer carved into slots of ``sizes`` bytes, each start ``align``-aligned
    (``aligned_starts``), as ``Pieces``: where a batch's decoded pieces go."""
    import cupy

    starts, total = aligned_starts(sizes, align)
    # At least a byte: CuPy gives an empty buffer no address, and the slots' addresses come from it.
    return Pieces.carved(cupy.empty(max(total, 1), dtype=np.uint8), starts, sizes)


def carve(sizes: Sequence[int], align: int = 256) -> tuple[Any, list[Any]]:
    """``slots`` as its buffer and a view per slot."""
    out = slots(sizes, align)
    return out.owners[0], list(out)


def pointer_table(arrays: Sequence[Any]) -> Any:
    """The arrays' device addresses as a uint64 device array: one launch reaches pieces in any buffer."""
    import cupy

    return cupy.asarray(np.array([a.data.ptr for a in arrays], dtype=np.uint64))


@functools.cache
def kernel(name: str, source: str) -> Any:
    """A compiled ``cupy.RawKernel`` for ``source``, once per process."""
    import cupy

    # ``name`` only keys the cache; the entry point is the one kernel the source defines.
    entry = source.split('extern "C" __global__ void ', 1)[1].split("(", 1)[0]
    return cupy.RawKernel(source, entry)


def _grid_x(pieces: Sequence[Any]) -> int:
    longest = max((int(p.size) for p in pieces), default=0)
    return max(1, min(4096, -(-longest // (256 * 4))))


def _launch(name: str, source: str, srcs: Sequence[Any], dsts: Sequence[Any], *, extra: tuple = (),
            grid_x: int = 1) -> None:
    """Kernels with ``blockIdx.y`` = piece and a grid-stride loop over its bytes."""
    import cupy

    k = kernel(name, source)
    for a in range(0, len(srcs), _MAX_Y):
        s, d = srcs[a:a + _MAX_Y], dsts[a:a + _MAX_Y]
        sizes = cupy.asarray(np.array([int(x.size) for x in d], dtype=np.int64))
        k((grid_x, len(s)), (256,), (pointer_table(s), pointer_table(d), sizes, *extra))


def _launch_blocks(name: str, source: str, srcs: Sequence[Any], dsts: Sequence[Any], counts: Sequence[int], *,
                   threads: int) -> None:
    """Kernels with one block per piece (``blockIdx.x`` = piece)."""
    import cupy

    if not srcs:
        return
    k = kernel(name, source)
    n = cupy.asarray(np.array(counts, dtype=np.int64))
    k((len(srcs),), (threads,), (pointer_table(srcs), pointer_table(dsts), n))


def _launch_threads(name: str, source: str, srcs: Sequence[Any], dsts: Sequence[Any], counts: Sequence[int]
                    ) -> None:
    """Kernels with one thread per piece."""
    import cupy

    if not srcs:
        return
    k = kernel(name, source)
    n = cupy.asarray(np.array(counts, dtype=np.int64))
    k((-(-len(srcs) // 64),), (64,), (pointer_table(srcs), pointer_table(dsts), n, np.int64(len(srcs))))


# -- kernel sources -------------------------------------------------------------------------

_COPY = r"""
extern "C" __global__ void gl_copy(const unsigned long long* src, const unsigned long long* dst,
                                   const long long* n) {
    const unsigned char* s = (const unsigned char*)src[blockIdx.y];
    unsigned char* d = (unsigned char*)dst[blockIdx.y];
    long long len = n[blockIdx.y];
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < len;
         k += (long long)gridDim.x * blockDim.x)
        d[k] = s[k];
}
"""

_UNSHUFFLE = r"""
extern "C" __global__ void gl_unshuffle(const unsigned long long* src, const unsigned long long* dst,
                                        const long long* n, long long es) {
    const unsigned char* s = (const unsigned char*)src[blockIdx.y];
    unsigned char* d = (unsigned char*)dst[blockIdx.y];
    long long len = n[blockIdx.y];
    long long count = len / es, body = count * es;
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < len;
         k += (long long)gridDim.x * blockDim.x) {
        if (k < body) {
            long long i = k / es, j = k - i * es;
            d[k] = s[j * count + i];
        } else {
            d[k] = s[k];  // bytes past the last whole element are not shuffled
        }
    }
}
"""

# A block-wide inclusive scan over tiles of blockDim.x elements, carrying the running sum.
# Unsigned arithmetic: conversion to an unsigned type and its overflow are modular (well
# defined), which is NumPy's wrap-around once cast to ``dtype``.
_DELTA_INT = r"""
typedef {ti} TI;
typedef {u} U;
typedef {acc} A;
extern "C" __global__ void gl_delta_int(const unsigned long long* src, const unsigned long long* dst,
                                        const long long* n) {{
    __shared__ A sums[32];
    const TI* s = (const TI*)src[blockIdx.x];
    U* d = (U*)dst[blockIdx.x];
    long long len = n[blockIdx.x];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    A carry = 0;
    for (long long base = 0; base < len; base += blockDim.x) {{
        long long k = base + threadIdx.x;
        A v = k < len ? (A)s[k] : (A)0;
        for (int o = 1; o < 32; o <<= 1) {{
            A t = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += t;
        }}
        if (lane == 31) sums[warp] = v;
        __syncthreads();
        if (warp == 0) {{
            A w = lane < nwarps ? sums[lane] : (A)0;
            for (int o = 1; o < 32; o <<= 1) {{
                A t = __shfl_up_sync(0xffffffffu, w, o);
                if (lane >= o) w += t;
            }}
            sums[lane] = w;
        }}
        __syncthreads();
        v += carry + (warp > 0 ? sums[warp - 1] : (A)0);
        if (k < len) d[k] = (U)v;
        carry += sums[nwarps - 1];
        __syncthreads();
    }}
}}
"""

_DELTA_SEQ = r"""
typedef {t} T;
extern "C" __global__ void gl_delta_seq(const unsigned long long* src, const unsigned long long* dst,
                                        const long long* n, long long count) {{
    long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (p >= count) return;
    const T* s = (const T*)src[p];
    T* d = (T*)dst[p];
    long long len = n[p];
    T acc = 0;
    for (long long k = 0; k < len; ++k) {{
        acc = k ? acc + s[k] : s[0];
        d[k] = acc;
    }}
}}
"""
