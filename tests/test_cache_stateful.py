"""A hypothesis state machine drives one DeviceCache with gets, prefetches, cancels and clears.

Chunks are real byte ranges of a real file (random offsets, sizes, dtypes, byte orders,
element orders, one or two ranges), read through the posix backend. After every step:
the bytes held (plus those reserved for prefetches in flight) never exceed the capacity,
the cache's entries add up to ``bytes_held``, and the counters add up.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from gpulazy.array import ChunkSource
from gpulazy.cache import DeviceCache
from gpulazy.spec import ByteRange, ChunkSpec, file_identity
from gpulazy.testing import wait_for_idle

from test_cache import np_read

FILE_BYTES = 8192
_dir = tempfile.mkdtemp(prefix="gpulazy-cache-stateful-")
atexit.register(shutil.rmtree, _dir, True)
PATH = os.path.join(_dir, "random.bin")
np.random.default_rng(1234).integers(0, 256, FILE_BYTES, dtype=np.uint8).tofile(PATH)
IDENT = (file_identity(PATH),)

READ = ChunkSource(device="cpu", cache=False).read


class CountingRead:
    """The posix read, counted."""

    def __init__(self):
        self.count = 0

    def __call__(self, spec):
        self.count += 1  # GIL-atomic enough for a count compared after the workers are idle
        return READ(spec)


@st.composite
def chunk_specs(draw):
    dtype = draw(st.sampled_from(["|u1", "<u2", ">u2", "<i4", ">f4", "<f8", ">c8"]))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    split = draw(st.integers(0, nbytes - 1))  # 0: one range; else two ranges from anywhere
    sizes = [nbytes] if split == 0 else [split, nbytes - split]
    ranges = tuple(ByteRange(PATH, draw(st.integers(0, FILE_BYTES - n)), n) for n in sizes)
    order = draw(st.sampled_from("CF"))
    return ChunkSpec(ranges, shape, dtype, order=order, identity=IDENT)


class CacheMachine(RuleBasedStateMachine):
    specs = Bundle("specs")

    def __init__(self):
        super().__init__()
        self.cache: DeviceCache | None = None
        self.read = CountingRead()
        self.expected: dict[str, np.ndarray] = {}
        self.gets = 0
        self.read_into_hits = 0

    @initialize(capacity=st.integers(0, 3000), threads=st.integers(1, 3))
    def make_cache(self, capacity, threads):
        import gpulazy

        gpulazy.config.set(threads=threads)
        self.cache = DeviceCache(capacity, device="cpu")

    @rule(target=specs, spec=chunk_specs())
    def add_spec(self, spec):
        self.expected[spec.key] = np_read(spec)
        return spec

    @rule(spec=specs)
    def get(self, spec):
        out = self.cache.get(spec, self.read)
        self.gets += 1
        assert out.shape == spec.shape and out.dtype == spec.out_dtype
        np.testing.assert_array_equal(out, self.expected[spec.key])
        out[...] = 0  # a caller scribbling on its result must not reach the cache

    @rule(spec=specs)
    def read_into(self, spec):
        out = np.full(spec.shape, 3, dtype=spec.out_dtype)
        if self.cache.read_into(spec, out):
            self.read_into_hits += 1
            np.testing.assert_array_equal(out, self.expected[spec.key])
        else:
            assert (out == 3).all()

    @rule(chosen=st.lists(specs, max_size=6))
    def prefetch(self, chosen):
        self.cache.prefetch(chosen, self.read)

    @rule(chosen=st.one_of(st.none(), st.lists(specs, max_size=4)))
    def cancel(self, chosen):
        queued = self.cache.stats()["queued"]
        n = self.cache.cancel(chosen)
        assert 0 <= n <= queued
        if chosen is None:
            assert self.cache.stats()["queued"] == 0

    @rule()
    def clear(self):
        warmed = self.cache.stats()["prefetched"]
        self.cache.clear()
        s = self.cache.stats()
        # Bytes held after a clear come only from prefetch reads in flight through it: still in
        # flight, or landed since (a read may land between the clear and this snapshot).
        assert s["bytes_held"] == 0 or s["in_flight"] > 0 or s["prefetched"] > warmed

    @rule()
    def wait_idle(self):
        s = wait_for_idle(self.cache)
        assert s["bytes_reserved"] == 0
        assert self.read.count == s["loads"] + s["errors"]
        assert s["errors"] == 0

    @invariant()
    def bounded_and_consistent(self):
        if self.cache is None:
            return
        c = self.cache
        with c._lock:  # entries and totals read together
            held = c._held
            total = sum(e.nbytes for e in c._entries.values())
            arrays = sum(e.array.nbytes for e in c._entries.values())
            reserved = c._reserved
            pins = sum(e.pins for e in c._entries.values())
            unused = sum(e.nbytes for e in c._entries.values() if e.prefetched)
        assert held == total == arrays
        assert 0 <= reserved and held + reserved <= c.capacity
        assert unused <= c.capacity
        assert pins == 0  # nothing is copied out between steps
        s = c.stats()
        assert s["hits"] + s["misses"] == self.gets + self.read_into_hits
        assert s["prefetch_hits"] <= s["prefetched"] + s["in_flight"] + s["hits"]
        assert s["misses"] <= s["loads"] + s["errors"] + s["in_flight"]

    def teardown(self):
        if self.cache is not None:
            self.cache.close()


CacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_cache_state_machine = CacheMachine.TestCase
