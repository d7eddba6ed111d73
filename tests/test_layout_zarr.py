"""Zarr v2/v3, sharding and OME-Zarr: every read compared with zarr-python reading the same store."""

from __future__ import annotations

import json
import os
import pickle
import tempfile

import numcodecs
import numpy as np
import pytest
import zarr
from conftest import to_host
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, ShardingCodec, TransposeCodec, ZstdCodec

import gpulazy
from gpulazy import layouts
from gpulazy.errors import LayoutError
from gpulazy.layouts import zarr as zarr_layout
from gpulazy.layouts.zarr import ZarrLayout
from gpulazy.spec import Codec

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _data(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind in "fc":
        return (rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if dt.kind == "c" else 0)).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), shape, endpoint=True).astype(dt)


def _make(path, data, *, missing=(), **kw):
    """A store holding ``data``, with the blocks in ``missing`` never written (they read as fill)."""
    z = zarr.create_array(str(path), shape=data.shape, dtype=data.dtype, **kw)
    z[...] = data
    for sel in missing:
        z[sel] = z.fill_value  # an all-fill chunk is deleted (write_empty_chunks is off by default)
    return str(path)


def _read(store, **kw):
    arr = gpulazy.from_files(store, device="cpu", cache=False, **kw)
    return arr, arr.compute()


def _check_same(store, **kw):
    arr, got = _read(store, **kw)
    want = zarr.open_array(store, mode="r")[...]
    assert got.dtype == want.dtype.newbyteorder("=")
    assert got.dtype.isnative
    np.testing.assert_array_equal(got, want)
    return arr


def _chunk_files(path):
    out = []
    for d, _, names in os.walk(path):
        out += [os.path.join(d, n) for n in names if n not in ("zarr.json", ".zarray", ".zattrs", ".zgroup")]
    return sorted(out)


# -- Zarr v2 ----------------------------------------------------------------------------------------

V2_CODECS = {
    "raw": dict(compressors=None),
    "zstd": dict(compressors=numcodecs.Zstd(level=1)),
    "blosc": dict(compressors=numcodecs.Blosc(cname="lz4", shuffle=numcodecs.Blosc.SHUFFLE)),
    "lz4": dict(compressors=numcodecs.LZ4()),
    "zlib": dict(compressors=numcodecs.Zlib(level=1)),
    "gzip": dict(compressors=numcodecs.GZip(level=1)),
    "zstd+shuffle": dict(compressors=numcodecs.Zstd(), filters=[numcodecs.Shuffle(elementsize=4)]),
    "zstd+delta": dict(compressors=numcodecs.Zstd(), filters=[numcodecs.Delta(dtype=">i4")]),
    "delta only": dict(compressors=None, filters=[numcodecs.Delta(dtype=">i4")]),
}


@pytest.mark.parametrize("codec", list(V2_CODECS), ids=list(V2_CODECS))
@pytest.mark.parametrize("order", ["C", "F"])
def test_v2_codecs_orders_and_missing_chunks_match_zarr(tmp_path, codec, order):
    data = _data((11, 13), ">i4")
    kw = dict(V2_CODECS[codec])
    p = _make(tmp_path / "a.zarr", data, zarr_format=2, chunks=(4, 5), order=order, fill_value=-3,
              missing=[np.s_[4:8, 5:10]], **kw)
    arr = _check_same(p)
    assert arr.dtype == np.dtype("i4") and arr.shape == (11, 13)
    assert any(t.range is None for s in arr.chunk_index.specs.values() for t in s.tiles)  # the missing chunk
    want_ids = {"raw": [], "delta only": ["delta"]}.get(codec, codec.split("+"))
    spec = next(iter(arr.chunk_index.specs.values()))
    assert [c.id for c in spec.codec or ()] == want_ids  # decode order: compressor first, then filters
    assert {t.order for t in spec.tiles} == {order}


