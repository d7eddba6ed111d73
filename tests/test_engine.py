"""The read engine (``gpulazy.read``): destinations written once, buffers counted, errors settled.

The counting tests are the issue-20 contract "counted, not guessed": on a miss, a chunk read
as stored is one allocation (its array) and no copy; a chunk of stored pieces adds one buffer
for its stored bytes and one copy per piece into place; a cache that keeps the chunk adds one
copy (into its own slot). Counted by the code that allocates and copies
(``gpulazy.stats()["buffers"]``), cross-checked here against the calls to ``Device.alloc``.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gpulazy
from gpulazy.device import Device
from gpulazy.errors import ChunkDecodeError, ChunkReadError
from gpulazy.io import get_backend
from gpulazy.read import read, start
from gpulazy.spec import ByteRange, ChunkSpec

from conftest import zstd_zarr


def _buffers() -> dict:
    return dict(gpulazy.stats().snapshot()["buffers"])


def _delta(before: dict) -> dict:
    after = _buffers()
    return {k: after[k] - before[k] for k in after}


@pytest.fixture
def allocs(monkeypatch):
    """Arrays made by ``Device.alloc_many`` (every chunk-sized array gpulazy makes goes through it,
    ``Device.alloc`` too)."""
    calls = []
    real = Device.alloc_many

    def spy(self, items):
        calls.extend(tuple(shape) for shape, _, _ in items)
        return real(self, items)

    monkeypatch.setattr(Device, "alloc_many", spy)
    return calls


def _raw(tmp_path, shape=(8, 16, 16), dtype="<u2"):
    data = np.random.default_rng(0).integers(0, 60000, shape).astype(dtype)
    p = str(tmp_path / "v.raw")
    data.tofile(p)
    return p, data


# -- counting: one allocation, at most one copy after the read ----------------------------------

@pytest.mark.parametrize("dtype", ["<u2", ">u2"])
def test_a_dask_path_miss_is_one_allocation_and_no_copy(tmp_path, allocs, dtype):
    p, data = _raw(tmp_path, dtype=dtype)
    vol = gpulazy.from_files(p, shape=data.shape, dtype=dtype, chunks=(2, 16, 16), device="cpu", cache=False)
    before = _buffers()
    with gpulazy.config.set(streamed_maps=False):  # a chunk task each (the streamed map: test_mapped.py)
        got = vol.map_blocks(lambda b: b + 0).compute(scheduler="sync")
    np.testing.assert_array_equal(got, data)
    n = vol.numblocks[0]
    assert _delta(before) == {"outputs": n, "staging": 0, "copies": 0}
    assert allocs.count((2, 16, 16)) == n  # one array per chunk, and no other chunk-sized one


def test_a_streamed_map_miss_is_one_allocation_a_chunk_and_the_result_once(tmp_path, allocs):
    """``vol.map_blocks(f).compute()`` (``gpulazy.read.mapped``): the engine allocates each chunk it reads
    (the chunk ``f`` gets) and the result is allocated once; ``f``'s own blocks are copied into it."""
    p, data = _raw(tmp_path)
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(2, 16, 16), device="cpu", cache=False)
    before = _buffers()
    mapped = vol.map_blocks(lambda b: b * 3, dtype=vol.dtype)
    np.testing.assert_array_equal(mapped.compute(scheduler="sync"), data * 3)
    assert mapped.compute_path == "fast"
    n = vol.numblocks[0]
    assert _delta(before) == {"outputs": n, "staging": 0, "copies": 0}
    assert sorted(allocs) == sorted([(2, 16, 16)] * n + [data.shape])


