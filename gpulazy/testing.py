"""Conformance suites: every I/O backend subclasses ``BackendConformance``, every layout
``LayoutConformance``, and every way of getting chunk values is a consumer of ``ConsumerConformance``.

Needs pytest (and hypothesis), so import this module from tests only::

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

import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulazy.device import get_device
from gpulazy.errors import BackendUnavailableError, ChunkReadError
from gpulazy.io import backend_class, get_backend
from gpulazy.spec import ByteRange
from gpulazy.stats import default_stats

__all__ = ["BackendConformance", "LayoutConformance", "ConsumerConformance", "CONSUMERS", "Case", "Dataset",
           "Format", "file_bytes", "write_file", "wait_for_idle"]

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


# -- layouts ----------------------------------------------------------------------------------

class LayoutConformance:
    """Tests every layout passes. Subclass it, set ``layout_name`` and ``__test__ = True``, write ``make``::

        class TestMyLayout(LayoutConformance):
            __test__ = True
            layout_name = "mine"
            open_kwargs = {}            # extra from_files options (e.g. dataset="/data")

            def make(self, tmp_path, array, **kw) -> str:
                ...                     # write ``array`` in the format under tmp_path
                return path             # what from_files opens (a file or a store directory)

    ``make`` should store the array in several pieces (strips, tiles, chunks) so chunking
    is exercised; ``reference(path)`` may return the format's own reading of the file
    (tifffile, zarr, h5py), checked as well. Documented behaviour the suite pins down:

    - ``guess_can_open`` is true for what ``make`` writes, false for other bytes, an empty
      file, a missing path or an empty directory, and never raises;
    - the array read through gpulazy (the whole-array fast path and dask's path alike)
      equals what was written, in shape, dtype (native byte order) and values;
    - every dask chunk is a union of whole stored pieces (``Index.attrs["stored_chunks"]``)
      for any ``chunks=`` spelling;
    - ``layouts.levels(path)`` starts with the full resolution ``index(path)`` gives;
    - each ``ChunkSpec`` survives pickle with the same key and dask token, and the
      ``Index`` token is the same for two indexings of the same files;
    - a damaged file (``damage``) raises a gpulazy error naming a file of the dataset,
      at indexing or at compute, never a hang or another exception; a missing path
      raises ``NoFilesError`` and an unknown option ``TypeError`` naming it.
    """

    __test__ = False

    layout_name: ClassVar[str]
    open_kwargs: ClassVar[dict] = {}
    #: dtypes ``make`` can write (big-endian where the format stores it).
    dtypes: ClassVar[tuple[str, ...]] = ("uint8", "<u2", ">u2", "int16", "float32")
    #: Smallest and largest number of axes ``make`` can write.
    ndims: ClassVar[tuple[int, int]] = (2, 3)
    max_examples: ClassVar[int] = 10

    def make(self, tmp_path: Any, array: np.ndarray, **kw: Any) -> str:
        """Write ``array`` in the layout's format under ``tmp_path``; return what to open."""
        raise NotImplementedError

    def reference(self, path: str) -> np.ndarray | None:
        """The format's own reader's array for ``path`` (``None``: compare with the written array only)."""
        return None

    def damage(self, path: str) -> None:
        """Damage the dataset at ``path``: by default, cut its biggest file to a third."""
        files = [path] if os.path.isfile(path) else [
            os.path.join(d, n) for d, _, names in os.walk(path) for n in names]
        biggest = max(files, key=os.path.getsize)
        with open(biggest, "r+b") as fh:
            fh.truncate(os.path.getsize(biggest) // 3)

    # -- helpers ----------------------------------------------------------------------------
    def open(self, path: str, **kw: Any) -> Any:
        import gpulazy

        return gpulazy.from_files(path, layout=self.layout_name, device="cpu", cache=False,
                                  **{**self.open_kwargs, **kw})

    def index(self, path: str, **kw: Any) -> Any:
        from gpulazy import layouts

        return layouts.index(path, layout=self.layout_name, **{**self.open_kwargs, **kw})

    @staticmethod
    def random_array(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
        rng = np.random.default_rng(seed)
        dt = np.dtype(dtype)
        if dt.kind == "f":
            return rng.standard_normal(shape).astype(dt)
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, shape, dtype=dt.newbyteorder("=")).astype(dt)

    def _fresh(self, tmp_path: Any) -> Any:
        import tempfile
        from pathlib import Path

        return Path(tempfile.mkdtemp(dir=tmp_path))

    def _shapes(self) -> Any:
        lo, hi = self.ndims
        return st.integers(lo, hi).flatmap(lambda n: st.tuples(*[st.integers(1, 40)] * n))

    # -- recognising files ------------------------------------------------------------------
    def test_guess_can_open_what_make_writes(self, tmp_path):
        from gpulazy import layouts

        path = self.make(tmp_path, self.random_array((6, 7), "uint16"))
        cls = layouts.layout_class(self.layout_name)
        assert cls.guess_can_open(path) is True
        assert layouts.guess_layout(path).name == self.layout_name

    def test_guess_can_open_is_false_for_other_things_and_never_raises(self, tmp_path):
        from gpulazy import layouts

        cls = layouts.layout_class(self.layout_name)
        noise = write_file(tmp_path / "noise.bin", _random_bytes(4096, 21))
        empty = write_file(tmp_path / "empty.bin", b"")
        os.mkdir(tmp_path / "emptydir")
        for path in (noise, empty, str(tmp_path / "missing"), str(tmp_path / "emptydir")):
            assert cls.guess_can_open(path) is False, path

    # -- values -----------------------------------------------------------------------------
    def test_reads_what_was_written(self, tmp_path):
        @settings(max_examples=self.max_examples, deadline=None)
        @given(shape=self._shapes(), dtype=st.sampled_from(self.dtypes), seed=st.integers(0, 2**16))
        def check(shape, dtype, seed):
            array = self.random_array(shape, dtype, seed)
            path = self.make(self._fresh(tmp_path), array)
            self.check_values(path, array)

        check()

    def check_values(self, path: str, array: np.ndarray, **kw: Any) -> None:
        """Both compute paths (fast whole array, dask per chunk) equal ``array`` and the reference."""
        arr = self.open(path, **kw)
        assert arr.shape == array.shape and arr.dtype == array.dtype.newbyteorder("=")
        whole = np.asarray(arr.compute())
        assert arr.compute_path == "fast"
        np.testing.assert_array_equal(whole, array)
        assert whole.dtype.isnative
        np.testing.assert_array_equal(np.asarray(arr[...].compute(scheduler="sync")), array)
        ref = self.reference(path)
        if ref is not None:
            np.testing.assert_array_equal(whole, ref)

    # -- chunks -----------------------------------------------------------------------------
    @pytest.mark.parametrize("chunks", [None, "auto", 5, (3, 11), {0: 7}, {-1: 2}], ids=repr)
    def test_chunks_are_whole_stored_pieces(self, tmp_path, chunks):
        array = self.random_array((20, 33), "uint16", 4)
        path = self.make(tmp_path, array)
        idx = self.index(path, chunks=chunks)
        stored = idx.attrs.get("stored_chunks")
        assert stored is not None and len(stored) == idx.ndim
        for axis, (sizes, n, s) in enumerate(zip(idx.chunks, idx.shape, stored)):
            assert sum(sizes) == n
            inner_edges = list(itertools.accumulate(sizes))[:-1]
            assert all(e % s == 0 for e in inner_edges), (axis, sizes, s)
        assert set(idx.specs) == set(itertools.product(*(range(len(c)) for c in idx.chunks)))
        self.check_values(path, array, chunks=chunks)

    def test_levels_start_with_full_resolution(self, tmp_path):
        from gpulazy import layouts

        path = self.make(tmp_path, self.random_array((12, 10), "uint16", 8))
        levels = layouts.levels(path, layout=self.layout_name, **self.open_kwargs)
        assert levels and levels[0].token() == self.index(path).token()

    # -- values travel ----------------------------------------------------------------------
    def test_specs_pickle_and_tokenize(self, tmp_path):
        import pickle

        from dask.base import tokenize

        path = self.make(tmp_path, self.random_array((9, 10), "float32", 5))
        idx = self.index(path, chunks=4)
        for spec in idx.specs.values():
            back = pickle.loads(pickle.dumps(spec))
            assert back == spec and back.key == spec.key and tokenize(back) == tokenize(spec)
        assert self.index(path, chunks=4).token() == idx.token()

    # -- errors -----------------------------------------------------------------------------
    def test_damaged_file_names_a_file(self, tmp_path):
        from gpulazy.errors import GpulazyError

        path = self.make(tmp_path, self.random_array((30, 40), "uint16", 6))
        self.damage(path)
        with pytest.raises(GpulazyError) as info:
            self.open(path).compute()
        assert os.path.basename(path.rstrip(os.sep)) in str(info.value)

    def test_missing_path_and_unknown_option(self, tmp_path):
        from gpulazy.errors import NoFilesError

        missing = str(tmp_path / "missing.dat")
        with pytest.raises(NoFilesError, match="missing.dat"):
            self.open(missing)
        path = self.make(tmp_path, self.random_array((4, 5), "uint8"))
        with pytest.raises(TypeError, match="bogus_option"):
            self.open(path, bogus_option=1)


# -- consumers --------------------------------------------------------------------------------
#
# A consumer is one way users get chunk values: ``consume(case) -> None`` reads the case's
# dataset that way and asserts the values equal ``case.reference`` (the format's own reader's
# array). A new way of reading is one more entry in ``CONSUMERS``; a new format one more
# ``Format`` in a ``ConsumerConformance`` subclass.

@dataclass(frozen=True)
class Dataset:
    """What a ``Format`` wrote under ``root``: the ``path`` ``from_files`` opens with ``options``.

    ``reference`` is the format's own reader's array (NumPy, tifffile, zarr, h5py) read back
    from the files. ``raw``, for files that are plain element runs: ``files`` and the
    ``read_file`` keywords ``dtype``, ``shape`` (one file's, in its element ``order``) and
    ``offset``.
    """

    root: str
    path: str
    reference: np.ndarray
    options: dict = field(default_factory=dict)
    raw: dict | None = None


@dataclass(frozen=True)
class Format:
    """A way to store an array: ``write(folder, array, chunks, draw) -> Dataset``.

    ``chunks`` is the stored chunking drawn for the example (one length per axis; a format
    with fixed pieces, such as 16 x 16 tiles, rounds it); ``draw`` is hypothesis' draw, for
    codec options. ``raw``: its files are plain element runs that ``read_file`` reads.
    """

    write: Callable[..., Dataset]
    dtypes: tuple[str, ...] = ("uint8", "<u2", ">u2", "int16", "float32")
    ndims: tuple[int, int] = (2, 3)
    min_side: int = 5
    max_side: int = 20
    raw: bool = False


@dataclass
class Case:
    """One example: a written dataset, the device, the ``chunks=`` asked for and hypothesis' ``draw``."""

    dataset: Dataset
    device: str
    chunks: Any
    draw: Callable[..., Any]
    tmp: str  # a fresh folder the consumer may write into

    @property
    def reference(self) -> np.ndarray:
        return self.dataset.reference

    def open(self, path: str | None = None, **kw: Any) -> Any:
        """``from_files`` over the dataset (or its copy at ``path``); no cache unless ``cache=`` says."""
        import gpulazy

        opts = {"chunks": self.chunks, "cache": False, **self.dataset.options, **kw}
        return gpulazy.from_files(path or self.dataset.path, device=self.device, **opts)

    def check(self, got: Any, want: Any, what: str, *, atol: float = 0.0) -> None:
        """``got`` lives on the case's device, in native byte order, and equals ``want``
        (within ``atol``: for sums, whose rounding depends on the order of the additions)."""
        if not isinstance(got, np.generic):  # dask hands a 0-d NumPy result out as a scalar
            xp = get_device(self.device).xp
            assert isinstance(got, xp.ndarray), f"{what}: a {type(got).__name__}, not an array on {self.device}"
        host, want = BackendConformance.host(got), np.asarray(want)
        assert host.shape == want.shape, f"{what}: shape {host.shape}, expected {want.shape}"
        assert host.dtype == want.dtype.newbyteorder("="), f"{what}: dtype {host.dtype}, expected {want.dtype}"
        if atol:
            np.testing.assert_allclose(host, want, rtol=0, atol=atol, err_msg=what)
        else:
            np.testing.assert_array_equal(host, want, err_msg=what)


def flip_byte(path: str, at: int) -> None:
    """Flip byte ``at`` of ``path``, keeping its size and mtime (only a checksum can tell)."""
    st_ = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x55]))
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns))