@pytest.mark.parametrize("sep", [".", "/"])
@pytest.mark.parametrize("dtype", ["<u2", ">f4", ">f8", "i1", "|b1", "<c8"])
def test_v2_separators_and_dtypes(tmp_path, sep, dtype):
    data = _data((9, 7), dtype)
    p = _make(tmp_path / "a.zarr", data, zarr_format=2, chunks=(4, 3), compressors=numcodecs.Zstd(),
              chunk_key_encoding={"name": "v2", "separator": sep})
    files = _chunk_files(p)
    assert any(os.sep.join(["", "1", "2"]) in f for f in files) == (sep == "/")
    arr = _check_same(p)
    assert {s.dtype for s in arr.chunk_index.specs.values()} == {np.dtype(dtype).str}


@pytest.mark.parametrize("fill", [float("nan"), None, 2.5])
def test_v2_fill_values_for_missing_chunks(tmp_path, fill):
    data = _data((8, 8), "<f4")
    p = _make(tmp_path / "a.zarr", data, zarr_format=2, chunks=(4, 4), compressors=None, fill_value=fill)
    os.remove(os.path.join(p, "1.0"))
    os.remove(os.path.join(p, "0.1"))
    _, got = _read(p)
    np.testing.assert_array_equal(got, zarr.open_array(p, mode="r")[...])
    expect = 0 if fill is None else fill
    np.testing.assert_array_equal(got[4:, :4], np.full((4, 4), expect, "f4"))
    np.testing.assert_array_equal(got[:4, :4], data[:4, :4])


# -- Zarr v3 ----------------------------------------------------------------------------------------

def _v3_pipelines():
    from zarr.codecs import numcodecs as znc

    return {  # name: (create_array options, codec ids in decode order)
        "raw": (dict(compressors=None), []),
        "zstd": (dict(compressors=ZstdCodec(level=1)), ["zstd"]),
        "gzip": (dict(compressors=GzipCodec(level=1)), ["gzip"]),
        "blosc": (dict(compressors=BloscCodec(cname="zstd", shuffle="bitshuffle")), ["blosc"]),
        "crc32c": (dict(compressors=Crc32cCodec()), ["crc32c"]),
        "zstd+crc32c": (dict(compressors=[ZstdCodec(), Crc32cCodec()]), ["crc32c", "zstd"]),
        "big-endian": (dict(compressors=None, serializer=BytesCodec(endian="big")), []),
        "big-endian zstd": (dict(compressors=ZstdCodec(), serializer=BytesCodec(endian="big")), ["zstd"]),
        "transpose (F)": (dict(compressors=None, filters=[TransposeCodec(order=(2, 1, 0))]), []),
        "transpose zstd": (dict(compressors=ZstdCodec(), filters=[TransposeCodec(order=(2, 1, 0))]), ["zstd"]),
        "numcodecs delta lz4": (dict(filters=[znc.Delta(dtype="<u2")], compressors=[znc.LZ4()]), ["lz4", "delta"]),
    }


V3_NAMES = list(_v3_pipelines())


@pytest.mark.parametrize("name", V3_NAMES, ids=V3_NAMES)
def test_v3_codec_pipelines_match_zarr(tmp_path, name):
    kw, ids = _v3_pipelines()[name]
    data = _data((5, 9, 7), "<u2")
    p = _make(tmp_path / "a.zarr", data, chunks=(2, 4, 3), fill_value=9, missing=[np.s_[2:4, 4:8, :]], **kw)
    arr = _check_same(p)
    spec = next(iter(arr.chunk_index.specs.values()))
    assert spec.dtype == (">u2" if "big" in name else "<u2")
    assert arr.chunk_index.order == ("F" if "transpose" in name else "C")
    assert [c.id for c in spec.codec or ()] == ids


def test_v3_transpose_that_is_not_c_or_f_is_refused(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((4, 5, 6), "u1"), chunks=(2, 2, 2), compressors=None,
              filters=[TransposeCodec(order=(1, 0, 2))])
    with pytest.raises(LayoutError, match=r"zarr.json.*transpose order \[1, 0, 2\]"):
        layouts.index(p)


@pytest.mark.parametrize("encoding", [{"name": "default", "separator": "/"}, {"name": "default", "separator": "."},
                                      {"name": "v2", "separator": "."}, {"name": "v2", "separator": "/"}])