@pytest.mark.parametrize("streamed", [False, True], ids=["dask", "streamed"])
def test_a_miss_through_a_cache_adds_one_copy_into_the_cache(tmp_path, allocs, streamed):
    gpulazy.config.set(streamed_maps=streamed)  # (put back by conftest's _fresh_config)
    p, data = _raw(tmp_path)
    cache = gpulazy.DeviceCache("1 MiB", device="cpu")
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(2, 16, 16), device="cpu", cache=cache)
    before = _buffers()
    np.testing.assert_array_equal(vol.map_blocks(lambda b: b + 0).compute(scheduler="sync"), data)
    n = vol.numblocks[0]
    assert _delta(before) == {"outputs": n, "staging": 0, "copies": n}
    before = _buffers()
    np.testing.assert_array_equal(vol.map_blocks(lambda b: b + 0).compute(scheduler="sync"), data)
    assert _delta(before) == {"outputs": 0, "staging": 0, "copies": 0}  # all hits: nothing read
    assert cache.stats()["hits"] == n
    cache.close()


def test_the_whole_array_path_reads_every_chunk_into_its_slice(tmp_path, allocs):
    p, data = _raw(tmp_path)
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(2, 16, 16), device="cpu", cache=False)
    before = _buffers()
    np.testing.assert_array_equal(vol.compute(), data)
    assert vol.compute_path == "fast"
    assert _delta(before) == {"outputs": 0, "staging": 0, "copies": 0}
    assert allocs == [data.shape]  # the result, once


@pytest.mark.parametrize("streamed", [False, True], ids=["dask", "streamed"])
def test_a_compressed_miss_stages_its_stored_bytes_and_places_each_piece_once(tmp_path, allocs, streamed):
    gpulazy.config.set(streamed_maps=streamed)  # (put back by conftest's _fresh_config)
    data = np.random.default_rng(1).integers(0, 999, (8, 16, 16)).astype("<u2")
    p = zstd_zarr(tmp_path / "v.zarr", data, (2, 16, 16))
    vol = gpulazy.from_files(p, device="cpu", cache=False, chunks=(2, 16, 16))  # a dask chunk per stored one
    before = _buffers()
    np.testing.assert_array_equal(vol.map_blocks(lambda b: b + 0).compute(scheduler="sync"), data)
    n = vol.numblocks[0]
    assert _delta(before) == {"outputs": n, "staging": n, "copies": n}
    assert allocs.count((2, 16, 16)) == n


def test_the_stored_bytes_of_a_submission_share_one_allocation(tmp_path, allocs):
    # Each chunk's stored bytes land in a buffer of their own, all views of one allocation:
    # an allocation per chunk cost a pool lookup and an event each.
    data = np.random.default_rng(1).integers(0, 999, (8, 16, 16)).astype("<u2")
    p = zstd_zarr(tmp_path / "v.zarr", data, (2, 16, 16))
    vol = gpulazy.from_files(p, device="cpu", cache=False, chunks=(2, 16, 16))
    specs = list(vol.chunk_index.specs.values())
    reads = start(specs, get_backend("posix", "cpu"))
    for i in range(len(specs)):
        np.testing.assert_array_equal(reads.chunk(i), data[2 * i:2 * i + 2])
    staged = [s for s in allocs if len(s) == 1]
    assert len(staged) == 1 and staged[0][0] >= sum(s.nbytes for s in specs)
    assert allocs.count((2, 16, 16)) == len(specs)


# -- destinations ------------------------------------------------------------------------------

@given(order=st.sampled_from("CF"), swap=st.booleans(), strided=st.booleans())
@settings(max_examples=20, deadline=None)
def test_a_chunk_lands_in_the_destination_it_is_given(tmp_path_factory, order, swap, strided):
    d = tmp_path_factory.mktemp("dest")
    dt = np.dtype(">u2" if swap else "<u2")
    data = np.arange(6 * 5, dtype=dt).reshape(6, 5)
    p = str(d / "a.raw")
    (data.T if order == "F" else data).tofile(p)  # F: the file holds the columns one after another
    spec = ChunkSpec((ByteRange(p, 0, data.nbytes),), (6, 5), dt.str, order)
    big = np.full((12, 10) if strided else (6, 5), 7, dtype=dt.newbyteorder("="))
    out = big[::2, ::2] if strided else big
    before = _buffers()
    (got,) = read([spec], get_backend("posix", "cpu"), [out])
    assert got is out
    np.testing.assert_array_equal(out, data)
    in_place = not strided and (order == "C")  # an F chunk's bytes are not a C destination's memory
    assert _delta(before)["copies"] == (0 if in_place else 1)
    if strided:
        assert (big[1::2] == 7).all()  # nothing written outside the destination


