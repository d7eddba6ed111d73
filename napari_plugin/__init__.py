"""napari plugin for gpulazy: open huge volumes lazily through the GPU cache.

- **Reader** (``napari_get_reader``): everything ``gpulazy.from_files`` opens (``.npy``,
  raw with a ``<file>.json`` sidecar, TIFF, Zarr/OME-Zarr, HDF5 as their layouts are
  registered), as lazy image layers; stored pyramids as multiscale layers.
- **Display path** (``HostView``): only the plane napari shows is copied to the host; its
  chunk stays in the device cache.
- **Motion-aware prefetch** (``attach(viewer)``, done by the reader for the current
  viewer): the next planes' chunks are warmed as the sliders move.
- **Sample data** and a **dock widget** (the widget is the only module importing Qt).

``import napari_gpulazy`` imports neither napari nor Qt.

>>> import napari, napari_gpulazy                                   # doctest: +SKIP
>>> viewer = napari.Viewer()                                        # doctest: +SKIP
>>> viewer.open("scan.npy", plugin="gpulazy")                       # doctest: +SKIP
"""

from __future__ import annotations

from napari_gpulazy._hook import attach, detach
from napari_gpulazy._reader import napari_get_reader, read_layers
from napari_gpulazy._view import HostView, pyramid

__all__ = ["napari_get_reader", "read_layers", "attach", "detach", "HostView", "pyramid"]