def test_v3_chunk_key_encodings(tmp_path, encoding):
    data = _data((7, 6), "<i2")
    p = _make(tmp_path / "a.zarr", data, chunks=(3, 4), chunk_key_encoding=encoding, fill_value=0)
    _check_same(p)
    meta = zarr.open_array(p, mode="r").metadata
    layout_meta = zarr_layout._read_meta(zarr.open_array(p, mode="r"), p)
    for coords in [(0, 0), (2, 1), (1, 0)]:
        assert layout_meta.chunk_key(coords) == meta.encode_chunk_key(coords)
        assert os.path.exists(os.path.join(p, *layout_meta.chunk_key(coords).split("/")))


def test_v3_fill_value_nan_and_dimension_names(tmp_path):
    data = _data((6, 4), "<f8")
    p = _make(tmp_path / "a.zarr", data, chunks=(3, 4), fill_value=float("nan"), missing=[np.s_[3:, :]],
              dimension_names=("y", "x"))
    arr = _check_same(p)
    assert np.isnan(arr[3:].compute()).all()
    assert arr.attrs["axes"] == ("y", "x")
    assert arr.attrs["stored_chunks"] == (3, 4) and arr.attrs["codec"] == "zstd"


def test_zero_dimensional_and_empty_arrays(tmp_path):
    for fmt in (2, 3):
        p = str(tmp_path / f"scalar{fmt}.zarr")
        z = zarr.create_array(p, shape=(), dtype="f4", zarr_format=fmt, fill_value=0)
        z[...] = 3.5
        _check_same(p)
        p = _make(tmp_path / f"empty{fmt}.zarr", np.zeros((0, 5), "u1"), chunks=(2, 2), zarr_format=fmt)
        arr, got = _read(p)
        assert got.shape == (0, 5)


# -- GPU-shaped specs ------------------------------------------------------------------------------

def test_uncompressed_chunks_become_plain_ranges(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((8, 6), "<u2"), chunks=(2, 6), compressors=None)
    arr = _check_same(p, chunks=(2, 6))
    for spec in arr.chunk_index.specs.values():
        assert not spec.tiles and spec.codec is None
        (r,) = spec.ranges
        assert r.offset == 0 and r.nbytes == 2 * 6 * 2 and r.path.startswith(p)
    # blocks of several row-slabs: still plain ranges, one per stored chunk, in order
    arr = _check_same(p, chunks=(4, 6))
    assert all(len(s.ranges) == 2 and not s.tiles for s in arr.chunk_index.specs.values())


def test_zstd_chunks_are_one_tile_each_with_a_plain_zstd_codec(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((8, 9), "<u2"), chunks=(4, 3), compressors=ZstdCodec(level=3, checksum=True))
    arr = _check_same(p)
    (spec,) = arr.chunk_index.specs.values()
    assert spec.codec == (Codec("zstd"),)
    assert len(spec.tiles) == 6 and all(t.range.offset == 0 for t in spec.tiles)
    assert sorted(t.range.path for t in spec.tiles) == _chunk_files(p)


