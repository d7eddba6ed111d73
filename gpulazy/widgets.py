"""Jupyter widgets: a live ``Dashboard`` of reads, cache and memory, and a compute ``ProgressBar``.

Both only *read* figures that the rest of gpulazy records (``gpulazy.stats()``, a
``DeviceCache``'s ``stats()``, NVML); they never compute or read data. The figures are
worked out by pure functions (``dashboard_figures``, ``sparkline_svg``, ``gpu_info``) kept
apart from the widget plumbing, so they can be tested without a notebook.

``import gpulazy.widgets`` needs neither ipywidgets nor IPython; ``Dashboard()`` needs
ipywidgets (``pip install 'gpulazy[notebook]'``); ``ProgressBar`` falls back to tqdm.

>>> import gpulazy
>>> dash = gpulazy.widgets.Dashboard()          # doctest: +SKIP
>>> dash                                         # doctest: +SKIP
>>> with gpulazy.widgets.ProgressBar():          # doctest: +SKIP
...     vol.max(axis=0).compute()
"""

from __future__ import annotations

import collections
import html
import os
import sys
import threading
import time
from typing import Any, Callable

from dask.callbacks import Callback

from gpulazy.errors import missing_dependency
from gpulazy.stats import Stats, default_stats

__all__ = ["Dashboard", "ProgressBar", "dashboard_figures", "gpu_info", "sparkline_svg", "format_bytes",
           "read_task_counts"]

_MODE_TEXT = {
    "gds": "GPUDirect Storage",
    "compat": "compat mode (POSIX reads through pinned host buffers, no GPUDirect Storage)",
    "posix": "POSIX reads into host memory",
}
_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


# ----------------------------------------------------------------------------- helpers

def format_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``"?"``."""
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _import_ipywidgets(feature: str) -> Any:
    try:
        import ipywidgets
    except ImportError as e:
        raise missing_dependency("ipywidgets", "notebook", feature) from e
    return ipywidgets


def _in_notebook() -> bool:
    """True inside a running Jupyter kernel (an ipykernel ZMQ shell), not a terminal IPython."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


# ----------------------------------------------------------------------------- memory figures

def _host_memory() -> tuple[int, int]:
    """``(used, total)`` bytes of host RAM; "used" excludes reclaimable page cache where known."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    available = os.sysconf("SC_AVPHYS_PAGES") * page
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return max(total - available, 0), total


def _cupy_pool() -> tuple[int | None, int | None]:
    """``(in use, held)`` bytes of CuPy's default pool, if CuPy is already in use."""
    cupy = sys.modules.get("cupy")  # never import CuPy just to look at an empty pool
    if cupy is None:
        return None, None
    try:
        pool = cupy.get_default_memory_pool()
        return int(pool.used_bytes()), int(pool.total_bytes())
    except Exception:
        return None, None


_nvml_lock = threading.Lock()
_nvml_ready = False


def _nvml_init(pynvml: Any) -> None:
    """``nvmlInit`` once per process (it is not free, and the dashboard asks 4 times a second)."""
    global _nvml_ready
    with _nvml_lock:
        if not _nvml_ready:
            pynvml.nvmlInit()
            _nvml_ready = True


def _nvml_memory(index: int) -> tuple[int, int, str]:
    """``(used, total, name)`` of CUDA device ``index`` from NVML, matched by PCI bus id."""
    import pynvml

    _nvml_init(pynvml)
    handle = None
    try:
        import cupy

        bus_id = cupy.cuda.Device(index).pci_bus_id  # NVML numbers devices ignoring CUDA_VISIBLE_DEVICES
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode() if isinstance(bus_id, str) else bus_id)
    except Exception:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    name = pynvml.nvmlDeviceGetName(handle)
    return int(mem.used), int(mem.total), name.decode() if isinstance(name, bytes) else str(name)


