"""``verify=True`` at speed: block hashes computed on every core (and on a GPU, by a kernel) are
the manifest's, and a flipped byte anywhere is still caught naming the file, offset and block.

The thresholds that send work to the verify pool are lowered here so that small files take
the parallel path, with many jobs.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import xxhash

import gpulazy
from gpulazy import _hashing, _xxh3_gpu, checksums
from gpulazy.checksums import block_hash, manifest_entry, write_manifest
from gpulazy.errors import ChunkReadError
from gpulazy.testing import flip_byte

BLOCK = 64 << 10
SIZE = 20 * BLOCK + 12345  # a short last block


@pytest.fixture
def parallel(monkeypatch):
    """Every check of more than one job goes to the pool, in jobs of one or two blocks."""
    monkeypatch.setattr(_hashing, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(_hashing, "JOB_BYTES", BLOCK)
    monkeypatch.setattr(_hashing, "JOB_MAX", 2 * BLOCK)


def _file(tmp_path, size=SIZE):
    p = tmp_path / "data.raw"
    data = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    data.tofile(p)
    return str(p), data


@pytest.mark.timeout(60)
@pytest.mark.parametrize("block", [BLOCK, BLOCK + 3, 4 * BLOCK])
def test_parallel_manifest_equals_serial_block_hashes(tmp_path, parallel, monkeypatch, block):
    path, data = _file(tmp_path)
    threads = set()
    span = checksums._hash_file_span

    def spy(*args):
        threads.add(threading.current_thread().name)
        return span(*args)

    monkeypatch.setattr(checksums, "_hash_file_span", spy)
    write_manifest([path], block_size=block)
    serial = b"".join(block_hash(data[at: at + block]) for at in range(0, len(data), block))
    entry = manifest_entry(path)
    assert entry.nblocks == -(-SIZE // block)
    assert b"".join(entry.digest(b) for b in range(entry.nblocks)) == serial
    assert any(t.startswith("gpulazy-verify") for t in threads)  # the pool hashed some of it


@pytest.mark.timeout(60)
def test_parallel_verify_reads_a_good_file_and_names_every_flipped_block(tmp_path, parallel):
    path, data = _file(tmp_path)
    write_manifest([path], block_size=BLOCK)
    chunk = 3 * BLOCK + 1001  # chunks cut blocks: edge blocks mix the chunk's bytes and the file's

    def read():
        return gpulazy.from_files(path, dtype="u1", chunks=chunk, device="cpu", cache=False, verify=True).compute()

    np.testing.assert_array_equal(read(), data)
    for at in (5, 7 * BLOCK + 100, chunk + 3, 2 * chunk - 1, SIZE - 1):  # first, whole, edge, edge, short last
        flip_byte(path, at)
        with pytest.raises(ChunkReadError, match=rf"block {at // BLOCK}\b") as info:
            read()
        _names_the_block(info.value, path, at, BLOCK)
        flip_byte(path, at)  # back: the next position is the only damage
    np.testing.assert_array_equal(read(), data)


def _names_the_block(err, path, at, block):
    """``err`` names ``path`` and the block holding byte ``at``; its offset and byte count are the
    chunk's bytes in that block (a chunk that reads only part of a damaged block is the one that
    finds it, if it comes first: the rest of the block is read from the file)."""
    start = at // block * block
    assert err.path == path and os.path.basename(path) in str(err)
    assert f"bytes {start}..{min(start + block, SIZE)}" in str(err)
    assert start <= err.offset and err.offset + err.expected <= start + block


@pytest.mark.timeout(60)
def test_the_first_failing_job_in_order_is_raised(tmp_path, parallel):
    path, _ = _file(tmp_path)
    write_manifest([path], block_size=BLOCK)
    for at in (3 * BLOCK + 1, 15 * BLOCK + 2):
        flip_byte(path, at)
    with pytest.raises(ChunkReadError, match=r"block 3\b"):
        gpulazy.read_file(path, device="cpu", verify=True)


def _stored(path, specs):
    data = np.fromfile(path, np.uint8)
    return [np.concatenate([data[r.offset: r.offset + r.nbytes] for r in spec.ranges]) for spec in specs]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", [False, True], ids=["serial", "pool"])
def test_a_batch_reports_each_chunk_alone(tmp_path, monkeypatch, pool):
    if pool:
        monkeypatch.setattr(_hashing, "PARALLEL_BYTES", 0)
        monkeypatch.setattr(_hashing, "JOB_BYTES", BLOCK)
    path, _ = _file(tmp_path)
    write_manifest([path], block_size=BLOCK)
    specs = list(gpulazy.from_files(path, dtype="u1", chunks=3 * BLOCK + 1001, device="cpu").chunk_index.specs.values())
    bufs = _stored(path, specs)
    assert checksums.verify_chunks(bufs, specs) == [None] * len(specs)
    bufs[1][BLOCK] ^= 1    # in memory: a whole block of chunk 1 (file block 4)
    bufs[4][-1] ^= 1       # the last byte of chunk 4: an edge block (file block 15)
    errors = checksums.verify_chunks(bufs, specs)
    assert [k for k, e in enumerate(errors) if e is not None] == [1, 4]
    for k, block in ((1, 4), (4, 15)):
        assert isinstance(errors[k], ChunkReadError) and f"(block {block})" in str(errors[k])
        assert errors[k].path == path


@pytest.mark.timeout(60)
def test_settle_many_verifies_a_batch_once_and_each_chunk_raises_its_own(tmp_path, monkeypatch):
    from gpulazy.io import get_backend
    from gpulazy.read import start

    path, _ = _file(tmp_path)
    write_manifest([path], block_size=BLOCK)
    flip_byte(path, 7 * BLOCK + 5)  # chunk 2 (bytes 395218 ..) holds block 7 whole
    specs = list(gpulazy.from_files(path, dtype="u1", chunks=3 * BLOCK + 1001, device="cpu").chunk_index.specs.values())
    singles = []
    real = checksums.verify_chunk
    monkeypatch.setattr(checksums, "verify_chunk", lambda buf, s: singles.append(s) or real(buf, s))
    reads = start(specs, get_backend("posix", "cpu"), verify=True)
    checksums.VerifiedRead.settle_many(reads.futures)
    chunk = 3 * BLOCK + 1001
    for k in range(len(specs)):
        if k == 2:
            with pytest.raises(ChunkReadError, match=r"block 7\b"):
                reads.chunk(k)
        else:
            np.testing.assert_array_equal(reads.chunk(k), np.fromfile(path, np.uint8)[k * chunk: (k + 1) * chunk])
    assert singles == []  # every chunk was verified in the batch, none again alone


@pytest.mark.timeout(60)
def test_device_plan_covers_each_whole_block_once(tmp_path):
    """The kernel's work list, checked with xxhash on the host: every block's start and length
    in the buffer hash to the manifest's, and blocks too short for the kernel go to the host."""
    path, data = _file(tmp_path)
    write_manifest([path], block_size=BLOCK)
    entry = manifest_entry(path)
    offset = BLOCK - 77  # the chunk's bytes start inside block 0: its first whole block is 1
    flat = data[offset:]
    b0, b1 = checksums._whole_blocks(entry, offset, len(flat))
    assert (b0, b1) == (1, entry.nblocks)
    on_device, starts, lengths, left = checksums._device_plan(
        [(path, entry, b0, b1, BLOCK - offset)], _xxh3_gpu.MIN_BYTES)
    assert [r[2:] for r in on_device] == [(1, entry.nblocks)] and left == []
    got = b"".join(xxhash.xxh3_128_digest(flat[s: s + n]) for s, n in zip(starts, lengths))
    assert got == b"".join(entry.digest(b) for b in range(1, entry.nblocks))
    # A last block of 100 bytes is hashed on the host; a manifest of tiny blocks entirely.
    short = tmp_path / "short.raw"
    data[: 2 * BLOCK + 100].tofile(short)
    write_manifest([str(short)], block_size=BLOCK)
    e = manifest_entry(str(short))
    on_device, starts, lengths, left = checksums._device_plan([(str(short), e, 0, 3, 0)], _xxh3_gpu.MIN_BYTES)
    assert [r[2:] for r in on_device] == [(0, 2)] and list(lengths) == [BLOCK, BLOCK]
    assert [r[2:] for r in left] == [(2, 3, 2 * BLOCK)]
    write_manifest([str(short)], block_size=200)
    e = manifest_entry(str(short))
    on_device, _, _, left = checksums._device_plan([(str(short), e, 0, e.nblocks, 0)], _xxh3_gpu.MIN_BYTES)
    assert on_device == [] and [r[2:] for r in left] == [(0, e.nblocks, 0)]


