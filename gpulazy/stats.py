"""Thread-safe read counters and a rolling throughput window.

The one source every display reads (dashboard, napari dock, CLI, bench). Backends call
``record_read`` once per completed read, ``gpulazy.codecs`` calls ``record_decode`` once per
decoded batch and step and ``record_fills`` for the stored chunks it filled with their fill
value (never written: a Zarr chunk file that does not exist, an unallocated HDF5 chunk, a
sparse TIFF tile); readers call ``snapshot()`` from any thread.

>>> import gpulazy
>>> s = gpulazy.stats()            # the process-wide Stats
>>> s.snapshot()["bytes_read"] >= 0
True
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

#: What ``Stats.record_buffer`` counts (``snapshot()["buffers"]``).
BUFFER_KINDS = ("outputs", "staging", "copies")

__all__ = ["Stats", "ReadEvent", "stats", "default_stats", "record_fills"]


@dataclass(frozen=True, slots=True)
class ReadEvent:
    """One completed read: when it ended, how many bytes, by which backend and path."""

    end: float  # time.monotonic()
    nbytes: int
    seconds: float
    backend: str
    mode: str  # e.g. "gds", "compat", "posix", "pinned-bounce"
    device: str


@dataclass
class _BackendTotals:
    bytes: int = 0
    reads: int = 0
    seconds: float = 0.0
    modes: collections.Counter = field(default_factory=collections.Counter)


@dataclass
class _DecodeTotals:
    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.seconds += seconds
        self.calls += 1

    def as_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "seconds": self.seconds, "calls": self.calls}


class Stats:
    """Counters of reads: totals, per backend, and recent events for throughput.

    Parameters
    ----------
    window
        Seconds of history kept for ``throughput()`` and ``history()``.
    """

    def __init__(self, window: float = 60.0):
        self.window = window
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget every count and event."""
        with getattr(self, "_lock", threading.Lock()):
            self._events: collections.deque[ReadEvent] = collections.deque()
            self._totals: dict[str, _BackendTotals] = {}
            self._errors = 0
            self._oom: dict[str, int] = {}
            self._decodes: dict[tuple[str, str], _DecodeTotals] = {}
            self._filled = 0
            self._buffers = dict.fromkeys(BUFFER_KINDS, 0)
            self._last: ReadEvent | None = None  # kept after the window forgets it: the dashboard's "backend"
            self._started = time.monotonic()

    def record_read(self, *, nbytes: int, seconds: float, backend: str, mode: str, device: str) -> None:
        """Count one completed read (called by backends)."""
        now = time.monotonic()
        event = ReadEvent(now, int(nbytes), float(seconds), backend, mode, device)
        with self._lock:
            self._events.append(event)
            self._last = event
            self._trim(now)
            t = self._totals.setdefault(backend, _BackendTotals())
            t.bytes += event.nbytes
            t.reads += 1
            t.seconds += event.seconds
            t.modes[mode] += 1

    def record_decode(self, *, nbytes: int, seconds: float, codec: str, where: str, device: str) -> None:
        """Count one batch decoded by ``codec`` (an id, or ids joined by ``+``) on ``where``
        (``"gpu"`` or ``"host"``) for ``device``: ``nbytes`` decoded bytes in ``seconds``."""
        with self._lock:
            self._decodes.setdefault((codec, where), _DecodeTotals()).add(int(nbytes), float(seconds))

    def record_filled(self, count: int) -> None:
        """Count ``count`` stored chunks read as their fill value, never having been written."""
        with self._lock:
            self._filled += int(count)

    def record_buffer(self, kind: str, count: int = 1) -> None:
        """Count ``count`` buffers the read engine made for chunks: ``"outputs"`` (a chunk's
        array), ``"staging"`` (stored bytes read before decoding) or ``"copies"`` (a chunk or
        piece copied after its read)."""
        with self._lock:
            self._buffers[kind] += int(count)

    def record_error(self) -> None:
        with self._lock:
            self._errors += 1

    def record_oom(self, *, device: str) -> None:
        """Count one out-of-memory that gpulazy recovered from by evicting (``gpulazy.memory``)."""
        with self._lock:
            self._oom[device] = self._oom.get(device, 0) + 1

    def _trim(self, now: float) -> None:
        cutoff = now - self.window
        while self._events and self._events[0].end < cutoff:
            self._events.popleft()

    def throughput(self, seconds: float = 2.0) -> float:
        """Bytes per second completed over the last ``seconds``."""
        now = time.monotonic()
        with self._lock:
            recent = sum(e.nbytes for e in reversed(self._events) if e.end >= now - seconds)
        return recent / seconds

    def history(self, bin_seconds: float = 0.5) -> dict[str, list[tuple[float, float]]]:
        """Per backend, ``[(seconds_ago, bytes_per_second), ...]`` binned over the window."""
        now = time.monotonic()
        with self._lock:
            events = list(self._events)
        nbins = max(1, int(self.window / bin_seconds))
        out: dict[str, list[float]] = {}
        for e in events:
            b = int((now - e.end) / bin_seconds)
            if b < nbins:
                out.setdefault(e.backend, [0.0] * nbins)[b] += e.nbytes / bin_seconds
        return {k: [(i * bin_seconds, v[i]) for i in range(nbins)] for k, v in out.items()}

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of every figure, safe to read from any thread."""
        with self._lock:
            by_backend = {
                name: {"bytes": t.bytes, "reads": t.reads, "seconds": t.seconds, "modes": dict(t.modes)}
                for name, t in self._totals.items()
            }
            last = self._last
            errors = self._errors
            oom = dict(self._oom)
            decodes = {k: v.as_dict() for k, v in self._decodes.items()}
            filled = self._filled
            buffers = dict(self._buffers)
        return {
            "oom_recoveries": oom,
            "bytes_read": sum(b["bytes"] for b in by_backend.values()),
            "reads": sum(b["reads"] for b in by_backend.values()),
            "read_seconds": sum(b["seconds"] for b in by_backend.values()),
            "errors": errors,
            "chunks_filled": filled,
            "buffers": buffers,
            "by_backend": by_backend,
            "throughput": self.throughput(),
            "last_backend": last.backend if last else None,
            "last_mode": last.mode if last else None,
            "last_device": last.device if last else None,
            **_decode_figures(decodes),
        }

    def timeline(self, bins: int = 60) -> tuple[float, float, dict[str, list[float]]]:
        """Read throughput over the span the recent reads cover, not the whole ``window``.

        Returns ``(start, bin_seconds, {backend: [bytes/s per bin]})``: ``start`` is the
        ``time.monotonic()`` of the first read's start, and ``bins`` bins reach the last
        read's end. Each read's bytes are spread over the time it took, so a compute of
        0.3 s shows as 0.3 s of throughput, not one spike in a minute of zeros.
        """
        with self._lock:
            events = list(self._events)
        return _timeline(events, bins)

    def plot(self, ax: Any = None, bins: int = 60) -> Any:
        """Read throughput over the span of the recent reads (at most ``window`` s), one line per backend.

        The x axis runs from the first read still in the window to the last one, so the
        plot fits the compute it shows (matplotlib).
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:
            from gpulazy.errors import missing_dependency

            raise missing_dependency("matplotlib", "notebook", "Stats.plot") from e
        if ax is None:
            _, ax = plt.subplots(figsize=(6, 3))
        start, step, lines = self.timeline(bins)
        for backend, rates in sorted(lines.items()):
            ax.plot([(i + 0.5) * step for i in range(len(rates))], [v / 1e9 for v in rates], label=backend)
        if lines:
            ax.set_xlim(0, step * bins)
            ago = time.monotonic() - start
            ax.set_xlabel(f"seconds since the first read ({ago:.1f} s ago)")
        else:
            ax.set_xlabel(f"no reads in the last {self.window:.0f} s")
        ax.set_ylabel("GB/s")
        ax.set_title("gpulazy read throughput")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        return ax


