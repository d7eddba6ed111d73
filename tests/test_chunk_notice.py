"""``chunks=`` enlarged to whole stored chunks says so: to what, and why (CPU)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import gpulazy
from gpulazy.errors import ChunksEnlargedWarning
from gpulazy.layouts._grid import grid_chunks


@pytest.fixture
def tiffs(tmp_path):
    import tifffile

    (tmp_path / "t").mkdir()
    truth = np.arange(3 * 30 * 40, dtype="uint16").reshape(3, 30, 40)
    for i, plane in enumerate(truth):
        tifffile.imwrite(tmp_path / "t" / f"z{i}.tif", plane)
    return str(tmp_path / "t"), truth


def test_a_requested_block_cut_to_whole_pages_warns_with_the_result_and_the_reason(tiffs):
    path, truth = tiffs
    with pytest.warns(ChunksEnlargedWarning) as rec:
        vol = gpulazy.from_files(path, chunks=(1, 8, 8), device="cpu")
    assert vol.chunksize == (1, 30, 40)
    assert np.array_equal(vol.compute(), truth)
    msg = str(rec[0].message)
    assert "chunks=(1, 8, 8) became blocks of (1, 30, 40) (axes 1, 2 enlarged)" in msg
    assert "stored in chunks of (1, 30, 40)" in msg and "whole stored chunks" in msg
    assert rec[0].filename == __file__  # names the caller's line, not gpulazy's


@pytest.mark.parametrize("chunks", [None, "auto", "1MiB", (1, 30, 40), (2, -1, -1), {0: 1}, (1, "auto", -1),
                                    (np.int64(1), 30, 40)])
def test_chunks_that_fit_or_leave_the_choice_to_gpulazy_say_nothing(tiffs, chunks):
    path, truth = tiffs
    with warnings.catch_warnings():
        warnings.simplefilter("error", ChunksEnlargedWarning)
        vol = gpulazy.from_files(path, chunks=chunks, device="cpu")
    assert np.array_equal(vol.compute(), truth)


def test_zarr_and_hdf5_blocks_say_the_same(tmp_path):
    import h5py
    import zarr

    data = np.arange(4 * 64 * 64, dtype="uint16").reshape(4, 64, 64)
    z = zarr.create_array(tmp_path / "v.zarr", shape=data.shape, chunks=(2, 32, 32), dtype="uint16")
    z[:] = data
    with h5py.File(tmp_path / "r.h5", "w") as f:
        f.create_dataset("d", data=data, chunks=(1, 64, 64))
    with pytest.warns(ChunksEnlargedWarning, match=r"chunks=\{0: 1\} became blocks of \(2, 64, 64\) \(axis 0"):
        vol = gpulazy.from_files(str(tmp_path / "v.zarr"), chunks={0: 1}, device="cpu")
    assert vol.chunks[0] == (2, 2) and np.array_equal(vol.compute(), data)
    with pytest.warns(ChunksEnlargedWarning, match=r"stored in chunks of \(1, 64, 64\)"):
        vol = gpulazy.from_files(str(tmp_path / "r.h5"), chunks=(1, 16, 64), device="cpu")
    assert vol.chunksize == (1, 64, 64) and np.array_equal(vol.compute(), data)


def test_grid_chunks_counts_only_axes_given_in_elements():
    with pytest.warns(ChunksEnlargedWarning, match=r"\(axis 1 enlarged\)"):
        assert grid_chunks((8, 10), (4, 4), np.dtype("u1"), chunks=(4, 5)) == ((4, 4), (8, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ChunksEnlargedWarning)
        # a byte size is a target, not a request for exact blocks
        assert grid_chunks((8, 10), (4, 4), np.dtype("u1"), chunks="20B")[0][0] % 4 == 0
