"""``vol.map_blocks(func).compute()`` as the reads land (``gpulazy.read.mapped``): the values dask
gives, ``func`` called once a chunk on a chunk of its own, as its read lands, and dask's way for
every map that needs more than the chunk."""

from __future__ import annotations

import os
import threading

import dask
import dask.array as da
import numpy as np
import pytest
from dask.callbacks import Callback
from hypothesis import event, given, settings
from hypothesis import strategies as st

import gpulazy
from gpulazy.cache import DeviceCache
from gpulazy.errors import ChunkReadError
from gpulazy.read.pairs import members

from conftest import gated_preadv, to_host


def _volume(tmp_path, shape=(12, 6, 5), dtype="<u2", chunks=(3, 6, 5), seed=0, **kw):
    data = np.random.default_rng(seed).integers(0, 1000, shape).astype(dtype)
    path = str(tmp_path / f"v{seed}.raw")
    data.tofile(path)
    vol = gpulazy.from_files(path, shape=shape, dtype=dtype, chunks=chunks, device=kw.pop("device", "cpu"), **kw)
    return vol, data


def _fails_on_call(n):
    """A map function that raises on its ``n``-th call (``.calls`` counts them)."""
    calls = []

    def fails(b):
        calls.append(1)
        if len(calls) == n:
            raise ZeroDivisionError("no good")
        return b

    fails.calls = calls
    return fails


def _on_dask(vol, func, **kw):
    with gpulazy.config.set(streamed_maps=False):
        return vol.map_blocks(func, **kw)


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_a_map_streams_and_gives_daskss_values(tmp_path, scheduler):
    vol, data = _volume(tmp_path)
    twice = vol.map_blocks(lambda b: b * 2, dtype=vol.dtype)
    got = twice.compute(scheduler=scheduler)
    assert twice.compute_path == "fast" and type(got) is np.ndarray
    np.testing.assert_array_equal(got, data * 2)
    assert got.dtype == data.dtype and got.shape == data.shape
    np.testing.assert_array_equal(got, _on_dask(vol, lambda b: b * 2, dtype=vol.dtype).compute(scheduler=scheduler))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(shape=st.tuples(st.integers(1, 9), st.integers(1, 7), st.integers(1, 5)), data=st.data())
def test_any_chunking_maps_to_what_dask_gives(tmp_path_factory, shape, data):
    chunks = tuple(data.draw(st.integers(1, n), label=f"chunk {a}") for a, n in enumerate(shape))
    dtype = data.draw(st.sampled_from(["<u2", ">u2", "<f4", "u1", ">i8"]), label="dtype")
    scheduler = data.draw(st.sampled_from(["sync", "threads"]), label="scheduler")
    vol, ref = _volume(tmp_path_factory.mktemp("m"), shape=shape, dtype=dtype, chunks=chunks)
    mapped = vol.map_blocks(lambda b: b.astype("f8") + 1, dtype="f8")
    got = mapped.compute(scheduler=scheduler)
    assert mapped.compute_path == "fast"
    np.testing.assert_array_equal(got, ref.astype("f8") + 1)
    assert got.dtype == np.dtype("f8") and got.flags.c_contiguous


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_blocks_of_another_shape_or_dtype_are_put_together_as_dask_does(tmp_path, scheduler):
    vol, data = _volume(tmp_path)
    dask_vol = da.from_array(data, chunks=vol.chunks)
    cases = {"first plane of each chunk": (lambda b: b[:1], {"dtype": vol.dtype}),
             "float64 though float32 was said": (lambda b: b / 2, {"dtype": "f4"}),
             "a chunk-dependent shape": (lambda b: b[: 1 + int(b[0, 0, 0]) % 2], {"dtype": vol.dtype})}
    for what, (func, kw) in cases.items():
        mapped = vol.map_blocks(func, **kw)
        got = mapped.compute(scheduler=scheduler)
        want = dask_vol.map_blocks(func, **kw).compute(scheduler=scheduler)
        assert mapped.compute_path == "fast", what
        assert got.shape == want.shape and got.dtype == want.dtype, what
        np.testing.assert_array_equal(got, want, err_msg=what)


def test_func_is_called_once_a_chunk_with_its_keywords_on_the_schedulers_threads(tmp_path):
    vol, data = _volume(tmp_path)
    calls, threads = [], set()

    def shift(b, *, by):
        calls.append(b.shape)
        threads.add(threading.current_thread().name)
        return b + by

    mapped = vol.map_blocks(shift, by=3, dtype=vol.dtype)
    calls.clear()  # (dask called it on an empty array for the map's meta)
    threads.clear()
    np.testing.assert_array_equal(mapped.compute(scheduler="sync"), data + 3)
    assert calls == [(3, 6, 5)] * 4 and threads == {threading.current_thread().name}
    calls.clear()
    threads.clear()
    with dask.config.set(num_workers=2):
        np.testing.assert_array_equal(mapped.compute(), data + 3)  # dask's default for arrays: threads
    assert calls == [(3, 6, 5)] * 4 and threads and all(t.startswith("gpulazy-map") for t in threads)


