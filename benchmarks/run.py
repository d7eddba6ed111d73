"""The full side-by-side benchmark, with the targets of the design checked.

Run from the repository root::

    python benchmarks/run.py --json bench.json            # 4 GiB, one file and 256 × 16 MiB
    python benchmarks/run.py --smoke                      # CPU-sized, a few seconds

Measures, in one run: ``import gpulazy`` time (fresh interpreters), the time to build
a 100,000-chunk graph, and every read method of ``gpulazy._bench`` (warm and cold, one
big file and many slice files); then prints the results table and the targets with
PASS / FAIL. The JSON is rewritten after every measurement, so a run cut short by a
time limit still leaves what it measured. ``--check`` exits 1 when a target fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
try:
    import gpulazy  # noqa: F401
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(ROOT))

from gpulazy import _bench, config  # noqa: E402
from gpulazy.device import get_device  # noqa: E402

# The design's targets (docs/ARCHITECTURE.md, "Targets").
WARM_GBPS = 45.0
WARM_OF_PINNED = 0.8
COLD_OF_ODIRECT = 0.95
TIMES_DASK_MEMMAP = 20.0
PEAK_OF_RESULT = 1.1
IMPORT_SECONDS = 0.5


def import_time(runs: int = 3) -> float:
    """Best time of ``import gpulazy`` in fresh interpreters (seconds)."""
    code = "import time; t = time.perf_counter(); import gpulazy; print(time.perf_counter() - t)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    times = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
        times.append(float(out.stdout.strip()))
    return min(times)


def graph_build_time(folder: str, chunks: int, device: str) -> dict[str, Any]:
    """Seconds for ``from_files`` to index a file and build a graph of ``chunks`` read tasks.

    The file is sparse (``truncate``): building a graph reads no data.
    """
    import gpulazy

    row_bytes = 4096
    path = os.path.join(folder, "graph.raw")
    with open(path, "wb") as f:
        f.truncate(chunks * row_bytes)
    # Warm-up on a small graph: the first call imports dask.array (and CuPy); not graph building.
    small = gpulazy.from_files(path, shape=(chunks, row_bytes), dtype="uint8",
                               chunks=(max(1, chunks // 4), row_bytes), device=device, cache=False)
    # ... and its sum compiles CuPy's reduction kernels (tens of seconds on a fresh GPU
    # host), which is not what the culled compute below measures.
    small[:1].sum().compute()
    t0 = time.perf_counter()
    arr = gpulazy.from_files(path, shape=(chunks, row_bytes), dtype="uint8", chunks=(1, row_bytes),
                             device=device, cache=False)
    seconds = time.perf_counter() - t0
    n = arr.npartitions
    t0 = time.perf_counter()
    arr[::max(1, chunks // 10)].sum().compute()  # a small compute over the big graph (culled)
    cull_seconds = time.perf_counter() - t0
    os.remove(path)
    return {"chunks": n, "seconds": seconds, "small_compute_seconds": cull_seconds}


def _row(rows: list[dict], scenario: str, mode: str, method: str) -> dict | None:
    return next((r for r in rows if (r["scenario"], r["mode"], r["method"]) == (scenario, mode, method)), None)


def _gbps(rows: list[dict], scenario: str, mode: str, method: str) -> float | None:
    r = _row(rows, scenario, mode, method)
    return r.get("gbps") if r else None


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with its measured value and ``ok`` (True / False / None when not measurable here)."""
    rows, gpu = doc["results"], doc["device"] != "cpu"
    out: list[dict[str, Any]] = []

    def add(name: str, measured: float | None, goal: float, unit: str, higher: bool = True,
            applies: bool = True) -> None:
        ok = None if (measured is None or not applies) else (measured >= goal if higher else measured <= goal)
        out.append({"target": name, "measured": measured, "goal": goal, "unit": unit, "ok": ok,
                    "note": "" if applies else "GPU targets; not applicable on cpu"})

    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        g_warm = _gbps(rows, scenario, "warm", "gpulazy")
        g_cold = _gbps(rows, scenario, "cold", "gpulazy")
        pinned = _gbps(rows, scenario, "warm", "pinned_h2d")
        odirect = _gbps(rows, scenario, "cold", "o_direct")
        memmap = _gbps(rows, scenario, "warm", "dask_memmap")
        add(f"{scenario}: gpulazy warm GB/s", g_warm, WARM_GBPS, "GB/s", applies=gpu)
        add(f"{scenario}: gpulazy warm / pinned copy", g_warm / pinned if g_warm and pinned else None,
            WARM_OF_PINNED, "×", applies=gpu)
        add(f"{scenario}: gpulazy warm / dask memmap", g_warm / memmap if g_warm and memmap else None,
            TIMES_DASK_MEMMAP, "×", applies=gpu)
        add(f"{scenario}: gpulazy cold / O_DIRECT 16 threads", g_cold / odirect if g_cold and odirect else None,
            COLD_OF_ODIRECT, "×")
        peaks = [r["peak_device_bytes"] / r["result_bytes"] for r in rows
                 if r["scenario"] == scenario and r.get("peak_device_bytes") is not None and r.get("result_bytes")]
        add(f"{scenario}: gpulazy peak device memory / result", max(peaks) if peaks else None, PEAK_OF_RESULT,
            "×", higher=False, applies=gpu)
    add("import gpulazy", doc.get("import_seconds"), IMPORT_SECONDS, "s", higher=False)
    return out


