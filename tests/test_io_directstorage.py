"""The directstorage adapter, exercised against a stand-in for the Windows-only package.

``dstorage_gpu`` ships only Windows wheels, so these tests install
``tests/standin_dstorage_gpu.py`` (a NumPy implementation of the surface the adapter
uses, clearly a stand-in) as ``sys.modules["dstorage_gpu"]`` and pretend the platform
is Windows. The adapter's own logic then runs for real: one batch and one fence per
submit, ranges copied out of whole-file tensors, a 1-3 byte tail, short reads,
package errors.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import standin_dstorage_gpu as standin
from gpulazy import io as gio
from gpulazy.device import Device
from gpulazy.errors import BackendUnavailableError, ChunkReadError
from gpulazy.io import _directstorage, get_backend, select_backend
from gpulazy.spec import ByteRange
from gpulazy.testing import BackendConformance, file_bytes, write_file


def _close_directstorage_instances():
    # get_backend caches instances; drop ours so no other test sees a stand-in-backed one.
    for b in list(gio._instances.values()):
        if b.name == "directstorage":
            b.close()


@pytest.fixture
def on_windows_with_standin(monkeypatch):
    """Pretend to be on Windows with the (stand-in) package installed."""
    standin.reset()
    _directstorage._probe.cache_clear()
    monkeypatch.setattr(_directstorage, "_platform", lambda: "win32")
    monkeypatch.setitem(sys.modules, "dstorage_gpu", standin)
    yield standin
    _close_directstorage_instances()
    _directstorage._probe.cache_clear()
    standin.reset()


class TestDirectStorageStandIn(BackendConformance):
    __test__ = True
    backend_name = "directstorage"
    device = "cpu"
    large_offsets = False
    large_skip_reason = ("dstorage_gpu reads whole-file prefixes (no file offset in its API): "
                         "a range near 5 GiB would read 5 GiB")

    @pytest.fixture(autouse=True)
    def _standin(self, on_windows_with_standin):
        yield


# -- availability without the package ------------------------------------------------------

def test_unavailable_off_windows():
    ok, reason = _directstorage.DirectStorageBackend.availability(Device("cpu"))
    if sys.platform != "win32":
        assert not ok
        assert reason.startswith("DirectStorage needs Windows and the 'dstorage_gpu' package")
        assert sys.platform in reason


def test_get_backend_by_name_says_why(monkeypatch):
    monkeypatch.setattr(_directstorage, "_platform", lambda: "linux")
    _close_directstorage_instances()
    with pytest.raises(BackendUnavailableError, match="DirectStorage needs Windows") as info:
        get_backend("directstorage", "cpu")
    assert "directstorage" in str(info.value)


def test_windows_without_the_package(monkeypatch):
    monkeypatch.setattr(_directstorage, "_platform", lambda: "win32")
    monkeypatch.setitem(sys.modules, "dstorage_gpu", None)  # import fails as if not installed
    _close_directstorage_instances()
    ok, reason = _directstorage.DirectStorageBackend.availability(Device("cpu"))
    assert not ok and "not importable" in reason and "pip install dstorage-gpu" in reason
    with pytest.raises(BackendUnavailableError, match="dstorage_gpu"):
        get_backend("directstorage", "cpu")


def test_auto_never_picks_directstorage(on_windows_with_standin):
    assert select_backend(Device("cpu"))[0] == "posix"


def test_probe_failure_is_reported(on_windows_with_standin):
    standin.fail = RuntimeError("DStorageCreateQueue failed: HRESULT 0x887A0005")
    ok, reason = _directstorage.DirectStorageBackend.availability(Device("cpu"))
    assert not ok and "0x887A0005" in reason


# -- adapter mechanics against the stand-in ---------------------------------------------------

def _file(tmp_path, name, n, seed):
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return write_file(tmp_path / name, data)


def test_one_batch_and_one_fence_per_submit(on_windows_with_standin, tmp_path):
    a, b, c = (_file(tmp_path, f"{k}.bin", 40_000 + i, i) for i, k in enumerate("abc"))
    backend = get_backend("directstorage", "cpu")
    standin.reset()
    ranges = [ByteRange(a, 100, 1000), ByteRange(b, 0, 40_001), ByteRange(a, 5, 10), ByteRange(c, 39_000, 1002)]
    out = np.empty(sum(r.nbytes for r in ranges), np.uint8)
    assert backend.read_into(ranges, out) == out.size
    np.testing.assert_array_equal(out, np.concatenate([file_bytes(r.path, r.offset, r.nbytes) for r in ranges]))
    assert standin.fences == 1 and len(standin.batches) == 1
    (batch,) = standin.batches
    # One request per distinct file, for just the whole 4-byte elements needed.
    assert batch == [(a, 1100 // 4), (b, 40_001 // 4), (c, 40_002 // 4)]


def test_tail_past_last_whole_element(on_windows_with_standin, tmp_path):
    path = _file(tmp_path, "odd.bin", 4 * 1000 + 3, 9)  # 3 bytes after the last float32
    out = np.empty(10, np.uint8)
    get_backend("directstorage", "cpu").read_into([ByteRange(path, 3995, 8)], out[:8])
    np.testing.assert_array_equal(out[:8], file_bytes(path, 3995, 8))


def test_short_tensor_is_a_short_read(on_windows_with_standin, tmp_path):
    path = _file(tmp_path, "s.bin", 10_000, 10)
    standin.shrink[path] = 4000  # the file lost 4000 bytes between stat and the read
    with pytest.raises(ChunkReadError) as info:
        get_backend("directstorage", "cpu").read_into([ByteRange(path, 1000, 9000)], np.empty(9000, np.uint8))
    assert (info.value.path, info.value.expected, info.value.got) == (path, 9000, 5000)


def test_package_error_names_the_files(on_windows_with_standin, tmp_path):
    a, b = _file(tmp_path, "a.bin", 100, 1), _file(tmp_path, "b.bin", 100, 2)
    backend = get_backend("directstorage", "cpu")
    standin.fail = RuntimeError("EnqueueRequest failed: HRESULT 0x80070057")
    with pytest.raises(ChunkReadError, match="0x80070057") as info:
        backend.read_into([ByteRange(a, 0, 10), ByteRange(b, 0, 10)], np.empty(20, np.uint8))
    assert a in str(info.value) and b in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_file_vanishing_after_stat(on_windows_with_standin, tmp_path, monkeypatch):
    path = _file(tmp_path, "v.bin", 100, 3)
    backend = get_backend("directstorage", "cpu")  # probed before the loader misbehaves
    real = standin.DirectStorageLoader._request

    def vanish(p, n):
        import os

        os.unlink(p)
        return real(p, n)

    monkeypatch.setattr(standin.DirectStorageLoader, "_request", staticmethod(vanish))
    with pytest.raises(ChunkReadError, match="v.bin"):
        backend.read_into([ByteRange(path, 0, 100)], np.empty(100, np.uint8))
