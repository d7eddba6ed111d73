"""Layouts: path resolution, chunking, byte ranges, raw and npy indexing (no data reads)."""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpulazy
from gpulazy import layouts
from gpulazy.errors import ConfigError, LayoutError, NoFilesError
from gpulazy.layouts._common import c_ranges, default_chunks, natural_key, normalize_chunks, slab_sizes

MiB = 1 << 20


def _touch(path, nbytes=0):
    with open(path, "wb") as f:
        f.write(b"\0" * nbytes)
    return str(path)


# -- paths ----------------------------------------------------------------------------------

def test_natural_sort_puts_z2_before_z10():
    names = ["z10.raw", "z2.raw", "z1.raw", "a.raw", "z100.raw"]
    assert sorted(names, key=natural_key) == ["a.raw", "z1.raw", "z2.raw", "z10.raw", "z100.raw"]


def test_glob_is_naturally_sorted_and_skips_directories(tmp_path):
    for i in (10, 2, 1):
        _touch(tmp_path / f"z{i}.raw")
    (tmp_path / "z5.raw").mkdir()  # a directory matching the glob is not a file
    got = layouts.resolve_paths(str(tmp_path / "z*.raw"))
    assert [os.path.basename(p) for p in got] == ["z1.raw", "z2.raw", "z10.raw"]


def test_directory_lists_regular_non_hidden_files(tmp_path):
    for name in ("b3", "b20", ".hidden", "a"):
        _touch(tmp_path / name)
    (tmp_path / "sub").mkdir()
    got = layouts.resolve_paths(tmp_path)
    assert [os.path.basename(p) for p in got] == ["a", "b3", "b20"]


def test_sequence_keeps_its_order_and_one_file_is_a_list(tmp_path):
    a, b = _touch(tmp_path / "a"), _touch(tmp_path / "b")
    assert layouts.resolve_paths([b, a]) == [b, a]
    assert layouts.resolve_paths(a) == [a]


def test_no_match_names_the_pattern(tmp_path):
    pattern = str(tmp_path / "nothing*.raw")
    with pytest.raises(NoFilesError, match="nothing\\*.raw"):
        layouts.resolve_paths(pattern)
    with pytest.raises(FileNotFoundError, match="missing.raw"):
        layouts.resolve_paths(str(tmp_path / "missing.raw"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoFilesError, match="empty"):
        layouts.resolve_paths(tmp_path / "empty")
    with pytest.raises(NoFilesError, match="empty"):
        layouts.resolve_paths([])


def test_directory_where_a_file_is_expected(tmp_path):
    a = _touch(tmp_path / "a")
    (tmp_path / "d").mkdir()
    with pytest.raises(LayoutError, match="is a directory"):
        layouts.resolve_paths([a, str(tmp_path / "d")])


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_is_a_clear_error(tmp_path):
    p = _touch(tmp_path / "secret.raw", 8)
    os.chmod(p, 0)
    try:
        with pytest.raises(NoFilesError, match="secret.raw.*not readable"):
            layouts.resolve_paths(p)
    finally:
        os.chmod(p, 0o600)


# -- chunking -------------------------------------------------------------------------------

def test_slab_sizes_whole_planes_along_axis_0():
    # 1000 planes of 1 MiB with a 128 MiB target: 128 planes per chunk.
    assert slab_sizes((1000, 512, 1024), 2, 128 * MiB) == (128, 512, 1024)
    # Everything fits: one chunk.
    assert slab_sizes((10, 10), 8, 128 * MiB) == (10, 10)
    # A plane bigger than the target: one plane per chunk, rows along axis 1.
    assert slab_sizes((4, 100_000, 1000), 4, 128 * MiB) == (1, 33554, 1000)


def test_default_chunks_are_even_and_near_the_target():
    chunks = default_chunks((1000, 512, 1024), 2, target=128 * MiB)
    assert chunks[1:] == ((512,), (1024,))
    sizes = [c * MiB for c in chunks[0]]
    assert sum(chunks[0]) == 1000
    assert all(64 * MiB <= s <= 256 * MiB for s in sizes)
    assert max(chunks[0]) - min(chunks[0]) <= 1  # evened out: 8 chunks of 125


def test_default_chunks_follow_config_chunk_size():
    with gpulazy.config.set(chunk_size="4 MiB"):
        assert default_chunks((64, 1024, 1024), 1) == ((4,) * 16, (1024,), (1024,))


def test_default_chunks_fortran_order_slabs_along_last_axis():
    chunks = default_chunks((1024, 1024, 64), 1, order="F", target=4 * MiB)
    assert chunks == ((1024,), (1024,), (4,) * 16)


def test_default_chunks_fortran_stack_one_file_per_block():
    chunks = default_chunks((5, 8, 8), 4, order="F", stacked=True, target=128 * MiB)
    assert chunks == ((1,) * 5, (8,), (8,))


def test_user_chunks_dask_style():
    dt = np.dtype("u2")
    assert normalize_chunks(2, (5, 4), dt) == ((2, 2, 1), (2, 2))
    assert normalize_chunks((3, -1), (5, 4), dt) == ((3, 2), (4,))
    assert normalize_chunks({1: 3}, (5, 4), dt) == ((5,), (3, 1))
    assert normalize_chunks({-1: 3}, (5, 4), dt) == ((5,), (3, 1))
    assert normalize_chunks("auto", (5, 4), dt) == ((5,), (4,))
    assert normalize_chunks(((1, 4), (4,)), (5, 4), dt) == ((1, 4), (4,))
    with pytest.raises(LayoutError, match="axes"):
        normalize_chunks({3: 1}, (5, 4), dt)
    with pytest.raises(LayoutError, match="add up to 2, not 5"):
        normalize_chunks(((1, 1), (4,)), (5, 4), dt)


def test_fortran_stack_forces_one_file_per_block():
    assert normalize_chunks(3, (5, 4), np.dtype("u1"), order="F", stacked=True) == ((1,) * 5, (3, 1))


# -- byte ranges ----------------------------------------------------------------------------

@st.composite
def _blocks(draw):
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    start, stop = [], []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a + 1, n))
        start.append(a)
        stop.append(b)
    itemsize = draw(st.sampled_from([1, 2, 4, 8, 16]))
    return shape, start, stop, itemsize


