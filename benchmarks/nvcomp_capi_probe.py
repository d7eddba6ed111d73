"""nvCOMP's batched C API on several streams, and a read -> decode pipeline over it (GPU only).

    python benchmarks/nvcomp_capi_probe.py

Makes 512 zstd-1 pieces of 8 MiB (uint16 smooth field + 3 bits of noise), decodes them from device
memory with ``nvcompBatchedZstdDecompressAsync`` in groups of ``per`` pieces round-robin over
``streams`` streams (``C API per=... streams=...``), then reads the stored pieces from a file with
KvikIO and queues each group's decode as its reads land (``pipeline read->decode``). The evidence
behind ``gpulazy/codecs/_nvcomp_c.py``; figures in ``benchmarks/RESULTS.md`` (fourth session).
"""
import os, sys, time, threading, ctypes, glob
import numpy as np, cupy as cp
import kvikio, kvikio.defaults
from nvidia import nvcomp
import numcodecs
kvikio.defaults.set({"num_threads": 16})
lib = None
for p in sys.path:
    for c in glob.glob(os.path.join(p, "nvidia/libnvcomp/lib64/libnvcomp.so*")):
        lib = ctypes.CDLL(c); print("lib", c); break
    if lib: break
class Opts(ctypes.Structure):
    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]
OPTS = Opts()
sz = ctypes.c_size_t; vp = ctypes.c_void_p
lib.nvcompBatchedZstdDecompressGetTempSize.argtypes = [sz, sz, Opts, ctypes.POINTER(sz), sz, vp]
lib.nvcompBatchedZstdDecompressAsync.argtypes = [vp, vp, vp, vp, sz, vp, sz, vp, Opts, vp, vp]
N, PIECE = 512, 8 << 20
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _zstd_frames import zstd_frames
comp = zstd_frames(N, PIECE)
z = numcodecs.Zstd(level=1)
sizes = np.array([len(c) for c in comp], np.uint64)
# 4 KiB-aligned offsets so each piece reads as kvikio likes
offs = np.concatenate([[0], np.cumsum((sizes + 4095) // 4096 * 4096)]).astype(np.uint64)
host = np.zeros(int(offs[-1]), np.uint8)
for i, c in enumerate(comp): host[int(offs[i]):int(offs[i]) + len(c)] = np.frombuffer(c, np.uint8)
zpath = "/tmp/z.bin"; host.tofile(zpath); open(zpath, "rb").read()
dsrc = cp.asarray(host); out = cp.empty(N * PIECE, np.uint8)
src_ptrs = cp.asarray(dsrc.data.ptr + offs[:-1]); src_sizes = cp.asarray(sizes)
dst_ptrs = cp.asarray(np.uint64(out.data.ptr) + np.arange(N, dtype=np.uint64) * np.uint64(PIECE))
dst_sizes = cp.full(N, PIECE, np.uint64); actual = cp.zeros(N, np.uint64); status = cp.zeros(N, np.int32)
temps = {}
def temp_for(n, stream):
    t = sz(0)
    r = lib.nvcompBatchedZstdDecompressGetTempSize(n, PIECE, OPTS, ctypes.byref(t), n * PIECE, stream.ptr)
    assert r == 0, r
    key = (n, stream.ptr)
    if key not in temps:
        temps[key] = cp.empty(max(1, t.value), np.uint8); print(f"  temp for {n} pieces: {t.value/2**20:.0f} MiB")
    return temps[key]
def dec(g, n, stream):
    tmp = temp_for(n, stream)
    r = lib.nvcompBatchedZstdDecompressAsync(src_ptrs.data.ptr + 8 * g, src_sizes.data.ptr + 8 * g, dst_sizes.data.ptr + 8 * g,
        actual.data.ptr + 8 * g, n, tmp.data.ptr, tmp.nbytes, dst_ptrs.data.ptr + 8 * g, OPTS, status.data.ptr + 4 * g, stream.ptr)
    assert r == 0, r
streams = [cp.cuda.Stream(non_blocking=True) for _ in range(16)]
def run(per, ns):
    for k, g in enumerate(range(0, N, per)):
        dec(g, min(per, N - g), streams[k % ns])
def timeit(f, n=3):
    best = 1e9
    for _ in range(n):
        cp.cuda.Device().synchronize(); t = time.perf_counter(); f(); cp.cuda.Device().synchronize(); best = min(best, time.perf_counter() - t)
    return best
run(512, 1); cp.cuda.Device().synchronize()
assert int(status.max()) == 0 and int((actual == PIECE).sum()) == N, (status.max(), actual[:4])
ref = np.frombuffer(z.decode(comp[3]), np.uint8); assert (cp.asnumpy(out[3 * PIECE:4 * PIECE]) == ref).all()
print("C API correct")
for per, ns in [(512, 1), (128, 1), (128, 4), (256, 2), (64, 8)]:
    t = timeit(lambda: run(per, ns))
    print(f"C API per={per} streams={ns}: {N*PIECE/t/1e9:.1f} GB/s")
temps.clear(); cp.get_default_memory_pool().free_all_blocks()
# raw read rate of z.bin into a staging buffer
stage = cp.empty(int(offs[-1]), np.uint8)
fh = kvikio.CuFile(zpath, "r")
def read_only():
    futs = [fh.pread(stage[int(offs[i]):int(offs[i]) + int(sizes[i])], int(sizes[i]), int(offs[i])) for i in range(N)]
    for f in futs: f.get()
tr = timeit(read_only)
print(f"read stored bytes alone: {int(sizes.sum())/tr/1e9:.1f} GB/s stored, {tr*1e3:.0f} ms")
ssrc = cp.asarray(stage.data.ptr + offs[:-1])
def pipeline(per, ns):
    futs = [fh.pread(stage[int(offs[i]):int(offs[i]) + int(sizes[i])], int(sizes[i]), int(offs[i])) for i in range(N)]
    for k, g in enumerate(range(0, N, per)):
        for f in futs[g:g + per]: f.get()
        n = min(per, N - g); s = streams[k % ns]; tmp = temp_for(n, s)
        r = lib.nvcompBatchedZstdDecompressAsync(ssrc.data.ptr + 8 * g, src_sizes.data.ptr + 8 * g, dst_sizes.data.ptr + 8 * g,
            actual.data.ptr + 8 * g, n, tmp.data.ptr, tmp.nbytes, dst_ptrs.data.ptr + 8 * g, OPTS, status.data.ptr + 4 * g, s.ptr)
        assert r == 0
for per, ns in [(128, 4), (64, 8), (32, 8), (64, 4), (128, 2), (32, 16)]:
    t = timeit(lambda: pipeline(per, ns))
    print(f"pipeline read->decode per={per} streams={ns}: {N*PIECE/t/1e9:.1f} GB/s decoded, {t*1e3:.0f} ms")
assert int(status.max()) == 0
