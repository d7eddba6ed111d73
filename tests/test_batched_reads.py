"""Derived computes read their chunks in batches (``ReadLayer``), through kept file handles."""

from __future__ import annotations

import gc

import logging
import os
import subprocess
import sys

import dask
import dask.array as da
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpulazy
from gpulazy.array import read_batch
from gpulazy.io import get_backend
from gpulazy.io._handles import HandleCache
from gpulazy.spec import ByteRange

from conftest import to_host
from test_cache import _until


@pytest.fixture(autouse=True)
def _dask_reductions():
    """These tests drive dask's per-chunk read path with reductions and maps; the streamed
    reductions and maps (``gpulazy.read.reduce``, ``gpulazy.read.mapped``, the default) are tested
    in tests/test_reduce.py and tests/test_mapped.py."""
    with gpulazy.config.set(fused_reductions=False, streamed_maps=False):
        yield


def _planes(tmp_path, n=8, shape=(4, 6), dtype="<u2"):
    data = (np.arange(n * shape[0] * shape[1]) * 7 % 1000).astype(dtype).reshape(n, *shape)
    paths = []
    for i in range(n):
        p = os.path.join(tmp_path, f"z{i:03d}.raw")
        data[i].tofile(p)
        paths.append(p)
    return paths, data


def _tasks(arr, func):
    (opt,) = dask.optimize(arr)
    return [k for k, t in dict(opt.__dask_graph__()).items() if getattr(t, "func", None) is func]


def _batch_sizes(arr):
    """Chunks read by each read task of ``arr``'s optimised graph (also inside fused tasks)."""
    from gpulazy.prefetch import find_reads

    (opt,) = dask.optimize(arr)
    return [len(find_reads(t)) for t in dict(opt.__dask_graph__()).values() if find_reads(t)]


def test_derived_computes_read_in_batches_and_equal_numpy(tmp_path, device):
    paths, data = _planes(tmp_path, n=16)
    vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device=device, cache=False)
    mip = vol.max(axis=0)
    assert _batch_sizes(mip) == [2] * 8  # 16 chunks read by 8 batch tasks (>= 8 batches)
    assert np.array_equal(to_host(mip.compute()), data.max(axis=0))
    assert np.array_equal(to_host(vol[3:11].compute()), data[3:11])
    assert to_host(vol.astype("f8").sum().compute()) == data.astype("f8").sum()
    got = vol.map_blocks(lambda b: b * 2, dtype="u2").compute(scheduler="sync")
    assert np.array_equal(to_host(got), data * 2)
    with gpulazy.config.set(batch_size=0):  # the switch: a read task per chunk again
        assert not _tasks(vol.max(axis=0), read_batch)
        assert np.array_equal(to_host(vol.max(axis=0).compute()), data.max(axis=0))


def test_batch_size_bounds_each_batch(tmp_path):
    paths, data = _planes(tmp_path, n=64)
    vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device="cpu", cache=False)
    with gpulazy.config.set(batch_size=3 * 48):
        sizes = _batch_sizes(vol.sum())
        assert max(sizes) == 3 and sum(sizes) == 64
        assert int(vol.sum().compute()) == int(data.astype("u8").sum())


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 12), c0=st.integers(1, 5), c1=st.integers(1, 4), lo=st.integers(0, 11), batch=st.integers(1, 400))
def test_batched_slices_equal_the_files(tmp_path_factory, n, c0, c1, lo, batch):
    tmp = tmp_path_factory.mktemp("b")
    paths, data = _planes(tmp, n=n)
    lo = min(lo, n - 1)
    with gpulazy.config.set(batch_size=batch):
        vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(c0, c1, 6), device="cpu", cache=False)
        assert np.array_equal(vol[lo:, 1:].compute(scheduler="sync"), data[lo:, 1:])
        assert np.array_equal(vol.max(axis=1).compute(), data.max(axis=1))


