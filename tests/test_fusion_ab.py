"""The fusion A/B benchmark switches dask's fusion of gpulazy's read tasks, times both, and puts the switch back."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
from dask._task_spec import Alias
from dask.callbacks import Callback

import gpulazy
from gpulazy._readlayer import ReadTask

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
fusion_ab = importlib.import_module("fusion_ab")


def _aliases(arr) -> int:
    seen: list = []
    with Callback(start=lambda dsk: seen.extend(t for t in dsk.values() if type(t) is Alias)):
        arr.compute(scheduler="sync")
    return len(seen)


def test_the_switch_lets_dask_fuse_the_reads_and_goes_back(tmp_path):
    data = np.arange(8 * 16, dtype="float32").reshape(8 * 2, 8)
    path = tmp_path / "a.raw"
    data.tofile(path)
    vol = gpulazy.from_files(str(path), shape=data.shape, dtype="float32", chunks=(2, 8), device="cpu", cache=False)
    with gpulazy.config.set(streamed_maps=False):  # dask's tasks (a streamed map has no graph to fuse)
        x = vol.map_blocks(np.negative)
    original = ReadTask.__dict__["block_fusion"]
    try:
        fusion_ab.set_fused(True)
        assert _aliases(x) == 8  # a fused read + negative per chunk, its old key an alias
        fusion_ab.set_fused(False)
        assert _aliases(x) == 0
    finally:
        ReadTask.block_fusion = original


def test_run_on_cpu_reports_every_pass_both_ways_and_restores_the_switch(capsys):
    before = ReadTask.__dict__["block_fusion"]
    r = fusion_ab.run(device="cpu", chunks=6, chunk_mib=0.0625, depth=2, compute="xp", repeat=2)
    assert ReadTask.__dict__["block_fusion"] is before
    for name in fusion_ab.PASSES:
        assert r[f"seconds_{name}_unfused"] > 0 and r[f"seconds_{name}_fused"] > 0
        assert r[f"{name}_unfused_over_fused"] > 0
    assert r["ratio_prefetch_unfused"] > 0 and r["ratio_prefetch_fused"] > 0 and r["ratio_floor"] > 0
    assert fusion_ab.main(["--device", "cpu", "--chunks", "4", "--chunk-mib", "0.0625", "--depth", "2",
                           "--compute", "xp", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "unfused / fused" in out and "prefetch / max(read, compute)" in out