def test_uncompressed_inner_chunks_are_plain_ranges_inside_the_shard_file(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((8, 6), "<u2"), chunks=(2, 6), shards=(4, 6), compressors=None)
    arr = _check_same(p, chunks=(2, 6))
    offsets = set()
    for (i, _), spec in arr.chunk_index.specs.items():
        assert not spec.tiles and spec.codec is None
        (r,) = spec.ranges
        assert r.path == os.path.join(p, "c", str(i // 2), "0") and r.nbytes == 24
        offsets.add(r.offset)
    assert offsets == {0, 24}  # index at the end: inner chunks from byte 0


@pytest.mark.parametrize("kind", ["raw", "zstd", "sharded zstd", "v2 F big-endian"])
def test_reads_onto_each_device(tmp_path, device, kind):
    data = _data((12, 10), ">f4" if "big" in kind else "<u2")
    kw = {"raw": dict(compressors=None), "zstd": dict(compressors=ZstdCodec()),
          "sharded zstd": dict(shards=(8, 10), compressors=ZstdCodec()),
          "v2 F big-endian": dict(zarr_format=2, order="F", compressors=numcodecs.Zstd())}[kind]
    p = _make(tmp_path / "a.zarr", data, chunks=(4, 5), missing=[np.s_[4:8, 0:5]], **kw)
    arr = gpulazy.from_files(p, device=device, cache=False, chunks=(8, 10))
    np.testing.assert_array_equal(to_host(arr.compute()), zarr.open_array(p, mode="r")[...])
    # A float sum on the GPU adds in another order than NumPy: equal to rounding.
    np.testing.assert_allclose(to_host(arr[8:].sum(axis=0).compute()), zarr.open_array(p, mode="r")[8:].sum(0),
                               rtol=1e-6)


# -- sharding -------------------------------------------------------------------------------------

@pytest.mark.parametrize("location", ["start", "end"])
@pytest.mark.parametrize("index_codecs", [[BytesCodec(), Crc32cCodec()], [BytesCodec(endian="big")]],
                         ids=["crc32c", "big-endian"])
@pytest.mark.parametrize("inner", [[BytesCodec(), ZstdCodec()], [BytesCodec()], [BytesCodec(endian="big")]],
                         ids=["zstd", "raw", "raw-big"])
def test_sharding_index_variants(tmp_path, location, index_codecs, inner):
    data = _data((10, 13), "<u2")
    shard = ShardingCodec(chunk_shape=(2, 3), codecs=inner, index_codecs=index_codecs, index_location=location)
    p = _make(tmp_path / "a.zarr", data, chunks=(4, 6), serializer=shard, compressors=None, fill_value=1,
              missing=[np.s_[0:2, 0:3], np.s_[4:8, 6:12]])  # one empty inner chunk; one whole shard
    assert not os.path.exists(os.path.join(p, "c", "1", "1"))  # the missing shard file
    arr = _check_same(p)
    assert arr.attrs["shards"] == (4, 6) and arr.attrs["stored_chunks"] == (2, 3)
    (spec,) = arr.chunk_index.specs.values()  # 3 x 3 shards of 2 x 2 inner chunks, clipped: 5 x 5 tiles
    assert len(spec.tiles) == 25
    assert sum(t.range is None for t in spec.tiles) == 1 + 4  # an empty inner chunk, a missing shard's 4
    assert {os.path.dirname(os.path.dirname(r.path)) for r in spec.ranges} == {os.path.join(p, "c")}


def test_each_shard_index_is_read_once(tmp_path, monkeypatch):
    p = _make(tmp_path / "a.zarr", _data((16, 16), "u1"), chunks=(2, 2), shards=(8, 8))
    reads = []
    real = zarr_layout.read_shard_index
    monkeypatch.setattr(zarr_layout, "read_shard_index", lambda path, *a: reads.append(path) or real(path, *a))
    arr = _check_same(p, chunks=(2, 4))
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 4
    assert arr.numblocks == (8, 4)


def test_sharded_default_chunks_are_whole_shards_and_user_chunks_whole_inner_chunks(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((20, 30), "u1"), chunks=(2, 5), shards=(6, 10))
    arr = _check_same(p)
    assert arr.chunks == ((20,), (30,))
    with gpulazy.config.set(chunk_size=60):  # one shard is 60 bytes
        arr = _check_same(p)
        assert arr.chunks == ((6, 6, 6, 2), (10, 10, 10))
    arr = _check_same(p, chunks=(3, 7))
    assert arr.chunks == ((4, 2, 4, 2, 4, 2, 2), (10, 5, 10, 5))  # each edge moved up to an inner chunk's


@st.composite
def _geometry(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    inner = tuple(draw(st.integers(1, 4)) for _ in shape)
    per = tuple(draw(st.integers(1, 3)) for _ in shape)
    user = draw(st.one_of(st.none(), st.tuples(*(st.integers(1, n) for n in shape))))
    return shape, inner, tuple(i * k for i, k in zip(inner, per)), user


@FUZZ
@given(geom=_geometry(), sharded=st.booleans(), compressed=st.booleans(), fmt=st.sampled_from([2, 3]),
       dtype=st.sampled_from(["<i2", ">i2", ">f4", "<f8", "u1"]), fortran=st.booleans(),
       drop=st.integers(0, 2**16), seed=st.integers(0, 100))
def test_any_geometry_matches_zarr(geom, sharded, compressed, fmt, dtype, fortran, drop, seed):
    shape, inner, shard, user = geom
    sharded = sharded and fmt == 3
    data = _data(shape, dtype, seed)
    kw = dict(chunks=inner, shards=shard if sharded else None, zarr_format=fmt, fill_value=1,
              compressors=(ZstdCodec() if fmt == 3 else numcodecs.Zstd()) if compressed else None)
    if fmt == 2:
        kw["order"] = "F" if fortran else "C"
    else:
        endian = "big" if dtype.startswith(">") else "little"
        kw["serializer"] = BytesCodec(endian=endian) if not sharded else "auto"
        kw["filters"] = [TransposeCodec(order=tuple(range(len(shape)))[::-1])] if fortran and not sharded else None
    with tempfile.TemporaryDirectory() as d:
        p = _make(os.path.join(d, "a.zarr"), data, **kw)
        files = _chunk_files(p)
        for i, f in enumerate(files):  # delete a random subset of chunk / shard files
            if drop >> (i % 16) & 1:
                os.remove(f)
        arr = _check_same(p, chunks=user)
        for axis, (c, s) in enumerate(zip(arr.chunks, inner)):
            edges = np.cumsum(c)[:-1]
            assert all(e % s == 0 for e in edges), (axis, c, s)  # blocks are whole stored chunks


# -- OME-Zarr -------------------------------------------------------------------------------------

def _ome(root, fmt, *, version):
    levels = [_data((4, 16, 12), "<u2", 1)]
    levels += [levels[0][:, ::2, ::2], levels[0][:, ::4, ::4]]
    axes = [{"name": "z", "type": "space", "unit": "micrometer"}, {"name": "y", "type": "space", "unit": "micrometer"},
            {"name": "x", "type": "space", "unit": "micrometer"}]
    datasets = [{"path": str(i), "coordinateTransformations": [
        {"type": "scale", "scale": [2.0, 0.5 * 2**i, 0.5 * 2**i]},
        {"type": "translation", "translation": [0.0, 0.25 * i, 0.25 * i]}]} for i in range(3)]
    ms = {"axes": axes, "datasets": datasets, "name": "cells",
          "coordinateTransformations": [{"type": "scale", "scale": [1.0, 2.0, 2.0]}]}
    if version == "0.4":
        ms["version"] = "0.4"
        attrs = {"multiscales": [ms]}
    else:
        attrs = {"ome": {"version": "0.5", "multiscales": [ms]}}
    g = zarr.open_group(str(root), mode="w", zarr_format=fmt, attributes=attrs)
    for i, lv in enumerate(levels):
        g.create_array(str(i), shape=lv.shape, dtype=lv.dtype, chunks=(2, 5, 5))[...] = lv
    lab = g.create_array("labels/0", shape=(4, 16, 12), dtype="u1", chunks=(4, 8, 8))
    lab[...] = 3
    return str(root), levels


@pytest.mark.parametrize("fmt,version", [(2, "0.4"), (3, "0.5")])
def test_ome_zarr_full_resolution_and_multiscale(tmp_path, fmt, version):
    root, levels = _ome(tmp_path / "img.ome.zarr", fmt, version=version)
    arr, got = _read(root)
    np.testing.assert_array_equal(got, levels[0])
    pyramid = gpulazy.multiscale(root, device="cpu", cache=False)
    assert [a.shape for a in pyramid] == [lv.shape for lv in levels]
    for a, lv in zip(pyramid, levels):
        np.testing.assert_array_equal(a.compute(), lv)
    a1 = pyramid[1]
    assert a1.attrs["axes"] == ("z", "y", "x")
    assert a1.attrs["units"] == ("micrometer",) * 3
    assert a1.attrs["scale"] == (2.0, 2.0, 2.0)  # dataset (2, 1, 1) then the multiscale's (1, 2, 2)
    assert a1.attrs["translation"] == (0.0, 0.5, 0.5)
    assert a1.attrs["name"] == "cells" and a1.attrs["ngff_version"] == version
    assert arr.attrs["scale"] == (2.0, 1.0, 1.0)


def test_multiscale_dataset_missing_from_the_store(tmp_path):
    import shutil

    root, levels = _ome(tmp_path / "img.ome.zarr", 3, version="0.5")
    shutil.rmtree(os.path.join(root, "2"))
    np.testing.assert_array_equal(_read(root)[1], levels[0])  # full resolution still opens
    with pytest.raises(LayoutError, match=r"img\.ome\.zarr.zarr\.json.*dataset '2' is not an array"):
        gpulazy.multiscale(root, device="cpu")


@pytest.mark.parametrize("opt", ["path", "array"])
def test_pick_an_array_inside_a_group(tmp_path, opt):
    root, _ = _ome(tmp_path / "img.ome.zarr", 3, version="0.5")
    arr, got = _read(root, **{opt: "labels/0"})
    assert got.dtype == np.uint8 and (got == 3).all()
    with pytest.raises(LayoutError, match="'nothing' is not in the Zarr store.*'0', '1', '2', 'labels/0'"):
        _read(root, **{opt: "nothing"})


def test_group_without_multiscales_lists_its_arrays(tmp_path):
    g = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    g.create_array("a", shape=(3,), dtype="u1")
    g.create_array("sub/b", shape=(3,), dtype="u1")
    with pytest.raises(LayoutError, match=r"2 arrays \('a', 'sub/b'\).*path="):
        layouts.index(str(tmp_path / "g.zarr"))
    zarr.open_group(str(tmp_path / "none.zarr"), mode="w")
    with pytest.raises(LayoutError, match="none.zarr' holds no arrays"):
        layouts.index(str(tmp_path / "none.zarr"))
    g2 = zarr.open_group(str(tmp_path / "one.zarr"), mode="w")
    g2.create_array("only", shape=(4,), dtype="u2")[...] = [1, 2, 3, 4]
    assert _read(str(tmp_path / "one.zarr"))[1].tolist() == [1, 2, 3, 4]


# -- recognising stores, options ------------------------------------------------------------------

def test_guess_can_open_and_metadata_file_paths(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((4, 4), "u1"), chunks=(2, 2))
    assert ZarrLayout.guess_can_open(p) and ZarrLayout.guess_can_open(os.path.join(p, "zarr.json"))
    assert not ZarrLayout.guess_can_open(str(tmp_path)) and not ZarrLayout.guess_can_open(str(tmp_path / "nope"))
    assert not ZarrLayout.guess_can_open(_chunk_files(p)[0])
    assert layouts.guess_layout(p).name == "zarr"
    np.testing.assert_array_equal(_read(os.path.join(p, "zarr.json"))[1], zarr.open_array(p)[...])
    p2 = _make(tmp_path / "b.zarr", _data((4, 4), "u1"), chunks=(2, 2), zarr_format=2)
    np.testing.assert_array_equal(_read(os.path.join(p2, ".zarray"))[1], zarr.open_array(p2)[...])


def test_options_are_checked(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((4, 4), "<u2"), chunks=(2, 2))
    with pytest.raises(TypeError, match="datasett"):
        layouts.index(p, datasett="x")
    with pytest.raises(LayoutError, match="holds dtype '<u2'"):
        layouts.index(p, dtype="f4")
    with pytest.raises(LayoutError, match=r"shape \(4, 4\)"):
        layouts.index(p, shape=(3, 4))
    with pytest.raises(LayoutError, match="offset"):
        layouts.index(p, offset=16)
    with pytest.raises(TypeError, match="different arrays"):
        layouts.index(p, path="a", array="b")
    assert layouts.index(p, dtype="<u2", shape=(4, 4), order="C").shape == (4, 4)


def test_index_token_follows_chunk_files_and_specs_pickle(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((4, 4), "<u2"), chunks=(2, 2))
    a, b = layouts.index(p), layouts.index(p)
    assert a.token() == b.token()
    assert pickle.loads(pickle.dumps(a.specs[0, 0])).key == a.specs[0, 0].key
    z = zarr.open_array(p, mode="r+")
    z[0, 0] = 7
    assert layouts.index(p).token() != a.token()


# -- bad input ------------------------------------------------------------------------------------

def test_unsupported_codec_names_store_codec_and_package(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((4, 4), "u1"), chunks=(2, 2), zarr_format=2, compressors=None)
    meta = json.loads(open(os.path.join(p, ".zarray")).read())
    meta["compressor"] = {"id": "nosuchcodec"}
    open(os.path.join(p, ".zarray"), "w").write(json.dumps(meta))
    with pytest.raises(LayoutError, match=r"a\.zarr.*nosuchcodec.*pip install"):
        gpulazy.from_files(p, device="cpu")
    p3 = _make(tmp_path / "b.zarr", _data((4, 4), "u1"), chunks=(2, 2), compressors=None)
    meta = json.loads(open(os.path.join(p3, "zarr.json")).read())
    meta["codecs"].append({"name": "nosuchcodec3"})
    open(os.path.join(p3, "zarr.json"), "w").write(json.dumps(meta))
    with pytest.raises(LayoutError, match=r"b\.zarr.*nosuchcodec3.*pip install"):
        layouts.index(p3)


def test_check_supported_refuses_what_the_host_cannot_decode(tmp_path):
    # zarr refuses a codec it cannot build before gpulazy sees it (above); what zarr accepts, the
    # layout checks again with gpulazy.codecs, whose error names the store, the codec and the package.
    from gpulazy.codecs import check_supported

    with pytest.raises(LayoutError, match=r"store.zarr.*'nosuch'.*pip install"):
        check_supported((Codec("nosuch"),), "store.zarr")


def test_corrupt_and_missing_metadata_name_the_file(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((4, 4), "u1"), chunks=(2, 2))
    meta = json.loads(open(os.path.join(p, "zarr.json")).read())
    meta["codecs"].append({"name": "bytes"})  # a second serializer: invalid, but no codec is missing
    open(os.path.join(p, "zarr.json"), "w").write(json.dumps(meta))
    with pytest.raises(LayoutError, match=r"a\.zarr.zarr\.json") as info:
        layouts.index(p)
    assert "pip install" not in str(info.value)
    open(os.path.join(p, "zarr.json"), "w").write("{not json")
    with pytest.raises(LayoutError, match=r"a\.zarr.zarr\.json"):
        layouts.index(p)
    (tmp_path / "plain").mkdir()
    with pytest.raises(LayoutError, match="no zarr.json, .zarray or .zgroup"):
        layouts.index(str(tmp_path / "plain"), layout="zarr")


def test_uncompressed_chunk_of_the_wrong_size_names_the_file(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((4, 4), "<u2"), chunks=(2, 2), compressors=None)
    victim = os.path.join(p, "c", "1", "0")
    with open(victim, "r+b") as f:
        f.truncate(5)
    with pytest.raises(LayoutError, match=r"c/1/0.* 5 bytes .* takes 8; the chunk is truncated"):
        layouts.index(p)


def test_chunk_data_is_not_read_at_index_time_and_a_corrupt_chunk_fails_on_compute(tmp_path):
    from gpulazy.errors import ChunkDecodeError

    p = _make(tmp_path / "a.zarr", _data((4, 4), "<u2"), chunks=(2, 2), zarr_format=2, compressors=numcodecs.Zstd())
    victim = os.path.join(p, "1.1")
    open(victim, "wb").write(b"not zstd at all")
    arr = gpulazy.from_files(p, device="cpu", cache=False, chunks=(2, 4))  # index time reads no chunk bytes
    np.testing.assert_array_equal(arr[:2].compute(), zarr.open_array(p, mode="r")[:2])
    with pytest.raises(ChunkDecodeError, match=r"a\.zarr/1\.1"):
        arr.compute()


def test_corrupt_shards_name_the_shard_file(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((4, 4), "<u2"), chunks=(2, 2), shards=(4, 4))
    shard = os.path.join(p, "c", "0", "0")
    blob = bytearray(open(shard, "rb").read())
    blob[-6] ^= 0xFF  # a flipped index byte: the crc32c no longer matches
    open(shard, "wb").write(bytes(blob))
    with pytest.raises(LayoutError, match=r"c/0/0.*crc32c"):
        layouts.index(p)
    open(shard, "wb").write(b"\0" * 10)
    with pytest.raises(LayoutError, match=r"c/0/0.* 10 bytes.*truncated"):
        layouts.index(p)
    p2 = _make(tmp_path / "b.zarr", _data((4, 4), "<u2"), chunks=(2, 2), compressors=None,
               serializer=ShardingCodec(chunk_shape=(2, 2), index_codecs=[BytesCodec()]))
    shard = os.path.join(p2, "c", "0", "0")
    blob = bytearray(open(shard, "rb").read())
    blob[-16:-8] = (1 << 40).to_bytes(8, "little")  # the last entry's offset points past the end
    open(shard, "wb").write(bytes(blob))
    with pytest.raises(LayoutError, match=r"c/0/0.*outside the file"):
        layouts.index(p2)


def test_metadata_claiming_astronomical_chunk_counts_or_sizes_is_refused(tmp_path):
    p = _make(tmp_path / "a.zarr", _data((4, 4), "u1"), chunks=(2, 2))
    meta = json.loads(open(os.path.join(p, "zarr.json")).read())
    meta["shape"] = [10**9, 10**9]
    open(os.path.join(p, "zarr.json"), "w").write(json.dumps(meta))
    with pytest.raises(LayoutError, match="stored chunks, more than"):
        layouts.index(p)
    meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"] = [4, 4], [10**6, 10**6]
    open(os.path.join(p, "zarr.json"), "w").write(json.dumps(meta))
    with pytest.raises(LayoutError, match="too big to decode"):
        layouts.index(p)


def _mutations():
    text = st.text(alphabet=st.sampled_from('{}[]:,"0123456789-.eE nulltruefalseNaN'), max_size=12)
    return st.tuples(st.integers(0, 10_000), st.integers(0, 12), text)


@FUZZ
@given(fmt=st.sampled_from(["v2", "v3", "v3-shard"]), muts=st.lists(_mutations(), min_size=1, max_size=3))
def test_fuzzed_metadata_gives_layout_error_or_a_valid_index(fmt, muts):
    with tempfile.TemporaryDirectory() as d:
        kw = {"v2": dict(zarr_format=2, compressors=numcodecs.Zstd()), "v3": dict(compressors=ZstdCodec()),
              "v3-shard": dict(shards=(4, 4))}[fmt]
        p = _make(os.path.join(d, "a.zarr"), _data((5, 6), "<u2"), chunks=(2, 2), **kw)
        meta_file = os.path.join(p, ".zarray" if fmt == "v2" else "zarr.json")
        text = open(meta_file).read()
        for at, n, new in muts:
            at %= len(text) + 1
            text = text[:at] + new + text[at + n:]
        open(meta_file, "w").write(text)
        try:
            ix = layouts.index(p)
        except LayoutError as e:
            assert p in str(e)
        else:
            assert len(ix.specs) == int(np.prod(ix.numblocks))


_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=3),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
                         ["path", "type", "scale", "translation", "name", "unit", "datasets", "axes",
                          "coordinateTransformations", "version"]), inner, max_size=4), max_leaves=12)