def test_a_destination_of_the_wrong_shape_is_refused(tmp_path):
    p, data = _raw(tmp_path)
    spec = ChunkSpec((ByteRange(p, 0, 512),), (16, 16), "<u2")
    with pytest.raises(ValueError, match=r"\(16, 16\)"):
        start([spec], get_backend("posix", "cpu"), [np.empty((16, 15), "<u2")])


# -- verified reads: the landed chunks of a submission hashed together ---------------------------

def test_a_verified_chunk_is_checked_with_the_landed_chunks_of_its_submission(tmp_path, monkeypatch):
    """Asking for one verified chunk hashes every chunk of the submission that has landed in one
    ``verify_chunks`` call (a pick task of a dask compute would otherwise hash its own); a chunk
    whose bytes changed after the manifest fails alone, naming its file."""
    from gpulazy import checksums
    from gpulazy.errors import ChunkReadError

    p, data = _raw(tmp_path, shape=(8, 16, 16))
    checksums.write_manifest([p], block_size=512)
    with open(p, "r+b") as f:  # one byte of chunk 5 changed since the manifest, size and mtime kept
        st = os.fstat(f.fileno())
        f.seek(5 * 16 * 16 * 2 + 7)
        f.write(bytes([(int(data.view("u1")[5].ravel()[7]) + 1) % 256]))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(1, 16, 16), device="cpu", cache=False)
    specs = list(vol.chunk_index.specs.values())
    calls = []
    real = checksums.verify_chunks

    def spy(bufs, specs_):
        calls.append(len(bufs))
        return real(bufs, specs_)

    monkeypatch.setattr(checksums, "verify_chunks", spy)
    reads = start(specs, get_backend("posix", "cpu"), verify=True)
    for f in reads.futures:
        f.future.result()  # every read has landed (not yet verified)
    np.testing.assert_array_equal(reads.chunk(2), data[2:3])
    assert calls == [8]  # all eight in one call
    for i in (0, 1, 3, 4, 6, 7):
        np.testing.assert_array_equal(reads.chunk(i), data[i:i + 1])
    with pytest.raises(ChunkReadError) as e:
        reads.chunk(5)
    assert p in str(e.value)
    assert calls == [8]  # none hashed twice


def _hold_read(monkeypatch, byte_range: ByteRange) -> threading.Event:
    """Make the POSIX backend's reads inside ``byte_range`` wait until the returned event is set."""
    from gpulazy.io import _posix

    gate, real_preadv = threading.Event(), _posix._preadv

    def held(fd, buffers, offset):
        if byte_range.offset <= offset < byte_range.offset + byte_range.nbytes:
            assert gate.wait(30)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(_posix, "_preadv", held)
    return gate


def test_an_unverified_plain_chunk_finishes_with_the_landed_run_after_it_and_waits_for_no_other(tmp_path,
                                                                                               monkeypatch):
    """Without ``verify`` a chunk read as stored needs no work of the others: asking for it finishes
    it with the chunks right after it whose reads are in (one finish for a consumer taking them in
    order), up to the first still reading, so the first chunk a viewer needs waits for no other read."""
    from gpulazy.read import engine

    p, data = _raw(tmp_path, shape=(4, 16, 16))
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(1, 16, 16), device="cpu", cache=False)
    specs = list(vol.chunk_index.specs.values())
    gate = _hold_read(monkeypatch, specs[2].ranges[0])              # chunk 2's read waits at the gate
    finished = []
    real = engine.Reads._finish

    def spy(self, idx):
        finished.append(list(idx))
        return real(self, idx)

    monkeypatch.setattr(engine.Reads, "_finish", spy)
    try:
        reads = start(specs, get_backend("posix", "cpu", threads=2))
        for i in (0, 1, 3):
            reads.futures[i].result()
        assert not reads.futures[2].done()
        np.testing.assert_array_equal(reads.chunk(0), data[0:1])
        assert finished == [[0, 1]]                                   # not 2 (reading), nor 3 behind it
        np.testing.assert_array_equal(reads.chunk(1), data[1:2])
        assert finished == [[0, 1]]                                   # finished already
    finally:
        gate.set()
    np.testing.assert_array_equal(reads.chunk(2), data[2:3])
    np.testing.assert_array_equal(reads.chunk(3), data[3:4])
    assert finished == [[0, 1], [2, 3]]


