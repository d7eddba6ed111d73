"""Every consumer of the read path (``gpulazy.testing.CONSUMERS``) over every format below.

A format writes a hypothesis-drawn array with a drawn stored chunking and codec options,
and reads it back with its own reader (NumPy, tifffile, zarr-python, h5py): that reading is
what every consumer must give. The writers are the layout tests' own helpers.

Run: ``pytest tests/test_conformance.py`` (``GPULAZY_CONFORMANCE_N=20`` for more examples).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import strategies as st

from gpulazy.testing import ConsumerConformance, Dataset, Format

HEADER = 24  # bytes of junk before a raw file's elements (read with offset=)

# ``chunks=`` is drawn apart from the stored chunking: enlarging it to whole stored chunks is expected.
pytestmark = pytest.mark.filterwarnings("ignore::gpulazy.errors.ChunksEnlargedWarning")


# -- raw and .npy -------------------------------------------------------------------------------

def _raw(folder, array, chunks, draw):
    """One raw file after a header, C order."""
    path = os.path.join(folder, "a.raw")
    with open(path, "wb") as fh:
        fh.write(b"\xee" * HEADER + array.tobytes())
    raw = {"files": [path], "dtype": array.dtype.str, "shape": array.shape, "offset": HEADER, "order": "C"}
    ref = np.fromfile(path, array.dtype, offset=HEADER).reshape(array.shape)
    return Dataset(folder, path, ref, {"shape": array.shape, "dtype": array.dtype.str, "offset": HEADER}, raw)


def _raw_fortran(folder, array, chunks, draw):
    """One raw file in Fortran element order."""
    path = os.path.join(folder, "a.raw")
    array.T.tofile(path)  # the transpose's C order is the array's F order
    raw = {"files": [path], "dtype": array.dtype.str, "shape": array.shape[::-1], "offset": 0, "order": "F"}
    ref = np.fromfile(path, array.dtype).reshape(array.shape, order="F")
    return Dataset(folder, path, ref, {"shape": array.shape, "dtype": array.dtype.str, "order": "F"}, raw)


def _raw_folder(folder, array, chunks, draw):
    """A folder of big-endian raw files, one plane each, stacked along axis 0."""
    files = [os.path.join(folder, f"z{i}.raw") for i in range(array.shape[0])]
    for path, plane in zip(files, array):
        plane.tofile(path)
    raw = {"files": files, "dtype": array.dtype.str, "shape": array.shape[1:], "offset": 0, "order": "C"}
    ref = np.stack([np.fromfile(p, array.dtype).reshape(array.shape[1:]) for p in files])
    return Dataset(folder, folder, ref, {"shape": array.shape[1:], "dtype": array.dtype.str}, raw)


def _npy(folder, array, chunks, draw):
    path = os.path.join(folder, "a.npy")
    np.save(path, array)
    offset = os.path.getsize(path) - array.nbytes
    raw = {"files": [path], "dtype": array.dtype.str, "shape": array.shape, "offset": offset, "order": "C"}
    return Dataset(folder, path, np.load(path), {}, raw)


# -- TIFF -------------------------------------------------------------------------------------

def _tiff_pages(folder, array, chunks, draw):
    """One multi-page TIFF, uncompressed strips of the drawn rows."""
    import tifffile
    from test_layout_tiff import _write

    path = _write(os.path.join(folder, "a.tif"), array, rowsperstrip=chunks[-2])
    return Dataset(folder, path, tifffile.imread(path))


def _tiff_tiled(folder, array, chunks, draw):
    """Tiles of 16 or 32 pixels a side, deflate with or without the horizontal predictor."""
    import tifffile
    from test_layout_tiff import _write

    tile = tuple(16 * draw(st.integers(1, 2), label="tile") for _ in range(2))
    path = os.path.join(folder, "a.tif")
    _write(path, array, tile=tile, compression="zlib", predictor=draw(st.booleans(), label="predictor"))
    return Dataset(folder, path, tifffile.imread(path))


def _tiff_folder(folder, array, chunks, draw):
    """A folder of single-page TIFFs, one per plane."""
    import tifffile
    from test_layout_tiff import _write

    files = [_write(os.path.join(folder, f"p{i}.tif"), plane, rowsperstrip=chunks[-2])
             for i, plane in enumerate(array)]
    return Dataset(folder, folder, np.stack([tifffile.imread(p) for p in files]))


# -- Zarr -------------------------------------------------------------------------------------

def _zarr(folder, array, chunks, fmt, **kw):
    import zarr
    from test_layout_zarr import _make

    path = _make(os.path.join(folder, "a.zarr"), array, chunks=chunks, zarr_format=fmt, **kw)
    return Dataset(folder, path, zarr.open_array(path, mode="r")[...])


def _zarr3(folder, array, chunks, draw):
    from zarr.codecs import Crc32cCodec, ZstdCodec

    compressors = draw(st.sampled_from(["none", "zstd", "crc32c", "zstd+crc32c"]), label="codecs")
    chain = {"none": None, "zstd": ZstdCodec(level=draw(st.integers(1, 5))), "crc32c": Crc32cCodec(),
             "zstd+crc32c": [ZstdCodec(), Crc32cCodec()]}[compressors]
    return _zarr(folder, array, chunks, 3, compressors=chain)


def _zarr3_sharded(folder, array, chunks, draw):
    from zarr.codecs import ZstdCodec

    inner = tuple(max(1, c // 2) for c in chunks)  # shards are whole numbers of inner chunks
    compressed = draw(st.booleans(), label="zstd")
    return _zarr(folder, array, inner, 3, shards=tuple(2 * c for c in inner),
                 compressors=ZstdCodec() if compressed else None)


def _zarr2(folder, array, chunks, draw):
    import numcodecs

    codec = draw(st.sampled_from(["blosc-lz4-shuffle", "zlib"]), label="codec")
    compressor = (numcodecs.Blosc(cname="lz4", shuffle=numcodecs.Blosc.SHUFFLE) if codec.startswith("blosc")
                  else numcodecs.Zlib(level=draw(st.integers(1, 9))))
    order = draw(st.sampled_from("CF"), label="order")
    return _zarr(folder, array, chunks, 2, compressors=compressor, order=order)


# -- HDF5 -------------------------------------------------------------------------------------

def _hdf5(folder, array, chunks, draw):
    from test_layout_hdf5 import _reference, _write

    filters = draw(st.sampled_from([{}, {"compression": "gzip"}, {"compression": "gzip", "shuffle": True}]),
                   label="filters")
    path = _write(os.path.join(folder, "a.h5"), data=array, chunks=chunks, **filters)
    return Dataset(folder, path, _reference(path), {"dataset": "data"})


FORMATS = {
    "raw": Format(_raw, dtypes=("uint8", "<u2", ">u2", "int16", "float32", "<i4"), raw=True),
    "raw-F": Format(_raw_fortran, raw=True),
    "raw-folder-BE": Format(_raw_folder, dtypes=(">u2", ">i4", ">f4"), raw=True),
    "npy": Format(_npy, raw=True),
    "tiff": Format(_tiff_pages, ndims=(3, 3)),
    "tiff-tiled": Format(_tiff_tiled, dtypes=("uint8", "<u2", "float32"), min_side=17, max_side=40),
    "tiff-folder": Format(_tiff_folder, ndims=(3, 3)),
    "zarr3": Format(_zarr3),
    "zarr3-sharded": Format(_zarr3_sharded),
    "zarr2": Format(_zarr2),
    "hdf5": Format(_hdf5),
}


@pytest.fixture(scope="module", autouse=True)
def _formats_present():
    for module in ("tifffile", "imagecodecs", "zarr", "numcodecs", "h5py", "xxhash"):
        pytest.importorskip(module)


class TestConsumers(ConsumerConformance):
    __test__ = True
    formats = FORMATS


@pytest.mark.gpu
class TestConsumersGpu(TestConsumers):
    device = "cuda:0"


# -- bugs the suite found, each as its smallest case ------------------------------------------

@pytest.mark.parametrize("fmt", ["tiff", "hdf5"])
def test_a_folder_of_one_file_stacks_like_raw_and_npy(tmp_path, fmt):
    import gpulazy

    plane = np.arange(60, dtype="<u2").reshape(12, 5)
    if fmt == "tiff":
        from test_layout_tiff import _write

        _write(tmp_path / "p0.tif", plane)
    else:
        from test_layout_hdf5 import _write

        _write(tmp_path / "a.h5", data=plane)
    vol = gpulazy.from_files(str(tmp_path), device="cpu", cache=False)
    np.testing.assert_array_equal(vol.compute(), plane[None])
