"""``FaultInjectingBackend``: a TEST DOUBLE backend that reads through the real posix backend
and injects one kind of fault into the reads a plan selects.

It stands in for a disk, not for CuPy or KvikIO: every byte it hands out was read from
the real file by gpulazy's posix backend. Registered through the backend registry
(``gpulazy.io.register_backend``) under the name ``"faulty"``; on dask.distributed
workers, ``client.run(install, plan)`` registers and configures it there.

Faults (``plan["fault"]``):

- ``"eio"``: the read fails with a bare ``OSError(EIO)``, as a backend that lets the
  operating system's error through would;
- ``"slow"``: the read waits ``plan["delay"]`` seconds, then reads;
- ``"interrupt"``: ``KeyboardInterrupt`` is raised from ``submit`` (Ctrl-C in a read; only
  reads in the main thread are selected, where Python delivers the signal);
- ``"flip"``: the read succeeds, then one byte of the buffer is flipped (silent
  corruption on the way: only ``verify=True`` can notice).

A read is selected when its first path contains ``plan["match"]`` (default: any) and
it is the ``after``-th such read or later (counted from 0), at most ``times`` reads (per
process); with ``plan["token"]`` (a file path) only the one read, in any process, that
removes that file gets the fault.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any, Sequence

from gpulazy.io import ReadFuture, register_backend
from gpulazy.io._base import Backend
from gpulazy.spec import ByteRange

NAME = "faulty"
TARGET = "fault_backend:FaultInjectingBackend"

_plan: dict[str, Any] = {}
_seen = 0
_injected = 0
_lock = threading.Lock()


def install(plan: dict[str, Any] | None = None) -> None:
    """Register the backend in this process and set its plan (``None``: no faults)."""
    global _plan, _seen, _injected
    register_backend(NAME, TARGET)
    with _lock:
        _plan = dict(plan or {})
        _seen = 0
        _injected = 0


def uninstall() -> None:
    install(None)
    register_backend(NAME, None)


def injected() -> int:
    """How many reads got a fault in this process since ``install``."""
    return _injected


def _selected(ranges: Sequence[ByteRange]) -> str | None:
    global _seen, _injected
    with _lock:
        fault = _plan.get("fault")
        if not fault or not ranges or _plan.get("match", "") not in ranges[0].path:
            return None
        if fault == "interrupt" and threading.current_thread() is not threading.main_thread():
            return None  # Ctrl-C arrives in the main thread only
        n, _seen = _seen, _seen + 1
        if n < _plan.get("after", 0) or _injected >= _plan.get("times", 1 << 30):
            return None
        if "token" in _plan:  # one fault across processes: whoever removes the token file injects it
            try:
                os.remove(_plan["token"])
            except FileNotFoundError:
                return None
        _injected += 1
        return fault


class FaultInjectingBackend(Backend):
    """TEST DOUBLE: gpulazy's posix backend with faults injected (see the module docstring)."""

    name = NAME
    device_direct = False
    devices = frozenset({"cpu", "cuda"})

    def __init__(self, device, **kwargs: Any):
        super().__init__(device, **kwargs)
        from gpulazy.io._posix import PosixBackend

        self.inner = PosixBackend(device, **kwargs)

    @classmethod
    def availability(cls, device) -> tuple[bool, str]:
        return True, "test double over the posix backend"

    @property
    def mode(self) -> str:
        return "faulty"

    def submit(self, ranges: Sequence[ByteRange], out: Any) -> ReadFuture:
        self._check_open()
        fault = _selected(ranges)
        if fault == "eio":
            return ReadFuture.failed(OSError(errno.EIO, "Input/output error (injected)"))
        if fault == "interrupt":
            raise KeyboardInterrupt("injected into a read")
        if fault == "slow":
            time.sleep(float(_plan.get("delay", 1.0)))
        future = self.inner.submit(ranges, out)
        if fault == "flip":
            def flip(values: list) -> int:
                out[min(len(out) - 1, int(_plan.get("at", 0)))] ^= 0xFF
                return values[0]

            return ReadFuture([_Wait(future)], flip)
        return future

    def close(self) -> None:
        super().close()
        self.inner.close()


class _Wait:
    """A part of a ``ReadFuture`` that waits on another ``ReadFuture``."""

    def __init__(self, future: ReadFuture):
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> int:
        return self.future.result()
