"""The HDF5 layout against h5py reading the same dataset (CPU path, random data)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpulazy
from gpulazy import layouts
from gpulazy.errors import ChunkDecodeError, ChunkReadError, LayoutError
from gpulazy.layouts.hdf5 import Hdf5Layout
from gpulazy.spec import Codec

h5py = pytest.importorskip("h5py")

DTYPES = ["u1", ">u2", "<i2", ">i4", "<u8", "<f4", ">f4", ">f8", "<c8", "?"]


def _random(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, shape, dtype=dt.newbyteorder("="), endpoint=True).astype(dt)


def _write(path, name="data", data=None, **kw):
    with h5py.File(path, "a") as f:
        f.create_dataset(name, data=data, **kw)
    return str(path)


def _reference(path, name="data"):
    with h5py.File(path, "r") as f:
        return f[name][()]


def _read(path, name="data", **kw):
    arr = gpulazy.from_files(path, dataset=name, device="cpu", cache=False, **kw)
    return arr, arr.compute()


def _assert_same(path, name="data", **kw):
    arr, got = _read(path, name, **kw)
    ref = _reference(path, name)
    assert got.dtype == ref.dtype.newbyteorder("=")
    assert got.shape == ref.shape
    np.testing.assert_array_equal(got, ref)
    return arr


# -- recognising files ---------------------------------------------------------------------------

@pytest.mark.parametrize("userblock", [0, 512, 4096])
def test_guess_by_signature_after_any_user_block(tmp_path, userblock):
    p = tmp_path / "x.dat"  # no .h5 extension: the signature alone decides
    with h5py.File(p, "w", userblock_size=userblock or None) as f:
        f["a"] = np.arange(3)
    assert Hdf5Layout.guess_can_open(str(p))
    assert layouts.guess_layout(str(p)).name == "hdf5"


def test_guess_rejects_other_files_and_never_raises(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros(3))
    (tmp_path / "empty.h5").write_bytes(b"")
    (tmp_path / "late.bin").write_bytes(b"\0" * 700 + b"\x89HDF\r\n\x1a\n")  # not at 0, 512, 1024...
    for name in ("a.npy", "empty.h5", "late.bin", "missing.h5"):
        assert not Hdf5Layout.guess_can_open(str(tmp_path / name))
    assert not Hdf5Layout.guess_can_open(str(tmp_path))


def test_registered_and_guessed_by_from_files(tmp_path):
    p = _write(tmp_path / "run.h5", "entry/data", np.arange(10, dtype="u2"))
    assert "hdf5" in layouts.layout_names()
    arr = gpulazy.from_files(p, device="cpu", cache=False)
    assert arr.chunk_index.layout == "hdf5"
    assert arr.compute().tolist() == list(range(10))


# -- contiguous datasets -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_dtypes_read_as_plain_ranges(tmp_path, dtype):
    p = _write(tmp_path / "c.h5", data=_random((5, 7), dtype))
    arr = _assert_same(p)
    ix = arr.chunk_index
    assert all(not s.tiles and s.codec is None for s in ix.specs.values())  # raw reads, no assembly
    assert ix.attrs["storage"] == "contiguous" and ix.attrs["name"] == "/data"


def test_contiguous_offset_includes_the_user_block(tmp_path):
    p = tmp_path / "ub.h5"
    with h5py.File(p, "w", userblock_size=1024) as f:
        f["data"] = _random((4, 5), ">f4")
    arr = _assert_same(str(p), chunks=(1, 5))
    assert arr.numblocks == (4, 1)


def test_scalar_and_empty_datasets(tmp_path):
    p = _write(tmp_path / "s.h5", "scalar", np.float64(2.5))
    _write(p, "empty", shape=(0, 5), dtype="<f4", chunks=(2, 2), maxshape=(None, 5))
    _assert_same(p, "scalar")
    arr = _assert_same(p, "empty")
    assert arr.shape == (0, 5)


def test_unallocated_contiguous_reads_the_fill_value(tmp_path):
    p = _write(tmp_path / "u.h5", shape=(3, 4), dtype=">i2", fillvalue=-7)
    arr = _assert_same(p)
    assert arr.chunk_index.attrs["storage"] == "unallocated"
    assert (arr.compute() == -7).all()


# -- chunked datasets ----------------------------------------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_chunked_against_h5py(tmp_path, data):
    ndim = data.draw(st.integers(1, 3), label="ndim")
    shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim), label="shape"))
    stored = tuple(data.draw(st.integers(1, n), label="chunk") for n in shape)
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    dask_chunks = data.draw(st.one_of(st.none(), st.tuples(*(st.integers(1, n) for n in shape))), label="chunks")
    holes = data.draw(st.booleans(), label="holes")
    p = str(tmp_path / f"{uuid.uuid4().hex}.h5")
    values = _random(shape, dtype, seed=data.draw(st.integers(0, 2**16), label="seed"))
    with h5py.File(p, "w") as f:
        d = f.create_dataset("data", shape=shape, dtype=dtype, chunks=stored, fillvalue=np.ones((), dtype)[()])
        if holes:  # write every other element along axis 0: some chunks stay unallocated
            d[::2] = values[::2]
        else:
            d[...] = values
    arr = _assert_same(p, chunks=dask_chunks)
    # every dask block is a union of whole stored chunks (an edge block may be clipped)
    for axis, (sizes, s, n) in enumerate(zip(arr.chunks, stored, shape)):
        edges = np.cumsum(sizes)
        assert all(e % s == 0 or e == n for e in edges), (axis, sizes, s)
    assert arr.chunk_index.attrs["stored_chunks"] == stored


FILTERS = {
    "gzip+shuffle": dict(compression="gzip", compression_opts=1, shuffle=True),
    "fletcher32": dict(fletcher32=True),
    "lzf": dict(compression="lzf"),
    "zstd": dict(compression=32015, compression_opts=(1,)),  # needs hdf5plugin to write
}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_filtered_chunks_against_h5py(tmp_path, data):
    name = data.draw(st.sampled_from(sorted(FILTERS)), label="filter")
    if name == "zstd":
        pytest.importorskip("hdf5plugin")
    ndim = data.draw(st.integers(1, 3), label="ndim")
    shape = tuple(data.draw(st.lists(st.integers(1, 8), min_size=ndim, max_size=ndim), label="shape"))
    stored = tuple(data.draw(st.integers(1, n), label="chunk") for n in shape)
    dtype = data.draw(st.sampled_from([">u2", "<i4", ">f4", "<f8"]), label="dtype")
    # lzf skips itself on chunks it cannot shrink: blocks must then be single chunks (tested above)
    free = name != "lzf"
    dask_chunks = data.draw(st.one_of(st.none(), st.tuples(*(st.integers(1, n) for n in shape))) if free
                            else st.none(), label="chunks")
    p = str(tmp_path / f"{uuid.uuid4().hex}.h5")
    values = _random(shape, dtype, seed=data.draw(st.integers(0, 2**16), label="seed"))
    values.reshape(-1)[::2] = 0  # half zeros: compressible, so most chunks are stored filtered
    _write(p, data=values, chunks=stored, **FILTERS[name])
    _assert_same(p, chunks=dask_chunks)


def test_whole_rows_of_raw_chunks_become_plain_ranges(tmp_path):
    p = _write(tmp_path / "r.h5", data=_random((12, 5), ">u2"), chunks=(3, 5))
    arr = _assert_same(p, chunks=(6, 5))
    for spec in arr.chunk_index.specs.values():
        assert not spec.tiles and spec.codec is None and len(spec.ranges) >= 1


def test_unallocated_chunks_are_the_fill_value(tmp_path):
    p = tmp_path / "sparse.h5"
    with h5py.File(p, "w") as f:
        d = f.create_dataset("data", shape=(10, 9), dtype="<f4", chunks=(4, 4), fillvalue=np.float32(3.5))
        d[0:4, 4:8] = _random((4, 4), "<f4")
    arr = _assert_same(str(p), chunks=(10, 9))
    (spec,) = arr.chunk_index.specs.values()
    assert sum(t.range is None for t in spec.tiles) == 8 and spec.fill_value == 3.5


# -- filters -------------------------------------------------------------------------------------

def test_gzip_shuffle_fletcher32_big_endian_and_edge_chunks(tmp_path):
    p = _write(tmp_path / "z.h5", data=_random((9, 7), ">f4"), chunks=(4, 3), compression="gzip",
               compression_opts=1, shuffle=True, fletcher32=True)
    arr = _assert_same(p)
    spec = next(iter(arr.chunk_index.specs.values()))
    assert spec.codec == (Codec.of("fletcher32"), Codec.of("zlib"), Codec.of("shuffle", elementsize=4))
    assert arr.chunk_index.attrs["codec"] == "fletcher32+zlib+shuffle"


def test_lzf_with_chunks_stored_unfiltered(tmp_path):
    # lzf gives up on incompressible chunks: HDF5 stores those raw and sets their filter mask.
    data = _random((8, 6), "<f8")
    data[:4] = 0  # the top chunks compress, the bottom ones do not
    p = _write(tmp_path / "lzf.h5", data=data, chunks=(4, 3), compression="lzf")
    with h5py.File(p) as f:
        masks = []
        f["data"].id.chunk_iter(lambda info: masks.append(info.filter_mask))
    assert set(masks) == {0, 1}
    arr = _assert_same(p)
    assert arr.chunks == ((4, 4), (3, 3))  # a block may not mix masks: one stored chunk each
    with pytest.raises(LayoutError, match="filters skipped.*chunks="):
        gpulazy.from_files(p, dataset="data", device="cpu", cache=False, chunks=(8, 6))
    _assert_same(p, chunks=(4, 6))  # rows of equally masked chunks are fine


def test_corrupt_chunk_fails_its_checksum(tmp_path):
    p = _write(tmp_path / "f.h5", data=_random((4, 4), "<i4"), chunks=(4, 4), fletcher32=True)
    with h5py.File(p) as f:
        info = f["data"].id.get_chunk_info(0)
    with open(p, "r+b") as fh:
        fh.seek(info.byte_offset + 3)
        byte = fh.read(1)
        fh.seek(info.byte_offset + 3)
        fh.write(bytes([byte[0] ^ 0xFF]))
    arr = gpulazy.from_files(p, dataset="data", device="cpu", cache=False)
    with pytest.raises(ChunkDecodeError, match="f.h5"):
        arr.compute()


@pytest.mark.parametrize("opts,dtype", [(("nn", 8), ">i2"), (("ec", 16), "<f4")], ids=["nn", "ec"])
def test_szip(tmp_path, opts, dtype):
    pytest.importorskip("imagecodecs")
    data = (_random((9, 20), "<u2") % 1000).astype(dtype)
    try:
        p = _write(tmp_path / "sz.h5", data=data, chunks=(4, 16), compression="szip", compression_opts=opts)
    except (ValueError, OSError) as e:
        pytest.skip(f"this h5py cannot write szip: {e}")
    arr = _assert_same(p)
    assert arr.chunk_index.attrs["codec"] == "imagecodecs_szip"


@pytest.mark.parametrize("deflate", [False, True], ids=["shuffle", "shuffle+deflate"])
def test_edge_chunks_stored_unfiltered_by_chunk_opts(tmp_path, deflate):
    # H5Pset_chunk_opts(DONT_FILTER_PARTIAL_CHUNKS): edge chunks raw, filter mask still 0.
    import ctypes

    lib = ctypes.CDLL(h5py.h5p.__file__)
    p = str(tmp_path / "pe.h5")
    with h5py.File(p, "w", libver="latest") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((4, 4))
        dcpl.set_shuffle()
        if deflate:
            dcpl.set_deflate(1)
        assert lib.H5Pset_chunk_opts(ctypes.c_int64(dcpl.id), ctypes.c_uint(2)) >= 0
        tid = h5py.h5t.py_create(np.dtype("<u2"))
        h5py.h5d.create(f.id, b"data", tid, h5py.h5s.create_simple((10, 9)), dcpl=dcpl)
        f["data"][...] = _random((10, 9), "<u2")
    arr = _assert_same(p)
    edge = [s for s in arr.chunk_index.specs.values() if s.index[0] == arr.numblocks[0] - 1]
    assert edge and all(s.codec is None for s in edge)


hdf5plugin_filters = [
    ("zstd", lambda m: m.Zstd(clevel=1), "zstd"),
    ("lz4", lambda m: m.LZ4(), "imagecodecs_lz4h5"),
    ("blosc", lambda m: m.Blosc(cname="lz4", clevel=1, shuffle=m.Blosc.SHUFFLE), "blosc"),
]


@pytest.mark.parametrize("name,make,codec", hdf5plugin_filters, ids=[f[0] for f in hdf5plugin_filters])
def test_plugin_filters(tmp_path, name, make, codec):
    hdf5plugin = pytest.importorskip("hdf5plugin")
    if codec.startswith("imagecodecs_"):
        pytest.importorskip("imagecodecs")
    data = np.repeat(_random((6, 1, 40), "<u2"), 4, axis=1)  # compressible: stored filtered
    p = _write(tmp_path / f"{name}.h5", data=data, chunks=(4, 4, 32), **make(hdf5plugin))
    arr = _assert_same(p)
    spec = next(iter(arr.chunk_index.specs.values()))
    assert spec.codec[0].id == codec


def test_blosc_chunks_stored_raw_decode_without_it(tmp_path):
    hdf5plugin = pytest.importorskip("hdf5plugin")
    # blosc cannot shrink a 24-byte chunk: every chunk is stored with the filter skipped
    p = _write(tmp_path / "b.h5", data=_random((10, 10), "<u2"), chunks=(4, 3), **hdf5plugin.Blosc())
    arr = _assert_same(p)
    assert all(s.codec is None for s in arr.chunk_index.specs.values())


@pytest.mark.parametrize("kw,fid,fname", [
    (dict(scaleoffset=0), 6, "scaleoffset"),
    (dict(compression=32008, compression_opts=(0, 0)), 32008, "bitshuffle"),  # without LZ4 (with it: opens)
])
def test_unsupported_filter_names_file_dataset_and_filter(tmp_path, kw, fid, fname):
    if fid == 32008:
        pytest.importorskip("hdf5plugin")
    p = _write(tmp_path / "u.h5", "grp/data", np.arange(64, dtype="<i4").reshape(8, 8), chunks=(4, 4), **kw)
    with pytest.raises(LayoutError, match=rf"'/grp/data' of .*u\.h5.*filter {fid} \({fname}\)"):
        layouts.index(p, dataset="/grp/data")


def test_missing_imagecodecs_says_what_to_install(tmp_path, monkeypatch):
    from gpulazy.codecs import host

    p = _write(tmp_path / "lzf.h5", data=np.zeros((8, 8)), chunks=(4, 4), compression="lzf")
    monkeypatch.setitem(sys.modules, "imagecodecs", None)
    host._build.cache_clear()
    try:
        with pytest.raises(LayoutError, match=r"filter 32000 \(lzf\).*pip install imagecodecs"):
            layouts.index(p, dataset="data")
    finally:
        host._build.cache_clear()


def test_every_storage_on_each_device(tmp_path, device):
    """Contiguous, chunked with holes, gzip+shuffle+fletcher32 big-endian and lzf with masks."""
    from conftest import to_host

    pytest.importorskip("imagecodecs")  # lzf decodes with imagecodecs (the formats/dev extras)

    p = str(tmp_path / "all.h5")
    half = _random((8, 6), ">f4")
    half[:4] = 0  # lzf shrinks the top chunks only
    with h5py.File(p, "w") as f:
        f["contiguous"] = _random((5, 7), ">u2")
        holes = f.create_dataset("holes", shape=(9, 8), dtype="<i2", chunks=(4, 4), fillvalue=-1)
        holes[:4] = _random((4, 8), "<i2")
        f.create_dataset("gzip", data=_random((9, 7), ">f8"), chunks=(4, 3), compression="gzip",
                         compression_opts=1, shuffle=True, fletcher32=True)
        f.create_dataset("lzf", data=half, chunks=(4, 3), compression="lzf")
    for name in ("contiguous", "holes", "gzip", "lzf"):
        arr = gpulazy.from_files(p, dataset=name, device=device, cache=False)
        np.testing.assert_array_equal(to_host(arr.compute()), _reference(p, name), err_msg=name)


# -- choosing the dataset ------------------------------------------------------------------------

def test_dataset_is_optional_when_the_file_holds_one_array(tmp_path):
    p = tmp_path / "one.h5"
    with h5py.File(p, "w") as f:
        f["entry/data"] = _random((3, 4), "<u2")
        f["entry/title"] = b"a string"
        f["entry/count"] = 3  # a scalar is not an array
    ix = layouts.index(str(p))
    assert ix.attrs["name"] == "/entry/data" and ix.shape == (3, 4)


def test_several_datasets_or_an_unknown_one_are_listed(tmp_path):
    p = str(tmp_path / "two.h5")
    _write(p, "a", np.zeros((2, 3), "u1"))
    _write(p, "g/b", np.zeros(5, ">f8"))
    with pytest.raises(LayoutError, match=r"2 numeric array datasets.*dataset=.*/a \(2, 3\) uint8.*/g/b \(5,\) >f8"):
        layouts.index(p)
    with pytest.raises(LayoutError, match=r"no dataset 'nope'.*/a \(2, 3\) uint8, /g/b"):
        layouts.index(p, dataset="nope")
    with pytest.raises(LayoutError, match=r"'g' in .* is a group"):
        layouts.index(p, dataset="g")


def test_storage_that_has_no_byte_range_is_refused_clearly(tmp_path):
    p = str(tmp_path / "odd.h5")
    (tmp_path / "ext.raw").write_bytes(bytes(range(4)))
    with h5py.File(p, "w") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        h5py.h5d.create(f.id, b"compact", h5py.h5t.NATIVE_INT32, h5py.h5s.create_simple((4,)), dcpl=dcpl)
        f.create_dataset("ext", shape=(4,), dtype="u1", external=[(str(tmp_path / "ext.raw"), 0, 4)])
        lay = h5py.VirtualLayout(shape=(4,), dtype="u1")
        lay[:] = h5py.VirtualSource("src.h5", "x", shape=(4,))
        f.create_virtual_dataset("virt", lay)
        f["text"] = np.array([b"ab", b"cd"])
    for name, match in [("compact", "stored compact"), ("ext", r"external file.*ext\.raw', 0, 4"),
                        ("virt", r"virtual dataset.*src\.h5"), ("text", "S2.*not supported")]:
        with pytest.raises(LayoutError, match=match) as e:
            layouts.index(p, dataset=name)
        assert "odd.h5" in str(e.value)


def test_external_link_reads_the_target_file(tmp_path):
    _write(tmp_path / "target.h5", "d", _random((6, 5), ">u2"), chunks=(2, 5))
    p = str(tmp_path / "links.h5")
    with h5py.File(p, "w") as f:
        f["entry/data"] = h5py.ExternalLink("target.h5", "/d")  # found beside the linking file
    arr = _assert_same(p, "entry/data")
    assert [os.path.basename(q) for q in arr.chunk_index.paths] == ["target.h5"]


def test_options_are_checked(tmp_path):
    p = _write(tmp_path / "o.h5", data=np.zeros((2, 3), "<i2"))
    with pytest.raises(TypeError, match="offset"):
        layouts.index(p, dataset="data", offset=8)
    with pytest.raises(LayoutError, match="'<i2', not the requested"):
        layouts.index(p, dataset="data", dtype="f4")
    with pytest.raises(LayoutError, match=r"shape \(2, 3\), not the requested"):
        layouts.index(p, dataset="data", shape=(3, 2))
    assert layouts.index(p, dataset="data", dtype="<i2", shape=(2, 3)).shape == (2, 3)


def test_file_held_open_by_the_caller(tmp_path):
    p = _write(tmp_path / "open.h5", data=_random((3, 3), "<u2"))
    with h5py.File(p, "r") as f:  # HDF5 shares one handle per file; its locking flags must match
        _, got = _read(p)
        np.testing.assert_array_equal(got, f["data"][()])


# -- several files -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, dict(chunks=(2, 3), compression="gzip", compression_opts=1)],
                         ids=["contiguous", "gzip"])
def test_files_stack_along_a_new_axis(tmp_path, kw):
    parts = [_random((5, 4), ">i4", seed=i) for i in range(3)]
    for i, part in enumerate(parts):
        _write(tmp_path / f"scan{i}.h5", "d", part, fillvalue=9, **kw)
    with h5py.File(tmp_path / "scan1.h5", "a") as f:
        if kw:  # one file with unallocated chunks
            del f["d"]
            f.create_dataset("d", shape=(5, 4), dtype=">i4", fillvalue=9, **kw)
            parts[1] = np.full((5, 4), 9, ">i4")
    arr = gpulazy.from_files(str(tmp_path / "scan*.h5"), dataset="d", device="cpu", cache=False)
    assert arr.shape == (3, 5, 4) and arr.chunk_index.stacked
    np.testing.assert_array_equal(arr.compute(), np.stack(parts))
    np.testing.assert_array_equal(arr[:, 1:4, 2].compute(), np.stack(parts)[:, 1:4, 2])


def test_stacked_files_must_agree(tmp_path):
    a = _write(tmp_path / "a.h5", "d", np.zeros((5, 4), "<u2"))
    b = _write(tmp_path / "b.h5", "d", np.zeros((5, 3), "<u2"))
    c = _write(tmp_path / "c.h5", "d", np.zeros((5, 4), "<u2"), chunks=(5, 2))
    with pytest.raises(LayoutError, match=r"b\.h5.*shape \(5, 3\).*a\.h5"):
        layouts.index([a, b], dataset="d")
    with pytest.raises(LayoutError, match=r"c\.h5.*storage 'chunked'"):
        layouts.index([a, c], dataset="d")
    renamed = _write(tmp_path / "r.h5", "other", np.zeros((5, 4), "<u2"))
    with pytest.raises(LayoutError, match=r"r\.h5.*name '/other'.*'/d'"):
        layouts.index([a, renamed])  # each file's one array, but not the same dataset
    e = _write(tmp_path / "e.h5", "d", shape=(5, 4), dtype="<u2", chunks=(5, 2), fillvalue=1)
    with pytest.raises(LayoutError, match=r"c\.h5.*fill_value 0 .*e\.h5.* 1"):
        layouts.index([e, c], dataset="d")


# -- bad input -----------------------------------------------------------------------------------

def test_truncated_file_names_it(tmp_path):
    p = _write(tmp_path / "t.h5", data=_random((64, 64), "<f8"))
    size = os.path.getsize(p)
    with open(p, "r+b") as fh:
        fh.truncate(size - 1000)
    with pytest.raises(LayoutError, match=r"t\.h5.*(truncated|beyond the end)"):
        layouts.index(p, dataset="data")


def test_corrupt_superblock_names_the_file(tmp_path):
    p = _write(tmp_path / "s.h5", data=np.zeros(4))
    with open(p, "r+b") as fh:
        fh.seek(8)
        fh.write(b"\xff" * 16)
    assert Hdf5Layout.guess_can_open(p)  # the signature is intact
    with pytest.raises(LayoutError, match=r"s\.h5"):
        layouts.index(p, dataset="data")


def test_implausible_chunk_count_is_refused(tmp_path):
    p = _write(tmp_path / "big.h5", shape=(10**9, 10**6), dtype="u1", chunks=(1, 1))
    with pytest.raises(LayoutError, match="stored chunks"):
        layouts.index(p, dataset="data")


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    p = d / "base.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("c", data=_random((6, 5), "<u2"))
        f.create_dataset("k", data=_random((7, 6), "<i4", seed=1), chunks=(3, 4), compression="gzip",
                         compression_opts=1, shuffle=True, fletcher32=True)
        f.create_dataset("r", data=_random((5, 4), ">f4", seed=2), chunks=(2, 4))
    return d, p.read_bytes(), {n: _reference(p, n) for n in ("c", "k", "r")}


_REFERENCE = """
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "r") as f:
    np.save(sys.argv[2], f[sys.argv[3]][()])
