"""Which device chunks land on: ``"cuda:N"`` (CuPy arrays) or ``"cpu"`` (NumPy arrays).

CuPy is imported only when a CUDA device is asked for or probed, never by
``import gpulazy``. ``device=None`` means ``config.get("device")``, and when that is
unset ``"cuda:0"`` if a usable GPU and CuPy are present, otherwise ``"cpu"``.
"""

from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator

import numpy as np

from gpulazy import config
from gpulazy.errors import DeviceError

__all__ = ["Device", "get_device", "gpu_count", "gpu_unavailable_reason", "gpulazy_stream", "own_stream"]


@functools.cache
def _probe_gpus() -> tuple[int, str]:
    """``(count, reason)``: how many CUDA devices CuPy can use, and why none if so."""
    try:
        import cupy
    except ImportError as e:
        return 0, f"CuPy is not installed ({e}); install it with: pip install 'gpulazy[gpu]'"
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # CUDARuntimeError, missing driver library, ...
        return 0, f"CuPy found no usable CUDA device: {type(e).__name__}: {e}"
    if n == 0:
        return 0, "CuPy reports 0 CUDA devices"
    return n, ""


def gpu_count() -> int:
    """Number of CUDA devices CuPy can use (0 without CuPy or a driver)."""
    return _probe_gpus()[0]


def gpu_unavailable_reason() -> str:
    """Why no GPU is used, or ``""`` when one is."""
    return _probe_gpus()[1]


@dataclass(frozen=True, slots=True)
class Device:
    """A place chunks land: ``Device("cpu")`` or ``Device("cuda", 0)``."""

    kind: str
    index: int = 0

    @property
    def name(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    @property
    def xp(self) -> Any:
        """The array module: ``numpy`` or ``cupy``."""
        if self.is_gpu:
            import cupy

            return cupy
        return np

    def __str__(self) -> str:
        return self.name

    def activate(self) -> ContextManager:
        """A context in which allocations and kernels use this device."""
        if self.is_gpu:
            import cupy

            return cupy.cuda.Device(self.index)
        return nullcontext()

    def empty(self, nbytes: int) -> Any:
        """A 1-D uint8 buffer of ``nbytes`` on this device (uninitialised)."""
        with self.activate():
            return self.xp.empty(nbytes, dtype=np.uint8)

    def meta(self, ndim: int, dtype: Any) -> Any:
        """An empty array of this device's type, for dask's ``meta``."""
        with self.activate():
            return self.xp.empty((0,) * ndim, dtype=dtype)

    def memory(self) -> tuple[int, int]:
        """``(free, total)`` bytes of this device (host RAM for ``"cpu"``)."""
        if self.is_gpu:
            import cupy

            with self.activate():
                free, total = cupy.cuda.runtime.memGetInfo()
            return int(free), int(total)
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def synchronize(self) -> None:
        """Wait for gpulazy's work queued by this thread (and the current stream, if one was set).

        Never the legacy default stream or the whole device (see README, "Streams"):
        other threads' kernels go on meanwhile. The current stream is waited for only when
        it is a stream of its own (not CuPy's default, the legacy stream).
        """
        if self.is_gpu:
            import cupy

            with self.activate():
                gpulazy_stream(self).synchronize()
                current = cupy.cuda.get_current_stream()
                if current.ptr != 0:  # 0: the legacy default stream, which every blocking stream joins
                    current.synchronize()

    def wait_all(self) -> None:
        """Wait for everything queued on the device, by any thread on any stream.

        For timing (benchmarks, ``gpulazy demo``): gpulazy's read path never calls it.
        """
        if self.is_gpu:
            import cupy

            cupy.cuda.Device(self.index).synchronize()


_streams = threading.local()


@contextmanager
def own_stream(device: Device) -> Iterator[None]:
    """Run gpulazy's own device work on ``gpulazy_stream`` and wait for it (that stream only) on exit.

    On ``"cpu"`` a plain context. The work is complete when the block is left, so what
    it produced can be handed to any stream or thread.
    """
    if not device.is_gpu:
        yield
        return
    with device.activate():
        s = gpulazy_stream(device)
        with s:
            yield
        s.synchronize()


def gpulazy_stream(device: Device) -> Any:
    """This thread's non-blocking CUDA stream on ``device``, for gpulazy's own device work.

    Copies out of the cache, byte swaps and staged host-to-device copies run on it, so
    they never wait for (or hold up) kernels on CuPy's legacy default stream; a CUDA
    stream created ``non_blocking`` does not synchronise with the legacy stream. Work on
    it is waited for (``stream.synchronize()``, this stream only) before a chunk is
    handed out, so a chunk is complete on every stream. The user's current stream is
    never changed.
    """
    per_thread = getattr(_streams, "by_device", None)
    if per_thread is None:
        per_thread = _streams.by_device = {}
    s = per_thread.get(device.index)
    if s is None:
        import cupy

        with device.activate():
            s = per_thread[device.index] = cupy.cuda.Stream(non_blocking=True)
    return s


_VALID = "'cpu', 'cuda', 'cuda:N' (N a device index), 'gpu' or None"


def get_device(device: str | Device | None = None) -> Device:
    """The ``Device`` for a name; ``None`` follows the config, then picks a GPU if usable."""
    if isinstance(device, Device):
        return device
    if device is None:
        device = config.get("device")
    if device is None:
        return Device("cuda", 0) if gpu_count() > 0 else Device("cpu")
    if not isinstance(device, str):
        raise DeviceError(f"unknown device {device!r}; valid: {_VALID}")
    name = device.strip().lower()
    if name == "cpu":
        return Device("cpu")
    if name in ("cuda", "gpu"):
        name = "cuda:0"
    if name.startswith("cuda:") and name[5:].isdigit():
        index = int(name[5:])
        count = gpu_count()
        if index >= count:
            why = gpu_unavailable_reason() or f"only {count} CUDA device(s) are present"
            raise DeviceError(f"device {device!r} is not usable: {why}. Use device='cpu' to read into host memory.")
        return Device("cuda", index)
    raise DeviceError(f"unknown device {device!r}; valid: {_VALID}")
