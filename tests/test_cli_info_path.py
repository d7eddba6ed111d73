"""``gpulazy info PATH``: what a file holds and where its chunks decode (CPU)."""

from __future__ import annotations

import json

import numpy as np

from gpulazy.cli import describe_index, main
from gpulazy.layouts import Index
from gpulazy.spec import ByteRange, ChunkSpec, Codec, Tile
from test_readme import _ome_tiff, _ome_zarr


def test_info_path_describes_an_npy_file(tmp_path, capsys):
    p = str(tmp_path / "a.npy")
    np.save(p, np.zeros((6, 5), ">i2"))
    assert main(["info", p, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert p in out and "layout: npy" in out and "shape: (6, 5)" in out and "dtype: int16" in out
    assert "codec: none; stored as is" in out


def test_info_path_json(tmp_path, capsys):
    p = str(tmp_path / "a.npy")
    np.save(p, np.zeros((3, 2), "f4"))
    assert main(["info", p, "--json", "--device", "cpu"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layout"] == "npy" and d["shape"] == [3, 2] and d["dtype"] == "float32"
    assert d["codec"] == "none" and d["decodes_on"] == "none" and d["stored_chunks"] == 1


def test_describe_a_compressed_index_with_missing_chunks():
    r = ByteRange("store/c", 0, 10)
    tiles = (Tile(r, (2, 2), (0, 0)), Tile(None, (2, 2), (2, 0)))
    spec = ChunkSpec((r,), (4, 2), "<u2", codec=(Codec.of("zstd", level=1),), tiles=tiles, index=(0, 0))
    idx = Index((4, 2), np.dtype("u2"), ((4,), (2,)), {(0, 0): spec}, layout="zarr", paths=("store",),
                attrs={"stored_chunks": (2, 2)})
    d = describe_index(idx, "cpu")
    assert d["codec"] == "zstd" and d["decodes_on"] == "host" and d["stored_chunks"] == 1
    assert d["missing_chunks"] == 1 and d["chunks"] == [4, 2] and d["layout"] == "zarr"
    from gpulazy.cli import format_description

    text = format_description(d)
    assert "1 missing (read as the fill value)" in text and "codec: zstd; decodes on the host" in text


def test_info_path_that_no_layout_reads_fails_naming_it(tmp_path, capsys):
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    assert main(["info", str(p)]) == 2
    assert "notes.txt" in capsys.readouterr().err


# -- stored chunks are counted from the format's grid, not from the dask chunks -------------
def test_info_counts_every_page_of_an_uncompressed_multipage_tiff(tmp_path, capsys):
    import tifffile

    p = str(tmp_path / "pages.tif")
    tifffile.imwrite(p, np.zeros((256, 16, 16), "uint8"))
    assert main(["info", p, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    # Before, the 256 pages read as one plain run showed as "1 stored chunks".
    assert "256 stored chunks of (1, 16, 16)" in out and "(1 dask chunk)" in out


def test_info_counts_every_file_of_a_tiff_folder(tmp_path, capsys):
    import tifffile

    (tmp_path / "s").mkdir()
    for i in range(40):
        tifffile.imwrite(tmp_path / "s" / f"z{i:02}.tif", np.full((30, 40), i, "uint16"))
    assert main(["info", str(tmp_path / "s"), "--json", "--device", "cpu"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["shape"] == [40, 30, 40] and d["stored_chunks"] == 40 and d["stored_chunk_shape"] == [1, 30, 40]
    assert d["dask_chunks"] == 1 and d["missing_chunks"] == 0


def test_info_counts_a_stacked_hdf5_grid_with_the_stack_axis(tmp_path):
    import h5py

    from gpulazy import layouts
    from gpulazy.cli import stored_count

    for i in range(3):
        with h5py.File(tmp_path / f"r{i}.h5", "w") as f:
            f.create_dataset("d", data=np.zeros((4, 10, 10), "f4"), chunks=(2, 5, 10))
    idx = layouts.index(str(tmp_path / "r*.h5"), dataset="/d")
    assert idx.shape == (3, 4, 10, 10) and stored_count(idx) == 3 * 2 * 2


# -- OME and pyramid metadata (the README's example files) -------------------------------------
def test_info_shows_ome_zarr_axes_scale_and_levels(tmp_path, capsys):
    p = str(tmp_path / "img.ome.zarr")
    _ome_zarr(p)
    assert main(["info", p, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "axes: z, y, x  scale: (2.0, 0.5, 0.5) (micrometer)" in out
    assert "8 stored chunks of (2, 32, 32)" in out
    assert "levels: 0: (4, 64, 64)" in out and "1: (4, 32, 32)  chunks (4, 32, 32)  scale (2.0, 1.0, 1.0)" in out
    assert main(["info", p, "--json", "--device", "cpu"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["axes"] == ["z", "y", "x"] and d["scale"] == [2.0, 0.5, 0.5]
    assert d["units"] == ["micrometer"] * 3
    assert [lv["shape"] for lv in d["levels"]] == [[4, 64, 64], [4, 32, 32]]
    assert d["levels"][1]["scale"] == [2.0, 1.0, 1.0]


def test_info_shows_an_ome_tiff_pyramid(tmp_path, capsys):
    p = str(tmp_path / "slide.ome.tif")
    _ome_tiff(p)  # (4, 128, 128) uint16, z 2.0 and y/x 0.5 per pixel, a second level at half size
    assert main(["info", p, "--json", "--device", "cpu"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["axes"] == ["z", "y", "x"] and d["scale"] == [2.0, 0.5, 0.5] and d["stored_chunks"] == 4
    assert [(lv["shape"], lv["scale"]) for lv in d["levels"]] == [([4, 128, 128], [2.0, 0.5, 0.5]),
                                                                   ([4, 64, 64], [2.0, 1.0, 1.0])]


def test_info_of_a_plain_file_has_no_axes_or_levels(tmp_path, capsys):
    p = str(tmp_path / "a.npy")
    np.save(p, np.zeros((2, 3), "u1"))
    assert main(["info", p, "--json", "--device", "cpu"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "levels" not in d and "axes" not in d and "scale" not in d
    assert main(["info", p, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "stored contiguously, 1 file" in out and "axes" not in out and "levels" not in out
