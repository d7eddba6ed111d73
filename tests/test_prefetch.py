"""Read-ahead: the policy alone, read discovery, and the local-scheduler callback."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections import OrderedDict

import dask
import dask.array as da
import numpy as np
import pytest
from dask.callbacks import Callback
from hypothesis import given, settings
from hypothesis import strategies as st

import gpulazy
from gpulazy.array import ChunkSource, load_chunk
from gpulazy.cache import DeviceCache
from gpulazy.errors import ChunkReadError
from gpulazy.prefetch import CACHE_FRACTION, ReadAheadPlan, find_reads
from gpulazy.spec import ByteRange, ChunkSpec, file_identity
from gpulazy.testing import wait_for_idle as wait_idle

from conftest import to_host


@pytest.fixture(autouse=True)
def _dask_reductions():
    """These tests drive dask's per-chunk read path with reductions and maps; the streamed
    reductions and maps (``gpulazy.read.reduce``, ``gpulazy.read.mapped``, the default) are tested
    in tests/test_reduce.py and tests/test_mapped.py."""
    with gpulazy.config.set(fused_reductions=False, streamed_maps=False):
        yield


def specs_of(sizes):
    """One 1-D uint8 chunk per size, each a distinct byte range of a notional file."""
    out, offset = [], 0
    for i, n in enumerate(sizes):
        out.append(ChunkSpec((ByteRange("f.raw", offset, n),), (n,), "u1", index=(i,)))
        offset += n
    return out


# --------------------------------------------------------------------------- policy


def test_plan_depth_and_budget():
    specs = specs_of([100] * 10)
    plan = ReadAheadPlan(specs, depth=3, budget=10_000)
    assert [s for _, s in plan.next_reads()] == specs[:3]
    assert plan.next_reads() == []  # nothing new until the scheduler moves
    plan.consume([specs[0].key])
    assert [s for _, s in plan.next_reads()] == [specs[3]]
    plan = ReadAheadPlan(specs, depth=10, budget=250)
    assert [s for _, s in plan.next_reads()] == specs[:2]
    assert plan.outstanding_bytes == 200


def test_gathered_reads_start_half_a_window_at_a_time():
    specs = specs_of([100] * 12)
    plan = ReadAheadPlan(specs, depth=4, budget=10_000)
    assert [s for _, s in plan.next_reads(gather=True)] == specs[:4]
    plan.consume([specs[0].key])
    assert plan.next_reads(gather=True) == []                  # one due of a window of four
    plan.consume([specs[1].key])
    assert [s for _, s in plan.next_reads(gather=True)] == specs[4:6]   # half the window: together
    plan.consume([specs[i].key for i in (2, 3, 4, 5)])           # fell behind: the next read is due
    assert [s for _, s in plan.next_reads(gather=True)] == specs[6:10]
    plan.consume([specs[i].key for i in (6, 7, 8)])
    assert [s for _, s in plan.next_reads(gather=True)] == specs[10:]   # the last reads: at once


def test_plan_big_chunk_blocks_what_follows():
    # Order first: a chunk too big for the budget is left to its task, and nothing
    # behind it jumps the queue (it would be warmed too early).
    specs = specs_of([100, 1000, 100, 100])
    plan = ReadAheadPlan(specs, depth=8, budget=500)
    assert [s for _, s in plan.next_reads()] == [specs[0]]
    plan.consume([specs[0].key])
    assert plan.next_reads() == []
    plan.consume([specs[1].key])
    assert [s for _, s in plan.next_reads()] == specs[2:]


def test_plan_cached_chunks_take_their_place():
    specs = specs_of([100] * 6)
    cached = {specs[1].key}
    plan = ReadAheadPlan(specs, depth=3, budget=10_000)
    got = [s for _, s in plan.next_reads(lambda s: s.key in cached)]
    assert got == [specs[0], specs[2]]  # chunk 1 is held already, chunk 3 is beyond depth


def test_plan_set_order_cancels_stale():
    specs = specs_of([100] * 8)
    plan = ReadAheadPlan(specs, depth=4, budget=10_000)
    plan.next_reads()
    plan.consume([specs[0].key])
    # The scheduler now plans 5, 6, 2, 7: issued 1 and 3 are stale, 2 stays.
    stale = plan.set_order([specs[i] for i in (5, 6, 2, 7)])
    assert {s.key for s in stale} == {specs[1].key, specs[3].key}
    assert [s for _, s in plan.next_reads()] == [specs[5], specs[6], specs[7]]
    assert {s.key for s in plan.outstanding} == {specs[i].key for i in (2, 5, 6, 7)}
    assert plan.set_order([]) and plan.outstanding == []


def test_plan_read_ids_and_duplicates():
    specs = specs_of([10, 10])
    plan = ReadAheadPlan([("a", specs[0]), ("b", specs[1]), ("a", specs[1])], depth=5, budget=100)
    assert [rid for rid, _ in plan.next_reads()] == ["a", "b"]
    assert plan.remaining == 2
    plan.consume(["a", "unknown"])
    assert plan.remaining == 1 and plan.window() == ["b"]
    assert "depth=5" in repr(plan)


@pytest.mark.parametrize("kw", [{"depth": -1, "budget": 1}, {"depth": 1, "budget": -5}])
def test_plan_rejects_negative(kw):
    with pytest.raises(ValueError, match="must be >= 0"):
        ReadAheadPlan(**kw)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=40),
    depth=st.integers(0, 8),
    budget=st.integers(0, 300),
    jitter=st.lists(st.integers(0, 2), max_size=40),
    cached=st.sets(st.integers(0, 39), max_size=10),
    gather=st.booleans(),
)
def test_plan_invariants(sizes, depth, budget, jitter, cached, gather):
    """Budget and depth never exceeded; a read is issued only after every earlier one; gathered,
    the read needed next is never left unissued."""
    specs = specs_of(sizes)
    cached_keys = {specs[i].key for i in cached if i < len(specs)}
    plan = ReadAheadPlan(specs, depth=depth, budget=budget)
    remaining = list(range(len(specs)))
    issued: set[str] = set()
    step = 0
    while remaining:
        for _, s in plan.next_reads(lambda s: s.key in cached_keys, gather=gather):
            assert s.key not in issued, "a read was issued twice"
            issued.add(s.key)
        window = plan.window()
        if window and window[0] not in cached_keys:
            assert window[0] in issued, "the read needed next was held back"
        out = plan.outstanding
        assert plan.outstanding_bytes <= budget
        assert len(out) <= depth
        assert plan.peak_outstanding_bytes <= budget
        # Order: before any outstanding read, every unconsumed read is outstanding or cached.
        if out:
            last = max(specs.index(s) for s in out)
            for i in remaining:
                if i < last:
                    assert specs[i] in out or specs[i].key in cached_keys
        # The scheduler starts the next read, sometimes one a little out of order.
        j = jitter[step] if step < len(jitter) else 0
        idx = remaining.pop(min(j, len(remaining) - 1))
        plan.consume([specs[idx].key])
        step += 1
    assert plan.outstanding == [] and plan.remaining == 0


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=60),
       capacity=st.integers(50, 400), depth=st.integers(1, 10))
def test_half_capacity_budget_never_evicts_a_warmed_chunk(sizes, capacity, depth):
    """With a plain LRU (no pinning) and budget = capacity/2, no warmed chunk is evicted unused."""
    specs = specs_of(sizes)
    plan = ReadAheadPlan(specs, depth=depth, budget=int(capacity * CACHE_FRACTION))
    lru: OrderedDict[str, int] = OrderedDict()

    def insert(spec):
        if spec.out_nbytes > capacity:
            return
        while sum(lru.values()) + spec.out_nbytes > capacity:
            lru.popitem(last=False)
        lru[spec.key] = spec.out_nbytes

    for spec in specs:
        for _, s in plan.next_reads(lambda s: s.key in lru):
            insert(s)
        warmed = {s.key for s in plan.outstanding}
        assert spec.key not in warmed or spec.key in lru, "a warmed chunk was evicted before use"
        plan.consume([spec.key])
        if spec.key in lru:
            lru.move_to_end(spec.key)  # a hit
        else:
            insert(spec)  # a miss, read by the task


# --------------------------------------------------------------------------- finding reads


SPEC = ChunkSpec((ByteRange("f.raw", 0, 8),), (8,), "u1")
SRC = ChunkSource("cpu", cache=False)


def test_find_reads_in_task_shapes():
    from dask._task_spec import DataNode, List, Task, TaskRef

    assert find_reads((load_chunk, SPEC, SRC)) == [(SPEC, SRC)]
    assert find_reads((sum, [(load_chunk, SPEC, SRC), 1])) == [(SPEC, SRC)]
    assert find_reads(Task("k", load_chunk, SPEC, SRC)) == [(SPEC, SRC)]
    assert find_reads(Task("k", load_chunk, DataNode(None, SPEC), DataNode(None, SRC))) == [(SPEC, SRC)]
    assert find_reads(Task("k", functools.partial(load_chunk, SPEC), SRC)) == []  # spec bound: not ours
    assert find_reads(Task("k", load_chunk, spec=SPEC, source=SRC)) == [(SPEC, SRC)]
    assert find_reads(Task("k", sum, List(Task(None, load_chunk, SPEC, SRC)))) == [(SPEC, SRC)]
    fused = Task.fuse(Task("a", load_chunk, SPEC, SRC), Task("b", np.negative, TaskRef("a")))
    assert find_reads(fused) == [(SPEC, SRC)]
    assert find_reads(Task("k", sum, [1, 2])) == [] and find_reads(42) == [] and find_reads("x") == []


def test_reads_are_tasks_of_their_own_that_dask_never_fuses(tmp_path):
    """Each chunk's read is its own task under the array's key: dask's linear fusion, which would
    merge it with the one task using it and leave an alias under the old key, leaves it alone
    (``ReadTask``). (Batched reads: ``test_a_map_blocks_runs_a_read_and_a_compute_a_chunk...``.)"""
    from dask._task_spec import Alias

    vol, data = make_volume(tmp_path, n=6, cache=False)
    x = (vol.map_blocks(np.negative) * 2).sum()
    seen = {}

    with gpulazy.config.set(batch_size=0), Callback(start=seen.update):
        got = x.compute()
    assert got == (np.negative(data) * 2).sum()
    reads = {k: find_reads(t) for k, t in seen.items() if find_reads(t)}
    assert sorted(reads) == [(vol.name, i, 0) for i in range(6)]
    assert all(len(r) == 1 and r[0][0].index == k[1:] for k, r in reads.items())
    # what uses the reads runs after them: no alias points at a task that reads
    assert not any(type(t) is Alias and t.target in reads for t in seen.values())


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
@pytest.mark.parametrize("prefetched", [False, True])
def test_a_map_blocks_runs_a_read_and_a_compute_a_chunk_and_no_alias(tmp_path, cache, scheduler, prefetched):
    """Fused with the ``map_blocks`` over it, a chunk's read became a task named after both plus an
    ``Alias`` task under the old key (2 n + 1 tasks for n chunks, each fused task running its
    subgraph through ``execute_graph``). Unfused, each chunk runs its read (or its pick from a read
    batch) and its compute, with the file's values; no task is an alias."""
    from dask._task_spec import Alias

    vol, data = make_volume(tmp_path, n=12, cache=cache)
    ran: list = []
    aliases: list = []
    count = Callback(start=lambda dsk: aliases.extend(k for k, t in dsk.items() if type(t) is Alias),
                     posttask=lambda key, result, dsk, state, worker: ran.append(key))
    twice = vol.map_blocks(lambda b: b * 2, dtype=vol.dtype)
    with (gpulazy.prefetch(depth=3) if prefetched else contextlib.nullcontext()), count:
        got = twice.compute(scheduler=scheduler)
    np.testing.assert_array_equal(to_host(got), data * 2)
    assert aliases == []
    chunks = [k for k in ran if isinstance(k, tuple) and k[0] in (vol.name, twice.name)]
    assert sorted(chunks) == sorted([(vol.name, i, 0) for i in range(12)] + [(twice.name, i, 0) for i in range(12)])
    batches = [k for k in ran if isinstance(k, tuple) and k[0].startswith("read-batch-")]
    assert len(ran) == 2 * 12 + len(batches) + 1 and (batches == []) == prefetched
    if prefetched:
        s = cache.stats()
        assert s["prefetched"] > 0 and s["prefetch_hits"] > 0, s


