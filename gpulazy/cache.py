"""``DeviceCache``: a bytes-bounded LRU of decoded chunks on one device.

The cache never knows how bytes were read: callers hand it a ``load(spec)`` callable
(usually ``ChunkSource.read``). What it guarantees:

- **Bounded**: the bytes of the arrays it holds, plus the bytes reserved for prefetch
  reads in flight, never exceed ``capacity``. Room is reserved *before* an array is
  inserted, by evicting least-recently-used entries that are not in use; when no room
  can be made (everything pinned, or the chunk is larger than the capacity) the
  array is handed out without being cached (read through).
- **One read per chunk**: concurrent requests for one chunk share a single ``load``
  through a future. If that load raises, every waiter gets the exception and nothing
  is cached.
- **Copies out**: every array handed out is the caller's own (a hit copies on the
  device; a miss caches a copy and hands out the loaded array; a chunk read ahead with
  ``keep=False`` is handed out as read and not cached), so writing into a result never
  corrupts the cache.
- **Read-ahead that cannot hurt**: ``prefetch`` warms chunks (reads started in the
  caller's thread with ``start=``, else on a few daemon threads), skips those cached,
  in flight or queued, and never evicts a chunk that was
  prefetched but not used yet to make room for another prefetch (it skips instead).
  A prefetch read error is recorded (``stats()["errors"]``), never raised in the
  background; a later ``get`` of that chunk reads it again and raises if it fails.

Caches have names and live in a process-wide registry: pickling one gives a reference
by name, so an array built with ``cache=DeviceCache("4 GiB")`` computes on
``dask.distributed`` workers, each of which creates (once) its own cache of that name,
capacity and device.

>>> import numpy as np
>>> from gpulazy.cache import DeviceCache
>>> from gpulazy.spec import ByteRange, ChunkSpec
>>> cache = DeviceCache("1 MiB", device="cpu")
>>> spec = ChunkSpec((ByteRange("a.raw", 0, 32),), (4, 4), "<u2")
>>> load = lambda s: np.arange(16, dtype="uint16").reshape(4, 4)   # any reader
>>> int(cache.get(spec, load).sum()), int(cache.get(spec, load).sum())
(120, 120)
>>> s = cache.stats(); (s["hits"], s["misses"], s["bytes_held"])
(1, 1, 32)
>>> cache.close()
"""

from __future__ import annotations

from dataclasses import dataclass, field

import atexit
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from concurrent.futures import CancelledError, Future
from typing import Any, Callable, Iterable

import numpy as np

from gpulazy import config
from gpulazy.device import Device, get_device, own_stream
from gpulazy.errors import ConfigError
from gpulazy.spec import ChunkSpec

__all__ = ["DeviceCache", "default_cache", "cache_by_name", "open_caches", "resolve_capacity"]

Loader = Callable[[ChunkSpec], Any]
#: ``start(specs) -> [pending, ...]``: reads submitted now; ``pending.done()`` never blocks,
#: ``pending.result()`` waits and returns the chunk's array; ``pending.spec`` is its spec.
Starter = Callable[[list], list]

# How long close() waits, in all, for its worker threads (a worker inside a load
# finishes that load first; threads are daemons, so exit is never blocked for longer).
_JOIN_SECONDS = 1.0
_MAX_WORKERS = 8


def resolve_capacity(capacity: int | str, device: Device) -> int:
    """Bytes meant by ``capacity`` on ``device``.

    Parameters
    ----------
    capacity
        An int (bytes), a size such as ``"8 GiB"``, or a percentage such as ``"50%"``
        of the device's *free* memory now (``Device.memory()``).
    device
        The device a percentage refers to.

    Examples
    --------
    >>> from gpulazy.device import get_device
    >>> resolve_capacity("2 KiB", get_device("cpu"))
    2048
    >>> 0 < resolve_capacity("1%", get_device("cpu"))
    True
    """
    if isinstance(capacity, bool):
        raise ConfigError(f"cache capacity must be bytes, '8 GiB' or '50%', got {capacity!r}")
    if isinstance(capacity, str) and capacity.strip().endswith("%"):
        text = capacity.strip()[:-1]
        try:
            percent = float(text)
        except ValueError as e:
            raise ConfigError(f"cannot read cache capacity {capacity!r} as a percentage; write e.g. '25%'") from e
        if not 0 <= percent <= 100:
            raise ConfigError(f"cache capacity {capacity!r} must be between 0% and 100% of free device memory")
        free, _ = device.memory()
        return int(free * percent / 100)
    if isinstance(capacity, float) and capacity.is_integer():
        capacity = int(capacity)
    return config.parse_bytes(capacity)


class _Entry:
    """A cached array, how many callers are copying it out, and whether it awaits its first use."""

    __slots__ = ("array", "nbytes", "pins", "prefetched")

    def __init__(self, array: Any, nbytes: int, prefetched: bool):
        self.array = array
        self.nbytes = nbytes
        self.pins = 0
        self.prefetched = prefetched


class _Job:
    """A load in flight: its future, who started it, and who waits on it."""

    __slots__ = ("future", "prefetch", "waiters", "used", "pending", "reserved", "t0", "keep", "landed")

    def __init__(self, prefetch: bool):
        self.future: Future = Future()
        self.prefetch = prefetch
        self.waiters = 0
        self.used = False  # a get already counted this prefetch as a prefetch hit
        # A read started by ``prefetch(..., start=)``: finished by whoever claims it first
        # (a ``get``, ``poll``, ``cancel`` or ``close``), never by a thread of the cache's.
        self.pending: Any = None
        self.reserved = 0
        self.t0 = 0.0
        # ``prefetch(..., keep=False)``: the chunk goes to the first ``get`` as it is, never cached.
        self.keep = True
        self.landed = False  # its pending read said it was done (``poll`` asks no more)


