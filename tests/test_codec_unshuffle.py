"""The unshuffle kernel (``gpulazy.codecs._unshuffle``) and the tables blosc and bitshuffle build for it.

The CPU tests run ``emulate``: the kernel's index arithmetic, item by item, in NumPy (the
same formulas as the CUDA source, on a byte array standing for device memory), over the
very tables ``blosc.unshuffle_rows`` and ``bitshuffle.unshuffle_rows`` build, and require
the bytes of the host twin (``blosc.unshuffle_block``), of c-blosc (numcodecs) and of
h5py + hdf5plugin; every output byte must be written exactly once. Where a C++ compiler
is found, the kernel's own CUDA source is also compiled for the host (the CUDA built-ins
as globals, the grid run thread after thread: the kernel shares nothing between threads)
and run on host memory. The ``gpu`` tests run the kernel itself against the same references.
"""

from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess

import numcodecs
import numpy as np
import pytest

from gpulazy.codecs import _unshuffle, bitshuffle, blosc
from gpulazy.spec import Codec

lz4_block = pytest.importorskip("lz4.block")

U64 = np.uint64


def t8(x: np.ndarray) -> np.ndarray:
    """``gl_t8``: each uint64 an 8 x 8 bit matrix (byte = row), transposed."""
    for shift, mask in ((7, 0x00AA00AA00AA00AA), (14, 0x0000CCCC0000CCCC), (28, 0x00000000F0F0F0F0)):
        t = (x ^ (x >> U64(shift))) & U64(mask)
        x = x ^ t ^ (t << U64(shift))
    return x


def emulate(mem: np.ndarray, rows: np.ndarray, pointers: np.ndarray) -> np.ndarray:
    """``gl_unshuffle_blocks`` on the host: addresses are indices into ``mem``. Returns how
    many times each byte of ``mem`` was written."""
    src = np.asarray(pointers, np.uint64).astype(np.int64)
    hits = np.zeros(mem.size, np.int64)

    def store(addr: np.ndarray, v: np.ndarray) -> None:
        mem[addr] = v
        np.add.at(hits, addr, 1)

    for d, bsize, ts, mode, first, neblock in np.asarray(rows, np.int64).tolist():
        count = bsize // ts
        body = count * ts
        bits = mode == 2 and count % 8 == 0
        n8 = count // 8
        groups = n8 * ts if bits else 0
        skip = body if bits else 0
        k = np.arange(groups + bsize - skip, dtype=np.int64)

        def at(q: np.ndarray) -> np.ndarray:  # gl_at
            s = q // neblock
            return mem[src[first + s] + q - s * neblock]

        kg = k[:groups]  # gl_bit_group, one item per (j, g)
        j = kg // max(n8, 1)
        g = kg - j * n8
        q = j * count
        s = q // neblock
        a = q - s * neblock
        one = a + count <= neblock  # the 8 planes in one stream
        x = np.zeros(len(kg), U64)
        for b in range(8):
            byte = np.empty(len(kg), np.uint8)
            byte[one] = mem[src[first + s[one]] + a[one] + g[one] + b * n8]
            byte[~one] = at(q[~one] + b * n8 + g[~one])
            x |= byte.astype(U64) << U64(8 * b)
        x = t8(x)
        o = d + 8 * g * ts + j
        for e in range(8):
            store(o + e * ts, ((x >> U64(8 * e)) & U64(255)).astype(np.uint8))
        ob = k[groups:] - groups + skip  # one item per output byte
        i = ob // ts
        q = np.where((mode == 1) & (ob < body), (ob - i * ts) * count + i, ob)
        store(d + ob, at(q))
    return hits


class Arena:
    """A byte array standing for device memory: ``put`` places bytes at a fresh address."""

    def __init__(self, size: int = 1 << 22):
        self.mem = np.full(size, 0xA5, np.uint8)
        self.top = 3  # odd addresses: the kernel may assume no alignment

    def put(self, data: bytes | np.ndarray) -> int:
        b = np.frombuffer(bytes(data), np.uint8)
        at = self.top
        self.mem[at:at + b.size] = b
        self.top += b.size + 5
        return at

    def take(self, n: int) -> int:
        return self.put(bytes(n))

    def bytes(self, at: int, n: int) -> bytes:
        return self.mem[at:at + n].tobytes()


