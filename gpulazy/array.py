"""``from_files`` and friends: chunk specs to a Dask array with CuPy (or NumPy) meta.

Every chunk task is ``load_chunk(spec, source)``: ``spec`` says where the bytes are,
``source`` (a small picklable value) says which device, backend and cache to use in
whatever process runs the task. The prefetcher recognises read tasks by that function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from gpulazy.spec import ChunkSpec

__all__ = ["from_files", "read_file", "read_files", "ChunkSource", "load_chunk"]


@dataclass(frozen=True, slots=True)
class ChunkSource:
    """Where a chunk task reads through, resolved in the process that runs it.

    ``device``: ``"cpu"`` or ``"cuda:N"``; ``backend``: a backend name or ``None`` for
    ``"auto"``; ``cache``: a ``DeviceCache`` name, ``None`` for the default cache, or
    ``False`` for no cache.
    """

    device: str
    backend: str | None = None
    cache: str | None | bool = None

    def backend_instance(self):
        from gpulazy.io import get_backend

        return get_backend(self.backend, self.device)

    def cache_instance(self):
        """The ``DeviceCache`` this source reads through, or ``None``."""
        if self.cache is False:
            return None
        from gpulazy.cache import cache_by_name, default_cache

        if self.cache is None:
            return default_cache(self.device)
        return cache_by_name(self.cache)

    def read(self, spec: ChunkSpec) -> Any:
        """Read ``spec`` from its files, bypassing any cache."""
        from gpulazy.io import read_chunk

        return read_chunk(spec, self.backend_instance())

    def load(self, spec: ChunkSpec) -> Any:
        """The chunk's array, through the cache when there is one."""
        cache = self.cache_instance()
        if cache is None:
            return self.read(spec)
        return cache.get(spec, self.read)

    def prefetch(self, specs: Iterable[ChunkSpec]) -> None:
        """Warm ``specs`` into the cache in the background (no-op without a cache)."""
        cache = self.cache_instance()
        if cache is not None:
            cache.prefetch(specs, self.read)


def load_chunk(spec: ChunkSpec, source: ChunkSource) -> Any:
    """The dask task that produces one chunk."""
    return source.load(spec)


def from_files(*args, **kwargs):  # placeholder until the layouts land
    raise NotImplementedError


def read_file(*args, **kwargs):  # placeholder
    raise NotImplementedError


def read_files(*args, **kwargs):  # placeholder
    raise NotImplementedError
