"""Read lanes: the reads a viewer waits on have backend instances (and threads) of their own, so
a plane is never queued behind read-ahead. Gated reads, never sleeps."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from gpulazy.device import gpu_count
from gpulazy.io import get_backend
from gpulazy.spec import ByteRange
from gpulazy.testing import file_bytes, write_file

from conftest import gated_preadv


@pytest.fixture
def gate():
    g = threading.Event()
    yield g
    g.set()  # reads still held at the gate end with the test


def test_each_lane_has_its_own_instance_and_lanes_are_checked():
    bulk = get_backend("posix", "cpu", threads=2, task_size=1 << 16)
    view = get_backend("posix", "cpu", threads=2, task_size=1 << 16, lane="view")
    assert view is not bulk and view.name == bulk.name == "posix"
    assert get_backend("posix", "cpu", threads=2, task_size=1 << 16, lane="view") is view
    with pytest.raises(ValueError, match="lane must be one of"):
        get_backend("posix", "cpu", lane="fast")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="tells files apart through /proc/self/fd")
def test_a_view_read_is_not_queued_behind_bulk_reads(tmp_path, monkeypatch, gate):
    slow = write_file(tmp_path / "warm.bin", np.arange(1 << 16, dtype=np.uint8))
    plane = write_file(tmp_path / "plane.bin", np.arange(1 << 12, dtype=np.uint16))
    entered = gated_preadv(monkeypatch, gate, os.path.realpath(slow))
    bulk = get_backend("posix", "cpu", threads=2, task_size=4096)
    view = get_backend("posix", "cpu", threads=2, task_size=4096, lane="view")
    warm = np.empty(1 << 16, np.uint8)
    warming = bulk.submit([ByteRange(slow, 0, 1 << 16)], warm)     # 16 pieces, both threads held
    assert entered.wait(10)
    queued, shown = np.empty(8192, np.uint8), np.empty(8192, np.uint8)
    behind = bulk.submit([ByteRange(plane, 0, 8192)], queued)        # waits behind the 16 pieces
    assert view.submit([ByteRange(plane, 0, 8192)], shown).result(timeout=10) == 8192
    np.testing.assert_array_equal(shown, file_bytes(plane, 0, 8192))
    assert not behind.done() and not warming.done()                   # the bulk lane still held
    gate.set()
    assert behind.result(timeout=10) == 8192 and warming.result(timeout=10) == 1 << 16
    np.testing.assert_array_equal(warm, file_bytes(slow, 0, 1 << 16))


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA device")
def test_kvikios_view_lane_reads_through_pinned_buffers_on_threads_of_its_own(tmp_path):
    import cupy

    bulk = get_backend("kvikio", "cuda:0")
    view = get_backend("kvikio", "cuda:0", lane="view")
    assert bulk.name == "kvikio" and bulk.shared_queue
    assert view.name == "posix" and "view lane" in view.selected_because
    path = write_file(tmp_path / "a.bin", np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8))
    out = cupy.empty(3 << 20, cupy.uint8)
    assert view.read_into([ByteRange(path, 0, 3 << 20)], out) == 3 << 20
    np.testing.assert_array_equal(cupy.asnumpy(out), file_bytes(path, 0, 3 << 20))
