"""A batch of chunks read through a ``DeviceCache``: hits served now, misses read by the engine.

``CachedBatch.start`` copies out what the cache holds, leaves to the cache what one of its
prefetches is reading already (in-flight reads are never read twice), and starts one engine
submission for the rest, from the calling thread. ``result()`` waits for all of them;
``chunk(i)`` for one, so each ``pick`` task of a windowed batch waits for its own read only.
Chunks read here are offered to the cache as they are handed out, unless the batch is part of
a pass the cache cannot keep (``keep=False``: ``gpulazy.read.window``).
"""

from __future__ import annotations

from typing import Any

from gpulazy import config
from gpulazy.spec import ChunkSpec

__all__ = ["CachedBatch"]


class CachedBatch:
    """Chunks of one batch: served from the cache or in flight; ``result()`` gives their arrays."""

    __slots__ = ("source", "specs", "keep", "arrays", "held", "slot", "reads")

    def __init__(self, source: Any, specs: tuple[ChunkSpec, ...], keep: bool = True):
        self.source, self.specs, self.keep = source, specs, keep
        self.arrays: list[Any] = [None] * len(specs)
        self.held: list[int] = []       # chunks a prefetch of the cache is reading
        self.slot: dict[int, int] = {}  # chunk -> its place in ``reads``
        self.reads: Any = None          # the engine's ``Reads`` of the others

    @classmethod
    def start(cls, source: Any, specs: tuple[ChunkSpec, ...], *, keep: bool = True) -> CachedBatch:
        """Serve the cached chunks of ``specs`` and submit reads for the rest, from this thread.

        ``keep=False``: the chunks read are handed out as they were read, not offered to the cache
        (which would keep a copy of each, evicting older entries for it).
        """
        from gpulazy.integrity import check_all_unchanged

        self = cls(source, specs, keep)
        cache = source.cache_instance()
        if cache is not None:
            self.arrays = cache.get_cached(specs)
            # A cached chunk of a file changed since indexing is never served; the engine checks
            # the files of what it reads after the reads.
            check_all_unchanged([s for s, a in zip(specs, self.arrays) if a is not None])
        todo = []
        for i, spec in enumerate(specs):
            if self.arrays[i] is None:
                if cache is not None and cache.holds(spec):
                    self.held.append(i)
                else:
                    self.slot[i] = len(todo)
                    todo.append(spec)
        if todo:
            from gpulazy.read.engine import start_retrying

            self.reads = start_retrying(todo, source.backend_instance(), verify=source.verify,
                                        staged=config.get("staging") != "never")
        return self

    def result(self) -> list[Any]:
        """The arrays, in order, each complete on every stream; raises the first read's error."""
        if self.reads is not None:
            self.reads.settle()  # every read settles before any error is raised
        return [self.chunk(i) for i in range(len(self.specs))]

    def chunk(self, i: int) -> Any:
        """Chunk ``i``'s array as soon as its own read is in; the rest of the batch may still be reading.

        Safe from several threads at once (for different chunks, or the same one twice).
        """
        arr = self.arrays[i]
        if arr is not None:
            return arr
        source, spec = self.source, self.specs[i]
        cache = source.cache_instance()
        k = self.slot.get(i)
        if k is None:  # held: a prefetch of the cache is reading it
            return cache.get(spec, source.read)
        read = self.reads.chunk(k)
        return read if cache is None or not self.keep else cache.get(spec, lambda s, a=read: a)

