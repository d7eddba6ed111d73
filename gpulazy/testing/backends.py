"""``BackendConformance``: the tests every I/O backend passes, and the file helpers the suites share.

Needs pytest (and hypothesis), so import it from tests only::

    from gpulazy.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        __test__ = True
        backend_name = "mybackend"
        device = "cpu"          # or "cuda:0" in a class marked ``@pytest.mark.gpu``

Every test reads through ``gpulazy.io.get_backend(backend_name, device, ...)`` and
compares the bytes with NumPy's own reading of the file (``np.fromfile``). Documented
behaviour the suite pins down:

- a short read, a missing file or a directory raise ``ChunkReadError`` (an ``OSError``)
  naming the path (and, for a short read, the offset, expected and got byte counts),
  through ``ReadFuture.result()``, never hanging, never returning zeros;
- ``ReadFuture.result()`` may be called again: same count, or the same error;
- every completed read is recorded in ``gpulazy.stats()`` with the backend's name;
- after ``close()``, ``submit``/``read_into`` raise ``BackendUnavailableError``, and
  ``get_backend`` hands out a fresh instance instead of the closed one.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulazy.device import get_device
from gpulazy.errors import BackendUnavailableError, ChunkReadError
from gpulazy.io import backend_class, get_backend
from gpulazy.spec import ByteRange
from gpulazy.stats import default_stats

__all__ = ["BackendConformance", "file_bytes", "write_file", "wait_for_idle"]

GiB = 1 << 30
_TIMEOUT = 120.0  # seconds a result() may take before the suite calls it a hang


def write_file(path: Any, data: np.ndarray | bytes) -> str:
    """Write ``data`` to ``path``; returns the path as a string."""
    with open(path, "wb") as fh:
        fh.write(bytes(data) if not isinstance(data, np.ndarray) else data.tobytes())
    return str(path)


def file_bytes(path: str, offset: int, nbytes: int) -> np.ndarray:
    """NumPy's reading of ``nbytes`` of ``path`` at ``offset``: the oracle every test compares with."""
    return np.fromfile(path, dtype=np.uint8, count=nbytes, offset=offset)


def _random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)



