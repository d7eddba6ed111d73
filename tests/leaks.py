"""Count threads, child processes and file descriptors before and after a block of work.

Long-lived pools that gpulazy and dask keep on purpose (one per process, reused by
every computation) are allowed by name; anything else still alive a few seconds after
the work ended is a leak: a read-ahead thread never stopped, a file never closed, a
worker process never joined.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

#: Parts of the names of threads in pools that live as long as the process (or cluster), by design.
LONG_LIVED = (
    "Dask-Default-Threads",    # a dask.distributed worker's task executor (started on its first task)
    "gpulazy-posix-",          # a backend's read pool: one per (backend, device, settings), shared
    "gpulazy-cache-default-",  # the default cache's prefetch workers (daemons, reused)
    "gpulazy-host-decode",     # codecs._run.host_pool: the host decode pool, one per process
    "gpulazy-verify",          # _hashing._pool: verify=True's hashing pool, one per process
    "gpulazy-settle",          # read.whole.settle_pool: the settle threads, one pool per process
    "gpulazy-host-share",      # codecs._beside._drivers: drives a host share beside nvCOMP, one per process
    "ThreadPoolExecutor-",     # dask's threaded scheduler pool and other default executors
    "asyncio_",                # distributed's offload executor
    "Dask-Offload",
    "Dask-Callback",
    "Profile",
    "IO loop",
    "TCP-Executor",
    "AsyncProcess",
    "QueueFeederThread",
    "ResourceTracker",
)


def _threads() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate() if t.is_alive() and t.ident is not None}


def _fds() -> set[int]:
    try:
        return {int(n) for n in os.listdir("/proc/self/fd")}
    except OSError:  # not Linux: nothing to count
        return set()


def _fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE}


@dataclass
class Snapshot:
    threads: dict[int, str] = field(default_factory=_threads)
    fds: set[int] = field(default_factory=_fds)
    children: set[int] = field(default_factory=_children)

    def leaks(self) -> list[str]:
        """What is alive now that was not at the snapshot (allowed pools aside)."""
        out = []
        now = _threads()
        for ident, name in now.items():
            if ident not in self.threads and not any(part in name for part in LONG_LIVED):
                out.append(f"thread {name!r}")
        new = {fd: _fd_target(fd) for fd in _fds() - self.fds}
        # The CUDA driver opens /dev/nvidia* and a few pipes once, when a test first uses the GPU.
        cuda_started = any(t.startswith("/dev/nvidia") for t in new.values())
        for fd, target in sorted(new.items()):
            # Sockets and event polls belong to dask.distributed's connection pools, which
            # connect lazily and stay; "?" is a descriptor closed while we looked.
            if target.startswith(("socket:", "anon_inode:", "?", "/dev/nvidia")):
                continue
            if cuda_started and target.startswith("pipe:"):
                continue
            out.append(f"file descriptor {fd} -> {target}")
        for pid in _children() - self.children:
            out.append(f"child process {pid}")
        return out

    def assert_no_leaks(self, wait: float = 5.0) -> None:
        """Wait up to ``wait`` seconds for stragglers to end, then fail listing what is left."""
        deadline = time.monotonic() + wait
        while True:
            left = self.leaks()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert not left, "left behind: " + "; ".join(left)
