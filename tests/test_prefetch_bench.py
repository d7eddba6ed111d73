"""The read-ahead benchmark runs on CPU at tiny sizes and reports consistent figures."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_prefetch.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_prefetch", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("compute", ["xp", "sleep"])
def test_run_reports_consistent_figures(bench, compute):
    r = bench.run(device="cpu", chunks=8, chunk_mib=0.125, depth=3, compute=compute, repeat=3)
    assert r["device"] == "cpu" and r["chunks"] == 8 and r["chunk_bytes"] == 32 * 1024 * 4
    for key in ("seconds_read", "seconds_compute", "seconds_naive", "seconds_prefetch"):
        assert r[key] > 0
    assert r["ratio_best"] == pytest.approx(r["seconds_prefetch"] / max(r["seconds_read"], r["seconds_compute"]))
    rounds = r["rounds"]
    assert len(rounds) == 3 and all(set(x) == {"read", "compute", "naive", "prefetch", "streamed", "read streamed",
                                               "compute loop"} for x in rounds)
    assert r["ratio_streamed"] == pytest.approx(sorted(
        x["streamed"] / max(min(x["read"], x["read streamed"]), min(x["compute"], x["compute loop"]))
        for x in rounds)[1])
    assert r["ratio"] == pytest.approx(sorted(x["prefetch"] / max(x["read"], x["compute"]) for x in rounds)[1])
    assert r["seconds_read"] == min(x["read"] for x in rounds)
    assert r["meets_target"] == (r["ratio"] <= 1.15)
    assert r["prefetched"] + r["misses"] == 8
    assert r["hit_rate"] >= 0.5  # at least most chunks came from read-ahead
    assert 0 < r["cache_peak_bytes"] <= r["cache_capacity"] and r["cache_peak_within_capacity"]
    assert r["lookahead_peak_bytes"] <= r["lookahead_budget"] <= r["cache_capacity"] // 2
    assert r["lookahead_peak_bytes"] <= 3 * r["chunk_bytes"]
    text = bench.table(r)
    assert "read + compute, prefetch" in text and "hit rate" in text and "ratio streamed" in text


def test_main_writes_json(bench, tmp_path, capsys):
    out = tmp_path / "sub" / "prefetch.json"
    assert bench.main(["--device", "cpu", "--chunks", "4", "--chunk-mib", "0.0625", "--depth", "2",
                       "--repeat", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["chunks"] == 4 and data["depth"] == 2 and data["device"] == "cpu"
    assert "ratio prefetch / max(read, compute)" in capsys.readouterr().out


def test_prefetch_host_time_times_each_function_and_puts_them_back(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    probe = importlib.import_module("prefetch_host_time")
    from gpulazy.cache import DeviceCache

    real_get = DeviceCache.get
    assert probe.main(["sync", "--device", "cpu", "--chunks", "8", "--chunk-mib", "0.25", "--passes", "2"]) == 0
    assert DeviceCache.get is real_get  # the wrappers removed
    out = capsys.readouterr().out
    passes = out.split("== ")[1:]
    assert [p.split(":")[0] for p in passes] == ["compute alone", "without prefetch", "prefetch"]
    rows = {line.split()[-1]: float(line.split()[2]) for line in passes[2].splitlines()[1:] if " ms " in line}
    assert rows["ChunkSource.load"] == 8.0 and rows["ReadAhead.issue"] >= 1  # calls a pass: a load per chunk
    assert "ReadAhead.issue" not in passes[1] and "ChunkSource.load" not in passes[0]
