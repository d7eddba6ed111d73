"""Operations of several gpulazy arrays (``gpulazy.read.pairs``): random expressions of up to eight of them,
each maybe a map, a cast, a flip or a scaled array, equal what NumPy gives for the same expression, computed
and reduced, on either scheduler, through a cache or none; each array's chunks read at most once a pass (a
flip's once more: its blocks are other chunks of the same file)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gpulazy
from gpulazy.cache import DeviceCache

#: Leaves: an array of files, or one made of one (``f`` is ``x // 3 + 1`` for both gpulazy and NumPy).
LEAVES = ["a", "b", "c", "d", "a[::-1]", "b.map_blocks(f)", "c.astype('f4')", "d * 2", "np.sqrt(a)"]
OPS = ["{} + {}", "{} - {}", "{} * {}", "np.maximum({}, {})", "({} > {})"]
TERNARY = ["np.where({} > 300, {}, {})", "np.clip({}, {}, {})"]


def _expression(depth: int) -> st.SearchStrategy[str]:
    leaf = st.sampled_from(LEAVES)
    if depth == 0:
        return leaf
    sub = _expression(depth - 1)
    return st.one_of(leaf, st.builds(lambda op, x, y: "(" + op.format(x, y) + ")", st.sampled_from(OPS), sub, sub),
                     st.builds(lambda op, x, y, z: op.format(x, y, z), st.sampled_from(TERNARY), sub, sub, sub))


def _f(x):
    return x // 3 + 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(expr=_expression(3), then=st.sampled_from(["compute", "max0", "sum"]),
       chunks=st.sampled_from([(2, 3, 4), (4, 6, 4), (3, 2, 2)]), capacity=st.sampled_from([None, "4 KiB"]),
       scheduler=st.sampled_from(["sync", "threads"]))
def test_an_expression_of_several_arrays_equals_numpy(tmp_path_factory, expr, then, chunks, capacity, scheduler):
    path = tmp_path_factory.mktemp("many")
    shape = (8, 6, 4)
    cache = DeviceCache(capacity, device="cpu") if capacity else False
    try:
        arrays, data = {}, {}
        for seed, name in enumerate("abcd"):
            values = np.random.default_rng(seed).integers(0, 1000, shape).astype("<u2")
            p = str(path / f"{name}.raw")
            values.tofile(p)
            arrays[name] = gpulazy.from_files(p, shape=shape, dtype="<u2", chunks=chunks, device="cpu", cache=cache)
            data[name] = values
        made = {"compute": lambda r: r, "max0": lambda r: r.max(axis=0), "sum": lambda r: r.sum()}[then]
        with np.errstate(all="ignore"):
            try:
                want = made(eval(expr.replace("b.map_blocks(f)", "f(b)"), {"np": np, "f": _f, **data}))
            except TypeError:  # (NumPy's refusal, booleans subtracted: dask refuses it too)
                with pytest.raises(TypeError):
                    made(eval(expr, {"np": np, "f": _f, **arrays})).compute(scheduler=scheduler)
                return
            ours = made(eval(expr, {"np": np, "f": _f, **arrays}))
            before = gpulazy.stats().snapshot()["bytes_read"]
            got = ours.compute(scheduler=scheduler)
        read = gpulazy.stats().snapshot()["bytes_read"] - before
        event(f"path {getattr(ours, 'compute_path', 'dask')}")
        assert np.asarray(got).dtype == np.asarray(want).dtype, expr
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=expr)
        if getattr(ours, "compute_path", None) == "fast":
            # Streamed: each array's chunks at most once, a flip's once more (its block ``i`` is the chunk
            # that is block ``n - 1 - i`` of the array: another chunk of the same block's tuple).
            used = {("flip " if leaf.endswith("[::-1]") else "") + next(c for c in leaf if c in "abcd")
                    for leaf in LEAVES if re.search(r"(?<![\w.'])" + re.escape(leaf) + r"(?![\w\[.])", expr)}
            assert read <= sum(data[name[-1]].nbytes for name in used), expr
    finally:
        if capacity:
            cache.close()


def test_a_flip_streams_beside_the_array_it_is_made_of_when_their_chunks_agree(tmp_path):
    values = np.arange(8 * 6 * 4, dtype="<u2").reshape(8, 6, 4)
    p = str(tmp_path / "a.raw")
    values.tofile(p)
    a = gpulazy.from_files(p, shape=values.shape, dtype="<u2", chunks=(2, 6, 4), device="cpu", cache=False)
    r = (a - a[::-1]).max(axis=0)
    before = gpulazy.stats().snapshot()["bytes_read"]
    np.testing.assert_array_equal(r.compute(), (values - values[::-1]).max(axis=0))
    assert r.compute_path == "fast"
    assert gpulazy.stats().snapshot()["bytes_read"] - before <= 2 * values.nbytes
    with pytest.raises(AssertionError):  # (the check above can fail: a wrong flip differs)
        np.testing.assert_array_equal(r.compute(), (values - values).max(axis=0))