def bit_shuffle(block: np.ndarray, ts: int) -> np.ndarray:
    """The inverse of ``unshuffle_block(., ts, 2)`` (bit ``b`` of byte ``j`` of element ``i``
    to bit ``(8 j + b) * count + i``), trailing bytes as they are."""
    count = block.size // ts
    out = block.copy()
    bits = np.unpackbits(block[:count * ts], bitorder="little").reshape(count, ts, 8)
    out[:count * ts] = np.packbits(bits.transpose(1, 2, 0).reshape(-1), bitorder="little")
    return out


def test_t8_transposes_a_bit_matrix():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**63, 200, dtype=np.int64).astype(U64) * U64(2) + U64(1)
    m = np.unpackbits(x.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little").reshape(-1, 8, 8)
    got = np.unpackbits(t8(x).view(np.uint8).reshape(-1, 8), axis=1, bitorder="little").reshape(-1, 8, 8)
    assert np.array_equal(got, m.transpose(0, 2, 1))


def blocks_cases():
    """(type size, block bytes, streams, mode): multiples of 8 elements and not, trailing bytes,
    one stream, one per byte position, and a split whose planes cross streams (the slow path)."""
    for ts in (1, 2, 3, 4, 8, 16):
        for count in (0, 7, 8, 24, 1000, 1003, 2048):
            for trailing in sorted({0, ts - 1}):
                for mode in (0, 1, 2):
                    yield ts, count * ts + trailing, 1, mode
                    if count and not trailing and ts > 1:
                        yield ts, count * ts, ts, mode
    yield 2, 96, 3, 2  # 48 elements in 3 streams of 32 bytes: byte row 0's planes span two
    yield 4, 4 * 64, 8, 2


def twin_batch(arena: Arena) -> tuple[list[list[int]], list[int], list[bytes]]:
    """Every ``blocks_cases`` block, random bytes, placed in ``arena``: (rows, pointers, wanted bytes)."""
    rng = np.random.default_rng(1)
    rows, pointers, want = [], [], []
    for ts, bsize, streams, mode in blocks_cases():
        shuffled = rng.integers(0, 256, bsize, dtype=np.uint8)
        rows.append([arena.take(bsize), bsize, ts, mode, len(pointers), bsize // streams])
        pointers += [arena.put(part) for part in np.split(shuffled, streams)]
        want.append(blosc.unshuffle_block(shuffled, ts, mode).tobytes())
    return rows, pointers, want


def test_emulated_kernel_matches_the_host_twin_in_one_batch():
    arena = Arena()
    rows, pointers, want = twin_batch(arena)
    hits = emulate(arena.mem, np.array(rows), np.array(pointers, np.uint64))
    for (d, bsize, ts, mode, _, neblock), w in zip(rows, want):
        assert arena.bytes(d, bsize) == w, (ts, bsize, bsize // neblock, mode)
        assert (hits[d:d + bsize] == 1).all(), (ts, bsize, mode)
    assert hits.sum() == sum(r[1] for r in rows)  # nothing written outside the blocks


HARNESS = r"""
struct gl_dim { unsigned int x, y, z; };
static gl_dim blockIdx, blockDim, threadIdx, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
%s
extern "C" void gl_run(unsigned int gx, unsigned int gy, unsigned int threads, const unsigned long long* src,
                       const long long* rows, long long nblk) {
    gridDim = {gx, gy, 1};
    blockDim = {threads, 1, 1};
    for (unsigned int y = 0; y < gy; ++y)
        for (unsigned int x = 0; x < gx; ++x)
            for (unsigned int t = 0; t < threads; ++t) {
                blockIdx = {x, y, 0};
                threadIdx = {t, 0, 0};
                gl_unshuffle_blocks(src, rows, nblk);
            }
}
"""


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):
    """``_ASSEMBLE`` compiled for the host: ``run(arena, rows, pointers, grid)``, addresses as offsets."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the kernel source for the host")
    d = tmp_path_factory.mktemp("kernel")
    (d / "k.cpp").write_text(HARNESS % _unshuffle._KERNEL)
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-o", str(d / "k.so"), str(d / "k.cpp")], check=True)
    lib = ctypes.CDLL(str(d / "k.so"))

    def run(arena: Arena, rows: np.ndarray, pointers: np.ndarray, grid: tuple[int, int]) -> None:
        base = arena.mem.ctypes.data
        table = np.array(rows, np.int64)
        table[:, 0] += base
        src = np.asarray(pointers, np.uint64) + np.uint64(base)
        lib.gl_run(ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(_unshuffle.THREADS),
                   src.ctypes.data_as(ctypes.c_void_p), table.ctypes.data_as(ctypes.c_void_p),
                   ctypes.c_longlong(len(table)))

    return run


@pytest.mark.parametrize("rows_per_grid", [None, 2], ids=["launch-grid", "2-grid-rows"])
def test_kernel_source_run_on_the_host_matches_the_twin(host_kernel, rows_per_grid):
    arena = Arena()
    rows, pointers, want = twin_batch(arena)
    gx, gy = _unshuffle.grid(np.array(rows))
    host_kernel(arena, np.array(rows), np.array(pointers, np.uint64), (gx, rows_per_grid or gy))
    for (d, bsize, ts, mode, _, neblock), w in zip(rows, want):
        assert arena.bytes(d, bsize) == w, (ts, bsize, bsize // neblock, mode)


# -- HDF5 bitshuffle: the table ``bitshuffle.unshuffle_rows`` builds ----------------------------

def hdf5_chunks(tmp_path, es: int, n: int, nelems: int) -> tuple[list[bytes], bytes]:
    """Chunks of ``n`` elements written by hdf5plugin's own filter, and their bytes per h5py."""
    h5py = pytest.importorskip("h5py")
    hdf5plugin = pytest.importorskip("hdf5plugin")
    dtype = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}[es]
    rng = np.random.default_rng(n + es)
    data = np.abs(np.linspace(0, 200, 2 * n) + rng.normal(0, 3, 2 * n)).astype(dtype)
    path = tmp_path / f"b{es}_{n}_{nelems}.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("d", data=data, chunks=(n,), **hdf5plugin.Bitshuffle(nelems=nelems, cname="lz4"))
        blobs = [ds.id.read_direct_chunk((k * n,))[1] for k in range(2)]
    with h5py.File(path, "r") as f:
        assert f["d"][:].tobytes() == data.tobytes()
    return blobs, data.tobytes()


@pytest.mark.parametrize("es", [1, 2, 4, 8])
@pytest.mark.parametrize("n, nelems", [(5, 0), (8, 0), (1003, 0), (4099, 256), (2053, 8), (999, 64)])
def test_emulated_kernel_decodes_hdf5plugin_chunks(tmp_path, es, n, nelems):
    blobs, want = hdf5_chunks(tmp_path, es, n, nelems)
    arena = Arena()
    plans = {i: bitshuffle.parse_header(b[:12], len(b), n * es, es) for i, b in enumerate(blobs)}
    blocks = bitshuffle.block_table(plans)
    where = {i: arena.put(b) for i, b in enumerate(blobs)}
    spans = [(i, off, c) for i, b in enumerate(blobs) for off, c in bitshuffle.walk_blocks(b, plans[i])]
    assert len(spans) == len(blocks)
    pointers = []  # nvCOMP's part: block k decoded somewhere, its address at slot k
    for (i, off, c), size in zip(spans, blocks[:, 1].tolist()):
        decoded = lz4_block.decompress(blobs[i][off:off + c], uncompressed_size=size)
        assert len(decoded) == size
        pointers.append(arena.put(decoded))
    dest = {i: arena.take(n * es) for i in plans}
    tails = {i: where[i] + len(blobs[i]) - plans[i].leftover for i in plans}
    rows, stored = bitshuffle.unshuffle_rows(plans, blocks, dest, tails)
    hits = emulate(arena.mem, rows, np.concatenate([np.array(pointers, np.uint64), stored]))
    got = b"".join(arena.bytes(dest[i], n * es) for i in plans)
    assert got == want
    assert all((hits[dest[i]:dest[i] + n * es] == 1).all() for i in plans)


def test_bitshuffle_block_table_matches_the_header():
    for count, block in ((5, 8), (8, 8), (1003, 128), (4096, 1024), (4100, 1024), (4104, 1024)):
        h = bitshuffle.Header(count * 2, 2, block)
        t = bitshuffle.block_table({3: h})
        assert t[:, 1].tolist() == [n * 2 for n in h.sizes] and (t[:, 0] == 3).all()
        assert t[:, 2].tolist() == [2 * sum(h.sizes[:k]) for k in range(h.nblocks)]


# -- blosc: the table ``blosc.unshuffle_rows`` builds -------------------------------------------

def blosc_split_bitshuffle(raw: bytes, ts: int, blocksize: int) -> bytes:
    """A blosc1 buffer with bit-shuffled blocks split into ``ts`` LZ4 streams (byte position
    ``j``'s 8 planes in stream ``j``), as older c-blosc wrote them; built here, read by c-blosc."""
    nblocks = -(-len(raw) // blocksize)
    body, starts = bytearray(), []
    for b in range(nblocks):
        block = np.frombuffer(raw[b * blocksize:(b + 1) * blocksize], np.uint8)
        last = b == nblocks - 1 and len(raw) % blocksize
        count = block.size // ts
        shuffled = bit_shuffle(block, ts) if count % 8 == 0 else block
        starts.append(16 + 4 * nblocks + len(body))
        split = not last and count >= 128
        for part in (np.split(shuffled, ts) if split else [shuffled]):
            c = lz4_block.compress(part.tobytes(), store_size=False)
            body += struct.pack("<i", len(c)) + c
    head = struct.pack("<BBBBIII", 2, 1, 0x24, ts, len(raw), blocksize, 16 + 4 * nblocks + len(body))
    return head + struct.pack(f"<{nblocks}i", *starts) + bytes(body)


def blosc_blobs() -> list[tuple[bytes, bytes]]:
    rng = np.random.default_rng(2)
    out = []
    for ts in (1, 2, 4, 8):
        for shuffle in (1, 2):
            for n, blocksize in ((40_000, 0), (5_000 * ts + 3 * ts, 1024), (3_000, 256)):
                count = -(-n // ts)
                vals = np.linspace(0, 3000, count).astype(np.int64) + rng.integers(0, 9, count)
                raw = (vals % (1 << min(8 * ts, 62))).astype(f"<u{ts}").tobytes()[:n - n % ts]
                out.append((bytes(numcodecs.blosc.compress(raw, b"lz4", 5, shuffle, blocksize, ts)), raw))
        raw = (np.arange(12_000 // ts) % 300).astype(f"<u{ts}").tobytes()
        out.append((blosc_split_bitshuffle(raw, ts, 256 * ts), raw))
    return out


def test_blosc_blobs_are_what_c_blosc_reads():  # the split ones written here included
    for blob, raw in blosc_blobs():
        assert bytes(numcodecs.Blosc().decode(blob)) == raw


def test_emulated_kernel_decodes_c_blosc_in_one_batch():
    arena = Arena(1 << 23)
    cases = blosc_blobs()
    plans = {i: blosc.parse_header(b[:16], len(b), len(r)) for i, (b, r) in enumerate(cases)}
    plans = {i: h for i, h in plans.items() if not h.memcpyed}
    assert any(blosc.block_table({i: h})[:, 3].max() > 1 for i, h in plans.items())  # a split case is here
    blocks = blosc.block_table(plans)
    pointers = []
    for i, h in plans.items():  # the walk and nvCOMP's part; stored streams read in place
        blob = cases[i][0]
        at = arena.put(blob)
        sizes = [bsize // n for bsize, n in map(h.block, range(h.nblocks)) for _ in range(n)]
        for (off, c), n in zip(blosc.walk_streams(blob, h), sizes):
            pointers.append(at + off if c == n else arena.put(lz4_block.decompress(blob[off:off + c], n)))
    assert len(pointers) == int(blocks[:, 3].sum())
    dest = {i: arena.take(h.nbytes) for i, h in plans.items()}
    hits = emulate(arena.mem, blosc.unshuffle_rows(plans, blocks, dest), np.array(pointers, np.uint64))
    for i, h in plans.items():
        assert arena.bytes(dest[i], h.nbytes) == cases[i][1], (i, h)
        assert (hits[dest[i]:dest[i] + h.nbytes] == 1).all()


def test_blosc_block_table_matches_header_block():
    for blob, raw in blosc_blobs():
        h = blosc.parse_header(blob[:16], len(blob), len(raw))
        if h.memcpyed:
            continue
        t = blosc.block_table({0: h})
        assert [tuple(r) for r in t[:, 2:4].tolist()] == [h.block(b) for b in range(h.nblocks)]
        assert t[:, 4].tolist() == np.concatenate([[0], np.cumsum(t[:, 3])[:-1]]).tolist()


# -- the kernel on the GPU ---------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_kernel_matches_the_host_twin_in_one_launch():
    import cupy

    rng = np.random.default_rng(1)
    cases = list(blocks_cases())
    rows, pointers, keep, want = [], [], [], []
    outs = [cupy.full(bsize, 0x5A, np.uint8) for _, bsize, _, _ in cases]
    for (ts, bsize, streams, mode), out in zip(cases, outs):
        shuffled = rng.integers(0, 256, bsize, dtype=np.uint8)
        rows.append([out.data.ptr, bsize, ts, mode, len(pointers), bsize // streams])
        parts = [cupy.asarray(p) for p in np.split(shuffled, streams)]
        keep += parts
        pointers += [p.data.ptr for p in parts]
        want.append(blosc.unshuffle_block(shuffled, ts, mode).tobytes())
    _unshuffle.unshuffle_blocks(np.array(rows), np.array(pointers, np.uint64))
    for case, out, w in zip(cases, outs, want):
        got = out.get().tobytes()
        assert got == w, f"{case}: first wrong byte {next(k for k in range(len(w)) if got[k] != w[k])}"


@pytest.mark.gpu
@pytest.mark.parametrize("es", [1, 2, 4, 8])
@pytest.mark.parametrize("n, nelems", [(5, 0), (1003, 0), (4099, 256), (2053, 8)])
def test_gpu_decodes_hdf5plugin_chunks_per_element_size(tmp_path, es, n, nelems):
    import cupy

    from gpulazy.codecs import decode_pieces
    from gpulazy.device import get_device

    blobs, want = hdf5_chunks(tmp_path, es, n, nelems)
    buf = cupy.asarray(np.frombuffer(b"\x01" + b"".join(blobs), np.uint8))
    cuts = np.cumsum([1, *map(len, blobs)]).tolist()
    pieces = [buf[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    codec = Codec.of("bitshuffle_lz4", elementsize=es)
    res = bitshuffle.decode(pieces, codec, [n * es] * 2)
    assert res.host == [], res.why
    assert b"".join(o.get().tobytes() for o in res.out) == want
    out = decode_pieces(pieces, (codec,), [n * es] * 2, get_device("cuda:0"))
    assert b"".join(o.get().tobytes() for o in out) == want


@pytest.mark.gpu
def test_gpu_decodes_more_blocks_than_one_grid_row(tmp_path):
    # 70,000 LZ4 blocks of 8 elements in one chunk: more rows than CUDA's 65,535 grid rows,
    # so the kernel's stride over rows is exercised, in one launch.
    n = 8 * 70_000 + 3
    import cupy

    blobs, want = hdf5_chunks(tmp_path, 1, n, 8)
    pieces = [cupy.asarray(np.frombuffer(b, np.uint8)) for b in blobs]
    res = bitshuffle.decode(pieces, Codec.of("bitshuffle_lz4", elementsize=1), [n] * 2)
    assert res.host == [], res.why
    assert b"".join(o.get().tobytes() for o in res.out) == want


@pytest.mark.gpu
def test_gpu_decodes_c_blosc_and_split_bitshuffle_in_one_batch():
    import cupy

    from gpulazy.codecs import decode_pieces
    from gpulazy.device import get_device

    cases = blosc_blobs()
    buf = cupy.asarray(np.frombuffer(b"\x07" + b"".join(b for b, _ in cases), np.uint8))
    cuts = np.cumsum([1, *(len(b) for b, _ in cases)]).tolist()
    pieces = [buf[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    sizes = [len(r) for _, r in cases]
    res = blosc.decode(pieces, Codec.of("blosc", cname="lz4"), sizes)
    assert res.host == [], res.why
    out = decode_pieces(pieces, (Codec.of("blosc", cname="lz4"),), sizes, get_device("cuda:0"))
    for k, (o, (_, raw)) in enumerate(zip(out, cases)):
        assert o.get().tobytes() == raw, k
