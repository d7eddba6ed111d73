"""HDF5 bitshuffle + LZ4 (filter 32008, ``gpulazy.codecs.bitshuffle``), held to h5py + hdf5plugin.

Files are written by hdf5plugin's own filter; chunks are read back raw
(``read_direct_chunk``) and through gpulazy on ``"cpu"`` and, marked ``gpu``, on
``"cuda:0"`` (nvCOMP's LZ4 and the bit-unshuffle kernel). Element counts that are no
multiple of 8 or of the block, and forced small blocks, cover the leftover rules.
"""

from __future__ import annotations

import struct
import sys
import warnings

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpulazy
from gpulazy.codecs import bitshuffle, decode_pieces
from gpulazy.codecs._frames import FrameError
from gpulazy.device import get_device
from gpulazy.errors import ChunkDecodeError, PerformanceWarning
from gpulazy.spec import ByteRange, Codec

hdf5plugin = pytest.importorskip("hdf5plugin")
pytest.importorskip("lz4.block")


def sample(shape, dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    vals = np.linspace(0, 200, n) + rng.normal(0, 3, n)  # small values: bitshuffle + LZ4 compresses
    return np.abs(vals).astype(dtype).reshape(shape)


def write(path, data, chunks, nelems=0) -> str:
    with h5py.File(path, "w") as f:
        f.create_dataset("entry/data", data=data, chunks=chunks, **hdf5plugin.Bitshuffle(nelems=nelems, cname="lz4"))
    return str(path)


def raw_chunks(path) -> tuple[list[bytes], list[int], Codec]:
    """Every stored chunk's bytes, its decoded size and the codec gpulazy maps the filter to."""
    from gpulazy import layouts

    with h5py.File(path, "r") as f:
        ds = f["entry/data"]
        blobs = [ds.id.read_direct_chunk(ds.id.get_chunk_info(i).chunk_offset)[1]
                 for i in range(ds.id.get_num_chunks())]
        size = int(np.prod(ds.chunks)) * ds.dtype.itemsize
    spec = next(iter(layouts.index(path, dataset="/entry/data").specs.values()))
    return blobs, [size] * len(blobs), spec.codec[0]


def h5_chunks(path) -> list[bytes]:
    """Each stored chunk's decoded bytes, as h5py reads them (edge chunks padded as stored)."""
    with h5py.File(path, "r") as f:
        ds = f["entry/data"]
        out = []
        for i in range(ds.id.get_num_chunks()):
            origin = ds.id.get_chunk_info(i).chunk_offset
            block = np.zeros(ds.chunks, ds.dtype)
            part = ds[tuple(slice(o, o + c) for o, c in zip(origin, ds.chunks))]
            block[tuple(slice(0, s) for s in part.shape)] = part
            out.append(block.tobytes())
        return out


# -- CPU --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["u1", "<u2", "<i4", "<f4", "<u8"])
@pytest.mark.parametrize("chunks, nelems", [((37, 50), 0), ((64, 64), 256), ((13, 7), 8), ((100, 99), 1024)])
def test_hdf5_bitshuffle_lz4_reads_like_h5py(tmp_path, dtype, chunks, nelems):
    data = sample((150, 120), dtype)
    p = write(tmp_path / "d.h5", data, chunks, nelems)
    got = gpulazy.from_files(p, dataset="/entry/data", device="cpu", cache=False).compute()
    np.testing.assert_array_equal(got, data)


def test_the_filter_maps_to_bitshuffle_lz4_with_the_element_size(tmp_path):
    p = write(tmp_path / "d.h5", sample((20, 30), "<u4"), (7, 30))
    _, _, codec = raw_chunks(p)
    assert codec == Codec.of("bitshuffle_lz4", elementsize=4)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5000), es=st.sampled_from([1, 2, 4, 8]), nelems=st.sampled_from([0, 8, 64, 4096]))
