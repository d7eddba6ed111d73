"""benchmarks/bench_napari.py at a tiny size: every shown pixel checked, the page cache really
dropped (mincore), the GPU presets and the plane-first comparison wired."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

pytest.importorskip("napari", reason="the napari extra is not installed")

BENCHMARKS = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")


@pytest.fixture(scope="module")
def bench():
    with pytest.MonkeyPatch.context() as mp:  # benchmarks/ is no package: on the path while imported
        mp.syspath_prepend(BENCHMARKS)
        return importlib.import_module("bench_napari")


def _read_all(files):
    for f in files:
        with open(f, "rb") as fh:
            fh.read()


def test_drop_evicts_every_chunk_file_of_a_zarr_store(bench, tmp_path):
    path = bench.write_zarr(str(tmp_path), planes=8, size=64, chunks=(4, 32, 32))
    files = bench.volume_files(path)
    chunk_files = [f for f in files if os.path.basename(f)[0].isdigit() or os.sep + "c" + os.sep in f]
    assert len(chunk_files) >= 8                                        # 2 x 2 x 2 chunks, each a file
    _read_all(files)
    if bench.resident_fraction(files) < 0.9:
        pytest.skip("this filesystem does not keep read pages resident (tmpfs-like): nothing to drop")
    assert bench.drop_volume_pages(path, resident_max=0.0) == 0.0
    assert bench.resident_fraction(chunk_files) == 0.0


def test_drop_says_so_when_pages_stay(bench, tmp_path, monkeypatch):
    path = bench.write_volume(str(tmp_path), planes=4, size=32)
    monkeypatch.setattr(bench, "resident_fraction", lambda files: 0.5)    # e.g. tmpfs keeps them
    with pytest.raises(RuntimeError, match="still in the page cache"):
        bench.drop_volume_pages(path, resident_max=0.02)


def test_tiny_run_checks_every_pixel_drops_the_page_cache_and_compares(bench, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench.main(["--device", "cpu", "--format", "zarr-zstd", "--planes", "16", "--size", "64",
                     "--chunks", "4,32,32", "--steps", "4", "--after-jump", "2", "--rate", "0",
                     "--start", "1", "--jump-to", "12", "--dir", str(tmp_path), "--cache", "8 MiB",
                     "--drop-page-cache", "--resident-max", "1", "--compare", "--repeat", "2",
                     "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert set(r) >= {"gpulazy-serial", "gpulazy", "dask", "targets"}
    pre = r["gpulazy"]["prefetch"]
    assert pre["forward"]["n"] == 2 * 4 and pre["after_jump"]["n"] == 2 * 2 and len(pre["jumps_ms"]) == 2
    assert pre["jump_ms"] == pytest.approx(float(np.median(pre["jumps_ms"])))
    assert "resident_after_drop" in pre and "resident_after_drop" not in r["gpulazy"]["cached"]
    assert r["targets"]["page_cache"] == "dropped"
    assert r["targets"]["dask_p95_ms"] == r["dask"]["cold"]["forward"]["p95_ms"]
    assert "page cache dropped: prefetch forward p95" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(tmp_path, "bench-napari-16x64x64-4x32x32-v2.zarr"))   # not --keep


def test_presets_set_the_gpu_volumes_and_flags_win(bench, monkeypatch):
    seen = {}

    def stop(**what):                                                   # no 8 GiB written here
        seen.update(what)
        raise SystemExit(0)

    monkeypatch.setattr(bench, "write_volume", lambda folder, planes, size: stop(raw=(planes, size)))
    monkeypatch.setattr(bench, "write_zarr", lambda folder, planes, size, chunks: stop(zarr=(planes, size, chunks)))
    for argv in (["--preset", "gpu-raw", "--device", "cpu"],
                 ["--preset", "gpu-zstd", "--device", "cpu", "--planes=600"]):
        with pytest.raises(SystemExit):
            bench.main(argv)
    assert seen == {"raw": (512, 2048), "zarr": (600, 2048, (32, 512, 512))}
    assert 512 * 2048 * 2048 * 4 == 8 << 30 and 512 * 2048 * 2048 * 2 == 4 << 30
