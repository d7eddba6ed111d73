"""Decode throughput: gpulazy's batched GPU decode against numcodecs on the host.

    python benchmarks/bench_codecs.py [--chunks 256] [--repeat 5] [--only NAME,...] [--json PATH]
    python benchmarks/bench_codecs.py --probe [--json PATH]
    python benchmarks/bench_codecs.py --host-deflate [--chunks 32]   # no GPU needed

Makes ``--chunks`` chunks of 1024 × 1024 uint16 (2 MiB each) of realistic data (a smooth
volume plus noise), encodes them with zstd-1, lz4, zlib-1, zstd-1 + shuffle and blosc-lz4
with byte or bit shuffle (Zarr v2's default), and HDF5's bitshuffle + LZ4 filter (32008, as
hdf5plugin writes it for Dectris detectors: 8 KiB LZ4 blocks, so 256 per chunk), and times
decoding all of them

- on cuda:0 through ``gpulazy.codecs.decode_pieces`` (compressed pieces already in device
  memory, back to back in one buffer as a read leaves them; nvCOMP + CuPy kernels);
- with nvCOMP called directly on the bare streams (what gpulazy adds is the framing
  checks, the size checks and the output layout);
- with numcodecs on the host, on one thread and on a pool of ``os.cpu_count()`` threads.

For zlib-1 (Deflate), the row also times, in the same run, gpulazy's three ways on cuda:0:
the host's cores alone (libdeflate, the pieces copied down and up), nvCOMP alone, and the
split between them that ``gpulazy.codecs._split`` plans from the rates the first two
measured (what a GPU read does by default), with nvCOMP alone on 16, 64 and 256 pieces
(how its rate grows with the number of streams, the split's model).

Prints GB/s of decoded output (best of ``--repeat``), the ratios and each codec's
compression ratio. ``--probe`` prints instead what nvCOMP reports for a corrupt or
truncated piece and for an over- or undersized output (the facts ``gpulazy.codecs.nvcomp``
relies on), each case in a process of its own.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time

import numpy as np

SIDE = 1024


def make_chunks(n: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` planes of a smooth volume (sums of low-frequency waves) plus Gaussian noise, uint16."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32) / SIDE
    base = 8000 + 3000 * np.sin(6.0 * x) * np.cos(4.0 * y) + 2000 * np.sin(11.0 * (x + y))

    def plane(i: int) -> np.ndarray:
        r = np.random.default_rng(seed + i)
        z = 1500 * np.sin(i / 17.0)
        return np.clip(base + z + r.normal(0, 10, base.shape), 0, 65535).astype(np.uint16)

    del rng
    with concurrent.futures.ThreadPoolExecutor() as pool:
        return list(pool.map(plane, range(n)))


def codecs() -> dict[str, tuple]:
    from gpulazy.spec import Codec

    zstd = Codec.of("zstd", level=1)
    return {
        "zstd-1": (zstd,),
        "lz4": (Codec.of("lz4", acceleration=1),),
        "zlib-1": (Codec.of("zlib", level=1),),
        "zstd-1+shuffle": (zstd, Codec.of("shuffle", elementsize=2)),
        # Zarr v2's default compressor: blosc's framing read by gpulazy, its LZ4 streams by nvCOMP
        "blosc-lz4+shuffle": (Codec.of("blosc", cname="lz4", clevel=5, shuffle=1, blocksize=0),),
        "blosc-lz4+bitshuffle": (Codec.of("blosc", cname="lz4", clevel=5, shuffle=2, blocksize=0),),
        # HDF5 filter 32008: the framing read by gpulazy, its LZ4 blocks by nvCOMP, one unshuffle kernel
        "hdf5-bitshuffle-lz4": (Codec.of("bitshuffle_lz4", elementsize=2),),
    }


def encode_hdf5_bitshuffle(chunks: list[np.ndarray]) -> list[bytes]:
    """Each chunk through hdf5plugin's own bitshuffle + LZ4 filter (an in-memory file), read back raw."""
    import h5py
    import hdf5plugin

    with h5py.File("bench_codecs.h5", "w", driver="core", backing_store=False) as f:
        ds = f.create_dataset("d", shape=(len(chunks), *chunks[0].shape), dtype=chunks[0].dtype,
                              chunks=(1, *chunks[0].shape), **hdf5plugin.Bitshuffle(cname="lz4"))
        for i, c in enumerate(chunks):
            ds[i] = c
        return [ds.id.read_direct_chunk((i, 0, 0))[1] for i in range(len(chunks))]


