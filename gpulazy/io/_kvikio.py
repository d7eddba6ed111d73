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
here. ``availability`` reports ``kvikio.cufile_driver`` ``is_gds_available`` so a user
can tell.

KvikIO's thread pool and task size are process-wide: creating a backend sets
``num_threads`` (``kvikio.defaults.set``) when it differs, so the last backend created
wins; the task size is passed with every ``pread`` instead.
"""

from __future__ import annotations

import functools
import itertools
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from gpulazy import config
from gpulazy.device import Device, gpu_count, gpu_unavailable_reason
from gpulazy.errors import ChunkReadError
from gpulazy.io._base import Backend, ReadFuture, open_error, short_read_error
from gpulazy.io._handles import HandleCache
from gpulazy.spec import ByteRange

__all__ = ["KvikioBackend"]

_PROBE_BYTES = (1 << 20) + 4097  # above gds_threshold, with an unaligned tail


class KvikioBackend(Backend):
    """``kvikio.CuFile.pread`` into CuPy buffers (GDS where possible, else KvikIO's compat mode).

    ``submit`` hands each range to KvikIO's thread pool at once; a small waiter pool
    owns the open file handles until their reads finish, then closes them, checks
    byte counts and records the read with the mode that served it.
    """

    name = "kvikio"
    device_direct = True
    devices = frozenset({"cuda"})

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
        # Threads that wait on KvikIO futures; the I/O itself runs on KvikIO's pool.
        self._waiters = ThreadPoolExecutor(max(4, self.threads), thread_name_prefix=f"gpulazy-kvikio-{device.name}")
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

    @property
    def mode(self) -> str:
        """``"gds"``, ``"compat"`` or ``"gds+compat"``: what served the latest read (else the probe's answer)."""
        if self._last_mode is not None:
            return self._last_mode
        return _probe(self.device.index)[2] or _preferred_mode(self._kvikio)

    # -- reading --------------------------------------------------------------------------
    def submit(self, ranges: Sequence[ByteRange], out: Any) -> ReadFuture:
        return self.submit_many([(ranges, out)], staged=False)[0]

    def submit_many(self, jobs: Sequence[tuple[Sequence[ByteRange], Any]], *, staged: bool | None = None
                    ) -> list[ReadFuture]:
        """Every read of ``jobs`` handed to KvikIO by one waiting thread (see ``_read_many``)."""
        self._check_open()
        jobs = [(_merge(list(ranges)), out, self._check_out(ranges, out)) for ranges, out in jobs]
        if staged is None:
            staged = config.get("staging") == "always"
        future = self._waiters.submit(self._read_many, jobs, bool(staged))
        return [ReadFuture([future], lambda values, i=i: values[0][i]) for i in range(len(jobs))]

    def close(self) -> None:
        super().close()
        self._waiters.shutdown(wait=True)
        self._handles.close()

    # -- internals ------------------------------------------------------------------------
    def _read_many(self, jobs: list[tuple[list[ByteRange], Any, int]], staged: bool) -> list[int]:
        """Submit every range of every job, then wait; one thread, so one GIL hand-off per wait.

        ``staged``: KvikIO reads into one pinned host buffer (plain ``pread``s on its
        thread pool, no CUDA stream of KvikIO's involved), and each job's bytes go to the
        device by one ``cudaMemcpyAsync`` on gpulazy's non-blocking stream as soon as its
        reads are in; the thread waits on that stream only. Kernels on CuPy's legacy default
        stream then never wait for our copies, nor ours for them.
        """
        started = time.perf_counter()
        before = self._snapshot()
        held: dict[str, Any] = {}
        pending: list[tuple[int, ByteRange, Any]] = []
        errors: list[BaseException] = []
        host = None
        try:
            with self.device.activate():
                if staged:
                    host, hview = _pinned(sum(n for _, _, n in jobs))
                at = 0
                for j, (ranges, out, nbytes) in enumerate(jobs):
                    dst = 0
                    for r in ranges:
                        h = held.get(r.path) or self._acquire(r.path, held)
                        if r.nbytes:
                            dest = hview[at + dst: at + dst + r.nbytes] if staged else out[dst: dst + r.nbytes]
                            pending.append((j, r, self._pread(h.obj, r, dest)))
                        dst += r.nbytes
                    at += nbytes
        except BaseException as e:
            errors.append(e)
        # Every future is waited on before any handle is given back: KvikIO's workers use them.
        left = [0] * len(jobs)
        for j, _, _ in pending:
            left[j] += 1
        offsets = list(itertools.accumulate((n for _, _, n in jobs), initial=0))
        stream = _stream(self.device) if staged else None
        for j, r, fut in pending:
            try:
                got = fut.get()
                if got != r.nbytes:
                    errors.append(short_read_error(r, got, backend=self.name))
            except BaseException as e:
                errors.append(_read_failure(r, e))
            left[j] -= 1
            if staged and left[j] == 0 and not errors:
                _copy_async(jobs[j][1], host, offsets[j], jobs[j][2], stream)
        if staged:
            try:
                stream.synchronize()  # our stream only: the copies of this batch have left ``host``
            except BaseException as e:
                errors.append(e)
        for h in held.values():
            self._handles.release(h)
        if errors:
            self._record_error()
            raise errors[0]
        nbytes = sum(n for _, _, n in jobs)
        mode = self._mode_since(before)  # (staged or not, KvikIO's own mode: gds or compat)
        self._last_mode = mode
        self._record(nbytes, started, mode)
        return [n for _, _, n in jobs]

    def _acquire(self, path: str, held: dict[str, Any]) -> Any:
        # KvikIO raises a bare RuntimeError for a missing file and opens directories;
        # check first so the error names the path and says what is wrong.
        if os.path.isdir(path):
            raise open_error(path, IsADirectoryError(path), backend=self.name)
        if os.path.exists(path) and not os.path.isfile(path):  # opening a FIFO would wait for a writer
            raise open_error(path, OSError("not a regular file (a pipe or device node)"), backend=self.name)
        try:
            h = self._handles.acquire(path)
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
    from gpulazy.device import gpulazy_stream

    return gpulazy_stream(device)


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
    try:
        import kvikio.cufile_driver

        parts.append(f"cuFile GDS available={kvikio.cufile_driver.get('is_gds_available')}")
    except Exception:
        parts.append("cuFile driver not loadable")
    parts.append(f"KvikIO {getattr(kvikio, '__version__', '?')}; probed on a temp file, so a data file "
                 "system without GDS support still reads in compat mode")
    return ", ".join(parts)
