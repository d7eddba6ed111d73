"""Stream contract on a GPU: gpulazy's own work never runs on the caller's stream, a chunk
handed out is complete on every stream, and memory taken from the caller's pool is written
only after the caller's queued kernels (docs/streams.md)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import gpulazy

pytestmark = pytest.mark.gpu

SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
'''


def _spin_legacy(cp, seconds: float):
    """Busy the legacy default stream for ``seconds``; returns an event recorded after it."""
    kernel = cp.RawKernel(SPIN, "spin")
    hz = cp.cuda.runtime.getDeviceProperties(0)["clockRate"] * 1000
    with cp.cuda.Stream.null:
        kernel((1,), (1,), (np.int64(int(seconds * hz)),))
        ev = cp.cuda.Event()
        ev.record(cp.cuda.Stream.null)
    return ev


@pytest.fixture
def planes(tmp_path):
    data = np.random.default_rng(1).integers(0, 60000, (8, 256, 512)).astype(">u2")  # byte swap on the device
    paths = []
    for i in range(8):
        p = os.path.join(tmp_path, f"z{i}.raw")
        data[i].tofile(p)
        paths.append(p)
    return paths, data.astype("u2")


def test_a_chunk_read_into_memory_the_legacy_stream_still_reads_waits_for_it(planes):
    """Memory the consumer dropped while its kernels still read it is reused by the next read:
    gpulazy's writes (staged copies, byte swaps, cache copies) wait for those kernels on the
    device (``Device.alloc``). Before, a read on gpulazy's non-blocking stream overwrote the
    chunk under a queued kernel of the user's."""
    cp = pytest.importorskip("cupy")
    paths, data = planes
    cache = gpulazy.DeviceCache("256 MiB", device="cuda:0", name="test-streams-legacy")
    try:
        vol = gpulazy.from_files(paths, shape=(256, 512), dtype=">u2", chunks=(1, 256, 512), device="cuda:0",
                                 cache=cache)
        specs = tuple(vol.chunk_index.specs.values())
        src = vol.chunk_source
        src.load_many(specs)                 # warm: backend, kernels, pools
        cache.clear()
        for first, then in ((specs[:4], specs[4:]), (specs[4:], specs[:4])):  # misses, then hits
            arrays = src.load_many(first)
            _spin_legacy(cp, 0.5)
            with cp.cuda.Stream.null:        # the user's kernels, queued behind the spin
                sums = [a.astype(cp.int64).sum() for a in arrays]
            del arrays                       # dropped while those kernels are queued: back to the pool
            again = src.load_many(then)      # may take the same memory
            want = [int(d.astype(np.int64).sum()) for d in data]
            got = [int(x) for x in sums]
            offset = 0 if first[0] is specs[0] else 4
            assert got == want[offset:offset + 4], "a read overwrote a chunk a queued kernel was reading"
            for a, s in zip(again, then):
                assert np.array_equal(cp.asnumpy(a)[0], data[s.index[0]])
    finally:
        cache.close()


def test_a_consumer_on_another_thread_and_stream_sees_complete_chunks(planes):
    cp = pytest.importorskip("cupy")
    paths, data = planes
    vol = gpulazy.from_files(paths, shape=(256, 512), dtype=">u2", chunks=(1, 256, 512), device="cuda:0",
                             cache=False)
    specs = tuple(vol.chunk_index.specs.values())
    for _ in range(3):
        arrays = vol.chunk_source.load_many(specs)
        sums = {}

        def consume():
            with cp.cuda.Stream(non_blocking=True) as s:
                sums["got"] = [int(a.astype(cp.int64).sum()) for a in arrays]
                s.synchronize()

        t = threading.Thread(target=consume)
        t.start()
        t.join()
        assert sums["got"] == [int(d.astype(np.int64).sum()) for d in data]


def test_derived_compute_and_device_synchronize_leave_streams_alone(planes):
    cp = pytest.importorskip("cupy")
    paths, data = planes
    before = cp.cuda.get_current_stream()
    vol = gpulazy.from_files(paths, shape=(256, 512), dtype=">u2", device="cuda:0", cache=False)
    assert np.array_equal(cp.asnumpy(vol.max(axis=0).compute()), data.max(axis=0))
    assert np.array_equal(cp.asnumpy(vol.compute()), data)
    assert cp.cuda.get_current_stream() == before  # the user's current stream is untouched
    ev = _spin_legacy(cp, 2.0)
    gpulazy.get_device("cuda:0").synchronize()
    with cp.cuda.Stream(non_blocking=True) as mine:  # a stream of the user's own is waited for
        x = cp.arange(10)
        gpulazy.get_device("cuda:0").synchronize()
        assert mine.done and int(x[-1]) == 9
    assert not ev.done, "Device.synchronize waited for the legacy default stream"
    ev.synchronize()


def test_staged_and_direct_kvikio_reads_equal_the_file(planes):
    cp = pytest.importorskip("cupy")
    from gpulazy.io import get_backend
    from gpulazy.read import read

    paths, data = planes
    vol = gpulazy.from_files(paths, shape=(256, 512), dtype=">u2", chunks=(2, 256, 512), device="cuda:0", cache=False)
    specs = list(vol.chunk_index.specs.values())
    be = get_backend("kvikio", "cuda:0")
    for staged in (True, False):
        got = read(specs, be, staged=staged)
        assert np.array_equal(cp.asnumpy(cp.concatenate(got)), data), staged
