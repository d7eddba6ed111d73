"""``Stats.plot``/``timeline`` fit the reads they show, not a fixed minute (CPU, matplotlib Agg)."""

from __future__ import annotations

import pytest

from gpulazy.stats import ReadEvent, Stats, _timeline


def _event(end, nbytes, seconds, backend="posix"):
    return ReadEvent(end, nbytes, seconds, backend, "posix", "cpu")


def test_timeline_spans_the_reads_and_keeps_every_byte():
    events = [_event(100.2, 400, 0.2), _event(100.4, 800, 0.2), _event(101.0, 300, 0.1, "kvikio")]
    start, step, lines = _timeline(events, bins=10)
    assert start == pytest.approx(100.0) and step == pytest.approx(0.1)
    assert sum(lines["posix"]) * step == pytest.approx(1200) and sum(lines["kvikio"]) * step == pytest.approx(300)
    # 400 bytes over 0.2 s then 800 over the next 0.2 s: 2 kB/s, then 4 kB/s, then nothing
    assert lines["posix"][:4] == pytest.approx([2000, 2000, 4000, 4000]) and lines["posix"][4:] == pytest.approx([0.0] * 6, abs=1e-6)
    assert lines["kvikio"] == pytest.approx([0.0] * 9 + [3000], abs=1e-6)


def test_timeline_of_instantaneous_reads_and_of_none():
    start, step, lines = _timeline([_event(5.0, 100, 0.0), _event(5.0, 50, 0.0)], bins=4)
    assert sum(lines["posix"]) * step == pytest.approx(150)
    assert _timeline([], bins=4)[1:] == (0.0, {})


def test_plot_fits_a_short_compute_not_the_whole_minute():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    s = Stats(window=60.0)
    for _ in range(5):
        s.record_read(nbytes=1 << 20, seconds=0.01, backend="posix", mode="posix", device="cpu")
    ax = s.plot()
    lo, hi = ax.get_xlim()
    events = list(s._events)
    span = max(e.end for e in events) - min(e.end - e.seconds for e in events)
    assert lo == 0 and hi == pytest.approx(span, rel=1e-6) and hi < 5  # was -60 .. 0
    assert "seconds since the first read" in ax.get_xlabel()
    (line,) = ax.get_lines()
    assert max(line.get_ydata()) > 0
    assert "no reads" in Stats().plot().get_xlabel()
