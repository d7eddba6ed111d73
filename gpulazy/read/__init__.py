"""The read engine: the one place that plans, starts, waits for and settles reads.

- ``gpulazy.read.engine``: ``start(specs, backend, outs)`` -> ``Reads`` (one backend
  submission, decode of the whole batch into the destinations, hand-out);
- ``gpulazy.read.decode``: the decode step (plain chunks in place, stored pieces a batch
  per codec call);
- ``gpulazy.read.window``: a compute's read batches, each submitted whole, read ahead in the
  order dask runs them (``ReadWindow``);
- ``gpulazy.read.cached``: a batch read through a ``DeviceCache`` (hits served, misses
  read by the engine and offered to the cache);
- ``gpulazy.read.whole``: every chunk of an array into one preallocated result, a box off
  the chunk boundaries, and the in-order pipeline both use;
- ``gpulazy.read.reduce``: reductions folded chunk by chunk as the reads land.

Consumers (dask chunk tasks, the whole-array path, boxes, streamed reductions,
``read_file(s)``, prefetch, napari regions) give the engine specs and, where they own them,
the destinations.
"""

from gpulazy.read.engine import PendingChunk, Reads, read, start

__all__ = ["start", "read", "Reads", "PendingChunk"]
