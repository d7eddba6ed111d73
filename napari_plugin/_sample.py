"""Sample data: a generated volume large enough to watch prefetch work, with no files of your own.

The volume (``SAMPLE_SHAPE`` uint16, 512 MiB: soft blobs drifting through the stack, so
stepping through planes shows change) is written once, as raw bytes with a sidecar
(``volume.raw`` + ``volume.raw.json``), to ``<tempdir>/gpulazy-sample`` and reused.
Chunks of 8 planes (16 MiB) give the prefetcher 32 chunks to warm ahead of the slider.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

__all__ = ["make_sample_data", "write_sample_volume", "SAMPLE_SHAPE"]

SAMPLE_SHAPE = (256, 1024, 1024)
SAMPLE_CHUNK_PLANES = 8


def write_sample_volume(folder: str | None = None, shape: tuple[int, int, int] = SAMPLE_SHAPE) -> str:
    """Write the sample volume (if it is not there yet) and return the raw file's path."""
    from gpulazy.layouts.raw import write_sidecar

    folder = folder or os.path.join(tempfile.gettempdir(), "gpulazy-sample")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "volume.raw")
    nbytes = int(np.prod(shape)) * 2
    if os.path.exists(path) and os.path.getsize(path) == nbytes and os.path.exists(path + ".json"):
        return path
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        for z in range(shape[0]):
            _plane(z, shape).tofile(f)  # one plane at a time: never the whole volume in memory
    os.replace(tmp, path)
    write_sidecar(path, shape=shape, dtype="uint16", axes=("z", "y", "x"), scale=(1.0, 1.0, 1.0),
                  name="gpulazy sample")
    return path


def _plane(z: int, shape: tuple[int, int, int]) -> np.ndarray:
    n, h, w = shape
    y = np.linspace(-1, 1, h, dtype=np.float32)[:, None]
    x = np.linspace(-1, 1, w, dtype=np.float32)[None, :]
    phase = 2 * np.pi * z / max(n, 1)
    out = np.zeros((h, w), np.float32)
    for k in range(5):  # blobs circling at different radii and speeds
        cy, cx = 0.6 * np.sin(phase * (k + 1) + k), 0.6 * np.cos(phase * (k + 1) + 2 * k)
        out += np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (0.02 + 0.01 * k))
    out += 0.15 * (1 + np.sin(12 * np.hypot(y, x) - phase * 4))  # rings, so each plane differs
    return (out * 20000 / out.max()).astype(np.uint16)


def make_sample_data(**kwargs: Any) -> list[tuple]:
    """npe2 sample-data command: the generated volume as a lazy gpulazy image layer."""
    from napari_gpulazy._reader import read_layers

    path = write_sample_volume()
    shape = SAMPLE_SHAPE
    kwargs.setdefault("chunks", (SAMPLE_CHUNK_PLANES, shape[1], shape[2]))
    layers = read_layers(path, **kwargs)
    for _, meta, _ in layers:
        meta["name"] = "gpulazy sample"
        meta["contrast_limits"] = (0, 20000)  # known: napari need not read planes to guess them
    return layers
