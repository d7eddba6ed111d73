"""Reductions that run as the reads land (``gpulazy.read.reduce``) equal NumPy's, over any chunking.

``vol.max/min/sum/mean/var/std/argmax/argmin/any/all`` (also after ``vol.astype(...)``) build one task that reads
every chunk through the engine and folds it into the result as it lands; dask's per-chunk
tree is what ``config fused_reductions=False`` (or an unsupported argument) gives.
"""

from __future__ import annotations

import os

import dask
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import gpulazy
import gpulazy.spec
from gpulazy.errors import ChunkReadError
from gpulazy.spec import ByteRange, ChunkSpec, Codec

from conftest import to_host, zstd_zarr

OPS = ["max", "min", "sum", "mean", "var", "std"]


@st.composite
def layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    chunks = tuple(draw(st.integers(1, n)) for n in shape)
    axes = draw(st.one_of(st.none(), st.sampled_from(range(-ndim, ndim)),
                          st.sets(st.integers(0, ndim - 1), min_size=1).map(tuple)))
    return shape, chunks, axes


def _vol(tmp_path, data, chunks, cache=False, device="cpu"):
    p = str(tmp_path / "v.raw")
    data.tofile(p)
    return gpulazy.from_files(p, shape=data.shape, dtype=data.dtype.str, chunks=chunks, device=device, cache=cache)


@given(layout=layouts(), op=st.sampled_from(OPS), dtype=st.sampled_from(["<u2", ">i4", "<f4", "u1"]),
       keepdims=st.booleans())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_streamed_reduction_equals_numpy(tmp_path_factory, layout, op, dtype, keepdims):
    shape, chunks, axes = layout
    data = np.random.default_rng(0).integers(0, 200, shape).astype(dtype)
    vol = _vol(tmp_path_factory.mktemp("r"), data, chunks)
    r = getattr(vol, op)(axis=axes, keepdims=keepdims)
    from gpulazy.read.reduce import groups_of

    # a chain, not dask's tree: start, a step (and its group node) per group of chunks, the result
    assert "streamed" in r.name and len(r.__dask_graph__()) == 2 * len(groups_of(vol.chunk_index.specs)) + 2
    want = getattr(np, op)(data, axis=axes, keepdims=keepdims)
    got = r.compute()
    assert r.compute_path == "fast"  # the chain run in this thread (``run_stream``)
    (through_dask,) = dask.compute(r)  # the same chain as dask tasks
    for out in (got, through_dask):
        assert r.dtype == want.dtype and np.asarray(out).dtype == want.dtype
        assert out.shape == want.shape
        if op in ("max", "min") or np.dtype(dtype).kind in "ui" and op == "sum":
            np.testing.assert_array_equal(out, want)
        else:
            np.testing.assert_allclose(out, want, rtol=1e-5)


@pytest.mark.parametrize("ddof", [0, 1])
def test_std_with_ddof_and_a_cast(tmp_path, ddof):
    data = np.random.default_rng(1).normal(1000, 3, (12, 7, 5)).astype("<f4")
    vol = _vol(tmp_path, data, (5, 3, 5))
    np.testing.assert_allclose(vol.std(axis=(0, 2), ddof=ddof).compute(), data.std(axis=(0, 2), ddof=ddof),
                               rtol=1e-5)
    s = vol.astype("f8").sum()
    assert "streamed" in s.name
    assert s.compute() == pytest.approx(data.astype("f8").sum(), rel=1e-12)
    assert vol.astype("f8").dtype == np.float64
    np.testing.assert_array_equal(vol.astype("f8").compute(), data.astype("f8"))


@given(layout=layouts(), name=st.sampled_from(["max", "amax", "min", "amin", "sum", "mean", "var", "std", "any", "all"]),
       keepdims=st.sampled_from([None, False, True]), positional=st.booleans())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_numpy_reductions_of_a_gpulazy_array_stream(tmp_path_factory, layout, name, keepdims, positional):
    """``np.max(vol, axis=0)`` is ``vol.max(axis=0)``: streamed, not dask's tasks."""
    shape, chunks, axes = layout
    data = np.random.default_rng(2).integers(0, 200, shape).astype("<u2")
    vol = _vol(tmp_path_factory.mktemp("n"), data, chunks)
    func = getattr(np, name)
    given = {} if keepdims is None else {"keepdims": keepdims}
    r = func(vol, axes, **given) if positional else func(vol, axis=axes, **given)
    assert isinstance(r, type(vol)) and "streamed" in r.name
    got = r.compute()
    assert r.compute_path == "fast"
    want = func(data, axis=axes, **given)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-6)


@st.composite
def arg_layouts(draw):
    """A layout, with the axes ``argmax`` takes: one or none."""
    shape, chunks, _ = draw(layouts())
    return shape, chunks, draw(st.one_of(st.none(), st.sampled_from(range(-len(shape), len(shape)))))


@given(layout=arg_layouts(), op=st.sampled_from(["argmax", "argmin", "any", "all"]),
       dtype=st.sampled_from(["<u2", ">i4", "<f4", ">f8", "u1", "?"]), nans=st.integers(0, 3),
       keepdims=st.booleans(), cached=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_argmax_argmin_any_all_stream_and_equal_numpy(tmp_path_factory, layout, op, dtype, nans, keepdims, cached,
                                                    seed):
    """Few distinct values, so equal extremes lie in several chunks (NumPy's index is the first one's),
    and NaNs in float arrays (the first NaN is NumPy's argmax and argmin)."""
    shape, chunks, axis = layout
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 3, shape).astype(dtype)
    if data.dtype.kind == "f":
        data.ravel()[rng.integers(0, data.size, nans)] = np.nan
    vol = _vol(tmp_path_factory.mktemp("a"), data, chunks, cache=cached)
    r = getattr(vol, op)(axis=axis, keepdims=keepdims)
    assert "streamed" in r.name
    want = getattr(np, op)(data, axis=axis, keepdims=keepdims)
    got = r.compute()
    assert r.compute_path == "fast"
    (through_dask,) = dask.compute(r)
    again = getattr(vol, op)(axis=axis, keepdims=keepdims).compute()  # (cached: every chunk from the cache)
    for out in (got, through_dask, again):
        assert out.shape == want.shape and out.dtype == want.dtype == r.dtype
        np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(getattr(np, op)(vol, axis=axis, keepdims=keepdims).compute(), want)


def test_argmax_of_a_cast_and_of_an_operation_stream(tmp_path):
    """The cast is made before the comparison (a narrower float makes neighbours equal: NumPy's first
    one is picked); a comparison's ``any`` and ``all`` fold its blocks."""
    data = np.array([[1.0, 1.0 + 1e-12, 3.0], [2.0, 5.0, 5.0 + 1e-9]] * 3, dtype="f8")
    vol = _vol(tmp_path, data, (2, 2))
    for r, want in ((vol.astype("f4").argmax(axis=1), data.astype("f4").argmax(axis=1)),
                    (vol.astype("f4").argmin(), data.astype("f4").argmin()),
                    ((vol > 4).any(axis=0), (data > 4).any(axis=0)),
                    ((vol > 0.5).all(), (data > 0.5).all()),
                    ((vol * 2).argmax(axis=0), (data * 2).argmax(axis=0))):
        assert "streamed" in r.name
        np.testing.assert_array_equal(r.compute(), want)
    with pytest.raises(TypeError, match="axis"):
        vol.argmax(axis=(0, 1))  # dask's error: one axis or none


@st.composite
def reductions(draw, ndim):
    """A reduction of ``ndim``-d arrays: ``(op, axis, keepdims, cast)``."""
    op = draw(st.sampled_from(["max", "min", "sum", "mean", "var", "std", "argmax", "argmin", "any", "all"]))
    one = st.sampled_from(range(-ndim, ndim))
    axis = draw(st.one_of(st.none(), one) if op.startswith("arg") else st.one_of(
        st.none(), one, st.sets(st.integers(0, ndim - 1), min_size=1).map(tuple)))
    return op, axis, draw(st.booleans()), draw(st.sampled_from([None, "f8", "f4", "i8"]))


