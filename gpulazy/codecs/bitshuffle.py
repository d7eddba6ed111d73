"""HDF5's bitshuffle + LZ4 filter (32008, what Dectris detectors and hdf5plugin write).

A chunk (bitshuffle's ``bshuf_h5_filter`` and ``bshuf_blocked_wrap_fun``, src/ of
kiyo-masui/bitshuffle) is a 12-byte big-endian header — the decoded size (uint64) and
the block size in bytes (uint32) — then blocks of ``block`` elements (a multiple of 8),
each a 4-byte big-endian compressed size and one LZ4 block of the block's bit-shuffled
bytes; the last block holds the elements left over, rounded down to a multiple of 8; the
last ``count % 8`` elements follow as they are. A block's bits are laid out as in blosc's
bit shuffle: bit ``b`` of byte ``j`` of element ``i`` is bit ``(8 j + b) * n + i``.

On the GPU (``decode``): headers checked on the host, one thread per chunk walks its block
sizes (``_WALK``; host twin ``walk_blocks``), every LZ4 block of the batch goes to nvCOMP
in one call, one launch of ``gpulazy.codecs._unshuffle`` bit-unshuffles every block of every
chunk into place (an 8 x 8 bit transpose per thread) and copies the leftover elements. The
plan is NumPy tables over the batch's blocks; the host syncs are one per batch (the header
bytes, the walk's table, nvCOMP's sizes), none per chunk.
On the host (``decode_host``): python-lz4 per block, then imagecodecs' bitshuffle (or
NumPy when imagecodecs is missing). Codec: ``Codec.of("bitshuffle_lz4", elementsize=n)``.

>>> import struct
>>> h = parse_header(struct.pack(">QI", 4096, 2048), 40, 4096, 2)
>>> (h.count, h.block, h.nblocks, h.leftover)
(2048, 1024, 2, 0)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from gpulazy.codecs._frames import FrameError
from gpulazy.codecs.pieces import Pieces
from gpulazy.spec import Codec

__all__ = ["Header", "parse_header", "walk_blocks", "decode_host", "handles", "decode", "block_table", "unshuffle_rows",
           "HEADER"]

HEADER = 12


@dataclass(frozen=True)
class Header:
    """A checked header: ``count`` elements of ``elementsize`` bytes in blocks of ``block``."""

    nbytes: int
    elementsize: int
    block: int

    @property
    def count(self) -> int:
        return self.nbytes // self.elementsize

    @property
    def sizes(self) -> list[int]:
        """Elements in each LZ4 block."""
        return [self.block] * (self.nblocks - 1) + [self.last] if self.nblocks else []

    @property
    def nblocks(self) -> int:
        full, rest = divmod(self.count, self.block)
        return full + (rest >= 8)

    @property
    def last(self) -> int:
        """Elements in the last LZ4 block (0 without blocks): the rest rounded down to a
        multiple of 8, or a whole block when that leaves nothing."""
        full, rest = divmod(self.count, self.block)
        return rest - rest % 8 if rest >= 8 else (self.block if full else 0)

    @property
    def leftover(self) -> int:
        """Bytes stored as they are after the last block."""
        return self.count % 8 * self.elementsize


def parse_header(head: bytes, size: int, expected: int | None, elementsize: int) -> Header:
    """The header of a piece of ``size`` bytes; ``FrameError`` when it cannot be this piece's."""
    if size < HEADER or len(head) < HEADER:
        raise FrameError(f"a bitshuffle piece of {size} bytes cannot hold its {HEADER}-byte header")
    nbytes, block_bytes = struct.unpack_from(">QI", head)
    if expected is not None and nbytes != expected:
        raise FrameError(f"its bitshuffle header says it decodes to {nbytes} bytes", got=nbytes)
    if elementsize <= 0 or nbytes % elementsize:
        raise FrameError(f"{nbytes} bytes are not whole elements of {elementsize} bytes", got=nbytes)
    block = block_bytes // elementsize
    if block_bytes % elementsize or block <= 0 or block % 8:
        raise FrameError(f"bitshuffle block size {block_bytes} bytes is not a positive multiple of 8 elements "
                         f"of {elementsize} bytes", got=nbytes)
    h = Header(nbytes, elementsize, block)
    if HEADER + 8 * h.nblocks + h.leftover > size:  # a size prefix and >= 4 bytes of LZ4 per block
        raise FrameError(f"a bitshuffle piece of {size} bytes cannot hold {h.nblocks} blocks", got=nbytes)
    return h


