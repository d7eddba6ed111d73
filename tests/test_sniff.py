"""Unsupported formats are named, with what reads them; Zarr stores by the store; mixed folders by group."""

from __future__ import annotations

import gzip
import os
import zipfile

import numpy as np
import pytest

import gpulazy
from gpulazy import layouts
from gpulazy.errors import LayoutError
from gpulazy.layouts._sniff import describe, mixed_kinds, sniff, zarr_store_of


def _write(path, head: bytes, size: int = 2048) -> str:
    path.write_bytes(head + bytes(max(0, size - len(head))))
    return str(path)


def _at(offset: int, magic: bytes) -> bytes:
    return bytes(offset) + magic


MAGICS = {
    "PNG image": (b"\x89PNG\r\n\x1a\n", "imageio"),
    "JPEG image": (b"\xff\xd8\xff\xe0", "imageio"),
    "GIF image": (b"GIF89a", "imageio"),
    "BMP image": (b"BM\x36\x00\x0c\x00\x00\x00\x00\x00\x36\x00", "imageio"),
    "NetCDF classic file": (b"CDF\x01", "xarray"),
    "FITS file": (b"SIMPLE  =                    T", "astropy"),
    "NRRD file": (b"NRRD0004\n", "pynrrd"),
    "MRC file (electron microscopy)": (_at(208, b"MAP "), "mrcfile"),
    "DICOM file": (_at(128, b"DICM"), "pydicom"),
    "NIfTI-1 image": (_at(344, b"n+1\0"), "nibabel"),
    "zstd-compressed file": (b"\x28\xb5\x2f\xfd", "zstd -d"),
}


@pytest.mark.parametrize("name", sorted(MAGICS))
def test_magic_table_names_the_format_and_its_reader(tmp_path, name):
    head, reader = MAGICS[name]
    p = _write(tmp_path / "data.bin", head)
    assert sniff(p).name == name
    with pytest.raises(LayoutError) as info:
        gpulazy.from_files(p, device="cpu")
    message = str(info.value)
    assert p in message and name in message and reader in message
    assert "offset=" not in message  # no raw-binary hint for a file whose format is known


def test_real_files_of_other_libraries(tmp_path):
    p = tmp_path / "a.gz"
    with gzip.open(p, "wb") as f:
        f.write(b"x" * 100)
    assert sniff(str(p)).name == "gzip-compressed file"
    z = tmp_path / "a.npz"
    np.savez(z, a=np.zeros(3))
    assert sniff(str(z)).name.startswith("zip archive")
    with zipfile.ZipFile(tmp_path / "b.zip", "w") as f:
        f.writestr("x", "y")
    assert "numpy.load" in describe(str(tmp_path / "b.zip"), ["npy"])
    (tmp_path / "t.csv").write_text("1,2,3\n4,5,6\n")
    assert sniff(str(tmp_path / "t.csv")).name == "text file"


@pytest.mark.parametrize("writer, name, layout, reader", [
    ("tiff", "TIFF file", "tiff", "tifffile"),
    ("hdf5", "HDF5 file (or NetCDF-4)", "hdf5", "h5py"),
])
def test_formats_a_layout_is_planned_for(tmp_path, writer, name, layout, reader):
    p = str(tmp_path / "f")
    if writer == "tiff":
        import tifffile

        tifffile.imwrite(p, np.zeros((4, 4), "u2"))
    else:
        import h5py

        with h5py.File(p, "w") as f:
            f["x"] = np.zeros(3)
    assert sniff(p).name == name
    without = describe(p, ["npy"])
    assert f"looks like a{'n' if name[0] in 'AEIOUH' else ''} {name}" in without
    assert "does not read yet" in without and reader in without and "offset=" not in without
    assert f"layout={layout!r}" in describe(p, ["npy", layout])


@pytest.fixture(params=[2, 3])
def zarr_store(request, tmp_path):
    zarr = pytest.importorskip("zarr")
    path = str(tmp_path / "data.zarr")
    z = zarr.create_array(path, shape=(4, 4), chunks=(2, 2), dtype="u2", zarr_format=request.param)
    z[:] = 1
    return path, request.param


