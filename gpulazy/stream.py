"""``Prefetcher``: a stream of arrays loaded ahead into a ring of preallocated device buffers.

The API users of the ``gpuprefetch`` package know, for data that is not a Dask array:
``nworkers`` threads (or processes) call ``loader()`` over and over; each result is
copied into one of ``capacity`` buffers allocated once on the device; ``next()`` hands
out the next filled buffer, passed through ``post``.

The reuse rule
--------------
The array returned by ``next()`` (and anything ``post`` made from it without copying,
e.g. a torch tensor sharing its memory) stays valid until the *following* ``next()``
call, or ``close()``. That call gives its buffer back to the ring, where a worker may
refill it at once. Copy it (``x.copy()``) to keep it longer. On a GPU, the buffer is
given back with a CUDA event recorded on the consumer's current CuPy stream, and the
worker waits for that event before overwriting it, so kernels the consumer queued on
that stream finish reading first.

Order: with ``nworkers=1`` arrays come out in the order ``loader`` returned them; with
more workers the order is whatever order the loads finished in.

End and errors: when ``loader`` raises ``StopIteration`` the workers stop calling it,
the arrays already loaded are handed out, then ``next()`` raises ``StopIteration``. Any
other exception is raised by the consumer's next ``next()`` call (the original
exception object, its traceback kept; from a worker process, with the remote traceback
chained as its ``__cause__``), and the stream is closed: later calls raise
``StopIteration``.

Shutdown: leaving the ``with`` block, ``close()``, the end of the stream or an error
stops the workers; a worker waiting for a free buffer stops at once, a worker inside a
``loader()`` call stops when that call returns (``close`` waits about a second for it,
then leaves the daemon thread or terminates the process).

>>> import numpy as np, itertools
>>> from gpulazy.stream import Prefetcher
>>> counter = itertools.count()
>>> def loader():
...     i = next(counter)
...     if i == 3:
...         raise StopIteration
...     return np.full((2, 2), i, dtype="float32")
>>> with Prefetcher(loader, "float32", (2, 2), capacity=2, device="cpu") as stream:
...     [float(x[0, 0]) for x in stream]
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import queue
import threading
import time
import traceback
import weakref
from collections import deque
from typing import Any, Callable

import numpy as np

from gpulazy.device import Device, get_device

__all__ = ["Prefetcher"]

_JOIN_SECONDS = 1.0
_POLL = 0.05  # how often a waiting worker process or the mover looks at the stop flag
_ids = itertools.count()


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (as text)."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


class _Stopped(Exception):
    """Internal: the stream was closed while a worker waited."""


def _check_array(array: Any, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    got_shape = tuple(getattr(array, "shape", ()))
    # Never np.asarray a CuPy array (it refuses implicit conversion): only when no dtype.
    got_dtype = np.dtype(array.dtype if hasattr(array, "dtype") else np.asarray(array).dtype)
    if got_shape != shape or not np.can_cast(got_dtype, dtype, "same_kind"):
        raise ValueError(
            f"loader returned an array of shape {got_shape} and dtype {got_dtype}, but this Prefetcher "
            f"was made for shape {shape} and dtype {dtype} (same-kind casts such as float64 to float32 "
            f"are allowed); return arrays of that shape, or make the Prefetcher with the loader's")


class _Copier:
    """Copies a loaded array into a ring buffer; on a GPU through its own stream and pinned staging."""

    def __init__(self, device: Device, dtype: np.dtype, shape: tuple[int, ...]):
        self.device, self.dtype, self.shape = device, dtype, shape
        self.stream: Any = None
        self.pinned: np.ndarray | None = None

    def copy(self, src: Any, dst: Any, wait_event: Any) -> None:
        _check_array(src, self.dtype, self.shape)
        if not self.device.is_gpu:
            np.copyto(dst, _to_numpy(src), casting="same_kind")
            return
        import cupy

        with self.device.activate():
            if self.stream is None:
                self.stream = cupy.cuda.Stream(non_blocking=True)
            for event in wait_event or ():
                self.stream.wait_event(event)  # the consumer is done with this buffer
            if isinstance(src, np.ndarray):
                if self.pinned is None:
                    import cupyx

                    self.pinned = cupyx.empty_pinned(self.shape, dtype=self.dtype)
                # Pinned staging makes the host-to-device copy an async DMA at full speed.
                np.copyto(self.pinned, src, casting="same_kind")
                dst.set(self.pinned, stream=self.stream)
            else:
                src = cupy.asarray(src)
                # The loader's kernels ran on its own stream; ours does not wait on it.
                cupy.cuda.get_current_stream().synchronize()
                with self.stream:
                    cupy.copyto(dst, src, casting="same_kind")
            self.stream.synchronize()


def _to_numpy(array: Any) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    get = getattr(array, "get", None)  # a CuPy array handed to a CPU stream
    return get() if callable(get) and type(array).__module__.startswith("cupy") else np.asarray(array)


class _Ring:
    """The buffers, who holds them, and the workers; shared by workers, never the Prefetcher itself."""

    def __init__(self, device: Device, dtype: np.dtype, shape: tuple[int, ...], capacity: int):
        self.device, self.dtype, self.shape = device, dtype, shape
        with device.activate():
            self.buffers = [device.xp.empty(shape, dtype=dtype) for _ in range(capacity)]
        self.cond = threading.Condition()
        self.free: deque[int] = deque(range(capacity))
        self.filled: deque[int] = deque()
        self.events: dict[int, Any] = {}  # slot -> CUDA event the refill must wait for
        self.error: BaseException | None = None
        self.exhausted = False  # a loader said StopIteration, or failed: no more loader calls
        self.stopped = False
        self.alive = 0
        self.produced = 0
        self.threads: list[threading.Thread] = []
        self.procs: Any = None  # _Processes in process mode

    # --- workers' side ---

    def take_free(self) -> int:
        with self.cond:
            while not self.free and not self.stopped:
                self.cond.wait()
            if self.stopped:
                raise _Stopped
            return self.free.popleft()

    def produce(self, fetch: Callable[[], tuple[Any, Callable[[], None] | None]]) -> None:
        # The loader runs with the stream's device current, so CuPy loaders allocate there.
        with self.device.activate():
            self._produce(fetch)

    def _produce(self, fetch: Callable[[], tuple[Any, Callable[[], None] | None]]) -> None:
        copier = _Copier(self.device, self.dtype, self.shape)
        try:
            while True:
                with self.cond:
                    if self.stopped or self.exhausted:
                        return
                try:
                    array, release = fetch()
                except StopIteration:
                    with self.cond:
                        self.exhausted = True
                    return
                except _Stopped:
                    return
                except BaseException as e:
                    self.fail(e)
                    return
                try:
                    self.fill(copier, array)
                except _Stopped:
                    return
                except BaseException as e:
                    self.fail(e)
                    return
                finally:
                    del array
                    if release is not None:
                        release()
        finally:
            with self.cond:
                self.alive -= 1
                self.cond.notify_all()

    def fill(self, copier: _Copier, array: Any) -> None:
        slot = self.take_free()
        try:
            with self.cond:
                event = self.events.pop(slot, None)
            copier.copy(array, self.buffers[slot], event)
        except BaseException:
            with self.cond:
                self.free.appendleft(slot)
            raise
        with self.cond:
            self.filled.append(slot)
            self.produced += 1
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None and not self.stopped:
                self.error = error
            self.exhausted = True
            self.cond.notify_all()

    # --- shutdown ---

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if self.procs is not None:
            self.procs.stop()
        deadline = time.monotonic() + _JOIN_SECONDS
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        if self.procs is not None:
            self.procs.close(deadline)
        with self.cond:
            self.filled.clear()
            self.free.clear()
            self.buffers = []


class Prefetcher:
    """Load arrays ahead, on worker threads or processes, into preallocated device buffers.

    Parameters
    ----------
    loader
        ``loader() -> array`` of ``shape`` and ``dtype`` (NumPy; CuPy too in thread mode),
        or raises ``StopIteration`` to end the stream. Called concurrently by
        ``nworkers`` workers; in process mode it must be picklable (a module-level
        function, or a ``functools.partial`` of one) and return NumPy arrays.
    dtype, shape
        Of every array; ``capacity`` buffers of this shape are allocated once. Loaded
        arrays are cast to ``dtype`` when NumPy's ``same_kind`` rule allows.
    capacity
        Buffers in the ring: the array handed out last plus up to ``capacity - 1``
        loaded ahead.
    device
        ``"cpu"``, ``"cuda:N"``, a ``Device`` or ``None`` (config, then a GPU if usable).
    post
        A callable applied to each buffer by ``next()`` (e.g. ``gpulazy.to_torch``).
    nworkers
        Worker threads (or processes) calling ``loader``.
    mode
        ``"thread"`` or ``"process"``: processes call ``loader`` and return arrays through
        shared memory; a thread of this process copies them into the device ring.
    timeout
        Seconds ``next()`` waits for a filled buffer before raising ``TimeoutError``
        (``None``: wait as long as a worker is running).
    context
        Multiprocessing start method for ``mode="process"``: ``"spawn"`` or ``"forkserver"``.

    Notes
    -----
    See the module docstring for the reuse rule (a buffer stays valid until the
    following ``next()``), ordering, errors and shutdown.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> loader = lambda: rng.random((4, 4))                  # float64, cast to float32
    >>> with Prefetcher(loader, "float32", (4, 4), capacity=3, device="cpu") as stream:
    ...     batch = next(stream)
    ...     kept = batch.copy()                              # valid past the next next()
    ...     _ = next(stream)
    >>> batch.dtype, kept.shape
    (dtype('float32'), (4, 4))
    """

    def __init__(self, loader: Callable[[], Any], dtype: Any, shape: tuple[int, ...] | int, capacity: int,
                 device: str | Device | None = None, post: Callable[[Any], Any] | None = None,
                 nworkers: int = 1, mode: str = "thread", *, timeout: float | None = None,
                 context: str = "spawn"):
        if not callable(loader):
            raise TypeError(f"loader must be a callable returning an array, got {loader!r}")
        if post is not None and not callable(post):
            raise TypeError(f"post must be a callable applied to each buffer, got {post!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive number of buffers, got {capacity!r}")
        if isinstance(nworkers, bool) or not isinstance(nworkers, int) or nworkers < 1:
            raise ValueError(f"nworkers must be a positive integer, got {nworkers!r}")
        if mode not in ("thread", "process"):
            raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")
        if mode == "process" and context not in ("spawn", "forkserver"):
            raise ValueError(f"context must be 'spawn' or 'forkserver' (fork is unsafe with CUDA and threads), "
                             f"got {context!r}")
        self.loader = loader
        self.dtype = np.dtype(dtype)
        self.shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(n) for n in shape)
        self.capacity = capacity
        self.device: Device = get_device(device)
        self.post = post
        self.nworkers = nworkers
        self.mode = mode
        self.timeout = timeout
        self.context = context
        self._id = next(_ids)
        self._ring: _Ring | None = None
        self._held: int | None = None
        self._consumed = 0
        self._finalizer: weakref.finalize | None = None

    @property
    def name(self) -> str:
        """The prefix of this stream's worker thread and process names."""
        return f"gpulazy-prefetcher-{self._id}"

    # --- lifecycle ---

    def start(self) -> Prefetcher:
        """Allocate the ring and start the workers (``with`` and the first ``next()`` do it)."""
        if self._ring is not None:
            return self
        ring = _Ring(self.device, self.dtype, self.shape, self.capacity)
        if self.mode == "thread":
            loader = self.loader
            fetches = [lambda: (loader(), None)] * self.nworkers
            names = [f"{self.name}-{i}" for i in range(self.nworkers)]
        else:
            ring.procs = _Processes(self, ring)
            fetches, names = [ring.procs.fetch], [f"{self.name}-mover"]
        self._ring = ring
        self._finalizer = weakref.finalize(self, ring.close)
        ring.alive = len(fetches)
        for fetch, name in zip(fetches, names):
            t = threading.Thread(target=ring.produce, args=(fetch,), name=name, daemon=True)
            ring.threads.append(t)
            t.start()
        return self

    def close(self) -> None:
        """Stop the workers and free the ring (the buffer handed out last stays readable)."""
        if self._finalizer is not None:
            self._finalizer()  # runs ring.close once
        self._held = None

    def __enter__(self) -> Prefetcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Prefetcher:
        return self

    # --- consuming ---

    def __next__(self) -> Any:
        ring = self.start()._ring
        assert ring is not None
        release_event = self._release_event() if self._held is not None else None
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with ring.cond:
            if self._held is not None:
                ring.events[self._held] = release_event
                ring.free.append(self._held)
                self._held = None
                ring.cond.notify_all()
            while True:
                if ring.error is not None:
                    error, ring.error = ring.error, None
                    break
                if ring.filled:
                    slot = ring.filled.popleft()
                    error = None
                    break
                if ring.stopped or ring.alive == 0:
                    slot = error = None
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no array was loaded within {self.timeout} s "
                                       f"({ring.alive} worker(s) running); raise timeout= or check the loader")
                ring.cond.wait(remaining)
        if error is not None:
            self.close()
            raise error
        if slot is None:
            self.close()
            raise StopIteration
        self._held = slot
        self._consumed += 1
        buf = ring.buffers[slot]
        return self.post(buf) if self.post is not None else buf

    def next(self) -> Any:
        """The next array (same as ``next(prefetcher)``)."""
        return self.__next__()

    def _release_event(self) -> Any:
        """Events on the consumer's streams; the buffer is refilled only after they complete.

        The consumer may read the buffer from CuPy's current stream or, through a zero-copy
        ``to_torch`` hand-off, from torch's: both are recorded (DALI#5617 is this bug).
        """
        if not self.device.is_gpu:
            return None
        import sys

        import cupy

        streams = [cupy.cuda.get_current_stream()]
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            ts = torch.cuda.current_stream(self.device.index)
            streams.append(cupy.cuda.ExternalStream(ts.cuda_stream, self.device.index))
        events = []
        with self.device.activate():
            for stream in streams:
                event = cupy.cuda.Event(block=False, disable_timing=True)
                event.record(stream)
                events.append(event)
        return tuple(events)

    def stats(self) -> dict[str, Any]:
        """``produced`` (buffers filled), ``consumed`` (handed out), ``ready`` (filled, waiting),
        ``workers`` (running), ``closed``."""
        ring = self._ring
        if ring is None:
            return {"produced": 0, "consumed": 0, "ready": 0, "workers": 0, "closed": False}
        with ring.cond:
            return {"produced": ring.produced, "consumed": self._consumed, "ready": len(ring.filled),
                    "workers": ring.alive, "closed": ring.stopped}

    def __repr__(self) -> str:
        return (f"Prefetcher(shape={self.shape}, dtype={self.dtype}, capacity={self.capacity}, "
                f"device={self.device.name!r}, nworkers={self.nworkers}, mode={self.mode!r})")


