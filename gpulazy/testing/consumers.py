"""``ConsumerConformance``: every way users get chunk values gives the file's values.

A consumer is one way users get chunk values: ``consume(case) -> None`` reads the case's
dataset that way and asserts the values equal ``case.reference`` (the format's own reader's
array). A new way of reading is one more entry in ``CONSUMERS``; a new format one more
``Format`` in a ``ConsumerConformance`` subclass (see the class).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulazy import config
from gpulazy.device import get_device
from gpulazy.errors import ChunkReadError, GpulazyError
from gpulazy.stats import default_stats
from gpulazy.testing.backends import BackendConformance
from gpulazy.testing.layouts import LayoutConformance

__all__ = ["CONSUMERS", "Case", "ConsumerConformance", "Dataset", "Format", "flip_byte"]


@dataclass(frozen=True)
class Dataset:
    """What a ``Format`` wrote under ``root``: the ``path`` ``from_files`` opens with ``options``.

    ``reference`` is the format's own reader's array (NumPy, tifffile, zarr, h5py) read back
    from the files. ``raw``, for files that are plain element runs: ``files`` and the
    ``read_file`` keywords ``dtype``, ``shape`` (one file's, in its element ``order``) and
    ``offset``.
    """

    root: str
    path: str
    reference: np.ndarray
    options: dict = field(default_factory=dict)
    raw: dict | None = None


@dataclass(frozen=True)
class Format:
    """A way to store an array: ``write(folder, array, chunks, draw) -> Dataset``.

    ``chunks`` is the stored chunking drawn for the example (one length per axis; a format
    with fixed pieces, such as 16 x 16 tiles, rounds it); ``draw`` is hypothesis' draw, for
    codec options. ``raw``: its files are plain element runs that ``read_file`` reads.
    """

    write: Callable[..., Dataset]
    dtypes: tuple[str, ...] = ("uint8", "<u2", ">u2", "int16", "float32")
    ndims: tuple[int, int] = (2, 3)
    min_side: int = 5
    max_side: int = 20
    raw: bool = False


@dataclass
class Case:
    """One example: a written dataset, the device, the ``chunks=`` asked for and hypothesis' ``draw``."""

    dataset: Dataset
    device: str
    chunks: Any
    draw: Callable[..., Any]
    tmp: str  # a fresh folder the consumer may write into

    @property
    def reference(self) -> np.ndarray:
        return self.dataset.reference

    def open(self, path: str | None = None, **kw: Any) -> Any:
        """``from_files`` over the dataset (or its copy at ``path``); no cache unless ``cache=`` says."""
        import gpulazy

        opts = {"chunks": self.chunks, "cache": False, **self.dataset.options, **kw}
        return gpulazy.from_files(path or self.dataset.path, device=self.device, **opts)

    def check(self, got: Any, want: Any, what: str, *, atol: float = 0.0) -> None:
        """``got`` lives on the case's device, in native byte order, and equals ``want``
        (within ``atol``: for sums, whose rounding depends on the order of the additions)."""
        if not isinstance(got, np.generic):  # dask hands a 0-d NumPy result out as a scalar
            xp = get_device(self.device).xp
            assert isinstance(got, xp.ndarray), f"{what}: a {type(got).__name__}, not an array on {self.device}"
        host, want = BackendConformance.host(got), np.asarray(want)
        assert host.shape == want.shape, f"{what}: shape {host.shape}, expected {want.shape}"
        assert host.dtype == want.dtype.newbyteorder("="), f"{what}: dtype {host.dtype}, expected {want.dtype}"
        if atol:
            np.testing.assert_allclose(host, want, rtol=0, atol=atol, err_msg=what)
        else:
            np.testing.assert_array_equal(host, want, err_msg=what)


def flip_byte(path: str, at: int) -> None:
    """Flip byte ``at`` of ``path``, keeping its size and mtime (only a checksum can tell)."""
    st_ = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x55]))
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns))


def _blocks(vol: Any) -> list[tuple[tuple[int, ...], Any, tuple[slice, ...]]]:
    """``(block index, ChunkSpec, the block's slices of the whole array)`` for each chunk of ``vol``."""
    edges = [list(itertools.accumulate(c, initial=0)) for c in vol.chunks]
    return [(index, spec, tuple(slice(e[i], e[i + 1]) for e, i in zip(edges, index)))
            for index, spec in vol.chunk_index.specs.items()]


