"""``gpulazy.prefetch`` is a package whose imports flow one way: plan <- local, plan <- distributed."""

from __future__ import annotations

import ast
import pathlib

import gpulazy

PKG = pathlib.Path(gpulazy.__file__).parent / "prefetch"


def _gpulazy_imports(path: pathlib.Path) -> set[str]:
    """Every ``gpulazy...`` module ``path`` imports, at any depth (lazy imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gpulazy"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("gpulazy"))
    return names


def test_plan_is_the_bottom():
    assert not {m for m in _gpulazy_imports(PKG / "plan.py") if m.startswith("gpulazy.prefetch")}


def test_distributed_imports_only_the_planner():
    mods = {m for m in _gpulazy_imports(PKG / "distributed.py") if m.startswith("gpulazy.prefetch")}
    assert mods == {"gpulazy.prefetch.plan"}


def test_local_never_imported_by_plan_or_distributed_and_no_old_modules():
    local = {m for m in _gpulazy_imports(PKG / "local.py") if m.startswith("gpulazy.prefetch")}
    assert local <= {"gpulazy.prefetch.plan", "gpulazy.prefetch.distributed"}
    assert not (PKG.parent / "prefetch.py").exists() and not (PKG.parent / "_prefetch_distributed.py").exists()


def test_public_names_kept():
    from gpulazy.prefetch import ReadAheadPlan, find_reads  # noqa: F401

    assert gpulazy.prefetch.__name__ == "prefetch" and callable(gpulazy.prefetch.install)
    assert gpulazy.Prefetcher.__name__ == "Prefetcher"
    with gpulazy.prefetch(depth=2) as p:
        assert p.depth == 2


def test_motion_imports_only_the_planner():
    mods = {m for m in _gpulazy_imports(PKG / "motion.py") if m.startswith("gpulazy.prefetch")}
    assert mods == {"gpulazy.prefetch.plan"}
    assert not (PKG.parent / "motion.py").exists()  # one import path: gpulazy.prefetch.motion
