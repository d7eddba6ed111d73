"""The ``gpulazy`` command line: info, bench, demo, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gpulazy import _bench
from gpulazy.cli import main, write_volume


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- info -------------------------------------------------------------------------------
def test_info_text(capsys):
    code, out, err = run(capsys, "info")
    assert code == 0, err
    for word in ("numpy", "dask", "distributed", "cupy", "kvikio", "backend (auto):", "GPUDirect Storage",
                 "chunk_size", "cpu"):
        assert word in out


def test_info_json(capsys):
    code, out, _ = run(capsys, "info", "--json")
    assert code == 0
    info = json.loads(out)
    assert set(info["packages"]) >= {"numpy", "dask", "distributed", "cupy", "kvikio"}
    assert info["packages"]["numpy"] == np.__version__
    assert info["devices"][0]["name"] == "cpu" and info["devices"][0]["total_bytes"] > 0
    assert len(info["devices"]) == 1 + info["gpu_count"]
    assert info["backend"]["name"] in ("posix", "kvikio") and info["backend"]["reason"]
    assert set(info["config"]) >= {"device", "backend", "threads", "cache"}
    assert isinstance(info["gds"]["active"], bool) and info["gds"]["reason"]


def test_info_cpu_says_why_no_gds(capsys):
    code, out, _ = run(capsys, "info", "--json", "--device", "cpu")
    info = json.loads(out)
    assert info["device"] == "cpu" and info["backend"]["name"] == "posix"
    assert info["gds"]["active"] is False and "no GPU" in info["gds"]["reason"]


def test_info_reports_missing_package(capsys, monkeypatch):
    import importlib.metadata as md

    real = md.version
    monkeypatch.setattr(md, "version", lambda name: (_ for _ in ()).throw(md.PackageNotFoundError(name))
                        if name.startswith("torch") else real(name))
    code, out, _ = run(capsys, "info", "--json", "--device", "cpu")
    assert json.loads(out)["packages"]["torch"] == "not installed"


# -- demo -------------------------------------------------------------------------------
def test_demo_cpu(capsys, tmp_path):
    code, out, err = run(capsys, "demo", "--size", "16MiB", "--device", "cpu", "--dir", str(tmp_path))
    assert code == 0, err
    assert "GB/s" in out and "backend: posix" in out and "max-intensity projection" in out
    assert os.listdir(tmp_path) == []  # cleaned up


def test_demo_keep(capsys, tmp_path):
    code, out, _ = run(capsys, "demo", "--size", "4MiB", "--device", "cpu", "--dir", str(tmp_path), "--keep")
    assert code == 0
    (folder,) = os.listdir(tmp_path)
    files = sorted(os.listdir(tmp_path / folder))
    assert len(files) >= 16 and all(f.endswith(".raw") for f in files)


def test_demo_volume_oracle(tmp_path):
    # The demo checks its projection against a pattern computed without reading the files:
    # the pattern must be what the files hold.
    paths, side, expected = write_volume(str(tmp_path), 3 << 20, show_progress=False)
    stack = np.stack([np.fromfile(p, dtype=np.uint16).reshape(side, side) for p in paths])
    assert len(paths) >= 16
    np.testing.assert_array_equal(stack.max(axis=0), expected)
    assert not np.array_equal(stack[0], stack[1])


@pytest.mark.gpu
def test_demo_gpu(capsys, tmp_path):
    code, out, err = run(capsys, "demo", "--size", "64MiB", "--device", "cuda:0", "--dir", str(tmp_path))
    assert code == 0, err
    assert "onto cuda:0" in out and "GB/s" in out and "GPUDirect Storage" in out


# -- bench ------------------------------------------------------------------------------
def test_bench_generate_cpu_json(capsys, tmp_path):
    out_json = tmp_path / "out.json"
    code, out, err = run(capsys, "bench", "--generate", "32MiB", "--files", "8", "--device", "cpu",
                         "--repeat", "1", "--json", str(out_json), "--dir", str(tmp_path / "data"))
    assert code == 0, err
    doc = json.loads(out_json.read_text())
    rows = doc["results"]
    assert {r["method"] for r in rows} == set(_bench.METHODS)
    assert {r["scenario"] for r in rows} == {"one file", "many files", "many files, max(axis=0)"}
    for method in ("dask_mip", "gpulazy_mip"):  # the derived row: a MIP over the 8 files, warm
        (r,) = [r for r in rows if r["method"] == method and r["mode"] == "warm"]
        assert r["scenario"] == "many files, max(axis=0)" and r["mode"] == "warm" and r["gbps"] > 0, r
    assert [r["versus"] for r in doc["ratios"] if r["scenario"] == "many files, max(axis=0)"] == ["dask_mip"]
    for scenario in ("one file", "many files"):
        for mode in ("warm", "cold"):
            for method in ("numpy_fromfile", "dask_memmap", "gpulazy"):
                (r,) = [r for r in rows if (r["scenario"], r["mode"], r["method"]) == (scenario, mode, method)]
                assert "error" not in r, r
                assert r["gbps"] > 0 and r["nbytes"] == 32 << 20
    gpu_only = [r for r in rows if r["method"] in ("pinned_h2d", "kvikio_pread", "torch_fromfile", "kvikio_mip")]
    assert all(r["skipped"] for r in gpu_only)
    assert {(r["versus"], r["mode"]) for r in doc["ratios"]} >= {("dask_memmap", "warm"), ("numpy_fromfile", "cold")}
    assert "gpulazy.from_files" in out and "da.from_array(np.memmap)" in out
    assert os.listdir(tmp_path / "data") == []  # generated files removed


def test_bench_existing_file_warm_only(capsys, tmp_path):
    path = tmp_path / "x.raw"
    np.arange(1 << 20, dtype=np.uint32).tofile(path)
    out_json = tmp_path / "r.json"
    code, out, err = run(capsys, "bench", str(path), "--warm", "--repeat", "2", "--device", "cpu",
                         "--methods", "numpy_fromfile,gpulazy", "--json", str(out_json))
    assert code == 0, err
    assert "one file: 4.00 MiB in 1 file(s)" in out and "cold GB/s" not in out
    rows = json.loads(out_json.read_text())["results"]
    assert [(r["method"], r["mode"], len(r["seconds"])) for r in rows] == [("numpy_fromfile", "warm", 2),
                                                                        ("gpulazy", "warm", 2)]
    assert path.exists()  # a given file is never removed


def test_bench_plot_draws_every_measured_method(capsys, tmp_path):
    path = tmp_path / "x.raw"
    np.arange(1 << 18, dtype=np.uint32).tofile(path)
    png = tmp_path / "bench.png"
    code, out, err = run(capsys, "bench", str(path), "--warm", "--repeat", "1", "--device", "cpu",
                         "--methods", "numpy_fromfile,dask_memmap,gpulazy", "--plot", str(png))
    assert code == 0, err
    assert f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    import matplotlib.pyplot as plt

    calls = []
    real = plt.Axes.barh

    def spy(ax, y, width, *a, **k):
        calls.append(list(width))
        return real(ax, y, width, *a, **k)

    rows = [{"scenario": "s", "mode": m, "label": lab, "gbps": g, "nbytes": 1 << 20, "files": 1, "device": "cpu"}
            for lab, g in (("a", 1.0), ("gpulazy", 20.0)) for m in ("warm", "cold")]
    try:
        plt.Axes.barh = spy
        _bench.plot_results(rows, str(tmp_path / "two.png"))
    finally:
        plt.Axes.barh = real
    assert calls == [[1.0, 20.0], [1.0, 20.0]]  # one bar per method, warm then cold


def test_bench_keep_says_where(capsys, tmp_path):
    code, out, _ = run(capsys, "bench", "--generate", "1MiB", "--files", "2", "--warm", "--repeat", "1",
                       "--methods", "numpy_fromfile", "--device", "cpu", "--dir", str(tmp_path), "--keep")
    assert code == 0
    (folder,) = os.listdir(tmp_path)
    assert f"kept the generated files in {tmp_path / folder}" in out
    assert sorted(os.listdir(tmp_path / folder)) == ["many", "one"]


def test_bench_bad_path_exit_2(capsys, tmp_path):
    missing = str(tmp_path / "nope.raw")
    code, out, err = run(capsys, "bench", missing, "--device", "cpu")
    assert code == 2
    assert missing in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bench_unknown_method_exit_2(capsys, tmp_path):
    code, _, err = run(capsys, "bench", "--generate", "1MiB", "--methods", "nope", "--device", "cpu")
    assert code == 2 and "'nope'" in err and "numpy_fromfile" in err


def test_bench_folder_of_unequal_files_exit_2(capsys, tmp_path):
    (tmp_path / "a.raw").write_bytes(b"x" * 10)
    (tmp_path / "b.raw").write_bytes(b"x" * 20)
    code, _, err = run(capsys, "bench", str(tmp_path), "--device", "cpu")
    assert code == 2 and str(tmp_path) in err and "sizes" in err


def test_bad_size_and_device_exit_2(capsys):
    code, _, err = run(capsys, "demo", "--size", "lots", "--device", "cpu")
    assert code == 2 and "'lots'" in err
    code, _, err = run(capsys, "info", "--device", "tpu:0")
    assert code == 2 and "'tpu:0'" in err


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_traceback(tmp_path, where):
    argv = ["bench", str(tmp_path / "missing"), "--device", "cpu"]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    with pytest.raises(FileNotFoundError):
        main(argv)


def test_usage_error_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2


@pytest.mark.gpu
def test_bench_gpu_all_methods(capsys, tmp_path):
    out_json = tmp_path / "gpu.json"
    code, out, err = run(capsys, "bench", "--generate", "256MiB", "--files", "16", "--device", "cuda:0",
                         "--repeat", "1", "--json", str(out_json), "--dir", str(tmp_path / "data"))
    assert code == 0, err
    rows = json.loads(out_json.read_text())["results"]
    for method in ("pinned_h2d", "numpy_fromfile", "dask_memmap", "kvikio_pread", "gpulazy"):
        ok = [r for r in rows if r["method"] == method and r.get("gbps")]
        assert ok, [r for r in rows if r["method"] == method]
    peaks = [r for r in rows if r["method"] == "gpulazy" and "peak_device_bytes" in r]
    assert peaks and all(r["result_bytes"] == 256 << 20 for r in peaks)


# -- the installed entry points -----------------------------------------------------------
def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "gpulazy", "info", "--json", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["device"] == "cpu"


def test_python_dash_m_error_has_no_traceback(tmp_path):
    missing = str(tmp_path / "missing.raw")
    r = subprocess.run([sys.executable, "-m", "gpulazy", "bench", missing], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and missing in r.stderr and "Traceback" not in r.stderr


# -- _bench helpers -----------------------------------------------------------------------
def test_check_result_catches_a_wrong_byte(tmp_path):
    ds = _bench.generate(str(tmp_path), 1 << 20, 4, show_progress=False)
    good = [np.fromfile(p, dtype=ds.dtype) for p in ds.paths]
    _bench.check_result(good, ds)
    _bench.check_result(np.stack(good), ds)
    bad = np.stack(good)
    bad[-1, -1] ^= 1
    with pytest.raises(AssertionError, match="differ"):
        _bench.check_result(bad, ds)


def test_generate_sizes_and_distinct_files(tmp_path):
    ds = _bench.generate(str(tmp_path), 10 << 20, 3, show_progress=False)
    assert ds.file_nbytes % 4096 == 0 and len(ds.paths) == 3
    assert all(os.path.getsize(p) == ds.file_nbytes for p in ds.paths)
    a, b = (np.fromfile(p, dtype=np.uint8) for p in ds.paths[:2])
    assert not np.array_equal(a, b)


def test_drop_and_prime_page_cache_keep_bytes(tmp_path):
    ds = _bench.generate(str(tmp_path), 1 << 20, 2, show_progress=False)
    before = [np.fromfile(p, dtype=np.uint8) for p in ds.paths]
    _bench.drop_page_cache(ds.paths)
    _bench.prime_page_cache(ds.paths)
    for p, b in zip(ds.paths, before):
        np.testing.assert_array_equal(np.fromfile(p, dtype=np.uint8), b)


def test_format_table_shows_ratio():
    rows = [
        {"scenario": "one file", "mode": "warm", "method": "dask_memmap", "label": "memmap", "nbytes": 1 << 30,
         "files": 1, "device": "cpu", "gbps": 1.0, "seconds": [1.0]},
        {"scenario": "one file", "mode": "warm", "method": "gpulazy", "label": "gpulazy", "nbytes": 1 << 30,
         "files": 1, "device": "cpu", "gbps": 25.0, "seconds": [0.04]},
    ]
    text = _bench.format_table(rows)
    assert "25.00×" in text and "25.00" in text
    assert _bench.ratios(rows) == [{"scenario": "one file", "mode": "warm", "versus": "dask_memmap", "ratio": 25.0}]
