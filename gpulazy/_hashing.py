"""Hashing blocks on every core: the verify pool, its jobs, and the host buffers they read into.

XXH3 hashes at about 12 GB/s on one core and releases the GIL (as ``os.preadv`` does), so
``gpulazy.checksums`` cuts the blocks of a check into jobs of a few MiB (``spans``) that
the calling thread and the verify pool (``_pool``, one thread per core, one per process,
shared by every read) run side by side (``run``, ``run_all``). A job is worth its cost in
the pool (~20 µs) from about ``JOB_BYTES`` on: one job per 256 KiB block spent more time in
the pool's locks than in XXH3. Each thread keeps a host buffer to read files into
(``scratch``) and, on a GPU, a pinned one to copy device bytes into (``host_span``).
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["JOB_BYTES", "JOB_MAX", "PARALLEL_BYTES", "digests", "host_span", "read_into", "run", "run_all",
           "scratch", "spans"]

PARALLEL_BYTES = 8 << 20  # a check of more bytes than this hashes in the verify pool
# Bytes one job hashes: at least JOB_BYTES (the pool's cost per job, ~20 µs, against ~0.3 ms
# of XXH3 for 4 MiB), at most JOB_MAX (a GPU job's pinned buffer, one per thread).
JOB_BYTES, JOB_MAX = 4 << 20, 16 << 20
# Per thread: in_pool (a verify worker), scratch (a host buffer files are read into), pinned
# (a pinned host buffer device bytes are copied into).
_local = threading.local()


def read_into(fd: int, buf: np.ndarray, offset: int) -> int:
    """Fill ``buf`` from ``offset`` of ``fd``; the bytes read (fewer only at the end of the file)."""
    view, done = memoryview(buf), 0
    while done < len(buf):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def scratch(nbytes: int) -> np.ndarray:
    """This thread's host buffer for reading files, at least ``nbytes`` (grown, never shrunk)."""
    have = getattr(_local, "scratch", None)
    if have is None or have.nbytes < nbytes:
        have = _local.scratch = np.empty(nbytes, np.uint8)
    return have[:nbytes]


def digests(data: Any, block_size: int) -> bytes:
    """The hash of every ``block_size`` bytes of ``data`` (1-D uint8, the last block may be shorter), joined."""
    import xxhash

    digest = xxhash.xxh3_128_digest  # one call per block: the same hash as checksums.block_hash, without a state object
    return b"".join(digest(data[at: at + block_size]) for at in range(0, len(data), block_size))


def spans(nblocks: int, block_size: int, nbytes: int, first: int = 0) -> list[tuple[int, int]]:
    """Blocks ``first .. first + nblocks`` cut into ``(b0, b1)`` runs of about one job's bytes
    each: enough jobs for every worker twice over, none under ``JOB_BYTES`` (unless it is all)."""
    per_job = min(max(JOB_BYTES, nbytes // (2 * _workers())), JOB_MAX)
    step = max(1, per_job // block_size)
    return [(b, min(b + step, first + nblocks)) for b in range(first, first + nblocks, step)]


def _workers() -> int:
    """Threads that hash: one per core this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _mark_worker() -> None:
    _local.in_pool = True


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The verify pool, one per process, shared by every read (as ``codecs._run.host_pool`` is by
    host decodes): a pool of its own, so that a hash job never queues behind a decode batch."""
    return ThreadPoolExecutor(_workers(), thread_name_prefix="gpulazy-verify", initializer=_mark_worker)


def run(jobs: list, nbytes: int) -> list:
    """``run_all``, raising the first failing job's error (in order, not in time); the results."""
    results, errors = run_all(jobs, nbytes)
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    return results


def run_all(jobs: list, nbytes: int) -> tuple[list, list[BaseException | None]]:
    """Run ``jobs`` (callables, each about ``nbytes / len(jobs)`` bytes of hashing): ``(results,
    errors)``, in order, ``None`` for what a job did not give.

    Many bytes: the calling thread runs the first job while the verify pool runs the rest
    (XXH3 and ``pread`` release the GIL); every job has finished when this returns. Few
    bytes, or called from a verify worker (which must never wait on its own pool): one
    after another, here.
    """
    inline = len(jobs) < 2 or nbytes < PARALLEL_BYTES or getattr(_local, "in_pool", False)
    futures = [] if inline else [_pool().submit(job) for job in jobs[1:]]
    results: list = []
    errors: list[BaseException | None] = []
    for job in jobs if inline else jobs[:1]:
        try:
            results.append(job())
            errors.append(None)
        except BaseException as e:  # kept: the other jobs are still waited for
            results.append(None)
            errors.append(e)
    for f in futures:
        error = f.exception()
        errors.append(error)
        results.append(None if error is not None else f.result())
    return results, errors


def host_span(flat: Any, lo: int, hi: int) -> np.ndarray:
    """Bytes ``lo .. hi`` of ``flat`` on the host: a view of a NumPy buffer; a device buffer's
    span copied into this thread's pinned buffer (valid until this thread's next copy)."""
    if isinstance(flat, np.ndarray):
        return flat[lo:hi]
    from gpulazy.device import Device, gpulazy_stream

    dev = Device("cuda", flat.device.id)
    host = _pinned(hi - lo)
    with dev.activate():
        # This thread's non-blocking stream: copies of several jobs overlap, and none waits for
        # (or holds up) the legacy default stream. The read has landed: its future returned.
        stream = gpulazy_stream(dev)
        flat[lo:hi].get(stream=stream, out=host)
        stream.synchronize()  # the host hashes it next
    return host


def _pinned(nbytes: int) -> np.ndarray:
    """This thread's pinned host buffer, at least ``nbytes`` (grown, never shrunk: one job's span)."""
    have = getattr(_local, "pinned", None)
    if have is None or have.nbytes < nbytes:
        import cupyx

        have = _local.pinned = cupyx.empty_pinned(max(nbytes, JOB_BYTES), np.uint8)
    return have[:nbytes]
