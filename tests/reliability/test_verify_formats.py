"""``verify=True`` on every read path, for every format whose chunks are assembled from stored pieces.

Each case writes a small array, checksums it (``write_manifest``, what ``gpulazy index
--checksum`` runs), flips one stored byte inside a chunk and sets the file's mtime back.
The array is then indexed anew (``from_files`` after the flip, so the identity check has
nothing to notice: only the checksums can) and every way of reading it must raise
``ChunkReadError`` naming the file: the whole-array ``.compute()``, a block slice's
``.compute()`` (both the fast path, which once decoded these chunks unverified), and a
reduction through dask's scheduler.

Then the two corruptions a CRC cannot see (manifest format 1 stored CRC32C): a Zarr shard
index rewritten with its crc32c recomputed, and a crc32c-coded chunk file swapped for
another of the same length.
"""

from __future__ import annotations

import json
import os
import shutil

import dask.array as da
import numpy as np
import pytest

import gpulazy
from gpulazy.checksums import MANIFEST_NAME, block_hash, crc32c, write_manifest
from gpulazy.errors import ChunkReadError, LayoutError

from .test_verify import _flip_on_disk

SHAPE = (4, 32, 48)
BLOCK = 512  # small manifest blocks: a flip is located to a few hundred bytes


@pytest.fixture(scope="module", autouse=True)
def _zarr_io_thread():
    """zarr starts one event-loop thread per process on first use, by design: start it before
    the per-test leak check takes its snapshot."""
    zarr = pytest.importorskip("zarr")
    zarr.create_array({}, shape=(1,), dtype="u1")[...] = 1


def _data():
    rng = np.random.default_rng(0)
    return (rng.integers(0, 50, SHAPE) + np.arange(SHAPE[2])).astype("<u2")  # compressible, not constant


def _tiff(tmp_path):
    tifffile = pytest.importorskip("tifffile")
    pytest.importorskip("imagecodecs")
    p = tmp_path / "a.tif"
    tifffile.imwrite(p, _data(), tile=(16, 16), compression="zlib", photometric="minisblack")
    return str(p), {}


def _zarr(tmp_path, **kw):
    zarr = pytest.importorskip("zarr")
    p = tmp_path / "a.zarr"
    z = zarr.create_array(str(p), shape=SHAPE, dtype="<u2", **kw)
    z[...] = _data()
    return str(p), {}


def _zarr_v2(tmp_path):
    import numcodecs

    return _zarr(tmp_path, zarr_format=2, chunks=(1, 16, 16), compressors=numcodecs.Zstd())


def _zarr_v3(tmp_path):
    from zarr.codecs import ZstdCodec

    return _zarr(tmp_path, chunks=(1, 16, 16), compressors=ZstdCodec())


def _zarr_f_order(tmp_path):
    return _zarr(tmp_path, zarr_format=2, chunks=(1, 16, 16), order="F", compressors=None)


def _zarr_sharded(tmp_path):
    from zarr.codecs import ZstdCodec

    return _zarr(tmp_path, chunks=(1, 8, 16), shards=(1, 16, 48), compressors=ZstdCodec())


def _hdf5(tmp_path):
    h5py = pytest.importorskip("h5py")
    p = tmp_path / "a.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("data", data=_data(), chunks=(1, 16, 16), shuffle=True, compression="gzip")
    return str(p), {"dataset": "data"}


FORMATS = {"tiled zlib TIFF": _tiff, "zstd Zarr v2": _zarr_v2, "zstd Zarr v3": _zarr_v3,
           "F-order Zarr v2": _zarr_f_order, "sharded zstd Zarr v3": _zarr_sharded, "shuffle+gzip HDF5": _hdf5}

READS = {
    "whole-array compute": lambda v: v.compute(),
    "block slice compute": lambda v: v[1:3].compute(),
    "max through dask": lambda v: v.max(axis=0).compute(scheduler="threads"),
}


def _open(path, opts, **kw):
    return gpulazy.from_files(path, chunks=(1, 32, 48), device="cpu", cache=False, **opts, **kw)