def test_batches_fill_and_then_hit_the_cache(tmp_path):
    paths, data = _planes(tmp_path, n=16)
    cache = gpulazy.DeviceCache("1 MiB", device="cpu", name="test-batched-cache")
    try:
        vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device="cpu", cache=cache)
        assert np.array_equal(vol.max(axis=0).compute(), data.max(axis=0))
        s = cache.stats()
        assert s["misses"] == 16 and s["loads"] == 16 and len(cache) == 16
        assert np.array_equal(vol.min(axis=0).compute(), data.min(axis=0))
        assert cache.stats()["hits"] == 16 and cache.stats()["loads"] == 16  # nothing read again
    finally:
        cache.close()


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_a_pass_larger_than_the_cache_hands_its_chunks_out_uncached(tmp_path, scheduler):
    """A compute whose batches read more bytes through a cache than it holds would copy every chunk
    into the cache and evict it before any reuse: its chunks go to their tasks as read, nothing
    copied or cached. A compute that fits is cached as before, and a second one hits."""
    paths, data = _planes(tmp_path, n=16)  # 16 chunks of 48 bytes: 768 bytes
    for capacity, kept in ((700, False), (800, True)):
        cache = gpulazy.DeviceCache(capacity, device="cpu", name=f"test-batched-one-use-{capacity}")
        try:
            vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device="cpu", cache=cache)
            twice = vol.map_blocks(lambda b: b * 2, dtype="u2")
            before = gpulazy.stats().snapshot()["buffers"]["copies"]
            assert np.array_equal(twice.compute(scheduler=scheduler), data * 2)
            copies = gpulazy.stats().snapshot()["buffers"]["copies"] - before
            s = cache.stats()
            if kept:
                assert copies == 16 and s["loads"] == 16 and len(cache) == 16
                assert np.array_equal(vol.max(axis=0).compute(scheduler=scheduler), data.max(axis=0))
                assert cache.stats()["hits"] == 16 and cache.stats()["loads"] == 16
            else:
                assert copies == 0 and s["loads"] == 0 and len(cache) == 0 and cache.bytes_held == 0
        finally:
            cache.close()


def test_a_read_error_in_a_batch_names_the_file(tmp_path):
    paths, _ = _planes(tmp_path, n=8)
    vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device="cpu", cache=False)
    with open(paths[5], "r+b") as f:
        f.truncate(10)
    with pytest.raises(gpulazy.errors.ChunkReadError, match="z005.raw") as info:
        vol.max(axis=0).compute()
    assert info.value.__cause__ is not info.value  # never its own cause


def test_read_tasks_travel_to_other_processes_still_unfused():
    """What dask.distributed does to a task: pickled (cloudpickle for the graph), it is still a
    ``ReadTask`` that dask's fusion leaves alone, with the same key and dependencies."""
    import pickle

    import cloudpickle
    from dask._task_spec import TaskRef

    from gpulazy._readlayer import ReadTask
    from gpulazy.array import pick

    task = ReadTask(("a", 0), pick, TaskRef(("b", 0)), 1)
    for dumps in (pickle.dumps, cloudpickle.dumps):
        back = pickle.loads(dumps(task))
        assert type(back) is ReadTask and back.block_fusion
        assert back.key == ("a", 0) and back.dependencies == frozenset({("b", 0)}) and back.args[1] == 1


def test_distributed_runs_batched_graphs(tmp_path):
    distributed = pytest.importorskip("distributed")
    paths, data = _planes(tmp_path, n=16)
    vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device="cpu", cache=False)
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=2, dashboard_address=":0"):
        assert np.array_equal(vol.max(axis=0).compute(), data.max(axis=0))


# -- the file handle cache -------------------------------------------------------------------

def test_handle_cache_keeps_files_open_and_reopens_a_changed_file(tmp_path):
    p = str(tmp_path / "a.bin")
    with open(p, "wb") as f:
        f.write(b"old-bytes")
    hc = HandleCache(lambda path: os.open(path, os.O_RDONLY), os.close, capacity=2)
    h = hc.acquire(p)
    assert os.pread(h.obj, 3, 0) == b"old"
    hc.release(h)
    assert hc.acquire(p) is h and hc.opened == 1
    hc.release(h)
    tmp = str(tmp_path / "a.new")
    with open(tmp, "wb") as f:
        f.write(b"new-bytes")
    os.replace(tmp, p)  # a new inode at the same path
    h2 = hc.acquire(p)
    assert h2 is not h and os.pread(h2.obj, 3, 0) == b"new" and hc.opened == 2
    hc.release(h2)
    with open(p, "ab") as f:  # same inode, new size
        f.write(b"!")
    h3 = hc.acquire(p)
    assert h3 is not h2 and hc.opened == 3
    hc.release(h3)
    hc.close()


