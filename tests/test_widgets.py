"""Dashboard and ProgressBar: figures (pure), live refresh thread, progress of a real compute."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time

import dask
import dask.array as da
import numpy as np
import pytest

import gpulazy
from gpulazy.array import ChunkSource, load_chunk
from gpulazy.device import gpu_count, gpu_unavailable_reason
from gpulazy.errors import OptionalDependencyError
from gpulazy.spec import ByteRange, ChunkSpec, file_identity
from gpulazy.stats import Stats
from gpulazy.widgets import (Dashboard, ProgressBar, dashboard_figures, format_bytes, gpu_info,
                             read_task_counts, sparkline_svg)

HAS_GPU = gpu_count() > 0

HOST = {"gpu": False, "index": None, "name": "host RAM", "used": 6 << 30, "total": 24 << 30,
        "pool_used": None, "pool_held": None, "source": "host", "reason": "CuPy found no usable CUDA device"}
GPU = {"gpu": True, "index": 0, "name": "NVIDIA H100", "used": 20 << 30, "total": 80 << 30,
       "pool_used": 3 << 30, "pool_held": 4 << 30, "source": "nvml", "reason": ""}
CACHE = {"hits": 30, "misses": 10, "prefetched": 12, "prefetch_hits": 9, "evictions": 2,
         "bytes_held": 2 << 30, "capacity": 8 << 30, "bytes_read": 5 << 30, "read_seconds": 1.0,
         "queued": 3, "in_flight": 2}


def _wait_for(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ----------------------------------------------------------------------------- pure figures

def test_figures_from_stats_cache_and_gpu():
    s = Stats()
    s.record_read(nbytes=3 * 10**9, seconds=1.0, backend="kvikio", mode="compat", device="cuda:0")
    s.record_read(nbytes=10**9, seconds=1.0, backend="kvikio", mode="gds", device="cuda:0")
    f = dashboard_figures(s.snapshot(), CACHE, GPU, history=s.history(1.0))
    assert f["bytes_read"] == 4 * 10**9
    assert f["reads"] == 2
    assert f["mean_read_gbps"] == pytest.approx(2.0)
    assert f["throughput_gbps"] == pytest.approx(4 * 10**9 / 2.0 / 1e9)  # last 2 s window
    assert (f["backend"], f["mode"], f["device"]) == ("kvikio", "gds", "cuda:0")
    assert f["by_backend"]["kvikio"]["modes"] == {"compat": 1, "gds": 1}
    assert f["cache"]["occupancy"] == pytest.approx(0.25)
    assert f["cache"]["hit_rate"] == pytest.approx(0.75)
    assert (f["queued"], f["in_flight"]) == (3, 2)
    assert f["memory"]["fraction"] == pytest.approx(0.25)
    assert sum(f["series"]["kvikio"]) == pytest.approx(4.0)  # 1 s bins: GB/s sums to GB
    t = f["text"]
    assert "hit rate 75%" in t["cache"] and "2.0 GiB / 8.0 GiB" in t["cache"]
    assert "3 queued, 2 in flight" in t["queue"]
    assert "GPU 0 (NVIDIA H100): 20.0 GiB / 80.0 GiB used" in t["memory"]
    assert "CuPy pool 4.0 GiB held, 3.0 GiB in use" in t["memory"]
    assert t["backend"] == "backend kvikio: GPUDirect Storage on cuda:0"
    assert "compat ×1" in t["modes"] and "gds ×1" in t["modes"]


def test_figures_without_reads_cache_or_gpu():
    f = dashboard_figures(Stats().snapshot(), None, HOST)
    assert f["bytes_read"] == 0 and f["mean_read_gbps"] == 0.0 and f["throughput_gbps"] == 0.0
    assert f["cache"] is None and f["queued"] == 0 and f["in_flight"] == 0
    assert f["series"] == {}
    t = f["text"]
    assert t["memory"].startswith("no GPU found: CuPy found no usable CUDA device")
    assert "6.0 GiB / 24.0 GiB" in t["memory"]
    assert "no device cache" in t["cache"]
    assert "no reads yet" in t["backend"]


def test_figures_compat_mode_is_named_and_errors_counted():
    s = Stats()
    s.record_read(nbytes=100, seconds=0.0, backend="kvikio", mode="compat", device="cuda:1")
    s.record_error()
    cache = dict(CACHE, hits=0, misses=0, capacity=0)
    f = dashboard_figures(s.snapshot(), cache, GPU)
    assert "compat mode" in f["text"]["backend"] and "no GPUDirect Storage" in f["text"]["backend"]
    assert f["mean_read_gbps"] == 0.0  # zero seconds recorded: no division by zero
    assert f["cache"]["hit_rate"] is None and "hit rate n/a" in f["text"]["cache"]
    assert f["cache"]["occupancy"] == 0.0
    assert "1 read errors" in f["text"]["throughput"]


def test_sparkline_one_line_per_backend_and_escaped():
    svg = sparkline_svg({"posix": [0.0, 1.0, 2.0], "<evil>": [0.5, 0.5]}, seconds=60)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert svg.count("<polyline") == 2
    assert "&lt;evil&gt;" in svg and "<evil>" not in svg
    assert "peak 2.00 GB/s" in svg
    # the highest point of the plot is the peak sample (smallest y)
    posix = svg.split('data-backend="posix"')[1]
    ys = [float(p.split(",")[1]) for p in posix.split('points="')[1].split('"')[0].split()]
    assert ys.index(min(ys)) == 2
    assert "no reads in this window" in sparkline_svg({})


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1536, "1.5 KiB"), (64 << 20, "64.0 MiB"), (None, "?")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_gpu_info_here():
    g = gpu_info()
    assert 0 < g["used"] <= g["total"]
    if HAS_GPU:
        assert g["gpu"] is True and g["reason"] == ""
    else:
        assert g["gpu"] is False and g["source"] == "host"
        assert g["reason"] == gpu_unavailable_reason() != ""
    assert gpu_info("cpu")["gpu"] is False


@pytest.mark.gpu
def test_gpu_info_reads_nvml_and_cupy_pool():
    import cupy as cp

    x = cp.ones(1 << 20, dtype=cp.uint8)  # puts bytes into CuPy's pool
    g = gpu_info("cuda:0")
    assert g["gpu"] is True and g["index"] == 0
    assert g["source"] == "nvml", "nvidia-ml-py should be installed with gpulazy[gpu]"
    assert 0 < g["used"] <= g["total"]
    assert g["pool_held"] >= x.nbytes and g["pool_used"] >= x.nbytes


# ----------------------------------------------------------------------------- Dashboard

class _CacheFigures:
    """Something with a DeviceCache's ``stats()``: the dashboard only reads that."""

    def __init__(self):
        self.figures = dict(CACHE)

    def stats(self):
        return dict(self.figures)


