"""The TIFF layout against tifffile's own reading, on random data (CPU path)."""

from __future__ import annotations

import contextlib
import re
import signal
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tifffile = pytest.importorskip("tifffile")

import gpulazy  # noqa: E402
from gpulazy import layouts  # noqa: E402
from gpulazy.errors import GpulazyError, LayoutError  # noqa: E402
from gpulazy.testing import LayoutConformance  # noqa: E402
from conftest import to_host  # noqa: E402


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


# -- helpers ------------------------------------------------------------------------------------

def _random(shape, dtype, seed=0) -> np.ndarray:
    return LayoutConformance.random_array(tuple(shape), dtype, seed)


def _open(path, **kw):
    return gpulazy.from_files(path, device="cpu", cache=False, **kw)


def _check(path, **kw) -> object:
    """gpulazy's reading of ``path`` (fast path and dask path) equals tifffile's; returns the array."""
    ref = tifffile.imread(path)
    arr = _open(path, **kw)
    assert arr.shape == ref.shape and arr.dtype == ref.dtype.newbyteorder("=")
    np.testing.assert_array_equal(arr.compute(), ref)
    np.testing.assert_array_equal(arr[...].compute(scheduler="sync"), ref)
    return arr


def _specs(arr):
    return list(arr.chunk_index.specs.values())


# -- files tifffile writes, each read back equal --------------------------------------------------

