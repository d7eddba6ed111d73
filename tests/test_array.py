"""from_files / read_file / read_files: values equal NumPy's reading of the same files."""

from __future__ import annotations

import math
import os
import pickle
import tempfile
import time

import dask
import dask.array as da
import numpy as np
import pytest
from dask.base import tokenize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpulazy
from gpulazy.array import ChunkSource, GpulazyArray, load_chunk
from gpulazy.cache import DeviceCache
from gpulazy.errors import LayoutError

from conftest import to_host

# Random bytes read as these dtypes cover every bit pattern (NaNs, subnormals, ...).
DTYPES = ["u1", "i1", "<u2", ">u2", "<i4", ">i4", "<f4", ">f4", "<f8", ">f8", "<c8", ">c8", "<c16", ">c16",
          ">i8", "<u8"]


def _bytes_equal(got, want) -> bool:
    got, want = np.ascontiguousarray(to_host(got)), np.ascontiguousarray(want)
    return got.shape == want.shape and got.dtype == want.dtype and got.tobytes() == want.tobytes()


def _native(a: np.ndarray) -> np.ndarray:
    return a.astype(a.dtype.newbyteorder("="))


def write_raw(d, nfiles, shape, dtype, offset, rng, order="C"):
    """Files of random bytes; returns (paths, what NumPy reads from them, native)."""
    dt = np.dtype(dtype)
    paths, arrays = [], []
    nbytes = math.prod(shape) * dt.itemsize
    for i in range(nfiles):
        p = os.path.join(d, f"f{i}.raw")
        with open(p, "wb") as f:
            f.write(rng.integers(0, 256, offset, dtype=np.uint8).tobytes())
            f.write(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())
        paths.append(p)
        arrays.append(np.fromfile(p, dtype=dt, offset=offset).reshape(shape, order=order))
    want = arrays[0] if nfiles == 1 else np.stack(arrays)
    return paths, _native(want)


# -- equality, hypothesis ---------------------------------------------------------------------