def test_a_prefetched_compute_walks_each_read_task_once(tmp_path, cache, monkeypatch):
    """The plan walks the graph's tasks for their reads once a compute (a graph of 100,000 chunks
    walked twice took as long again)."""
    from gpulazy.prefetch import local

    vol, data = make_volume(tmp_path, n=12, cache=cache)
    walked: list = []

    def counted(task):
        reads = find_reads(task)
        if reads:
            walked.append(reads)
        return reads

    monkeypatch.setattr(local, "find_reads", counted)
    with gpulazy.prefetch(depth=3) as p:
        got = vol.map_blocks(lambda b: b + 1, dtype=vol.dtype).compute(scheduler="sync")
    np.testing.assert_array_equal(to_host(got), data + 1)
    assert len(walked) == 12 and p.last_summary["reads"] == 12


@pytest.mark.parametrize("graph", ["fused", "legacy", "a reduction"])
def test_the_plan_from_the_schedulers_ready_list_is_dask_orders(tmp_path, graph):
    """``plan_graph`` takes the read tasks' order from the local scheduler's ready list when
    every read task is in it; that order is ``dask.order``'s (and a graph whose reads are not
    all ready is ordered by ``dask.order`` itself)."""
    from gpulazy.prefetch import plan_graph
    from gpulazy.prefetch.plan import ReadAhead

    c = DeviceCache("16 MiB", device="cpu", name=f"test-plan-ready-{graph}")
    try:
        if graph == "legacy":
            vol, _ = legacy_volume(tmp_path, n=24, rows=4, cols=64, cache_name=c.name)
            x = vol.map_blocks(np.negative)
        else:
            vol, _ = make_volume(tmp_path, n=24, rows=4, cols=64, cache=c)
            x = vol.map_blocks(np.negative) if graph == "fused" else (vol.astype("f8") ** 2).sum(axis=1)
        seen = {}

        def start_state(dsk, state):
            seen["dsk"], seen["ready"] = dsk, list(state["ready"])

        with gpulazy.prefetch(depth=4), Callback(start_state=start_state):  # the graph a prefetch sees
            x.compute(scheduler="sync")
        orders = []
        for ready in (seen["ready"], None, seen["ready"][:-1]):  # the last: one read task left out
            windows: dict = {}
            by_task = plan_graph(seen["dsk"], ReadAhead(depth=4, only=c), windows, ready=ready)
            orders.append(([spec.index for reads in by_task.values() for _, spec in reads],
                           [batches for _, batches in windows.values()]))
        reads, batches = orders[0]
        assert len(reads) == 24 or sum(map(len, batches)) > 1  # chunk tasks, or a window's batches
        assert orders[0] == orders[1] == orders[2]
    finally:
        c.close()