def gpu_info(device: str | int | None = None) -> dict[str, Any]:
    """Memory of the GPU chunks land on (NVML, else CuPy), or of the host without a GPU.

    Parameters
    ----------
    device
        ``"cuda:N"``, ``N`` or ``None`` (device 0).

    Returns
    -------
    dict
        ``gpu`` (bool), ``index``, ``name``, ``used``, ``total`` (bytes), ``pool_used`` and
        ``pool_held`` (CuPy's pool, ``None`` when unknown), ``source`` (``"nvml"``,
        ``"cupy"`` or ``"host"``) and ``reason`` (why no GPU, ``""`` with one).
    """
    from gpulazy.device import gpu_count, gpu_unavailable_reason

    index = _device_index(device)
    if gpu_count() == 0 or (isinstance(device, str) and device == "cpu"):
        used, total = _host_memory()
        reason = gpu_unavailable_reason() or "device 'cpu' was chosen"
        return {"gpu": False, "index": None, "name": "host RAM", "used": used, "total": total,
                "pool_used": None, "pool_held": None, "source": "host", "reason": reason}
    pool_used, pool_held = _cupy_pool()
    try:
        used, total, name = _nvml_memory(index)
        source = "nvml"
    except Exception:  # no nvidia-ml-py, or NVML unusable in this container
        import cupy

        with cupy.cuda.Device(index):
            free, total = cupy.cuda.runtime.memGetInfo()
        used, total, name, source = int(total - free), int(total), f"cuda:{index}", "cupy"
    return {"gpu": True, "index": index, "name": name, "used": used, "total": total,
            "pool_used": pool_used, "pool_held": pool_held, "source": source, "reason": ""}


def _device_index(device: str | int | None) -> int:
    if isinstance(device, int):
        return device
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return 0


# ----------------------------------------------------------------------------- figures

def _series(history: dict[str, list[tuple[float, float]]] | None) -> dict[str, list[float]]:
    """``Stats.history()`` (newest bin first, bytes/s) as GB/s lists, oldest first."""
    return {name: [v / 1e9 for _, v in reversed(points)] for name, points in sorted((history or {}).items())}


def _mode_text(backend: str | None, mode: str | None) -> str:
    if backend is None:
        return "no reads yet"
    return f"{backend}: {_MODE_TEXT.get(mode or '', mode or 'unknown mode')}"


def _modes_text(by_backend: dict[str, dict[str, Any]]) -> str:
    parts = []
    for name, b in sorted(by_backend.items()):
        modes = ", ".join(f"{m} ×{n}" for m, n in sorted(b.get("modes", {}).items()))
        parts.append(f"{name}: {modes or 'no reads'}")
    return "; ".join(parts) or "no reads yet"


def _decode_text(by_codec: dict[str, dict[str, dict[str, Any]]]) -> str:
    """``decode: zstd on GPU 12.3 GB/s / lzw on host 0.21 GB/s`` from ``Stats`` decode figures."""
    parts = []
    for codec, places in sorted(by_codec.items()):
        for where, t in sorted(places.items()):
            rate = f" {t['bytes'] / t['seconds'] / 1e9:.3g} GB/s" if t.get("seconds") else ""
            parts.append(f"{codec} on {'GPU' if where == 'gpu' else where}{rate}")
    return "decode: " + (" / ".join(parts) or "nothing decoded yet")


def _cache_figures(cs: dict[str, Any] | None) -> dict[str, Any] | None:
    if cs is None:
        return None
    held, capacity = int(cs.get("bytes_held", 0)), int(cs.get("capacity", 0))
    hits, misses = int(cs.get("hits", 0)), int(cs.get("misses", 0))
    return {
        "bytes_held": held,
        "capacity": capacity,
        "occupancy": min(held / capacity, 1.0) if capacity > 0 else 0.0,
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "evictions": int(cs.get("evictions", 0)),
        "prefetched": int(cs.get("prefetched", 0)),
        "prefetch_hits": int(cs.get("prefetch_hits", 0)),
        "queued": int(cs.get("queued", 0)),
        "in_flight": int(cs.get("in_flight", 0)),
    }


def _memory_figures(g: dict[str, Any]) -> dict[str, Any]:
    used, total = int(g.get("used") or 0), int(g.get("total") or 0)
    out = dict(g)
    out["fraction"] = min(used / total, 1.0) if total > 0 else 0.0
    return out