@settings(max_examples=200, deadline=None)
@given(_blocks())
def test_c_ranges_are_exactly_the_block_bytes_in_c_order(block):
    shape, start, stop, itemsize = block
    runs = c_ranges(shape, start, stop, itemsize)
    # Every byte of the block, in C order, from NumPy's own indexing.
    elems = np.arange(math.prod(shape)).reshape(shape)[tuple(slice(a, b) for a, b in zip(start, stop))]
    want = (elems.ravel()[:, None] * itemsize + np.arange(itemsize)).ravel()
    got = np.concatenate([np.arange(o, o + n) for o, n in runs]) if runs else np.array([], int)
    assert np.array_equal(got, want)
    # Coalesced: no run starts where the previous one ended.
    assert all(o1 + n1 != o2 for (o1, n1), (o2, _) in zip(runs, runs[1:]))


def test_c_ranges_contiguous_block_is_one_run():
    assert c_ranges((10, 4, 4), (2, 0, 0), (5, 4, 4), 2) == [(64, 96)]
    assert c_ranges((10, 4, 4), (2, 1, 0), (3, 3, 4), 2) == [(72, 16)]
    assert len(c_ranges((10, 4, 4), (0, 0, 1), (10, 4, 3), 1)) == 40


# -- raw ------------------------------------------------------------------------------------

def test_raw_index_single_file(tmp_path):
    p = _touch(tmp_path / "a.raw", 16 + 6 * 4 * 2)
    ix = layouts.index(p, dtype=">u2", shape=(6, 4), offset=16, chunks=(4, 4))
    assert ix.layout == "raw" and ix.shape == (6, 4) and ix.dtype == np.dtype("uint16")
    assert ix.dtype.isnative and ix.chunks == ((4, 2), (4,))
    s0, s1 = ix.specs[(0, 0)], ix.specs[(1, 0)]
    assert s0.dtype == ">u2" and s0.needs_byteswap and s0.shape == (4, 4)
    assert [(r.offset, r.nbytes) for r in s0.ranges] == [(16, 32)]
    assert [(r.offset, r.nbytes) for r in s1.ranges] == [(48, 16)]
    assert s0.identity[0][0] == p and s0.identity[0][1] == 64


def test_raw_stack_spans_files_in_order(tmp_path):
    paths = [_touch(tmp_path / f"s{i}.raw", 12) for i in range(5)]
    ix = layouts.index(paths, dtype="u1", shape=(3, 4), chunks=(2, 3, 4))
    assert ix.shape == (5, 3, 4) and ix.chunks == ((2, 2, 1), (3,), (4,)) and ix.stacked
    spec = ix.specs[(1, 0, 0)]
    assert [(r.path, r.offset, r.nbytes) for r in spec.ranges] == [(paths[2], 0, 12), (paths[3], 0, 12)]
    assert [i[0] for i in spec.identity] == paths[2:4]


