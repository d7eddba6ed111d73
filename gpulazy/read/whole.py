"""Every chunk of an array read into one preallocated result (the fast whole-array path).

The result is allocated once; each chunk is a destination of the engine: cache hits are
copied in from the cache, misses read straight into their slice (decoded into it, for
chunks of stored pieces). Submissions of about ``GROUP`` bytes go out in order from this
thread; stored bytes waiting to decode are held to ``STAGED`` bytes (a submission is
finished before the next one would pass that), so reading the next group overlaps
decoding this one.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import Any

import numpy as np

from gpulazy.device import get_device
from gpulazy.spec import ChunkSpec

__all__ = ["read_whole", "read_all", "GROUP", "STAGED"]

GROUP = 256 << 20
STAGED = 512 << 20


def read_whole(specs: dict, source: Any, chunks: tuple, dtype: Any, order: str = "C", *,
               hooks: Any = None, name: str = "") -> Any:
    """Every chunk of ``specs`` read into one array with dask ``chunks`` on ``source``'s device.

    ``hooks`` (a ``gpulazy._hooks.FastPathHooks``) hears of each chunk task ``(name, *index)``
    as its read is submitted and as it lands. Hits are copied from ``source``'s cache; misses
    are not inserted in it. The first error is raised once every submitted read has settled.
    """
    from gpulazy.integrity import check_all_unchanged
    from gpulazy.memory import retry_on_oom

    dev = get_device(source.device)
    backend = source.backend_instance()
    cache = source.cache_instance()
    shape = tuple(sum(c) for c in chunks)
    edges = [list(itertools.accumulate(c, initial=0)) for c in chunks]
    with dev.activate():
        out = retry_on_oom(lambda: dev.alloc(shape, dtype, order), device=dev,
                           nbytes=math.prod(shape) * np.dtype(dtype).itemsize, what=f"allocating a {shape} result")
    check_all_unchanged(specs.values())  # nothing cached or read from a file changed since indexing
    todo: list[tuple[ChunkSpec, Any]] = []
    with dev.activate():
        for spec in specs.values():
            # (the Ellipsis keeps a 0-d result a view, not a scalar copy)
            view = out[tuple(slice(edges[a][i], edges[a][i + 1]) for a, i in enumerate(spec.index)) + (Ellipsis,)]
            if hooks:
                hooks.pretask((name, *spec.index))
            if view.size == 0 or (cache is not None and cache.read_into(spec, view)):
                if hooks:
                    hooks.posttask((name, *spec.index), view)
                continue
            todo.append((spec, view))
        _read_in_groups(todo, backend, source.verify, hooks, name)
    check_all_unchanged(specs.values())  # written to during the reads: bytes may be mixed
    return out


def _read_in_groups(todo: list[tuple[ChunkSpec, Any]], backend: Any, verify: bool, hooks: Any, name: str) -> None:
    """Read ``todo``'s chunks into their views, a submission per group, staged bytes bounded."""
    from gpulazy.read.engine import start

    inflight: deque = deque()
    staged = 0
    errors: list[BaseException] = []

    def finish(entry: tuple) -> int:
        reads, group, nbytes = entry
        reads.settle()
        for k, (spec, view) in enumerate(group):
            try:
                reads.chunk(k)
            except BaseException as e:  # kept; raised once every read has settled
                errors.append(e)
                continue
            if hooks:
                hooks.posttask((name, *spec.index), view)
        return nbytes

    for group in _groups(todo):
        if errors:
            break
        nbytes = sum(_staged_bytes(spec, view) for spec, view in group)
        while inflight and staged + nbytes > STAGED:
            staged -= finish(inflight.popleft())
        try:
            reads = start([s for s, _ in group], backend, [v for _, v in group], verify=verify, staged=False,
                          check=False)
        except BaseException as e:
            errors.append(e)
            break
        inflight.append((reads, group, nbytes))
        staged += nbytes
    while inflight:
        finish(inflight.popleft())
    if errors:
        raise errors[0]


def _groups(todo: list[tuple[ChunkSpec, Any]]) -> list[list[tuple[ChunkSpec, Any]]]:
    """Consecutive chunks in groups of about ``GROUP`` bytes read."""
    groups: list[list] = [[]]
    size = 0
    for item in todo:
        n = item[0].nbytes
        if groups[-1] and size + n > GROUP:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return [g for g in groups if g]


def _staged_bytes(spec: ChunkSpec, view: Any) -> int:
    """Bytes a chunk holds in a buffer of its own until it is finished (0 when it lands in place)."""
    from gpulazy.read.engine import byte_view

    if spec.is_assembled:
        return spec.nbytes
    flat = byte_view(view, spec.order)
    return 0 if flat is not None and flat.nbytes == spec.nbytes else spec.nbytes


def read_all(specs: list[ChunkSpec], backend: Any, verify: bool = False) -> list[Any]:
    """Whole files (``read_file(s)``): every read in flight before any is awaited."""
    from gpulazy.read.engine import read

    if verify:
        from gpulazy.checksums import require_checksums

        require_checksums(specs)
    with backend.device.activate():
        return read(specs, backend, verify=verify, staged=False)
