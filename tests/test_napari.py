"""The napari plugin: manifest, reader, display path, motion prefetch, errors, widget, a real viewer.

Model-level tests use ``napari.components.ViewerModel`` (no Qt, no display). Tests marked
with the ``real_viewer`` fixture open a real ``napari.Viewer``; they need an X
display (pytest-xvfb starts Xvfb when it is installed) and skip, visibly, without one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("napari", reason="the napari extra is not installed")
pytest.importorskip("npe2")

import gpulazy  # noqa: E402
from gpulazy.layouts.raw import write_sidecar  # noqa: E402
from test_cache import wait_idle  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _cpu_and_plugins(monkeypatch):
    """Every test reads onto the CPU through a fresh default cache; npe2 knows the plugin."""
    from npe2 import PluginManager

    monkeypatch.setenv("GPULAZY_DEVICE", "cpu")
    gpulazy.config.set(device="cpu", cache="256 MiB")
    PluginManager.instance().discover()
    yield
    from gpulazy.cache import default_cache

    with gpulazy.config.set(cache=False):
        default_cache("cpu")  # closes the default cache: no chunks leak into the next test


@pytest.fixture
def volume(tmp_path):
    data = np.random.default_rng(1).random((48, 40, 32), dtype="f4")
    path = tmp_path / "vol.npy"
    np.save(path, data)
    return str(path), data


@pytest.fixture
def model():
    from napari.components import ViewerModel

    viewer = ViewerModel()
    yield viewer
    import napari_gpulazy

    napari_gpulazy.detach(viewer)


def _open(viewer, path, **kw):
    (layer,) = viewer.open(path, plugin="gpulazy", **kw)
    return layer


def _shown(layer) -> np.ndarray:
    return np.asarray(layer._slice.image.view)


def _step_forward(viewer, layer, data, planes, wait=None) -> dict:
    """Show ``planes`` one by one (checking each), prefetch settled between steps; cache stats
    counted from the second plane on (the first is read cold)."""
    cache = _default_cache()
    for k, z in enumerate(planes):
        viewer.dims.set_current_step(0, z)
        if wait is not None:
            wait()
        np.testing.assert_array_equal(_shown(layer), data[z])
        wait_idle(cache)
        if k == 0:
            cache.reset_stats()
    return cache.stats()


def _default_cache():
    from gpulazy.cache import default_cache

    return default_cache("cpu")


# -- package and manifest ----------------------------------------------------------------------

def test_npe2_validate_passes():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-m", "npe2", "validate", "gpulazy", "--imports"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0 and "valid" in r.stdout, r.stdout + r.stderr


def test_manifest_contributes_reader_sample_and_widget():
    from npe2 import PluginManager

    mf = PluginManager.instance().get_manifest("gpulazy")
    (reader,) = mf.contributions.readers
    assert reader.accepts_directories
    assert {"*.npy", "*.raw", "*.tif", "*.tiff", "*.zarr", "*.h5", "*.hdf5"} <= set(reader.filename_patterns)
    assert [s.key for s in mf.contributions.sample_data] == ["volume"]
    assert [w.command for w in mf.contributions.widgets] == ["gpulazy.dock_widget"]


def test_import_napari_gpulazy_imports_no_qt_and_no_napari():
    probe = "import sys, json, napari_gpulazy; print(json.dumps(sorted(sys.modules)))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120,
                         env=env)
    loaded = set(json.loads(out.stdout))
    bad = sorted(m for m in loaded if m.split(".")[0] in {"PyQt5", "PyQt6", "PySide2", "PySide6", "qtpy", "napari",
                                                          "vispy", "superqt", "magicgui"})
    assert bad == [], f"import napari_gpulazy imported {bad}"


# -- the reader: what it opens, what it refuses ----------------------------------------------------

def test_get_reader_returns_none_for_what_it_cannot_open(tmp_path):
    from napari_gpulazy import napari_get_reader

    (tmp_path / "notes.txt").write_text("hello")
    np.zeros(8, "u1").tofile(tmp_path / "bare.raw")          # raw bytes, no sidecar
    (tmp_path / "empty").mkdir()
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "a.txt").write_text("x")
    for p in ["notes.txt", "bare.raw", "missing.npy", "empty", "junk"]:
        assert napari_get_reader(str(tmp_path / p)) is None, p
    assert napari_get_reader([str(tmp_path / "notes.txt")]) is None
    assert napari_get_reader([]) is None
    assert napari_get_reader(12) is None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(head=st.binary(max_size=64), name=st.sampled_from(["a.npy", "a.tif", "a.h5", "a.raw", "a.zarr", "a"]))
def test_get_reader_never_raises(tmp_path, head, name):
    from napari_gpulazy import napari_get_reader

    p = tmp_path / name
    p.write_bytes(head)
    reader = napari_get_reader(str(p))
    assert reader is None or callable(reader)


def test_npy_opens_lazily_and_steps_show_the_file(model, volume):
    path, data = volume
    layer = _open(model, path)
    from napari_gpulazy import HostView

    assert isinstance(layer.data, HostView) and layer.data.shape == data.shape and layer.name == "vol.npy"
    for z in (0, 7, 8, 31, 47):
        model.dims.set_current_step(0, z)
        np.testing.assert_array_equal(_shown(layer), data[z])


def test_raw_with_sidecar_gets_scale_and_axis_names(model, tmp_path):
    data = np.arange(6 * 5 * 4, dtype=">u2").reshape(6, 5, 4)
    p = str(tmp_path / "scan.raw")
    data.tofile(p)
    write_sidecar(p, shape=data.shape, dtype=">u2", axes=["z", "y", "x"], scale=[3.0, 0.5, 0.25])
    layer = _open(model, p)
    assert tuple(layer.scale) == (3.0, 0.5, 0.25)
    assert tuple(layer.axis_labels) == ("z", "y", "x")
    model.dims.set_point(0, 4 * 3.0)  # world position of plane 4 (scale 3)
    np.testing.assert_array_equal(_shown(layer), data[4])


def test_folder_of_raw_slices_with_sidecars_stacks(model, tmp_path):
    folder = tmp_path / "slices"
    folder.mkdir()
    planes = [np.full((6, 5), i, dtype="u2") for i in range(5)]
    for i, a in enumerate(planes):
        a.tofile(folder / f"z{i}.raw")
        write_sidecar(str(folder / f"z{i}.raw"), shape=(6, 5), dtype="u2")
    (folder / "notes.txt").write_text("acquired on a Tuesday")     # not a slice: left out
    layer = _open(model, str(folder))
    assert layer.data.shape == (5, 6, 5) and layer.name == "slices"
    model.dims.set_current_step(0, 3)
    np.testing.assert_array_equal(_shown(layer), planes[3])


def test_bad_sidecar_is_reported_naming_it(tmp_path):
    from napari_gpulazy import napari_get_reader

    p = tmp_path / "v.raw"
    np.zeros(4, "u1").tofile(p)
    (tmp_path / "v.raw.json").write_text('{"shape": [4]}')
    reader = napari_get_reader(str(p))                        # a sidecar says it is ours...
    with pytest.raises(gpulazy.errors.LayoutError, match=r"v\.raw\.json.*lacks the required keys"):
        reader(str(p))                                         # ...and what is wrong with it


# -- formats as their layouts land --------------------------------------------------------------

def _needs_layout(name):
    from gpulazy import layouts

    return pytest.mark.skipif(name not in layouts.layout_names(), reason=f"the {name!r} layout is not registered yet")


@_needs_layout("tiff")
def test_tiff_stack_opens(model, tmp_path):
    tifffile = pytest.importorskip("tifffile")
    data = np.random.default_rng(2).integers(0, 4000, (6, 20, 24), dtype="u2")
    p = str(tmp_path / "stack.tif")
    tifffile.imwrite(p, data)
    layer = _open(model, p)
    model.dims.set_current_step(0, 4)
    np.testing.assert_array_equal(_shown(layer), data[4])


@_needs_layout("hdf5")
def test_hdf5_dataset_opens(model, tmp_path):
    h5py = pytest.importorskip("h5py")
    data = np.random.default_rng(3).random((5, 16, 12), dtype="f4")
    p = str(tmp_path / "vol.h5")
    with h5py.File(p, "w") as f:
        f.create_dataset("data", data=data, chunks=(1, 16, 12))
    layer = _open(model, p)
    model.dims.set_current_step(0, 3)
    np.testing.assert_array_equal(_shown(layer), data[3])


def _write_ome_zarr(path, levels, scale):
    zarr = pytest.importorskip("zarr")
    root = zarr.open_group(path, mode="w", zarr_format=2)
    datasets = []
    for i, a in enumerate(levels):
        arr = root.create_array(str(i), shape=a.shape, dtype=a.dtype, chunks=(2,) + a.shape[1:], compressors=None)
        arr[...] = a
        f = 2 ** i
        datasets.append({"path": str(i), "coordinateTransformations": [
            {"type": "scale", "scale": [scale[0], scale[1] * f, scale[2] * f]}]})
    root.attrs["multiscales"] = [{"version": "0.4", "name": "vol", "datasets": datasets,
                                  "axes": [{"name": n, "type": "space"} for n in "zyx"]}]


@_needs_layout("zarr")
def test_ome_zarr_opens_as_a_multiscale_layer_with_its_scale(model, tmp_path):
    full = np.random.default_rng(4).random((4, 32, 32), dtype="f4")
    half = full.reshape(4, 16, 2, 16, 2).mean(axis=(2, 4))
    p = str(tmp_path / "vol.ome.zarr")
    _write_ome_zarr(p, [full, half], scale=(2.0, 0.5, 0.5))
    layer = _open(model, p)
    assert layer.multiscale and [tuple(s) for s in layer.level_shapes] == [full.shape, half.shape]
    assert tuple(layer.scale) == (2.0, 0.5, 0.5)
    assert tuple(layer.axis_labels) == ("z", "y", "x")
    np.testing.assert_array_equal(np.asarray(layer.data[1][3]), half[3])
    np.testing.assert_array_equal(np.asarray(layer.data[0][2]), full[2])


# -- display path ---------------------------------------------------------------------------------

def test_one_plane_crosses_to_the_host_not_its_chunk(model, volume):
    path, data = volume
    from napari_gpulazy import read_layers

    ((view, kwargs, kind),) = read_layers(path, chunks=(8, 40, 32))
    layer = model.add_image(view, **kwargs)
    cache = _default_cache()
    view.transfers.reset()
    cache.reset_stats()
    model.dims.set_current_step(0, 13)
    plane, chunk = data[0].nbytes, 8 * data[0].nbytes
    assert view.transfers.count == 1 and view.transfers.bytes == plane < chunk
    np.testing.assert_array_equal(_shown(layer), data[13])
    assert cache.stats()["bytes_held"] >= chunk             # the whole chunk stays cached
    model.dims.set_current_step(0, 14)                      # same chunk: a cache hit
    assert cache.stats()["hits"] == 1 and view.transfers.largest == plane


# Negative steps are left out: dask and NumPy disagree on some (dask's business, not this path's).
_AXIS_KEY = st.one_of(st.integers(-5, 20), st.slices(21).filter(lambda s: (s.step or 1) > 0), st.just(slice(None)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.one_of(st.tuples(_AXIS_KEY), st.tuples(_AXIS_KEY, _AXIS_KEY),
                     st.tuples(_AXIS_KEY, _AXIS_KEY, _AXIS_KEY), st.tuples(st.just(Ellipsis), _AXIS_KEY)))
def test_host_view_regions_equal_numpy(tmp_path, key):
    from napari_gpulazy import read_layers

    data = np.arange(21 * 10 * 6, dtype=">i4").reshape(21, 10, 6)   # big-endian: native out
    p = tmp_path / "r.npy"
    if not p.exists():
        np.save(p, data)
    ((view, _, _),) = read_layers(str(p), chunks=(4, 3, 6), prefetch=False)
    try:
        want = data[key]
    except IndexError:
        with pytest.raises(IndexError):
            np.asarray(view[key])
        return
    got = np.asarray(view[key])
    assert got.dtype == np.dtype("i4") and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_cache_get_region_copies_only_the_region():
    from gpulazy.spec import ByteRange, ChunkSpec

    cache = gpulazy.DeviceCache("1 MiB", device="cpu")
    try:
        spec = ChunkSpec((ByteRange("x", 0, 4 * 64),), (4, 8, 8), "<i4")
        loads = []
        chunk = np.arange(4 * 64, dtype="i4").reshape(4, 8, 8)

        def load(s):
            loads.append(s)
            return chunk.copy()

        first = cache.get_region(spec, load, (1,))               # a miss loads the chunk once
        second = cache.get_region(spec, load, (2, slice(1, 3)))  # a hit copies two rows
        assert len(loads) == 1 and cache.stats()["hits"] == 1
        np.testing.assert_array_equal(first, chunk[1])
        assert second.base is None and second.nbytes == 2 * 8 * 4
        second[...] = -1                                         # the caller's own: the cache is intact
        np.testing.assert_array_equal(cache.get_region(spec, load, (2,)), chunk[2])
    finally:
        cache.close()


def test_lazy_pyramid_for_large_planes(model, tmp_path):
    data = np.random.default_rng(5).integers(0, 60000, (3, 40, 36), dtype="u2")
    p = str(tmp_path / "wide.npy")
    np.save(p, data)
    from napari_gpulazy import read_layers

    ((levels, kwargs, _),) = read_layers(p, pyramid_min_side=32)       # halve until a side <= 16
    assert kwargs["multiscale"] and [v.shape for v in levels] == [(3, 40, 36), (3, 20, 18), (3, 10, 9)]
    want = data[1].reshape(20, 2, 18, 2).astype("f4").mean(axis=(1, 3)).round().astype("u2")
    got = np.asarray(levels[1][1])
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, want)
    assert all(v.target is levels[0].array for v in levels)  # levels warm the full-resolution chunks
    layer = model.add_image(levels, **kwargs)
    assert layer.multiscale and len(layer.level_shapes) == 3
    want2 = data[2].reshape(10, 4, 9, 4).astype("f4").mean(axis=(1, 3))
    np.testing.assert_allclose(np.asarray(levels[2][2]), want2, atol=1.0)  # rounded at each level


def test_pyramid_is_skipped_for_small_planes(volume):
    from napari_gpulazy import read_layers

    ((view, kwargs, _),) = read_layers(volume[0])
    assert not kwargs["multiscale"] and view.shape == volume[1].shape


# -- motion-aware prefetch in a viewer ----------------------------------------------------------------

def test_stepping_forward_hits_prefetched_chunks(model, volume):
    path, data = volume
    import napari_gpulazy
    from napari_gpulazy import read_layers

    hook = napari_gpulazy.attach(model, depth=4)
    ((view, kwargs, _),) = read_layers(path, chunks=(2, 40, 32))
    layer = model.add_image(view, **kwargs)
    s = _step_forward(model, layer, data, range(2, 30))
    assert s["misses"] == 0 and s["prefetch_hits"] >= 12, s   # every new chunk was warmed ahead
    assert hook.totals()["events"] >= 27 and hook.errors == 0, hook.last_error


def test_a_jump_cancels_and_warms_around_the_new_plane(model, volume):
    path, _ = volume
    import napari_gpulazy
    from napari_gpulazy import read_layers

    hook = napari_gpulazy.attach(model, depth=2)
    ((view, kwargs, _),) = read_layers(path, chunks=(1, 40, 32))
    model.add_image(view, **kwargs)
    for z in (1, 2, 3):
        model.dims.set_current_step(0, z)
    model.dims.set_current_step(0, 40)
    (result,) = hook.last_result.values()
    assert result["jump"] and result["planes"] == [41, 39]


# -- errors reach the user -------------------------------------------------------------------------

def test_read_error_becomes_a_notification_naming_the_file(model, volume):
    path, _ = volume
    from napari.utils.notifications import notification_manager

    _open(model, path)
    with gpulazy.config.set(cache=False):                   # no cached chunk hides the damage
        with open(path, "r+b") as f:
            f.truncate(1000)                                # the file shrinks after opening
        seen = []
        notification_manager.notification_ready.connect(seen.append)
        try:
            with pytest.raises(OSError, match=os.path.basename(path)):
                model.dims.set_current_step(0, 30)
        finally:
            notification_manager.notification_ready.disconnect(seen.append)
    messages = [str(n.message) for n in seen]
    assert any(path in m and "gpulazy could not read" in m for m in messages), messages


# -- sample data -----------------------------------------------------------------------------------

def test_sample_volume_is_raw_with_a_sidecar(tmp_path):
    from napari_gpulazy._sample import _plane, write_sample_volume
    from napari_gpulazy import read_layers

    p = write_sample_volume(str(tmp_path), shape=(6, 32, 24))
    assert write_sample_volume(str(tmp_path), shape=(6, 32, 24)) == p   # reused, not rewritten
    ((view, kwargs, _),) = read_layers(p)
    assert view.shape == (6, 32, 24) and kwargs["axis_labels"] == ("z", "y", "x")
    np.testing.assert_array_equal(np.asarray(view[4]), _plane(4, (6, 32, 24)))
    assert not np.array_equal(_plane(4, (6, 32, 24)), _plane(5, (6, 32, 24)))


# -- a real viewer under Xvfb ----------------------------------------------------------------------

@pytest.fixture(scope="session")
def _qt_can_start():
    """Whether Qt starts on this display (a missing xcb library aborts the process, so ask a child)."""
    if not os.environ.get("DISPLAY"):
        return "no X display: install Debian's xvfb (pytest-xvfb then starts it) to run real-viewer tests"
    probe = "from qtpy.QtWidgets import QApplication; QApplication([])"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, QT_QPA_PLATFORM="xcb"))
    if r.returncode != 0:
        return ("Qt cannot start on this display (install xvfb libxcb-icccm4 libxcb-keysyms1 libxcb-xinerama0): "
                + r.stderr.strip()[-300:])
    return None


@pytest.fixture
def real_viewer(_qt_can_start, request):
    """``(viewer, qtbot)``; qtbot is asked for only once Qt is known to start (a session-scoped
    QApplication made without a display aborts the whole run)."""
    if _qt_can_start:
        pytest.skip(_qt_can_start)
    from qtpy.QtWidgets import QApplication

    app = QApplication.instance()
    if app is not None and app.platformName() == "offscreen":
        pytest.skip("the Qt application runs offscreen (no OpenGL): run this test file under Xvfb with xcb")
    os.environ["QT_QPA_PLATFORM"] = "xcb"
    import napari

    # Shown on the virtual display: a canvas never shown is never drawn (its screenshot is black).
    viewer = napari.Viewer(show=True)
    yield viewer, request.getfixturevalue("qtbot")
    import napari_gpulazy

    napari_gpulazy.detach(viewer)
    viewer.close()


def test_real_viewer_opens_steps_prefetches_and_screenshots(real_viewer, tmp_path):
    real_viewer, qtbot = real_viewer
    import napari_gpulazy
    from napari_gpulazy._sample import write_sample_volume

    path = write_sample_volume(str(tmp_path), shape=(48, 256, 256))
    data = np.fromfile(path, dtype="u2").reshape(48, 256, 256)
    gpulazy.config.set(chunk_size=4 * 256 * 256 * 2)           # 4 planes per chunk: 12 chunks to warm
    (layer,) = real_viewer.open(path, plugin="gpulazy")
    assert layer.data.array.chunks[0] == (4,) * 12
    hook = napari_gpulazy._hook.hook_of(real_viewer)
    assert hook is not None                                   # the reader attached prefetch to this viewer
    hook.depth = 8
    s = _step_forward(real_viewer, layer, data, range(4, 30), wait=lambda: qtbot.wait(5))
    assert s["misses"] == 0 and s["prefetch_hits"] >= 5, s
    real_viewer.reset_view()
    qtbot.wait(100)
    shot = real_viewer.screenshot(canvas_only=True, flash=False)
    assert shot.ndim == 3 and shot[..., :3].std() > 5          # the plane is drawn, not a blank canvas
    ARTIFACTS.mkdir(exist_ok=True)
    from napari.utils.io import imsave

    imsave(str(ARTIFACTS / "napari.png"), shot)
    assert (ARTIFACTS / "napari.png").stat().st_size > 1000


def test_dock_widget_shows_figures_and_sets_controls(real_viewer, volume):
    real_viewer, qtbot = real_viewer
    from napari_gpulazy._widget import GpulazyWidget

    path, _ = volume
    real_viewer.open(path, plugin="gpulazy")
    widget = GpulazyWidget(real_viewer, interval_ms=0)
    real_viewer.window.add_dock_widget(widget, name="gpulazy")
    real_viewer.dims.set_current_step(0, 20)
    assert widget.refresh(), widget.last_error
    f = widget.figures
    assert f["cache"] is not None and f["cache"]["hits"] + f["cache"]["misses"] >= 1
    assert "hit rate" in widget.cache_label.text() and "posix" in widget.backend_label.text()
    assert "host RAM" in widget.memory_label.text() or "GPU" in widget.memory_label.text()
    assert widget.sparkline.renderer().isValid()
    widget.depth_spin.setValue(17)
    assert widget.hook.depth == 17
    assert widget.set_capacity("64 MiB") and gpulazy.config.get("cache") == 64 << 20
    assert not widget.set_capacity("lots") and "not changed" in widget.status_label.text()
    widget.grab().save(str(Path(ARTIFACTS.mkdir(exist_ok=True) or ARTIFACTS) / "napari-dock.png"))


# -- on a GPU (skipped, visibly, without one) ----------------------------------------------------

@pytest.mark.gpu
def test_gpu_display_path_prefetch_and_pyramid(model, tmp_path):
    import napari_gpulazy
    from napari_gpulazy import read_layers

    data = np.random.default_rng(6).random((24, 64, 48), dtype="f4")
    p = str(tmp_path / "g.npy")
    np.save(p, data)
    cache = gpulazy.DeviceCache("64 MiB", device="cuda:0")
    try:
        napari_gpulazy.attach(model, depth=4)
        ((view, kwargs, _),) = read_layers(p, device="cuda:0", cache=cache, chunks=(4, 64, 48))
        assert view.target.chunk_source.device == "cuda:0"
        layer = model.add_image(view, **kwargs)
        view.transfers.reset()                                          # napari's contrast guess read it all
        for z in range(2, 20):
            model.dims.set_current_step(0, z)
            np.testing.assert_array_equal(_shown(layer), data[z])      # CuPy chunks, host plane
            wait_idle(cache)
        s = cache.stats()
        assert s["prefetch_hits"] >= 3 and view.transfers.largest == data[0].nbytes, s
        np.testing.assert_array_equal(np.asarray(view[3:9, 10:20, 5]), data[3:9, 10:20, 5])  # across chunks
        ((levels, _, _),) = read_layers(p, device="cuda:0", cache=cache, pyramid_min_side=32, prefetch=False)
        want = data[5].reshape(32, 2, 24, 2).mean(axis=(1, 3))
        np.testing.assert_allclose(np.asarray(levels[1][5]), want, rtol=1e-6)  # means taken on the GPU
    finally:
        cache.close()
