"""``gpulazy info PATH``: what a file holds and where its chunks decode (CPU)."""

from __future__ import annotations

import json

import numpy as np

from gpulazy.cli import describe_index, main
from gpulazy.layouts import Index
from gpulazy.spec import ByteRange, ChunkSpec, Codec, Tile


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
