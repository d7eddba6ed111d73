"""The npe2 reader: whatever ``gpulazy.from_files`` opens, as lazy image layers.

``napari_get_reader(path)`` only looks (magic bytes, a sidecar, a store's metadata
through ``gpulazy.layouts``); it returns ``None`` for anything gpulazy cannot open and
never raises. The reader function it returns opens the data lazily with
``gpulazy.multiscale``: a stored pyramid (OME-Zarr, OME-TIFF) becomes a multiscale layer
with its ``scale`` and axis names; large planes without one get a lazy pyramid built on
the device (``_view.pyramid``). Nothing is read until napari shows a plane.
"""

from __future__ import annotations

import os
from typing import Any, Callable

__all__ = ["napari_get_reader", "read_layers", "resolve_target"]

SIDECAR_SUFFIX = ".json"


def napari_get_reader(path: Any) -> Callable[[Any], list[tuple]] | None:
    """The reader function for ``path`` (a path or a list of paths), or ``None``."""
    try:
        target = resolve_target(path)
    except Exception:  # a reader that cannot open a path says so with None, never an error
        return None
    if target is None:
        return None
    return lambda _path: read_layers(target)


def resolve_target(path: Any) -> str | list[str] | None:
    """What to hand ``gpulazy.multiscale`` for ``path``, or ``None`` if gpulazy cannot open it.

    A store directory (Zarr) is itself; another directory is its data files of the
    most common extension (sidecars and stray files left out), which must be openable; a file is itself when a layout
    recognises it (``.npy``, TIFF, HDF5 by magic bytes; raw by its ``<file>.json``).
    """
    if isinstance(path, (list, tuple)):
        files = [os.fspath(p) for p in path]
        return files if files and all(_file_openable(p) for p in files) else None
    path = os.path.expanduser(os.fspath(path))
    if os.path.isdir(path):
        if _is_store(path):
            return path
        files = _data_files(path)
        if not files:
            return None
        # A folder of slices: the files of its most common extension (a stray README is left out).
        exts = [os.path.splitext(f)[1].lower() for f in files]
        common = max(set(exts), key=exts.count)
        files = [f for f, e in zip(files, exts) if e == common]
        return files if _file_openable(files[0]) else None
    return path if os.path.isfile(path) and _file_openable(path) else None


def _is_store(path: str) -> bool:
    from gpulazy import layouts

    for name in layouts.layout_names():
        cls = layouts.layout_class(name)
        if cls.opens_directories and cls.guessable and cls.guess_can_open(path):
            return True
    return False


def _data_files(folder: str) -> list[str]:
    from gpulazy.layouts import natural_key

    names = [n for n in os.listdir(folder) if not n.startswith(".") and not n.endswith(SIDECAR_SUFFIX)]
    return sorted((os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))),
                  key=natural_key)


def _file_openable(path: str) -> bool:
    from gpulazy import layouts
    from gpulazy.errors import LayoutError

    try:
        layouts.guess_layout(path)
    except LayoutError:
        return False
    return True


def read_layers(target: str | list[str], *, device: Any = None, chunks: Any = None, cache: Any = None,
                pyramid_min_side: int | None = None, prefetch: bool = True) -> list[tuple]:
    """napari layer data tuples ``[(data, kwargs, "image")]`` for ``target``, opened lazily.

    Parameters
    ----------
    target
        A file, a store directory or a list of files (see ``resolve_target``).
    device, chunks, cache
        As for ``gpulazy.from_files`` (default: a GPU when usable, the layout's chunks,
        the default device cache).
    pyramid_min_side
        Build a lazy pyramid when a plane is longer than this on a side and the data
        has no stored one (default ``_view.PYRAMID_MIN_SIDE``).
    prefetch
        Warm the next planes' chunks as the current napari viewer's sliders move.
    """
    import gpulazy

    from napari_gpulazy._view import PYRAMID_MIN_SIDE, HostView, pyramid

    levels = gpulazy.multiscale(target, device=device, chunks=chunks, cache=cache)
    base = levels[0]
    label = _label(target)
    if len(levels) == 1:
        levels = pyramid(base, min_side=PYRAMID_MIN_SIDE if pyramid_min_side is None else pyramid_min_side)
        # Derived levels read the full-resolution chunks: those are the ones to warm.
        targets = [base] * len(levels)
    else:
        targets = levels
    views = [HostView(a, label=label, target=t) for a, t in zip(levels, targets)]
    for v in views[1:]:
        v.transfers = views[0].transfers  # one counter per layer
    kwargs = _layer_kwargs(base, target, multiscale=len(views) > 1)
    if prefetch:
        _attach_current_viewer()
    return [(views if len(views) > 1 else views[0], kwargs, "image")]


def _label(target: str | list[str]) -> str:
    if isinstance(target, str):
        return target
    return target[0] if len(target) == 1 else f"{target[0]} (+{len(target) - 1} files)"


def _layer_kwargs(base: Any, target: str | list[str], *, multiscale: bool) -> dict[str, Any]:
    if isinstance(target, str):
        name = os.path.basename(os.path.normpath(target))
    else:  # files of one folder: the folder's name
        name = os.path.basename(os.path.dirname(os.path.abspath(target[0])))
    attrs = base.attrs
    kwargs: dict[str, Any] = {"name": name, "multiscale": multiscale,
                              "metadata": {"gpulazy": {"paths": _label(target), "device": base.chunk_source.device,
                                                       "layout": getattr(base.chunk_index, "layout", None)}}}
    scale = attrs.get("scale")
    if scale is not None and len(scale) == base.ndim:
        kwargs["scale"] = tuple(float(s) for s in scale)
    axes = attrs.get("axes")
    if axes is not None and len(axes) == base.ndim:
        kwargs["axis_labels"] = tuple(str(a) for a in axes)
    units = attrs.get("units")
    if units is not None and len(units) == base.ndim and all(units):
        kwargs["metadata"]["gpulazy"]["units"] = tuple(units)
    return kwargs


def _attach_current_viewer() -> None:
    # The reader cannot be handed the viewer; the one opening the file is the current one.
    try:
        from napari import current_viewer
    except ImportError:
        return
    viewer = current_viewer()
    if viewer is not None:
        from napari_gpulazy._hook import attach

        attach(viewer)
