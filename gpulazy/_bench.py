"""Side-by-side read benchmarks: gpulazy against the naive ways, in one run.

Used by ``gpulazy bench`` and ``benchmarks/run.py``. Every method reads the same
files onto the same device; the results are plain dicts (JSON-ready).

Methods (``METHODS``): the pinned host→device copy (warm ceiling, GPU only), an
``O_DIRECT`` read with 16 threads (disk ceiling, cold), ``cp.asarray(np.fromfile)``
(``np.fromfile`` on ``"cpu"``), ``da.from_array(np.memmap).map_blocks(cp.asarray)``,
``torch.from_numpy(np.fromfile(...)).cuda()`` (torch with CUDA only), raw KvikIO
``CuFile.pread`` (16 threads, 4 MiB tasks; GPU only) and ``gpulazy.from_files(...).compute()``.

"Warm" means the page cache holds the files (primed by a first read); "cold" means
every file's pages were dropped (``os.sync()`` then ``posix_fadvise(DONTNEED)``)
before each timed run.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from gpulazy.device import Device

__all__ = [
    "Dataset", "Method", "METHODS", "generate", "open_path", "drop_page_cache", "prime_page_cache",
    "measure", "run_suite", "ratios", "format_table", "filesystem_type", "progress",
]

GB = 1e9
GiB = 1 << 30
MiB = 1 << 20
TASK = 4 * MiB  # O_DIRECT and KvikIO task size
THREADS = 16


# -- progress ---------------------------------------------------------------------------
def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it", unit_scale: bool = False, enabled: bool = True) -> Any:
    """A terminal progress bar (tqdm on stderr; silent when disabled or not a terminal)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale,
                disable=None if enabled else True, leave=False, dynamic_ncols=True)


