"""gpulazy.codecs: stored pieces through codec pipelines, assembled into chunks.

Specs are built by hand over numcodecs/imagecodecs-encoded blobs in a temporary file and
read through the device's backend, so the same tests run on ``"cpu"`` (numcodecs on the
host) and, marked ``gpu``, on ``"cuda:0"`` (nvCOMP and the CuPy filters).
"""

from __future__ import annotations

import gzip
import io
import os
import warnings

import numpy as np
import pytest
from conftest import to_host
from hypothesis import given, settings
from hypothesis import strategies as st

import gpulazy
from gpulazy.codecs import _pipeline, _run, _split, decoded_on, decode_pieces
from gpulazy.codecs.gpu import step_sizes
from gpulazy.device import get_device
from gpulazy.errors import ChunkDecodeError, PerformanceWarning
from gpulazy.io import get_backend
from gpulazy.read import read as engine_read
from gpulazy.spec import ByteRange, ChunkSpec, Codec, Tile

try:
    import imagecodecs  # noqa: F401  (an optional extra: TIFF's codecs)

    HAS_IMAGECODECS = True
except ImportError:
    HAS_IMAGECODECS = False

ZSTD = Codec.of("zstd", level=1)
LZ4 = Codec.of("lz4", acceleration=1)
ZLIB = Codec.of("zlib", level=1)
GZIP = Codec.of("gzip", level=1)

#: name -> (pipeline in decode order, dtype of the data)
PIPELINES = {
    "zstd": ((ZSTD,), "<u2"),
    "lz4": ((LZ4,), "<u2"),
    "zlib": ((ZLIB,), "<u2"),
    "gzip": ((GZIP,), "<u2"),
    "blosc": ((Codec.of("blosc", cname="lz4", clevel=5, shuffle=1, blocksize=0),), "<u2"),
    "zstd+shuffle": ((ZSTD, Codec.of("shuffle", elementsize=4)), "<f4"),
    "delta": ((Codec.of("delta", dtype="<i2", astype="<i2"),), "<i2"),
    "zlib+delta-narrow": ((ZLIB, Codec.of("delta", dtype="<i4", astype="<i2")), "<i4"),
    "crc32c+zstd": ((Codec("crc32c"), ZSTD), "<u2"),
    "fletcher32": ((Codec("fletcher32"),), "<u2"),
    "lzw": ((Codec("imagecodecs_lzw"),), "<u2"),
    "packbits": ((Codec("imagecodecs_packbits"),), "u1"),
}


def encode(data: np.ndarray, codec: tuple[Codec, ...]) -> bytes:
    """``data``'s bytes encoded so that ``codec`` (decode order) decodes them."""
    import numcodecs

    buf: object = data.tobytes()
    for c in reversed(codec):
        if c.id.startswith("imagecodecs_"):
            import imagecodecs

            buf = getattr(imagecodecs, c.id.removeprefix("imagecodecs_") + "_encode")(bytes(buf), **dict(c.params))
        else:
            buf = numcodecs.get_codec(c.config()).encode(np.frombuffer(bytes(buf), "u1"))
    return bytes(buf)