"""


def _reference_isolated(path, name, tmp):
    """h5py's reading of a corrupt file, in a child process (HDF5 may scribble on its heap)."""
    out = os.path.join(tmp, "ref.npy")
    done = subprocess.run([sys.executable, "-c", _REFERENCE, path, out, name], capture_output=True, timeout=60)
    return np.load(out) if done.returncode == 0 else None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_files_give_a_layout_error_or_the_right_data(fuzz_base, data):
    folder, base, originals = fuzz_base
    blob = bytearray(base)
    if data.draw(st.booleans(), label="truncate"):
        blob = blob[:data.draw(st.integers(0, len(blob) - 1), label="size")]
    else:
        for _ in range(data.draw(st.integers(1, 4), label="count")):
            at = data.draw(st.integers(0, len(blob) - 1), label="at")
            blob[at] = data.draw(st.integers(0, 255), label="byte")
    p = str(folder / f"{uuid.uuid4().hex}.h5")
    with open(p, "wb") as fh:
        fh.write(blob)
    try:
        for name in ("c", "k", "r"):
            try:
                got = gpulazy.from_files(p, dataset=name, device="cpu", cache=False).compute()
            except LayoutError as e:
                assert p in str(e)
                continue
            except ChunkReadError as e:  # a corrupt chunk found while decoding
                assert e.path == p
                continue
            ref = originals[name]
            if got.shape != ref.shape or got.dtype != ref.dtype or not np.array_equal(got, ref):
                # what the corrupt file now says, as h5py reads it
                np.testing.assert_array_equal(got, _reference_isolated(p, name, str(folder)))
    finally:
        os.remove(p)