def wait_for_idle(cache: Any, timeout: float = 10.0) -> dict:
    """Wait until ``cache`` has no prefetch queued or in flight; its ``stats()`` then.

    Raises ``AssertionError`` with the stats if it is still busy after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = cache.stats()
        if s["queued"] == 0 and s["in_flight"] == 0:
            return s
        time.sleep(0.005)
    raise AssertionError(f"cache {getattr(cache, 'name', cache)!r} still busy after {timeout} s: {cache.stats()}")


class BackendConformance:
    """Tests every backend passes. Subclasses set ``backend_name``, ``device`` and ``__test__ = True``."""

    __test__ = False  # the base class itself is not collected

    backend_name: ClassVar[str]
    device: ClassVar[str] = "cpu"
    threads: ClassVar[int] = 3
    task_size: ClassVar[int] = 64 << 10  # small, so reads split into many pieces
    #: False for a backend that cannot read ranges near 5 GiB cheaply (says why in ``large_skip_reason``).
    large_offsets: ClassVar[bool] = True
    large_skip_reason: ClassVar[str] = ""

    # -- fixtures and helpers -------------------------------------------------------------
    @pytest.fixture
    def backend(self):
        return get_backend(self.backend_name, self.device, threads=self.threads, task_size=self.task_size)

    @pytest.fixture(scope="class")
    @classmethod
    def sparse_file(cls, tmp_path_factory) -> tuple[str, dict[int, np.ndarray]]:
        """A sparse 5 GiB file with random markers around 2 GiB, 4 GiB and its end."""
        path = str(tmp_path_factory.mktemp("sparse") / "big.bin")
        markers = {(2 * GiB) - 7: _random_bytes(64, 1), (4 * GiB) - 11: _random_bytes(64, 2),
                   (4 * GiB) + 12345: _random_bytes(64, 3), (5 * GiB) - 64: _random_bytes(64, 4)}
        with open(path, "wb") as fh:
            fh.truncate(5 * GiB)
            for offset, data in markers.items():
                fh.seek(offset)
                fh.write(data.tobytes())
        return path, markers

    def empty(self, nbytes: int) -> Any:
        """An output buffer on the suite's device, filled with a sentinel (never all zeros)."""
        dev = get_device(self.device)
        buf = dev.empty(nbytes)
        with dev.activate():
            buf[...] = 0xA5
        return buf

    @staticmethod
    def host(buf: Any) -> np.ndarray:
        return buf.get() if hasattr(buf, "get") and not isinstance(buf, np.ndarray) else np.asarray(buf)

    def read(self, backend: Any, ranges: list[ByteRange], nbytes: int | None = None) -> np.ndarray:
        out = self.empty(sum(r.nbytes for r in ranges) if nbytes is None else nbytes)
        got = backend.submit(ranges, out).result(timeout=_TIMEOUT)
        assert got == sum(r.nbytes for r in ranges)
        return self.host(out)

    # -- reading --------------------------------------------------------------------------
    def test_read_one_range(self, backend, tmp_path):
        path = write_file(tmp_path / "a.bin", _random_bytes(300_001))
        got = self.read(backend, [ByteRange(path, 1000, 250_000)])
        np.testing.assert_array_equal(got, file_bytes(path, 1000, 250_000))

    def test_whole_file(self, backend, tmp_path):
        path = write_file(tmp_path / "a.bin", _random_bytes(1 << 20, 5))
        got = self.read(backend, [ByteRange(path, 0, 1 << 20)])
        np.testing.assert_array_equal(got, file_bytes(path, 0, 1 << 20))

    def test_many_ranges_concatenated(self, backend, tmp_path):
        path = write_file(tmp_path / "a.bin", _random_bytes(500_000, 1))
        ranges = [ByteRange(path, off, n) for off, n in [(0, 10), (400_000, 99_999), (17, 130_000), (17, 5)]]
        got = self.read(backend, ranges)
        want = np.concatenate([file_bytes(path, r.offset, r.nbytes) for r in ranges])
        np.testing.assert_array_equal(got, want)

    def test_ranges_from_several_files(self, backend, tmp_path):
        paths = [write_file(tmp_path / f"f{i}.bin", _random_bytes(70_000 + i * 4099, 10 + i)) for i in range(5)]
        ranges = [ByteRange(p, 3 * i, 60_000 + i) for i, p in enumerate(paths)] + [ByteRange(paths[0], 5, 7)]
        got = self.read(backend, ranges)
        want = np.concatenate([file_bytes(r.path, r.offset, r.nbytes) for r in ranges])
        np.testing.assert_array_equal(got, want)

    def test_output_larger_than_ranges_is_fine(self, backend, tmp_path):
        path = write_file(tmp_path / "a.bin", _random_bytes(1000, 2))
        got = self.read(backend, [ByteRange(path, 10, 100)], nbytes=150)
        np.testing.assert_array_equal(got[:100], file_bytes(path, 10, 100))
        assert (got[100:] == 0xA5).all()  # bytes past the ranges are left alone

    def test_output_too_small_raises(self, backend, tmp_path):
        path = write_file(tmp_path / "a.bin", _random_bytes(1000, 2))
        with pytest.raises(ValueError, match="100"):
            backend.submit([ByteRange(path, 0, 100)], self.empty(99))

    # Each subclass runs this inherited test (differing executors by design); the file
    # is written once per test function and only read afterwards.
    @settings(max_examples=15, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors])
    @given(data=st.data())
    def test_unaligned_offsets(self, backend, tmp_path, data):
        size = 200_003
        path = str(tmp_path / "u.bin")
        if not os.path.exists(path):
            write_file(path, _random_bytes(size, 3))
        spans = data.draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, 150_000)),
                                   min_size=1, max_size=4))
        ranges = [ByteRange(path, off, min(n, size - off)) for off, n in spans]
        got = self.read(backend, ranges, nbytes=max(1, sum(r.nbytes for r in ranges)))
        want = np.concatenate([file_bytes(path, r.offset, r.nbytes) for r in ranges])
        np.testing.assert_array_equal(got[: want.size], want)

    def test_zero_length_range(self, backend, tmp_path):
        path = write_file(tmp_path / "a.bin", _random_bytes(100, 4))
        assert backend.submit([ByteRange(path, 50, 0)], self.empty(1)).result(timeout=_TIMEOUT) == 0
        got = self.read(backend, [ByteRange(path, 0, 0), ByteRange(path, 10, 20), ByteRange(path, 99, 0)])
        np.testing.assert_array_equal(got, file_bytes(path, 10, 20))

    def test_large_file_beyond_4gib(self, backend, sparse_file):
        if not self.large_offsets:
            pytest.skip(self.large_skip_reason or f"{self.backend_name} cannot read near 5 GiB cheaply")
        path, markers = sparse_file
        # Ranges straddling 2**31 and 2**32, deep past 4 GiB, and the file's last bytes.
        ranges = [ByteRange(path, 2 * GiB - 100, 300), ByteRange(path, 4 * GiB - 20, 80),
                  ByteRange(path, 4 * GiB + 12345, 64), ByteRange(path, 5 * GiB - 100, 100),
                  ByteRange(path, 4 * GiB - (1 << 20), 3 << 20)]  # many pieces across 4 GiB
        got = self.read(backend, ranges)
        want = np.concatenate([file_bytes(path, r.offset, r.nbytes) for r in ranges])
        np.testing.assert_array_equal(got, want)
        for offset, marker in markers.items():  # the oracle itself saw the markers
            np.testing.assert_array_equal(file_bytes(path, offset, 64), marker)

    # -- errors ---------------------------------------------------------------------------
    def test_short_read_raises_with_counts(self, backend, tmp_path):
        path = write_file(tmp_path / "short.bin", _random_bytes(1000, 5))
        with pytest.raises(ChunkReadError) as info:
            backend.submit([ByteRange(path, 900, 300)], self.empty(300)).result(timeout=_TIMEOUT)
        err = info.value
        assert isinstance(err, OSError)
        assert (err.path, err.expected, err.got) == (path, 300, 100)
        message = str(err)
        for part in (path, "900", "300", "100"):
            assert part in message

    def test_short_read_of_a_large_range_counts_true_bytes(self, backend, tmp_path):
        # Many pieces past the end of the file: the error reports the bytes really there.
        path = write_file(tmp_path / "short.bin", _random_bytes(150_000, 6))
        with pytest.raises(ChunkReadError) as info:
            backend.submit([ByteRange(path, 0, 600_000)], self.empty(600_000)).result(timeout=_TIMEOUT)
        assert (info.value.expected, info.value.got) == (600_000, 150_000)

    def test_missing_file(self, backend, tmp_path):
        path = str(tmp_path / "nope.bin")
        with pytest.raises(ChunkReadError, match="nope.bin") as info:
            backend.submit([ByteRange(path, 0, 10)], self.empty(10)).result(timeout=_TIMEOUT)
        assert info.value.path == path and isinstance(info.value, OSError)

    def test_directory(self, backend, tmp_path):
        with pytest.raises(ChunkReadError, match="directory") as info:
            backend.submit([ByteRange(str(tmp_path), 0, 10)], self.empty(10)).result(timeout=_TIMEOUT)
        assert info.value.path == str(tmp_path)

    def test_error_among_many_ranges_reaches_result(self, backend, tmp_path):
        good = write_file(tmp_path / "good.bin", _random_bytes(300_000, 7))
        bad = write_file(tmp_path / "bad.bin", _random_bytes(1000, 8))
        ranges = [ByteRange(good, 0, 200_000), ByteRange(bad, 0, 5000), ByteRange(good, 10, 90_000)]
        future = backend.submit(ranges, self.empty(295_000))
        with pytest.raises(ChunkReadError, match="bad.bin"):
            future.result(timeout=_TIMEOUT)
        assert future.done()

    def test_result_twice(self, backend, tmp_path):
        path = write_file(tmp_path / "a.bin", _random_bytes(5000, 9))
        future = backend.submit([ByteRange(path, 0, 5000)], self.empty(5000))
        assert future.result(timeout=_TIMEOUT) == 5000
        assert future.result(timeout=_TIMEOUT) == 5000
        failing = backend.submit([ByteRange(path, 4000, 5000)], self.empty(5000))
        with pytest.raises(ChunkReadError) as first:
            failing.result(timeout=_TIMEOUT)
        with pytest.raises(ChunkReadError) as second:
            failing.result(timeout=_TIMEOUT)
        assert first.value is second.value

    def test_failed_read_leaves_backend_usable(self, backend, tmp_path):
        path = write_file(tmp_path / "a.bin", _random_bytes(5000, 10))
        with pytest.raises(ChunkReadError):
            backend.submit([ByteRange(path, 0, 6000)], self.empty(6000)).result(timeout=_TIMEOUT)
        np.testing.assert_array_equal(self.read(backend, [ByteRange(path, 0, 5000)]), file_bytes(path, 0, 5000))

    def test_known_identities_read_each_file_as_it_is(self, backend, tmp_path):
        # ``submit_many(known=...)`` may read a file kept open as indexed without a stat; an
        # identity that is not the kept handle's (the file was replaced) opens the file anew.
        import os

        from gpulazy.spec import FileIdentity

        path = write_file(tmp_path / "k.bin", _random_bytes(8192, 21))
        for data in (None, _random_bytes(8192, 22)):
            if data is not None:
                write_file(tmp_path / "k.new", data)
                os.replace(tmp_path / "k.new", path)  # a new inode at the same path
            out = self.empty(8192)
            job = ([ByteRange(path, 0, 8192)], out)
            got = backend.submit_many([job], known={path: FileIdentity.of(path)})[0].result(timeout=_TIMEOUT)
            assert got == 8192
            np.testing.assert_array_equal(self.host(out), file_bytes(path, 0, 8192))

    # -- stats and lifecycle ----------------------------------------------------------------
    def test_stats_recorded(self, backend, tmp_path):
        path = write_file(tmp_path / "a.bin", _random_bytes(77_777, 11))
        before = default_stats().snapshot()
        self.read(backend, [ByteRange(path, 0, 77_777)])
        after = default_stats().snapshot()
        assert after["bytes_read"] - before["bytes_read"] == 77_777
        assert after["reads"] - before["reads"] == 1
        mine = lambda s: s["by_backend"].get(self.backend_name, {}).get("bytes", 0)  # noqa: E731
        assert mine(after) - mine(before) == 77_777
        assert after["last_backend"] == self.backend_name
        assert after["last_device"] == get_device(self.device).name
        assert after["last_mode"] == backend.mode

    def test_failed_read_counts_an_error(self, backend, tmp_path):
        before = default_stats().snapshot()["errors"]
        with pytest.raises(ChunkReadError):
            backend.submit([ByteRange(str(tmp_path / "missing"), 0, 1)], self.empty(1)).result(timeout=_TIMEOUT)
        assert default_stats().snapshot()["errors"] == before + 1

    def test_read_into_after_close_raises(self, tmp_path):
        path = write_file(tmp_path / "a.bin", _random_bytes(100, 12))
        cls = backend_class(self.backend_name)
        own = cls(get_device(self.device), threads=self.threads, task_size=self.task_size)
        assert own.read_into([ByteRange(path, 0, 100)], self.empty(100)) == 100
        own.close()
        assert own.closed
        with pytest.raises(BackendUnavailableError, match="closed"):
            own.read_into([ByteRange(path, 0, 100)], self.empty(100))

    def test_get_backend_replaces_a_closed_instance(self, backend, tmp_path):
        path = write_file(tmp_path / "a.bin", _random_bytes(100, 13))
        backend.close()
        fresh = get_backend(self.backend_name, self.device, threads=self.threads, task_size=self.task_size)
        assert fresh is not backend and not fresh.closed
        np.testing.assert_array_equal(self.read(fresh, [ByteRange(path, 0, 100)]), file_bytes(path, 0, 100))

    def test_metadata(self, backend):
        cls = type(backend)
        assert cls.name == self.backend_name
        assert get_device(self.device).kind in cls.devices
        ok, reason = cls.availability(get_device(self.device))
        assert ok and isinstance(reason, str) and reason
        assert isinstance(backend.mode, str) and backend.mode
