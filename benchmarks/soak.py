"""Soak: random-access computes for N seconds, every result checked against NumPy.

Each round picks a dataset (one raw file, a stack of slice files, a ``.npy`` file), a
random chunking, a scheduler (the whole-array fast path, ``sync``, ``threads``, and with
``--distributed`` an in-process ``dask.distributed`` cluster), a cache far smaller or
larger than the array, read-ahead on or off, ``verify`` on or off, and a random
selection and reduction; the result is compared with the same expression on the
NumPy reference. It reports reads, bytes, mismatches (must be 0), errors (must be 0),
the peak bytes a cache held against its capacity (sampled every 0.5 ms; must never be
over), peak device memory (CuPy's pool on a GPU) and what was left behind (threads,
descriptors). Exit status 1 when any of those fails.

    python benchmarks/soak.py --seconds 600 --device cuda:0 --distributed --json soak.json
    python benchmarks/soak.py --seconds 60 --device cpu          # what CI runs (tests/test_soak.py)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpulazy  # noqa: E402
from gpulazy.cache import DeviceCache  # noqa: E402
from gpulazy.checksums import write_manifest  # noqa: E402


# -- datasets ---------------------------------------------------------------------------------

def make_datasets(folder: str, size: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Three datasets of about ``size`` bytes each, with their NumPy reference and open options."""
    side = max(16, int((size / 2 / 16) ** 0.5))
    out = []
    one = rng.integers(0, 1 << 15, (16, side, side), dtype="<u2")
    one.tofile(os.path.join(folder, "one.raw"))
    out.append({"name": "raw", "ref": one, "paths": os.path.join(folder, "one.raw"),
                "opts": {"shape": one.shape, "dtype": "<u2"}})
    stack_dir = os.path.join(folder, "stack")
    os.mkdir(stack_dir)
    stack = rng.standard_normal((12, side // 2, side)).astype(">f4")
    for i, plane in enumerate(stack):
        plane.tofile(os.path.join(stack_dir, f"z{i}.raw"))
    out.append({"name": "stack", "ref": stack.astype("=f4"), "paths": stack_dir,
                "opts": {"shape": stack.shape[1:], "dtype": ">f4"}})
    npy = np.asfortranarray(rng.integers(-1000, 1000, (side, 24, 8), dtype="<i4"))
    np.save(os.path.join(folder, "f.npy"), npy)
    out.append({"name": "npy-F", "ref": npy, "paths": os.path.join(folder, "f.npy"), "opts": {}})
    write_manifest(folder)  # verify=True rounds check against it
    return out


def random_chunks(shape: tuple[int, ...], rng: np.random.Generator) -> tuple[int, ...]:
    return tuple(int(rng.integers(1, n + 1)) if n else 1 for n in shape)


def random_selection(shape: tuple[int, ...], rng: np.random.Generator) -> tuple[slice, ...]:
    sel = []
    for n in shape:
        a = int(rng.integers(0, n))
        b = int(rng.integers(a + 1, n + 1))
        step = int(rng.integers(1, 3))
        sel.append(slice(a, b, step))
    return tuple(sel)


OPS = {
    "values": lambda x: x,
    "sum0": lambda x: x.sum(axis=0),
    "max": lambda x: x.max(axis=-1),
    "mean": lambda x: x.astype("f8").mean(axis=(0, 1)),
}


def to_host(x: Any) -> np.ndarray:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


# -- watching memory -----------------------------------------------------------------------------

class Watch:
    """Peak bytes held + reserved by the caches in use, and CuPy pool bytes, sampled on a thread."""

    def __init__(self, device: str):
        self.caches: list[DeviceCache] = []
        self.peak_cache = 0
        self.peak_capacity = 0
        self.over = 0
        self.peak_device = 0
        self.gpu = device.startswith("cuda")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pool = None
        if self.gpu:
            import cupy

            pool = cupy.get_default_memory_pool()
        while not self._stop.is_set():
            for c in list(self.caches):
                with c._lock:
                    used = c._held + c._reserved
                if used > self.peak_cache:
                    self.peak_cache, self.peak_capacity = used, c.capacity
                if used > c.capacity:
                    self.over += 1
            if pool is not None:
                self.peak_device = max(self.peak_device, pool.used_bytes())
            time.sleep(0.0005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _resources() -> tuple[set, int]:
    names = {t.name for t in threading.enumerate()}
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = 0
    return names, fds


# -- the loop -----------------------------------------------------------------------------------

def soak(seconds: float, *, device: str = "cpu", size: int = 4 << 20, seed: int = 0, distributed: bool = False,
         workdir: str | None = None, log: Any = None) -> dict[str, Any]:
    """Run rounds for ``seconds``; returns the report (see the module docstring)."""
    rng = np.random.default_rng(seed)
    folder = tempfile.mkdtemp(prefix="gpulazy-soak-", dir=workdir)
    _, fds_before = _resources()
    client = cluster = None
    report: dict[str, Any] = {"device": device, "seconds": seconds, "seed": seed, "rounds": 0, "mismatches": 0,
                              "errors": 0, "error_examples": [], "by_scheduler": {}, "reads": 0, "bytes": 0}
    stats0 = gpulazy.stats().snapshot()
    watch = Watch(device)
    try:
        datasets = make_datasets(folder, size, rng)
        schedulers = ["fast", "sync", "threads"]
        if distributed:
            from distributed import Client, LocalCluster

            cluster = LocalCluster(n_workers=1, threads_per_worker=4, processes=False, dashboard_address=None)
            client = Client(cluster, set_as_default=False)
            schedulers.append("distributed")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            _round(report, datasets, schedulers, client, watch, device, rng, log)
    finally:
        watch.stop()
        if client is not None:
            client.close()
            cluster.close()
        shutil.rmtree(folder, ignore_errors=True)
    stats1 = gpulazy.stats().snapshot()
    report["reads"] = stats1["reads"] - stats0["reads"]
    report["bytes"] = stats1["bytes_read"] - stats0["bytes_read"]
    report["peak_cache_bytes"] = watch.peak_cache
    report["capacity_at_peak"] = watch.peak_capacity
    report["samples_over_capacity"] = watch.over
    report["peak_device_bytes"] = watch.peak_device if watch.gpu else None
    time.sleep(0.2)
    from gpulazy import io

    io._close_all()  # backends keep file handles open between reads on purpose; closing them ends that
    names, fds_after = _resources()
    report["threads_left"] = sorted(n for n in names if n.startswith("gpulazy-cache-cache-"))
    report["fds_left"] = max(0, fds_after - fds_before)
    report["ok"] = (report["mismatches"] == 0 and report["errors"] == 0 and report["samples_over_capacity"] == 0
                    and not report["threads_left"] and report["rounds"] > 0)
    return report


def _dask_fails_too(ref: np.ndarray, chunks: tuple, op: str, sel: tuple, error: Exception) -> bool:
    import dask.array as da

    try:
        OPS[op](da.from_array(ref, chunks=chunks)[sel]).compute(scheduler="sync")
    except Exception as e:
        return type(e) is type(error)
    return False


def _round(report: dict, datasets: list, schedulers: list, client: Any, watch: Watch, device: str,
           rng: np.random.Generator, log: Any) -> None:
    ds = datasets[int(rng.integers(0, len(datasets)))]
    ref = ds["ref"]
    chunks = random_chunks(ref.shape, rng)
    scheduler = schedulers[int(rng.integers(0, len(schedulers)))]
    capacity = int(ref.nbytes * float(rng.choice([0.02, 0.1, 0.5, 2.0])))
    cache = DeviceCache(max(capacity, 1), device=device)
    watch.caches.append(cache)
    verify = bool(rng.random() < 0.2)
    read_ahead = bool(rng.random() < 0.5) and scheduler in ("sync", "threads")
    op = list(OPS)[int(rng.integers(0, len(OPS)))]
    sel = random_selection(ref.shape, rng)
    what = f"{ds['name']} chunks={chunks} {scheduler} cache={capacity} verify={verify} prefetch={read_ahead} {op}{sel}"
    try:
        vol = gpulazy.from_files(ds["paths"], chunks=chunks, device=device, cache=cache, verify=verify, **ds["opts"])
        if scheduler == "fast":
            got = OPS[op](vol.compute()[sel])
        else:
            expr = OPS[op](vol[sel])
            if scheduler == "distributed":
                got = client.compute(expr).result()
            else:
                callbacks = [gpulazy.prefetch(depth=int(rng.integers(1, 16)))] if read_ahead else []
                got = expr.compute(scheduler=scheduler, callbacks=callbacks)
        want = OPS[op](ref[sel])
        got = to_host(got)
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True):
            report["mismatches"] += 1
            report.setdefault("mismatch_examples", []).append(what)
            print(f"MISMATCH {what}", file=log or sys.stderr)
    except gpulazy.errors.TooManyChunksError:
        # A chunking of more pieces than config max_chunks is refused by design (a named error
        # before any piece is made): counted apart, like dask's own limitations.
        report["refused_chunkings"] = report.get("refused_chunkings", 0) + 1
    except Exception as e:
        if scheduler != "fast" and _dask_fails_too(ref, chunks, op, sel, e):
            # dask.array itself fails this selection + reduction on these chunks (empty blocks
            # after a stepped slice): not gpulazy's error, counted apart.
            report["dask_limitations"] = report.get("dask_limitations", 0) + 1
            return
        report["errors"] += 1
        if len(report["error_examples"]) < 5:
            report["error_examples"].append(f"{what}: {type(e).__name__}: {e}")
        print(f"ERROR {what}: {type(e).__name__}: {e}", file=log or sys.stderr)
    finally:
        watch.caches.remove(cache)
        cache.close()
    report["rounds"] += 1
    report["by_scheduler"][scheduler] = report["by_scheduler"].get(scheduler, 0) + 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda:N'")
    p.add_argument("--size", default="4MiB", help="bytes per dataset (default 4MiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--distributed", action="store_true", help="also an in-process dask.distributed cluster")
    p.add_argument("--dir", help="where the datasets are written (default: a temporary folder)")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    report = soak(args.seconds, device=args.device, size=gpulazy.config.parse_bytes(args.size), seed=args.seed,
                  distributed=args.distributed, workdir=args.dir)
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