def test_maps_that_need_more_than_the_chunk_run_on_dask(tmp_path):
    vol, data = _volume(tmp_path)
    other = da.from_array(data, chunks=vol.chunks)

    def info(b, block_info=None):
        return b + block_info[0]["chunk-location"][0]

    def ident(b, block_id=None):
        return b + block_id[0]

    offsets = np.repeat(np.arange(4), 3)[:, None, None]
    cases = {
        "block_info": (vol.map_blocks(info, dtype=vol.dtype), data + offsets),
        "block_id": (vol.map_blocks(ident, dtype=vol.dtype), data + offsets),
        "drop_axis": (vol.map_blocks(lambda b: b.sum(axis=2), drop_axis=2, dtype="u8"), data.sum(axis=2)),
        "new_axis": (vol.map_blocks(lambda b: b[..., None], new_axis=3, dtype=vol.dtype), data[..., None]),
        "a second array": (vol.map_blocks(np.add, other, dtype=vol.dtype), data * 2),
        "a dask keyword": (vol.map_blocks(lambda b, k: b + k, k=dask.delayed(1), dtype=vol.dtype), data + 1),
        "config streamed_maps=False": (_on_dask(vol, lambda b: b + 1, dtype=vol.dtype), data + 1),
    }
    for what, (mapped, want) in cases.items():
        assert getattr(mapped, "_gl_map_of", None) is None, what
        np.testing.assert_array_equal(mapped.compute(scheduler="sync"), want, err_msg=what)


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_callbacks_hear_each_chunks_read_and_map_tasks_from_the_streamed_map(tmp_path, scheduler):
    vol, data = _volume(tmp_path)
    mapped = vol.map_blocks(lambda b: b + 1, dtype=vol.dtype).map_blocks(lambda b: b * 2)
    heard = []
    lock = threading.Lock()

    def post(key, result, dsk, state, worker):
        with lock:
            heard.append((key, to_host(result).copy(), len(state["finished"])))

    with Callback(pretask=lambda key, dsk, state: heard.append(("pre", key)), posttask=post):
        got = mapped.compute(scheduler=scheduler)
    np.testing.assert_array_equal(got, (data + 1) * 2)
    assert mapped.compute_path == "fast"
    posted = [h for h in heard if h[0] != "pre"]
    assert len(posted) == 12 and [n for _, _, n in posted] == list(range(1, 13))  # 4 chunks x (read, map, map)
    names = [vol.name, mapped.name, *{k[0] for k, _, _ in posted} - {vol.name, mapped.name}]
    for i in range(4):
        (read, r), (inner, m), (outer, o) = [(k, v) for k, v, _ in posted if k[1:] == (i, 0, 0)]
        assert (read[0], outer[0]) == (vol.name, mapped.name) and inner[0] in names
        rows = slice(3 * i, 3 * i + 3)
        np.testing.assert_array_equal(r, data[rows])  # a read task's result is the chunk
        np.testing.assert_array_equal(o, (data[rows] + 1) * 2)
        pre = [h[1] for h in heard if h[0] == "pre" and h[1][1:] == (i, 0, 0)]
        assert pre[0] == read and set(pre) == {read, inner, outer}


def test_gpulazys_progress_bar_counts_a_streamed_maps_chunks(tmp_path):
    from gpulazy.widgets import ProgressBar

    vol, data = _volume(tmp_path)
    mapped = vol.map_blocks(lambda b: b + 1, dtype=vol.dtype)
    bar = ProgressBar(minimum=60, terminal=True)  # (shows nothing for a compute under a minute)
    with bar:
        np.testing.assert_array_equal(mapped.compute(), data + 1)
    assert mapped.compute_path == "fast"
    assert (bar.done, bar.total, bar.counting, bar.bytes_read, bar.errored) == (4, 4, "reads", data.nbytes, False)


def test_a_map_computed_with_options_or_changed_runs_on_dask(tmp_path):
    vol, data = _volume(tmp_path)
    mapped = vol.map_blocks(lambda b: b + 1, dtype=vol.dtype)
    np.testing.assert_array_equal(mapped.compute(optimize_graph=False), data + 1)
    assert mapped.compute_path == "dask"
    with gpulazy.prefetch(depth=2):  # the prefetcher is gpulazy's own: the streamed map reads ahead itself
        np.testing.assert_array_equal(mapped.compute(), data + 1)
    assert mapped.compute_path == "fast"
    mapped[0, 0, 0] = 7  # changed in place: no longer the map of the files
    want = data + 1
    want[0, 0, 0] = 7
    np.testing.assert_array_equal(mapped.compute(), want)
    assert mapped.compute_path == "dask"
    total = mapped.sum()  # what follows a changed map is dask's
    assert "streamed" not in total.name and total.compute() == want.astype("u8").sum()


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
@pytest.mark.parametrize("reduced", [False, True])
def test_through_a_cache_func_gets_copies_and_a_second_map_reads_nothing(tmp_path, scheduler, reduced):
    cache = DeviceCache("1 MiB", device="cpu")
    try:
        vol, data = _volume(tmp_path, cache=cache)

        def bump(b):
            b += 1  # into its input: must not reach the cache
            return b

        for turn in ("miss", "hit"):
            read_before = gpulazy.stats().snapshot()["bytes_read"]
            mapped = vol.map_blocks(bump, dtype=vol.dtype)
            if reduced:  # the streamed reduction of the map
                assert mapped.sum().compute(scheduler=scheduler) == (data.astype("u8") + 1).sum(), turn
            else:
                np.testing.assert_array_equal(mapped.compute(scheduler=scheduler), data + 1, err_msg=turn)
        assert gpulazy.stats().snapshot()["bytes_read"] == read_before  # the second map read nothing
        s = cache.stats()
        assert s["hits"] == 4 and s["misses"] == 4 and cache.bytes_held == data.nbytes, s
        np.testing.assert_array_equal(vol.compute(), data)  # the cache still holds the file's values
    finally:
        cache.close()


def test_cached_chunks_are_copied_out_a_group_at_a_time_and_one_evicted_meanwhile_is_read(tmp_path, monkeypatch):
    """A map over cached data copies the chunks out ``whole.GROUP`` bytes at a time, not all at once
    (which held a second copy of them beside the result); a chunk evicted before its group's turn
    is read again."""
    from gpulazy.read import whole

    cache = DeviceCache("1 MiB", device="cpu")
    try:
        vol, data = _volume(tmp_path, cache=cache)
        vol.map_blocks(lambda b: b, dtype=vol.dtype).compute()  # every chunk cached
        assert len(cache) == 4
        monkeypatch.setattr(whole, "GROUP", 2 * 3 * 6 * 5 * 2)  # two chunks a group
        asked = []
        real = DeviceCache.get_cached

        def get_cached(self, specs):
            specs = list(specs)
            asked.append([s.index[0] for s in specs])
            copies = real(self, specs)
            if len(asked) == 1:
                self.clear()  # the second group's chunks are gone before its turn
            return copies

        monkeypatch.setattr(DeviceCache, "get_cached", get_cached)
        read_before = gpulazy.stats().snapshot()["bytes_read"]
        got = vol.map_blocks(lambda b: b + 1, dtype=vol.dtype).compute(scheduler="sync")
        np.testing.assert_array_equal(got, data + 1)
        assert asked == [[0, 1], [2, 3]]
        assert gpulazy.stats().snapshot()["bytes_read"] - read_before == data[6:].nbytes  # the two evicted
    finally:
        cache.close()