def encode_all(chunks: list[np.ndarray], codec: tuple, pool) -> list[bytes]:
    import numcodecs

    if codec[0].id == "bitshuffle_lz4":
        return encode_hdf5_bitshuffle(chunks)
    steps = [numcodecs.get_codec(c.config()) for c in reversed(codec)]

    def enc(a: np.ndarray) -> bytes:
        buf = a.tobytes()
        for s in steps:
            buf = bytes(s.encode(np.frombuffer(buf, "u1")))
        return buf

    return list(pool.map(enc, chunks))


def host_decode(blobs: list[bytes], codec: tuple, nbytes: int, pool=None) -> list[np.ndarray]:
    from gpulazy.codecs import host

    def dec(b: bytes) -> np.ndarray:
        return host.decode(np.frombuffer(b, "u1"), codec, nbytes)

    return list(pool.map(dec, blobs)) if pool is not None else [dec(b) for b in blobs]


def best(fn, repeat: int, sync=lambda: None) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def on_device(blobs: list[bytes]):
    """The blobs back to back in one device buffer, and a view of each (as a read leaves them)."""
    import cupy

    lengths = [len(b) for b in blobs]
    buf = cupy.asarray(np.frombuffer(b"".join(blobs), "u1"))
    cuts = np.cumsum([0, *lengths])
    return buf, [buf[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def nvcomp_direct(pieces, codec, nbytes: int):
    """Bare streams to nvCOMP in one call (no framing checks, nvCOMP allocates the outputs)."""
    from nvidia import nvcomp as nv

    from gpulazy.codecs import nvcomp

    from gpulazy.codecs import filters

    algo, framing = nvcomp.ALGORITHMS[codec[0].id]
    cut = {"lz4-numcodecs": (4, 0), "zlib": (2, 4)}.get(framing, (0, 0))
    c = nv.Codec(algorithm=algo, device_id=0, bitstream_kind=nv.BitstreamKind.RAW)  # nvCOMP's Python API
    # aligned once, outside the timing (Deflate wants 4-byte aligned input; gpulazy's time includes that copy)
    bare = filters.aligned([p[cut[0]:p.size - cut[1]] for p in pieces], c.get_required_decompression_alignment())

    def run():
        out = c.decode(nv.as_arrays(bare))
        assert out.buffer_sizes[0] == nbytes

    return run


def run(n: int, repeat: int, only: list[str] | None = None) -> dict:
    import cupy

    import gpulazy
    from gpulazy.codecs import _split, decode_pieces, nvcomp

    dev = gpulazy.get_device("cuda:0")
    t0 = time.perf_counter()
    chunks = make_chunks(n)
    nbytes = chunks[0].nbytes
    total = nbytes * n
    print(f"{n} chunks of {SIDE}x{SIDE} uint16 ({total / 2**20:.0f} MiB) made in {time.perf_counter() - t0:.1f} s",
          flush=True)
    threads = os.cpu_count() or 1
    rows = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for name, codec in codecs().items():
            if only and name not in only:
                continue
            try:
                blobs = encode_all(chunks, codec, pool)
            except ImportError as e:  # hdf5plugin missing: say so, time the rest
                print(f"{name}: skipped ({e})", flush=True)
                continue
            stored = sum(len(b) for b in blobs)
            buf, pieces = on_device(blobs)
            sync = cupy.cuda.get_current_stream().synchronize
            out = decode_pieces(pieces, codec, [nbytes] * n, dev)  # warm-up: kernels compile, scratch allocates
            for i in (0, n // 2, n - 1):
                assert out[i].get().tobytes() == chunks[i].tobytes(), f"{name}: chunk {i} differs"
            del out
            gpulazy.stats().reset()
            gpu_s = best(lambda: decode_pieces(pieces, codec, [nbytes] * n, dev), repeat, sync)
            places = {k: sorted(v) for k, v in gpulazy.stats().snapshot()["decode_by_codec"].items()}
            deflate = split_ways(pieces, codec, nbytes, dev, repeat, sync) if _split.applies(codec[0]) else {}
            direct_s = None
            if len(codec) == 1 and codec[0].id in nvcomp.ALGORITHMS:  # nvCOMP reads no blosc framing
                direct = nvcomp_direct(pieces, codec, nbytes)
                direct()
                direct_s = best(direct, repeat, sync)
            sub = blobs[: max(16, n // 8)]  # one host thread is slow: time a subset, scale up
            one_s = best(lambda: host_decode(sub, codec, nbytes), 1) * n / len(sub)
            host_decode(blobs[:threads], codec, nbytes, pool)
            pool_s = best(lambda: host_decode(blobs, codec, nbytes, pool), max(1, repeat // 2))
            row = {"codec": name, "chunks": n, "decoded_bytes": total, "stored_bytes": stored,
                   "compression_ratio": total / stored, "gpulazy_gpu_gbps": total / gpu_s / 1e9,
                   "nvcomp_direct_gbps": total / direct_s / 1e9 if direct_s else None,
                   "host_1thread_gbps": total / one_s / 1e9, f"host_{threads}threads_gbps": total / pool_s / 1e9,
                   "x_vs_host_1thread": one_s / gpu_s, "x_vs_host_pool": pool_s / gpu_s, "steps_ran_on": places,
                   **deflate}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del buf, pieces
            cupy.get_default_memory_pool().free_all_blocks()
    return {"device": dev.name, "gpu": _gpu_name(), "threads": threads, "rows": rows}


def split_ways(pieces, codec, nbytes: int, dev, repeat: int, sync) -> dict:
    """A Deflate batch through ``decode_pieces`` on the host's cores alone, nvCOMP alone and split.

    Host and nvCOMP alone first: their batches are what ``_split.RECORD`` learns the rates
    from, so the split (last) runs on this machine's figures, as a read's would after a few
    batches. Each way's bytes are checked against the first way's.
    """
    from gpulazy.codecs import _split, decode_pieces

    n, total = len(pieces), nbytes * len(pieces)
    want = [nbytes] * n
    _split.RECORD.reset()
    seconds, first = {}, None
    for way in ("host", "gpu", "auto"):
        with _split.force(way):
            out = decode_pieces(pieces, codec, want, dev)  # warm-up: pinned blocks, nvCOMP scratch
            got = [out[i].get().tobytes() for i in (0, n // 2, n - 1)]
            first = first or got
            assert got == first, f"{codec[0].id}: the {way} way decoded other bytes"
            del out
            seconds[way] = best(lambda: decode_pieces(pieces, codec, want, dev), repeat, sync)
    snap = _split.RECORD.snapshot().get(dev.name, {})
    streams = {}
    for k in (16, 64, 256):
        if k <= n:
            with _split.force("gpu"):
                t = best(lambda: decode_pieces(pieces[:k], codec, want[:k], dev), repeat, sync)
            streams[str(k)] = k * nbytes / t / 1e9
    plan = _split.plan(want, [int(p.size) for p in pieces], _cores(), _split.RECORD.rates(dev.name))
    return {"host_only_gbps": total / seconds["host"] / 1e9, "nvcomp_only_gbps": total / seconds["gpu"] / 1e9,
            "split_gbps": total / seconds["auto"] / 1e9, "split_gpu_pieces": len(plan), "split_pieces": n,
            "split_rates": snap.get("rates"), "split_counts": snap.get("counts"), "nvcomp_only_by_streams": streams}


def _cores() -> int:
    from gpulazy.codecs._run import cores

    return cores()


def _gpu_name() -> str:
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def table(doc: dict) -> str:
    t = doc["threads"]
    head = (f"{'codec':<16}{'ratio':>7}{'gpulazy GPU':>13}{'nvCOMP direct':>15}{'host 1 thr':>12}"
            f"{f'host {t} thr':>13}{'x 1 thr':>9}{'x pool':>8}")
    lines = [f"decode throughput, GB/s of decoded output ({doc['gpu']})", head]
    for r in doc["rows"]:
        direct = f"{r['nvcomp_direct_gbps']:.1f}" if r["nvcomp_direct_gbps"] else "-"
        lines.append(f"{r['codec']:<16}{r['compression_ratio']:>7.2f}{r['gpulazy_gpu_gbps']:>13.1f}{direct:>15}"
                     f"{r['host_1thread_gbps']:>12.2f}{r[f'host_{t}threads_gbps']:>13.2f}"
                     f"{r['x_vs_host_1thread']:>9.0f}{r['x_vs_host_pool']:>8.1f}")
    for r in doc["rows"]:
        if "split_gbps" in r:
            streams = ", ".join(f"{k}: {v:.2f}" for k, v in r["nvcomp_only_by_streams"].items())
            rates = r["split_rates"] or {}
            lines.append(
                f"{r['codec']} through gpulazy on cuda:0: host alone ({t} thr, copies included) "
                f"{r['host_only_gbps']:.2f}, nvCOMP alone {r['nvcomp_only_gbps']:.2f}, split {r['split_gbps']:.2f} "
                f"GB/s ({r['split_gpu_pieces']} of {r['split_pieces']} pieces to nvCOMP); host pool without "
                f"copies {r[f'host_{t}threads_gbps']:.2f}; nvCOMP alone by pieces {{{streams}}}; learnt: "
                f"host {rates.get('host_per_core', 0) / 1e9:.2f} GB/s/core, nvCOMP "
                f"{rates.get('gpu_per_stream', 0) / 1e6:.1f} MB/s/stream, overlap {rates.get('overlap', 1):.2f}")
    return "\n".join(lines)


def host_deflate(n: int, repeat: int) -> dict:
    """Host Deflate (no GPU): numcodecs' zlib against gpulazy's host path (libdeflate, every core).

    Times ``n`` zlib-1 chunks decoded one after the other with numcodecs (what gpulazy did
    before), and through ``decode_pieces`` on ``"cpu"`` (libdeflate, the batch on
    ``_run.host_pool``), on one thread and on all cores.
    """
    import numcodecs

    import gpulazy
    from gpulazy.codecs import decode_pieces
    from gpulazy.codecs._run import host_pool
    from gpulazy.spec import Codec

    chunks = make_chunks(n)
    nbytes, codec = chunks[0].nbytes, (Codec.of("zlib", level=1),)
    with concurrent.futures.ThreadPoolExecutor() as pool:
        blobs = encode_all(chunks, codec, pool)
    pieces = [np.frombuffer(b, "u1") for b in blobs]
    cpu, total = gpulazy.get_device("cpu"), nbytes * n
    zlib = numcodecs.Zlib()
    cores = host_pool()._max_workers
    with concurrent.futures.ThreadPoolExecutor(cores) as pool:
        rows = {
            "numcodecs zlib, 1 thread": best(lambda: [zlib.decode(b) for b in blobs], repeat),
            f"numcodecs zlib, {cores} threads": best(lambda: list(pool.map(zlib.decode, blobs)), repeat),
            "gpulazy host (libdeflate), 1 piece per call": best(
                lambda: [decode_pieces([p], codec, [nbytes], cpu) for p in pieces], repeat),
            f"gpulazy host (libdeflate), batch on {cores} threads": best(
                lambda: decode_pieces(pieces, codec, [nbytes] * n, cpu), repeat),
        }
    out = decode_pieces(pieces[:2], codec, [nbytes] * 2, cpu)
    assert out[1].tobytes() == chunks[1].tobytes()
    ratio = total / sum(len(b) for b in blobs)
    doc = {"chunks": n, "decoded_bytes": total, "compression_ratio": ratio, "cores": cores,
           "gbps": {k: total / t / 1e9 for k, t in rows.items()}}
    print(f"host zlib-1 decode, {n} chunks of {SIDE}x{SIDE} uint16, ratio {ratio:.2f}, {cores} cores")
    for k, v in doc["gbps"].items():
        print(f"  {k:<48}{v:6.2f} GB/s")
    return doc


PROBE_CASES = ("exact", "oversized_output", "undersized_output", "garbled_payload", "truncated")


def probe() -> dict:
    """What nvCOMP's Python API reports for the cases gpulazy's checks rely on.

    Each case runs in a process of its own: a decoder that faults takes the CUDA context
    (and the process) down with it, which is itself the answer.
    """
    import subprocess

    facts: dict = {}
    for algo in ("Zstd", "LZ4", "Deflate"):
        for case in PROBE_CASES:
            try:
                r = subprocess.run([sys.executable, __file__, "--probe-case", algo, case], capture_output=True,
                                   text=True, timeout=90)
                lines = r.stdout.strip().splitlines()
                got = json.loads(lines[-1]) if r.returncode == 0 and lines else {
                    "process_failed": r.returncode, "stderr": r.stderr.strip()[-300:]}
            except subprocess.TimeoutExpired:
                got = {"timed_out": True}
            facts.setdefault(algo, {})[case] = got
            print(algo, case, json.dumps(got), flush=True)
    return facts


def probe_case(algo: str, case: str) -> dict:
    import cupy
    import numcodecs
    from nvidia import nvcomp as nv

    data = make_chunks(1)[0].tobytes()[: 1 << 18]
    enc, cut = {"Zstd": (numcodecs.Zstd(1), (0, 0)), "LZ4": (numcodecs.LZ4(), (4, 0)),
                "Deflate": (numcodecs.Zlib(1), (2, 4))}[algo]
    blob = np.frombuffer(bytes(enc.encode(data)), "u1")
    bare = cupy.asarray(blob[cut[0]:blob.size - cut[1]])
    c = nv.Codec(algorithm=algo, device_id=0, bitstream_kind=nv.BitstreamKind.RAW)
    capacity = {"oversized_output": len(data) + 4096, "undersized_output": len(data) - 4096}.get(case, len(data))
    if case == "garbled_payload":
        bare[16:-16] = cupy.asarray(np.random.default_rng(0).integers(0, 256, bare.size - 32, dtype=np.uint8))
    if case == "truncated":
        bare = bare[: bare.size // 2]
    out = cupy.zeros(capacity, np.uint8)
    f: dict = {"alignment": int(c.get_required_decompression_alignment())}
    try:
        res = c.decode(nv.as_arrays([bare]), out=nv.as_arrays(out, [0], [capacity]))
        f["sizes"] = list(res.buffer_sizes)
        cupy.cuda.runtime.deviceSynchronize()
        f["bytes_equal"] = out[: len(data)].get().tobytes() == data if capacity >= len(data) else None
    except Exception as e:
        f["error"] = f"{type(e).__name__}: {e}"[:300]
    return f


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--only", help="comma-separated codec rows to time (default: all)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--probe", action="store_true", help="only print nvCOMP's reports for corrupt pieces")
    p.add_argument("--probe-case", nargs=2, metavar=("ALGO", "CASE"), help=argparse.SUPPRESS)
    p.add_argument("--host-deflate", action="store_true", help="only time host zlib decoding (no GPU needed)")
    args = p.parse_args(argv)
    if args.probe_case:
        print(json.dumps(probe_case(*args.probe_case)))
        return 0
    if args.probe:
        doc = {"probe": probe()}
    elif args.host_deflate:
        doc = host_deflate(args.chunks, args.repeat)
    else:
        doc = run(args.chunks, args.repeat, args.only.split(",") if args.only else None)
        print(table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