# --------------------------------------------------------------------------- local scheduler


def make_volume(tmp_path, *, n=32, rows=16, cols=256, device="cpu", cache=None, name="vol.raw"):
    """A raw uint16 file of ``n`` chunks of ``rows x cols`` and its lazy array."""
    path = os.path.join(tmp_path, name)
    data = np.arange(n * rows * cols, dtype="uint16").reshape(n * rows, cols)
    data.tofile(path)
    vol = gpulazy.from_files(path, shape=data.shape, dtype="uint16", chunks=(rows, cols), device=device,
                             cache=cache)
    return vol, data


def legacy_volume(tmp_path, *, n, rows, cols, cache_name):
    """The same kind of array as an old-style tuple graph (``{key: (load_chunk, spec, source)}``)."""
    from dask.highlevelgraph import HighLevelGraph

    path = os.path.join(tmp_path, "legacy.raw")
    data = np.arange(n * rows * cols, dtype="uint16").reshape(n * rows, cols)
    data.tofile(path)
    ident = (file_identity(path),)
    source = ChunkSource("cpu", cache=cache_name)
    name = "legacy-vol"
    nb = rows * cols * 2
    dsk = {(name, i, 0): (load_chunk, ChunkSpec((ByteRange(path, i * nb, nb),), (rows, cols), "<u2",
                                                identity=ident, index=(i, 0)), source)
           for i in range(n)}
    graph = HighLevelGraph.from_collections(name, dsk)
    return da.Array(graph, name, ((rows,) * n, (cols,)), meta=np.empty((0, 0), "uint16")), data


