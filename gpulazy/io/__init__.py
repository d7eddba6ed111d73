"""I/O backends: a small contract (``Backend``), a registry, and ``"auto"`` selection.

Built-ins live in one table and are imported only when chosen; third parties register
through the ``gpulazy.backends`` entry-point group (``name = "pkg.module:Class"``).
"""

from __future__ import annotations

import threading

from gpulazy import config
from gpulazy._plugins import entry_point_table, load_plugin, plugin_names
from gpulazy.device import Device, get_device
from gpulazy.errors import BackendUnavailableError
from gpulazy.io._base import Backend, ReadFuture

__all__ = [
    "Backend",
    "ReadFuture",
    "backend_names",
    "register_backend",
    "backend_class",
    "select_backend",
    "get_backend",
    "LANES",
]

_BUILTIN = {
    "kvikio": "gpulazy.io._kvikio:KvikioBackend",
    "posix": "gpulazy.io._posix:PosixBackend",
    "directstorage": "gpulazy.io._directstorage:DirectStorageBackend",
}


_registered: dict[str, str] = {}


def _entry_points() -> dict[str, str]:
    return {**entry_point_table("gpulazy.backends"), **_registered}


def register_backend(name: str, target: str | None) -> None:
    """Register a backend at run time as ``"pkg.module:Class"`` (``None`` removes it).

    What the ``gpulazy.backends`` entry-point group does for an installed package, for
    a class that is not installed (a test double, a notebook). It holds in this process
    only: on ``dask.distributed`` workers, register it there too (``client.run``).
    """
    if target is None:
        _registered.pop(name, None)
    else:
        _registered[name] = target


def backend_names() -> list[str]:
    """Every backend name: built-ins first, then those from entry points."""
    return plugin_names(_BUILTIN, _entry_points())


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name`` (imported now)."""
    return load_plugin("backend", name, _BUILTIN, _entry_points(), also_valid=("auto",))


def select_backend(device: Device) -> tuple[str, str]:
    """``(name, reason)`` that ``"auto"`` picks for ``device``; deterministic.

    On a CUDA device: kvikio when its probe read works, else posix through pinned
    host buffers. On ``"cpu"``: posix. directstorage is never picked automatically.
    """
    if device.is_gpu:
        ok, why = backend_class("kvikio").availability(device)
        if ok:
            return "kvikio", f"CUDA device {device.name} and a working KvikIO ({why})"
        return "posix", f"CUDA device {device.name} but KvikIO is not usable ({why}); pinned host buffers instead"
    return "posix", "device is 'cpu': threaded preadv straight into NumPy buffers"


_instances: dict[tuple, Backend] = {}
_lock = threading.Lock()


#: Lanes: ``"bulk"`` (chunk tasks, read-ahead, whole-array reads) and ``"view"`` (the reads
#: a viewer waits on to show a plane). Each lane has backend instances of its own.
LANES = ("bulk", "view")


def get_backend(name: str | None = None, device: str | Device | None = None, *,
                threads: int | None = None, task_size: int | None = None, lane: str = "bulk") -> Backend:
    """A ready backend instance (shared per name, device, settings and lane).

    ``name=None`` follows ``config.get("backend")``, then ``"auto"``. Asking for a
    backend that cannot run on this device raises ``BackendUnavailableError`` saying why.

    ``lane="view"`` is for reads someone is waiting on while read-ahead runs (a viewer's
    plane): a backend's queue is first in, first out, so a plane submitted behind a
    gigabyte of read-ahead waited for all of it (a 4 MiB plane read took 86 ms behind three
    32 MiB chunk warm-ups). The view lane is a separate instance with its own threads. A
    backend whose queue is process-wide (``Backend.shared_queue``: KvikIO's one thread pool)
    cannot give a second queue, so its view lane is ``posix`` (pinned buffers, non-blocking
    streams) on that device.
    """
    if lane not in LANES:
        raise ValueError(f"lane must be one of {LANES}, got {lane!r}")
    dev = get_device(device)
    name = name or config.get("backend") or "auto"
    if name == "auto":
        name, because = select_backend(dev)
    else:
        because = "asked for by name"
    if lane == "view" and backend_class(name).shared_queue:
        name, because = "posix", (f"the view lane: {name}'s read queue is shared by the whole process, so "
                                  "reads a viewer waits on go through pinned host buffers on threads of their own")
    threads = int(threads or config.get("threads"))
    task_size = int(task_size or config.get("task_size"))
    key = (name, dev.name, threads, task_size, lane)
    with _lock:
        backend = _instances.get(key)
        if backend is None or backend.closed:  # a closed instance is replaced, never handed out
            cls = backend_class(name)
            if dev.kind not in cls.devices:
                raise BackendUnavailableError(
                    f"backend {name!r} cannot read into device {dev.name!r}; it supports {sorted(cls.devices)}")
            ok, why = cls.availability(dev)
            if not ok:
                raise BackendUnavailableError(f"backend {name!r} is not usable on {dev.name}: {why}")
            backend = cls(dev, threads=threads, task_size=task_size)
            _instances[key] = backend
        # One instance serves both "posix" and "auto" -> posix: it says why it was chosen last.
        backend.selected_because = because
    return backend


def _close_all() -> None:
    with _lock:
        for b in _instances.values():
            b.close()
        _instances.clear()