#: ``_hand_over``'s answer when the read failed (the error is recorded; ``get`` reads again).
_FAILED = object()
#: ``_Job.pending`` while ``prefetch(..., start=)`` submits the read, outside the lock.
_SUBMITTING = object()

_COUNTERS = ("hits", "misses", "prefetched", "prefetch_hits", "prefetch_skipped", "evictions",
             "bytes_read", "loads", "errors", "cancelled")


def _is_compact(arr: Any) -> bool:
    """Whether ``arr`` owns exactly its bytes (so caching it holds no hidden memory)."""
    flags = getattr(arr, "flags", None)
    if flags is None or not (flags.c_contiguous or flags.f_contiguous):
        return False
    if isinstance(arr, np.ndarray):
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        return root.base is None and root.nbytes == arr.nbytes
    data = getattr(arr, "data", None)  # cupy: a MemoryPointer into one pool allocation
    mem = getattr(data, "mem", None)
    size = getattr(mem, "size", None)
    if mem is None or size is None:
        return False
    # The CuPy pool rounds allocations up to 512 bytes.
    return data.ptr == mem.ptr and 0 <= size - arr.nbytes < 512


class DeviceCache:
    """A thread-safe, bytes-bounded LRU cache of decoded chunks on one device.

    Parameters
    ----------
    capacity
        Bytes it may hold: an int, a size such as ``"8 GiB"``, or ``"50%"`` of the
        device's free memory when the cache is created.
    device
        ``"cpu"``, ``"cuda:N"``, a ``Device`` or ``None`` (config, then a GPU if usable).
    name
        Its name in this process's registry (``cache_by_name``); a unique one is made
        when ``None``. Two open caches cannot share a name.

    Notes
    -----
    ``load(spec)`` must return a new array of ``spec.shape`` and ``spec.out_dtype`` on
    this device that the cache may keep (a prefetched array is cached as it is when it
    owns exactly its bytes, otherwise as a compact copy).

    Statistics count each ``get`` once: a *miss* started a load (or read through), a
    *hit* did not (served from the cache, or by waiting on a load already running).

    After ``close()`` the cache holds nothing and ``get`` reads through (loads and
    hands out without caching), so tasks still running finish.

    Examples
    --------
    >>> import numpy as np
    >>> from gpulazy.spec import ByteRange, ChunkSpec
    >>> cache = DeviceCache(64, device="cpu")
    >>> specs = [ChunkSpec((ByteRange("f", 32 * i, 32),), (8,), "<i4") for i in range(3)]
    >>> load = lambda s: np.full(8, s.ranges[0].offset, dtype="int32")
    >>> [int(cache.get(s, load)[0]) for s in specs]      # the third evicts the first
    [0, 32, 64]
    >>> specs[0] in cache, specs[2] in cache, cache.bytes_held
    (False, True, 64)
    >>> cache.close()
    """

    def __init__(self, capacity: int | str, *, device: str | Device | None = None, name: str | None = None):
        self.device: Device = get_device(device)
        self._capacity_spec = capacity
        self._capacity = resolve_capacity(capacity, self.device)
        self.name: str = str(name) if name is not None else f"cache-{uuid.uuid4().hex[:12]}"
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # prefetch workers wait on it
        self._attached = threading.Condition(self._lock)  # a started prefetch's read is attached
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest use first
        self._jobs: dict[str, _Job] = {}
        self._queue: OrderedDict[str, tuple[ChunkSpec, Loader]] = OrderedDict()
        self._held = 0
        self._reserved = 0
        self._loading = 0  # bytes of the chunks prefetch workers are loading now
        self._threads: list[threading.Thread] = []
        self._closed = False
        #: Share of the capacity queued read-ahead may take; halved after each out-of-memory.
        self.readahead_fraction = 1.0
        self.reset_stats()
        _register(self)

    # --- the public surface -------------------------------------------------

    @property
    def capacity(self) -> int:
        """Bytes this cache may hold."""
        return self._capacity

    def keeps(self, nbytes: int) -> bool:
        """Whether a pass reading ``nbytes`` through this cache is worth keeping in it.

        A pass over more bytes than the capacity is one an LRU cannot keep: each chunk would be
        put in (a copy, for a chunk handed out) and evicted, the newest evicting the oldest, before
        any reuse. Computes over such a pass hand their chunks out as read and keep none of them
        (``gpulazy.prefetch``, the read window of batched reads, streamed reductions).
        """
        return nbytes <= self._capacity

    @property
    def bytes_held(self) -> int:
        """Bytes of the arrays held now (the sum of their ``nbytes``)."""
        with self._lock:
            return self._held

    @property
    def closed(self) -> bool:
        return self._closed

    def __contains__(self, spec: ChunkSpec) -> bool:
        with self._lock:
            return spec.key in self._entries

    def holds(self, spec: ChunkSpec) -> bool:
        """Whether ``spec`` is cached or being loaded now (a ``get`` would not start a read)."""
        with self._lock:
            return spec.key in self._entries or spec.key in self._jobs

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __repr__(self) -> str:
        return (f"DeviceCache(name={self.name!r}, device={self.device.name!r}, "
                f"capacity={self._capacity}, bytes_held={self._held}, entries={len(self._entries)})")

    @property
    def ref(self) -> CacheRef:
        """A picklable value naming this cache; what chunk tasks carry."""
        return CacheRef(self.name, self._capacity_spec, self.device.name, self)

    def __reduce__(self):
        # A reference by name: the same object in this process, a cache created once
        # per process elsewhere (each dask.distributed worker gets its own).
        return (_cache_ref, (self.name, self._capacity_spec, self.device.name))

    def get(self, spec: ChunkSpec, load: Loader, check: Callable[[ChunkSpec], None] | None = None) -> Any:
        """The chunk ``spec`` as a new array the caller owns.

        Parameters
        ----------
        spec
            The chunk; ``spec.key`` identifies it.
        load
            ``load(spec) -> array``, called on a miss, once however many threads ask.
        check
            ``check(spec)``, called before a cached copy is handed out; what it raises refuses
            it (``gpulazy.integrity.check_unchanged``: a file changed since indexing). A chunk
            read for this call, or by a read in flight it waited for, was checked by that read.

        Returns
        -------
        array
            NumPy or CuPy array of ``spec.shape``; writing into it leaves the cache intact.

        Raises
        ------
        Exception
            Whatever ``load`` raised (for every caller waiting on that load).
        """
        key = spec.key
        while True:
            pending = None
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    self._count_hit(key, entry, None)
                    entry.pins += 1
                    job = None
                elif (job := self._jobs.get(key)) is None:
                    job = self._start_job(key, prefetch=False)
                    self._counts["misses"] += 1
                    owner = True
                else:
                    job.waiters += 1
                    owner = False
                    while job.pending is _SUBMITTING:
                        self._attached.wait()
                    pending, job.pending = job.pending, None  # a started prefetch: this thread finishes it
            if entry is not None:
                if check is not None:
                    self._check_hit(spec, entry, check)
                return self._copy_out(entry.array, entry)
            assert job is not None
            if owner:
                return self._load_for_get(spec, load, job)
            if pending is not None:
                if not job.keep:
                    handed = self._hand_over(key, job, pending)
                    if handed is _FAILED:
                        continue  # a failed read-ahead is read again on demand, and raises then
                    return handed
                self._finish_started(key, job, pending)
            try:
                result = job.future.result()
            except BaseException:
                if job.prefetch:
                    continue  # a failed prefetch is read again on demand, and raises then
                raise
            with self._lock:
                entry = self._entries.get(key)
                self._count_hit(key, entry, job)
                if entry is not None:
                    entry.pins += 1
                    result = entry.array
            return self._copy_out(result, entry)

    def _check_hit(self, spec: ChunkSpec, entry: _Entry, check: Callable[[ChunkSpec], None]) -> None:
        try:
            check(spec)
        except BaseException:
            with self._lock:
                entry.pins -= 1
            raise

    def get_cached(self, specs: Iterable[ChunkSpec]) -> list[Any]:
        """Copies of the chunks of ``specs`` that are cached now (``None`` for the others).

        Like a ``get`` hit for each cached chunk (counted as hits), but the copies are
        issued together and waited for once: a recompute over cached data is bound by the
        device's copy rate, not by one stream synchronisation per chunk.
        """
        specs = list(specs)
        found = self._pin_cached(specs)
        out: list[Any] = [None] * len(specs)
        try:
            with own_stream(self.device):  # done before they are handed out: valid on any stream
                for i, entry in enumerate(found):
                    if entry is not None:
                        out[i] = self._alloc_like(entry.array)
                        out[i][...] = entry.array
        finally:
            self._unpin(found)
        return out

    def visit(self, specs: Iterable[ChunkSpec], use: Callable[[ChunkSpec, Any], None],
              after: Callable[[], None] | None = None) -> list[ChunkSpec]:
        """Call ``use(spec, array)`` on each chunk of ``specs`` cached now, in place; the others are returned.

        For readers that only read a chunk (a reduction folding it into its result): no copy
        is made. ``array`` is the cache's own: ``use`` must not write into it or keep it.
        ``after()`` runs once every ``use`` has, before the entries may be evicted again: the
        work reading them must be finished on every stream by then (e.g. its stream waited
        for). Each chunk visited counts as a hit.
        """
        specs = list(specs)
        found = self._pin_cached(specs)
        try:
            for spec, entry in zip(specs, found):
                if entry is not None:
                    use(spec, entry.array)
        finally:
            try:
                if after is not None:
                    after()
            finally:
                self._unpin(found)
        return [spec for spec, entry in zip(specs, found) if entry is None]

    def _pin_cached(self, specs: list[ChunkSpec]) -> list[_Entry | None]:
        """The entries of ``specs`` cached now (``None`` for the others), each counted as a hit and
        pinned (not evicted) until ``_unpin``."""
        found: list[_Entry | None] = []
        with self._lock:
            for spec in specs:
                entry = self._entries.get(spec.key)
                if entry is not None:
                    self._count_hit(spec.key, entry, None)
                    entry.pins += 1
                found.append(entry)
        return found

    def _unpin(self, found: list[_Entry | None]) -> None:
        with self._lock:
            for entry in found:
                if entry is not None:
                    entry.pins -= 1

    def get_region(self, spec: ChunkSpec, load: Loader, region: tuple, out: Any = None,
                   check: Callable[[ChunkSpec], None] | None = None) -> Any:
        """``get(spec, load)[region]`` as the caller's own array, copying only ``region`` on a hit.

        For viewers: one plane of a cached chunk is copied out, not the whole chunk
        (``get`` copies all of it). A miss loads and caches the chunk as ``get`` does.
        ``out``, when given (an array of the region's shape, e.g. a view into a larger
        region the caller assembles), receives the region and is returned: the one copy
        a region of several chunks needs. Either way the bytes are in place, on every
        stream, when this returns (docs/streams.md). ``check(spec)`` runs before a cached copy
        is served, as in ``get``; what it raises refuses it.
        """
        with self._lock:
            entry = self._entries.get(spec.key)
            if entry is not None:
                self._count_hit(spec.key, entry, None)
                entry.pins += 1
        if entry is not None:
            if check is not None:
                self._check_hit(spec, entry, check)
            if out is None:
                return self._copy_out(entry.array[region], entry)
            try:
                with own_stream(self.device):
                    out[...] = entry.array[region]
            finally:
                with self._lock:
                    entry.pins -= 1
            return out
        chunk = self.get(spec, load, check)
        if out is None:
            return chunk[region]
        with own_stream(self.device):
            out[...] = chunk[region]
        return out

    def read_into(self, spec: ChunkSpec, out: Any) -> bool:
        """Copy the cached chunk ``spec`` into ``out`` if it is cached.

        Parameters
        ----------
        spec
            The chunk.
        out
            An array of ``spec.shape`` and ``spec.out_dtype`` on this cache's device.

        Returns
        -------
        bool
            ``True`` (and one hit counted) when it was cached and copied; ``False``
            (nothing counted, ``out`` untouched) otherwise.
        """
        if tuple(out.shape) != tuple(spec.shape) or np.dtype(out.dtype) != spec.out_dtype:
            raise ValueError(f"read_into: out has shape {tuple(out.shape)} and dtype {out.dtype}, "
                             f"but chunk {spec.index or spec.key} is {tuple(spec.shape)} {spec.out_dtype}")
        key = spec.key
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            self._count_hit(key, entry, None)
            entry.pins += 1
        try:
            with own_stream(self.device):
                self.device.xp.copyto(out, entry.array)
        finally:
            with self._lock:
                entry.pins -= 1
        return True

    def prefetch(self, specs: Iterable[ChunkSpec], load: Loader, start: Starter | None = None, *,
                 keep: bool = True) -> int:
        """Start warming ``specs`` in the background; returns at once.

        Chunks already cached (their LRU position is refreshed), in flight or queued
        are skipped, as are chunks larger than the capacity.

        Without ``start``, the chunks are queued for worker threads (config ``"threads"``,
        at most 8, started on first use) that call ``load``. With ``start``
        (``ChunkSource.start``), ``start(specs)`` submits the reads of every chunk that has
        room right here, in the calling thread, and returns pending reads that finish
        without any Python thread of ours: the first ``get`` of a chunk (or ``poll``)
        finishes it. Worker threads need the GIL for every chunk, so a thread busy in
        Python (a launch-bound compute) would starve them; ``start`` does not.

        ``keep=False`` (with ``start`` only): the chunks are read ahead for one use. The
        first ``get`` of each takes the array read as it is, with no copy, and the cache
        keeps nothing of it (room is held for it only while it is read). For a pass over
        more bytes than the cache holds, whose chunks an LRU would evict before any reuse.

        Returns
        -------
        int
            How many chunks were queued or started.
        """
        if start is not None:
            return self._prefetch_started(specs, start, keep)
        queued = 0
        with self._lock:
            if self._closed:
                return 0
            for spec in specs:
                if self._wanted(spec, reserve=False):
                    self._queue[spec.key] = (spec, load)
                    queued += 1
            if queued:
                self._start_workers()
                self._wake.notify(queued)
        return queued

    def cancel(self, specs: Iterable[ChunkSpec] | None = None) -> int:
        """Drop queued prefetches (all of them when ``specs`` is ``None``).

        Loads already running finish. Returns how many queued prefetches were dropped.
        """
        with self._lock:
            if specs is None:
                n = len(self._queue)
                self._queue.clear()
            else:
                n = sum(self._queue.pop(s.key, None) is not None for s in specs)
            self._counts["cancelled"] += n
        self._settle_started(None if specs is None else {s.key for s in specs}, keep=True)
        return n

    def poll(self) -> int:
        """Finish the started prefetches whose reads are complete (never blocks); how many
        (those started with ``keep=False`` are only moved on: their ``get`` finishes them).

        Called by ``gpulazy.prefetch`` as each task starts, so their chunks are cached
        and their copies to the device issued before a task asks for them.
        """
        with self._lock:
            started = [(k, j) for k, j in self._jobs.items() if j.pending is not None and j.pending is not _SUBMITTING]
        n = 0
        moving = True
        for key, job in started:
            pending = job.pending
            if pending is None:
                continue
            if not job.keep:
                # Left to its ``get``, which takes it as it is; ``done()`` only moves it on (issues its
                # staged copy once its bytes are in). Reads land about in the order started: those
                # after the first still reading are moved on by a later poll, and one that said it
                # was done is asked no more (each ``done()`` took ~16 us of the scheduler's thread on
                # an H100 host, and was asked of every read in flight at every task).
                if not job.landed and moving:
                    job.landed = moving = pending.done()
                continue
            if not pending.done():
                continue
            with self._lock:
                if job.pending is not pending:
                    continue  # claimed meanwhile
                job.pending = None
            self._finish_started(key, job, pending)
            n += 1
        return n

    def _wanted(self, spec: ChunkSpec, *, reserve: bool) -> bool:
        """Whether to prefetch ``spec`` (lock held): not cached, in flight or queued, and room
        for it (held for it now when ``reserve``). A cached chunk moves to the young end."""
        key = spec.key
        if key in self._entries:
            self._entries.move_to_end(key)  # wanted soon: evict it last
            return False
        if key in self._jobs or key in self._queue:
            return False
        nbytes = spec.out_nbytes
        if (nbytes > self._capacity or not self._readahead_room(nbytes)
                or (reserve and not self._reserve(nbytes, prefetch=True))):
            self._counts["prefetch_skipped"] += 1
            return False
        return True

    def _prefetch_started(self, specs: Iterable[ChunkSpec], start: Starter, keep: bool) -> int:
        with self._lock:
            if self._closed:
                return 0
            todo: list[tuple[ChunkSpec, _Job]] = []
            for spec in specs:
                if self._wanted(spec, reserve=True):
                    job = self._start_job(spec.key, prefetch=True)
                    job.reserved, job.keep, job.pending = spec.out_nbytes, keep, _SUBMITTING
                    todo.append((spec, job))
            if not todo:
                return 0
        # Submitted outside the lock: gets of other chunks go on meanwhile (a get of one of these
        # waits for its read to be attached). Under dask's threads the submitting thread may wait
        # milliseconds for the GIL after each CUDA call; holding the lock, every task asking for
        # its chunk waited with it.
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            pendings = start([spec for spec, _ in todo])
        except BaseException as e:  # recorded; a later get reads again and raises
            error, failed = e, todo
        else:
            failed = []
        with self._lock:
            if error is None:
                for (spec, job), pending in zip(todo, pendings):
                    job.pending, job.t0 = pending, t0
            else:
                for _, job in todo:
                    job.pending = None
                    self._reserved -= job.reserved
                    job.reserved = 0
            self._attached.notify_all()
        for spec, job in failed:
            self._fail(spec.key, job, error)
        if error is not None and not isinstance(error, Exception):
            raise error  # Ctrl-C or SystemExit while submitting: recorded, and on its way up
        return len(todo) - len(failed)

    def _finish_started(self, key: str, job: _Job, pending: Any) -> None:
        """Wait for a started read this thread has claimed, and cache it; errors are recorded."""
        reserved, job.reserved = job.reserved, 0
        try:
            array = pending.result()
        except BaseException as e:  # recorded; a later get reads again and raises
            with self._lock:
                self._reserved -= reserved
            self._fail(key, job, e)
            if not isinstance(e, Exception):
                raise  # Ctrl-C while waiting: never swallowed
            return
        try:  # ``_store`` gives the reservation back first, whatever happens after
            stored = self._store(pending.spec, array, time.perf_counter() - job.t0, job, reserved=reserved)
        except BaseException as e:
            self._fail(key, job, e)
            if not isinstance(e, Exception):
                raise
            return
        with self._lock:
            self._jobs.pop(key, None)
            if stored is not None:
                self._counts["prefetched"] += 1
        job.future.set_result(stored if stored is not None else array)

    def _hand_over(self, key: str, job: _Job, pending: Any) -> Any:
        """The array of a chunk read ahead for one use (``keep=False``), claimed by this ``get``:
        its own, uncached; a copy if other threads wait on it too. ``_FAILED`` if the read failed."""
        reserved, job.reserved = job.reserved, 0
        try:
            array = pending.result()
        except BaseException as e:  # recorded; the caller reads it again and raises then
            with self._lock:
                self._reserved -= reserved
            self._fail(key, job, e)
            if not isinstance(e, Exception):
                raise
            return _FAILED
        with self._lock:
            self._reserved -= reserved
            self._counts["loads"] += 1
            self._counts["bytes_read"] += pending.spec.nbytes
            self._counts["prefetched"] += 1
            self._read_seconds += time.perf_counter() - job.t0
            self._count_hit(key, None, job)
            if self._jobs.get(key) is job:
                del self._jobs[key]
            others = job.waiters - 1  # from now on a get of this chunk reads it again
        job.future.set_result(array)
        if others:
            return self._copy_out(array, None)  # the others copy from ``array``: it stays as read
        return array

    def _settle_started(self, keys: set | None, *, keep: bool) -> None:
        """Finish started prefetches (of ``keys``, or all): their reads write into buffers
        until they complete. ``keep``: cache them (else they are dropped; so are those started
        with ``keep=False``)."""
        with self._lock:
            while any(job.pending is _SUBMITTING for job in self._jobs.values()):
                self._attached.wait()  # another thread is submitting reads: settle them too
            claimed = []
            for key, job in self._jobs.items():
                if job.pending is not None and (keys is None or key in keys):
                    claimed.append((key, job, job.pending))
                    job.pending = None
        interrupted: BaseException | None = None
        for key, job, pending in claimed:
            if keep and job.keep:
                try:
                    self._finish_started(key, job, pending)
                except BaseException as e:  # Ctrl-C: settle the others first, then raise it
                    interrupted = interrupted or e
                continue
            try:
                pending.result()
            except BaseException as e:
                if not isinstance(e, Exception):
                    interrupted = interrupted or e
            with self._lock:
                self._reserved -= job.reserved
                job.reserved = 0
                if self._jobs.get(key) is job:
                    del self._jobs[key]
            job.future.set_exception(CancelledError(f"prefetch of {key} dropped: the cache was cleared"))
        if interrupted is not None:
            raise interrupted

    def shrink_readahead(self) -> float:
        """Halve the room read-ahead may take (after an out-of-memory); the new fraction."""
        with self._lock:
            self.readahead_fraction = max(self.readahead_fraction / 2, 1 / 64)
            return self.readahead_fraction

    def _readahead_room(self, nbytes: int) -> bool:
        # Lock held. Queued plus in-flight read-ahead stays within the (shrinkable) share.
        if self.readahead_fraction >= 1.0:
            return True
        queued = sum(s.out_nbytes for s, _ in self._queue.values())
        return self._reserved + queued + nbytes <= self.readahead_fraction * self._capacity

    def clear(self) -> None:
        """Drop every cached array and every queued prefetch (counters are kept)."""
        with self._lock:
            self._counts["cancelled"] += len(self._queue)
            self._queue.clear()
            self._entries.clear()
            self._held = 0
        self._settle_started(None, keep=False)

    def stats(self) -> dict[str, Any]:
        """A consistent snapshot of the counters, safe to call from any thread.

        Keys: ``name``, ``device``, ``capacity``, ``bytes_held``, ``bytes_reserved``
        (room held for prefetch reads in flight), ``entries``, ``hits``, ``misses``,
        ``hit_rate``, ``prefetched`` (chunks warmed by prefetch), ``prefetch_hits``
        (prefetched chunks later asked for), ``prefetch_skipped`` (no room, or larger
        than the capacity), ``evictions``, ``loads``, ``bytes_read`` (bytes of the
        specs loaded), ``read_seconds`` (time spent in ``load``), ``queued``,
        ``in_flight``, ``errors`` (failed loads), ``last_error``, ``cancelled``,
        ``closed``.
        """
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out.update(
                name=self.name,
                device=self.device.name,
                capacity=self._capacity,
                bytes_held=self._held,
                bytes_reserved=self._reserved,
                entries=len(self._entries),
                read_seconds=self._read_seconds,
                queued=len(self._queue),
                in_flight=len(self._jobs),
                last_error=self._last_error,
                closed=self._closed,
            )
        looked = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / looked if looked else 0.0
        return out

    def reset_stats(self) -> None:
        """Zero the counters (what is cached stays)."""
        with self._lock:
            self._counts = dict.fromkeys(_COUNTERS, 0)
            self._read_seconds = 0.0
            self._last_error: str | None = None

    def close(self) -> None:
        """Drop everything, stop the prefetch threads and leave the registry.

        Safe to call twice and from ``atexit``; waits at most about a second for
        threads inside a load (they are daemons and finish that load alone).
        """
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._entries.clear()
            self._held = 0
            self._wake.notify_all()
            threads, self._threads = self._threads, []
        self._settle_started(None, keep=False)
        deadline = time.monotonic() + _JOIN_SECONDS
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        _unregister(self)

    # --- loading and storing ------------------------------------------------

    def _start_job(self, key: str, *, prefetch: bool) -> _Job:
        job = _Job(prefetch)
        self._jobs[key] = job
        self._queue.pop(key, None)  # asked for now: no need to prefetch it
        return job

    def _count_hit(self, key: str, entry: _Entry | None, job: _Job | None) -> None:
        # Called with the lock held. A prefetched chunk counts one prefetch hit, the
        # first time a get is served by it (from the cache or by waiting on its load).
        self._counts["hits"] += 1
        if entry is not None:
            self._entries.move_to_end(key)
        first_use = False
        if entry is not None and entry.prefetched:
            entry.prefetched = False
            first_use = job is None or not job.used
        elif entry is None and job is not None and job.prefetch and not job.used:
            first_use = True
        if job is not None:
            job.used = job.used or job.prefetch
        if first_use:
            self._counts["prefetch_hits"] += 1

    def _alloc_like(self, array: Any) -> Any:
        """A hand-out array for a copy of ``array`` (the consumer's memory pool: ``Device.alloc``)."""
        order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
        return self.device.alloc(array.shape, array.dtype, order)

    def _copy_out(self, array: Any, entry: _Entry | None) -> Any:
        try:
            with own_stream(self.device):  # done before it is handed out: valid on any stream
                out = self._alloc_like(array)
                out[...] = array
                return out
        finally:
            if entry is not None:
                with self._lock:
                    entry.pins -= 1

    def _load_for_get(self, spec: ChunkSpec, load: Loader, job: _Job) -> Any:
        key = spec.key
        try:
            t0 = time.perf_counter()
            array = load(spec)
            seconds = time.perf_counter() - t0
            cached = self._store(spec, array, seconds, job, reserved=0)
        except BaseException as e:
            self._fail(key, job, e)
            raise
        with self._lock:
            self._jobs.pop(key, None)
            waiters = job.waiters
        job.future.set_result(cached if cached is not None else array)
        if cached is None and waiters:
            # Waiters copy from ``array``: the caller gets its own copy, not ``array``.
            return self._copy_out(array, None)
        return array

    def _fail(self, key: str, job: _Job, error: BaseException) -> None:
        with self._lock:
            if self._jobs.get(key) is job:
                del self._jobs[key]
            self._counts["errors"] += 1
            self._last_error = f"{type(error).__name__}: {error}"
        job.future.set_exception(error)

    def _store(self, spec: ChunkSpec, array: Any, seconds: float, job: _Job, reserved: int) -> Any:
        """Cache ``array`` (or a compact copy) if room can be made; the cached array or ``None``.

        ``reserved`` bytes, held for this load beforehand, are given back first.
        """
        nbytes = int(array.nbytes)
        with self._lock:
            self._reserved -= reserved
            self._counts["loads"] += 1
            self._counts["bytes_read"] += spec.nbytes
            self._read_seconds += seconds
            if self._closed or not self._reserve(nbytes, prefetch=job.prefetch):
                return None
        # A get hands ``array`` to its caller, so the cache keeps a copy; a prefetch
        # keeps ``array`` itself unless it holds more memory than its bytes.
        try:
            if job.prefetch and _is_compact(array):
                stored = array
            else:
                with own_stream(self.device):  # other threads' streams read this entry: wait for the copy
                    stored = array.copy(order="K")
                _count_copy()
        except MemoryError:  # CuPy's OutOfMemoryError too: the caller still gets its array
            with self._lock:
                self._reserved -= nbytes
            return None
        except BaseException:
            with self._lock:
                self._reserved -= nbytes
            raise
        with self._lock:
            self._reserved -= nbytes
            if self._closed:
                return None
            self._entries[spec.key] = _Entry(stored, nbytes, prefetched=job.prefetch and not job.used)
            self._held += nbytes
        return stored

    def _reserve(self, nbytes: int, *, prefetch: bool) -> bool:
        """Hold ``nbytes`` of room, evicting as needed (lock held). False if it cannot."""
        if nbytes > self._capacity:
            return False
        while self._held + self._reserved + nbytes > self._capacity:
            victim = self._victim(prefetch)
            if victim is None:
                return False
            entry = self._entries.pop(victim)
            self._held -= entry.nbytes
            self._counts["evictions"] += 1
        self._reserved += nbytes
        return True

    def _victim(self, prefetch: bool) -> str | None:
        # Least recently used first, among entries not being copied out and not
        # awaiting their first use. A prefetch never displaces a prefetched chunk;
        # a demand read may, newest prefetch first (it is the one needed last).
        for key, entry in self._entries.items():
            if not entry.pins and not entry.prefetched:
                return key
        if prefetch:
            return None
        for key, entry in reversed(self._entries.items()):
            if not entry.pins:
                return key
        return None

    # --- prefetch workers ---------------------------------------------------

    def _start_workers(self) -> None:
        # Lock held. Threads start once, on the first prefetch. They hold the cache only
        # weakly while idle, so a cache nobody references is freed (and its threads end).
        if self._threads:
            return
        n = max(1, min(int(config.get("threads")), _MAX_WORKERS))
        ref = weakref.ref(self)
        for i in range(n):
            t = threading.Thread(target=_prefetch_worker, args=(ref, self._wake, self.device),
                                 name=f"gpulazy-cache-{self.name}-{i}", daemon=True)
            self._threads.append(t)
            t.start()

    def _take_prefetch(self) -> tuple[ChunkSpec, Loader, _Job, int] | None | bool:
        """A queued prefetch that needs a load and has room; ``None`` when there is none now,
        ``False`` when closed. Lock held.

        Loads in flight hold at most config ``prefetch_inflight`` bytes (one load always may
        run): the workers' reads share the backend's queue and the host's memory bandwidth
        with the reads someone waits on, and each takes a staging buffer. A napari jump on an
        8 GiB raw volume started five 128 MiB chunk loads at once, and the plane after it
        waited 59-95 ms on an H100 where the steps around it took 10-15.
        """
        while True:
            if self._closed:
                return False
            if not self._queue:
                return None
            key, (spec, load) = next(iter(self._queue.items()))
            if key in self._entries or key in self._jobs:
                del self._queue[key]
                continue
            nbytes = spec.out_nbytes
            if self._loading and self._loading + nbytes > config.get("prefetch_inflight"):
                return None  # a load that ends wakes a worker (``_prefetch_one``)
            del self._queue[key]
            if not self._reserve(nbytes, prefetch=True):
                self._counts["prefetch_skipped"] += 1
                continue
            self._loading += nbytes
            return spec, load, self._start_job(key, prefetch=True), nbytes

    def _prefetch_one(self, spec: ChunkSpec, load: Loader, job: _Job, reserved: int) -> None:
        try:
            self._load_one(spec, load, job, reserved)
        finally:
            with self._wake:
                self._loading -= reserved
                if self._queue:
                    self._wake.notify()

    def _load_one(self, spec: ChunkSpec, load: Loader, job: _Job, reserved: int) -> None:
        try:
            t0 = time.perf_counter()
            array = load(spec)
            seconds = time.perf_counter() - t0
        except BaseException as e:  # recorded; a later get reads again and raises
            with self._lock:
                self._reserved -= reserved
            self._fail(spec.key, job, e)
            return
        try:
            stored = self._store(spec, array, seconds, job, reserved=reserved)
        except BaseException as e:
            self._fail(spec.key, job, e)
            return
        job.future.set_result(stored if stored is not None else array)
        with self._lock:
            self._jobs.pop(spec.key, None)
            if stored is not None:
                self._counts["prefetched"] += 1


