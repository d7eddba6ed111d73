"""The four passes of ``bench_prefetch`` (matmul compute, 64 chunks x 16 MiB), each phase a named function
run ``N`` times, for a sampling profiler to tell them apart in the scheduler's thread:

    py-spy record --idle --threads -r 1000 -f raw -o pf.txt -- python benchmarks/prefetch_profile.py sync 25

Arguments: the scheduler (``sync`` or ``threads``) and ``N``. Prints each phase's median and fastest
pass. Needs a GPU (CuPy).
"""
import os, sys, time, tempfile, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np, cupy as cp, dask.array as da
import gpulazy
from gpulazy.cache import DeviceCache
import bench_prefetch as bp

gpulazy.config.set(streamed_maps=False)  # dask's task a chunk, as read-ahead works on it

chunks, rows, cols = 64, 4096, 1024
sched = sys.argv[1] if len(sys.argv) > 1 else "sync"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 25
d = tempfile.mkdtemp(dir="/tmp")
path = os.path.join(d, "pf.raw")
rng = np.random.default_rng(0)
with open(path, "wb") as f:
    for _ in range(chunks):
        rng.random((rows, cols), dtype=np.float32).tofile(f)
cache = DeviceCache(2 * 10 * rows * cols * 4, device="cuda:0", name="prefetch-profile")  # as bench_prefetch: 2 (depth + 2) chunks
vol = gpulazy.from_files(path, shape=(chunks * rows, cols), dtype="float32", chunks=(rows, cols), device="cuda:0", cache=cache)
block = vol[:rows].compute(scheduler="sync")
mem = da.from_array(cp.concatenate([block] * chunks), chunks=(rows, cols), asarray=False)

def t(fn):
    cache.clear(); t0 = time.perf_counter(); fn(); return time.perf_counter() - t0

read = lambda: vol.map_blocks(bp._corner, dtype=vol.dtype).compute(scheduler=sched)
for _ in range(3): t(read)
tr = statistics.median(t(read) for _ in range(5))
t1 = bp._time_one_iteration(cp, block, "matmul")
iters = max(1, round(tr / chunks / t1))
busy = bp.make_compute(cp, iters, "matmul", 0.0)
comp = lambda: mem.map_blocks(busy, dtype=vol.dtype).compute(scheduler=sched)
tc = statistics.median(t(comp) for _ in range(5))
iters = max(1, round(iters * tr / tc)); busy = bp.make_compute(cp, iters, "matmul", 0.0)
comp = lambda: mem.map_blocks(busy, dtype=vol.dtype).compute(scheduler=sched)
naive = lambda: vol.map_blocks(busy, dtype=vol.dtype).compute(scheduler=sched)
p = gpulazy.prefetch(depth=8)
def pf():
    with p:
        vol.map_blocks(busy, dtype=vol.dtype).compute(scheduler=sched)

def phase_read(): return [t(read) for _ in range(N)]
def phase_compute(): return [t(comp) for _ in range(N)]
def phase_naive(): return [t(naive) for _ in range(N)]
def phase_prefetch(): return [t(pf) for _ in range(N)]
print(f"iters {iters}", flush=True)
for fn in (phase_read, phase_compute, phase_naive, phase_prefetch):
    ts = fn()
    print(f"{fn.__name__:16s} median {statistics.median(ts)*1e3:7.2f} ms  min {min(ts)*1e3:7.2f}", flush=True)
