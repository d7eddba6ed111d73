"""``benchmarks/bench_formats.py`` on the CPU at tiny sizes: its writers write the volume it
checks against, its derived rows are checked and related to the whole read, files are reused,
and the time budget skips (and names) what is left."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_formats.py"
sys.path.insert(0, str(BENCH.parent))  # the benchmarks import as modules, as test_bench_cache does
TINY = ["--device", "cpu", "--side", "64", "--size", "64KiB", "--repeat", "1"]  # 8 planes of 64 x 64


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("bench_formats")


def _volume(bench, g):
    return np.stack([bench.plane(z, g.side) for z in range(g.n)])


def _read_back(fmt, path):
    """The written files through their reference reader."""
    if fmt == "raw":
        return np.fromfile(path, np.uint16)
    if fmt == "tiff":
        import tifffile

        return tifffile.imread(sorted(str(p) for p in Path(path).iterdir()))
    if fmt.startswith("zarr"):
        import zarr

        return zarr.open_array(path, mode="r")[:]
    import h5py

    if fmt in ("hdf5-bitshuffle", "hdf5-blosc"):
        pytest.importorskip("hdf5plugin")
    with h5py.File(path, "r") as f:
        return f["data"][:]


@pytest.mark.parametrize("fmt", ["raw", "tiff", "zarr-zstd-sharded", "zarr-zstd-3d", "zarr2-blosc", "hdf5-gzip",
                                 "hdf5-bitshuffle", "hdf5-blosc"])
def test_writers_write_the_volume_in_parallel(bench, tmp_path, fmt):
    # 24 planes of 48 x 48: slabs of 8 (and shards and 3D chunks clipped to the volume) in a thread pool
    g = bench.Geometry(24, 48)
    path = bench.WRITERS[fmt](str(tmp_path), g)
    got = _read_back(fmt, path)
    np.testing.assert_array_equal(got.reshape(g.n, g.side, g.side), _volume(bench, g))


@pytest.mark.parametrize("fmt", ["hdf5-gzip", "hdf5-blosc"])
def test_direct_chunk_writers_pad_the_last_slab(bench, tmp_path, fmt):
    # 20 planes: the last chunk of 8 holds 4 planes, stored whole as HDF5 stores edge chunks
    g = bench.Geometry(20, 48)
    got = _read_back(fmt, bench.WRITERS[fmt](str(tmp_path), g))
    np.testing.assert_array_equal(got.reshape(g.n, g.side, g.side), _volume(bench, g))


def test_checks_catch_wrong_results(bench):
    g = bench.Geometry(8, 32)
    vol = _volume(bench, g)
    for op, (_, fn) in bench.OPS.items():
        assert bench.check_op(op, fn(vol, g), g), op
    bad = vol.copy()
    bad[4, 4, 8] = vol[:, 4, 8].max() + 1  # in the slice [1:5], the plane [4], its tile and the preview, above the MIP
    brighter = vol.copy()
    brighter[4, 4, 8] = vol[4].max() + 1  # above the plane's max
    for op, (_, fn) in bench.OPS.items():
        assert not bench.check_op(op, fn(brighter if op.startswith("plane_max") else bad, g), g), op
    assert bench.check_whole(vol, g) and not bench.check_whole(vol[::-1], g)
    assert bench.op_bytes("slice", g) == 4 * 32 * 32 * 2 and bench.op_bytes("mean", g) == g.nbytes
    assert bench.op_bytes("plane", g) == 32 * 32 * 2


def test_derived_rows_and_references(bench, tmp_path, capsys):
    out = tmp_path / "formats.json"
    assert bench.main(TINY + ["--only", "raw,tiff,zarr-3d,hdf5", "--derived", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ops"] == ["mip", "slice", "astype_sum", "mean", "plane", "map", "map_mip", "plane_int", "plane_dask",
                           "tile", "tile_dask", "plane_max", "plane_max_dask", "np_mip", "mip_dask", "slice_mip", "slice_mip_dask", "preview",
                           "preview_dask", "flip", "flip_dask"]
    assert data["planes"] == 8 and data["side"] == 64
    assert all(r["correct"] for r in data["raw_refs"].values())
    rows = {r["format"]: r for r in data["rows"]}
    assert list(rows) == ["raw", "tiff", "zarr-3d", "hdf5"]
    for fmt, row in rows.items():
        assert row["correct"] and row["bytes"] == 8 * 64 * 64 * 2
        assert row["compression_ratio"] == pytest.approx(row["bytes"] / row["stored_bytes"])
        assert row["vs_raw"] == pytest.approx(row["gpulazy_gbps"] / rows["raw"]["gpulazy_gbps"])
        for op, r in row["ops"].items():
            assert r["correct"], (fmt, op)
            assert r["x_whole"] == pytest.approx(r["gbps"] / row["gpulazy_gbps"])
            assert r["raw_ref_gbps"] == data["raw_refs"][op]["gbps"]
            assert r["x_raw_ref"] == pytest.approx(r["gbps"] / r["raw_ref_gbps"])
            assert ("meets_target" in r) == (fmt in bench.TARGET_FORMATS and op in bench.TARGET_OPS)
            assert r["ms"] == pytest.approx(bench.op_bytes(op, bench.Geometry(8, 64)) / r["gbps"] / 1e6)
    assert rows["zarr-3d"]["chunks"][0] == [8, 1]  # 3D chunks of 64 planes, clipped to the 8 there are
    refs = rows["zarr-3d"]["refs"]
    assert refs["zarr enable_gpu + da.from_zarr"] == {"skipped": "needs a GPU"}
    assert refs["zarr-python [:] -> cp.asarray"]["gbps"] > 0
    assert rows["raw"]["refs"]["np.fromfile"]["planes"] == 8
    text = capsys.readouterr().out
    assert "ms) [target 0.9x:" in text and "np.fromfile + same op" in text
    assert "derived op rate / whole compute() rate" in text
    assert "enable_gpu + da.from_zarr       skipped: needs a GPU" in text


def test_files_kept_in_dir_are_reused(bench, tmp_path, capsys):
    args = TINY + ["--only", "tiff", "--no-refs", "--dir", str(tmp_path), "--json"]
    bench.main(args + [str(tmp_path / "a.json")])
    bench.main(args + [str(tmp_path / "b.json")])
    bench.main(args + [str(tmp_path / "c.json"), "--fresh"])
    first, again, fresh = (json.loads((tmp_path / f"{n}.json").read_text())["rows"][0] for n in "abc")
    assert (first["reused"], again["reused"], fresh["reused"]) == (False, True, False)
    assert again["write_seconds"] == first["write_seconds"]
    assert again["correct"] and fresh["correct"]
    assert "files reused, written in" in capsys.readouterr().out
    kept = sorted(p.name for p in (tmp_path / "gpulazy-bench-formats").iterdir())
    tag = f"tiff-8x64x64-v{bench.WRITER_VERSION}"
    assert kept == [tag, f"{tag}.json"]


def test_budget_skips_and_names_the_rows_left(bench, tmp_path, capsys):
    out = tmp_path / "formats.json"
    assert bench.main(TINY + ["--only", "raw,zarr-3d", "--ops", "mip", "--budget-s", "0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["skipped"] for r in data["rows"]] == ["budget spent", "budget spent"]
    assert data["raw_refs"] == {"mip": {"skipped": "budget spent"}}
    assert data["skipped"] == ["np.fromfile + same op mip", "raw (all rows)", "zarr-3d (all rows)"]
    assert "skipped for the budget: np.fromfile + same op mip; raw (all rows); zarr-3d (all rows)" in \
        capsys.readouterr().out


def test_a_failing_row_is_reported_and_the_run_goes_on(bench, tmp_path, monkeypatch, capsys):
    def broken(a, g):
        raise ValueError("no mean today")

    monkeypatch.setitem(bench.OPS, "mean", ("mean()", broken))
    out = tmp_path / "formats.json"
    assert bench.main(TINY + ["--only", "raw,zarr-3d", "--ops", "mean,mip", "--no-refs", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["raw_refs"]["mean"] == {"error": "ValueError: no mean today"} and data["raw_refs"]["mip"]["correct"]
    assert [r["ops"]["mean"] for r in rows] == [{"error": "ValueError: no mean today"}] * 2
    assert all(r["ops"]["mip"]["correct"] for r in rows)
    assert "mean       mean()               failed: ValueError: no mean today" in capsys.readouterr().out


def test_unknown_names_are_refused(bench):
    with pytest.raises(SystemExit, match="unknown format zarr-4d; choose from raw, tiff"):
        bench.main(TINY + ["--only", "raw,zarr-4d"])
    with pytest.raises(SystemExit, match="unknown op median"):
        bench.main(TINY + ["--ops", "mip,median"])


def test_gpu_session_formats_mode(tmp_path):
    """gpu_session.sh's FORMATS mode passes its budget, formats and folder through (CPU-sized here)."""
    import os
    import subprocess

    root = BENCH.parents[1]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "python3"  # the script calls python3 (a symlink would lose the virtual environment)
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(root),
           "OUT": str(tmp_path / "out"), "FORMATS": "1", "FORMATS_BUDGET": "120", "FORMATS_SIZE": "64KiB",
           "FORMATS_ONLY": "raw,zarr-zstd-3d", "FORMATS_DIR": str(tmp_path / "data"),
           "FORMATS_ARGS": "--device cpu --side 64 --repeat 1 --no-refs"}
    for step in ("TESTS", "NOTEBOOKS", "BENCH", "OVERLAP", "PREFETCH"):
        env[f"SKIP_{step}"] = "1"
    r = subprocess.run(["bash", str(root / "benchmarks" / "gpu_session.sh")], cwd=root, env=env, check=False,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "out" / "formats.json").read_text())
    assert [row["format"] for row in data["rows"]] == ["raw", "zarr-zstd-3d"]
    assert data["ops"] == ["mip", "slice", "astype_sum", "mean", "plane", "map", "map_mip", "plane_int", "plane_dask",
                           "tile", "tile_dask", "plane_max", "plane_max_dask", "np_mip", "mip_dask", "slice_mip", "slice_mip_dask", "preview",
                           "preview_dask", "flip", "flip_dask"] and data["side"] == 64
    assert all(r["correct"] for row in data["rows"] for r in row["ops"].values())
    assert "budget 120 s" in (tmp_path / "out" / "formats.log").read_text()
    assert (tmp_path / "data" / "gpulazy-bench-formats").is_dir()