def _count_copy() -> None:
    """A chunk copied into the cache after its read (``gpulazy.stats()["buffers"]["copies"]``)."""
    from gpulazy.stats import default_stats

    default_stats().record_buffer("copies")


def _prefetch_worker(ref: weakref.ref, wake: threading.Condition, device: Device) -> None:
    """A prefetch thread: loads queued chunks; holds its cache only while it has work."""
    with device.activate():
        while True:
            with wake:
                while True:
                    cache = ref()
                    if cache is None:
                        return
                    task = cache._take_prefetch()
                    if task is False:
                        return
                    if task is not None:
                        break
                    del cache  # idle: not holding it lets a dropped cache be freed
                    wake.wait()
            cache._prefetch_one(*task)
            del cache, task  # nothing it loaded outlives the task in this frame


# --- the registry --------------------------------------------------------------

# Weak: a cache nobody holds (no variable, no array reading through it) is freed. Default
# caches, and caches made in this process from a reference (a dask.distributed worker's),
# are also kept in ``_kept``: nothing else holds them between tasks.
_registry: weakref.WeakValueDictionary[str, DeviceCache] = weakref.WeakValueDictionary()
_kept: dict[str, DeviceCache] = {}
_registry_lock = threading.RLock()


def _register(cache: DeviceCache) -> None:
    with _registry_lock:
        other = _registry.get(cache.name)
        if other is not None and not other.closed:
            raise ValueError(f"a DeviceCache named {cache.name!r} already exists in this process; "
                             f"use gpulazy.cache.cache_by_name({cache.name!r}) or another name")
        _registry[cache.name] = cache
    # Wakes its idle prefetch threads once it is collected, so they end too.
    weakref.finalize(cache, _wake_all, cache._wake)


