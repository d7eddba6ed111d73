"""Stale data: a file rewritten, replaced or written to is never served from before the change.

``rsync -t``, ``cp -p`` and ``tar`` rewrite a file and set its mtime back; the inode (on
replacement) and the ctime (on every write) still change, and ``file_identity`` holds
both. Every test runs through the default cache, where a stale hit would come from.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np
import pytest

import fault_backend
import gpulazy
from gpulazy.cache import default_cache
from gpulazy.errors import ChunkReadError
from gpulazy.spec import FileIdentity, file_identity

SHAPE = (8, 64)


def _write(path, value):
    np.full(SHAPE, value, dtype="<u2").tofile(path)


def _rewrite_keeping_mtime(path, value):
    """Same size, new bytes, mtime (and atime) set back: what ``cp -p`` / ``rsync -t`` leave."""
    st = os.stat(path)
    time.sleep(0.02)  # past the kernel's coarse timestamp tick, as any real rewrite is
    with open(path, "r+b") as f:
        f.write(np.full(SHAPE, value, dtype="<u2").tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def _replace_keeping_mtime(path, value):
    """A new file renamed over the old one, mtime set back: what ``tar -x`` and ``rsync`` leave."""
    st = os.stat(path)
    tmp = path + ".new"
    _write(tmp, value)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, path)


CHANGES = {"rewritten-in-place": _rewrite_keeping_mtime, "replaced": _replace_keeping_mtime}

COMPUTES = {
    "whole-array": lambda v: v.compute(),
    "dask-sync": lambda v: v.sum(axis=1).compute(scheduler="sync"),
    "dask-threads": lambda v: (v[2:7] * 1).compute(scheduler="threads"),
    "box": lambda v: v[2:7].compute(scheduler="threads"),  # read alone, as the whole array is
}


@pytest.fixture
def raw(tmp_path):
    path = str(tmp_path / "vol.raw")
    _write(path, 1)
    yield path
    cache = default_cache("cpu")
    if cache is not None:
        cache.clear()


def _vol(path):
    return gpulazy.from_files(path, shape=SHAPE, dtype="<u2", chunks=(2, 64), device="cpu")  # default cache


def _expected(how, value):
    full = np.full(SHAPE, value, dtype="<u2")
    return {"whole-array": full, "dask-sync": full.sum(axis=1), "dask-threads": full[2:7], "box": full[2:7]}[how]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", list(CHANGES))
def test_identity_changes_when_size_and_mtime_are_restored(raw, change):
    before = file_identity(raw)
    CHANGES[change](raw, 2)
    after = file_identity(raw)
    assert before[:3] == after[:3]  # path, size, mtime: all the same
    assert before != after          # inode or ctime tells them apart


def test_file_identity_is_one_picklable_tokenizable_value(raw, tmp_path):
    import pickle

    from dask.base import tokenize

    ident = FileIdentity.of(raw)
    st = os.stat(raw)
    assert ident == (raw, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns) == file_identity(raw)
    assert (ident.path, ident.size, ident.inode) == (raw, st.st_size, st.st_ino) and ident.exists
    assert pickle.loads(pickle.dumps(ident)) == ident and type(pickle.loads(pickle.dumps(ident))) is FileIdentity
    assert tokenize(ident) == tokenize(FileIdentity.of(raw))
    assert ident.changes() is None
    gone = FileIdentity.absent(str(tmp_path / "never-written"))
    assert not gone.exists and gone.changes() is None
    _write(gone.path, 3)
    assert "did not exist when indexed" in gone.changes()
    os.remove(raw)
    assert "can no longer be found" in ident.changes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", list(COMPUTES))
@pytest.mark.parametrize("change", list(CHANGES))
def test_new_from_files_reads_the_new_bytes_through_the_default_cache(raw, change, how):
    first = _vol(raw)
    np.testing.assert_array_equal(COMPUTES[how](first), _expected(how, 1))
    assert COMPUTES[how](first) is not None  # second compute: served from the default cache
    assert default_cache("cpu").stats()["entries"] > 0 or how in ("whole-array", "box")
    CHANGES[change](raw, 2)
    second = _vol(raw)
    assert second.name != first.name
    np.testing.assert_array_equal(COMPUTES[how](second), _expected(how, 2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", list(COMPUTES))
@pytest.mark.parametrize("change", list(CHANGES))
def test_an_array_indexed_before_the_change_refuses_to_compute(raw, change, how):
    vol = _vol(raw)
    COMPUTES[how](vol)  # its chunks are in the default cache now (the dask paths)
    CHANGES[change](raw, 2)
    with pytest.raises(ChunkReadError, match="changed since it was indexed") as info:
        COMPUTES[how](vol)
    err = info.value
    assert err.path == raw and "vol.raw" in str(err)
    assert err.offset is not None and err.offset % 256 == 0 and err.expected == 256  # a (2, 64) u2 chunk
    # Indexing again reads what is there now.
    np.testing.assert_array_equal(COMPUTES[how](_vol(raw)), _expected(how, 2))


FAST_PATHS = {
    "whole-array": lambda v: v.compute(),
    "box": lambda v: v[2:7].compute(),
    "streamed-max": lambda v: v.max(axis=0).compute(),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", list(FAST_PATHS))
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_cached_chunk_of_a_changed_file_is_never_served(raw, change, how):
    # The whole-array, box and streamed-reduction paths take cached chunks as they are: each hit
    # stats its file first (reads are checked after they land; a hit reads nothing).
    vol = _vol(raw)
    (vol * 1).compute(scheduler="sync")  # every chunk in the default cache
    assert default_cache("cpu").stats()["entries"] == 4
    CHANGES[change](raw, 2)
    read_before = gpulazy.stats().snapshot()["bytes_read"]
    with pytest.raises(ChunkReadError, match="changed since it was indexed") as info:
        FAST_PATHS[how](vol)
    assert info.value.path == raw
    assert gpulazy.stats().snapshot()["bytes_read"] == read_before  # refused at the hit, nothing read


@pytest.mark.timeout(60)
def test_file_written_during_a_read_raises_not_mixed_bytes(raw):
    """A read that overlaps a write: its bytes may be half old, half new; the check after it says so."""
    fault_backend.install({"fault": "slow", "delay": 0.5, "times": 1})
    try:
        vol = gpulazy.from_files(raw, shape=SHAPE, dtype="<u2", chunks=(2, 64), device="cpu",
                                 backend="faulty", cache=False)
        writer = threading.Timer(0.1, _rewrite_keeping_mtime, (raw, 7))
        writer.start()
        try:
            with pytest.raises(ChunkReadError, match="changed since it was indexed"):
                vol.compute(scheduler="sync")
        finally:
            writer.join()
        assert fault_backend.injected() == 1
    finally:
        fault_backend.uninstall()


@pytest.mark.timeout(60)
def test_read_file_checks_the_file_after_reading(raw):
    fault_backend.install({"fault": "slow", "delay": 0.5, "times": 1})
    try:
        writer = threading.Timer(0.1, _replace_keeping_mtime, (raw, 9))
        writer.start()
        try:
            with pytest.raises(ChunkReadError, match="changed since"):
                gpulazy.read_file(raw, dtype="<u2", device="cpu", backend="faulty")
        finally:
            writer.join()
    finally:
        fault_backend.uninstall()
    np.testing.assert_array_equal(gpulazy.read_file(raw, dtype="<u2", device="cpu"), np.full(SHAPE, 9).ravel())


@pytest.mark.timeout(60)
def test_a_copy_with_cp_p_semantics_is_read_anew(tmp_path, raw):
    """shutil.copy2 is ``cp -p``: a second file with the same size and mtime, other bytes."""
    other = str(tmp_path / "other.raw")
    _write(other, 5)
    a = _vol(raw)
    np.testing.assert_array_equal(a.compute(scheduler="sync"), np.full(SHAPE, 1))
    time.sleep(0.02)
    shutil.copy2(other, raw)  # overwrites vol.raw in place, copies other's mtime
    np.testing.assert_array_equal(_vol(raw).compute(scheduler="sync"), np.full(SHAPE, 5))