def test_dashboard_shows_reads_as_they_happen():
    s, cache = Stats(), _CacheFigures()
    dash = Dashboard(cache=cache, interval=0.02, stats=s)
    try:
        assert dash.running
        assert dash.figures["bytes_read"] == 0
        assert "no reads in this window" in dash.plot.value
        total = 0
        for _ in range(20):  # reads recorded by "another thread" while the dashboard runs
            s.record_read(nbytes=1 << 20, seconds=0.001, backend="posix", mode="posix", device="cpu")
            total += 1 << 20
        cache.figures.update(bytes_held=6 << 30, queued=7)
        assert _wait_for(lambda: dash.figures["bytes_read"] == total and dash.figures["queued"] == 7)
        f = dash.figures
        assert f["throughput_gbps"] > 0
        assert f"data-bytes-read=\"{total}\"" in dash.throughput.value
        assert dash.cache_bar.value == pytest.approx(0.75)
        assert "7 queued" in dash.queue.value
        assert "<polyline" in dash.plot.value and 'data-backend="posix"' in dash.plot.value
        assert "posix" in dash.backend.value
        assert 0 <= dash.memory_bar.value <= 1
        assert dash.last_error is None
    finally:
        dash.close()


def test_a_refresh_that_read_earlier_never_overwrites_a_later_one():
    # The refresh thread reads its figures, then stalls while rendering; meanwhile the notebook's
    # own update() reads newer ones. The newer figures must be what the dashboard ends showing.
    import threading

    s = Stats()
    dash = Dashboard(start=False, stats=s, cache=_CacheFigures())
    rendering, go = threading.Event(), threading.Event()
    real = dash._render

    def slow_render(f):
        if threading.current_thread().name == "stale":
            rendering.set()
            go.wait(10)
        return real(f)

    dash._render = slow_render
    try:
        stale = threading.Thread(target=dash.update, name="stale")
        stale.start()
        assert rendering.wait(10)
        s.record_read(nbytes=5 << 20, seconds=0.001, backend="posix", mode="posix", device="cpu")
        fresh = threading.Thread(target=dash.update, name="fresh")
        fresh.start()
        fresh.join(0.2)  # it waits for the refresh under way (without that, it renders at once)
        go.set()
        stale.join(10)
        fresh.join(10)
        assert dash.figures["bytes_read"] == 5 << 20
        assert f'data-bytes-read="{5 << 20}"' in dash.throughput.value
    finally:
        go.set()
        dash.close()


