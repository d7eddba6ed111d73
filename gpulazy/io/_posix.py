"""The ``posix`` backend: threaded ``os.preadv`` into NumPy, or through pinned buffers into CuPy.

On ``"cpu"`` every piece of a read lands straight in the caller's NumPy buffer
(``preadv`` into a memoryview slice: no extra copy). On a CUDA device each worker
thread reads a piece into one of a ring of pinned host buffers and copies it to the
device asynchronously on one of several non-blocking streams; a pinned buffer is
reused only after its copy has finished (a CUDA event per copy). This is the path
``"auto"`` takes on a GPU when KvikIO is not usable.

Reads are split into ``task_size`` pieces spread over ``threads`` workers. A piece
loops on partial reads (Linux moves at most 0x7ffff000 bytes per call); a read that
returns 0 before the end is a short read and raises ``ChunkReadError``.
"""

from __future__ import annotations

import functools
import os
import queue
import stat
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import numpy as np

from gpulazy.device import Device
from gpulazy.errors import BackendUnavailableError, ChunkReadError
from gpulazy.io._base import Backend, ReadFuture, open_error, read_error, short_read_error
from gpulazy.io._handles import Handle, HandleCache
from gpulazy.spec import ByteRange, FileIdentity

__all__ = ["PosixBackend"]

# Module-level so tests can cap the bytes one call returns and exercise the loop.
_preadv = getattr(os, "preadv", None)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """One read call into ``view`` at file ``offset``; returns bytes read (0 at EOF)."""
    if _preadv is not None:
        return _preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)  # platforms without preadv: one extra copy
    view[: len(data)] = data
    return len(data)


def _read_fully(fd: int, view: memoryview, offset: int, r: ByteRange) -> None:
    """Fill ``view`` from ``offset``, looping on partial reads; a 0 return is a short read."""
    done, n = 0, len(view)
    while done < n:
        try:
            got = _pread_into(fd, view[done:], offset + done)
        except OSError as e:  # EIO from a failing disk, ESTALE on NFS...: say where
            raise read_error(r, offset + done, n - done, e, backend="posix") from e
        if got == 0:
            raise _short(fd, r, offset + done)
        done += got


def _short(fd: int, r: ByteRange, stopped: int) -> ChunkReadError:
    # Byte counts from the file's size, not from this piece: pieces of one range run
    # in any order, and each must report the same (true) number of bytes available.
    size = os.fstat(fd).st_size
    end = stopped if size > stopped else max(size, r.offset)
    return short_read_error(r, end - r.offset, backend="posix", at=end)


class _Piece:
    """``nbytes`` of range ``r`` from file offset ``offset`` into output byte ``dst``."""

    __slots__ = ("r", "fd", "offset", "dst", "nbytes")

    def __init__(self, r: ByteRange, fd: int, offset: int, dst: int, nbytes: int):
        self.r, self.fd, self.offset, self.dst, self.nbytes = r, fd, offset, dst, nbytes


def _split(ranges: Sequence[ByteRange], fds: dict[str, int], task_size: int) -> list[_Piece]:
    pieces, dst = [], 0
    for r in ranges:
        for start in range(0, r.nbytes, task_size):
            n = min(task_size, r.nbytes - start)
            pieces.append(_Piece(r, fds[r.path], r.offset + start, dst + start, n))
        dst += r.nbytes
    return pieces