def test_plan_decodes_any_count_like_hdf5plugin(tmp_path_factory, n, es, nelems):
    dtype = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}[es]
    data = sample((n,), dtype, seed=n)
    p = write(tmp_path_factory.mktemp("h") / "d.h5", data, (n,), nelems)
    blobs, sizes, codec = raw_chunks(p)
    h = bitshuffle.parse_header(blobs[0][:12], len(blobs[0]), sizes[0], es)
    assert h.count == n and sum(h.sizes) + h.leftover // es == n
    assert bitshuffle.decode_host(np.frombuffer(blobs[0], np.uint8), codec, sizes[0]).tobytes() == data.tobytes()


def test_numpy_unshuffle_matches_imagecodecs(tmp_path, monkeypatch):
    pytest.importorskip("imagecodecs")
    p = write(tmp_path / "d.h5", sample((300, 41), "<u2"), (300, 41), 64)
    blobs, sizes, codec = raw_chunks(p)
    with_ic = bitshuffle.decode_host(np.frombuffer(blobs[0], np.uint8), codec, sizes[0])
    monkeypatch.setitem(sys.modules, "imagecodecs", None)
    without = bitshuffle.decode_host(np.frombuffer(blobs[0], np.uint8), codec, sizes[0])
    assert with_ic.tobytes() == without.tobytes() == h5_chunks(p)[0]


def one_chunk(tmp_path) -> tuple[bytes, int, Codec]:
    p = write(tmp_path / "d.h5", sample((4000,), "<u2"), (4000,), 256)
    blobs, sizes, codec = raw_chunks(p)
    return blobs[0], sizes[0], codec


@pytest.mark.parametrize("mutate, match", [
    (lambda b: b[:8], "cannot hold its 12-byte header"),
    (lambda b: struct.pack(">Q", 8002) + b[8:], "decodes to 8002 bytes"),
    (lambda b: b[:8] + struct.pack(">I", 12) + b[12:], "not a positive multiple of 8"),
    (lambda b: b[:8] + struct.pack(">I", 0) + b[12:], "not a positive multiple of 8"),
    (lambda b: b[:12] + struct.pack(">I", 10**6) + b[16:], "do not fit"),
    (lambda b: b[:12] + struct.pack(">I", 0) + b[16:], "0 compressed bytes"),
    (lambda b: b[:-3], "blocks end at|do not fit|passes"),
    (lambda b: b + b"\0\0", "blocks end at"),
])
def test_bad_framing_is_refused_naming_the_chunk(tmp_path, mutate, match):
    blob, size, codec = one_chunk(tmp_path)
    bad = mutate(blob)
    with pytest.raises(ChunkDecodeError, match=rf"bitshuffle_lz4 chunk of '/x/d\.h5' at offset 4096.*({match})"):
        decode_pieces([np.frombuffer(bad, np.uint8)], (codec,), [size], get_device("cpu"),
                      where=[ByteRange("/x/d.h5", 4096, len(bad))])


def test_a_garbled_lz4_block_raises(tmp_path):
    blob, size, codec = one_chunk(tmp_path)
    bad = blob[:16] + b"\xf0" + b"\xff" * 6 + blob[23:]  # a literal run longer than the block
    with pytest.raises(FrameError, match="bitshuffle block at 16"):
        bitshuffle.decode_host(np.frombuffer(bad, np.uint8), codec, size)


def test_bitshuffle_without_lz4_is_still_refused(tmp_path):
    from gpulazy import layouts
    from gpulazy.errors import LayoutError

    with h5py.File(tmp_path / "p.h5", "w") as f:
        f.create_dataset("d", data=np.arange(64, dtype="<i4"), chunks=(16,), compression=32008,
                         compression_opts=(0, 0))
    with pytest.raises(LayoutError, match=r"filter 32008 \(bitshuffle\)"):
        layouts.index(str(tmp_path / "p.h5"), dataset="/d")


# -- GPU --------------------------------------------------------------------------------------

def on_gpu(blobs: list[bytes]) -> list:
    import cupy

    buf, spans = bytearray(b"\x03"), []
    for b in blobs:
        spans.append((len(buf), len(b)))
        buf += b + b"\xa5" * 5
    dev = cupy.asarray(np.frombuffer(bytes(buf), np.uint8))
    return [dev[a:a + n] for a, n in spans]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["u1", "<u2", "<u4", "<f8"])
