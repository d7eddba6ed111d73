"""Read-ahead: warm the chunks a computation reads next into the cache they are read from.

Three layers, imports flowing one way (``plan`` at the bottom), so the policy can be
tested without a scheduler:

- ``plan``: ``ReadAheadPlan`` (pure Python) decides *what* to read next from an ordered
  list of chunk reads, a depth and a byte budget; ``find_reads`` finds chunk reads in
  dask tasks; ``ReadAhead`` wires a plan to the caches;
- ``local``: ``prefetch`` adapts it to Dask's local schedulers (``threads`` and
  ``sync``) as a scheduler callback: the run order is ``dask.order.order``'s (read from the
  scheduler's ready list when the reads are the graph's roots);
- ``distributed``: ``prefetch.install(client)`` adapts it to ``dask.distributed`` with a
  worker plugin that plans from the tasks the scheduler has handed that worker.

``gpulazy.prefetch`` (the package attribute) is the ``prefetch`` class, used like a
function; this package's names stay importable from ``gpulazy.prefetch``. No Dask import
at import time: ``import gpulazy`` imports this package.
"""

from __future__ import annotations

from gpulazy.prefetch.local import plan_graph, prefetch
from gpulazy.prefetch.plan import CACHE_FRACTION, ReadAhead, ReadAheadPlan, find_reads
from gpulazy.stream import Prefetcher

__all__ = ["ReadAheadPlan", "find_reads", "prefetch", "Prefetcher", "ReadAhead", "plan_graph", "CACHE_FRACTION"]
