"""The posix backend: conformance on cpu and (gpu-marked) cuda, plus its own mechanics."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

from gpulazy.device import Device, get_device
from gpulazy.errors import ChunkReadError
from gpulazy.io import _posix, get_backend
from gpulazy.spec import ByteRange
from gpulazy.testing import BackendConformance, file_bytes, write_file


class TestPosixCPU(BackendConformance):
    __test__ = True
    backend_name = "posix"
    device = "cpu"


@pytest.mark.gpu
class TestPosixCUDA(BackendConformance):
    """The pinned-bounce path: preadv into pinned host buffers, async copies to the GPU."""

    __test__ = True
    backend_name = "posix"
    device = "cuda:0"

    def test_mode_is_pinned_bounce(self, backend):
        assert backend.mode == "pinned-bounce"
        assert backend.selected_because == "asked for by name"

    def test_more_pieces_than_pinned_buffers(self, backend, tmp_path):
        # 3 threads -> 6 pinned buffers of 64 KiB; 8 MiB is 128 pieces, so buffers are reused.
        data = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
        path = write_file(tmp_path / "big.bin", data)
        for _ in range(3):
            got = self.read(backend, [ByteRange(path, 3, (8 << 20) - 3)])
            np.testing.assert_array_equal(got, data[3:])

    def test_concurrent_submits(self, backend, tmp_path):
        data = np.random.default_rng(2).integers(0, 256, 2 << 20, dtype=np.uint8)
        path = write_file(tmp_path / "c.bin", data)
        outs = [self.empty(1 << 20) for _ in range(6)]
        futures = [backend.submit([ByteRange(path, i * 100_000, 1 << 20)], out) for i, out in enumerate(outs)]
        for i, (f, out) in enumerate(zip(futures, outs)):
            assert f.result(timeout=60) == 1 << 20
            np.testing.assert_array_equal(self.host(out), data[i * 100_000: i * 100_000 + (1 << 20)])


def _file(tmp_path, n=1 << 20, seed=0):
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return write_file(tmp_path / f"d{seed}.bin", data), data


def test_cpu_mode_and_zero_copy_into_numpy(tmp_path):
    path, data = _file(tmp_path)
    backend = get_backend("posix", "cpu", threads=2, task_size=4096)
    assert backend.mode == "posix" and not backend.device_direct
    out = np.zeros(1 << 20, np.uint8)
    assert backend.read_into([ByteRange(path, 0, 1 << 20)], out) == 1 << 20
    np.testing.assert_array_equal(out, data)  # the caller's own buffer was filled


def test_partial_reads_are_looped(tmp_path, monkeypatch):
    # Linux returns at most ~2 GiB per call; here every call returns at most 1000 bytes.
    calls = []
    real = os.preadv

    def capped(fd, buffers, offset):
        (view,) = buffers
        calls.append(offset)
        return real(fd, [view[:1000]], offset)

    monkeypatch.setattr(_posix, "_preadv", capped)
    path, data = _file(tmp_path, 100_000, 1)
    out = np.empty(99_000, np.uint8)
    get_backend("posix", "cpu", threads=2, task_size=40_000).read_into([ByteRange(path, 1000, 99_000)], out)
    np.testing.assert_array_equal(out, data[1000:])
    assert len(calls) >= 99  # looped: one call could not have moved it all


def test_an_oserror_in_a_worker_reaches_result(tmp_path, monkeypatch):
    def broken(fd, buffers, offset):
        if offset >= 50_000:
            raise OSError(errno.EIO, "Input/output error")
        return os.preadv(fd, buffers, offset)

    monkeypatch.setattr(_posix, "_preadv", broken)
    path, _ = _file(tmp_path, 100_000, 2)
    future = get_backend("posix", "cpu", threads=2, task_size=10_000).submit(
        [ByteRange(path, 0, 100_000)], np.empty(100_000, np.uint8))
    with pytest.raises(OSError, match="Input/output error"):
        future.result(timeout=30)


def test_short_read_from_a_file_truncated_mid_read(tmp_path, monkeypatch):
    path, _ = _file(tmp_path, 100_000, 3)
    seen = threading.Event()

    def truncating(fd, buffers, offset):
        if offset >= 60_000 and not seen.is_set():
            seen.set()
            os.truncate(path, 30_000)  # another process truncates the file after 60 kB were read
        return os.preadv(fd, buffers, offset)

    monkeypatch.setattr(_posix, "_preadv", truncating)
    with pytest.raises(ChunkReadError) as info:
        get_backend("posix", "cpu", threads=1, task_size=20_000).read_into(
            [ByteRange(path, 0, 100_000)], np.empty(100_000, np.uint8))
    # The piece that failed started at 60 kB, but only 30 kB of the file remain: report those.
    assert (info.value.expected, info.value.got, info.value.offset) == (100_000, 30_000, 30_000)


def _open_fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd to count descriptors")
def test_file_descriptors_are_closed_even_on_error(tmp_path):
    path, _ = _file(tmp_path, 10_000, 4)
    backend = get_backend("posix", "cpu", threads=2, task_size=1000)
    out = np.empty(20_000, np.uint8)
    backend.read_into([ByteRange(path, 0, 10_000)], out)  # warm the pool's threads
    before = _open_fds()
    for _ in range(20):
        backend.read_into([ByteRange(path, 0, 5000), ByteRange(path, 5000, 5000)], out)
        with pytest.raises(ChunkReadError):
            backend.read_into([ByteRange(path, 0, 5000), ByteRange(path, 9000, 5000)], out)
        with pytest.raises(ChunkReadError):
            backend.read_into([ByteRange(path, 0, 10), ByteRange(str(tmp_path / "gone"), 0, 10)], out)
        with pytest.raises(ChunkReadError):
            backend.read_into([ByteRange(path, 0, 10), ByteRange(str(tmp_path), 0, 10)], out)
    assert _open_fds() == before


def test_non_contiguous_output_is_refused(tmp_path):
    path, _ = _file(tmp_path, 1000, 5)
    out = np.empty(4000, np.uint8)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        get_backend("posix", "cpu").submit([ByteRange(path, 0, 1000)], out)


def test_cpu_availability_needs_nothing():
    ok, reason = _posix.PosixBackend.availability(Device("cpu"))
    assert ok and "preadv" in reason


def test_reads_from_many_threads_at_once(tmp_path):
    path, data = _file(tmp_path, 1 << 20, 6)
    backend = get_backend("posix", "cpu", threads=4, task_size=8192)
    errors = []

    def reader(i):
        try:
            out = np.empty(200_000, np.uint8)
            backend.read_into([ByteRange(path, i * 1000, 200_000)], out)
            np.testing.assert_array_equal(out, data[i * 1000: i * 1000 + 200_000])
        except BaseException as e:  # collected: a failure in a thread must fail the test
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


def test_file_bytes_oracle_matches_python(tmp_path):
    path, data = _file(tmp_path, 5000, 7)
    np.testing.assert_array_equal(file_bytes(path, 123, 456), data[123:579])
    assert get_device("cpu").name == "cpu"


def test_close_racing_a_submit_fails_the_read_instead_of_hanging(tmp_path):
    from gpulazy.errors import BackendUnavailableError
    from gpulazy.io._posix import PosixBackend

    path, _ = _file(tmp_path, 100_000, 8)
    backend = PosixBackend(Device("cpu"), threads=2, task_size=10_000)
    real_submit = backend._pool.submit
    calls = []

    def submit_then_shut(*args):
        calls.append(1)
        if len(calls) == 3:  # close() lands between two pieces being queued
            backend._pool.shutdown(wait=False)
        return real_submit(*args)

    backend._pool.submit = submit_then_shut
    future = backend.submit([ByteRange(path, 0, 100_000)], np.empty(100_000, np.uint8))
    with pytest.raises(BackendUnavailableError, match="closed during a read"):
        future.result(timeout=30)
    backend.close()