def _wake_all(wake: threading.Condition) -> None:
    with wake:
        wake.notify_all()


def _unregister(cache: DeviceCache) -> None:
    with _registry_lock:
        if _registry.get(cache.name) is cache:
            del _registry[cache.name]
        if _kept.get(cache.name) is cache:
            del _kept[cache.name]


def open_caches() -> list[DeviceCache]:
    """Every open cache in this process (the default caches included)."""
    with _registry_lock:
        return [c for c in _registry.values() if not c.closed]


def cache_by_name(name: str) -> DeviceCache:
    """The open cache called ``name`` in this process.

    Raises
    ------
    KeyError
        No open cache has that name here.

    Examples
    --------
    >>> c = DeviceCache("1 MiB", device="cpu", name="doc-example")
    >>> cache_by_name("doc-example") is c
    True
    >>> c.close()
    """
    with _registry_lock:
        cache = _registry.get(name)
    if cache is None:
        raise KeyError(f"no DeviceCache named {name!r} in this process; create it with "
                       f"DeviceCache(capacity, name={name!r}) or pass the cache object itself")
    return cache


@dataclass(frozen=True, slots=True)
class CacheRef:
    """A cache by name, capacity and device: resolves to the cache of that name in
    this process, creating it there (once) if it is not yet; so a task carrying it
    runs on any dask.distributed worker, each with its own cache.

    In the process that made it, it also holds the cache itself (not pickled, not part of
    its value): an array reading through a cache keeps it alive, and a cache dropped with
    every array over it is freed.
    """

    name: str
    capacity: int | str
    device: str
    local: Any = field(default=None, compare=False, hash=False, repr=False)

    def resolve(self) -> DeviceCache:
        if self.local is not None and not self.local.closed:
            return self.local
        return _cache_ref(self.name, self.capacity, self.device)

    def __reduce__(self):
        return (CacheRef, (self.name, self.capacity, self.device))

    def __dask_tokenize__(self):
        return ("gpulazy.CacheRef", self.name, self.capacity, self.device)