def walk_blocks(data: bytes | memoryview, h: Header) -> list[tuple[int, int]]:
    """``(offset, compressed size)`` of every LZ4 block: the host twin of ``_WALK``.

    Each size must be positive and fit, and the blocks plus the leftover bytes must end
    exactly at the piece's end: ``FrameError`` otherwise.
    """
    pos, end, out = HEADER, len(data) - h.leftover, []
    for k in range(h.nblocks):
        if pos + 4 > end:
            raise FrameError(f"bitshuffle block {k}: its size prefix at {pos} passes the blocks' end {end}")
        c = int.from_bytes(data[pos:pos + 4], "big")
        pos += 4
        if not 0 < c <= end - pos:
            raise FrameError(f"bitshuffle block {k}: {c} compressed bytes at {pos} do not fit before {end}")
        out.append((pos, c))
        pos += c
    if pos != end:
        raise FrameError(f"bitshuffle blocks end at {pos}, but the piece leaves them {end} bytes")
    return out


def decode_host(data: np.ndarray, codec: Codec, expected: int | None) -> np.ndarray:
    """One piece on the host: python-lz4's safe decoder per block, then the bit unshuffle."""
    import lz4.block

    data = np.ascontiguousarray(np.asarray(data).reshape(-1).view(np.uint8))
    blob = memoryview(data)  # slices without copies: python-lz4 and int.from_bytes take buffers
    es = int(codec.get("elementsize", 1))
    h = parse_header(bytes(blob[:HEADER]), len(blob), expected, es)
    shuffled = np.empty(h.nbytes, np.uint8)
    at = 0
    for (off, c), n in zip(walk_blocks(blob, h), h.sizes):
        try:
            part = lz4.block.decompress(blob[off:off + c], uncompressed_size=n * es)
        except lz4.block.LZ4BlockError as e:
            raise FrameError(f"bitshuffle block at {off}: {e}") from e
        if len(part) != n * es:
            raise FrameError(f"bitshuffle block at {off} decoded to {len(part)} bytes, expected {n * es}")
        shuffled[at:at + n * es] = np.frombuffer(part, np.uint8)
        at += n * es
    shuffled[at:] = data[data.size - h.leftover:]
    return _bitunshuffle(shuffled, h)


def _bitunshuffle(shuffled: np.ndarray, h: Header) -> np.ndarray:
    try:
        import imagecodecs
    except ImportError:
        imagecodecs = None
    if imagecodecs is not None and hasattr(imagecodecs, "bitshuffle_decode"):
        # bitshuffle's own blocked unshuffle: the same blocks, and the leftover copied as is. It
        # takes an array's element size from its dtype (ignoring ``itemsize``): a typed view, or bytes.
        es = h.elementsize
        src = shuffled.view(f"u{es}") if es in (1, 2, 4, 8) else shuffled.tobytes()
        out = imagecodecs.bitshuffle_decode(src, itemsize=es, blocksize=h.block)
        if isinstance(out, np.ndarray):
            return out.reshape(-1).view(np.uint8)
        return np.frombuffer(out, np.uint8).copy()
    from gpulazy.codecs.blosc import unshuffle_block

    out, at = shuffled.copy(), 0
    for n in h.sizes:
        out[at:at + n * h.elementsize] = unshuffle_block(shuffled[at:at + n * h.elementsize], h.elementsize, 2)
        at += n * h.elementsize
    return out


