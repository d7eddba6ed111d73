"""XXH3-128 of blocks of a CuPy buffer, on the GPU: ``verify=True`` with no copy of the chunk to the host.

The checksum manifest holds the XXH3-128 hash of every block of a file (``gpulazy.checksums``).
A chunk read onto a GPU is checked where it landed: one kernel hashes every whole block
the chunk holds, and only the 16-byte hashes come down (1/16384 of the bytes for 256 KiB
blocks). Hashing on the host instead copies every byte back down (a second pass over
PCIe and host memory, beside the read's own) and spends a core per ~12 GB/s, which the
read's own threads need.

One warp hashes one block, the long-input path of XXH3 (more than 240 bytes; shorter
blocks are hashed on the host). XXH3 keeps 8 accumulators; a 1 KiB round adds, for each of
16 stripes of 64 bytes, a product and a data word to them, then scrambles them. The sums
of a round do not depend on their order, so lane ``(g, i)`` of the warp (``i = lane % 8``
the accumulator, ``g = lane // 8``) adds up stripes ``g, g + 4, ...`` and the warp sums the
four partials with shuffles; the scrambles stay in order, round after round. The secret is
XXH3's default (``kSecret``, seed 0), as ``xxhash.xxh3_128_digest`` uses.

``hash_on_host`` runs the same arithmetic in NumPy, so the tests check it against
``xxhash`` without a GPU. Before first use in a process, ``usable()`` checks the kernel
against ``xxhash`` on random data (odd lengths, unaligned starts); if they disagree or it
does not compile, blocks are hashed on the host instead, with a warning.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np

__all__ = ["MIN_BYTES", "block_digests", "hash_on_host", "usable"]

MIN_BYTES = 241  # XXH3's long-input path starts here; shorter inputs hash otherwise
_M = (1 << 64) - 1
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3, _P64_4, _P64_5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                                          0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
_INIT = (_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1)
# XXH3's default secret (kSecret, 192 bytes), a constant of the algorithm.
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")


def _words(offset: int, n: int = 8) -> np.ndarray:
    """``n`` little-endian 64-bit words of the secret from byte ``offset`` (not always aligned)."""
    return np.frombuffer(_SECRET[offset: offset + 8 * n], "<u8")


@functools.cache
def _table() -> np.ndarray:
    """The secret words the kernel reads, so it never reads the secret unaligned: ``[0:24]``
    the aligned words (stripe ``s``, accumulator ``i`` uses word ``s + i``; the scramble words
    ``16 + i``), ``[24:32]`` the last stripe's (from byte 121), ``[32:40]`` and ``[40:48]`` the
    low and high halves' merges (from bytes 11 and 117)."""
    return np.concatenate([_words(0, 24), _words(121), _words(11), _words(117)]).astype(np.uint64)


# -- the kernel's arithmetic, lane by lane, in NumPy -----------------------------------------

_LANE = np.arange(32)
_I, _G = _LANE & 7, _LANE >> 3  # lane = (g, i): accumulator i, stripes g, g + 4, ...


def _shfl_xor(x: np.ndarray, mask: int) -> np.ndarray:
    return x[_LANE ^ mask]


def _group_sum(x: np.ndarray) -> np.ndarray:
    x = x + _shfl_xor(x, 8)
    return x + _shfl_xor(x, 16)


def _stripes(words: np.ndarray, stripes: int) -> tuple[np.ndarray, np.ndarray]:
    """Each lane's ``(product sum, data sum)`` over its stripes of a round (``words``: the round's
    64-bit words; stripe ``s`` is words ``8s .. 8s + 8``), as the kernel's loop makes them."""
    prod, data = np.zeros(32, np.uint64), np.zeros(32, np.uint64)
    table = _table()
    for t in range(4 if stripes else 0):
        s = _G + 4 * t
        mine = s < stripes
        v = np.where(mine, words[np.where(mine, 8 * s + _I, 0)], np.uint64(0))
        k = v ^ table[np.where(mine, s, 0) + _I]
        prod += np.where(mine, (k & np.uint64(0xFFFFFFFF)) * (k >> np.uint64(32)), np.uint64(0))
        data += v
    return prod, data


def _fold(a: int, b: int) -> int:
    p = a * b
    return (p ^ (p >> 64)) & _M


def _avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & _M
    return h ^ (h >> 32)


