"""From a ``ChunkSpec`` to an array: allocate, read through a backend, decode.

Decoding here is format-free: view the bytes as the file's dtype, swap to native byte
order on the device, and reshape in the spec's element order. Chunks made of encoded
or partial stored pieces (``spec.is_assembled``) are decoded by ``gpulazy.codecs``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpulazy.codecs import byteswap
from gpulazy.device import Device
from gpulazy.io._base import Backend, ReadFuture
from gpulazy.spec import ChunkSpec

__all__ = ["read_chunk", "read_chunks", "start_chunks", "finish_chunks", "PendingChunk", "submit_chunk", "decode"]


def submit_chunk(spec: ChunkSpec, backend: Backend, out: Any = None, verify: bool = False
                 ) -> tuple[ReadFuture, Any]:
    """Start reading ``spec`` into ``out`` (allocated on the backend's device if ``None``).

    ``verify``: the future's ``result()`` also checks the bytes against their checksums
    (``gpulazy.checksums.VerifiedRead``) before anything decodes them.
    """
    if spec.is_assembled:  # stored pieces: read into a buffer of their own, decoded by ``decode``
        out = None
    buf = out if out is not None else backend.device.empty(spec.nbytes)
    return _checked(backend.submit(spec.ranges, buf), buf, spec, verify), buf


def _checked(future: ReadFuture, buf: Any, spec: ChunkSpec, verify: bool) -> Any:
    # Every read path submits through here: the one place a verified read's bytes are
    # checked, after they land (the future's result) and before any decode.
    if not verify:
        return future
    from gpulazy.checksums import VerifiedRead

    return VerifiedRead(future, buf, spec)


def read_chunk(spec: ChunkSpec, backend: Backend, out: Any = None, *, staged: bool | None = None) -> Any:
    """Read and decode one chunk; returns a NumPy or CuPy array of ``spec.shape``.

    ``staged``: see ``Backend.submit_many`` (``None``: a plain ``submit``).
    """
    if staged is None:
        future, buf = submit_chunk(spec, backend, out)
        future.result()
        return decode(buf, spec, backend.device)
    return read_chunks([spec], backend, staged=staged)[0]


def read_chunks(specs: list[ChunkSpec], backend: Backend, *, staged: bool | None = None) -> list[Any]:
    """Read and decode several chunks, all submitted in one batch before any is waited on.

    Every read settles before an error is raised, so nothing writes into a dropped buffer.
    """
    return finish_chunks(start_chunks(specs, backend, staged=staged))


def finish_chunks(pending: list[PendingChunk]) -> list[Any]:
    """The arrays of ``pending``, in order; every read settles before the first error is raised,
    so nothing writes into a dropped buffer."""
    errors: list[BaseException] = []
    for p in pending:
        try:
            p.future.result()
        except BaseException as e:
            errors.append(e)
    if errors:
        raise errors[0]
    return [p.result() for p in pending]


class PendingChunk:
    """A chunk whose read is in flight: ``done()`` never blocks, ``result()`` waits and decodes.

    Either may be called from any thread; the first ``result()`` finishes the read there
    (for KvikIO: waits for its ranges and, when staged, its copy to the device).
    """

    __slots__ = ("spec", "future", "buf", "device")

    def __init__(self, spec: ChunkSpec, future: ReadFuture, buf: Any, device: Device):
        self.spec, self.future, self.buf, self.device = spec, future, buf, device

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> Any:
        self.future.result()
        return decode(self.buf, self.spec, self.device)


def start_chunks(specs: list[ChunkSpec], backend: Backend, *, staged: bool | None = None,
                 verify: bool = False) -> list[PendingChunk]:
    """Start reading ``specs`` in one submission from this thread; returns at once.

    ``verify``: as in ``submit_chunk``."""
    dev = backend.device
    bufs = [dev.empty(s.nbytes) for s in specs]
    futures = backend.submit_many([(s.ranges, b) for s, b in zip(specs, bufs)], staged=staged)
    return [PendingChunk(s, _checked(f, b, s, verify), b, dev) for s, f, b in zip(specs, futures, bufs)]


def decode(buf: Any, spec: ChunkSpec, device: Device) -> Any:
    """The chunk's array from its raw bytes ``buf`` (1-D uint8), in native byte order."""
    if spec.is_assembled:
        from gpulazy.codecs import assemble

        return assemble(buf, spec, device)
    raw = buf[: spec.out_nbytes]
    dt = np.dtype(spec.dtype)
    if spec.needs_byteswap:
        raw = byteswap(raw, dt, device)
    arr = raw.view(spec.out_dtype)
    if spec.order == "F":
        return arr.reshape(spec.shape[::-1]).transpose()
    return arr.reshape(spec.shape)
