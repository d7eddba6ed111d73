"""``ChunkSpec`` keys: a part of a chunk (``leading``, ``head``) is keyed by the chunk's key and the cut,
a chunk at another block index (``at``) keeps its key.

A key names the bytes a spec reads: the cache, the in-flight dedupe and the region readers'
bookkeeping look chunks up by it, so two specs of different bytes must never share one, and
the same part of unchanged files must get the same key in any process.
"""

from __future__ import annotations

import dataclasses
import pickle

from dask.base import tokenize
from hypothesis import given, strategies as st

from gpulazy.spec import ByteRange, ChunkSpec, Codec, FileIdentity, Tile


def _gathered(planes: int = 8, across: int = 3, mtime: int = 1, codec: tuple | None = None) -> ChunkSpec:
    """A chunk of ``across`` stored pieces side by side along axis 1 (a Zarr row gathered into one
    dask chunk), each ``planes`` planes of 4 x 4 ``<u2``."""
    piece = planes * 4 * 4 * 2
    tiles, ids = [], []
    for j in range(across):
        path = f"/store/c/0/{j}"
        tiles.append(Tile(ByteRange(path, 0, piece if codec is None else piece // 2), (planes, 4, 4), (0, 4 * j, 0)))
        ids.append(FileIdentity(path, piece, mtime, 10 + j, mtime))
    return ChunkSpec(tuple(t.range for t in tiles), (planes, 4 * across, 4), "<u2", codec=codec,
                     identity=tuple(ids), index=(0, 0, 0), tiles=tuple(tiles))


cuts = st.integers(0, 7).flatmap(lambda a: st.tuples(st.just(a), st.integers(a + 1, 8)))


@given(cut=cuts)
def test_a_part_is_keyed_alike_each_time_and_after_pickling(cut):
    a, b = _gathered().leading(*cut), _gathered().leading(*cut)
    assert a.key == b.key and tokenize(a) == tokenize(b)
    again = pickle.loads(pickle.dumps(a))
    assert again.key == a.key and again == a


@given(one=cuts, other=cuts)
def test_parts_of_other_planes_have_other_keys(one, other):
    spec = _gathered()
    a, b = spec.leading(*one), spec.leading(*other)
    assert (a.key == b.key) == (one == other)
    assert spec.key not in (a.key, b.key)


@given(cut=cuts)
def test_a_part_of_a_changed_file_is_never_keyed_like_the_part_before(cut):
    before, after = _gathered(mtime=1).leading(*cut), _gathered(mtime=2).leading(*cut)
    assert before.ranges == after.ranges and before.key != after.key


def test_a_head_and_a_slab_of_the_same_planes_have_other_keys():
    zstd = _gathered(codec=(Codec("zstd"),))
    first, head = zstd.head(0, 2)
    assert first == 0 and head.is_head
    slab = _gathered().leading(0, 2)
    assert len({zstd.key, head.key, slab.key, zstd.head(0, 3)[1].key}) == 4
    assert head.key == _gathered(codec=(Codec("zstd"),)).head(0, 2)[1].key


def test_a_part_changed_by_replace_is_keyed_by_its_content():
    """``dataclasses.replace`` builds a new spec: its key hashes what it reads, as any spec's does."""
    part = _gathered().leading(2, 5)
    moved = dataclasses.replace(part, ranges=part.ranges[:1], tiles=part.tiles[:1])
    assert moved.key != part.key
    assert moved.key == ChunkSpec(part.ranges[:1], part.shape, part.dtype, identity=part.identity,
                                  index=part.index, tiles=part.tiles[:1]).key


def test_a_part_reads_its_planes_bytes_of_each_piece():
    spec = _gathered(planes=8, across=2)
    part = spec.leading(3, 6)
    plane = 4 * 4 * 2
    assert part.shape == (3, 8, 4) and part.nbytes == 2 * 3 * plane
    assert [(r.path, r.offset, r.nbytes) for r in part.ranges] == [
        ("/store/c/0/0", 3 * plane, 3 * plane), ("/store/c/0/1", 3 * plane, 3 * plane)]
    assert [(t.shape, t.origin) for t in part.tiles] == [((3, 4, 4), (0, 0, 0)), ((3, 4, 4), (0, 4, 0))]


def test_a_chunk_at_another_block_index_is_the_same_bytes_and_key():
    """A slice of whole blocks renumbers its chunks (``ChunkSpec.at``): the cache entries are shared."""
    spec = _gathered()
    moved = spec.at((5, 1, 0))
    assert moved.index == (5, 1, 0) and moved.key == spec.key
    assert (moved.ranges, moved.tiles, moved.identity, moved.nbytes) == (spec.ranges, spec.tiles, spec.identity,
                                                                         spec.nbytes)
    assert pickle.loads(pickle.dumps(moved)).key == spec.key
    assert dataclasses.replace(spec, index=(5, 1, 0)).key == moved.key  # as a hash of its content gives
