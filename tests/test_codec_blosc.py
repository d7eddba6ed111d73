"""Blosc on the GPU (``gpulazy.codecs.blosc``): its header parse, stream walk and unshuffle.

The CPU tests decode c-blosc's own output (``numcodecs.blosc.compress``) with the plan the
GPU path follows — ``parse_header``, ``walk_streams`` (the walk kernel's host twin), each
stream through python-lz4 / zstd / zlib, ``unshuffle_block`` (the assemble kernel's twin)
— and require c-blosc's bytes for every inner codec, shuffle, type size, level and block
size. The ``gpu`` tests hold the kernels and the nvCOMP batch to the same bytes.
"""

from __future__ import annotations

import struct
import warnings
import zlib

import numcodecs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpulazy
from gpulazy.codecs import blosc, decode_pieces, decoded_on
from gpulazy.codecs._frames import FrameError
from gpulazy.device import get_device
from gpulazy.errors import ChunkDecodeError, PerformanceWarning
from gpulazy.spec import ByteRange, Codec

lz4_block = pytest.importorskip("lz4.block")

SHUFFLES = {"none": 0, "byte": 1, "bit": 2}


def data_for(n: int, typesize: int, seed: int, kind: str = "smooth") -> bytes:
    """``n`` bytes: a noisy ramp of ``typesize``-byte values (compresses), or random bytes (does not)."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    count = -(-n // typesize)
    dt = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}.get(typesize)
    if dt is None:
        vals = rng.integers(0, 4, count * typesize, dtype=np.uint8)
        return vals.tobytes()[:n]
    top = min(np.iinfo(np.dtype(dt)).max, 50_000)
    vals = (np.linspace(0, top // 2, count) + rng.integers(0, max(2, top // 100), count)).astype(dt)
    return vals.tobytes()[:n]


def compress(raw: bytes, cname: str, clevel: int, shuffle: int, blocksize: int, typesize: int) -> bytes:
    return bytes(numcodecs.blosc.compress(raw, cname.encode(), clevel, shuffle, blocksize, typesize))


def plan_decode(blob: bytes, expected: int | None = None) -> bytes:
    """The GPU path's plan run on the host: header, stream walk, safe inner decoder, unshuffle."""
    return blosc.decode_checked(np.frombuffer(blob, np.uint8), Codec("blosc"), expected).tobytes()


# -- the plan reproduces c-blosc ------------------------------------------------------------

@pytest.mark.parametrize("cname", ["lz4", "lz4hc", "zstd"])
@pytest.mark.parametrize("shuffle", SHUFFLES.values(), ids=SHUFFLES.keys())
@pytest.mark.parametrize("typesize", [1, 2, 4, 8])
@pytest.mark.parametrize("blocksize", [0, 256, 4096], ids=lambda b: f"block{b}")
def test_plan_decodes_like_c_blosc(cname, shuffle, typesize, blocksize):
    for n, kind, clevel in ((20_000, "smooth", 5), (5_003, "smooth", 1), (3_000, "random", 9), (130, "smooth", 5)):
        raw = data_for(n, typesize, seed=n + typesize, kind=kind)
        blob = compress(raw, cname, clevel, shuffle, blocksize, typesize)
        assert bytes(numcodecs.Blosc().decode(blob)) == raw  # c-blosc's own round trip
        assert plan_decode(blob, len(raw)) == raw, (cname, shuffle, typesize, blocksize, n, kind, clevel)


