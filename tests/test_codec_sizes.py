"""No silent wrong data from a damaged compressed chunk (issue 19, items 1 and 2).

Every codec must decode a chunk to exactly the bytes its spec needs: a piece that decodes
short or long raises ``ChunkDecodeError`` naming the file, its offset and both sizes
(before, a short piece came back as uninitialised memory). And a codec never reads past
its piece: a blosc piece cut short inside a shard decoded the next inner chunk's bytes,
since c-blosc trusts the length in its own header. Stores are written by zarr-python and
tifffile, then damaged the way real files are: a chunk rewritten with another chunking's
bytes (zarr itself encodes them), a shard index entry cut short, a TIFF tile replaced.
Every case runs on ``"cpu"`` and, marked ``gpu``, on ``"cuda:0"`` (nvCOMP).
"""

from __future__ import annotations

import os
import shutil

import numcodecs
import numpy as np
import pytest
from conftest import to_host
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codecs import encode, read, sample, tiled_spec, write_blobs

import gpulazy
from gpulazy.codecs import decode_pieces
from gpulazy.codecs._frames import FrameError, check_declared, declared_size
from gpulazy.device import get_device
from gpulazy.errors import ChunkDecodeError
from gpulazy.spec import ByteRange, ChunkSpec, Codec, Tile

zarr = pytest.importorskip("zarr")

SHUFFLE, BITSHUFFLE = numcodecs.Blosc.SHUFFLE, numcodecs.Blosc.BITSHUFFLE

#: Zarr v2 compressors (numcodecs), each a codec with its own length field or none (zlib).
V2 = {
    "zstd": numcodecs.Zstd(level=1),
    "blosc-lz4-shuffle": numcodecs.Blosc("lz4", clevel=5, shuffle=SHUFFLE),
    "blosc-zstd": numcodecs.Blosc("zstd", clevel=1, shuffle=BITSHUFFLE),
    "lz4": numcodecs.LZ4(),
    "zlib": numcodecs.Zlib(level=1),
    "gzip": numcodecs.GZip(level=1),
}


