"""Shared fixtures. GPU tests are marked ``gpu`` and skip, visibly, without a usable GPU."""

from __future__ import annotations

import numpy as np
import pytest

import gpulazy
from gpulazy.device import gpu_count, gpu_unavailable_reason

HAS_GPU = gpu_count() > 0


def pytest_sessionstart(session):
    """On a GPU host, compile CuPy's common reduction kernels before any test's timeout runs.

    A fresh machine has no CuPy kernel cache: the first ``sum`` of a dtype compiles CUB's
    reduction with NVRTC, which took over 40 s on an H100 host (a test timed out inside it).
    That is the machine warming up, not the code under test.
    """
    if not HAS_GPU:
        return
    import cupy

    for dt in ("int32", "int64", "uint16", "uint8", "float32", "float64"):
        a = cupy.arange(1024, dtype=dt)
        a.sum(), a.max(), a.min(), a.astype("float64").mean()
        b = a.reshape(4, 16, 16)  # dask's blockwise reductions: keepdims over all or some axes
        b.sum(axis=(0, 1, 2), keepdims=True), b.max(axis=0), b.sum(axis=(1, 2))
    cupy.cuda.Device(0).synchronize()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {gpu_unavailable_reason()}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu, id="cuda")]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Each device name: "cpu" always, "cuda:0" as a gpu-marked case."""
    return request.param


def zstd_zarr(path, data: np.ndarray, chunks: tuple) -> str:
    """``data`` as a Zarr v3 store at ``path`` with ``chunks``, zstd level 1 (skips without zarr)."""
    zarr = pytest.importorskip("zarr")
    from zarr.codecs import ZstdCodec

    p = str(path)
    z = zarr.create_array(p, shape=data.shape, chunks=chunks, dtype=data.dtype, compressors=ZstdCodec(level=1))
    z[...] = data
    return p


def to_host(x) -> np.ndarray:
    """A NumPy copy of a NumPy or CuPy array."""
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


@pytest.fixture(autouse=True)
def _fresh_config():
    """Each test starts from the default config."""
    gpulazy.config.reset()
    yield
    gpulazy.config.reset()


def gated_preadv(monkeypatch, gate, blocked: str, timeout: float = 30.0):
    """Every read of the file ``blocked`` waits for ``gate`` (a ``threading.Event``); the event
    returned is set by the first. Its ``timed_out`` lists each read that went on only because
    ``timeout`` passed (what a test that must open the gate first asserts empty)."""
    import os
    import threading

    from gpulazy.io import _posix

    entered = threading.Event()
    entered.timed_out = []
    real = _posix._preadv

    def preadv(fd, buffers, offset):
        if os.readlink(f"/proc/self/fd/{fd}") == blocked:
            entered.set()
            if not gate.wait(timeout):
                entered.timed_out.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(_posix, "_preadv", preadv)
    return entered