def hash_on_host(data: np.ndarray) -> bytes:
    """XXH3-128 of ``data`` (1-D uint8, at least ``MIN_BYTES``) as the kernel computes it, its 32
    lanes and shuffles emulated in NumPy (slow; for tests): equal to ``xxhash.xxh3_128_digest(data)``."""
    data = np.ascontiguousarray(data, np.uint8)
    n = len(data)
    if n < MIN_BYTES:
        raise ValueError(f"XXH3's long path needs at least {MIN_BYTES} bytes, got {n}")
    table = _table()
    with np.errstate(over="ignore"):
        acc = np.array(_INIT, np.uint64)[_I]
        rounds = (n - 1) // 1024
        for r in range(rounds + 1):  # the last one: the stripes before the last, no scramble
            stripes = 16 if r < rounds else ((n - 1) - 1024 * rounds) // 64
            words = np.frombuffer(data[1024 * r: 1024 * r + 64 * stripes].tobytes(), "<u8")
            prod, dsum = _stripes(words, stripes)
            acc += _group_sum(prod) + _shfl_xor(_group_sum(dsum), 1)
            if r < rounds:
                acc ^= acc >> np.uint64(47)
                acc ^= table[16 + _I]
                acc *= np.uint64(_P32_1)
        v = np.frombuffer(data[n - 64:].tobytes(), "<u8")[_I]  # the last stripe
        k = v ^ table[24 + _I]
        acc += (k & np.uint64(0xFFFFFFFF)) * (k >> np.uint64(32)) + _shfl_xor(v, 1)
    a = [int(x) for x in acc[:8]]  # lanes 0..7: g = 0, accumulator i

    def merge(first: int, start: int) -> int:
        for j in range(4):
            start = (start + _fold(a[2 * j] ^ int(table[first + 2 * j]), a[2 * j + 1] ^ int(table[first + 2 * j + 1]))) & _M
        return _avalanche(start)

    low = merge(32, (n * _P64_1) & _M)
    high = merge(40, ~(n * _P64_2) & _M)
    return high.to_bytes(8, "big") + low.to_bytes(8, "big")  # xxhash's canonical digest: high half first


# -- the kernel -------------------------------------------------------------------------------

_SOURCE = r"""
typedef unsigned long long u64;
#define FULL 0xffffffffu

__device__ __forceinline__ u64 load64(const unsigned char* p) {
    if ((((unsigned long long)p) & 7) == 0) return *(const u64*)p;
    u64 v = 0;
    for (int k = 7; k >= 0; --k) v = (v << 8) | p[k];   // little-endian, unaligned
    return v;
}

__device__ __forceinline__ u64 group_sum(u64 x) {     // over the 4 lanes g = 0..3 of accumulator i
    x += __shfl_xor_sync(FULL, x, 8);
    x += __shfl_xor_sync(FULL, x, 16);
    return x;
}

__device__ __forceinline__ u64 fold64(u64 a, u64 b) { return (a * b) ^ __umul64hi(a, b); }

__device__ __forceinline__ u64 avalanche(u64 h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    return h ^ (h >> 32);
}

__device__ __forceinline__ u64 init_acc(int i) {     // a switch, not an array: no local memory
    switch (i) {
        case 0: return 0xC2B2AE3Dull;
        case 1: return 0x9E3779B185EBCA87ull;
        case 2: return 0xC2B2AE3D27D4EB4Full;
        case 3: return 0x165667B19E3779F9ull;
        case 4: return 0x85EBCA77C2B2AE63ull;
        case 5: return 0x85EBCA77ull;
        case 6: return 0x27D4EB2F165667C5ull;
        default: return 0x9E3779B1ull;
    }
}

extern "C" __global__ void xxh3_128(const u64* addresses, const u64* lengths, const u64* secret, u64* out,
                                    int n) {
    const int warp = (int)(((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    if (warp >= n) return;                      // whole warps leave: the shuffles below see all 32 lanes
    const int lane = threadIdx.x & 31, i = lane & 7, g = lane >> 3;
    const unsigned char* p = (const unsigned char*)addresses[warp];   // blocks of any buffers of the device
    const u64 len = lengths[warp];
    u64 acc = init_acc(i);
    const u64 rounds = (len - 1) / 1024;
    // A warp's rounds run in order (each scramble needs the last), so the next round's words are
    // loaded before this round is summed: the memory latency overlaps the work, not adds to it.
    u64 next[4];
    #pragma unroll
    for (int t = 0; t < 4; ++t) next[t] = rounds ? load64(p + (g + 4 * t) * 64 + i * 8) : 0;
    for (u64 r = 0; r < rounds; ++r) {
        u64 now[4];
        #pragma unroll
        for (int t = 0; t < 4; ++t) now[t] = next[t];
        if (r + 1 < rounds) {
            #pragma unroll
            for (int t = 0; t < 4; ++t) next[t] = load64(p + (r + 1) * 1024 + (g + 4 * t) * 64 + i * 8);
        }
        u64 prod = 0, data = 0;
        #pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int s = g + 4 * t;
            const u64 v = now[t];
            const u64 k = v ^ secret[s + i];
            prod += (k & 0xFFFFFFFFull) * (k >> 32);
            data += v;
        }
        acc += group_sum(prod) + __shfl_xor_sync(FULL, group_sum(data), 1);
        acc ^= acc >> 47;
        acc ^= secret[16 + i];
        acc *= 0x9E3779B1ull;
    }
    const unsigned char* q = p + rounds * 1024;
    const int stripes = (int)(((len - 1) - rounds * 1024) / 64);
    u64 prod = 0, data = 0;
    for (int s = g; s < stripes; s += 4) {
        const u64 v = load64(q + s * 64 + i * 8);
        const u64 k = v ^ secret[s + i];
        prod += (k & 0xFFFFFFFFull) * (k >> 32);
        data += v;
    }
    acc += group_sum(prod) + __shfl_xor_sync(FULL, group_sum(data), 1);
    const u64 v = load64(p + len - 64 + i * 8);   // the last stripe, against the secret from byte 121
    const u64 k = v ^ secret[24 + i];
    acc += (k & 0xFFFFFFFFull) * (k >> 32) + __shfl_xor_sync(FULL, v, 1);
    u64 a[8];
    #pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = __shfl_sync(FULL, acc, j);
    if (lane == 0) {
        u64 low = len * 0x9E3779B185EBCA87ull, high = ~(len * 0xC2B2AE3D27D4EB4Full);
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            low += fold64(a[2 * j] ^ secret[32 + 2 * j], a[2 * j + 1] ^ secret[33 + 2 * j]);
            high += fold64(a[2 * j] ^ secret[40 + 2 * j], a[2 * j + 1] ^ secret[41 + 2 * j]);
        }
        out[2 * (u64)warp] = avalanche(high);
        out[2 * (u64)warp + 1] = avalanche(low);
    }
}
"""

