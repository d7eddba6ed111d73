"""The ``kvikio`` backend: ``CuFile.pread`` straight into CuPy device buffers.

KvikIO serves a read through cuFile (GPUDirect Storage, ``"gds"``) where the host,
driver and file system allow it, otherwise through its own compatibility mode
(``"compat"``: POSIX reads into pinned bounce buffers on its thread pool). Which one
served a read is not in KvikIO's per-call API (kvikio#126, #529), and the per-file
decision (``FileHandle::get_compat_mode_manager``) is C++ only. KvikIO 26.x does
count every logical operation by the backend that carried it (``kvikio.SummaryMonitor``,
``by_backend["GDS"]`` / ``["POSIX"]``), so we read that monitor around each of our
reads: the mode recorded for a read is what KvikIO counted during it. Reads that
overlap (ours or anyone else's in the process) share one answer, which is then
``"gds+compat"`` if both backends were busy. Without a monitor (older KvikIO) the
mode falls back to the process-wide setting ``kvikio.defaults.is_compat_mode_preferred()``.

Caveat: ``"gds"`` means KvikIO handed the read to cuFile. cuFile may itself fall back
to POSIX when ``allow_compat_mode`` is set in ``cufile.json``; that is invisible from
here. ``gpulazy info`` reports ``kvikio.cufile_driver`` ``is_gds_available``
(``gds_details``) so a user can tell; reads do not ask, since the question opens the cuFile
driver (0.23 s of a process's first read on an H100 host).

KvikIO's thread pool and task size are process-wide: creating a backend sets
``num_threads`` (``kvikio.defaults.set``) when it differs, so the last backend created
wins; the task size is passed with every ``pread`` instead.
"""

from __future__ import annotations

import functools
import itertools
import os
import stat
import tempfile
import threading
import time
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from gpulazy import config
from gpulazy.device import Device, after_consumer, gpu_count, gpu_unavailable_reason
from gpulazy.errors import ChunkReadError
from gpulazy.io._base import Backend, ReadFuture, open_error, short_read_error
from gpulazy.io._handles import HandleCache
from gpulazy.spec import ByteRange, FileIdentity

__all__ = ["KvikioBackend"]

_PROBE_BYTES = (1 << 20) + 4097  # above gds_threshold, with an unaligned tail


