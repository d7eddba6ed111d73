"""The cache benchmark runs on the CPU and its figures add up."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_cache  # noqa: E402


def test_cache_benchmark_counts_one_miss_per_chunk_then_hits():
    r = bench_cache.run(device="cpu", size="16MiB", repeat=2)
    assert r["misses"] == r["chunks"] and r["hits"] == 2 * r["chunks"]
    assert 0 < r["bytes_held"] <= r["capacity"]
    assert r["first_seconds"] > 0 and r["cached_seconds"] > 0 and r["speedup"] == r["first_seconds"] / r["cached_seconds"]
