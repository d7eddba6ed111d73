"""Issue 11: device-aware conversion, the ``on`` decorator, ``release`` and out-of-memory recovery."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import gpulazy
import gpulazy.io as gio
from gpulazy.errors import DeviceError, DeviceMemoryError, OptionalDependencyError
from gpulazy.io._posix import PosixBackend

torch = pytest.importorskip("torch")


# --- conversion -------------------------------------------------------------------------

def test_to_torch_same_device_is_zero_copy():
    a = np.arange(12, dtype="float32").reshape(3, 4)
    t = gpulazy.to_torch(a, device="cpu")
    assert t.data_ptr() == a.ctypes.data  # the same memory, not a copy
    t[0, 0] = 42
    assert a[0, 0] == 42


def test_to_torch_device_accepts_torch_device():
    a = np.ones(3, dtype="int16")
    assert gpulazy.to_torch(a, device=torch.device("cpu")).data_ptr() == a.ctypes.data


def test_to_numpy_refuses_a_gpu_device():
    with pytest.raises(DeviceError, match="host"):
        gpulazy.to_numpy(np.ones(2), device="cuda:0")


@pytest.mark.parametrize("cupy_importable", [True, False], ids=["as-installed", "cupy-missing"])
def test_to_cupy_refuses_cpu_device(monkeypatch, cupy_importable):
    # A host device is refused for what it is, whether or not CuPy is installed: installing
    # the gpu extra would not make it possible.
    if not cupy_importable:
        monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(DeviceError, match="to_numpy"):
        gpulazy.to_cupy(np.ones(2), device="cpu")


def test_to_cupy_without_cupy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(OptionalDependencyError, match=r"gpulazy\[gpu\]"):
        gpulazy.to_cupy(np.ones(2))


def test_to_cupy_rejects_dask():
    vol = gpulazy.from_files  # noqa: F841 - keep the import side of the API in view
    import dask.array as da

    with pytest.raises(TypeError, match="compute"):
        gpulazy.to_cupy(da.ones(4))


# --- the decorator ------------------------------------------------------------------------

def test_on_converts_array_arguments_and_leaves_others():
    seen = {}

    @gpulazy.on("torch", device="cpu")
    def f(a, b, *, scale, name="x"):
        seen.update(a=type(a), b=type(b), scale=type(scale), name=name)
        return a * scale + b

    a, b = np.arange(3.0), np.ones(3)
    out = f(a, b, scale=2, name="y")
    assert seen == {"a": torch.Tensor, "b": torch.Tensor, "scale": int, "name": "y"}
    assert isinstance(out, torch.Tensor) and out.tolist() == [1.0, 3.0, 5.0]


def test_on_converts_results_back():
    @gpulazy.on("torch", result="numpy")
    def pair(a):
        return a + 1, a * 2

    lo, hi = pair(np.arange(3))
    assert isinstance(lo, np.ndarray) and lo.tolist() == [1, 2, 3]
    assert isinstance(hi, np.ndarray) and hi.tolist() == [0, 2, 4]


def test_on_shares_memory_on_the_same_device():
    a = np.zeros(4, dtype="float32")

    @gpulazy.on("torch", device="cpu")
    def fill(t):
        t += 5

    fill(a)
    assert a.tolist() == [5.0] * 4


def test_on_rejects_an_unknown_framework():
    with pytest.raises(ValueError, match="'tensorflow'.*valid"):
        gpulazy.on("tensorflow")


# --- release -------------------------------------------------------------------------------

def _raw(tmp_path, n=8, side=16):
    data = np.arange(n * side * side, dtype="uint16").reshape(n, side, side)
    path = tmp_path / "vol.raw"
    data.tofile(path)
    return path, data


def test_release_empties_caches_and_reports_bytes(tmp_path):
    path, data = _raw(tmp_path)
    cache = gpulazy.DeviceCache("1 MiB", device="cpu")
    try:
        vol = gpulazy.from_files(path, shape=data.shape, dtype="uint16", chunks=(2, 16, 16), device="cpu",
                                 cache=cache)
        vol.sum().compute(scheduler="sync")
        held = cache.bytes_held
        assert held == data.nbytes
        report = gpulazy.release(device="cpu")
        assert report["cache_bytes"] >= held and report["caches"] >= 1
        assert cache.bytes_held == 0 and len(cache) == 0
        np.testing.assert_array_equal(vol.compute(scheduler="sync"), data)  # still readable afterwards
    finally:
        cache.close()


# --- out-of-memory recovery ---------------------------------------------------------------------

class OomOnceBackend(PosixBackend):
    """Test double: a posix backend whose first ``fail`` submissions raise MemoryError (as a full GPU
    would). (The read engine submits through ``submit_many``.)"""

    name = "oom-once"
    fail = 1

    def submit_many(self, jobs, **kwargs):
        if type(self).fail > 0:
            type(self).fail -= 1
            raise MemoryError("out of memory (injected by OomOnceBackend)")
        return super().submit_many(jobs, **kwargs)


@pytest.fixture
def oom_backend(monkeypatch):
    module = types.ModuleType("gpulazy_test_oom")
    module.OomOnceBackend = OomOnceBackend
    monkeypatch.setitem(sys.modules, "gpulazy_test_oom", module)
    monkeypatch.setattr(gio, "_entry_points", lambda: {"oom-once": "gpulazy_test_oom:OomOnceBackend"})
    yield OomOnceBackend
    OomOnceBackend.fail = 1


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_compute_recovers_from_one_oom_with_a_small_cache(tmp_path, oom_backend, scheduler):
    path, data = _raw(tmp_path, n=16)
    cache = gpulazy.DeviceCache(data.nbytes // 4, device="cpu")  # 25 % of the working set
    try:
        vol = gpulazy.from_files(path, shape=data.shape, dtype="uint16", chunks=(2, 16, 16), device="cpu",
                                 cache=cache, backend="oom-once")
        before = gpulazy.stats().snapshot()["oom_recoveries"].get("cpu", 0)
        got = (vol.astype("int64") * 3).sum(axis=0).compute(scheduler=scheduler)
        np.testing.assert_array_equal(got, (data.astype("int64") * 3).sum(axis=0))
        assert gpulazy.stats().snapshot()["oom_recoveries"]["cpu"] == before + 1
        assert oom_backend.fail == 0
        assert cache.readahead_fraction == 0.5  # read-ahead shrank
        assert cache.bytes_held <= cache.capacity
    finally:
        cache.close()


@pytest.mark.parametrize("part,nbytes", [
    (lambda vol: vol[:, [0, 2]].sum(axis=0), 4096),  # dask's tasks: the chunk task reads its 8 planes
    (lambda vol: vol[[0, 2]], 2 * 512),  # a list of planes: two boxes, read alone in one submission
    (lambda vol: vol[[0, 2]].sum(axis=0), 2 * 512),  # a list's reduction: its planes alone, in one submission
    (lambda vol: vol[0], 512),  # a plane, read alone
    (lambda vol: vol, 4096),  # the whole read
    (lambda vol: vol.max(axis=0), 4096),  # a streamed reduction
    (lambda vol: vol.map_blocks(np.negative), 4096),  # a streamed map
    (lambda vol: vol[::2], 4 * 512),  # a step: planes 0, 2, 4 and 6 of the chunk, read alone
], ids=["dask", "list", "list-reduction", "plane", "whole", "reduction", "map", "step"])
def test_second_oom_raises_with_the_figures(tmp_path, oom_backend, part, nbytes):
    oom_backend.fail = 2
    path, data = _raw(tmp_path)
    vol = gpulazy.from_files(path, shape=data.shape, dtype="uint16", chunks=(8, 16, 16), device="cpu",
                             cache=False, backend="oom-once")
    with pytest.raises(DeviceMemoryError) as info:
        part(vol).compute(scheduler="sync")
    msg = str(info.value)
    assert f"{nbytes} bytes requested" in msg and "free" in msg and "held by gpulazy" in msg
    assert str(path) in msg
    assert isinstance(info.value, MemoryError)


# --- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cupy_hand_off_is_zero_copy_and_fast():
    import time

    import cupy

    x = cupy.arange(1 << 20, dtype=cupy.float32)
    t = gpulazy.to_torch(x, device="cuda:0")
    assert t.data_ptr() == x.data.ptr
    y = gpulazy.to_cupy(t)
    assert y.data.ptr == x.data.ptr
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        gpulazy.to_torch(x, device="cuda:0")
    per = (time.perf_counter() - t0) / n
    assert per < 500e-6  # generous for shared hosts; the benchmark reports the figure


@pytest.mark.gpu
def test_to_torch_moves_to_the_host_when_asked():
    import cupy

    x = cupy.arange(5, dtype=cupy.int32)
    t = gpulazy.to_torch(x, device="cpu")
    assert t.device.type == "cpu" and t.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="copy"):
        gpulazy.to_torch(x, device="cpu", copy=False)


@pytest.mark.gpu
def test_real_oom_from_a_pool_limit_recovers(tmp_path):
    """A read that finds no memory beside a full cache makes room (evicts it) and succeeds."""
    import cupy

    import gc

    from gpulazy.stats import default_stats

    data = np.arange(64 * 256 * 256, dtype="uint16").reshape(64, 256, 256)  # 8 MiB a file
    other = data[::-1].copy()
    data.tofile(tmp_path / "a.raw")
    other.tofile(tmp_path / "b.raw")
    cache = gpulazy.DeviceCache(data.nbytes, device="cuda:0")
    pool = cupy.get_default_memory_pool()
    limit = pool.get_limit()
    try:
        a, b = (gpulazy.from_files(tmp_path / name, shape=data.shape, dtype="uint16", chunks=(4, 256, 256),
                                   device="cuda:0", cache=cache) for name in ("a.raw", "b.raw"))
        a.sum().compute(scheduler="sync")
        assert cache.bytes_held == data.nbytes  # (the precondition: the cache is full of ``a``)
        gc.collect()
        pool.free_all_blocks()
        # Room for a step of the compute (a batch of reads, their float32 copies) only once the
        # cache's 8 MiB of ``a`` are evicted: ``b``'s reads must make room to get memory.
        pool.set_limit(size=pool.used_bytes() + (5 << 20))
        before = default_stats().snapshot()["oom_recoveries"].get("cuda:0", 0)
        got = b.astype("float32").max(axis=0).compute(scheduler="sync")
        pool.set_limit(size=limit)
        np.testing.assert_array_equal(cupy.asnumpy(got), other.max(axis=0).astype("float32"))
        assert default_stats().snapshot()["oom_recoveries"].get("cuda:0", 0) > before
    finally:
        pool.set_limit(size=limit)
        cache.close()


@pytest.mark.gpu
def test_prefetcher_slot_is_not_overwritten_while_torch_reads_it():
    """DALI#5617: a recycled buffer must wait for the consumer's torch stream, not only CuPy's."""
    import cupy

    from gpulazy.stream import Prefetcher

    count = iter(range(1, 1000))

    def loader():
        return cupy.full((1 << 20,), next(count), dtype=cupy.float32)

    side = torch.cuda.Stream()
    sums = []
    with Prefetcher(loader, "float32", (1 << 20,), capacity=2, nworkers=2, device="cuda:0",
                    post=lambda b: gpulazy.to_torch(b)) as stream:
        with torch.cuda.stream(side):
            for _ in range(6):
                t = next(stream)
                torch.cuda._sleep(20_000_000)  # keep the stream busy before reading t
                sums.append(t.sum())
        torch.cuda.synchronize()
    values = [float(s) / (1 << 20) for s in sums]
    assert all(v == int(v) for v in values) and len(set(values)) == 6, values