def test_handle_cache_never_closes_a_handle_in_use(tmp_path):
    closed = []
    paths = []
    for i in range(5):
        p = str(tmp_path / f"f{i}")
        open(p, "wb").write(b"x")
        paths.append(p)
    hc = HandleCache(lambda path: path, closed.append, capacity=1)
    held = [hc.acquire(p) for p in paths[:4]]
    assert closed == []  # over capacity, but every handle is in use
    for h in held:
        hc.release(h)
    hc.acquire(paths[4])  # opening another evicts idle ones down to the capacity
    assert set(closed) == set(paths[:4])


def test_posix_backend_rereads_a_replaced_file(tmp_path):
    p = str(tmp_path / "r.bin")
    open(p, "wb").write(bytes(range(16)))
    be = get_backend("posix", "cpu")
    out = np.empty(4, np.uint8)
    be.read_into([ByteRange(p, 0, 4)], out)
    assert out.tolist() == [0, 1, 2, 3]
    tmp = str(tmp_path / "r.tmp")
    open(tmp, "wb").write(bytes(range(100, 116)))
    os.replace(tmp, p)
    be.read_into([ByteRange(p, 0, 4)], out)
    assert out.tolist() == [100, 101, 102, 103]


def test_import_changes_no_global_behaviour():
    # Neither CuPy's stream mode nor dask's array optimisation is switched by gpulazy.
    code = ("import os, dask, gpulazy, numpy as np, tempfile; d = tempfile.mkdtemp(); "
            "np.zeros(8, 'u1').tofile(d + '/a'); gpulazy.from_files(d + '/a', dtype='u1', device='cpu').sum().compute(); "
            "print(os.environ.get('CUPY_CUDA_PER_THREAD_DEFAULT_STREAM'), dask.config.get('array_optimize', None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["None", "None"]


def test_registered_prefetch_keeps_a_read_task_per_chunk(tmp_path):
    from dask.callbacks import Callback

    paths, data = _planes(tmp_path, n=16)
    vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device="cpu", cache=False)
    assert _batch_sizes(vol.max(axis=0)) == [2] * 8
    with gpulazy.prefetch(depth=4):
        assert _batch_sizes(vol.max(axis=0)) == [1] * 16
    with Callback():  # any other callback: still batched
        assert _batch_sizes(vol.max(axis=0)) == [2] * 8


# -- the read window: batches started in order, ahead of their tasks ---------------------------

def _spy_starts(monkeypatch, claims=None):
    """Record the first chunk index of every batch ``CachedBatch.start`` submits, and the window's bytes
    (and in ``claims`` the batches in the order their tasks claimed them)."""
    from gpulazy.read import cached, window

    started, inflight = [], []
    real = cached.CachedBatch.start.__func__

    def start(cls, source, specs, **kw):
        started.append(specs[0].index[0])
        return real(cls, source, specs, **kw)

    monkeypatch.setattr(cached.CachedBatch, "start", classmethod(start))
    top_up, claim = window.ReadWindow._top_up, window.ReadWindow.claim

    def spy_top_up(self, upcoming):
        top_up(self, upcoming)
        inflight.append((self._inflight, self.ahead))

    def spy_claim(self, j):
        if claims is not None:
            claims.append(self.batches[j][0].index[0])
        return claim(self, j)

    monkeypatch.setattr(window.ReadWindow, "_top_up", spy_top_up)
    monkeypatch.setattr(window.ReadWindow, "claim", spy_claim)
    return started, inflight


@pytest.mark.parametrize("ahead_batches", [0.5, 1, 3, 100])
def test_every_batch_is_started_once_within_read_ahead(tmp_path, monkeypatch, ahead_batches):
    paths, data = _planes(tmp_path, n=16)
    vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device="cpu", cache=False)
    started, inflight = _spy_starts(monkeypatch)
    batch_bytes = 2 * 4 * 6 * 2  # 8 batches of 2 planes
    with gpulazy.config.set(read_ahead=int(ahead_batches * batch_bytes)):
        assert np.array_equal(vol.max(axis=0).compute(scheduler="sync"), data.max(axis=0))
        assert vol.astype("f8").sum().compute(scheduler="sync") == data.astype("f8").sum()
    assert sorted(started) == sorted(2 * list(range(0, 16, 2)))  # every batch once per compute
    assert inflight and all(n <= ahead for n, ahead in inflight)


