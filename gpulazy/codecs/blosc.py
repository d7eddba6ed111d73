"""Blosc (c-blosc 1 format, Zarr v2's default compressor) decoded on the GPU.

A blosc chunk is a 16-byte header, a table of block starts, and the blocks; each block is
one stream, or ``typesize`` streams when it is split, each stream a 4-byte little-endian
compressed size and then the stream (stored raw when that size equals the stream's decoded
size). c-blosc's ``blosc_d``/``blosc_run_decompression_with_context`` (blosc/blosc.c) is
the reference this follows rule by rule:

- header: ``version`` (2), ``versionlz`` (1), ``flags`` (bit 0 byte shuffle, bit 1 stored
  raw ("memcpyed"), bit 2 bit shuffle, bit 3 reserved, bit 4 "do not split", bits 5-7 the
  inner codec: 0 blosclz, 1 lz4/lz4hc, 2 snappy, 3 zlib, 4 zstd), ``typesize``, then
  ``nbytes``, ``blocksize`` and ``cbytes`` as little-endian uint32;
- ``nblocks = ceil(nbytes / blocksize)``; the last block holds the leftover bytes;
- a block is split into ``typesize`` streams unless the flag says not to, the typesize is
  over 16, the block holds fewer than 128 elements, or it is the leftover block;
- after decoding, a block is byte-unshuffled (typesize > 1; trailing bytes that make no
  whole element are left as they are) or bit-unshuffled (when its element count is a
  multiple of 8; otherwise the block was stored unshuffled; trailing bytes as they are).

On the GPU (``decode``): the headers are read and checked on the host (one copy of each
piece's first bytes), one thread per block walks its streams' sizes (``_WALK``, whose host
twin is ``walk_streams``), every LZ4 (or zstd) stream of every block of every chunk goes to
nvCOMP in one batched call, and one kernel launch (``gpulazy.codecs._unshuffle``, host twin
``unshuffle_block``) gathers each block's streams, undoes the shuffle and writes the
chunk; the plan between them is NumPy tables over the batch's blocks and streams. Chunks
whose inner codec nvCOMP does not decode (blosclz, zlib, snappy), and chunks whose framing
fails a check, are handed back for the host (c-blosc through numcodecs), which decodes them
or raises the error naming the file.

>>> import numcodecs, numpy as np
>>> blob = numcodecs.Blosc("lz4", shuffle=1).encode(np.arange(300, dtype="<u2"))
>>> h = parse_header(blob[:16], len(blob), 600)
>>> (h.codec, h.typesize, h.nblocks, h.mode)
('lz4', 2, 1, 1)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from gpulazy.codecs._frames import FrameError
from gpulazy.codecs.pieces import Pieces
from gpulazy.spec import Codec

__all__ = ["Header", "parse_header", "walk_streams", "unshuffle_block", "decode_checked", "handles", "decode",
           "block_table", "unshuffle_rows", "by_piece", "HEADER", "INNER_CODECS"]

HEADER = 16
_VERSION, _VERSIONLZ = 2, 1
_MAX_SPLITS, _MIN_BUFFERSIZE = 16, 128  # c-blosc's split conditions
_MAX_BLOCKSIZE = (2**31 - 1 - 255 * 4) // 3
#: flags bits 5-7 -> inner codec name
INNER_CODECS = {0: "blosclz", 1: "lz4", 2: "snappy", 3: "zlib", 4: "zstd"}
#: inner codec -> the nvCOMP-decoded codec its streams are sent as
_GPU_INNER = {"lz4": Codec("lz4_raw"), "zstd": Codec("zstd")}


@dataclass(frozen=True)
class Header:
    """A checked blosc1 header. ``mode``: 0 none, 1 byte shuffle, 2 bit shuffle."""

    flags: int
    typesize: int
    nbytes: int
    blocksize: int
    cbytes: int

    @property
    def codec(self) -> str:
        return INNER_CODECS.get(self.flags >> 5, f"unknown ({self.flags >> 5})")

    @property
    def memcpyed(self) -> bool:
        return bool(self.flags & 2)

    @property
    def mode(self) -> int:
        if self.flags & 1 and self.typesize > 1:
            return 1
        return 2 if self.flags & 4 else 0

    @property
    def nblocks(self) -> int:
        return -(-self.nbytes // self.blocksize) if self.blocksize else 0

    def block(self, b: int) -> tuple[int, int]:
        """``(bytes, streams)`` of block ``b``: c-blosc's ``bsize`` and ``nsplits``."""
        leftover = self.nbytes % self.blocksize
        last = b == self.nblocks - 1 and leftover > 0
        bsize = leftover if last else self.blocksize
        split = (not self.flags & 0x10 and self.typesize <= _MAX_SPLITS
                 and bsize // self.typesize >= _MIN_BUFFERSIZE and not last)
        return bsize, self.typesize if split else 1


def parse_header(head: bytes, size: int, expected: int | None) -> Header:
    """The header of a blosc piece of ``size`` bytes that must decode to ``expected`` bytes.

    Every field is checked against the piece and the expected size before any stream is
    looked at (what c-blosc checks, and that split blocks divide evenly, which c-blosc's
    writer guarantees and its reader would silently get wrong): ``FrameError`` says what is off.
    """
    if size < HEADER or len(head) < HEADER:
        raise FrameError(f"a blosc piece of {size} bytes cannot hold its {HEADER}-byte header")
    version, versionlz, flags, typesize = head[0], head[1], head[2], head[3]
    nbytes, blocksize, cbytes = struct.unpack_from("<III", head, 4)
    h = Header(flags, typesize, nbytes, blocksize, cbytes)
    if cbytes != size:
        raise FrameError(f"its blosc header says the piece is {cbytes} bytes long, but it is {size}", got=nbytes)
    if expected is not None and nbytes != expected:
        raise FrameError(f"its blosc header says it decodes to {nbytes} bytes", got=nbytes)
    if version != _VERSION or flags & 0x08:
        raise FrameError(f"blosc format version {version} (flags {flags:#04x}) is not c-blosc 1's", got=nbytes)
    if nbytes == 0:
        return h
    if not 0 < blocksize <= _MAX_BLOCKSIZE or typesize == 0:
        raise FrameError(f"its blosc header has block size {blocksize} and type size {typesize}", got=nbytes)
    if h.memcpyed:
        if cbytes != nbytes + HEADER:
            raise FrameError(f"a stored (memcpyed) blosc piece of {nbytes} bytes must be {nbytes + HEADER} "
                             f"bytes long, not {cbytes}", got=nbytes)
        return h
    if versionlz != _VERSIONLZ:
        raise FrameError(f"blosc inner format version {versionlz} is not 1", got=nbytes)
    if h.nblocks > (cbytes - HEADER) // 4:
        raise FrameError(f"a blosc piece of {cbytes} bytes cannot hold the starts of its {h.nblocks} blocks",
                         got=nbytes)
    if any(bsize % n for bsize, n in (h.block(0), h.block(h.nblocks - 1))):
        raise FrameError(f"blosc block size {blocksize} is not a multiple of the type size {typesize}",
                         got=nbytes)
    return h


def streams_per_block(h: Header) -> list[int]:
    return [h.block(b)[1] for b in range(h.nblocks)] if not h.memcpyed else []


def walk_streams(data: bytes, h: Header) -> list[tuple[int, int]]:
    """``(offset, compressed size)`` of every stream, block by block (the host twin of ``_WALK``).

    A block start must lie past the start table, every size prefix and stream inside the
    piece, and no stream may be empty: ``FrameError`` otherwise.
    """
    table, n, out = HEADER + 4 * h.nblocks, len(data), []
    for b, splits in enumerate(streams_per_block(h)):
        pos = int.from_bytes(data[HEADER + 4 * b:HEADER + 4 * b + 4], "little")
        if not table <= pos <= n:
            raise FrameError(f"blosc block {b} starts at {pos}, outside bytes {table}..{n} of the piece")
        for j in range(splits):
            if pos + 4 > n:
                raise FrameError(f"blosc block {b} stream {j}: its size prefix at {pos} passes the piece's end")
            c = int.from_bytes(data[pos:pos + 4], "little")
            pos += 4
            if not 0 < c <= n - pos:
                raise FrameError(f"blosc block {b} stream {j}: {c} compressed bytes at {pos} do not fit the "
                                 f"{n}-byte piece")
            out.append((pos, c))
            pos += c
    return out


def unshuffle_block(shuffled: np.ndarray, typesize: int, mode: int) -> np.ndarray:
    """One block's bytes from its decoded streams (concatenated): the host twin of ``_unshuffle``.

    ``mode`` 1: byte unshuffle, trailing bytes as they are; 2: bit unshuffle when the
    element count is a multiple of 8 (bit ``b`` of byte ``j`` of element ``i`` is bit
    ``(j * 8 + b) * count + i`` of the block, least significant first), else a copy.
    """
    bsize = shuffled.size
    count = bsize // typesize
    out = shuffled.copy()
    body = count * typesize
    if mode == 1 and typesize > 1:
        out[:body] = shuffled[:body].reshape(typesize, count).T.reshape(-1)
    elif mode == 2 and count % 8 == 0 and count:
        bits = np.unpackbits(shuffled[:body], bitorder="little").reshape(typesize, 8, count)
        out[:body] = np.packbits(bits.transpose(2, 0, 1).reshape(-1), bitorder="little")
    return out


def decode_checked(data: np.ndarray, codec: Codec, expected: int | None) -> np.ndarray | None:
    """A blosc piece decoded on the host by the GPU path's plan, every stream bounds-checked.

    For pieces the GPU path refused: c-blosc decodes LZ4 streams with
    ``LZ4_decompress_fast``, which trusts the stream (a garbled payload whose lengths still
    add up decodes to wrong bytes, silently), so LZ4 streams go through python-lz4's safe
    decoder after the GPU walk's rules (``lz4.block_fits``), and zstd streams through numcodecs' (which checks them). Other inner
    codecs, or no python-lz4: ``None`` (the host decodes with c-blosc, numcodecs). Far slower than c-blosc (the walk
    is Python): not the CPU path's decoder, only the fallback for pieces that already
    failed a GPU-side check.
    """
    data = np.asarray(data).reshape(-1).view(np.uint8)
    head = data[:HEADER].tobytes()
    h = parse_header(head, int(data.size), expected)
    if h.nbytes == 0 or h.memcpyed:
        return data[HEADER:HEADER + h.nbytes].copy()
    inner = _safe_inner(h.codec)
    if inner is None:  # no checked decoder for this inner codec: the caller's c-blosc decodes it
        return None
    blob = data.tobytes()
    streams = iter(walk_streams(blob, h))
    out = np.empty(h.nbytes, np.uint8)
    for b in range(h.nblocks):
        bsize, n = h.block(b)
        parts = []
        for _ in range(n):
            off, c = next(streams)
            part = blob[off:off + c]
            part = part if c == bsize // n else inner(part, bsize // n)
            if len(part) != bsize // n:
                raise FrameError(f"blosc block {b}: a {h.codec} stream decoded to {len(part)} bytes, expected "
                                 f"{bsize // n}")
            parts.append(part)
        shuffled = np.frombuffer(b"".join(parts), np.uint8)
        out[b * h.blocksize:b * h.blocksize + bsize] = unshuffle_block(shuffled, h.typesize, h.mode)
    return out


def _safe_inner(codec: str) -> Any:
    """``fn(stream, decoded_size) -> bytes`` with a decoder that checks its input, or None."""
    if codec == "zstd":
        import numcodecs

        return lambda s, n: bytes(numcodecs.Zstd().decode(s))
    if codec == "lz4":
        try:
            import lz4.block
        except ImportError:
            return None
        return _lz4_checked
    return None


def _lz4_checked(stream: bytes, n: int) -> bytes:
    # LZ4's safe decoder only stays in bounds: a zero match offset or a stream that ends
    # early with the right size still "decodes". The GPU walk's rules (its host twin) come first.
    import lz4.block

    from gpulazy.codecs.lz4 import block_fits

    if not block_fits(stream, 0, n):
        raise FrameError(f"an lz4 stream of {len(stream)} bytes does not decode to exactly {n} bytes "
                         "(its sequences are corrupt)")
    return lz4.block.decompress(stream, uncompressed_size=n)


# -- the GPU path ---------------------------------------------------------------------------

def handles(c: Codec) -> bool:
    """Whether blosc codec ``c`` decodes on the GPU here (nvCOMP's LZ4, or zstd for cname zstd)."""
    if c.id != "blosc":
        return False
    from gpulazy.codecs import nvcomp

    inner = str(c.get("cname") or "lz4")
    need = "zstd" if inner == "zstd" else "lz4_raw"
    return inner in ("lz4", "lz4hc", "zstd") and need in nvcomp.supported()


def decode(pieces: Sequence[Any], codec: Codec, sizes: Sequence[int], device_index: int = 0) -> Any:
    """Blosc ``pieces`` (``Pieces``, or 1-D CuPy uint8 arrays), each to ``sizes[i]`` bytes: an
    ``nvcomp.Decoded``.

    Pieces whose header or streams fail a check, whose inner codec has no GPU decoder
    (``Decoded.slow``), or whose streams nvCOMP refuses are listed in ``Decoded.host``.
    """
    import cupy

    from gpulazy.codecs import nvcomp

    pieces = Pieces.of(pieces)
    # What the GPU refuses, the host decodes with every stream checked (``decode_checked``).
    result = nvcomp.Decoded.pending(len(pieces), cupy, host_codec=Codec("blosc_checked"))
    heads, _ = nvcomp._ends(pieces)
    plans: dict[int, Header] = {}
    stored: dict[int, int] = {}  # piece -> its bytes, stored as they are after the header
    for i, n in enumerate(sizes):
        try:
            h = parse_header(heads[i], int(pieces.sizes[i]), int(n))
        except FrameError as e:
            _to_host(result, i, str(e))
            continue
        if h.nbytes == 0 or h.memcpyed:
            stored[i] = h.nbytes
        elif h.codec not in _GPU_INNER or h.codec == "zstd" and "zstd" not in nvcomp.supported():
            _to_host(result, i, f"blosc inner codec {h.codec!r} has no GPU decoder here")
            result.slow.append(i)
        else:
            plans[i] = h
    if stored:  # a span of the piece, exactly nbytes long: no copy
        at = list(stored)
        result.out = result.out.filled([(at, pieces.within(at, HEADER, list(stored.values())))])
    if plans:
        _decode_planned(pieces, plans, result, device_index)
    result.host.sort()
    return result


def _to_host(result: Any, i: int, why: str) -> None:
    result.host.append(i)
    result.why[i] = why


def _decode_planned(pieces: Pieces, plans: dict[int, Header], result: Any, device_index: int) -> None:
    """Walk, decompress in one nvCOMP call per inner codec, unshuffle in one launch.

    The plan is NumPy tables over every block and stream of the batch (no Python per block).
    """
    from gpulazy.codecs import _unshuffle, filters

    blocks = block_table(plans)
    piece, _, bsize, streams, _ = blocks.T
    offsets, csizes, ok = _walk(pieces, plans, blocks)
    bad = sorted(set(piece[ok == 0].tolist()))
    for i in bad:
        _to_host(result, i, "blosc block starts or stream sizes do not fit the piece (truncated or corrupt)")
    # Every stream: its piece, decoded size and address (one stored raw: where it lies in its piece).
    of = np.repeat(piece, streams)
    neblock = np.repeat(bsize // streams, streams)
    raw = csizes == neblock
    ptr = pieces.ptrs.astype(np.int64)
    pointers = np.zeros(len(of), np.uint64)
    pointers[raw] = (ptr[of[raw]] + offsets[raw]).astype(np.uint64)
    # Each piece's inner codec as a number (0: none, its blocks refused by the walk).
    inners = sorted({h.codec for h in plans.values()})
    code = by_piece(len(pieces), {i: 1 + inners.index(h.codec) for i, h in plans.items() if i not in bad})[of]
    failed: set[int] = set()
    held: list[Any] = []  # nvCOMP's outputs, alive until the unshuffle launch is queued
    for c, inner in enumerate(inners, 1):
        failed |= _inflate(pieces, np.flatnonzero((code == c) & ~raw), (of, offsets, csizes, neblock), inner,
                           device_index, pointers, result, held)
    kept = sorted(set(plans) - set(bad) - failed)
    if not kept:
        return
    out = filters.slots([plans[i].nbytes for i in kept])
    result.out = result.out.filled([(kept, out)])
    rows = unshuffle_rows(plans, blocks, dict(zip(kept, out.ptrs.tolist())))
    _unshuffle.unshuffle_blocks(rows, pointers)


def unshuffle_rows(plans: dict[int, Header], blocks: np.ndarray, dest: dict[int, int]) -> np.ndarray:
    """``_unshuffle``'s table for the blocks (``block_table(plans)``) of the pieces in ``dest``
    (piece -> output address, never 0): each block to its place, unshuffled by its piece's mode."""
    piece, index, bsize, streams, first = blocks.T
    n = max([*dest, int(piece.max(initial=0))]) + 1
    out = by_piece(n, dest)
    typesize, mode, blocksize = (by_piece(n, {i: getattr(plans[i], a) for i in dest})
                                 for a in ("typesize", "mode", "blocksize"))
    rows = np.flatnonzero(out[piece])
    p = piece[rows]
    table = np.empty((len(rows), 6), np.int64)
    table[:, 0] = out[p] + index[rows] * blocksize[p]
    table[:, 1], table[:, 2], table[:, 3], table[:, 4] = bsize[rows], typesize[p], mode[p], first[rows]
    table[:, 5] = bsize[rows] // streams[rows]
    return table


def by_piece(n: int, values: dict[int, int]) -> np.ndarray:
    """``values`` as an int64 array of ``n`` indexed by piece (0 where a piece has none)."""
    out = np.zeros(n, np.int64)
    for i, v in values.items():
        out[i] = v
    return out


def _inflate(pieces: Pieces, sel: np.ndarray, streams: tuple[np.ndarray, ...], inner: str, device_index: int,
             pointers: np.ndarray, result: Any, held: list) -> set[int]:
    """Streams ``sel`` (all of inner codec ``inner``) through nvCOMP in one call: their decoded
    addresses into ``pointers``, nvCOMP's result kept in ``held``. Returns the pieces with a
    stream that did not decode (each handed to the host once, saying why)."""
    from gpulazy.codecs import nvcomp

    if not len(sel):
        return set()
    of, offsets, csizes, neblock = (a[sel] for a in streams)
    if _GPU_INNER[inner].id == "lz4_raw":  # bare LZ4 blocks: one table, no Python per stream
        decoded, at, good = nvcomp.decode_table(pieces.ptrs[of] + offsets.astype(np.uint64), csizes, neblock,
                                                _GPU_INNER[inner], device_index)
        held.append(decoded)
        pointers[sel[good]] = np.uint64(decoded.data.ptr) + at[good].astype(np.uint64)
        bad = {int(i) for i in np.unique(of[~good])}
        for i in sorted(bad):
            _to_host(result, i, f"a blosc {inner} stream did not decode on the GPU")
        return bad
    streams = pieces.within(of, offsets, csizes)
    res = nvcomp.decode(streams, _GPU_INNER[inner], neblock.tolist(), device_index)
    held.append(res)
    ok = np.ones(len(streams), bool)
    ok[res.host] = False
    pointers[sel[ok]] = res.out.ptrs[ok]
    failed: set[int] = set()
    for k in res.host:
        if int(of[k]) not in failed:
            failed.add(int(of[k]))
            _to_host(result, int(of[k]), f"a blosc {inner} stream: {res.why.get(k, 'not decoded')}")
    return failed


def block_table(plans: dict[int, Header]) -> np.ndarray:
    """One int64 row per block of every planned piece: (piece, block index, bytes, streams, first
    stream's slot), streams numbered across the batch. Every block but a piece's last has block
    0's bytes and streams (``Header.block``)."""
    parts = [np.empty((0, 4), np.int64)]
    for i, h in plans.items():
        t = np.empty((h.nblocks, 4), np.int64)
        t[:, 0], t[:, 1] = i, np.arange(h.nblocks)
        t[:, 2:] = h.block(0)
        t[-1, 2:] = h.block(h.nblocks - 1)
        parts.append(t)
    t = np.concatenate(parts)
    return np.column_stack([t, np.cumsum(t[:, 3]) - t[:, 3]]).astype(np.int64)


def _walk(pieces: Pieces, plans: dict[int, Header], blocks: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every stream's offset and size and every block's ok flag (``blocks``: ``block_table(plans)``):
    one kernel launch, one copy down for the batch."""
    import cupy

    from gpulazy.codecs import filters

    n = len(blocks)
    piece, index, _, streams, first = blocks.T
    nstreams = int(streams.sum())
    ptr = pieces.ptrs.astype(np.int64)
    cbytes = by_piece(len(pieces), {i: h.cbytes for i, h in plans.items()})
    nblocks = by_piece(len(pieces), {i: h.nblocks for i, h in plans.items()})
    table = np.column_stack([ptr[piece], cbytes[piece], index, nblocks[piece], streams, first]).astype(np.int64)
    found = cupy.zeros(2 * nstreams + n, dtype=np.int64)  # offsets, sizes, ok
    k = filters.kernel("blosc_walk", _WALK)
    k((-(-n // 64),), (64,), (cupy.asarray(table), found, np.int64(nstreams), np.int64(n)))
    host = found.get()
    return host[:nstreams], host[nstreams:2 * nstreams], host[2 * nstreams:]


def row_kernel(name: str, width: int, total: str, body: str, helpers: str = "") -> str:
    """A kernel with one thread per row of ``width`` int64s (``row[0]``: a piece's address, as
    ``s``), writing into ``found``; ``total`` names its int64 size parameter. Used by the walks."""
    return helpers + f"""
extern "C" __global__ void gl_{name}(const long long* rows, long long* found, long long {total}, long long count) {{
    long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (t >= count) return;
    const long long* row = rows + {width} * t;
    const unsigned char* s = (const unsigned char*)row[0];
{body}
}}
"""


# One thread per block: its start from the table, then each stream's size prefix; the rules
# of ``walk_streams``. ``row``: piece address, piece length, block index, block count,
# streams, first slot. ``found``: offsets[nstreams], sizes[nstreams], ok[nblocks].
_WALK = row_kernel("blosc_walk", 6, "nstreams", r"""
    long long n = row[1], b = row[2], table = 16 + 4 * row[3], splits = row[4], slot = row[5];
    long long pos = gl_rd32(s + 16 + 4 * b);
    long long good = (pos >= table && pos <= n);
    for (long long j = 0; good && j < splits; ++j) {
        if (pos + 4 > n) { good = 0; break; }
        long long c = gl_rd32(s + pos);
        pos += 4;
        if (c <= 0 || c > n - pos) { good = 0; break; }
        found[slot + j] = pos;
        found[nstreams + slot + j] = c;
        pos += c;
    }
    found[2 * nstreams + t] = good;""", helpers=r"""
__device__ long long gl_rd32(const unsigned char* s) {
    return (long long)((unsigned int)s[0] | ((unsigned int)s[1] << 8) | ((unsigned int)s[2] << 16)
                       | ((unsigned int)s[3] << 24));
}
""")
