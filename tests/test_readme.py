"""Every ```python block of README.md and docs/*.md runs on the CPU path, so the documentation
cannot drift from the code.

Each page's blocks run in order in one namespace of their own (later examples use earlier
ones' names; a page starts from nothing, so it imports what it uses), in a temporary folder
holding the files the examples name (``_EXAMPLE_FILES``). A block that cannot run on a
CPU-only CI box carries ``<!-- skip-test: reason -->`` on the line before its fence; it is
counted, not run. A block that fails without that marker fails the test, named by its page
and line. A new block naming files this fixture does not create fails the same way: add the
files to ``_EXAMPLE_FILES`` (or mark the block).
"""

from __future__ import annotations

import os
import re
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import gpulazy

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)\s*$")
_SKIP = re.compile(r"<!--\s*skip-test:\s*(?P<reason>.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the reason of a skip-test marker right before the fence


def extract_blocks(text: str) -> list[Block]:
    """Fenced code blocks (also indented ones, inside list items) with their skip markers."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = m.group("indent"), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        marker = _SKIP.search(prev)
        blocks.append(Block(start + 1, m.group("lang"), textwrap.dedent("\n".join(body)) + "\n",
                            marker.group("reason") if marker else None))
        i += 1
    return blocks


def python_blocks(text: str) -> list[Block]:
    return [b for b in extract_blocks(text) if b.lang in ("python", "py", "pycon")]


# -- the files the README's examples name -------------------------------------------------
def _scan(folder: Path) -> None:
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        rng.integers(0, 4096, (2048, 2048), dtype=np.uint16).tofile(folder / f"z{i:03d}.raw")


def _sparse(path: Path, nbytes: int) -> None:
    with open(path, "wb") as f:  # a hole: no disk space, no read in the examples
        f.truncate(nbytes)


def _frames(folder: Path) -> None:
    folder.mkdir()
    for i in range(3):
        np.save(folder / f"f{i}.npy", np.full((64, 64), i, dtype="float32"))


def _tiffs(folder: Path) -> None:
    import tifffile

    folder.mkdir()
    for i in range(3):
        tifffile.imwrite(folder / f"z{i:03d}.tif", np.full((64, 64), i, dtype="uint16"))


def _ome_tiff(path: Path) -> None:
    import tifffile

    data = np.arange(4 * 128 * 128, dtype="uint16").reshape(4, 128, 128)
    meta = {"axes": "ZYX", "PhysicalSizeZ": 2.0, "PhysicalSizeY": 0.5, "PhysicalSizeX": 0.5}
    with tifffile.TiffWriter(path, ome=True) as tif:
        tif.write(data, subifds=1, metadata=meta)
        tif.write(data[:, ::2, ::2], subfiletype=1)


def _zarr_store(path: Path) -> None:
    import zarr

    z = zarr.create_array(path, shape=(4, 64, 64), chunks=(2, 32, 32), dtype="uint16", zarr_format=3)
    z[:] = np.arange(4 * 64 * 64, dtype="uint16").reshape(4, 64, 64)


def _ome_zarr(path: Path) -> None:
    import zarr

    root = zarr.open_group(path, mode="w", zarr_format=2)
    data = np.arange(4 * 64 * 64, dtype="uint16").reshape(4, 64, 64)
    for level, arr in enumerate([data, data[:, ::2, ::2]]):
        root.create_array(str(level), data=arr, chunks=(2, 32, 32))
    axes = [{"name": n, "type": "space", "unit": "micrometer"} for n in "zyx"]
    root.attrs["multiscales"] = [{"version": "0.4", "axes": axes, "datasets": [
        {"path": str(lv), "coordinateTransformations": [{"type": "scale", "scale": [2.0, 0.5 * 2 ** lv, 0.5 * 2 ** lv]}]}
        for lv in range(2)]}]
    cells = root.create_group("labels").create_group("cells")
    cells.create_array("0", data=np.zeros((4, 64, 64), "uint8"), chunks=(2, 64, 64))


def _h5(path: Path) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        f.create_dataset("entry/data", data=np.arange(4 * 64 * 64, dtype="float32").reshape(4, 64, 64),
                         chunks=(1, 64, 64))


def _h5_runs(folder: Path) -> None:
    folder.mkdir()
    for i in range(2):
        _h5(folder / f"run{i}.h5")


_EXAMPLE_FILES = {
    "tiffs/": _tiffs,
    "slide.ome.tif": _ome_tiff,
    "volume.zarr": _zarr_store,
    "image.ome.zarr": _ome_zarr,
    "run.h5": _h5,
    "runs/": _h5_runs,
    "scan/": _scan,
    "big.raw": lambda p: _sparse(p, 512 + 4096 * 4096 * 256 * 4),
    "small.raw": lambda p: np.zeros((1024, 1024), "float32").tofile(p),
    "frames/": _frames,
}


@pytest.fixture
def example_dir(tmp_path, monkeypatch):
    for name, make in _EXAMPLE_FILES.items():
        make(tmp_path / name.rstrip("/"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")  # figures without a display
    return tmp_path


# -- the tests ----------------------------------------------------------------------------
def test_extractor_sees_markers_and_indented_blocks():
    text = textwrap.dedent("""\
        Intro.

        ```python
        a = 1
        ```

        - item:

          ```python
          b = a + 1
          ```
        <!-- skip-test: needs a GPU -->
        ```python
        import cupy
        ```

        ```bash
        echo hi
        ```
        """)
    blocks = python_blocks(text)
    assert [(b.line, b.code, b.skip) for b in blocks] == [
        (3, "a = 1\n", None), (9, "b = a + 1\n", None), (13, "import cupy\n", "needs a GPU")]
    assert [b.lang for b in extract_blocks(text)] == ["python", "python", "python", "bash"]


def run_blocks(blocks: list[Block], source: str = "README.md") -> tuple[int, list[str], list[str]]:
    """Run unmarked blocks in order in one namespace: ``(ran, skipped, failures)``."""
    namespace: dict = {"__name__": "__readme__"}
    failures, ran, skipped = [], 0, []
    with gpulazy.config.set(device="cpu"):
        for b in blocks:
            if b.skip is not None:
                skipped.append(f"line {b.line}: {b.skip}")
                continue
            try:
                exec(compile(b.code, f"{source}:{b.line}", "exec"), namespace)
                ran += 1
            except Exception as e:  # every failure is reported with its block, then the next runs
                failures.append(f"{source} line {b.line}: {type(e).__name__}: {e}\n"
                                + "".join(traceback.format_exception(e)[-3:]))
        _close_widgets(namespace)
    return ran, skipped, failures


@pytest.mark.parametrize("page", [p for p in PAGES if p == README or "```python" in p.read_text()],
                         ids=lambda p: str(p.relative_to(ROOT)))  # pages without code need no example files
def test_python_blocks_run_on_the_cpu(page, example_dir, capsys):
    name = str(page.relative_to(ROOT))
    blocks = python_blocks(page.read_text())
    if page == README:
        assert blocks, "README.md has no ```python block"
    ran, skipped, failures = run_blocks(blocks, source=name)
    with capsys.disabled():
        print(f"\n{name}: {ran} python blocks ran, {len(skipped)} skipped: {skipped}")
    assert not failures, (
        f"{name} python blocks failed on the CPU path; fix the example, add the files it names to "
        "_EXAMPLE_FILES in tests/test_readme.py, or mark it with <!-- skip-test: reason --> on the "
        "line before its fence:\n\n" + "\n".join(failures))
    assert ran >= 1 or not blocks or all(b.skip for b in blocks)


def _close_widgets(namespace: dict) -> None:
    for value in namespace.values():
        if isinstance(value, gpulazy.widgets.Dashboard):
            value.close()


def test_failures_are_reported_by_line_and_marked_blocks_counted(example_dir):
    text = ("```python\nx = 1\n```\n\n```python\nraise RuntimeError('boom')\n```\n\n"
            "<!-- skip-test: needs a cluster -->\n```python\nundefined_name\n```\n\n"
            "```python\nassert x == 1\n```\n")
    ran, skipped, failures = run_blocks(python_blocks(text), source="T.md")
    assert ran == 2 and skipped == ["line 10: needs a cluster"]
    assert len(failures) == 1 and failures[0].startswith("T.md line 5: RuntimeError: boom")


def test_example_files_exist_as_the_pages_name_them(example_dir):
    text = "\n".join(p.read_text() for p in PAGES)
    for name in _EXAMPLE_FILES:
        assert f'"{name}' in text, f"{name!r} is not named by README.md or docs/*.md any more; drop it here"
        assert os.path.exists(name.rstrip("/"))


def test_the_moved_sections_still_run():
    # The long README sections moved to docs/ keep their examples running: a page listed
    # here with no runnable block would mean its examples were all marked or dropped.
    for page in ("formats.md", "cache-and-prefetch.md", "configuration.md", "notebooks.md"):
        blocks = python_blocks((ROOT / "docs" / page).read_text())
        assert any(b.skip is None for b in blocks), f"docs/{page} has no python block that runs"