def _window_over(tmp_path, n, per_batch, ahead_batches):
    from gpulazy.read.window import ReadWindow

    paths, data = _planes(tmp_path, n=n)
    vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device="cpu", cache=False)
    specs = tuple(vol.chunk_index.specs.values())
    batches = [specs[i:i + per_batch] for i in range(0, n, per_batch)]
    nbytes = per_batch * 4 * 6 * 2
    return ReadWindow(batches, vol.chunk_source, ahead_batches * nbytes), data, nbytes


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [5, 2, 3, 4, 1, 0], [3, 0, 5, 1, 4, 2]])
def test_the_window_reads_ahead_in_the_direction_tasks_claim(tmp_path, monkeypatch, order):
    window, data, nbytes = _window_over(tmp_path, 12, 2, 2)
    started, inflight = _spy_starts(monkeypatch)
    for j in order:
        got = window.load(j)
        assert np.array_equal(np.concatenate(got), data[2 * j: 2 * j + 2])  # its own batch, whatever was started
    assert sorted(started) == list(range(0, 12, 2)) and all(n <= 2 * nbytes for n, _ in inflight)
    if order == [5, 4, 3, 2, 1, 0]:  # the first claim guesses downwards, as dask mostly runs roots
        assert started == [10, 8, 6, 4, 2, 0] and inflight[0][0] == 2 * nbytes
        assert (window.read_ahead, window.started_by_task) == (5, 1)
    if order == [0, 1, 2, 3, 4, 5]:  # the guess wraps around to 5 and 4; the claims then learn upwards
        assert started == [0, 10, 8, 2, 4, 6] and inflight[0][0] == 2 * nbytes
    if order == [5, 2, 3, 4, 1, 0]:  # 4, 3 read ahead; 2 claimed out of turn; then the guess is upwards
        assert started == [10, 8, 6, 4, 0, 2] and window.started_by_task == 2  # (wrapping to 0, 1): 1 misses


def test_a_given_order_is_read_ahead_from_the_start(tmp_path, monkeypatch):
    window, data, nbytes = _window_over(tmp_path, 12, 2, 2)
    started, inflight = _spy_starts(monkeypatch)
    order = [3, 0, 5, 1, 4, 2]
    window.set_order(order)
    assert started == [6, 0] and window._inflight == 2 * nbytes  # before any task ran
    for j in order:
        assert np.array_equal(np.concatenate(window.load(j)), data[2 * j: 2 * j + 2])
    assert started == [2 * j for j in order] and all(n <= 2 * nbytes for n, _ in inflight)
    assert (window.read_ahead, window.started_by_task) == (6, 0)


def test_each_chunk_of_a_batch_is_handed_out_on_its_own(tmp_path):
    window, data, _ = _window_over(tmp_path, 8, 4, 0)
    batch = read_batch(window.batches[0], window.source, window, 0)  # submitted, not waited for
    with open(window.batches[0][3].paths[0], "ab") as f:  # z003.raw, the batch's last chunk, changes
        f.write(b"more")
    for i in (2, 0, 1):  # the others are handed out, in any order, each equal to its file
        assert np.array_equal(gpulazy.array.pick(batch, i), data[i:i + 1])
    with pytest.raises(gpulazy.errors.GpulazyError, match="z003.raw"):
        batch.chunk(3)
    assert np.array_equal(np.concatenate(window.load(1)), data[4:])


def test_the_window_under_threads_reads_each_batch_once(tmp_path, monkeypatch):
    paths, data = _planes(tmp_path, n=32)
    vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device="cpu", cache=False)
    started, inflight = _spy_starts(monkeypatch)
    for _ in range(3):
        started.clear()
        assert np.array_equal(vol[5:].max(axis=0).compute(scheduler="threads"), data[5:].max(axis=0))
        assert len(started) == len(set(started)) == 7  # 27 chunks in batches of 4, each started once
    assert all(n <= ahead for n, ahead in inflight)


