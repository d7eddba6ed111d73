"""Another commit's ``gpulazy`` imported beside this one, for A/Bs timed in one process.

``load_old_tree("f62d462")`` extracts that commit's ``gpulazy/`` with ``git archive`` into a
temporary directory as the package ``gpulazy_old`` (every absolute import of ``gpulazy`` in it
rewritten) and imports it. Both trees then share the process, its CUDA context, KvikIO's thread
pool and dask, and their passes can be timed in the same rounds: on these shared hosts the
spread between processes (0.1-0.3 of a prefetch ratio) had hidden every change measured process
against process, where the same rounds showed a 4 % change plainly (RESULTS, twenty-second session).
"""

from __future__ import annotations

import atexit
import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent

#: ``gpulazy`` as a module name: ``gpulazy.x``, ``import gpulazy``, ``from gpulazy import``.
_MODULE = re.compile(r"\bgpulazy\b(?=\.|\s+import\b|\s*$)", re.MULTILINE)


def load_old_tree(rev: str, name: str = "gpulazy_old") -> ModuleType:
    """Commit ``rev``'s ``gpulazy`` package, imported as ``name``.

    ``rev`` may also be a directory holding a ``gpulazy/`` package (a tree extracted before, for
    a machine whose copy of the checkout has no git history: ``git archive REV gpulazy | tar -x -C DIR``).
    """
    if name in sys.modules:
        raise RuntimeError(f"{name!r} is imported already; one old tree a process")
    root = Path(tempfile.mkdtemp(prefix="gpulazy-old-"))
    atexit.register(shutil.rmtree, root, True)
    if Path(rev, "gpulazy").is_dir():
        shutil.copytree(Path(rev, "gpulazy"), root / "gpulazy", ignore=shutil.ignore_patterns("__pycache__"))
    else:
        _extract(rev, root)
    package = root / name
    os.rename(root / "gpulazy", package)
    for path in package.rglob("*.py"):
        path.write_text(_MODULE.sub(name, path.read_text()))
    sys.path.insert(0, str(root))
    return importlib.import_module(name)


def _extract(rev: str, root: Path) -> None:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, "gpulazy"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(root, filter="data")
        else:  # Python before 3.11.4: the archive is our own repository's
            tar.extractall(root)