def _texts(f: dict[str, Any]) -> dict[str, str]:
    """The labels the dashboard shows, one per part."""
    c, m = f["cache"], f["memory"]
    if c is None:
        cache = "no device cache: every chunk is read from its file"
        queue = "prefetch queue: no cache to prefetch into"
    else:
        rate = "n/a" if c["hit_rate"] is None else f"{100 * c['hit_rate']:.0f}%"
        cache = (f"cache {format_bytes(c['bytes_held'])} / {format_bytes(c['capacity'])} "
                 f"({100 * c['occupancy']:.0f}%) · hit rate {rate} "
                 f"({c['hits']} hits, {c['misses']} misses) · {c['evictions']} evictions")
        queue = (f"prefetch queue: {c['queued']} queued, {c['in_flight']} in flight · "
                 f"{c['prefetched']} prefetched, {c['prefetch_hits']} used")
    if m.get("gpu"):
        memory = (f"GPU {m.get('index')} ({m.get('name')}): "
                  f"{format_bytes(m['used'])} / {format_bytes(m['total'])} used")
        if m.get("pool_held") is not None:
            memory += f" · CuPy pool {format_bytes(m['pool_held'])} held, {format_bytes(m['pool_used'])} in use"
    else:
        memory = (f"no GPU found: {m.get('reason') or 'unknown'} — host RAM "
                  f"{format_bytes(m['used'])} / {format_bytes(m['total'])} used")
    backend = f"backend {_mode_text(f['backend'], f['mode'])}"
    if f["device"]:
        backend += f" on {f['device']}"
    peak = max((v for values in f["series"].values() for v in values), default=0.0)
    throughput = (f"now {f['throughput_gbps']:.2f} GB/s (1 s peak {peak:.2f}) · "
                  f"{format_bytes(f['bytes_read'])} read in {f['reads']} reads "
                  f"({f['mean_read_gbps']:.2f} GB/s per read)")
    if f["errors"]:
        throughput += f" · {f['errors']} read errors"
    return {"throughput": throughput, "cache": cache, "queue": queue, "memory": memory,
            "backend": backend, "modes": f"reads served by: {_modes_text(f['by_backend'])}",
            "decode": _decode_text(f["decode_by_codec"])}


def dashboard_figures(stats_snapshot: dict[str, Any], cache_stats: dict[str, Any] | None,
                      gpu_info: dict[str, Any], history: dict[str, list[tuple[float, float]]] | None = None,
                      ) -> dict[str, Any]:
    """Every figure the dashboard shows, from plain dicts (no widgets, no I/O).

    Parameters
    ----------
    stats_snapshot
        ``gpulazy.stats().snapshot()``.
    cache_stats
        ``DeviceCache.stats()``, or ``None`` without a cache.
    gpu_info
        ``gpulazy.widgets.gpu_info()``.
    history
        ``gpulazy.stats().history(bin_seconds)`` for the throughput plot.

    Returns
    -------
    dict
        ``throughput_gbps``, ``bytes_read``, ``reads``, ``read_seconds``, ``mean_read_gbps``,
        ``errors``, ``backend``, ``mode``, ``device``, ``by_backend``, ``series`` (GB/s per
        backend, oldest first), ``cache`` (``None`` or occupancy, hit rate, queue...),
        ``queued``, ``in_flight``, ``memory`` (``gpu_info`` plus ``fraction``), ``decode_by_codec``
        (decoded bytes and seconds per codec and place) and ``text`` (the label of each part).

    Examples
    --------
    >>> from gpulazy.stats import Stats
    >>> s = Stats(); s.record_read(nbytes=10**9, seconds=0.5, backend="posix", mode="posix", device="cpu")
    >>> f = dashboard_figures(s.snapshot(), None, {"gpu": False, "used": 1, "total": 2, "reason": "none"})
    >>> f["bytes_read"], f["mean_read_gbps"], f["backend"]
    (1000000000, 2.0, 'posix')
    """
    s = stats_snapshot
    seconds = float(s.get("read_seconds", 0.0))
    cache = _cache_figures(cache_stats)
    f: dict[str, Any] = {
        "throughput_gbps": float(s.get("throughput", 0.0)) / 1e9,
        "bytes_read": int(s.get("bytes_read", 0)),
        "reads": int(s.get("reads", 0)),
        "read_seconds": seconds,
        "mean_read_gbps": s.get("bytes_read", 0) / seconds / 1e9 if seconds > 0 else 0.0,
        "errors": int(s.get("errors", 0)),
        "backend": s.get("last_backend"),
        "mode": s.get("last_mode"),
        "device": s.get("last_device"),
        "by_backend": dict(s.get("by_backend", {})),
        "series": _series(history),
        "cache": cache,
        "queued": cache["queued"] if cache else 0,
        "in_flight": cache["in_flight"] if cache else 0,
        "memory": _memory_figures(gpu_info),
        "decode_by_codec": dict(s.get("decode_by_codec", {})),
    }
    f["text"] = _texts(f)
    return f


