"""Third-party plugins: entry-point tables, read once per process.

Reading entry points scans every installed distribution's metadata (~4 ms here), which
``from_files`` would otherwise pay on every call while guessing a layout.
"""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points
from typing import Any

__all__ = ["entry_point_table", "plugin_names", "load_plugin"]


@functools.cache
def entry_point_table(group: str) -> dict[str, str]:
    """``{name: "module:attr"}`` registered under ``group``."""
    return {ep.name: ep.value for ep in entry_points(group=group)}


def plugin_names(builtin: dict[str, str], plugins: dict[str, str]) -> list[str]:
    """Built-in names first, then the plugins' (a built-in name cannot be taken over)."""
    return list(builtin) + [n for n in plugins if n not in builtin]


def load_plugin(kind: str, name: str, builtin: dict[str, str], plugins: dict[str, str],
                also_valid: tuple[str, ...] = ()) -> Any:
    """The object registered as ``name`` (imported now); an unknown name lists the valid ones."""
    from gpulazy.errors import ConfigError

    target = builtin.get(name) or plugins.get(name)
    if target is None:
        valid = [*also_valid, *plugin_names(builtin, plugins)]
        raise ConfigError(f"unknown {kind} {name!r}; valid: {', '.join(map(repr, valid))}")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
