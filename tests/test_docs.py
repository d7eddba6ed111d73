"""The project's own documents are in the repository and its links resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import gpulazy

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "CHANGELOG.md", "docs/ARCHITECTURE.md", "benchmarks/README.md"]
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    path = ROOT / doc
    text = path.read_text()
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        assert (path.parent / target).exists(), f"{doc} links to {target!r}, which does not exist"


@pytest.mark.parametrize("doc", DOCS + ["benchmarks/run.py", "benchmarks/bench_prefetch.py"])
def test_no_references_to_files_outside_the_repository(doc):
    text = (ROOT / doc).read_text()
    for name in ("DESIGN.md", "STYLE.md", "ECOSYSTEM.md", "shared/"):
        assert name not in text, f"{doc} refers to {name}, which is not in the repository"


def test_architecture_page_covers_the_tree():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for module in sorted((ROOT / "gpulazy").glob("[!_]*.py")):  # every public module is described
        assert f"gpulazy/{module.name}" in text, f"docs/ARCHITECTURE.md does not mention gpulazy/{module.name}"
    for heading in ("## The pipeline", "## Modules", "## Contracts"):
        assert heading in text


def test_licence_matches_the_package_metadata():
    import tomllib

    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "the gpulazy developers" in text
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == {"text": "BSD-3-Clause"}


def test_changelog_has_unreleased_and_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## Unreleased" in text
    assert re.search(rf"^## {re.escape(gpulazy.__version__)} - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M)
    assert text.index("## Unreleased") < text.index(f"## {gpulazy.__version__}")