def sparkline_svg(series: dict[str, list[float]], *, seconds: float = 60.0, width: int = 360,
                  height: int = 70) -> str:
    """An inline SVG plot of GB/s over the last ``seconds``, one line per backend.

    Plain markup, so it renders in a notebook, a static HTML export or a browser
    without JavaScript or matplotlib.
    """
    peak = max((v for values in series.values() for v in values), default=0.0)
    top = peak * 1.1 if peak > 0 else 1.0
    pad, plot_h = 2, height - 16
    parts = [f'<svg class="gpulazy-sparkline" xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="read throughput, last {seconds:.0f} s">',
             f'<rect x="0" y="0" width="{width}" height="{plot_h}" fill="#f7f7f7" stroke="#ccc"/>']
    for i, (name, values) in enumerate(sorted(series.items())):
        if not values:
            continue
        step = (width - 2 * pad) / max(len(values) - 1, 1)
        pts = " ".join(f"{pad + j * step:.1f},{plot_h - pad - (plot_h - 2 * pad) * v / top:.1f}"
                       for j, v in enumerate(values))
        color = _COLORS[i % len(_COLORS)]
        parts.append(f'<polyline data-backend="{html.escape(name)}" fill="none" stroke="{color}" '
                     f'stroke-width="1.5" points="{pts}"/>')
        parts.append(f'<text x="{4 + 90 * i}" y="{height - 3}" font-size="10" fill="{color}">'
                     f'{html.escape(name)}</text>')
    label = f"peak {peak:.2f} GB/s" if peak > 0 else "no reads in this window"
    parts.append(f'<text x="4" y="11" font-size="10" fill="#555">{label}</text>')
    parts.append(f'<text x="{width - 4}" y="{height - 3}" font-size="10" text-anchor="end" '
                 f'fill="#555">last {seconds:.0f} s</text>')
    parts.append("</svg>")
    return "".join(parts)


# ----------------------------------------------------------------------------- Dashboard

