"""Batched GPU decompression with nvCOMP (its C API, ``gpulazy.codecs._nvcomp_c``).

One ``decode`` call decodes every piece of a batch with one nvCOMP call per algorithm, queued
on the calling thread's own stream.
Each format's framing is handled here, on the host, from a few header and trailer bytes
of every piece fetched in one copy: nvCOMP's ``RAW`` bitstreams are the bare
algorithm, so

- ``zstd``: standard frames decode as they are;
- ``lz4`` (numcodecs): a 4-byte little-endian size prefix, then one LZ4 block (a block of few
  sequences is decoded by ``gpulazy.codecs.lz4``'s kernels instead, in the same ``decode``);
- ``lz4_raw``: one bare LZ4 block (the streams inside blosc and HDF5 bitshuffle chunks,
  whose framing ``gpulazy.codecs.blosc`` and ``gpulazy.codecs.bitshuffle`` read);
- ``zlib``: a 2-byte header and a 4-byte Adler-32 trailer around raw Deflate;
- ``gzip``: a 10-byte header with optional FEXTRA/FNAME/FCOMMENT/FHCRC fields, raw
  Deflate, and an 8-byte CRC-32 + size trailer.

Before nvCOMP sees a piece, the size its framing declares (zstd content size, lz4 prefix,
gzip ISIZE) must be the expected one: ``gpulazy.codecs._frames``, the same check the host
decoders make. A piece whose framing is not the plain form (a zstd dictionary, a preset zlib
dictionary, a gzip header longer than what was fetched), declares another size (or, a zstd
frame, none: nvCOMP does not stop at its output's end), or whose stream does not end exactly
at the piece's end (a zstd frame's block headers, an LZ4 block's sequences, walked by one
GPU thread per piece) is not sent to nvCOMP: it is returned in ``Decoded.host`` for the
caller to decode on the host, which either decodes it or raises the error that names the
file. The same goes for pieces nvCOMP reports failing or decoding to a size other than the
expected one, and for a whole batch nvCOMP refuses.

What nvCOMP 6.0 does with bad input, probed on an H100 (``benchmarks/bench_codecs.py
--probe``): Deflate reports the bytes it actually decoded (a garbled stream 0, a
truncated one fewer), so the size check catches both; LZ4 reports a garbled piece whose
output would not fit its slot in that piece's status; zstd and LZ4 read past a piece's stated
end (a stream cut in half still decoded in full from the bytes behind it), hence the
walks; and a garbled zstd payload faulted the CUDA context (NVIDIA's release notes:
its zstd and Deflate decoders assume valid input). nvCOMP verifies no zstd content
checksum, Adler-32 or gzip CRC-32. A zstd frame that carries a checksum of its content
(Zarr's ``ZstdCodec(checksum=True)``) is therefore decoded on the host, which verifies it:
its writer asked for the check. Otherwise a payload corrupted *inside* a zstd block (its
headers intact), or LZ4 literals garbled, is not caught on the GPU and a garbled zstd
block can take the process's GPU context down: read files you do not trust with
``device="cpu"`` or ``gpulazy.config.set(gpu_decode=False)``.

>>> from gpulazy.codecs import nvcomp
>>> isinstance(nvcomp.supported(), frozenset)
True
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from gpulazy.codecs._frames import HEAD, TAIL, ZSTD_MAGIC, FrameError, check_declared, zstd_header
from gpulazy.codecs.pieces import Pieces
from gpulazy.spec import Codec

__all__ = ["supported", "handles", "decode", "Decoded", "ALGORITHMS", "zstd_header", "zstd_blocks_fit"]

#: Codec id -> (nvCOMP algorithm, framing). TIFF's codecs through imagecodecs share framings.
ALGORITHMS: dict[str, tuple[str, str]] = {
    "zstd": ("Zstd", "zstd"),
    "lz4": ("LZ4", "lz4-numcodecs"),
    "lz4_raw": ("LZ4", "lz4-raw"),  # a bare LZ4 block: blosc's and HDF5 bitshuffle's streams
    "zlib": ("Deflate", "zlib"),
    "gzip": ("Deflate", "gzip"),
    "imagecodecs_zstd": ("Zstd", "zstd"),
    "imagecodecs_zlib": ("Deflate", "zlib"),
    "imagecodecs_deflate": ("Deflate", "zlib"),
}

_HEAD = HEAD  # header bytes fetched per piece (a gzip header with a long FNAME goes to the host)
_TAIL = TAIL
_OUT_ALIGN = 256  # where each decoded piece starts in the batch's output buffer


@functools.cache
def supported() -> frozenset[str]:
    """Codec ids nvCOMP decodes on this machine (empty without nvCOMP, CuPy or a GPU). Probed once."""
    from gpulazy.device import gpu_count

    if gpu_count() == 0:
        return frozenset()
    from gpulazy.codecs import _nvcomp_c

    if not _nvcomp_c.available():
        return frozenset()
    ok = set()
    for algo in sorted({a for a, _ in ALGORITHMS.values()}):
        try:
            _nvcomp_c.alignments(algo)
        except _nvcomp_c.NvcompError:
            continue
        ok.update(cid for cid, (a, _) in ALGORITHMS.items() if a == algo)
    return frozenset(ok)


def handles(c: Codec) -> bool:
    """Whether this codec value (id and parameters) decodes with nvCOMP here."""
    if c.id not in supported():
        return False
    if c.id == "imagecodecs_deflate" and c.get("raw"):
        return True  # raw Deflate: no framing at all
    return not (c.id == "imagecodecs_zlib" and c.get("raw"))


def _stream(device_index: int) -> Any:
    """This thread's non-blocking ``gpulazy_stream`` on the device: where its nvCOMP calls run.

    Each thread decodes on its own stream, so dask worker threads and the whole-array path's
    settle threads decode side by side, and no decode waits for KvikIO's reads into the next
    buffers: on the stream nvCOMP's Python API makes for itself, a 4 GiB read and 4 GiB of zstd
    decodes took 308 ms together on an H100, against 100 + 208 ms apart.
    """
    from gpulazy.device import Device, gpulazy_stream

    return gpulazy_stream(Device("cuda", device_index))


def _after_current(stream: Any, cupy: Any) -> None:
    """Order ``stream`` after what the current stream has queued (the pieces, their output buffer)."""
    current = cupy.cuda.get_current_stream()
    if current.ptr != stream.ptr:
        stream.wait_event(current.record())


@dataclass
class Decoded:
    """What ``decode`` did: ``out[i]`` (``out``: a ``Pieces``) is piece ``i`` decoded, or empty when
    piece ``i`` is in ``host``: it must be decoded on the host (framing nvCOMP does not take, or
    a result that failed a check). ``why[i]`` says why for those."""

    out: Any
    host: list[int] = field(default_factory=list)
    why: dict[int, str] = field(default_factory=dict)
    #: Pieces in ``host`` because no GPU decoder takes them (e.g. blosc with blosclz inside):
    #: the caller warns once that they decode on the host.
    slow: list[int] = field(default_factory=list)
    #: The step the host decodes ``host`` pieces with, when not the batch's own codec.
    host_codec: Codec | None = None

    @classmethod
    def pending(cls, n: int, cupy: Any, host_codec: Codec | None = None) -> Decoded:
        """The result for ``n`` pieces before any is decoded: each ``out`` piece empty."""
        return cls(Pieces.carved(cupy.empty(0, dtype=np.uint8), np.zeros(n, np.int64), np.zeros(n, np.int64)),
                   host_codec=host_codec)


def decode(pieces: Sequence[Any], codec: Codec, sizes: Sequence[int], device_index: int = 0) -> Decoded:
    """Decode ``pieces`` (``Pieces``, or 1-D CuPy uint8 arrays) of one codec, each to ``sizes[i]``
    bytes, in one batch. Framing is checked over the batch's table (``Pieces``): an array is made
    per piece only where its framing needs reading on the host."""
    import cupy

    algorithm, framing = ALGORITHMS[codec.id]
    if codec.id == "imagecodecs_deflate" and codec.get("raw"):
        framing = "raw"
    pieces = Pieces.of(pieces)
    n = len(pieces)
    want = np.asarray(sizes, dtype=np.int64).reshape(-1)
    result = Decoded.pending(n, cupy)
    start, stop = np.zeros(n, np.int64), pieces.sizes.copy()
    go = np.ones(n, bool)
    if framing in _HEADLESS:  # the stream is the whole piece: nothing to read on the host
        heads = tails = [b""] * n
        rest = np.flatnonzero((want <= 0) | (stop <= 0))
    else:
        ends, lengths = _gather_ends(pieces)
        fits = _prefix_fits(ends, lengths, want) if framing == "lz4-numcodecs" else np.zeros(n, bool)
        start[fits] = 4
        rest = np.flatnonzero(~fits)
        heads, tails = _as_bytes(ends, lengths, rest)
    for i in rest:
        i = int(i)
        span, why = _frame(codec.id, framing, heads[i], tails[i], int(stop[i]), int(want[i])) if want[i] > 0 \
            else (None, "empty")
        if span is None:
            go[i] = False
            result.host.append(i)
            result.why[i] = why
        else:
            start[i], stop[i] = span
    idx = np.flatnonzero(go)
    if not len(idx):
        return result
    outputs: list[tuple[np.ndarray, Pieces]] = []
    if framing in _LZ4_FRAMINGS:
        idx = _lz4_spans(pieces, idx, start, want, result, outputs)
    elif framing in _WALKS:
        idx = _walk(framing, pieces, idx, heads, result)
    if len(idx):
        got = _run(algorithm, device_index, pieces.ptrs[idx] + start[idx].astype(np.uint64),
                   stop[idx] - start[idx], want[idx], cupy)
        if isinstance(got, str):  # the whole batch refused: let the host find (and name) the bad piece
            for i in idx.tolist():
                result.host.append(i)
                result.why[i] = got
        else:
            decoded, ok, counts = got
            for i, k in zip(idx[~ok].tolist(), counts[~ok].tolist()):
                result.host.append(i)
                result.why[i] = f"nvCOMP {algorithm} decoded {k} bytes, expected {int(want[i])}"
            outputs.append((idx[ok], decoded.take(ok)))
    if outputs:
        result.out = result.out.filled(outputs)
    result.host.sort()
    return result


def _run(algorithm: str, device_index: int, src: np.ndarray, lengths: np.ndarray, want: np.ndarray, cupy: Any
         ) -> tuple[Pieces, np.ndarray, np.ndarray] | str:
    """Decode the streams at device addresses ``src`` (``lengths`` bytes, ``want`` decoded) in one
    nvCOMP call; ``(decoded pieces, ok, bytes decoded)``, or the batch's error as a string.

    Into one output buffer carved per piece. A piece nvCOMP reports failing (its status: a
    garbled LZ4 or Deflate stream, or one whose output would not fit its slot, found before
    anything is written past it) gets -1 bytes decoded; otherwise the bytes actually decoded
    (a truncated Deflate stream reports fewer), which must be ``want``.
    """
    from gpulazy.codecs import _nvcomp_c, filters

    align = _nvcomp_c.alignments(algorithm)
    src = np.asarray(src, dtype=np.uint64)
    kept = None
    bad = np.flatnonzero(src % np.uint64(max(1, align.input)))
    if len(bad):  # misaligned streams are copied to aligned memory first (rare: an odd framing)
        kept = filters.aligned([_span(int(src[k]), int(lengths[k])) for k in bad], align.input)
        src = src.copy()
        src[bad] = [a.data.ptr for a in kept]
    stream = _stream(device_index)
    _after_current(stream, cupy)
    decoded = filters.slots(want, max(align.output, _OUT_ALIGN))
    try:
        got, status = _nvcomp_c.decompress(algorithm, src, np.asarray(lengths, np.int64), decoded.ptrs, want, stream)
    except _nvcomp_c.NvcompError as e:  # the call refused as a whole: the host finds (and names) the bad piece
        return str(e)
    counts = np.where(np.asarray(status) == 0, np.asarray(got, np.int64), -1)
    if kept is not None:  # held as long as the output: nvCOMP reads them on its own stream
        decoded.owners.extend(kept)
    return decoded, counts == want, counts


def _span(ptr: int, nbytes: int) -> Any:
    """``nbytes`` of device memory at ``ptr`` as a CuPy array that does not own it."""
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, nbytes, None)
    return cupy.ndarray((nbytes,), dtype=np.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


def _ends(pieces: Sequence[Any]) -> tuple[list[bytes], list[bytes]]:
    """The first ``_HEAD`` and last ``_TAIL`` bytes of every piece (fewer where it is shorter)."""
    ends, lengths = _gather_ends(Pieces.of(pieces))
    return _as_bytes(ends, lengths, range(len(pieces)))


def _gather_ends(pieces: Pieces) -> tuple[np.ndarray, np.ndarray]:
    """``(ends, lengths)``: row ``i`` of ``ends`` holds piece ``i``'s first ``_HEAD`` bytes, then its
    last ``_TAIL`` bytes ending at the row's end; gathered by one launch on the current stream and
    brought down in one copy. Slicing every piece on the host (two CuPy views each, then a
    concatenation) cost the 2,048 pieces of a 4 GiB LZ4 Zarr about 10 ms of the thread that
    decodes (H100 host)."""
    import cupy

    from gpulazy.codecs import filters

    n = len(pieces)
    lengths = pieces.sizes
    if not n:
        return np.empty((0, _HEAD + _TAIL), np.uint8), lengths
    addresses = pieces.ptrs
    width = _HEAD + _TAIL
    ends = cupy.empty((n, width), dtype=np.uint8)
    filters.kernel("piece_ends", _ENDS)((-(-n * width // 256),), (256,), (
        cupy.asarray(addresses), cupy.asarray(lengths), ends, np.int64(n), np.int32(_HEAD), np.int32(_TAIL)))
    return ends.get(), lengths


def _as_bytes(ends: np.ndarray, lengths: np.ndarray, which: Any) -> tuple[list[bytes], list[bytes]]:
    """Heads and tails (``_gather_ends``) as bytes for the pieces ``which``; ``b""`` for the others."""
    heads, tails = [b""] * len(lengths), [b""] * len(lengths)
    width = _HEAD + _TAIL
    for i in which:
        n = int(lengths[i])
        heads[i] = ends[i, :min(n, _HEAD)].tobytes()
        tails[i] = ends[i, width - min(n, _TAIL):].tobytes()
    return heads, tails


def _prefix_fits(ends: np.ndarray, lengths: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """Which numcodecs LZ4 pieces plainly pass ``_frame``: a 4-byte prefix declaring the expected size,
    then at least one token. Worked out with NumPy over the batch (a piece at a time, the checks
    cost 2,048 pieces several milliseconds); the others go through ``_frame``, which says why."""
    want = np.asarray(sizes, dtype=np.int64).reshape(-1)
    declared = np.ascontiguousarray(ends[:, :4]).view("<u4").reshape(-1).astype(np.int64)
    return (lengths >= 5) & (want > 0) & (declared == want)


# Row ``p`` of ``out``: piece ``p``'s first ``head`` bytes, then its last ``tail`` bytes ending
# at the row's end (a piece shorter than either leaves the rest of that part unwritten).
_ENDS = r"""
extern "C" __global__ void gl_piece_ends(const unsigned long long* src, const long long* size, unsigned char* out,
                                         long long count, int head, int tail) {
    long long u = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    int width = head + tail;
    if (u >= count * width) return;
    long long p = u / width;
    int k = (int)(u - p * width);
    const unsigned char* s = (const unsigned char*)src[p];
    long long n = size[p];
    if (k < head) {
        if (k < n) out[u] = s[k];
    } else {
        long long back = width - k;  // 1 .. tail: bytes from the piece's end
        if (back <= n && back <= tail) out[u] = s[n - back];
    }
}
"""


# -- framings: (start, stop) of the bare stream inside a piece, or (None, why) ------------

def _frame(codec_id: str, framing: str, head: bytes, tail: bytes, size: int, expected: int) -> tuple[Any, str]:
    try:  # the size the framing declares, and whether it fits the piece: one check for host and GPU
        check_declared(codec_id, head, tail, size, expected)
    except FrameError as e:
        return None, str(e)
    if framing == "zstd":
        return _zstd(head, size)
    if framing == "lz4-numcodecs":
        return _lz4(head, size)
    if framing == "zlib":
        return _zlib(head, size)
    if framing == "gzip":
        return _gzip(head, tail, size)
    return ((0, size), "") if size else (None, "empty stream")


#: Framings whose stream is the whole piece, checked without reading its bytes on the host.
_HEADLESS = frozenset({"raw", "lz4-raw"})


def _zstd(head: bytes, size: int) -> tuple[Any, str]:
    # nvCOMP sees only frames with the standard magic, no dictionary and a whole header;
    # the frame's content size was checked by ``check_declared``, its blocks by the walk.
    if len(head) < 6 or head[:4] != ZSTD_MAGIC:
        return None, "not a zstd frame (magic number missing)"
    if head[4] & 3:
        return None, "zstd frame uses a dictionary"
    if not head[4] >> 5:  # (no single-segment flag, no content-size field)
        # nvCOMP does not stop at the end of its output: a frame decoding longer than the chunk faulted
        # the CUDA context (an illegal address, found by the GPU suite). Without the size the frame
        # declares (``check_declared``), libzstd on the host decodes it, bounded by the chunk's size.
        return None, "its zstd frame does not say how many bytes it decodes to"
    start, trailer = zstd_header(head)
    if trailer:  # libzstd on the host checks it; a corrupt frame would otherwise be data
        return None, "its zstd frame has a checksum of its content, which nvCOMP does not verify"
    if start + 3 + trailer > size:
        return None, "truncated zstd frame header"
    return (0, size), ""


def zstd_blocks_fit(data: bytes, start: int, trailer: int) -> bool:
    """Whether the block headers from ``start`` chain to a last block ending at ``len(data) - trailer``.

    The host twin of the ``_ZSTD_WALK`` kernel (the tests check one against the other's rules).
    """
    pos, end = start, len(data)
    while pos + 3 <= end:
        h = data[pos] | data[pos + 1] << 8 | data[pos + 2] << 16
        last, kind, size = h & 1, (h >> 1) & 3, h >> 3
        if kind == 3 or size > _ZSTD_MAX_BLOCK:
            return False
        pos += 3 + (1 if kind == 1 else size)
        if last:
            return pos + trailer == end
    return False


def _walk(framing: str, pieces: Pieces, idx: np.ndarray, heads: list[bytes], result: Decoded) -> np.ndarray:
    """The pieces of ``idx`` whose zstd frame provably ends at the end of the piece (one GPU thread
    per piece walks it).

    nvCOMP's zstd decoder reads past a stream that is cut short (into the next piece of the read
    buffer): a frame's block headers must chain to the piece's end (less its checksum). Pieces
    that do not go to the host, which names the file. (LZ4: ``_lz4_spans``.)
    """
    why = _WALKS[framing][2]
    layout = np.array([zstd_header(heads[i]) for i in idx.tolist()], dtype=np.int64).reshape(-1, 2)
    ok = walk_ends(framing, pieces.ptrs[idx], pieces.sizes[idx], layout[:, 0], layout[:, 1])
    for i in idx[~ok].tolist():
        result.host.append(i)
        result.why[i] = why
    return idx[ok]


def _lz4_spans(pieces: Pieces, idx: np.ndarray, start: np.ndarray, sizes: np.ndarray, result: Decoded,
               outputs: list) -> np.ndarray:
    """Walk the LZ4 block of every piece of ``idx`` (sequences from ``start``; ``gpulazy.codecs.lz4``):
    blocks that fail go to the host, blocks of few sequences are decoded here (``(pieces,
    decoded)`` appended to ``outputs``); returns the pieces left for nvCOMP."""
    from gpulazy.codecs import lz4

    walked = lz4.walk(pieces.ptrs[idx], pieces.sizes[idx], start[idx], sizes[idx])
    status = np.asarray(walked.status)
    for i in idx[status == lz4.BAD].tolist():
        result.host.append(i)
        result.why[i] = _LZ4_BAD
    sparse = np.flatnonzero(status == lz4.SPARSE)
    if len(sparse):  # on the current stream, as the walk: inside ``own_stream``, gpulazy's
        from gpulazy.codecs import filters

        want = sizes[idx[sparse]]
        decoded = filters.slots(want, _OUT_ALIGN)
        lz4.decode_sparse(walked, sparse, decoded.ptrs, want)
        outputs.append((idx[sparse], decoded))
    return idx[status == lz4.DENSE]


def walk_ends(framing: str, addresses: np.ndarray, lengths: np.ndarray, starts: np.ndarray, limits: np.ndarray
              ) -> np.ndarray:
    """Whether each stream at device ``addresses`` (``lengths`` bytes) provably ends at its end:
    one GPU thread per stream walks it from ``starts`` (``limits``: what the end must match; see
    ``_walk``). One launch, one copy back."""
    import cupy

    from gpulazy.codecs import filters

    name, source, _ = _WALKS[framing]
    n = len(addresses)
    if n == 0:
        return np.zeros(0, dtype=bool)
    ok = cupy.zeros(n, dtype=np.int32)
    filters.kernel(name, source)((-(-n // 64),), (64,), (
        cupy.asarray(addresses.astype(np.uint64)), cupy.asarray(lengths.astype(np.int64)),
        cupy.asarray(starts.astype(np.int64)), cupy.asarray(limits.astype(np.int64)), ok, np.int64(n)))
    return ok.get().astype(bool)


def decode_table(addresses: np.ndarray, csizes: np.ndarray, dsizes: np.ndarray, codec: Codec,
                 device_index: int = 0) -> tuple[Any, np.ndarray, np.ndarray]:
    """Bare streams (``lz4_raw``: blosc's and HDF5 bitshuffle's LZ4 blocks) at device ``addresses``,
    each ``csizes`` bytes decoding to ``dsizes``, in one nvCOMP call with no Python per stream.

    Returns ``(buffer, offsets, ok)``: stream ``k`` decoded at ``buffer[offsets[k]:][:dsizes[k]]``
    where ``ok[k]``; a stream that does not walk to its end, or decodes to another size, is not ok
    (the caller sends its piece to the host). ``decode`` takes a CuPy array per piece, which cost
    ~20 µs of Python each: 0.5 million 8 KiB blocks of a 4 GiB HDF5 bitshuffle file took seconds;
    here the addresses go to nvCOMP as one table.
    """
    import cupy

    algorithm, framing = ALGORITHMS[codec.id]
    if framing not in _HEADLESS:
        raise ValueError(f"decode_table takes bare streams, not {codec.id}")
    addresses = np.asarray(addresses, dtype=np.uint64)
    csizes, dsizes = np.asarray(csizes, dtype=np.int64), np.asarray(dsizes, dtype=np.int64)
    ok = (dsizes > 0) & (csizes > 0)
    if ok.any():  # every stream here is LZ4 (``_HEADLESS``): walked, nvCOMP decodes each
        from gpulazy.codecs import lz4

        sel = np.flatnonzero(ok)
        ok[sel] = lz4.walk(addresses[sel], csizes[sel], np.zeros(len(sel), np.int64), dsizes[sel],
                           record=False).status != lz4.BAD
    offsets = np.zeros(len(addresses), dtype=np.int64)
    if not ok.any():
        return cupy.empty(1, dtype=np.uint8), offsets, ok
    from gpulazy.codecs import _nvcomp_c, filters

    align = _nvcomp_c.alignments(algorithm)
    sel = np.flatnonzero(ok)
    ok[sel[addresses[sel] % np.uint64(align.input) != 0]] = False  # nvCOMP would refuse them: the host decodes
    sel = np.flatnonzero(ok)
    if not len(sel):
        return cupy.empty(1, dtype=np.uint8), offsets, ok
    decoded = filters.slots(dsizes[sel], max(_OUT_ALIGN, align.output))
    out, offsets[sel] = decoded.owners[0], decoded.starts
    stream = _stream(device_index)
    _after_current(stream, cupy)
    try:
        got, status = _nvcomp_c.decompress(algorithm, addresses[sel], csizes[sel], decoded.ptrs, dsizes[sel], stream)
    except _nvcomp_c.NvcompError:  # the call refused as a whole: every piece to the host
        ok[sel] = False
        return out, offsets, ok
    ok[sel] = (status == 0) & (got == dsizes[sel])
    return out, offsets, ok


_ZSTD_MAX_BLOCK = 128 * 1024

def _walk_kernel(name: str, helpers: str, body: str) -> str:
    """The source of a walk kernel: one thread per piece sets ``ok[p]`` from ``body``, which
    walks ``s[start[p]:n[p]]`` (``limit[p]``: what the end must match) and sets ``good``."""
    return helpers + f"""
