"""Planes of zstd chunks decoded from heads of their stored bytes (``ChunkSpec.head``): values in
native order on the CPU and the GPU, what is read, and errors naming the file for heads cut short or
garbled (a head decodes on the host's cores on a GPU too, straight into its slot of the batch)."""

from __future__ import annotations

import numpy as np
import pytest

import gpulazy
from gpulazy.spec import head_allowance

zarr = pytest.importorskip("zarr")

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]
PLANE = 128 * 128 * 2  # a plane of a stored chunk of (16, 128, 128): a head of two reads 194 of its 512 KiB


def _to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _zstd_zarr(tmp_path, data, chunks, endian="little"):
    from zarr.codecs import BytesCodec, ZstdCodec

    p = str(tmp_path / "z.zarr")
    z = zarr.create_array(p, shape=data.shape, chunks=chunks, dtype=data.dtype, serializer=BytesCodec(endian=endian),
                          compressors=ZstdCodec(level=1))
    z[...] = data
    return p


def _data(seed=3, shape=(48, 256, 256)):
    return np.random.default_rng(seed).integers(0, 60_000, shape).astype("<u2")


@pytest.mark.parametrize("device", DEVICES)
def test_a_plane_reads_a_head_of_each_stored_chunk_it_crosses(tmp_path, device):
    data = _data()
    vol = gpulazy.from_files(_zstd_zarr(tmp_path, data, (16, 128, 128)), device=device, cache=False,
                             chunks=(16, 128, 128))
    before = gpulazy.stats().snapshot()["bytes_read"]
    got = _to_host(vol[17:18].compute())
    np.testing.assert_array_equal(got, data[17:18])
    # planes 16-17 of each of the four stored chunks the plane crosses, from a head of each
    assert gpulazy.stats().snapshot()["bytes_read"] - before == 4 * head_allowance(2 * PLANE)


@pytest.mark.parametrize("device", DEVICES)
def test_heads_of_big_endian_chunks_come_out_in_native_order(tmp_path, device):
    data = _data(4)
    vol = gpulazy.from_files(_zstd_zarr(tmp_path, data, (16, 128, 128), endian="big"), device=device, cache=False)
    for box in (np.s_[16:18], np.s_[33:34, 5:140, 7:9], np.s_[0:2, ::3]):
        np.testing.assert_array_equal(_to_host(vol[box].compute()), data[box])


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_a_box_of_heads_into_a_result_equals_the_data_and_its_reductions_stream(tmp_path, device, gathered):
    """A dask chunk a stored chunk, or the stored chunks gathered as tiles of one (assembled on the host)."""
    data = _data(5, (40, 300, 260))
    vol = gpulazy.from_files(_zstd_zarr(tmp_path, data, (16, 128, 128)), device=device, cache=False,
                             chunks=None if gathered else (16, 128, 128))
    for box in (np.s_[17:18], np.s_[16:19, 3:290, 5:160], np.s_[33:35, :, 130:]):
        np.testing.assert_array_equal(_to_host(vol[box].compute()), data[box])
        assert int(_to_host(vol[box].max().compute())) == int(data[box].max())
        np.testing.assert_array_equal(_to_host(vol[box].max(axis=0).compute()), data[box].max(axis=0))


@pytest.mark.parametrize("device", DEVICES)
def test_a_head_of_a_chunk_cut_short_after_indexing_raises_naming_it(tmp_path, device):
    data = _data(6)
    p = _zstd_zarr(tmp_path, data, (16, 128, 128))
    vol = gpulazy.from_files(p, device=device, cache=False, chunks=(16, 128, 128))
    chunk = tmp_path / "z.zarr" / "c" / "1" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:1000])  # shorter than the head's allowance
    with pytest.raises((gpulazy.errors.ChunkReadError, gpulazy.errors.ChunkDecodeError), match=str(chunk)):
        vol[17:18].compute()
    np.testing.assert_array_equal(_to_host(vol[33:34].compute()), data[33:34])  # the others still read


@pytest.mark.parametrize("device", DEVICES)
def test_a_garbled_head_reads_its_chunk_whole_and_says_what_is_wrong(tmp_path, device):
    from gpulazy.codecs._frames import zstd_header

    data = _data(7)
    p = _zstd_zarr(tmp_path, data, (16, 128, 128))
    chunk = tmp_path / "z.zarr" / "c" / "1" / "0" / "0"
    blob = bytearray(chunk.read_bytes())
    blob[zstd_header(bytes(blob[:32]))[0]] |= 0b110  # the first block's type: reserved, so nothing decodes
    chunk.write_bytes(bytes(blob))
    vol = gpulazy.from_files(p, device=device, cache=False)
    with pytest.raises(gpulazy.errors.ChunkDecodeError, match=str(chunk)):
        vol[17:18].compute()
    with pytest.raises(gpulazy.errors.ChunkDecodeError, match=str(chunk)):
        vol[16:18].max().compute()


def test_a_gpu_batch_decodes_heads_straight_into_their_slots_and_names_a_short_one(monkeypatch):
    """On a GPU, heads decode on the host's threads through ``_beside.HostShare``: each straight into
    its slot of the pinned buffer that goes up (run here on ``HostShare``'s NumPy side, whose stale
    bytes would show through a slot left unwritten). A head whose frame cannot serve it raises the
    error naming its file, with ``HeadShort`` as its cause (the engine then reads the chunk whole)."""
    zstandard = pytest.importorskip("zstandard")
    from test_codec_deflate import NumpySide

    from gpulazy.codecs import _beside, _run
    from gpulazy.codecs.host import HeadShort
    from gpulazy.spec import ByteRange, Codec

    rng = np.random.default_rng(12)
    chunks = [rng.integers(0, 4096, 64 * 1024, dtype="<u2").tobytes() for _ in range(5)]  # 128 KiB each
    frames = [zstandard.ZstdCompressor(level=1).compress(c) for c in chunks]
    wants = [1, 40_000, 65_536, 131_072, 7]
    codec = Codec.of("head", of="zstd", size=len(chunks[0]))
    heads = [np.frombuffer(f[:head_allowance(n)], np.uint8) for f, n in zip(frames, wants)]
    where = [ByteRange(f"/data/z.zarr/c/{k}/0/0", 0, h.size) for k, h in enumerate(heads)]
    into = []
    real = _run._host_one
    monkeypatch.setattr(_beside, "_host_one", lambda *a, **k: into.append(k.get("into") is not None) or real(*a, **k))
    share = _beside.HostShare(heads, (codec,), wants, where, side=NumpySide())
    assert [v.tobytes() for v in share.run()] == [c[:n] for c, n in zip(chunks, wants)]
    assert into == [True] * 5
    heads[3] = heads[3][:2000]  # the frame needs more stored bytes than the head has
    share = _beside.HostShare(heads, (codec,), wants, where, side=NumpySide())
    with pytest.raises(gpulazy.errors.ChunkDecodeError, match="/data/z.zarr/c/3/0/0") as e:
        share.run()
    assert isinstance(e.value.__cause__, HeadShort)
