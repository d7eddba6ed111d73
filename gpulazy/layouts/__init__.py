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

import os
from typing import Any, NoReturn

from gpulazy.errors import LayoutError
from gpulazy.layouts._base import Index, Layout
from gpulazy.layouts._common import names_collection, natural_key, resolve_paths
from gpulazy.layouts._limits import TooManyChunksError

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
    "tiff": "gpulazy.layouts.tiff:TiffLayout",
    "zarr": "gpulazy.layouts.zarr:ZarrLayout",
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
    if dtype is not None or layout_class("raw").guess_can_open(path):  # raw last: a sidecar is a weak sign
        return layout_class("raw")()
    from gpulazy.layouts._sniff import describe

    # Name what the file looks like and what reads it, not only what gpulazy knows.
    raise LayoutError(describe(path, [n for n in layout_names() if n != "raw"]))


def index(paths: Any, *, layout: str | Layout | None = None, **opts: Any) -> Index:
    """Resolve ``paths`` and index them with ``layout`` (guessed when ``None``).

    Options (``shape``, ``dtype``, ``offset``, ``order``, ``chunks``) go to the layout;
    those left as ``None`` are not passed, so each layout applies its own defaults.
    Layouts whose ``index`` takes ``stack`` get ``stack=True`` when ``paths`` names a
    collection (a folder, glob or list, even of one file) and ``stack=False`` for a
    single path, unless the caller passed ``stack`` itself.
    """
    lay, files, given = _prepare(paths, layout, opts)
    try:
        return lay.index(files, **given)
    except TooManyChunksError as e:  # counted where the path is not known: name it here
        _name_path(e, files[0])


def levels(paths: Any, *, layout: str | Layout | None = None, **opts: Any) -> list[Index]:
    """Every resolution level of ``paths``, full resolution first (one level if it has no pyramid)."""
    lay, files, given = _prepare(paths, layout, opts)
    try:
        return lay.levels(files, **given)
    except TooManyChunksError as e:
        _name_path(e, files[0])


def _name_path(e: TooManyChunksError, path: str) -> NoReturn:
    if e.where:
        raise e
    raise e.at(path) from e


def _prepare(paths: Any, layout: str | Layout | None, opts: dict[str, Any]
             ) -> tuple[Layout, list[str], dict[str, Any]]:
    """The layout, the resolved files and the options to index ``paths`` with."""
    lay = get_layout(layout) if layout is not None else None
    files = _store(paths, lay)
    collection = False
    if files is None:
        _check_not_a_store(paths)
        files = resolve_paths(paths)
        collection = names_collection(paths)
        if collection and isinstance(paths, (str, os.PathLike)):
            _check_one_kind(paths, files)
    if lay is None:
        lay = guess_layout(files[0], dtype=opts.get("dtype"))
    given = {k: v for k, v in opts.items() if v is not None}
    if "stack" not in given and _takes_stack(lay):
        # A folder, glob or list stacks even with one file: shapes must not depend on
        # how many files matched (see Layout.index).
        given["stack"] = collection
    return lay, files, given


def _check_not_a_store(paths: Any) -> None:
    """A Zarr store no layout opens is named as the store, not by a file inside it."""
    if isinstance(paths, (str, os.PathLike)) and os.path.isdir(os.path.expanduser(os.fspath(paths))):
        from gpulazy.layouts._sniff import describe, zarr_store_of

        path = os.path.expanduser(os.fspath(paths))
        store = zarr_store_of(path)
        if store is not None and store.path == os.path.abspath(path):
            raise LayoutError(describe(path, [n for n in layout_names() if n != "raw"]))


def _check_one_kind(pattern: Any, files: list[str]) -> None:
    """A folder or glob must name files of one kind; say which differ and suggest a glob."""
    from gpulazy.layouts._sniff import mixed_kinds

    mixed = mixed_kinds(files)
    if mixed:
        raise LayoutError(f"{os.fspath(pattern)!r}: {mixed}")


def _takes_stack(lay: Layout) -> bool:
    import inspect

    params = inspect.signature(lay.index).parameters
    return "stack" in params


def _store(paths: Any, lay: Layout | None) -> list[str] | None:
    """``[path]`` when ``paths`` is one directory that a layout reads as a whole (a Zarr store)."""
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