extern "C" __global__ void gl_{name}(const unsigned long long* src, const long long* n,
                                     const long long* start, const long long* limit, int* ok, long long count) {{
    long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (p >= count) return;
    const unsigned char* s = (const unsigned char*)src[p];
    long long end = n[p], pos = start[p];
    int good = 0;
{body}
    ok[p] = good;
}}
"""


# The rules of ``zstd_blocks_fit``; ``limit``: the frame's checksum bytes after the last block.
_ZSTD_WALK = _walk_kernel("zstd_walk", "", r"""
    while (pos + 3 <= end) {
        unsigned int h = s[pos] | (s[pos + 1] << 8) | (s[pos + 2] << 16);
        unsigned int last = h & 1u, kind = (h >> 1) & 3u, size = h >> 3;
        if (kind == 3u || size > 131072u) break;
        pos += 3 + (kind == 1u ? 1 : (long long)size);
        if (last) { good = (pos + limit[p] == end); break; }
    }""")

#: framing -> (kernel name, source, why a piece that fails the walk goes to the host)
_WALKS = {
    "zstd": ("zstd_walk", _ZSTD_WALK, "zstd block headers do not end at the end of the piece (truncated or "
             "corrupt)"),
}
#: Why an LZ4 block that fails ``gpulazy.codecs.lz4.walk`` goes to the host.
_LZ4_BAD = "lz4 sequences do not end at the end of the piece with the expected size (truncated or corrupt)"
_LZ4_FRAMINGS = frozenset({"lz4-numcodecs", "lz4-raw"})


def _lz4(head: bytes, size: int) -> tuple[Any, str]:
    if size < 5:
        return None, "lz4 piece shorter than its size prefix and one token"
    return (4, size), ""


def _zlib(head: bytes, size: int) -> tuple[Any, str]:
    if size < 7:
        return None, "zlib stream too short"
    cmf, flg = head[0], head[1]
    if cmf & 0x0F != 8 or cmf >> 4 > 7 or (cmf * 256 + flg) % 31:
        return None, "not a zlib stream (bad header)"
    if flg & 0x20:
        return None, "zlib stream uses a preset dictionary"
    return (2, size - 4), ""


def _gzip(head: bytes, tail: bytes, size: int) -> tuple[Any, str]:
    if size < 18 or head[:3] != b"\x1f\x8b\x08":
        return None, "not a gzip member (bad header)"
    flg, at = head[3], 10
    if flg & 0xE0:
        return None, "gzip header has reserved flags set"
    if flg & 4:  # FEXTRA: 2-byte length, then that many bytes
        if len(head) < at + 2:
            return None, "gzip header longer than fetched"
        at += 2 + int.from_bytes(head[at:at + 2], "little")
    for bit in (8, 16):  # FNAME, FCOMMENT: zero-terminated
        if flg & bit:
            end = head.find(b"\x00", at)
            if end < 0:
                return None, "gzip header longer than fetched"
            at = end + 1
    if flg & 2:  # FHCRC
        at += 2
    if at > len(head) or at >= size - 8:
        return None, "gzip header longer than fetched"
    return (at, size - 8), ""
