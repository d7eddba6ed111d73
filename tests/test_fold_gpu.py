"""A stack of planes folds into a streamed reduction in one launch on a GPU (``read/_fold_gpu.py``).

The values equal NumPy's on the same array: any dtype the kernel takes, NaN in floats, a cast
before the reduction, stacks deeper than the plane-by-plane limit, and chunks folded from the
cache where they lie.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import gpulazy
from gpulazy.read import _fold_gpu

from conftest import to_host

pytestmark = pytest.mark.gpu


def test_the_kernel_takes_real_numbers_only():
    assert _fold_gpu.folds("max", np.dtype("u2"), np.dtype("u2"))
    assert _fold_gpu.folds("sum", np.dtype("f4"), np.dtype("f8"))
    assert not _fold_gpu.folds("max", np.dtype("f2"), np.dtype("f2"))
    assert not _fold_gpu.folds("sum", np.dtype("c8"), np.dtype("c8"))
    assert not _fold_gpu.folds("var", np.dtype("f8"), np.dtype("f8"))


@given(dtype=st.sampled_from(["u1", "<u2", ">i4", "<f4", "<f8", "<i8"]),
       planes=st.integers(1, 80), chunk_planes=st.integers(1, 80), rows=st.integers(1, 5),
       op=st.sampled_from(["max", "min", "sum", "mean"]), cast=st.sampled_from([None, "f4", "f8", "i8"]),
       nan=st.booleans())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_reduction_over_leading_planes_equals_numpy(tmp_path_factory, dtype, planes, chunk_planes, rows, op,
                                                      cast, nan):
    data = np.random.default_rng(planes * 7 + rows).integers(-100, 250, (planes, rows, 33)).astype(dtype)
    if nan and data.dtype.kind == "f" and cast != "i8":  # (NaN cast to an integer is undefined)
        data[planes // 2, 0, 3] = np.nan
    p = str(tmp_path_factory.mktemp("fold") / "v.raw")
    data.tofile(p)
    vol = gpulazy.from_files(p, shape=data.shape, dtype=data.dtype.str, chunks=(min(chunk_planes, planes), rows, 33),
                             device="cuda:0", cache=False)
    src = vol if cast is None else vol.astype(cast)
    want = getattr(np, op)(data if cast is None else data.astype(cast), axis=0)
    got = to_host(getattr(src, op)(axis=0).compute())
    assert got.dtype == want.dtype and got.shape == want.shape
    if op in ("max", "min"):
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_cached_chunks_fold_where_they_lie_and_equal_the_file(tmp_path):
    data = np.random.default_rng(3).integers(0, 60000, (96, 40, 64)).astype("<u2")
    p = str(tmp_path / "v.raw")
    data.tofile(p)
    cache = gpulazy.DeviceCache("64 MiB", device="cuda:0")
    try:
        vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(70, 40, 64), device="cuda:0", cache=cache)
        first = to_host(vol.max(axis=0).compute())
        before = gpulazy.stats().snapshot()["bytes_read"]
        again = to_host(vol.max(axis=0).compute())
        assert gpulazy.stats().snapshot()["bytes_read"] == before  # nothing read: folded from the cache
        np.testing.assert_array_equal(first, data.max(axis=0))
        np.testing.assert_array_equal(again, data.max(axis=0))
        np.testing.assert_allclose(to_host(vol.mean(axis=0).compute()), data.mean(axis=0), rtol=1e-12)
    finally:
        cache.close()
