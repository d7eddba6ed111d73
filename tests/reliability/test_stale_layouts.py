"""Stale data through the TIFF and Zarr layouts: every chunk, shard and TIFF file they read
carries a ``FileIdentity`` (path, size, mtime, inode, ctime).

A file rewritten in place with its size and mtime set back (``cp -p``, ``rsync -t``), or
replaced by ``os.replace`` with its mtime set back (``tar -x``), must never be served from
the default cache: an array indexed before the change raises ``ChunkReadError`` naming the
file, and a new ``from_files`` reads the new bytes (the reference reader's).
"""

from __future__ import annotations

import filecmp
import os

import numpy as np
import pytest
import tifffile
import zarr
from zarr.codecs import Crc32cCodec

import gpulazy
from gpulazy.cache import default_cache
from gpulazy.errors import ChunkReadError

SHAPE = (3, 4, 6)


def _data(version):
    return (np.arange(np.prod(SHAPE), dtype="<u2").reshape(SHAPE) + 1000 * version).astype("<u2")


def _zarr(**kw):
    def make(where, data):
        z = zarr.create_array(where, shape=data.shape, chunks=(1, 2, 3), dtype=data.dtype, **kw)
        z[...] = data
        return where

    return make, lambda store: zarr.open_array(store, mode="r")[...]


def _tiff_stack(where, data):
    os.makedirs(where)
    for i, plane in enumerate(data):
        tifffile.imwrite(os.path.join(where, f"z{i}.tif"), plane)
    return where


def _tiff_file(where, data):
    tifffile.imwrite(where + ".tif", data, photometric="minisblack")
    return where + ".tif"


def _read_tiff_stack(where):
    return np.stack([tifffile.imread(os.path.join(where, n)) for n in sorted(os.listdir(where))])


# (build(where, data) -> path to open, reference reader); sizes are fixed so a rewrite keeps them
LAYOUTS = {
    "zarr-v2": _zarr(zarr_format=2, compressors=None),
    "zarr-v3": _zarr(zarr_format=3, compressors=None),
    "zarr-v3-crc32c": _zarr(zarr_format=3, compressors=[Crc32cCodec()]),  # a codec: assembled from tiles
    "zarr-v3-sharded": _zarr(zarr_format=3, compressors=None, shards=(1, 4, 6)),
    "tiff-stack": (_tiff_stack, _read_tiff_stack),
    "tiff-multipage": (_tiff_file, tifffile.imread),
}


@pytest.fixture(scope="module", autouse=True)
def _zarr_io_thread(tmp_path_factory):
    """zarr-python's event-loop thread lives as long as the process: start it before the leak
    check's first snapshot (module fixtures are set up before the function ones)."""
    zarr.create_array(str(tmp_path_factory.mktemp("warm") / "w.zarr"), shape=(1,), dtype="u1")


def _changed_file(old_root, new_root):
    """A file (relative path) whose bytes differ between the two versions of the dataset."""
    if os.path.isfile(old_root):
        return ""
    for folder, _, names in os.walk(new_root):
        for n in sorted(names):
            rel = os.path.relpath(os.path.join(folder, n), new_root)
            if not n.startswith(".") and "zarr.json" not in n and not filecmp.cmp(
                    os.path.join(old_root, rel), os.path.join(new_root, rel), shallow=False):
                return rel
    raise AssertionError("no file differs")


def _bump_until_ctime_moves(path, before, write):
    """Write, then set the times back, until the ctime ticks past ``before``'s (the kernel's
    timestamp tick can be a few milliseconds: two writes within one look alike)."""
    for _ in range(100_000):
        write()
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        if os.stat(path).st_ctime_ns != before.st_ctime_ns:
            return
    raise AssertionError(f"the ctime of {path!r} never moved")


