"""Contrast limits from the data, computed on its device before napari guesses them.

Left to itself, napari 0.9 guesses an image layer's contrast limits from the plane it
slices first (plane 0): a volume whose later planes are brighter opens saturated white.
``data_limits`` instead takes the minimum and maximum of

- a stored pyramid's coarsest level (all of it, when it fits ``SAMPLE_BYTES``), which
  summarises the whole volume, or
- a few planes spread through the volume (``SAMPLE_AT``): the middle one first, the one
  napari shows first, then the ends and the quarters while the stored chunks they touch
  fit ``SAMPLE_BYTES``.

The reductions run where the chunks are (CuPy on a GPU: only two numbers reach the host),
and the chunks are read through the device cache, so the middle plane is already there when
napari asks for it. Imports neither napari nor Qt.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["data_limits", "SAMPLE_AT", "SAMPLE_BYTES"]

#: Where planes are sampled, as fractions of the volume's planes, in the order they are taken.
SAMPLE_AT = (0.5, 0.0, 1.0, 0.25, 0.75)
#: Stored-chunk bytes the sample may read (each chunk counted once); the middle plane is always read.
SAMPLE_BYTES = 256 << 20


def data_limits(levels: list[Any], *, stored_pyramid: bool,
                budget: int = SAMPLE_BYTES) -> tuple[tuple[float, float], str] | None:
    """``((low, high), what was measured)`` for an image layer of ``levels``, or ``None``.

    ``None`` for data napari does not draw by contrast limits (complex numbers) or has no
    elements. Equal extremes widen to ``(v, v + 1)``: napari needs ``low < high``.
    """
    base = levels[0]
    dtype = np.dtype(base.dtype)
    if dtype.kind not in "biuf" or base.size == 0:
        return None
    if stored_pyramid and len(levels) > 1 and levels[-1].nbytes <= budget:
        coarsest = levels[-1]
        sample, what = coarsest, f"the coarsest stored level {tuple(coarsest.shape)}, all of it"
    else:
        array = levels[-1] if stored_pyramid else base
        planes = sample_planes(array, budget)
        sample = _stack(array, planes)
        what = (f"all of {tuple(array.shape)}" if planes == [()] else
                f"planes {[list(p) if len(p) > 1 else p[0] for p in planes]} of {tuple(array.shape)}")
    low, high = _extremes(sample, dtype)
    if not (math.isfinite(low) and math.isfinite(high)):
        return None  # all NaN (or inf): napari's own guess is as good as any
    return (low, high if high > low else low + 1.0), what


def sample_planes(array: Any, budget: int) -> list[tuple[int, ...]]:
    """Indices over the leading axes (all but the last two) of the planes to sample.

    Taken in ``SAMPLE_AT`` order while the stored chunks they touch, each counted once,
    fit ``budget``; the first (the middle plane) always. ``[()]`` for a 2-D array.
    """
    lead = tuple(array.shape[:-2])
    count = math.prod(lead)
    plane_bytes = math.prod(array.shape[-2:]) * np.dtype(array.dtype).itemsize
    edges = [np.cumsum((0,) + tuple(c)) for c in array.chunks[:-2]]
    taken: list[tuple[int, ...]] = []
    blocks: set[tuple[int, ...]] = set()
    spent = 0
    for at in SAMPLE_AT:
        at_plane = math.floor(at * (count - 1) + 0.5)  # half up: the middle is napari's first plane (n // 2)
        plane = tuple(int(i) for i in np.unravel_index(at_plane, lead)) if lead else ()
        if plane in taken:
            continue
        block = tuple(int(np.searchsorted(e, i, "right")) - 1 for e, i in zip(edges, plane))
        cost = 0 if block in blocks else plane_bytes * math.prod(int(e[b + 1] - e[b]) for e, b in zip(edges, block))
        if taken and spent + cost > budget:
            continue
        taken.append(plane)
        blocks.add(block)
        spent += cost
    return taken


def _stack(array: Any, planes: list[tuple[int, ...]]) -> Any:
    import dask.array as da

    return da.stack([array[p] for p in planes]) if len(planes) > 1 else array[planes[0]]


def _extremes(sample: Any, dtype: np.dtype) -> tuple[float, float]:
    import dask

    if dtype.kind == "b":
        sample = sample.astype("u1")
    if dtype.kind == "f":
        import dask.array as da

        low, high = da.nanmin(sample), da.nanmax(sample)
    else:
        low, high = sample.min(), sample.max()
    # Reduced on the chunks' device: a CuPy 0-d array per extreme, converted here.
    low, high = dask.compute(low, high, scheduler="threads")
    return float(low), float(high)