def sample(shape, dtype, seed=0) -> np.ndarray:
    """A smooth ramp plus noise (compresses like real data), or small ints for deltas."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    if dt.kind == "f":
        return (np.linspace(0, 100, n) + rng.normal(0, 1, n)).astype(dt).reshape(shape)
    top = min(np.iinfo(dt).max, 4000)
    ramp = np.linspace(0, top // 2, n)
    return np.clip(ramp + rng.integers(0, top // 4, n), 0, top).astype(dt).reshape(shape)


def write_blobs(path: str, blobs: list[bytes | None]) -> list[ByteRange | None]:
    """Write blobs back to back after a 7-byte header (odd offsets); their ranges."""
    ranges, at = [], 7
    with open(path, "wb") as f:
        f.write(b"HEADER!")
        for b in blobs:
            if b is None:
                ranges.append(None)
                continue
            f.write(b)
            ranges.append(ByteRange(path, at, len(b)))
            at += len(b)
    return ranges


def tiled_spec(path, data, tile_shape, codec, *, dtype=None, missing=(), order="C", fill_value=0):
    """A spec of ``data`` stored as tiles of ``tile_shape`` (edge tiles full size, zero-padded)."""
    dtype = np.dtype(dtype or data.dtype)
    grid = [-(-n // t) for n, t in zip(data.shape, tile_shape)]
    tiles, blobs = [], []
    for idx in np.ndindex(*grid):
        origin = tuple(i * t for i, t in zip(idx, tile_shape))
        block = np.zeros(tile_shape, dtype)
        part = data[tuple(slice(o, o + t) for o, t in zip(origin, tile_shape))]
        block[tuple(slice(0, s) for s in part.shape)] = part
        raw = np.asfortranarray(block).tobytes(order="F") if order == "F" else block.tobytes()
        blobs.append(None if idx in missing else encode(np.frombuffer(raw, "u1"), codec))
        tiles.append((origin, idx))
    ranges = write_blobs(path, blobs)
    tile_objs = tuple(Tile(r, tuple(tile_shape), o, order) for r, (o, _) in zip(ranges, tiles))
    present = tuple(r for r in ranges if r is not None)
    return ChunkSpec(present, tuple(data.shape), dtype.str, codec=tuple(codec), tiles=tile_objs,
                     fill_value=fill_value)


def read(spec: ChunkSpec, device: str) -> np.ndarray:
    dev = get_device(device)
    return to_host(engine_read([spec], get_backend(None, dev))[0])


# -- every codec id the layouts use, on each device ---------------------------------------

NEEDS_IMAGECODECS = pytest.mark.skipif(not HAS_IMAGECODECS, reason="imagecodecs is not installed")


@pytest.mark.parametrize("name", [pytest.param(n, marks=NEEDS_IMAGECODECS) if "imagecodecs" in PIPELINES[n][0][0].id
                                  else n for n in PIPELINES])
def test_pipeline_decodes_like_numcodecs(tmp_path, device, name):
    codec, dtype = PIPELINES[name]
    data = sample((40, 33), dtype)
    spec = tiled_spec(str(tmp_path / "a.bin"), data, (16, 33), codec)
    out = read(spec, device)
    assert out.dtype == data.dtype.newbyteorder("=") and out.shape == data.shape
    np.testing.assert_array_equal(out, data)


def test_host_decode_matches_numcodecs_decode(tmp_path):
    # The host path is numcodecs itself: piece by piece, the same bytes as numcodecs' decode.
    import numcodecs

    data = sample((64, 64), "<u2")
    for c in (ZSTD, LZ4, ZLIB, GZIP):
        blob = np.frombuffer(encode(data, (c,)), "u1")
        (got,) = decode_pieces([blob], (c,), [data.nbytes], get_device("cpu"))
        ref = np.frombuffer(bytes(numcodecs.get_codec(c.config()).decode(blob)), "u1")
        np.testing.assert_array_equal(got, ref)


# -- assembling tiles ---------------------------------------------------------------------

def test_missing_tiles_read_as_fill_value(tmp_path, device):
    data = sample((8, 8), "<u2")
    spec = tiled_spec(str(tmp_path / "a.bin"), data, (4, 4), (ZSTD,), missing={(0, 1), (1, 0)}, fill_value=7)
    out = read(spec, device)
    want = data.copy()
    want[0:4, 4:8] = 7
    want[4:8, 0:4] = 7
    np.testing.assert_array_equal(out, want)


def test_edge_tiles_are_clipped(tmp_path, device):
    data = sample((10, 7), "<u2")  # 4x4 tiles: the last row and column of tiles stick out
    spec = tiled_spec(str(tmp_path / "a.bin"), data, (4, 4), (LZ4,))
    np.testing.assert_array_equal(read(spec, device), data)


def test_fortran_order_tiles(tmp_path, device):
    data = sample((9, 6), "<u2")
    spec = tiled_spec(str(tmp_path / "a.bin"), data, (4, 6), (ZLIB,), order="F")
    np.testing.assert_array_equal(read(spec, device), data)


def test_big_endian_pieces_come_back_native(tmp_path, device):
    data = sample((12, 5), ">u2")
    spec = tiled_spec(str(tmp_path / "a.bin"), data, (5, 5), (ZSTD, Codec.of("shuffle", elementsize=2)))
    out = read(spec, device)
    assert out.dtype == np.dtype("=u2")
    np.testing.assert_array_equal(out, data.astype("=u2"))


@settings(max_examples=15, deadline=None)
@given(shape=st.tuples(st.integers(1, 9), st.integers(1, 9)), tile=st.tuples(st.integers(1, 5), st.integers(1, 5)),
       order=st.sampled_from("CF"), seed=st.integers(0, 2**16))
def test_any_tiling_assembles_the_array(tmp_path_factory, shape, tile, order, seed):
    data = sample(shape, "<i4", seed)
    grid = [-(-n // t) for n, t in zip(shape, tile)]
    missing = {(0,) * 2} if seed % 3 == 0 and np.prod(grid) > 1 else set()
    path = str(tmp_path_factory.mktemp("h") / "a.bin")
    spec = tiled_spec(path, data, tile, (ZLIB,), missing=missing, order=order, fill_value=-1)
    want = data.copy()
    if missing:
        want[:tile[0], :tile[1]] = -1
    np.testing.assert_array_equal(read(spec, "cpu"), want)


# -- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", [ZSTD, LZ4, ZLIB, GZIP, Codec.of("blosc", cname="lz4", clevel=5, shuffle=1, blocksize=0)],
                         ids=lambda c: c.id)
def test_corrupt_piece_raises_naming_the_file(tmp_path, device, codec):
    data = sample((32, 32), "<u2")
    spec = tiled_spec(str(tmp_path / "a.bin"), data, (16, 32), (codec,))
    second = spec.tiles[1].range
    with open(second.path, "r+b") as f:  # the second piece's header and some payload garbled
        f.seek(second.offset)
        f.write(bytes(range(200, 232)))
    with pytest.raises(ChunkDecodeError) as e:
        read(spec, device)
    assert second.path in str(e.value) and e.value.path == second.path


def test_truncated_piece_raises(tmp_path, device):
    data = sample((32, 32), "<u2")
    path = str(tmp_path / "a.bin")
    spec = tiled_spec(path, data, (32, 32), (ZSTD,))
    r = spec.tiles[0].range
    short = ByteRange(r.path, r.offset, r.nbytes - 20)
    bad = ChunkSpec((short,), spec.shape, spec.dtype, codec=spec.codec, tiles=(Tile(short, (32, 32), (0, 0)),))
    with pytest.raises(ChunkDecodeError, match="a.bin"):
        read(bad, device)


# -- whole-array reads decode in batches across chunks ---------------------------------------

def chunked_specs(path: str, data: np.ndarray, chunk: int, codec) -> tuple[dict, tuple]:
    """``data`` split along axis 0 into chunks of ``chunk`` rows, each stored as 2 tiles."""
    import dataclasses

    specs, rows, blobs = {}, [], []
    for i, a in enumerate(range(0, data.shape[0], chunk)):
        part = data[a:a + chunk]
        half = -(-part.shape[0] // 2)
        blobs += [encode(part[:half], codec), encode(part[half:], codec)]
        rows.append((i, part.shape, half))
    ranges = write_blobs(path, blobs)
    for (i, shape, half), r0, r1 in zip(rows, ranges[0::2], ranges[1::2]):
        tiles = (Tile(r0, (half, *shape[1:]), (0, 0)), Tile(r1, (shape[0] - half, *shape[1:]), (half, 0)))
        spec = ChunkSpec((r0, r1), shape, data.dtype.str, codec=tuple(codec), tiles=tiles)
        specs[(i, 0)] = dataclasses.replace(spec, index=(i, 0))
    chunks = (tuple(s.shape[0] for s in specs.values()), (data.shape[1],))
    return specs, chunks


def test_read_whole_decodes_in_batches_overlapping_reads(tmp_path, monkeypatch):
    import gpulazy.codecs
    import gpulazy.read.decode
    import gpulazy.read.engine
    import gpulazy.read.whole
    from gpulazy.array import ChunkSource, read_whole

    data = sample((40, 50), "<u2")
    # crc32c: every chunk stores the same number of bytes, so batches hold 3 chunks exactly
    specs, chunks = chunked_specs(str(tmp_path / "a.bin"), data, 4, (Codec("crc32c"),))
    events = []
    submit, batch = gpulazy.read.engine.start, gpulazy.read.decode.assemble_batch
    monkeypatch.setattr(gpulazy.read.engine, "start", lambda specs, *a, **k: events.extend(
        ("read", s.index) for s in specs) or submit(specs, *a, **k))
    monkeypatch.setattr(gpulazy.read.decode, "assemble_batch", lambda bufs, specs, *a: events.append(
        ("decode", [s.index for s in specs])) or batch(bufs, specs, *a))
    monkeypatch.setattr(gpulazy.read.whole, "GROUP", 3 * specs[(0, 0)].nbytes)  # 3 chunks a submission
    monkeypatch.setattr(gpulazy.read.whole, "STAGED", 6 * specs[(0, 0)].nbytes)  # 2 submissions in flight
    out = read_whole(specs, ChunkSource("cpu", None, False), chunks, data.dtype)
    np.testing.assert_array_equal(out, data)
    # One decode per submission of three chunks. They run on the settle pool's two threads, so in any
    # order (a CI run saw the last one finish before the third).
    decodes = sorted(e[1] for e in events if e[0] == "decode")
    assert decodes == [[(0, 0), (1, 0), (2, 0)], [(3, 0), (4, 0), (5, 0)], [(6, 0), (7, 0), (8, 0)], [(9, 0)]]
    assert [e[1] for e in events if e[0] == "read"] == [(i, 0) for i in range(10)]  # submitted in order


def test_read_whole_raises_for_a_corrupt_chunk_in_a_batch(tmp_path):
    from gpulazy.array import ChunkSource, read_whole

    data = sample((24, 30), "<u2")
    specs, chunks = chunked_specs(str(tmp_path / "a.bin"), data, 4, (ZLIB,))
    bad = specs[(3, 0)].tiles[1].range
    with open(bad.path, "r+b") as f:
        f.seek(bad.offset)
        f.write(b"\x00" * 8)
    with pytest.raises(ChunkDecodeError) as e:
        read_whole(specs, ChunkSource("cpu", None, False), chunks, data.dtype)
    assert e.value.offset == bad.offset


@pytest.mark.gpu
def test_read_whole_decodes_on_the_gpu_in_one_call_per_batch(tmp_path):
    from gpulazy.array import ChunkSource, read_whole

    gpulazy.stats().reset()
    data = sample((64, 256), "<u2")
    specs, chunks = chunked_specs(str(tmp_path / "a.bin"), data, 8, (ZSTD, Codec.of("shuffle", elementsize=2)))
    out = read_whole(specs, ChunkSource("cuda:0", None, False), chunks, data.dtype)
    np.testing.assert_array_equal(out.get(), data)
    snap = gpulazy.stats().snapshot()["decode_by_codec"]
    assert snap["zstd"]["gpu"]["calls"] == 1 and snap["shuffle"]["gpu"]["calls"] == 1


def test_step_sizes_work_back_from_the_expected_size():
    codec = (Codec("crc32c"), ZLIB, Codec.of("delta", dtype="<i4", astype="<i2"), Codec.of("shuffle", elementsize=4))
    assert step_sizes(codec, [400]) == [None, [200], [400], [400]]
    assert step_sizes((Codec("crc32c"), Codec("fletcher32")), [10]) == [[14], [10]]


def test_decoded_on_says_host_on_cpu():
    assert decoded_on((ZSTD,), get_device("cpu")) == "host"
    assert decoded_on(None, get_device("cpu")) == "none"


def test_cpu_decodes_are_recorded_in_stats(tmp_path):
    gpulazy.stats().reset()
    data = sample((16, 16), "<u2")
    read(tiled_spec(str(tmp_path / "a.bin"), data, (8, 16), (ZSTD,)), "cpu")
    snap = gpulazy.stats().snapshot()
    assert snap["decode_by_codec"]["zstd"]["host"]["bytes"] == data.nbytes
    assert snap["decoded_bytes"] == data.nbytes and set(snap["decode_by_place"]) == {"host"}


def test_record_decode_counts_per_codec_and_place():
    from gpulazy.stats import Stats

    s = Stats()
    s.record_decode(nbytes=4 * 10**9, seconds=0.25, codec="zstd", where="gpu", device="cuda:0")
    s.record_decode(nbytes=10**9, seconds=0.25, codec="zstd", where="gpu", device="cuda:0")
    s.record_decode(nbytes=10**8, seconds=0.5, codec="imagecodecs_lzw", where="host", device="cuda:0")
    snap = s.snapshot()
    assert snap["decode_by_codec"]["zstd"]["gpu"] == {"bytes": 5 * 10**9, "seconds": 0.5, "calls": 2}
    assert snap["decode_by_place"]["host"]["bytes"] == 10**8 and snap["decoded_bytes"] == 5_100_000_000
    s.reset()
    assert s.snapshot()["decoded_bytes"] == 0 and s.snapshot()["decode_by_codec"] == {}


def test_dashboard_says_where_each_codec_decodes():
    from gpulazy.stats import Stats
    from gpulazy.widgets import dashboard_figures

    s = Stats()
    memory = {"gpu": False, "used": 1, "total": 2, "reason": "none"}
    assert dashboard_figures(s.snapshot(), None, memory)["text"]["decode"] == "decode: nothing decoded yet"
    s.record_decode(nbytes=123 * 10**8, seconds=1.0, codec="zstd", where="gpu", device="cuda:0")
    s.record_decode(nbytes=10**8, seconds=0.5, codec="imagecodecs_lzw", where="host", device="cuda:0")
    text = dashboard_figures(s.snapshot(), None, memory)["text"]["decode"]
    assert text == "decode: imagecodecs_lzw on host 0.2 GB/s / zstd on GPU 12.3 GB/s"


def test_gpu_decode_setting_reads_flags():
    with gpulazy.config.set(gpu_decode="off"):
        assert gpulazy.config.get("gpu_decode") is False
    assert gpulazy.config.get("gpu_decode") is True
    with pytest.raises(gpulazy.errors.ConfigError, match="true or false"):
        gpulazy.config.set(gpu_decode="maybe")


# -- the GPU path ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("codec", [ZSTD, LZ4, ZLIB, GZIP, Codec.of("blosc", cname="lz4", clevel=5, shuffle=1, blocksize=0)],
                         ids=lambda c: c.id)
def test_compressors_really_decode_on_the_gpu(tmp_path, codec):
    gpulazy.stats().reset()
    data = sample((64, 100), "<u2")
    spec = tiled_spec(str(tmp_path / "a.bin"), data, (16, 100), (codec,))
    # Four small Deflate tiles would decode on the host's cores by choice (test_deflate_split.py).
    with warnings.catch_warnings(), _split.force("gpu"):
        warnings.simplefilter("error", PerformanceWarning)
        np.testing.assert_array_equal(read(spec, "cuda:0"), data)
    places = gpulazy.stats().snapshot()["decode_by_codec"][codec.id]
    assert set(places) == {"gpu"} and places["gpu"]["bytes"] == data.nbytes
    assert decoded_on((codec,), get_device("cuda:0")) == "gpu"


@pytest.mark.gpu
def test_gpu_decode_off_decodes_on_the_host_without_warning(tmp_path):
    gpulazy.stats().reset()
    data = sample((32, 40), "<u2")
    codec = (ZSTD, Codec.of("shuffle", elementsize=2))
    spec = tiled_spec(str(tmp_path / "a.bin"), data, (16, 40), codec)
    with gpulazy.config.set(gpu_decode=False), warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        out = engine_read([spec], get_backend(None, "cuda:0"))[0]
        assert decoded_on(codec, get_device("cuda:0")) == "host"
    np.testing.assert_array_equal(out.get(), data)
    assert set(gpulazy.stats().snapshot()["decode_by_place"]) == {"host"}


@pytest.mark.gpu
def test_gzip_header_fields_are_skipped_on_the_gpu(tmp_path):
    # FEXTRA, FNAME and FCOMMENT must be stepped over before the Deflate stream.
    import cupy

    data = sample((50, 50), "<u2").tobytes()
    plain = gzip.compress(data, mtime=0)
    head = bytearray(plain[:10])
    head[3] = 4 | 8 | 16
    fancy = bytes(head) + (3).to_bytes(2, "little") + b"xyz" + b"name.raw\x00" + b"a comment\x00" + plain[10:]
    gpulazy.stats().reset()
    with _split.force("gpu"):  # one piece would decode on the host by choice
        out = decode_pieces([cupy.asarray(np.frombuffer(fancy, "u1"))], (GZIP,), [len(data)], get_device("cuda:0"))
    assert out[0].get().tobytes() == data
    assert set(gpulazy.stats().snapshot()["decode_by_codec"]["gzip"]) == {"gpu"}


@pytest.mark.gpu
def test_unsupported_codec_warns_once_and_decodes_on_host(tmp_path):
    # blosc with blosclz inside has no GPU decoder (nvCOMP has no blosclz): host, one warning.
    _run._warn_once.cache_clear()
    gpulazy.stats().reset()
    data = sample((20, 20), "<u2")
    blosc = Codec.of("blosc", cname="blosclz", clevel=1, shuffle=2, blocksize=0)
    spec = tiled_spec(str(tmp_path / "a.bin"), data, (10, 20), (blosc,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        np.testing.assert_array_equal(read(spec, "cuda:0"), data)
        np.testing.assert_array_equal(read(spec, "cuda:0"), data)
    perf = [w for w in caught if issubclass(w.category, PerformanceWarning)]
    assert len(perf) == 1 and "blosc" in str(perf[0].message)
    assert set(gpulazy.stats().snapshot()["decode_by_codec"]["blosc"]) == {"host"}
    assert decoded_on((blosc,), get_device("cuda:0")) == "host"


@pytest.mark.gpu
@pytest.mark.parametrize("es", [2, 3, 4, 8])
def test_gpu_unshuffle_equals_numcodecs(es):
    import cupy
    import numcodecs

    from gpulazy.codecs import filters

    rng = np.random.default_rng(es)
    raw = [rng.integers(0, 256, n * es, dtype=np.uint8) for n in (1, 7, 1000, 4099)]
    enc = [np.frombuffer(numcodecs.Shuffle(es).encode(r), "u1") for r in raw]
    out = filters.decode([cupy.asarray(e) for e in enc], Codec.of("shuffle", elementsize=es))
    for o, r in zip(out, raw):
        np.testing.assert_array_equal(o.get(), r)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,astype", [("<u1", "<u1"), ("<i2", "<i2"), ("<u2", "<u2"), ("<i4", "<i2"),
                                          ("<u4", "<u4"), ("<i8", "<i8"), ("<i8", "<i4"), ("<f4", "<f4"),
                                          ("<f8", "<f8")])
def test_gpu_delta_equals_numcodecs(dtype, astype):
    import cupy
    import numcodecs

    from gpulazy.codecs import filters

    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    c = numcodecs.Delta(dtype=dtype, astype=astype)
    outs, encs = [], []
    for n in (1, 5, 1023, 1024, 1025, 70_001):
        if dt.kind == "f":
            x = rng.normal(0, 1e3, n).astype(dt)
        else:  # the first value is stored as is: it must fit ``astype``
            top = np.iinfo(np.dtype(astype))
            x = rng.integers(top.min // 2, top.max // 2, n, endpoint=True).astype(dt)
        enc = np.frombuffer(c.encode(x).tobytes(), "u1")
        encs.append(enc)
        outs.append(np.asarray(c.decode(enc)).tobytes())
    got = filters.decode([cupy.asarray(e) for e in encs], Codec.of("delta", dtype=dtype, astype=astype))
    for g, ref in zip(got, outs):
        assert g.get().tobytes() == ref


@pytest.mark.gpu
def test_gpu_filters_run_on_the_gpu(tmp_path):
    gpulazy.stats().reset()
    data = sample((30, 40), "<i4")
    codec = (Codec("crc32c"), ZSTD, Codec.of("delta", dtype="<i4", astype="<i4"), Codec.of("shuffle", elementsize=4))
    spec = tiled_spec(str(tmp_path / "a.bin"), data, (10, 40), codec)
    np.testing.assert_array_equal(read(spec, "cuda:0"), data)
    snap = gpulazy.stats().snapshot()["decode_by_codec"]
    assert all(set(snap[k]) == {"gpu"} for k in ("crc32c", "zstd", "delta", "shuffle"))


@pytest.mark.gpu
@pytest.mark.parametrize("codec", [LZ4], ids=lambda c: c.id)
def test_gpu_batch_with_a_garbled_payload_names_the_piece(codec):
    # Headers intact, payload garbled: nvCOMP's LZ4 must not hand back garbage for it. (Its
    # zstd and Deflate decoders assume valid input; see gpulazy.codecs.nvcomp.)
    import cupy

    data = sample((64, 64), "<u2")
    good = np.frombuffer(encode(data, (codec,)), "u1")
    bad = good.copy()
    bad[16:good.size - 16] = np.random.default_rng(1).integers(0, 256, good.size - 32, dtype=np.uint8)
    where = [ByteRange("good.bin", 0, good.size), ByteRange("bad.bin", 128, bad.size)]
    with pytest.raises(ChunkDecodeError) as e:
        decode_pieces([cupy.asarray(good), cupy.asarray(bad)], (codec,), [data.nbytes] * 2, get_device("cuda:0"),
                      where=where)
    assert e.value.path == "bad.bin" and "offset 128" in str(e.value)


def test_gzip_framing_parses_optional_fields():
    from gpulazy.codecs.nvcomp import _frame

    data = b"x" * 1000
    plain = gzip.compress(data, mtime=0)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="some_name.raw", fileobj=buf, mode="wb", mtime=0) as f:
        f.write(data)
    named = buf.getvalue()
    assert _frame("gzip", "gzip", plain[:64], plain[-8:], len(plain), 1000) == ((10, len(plain) - 8), "")
    start = 10 + len(b"some_name.raw") + 1
    assert _frame("gzip", "gzip", named[:64], named[-8:], len(named), 1000) == ((start, len(named) - 8), "")
    span, why = _frame("gzip", "gzip", plain[:64], plain[-8:], len(plain), 999)
    assert span is None and "1000" in why


def test_zstd_and_lz4_framings_check_sizes():
    import numcodecs

    from gpulazy.codecs.nvcomp import _frame

    blob = numcodecs.Zstd(1).encode(b"y" * 5000)
    assert _frame("zstd", "zstd", blob[:64], b"", len(blob), 5000)[0] == (0, len(blob))
    assert _frame("zstd", "zstd", blob[:64], b"", len(blob), 4999)[0] is None
    assert _frame("zstd", "zstd", b"\x00" * 64, b"", 100, 10)[0] is None
    # A frame that does not say its content size goes to the host: nvCOMP would not stop at the output's
    # end were it longer (an illegal address on an H200).
    zstandard = pytest.importorskip("zstandard")
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"y" * 5064)
    span, why = _frame("zstd", "zstd", unsized[:64], b"", len(unsized), 5000)
    assert span is None and "does not say" in why
    lz = numcodecs.LZ4().encode(b"z" * 300)
    assert _frame("lz4", "lz4-numcodecs", lz[:64], b"", len(lz), 300) == ((4, len(lz)), "")
    assert _frame("lz4", "lz4-numcodecs", lz[:64], b"", len(lz), 301)[0] is None
    zl = numcodecs.Zlib(1).encode(b"w" * 100)
    assert _frame("zlib", "zlib", zl[:64], b"", len(zl), 100) == ((2, len(zl) - 4), "")
    assert _frame("zlib", "zlib", b"\x00\x00" + zl[2:64], b"", len(zl), 100)[0] is None


def test_zstd_block_walk_fits_only_whole_frames():
    import numcodecs

    from gpulazy.codecs.nvcomp import zstd_blocks_fit, zstd_header

    data = sample((300, 300), "<u2").tobytes()  # > 128 KiB: several blocks
    for checksum in (False, True):
        blob = bytes(numcodecs.Zstd(level=1, checksum=checksum).encode(data))
        start, trailer = zstd_header(blob[:64])
        assert trailer == (4 if checksum else 0)
        assert zstd_blocks_fit(blob, start, trailer)
        assert not zstd_blocks_fit(blob[:-1], start, trailer)
        assert not zstd_blocks_fit(blob + b"\0", start, trailer)
        assert not zstd_blocks_fit(blob[: len(blob) // 2], start, trailer)
    rle = bytes(numcodecs.Zstd(level=1).encode(bytes(200_000)))  # RLE blocks carry one byte
    assert zstd_blocks_fit(rle, *zstd_header(rle[:64]))


@pytest.mark.parametrize("kind", ["ramp", "noise", "zeros", "empty"])
def test_lz4_walk_fits_only_whole_blocks(kind):
    # What the GPU walk lets through to nvCOMP: a block whose sequences end exactly at the
    # piece's end having produced the expected bytes; never one cut short (nvCOMP would read
    # the next piece) or one followed by more bytes.
    import numcodecs

    from gpulazy.codecs.lz4 import block_fits as lz4_block_fits

    n = 0 if kind == "empty" else 70_000
    raw = {"ramp": sample((n // 2,), "<u2").tobytes(), "noise": np.random.default_rng(0).bytes(n),
           "zeros": bytes(n), "empty": b""}[kind]
    blob = bytes(numcodecs.LZ4().encode(np.frombuffer(raw, "u1")))
    assert lz4_block_fits(blob, 4, len(raw))
    assert not lz4_block_fits(blob, 4, len(raw) + 1)
    for bad in (blob[:-1], blob + b"\0", blob[: len(blob) // 2], blob[:4]):
        assert not lz4_block_fits(bad, 4, len(raw))


_KERNEL_SHIM = ("struct D3 { long long x, y; };\n"
                "static D3 blockIdx = {0, 0}, blockDim = {1, 1}, threadIdx = {0, 0}, gridDim = {1, 1};\n"
                "extern \"C\" void gl_thread(long long t, long long n) { threadIdx.x = t; blockDim.x = n; }\n"
                "#define __global__\n#define __device__ static\n#define __syncthreads()\n")


def _host_kernels(tmp_path, sources: dict[str, str]) -> dict:
    """GPU kernel sources compiled as C++ for the host (one "thread", one thread block whose
    grid-stride loops then cover the whole grid): the kernels' rules, tested where CI runs."""
    import ctypes
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    libs = {}
    for name, source in sources.items():
        src, so = tmp_path / f"{name}.cpp", tmp_path / f"{name}.so"
        src.write_text(_KERNEL_SHIM + source)
        subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
        lib = ctypes.CDLL(str(so))
        libs[name] = getattr(lib, f"gl_{name}")
        libs[name].thread = lib.gl_thread  # gl_thread(t, n): run as thread t of a block of n
    return libs