def test_raw_stack_several_small_files_per_default_chunk(tmp_path):
    paths = [_touch(tmp_path / f"s{i}.raw", 1024) for i in range(40)]
    with gpulazy.config.set(chunk_size="10 KiB"):
        ix = layouts.index(paths, dtype="u1", shape=(32, 32))
    assert ix.chunks[1:] == ((32,), (32,))
    assert ix.chunks[0] == (10, 10, 10, 10)
    assert len(ix.specs[(0, 0, 0)].ranges) == 10


def test_raw_fortran_ranges_on_reversed_view(tmp_path):
    p = _touch(tmp_path / "f.raw", 3 * 4 * 5)
    ix = layouts.index(p, dtype="u1", shape=(3, 4, 5), order="F", chunks=(3, 4, 2))
    spec = ix.specs[(0, 0, 1)]
    assert spec.order == "F" and spec.shape == (3, 4, 2)
    assert [(r.offset, r.nbytes) for r in spec.ranges] == [(24, 24)]  # planes 2..3 of the last axis


def test_raw_shape_defaults_to_1d(tmp_path):
    p = _touch(tmp_path / "a.raw", 40)
    assert layouts.index(p, dtype="f4").shape == (10,)
    assert layouts.index(p, dtype="f4", offset=8).shape == (8,)
    with pytest.raises(LayoutError, match="whole number"):
        layouts.index(p, dtype="f8", offset=4)


def test_raw_size_mismatch_names_file_expected_and_actual(tmp_path):
    good = _touch(tmp_path / "good.raw", 32)
    bad = _touch(tmp_path / "bad.raw", 30)
    with pytest.raises(LayoutError) as e:
        layouts.index([good, bad], dtype="u2", shape=(4, 4))
    msg = str(e.value)
    assert "bad.raw" in msg and "30 bytes" in msg and "32 were expected" in msg


def test_raw_header_hint(tmp_path):
    p = _touch(tmp_path / "h.raw", 512 + 64)
    with pytest.raises(LayoutError, match="offset=512"):
        layouts.index(p, dtype="u1", shape=(8, 8))


def test_unknown_dtype_lists_valid_examples(tmp_path):
    p = _touch(tmp_path / "a.raw", 8)
    with pytest.raises(LayoutError, match="unknown dtype 'uint17'.*uint16"):
        layouts.index(p, dtype="uint17")
    with pytest.raises(LayoutError, match="not supported"):
        layouts.index(p, dtype=object)
    with pytest.raises(LayoutError, match="not supported"):
        layouts.index(p, dtype=[("a", "u1")])


def test_bad_options(tmp_path):
    p = _touch(tmp_path / "a.raw", 8)
    with pytest.raises(LayoutError, match="order"):
        layouts.index(p, dtype="u1", order="X")
    with pytest.raises(LayoutError, match="offset"):
        layouts.index(p, dtype="u1", offset=-1)
    with pytest.raises(LayoutError, match="shape"):
        layouts.index(p, dtype="u1", shape=(-1, 8))


def test_unrecognised_file_without_dtype(tmp_path):
    p = _touch(tmp_path / "mystery.bin", 8)
    with pytest.raises(LayoutError, match="mystery.bin.*dtype="):
        layouts.index(p)


# -- npy ------------------------------------------------------------------------------------

def _save(path, arr, version=None):
    with open(path, "wb") as f:
        np.lib.format.write_array(f, arr, version=version)
    return str(path)


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
@pytest.mark.parametrize("fortran", [False, True])
def test_npy_header_versions_and_order(tmp_path, version, fortran):
    arr = np.arange(60, dtype=">f8").reshape(3, 4, 5)
    if fortran:
        arr = np.asfortranarray(arr)
    p = _save(tmp_path / "a.npy", arr, version)
    assert layouts.layout_class("npy").guess_can_open(p)
    ix = layouts.index(p)
    assert ix.layout == "npy" and ix.shape == (3, 4, 5) and ix.dtype == np.dtype("float64")
    assert ix.order == ("F" if fortran else "C")
    header = os.path.getsize(p) - arr.nbytes
    assert ix.specs[(0, 0, 0)].ranges[0].offset == header


def test_npy_stack_checks_every_file(tmp_path):
    a = _save(tmp_path / "a0.npy", np.zeros((2, 3), "u2"))
    b = _save(tmp_path / "a1.npy", np.zeros((2, 3), "u2"))
    assert layouts.index(str(tmp_path / "a*.npy")).shape == (2, 2, 3)
    odd = _save(tmp_path / "a2.npy", np.zeros((2, 4), "u2"))
    with pytest.raises(LayoutError, match="a2.npy.*shape"):
        layouts.index([a, b, odd])
    odd = _save(tmp_path / "a2.npy", np.zeros((2, 3), "i2"))
    with pytest.raises(LayoutError, match="a2.npy.*dtype"):
        layouts.index([a, b, odd])
    odd = _save(tmp_path / "a2.npy", np.asfortranarray(np.zeros((2, 3), "u2")))
    with pytest.raises(LayoutError, match="a2.npy.*fortran_order"):
        layouts.index([a, b, odd])