def test_a_chunk_whose_read_landed_is_not_held_up_by_a_thread_waiting_for_another(tmp_path, monkeypatch):
    """Dask's threads each wait for their own chunk of one submission: a chunk whose read is in
    is handed out while another thread still waits for an earlier chunk's read."""
    p, data = _raw(tmp_path, shape=(2, 16, 16))
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(1, 16, 16), device="cpu", cache=False)
    specs = list(vol.chunk_index.specs.values())
    gate = _hold_read(monkeypatch, specs[0].ranges[0])              # chunk 0's read waits at the gate
    waiting, got = threading.Event(), {}

    class Announced:                                                  # says when a thread waits on it
        def __init__(self, future):
            self.future = future

        def done(self):
            return self.future.done()

        def result(self):
            waiting.set()
            return self.future.result()

    try:
        reads = start(specs, get_backend("posix", "cpu", threads=2))
        reads.futures[0] = Announced(reads.futures[0])
        reads.futures[1].result()                                     # chunk 1's read is in
        first_waiter = threading.Thread(target=lambda: got.update(a=reads.chunk(0)))
        first_waiter.start()
        assert waiting.wait(10)
        second = threading.Thread(target=lambda: got.update(b=reads.chunk(1)))
        second.start()
        second.join(10)
        assert not second.is_alive()                                  # not behind chunk 0's wait
    finally:
        gate.set()
    first_waiter.join(10)
    np.testing.assert_array_equal(got["b"], data[1:2])
    np.testing.assert_array_equal(got["a"], data[0:1])


def test_one_stat_checks_the_chunks_whose_reads_landed_before_it(tmp_path, monkeypatch):
    """Chunks finished one at a time (dask's pick tasks) share the identity stat taken after
    their reads landed: eight chunks of one file, one stat. A write after that stat is still
    caught for a chunk whose read had not landed when it was taken."""
    from gpulazy import integrity

    p, data = _raw(tmp_path, shape=(8, 16, 16))
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(1, 16, 16), device="cpu", cache=False)
    specs = list(vol.chunk_index.specs.values())
    stats = []
    real = integrity._changes

    def spy(ident):
        stats.append(ident)
        return real(ident)

    monkeypatch.setattr(integrity, "_changes", spy)
    reads = start(specs[:7], get_backend("posix", "cpu"))
    for f in reads.futures:
        f.result()                                                   # every read has landed
    for i in range(7):
        np.testing.assert_array_equal(reads.chunk(i), data[i:i + 1])
    assert len(stats) == 1

    gate = _hold_read(monkeypatch, specs[7].ranges[0])              # chunk 7's read waits at the gate
    try:
        late = start(specs[6:], get_backend("posix", "cpu", threads=2))
        np.testing.assert_array_equal(late.chunk(0), data[6:7])      # its stat: chunk 7 not landed
        with open(p, "ab") as f:                                     # the file grows after that stat
            f.write(b"\0\0")
    finally:
        gate.set()
    with pytest.raises(ChunkReadError) as e:
        late.chunk(1)
    assert p in str(e.value) and len(stats) == 3


# -- errors: each chunk its own, every read settled ------------------------------------------

