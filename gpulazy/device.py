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
from typing import Any, ContextManager, Iterator, Sequence

import numpy as np

from gpulazy import config
from gpulazy.errors import DeviceError

__all__ = ["Device", "get_device", "gpu_count", "gpu_unavailable_reason", "no_gpu_reason", "gpulazy_stream",
           "own_stream", "consumer_stream", "after_consumer"]


@functools.cache
def _probe_gpus() -> tuple[int, str]:
    """``(count, reason)``: how many CUDA devices CuPy can use, and why none if so."""
    try:
        import cupy
    except ImportError as e:
        return 0, no_gpu_reason(cupy_missing=str(e))
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # CUDARuntimeError, missing driver library, ...
        driver, runtime = _cuda_versions(cupy)
        return 0, no_gpu_reason(error=f"{type(e).__name__}: {e}", driver=driver, runtime=runtime)
    if n == 0:
        return 0, no_gpu_reason(error="0 CUDA devices", driver=_cuda_versions(cupy)[0])
    return n, ""


def _cuda_versions(cupy: Any) -> tuple[int | None, int | None]:
    """``(driver, runtime)`` CUDA versions as ``1000 * major + 10 * minor``; the driver's is 0 without one."""
    out: list[int | None] = []
    for name in ("driverGetVersion", "runtimeGetVersion"):
        try:
            out.append(int(getattr(cupy.cuda.runtime, name)()))
        except Exception:  # libcuda cannot even be loaded
            out.append(None)
    return out[0], out[1]


def _cuda_text(version: int) -> str:
    return f"CUDA {version // 1000}.{version % 1000 // 10}"


_USE_CPU = "gpulazy uses the CPU (NumPy arrays) instead"


def no_gpu_reason(*, error: str = "", driver: int | None = None, runtime: int | None = None,
                  cupy_missing: str | None = None) -> str:
    """Why no GPU can be used, and what to do, from what the probe saw.

    Three cases are told apart: CuPy not installed; no NVIDIA driver or device (the
    driver's CUDA version is 0 or unknown, or the runtime says there is no device);
    a driver too old for the CUDA version CuPy was built for.

    >>> no_gpu_reason(error="cudaErrorInsufficientDriver", driver=12020, runtime=13000)[:60]
    'the NVIDIA driver is too old for this CUDA build (driver sup'
    """
    if cupy_missing is not None:
        return (f"CuPy is not installed ({cupy_missing}); {_USE_CPU}. On a machine with an NVIDIA GPU, "
                "install the GPU packages with: pip install 'gpulazy[gpu]'")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not driver or "NoDevice" in error or error == "0 CUDA devices":
        if driver and visible is not None and not visible.strip(" ,"):
            return (f"no CUDA device is visible: CUDA_VISIBLE_DEVICES is set to {visible!r}; "
                    f"unset it to use the GPU; {_USE_CPU}")
        seen = (f"no NVIDIA GPU found (the driver, for {_cuda_text(driver)}, reports no CUDA device)" if driver
                else "no NVIDIA driver or GPU found (CuPy finds no CUDA driver)")
        return (f"{seen}; {_USE_CPU}. To use a GPU, run on a machine with an NVIDIA GPU and its driver "
                "installed (nvidia-smi lists them)")
    if runtime and driver < runtime:
        return (f"the NVIDIA driver is too old for this CUDA build (driver supports {_cuda_text(driver)}, "
                f"CuPy was built for {_cuda_text(runtime)}); update the NVIDIA driver, or install the "
                f"CuPy and KvikIO wheels for CUDA {driver // 1000} (e.g. cupy-cuda{driver // 1000}x); {_USE_CPU}")
    return f"CuPy cannot use the GPU ({error}); {_USE_CPU}"


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
        """A 1-D uint8 buffer of ``nbytes`` on this device (uninitialised), for gpulazy to write into.

        See ``alloc``: the same stream rules.
        """
        return self.alloc((nbytes,), np.uint8)

    def alloc(self, shape: Any, dtype: Any, order: str = "C") -> Any:
        """An uninitialised array that gpulazy fills on its own stream and then hands out.

        On a GPU it is taken from the memory pool of the *consumer's* stream (the stream
        current outside ``own_stream``), so that when the consumer drops it, the memory is
        reused only by work ordered on that stream. The block may have been freed while
        the consumer's kernels still read it, so this thread's ``gpulazy_stream`` is made
        to wait for an event recorded on the consumer's stream now: gpulazy's writes start
        after that work. (A backend that copies on another stream waits for
        ``after_consumer`` itself.)
        """
        return self.alloc_many([(shape, dtype, order)])[0]

    def alloc_many(self, items: Sequence[tuple[Any, Any, str]]) -> list[Any]:
        """``[alloc(shape, dtype, order) for (shape, dtype, order) in items]`` with one event on the
        consumer's stream for all of them (each event costs tens of microseconds of Python)."""
        if not self.is_gpu:
            return [np.empty(shape, dtype=dtype, order=order) for shape, dtype, order in items]
        with self.activate():
            with consumer_stream(self):
                arrs = [self.xp.empty(shape, dtype=dtype, order=order) for shape, dtype, order in items]
            if arrs:
                gpulazy_stream(self).wait_event(after_consumer(self))
        return arrs

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

        Never the legacy default stream or the whole device (see docs/streams.md):
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
def own_stream(device: Device, wait: bool = True) -> Iterator[None]:
    """Run gpulazy's own device work on ``gpulazy_stream`` and wait for it (that stream only) on exit.

    On ``"cpu"`` a plain context. The work is complete when the block is left, so what
    it produced can be handed to any stream or thread. ``wait=False`` leaves the waiting to
    the caller (several blocks, one wait: ``gpulazy_stream(device).synchronize()``).
    """
    if not device.is_gpu:
        yield
        return
    import cupy

    with device.activate():
        s = gpulazy_stream(device)
        outer = _outer_streams()
        outer.append(cupy.cuda.get_current_stream())
        try:
            with s:
                yield
        finally:
            outer.pop()
        if wait:
            s.synchronize()


