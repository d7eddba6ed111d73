"""napari's 3-D view of a large volume: a coarse level built on the device, shown while in 3-D.

napari volume-renders a single-scale layer whole: switching a 512 x 2048 x 2048 float32 volume
to 3-D would read all 8 GiB, copy them to the host and upload them as one texture (larger than
GPUs' 3-D texture limit, 2048 a side on most). ``VolumeSwap`` follows ``viewer.dims.ndisplay``:
entering 3-D, each gpulazy layer whose volume (its last three axes) is larger than
``VOLUME_BYTES`` shows a coarse level instead (``coarse_volume``: means over blocks of a power of
two a side, computed by dask from the full-resolution chunks on their device, through the
device cache); leaving 3-D gives the layer back its data, scale, translation and the plane it
showed. What it does not avoid: napari slices the full-resolution volume once when the view
switches, before any plugin's callback runs (napari keeps its own callbacks first); the coarse
level then replaces it, so napari draws and keeps 64 MiB instead of the whole volume. That slice
reads nothing: each large volume's ``HostView`` is armed (``HostView.defer``) to give napari zeros
that take no memory (a broadcast array) for a whole-volume request while the viewer is in 3-D and
the layer not yet swapped; the swap follows in the same event, before anything is drawn. Should
the coarse level fail to read, the layer is sliced again for real (and the user told why). A
layer added while the viewer is already in 3-D is armed only once napari has sliced it. A level
held in host memory is kept for the next entry into 3-D, shown again once every file of the
volume is stat'ed unchanged (else it is read anew, and a file that changed is named).

Why a swap and not one more level of a multiscale layer: napari's 2-D view picks the coarsest
level still larger than the canvas, and a level averaged along axis -3 holds no plane of the
file; napari's ``ViewerModel`` (no canvas) even starts 2-D views at the coarsest level. The 2-D
view must only ever show planes of the file.

Layers with a pyramid (stored, or built for planes larger than ``_view.PYRAMID_MIN_SIDE``) are
left to napari, which renders their coarsest level. Imports no Qt.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np

__all__ = ["VolumeSwap", "coarse_volume", "needs_level", "VOLUME_BYTES", "VOLUME_SIDE"]

#: A volume larger than this shows a coarse level in napari's 3-D view: 256³ float32 voxels.
VOLUME_BYTES = 64 << 20
#: Nor is any side of that level longer than this (GPUs' 3-D textures stop at 2048 a side).
VOLUME_SIDE = 1024


def coarse_volume(array: Any, *, max_bytes: int = VOLUME_BYTES, max_side: int = VOLUME_SIDE
                  ) -> tuple[Any, tuple[int, int, int]] | None:
    """``(level, factors)``: ``array`` averaged over blocks of ``factors`` on its last three axes,
    halving the longest side until the volume holds at most ``max_bytes`` and no side is longer
    than ``max_side``; ``None`` when it already fits (or is no volume).

    The level is lazy (a dask array over ``array``'s chunks, on their device); integer data is
    rounded back to its dtype, as the 2-D pyramid's levels are (``_view.pyramid``).

    >>> import dask.array as da, numpy as np
    >>> level, factors = coarse_volume(da.ones((8, 64, 64), dtype="u1", chunks=8), max_bytes=1024)
    >>> level.shape, factors
    ((8, 8, 16), (1, 8, 4))
    """
    import dask.array as da

    from napari_gpulazy._view import _mean_keep_dtype

    if not needs_level(array.shape, array.dtype, max_bytes=max_bytes, max_side=max_side):
        return None
    shape, factors = list(array.shape[-3:]), [1, 1, 1]

    def size(k: int) -> int:
        return shape[k] // factors[k]

    def too_big() -> bool:
        return (math.prod(size(k) for k in range(3)) * array.dtype.itemsize > max_bytes
                or max(size(k) for k in range(3)) > max_side)

    if not too_big():
        return None
    while too_big():
        k = max(range(3), key=size)
        if size(k) < 2:
            return None
        factors[k] *= 2
    axes = {array.ndim - 3 + k: f for k, f in enumerate(factors) if f > 1}
    level = da.coarsen(_mean_keep_dtype, array, axes, trim_excess=True, dtype=array.dtype)
    return level, (factors[0], factors[1], factors[2])


def needs_level(shape: tuple, dtype: Any, *, max_bytes: int = VOLUME_BYTES, max_side: int = VOLUME_SIDE) -> bool:
    """Whether a volume of ``shape`` (its last three axes) is too large to show whole in 3-D."""
    vol = tuple(shape)[-3:]
    if len(vol) < 3 or min(vol) < 1:
        return False
    return math.prod(vol) * np.dtype(dtype).itemsize > max_bytes or max(vol) > max_side


class VolumeSwap:
    """Show a coarse level of each large gpulazy volume while ``viewer`` is in 3-D (see the module)."""

    def __init__(self, viewer: Any, *, max_bytes: int = VOLUME_BYTES, max_side: int = VOLUME_SIDE):
        self._viewer = weakref.ref(viewer)
        self.max_bytes, self.max_side = max_bytes, max_side
        self._saved: dict[int, tuple[Any, Any, np.ndarray, np.ndarray]] = {}  # id(layer) -> what it had
        self._failed: set[int] = set()  # id(layer): its level did not read in this 3-D view; napari shows it whole
        # view -> (level in host memory, factors): shown again on the next entry into 3-D, once the
        # files are checked unchanged, instead of reading the whole volume again.
        self._levels: weakref.WeakKeyDictionary[Any, tuple[np.ndarray, tuple[int, int, int]]] = \
            weakref.WeakKeyDictionary()
        self._step: tuple[int, ...] | None = None
        # napari runs its own callbacks before any plugin's (EventEmitter.connect keeps them first), so
        # napari has sliced the full-resolution volume once in 3-D by the time this one swaps.
        viewer.dims.events.ndisplay.connect(self._on_ndisplay)
        viewer.layers.events.inserted.connect(self._on_inserted)
        for layer in viewer.layers:
            self._arm(layer)
        if viewer.dims.ndisplay == 3:
            self.enter()

    def close(self) -> None:
        viewer = self._viewer()
        if viewer is None:
            return
        self.leave()
        viewer.dims.events.ndisplay.disconnect(self._on_ndisplay)
        viewer.layers.events.inserted.disconnect(self._on_inserted)

    @property
    def swapped(self) -> list[Any]:
        """The layers showing a coarse level now."""
        return [layer for layer in (ref() for ref, *_ in self._saved.values()) if layer is not None]

    def _on_ndisplay(self, event: Any) -> None:
        if event.value == 3:
            self.enter()
        else:
            self.leave()

    def _on_inserted(self, event: Any) -> None:
        self._arm(event.value)
        viewer = self._viewer()
        if viewer is not None and viewer.dims.ndisplay == 3:
            self._swap(event.value)

    def _arm(self, layer: Any) -> None:
        """Let ``layer``'s view give napari zeros for the whole volume it slices on entering 3-D
        (``HostView.defer``), when that volume is one this swaps for a coarse level."""
        from napari_gpulazy._view import HostView

        view = getattr(layer, "data", None)
        if (not isinstance(view, HostView) or getattr(layer, "multiscale", False)
                or not needs_level(view.shape, view.dtype, max_bytes=self.max_bytes, max_side=self.max_side)):
            return
        layer_ref, whole = weakref.ref(layer), tuple(view.shape[-3:])

        def defer(part: Any) -> bool:
            viewer, shown = self._viewer(), layer_ref()
            return (viewer is not None and shown is not None and viewer.dims.ndisplay == 3
                    and id(shown) not in self._saved and id(shown) not in self._failed
                    and tuple(part.shape[-3:]) == whole)

        view.defer = defer

    def enter(self) -> None:
        """Swap in the coarse level of every large gpulazy volume of the viewer."""
        viewer = self._viewer()
        if viewer is None:
            return
        if self._step is None:
            self._step = tuple(viewer.dims.current_step)
        for layer in list(viewer.layers):
            self._swap(layer)

    def leave(self) -> None:
        """Give every swapped layer back its data, scale and translation, and the viewer its plane."""
        viewer = self._viewer()
        for ref, view, scale, translate in list(self._saved.values()):
            layer = ref()
            if layer is None:
                continue
            layer.data = view
            layer.scale, layer.translate = scale, translate
            layer.metadata.get("gpulazy", {}).pop("volume", None)
        self._saved.clear()
        self._failed.clear()  # the next entry into 3-D tries the coarse level again (and defers again)
        step, self._step = self._step, None
        if viewer is not None and step is not None and len(step) == len(viewer.dims.current_step):
            viewer.dims.current_step = step

    def _swap(self, layer: Any) -> None:
        from napari_gpulazy._view import HostView

        view = getattr(layer, "data", None)
        if not isinstance(view, HostView) or getattr(layer, "multiscale", False) or id(layer) in self._saved:
            return
        kept = self._levels.get(view)
        if kept is not None and _unchanged(view):
            data, factors = kept
        else:
            found = coarse_volume(view.array, max_bytes=self.max_bytes, max_side=self.max_side)
            if found is None:
                return
            level, factors = found
            data = _held(level, view, self.max_bytes)
            if data is None:  # napari was given zeros for the whole volume: let it read the volume itself
                self._failed.add(id(layer))
                layer.refresh()
                return
            if isinstance(data, np.ndarray):
                self._levels[view] = (data, factors)
        scale, translate = np.array(layer.scale, dtype=float), np.array(layer.translate, dtype=float)
        f = np.ones(layer.ndim)
        f[-3:] = factors
        self._saved[id(layer)] = (weakref.ref(layer), view, scale, translate)
        layer.data = data
        # A block's mean sits at the block's centre: (f - 1) / 2 voxels in from its first voxel.
        layer.scale, layer.translate = scale * f, translate + (f - 1) / 2 * scale
        layer.metadata.setdefault("gpulazy", {})["volume"] = {
            "shape": tuple(data.shape), "factors": factors,
            "from": "means over blocks of the full-resolution chunks, for the 3-D view"}


def _unchanged(view: Any) -> bool:
    """Whether every file ``view``'s array reads is as it was indexed (a stat each); ``False`` for
    an array gpulazy did not index, whose files it cannot check."""
    from gpulazy.errors import ChunkReadError
    from gpulazy.integrity import check_all_unchanged

    index = getattr(view.array, "chunk_index", None)
    if index is None:
        return False
    try:
        check_all_unchanged(index.specs.values())
    except ChunkReadError:
        return False
    return True


def _held(level: Any, view: Any, max_bytes: int) -> Any:
    """What the layer shows in 3-D: ``level`` computed once into host memory when it is one volume
    (napari slices a layer again on each change of its data, scale and translation: a lazy level
    would be computed each time), else a lazy ``HostView`` that napari slices per time point.
    ``None`` (after telling the user) when reading it failed."""
    from napari_gpulazy._view import HostView, notify_read_error

    if level.nbytes > 4 * max_bytes:
        return HostView(level, label=view.label, target=view.target, transfers=view.transfers)
    from gpulazy.convert import to_numpy

    try:
        held = to_numpy(level.compute())
    except Exception as e:  # the 3-D view stays as napari has it; the user is told which file failed
        notify_read_error(view.label, e)
        return None
    view.transfers.add(held.nbytes)
    return held
