"""``verify=True``: every chunk's stored bytes checked against CRC32C before they are handed out.

Checksums come from a manifest written by ``gpulazy index --checksum`` or from Zarr's
``crc32c`` codec inside the stored chunk. Corruption on disk, or in transit (the
``FaultInjectingBackend`` flips a byte after a read succeeded), raises ``ChunkReadError``
naming the chunk, the file and the offset; without ``verify`` the flipped byte goes
through, which is why the option exists.
"""

from __future__ import annotations

import json
import os

import numcodecs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fault_backend
import gpulazy
from gpulazy.array import ChunkSource
from gpulazy.checksums import MANIFEST_NAME, crc32c, write_manifest
from gpulazy.cli import main
from gpulazy.errors import ChunkReadError, LayoutError
from gpulazy.spec import ByteRange, ChunkSpec, Codec, Tile, file_identity
from gpulazy.testing import flip_byte

SHAPE = (10, 100)  # 2000 bytes of <u2 per file: 100-byte checksum blocks cut chunks' ranges


@pytest.fixture
def folder(tmp_path):
    for i in range(3):
        (np.arange(np.prod(SHAPE), dtype="<u2").reshape(SHAPE) * (i + 1)).tofile(tmp_path / f"s{i}.raw")
    return tmp_path


def _reference():
    return np.stack([np.arange(np.prod(SHAPE), dtype="<u2").reshape(SHAPE) * (i + 1) for i in range(3)])


def _vol(folder, **kw):
    return gpulazy.from_files(str(folder), shape=SHAPE, dtype="<u2", chunks=(1, 3, 100), device="cpu",
                              verify=True, **kw)


def _flip_on_disk(path, at):
    """Flip byte ``at`` of ``path`` and set its mtime back (size and mtime alone cannot tell)."""
    size = os.path.getsize(path)
    flip_byte(path, at)
    assert os.path.getsize(path) == size


