"""The backend contract: move byte ranges of files into a caller-allocated buffer.

A backend never knows file formats. ``submit(ranges, out)`` starts reading the ranges,
concatenated in order, into ``out`` (a 1-D ``uint8`` buffer on the backend's device,
NumPy or CuPy, at least ``sum(r.nbytes)`` long) and returns a ``ReadFuture``. Every byte
is read or the future raises ``ChunkReadError`` naming the file, offset and byte counts;
a short read is an error, never zeros.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Callable, ClassVar, Mapping, Sequence

from gpulazy import config
from gpulazy.device import Device
from gpulazy.errors import BackendUnavailableError, ChunkReadError
from gpulazy.spec import ByteRange, FileIdentity
from gpulazy.stats import Stats, default_stats

__all__ = ["Backend", "ReadFuture", "short_read_error", "open_error", "read_error", "total_bytes"]


def total_bytes(ranges: Sequence[ByteRange]) -> int:
    return sum(r.nbytes for r in ranges)


def short_read_error(r: ByteRange, got: int, *, backend: str, at: int | None = None) -> ChunkReadError:
    """The error for a read of ``r`` that returned ``got`` bytes instead of ``r.nbytes``.

    ``at`` is where the file ended (default: ``r.offset + got``). The message names the
    range asked for and where the file ended, once each:

    >>> from gpulazy.spec import ByteRange
    >>> print(short_read_error(ByteRange("f.raw", 96, 96), 4, backend="posix", at=100))
    short read of 'f.raw': asked for bytes 96 to 192 (96 bytes) but the file ends at byte 100, so 4 were read (posix backend); the file may have been truncated or replaced after it was opened
    """
    end = r.offset + got if at is None else at
    return ChunkReadError(
        f"short read of {r.path!r}: asked for bytes {r.offset} to {r.offset + r.nbytes} ({r.nbytes} bytes) "
        f"but the file ends at byte {end}, so {got} were read ({backend} backend); the file may have "
        "been truncated or replaced after it was opened",
        path=r.path, offset=end, expected=r.nbytes, got=got,
    )


def open_error(path: str, exc: BaseException, *, backend: str) -> ChunkReadError:
    """The error for a file that cannot be opened for reading (missing, a directory, no permission)."""
    if isinstance(exc, FileNotFoundError) or not os.path.lexists(path):
        why = "no such file; check the path (and that the file was not moved or deleted)"
    elif isinstance(exc, IsADirectoryError) or os.path.isdir(path):
        why = "it is a directory, not a file; pass the files inside it (e.g. a glob)"
    elif isinstance(exc, PermissionError):
        why = "permission denied; check the file's permissions"
    else:
        why = f"{type(exc).__name__}: {exc}"
    err = ChunkReadError(f"cannot open {path!r} for reading ({backend} backend): {why}", path=path)
    err.errno = getattr(exc, "errno", None)
    return err


def read_error(r: ByteRange, at: int, nbytes: int, exc: OSError, *, backend: str) -> ChunkReadError:
    """The error for a read call of ``nbytes`` bytes of ``r.path`` at offset ``at`` that raised ``exc``."""
    err = ChunkReadError(
        f"reading {nbytes} bytes of {r.path!r} at offset {at} failed ({backend} backend): "
        f"{type(exc).__name__}: {exc}", path=r.path, offset=at, expected=nbytes)
    err.errno = exc.errno
    return err


class ReadFuture:
    """The pending result of ``Backend.submit``: ``result()`` is the number of bytes read.

    Wraps the backend's own futures; ``finish`` turns their results into the byte count
    (checking for short reads) and runs once, in the thread that first asks for it.
    """

    def __init__(self, parts: Sequence[Any], finish: Callable[[list[Any]], int]):
        self._parts = list(parts)
        self._finish = finish
        self._result: int | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._result is not None or self._error is not None or all(_part_done(p) for p in self._parts)

    def result(self, timeout: float | None = None) -> int:
        if self._result is None and self._error is None:
            try:
                values = [_part_result(p, timeout) for p in self._parts]
                self._result = self._finish(values)
            except BaseException as e:  # kept, so a second result() raises the same error
                self._error = e
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    @classmethod
    def completed(cls, nbytes: int) -> ReadFuture:
        return cls([], lambda _: nbytes)

    @classmethod
    def failed(cls, error: BaseException) -> ReadFuture:
        """A future whose ``result()`` raises ``error``."""
        part: Future = Future()
        part.set_exception(error)
        return cls([part], lambda values: 0)


def _part_done(p: Any) -> bool:
    return p.done() if hasattr(p, "done") else True


def _part_result(p: Any, timeout: float | None) -> Any:
    if isinstance(p, Future):
        return p.result(timeout)
    if hasattr(p, "get"):  # kvikio.IOFuture
        return p.get()
    if hasattr(p, "result"):
        return p.result()
    return p


class Backend(ABC):
    """An I/O backend bound to one device.

    Subclasses set ``name``, ``device_direct`` (bytes land in device memory without a
    host copy of ours), ``devices`` (``{"cpu", "cuda"}`` subset), ``shared_queue`` and implement
    ``availability`` and ``submit``.
    """

    name: ClassVar[str]
    device_direct: ClassVar[bool] = False
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    #: True when every instance feeds one process-wide queue (KvikIO's thread pool): a second
    #: instance would not let a read overtake those already queued (see ``get_backend``'s lanes).
    shared_queue: ClassVar[bool] = False

    def __init__(self, device: Device, *, threads: int | None = None, task_size: int | None = None,
                 stats: Stats | None = None):
        self.device = device
        self.threads = int(threads or config.get("threads"))
        self.task_size = int(task_size or config.get("task_size"))
        self.stats = stats if stats is not None else default_stats()
        self.selected_because = "asked for by name"
        self._closed = False

    # -- capability -------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def availability(cls, device: Device) -> tuple[bool, str]:
        """``(usable, reason)`` for this device; probes for real and caches the answer."""

    @property
    def mode(self) -> str:
        """How reads are served right now (``"gds"``, ``"compat"``, ``"posix"``, ...)."""
        return self.name

    # -- reading ----------------------------------------------------------------------
    @abstractmethod
    def submit(self, ranges: Sequence[ByteRange], out: Any) -> ReadFuture:
        """Start reading ``ranges`` concatenated into ``out``; return a ``ReadFuture``."""

    def submit_many(self, jobs: Sequence[tuple[Sequence[ByteRange], Any]], *, staged: bool | None = None,
                    known: Mapping[str, FileIdentity] | None = None) -> list[ReadFuture]:
        """Start several reads at once: ``[(ranges, out), ...]`` -> one ``ReadFuture`` each.

        Backends that can submit a batch in one go (KvikIO: one waiting thread, open
        files kept, contiguous ranges merged) override this; the default submits each.
        ``staged`` asks for reads through pinned host buffers and the backend's own
        non-blocking streams where the backend has both (``None``: config ``staging``).
        ``known``: the identities the caller indexed the files with, where it stats the files
        after the reads (the read engine does); a backend that keeps files open may then read
        through a handle opened on that very file without a stat first
        (``HandleCache.reuse``). Backends without kept handles ignore it.
        """
        return [self.submit(ranges, out) for ranges, out in jobs]

    def read_into(self, ranges: Sequence[ByteRange], out: Any) -> int:
        """Read ``ranges`` concatenated into ``out`` and wait; returns bytes read."""
        return self.submit(ranges, out).result()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release threads and buffers.

        Reads already submitted finish first. Afterwards ``submit`` and ``read_into``
        raise ``BackendUnavailableError``; ``get_backend`` hands out a fresh instance.
        Subclasses extend this and call ``super().close()``.
        """
        self._closed = True

    # -- helpers for subclasses ---------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailableError(
                f"the {self.name!r} backend for {self.device.name} was closed; get a new one with "
                f"gpulazy.io.get_backend({self.name!r}, {self.device.name!r})")

    def _check_out(self, ranges: Sequence[ByteRange], out: Any) -> int:
        need = total_bytes(ranges)
        if not out.flags.c_contiguous:
            raise ValueError("the output buffer must be contiguous (a 1-D uint8 array from Device.empty)")
        if out.nbytes < need:
            raise ValueError(f"output buffer holds {out.nbytes} bytes but the ranges need {need}")
        return need

    def _record(self, nbytes: int, started: float, mode: str | None = None) -> None:
        self.stats.record_read(nbytes=nbytes, seconds=time.perf_counter() - started, backend=self.name,
                               mode=mode or self.mode, device=self.device.name)

    def _record_error(self) -> None:
        self.stats.record_error()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} device={self.device.name} mode={self.mode} threads={self.threads}>"
