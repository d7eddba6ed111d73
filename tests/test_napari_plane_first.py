"""The plane on screen first: a plane's part of a plain chunk read before the chunk, a plane's
chunks read together and ahead of stale read-ahead on a jump, a stored pyramid's coarsest level
warmed at open. Counters and events, never sleeps."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("napari", reason="the napari extra is not installed")

import test_napari as tn
from test_cache import wait_idle

import gpulazy
from gpulazy.prefetch.motion import plane_specs

# test_napari's fixtures: a CPU default cache and npe2's plugins for every test, a ViewerModel, a volume
_cpu_and_plugins, model, volume = tn._cpu_and_plugins, tn.model, tn.volume
_needs_layout, _shown, _write_ome_zarr = tn._needs_layout, tn._shown, tn._write_ome_zarr


@pytest.fixture
def cache():
    c = gpulazy.DeviceCache("4 MiB", device="cpu")
    yield c
    c.close()


@pytest.fixture
def gate():
    g = threading.Event()
    yield g
    g.set()  # a read still held at the gate ends with the test


def _layer_of(path, cache, **kw):
    from napari_gpulazy import read_layers

    ((view, kwargs, _),) = read_layers(path, cache=cache, contrast_limits=(0, 1), **kw)  # no sample read
    return view, kwargs


def _pyramid(tmp_path, name, full):
    """An OME-Zarr store of ``full`` and its 2 x 2 mean; the half level."""
    half = full.reshape(4, 16, 2, 16, 2).mean(axis=(2, 4))
    _write_ome_zarr(str(tmp_path / name), [full, half], scale=(1.0, 1.0, 1.0))
    return str(tmp_path / name), half


def _zarr_view(tmp_path, shape, cache, seed):
    """A Zarr v2 store (default compressor) in (4, 16, 16) chunks, opened in the same chunks."""
    zarr = pytest.importorskip("zarr")
    data = np.random.default_rng(seed).integers(0, 60000, shape, dtype="u2")
    p = str(tmp_path / "c.zarr")
    zarr.create_array(p, shape=data.shape, chunks=(4, 16, 16), dtype="u2", zarr_format=2)[...] = data
    view, _ = _layer_of(p, cache, chunks=(4, 16, 16), prefetch=False)
    return view, data


def test_a_plane_of_a_plain_chunk_is_read_before_its_chunk_arrives(volume, cache, gate):
    path, data = volume
    finished = []
    view, _ = _layer_of(path, cache, chunks=(8, 40, 32), prefetch=False)
    spec = view.array.chunk_index.specs[(1, 0, 0)]                       # planes 8..15

    def busy_disk(s):                                                    # the whole chunk, slowly
        gate.wait(10)
        finished.append(s.index)
        return view.array.chunk_source.read(s)

    assert cache.prefetch([spec], busy_disk) == 1                        # on its way, held at the gate
    np.testing.assert_array_equal(np.asarray(view[13]), data[13])
    assert finished == [] and view.transfers.part_reads == 1             # shown before the chunk landed
    assert view.transfers.bytes == data[13].nbytes
    gate.set()
    wait_idle(cache)
    assert finished == [(1, 0, 0)] and spec in cache                     # read once, whole, behind it
    np.testing.assert_array_equal(np.asarray(view[14, 3:9]), data[14, 3:9])
    assert view.transfers.part_reads == 1 and cache.stats()["hits"] == 1  # from the cached chunk


def test_a_cold_plain_chunk_is_warmed_whole_behind_its_plane(volume, cache):
    path, data = volume
    view, _ = _layer_of(path, cache, chunks=(8, 40, 32), prefetch=False)
    np.testing.assert_array_equal(np.asarray(view[20, 5:30, 2:31]), data[20, 5:30, 2:31])
    assert view.transfers.part_reads == 1
    s = wait_idle(cache)
    assert s["prefetched"] == 1 and s["loads"] == 1 and view.array.chunk_index.specs[(2, 0, 0)] in cache
    np.testing.assert_array_equal(np.asarray(view[16:18]), data[16:18])  # 2 of 8 planes: from the cache
    assert view.transfers.part_reads == 1 and cache.stats()["prefetch_hits"] == 1


def test_a_box_of_most_of_a_chunk_waits_for_the_chunk(volume, cache):
    path, data = volume
    view, _ = _layer_of(path, cache, chunks=(8, 40, 32), prefetch=False)
    np.testing.assert_array_equal(np.asarray(view[8:13]), data[8:13])    # 5 of 8 planes
    assert view.transfers.part_reads == 0 and cache.stats()["misses"] == 1
    np.testing.assert_array_equal(np.asarray(view[:, 3, 4]), data[:, 3, 4])  # a column: not one run
    assert view.transfers.part_reads == 0


def _zstd_view(tmp_path, cache, checksum=False):
    """A Zarr v3 zstd store of 32 planes in (16, 32, 32) chunks, opened in the same chunks."""
    zarr = pytest.importorskip("zarr")
    from zarr.codecs import ZstdCodec

    data = np.random.default_rng(11).integers(0, 60000, (32, 64, 64), dtype="u2")
    p = str(tmp_path / "z.zarr")
    zarr.create_array(p, shape=data.shape, chunks=(16, 32, 32), dtype="u2",
                      compressors=ZstdCodec(level=1, checksum=checksum))[...] = data
    view, _ = _layer_of(p, cache, chunks=(16, 32, 32), prefetch=False)
    return view, data


@_needs_layout("zarr")
def test_a_plane_near_the_start_of_a_zstd_chunk_decodes_alone_and_the_chunk_is_warmed_behind(tmp_path, cache):
    import gpulazy.read

    view, data = _zstd_view(tmp_path, cache)
    submissions, real = [], gpulazy.read.start
    gpulazy.read.start = lambda specs, *a, **k: submissions.append([s.shape for s in specs]) or real(specs, *a, **k)
    try:
        np.testing.assert_array_equal(np.asarray(view[18, 3:40]), data[18, 3:40])  # planes 16-18 decode
    finally:
        gpulazy.read.start = real
    assert submissions == [[(3, 32, 32)] * 4]                            # its 4 chunks' heads, together
    assert view.transfers.part_reads == 4
    wait_idle(cache)
    assert all(view.array.chunk_index.specs[(1, i, j)] in cache for i in (0, 1) for j in (0, 1))  # behind it
    np.testing.assert_array_equal(np.asarray(view[29]), data[29])        # from the cached chunks
    assert view.transfers.part_reads == 4 and cache.stats()["prefetch_hits"] == 4
    np.testing.assert_array_equal(np.asarray(view[3]), data[3])          # 4 of 16 planes: a quarter
    assert view.transfers.part_reads == 8
    np.testing.assert_array_equal(np.asarray(view[12]), data[12])        # 13 of 16 planes: the chunks
    assert view.transfers.part_reads == 8


@_needs_layout("zarr")
def test_a_zstd_frame_a_head_cannot_check_is_read_whole_for_its_plane(tmp_path, cache):
    """The engine reads a head its frame cannot serve as its whole chunk (``Reads._whole_instead``), which
    checks it; the chunks are warmed behind the plane as ever (read a second time: such frames are rare)."""
    view, data = _zstd_view(tmp_path, cache, checksum=True)              # the checksum covers every byte
    before = gpulazy.stats().snapshot()["bytes_read"]
    np.testing.assert_array_equal(np.asarray(view[17]), data[17])
    assert view.transfers.part_reads == 4
    chunks = [view.array.chunk_index.specs[(1, i, j)] for i in (0, 1) for j in (0, 1)]
    assert gpulazy.stats().snapshot()["bytes_read"] - before >= sum(c.nbytes for c in chunks)  # read whole
    wait_idle(cache)
    np.testing.assert_array_equal(np.asarray(view[29]), data[29])        # from the chunks warmed behind
    assert all(c in cache for c in chunks) and view.transfers.part_reads == 4


@_needs_layout("zarr")
def test_a_plane_s_compressed_chunks_are_read_together_after_the_stale_read_ahead_is_dropped(tmp_path, cache):
    import gpulazy.read.engine

    view, data = _zarr_view(tmp_path, (8, 32, 32), cache, seed=8)
    arr = view.array
    claimed, submissions = [], []
    view.claim = lambda specs: claimed.append((list(specs), cache.stats()["loads"]))
    real = gpulazy.read.engine.start
    gpulazy.read.engine.start = lambda specs, *a, **k: submissions.append(len(specs)) or real(specs, *a, **k)
    try:
        np.testing.assert_array_equal(np.asarray(view[5]), data[5])
    finally:
        gpulazy.read.engine.start = real
    want = plane_specs(arr.chunks, arr.chunk_index.specs, (5, None, None))
    assert len(want) == 4 and claimed == [([], 0)]                     # before the first read, once
    assert submissions == [4]                                         # the plane's 4 chunks: one submission
    assert cache.stats()["loads"] == 4 and all(s in cache for s in want)
    np.testing.assert_array_equal(np.asarray(view[6]), data[6])        # same chunks: cached, no claim
    assert len(claimed) == 1


@_needs_layout("zarr")
def test_without_a_viewer_a_plane_s_chunks_are_read_together_once(tmp_path, cache):
    view, data = _zarr_view(tmp_path, (4, 48, 48), cache, seed=9)
    np.testing.assert_array_equal(np.asarray(view[2, 5:40]), data[2, 5:40])
    s = wait_idle(cache)
    # 9 chunks, each read once, together by this thread, and kept in the cache
    assert s["loads"] == 9 and s["misses"] == 9 and s["errors"] == 0 and s["prefetched"] == 0
    np.testing.assert_array_equal(np.asarray(view[3, 5:40]), data[3, 5:40])  # the same chunks: hits
    assert wait_idle(cache)["loads"] == 9


def test_a_jump_in_the_viewer_claims_the_landing_plane(model, volume):
    path, data = volume
    import napari_gpulazy

    cache = gpulazy.DeviceCache(64 * 20 * 16 * 4, device="cpu")          # read-ahead: 8 planes at most
    hook = napari_gpulazy.attach(model, depth=2)
    view, kwargs = _layer_of(path, cache, chunks=(1, 20, 16))          # 4 chunks a plane
    layer = model.add_image(view, **kwargs)
    try:
        for z in (1, 2, 3):
            model.dims.set_current_step(0, z)
        wait_idle(cache)
        landing = plane_specs(view.array.chunks, view.array.chunk_index.specs, (40, None, None))
        assert not any(cache.holds(s) for s in landing)
        claims, loads = hook.totals()["claims"], cache.stats()["loads"]
        model.dims.set_current_step(0, 40)
        np.testing.assert_array_equal(_shown(layer), data[40])
        assert hook.totals()["claims"] == claims + 1 and hook.errors == 0, hook.last_error
        s = wait_idle(cache)
        assert all(x in cache for x in landing) and s["errors"] == 0 and s["loads"] - loads >= 4
        (result,) = hook.last_result.values()
        assert result["jump"] and result["planes"] == [41, 39]
        napari_gpulazy.detach(model)
        assert view.claim is None                                     # detached: reads claim nothing
    finally:
        napari_gpulazy.detach(model)
        cache.close()


@_needs_layout("zarr")
def test_a_stored_pyramid_s_coarsest_level_is_warmed_at_open(tmp_path, cache):
    from napari_gpulazy import read_layers

    p, half = _pyramid(tmp_path, "pyr.ome.zarr", np.random.default_rng(10).random((4, 32, 32), dtype="f4"))
    ((levels, _, _),) = read_layers(p, cache=cache, contrast_limits=(0, 1), prefetch=False)
    s = wait_idle(cache)
    coarse = list(levels[1].array.chunk_index.specs.values())
    assert s["prefetched"] == len(coarse) >= 1 and all(x in cache for x in coarse)
    assert not any(x in cache for x in levels[0].array.chunk_index.specs.values())   # nothing else read
    cache.reset_stats()
    np.testing.assert_array_equal(np.asarray(levels[1][:]), half)      # the zoomed-out view: cached
    assert cache.stats()["misses"] == 0 and cache.stats()["prefetch_hits"] == len(coarse)


def test_a_pyramid_level_larger_than_the_read_ahead_share_is_not_warmed(tmp_path):
    from napari_gpulazy import read_layers

    p, _ = _pyramid(tmp_path, "big.ome.zarr", np.zeros((4, 32, 32), dtype="f4"))
    small = gpulazy.DeviceCache(4 * 16 * 16 * 4, device="cpu")          # the level is all of it: > half
    try:
        read_layers(p, cache=small, contrast_limits=(0, 1), prefetch=False)
        s = small.stats()
        assert s["queued"] == s["in_flight"] == s["prefetched"] == s["entries"] == 0
    finally:
        small.close()


# -- on a GPU (skipped, visibly, without one) ----------------------------------------------------

@pytest.mark.gpu
def test_gpu_plane_first_part_reads_and_coarsest_level(model, tmp_path):
    import napari_gpulazy

    data = np.random.default_rng(11).random((32, 64, 48), dtype="f4").astype(">f4")  # swapped on the device
    p = str(tmp_path / "g.npy")
    np.save(p, data)
    cache = gpulazy.DeviceCache("64 MiB", device="cuda:0")
    try:
        hook = napari_gpulazy.attach(model, depth=2)
        view, kwargs = _layer_of(p, cache, device="cuda:0", chunks=(8, 64, 48))   # 8 planes a chunk
        layer = model.add_image(view, **kwargs)
        for z in (1, 2, 25):                                                # 25: a jump
            model.dims.set_current_step(0, z)
            np.testing.assert_array_equal(_shown(layer), data[z])
        assert view.transfers.part_reads >= 2 and hook.errors == 0, hook.last_error   # planes 16 and 1 at least
        wait_idle(cache)
        np.testing.assert_array_equal(np.asarray(view[26, 5:40, 3:30]), data[26, 5:40, 3:30])  # cached chunks
        pyr, half = _pyramid(tmp_path, "pyr.ome.zarr", np.random.default_rng(12).random((4, 32, 32), dtype="f4"))
        from napari_gpulazy import read_layers

        ((levels, _, _),) = read_layers(pyr, device="cuda:0", cache=cache, contrast_limits=(0, 1), prefetch=False)
        wait_idle(cache)
        cache.reset_stats()
        np.testing.assert_array_equal(np.asarray(levels[1][:]), half)
        assert cache.stats()["misses"] == 0
    finally:
        napari_gpulazy.detach(model)
        cache.close()


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="gates reads by file offset")
def test_a_plane_is_not_queued_behind_the_read_ahead_of_its_volume(volume, cache, gate, monkeypatch):
    from gpulazy.io import _posix

    path, data = volume
    entered, real = threading.Event(), _posix._preadv
    with gpulazy.config.set(threads=2, task_size="4 KiB"):               # 10 pieces a chunk, 2 threads a lane
        view, _ = _layer_of(path, cache, chunks=(8, 40, 32), prefetch=False)
        warmed = view.array.chunk_index.specs[(2, 0, 0)].ranges[0]       # planes 16..23

        def disk(fd, buffers, offset):                                   # the read-ahead's bytes, held
            if warmed.offset <= offset < warmed.offset + warmed.nbytes:
                entered.set()
                gate.wait(30)
            return real(fd, buffers, offset)

        monkeypatch.setattr(_posix, "_preadv", disk)
        assert cache.prefetch([view.array.chunk_index.specs[(2, 0, 0)]], view.array.chunk_source.read) == 1
        assert entered.wait(10)                                          # both bulk threads held now
        shown = []
        viewer = threading.Thread(target=lambda: shown.append(np.asarray(view[5])), daemon=True)
        viewer.start()
        viewer.join(10)
    assert shown, "the plane waited behind the read-ahead"
    np.testing.assert_array_equal(shown[0], data[5])
    assert view.transfers.part_reads == 1
    gate.set()
    wait_idle(cache)
    assert view.array.chunk_index.specs[(2, 0, 0)] in cache