def _open_fd(path: str) -> int:
    """A read-only descriptor of ``path``; ChunkReadError naming it if it cannot be read."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (no effect on regular files).
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise open_error(path, e, backend="posix") from e
    mode = os.fstat(fd).st_mode
    # os.open succeeds on a directory on Linux; reading it would fail later with EISDIR.
    if stat.S_ISDIR(mode):
        os.close(fd)
        raise open_error(path, IsADirectoryError(path), backend="posix")
    if not stat.S_ISREG(mode):  # a FIFO never ends, /dev/zero reads zeros forever
        os.close(fd)
        raise open_error(path, OSError("not a regular file (a pipe or device node)"), backend="posix")
    return fd


def _open_all(paths: Sequence[str], handles: HandleCache, known: Mapping[str, FileIdentity]) -> dict[str, Handle]:
    """One handle per distinct path from ``handles`` (kept ones opened on the files as ``known``
    without a stat: ``HandleCache.reuse_many``); gives back what it took if one fails."""
    held = handles.reuse_many({p: known[p] for p in paths if p in known}) if known else {}
    try:
        for path in paths:
            if path in held:
                continue
            try:
                held[path] = handles.acquire(path)
            except ChunkReadError:
                raise
            except OSError as e:  # stat failed: missing file, no permission
                raise open_error(path, e, backend="posix") from e
    except BaseException:
        _release_all(handles, held)
        raise
    return held


def _release_all(handles: HandleCache, held: dict[str, Handle]) -> None:
    handles.release_many(held.values())


class _Job:
    """One ``submit``: counts finished pieces; the last one closes the files and settles ``future``.

    Settling only after every piece has finished means nothing writes into the
    caller's buffer once ``result()`` returns or raises.
    """

    def __init__(self, backend: PosixBackend, held: dict[str, Handle], npieces: int, nbytes: int):
        self.backend = backend
        self.held = held
        self.remaining = npieces
        self.nbytes = nbytes
        self.errors: list[BaseException] = []
        self.events: list[Any] = []  # CUDA events of this job's host->device copies
        self.started = time.perf_counter()
        self.future: Future = Future()
        self._lock = threading.Lock()

    @property
    def failed(self) -> bool:
        return bool(self.errors)

    def piece_done(self, error: BaseException | None = None, event: Any = None) -> None:
        with self._lock:
            if error is not None:
                self.errors.append(error)
            if event is not None:
                self.events.append(event)
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.finish()

    def finish(self) -> None:
        try:
            for ev in self.events:  # every copy of this job has landed before we report
                ev.synchronize()
        except BaseException as e:  # a CUDA error surfaces here
            self.errors.append(e)
        finally:
            _release_all(self.backend._handles, self.held)
        if self.errors:
            self.backend._record_error()
            self.future.set_exception(_first_error(self.errors))
        else:
            self.backend._record(self.nbytes, self.started)
            self.future.set_result(self.nbytes)


def _first_error(errors: list[BaseException]) -> BaseException:
    # Deterministic: any other error wins over a short read; of several short reads,
    # the one at the earliest offset.
    others = [e for e in errors if not (isinstance(e, ChunkReadError) and e.got is not None)]
    if others:
        return others[0]
    return min(errors, key=lambda e: e.offset)  # type: ignore[attr-defined]


class PosixBackend(Backend):
    """Threaded ``os.preadv``: straight into NumPy on ``"cpu"``, pinned bounce buffers on CUDA.

    Parameters
    ----------
    device
        Where bytes land.
    threads
        Worker threads (default ``config.get("threads")``).
    task_size
        Bytes per piece a read is split into (default ``config.get("task_size")``); on
        CUDA also the size of each pinned buffer.

    Examples
    --------
    >>> import numpy as np, tempfile, os
    >>> from gpulazy.io import get_backend
    >>> from gpulazy.spec import ByteRange
    >>> path = os.path.join(tempfile.mkdtemp(), "x.bin")
    >>> _ = open(path, "wb").write(bytes(range(16)))
    >>> out = np.empty(4, np.uint8)
    >>> get_backend("posix", "cpu").read_into([ByteRange(path, 2, 4)], out)
    4
    >>> out.tolist()
    [2, 3, 4, 5]
    """

    name = "posix"
    device_direct = False
    devices = frozenset({"cpu", "cuda"})

    def __init__(self, device: Device, **kwargs: Any):
        super().__init__(device, **kwargs)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"gpulazy-posix-{device.name}")
        self._handles = HandleCache(_open_fd, os.close)  # descriptors kept open between reads
        self._ring: _PinnedRing | None = None
        self._ring_lock = threading.Lock()

    @classmethod
    def availability(cls, device: Device) -> tuple[bool, str]:
        if device.is_gpu:
            return _probe_pinned(device.index)
        return True, "threaded os.preadv into host memory"

    @property
    def mode(self) -> str:
        return "pinned-bounce" if self.device.is_gpu else "posix"

    def submit(self, ranges: Sequence[ByteRange], out: Any) -> ReadFuture:
        return self._submit(ranges, out, {})

    def submit_many(self, jobs: Sequence[tuple[Sequence[ByteRange], Any]], *, staged: bool | None = None,
                    known: Mapping[str, FileIdentity] | None = None) -> list[ReadFuture]:
        return [self._submit(ranges, out, known or {}) for ranges, out in jobs]

    def _submit(self, ranges: Sequence[ByteRange], out: Any, known: Mapping[str, FileIdentity]) -> ReadFuture:
        self._check_open()
        nbytes = self._check_out(ranges, out)
        try:
            held = _open_all([r.path for r in ranges], self._handles, known)
        except ChunkReadError as e:
            self._record_error()
            return ReadFuture.failed(e)
        pieces = _split(ranges, {p: h.obj for p, h in held.items()}, self.task_size)
        job = _Job(self, held, len(pieces), nbytes)
        if not pieces:
            job.finish()
            return ReadFuture([job.future], lambda values: values[0])
        if self.device.is_gpu:
            from gpulazy.device import after_consumer

            # ``out`` may be memory the consumer's stream still reads (see ``Device.alloc``).
            task, args = _bounce_piece, (out, self._pinned_ring(), after_consumer(self.device))
        else:
            task, args = _host_piece, (memoryview(out).cast("B"),)
        for i, p in enumerate(pieces):
            try:
                self._pool.submit(task, job, p, *args)
            except RuntimeError as e:  # close() raced with us: settle the pieces never queued
                for _ in pieces[i:]:
                    job.piece_done(error=BackendUnavailableError(f"the posix backend was closed during a read: {e}"))
                break
        return ReadFuture([job.future], lambda values: values[0])

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=True)  # queued pieces finish: their jobs settle, handles come back
        self._handles.close()
        with self._ring_lock:
            self._ring = None  # pinned buffers go back to CuPy's pinned pool when collected

    # -- internals -----------------------------------------------------------------------
    def _pinned_ring(self) -> _PinnedRing:
        with self._ring_lock:
            if self._ring is None:
                self._ring = _PinnedRing(self.device, self.task_size, 2 * self.threads, max(2, self.threads))
            return self._ring


def _host_piece(job: _Job, p: _Piece, view: memoryview) -> None:
    # A failing piece is recorded in the job, never raised: the executor would swallow it.
    if job.failed:  # an earlier piece failed: the result is an error anyway
        job.piece_done()
        return
    try:
        _read_fully(p.fd, view[p.dst: p.dst + p.nbytes], p.offset, p.r)
    except BaseException as e:
        job.piece_done(error=e)
    else:
        job.piece_done()


# -- CUDA: a ring of pinned host buffers ------------------------------------------------------

@functools.cache
def _probe_pinned(index: int) -> tuple[bool, str]:
    """Can we allocate pinned memory and copy it to device ``index``? Probed once."""
    try:
        import cupy
    except ImportError as e:
        return False, f"CuPy is not installed ({e}); install it with: pip install 'gpulazy[gpu]'"
    try:
        with cupy.cuda.Device(index):
            mem = cupy.cuda.alloc_pinned_memory(4096)
            dev = cupy.empty(4096, dtype=cupy.uint8)
            cupy.cuda.runtime.memcpy(dev.data.ptr, mem.ptr, 4096, cupy.cuda.runtime.memcpyHostToDevice)
    except Exception as e:  # no driver, no device, out of pinned memory
        return False, f"cannot copy pinned host memory to cuda:{index}: {type(e).__name__}: {e}"
    return True, f"threaded os.preadv into pinned host buffers, async copies to cuda:{index}"


class _Slot:
    __slots__ = ("mem", "host", "event")

    def __init__(self, mem: Any, host: memoryview):
        self.mem, self.host, self.event = mem, host, None


class _PinnedRing:
    """``count`` pinned buffers of ``size`` bytes and ``nstreams`` non-blocking streams on one device."""

    def __init__(self, device: Device, size: int, count: int, nstreams: int):
        import cupy

        self.device = device
        self._free: queue.Queue[_Slot] = queue.Queue()
        with device.activate():
            for _ in range(count):
                mem = cupy.cuda.alloc_pinned_memory(size)
                host = np.frombuffer(mem, np.uint8, size)  # CuPy's documented way to view pinned memory
                self._free.put(_Slot(mem, memoryview(host)))
            self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(nstreams)]
        self._next = 0
        self._lock = threading.Lock()

    def acquire(self) -> _Slot:
        slot = self._free.get()
        if slot.event is not None:  # its previous copy must have left the buffer
            slot.event.synchronize()
            slot.event = None
        return slot

    def release(self, slot: _Slot) -> None:
        self._free.put(slot)

    def stream(self) -> Any:
        with self._lock:
            self._next = (self._next + 1) % len(self.streams)
            return self.streams[self._next]


def _bounce_piece(job: _Job, p: _Piece, out: Any, ring: _PinnedRing, after: Any) -> None:
    if job.failed:
        job.piece_done()
        return
    import cupy

    slot = ring.acquire()
    try:
        with ring.device.activate():
            _read_fully(p.fd, slot.host[: p.nbytes], p.offset, p.r)
            stream = ring.stream()
            stream.wait_event(after)
            cupy.cuda.runtime.memcpyAsync(out.data.ptr + p.dst, slot.mem.ptr, p.nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record(stream)
            slot.event = event
    except BaseException as e:
        ring.release(slot)
        job.piece_done(error=e)
    else:
        ring.release(slot)
        job.piece_done(event=event)