def test_an_explicit_update_sends_every_figure_and_the_thread_only_changes(monkeypatch):
    """A notebook saved with its widget state keeps a cell's messages only while the cell runs: a
    change the refresh thread sent between cells is lost, so the cell's ``update()`` sends every
    figure again, changed or not; the thread's refreshes send only what changed."""
    from ipywidgets import Widget

    sent: list = []
    monkeypatch.setattr(Widget, "send_state", lambda self, key=None: sent.append((self, key)))
    dash = Dashboard(start=False, stats=Stats(), cache=_CacheFigures())
    try:
        assert dash.update(resend=False)
        sent.clear()
        assert dash.update(resend=False)  # as the thread does: the backend's text did not change
        assert not any(w is dash.backend for w, _ in sent)
        sent.clear()
        assert dash.update()
        resent = {id(w) for w, key in sent if key == "value"}
        assert {id(w) for w in (dash.plot, dash.throughput, dash.cache_bar, dash.cache_label, dash.queue,
                                dash.memory_bar, dash.memory_label, dash.backend, dash.modes)} <= resent
    finally:
        dash.close()


def test_dashboard_without_gpu_says_why():
    dash = Dashboard(start=False, stats=Stats(), device="cpu", cache=_CacheFigures())
    try:
        text = dash.memory_label.value
        assert "host RAM" in text
        if not HAS_GPU:
            assert "no GPU found:" in text
        assert dash.figures["memory"]["gpu"] is False
    finally:
        dash.close()


def test_dashboard_close_stops_thread_and_widgets():
    dash = Dashboard(interval=0.05, stats=Stats(), cache=_CacheFigures())
    thread = dash._thread
    assert thread.is_alive()
    started = time.monotonic()
    dash.close()
    assert time.monotonic() - started < 1.0
    assert not thread.is_alive() and not dash.running
    assert dash.widget.comm is None and dash.cache_bar.comm is None  # widgets closed
    assert dash.update() is False  # nothing to refresh after close
    dash.close()  # idempotent


def test_no_exception_escapes_the_refresh_thread():
    state = {"fail": True}

    def flaky_gpu_info():
        if state["fail"]:
            raise RuntimeError("NVML went away")
        return HOST

    errors = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args)
    try:
        dash = Dashboard(interval=0.02, stats=Stats(), cache=_CacheFigures(), gpu_info=flaky_gpu_info)
        assert _wait_for(lambda: dash.errors >= 3)
        assert dash.running
        assert dash.last_error == "RuntimeError: NVML went away"
        assert "NVML went away" in dash.status.value
        before = dash.updates
        state["fail"] = False  # the source recovers: so does the dashboard
        assert _wait_for(lambda: dash.updates > before + 2)
        assert dash.status.value == ""
        dash.close()
    finally:
        threading.excepthook = old_hook
    assert errors == []


def test_dashboard_displays_as_a_widget():
    dash = Dashboard(start=False, stats=Stats(), cache=_CacheFigures())
    try:
        bundle = dash._repr_mimebundle_()
        view = bundle["application/vnd.jupyter.widget-view+json"]
        assert view["model_id"] == dash.widget.model_id
        assert "gpulazy-dashboard" in dash.widget._dom_classes
        assert "stopped" in repr(dash)
    finally:
        dash.close()


def test_dashboard_finds_the_default_cache_without_creating_one():
    from gpulazy.cache import cache_by_name, default_cache

    with gpulazy.config.set(cache=False):
        default_cache("cpu")  # closes any default cache left by other tests
    dash = Dashboard(start=False, stats=Stats(), device="cpu")
    try:
        assert dash.last_error is None, dash.last_error
        assert dash.figures["cache"] is None
        with pytest.raises(KeyError):
            cache_by_name("default-cpu")  # looking did not create it
        with gpulazy.config.set(cache="3 MiB"):
            cache = default_cache("cpu")
            assert dash.update(), dash.last_error
            assert dash.figures["cache"]["capacity"] == cache.capacity == 3 << 20
    finally:
        dash.close()
        with gpulazy.config.set(cache=False):
            default_cache("cpu")