def _box(shape: tuple[int, ...]) -> Any:
    """A strategy for an index into ``shape``: per axis an int or a slice with a step."""
    def axis(n: int) -> Any:
        bounds = st.tuples(st.integers(0, n - 1), st.integers(1, n), st.integers(1, 3))
        slices = bounds.map(lambda b: slice(min(b[0], b[1] - 1), b[1], b[2]))
        return st.one_of(slices, st.integers(-n, n - 1))
    return st.tuples(*(axis(n) for n in shape))


def _chunk_length(n: int) -> Any:
    """A strategy for a chunk length along an axis of ``n``: 2 chunks first, then 3, 1 or 4."""
    return st.sampled_from([2, 3, 1, 4]).map(lambda k: -(-n // k))


def _sum_atol(reference: np.ndarray, dtype: Any, count: int = 1) -> float:
    """How far rounding may take a chunked sum (a mean of ``count`` terms) from NumPy's."""
    return 64 * float(np.finfo(dtype).eps) * float(np.abs(reference.astype("f8")).sum()) / count + 1e-300


def consume_compute(case: Case) -> None:
    vol, ref = case.open(), case.reference
    case.check(vol.compute(), ref, "vol.compute()")
    assert vol.compute_path == "fast"
    head = vol[: vol.chunks[0][0]]  # a slice on chunk boundaries stays gpulazy's: the fast path too
    case.check(head.compute(), ref[: vol.chunks[0][0]], "vol[:first chunk].compute()")
    assert head.compute_path == "fast"


def _consume_dask(scheduler: str) -> Callable[[Case], None]:
    def consume(case: Case) -> None:
        vol, ref = case.open(), case.reference
        plus = vol + 0
        assert getattr(plus, "compute_path", None) is None  # dask's array: culled read_batch/pick tasks
        case.check(plus.compute(scheduler=scheduler), ref + 0, f"(vol + 0).compute(scheduler={scheduler!r})")
        with config.set(streamed_maps=False):  # dask's task a chunk (the streamed map: ``consume_map``)
            copied = vol.map_blocks(lambda b: b.copy(), dtype=vol.dtype)
        case.check(copied.compute(scheduler=scheduler), ref, f"vol.map_blocks(copy).compute(scheduler={scheduler!r})")
        assert getattr(copied, "compute_path", None) is None
    return consume


def consume_map(case: Case) -> None:
    """``vol.map_blocks(f).compute()`` as the reads land (``gpulazy.read.mapped``), a block of the
    chunk's shape and one of another shape, on both local schedulers; a MIP of each, ``f``
    folded into the streamed reduction (``gpulazy.read.reduce``)."""
    import dask

    vol, ref = case.open(), case.reference
    for scheduler in ("sync", "threads"):
        doubled = vol.map_blocks(lambda b: b.astype("f8") * 2, dtype="f8")
        case.check(doubled.compute(scheduler=scheduler), ref.astype("f8") * 2,
                   f"vol.map_blocks(b * 2).compute(scheduler={scheduler!r})")
        assert doubled.compute_path == "fast"
        heads = vol.map_blocks(lambda b: b[:1].copy(), dtype=vol.dtype)
        starts = list(itertools.accumulate(vol.chunks[0][:-1], initial=0))
        case.check(heads.compute(scheduler=scheduler), ref[starts], f"vol.map_blocks(b[:1]).compute({scheduler!r})")
        assert heads.compute_path == "fast"
    mip = doubled.max(axis=0)
    case.check(mip.compute(), (ref.astype("f8") * 2).max(axis=0), "vol.map_blocks(b * 2).max(axis=0).compute()")
    assert mip.compute_path == "fast"
    case.check(dask.compute(heads.max(axis=0))[0], ref[starts].max(axis=0),
               "dask.compute(vol.map_blocks(b[:1]).max(axis=0))")  # the chain as dask tasks


def consume_slice(case: Case) -> None:
    vol, ref = case.open(), case.reference
    case.check(vol[1:-1, ...].compute(), ref[1:-1, ...], "vol[1:-1, ...].compute()")
    box = case.draw(_box(ref.shape), label="box")
    case.check(vol[box].compute(scheduler="sync"), ref[box], f"vol[{box}].compute()")


def consume_max(case: Case) -> None:
    import dask

    vol, ref = case.open(), case.reference
    mip = vol.max(axis=0)
    case.check(mip.compute(), ref.max(axis=0), "vol.max(axis=0).compute()")  # the chain in this thread
    case.check(dask.compute(mip)[0], ref.max(axis=0), "dask.compute(vol.max(axis=0))")  # as dask tasks


def consume_sum(case: Case) -> None:
    vol, ref = case.open(), case.reference
    want = ref.astype("f8").sum()
    case.check(vol.astype("f8").sum().compute(), want, "vol.astype('f8').sum().compute()", atol=_sum_atol(ref, "f8"))


def consume_mean(case: Case) -> None:
    vol, ref = case.open(), case.reference
    got = vol.mean().compute()
    want = np.asarray(ref.astype("f8").mean(), dtype=got.dtype)
    case.check(got, want, "vol.mean().compute()", atol=_sum_atol(ref, got.dtype, ref.size))


def _add_one_in_place(block: Any) -> Any:
    block += 1
    return block


def consume_cache(case: Case) -> None:
    """Reads through a ``DeviceCache``: a miss, then hits; results are the caller's own; capacity holds."""
    from gpulazy.cache import DeviceCache

    ref, nbytes = case.reference, case.reference.nbytes
    capacity = case.draw(st.sampled_from([2 * nbytes, nbytes // 3, 0]), label="capacity")
    cache = DeviceCache(capacity, device=case.device)
    try:
        vol = case.open(cache=cache)
        for turn in ("miss", "hit"):
            before, read_before = cache.stats(), default_stats().snapshot()["bytes_read"]
            # Each block handed out is the task's own: writing into it cannot reach the cache.
            got = vol.map_blocks(_add_one_in_place, dtype=vol.dtype).compute(scheduler="threads")
            case.check(got, ref + 1, f"{turn} through DeviceCache({capacity}), each block += 1")
            assert cache.bytes_held <= cache.capacity, cache.stats()
        if capacity >= nbytes:  # everything stayed cached: the second pass read no byte
            after = cache.stats()
            assert after["hits"] - before["hits"] == len(vol.chunk_index.specs), after
            assert after["misses"] == before["misses"], after
            assert default_stats().snapshot()["bytes_read"] == read_before
        whole = vol.compute()  # the fast path copies cached chunks out
        case.check(whole, ref, f"vol.compute() through DeviceCache({capacity})")
        whole += 1
        case.check((vol + 0).compute(scheduler="sync"), ref + 0, "(vol + 0).compute() after writing into results")
        assert cache.bytes_held <= cache.capacity, cache.stats()
    finally:
        cache.close()


def consume_load_many(case: Case) -> None:
    vol, ref = case.open(), case.reference
    blocks = _blocks(vol)
    got = vol.chunk_source.load_many(tuple(spec for _, spec, _ in blocks))
    assert len(got) == len(blocks)
    for (index, _, block), arr in zip(blocks, got):
        case.check(arr, ref[block], f"chunk_source.load_many(...)[{index}]")


def consume_read(case: Case) -> None:
    vol, ref = case.open(), case.reference
    for index, spec, block in _blocks(vol):
        case.check(vol.chunk_source.read(spec), ref[block], f"chunk_source.read(chunk {index})")


def consume_get_region(case: Case) -> None:
    """``DeviceCache.get_region`` of random boxes inside chunks, into a view of a larger array and not."""
    from gpulazy.cache import DeviceCache

    vol, ref = case.open(), case.reference
    dev = get_device(case.device)
    capacity = case.draw(st.sampled_from([2 * ref.nbytes, 0]), label="capacity")
    cache = DeviceCache(capacity, device=case.device)
    blocks = _blocks(vol)
    try:
        for i in case.draw(st.lists(st.integers(0, len(blocks) - 1), min_size=1, max_size=3), label="chunks"):
            index, spec, block = blocks[i]
            region = case.draw(_box(tuple(spec.shape)), label="region")
            want = ref[block][region]
            with dev.activate():  # ``out`` inside a frame of sentinels that must stay untouched
                frame = dev.xp.full(tuple(n + 2 for n in want.shape), 7, dtype=vol.dtype)
                out = frame[(slice(1, -1),) * want.ndim + (Ellipsis,)]
            what = f"get_region(chunk {index}, {region})"
            assert cache.get_region(spec, vol.chunk_source.read, region, out=out) is out, what
            case.check(out, want, what)
            edge = BackendConformance.host(frame).copy()
            edge[(slice(1, -1),) * want.ndim] = 7
            assert (edge == 7).all(), f"{what} wrote outside out"
            case.check(cache.get_region(spec, vol.chunk_source.read, region), want, what + ", again")
            assert cache.bytes_held <= cache.capacity, cache.stats()
    finally:
        cache.close()


def _consume_prefetch(context: bool) -> Callable[[Case], None]:
    def consume(case: Case) -> None:
        import gpulazy
        from gpulazy.cache import DeviceCache

        ref = case.reference
        capacity = case.draw(st.sampled_from([2 * ref.nbytes, ref.nbytes // 2]), label="capacity")
        cache = DeviceCache(capacity, device=case.device)
        try:
            vol = case.open(cache=cache)
            runs = {"(vol + 0).compute()": (lambda cb: (vol + 0).compute(scheduler="threads", **cb), ref + 0),
                    "vol.max(axis=0).compute()": (lambda cb: vol.max(axis=0).compute(scheduler="sync", **cb),
                                                  ref.max(axis=0)),
                    "vol.compute()": (lambda cb: vol.compute(**cb), ref)}
            for what, (run, want) in runs.items():
                if context:
                    with gpulazy.prefetch(depth=2):
                        got = run({})
                else:
                    got = run({"callbacks": [gpulazy.prefetch(depth=2)]})
                case.check(got, want, f"{what} with prefetch ({'with' if context else 'callbacks'})")
                assert cache.bytes_held <= cache.capacity, cache.stats()
            assert vol.compute_path == "fast"
        finally:
            cache.close()
    return consume


def consume_read_file(case: Case) -> None:
    """``read_file`` of each file and ``read_files`` of all, for files of plain element runs."""
    import gpulazy

    raw = case.dataset.raw
    assert raw is not None, "read_file needs a Format with raw=True"
    kw = {"dtype": raw["dtype"], "shape": raw["shape"], "offset": raw["offset"], "device": case.device}
    files = raw["files"]
    stacked = os.path.isdir(case.dataset.path)  # a folder stacks its files, one per plane, even one file
    planes = case.reference if stacked else case.reference[None]
    in_c = (lambda a: a.T) if raw["order"] == "F" else (lambda a: a)
    for path, want in zip(files, planes):
        case.check(in_c(gpulazy.read_file(path, **kw)), want, f"read_file({path!r})")
    got = gpulazy.read_files(files, **kw)
    assert len(got) == len(files)
    for path, arr, want in zip(files, got, planes):
        case.check(in_c(arr), want, f"read_files(...) of {path!r}")


consume_read_file.needs_raw = True  # type: ignore[attr-defined]


def consume_verify(case: Case) -> None:
    """``verify=True`` reads equal the file; one flipped stored byte raises ``ChunkReadError`` naming it."""
    import shutil

    from gpulazy.checksums import write_manifest

    ref, data = case.reference, case.dataset
    root = shutil.copytree(data.root, os.path.join(case.tmp, "verified"))
    path = os.path.join(root, os.path.relpath(data.path, data.root))
    write_manifest(path if os.path.isdir(path) else [path], block_size=case.draw(st.sampled_from([4096, 64])))
    reads = {"vol.compute()": lambda v: v.compute(), "(vol + 0).compute()": lambda v: (v + 0).compute()}
    for what, read in reads.items():
        case.check(read(case.open(path, verify=True)), ref + 0, f"verify=True {what}")
    stored = [r for spec in case.open(path).chunk_index.specs.values() for r in spec.ranges if r.nbytes]
    victim = stored[case.draw(st.integers(0, len(stored) - 1), label="stored piece")]
    at = victim.offset + case.draw(st.integers(0, victim.nbytes - 1), label="byte")
    flip_byte(victim.path, at)
    for what, read in reads.items():
        # Indexed after the flip: only the checksums can tell. A byte in a checksum block that
        # also holds the layout's metadata (a header) fails ``from_files`` itself.
        with pytest.raises(ChunkReadError) as info:
            read(case.open(path, verify=True))
        assert info.value.path == victim.path and victim.path in str(info.value), f"{what}: {info.value!r}"


#: Every way users get chunk values, by name. Plug a new one in as one more entry.
CONSUMERS: dict[str, Callable[[Case], None]] = {
    "compute": consume_compute,
    "dask-sync": _consume_dask("sync"),
    "dask-threads": _consume_dask("threads"),
    "map": consume_map,
    "slice": consume_slice,
    "max": consume_max,
    "sum-f8": consume_sum,
    "mean": consume_mean,
    "cache": consume_cache,
    "load_many": consume_load_many,
    "read": consume_read,
    "get_region": consume_get_region,
    "prefetch-callbacks": _consume_prefetch(context=False),
    "prefetch-with": _consume_prefetch(context=True),
    "read_file": consume_read_file,
    "verify": consume_verify,
}


class ConsumerConformance:
    """Every consumer gives every format's values as the format's own reader reads them.

    Subclass it, set ``formats`` (name -> ``Format``) and ``__test__ = True``::

        class TestConsumers(ConsumerConformance):
            __test__ = True
            formats = {"npy": Format(write_npy, raw=True), ...}
            device = "cpu"            # or "cuda:0" in a class marked ``@pytest.mark.gpu``

    ``test_consumer`` runs once per consumer (``consumers``, default ``CONSUMERS``) and format;
    hypothesis draws the dtype, shape, stored chunking, the ``chunks=`` asked of
    ``from_files`` (at most 4 chunks an axis) and what each consumer draws itself (boxes,
    capacities, the byte to flip). ``max_examples`` per pair (``GPULAZY_CONFORMANCE_N``);
    examples are derandomized, so CI runs the same ones every time. ``known_failures``
    (``(consumer, format) -> reason``) marks a pair ``xfail(strict=True)``, ``known_bug``
    the examples a consumer fails: bugs to fix.
    """

    __test__ = False

    formats: ClassVar[dict[str, Format]] = {}
    consumers: ClassVar[dict[str, Callable[[Case], None]]] = CONSUMERS
    device: ClassVar[str] = "cpu"
    max_examples: ClassVar[int] = int(os.environ.get("GPULAZY_CONFORMANCE_N", "3"))
    known_failures: ClassVar[dict[tuple[str, str], str]] = {}

    def pytest_generate_tests(self, metafunc: Any) -> None:
        if "consumer" not in metafunc.fixturenames:
            return
        params = []
        for name, consume in self.consumers.items():
            for fmt, form in self.formats.items():
                if getattr(consume, "needs_raw", False) and not form.raw:
                    continue
                reason = self.known_failures.get((name, fmt))
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                params.append(pytest.param(name, fmt, marks=marks, id=f"{name}-{fmt}"))
        metafunc.parametrize(("consumer", "fmt"), params)

    def test_consumer(self, consumer, fmt, tmp_path):
        consume, form = self.consumers[consumer], self.formats[fmt]

        @settings(max_examples=self.max_examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def check(data):
            case = self.case(form, data.draw, str(tmp_path))
            bug = self.known_bug(consumer, fmt, case)
            if bug is None:
                return consume(case)
            try:
                consume(case)
            except (AssertionError, GpulazyError):  # still failing, as the bug predicts
                return
            raise AssertionError(f"fixed? this case no longer fails; drop it from known_bug: {bug}")

        check()

    def known_bug(self, consumer: str, fmt: str, case: Case) -> str | None:
        """Why ``consumer`` fails ``case`` of format ``fmt`` (a bug to fix), else ``None``.

        Such a case must fail: once the bug is fixed the suite says so, and this goes.
        """
        return None

    def case(self, form: Format, draw: Callable[..., Any], tmp: str) -> Case:
        """Draw an example of ``form`` and write it under a fresh folder of ``tmp``."""
        import tempfile

        ndim = draw(st.integers(*form.ndims), label="ndim")
        # Hypothesis starts from the simplest example: make that one several chunks a side,
        # edge chunks included; sides of 1 and 2 come later.
        sides = [(3, 8) if axis == 0 and ndim == 3 else (form.min_side, form.max_side) for axis in range(ndim)]
        shape = tuple(draw(st.integers(lo, max(lo, hi)) | st.integers(1, lo)) for lo, hi in sides)
        stored = draw(st.tuples(*(_chunk_length(n) for n in shape)), label="stored chunks")
        chunks = draw(st.one_of(st.tuples(*(_chunk_length(n) for n in shape)), st.none()), label="chunks=")
        array = LayoutConformance.random_array(shape, draw(st.sampled_from(form.dtypes), label="dtype"),
                                               draw(st.integers(0, 2**16), label="seed"))
        folder = tempfile.mkdtemp(dir=tmp)
        dataset = form.write(folder, array, stored, draw)
        np.testing.assert_array_equal(dataset.reference, array, err_msg="the format's reader disagrees with the writer")
        return Case(dataset, self.device, chunks, draw, tempfile.mkdtemp(dir=tmp))