@given(layout=layouts(), data=st.data(), mapped=st.booleans(), scheduler=st.sampled_from(["sync", "threads"]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_reductions_computed_together_read_each_chunk_once(tmp_path_factory, layout, data, mapped, scheduler):
    """``dask.compute(vol.min(), vol.max(axis=0), vol.astype("f8").std())``: one chain folds every chunk into
    each reduction (``share_reads``), as dask's own tree reductions would share their chunk tasks."""
    shape, chunks, _ = layout
    values = np.random.default_rng(5).integers(0, 200, shape).astype("<u2")
    vol = _vol(tmp_path_factory.mktemp("s"), values, chunks)
    source, ref = (vol * 3, values * np.uint16(3)) if mapped else (vol, values)
    asked = data.draw(st.lists(reductions(len(shape)), min_size=2, max_size=4))
    made = [getattr(source if cast is None else source.astype(cast), op)(axis=axis, keepdims=keepdims)
            for op, axis, keepdims, cast in asked]
    before = gpulazy.stats().snapshot()["bytes_read"]
    got = dask.compute(*made, scheduler=scheduler)
    assert gpulazy.stats().snapshot()["bytes_read"] - before == values.nbytes  # every chunk once
    for out, (op, axis, keepdims, cast) in zip(got, asked):
        want = getattr(np, op)(ref if cast is None else ref.astype(cast), axis=axis, keepdims=keepdims)
        assert out.shape == want.shape and out.dtype == want.dtype
        np.testing.assert_allclose(out, want, rtol=1e-5)


@given(layout=layouts(), dtype=st.sampled_from(["<u2", ">i4", "<f4", "u1"]), edges=st.booleans(),
       made=st.sampled_from(["files", "cast", "map"]), bins=st.integers(1, 12), cached=st.booleans())
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_np_histogram_streams_and_equals_dask_s(tmp_path_factory, layout, dtype, edges, made, bins, cached):
    """``np.histogram(vol, bins, range)``: each chunk's counts as dask's task for its block counts them (values
    on the edges of bins included), added up as the reads land; the edges are dask's."""
    import dask.array as da

    shape, chunks, _ = layout
    data = np.random.default_rng(bins).integers(0, 100, shape).astype(dtype)
    vol = _vol(tmp_path_factory.mktemp("h"), data, chunks, cache=cached)
    source, ref = {"files": (vol, data), "cast": (vol.astype("f8"), data.astype("f8")),
                   "map": (vol * 2 - 7, data * 2 - 7)}[made]
    kw = {"bins": np.linspace(-10, 150, bins + 1).tolist()} if edges else {"bins": bins, "range": (0, 99)}
    counts, got_edges = np.histogram(source, **kw)
    want, want_edges = np.histogram(da.from_array(ref, chunks=chunks), **kw)
    assert "streamed" in counts.name and counts.dtype == want.dtype and counts.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got_edges), np.asarray(want_edges))
    for out in (counts.compute(), dask.compute(counts)[0]):
        np.testing.assert_array_equal(out, want.compute())
    np.testing.assert_array_equal(counts.compute(), np.histogram(ref, **kw)[0])


def test_np_histogram_is_dask_s_for_density_and_weights(tmp_path):
    data = np.arange(40, dtype="<u2").reshape(8, 5)
    vol = _vol(tmp_path, data, (3, 5))
    density, _ = np.histogram(vol, bins=4, range=(0, 40), density=True)
    assert "streamed" not in density.name
    np.testing.assert_allclose(density.compute(), np.histogram(data, bins=4, range=(0, 40), density=True)[0])
    weighted, _ = np.histogram(vol, bins=4, range=(0, 40), weights=vol)
    assert "streamed" not in weighted.name
    np.testing.assert_array_equal(weighted.compute(), np.histogram(data, bins=4, range=(0, 40), weights=data)[0])
    counted, _ = np.histogram(vol, bins=4, range=(0, 40))  # (beside them, the plain count streams)
    assert "streamed" in counted.name
    with pytest.raises(ValueError, match="range"):  # dask's own error: it needs the range to be lazy
        np.histogram(vol, bins=4)


def test_an_operation_of_reductions_reads_once_and_what_differs_does_not_share(tmp_path):
    data = np.random.default_rng(6).normal(0, 1, (12, 7, 5)).astype("<f4")
    vol = _vol(tmp_path, data, (5, 3, 5))
    (tmp_path / "o").mkdir()
    other = _vol(tmp_path / "o", data[::-1].copy(), (5, 3, 5))
    span = vol.max(axis=0) - vol.min(axis=0)  # (a gpulazy array: its optimisation shares the chains)
    before = gpulazy.stats().snapshot()["bytes_read"]
    np.testing.assert_allclose(span.compute(), np.ptp(data, axis=0))
    assert gpulazy.stats().snapshot()["bytes_read"] - before == data.nbytes and span.compute_path == "dask"
    z = (vol - vol.mean()) / vol.std()  # the mean and std in one read, then the map's
    before = gpulazy.stats().snapshot()["bytes_read"]
    np.testing.assert_allclose(z.compute(), (data - data.mean()) / data.std(), atol=1e-5)
    assert gpulazy.stats().snapshot()["bytes_read"] - before == 2 * data.nbytes
    graph = dict(span.__dask_optimize__(span.__dask_graph__(), span.__dask_keys__()))
    assert sum(1 for k in graph if isinstance(k, tuple) and str(k[0]).startswith("shared-streamed")) > 0
    # Other files, or a different map of the same files: a chain each.
    before = gpulazy.stats().snapshot()["bytes_read"]
    lo, hi, twice = dask.compute(vol.min(), other.max(), (vol * 2).max())
    assert (lo, hi, twice) == (data.min(), data.max(), (data * 2).max())
    assert gpulazy.stats().snapshot()["bytes_read"] - before == 3 * data.nbytes
    # With a progress bar, as dask tasks: shared too.
    from dask.diagnostics import ProgressBar

    before = gpulazy.stats().snapshot()["bytes_read"]
    with ProgressBar(out=open(os.devnull, "w")):
        np.testing.assert_allclose(span.compute(), np.ptp(data, axis=0))
    assert gpulazy.stats().snapshot()["bytes_read"] - before == data.nbytes


@pytest.mark.parametrize("op,dtype", [(op, d) for op in ("sum", "mean", "var", "std") for d in ("f4", "f8")]
                         + [("sum", "i8")])  # (NumPy's mean of int64 is float64: not accumulated in int64)
def test_a_reduction_given_the_dtype_it_accumulates_in_streams(tmp_path, op, dtype):
    """``vol.sum(dtype="f8")`` is ``vol.astype("f8").sum()``: the same values, streamed."""
    data = np.random.default_rng(3).integers(0, 60000, (9, 6, 5)).astype(">u2")
    vol = _vol(tmp_path, data, (4, 3, 5))
    r = getattr(vol, op)(axis=(0, 2), dtype=dtype)
    want = getattr(data, op)(axis=(0, 2), dtype=dtype)
    assert "streamed" in r.name and r.dtype == want.dtype
    got = r.compute()
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == "f4" else 1e-12)


def test_hits_come_from_the_cache_and_misses_are_read_once(tmp_path):
    data = np.arange(8 * 6 * 4, dtype="<u2").reshape(8, 6, 4)
    cache = gpulazy.DeviceCache("1 MiB", device="cpu")
    vol = _vol(tmp_path, data, (2, 6, 4), cache=cache)
    vol[2:4].map_blocks(lambda b: b).compute(scheduler="sync")  # one chunk cached
    before = gpulazy.stats().snapshot()["bytes_read"]
    np.testing.assert_array_equal(vol.max(axis=0).compute(), data.max(axis=0))
    assert gpulazy.stats().snapshot()["bytes_read"] - before == 3 * data[:2].nbytes  # the 3 others
    assert cache.stats()["hits"] == 1
    cache.close()


def test_a_reduction_over_more_than_the_cache_holds_keeps_none_of_it(tmp_path):
    """Its chunks would each be copied into the cache and evicted before any reuse: none is offered,
    nothing copied. A reduction that fits fills the cache, and the next one folds it where it lies."""
    data = np.arange(8 * 6 * 4, dtype="<u2").reshape(8, 6, 4)  # 4 chunks of 96 bytes: 384
    for capacity, kept in ((300, False), (400, True)):
        cache = gpulazy.DeviceCache(capacity, device="cpu")
        try:
            vol = _vol(tmp_path, data, (2, 6, 4), cache=cache)
            before = gpulazy.stats().snapshot()["buffers"]["copies"]
            np.testing.assert_array_equal(vol.max(axis=0).compute(), data.max(axis=0))
            copies = gpulazy.stats().snapshot()["buffers"]["copies"] - before
            assert (copies, len(cache), cache.stats()["loads"]) == ((4, 4, 4) if kept else (0, 0, 0))
            read = gpulazy.stats().snapshot()["bytes_read"]
            assert vol.sum().compute() == data.sum()
            assert gpulazy.stats().snapshot()["bytes_read"] - read == (0 if kept else data.nbytes)
        finally:
            cache.close()


def test_dask_reduces_when_asked_or_when_the_arguments_need_it(tmp_path):
    data = np.arange(60, dtype="<u2").reshape(6, 10)
    vol = _vol(tmp_path, data, (2, 5))
    with gpulazy.config.set(fused_reductions=False):
        r = vol.max(axis=0)
        assert "streamed" not in r.name
        np.testing.assert_array_equal(r.compute(), data.max(axis=0))
    r = vol.sum(dtype="u1")  # NumPy sums uint8 in uint64, this sum wraps in uint8: dask's own
    assert "streamed" not in r.name and r.compute() == data.sum(dtype="u1")
    with pytest.raises(TypeError, match="where"):
        np.sum(vol, axis=0, where=data > 3)  # NumPy's parameters the methods lack: dask's (which has none)
    vol2 = vol.copy()
    vol2[0, 0] = 7  # changed in place: no longer the files
    assert "streamed" not in vol2.max().name and vol2.max().compute() == max(7, data.max())


