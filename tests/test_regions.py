"""Regions a viewer reads (``HostView`` boxes, napari's planes) equal the file, on every device.

A plane of a 3D-chunked volume spans several chunks; ``napari_gpulazy._view._read_box``
assembles it from the device cache (``DeviceCache.get_region(out=)``). On a GPU this once
came back wrong (rows of zeros, pixels of other planes): a compressed chunk was assembled on
the caller's stream and copied into the cache on gpulazy's own stream before it was complete,
so every later read of that chunk served the half-written copy. The GPU tests below keep
CuPy's legacy default stream busy from another thread while regions are read, which makes
that race certain; the
CPU tests check the assembly itself over random chunkings and boxes.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import gpulazy
from napari_gpulazy._view import HostView

CODECS = ["raw", "zstd", "tiff"]
#: A raw file in (4, 128, 128) chunks reads each chunk as 512 row ranges, and KvikIO's compat mode
#: copies each range on a blocking CUDA stream, which waits for the busy legacy stream's 2 ms
#: kernels: 31 s and 11 s on an H100 host against 1-7 s for the other cases. Run with ``-m gpu``.
SLOW_RAW = [pytest.param("raw", marks=pytest.mark.slow), "zstd", "tiff"]


def _write(tmp_path, data: np.ndarray, chunks: tuple, codec: str) -> str:
    """``data`` as a raw ``.npy`` file, a zstd Zarr v3 store with ``chunks``, or a multi-page
    TIFF of 16 x 16 tiles (a plane is many tiles; the layout picks its chunks)."""
    if codec == "raw":
        p = str(tmp_path / "v.npy")
        np.save(p, data)
        return p
    if codec == "tiff":  # uncompressed tiles: no imagecodecs needed, and still assembled from pieces
        tifffile = pytest.importorskip("tifffile")
        p = str(tmp_path / "v.tif")
        tifffile.imwrite(p, data, tile=(16, 16))
        return p
    zarr = pytest.importorskip("zarr")
    from zarr.codecs import ZstdCodec

    p = str(tmp_path / "v.zarr")
    z = zarr.create_array(p, shape=data.shape, chunks=chunks, dtype=data.dtype, compressors=ZstdCodec(level=1))
    z[...] = data
    return p


def _view(path: str, chunks: tuple, device: str, cache) -> HostView:
    vol = gpulazy.from_files(path, device=device, cache=cache, chunks=chunks)
    if not path.endswith(".tif"):  # a TIFF's chunks are whole pages (the layout's choice)
        assert vol.chunksize == chunks
    return HostView(vol, label=path, target=vol)


def _volume(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 65535, shape, dtype=np.uint16)


# -- CPU: the assembly itself, over random chunkings and boxes ----------------------------------

@st.composite
def _layouts(draw):
    shape = tuple(draw(st.integers(1, n)) for n in (6, 20, 24))
    chunks = tuple(draw(st.integers(1, s)) for s in shape)
    boxes = []
    for _ in range(4):
        box = []
        for n in shape:
            kind = draw(st.sampled_from(["int", "slice", "all"]))
            if kind == "int":
                box.append(draw(st.integers(-n, n - 1)))
            elif kind == "slice":
                a = draw(st.integers(0, n - 1))
                box.append(slice(a, draw(st.integers(a + 1, n))))
            else:
                box.append(slice(None))
        boxes.append(tuple(box))
    return shape, chunks, boxes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=_layouts(), codec=st.sampled_from(CODECS), capacity=st.sampled_from([None, 0, 2048]))
def test_boxes_over_random_chunkings_equal_numpy(tmp_path_factory, layout, codec, capacity):
    shape, chunks, boxes = layout
    data = _volume(shape, seed=sum(shape))
    path = _write(tmp_path_factory.mktemp("r"), data, chunks, codec)
    cache = False if capacity is None else gpulazy.DeviceCache(capacity, device="cpu")
    try:
        view = _view(path, chunks, "cpu", cache)
        for box in boxes:
            sub = view[box]
            assert sub._direct is not None  # read by _read_box, not by dask
            got = np.asarray(sub)
            np.testing.assert_array_equal(got, data[box], err_msg=f"box {box} of {shape} in chunks {chunks}")
            assert got.flags.owndata or got.base is None or got.base.nbytes == got.nbytes
        if cache:
            assert cache.bytes_held <= cache.capacity
    finally:
        if cache:
            cache.close()


def test_a_box_is_written_once_into_one_array(tmp_path):
    data = _volume((4, 16, 16))
    path = _write(tmp_path, data, (2, 4, 4), "raw")
    cache = gpulazy.DeviceCache("1 MiB", device="cpu")
    try:
        view = _view(path, (2, 4, 4), "cpu", cache)
        np.asarray(view[1])                     # warm: every chunk of plane 1 cached
        before = cache.stats()
        plane = np.asarray(view[1])
        after = cache.stats()
        np.testing.assert_array_equal(plane, data[1])
        assert after["hits"] - before["hits"] == 16 and after["misses"] == before["misses"]
        assert plane.base is None               # the array the chunks were copied into, nothing around it
    finally:
        cache.close()


def test_a_box_cut_through_cached_chunks_copies_only_its_part(tmp_path, monkeypatch):
    # A chunk the box cuts is read from the cache where it lies: its part is copied into the
    # result, with no copy of the whole chunk first (no chunk-sized array made at all).
    from gpulazy.device import Device

    data = _volume((4, 16, 16))
    path = _write(tmp_path, data, (2, 8, 8), "raw")
    cache = gpulazy.DeviceCache("1 MiB", device="cpu")
    try:
        vol = gpulazy.from_files(path, shape=data.shape, dtype=data.dtype, chunks=(2, 8, 8), device="cpu",
                                 cache=cache)
        vol.map_blocks(lambda b: b).compute(scheduler="sync")  # every chunk cached
        shapes = []
        real = Device.alloc_many
        monkeypatch.setattr(Device, "alloc_many", lambda self, items: shapes.extend(tuple(i[0]) for i in items) or
                            real(self, items))
        before = cache.stats()
        got = vol[1:3, 3:13, 5:6].compute()
        np.testing.assert_array_equal(got, data[1:3, 3:13, 5:6])
        assert cache.stats()["hits"] - before["hits"] == 4 and cache.stats()["misses"] == before["misses"]
        assert shapes == [(2, 10, 1)]  # the result alone
    finally:
        cache.close()


# -- GPU: the same regions with CuPy's legacy stream busy ---------------------------------------

SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
'''


class _BusyLegacyStream:
    """Keep CuPy's legacy default stream (where napari's thread works) busy from another thread:
    one short spin kernel after another, so any work queued there waits a few milliseconds,
    while work on gpulazy's own stream runs at once. A copy that is not ordered after the
    work it reads then reads it unfinished, every time rather than now and then."""

    def __init__(self, cp, spin_ms: float = 2.0):
        import threading

        self.cp, self.stop, self.kernels = cp, threading.Event(), 0
        kernel = cp.RawKernel(SPIN, "spin")
        cycles = np.int64(spin_ms * 1e-3 * cp.cuda.runtime.getDeviceProperties(0)["clockRate"] * 1000)

        def run():
            with cp.cuda.Device(0):
                queued = []
                while not self.stop.is_set() and self.kernels < 20_000:  # bounded: ~1 min at most
                    kernel((1,), (1,), (cycles,), stream=cp.cuda.Stream.null)
                    event = cp.cuda.Event(disable_timing=True)
                    event.record(cp.cuda.Stream.null)
                    queued.append(event)
                    self.kernels += 1
                    if len(queued) == 2:  # two queued: the stream is never idle, yet never far ahead
                        queued.pop(0).synchronize()
                for event in queued:
                    event.synchronize()

        self.thread = threading.Thread(target=run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        assert self.kernels > 0


def _check_planes(cp, view, data, planes, what):
    with _BusyLegacyStream(cp):
        for z in planes:
            np.testing.assert_array_equal(np.asarray(view[z]), data[z], err_msg=f"{what}: plane {z}")


GRIDS = {"1": (4, 512, 512), "2x2": (4, 256, 256), "4x4": (4, 128, 128)}


@pytest.mark.gpu
@pytest.mark.parametrize("grid,codec", [
    pytest.param(g, c, marks=pytest.mark.slow) if (g, c) == ("4x4", "raw") else (g, c) for c in CODECS for g in GRIDS])
def test_gpu_planes_cold_cached_reread_and_evicted_equal_the_file(tmp_path, codec, grid):
    cp = pytest.importorskip("cupy")
    chunks = GRIDS[grid]
    data = _volume((16, 512, 512), seed=3)
    path = _write(tmp_path, data, chunks, codec)
    cache = gpulazy.DeviceCache("64 MiB", device="cuda:0")
    small = gpulazy.DeviceCache(3 * int(np.prod(chunks)) * 2, device="cuda:0")  # three chunks: evicts all along
    try:
        view = _view(path, chunks, "cuda:0", cache)
        _check_planes(cp, view, data, range(0, 9), "cold")
        _check_planes(cp, view, data, [0, 1, 5, 8, 2], "cached")
        _check_planes(cp, view, data, range(9, 16), "after other planes")
        _check_planes(cp, view, data, [3, 4, 12], "re-read")
        assert cache.stats()["hits"] > 0
        tight = _view(path, chunks, "cuda:0", small)
        _check_planes(cp, tight, data, [0, 5, 0, 9, 15, 5], "small cache")
        assert small.bytes_held <= small.capacity
        assert small.stats()["evictions"] > 0 or codec == "tiff"  # a TIFF page can exceed it: read through
        box = (slice(2, 11), slice(30, 400), 77)  # across chunks on two axes, a column of a plane
        np.testing.assert_array_equal(np.asarray(view[box]), data[box])
    finally:
        cache.close()
        small.close()


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [["--host-decode"], []], ids=["host-decode", "gpu-decode"])
def test_gpu_planes_of_large_compressed_chunks_equal_the_file(decode):
    """The case napari users met, as ``benchmarks/region_race.py`` reproduces it: 2048 x 2048
    planes over 4 x 4 zstd chunks of 16 MiB (gpulazy's default dask chunks span several), the
    legacy stream kept busy. A chunk decoded on the host was uploaded and placed on the
    caller's stream and the cache's copy on gpulazy's stream read it before the upload had
    landed: on an H100 at 2f3a4d7 this reproducer showed 38 of 40 planes wrong on first read
    and 40 of 40 from the cache with ``--host-decode`` (0 with GPU decode); at 0d0cbf3, none."""
    import importlib.util

    pytest.importorskip("cupy")
    pytest.importorskip("zarr")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "region_race.py")
    spec = importlib.util.spec_from_file_location("region_race", path)
    race = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(race)
    assert race.main([*decode, "--busy-ms", "2", "--size", "2048", "--chunks", "32,512,512", "--planes", "40"]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("codec", SLOW_RAW)
def test_gpu_regions_equal_the_file_with_chunks_read_by_dask_and_prefetch(tmp_path, codec):
    """Cache entries made by every other reader (dask tasks, prefetch threads) serve regions right."""
    cp = pytest.importorskip("cupy")
    chunks = GRIDS["4x4"]
    data = _volume((16, 512, 512), seed=4)
    path = _write(tmp_path, data, chunks, codec)
    cache = gpulazy.DeviceCache("64 MiB", device="cuda:0")
    try:
        view = _view(path, chunks, "cuda:0", cache)
        vol = view.array
        with _BusyLegacyStream(cp):
            assert int(vol[0:4].max().compute()) == int(data[0:4].max())  # dask tasks fill the cache
            cache.prefetch([vol.chunk_index.specs[(i, j, k)] for i in (2, 3) for j in range(4) for k in range(4)],
                           vol.chunk_source.read)
        _check_planes(cp, view, data, range(0, 16), "dask- and prefetch-filled")
    finally:
        cache.close()


@pytest.mark.gpu
@pytest.mark.parametrize("codec", CODECS)
def test_gpu_napari_stepping_shows_every_plane_as_the_file(tmp_path, codec):
    """A napari ViewerModel stepping through planes of 4 x 4 chunks, with motion prefetch."""
    cp = pytest.importorskip("cupy")
    pytest.importorskip("napari")
    from napari.components import ViewerModel

    import napari_gpulazy
    from napari_gpulazy import read_layers

    data = _volume((32, 512, 512), seed=5)
    path = _write(tmp_path, data, GRIDS["4x4"], codec)
    cache = gpulazy.DeviceCache("8 MiB", device="cuda:0")  # 4 of 8 chunk layers: prefetch evicts as it goes
    viewer = ViewerModel()
    try:
        napari_gpulazy.attach(viewer, depth=4)
        ((view, kwargs, _),) = read_layers(path, device="cuda:0", cache=cache, chunks=GRIDS["4x4"])
        layer = viewer.add_image(view, **kwargs)
        wrong = []
        with _BusyLegacyStream(cp):
            for z in [*range(32), 3, 30, 12, 13, 14, 0]:
                viewer.dims.set_current_step(0, z)
                if not np.array_equal(np.asarray(layer._slice.image.view), data[z]):
                    wrong.append(z)
        assert not wrong, f"planes shown unlike the file: {wrong}"
        assert cache.bytes_held <= cache.capacity
    finally:
        napari_gpulazy.detach(viewer)
        cache.close()


def test_a_viewer_region_of_a_cached_chunk_of_a_changed_file_raises_naming_it(tmp_path):
    """A viewer's region of a cached chunk is served by ``DeviceCache.get_region``, which checked
    nothing: after the file changed, napari showed the old values while ``vol[box]`` raised (found by
    fuzzing the partial reads). The hit is checked as ``get``'s are."""
    from gpulazy.errors import ChunkReadError

    path = str(tmp_path / "a.npy")
    np.save(path, np.arange(4 * 8 * 8, dtype="u2").reshape(4, 8, 8))
    cache = gpulazy.DeviceCache("64 MiB", device="cpu")
    try:
        vol = gpulazy.from_files(path, device="cpu", cache=cache, chunks=(2, 8, 8))
        view = HostView(vol, label=path, target=vol)
        np.testing.assert_array_equal(np.asarray(view[0:2, 1:3]), np.arange(256, dtype="u2").reshape(4, 8, 8)[0:2, 1:3])
        assert cache.stats()["loads"] >= 1  # the chunk is cached now
        np.save(path, np.arange(4 * 8 * 8, dtype="u2").reshape(4, 8, 8) + 1)  # same size, other values
        with pytest.raises(ChunkReadError) as info:
            np.asarray(view[0:2, 1:3])
        assert path in str(info.value) and "changed" in str(info.value)
    finally:
        cache.close()
