"""Packaging: every subpackage ships, the entry points resolve, the extras exist."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_dirs(top: Path, name: str) -> set[str]:
    return {name + ("." + ".".join(p.parent.relative_to(top).parts) if p.parent != top else "")
            for p in top.rglob("__init__.py") if "__pycache__" not in p.parts}


def test_every_subpackage_is_listed():
    # setuptools ships only the packages listed: a new folder left out installs nowhere.
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = _package_dirs(ROOT / "gpulazy", "gpulazy") | _package_dirs(ROOT / "napari_plugin", "napari_gpulazy")
    assert found - listed == set(), f"add these to [tool.setuptools] packages: {sorted(found - listed)}"


def test_package_data_present():
    assert (ROOT / "gpulazy" / "py.typed").exists()
    assert (ROOT / "napari_plugin" / "napari.yaml").exists()


def test_version_matches_metadata():
    import gpulazy

    # One place: gpulazy/_version.py, which pyproject.toml reads (dynamic version).
    assert "version" in PYPROJECT["project"]["dynamic"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gpulazy._version.__version__"}
    assert gpulazy.__version__ == md.version("gpulazy")


def test_console_script_entry_point_resolves():
    (ep,) = [e for e in md.entry_points(group="console_scripts") if e.name == "gpulazy"]
    assert ep.value == "gpulazy.cli:main"
    from gpulazy.cli import main

    assert ep.load() is main


def test_console_script_runs():
    exe = Path(sys.executable).parent / "gpulazy"
    if not exe.exists():
        pytest.skip(f"no gpulazy script beside {sys.executable} (package not installed in this environment)")
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "info" in r.stdout and "bench" in r.stdout and "demo" in r.stdout


def test_napari_manifest_entry_point():
    (ep,) = [e for e in md.entry_points(group="napari.manifest") if e.name == "gpulazy"]
    module, _, resource = ep.value.partition(":")
    mod = importlib.import_module(module)
    assert os.path.exists(os.path.join(os.path.dirname(mod.__file__), resource))


def test_extras_declared():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"gpu", "dev", "notebook", "napari", "torch", "all"} <= set(extras)
    # The README's quick start installs '.[gpu]' on machines without a GPU too: it must not
    # pull a CUDA build of torch (a plain torch requirement can).
    assert not any(req.startswith("torch") for req in extras["gpu"] + extras["dev"])


def test_readme_quick_start_has_two_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```")[1::2]
    commands = [line for b in blocks for line in b.splitlines()[1:] if line.strip()]
    assert len(commands) == 2, commands
    assert "gpulazy demo" in commands[0] and "pytest" in commands[1]


def test_ci_runs_the_readme_quick_start_word_for_word():
    # .ci/run extracts the two bash blocks of the Quick start and runs them as written:
    # run its extraction here and check it yields the README's two commands, demo first.
    import subprocess
    import sys

    ci = (ROOT / ".ci" / "run").read_text()
    script = ci.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    commands = out.stdout.split("\0")[:-1]
    section = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("\n", 1)[1].strip() for b in section.split("```")[1::2] if b.startswith("bash")]
    assert commands == blocks and len(commands) == 2
    assert commands[0].endswith("gpulazy demo") and commands[1].endswith("python -m pytest")
    run_lines = [line for line in ci.splitlines() if line.startswith("bash -euo pipefail -c")]
    assert run_lines == ['bash -euo pipefail -c "${quickstart[0]}"', 'bash -euo pipefail -c "${quickstart[1]}"']
    # The test command is the script's last: CI ends with pytest's summary and exit status.
    assert ci.rstrip().splitlines()[-1] == run_lines[1]