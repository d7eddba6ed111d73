"""CRC32C of segments of a CuPy buffer, on the GPU: Zarr's ``crc32c`` codec checked with no copy to the host.

(The checksum manifest hashes blocks with XXH3-128 on the host, ``gpulazy.checksums``: a
CRC cannot tell a file that ends in its own CRC from another of the same length.)

Two kernels, so that a few long segments still use the whole GPU:

1. every 4 KiB piece of every segment gets its raw CRC register, started from 0, in
   parallel (one thread per piece);
2. one thread per segment folds its pieces in order: ``c = shift4096(c) ^ piece``,
   where ``shift4096`` (what 4096 zero bytes do to the register) is a 32 x 32 matrix over
   GF(2), then runs the segment's tail bytes.

CRC32C (Castagnoli, reflected 0x82F63B78, inverted in and out) is linear in the register,
which makes the fold exact; ``fold_on_host`` runs the same algorithm in NumPy so the
tests check the arithmetic without a GPU. Before first use in a process, ``usable()``
checks the kernels against google-crc32c on random data; if they disagree or do not
compile, the crc32c codec checks on the host instead, with a warning.
This is hand-written because no installed library computes CRC32C on a GPU.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np

__all__ = ["segment_crcs", "usable", "fold_on_host"]

PIECE = 4096
_POLY = 0x82F63B78


@functools.cache
def _table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(_POLY), t >> 1).astype(np.uint32)
    return t


def _raw(c: int, data: np.ndarray) -> int:
    """The register after ``data``, from register ``c`` (no inversions)."""
    t = _table()
    for b in data.tobytes():
        c = int(t[(c ^ b) & 0xFF]) ^ (c >> 8)
    return c


def _apply(cols: np.ndarray, c: int) -> int:
    out = 0
    for j in range(32):
        if c >> j & 1:
            out ^= int(cols[j])
    return out


def _square(cols: np.ndarray) -> np.ndarray:
    return np.array([_apply(cols, int(cols[j])) for j in range(32)], dtype=np.uint32)


@functools.cache
def _shift_piece() -> np.ndarray:
    """Columns of the matrix that ``PIECE`` zero bytes apply to the register."""
    one = np.array([_raw(1 << j, np.zeros(1, np.uint8)) for j in range(32)], dtype=np.uint32)
    m = one
    for _ in range(PIECE.bit_length() - 1):  # PIECE is a power of two: square log2(PIECE) times
        m = _square(m)
    return m


def fold_on_host(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray, inits: np.ndarray) -> np.ndarray:
    """The two-kernel algorithm in NumPy (slow; for tests): CRC32C of each segment from its ``init``."""
    shift = _shift_piece()
    out = np.empty(len(starts), np.uint32)
    for s, (a, n, init) in enumerate(zip(starts, lengths, inits)):
        c = int(init) ^ 0xFFFFFFFF
        whole = int(n) // PIECE
        for k in range(whole):
            c = _apply(shift, c) ^ _raw(0, data[a + k * PIECE: a + (k + 1) * PIECE])
        c = _raw(c, data[a + whole * PIECE: a + n])
        out[s] = c ^ 0xFFFFFFFF
    return out


_SOURCE = r"""
__device__ unsigned int crc_table(int i) {
    unsigned int c = (unsigned int)i;
    for (int k = 0; k < 8; k++) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : (c >> 1);
    return c;
}

extern "C" __global__ void pieces(const unsigned char* data, const long long* piece_start, int npieces,
                                  unsigned int* piece_crc) {
    __shared__ unsigned int table[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = crc_table(i);
    __syncthreads();
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= npieces) return;
    const unsigned char* q = data + piece_start[p];
    unsigned int c = 0u;
    for (int i = 0; i < PIECE; i++) c = table[(c ^ q[i]) & 0xFFu] ^ (c >> 8);
    piece_crc[p] = c;
}

extern "C" __global__ void fold(const unsigned char* data, const long long* start, const long long* length,
                                const unsigned int* init, const long long* first_piece, int nseg,
                                const unsigned int* piece_crc, const unsigned int* shift, unsigned int* out) {
    __shared__ unsigned int table[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = crc_table(i);
    __syncthreads();
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= nseg) return;
    unsigned int c = ~init[s];
    long long whole = length[s] / PIECE;
    for (long long k = 0; k < whole; k++) {
        unsigned int r = 0u;
        for (int j = 0; j < 32; j++) if ((c >> j) & 1u) r ^= shift[j];
        c = r ^ piece_crc[first_piece[s] + k];
    }
    const unsigned char* q = data + start[s] + whole * PIECE;
    long long tail = length[s] - whole * PIECE;
    for (long long i = 0; i < tail; i++) c = table[(c ^ q[i]) & 0xFFu] ^ (c >> 8);
    out[s] = ~c;
}
"""


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import cupy

    module = cupy.RawModule(code=_SOURCE, options=(f"-DPIECE={PIECE}",))
    return module.get_function("pieces"), module.get_function("fold")


def segment_crcs(buf: Any, starts: np.ndarray, lengths: np.ndarray, inits: np.ndarray) -> np.ndarray:
    """CRC32C of ``buf[starts[i]: starts[i] + lengths[i]]`` continued from ``inits[i]``, on the GPU."""
    import cupy

    starts = np.asarray(starts, np.int64)
    lengths = np.asarray(lengths, np.int64)
    counts = lengths // PIECE
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    piece_start = np.concatenate([s + PIECE * np.arange(k, dtype=np.int64) for s, k in zip(starts, counts)]
                                 or [np.zeros(0, np.int64)])
    pieces, fold = _kernels()
    data = buf.reshape(-1).view(cupy.uint8)
    npieces = len(piece_start)
    piece_crc = cupy.empty(max(npieces, 1), cupy.uint32)
    threads = 256
    if npieces:
        pieces(((npieces + threads - 1) // threads,), (threads,),
               (data, cupy.asarray(piece_start), np.int32(npieces), piece_crc))
    out = cupy.empty(len(starts), cupy.uint32)
    fold(((len(starts) + threads - 1) // threads,), (threads,),
         (data, cupy.asarray(starts), cupy.asarray(lengths), cupy.asarray(np.asarray(inits, np.uint32)),
          cupy.asarray(first), np.int32(len(starts)), piece_crc, cupy.asarray(_shift_piece()), out))
    return out.get()


@functools.cache
def usable(device_index: int) -> bool:
    """Whether the kernels agree with google-crc32c on this GPU (checked once per process)."""
    try:
        import cupy

        from gpulazy.codecs._frames import crc32c

        rng = np.random.default_rng(0)
        host = rng.integers(0, 256, 3 * PIECE + 1234, dtype=np.uint8)
        starts = np.array([0, 5, PIECE + 3, 100], np.int64)
        lengths = np.array([len(host), 2 * PIECE + 7, 11, 0], np.int64)
        inits = np.array([0, 0xDEADBEEF, 7, 42], np.uint32)
        want = [crc32c(host[a: a + n], int(i)) for a, n, i in zip(starts, lengths, inits)]
        with cupy.cuda.Device(device_index):
            got = segment_crcs(cupy.asarray(host), starts, lengths, inits)
        if [int(x) for x in got] == want:
            return True
        reason = f"results differ from google-crc32c ({list(got)} != {want})"
    except Exception as e:  # no compiler, no device...
        reason = f"{type(e).__name__}: {e}"
    warnings.warn(f"gpulazy: the CRC32C GPU kernel is not usable on cuda:{device_index} ({reason}); "
                  "Zarr's crc32c codec is checked on the host instead (a device-to-host copy per batch)", RuntimeWarning)
    return False
