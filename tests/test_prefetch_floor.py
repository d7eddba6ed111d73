"""The prefetch floor probe: its minimal reader reads the file's bytes, ``depth`` ahead, and it reports both ratios."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
floor = importlib.import_module("prefetch_floor")


@pytest.fixture
def raw(tmp_path):
    data = np.arange(6 * 8, dtype=np.float32).reshape(6 * 2, 4)  # 6 chunks of 2 x 4 float32 (32 bytes)
    path = tmp_path / "a.raw"
    data.tofile(path)
    return str(path), data


@pytest.mark.parametrize("ahead", [True, False])
def test_reader_reads_each_chunk_ahead_in_the_given_order(raw, ahead):
    from gpulazy.device import get_device

    path, data = raw
    reader = floor.FloorReader(path, 32, depth=2, slots=4, dev=get_device("cpu"), shape=(2, 4), ahead=ahead)
    try:
        reader.start_pass([5, 4, 3, 2, 1, 0])
        assert sorted(reader._inflight) == [4, 5]  # depth reads in flight, the first ones of the order
        for k in (5, 4, 3, 2, 1, 0):
            reader.pretask()
            assert len(reader._inflight) <= 2
            np.testing.assert_array_equal(reader.load(k), data[2 * k:2 * k + 2])
        assert not reader._inflight and len(reader._free) == 4  # every slot given back
        np.testing.assert_array_equal(reader.load(3), data[6:8])  # not read ahead: read on demand
    finally:
        reader.close()


def test_reader_raises_on_a_short_read(tmp_path):
    from gpulazy.device import get_device

    path = tmp_path / "short.raw"
    np.zeros(12, np.float32).tofile(path)  # 48 bytes: chunk 1 of 32 bytes is cut short
    reader = floor.FloorReader(str(path), 32, depth=1, slots=2, dev=get_device("cpu"), shape=(2, 4), ahead=False)
    try:
        with pytest.raises(OSError, match="short read"):
            reader.load(1)
    finally:
        reader.close()


def test_run_on_cpu_reports_both_ratios(capsys):
    r = floor.run(device="cpu", chunks=6, chunk_mib=0.0625, depth=2, compute="xp", repeat=2)
    assert r["floor_bytes_equal"] and len(r["rounds"]) == 2
    assert set(r["rounds"][0]) == {"read", "compute", "prefetch", "floor", "floor read", "streamed", "read streamed",
                                   "compute loop", "streamed floor"}
    for name in ("prefetch", "floor"):
        expect = sorted(x[name] / max(x["read"], x["compute"]) for x in r["rounds"])
        assert r["ratio_" + name] == pytest.approx(sum(expect) / 2)
    for name in ("streamed", "streamed floor"):  # over max(the faster read alone, the faster compute alone)
        expect = sorted(x[name] / max(min(x["read"], x["read streamed"]), min(x["compute"], x["compute loop"]))
                        for x in r["rounds"])
        assert r["ratio_" + name.replace(" ", "_")] == pytest.approx(sum(expect) / 2)
    for name, floor_of in (("prefetch", "floor"), ("streamed", "streamed floor")):  # each over its own floor
        assert r[f"{name}_over_floor"] == pytest.approx(sum(x[name] / x[floor_of] for x in r["rounds"]) / 2)
    assert floor.main(["--device", "cpu", "--chunks", "4", "--chunk-mib", "0.0625", "--depth", "2", "--compute", "xp",
                       "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "ratio floor" in out and "ratio prefetch" in out and "ratio streamed     /" in out
    assert "ratio streamed floor" in out and "streamed / streamed floor" in out


REPO = Path(__file__).resolve().parent.parent
needs_git = pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the git repository (git archive)")


@needs_git
def test_an_old_tree_is_imported_beside_this_one(tmp_path):
    import gpulazy

    old = importlib.import_module("_old_tree").load_old_tree("HEAD", name="gpulazy_old_probe")
    assert old.__name__ == "gpulazy_old_probe" and old.prefetch is not gpulazy.prefetch
    assert old.cache.DeviceCache is not gpulazy.cache.DeviceCache
    mine = {m for m in sys.modules if m == "gpulazy_old_probe" or m.startswith("gpulazy_old_probe.")}
    assert len(mine) > 10 and all(sys.modules[m].__file__.startswith(str(Path(old.__file__).parent)) for m in mine
                                  if getattr(sys.modules[m], "__file__", None))
    data = np.arange(64, dtype=np.uint16)
    data.tofile(tmp_path / "a.raw")
    vol = old.from_files(str(tmp_path / "a.raw"), shape=(8, 8), dtype="uint16", chunks=(2, 8), device="cpu",
                         cache=False)
    with old.prefetch(depth=2):
        assert int(vol.sum().compute()) == int(data.sum())
    with pytest.raises(RuntimeError, match="imported already"):
        importlib.import_module("_old_tree").load_old_tree("HEAD", name="gpulazy_old_probe")


def test_an_old_tree_is_taken_from_a_directory_without_git(tmp_path):
    # Device machines get a copy of the checkout whose git history may lag: the tree is extracted here
    # and carried over. This tree's own package stands in for it; a marker proves which copy was imported.
    import shutil

    shutil.copytree(REPO / "gpulazy", tmp_path / "old" / "gpulazy", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "old" / "gpulazy" / "_marker.py").write_text("import gpulazy.spec\nWHERE = gpulazy.spec.__name__\n")
    old = importlib.import_module("_old_tree").load_old_tree(str(tmp_path / "old"), name="gpulazy_old_dir")
    assert importlib.import_module("gpulazy_old_dir._marker").WHERE == "gpulazy_old_dir.spec"
    assert not Path(old.__file__).is_relative_to(tmp_path)  # a copy: the directory given stays as it was
    data = np.arange(64, dtype=np.uint16)
    data.tofile(tmp_path / "a.raw")
    vol = old.from_files(str(tmp_path / "a.raw"), shape=(8, 8), dtype="uint16", chunks=(2, 8), device="cpu",
                         cache=False)
    assert int(vol.sum().compute()) == int(data.sum())


def test_old_and_new_swap_places_every_other_round():
    names = ["read", "compute", "prefetch", "floor", "floor read", "prefetch old"]
    assert floor._round_order(names, 0) == names
    assert floor._round_order(names, 1) == ["read", "compute", "prefetch old", "floor", "floor read", "prefetch"]
    assert floor._round_order(names[:-1], 1) == names[:-1]


@needs_git
def test_run_with_an_old_tree_reports_new_over_old():
    r = floor.run(device="cpu", chunks=4, chunk_mib=0.0625, depth=2, compute="xp", repeat=2, old="HEAD")
    assert r["floor_bytes_equal"] and "prefetch old" in r["rounds"][0]
    expect = sorted(x["prefetch"] / x["prefetch old"] for x in r["rounds"])
    assert r["new_over_old"] == pytest.approx(sum(expect) / 2) and r["old"] == "HEAD"
    assert "HEAD's" in floor.table(r) and "ratio prefetch old" in floor.table(r)


def test_the_streamed_floor_reads_every_chunk_and_calls_f_on_each_in_order(raw):
    from gpulazy.device import get_device

    path, data = raw
    mf = floor.MapFloor(path, 32, 6, get_device("cpu"), shape=(2, 4))
    seen = []
    try:
        mf.run(lambda chunk: seen.append(chunk.copy()))
    finally:
        mf.close()
    assert len(seen) == 6
    for k, chunk in enumerate(seen):
        np.testing.assert_array_equal(chunk, data[2 * k:2 * k + 2])


def test_the_streamed_floor_raises_on_a_short_read(tmp_path):
    from gpulazy.device import get_device

    path = tmp_path / "short.raw"
    np.zeros(12, np.float32).tofile(path)  # 48 bytes: chunk 1 of 32 bytes is cut short
    mf = floor.MapFloor(str(path), 32, 2, get_device("cpu"), shape=(2, 4))
    try:
        with pytest.raises(OSError, match="short read"):
            mf.run(lambda chunk: None)
    finally:
        mf.close()
