"""Blocks gathered from their decoded streams and unshuffled into place: one launch per batch.

Blosc (``gpulazy.codecs.blosc``) and HDF5 bitshuffle (``gpulazy.codecs.bitshuffle``) both
end in blocks whose bytes were byte- or bit-shuffled, then compressed as one or more
streams. Once nvCOMP has decoded every stream of a batch, one launch of ``_KERNEL``
writes every block of every chunk where it belongs. A row of the table (int64) is

    (destination address, block bytes, type size, mode, first stream's slot, bytes per stream)

and ``pointers[slot]`` (uint64) is the device address of that stream's bytes: a block's
shuffled bytes ``[s * neblock, (s + 1) * neblock)`` are stream ``first + s``. Modes are
those of ``blosc.unshuffle_block``, the host twin: 0 copy; 1 byte unshuffle; 2 bit
unshuffle when the element count is a multiple of 8, else a copy; in every mode the
trailing bytes that make no whole element are copied as they are.

The bit unshuffle takes one thread per (byte position ``j``, group ``g`` of 8 elements):
bit plane ``8 j + b`` is the ``count / 8`` bytes from ``(8 j + b) * count / 8``, and its
byte ``g`` holds bit ``b`` of byte ``j`` of elements ``8 g`` .. ``8 g + 7`` (least
significant bit first). The thread loads those 8 bytes (one per plane; neighbouring
threads load neighbouring bytes, so a warp's loads are coalesced), packs them into a
64-bit word, transposes it as an 8 x 8 bit matrix with three shift-and-mask steps
(bitshuffle's ``TRANS_BIT_8X8``), and stores byte ``e`` of the result as byte ``j`` of
element ``8 g + e``. The former kernel took one thread per output byte and gathered its 8
bits from 8 loads, each behind a 64-bit division: per 8 output bytes, 64 loads and some 70
divisions where this kernel makes 8 loads and 2 divisions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["unshuffle_blocks", "grid", "ROW", "THREADS"]

ROW = 6  # int64 columns of a row
THREADS = 256
_MAX_Y = 65535  # CUDA's grid y limit: the kernel strides over rows past it


def unshuffle_blocks(rows: Any, pointers: Any) -> None:
    """Every block of ``rows`` (an (n, 6) int64 table) written from the streams at ``pointers``.

    One kernel launch on the current stream (the two tables copied up, nothing read back).
    The caller keeps the source and destination arrays alive until the launch is queued
    (CuPy's memory pool orders reuse on the same stream after it).
    """
    import cupy

    from gpulazy.codecs import filters

    table = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1, ROW)
    if not len(table):
        return
    ptrs = np.ascontiguousarray(pointers, dtype=np.uint64).reshape(-1)
    k = filters.kernel("unshuffle_blocks", _KERNEL)
    k(grid(table), (THREADS,), (cupy.asarray(ptrs), cupy.asarray(table), np.int64(len(table))))


def grid(table: np.ndarray) -> tuple[int, int]:
    """The launch's grid for a non-empty table: ~16 bytes (or 2 bit groups) per thread on the
    longest block along x, a block per row along y (rows past 65535 strided)."""
    longest = int(table[:, 1].max())
    return max(1, min(256, -(-longest // (16 * THREADS)))), min(len(table), _MAX_Y)


# Blocks along y (grid-stride), a block's work items along x (grid-stride). A bit-shuffled
# block has count / 8 * ts group items, then one item per trailing byte; any other block one
# item per byte. Byte q of a block's shuffled bytes lies in stream first + q / neblock at
# q % neblock (``gl_at``); a group's 8 planes (count bytes from j * count) lie in one stream
# whenever the block has 1 or ts streams (every blosc and HDF5 block), else they are
# gathered byte by byte.
_KERNEL = r"""
__device__ __forceinline__ unsigned char gl_at(const unsigned long long* src, long long first, long long neblock,
                                               long long q) {
    long long s = q / neblock;
    return ((const unsigned char*)src[first + s])[q - s * neblock];
}
// An 8 x 8 bit matrix (byte r = row r, bit c = column c) transposed: bitshuffle's TRANS_BIT_8X8.
__device__ __forceinline__ unsigned long long gl_t8(unsigned long long x) {
    unsigned long long t;
    t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAull;
    x = x ^ t ^ (t << 7);
    t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCull;
    x = x ^ t ^ (t << 14);
    t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ull;
    x = x ^ t ^ (t << 28);
    return x;
}
__device__ __forceinline__ void gl_bit_group(const unsigned long long* src, unsigned char* d, long long count,
                                             long long ts, long long first, long long neblock, long long j,
                                             long long g) {
    long long n8 = count / 8, q = j * count, s = q / neblock, at = q - s * neblock;
    unsigned long long x = 0;
    if (at + count <= neblock) {
        const unsigned char* p = (const unsigned char*)src[first + s] + at + g;
        for (int b = 0; b < 8; ++b) x |= (unsigned long long)p[b * n8] << (8 * b);
    } else {
        for (int b = 0; b < 8; ++b) x |= (unsigned long long)gl_at(src, first, neblock, q + b * n8 + g) << (8 * b);
    }
    x = gl_t8(x);
    unsigned char* o = d + 8 * g * ts + j;
    if (ts == 1 && ((unsigned long long)o & 7) == 0) {
        *(unsigned long long*)o = x;  // 8 whole one-byte elements, little-endian: byte e is element e
    } else {
        for (int e = 0; e < 8; ++e) o[e * ts] = (unsigned char)(x >> (8 * e));
    }
}
extern "C" __global__ void gl_unshuffle_blocks(const unsigned long long* src, const long long* rows,
                                               long long nblk) {
    for (long long blk = blockIdx.y; blk < nblk; blk += gridDim.y) {
        const long long* row = rows + 6 * blk;
        unsigned char* d = (unsigned char*)row[0];
        long long bsize = row[1], ts = row[2], mode = row[3], first = row[4], neblock = row[5];
        long long count = bsize / ts, body = count * ts;
        int bits = (mode == 2 && count % 8 == 0);
        long long n8 = count / 8, groups = bits ? n8 * ts : 0, skip = bits ? body : 0;
        long long items = groups + bsize - skip;
        for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < items;
             k += (long long)gridDim.x * blockDim.x) {
            if (k < groups) {
                long long j = k / n8;
                gl_bit_group(src, d, count, ts, first, neblock, j, k - j * n8);
                continue;
            }
            long long o = k - groups + skip;  // the output byte this item writes
            if (mode == 1 && o < body) {
                long long i = o / ts;
                d[o] = gl_at(src, first, neblock, (o - i * ts) * count + i);
            } else {
                d[o] = gl_at(src, first, neblock, o);  // a copy, or a trailing byte
            }
        }
    }
}
"""