def _timeline(events: list[ReadEvent], bins: int) -> tuple[float, float, dict[str, list[float]]]:
    """``Stats.timeline`` of ``events``: each read's bytes spread evenly over its own duration."""
    if not events:
        return time.monotonic(), 0.0, {}
    start = min(e.end - e.seconds for e in events)
    span = max(max(e.end for e in events) - start, 1e-6)
    step = span / bins
    out: dict[str, list[float]] = {}
    for e in events:
        rates = out.setdefault(e.backend, [0.0] * bins)
        begin, end = e.end - e.seconds - start, e.end - start
        if end - begin <= 0:  # an instantaneous read: all its bytes in the bin where it ended
            rates[min(bins - 1, int(end / step))] += e.nbytes / step
            continue
        per_second = e.nbytes / (end - begin)
        for b in range(int(begin / step), min(bins - 1, int(end / step)) + 1):
            overlap = min(end, (b + 1) * step) - max(begin, b * step)
            if overlap > 0:
                rates[b] += per_second * overlap / step
    return start, step, out


def _decode_figures(decodes: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """``decoded_bytes``/``decode_seconds`` in all, per place (``"gpu"``/``"host"``) and per codec."""
    by_codec: dict[str, dict[str, dict[str, Any]]] = {}
    by_place: dict[str, dict[str, Any]] = {}
    for (codec, where), t in sorted(decodes.items()):
        by_codec.setdefault(codec, {})[where] = dict(t)
        p = by_place.setdefault(where, {"bytes": 0, "seconds": 0.0, "calls": 0})
        for k in p:
            p[k] += t[k]
    return {"decoded_bytes": sum(t["bytes"] for t in decodes.values()),
            "decode_seconds": sum(t["seconds"] for t in decodes.values()),
            "decode_by_codec": by_codec, "decode_by_place": by_place}


_default = Stats()


def record_fills(specs: Iterable[Any]) -> None:
    """Count the stored chunks of ``specs`` (``ChunkSpec``) that never were written and so are
    handed out as their fill value (``snapshot()["chunks_filled"]``): a Zarr chunk file that
    does not exist reads as the Zarr spec says, but a user who lost a file can see it here."""
    count = sum(1 for spec in specs for t in spec.tiles if t.range is None)
    if count:
        _default.record_filled(count)


def default_stats() -> Stats:
    """The process-wide ``Stats`` every backend records into by default."""
    return _default


def stats() -> Stats:
    """The process-wide ``Stats`` (``gpulazy.stats().snapshot()``, ``.plot()``)."""
    return _default