# -- data sets --------------------------------------------------------------------------
@dataclass
class Dataset:
    """Files a benchmark reads: one big file, or many slice files of one size each."""

    scenario: str  # "one file" | "many files"
    paths: list[str]
    file_nbytes: int
    dtype: str = "uint8"
    generated: bool = False

    @property
    def nbytes(self) -> int:
        return self.file_nbytes * len(self.paths)

    @property
    def file_shape(self) -> tuple[int, ...]:
        """Shape of one file's array (1-D in ``dtype``)."""
        return (self.file_nbytes // np.dtype(self.dtype).itemsize,)

    def describe(self) -> str:
        n = len(self.paths)
        return f"{self.scenario}: {_fmt_bytes(self.nbytes)} ({n} × {_fmt_bytes(self.file_nbytes)})"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _write_file(path: str, nbytes: int, block: np.ndarray, seed: int, bar: Any) -> None:
    # A cheap pattern: one random block, shifted by a counter per block written, so
    # files differ without generating random numbers for every byte.
    scratch = np.empty_like(block)
    with open(path, "wb", buffering=0) as f:
        written, k = 0, seed
        while written < nbytes:
            n = min(block.nbytes, nbytes - written)
            np.add(block, k & 0xFF, out=scratch)
            f.write(memoryview(scratch)[:n])
            written += n
            k += 1
            bar.update(n)


def generate(folder: str, size: int, files: int = 1, *, dtype: str = "uint16",
             show_progress: bool = True) -> Dataset:
    """Write ``files`` raw files of ``size // files`` bytes each (a multiple of 4 KiB) into ``folder``."""
    if size <= 0 or files <= 0:
        raise ValueError(f"need a positive size and file count, got size={size}, files={files}")
    per_file = max((size // files) // 4096 * 4096, 4096)
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, size=min(per_file, 64 * MiB), dtype=np.uint8)
    name = "data.raw" if files == 1 else "slice_{:05d}.raw"
    paths = [os.path.join(folder, name.format(i)) for i in range(files)]
    with progress(total=per_file * files, desc=f"writing {len(paths)} file(s)", unit="B", unit_scale=True,
                  enabled=show_progress) as bar:
        for i, p in enumerate(paths):
            _write_file(p, per_file, block, i, bar)
    scenario = "one file" if files == 1 else "many files"
    return Dataset(scenario, paths, per_file, dtype=dtype, generated=True)


def open_path(path: str, dtype: str = "uint8") -> Dataset:
    """A ``Dataset`` for a file, or a folder of files of one size (its regular files, sorted)."""
    if os.path.isdir(path):
        paths = sorted(os.path.join(path, n) for n in os.listdir(path)
                       if os.path.isfile(os.path.join(path, n)) and not n.startswith("."))
        if not paths:
            raise FileNotFoundError(f"no files in folder {path!r}; pass a file or a folder of raw files")
        sizes = {os.path.getsize(p) for p in paths}
        if len(sizes) != 1:
            raise ValueError(f"the files in {path!r} have {len(sizes)} different sizes; "
                             "bench reads a folder of equally sized files (slices)")
        scenario = "one file" if len(paths) == 1 else "many files"
        return Dataset(scenario, paths, sizes.pop(), dtype=dtype)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file or folder: {path!r}")
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{path!r} is empty; nothing to read")
    return Dataset("one file", [path], size, dtype=dtype)


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (``"ext4"``, ``"tmpfs"``, ...; ``""`` if unknown)."""
    path = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


# -- page cache -------------------------------------------------------------------------
def drop_page_cache(paths: Iterable[str]) -> None:
    """Evict the files' pages: ``os.sync()`` (dirty pages cannot be dropped) then ``POSIX_FADV_DONTNEED``."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prime_page_cache(paths: Iterable[str]) -> None:
    """Read every file once so its pages are in the page cache."""
    buf = bytearray(16 * MiB)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# -- methods ----------------------------------------------------------------------------
@dataclass
class Method:
    """One way to read a ``Dataset`` onto a device."""

    name: str
    label: str
    cpu_label: str | None  # None: not run on "cpu"
    run: Callable[[Dataset, Device], Any]
    gpu: bool = True  # run on a CUDA device
    modes: tuple[str, ...] = ("warm", "cold")
    kind: str = "naive"  # "ceiling" | "naive" | "gpulazy"
    needs: Callable[[Device], str] | None = None  # why it cannot run here ("" if it can)
    derived: str = ""  # a derived compute over "many files" (its rows get their own scenario)

    def label_for(self, device: Device) -> str:
        return self.label if device.is_gpu else (self.cpu_label or self.label)

    def skip_reason(self, device: Device) -> str:
        if device.is_gpu and not self.gpu:
            return "CPU only"
        if not device.is_gpu and self.cpu_label is None:
            return "needs a CUDA device"
        return self.needs(device) if self.needs else ""


def _pinned_copy(ds: Dataset, device: Device) -> Any:
    import cupy as cp
    import cupyx

    host = cupyx.empty_pinned((ds.nbytes,), dtype=np.uint8)
    host[::4096] = 1  # touch the pages before timing
    out = cp.empty(ds.nbytes, dtype=np.uint8)
    t0 = time.perf_counter()
    out.set(host)
    device.wait_all()  # timing: everything on the device, the legacy stream included
    return _Timed(out, time.perf_counter() - t0)


@dataclass
class _Timed:
    """A result that carries its own timing (when set-up must not count)."""

    value: Any
    seconds: float


def _o_direct(ds: Dataset, device: Device) -> Any:
    local = threading.local()

    def read(task: tuple[str, int]) -> int:
        path, offset = task
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, TASK)  # page-aligned, as O_DIRECT needs
        fd = fds[path]
        return os.preadv(fd, [buf], offset)

    fds: dict[str, int] = {}
    try:
        for p in ds.paths:
            try:
                fds[p] = os.open(p, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                raise OSError(f"O_DIRECT is not supported for {p!r} "
                              f"(filesystem {filesystem_type(p) or 'unknown'}): {e.strerror}") from e
        tasks = [(p, off) for p in ds.paths for off in range(0, ds.file_nbytes, TASK)]
        with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
            got = sum(pool.map(read, tasks))
    finally:
        for fd in fds.values():
            os.close(fd)
    if got < ds.nbytes:
        raise OSError(f"O_DIRECT read {got} of {ds.nbytes} bytes")
    return None


def _fromfile(ds: Dataset, device: Device) -> Any:
    if not device.is_gpu:
        return [np.fromfile(p, dtype=ds.dtype) for p in ds.paths]
    import cupy as cp

    out = [cp.asarray(np.fromfile(p, dtype=ds.dtype)) for p in ds.paths]
    device.wait_all()  # timing: everything on the device, the legacy stream included
    return out


def _dask_memmap(ds: Dataset, device: Device) -> Any:
    import dask.array as da

    parts = [da.from_array(np.memmap(p, dtype=ds.dtype, mode="r", shape=ds.file_shape)) for p in ds.paths]
    arr = parts[0] if len(parts) == 1 else da.stack(parts)
    if device.is_gpu:
        import cupy as cp

        out = arr.map_blocks(cp.asarray).compute()
        device.wait_all()  # timing: everything on the device, the legacy stream included
        return out
    # np.array copies: a memmap view alone would read nothing.
    return arr.map_blocks(np.array).compute()


def _torch_missing(device: Device) -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return "" if torch.cuda.is_available() else "torch has no CUDA"


def _torch(ds: Dataset, device: Device) -> Any:
    import torch

    out = [torch.from_numpy(np.fromfile(p, dtype=np.uint8)).cuda(device.index) for p in ds.paths]
    torch.cuda.synchronize(device.index)
    return out


def _kvikio(ds: Dataset, device: Device) -> Any:
    import cupy as cp

    return _kvikio_into(ds, [cp.empty(ds.file_nbytes, dtype=np.uint8) for _ in ds.paths])


def _kvikio_into(ds: Dataset, bufs: list[Any]) -> list[Any]:
    """Every file of ``ds`` into its buffer with KvikIO, all in flight before any is awaited."""
    import kvikio
    import kvikio.defaults

    with kvikio.defaults.set({"num_threads": THREADS, "task_size": TASK}):
        files = [kvikio.CuFile(p, "r") for p in ds.paths]
        try:
            futures = [f.pread(b, task_size=TASK) for f, b in zip(files, bufs)]
            got = sum(fut.get() for fut in futures)
        finally:
            for f in files:
                f.close()
    if got != ds.nbytes:
        raise OSError(f"KvikIO read {got} of {ds.nbytes} bytes")
    return bufs


def gpulazy_array(ds: Dataset, device: Device, cache: Any = None) -> Any:
    """The lazy array gpulazy builds for ``ds`` (one file: 1-D; many files: stacked)."""
    import gpulazy

    paths = ds.paths[0] if ds.scenario == "one file" else ds.paths
    return gpulazy.from_files(paths, shape=ds.file_shape, dtype=ds.dtype, device=device.name, cache=cache)


def _gpulazy(ds: Dataset, device: Device) -> Any:
    # No device cache: every timed run must read the files (cold runs would hit it).
    out = gpulazy_array(ds, device, cache=False).compute()
    device.wait_all()  # timing: everything on the device, the legacy stream included
    return out


MIP = "max(axis=0)"


def _mip_kvikio(ds: Dataset, device: Device) -> Any:
    import cupy as cp

    buf = cp.empty(ds.nbytes, dtype=np.uint8)
    n = ds.file_nbytes
    _kvikio_into(ds, [buf[i * n:(i + 1) * n] for i in range(len(ds.paths))])
    out = buf.view(ds.dtype).reshape(len(ds.paths), *ds.file_shape).max(axis=0)
    device.wait_all()
    return out


def _mip_dask(ds: Dataset, device: Device) -> Any:
    import dask.array as da

    arr = da.stack([da.from_array(np.memmap(p, dtype=ds.dtype, mode="r", shape=ds.file_shape)) for p in ds.paths])
    if device.is_gpu:
        import cupy as cp

        arr = arr.map_blocks(cp.asarray)
    out = arr.max(axis=0).compute()
    device.wait_all()
    return out


def _mip_gpulazy(ds: Dataset, device: Device) -> Any:
    out = gpulazy_array(ds, device, cache=False).max(axis=0).compute()
    device.wait_all()
    return out


def check_mip(result: Any, ds: Dataset, nbytes: int = MiB) -> None:
    """Raise if the first ``nbytes`` of a MIP over the files differ from the files' maximum."""
    n = min(nbytes, ds.file_nbytes) // np.dtype(ds.dtype).itemsize
    want = np.max([np.fromfile(p, dtype=ds.dtype, count=n) for p in ds.paths], axis=0)
    got = _host_bytes(result.reshape(-1)[:n]).view(ds.dtype)
    if not np.array_equal(got, want):
        raise AssertionError(f"the MIP differs from the maximum over {ds.paths[0]!r} ... {ds.paths[-1]!r}")


METHODS: dict[str, Method] = {m.name: m for m in [
    Method("pinned_h2d", "pinned host→device copy (ceiling)", None, _pinned_copy, modes=("warm",),
           kind="ceiling"),
    Method("o_direct", "O_DIRECT, 16 threads (disk ceiling)", "O_DIRECT, 16 threads (disk ceiling)",
           _o_direct, modes=("cold",), kind="ceiling"),
    Method("numpy_fromfile", "cp.asarray(np.fromfile(...))", "np.fromfile(...)", _fromfile),
    Method("dask_memmap", "da.from_array(np.memmap).map_blocks(cp.asarray)", "da.from_array(np.memmap)",
           _dask_memmap),
    Method("torch_fromfile", "torch.from_numpy(np.fromfile(...)).cuda()", None, _torch, needs=_torch_missing),
    Method("kvikio_pread", "KvikIO CuFile.pread, 16 threads, 4 MiB tasks", None, _kvikio),
    Method("gpulazy", "gpulazy.from_files(...).compute()", "gpulazy.from_files(..., device='cpu').compute()",
           _gpulazy, kind="gpulazy"),
    Method("kvikio_mip", "KvikIO CuFile.pread, then .max(axis=0)", None, _mip_kvikio, modes=("warm",), derived=MIP),
    Method("dask_mip", "da.stack(memmaps).map_blocks(cp.asarray).max(axis=0)", "da.stack(memmaps).max(axis=0)",
           _mip_dask, modes=("warm",), derived=MIP),
    Method("gpulazy_mip", "gpulazy.from_files(...).max(axis=0).compute()",
           "gpulazy.from_files(..., device='cpu').max(axis=0)", _mip_gpulazy, modes=("warm",), kind="gpulazy",
           derived=MIP),
]}


# -- checking and memory ----------------------------------------------------------------
def _host_bytes(x: Any) -> np.ndarray:
    """The bytes of a NumPy / CuPy / torch array as host uint8."""
    if hasattr(x, "cpu") and hasattr(x, "numpy"):  # torch
        x = x.cpu().numpy()
    if hasattr(x, "get") and not isinstance(x, np.ndarray):
        x = x.get()
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _ends(x: Any, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The first and last ``nbytes`` of an array, sliced on its device before copying to the host."""
    flat = x.reshape(-1)
    itemsize = flat.element_size() if hasattr(flat, "element_size") else flat.itemsize
    k = nbytes // itemsize
    return _host_bytes(flat[:k]), _host_bytes(flat[flat.shape[0] - k:])


def check_result(result: Any, ds: Dataset, nbytes: int = MiB) -> None:
    """Raise if the first and last ``nbytes`` read differ from the files' bytes."""
    if result is None:
        return
    first, last = (result[0], result[-1]) if isinstance(result, list) else (result, result)
    n = min(nbytes, ds.file_nbytes) // 8 * 8
    head = np.fromfile(ds.paths[0], dtype=np.uint8, count=n)
    tail = np.fromfile(ds.paths[-1], dtype=np.uint8, count=n, offset=ds.file_nbytes - n)
    got_head, _ = _ends(first, n)
    _, got_tail = _ends(last, n)
    if not (np.array_equal(got_head, head) and np.array_equal(got_tail, tail)):
        raise AssertionError(f"the bytes read differ from the bytes of {ds.paths[0]!r} ... {ds.paths[-1]!r}")


class _PeakTracker:
    """A CuPy allocator that records the memory pool's high-water mark of used bytes."""

    def __init__(self) -> None:
        import cupy as cp

        self.pool = cp.get_default_memory_pool()
        self.base = self.peak = self.pool.used_bytes()
        self._lock = threading.Lock()

    def malloc(self, nbytes: int) -> Any:
        mem = self.pool.malloc(nbytes)
        used = self.pool.used_bytes()
        with self._lock:
            self.peak = max(self.peak, used)
        return mem

    def __enter__(self) -> _PeakTracker:
        import cupy as cp

        self._previous = cp.cuda.get_allocator()
        cp.cuda.set_allocator(self.malloc)
        return self

    def __exit__(self, *exc: object) -> None:
        import cupy as cp

        cp.cuda.set_allocator(self._previous)


def _result_nbytes(result: Any) -> int:
    items = result if isinstance(result, list) else [result]
    return sum(int(getattr(x, "nbytes", 0)) for x in items if x is not None)


def _release(device: Device) -> None:
    """Give freed device memory back, so one method's pool does not crowd the next."""
    if device.is_gpu:
        import cupy as cp

        cp.get_default_memory_pool().free_all_blocks()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()


# -- measuring --------------------------------------------------------------------------
def measure(method: Method, ds: Dataset, device: Device, mode: str, repeat: int = 3,
            track_memory: bool = False) -> dict[str, Any]:
    """Time ``method`` ``repeat`` times on ``ds`` in ``mode`` ("warm" or "cold"); a JSON-ready dict."""
    scenario = f"{ds.scenario}, {method.derived}" if method.derived else ds.scenario
    row: dict[str, Any] = {"scenario": scenario, "mode": mode, "method": method.name,
                           "label": method.label_for(device), "kind": method.kind, "nbytes": ds.nbytes,
                           "files": len(ds.paths), "device": device.name, "seconds": []}
    why = method.skip_reason(device) or (
        "a derived compute over many files" if method.derived and ds.scenario != "many files" else "")
    if why or mode not in method.modes:
        row["skipped"] = why or f"not a {mode} measurement"
        return row
    try:
        for i in range(repeat):
            if mode == "cold":
                drop_page_cache(ds.paths)
            tracker = _PeakTracker() if (track_memory and device.is_gpu and i == 0) else None
            with device.activate():
                if tracker:
                    with tracker:
                        t0 = time.perf_counter()
                        result = method.run(ds, device)
                        seconds = time.perf_counter() - t0
                else:
                    t0 = time.perf_counter()
                    result = method.run(ds, device)
                    seconds = time.perf_counter() - t0
            if isinstance(result, _Timed):
                result, seconds = result.value, result.seconds
            row["seconds"].append(seconds)
            if i == 0 and method.derived:
                check_mip(result, ds)
            elif i == 0 and method.kind != "ceiling":
                check_result(result, ds)
            if tracker:
                row["peak_device_bytes"] = tracker.peak - tracker.base
                row["result_bytes"] = _result_nbytes(result)
            del result
    except Exception as e:  # reported in the table; one method failing must not stop the run
        row["error"] = f"{type(e).__name__}: {e}"
    # Memory goes back between methods, not between the repeats of one: from the second
    # run on, every method allocates from CuPy's warm pool, as in a session where arrays
    # come and go; the first run (cudaMalloc included) is kept as first_gbps.
    _release(device)
    if row["seconds"]:
        row["first_gbps"] = ds.nbytes / row["seconds"][0] / GB
        row["gbps"] = ds.nbytes / min(row["seconds"]) / GB
        row["gbps_median"] = ds.nbytes / statistics.median(row["seconds"]) / GB
    return row


def run_suite(datasets: list[Dataset], device: Device, *, modes: Iterable[str] = ("warm", "cold"),
              methods: Iterable[str] | None = None, repeat: int = 3,
              on_row: Callable[[dict[str, Any]], None] | None = None,
              show_progress: bool = True) -> list[dict[str, Any]]:
    """Measure every method in every mode on every data set; returns the rows."""
    chosen = [METHODS[m] for m in (methods or METHODS)]
    modes = list(modes)
    plan = [(ds, mode, m) for ds in datasets for mode in modes for m in chosen
            if not m.derived or ds.scenario == "many files"]
    rows = []
    primed: set[int] = set()
    with progress(plan, desc="benchmark", unit="run", enabled=show_progress) as bar:
        for ds, mode, m in bar:
            bar.set_postfix_str(f"{ds.scenario}, {mode}, {m.name}")
            if mode == "warm" and id(ds) not in primed:
                prime_page_cache(ds.paths)
                primed.add(id(ds))
            row = measure(m, ds, device, mode, repeat=repeat, track_memory=m.kind == "gpulazy")
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpulazy's throughput over each other method's, per scenario and mode."""
    out = []
    by = {(r["scenario"], r["mode"], r["method"]): r for r in rows if r.get("gbps")}
    for (scenario, mode, name), g in by.items():
        if not _is_gpulazy(g):
            continue
        for (s2, m2, other), r in by.items():
            if (s2, m2) == (scenario, mode) and not _is_gpulazy(r):
                out.append({"scenario": scenario, "mode": mode, "versus": other,
                            "ratio": g["gbps"] / r["gbps"]})
    return out


def _is_gpulazy(row: dict[str, Any]) -> bool:
    method = METHODS.get(row["method"])
    return (method.kind if method else row.get("kind")) == "gpulazy"


def _not_for_device(row: dict[str, Any]) -> bool:
    return row.get("skipped") in ("needs a CUDA device", "CPU only", "a derived compute over many files")


def format_table(rows: list[dict[str, Any]]) -> str:
    """A text table: one block per scenario, a line per method, GB/s per mode, gpulazy's ratios."""
    lines = []
    rats = {(r["scenario"], r["mode"], r["versus"]): r["ratio"] for r in ratios(rows)}
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        block = [r for r in rows if r["scenario"] == scenario]
        modes = [m for m in ("warm", "cold") if any(r["mode"] == m for r in block)]
        first = block[0]
        lines.append(f"{scenario}: {_fmt_bytes(first['nbytes'])} in {first['files']} file(s), "
                     f"device {first['device']}")
        lines.append(f"  {'method':<52}" + "".join(f"{m + ' GB/s':>11}" for m in modes)
                     + f"   gpulazy/this ({', '.join(modes)})")
        for name in dict.fromkeys(r["method"] for r in block if not _not_for_device(r)):
            cells, ratio_cells, label, notes = [], [], name, []
            for mode in modes:
                r = next((x for x in block if x["method"] == name and x["mode"] == mode), None)
                label = r["label"] if r else label
                if r and r.get("gbps"):
                    cells.append(f"{r['gbps']:.2f}")
                elif r and r.get("error"):
                    cells.append("error")
                    notes.append(f"{mode}: {r['error']}")
                else:
                    cells.append("—")
                    if r and r.get("skipped") and not r["skipped"].startswith("not a"):
                        notes.append(r["skipped"])
                ratio = rats.get((scenario, mode, name))
                ratio_cells.append(f"{ratio:.2f}×" if ratio else "—")
            ratio_text = "" if _is_gpulazy({"method": name}) else ", ".join(ratio_cells)
            lines.append(f"  {label:<52}" + "".join(f"{c:>11}" for c in cells) + f"   {ratio_text}")
            for note in dict.fromkeys(notes):
                lines.append(f"      ({note})")
        for r in block:
            if r.get("peak_device_bytes") is not None and r.get("result_bytes"):
                lines.append(f"  gpulazy peak device memory ({r['mode']}): {_fmt_bytes(r['peak_device_bytes'])} "
                             f"for a {_fmt_bytes(r['result_bytes'])} result "
                             f"({r['peak_device_bytes'] / r['result_bytes']:.2f}×)")
        lines.append("")
    return "\n".join(lines)


@dataclass
class Timer:
    """``with Timer() as t: ...; t.seconds``."""

    seconds: float = 0.0
    _t0: float = field(default=0.0, repr=False)

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0


def plot_results(rows: list[dict[str, Any]], path: str) -> str:
    """A bar chart of the side-by-side (GB/s, log scale; warm and cold) saved to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        from gpulazy.errors import missing_dependency

        raise missing_dependency("matplotlib", "notebook", "gpulazy bench --plot") from e
    measured = [r for r in rows if r.get("gbps")]
    scenarios = list(dict.fromkeys(r["scenario"] for r in measured))
    if not scenarios:
        raise ValueError("no method was measured, so there is nothing to plot")
    fig, axes = plt.subplots(len(scenarios), 1, figsize=(9, 3.2 * len(scenarios)), squeeze=False)
    for ax, scenario in zip(axes[:, 0], scenarios):
        _plot_scenario(ax, [r for r in measured if r["scenario"] == scenario], scenario)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_scenario(ax: Any, rows: list[dict[str, Any]], scenario: str) -> None:
    labels = list(dict.fromkeys(r["label"] for r in rows))
    width = 0.4
    for k, (mode, color) in enumerate((("warm", "tab:orange"), ("cold", "tab:blue"))):
        gbps = {r["label"]: r["gbps"] for r in rows if r["mode"] == mode}
        xs = [i + (k - 0.5) * width for i, label in enumerate(labels) if label in gbps]
        ys = [gbps[label] for label in labels if label in gbps]
        bars = ax.barh(xs, ys, height=width, color=color, label=mode)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, padding=2)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    for tick, label in zip(ax.get_yticklabels(), labels):
        if "gpulazy" in label:
            tick.set_fontweight("bold")
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("GB/s (log scale)")
    ax.set_title(f"{scenario}: {rows[0]['nbytes'] / 2**30:.2f} GiB in {rows[0]['files']} file(s), {rows[0]['device']}")
    ax.legend(loc="lower right", fontsize=8)