@st.composite
def _cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    nfiles = draw(st.integers(1, 3))
    full = ((nfiles,) if nfiles > 1 else ()) + shape
    chunks = draw(st.one_of(
        st.none(),
        st.tuples(*(st.integers(1, n) for n in full)),
        st.integers(1, 4),
        st.fixed_dictionaries({0: st.integers(1, full[0])}),
    ))
    return dict(shape=shape, nfiles=nfiles, chunks=chunks, dtype=draw(st.sampled_from(DTYPES)),
                order=draw(st.sampled_from("CF")), offset=draw(st.integers(0, 33)), seed=draw(st.integers(0, 99)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_raw_equals_numpy(case):
    rng = np.random.default_rng(case["seed"])
    with tempfile.TemporaryDirectory() as d:
        paths, want = write_raw(d, case["nfiles"], case["shape"], case["dtype"], case["offset"], rng,
                                case["order"])
        src = paths if case["nfiles"] > 1 else paths[0]
        vol = gpulazy.from_files(src, shape=case["shape"], dtype=case["dtype"], offset=case["offset"],
                                 order=case["order"], chunks=case["chunks"], device="cpu", cache=False)
        assert vol.shape == want.shape and vol.dtype == want.dtype and vol.dtype.isnative
        fast = vol.compute()
        assert vol.compute_path == "fast"
        slow = vol.compute(scheduler="sync", optimize_graph=True)  # any other option: dask's way
        assert vol.compute_path == "dask"
        assert _bytes_equal(fast, want) and _bytes_equal(slow, want)
        # A derived array computes through dask too, chunk by chunk.
        assert _bytes_equal((vol[..., ::-1]).compute(), want[..., ::-1])


@st.composite
def _npy_cases(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    return dict(shape=shape, nfiles=draw(st.integers(1, 3)), dtype=draw(st.sampled_from(DTYPES + ["?"])),
                fortran=draw(st.booleans()), version=draw(st.sampled_from([(1, 0), (2, 0), (3, 0)])),
                chunks=draw(st.one_of(st.none(), st.integers(1, 3))), seed=draw(st.integers(0, 99)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_npy_cases())
def test_npy_equals_np_load(case):
    rng = np.random.default_rng(case["seed"])
    dt = np.dtype(case["dtype"])
    with tempfile.TemporaryDirectory() as d:
        paths, arrays = [], []
        for i in range(case["nfiles"]):
            raw = rng.integers(0, 2 if dt.kind == "b" else 256, math.prod(case["shape"]) * dt.itemsize,
                               dtype=np.uint8)
            arr = raw.view(dt).reshape(case["shape"])
            arr = np.asfortranarray(arr) if case["fortran"] else arr
            p = os.path.join(d, f"a{i}.npy")
            with open(p, "wb") as f:
                np.lib.format.write_array(f, arr, version=case["version"])
            paths.append(p)
            arrays.append(np.load(p))
        want = _native(np.stack(arrays))  # a glob stacks, even when it matches one file
        vol = gpulazy.from_files(os.path.join(d, "a*.npy"), chunks=case["chunks"], device="cpu", cache=False)
        assert vol.shape == want.shape and vol.dtype == want.dtype
        assert _bytes_equal(vol.compute(), want)
        assert _bytes_equal(vol.compute(scheduler="sync", optimize_graph=False), want)


def test_bool_and_wide_chunks_across_inner_axes(tmp_path):
    want = np.arange(4 * 6 * 10, dtype="<i2").reshape(4, 6, 10)
    p = tmp_path / "a.raw"
    want.tofile(p)
    vol = gpulazy.from_files(p, shape=want.shape, dtype="<i2", chunks={1: 4, 2: 3}, device="cpu", cache=False)
    assert vol.chunks == ((4,), (4, 2), (3, 3, 3, 1))
    assert np.array_equal(vol.compute(), want) and vol.compute_path == "fast"
    b = tmp_path / "b.raw"
    (want % 2 == 0).tofile(b)
    assert np.array_equal(gpulazy.from_files(b, dtype="?", device="cpu", cache=False).compute(),
                          (want % 2 == 0).ravel())


# -- the fast path ------------------------------------------------------------------------------

@pytest.fixture
def stack(tmp_path):
    rng = np.random.default_rng(0)
    paths, want = write_raw(str(tmp_path), 6, (5, 7), ">u2", 3, rng)
    return paths, want


def _vol(paths, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("cache", False)
    return gpulazy.from_files(paths, shape=(5, 7), dtype=">u2", offset=3, chunks=(2, 5, 7), **kw)


def test_fast_path_taken_only_for_plain_local_compute(stack):
    paths, want = stack
    vol = _vol(paths)
    assert isinstance(vol, GpulazyArray)
    for kw in ({}, {"scheduler": "threads"}, {"scheduler": "sync"}, {"scheduler": "single-threaded"}):
        assert np.array_equal(vol.compute(**kw), want) and vol.compute_path == "fast", kw
    with dask.config.set(scheduler="sync"):
        vol.compute()
        assert vol.compute_path == "fast"
    with dask.config.set(scheduler="processes"):
        assert np.array_equal(vol.compute(), want) and vol.compute_path == "dask"
    # Active callbacks (progress bars, the prefetcher) keep the fast path (tests/test_fastpath_callbacks.py).
    from dask.diagnostics import ProgressBar

    with ProgressBar(out=open(os.devnull, "w")):
        assert np.array_equal(vol.compute(), want) and vol.compute_path == "fast"
    # dask.compute and derived arrays are plain dask; a box off the chunk boundaries, a streamed
    # reduction and what is computed from a box keep a fast compute of their own.
    assert np.array_equal(dask.compute(vol)[0], want)
    assert type(vol + da.ones(vol.shape, dtype=vol.dtype, chunks=vol.chunks)) is da.Array  # (with another dask array)
    # (what is made of a streamed reduction is a gpulazy array with no fast path of its own: computed, the
    # reductions that read the same chunks share one read, ``share_reads``)
    scaled = vol.sum() * 1
    assert scaled.compute() == want.sum() and scaled.compute_path == "dask"
    twice = vol[1:] * 2
    assert np.array_equal(twice.compute(), want[1:] * 2) and twice.compute_path == "fast"
    total = vol.sum()
    assert total.compute() == want.sum() and total.compute_path == "fast"
    with dask.config.set(scheduler="processes"):
        assert total.compute() == want.sum() and total.compute_path == "dask"
    box = vol[1:]
    assert np.array_equal(box.compute(), want[1:]) and box.compute_path == "fast"
    assert box.chunk_index is None  # not the files' own chunks: no fast whole-array path of its own


def test_fast_path_reads_into_one_result_and_counts_reads(stack):
    paths, want = stack
    vol = _vol(paths)
    before = gpulazy.stats().snapshot()["bytes_read"]
    out = vol.compute()
    assert out.flags.c_contiguous and out.flags.owndata and out.shape == (6, 5, 7)
    assert gpulazy.stats().snapshot()["bytes_read"] - before == 6 * 5 * 7 * 2


@pytest.mark.parametrize("made", ["whole", "box", "list", "map", "reduction", "pair"])
def test_persist_reads_at_the_read_rate_into_one_array_of_dask_s_blocks(stack, made):
    """``persist()`` computes by the fast path once, and its blocks are views of that result under the
    array's own keys and chunks: what dask's ``persist`` gives, with every chunk read once."""
    paths, want = stack
    vol = _vol(paths)
    x, expected = {"whole": (vol, want), "box": (vol[1:5, 2:], want[1:5, 2:]),
                   "list": (vol[[5, 0, 1]], want[[5, 0, 1]]), "map": (vol.map_blocks(np.negative), -want),
                   "reduction": (vol.max(axis=0), want.max(axis=0)),
                   "pair": (vol[:2] - vol[4:], want[:2] - want[4:])}[made]
    before = gpulazy.stats().snapshot()["bytes_read"]
    held = x.persist()
    read = gpulazy.stats().snapshot()["bytes_read"] - before
    assert x.compute_path == "fast" and read <= want.nbytes
    with gpulazy.config.set(streamed_maps=False, fused_reductions=False):
        (theirs,) = dask.persist(x)  # dask's own: a task a block
    assert type(held) is da.Array and held.name == x.name == theirs.name and held.chunks == x.chunks
    assert set(held.__dask_keys__() if x.ndim == 0 else held.__dask_graph__()) == set(theirs.__dask_graph__())
    blocks = [held.__dask_graph__()[k] for k in sorted(held.__dask_graph__())]
    base = blocks[0].base if blocks[0].base is not None else blocks[0]
    assert all(np.shares_memory(b, base) for b in blocks)  # one allocation, views of it
    for key, block in held.__dask_graph__().items():
        np.testing.assert_array_equal(block, theirs.__dask_graph__()[key])
    before = gpulazy.stats().snapshot()["bytes_read"]
    np.testing.assert_array_equal(held.compute(), expected)
    assert gpulazy.stats().snapshot()["bytes_read"] == before  # (held: nothing read again)


@pytest.mark.gpu
def test_persist_on_the_gpu_holds_views_of_one_cupy_array(tmp_path):
    import cupy

    data = np.random.default_rng(3).integers(0, 999, (9, 40, 24)).astype("<u2")
    p = str(tmp_path / "v.raw")
    data.tofile(p)
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(4, 16, 24), device="cuda:0", cache=False)
    for x, want in ((vol, data), (vol.max(axis=0), data.max(axis=0)), (vol[[8, 0]], data[[8, 0]])):
        held = x.persist()
        assert x.compute_path == "fast"
        assert all(isinstance(b, cupy.ndarray) for b in held.__dask_graph__().values())
        np.testing.assert_array_equal(to_host(held.compute()), want)


def test_persist_is_dask_s_where_no_fast_path_applies(stack):
    paths, want = stack
    vol = _vol(paths)
    held = vol.persist(scheduler="processes")
    assert vol.compute_path == "dask" and np.array_equal(held.compute(), want)
    changed = _vol(paths)
    changed[0] = 0  # no longer the files
    held = changed.persist()
    assert changed.compute_path == "dask" and held.compute()[0].max() == 0


def test_setitem_turns_the_fast_path_off(stack):
    paths, want = stack
    vol = _vol(paths)
    vol[0] = 0
    got = vol.compute()
    assert vol.compute_path == "dask"
    want = want.copy()
    want[0] = 0
    assert np.array_equal(got, want)
    again = pickle.loads(pickle.dumps(vol))  # pickles as the modified array, not the files
    assert np.array_equal(again.compute(), want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_slices_on_chunk_boundaries_stay_gpulazy_arrays_with_the_fast_path(stack, data):
    paths, want = stack
    vol = gpulazy.from_files(paths, shape=(5, 7), dtype=">u2", offset=3, chunks=(2, (2, 3), (4, 3)), device="cpu",
                             cache=False)
    edges = [(0, 2, 4, 6), (0, 2, 5), (0, 4, 7)]
    index = []
    for n, e in zip(vol.shape, edges):
        if data.draw(st.booleans(), label="on edges"):
            lo, hi = sorted(data.draw(st.lists(st.sampled_from(e), min_size=2, max_size=2, unique=True)))
        else:
            lo = data.draw(st.integers(0, n - 1))
            hi = data.draw(st.integers(lo + 1, n))
        index.append(slice(lo, hi))
    index = tuple(index)
    part = vol[index]
    aligned = all(s.start in e and s.stop in e for s, e in zip(index, edges))
    whole = all(s == slice(0, n) for s, n in zip(index, vol.shape))
    assert isinstance(part, GpulazyArray), index  # on the edges: the chunks' own array; off them: a box
    assert (part.chunk_index is not None) == aligned, index
    got = part.compute()
    assert np.array_equal(got, want[index]) and got.shape == want[index].shape
    assert part.compute_path == "fast"
    if aligned:
        assert part.compute_path == "fast" and part.chunk_index is not None
        assert part.chunk_index.shape == want[index].shape and (whole or part.name != vol.name)
        assert np.array_equal(part.max(axis=0).compute(), want[index].max(axis=0))  # derived: dask, same values
        assert np.array_equal(pickle.loads(pickle.dumps(part)).compute(), want[index])


def test_a_slice_on_chunk_boundaries_reads_onto_each_device(stack, device):
    paths, want = stack
    vol = _vol(paths, device=device)
    part = vol[2:6, :, 0:7]
    assert isinstance(part, GpulazyArray)
    got = part.compute()
    assert part.compute_path == "fast" and type(got).__module__.split(".")[0] == ("numpy" if device == "cpu" else "cupy")
    assert np.array_equal(to_host(got), want[2:6])


def test_a_slice_reads_through_the_same_cache_entries(stack):
    paths, want = stack
    cache = DeviceCache("1 MiB", device="cpu", name="test-slice-cache")
    try:
        vol = _vol(paths, cache=cache)
        assert np.array_equal(vol[:4].max(axis=0).compute(), want[:4].max(axis=0))  # caches chunks 0 and 1
        assert cache.stats()["loads"] == 2
        part = vol[2:6]
        assert isinstance(part, GpulazyArray) and np.array_equal(part.compute(), want[2:6])
        s = cache.stats()
        assert s["loads"] == 2 and s["hits"] == 1  # chunk 1 from the cache, chunk 2 read past it
    finally:
        cache.close()


def test_a_changed_array_slices_through_dask(stack):
    paths, want = stack
    vol = _vol(paths)
    vol[0] = 0
    assert type(vol[2:4]) is da.Array
    want = want.copy()
    want[0] = 0
    assert np.array_equal(vol[0:2].compute(), want[0:2])


def test_fast_path_fills_from_cache_hits_without_inserting_misses(stack):
    paths, want = stack
    cache = DeviceCache("1 MiB", device="cpu")
    try:
        vol = _vol(paths, cache=cache)
        assert np.array_equal(vol.compute(), want) and vol.compute_path == "fast"
        assert len(cache) == 0 and cache.stats()["misses"] == 0  # misses read straight into the result
        assert np.array_equal(vol[:2].compute(), want[:2]) and len(cache) == 0  # a slice's fast path
        assert np.array_equal(vol[:2].map_blocks(np.copy).compute(), want[:2])  # dask: caches the first block
        assert len(cache) == 1
        hits = cache.stats()["hits"]
        assert np.array_equal(vol.compute(), want) and vol.compute_path == "fast"
        assert cache.stats()["hits"] == hits + 1 and len(cache) == 1
        # The cache by name gives the same graph name as the cache object.
        assert _vol(paths, cache=cache.name).name == vol.name
    finally:
        cache.close()


def test_fortran_single_file_fast_path_is_fortran_ordered(tmp_path):
    want = np.arange(3 * 4 * 5, dtype=">f4").reshape(3, 4, 5)
    p = tmp_path / "f.raw"
    np.asfortranarray(want).T.tofile(p)  # the file holds ``want`` in F order
    vol = gpulazy.from_files(p, shape=(3, 4, 5), dtype=">f4", order="F", chunks=(2, 3, 2), device="cpu",
                             cache=False)
    fast = vol.compute()
    assert vol.compute_path == "fast" and fast.flags.f_contiguous
    assert np.array_equal(fast, want) and np.array_equal(vol.compute(scheduler="sync", optimize_graph=False), want)


# -- graph names, tokens, pickling, distributed ---------------------------------------------------

def test_graph_names_are_deterministic(stack):
    paths, _ = stack
    a, b = _vol(paths), _vol(paths)
    assert a.name == b.name and a.name.startswith("from_files-")
    assert tokenize(a) == tokenize(b) == tokenize(a)
    assert _vol(paths, cache=None).name != a.name  # another cache: another name
    assert gpulazy.from_files(paths, shape=(5, 7), dtype=">u2", offset=3, device="cpu", cache=False).name != a.name
    st_ = os.stat(paths[2])
    os.utime(paths[2], ns=(st_.st_atime_ns, st_.st_mtime_ns + 5_000_000))  # a changed file
    assert _vol(paths).name != a.name


def test_tasks_are_load_chunk_with_spec_and_source(stack):
    paths, _ = stack
    vol = _vol(paths, backend="posix")
    graph = dict(vol.__dask_graph__())
    assert len(graph) == 3
    task = graph[(vol.name, 1, 0, 0)]
    assert task.func is load_chunk
    spec, source = task.args
    assert spec.index == (1, 0, 0) and spec.shape == (2, 5, 7)
    assert source == ChunkSource("cpu", "posix", False)


def test_tasks_and_arrays_pickle(stack):
    paths, want = stack
    vol = _vol(paths)
    graph = pickle.loads(pickle.dumps(dict(vol.__dask_graph__())))
    assert set(graph) == set(vol.__dask_graph__())
    again = pickle.loads(pickle.dumps(vol))
    assert isinstance(again, GpulazyArray) and again.name == vol.name
    assert np.array_equal(again.compute(), want) and again.compute_path == "fast"


def test_distributed_local_cluster(stack):
    distributed = pytest.importorskip("distributed")
    paths, want = stack
    vol = _vol(paths)
    with distributed.LocalCluster(processes=False, n_workers=1, threads_per_worker=2,
                                  dashboard_address=None) as cluster, distributed.Client(cluster):
        assert np.array_equal(vol.compute(), want)
        assert vol.compute_path == "dask"  # a client is active: it runs the graph
        assert int(vol.sum().compute()) == int(want.astype(np.int64).sum())


def test_named_cache_on_worker_processes(stack):
    """A DeviceCache passed to from_files exists in every worker process, made there."""
    distributed = pytest.importorskip("distributed")
    paths, want = stack
    vol = _vol(paths, cache=DeviceCache("8 MiB", device="cpu", name="worker-cache-test"))
    with distributed.LocalCluster(processes=True, n_workers=1, threads_per_worker=1,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        assert int(vol.sum().compute()) == int(want.astype(np.int64).sum())
        assert int(vol.sum().compute()) == int(want.astype(np.int64).sum())

        def worker_cache_stats():
            from gpulazy.cache import cache_by_name

            return cache_by_name("worker-cache-test").stats()

        (stats,) = client.run(worker_cache_stats).values()
    assert stats["misses"] == vol.npartitions and stats["hits"] == vol.npartitions


def test_processes_scheduler_runs_pickled_tasks(stack):
    paths, want = stack
    vol = _vol(paths)
    assert np.array_equal(vol.compute(scheduler="processes"), want) and vol.compute_path == "dask"


def test_graph_of_100k_chunks_builds_quickly(tmp_path):
    p = tmp_path / "big.raw"
    np.zeros(100_000 * 16, np.uint8).tofile(p)
    started = time.perf_counter()
    vol = gpulazy.from_files(p, shape=(100_000, 16), dtype="u1", chunks=(1, 16), device="cpu", cache=False)
    seconds = time.perf_counter() - started
    print(f"\n100,000-chunk graph built in {seconds:.2f} s")
    assert vol.numblocks == (100_000, 1) and len(vol.__dask_graph__()) == 100_000
    assert seconds < 20  # target < 2 s; generous for loaded CI machines


# -- backends, devices, options ------------------------------------------------------------------

def test_meta_and_chunk_type_on_cpu(stack):
    paths, _ = stack
    vol = _vol(paths)
    assert type(vol._meta) is np.ndarray and vol._meta.dtype == np.dtype("uint16")


def test_bad_arguments(stack):
    paths, _ = stack
    from gpulazy.errors import ConfigError, DeviceError

    with pytest.raises(ConfigError, match="unknown backend 'nope'"):
        _vol(paths, backend="nope")
    with pytest.raises(DeviceError):
        _vol(paths, device="tpu")
    with pytest.raises(TypeError, match="cache must be"):
        _vol(paths, cache=3)
    with pytest.raises(LayoutError, match="f0.raw.*expected"):
        gpulazy.from_files(paths, shape=(5, 8), dtype=">u2", offset=3, device="cpu")


# -- read_file / read_files ----------------------------------------------------------------------

def test_read_file_shapes_dtypes_offsets(tmp_path):
    rng = np.random.default_rng(1)
    (p,), want = write_raw(str(tmp_path), 1, (6, 10), ">f8", 16, rng)
    got = gpulazy.read_file(p, dtype=">f8", shape=(6, 10), offset=16, device="cpu")
    assert _bytes_equal(got, want)
    flat = gpulazy.read_file(p, device="cpu")
    assert flat.dtype == np.uint8 and flat.shape == (16 + 480,)
    assert flat.tobytes() == open(p, "rb").read()
    arr, seconds = gpulazy.read_file(p, dtype=">f8", offset=16, device="cpu", timed=True)
    assert _bytes_equal(arr, want.ravel()) and seconds >= 0


def test_read_file_size_mismatch_names_the_file(tmp_path):
    p = tmp_path / "odd.raw"
    p.write_bytes(b"\0" * 10)
    with pytest.raises(LayoutError, match="odd.raw.*10 bytes.*12 were expected"):
        gpulazy.read_file(p, dtype="u2", shape=(2, 3), device="cpu")
    with pytest.raises(LayoutError, match="odd.raw.*whole number"):
        gpulazy.read_file(p, dtype="u4", device="cpu")
    with pytest.raises(LayoutError, match="directory"):
        gpulazy.read_file(tmp_path, device="cpu")


def test_read_files_in_natural_order(tmp_path):
    for i in (10, 2, 1):
        np.full(3 + i, i, dtype="<i2").tofile(tmp_path / f"s{i}.bin")
    got = gpulazy.read_files(tmp_path / "s*.bin", dtype="<i2", device="cpu")
    assert [a.tolist() for a in got] == [[1] * 4, [2] * 5, [10] * 13]
    got, seconds = gpulazy.read_files([tmp_path / "s2.bin", tmp_path / "s1.bin"], dtype="<i2", device="cpu",
                                      timed=True)
    assert [int(a[0]) for a in got] == [2, 1] and seconds >= 0
    with pytest.raises(LayoutError, match="s1.bin.*8 bytes"):
        gpulazy.read_files(tmp_path, dtype="<i2", shape=(5,), device="cpu")


# -- GPU -------------------------------------------------------------------------------------------

@pytest.mark.gpu
class TestCuda:
    """The key equality checks again, reading onto cuda:0 with CuPy meta."""

    @pytest.mark.parametrize("order", ["C", "F"])
    @pytest.mark.parametrize("dtype", ["<u2", ">u2", ">f8", "<c8"])
    def test_raw_stack_equals_numpy(self, tmp_path, order, dtype):
        import cupy

        rng = np.random.default_rng(2)
        paths, want = write_raw(str(tmp_path), 3, (17, 33), dtype, 5, rng, order)
        vol = gpulazy.from_files(paths, shape=(17, 33), dtype=dtype, offset=5, order=order, chunks=(1, 8, 16),
                                 device="cuda:0", cache=False)
        assert isinstance(vol._meta, cupy.ndarray)
        fast = vol.compute()
        assert isinstance(fast, cupy.ndarray) and vol.compute_path == "fast"
        assert _bytes_equal(fast, want)
        slow = vol.compute(scheduler="sync", optimize_graph=False)
        assert isinstance(slow, cupy.ndarray) and _bytes_equal(slow, want)
        assert _bytes_equal(vol[1, 3:9].compute(), want[1, 3:9])

    @pytest.mark.parametrize("fortran", [False, True])
    def test_single_file_and_npy(self, tmp_path, fortran):
        import cupy

        want = np.arange(40 * 30 * 3, dtype=">i4").reshape(40, 30, 3)
        want = np.asfortranarray(want) if fortran else want
        np.save(tmp_path / "a.npy", want)
        vol = gpulazy.from_files(tmp_path / "a.npy", chunks=(7, 30, 2), device="cuda:0", cache=False)
        assert isinstance(vol._meta, cupy.ndarray)
        assert _bytes_equal(vol.compute(), _native(want))
        assert _bytes_equal(vol.compute(scheduler="sync", optimize_graph=False), _native(want))
        assert int(vol.sum().compute()) == int(want.astype(np.int64).sum())

    def test_cache_hits_on_device(self, tmp_path):
        want = np.arange(64 * 64, dtype="<f4").reshape(64, 64)
        want.tofile(tmp_path / "a.raw")
        cache = DeviceCache("16 MiB", device="cuda:0")
        try:
            vol = gpulazy.from_files(tmp_path / "a.raw", shape=(64, 64), dtype="<f4", chunks=(16, 64),
                                     device="cuda:0", cache=cache)
            assert _bytes_equal((vol + 0).compute(), want) and len(cache) == 4
            hits = cache.stats()["hits"]
            assert _bytes_equal(vol.compute(), want) and vol.compute_path == "fast"
            assert cache.stats()["hits"] == hits + 4
        finally:
            cache.close()

    def test_read_files_on_device(self, tmp_path):
        import cupy

        for i in range(4):
            np.full(1000 + i, i, dtype=">u4").tofile(tmp_path / f"s{i}.bin")
        got = gpulazy.read_files(tmp_path, dtype=">u4", device="cuda:0")
        assert all(isinstance(a, cupy.ndarray) for a in got)
        assert [to_host(a).tolist() for a in got] == [[i] * (1000 + i) for i in range(4)]

    @pytest.mark.slow
    def test_read_file_beyond_4_gib(self, tmp_path):
        size = (4 << 30) + (64 << 20) + 12  # > 4 GiB, not a multiple of any task size
        p = tmp_path / "big.bin"
        marks = {0: 1, (2 << 30) - 3: 2, (4 << 30) - 7: 3, (4 << 30) + 8192 + 5: 4, size - 4096: 5}  # 4 KiB each, apart
        with open(p, "wb") as f:
            f.truncate(size)  # holes read as zeros
            for offset, seed in marks.items():
                f.seek(offset)
                f.write(np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8).tobytes())
        arr, seconds = gpulazy.read_file(p, device="cuda:0", timed=True)
        assert arr.shape == (size,) and arr.dtype == np.uint8 and seconds > 0
        for offset, seed in marks.items():
            want = np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8)
            assert np.array_equal(to_host(arr[offset:offset + 4096]), want), offset
        assert not to_host(arr[(3 << 30): (3 << 30) + (1 << 20)]).any()
        # A multi-byte view with an offset, past the 4 GiB mark.
        words = gpulazy.read_file(p, dtype="<u4", offset=size % 4, device="cuda:0")
        assert words.shape == (size // 4,)
        host = np.fromfile(p, dtype="<u4", count=1024, offset=size % 4 + ((4 << 30) + 4))
        assert np.array_equal(to_host(words[(1 << 30) + 1:(1 << 30) + 1025]), host)
