"""Arrays of more pieces than config ``max_chunks`` are refused early, naming the path and a chunking that fits.

Each refusal is checked to come before any per-piece object: the peak memory traced
while indexing stays far below what one object per piece would take.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import tracemalloc

import dask.array  # noqa: F401 - imported before memory is traced: its import is not indexing
import numpy as np
import pytest

import gpulazy
from gpulazy.errors import LayoutError
from gpulazy.layouts._common import c_ranges, normalize_chunks
from gpulazy.layouts._limits import runs_per_block, spelled_block_count, suggest_chunks


def _refused(match: str, *args, **kwargs) -> LayoutError:
    """The LayoutError ``from_files`` raises, and the peak traced memory of raising it (< 32 MiB)."""
    tracemalloc.start()
    try:
        with pytest.raises(LayoutError, match=match) as info:
            gpulazy.from_files(*args, device="cpu", cache=False, **kwargs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MiB traced before refusing: objects were made per piece"
    return info.value


def test_raw_bytes_in_chunks_of_one_are_refused_not_a_memory_error(tmp_path):
    path = str(tmp_path / "big.raw")
    with open(path, "wb") as f:
        f.truncate(10**9)  # sparse: 1e9 bytes on no disk
    err = _refused("1,000,000,000 dask chunks", path, dtype="u1", chunks=1)
    assert repr(path) in str(err) and "config max_chunks" in str(err) and "chunks=(125000000,)" in str(err)
    vol = gpulazy.from_files(path, dtype="u1", chunks=(125_000_000,), device="cpu", cache=False)
    assert vol.numblocks == (8,)  # the suggested chunking opens


def test_many_byte_runs_per_chunk_are_counted(tmp_path):
    path = str(tmp_path / "wide.raw")
    with open(path, "wb") as f:
        f.truncate(1000 * 10**6)
    # 10**6 blocks of one column each, 1000 runs per block: 1e9 byte ranges.
    err = _refused("1,000,000,000 byte runs", path, dtype="u1", shape=(1000, 10**6), chunks=(1000, 1))
    assert repr(path) in str(err) and "pass chunks=(125, 1000000)" in str(err)


def test_npy_in_tiny_chunks_is_refused_naming_the_file(tmp_path):
    path = str(tmp_path / "a.npy")
    np.save(path, np.arange(4096, dtype="u2"))
    with gpulazy.config.set(max_chunks=100):
        err = _refused("4,096 dask chunks", path, chunks=1)
        assert repr(path) in str(err)
        vol = gpulazy.from_files(path, chunks=64, device="cpu", cache=False)  # 64 chunks: within the limit
        assert np.array_equal(vol.compute(), np.arange(4096, dtype="u2"))


def _zarr_v2(path: str, n: int) -> np.ndarray:
    """A Zarr v2 store of ``n`` uint16 in stored chunks of one element (written directly: fast)."""
    os.makedirs(path)
    with open(os.path.join(path, ".zarray"), "w") as f:
        json.dump({"zarr_format": 2, "shape": [n], "chunks": [1], "dtype": "<u2", "compressor": None,
                   "fill_value": 0, "filters": None, "order": "C"}, f)
    data = (np.arange(n) * 7 % 1000).astype("<u2")
    for i in range(n):
        data[i:i + 1].tofile(os.path.join(path, str(i)))
    return data


def test_a_zarr_store_of_more_stored_chunks_is_refused_naming_it(tmp_path):
    pytest.importorskip("zarr")
    store = str(tmp_path / "x.zarr")
    data = _zarr_v2(store, 300)
    with gpulazy.config.set(max_chunks=200):
        err = _refused("300 stored chunks", store)
        assert repr(store) in str(err) and "no chunks= changes" in str(err)
        levels_err = pytest.raises(LayoutError, gpulazy.multiscale, store, device="cpu", cache=False)
        assert repr(store) in str(levels_err.value)
    with gpulazy.config.set(max_chunks=300):
        vol = gpulazy.from_files(store, device="cpu", cache=False)
        assert np.array_equal(vol.compute(), data)


def test_a_shard_of_2_24_inner_chunks_is_refused_at_once(tmp_path):
    zarr = pytest.importorskip("zarr")
    store = str(tmp_path / "s.zarr")
    zarr.create_array(store, shape=(1 << 24,), chunks=(1,), shards=(1 << 24,), dtype="u1", compressors=None)
    err = _refused("16,777,216 stored chunks", store)  # took 164 s and 5 GiB (a MemoryError on smaller hosts)
    assert repr(store) in str(err)
    again = pickle.loads(pickle.dumps(err))  # crosses to a dask.distributed client whole
    assert type(again) is type(err) and str(again) == str(err) and isinstance(again, LayoutError)


def test_a_user_chunking_finer_than_the_limit_over_zarr_is_refused(tmp_path):
    zarr = pytest.importorskip("zarr")
    store = str(tmp_path / "c.zarr")
    zarr.create_array(store, shape=(4096,), chunks=(4096,), dtype="u1", compressors=None)
    with gpulazy.config.set(max_chunks=100):
        err = _refused("4,096 dask chunks", store, chunks=1)
        assert repr(store) in str(err)


@pytest.mark.parametrize("shape, block", [((7,), (3,)), ((4, 6), (4, 6)), ((4, 6), (2, 6)), ((4, 6), (4, 2)),
                                          ((3, 4, 5), (2, 4, 5)), ((3, 4, 5), (3, 1, 5)), ((3, 4, 5), (2, 3, 1)),
                                          ((3, 4, 5), (3, 4, 2))])
def test_runs_per_block_counts_what_c_ranges_lists(shape, block):
    assert runs_per_block(shape, block) == len(c_ranges(shape, (0,) * len(shape), block, 2))


@pytest.mark.parametrize("chunks", [1, 3, (2, 5), (2, -1), {0: 3}, ((1, 2, 2), 5), (None, 4), "auto", "1KiB"])
def test_spelled_block_count_is_at_most_what_dask_makes(chunks):
    shape = (5, 12)
    made = math.prod(len(c) for c in normalize_chunks(chunks, shape, np.dtype("u2")))
    assert spelled_block_count(chunks, shape) <= made
    if not isinstance(chunks, str) and chunks != (None, 4) and chunks != (2, -1) and chunks != {0: 3}:
        assert spelled_block_count(chunks, shape) == made


@pytest.mark.parametrize("limit", [1, 3, 1000])
def test_suggested_chunks_fit_the_limit(limit):
    with gpulazy.config.set(max_chunks=limit, chunk_size=64):
        for shape in [(1000,), (40, 50), (7, 11, 13)]:
            sug = suggest_chunks(shape, np.dtype("u2"))
            blocks = math.prod(-(-n // c) for n, c in zip(shape, sug))
            assert blocks <= limit, (shape, sug)


def test_an_hdf5_dataset_of_more_stored_chunks_is_refused_before_its_chunk_index(tmp_path):
    h5py = pytest.importorskip("h5py")
    path = str(tmp_path / "a.h5")
    data = (np.arange(4096) * 3 % 251).astype("u1")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(8,))
    with gpulazy.config.set(max_chunks=500):
        err = _refused("512 stored chunks", path)
        assert repr(path) in str(err) and "larger stored chunks" in str(err)
    with gpulazy.config.set(max_chunks=512):
        assert np.array_equal(gpulazy.from_files(path, device="cpu", cache=False).compute(), data)