def test_read_ahead_zero_reads_each_batch_in_its_task(tmp_path, monkeypatch):
    paths, data = _planes(tmp_path, n=16)
    vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device="cpu", cache=False)
    started, inflight = _spy_starts(monkeypatch)
    with gpulazy.config.set(read_ahead=0):
        assert np.array_equal(vol.max(axis=0).compute(scheduler="sync"), data.max(axis=0))
    assert sorted(started) == list(range(0, 16, 2)) and not inflight  # no window: nothing topped up


def test_a_pickled_window_reads_its_own_batch(tmp_path):
    import pickle

    from gpulazy.read.window import ReadWindow

    paths, data = _planes(tmp_path, n=4)
    vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device="cpu", cache=False)
    specs = tuple(vol.chunk_index.specs.values())
    window = ReadWindow([specs[:2], specs[2:]], vol.chunk_source, 1 << 20)
    assert pickle.loads(pickle.dumps(window)) is None  # another process: no shared window
    assert np.array_equal(np.concatenate(read_batch(specs[2:], vol.chunk_source, None, 1)), data[2:])
    assert np.array_equal(np.concatenate(read_batch(specs[2:], vol.chunk_source, window, 1).result()), data[2:])
    assert np.array_equal(np.concatenate(read_batch(specs[:2], vol.chunk_source, window, 0).result()), data[:2])


@settings(max_examples=40, deadline=None)
@given(data=st.data(), nbatches=st.integers(1, 7), per_batch=st.integers(1, 3), ahead=st.integers(0, 5),
       ordered=st.booleans())
def test_any_claim_and_pick_order_reads_each_batch_once_within_read_ahead(tmp_path_factory, data, nbatches,
                                                                           per_batch, ahead, ordered):
    with pytest.MonkeyPatch.context() as mp:
        _claims_and_picks(tmp_path_factory.mktemp("w"), mp, data, nbatches, per_batch, ahead, ordered)


def _claims_and_picks(tmp, monkeypatch, data, nbatches, per_batch, ahead, ordered):
    window, planes, nbytes = _window_over(tmp, nbatches * per_batch, per_batch, ahead)
    started, inflight = _spy_starts(monkeypatch)
    order = data.draw(st.permutations(range(nbatches)))
    if ordered:  # told an order (a prefetch callback's), maybe not the one the claims take
        window.set_order(data.draw(st.permutations(range(nbatches))))
    claimed = {}
    picks = [(j, i) for j in range(nbatches) for i in range(per_batch)]
    steps = data.draw(st.permutations(picks))  # every chunk picked once, in any order; its batch claimed first
    for j, i in steps:
        if j not in claimed:
            claimed[j] = window.claim(j)
        got = gpulazy.array.pick(claimed[j], i)
        k = j * per_batch + i
        assert np.array_equal(got, planes[k:k + 1])
    assert sorted(started) == [j * per_batch for j in range(nbatches)]  # each batch read once
    assert all(n <= ahead * nbytes for n, _ in inflight) and window._inflight == 0
    assert window.read_ahead + window.started_by_task == nbatches
    j = data.draw(st.sampled_from(order))  # a batch task run again (a retry): read again, same bytes
    assert np.array_equal(np.concatenate(window.load(j)), planes[j * per_batch:(j + 1) * per_batch])
    assert len(started) == nbatches + 1 and window._inflight == 0


def test_the_chunks_of_one_batch_picked_from_many_threads_at_once(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    window, data, _ = _window_over(tmp_path, 32, 16, 1)
    for _ in range(5):
        batches = [window.claim(0), window.claim(1)]
        work = [(j, i) for j in (0, 1) for i in range(16)] * 2  # each chunk asked for twice
        np.random.default_rng(_).shuffle(work)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda ji: gpulazy.array.pick(batches[ji[0]], ji[1]), work))
        for (j, i), arr in zip(work, got):
            assert np.array_equal(arr, data[16 * j + i:16 * j + i + 1])


def test_a_read_ahead_batch_that_fails_raises_in_its_own_task(tmp_path, monkeypatch):
    window, data, _ = _window_over(tmp_path, 12, 2, 100)
    os.unlink(window.batches[2][1].paths[0])  # z005.raw, in batch 2
    started, _ = _spy_starts(monkeypatch)
    assert np.array_equal(np.concatenate(window.load(0)), data[:2])  # reads ahead 5, 4, 3 and 2 (it fails)
    assert started == [0, 10, 8, 6, 4, 2]
    assert np.array_equal(np.concatenate(window.load(1)), data[2:4])
    with pytest.raises(gpulazy.errors.GpulazyError, match="z005.raw"):
        window.load(2)
    assert np.array_equal(np.concatenate(window.load(3)), data[6:8])


