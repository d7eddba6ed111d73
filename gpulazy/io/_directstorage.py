"""The ``directstorage`` backend: Windows DirectStorage through the ``dstorage_gpu`` package.

``dstorage_gpu`` (PyPI ``dstorage-gpu`` 1.0.0, Windows wheels only) moves file bytes
NVMe → DirectStorage → a D3D12 buffer → a CUDA torch tensor. We could not install it
or read its source here (Linux, no Windows wheel); its published README and the code
of projects that use it show this surface, which is all the adapter relies on::

    loader = dstorage_gpu.DirectStorageLoader()
    t = loader.load_tensor(path)                          # a whole file -> one tensor
    ts = loader.load_tensors([(path, n_elements), ...])   # a batch: one DirectStorage fence

Tensors are float32 (callers pass ``file_size // 4`` elements) and read from the start
of the file into new tensors: there is no file offset and no caller buffer. So each
``submit`` becomes **one** ``load_tensors`` batch (one fence for all its files) that
reads, per distinct file, the prefix up to the furthest byte asked of it (whole 4-byte
elements, never past the end of the file; a 1-3 byte tail past the last whole element
is read with ``os.pread``), and the asked-for ranges are then copied from those tensors
into ``out``. That is exact for whole-file chunks (one slice per file, the common
Windows case) and wasteful for ranges deep inside big files: use ``posix`` for those.

A tensor shorter than asked (the file shrank between ``stat`` and the read) is a short
read: ``ChunkReadError`` naming the file, offset and byte counts. Any error the package
raises is wrapped in ``ChunkReadError`` naming the files of the batch.

The tests run this adapter against a stand-in module (``tests/standin_dstorage_gpu.py``)
that implements the surface above with NumPy on any platform.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from gpulazy.device import Device
from gpulazy.errors import ChunkReadError
from gpulazy.io._base import Backend, ReadFuture, open_error, short_read_error
from gpulazy.spec import ByteRange

__all__ = ["DirectStorageBackend"]

_ELEMENT = 4  # bytes per element of the float32 tensors dstorage_gpu returns
_NEEDS = ("DirectStorage needs Windows and the 'dstorage_gpu' package "
          "(pip install dstorage-gpu, Windows 10/11 with a DirectX 12 GPU)")


def _platform() -> str:
    """``sys.platform``; a function so tests can stand in for Windows."""
    return sys.platform


def _import_package() -> Any:
    return importlib.import_module("dstorage_gpu")


class DirectStorageBackend(Backend):
    """Batched reads through DirectStorage: one ``load_tensors`` call and one fence per ``submit``.

    Chosen only by name (``backend="directstorage"``); ``"auto"`` never picks it.
    """

    name = "directstorage"
    device_direct = True
    devices = frozenset({"cpu", "cuda"})

    def __init__(self, device: Device, **kwargs: Any):
        super().__init__(device, **kwargs)
        self._package = _import_package()
        self._loader = self._package.DirectStorageLoader()
        # One DirectStorage queue: batches go one after another, each behind its fence.
        self._queue = ThreadPoolExecutor(1, thread_name_prefix=f"gpulazy-dstorage-{device.name}")

    @classmethod
    def availability(cls, device: Device) -> tuple[bool, str]:
        platform = _platform()
        if platform != "win32":
            return False, f"{_NEEDS}; this is {platform!r}"
        try:
            package = _import_package()
        except ImportError as e:
            return False, f"{_NEEDS}; the package is not importable: {e}"
        return _probe(device, package)

    @property
    def mode(self) -> str:
        return "directstorage"

    def submit(self, ranges: Sequence[ByteRange], out: Any) -> ReadFuture:
        self._check_open()
        nbytes = self._check_out(ranges, out)
        future = self._queue.submit(self._read_batch, list(ranges), out, nbytes)
        return ReadFuture([future], lambda values: values[0])

    def close(self) -> None:
        super().close()
        self._queue.shutdown(wait=True)

    # -- internals ------------------------------------------------------------------------
    def _read_batch(self, ranges: list[ByteRange], out: Any, nbytes: int) -> int:
        started = time.perf_counter()
        try:
            _read_ranges(self._loader, ranges, out, self.device)
        except BaseException:
            self._record_error()
            raise
        self._record(nbytes, started)
        return nbytes


class _FilePlan:
    """What to ask of one file: ``elements`` float32 elements, plus a ``tail`` read by hand."""

    __slots__ = ("path", "size", "end", "elements", "tail_start")

    def __init__(self, path: str, size: int, need_end: int):
        self.path, self.size = path, size
        self.end = min(need_end, size)  # never ask past the end of the file
        elements = -(-self.end // _ELEMENT)
        if elements * _ELEMENT > size:  # the last element would run past EOF: read it by hand
            elements = size // _ELEMENT
        self.elements = elements
        self.tail_start = elements * _ELEMENT


def _plan(ranges: Sequence[ByteRange]) -> dict[str, _FilePlan]:
    need: dict[str, int] = {}
    for r in ranges:
        # A zero-length range asks for no bytes (its file must still exist).
        need[r.path] = max(need.get(r.path, 0), r.offset + r.nbytes if r.nbytes else 0)
    plans = {}
    for path, end in need.items():
        try:
            st = os.stat(path)
        except OSError as e:
            raise open_error(path, e, backend="directstorage") from e
        if os.path.isdir(path):
            raise open_error(path, IsADirectoryError(path), backend="directstorage")
        plans[path] = _FilePlan(path, st.st_size, end)
    return plans


def _read_ranges(loader: Any, ranges: Sequence[ByteRange], out: Any, device: Device) -> None:
    plans = _plan(ranges)
    batch = [p for p in plans.values() if p.elements > 0]
    tensors = _load_batch(loader, batch)
    got: dict[str, Any] = {p.path: _as_bytes(t, device) for p, t in zip(batch, tensors)}
    tails = {p.path: _read_tail(p) for p in plans.values() if p.tail_start < p.end}
    dst = 0
    for r in ranges:
        plan = plans[r.path]
        data = got.get(r.path)
        head = 0 if data is None else int(data.shape[0])
        tail = tails.get(r.path, b"")
        # Bytes we really have of this file: a short tensor ends them early.
        have = head if head < plan.tail_start else plan.tail_start + len(tail)
        if r.nbytes and r.offset + r.nbytes > have:
            raise short_read_error(r, max(0, have - r.offset), backend="directstorage", at=max(r.offset, have))
        if r.nbytes:
            _copy_range(out, dst, r, data, plan.tail_start, tail, device)
        dst += r.nbytes


def _load_batch(loader: Any, batch: list[_FilePlan]) -> list[Any]:
    if not batch:
        return []
    specs = [(p.path, p.elements) for p in batch]
    try:
        tensors = list(loader.load_tensors(specs))  # one submission, one fence, waits for it
    except Exception as e:
        paths = ", ".join(repr(p.path) for p in batch)
        raise ChunkReadError(f"DirectStorage batch read of {paths} failed: {type(e).__name__}: {e}",
                             path=batch[0].path) from e
    if len(tensors) != len(batch):
        raise ChunkReadError(f"DirectStorage returned {len(tensors)} tensors for a batch of {len(batch)} files",
                             path=batch[0].path)
    return tensors


def _read_tail(plan: _FilePlan) -> bytes:
    with open(plan.path, "rb") as fh:
        return os.pread(fh.fileno(), plan.end - plan.tail_start, plan.tail_start)


def _as_bytes(tensor: Any, device: Device) -> Any:
    """A 1-D uint8 view of a returned tensor, on ``device`` (CuPy) or the host (NumPy)."""
    if device.is_gpu and not isinstance(tensor, np.ndarray):
        import cupy

        return cupy.from_dlpack(tensor).reshape(-1).view(cupy.uint8)  # zero-copy from torch
    if isinstance(tensor, np.ndarray):
        host = tensor
    elif hasattr(tensor, "cpu"):  # a torch tensor on the GPU, read into host memory
        host = tensor.cpu().numpy()
    else:
        host = np.asarray(tensor)
    host = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
    if device.is_gpu:
        import cupy

        with device.activate():
            return cupy.asarray(host)
    return host


def _copy_range(out: Any, dst: int, r: ByteRange, data: Any, tail_start: int, tail: bytes, device: Device) -> None:
    start, end = r.offset, r.offset + r.nbytes
    mid = min(end, tail_start)
    with device.activate():
        if start < mid:
            out[dst: dst + mid - start] = data[start:mid]
        if end > max(start, tail_start):
            lo = max(start, tail_start)
            piece = np.frombuffer(tail, np.uint8)[lo - tail_start: end - tail_start]
            out[dst + lo - start: dst + r.nbytes] = device.xp.asarray(piece)


@functools.cache
def _probe(device: Device, package: Any) -> tuple[bool, str]:
    """One real batch read through the package into ``device``; cached per device and module."""
    data = np.random.default_rng(7).integers(0, 256, 65536 + 3, dtype=np.uint8)
    fd, path = tempfile.mkstemp(prefix="gpulazy-dstorage-probe-", suffix=".bin")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.tobytes())
        out = device.empty(data.size)
        _read_ranges(package.DirectStorageLoader(), [ByteRange(path, 0, data.size)], out, device)
        host = out.get() if hasattr(out, "get") and not isinstance(out, np.ndarray) else out
        if not (host == data).all():
            return False, f"{_NEEDS}; the probe read through 'dstorage_gpu' returned wrong bytes"
    except Exception as e:
        return False, f"{_NEEDS}; the probe read through 'dstorage_gpu' failed: {type(e).__name__}: {e}"
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    version = getattr(package, "__version__", "?")
    return True, f"DirectStorage via dstorage_gpu {version}: probe batch read into {device.name} matched"