def _v3_codecs(name: str) -> list:
    from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

    return {"zstd": [ZstdCodec(level=1)], "blosc-lz4-shuffle": [BloscCodec(cname="lz4", shuffle="shuffle")],
            "blosc-zstd": [BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle")],
            "gzip": [GzipCodec(level=1)]}[name]


V3 = ["zstd", "blosc-lz4-shuffle", "blosc-zstd", "gzip"]

#: How the array is computed: the whole-array fast path, dask's scheduler, dask through the cache.
WAYS = {
    "fast": (False, lambda a: a.compute()),
    "dask": (False, lambda a: a.compute(optimize_graph=False)),
    "dask-cached": (None, lambda a: a.compute(optimize_graph=False)),
}
SHAPE, CHUNKS = (64, 32), (32, 32)
CHUNK_BYTES = 32 * 32 * 2


def ramp(shape=SHAPE) -> np.ndarray:
    return (np.arange(int(np.prod(shape))) % 4000).astype("<u2").reshape(shape)


def zarr_array(path: str, fmt: int, name: str, *, shape=SHAPE, chunks=CHUNKS, shards=None) -> np.ndarray:
    """A ``<u2`` Zarr array of ``ramp(shape)`` written by zarr-python; its data."""
    kw = {"compressors": V2[name]} if fmt == 2 else {"compressors": _v3_codecs(name)}
    z = zarr.create_array(path, shape=shape, chunks=chunks, shards=shards, dtype="<u2", zarr_format=fmt, **kw)
    data = ramp(shape)
    z[:] = data
    return data


def chunk_file(store: str, fmt: int) -> str:
    return os.path.join(store, "0.0" if fmt == 2 else os.path.join("c", "0", "0"))


def rewrite_with_other_chunking(tmp_path, store: str, fmt: int, name: str, chunks: tuple, **kw) -> str:
    """Chunk (0, 0) of ``store`` replaced by chunk (0, 0) of the same array stored with ``chunks``:
    a whole, valid stream of the same codec that decodes to another size. Its path."""
    other = str(tmp_path / "other.zarr")
    zarr_array(other, fmt, name, chunks=chunks, **kw)
    shutil.copyfile(chunk_file(other, fmt), chunk_file(store, fmt))
    return chunk_file(store, fmt)


def raises_naming(fn, path: str, expected: int | None = None, got: int | None = None) -> ChunkDecodeError:
    with pytest.raises(ChunkDecodeError) as e:
        fn()
    assert path in str(e.value) and e.value.path == path, str(e.value)
    if expected is not None:
        assert e.value.expected == expected and f"expected {expected}" in str(e.value), str(e.value)
    if got is not None:
        assert e.value.got == got and str(got) in str(e.value), str(e.value)
    return e.value


def compute(store: str, device: str, way: str):
    cache, run = WAYS[way]
    arr = gpulazy.from_files(store, device=device, cache=cache)

    def go():
        try:
            return run(arr)
        finally:
            assert arr.compute_path == way.split("-")[0]
    return go


# -- the issue's reproducer ----------------------------------------------------------------

def test_issue_reproducer_zstd_short_chunk(tmp_path):
    store = str(tmp_path / "a.zarr")
    z = zarr.create_array(store, shape=(32, 32), chunks=(32, 32), dtype="<u2", zarr_format=2,
                          compressors=numcodecs.Zstd())
    z[:] = 1
    with open(os.path.join(store, "0.0"), "wb") as f:
        f.write(numcodecs.Zstd().encode(np.full(100, 7, "<u2").tobytes()))
    arr = gpulazy.from_files(store, device="cpu", cache=False)
    raises_naming(arr.compute, os.path.join(store, "0.0"), expected=2048, got=200)


# -- Zarr v2 / v3: a chunk that decodes short or long --------------------------------------

ZARR = [pytest.param(2, n, id=f"v2-{n}") for n in V2] + [pytest.param(3, n, id=f"v3-{n}") for n in V3]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("rows,damage", [(16, "short"), (64, "long")])
@pytest.mark.parametrize("fmt,name", ZARR)
def test_zarr_chunk_decoding_to_another_size_raises(tmp_path, device, fmt, name, rows, damage, way):
    store = str(tmp_path / "a.zarr")
    zarr_array(store, fmt, name)
    bad = rewrite_with_other_chunking(tmp_path, store, fmt, name, (rows, 32))
    raises_naming(compute(store, device, way), bad, expected=CHUNK_BYTES, got=rows * 32 * 2)


@pytest.mark.parametrize("name", ["zstd", "blosc-lz4-shuffle", "gzip"])
def test_zarr_v3_sharded_short_inner_chunk_raises(tmp_path, device, name):
    # The shard of another array whose inner chunks are half as big: a valid index, valid
    # streams, each decoding to half of what this array's inner chunks need.
    store = str(tmp_path / "a.zarr")
    zarr_array(store, 3, name, chunks=(16, 16), shards=(32, 32))
    bad = rewrite_with_other_chunking(tmp_path, store, 3, name, (8, 16), shape=(32, 32), shards=(16, 32))
    raises_naming(compute(store, device, "fast"), bad, expected=16 * 16 * 2, got=8 * 16 * 2)


def test_intact_stores_still_read_equal_to_zarr(tmp_path, device):
    for fmt, names in ((2, V2), (3, V3)):
        for name in names:
            store = str(tmp_path / f"{name}-{fmt}.zarr")
            data = zarr_array(store, fmt, name)
            np.testing.assert_array_equal(to_host(gpulazy.from_files(store, device=device, cache=False).compute()),
                                          zarr.open_array(store, mode="r")[:])
            np.testing.assert_array_equal(to_host(gpulazy.from_files(store, device=device, cache=False).compute()),
                                          data)


# -- a piece cut short must not be read past -----------------------------------------------

INNER = 4  # a (32, 32) shard of (16, 16) inner chunks
INDEX = INNER * 16 + 4  # (offset, nbytes) uint64 pairs, then a crc32c


def shard_index(shard_path: str) -> np.ndarray:
    with open(shard_path, "rb") as f:
        raw = f.read()
    return np.frombuffer(numcodecs.CRC32C().decode(raw[-INDEX:]), "<u8").reshape(INNER, 2).copy()


def set_inner_nbytes(shard_path: str, k: int, nbytes: int) -> int:
    """Shorten inner chunk ``k``'s entry in a shard's index to ``nbytes``, checksum renewed.

    The data stays where it was: the bytes after the shortened piece are the next inner
    chunk's. Returns the piece's offset."""
    entries = shard_index(shard_path)
    entries[k, 1] = nbytes
    with open(shard_path, "r+b") as f:
        f.seek(-INDEX, os.SEEK_END)
        f.write(bytes(numcodecs.CRC32C().encode(entries.tobytes())))
    return int(entries[k, 0])


@pytest.mark.parametrize("cut", ["empty", "half"])
@pytest.mark.parametrize("name", ["blosc-lz4-shuffle", "blosc-zstd", "zstd", "gzip"])
def test_shard_piece_cut_short_is_not_read_past(tmp_path, device, name, cut):
    store = str(tmp_path / "a.zarr")
    zarr_array(store, 3, name, chunks=(16, 16), shards=(32, 32))
    shard = chunk_file(store, 3)
    offset = set_inner_nbytes(shard, 0, 0 if cut == "empty" else int(shard_index(shard)[0, 1]) // 2)
    err = raises_naming(compute(store, device, "fast"), shard)
    assert err.offset == offset


@pytest.mark.parametrize("cut", [0, 0.5])
@pytest.mark.parametrize("name", ["blosc-lz4-shuffle", "blosc-zstd"])
def test_zarr_v2_blosc_chunk_file_truncated(tmp_path, device, name, cut):
    store = str(tmp_path / "a.zarr")
    zarr_array(store, 2, name)
    path = chunk_file(store, 2)
    os.truncate(path, int(os.path.getsize(path) * cut))
    if cut == 0:  # an empty chunk file: Zarr's reader fails on it too
        with pytest.raises(Exception):
            zarr.open_array(store, mode="r")[:]
    raises_naming(compute(store, device, "fast"), path)


CODECS = {
    "zstd": Codec.of("zstd", level=1),
    "lz4": Codec.of("lz4", acceleration=1),
    "zlib": Codec.of("zlib", level=1),
    "gzip": Codec.of("gzip", level=1),
    "blosc": Codec.of("blosc", cname="lz4", clevel=5, shuffle=1, blocksize=0),
}


@pytest.mark.parametrize("name", CODECS)
def test_piece_cut_short_inside_a_chunk_raises(tmp_path, device, name):
    # Two pieces back to back in one read buffer; the first one's range ends early (0 bytes,
    # a third, or one byte short): its codec sees only its own bytes and refuses them.
    data = sample((32, 32), "<u2")
    spec = tiled_spec(str(tmp_path / "a.bin"), data, (16, 32), (CODECS[name],))
    first = spec.tiles[0].range
    for n in (0, first.nbytes // 3, first.nbytes - 1):
        short = ByteRange(first.path, first.offset, n)
        tiles = (Tile(short, (16, 32), (0, 0)), spec.tiles[1])
        bad = ChunkSpec((short, spec.tiles[1].range), spec.shape, spec.dtype, codec=spec.codec, tiles=tiles)
        err = raises_naming(lambda: read(bad, device), first.path)
        assert err.offset == first.offset


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(2, 12), tile_rows=st.integers(1, 6), victim=st.integers(0, 20),
       name=st.sampled_from(sorted(CODECS)), damage=st.sampled_from(["short", "long", "cut"]))
def test_any_tiling_with_one_damaged_piece_raises_for_it(tmp_path_factory, rows, tile_rows, victim, name, damage):
    codec = (CODECS[name],)
    data = sample((rows, 24), "<u2")
    path = str(tmp_path_factory.mktemp("h") / "a.bin")
    spec = tiled_spec(path, data, (tile_rows, 24), codec)
    k = victim % len(spec.tiles)
    want = tile_rows * 24 * 2
    with open(path, "rb") as f:
        stored = f.read()
    blobs = [stored[t.range.offset:t.range.offset + t.range.nbytes] for t in spec.tiles]
    if damage == "cut":
        blobs[k] = blobs[k][: len(blobs[k]) // 2]
    else:
        values = np.resize(data.reshape(-1), want // 4 if damage == "short" else want // 2 + 24)
        blobs[k] = encode(values.astype("<u2"), codec)
    ranges = write_blobs(path, blobs)
    tiles = tuple(Tile(r, t.shape, t.origin) for r, t in zip(ranges, spec.tiles))
    bad = ChunkSpec(tuple(ranges), spec.shape, spec.dtype, codec=codec, tiles=tiles)
    err = raises_naming(lambda: read(bad, "cpu"), path)
    assert err.offset == ranges[k].offset
    if damage != "cut":
        assert err.expected == want


# -- TIFF: zstd and deflate tiles ----------------------------------------------------------

@pytest.mark.parametrize("compression", ["zstd", "zlib"])
@pytest.mark.parametrize("damage", ["short", "long"])
def test_tiff_tile_decoding_to_the_wrong_size_raises(tmp_path, device, compression, damage):
    tifffile = pytest.importorskip("tifffile")
    imagecodecs = pytest.importorskip("imagecodecs")
    enc = {"zstd": imagecodecs.zstd_encode, "zlib": imagecodecs.zlib_encode}[compression]
    data = ramp()
    tiles = [enc(data[i:i + 16, j:j + 16].tobytes()) for i in range(0, 64, 16) for j in range(0, 32, 16)]
    rows = 8 if damage == "short" else 24
    tiles[3] = enc(ramp((rows, 16)).tobytes())
    path = str(tmp_path / "a.tif")
    tifffile.imwrite(path, iter(tiles), shape=SHAPE, dtype="<u2", tile=(16, 16), compression=compression)
    with pytest.raises(Exception):  # the reference reader refuses it too (TiffFileError, ZstdError, ...)
        tifffile.imread(path)
    with tifffile.TiffFile(path) as t:
        offset = t.pages[0].dataoffsets[3]
    err = raises_naming(compute(path, device, "fast"), path, expected=16 * 16 * 2, got=rows * 16 * 2)
    assert err.offset == offset
    raises_naming(compute(path, device, "dask"), path)


# -- the framing table itself --------------------------------------------------------------

@pytest.mark.parametrize("name", ["zstd", "lz4", "blosc", "gzip"])
def test_declared_size_is_what_numcodecs_decodes_to(name):
    import numcodecs as nc

    raw = sample((50, 30), "<u2").tobytes()
    c = nc.get_codec(CODECS[name].config())
    blob = bytes(c.encode(np.frombuffer(raw, "u1")))
    assert declared_size(name, blob[:64], blob[-8:], len(blob)) == len(raw) == len(bytes(c.decode(blob)))
    assert check_declared(name, blob[:64], blob[-8:], len(blob), len(raw)) == len(raw)
    with pytest.raises(FrameError) as e:
        check_declared(name, blob[:64], blob[-8:], len(blob), len(raw) + 2)
    assert e.value.got == len(raw)


def test_hdf5_lz4_header_declares_its_size():
    imagecodecs = pytest.importorskip("imagecodecs")
    raw = sample((50, 30), "<u2").tobytes()
    blob = imagecodecs.lz4h5_encode(raw)
    assert declared_size("imagecodecs_lz4h5", blob[:64], blob[-8:], len(blob)) == len(raw)
    with pytest.raises(FrameError, match="says it decodes to 3000 bytes"):
        check_declared("imagecodecs_lz4h5", blob[:64], blob[-8:], len(blob), 2 * len(raw))
    with pytest.raises(FrameError, match="12-byte header"):
        declared_size("imagecodecs_lz4h5", blob[:5], blob[-5:], 5)


def test_blosc_header_must_give_the_piece_its_own_length():
    blob = bytes(numcodecs.Blosc("lz4").encode(np.arange(500, dtype="<u2")))
    for piece in (blob[:8], blob[: len(blob) // 2], blob + b"\0"):
        with pytest.raises(FrameError, match="blosc"):
            declared_size("blosc", piece[:64], piece[-8:], len(piece))


def test_host_decode_never_sees_the_bytes_after_a_piece():
    # Two blosc pieces in one buffer, the first cut to nothing: before, c-blosc decoded the
    # second piece in its place.
    data = np.arange(256, dtype="<u2")
    blob = np.frombuffer(bytes(numcodecs.Blosc("lz4").encode(data)), "u1")
    buf = np.concatenate([blob, blob])
    where = [ByteRange("f.bin", 5, 0)]
    with pytest.raises(ChunkDecodeError, match="'f.bin' at offset 5"):
        decode_pieces([buf[:0]], (CODECS["blosc"],), [data.nbytes], get_device("cpu"), where=where)
    (ok,) = decode_pieces([buf[:blob.size]], (CODECS["blosc"],), [data.nbytes], get_device("cpu"))
    np.testing.assert_array_equal(ok.view("<u2"), data)


# -- the GPU path: nvCOMP is never handed a frame whose header disagrees -------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["zstd", "lz4", "gzip"])
def test_nvcomp_routes_a_frame_declaring_another_size_to_the_host(name):
    import cupy

    from gpulazy.codecs import nvcomp

    data = sample((64, 64), "<u2")
    good = np.frombuffer(encode(data, (CODECS[name],)), "u1")
    short = np.frombuffer(encode(data[:32], (CODECS[name],)), "u1")
    res = nvcomp.decode([cupy.asarray(good), cupy.asarray(short)], CODECS[name], [data.nbytes] * 2)
    assert res.host == [1] and "header says" in res.why[1]
    assert res.out[0].get().tobytes() == data.tobytes()


@pytest.mark.gpu
@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=40))
def test_the_ends_the_gpu_checks_are_each_pieces_first_and_last_bytes(sizes):
    import cupy

    from gpulazy.codecs import nvcomp

    blob = cupy.asarray(np.random.default_rng(len(sizes)).integers(0, 256, sum(sizes) + 1, dtype=np.uint8))
    starts = np.cumsum([0, *sizes])
    pieces = [blob[a:a + n] for a, n in zip(starts, sizes)]
    heads, tails = nvcomp._ends(pieces)
    host = blob.get()
    assert heads == [host[a:a + min(n, nvcomp._HEAD)].tobytes() for a, n in zip(starts, sizes)]
    assert tails == [host[a + max(0, n - nvcomp._TAIL):a + n].tobytes() for a, n in zip(starts, sizes)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["zstd", "lz4", "zlib", "gzip"])
def test_gpu_short_piece_raises_with_sizes(name):
    import cupy

    data = sample((64, 64), "<u2")
    short = np.frombuffer(encode(data[:32], (CODECS[name],)), "u1")
    where = [ByteRange("bad.bin", 128, short.size)]
    with pytest.raises(ChunkDecodeError) as e:
        decode_pieces([cupy.asarray(short)], (CODECS[name],), [data.nbytes], get_device("cuda:0"), where=where)
    assert e.value.path == "bad.bin" and e.value.expected == data.nbytes and e.value.got == data.nbytes // 2


def test_zarr_v3_crc32c_mismatch_raises_on_every_read(tmp_path, device):
    """Zarr's crc32c codec is a step of the chain: checked on every read (as zarr-python does),
    not only with verify=True; a flipped payload byte raised nothing before."""
    import zarr
    from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec

    p = str(tmp_path / "c.zarr")
    data = np.arange(32 * 32, dtype="<u2").reshape(32, 32)
    z = zarr.create_array(p, shape=data.shape, chunks=(16, 32), dtype="<u2",
                          serializer=BytesCodec(), compressors=[ZstdCodec(level=1), Crc32cCodec()])
    z[:] = data
    chunk = os.path.join(p, "c", "1", "0")
    st = os.stat(chunk)
    blob = bytearray(open(chunk, "rb").read())
    blob[len(blob) // 2] ^= 0x40
    open(chunk, "wb").write(bytes(blob))
    os.utime(chunk, ns=(st.st_atime_ns, st.st_mtime_ns))
    vol = gpulazy.from_files(p, device=device, cache=False, chunks=(16, 32))
    for compute in (lambda: vol.compute(), lambda: vol[10:20].sum().compute(scheduler="threads")):
        with pytest.raises(ChunkDecodeError, match="crc32c") as e:
            compute()
        assert chunk in str(e.value)
    np.testing.assert_array_equal(to_host(vol[:16].compute()), data[:16])  # the intact chunk reads