def _blocks(vol: Any) -> list[tuple[tuple[int, ...], Any, tuple[slice, ...]]]:
    """``(block index, ChunkSpec, the block's slices of the whole array)`` for each chunk of ``vol``."""
    edges = [list(itertools.accumulate(c, initial=0)) for c in vol.chunks]
    return [(index, spec, tuple(slice(e[i], e[i + 1]) for e, i in zip(edges, index)))
            for index, spec in vol.chunk_index.specs.items()]


def _box(shape: tuple[int, ...]) -> Any:
    """A strategy for an index into ``shape``: per axis an int or a slice with a step."""
    def axis(n: int) -> Any:
        bounds = st.tuples(st.integers(0, n - 1), st.integers(1, n), st.integers(1, 3))
        slices = bounds.map(lambda b: slice(min(b[0], b[1] - 1), b[1], b[2]))
        return st.one_of(slices, st.integers(-n, n - 1))
    return st.tuples(*(axis(n) for n in shape))


def _sum_atol(reference: np.ndarray, dtype: Any, count: int = 1) -> float:
    """Rounding a chunked sum (of ``count`` terms averaged) may differ from NumPy's by."""
    return 64 * float(np.finfo(dtype).eps) * float(np.abs(reference.astype("f8")).sum()) / count + 1e-300


