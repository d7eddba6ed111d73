"""Read-ahead on a real ``dask.distributed`` cluster of worker processes (device "cpu").

Each worker reads through its own default cache (``GPULAZY_CACHE`` is set for the worker
processes); hit rates are read from those caches with ``client.run``.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import gpulazy

distributed = pytest.importorskip("distributed")

N_CHUNKS = 64


def busy(block):
    # Compute per chunk that takes a little longer than reading it (a page-cache read of
    # 32 KiB): the read-then-compute loop the prefetcher is for.
    time.sleep(0.005)
    return block


def cache_stats(dask_worker=None):
    from gpulazy.cache import default_cache

    return default_cache("cpu").stats()


def reset_cache(dask_worker=None):
    from gpulazy.cache import default_cache

    cache = default_cache("cpu")
    cache.clear()
    cache.reset_stats()


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # Worker processes inherit the environment: a modest default cache on "cpu".
    old = os.environ.get("GPULAZY_CACHE")
    os.environ["GPULAZY_CACHE"] = "64 MiB"
    try:
        with distributed.LocalCluster(processes=True, n_workers=2, threads_per_worker=1,
                                      dashboard_address=None) as cluster, distributed.Client(cluster) as c:
            yield c
    finally:
        if old is None:
            os.environ.pop("GPULAZY_CACHE", None)
        else:
            os.environ["GPULAZY_CACHE"] = old


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    path = os.path.join(d, "vol.raw")
    data = np.arange(N_CHUNKS * 16 * 1024, dtype="uint16").reshape(N_CHUNKS * 16, 1024)
    data.tofile(path)
    vol = gpulazy.from_files(path, shape=data.shape, dtype="uint16", chunks=(16, 1024), device="cpu")
    return vol, data


def run_once(client, vol, data):
    client.run(reset_cache)
    got = vol.map_blocks(busy).sum(dtype="u8").compute()
    assert int(got) == int(data.sum(dtype="u8"))
    stats = client.run(cache_stats)
    assert len(stats) == 2
    total = {k: sum(s[k] for s in stats.values()) for k in ("hits", "misses", "loads", "prefetched",
                                                            "prefetch_hits", "queued")}
    return total, stats


def scheduler_saturation(client):
    return client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.WORKER_SATURATION)


def test_no_plugin_no_prefetch(client, volume):
    total, _ = run_once(client, *volume)
    assert total["loads"] == N_CHUNKS and total["prefetched"] == 0
    assert set(gpulazy.prefetch.summaries(client).values()) == {None}


def test_workers_prefetch_their_own_tasks(client, volume, record_property):
    before = scheduler_saturation(client)
    info = gpulazy.prefetch.install(client, depth=8)
    try:
        assert info["saturation"] == (before, 1 + 8 / 1)  # one thread per worker
        assert scheduler_saturation(client) == 9
        total, per_worker = run_once(client, *volume)
        summaries = gpulazy.prefetch.summaries(client)
    finally:
        gpulazy.prefetch.uninstall(client)
    assert scheduler_saturation(client) == before
    gets = total["hits"] + total["misses"]
    share = total["prefetch_hits"] / gets
    ahead = {addr: (s["ahead_max"], round(s["ahead_mean"], 1)) for addr, s in summaries.items()}
    print(f"\ndistributed read-ahead: {share:.0%} of {gets} chunk gets served by prefetched chunks; "
          f"(max, mean) tasks waiting per worker at each start: {ahead}")
    record_property("prefetch_share", share)
    record_property("ahead", ahead)
    assert total["loads"] == N_CHUNKS  # each chunk read once, by the worker that used it
    assert all(s["loads"] > 0 for s in per_worker.values())  # both workers took part
    assert share >= 0.9, (total, summaries)
    assert total["prefetched"] == total["prefetch_hits"] and total["queued"] == 0
    for s in summaries.values():
        assert 1 <= s["ahead_max"] <= 8
        assert s["peak_outstanding_bytes"] <= s["budget"] <= (64 << 20) // 2
        assert s["error"] is None and s["pending"] == 0


def test_default_saturation_sees_little_ahead(client, volume, record_property):
    info = gpulazy.prefetch.install(client, depth=8, saturation=None)
    try:
        assert info["saturation"][0] == info["saturation"][1] == scheduler_saturation(client)
        total, _ = run_once(client, *volume)
        summaries = gpulazy.prefetch.summaries(client)
    finally:
        gpulazy.prefetch.uninstall(client)
    ahead = max(s["ahead_max"] for s in summaries.values())
    record_property("ahead_default_saturation", ahead)
    print(f"\ndefault worker-saturation: at most {ahead} task(s) waiting per worker; "
          f"{total['prefetch_hits']} of {N_CHUNKS} gets served by prefetched chunks")
    assert ahead <= 1  # 1.1 x 1 thread: two slots, one of them running
    assert total["loads"] == N_CHUNKS


def test_read_error_reaches_the_client(client, tmp_path):
    path = os.path.join(tmp_path, "short.raw")
    np.zeros((32, 1024), dtype="uint16").tofile(path)
    vol = gpulazy.from_files(path, shape=(32, 1024), dtype="uint16", chunks=(4, 1024), device="cpu")
    with open(path, "r+b") as f:
        f.truncate(5 * 4 * 1024 * 2)
    gpulazy.prefetch.install(client, depth=4)
    try:
        with pytest.raises(gpulazy.errors.ChunkReadError, match="short.raw"):
            vol.map_blocks(busy).sum().compute()
    finally:
        gpulazy.prefetch.uninstall(client)


def test_install_arguments(client):
    with pytest.raises(ValueError, match="depth"):
        gpulazy.prefetch.install(client, depth=0)
    with pytest.raises(ValueError, match="saturation"):
        gpulazy.prefetch.install(client, saturation="lots")


def gpu_cache_stats(dask_worker=None):
    from gpulazy.cache import cache_by_name

    return cache_by_name("dist-gpu-cache").stats()


@pytest.mark.gpu
def test_workers_prefetch_onto_the_gpu(tmp_path):
    """A worker process reads through its own device cache on cuda:0, warmed ahead of its tasks."""
    from gpulazy.cache import DeviceCache

    data = np.arange(N_CHUNKS * 16 * 1024, dtype="uint16").reshape(N_CHUNKS * 16, 1024)
    path = tmp_path / "vol.raw"
    data.tofile(path)
    cache = DeviceCache("64 MiB", device="cuda:0", name="dist-gpu-cache")
    vol = gpulazy.from_files(path, shape=data.shape, dtype="uint16", chunks=(16, 1024), device="cuda:0",
                             cache=cache)
    with distributed.LocalCluster(processes=True, n_workers=1, threads_per_worker=1,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as c:
        gpulazy.prefetch.install(c, depth=8)
        try:
            got = vol.map_blocks(busy).sum(dtype="u8").compute()
            (stats,) = c.run(gpu_cache_stats).values()
        finally:
            gpulazy.prefetch.uninstall(c)
    cache.close()
    assert int(got) == int(data.sum(dtype="u8"))
    assert stats["device"] == "cuda:0" and stats["loads"] == N_CHUNKS
    share = stats["prefetch_hits"] / (stats["hits"] + stats["misses"])
    print(f"\ndistributed read-ahead on cuda:0: {share:.0%} of chunk gets served by prefetched chunks")
    assert share >= 0.8 and stats["bytes_held"] <= stats["capacity"]