def _zstd_store(tmp_path, shape, chunks, seed):
    """A zstd-1 Zarr of random uint16 values, its path."""
    zarr = pytest.importorskip("zarr")
    from zarr.codecs import ZstdCodec

    data = np.random.default_rng(seed).integers(0, 4096, shape, dtype="u2")
    p = str(tmp_path / "z.zarr")
    zarr.create_array(p, shape=data.shape, chunks=chunks, dtype="u2", compressors=ZstdCodec(level=1))[...] = data
    return p


def _bench_module(name):
    sys.path.insert(0, str(BENCH.parent))
    return importlib.import_module(name)


def test_zstd_head_probe_reads_planes_from_heads_and_less(tmp_path, capsys):
    probe = _bench_module("zstd_head_probe")
    p = _zstd_store(tmp_path, (16, 256, 256), (4, 256, 256), seed=3)
    assert probe.main([p, "--device", "cpu", "--rounds", "2"]) == 0
    rows = {tuple(line.split()[:2]): float(line.split()[-2]) for line in capsys.readouterr().out.splitlines()
            if "heads=" in line}
    assert len(rows) == 10
    assert rows[("row2plane", "heads=True")] < rows[("row2plane", "heads=False")] / 2  # MiB read
    assert rows[("whole", "heads=True")] == rows[("whole", "heads=False")]