def test_a_map_over_more_than_its_cache_holds_caches_nothing(tmp_path):
    cache = DeviceCache(2 * 3 * 6 * 5 * 2, device="cpu")  # two of the four chunks
    try:
        vol, data = _volume(tmp_path, cache=cache)
        np.testing.assert_array_equal(vol.map_blocks(lambda b: b + 1, dtype=vol.dtype).compute(), data + 1)
        assert len(cache) == 0 and cache.stats()["misses"] == 0, cache.stats()
        vol[:6].compute(scheduler="sync")  # (a fast-path read inserts nothing either)
        np.testing.assert_array_equal(vol[:6].map_blocks(lambda b: b - 1, dtype=vol.dtype).compute(), data[:6] - 1)
        assert len(cache) == 2  # a map that fits is kept
        np.testing.assert_array_equal(vol.map_blocks(lambda b: b + 2, dtype=vol.dtype).compute(), data + 2)
        assert cache.stats()["hits"] == 2
    finally:
        cache.close()


def test_func_runs_on_a_chunk_as_its_own_read_lands(tmp_path, monkeypatch):
    """The first chunk is mapped while a later chunk's read is still held: ``func`` opens the gate
    the last file's read waits at (a map that waited for every read of the submission would
    only go on once that read timed out)."""
    data = np.arange(4 * 8 * 8, dtype="<u2").reshape(4, 8, 8)
    paths = []
    for i in range(4):
        paths.append(str(tmp_path / f"p{i}.raw"))
        data[i].tofile(paths[-1])
    vol = gpulazy.from_files(paths, shape=(8, 8), dtype="<u2", device="cpu", chunks=(1, 8, 8))
    assert vol.numblocks[0] == 4
    gate = threading.Event()
    entered = gated_preadv(monkeypatch, gate, os.path.realpath(paths[-1]), timeout=10)
    seen = []

    def first_opens(b):
        seen.append(int(b[0, 0, 0]))
        gate.set()
        return b

    np.testing.assert_array_equal(vol.map_blocks(first_opens, dtype=vol.dtype).compute(scheduler="sync"), data)
    assert entered.is_set() and entered.timed_out == [] and seen == [0, 64, 128, 192]


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_an_error_in_func_is_raised_once_every_read_has_settled(tmp_path, scheduler):
    vol, _ = _volume(tmp_path, shape=(40, 6, 5), chunks=(2, 6, 5))
    fails_on_third = _fails_on_call(3)
    with pytest.raises(ZeroDivisionError, match="no good"):
        vol.map_blocks(fails_on_third, dtype=vol.dtype).compute(scheduler=scheduler)
    assert len(fails_on_third.calls) < 20  # the calls stop at the error
    assert not [t for t in threading.enumerate() if t.name.startswith("gpulazy-map")]  # the reads ended


def test_an_interrupt_in_func_ends_the_reads_before_it_propagates(tmp_path):
    vol, data = _volume(tmp_path, shape=(40, 6, 5), chunks=(2, 6, 5))

    def interrupted(b):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        vol.map_blocks(interrupted, dtype=vol.dtype).compute(scheduler="sync")
    assert not [t for t in threading.enumerate() if t.name.startswith("gpulazy-map")]
    np.testing.assert_array_equal(vol.map_blocks(lambda b: b, dtype=vol.dtype).compute(), data)  # still usable


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_a_truncated_file_raises_with_its_path(tmp_path, scheduler):
    vol, _ = _volume(tmp_path)
    path = vol.chunk_index.paths[0]
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ChunkReadError) as info:
        vol.map_blocks(lambda b: b, dtype=vol.dtype).compute(scheduler=scheduler)
    assert path in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_a_map_on_a_gpu_gives_cupy_values_as_dask_does(tmp_path, scheduler):
    import cupy as cp

    vol, data = _volume(tmp_path, shape=(16, 64, 64), chunks=(4, 64, 64), device="cuda:0")
    where = set()

    def root(b):
        # (in the calling thread, on a non-blocking stream of the map's own: not CuPy's legacy one)
        where.add((threading.current_thread().name, cp.cuda.get_current_stream().ptr))
        return cp.sqrt(b.astype("f4"))

    mapped = vol.map_blocks(root, dtype="f4")
    where.clear()
    got = mapped.compute(scheduler=scheduler)
    assert mapped.compute_path == "fast" and isinstance(got, cp.ndarray)
    assert len(where) == 1 and next(iter(where))[0] == threading.current_thread().name
    assert next(iter(where))[1] not in (0, cp.cuda.get_current_stream().ptr)
    np.testing.assert_allclose(to_host(got), np.sqrt(data.astype("f4")), rtol=1e-6)
    scaled = np.sqrt(vol * 2)  # elementwise with scalars: a streamed map too
    np.testing.assert_allclose(to_host(scaled.compute(scheduler=scheduler)), np.sqrt(data * 2), rtol=1e-6)
    assert scaled.compute_path == "fast"
    np.testing.assert_array_equal(to_host((vol - 1).max(axis=0).compute()), (data - 1).max(axis=0))
    dark = np.random.default_rng(5).integers(0, 50, (64, 64)).astype("u2")
    gain = np.linspace(0.5, 1.5, 64).astype("f4")
    flat = (vol - cp.asarray(dark)) / cp.asarray(gain)  # CuPy arrays in memory: each block its part
    assert flat._gl_map_of is not None
    np.testing.assert_allclose(to_host(flat.compute(scheduler=scheduler)), (data - dark) / gain, rtol=1e-6)
    np.testing.assert_allclose(to_host(flat.mean(axis=0).compute()), ((data - dark) / gain).mean(axis=0), rtol=1e-5)
    shrunk = vol.map_blocks(lambda b: b[:1].copy(), dtype=vol.dtype).compute(scheduler=scheduler)
    np.testing.assert_array_equal(to_host(shrunk), data[::4])
    cache = DeviceCache("64 MiB", device="cuda:0")
    try:
        cached, _ = _volume(tmp_path, shape=(16, 64, 64), chunks=(4, 64, 64), device="cuda:0", cache=cache, seed=1)
        want = to_host(cached.compute())

        def bump(b):
            b += 1
            return b

        for _ in range(2):
            np.testing.assert_array_equal(to_host(cached.map_blocks(bump, dtype=cached.dtype).compute(
                scheduler=scheduler)), want + 1)
        assert cache.stats()["hits"] == 4
    finally:
        cache.close()