class KvikioBackend(Backend):
    """``kvikio.CuFile.pread`` into CuPy buffers (GDS where possible, else KvikIO's compat mode).

    ``submit`` hands each range to KvikIO's thread pool at once, from the caller's
    thread; the batch holds its open file handles until its reads finish, then gives
    them back, checks byte counts and records the read with the mode that served it.
    """

    name = "kvikio"
    device_direct = True
    devices = frozenset({"cuda"})
    shared_queue = True  # one KvikIO thread pool per process (``kvikio.defaults`` ``num_threads``)

    def __init__(self, device: Device, **kwargs: Any):
        super().__init__(device, **kwargs)
        import kvikio
        import kvikio.defaults

        if int(kvikio.defaults.get("num_threads")) != self.threads:
            kvikio.defaults.set({"num_threads": self.threads})  # process-wide: the last backend made wins
        self._kvikio = kvikio
        monitor_cls = getattr(kvikio, "SummaryMonitor", None)
        self._monitor = monitor_cls() if monitor_cls is not None else None
        self._monitor_lock = threading.Lock()
        # Batches whose reads may still be in flight (``close`` waits for them).
        self._batches: weakref.WeakSet[_Batch] = weakref.WeakSet()
        # Files stay open between reads (thousands of tiles reread the same files).
        self._handles = HandleCache(lambda path: kvikio.CuFile(path, "r"), lambda f: f.close())
        self._last_mode: str | None = None

    # -- capability -----------------------------------------------------------------------
    @classmethod
    def availability(cls, device: Device) -> tuple[bool, str]:
        if not device.is_gpu:
            return False, f"KvikIO reads into CUDA device memory; device {device.name!r} is not a GPU"
        ok, reason, _ = _probe(device.index)
        return ok, reason

    @staticmethod
    def gds_details() -> str:
        """What the cuFile driver says of GPUDirect Storage here (``gpulazy info``)."""
        return gds_details()

    @property
    def mode(self) -> str:
        """``"gds"``, ``"compat"`` or ``"gds+compat"``: what served the latest read (else the probe's answer)."""
        if self._last_mode is not None:
            return self._last_mode
        return _probe(self.device.index)[2] or _preferred_mode(self._kvikio)

    # -- reading --------------------------------------------------------------------------
    def submit(self, ranges: Sequence[ByteRange], out: Any) -> ReadFuture:
        return self.submit_many([(ranges, out)], staged=False)[0]

    def submit_many(self, jobs: Sequence[tuple[Sequence[ByteRange], Any]], *, staged: bool | None = None,
                    known: Mapping[str, FileIdentity] | None = None) -> list[ReadFuture]:
        """Hand every range of ``jobs`` to KvikIO now, from the calling thread; see ``_Batch``.

        No Python thread of ours waits on the reads: KvikIO's C++ pool runs them without
        the GIL, and whichever thread first asks a future for its result (or polls it with
        ``done()``) finishes that job. So a thread busy in Python (a launch-bound compute)
        cannot starve the reads, which a waiting thread of ours needing the GIL after
        every range would be.
        """
        self._check_open()
        jobs = [(_merge(list(ranges)), out, self._check_out(ranges, out)) for ranges, out in jobs]
        if staged is None:
            staged = config.get("staging") == "always"
        batch = _Batch(self, jobs, bool(staged), known or {})
        return [ReadFuture([_JobPart(batch, j)], _first) for j in range(len(jobs))]

    def close(self) -> None:
        super().close()
        for batch in list(self._batches):
            batch.settle_all()  # KvikIO's workers use the handles and buffers until then
        self._handles.close()

    def _acquire(self, path: str, held: dict[str, Any]) -> Any:
        # KvikIO raises a bare RuntimeError for a missing file and opens directories;
        # check first so the error names the path and says what is wrong.
        # One stat serves these checks and the handle cache's identity check.
        try:
            st = os.stat(path)
        except OSError as e:
            raise open_error(path, e, backend=self.name) from e
        if stat.S_ISDIR(st.st_mode):
            raise open_error(path, IsADirectoryError(path), backend=self.name)
        if not stat.S_ISREG(st.st_mode):  # opening a FIFO would wait for a writer
            raise open_error(path, OSError("not a regular file (a pipe or device node)"), backend=self.name)
        try:
            h = self._handles.acquire(path, st)
        except Exception as e:
            raise open_error(path, e, backend=self.name) from e
        held[path] = h
        return h

    def _pread(self, f: Any, r: ByteRange, dest: Any) -> Any:
        # Below gds_threshold KvikIO reads synchronously inside pread(), so an EOF can
        # surface here rather than from the future.
        try:
            return f.pread(dest, r.nbytes, r.offset, task_size=self.task_size)
        except BaseException as e:
            raise _read_failure(r, e) from e

    def _snapshot(self) -> Any:
        if self._monitor is None:
            return None
        with self._monitor_lock:
            return self._monitor.get()

    def _mode_since(self, before: Any) -> str:
        if before is None:
            return _preferred_mode(self._kvikio)
        with self._monitor_lock:
            delta = self._monitor.since(before)
        return _mode_from_summary(delta) or _preferred_mode(self._kvikio)