def test_a_corrupt_chunk_fails_alone_in_its_batch(tmp_path):
    data = np.random.default_rng(2).integers(0, 999, (6, 16, 16)).astype("<u2")
    p = zstd_zarr(tmp_path / "v.zarr", data, (2, 16, 16))
    with open(f"{p}/c/1/0/0", "r+b") as f:  # garble the frame's header, keep its size
        f.write(b"\xff" * 8)
    vol = gpulazy.from_files(p, device="cpu", cache=False, chunks=(2, 16, 16))
    specs = list(vol.chunk_index.specs.values())
    bad = specs[1].ranges[0]
    reads = start(specs, get_backend("posix", "cpu"))
    np.testing.assert_array_equal(reads.chunk(0), data[0:2])
    with pytest.raises(ChunkDecodeError) as e:
        reads.chunk(1)
    assert bad.path in str(e.value)
    np.testing.assert_array_equal(reads.chunk(2), data[4:6])
    with pytest.raises(ChunkDecodeError):
        reads.result()


def test_a_short_file_raises_with_its_path_after_every_read_settled(tmp_path):
    p, data = _raw(tmp_path)
    specs = [ChunkSpec((ByteRange(p, 512 * i, 512),), (16, 16), "<u2", index=(i,)) for i in range(8)]
    specs.append(ChunkSpec((ByteRange(p, 4096, 512),), (16, 16), "<u2", index=(8,)))  # past the end
    reads = start(specs, get_backend("posix", "cpu"))
    with pytest.raises(ChunkReadError) as e:
        reads.result()
    assert p in str(e.value)
    assert all(reads.done(i) for i in range(len(specs)))
    np.testing.assert_array_equal(reads.chunk(3), data[3].reshape(16, 16))


def test_a_file_changed_after_indexing_fails_each_chunk_with_what_changed(tmp_path):
    # Nothing stats a file before its read: the stat after it catches a change made before.
    p, data = _raw(tmp_path)
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(2, 16, 16), device="cpu", cache=False)
    specs = list(vol.chunk_index.specs.values())
    np.zeros(data.shape, "<u2").tofile(p + ".new")
    import os

    os.replace(p + ".new", p)
    reads = start(specs, get_backend("posix", "cpu"))
    for i in range(len(specs)):
        with pytest.raises(ChunkReadError, match="changed since it was indexed") as e:
            reads.chunk(i)
        assert e.value.path == p and "inode" in str(e.value)


@pytest.mark.parametrize("change", ["truncated", "removed"])
def test_a_read_that_fails_on_a_changed_file_says_what_changed(tmp_path, change):
    # The read itself fails (a short read, a missing file); the error says why: the file changed
    # since indexing, with the read's own failure as its cause.
    import os

    p, data = _raw(tmp_path)
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(2, 16, 16), device="cpu", cache=False)
    specs = list(vol.chunk_index.specs.values())
    if change == "truncated":
        os.truncate(p, 100)
    else:
        os.remove(p)
    reads = start(specs, get_backend("posix", "cpu"))
    with pytest.raises(ChunkReadError, match="changed since it was indexed") as e:
        reads.chunk(len(specs) - 1)
    assert e.value.path == p
    assert ("size 4096 -> 100" if change == "truncated" else "can no longer be found") in str(e.value)
    assert e.value.__cause__ is not None and "changed since" not in str(e.value.__cause__)


def test_a_file_written_during_the_read_fails_every_chunk_of_it_with_one_stat(tmp_path, monkeypatch):
    # After the reads land, each file is stat'ed once for all the chunks that read it (the
    # whole-array path finishes thousands of one-file chunks at a time); a file written
    # meanwhile fails each of its chunks with its path, and a file left alone fails none.
    import os

    p, data = _raw(tmp_path)
    q = str(tmp_path / "b.raw")
    data.tofile(q)
    specs = [gpulazy.from_files(path, shape=data.shape, dtype="<u2", chunks=(2, 16, 16), device="cpu",
                                cache=False).chunk_index.specs[(i, 0, 0)] for path in (p, q) for i in range(4)]
    reads = start(specs, get_backend("posix", "cpu"))
    with open(q, "r+b") as f:  # written to after the reads were submitted
        f.write(b"\1\2")
    os.utime(q, ns=(1, 1))
    stats: list[str] = []
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: (stats.append(path) if path in (p, q) else None)
                        or real(path, *a, **k))
    reads.settle()  # as the whole-array path finishes a submission: all its chunks at once
    for i in range(4):
        np.testing.assert_array_equal(reads.chunk(i), data[2 * i:2 * i + 2])
    for i in range(4, 8):
        with pytest.raises(ChunkReadError, match="changed since it was indexed") as e:
            reads.chunk(i)
        assert e.value.path == q
    assert sorted(stats) == sorted([p, q])