def test_npy_rejects_object_and_structured(tmp_path):
    p = tmp_path / "o.npy"
    np.save(p, np.array([1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(LayoutError, match="o.npy.*object"):
        layouts.index(p)
    p = _save(tmp_path / "s.npy", np.zeros(3, dtype=[("a", "u1"), ("b", "f4")]))
    with pytest.raises(LayoutError, match="s.npy"):
        layouts.index(p)


def test_npy_truncated_and_mismatched_requests(tmp_path):
    p = _save(tmp_path / "t.npy", np.zeros((4, 4), "f4"))
    assert layouts.index(p, dtype="float32", shape=(4, 4)).shape == (4, 4)
    with pytest.raises(LayoutError, match="t.npy.*requested"):
        layouts.index(p, dtype="u2")
    with pytest.raises(LayoutError, match="t.npy.*requested"):
        layouts.index(p, shape=(16,))
    with pytest.raises(LayoutError, match="offset=4.*t.npy"):
        layouts.index(p, offset=4)
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 4)
    with pytest.raises(LayoutError, match="t.npy.*truncated"):
        layouts.index(p)


def test_npy_can_be_read_raw_when_asked(tmp_path):
    p = _save(tmp_path / "r.npy", np.zeros(4, "u1"))
    ix = layouts.index(p, layout="raw", dtype="u1")
    assert ix.layout == "raw" and ix.shape == (os.path.getsize(p),)


# -- registry -------------------------------------------------------------------------------

def test_registry_table_and_errors():
    assert layouts.layout_names()[:2] == ["npy", "raw"]
    assert layouts.layout_class("raw").name == "raw"
    assert isinstance(layouts.get_layout("npy"), layouts.Layout)
    with pytest.raises(ConfigError, match="unknown layout 'tiff2'.*'npy'"):
        layouts.layout_class("tiff2")


def test_guess_can_open_reads_only_magic_and_never_raises(tmp_path):
    npy = layouts.layout_class("npy")
    assert not npy.guess_can_open(str(tmp_path / "missing.npy"))
    assert not npy.guess_can_open(_touch(tmp_path / "zeros.npy", 100))
    assert not layouts.layout_class("raw").guess_can_open(_touch(tmp_path / "x.raw", 4))


# -- every byte once ------------------------------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), nfiles=st.integers(1, 3),
       order=st.sampled_from("CF"), offset=st.integers(0, 9), itemsize=st.sampled_from([1, 2, 8]),
       data=st.data())
def test_specs_cover_every_byte_exactly_once(shape, nfiles, order, offset, itemsize, data):
    with tempfile.TemporaryDirectory() as d:
        nbytes = offset + math.prod(shape) * itemsize
        paths = [_touch(os.path.join(d, f"f{i}.raw"), nbytes) for i in range(nfiles)]
        full = (nfiles,) + tuple(shape)  # a list stacks, even of one file
        chunks = tuple(data.draw(st.integers(1, n)) for n in full)
        ix = layouts.index(paths, dtype=f"u{itemsize}", shape=tuple(shape), offset=offset, order=order,
                           chunks=chunks)
        seen = {p: np.zeros(nbytes, int) for p in paths}
        for idx, spec in ix.specs.items():
            assert spec.index == idx
            assert spec.nbytes == spec.out_nbytes == math.prod(spec.shape) * itemsize
            for r in spec.ranges:
                seen[r.path][r.offset:r.offset + r.nbytes] += 1
        for counts in seen.values():
            assert (counts[:offset] == 0).all() and (counts[offset:] == 1).all()
        assert ix.shape == full and tuple(map(sum, ix.chunks)) == full


def test_index_token_is_stable_and_follows_file_identity(tmp_path):
    p = _touch(tmp_path / "a.raw", 64)
    t1 = layouts.index(p, dtype="u1", chunks=8).token()
    assert layouts.index(p, dtype="u1", chunks=8).token() == t1
    assert layouts.index(p, dtype="u1", chunks=16).token() != t1
    st_ = os.stat(p)
    os.utime(p, ns=(st_.st_atime_ns, st_.st_mtime_ns + 1_000_000))
    assert layouts.index(p, dtype="u1", chunks=8).token() != t1


def test_import_is_light():
    import subprocess
    import sys

    code = ("import sys, gpulazy.layouts, gpulazy.layouts.raw, gpulazy.layouts.npy; "
            "print(sorted(m for m in ('cupy', 'kvikio', 'distributed', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


