"""ProgressBar figures on a fake clock: no absurd first rates; final rate and ETA describe the whole compute."""

from __future__ import annotations

import io

import pytest

from gpulazy.stats import Stats
from gpulazy.widgets import ProgressBar


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def bar():
    clock, stats = Clock(), Stats()
    # dt: the refresh thread never wakes during a test; the test drives the hooks itself.
    pb = ProgressBar(minimum=0, dt=3600, terminal=True, file=io.StringIO(), stats=stats, clock=clock)
    keys = [("x", i) for i in range(10)]
    pb._start({k: 1 for k in keys})
    return pb, clock, stats, keys


def _read(stats, nbytes):
    stats.record_read(nbytes=nbytes, seconds=0.1, backend="posix", mode="posix", device="cpu")


def test_no_rate_from_a_span_too_short(bar):
    pb, clock, stats, keys = bar
    clock.now += 0.005
    for k in keys[:9]:
        pb._posttask(k, None, None, None, 0)
    pb._measure()
    assert pb.rate is None and pb.eta is None and pb.gbps == 0.0  # not 1,800 tasks/s
    assert "– GB/s" in pb.text() and "/s" not in pb.text().replace("GB/s", "")


def test_running_rates_are_recent_and_eta_follows_the_average(bar):
    pb, clock, stats, keys = bar
    clock.now += 1.0
    _read(stats, 2 * 10**9)
    for k in keys[:4]:
        pb._posttask(k, None, None, None, 0)
    pb._measure()
    assert pb.gbps == pytest.approx(2.0) and pb.rate == pytest.approx(4.0)
    assert pb.eta == pytest.approx(6 / 4.0)
    assert "ETA 2 s" in pb.text()
    clock.now += 3.0  # three idle seconds: the running rate drops, the ETA grows
    pb._measure()
    pb._measure()
    assert pb.gbps == pytest.approx(0.0) and pb.rate == pytest.approx(0.0)
    assert pb.eta == pytest.approx(6 / (4 / 4.0))


def test_final_figures_are_the_whole_computes(bar):
    # Reads end after 1 s, a slow last task runs until 5 s: the final GB/s is bytes / 5 s,
    # not the last two seconds' 0.00, and the ETA is 0.
    pb, clock, stats, keys = bar
    clock.now += 1.0
    _read(stats, 10**9)
    for k in keys[:9]:
        pb._posttask(k, None, None, None, 0)
    pb._measure()
    clock.now += 4.0
    pb._measure()
    assert pb.gbps == pytest.approx(0.0)  # while running: nothing was read lately
    pb._posttask(keys[9], None, None, None, 0)
    pb._finish(None, None, False)
    assert pb.elapsed == pytest.approx(5.0)
    assert pb.gbps == pytest.approx(0.2) and pb.rate == pytest.approx(2.0) and pb.eta == 0.0
    assert "0.20 GB/s" in pb.text() and "2 tasks/s" in pb.text() and "ETA" not in pb.text()
    out = pb.file.getvalue()
    assert "10/10" in out and "0.20 GB/s" in out and "it/s" not in out
    clock.now += 60.0  # after completion nothing moves
    assert pb.elapsed == pytest.approx(5.0) and pb.gbps == pytest.approx(0.2)


def test_default_minimum_is_documented():
    assert ProgressBar().minimum == 0.5
    assert "0.5 s by default" in ProgressBar.__doc__
