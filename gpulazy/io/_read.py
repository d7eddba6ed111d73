"""From a ``ChunkSpec`` to an array: allocate, read through a backend, decode.

Decoding here is format-free: view the bytes as the file's dtype, swap to native byte
order on the device, and reshape in the spec's element order. Chunks made of encoded
or partial stored pieces (``spec.is_assembled``) are decoded by ``gpulazy.codecs``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpulazy.device import Device
from gpulazy.io._base import Backend, ReadFuture
from gpulazy.spec import ChunkSpec

__all__ = ["read_chunk", "submit_chunk", "decode"]


def submit_chunk(spec: ChunkSpec, backend: Backend, out: Any = None) -> tuple[ReadFuture, Any]:
    """Start reading ``spec`` into ``out`` (allocated on the backend's device if ``None``)."""
    if spec.is_assembled:  # stored pieces: read into a buffer of their own, decoded by ``decode``
        out = None
    buf = out if out is not None else backend.device.empty(spec.nbytes)
    return backend.submit(spec.ranges, buf), buf


def read_chunk(spec: ChunkSpec, backend: Backend, out: Any = None) -> Any:
    """Read and decode one chunk; returns a NumPy or CuPy array of ``spec.shape``."""
    future, buf = submit_chunk(spec, backend, out)
    future.result()
    return decode(buf, spec, backend.device)


def decode(buf: Any, spec: ChunkSpec, device: Device) -> Any:
    """The chunk's array from its raw bytes ``buf`` (1-D uint8), in native byte order."""
    if spec.is_assembled:
        from gpulazy.codecs import assemble

        return assemble(buf, spec, device)
    raw = buf[: spec.out_nbytes]
    dt = np.dtype(spec.dtype)
    if spec.needs_byteswap:
        raw = _byteswap(raw, dt, device)
    arr = raw.view(spec.out_dtype)
    if spec.order == "F":
        return arr.reshape(spec.shape[::-1]).transpose()
    return arr.reshape(spec.shape)


def _byteswap(raw: Any, dt: np.dtype, device: Device) -> Any:
    # In place: reverse the bytes of every element. Works for NumPy and CuPy alike
    # (CuPy has no ndarray.byteswap); complex types swap each half on its own.
    unit = dt.itemsize // 2 if dt.kind == "c" else dt.itemsize
    with device.activate():
        lanes = raw.reshape(-1, unit)
        lanes[...] = lanes[:, ::-1].copy()
    return raw