def test_read_timeline_times_each_op_and_draws_its_submissions(tmp_path, capsys):
    probe = _bench_module("read_timeline")
    p = _zstd_store(tmp_path, (16, 64, 64), (4, 32, 32), seed=4)
    from gpulazy.read import whole

    before = (whole.GROUP, whole.DECODE_GROUP, whole.SETTLERS)
    assert probe.main([p, "--device", "cpu", "--rounds", "2", "--timeline", "whole,slice", "--sweep"]) == 0
    assert (whole.GROUP, whole.DECODE_GROUP, whole.SETTLERS) == before  # the sweep's settings put back
    out = capsys.readouterr().out
    assert sum(line.split()[0] in ("whole", "slice", "rows", "mip", "mean") and "x the whole" in line
               for line in out.splitlines()) == 5
    events = [line.split() for line in out.splitlines() if " submit " in line or " finish " in line]
    assert any(e[4] == "submit" for e in events) and any(e[4] == "finish" for e in events)
    assert all(float(e[0]) <= float(e[2]) for e in events)  # each event ends after it starts
    assert len([line for line in out.splitlines() if line[:22].strip() in probe.SWEEP]) == len(probe.SWEEP)
    from gpulazy.read import engine
    assert engine.start.__module__ == "gpulazy.read.engine"  # the timeline's wrappers removed


def test_read_timeline_times_each_op_up_to_its_first_submission(tmp_path, capsys):
    probe = _bench_module("read_timeline")
    p = _zstd_store(tmp_path, (16, 64, 64), (4, 32, 32), seed=5)
    from gpulazy.read import engine

    real = engine.start
    assert probe.main([p, "--device", "cpu", "--rounds", "1", "--timeline", "", "--first"]) == 0
    assert engine.start is real  # put back
    firsts = {line.split()[0]: float(line.split()[3]) for line in capsys.readouterr().out.splitlines()
              if "first submission" in line}
    assert set(firsts) == {"whole", "slice", "rows", "mip", "mean", "astype_sum"}
    assert all(0 < t < 1e3 for t in firsts.values())
