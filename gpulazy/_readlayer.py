"""``ReadLayer``: the read tasks of one gpulazy array, batched when a compute culls them.

Imports Dask, so ``gpulazy.array`` imports it only when it builds a graph.
"""

from __future__ import annotations

import hashlib
from typing import Any

from dask._task_spec import DataNode, Task, TaskRef
from dask.highlevelgraph import MaterializedLayer

from gpulazy import config
from gpulazy.read.window import ReadWindow
from gpulazy._tasks import pick, read_batch

__all__ = ["ReadLayer", "ReadTask"]


class ReadTask(Task):
    """The task that reads a chunk (``load_chunk``) or hands it out of its batch (``pick``): never fused.

    Dask's linear fusion (``fuse_linear_task_spec``) would merge a chunk's read with the one task
    that uses it (a ``map_blocks``, an elementwise op, a cast) into a task named after both, and
    keep the old key as an ``Alias``, a task of its own. A fused task runs its subgraph through
    ``execute_graph``, which maps the subgraph's dependencies and orders it (``dask.order``) every
    time. So a chunk cost a fused task and an alias; as a task of its own it costs two plain
    tasks, which is less: on an H200 host a ``map_blocks`` over 64 chunks of 16 MiB took 0.76-0.86
    of the time, sync and threaded schedulers alike, under ``gpulazy.prefetch`` 0.70-0.99 (against a
    tree that folded the aliases away), and chains of several operations after the read as before,
    0.81-1.09 (``benchmarks/fusion_ab.py``; benchmarks/RESULTS.md, twenty-fourth session).
    """

    __slots__ = ()

    @property
    def block_fusion(self) -> bool:
        return True


def _prefetch_registered() -> bool:
    """Whether a ``gpulazy.prefetch`` is active (``with gpulazy.prefetch():``) as dask culls.

    (A prefetch passed as ``compute(callbacks=[p])`` is not visible yet when the graph is
    culled; the batches stay, and it gives their ``ReadWindow`` the order dask runs them in.)
    """
    from dask.callbacks import Callback

    from gpulazy._hooks import _is_prefetch

    return any(_is_prefetch(cb) for cb in Callback.active)

_MIN_BATCHES = 8


def _batch_name(array: str, mine: list, limit: int) -> str:
    """The batch tasks' name: a function of the keys culled (and the batch limit), nothing else.

    A chunk's key must always name the same task: ``dask.distributed`` keeps the first
    task it was given for a key while that key is alive and warns ("Detected different
    `run_spec`") when a later graph gives it other dependencies, which can deadlock. The
    grouping is a function of ``mine`` and ``limit`` (and of the specs, which the array's
    name already hashes), so the same keys give the same batches and the same picks.
    """
    tag = hashlib.blake2b(repr((limit, mine)).encode(), digest_size=8).hexdigest()
    return f"read-batch-{array}-{tag}"


def _window(batches: list, sources: list) -> ReadWindow | None:
    """One ``ReadWindow`` over the batches (``None`` when read-ahead is off or sources differ)."""
    ahead = int(config.get("read_ahead"))
    if ahead <= 0 or any(s != sources[0] for s in sources):
        return None
    return ReadWindow(batches, sources[0], ahead)


class ReadLayer(MaterializedLayer):
    """The read tasks of one array; culling groups the reads a compute needs into batches.

    Every compute of this array or of anything derived from it (a MIP, a slice, a cast,
    a reduction, ``map_blocks``) culls the graph first (dask's array optimisation,
    local and distributed alike). Here culling also replaces the needed
    ``load_chunk`` tasks by ``read_batch`` tasks, each reading up to config
    ``batch_size`` bytes of chunks (neighbours in block order, and at most 1/8 of the
    chunks needed) in one submission, and
    one ``pick`` task per chunk under the old key, so downstream tasks are unchanged.
    The batches are named from the keys culled: computing the same keys again (the same
    array, or another reduction over all of it) gives every key the same task, which
    ``dask.distributed`` requires of a key that is still alive (``_batch_name``).
    The batch tasks of one compute share a ``ReadWindow``: each batch is submitted whole,
    and each task starts the batches likely to run next, up to config ``read_ahead`` bytes
    (``gpulazy.read.window``). A batch task returns as soon as its batch is submitted;
    each ``pick`` waits for its own chunk.
    ``batch_size=0`` keeps a read task per chunk, as does an active ``gpulazy.prefetch``
    (it overlaps reads with compute chunk by chunk). (A layer dask merges into another,
    as ``fuse_roots`` does for blockwise operations over several inputs, is culled
    as an ordinary layer: one read per chunk, still correct.)
    """

    def cull(self, keys: set, all_hlg_keys: Any) -> tuple:
        limit = int(config.get("batch_size"))
        if limit > 0 and _prefetch_registered():
            limit = 0  # gpulazy.prefetch reads ahead chunk by chunk: batches would coarsen its window
        mine = ([k for k in self.mapping if k in keys] if len(keys) >= len(self.mapping)
                else [k for k in keys if k in self.mapping])
        if limit <= 0 or len(mine) < 2:
            return super().cull(keys, all_hlg_keys)
        mine.sort()
        # At least ~8 batches: reading one batch overlaps computing on the one before (threads,
        # or gpulazy.prefetch warming the next batch under the sync scheduler).
        most = max(2, -(-len(mine) // _MIN_BATCHES))
        groups: list[list] = [[]]
        size = 0
        for k in mine:
            nbytes = self.mapping[k].args[0].nbytes
            if groups[-1] and (size + nbytes > limit or len(groups[-1]) >= most):
                groups.append([])
                size = 0
            groups[-1].append(k)
            size += nbytes
        if len(groups) == len(mine):  # every chunk alone in its batch: nothing to gain
            return super().cull(keys, all_hlg_keys)
        bname = _batch_name(mine[0][0], mine, limit)
        batches = [tuple(self.mapping[k].args[0] for k in group) for group in groups]
        sources = [self.mapping[group[0]].args[1] for group in groups]
        window = _window(batches, sources)
        out: dict = {}
        for j, group in enumerate(groups):
            bkey = (bname, j)
            out[bkey] = Task(bkey, read_batch, DataNode(None, batches[j]), sources[j], DataNode(None, window),
                             j, _data_producer=True)
            for i, k in enumerate(group):
                out[k] = ReadTask(k, pick, TaskRef(bkey), i)
        return MaterializedLayer(out, annotations=self.annotations), {k: set() for k in out}
