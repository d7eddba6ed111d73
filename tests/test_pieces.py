"""``gpulazy.codecs.pieces``: a batch's pieces as one table, and chunk coverage from its tiles."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulazy.codecs import _covered
from gpulazy.codecs.pieces import Pieces, address, aligned_starts
from gpulazy.spec import ByteRange, ChunkSpec, Tile


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.data())
def test_pieces_taken_apart_and_gathered_are_the_same_bytes(sizes, data):
    rng = np.random.default_rng(len(sizes))
    arrays = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    pieces = Pieces.of(arrays)
    assert [int(p) for p in pieces.ptrs] == [address(a) for a in arrays]
    order = data.draw(st.permutations(range(len(sizes))))
    cut = data.draw(st.integers(0, len(sizes)))
    parts = [(order[:cut], pieces.take(order[:cut])), (order[cut:], pieces.take(order[cut:]))]
    back = Pieces.gather(len(sizes), parts)
    assert [p.tobytes() for p in back] == [a.tobytes() for a in arrays]
    assert back.ptrs.tolist() == pieces.ptrs.tolist()  # views of the same memory, not copies
    swap = data.draw(st.lists(st.integers(0, len(sizes) - 1), unique=True))
    new = [np.full(k + 1, k, np.uint8) for k in range(len(swap))]
    replaced = pieces.replaced(swap, new)
    want = [a.tobytes() for a in arrays]
    for i, a in zip(swap, new):
        want[i] = a.tobytes()
    assert [p.tobytes() for p in replaced] == want and len(pieces) == len(sizes)  # ``pieces`` itself unchanged


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=40),
       st.one_of(st.sampled_from([1, 4, 8, 256, 512, 4096]), st.integers(1, 1000)))
def test_aligned_starts_pack_every_slot_in_order_inside_the_buffer(sizes, align):
    starts, total = aligned_starts(sizes, align)
    sizes = np.array(sizes, np.int64)
    assert starts.dtype == np.int64 and len(starts) == len(sizes)
    assert (starts % align == 0).all() and total % align == 0
    if not len(sizes):
        assert total == 0
        return
    assert starts[0] == 0
    ends = starts + sizes
    assert (ends[:-1] <= starts[1:]).all()  # in order, no two slots overlap
    assert (starts[1:] - ends[:-1] < align).all()  # packed: no more padding than alignment needs
    assert ends[-1] <= total < ends[-1] + align  # the buffer covers the last slot, no more


def test_spans_within_pieces_filled_into_a_batch_are_those_bytes():
    arrays = [np.arange(10, dtype=np.uint8), np.arange(20, 30, dtype=np.uint8)]
    pieces = Pieces.of(arrays)
    spans = pieces.within([1, 0], [2, 5], [3, 0])
    assert [a.tolist() for a in spans] == [[22, 23, 24], []]
    assert spans.ptrs.tolist() == [address(arrays[1]) + 2, address(arrays[0]) + 5]
    batch = Pieces.of([np.full(2, 9, np.uint8), np.full(1, 8, np.uint8), np.full(3, 7, np.uint8)])
    assert [a.tolist() for a in batch.filled([([2, 0], spans)])] == [[], [8], [22, 23, 24]]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3).flatmap(
    lambda shape: st.tuples(st.just(tuple(shape)), st.lists(st.integers(1, 4), min_size=len(shape),
                                                            max_size=len(shape)),
                            st.lists(st.booleans(), min_size=1, max_size=64))))
def test_a_chunk_is_covered_exactly_when_its_present_tiles_reach_every_element(case):
    shape, tile, present = case
    grid = [range(0, s, t) for s, t in zip(shape, tile)]
    origins = [tuple(o) for o in np.stack(np.meshgrid(*grid, indexing="ij"), -1).reshape(-1, len(shape))]
    tiles, mask = [], np.zeros(shape, bool)
    for k, origin in enumerate(origins):
        here = present[k % len(present)]
        tiles.append(Tile(ByteRange("f", 0, 1) if here else None, tuple(tile), origin))
        if here:
            mask[tuple(slice(o, o + t) for o, t in zip(origin, tile))] = True
    spec = ChunkSpec(tuple(t.range for t in tiles if t.range is not None), shape, "<u1", codec=None,
                     tiles=tuple(tiles))
    assert _covered(spec) == bool(mask.all())
    one = Tile(ByteRange("f", 0, 1), tuple(tile), tuple(-o for o in origins[-1]))  # a single tile, shifted
    single = np.zeros(shape, bool)
    single[tuple(slice(0, max(0, t - o)) for o, t in zip(origins[-1], tile))] = True
    assert _covered(ChunkSpec((one.range,), shape, "<u1", tiles=(one,))) == bool(single.all())
