"""Every chunk spelling dask.array accepts works in from_files(chunks=...); errors speak gpulazy's words."""

from __future__ import annotations

import numpy as np
import pytest
from dask.array.core import normalize_chunks as dask_normalize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpulazy
from gpulazy.errors import LayoutError
from gpulazy.layouts._common import default_chunks

SHAPE = (6, 10, 12)
DT = np.dtype("<u2")
DASK_WORDS = ("Only one consistent", "limit or chunk", "chunks= keyword", "docs.dask.org", "Chunks do not add up")


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    d = tmp_path_factory.mktemp("vol")
    data = np.arange(np.prod(SHAPE), dtype=DT).reshape(SHAPE)
    for i, plane in enumerate(data):
        plane.tofile(d / f"z{i}.raw")
    return str(d / "z*.raw"), data


def _open(volume, chunks):
    glob, data = volume
    return gpulazy.from_files(glob, shape=SHAPE[1:], dtype=DT, chunks=chunks, device="cpu", cache=False), data


@pytest.mark.parametrize("chunks", ["16MiB", "200B", "1kB", 1000])
def test_byte_sizes_give_contiguous_slabs_under_the_limit(volume, chunks):
    vol, data = _open(volume, chunks)
    limit = 1000 if chunks == 1000 else gpulazy.config.parse_bytes(chunks)
    if chunks == 1000:  # an int is a block length, not bytes
        assert vol.chunks == ((6,), (10,), (12,))
    else:
        assert vol.chunks == default_chunks(SHAPE, 2, stacked=True, target=limit)
        assert max(np.prod(b) for b in np.ndindex(*vol.numblocks) for b in [vol.blocks[b].shape]) * 2 <= limit
    np.testing.assert_array_equal(vol.compute(), data)


@pytest.mark.parametrize("chunks", [
    -1, 4, (2, -1, "auto"), (None, 5, -1), {0: 1}, {-1: 5, 0: None}, {1: "auto"},
    ((1, 5), (3, 7), (12,)), ((6,), 10, [4, 4, 4]), ("auto", "auto", "auto"),
    (2, "400B", -1), {1: "400B"}, (np.int64(3), 5, 6),
])
def test_dask_spellings_match_dask(volume, chunks):
    vol, data = _open(volume, chunks)
    spelled = ({a % 3: c for a, c in chunks.items()} if isinstance(chunks, dict) else chunks)
    entries = spelled.values() if isinstance(spelled, dict) else spelled if isinstance(spelled, tuple) else ()
    limit = next((gpulazy.config.parse_bytes(c) for c in entries if isinstance(c, str) and c != "auto"), 128 << 20)
    if isinstance(spelled, dict):  # axes a dict leaves out: gpulazy's slabs under the same limit
        defaults = default_chunks(SHAPE, 2, stacked=True, target=limit)
        spelled = tuple(spelled.get(a, defaults[a]) for a in range(3))
    if isinstance(spelled, tuple):
        spelled = tuple("auto" if isinstance(c, str) else c for c in spelled)
    assert vol.chunks == dask_normalize(spelled, SHAPE, limit=limit, dtype=DT)
    np.testing.assert_array_equal(vol.compute(), data)


@pytest.mark.parametrize("chunks", ["auto", None])
def test_auto_is_the_default(volume, chunks):
    vol, _ = _open(volume, chunks)
    assert vol.chunks == default_chunks(SHAPE, 2, stacked=True)


_axis = st.one_of(st.integers(1, 7), st.just(-1), st.none(), st.just("auto"),
                  st.sampled_from(["64B", "256B", "1KiB"]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spelling=st.tuples(_axis, _axis, _axis))
def test_per_axis_mixes(volume, spelling):
    sizes = {c for c in spelling if isinstance(c, str) and c != "auto"}
    if len(sizes) > 1:
        with pytest.raises(LayoutError, match="different byte sizes"):
            _open(volume, spelling)
        return
    vol, data = _open(volume, spelling)
    assert tuple(map(sum, vol.chunks)) == SHAPE
    for c, axis, n in zip(spelling, vol.chunks, SHAPE):
        if c in (-1, None):
            assert axis == (n,)
        elif isinstance(c, int):
            assert axis[0] == min(c, n)
    if sizes:  # the byte size bounds the block unless the fixed axes alone exceed it
        limit = gpulazy.config.parse_bytes(sizes.pop())
        fixed = np.prod([ax[0] for ax, c in zip(vol.chunks, spelling) if not isinstance(c, str)]) * 2
        assert np.prod([ax[0] for ax in vol.chunks]) * 2 <= max(limit, fixed)
    np.testing.assert_array_equal(vol[:, ::3].compute(), data[:, ::3])


@pytest.mark.parametrize("chunks, words", [
    ("lots", "cannot read 'lots' as a byte size"),
    ((2, 2), "has 2 entries but the array has 3 axes"),
    ((2, 0, 2), "axis 1 (length 10): block length 0 must be positive"),
    (((1, 2), -1, -1), "axis 0 (length 6): block lengths (1, 2) add up to 3, not 6"),
    ({7: 2}, "names axes [7] outside the array's 3 axes"),
    (("1KiB", "2KiB", -1), "different byte sizes"),
    (2.5, "is not a chunk spelling"),
    ((2, [1.5], -1), "must be non-negative integers"),
    ((2, {}, -1), "is not a chunk size"),
])
def test_errors_speak_gpulazy(volume, chunks, words):
    with pytest.raises(LayoutError) as info:
        _open(volume, chunks)
    message = str(info.value)
    assert words in message
    assert not any(w in message for w in DASK_WORDS)
