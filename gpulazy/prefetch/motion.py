"""Motion-aware read-ahead for viewers: follow a cursor stepping along an axis, warm what comes next.

A viewer shows one plane of a volume at a time. Its slider moves in recognisable ways:
single steps (arrow keys), drags (many events, several planes apart), playback (one plane
per frame) and jumps (a click far away). ``MotionPredictor`` is fed ``(time, index)``
events and estimates direction, speed and stride; ``upcoming`` lists the planes the
viewer will most likely ask for next. ``MotionPrefetch`` turns those planes into the
chunks of a gpulazy array and warms them into its device cache with the same window
rule as ``gpulazy.prefetch`` (``ReadAheadPlan``: at most half the cache's capacity
warmed and not yet shown), cancelling queued reads that left the window — all of them
on a jump. ``MotionPrefetch.claim`` puts the chunks of a plane the viewer is reading now,
and finds neither cached nor on their way, ahead of all of that.

Pure Python; no viewer is imported. ``napari_gpulazy`` feeds it from
``viewer.dims.events.current_step``.

>>> p = MotionPredictor(lead=0.1)   # warm 0.1 s ahead (at least `depth` planes)
>>> for t, i in [(0.0, 10), (0.05, 11), (0.10, 12)]:
...     _ = p.observe(t, i)
>>> p.direction, round(p.speed), p.upcoming(3, size=100)
(1, 20, [13, 14, 15])
>>> p.observe(0.15, 80)          # a jump: unknown direction, warm both sides
True
>>> p.direction, p.upcoming(4, size=100)
(0, [81, 79, 82, 78])
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import statistics
import threading
from collections import deque
from typing import Any, Callable, Sequence

from gpulazy.prefetch.plan import CACHE_FRACTION, ReadAheadPlan
from gpulazy.spec import ChunkSpec

__all__ = ["MotionPredictor", "MotionPrefetch", "plane_specs"]


class MotionPredictor:
    """Direction, speed and stride of a cursor moving along one axis, from its events.

    Parameters
    ----------
    window
        Seconds of history used for speed and stride; a gap longer than this between
        two events starts a new motion (the cursor rested).
    jump
        A move of more than ``jump`` planes *and* more than ``jump_factor`` times the
        recent stride is a jump: the motion so far says nothing about what comes next.
    jump_factor
        See ``jump``: a drag moves many planes per event without being a jump.
    lead
        Seconds ahead to warm at the current speed (at least ``depth`` planes in ``upcoming``).
    unsure
        Most planes ``upcoming`` lists while the direction is unknown (at rest, just after a
        jump): ``None`` for ``depth``. Warming ``depth`` planes on both sides of a jump starts
        reads on the side the cursor will not take, beside the planes it will ask for next.
    """

    def __init__(self, *, window: float = 1.0, jump: int = 8, jump_factor: float = 4.0, lead: float = 1.0,
                 unsure: int | None = None):
        self.window = float(window)
        self.jump = int(jump)
        self.jump_factor = float(jump_factor)
        self.lead = float(lead)
        self.unsure = None if unsure is None else max(1, int(unsure))
        self._track: deque[tuple[float, int]] = deque()   # (t, index) since the last jump or rest
        self._deltas: deque[tuple[float, int]] = deque()  # (t, |move|) of recent events, jumps too
        self.jumps = 0

    @property
    def position(self) -> int | None:
        """The last index observed."""
        return self._track[-1][1] if self._track else None

    def observe(self, t: float, index: int) -> bool:
        """Record that the cursor is at ``index`` at time ``t`` (seconds); True if that was a jump."""
        index = int(index)
        if not self._track:
            self._track.append((t, index))
            return False
        last_t, last_i = self._track[-1]
        move = index - last_i
        if move == 0:
            return False
        self._trim(t)
        stride = self._typical_stride()
        self._deltas.append((t, abs(move)))
        jumped = abs(move) > self.jump and abs(move) > self.jump_factor * stride
        if jumped:
            self.jumps += 1
            self._track.clear()
        elif t - last_t > self.window:
            self._track.clear()  # the cursor rested: a new motion starts here
        self._track.append((t, index))
        return jumped

    def _trim(self, now: float) -> None:
        while self._deltas and now - self._deltas[0][0] > self.window:
            self._deltas.popleft()
        while len(self._track) > 1 and now - self._track[0][0] > self.window:
            self._track.popleft()

    def _typical_stride(self) -> float:
        return statistics.median(d for _, d in self._deltas) if self._deltas else 1.0

    @property
    def speed(self) -> float:
        """Planes per second over the current motion (0 at rest or just after a jump)."""
        if len(self._track) < 2:
            return 0.0
        (t0, i0), (t1, i1) = self._track[0], self._track[-1]
        return abs(i1 - i0) / (t1 - t0) if t1 > t0 else 0.0

    @property
    def direction(self) -> int:
        """+1 forward, -1 backward, 0 unknown (at rest, just after a jump, or back and forth)."""
        if len(self._track) < 2:
            return 0
        net = self._track[-1][1] - self._track[0][1]
        return (net > 0) - (net < 0)

    @property
    def stride(self) -> int:
        """Planes per event in the current motion (a drag skips planes the viewer never shows)."""
        moves = [abs(b[1] - a[1]) for a, b in itertools.pairwise(self._track)]
        return max(1, round(statistics.median(moves))) if moves else 1

    def upcoming(self, depth: int, *, size: int) -> list[int]:
        """The planes to warm, most urgent first, within ``0 <= index < size``.

        Moving: ``max(depth, speed * lead / stride)`` positions ahead, ``stride`` apart.
        Otherwise (rest, jump, back and forth): ``depth`` planes (at most ``unsure``)
        alternating after and before the cursor.
        """
        here = self.position
        if here is None or depth <= 0:
            return []
        d = self.direction
        if d:
            s = self.stride
            n = max(depth, math.ceil(self.speed * self.lead / s))
            return [i for i in (here + d * s * k for k in range(1, n + 1)) if 0 <= i < size]
        if self.unsure is not None:
            depth = min(depth, self.unsure)
        out = []
        for k in range(1, size):
            for i in (here + k, here - k):
                if 0 <= i < size:
                    out.append(i)
            if len(out) >= depth or (here + k >= size and here - k < 0):
                break
        return out[:depth]


def plane_specs(chunks: Sequence[Sequence[int]], specs: Any, point: Sequence[int | None]) -> list[ChunkSpec]:
    """The chunk specs a plane (or any axis-aligned slab) reads, in block order.

    Parameters
    ----------
    chunks
        Dask chunks of the array (``arr.chunks``).
    specs
        ``{block index: ChunkSpec}`` (``arr.chunk_index.specs``).
    point
        Per axis, the index the plane has there, or ``None`` for an axis shown whole
        (a displayed axis).

    Examples
    --------
    >>> chunks = ((2, 2, 1), (3, 3))
    >>> specs = {(i, j): f"b{i}{j}" for i in range(3) for j in range(2)}
    >>> plane_specs(chunks, specs, (3, None)), plane_specs(chunks, specs, (None, 4))
    (['b10', 'b11'], ['b01', 'b11', 'b21'])
    """
    ranges = []
    for axis_chunks, p in zip(chunks, point):
        if p is None:
            ranges.append(range(len(axis_chunks)))
        else:
            edges = list(itertools.accumulate(axis_chunks))
            ranges.append(range(b, b + 1) if (b := bisect.bisect_right(edges, int(p))) < len(edges) else range(0))
    return [specs[idx] for idx in itertools.product(*ranges)]


class MotionPrefetch:
    """Warm the chunks of one gpulazy array ahead of a viewer's cursor.

    Parameters
    ----------
    array
        What ``gpulazy.from_files`` returned (it has ``chunk_index`` and ``chunk_source``).
    depth
        Planes to warm ahead (``config prefetch_depth`` when ``None``); more when moving
        fast (see ``MotionPredictor.upcoming``). The byte budget caps it either way.
    load
        ``load(spec)`` the cache calls for a chunk (default: the array's own reader).
    predictor
        Factory of the ``MotionPredictor`` used for each new axis of motion.
    unsure
        With the default ``predictor``: its ``unsure`` (planes warmed while the direction is
        unknown; ``None``: ``depth``).

    Examples
    --------
    >>> import gpulazy, numpy as np, os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "v.npy"); np.save(p, np.zeros((64, 8, 8), "f4"))
    >>> cache = gpulazy.DeviceCache("64 KiB", device="cpu")
    >>> vol = gpulazy.from_files(p, chunks=(4, 8, 8), device="cpu", cache=cache)
    >>> warm = MotionPrefetch(vol, depth=8)
    >>> r = warm.update(0.0, (10, 0, 0), axis=0, displayed=(1, 2))   # at rest: both sides, 2 chunks
    >>> r["planes"][:4], r["issued"]
    ([11, 9, 12, 8], 2)
    >>> cache.close()
    """

    def __init__(self, array: Any, *, depth: int | None = None, load: Callable[[ChunkSpec], Any] | None = None,
                 predictor: Callable[[], MotionPredictor] | None = None, unsure: int | None = None):
        index = getattr(array, "chunk_index", None)
        if index is None:
            raise TypeError("MotionPrefetch needs an array made by gpulazy.from_files (with a chunk_index), "
                            f"got {type(array).__name__}")
        self.array = array
        self.specs = index.specs
        self.chunks = array.chunks
        self.shape = array.shape
        self.source = array.chunk_source
        self.load = load or self.source.read
        self._depth = depth
        self._new_predictor = predictor or functools.partial(MotionPredictor, unsure=unsure)
        self.predictor: MotionPredictor | None = None
        self._motion: tuple | None = None  # (axis, displayed) the predictor follows
        self._plan: ReadAheadPlan | None = None
        self._cache: Any = None
        self.totals = {"events": 0, "jumps": 0, "issued": 0, "cancelled": 0, "claims": 0}
        self._lock = threading.Lock()  # a viewer may slice (``claim``) on another thread than its events

    @property
    def depth(self) -> int:
        if self._depth is not None:
            return self._depth
        from gpulazy import config

        return int(config.get("prefetch_depth"))

    @depth.setter
    def depth(self, value: int | None) -> None:
        self._depth = None if value is None else max(0, int(value))

    def update(self, t: float, point: Sequence[int], *, axis: int, displayed: Sequence[int]) -> dict[str, Any]:
        """The viewer shows the plane through ``point`` (moving along ``axis``) at time ``t``.

        Returns what was done: ``jump``, ``planes`` (predicted, most urgent first),
        ``issued`` (chunk reads queued now), ``cancelled`` (queued reads dropped as stale).
        """
        cache = self.source.cache_instance()
        if cache is None:  # no cache, nothing to warm into
            return {"jump": False, "planes": [], "issued": 0, "cancelled": 0}
        with self._lock:
            return self._update(cache, t, point, axis, displayed)

    def _update(self, cache: Any, t: float, point: Sequence[int], axis: int, displayed: Sequence[int]
                ) -> dict[str, Any]:
        if cache is not self._cache or self._motion != (axis, tuple(displayed)):
            self._restart(cache, axis, displayed)
        assert self.predictor is not None and self._plan is not None
        point = [int(p) for p in point]
        jump = self.predictor.observe(t, point[axis])
        planes = self.predictor.upcoming(self.depth, size=self.shape[axis])
        order = self._chunk_order(point, axis, displayed, planes)
        self._plan.budget = int(cache.capacity * CACHE_FRACTION)
        cancelled = int(cache.cancel(self._plan.set_order(order)) or 0)
        reads = [spec for _, spec in self._plan.next_reads()]
        issued = cache.prefetch(reads, self.load) if reads else 0
        self.totals["events"] += 1
        self.totals["jumps"] += int(jump)
        self.totals["issued"] += issued
        self.totals["cancelled"] += cancelled
        return {"jump": jump, "planes": planes, "issued": issued, "cancelled": cancelled}

    def claim(self, specs: Sequence[ChunkSpec]) -> int:
        """The viewer needs a plane whose chunks are neither cached nor on their way: read it first.

        Called by the viewer as it asks for the plane, before the step event that ``update``
        follows (napari slices first): every read this warmer has queued is dropped (after a
        jump they are stale; when read-ahead fell behind, the next ``update`` queues them
        again, behind the plane), then ``specs`` are queued, at the head of the cache's queue,
        for its threads to read beside the viewer's. Reads already running finish. Returns how
        many queued reads were dropped.
        """
        cache = self.source.cache_instance()
        if cache is None:
            return 0
        with self._lock:
            dropped = 0
            if self._plan is not None and self._cache is cache:
                dropped = int(cache.cancel(self._plan.cancel_all()) or 0)
            issued = cache.prefetch(specs, self.load) if specs else 0
            self.totals["claims"] += 1
            self.totals["cancelled"] += dropped
            self.totals["issued"] += issued
        return dropped

    def stop(self) -> int:
        """Cancel every warm-up still queued; returns how many were dropped."""
        with self._lock:
            if self._plan is None or self._cache is None:
                return 0
            return int(self._cache.cancel(self._plan.cancel_all()) or 0)

    def _restart(self, cache: Any, axis: int, displayed: Sequence[int]) -> None:
        if self._plan is not None and self._cache is not None and not self._cache.closed:
            self._cache.cancel(self._plan.cancel_all())
        self._cache = cache
        self._motion = (axis, tuple(displayed))
        self.predictor = self._new_predictor()
        # The depth in planes is the predictor's; the plan only keeps the byte budget.
        self._plan = ReadAheadPlan(depth=len(self.specs), budget=int(cache.capacity * CACHE_FRACTION))

    def _chunk_order(self, point: list[int], axis: int, displayed: Sequence[int], planes: list[int]) -> list[ChunkSpec]:
        shown = set(displayed)
        here = [None if a in shown else p for a, p in enumerate(point)]
        current = {s.key for s in plane_specs(self.chunks, self.specs, here)}  # the viewer reads these now
        order: dict[str, ChunkSpec] = {}
        for plane in planes:
            here[axis] = plane
            for spec in plane_specs(self.chunks, self.specs, here):
                if spec.key not in current:
                    order.setdefault(spec.key, spec)
        return list(order.values())
