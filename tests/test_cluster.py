"""``gpulazy.cluster()``: a real multi-process LocalCluster reads chunks on the workers."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import gpulazy


@pytest.fixture(scope="module")
def client():
    c = gpulazy.cluster(n_workers=2, threads_per_worker=1, gpus=False, dashboard_address=None)
    yield c
    cluster = c.cluster
    c.close()
    cluster.close()


@pytest.mark.timeout(120)
def test_cluster_computes_on_worker_processes(client, tmp_path):
    data = np.random.default_rng(0).integers(0, 60000, (32, 64, 64), dtype="uint16")
    for i, plane in enumerate(data):
        plane.tofile(tmp_path / f"z{i:03}.raw")
    vol = gpulazy.from_files(str(tmp_path / "z*.raw"), shape=(64, 64), dtype="uint16", chunks=(4, 64, 64),
                             device="cpu")
    before = gpulazy.stats().snapshot()["bytes_read"]
    got = vol.max(axis=0).compute()
    np.testing.assert_array_equal(got, data.max(axis=0))
    # The chunks were read by the workers, not by this process ...
    assert gpulazy.stats().snapshot()["bytes_read"] == before
    per_worker = client.run(lambda: gpulazy.stats().snapshot()["bytes_read"])
    assert len(per_worker) == 2 and sum(per_worker.values()) >= data.nbytes
    # ... and the graph the scheduler holds carries paths and byte ranges, not bytes.
    assert len(pickle.dumps(dict(vol.__dask_graph__()))) < data.nbytes / 4


@pytest.mark.timeout(120)
def test_cluster_installs_the_prefetch_plugin(client):
    summaries = gpulazy.prefetch.summaries(client)
    assert len(summaries) == 2


def test_cluster_gpus_true_without_a_gpu_says_why():
    if gpulazy.get_device().is_gpu:
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="no usable GPU"):
        gpulazy.cluster(gpus=True)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_cuda_cluster_one_worker_per_gpu(tmp_path):
    pytest.importorskip("dask_cuda")
    from gpulazy.device import gpu_count

    data = np.arange(8 * 256 * 256, dtype="float32").reshape(8, 256, 256)
    data.tofile(tmp_path / "v.raw")
    c = gpulazy.cluster()
    try:
        assert len(c.scheduler_info()["workers"]) == gpu_count()
        vol = gpulazy.from_files(str(tmp_path / "v.raw"), shape=data.shape, dtype="float32", chunks=(1, 256, 256),
                                 device="cuda:0")
        got = vol.sum(axis=0).compute()
        np.testing.assert_allclose(got.get(), data.sum(axis=0))
    finally:
        cluster = c.cluster
        c.close()
        cluster.close()
