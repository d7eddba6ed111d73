"""``ReadLayer``: the read tasks of one gpulazy array, batched when a compute culls them.

Imports Dask, so ``gpulazy.array`` imports it only when it builds a graph.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

from dask._task_spec import DataNode, Task, TaskRef
from dask.highlevelgraph import MaterializedLayer

from gpulazy import config
from gpulazy._batchread import ReadWindow
from gpulazy.array import pick, read_batch

__all__ = ["ReadLayer"]


def _prefetch_registered() -> bool:
    """Whether a ``gpulazy.prefetch`` is active (``with gpulazy.prefetch():``) as dask culls.

    (A prefetch passed as ``compute(callbacks=[p])`` is not visible yet when the graph is
    culled; the batches stay, and it gives their ``ReadWindow`` the order dask runs them in.)
    """
    from dask.callbacks import Callback

    from gpulazy._hooks import _is_prefetch

    return any(_is_prefetch(cb) for cb in Callback.active)

_MIN_BATCHES = 8
# Batch keys are new for every compute: a batch that failed must never be taken for the
# same key by a later compute (dask.distributed keeps an erred key while anything still
# refers to the failed compute, e.g. the exception a caller holds on to).
_next_id = itertools.count().__next__


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
    The batch tasks of one compute share a ``ReadWindow``: each batch is submitted whole,
    and each task starts the batches likely to run next, up to config ``read_ahead`` bytes
    (``gpulazy._batchread``). A batch task returns as soon as its batch is submitted;
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
        # Cheap for 100k keys; culling runs where the graph is submitted, so only that process names it.
        tag = hashlib.blake2b(repr((len(mine), mine[0], mine[-1], limit, _next_id())).encode(), digest_size=8).hexdigest()
        bname = f"read-batch-{mine[0][0]}-{tag}"
        batches = [tuple(self.mapping[k].args[0] for k in group) for group in groups]
        sources = [self.mapping[group[0]].args[1] for group in groups]
        window = _window(batches, sources)
        out: dict = {}
        for j, group in enumerate(groups):
            bkey = (bname, j)
            out[bkey] = Task(bkey, read_batch, DataNode(None, batches[j]), sources[j], DataNode(None, window),
                             j, _data_producer=True)
            for i, k in enumerate(group):
                out[k] = Task(k, pick, TaskRef(bkey), i)
        return MaterializedLayer(out, annotations=self.annotations), {k: set() for k in out}
