"""Tile placement: the launch table ``gpulazy.codecs.place.plan`` builds, walked on the host
exactly as the kernel walks it, and (on a GPU) the kernel itself, against NumPy assignment."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulazy.codecs import place
from gpulazy.codecs.pieces import Pieces


def _walk(table: np.ndarray, word: int, total: int, memory: np.ndarray) -> None:
    """The kernel's loop over ``total`` units, on a host byte array whose offsets stand for addresses."""
    starts = table[:, 0]
    for u in range(total):
        t = table[np.searchsorted(starts, u, side="right") - 1]
        local, words = u - t[0], t[3]
        runs = place.runs(words)
        row, r = divmod(local, runs)
        so = do = 0
        for d in range(t[4]):
            row, i = divmod(row, t[5 + d])
            so += i * t[5 + place.MAXD + d]
            do += i * t[5 + 2 * place.MAXD + d]
        for w in range(r, words, runs):
            s, dst = t[1] + so + w * word, t[2] + do + w * word
            memory[dst:dst + word] = memory[s:s + word]


def _batch(memory: np.ndarray, chunk: np.ndarray, tiles: list[tuple[np.ndarray, tuple[int, ...]]]) -> tuple:
    """The tiles (one shape and layout) of ``chunk`` as one batch of ``place.plan``, addresses as offsets in ``memory``."""
    base = memory.ctypes.data
    tile = tiles[0][0]
    lay = place.Layout(chunk.shape, chunk.strides, tile.shape, tile.strides, chunk.itemsize)
    return (lay, [chunk.ctypes.data - base] * len(tiles), [t.ctypes.data - base for t, _ in tiles],
            [origin for _, origin in tiles])


@st.composite
def layouts(draw):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(nd))
    tile = tuple(draw(st.integers(1, 5)) for _ in range(nd))
    dtype = draw(st.sampled_from(["u1", "<u2", "<f4", "<f8", "<c16"]))
    order = draw(st.sampled_from(["C", "F"]))
    # the chunk may start inside its first tiles (a dask chunk cutting stored chunks): origins < 0
    shift = tuple(draw(st.integers(0, t - 1)) for t in tile)
    return shape, tile, np.dtype(dtype), order, shift


