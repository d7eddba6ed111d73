"""What a chunk task runs: ``ChunkSource`` (where a task reads through) and the task functions.

Every chunk task is ``load_chunk(spec, source)``: ``spec`` says where the bytes are,
``source`` (a small picklable value) says which device, backend and cache to use in
whatever process runs the task. When a compute culls the graph, the reads it needs are
grouped into ``read_batch`` tasks with a ``pick`` per chunk (``gpulazy._readlayer``). The
prefetch planner recognises read tasks by these functions. They sit below the graph code
(``gpulazy.array``), the read layer and the prefetcher, so all of those import them and none
imports the others back.

Streams: a chunk a task returns is complete on every CUDA stream and thread (docs/streams.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable

from gpulazy import config
from gpulazy.device import get_device
from gpulazy.spec import ChunkSpec

__all__ = ["ChunkSource", "load_chunk", "read_batch", "pick"]


@dataclass(frozen=True, slots=True)
class ChunkSource:
    """Where a chunk task reads through, resolved in the process that runs it.

    ``device``: ``"cpu"`` or ``"cuda:N"``; ``backend``: a backend name or ``None`` for
    ``"auto"``; ``cache``: a ``CacheRef`` (made anew in a process that lacks it), a
    ``DeviceCache`` name, ``None`` for the default cache, or ``False`` for no cache;
    ``verify``: check stored bytes against their checksums (reads then bypass the cache);
    ``lane``: ``"bulk"``, or ``"view"`` for reads a viewer waits on, which then never queue
    behind read-ahead (``gpulazy.io.get_backend``; ``ChunkSource.for_viewer``).
    """

    device: str
    backend: str | None = None
    cache: Any = None
    verify: bool = False
    lane: str = "bulk"

    def backend_instance(self):
        from gpulazy.io import get_backend

        return get_backend(self.backend, self.device, lane=self.lane)

    def for_viewer(self) -> ChunkSource:
        """This source with its reads in the view lane (same files, device and cache)."""
        return self if self.lane == "view" else replace(self, lane="view")

    def cache_instance(self):
        """The ``DeviceCache`` this source reads through, or ``None``."""
        if self.cache is False or self.verify:  # a cached chunk may not have been verified
            return None
        from gpulazy.cache import cache_by_name, default_cache

        if self.cache is None:
            return default_cache(self.device)
        if isinstance(self.cache, str):
            return cache_by_name(self.cache)
        return self.cache.resolve()

    def read(self, spec: ChunkSpec) -> Any:
        """Read ``spec`` from its files through the engine, bypassing any cache (files' identities
        checked around the read, stored bytes verified with ``verify``; staged: see config ``staging``)."""
        from gpulazy.read import read

        return read([spec], self.backend_instance(), verify=self.verify,
                    staged=config.get("staging") != "never")[0]

    def start(self, specs: list[ChunkSpec]) -> list[Any]:
        """Start reading ``specs`` now, from this thread, in one engine submission, bypassing any
        cache (for read-ahead).

        Returns one pending read per chunk (``gpulazy.read.PendingChunk``): ``done()`` never
        blocks, ``result()`` waits and returns the chunk's array, checked as ``read`` checks it.
        """
        from gpulazy.read import start

        reads = start(list(specs), self.backend_instance(), verify=self.verify,
                      staged=config.get("staging") != "never")
        return [reads.pending(i) for i in range(len(reads))]

    def load_many(self, specs: tuple[ChunkSpec, ...]) -> list[Any]:
        """Several chunks' arrays: cached ones from the cache, the others read in one batch.

        The chunks read are offered to the cache afterwards (kept when there is room).
        Every array returned is complete on every stream: staged copies and byte swaps ran
        on this thread's ``gpulazy_stream``, which was waited for.

        Examples
        --------
        >>> import gpulazy, numpy as np, tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "a.raw"); np.arange(8, dtype="u1").tofile(p)
        >>> vol = gpulazy.from_files(p, dtype="u1", chunks=4, device="cpu", cache=False)
        >>> [a.tolist() for a in vol.chunk_source.load_many(tuple(vol.chunk_index.specs.values()))]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        """
        return self.start_many(specs).result()

    def start_many(self, specs: tuple[ChunkSpec, ...]) -> Any:
        """``load_many`` in two halves: the reads start now, ``.result()`` waits for them.

        Returns a ``gpulazy.read.cached.CachedBatch``; see there.
        """
        from gpulazy.read.cached import CachedBatch

        return CachedBatch.start(self, specs)

    def load(self, spec: ChunkSpec) -> Any:
        """The chunk's array, through the cache when there is one."""
        from gpulazy.memory import retry_on_oom
        from gpulazy.read.engine import reading

        cache = self.cache_instance()
        what = reading([spec])
        if cache is None:
            return retry_on_oom(lambda: self.read(spec), device=get_device(self.device), nbytes=spec.out_nbytes,
                                what=what)
        from gpulazy.integrity import check_unchanged

        # A cached chunk of a file changed since indexing is never served; a chunk read now is
        # checked by its read (one stat a chunk fewer under read-ahead).
        return retry_on_oom(lambda: cache.get(spec, self.read, check_unchanged), device=cache.device,
                            nbytes=spec.out_nbytes, what=what)

    def prefetch(self, specs: Iterable[ChunkSpec]) -> None:
        """Warm ``specs`` into the cache in the background (no-op without a cache)."""
        cache = self.cache_instance()
        if cache is not None:
            cache.prefetch(specs, self.read)


def load_chunk(spec: ChunkSpec, source: ChunkSource) -> Any:
    """The dask task that produces one chunk (complete on every stream when it returns)."""
    return source.load(spec)


def read_batch(specs: tuple[ChunkSpec, ...], source: ChunkSource, window: Any = None, j: int = 0) -> Any:
    """The dask task that reads several chunks in one submission (see ``gpulazy._readlayer``).

    ``window``: the compute's ``gpulazy.read.window.ReadWindow``, which may have started
    this batch (``j``) already and starts the next ones. With it, returns at once the
    batch in flight (a ``CachedBatch``), and each ``pick`` task waits for its own
    chunk only. ``None`` (a ``dask.distributed`` worker: a batch in flight cannot travel
    to another worker) reads this batch alone and returns its arrays in order, each
    complete on every stream (``ChunkSource.load_many``).
    """
    if window is None:
        return source.load_many(specs)
    return window.claim(j)


def pick(batch: Any, i: int) -> Any:
    """Chunk ``i`` of a ``read_batch`` result: the task that stands for one chunk's read."""
    if isinstance(batch, list):
        return batch[i]
    return batch.chunk(i)