@pytest.mark.parametrize("n", [241, 1023, 1024, 1025, 2047, 4096 + 7, BLOCK, BLOCK + 13])
@pytest.mark.parametrize("start", [0, 3])
def test_kernel_arithmetic_equals_xxhash(n, start):
    data = np.random.default_rng(n).integers(0, 256, n + start, dtype=np.uint8)[start:]
    assert _xxh3_gpu.hash_on_host(data) == xxhash.xxh3_128_digest(data)


# -- on a GPU -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_kernel_equals_xxhash_on_the_gpu():
    import cupy

    assert _xxh3_gpu.usable(0)
    host = np.random.default_rng(3).integers(0, 256, 8 << 20, dtype=np.uint8)
    rng = np.random.default_rng(4)
    starts = rng.integers(0, 4 << 20, 500).astype(np.uint64)
    lengths = rng.integers(241, 4 << 20, 500).astype(np.uint64)
    want = b"".join(xxhash.xxh3_128_digest(host[int(s): int(s) + int(n)]) for s, n in zip(starts, lengths))
    stream = cupy.cuda.Stream(non_blocking=True)
    buf = cupy.asarray(host)
    assert _xxh3_gpu.block_digests(0, buf.data.ptr + starts, lengths, stream) == want


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", [BLOCK, 200])  # hashed on the GPU; tiny blocks: on the host
def test_gpu_verify_reads_a_good_file_and_names_every_flipped_block(tmp_path, block):
    from conftest import to_host

    path, data = _file(tmp_path)
    write_manifest([path], block_size=block)
    chunk = 3 * BLOCK + 1001

    def read(scheduler=None):
        vol = gpulazy.from_files(path, dtype="u1", chunks=chunk, device="cuda:0", cache=False, verify=True)
        return to_host(vol.compute() if scheduler is None else (vol + 0).compute(scheduler=scheduler))

    np.testing.assert_array_equal(read(), data)
    np.testing.assert_array_equal(read("threads"), data)
    for at in (5, 7 * BLOCK + 100, chunk + 3, SIZE - 1):
        flip_byte(path, at)
        for scheduler in (None, "threads"):
            with pytest.raises(ChunkReadError, match=rf"block {at // block}\b") as info:
                read(scheduler)
            _names_the_block(info.value, path, at, block)
        flip_byte(path, at)
    assert os.path.getsize(path) == SIZE


@pytest.mark.timeout(60)
def test_kernel_compiles_for_hopper(tmp_path):
    """The kernel's source compiles (nvcc, where installed; no GPU needed): a typo would otherwise
    show only on a GPU host, as the fallback's warning."""
    import shutil
    import subprocess

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    src = tmp_path / "xxh3.cu"
    src.write_text(_xxh3_gpu._SOURCE)
    done = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", str(tmp_path / "xxh3.cubin"), str(src)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
