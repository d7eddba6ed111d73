"""Active dask callbacks no longer turn off the fast whole-array read: the fast path drives them."""

from __future__ import annotations

import io

import numpy as np
import pytest
from dask.callbacks import Callback

import gpulazy


@pytest.fixture
def vol(tmp_path):
    data = np.arange(6 * 4 * 8, dtype="<u2").reshape(6, 4, 8)
    paths = []
    for i in range(6):
        p = tmp_path / f"z{i}.raw"
        data[i].tofile(p)
        paths.append(str(p))
    v = gpulazy.from_files(paths, shape=(4, 8), dtype="<u2", chunks=(2, 4, 8), device="cpu", cache=False)
    return v, data


class Recorder(Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def _start(self, dsk):
        self.events.append(("start", len(dsk)))

    def _start_state(self, dsk, state):
        self.events.append(("start_state", len(state["ready"])))

    def _pretask(self, key, dsk, state):
        self.events.append(("pre", key))

    def _posttask(self, key, result, dsk, state, worker_id):
        self.events.append(("post", key, np.asarray(result).copy(), len(state["finished"])))

    def _finish(self, dsk, state, errored):
        self.events.append(("finish", errored, len(state["finished"])))


def test_user_callback_keeps_fast_path_and_sees_every_chunk(vol):
    v, data = vol
    rec = Recorder()
    with rec:
        out = v.compute()
    assert v.compute_path == "fast" and np.array_equal(out, data)
    keys = sorted(v.__dask_keys__() and [k for k in v.__dask_graph__()])
    ev = rec.events
    assert ev[0] == ("start", 3) and ev[1] == ("start_state", 3) and ev[-1] == ("finish", False, 3)
    pres = [e[1] for e in ev if e[0] == "pre"]
    posts = [e for e in ev if e[0] == "post"]
    assert sorted(pres) == keys and sorted(p[1] for p in posts) == keys
    for _, key, result, _ in posts:  # the result a hook sees is the chunk's values
        i = key[1]
        assert np.array_equal(result, data[2 * i: 2 * i + 2])
    assert [p[3] for p in posts] == [1, 2, 3]


def test_callbacks_argument_and_progress_bars(vol):
    v, data = vol
    rec = Recorder()
    assert np.array_equal(v.compute(callbacks=[rec]), data) and v.compute_path == "fast"
    assert rec.events[-1] == ("finish", False, 3)
    from dask.diagnostics import ProgressBar

    out = io.StringIO()
    with ProgressBar(out=out, minimum=0):
        assert np.array_equal(v.compute(), data) and v.compute_path == "fast"
    assert "100%" in out.getvalue()
    from gpulazy.widgets import ProgressBar as GlBar

    bar = GlBar(minimum=0, terminal=True, file=io.StringIO())
    with bar:
        v.compute()
    assert v.compute_path == "fast" and bar.done == bar.total == 3 and bar.bytes_read == data.nbytes


def test_error_reaches_finish_with_errored(vol, tmp_path):
    v, _ = vol
    (tmp_path / "z3.raw").write_bytes(b"short")
    rec = Recorder()
    with rec, pytest.raises(gpulazy.errors.ChunkReadError, match="z3.raw"):
        v.compute()
    assert rec.events[-1][:2] == ("finish", True)


def test_prefetch_is_not_run_by_the_fast_path(vol):
    v, data = vol
    p = gpulazy.prefetch(depth=2)
    with p:
        assert np.array_equal(v.compute(), data) and v.compute_path == "fast"
    assert p.last_summary is None  # nothing to read ahead: every read was in flight at once