@pytest.fixture
def cache(request):
    c = DeviceCache("16 MiB", device="cpu", name=f"test-prefetch-{request.node.name}")
    yield c
    c.close()


def read_share(stats) -> float:
    """Share of chunk gets served by a chunk the prefetcher read."""
    gets = stats["hits"] + stats["misses"]
    return stats["prefetch_hits"] / gets if gets else 0.0


@pytest.mark.parametrize("scheduler", ["threads", "sync"])
def test_hit_rate_on_a_reduction(tmp_path, cache, scheduler):
    vol, data = make_volume(tmp_path, n=64, cache=cache)
    p = gpulazy.prefetch(depth=8)
    # A fixed pool: the first ``num_workers`` tasks start together and read their own
    # chunks (beyond ``depth``), however many cores the test machine has.
    kw = {"num_workers": 2} if scheduler == "threads" else {}
    with p:
        got = (vol.astype("f8") ** 2).sum().compute(scheduler=scheduler, **kw)
    assert got == (data.astype("f8") ** 2).sum()
    s = cache.stats()
    assert s["hits"] + s["misses"] == 64 and s["loads"] == 64  # every chunk read exactly once
    assert read_share(s) >= 0.9, s
    assert s["prefetched"] == s["prefetch_hits"]  # nothing warmed in vain
    assert s["queued"] == 0
    summary = p.last_summary
    assert summary["reads"] == 64 and summary["errored"] is False
    assert 0 < summary["peak_outstanding_bytes"] <= summary["budget"] <= cache.capacity * CACHE_FRACTION
    assert not Callback.active
    assert cache._threads == []  # reads started by the scheduler's thread, finished by tasks: no worker threads


