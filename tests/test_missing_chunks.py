"""Stored chunks never written: read as the fill value (the Zarr spec, HDF5, sparse TIFF), counted
in ``gpulazy.stats()["chunks_filled"]``; a Zarr chunk or shard file that does not exist is an error
with ``missing="error"``, and with ``verify=True`` when a checksum manifest lists it."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import zarr

import gpulazy
from gpulazy.checksums import write_manifest
from gpulazy.errors import ChunkReadError, LayoutError

SHAPE = (4, 6)
CHUNKS = (2, 3)


def _store(path, *, fmt=3, shards=None, fill=5, hole=True):
    """A store whose chunk (1, 0) (rows 2-3, columns 0-2) holds only the fill value, so it is not
    written (``hole``; else every chunk is)."""
    data = np.arange(np.prod(SHAPE), dtype="<i4").reshape(SHAPE) + 100
    if hole:
        data[2:4, 0:3] = fill
    z = zarr.create_array(str(path), shape=SHAPE, chunks=CHUNKS, dtype="<i4", fill_value=fill, zarr_format=fmt,
                          shards=shards)
    z[...] = data
    return str(path), data


def _chunk_file(store, coords, fmt=3):
    return os.path.join(store, "c", *map(str, coords)) if fmt == 3 else os.path.join(store, ".".join(map(str, coords)))


def _filled():
    return gpulazy.stats().snapshot()["chunks_filled"]


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_missing_chunk_reads_as_the_fill_value_and_is_counted(tmp_path, fmt):
    store, data = _store(tmp_path / "a.zarr", fmt=fmt)
    assert not os.path.exists(_chunk_file(store, (1, 0), fmt))
    vol = gpulazy.from_files(store, device="cpu", cache=False, chunks=CHUNKS)
    before = _filled()
    np.testing.assert_array_equal(vol.compute(), data)
    assert _filled() - before == 1
    np.testing.assert_array_equal((vol + 0).compute(scheduler="sync"), zarr.open_array(store, mode="r")[...])
    assert _filled() - before == 2  # once per read: the dask path read it again


@pytest.mark.parametrize("fmt", [2, 3])
def test_missing_error_names_the_chunk_file(tmp_path, fmt):
    store, _ = _store(tmp_path / "a.zarr", fmt=fmt)
    path = _chunk_file(store, (1, 0), fmt)
    with pytest.raises(LayoutError, match="missing='error'") as info:
        gpulazy.from_files(store, device="cpu", cache=False, missing="error")
    assert repr(path) in str(info.value)
    # every chunk present: missing="error" reads as usual
    complete, data = _store(tmp_path / "b.zarr", fmt=fmt, hole=False)
    np.testing.assert_array_equal(gpulazy.from_files(complete, device="cpu", cache=False, missing="error").compute(),
                                  data)


def test_missing_error_names_a_missing_shard_file(tmp_path):
    store, data = _store(tmp_path / "s.zarr", shards=(2, 6))
    shard = _chunk_file(store, (1, 0))
    os.remove(shard)  # the whole lower shard: two inner chunks
    data[2:4] = 5
    before = _filled()
    np.testing.assert_array_equal(gpulazy.from_files(store, device="cpu", cache=False).compute(), data)
    assert _filled() - before == 2
    with pytest.raises(LayoutError, match="shard file") as info:
        gpulazy.from_files(store, device="cpu", cache=False, missing="error")
    assert repr(shard) in str(info.value)


def test_missing_takes_fill_or_error(tmp_path):
    store, _ = _store(tmp_path / "a.zarr")
    with pytest.raises(LayoutError, match="missing='skip' is not one of"):
        gpulazy.from_files(store, device="cpu", missing="skip")


def test_unallocated_hdf5_chunks_are_counted(tmp_path):
    p = str(tmp_path / "h.h5")
    with h5py.File(p, "w") as f:
        d = f.create_dataset("data", shape=SHAPE, dtype="<i4", chunks=CHUNKS, fillvalue=9)
        d[0:2] = 1  # chunks (0, 0) and (0, 1) allocated, (1, 0) and (1, 1) not
    before = _filled()
    got = gpulazy.from_files(p, device="cpu", cache=False, chunks=CHUNKS).compute()
    want = np.full(SHAPE, 9, "<i4")
    want[0:2] = 1
    np.testing.assert_array_equal(got, want)
    assert _filled() - before == 2


@pytest.mark.parametrize("fmt", [2, 3])
def test_verify_refuses_a_chunk_file_the_manifest_lists_but_that_is_gone(tmp_path, fmt):
    store, data = _store(tmp_path / "v.zarr", fmt=fmt)
    write_manifest(store)
    np.testing.assert_array_equal(gpulazy.from_files(store, device="cpu", verify=True).compute(), data)
    lost = _chunk_file(store, (0, 1), fmt)
    os.remove(lost)
    # Without verify the Zarr spec's reading stands: the fill value, as zarr-python reads it.
    want = data.copy()
    want[0:2, 3:6] = 5
    np.testing.assert_array_equal(gpulazy.from_files(store, device="cpu", cache=False).compute(), want)
    with pytest.raises(ChunkReadError, match="checksum manifest") as info:
        gpulazy.from_files(store, device="cpu", verify=True)
    assert info.value.path == lost
    assert repr(lost) in str(info.value)


def test_a_block_of_missing_chunks_of_a_rewritten_file_raises_not_the_old_fill(tmp_path):
    """A block made only of chunks never written read no byte of its file and carried no identity of
    it, so after the file was rewritten it still handed out the fill value (found by fuzzing): it
    now depends on the HDF5 file, or on the shard whose index says its chunks are missing."""
    path = str(tmp_path / "a.h5")
    with h5py.File(path, "w") as h:
        h.create_dataset("data", shape=(2, 8, 8), dtype="u2", chunks=(2, 4, 4))[:, 4:, 4:] = 5
    vol = gpulazy.from_files(path, dataset="/data", device="cpu", cache=False, chunks=(2, 4, 4))
    np.testing.assert_array_equal(vol[0:2, 0:4, 0:4].compute(), 0)
    with h5py.File(path, "w") as h:
        h.create_dataset("data", shape=(2, 8, 8), dtype="u2", chunks=(2, 4, 4))[...] = 9
    with pytest.raises(ChunkReadError) as info:
        vol[0:2, 0:4, 0:4].compute()
    assert path in str(info.value)
    store = str(tmp_path / "a.zarr")
    z = zarr.create_array(store, shape=(8, 8), chunks=(2, 4), shards=(8, 8), dtype="u2", fill_value=0,
                          config={"write_empty_chunks": False})
    z[6:, 4:] = 5  # one inner chunk of the one shard written
    sharded = gpulazy.from_files(store, device="cpu", cache=False, chunks=(2, 4))
    np.testing.assert_array_equal(sharded[0:2, 0:4].compute(), 0)
    zarr.open_array(store, mode="r+")[...] = 9  # every inner chunk written now
    with pytest.raises(ChunkReadError) as info:
        sharded[0:2, 0:4].compute()
    assert os.path.join(store, "c") in str(info.value)


def test_a_block_of_sparse_tiff_tiles_of_a_rewritten_file_raises_not_the_old_fill(tmp_path):
    """The same for a TIFF's sparse tiles (byte count 0: never written, read as the fill value, as
    tifffile reads them): the block depends on the file whose byte counts say so."""
    import struct

    import tifffile

    path = str(tmp_path / "sparse.tif")
    data = np.zeros((64, 64), "u2")
    data[32:, 32:] = 5
    tifffile.imwrite(path, data, tile=(32, 32), photometric="minisblack")
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        offsets, counts = page.tags["TileOffsets"], page.tags["TileByteCounts"]
        n, order = len(page.dataoffsets), tif.byteorder
        kinds = {3: "H", 4: "I", 16: "Q"}
        new_offsets, new_counts = [0] + list(page.dataoffsets[1:]), [0] + list(page.databytecounts[1:])
    blob = bytearray(open(path, "rb").read())
    struct.pack_into(order + kinds[offsets.dtype] * n, blob, offsets.valueoffset, *new_offsets)  # tile 0 sparse
    struct.pack_into(order + kinds[counts.dtype] * n, blob, counts.valueoffset, *new_counts)
    open(path, "wb").write(bytes(blob))
    vol = gpulazy.from_files(path, device="cpu", cache=False, chunks=(32, 32))
    np.testing.assert_array_equal(vol[:32, :32].compute(), tifffile.imread(path)[:32, :32])
    tifffile.imwrite(path, np.full((64, 64), 9, "u2"), tile=(32, 32), photometric="minisblack")
    with pytest.raises(ChunkReadError) as info:
        vol[:32, :32].compute()
    assert path in str(info.value)