def _rewrite_in_place(path, new_bytes):
    st = os.stat(path)

    def write():
        with open(path, "r+b") as f:
            f.write(new_bytes)

    _bump_until_ctime_moves(path, st, write)
    now = os.stat(path)
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def _replace(path, new_bytes):
    st = os.stat(path)
    tmp = path + ".new"
    with open(tmp, "wb") as f:
        f.write(new_bytes)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, path)
    now = os.stat(path)
    assert (now.st_size, now.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


CHANGES = {"rewritten-in-place": _rewrite_in_place, "replaced": _replace}
COMPUTES = {"whole-array": lambda v: v.compute(), "dask-sync": lambda v: (v + 0).compute(scheduler="sync")}


@pytest.fixture
def dataset(tmp_path, request):
    layout = request.param
    build, reference = LAYOUTS[layout]
    path = build(str(tmp_path / "data"), _data(1))
    spare = build(str(tmp_path / "spare"), _data(2))  # the same dataset with other values
    rel = _changed_file(path, spare)
    changed = os.path.join(path, rel) if rel else path
    with open(os.path.join(spare, rel) if rel else spare, "rb") as f:
        new_bytes = f.read()
    assert len(new_bytes) == os.path.getsize(changed)
    yield path, changed, new_bytes, reference
    cache = default_cache("cpu")
    if cache is not None:
        cache.clear()


def _vol(path):
    return gpulazy.from_files(path, device="cpu")  # the default cache, where a stale hit would come from


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", list(COMPUTES))
@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("dataset", list(LAYOUTS), indirect=True)
def test_old_array_raises_and_new_from_files_reads_the_new_bytes(dataset, change, how):
    path, changed, new_bytes, reference = dataset
    before = reference(path)
    old = _vol(path)
    np.testing.assert_array_equal(COMPUTES[how](old), before)
    np.testing.assert_array_equal(COMPUTES[how](old), before)  # the dask path: now from the cache
    CHANGES[change](changed, new_bytes)
    after = reference(path)
    assert not np.array_equal(after, before)

    with pytest.raises(ChunkReadError, match="changed since it was indexed") as info:
        COMPUTES[how](old)
    assert info.value.path == changed and repr(changed) in str(info.value)

    new = _vol(path)
    assert new.name != old.name  # other chunk keys: nothing of the old array's is served
    np.testing.assert_array_equal(COMPUTES[how](new), after)


@pytest.fixture
def sparse_store(tmp_path):
    """A Zarr v3 store whose chunk (0, 1, 1) was never written (all fill value)."""
    store = str(tmp_path / "sparse.zarr")
    z = zarr.create_array(store, shape=SHAPE, chunks=(1, 2, 3), dtype="<u2", fill_value=7, compressors=None)
    data = _data(1)
    data[0, 2:4, 3:6] = 7
    z[...] = data  # write_empty_chunks is off: the all-fill chunk is not stored
    missing = os.path.join(store, "c", "0", "1", "1")
    assert not os.path.exists(missing)
    yield store, missing, data
    cache = default_cache("cpu")
    if cache is not None:
        cache.clear()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", list(COMPUTES))
def test_a_chunk_written_after_indexing_is_not_served_as_the_fill_value(sparse_store, how):
    store, missing, data = sparse_store
    old = _vol(store)
    np.testing.assert_array_equal(COMPUTES[how](old), data)
    COMPUTES[how](old)  # cached
    z = zarr.open_array(store, mode="r+")
    z[0, 2:4, 3:6] = 99
    assert os.path.exists(missing)
    with pytest.raises(ChunkReadError, match="did not exist when indexed") as info:
        COMPUTES[how](old)
    assert info.value.path == missing
    np.testing.assert_array_equal(COMPUTES[how](_vol(store)), z[...])


@pytest.mark.timeout(60)
def test_a_chunk_deleted_after_indexing_raises_naming_it(sparse_store):
    store, _, data = sparse_store
    old = _vol(store)
    np.testing.assert_array_equal(old.compute(), data)
    gone = os.path.join(store, "c", "2", "0", "0")
    os.remove(gone)
    with pytest.raises(ChunkReadError, match="can no longer be found") as info:
        (old + 0).compute(scheduler="sync")
    assert info.value.path == gone
    want = data.copy()
    want[2, 0:2, 0:3] = 7
    np.testing.assert_array_equal(_vol(store).compute(), want)  # indexed again: the fill value, as in zarr
    np.testing.assert_array_equal(zarr.open_array(store, mode="r")[...], want)
