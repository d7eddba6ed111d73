"""``benchmarks/run.py --smoke``: the full suite, CPU-sized, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_suite_smoke(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--json", str(out),
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["graph"]["chunks"] == 2000
    assert 0 < doc["import_seconds"] < 10
    methods = {(row["scenario"], row["method"]) for row in doc["results"] if row.get("gbps")}
    for scenario in ("one file", "many files"):
        assert {(scenario, "numpy_fromfile"), (scenario, "dask_memmap"), (scenario, "gpulazy")} <= methods
    names = [t["target"] for t in doc["targets"]]
    assert "import gpulazy" in names and "many files: gpulazy warm / dask memmap" in names
    # GPU-only targets are marked not applicable on cpu, never passed or failed.
    assert all(t["ok"] is None for t in doc["targets"] if "warm GB/s" in t["target"])
    assert "targets:" in r.stdout and "gpulazy.from_files" in r.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # data removed