def test_index_reads_no_data_through_h5py(tmp_path, monkeypatch):
    p = _write(tmp_path / "n.h5", data=_random((8, 8), "<u2"), chunks=(4, 4), compression="gzip")

    def refuse(*a, **k):
        raise AssertionError("the layout read data through h5py")

    monkeypatch.setattr(h5py.Dataset, "__getitem__", refuse)
    monkeypatch.setattr(h5py.Dataset, "read_direct", refuse)
    ix = layouts.index(p, dataset="data")
    assert math.prod(ix.numblocks) == 1 and len(next(iter(ix.specs.values())).tiles) == 4


# -- the conformance suite every layout passes ------------------------------------------------------

from gpulazy.testing import LayoutConformance  # noqa: E402


class TestHdf5Conformance(LayoutConformance):
    __test__ = True
    layout_name = "hdf5"
    open_kwargs = {"dataset": "/data"}

    def make(self, tmp_path, array, **kw):
        path = tmp_path / "data.h5"
        chunks = tuple(max(1, n // 2) for n in array.shape)  # several stored chunks per axis
        with h5py.File(path, "w") as f:
            f.create_dataset("data", data=array, chunks=chunks, **kw)
        return str(path)

    def reference(self, path):
        with h5py.File(path, "r") as f:
            return f["data"][()]


class TestGzipHdf5Conformance(TestHdf5Conformance):
    def make(self, tmp_path, array, **kw):
        return super().make(tmp_path, array, compression="gzip", shuffle=True, **kw)


@pytest.mark.parametrize("chunk, copy", [((1, 31, 28), -1), ((1, 20, 24), -1), ((2, 39, 44), -1)])
def test_a_chunk_index_key_hdf5s_lookup_misses_is_a_layout_error(tmp_path, chunk, copy):
    """A chunk key of the index changed (here its first coordinate 1 -> 0, in the leaf: the key's last
    copy in the file) lists the chunk where h5py's reads find none and read the fill value; gpulazy
    read the chunk's bytes there (found by fuzzing). Every listed chunk is looked up at open."""
    import struct

    path = tmp_path / "a.h5"
    shape = (3, 40, 48)
    data = (np.arange(np.prod(shape)) % 200 + 1).astype("<f4").reshape(shape)
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("data", shape=shape, dtype="<f4", chunks=(1, 1, 4), fillvalue=0)
        ds[1:, 20:, 24:] = data[1:, 20:, 24:]  # some chunks never allocated
    blob = bytearray(path.read_bytes())
    key = struct.pack("<4Q", *chunk, 0)  # a v1 B-tree chunk key's coordinates (and the element axis)
    where = [i for i in range(len(blob) - len(key)) if blob.startswith(key, i)]
    assert where, "another HDF5 version laid the index out otherwise"
    struct.pack_into("<Q", blob, where[copy], 0)
    path.write_bytes(bytes(blob))
    with h5py.File(path, "r") as f:
        assert (f["data"][0] == 0).all()  # h5py: position 0 was never written, and still reads as fill
    with pytest.raises(LayoutError) as info:
        gpulazy.from_files(str(path), dataset="/data", device="cpu", cache=False)
    assert str(path) in str(info.value) and "HDF5's own lookup does not find" in str(info.value)
