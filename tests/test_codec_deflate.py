"""Deflate on the host's cores (libdeflate through the ``deflate`` package), and beside nvCOMP on a GPU.

HDF5 gzip chunks and TIFF deflate tiles are ``zlib`` pieces; numcodecs ``GZip`` writes
``gzip`` ones. On ``"cpu"`` a batch decodes on ``_run.host_pool`` with libdeflate; on a GPU
a batch is shared between nvCOMP and the host's cores (``codecs._split`` plans it,
``codecs._beside`` runs it; the plan itself is tested in ``test_deflate_split.py``).
"""

from __future__ import annotations

import gzip
import threading
import warnings
import zlib

import numcodecs
import numpy as np
import pytest

import gpulazy
from gpulazy.codecs import _beside, _split, decode_pieces, host
from gpulazy.device import get_device
from gpulazy.errors import ChunkDecodeError, PerformanceWarning
from gpulazy.spec import ByteRange, Codec

deflate = pytest.importorskip("deflate")

ZLIB, GZIP = Codec.of("zlib", level=1), Codec.of("gzip", level=1)


def payload(n: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return (np.linspace(0, 3000, n // 2) + rng.integers(0, 300, n // 2)).astype("<u2").tobytes()


def encoded(codec: Codec, raw: bytes) -> bytes:
    return bytes(numcodecs.get_codec(codec.config()).encode(np.frombuffer(raw, np.uint8)))


@pytest.mark.parametrize("codec", [ZLIB, GZIP, Codec.of("imagecodecs_zlib"), Codec.of("imagecodecs_deflate")],
                         ids=lambda c: c.id)
def test_libdeflate_decodes_each_framing_like_numcodecs(codec):
    raw = payload(300_000, 1)
    blob = gzip.compress(raw, mtime=0) if codec.id == "gzip" else zlib.compress(raw, 6)
    got = host._inflate(np.frombuffer(blob, np.uint8), codec, len(raw))
    assert got is not None and got.tobytes() == raw and got.flags.writeable


def test_raw_deflate_uses_libdeflates_raw_decoder():
    raw = payload(50_000, 2)
    co = zlib.compressobj(6, zlib.DEFLATED, -15)
    blob = co.compress(raw) + co.flush()
    got = host._inflate(np.frombuffer(blob, np.uint8), Codec.of("imagecodecs_deflate", raw=True), len(raw))
    assert got.tobytes() == raw


def test_a_stream_libdeflate_refuses_goes_to_the_codecs_own_decoder():
    raw = payload(20_000, 3)
    bad = bytearray(zlib.compress(raw))
    bad[-1] ^= 1  # the Adler-32 trailer: libdeflate checks it, and refuses
    assert host._inflate(np.frombuffer(bytes(bad), np.uint8), ZLIB, len(raw)) is None
    with pytest.raises(ChunkDecodeError, match=r"zlib chunk of '/h5/a\.h5' at offset 96.*incorrect data check"):
        decode_pieces([np.frombuffer(bytes(bad), np.uint8)], (ZLIB,), [len(raw)], get_device("cpu"),
                      where=[ByteRange("/h5/a.h5", 96, len(bad))])


@pytest.mark.parametrize("delta", [-2, 2])
def test_a_stream_of_another_size_raises_naming_the_file(delta):
    raw = payload(20_000, 4)
    blob = np.frombuffer(zlib.compress(raw), np.uint8)
    with pytest.raises(ChunkDecodeError, match=r"'/t/a\.tif' at offset 8 .*expected") as e:
        decode_pieces([blob], (ZLIB,), [len(raw) + delta], get_device("cpu"),
                      where=[ByteRange("/t/a.tif", 8, blob.size)])
    assert e.value.expected == len(raw) + delta


def test_a_cpu_batch_decodes_on_the_host_pool(monkeypatch):
    # Before, the pieces of a batch decoded one after the other on the calling thread.
    seen: list[str] = []
    real = host.decode

    def spy(data, codec, expected):
        seen.append(threading.current_thread().name)
        return real(data, codec, expected)

    monkeypatch.setattr(host, "decode", spy)
    raws = [payload(40_000, k) for k in range(6)]
    blobs = [np.frombuffer(encoded(ZLIB, r), np.uint8) for r in raws]
    out = decode_pieces(blobs, (ZLIB,), [len(r) for r in raws], get_device("cpu"))
    assert [o.tobytes() for o in out] == raws
    assert len(seen) == 6 and all(name.startswith("gpulazy-host-decode") for name in seen), seen


def test_host_map_raises_the_first_failing_pieces_error():
    raws = [payload(10_000, k) for k in range(4)]
    blobs = [np.frombuffer(encoded(ZLIB, r), np.uint8) for r in raws]
    blobs[2] = blobs[2][:-9]
    where = [ByteRange("/f.h5", 100 * k, b.size) for k, b in enumerate(blobs)]
    with pytest.raises(ChunkDecodeError, match="offset 200"):
        decode_pieces(blobs, (ZLIB,), [len(r) for r in raws], get_device("cpu"), where=where)


# -- the host's share of a GPU batch: every piece into its slot of one buffer ------------------

def raw_deflate(raw: bytes) -> bytes:
    co = zlib.compressobj(1, zlib.DEFLATED, -15)
    return co.compress(raw) + co.flush()


FRAMINGS = {  # codec -> how its pieces are written
    "zlib": (ZLIB, lambda r: zlib.compress(r, 1)),
    "gzip": (GZIP, lambda r: gzip.compress(r, 1, mtime=0)),
    "tiff-deflate": (Codec.of("imagecodecs_deflate"), lambda r: zlib.compress(r, 6)),
    "raw-deflate": (Codec.of("imagecodecs_deflate", raw=True), raw_deflate),
}


def slots(sizes: list[int], align: int = 256) -> tuple[np.ndarray, list[int]]:
    starts = np.cumsum([0, *(-(-n // align) * align for n in sizes)])
    return np.full(int(starts[-1]) + 1, 0xEE, np.uint8), [int(a) for a in starts[:-1]]


@pytest.mark.parametrize("name", sorted(FRAMINGS))
def test_host_share_decodes_each_piece_into_its_slot_like_zlib(name):
    codec, write = FRAMINGS[name]
    raws = [payload(n, k) for k, n in enumerate([70_000, 2, 0, 131_072, 9_998])]
    pieces = [np.frombuffer(write(r), np.uint8) for r in raws]
    out, starts = slots([len(r) for r in raws])
    job = _beside.HostDecode(pieces, (codec,), [len(r) for r in raws], [None] * len(raws), out, starts)
    job.check()
    for r, at in zip(raws, starts):  # each raw Deflate stream inflated by zlib itself is the reference
        assert out[at:at + len(r)].tobytes() == r
    assert job.busy_seconds() > 0


def test_host_share_names_the_corrupt_piece_after_every_thread_is_done():
    raws = [payload(60_000, k) for k in range(12)]
    blobs = [zlib.compress(r, 1) for r in raws]
    blobs[7] = blobs[7][:100] + bytes(50) + blobs[7][150:]  # garbled inside the stream
    pieces = [np.frombuffer(b, np.uint8) for b in blobs]
    where = [ByteRange("/data/scan.h5", 4096 * (k + 1), len(b)) for k, b in enumerate(blobs)]
    out, starts = slots([len(r) for r in raws])
    job = _beside.HostDecode(pieces, (ZLIB,), [len(r) for r in raws], where, out, starts)
    with pytest.raises(ChunkDecodeError, match=r"zlib chunk of '/data/scan\.h5' at offset 32768 ") as e:
        job.check()
    assert e.value.path == "/data/scan.h5" and e.value.offset == 32768
    assert all(f.done() for f in job.futures)  # nothing still writes into the buffer handed back
    for k in (0, 6, 8, 11):  # the good pieces decoded all the same
        assert out[starts[k]:starts[k] + len(raws[k])].tobytes() == raws[k]


def test_host_share_refuses_a_piece_of_another_size():
    raw = payload(10_000, 5)
    out, starts = slots([len(raw) + 2])
    job = _beside.HostDecode([np.frombuffer(zlib.compress(raw), np.uint8)], (ZLIB,), [len(raw) + 2],
                             [ByteRange("/t/tile.tif", 77, 10)], out, starts)
    with pytest.raises(ChunkDecodeError, match=r"'/t/tile\.tif' at offset 77 .*expected 10002"):
        job.check()


class NumpySide:
    """``HostShare``'s device side in host memory (the production side is ``_beside.CupySide``):
    the same carving, gathering and copies, so the rounds run on a machine without a GPU."""

    def __init__(self):
        self.copies: list[tuple[str, int]] = []

    def carve(self, sizes):
        buf, starts = slots(list(sizes))
        return buf, [buf[a:a + n] for a, n in zip(starts, sizes)], starts

    def stream(self):
        return None

    def pinned(self, nbytes):
        return np.full(max(1, nbytes), 0xAB, np.uint8)  # stale bytes: nothing may show through

    def download(self, pieces, into, stream):
        flat = np.concatenate([np.asarray(p, np.uint8) for p in pieces])
        into[:flat.size] = flat
        self.copies.append(("down", flat.size))
        cuts = np.cumsum([0, *(len(p) for p in pieces)])
        return [into[a:b] for a, b in zip(cuts[:-1], cuts[1:])]

    def upload(self, dst, src, stream):
        dst[...] = src
        self.copies.append(("up", src.size))


@pytest.mark.parametrize("limit", [1, 150_000, 400_000, 10**9])
@pytest.mark.parametrize("name", ["zlib", "gzip"])
def test_host_share_rounds_take_turns_in_two_buffer_pairs(monkeypatch, limit, name):
    codec, write = FRAMINGS[name]
    monkeypatch.setattr(_split, "ROUND", limit)
    sizes = np.random.default_rng(2).integers(0, 120_000, 23)
    raws = [payload(int(n), k) for k, n in enumerate(sizes)]
    side = NumpySide()
    share = _beside.HostShare([np.frombuffer(write(r), np.uint8) for r in raws], (codec,), [len(r) for r in raws],
                              [None] * len(raws), side=side)
    views = share.run()
    assert [v.tobytes() for v in views] == raws  # a round that reused another's buffers too early would differ
    n = len(_beside.rounds([len(r) for r in raws], limit))
    assert n == {1: 23, 10**9: 1}.get(limit, n) and (limit in (1, 10**9) or 2 < n < 23)
    assert [k for k, _ in side.copies].count("down") == n == [k for k, _ in side.copies].count("up")
    assert sum(b for k, b in side.copies if k == "up") >= sum(map(len, raws))  # padding travels too
    assert share.busy > 0


def test_host_share_raises_the_first_bad_round_after_all_threads(monkeypatch):
    monkeypatch.setattr(_split, "ROUND", 100_000)
    raws = [payload(60_000, k) for k in range(10)]
    blobs = [zlib.compress(r, 1) for r in raws]
    for bad in (5, 8):
        blobs[bad] = blobs[bad][:30] + bytes(40) + blobs[bad][70:]
    where = [ByteRange("/h5/gz.h5", 10_000 + k, len(b)) for k, b in enumerate(blobs)]
    side = NumpySide()
    share = _beside.HostShare([np.frombuffer(b, np.uint8) for b in blobs], (ZLIB,), [len(r) for r in raws],
                              where, side=side)
    with pytest.raises(ChunkDecodeError, match=r"'/h5/gz\.h5' at offset 10005 "):
        share.run()
    ups = [b for k, b in side.copies if k == "up"]
    assert len(ups) == 5  # one piece a round: the five before the bad one went up, none after it


@pytest.mark.parametrize("sizes, limit, want", [
    ([10, 10, 10, 10], 20, [(0, 2), (2, 4)]),
    ([10, 10, 10], 25, [(0, 2), (2, 3)]),
    ([50, 10, 60, 5], 20, [(0, 1), (1, 2), (2, 3), (3, 4)]),  # a piece bigger than a round goes alone
    ([0, 0, 7], 5, [(0, 2), (2, 3)]),
    ([3], 1, [(0, 1)]),
    ([], 10, []),
])
def test_rounds_are_consecutive_and_bounded(sizes, limit, want):
    got = _beside.rounds(sizes, limit)
    assert got == want
    for a, b in got:  # over the limit only where a single piece is
        assert sum(sizes[a:b]) <= limit or b - a == 1


def test_pinned_blocks_come_in_few_sizes():
    # CuPy's pinned pool reuses a block only for a request of its exact size.
    assert _beside.size_class(1) == 1 << 20 and _beside.size_class(1 << 20) == 1 << 20
    assert _beside.size_class((1 << 20) + 1) == 2 << 20 and _beside.size_class(300 << 20) == 512 << 20
    assert len({_beside.size_class(n) for n in range(1, 64 << 20, 997 << 10)}) == 7


# -- on a GPU: nvCOMP and the host's cores side by side ----------------------------------------

def device_pieces(blobs: list[bytes]):
    """The blobs back to back in one device buffer, off 4-byte alignment, as a read leaves them."""
    import cupy

    buf = cupy.asarray(np.frombuffer(b"\x01" + b"".join(blobs), np.uint8))
    cuts = np.cumsum([1, *map(len, blobs)])
    return buf, [buf[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FRAMINGS))
def test_gpu_mixed_batch_decodes_like_zlib(name):
    codec, write = FRAMINGS[name]
    sizes = np.random.default_rng(0).integers(1000, 400_000, 24)
    raws = [payload(int(n), k) for k, n in enumerate(sizes)]
    _, pieces = device_pieces([write(r) for r in raws])
    gpulazy.stats().reset()
    with _split.force("alternate"), warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        out = decode_pieces(pieces, (codec,), [len(r) for r in raws], get_device("cuda:0"))
    assert [k for k, (o, r) in enumerate(zip(out, raws)) if o.get().tobytes() != r] == []
    places = gpulazy.stats().snapshot()["decode_by_codec"][codec.id]
    assert places["host"]["bytes"] == sum(len(r) for r in raws[0::2])
    assert places["gpu"]["bytes"] == sum(len(r) for r in raws[1::2])


@pytest.mark.gpu
@pytest.mark.parametrize("way", ["auto", "host", "gpu"])
def test_gpu_batch_decodes_like_zlib_every_way(way):
    raws = [payload(262_144, k) for k in range(40)]
    _, pieces = device_pieces([zlib.compress(r, 1) for r in raws])
    dev = get_device("cuda:0")
    _split.RECORD.reset()
    with _split.force(way):
        out = decode_pieces(pieces, (ZLIB,), [len(r) for r in raws], dev)
    assert [o.get().tobytes() for o in out] == raws
    counts = _split.RECORD.snapshot()[dev.name]["counts"]
    assert counts["host_pieces"] + counts["gpu_pieces"] == 40
    if way == "host":
        assert counts["transfers"] == 2 and counts["copied_up"] == sum(map(len, raws))
        assert _split.RECORD.rates(dev.name).host_per_core != _split.Rates().host_per_core  # measured


@pytest.mark.gpu
@pytest.mark.parametrize("way", ["host", "alternate"])
def test_gpu_host_share_in_many_rounds_decodes_like_zlib(way, monkeypatch):
    # Rounds of at most 300 kB: several pinned rounds take turns, copies overlapping decoding.
    monkeypatch.setattr(_split, "ROUND", 300_000)
    sizes = np.random.default_rng(1).integers(0, 250_000, 41)
    raws = [payload(int(n), k) for k, n in enumerate(sizes)]
    _, pieces = device_pieces([gzip.compress(r, 1, mtime=0) for r in raws])
    dev = get_device("cuda:0")
    _split.RECORD.reset()
    with _split.force(way):
        out = decode_pieces(pieces, (GZIP,), [len(r) for r in raws], dev)
    assert [k for k, (o, r) in enumerate(zip(out, raws)) if o.get().tobytes() != r] == []
    on_host = [len(r) for r in (raws if way == "host" else raws[0::2])]
    counts = _split.RECORD.snapshot()[dev.name]["counts"]
    assert counts["transfers"] == 2 * len(_beside.rounds(on_host, 300_000)) > 4


@pytest.mark.gpu
def test_gpu_corrupt_piece_in_a_later_round_is_named(monkeypatch):
    monkeypatch.setattr(_split, "ROUND", 200_000)
    raws = [payload(90_000, k) for k in range(30)]
    blobs = [zlib.compress(r, 1) for r in raws]
    blobs[25] = blobs[25][:40] + bytes(30) + blobs[25][70:]
    _, pieces = device_pieces(blobs)
    where = [ByteRange("/tiles/t.tif", 512 * k, len(b)) for k, b in enumerate(blobs)]
    with _split.force("host"), pytest.raises(ChunkDecodeError, match=r"'/tiles/t\.tif' at offset 12800 "):
        decode_pieces(pieces, (ZLIB,), [len(r) for r in raws], get_device("cuda:0"), where=where)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [0, 23])  # with "alternate": piece 0 on the host, 23 on nvCOMP
@pytest.mark.parametrize("way", ["alternate", "auto"])
def test_gpu_deflate_names_a_corrupt_piece(bad, way):
    raws = [payload(50_000, k) for k in range(24)]
    blobs = [encoded(ZLIB, r) for r in raws]
    blobs[bad] = blobs[bad][:-10]
    _, pieces = device_pieces(blobs)
    where = [ByteRange("/d/x.h5", 1000 * k, len(b)) for k, b in enumerate(blobs)]
    with _split.force(way), pytest.raises(ChunkDecodeError, match=rf"'/d/x\.h5' at offset {1000 * bad}\b"):
        decode_pieces(pieces, (ZLIB,), [len(r) for r in raws], get_device("cuda:0"), where=where)


@pytest.mark.gpu
def test_gpu_decode_off_keeps_deflate_on_the_host():
    raws = [payload(100_000, k) for k in range(6)]
    _, pieces = device_pieces([gzip.compress(r, 1, mtime=0) for r in raws])
    gpulazy.stats().reset()
    with gpulazy.config.set(gpu_decode=False), _split.force("gpu"):  # the setting wins over any split
        out = decode_pieces(pieces, (GZIP,), [len(r) for r in raws], get_device("cuda:0"))
    assert [o.get().tobytes() for o in out] == raws
    assert set(gpulazy.stats().snapshot()["decode_by_place"]) == {"host"}


@pytest.mark.gpu
@pytest.mark.parametrize("way", ["auto", "host", "alternate"])
def test_gpu_zstd_batch_split_with_the_host_decodes_like_numcodecs(way):
    # zstd shares the Deflate split (its own figures, ``_split.PRIORS["zstd"]``): 12 frames of
    # 8 MiB are the batch a napari plane needs; ``auto`` gives them to the host's cores.
    zstd = Codec.of("zstd", level=1)
    raws = [payload(8 << 20, k) for k in range(12)]
    _, pieces = device_pieces([numcodecs.Zstd(level=1).encode(r) for r in raws])
    dev = get_device("cuda:0")
    _split.RECORD.reset()
    gpulazy.stats().reset()
    with _split.force(way):
        out = decode_pieces(pieces, (zstd,), [len(r) for r in raws], dev)
    assert [k for k, (o, r) in enumerate(zip(out, raws)) if o.get().tobytes() != r] == []
    counts = _split.RECORD.snapshot()[f"{dev.name}/zstd"]["counts"]
    assert counts["host_pieces"] + counts["gpu_pieces"] == 12
    assert counts["gpu_pieces"] == {"host": 0, "alternate": 6}.get(way, counts["gpu_pieces"])
    assert "cuda:0" not in _split.RECORD.snapshot()  # Deflate's figures untouched
