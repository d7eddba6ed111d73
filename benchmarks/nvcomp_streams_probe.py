"""Does nvCOMP's Python API decode overlap KvikIO reads? Read alone, decode alone, both at once (GPU only).

    python benchmarks/nvcomp_streams_probe.py

4 GiB read by KvikIO from a warm file on one thread while another decodes 512 zstd-1 pieces of
8 MiB with ``nvidia.nvcomp.Codec.decode``, 128 per call: ``default`` (the Codec's own stream),
``ownstream`` (a non-blocking CuPy stream passed as ``cuda_stream``), ``cupyalloc`` (nvCOMP's
scratch from CuPy's pool). ``overlap`` is (read + decode) / both; 1.00 means one after the other.
Also prints how long each ``decode`` call holds its thread. Figures in ``benchmarks/RESULTS.md``.
"""
import os, sys, time, threading
import numpy as np, cupy as cp
import kvikio, kvikio.defaults
from nvidia import nvcomp
import numcodecs
kvikio.defaults.set({"num_threads": 16})
N, PIECE = 512, 8 << 20
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _zstd_frames import zstd_frames
comp = zstd_frames(N, PIECE)
z = numcodecs.Zstd(level=1)
sizes = np.array([len(c) for c in comp]); offs = np.concatenate([[0], np.cumsum(sizes)])
print("ratio", N * PIECE / offs[-1])
host = np.empty(int(offs[-1]), np.uint8)
for i, c in enumerate(comp): host[offs[i]:offs[i + 1]] = np.frombuffer(c, np.uint8)
dsrc = cp.asarray(host); out = cp.empty(N * PIECE, np.uint8)
path = "/tmp/raw4g.bin"; NB = 4 << 30
if not os.path.exists(path):
    blk = np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8)
    with open(path, "wb") as f:
        for _ in range(NB // blk.size): f.write(blk)
rbuf = cp.empty(NB, np.uint8)
fh = kvikio.CuFile(path, "r")
def read_all():
    futs = [fh.pread(rbuf[o:o + (256 << 20)], 256 << 20, o) for o in range(0, NB, 256 << 20)]
    for f in futs: f.get()
read_all(); cp.cuda.Device().synchronize()
S = cp.cuda.Stream(non_blocking=True)
def mk_codec(mode):
    if mode == "ownstream":
        return nvcomp.Codec(algorithm="Zstd", device_id=0, bitstream_kind=nvcomp.BitstreamKind.RAW, cuda_stream=S.ptr)
    return nvcomp.Codec(algorithm="Zstd", device_id=0, bitstream_kind=nvcomp.BitstreamKind.RAW)
def decode_all(codec, stream, per=128, tt=None):
    for g in range(0, N, per):
        t0 = time.perf_counter()
        src = nvcomp.as_arrays(dsrc, [int(x) for x in offs[g:g + per]], [int(x) for x in sizes[g:g + per]], stream.ptr)
        dst = nvcomp.as_arrays(out, [PIECE * k for k in range(g, g + per)], [PIECE] * per, stream.ptr)
        t1 = time.perf_counter()
        res = codec.decode(src, out=dst)
        t2 = time.perf_counter()
        stream.synchronize()
        t3 = time.perf_counter()
        if tt is not None: tt.append((t1 - t0, t2 - t1, t3 - t2))
def timeit(f, n=3):
    best = 1e9
    for _ in range(n):
        cp.cuda.Device().synchronize(); t = time.perf_counter(); f(); cp.cuda.Device().synchronize(); best = min(best, time.perf_counter() - t)
    return best
for mode in ["default", "ownstream", "cupyalloc"]:
    if mode == "cupyalloc":
        nvcomp.set_device_allocator(lambda nbytes, stream: cp.cuda.alloc(nbytes))
    codec = mk_codec(mode)
    stream = S if mode == "ownstream" else cp.cuda.get_current_stream()
    if mode == "default":
        stream = S  # our stream for as_arrays; codec on its own
    decode_all(codec, stream)
    tt = []; decode_all(codec, stream, tt=tt)
    print(mode, "per call (as_arrays, decode, sync) ms:", [tuple(round(x * 1e3, 1) for x in r) for r in tt])
    tr = timeit(read_all); td = timeit(lambda: decode_all(codec, stream))
    def both():
        th = threading.Thread(target=read_all); th.start(); decode_all(codec, stream); th.join()
    tb = timeit(both)
    print(f"{mode}: read {NB/tr/1e9:.1f} GB/s {tr*1e3:.0f} ms; decode {N*PIECE/td/1e9:.1f} GB/s {td*1e3:.0f} ms; both {tb*1e3:.0f} ms; overlap (r+d)/both {(tr+td)/tb:.2f} (max {(tr+td)/max(tr,td):.2f})")
    for per in (64, 256, 512):
        td2 = timeit(lambda: decode_all(codec, stream, per=per))
        print(f"   decode per={per}: {N*PIECE/td2/1e9:.1f} GB/s")

sys.stdout.flush()
os._exit(0)  # skips teardown: this script crashed in the interpreter's exit once on an H100 (Codecs bound to CuPy streams)