def test_zarr_store_is_named_as_the_store(zarr_store):
    path, version = zarr_store
    meta = os.path.join(path, "zarr.json" if version == 3 else ".zarray")
    chunk = os.path.join(path, "c", "0", "0") if version == 3 else os.path.join(path, "0.0")
    for inside in (meta, chunk):
        store = zarr_store_of(inside)
        assert store.path == os.path.abspath(path) and store.name == f"Zarr v{version} store"
        message = describe(inside, ["npy"])
        assert f"part of the Zarr v{version} store {os.path.abspath(path)!r}" in message
        assert "dask.array.from_zarr" in message
    assert "pass the store folder" in describe(meta, ["npy", "zarr"])
    if "zarr" in layouts.layout_names():
        pytest.skip("a zarr layout is registered: the store is read, not reported")
    with pytest.raises(LayoutError) as info:
        gpulazy.from_files(path, device="cpu")
    assert str(info.value).startswith(f"cannot read {path!r}: it is a Zarr v{version} store, which gpulazy "
                                      "does not read yet")
    with pytest.raises(LayoutError, match=f"part of the Zarr v{version} store"):
        gpulazy.from_files(meta, device="cpu")


def test_mixed_folder_names_the_groups_and_suggests_a_glob(tmp_path):
    for i in range(5):
        np.zeros(4, "u2").tofile(tmp_path / f"s{i}.raw")
    (tmp_path / "notes.txt").write_text("acquired on Monday")
    np.save(tmp_path / "mask.npy", np.zeros(3))
    for arg in (str(tmp_path), str(tmp_path / "*")):
        with pytest.raises(LayoutError) as info:
            gpulazy.from_files(arg, dtype="u2", device="cpu")
        message = str(info.value)
        assert "not all of one kind" in message
        assert "5 .raw files" in message and "1 text file (notes.txt)" in message
        assert "1 NumPy .npy file (mask.npy)" in message
        assert repr(str(tmp_path / "*.raw")) in message
    vol = gpulazy.from_files(str(tmp_path / "*.raw"), dtype="u2", device="cpu")  # the suggested glob works
    assert vol.shape == (5, 4)


def test_one_kind_is_not_mixed(tmp_path):
    names = [f"img.{i:03d}" for i in range(3)] + ["a.tif", "b.TIF"]
    for n in names:
        (tmp_path / n).write_bytes(bytes(8))
    assert mixed_kinds([str(tmp_path / n) for n in names[:3]]) is None  # numbered extensions
    assert mixed_kinds([str(tmp_path / "a.tif"), str(tmp_path / "b.TIF")]) is None
    assert gpulazy.from_files(str(tmp_path / "img.*"), dtype="u1", device="cpu").shape == (3, 8)


def test_unknown_bytes_keep_the_raw_hint(tmp_path):
    p = _write(tmp_path / "x.raw", b"\x01\x02\x03\x04", size=64)
    with pytest.raises(LayoutError, match="pass dtype=.*offset="):
        gpulazy.from_files(p, device="cpu")


def test_raw_size_error_names_a_known_format_instead_of_an_offset_hint(tmp_path):
    import tifffile

    p = str(tmp_path / "a.tif")
    tifffile.imwrite(p, np.zeros((64, 64), "u2"))
    with pytest.raises(LayoutError) as info:
        gpulazy.from_files(p, dtype="u2", shape=(64, 64), device="cpu", layout="raw")  # raw, on purpose
    message = str(info.value)
    assert "it looks like a TIFF file" in message and "pass offset=" not in message
    q = _write(tmp_path / "plain.raw", b"\x01\x02", size=8192 + 100)  # unknown bytes keep the hint
    with pytest.raises(LayoutError, match="pass offset=100"):
        gpulazy.from_files(q, dtype="u2", shape=(64, 64), device="cpu")
