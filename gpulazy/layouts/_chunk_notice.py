"""The one-line notice when ``chunks=`` asked for blocks smaller than the stored chunks.

Chunked formats (TIFF strips/tiles, Zarr, HDF5) read whole stored chunks: a block that
cut one would read and decode it twice. So ``grid_chunks`` moves each block edge up to a
stored-chunk edge, and ``chunks=(1, 64, 64)`` on TIFF pages of 300 × 400 gives blocks of
``(1, 300, 400)``. That was documented but silent; a ``ChunksEnlargedWarning`` now says
to what and why, once per call site (Python's default warning filter), and can be
silenced or turned into an error by its class.

Only axes the caller spelled as element counts are compared: ``"auto"``, a byte size
(``"16MiB"``), ``-1`` and ``None`` ask for gpulazy's choice, and no choice of ours is
"enlarged".
"""

from __future__ import annotations

import numbers
import os
import sys
import warnings
from typing import Any, Sequence

from gpulazy.errors import ChunksEnlargedWarning

__all__ = ["warn_if_enlarged"]


def warn_if_enlarged(asked: Any, wanted: Sequence[Sequence[int]], got: Sequence[Sequence[int]],
                     stored: Sequence[int]) -> None:
    """Warn when an axis given in elements came out with other blocks than ``wanted``."""
    axes = [a for a in _counted_axes(asked, len(got)) if tuple(wanted[a]) != tuple(got[a])]
    if not axes:
        return
    first = tuple(c[0] if c else 0 for c in got)
    warnings.warn(
        f"gpulazy: chunks={asked!r} became blocks of {first} ({'axis' if len(axes) == 1 else 'axes'} "
        f"{', '.join(map(str, axes))} enlarged): "
        f"the data is stored in chunks of {tuple(stored)} and gpulazy reads whole stored chunks (cutting one "
        f"would read and decode it twice); ask for multiples of {tuple(stored)} to silence this",
        ChunksEnlargedWarning, stacklevel=_caller_stacklevel())


def _counted_axes(asked: Any, ndim: int) -> list[int]:
    """The axes whose blocks ``asked`` gives as element counts."""
    if asked is None or isinstance(asked, str):
        return []
    if isinstance(asked, dict):
        return sorted(a % ndim for a, c in asked.items() if isinstance(a, int) and _is_count(c))
    if _is_count(asked):  # one int for every axis
        return list(range(ndim))
    return [a for a, c in enumerate(asked) if a < ndim and _is_count(c)]


def _is_count(c: Any) -> bool:
    if isinstance(c, (tuple, list)):
        return bool(c) and all(_is_count(x) for x in c)
    return isinstance(c, numbers.Integral) and not isinstance(c, bool) and c != -1


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside gpulazy: the warning names the user's line."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1  # warn_if_enlarged's frame is stacklevel 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return level
