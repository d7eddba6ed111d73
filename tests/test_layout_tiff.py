"""The TIFF layout against tifffile's own reading, on random data (CPU path)."""

from __future__ import annotations

import os

import numpy as np
import pytest

tifffile = pytest.importorskip("tifffile")

import gpulazy  # noqa: E402
from gpulazy import layouts  # noqa: E402
from gpulazy.errors import LayoutError  # noqa: E402
from gpulazy.testing import LayoutConformance  # noqa: E402


def _write(path, array: np.ndarray, **kw) -> str:
    """``array`` as a TIFF in its own byte order (big-endian arrays make a big-endian file)."""
    if array.dtype.byteorder == ">":
        kw.setdefault("byteorder", ">")
    tifffile.imwrite(path, array, photometric="minisblack", **kw)
    return str(path)


class TestTiffConformance(LayoutConformance):
    __test__ = True
    layout_name = "tiff"

    def make(self, tmp_path, array, **kw):
        # Several strips per page, so chunking meets stored boundaries inside a page too.
        return _write(tmp_path / "data.tif", array, rowsperstrip=kw.pop("rowsperstrip", 3), **kw)

    def reference(self, path):
        return tifffile.imread(path)


class TestCompressedTiffConformance(TestTiffConformance):
    def make(self, tmp_path, array, **kw):
        return _write(tmp_path / "data.tif", array, compression="zlib", tile=(16, 16), **kw)