def _stored_byte_of_plane(vol, plane):
    """A file and an offset inside a stored piece of plane ``plane``'s chunk."""
    spec = vol.chunk_index.specs[(plane, 0, 0)]
    r = spec.ranges[len(spec.ranges) // 2]
    return r.path, r.offset + r.nbytes // 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_flipped_stored_byte_fails_every_read_path(tmp_path, fmt):
    path, opts = FORMATS[fmt](tmp_path)
    write_manifest(path if os.path.isdir(path) else [path], block_size=BLOCK)
    for read in READS.values():  # verified reads of intact files equal the reference
        want = read(da.from_array(_data(), chunks=(1, 32, 48)))
        np.testing.assert_array_equal(read(_open(path, opts, verify=True)), want)
    victim, at = _stored_byte_of_plane(_open(path, opts), 2)
    _flip_on_disk(victim, at)
    for how, read in READS.items():
        vol = _open(path, opts, verify=True)  # indexed after the flip: only the checksums can tell
        with pytest.raises(ChunkReadError, match="failed verification") as info:
            read(vol)
        assert info.value.path == victim, how
        assert victim in str(info.value) and info.value.offset <= at < info.value.offset + info.value.expected, how


@pytest.mark.timeout(120)
def test_a_shard_index_rewritten_with_its_crc32c_recomputed_is_caught(tmp_path):
    """Two inner chunks' index entries swapped, the index's crc32c recomputed: the shard
    stays valid Zarr, every chunk's bytes are intact, but two chunks trade places."""
    path, opts = _zarr_sharded(tmp_path)
    write_manifest(path, block_size=BLOCK)
    shard = os.path.join(path, "c", "1", "0", "0")
    blob = bytearray(open(shard, "rb").read())
    n = 2 * 3  # inner chunks per shard: (1, 16, 48) / (1, 8, 16)
    index_at = len(blob) - (16 * n + 4)
    entries = np.frombuffer(bytes(blob[index_at: index_at + 16 * n]), "<u8").reshape(n, 2).copy()
    entries[[0, 1]] = entries[[1, 0]]
    payload = entries.tobytes()
    blob[index_at:] = payload + np.uint32(crc32c(payload)).astype("<u4").tobytes()
    st = os.stat(shard)
    with open(shard, "r+b") as f:
        f.write(blob)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    swapped = gpulazy.from_files(path, device="cpu", cache=False).compute()
    assert not np.array_equal(swapped, _data())  # unverified: valid Zarr, wrong data
    with pytest.raises(ChunkReadError, match="failed verification") as info:
        _open(path, opts, verify=True).compute()
    assert info.value.path == shard


@pytest.mark.timeout(120)
def test_a_crc32c_coded_chunk_swapped_for_another_of_the_same_length_is_caught(tmp_path):
    """Each chunk file carries a valid crc32c, so Zarr's own check passes: only the manifest,
    written before the swap, knows which bytes belong where."""
    from zarr.codecs import Crc32cCodec

    path, opts = _zarr(tmp_path, chunks=(1, 32, 48), compressors=Crc32cCodec())
    write_manifest(path, block_size=BLOCK)
    a, b = (os.path.join(path, "c", str(i), "0", "0") for i in (0, 1))
    assert os.path.getsize(a) == os.path.getsize(b)
    st = os.stat(b)
    shutil.copyfile(a, b)
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
    for how, read in READS.items():
        vol = _open(path, opts, verify=True)  # indexed after the swap: its identity is the new file's
        with pytest.raises(ChunkReadError, match="failed verification") as info:
            read(vol)
        assert info.value.path == b, how


def test_why_a_crc_cannot_catch_these_and_the_block_hash_can():
    """Two different files, each ending in the CRC32C of the bytes before it, have one CRC32C
    (the residue, a constant per length); their XXH3-128 hashes differ."""
    def sealed(body):
        return body + np.uint32(crc32c(body)).astype("<u4").tobytes()

    one, two = sealed(b"the first chunk"), sealed(b"a second chunk!")
    assert one != two and len(one) == len(two)
    assert crc32c(one) == crc32c(two)
    assert block_hash(one) != block_hash(two)


@pytest.mark.timeout(60)
def test_an_old_crc32c_manifest_asks_to_index_again(tmp_path):
    p = tmp_path / "a.raw"
    np.arange(100, dtype="<u2").tofile(p)
    old = {"format": "gpulazy-checksums", "version": 1, "algorithm": "crc32c",
           "files": {"a.raw": {"size": 200, "mtime_ns": 0, "block_size": 256, "crc32c": "00000000"}}}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(old))
    with pytest.raises(LayoutError, match=r"version 1 .*re-run gpulazy index --checksum"):
        gpulazy.from_files(str(p), dtype="<u2", device="cpu", verify=True)
    write_manifest([str(p)])  # replaces the old manifest rather than merging into it
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["version"] == 2
    np.testing.assert_array_equal(gpulazy.from_files(str(p), dtype="<u2", device="cpu", verify=True).compute(),
                                  np.arange(100, dtype="<u2"))


@pytest.mark.timeout(60)
def test_big_chunks_hash_their_blocks_in_threads_and_still_name_the_block(tmp_path):
    p = tmp_path / "big.raw"
    data = np.random.default_rng(1).integers(0, 256, 24 << 20, dtype=np.uint8)  # 3 x the threaded threshold
    data.tofile(p)
    write_manifest([str(p)], block_size=1 << 20)
    np.testing.assert_array_equal(gpulazy.read_file(str(p), device="cpu", verify=True), data)
    _flip_on_disk(str(p), (17 << 20) + 5)
    with pytest.raises(ChunkReadError, match=r"block 17\b") as info:
        gpulazy.read_file(str(p), device="cpu", verify=True)
    assert info.value.path == str(p)