def format_targets(rows: list[dict[str, Any]]) -> str:
    lines = [f"  {'target':<56} {'measured':>10} {'goal':>10}   result"]
    for t in rows:
        m = "—" if t["measured"] is None else f"{t['measured']:.3g}"
        goal = f"{'≥' if t['unit'] != 's' and 'peak' not in t['target'] else '≤'} {t['goal']:g}"
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["ok"]]
        note = f" ({t['note']})" if t["note"] and t["ok"] is None else ""
        lines.append(f"  {t['target']:<56} {m:>10} {goal:>10} {t['unit']:<5} {verdict}{note}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="4GiB", help="bytes in each data set (default 4GiB)")
    p.add_argument("--files", type=int, default=256, help="slice files of the many-files data set (default 256)")
    p.add_argument("--device", help="'cuda:N' or 'cpu' (default: a GPU if usable)")
    p.add_argument("--repeat", type=int, default=2, help="timed runs per method and mode (best is reported)")
    p.add_argument("--graph-chunks", type=int, default=100_000, help="chunks of the graph-build measurement")
    p.add_argument("--dir", help="where to write the data (default: a temporary folder); prefer a real disk")
    p.add_argument("--json", help="write the results here (rewritten after every measurement)")
    p.add_argument("--methods", help=f"comma-separated subset of: {', '.join(_bench.METHODS)}")
    p.add_argument("--smoke", action="store_true",
                   help="CPU-sized: 32 MiB, 8 files, device cpu, 1 run, 2,000-chunk graph")
    p.add_argument("--check", action="store_true", help="exit 1 when a measurable target fails")
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.files, args.repeat, args.graph_chunks = "32MiB", 8, 1, 2000
        args.device = args.device or "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev = get_device(args.device)
    size = config.parse_bytes(args.size)
    folder = tempfile.mkdtemp(prefix="gpulazy-bench-", dir=args.dir)
    doc: dict[str, Any] = {"device": dev.name, "size": size, "files": args.files, "repeat": args.repeat,
                           "filesystem": _bench.filesystem_type(folder), "results": []}

    def save(*_: Any) -> None:
        if args.json:
            doc["ratios"] = _bench.ratios(doc["results"])
            doc["targets"] = targets(doc)
            Path(args.json).write_text(json.dumps(doc, indent=2, default=str))

    try:
        doc["import_seconds"] = import_time()
        print(f"import gpulazy: {doc['import_seconds']:.3f} s", flush=True)
        doc["graph"] = graph_build_time(folder, args.graph_chunks, dev.name)
        print(f"graph of {doc['graph']['chunks']:,} chunks built in {doc['graph']['seconds']:.2f} s "
              f"(a culled compute over it: {doc['graph']['small_compute_seconds']:.2f} s)", flush=True)
        save()
        datasets = [_bench.generate(os.path.join(folder, "one"), size, 1)]
        if args.files > 1:
            datasets.append(_bench.generate(os.path.join(folder, "many"), size, args.files))
        print(f"data on {doc['filesystem'] or 'an unknown filesystem'} in {folder}: "
              + "; ".join(ds.describe() for ds in datasets), flush=True)

        def on_row(row: dict) -> None:
            doc["results"].append(row)
            save()

        methods = args.methods.split(",") if args.methods else None
        _bench.run_suite(datasets, dev, methods=methods, repeat=args.repeat, on_row=on_row)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    save()
    print()
    print(_bench.format_table(doc["results"]))
    doc["targets"] = targets(doc)
    print("targets:")
    print(format_targets(doc["targets"]))
    if args.json:
        print(f"wrote {args.json}")
    failed = [t for t in doc["targets"] if t["ok"] is False]
    return 1 if (args.check and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
