"""Tile placement: the launch table ``gpulazy.codecs.place.plan`` builds, walked on the host
exactly as the kernel walks it, and (on a GPU) the kernel itself, against NumPy assignment."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulazy.codecs import place


def _walk(table: np.ndarray, word: int, total: int, memory: np.ndarray) -> None:
    """The kernel's loop over ``total`` words, on a host byte array whose offsets stand for addresses."""
    starts = table[:, 0]
    for u in range(total):
        t = table[np.searchsorted(starts, u, side="right") - 1]
        local = u - t[0]
        row, w = divmod(local, t[3])
        so = do = 0
        for d in range(t[4]):
            row, i = divmod(row, t[5 + d])
            so += i * t[5 + place.MAXD + d]
            do += i * t[5 + 2 * place.MAXD + d]
        s, dst = t[1] + so + w * word, t[2] + do + w * word
        memory[dst:dst + word] = memory[s:s + word]


def _boxes(memory: np.ndarray, chunk: np.ndarray, tiles: list[tuple[np.ndarray, tuple[int, ...]]]) -> list:
    base = memory.ctypes.data
    out = []
    for tile, origin in tiles:
        b = place.box_of(chunk.shape, chunk.strides, chunk.ctypes.data - base, tile.shape, tile.strides,
                         tile.ctypes.data - base, origin, chunk.itemsize)
        if b is not None:
            out.append((b, tile, origin))
    return out


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
    kept = _boxes(memory, chunk, tiles)
    table, word, total, rest = place.plan([b for b, _, _ in kept])
    _walk(table, word, total, memory)
    for i in rest:  # boxes the kernel leaves to assignment (no axis contiguous on both sides)
        place.assign(chunk, kept[i][1], kept[i][2])
    np.testing.assert_array_equal(chunk, want)
    assert dtype.itemsize % word == 0 or word % dtype.itemsize == 0


def test_a_c_order_tile_into_a_c_order_chunk_goes_in_the_launch_with_the_widest_word():
    memory = np.zeros(4096 + 64, np.uint8)
    chunk = memory[:2048].view("<u2").reshape(32, 32)
    tile = memory[2048:2048 + 512].view("<u2").reshape(16, 16)
    ((b, _, _),) = _boxes(memory, chunk, [(tile, (16, 0))])
    table, word, total, rest = place.plan([b])
    assert rest == [] and word == 16 and total == 16 * 32 // 16  # 16 rows of 32 bytes, two words each
    assert list(table[0, :5]) == [0, b.src, b.dst, 2, 1]


def test_a_tile_wholly_outside_the_chunk_has_no_box():
    assert place.box_of((4, 4), (16, 4), 0, (2, 2), (8, 4), 100, (4, 0), 4) is None


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


def test_groups_grow_from_the_first_size_to_the_cap_and_keep_every_item_in_order():
    from gpulazy.read.whole import groups_by_bytes

    items = list(range(100))
    groups = groups_by_bytes(items, lambda i: 10, size=20, grow_to=160)
    assert [x for g in groups for x in g] == items
    assert [sum(10 for _ in g) for g in groups[:5]] == [20, 40, 80, 160, 160]
    assert groups_by_bytes(items, lambda i: 10, size=20) == [items[i:i + 2] for i in range(0, 100, 2)]
