"""Interrupts and clean-up: Ctrl-C in a task or a read, and a distributed cancel, stop read-ahead.

After each, the cache has nothing queued or in flight within a few seconds, the next
computation gives the right values, and (the autouse leak check) no thread, process or
file descriptor is left behind.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import fault_backend
import gpulazy
from gpulazy.cache import DeviceCache
from gpulazy.testing import wait_for_idle as _idle

N, ROWS = 48, (16, 256)


@pytest.fixture
def volume(tmp_path):
    path = str(tmp_path / "vol.raw")
    data = np.arange(N * ROWS[0] * ROWS[1], dtype="<u2").reshape(N, *ROWS)
    data.tofile(path)
    return path, data


@pytest.fixture
def cache():
    c = DeviceCache("1 MiB", device="cpu")  # the volume is 384 KiB: room to read ahead
    yield c
    c.close()


def _vol(path, cache, **kw):
    return gpulazy.from_files(path, shape=(N, *ROWS), dtype="<u2", chunks=(1, *ROWS), device="cpu",
                              cache=cache, **kw)


def _interrupt_at(block_id, at):
    def fn(x, block_info=None):
        if block_info[0]["chunk-location"][0] == at:
            raise KeyboardInterrupt("interrupted in a task")
        return x

    return fn


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_keyboard_interrupt_in_a_task_stops_read_ahead(volume, cache, scheduler):
    path, data = volume
    vol = _vol(path, cache)
    p = gpulazy.prefetch(depth=8)
    with pytest.raises(KeyboardInterrupt):
        with p:
            vol.map_blocks(_interrupt_at(None, 10), dtype=vol.dtype).sum().compute(scheduler=scheduler)
    s = _idle(cache)
    assert s["cancelled"] + s["prefetched"] + s["misses"] > 0  # read-ahead had started, then stopped
    assert p.last_summary is not None and p.last_summary["errored"] is True
    with p:
        assert int(vol.sum().compute(scheduler=scheduler)) == int(data.sum(dtype=np.uint64))


@pytest.mark.timeout(60)
def test_keyboard_interrupt_in_a_read(volume, cache):
    """The sync scheduler reads in the main thread, where Ctrl-C lands: raised from inside a read.

    (The other tests here cover interrupts with read-ahead, whose reads are started by the
    scheduler's thread and finished by the tasks.)"""
    path, data = volume
    fault_backend.install({"fault": "interrupt", "after": 2, "times": 1})
    try:
        vol = _vol(path, cache, backend="faulty")
        with pytest.raises(KeyboardInterrupt):
            vol.max(axis=(1, 2)).compute(scheduler="sync")
        _idle(cache)
        assert fault_backend.injected() == 1
        # Nothing half-read was cached: every value of the next compute is the file's.
        np.testing.assert_array_equal(vol.max(axis=(1, 2)).compute(scheduler="sync"), data.max(axis=(1, 2)))
    finally:
        fault_backend.uninstall()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("streamed", [False, True])
def test_ctrl_c_while_the_threaded_scheduler_waits(volume, cache, monkeypatch, streamed):
    """A real Ctrl-C (``_thread.interrupt_main``) while worker threads are inside slow reads.

    Through dask's tree (a task per chunk, read ahead by ``gpulazy.prefetch``) and streamed (a
    chain of steps, one per group of chunks: it stops between them)."""
    import _thread
    import contextlib
    import threading

    import gpulazy.read.whole

    path, data = volume
    monkeypatch.setattr(gpulazy.read.whole, "GROUP", 2 * ROWS[0] * ROWS[1] * 2)  # streamed: two chunks a group
    fault_backend.install({"fault": "slow", "delay": 0.1})
    try:
        vol = _vol(path, cache, backend="faulty")
        timer = threading.Timer(0.5, _thread.interrupt_main)
        timer.start()
        setting = (gpulazy.config.set(read_ahead=4 * ROWS[0] * ROWS[1] * 2) if streamed
                   else gpulazy.config.set(fused_reductions=False))
        try:
            with pytest.raises(KeyboardInterrupt), setting:
                with gpulazy.prefetch(depth=8) if not streamed else contextlib.nullcontext():
                    vol.sum().compute(scheduler="threads")
        finally:
            timer.join()
        s = _idle(cache)
        assert s["loads"] < N  # stopped before reading everything
        fault_backend.install(None)
        assert int(vol.sum().compute(scheduler="threads")) == int(data.sum(dtype=np.uint64))
    finally:
        fault_backend.uninstall()


@pytest.mark.timeout(60)
def test_keyboard_interrupt_on_the_fast_path_leaves_no_read_running(volume, cache):
    path, data = volume
    fault_backend.install({"fault": "interrupt", "after": 5, "times": 1})
    try:
        vol = _vol(path, False, backend="faulty")
        with pytest.raises(KeyboardInterrupt):
            vol.compute()
        assert vol.compute_path == "fast"
        np.testing.assert_array_equal(vol.compute(), data)
    finally:
        fault_backend.uninstall()


@pytest.mark.timeout(120)
def test_distributed_cancel_stops_read_ahead(volume):
    from distributed import Client, LocalCluster

    path, data = volume
    fault_backend.install({"fault": "slow", "delay": 0.2})  # every read slow: plenty in flight to cancel
    cluster = LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None)
    client = Client(cluster, set_as_default=False)
    cache = DeviceCache("8 MiB", device="cpu", name="interrupt-dist")
    try:
        gpulazy.prefetch.install(client, depth=8)
        vol = _vol(path, cache, backend="faulty")
        with gpulazy.config.set(fused_reductions=False):  # a task per chunk, read ahead by the plugin
            future = client.compute(vol.sum())
        deadline = time.monotonic() + 30
        while cache.stats()["loads"] + cache.stats()["in_flight"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        future.cancel()
        assert future.cancelled()
        s = _idle(cache, timeout=20)
        assert s["loads"] < N  # it stopped before reading everything
        fault_backend.install(None)
        assert int(client.compute(vol.sum()).result()) == int(data.sum(dtype=np.uint64))
    finally:
        gpulazy.prefetch.uninstall(client)
        client.close()
        cluster.close()
        cache.close()
        fault_backend.uninstall()
