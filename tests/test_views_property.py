"""Any view users index out of a volume (a step, a flip, a list, a mask, an integer, a box of a box), over any
store (raw, uncompressed Zarr, zstd, blosc, with chunks never written, cached or not), and what is computed
from it: equal to dask over the same values in NumPy. The random stress that found dask's empty blocks going
wrong (``array._strided_view``), kept as a property."""

from __future__ import annotations

import os

import dask.array as da
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpulazy

zarr = pytest.importorskip("zarr")

OPS = {
    "compute": lambda v: v,
    "max0": lambda v: v.max(axis=0),
    "sum": lambda v: v.sum(),
    "mean": lambda v: v.mean(),
    "map_max": lambda v: v.map_blocks(lambda b: b + 1, dtype=v.dtype).max(),
    "astype_sum": lambda v: v.astype("f8").sum(axis=-1),
    "times2": lambda v: v * 2,
}


@st.composite
def volumes(draw):
    shape = tuple(draw(st.integers(1, 12)) for _ in range(draw(st.integers(1, 3))))
    stored = tuple(draw(st.integers(1, n)) for n in shape)
    chunks = tuple(min(n, c * draw(st.integers(1, 3))) for n, c in zip(shape, stored))
    return shape, stored, chunks, draw(st.sampled_from(["raw", "zarr", "zstd", "blosc"]))


@st.composite
def indexes(draw, shape):
    kind = draw(st.sampled_from(["steps", "steps", "list", "mask", "box"]))  # (steps: where dask's blocks go empty)
    axis = draw(st.integers(0, len(shape) - 1))
    index = []
    for a, n in enumerate(shape):
        if kind in ("list", "mask") and a == axis:
            if kind == "mask":
                mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
                mask[draw(st.integers(0, n - 1))] = True
                index.append(mask)
            else:
                index.append(draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=6)))
        elif draw(st.integers(0, 4)) == 0:
            index.append(draw(st.integers(-n, n - 1)))
        else:
            lo = draw(st.integers(0, n - 1))
            hi = draw(st.integers(lo + 1, n))
            step = draw(st.sampled_from([1, 2, 2, 3, 4, -1, -2, -3])) if kind == "steps" else 1
            index.append(slice(lo, hi, step) if step > 0 else slice(hi - 1, lo - 1 if lo else None, step))
    return tuple(index)


def _store(tmp, data, stored, chunks, kind, cache, unwritten):
    if kind == "raw":
        p = os.path.join(tmp, "v.raw")
        data.tofile(p)
        return gpulazy.from_files(p, shape=data.shape, dtype=data.dtype.str, chunks=stored, device="cpu",
                                  cache=cache), data
    from zarr.codecs import BloscCodec, ZstdCodec

    p = os.path.join(tmp, "v.zarr")
    codec = {"zarr": None, "zstd": ZstdCodec(level=1), "blosc": BloscCodec()}[kind]
    zarr.create_array(p, shape=data.shape, chunks=stored, dtype=data.dtype, compressors=codec, fill_value=7)[...] = data
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(os.path.join(p, "c")) for f in fs)
    if unwritten and files:
        os.remove(files[len(files) // 2])  # a chunk never written: the fill value
    return gpulazy.from_files(p, device="cpu", cache=cache, chunks=chunks), zarr.open_array(p, mode="r")[...]


@given(volume=volumes(), data=st.data(), op=st.sampled_from(sorted(OPS)), cached=st.booleans(),
       unwritten=st.booleans(), inner_step=st.sampled_from([None, 1, 2]))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_view_and_what_is_computed_from_it_equals_dask_over_numpy(tmp_path_factory, volume, data, op, cached,
                                                                      unwritten, inner_step):
    shape, stored, chunks, kind = volume
    values = np.random.default_rng(len(shape)).integers(1, 999, shape).astype("<u2")
    cache = gpulazy.DeviceCache("64 KiB", device="cpu") if cached else False
    try:
        vol, values = _store(str(tmp_path_factory.mktemp("v")), values, stored, chunks, kind, cache, unwritten)
        index = data.draw(indexes(shape), label="index")
        want = da.from_array(values, chunks=stored)[index].compute()
        part = vol[index]
        if inner_step is not None and part.ndim:  # a view of a view
            inner = tuple(slice(None, None, inner_step) for _ in range(part.ndim))
            part, want = part[inner], want[inner]
        if want.size == 0 or want.ndim == 0:
            return
        for _ in range(2 if cached else 1):  # (cached: again, from the cache)
            got = np.asarray(OPS[op](part).compute())
            expected = np.asarray(OPS[op](da.from_array(want)).compute())
            assert got.shape == expected.shape
            np.testing.assert_allclose(got, expected)
    finally:
        if cached:
            cache.close()
