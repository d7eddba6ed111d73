"""The index of a Zarr v3 shard: where each inner chunk's bytes are inside the shard file.

A shard file holds its inner chunks' encoded bytes and an index of
``(offset, nbytes)`` uint64 pairs, one per inner chunk in C order, at the start or the
end of the file (``index_location``), encoded by ``index_codecs`` (``bytes`` then,
usually, ``crc32c``). ``(2**64 - 1, 2**64 - 1)`` marks an inner chunk that was never
written. The index is read once per shard when the array is indexed; chunk data is
never read here.
"""

from __future__ import annotations

import numpy as np

from gpulazy.errors import LayoutError
from gpulazy.layouts._zarr_meta import ShardMeta

__all__ = ["read_shard_index", "EMPTY"]

EMPTY = np.uint64(2**64 - 1)


def read_shard_index(path: str, size: int, shard: ShardMeta) -> np.ndarray:
    """``(*per_shard, 2)`` int64 array of ``(offset, nbytes)``; ``-1`` rows for empty inner chunks.

    Raises ``LayoutError`` naming ``path`` when the file is too short for its index, the
    index checksum does not match, or an entry points outside the file.
    """
    want = shard.index_nbytes
    if size < want:
        raise LayoutError(f"shard file {path!r} has {size} bytes, fewer than its {want}-byte index "
                          f"({np.prod(shard.per_shard)} inner chunks); the file is truncated")
    try:
        with open(path, "rb") as f:
            f.seek(size - want if shard.index_at_end else 0)
            raw = f.read(want)
    except OSError as e:
        raise LayoutError(f"cannot read the index of shard file {path!r}: {e}") from e
    if len(raw) != want:
        raise LayoutError(f"shard file {path!r}: read {len(raw)} of its {want} index bytes; the file changed "
                          "while it was indexed")
    if shard.index_crc32c:
        raw = _strip_checksum(raw, path)
    entries = np.frombuffer(raw, dtype=np.dtype("u8").newbyteorder(shard.index_endian))
    entries = entries.reshape(shard.per_shard + (2,))
    empty = (entries == EMPTY).all(axis=-1)
    out = entries.astype(np.int64)  # never-written entries wrap to -1; checked below
    out[empty] = -1
    _check_entries(out[~empty], size, path)
    return out


def _strip_checksum(raw: bytes, path: str) -> bytes:
    # numcodecs' CRC32C is the checksum Zarr v3's crc32c codec writes (4 bytes, little-endian, at the end).
    from numcodecs import CRC32C

    try:
        return bytes(CRC32C().decode(raw))
    except RuntimeError as e:
        raise LayoutError(f"the index of shard file {path!r} fails its crc32c checksum ({e}); the shard is "
                          "corrupt") from e


def _check_entries(entries: np.ndarray, size: int, path: str) -> None:
    if entries.size == 0:
        return
    off, nb = entries[:, 0], entries[:, 1]
    bad = (off < 0) | (nb < 0) | (off + nb > size) | (off + nb < off)
    if bad.any():
        i = int(np.argmax(bad))
        raise LayoutError(f"shard file {path!r}: its index puts an inner chunk at offset {int(entries[i, 0])} with "
                          f"{int(entries[i, 1])} bytes, outside the file's {size} bytes; the shard is corrupt")

