"""The raw sidecar: a small JSON file beside a raw file saying how to read it.

A raw file has no header, so ``from_files("vol.raw")`` cannot know its dtype or shape.
The file ``vol.raw.json`` beside it says so::

    {"shape": [512, 2048, 2048], "dtype": "<f4", "offset": 0, "order": "C",
     "axes": ["z", "y", "x"], "scale": [2.0, 0.5, 0.5], "units": ["um", "um", "um"]}

``shape`` (of the one file; of each file in a stack) and ``dtype`` (NumPy notation, byte
order honoured) are required; ``offset`` (header bytes to skip, default 0) and
``order`` (``"C"`` or ``"F"``, default ``"C"``) are optional. ``axes``, ``scale``,
``translation``, ``units`` and ``name`` are optional too and become the array's
``attrs`` (napari uses ``scale`` and ``axes``). Any other key is an error, so a typo
(``"dtpye"``) does not go unnoticed.

>>> import json, os, tempfile, numpy as np
>>> p = os.path.join(tempfile.mkdtemp(), "v.raw"); np.zeros((2, 3), "<u2").tofile(p)
>>> _ = write_sidecar(p, shape=(2, 3), dtype="<u2", axes=("y", "x"))
>>> s = read_sidecar(p); s.shape, s.dtype, s.attrs
((2, 3), dtype('uint16'), {'axes': ('y', 'x')})
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpulazy.errors import LayoutError

__all__ = ["Sidecar", "sidecar_path", "read_sidecar", "write_sidecar"]

SUFFIX = ".json"
REQUIRED = ("shape", "dtype")
OPTIONAL = ("offset", "order")
ATTRS = ("axes", "scale", "translation", "units", "name")


@dataclass(frozen=True)
class Sidecar:
    """What a sidecar says: how to read the raw file, and ``attrs`` about the array."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int = 0
    order: str = "C"
    attrs: dict = field(default_factory=dict)


def sidecar_path(path: str) -> str | None:
    """``path + ".json"`` when that file exists beside ``path``, else ``None`` (never raises)."""
    candidate = os.fspath(path) + SUFFIX
    try:
        return candidate if os.path.isfile(candidate) else None
    except (OSError, ValueError):
        return None


def read_sidecar(path: str) -> Sidecar:
    """The sidecar of raw file ``path``; ``LayoutError`` naming the sidecar if it is absent or wrong."""
    from gpulazy.layouts._common import check_dtype, check_order, check_shape

    where = os.fspath(path) + SUFFIX
    try:
        with open(where, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError as e:
        raise LayoutError(f"raw file {path!r} has no sidecar {where!r}; pass dtype= and shape=, or write "
                          f"the sidecar (gpulazy.layouts.raw.write_sidecar)") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LayoutError(f"sidecar {where!r} is not readable JSON: {e}") from e
    if not isinstance(doc, dict):
        raise LayoutError(f"sidecar {where!r} must hold a JSON object with {list(REQUIRED)}, "
                          f"got {type(doc).__name__}")
    missing = [k for k in REQUIRED if k not in doc]
    if missing:
        raise LayoutError(f"sidecar {where!r} lacks the required keys {missing}; e.g. "
                          '{"shape": [512, 2048, 2048], "dtype": "<f4"}')
    unknown = sorted(set(doc) - set(REQUIRED + OPTIONAL + ATTRS))
    if unknown:
        raise LayoutError(f"sidecar {where!r} has unknown keys {unknown}; valid: "
                          f"{list(REQUIRED + OPTIONAL + ATTRS)}")
    try:
        if not isinstance(doc["shape"], list) or not all(isinstance(n, int) for n in doc["shape"]):
            raise LayoutError(f"shape must be a list of non-negative integers, got {doc['shape']!r}")
        shape = check_shape(doc["shape"], what="shape")
        dtype = check_dtype(doc["dtype"], what="dtype")
        order = check_order(doc.get("order", "C"))
        offset = doc.get("offset", 0)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise LayoutError(f"offset must be a non-negative integer, got {offset!r}")
        attrs = {k: _attr(k, doc[k], len(shape)) for k in ATTRS if k in doc}
    except LayoutError as e:
        raise LayoutError(f"sidecar {where!r}: {e}") from e
    return Sidecar(where, shape, dtype, offset, order, attrs)


def _attr(key: str, value: Any, ndim: int) -> Any:
    if key == "name":
        return str(value)
    if not isinstance(value, list) or len(value) != ndim:
        raise LayoutError(f"{key} must be a list of {ndim} values (one per axis), got {value!r}")
    if key in ("scale", "translation"):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise LayoutError(f"{key} must hold numbers, got {value!r}")
        return tuple(float(v) for v in value)
    return tuple(str(v) for v in value)


def write_sidecar(path: str, *, shape: Any, dtype: Any, offset: int = 0, order: str = "C",
                  **attrs: Any) -> str:
    """Write ``path + ".json"`` describing raw file ``path``; returns the sidecar's path.

    ``attrs``: ``axes``, ``scale``, ``translation``, ``units``, ``name``. The result is
    read back before returning, so a bad value raises here, not when the file is opened.
    """
    doc: dict[str, Any] = {"shape": [int(n) for n in shape], "dtype": np.dtype(dtype).str,
                           "offset": int(offset), "order": order}
    for k, v in attrs.items():
        doc[k] = v if isinstance(v, str) else list(v)
    where = os.fspath(path) + SUFFIX
    with open(where, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    read_sidecar(path)
    return where