# -- the GPU path ---------------------------------------------------------------------------

def handles(c: Codec) -> bool:
    """Whether ``c`` decodes on the GPU here (nvCOMP's LZ4 for the blocks)."""
    from gpulazy.codecs import nvcomp

    return c.id == "bitshuffle_lz4" and "lz4_raw" in nvcomp.supported()


def decode(pieces: Sequence[Any], codec: Codec, sizes: Sequence[int], device_index: int = 0) -> Any:
    """``pieces`` (``Pieces``, or 1-D CuPy uint8 arrays) each to ``sizes[i]`` bytes: an
    ``nvcomp.Decoded``; pieces that fail a check or whose LZ4 nvCOMP refuses are in ``host``
    (``decode_host`` says why)."""
    import cupy

    from gpulazy.codecs import nvcomp

    pieces = Pieces.of(pieces)
    result = nvcomp.Decoded.pending(len(pieces), cupy)
    es = int(codec.get("elementsize", 1))
    heads, _ = nvcomp._ends(pieces)
    plans: dict[int, Header] = {}
    for i, n in enumerate(sizes):
        try:
            plans[i] = parse_header(heads[i], int(pieces.sizes[i]), int(n), es)
        except FrameError as e:
            _to_host(result, i, str(e))
    if plans:
        _decode_planned(pieces, plans, result, device_index)
    result.host.sort()
    return result


def _to_host(result: Any, i: int, why: str) -> None:
    result.host.append(i)
    result.why[i] = why


def block_table(plans: dict[int, Header]) -> np.ndarray:
    """One int64 row per LZ4 block of every planned piece, in ``plans`` order: (piece, decoded
    bytes, where they go in the piece's output). Every block but a piece's last is ``block`` elements."""
    ids = np.array(list(plans), np.int64)
    counts, step, last = (np.array([f(h) for h in plans.values()], np.int64).reshape(-1) for f in (
        lambda h: h.nblocks, lambda h: h.block * h.elementsize, lambda h: h.last * h.elementsize))
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    t = np.column_stack([np.repeat(ids, counts), np.repeat(step, counts), within * np.repeat(step, counts)])
    t[np.cumsum(counts)[counts > 0] - 1, 1] = last[counts > 0]
    return t.astype(np.int64).reshape(-1, 3)


def _decode_planned(pieces: Pieces, plans: dict[int, Header], result: Any, device_index: int) -> None:
    """Walk, every LZ4 block of the batch in one nvCOMP call, bit-unshuffle in one launch.

    The plan is NumPy tables over the batch's blocks (no Python per block).
    """
    from gpulazy.codecs import _unshuffle, filters, nvcomp
    from gpulazy.codecs.blosc import by_piece

    blocks = block_table(plans)
    piece, nbytes, _ = blocks.T
    offsets, csizes, ok = _walk(pieces, plans)
    bad = [i for i, good in zip(plans, ok) if not good]
    for i in bad:
        _to_host(result, i, "bitshuffle block sizes do not fit the piece (truncated or corrupt)")
    sel = np.flatnonzero(by_piece(len(pieces), dict.fromkeys(bad, 1))[piece] == 0)
    decoded, at, good = nvcomp.decode_table(pieces.ptrs[piece[sel]] + offsets[sel].astype(np.uint64), csizes[sel],
                                            nbytes[sel], Codec("lz4_raw"), device_index)
    pointers = np.zeros(len(blocks), np.uint64)  # slot k: block k's decoded (still shuffled) bytes
    pointers[sel[good]] = np.uint64(decoded.data.ptr) + at[good].astype(np.uint64)
    failed = {int(i) for i in np.unique(piece[sel[~good]])}
    for i in sorted(failed):
        _to_host(result, i, "a bitshuffle LZ4 block did not decode on the GPU")
    kept = [i for i in plans if i not in failed and i not in bad]
    if not kept:
        return
    out = filters.slots([plans[i].nbytes for i in kept])
    result.out = result.out.filled([(kept, out)])
    tails = {i: int(pieces.ptrs[i]) + int(pieces.sizes[i]) - plans[i].leftover for i in kept}
    rows, stored = unshuffle_rows(plans, blocks, dict(zip(kept, out.ptrs.tolist())), tails)
    _unshuffle.unshuffle_blocks(rows, np.concatenate([pointers, stored]))