@FUZZ
@given(ms=st.lists(_json, min_size=1, max_size=2), wrap=st.booleans())
def test_fuzzed_multiscales_attributes_give_layout_error_or_levels(ms, wrap):
    from gpulazy.layouts._ngff import multiscale_levels

    attrs = {"ome": {"version": "0.5", "multiscales": ms}} if wrap else {"multiscales": ms}
    try:
        levels = multiscale_levels(attrs, "root/zarr.json")
    except LayoutError as e:
        assert "root/zarr.json" in str(e)
    else:
        assert levels and all(isinstance(lv.path, str) for lv in levels)


# -- the conformance suite every layout passes ------------------------------------------------------

from gpulazy.testing import LayoutConformance  # noqa: E402


class TestZarrConformance(LayoutConformance):
    __test__ = True
    layout_name = "zarr"

    def make(self, tmp_path, array, **kw):
        path = tmp_path / "data.zarr"
        chunks = tuple(max(1, n // 2) for n in array.shape)  # several stored chunks per axis
        z = zarr.create_array(path, shape=array.shape, chunks=chunks, dtype=array.dtype, zarr_format=3, **kw)
        z[...] = array
        return str(path)

    def reference(self, path):
        return zarr.open_array(path, mode="r")[...]


class TestShardedZstdZarrConformance(TestZarrConformance):
    def make(self, tmp_path, array, **kw):
        path = tmp_path / "data.zarr"
        inner = tuple(max(1, n // 4) for n in array.shape)
        shards = tuple(2 * c for c in inner)
        z = zarr.create_array(path, shape=array.shape, chunks=inner, shards=shards, dtype=array.dtype,
                              zarr_format=3, compressors=ZstdCodec())
        z[...] = array
        return str(path)
