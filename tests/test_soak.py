"""The soak in CI: ``benchmarks/soak.py`` on the CPU path for 45 s (``GPULAZY_SOAK_SECONDS`` to change).

Random datasets, chunkings, schedulers (fast path, sync, threads, in-process distributed),
cache pressure, read-ahead and verify; every result checked against NumPy. The GPU
variant runs the same on ``cuda:0`` (the 10-minute run is ``python benchmarks/soak.py
--seconds 600 --device cuda:0 --distributed``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

SECONDS = float(os.environ.get("GPULAZY_SOAK_SECONDS", "45"))


def _soak_module():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "soak.py")
    spec = importlib.util.spec_from_file_location("gpulazy_soak", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check(report):
    assert report["rounds"] >= 5, report
    assert report["mismatches"] == 0, report.get("mismatch_examples")
    assert report["errors"] == 0, report["error_examples"]
    assert report["samples_over_capacity"] == 0 and report["peak_cache_bytes"] > 0, report
    assert report["reads"] > 0 and report["bytes"] > 0
    assert not report["threads_left"] and report["fds_left"] == 0, report
    assert len(report["by_scheduler"]) >= 3, report["by_scheduler"]  # several schedulers were exercised
    assert report["ok"]


@pytest.mark.slow
@pytest.mark.timeout(SECONDS + 60)
def test_soak_cpu(tmp_path):
    _check(_soak_module().soak(SECONDS, device="cpu", size=2 << 20, seed=int(os.environ.get("GPULAZY_SOAK_SEED", "0")),
                               distributed=True, workdir=str(tmp_path)))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(SECONDS + 120)
def test_soak_gpu(tmp_path):
    report = _soak_module().soak(SECONDS, device="cuda:0", size=64 << 20, seed=1, distributed=True,
                                 workdir=str(tmp_path))
    _check(report)
    assert report["peak_device_bytes"] > 0
