"""Concurrency and memory pressure: many threads, one small shared cache, read-ahead on.

Every result is compared with NumPy's reading of the same file; the cache's bytes are
sampled all along and never exceed its capacity; nothing deadlocks (each test has a
timeout). A hypothesis state machine mixes gets, prefetches, cancels, evictions, file
rewrites and injected read errors, and checks that a value handed out is always the
file's as it was when its chunk was indexed, or an error.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import fault_backend
import gpulazy
from gpulazy.array import ChunkSource
from gpulazy.cache import DeviceCache
from gpulazy.errors import ChunkReadError

N, ROWS = 64, (8, 128)  # 64 chunks of 2 KiB (uint16 rows of 8 x 128)
CHUNK = ROWS[0] * ROWS[1] * 2


@pytest.fixture
def volume(tmp_path):
    path = str(tmp_path / "vol.raw")
    data = np.random.default_rng(7).integers(0, 60000, (N, *ROWS), dtype="<u2")
    data.tofile(path)
    return path, data


class Watch:
    """Samples a cache's bytes held + reserved on a thread, to catch any moment over capacity."""

    def __init__(self, cache):
        self.cache, self.peak, self._stop = cache, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-cache-watch")

    def _run(self):
        while not self._stop.is_set():
            with self.cache._lock:
                self.peak = max(self.peak, self.cache._held + self.cache._reserved)
            time.sleep(0.0005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.mark.timeout(120)
def test_many_threads_overlapping_arrays_one_small_cache(volume):
    path, data = volume
    cache = DeviceCache(6 * CHUNK, device="cpu")  # 6 of the 64 chunks
    a = gpulazy.from_files(path, shape=(N, *ROWS), dtype="<u2", chunks=(1, *ROWS), device="cpu", cache=cache)
    b = gpulazy.from_files(path, shape=(N, *ROWS), dtype="<u2", chunks=(2, 4, 128), device="cpu", cache=cache)
    errors, done = [], []

    def work(i):
        rng = np.random.default_rng(i)
        try:
            for _ in range(6):
                # 4 planes: each compute fits the cache (a pass that does not is not cached at all),
                # the 8 threads' computes together overflow it
                lo = int(rng.integers(0, N - 4))
                arr = (a, b)[int(rng.integers(0, 2))]
                sel = arr[lo:lo + 4]
                got = sel.sum(axis=0).compute(scheduler=("sync", "threads")[i % 2],
                                               callbacks=[gpulazy.prefetch(depth=4)])
                np.testing.assert_array_equal(got, data[lo:lo + 4].sum(axis=0))
            done.append(i)
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    try:
        with Watch(cache) as watch:
            threads = [threading.Thread(target=work, args=(i,), name=f"test-worker-{i}") for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(100)
        assert not errors, errors[0]
        assert sorted(done) == list(range(8))
        assert watch.peak <= cache.capacity
        s = cache.stats()
        assert s["errors"] == 0 and s["evictions"] > 0  # under pressure, and nothing failed
    finally:
        cache.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_capacity_far_below_the_working_set_with_prefetch(volume, scheduler):
    path, data = volume
    cache = DeviceCache(3 * CHUNK, device="cpu")  # 3 chunks for a 64-chunk pass
    try:
        vol = gpulazy.from_files(path, shape=(N, *ROWS), dtype="<u2", chunks=(1, *ROWS), device="cpu", cache=cache)
        with Watch(cache) as watch:
            with gpulazy.prefetch(depth=16):
                for _ in range(2):
                    np.testing.assert_array_equal(vol.max(axis=1).compute(scheduler=scheduler), data.max(axis=1))
        assert watch.peak <= cache.capacity
        s = cache.stats()
        assert s["errors"] == 0 and s["bytes_held"] <= cache.capacity
    finally:
        cache.close()


# -- a state machine: cache, read-ahead, cancel, evict, rewrites and read errors ------------------

class FaultyCacheMachine(RuleBasedStateMachine):
    """Chunks of one real file read through a ChunkSource over a small DeviceCache.

    ``expected`` holds, per chunk spec, the bytes of the file when that spec was indexed;
    a rewrite makes every older spec stale. A get must return exactly the expected bytes
    of a current spec; for a stale spec it must raise ``ChunkReadError`` (never the old
    bytes from the cache, never the new ones under the old key).
    """

    def __init__(self):
        super().__init__()
        self.dir = None
        self.cache = None
        self.generation = 0
        self.specs = {}      # (generation, i) -> spec
        self.expected = {}   # spec.key -> array
        fault_backend.install(None)

    @initialize(capacity=st.integers(1, 6), seed=st.integers(0, 1000))
    def setup(self, capacity, seed):
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="gpulazy-faulty-machine-")
        self.path = os.path.join(self.dir, "f.raw")
        self.rng = np.random.default_rng(seed)
        self.cache = DeviceCache(capacity * 512, device="cpu")
        self.source = ChunkSource("cpu", "faulty", self.cache.ref)
        self._write()

    def _write(self):
        data = self.rng.integers(0, 256, 8 * 512, dtype=np.uint8)
        time.sleep(0.005)  # a rewrite lands on a later ctime tick
        with open(self.path, "wb") as f:
            f.write(data.tobytes())
        self.generation += 1
        vol = gpulazy.from_files(self.path, dtype="u1", chunks=512, device="cpu", cache=False)
        for i, spec in vol.chunk_index.specs.items():
            self.specs[(self.generation, i[0])] = spec
            self.expected[spec.key] = data[i[0] * 512:(i[0] + 1) * 512]

    def _current(self, spec):
        return any(self.specs[(self.generation, i)] is spec for i in range(8))

    @rule(i=st.integers(0, 7), old=st.booleans())
    def get(self, i, old):
        gens = [g for g in range(1, self.generation + 1) if (g, i) in self.specs]
        spec = self.specs[(gens[0] if old else gens[-1], i)]
        try:
            got = self.source.load(spec)
        except ChunkReadError as e:
            assert e.path == self.path
            assert not self._current(spec) or fault_backend.injected() > 0
            return
        assert self._current(spec), "a chunk of a rewritten file was served"
        np.testing.assert_array_equal(got, self.expected[spec.key])

    @rule(chosen=st.lists(st.integers(0, 7), max_size=6))
    def prefetch(self, chosen):
        self.cache.prefetch([self.specs[(self.generation, i)] for i in chosen], self.source.read)

    @rule()
    def cancel(self):
        self.cache.cancel()

    @rule()
    def evict(self):
        self.cache.clear()

    @precondition(lambda self: self.generation < 4)
    @rule()
    def rewrite(self):
        self._write()

    @rule(times=st.integers(1, 2))
    def read_errors(self, times):
        fault_backend.install({"fault": "eio", "times": times})

    @invariant()
    def bounded(self):
        if self.cache is None:
            return
        with self.cache._lock:
            assert self.cache._held + self.cache._reserved <= self.cache.capacity

    def teardown(self):
        import shutil

        fault_backend.uninstall()
        if self.cache is not None:
            self.cache.close()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


FaultyCacheMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_faulty_cache_machine = pytest.mark.timeout(300)(FaultyCacheMachine.TestCase)