_WARPS_PER_BLOCK = 8


@functools.cache
def _kernel(device_index: int) -> Any:
    import cupy

    with cupy.cuda.Device(device_index):
        return cupy.RawKernel(_SOURCE, "xxh3_128")


def block_digests(device_index: int, addresses: np.ndarray, lengths: np.ndarray, stream: Any) -> bytes:
    """The XXH3-128 digests (16 bytes each, joined) of the ``lengths[k]`` bytes at device address
    ``addresses[k]`` (blocks of any buffers on GPU ``device_index``, every length at least
    ``MIN_BYTES``), hashed on ``stream`` and waited for."""
    import cupy

    n = len(addresses)
    if n == 0:
        return b""
    with cupy.cuda.Device(device_index), stream:
        out = cupy.empty((n, 2), cupy.uint64)
        threads = 32 * _WARPS_PER_BLOCK
        _kernel(device_index)(((n + _WARPS_PER_BLOCK - 1) // _WARPS_PER_BLOCK,), (threads,),
                              (cupy.asarray(np.asarray(addresses, np.uint64)),
                               cupy.asarray(np.asarray(lengths, np.uint64)), cupy.asarray(_table()), out,
                               np.int32(n)))
        host = out.get(stream=stream)
        stream.synchronize()  # the hashes are read next, on the host
    return host.astype(">u8").tobytes()  # per block: high half, low half, big-endian (xxhash's digest)


@functools.cache
def usable(device_index: int) -> bool:
    """Whether the kernel agrees with ``xxhash`` on this GPU (checked once per process)."""
    try:
        import cupy
        import xxhash

        host = np.random.default_rng(0).integers(0, 256, 3 * 1024 * 1024 + 777, dtype=np.uint8)
        spans = [(0, len(host)), (3, 256 << 10), (8, 1024), (5, 1025), (16, 241), (1, 4096 + 7), (64, 2047)]
        starts = np.array([s for s, _ in spans], np.uint64)
        lengths = np.array([n for _, n in spans], np.uint64)
        want = b"".join(xxhash.xxh3_128_digest(host[s: s + n]) for s, n in spans)
        with cupy.cuda.Device(device_index):
            stream = cupy.cuda.Stream(non_blocking=True)
            buf = cupy.asarray(host)
            got = block_digests(device_index, buf.data.ptr + starts, lengths, stream)
        if got == want:
            return True
        reason = "its hashes differ from xxhash's"
    except Exception as e:  # no compiler, no device...
        reason = f"{type(e).__name__}: {e}"
    warnings.warn(f"gpulazy: the XXH3 GPU kernel is not usable on cuda:{device_index} ({reason}); verify=True "
                  "hashes on the host instead (each chunk's bytes copied down)", RuntimeWarning)
    return False
