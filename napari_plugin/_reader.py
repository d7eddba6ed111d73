"""The npe2 reader: whatever ``gpulazy.from_files`` opens, as lazy image layers.

``napari_get_reader(path)`` only looks (magic bytes, a sidecar, a store's metadata
through ``gpulazy.layouts``); it returns ``None`` for anything gpulazy cannot open and
never raises. The reader function it returns opens the data lazily with
``gpulazy.multiscale``: a stored pyramid (OME-Zarr, OME-TIFF) becomes a multiscale layer
with its ``scale`` and axis names; large planes without one get a lazy pyramid built on
the device (``_view.pyramid``). Nothing is read but the small sample that sets the contrast
limits (``_contrast``) and, for a stored pyramid, its coarsest level, warmed into the device
cache in the background as the layer is made (``warm_coarsest``: a 3-D view or a zoom-out
then shows at once); an HDF5 file gives a layer per image-like dataset.
"""

from __future__ import annotations

import os
from typing import Any, Callable

__all__ = ["napari_get_reader", "read_layers", "resolve_target", "axis_labels", "warm_coarsest"]

SIDECAR_SUFFIX = ".json"
#: A stored pyramid's coarsest level is warmed at open when it is at most this large (and at
#: most the read-ahead's share of the cache, ``gpulazy.prefetch.plan.CACHE_FRACTION``).
WARM_COARSEST_BYTES = 256 << 20


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
                pyramid_min_side: int | None = None, prefetch: bool = True,
                contrast_limits: tuple[float, float] | None = None) -> list[tuple]:
    """napari layer data tuples ``[(data, kwargs, "image"), ...]`` for ``target``, opened lazily.

    One layer per image of the file: an HDF5 file holding several image-like datasets gives
    one layer each (``"run.h5/entry/data"``), the largest last (on top, selected) and the
    others hidden until asked for.

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
    contrast_limits
        ``(low, high)`` for every layer; by default they are measured on the device from the
        data (``_contrast.data_limits``) and stated in the layer's metadata.
    """
    from gpulazy.errors import LayoutError

    from napari_gpulazy._view import PYRAMID_MIN_SIDE

    layers, refused = [], []
    members = _members(target)
    for opts in reversed(members):  # largest last: napari puts it on top
        try:
            layers.append(_read_layer(target, opts, device=device, chunks=chunks, cache=cache,
                                      contrast_limits=contrast_limits, pyramid_min_side=PYRAMID_MIN_SIDE
                                      if pyramid_min_side is None else pyramid_min_side))
        except LayoutError as e:
            if len(members) == 1:
                raise
            refused.append(e)  # one dataset gpulazy cannot read (compact, virtual...) hides no other
    if not layers:
        raise refused[-1]
    if refused:
        _notify_refused(refused)
    for _, kwargs, _ in layers[:-1]:
        kwargs["visible"] = False
    if prefetch:
        _attach_current_viewer()
    return layers


def _notify_refused(errors: list[Exception]) -> None:
    try:
        from napari.utils.notifications import show_warning
    except ImportError:
        return
    show_warning("gpulazy opened the other datasets; it cannot read " + "; ".join(str(e) for e in errors))


def _members(target: str | list[str]) -> list[dict[str, Any]]:
    """Layout options of each image ``target`` holds, largest first: ``[{}]`` for a one-image file.

    An HDF5 file names its image-like datasets (``dataset=`` each): a file holding more than one
    array opens whole instead of failing with "pass dataset=".
    """
    from gpulazy import layouts

    first = target if isinstance(target, str) else target[0]
    if os.path.isdir(first) or layouts.guess_layout(first).name != "hdf5":
        return [{}]
    from gpulazy.layouts.hdf5 import image_datasets

    names = [name for name, _, _ in image_datasets(first)]
    return [{"dataset": n} for n in names] or [{}]


def _read_layer(target: str | list[str], opts: dict[str, Any], *, device: Any, chunks: Any, cache: Any,
                pyramid_min_side: int, contrast_limits: tuple[float, float] | None) -> tuple:
    import gpulazy

    from napari_gpulazy._view import HostView, pyramid

    levels = gpulazy.multiscale(target, device=device, chunks=chunks, cache=cache, **opts)
    base = levels[0]
    stored_pyramid = len(levels) > 1
    label = _label(target)
    if not stored_pyramid:
        levels = pyramid(base, min_side=pyramid_min_side)
        # Derived levels read the full-resolution chunks: those are the ones to warm.
        targets = [base] * len(levels)
    else:
        targets = levels
        warm_coarsest(levels[-1])
    views = [HostView(a, label=label, target=t) for a, t in zip(levels, targets)]
    for v in views[1:]:
        v.transfers = views[0].transfers  # one counter per layer
    kwargs = _layer_kwargs(base, target, multiscale=len(views) > 1, dataset=opts.get("dataset"))
    if not kwargs["rgb"]:  # colour keeps napari's limits (0-255 for 8 bits: the colours as stored)
        _set_contrast(kwargs, levels, stored_pyramid, contrast_limits)
    return (views if len(views) > 1 else views[0], kwargs, "image")