def _walk_on_host(libs, data: bytes, start: int, limit: int, keep: int = 0) -> tuple[int, np.ndarray, int]:
    """The LZ4 walk kernel over one block: (status, recorded sequences, sequence count)."""
    import ctypes

    buf = ctypes.create_string_buffer(bytes(data), max(1, len(data)))
    arg = [(ctypes.c_longlong * 1)(v) for v in (len(data), start, limit)]
    ok, counts = (ctypes.c_int * 1)(0), (ctypes.c_int * 1)(0)
    rec = np.zeros(max(1, keep * 5), dtype=np.int64)
    libs["lz4_walk"]((ctypes.c_ulonglong * 1)(ctypes.addressof(buf)), *arg, ok, ctypes.c_longlong(1),
                     rec.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(keep), counts)
    return ok[0], rec, counts[0]


def test_walk_kernels_agree_with_their_host_twins(tmp_path):
    # The walk kernels compiled as C++ for the host (one "thread" per call), against the
    # Python twins on whole, cut, extended and garbled LZ4 blocks and zstd frames.
    import ctypes

    import numcodecs

    from gpulazy.codecs import lz4, nvcomp
    from gpulazy.codecs._frames import zstd_header

    libs = _host_kernels(tmp_path, {"zstd_walk": nvcomp._ZSTD_WALK, "lz4_walk": lz4._WALK})

    def zstd_kernel(data, start, limit):
        buf = ctypes.create_string_buffer(bytes(data), max(1, len(data)))
        arg = [(ctypes.c_longlong * 1)(v) for v in (len(data), start, limit)]
        ok = (ctypes.c_int * 1)(0)
        libs["zstd_walk"]((ctypes.c_ulonglong * 1)(ctypes.addressof(buf)), *arg, ok, ctypes.c_longlong(1))
        return bool(ok[0])

    rng = np.random.default_rng(0)
    for raw in (b"", bytes(70_000), rng.bytes(5000), sample((40_000,), "<u2").tobytes()):
        lz = bytes(numcodecs.LZ4().encode(np.frombuffer(raw, "u1")))
        garbled = bytearray(lz)
        garbled[len(lz) // 2] ^= 0x5A
        for v in (lz, lz[:-1], lz + b"\0", lz[: len(lz) // 2], bytes(garbled)):
            for want in (len(raw), len(raw) + 1):
                for keep in (0, lz4.RECORDS):
                    status = _walk_on_host(libs, v, 4, want, keep)[0]
                    assert (status != lz4.BAD) == lz4.block_fits(v, 4, want)
        assert _walk_on_host(libs, lz, 4, len(raw))[0] == lz4.DENSE  # recording nothing: nvCOMP's
        zs = bytes(numcodecs.Zstd(level=1).encode(np.frombuffer(raw, "u1")))
        for v in (zs, zs[:-1], zs + b"\0", zs[: max(6, len(zs) // 2)]):  # a whole header: _zstd checks that
            start, trailer = zstd_header(v[:64])
            assert zstd_kernel(v, start, trailer) == nvcomp.zstd_blocks_fit(v, start, trailer)
        assert zstd_kernel(zs, *zstd_header(zs[:64]))


def _sparse_decode_on_host(libs, block: bytes, want: int, keep: int) -> tuple[int, bytes | None]:
    """The walk, then the literal and match kernels, over one block: (status, decoded or None)."""
    import ctypes

    from gpulazy.codecs import lz4

    status, rec, count = _walk_on_host(libs, block, 0, want, keep)
    if status != lz4.SPARSE:
        return status, None
    src = ctypes.create_string_buffer(block, max(1, len(block)))
    out = ctypes.create_string_buffer(max(1, want))
    ptr = ctypes.c_void_p
    srcs = (ctypes.c_ulonglong * 1)(ctypes.addressof(src))
    dsts = (ctypes.c_ulonglong * 1)(ctypes.addressof(out))
    which, wants, counts = (ctypes.c_longlong * 1)(0), (ctypes.c_longlong * 1)(want), (ctypes.c_int * 1)(count)
    recp = rec.ctypes.data_as(ptr)
    libs["lz4_literals"](srcs, dsts, wants, which, recp, counts, ctypes.c_int(keep), ctypes.c_longlong(1),
                         ctypes.c_longlong(lz4.SLICE))
    libs["lz4_matches"](dsts, which, recp, counts, ctypes.c_int(keep), ctypes.c_longlong(1))
    return status, out.raw[:want]


@settings(max_examples=40, deadline=None)
@given(pattern=st.binary(min_size=1, max_size=40), times=st.integers(2, 3000), threads=st.sampled_from([7, 32, 256]))
def test_an_overlapping_match_decodes_whatever_order_its_threads_run_in(tmp_path_factory, pattern, times, threads):
    # A block of one literal run and one long match whose offset is shorter than the match
    # (a repeated pattern): on the GPU all threads of a block write the match's bytes at once.
    # Here the match kernel runs as each thread of a block in turn, the last thread first: a
    # byte may only be read from before the match (the ``k % offset`` rule), never from a byte
    # another thread of the same match writes.
    import ctypes

    import lz4.block

    from gpulazy.codecs import lz4 as glz4

    libs = _sparse_kernels(tmp_path_factory)
    raw = pattern * times
    block = lz4.block.compress(raw, store_size=False)
    status, rec, count = _walk_on_host(libs, block, 0, len(raw), glz4.RECORDS)
    assert status == glz4.SPARSE
    src = ctypes.create_string_buffer(block, len(block))
    out = ctypes.create_string_buffer(len(raw))
    srcs, dsts = (ctypes.c_ulonglong * 1)(ctypes.addressof(src)), (ctypes.c_ulonglong * 1)(ctypes.addressof(out))
    which, wants, counts = (ctypes.c_longlong * 1)(0), (ctypes.c_longlong * 1)(len(raw)), (ctypes.c_int * 1)(count)
    recp = rec.ctypes.data_as(ctypes.c_void_p)
    libs["lz4_literals"](srcs, dsts, wants, which, recp, counts, ctypes.c_int(glz4.RECORDS), ctypes.c_longlong(1),
                         ctypes.c_longlong(glz4.SLICE))
    matches = libs["lz4_matches"]
    try:
        for t in reversed(range(threads)):
            matches.thread(ctypes.c_longlong(t), ctypes.c_longlong(threads))
            matches(dsts, which, recp, counts, ctypes.c_int(glz4.RECORDS), ctypes.c_longlong(1))
    finally:
        matches.thread(ctypes.c_longlong(0), ctypes.c_longlong(1))  # the other tests run one thread
    if count == 2:  # one match (more would need the barrier between matches, which this cannot run)
        assert out.raw == raw


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_lz4_sparse_decode_kernels_match_lz4(tmp_path_factory, data):
    # Blocks of few sequences are decoded by our kernels, not nvCOMP: every byte must be
    # LZ4's. Hypothesis draws blocks of long literal runs, long and overlapping matches
    # (offsets shorter than the match: runs of a repeated pattern) and mixes of both.
    import lz4.block

    from gpulazy.codecs import lz4 as glz4

    libs = _sparse_kernels(tmp_path_factory)
    parts = data.draw(st.lists(st.one_of(
        st.binary(min_size=1, max_size=3000),  # noise: literals
        st.tuples(st.binary(min_size=1, max_size=7), st.integers(1, 5000)).map(lambda t: t[0] * t[1]),  # runs
    ), min_size=1, max_size=12))
    raw = b"".join(parts)
    block = lz4.block.compress(raw, store_size=False)
    keep = data.draw(st.sampled_from([1, 4, glz4.RECORDS]))
    status, out = _sparse_decode_on_host(libs, block, len(raw), keep)
    assert status in (glz4.DENSE, glz4.SPARSE)
    if status == glz4.SPARSE:
        assert out == raw
    if keep == glz4.RECORDS and len(parts) <= 3:
        assert status == glz4.SPARSE  # few parts make few sequences: this path is taken


def test_lz4_sparse_decode_of_incompressible_planes(tmp_path_factory):
    # What LZ4 makes of noisy uint16 planes (the benchmark's Zarr LZ4 chunks): a few dozen
    # sequences per 2 MiB, nearly all literals, decoded here.
    import numcodecs

    from gpulazy.codecs import lz4

    libs = _sparse_kernels(tmp_path_factory)
    rng = np.random.default_rng(3)
    y, x = np.mgrid[:512, :2048]
    raw = ((np.sin(x / 97.0) + np.cos(y / 131.0)) * 8000 + 20000).astype(np.uint16)
    raw = (raw + rng.integers(0, 8, raw.shape, dtype=np.uint16)).tobytes()
    block = bytes(numcodecs.LZ4(acceleration=1).encode(raw))[4:]
    status, out = _sparse_decode_on_host(libs, block, len(raw), lz4.RECORDS)
    assert status == lz4.SPARSE
    assert out == raw
    garbled = bytearray(block)
    garbled[len(block) // 3] ^= 0xFF  # inside a literal run: walks, and decodes to other bytes
    status, out = _sparse_decode_on_host(libs, bytes(garbled), len(raw), lz4.RECORDS)
    assert status == lz4.BAD or (len(out) == len(raw) and out != raw)
    assert _sparse_decode_on_host(libs, bytes(block[:-1]), len(raw), lz4.RECORDS)[0] == lz4.BAD
    assert _sparse_decode_on_host(libs, block, len(raw) + 1, lz4.RECORDS)[0] == lz4.BAD


@pytest.mark.gpu
@settings(max_examples=25, deadline=None)
@given(st.data())
def test_lz4_blocks_of_few_sequences_decode_on_the_gpu_like_lz4(data):
    # The same kernels on the GPU, 256 threads each: the bytes of an overlapping match are
    # written in parallel, so a wrong source index shows here (the host harness runs one
    # thread in order). Blocks too dense to record still go to nvCOMP, in the same batch.
    import cupy
    import numcodecs

    from gpulazy.codecs import lz4, nvcomp

    run = st.tuples(st.binary(min_size=1, max_size=9), st.integers(1, 70_000)).map(lambda t: t[0] * t[1])
    noise = st.integers(1, 300_000).map(lambda n: np.random.default_rng(n).bytes(n))
    raws = data.draw(st.lists(st.lists(st.one_of(noise, run), min_size=1, max_size=4).map(b"".join),
                              min_size=1, max_size=6))
    raws.append(np.random.default_rng(1).integers(0, 4, 60_000, np.uint8).tobytes())  # thousands of sequences
    blobs = [bytes(numcodecs.LZ4().encode(np.frombuffer(r, "u1"))) for r in raws]
    pieces = [cupy.asarray(np.frombuffer(b, "u1")) for b in blobs]
    walked = lz4.walk(np.array([p.data.ptr for p in pieces], np.uint64), np.array([len(b) for b in blobs]),
                      np.full(len(blobs), 4), np.array([len(r) for r in raws]))
    assert walked.status[-1] == lz4.DENSE and (walked.status[:-1] == lz4.SPARSE).any()
    got = nvcomp.decode(pieces, LZ4, [len(r) for r in raws])
    assert got.host == []
    for out, raw in zip(got.out, raws):
        assert out.get().tobytes() == raw


_SPARSE_LIBS: dict = {}


def _sparse_kernels(tmp_path_factory) -> dict:
    from gpulazy.codecs import lz4

    if not _SPARSE_LIBS:
        _SPARSE_LIBS.update(_host_kernels(tmp_path_factory.mktemp("lz4"), {
            "lz4_walk": lz4._WALK, "lz4_literals": lz4._LITERALS, "lz4_matches": lz4._MATCHES}))
    return _SPARSE_LIBS


def test_gpu_kernels_compile():
    # NVRTC needs no GPU: every kernel source compiles for Hopper here too.
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from gpulazy.codecs import filters, lz4, nvcomp

    from gpulazy import _xxh3_gpu
    from gpulazy.codecs import _unshuffle, bitshuffle, blosc, place

    sources = [filters._COPY, filters._UNSHUFFLE, nvcomp._ZSTD_WALK, lz4._WALK, lz4._LITERALS, lz4._MATCHES, filters._DELTA_SEQ.format(t="double"),
               blosc._WALK, _unshuffle._KERNEL, bitshuffle._WALK,
               filters._DELTA_INT.format(ti="short", u="unsigned short", acc="unsigned int"),
               filters._DELTA_INT.format(ti="int", u="unsigned long long", acc="unsigned long long")]
    sources += [place._source(w) for w in (1, 2, 4, 8, 16)]
    for src, entry in [(s, ".entry gl_") for s in sources] + [(_xxh3_gpu._SOURCE, ".entry xxh3_128")]:
        prog = nvrtc.createProgram(src, "k.cu", [], [])
        try:
            nvrtc.compileProgram(prog, ["-arch=compute_90"])
        except Exception:
            pytest.fail(nvrtc.getProgramLog(prog))
        ptx = nvrtc.getPTX(prog)
        assert entry in (ptx.decode() if isinstance(ptx, bytes) else ptx)


def test_nvcomp_and_filters_report_nothing_without_a_gpu():
    from gpulazy.codecs import filters, nvcomp

    if get_device(None).is_gpu:
        pytest.skip("this machine has a GPU")
    assert nvcomp.supported() == frozenset() and filters.supported() == frozenset()
    assert _pipeline.gpu_codecs() == frozenset()


def test_blob_offsets_are_odd(tmp_path):
    # The helper's 7-byte header puts pieces at unaligned offsets, as real files do.
    ranges = write_blobs(str(tmp_path / "a.bin"), [b"ab", b"cde"])
    assert [r.offset for r in ranges] == [7, 9] and os.path.getsize(tmp_path / "a.bin") == 12