@pytest.mark.parametrize("shuffle", SHUFFLES.values(), ids=SHUFFLES.keys())
@pytest.mark.parametrize("typesize", [1, 2, 4, 8, 3])
def test_blosclz_streams_are_found_and_stored_ones_decode(shuffle, typesize):
    # No Python blosclz decoder: the walk must tile the piece exactly, stream after stream,
    # and blocks whose streams are all stored raw must decode.
    for kind in ("smooth", "random"):
        raw = data_for(40_000, typesize, seed=typesize, kind=kind)
        blob = compress(raw, "blosclz", 5, shuffle, 2048, typesize)
        h = blosc.parse_header(blob[:16], len(blob), len(raw))
        if h.memcpyed:
            assert plan_decode(blob) == raw
            continue
        streams = blosc.walk_streams(blob, h)
        assert len(streams) == sum(h.block(b)[1] for b in range(h.nblocks))
        assert streams[0][0] == 16 + 4 * h.nblocks + 4 and streams[-1][0] + streams[-1][1] == len(blob)
        for (o1, c1), (o2, _) in zip(streams, streams[1:]):
            assert o1 + c1 + 4 == o2  # back to back, each behind its 4-byte size


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9000), typesize=st.sampled_from([1, 2, 3, 4, 8, 16, 17]),
       shuffle=st.sampled_from([0, 1, 2]), cname=st.sampled_from(["lz4", "zstd"]),
       blocksize=st.sampled_from([0, 128, 200, 1024]), seed=st.integers(0, 3))
def test_plan_decodes_any_size_like_c_blosc(n, typesize, shuffle, cname, blocksize, seed):
    # Sizes that are no multiple of the type size or the block size; type sizes past the
    # 16 that c-blosc still splits.
    raw = data_for(n, typesize, seed)
    blob = compress(raw, cname, 5, shuffle, blocksize, typesize)
    assert plan_decode(blob, n) == raw