@pytest.mark.parametrize("scheduler", ["threads", "sync"])
def test_a_pass_over_more_than_the_cache_hands_its_chunks_over(tmp_path, scheduler):
    """An LRU cannot keep a pass larger than itself: each chunk read ahead goes to its task as
    read (no copy), nothing is cached or evicted for it; a chunk two tasks read is cached."""
    chunk = 16 * 256 * 2
    cache = DeviceCache(8 * chunk, device="cpu", name=f"test-prefetch-one-use-{scheduler}")
    try:
        vol, data = make_volume(tmp_path, n=32, cache=cache)
        kept = cache.get(vol.chunk_index.specs[(31, 0)], lambda s: data[-16:].copy())  # cached before the pass
        before = gpulazy.stats().snapshot()["buffers"]["copies"]
        kw = {"num_workers": 2} if scheduler == "threads" else {}
        p = gpulazy.prefetch(depth=3)
        with p:
            assert int(vol.astype("u8").sum().compute(scheduler=scheduler, **kw)) == int(data.astype("u8").sum())
        s = cache.stats()
        assert s["loads"] == 32 and read_share(s) >= 0.9, s  # chunk 31 is a hit of what was cached
        assert s["prefetched"] == s["prefetch_hits"] and s["evictions"] == 0
        assert s["entries"] == 1 and s["bytes_held"] == chunk and s["bytes_reserved"] == 0 and s["in_flight"] == 0
        assert gpulazy.stats().snapshot()["buffers"]["copies"] == before   # nothing copied into the cache
        np.testing.assert_array_equal(kept, data[-16:])

        cache.clear()
        cache.reset_stats()
        twice = gpulazy.from_files(os.path.join(tmp_path, "vol.raw"), shape=data.shape, dtype="uint16",
                                   chunks=(16, 256), device="cpu", cache=cache, backend="posix")  # other tasks, same chunks
        with p:
            got = (vol.astype("u8") + twice.astype("u8")).sum().compute(scheduler=scheduler, **kw)
        assert int(got) == 2 * int(data.astype("u8").sum())
        s = cache.stats()
        assert s["hits"] + s["misses"] == 64 and s["loads"] < 64, s  # the second read of a chunk is served cached
    finally:
        cache.close()


