"""Errors reach the caller with the file and what was expected: never zeros, never a hang."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

import gpulazy
from gpulazy.cache import DeviceCache
from gpulazy.errors import ChunkReadError, GpulazyError, LayoutError, NoFilesError

pytestmark = pytest.mark.timeout(120)  # a hang is a failure, not a stuck suite


@pytest.fixture
def files(tmp_path):
    """Four files of 8×16 uint16 (values 1.., no zeros) with an 8-byte header."""
    paths = []
    for i in range(4):
        p = tmp_path / f"s{i}.raw"
        with open(p, "wb") as f:
            f.write(b"HEADER!!")
            (np.arange(128, dtype="<u2").reshape(8, 16) + 1 + 1000 * i).tofile(f)
        paths.append(str(p))
    return paths


def _vol(paths, **kw):
    kw.setdefault("cache", False)
    return gpulazy.from_files(paths, shape=(8, 16), dtype="<u2", offset=8, chunks=(1, 4, 16), device="cpu", **kw)


def _shrink(path, nbytes):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - nbytes)


COMPUTES = {
    "fast": lambda vol: vol.compute(),
    "fast-threads": lambda vol: vol.compute(scheduler="threads"),
    "dask-sync": lambda vol: vol.compute(scheduler="sync", optimize_graph=False),
    "sum": lambda vol: vol.sum().compute(),
    "sum-threads": lambda vol: vol.sum().compute(scheduler="threads"),
    "slice": lambda vol: vol[2, 4:].compute(),
}


@pytest.mark.parametrize("how", list(COMPUTES))
def test_file_shrunk_after_from_files_raises_with_path_and_offset(files, how):
    vol = _vol(files)
    _shrink(files[2], 40)  # the last 40 bytes of the third file are gone
    with pytest.raises(ChunkReadError) as e:
        COMPUTES[how](vol)
    err = e.value
    assert err.path == files[2] and "s2.raw" in str(err)
    # The file changed since indexing: whichever of its chunks is read first fails (its
    # intact first half too: nothing is served from a changed file) and says where.
    assert err.offset is not None and 8 <= err.offset < 8 + 256
    assert str(err.offset) in str(err)
    if how == "fast":
        assert vol.compute_path == "fast"


def test_shrunk_file_with_a_cache(files):
    cache = DeviceCache("1 MiB", device="cpu")
    try:
        vol = _vol(files, cache=cache)
        _shrink(files[1], 2)
        for compute in (lambda: vol.compute(), lambda: vol.sum().compute()):
            with pytest.raises(ChunkReadError, match="s1.raw"):
                compute()
        # Only the chunk that lost bytes (rows 4..7 of s1) must stay out of the cache; the
        # first half of s1 is intact and may well have been cached by the reduction.
        broken = [spec for spec in _specs(vol) if spec.index == (1, 1, 0)]
        assert broken and all(spec not in cache for spec in broken)
    finally:
        cache.close()


def _specs(vol):
    return [task.args[0] for task in dict(vol.__dask_graph__()).values()]


def test_deleted_file_raises_with_path(files):
    vol = _vol(files)
    os.remove(files[3])
    for compute in (lambda: vol.compute(), lambda: vol.max().compute()):
        with pytest.raises(ChunkReadError, match="s3.raw"):
            compute()


def test_untouched_files_still_read_after_an_error(files):
    vol = _vol(files)
    _shrink(files[0], 2)
    with pytest.raises(ChunkReadError):
        vol.compute()
    # The other files' chunks are fine, and a slice of them computes.
    want = np.arange(128, dtype="<u2").reshape(8, 16) + 1 + 3000
    assert np.array_equal(vol[3].compute(), want)


def test_read_errors_pickle_with_their_fields():
    e = ChunkReadError("short read of 'x' at offset 5", path="x", offset=5, expected=10, got=3)
    again = pickle.loads(pickle.dumps(e))
    assert (again.path, again.offset, again.expected, again.got) == ("x", 5, 10, 3)
    assert isinstance(again, OSError) and isinstance(again, GpulazyError)


def test_from_files_raises_layout_errors_before_compute(files, tmp_path):
    _shrink(files[1], 2)
    with pytest.raises(LayoutError) as e:
        _vol(files)
    msg = str(e.value)
    assert "s1.raw" in msg and "262 bytes" in msg and "264 were expected" in msg
    assert isinstance(e.value, ValueError)


def test_unknown_dtype_and_missing_files(files, tmp_path):
    with pytest.raises(LayoutError, match="unknown dtype 'u3'.*'uint16'"):
        gpulazy.from_files(files, shape=(8, 16), dtype="u3", device="cpu")
    with pytest.raises(NoFilesError, match="nope\\*.raw"):
        gpulazy.from_files(str(tmp_path / "nope*.raw"), dtype="u1", device="cpu")
    with pytest.raises(LayoutError, match="directory"):
        gpulazy.from_files([files[0], str(tmp_path)], dtype="u1", device="cpu")
    with pytest.raises(LayoutError, match="dtype="):
        gpulazy.from_files(files[0], device="cpu")  # raw bytes need a dtype


def test_read_file_short_read_names_file(tmp_path, monkeypatch):
    p = tmp_path / "a.bin"
    np.arange(1000, dtype="<u4").tofile(p)
    # A file that shrinks between the size check and the read: the read must fail.
    import gpulazy.array as array_mod

    real = array_mod._whole_file_spec

    def shrink_after_indexing(*args, **kwargs):
        spec = real(*args, **kwargs)
        _shrink(p, 100)
        return spec

    monkeypatch.setattr(array_mod, "_whole_file_spec", shrink_after_indexing)
    with pytest.raises(ChunkReadError, match="a.bin"):
        gpulazy.read_file(p, dtype="<u4", device="cpu")
    with pytest.raises(ChunkReadError, match="a.bin"):
        gpulazy.read_files([p], dtype="<u4", device="cpu")


def test_npy_object_dtype_is_a_layout_error(tmp_path):
    p = tmp_path / "o.npy"
    np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(LayoutError, match="o.npy.*object"):
        gpulazy.from_files(p, device="cpu")
