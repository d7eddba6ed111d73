"""Prefetcher: values, order, the buffer reuse rule, errors, timeouts and clean shutdown."""

from __future__ import annotations

import gc
import multiprocessing
import threading
import time
import traceback

import numpy as np
import pytest

import gpulazy
from gpulazy.stream import Prefetcher

from conftest import to_host
from test_stream_helpers import Counter, Crash, FailAfter


def stream_threads(p: Prefetcher) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(p.name + "-")]


def stream_procs(p: Prefetcher) -> list:
    return [c for c in multiprocessing.active_children() if c.name.startswith(p.name + "-")]


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition never became true")
        time.sleep(0.002)


def values(arrays) -> list[int]:
    return [int(to_host(a)[0, 0]) for a in arrays]


# --- thread mode ------------------------------------------------------------------

def test_public_name():
    assert gpulazy.Prefetcher is Prefetcher


def test_one_worker_keeps_the_loader_order(device):
    with Prefetcher(Counter(n=20), "float32", (4, 8), capacity=3, device=device) as p:
        got = [to_host(x).copy() for x in p]
        assert stream_threads(p) == []
    assert [int(g[0, 0]) for g in got] == list(range(20))
    assert all(g.shape == (4, 8) and g.dtype == np.float32 and (g == g[0, 0]).all() for g in got)


def test_many_workers_load_each_item_once(device):
    with Prefetcher(Counter(n=50, delay=0.001), "float32", (4, 8), capacity=4, device=device, nworkers=4) as p:
        got = [int(to_host(x)[0, 0]) for x in p]
    assert sorted(got) == list(range(50))   # every item once; the order is not promised


def test_buffers_are_preallocated_and_reused():
    with Prefetcher(Counter(), "float32", (4, 8), capacity=3, device="cpu") as p:
        addresses = {next(p).ctypes.data for _ in range(12)}
    assert len(addresses) == 3


def test_reuse_rule_valid_until_the_following_next(device):
    # capacity 2: while the consumer holds one buffer, the worker fills the other and waits.
    with Prefetcher(Counter(), "float32", (4, 8), capacity=2, device=device) as p:
        a = next(p)
        assert int(to_host(a)[0, 0]) == 0
        wait_for(lambda: p.stats()["produced"] == 2)
        time.sleep(0.1)                            # the worker would overwrite `a` now if it could
        assert (to_host(a) == 0).all() and p.stats()["produced"] == 2
        b = next(p)                                # gives a's buffer back to the ring...
        assert (to_host(b) == 1).all()
        wait_for(lambda: p.stats()["produced"] == 3)
        assert (to_host(a) == 2).all()             # ...which was refilled: a was only valid until now
        assert (to_host(b) == 1).all()             # b is held, untouched


def test_dtype_cast_and_post():
    rng = np.random.default_rng(0)
    expected = []

    def loader():
        x = rng.random((3, 5))                    # float64, cast to float32 (same kind)
        expected.append(x)
        return x

    with Prefetcher(loader, np.float32, (3, 5), capacity=2, device="cpu", post=lambda x: x.sum()) as p:
        s = next(p)
    assert isinstance(s, np.float32)
    np.testing.assert_allclose(s, expected[0].astype(np.float32).sum(), rtol=1e-6)


def test_post_to_torch_shares_the_buffer():
    pytest.importorskip("torch")
    with Prefetcher(Counter(n=3), "float32", (4, 8), capacity=2, device="cpu", post=gpulazy.to_torch) as p:
        t = next(p)
        assert type(t).__module__.startswith("torch") and float(t[0, 0]) == 0.0


def test_loader_error_reaches_the_consumer_with_its_traceback(device):
    p = Prefetcher(FailAfter(3), "float32", (4, 8), capacity=2, device=device)
    got = []
    with pytest.raises(ValueError, match="broken.tif") as info:
        with p:
            for x in p:
                got.append(int(to_host(x)[0, 0]))
    assert got == list(range(len(got))) and len(got) <= 3
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "broken_loader_helper" in frames      # the loader's own frame is kept
    with pytest.raises(StopIteration):
        next(p)
    assert stream_threads(p) == []


def test_wrong_shape_is_an_error_naming_both_shapes():
    with Prefetcher(lambda: np.zeros((2, 2)), "float32", (4, 8), capacity=2, device="cpu") as p:
        with pytest.raises(ValueError, match=r"shape \(2, 2\).*\(4, 8\)"):
            next(p)


def test_unsafe_cast_is_refused():
    with Prefetcher(lambda: np.zeros((4, 8), "float64"), "int16", (4, 8), capacity=2, device="cpu") as p:
        with pytest.raises(ValueError, match="float64"):
            next(p)


def test_timeout():
    with Prefetcher(Counter(delay=0.5), "float32", (4, 8), capacity=2, device="cpu", timeout=0.1) as p:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="0.1 s"):
            next(p)
        assert time.monotonic() - t0 < 1.0