def test_depth_and_capacity_bound_the_look_ahead(tmp_path, cache):
    vol, data = make_volume(tmp_path, n=24, cache=cache)
    chunk = 16 * 256 * 2
    p = gpulazy.prefetch(depth=3)
    with p:
        assert int(vol.sum().compute(scheduler="sync")) == int(data.sum())
    assert p.last_summary["peak_outstanding_bytes"] == 3 * chunk
    cache.clear()
    p = gpulazy.prefetch(depth=20, capacity=2 * chunk + 1)
    with p:
        assert int(vol.sum().compute(scheduler="threads")) == int(data.sum())
    assert p.last_summary["budget"] == 2 * chunk + 1
    assert p.last_summary["peak_outstanding_bytes"] == 2 * chunk


def test_callbacks_argument_and_concurrent_computations(tmp_path, cache):
    vol_a, data_a = make_volume(tmp_path, n=16, cache=cache, name="a.raw")
    vol_b, data_b = make_volume(tmp_path, n=16, rows=8, cache=cache, name="b.raw")
    p = gpulazy.prefetch(depth=4)
    results = {}

    def run(label, vol):
        results[label] = int(vol.sum().compute(callbacks=[p]))

    threads = [threading.Thread(target=run, args=(k, v)) for k, v in (("a", vol_a), ("b", vol_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {"a": int(data_a.sum()), "b": int(data_b.sum())}
    s = cache.stats()
    # Passed as a callback, the prefetch comes after culling: the reads stay batched and it
    # orders each compute's read window (nothing goes through the cache's prefetch).
    assert s["loads"] == 32 and s["prefetched"] == 0 and s["queued"] == 0
    summary = p.last_summary
    assert summary["batches"] == 8 and summary["batches_read_ahead"] + summary["batches_started_by_task"] == 8
    assert not p._runs and not Callback.active


@pytest.mark.parametrize("scheduler", ["threads", "sync"])
def test_a_prefetch_callback_orders_the_read_window(tmp_path, cache, scheduler, monkeypatch):
    from gpulazy.read.window import ReadWindow

    vol, data = make_volume(tmp_path, n=64, cache=cache)
    claims = []
    claim = ReadWindow.claim
    monkeypatch.setattr(ReadWindow, "claim", lambda self, j: claims.append(j) or claim(self, j))
    p = gpulazy.prefetch()
    for compute in (vol.map_blocks(lambda b: b[:1].copy(), dtype=vol.dtype), vol.max(axis=0), vol.sum()):
        expected = compute.compute(scheduler=scheduler)
        claims.clear()
        cache.clear()
        assert np.array_equal(compute.compute(scheduler=scheduler, callbacks=[p]), expected)
        s = p.last_summary
        assert s["batches"] == 8 and sorted(claims) == list(range(8))
        # dask.order's order: under ``sync`` exactly the claims; every batch started before its task
        assert s["batches_started_by_task"] == 0 and s["batches_read_ahead"] == 8
    assert not p._runs and cache.stats()["prefetched"] == 0


def test_register_unregister_and_legacy_graphs(tmp_path, cache):
    vol, data = legacy_volume(tmp_path, n=12, rows=8, cols=64, cache_name=cache.name)
    p = gpulazy.prefetch(depth=4)
    p.register()
    try:
        assert np.array_equal(vol.compute(scheduler="threads"), data)
    finally:
        p.unregister()
    assert not Callback.active
    assert cache.stats()["prefetched"] >= 8 and p.last_summary["reads"] == 12


def test_off_means_no_activity(tmp_path, cache):
    vol, data = make_volume(tmp_path, n=16, cache=cache)
    before = {t.name for t in threading.enumerate()}
    with gpulazy.prefetch():
        pass
    assert not Callback.active
    assert int(vol.sum().compute()) == int(data.sum())
    s = cache.stats()
    assert s["prefetched"] == 0 and s["misses"] == 16 and s["cancelled"] == 0
    new = {t.name for t in threading.enumerate()} - before
    assert not any(cache.name in name for name in new)  # no prefetch thread was started


def test_graphs_without_reads_and_uncached_arrays(tmp_path):
    p = gpulazy.prefetch()
    with p:
        assert int(da.arange(100, chunks=10).sum().compute()) == 4950
        vol, data = make_volume(tmp_path, n=4, cache=False)
        assert int(vol.sum().compute()) == int(data.sum())
    assert p.last_summary is None  # nothing to read ahead: no plan at all


def test_only_the_given_cache_is_warmed(tmp_path, cache):
    other = DeviceCache("16 MiB", device="cpu", name="test-prefetch-other")
    try:
        vol_a, data_a = make_volume(tmp_path, n=8, cache=cache, name="a.raw")
        vol_b, data_b = make_volume(tmp_path, n=8, cache=other, name="b.raw")
        with gpulazy.prefetch(cache=other.name):
            got = da.stack([vol_a, vol_b]).sum(axis=(1, 2)).compute(scheduler="sync")
        assert got.tolist() == [int(data_a.sum()), int(data_b.sum())]
        assert cache.stats()["prefetched"] == 0 and other.stats()["prefetched"] > 0
    finally:
        other.close()


def test_hooks_cancel_what_is_queued(tmp_path, cache):
    """``_finish`` cancels every queued prefetch: each issued chunk was either loaded or cancelled."""
    vol, _ = make_volume(tmp_path, n=64, cache=cache)
    dsk = dict(vol.__dask_graph__())
    from dask._task_spec import convert_legacy_graph

    dsk = convert_legacy_graph(dsk)
    p = gpulazy.prefetch(depth=64)
    state: dict = {}
    p._start_state(dsk, state)
    p._finish(dsk, state, True)
    assert cache.stats()["queued"] == 0
    issued = p.last_summary["issued"]
    assert issued == 64 and p.last_summary["errored"] is True
    wait_idle(cache)
    s = cache.stats()
    assert s["loads"] + s["cancelled"] == issued


@pytest.mark.parametrize("scheduler", ["threads", "sync"])
def test_read_error_while_prefetching(tmp_path, cache, scheduler):
    vol, _ = make_volume(tmp_path, n=32, cache=cache)
    path = os.path.join(tmp_path, "vol.raw")
    with open(path, "r+b") as f:  # chunks 20 and later are now short
        f.truncate(20 * 16 * 256 * 2 + 100)
    p = gpulazy.prefetch(depth=8)
    t0 = time.monotonic()
    with pytest.raises(ChunkReadError) as info:
        with p:
            vol.sum().compute(scheduler=scheduler)
    assert time.monotonic() - t0 < 30
    assert "vol.raw" in str(info.value)
    assert p.last_summary["errored"] is True
    s = wait_idle(cache)
    assert s["queued"] == 0 and s["in_flight"] == 0
    assert not Callback.active


def test_prefetch_arguments():
    assert isinstance(gpulazy.prefetch, type) and gpulazy.prefetch.__name__ == "prefetch"  # the class, not the module
    p = gpulazy.prefetch(depth=3, capacity="1 MiB")
    assert (p.depth, p.capacity) == (3, 1 << 20)
    assert len(p) == 5 and list(p)[1] == p._start_state and "depth=3" in repr(p)
    with pytest.raises(ValueError, match="depth"):
        gpulazy.prefetch(depth=0)
    with pytest.raises(gpulazy.errors.ConfigError):
        gpulazy.prefetch(capacity="lots")


def test_depth_follows_config(tmp_path, cache):
    vol, data = make_volume(tmp_path, n=12, cache=cache)
    p = gpulazy.prefetch()
    with gpulazy.config.set(prefetch_depth=2), p:
        assert int(vol.sum().compute(scheduler="sync")) == int(data.sum())
    assert p.last_summary["depth"] == 2


def test_default_depth_grows_with_the_pool(tmp_path, cache):
    vol, data = make_volume(tmp_path, n=24, cache=cache)
    with gpulazy.config.set(prefetch_depth=2, batch_size=0):  # a read per chunk: planned chunk by chunk
        auto, fixed = gpulazy.prefetch(), gpulazy.prefetch(depth=2)
        for p in (auto, fixed):
            cache.clear()
            assert int(vol.sum().compute(scheduler="threads", num_workers=6, callbacks=[p])) == int(data.sum())
    assert auto.last_summary["depth"] == 12  # 6 tasks start together
    assert fixed.last_summary["depth"] == 2


@pytest.mark.gpu
def test_hit_rate_on_the_gpu(tmp_path):
    cache = DeviceCache("256 MiB", device="cuda:0", name="test-prefetch-gpu")
    try:
        vol, data = make_volume(tmp_path, n=128, rows=32, cols=1024, device="cuda:0", cache=cache)
        p = gpulazy.prefetch(depth=8)
        with p:
            got = (vol.astype("f8") ** 2).sum().compute(scheduler="threads", num_workers=4)
        assert float(to_host(got)) == float((data.astype("f8") ** 2).sum())  # integers < 2**53: exact
        s = cache.stats()
        assert s["loads"] == 128 and read_share(s) >= 0.9, s
        assert s["prefetched"] == s["prefetch_hits"]
        assert p.last_summary["peak_outstanding_bytes"] <= cache.capacity * CACHE_FRACTION
        with p:
            first = vol[:64].compute(scheduler="sync")
        assert np.array_equal(to_host(first), data[:64])
    finally:
        cache.close()


def test_a_read_ahead_no_task_took_is_settled_when_the_computation_ends(tmp_path, cache, monkeypatch):
    """A chunk read ahead whose task started but never took it (the computation failed first, or a
    streamed reduction read the chunk itself) is settled by ``stop``: cached, the cache idle."""
    from gpulazy.io import _posix
    from gpulazy.prefetch.plan import ReadAhead

    vol, data = make_volume(tmp_path, n=4, cache=cache)
    specs = list(vol.chunk_index.specs.values())
    source = ChunkSource(device="cpu", cache=cache.name)
    gate, real_preadv = threading.Event(), _posix._preadv

    def held(fd, buffers, offset):  # every read waits at the gate
        gate.wait(30)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(_posix, "_preadv", held)
    ahead = ReadAhead(depth=8)
    reads = ahead.keep([(i, spec, source) for i, spec in enumerate(specs)])
    try:
        ahead.start(reads)                       # all four started, none landed
        ahead.started([rid for rid, _ in reads])  # their tasks start; none takes its chunk
        assert cache.stats()["in_flight"] == 4
    finally:
        gate.set()
    ahead.stop()
    s = cache.stats()
    assert s["in_flight"] == 0 and s["bytes_reserved"] == 0 and s["entries"] == 4
    for k, spec in enumerate(specs):
        np.testing.assert_array_equal(cache.get(spec, lambda s: pytest.fail("read again")), data[16 * k:16 * (k + 1)])
