"""``gpulazy.read.pairs``: a block of several arrays' chunks is handed on once its last chunk has landed,
its chunks told apart by identity (two of one block may share a key; one object in two places is one
chunk, read once), in the block's order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulazy.read.pairs import Pairs, members
from gpulazy.spec import ByteRange, ChunkSpec


def _spec(path: str, index: tuple[int, ...]) -> ChunkSpec:
    return ChunkSpec((ByteRange(path, 0, 8),), (8,), "u1", index=index)


def test_a_block_whose_chunks_share_a_key_waits_for_each_of_them():
    """``(a - b) * (c - a)``: ``a``'s chunk twice in one block, as two objects of one key."""
    a = _spec("a", (0,))
    twice = a.at((0,))
    assert twice.key == a.key and twice is not a
    unit = (a, _spec("b", (0,)), _spec("c", (0,)), twice)
    pairs = Pairs([unit])
    assert members(unit) == unit and members(a) == (a,)
    assert pairs.add(a, "a") is None and pairs.add(unit[2], "c") is None and pairs.add(twice, "a again") is None
    with pytest.raises(RuntimeError, match="1 blocks"):
        pairs.check_done()
    assert pairs.add(unit[1], "b") == (a, ("a", "b", "c", "a again"))
    pairs.check_done()


def test_one_chunk_in_two_places_of_a_block_is_read_once_and_fills_both():
    """``(a - b) / (a + b)``: the block is ``(a, b, a, b)``, two chunks to read."""
    a, b = _spec("a", (0,)), _spec("b", (0,))
    unit = (a, b, a, b)
    assert members(unit) == (a, b)
    pairs = Pairs([unit])
    assert pairs.add(b, "b") is None
    assert pairs.add(a, "a") == (a, ("a", "b", "a", "b"))
    pairs.check_done()


def test_a_chunk_of_no_block_of_several_is_handed_on_as_it_is():
    pairs = Pairs([_spec("a", (0,))])
    alone = _spec("a", (1,))
    assert pairs.add(alone, "x") == (alone, "x")


@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6), data=st.data())
def test_blocks_come_whole_in_their_order_whatever_order_their_chunks_land_in(sizes, data):
    units = [tuple(_spec(f"f{k}", (i,)) for k in range(n)) if n > 1 else _spec("f0", (i,)) for i, n in enumerate(sizes)]
    flat = [(spec, (i, k)) for i, unit in enumerate(units) for k, spec in enumerate(members(unit))]
    order = data.draw(st.permutations(flat))
    pairs = Pairs(units)
    whole = {}
    for spec, value in order:
        out = pairs.add(spec, value)
        if out is not None:
            first, block = out
            i = value[0]
            assert first is members(units[i])[0] and i not in whole
            whole[i] = block
    pairs.check_done()
    for i, n in enumerate(sizes):
        assert whole[i] == (tuple((i, k) for k in range(n)) if n > 1 else (i, 0))