def warm_coarsest(level: Any, *, limit: int = WARM_COARSEST_BYTES) -> int:
    """Start reading every chunk of ``level`` (a gpulazy array) into its device cache; how many.

    Returns at once: the cache's prefetch threads read the chunks, and a plane asked for
    meanwhile waits on its chunk's read rather than starting another. Nothing is read when
    the level is larger than ``limit`` or than the read-ahead's share of the cache, or when
    it reads through no cache.
    """
    from gpulazy.prefetch.plan import CACHE_FRACTION

    source = level.chunk_source
    cache = source.cache_instance()
    if cache is None or level.nbytes > min(limit, cache.capacity * CACHE_FRACTION):
        return 0
    return cache.prefetch(list(level.chunk_index.specs.values()), source.read)


def _set_contrast(kwargs: dict[str, Any], levels: list[Any], stored_pyramid: bool,
                  given: tuple[float, float] | None) -> None:
    from napari_gpulazy._contrast import data_limits

    found = (tuple(given), "given") if given is not None else data_limits(levels, stored_pyramid=stored_pyramid)
    if found is None:
        return  # napari guesses (complex or all-NaN data)
    limits, what = found
    kwargs["contrast_limits"] = limits
    kwargs["metadata"]["gpulazy"]["contrast_limits"] = {"limits": limits, "from": what}


def _label(target: str | list[str]) -> str:
    if isinstance(target, str):
        return target
    return target[0] if len(target) == 1 else f"{target[0]} (+{len(target) - 1} files)"


def _layer_kwargs(base: Any, target: str | list[str], *, multiscale: bool, dataset: str | None = None
                  ) -> dict[str, Any]:
    if isinstance(target, str):
        name = os.path.basename(os.path.normpath(target))
    else:  # files of one folder: the folder's name
        name = os.path.basename(os.path.dirname(os.path.abspath(target[0])))
    if dataset is not None:
        name += "/" + dataset.lstrip("/")
    attrs = base.attrs
    kwargs: dict[str, Any] = {"name": name, "multiscale": multiscale,
                              "metadata": {"gpulazy": {"paths": _label(target), "device": base.chunk_source.device,
                                                       "layout": getattr(base.chunk_index, "layout", None)}}}
    if dataset is not None:
        kwargs["metadata"]["gpulazy"]["dataset"] = dataset
    axes = attrs.get("axes")
    axes = tuple(axes) if axes is not None and len(axes) == base.ndim else None
    kwargs["rgb"] = rgb = is_rgb(base.shape, axes)
    ndim = base.ndim - rgb  # napari's axes: a colour axis is not one of them
    scale = attrs.get("scale")
    if scale is not None and len(scale) == base.ndim:
        kwargs["scale"] = tuple(float(s) for s in scale[:ndim])
    labels = axis_labels(axes[:ndim] if axes else None, ndim)
    if labels is not None:
        kwargs["axis_labels"] = labels
    units = attrs.get("units")
    if units is not None and len(units) == base.ndim and all(units[:ndim]):
        kwargs["metadata"]["gpulazy"]["units"] = tuple(units[:ndim])
    return kwargs


def is_rgb(shape: tuple[int, ...], axes: tuple | None) -> bool:
    """Whether napari shows the last axis as colour: the format calls it samples (``s``, tifffile's
    name for RGB(A)), or names it nothing and napari's own guess says so (3 or 4 long after
    planes longer than 30 px). Given explicitly, so labels and scale have napari's length."""
    if len(shape) < 3 or shape[-1] not in (3, 4):
        return False
    last = "" if axes is None or axes[-1] is None else str(axes[-1]).lower()
    if last == "s":
        return True
    return last in GENERIC_AXES and all(n > 30 for n in shape[-3:-1])


#: Axis names that say nothing about the axis (tifffile's ``q``, "other", and ``i``, "image
#: sequence"; a raw stack's ``file``): napari's default label is shown instead.
GENERIC_AXES = frozenset({"q", "i", "file", "", "none"})


def axis_labels(axes: Any, ndim: int) -> tuple[str, ...] | None:
    """napari ``axis_labels`` from a format's axis names, or ``None`` when it names none.

    Names the format gives (``z``, ``y``, ``x``, ``c``, ``t`` from OME, ImageJ, Zarr
    ``dimension_names``, a sidecar) are kept; generic ones (``GENERIC_AXES``), missing ones
    and repeats get napari's default for their position (``"-3"`` of three axes), which
    napari shows as its own slider label.
    """
    if axes is None or len(axes) != ndim:
        return None
    labels: list[str] = []
    for i, a in enumerate(axes):
        name = "" if a is None else str(a)
        labels.append(str(i - ndim) if name.lower() in GENERIC_AXES or name in labels else name)
    return tuple(labels) if any(lab != str(i - ndim) for i, lab in enumerate(labels)) else None


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