def split_lz4(raw: bytes, typesize: int, blocksize: int, flags: int = 0x21) -> bytes:
    """A blosc1 buffer written here: byte-shuffled blocks split into ``typesize`` LZ4 streams,
    incompressible streams stored raw (what c-blosc writes, built independently of it)."""
    nblocks = -(-len(raw) // blocksize)
    body, starts = bytearray(), []
    at = 16 + 4 * nblocks
    for b in range(nblocks):
        block = np.frombuffer(raw[b * blocksize:(b + 1) * blocksize], np.uint8)
        last = b == nblocks - 1 and len(raw) % blocksize
        split = not last and typesize <= 16 and len(block) // typesize >= 128 and not flags & 0x10
        count = len(block) // typesize
        shuffled = block.copy()
        shuffled[:count * typesize] = block[:count * typesize].reshape(count, typesize).T.reshape(-1)
        starts.append(at + len(body))
        parts = np.split(shuffled, typesize) if split else [shuffled]
        for part in parts:
            c = lz4_block.compress(part.tobytes(), store_size=False)
            c = c if len(c) < part.size else part.tobytes()
            body += struct.pack("<i", len(c)) + c
    head = struct.pack("<BBBBIII", 2, 1, flags, typesize, len(raw), blocksize, 16 + 4 * nblocks + len(body))
    return head + struct.pack(f"<{nblocks}i", *starts) + bytes(body)


@pytest.mark.parametrize("typesize", [2, 4, 8, 16])
def test_split_lz4_written_here_decodes_like_c_blosc(typesize):
    raw = data_for(300_000, typesize, seed=typesize)
    blob = split_lz4(raw, typesize, 32768)
    assert bytes(numcodecs.Blosc().decode(blob)) == raw  # c-blosc reads what we wrote
    h = blosc.parse_header(blob[:16], len(blob), len(raw))
    assert h.block(0) == (32768, typesize) and h.block(h.nblocks - 1)[1] == 1
    assert plan_decode(blob, len(raw)) == raw


def test_zarr_v2_default_blosc_splits_lz4_streams():
    # Zarr v2's default compressor (lz4, byte shuffle) splits each block into typesize
    # streams: the case nothing else decodes on the GPU.
    raw = np.arange(100_000, dtype="<u2").tobytes()
    blob = bytes(numcodecs.Blosc(cname="lz4", clevel=5, shuffle=1).encode(np.frombuffer(raw, "<u2")))
    h = blosc.parse_header(blob[:16], len(blob), len(raw))
    assert (h.codec, h.mode, h.flags & 0x10) == ("lz4", 1, 0) and h.block(0)[1] == 2
    assert plan_decode(blob, len(raw)) == raw


def test_unshuffle_twin_matches_numcodecs_shuffle_and_bitshuffle():
    rng = np.random.default_rng(0)
    for ts, count in ((2, 64), (4, 24), (8, 8), (3, 16)):
        block = rng.integers(0, 256, ts * count + 1, dtype=np.uint8)  # one trailing byte
        shuffled = block.copy()
        shuffled[:-1] = numcodecs.Shuffle(ts).encode(block[:-1])
        assert blosc.unshuffle_block(shuffled, ts, 1).tobytes() == block.tobytes()
    # bitshuffle: LSB-first bit planes per byte position, as bitshuffle's bshuf_trans_bit_elem
    vals = np.array([1, 2, 4, 8, 16, 32, 64, 128], dtype=np.uint8)
    planes = np.eye(8, dtype=np.uint8)
    shuffled = np.packbits(planes, axis=1, bitorder="little").reshape(-1)
    assert blosc.unshuffle_block(shuffled, 1, 2).tobytes() == vals.tobytes()
    odd = rng.integers(0, 256, 7 * 4, dtype=np.uint8)  # 7 elements: not a multiple of 8, stored as is
    assert blosc.unshuffle_block(odd, 4, 2).tobytes() == odd.tobytes()


# -- the header checks ----------------------------------------------------------------------

def first_compressed_stream(blob: bytes, n: int) -> int:
    """Where the first stream that is not stored raw starts (a stored one has no structure to check)."""
    h = blosc.parse_header(blob[:16], len(blob), n)
    sizes = [h.block(b)[0] // h.block(b)[1] for b in range(h.nblocks) for _ in range(h.block(b)[1])]
    return next(off for (off, c), raw in zip(blosc.walk_streams(blob, h), sizes) if c != raw)


def lz4_blob(n: int = 20_000) -> tuple[bytes, int]:
    raw = data_for(n, 2, seed=1)
    return compress(raw, "lz4", 5, 1, 0, 2), n


@pytest.mark.parametrize("mutate, match", [
    (lambda b: b[:10], "cannot hold its 16-byte header"),
    (lambda b: b[:-1], "says the piece is"),
    (lambda b: b + b"\0", "says the piece is"),
    (lambda b: b"\x03" + b[1:], "format version 3"),
    (lambda b: b[:2] + bytes([b[2] | 8]) + b[3:], "format version"),
    (lambda b: b[:1] + b"\x02" + b[2:], "inner format version 2"),
    (lambda b: b[:8] + struct.pack("<I", 0) + b[12:], "block size 0"),
    (lambda b: b[:3] + b"\x00" + b[4:], "type size 0"),
    (lambda b: b[:8] + struct.pack("<I", 1) + b[12:], "cannot hold the starts"),
    (lambda b: b[:8] + struct.pack("<I", 1001) + b[12:], "not a multiple of the type size"),
    (lambda b: b[:2] + bytes([b[2] | 2]) + b[3:], "stored \\(memcpyed\\)"),
])
def test_bad_headers_are_refused_before_any_stream(mutate, match):
    blob, n = lz4_blob()
    with pytest.raises(FrameError, match=match):
        blosc.parse_header(mutate(blob)[:16], len(mutate(blob)), n)


def test_a_header_declaring_another_size_is_refused():
    blob, n = lz4_blob()
    with pytest.raises(FrameError, match=f"decodes to {n} bytes") as e:
        blosc.parse_header(blob[:16], len(blob), n + 2)
    assert e.value.got == n


@pytest.mark.parametrize("where, value, match", [
    ("start", 3, "starts at 3"),
    ("start", 10**6, "starts at 1000000"),
    ("size", 0, "0 compressed bytes"),
    ("size", 2**31 + 5, "compressed bytes"),
    ("size", 10**6, "do not fit"),
])
def test_garbled_stream_table_is_refused_by_the_walk(where, value, match):
    blob, n = lz4_blob()
    h = blosc.parse_header(blob[:16], len(blob), n)
    start = int.from_bytes(blob[16:20], "little")
    at = 16 if where == "start" else start
    bad = blob[:at] + struct.pack("<I", value) + blob[at + 4:]
    with pytest.raises(FrameError, match=match):
        blosc.walk_streams(bad, h)


def first_match_offset(stream: bytes) -> int:
    """Where the first sequence's 2-byte match offset lies in an LZ4 block."""
    token, pos = stream[0], 1
    lit = token >> 4
    if lit == 15:
        while stream[pos] == 255:
            lit, pos = lit + 255, pos + 1
        lit, pos = lit + stream[pos], pos + 1
    return pos + lit


@pytest.mark.parametrize("damage", ["zeros", "offset past the output"])
def test_checked_decode_refuses_a_garbled_lz4_payload(damage):
    # A match reaching before the block's first byte is what LZ4_decompress_fast (c-blosc)
    # reads from outside its output, and the safe decoder may take within its buffer: the
    # walk's rules (the GPU kernel's) refuse it before any decoder runs.
    raw = data_for(200_000, 2, seed=3)
    good = compress(raw, "lz4", 5, 1, 0, 2)
    at = first_compressed_stream(good, len(raw))
    if damage == "zeros":
        bad = good[:at] + bytes(64) + good[at + 64:]
    else:
        m = at + first_match_offset(good[at:])
        bad = good[:m] + b"\xff\xff" + good[m + 2:]
    with pytest.raises(FrameError, match="its sequences are corrupt"):
        plan_decode(bad, len(raw))


def test_checked_decode_is_what_the_gpu_path_falls_back_to(tmp_path):
    # A piece the GPU refused is decoded on the host as "blosc_checked"; its errors name blosc.
    blob, n = lz4_blob()
    bad = blob[:4] + struct.pack("<I", n - 2) + blob[8:]
    where = ByteRange(str(tmp_path / "c.zarr/1"), 8, len(bad))
    with pytest.raises(ChunkDecodeError, match=r"the blosc chunk of '.*c\.zarr/1' at offset 8.*decodes to"):
        decode_pieces([np.frombuffer(bad, np.uint8)], (Codec("blosc_checked"),), [n], get_device("cpu"),
                      where=[where])
    assert decode_pieces([np.frombuffer(blob, np.uint8)], (Codec("blosc_checked"),), [n],
                         get_device("cpu"))[0].tobytes() == data_for(n, 2, seed=1)


def test_truncated_piece_fails_in_the_header_on_cpu(tmp_path):
    # The CPU path (numcodecs) gets the same header check: a clear error naming the file.
    blob, n = lz4_blob()
    where = ByteRange(str(tmp_path / "x.zarr/0.0"), 40, len(blob) - 5)
    with pytest.raises(ChunkDecodeError, match=r"x\.zarr/0\.0.*offset 40"):
        decode_pieces([np.frombuffer(blob[:-5], np.uint8)], (Codec.of("blosc"),), [n], get_device("cpu"),
                      where=[where])


def test_blosc_is_host_only_without_a_gpu():
    assert not blosc.handles(Codec.of("blosc", cname="lz4")) or get_device(None).is_gpu
    assert decoded_on((Codec.of("blosc"),), get_device("cpu")) == "host"


# -- the GPU path ---------------------------------------------------------------------------

def gpu_batch(blobs: list[bytes]) -> list:
    """Blobs as exact-length views into one device buffer at odd offsets, as a read leaves them."""
    import cupy

    buf = bytearray(b"\x07")
    spans = []
    for b in blobs:
        spans.append((len(buf), len(b)))
        buf += b + b"\x5a" * 3  # bytes after each piece: a decoder that overreads sees garbage
    dev = cupy.asarray(np.frombuffer(bytes(buf), np.uint8))
    return [dev[a:a + n] for a, n in spans]


def gpu_decode(blobs: list[bytes], sizes: list[int], codec: Codec = Codec.of("blosc", cname="lz4")) -> list[bytes]:
    out = decode_pieces(gpu_batch(blobs), (codec,), sizes, get_device("cuda:0"),
                        where=[ByteRange("/data/z.zarr/c", 1000 * k, len(b)) for k, b in enumerate(blobs)])
    return [o.get().tobytes() for o in out]


@pytest.mark.gpu
@pytest.mark.parametrize("cname", ["lz4", "lz4hc", "zstd"])
@pytest.mark.parametrize("shuffle", SHUFFLES.values(), ids=SHUFFLES.keys())
def test_gpu_decodes_blosc_like_c_blosc_with_no_host_step(cname, shuffle):
    # Many chunks of random sizes, type sizes and block sizes in one batch: every byte as
    # c-blosc decodes it, every chunk on the GPU (no warning, stats say gpu only).
    rng = np.random.default_rng(shuffle)
    raws, blobs = [], []
    for k in range(24):
        ts = int(rng.choice([1, 2, 4, 8]))
        raw = data_for(int(rng.integers(1, 300_000)), ts, seed=k)
        raws.append(raw)
        blobs.append(compress(raw, cname, int(rng.integers(1, 10)), shuffle, int(rng.choice([0, 256, 8192])), ts))
    gpulazy.stats().reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        got = gpu_decode(blobs, [len(r) for r in raws], Codec.of("blosc", cname=cname))
    for k, (g, raw, blob) in enumerate(zip(got, raws, blobs)):
        h = blosc.parse_header(blob[:16], len(blob), len(raw))
        assert g == raw, f"chunk {k}: {h} decoded wrong from byte {next(i for i in range(len(raw)) if g[i] != raw[i])}"
    places = gpulazy.stats().snapshot()["decode_by_codec"]["blosc"]
    assert set(places) == {"gpu"}, places
    assert decoded_on((Codec.of("blosc", cname=cname),), get_device("cuda:0")) == "gpu"


@pytest.mark.gpu
@pytest.mark.parametrize("typesize", [2, 4, 8, 16])
def test_gpu_decodes_split_lz4_blocks(typesize):
    raws = [data_for(n, typesize, seed=n) for n in (300_000, 65_536, 40_000)]
    blobs = [split_lz4(r, typesize, bs) for r, bs in zip(raws, (32768, 8192, 4096))]
    assert gpu_decode(blobs, [len(r) for r in raws]) == raws


@pytest.mark.gpu
def test_gpu_blosc_mixed_batch_warns_once_for_blosclz():
    # lz4, zstd, memcpyed and blosclz chunks in one call: blosclz decodes on the host with
    # one PerformanceWarning, the rest on the GPU.
    from gpulazy.codecs import _run

    _run._warn_once.cache_clear()
    raws = [data_for(50_000, 4, seed=k) for k in range(3)] + [data_for(9_000, 1, 7, kind="random")]
    blobs = [compress(raws[0], "lz4", 5, 1, 0, 4), compress(raws[1], "zstd", 3, 2, 0, 4),
             compress(raws[2], "blosclz", 5, 1, 0, 4), compress(raws[3], "lz4", 5, 0, 0, 1)]
    assert blosc.parse_header(blobs[3][:16], len(blobs[3]), len(raws[3])).memcpyed
    gpulazy.stats().reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gpu_decode(blobs, [len(r) for r in raws]) == raws
    perf = [w for w in caught if issubclass(w.category, PerformanceWarning)]
    assert len(perf) == 1 and "blosc" in str(perf[0].message), [str(w.message) for w in perf]
    places = gpulazy.stats().snapshot()["decode_by_codec"]["blosc"]
    assert places["host"]["bytes"] == len(raws[2]) and places["gpu"]["bytes"] == sum(map(len, raws)) - len(raws[2])


@pytest.mark.gpu
@pytest.mark.parametrize("damage", ["truncated", "cbytes", "start", "stream size", "payload", "match offset",
                                    "nbytes"])
def test_gpu_garbled_blosc_raises_naming_the_chunk_and_keeps_the_gpu_usable(damage):
    import cupy

    raw = data_for(200_000, 2, seed=3)
    good = compress(raw, "lz4", 5, 1, 0, 2)
    start = int.from_bytes(good[16:20], "little")
    at = first_compressed_stream(good, len(raw))
    m = at + first_match_offset(good[at:])
    bad = {"truncated": good[:-7],
           "cbytes": good[:12] + struct.pack("<I", len(good) + 9) + good[16:],
           "start": good[:16] + struct.pack("<I", len(good) - 2) + good[20:],
           "stream size": good[:start] + struct.pack("<I", 7) + good[start + 4:],
           "payload": good[:at] + bytes(64) + good[at + 64:],
           "match offset": good[:m] + b"\xff\xff" + good[m + 2:],
           "nbytes": good[:4] + struct.pack("<I", len(raw) - 2) + good[8:]}[damage]
    with pytest.raises(ChunkDecodeError, match=r"/data/z\.zarr/c' at offset 1000") as e:
        gpu_decode([good, bad, good], [len(raw)] * 3)
    assert e.value.path == "/data/z.zarr/c" and e.value.offset == 1000
    assert gpu_decode([good], [len(raw)]) == [raw]  # the CUDA context survived
    cupy.cuda.get_current_stream().synchronize()


@pytest.mark.gpu
def test_gpu_walk_kernel_agrees_with_its_host_twin():
    # Block starts and stream sizes garbled at random: the kernel keeps a block exactly when
    # walk_streams accepts the piece, and finds the same offsets and sizes.
    import cupy

    from gpulazy.codecs.blosc import _walk, block_table
    from gpulazy.codecs.pieces import Pieces

    rng = np.random.default_rng(5)
    raw = data_for(100_000, 4, seed=2)
    good = compress(raw, "lz4", 5, 1, 4096, 4)
    h = blosc.parse_header(good[:16], len(good), len(raw))
    for trial in range(60):
        blob = bytearray(good)
        for _ in range(int(rng.integers(0, 3))):
            at = int(rng.integers(16, min(len(blob), 16 + 4 * h.nblocks + 600)))
            blob[at] = int(rng.integers(0, 256))
        blob = bytes(blob)
        piece = cupy.asarray(np.frombuffer(blob, np.uint8))
        offsets, sizes, ok = _walk(Pieces.of([piece]), {0: h}, block_table({0: h}))
        try:
            want = blosc.walk_streams(blob, h)
        except FrameError:
            assert not ok.all(), f"trial {trial}: the kernel accepted what walk_streams refuses"
        else:
            assert ok.all() and list(zip(offsets.tolist(), sizes.tolist())) == want, f"trial {trial}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("typesize, bsize, streams", [(2, 4096, 2), (4, 4096, 1), (8, 1000, 1), (3, 768, 3),
                                                      (4, 44, 1), (1, 4096, 1), (16, 16 * 128, 16)])