# --------------------------------------------------------------------------- process mode


class _Processes:
    """Worker processes writing into shared-memory slots, and the mover's fetch from them."""

    def __init__(self, owner: Prefetcher, ring: _Ring):
        from multiprocessing import shared_memory

        ctx = multiprocessing.get_context(owner.context)
        self.ring = ring
        self.nworkers = owner.nworkers
        nbytes = max(1, int(np.prod(owner.shape)) * owner.dtype.itemsize)
        nslots = 2 * owner.nworkers  # each process can load one while one waits to be moved
        self.shms = [shared_memory.SharedMemory(create=True, size=nbytes) for _ in range(nslots)]
        self.views = [np.ndarray(owner.shape, owner.dtype, buffer=s.buf) for s in self.shms]
        self.free_q = ctx.Queue()
        self.ready_q = ctx.Queue()
        for i in range(nslots):
            self.free_q.put(i)
        self.stop_event = ctx.Event()
        self.exhausted = ctx.Event()
        self.ended: set[int] = set()
        self.dead_polls: dict[int, int] = {}
        args = (owner.loader, [s.name for s in self.shms], owner.dtype, owner.shape,
                self.free_q, self.ready_q, self.stop_event, self.exhausted)
        self.procs = [ctx.Process(target=_process_main, args=(*args, wid), name=f"{owner.name}-proc-{wid}",
                                  daemon=True) for wid in range(owner.nworkers)]
        try:
            for p in self.procs:
                p.start()  # pickles the loader here, in this process
        except Exception as e:
            self.stop()
            self.close(time.monotonic() + _JOIN_SECONDS)
            raise TypeError(f"mode='process' needs a picklable loader (a module-level function, an instance "
                            f"of a module-level class, or a functools.partial of one); {owner.loader!r} "
                            f"could not be sent to a worker process: {type(e).__name__}: {e}") from e

    def fetch(self) -> tuple[np.ndarray, Callable[[], None]]:
        """The next array a process loaded (a shared-memory view) and how to give its slot back."""
        while True:
            if self.ring.stopped:
                raise _Stopped
            try:
                kind, wid, value, text = self.ready_q.get(timeout=_POLL)
            except queue.Empty:
                self._check_alive()
                continue
            if kind == "data":
                return self.views[value], lambda slot=value: self.free_q.put(slot)
            if kind == "error":
                value.__cause__ = _RemoteTraceback(text)
                raise value
            self.ended.add(wid)
            if len(self.ended) == self.nworkers:
                raise StopIteration

    def _check_alive(self) -> None:
        # A process that exited without saying "end" crashed (or could not unpickle the
        # loader). Its last messages may still be in the pipe: wait a few polls first.
        for wid, p in enumerate(self.procs):
            if wid in self.ended or p.exitcode is None:
                continue
            self.dead_polls[wid] = self.dead_polls.get(wid, 0) + 1
            if self.dead_polls[wid] > 10:
                raise RuntimeError(
                    f"prefetch worker process {p.name} (pid {p.pid}) exited with code {p.exitcode} before the "
                    f"stream ended; its stderr says why (a loader that cannot be unpickled in a fresh "
                    f"process, or a crash)")

    def stop(self) -> None:
        self.stop_event.set()

    def _drain(self) -> None:
        try:
            while True:
                self.ready_q.get_nowait()
        except (queue.Empty, OSError, EOFError):
            pass

    def close(self, deadline: float) -> None:
        # A process exits only once its queued messages are in the pipe: keep reading
        # them while it stops, so a full pipe cannot hold it up.
        while any(p.pid is not None and p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            self._drain()
            for p in self.procs:
                p.join(_POLL / len(self.procs))
        for p in self.procs:
            if p.pid is None:  # never started
                continue
            if p.is_alive():
                p.terminate()
                p.join(1.0)
            if p.exitcode is not None:
                p.close()
        for q in (self.free_q, self.ready_q):
            q.close()
            q.cancel_join_thread()
        self.views = []
        for s in self.shms:
            try:
                s.close()
            except BufferError:  # a view is still referenced (a mover stuck in a copy)
                pass
            s.unlink()


def _process_main(loader, shm_names, dtype, shape, free_q, ready_q, stop_event, exhausted, wid) -> None:
    """A worker process: call ``loader``, copy each result into a free shared-memory slot."""
    from multiprocessing import shared_memory

    shms = [shared_memory.SharedMemory(name=n) for n in shm_names]
    views = [np.ndarray(shape, dtype, buffer=s.buf) for s in shms]
    try:
        while not stop_event.is_set() and not exhausted.is_set():
            try:
                array = _to_numpy(loader())
                _check_array(array, dtype, shape)
            except StopIteration:
                exhausted.set()
                break
            except BaseException as e:
                ready_q.put(("error", wid, _picklable(e), traceback.format_exc()))
                exhausted.set()
                break
            slot = _take_slot(free_q, stop_event)
            if slot is None:
                break
            np.copyto(views[slot], array, casting="same_kind")
            ready_q.put(("data", wid, slot, None))
    finally:
        ready_q.put(("end", wid, None, None))
        del views
        for s in shms:
            s.close()


def _take_slot(free_q: Any, stop_event: Any) -> int | None:
    while not stop_event.is_set():
        try:
            return free_q.get(timeout=_POLL)
        except queue.Empty:
            continue
    return None


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
