"""The project's own documents are in the repository and its links resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import gpulazy

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
DOCS = ["README.md", "CHANGELOG.md", "benchmarks/README.md", *PAGES]
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


# -- the README reads top-down for a newcomer; the long sections live in docs/ -----------------
def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_front_fits_on_two_screens():
    front = _readme().split("\n## Usage\n", 1)[0]
    assert front.count("\n") <= 100, f"the README up to Usage is {front.count(chr(10))} lines; keep it to ~100"


def test_readme_sections_in_a_newcomers_order():
    headings = re.findall(r"^## (.+)$", _readme(), re.M)
    order = ["Quick start", "Usage", "Choosing chunks", "Formats", "Troubleshooting", "Command line",
             "More documentation"]
    assert [h for h in headings if h in order] == order, headings
    for topic in ("No GPU found", "GPUDirect Storage is not active", "Out of memory", "Slow reads",
                  "A file that changed"):
        assert f"**{topic}" in _readme(), f"Troubleshooting does not cover {topic!r}"


def test_readme_links_every_docs_page():
    for page in PAGES:
        assert f"]({page})" in _readme() or f"]({page}#" in _readme(), f"README.md does not link {page}"


def test_configuration_page_lists_every_config_key():
    from gpulazy.config import KEYS

    text = (ROOT / "docs" / "configuration.md").read_text()
    for key in KEYS:
        assert f"| `{key}` |" in text, f"docs/configuration.md does not describe config key {key!r}"


def test_notebooks_page_names_every_notebook():
    text = (ROOT / "docs" / "notebooks.md").read_text()
    names = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    for name in names:
        assert f"`{name}`" in text, f"docs/notebooks.md does not describe notebooks/{name}.ipynb"
    words = {4: "four", 5: "five", 6: "six", 7: "seven"}
    assert f"all {words.get(len(names), len(names))}" in text, "docs/notebooks.md miscounts the notebooks CI runs"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", path.read_text(), re.M)}


@pytest.mark.parametrize("doc", ["README.md", *PAGES])
def test_anchor_links_name_a_heading(doc):
    path = ROOT / doc
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", path.read_text()):
        page = (path.parent / target) if target else path
        if page.suffix == ".md":
            assert anchor in _anchors(page), f"{doc} links to {target}#{anchor}, which has no such heading"
