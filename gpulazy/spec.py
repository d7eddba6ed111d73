"""``ChunkSpec``: an immutable description of one chunk and where its bytes are.

A spec is a value: frozen, slotted, picklable and tokenizable, so dask graph names are
deterministic and tasks travel to ``dask.distributed`` workers. Its ``key`` includes the
``FileIdentity`` (path, size, mtime, inode, ctime) of every file it depends on, so a changed
file never hits a stale cache entry (napari's dask cache is global and keyed by task key).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import InitVar, dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

__all__ = ["ByteRange", "Codec", "Tile", "ChunkSpec", "FileIdentity", "file_identity", "identity_from_stat", "STREAMED",
           "head_allowance"]


@dataclass(frozen=True, slots=True)
class ByteRange:
    """``nbytes`` bytes of ``path`` starting at ``offset``."""

    path: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Codec:
    """One decoding step of a stored chunk: a codec id and its parameters.

    Ids follow numcodecs (``"zstd"``, ``"lz4"``, ``"zlib"``, ``"gzip"``, ``"blosc"``,
    ``"shuffle"``, ``"delta"``, ...) plus gpulazy's own (``"crc32c"``, ``"tiff_predictor"``,
    ...): ``gpulazy.codecs`` says which decode on the GPU. ``params`` is a sorted tuple of
    ``(name, value)`` pairs so a codec is hashable and part of the chunk key.
    """

    id: str
    params: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, id: str, **params: object) -> Codec:
        return cls(id, tuple(sorted((k, _freeze(v)) for k, v in params.items())))

    def get(self, name: str, default: object = None) -> object:
        return dict(self.params).get(name, default)

    def config(self) -> dict:
        """The numcodecs-style config dict: ``{"id": ..., **params}``."""
        return {"id": self.id, **{k: _thaw(v) for k, v in self.params}}


def _freeze(v: object) -> object:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    return v


def _thaw(v: object) -> object:
    return list(v) if isinstance(v, tuple) else v


@dataclass(frozen=True, slots=True)
class Tile:
    """One stored piece of a chunk (a Zarr chunk, an HDF5 chunk, a TIFF strip or tile).

    Parameters
    ----------
    range
        Where its stored (possibly encoded) bytes are; ``None`` when the piece was never
        written (a missing Zarr chunk, an unallocated HDF5 chunk): it reads as the
        spec's ``fill_value``.
    shape
        The shape its bytes decode to (a stored chunk at an array edge usually decodes to
        the full chunk shape; a TIFF's last strip to fewer rows).
    origin
        Where ``tile[0, 0, ...]`` lands in the chunk; the part outside the chunk is dropped.
    order
        ``"C"`` or ``"F"``: element order of the decoded bytes.
    """

    range: ByteRange | None
    shape: tuple[int, ...]
    origin: tuple[int, ...]
    order: str = "C"


class FileIdentity(NamedTuple):
    """What makes a file's bytes the same bytes as before: the one identity every layout records.

    Size and mtime alone are not enough: ``rsync -t``, ``cp -p`` and ``tar`` rewrite a
    file and set its mtime back. The inode changes when a file is replaced (a rename
    over it, a new file of the same name) and the ctime on every write to it, and no
    tool can set the ctime back. (The ctime ticks at the kernel's timestamp granularity,
    a few milliseconds on older kernels: two writes within one tick look alike.)

    A file that did not exist when indexed (a Zarr chunk never written, read as its
    fill value) has ``size == -1`` (``FileIdentity.absent``): it must still be absent
    when read. A tuple, so it pickles, tokenizes and compares as one; ``st_dev`` is left
    out on purpose, as it differs between hosts that mount the same network file system.
    """

    path: str
    size: int
    mtime_ns: int
    inode: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str) -> FileIdentity:
        """The identity of ``path`` now (``os.stat``; raises ``OSError`` as it does)."""
        return cls.from_stat(path, os.stat(path))

    @classmethod
    def from_stat(cls, path: str, st: os.stat_result) -> FileIdentity:
        """The identity of ``path`` from a ``stat`` result already at hand (``os.scandir``'s)."""
        return cls(path, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)

    @classmethod
    def absent(cls, path: str) -> FileIdentity:
        """``path`` did not exist when indexed."""
        return cls(path, -1, 0, 0, 0)

    @property
    def exists(self) -> bool:
        return self.size >= 0

    def changes(self) -> str | None:
        """What differs between this identity and the file at ``path`` now, or ``None``."""
        if not self.exists and not os.access(self.path, os.F_OK):
            return None  # still absent: os.access costs ~1 µs, a failing os.stat ~8 (it builds an exception)
        try:
            st = os.stat(self.path)
        except FileNotFoundError as e:
            return None if not self.exists else f"it can no longer be found ({e.strerror or e})"
        except OSError as e:
            return f"it can no longer be read ({type(e).__name__}: {e.strerror or e})"
        # Compared field by field before an identity is built: reads check thousands of files.
        if (self.size == st.st_size and self.mtime_ns == st.st_mtime_ns and self.inode == st.st_ino
                and self.ctime_ns == st.st_ctime_ns):
            return None
        now = FileIdentity.from_stat(self.path, st)
        if not self.exists:
            return f"it did not exist when indexed (it read as the fill value) and now has {now.size} bytes"
        return ", ".join(f"{name} {a} -> {b}" for name, a, b in zip(self._fields[1:], self[1:], now[1:]) if a != b)


def file_identity(path: str) -> FileIdentity:
    """``FileIdentity.of(path)``: ``(path, size, mtime_ns, inode, ctime_ns)`` of ``path`` now."""
    return FileIdentity.of(path)


def identity_from_stat(path: str, st: os.stat_result) -> FileIdentity:
    """``FileIdentity.from_stat``: the identity from a ``stat`` result already at hand."""
    return FileIdentity.from_stat(path, st)


#: Compressors whose stream decodes front to back, block by block, so a chunk's first decoded bytes
#: come from a head of its stored bytes (``ChunkSpec.head``). zstd alone: a zlib or gzip stream
#: ends with a checksum of every decoded byte, which a head would leave unchecked.
STREAMED = frozenset({"zstd"})


def head_allowance(decoded: int) -> int:
    """Stored bytes read for a head of ``decoded`` bytes: enough for any zstd frame libzstd writes.

    A block holds at most 128 KiB, and libzstd stores a block that would not shrink as is
    (3 header bytes more), so the blocks up to the one holding the last byte asked for take
    at most ``decoded`` + 128 KiB, plus 3 bytes a block and the frame header. A frame that
    needs more (another encoder's) runs short, and the reader reads the whole chunk instead
    (``gpulazy.codecs.host.HeadShort``).
    """
    return decoded + decoded // 128 + (129 << 10)


def _part_key(key: str, *cut: object) -> str:
    """The key of a part of the chunk keyed ``key``: ``cut`` (how it was cut) determines the part."""
    return hashlib.blake2b(repr((key, *cut)).encode(), digest_size=16).hexdigest()


def _span(ranges: tuple[ByteRange, ...], lo: int, hi: int) -> tuple[ByteRange, ...]:
    """Bytes ``[lo, hi)`` of the concatenation of ``ranges``, as ranges."""
    out, at = [], 0
    for r in ranges:
        a, b = max(lo, at), min(hi, at + r.nbytes)
        if a < b:
            out.append(ByteRange(r.path, r.offset + a - at, b - a))
        at += r.nbytes
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """One chunk: byte ranges that, concatenated in order, are the chunk's bytes.

    Parameters
    ----------
    ranges
        Byte ranges read one after another into the chunk's buffer. For a chunk made of
        ``tiles`` these are the present tiles' ranges, in tile order: tile ``i``'s stored
        bytes are its segment of the buffer (``tile_segments``).
    shape
        The chunk's shape.
    dtype
        The dtype *in the file*, byte order included (``">u2"``); arrays handed out
        are in native byte order (see ``out_dtype``).
    order
        ``"C"`` or ``"F"``: the order of the elements in the concatenated bytes.
    codec
        The decoding steps, in the order they are applied (``(Codec("zstd"), Codec("shuffle",
        ...))``), or ``None`` for raw bytes. Applies to each tile (or, without tiles, to the
        concatenated bytes as one stored piece).
    identity
        The ``FileIdentity`` of each file the chunk depends on: those read, the files whose
        absence made a piece the fill value, and metadata files that describe the bytes;
        part of ``key``. Reads check it: a file changed since indexing raises.
    index
        The chunk's block index in its array (informational; not part of ``key``).
    tiles
        The stored pieces the chunk is assembled from; empty when the concatenated
        ``ranges`` are the chunk's elements in ``order`` (raw, ``.npy``, uncompressed
        contiguous data).
    fill_value
        Value of elements no tile covers (missing chunks).
    """

    ranges: tuple[ByteRange, ...]
    shape: tuple[int, ...]
    dtype: str
    order: str = "C"
    codec: tuple[Codec, ...] | None = None
    identity: tuple[FileIdentity, ...] = ()
    index: tuple[int, ...] = ()
    tiles: tuple[Tile, ...] = ()
    fill_value: object = 0
    #: For a head (``head``): ``(the whole chunk, the plane the head starts at)``; the engine reads the
    #: whole chunk instead of a head its frame cannot serve (``HeadShort``). Not part of the key.
    whole: tuple | None = field(default=None, repr=False, compare=False)
    key: str = field(init=False, repr=False, compare=False)
    #: Bytes read from files (what the backend moves): summed once, as readers ask for it per chunk
    #: several times (grouping, buffers, submission) on the thread that submits the reads.
    nbytes: int = field(init=False, repr=False, compare=False)
    #: Bytes of the decoded chunk: worked out once, as the cache and the read-ahead plan ask for
    #: it for every chunk they consider, several times a task.
    out_nbytes: int = field(init=False, repr=False, compare=False)
    #: The key, where the maker derived it from another spec's instead of hashing a repr of every
    #: range, tile and identity again (about half of ``leading``'s time for a chunk of 16 stored
    #: pieces, paid per chunk on the thread about to submit reads): a part of a chunk (``leading``,
    #: ``head``: ``_part_key``), the same bytes at another block index (``at``). Not a field: the key is.
    _key: InitVar[str | None] = None

    def __post_init__(self, _key: str | None) -> None:
        if _key is not None:
            object.__setattr__(self, "key", _key)
        else:
            h = hashlib.blake2b(digest_size=16)
            # Plain tuples: their repr runs in C, ~3x faster than the dataclasses' (100k-chunk graphs).
            ranges = tuple((r.path, r.offset, r.nbytes) for r in self.ranges)
            identity = tuple(map(tuple, self.identity))  # FileIdentity's repr is Python's, a tuple's C's
            parts: tuple = (ranges, self.shape, self.dtype, self.order, self.codec, identity)
            if self.tiles:
                parts += (tuple((t.range is not None, t.shape, t.origin, t.order) for t in self.tiles),
                          repr(self.fill_value))
            h.update(repr(parts).encode())
            object.__setattr__(self, "key", h.hexdigest())
        object.__setattr__(self, "nbytes", sum(r.nbytes for r in self.ranges))
        object.__setattr__(self, "out_nbytes", math.prod(self.shape) * np.dtype(self.dtype).itemsize)

    @property
    def out_dtype(self) -> np.dtype:
        """The dtype of the array handed out: the file's dtype in native byte order."""
        return np.dtype(self.dtype).newbyteorder("=")

    @property
    def paths(self) -> tuple[str, ...]:
        """The files this chunk reads, in order, without repeats."""
        return tuple(dict.fromkeys(r.path for r in self.ranges))

    @property
    def is_assembled(self) -> bool:
        """Whether the chunk is built from decoded pieces rather than read as is."""
        return bool(self.tiles) or self.codec is not None

    def tile_segments(self) -> list[tuple[Tile, int, int]]:
        """``(tile, start, nbytes)`` of each present tile within the read buffer."""
        out, at = [], 0
        for t in self.tiles:
            if t.range is not None:
                out.append((t, at, t.range.nbytes))
                at += t.range.nbytes
        return out

    def at(self, index: tuple[int, ...]) -> ChunkSpec:
        """This chunk as block ``index`` (of a slice of whole blocks): the same bytes, so the same key.

        >>> c = ChunkSpec((ByteRange("a", 0, 8),), (8,), "u1", index=(3,))
        >>> c.at((0,)).index, c.at((0,)).key == c.key
        ((0,), True)
        """
        return ChunkSpec(self.ranges, self.shape, self.dtype, self.order, self.codec, self.identity, tuple(index),
                         self.tiles, self.fill_value, self.whole, _key=self.key)

    def leading(self, start: int, stop: int, step: int = 1) -> ChunkSpec | None:
        """Slices ``start:stop:step`` of the chunk along axis 0 as a chunk of their own (``planes``).

        >>> c = ChunkSpec((ByteRange("a", 0, 6), ByteRange("b", 10, 10)), (4, 2), "<u2", index=(3, 0))
        >>> c.leading(1, 3).ranges, c.leading(1, 3).shape, c.leading(1, 3).index
        ((ByteRange(path='a', offset=4, nbytes=2), ByteRange(path='b', offset=10, nbytes=6)), (2, 2), (3, 0))
        >>> c.leading(0, 4, 2).ranges, c.leading(0, 4, 2).shape
        ((ByteRange(path='a', offset=0, nbytes=4), ByteRange(path='b', offset=12, nbytes=4)), (2, 2))
        """
        if not self.shape or not 0 <= start < stop <= self.shape[0] or step < 1:
            return None
        return self.planes(range(start, stop, step))

    def planes(self, rows: Sequence[int]) -> ChunkSpec | None:
        """Planes ``rows`` of the chunk along axis 0 (in that order, repeats too) as a chunk of their own
        (their bytes only), or ``None`` when the chunk's bytes are not stored as is in C order (decoded,
        ``"F"``) or a row is outside it.

        For a read that needs part of a chunk (a box off the chunk boundaries, every fourth plane, a
        list of planes): each plane's bytes are one span of the chunk's bytes, or of each stored piece
        it is made of (uncompressed Zarr chunks gathered into one chunk), so the part reads those
        planes alone, ``vol[::4]`` of a folder of TIFF planes a quarter of its files; a run of
        neighbouring rows is one span. The part has a key of its own.

        >>> c = ChunkSpec((ByteRange("a", 0, 8),), (4, 1), "<u2")
        >>> c.planes([3, 0, 1]).ranges
        (ByteRange(path='a', offset=6, nbytes=2), ByteRange(path='a', offset=0, nbytes=4))
        """
        rows = [int(r) for r in rows]
        if (self.codec is not None or self.order != "C" or not self.shape or not rows
                or not 0 <= min(rows) <= max(rows) < self.shape[0]):
            return None
        runs: list[list[int]] = []  # [first row, how many]: neighbours in order are one span
        for r in rows:
            if runs and r == runs[-1][0] + runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([r, 1])
        key = _part_key(self.key, "leading", rows[0], rows[0] + len(rows)) if len(runs) == 1 else \
            _part_key(self.key, "planes", tuple(rows))
        shape = (len(rows),) + tuple(self.shape[1:])
        itemsize = np.dtype(self.dtype).itemsize
        if not self.tiles:
            plane = self.out_nbytes // self.shape[0]
            return ChunkSpec(tuple(r for first, n in runs for r in _span(self.ranges, first * plane, (first + n) * plane)),
                             shape, self.dtype, "C", identity=self.identity, index=self.index, _key=key)
        tiles = []
        steps: dict[tuple[int, ...], int] = {}  # bytes a plane, per tile shape: the tiles share one or two
        for t in self.tiles:
            if t.order != "C" or not t.shape:
                return None
            plane = steps.get(t.shape)
            if plane is None:
                plane = steps[t.shape] = math.prod(t.shape[1:]) * itemsize
            if t.range is not None and t.range.nbytes != t.shape[0] * plane:
                return None  # not the tile's elements as is
        at = 0
        for first, n in runs:
            for t in self.tiles:
                o, r, plane = t.origin[0], t.range, steps[t.shape]
                a, b = max(first, o), min(first + n, o + t.shape[0])
                if a >= b:
                    continue
                sub = None if r is None else ByteRange(r.path, r.offset + (a - o) * plane, (b - a) * plane)
                tiles.append(Tile(sub, (b - a,) + tuple(t.shape[1:]), (at + a - first,) + tuple(t.origin[1:]), "C"))
            at += n
        ranges = tuple(t.range for t in tiles if t.range is not None)
        return ChunkSpec(ranges, shape, self.dtype, "C", identity=self.identity, index=self.index, tiles=tuple(tiles),
                         fill_value=self.fill_value, _key=key)

    def head(self, start: int, stop: int) -> tuple[int, ChunkSpec] | None:
        """For a read of slices ``[start, stop)`` along axis 0 that ends inside a zstd chunk: ``(first,
        part)``, ``part`` being slices ``[first, stop)`` of the chunk as a chunk of their own, decoded
        from heads of the stored bytes; ``None`` where that does not apply.

        A compressed piece decodes from its first byte, so reading slices off the end of a
        stored chunk costs the whole chunk; a ``STREAMED`` one decodes front to back, so a
        head of it does: a plane near the start of a 64-plane chunk decodes from about its own
        size of stored bytes instead of all 64. ``first`` is where the stored piece holding
        ``start`` begins. Applies to a chunk of one stored piece, or of stored pieces (``tiles``)
        of which those ``[start, stop)`` meets start at one plane and end after ``stop``, in C
        order, compressed by a ``STREAMED`` codec alone (another step would need every byte: a
        filter, a checksum). Its codec is ``Codec("head", of=..., size=...)``: the compressor and
        a whole piece's decoded size (checked against the frame's header).

        >>> c = ChunkSpec((ByteRange("a", 0, 1 << 20),), (64, 256, 256), "<u2", codec=(Codec("zstd"),))
        >>> first, h = c.head(1, 2)
        >>> first, h.shape, h.ranges[0].nbytes, h.codec[0].get("size") == c.out_nbytes
        (0, (2, 256, 256), 396288, True)
        """
        if (self.order != "C" or not self.shape or not 0 <= start < stop < self.shape[0] or not self.codec
                or len(self.codec) != 1 or self.codec[0].id not in STREAMED or not self.nbytes):
            return None
        of = self.codec[0].id
        itemsize = np.dtype(self.dtype).itemsize
        rest = tuple(self.shape[1:])
        if not self.tiles:
            decoded = self.out_nbytes // self.shape[0] * stop
            codec = Codec.of("head", of=of, size=self.out_nbytes)
            return 0, ChunkSpec(_span(self.ranges, 0, min(self.nbytes, head_allowance(decoded))), (stop,) + rest,
                                self.dtype, "C", (codec,), identity=self.identity, index=self.index,
                                fill_value=self.fill_value, whole=(self, 0),
                                _key=_part_key(self.key, "head", start, stop))
        met = [t for t in self.tiles if t.origin[0] < stop and t.origin[0] + t.shape[0] > start]
        if not met:
            return None
        shapes = {t.shape for t in met}
        first = min(t.origin[0] for t in met)
        if len(shapes) != 1 or any(t.origin[0] != first or t.order != "C" for t in met):
            return None
        shape = shapes.pop()
        keep = stop - first
        if keep >= shape[0]:
            return None  # the stored pieces are whole
        decoded = math.prod(shape[1:]) * itemsize * keep
        tiles = tuple(Tile(None if t.range is None else ByteRange(t.range.path, t.range.offset,
                                                                  min(t.range.nbytes, head_allowance(decoded))),
                           (keep,) + shape[1:], (0,) + tuple(t.origin[1:]), "C") for t in met)
        codec = Codec.of("head", of=of, size=math.prod(shape) * itemsize)
        return first, ChunkSpec(tuple(t.range for t in tiles if t.range is not None), (keep,) + rest, self.dtype,
                                "C", (codec,), identity=self.identity, index=self.index, tiles=tiles,
                                fill_value=self.fill_value, whole=(self, first),
                                _key=_part_key(self.key, "head", start, stop))

    @property
    def stored_as_is(self) -> bool:
        """Whether each plane of the chunk is a span of its stored bytes (``planes`` can cut it): not
        decoded, in C order, each stored piece its tile's elements as they are."""
        return self.planes([0]) is not None

    @property
    def is_head(self) -> bool:
        """Whether this is the first planes of a chunk, decoded from heads of its stored bytes (``head``)."""
        return self.codec is not None and len(self.codec) > 0 and self.codec[0].id == "head"

    @property
    def needs_byteswap(self) -> bool:
        dt = np.dtype(self.dtype)
        return dt.itemsize > 1 and not dt.isnative

    def __dask_tokenize__(self) -> str:
        return self.key