def consume_compute(case: Case) -> None:
    vol, ref = case.open(), case.reference
    case.check(vol.compute(), ref, "vol.compute()")
    assert vol.compute_path == "fast"
    head = vol[: vol.chunks[0][0]]  # a slice on chunk boundaries stays gpulazy's: the fast path too
    case.check(head.compute(), ref[: vol.chunks[0][0]], "vol[:first chunk].compute()")
    assert head.compute_path == "fast"


def _consume_dask(scheduler: str) -> Callable[[Case], None]:
    def consume(case: Case) -> None:
        vol, ref = case.open(), case.reference
        plus = vol + 0
        assert getattr(plus, "compute_path", None) is None  # dask's array: culled read_batch/pick tasks
        case.check(plus.compute(scheduler=scheduler), ref + 0, f"(vol + 0).compute(scheduler={scheduler!r})")
        copied = vol.map_blocks(lambda b: b.copy(), dtype=vol.dtype)
        case.check(copied.compute(scheduler=scheduler), ref, f"vol.map_blocks(copy).compute(scheduler={scheduler!r})")
    return consume


def consume_slice(case: Case) -> None:
    vol, ref = case.open(), case.reference
    case.check(vol[1:-1, ...].compute(), ref[1:-1, ...], "vol[1:-1, ...].compute()")
    box = case.draw(_box(ref.shape), label="box")
    case.check(vol[box].compute(scheduler="sync"), ref[box], f"vol[{box}].compute()")