def _cache_ref(name: str, capacity: int | str, device: str) -> DeviceCache:
    """Unpickle a cache reference: the cache of that name, created (and kept) here if it is not yet."""
    with _registry_lock:
        cache = _registry.get(name)
        if cache is None:
            cache = _kept[name] = DeviceCache(capacity, device=device, name=name)
        return cache


def default_cache(device: str | Device | None = None) -> DeviceCache | None:
    """The process-wide cache for ``device``, sized by config ``"cache"``; ``None`` if that is off.

    It is created on first use (a ``"25%"`` capacity is 25 % of the device's free
    memory then) and registered as ``"default-<device>"``. The default cache follows
    the config: when ``"cache"`` has changed since it was created, the old default
    cache is closed (its memory freed; loads still running read through) and a new
    one is made with the new capacity; ``cache=False`` closes it and returns ``None``.
    Arrays read through the default cache look it up per chunk, so they all move to
    the new one.

    Examples
    --------
    >>> import gpulazy
    >>> with gpulazy.config.set(cache="1 MiB"):
    ...     default_cache("cpu").capacity
    1048576
    >>> with gpulazy.config.set(cache=False):
    ...     default_cache("cpu") is None
    True
    """
    spec = config.get("cache")
    dev = get_device(device)
    name = f"default-{dev.name}"
    with _registry_lock:
        current = _registry.get(name)
        if current is not None and spec is not False and current._capacity_spec == spec:
            return current
        if current is not None:
            current.close()
        if spec is False:
            return None
        cache = _kept[name] = DeviceCache(spec, device=dev, name=name)
        return cache


def _close_all() -> None:
    with _registry_lock:
        caches = list(_registry.values())
    for cache in caches:
        cache.close()


atexit.register(_close_all)