def _settle_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("gpulazy-settle")]


def test_settle_threads_settle_several_submissions_at_once():
    import threading

    from gpulazy.read.whole import SETTLERS, _Settler

    assert SETTLERS >= 2
    barrier = threading.Barrier(SETTLERS, timeout=60)  # passed only if that many settles run at the same time

    class Submission:
        def settle(self) -> None:
            barrier.wait()

    settler = _Settler(True, workers=SETTLERS)
    waits = [settler.add(Submission()) for _ in range(SETTLERS)]
    for wait in waits:
        wait()
    settler.close()
    assert not barrier.broken


def test_a_whole_read_in_many_submissions_settled_on_threads_gives_every_value(tmp_path, monkeypatch):
    from gpulazy.read import whole

    monkeypatch.setattr(whole, "GROUP", 1024)  # a submission per chunk or two: many of them in flight
    data = np.random.default_rng(3).integers(0, 999, (24, 32, 32)).astype("<u2")
    p = zstd_zarr(tmp_path / "v.zarr", data, (2, 16, 16))
    vol = gpulazy.from_files(p, device="cpu", cache=False, chunks=(4, 32, 32))
    np.testing.assert_array_equal(vol.compute(), data)
    np.testing.assert_array_equal(vol.compute(), data)
    assert len(_settle_threads()) <= max(whole.SETTLERS, whole.STREAM_SETTLERS)  # kept for the next read, not one more per read


@pytest.mark.parametrize("how", ["compute", "max"])  # the whole-array path; a streamed reduction's groups
def test_a_corrupt_chunk_in_a_later_submission_raises_with_its_path_and_leaks_no_thread(tmp_path, monkeypatch, how):
    from gpulazy.read import whole

    monkeypatch.setattr(whole, "GROUP", 1024)
    data = np.random.default_rng(4).integers(0, 999, (24, 32, 32)).astype("<u2")
    p = zstd_zarr(tmp_path / "v.zarr", data, (2, 16, 16))
    with open(f"{p}/c/9/1/0", "r+b") as f:  # garble the frame's header, keep its size
        f.write(b"\xff" * 8)
    vol = gpulazy.from_files(p, device="cpu", cache=False, chunks=(4, 32, 32))
    with pytest.raises(ChunkDecodeError) as e:
        (vol.compute() if how == "compute" else vol.max(axis=0).compute())
    assert "c/9/1/0" in str(e.value)
    assert len(_settle_threads()) <= max(whole.SETTLERS, whole.STREAM_SETTLERS)