def test_a_stream_sent_to_another_process_between_steps_gives_the_same_result(tmp_path):
    import pickle

    from gpulazy.read.reduce import groups_of, stream_result, stream_start, stream_start_shared, stream_step

    data = np.random.default_rng(6).normal(0, 1, (12, 5, 4)).astype("<f4")
    vol = _vol(tmp_path, data, (1, 5, 4))
    groups = [(s,) for g in groups_of(vol.chunk_index.specs) for s in g]  # a chunk a group: 12 steps
    # (a shared stream too: two reductions folded from the one read, ``share_reads``)
    shared = stream_start_shared(groups, vol.chunk_source, vol.chunks, vol.dtype,
                                 [("max", (0,), 0, None), ("std", (0, 2), 1, "f8")])
    for k in range(len(groups)):
        if k == 5:
            shared = pickle.loads(pickle.dumps(shared))
        shared = stream_step(shared, k)
    np.testing.assert_array_equal(stream_result(shared, False, 0), data.max(axis=0))
    np.testing.assert_allclose(stream_result(shared, True, 1), data.astype("f8").std(axis=(0, 2), ddof=1,
                                                                                       keepdims=True))
    for op, axis in (("max", (0, 2)), ("sum", (0, 2)), ("std", (0, 2)), ("argmax", (0,)), ("argmin", (0, 1, 2))):
        with gpulazy.config.set(read_ahead=3 * 80):  # a few groups in flight when it travels
            stream = stream_start(groups, vol.chunk_source, vol.chunks, vol.dtype, op, axis, 1, None)
            for k in range(len(groups)):
                if k in (4, 9):
                    stream = pickle.loads(pickle.dumps(stream))
                stream = stream_step(stream, k)
        want = getattr(np, op)(data, axis=axis[0] if len(axis) == 1 else None) if op.startswith("arg") else (
            getattr(np, op)(data, axis=axis, **({"ddof": 1} if op == "std" else {})))
        np.testing.assert_allclose(stream_result(stream, False), want, rtol=1e-5)


