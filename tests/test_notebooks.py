"""Every notebook in notebooks/ runs top to bottom (CPU-only here) in well under a minute.

The notebooks assert their own results (a MIP equal to NumPy's, hit counts, ...), so a
wrong figure fails the cell and this test. Executed copies are written to
``test-artifacts/notebooks/`` for a look.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import HAS_GPU

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ARTIFACTS = ROOT / "test-artifacts" / "notebooks"
EXPECTED = ["01-quickstart", "02-prefetch", "03-formats", "04-torch-jax", "05-handoff-cluster"]


def ensure_python3_kernel() -> str:
    """The ``python3`` kernel of this interpreter, installed into ``sys.prefix`` if missing.

    jupyter_client starts a spec whose argv[0] is ``python`` with ``sys.executable``, so
    the kernel runs in this same environment (where gpulazy is installed).
    """
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"],
                       check=True, capture_output=True)
    return "python3"


@pytest.fixture(scope="module")
def kernel_name() -> str:
    return ensure_python3_kernel()


def execute_notebook(path: Path, kernel: str, *, store_widget_state: bool = False, timeout: int = 120,
                     hide: tuple[str, ...] = ()):
    """Run ``path`` in a fresh kernel (cwd: a temp dir) and return the executed notebook.

    ``hide``: modules the kernel cannot import (as on an install without them).
    """
    nb = nbformat.read(path, as_version=4)
    # sys.modules[name] = None: importing it raises ImportError and find_spec says None.
    startup = [f"--IPKernelApp.exec_lines=import sys; sys.modules[{m!r}] = None" for m in hide]
    with tempfile.TemporaryDirectory(prefix="nbk-") as sockets:
        client = nbclient.NotebookClient(
            nb, km=_kernel_manager(kernel, sockets), timeout=timeout, store_widget_state=store_widget_state,
            resources={"metadata": {"path": str(ROOT / "notebooks")}}, extra_arguments=startup,
        )
        client.execute()
    return nb


def _kernel_manager(kernel: str, sockets: str):
    """A kernel manager talking over Unix sockets in ``sockets`` where it can, else over TCP.

    Over TCP jupyter_client picks five free ports and closes them before the kernel binds
    them: another kernel or cluster starting on the machine meanwhile (test suites run
    side by side) can take one, and the kernel dies at start. Socket files in a fresh
    directory cannot be taken.
    """
    from jupyter_client.manager import KernelManager

    if os.name != "posix":
        return KernelManager(kernel_name=kernel)
    return KernelManager(kernel_name=kernel, transport="ipc", ip=os.path.join(sockets, "k"))


def cell_seconds(nb) -> list[tuple[float, int]]:
    """``(seconds, cell number)`` of each executed code cell, slowest first (nbclient's timestamps)."""
    from datetime import datetime

    out = []
    for i, cell in enumerate(nb.cells):
        times = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in times and "shell.execute_reply" in times:
            start, end = (datetime.fromisoformat(times[k].replace("Z", "+00:00"))
                          for k in ("iopub.execute_input", "shell.execute_reply"))
            out.append(((end - start).total_seconds(), i))
    return sorted(out, reverse=True)


def outputs_text(nb) -> str:
    """The text a reader sees: a cell's stream outputs joined as written (a kernel under load
    may flush one ``print`` as two stream messages, "freed:" then its value), cells apart."""
    parts = []
    for cell in nb.cells:
        text = ""
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text += out["text"]
            elif "data" in out and "text/plain" in out["data"]:
                text += "\n" + out["data"]["text/plain"]
        parts.append(text)
    return "\n".join(p for p in parts if p)


def test_the_notebooks_exist_and_are_clean():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert nb.nbformat == 4
        assert nb.metadata.kernelspec.name == "python3"
        # committed without outputs: small diffs, no stale figures
        assert all(not c.get("outputs") and c.get("execution_count") is None
                   for c in nb.cells if c.cell_type == "code"), path.name


CHECKS = {
    "01-quickstart": ["MIP matches NumPy: (512, 512) uint16", "read 64.0 MiB in", " 0 new bytes read",
                      "plane fast (512, 512)", "plane max streams: True", "np.max streams: True", "two arrays streamed: True (64,)",
                      "MIP of slices 3-39 matches NumPy, compute path fast"],
    "02-prefetch": ["with prefetch:", "without:", "hit rate 0%", "streamed: ", "compute path fast"],
    "03-formats": ["LayoutError:", "uint16 (4, 4, 4, 4)", "TIFF tiff (16, 64, 64) | deflate tiles: zlib",
                   "Zarr (16, 64, 64) | OME-Zarr levels: [(16, 64, 64), (16, 32, 32)]", "HDF5 (16, 64, 64) uint16",
                   "{'blosc': ['host']}", "plane 17: read 387 KiB of its chunk's"],
    "04-torch-jax": ["TypeError: gpulazy.to_numpy got a lazy dask array", "ndarray float32 (2, 128, 128)"],
    "05-handoff-cluster": ["freed: {'cache_bytes'", "workers: 2 - MIP equal to NumPy: True",
                           "normalised: ndarray float32 (4, 128, 128)", "same memory as the chunk: True"],
}
#: Notebooks whose output depends on whether torch is installed: they also run with it hidden.
USES_TORCH = ["04-torch-jax", "05-handoff-cluster"]


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs(name, kernel_name):
    _run_and_check(name, kernel_name, has_torch=_has("torch"))


@pytest.mark.slow
@pytest.mark.parametrize("name", USES_TORCH)
def test_notebook_runs_without_torch(name, kernel_name):
    # What a CPU-only install without the torch extra sees, whether or not torch is here.
    _run_and_check(name, kernel_name, has_torch=False, hide=("torch",))


def _run_and_check(name: str, kernel: str, *, has_torch: bool, hide: tuple[str, ...] = ()) -> None:
    nb = execute_notebook(ROOT / "notebooks" / f"{name}.ipynb", kernel, hide=hide)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, ARTIFACTS / f"{name}{'-without-' + '-'.join(hide) if hide else ''}.ipynb")
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    text = outputs_text(nb)
    for expected in CHECKS[name]:
        assert expected in text, f"{expected!r} not in the outputs of {name}:\n{text}"
    if name in USES_TORCH:
        # Without torch a notebook says so and shows the same with what is installed.
        assert ("torch is not installed" in text) != has_torch
    if name == "05-handoff-cluster":
        assert ("torch on cpu - same memory" in text or "torch on cuda" in text) == has_torch
    if name == "04-torch-jax":
        assert ("shares memory with the chunk: True" in text) == has_torch
        if not _has("jax"):
            assert "pip install 'gpulazy[jax]'" in text
    _check_time(name, nb)


def _check_time(name: str, nb) -> None:
    """The notebook's own cells run in well under a minute.

    Timed from nbclient's per-cell timestamps, not around ``execute``: a kernel's start
    and a first ``import torch`` in a fresh environment (compiling its bytecode, reading
    its libraries from disk) took 10 to 17 s of a 3.5 s notebook on a 2-core machine
    under load, which made a wall-clock bound on the whole run fail now and then. On a
    fresh GPU host CuPy compiles each reduction kernel on first use (a first ``.mean()``
    took 48 s on the H100 host, then ~0); the bound is for CPU machines and CI.
    """
    cells = cell_seconds(nb)
    seconds = sum(t for t, _ in cells)
    slowest = ", ".join(f"cell {i}: {t:.1f} s" for t, i in cells[:3])
    assert seconds < (240 if HAS_GPU else 90), f"{name}'s cells took {seconds:.1f} s ({slowest})"


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