def test_gpu_decodes_every_chunk_like_h5py_with_no_host_step(tmp_path, dtype):
    rng = np.random.default_rng(len(dtype))
    blobs, sizes, wants, codec = [], [], [], None
    for k, (chunks, nelems) in enumerate([((37, 50), 0), ((64, 64), 256), ((13, 7), 8), ((100, 99), 1024)]):
        p = write(tmp_path / f"d{k}.h5", sample((int(rng.integers(100, 300)), 120), dtype, seed=k), chunks, nelems)
        b, s, codec = raw_chunks(p)
        blobs += b
        sizes += s
        # the host decoder (held to h5py above): edge chunks' padding is whatever HDF5 stored
        wants += [bitshuffle.decode_host(np.frombuffer(x, np.uint8), codec, n).tobytes() for x, n in zip(b, s)]
    gpulazy.stats().reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        out = decode_pieces(on_gpu(blobs), (codec,), sizes, get_device("cuda:0"))
    got = [o.get().tobytes() for o in out]
    wrong = [k for k, (g, w) in enumerate(zip(got, wants)) if g != w]
    assert not wrong, f"{len(wrong)} of {len(got)} chunks differ, first {wrong[0]}: " \
                      f"{bitshuffle.parse_header(blobs[wrong[0]][:12], len(blobs[wrong[0]]), sizes[wrong[0]], np.dtype(dtype).itemsize)}"
    assert set(gpulazy.stats().snapshot()["decode_by_codec"]["bitshuffle_lz4"]) == {"gpu"}


@pytest.mark.gpu
def test_gpu_reads_a_dectris_style_file_like_h5py(tmp_path):
    data = sample((40, 96, 80), "<u4")
    p = write(tmp_path / "master.h5", data, (1, 96, 80))
    got = gpulazy.from_files(p, dataset="/entry/data", device="cuda:0", cache=False).compute()
    np.testing.assert_array_equal(got.get(), data)


@pytest.mark.gpu
@pytest.mark.parametrize("damage", ["nbytes", "block size", "first size", "truncated", "garbled lz4"])
def test_gpu_garbled_chunk_raises_naming_it_and_keeps_the_gpu_usable(tmp_path, damage):
    blob, size, codec = one_chunk(tmp_path)
    bad = {"nbytes": struct.pack(">Q", size + 2) + blob[8:],
           "block size": blob[:8] + struct.pack(">I", 12) + blob[12:],
           "first size": blob[:12] + struct.pack(">I", 3) + blob[16:],
           "truncated": blob[:-5],
           "garbled lz4": blob[:16] + b"\xf0" + b"\xff" * 6 + blob[23:]}[damage]
    where = [ByteRange("/x/m.h5", 512 * k, len(b)) for k, b in enumerate([blob, bad, blob])]
    with pytest.raises(ChunkDecodeError, match=r"'/x/m\.h5' at offset 512\b"):
        decode_pieces(on_gpu([blob, bad, blob]), (codec,), [size] * 3, get_device("cuda:0"), where=where)
    out = decode_pieces(on_gpu([blob]), (codec,), [size], get_device("cuda:0"))
    assert out[0].get().tobytes() == h5_chunks(tmp_path / "d.h5")[0]


@pytest.mark.gpu
def test_gpu_walk_kernel_agrees_with_its_host_twin(tmp_path):
    import cupy

    from gpulazy.codecs.pieces import Pieces

    blob, size, _ = one_chunk(tmp_path)
    h = bitshuffle.parse_header(blob[:12], len(blob), size, 2)
    rng = np.random.default_rng(1)
    for trial in range(60):
        bad = bytearray(blob)
        for _ in range(int(rng.integers(0, 3))):
            bad[int(rng.integers(12, len(bad)))] = int(rng.integers(0, 256))
        bad = bytes(bad)
        offsets, sizes, ok = bitshuffle._walk(Pieces.of([cupy.asarray(np.frombuffer(bad, np.uint8))]), {0: h})
        try:
            want = bitshuffle.walk_blocks(bad, h)
        except FrameError:
            assert not ok[0], f"trial {trial}: the kernel accepted what walk_blocks refuses"
        else:
            assert ok[0] and list(zip(offsets.tolist(), sizes.tolist())) == want, f"trial {trial}"
