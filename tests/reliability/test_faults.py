"""Faults with real files, under every scheduler: an error naming file, offset and bytes, or the right values.

Each fault surfaces at ``.compute()`` under the synchronous and threaded schedulers, an
in-process ``dask.distributed`` cluster and a real two-process one. Nothing partial,
zero-filled or stale is returned; a failed read never stays in a cache (the same array
computes once the fault is gone); after the file is fixed, indexing it again reads it.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import fault_backend
import gpulazy
from gpulazy.errors import ChunkReadError, LayoutError

NFILES, SHAPE = 3, (8, 64)
SCHEDULERS = ["sync", "threads", "dist-inprocess", "dist-2proc"]


def _values(i):
    return (np.arange(np.prod(SHAPE), dtype="<u2").reshape(SHAPE) + 1000 * i + 1)


@pytest.fixture
def files(tmp_path):
    paths = []
    for i in range(NFILES):
        p = str(tmp_path / f"s{i}.raw")
        _values(i).tofile(p)
        paths.append(p)
    return paths


def _reference():
    return np.stack([_values(i) for i in range(NFILES)])


def _vol(files, **kw):
    kw.setdefault("device", "cpu")
    return gpulazy.from_files(files, shape=SHAPE, dtype="<u2", chunks=(1, 4, 64), **kw)


@pytest.fixture(scope="module")
def clients():
    """One in-process cluster and one of two worker processes, shared by the module."""
    from distributed import Client, LocalCluster

    made = {}
    c1 = LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None)
    c2 = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    made["dist-inprocess"] = Client(c1, set_as_default=False)
    made["dist-2proc"] = Client(c2, set_as_default=False)
    yield made
    for client in made.values():
        client.close()
    c1.close()
    c2.close()


@pytest.fixture(params=SCHEDULERS)
def run(request, clients):
    """``run(collection)`` computes on the scheduler of this case; ``run.everywhere(fn, *a)`` runs
    ``fn`` here and on the workers. (The clusters are made before the leak check's snapshot.)"""
    name = request.param
    client = clients.get(name)

    class Run:
        scheduler = name

        def __call__(self, x):
            return x.compute(scheduler=client if client is not None else name)

        def everywhere(self, fn, *args):
            fn(*args)
            if client is not None and name == "dist-2proc":
                client.run(fn, *args)

        def cached(self, key):
            """Whether any cache this computation used holds ``key``."""
            found = [_holds(key)]
            if client is not None and name == "dist-2proc":
                found += list(client.run(_holds, key).values())
            return any(found)

    yield Run()
    Run().everywhere(fault_backend.uninstall)
    Run().everywhere(_clear_default_cache)


def _holds(key):
    from gpulazy.cache import default_cache

    cache = default_cache("cpu")
    return cache is not None and key in cache._entries


def _clear_default_cache(device="cpu"):
    from gpulazy.cache import default_cache

    cache = default_cache(device)
    if cache is not None:
        cache.clear()


def _check(err, path, *, offset=True):
    assert isinstance(err, ChunkReadError), repr(err)
    assert err.path == path and os.path.basename(path) in str(err)
    if offset:
        assert err.offset is not None and str(err.offset) in str(err)
        assert err.expected is not None and str(err.expected) in str(err)


def _fix(files):
    for i, p in enumerate(files):
        if os.path.exists(p) and not os.path.isfile(p):
            os.remove(p)
        _values(i).tofile(p)


# -- files changed between from_files and compute -----------------------------------------

def _truncate(p):
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 10)


def _delete(p):
    os.remove(p)


def _fifo(p):
    os.remove(p)
    os.mkfifo(p)  # opening it for reading would wait for a writer forever


def _grow(p):
    with open(p, "ab") as f:
        f.write(b"\1" * 512)


def _rename_other_over(p):
    other = p + ".tmp"
    np.zeros(SHAPE, "<u2").tofile(other)  # same size, all zeros
    os.replace(other, p)


CHANGES = {"truncated": _truncate, "deleted": _delete, "fifo": _fifo, "grown": _grow, "replaced": _rename_other_over}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", list(CHANGES))
def test_file_changed_after_from_files(files, run, change):
    vol = _vol(files)
    whole = vol if run.scheduler in ("sync", "threads") else vol + 0  # the fast path, or a dask graph
    CHANGES[change](files[1])
    t0 = time.monotonic()
    with pytest.raises(ChunkReadError) as info:
        run(whole)
    assert time.monotonic() - t0 < 60  # never hangs, a FIFO included
    _check(info.value, files[1])
    assert "changed since it was indexed" in str(info.value)
    # Chunks of the other files still compute, and equal the files.
    np.testing.assert_array_equal(run(vol[2]), _values(2))
    _fix(files)
    np.testing.assert_array_equal(run(_vol(files)), _reference())


# -- faults during the read: an injecting backend (test double) -----------------------------