@pytest.mark.timeout(60)
def test_read_ahead_and_batched_reads_verify_too(tmp_path):
    """``ChunkSource.start`` (read-ahead) and ``load_many`` (a batch) check the bytes as they land."""
    path, opts = _zarr_v3(tmp_path)
    write_manifest(path, block_size=BLOCK)
    victim, at = _stored_byte_of_plane(_open(path, opts), 1)
    _flip_on_disk(victim, at)
    vol = _open(path, opts, verify=True)
    specs = tuple(vol.chunk_index.specs.values())
    np.testing.assert_array_equal(vol.chunk_source.start([specs[0]])[0].result(), _data()[:1])
    for read in (lambda: vol.chunk_source.start([specs[1]])[0].result(),
                 lambda: vol.chunk_source.load_many(specs)):
        with pytest.raises(ChunkReadError, match="failed verification") as info:
            read()
        assert info.value.path == victim


@pytest.mark.timeout(60)
def test_metadata_blocks_are_verified_unless_the_file_is_mostly_something_else(tmp_path, monkeypatch):
    from gpulazy import checksums

    h5py = pytest.importorskip("h5py")
    p = tmp_path / "two.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("data", data=_data(), chunks=(1, 16, 16), shuffle=True, compression="gzip")
        f.create_dataset("other", data=np.arange(20000, dtype="<u4"))  # 80 kB no chunk of "data" reads
    write_manifest([str(p)], block_size=BLOCK)
    vol = gpulazy.from_files(str(p), dataset="data", device="cpu", verify=True)
    np.testing.assert_array_equal(vol.compute(), _data())
    monkeypatch.setattr(checksums, "_METADATA_BYTES", 4096)
    with pytest.warns(UserWarning, match="two.h5.*only the chunks' own bytes are verified"):
        vol = gpulazy.from_files(str(p), dataset="data", device="cpu", verify=True)
    np.testing.assert_array_equal(vol.compute(), _data())


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["zstd Zarr v3", "shuffle+gzip HDF5", "sharded zstd Zarr v3"])
def test_a_flipped_stored_byte_fails_every_read_path_on_the_gpu(tmp_path, fmt):
    from conftest import to_host

    path, opts = FORMATS[fmt](tmp_path)
    write_manifest(path if os.path.isdir(path) else [path], block_size=BLOCK)
    gpu = dict(opts, device="cuda:0")
    vol = gpulazy.from_files(path, chunks=(1, 32, 48), cache=False, verify=True, **gpu)
    np.testing.assert_array_equal(to_host(vol.compute()), _data())
    victim, at = _stored_byte_of_plane(vol, 2)
    _flip_on_disk(victim, at)
    for how, read in READS.items():
        vol = gpulazy.from_files(path, chunks=(1, 32, 48), cache=False, verify=True, **gpu)
        with pytest.raises(ChunkReadError, match="failed verification") as info:
            read(vol)
        assert info.value.path == victim, how


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["zstd Zarr v2", "zstd Zarr v3"])
def test_a_store_metadata_file_changed_to_another_valid_one_is_caught(tmp_path, fmt):
    """The dtype in ``.zarray``/``zarr.json`` changed from unsigned to signed (same length, still
    valid): every chunk's bytes are intact, but they would be read as other values."""
    path, opts = FORMATS[fmt](tmp_path)
    write_manifest(path, block_size=BLOCK)
    meta = os.path.join(path, ".zarray" if fmt.endswith("v2") else "zarr.json")
    assert ".zarray" in json.loads(open(os.path.join(path, MANIFEST_NAME)).read())["files"] or "v3" in fmt
    text = open(meta).read()
    signed = text.replace('"<u2"', '"<i2"') if "v2" in fmt else text.replace('"uint16"', '"int16" ')
    assert signed != text and len(signed) == len(text)
    st = os.stat(meta)
    with open(meta, "w") as f:
        f.write(signed)
    os.utime(meta, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ChunkReadError, match="failed verification") as info:
        _open(path, opts, verify=True)
    assert info.value.path == meta


@pytest.mark.timeout(60)
def test_a_verified_read_checks_its_bytes_once_whichever_threads_ask(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from gpulazy import checksums
    from gpulazy.io import get_backend
    from gpulazy.read import start

    p = tmp_path / "a.raw"
    np.arange(4096, dtype="<u2").tofile(p)
    write_manifest([str(p)], block_size=BLOCK)
    spec = next(iter(gpulazy.from_files(str(p), dtype="<u2", device="cpu").chunk_index.specs.values()))
    calls = []
    real = checksums.verify_chunk
    monkeypatch.setattr(checksums, "verify_chunk", lambda buf, s: calls.append(s) or real(buf, s))
    reads = start([spec], get_backend("posix", "cpu"), verify=True)
    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(lambda _: reads.futures[0].result(), range(32))) == {spec.nbytes}
    np.testing.assert_array_equal(reads.chunk(0), np.arange(4096, dtype="<u2"))
    assert len(calls) == 1
