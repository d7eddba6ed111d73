"""``LayoutConformance``: the tests every layout passes (see the class)."""

from __future__ import annotations

import itertools
import os
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulazy.testing.backends import _random_bytes, write_file

__all__ = ["LayoutConformance"]


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