def consume_max(case: Case) -> None:
    vol, ref = case.open(), case.reference
    case.check(vol.max(axis=0).compute(), ref.max(axis=0), "vol.max(axis=0).compute()")


def consume_sum(case: Case) -> None:
    vol, ref = case.open(), case.reference
    want = ref.astype("f8").sum()
    case.check(vol.astype("f8").sum().compute(), want, "vol.astype('f8').sum().compute()", atol=_sum_atol(ref, "f8"))


def consume_mean(case: Case) -> None:
    vol, ref = case.open(), case.reference
    got = vol.mean().compute()
    want = np.asarray(ref.astype("f8").mean(), dtype=got.dtype)
    case.check(got, want, "vol.mean().compute()", atol=_sum_atol(ref, got.dtype, ref.size))


def _add_one_in_place(block: Any) -> Any:
    block += 1
    return block


def consume_cache(case: Case) -> None:
    """Reads through a ``DeviceCache``: a miss, then hits; results are the caller's own; capacity holds."""
    from gpulazy.cache import DeviceCache

    ref, nbytes = case.reference, case.reference.nbytes
    capacity = case.draw(st.sampled_from([2 * nbytes, nbytes // 3, 0]), label="capacity")
    cache = DeviceCache(capacity, device=case.device)
    try:
        vol = case.open(cache=cache)
        for turn in ("miss", "hit"):
            before, read_before = cache.stats(), default_stats().snapshot()["bytes_read"]
            # Each block handed out is the task's own: writing into it cannot reach the cache.
            got = vol.map_blocks(_add_one_in_place, dtype=vol.dtype).compute(scheduler="threads")
            case.check(got, ref + 1, f"{turn} through DeviceCache({capacity}), each block += 1")
            assert cache.bytes_held <= cache.capacity, cache.stats()
        if capacity >= nbytes:  # everything stayed cached: the second pass read no byte
            after = cache.stats()
            assert after["hits"] - before["hits"] == len(vol.chunk_index.specs), after
            assert after["misses"] == before["misses"], after
            assert default_stats().snapshot()["bytes_read"] == read_before
        whole = vol.compute()  # the fast path copies cached chunks out
        case.check(whole, ref, f"vol.compute() through DeviceCache({capacity})")
        whole += 1
        case.check((vol + 0).compute(scheduler="sync"), ref + 0, "(vol + 0).compute() after writing into results")
        assert cache.bytes_held <= cache.capacity, cache.stats()
    finally:
        cache.close()


def consume_load_many(case: Case) -> None:
    vol, ref = case.open(), case.reference
    blocks = _blocks(vol)
    got = vol.chunk_source.load_many(tuple(spec for _, spec, _ in blocks))
    assert len(got) == len(blocks)
    for (index, _, block), arr in zip(blocks, got):
        case.check(arr, ref[block], f"chunk_source.load_many(...)[{index}]")


def consume_read(case: Case) -> None:
    vol, ref = case.open(), case.reference
    for index, spec, block in _blocks(vol):
        case.check(vol.chunk_source.read(spec), ref[block], f"chunk_source.read(chunk {index})")


def consume_get_region(case: Case) -> None:
    """``DeviceCache.get_region`` of random boxes inside chunks, into a view of a larger array and not."""
    from gpulazy.cache import DeviceCache

    vol, ref = case.open(), case.reference
    dev = get_device(case.device)
    capacity = case.draw(st.sampled_from([2 * ref.nbytes, 0]), label="capacity")
    cache = DeviceCache(capacity, device=case.device)
    blocks = _blocks(vol)
    try:
        for i in case.draw(st.lists(st.integers(0, len(blocks) - 1), min_size=1, max_size=3), label="chunks"):
            index, spec, block = blocks[i]
            region = case.draw(_box(tuple(spec.shape)), label="region")
            want = ref[block][region]
            with dev.activate():  # ``out`` inside a frame of sentinels that must stay untouched
                frame = dev.xp.full(tuple(n + 2 for n in want.shape), 7, dtype=vol.dtype)
                out = frame[(slice(1, -1),) * want.ndim + (Ellipsis,)]
            what = f"get_region(chunk {index}, {region})"
            assert cache.get_region(spec, vol.chunk_source.read, region, out=out) is out, what
            case.check(out, want, what)
            edge = BackendConformance.host(frame).copy()
            edge[(slice(1, -1),) * want.ndim] = 7
            assert (edge == 7).all(), f"{what} wrote outside out"
            case.check(cache.get_region(spec, vol.chunk_source.read, region), want, what + ", again")
            assert cache.bytes_held <= cache.capacity, cache.stats()
    finally:
        cache.close()


def _consume_prefetch(context: bool) -> Callable[[Case], None]:
    def consume(case: Case) -> None:
        import gpulazy
        from gpulazy.cache import DeviceCache

        ref = case.reference
        capacity = case.draw(st.sampled_from([2 * ref.nbytes, ref.nbytes // 2]), label="capacity")
        cache = DeviceCache(capacity, device=case.device)
        try:
            vol = case.open(cache=cache)
            runs = {"(vol + 0).compute()": (lambda cb: (vol + 0).compute(scheduler="threads", **cb), ref + 0),
                    "vol.max(axis=0).compute()": (lambda cb: vol.max(axis=0).compute(scheduler="sync", **cb),
                                                  ref.max(axis=0)),
                    "vol.compute()": (lambda cb: vol.compute(**cb), ref)}
            for what, (run, want) in runs.items():
                if context:
                    with gpulazy.prefetch(depth=2):
                        got = run({})
                else:
                    got = run({"callbacks": [gpulazy.prefetch(depth=2)]})
                case.check(got, want, f"{what} with prefetch ({'with' if context else 'callbacks'})")
                assert cache.bytes_held <= cache.capacity, cache.stats()
            assert vol.compute_path == "fast"
        finally:
            cache.close()
    return consume


def consume_read_file(case: Case) -> None:
    """``read_file`` of each file and ``read_files`` of all, for files of plain element runs."""
    import gpulazy

    raw = case.dataset.raw
    assert raw is not None, "read_file needs a Format with raw=True"
    kw = {"dtype": raw["dtype"], "shape": raw["shape"], "offset": raw["offset"], "device": case.device}
    files = raw["files"]
    stacked = os.path.isdir(case.dataset.path)  # a folder stacks its files, one per plane, even one file
    planes = case.reference if stacked else case.reference[None]
    in_c = (lambda a: a.T) if raw["order"] == "F" else (lambda a: a)
    for path, want in zip(files, planes):
        case.check(in_c(gpulazy.read_file(path, **kw)), want, f"read_file({path!r})")
    got = gpulazy.read_files(files, **kw)
    assert len(got) == len(files)
    for path, arr, want in zip(files, got, planes):
        case.check(in_c(arr), want, f"read_files(...) of {path!r}")


consume_read_file.needs_raw = True  # type: ignore[attr-defined]


def consume_verify(case: Case) -> None:
    """``verify=True`` reads equal the file; one flipped stored byte raises ``ChunkReadError`` naming it."""
    import shutil

    from gpulazy.checksums import write_manifest

    ref, data = case.reference, case.dataset
    root = shutil.copytree(data.root, os.path.join(case.tmp, "verified"))
    path = os.path.join(root, os.path.relpath(data.path, data.root))
    write_manifest(path if os.path.isdir(path) else [path], block_size=case.draw(st.sampled_from([4096, 64])))
    reads = {"vol.compute()": lambda v: v.compute(), "(vol + 0).compute()": lambda v: (v + 0).compute()}
    for what, read in reads.items():
        case.check(read(case.open(path, verify=True)), ref + 0, f"verify=True {what}")
    stored = [r for spec in case.open(path).chunk_index.specs.values() for r in spec.ranges if r.nbytes]
    victim = stored[case.draw(st.integers(0, len(stored) - 1), label="stored piece")]
    at = victim.offset + case.draw(st.integers(0, victim.nbytes - 1), label="byte")
    flip_byte(victim.path, at)
    for what, read in reads.items():
        # Indexed after the flip: only the checksums can tell. A byte in a checksum block that
        # also holds the layout's metadata (a header) fails ``from_files`` itself.
        with pytest.raises(ChunkReadError) as info:
            read(case.open(path, verify=True))
        assert info.value.path == victim.path and victim.path in str(info.value), f"{what}: {info.value!r}"


#: Every way users get chunk values, by name. Plug a new one in as one more entry.
CONSUMERS: dict[str, Callable[[Case], None]] = {
    "compute": consume_compute,
    "dask-sync": _consume_dask("sync"),
    "dask-threads": _consume_dask("threads"),
    "slice": consume_slice,
    "max": consume_max,
    "sum-f8": consume_sum,
    "mean": consume_mean,
    "cache": consume_cache,
    "load_many": consume_load_many,
    "read": consume_read,
    "get_region": consume_get_region,
    "prefetch-callbacks": _consume_prefetch(context=False),
    "prefetch-with": _consume_prefetch(context=True),
    "read_file": consume_read_file,
    "verify": consume_verify,
}


class ConsumerConformance:
    """Every consumer gives every format's values as the format's own reader reads them.

    Subclass it, set ``formats`` (name -> ``Format``) and ``__test__ = True``::

        class TestConsumers(ConsumerConformance):
            __test__ = True
            formats = {"npy": Format(write_npy, raw=True), ...}
            device = "cpu"            # or "cuda:0" in a class marked ``@pytest.mark.gpu``

    ``test_consumer`` runs once per consumer (``consumers``, default ``CONSUMERS``) and format;
    hypothesis draws the dtype, shape, stored chunking, the ``chunks=`` asked of
    ``from_files`` (at most 4 chunks an axis) and what each consumer draws itself (boxes,
    capacities, the byte to flip). ``max_examples`` per pair (``GPULAZY_CONFORMANCE_N``);
    examples are derandomized, so CI runs the same ones every time. ``known_failures``
    (``(consumer, format) -> reason``) marks a pair ``xfail(strict=True)``, ``known_bug``
    the examples every consumer fails: bugs to fix.
    """

    __test__ = False

    formats: ClassVar[dict[str, Format]] = {}
    consumers: ClassVar[dict[str, Callable[[Case], None]]] = CONSUMERS
    device: ClassVar[str] = "cpu"
    max_examples: ClassVar[int] = int(os.environ.get("GPULAZY_CONFORMANCE_N", "3"))
    known_failures: ClassVar[dict[tuple[str, str], str]] = {}

    def pytest_generate_tests(self, metafunc: Any) -> None:
        if "consumer" not in metafunc.fixturenames:
            return
        params = []
        for name, consume in self.consumers.items():
            for fmt, form in self.formats.items():
                if getattr(consume, "needs_raw", False) and not form.raw:
                    continue
                reason = self.known_failures.get((name, fmt))
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                params.append(pytest.param(name, fmt, marks=marks, id=f"{name}-{fmt}"))
        metafunc.parametrize(("consumer", "fmt"), params)

    def test_consumer(self, consumer, fmt, tmp_path):
        consume, form = self.consumers[consumer], self.formats[fmt]

        @settings(max_examples=self.max_examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def check(data):
            case = self.case(form, data.draw, str(tmp_path))
            bug = self.known_bug(fmt, case)
            if bug is None:
                return consume(case)
            with pytest.raises(Exception, match=".") as info:  # still failing, as the bug predicts
                consume(case)
            print(f"known bug ({bug}): {info.value!r}")

        check()

    def known_bug(self, fmt: str, case: Case) -> str | None:
        """Why every consumer fails ``case`` of format ``fmt`` (a bug to fix), else ``None``.

        Such a case must fail: once the bug is fixed the suite says so, and this goes.
        """
        return None

    def case(self, form: Format, draw: Callable[..., Any], tmp: str) -> Case:
        """Draw an example of ``form`` and write it under a fresh folder of ``tmp``."""
        import tempfile

        ndim = draw(st.integers(*form.ndims), label="ndim")
        # Hypothesis starts from the simplest example: make that one several chunks a side,
        # edge chunks included; sides of 1 and 2 come later.
        sides = [(3, 8) if axis == 0 and ndim == 3 else (form.min_side, form.max_side) for axis in range(ndim)]
        shape = tuple(draw(st.integers(lo, max(lo, hi)) | st.integers(1, lo)) for lo, hi in sides)
        pieces = lambda n: st.sampled_from([2, 3, 1, 4]).map(lambda k: -(-n // k))  # noqa: E731 - chunks a side
        stored = draw(st.tuples(*(pieces(n) for n in shape)), label="stored chunks")
        chunks = draw(st.one_of(st.tuples(*(pieces(n) for n in shape)), st.none()), label="chunks=")
        array = LayoutConformance.random_array(shape, draw(st.sampled_from(form.dtypes), label="dtype"),
                                               draw(st.integers(0, 2**16), label="seed"))
        folder = tempfile.mkdtemp(dir=tmp)
        dataset = form.write(folder, array, stored, draw)
        np.testing.assert_array_equal(dataset.reference, array, err_msg="the format's reader disagrees with the writer")
        return Case(dataset, self.device, chunks, draw, tempfile.mkdtemp(dir=tmp))
