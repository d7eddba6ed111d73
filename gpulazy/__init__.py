"""gpulazy: huge on-disk arrays as lazy Dask arrays whose chunks read straight into GPU memory.

``import gpulazy`` imports NumPy and Dask only; CuPy, KvikIO, torch, JAX, ipywidgets,
napari and format libraries are imported where they are used.

>>> import gpulazy, numpy as np, tempfile, os
>>> d = tempfile.mkdtemp(); np.arange(12, dtype="uint16").tofile(os.path.join(d, "a.raw"))
>>> vol = gpulazy.from_files(os.path.join(d, "a.raw"), shape=(3, 4), dtype="uint16", device="cpu")
>>> int(vol.sum().compute())
66
"""

from __future__ import annotations

import importlib
from typing import Any

from gpulazy import config, errors
from gpulazy.array import from_files, multiscale, read_file, read_files
from gpulazy.cache import DeviceCache
from gpulazy.convert import on, to_cupy, to_jax, to_numpy, to_torch
from gpulazy.device import get_device

# ``gpulazy.stats`` and ``gpulazy.prefetch`` are callables named like their modules:
# importing them here, eagerly, binds the package attribute to the callable for good.
from gpulazy.prefetch import Prefetcher, prefetch
from gpulazy.stats import stats

from gpulazy._version import __version__

__all__ = [
    "from_files",
    "multiscale",
    "read_file",
    "read_files",
    "DeviceCache",
    "prefetch",
    "Prefetcher",
    "stats",
    "config",
    "errors",
    "get_device",
    "to_torch",
    "to_jax",
    "to_numpy",
    "to_cupy",
    "on",
    "release",
    "cluster",
    "widgets",
    "__version__",
]

_LAZY_SUBMODULES = {"widgets", "cli", "testing", "io", "layouts"}


_LAZY_FUNCTIONS = {"release": "gpulazy.memory", "cluster": "gpulazy._cluster"}


def __getattr__(name: str) -> Any:
    # Heavy or optional submodules load on first use: ``gpulazy.widgets.Dashboard()``.
    if name in _LAZY_FUNCTIONS:
        return getattr(importlib.import_module(_LAZY_FUNCTIONS[name]), name)
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"gpulazy.{name}")
    raise AttributeError(f"module 'gpulazy' has no attribute {name!r}")
