"""DeviceCache: values, bounds, one load per chunk, errors, prefetch, names and pickling."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import gpulazy
from gpulazy.array import ChunkSource, load_chunk
from gpulazy.cache import DeviceCache, cache_by_name, default_cache, resolve_capacity
from gpulazy.device import get_device
from gpulazy.errors import ChunkReadError, ConfigError
from gpulazy.spec import ByteRange, ChunkSpec, file_identity

from conftest import to_host
from gpulazy.testing import wait_for_idle as wait_idle

# --- helpers ---------------------------------------------------------------------

ROW = 256  # float32 elements per chunk row; 1 KiB rows keep GPU pool sizes on 512-byte multiples


def make_file(tmp_path, nchunks=8, rows=4, dtype="<f4", name="data.raw"):
    """A file of ``nchunks`` chunks of ``(rows, ROW)`` and their specs."""
    path = str(tmp_path / name)
    n = nchunks * rows * ROW
    np.arange(n, dtype=dtype).tofile(path)
    ident = (file_identity(path),)
    item = np.dtype(dtype).itemsize
    nb = rows * ROW * item
    specs = [ChunkSpec((ByteRange(path, i * nb, nb),), (rows, ROW), dtype, identity=ident, index=(i, 0))
             for i in range(nchunks)]
    return path, specs


def np_read(spec: ChunkSpec) -> np.ndarray:
    """The chunk as NumPy reads it: the reference every result is compared with."""
    parts = [np.fromfile(r.path, dtype=np.uint8, count=r.nbytes, offset=r.offset) for r in spec.ranges]
    raw = np.concatenate(parts)
    return raw.view(spec.dtype).astype(spec.out_dtype).reshape(spec.shape, order=spec.order)


class Loader:
    """Counts loads; optionally waits on ``gate``, sleeps, or fails for some specs."""

    def __init__(self, device="cpu", *, delay=0.0, gate=None, fail=(), fail_times=None):
        self.device = get_device(device)
        self.delay = delay
        self.gate = gate
        self.fail = {s.key for s in fail}
        self.fail_times = fail_times  # fail only the first n times for the failing specs
        self.calls: list[str] = []
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self.calls)

    def __call__(self, spec: ChunkSpec):
        with self._lock:
            self.calls.append(spec.key)
            nth = self.calls.count(spec.key)
        if self.gate is not None:
            assert self.gate.wait(10), "test gate never opened"
        if self.delay:
            time.sleep(self.delay)
        if spec.key in self.fail and (self.fail_times is None or nth <= self.fail_times):
            raise OSError(f"cannot read {spec.paths[0]!r} at offset {spec.ranges[0].offset}")
        with self.device.activate():
            return self.device.xp.asarray(np_read(spec))


@pytest.fixture
def caches():
    """Caches made by a test; closed afterwards so no thread or registry entry leaks."""
    made: list[DeviceCache] = []

    def make(*args, **kw):
        c = DeviceCache(*args, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# --- capacity --------------------------------------------------------------------

def test_capacity_forms():
    cpu = get_device("cpu")
    assert resolve_capacity(1000, cpu) == 1000
    assert resolve_capacity("8 KiB", cpu) == 8192
    assert resolve_capacity("0", cpu) == 0
    free, _ = cpu.memory()
    half = resolve_capacity("50%", cpu)
    assert 0.3 * free < half < 0.7 * free  # free memory moves a little between the two looks


@pytest.mark.parametrize("bad", ["lots", "150%", "-3%", "x%", True, -1])
def test_capacity_errors_name_the_value(bad):
    with pytest.raises(ConfigError, match=str(bad).replace("%", "") if bad is not True else "True"):
        resolve_capacity(bad, get_device("cpu"))


# --- values and copies -------------------------------------------------------------

def test_get_values_hits_misses(tmp_path, device, caches):
    _, specs = make_file(tmp_path)
    cache = caches("1 MiB", device=device)
    load = Loader(device)
    for _ in range(2):
        for s in specs:
            out = cache.get(s, load)
            assert out.shape == s.shape and out.dtype == s.out_dtype
            np.testing.assert_array_equal(to_host(out), np_read(s))
    st = cache.stats()
    assert (st["misses"], st["hits"], load.count) == (len(specs), len(specs), len(specs))
    assert st["bytes_held"] == sum(s.out_nbytes for s in specs) == cache.bytes_held
    assert st["loads"] == len(specs) and st["bytes_read"] == sum(s.nbytes for s in specs)
    assert all(s in cache for s in specs) and len(cache) == len(specs)


def test_writing_into_results_never_corrupts_the_cache(tmp_path, device, caches):
    _, specs = make_file(tmp_path, nchunks=2)
    cache = caches("1 MiB", device=device)
    load = Loader(device)
    first = cache.get(specs[0], load)       # miss: the caller gets the loaded array
    first[...] = -1
    second = cache.get(specs[0], load)      # hit: a copy of the cached one
    np.testing.assert_array_equal(to_host(second), np_read(specs[0]))
    second[...] = -2
    out = get_device(device).xp.zeros(specs[0].shape, specs[0].out_dtype)
    assert cache.read_into(specs[0], out)
    np.testing.assert_array_equal(to_host(out), np_read(specs[0]))
    np.testing.assert_array_equal(to_host(cache.get(specs[0], load)), np_read(specs[0]))
    assert load.count == 1


def test_dask_compute_write_recompute(tmp_path, caches):
    import dask.array as da

    _, specs = make_file(tmp_path, nchunks=3)
    cache = caches("1 MiB", device="cpu")
    source = ChunkSource(device="cpu", cache=cache.name)
    name = "cache-test-array"
    dsk = {(name, i, 0): (load_chunk, s, source) for i, s in enumerate(specs)}
    rows = specs[0].shape[0]
    arr = da.Array(dsk, name, chunks=((rows,) * len(specs), (ROW,)), dtype="float32")
    expected = np.concatenate([np_read(s) for s in specs])
    out = arr.compute(scheduler="threads")
    np.testing.assert_array_equal(out, expected)
    out[...] = 0
    np.testing.assert_array_equal(arr.compute(scheduler="threads"), expected)
    block = arr.blocks[1].compute(scheduler="sync")   # one chunk: the task's own result
    block[...] = 7
    np.testing.assert_array_equal(arr.blocks[1].compute(scheduler="sync"), np_read(specs[1]))
    st = cache.stats()
    assert st["misses"] == 3 and st["hits"] >= 4


def test_read_into(tmp_path, device, caches):
    _, specs = make_file(tmp_path, nchunks=2)
    cache = caches("1 MiB", device=device)
    xp = get_device(device).xp
    out = xp.full(specs[0].shape, 5, dtype=specs[0].out_dtype)
    assert cache.read_into(specs[0], out) is False
    assert cache.stats()["hits"] == cache.stats()["misses"] == 0
    np.testing.assert_array_equal(to_host(out), 5)
    cache.get(specs[0], Loader(device))
    assert cache.read_into(specs[0], out) is True
    np.testing.assert_array_equal(to_host(out), np_read(specs[0]))
    assert cache.stats()["hits"] == 1
    with pytest.raises(ValueError, match="shape"):
        cache.read_into(specs[0], xp.zeros((2, 2), dtype="float32"))


# --- bounds and eviction -------------------------------------------------------------

def test_lru_eviction_order(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=3)
    a, b, c = specs
    cache = caches(2 * a.out_nbytes, device="cpu")
    load = Loader()
    cache.get(a, load)
    cache.get(b, load)
    cache.get(a, load)        # a is now the most recently used
    cache.get(c, load)        # evicts b, the least recently used
    assert a in cache and c in cache and b not in cache
    st = cache.stats()
    assert st["evictions"] == 1 and st["bytes_held"] == 2 * a.out_nbytes <= st["capacity"]


def test_chunk_larger_than_capacity_reads_through(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=2)
    cache = caches(specs[0].out_nbytes - 1, device="cpu")
    load = Loader()
    for _ in range(2):
        np.testing.assert_array_equal(cache.get(specs[0], load), np_read(specs[0]))
    st = cache.stats()
    assert st["bytes_held"] == 0 and load.count == 2 and st["misses"] == 2
    assert specs[0] not in cache


def test_zero_capacity_caches_nothing(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=2)
    cache = caches(0, device="cpu")
    np.testing.assert_array_equal(cache.get(specs[1], Loader()), np_read(specs[1]))
    assert cache.bytes_held == 0 and len(cache) == 0


def test_pinned_entries_are_not_evicted(tmp_path, caches):
    # An entry being copied out is pinned; when nothing else can go, the new chunk is
    # handed out without being cached rather than exceeding the capacity.
    _, specs = make_file(tmp_path, nchunks=2)
    cache = caches(specs[0].out_nbytes, device="cpu")
    load = Loader()
    cache.get(specs[0], load)
    entry = cache._entries[specs[0].key]
    entry.pins += 1                        # as if a copy-out were in progress
    try:
        np.testing.assert_array_equal(cache.get(specs[1], load), np_read(specs[1]))
        assert specs[0] in cache and specs[1] not in cache
        assert cache.bytes_held == specs[0].out_nbytes
    finally:
        entry.pins -= 1
    cache.get(specs[1], load)
    assert specs[1] in cache and specs[0] not in cache


class _NoRoomArray(np.ndarray):
    """An array whose copy fails as a full device would."""

    def copy(self, order="C"):
        raise MemoryError("out of memory allocating the cache's copy")


def test_out_of_memory_while_caching_hands_the_array_out(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=1)
    cache = caches("1 MiB", device="cpu")
    out = cache.get(specs[0], lambda s: np_read(s).view(_NoRoomArray))
    np.testing.assert_array_equal(out, np_read(specs[0]))
    st = cache.stats()
    assert specs[0] not in cache and st["bytes_held"] == st["bytes_reserved"] == 0 and st["errors"] == 0


# --- one load per chunk, errors -------------------------------------------------------

def test_eight_threads_one_load(tmp_path, device, caches):
    _, specs = make_file(tmp_path, nchunks=1)
    cache = caches("1 MiB", device=device)
    gate = threading.Event()
    load = Loader(device, gate=gate)
    results, errors = [None] * 8, []
    start = threading.Barrier(8)

    def work(i):
        try:
            start.wait()
            results[i] = cache.get(specs[0], load)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while cache.stats()["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)  # let the others find the load in flight
    gate.set()
    for t in threads:
        t.join(10)
    assert not errors
    assert load.count == 1
    for r in results:
        np.testing.assert_array_equal(to_host(r), np_read(specs[0]))
    assert len({id(r) for r in results}) == 8     # each caller owns its array
    st = cache.stats()
    assert (st["misses"], st["hits"]) == (1, 7)


def test_failed_load_reaches_every_waiter_and_caches_nothing(tmp_path, caches):
    path, specs = make_file(tmp_path, nchunks=1)
    cache = caches("1 MiB", device="cpu")
    gate = threading.Event()
    load = Loader(gate=gate, fail=specs)
    errors: list[BaseException] = []

    def work():
        try:
            cache.get(specs[0], load)
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    gate.set()
    for t in threads:
        t.join(10)
    assert len(errors) == 4 and all(path in str(e) for e in errors)
    assert load.count == 1
    st = cache.stats()
    assert st["errors"] == 1 and st["bytes_held"] == 0 and st["in_flight"] == 0
    assert path in st["last_error"]
    assert specs[0] not in cache
    with pytest.raises(OSError, match="cannot read"):   # not remembered: read again
        cache.get(specs[0], load)
    assert load.count == 2


def test_real_read_error_names_the_file(tmp_path, caches):
    path, specs = make_file(tmp_path, nchunks=2)
    cache = caches("1 MiB", device="cpu")
    read = ChunkSource(device="cpu", cache=False).read
    with open(path, "r+b") as f:
        f.truncate(specs[0].nbytes + 10)      # the second chunk is now short
    with pytest.raises(OSError, match="data.raw"):
        cache.get(specs[1], read)
    assert specs[1] not in cache and cache.stats()["errors"] == 1


# --- prefetch ------------------------------------------------------------------------

def test_prefetch_warms_then_hits(tmp_path, device, caches):
    _, specs = make_file(tmp_path, nchunks=6)
    cache = caches("1 MiB", device=device)
    load = Loader(device)
    assert cache.prefetch(specs, load) == len(specs)
    st = wait_idle(cache)
    assert st["prefetched"] == len(specs) and load.count == len(specs)
    for s in specs:
        np.testing.assert_array_equal(to_host(cache.get(s, load)), np_read(s))
    st = cache.stats()
    assert (st["hits"], st["misses"], st["prefetch_hits"]) == (6, 0, 6)
    assert load.count == len(specs)
    assert cache.prefetch(specs, load) == 0             # all cached: nothing queued


def test_prefetch_never_displaces_unused_prefetches(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=5)
    cache = caches(2 * specs[0].out_nbytes, device="cpu")
    load = Loader()
    gpulazy.config.set(threads=1)                        # one worker: deterministic order
    cache.prefetch(specs, load)
    st = wait_idle(cache)
    assert specs[0] in cache and specs[1] in cache
    assert not any(s in cache for s in specs[2:])
    assert st["prefetched"] == 2 and st["prefetch_skipped"] == 3 and st["evictions"] == 0
    assert st["bytes_held"] <= st["capacity"]
    # once used, they may make room for later prefetches
    cache.get(specs[0], load)
    cache.get(specs[1], load)
    cache.prefetch(specs[2:4], load)
    st = wait_idle(cache)
    assert specs[2] in cache and specs[3] in cache and st["evictions"] == 2


def test_demand_read_may_evict_newest_prefetch_first(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=3)
    cache = caches(2 * specs[0].out_nbytes, device="cpu")
    load = Loader()
    gpulazy.config.set(threads=1)
    cache.prefetch(specs[:2], load)
    wait_idle(cache)
    cache.get(specs[2], load)               # needs room now: the later prefetch goes
    assert specs[0] in cache and specs[2] in cache and specs[1] not in cache


def test_prefetch_skips_in_flight_and_queued(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=3)
    cache = caches("1 MiB", device="cpu")
    gate = threading.Event()
    load = Loader(gate=gate)
    gpulazy.config.set(threads=1)
    assert cache.prefetch(specs, load) == 3
    assert cache.prefetch(specs, load) == 0
    gate.set()
    wait_idle(cache)
    assert load.count == 3


def test_prefetch_loads_in_flight_stay_within_prefetch_inflight(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=6)
    cache = caches("1 MiB", device="cpu")
    gate = threading.Event()
    load = Loader(gate=gate)
    gpulazy.config.set(threads=4, prefetch_inflight=2 * specs[0].out_nbytes)
    assert cache.prefetch(specs, load) == 6
    deadline = time.monotonic() + 5
    while load.count < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    deadline = time.monotonic() + 0.5                   # four idle workers: a third load would start now
    while load.count == 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert load.count == 2 and cache.stats()["queued"] == 4
    gate.set()
    wait_idle(cache)
    assert load.count == 6 and all(s in cache for s in specs)
    gpulazy.config.set(prefetch_inflight=1)             # one chunk always may load
    cache.clear()
    assert cache.prefetch(specs[:2], Loader()) == 2
    wait_idle(cache)
    assert all(s in cache for s in specs[:2])


def test_get_waits_on_a_running_prefetch(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=1)
    cache = caches("1 MiB", device="cpu")
    gate = threading.Event()
    load = Loader(gate=gate)
    cache.prefetch(specs, load)
    deadline = time.monotonic() + 5
    while cache.stats()["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    threading.Timer(0.05, gate.set).start()
    np.testing.assert_array_equal(cache.get(specs[0], load), np_read(specs[0]))
    st = cache.stats()
    assert load.count == 1 and (st["hits"], st["misses"], st["prefetch_hits"]) == (1, 0, 1)
    cache.get(specs[0], load)
    assert cache.stats()["prefetch_hits"] == 1          # counted once per prefetched chunk


def test_cancel(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=6)
    cache = caches("1 MiB", device="cpu")
    gate = threading.Event()
    load = Loader(gate=gate)
    gpulazy.config.set(threads=1)
    cache.prefetch(specs, load)
    deadline = time.monotonic() + 5
    while cache.stats()["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert cache.stats()["queued"] == 5                 # one is running
    assert cache.cancel(specs[4:]) == 2
    assert cache.cancel([specs[4]]) == 0                # already gone
    assert cache.cancel() == 3
    assert cache.stats()["queued"] == 0 and cache.stats()["cancelled"] == 5
    gate.set()
    wait_idle(cache)
    assert load.count == 1 and specs[0] in cache


def test_prefetch_error_is_recorded_then_raised_by_get(tmp_path, caches):
    path, specs = make_file(tmp_path, nchunks=2)
    cache = caches("1 MiB", device="cpu")
    load = Loader(fail=specs[:1])
    cache.prefetch(specs, load)
    st = wait_idle(cache)
    assert st["errors"] == 1 and st["prefetched"] == 1 and path in st["last_error"]
    with pytest.raises(OSError, match="cannot read"):
        cache.get(specs[0], load)
    assert load.calls.count(specs[0].key) == 2          # read again on demand


def test_transient_prefetch_error_recovers_on_get(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=1)
    cache = caches("1 MiB", device="cpu")
    load = Loader(fail=specs, fail_times=1)
    cache.prefetch(specs, load)
    wait_idle(cache)
    np.testing.assert_array_equal(cache.get(specs[0], load), np_read(specs[0]))
    assert specs[0] in cache


def test_get_waiting_on_a_failing_prefetch_reads_again(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=1)
    cache = caches("1 MiB", device="cpu")
    gate = threading.Event()
    load = Loader(gate=gate, fail=specs, fail_times=1)
    cache.prefetch(specs, load)
    while cache.stats()["in_flight"] == 0:
        time.sleep(0.001)
    threading.Timer(0.05, gate.set).start()
    np.testing.assert_array_equal(cache.get(specs[0], load), np_read(specs[0]))
    assert load.count == 2 and cache.stats()["misses"] == 1


def test_stats_from_another_thread_stay_bounded(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=12)
    cap = 3 * specs[0].out_nbytes
    cache = caches(cap, device="cpu")
    load = Loader(delay=0.001)
    stop = threading.Event()
    seen: list[dict] = []

    def watch():
        while not stop.is_set():
            seen.append(cache.stats())

    def work(seed):
        rng = np.random.default_rng(seed)
        for i in rng.integers(0, len(specs), 40):
            np.testing.assert_array_equal(cache.get(specs[i], load), np_read(specs[i]))
            if i % 3 == 0:
                cache.prefetch(specs[i: i + 3], load)

    watcher = threading.Thread(target=watch)
    watcher.start()
    workers = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(30)
    wait_idle(cache)
    stop.set()
    watcher.join()
    keys = {"hits", "misses", "prefetched", "prefetch_hits", "evictions", "bytes_held", "capacity",
            "bytes_read", "read_seconds", "queued", "in_flight"}
    assert seen and all(keys <= s.keys() for s in seen)
    assert all(s["bytes_held"] + s["bytes_reserved"] <= cap for s in seen)
    final = cache.stats()
    assert final["hits"] + final["misses"] == 160
    assert final["bytes_held"] == sum(s.out_nbytes for s in specs if s in cache) <= cap


# --- clear, close, threads ------------------------------------------------------------

def _cache_threads(cache):
    return [t for t in threading.enumerate() if t.name.startswith(f"gpulazy-cache-{cache.name}-")]


def test_clear_and_close(tmp_path):
    _, specs = make_file(tmp_path, nchunks=4)
    cache = DeviceCache("1 MiB", device="cpu")
    load = Loader()
    cache.prefetch(specs, load)
    wait_idle(cache)
    assert _cache_threads(cache)
    cache.clear()
    assert cache.bytes_held == 0 and len(cache) == 0
    cache.get(specs[0], load)
    assert cache.stats()["misses"] == 1
    cache.close()
    assert not _cache_threads(cache)
    assert cache.closed and cache.bytes_held == 0
    with pytest.raises(KeyError, match=cache.name):
        cache_by_name(cache.name)
    # a closed cache reads through, so tasks still running finish
    np.testing.assert_array_equal(cache.get(specs[1], load), np_read(specs[1]))
    assert cache.bytes_held == 0 and cache.prefetch(specs, load) == 0
    cache.close()  # twice is fine


def test_close_does_not_wait_on_a_stuck_load(tmp_path):
    _, specs = make_file(tmp_path, nchunks=1)
    cache = DeviceCache("1 MiB", device="cpu")
    gate = threading.Event()
    cache.prefetch(specs, Loader(gate=gate))
    while cache.stats()["in_flight"] == 0:
        time.sleep(0.001)
    t0 = time.monotonic()
    cache.close()
    assert time.monotonic() - t0 < 1.5
    gate.set()
    deadline = time.monotonic() + 5
    while _cache_threads(cache) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _cache_threads(cache)
    assert cache.bytes_held == 0


# --- names, pickling, the default cache ------------------------------------------------

def test_names_and_registry(caches):
    c = caches("1 MiB", device="cpu", name="test-names")
    assert cache_by_name("test-names") is c
    with pytest.raises(ValueError, match="test-names"):
        DeviceCache("1 MiB", device="cpu", name="test-names")
    other = caches("1 MiB", device="cpu")
    assert other.name != c.name and cache_by_name(other.name) is other
    with pytest.raises(KeyError, match="no DeviceCache named 'nope'"):
        cache_by_name("nope")


def test_pickle_is_a_reference_in_process(caches):
    c = caches("2 MiB", device="cpu", name="test-pickle")
    assert pickle.loads(pickle.dumps(c)) is c


def test_pickle_creates_once_in_another_process(caches):
    c = caches("3 MiB", device="cpu", name="test-remote")
    code = (
        "import pickle, sys\n"
        "c = pickle.loads(sys.stdin.buffer.read())\n"
        "from gpulazy.cache import cache_by_name\n"
        "again = pickle.loads(pickle.dumps(c))\n"
        "print(c.name, c.capacity, c.device.name, again is c, cache_by_name('test-remote') is c)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(c), capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().split() == ["test-remote", str(3 << 20), "cpu", "True", "True"]


def test_default_cache_follows_config():
    with gpulazy.config.set(cache="1 MiB"):
        d = default_cache("cpu")
        assert d.capacity == 1 << 20 and d.name == "default-cpu"
        assert default_cache("cpu") is d and cache_by_name("default-cpu") is d
        assert pickle.loads(pickle.dumps(d)) is d
    with gpulazy.config.set(cache="2 MiB"):
        d2 = default_cache("cpu")
        assert d2 is not d and d.closed and d2.capacity == 2 << 20
    with gpulazy.config.set(cache=False):
        assert default_cache("cpu") is None
        assert d2.closed
    d3 = default_cache("cpu")  # "25%" of free host memory
    try:
        free, _ = get_device("cpu").memory()
        assert 0.1 * free < d3.capacity < 0.4 * free
    finally:
        d3.close()


def test_chunk_source_reads_through_named_and_default_caches(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=2)
    c = caches("1 MiB", device="cpu", name="test-source")
    src = ChunkSource(device="cpu", cache="test-source")
    np.testing.assert_array_equal(src.load(specs[0]), np_read(specs[0]))
    src.prefetch(specs[1:])
    wait_idle(c)
    assert specs[0] in c and specs[1] in c
    with gpulazy.config.set(cache="1 MiB"):
        d = ChunkSource(device="cpu").cache_instance()
        try:
            assert d is default_cache("cpu")
        finally:
            d.close()


# --- GPU: bytes held against the CuPy pool ---------------------------------------------

@pytest.mark.gpu
def test_gpu_bytes_held_match_the_cupy_pool(tmp_path):
    import cupy as cp

    _, specs = make_file(tmp_path, nchunks=10)
    pool = cp.get_default_memory_pool()
    cap = 4 * specs[0].out_nbytes
    with cp.cuda.Device(0):
        cp.cuda.Device(0).synchronize()
        base = pool.used_bytes()
        cache = DeviceCache(cap, device="cuda:0")
        load = Loader("cuda:0")
        rng = np.random.default_rng(0)
        try:
            for i in rng.integers(0, len(specs), 60):
                r = cache.get(specs[i], load)
                np.testing.assert_array_equal(r.get(), np_read(specs[i]))
                del r
                used = pool.used_bytes() - base
                assert used == cache.bytes_held <= cap
                if i % 4 == 0:
                    cache.prefetch(specs[i: i + 4], load)
                    wait_idle(cache)
                    cp.cuda.Device(0).synchronize()
                    assert pool.used_bytes() - base == cache.bytes_held <= cap
            assert cache.stats()["evictions"] > 0
        finally:
            cache.close()
        assert pool.used_bytes() == base


@pytest.mark.gpu
def test_gpu_results_are_cupy_on_the_device(tmp_path):
    import cupy as cp

    _, specs = make_file(tmp_path, nchunks=2)
    cache = DeviceCache("50%", device="cuda:0")
    try:
        free, _ = get_device("cuda:0").memory()
        assert cache.capacity <= free
        r = cache.get(specs[0], Loader("cuda:0"))
        assert isinstance(r, cp.ndarray) and r.device.id == 0
        r[...] = 0
        h = cache.get(specs[0], Loader("cuda:0"))
        assert isinstance(h, cp.ndarray)
        np.testing.assert_array_equal(h.get(), np_read(specs[0]))
    finally:
        cache.close()


# --- read-ahead started in the caller's thread (``prefetch(..., start=)``) -----------


class Pending:
    """A read in flight as ``ChunkSource.start`` returns it: done when ``gate`` is set."""

    def __init__(self, spec, gate, fail=False):
        self.spec, self.gate, self.fail = spec, gate, fail
        self.results = 0

    def done(self):
        return self.gate.is_set()

    def result(self):
        assert self.gate.wait(10), "test gate never opened"
        self.results += 1
        if self.fail:
            raise OSError(f"cannot read {self.spec.paths[0]!r} at offset {self.spec.ranges[0].offset}")
        self.value = np_read(self.spec)  # the array handed out, for identity checks
        return self.value


class Starter:
    """``start(specs)``: one ``Pending`` per spec, all behind one gate unless given one each."""

    def __init__(self, gates=None, fail=(), raises=None):
        self.gates = gates or {}
        self.fail = {s.key for s in fail}
        self.raises = raises
        self.started: list[Pending] = []
        self.thread_ids: set[int] = set()
        self.gate = threading.Event()

    def __call__(self, specs):
        self.thread_ids.add(threading.get_ident())
        if self.raises is not None:
            raise self.raises
        out = [Pending(s, self.gates.get(s.key, self.gate), s.key in self.fail) for s in specs]
        self.started += out
        return out


def test_started_prefetch_runs_in_the_callers_thread_and_get_finishes_it(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=4)
    cache = caches("1 MiB", device="cpu")
    start, load = Starter(), Loader()
    assert cache.prefetch(specs, load, start=start) == 4
    assert start.thread_ids == {threading.get_ident()}
    st = cache.stats()
    assert st["in_flight"] == 4 and st["bytes_reserved"] == sum(s.out_nbytes for s in specs)
    assert cache._threads == []                      # no worker thread: nothing needs the GIL to progress
    start.gate.set()
    for s in specs:
        np.testing.assert_array_equal(cache.get(s, load), np_read(s))
    st = cache.stats()
    assert load.count == 0 and (st["prefetched"], st["prefetch_hits"], st["misses"]) == (4, 4, 0)
    assert st["bytes_reserved"] == 0 and st["bytes_held"] == sum(s.out_nbytes for s in specs)
    assert [p.results for p in start.started] == [1, 1, 1, 1]     # each read finished once


def test_poll_finishes_completed_reads_and_never_blocks(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=3)
    cache = caches("1 MiB", device="cpu")
    gates = {s.key: threading.Event() for s in specs}
    start = Starter(gates)
    cache.prefetch(specs, Loader(), start=start)
    gates[specs[1].key].set()
    t0 = time.perf_counter()
    assert cache.poll() == 1
    assert time.perf_counter() - t0 < 5                 # the two closed gates were not waited on
    assert specs[1] in cache and specs[0] not in cache and cache.stats()["in_flight"] == 2
    assert cache.poll() == 0
    for g in gates.values():
        g.set()
    assert cache.poll() == 2 and cache.stats()["in_flight"] == 0


def test_started_prefetch_error_is_recorded_then_get_reads_again(tmp_path, caches):
    path, specs = make_file(tmp_path, nchunks=2)
    cache = caches("1 MiB", device="cpu")
    start, load = Starter(fail=specs[:1]), Loader(fail=specs[:1])
    cache.prefetch(specs, load, start=start)
    start.gate.set()
    assert cache.poll() == 2
    st = cache.stats()
    assert st["errors"] == 1 and st["prefetched"] == 1 and path in st["last_error"] and st["bytes_reserved"] == 0
    with pytest.raises(OSError, match="cannot read"):
        cache.get(specs[0], load)
    assert load.calls == [specs[0].key]                  # read again on demand, and that raised


def test_get_claiming_a_failing_started_read_reads_again(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=1)
    cache = caches("1 MiB", device="cpu")
    start, load = Starter(fail=specs), Loader()
    cache.prefetch(specs, load, start=start)
    start.gate.set()
    np.testing.assert_array_equal(cache.get(specs[0], load), np_read(specs[0]))
    assert load.count == 1 and cache.stats()["errors"] == 1 and specs[0] in cache


def test_start_that_raises_gives_the_room_back(tmp_path, caches):
    path, specs = make_file(tmp_path, nchunks=3)
    cache = caches("1 MiB", device="cpu")
    start = Starter(raises=OSError(f"cannot open {path!r}"))
    assert cache.prefetch(specs, Loader(), start=start) == 0
    st = cache.stats()
    assert (st["errors"], st["in_flight"], st["bytes_reserved"]) == (3, 0, 0) and path in st["last_error"]
    np.testing.assert_array_equal(cache.get(specs[2], Loader()), np_read(specs[2]))


def test_started_prefetches_never_exceed_capacity_or_displace_each_other(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=6)
    cap = 2 * specs[0].out_nbytes
    cache = caches(cap, device="cpu")
    start = Starter()
    assert cache.prefetch(specs, Loader(), start=start) == 2
    st = cache.stats()
    assert st["prefetch_skipped"] == 4 and st["bytes_reserved"] == cap
    start.gate.set()
    cache.poll()
    assert cache.prefetch(specs[2:], Loader(), start=start) == 0    # would evict unused prefetches
    st = cache.stats()
    assert st["bytes_held"] + st["bytes_reserved"] <= cap and specs[0] in cache and specs[1] in cache


def test_cancel_keeps_started_reads_and_clear_waits_for_them(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=4)
    cache = caches("1 MiB", device="cpu")
    start = Starter()
    cache.prefetch(specs, Loader(), start=start)
    threading.Timer(0.05, start.gate.set).start()
    cache.cancel(specs[:2])                              # in flight: finished and kept, not dropped
    assert specs[0] in cache and specs[1] in cache
    cache.clear()                                        # the other two: waited for, then dropped
    st = cache.stats()
    assert (st["in_flight"], st["bytes_reserved"], st["bytes_held"]) == (0, 0, 0)
    assert all(p.results == 1 for p in start.started)
    load = Loader()
    np.testing.assert_array_equal(cache.get(specs[3], load), np_read(specs[3]))
    assert load.count == 1


class BlockingStarter(Starter):
    """A ``Starter`` whose submission itself blocks until ``submitting_may_end`` is set."""

    def __init__(self):
        super().__init__()
        self.submitting = threading.Event()
        self.submitting_may_end = threading.Event()

    def __call__(self, specs):
        self.submitting.set()
        assert self.submitting_may_end.wait(10), "test gate never opened"
        return super().__call__(specs)


def test_gets_go_on_while_reads_are_submitted_and_one_of_them_waits_for_its_read(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=3)
    cache = caches("1 MiB", device="cpu")
    cached = np_read(specs[0])
    cache.get(specs[0], lambda s: cached)               # a chunk cached before the submission
    start = BlockingStarter()
    start.gate.set()
    submitter = threading.Thread(target=cache.prefetch, args=(specs[1:], Loader()), kwargs={"start": start})
    submitter.start()
    assert start.submitting.wait(10)
    # The submission holds no lock of the cache: a hit is served while it blocks.
    np.testing.assert_array_equal(cache.get(specs[0], Loader()), cached)
    got: dict = {}
    getter = threading.Thread(target=lambda: got.update(a=cache.get(specs[1], Loader())))
    getter.start()
    _until(lambda: cache._attached._waiters)            # its read is being submitted: it waits for it
    start.submitting_may_end.set()
    getter.join(10)
    submitter.join(10)
    np.testing.assert_array_equal(got["a"], np_read(specs[1]))
    st = cache.stats()
    assert (st["misses"], st["prefetch_hits"], st["in_flight"]) == (1, 1, 1)
    assert [p.results for p in start.started] == [1, 0]  # the getter finished its read; the other waits


def _until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.001)


def test_clear_during_a_submission_settles_its_reads(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=2)
    cache = caches("1 MiB", device="cpu")
    start = BlockingStarter()
    start.gate.set()
    submitter = threading.Thread(target=cache.prefetch, args=(specs, Loader()), kwargs={"start": start})
    submitter.start()
    assert start.submitting.wait(10)
    clearer = threading.Thread(target=cache.clear)      # waits for the submission, then settles its reads
    clearer.start()
    _until(lambda: cache._attached._waiters)
    start.submitting_may_end.set()
    clearer.join(10)
    submitter.join(10)
    st = cache.stats()
    assert (st["in_flight"], st["bytes_reserved"], st["bytes_held"]) == (0, 0, 0)
    assert [p.results for p in start.started] == [1, 1]


def test_a_hit_is_checked_and_a_read_is_not(tmp_path, caches):
    path, specs = make_file(tmp_path, nchunks=2)
    cache = caches("1 MiB", device="cpu")
    checked = []

    def check(spec):
        checked.append(spec.key)
        if spec is specs[1]:
            raise ChunkReadError(f"{path!r} changed since it was indexed")

    load = Loader()
    for s in specs:
        cache.get(s, load, check)                       # misses: read now, checked by their read
    assert checked == [] and load.count == 2
    np.testing.assert_array_equal(cache.get(specs[0], load, check), np_read(specs[0]))
    with pytest.raises(ChunkReadError, match="changed since"):
        cache.get(specs[1], load, check)
    assert checked == [specs[0].key, specs[1].key] and load.count == 2
    assert all(e.pins == 0 for e in cache._entries.values())   # the refused hit is unpinned


def test_close_waits_for_started_reads(tmp_path):
    _, specs = make_file(tmp_path, nchunks=2)
    cache = DeviceCache("1 MiB", device="cpu")
    start = Starter()
    cache.prefetch(specs, Loader(), start=start)
    threading.Timer(0.05, start.gate.set).start()
    cache.close()
    assert all(p.results == 1 for p in start.started) and cache.stats()["in_flight"] == 0


def test_a_chunk_read_ahead_for_one_use_is_handed_over_uncached(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=3)
    cache = caches("1 MiB", device="cpu")
    start, load = Starter(), Loader()
    assert cache.prefetch(specs, load, start=start, keep=False) == 3
    assert cache.stats()["bytes_reserved"] == sum(s.out_nbytes for s in specs)   # room held while read
    start.gate.set()
    assert cache.poll() == 0                             # moved on, never finished: its get takes it
    got = cache.get(specs[1], load)
    assert got is start.started[1].value                 # the array as read: no copy
    np.testing.assert_array_equal(got, np_read(specs[1]))
    st = cache.stats()
    assert specs[1] not in cache and (st["prefetched"], st["prefetch_hits"], st["hits"], st["misses"]) == (1, 1, 1, 0)
    assert st["bytes_held"] == 0 and st["bytes_reserved"] == 2 * specs[0].out_nbytes and st["in_flight"] == 2
    got[...] = 0                                         # the caller's own: nothing of it is kept
    np.testing.assert_array_equal(cache.get(specs[1], load), np_read(specs[1]))
    assert load.calls == [specs[1].key] and specs[1] in cache  # asked again: read again, cached as usual
    cache.clear()                                        # the two not taken are dropped, their room given back
    st = cache.stats()
    assert (st["in_flight"], st["bytes_reserved"], st["bytes_held"]) == (0, 0, 0)
    assert [p.results for p in start.started] == [1, 1, 1]


def test_a_chunk_read_ahead_for_one_use_is_copied_for_each_of_several_getters(tmp_path, caches):
    """Two threads ask for it while it is read: neither may get the array the other can write into."""
    _, specs = make_file(tmp_path, nchunks=1)
    spec = specs[0]
    cache = caches("1 MiB", device="cpu")
    start, load = Starter(), Loader()
    cache.prefetch(specs, load, start=start, keep=False)
    got = {}

    def second():
        got["second"] = cache.get(spec, load)

    waiter = threading.Thread(target=second)
    real_result = start.started[0].result

    def result_once_the_second_waits():  # the first get claims the read; open it once the second waits
        waiter.start()
        deadline = time.monotonic() + 10
        while cache._jobs[spec.key].waiters < 2:
            assert time.monotonic() < deadline, "the second get never waited"
            threading.Event().wait(0.001)
        start.gate.set()
        return real_result()

    start.started[0].result = result_once_the_second_waits
    got["first"] = cache.get(spec, load)
    waiter.join(10)
    read = start.started[0].value
    assert got["first"] is not read and got["second"] is not read and got["first"] is not got["second"]
    for a in got.values():
        np.testing.assert_array_equal(a, np_read(spec))
    st = cache.stats()
    assert load.count == 0 and (st["prefetch_hits"], st["hits"], st["misses"]) == (1, 2, 0)
    assert spec not in cache and st["bytes_reserved"] == 0


def test_a_failed_read_ahead_for_one_use_is_read_again_by_its_get(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=1)
    cache = caches("1 MiB", device="cpu")
    start, load = Starter(fail=specs), Loader()
    cache.prefetch(specs, load, start=start, keep=False)
    start.gate.set()
    np.testing.assert_array_equal(cache.get(specs[0], load), np_read(specs[0]))
    st = cache.stats()
    assert load.count == 1 and st["errors"] == 1 and st["bytes_reserved"] == 0 and specs[0] in cache


def test_get_cached_copies_what_is_cached(tmp_path, caches):
    _, specs = make_file(tmp_path, nchunks=3)
    cache = caches("1 MiB", device="cpu")
    load = Loader()
    cache.get(specs[0], load)
    cache.get(specs[2], load)
    got = cache.get_cached(specs)
    assert got[1] is None
    for i in (0, 2):
        np.testing.assert_array_equal(got[i], np_read(specs[i]))
        got[i][...] = -1                                 # the caller's own copy
    np.testing.assert_array_equal(cache.get(specs[0], load), np_read(specs[0]))
    assert cache.stats()["hits"] == 3 and load.count == 2


def test_chunk_source_start_reads_real_bytes_and_checks_the_file(tmp_path, caches):
    path, specs = make_file(tmp_path, nchunks=3)
    source = ChunkSource("cpu", cache=False)
    pending = source.start(specs)
    for p, s in zip(pending, specs):
        np.testing.assert_array_equal(p.result(), np_read(s))
    pending = source.start(specs[:1])
    pending[0].result()
    with open(path, "ab") as f:                          # the file changes after indexing
        f.write(b"x")
    with pytest.raises(gpulazy.errors.ChunkReadError, match="changed since"):
        source.start(specs[:1])[0].result()


def test_dropped_caches_are_freed_and_an_array_keeps_its_cache(tmp_path):
    import gc
    import weakref

    from gpulazy.cache import open_caches

    refs: list = []
    for i in range(40):
        c = DeviceCache("1 MiB", device="cpu")
        spec = ChunkSpec((ByteRange("x", 0, 4096),), (1024,), "<f4")
        c.get(spec, lambda s: np.ones(1024, "f4"))
        if i % 2:  # prefetch threads started: they must not keep it alive
            done = threading.Event()
            c.prefetch([ChunkSpec((ByteRange("y", 0, 64),), (16,), "<f4")], lambda s: (done.set(), np.ones(16, "f4"))[1])
            assert done.wait(10)
        refs.append(weakref.ref(c))
        del c

    def all_freed():  # a prefetch thread lets go of its cache right after its last load
        gc.collect()
        return all(r() is None for r in refs)

    deadline = time.monotonic() + 10
    while not all_freed() and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    assert all_freed(), f"{sum(r() is not None for r in refs)} of 40 dropped caches still alive"
    assert not any(r() in open_caches() for r in refs)

    p = str(tmp_path / "a.npy")
    np.save(p, np.arange(64, dtype="f4"))
    vol = gpulazy.from_files(p, device="cpu", cache=DeviceCache("1 MiB", device="cpu"), chunks=16)
    gc.collect()
    assert float(vol.sum().compute()) == float(np.arange(64).sum())
    gc.collect()
    cache = vol.chunk_source.cache_instance()
    assert cache.stats()["misses"] == 4 and len(cache) == 4   # the same cache, alive through the array
    assert float(vol.sum().compute()) == float(np.arange(64).sum()) and cache.stats()["hits"] == 4
    ref = weakref.ref(cache)
    del vol, cache
    gc.collect()
    assert ref() is None
