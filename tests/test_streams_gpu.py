"""Stream contract on a GPU: gpulazy's own work never uses CuPy's legacy default stream,
and a chunk handed out is complete on every stream (README, "Streams")."""

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


def test_batched_reads_and_cache_copies_do_not_wait_for_the_legacy_stream(planes):
    cp = pytest.importorskip("cupy")
    paths, data = planes
    cache = gpulazy.DeviceCache("256 MiB", device="cuda:0", name="test-streams-legacy")
    try:
        vol = gpulazy.from_files(paths, shape=(256, 512), dtype=">u2", chunks=(1, 256, 512), device="cuda:0",
                                 cache=cache)
        specs = tuple(vol.chunk_index.specs.values())
        src = vol.chunk_source
        # Warm: backend, kernels, and the memory pools. (A first cudaMalloc or cudaHostAlloc
        # is an implicit synchronisation with every stream, the legacy one included; pools
        # make later reads allocation-free.)
        src.load_many(specs)
        src.load_many(specs)
        cache.clear()
        cp.cuda.Device(0).synchronize()
        ev = _spin_legacy(cp, 3.0)
        t0 = time.perf_counter()
        arrays = src.load_many(specs)       # staged reads, byte swaps, cache inserts and copies
        again = src.load_many(specs)        # cache hits: copies out
        gpulazy.get_device("cuda:0").synchronize()  # this thread's streams, not the device
        took = time.perf_counter() - t0
        assert not ev.done, f"gpulazy's reads waited for the legacy stream ({took:.2f} s)"
        ev.synchronize()
        for a, b, want in zip(arrays, again, data):  # chunks are (1, 256, 512)
            assert np.array_equal(cp.asnumpy(a)[0], want) and np.array_equal(cp.asnumpy(b)[0], want)
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


@pytest.mark.xfail(strict=False, reason="on the H100 at 325f8e1 Device.synchronize, called after a fast-path "
                   "compute, returned only after a 2 s legacy-stream kernel, while the same call after batched "
                   "reads (test above) did not wait; cause not found yet")
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
    from gpulazy.io import get_backend, read_chunks

    paths, data = planes
    vol = gpulazy.from_files(paths, shape=(256, 512), dtype=">u2", chunks=(2, 256, 512), device="cuda:0", cache=False)
    specs = list(vol.chunk_index.specs.values())
    be = get_backend("kvikio", "cuda:0")
    for staged in (True, False):
        got = read_chunks(specs, be, staged=staged)
        assert np.array_equal(cp.asnumpy(cp.concatenate(got)), data), staged