# -- what follows a map: a reduction, a cast, another map ------------------------------------------------

OPS = ["max", "min", "sum", "mean", "var", "std"]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(shape=st.tuples(st.integers(1, 9), st.integers(1, 7), st.integers(1, 5)), data=st.data())
def test_a_reduction_of_a_map_streams_and_equals_numpy_of_the_mapped_values(tmp_path_factory, shape, data):
    chunks = tuple(data.draw(st.integers(1, n)) for n in shape)
    op = data.draw(st.sampled_from(OPS))
    axis = data.draw(st.one_of(st.none(), st.sampled_from(range(-3, 3)),
                               st.sets(st.integers(0, 2), min_size=1).map(tuple)))
    cast = data.draw(st.sampled_from([None, "f8", "u1"]))
    vol, values = _volume(tmp_path_factory.mktemp("m"), shape=shape, chunks=chunks)
    mapped = vol.map_blocks(lambda b: b * 3 + 1)
    if cast is not None:
        mapped, values = mapped.astype(cast), (values * 3 + 1).astype(cast)
    else:
        values = values * 3 + 1
    r = getattr(mapped, op)(axis=axis)
    assert "streamed" in r.name  # the map's function folded into the chain, not dask's tree
    want = getattr(np, op)(values, axis=axis)
    got = r.compute()
    assert r.compute_path == "fast"
    (through_dask,) = dask.compute(r)  # the same chain as dask tasks
    for out in (got, through_dask):
        assert out.shape == want.shape and np.asarray(out).dtype == want.dtype
        if op in ("max", "min") or op == "sum" and want.dtype.kind in "ui":
            np.testing.assert_array_equal(out, want)
        else:
            np.testing.assert_allclose(out, want, rtol=1e-6)


def test_a_reduction_of_a_map_calls_func_on_the_schedulers_threads_and_folds_in_block_order(tmp_path):
    vol, data = _volume(tmp_path, shape=(40, 6, 5), chunks=(2, 6, 5), dtype="<f4")
    threads = []

    def noisy(b):
        threads.append(threading.current_thread().name)
        return b * np.float32(1.1) + np.float32(1e-3)

    sums = {}
    for scheduler in ("sync", "threads"):
        total = vol.map_blocks(noisy).sum()
        threads.clear()  # (dask called it on an empty array for its dtype)
        sums[scheduler] = total.compute(scheduler=scheduler)
        assert total.compute_path == "fast" and len(threads) == 20
        on_pool = [t.startswith("gpulazy-map") for t in threads]
        assert all(on_pool) if scheduler == "threads" else not any(on_pool)
    assert sums["sync"] == sums["threads"]  # the same folds in the same order: the same float sum
    assert sums["sync"] == pytest.approx(float((data * np.float32(1.1) + np.float32(1e-3)).sum()), rel=1e-5)
    assert not [t for t in threading.enumerate() if t.name.startswith("gpulazy-map")]  # let go of


def test_a_map_of_a_map_streams_and_so_does_its_reduction(tmp_path):
    vol, data = _volume(tmp_path)
    calls = []

    def first(b, k):
        calls.append("first")
        return b + k

    def then(b):
        calls.append("then")
        return b.astype("f4") / 2

    twice = vol.map_blocks(first, k=3).map_blocks(then)
    calls.clear()  # (dask called each on an empty array for its dtype)
    got = twice.compute(scheduler="sync")
    assert twice.compute_path == "fast" and got.dtype == np.float32
    np.testing.assert_array_equal(got, (data + 3).astype("f4") / 2)
    assert calls == ["first", "then"] * 4  # one call of each a chunk, in turn
    calls.clear()
    assert twice.max().compute() == ((data + 3).astype("f4") / 2).max() and len(calls) == 8
    on_dask = _on_dask(vol, first, k=3).map_blocks(then)  # dask's two maps, for reference
    assert getattr(on_dask, "_gl_map_of", None) is None
    np.testing.assert_array_equal(on_dask.compute(), got)


def test_a_reduction_of_a_map_that_changes_its_blocks(tmp_path):
    """Along the axes it reduces, a block may change length (the fold counts what the block holds, as
    dask's reduction does); along the others it may not: the error names the chunk, the file and
    the way out (``chunks=``)."""
    vol, data = _volume(tmp_path)  # chunks (3, 6, 5)
    firsts = vol.map_blocks(lambda b: b[:1])
    assert firsts.sum().compute() == data[::3].astype("u8").sum()
    np.testing.assert_array_equal(firsts.max(axis=0).compute(), data[::3].max(axis=0))
    assert firsts.mean().compute() == pytest.approx(data[::3].mean())
    with pytest.raises(ValueError) as info:
        firsts.max(axis=1).compute()
    assert vol.chunk_index.paths[0] in str(info.value) and "chunks=" in str(info.value)
    assert "(1, 6, 5)" in str(info.value) and "(3, 6, 5)" in str(info.value)
    declared = vol.map_blocks(lambda b: b[:1], chunks=((1,) * 4, (6,), (5,)))  # said: the kept axes may change
    np.testing.assert_array_equal(declared.max(axis=1).compute(), data[::3].max(axis=1))
    with pytest.raises(ValueError, match=r"block \(0, 0, 0\) \(shape \(2, 6, 5\)\)"):  # said wrong
        vol.map_blocks(lambda b: b[:1], chunks=((2,) * 4, (6,), (5,))).max(axis=1).compute()


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_a_map_given_chunks_streams_blocks_of_those_lengths(tmp_path, scheduler):
    """``chunks=`` gives the map's blocks other lengths (a thumbnail a chunk, a statistic a chunk);
    block (i, j, k) is still made of chunk (i, j, k) alone, so the map streams."""
    vol, data = _volume(tmp_path, shape=(12, 6, 10), chunks=(3, 6, 5))
    thumbs = vol.map_blocks(lambda b: b[:, ::2, ::5], chunks=((3,) * 4, (3,), (1, 1)))
    got = thumbs.compute(scheduler=scheduler)
    assert thumbs.compute_path == "fast" and got.shape == thumbs.shape == (12, 3, 2)
    want = np.concatenate([data[:, ::2, 0:1], data[:, ::2, 5:6]], axis=2)
    np.testing.assert_array_equal(got, want)
    peaks = vol.map_blocks(lambda b: b.max(axis=0, keepdims=True), chunks=((1,) * 4, (6,), (5, 5)))
    np.testing.assert_array_equal(peaks.compute(scheduler=scheduler), data.reshape(4, 3, 6, 10).max(axis=1))
    assert peaks.compute_path == "fast"
    total = peaks.sum(axis=0)  # a reduction of it streams, over the declared blocks
    assert "streamed" in total.name
    np.testing.assert_array_equal(total.compute(), data.reshape(4, 3, 6, 10).max(axis=1).astype("u8").sum(axis=0))
    wrong = vol.map_blocks(lambda b: b[:1], chunks=((2,) * 4, (6,), (5, 5)))  # declared wrong: as dask puts it
    np.testing.assert_array_equal(wrong.compute(scheduler=scheduler),
                                  _on_dask(vol, lambda b: b[:1], chunks=((2,) * 4, (6,), (5, 5))).compute())