@pytest.mark.timeout(120)
def test_io_error_mid_compute_names_the_file_and_never_stays_cached(files, run, tmp_path):
    token = tmp_path / "fault-token"  # one fault in all processes together
    token.touch()
    run.everywhere(fault_backend.install, {"fault": "eio", "match": "s1.raw", "token": str(token)})
    vol = _vol(files, backend="faulty")
    with pytest.raises(ChunkReadError) as info:
        run(vol.sum(axis=(1, 2)))
    _check(info.value, files[1])
    assert "Input/output error" in str(info.value)
    # The error names the chunk that failed: its file, offset and byte count; it is not cached.
    (failed,) = [s for s in vol.chunk_index.specs.values()
                 if s.ranges[0].path == files[1] and s.ranges[0].offset == info.value.offset]
    assert info.value.expected == failed.nbytes
    assert not run.cached(failed.key)
    # The fault is gone (the token is used up): the same array computes, every value the file's.
    np.testing.assert_array_equal(run(vol), _reference())


@pytest.mark.timeout(120)
def test_slow_read_mid_compute_gives_the_right_values(files, run, tmp_path):
    token = tmp_path / "fault-token"
    token.touch()
    run.everywhere(fault_backend.install, {"fault": "slow", "delay": 1.0, "match": "s1.raw", "token": str(token)})
    vol = _vol(files, backend="faulty")
    t0 = time.monotonic()
    np.testing.assert_array_equal(run(vol.max(axis=1)), _reference().max(axis=1))
    assert time.monotonic() - t0 >= 1.0  # it waited for the slow read, and did not time out


@pytest.mark.timeout(120)
def test_every_read_failing_raises_the_first_error(files, run):
    run.everywhere(fault_backend.install, {"fault": "eio"})
    with pytest.raises(ChunkReadError, match="Input/output error") as info:
        run(_vol(files, backend="faulty").mean())
    assert info.value.path in files and info.value.offset is not None


# -- not a file at all, given to from_files ------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", ["directory", "fifo", "/dev/zero"])
def test_not_a_regular_file_is_refused_at_once(tmp_path, what):
    if what == "directory":
        path = str(tmp_path / "d")
        os.mkdir(path)
    elif what == "fifo":
        path = str(tmp_path / "f.raw")
        os.mkfifo(path)
    else:
        path = what
    t0 = time.monotonic()
    for call in (lambda: gpulazy.from_files([path], dtype="u1", device="cpu"),
                 lambda: gpulazy.read_file(path, device="cpu")):
        with pytest.raises((LayoutError, ChunkReadError)) as info:
            call()
        assert path in str(info.value)
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(30)
def test_posix_backend_refuses_a_fifo_without_blocking(tmp_path):
    from gpulazy.io import get_backend
    from gpulazy.spec import ByteRange

    path = str(tmp_path / "pipe")
    os.mkfifo(path)
    future = get_backend("posix", "cpu").submit([ByteRange(path, 0, 16)], np.empty(16, np.uint8))
    with pytest.raises(ChunkReadError, match="not a regular file") as info:
        future.result(timeout=10)
    assert info.value.path == path


# -- the same on a GPU (KvikIO reads straight into device memory) ---------------------------------

@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", ["truncated", "fifo", "replaced"])
def test_file_changed_after_from_files_on_the_gpu(files, change):
    vol = _vol(files, device="cuda:0")
    CHANGES[change](files[1])
    for compute in (lambda: vol.compute(), lambda: vol.sum().compute(scheduler="threads")):
        with pytest.raises(ChunkReadError, match="changed since it was indexed") as info:
            compute()
        _check(info.value, files[1])
    _fix(files)
    from conftest import to_host

    np.testing.assert_array_equal(to_host(_vol(files, device="cuda:0").compute()), _reference())


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_kvikio_refuses_a_fifo_without_blocking(tmp_path):
    import cupy

    from gpulazy.io import get_backend
    from gpulazy.spec import ByteRange

    path = str(tmp_path / "pipe")
    os.mkfifo(path)
    with pytest.raises(ChunkReadError, match="not a regular file"):
        get_backend("kvikio", "cuda:0").read_into([ByteRange(path, 0, 16)], cupy.empty(16, cupy.uint8))


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_io_error_on_the_gpu_never_stays_cached(files):
    fault_backend.install({"fault": "eio", "match": "s1.raw", "times": 1})
    try:
        vol = _vol(files, device="cuda:0", backend="faulty")
        with pytest.raises(ChunkReadError, match="Input/output error") as info:
            vol.max().compute(scheduler="threads")
        _check(info.value, files[1])
        from conftest import to_host

        np.testing.assert_array_equal(to_host(vol.compute(scheduler="threads")), _reference())
    finally:
        fault_backend.uninstall()
        _clear_default_cache("cuda:0")