def test_exit_stops_every_worker_within_a_second(device):
    p = Prefetcher(Counter(delay=0.01), "float32", (4, 8), capacity=3, device=device, nworkers=4)
    with p:
        next(p)
        wait_for(lambda: p.stats()["ready"] == 2)  # workers are now blocked on a full ring
        assert len(stream_threads(p)) == 4
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 1.0
    assert stream_threads(p) == []
    assert p.stats()["closed"]


def test_stop_iteration_with_many_workers_drains_then_ends():
    p = Prefetcher(Counter(n=7, delay=0.005), "float32", (4, 8), capacity=2, device="cpu", nworkers=3)
    got = sorted(int(x[0, 0]) for x in p)        # no ``with``: started by next(), closed at the end
    assert got == list(range(7))
    wait_for(lambda: stream_threads(p) == [], timeout=2)
    with pytest.raises(StopIteration):
        next(p)


def test_an_abandoned_stream_stops_when_collected():
    p = Prefetcher(Counter(), "float32", (4, 8), capacity=2, device="cpu", nworkers=2)
    next(p)
    name = p.name
    del p
    gc.collect()
    wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith(name + "-")], timeout=2)


@pytest.mark.parametrize("kwargs, error", [
    (dict(capacity=0), ValueError),
    (dict(nworkers=0), ValueError),
    (dict(mode="fork-bomb"), ValueError),
    (dict(mode="process", context="fork"), ValueError),
    (dict(post="torch"), TypeError),
])
def test_bad_arguments(kwargs, error):
    args = dict(loader=Counter(), dtype="float32", shape=(4, 8), capacity=2, device="cpu")
    args.update(kwargs)
    with pytest.raises(error):
        Prefetcher(**args)


def test_loader_must_be_callable():
    with pytest.raises(TypeError, match="callable"):
        Prefetcher(None, "float32", (4,), capacity=2, device="cpu")


# --- process mode -------------------------------------------------------------------

def test_process_mode_one_worker_keeps_order_and_leaves_no_process(device):
    p = Prefetcher(Counter(n=12), "float32", (4, 8), capacity=3, device=device, mode="process")
    with p:
        got = [to_host(x).copy() for x in p]
    assert [int(g[0, 0]) for g in got] == list(range(12))
    assert all((g == g[0, 0]).all() for g in got)
    assert stream_procs(p) == [] and stream_threads(p) == []


def test_process_mode_many_workers_share_one_count():
    counter = multiprocessing.get_context("spawn").Value("i", 0)
    p = Prefetcher(Counter(n=30, shared=counter), "float32", (4, 8), capacity=3, device="cpu",
                   nworkers=3, mode="process")
    with p:
        assert len(stream_procs(p)) == 3
        got = sorted(int(x[0, 0]) for x in p)
    assert got == list(range(30))
    assert stream_procs(p) == []


def test_process_mode_error_has_the_remote_traceback():
    p = Prefetcher(FailAfter(2), "float32", (4, 8), capacity=2, device="cpu", mode="process")
    with pytest.raises(ValueError, match="broken.tif") as info:
        with p:
            for _ in p:
                pass
    assert "broken_loader_helper" in str(info.value.__cause__)
    assert stream_procs(p) == [] and stream_threads(p) == []


def test_process_mode_crash_is_reported():
    p = Prefetcher(Crash(1), "float32", (4, 8), capacity=2, device="cpu", mode="process")
    with pytest.raises(RuntimeError, match="exited with code 3"):
        with p:
            for _ in p:
                pass
    assert stream_procs(p) == []


def test_process_mode_needs_a_picklable_loader():
    p = Prefetcher(lambda: np.zeros((4, 8)), "float32", (4, 8), capacity=2, device="cpu", mode="process")
    with pytest.raises(TypeError, match="picklable"):
        p.start()


def test_process_mode_exit_is_prompt():
    p = Prefetcher(Counter(delay=0.01), "float32", (4, 8), capacity=2, device="cpu", nworkers=2, mode="process")
    with p:
        next(p)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 1.5
    assert stream_procs(p) == [] and stream_threads(p) == []


# --- GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_buffers_are_cupy_and_loaders_may_return_cupy():
    import cupy as cp

    def loader(c=Counter(n=6)):
        return cp.asarray(c())

    with Prefetcher(loader, "float32", (4, 8), capacity=2, device="cuda:0") as p:
        first = next(p)
        assert isinstance(first, cp.ndarray) and first.device.id == 0
        rest = [int(x[0, 0]) for x in p]
    assert rest == [1, 2, 3, 4, 5]


@pytest.mark.gpu
def test_gpu_consumer_kernels_finish_before_a_buffer_is_refilled():
    import cupy as cp

    shape = (2048, 2048)
    with Prefetcher(Counter(n=8, shape=shape), "float32", shape, capacity=2, device="cuda:0") as p:
        sums = []
        for x in p:
            sums.append(x.sum(dtype=cp.float64))   # queued on the consumer's stream, read later
    assert [float(s) for s in sums] == [float(i * shape[0] * shape[1]) for i in range(8)]