def test_a_missing_file_fails_the_compute_naming_it_under_both_schedulers(tmp_path):
    paths, data = _planes(tmp_path, n=16)
    vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 4, 6), device="cpu", cache=False)
    os.unlink(paths[13])
    for scheduler in ("sync", "threads"):
        with pytest.raises(gpulazy.errors.GpulazyError, match="z013.raw"):
            vol.max(axis=0).compute(scheduler=scheduler)


def test_a_chunk_key_names_the_same_task_in_every_distributed_compute(tmp_path):
    """Batch names come from the keys culled, so ``distributed`` never sees a key change its task."""
    distributed = pytest.importorskip("distributed")
    import warnings

    paths, data = _planes(tmp_path, n=16)
    vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 2, 6), device="cpu", cache=False)
    log = _Records()
    logger = logging.getLogger("distributed")
    logger.addHandler(log)
    try:
        with warnings.catch_warnings(record=True) as caught, distributed.Client(
                processes=False, n_workers=1, threads_per_worker=2, dashboard_address=":0") as client:
            warnings.simplefilter("always")
            for _ in range(3):
                assert np.array_equal(vol.compute(), data)
                # Two reductions in flight at once: the second graph meets the first one's keys alive.
                mip, total, whole = client.compute([vol.max(axis=0), vol.sum(), vol])
                assert np.array_equal(mip.result(), data.max(axis=0))
                assert int(total.result()) == int(data.astype("u8").sum())
                assert np.array_equal(whole.result(), data)
                del mip, total, whole
    finally:
        logger.removeHandler(log)
    said = log.messages + [str(w.message) for w in caught]
    assert not [m for m in said if "Detected different `run_spec`" in m]


class _Records(logging.Handler):
    """Keeps the messages logged (distributed's loggers do not propagate to pytest's caplog)."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _error_text(call, kind) -> str:
    """The message of the ``kind`` error ``call()`` raises, keeping no reference to it (a held
    exception keeps distributed's futures, and so the failed keys, alive)."""
    try:
        call()
    except kind as e:
        return str(e)
    raise AssertionError(f"{kind.__name__} not raised")


def _tasks_held(dask_scheduler):
    return len(dask_scheduler.tasks)


def test_a_distributed_compute_after_a_failed_one_reads_again(tmp_path):
    """Batches named by their keys are not taken from a failed compute: the retry reads the file."""
    distributed = pytest.importorskip("distributed")
    import fault_backend

    paths, data = _planes(tmp_path, n=16)
    fault_backend.install({"fault": "eio", "match": "z005", "times": 1})
    try:
        vol = gpulazy.from_files(paths, shape=(4, 6), dtype="<u2", chunks=(1, 2, 6), device="cpu", cache=False,
                                 backend=fault_backend.NAME)
        with distributed.Client(processes=False, n_workers=1, threads_per_worker=2, dashboard_address=":0") as client:
            assert "z005.raw" in _error_text(lambda: vol.max(axis=0).compute(), gpulazy.errors.ChunkReadError)
            # Nothing holds the failed compute now (no exception, no traceback, no future); once the
            # client's release has reached the scheduler (which forgets the failed tasks), the retry reads.
            # (Not waited for, the retry raced the release: one CI run got the failed batch again.)
            gc.collect()
            _until(lambda: client.run_on_scheduler(_tasks_held) == 0)
            assert np.array_equal(vol.max(axis=0).compute(), data.max(axis=0))
    finally:
        fault_backend.uninstall()


@pytest.mark.parametrize(("soft", "want"), [(1024, 256), (20000, 4096), (100, 64), (8192, 2048)])
def test_handles_kept_open_follow_the_open_file_limit(monkeypatch, soft, want):
    resource = pytest.importorskip("resource")
    from gpulazy.io._handles import default_capacity

    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, 1 << 20))
    assert default_capacity() == want
    assert HandleCache(lambda p: p, lambda o: None).capacity == want
