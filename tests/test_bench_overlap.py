"""``benchmarks/bench_overlap.py`` on the CPU at tiny sizes: every issue-20 row is there, checked
against the raw way, with its ratios to the whole read and to the raw way; ``--read-ahead``
repeats the derived rows under each value."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_overlap.py"
sys.path.insert(0, str(BENCH.parent))  # the benchmarks import as modules, as test_bench_cache does
DERIVED = ["MIP max(axis=0)", "dask.compute(min(), max())", "np.histogram(bins=256)", "argmax(axis=0)", "[1:half+1] compute()", "[every 4th plane as a list] compute()", "[::4].max(axis=0)",
           "[every 4th plane as a list].max(axis=0)", "astype(f8).sum()", "mean()", "map_blocks(b * 2)",
           "(a - b).max(axis=0), two arrays", "(a + b + c + d).max(axis=0), four arrays"]


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("bench_overlap")


def test_rows_ratios_and_read_ahead_sweep(bench, tmp_path, capsys):
    out = tmp_path / "overlap.json"
    assert bench.main(["--device", "cpu", "--planes", "6", "--mib", "0.0625", "--repeat", "1", "--no-overlap",
                       "--read-ahead", "0,1MiB", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["paths"]["rows"]
    whole = {"one file compute()": rows["one file compute()"], "planes compute()": rows["planes compute()"]}
    for name in ["one file compute()", "planes compute()", "planes persist()", *DERIVED, "[:half] compute()"]:
        r = rows[name]
        assert r["correct"] is True, name
        assert r["x_raw"] == pytest.approx(r["gpulazy"] / r["raw"]) and r["naive"] > 0, name
    for name in DERIVED:
        base = whole["one file compute()" if name.startswith("astype") else "planes compute()"]
        assert rows[name]["x_whole"] == pytest.approx(rows[name]["gpulazy"] / base["gpulazy"])
        for value in ("0", "1MiB"):
            swept = rows[f"{name} read_ahead={value}"]
            assert swept["correct"] is True
            assert swept["x_whole"] == pytest.approx(swept["gpulazy"] / base["gpulazy"])
            assert swept["x_raw"] == pytest.approx(swept["gpulazy"] / rows[name]["raw"])
    dask_map = rows["map_blocks(b * 2), streamed_maps=False (dask's tasks)"]
    assert dask_map["x_whole"] == pytest.approx(dask_map["gpulazy"] / whole["planes compute()"]["gpulazy"])
    assert rows["(a - b).max(axis=0), two arrays, streamed_maps=False (dask's tasks)"]["gpulazy"] > 0
    assert rows["(a + b + c + d).max(axis=0), four arrays, streamed_maps=False (dask's tasks)"]["gpulazy"] > 0
    cached = rows["MIP again from DeviceCache"]
    assert cached["x_reread"] > 0
    assert cached["x_raw"] == pytest.approx(cached["gpulazy"] / rows["MIP max(axis=0)"]["raw"])
    text = capsys.readouterr().out
    assert "x whole" in text and "mean() read_ahead=1MiB" in text and "VALUES DIFFER" not in text


def test_agree_tells_results_apart(bench):
    import numpy as np

    a = np.arange(12, dtype=np.uint16).reshape(3, 4)
    assert bench._agree(np, a, a.view(np.uint8).reshape(-1))  # the raw way's bytes
    b = a.copy()
    b[2, 3] += 1
    assert not bench._agree(np, a, b)
    assert bench._agree(np, np.float64(66.0), 66.0) and not bench._agree(np, np.float64(66.0), 66.5)


def test_read_ahead_values_are_checked_first(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", "--read-ahead", "1GiB,lots"])
    assert e.value.code == 2
    assert "--read-ahead: cannot read 'lots' as a byte count" in capsys.readouterr().err


def test_the_overlap_table_shows_the_streamed_map_beside_prefetch(bench):
    paths = {"device": "cpu", "planes": 2, "plane_bytes": 1 << 20, "total_bytes": 2 << 20, "rows": {}}
    cell = {"seconds_read": 0.04, "seconds_compute": 0.05, "ratio_naive": 1.9, "ratio": 1.3, "hit_rate": 1.0,
            "ratio_streamed": 1.07}
    text = bench.table({"repeat": 1, "paths": paths, "overlap": {"matmul/sync": cell}})
    header, row = text.splitlines()[-2:]
    assert "streamed x" in header and row.split()[-1] == "1.07" and row.split()[-3] == "1.30"
