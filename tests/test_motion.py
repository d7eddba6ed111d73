"""gpulazy.prefetch.motion: the cursor predictor (no viewer) and the read-ahead it drives on a real cache."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gpulazy
from gpulazy.prefetch.motion import MotionPredictor, MotionPrefetch, plane_specs
from test_cache import wait_idle


def _feed(p: MotionPredictor, events) -> list[bool]:
    return [p.observe(t, i) for t, i in events]


# -- the predictor ----------------------------------------------------------------------------

def test_single_steps_forward_and_backward():
    p = MotionPredictor(lead=0.0)
    assert not any(_feed(p, [(0.2 * k, 40 + k) for k in range(5)]))   # arrow key, 5 Hz
    assert (p.direction, p.stride, p.position) == (1, 1, 44)
    assert p.speed == pytest.approx(5.0)
    assert p.upcoming(4, size=100) == [45, 46, 47, 48]
    _feed(p, [(1.0 + 0.2 * k, 43 - k) for k in range(5)])               # turns round
    assert p.direction == -1 and p.upcoming(3, size=100) == [38, 37, 36]


def test_drag_skips_planes_and_looks_further_when_fast():
    p = MotionPredictor(lead=0.5)
    jumps = _feed(p, [(0.02 * k, 100 + 6 * k) for k in range(10)])      # 6 planes per event, 300 planes/s
    assert not any(jumps[1:])
    assert p.direction == 1 and p.stride == 6 and p.speed == pytest.approx(300.0)
    ahead = p.upcoming(4, size=10_000)
    assert len(ahead) == 25 and ahead[:3] == [160, 166, 172]            # 0.5 s at 300/s, 6 apart


def test_a_drag_that_starts_with_a_big_move_is_one_jump_then_motion():
    p = MotionPredictor()
    jumps = _feed(p, [(0.0, 0), (0.02, 30), (0.04, 60), (0.06, 90), (0.08, 118)])
    assert jumps == [False, True, False, False, False]
    assert p.direction == 1 and p.stride == 30            # median of 30, 30, 28


def test_playback_and_wrap_around():
    p = MotionPredictor(lead=0.0)
    _feed(p, [(k / 10, k) for k in range(50, 64)])                      # napari plays at 10 fps
    assert p.direction == 1 and p.speed == pytest.approx(10.0, rel=0.01)
    assert p.observe(1.4, 0)                                            # loops back to the start: a jump
    assert p.direction == 0 and p.upcoming(3, size=64) == [1, 2, 3]     # nothing before plane 0


def test_jump_resets_direction_and_warms_both_sides():
    p = MotionPredictor()
    _feed(p, [(0.1 * k, k) for k in range(6)])
    assert p.observe(0.6, 500)
    assert p.jumps == 1 and p.direction == 0 and p.speed == 0.0
    assert p.upcoming(5, size=502) == [501, 499, 498, 497, 496]        # the end of the axis is near
    assert p.upcoming(5, size=1000) == [501, 499, 502, 498, 503]


def test_unsure_bounds_the_planes_warmed_until_the_direction_shows():
    p = MotionPredictor(unsure=2)
    _feed(p, [(0.05 * k, k) for k in range(6)])
    assert p.upcoming(4, size=1000)[:16] == list(range(6, 22))          # moving (20 planes/s): not bounded
    assert p.observe(0.3, 500) and p.upcoming(16, size=1000) == [501, 499]
    p.observe(0.35, 501)
    assert p.direction == 1 and p.upcoming(16, size=1000)[:16] == list(range(502, 518))


def test_rest_starts_a_new_motion_and_repeats_are_ignored():
    p = MotionPredictor(window=1.0, lead=0.0)
    _feed(p, [(0.0, 10), (0.1, 11), (0.2, 12)])
    assert not p.observe(0.3, 12) and p.direction == 1                  # same plane again: no event
    assert not p.observe(5.0, 11)                                       # after a rest, one step back
    assert (p.direction, p.speed) == (0, 0.0)                           # one step is no motion yet
    assert p.upcoming(2, size=100) == [12, 10]
    p.observe(5.1, 10)
    assert p.direction == -1 and p.upcoming(2, size=100) == [9, 8]


def test_upcoming_stays_inside_the_axis():
    p = MotionPredictor(lead=0.0)
    _feed(p, [(0.1 * k, 95 + k) for k in range(4)])
    assert p.upcoming(10, size=100) == [99]
    assert MotionPredictor().upcoming(3, size=10) == []                 # nothing observed yet


# -- planes to chunks ------------------------------------------------------------------------

@st.composite
def _grid(draw):
    ndim = draw(st.integers(1, 4))
    chunks = tuple(tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))) for _ in range(ndim))
    shape = tuple(sum(c) for c in chunks)
    point = tuple(draw(st.one_of(st.none(), st.integers(0, n - 1))) for n in shape)
    return chunks, point


@settings(max_examples=60, deadline=None)
@given(_grid())
def test_plane_specs_are_exactly_the_blocks_the_plane_crosses(grid):
    chunks, point = grid
    specs = {idx: idx for idx in itertools.product(*(range(len(c)) for c in chunks))}
    want = []
    for idx in specs:
        starts = [sum(c[:i]) for c, i in zip(chunks, idx)]
        if all(p is None or s <= p < s + c[i] for p, s, c, i in zip(point, starts, chunks, idx)):
            want.append(idx)
    assert plane_specs(chunks, specs, point) == want


# -- read-ahead on a real cache ----------------------------------------------------------------

@pytest.fixture
def volume(tmp_path):
    data = np.random.default_rng(0).random((64, 16, 16), dtype="f4")
    path = str(tmp_path / "v.npy")
    np.save(path, data)
    return path, data


def test_stepping_forward_hits_prefetched_chunks_and_stays_in_budget(volume):
    path, data = volume
    chunk = 2 * 16 * 16 * 4                                              # 2 planes per chunk
    cache = gpulazy.DeviceCache(16 * chunk, device="cpu")
    try:
        vol = gpulazy.from_files(path, chunks=(2, 16, 16), device="cpu", cache=cache)
        warm = MotionPrefetch(vol, depth=6)
        peak = 0
        for k, z in enumerate(range(10, 40)):
            np.testing.assert_array_equal(vol[z].compute(), data[z])     # what the viewer shows
            warm.update(0.05 * k, (z, 0, 0), axis=0, displayed=(1, 2))
            peak = max(peak, warm._plan.outstanding_bytes)
            wait_idle(cache)
        s = cache.stats()
        assert peak <= cache.capacity // 2
        assert s["misses"] <= 2 and s["hit_rate"] >= 0.9, s                # only the first chunk was cold
        assert s["prefetch_hits"] >= 13, s
        assert warm.totals["jumps"] == 0 and warm.totals["issued"] >= 14
    finally:
        cache.close()


@pytest.fixture
def busy_disk():
    """A one-thread cache whose read-ahead waits at ``gate`` (a busy disk) and records what it read."""

    class Disk:
        def __init__(self, cache):
            self.cache, self.gate, self.loaded, self.vol = cache, threading.Event(), [], None

        def load(self, spec):
            self.gate.wait(10)
            self.loaded.append(spec.index)
            return self.vol.chunk_source.read(spec)

    with gpulazy.config.set(threads=1):
        disk = Disk(gpulazy.DeviceCache("1 MiB", device="cpu"))
        yield disk
    disk.gate.set()
    disk.cache.close()


def test_jump_cancels_queued_reads(volume, busy_disk):
    path, _ = volume
    disk = busy_disk
    cache = disk.cache
    vol = disk.vol = gpulazy.from_files(path, chunks=(1, 16, 16), device="cpu", cache=cache)
    warm = MotionPrefetch(vol, depth=8, load=disk.load)
    for k in range(4):
        warm.update(0.1 * k, (k, 0, 0), axis=0, displayed=(1, 2))
    queued_before = cache.stats()["queued"]
    r = warm.update(0.5, (50, 0, 0), axis=0, displayed=(1, 2))
    assert r["jump"] and queued_before >= 5
    assert r["cancelled"] >= queued_before - 1                          # every queued read near plane 3
    assert r["planes"][:2] == [51, 49]
    disk.gate.set()
    wait_idle(cache)
    near_old = [i for i in disk.loaded if i[0] < 20]
    assert len(near_old) <= 2, disk.loaded                              # at most the reads already running
    assert {(51, 0, 0), (49, 0, 0)} <= set(disk.loaded)


def test_new_axis_of_motion_restarts_the_predictor(volume):
    path, _ = volume
    cache = gpulazy.DeviceCache("1 MiB", device="cpu")
    try:
        vol = gpulazy.from_files(path, chunks=(4, 4, 16), device="cpu", cache=cache)
        warm = MotionPrefetch(vol, depth=2)
        warm.update(0.0, (3, 5, 0), axis=0, displayed=(1, 2))
        wait_idle(cache)
        r = warm.update(0.1, (3, 3, 0), axis=1, displayed=(0, 2))     # the user rolled the dims
        assert r["planes"] == [4, 2] and warm.predictor.position == 3
        assert r["issued"] == 15                                        # 16 blocks at y 4..7; one warmed already
        wait_idle(cache)
        assert all(s in cache for s in plane_specs(vol.chunks, vol.chunk_index.specs, (None, 4, None)))
    finally:
        cache.close()


def test_without_a_cache_nothing_is_warmed(volume):
    vol = gpulazy.from_files(volume[0], device="cpu", cache=False)
    assert MotionPrefetch(vol).update(0.0, (1, 0, 0), axis=0, displayed=(1, 2))["issued"] == 0
    with pytest.raises(TypeError, match="gpulazy.from_files"):
        MotionPrefetch(np.zeros((2, 2)))


def test_claim_drops_queued_reads_and_reads_the_plane_first(volume, busy_disk):
    path, data = volume
    disk = busy_disk
    cache = disk.cache
    vol = disk.vol = gpulazy.from_files(path, chunks=(1, 8, 8), device="cpu", cache=cache)   # 4 chunks a plane
    warm = MotionPrefetch(vol, depth=4, load=disk.load)
    for k in range(3):
        warm.update(0.1 * k, (k, 0, 0), axis=0, displayed=(1, 2))
    before = cache.stats()
    queued, totals = before["queued"], dict(warm.totals)
    assert queued >= 8                                                  # planes 3.. wait behind the gate
    landing = plane_specs(vol.chunks, vol.chunk_index.specs, (50, None, None))
    dropped = warm.claim(landing[1:])                                   # the viewer reads landing[0] itself
    s = cache.stats()
    assert dropped == queued and s["queued"] == 3 and s["cancelled"] - before["cancelled"] == queued
    assert warm.totals["claims"] == 1 and warm.totals["cancelled"] - totals["cancelled"] == queued
    disk.gate.set()
    wait_idle(cache)
    # At most the read already running when the gate closed, then the plane's chunks first.
    loaded = disk.loaded
    assert all(i[0] < 4 for i in loaded[:-3]) and len(loaded) <= 4, loaded
    assert loaded[-3:] == [s.index for s in landing[1:]]
    for s in landing[1:]:
        y, x = s.index[1] * 8, s.index[2] * 8
        np.testing.assert_array_equal(cache.get(s, vol.chunk_source.read), data[50:51, y:y + 8, x:x + 8])
    r = warm.update(0.5, (50, 0, 0), axis=0, displayed=(1, 2))          # the step event, after the plane
    assert r["jump"] and r["cancelled"] == 0                             # nothing stale was left queued