def test_deflate_submissions_decode_side_by_side_until_nvcomp_has_enough_pieces():
    # One nvCOMP Deflate call takes about one stream's time whatever its size: submissions of few
    # large pieces decode several at once (up to STREAM_SETTLERS, as the bytes held allow); small
    # pieces fill nvCOMP in one submission, and zstd keeps SETTLERS (its scratch is three times its output).
    from gpulazy.read.whole import SETTLERS, STREAM_PIECES, STREAM_SETTLERS, settlers, stream_calls
    from gpulazy.spec import ByteRange, ChunkSpec, Codec

    def spec(codec, stored):
        return ChunkSpec((ByteRange("f", 0, stored),), (stored,), "u1", codec=None if codec is None else (codec,))

    zlib, zstd, GiB = Codec.of("zlib", level=1), Codec("zstd"), 1 << 30
    big, small = [spec(zlib, 4 << 20)] * 8, [spec(zlib, 256 << 10)] * 8  # HDF5's 4 MiB chunks, TIFF-like tiles
    assert stream_calls(big, GiB) == min(STREAM_SETTLERS, STREAM_PIECES * 4 // 1024) == 4
    assert settlers(big + [spec(None, 10)], 4 * GiB, GiB) == 4
    assert settlers(big, 2 * GiB, GiB) == 2  # as many as the bytes held allow
    assert settlers(big, 1 << 20, GiB) == 1
    assert stream_calls(small, GiB) == 1 and settlers(small, 4 * GiB, GiB // 2) == SETTLERS
    assert stream_calls([spec(zstd, 4 << 20)], GiB) == 0
    assert SETTLERS == 3
    assert settlers([spec(zstd, 4 << 20)], 4 * GiB, GiB // 2) == 3  # each holds twice its bytes: three fit
    assert settlers([spec(zstd, 4 << 20)], 4 * GiB, GiB) == 2
    assert settlers([spec(zstd, 4 << 20)], GiB, GiB) == 1


def test_a_read_of_half_an_array_settles_all_its_submissions_at_once():
    # Submissions grow to DECODE_GROUP (1 GiB), but a read of 960 MiB of zstd chunks makes three of
    # 256, 512 and 192 MiB: sized by the largest it makes, all three settle at once (on an H200 the
    # last one no longer waited 30 ms for a slot: [0:128] of a 2 GiB Zarr in 47 ms, not 53).
    from gpulazy.read.whole import GROUP, _largest_group, groups_by_bytes, settlers
    from gpulazy.spec import ByteRange, ChunkSpec, Codec

    def spec(codec, stored):
        return ChunkSpec((ByteRange("f", 0, stored),), (stored,), "u1", codec=(codec,))

    MiB, GiB = 1 << 20, 1 << 30
    chunks = [spec(Codec("zstd"), 32 * MiB)] * 30
    heads = [spec(Codec.of("head", of="zstd", size=64 * MiB), MiB)] * 4
    assert [sum(s.nbytes for s in g) for g in groups_by_bytes(chunks, lambda s: s.nbytes, grow_to=GiB)] == [
        GROUP, 2 * GROUP, 192 * MiB]
    assert _largest_group(chunks + heads, GiB) == 512 * MiB  # heads take no settle slot
    assert settlers(chunks, 4 * GiB, _largest_group(chunks, GiB)) == 3
    assert settlers(chunks, 4 * GiB, GiB) == 2
    assert _largest_group(heads, GiB) == GROUP  # none takes a slot


# -- kept handles: no stat before a read of a file kept open as indexed ---------------------------

def test_a_file_kept_open_as_indexed_is_read_without_a_stat_before(tmp_path, monkeypatch):
    from gpulazy.io._handles import HandleCache

    p, data = _raw(tmp_path)
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(2, 16, 16), device="cpu", cache=False)
    specs = list(vol.chunk_index.specs.values())
    backend = get_backend("posix", "cpu")
    read(specs, backend)                                             # opens the file, keeps it
    stats = []
    real = HandleCache.acquire
    monkeypatch.setattr(HandleCache, "acquire", lambda self, path, st=None: stats.append(path) or real(self, path, st))
    got = read(specs, backend)
    np.testing.assert_array_equal(np.concatenate(got), data)
    assert stats == []                                               # served by HandleCache.reuse_many


@pytest.mark.parametrize("change", ["replaced", "rewritten in place"])
def test_a_kept_handle_never_hides_a_change(tmp_path, change):
    # The kept handle still reads the file as it was indexed (replaced: the old inode) or its new
    # bytes (rewritten): the stat after the read fails the chunks either way, and a new index
    # reads the file as it is now through a handle opened anew.
    import os

    p, data = _raw(tmp_path)
    vol = gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(2, 16, 16), device="cpu", cache=False)
    specs = list(vol.chunk_index.specs.values())
    backend = get_backend("posix", "cpu")
    read(specs, backend)
    new = (data + 1).astype("<u2")
    if change == "replaced":
        new.tofile(p + ".new")
        os.replace(p + ".new", p)
    else:
        with open(p, "r+b") as f:
            f.write(new.tobytes())
    reads = start(specs, backend)
    for i in range(len(specs)):
        with pytest.raises(ChunkReadError, match="changed since it was indexed"):
            reads.chunk(i)
    again = list(gpulazy.from_files(p, shape=data.shape, dtype="<u2", chunks=(2, 16, 16), device="cpu",
                                    cache=False).chunk_index.specs.values())
    np.testing.assert_array_equal(np.concatenate(read(again, backend)), new)


def test_an_out_of_memory_error_names_what_was_being_read(tmp_path):
    """``reading`` is what ``start_retrying`` and the dask path's chunk loads put in a ``DeviceMemoryError``."""
    from gpulazy.read.engine import reading

    p = str(tmp_path / "a.raw")
    specs = [ChunkSpec((ByteRange(p, 8 * i, 8),), (4,), "<u2", index=(i,)) for i in range(3)]
    assert reading(specs[1:2]) == f"reading chunk (1,) of {p!r}"
    assert reading(specs) == f"reading 3 chunks from (0,) of {p!r}"
    empty = ChunkSpec((), (0,), "<u2", index=(0,))
    assert reading([empty]) == "reading a chunk" and reading([empty, empty]) == "reading chunks"


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 8), data=st.data(), dtype=st.sampled_from(["<u2", ">u2"]))
def test_asked_in_any_order_chunks_equal_the_file_and_no_finish_takes_a_chunk_still_reading(n, data, dtype):
    """Chunks read as stored, some held in flight: asked for in any order (a held one once let go),
    each equals the file's bytes, and no finish (a chunk with the landed run after it) ever holds a
    chunk whose read was still held, nor finishes one twice."""
    import tempfile
    from unittest import mock

    from gpulazy.io import _posix
    from gpulazy.read import engine

    held = set(data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n - 1), label="held"))
    order = data.draw(st.permutations(range(n)), label="order")
    with tempfile.TemporaryDirectory() as tmp:
        values = np.random.default_rng(n).integers(0, 60000, (n, 4, 8)).astype(dtype)
        p = os.path.join(tmp, "v.raw")
        values.tofile(p)
        vol = gpulazy.from_files(p, shape=values.shape, dtype=dtype, chunks=(1, 4, 8), device="cpu", cache=False)
        specs = list(vol.chunk_index.specs.values())
        gates = {specs[i].ranges[0].offset: threading.Event() for i in held}
        real_preadv, real_finish = _posix._preadv, engine.Reads._finish
        finished: list[int] = []

        def gated(fd, buffers, offset):
            gate = gates.get(offset)
            if gate is not None:
                assert gate.wait(30)
            return real_preadv(fd, buffers, offset)

        def spy(self, idx):
            assert not [i for i in idx if specs[i].ranges[0].offset in gates
                        and not gates[specs[i].ranges[0].offset].is_set()], "a held chunk was finished"
            finished.extend(idx)
            return real_finish(self, idx)

        with mock.patch.object(_posix, "_preadv", gated), mock.patch.object(engine.Reads, "_finish", spy):
            try:
                # (a thread a read: none waits behind a held one)
                reads = start(specs, get_backend("posix", "cpu", threads=8))
                for i in range(n):
                    if i not in held:
                        reads.futures[i].result()                 # every read not held has landed
                for i in order:
                    if i in held:
                        gates[specs[i].ranges[0].offset].set()    # let it land, then ask for it
                    native = values[i:i + 1].astype(values.dtype.newbyteorder("="))
                    np.testing.assert_array_equal(reads.chunk(i), native)
            finally:
                for gate in gates.values():
                    gate.set()
                reads.settle()
        assert sorted(finished) == list(range(n))                 # each chunk finished once