class _DeviceSpan:
    """``nbytes`` bytes of device memory at ``ptr``, for KvikIO to read into: what a slice of a
    CuPy array gives it (its ``__cuda_array_interface__``) without making a new ndarray and its
    interface for each range. On an H100 host submitting 2,048 ``pread`` calls of 2 MiB took
    10.4 µs a call this way against 19.3 with slices (one process, alternating)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def _first(values: list[Any]) -> int:
    return values[0]


class _JobPart:
    """One job of a ``_Batch``, as a part of a ``ReadFuture``."""

    __slots__ = ("batch", "j")

    def __init__(self, batch: _Batch, j: int):
        self.batch, self.j = batch, j

    def done(self) -> bool:
        return self.batch.progress(self.j)

    def result(self) -> int:
        return self.batch.wait(self.j)


class _Batch:
    """The reads of one ``submit_many``, submitted at creation by the calling thread.

    Direct (``staged=False``): KvikIO reads into the jobs' device buffers (in compat mode
    through its bounce buffers and its own per-thread CUDA streams, which are blocking:
    their copies wait for kernels on CuPy's legacy default stream, and those kernels for
    them).

    Staged: KvikIO reads into one pinned host buffer (plain ``pread``s on its pool, no
    CUDA stream of KvikIO's involved), and each job's bytes go to the device by one
    ``cudaMemcpyAsync`` on the finishing thread's non-blocking ``staging_stream``, with an
    event recorded after it; the job is handed out once that event has completed.
    Kernels on the legacy stream then never wait for our copies, nor ours for them.

    ``progress(j)`` (from ``ReadFuture.done``) never blocks: it issues job ``j``'s copy as
    soon as its reads are in, so a poller (``gpulazy.prefetch``) gets the copy going
    early. ``wait(j)`` blocks until job ``j`` is on the device. Handles go back and the
    read is recorded once every job has been waited for; the pinned buffer is dropped then.

    Each job has a lock of its own, held while its reads are collected and its copy waited
    for: a thread waiting for one job never holds up another job of the batch (dask's
    threads each wait for their own chunk), nor a poller moving the others on.
    """

    def __init__(self, backend: KvikioBackend, jobs: list[tuple[list[ByteRange], Any, int]], staged: bool,
                 known: Mapping[str, FileIdentity]):
        self.backend = backend
        self.jobs = jobs
        self.staged = staged
        self._known = known
        self._lock = threading.Lock()  # ``_left`` and closing
        self._locks = [threading.Lock() for _ in jobs]
        self._started = time.perf_counter()
        self._before = backend._snapshot()
        self._held: dict[str, Any] = {}
        self._reads: list[list[tuple[ByteRange, Any]]] = [[] for _ in jobs]
        self._errors: list[BaseException | None] = [None] * len(jobs)
        self._events: list[Any] = [None] * len(jobs)
        self._result: list[int | None] = [None] * len(jobs)
        self._left = len(jobs)
        self._host = self._hview = None
        self._offsets = list(itertools.accumulate((n for _, _, n in jobs), initial=0))
        # The outputs may be memory the consumer's stream still reads (``Device.alloc``):
        # staged copies wait for it on the device, never on the host.
        self._after = after_consumer(backend.device) if staged else None
        backend._batches.add(self)
        self._submit()

    def _submit(self) -> None:
        backend = self.backend
        with backend.device.activate():
            if self.staged:
                try:
                    self._host, self._hview = _pinned(self._offsets[-1])
                except BaseException as e:
                    self._errors = [e] * len(self.jobs)
                    return
            # Handles kept open on the files as the caller indexed them need no stat (the caller
            # stats the paths after the read): all of them taken at once.
            held = self._held
            held.update(backend._handles.reuse_many(self._known))
            for j, (ranges, out, _) in enumerate(self.jobs):
                at, dst = self._offsets[j], 0
                ptr = None if self.staged else out.data.ptr
                try:
                    for r in ranges:
                        h = held.get(r.path) or backend._acquire(r.path, held)
                        if r.nbytes:
                            dest = (self._hview[at + dst: at + dst + r.nbytes] if self.staged
                                    else _DeviceSpan(ptr + dst, r.nbytes))  # ``out`` stays held by the job
                            self._reads[j].append((r, backend._pread(h.obj, r, dest)))
                        dst += r.nbytes
                except BaseException as e:
                    self._errors[j] = e  # the ranges already submitted are still waited for

    # -- finishing ---------------------------------------------------------------------
    def progress(self, j: int) -> bool:
        """Whether job ``j`` is complete; never blocks (issues its copy once its reads are in)."""
        if self._result[j] is not None:
            return True
        lock = self._locks[j]
        if not lock.acquire(blocking=False):
            return False
        try:
            if self._result[j] is not None:
                return True
            if not self._move(j):
                return False
            event = self._events[j]
            return event is None or bool(event.done)
        finally:
            lock.release()

    def wait(self, j: int) -> int:
        """Block until job ``j`` is on the device; its byte count, or its error."""
        with self._locks[j]:
            if self._result[j] is None:
                self._collect(j)
                if self.staged and self._errors[j] is None and self._events[j] is None:
                    self._copy(j)
                if self.staged:
                    self._copy_ready(j)
                if self._events[j] is not None:
                    try:
                        self._events[j].synchronize()
                    except BaseException as e:
                        self._errors[j] = self._errors[j] or e
                self._result[j] = self.jobs[j][2]
                with self._lock:
                    self._left -= 1
                    last = self._left == 0
                if last:
                    self._close()
            error = self._errors[j]
        if error is not None:
            raise error
        return self.jobs[j][2]

    def settle_all(self) -> None:
        """Wait for every job (errors kept for their futures): nothing is left in flight."""
        for j in range(len(self.jobs)):
            try:
                self.wait(j)
            except BaseException:
                pass

    def _move(self, j: int) -> bool:
        # Job ``j``'s lock held. If its reads are in, collect them and issue its copy (once);
        # whether they were in.
        if not all(fut.done() for _, fut in self._reads[j]):
            return False
        if self.staged and self._events[j] is None and self._errors[j] is None:
            self._collect(j)
            if self._errors[j] is None:
                self._copy(j)
        return True

    def _copy_ready(self, j: int) -> None:
        # Job ``j``'s lock held. Before blocking on its copy, queue the copies of the jobs whose
        # reads are in already (those no other thread holds), so the copies of a batch follow
        # each other on the stream.
        for k in range(len(self.jobs)):
            if k == j or self._result[k] is not None or self._events[k] is not None or self._errors[k] is not None:
                continue
            lock = self._locks[k]
            if lock.acquire(blocking=False):
                try:
                    if self._result[k] is None:
                        self._move(k)
                finally:
                    lock.release()

    def _collect(self, j: int) -> None:
        # Job ``j``'s lock held. Wait for the reads of job ``j`` (each future once) and check byte counts.
        reads, self._reads[j] = self._reads[j], []
        for r, fut in reads:
            try:
                got = fut.get()
                if got != r.nbytes:
                    raise short_read_error(r, got, backend=self.backend.name)
            except BaseException as e:
                if self._errors[j] is None:
                    self._errors[j] = _read_failure(r, e)

    def _copy(self, j: int) -> None:
        # Job ``j``'s lock held; its reads are in host memory.
        import cupy

        _, out, nbytes = self.jobs[j]
        try:
            with self.backend.device.activate():
                stream = _stream(self.backend.device)
                stream.wait_event(self._after)
                _copy_async(out, self._host, self._offsets[j], nbytes, stream)
                event = cupy.cuda.Event(disable_timing=True)
                event.record(stream)
                self._events[j] = event
        except BaseException as e:
            self._errors[j] = e

    def _close(self) -> None:
        # Once, by the job finished last (every job waited for): give the handles back, record,
        # drop the pinned buffer.
        backend = self.backend
        backend._handles.release_many(self._held.values())
        self._held.clear()
        self._host = self._hview = None
        self._events = [None] * len(self.jobs)
        backend._batches.discard(self)
        failed = sum(e is not None for e in self._errors)
        for _ in range(failed):
            backend._record_error()
        if failed < len(self.jobs):
            mode = backend._mode_since(self._before)
            backend._last_mode = mode
            backend._record(sum(n for (_, _, n), e in zip(self.jobs, self._errors) if e is None), self._started,
                            mode)

    def __del__(self) -> None:
        # A batch nobody waited for (a caller that raised early): its reads must not write
        # into buffers freed under them, nor keep files open.
        try:
            if self._left:
                self.settle_all()
        except Exception:
            pass


def _merge(ranges: list[ByteRange]) -> list[ByteRange]:
    """Adjacent ranges of one file (each ends where the next starts) as one range: fewer calls."""
    out: list[ByteRange] = []
    for r in ranges:
        last = out[-1] if out else None
        if last is not None and last.path == r.path and last.offset + last.nbytes == r.offset:
            out[-1] = ByteRange(r.path, last.offset, last.nbytes + r.nbytes)
        else:
            out.append(r)
    return out


def _pinned(nbytes: int) -> tuple[Any, Any]:
    """A pinned host buffer (from CuPy's pinned pool, reused between batches) and its NumPy view."""
    import cupy

    mem = cupy.cuda.alloc_pinned_memory(max(1, nbytes))
    return mem, np.frombuffer(mem, np.uint8, nbytes)


def _stream(device: Device) -> Any:
    from gpulazy.device import staging_stream

    return staging_stream(device)


def _copy_async(out: Any, host: Any, at: int, nbytes: int, stream: Any) -> None:
    import cupy

    if nbytes:
        cupy.cuda.runtime.memcpyAsync(out.data.ptr, host.ptr + at, nbytes, cupy.cuda.runtime.memcpyHostToDevice,
                                      stream.ptr)


def _read_failure(r: ByteRange, exc: BaseException) -> BaseException:
    """KvikIO raises (``"POSIX error on pread: EOF"``) instead of returning a short count."""
    if isinstance(exc, ChunkReadError):
        return exc
    try:
        size = os.stat(r.path).st_size
    except OSError:
        size = None
    if size is not None and size < r.offset + r.nbytes:
        err = short_read_error(r, max(0, size - r.offset), backend="kvikio", at=max(r.offset, size))
    else:
        err = ChunkReadError(f"KvikIO failed to read {r.nbytes} bytes of {r.path!r} at offset {r.offset}: "
                             f"{type(exc).__name__}: {exc}", path=r.path, offset=r.offset, expected=r.nbytes)
    err.__cause__ = exc
    return err


def _mode_from_summary(summary: Any) -> str | None:
    by = getattr(summary, "by_backend", {}) or {}
    gds = by.get("GDS", {}).get("num_ops", 0)
    posix = by.get("POSIX", {}).get("num_ops", 0)
    if gds and posix:
        return "gds+compat"
    if gds:
        return "gds"
    if posix:
        return "compat"
    return None


def _preferred_mode(kvikio: Any) -> str:
    try:
        return "compat" if kvikio.defaults.is_compat_mode_preferred() else "gds"
    except Exception:
        return "compat"


@functools.cache
def _probe(index: int) -> tuple[bool, str, str | None]:
    """``(ok, reason, mode)`` from one real read through KvikIO into cuda:``index``; run once per device."""
    if gpu_count() <= index:
        why = gpu_unavailable_reason() or f"only {gpu_count()} CUDA device(s) are present"
        return False, f"no CUDA device cuda:{index}: {why}", None
    try:
        import cupy
        import kvikio
        import kvikio.defaults
    except ImportError as e:
        return False, f"KvikIO or CuPy is not installed ({e}); install them with: pip install 'gpulazy[gpu]'", None
    data = np.random.default_rng(index).integers(0, 256, _PROBE_BYTES, dtype=np.uint8)
    fd, path = tempfile.mkstemp(prefix="gpulazy-kvikio-probe-", suffix=".bin")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.tobytes())
        monitor = kvikio.SummaryMonitor() if hasattr(kvikio, "SummaryMonitor") else None
        with cupy.cuda.Device(index):
            buf = cupy.zeros(_PROBE_BYTES, dtype=cupy.uint8)
            f = kvikio.CuFile(path, "r")
            try:
                got = f.pread(buf, _PROBE_BYTES, 0).get()
            finally:
                f.close()
            same = got == _PROBE_BYTES and bool((cupy.asnumpy(buf) == data).all())
        mode = (_mode_from_summary(monitor.get()) if monitor is not None else None) or _preferred_mode(kvikio)
        if monitor is not None:
            monitor.stop()
    except Exception as e:  # missing libcuda/libcufile, driver errors, ...
        return False, f"KvikIO probe read failed: {type(e).__name__}: {e}", None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    if not same:
        return False, f"KvikIO probe read returned wrong bytes ({got} of {_PROBE_BYTES} read)", None
    return True, f"probe read into cuda:{index} matched; {mode} mode ({_mode_details(kvikio)})", mode


def _mode_details(kvikio: Any) -> str:
    parts = []
    try:
        setting = kvikio.defaults.get("compat_mode")
        parts.append(f"compat_mode setting {getattr(kvikio.CompatMode(setting), 'name', setting)}")
        parts.append(f"compat preferred={kvikio.defaults.is_compat_mode_preferred()}")
    except Exception:
        pass
    parts.append(f"KvikIO {getattr(kvikio, '__version__', '?')}; probed on a temp file, so a data file "
                 "system without GDS support still reads in compat mode")
    return ", ".join(parts)


def gds_details() -> str:
    """What the cuFile driver says of GPUDirect Storage here (for ``gpulazy info``; it opens the
    driver, which no read needs)."""
    try:
        import kvikio.cufile_driver

        return f"cuFile GDS available={kvikio.cufile_driver.get('is_gds_available')}"
    except Exception:
        return "cuFile driver not loadable"