class Dashboard:
    """A live view of gpulazy: read throughput, cache, prefetch queue, memory, backend.

    A daemon thread refreshes it ``1 / interval`` times a second from recorded figures
    only (it never computes), so it stays live while the kernel is busy in ``.compute()``.
    Errors while refreshing are kept in ``last_error`` and shown; the thread goes on.

    Parameters
    ----------
    cache
        A ``DeviceCache``, a cache name, or ``None`` for the default cache of the device
        reads land on (none shown if there is no cache).
    interval
        Seconds between refreshes.
    stats
        The ``Stats`` to read (default: ``gpulazy.stats()``).
    device
        Whose memory to show: ``"cuda:N"`` or ``"cpu"`` (default: the device of the last
        read, else GPU 0, else the host).
    gpu_info
        A callable returning a ``gpu_info()``-like dict (for tests or remote views).
    start
        Start the refresh thread now (else call ``start()``).

    Raises
    ------
    OptionalDependencyError
        Without ipywidgets: ``pip install 'gpulazy[notebook]'``.

    Examples
    --------
    >>> dash = gpulazy.widgets.Dashboard()    # doctest: +SKIP
    >>> dash                                   # shows it in a notebook  # doctest: +SKIP
    >>> dash.close()                           # stops the thread  # doctest: +SKIP
    """

    def __init__(self, cache: Any = None, interval: float = 0.25, *, stats: Stats | None = None,
                 device: str | None = None, gpu_info: Callable[[], dict[str, Any]] | None = None,
                 start: bool = True):
        self._w = _import_ipywidgets("gpulazy.widgets.Dashboard")
        self.interval = float(interval)
        self._cache = cache
        self._stats = stats if stats is not None else default_stats()
        self._device = device
        self._gpu_info = gpu_info
        self.figures: dict[str, Any] = {}
        self.updates = 0
        self.errors = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # One refresh at a time: the figures read and rendered together, so a refresh that read
        # earlier never overwrites, part by part, what a later one showed (a saved notebook kept
        # a throughput read during its MIP although later cells refreshed it).
        self._refreshing = threading.Lock()
        self._closed = False
        self._build()
        self.update()
        if start:
            self.start()

    # -- widgets --------------------------------------------------------------------
    def _part(self, cls: str, factory: Callable[..., Any], **kw: Any) -> Any:
        w = factory(**kw)
        w.add_class(f"gpulazy-{cls}")  # stable hooks for CSS and for browser tests
        return w

    def _build(self) -> None:
        w = self._w
        full = w.Layout(width="100%")
        bar = w.Layout(width="220px", min_width="220px")
        self.title = self._part("title", w.HTML, value=f"<b>gpulazy</b> · refreshed every {self.interval:g} s")
        self.plot = self._part("throughput-plot", w.HTML)
        self.throughput = self._part("throughput", w.HTML)
        self.cache_bar = self._part("cache-bar", w.FloatProgress, min=0.0, max=1.0, description="cache",
                                    bar_style="info", layout=bar)
        self.cache_label = self._part("cache", w.HTML)
        self.queue = self._part("queue", w.HTML)
        self.memory_bar = self._part("memory-bar", w.FloatProgress, min=0.0, max=1.0, description="memory",
                                     layout=w.Layout(width="220px", min_width="220px"))
        self.memory_label = self._part("memory", w.HTML)
        self.backend = self._part("backend", w.HTML)
        self.modes = self._part("modes", w.HTML)
        self.status = self._part("status", w.HTML)
        self.widget = w.VBox(
            [self.title, self.plot, self.throughput, w.HBox([self.cache_bar, self.cache_label]), self.queue,
             w.HBox([self.memory_bar, self.memory_label]), self.backend, self.modes, self.status],
            layout=full,
        )
        self.widget.add_class("gpulazy-dashboard")
        self._children = [self.widget, *self.widget.children[3].children, *self.widget.children[5].children,
                          *self.widget.children]

    def _render(self, f: dict[str, Any]) -> list[Any]:
        """Show the figures ``f``; returns the widgets set (what ``update(resend=True)`` sends again)."""
        t = f["text"]
        values = [
            (self.plot, sparkline_svg(f["series"], seconds=self._stats.window)),
            (self.throughput, _span("throughput", t["throughput"], gbps=f"{f['throughput_gbps']:.4f}",
                                    bytes_read=f["bytes_read"])),
            (self.cache_bar, f["cache"]["occupancy"] if f["cache"] else 0.0),
            (self.cache_label, _span("cache", t["cache"])),
            (self.queue, _span("queue", t["queue"], queued=f["queued"], in_flight=f["in_flight"])),
            (self.memory_bar, f["memory"]["fraction"]),
            (self.memory_label, _span("memory", t["memory"], used=f["memory"].get("used", 0))),
            (self.backend, _span("backend", t["backend"])),
            (self.modes, _span("modes", t["modes"]) + "<br>" + _span("decode", t["decode"])),
        ]
        for part, value in values:
            part.value = value
        return [part for part, _ in values]

    # -- figure sources (read only) -------------------------------------------------
    def _cache_instance(self) -> Any:
        if self._cache is not None and not isinstance(self._cache, str):
            return self._cache
        from gpulazy.cache import cache_by_name

        if isinstance(self._cache, str):
            return cache_by_name(self._cache)
        # Look the default cache up, never create it: default_cache() would make (or
        # replace) one, and a display must not change what it shows.
        from gpulazy.device import get_device

        try:
            return cache_by_name(f"default-{get_device(self._current_device()).name}")
        except KeyError:
            return None

    def _current_device(self) -> str | None:
        return self._device or self._stats.snapshot().get("last_device")

    def _read_gpu_info(self) -> dict[str, Any]:
        if self._gpu_info is not None:
            return self._gpu_info()
        return gpu_info(self._current_device())

    def read_figures(self) -> dict[str, Any]:
        """Collect every figure now (what one refresh shows)."""
        cache = self._cache_instance()
        return dashboard_figures(self._stats.snapshot(), cache.stats() if cache is not None else None,
                                 self._read_gpu_info(), history=self._stats.history(1.0))

    # -- refreshing -------------------------------------------------------------------
    def update(self, *, resend: bool = True) -> bool:
        """Refresh once; returns False (and records ``last_error``) if that failed.

        ``resend``: send every figure to the front end, changed or not (the refresh thread sends only
        what changed). A change the thread sent between two cells is missed by a notebook saved with
        its widget state (``nbclient`` keeps a cell's messages only while that cell runs), and the
        cell's own ``update()`` then found nothing changed: the saved page showed a stale figure
        ("backend no reads yet" after the reads).
        """
        if self._closed:
            return False
        try:
            with self._refreshing:
                f = self.read_figures()
                parts = self._render(f)
                if resend:
                    for part in parts:
                        part.send_state("value")
        except Exception as e:  # a display must never take the kernel down
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            try:
                self.status.value = _span("status", f"dashboard refresh failed: {self.last_error}")
            except Exception:
                pass
            return False
        self.figures = f
        self.updates += 1
        if self.status.value:
            self.status.value = ""
        return True

    def start(self) -> None:
        """Start the refresh thread (a no-op if it is running)."""
        if self._closed or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpulazy-dashboard", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.update(resend=False)
            except BaseException as e:  # pragma: no cover - update() already catches Exception
                self.last_error = f"{type(e).__name__}: {e}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 1.0) -> None:
        """Stop the refresh thread (waits up to ``timeout`` s) and close the widgets."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._closed = True
        for w in self._children:
            try:
                w.close()
            except Exception:
                pass

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kw: Any) -> Any:
        return self.widget._repr_mimebundle_(include=include, exclude=exclude, **kw)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self.running else "stopped")
        return f"<gpulazy Dashboard {state}, every {self.interval} s, {self.updates} updates>"


def _span(part: str, text: str, **data: Any) -> str:
    """A label with machine-readable ``data-*`` figures (read by the browser test)."""
    attrs = "".join(f' data-{k.replace("_", "-")}="{html.escape(str(v))}"' for k, v in data.items())
    return f'<span class="gpulazy-{part}-text"{attrs}>{html.escape(text)}</span>'


# ----------------------------------------------------------------------------- ProgressBar

def read_task_counts(dsk: dict[Any, Any]) -> dict[Any, int]:
    """``{key: number of chunk reads}`` for the tasks of ``dsk`` that read chunks.

    Reads are ``load_chunk`` calls, also inside fused tasks (the same search the
    prefetcher uses: ``gpulazy.prefetch.find_reads``), and the chunks each step of a
    streamed reduction folds (``gpulazy.read.reduce``).
    """
    from gpulazy.prefetch import find_reads
    from gpulazy.read.reduce import stream_step

    counts = {}
    for key, task in dsk.items():
        n = len(find_reads(task)) or _streamed_chunks(task, stream_step, 0)
        if n:
            counts[key] = n
    return counts


def _streamed_chunks(obj: Any, step: Any, depth: int) -> int:
    """Chunks folded by the streamed-reduction steps in ``obj`` (a task, also one dask fused)."""
    if depth > 16:
        return 0
    if type(obj) in (list, tuple):
        return sum(_streamed_chunks(a, step, depth + 1) for a in obj)
    if type(obj) is dict:
        return sum(_streamed_chunks(v, step, depth + 1) for v in obj.values())
    func, args = getattr(obj, "func", None), getattr(obj, "args", None)
    if func is None or not isinstance(args, tuple):
        return 0
    if func is step:
        return int(getattr(args[2], "value", args[2])) if len(args) > 2 else 0
    return sum(_streamed_chunks(a, step, depth + 1) for a in args)


_MIN_RATE_SECONDS = 0.2  # no rate from a shorter span: 1000 cached chunks in 5 ms is not 200,000 chunks/s


class ProgressBar(Callback):
    """Progress of a dask compute: chunks read / total, bytes read, GB/s, chunks/s, ETA.

    A ``dask.callbacks.Callback`` for the local schedulers, used like
    ``dask.diagnostics.ProgressBar``. It counts chunk reads (``load_chunk`` tasks, also
    inside fused tasks), or every task when the graph reads no chunk. Bytes are deltas
    of ``gpulazy.stats()``. Shown as an ipywidgets bar inside a Jupyter kernel and as a
    tqdm bar elsewhere, and **only once the compute has lasted** ``minimum`` **seconds
    (0.5 s by default)**: a shorter compute shows nothing (pass ``minimum=0`` to always
    show the bar); its figures are in the attributes either way.

    While the compute runs, GB/s and chunks/s are those of the last two seconds (none
    before 0.2 s have passed) and the ETA follows the compute's average chunk rate.
    When it ends, the figures are those of the whole compute (bytes / its duration,
    chunks / its duration), the ETA is 0 and nothing updates any more.

    Parameters
    ----------
    minimum
        Show nothing for computes shorter than this (seconds; default 0.5).
    dt
        Seconds between refreshes.
    terminal
        ``True``: always tqdm (the CLI uses this); ``False``: always a widget;
        ``None``: a widget inside a Jupyter kernel, tqdm elsewhere.
    file
        Where tqdm writes (default ``sys.stderr``).
    stats
        The ``Stats`` to read bytes from (default ``gpulazy.stats()``).
    clock
        The clock in seconds (default ``time.perf_counter``; tests pass a fake one).

    Examples
    --------
    >>> with ProgressBar():                                   # doctest: +SKIP
    ...     vol.max(axis=0).compute()
    >>> vol.sum().compute(callbacks=[ProgressBar(minimum=0)]) # doctest: +SKIP
    >>> pb = ProgressBar(terminal=True); pb.register()        # doctest: +SKIP

    After a compute, ``done``, ``total``, ``bytes_read``, ``elapsed``, ``gbps``, ``rate``
    (chunks or tasks per second) and ``eta`` (seconds, 0 when done) hold its figures.
    """

    window = 2.0  # seconds of the running rates

    def __init__(self, minimum: float = 0.5, dt: float = 0.1, *, terminal: bool | None = None,
                 file: Any = None, stats: Stats | None = None, clock: Callable[[], float] | None = None):
        super().__init__()
        self.minimum = float(minimum)
        self.dt = float(dt)
        self.terminal = terminal
        self.file = file
        self._stats = stats if stats is not None else default_stats()
        self._clock = clock or time.perf_counter
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._reset()

    # ``compute(callbacks=[ProgressBar()])`` wants the 5-tuple of hooks: behave as one.
    def __iter__(self):
        return iter(self._callback)

    def __getitem__(self, i: int) -> Any:
        return self._callback[i]

    def __len__(self) -> int:
        return len(self._callback)

    def _reset(self) -> None:
        self.total = 0
        self.done = 0
        self.counting = "reads"
        self.bytes_read = 0
        self.gbps = 0.0
        self.rate: float | None = None
        self.eta: float | None = None
        self.elapsed = 0.0
        self.finished = False
        self.errored = False
        self.last_error: str | None = None
        self.kind: str | None = None  # "widget" or "tqdm" once shown
        self._weights: dict[Any, int] = {}
        self._bytes0 = 0
        self._t0 = self._clock()
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque([(self._t0, 0, 0)])
        self._bar: Any = None
        self._widgets: Any = None

    # -- dask hooks -----------------------------------------------------------------
    def _start(self, dsk: dict[Any, Any]) -> None:
        self._stop_timer()
        self._reset()
        weights = read_task_counts(dsk)
        if not weights:
            self.counting = "tasks"
            weights = {k: 1 for k in dsk}
        self._weights = weights
        self.total = sum(weights.values())
        self._bytes0 = int(self._stats.snapshot()["bytes_read"])
        self._t0 = self._clock()
        self._samples = collections.deque([(self._t0, 0, 0)])
        self._stop.clear()
        self._timer = threading.Thread(target=self._run, name="gpulazy-progress", daemon=True)
        self._timer.start()

    def _posttask(self, key: Any, result: Any, dsk: Any, state: Any, worker_id: Any) -> None:
        n = self._weights.get(key, 0)
        if n:
            with self._lock:
                self.done += n

    def _finish(self, dsk: Any, state: Any, errored: bool) -> None:
        self._stop_timer()
        self.errored = bool(errored)
        if not errored:
            self.done = self.total  # tasks already in the cache never ran
        self._measure(final=True)
        if self._bar is not None or self.elapsed >= self.minimum:
            self._draw(final=True)

    # -- figures and drawing ------------------------------------------------------------
    def _measure(self, final: bool = False) -> None:
        now = self._clock()
        self.elapsed = now - self._t0
        self.bytes_read = max(int(self._stats.snapshot()["bytes_read"]) - self._bytes0, 0)
        done = self.done
        if final:
            # The whole compute's figures, not the last seconds': reads that ended before a
            # slow last task still count, and nothing moves once it is over.
            self.finished = True
            span = max(self.elapsed, 1e-9)
            self.gbps = self.bytes_read / span / 1e9
            self.rate = done / span
            self.eta = 0.0 if not self.errored else None
            return
        samples = self._samples
        samples.append((now, self.bytes_read, done))
        while len(samples) > 2 and now - samples[1][0] >= self.window:
            samples.popleft()
        t_old, b_old, d_old = samples[0]
        if now - t_old < _MIN_RATE_SECONDS:
            self.gbps, self.rate, self.eta = 0.0, None, None
            return
        self.gbps = (self.bytes_read - b_old) / (now - t_old) / 1e9
        self.rate = (done - d_old) / (now - t_old)
        average = done / self.elapsed
        self.eta = (self.total - done) / average if average > 0 else None

    def text(self) -> str:
        """The one-line summary shown beside the bar."""
        unit = "chunks" if self.counting == "reads" else "tasks"
        return f"{self.done}/{self.total} {unit} · {self._figures(unit)}"

    def _figures(self, unit: str) -> str:
        parts = [f"{format_bytes(self.bytes_read)} read"]
        if self.rate is None:
            parts.append("– GB/s")
        else:
            parts += [f"{self.gbps:.2f} GB/s", f"{self.rate:,.0f} {unit}/s"]
        parts.append(f"{self.elapsed:.1f} s")
        if not self.finished and self.eta is not None:
            parts.append(f"ETA {self.eta:.0f} s")
        return " · ".join(parts)

    def _run(self) -> None:
        while not self._stop.wait(self.dt):
            try:
                self._measure()
                if self.elapsed >= self.minimum:
                    self._draw()
            except Exception as e:  # a progress display must never break a compute
                self.last_error = f"{type(e).__name__}: {e}"

    def _stop_timer(self) -> None:
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join(1.0)
        self._timer = None

    def _use_widget(self) -> bool:
        if self.terminal is not None:
            return not self.terminal
        return _in_notebook()

    def _draw(self, final: bool = False) -> None:
        try:
            if self._bar is None:
                self._open()
            if self.kind == "widget":
                self._draw_widget(final)
            else:
                self._draw_tqdm(final)
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"

    def _open(self) -> None:
        if self._use_widget():
            try:
                w = _import_ipywidgets("gpulazy.widgets.ProgressBar")
                from IPython.display import display

                self._bar = w.IntProgress(min=0, max=max(self.total, 1), description="gpulazy")
                self._label = w.HTML()
                self._widgets = w.HBox([self._bar, self._label])
                self._widgets.add_class("gpulazy-progress")
                display(self._widgets)
                self.kind = "widget"
                return
            except ImportError:
                pass  # no ipywidgets: tqdm prints to the notebook's stderr instead
        from tqdm.std import tqdm  # plain text: tqdm.auto would need ipywidgets in a notebook

        # tqdm's own rate, elapsed and ETA are left out: its clock starts when the bar
        # opens (after ``minimum``), so its first rate divides the chunks done before by
        # almost nothing. ``text()`` carries the compute's own figures instead.
        self._bar = tqdm(total=self.total, unit=" chunks" if self.counting == "reads" else " tasks",
                         desc="gpulazy", file=self.file, leave=True, dynamic_ncols=True,
                         bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{unit}{postfix}")
        self.kind = "tqdm"

    def _draw_widget(self, final: bool) -> None:
        self._bar.max = max(self.total, 1)
        self._bar.value = self.done
        self._label.value = html.escape(self.text())
        if final:
            self._bar.bar_style = "danger" if self.errored else "success"

    def _draw_tqdm(self, final: bool) -> None:
        bar = self._bar
        bar.n = self.done
        bar.set_postfix_str(self._figures("chunks" if self.counting == "reads" else "tasks"), refresh=True)
        if final:
            bar.close()