def test_an_interrupted_reduction_settles_every_read_in_flight_before_it_propagates(tmp_path, monkeypatch):
    """A local compute runs the chain in the calling thread: an interrupt (or a failure) while
    group 0 folds leaves the groups read ahead in flight, and no read may outlive its compute."""
    from gpulazy.read import engine, reduce, whole

    data = np.arange(12 * 5 * 4, dtype="<f4").reshape(12, 5, 4)
    vol = _vol(tmp_path, data, (1, 5, 4))
    monkeypatch.setattr(whole, "GROUP", 1)  # a group per chunk or two: several groups read ahead
    started, start = [], engine.start

    def recorded(*args, **kwargs):
        started.append(start(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(engine, "start", recorded)

    def interrupted(self, spec, chunk):
        raise KeyboardInterrupt

    monkeypatch.setattr(reduce._Accumulator, "fold", interrupted)
    with pytest.raises(KeyboardInterrupt):
        vol.max(axis=0).compute()
    assert len(started) > 1  # groups after the first were in flight
    assert all(reads.outcomes[i] is not engine._PENDING for reads in started for i in range(len(reads)))


def test_a_damaged_file_raises_with_its_path(tmp_path):
    data = np.arange(4 * 8, dtype="<u2").reshape(4, 8)
    vol = _vol(tmp_path, data, (1, 8))
    p = str(tmp_path / "v.raw")
    with open(p, "r+b") as f:
        f.truncate(20)
    with pytest.raises(ChunkReadError) as e:
        vol.mean().compute()
    assert p in str(e.value)


def test_a_compressed_store_streams_too(tmp_path):
    data = np.random.default_rng(3).integers(0, 4000, (10, 12, 9)).astype("<u2")
    p = zstd_zarr(tmp_path / "v.zarr", data, (3, 5, 9))
    vol = gpulazy.from_files(p, device="cpu", cache=False)
    np.testing.assert_array_equal(vol.max(axis=0).compute(), data.max(axis=0))
    np.testing.assert_allclose(vol.mean(axis=(1, 2)).compute(), data.mean(axis=(1, 2)))


def test_groups_of_chunks_that_decode_hold_enough_pieces_for_one_decode_call(tmp_path, monkeypatch):
    """A group of a streamed reduction is one decode call: chunks that decode go in groups of at
    least ``DECODE_GROUP`` stored bytes (nvCOMP needs many pieces a call); stored chunks do not."""
    zarr = pytest.importorskip("zarr")
    from zarr.codecs import ZstdCodec

    from gpulazy.read import reduce, whole
    from gpulazy.read.reduce import groups_of

    monkeypatch.setattr(whole, "GROUP", 2048)
    monkeypatch.setattr(reduce, "DECODE_GROUP", 16384)
    data = np.random.default_rng(6).integers(0, 60000, (32, 32, 16)).astype("<u2")  # 1 KiB a plane
    vols = {}
    for name, compressors in (("zstd", ZstdCodec(level=1)), ("stored", None)):
        p = str(tmp_path / f"{name}.zarr")
        z = zarr.create_array(p, shape=data.shape, chunks=(2, 16, 16), dtype=data.dtype, compressors=compressors)
        z[...] = data
        vols[name] = gpulazy.from_files(p, device="cpu", cache=False, chunks=(2, 16, 16))
    packed = groups_of(vols["zstd"].chunk_index.specs)
    largest = max(s.nbytes for s in vols["zstd"].chunk_index.specs.values())
    # filled up to DECODE_GROUP: no room left in a group but the last for its next chunk
    assert len(packed) >= 2 and all(16384 - largest < sum(s.nbytes for s in g) <= 16384 for g in packed[:-1])
    stored = groups_of(vols["stored"].chunk_index.specs)
    size = max(2048, -(-data.nbytes // reduce.STEPS))  # GROUP, or an eighth of the array
    assert len(stored) > len(packed) and all(sum(s.nbytes for s in g) <= size for g in stored)
    for vol in vols.values():
        np.testing.assert_array_equal(vol.max(axis=0).compute(), data.max(axis=0))


@pytest.mark.parametrize("compressed", [False, True])
def test_a_big_array_reduces_in_more_steps_not_in_bigger_groups(tmp_path, monkeypatch, compressed):
    """Each group is read into memory at once: past ``STEPS`` groups of ``MOST_GROUP`` decoded bytes,
    an array takes more steps (a 200 GB volume in eight groups held 25 GB of reads at once)."""
    zarr = pytest.importorskip("zarr")
    from zarr.codecs import ZstdCodec

    from gpulazy.read import reduce, whole
    from gpulazy.read.reduce import groups_of

    monkeypatch.setattr(whole, "GROUP", 1024)
    monkeypatch.setattr(reduce, "DECODE_GROUP", 1024)
    monkeypatch.setattr(reduce, "MOST_GROUP", 4096)
    data = np.zeros((64, 32, 16), "<u2")  # zeros: compressed, a chunk's bytes shrink a lot
    data[::3] = np.random.default_rng(7).integers(0, 60000, (22, 32, 16))
    p = str(tmp_path / "v.zarr")
    z = zarr.create_array(p, shape=data.shape, chunks=(2, 16, 16), dtype=data.dtype,
                          compressors=ZstdCodec(level=1) if compressed else None)
    z[...] = data
    vol = gpulazy.from_files(p, device="cpu", cache=False, chunks=(2, 16, 16))
    groups = groups_of(vol.chunk_index.specs)
    decoded = [sum(s.out_nbytes for s in g) for g in groups]
    assert len(groups) >= 16 > reduce.STEPS  # 64 KiB in groups of at most 4 KiB decoded
    assert sum(decoded) == data.nbytes and max(decoded) <= 4096
    np.testing.assert_array_equal(vol.max(axis=0).compute(), data.max(axis=0))
    np.testing.assert_allclose(vol.mean(axis=(1, 2)).compute(), data.mean(axis=(1, 2)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("codec", ["zstd", "zlib"])
def test_compressed_groups_decode_on_the_settle_threads_and_fold_in_order(tmp_path, monkeypatch, device, codec):
    """Groups settle on the settle pool, at most ``SETTLERS`` at once for zstd and
    ``STREAM_SETTLERS`` for Deflate (its nvCOMP calls take one stream's time each), and fold in order."""
    import threading

    zarr = pytest.importorskip("zarr")
    from numcodecs.zarr3 import Zlib
    from zarr.codecs import ZstdCodec

    from gpulazy.read import reduce, whole
    from gpulazy.read.reduce import groups_of

    monkeypatch.setattr(whole, "GROUP", 2048)  # a group per chunk or two: many settle at once
    monkeypatch.setattr(reduce, "DECODE_GROUP", 2048)
    data = np.random.default_rng(5).integers(0, 60000, (24, 32, 16)).astype("<u2")
    p = str(tmp_path / "v.zarr")
    z = zarr.create_array(p, shape=data.shape, chunks=(2, 16, 16), dtype=data.dtype,
                          compressors=ZstdCodec(level=1) if codec == "zstd" else Zlib(level=1))
    z[...] = data
    vol = gpulazy.from_files(p, device=device, cache=False, chunks=(2, 16, 16))
    groups = len(groups_of(vol.chunk_index.specs))
    assert groups >= 6  # of at most STEPS (8)
    settled_on: list[str] = []
    lock = threading.Lock()
    running = [0, 0]  # now, most at once
    both = threading.Event()  # set once two settles run together
    settle_later = whole.settle_later

    class Recorded:  # what settle_later settles: the group's reads, noting the thread and how many run
        def __init__(self, reads):
            self.reads = reads

        def settle(self):
            with lock:
                settled_on.append(threading.current_thread().name)
                running[0] += 1
                running[1] = max(running)
                if running[0] >= 2:
                    both.set()
            both.wait(timeout=30)  # the first settle waits for a second beside it (the slots permitting)
            self.reads.settle()
            with lock:
                running[0] -= 1

    def recorded(reads, slots=None):
        return settle_later(Recorded(reads), slots)

    monkeypatch.setattr(whole, "settle_later", recorded)
    np.testing.assert_array_equal(to_host(vol.max(axis=0).compute()), data.max(axis=0))
    # Every group settled (decoded) on the settle pool, not on the step's thread.
    assert len(settled_on) == groups and all(n.startswith("gpulazy-settle") for n in settled_on)
    assert 2 <= running[1] <= (whole.SETTLERS if codec == "zstd" else whole.STREAM_SETTLERS)
    np.testing.assert_allclose(to_host(vol.mean(axis=(1, 2)).compute()), data.mean(axis=(1, 2)))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["argmax", "argmin", "any", "all"])
def test_argmax_argmin_any_all_stream_on_the_gpu(tmp_path, op):
    rng = np.random.default_rng(5)
    data = rng.integers(0, 4, (33, 64, 48)).astype("<f4")
    data.ravel()[rng.integers(0, data.size, 2)] = np.nan
    vol = _vol(tmp_path, data, (8, 32, 48), device="cuda:0")
    for axes in (None, 0, 2):
        r = getattr(vol, op)(axis=axes)
        got = r.compute()
        assert r.compute_path == "fast" and type(got).__module__.startswith("cupy")
        np.testing.assert_array_equal(to_host(got), getattr(np, op)(data, axis=axes))


@pytest.mark.gpu
def test_reductions_computed_together_share_one_read_on_the_gpu(tmp_path):
    data = np.random.default_rng(7).integers(0, 60000, (33, 64, 48)).astype("<u2")
    vol = _vol(tmp_path, data, (8, 32, 48), device="cuda:0")
    before = gpulazy.stats().snapshot()["bytes_read"]
    counts, _ = np.histogram(vol, bins=50, range=(0, 60000))
    lo, hi, mean, depth, counted = dask.compute(vol.min(), vol.max(axis=0), vol.astype("f4").mean(axis=(1, 2)),
                                                vol.argmax(axis=0), counts)
    assert gpulazy.stats().snapshot()["bytes_read"] - before == data.nbytes
    np.testing.assert_array_equal(to_host(counted), np.histogram(data, bins=50, range=(0, 60000))[0])
    assert int(lo) == data.min() and type(hi).__module__.startswith("cupy")
    np.testing.assert_array_equal(to_host(hi), data.max(axis=0))
    np.testing.assert_allclose(to_host(mean), data.astype("f4").mean(axis=(1, 2)), rtol=1e-5)
    np.testing.assert_array_equal(to_host(depth), data.argmax(axis=0))


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_streamed_reductions_on_the_gpu(tmp_path, op):
    data = np.random.default_rng(4).integers(0, 60000, (33, 64, 48)).astype("<u2")
    vol = _vol(tmp_path, data, (8, 32, 48), device="cuda:0")
    for axes in (None, 0, (1, 2)):
        got = to_host(getattr(vol, op)(axis=axes).compute())
        want = getattr(np, op)(data, axis=axes)
        np.testing.assert_allclose(got, want, rtol=1e-6)


# -- a box off the chunk boundaries: read alone, at the read rate ------------------------------

@st.composite
def boxes(draw, steps=False):
    """A shape, a chunking and a box of it: per axis a step-1 slice or an integer (``vol[5]``, a plane);
    ``steps=True``: slices of steps -3 to 4, one of them not 1 (``vol[::4, ::4]``, ``vol[::-1]``), and integers."""
    shape = tuple(draw(st.integers(1, 9)) for _ in range(draw(st.integers(1, 3))))
    chunks = tuple(draw(st.integers(1, n)) for n in shape)
    box = []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        if draw(st.integers(0, 3)) == 0:
            box.append(draw(st.sampled_from([lo, lo - n])))  # an integer, maybe from the end
        else:
            hi = draw(st.integers(lo + 1, n))
            step = draw(st.sampled_from([1, 2, 3, 4, -1, -2, -3])) if steps else None
            # (a negative step picks from ``hi - 1`` down to ``lo``)
            box.append(slice(hi - 1, lo - 1 if lo else None, step) if step and step < 0 else slice(lo, hi, step))
    if steps and all(isinstance(s, int) or s.step == 1 for s in box):  # (a step, on a slice)
        b = box[-1] % shape[-1] if isinstance(box[-1], int) else box[-1].start
        box[-1] = slice(b, shape[-1], 2)
    return shape, chunks, tuple(box)


def _as_slices(box, shape):
    return tuple(slice(b % n, b % n + 1) if isinstance(b, int) else b for b, n in zip(box, shape))


@given(layout=boxes(), cached=st.booleans(), dtype=st.sampled_from(["<u2", ">f8"]))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_box_computes_alone_and_equals_the_file(tmp_path_factory, layout, cached, dtype):
    shape, chunks, box = layout
    data = np.random.default_rng(5).integers(0, 999, shape).astype(dtype)
    cache = gpulazy.DeviceCache("1 MiB", device="cpu") if cached else False
    vol = _vol(tmp_path_factory.mktemp("b"), data, chunks, cache=cache)
    if cached:
        vol[tuple(slice(0, c) for c in chunks)].map_blocks(lambda b: b).compute(scheduler="sync")
        assert cache.stats()["entries"] == 1  # the first chunk cached
    before = gpulazy.stats().snapshot()["bytes_read"]
    part = vol[box]
    got = part.compute()
    if all(isinstance(b, int) for b in box):  # one element: dask's, a scalar
        assert not isinstance(part, type(vol)) and np.ndim(got) == 0
    else:
        assert part.compute_path == "fast" and got.shape == data[box].shape
    np.testing.assert_array_equal(got, data[box])
    assert got.dtype == data.dtype.newbyteorder("=")
    edges = [range(0, n, c) for n, c in zip(shape, chunks)]
    touched = 1
    for e, c, s in zip(edges, chunks, _as_slices(box, shape)):
        touched *= sum(1 for lo in e if lo < s.stop and lo + c > s.start)
    read = gpulazy.stats().snapshot()["bytes_read"] - before
    assert read <= touched * np.prod(chunks) * data.itemsize  # only the chunks the box meets
    np.testing.assert_array_equal((part * 1).compute(), data[box] * 1)  # dask's path agrees
    if cached:
        cache.close()


@given(steps=st.booleans(), data=st.data(),
       op=st.sampled_from(["compute", "max", "sum", "mean", "std", "map", "map_max", "times2", "astype_sum"]),
       axis=st.sampled_from([None, 0, -1]), cached=st.booleans())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_what_is_computed_from_a_box_or_a_step_streams_and_equals_numpy(tmp_path_factory, steps, data, op, axis,
                                                                       cached):
    """A box's (``vol[3:40]``), a plane's (``vol[5]``) or a step's (``vol[::4, ::4]``) reductions, maps
    and elementwise operations (and a step's ``compute()``) run as a streamed map of the chunks it picks
    from, each cut to it: no dask task a chunk, only those chunks read, values as NumPy's."""
    shape, chunks, box = data.draw(boxes(steps=steps), label="layout")
    assume(not all(isinstance(b, int) for b in box))  # (one element: dask's, a scalar)
    values = np.random.default_rng(7).integers(0, 999, shape).astype("<u2")
    cache = gpulazy.DeviceCache("1 MiB", device="cpu") if cached else False
    vol = _vol(tmp_path_factory.mktemp("bx"), values, chunks, cache=cache)
    part, want = vol[box], values[box]
    made = {
        "compute": (lambda v: v.map_blocks(lambda b: b) if not steps else v, lambda d: d),
        "max": (lambda v: v.max(axis=axis), lambda d: d.max(axis=axis)),
        "sum": (lambda v: v.sum(axis=axis), lambda d: d.sum(axis=axis)),
        "mean": (lambda v: v.mean(axis=axis), lambda d: d.mean(axis=axis)),
        "std": (lambda v: v.std(axis=axis), lambda d: d.std(axis=axis)),
        "map": (lambda v: v.map_blocks(np.sqrt, dtype="f4"), np.sqrt),
        "map_max": (lambda v: v.map_blocks(lambda b: b + 1).max(axis=axis), lambda d: (d + 1).max(axis=axis)),
        "times2": (lambda v: v * 2, lambda d: d * 2),
        "astype_sum": (lambda v: v.astype("f8").sum(axis=axis), lambda d: d.astype("f8").sum(axis=axis)),
    }
    ours, numpys = made[op]
    try:
        if not all(all(c) for c in part.chunks):  # dask's slicing kept an empty block: its own tasks
            assert steps and type(part) is not type(vol)  # (whose reductions over it may fail in dask's concatenate)
            np.testing.assert_array_equal(part.compute(scheduler="sync"), want)
            return
        r = ours(part)
        assert isinstance(r, type(vol))
        before = gpulazy.stats().snapshot()["bytes_read"]
        got = r.compute(scheduler="sync")
        assert r.compute_path == "fast"
        np.testing.assert_allclose(got, numpys(want), rtol=1e-6)
        picked = 1
        for n, c, s in zip(shape, chunks, _as_slices(box, shape)):
            picked *= sum(1 for lo in range(0, n, c) if any(lo <= i < lo + c for i in range(n)[s]))
        assert gpulazy.stats().snapshot()["bytes_read"] - before <= picked * np.prod(chunks) * 2
    finally:
        if cached:
            cache.close()


@given(layout=boxes(), data=st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_box_of_a_box_is_a_box_of_the_files(tmp_path_factory, layout, data):
    shape, chunks, outer = layout
    outer = _as_slices(outer, shape)  # (a box that keeps its axes)
    values = np.random.default_rng(9).integers(0, 999, shape).astype("<u2")
    vol = _vol(tmp_path_factory.mktemp("bb"), values, chunks)
    part = vol[outer]
    inner = []
    step = data.draw(st.sampled_from([1, 1, 2, 3]), label="step")  # (a step of a box: ``vol[3:30][::2]``)
    for s in outer:
        n = s.stop - s.start
        lo = data.draw(st.integers(0, n - 1))
        cut = slice(lo, data.draw(st.integers(lo + 1, n)), step)
        inner.append(cut if step > 1 else data.draw(st.sampled_from([lo, cut])))
    inner = tuple(inner)
    got = part[inner]
    want = values[outer][inner]
    if all(isinstance(i, int) for i in inner):
        assert np.array_equal(got.compute(), want)  # one element: dask's
        return
    if not all(all(c) for c in got.chunks):  # dask's slicing kept an empty block: its own tasks
        np.testing.assert_array_equal(got.compute(), want)
        return
    assert isinstance(got, type(vol))
    np.testing.assert_array_equal(got.compute(), want)
    assert got.compute_path == "fast"
    np.testing.assert_array_equal(got.sum(axis=0).compute(), want.sum(axis=0))


def test_every_other_plane_of_a_stack_reads_every_other_file(tmp_path):
    data = np.random.default_rng(11).integers(0, 999, (10, 6, 5)).astype("<u2")
    paths = []
    for z, plane in enumerate(data):
        paths.append(str(tmp_path / f"z{z:02d}.raw"))
        plane.tofile(paths[-1])
    vol = gpulazy.from_files(paths, shape=(6, 5), dtype="<u2", chunks=(1, 6, 5), device="cpu", cache=False)
    before = gpulazy.stats().snapshot()["bytes_read"]
    half = vol[::2]
    np.testing.assert_array_equal(half.compute(), data[::2])
    assert half.compute_path == "fast" and gpulazy.stats().snapshot()["bytes_read"] - before == data[::2].nbytes
    with gpulazy.config.set(streamed_maps=False):  # dask's getitem
        assert type(vol[::2]) is not type(vol)


@pytest.mark.gpu
def test_a_box_s_reductions_and_maps_stream_on_the_gpu(tmp_path):
    data = np.random.default_rng(8).integers(0, 60000, (37, 40, 24)).astype("<u2")
    vol = _vol(tmp_path, data, (8, 16, 24), device="cuda:0")
    part = vol[3:30, 5:33]
    for r, want in ((part.max(axis=0), data[3:30, 5:33].max(axis=0)),
                    (part.astype("f4").mean(axis=(1, 2)), data[3:30, 5:33].astype("f4").mean(axis=(1, 2))),
                    ((part * 2).sum(axis=0), (data[3:30, 5:33] * 2).sum(axis=0)),
                    (part.map_blocks(lambda b: b // 3), data[3:30, 5:33] // 3),
                    (vol[::3, ::2, 1::5], data[::3, ::2, 1::5]), (vol[::4].max(axis=0), data[::4].max(axis=0)),
                    (vol[7].max(), data[7].max()), (vol[:, 9].astype("f8").std(axis=0), data[:, 9].std(axis=0)),
                    (vol[5, ::2, ::3], data[5, ::2, ::3]), (vol[20] - 7, data[20] - 7),
                    (vol[::-1, :, ::-2], data[::-1, :, ::-2]), (vol[30:2:-3].max(axis=0), data[30:2:-3].max(axis=0))):
        got = r.compute()
        assert r.compute_path == "fast" and type(got).__module__.startswith("cupy")
        np.testing.assert_allclose(to_host(got), want, rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_box_cut_along_axis_0_reads_only_its_planes(tmp_path, device):
    data = np.random.default_rng(6).integers(0, 999, (40, 6, 5)).astype(">u2")
    vol = _vol(tmp_path, data, (16, 6, 5), device=device)  # chunks of planes 0-15, 16-31, 32-39
    before = gpulazy.stats().snapshot()["bytes_read"]
    got = to_host(vol[3:35].compute())
    assert gpulazy.stats().snapshot()["bytes_read"] - before == 32 * 6 * 5 * 2  # planes 3-34, no more
    np.testing.assert_array_equal(got, data[3:35])
    # Cut across axis 1 too: the same planes are read, and the part of them the box needs copied out.
    before = gpulazy.stats().snapshot()["bytes_read"]
    np.testing.assert_array_equal(to_host(vol[3:35, 1:4].compute()), data[3:35, 1:4])
    assert gpulazy.stats().snapshot()["bytes_read"] - before == 32 * 6 * 5 * 2
    # What is computed from the box reads its planes alone too (its cut along axis 1 made after the read).
    for made, want in ((vol[3:35].max(axis=0), data[3:35].max(axis=0)),
                       ((vol[3:35, 1:4] * 2).sum(axis=0), (data[3:35, 1:4] * 2).sum(axis=0))):
        before = gpulazy.stats().snapshot()["bytes_read"]
        np.testing.assert_array_equal(to_host(made.compute()), want)
        assert made.compute_path == "fast"
        assert gpulazy.stats().snapshot()["bytes_read"] - before == 32 * 6 * 5 * 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_plane_reads_only_its_bytes_and_drops_its_axis(tmp_path, device):
    data = np.random.default_rng(6).integers(0, 999, (40, 6, 5)).astype(">u2")
    vol = _vol(tmp_path, data, (16, 6, 5), device=device)
    for index, nbytes in ((20, 60), (-1, 60), ((slice(None), 2), 40 * 60), ((7, slice(1, 3)), 60)):
        before = gpulazy.stats().snapshot()["bytes_read"]
        plane = vol[index]
        got = plane.compute()
        assert plane.compute_path == "fast"
        assert type(got) is type(vol._meta) and got.shape == data[index].shape
        np.testing.assert_array_equal(to_host(got), data[index])
        # A plane across axis 0 is its own bytes, cut along later axes too; one across axis 1 reads the
        # chunks it meets whole.
        assert gpulazy.stats().snapshot()["bytes_read"] - before == nbytes
        # What is computed from it streams (``vol[20].max()``), reading the same.
        before = gpulazy.stats().snapshot()["bytes_read"]
        peak = plane.max()
        assert to_host(peak.compute()) == data[index].max() and peak.compute_path == "fast"
        assert gpulazy.stats().snapshot()["bytes_read"] - before == nbytes


def test_a_box_s_reduction_over_cached_chunks_reads_nothing(tmp_path):
    """A box cut along axis 0 reads its planes alone, unless the cache holds their chunk: then it is
    served from there (a part read on its own would have a key of its own, and be read again)."""
    data = np.random.default_rng(6).integers(0, 999, (40, 6, 5)).astype("<u2")
    cache = gpulazy.DeviceCache("1 MiB", device="cpu")
    try:
        vol = _vol(tmp_path, data, (16, 6, 5), cache=cache)
        vol.sum().compute()  # every chunk cached
        before = gpulazy.stats().snapshot()["bytes_read"]
        np.testing.assert_array_equal(vol[3:35].max(axis=0).compute(), data[3:35].max(axis=0))
        assert gpulazy.stats().snapshot()["bytes_read"] == before
    finally:
        cache.close()


def test_a_box_submits_its_whole_chunks_before_working_out_the_parts_it_cuts(tmp_path, monkeypatch):
    # The parts of the chunks a box cuts (``ChunkSpec.planes``) are made as the submissions reach
    # them, while the whole chunks' reads are in flight: on a Zarr volume of 16 stored chunks a
    # block they were most of the host's time before the first read.
    from gpulazy.read import engine, whole
    from gpulazy.spec import ChunkSpec

    data = np.random.default_rng(7).integers(0, 999, (64, 6, 5)).astype("<u2")
    vol = _vol(tmp_path, data, (16, 6, 5))  # a box [3:35] cuts chunks 0 and 2, holds chunk 1
    made, submitted = [], []
    real_planes, real_start = ChunkSpec.planes, engine.start
    monkeypatch.setattr(ChunkSpec, "planes", lambda self, rows: made.append(self.index) or real_planes(self, rows))
    monkeypatch.setattr(engine, "start", lambda specs, *a, **k: submitted.append(
        ([s.index for s in specs], len(made))) or real_start(specs, *a, **k))
    monkeypatch.setattr(whole, "GROUP", 1)  # a submission per chunk
    np.testing.assert_array_equal(vol[3:35].compute(), data[3:35])
    assert submitted[0] == ([(1, 0, 0)], 1)  # the whole chunk first, one part made (to close its group)
    assert sorted(i for ids, _ in submitted for i in ids) == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    assert sorted(made) == [(0, 0, 0), (2, 0, 0)]


@given(planes=st.integers(2, 40), stored=st.tuples(st.integers(1, 12), st.integers(1, 7), st.integers(1, 9)),
       lo=st.integers(0, 39), n=st.integers(1, 40), missing=st.booleans())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_box_of_gathered_zarr_chunks_reads_only_its_planes(tmp_path_factory, planes, stored, lo, n, missing):
    """Uncompressed Zarr chunks gathered into one array chunk (tiles): a box cut along axis 0 reads
    each stored chunk's planes it needs, and equals zarr-python (missing chunks read as the fill)."""
    zarr = pytest.importorskip("zarr")
    lo = min(lo, planes - 1)
    hi = min(planes, lo + n)
    data = np.random.default_rng(planes).integers(0, 999, (planes, 7, 9)).astype("<u2")
    p = str(tmp_path_factory.mktemp("z") / "v.zarr")
    z = zarr.create_array(p, shape=data.shape, chunks=stored, dtype="<u2", compressors=None, fill_value=5)
    z[...] = data
    if missing:  # one stored chunk never written
        z[:stored[0], :stored[1], :stored[2]] = 5
    want = z[...]
    vol = gpulazy.from_files(p, device="cpu", cache=False, chunks=(planes, 7, 9))  # one chunk of tiles
    before = gpulazy.stats().snapshot()["bytes_read"]
    got = vol[lo:hi].compute()
    np.testing.assert_array_equal(got, want[lo:hi])
    tile_plane = stored[1] * stored[2] * 2  # bytes of one plane of a stored chunk (edge ones are whole too)
    tiles_per_plane = -(-7 // stored[1]) * -(-9 // stored[2])
    # A box over the whole array chunk reads its stored chunks whole, the planes Zarr stores past
    # the array's edge included (an edge chunk of 3 planes for 2); a cut box reads its planes only.
    read_planes = -(-planes // stored[0]) * stored[0] if (lo, hi) == (0, planes) else hi - lo
    assert gpulazy.stats().snapshot()["bytes_read"] - before <= read_planes * tile_plane * tiles_per_plane


def test_a_box_with_verify_reads_whole_chunks(tmp_path):
    from gpulazy import checksums

    data = np.arange(40 * 6, dtype="<u2").reshape(40, 6)
    p = str(tmp_path / "v.raw")
    data.tofile(p)
    checksums.write_manifest([p])
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(16, 6), device="cpu", cache=False, verify=True)
    before = gpulazy.stats().snapshot()["bytes_read"]
    np.testing.assert_array_equal(vol[3:35].compute(), data[3:35])
    assert gpulazy.stats().snapshot()["bytes_read"] - before == 40 * 6 * 2  # checksums cover whole chunks
    before = gpulazy.stats().snapshot()["bytes_read"]
    mip = vol[3:35].max(axis=0)
    np.testing.assert_array_equal(mip.compute(), data[3:35].max(axis=0))
    assert mip.compute_path == "fast" and gpulazy.stats().snapshot()["bytes_read"] - before == 40 * 6 * 2


@given(src=st.sampled_from(["<u2", ">i4", "<f4", "<f8", "u1"]), cast=st.sampled_from(["f8", "f4", "i8", "u1"]),
       op=st.sampled_from(OPS), layout=layouts())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_reduction_after_astype_equals_numpy_on_the_cast_array(tmp_path_factory, src, cast, op, layout):
    shape, chunks, axes = layout
    data = np.random.default_rng(7).integers(0, 250, shape).astype(src)
    vol = _vol(tmp_path_factory.mktemp("c"), data, chunks)
    r = getattr(vol.astype(cast), op)(axis=axes)
    assert "streamed" in r.name
    want = getattr(np, op)(data.astype(cast), axis=axes)
    got = r.compute()
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # The cast array itself (its graph built by gpulazy, not by dask's ``astype``) is the cast data,
    # block by block and through other ops, named by what it casts.
    c = vol.astype(cast)
    assert c.dtype == np.dtype(cast) and c.chunks == vol.chunks and c.name == vol.astype(cast).name
    assert c.name != vol.astype("f2").name
    np.testing.assert_array_equal(c.compute(), data.astype(cast))
    np.testing.assert_array_equal((c[tuple(slice(0, n) for n in chunks)] * 1).compute(),
                                  data.astype(cast)[tuple(slice(0, n) for n in chunks)])


# -- the first planes of a zstd chunk: decoded alone, from a head of its bytes -------------------

def _zstd_vol(tmp_path, data, chunks, device="cpu", checksum=False, gathered=False):
    zarr = pytest.importorskip("zarr")
    from zarr.codecs import ZstdCodec

    p = str(tmp_path / "z.zarr")
    z = zarr.create_array(p, shape=data.shape, chunks=chunks, dtype=data.dtype,
                          compressors=ZstdCodec(level=1, checksum=checksum))
    z[...] = data
    # gathered: the default dask chunks, unions of stored chunks (each a tile of one array chunk)
    return p, gpulazy.from_files(p, device=device, cache=False, chunks=None if gathered else chunks)


def _read(vol, box):
    before = gpulazy.stats().snapshot()["bytes_read"]
    got = to_host(vol[box].compute())
    return got, gpulazy.stats().snapshot()["bytes_read"] - before


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_planes_of_a_zstd_chunk_decode_from_a_head_of_its_bytes(tmp_path, device, gathered):
    from gpulazy.spec import head_allowance

    data = np.random.default_rng(7).integers(0, 999, (48, 128, 128)).astype("<u2")
    p, vol = _zstd_vol(tmp_path, data, (16, 128, 128), device, gathered=gathered)
    assert len(vol.chunks[0]) == (1 if gathered else 3)
    stored = [(tmp_path / "z.zarr" / "c" / str(i) / "0" / "0").stat().st_size for i in range(3)]
    plane = 128 * 128 * 2
    assert head_allowance(2 * plane) < min(stored)  # so a head reads less than its chunk
    got, read = _read(vol, np.s_[17:18])  # planes 16-17 decode, from 194 KiB of the 350 KiB stored
    np.testing.assert_array_equal(got, data[17:18])
    assert read == head_allowance(2 * plane)
    got, read = _read(vol, np.s_[16:17, 3:90, 5:60])  # the first plane, then its box copied out
    np.testing.assert_array_equal(got, data[16:17, 3:90, 5:60])
    assert read == head_allowance(plane)
    got, read = _read(vol, np.s_[32:33])  # the first plane, decoded straight into the result
    np.testing.assert_array_equal(got, data[32:33])
    assert read == head_allowance(plane)
    got, read = _read(vol, np.s_[5:33])  # cut at both ends
    np.testing.assert_array_equal(got, data[5:33])
    # Stored chunk by stored chunk, the first (cut after its planes 0-4) is read whole, the last
    # (cut after its first plane) from a head; one array chunk of all three reads them whole.
    assert read == (sum(stored) if gathered else stored[0] + stored[1] + head_allowance(plane))
    # What is made of a box or a plane streams over the same reads (``vol[17].max()``).
    for box, nbytes in ((np.s_[17], head_allowance(2 * plane)), (np.s_[5:33], read)):
        before = gpulazy.stats().snapshot()["bytes_read"]
        assert to_host(vol[box].max().compute()) == data[box].max()
        assert gpulazy.stats().snapshot()["bytes_read"] - before == nbytes


def test_a_box_of_a_zstd_zarr_reads_its_cut_chunks_first_and_its_heads_last_without_a_slot(tmp_path, monkeypatch):
    # Heads decode on the host's cores: submitted first, they decoded while the whole chunks' reads
    # kept those cores busy (35 ms for 64 heads on an H200) and held a settle slot the last nvCOMP
    # call then waited for. Last, they land when the cores are free and settle beside nvCOMP's calls.
    from gpulazy.read import engine, whole

    data = np.random.default_rng(11).integers(0, 999, (48, 32, 32)).astype("<u2")
    _, vol = _zstd_vol(tmp_path, data, (16, 32, 32))  # a box [3:33] cuts chunks 0 and 2 (a head), holds chunk 1
    submitted, slotted = [], []
    real_start, real_later = engine.start, whole.settle_later
    monkeypatch.setattr(engine, "start", lambda specs, *a, **k: submitted.append(
        [(s.index, s.is_head) for s in specs]) or real_start(specs, *a, **k))
    monkeypatch.setattr(whole, "settle_later", lambda reads, slots=None: slotted.append(
        (all(s.is_head for s in reads.specs), slots is not None)) or real_later(reads, slots))
    monkeypatch.setattr(whole, "GROUP", 1)  # a submission per chunk
    np.testing.assert_array_equal(vol[3:33].compute(), data[3:33])
    # the cut chunk first (copied in part as it lands), the chunk held whole next, the head last
    assert submitted == [[((0, 0, 0), False)], [((1, 0, 0), False)], [((2, 0, 0), True)]]
    assert slotted == [(False, True), (False, True), (True, False)]


@given(layout=boxes(), short=st.booleans(), checksum=st.booleans(), gathered=st.booleans())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_box_of_a_zstd_zarr_equals_the_file(tmp_path_factory, layout, short, checksum, gathered):
    """Heads that run short (a stored allowance of a few bytes) and frames with a checksum (which a head
    cannot check) read their chunks whole instead (the engine does: ``Reads._whole_instead``): the box,
    and its max as a streamed map of heads, equal the data either way, with a dask chunk per stored
    chunk or the stored chunks gathered as tiles (edge ones stored whole, cropped)."""
    shape, chunks, box = layout
    data = np.random.default_rng(len(shape)).integers(0, 999, shape).astype("<u2")
    _, vol = _zstd_vol(tmp_path_factory.mktemp("z"), data, chunks, checksum=checksum, gathered=gathered)
    with pytest.MonkeyPatch.context() as mp:
        if short:
            mp.setattr(gpulazy.spec, "head_allowance", lambda n: 1 + n // 8)
        got, _ = _read(vol, box)
        peak = vol[box].max()
        assert to_host(peak.compute()) == data[box].max()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_head_of_a_checksummed_frame_reads_the_chunk_and_checks_it(tmp_path, device):
    data = np.random.default_rng(8).integers(0, 999, (32, 128, 128)).astype("<u2")
    p, vol = _zstd_vol(tmp_path, data, (16, 128, 128), device, checksum=True)
    got, read = _read(vol, np.s_[16:17])
    np.testing.assert_array_equal(got, data[16:17])
    chunk = tmp_path / "z.zarr" / "c" / "1" / "0" / "0"
    assert read >= chunk.stat().st_size  # the chunk, whole (after its head)
    blob = bytearray(chunk.read_bytes())
    blob[-10] ^= 0xFF  # past any head: only the frame's checksum can tell
    chunk.write_bytes(bytes(blob))
    vol = gpulazy.from_files(p, device=device, cache=False)
    with pytest.raises(gpulazy.errors.ChunkDecodeError, match=str(chunk)):
        vol[16:17].compute()
    with pytest.raises(gpulazy.errors.ChunkDecodeError, match=str(chunk)):  # the whole read checks it too
        vol.compute()  # (nvCOMP verifies no checksum: such frames decode on the host, on a GPU too)


def test_a_head_whose_frame_declares_another_size_raises_naming_the_file(tmp_path):
    numcodecs = pytest.importorskip("numcodecs")
    data = np.random.default_rng(9).integers(0, 999, (32, 128, 128)).astype("<u2")
    p, vol = _zstd_vol(tmp_path, data, (16, 128, 128))
    chunk = tmp_path / "z.zarr" / "c" / "1" / "0" / "0"
    chunk.write_bytes(bytes(numcodecs.Zstd(level=1).encode(data[16:18])))  # two planes, not sixteen
    vol = gpulazy.from_files(p, device="cpu", cache=False)
    with pytest.raises(gpulazy.errors.ChunkDecodeError, match=f"{chunk}.*says it decodes to {2 * 128 * 128 * 2}"):
        vol[16:17].compute()


@pytest.mark.parametrize("spec, stop", [
    (dict(codec=(Codec("zstd"), Codec("shuffle"))), 1),  # a filter after it needs every byte
    (dict(codec=(Codec("crc32c"), Codec("zstd"))), 1),  # a checksum covers every byte
    (dict(codec=(Codec("zlib"),)), 1),  # its trailer's checksum too
    (dict(codec=(Codec("zstd"),), order="F"), 1),
    (dict(codec=(Codec("zstd"),)), 4),  # the whole chunk
    (dict(codec=None), 1),  # stored as is: ChunkSpec.leading reads its planes
])
def test_a_head_is_only_for_the_first_planes_of_a_chunk_zstd_alone_compresses(spec, stop):
    c = ChunkSpec((ByteRange("f", 0, 1 << 20),), (4, 256, 256), "<u2", **spec)
    assert c.head(0, stop) is None
    assert ChunkSpec((ByteRange("f", 0, 1 << 20),), (4, 256, 256), "<u2", codec=(Codec("zstd"),)).head(0, stop - 1 or 3)



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_frame_that_does_not_say_its_size_is_read_whole_and_its_size_checked(tmp_path, device):
    """A head cannot tell a frame decodes to the chunk's size unless its header says so: without
    that, the chunk is read whole, which decodes it (or, too long, raises naming the file)."""
    zstandard = pytest.importorskip("zstandard")
    data = np.random.default_rng(14).integers(0, 999, (32, 128, 128)).astype("<u2")
    p, _ = _zstd_vol(tmp_path, data, (16, 128, 128))
    chunk = tmp_path / "z.zarr" / "c" / "1" / "0" / "0"
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False)
    chunk.write_bytes(unsized.compress(data[16:32].tobytes()))
    vol = gpulazy.from_files(p, device=device, cache=False)
    got, read = _read(vol, np.s_[17:18])
    np.testing.assert_array_equal(got, data[17:18])
    assert read >= chunk.stat().st_size  # read whole (after the head)
    chunk.write_bytes(unsized.compress(data[16:32].tobytes() + bytes(64)))  # decodes 64 bytes long
    vol = gpulazy.from_files(p, device=device, cache=False)
    with pytest.raises(gpulazy.errors.ChunkDecodeError, match=str(chunk)):
        vol[17:18].compute()


def test_a_reused_decompressor_decodes_each_head_from_its_own_frame():
    """Heads stop inside their frames; the thread's decompressor starts each next frame afresh."""
    numcodecs = pytest.importorskip("numcodecs")
    from gpulazy.codecs.host import _zstd_head

    rng = np.random.default_rng(15)
    raw = [rng.integers(0, 4096, 1 << 20, dtype="u2").tobytes() for _ in range(3)]
    frames = [np.frombuffer(numcodecs.Zstd(level=1).encode(r), np.uint8) for r in raw]
    for k, n in [(0, 300_000), (1, 5), (2, 1 << 20), (0, 131_073), (1, 2 << 20)]:
        out = np.empty(n, np.uint8)
        assert _zstd_head(frames[k], out) == n
        assert out.tobytes() == raw[k][:n], (k, n)


def test_a_plane_of_an_hdf5_zstd_chunk_decodes_from_a_head_too(tmp_path):
    h5py = pytest.importorskip("h5py")
    hdf5plugin = pytest.importorskip("hdf5plugin")
    from gpulazy.spec import head_allowance

    data = np.random.default_rng(17).integers(0, 999, (32, 128, 128)).astype("<u2")
    p = str(tmp_path / "z.h5")
    with h5py.File(p, "w") as f:
        f.create_dataset("d", data=data, chunks=(16, 128, 128), **hdf5plugin.Zstd(clevel=1))
        stored = f["d"].id.get_chunk_info(1).size  # planes 16..31
    vol = gpulazy.from_files(p, dataset="d", device="cpu", cache=False)
    got, read = _read(vol, np.s_[17:18])
    np.testing.assert_array_equal(got, data[17:18])
    assert read == head_allowance(2 * 128 * 128 * 2) < stored


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_a_box_cutting_several_missing_chunks_fills_each(tmp_path, scheduler):
    """Missing chunks read as the fill value share one key (their bytes are the same): a box cutting
    several of them read the key once and copied it to one place only, leaving the others as
    uninitialised memory (found by fuzzing the partial reads). Every place gets its copy."""
    import h5py
    import zarr

    path = str(tmp_path / "a.h5")
    with h5py.File(path, "w") as h:
        ds = h.create_dataset("data", shape=(2, 8, 8), dtype="<i4", chunks=(2, 4, 4), fillvalue=3)
        ds[:, 4:, 4:] = 5  # chunks (0, 0, 0), (0, 0, 1) and (0, 1, 0) never written
    with h5py.File(path, "r") as h:
        ref = h["data"][()]
    vol = gpulazy.from_files(path, dataset="/data", device="cpu", cache=False, chunks=(2, 4, 4))
    for box in [(slice(0, 2), slice(0, 3)), (slice(1, 2), slice(1, 7), slice(2, 7)), (slice(0, 2), slice(3, 5))]:
        for _ in range(3):  # (uninitialised memory may happen to hold the right values once)
            np.testing.assert_array_equal(vol[box].compute(scheduler=scheduler), ref[box], err_msg=str(box))
    store = str(tmp_path / "a.zarr")
    data = np.full((8, 8), 7, "u2")
    data[6:, 4:] = 5
    z = zarr.create_array(store, shape=(8, 8), chunks=(2, 4), shards=(8, 8), dtype="u2", fill_value=7,
                          config={"write_empty_chunks": False})
    z[...] = data  # one shard; 7 of its 8 inner chunks are not stored
    sharded = gpulazy.from_files(store, device="cpu", cache=False, chunks=(2, 4))
    for box in [(slice(0, 8), slice(1, 3)), (slice(1, 7), slice(2, 6))]:
        for _ in range(3):
            np.testing.assert_array_equal(sharded[box].compute(scheduler=scheduler), data[box], err_msg=str(box))


# -- a list of planes: each run of them a box, all read in one pass --------------------------

@st.composite
def picks(draw):
    """A shape, a chunking and an index picking planes by a list (or a mask) along one axis, the other
    axes step-1 slices or integers."""
    shape = tuple(draw(st.integers(1, 9)) for _ in range(draw(st.integers(1, 3))))
    chunks = tuple(draw(st.integers(1, n)) for n in shape)
    axis = draw(st.integers(0, len(shape) - 1))
    n = shape[axis]
    if draw(st.integers(0, 4)) == 0:
        mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        assume(mask.any())
        listed = mask
    else:
        listed = draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=7))
    index = []
    for a, m in enumerate(shape):
        if a == axis:
            index.append(listed)
        elif draw(st.integers(0, 3)) == 0:
            index.append(draw(st.integers(-m, m - 1)))
        else:
            lo = draw(st.integers(0, m - 1))
            index.append(slice(lo, draw(st.integers(lo + 1, m))))
    return shape, chunks, tuple(index)


@given(layout=picks(), cached=st.booleans(), zarr_store=st.booleans())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_list_of_planes_computes_alone_and_equals_dask(tmp_path_factory, layout, cached, zarr_store):
    """Values and shape are dask's (which picks orthogonally: NumPy's differ where integers are not beside
    the list, ``vol[0, :, [1, 2]]``), from a read of the planes alone."""
    import dask.array as da

    shape, chunks, index = layout
    data = np.random.default_rng(9).integers(0, 60000, shape).astype("<u2")
    want = da.from_array(data, chunks=chunks)[index].compute()
    assume(want.size > 1)
    tmp = tmp_path_factory.mktemp("p")
    if zarr_store:  # chunks that decode, cut by the boxes (read once however many boxes cut them)
        vol = gpulazy.from_files(zstd_zarr(tmp / "v.zarr", data, chunks), device="cpu", cache=cached)
    else:
        vol = _vol(tmp, data, chunks, cache=cached)
    for _ in range(2 if cached else 1):  # (cached: the second time from the cache)
        part = vol[index]
        got = part.compute()
        assert part.compute_path == "fast"
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    (through_dask,) = dask.compute(part)  # the graph is dask's own
    np.testing.assert_array_equal(through_dask, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_list_of_planes_reads_only_them_and_each_chunk_it_cuts_once(tmp_path, device):
    data = np.random.default_rng(6).integers(0, 999, (40, 6, 5)).astype(">u2")
    vol = _vol(tmp_path, data, (16, 6, 5), device=device)  # chunks of planes 0-15, 16-31, 32-39
    plane = 6 * 5 * 2
    for index, nbytes in (([3, 4, 20, 39], 4 * plane),  # three boxes: [3:5], [20:21], [39:40]
                          ([39, 3], 2 * plane),
                          (np.arange(40) % 3 == 0, 14 * plane),
                          ((slice(None), [1, 4]), 40 * plane),  # every chunk cut by two boxes: read once
                          ((slice(5, 9), [5, 0], 2), 4 * plane)):
        before = gpulazy.stats().snapshot()["bytes_read"]
        part = vol[index]
        got = part.compute()
        assert part.compute_path == "fast" and type(got) is type(vol._meta)
        np.testing.assert_array_equal(to_host(got), data[index])
        assert gpulazy.stats().snapshot()["bytes_read"] - before == nbytes, index
    # Its dask graph: a block for each stretch of the list in one chunk, cut from that chunk's task.
    part = vol[[3, 4, 20, 39, 38]]
    assert part.chunks[0] == (2, 1, 2) and len(part.__dask_graph__()) > 3
    np.testing.assert_array_equal(to_host(dask.compute(part)[0]), data[[3, 4, 20, 39, 38]])


@given(layout=picks(), op=st.sampled_from(["max0", "sum", "mean", "times2", "map_max"]), zarr_store=st.booleans())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_what_is_computed_from_a_list_of_planes_streams_and_equals_dask(tmp_path_factory, layout, op, zarr_store):
    """``vol[[3, 9, 27]].max(axis=0)`` streams (a map of the parts of its chunks, a block for each stretch of
    the list in one chunk, ``_pick_as_map``), each chunk read once, and where its chunks are stored as is,
    the planes alone (listed twice, read twice); a list that comes back to a compressed chunk it left, or
    along a later axis, is dask's. Values as dask's."""
    import dask.array as da

    shape, chunks, index = layout
    data = np.random.default_rng(4).integers(0, 60000, shape).astype("<u2")
    made = {"max0": lambda v: v.max(axis=0), "sum": lambda v: v.sum(), "mean": lambda v: v.mean(),
            "times2": lambda v: v * 2, "map_max": lambda v: v.map_blocks(lambda b: b + 1).max()}[op]
    picked = da.from_array(data, chunks=chunks)[index]
    assume(picked.size > 1 and picked.ndim > 0)
    want = made(picked).compute()
    tmp = tmp_path_factory.mktemp("pm")
    if zarr_store:
        vol = gpulazy.from_files(zstd_zarr(tmp / "v.zarr", data, chunks), device="cpu", cache=False)
    else:
        vol = _vol(tmp, data, chunks)
    r = made(vol[index])
    before = gpulazy.stats().snapshot()["bytes_read"]
    got = r.compute(scheduler="sync")
    np.testing.assert_allclose(got, want, rtol=1e-6)
    axis = next(a for a, ix in enumerate(index) if isinstance(ix, (list, np.ndarray)))
    listed = np.asarray(index[axis])
    positions = np.flatnonzero(listed) if listed.dtype == bool else listed % shape[axis]
    stretches = [c for k, c in enumerate(positions // chunks[axis]) if k == 0 or c != positions[k - 1] // chunks[axis]]
    back = len(stretches) != len(set(stretches))  # a chunk the list comes back to: read again for its planes
    # where stored as is (or never written) and listed along axis 0, else dask's graph, which reads it once
    if not back:  # each chunk once (a compressed one's stored bytes may be more than its values')
        assert r.compute_path == "fast"
        assert gpulazy.stats().snapshot()["bytes_read"] - before <= vol.nbytes * (2 if zarr_store else 1) + 4096
    if axis == 0 and not zarr_store:
        rows = positions
        # each plane picked read, whatever the later axes cut of it (``leading``), as often as it is picked
        later = [(s.start, s.stop) if isinstance(s, slice) else (s % n, s % n + 1)
                 for s, n in zip(index[1:], shape[1:])]
        extent = 1
        for (a, b), n, c in zip(later, shape[1:], chunks[1:]):
            extent *= min(n, -(-b // c) * c) - a // c * c
        assert gpulazy.stats().snapshot()["bytes_read"] - before <= len(rows) * extent * 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_step_or_a_list_of_planes_reads_those_planes_alone(tmp_path, device):
    """Every fourth plane of chunks stored as is reads a quarter of them (``ChunkSpec.leading`` with a
    step), its reductions too; a list of planes' reductions read the planes alone. A zstd Zarr's chunks
    decode whole (or from heads): same values."""
    data = np.random.default_rng(8).integers(0, 999, (40, 6, 5)).astype("<u2")
    vol = _vol(tmp_path, data, (16, 6, 5), device=device)
    zvol = gpulazy.from_files(zstd_zarr(tmp_path / "z.zarr", data, (16, 6, 5)), device=device, cache=False)
    plane = 6 * 5 * 2
    for make, nbytes in ((lambda v: v[::4], 10 * plane), (lambda v: v[::4].max(axis=0), 10 * plane),
                         (lambda v: v[1::3, 2:4].sum(), 13 * plane), (lambda v: v[::-5], 8 * plane),
                         (lambda v: v[[3, 9, 27]].max(axis=0), 3 * plane),
                         (lambda v: v[[3, 4, 20, 3]].astype("f8").mean(), 4 * plane),  # (3 twice)
                         (lambda v: v[[30, 2]] * 2, 2 * plane)):
        want = make(da_from(data)).compute()
        before = gpulazy.stats().snapshot()["bytes_read"]
        r = make(vol)
        got = r.compute()
        assert r.compute_path == "fast"
        np.testing.assert_allclose(to_host(got), want)
        assert gpulazy.stats().snapshot()["bytes_read"] - before == nbytes
        np.testing.assert_allclose(to_host(make(zvol).compute()), want)


def da_from(data):
    import dask.array as da

    return da.from_array(data, chunks=(16, 6, 5))


@pytest.mark.parametrize("index", [np.s_[9:11:2], np.s_[6:10:4, 2], np.s_[::-5], np.s_[3, 1:7:4], np.s_[5:9:2, 4:7:3],
                                   np.s_[11:6:-2, ::-3]])
def test_a_step_dask_would_slice_into_an_empty_block_is_a_view_of_its_own(tmp_path, index):
    """dask slices ``vol[9:11:2]`` of chunks of 2 planes into blocks of 1 and 0 planes, and its own operations
    over such blocks fail or give the wrong shape (dask 2026.8: ``max(axis=0)`` raises in its concatenate,
    ``vol[5:9:2, 4:7:3] * 2`` has twice the columns); gpulazy's view of a step has a block a chunk it takes
    from, its graph and its streamed map alike (``_strided_view``)."""
    data = np.random.default_rng(12).integers(0, 999, (12, 10)).astype("<u2")
    vol = _vol(tmp_path, data, (2, 5))
    part = vol[index]
    assert all(all(c) for c in part.chunks), index
    for make in (lambda v: v, lambda v: v.max(axis=0), lambda v: v * 2, lambda v: (v * 2).max()):
        r = make(part)
        got = r.compute()
        assert r.compute_path == "fast"
        np.testing.assert_array_equal(got, make(data[index]))
        (through_dask,) = dask.compute(r)  # the graph
        np.testing.assert_array_equal(through_dask, make(data[index]))
