"""LZ4 blocks on the GPU: the walk that proves a block whole, and our own decode of blocks
made of few sequences.

Every LZ4 block bound for the GPU is first walked by one GPU thread (``walk``): its sequences
must end exactly at the piece's end having produced the expected size, each match inside what
was produced before it (the host twin is ``block_fits``). nvCOMP reads past a stream cut short,
so a block that fails goes to the host, which names the file.

nvCOMP decodes a block with one warp, sequence after sequence, so a block of long literal runs
(data LZ4 hardly compresses: noisy integers, stored as they are) decodes at the rate one warp
copies bytes: a 4 GiB Zarr of (1, 1024, 1024) uint16 chunks holding 41 sequences per 2 MiB
block decoded at 14.6 GB/s on an H100. The walk visits every sequence anyway, so it records
them (``RECORDS`` per block). A block with no more sequences than that is decoded here
(``decode_sparse``), in two launches on the caller's stream:

- **literals**: every literal run of every block copied, each block's output cut in slices
  of ``SLICE`` bytes, one thread block per slice;
- **matches**: one thread block per LZ4 block replays its matches in order, each match's bytes
  in parallel: byte ``k`` of a match at ``at`` with offset ``o`` is ``out[at - o + k % o]``,
  which lies before ``at`` and so was written by a literal run (the launch before) or by an
  earlier match (a barrier before).

Blocks with more sequences go to nvCOMP as before. Since only what the walk proved is
recorded, no read or write leaves its piece or its output.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["block_fits", "walk", "decode_sparse", "RECORDS", "SLICE", "BAD", "DENSE", "SPARSE"]

#: Sequences recorded per block: a block with more decodes with nvCOMP.
RECORDS = 128
#: Output bytes of one block that one thread block fills with literals.
SLICE = 64 << 10
#: ``walk`` statuses: the block fails the walk; it walks (nvCOMP decodes it); it walks and its
#: sequences were recorded (``decode_sparse`` decodes it).
BAD, DENSE, SPARSE = 0, 1, 2
#: int64 fields per recorded sequence: literals' offset in the piece, their offset in the
#: output, their length, the match's offset (0: no match) and length.
_FIELDS = 5


def block_fits(data: bytes, start: int, expected: int) -> bool:
    """Whether the LZ4 sequences from ``start`` end exactly at ``len(data)`` having produced
    ``expected`` bytes, every match inside what was produced before it.

    The host twin of the ``_WALK`` kernel (the tests check one against the other's rules).
    """
    pos, end, out = start, len(data), 0
    while pos < end:
        token = data[pos]
        pos += 1
        lit, pos, whole = _length(data, pos, token >> 4)
        if not whole or lit > end - pos or out + lit > expected:
            return False
        pos, out = pos + lit, out + lit
        if pos == end:  # the last sequence is literals only: the block ends right after them
            return out == expected
        if end - pos < 2:
            return False
        offset = data[pos] | data[pos + 1] << 8
        match, pos, whole = _length(data, pos + 2, token & 15)
        if not whole or offset == 0 or offset > out or out + match + 4 > expected:
            return False
        out += match + 4
    return False


def _length(data: bytes, pos: int, n: int) -> tuple[int, int, bool]:
    # A 4-bit length of 15 goes on in bytes of 255 until one that is not.
    if n != 15:
        return n, pos, True
    while pos < len(data):
        b = data[pos]
        pos, n = pos + 1, n + b
        if b != 255:
            return n, pos, True
    return n, pos, False


class Walked:
    """What ``walk`` found: ``status[k]`` (``BAD``, ``DENSE`` or ``SPARSE``) per block, and on
    the device the recorded sequences and the sequence count of each block."""

    def __init__(self, status: np.ndarray, records: Any, counts: Any, addresses: Any):
        self.status, self.records, self.counts, self.addresses = status, records, counts, addresses


def walk(addresses: np.ndarray, lengths: np.ndarray, starts: np.ndarray, expected: np.ndarray, *,
         record: bool = True) -> Walked:
    """Walk the LZ4 block at each device address (``lengths`` bytes, sequences from ``starts``,
    decoding to ``expected`` bytes): one GPU thread per block, one launch, one copy back.
    With ``record``, blocks of at most ``RECORDS`` sequences come back ``SPARSE``."""
    import cupy

    from gpulazy.codecs import filters

    n = len(addresses)
    keep = RECORDS if record else 0
    status = cupy.zeros(n, dtype=np.int32)
    records = cupy.empty(max(1, n * keep * _FIELDS), dtype=np.int64)
    counts = cupy.zeros(max(1, n), dtype=np.int32)
    table = cupy.asarray(np.asarray(addresses, dtype=np.uint64))
    if n:
        filters.kernel("lz4_walk", _WALK)((-(-n // 64),), (64,), (
            table, cupy.asarray(np.asarray(lengths, dtype=np.int64)), cupy.asarray(np.asarray(starts, dtype=np.int64)),
            cupy.asarray(np.asarray(expected, dtype=np.int64)), status, np.int64(n), records, np.int32(keep), counts))
    return Walked(status.get(), records, counts, table)


def decode_sparse(walked: Walked, which: np.ndarray, outputs: np.ndarray, expected: np.ndarray) -> None:
    """Decode the ``SPARSE`` blocks ``which`` (indices into the walk) into device ``outputs``
    (addresses, ``expected`` bytes each, in ``which`` order), on the current stream."""
    import cupy

    from gpulazy.codecs import filters

    m = len(which)
    if not m:
        return
    which_d = cupy.asarray(np.asarray(which, dtype=np.int64))
    out_d = cupy.asarray(np.asarray(outputs, dtype=np.uint64))
    want = np.asarray(expected, dtype=np.int64)
    slices = max(1, int(-(-int(want.max()) // SLICE)))
    for a in range(0, m, filters._MAX_Y):  # CUDA's grid y limit
        b = min(m, a + filters._MAX_Y)
        filters.kernel("lz4_literals", _LITERALS)((slices, b - a), (256,), (
            walked.addresses, out_d[a:b], cupy.asarray(want[a:b]), which_d[a:b], walked.records, walked.counts,
            np.int32(RECORDS), np.int64(b - a), np.int64(SLICE)))
    filters.kernel("lz4_matches", _MATCHES)((min(m, 1 << 16),), (256,), (
        out_d, which_d, walked.records, walked.counts, np.int32(RECORDS), np.int64(m)))


# The rules of ``block_fits``, recording each sequence while ``keep`` allows. ``src[p]``: the
# piece; ``start[p]``: its first sequence; ``limit[p]``: the decoded size it must produce.
_WALK = r"""
__device__ bool gl_lz4_len(const unsigned char* s, long long* pos, long long end, long long* n) {
    if (*n != 15) return true;
    while (*pos < end) {
        unsigned int b = s[(*pos)++];
        *n += b;
        if (b != 255u) return true;
    }
    return false;
}

extern "C" __global__ void gl_lz4_walk(const unsigned long long* src, const long long* n, const long long* start,
                                       const long long* limit, int* ok, long long count, long long* rec, int keep,
                                       int* counts) {
    long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (p >= count) return;
    const unsigned char* s = (const unsigned char*)src[p];
    long long end = n[p], pos = start[p];
    long long want = limit[p], out = 0;
    long long* r = rec + p * (long long)keep * 5;
    int good = 0, seqs = 0;
    while (pos < end) {
        unsigned int token = s[pos++];
        long long lit = token >> 4;
        if (!gl_lz4_len(s, &pos, end, &lit) || lit > end - pos || out + lit > want) break;
        long long lit_at = pos, lit_out = out;
        pos += lit;
        out += lit;
        long long offset = 0, match = 0;
        int last = (pos == end);
        if (!last) {
            if (end - pos < 2) break;
            offset = s[pos] | (s[pos + 1] << 8);
            pos += 2;
            match = token & 15u;
            if (!gl_lz4_len(s, &pos, end, &match) || offset == 0 || offset > out || out + match + 4 > want) break;
            match += 4;
        }
        if (seqs < keep) {
            long long* q = r + 5LL * seqs;
            q[0] = lit_at; q[1] = lit_out; q[2] = lit; q[3] = offset; q[4] = match;
        }
        seqs++;
        out += match;
        if (last) { good = (out == want); break; }
    }
    ok[p] = good ? (keep > 0 && seqs <= keep ? 2 : 1) : 0;
    counts[p] = seqs;
}
"""

# Literal runs: thread block (x, y) fills output bytes [x * slice, (x + 1) * slice) of block
# which[y] from the runs that overlap them.
_LITERALS = r"""
extern "C" __global__ void gl_lz4_literals(const unsigned long long* src, const unsigned long long* dst,
                                           const long long* want, const long long* which, const long long* rec,
                                           const int* counts, int keep, long long count, long long slice) {
    for (long long y = blockIdx.y; y < count; y += gridDim.y) {
        long long p = which[y];
        const unsigned char* s = (const unsigned char*)src[p];
        unsigned char* d = (unsigned char*)dst[y];
        const long long* r = rec + p * (long long)keep * 5;
        int m = counts[p];
        for (long long a = blockIdx.x * slice; a < want[y]; a += gridDim.x * slice) {
            long long b = a + slice < want[y] ? a + slice : want[y];
            for (int i = 0; i < m; i++) {
                long long at = r[5 * i], o = r[5 * i + 1], len = r[5 * i + 2];
                long long lo = o > a ? o : a, hi = o + len < b ? o + len : b;
                for (long long x = lo + threadIdx.x; x < hi; x += blockDim.x) d[x] = s[at + (x - o)];
            }
        }
    }
}
"""

# Matches: one thread block per LZ4 block, its matches in order, each match's bytes in parallel.
_MATCHES = r"""
extern "C" __global__ void gl_lz4_matches(const unsigned long long* dst, const long long* which, const long long* rec,
                                          const int* counts, int keep, long long count) {
    for (long long y = blockIdx.x; y < count; y += gridDim.x) {
        long long p = which[y];
        unsigned char* d = (unsigned char*)dst[y];
        const long long* r = rec + p * (long long)keep * 5;
        int m = counts[p];
        for (int i = 0; i < m; i++) {
            long long off = r[5 * i + 3], len = r[5 * i + 4];
            if (len == 0) continue;
            long long at = r[5 * i + 1] + r[5 * i + 2];
            for (long long k = threadIdx.x; k < len; k += blockDim.x) d[at + k] = d[at - off + k % off];
            __syncthreads();
        }
    }
}
"""