def _outer_streams() -> list:
    stack = getattr(_streams, "outer", None)
    if stack is None:
        stack = _streams.outer = []
    return stack


def consumer_stream(device: Device) -> Any:
    """The stream of whoever gpulazy works for in this thread: the current stream outside
    ``own_stream`` (a context manager; a plain context on ``"cpu"``)."""
    if not device.is_gpu:
        return nullcontext()
    import cupy

    outer = _outer_streams()
    return outer[0] if outer else cupy.cuda.get_current_stream()


def after_consumer(device: Device) -> Any:
    """A CUDA event recorded now on the consumer's stream (``consumer_stream``).

    A stream of gpulazy's that will write into memory just taken from the consumer's pool
    waits for it (``stream.wait_event``): the consumer's earlier kernels, which may still
    read that memory's previous contents, finish first. Costs a few microseconds and
    never blocks the host.
    """
    import cupy

    with device.activate():
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(consumer_stream(device))
    return event


def gpulazy_stream(device: Device) -> Any:
    """This thread's non-blocking CUDA stream on ``device``, for gpulazy's own device work.

    Copies out of the cache, byte swaps and staged host-to-device copies run on it, so
    they never wait for (or hold up) kernels on CuPy's legacy default stream; a CUDA
    stream created ``non_blocking`` does not synchronise with the legacy stream. Work on
    it is waited for (``stream.synchronize()``, this stream only) before a chunk is
    handed out, so a chunk is complete on every stream. The user's current stream is
    never changed.
    """
    return _thread_stream(device, "by_device")


def _thread_stream(device: Device, slot: str) -> Any:
    """This thread's non-blocking stream ``slot`` on ``device``, made on first use."""
    per_thread = getattr(_streams, slot, None)
    if per_thread is None:
        per_thread = {}
        setattr(_streams, slot, per_thread)
    s = per_thread.get(device.index)
    if s is None:
        import cupy

        with device.activate():
            s = per_thread[device.index] = cupy.cuda.Stream(non_blocking=True)
    return s


def staging_stream(device: Device) -> Any:
    """This thread's second non-blocking stream on ``device``: staged host-to-device copies.

    Apart from ``gpulazy_stream`` so that what waits for that stream (a copy out of the cache
    before it is handed out) does not wait behind the copies of chunks read ahead: on an H100
    a prefetched compute spent 0.28 ms a chunk there. A staged copy is handed out only once
    its own event has completed, so nothing orders other work after it on the stream.
    """
    return _thread_stream(device, "staging")


def map_stream(device: Device) -> Any:
    """This thread's third non-blocking stream on ``device``: a streamed map's function runs on it
    (``gpulazy.read.mapped``), beside the copies of the next reads.

    One for the thread, kept: CuPy's memory pool reuses a block only on the stream that freed it,
    so a stream made for each map would have allocated every temporary of its function anew
    (``cudaMalloc``, about 0.1 ms each on an H200) and left the blocks freed on it unusable.
    """
    return _thread_stream(device, "maps")


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
