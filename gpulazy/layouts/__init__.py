"""Layouts: from files to ``ChunkSpec``s without reading the data.

Built-ins live in one table and are imported only when used; third parties register
through the ``gpulazy.layouts`` entry-point group (``name = "pkg.module:Class"``, a
``Layout`` subclass). ``index(paths, ...)`` resolves the paths, picks the layout (the
first whose ``guess_can_open`` recognises the first file; raw bytes when a ``dtype``
is given and nothing else matches) and returns its ``Index``.

>>> import numpy as np, tempfile, os
>>> from gpulazy import layouts
>>> p = os.path.join(tempfile.mkdtemp(), "a.npy"); np.save(p, np.zeros((4, 3), "f4"))
>>> ix = layouts.index(p)
>>> ix.layout, ix.shape, ix.dtype, ix.chunks
('npy', (4, 3), dtype('float32'), ((4,), (3,)))
"""

from __future__ import annotations

from gpulazy._plugins import entry_point_table, load_plugin, plugin_names

from typing import Any

from gpulazy.errors import LayoutError
from gpulazy.layouts._base import Index, Layout
from gpulazy.layouts._common import natural_key, resolve_paths

__all__ = [
    "Layout",
    "Index",
    "layout_names",
    "layout_class",
    "get_layout",
    "guess_layout",
    "index",
    "levels",
    "resolve_paths",
    "natural_key",
]

_BUILTIN = {
    "npy": "gpulazy.layouts.npy:NpyLayout",
    "raw": "gpulazy.layouts.raw:RawLayout",
    "hdf5": "gpulazy.layouts.hdf5:Hdf5Layout",
}


def _entry_points() -> dict[str, str]:
    return entry_point_table("gpulazy.layouts")


def layout_names() -> list[str]:
    """Every layout name: built-ins first, then those from entry points."""
    return plugin_names(_BUILTIN, _entry_points())


def layout_class(name: str) -> type[Layout]:
    """The ``Layout`` class registered as ``name`` (imported now)."""
    return load_plugin("layout", name, _BUILTIN, _entry_points())


def get_layout(name: str | Layout) -> Layout:
    """A layout instance for a name (or the instance itself)."""
    if isinstance(name, Layout):
        return name
    return layout_class(name)()


def guess_layout(path: str, *, dtype: Any = None) -> Layout:
    """The layout for ``path``: the first that recognises it, else raw when ``dtype`` is given."""
    for name in layout_names():
        if name == "raw":
            continue
        cls = layout_class(name)
        if cls.guessable and cls.guess_can_open(path):
            return cls()
    if dtype is not None:
        return layout_class("raw")()
    known = [n for n in layout_names() if n != "raw"]
    raise LayoutError(
        f"cannot tell how to read {path!r}: it is none of the known formats ({', '.join(known)}); "
        "to read it as raw binary, pass dtype= (and shape=, offset= for a header)")


def index(paths: Any, *, layout: str | Layout | None = None, **opts: Any) -> Index:
    """Resolve ``paths`` and index them with ``layout`` (guessed when ``None``).

    Options (``shape``, ``dtype``, ``offset``, ``order``, ``chunks``) go to the layout;
    those left as ``None`` are not passed, so each layout applies its own defaults.
    """
    lay = get_layout(layout) if layout is not None else None
    files = _store(paths, lay)
    if files is None:
        files = resolve_paths(paths)
    if lay is None:
        lay = guess_layout(files[0], dtype=opts.get("dtype"))
    given = {k: v for k, v in opts.items() if v is not None}
    return lay.index(files, **given)


def levels(paths: Any, *, layout: str | Layout | None = None, **opts: Any) -> list[Index]:
    """Every resolution level of ``paths``, full resolution first (one level if it has no pyramid)."""
    lay = get_layout(layout) if layout is not None else None
    files = _store(paths, lay)
    if files is None:
        files = resolve_paths(paths)
    if lay is None:
        lay = guess_layout(files[0], dtype=opts.get("dtype"))
    given = {k: v for k, v in opts.items() if v is not None}
    return lay.levels(files, **given)


def _store(paths: Any, lay: Layout | None) -> list[str] | None:
    """``[path]`` when ``paths`` is one directory that a layout reads as a whole (a Zarr store)."""
    import os

    if not isinstance(paths, (str, os.PathLike)):
        return None
    path = os.path.expanduser(os.fspath(paths))
    if not os.path.isdir(path):
        return None
    if lay is not None:
        return [path] if lay.opens_directories else None
    for name in layout_names():
        cls = layout_class(name)
        if cls.opens_directories and cls.guessable and cls.guess_can_open(path):
            return [path]
    return None