def test_an_error_in_a_reduced_maps_function_settles_every_read_first(tmp_path, monkeypatch):
    from gpulazy.read import engine, whole

    vol, _ = _volume(tmp_path, shape=(40, 6, 5), chunks=(2, 6, 5))
    monkeypatch.setattr(whole, "GROUP", 1)  # a group per chunk: several groups read ahead
    started, start = [], engine.start

    def recorded(*args, **kwargs):
        started.append(start(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(engine, "start", recorded)
    fails_on_third = _fails_on_call(3)
    with pytest.raises(ZeroDivisionError, match="no good"):
        vol.map_blocks(fails_on_third, dtype=vol.dtype).max(axis=0).compute()
    assert len(fails_on_third.calls) == 3 and len(started) > 3  # later groups were in flight
    assert all(reads.outcomes[i] is not engine._PENDING for reads in started for i in range(len(reads)))


@pytest.mark.gpu
def test_a_reduction_of_a_map_on_a_gpu(tmp_path):
    import cupy as cp

    cache = DeviceCache("64 MiB", device="cuda:0")
    try:
        vol, data = _volume(tmp_path, shape=(16, 64, 64), chunks=(4, 64, 64), device="cuda:0", cache=cache)

        def bump(b):
            b += 1  # into its input: must not reach the cache
            return cp.sqrt(b.astype("f4"))

        want = np.sqrt((data + 1).astype("f4"))
        for turn in ("miss", "hit"):
            got = vol.map_blocks(bump).max(axis=0).compute()
            assert isinstance(got, cp.ndarray)
            np.testing.assert_allclose(to_host(got), want.max(axis=0), rtol=1e-6, err_msg=turn)
            total = vol.map_blocks(bump).astype("f8").mean().compute()
            assert float(total) == pytest.approx(float(want.astype("f8").mean()), rel=1e-9)
        assert cache.stats()["hits"] >= 4
        np.testing.assert_array_equal(to_host(vol.compute()), data)
        with pytest.raises(ValueError, match="cupy"):
            vol.map_blocks(lambda b: b.get()).sum().compute()
    finally:
        cache.close()


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_blocks_that_tile_another_grid_are_joined_an_axis_at_a_time_and_mixed_dtypes_concatenated(tmp_path, scheduler,
                                                                                            monkeypatch):
    import dask.array.core as dac

    vol, data = _volume(tmp_path, shape=(12, 6, 10), chunks=(3, 6, 5))
    concatenated = []
    real = dac.concatenate3
    monkeypatch.setattr(dac, "concatenate3", lambda arrays: concatenated.append(1) or real(arrays))
    corners = vol.map_blocks(lambda b: b[:1, :2, :1].copy())  # blocks of 1 x 2 x 1: a grid of its own
    got = corners.compute(scheduler=scheduler)
    assert not concatenated and got.shape == (4, 2, 2) and got.dtype == data.dtype
    np.testing.assert_array_equal(got, _on_dask(vol, lambda b: b[:1, :2, :1].copy()).compute())
    high = data[::3, 0, ::5] > 500
    assert high.any() and not high.all()
    mixed = vol.map_blocks(lambda b: b[:1].astype("f8") if b[0, 0, 0] > 500 else b[:1])  # two dtypes: dask's way
    got = mixed.compute(scheduler=scheduler)
    assert concatenated and got.dtype == np.float64
    np.testing.assert_array_equal(got, data[::3])


# -- elementwise operations with scalars: streamed maps ----------------------------------------------

import operator  # noqa: E402

_BINARY_OPS = ["add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and_", "or_", "xor", "lshift", "rshift",
               "eq", "ne", "lt", "le", "gt", "ge"]
_UFUNCS = [np.sqrt, np.abs, np.negative, np.exp, np.log1p, np.invert, np.isnan]


@st.composite
def elementwise(draw):
    kind = draw(st.sampled_from(["binary", "reflected", "unary", "ufunc", "da-ufunc", "ufunc-scalar", "array"]))
    scalar = draw(st.one_of(st.integers(1, 5), st.floats(0.5, 4.0), st.sampled_from(
        [np.float32(1.5), np.uint8(3), np.int16(2), np.array(2.0), True])))
    if kind == "array":  # an array in memory: a row or a plane, broadcast to each block's part of it
        op = getattr(operator, draw(st.sampled_from(_BINARY_OPS)))
        plane = draw(st.booleans())
        kind_of = draw(st.sampled_from(["u1", "f4"]))

        def operand(shape):
            tail = shape[-2:] if plane else shape[-1:]
            return (np.arange(int(np.prod(tail))).reshape(tail) % 3 + 1).astype(kind_of)

        return lambda a, op=op: op(a, operand(a.shape))
    if kind in ("binary", "reflected"):
        op = getattr(operator, draw(st.sampled_from(_BINARY_OPS)))
        return (lambda a, op=op, s=scalar: op(s, a)) if kind == "reflected" else (lambda a, op=op, s=scalar: op(a, s))
    if kind == "unary":
        op = draw(st.sampled_from([operator.neg, operator.pos, abs, operator.invert]))
        return lambda a, op=op: op(a)
    ufunc = draw(st.sampled_from(_UFUNCS))
    if kind == "da-ufunc":
        return lambda a, u=ufunc: getattr(da, u.__name__)(a) if isinstance(a, da.Array) else u(a)
    if kind == "ufunc-scalar":
        return lambda a, s=scalar: np.maximum(a, s)
    return lambda a, u=ufunc: u(a)


def _outcome(fn):
    try:
        return fn(), None
    except Exception as e:  # what dask raises, gpulazy must raise too
        return None, type(e)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(op=elementwise(), dtype=st.sampled_from(["<u2", ">i4", "<f4", "u1"]), data=st.data())
def test_an_elementwise_op_with_scalars_streams_and_equals_dask(tmp_path_factory, op, dtype, data):
    import warnings

    shape = data.draw(st.tuples(st.integers(1, 7), st.integers(1, 5), st.integers(1, 4)))
    chunks = tuple(data.draw(st.integers(1, n)) for n in shape)
    vol, values = _volume(tmp_path_factory.mktemp("e"), shape=shape, dtype=dtype, chunks=chunks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (overflow, invalid values: the same on both ways)
        with gpulazy.config.set(streamed_maps=False):
            theirs, raised = _outcome(lambda: op(vol))
            if raised is None and not isinstance(theirs, da.Array):  # (dask's ``~`` of floats: NotImplemented)
                assert op(vol) is theirs
                event("not an array")
                return
            want, raised = _outcome(lambda: op(vol).compute())
        ours, ours_raised = _outcome(lambda: op(vol))
        if ours_raised is not None or raised is not None and ours is None:
            assert ours_raised == raised  # dask refused it when building the graph: so does gpulazy
            event("refused when built")
            return
        assert getattr(ours, "_gl_map_of", None) is not None  # a streamed map
        got, got_raised = _outcome(ours.compute)
        assert got_raised == raised
        event("raised when computed" if raised is not None else "streamed")
        if raised is not None:
            return
        assert ours.compute_path == "fast" and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        if got.dtype != bool and got.dtype.kind != "c":
            mip = ours.max(axis=0)
            assert "streamed" in mip.name
            np.testing.assert_array_equal(mip.compute(), want.max(axis=0))


def test_chains_of_casts_and_ops_stream_and_what_needs_more_than_the_block_does_not(tmp_path):
    vol, data = _volume(tmp_path, shape=(12, 6, 10), chunks=(3, 6, 5))
    scaled = (vol.astype("f4") * 0.5 + 1) ** 2
    assert scaled._gl_map_of is not None
    want = (data.astype("f4") * 0.5 + 1) ** 2
    np.testing.assert_array_equal(scaled.compute(), want)
    assert scaled.compute_path == "fast"
    np.testing.assert_allclose(scaled.mean(axis=(1, 2)).compute(), want.mean(axis=(1, 2)), rtol=1e-6)
    np.testing.assert_array_equal((vol + vol).compute(), data + data)  # the same array twice: one block
    other, _ = _volume(tmp_path, shape=(12, 6, 10), chunks=(3, 6, 5), seed=1)
    changed = vol.copy()
    changed[0, 0, 0] = 1
    not_streamed = {
        "a changed array beside another": other + changed,
        "an array that grows the result": vol + np.ones((2, 12, 6, 10), "u2"),
        "a ufunc keyword": np.add(vol, 1, dtype="f8"),
        "a changed array": changed * 2,
    }
    for what, arr in not_streamed.items():
        assert getattr(arr, "_gl_map_of", None) is None, what
    with gpulazy.config.set(streamed_maps=False):
        assert getattr(vol * 2, "_gl_map_of", None) is None
    np.testing.assert_array_equal(np.add(vol, 1, dtype="f8").compute(), data + 1.0)


def test_an_elementwise_maps_function_survives_pickling(tmp_path):
    import pickle

    import cloudpickle

    vol, data = _volume(tmp_path)
    plane = np.arange(30, dtype="u2").reshape(6, 5)
    func = ((vol - 3) * np.float32(0.5) + plane)._gl_map_of[4]
    again = pickle.loads(cloudpickle.dumps(func))
    np.testing.assert_array_equal(again(data[:3], index=(0, 0, 0)), (data[:3] - 3) * np.float32(0.5) + plane)


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_arrays_in_memory_among_the_operands_give_each_block_its_part(tmp_path, scheduler):
    """A flat-field correction, ``(vol - dark) / gain``: ``dark`` a plane, ``gain`` a row; each block's
    call gets the part of each that broadcasts to it, as dask's task for the block does."""
    vol, data = _volume(tmp_path, shape=(12, 6, 10), chunks=(3, 2, 5))
    rng = np.random.default_rng(3)
    dark = rng.integers(0, 50, (6, 10)).astype("u2")
    gain = np.linspace(0.5, 1.5, 10).astype("f4")
    column = np.arange(6, dtype="f8")[:, None]
    cases = {
        "(vol - dark) / gain": (lambda v: (v - dark) / gain, (data - dark) / gain),
        "gain * vol": (lambda v: gain * v, gain * data),
        "vol + column": (lambda v: v + column, data + column),
        "np.maximum(vol, dark)": (lambda v: np.maximum(v, dark), np.maximum(data, dark)),
        "a full array": (lambda v: v - data, data - data),
    }
    for what, (fn, want) in cases.items():
        arr = fn(vol)
        assert getattr(arr, "_gl_map_of", None) is not None, what
        got = arr.compute(scheduler=scheduler)
        assert arr.compute_path == "fast" and got.dtype == want.dtype, what
        np.testing.assert_array_equal(got, want, err_msg=what)
        with gpulazy.config.set(streamed_maps=False):
            np.testing.assert_array_equal(fn(vol).compute(scheduler=scheduler), got, err_msg=what)  # dask's own
        np.testing.assert_array_equal(arr.max(axis=0).compute(scheduler=scheduler), want.max(axis=0), err_msg=what)


_PAIRED = {  # gpulazy's, NumPy's, the arrays read (an array twice among the operands: read once)
    "a - b": (lambda a, b, c: a - b, lambda a, b, c: a - b, "ab"),
    "np.maximum(a, b)": (lambda a, b, c: np.maximum(a, b), lambda a, b, c: np.maximum(a, b), "ab"),
    "(a.astype(f4) - b) / 2": (lambda a, b, c: (a.astype("f4") - b) / 2, lambda a, b, c: (a.astype("f4") - b) / 2,
                               "ab"),
    "a * 2 - b.map_blocks(f)": (lambda a, b, c: a * 2 - b.map_blocks(lambda x: x // 3),
                                lambda a, b, c: a * 2 - b // 3, "ab"),
    "b > a": (lambda a, b, c: b > a, lambda a, b, c: b > a, "ab"),
    "a + b + c": (lambda a, b, c: a + b + c, lambda a, b, c: a + b + c, "abc"),
    "(a - b) * (c - a)": (lambda a, b, c: (a.astype("i4") - b) * (c - a),
                          lambda a, b, c: (a.astype("i4") - b) * (c - a), "abc"),
    "(a - b) / (a + b + 1)": (lambda a, b, c: (a.astype("f4") - b) / (a + b + 1.0),
                              lambda a, b, c: (a.astype("f4") - b) / (a + b + 1.0), "ab"),
    "np.maximum(a - b, c * 2).map_blocks(f)": (lambda a, b, c: np.maximum(a - b, c * 2).map_blocks(lambda x: x // 3),
                                               lambda a, b, c: np.maximum(a - b, c * 2) // 3, "abc"),
}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), op=st.sampled_from(sorted(_PAIRED)), then=st.sampled_from(["compute", "max0", "sum", "mean12"]),
       capacity=st.sampled_from([None, "2 KiB", "1 MiB"]), scheduler=st.sampled_from(["sync", "threads"]))
def test_an_operation_between_two_arrays_streams_both_in_one_pass(tmp_path_factory, data, op, then, capacity,
                                                                 scheduler):
    """``a - b`` of two arrays of files with the same chunks, read through the same source (or ``a + b + c``
    of three): one streamed pass reads them all, each block's operation called once its chunks have
    landed; its reductions stream too. Values as dask's; each chunk read once, an array's twice among the
    operands too (a cache holding some of them reads those not)."""
    shape = data.draw(st.tuples(st.integers(1, 7), st.integers(1, 5), st.integers(1, 4)), label="shape")
    chunks = tuple(data.draw(st.integers(1, n)) for n in shape)
    path = tmp_path_factory.mktemp("pair")
    cache = DeviceCache(capacity, device="cpu") if capacity else False
    try:
        a, av = _volume(path, shape=shape, chunks=chunks, seed=1, cache=cache)
        b, bv = _volume(path, shape=shape, chunks=chunks, seed=2, cache=cache)
        c, cv = _volume(path, shape=shape, chunks=chunks, seed=3, cache=cache)
        if capacity:  # some of ``a``'s chunks cached: a block of a hit and a read
            a[: chunks[0]].map_blocks(lambda x: x).compute(scheduler="sync")
        ours, numpys, reads = _PAIRED[op]
        made = {"compute": lambda r: r, "max0": lambda r: r.max(axis=0), "sum": lambda r: r.sum(),
                "mean12": lambda r: r.mean(axis=(1, 2))}[then]
        paired = ours(a, b, c)
        assert paired._gl_map_of is not None and len(members(next(iter(paired._gl_map_of[1].values())))) == len(reads)
        r = made(paired)
        before = gpulazy.stats().snapshot()["bytes_read"]
        got = r.compute(scheduler=scheduler)
        assert r.compute_path == "fast"
        read = gpulazy.stats().snapshot()["bytes_read"] - before
        nbytes = sum({"a": av, "b": bv, "c": cv}[k].nbytes for k in reads)
        assert read <= nbytes and (capacity or read == nbytes)
        want = made(numpys(av, bv, cv))
        assert got.dtype == np.asarray(want).dtype
        np.testing.assert_allclose(got, want, rtol=1e-6)
        with gpulazy.config.set(streamed_maps=False):  # dask's own tasks agree
            np.testing.assert_allclose(made(ours(a, b, c)).compute(scheduler=scheduler), want, rtol=1e-6)
    finally:
        if capacity:
            cache.close()


def test_two_arrays_that_cannot_stream_together_are_dask_s_and_right(tmp_path):
    a, av = _volume(tmp_path, shape=(12, 6, 10), chunks=(3, 6, 5), seed=1)
    b, bv = _volume(tmp_path, shape=(12, 6, 10), chunks=(3, 6, 5), seed=2)
    other_chunks, cv = _volume(tmp_path, shape=(12, 6, 10), chunks=(4, 6, 5), seed=3)
    other_cache, dv = _volume(tmp_path, shape=(12, 6, 10), chunks=(3, 6, 5), seed=4, cache=False)
    cases = {
        "other chunks": (a - other_chunks, av - cv),
        "another cache": (a - other_cache, av - dv),
    }
    many = [_volume(tmp_path, shape=(12, 6, 10), chunks=(3, 6, 5), seed=10 + k) for k in range(9)]
    eight = sum((v for v, _ in many[1:8]), many[0][0])
    assert len(next(iter(eight._gl_map_of[1].values()))) == 8  # eight arrays stream together
    cases["a ninth array"] = (eight + many[8][0], sum(d for _, d in many))
    for what, (arr, want) in cases.items():
        assert getattr(arr, "_gl_map_of", None) is None, what
        np.testing.assert_array_equal(arr.compute(), want, err_msg=what)
    assert (a - b)._gl_map_of is not None and (a.map_blocks(lambda x: x) - a)._gl_map_of is not None
    # A file's chunks on both sides (``vol - vol.map_blocks(f)``): read once, each side made of the one chunk.
    c = other_cache  # (no cache: every chunk is read)
    before = gpulazy.stats().snapshot()["bytes_read"]
    np.testing.assert_array_equal((c.map_blocks(lambda x: x // 2) - c).sum(axis=0).compute(), (dv // 2 - dv).sum(axis=0))
    assert gpulazy.stats().snapshot()["bytes_read"] - before == dv.nbytes


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
@pytest.mark.parametrize("make,numpys", [("a - b", "a - b"), ("a * 2 - b", "a * 2 - b"),
                                         ("a - a.map_blocks(f)", "a - (a + 1)"), ("a - a2", "a - a"),
                                         ("(a - b).map_blocks(f)", "(a - b) + 1"),
                                         ("(a - b) * (b - a2)", "(a - b) * (b - a)")])
def test_a_pair_streams_under_callbacks_that_hear_of_every_task_once(tmp_path, scheduler, make, numpys):
    """A callback (a progress bar) does not send a block of several arrays' chunks back to dask's tasks:
    the streamed pass tells it of each task of the graph once, a pretask before its posttask, the reads
    of a block among them (one, where both sides are made of the one chunk read)."""
    a, av = _volume(tmp_path, seed=1)
    b, bv = _volume(tmp_path, seed=2)
    a2 = gpulazy.from_files(a.chunk_index.paths[0], shape=a.shape, dtype=a.dtype, chunks=a.chunksize, device="cpu")
    arr = eval(make, {"a": a, "b": b, "a2": a2, "f": lambda x: x + 1})
    want = eval(numpys, {"a": av, "b": bv})
    pre, post = [], []

    class Count(Callback):
        def _pretask(self, key, dsk, state):
            pre.append(key)

        def _posttask(self, key, result, dsk, state, id):
            assert key in pre
            post.append(key)

    with Count():
        got = arr.compute(scheduler=scheduler)
    assert arr.compute_path == "fast"
    np.testing.assert_array_equal(got, want)
    graph = dict(arr.__dask_graph__())
    assert sorted(map(str, post)) == sorted(map(str, pre)) == sorted(map(str, graph))
    reads = {k[0] for k in post if k[0] in (a.name, b.name, a2.name)}
    assert reads == {n for n in (a.name, b.name, a2.name) if any(k[0] == n for k in graph)} and len(reads) >= 1


@pytest.mark.parametrize("reduced", [False, True])
def test_a_pair_whose_second_file_changed_raises_naming_it(tmp_path, reduced):
    a, _ = _volume(tmp_path, seed=1, cache=False)
    b, _ = _volume(tmp_path, seed=2, cache=False)
    os.truncate(tmp_path / "v2.raw", 100)
    r = (a - b).sum() if reduced else a - b
    with pytest.raises(ChunkReadError, match="v2.raw.*changed since it was indexed"):
        r.compute()


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_numpy_s_where_and_clip_stream_as_maps(tmp_path, scheduler):
    """``np.where`` and ``np.clip`` are dask's block by block, as ufuncs are: streamed maps, a file's
    chunks read once however many of its arrays they take (``np.where(vol > 500, vol, 0)``,
    ``np.where(a > b, a, b)``), other gpulazy arrays among the operands read in the same pass."""
    a, av = _volume(tmp_path, shape=(12, 6, 10), chunks=(3, 2, 5), seed=1, cache=False)
    b, bv = _volume(tmp_path, shape=(12, 6, 10), chunks=(3, 2, 5), seed=2, cache=False)
    c, cv = _volume(tmp_path, shape=(12, 6, 10), chunks=(3, 2, 5), seed=3, cache=False)
    cases = {
        "np.where(a > b, a, b)": (lambda: np.where(a > b, a, b), np.where(av > bv, av, bv), av.nbytes + bv.nbytes),
        "np.where(c > 500, a, b).max(axis=0)": (lambda: np.where(c > 500, a, b).max(axis=0),
                                                np.where(cv > 500, av, bv).max(axis=0), 3 * av.nbytes),
        "np.clip(a, b, c)": (lambda: np.clip(a, b, c), np.clip(av, bv, cv), 3 * av.nbytes),
        "np.where(a > 500, a, 0)": (lambda: np.where(a > 500, a, 0), np.where(av > 500, av, 0), av.nbytes),
        "np.clip(a, 100, 900)": (lambda: np.clip(a, 100, 900), np.clip(av, 100, 900), av.nbytes),
        "np.where(b > 300, a, 7).max(axis=0)": (lambda: np.where(b > 300, a, 7).max(axis=0),
                                                np.where(bv > 300, av, 7).max(axis=0), av.nbytes + bv.nbytes),
        "np.clip(a - b, 0, 50).sum()": (lambda: np.clip(a - b, 0, 50).sum(), np.clip(av - bv, 0, 50).sum(),
                                        av.nbytes + bv.nbytes),
    }
    for what, (made, want, nbytes) in cases.items():
        r = made()
        before = gpulazy.stats().snapshot()["bytes_read"]
        got = r.compute(scheduler=scheduler)
        assert r.compute_path == "fast", what
        assert gpulazy.stats().snapshot()["bytes_read"] - before == nbytes, what
        np.testing.assert_array_equal(got, want, err_msg=what)
        with gpulazy.config.set(streamed_maps=False):  # dask's own tasks agree
            np.testing.assert_array_equal(made().compute(scheduler=scheduler), want, err_msg=what)


@pytest.mark.gpu
def test_an_operation_between_two_or_three_arrays_streams_on_the_gpu(tmp_path):
    import cupy

    a, av = _volume(tmp_path, shape=(40, 64, 48), chunks=(8, 32, 48), seed=1, device="cuda:0")
    b, bv = _volume(tmp_path, shape=(40, 64, 48), chunks=(8, 32, 48), seed=2, device="cuda:0")
    c, cv = _volume(tmp_path, shape=(40, 64, 48), chunks=(8, 32, 48), seed=3, device="cuda:0")
    fa = av.astype("f4")
    for r, want in (((a.astype("f4") - b), fa - bv), (np.maximum(a, b).max(axis=0), np.maximum(av, bv).max(axis=0)),
                    ((a.astype("f4") - b) / (c + 1), (fa - bv) / (cv + 1)),
                    ((a + b + c).max(axis=0), (av + bv + cv).max(axis=0)),
                    ((a.astype("f4") - b) / (a + b + 1.0), (fa - bv) / (av + bv + 1.0)),
                    (np.where(c > 500, a, b), np.where(cv > 500, av, bv)),
                    ((a.astype("f4") - b * 2).mean(axis=(1, 2)), (fa - bv * 2).mean(axis=(1, 2))),
                    (np.where(a > 500, a, 0), np.where(av > 500, av, 0)), (np.clip(a, 100, 900).sum(), np.clip(av, 100, 900).sum())):
        got = r.compute()
        assert r.compute_path == "fast" and isinstance(got, cupy.ndarray)
        np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-5)