@pytest.mark.slow
def test_dashboard_and_progress_during_a_real_compute(tmp_path):
    data = np.random.default_rng(0).integers(0, 4000, size=(16, 64, 64), dtype="uint16")
    for i, plane in enumerate(data):
        plane.tofile(tmp_path / f"z{i:02d}.raw")
    cache = gpulazy.DeviceCache("4 MiB", device="cpu", name="test-widgets-dashboard")
    dash = Dashboard(cache=cache, interval=0.02, device="cpu")
    try:
        vol = gpulazy.from_files(str(tmp_path / "z*.raw"), shape=(64, 64), dtype="uint16", device="cpu",
                                 chunks=(2, 64, 64), cache=cache)
        before = dash.figures["bytes_read"]
        seen = []
        dash_ready = threading.Event()

        def watch():  # what the dashboard showed while the compute ran
            while not dash_ready.is_set():
                seen.append(dash.figures.get("bytes_read", 0) - before)
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        pb = ProgressBar(minimum=0, dt=0.01, terminal=True, file=io.StringIO())
        with gpulazy.config.set(fused_reductions=False):  # dask's reduction: a task per chunk to count
            mip = vol.max(axis=0).compute(callbacks=[pb])
        np.testing.assert_array_equal(mip, data.max(axis=0))
        assert (pb.done, pb.total, pb.bytes_read) == (8, 8, data.nbytes)
        assert cache.bytes_held == data.nbytes  # every chunk is in the cache when compute() returns
        assert pb.gbps > 0
        # the dashboard samples on its own thread: one sample may fall between a read's bytes being
        # counted and its chunk being put in the cache, so wait for a sample taken after both
        assert _wait_for(lambda: dash.figures["bytes_read"] - before == data.nbytes
                         and dash.figures["cache"]["bytes_held"] == data.nbytes), dash.figures
        dash_ready.set()
        watcher.join()
        assert seen == sorted(seen) and seen[-1] <= data.nbytes  # only ever grew
        f = dash.figures
        assert f["throughput_gbps"] > 0
        assert f["backend"] == "posix" and f["device"] == "cpu"
        assert f["cache"]["misses"] == 8, f
        assert f["cache"]["occupancy"] == pytest.approx(data.nbytes / (4 << 20))
        # again: every chunk from the cache, nothing read
        pb2 = ProgressBar(minimum=0, terminal=True, file=io.StringIO())
        np.testing.assert_array_equal(vol.max(axis=0).compute(callbacks=[pb2]), data.max(axis=0))
        assert pb2.bytes_read == 0 and pb2.done == pb2.total  # the streamed chain: every chunk folded from the cache
        assert _wait_for(lambda: dash.figures["cache"]["hits"] == 8)
        assert dash.figures["cache"]["hit_rate"] == pytest.approx(0.5)
        assert "hit rate 50%" in dash.cache_label.value
        assert dash.last_error is None
    finally:
        dash.close()
        cache.close()


def test_missing_ipywidgets_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.raises(OptionalDependencyError, match=r"pip install 'gpulazy\[notebook\]'") as e:
        Dashboard()
    assert isinstance(e.value, ImportError) and "ipywidgets" in str(e.value)