CASES = {
    "2d-uint8": (lambda: _random((37, 21), "uint8"), {}),
    "pages-uint16": (lambda: _random((5, 30, 20), "uint16"), {}),
    "pages-int16-strips": (lambda: _random((4, 30, 20), "int16"), {"rowsperstrip": 7}),
    "float32-tiles": (lambda: _random((3, 40, 50), "float32"), {"tile": (16, 32)}),
    "bigtiff": (lambda: _random((3, 20, 10), "uint16"), {"bigtiff": True, "rowsperstrip": 4}),
    "big-endian": (lambda: _random((3, 20, 10), ">u2"), {"byteorder": ">", "rowsperstrip": 6}),
    "big-endian-float-zlib": (lambda: _random((2, 20, 10), ">f4"), {"byteorder": ">", "compression": "zlib"}),
    "rgb-contig": (lambda: _random((3, 30, 20, 3), "uint8"), {"photometric": "rgb", "rowsperstrip": 5}),
    "rgb-separate": (lambda: _random((2, 3, 30, 20), "uint8"), {"photometric": "rgb", "planarconfig": "separate",
                                                                 "rowsperstrip": 8}),
    "rgb-tiles-zlib": (lambda: _random((2, 40, 40, 3), "uint16"), {"photometric": "rgb", "tile": (16, 16),
                                                                    "compression": "zlib"}),
    "volume-tiles": (lambda: _random((2, 6, 40, 50), "uint8"), {"volumetric": True, "tile": (2, 16, 16),
                                                                 "compression": "zlib"}),
    "imagej-tzcyx": (lambda: _random((2, 3, 4, 20, 10), "uint16"), {"imagej": True}),
    "imagej-truncated": (lambda: _random((4, 20, 10), "uint16"), {"imagej": True, "truncate": True}),
    "ome-czyx": (lambda: _random((2, 3, 20, 10), "uint16"), {"ome": True, "metadata": {"axes": "CZYX"}}),
    "scattered-ifds": (lambda: _random((3, 20, 10), "uint16"), {"contiguous": False, "rowsperstrip": 3}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reads_like_tifffile(tmp_path, case):
    make, kw = CASES[case]
    path = str(tmp_path / "a.tif")
    tifffile.imwrite(path, make(), **kw)
    arr = _check(path)
    with tifffile.TiffFile(path) as tif:
        assert arr.attrs["axes"] == tuple(tif.series[0].axes.lower())
    for chunks in (1, {0: 1, -1: 7}):
        _check(path, chunks=chunks)


def test_ome_axes_and_physical_sizes(tmp_path):
    path = str(tmp_path / "a.ome.tif")
    meta = {"axes": "TZYX", "PhysicalSizeX": 0.25, "PhysicalSizeY": 0.5, "PhysicalSizeZ": 2.0,
            "PhysicalSizeZUnit": "nm"}
    tifffile.imwrite(path, _random((2, 3, 20, 10), "uint16"), ome=True, metadata=meta)
    arr = _check(path)
    assert arr.attrs["axes"] == ("t", "z", "y", "x")
    assert arr.attrs["scale"] == (1.0, 2.0, 0.5, 0.25)
    assert arr.attrs["units"][1:] == ("nm", "µm", "µm")


def test_imagej_spacing_and_resolution(tmp_path):
    path = str(tmp_path / "a.tif")
    tifffile.imwrite(path, _random((3, 20, 10), "uint16"), imagej=True, resolution=(2.0, 4.0),
                     metadata={"spacing": 3.5, "unit": "um", "axes": "ZYX"})
    arr = _check(path)
    assert arr.attrs["axes"] == ("z", "y", "x")
    assert arr.attrs["scale"] == (3.5, 0.25, 0.5)
    assert arr.attrs["units"] == ("um", "um", "um")


# -- hypothesis: shapes, strips/tiles, compression, chunkings ---------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_storage_and_chunking_reads_like_tifffile(tmp_path, data):
    pages = data.draw(st.integers(1, 4), "pages")
    rows, cols = data.draw(st.integers(1, 40), "rows"), data.draw(st.integers(1, 40), "cols")
    dtype = data.draw(st.sampled_from(["uint8", "<u2", ">u2", "int16", "float32"]), "dtype")
    kw: dict = {"photometric": "minisblack"}
    if data.draw(st.booleans(), "tiled"):
        kw["tile"] = (data.draw(st.sampled_from([16, 32]), "tile_y"), data.draw(st.sampled_from([16, 32]), "tile_x"))
    else:
        kw["rowsperstrip"] = data.draw(st.integers(1, rows), "rowsperstrip")
    kw["compression"] = data.draw(st.sampled_from([None, "zlib", "zstd"]), "compression")
    if dtype.startswith(">"):
        kw["byteorder"] = ">"
    array = _random((pages, rows, cols), dtype, data.draw(st.integers(0, 99), "seed"))
    path = str(tmp_path / f"h{abs(hash((tuple(kw.items()), array.shape, dtype)))}.tif")
    tifffile.imwrite(path, array, **kw)
    chunks = tuple(data.draw(st.integers(1, n), f"chunk{i}") for i, n in enumerate(array.shape))
    arr = _check(path, chunks=chunks)
    stored = arr.chunk_index.attrs["stored_chunks"]
    for sizes, s in zip(arr.chunks, stored):
        assert all(e % s == 0 for e in np.cumsum(sizes)[:-1])  # whole strips/tiles, whole pages
    assert all(-(-c // s) * s >= c for c, s in zip(chunks, stored))


# -- compression --------------------------------------------------------------------------------

@pytest.mark.parametrize("compression, predictor, dtype, codec_ids", [
    ("zlib", None, "uint16", ["zlib"]),
    ("adobe_deflate", None, "int16", ["zlib"]),
    ("zstd", None, "float32", ["zstd"]),
    ("lzw", None, "uint16", ["imagecodecs_lzw"]),
    ("packbits", None, "uint8", ["imagecodecs_packbits"]),
    ("lzma", None, "uint8", ["imagecodecs_lzma"]),
    ("zlib", True, "uint16", ["zlib", "tiff_predictor"]),      # horizontal differencing (2)
    ("zstd", True, "float32", ["zstd", "tiff_predictor"]),     # floating point (3)
    ("lzw", True, ">u2", ["imagecodecs_lzw", "tiff_predictor"]),
    ("zlib", True, ">f4", ["zlib", "tiff_predictor"]),
])
@pytest.mark.parametrize("pieces", [{"rowsperstrip": 7}, {"tile": (16, 16)}], ids=["strips", "tiles"])
def test_compressed_round_trip(tmp_path, compression, predictor, dtype, codec_ids, pieces):
    pytest.importorskip("imagecodecs")
    path = str(tmp_path / "c.tif")
    array = _random((3, 33, 21), dtype, 7)
    if np.dtype(dtype).kind != "f":  # smooth data, so predictors matter
        array = (np.cumsum(array.astype("i8"), axis=-1) % 200).astype(dtype)
    tifffile.imwrite(path, array, compression=compression, predictor=predictor, photometric="minisblack",
                     byteorder=">" if dtype.startswith(">") else None, **pieces)
    arr = _check(path)
    np.testing.assert_array_equal(arr.compute(), array)
    for spec in _specs(arr):
        assert [c.id for c in spec.codec] == codec_ids and spec.tiles
    if predictor:
        pred = _specs(arr)[0].codec[-1]
        assert pred.get("kind") == (3 if np.dtype(dtype).kind == "f" else 2)


def test_rgb_predictor_and_jpeg(tmp_path):
    pytest.importorskip("imagecodecs")
    rgb = _random((2, 40, 48, 3), "uint8", 3)
    path = str(tmp_path / "p.tif")
    tifffile.imwrite(path, rgb, photometric="rgb", compression="zlib", predictor=True, rowsperstrip=9)
    np.testing.assert_array_equal(_check(path).compute(), rgb)
    for pieces in ({"tile": (16, 16)}, {"rowsperstrip": 16}):
        tifffile.imwrite(path, rgb, photometric="rgb", compression="jpeg", **pieces)
        arr = _check(path)  # lossy: equal to tifffile's own decoding, through the same decoder
        assert _specs(arr)[0].codec[0].id == "imagecodecs_jpeg"


@pytest.mark.parametrize("kw", [{}, {"compression": "zlib", "predictor": True, "tile": (16, 16)},
                                {"compression": "lzw", "rowsperstrip": 5}], ids=["plain", "zlib-pred-tiles", "lzw"])
def test_reads_on_each_device(tmp_path, device, kw):
    if kw.get("compression") == "lzw" or kw.get("predictor"):  # LZW and predictors decode with imagecodecs
        pytest.importorskip("imagecodecs")
    path = str(tmp_path / "d.tif")
    tifffile.imwrite(path, _random((4, 40, 30), "uint16"), photometric="minisblack", **kw)
    arr = gpulazy.from_files(path, device=device, cache=False, chunks=(3, 16, 30))
    ref = tifffile.imread(path)
    np.testing.assert_array_equal(to_host(arr.compute()), ref)
    np.testing.assert_array_equal(to_host(arr[1:, 5:].compute()), ref[1:, 5:])


def test_jpeg_ycbcr_subsampled(tmp_path):
    pytest.importorskip("imagecodecs")
    path = str(tmp_path / "ycbcr.tif")
    rgb = _random((40, 48, 3), "uint8", 4)
    tifffile.imwrite(path, rgb, photometric="ycbcr", compression="jpeg", subsampling=(2, 2), tile=(16, 16))
    _check(path)  # decoded to RGB by imagecodecs, as tifffile does


def test_second_ome_series(tmp_path):
    path = str(tmp_path / "two.ome.tif")
    first, second = _random((20, 10), "uint16", 1), _random((2, 20, 10), "uint8", 2)
    with tifffile.TiffWriter(path, ome=True) as tif:
        tif.write(first, photometric="minisblack")
        tif.write(second, photometric="minisblack", metadata={"axes": "CYX", "PhysicalSizeX": 3.0})
    np.testing.assert_array_equal(_open(path).compute(), first)
    arr = _open(path, series=1)
    np.testing.assert_array_equal(arr.compute(), second)
    assert arr.attrs["axes"] == ("c", "y", "x") and arr.attrs["scale"] == (1.0, 1.0, 3.0)


# -- the fast path: plain byte ranges -------------------------------------------------------------

def test_uncompressed_contiguous_file_is_plain_ranges(tmp_path):
    array = _random((12, 64, 48), "uint16")
    path = str(tmp_path / "stack.tif")
    tifffile.imwrite(path, array, rowsperstrip=5)
    arr = _open(path)
    page = 64 * 48 * 2
    for spec in _specs(arr):
        assert spec.tiles == () and spec.codec is None
        assert all(r.nbytes >= page for r in spec.ranges)  # one run per page or longer
        assert len(spec.ranges) <= spec.shape[0]
    # ImageJ writes pages back to back: the whole file is one run.
    tifffile.imwrite(path, array, imagej=True)
    (spec,) = _specs(_open(path))
    assert spec.tiles == () and len(spec.ranges) == 1 and spec.ranges[0].nbytes == array.nbytes
    # a block inside a page: c-order runs of the page, still plain
    arr = _open(path, chunks=(2, 32, 48))
    assert all(s.tiles == () for s in _specs(arr))
    np.testing.assert_array_equal(arr.compute(), array)


def test_folder_of_single_page_files(tmp_path):
    folder = tmp_path / "scan"
    folder.mkdir()
    planes = [_random((30, 20), "uint16", i) for i in range(11)]
    for i, plane in enumerate(planes):
        tifffile.imwrite(folder / f"z{i}.tif", plane)
    arr = _open(str(folder))  # natural order: z2 before z10
    np.testing.assert_array_equal(arr.compute(), np.stack(planes))
    assert arr.attrs["axes"] == ("i", "y", "x")
    for spec in _specs(arr):
        assert spec.tiles == () and len(spec.ranges) == spec.shape[0]  # one range per file
    np.testing.assert_array_equal(_open(str(folder / "z*.tif"), chunks=(3, 7, 20)).compute(), np.stack(planes))
    files = [str(folder / f"z{i}.tif") for i in (3, 1)]
    np.testing.assert_array_equal(_open(files).compute(), np.stack([planes[3], planes[1]]))


def test_stack_of_multi_page_compressed_files(tmp_path):
    vols = [_random((3, 20, 10), "float32", i) for i in range(3)]
    paths = [str(tmp_path / f"v{i}.tif") for i in range(3)]
    for p, v in zip(paths, vols):
        tifffile.imwrite(p, v, compression="zstd", predictor=True, rowsperstrip=8)
    arr = _open(paths, chunks=(2, 2, 20, 10))
    np.testing.assert_array_equal(arr.compute(), np.stack(vols))


@pytest.mark.parametrize("odd, what", [
    (lambda: _random((31, 20), "uint16"), "shape"),
    (lambda: _random((30, 20), "uint8"), "dtype"),
])
def test_stacked_files_must_agree_and_the_odd_one_is_named(tmp_path, odd, what):
    for i in range(3):
        tifffile.imwrite(tmp_path / f"z{i}.tif", _random((30, 20), "uint16", i))
    tifffile.imwrite(tmp_path / "z1.tif", odd())
    with pytest.raises(LayoutError, match=f"z1.tif.*{what}"):
        _open(str(tmp_path))
    tifffile.imwrite(tmp_path / "z1.tif", _random((30, 20), "uint16"), compression="zlib")
    with pytest.raises(LayoutError, match="z1.tif.*codec"):
        _open(str(tmp_path))


# -- pyramids -----------------------------------------------------------------------------------

def _write_pyramid(path, data, **opts):
    meta = {"axes": "ZYX", "PhysicalSizeX": 0.5, "PhysicalSizeY": 0.5, "PhysicalSizeZ": 2.0}
    with tifffile.TiffWriter(path, ome=True) as tif:
        tif.write(data, subifds=2, metadata=meta, photometric="minisblack", **opts)
        for k in (2, 4):
            tif.write(data[:, ::k, ::k], subfiletype=1, photometric="minisblack", **opts)


@pytest.mark.parametrize("opts", [{"tile": (16, 16), "compression": "zlib"}, {}], ids=["tiled-zlib", "plain"])
def test_multiscale_ome_pyramid(tmp_path, opts):
    data = _random((2, 64, 96), "uint16")
    path = str(tmp_path / "pyr.ome.tif")
    _write_pyramid(path, data, **opts)
    levels = gpulazy.multiscale(path, device="cpu", cache=False)
    assert [a.shape for a in levels] == [(2, 64, 96), (2, 32, 48), (2, 16, 24)]
    with tifffile.TiffFile(path) as tif:
        refs = [lv.asarray() for lv in tif.series[0].levels]
    for arr, ref in zip(levels, refs):
        np.testing.assert_array_equal(arr.compute(), ref)
        assert arr.attrs["axes"] == ("z", "y", "x")
    assert [a.attrs["scale"] for a in levels] == [(2.0, 0.5, 0.5), (2.0, 1.0, 1.0), (2.0, 2.0, 2.0)]
    np.testing.assert_array_equal(_open(path).compute(), data)  # from_files: full resolution
    np.testing.assert_array_equal(_open(path, level=2).compute(), refs[2])
    assert _open(path, level=1).attrs["scale"] == (2.0, 1.0, 1.0)
    with pytest.raises(LayoutError, match="pyr.ome.tif.*level=3"):
        _open(path, level=3)


def test_multiscale_without_pyramid_is_one_level(tmp_path):
    path = str(tmp_path / "a.tif")
    tifffile.imwrite(path, _random((2, 8, 8), "uint8"))
    (only,) = gpulazy.multiscale(path, device="cpu", cache=False)
    np.testing.assert_array_equal(only.compute(), tifffile.imread(path))


# -- recognising files --------------------------------------------------------------------------

@pytest.mark.parametrize("head, expected", [
    (b"II*\0", True), (b"MM\0*", True), (b"II+\0", True), (b"MM\0+", True),
    (b"II*", False), (b"\x89PNG", False), (b"", False), (b"MM*\0", False),
])
def test_guess_can_open_reads_magic_only(tmp_path, head, expected):
    path = tmp_path / "x.bin"
    path.write_bytes(head + b"\0" * 12 if len(head) == 4 else head)
    assert layouts.layout_class("tiff").guess_can_open(str(path)) is expected


def test_guessed_for_bigtiff_and_big_endian(tmp_path):
    for kw in ({"bigtiff": True}, {"byteorder": ">"}):
        path = str(tmp_path / "a.tif")
        tifffile.imwrite(path, _random((4, 5), "uint16"), **kw)
        assert layouts.guess_layout(path).name == "tiff"


# -- errors -------------------------------------------------------------------------------------

def _overwrite_tag(path, name, value):
    with tifffile.TiffFile(path, mode="r+") as tif:
        tif.pages[0].tags[name].overwrite(value)


def test_unsupported_compression_names_file_and_compression(tmp_path):
    path = str(tmp_path / "odd.tif")
    tifffile.imwrite(path, _random((10, 10), "uint16"))
    _overwrite_tag(path, "Compression", 34676)  # SGILOG
    with pytest.raises(LayoutError, match=r"odd.tif.*SGILOG"):
        _open(path)


def test_missing_codec_package_is_named(tmp_path, monkeypatch):
    import sys

    from gpulazy.codecs import host

    path = str(tmp_path / "lzw.tif")
    tifffile.imwrite(path, _random((10, 10), "uint16"), compression="lzw")
    predicted = str(tmp_path / "pred.tif")
    tifffile.imwrite(predicted, _random((10, 10), "uint16"), compression="zlib", predictor=True)
    monkeypatch.setitem(sys.modules, "imagecodecs", None)
    host._build.cache_clear()
    try:
        with pytest.raises(LayoutError, match=r"lzw.tif.*LZW.*pip install imagecodecs"):
            _open(path)
        with pytest.raises(LayoutError, match=r"pred.tif.*tiff_predictor.*pip install imagecodecs"):
            _open(predicted)
    finally:
        host._build.cache_clear()


def test_truncated_file_names_the_file(tmp_path):
    path = tmp_path / "cut.tif"
    tifffile.imwrite(path, _random((3, 30, 20), "uint16"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(LayoutError, match=r"cut.tif.*outside the file"):
        _open(str(path))
    path.write_bytes(data[:6])  # not even a whole header
    with pytest.raises(LayoutError, match="cut.tif"):
        _open(str(path), layout="tiff")


# -- truncated multi-page files: never opened as their first pages -------------------------------

_MULTIPAGE = {  # (tifffile options, what the message says the metadata declares)
    "ome": ({"ome": True, "metadata": {"axes": "TZYX"}}, None),  # OME-XML is written last: a cut loses it
    "imagej": ({"imagej": True, "metadata": {"axes": "TZYX"}}, r"ImageJ metadata \(images=\) declares 15 page"),
    "tiled": ({"tile": (16, 16), "photometric": "minisblack"}, r"shape metadata \(5, 3, 32, 48\) declares 15 page"),
    "strips-no-metadata": ({"metadata": None, "photometric": "minisblack", "rowsperstrip": 8}, None),
    "ome-tiled-zlib": ({"ome": True, "tile": (16, 16), "compression": "zlib", "metadata": {"axes": "TZYX"}}, None),
}


def _cut_points(path):
    """Where page 7's data ends (a page boundary) and 100 bytes into what follows."""
    with tifffile.TiffFile(path) as tif:
        assert len(tif.pages) == 15
        page = tif.pages[7]
        end = page.dataoffsets[-1] + page.databytecounts[-1]
    return {"page-boundary": end, "mid-page": end + 100}


@pytest.mark.parametrize("cut", ["page-boundary", "mid-page"])
@pytest.mark.parametrize("kind", list(_MULTIPAGE))
def test_truncated_multipage_file_is_refused_not_opened_as_its_first_pages(tmp_path, kind, cut, capsys):
    opts, declared = _MULTIPAGE[kind]
    whole = str(tmp_path / "whole.tif")
    tifffile.imwrite(whole, _random((5, 3, 32, 48), "uint16"), **opts)
    path = str(tmp_path / "cut.tif")
    with open(whole, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: _cut_points(whole)[cut]])
    with pytest.raises(LayoutError) as info:
        _open(path)
    msg = str(info.value)
    assert repr(path) in msg
    if "parse the TIFF header" not in msg:  # tifffile itself gives up on some cuts ("corrupted IFD structure")
        assert "truncated" in msg and re.search(r"after \d+ page\(s\)", msg)
    if declared is not None:
        assert re.search(declared, msg), msg
    from gpulazy.cli import main

    assert main(["info", path, "--device", "cpu"]) != 0  # gpulazy info says so too, not a 2-D shape
    out, err = capsys.readouterr()
    assert "cut.tif" in out + err and "shape: (32, 48)" not in out


def _end_chain_after(path, page_index):
    """Set the next-IFD offset of page ``page_index`` to 0: a well-formed file with fewer pages."""
    with tifffile.TiffFile(path) as tif:
        offset = tif.pages[page_index].offset
        assert tif.byteorder == "<" and not tif.is_bigtiff
    with open(path, "r+b") as f:
        f.seek(offset)
        (ntags,) = struct.unpack("<H", f.read(2))
        f.seek(offset + 2 + 12 * ntags)
        f.write(struct.pack("<I", 0))


@pytest.mark.parametrize("kind, declared", [
    ("imagej", "ImageJ metadata \\(images=\\) declares 15"),
    ("ome", "OME-XML declares 15 page"),
    ("tiled", "shape metadata .* declares 15"),
])
def test_metadata_declaring_more_pages_than_the_file_holds_is_refused(tmp_path, kind, declared):
    path = str(tmp_path / "short.tif")
    tifffile.imwrite(path, _random((5, 3, 32, 48), "uint16"), **_MULTIPAGE[kind][0])
    _end_chain_after(path, 7)  # 8 pages left, the metadata unchanged
    with tifffile.TiffFile(path) as tif:
        assert len(tif.pages) == 8
    with pytest.raises(LayoutError, match=declared) as info:
        _open(path)
    assert repr(path) in str(info.value)


def test_byte_counts_that_do_not_match(tmp_path):
    path = str(tmp_path / "short.tif")
    tifffile.imwrite(path, _random((20, 10), "uint16"), rowsperstrip=5)
    _overwrite_tag(path, "StripByteCounts", (100, 100, 100, 100))  # each strip needs 100: fine
    _check(path)
    _overwrite_tag(path, "StripByteCounts", (100, 60, 100, 100))
    with pytest.raises(LayoutError, match=r"short.tif.*piece 1 has 60 bytes.*needs 100"):
        _open(path)
    _overwrite_tag(path, "StripByteCounts", (100, 0, 100, 100))
    with pytest.raises(LayoutError, match=r"short.tif.*piece 1 \(0 bytes at offset \d+\) has no bytes"):
        _open(path)


def test_pages_stored_unlike_the_first_are_refused(tmp_path):
    path = str(tmp_path / "mixed.tif")
    tifffile.imwrite(path, _random((3, 20, 10), "uint16"), imagej=True)
    with tifffile.TiffFile(path, mode="r+") as tif:
        tif.pages[1].tags["Compression"].overwrite(8)
    with pytest.raises(LayoutError, match="mixed.tif.* page 1 is stored unlike page 0"):
        _open(path)


def test_sparse_tiles_read_as_fill_like_tifffile(tmp_path):
    path = str(tmp_path / "sparse.tif")
    tifffile.imwrite(path, _random((40, 40), "uint16"), tile=(16, 16), compression="zlib")
    with tifffile.TiffFile(path) as tif:
        offsets, counts = list(tif.pages[0].dataoffsets), list(tif.pages[0].databytecounts)
    offsets[4], counts[4] = 0, 0  # the middle tile was never written (GDAL's SPARSE_OK)
    _overwrite_tag(path, "TileOffsets", tuple(offsets))
    _overwrite_tag(path, "TileByteCounts", tuple(counts))
    arr = _check(path)
    assert (arr.compute()[16:32, 16:32] == 0).all()


@pytest.mark.parametrize("pieces, why", [({}, "cannot decode to"), ({"tile": (16, 16)}, "more than the file")])
def test_header_claiming_more_than_the_bytes_can_hold(tmp_path, pieces, why):
    path = str(tmp_path / "huge.tif")
    tifffile.imwrite(path, _random((8, 8), "uint16"), compression="zlib", **pieces)
    _overwrite_tag(path, "ImageWidth", 3_000_000)  # one strip of 8 rows: 48 MB from ~100 bytes
    if pieces:
        _overwrite_tag(path, "ImageLength", 3_000_000)  # 35 billion tiles
    with pytest.raises(LayoutError, match=f"huge.tif.*{why}"):
        _open(path)


def test_not_a_tiff_and_bad_options(tmp_path):
    path = tmp_path / "a.tif"
    path.write_bytes(b"not a tiff at all" * 10)
    with pytest.raises(LayoutError, match="a.tif"):
        _open(str(path), layout="tiff")
    tifffile.imwrite(path, _random((4, 5), "uint16"))
    with pytest.raises(LayoutError, match="series=3"):
        _open(str(path), series=3)
    with pytest.raises(LayoutError, match="offset"):
        _open(str(path), offset=8)
    with pytest.raises(LayoutError, match="order"):
        _open(str(path), order="F")
    with pytest.raises(LayoutError, match="a.tif.*dtype"):
        _open(str(path), dtype="float32")
    with pytest.raises(LayoutError, match="a.tif.*shape"):
        _open(str(path), shape=(5, 4))
    assert _open(str(path), dtype="uint16", shape=(4, 5)).shape == (4, 5)


# -- fuzzing the header parser --------------------------------------------------------------------

_FUZZ_SOURCES = {
    "strips": {"rowsperstrip": 7},
    "zlib-tiles": {"compression": "zlib", "tile": (16, 16)},
    "bigtiff-be": {"bigtiff": True, "byteorder": ">", "rowsperstrip": 5},
    "zstd-predictor": {"compression": "zstd", "predictor": True, "rowsperstrip": 8},
}


@pytest.fixture(scope="module")
def fuzz_sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    out = {}
    for name, kw in _FUZZ_SOURCES.items():
        path = folder / f"{name}.tif"
        tifffile.imwrite(path, _random((3, 20, 12), "uint16", 1), photometric="minisblack", **kw)
        out[name] = path.read_bytes()
    return out


@contextlib.contextmanager
def _time_limit(seconds: int):
    """Fail, rather than hang, when the block takes longer (SIGALRM: main thread, Unix)."""
    def expire(*_):
        raise TimeoutError(f"took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _patch_tags(path, page_tags, edit):
    """Rewrite tags of a file tifffile wrote: ``edit(blob, tag, fmt_prefix)`` for ``page_tags`` [(page, code)]."""
    with tifffile.TiffFile(path) as tif:
        found = [(tif.pages[p].tags[code], tif.byteorder, list(tif.pages[p].dataoffsets)) for p, code in page_tags]
    blob = bytearray(path.read_bytes())
    for tag, order, offsets in found:
        edit(blob, tag, order, offsets)
    path.write_bytes(bytes(blob))


def _move_strip(blob, tag, order, offsets, piece=2, shift=1):
    offsets = list(offsets)
    offsets[piece] += shift
    struct.pack_into(order + f"{tag.count}I", blob, tag.valueoffset, *offsets)


def _retag(code, value):
    """SamplesPerPixel (277, 1: the default) written as another tag: FillOrder, Predictor."""
    def edit(blob, tag, order, offsets):
        struct.pack_into(order + "H", blob, tag.offset, code)
        struct.pack_into(order + "H", blob, tag.valueoffset, value)
    return edit


def _damaged(tmp_path, damage):
    """A small TIFF tifffile wrote, damaged in one of the ways fuzzing found gpulazy reading it unlike tifffile."""
    path = tmp_path / "damaged.tif"
    data = _random((3, 20, 12), "uint16", 1)
    if damage in ("strip moved 1", "strip moved 144"):  # tifffile reads the series as one run
        tifffile.imwrite(path, data, photometric="minisblack", rowsperstrip=7)
        _patch_tags(path, [(1, "StripOffsets")], lambda *a: _move_strip(*a, shift=int(damage.split()[-1])))
    elif damage == "OME strips swapped":  # no series run; tifffile reads each page from its first strip
        tifffile.imwrite(path, data, ome=True, rowsperstrip=7, metadata={"axes": "ZYX"})
        def swap(blob, tag, order, offsets):
            struct.pack_into(order + f"{tag.count}I", blob, tag.valueoffset, offsets[1], offsets[0], *offsets[2:])
        _patch_tags(path, [(1, "StripOffsets")], swap)
    elif damage == "FillOrder 2, strip moved":  # a decode step: the series is not one run either
        tifffile.imwrite(path, data, photometric="minisblack", rowsperstrip=7)
        _patch_tags(path, [(p, 277) for p in range(3)], _retag(266, 2))
        _patch_tags(path, [(1, "StripOffsets")], lambda *a: _move_strip(*a, piece=2, shift=1))
    elif damage == "ImageJ page moved":  # one strip a page: tifffile reads the hyperstack as one run
        tifffile.imwrite(path, _random((2, 1, 2, 33, 17), "float32", 3), imagej=True)
        with tifffile.TiffFile(path) as tif:  # (a single offset is stored in its tag's own value field)
            tag, order, offset = tif.pages[2].tags["StripOffsets"], tif.byteorder, tif.pages[2].dataoffsets[0]
        blob = bytearray(path.read_bytes())
        struct.pack_into(order + "I", blob, tag.valueoffset, offset - 256)
        path.write_bytes(bytes(blob))
    elif damage == "predictor on uncompressed pages":  # legal, but tifffile undoes it across rows
        tifffile.imwrite(path, data[0], photometric="minisblack", rowsperstrip=7)
        _patch_tags(path, [(0, 277)], _retag(317, 2))
    elif damage == "TileWidth 0":  # tifffile takes the tiles for strips (and imread raises)
        tifffile.imwrite(path, _random((8, 32, 32), "uint16", 2), tile=(4, 16, 16), volumetric=True,
                         photometric="minisblack")
        def zero(blob, tag, order, offsets):
            struct.pack_into(order + ("H" if tag.dtype == 3 else "I"), blob, tag.valueoffset, 0)
        _patch_tags(path, [(0, 322)], zero)
    return path


@pytest.mark.parametrize("damage", ["strip moved 1", "strip moved 144", "OME strips swapped", "ImageJ page moved",
                                    "FillOrder 2, strip moved", "predictor on uncompressed pages", "TileWidth 0"])
def test_headers_gpulazy_and_tifffile_would_read_differently_are_layout_errors(tmp_path, damage):
    """Each of these read without an error before, and its values differed from tifffile's (found by
    the fuzz test below and a wider TIFF fuzzer): now a ``LayoutError`` names the file and the fault."""
    path = _damaged(tmp_path, damage)
    with pytest.raises(LayoutError) as info:
        _open(str(path))
    said = str(info.value)
    assert str(path) in said
    if "strip" in damage or "page moved" in damage:
        assert "page 1 piece" in said or "page 2 piece" in said
        assert "one run" in said and "corrupt" in said
    else:
        assert ("predictor 2" in said) if "predictor" in damage else ("TileWidth 0" in said)


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="needs SIGALRM to bound each example's time")
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupt_header_is_a_layout_error_or_a_correct_read(tmp_path, fuzz_sources, data):
    name = data.draw(st.sampled_from(sorted(fuzz_sources)), "source")
    blob = bytearray(fuzz_sources[name])
    if data.draw(st.booleans(), "truncate"):
        blob = blob[: data.draw(st.integers(0, len(blob) - 1), "length")]
    edits = data.draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4))
    for pos, value in edits:
        if blob:  # mostly the header and IFDs (the first ~400 bytes), sometimes anywhere
            blob[pos % min(len(blob), 400) if pos % 5 else pos % len(blob)] = value
    path = tmp_path / "fuzzed.tif"
    path.write_bytes(bytes(blob))
    with _time_limit(20):
        try:
            arr = _open(str(path), layout="tiff")
        except LayoutError as e:
            assert "fuzzed.tif" in str(e)
            return
        try:
            got = arr.compute()
        except GpulazyError as e:  # the data itself is corrupt: a decode or read error naming the file
            assert "fuzzed.tif" in str(e)
            return
        try:
            ref = tifffile.imread(str(path))  # gpulazy read it: tifffile must agree
        except Exception:
            # tifffile's decoders are stricter about some corrupt *pixel* streams (a zstd frame
            # longer than its strip); the header both parse must still give the same shape.
            with tifffile.TiffFile(str(path)) as tif:
                assert got.shape == tuple(tif.series[0].shape)
            return
    np.testing.assert_array_equal(got, ref)


def test_a_strip_starting_inside_another_is_a_layout_error_naming_the_file(tmp_path):
    p = tmp_path / "s.tif"
    tifffile.imwrite(p, _random((3, 20, 12), "uint16", 1), photometric="minisblack", rowsperstrip=7)
    with tifffile.TiffFile(p) as tif:  # page 2's second strip offset, pointed into its first strip
        tag = tif.pages[2].tags["StripOffsets"]
        first, where = tag.value[0], tag.valueoffset + 4
    blob = bytearray(p.read_bytes())
    blob[where:where + 4] = int(first + 48).to_bytes(4, "little")
    p.write_bytes(bytes(blob))
    with pytest.raises(LayoutError, match="s.tif.*page 2.*starts inside piece 0"):
        _open(str(p), layout="tiff")