def unshuffle_rows(plans: dict[int, Header], blocks: np.ndarray, dest: dict[int, int], tails: dict[int, int]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``_unshuffle``'s table for the pieces in ``dest`` (piece -> output address, never 0): a
    bit-unshuffle row per LZ4 block (block ``k`` of ``blocks`` decoded at slot ``k``), then a
    copy row per piece with leftover elements, read from ``tails[i]`` (slots from
    ``len(blocks)``: their addresses, the second array returned, follow the blocks')."""
    from gpulazy.codecs.blosc import by_piece

    piece, nbytes, at = blocks.T
    out = by_piece(max([*dest, int(piece.max(initial=0))]) + 1, dest)
    rows = np.flatnonzero(out[piece])
    es = next(iter(plans.values())).elementsize
    left = [i for i in dest if plans[i].leftover]  # the trailing elements, stored as they are
    table = np.empty((len(rows) + len(left), 6), np.int64)
    body = table[:len(rows)]
    body[:, 0] = out[piece[rows]] + at[rows]
    body[:, 1] = body[:, 5] = nbytes[rows]
    body[:, 2], body[:, 3], body[:, 4] = es, 2, rows
    for m, i in enumerate(left):
        n = plans[i].leftover
        table[len(rows) + m] = (dest[i] + plans[i].nbytes - n, n, es, 0, len(blocks) + m, n)
    return table, np.array([tails[i] for i in left], np.uint64)


def _walk(pieces: Pieces, plans: dict[int, Header]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every block's offset and compressed size (``block_table`` order) and every planned piece's
    ok flag (``plans`` order): one thread per piece, one launch and one copy down for the batch."""
    import cupy

    from gpulazy.codecs import filters

    order = list(plans)
    counts = np.array([plans[i].nblocks for i in order], np.int64)
    firsts = np.cumsum(counts) - counts
    rows = np.array([[int(pieces.ptrs[i]), int(pieces.sizes[i]) - plans[i].leftover, plans[i].nblocks, f]
                     for i, f in zip(order, firsts.tolist())], dtype=np.int64)
    total = int(counts.sum())
    found = cupy.zeros(2 * total + len(order), dtype=np.int64)
    k = filters.kernel("bitshuffle_walk", _WALK)
    k((-(-len(order) // 64),), (64,), (cupy.asarray(rows), found, np.int64(total), np.int64(len(order))))
    host = found.get()
    return host[:total], host[total:2 * total], host[2 * total:]


# One thread per chunk: the rules of ``walk_blocks``. ``row``: piece address, where the
# blocks must end, block count, first slot. ``found``: offsets[total], sizes[total], ok[count].
def _walk_source() -> str:
    from gpulazy.codecs.blosc import row_kernel

    return row_kernel("bitshuffle_walk", 4, "total", r"""
    long long end = row[1], nblocks = row[2], slot = row[3], pos = 12, good = 1;
    for (long long k = 0; k < nblocks; ++k) {
        if (pos + 4 > end) { good = 0; break; }
        long long c = ((long long)s[pos] << 24) | ((long long)s[pos + 1] << 16) | ((long long)s[pos + 2] << 8)
                      | (long long)s[pos + 3];
        pos += 4;
        if (c <= 0 || c > end - pos) { good = 0; break; }
        found[slot + k] = pos;
        found[total + slot + k] = c;
        pos += c;
    }
    found[2 * total + t] = good && pos == end;""")


_WALK = _walk_source()