def _origins(shape, tshape, shift) -> list[tuple[int, ...]]:
    counts = [-(-(s + h) // t) for s, t, h in zip(shape, tshape, shift)]
    return [tuple(i * t - h for i, t, h in zip(idx, tshape, shift)) for idx in np.ndindex(*counts)]


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_the_table_walked_as_the_kernel_walks_it_places_every_tile_like_numpy(layout):
    shape, tshape, dtype, order, shift = layout
    origins = _origins(shape, tshape, shift)
    n_chunk = int(np.prod(shape)) * dtype.itemsize
    n_tile = int(np.prod(tshape)) * dtype.itemsize
    memory = np.zeros(n_chunk + n_tile * len(origins) + 64, dtype=np.uint8)
    chunk = memory[:n_chunk].view(dtype).reshape(shape)
    rng = np.random.default_rng(0)
    tiles = []
    for k, origin in enumerate(origins):
        flat = memory[n_chunk + k * n_tile:n_chunk + (k + 1) * n_tile].view(dtype)
        flat[...] = rng.integers(0, 200, flat.size).astype(dtype)
        tile = flat.reshape(tshape[::-1]).T if order == "F" else flat.reshape(tshape)
        tiles.append((tile, origin))
    want = np.zeros(shape, dtype)
    for tile, origin in tiles:
        place.assign(want, tile, origin)
    table, word, total, rest = place.plan([_batch(memory, chunk, tiles)])
    _walk(table, word, total, memory)
    for b, i in rest:  # tiles the kernel leaves to assignment (no axis contiguous on both sides)
        assert b == 0
        place.assign(chunk, *tiles[i])
    np.testing.assert_array_equal(chunk, want)
    assert dtype.itemsize % word == 0 or word % dtype.itemsize == 0


def test_a_c_order_tile_into_a_c_order_chunk_goes_in_the_launch_with_the_widest_word():
    memory = np.zeros(4096 + 64, np.uint8)
    chunk = memory[:2048].view("<u2").reshape(32, 32)
    tile = memory[2048:2048 + 512].view("<u2").reshape(16, 16)
    table, word, total, rest = place.plan([_batch(memory, chunk, [(tile, (16, 0))])])
    assert rest == [] and word == 16 and total == 16  # 16 rows of 32 bytes: two words, one unit each
    assert list(table[0, :5]) == [0, 2048, 16 * 64, 2, 1]  # the tile's start, row 16 of the chunk


def test_tiles_of_two_layouts_share_one_table_in_order_and_a_word_that_divides_both():
    memory = np.zeros(8192, np.uint8)
    a = memory[:512].view("<u2").reshape(16, 16)
    b = memory[512:1024].view("<u4").reshape(8, 16)
    ta = memory[2048:2048 + 128].view("<u2").reshape(8, 8)
    tb = memory[4096:4096 + 12].view("<u4").reshape(1, 3)
    table, word, total, rest = place.plan([_batch(memory, a, [(ta, (0, 8)), (ta, (8, 8))]),
                                           _batch(memory, b, [(tb, (7, 13))])])
    assert rest == [] and word == 4  # the u4 row of 3 elements is 12 bytes: 4 divides everything
    assert len(table) == 3 and list(table[:, 0]) == [0, 8, 16]  # 8 rows of 16 bytes (4 words, a unit), each
    assert table[2, 1] == 4096 and table[2, 2] == 512 + 7 * 64 + 13 * 4 and table[2, 3] == 3


@pytest.mark.parametrize("row_words", [place.RUN - 1, place.RUN, place.RUN + 1, 3 * place.RUN + 5])
def test_a_row_longer_than_a_run_is_copied_in_units_each_every_runs_th_word(row_words):
    """A row of more than ``RUN`` words is several units (threads), each copying every ``runs``-th word
    from its own first: every word once, none twice, as NumPy places the tile."""
    cols = 16 * row_words // 2  # u2 elements: a C-order row of 16-byte words
    memory = np.zeros(4 * cols * 2 + 2 * cols * 2 + 64, np.uint8)
    chunk = memory[:4 * cols * 2].view("<u2").reshape(4, cols)
    tile = memory[4 * cols * 2:4 * cols * 2 + 2 * cols * 2].view("<u2").reshape(2, cols)
    tile[...] = np.arange(2 * cols, dtype="<u2").reshape(2, cols) + 1
    table, word, total, rest = place.plan([_batch(memory, chunk, [(tile, (1, 0))])])
    assert word == 16 and table[0, 3] == row_words and total == 2 * place.runs(row_words) and rest == []
    _walk(table, word, total, memory)
    want = np.zeros((4, cols), "<u2")
    want[1:3] = tile
    np.testing.assert_array_equal(chunk, want)


def test_a_tile_wholly_outside_the_chunk_is_neither_placed_nor_left_over():
    lay = place.Layout((4, 4), (16, 4), (2, 2), (8, 4), 4)
    table, word, total, rest = place.plan([(lay, [0, 0], [100, 200], [(4, 0), (2, 2)])])
    assert len(table) == 1 and table[0, 1] == 200 and rest == []  # only the tile at (2, 2)
    assert (word, total) == (8, 2)  # two rows of 8 bytes


def test_pieces_of_bytes_that_are_not_contiguous_hold_those_bytes_not_their_neighbours():
    from gpulazy.codecs.pieces import Pieces, address

    raw = np.arange(32, dtype=np.uint8)[::2]  # every other byte: its address alone misleads
    pieces = Pieces.of([raw, np.arange(6, dtype="<u2").reshape(2, 3).T])
    assert pieces[0].tolist() == list(range(0, 32, 2)) and pieces.sizes.tolist() == [16, 12]
    assert np.frombuffer(pieces[1].tobytes(), "<u2").tolist() == [0, 3, 1, 4, 2, 5]  # C order of the transpose
    assert int(pieces.ptrs[0]) == address(pieces[0])


@pytest.mark.gpu
@settings(max_examples=30, deadline=None)
@given(layouts())
def test_the_kernel_places_every_tile_like_numpy(layout):
    cp = pytest.importorskip("cupy")
    shape, tshape, dtype, order, shift = layout
    rng = np.random.default_rng(1)
    chunk = cp.zeros(shape, dtype)
    want = np.zeros(shape, dtype)
    pairs = []
    for origin in _origins(shape, tshape, shift):
        host = rng.integers(0, 200, tshape).astype(dtype)
        host = np.asfortranarray(host) if order == "F" else host
        pairs.append((chunk, cp.asarray(host, order=order), origin))
        place.assign(want, host, origin)
    place.place(pairs)
    np.testing.assert_array_equal(chunk.get(), want)
    _placed_from_bytes_too(cp, pairs, shape, tshape, dtype, order, want)


def _placed_from_bytes_too(cp, pairs, shape, tshape, dtype, order, want):
    """The same tiles as bare decoded bytes (no array made of each), placed into a fresh chunk."""
    again = cp.zeros(shape, dtype)
    raws = [cp.asarray(np.ascontiguousarray(t.get().T if order == "F" else t.get())).reshape(-1).view(np.uint8)
            for _, t, _ in pairs]
    place.place_decoded([again] * len(pairs), Pieces.of(raws), [tshape] * len(pairs), [order] * len(pairs),
                        [origin for _, _, origin in pairs])
    np.testing.assert_array_equal(again.get(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,tile,dtype", [((64, 512, 2048), (64, 256, 256), "<u2"),  # a Zarr's stored chunks
                                              ((3, 1000), (2, 333), "u1"),  # rows of odd bytes: small words
                                              ((5, 300), (4, 77), "<f8")])
def test_the_kernel_places_tiles_with_rows_of_many_words_like_numpy(shape, tile, dtype):
    """Rows of more than ``place.RUN`` words: several threads a row (the layouts above keep rows short)."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(2)
    chunk = cp.zeros(shape, dtype)
    want = np.zeros(shape, dtype)
    pairs = []
    for origin in _origins(shape, tile, (0,) * len(shape)):
        host = rng.integers(1, 200, tile).astype(dtype)
        pairs.append((chunk, cp.asarray(host), origin))
        place.assign(want, host, origin)
    place.place(pairs)
    np.testing.assert_array_equal(chunk.get(), want)
    _placed_from_bytes_too(cp, pairs, shape, tile, dtype, "C", want)


def test_groups_grow_from_the_first_size_to_the_cap_and_keep_every_item_in_order():
    from gpulazy.read.whole import groups_by_bytes

    items = list(range(100))
    groups = groups_by_bytes(items, lambda i: 10, size=20, grow_to=160)
    assert [x for g in groups for x in g] == items
    assert [sum(10 for _ in g) for g in groups[:5]] == [20, 40, 80, 160, 160]
    assert groups_by_bytes(items, lambda i: 10, size=20) == [items[i:i + 2] for i in range(0, 100, 2)]


def test_items_of_another_kind_start_a_group_of_their_own():
    from gpulazy.read.whole import groups_by_bytes

    items = [0, 2, 4, 1, 3, 6, 8, 10, 12]
    groups = groups_by_bytes(items, lambda i: 10, size=30, apart=lambda i: i % 2)
    assert groups == [[0, 2, 4], [1, 3], [6, 8, 10], [12]]