def test_gpu_assemble_kernel_agrees_with_unshuffle_twin(mode, typesize, bsize, streams):
    import cupy

    from gpulazy.codecs._unshuffle import unshuffle_blocks
    from gpulazy.codecs.blosc import Header

    rng = np.random.default_rng(bsize + mode)
    shuffled = rng.integers(0, 256, bsize, dtype=np.uint8)
    parts = [cupy.asarray(p) for p in np.split(shuffled, streams)]
    flags = {0: 0, 1: 1, 2: 4}[mode] | 0x20
    h = Header(flags, typesize, bsize, bsize, 0)
    out = cupy.zeros(bsize, dtype=np.uint8)
    unshuffle_blocks(np.array([[out.data.ptr, bsize, typesize, h.mode, 0, bsize // streams]]),
             np.array([p.data.ptr for p in parts], np.uint64))
    want = blosc.unshuffle_block(shuffled, typesize, h.mode)
    got = out.get()
    assert got.tobytes() == want.tobytes(), f"first wrong byte {int(np.argmax(got != want))}"


def test_gpu_kernel_sources_name_their_entry_points():
    from gpulazy.codecs import _unshuffle

    for src, name in ((blosc._WALK, "gl_blosc_walk"), (_unshuffle._KERNEL, "gl_unshuffle_blocks")):
        assert f'extern "C" __global__ void {name}(' in src