COMPUTES = {
    "whole-array": lambda v: v.compute(),
    "sync": lambda v: v.sum(axis=0).compute(scheduler="sync"),
    "threads": lambda v: v[:, 2:9].compute(scheduler="threads"),
}
EXPECTED = {"whole-array": lambda r: r, "sync": lambda r: r.sum(axis=0), "threads": lambda r: r[:, 2:9]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", list(COMPUTES))
def test_verified_read_equals_the_files(folder, how):
    assert main(["index", "--checksum", str(folder), "--block-size", "100"]) == 0
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert sorted(manifest["files"]) == ["s0.raw", "s1.raw", "s2.raw"]
    assert manifest["files"]["s0.raw"]["block_size"] == 100
    np.testing.assert_array_equal(COMPUTES[how](_vol(folder)), EXPECTED[how](_reference()))
    # The manifest is a dotfile: reading the folder does not pick it up as data.
    assert len(gpulazy.from_files(str(folder), shape=SHAPE, dtype="<u2", device="cpu").chunk_index.paths) == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", list(COMPUTES))
def test_corruption_on_disk_is_caught_naming_chunk_file_and_offset(folder, how):
    write_manifest(str(folder), block_size=100)
    _flip_on_disk(str(folder / "s1.raw"), 1234)  # row 6, in chunk (1, 2, 0) (rows 6..8)
    vol = _vol(folder)
    with pytest.raises(ChunkReadError, match="failed verification") as info:
        COMPUTES[how](vol)
    err = info.value
    assert err.path == str(folder / "s1.raw") and "s1.raw" in str(err)
    assert err.offset is not None and err.offset <= 1234 < err.offset + err.expected
    assert "(1, 2, 0)" in str(err) and "block 12" in str(err)
    # Unverified, the flipped byte is read as data: the check is what notices.
    plain = gpulazy.from_files(str(folder), shape=SHAPE, dtype="<u2", device="cpu", cache=False).compute()
    assert not np.array_equal(plain, _reference())


@pytest.mark.timeout(60)
def test_corruption_in_transit_is_caught(folder):
    write_manifest(str(folder), block_size=100)
    fault_backend.install({"fault": "flip", "at": 7, "match": "s2.raw", "times": 1})
    try:
        with pytest.raises(ChunkReadError, match="s2.raw.*failed verification"):
            _vol(folder, backend="faulty").compute(scheduler="sync")
        # The next read is clean and verifies; nothing of the bad one was kept.
        np.testing.assert_array_equal(_vol(folder, backend="faulty").compute(scheduler="sync"), _reference())
        fault_backend.install({"fault": "flip", "at": 7, "match": "s2.raw", "times": 1})
        unverified = gpulazy.from_files(str(folder), shape=SHAPE, dtype="<u2", chunks=(1, 3, 100), device="cpu",
                                        backend="faulty", cache=False).compute(scheduler="sync")
        assert (unverified != _reference()).sum() == 1  # without verify, the corruption goes through
    finally:
        fault_backend.uninstall()


@pytest.mark.timeout(60)
def test_read_file_verifies(folder):
    path = str(folder / "s0.raw")
    write_manifest([path], block_size=64)
    np.testing.assert_array_equal(gpulazy.read_file(path, dtype="<u2", shape=SHAPE, device="cpu", verify=True),
                                  _reference()[0])
    _flip_on_disk(path, 5)
    with pytest.raises(ChunkReadError, match="s0.raw.*offset 0"):
        gpulazy.read_file(path, dtype="<u2", device="cpu", verify=True)


@pytest.mark.timeout(60)
def test_no_manifest_or_a_stale_one_is_a_layout_error(folder):
    with pytest.raises(LayoutError, match="no checksums.*s0.raw.*gpulazy index --checksum"):
        _vol(folder)
    write_manifest(str(folder))
    with open(folder / "s1.raw", "ab") as f:
        f.write(b"xx")
    with pytest.raises(LayoutError, match="s1.raw.*2002"):
        gpulazy.from_files([str(folder / "s1.raw")], dtype="<u2", device="cpu", verify=True)


@pytest.mark.timeout(60)
def test_manifest_of_a_nested_store_is_found_from_its_chunk_files(tmp_path):
    store = tmp_path / "store"
    (store / "c" / "0").mkdir(parents=True)
    data = np.arange(50, dtype="<i4")
    data.tofile(store / "c" / "0" / "0")
    write_manifest(str(store))
    assert "c/0/0" in json.loads((store / MANIFEST_NAME).read_text())["files"]
    got = gpulazy.read_file(str(store / "c" / "0" / "0"), dtype="<i4", device="cpu", verify=True)
    np.testing.assert_array_equal(got, data)


# -- Zarr v3's crc32c codec: the checksum the stored chunk carries -------------------------------

def _crc_chunk_file(tmp_path, steps, values):
    """A file holding one stored chunk encoded by ``steps`` (in encode order) and its spec."""
    raw = values.tobytes()
    for step in steps:
        if step == "crc32c":
            raw = raw + np.uint32(crc32c(raw)).astype("<u4").tobytes()
        else:
            raw = bytes(numcodecs.get_codec({"id": step}).encode(raw))
    path = str(tmp_path / "chunk.bin")
    with open(path, "wb") as f:
        f.write(b"PAD!" + raw)
    r = ByteRange(path, 4, len(raw))
    codec = tuple(Codec(s) for s in reversed(steps))  # decode order
    spec = ChunkSpec((r,), values.shape, values.dtype.str, codec=codec, identity=(file_identity(path),),
                     index=(0, 0), tiles=(Tile(r, values.shape, (0, 0)),))
    return path, spec


@pytest.mark.timeout(60)
@pytest.mark.parametrize("steps", [["crc32c"], ["zstd", "crc32c"], ["crc32c", "zstd"]], ids="+".join)
def test_zarr_crc32c_codec_is_checked(tmp_path, steps):
    values = np.arange(64, dtype="<u2").reshape(8, 8)
    path, spec = _crc_chunk_file(tmp_path, steps, values)
    verified = ChunkSource("cpu", cache=False, verify=True)
    np.testing.assert_array_equal(verified.read(spec), values)
    _flip_on_disk(path, 4 + spec.nbytes - 1)  # the last stored byte (checksum or compressed data)
    bad = ChunkSpec(spec.ranges, spec.shape, spec.dtype, codec=spec.codec, identity=(file_identity(path),),
                    index=spec.index, tiles=spec.tiles)
    with pytest.raises(ChunkReadError) as info:  # the codec's own check (a ChunkDecodeError), verify or not
        verified.read(bad)
    assert info.value.path == path and info.value.offset == 4
    assert "crc32c" in str(info.value) or "zstd" in str(info.value)  # the checksum, or the frame it guards


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_verified_read_on_the_gpu(folder):
    from conftest import to_host

    write_manifest(str(folder), block_size=100)
    vol = gpulazy.from_files(str(folder), shape=SHAPE, dtype="<u2", chunks=(1, 3, 100), device="cuda:0",
                             verify=True)
    np.testing.assert_array_equal(to_host(vol.compute()), _reference())
    np.testing.assert_array_equal(to_host(vol.sum(axis=0).compute(scheduler="threads")), _reference().sum(axis=0))
    _flip_on_disk(str(folder / "s2.raw"), 10)
    with pytest.raises(ChunkReadError, match="s2.raw.*failed verification"):
        gpulazy.from_files(str(folder), shape=SHAPE, dtype="<u2", device="cuda:0", verify=True).compute()


# -- nvCOMP's CRC32-C preset against google-crc32c, on a GPU ---------------------------------


@pytest.mark.gpu
@pytest.mark.timeout(120)
@settings(max_examples=15, deadline=None)
@given(segs=st.lists(st.tuples(st.integers(0, 3 * 4096), st.integers(0, 3 * 4096 + 50)), min_size=1, max_size=6),
       seed=st.integers(0, 100))
def test_nvcomp_crc32c_equals_google_crc32c(segs, seed):
    """Pieces of any length (0 included) at any address, one call: each CRC as google-crc32c's."""
    import cupy

    from gpulazy.codecs import _nvcomp_c

    assert _nvcomp_c.crc32c_available()
    data = np.random.default_rng(seed).integers(0, 256, 6 * 4096 + 100, dtype=np.uint8)
    starts = [min(a, len(data)) for a, _ in segs]
    lengths = [min(n, len(data) - a) for a, (_, n) in zip(starts, segs)]
    dev = cupy.asarray(data)
    stream = cupy.cuda.get_current_stream()
    got = _nvcomp_c.crc32c([dev.data.ptr + a for a in starts], lengths, stream).get()
    assert [int(x) for x in got] == [crc32c(data[a: a + n]) for a, n in zip(starts, lengths)]


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_nvcomp_crc32c_of_a_large_batch_equals_google_crc32c():
    import cupy

    from gpulazy.codecs import _nvcomp_c

    data = np.random.default_rng(3).integers(0, 256, (64 << 20) + 77, dtype=np.uint8)
    bs = 256 << 10
    starts = np.arange(0, len(data), bs)
    lengths = np.minimum(bs, len(data) - starts)
    dev = cupy.asarray(data)
    got = _nvcomp_c.crc32c([dev.data.ptr + int(a) for a in starts], lengths.tolist(), cupy.cuda.get_current_stream())
    assert [int(x) for x in got.get()] == [crc32c(data[a: a + n]) for a, n in zip(starts, lengths)]


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_zarr_crc32c_codec_is_checked_on_the_gpu(tmp_path):
    from conftest import to_host

    values = np.arange(64, dtype="<u2").reshape(8, 8)
    path, spec = _crc_chunk_file(tmp_path, ["crc32c"], values)
    verified = ChunkSource("cuda:0", cache=False, verify=True)
    np.testing.assert_array_equal(to_host(verified.read(spec)), values)
    _flip_on_disk(path, 4 + 10)
    bad = ChunkSpec(spec.ranges, spec.shape, spec.dtype, codec=spec.codec, identity=(file_identity(path),),
                    index=spec.index, tiles=spec.tiles)
    with pytest.raises(ChunkReadError, match="crc32c checksum does not match"):
        verified.read(bad)