def test_import_widgets_is_light_and_works_without_ipywidgets():
    code = (
        "import sys; sys.modules['ipywidgets'] = None\n"
        "import gpulazy\n"
        "before = set(sys.modules)\n"
        "import gpulazy.widgets as w\n"
        "new = set(sys.modules) - before\n"
        "heavy = ('IPython', 'matplotlib', 'cupy', 'torch', 'pynvml', 'tqdm', 'ipykernel')\n"
        "bad = sorted(m for m in new if m.split('.')[0] in heavy)\n"
        "assert not bad, bad\n"
        "try:\n"
        "    w.Dashboard()\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "gpulazy[notebook]" in out.stdout


# ----------------------------------------------------------------------------- ProgressBar

@pytest.fixture
def raw_array(tmp_path):
    """A (8, 16, 16) uint16 dask array of ``load_chunk`` tasks over one raw file, and its data."""
    data = np.arange(8 * 16 * 16, dtype="uint16").reshape(8, 16, 16)
    path = str(tmp_path / "vol.raw")
    data.tofile(path)
    ident = (file_identity(path),)
    source = ChunkSource(device="cpu", backend="posix", cache=False)
    name = "raw-" + dask.base.tokenize(path, ident)
    per = 16 * 16 * 2
    dsk = {(name, i, 0, 0): (load_chunk, ChunkSpec(ranges=(ByteRange(path, i * per, per),), shape=(1, 16, 16),
                                                   dtype="<u2", identity=ident, index=(i, 0, 0)), source)
           for i in range(8)}
    arr = da.Array(dsk, name, chunks=((1,) * 8, (16,), (16,)), dtype="uint16", meta=np.empty((0, 0, 0), "uint16"))
    return arr, data


def test_read_task_counts_finds_reads_inside_fused_tasks(raw_array):
    arr, _ = raw_array
    expr = (arr + 1).sum(axis=(1, 2))
    (dsk,) = dask.optimize(expr)
    counts = read_task_counts(dict(dsk.__dask_graph__()))
    assert sum(counts.values()) == 8
    plain = da.ones((4, 4), chunks=2)
    assert read_task_counts(dict(plain.__dask_graph__())) == {}


def test_progress_counts_chunks_and_bytes(raw_array):
    arr, data = raw_array
    pb = ProgressBar(minimum=0, dt=0.01, terminal=True, file=io.StringIO())
    out = (arr.astype("int64") + 1).max(axis=0).compute(scheduler="threads", callbacks=[pb])
    np.testing.assert_array_equal(out, data.max(axis=0) + 1)
    assert pb.counting == "reads"
    assert (pb.done, pb.total) == (8, 8)
    assert pb.bytes_read == data.nbytes
    assert pb.gbps > 0 and pb.elapsed > 0
    assert pb.kind == "tqdm"
    text = pb.file.getvalue()
    assert "gpulazy" in text and "8/8" in text and "4.0 KiB read" in text
    assert pb.last_error is None


def test_progress_as_context_manager_and_register(raw_array):
    arr, data = raw_array
    pb = ProgressBar(minimum=10.0, terminal=True, file=io.StringIO())
    with pb:
        assert int(arr.sum().compute(scheduler="sync")) == int(data.astype("int64").sum())
    assert (pb.done, pb.total, pb.bytes_read) == (8, 8, data.nbytes)
    assert pb.kind is None and pb.file.getvalue() == ""  # shorter than minimum: nothing shown
    pb.register()
    try:
        arr[:2].sum().compute(scheduler="sync")
    finally:
        pb.unregister()
    assert (pb.done, pb.total, pb.bytes_read) == (2, 2, data[:2].nbytes)


def test_progress_counts_tasks_without_reads():
    pb = ProgressBar(minimum=0, terminal=True, file=io.StringIO())
    da.ones((10, 10), chunks=5).sum().compute(scheduler="sync", callbacks=[pb])
    assert pb.counting == "tasks"
    assert pb.done == pb.total > 4
    assert pb.bytes_read == 0
    assert "tasks" in pb.text()


def test_progress_widget_in_notebook_mode(raw_array, capsys):
    arr, data = raw_array
    pb = ProgressBar(minimum=0, terminal=False)
    arr.sum().compute(scheduler="sync", callbacks=[pb])
    assert pb.kind == "widget"
    assert pb._bar.value == pb._bar.max == 8
    assert pb._bar.bar_style == "success"
    assert "8/8 chunks" in pb._label.value
    assert "4.0 KiB read" in pb._label.value


def test_progress_reports_failure(tmp_path, raw_array):
    arr, _ = raw_array

    def boom(x):
        raise ValueError("bad block")

    pb = ProgressBar(minimum=0, terminal=False)
    with pytest.raises(ValueError, match="bad block"):
        arr.map_blocks(boom, meta=np.empty((0, 0, 0), "uint16")).compute(scheduler="sync", callbacks=[pb])
    assert pb.errored
    assert pb.done < pb.total
    assert pb._bar.bar_style == "danger"


def test_progress_defaults_to_terminal_outside_a_kernel():
    from gpulazy.widgets import _in_notebook

    assert _in_notebook() is False
    pb = ProgressBar()
    assert pb._use_widget() is False
    assert (pb.minimum, pb.dt) == (0.5, 0.1)


def test_the_last_backend_outlives_the_throughput_window():
    """A dashboard sampled a minute after the reads said "backend no reads yet" beside "64 MiB
    read" (the rolling window had dropped the reads; CI's headless-Chromium test met it)."""
    from gpulazy.stats import Stats

    s = Stats(window=0.0)
    s.record_read(nbytes=10, seconds=0.1, backend="posix", mode="posix", device="cpu")
    snap = s.snapshot()
    assert snap["bytes_read"] == 10 and snap["last_backend"] == "posix" and snap["last_mode"] == "posix"
