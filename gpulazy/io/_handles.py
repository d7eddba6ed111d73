"""A small cache of open file handles, shared by the reads of one backend.

Opening a file per read costs a system call and, with KvikIO, a ``CuFile`` (a cuFile
handle registration attempt) per read; a volume of thousands of tiles reads the same
files again and again. Handles stay open here, least recently used closed first, and a
handle is never closed while a read uses it (reference counts). Before each use the
file is ``stat``-ed: a different device or ``FileIdentity`` (inode, size, mtime, ctime: the
file was replaced, truncated or rewritten) retires the old handle and opens the file anew,
so a cached handle never reads a file that is no longer the one at that path.

Hand-written rather than ``functools.lru_cache``: entries need reference counts and a
validity check on every use.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable, Mapping

from gpulazy.spec import FileIdentity

__all__ = ["Handle", "HandleCache", "default_capacity"]


class Handle:
    """One open file: ``obj`` is what ``open_fn`` returned."""

    __slots__ = ("path", "obj", "ident", "refs", "retired")

    def __init__(self, path: str, obj: Any, ident: tuple):
        self.path, self.obj, self.ident, self.refs, self.retired = path, obj, ident, 0, False


def default_capacity() -> int:
    """Handles kept open: a quarter of the process's open-file limit, 64 to 4096. A 4 GiB Zarr of
    8 MiB chunks is 512 files; with 256 kept, every whole read opened each of them again."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # no resource module (Windows)
        return 256
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(64, min(4096, soft // 4))


def _ident(path: str, st: os.stat_result) -> tuple[int, FileIdentity]:
    # The device too: this process's handle must be for this mount's file (a FileIdentity
    # leaves st_dev out, as it travels between hosts).
    return (st.st_dev, FileIdentity.from_stat(path, st))


class HandleCache:
    """Open handles by path, at most ``capacity`` idle ones kept.

    Parameters
    ----------
    open_fn, close_fn
        ``open_fn(path) -> obj`` and ``close_fn(obj)``; ``open_fn`` raises for a file it
        cannot open.
    capacity
        Most handles kept open (handles in use are never closed, so more may be open
        for a moment).

    Examples
    --------
    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "a.bin"); _ = open(p, "wb").write(b"abc")
    >>> hc = HandleCache(lambda path: os.open(path, os.O_RDONLY), os.close)
    >>> h = hc.acquire(p); os.pread(h.obj, 3, 0); hc.release(h)
    b'abc'
    >>> hc.acquire(p) is h     # kept open, and still the same file
    True
    >>> hc.close()
    """

    def __init__(self, open_fn: Callable[[str], Any], close_fn: Callable[[Any], None], capacity: int | None = None):
        self._open, self._close = open_fn, close_fn
        self.capacity = default_capacity() if capacity is None else int(capacity)
        self._lock = threading.Lock()
        self._handles: OrderedDict[str, Handle] = OrderedDict()
        self.opened = 0  # files opened so far (tests and stats)

    def acquire(self, path: str, st: os.stat_result | None = None) -> Handle:
        """An open handle of ``path`` as it is now (``st``: its ``os.stat``, when the caller has
        just taken it); give it back with ``release``."""
        ident = _ident(path, os.stat(path) if st is None else st)  # FileNotFoundError etc. reach the caller
        retired = None
        with self._lock:
            h = self._handles.get(path)
            if h is not None and h.ident == ident:
                h.refs += 1
                self._handles.move_to_end(path)
                return h
            if h is not None:  # the file at this path changed: never read it through the old handle
                retired = self._retire(path)
        if retired is not None:
            self._close(retired)
        obj = self._open(path)
        h = Handle(path, obj, ident)
        h.refs = 1
        idle = []
        with self._lock:
            self.opened += 1
            old = self._handles.pop(path, None)
            if old is not None:  # another thread opened it meanwhile: keep ours, retire theirs
                old.retired = True
                if old.refs == 0:
                    idle.append(old.obj)
            self._handles[path] = h
            while len(self._handles) > self.capacity:
                victim = next((p for p, e in self._handles.items() if e.refs == 0), None)
                if victim is None:
                    break
                idle.append(self._handles.pop(victim).obj)
        for o in idle:
            self._close(o)
        return h

    def reuse_many(self, known: Mapping[str, FileIdentity]) -> dict[str, Handle]:
        """The kept handles of the paths of ``known`` that were opened on the file with that identity,
        taken without a stat (give each back with ``release_many``); paths with none are left out.

        For a caller that indexed ``known`` and stats the paths after its read: a handle then
        reads the very file it indexed, and the stat after catches a file replaced or written to
        since. (A stat before the read, on the thread that submits thousands of them, cost an H100
        host's many-file reads about a seventh of that thread's time; all of a submission's
        files are taken under one lock, as a lock a file held that thread a few more percent.)
        """
        out: dict[str, Handle] = {}
        with self._lock:
            handles = self._handles
            for path, ident in known.items():
                h = handles.get(path)
                if h is not None and h.ident[1] == ident:
                    h.refs += 1
                    handles.move_to_end(path)
                    out[path] = h
        return out

    def release(self, h: Handle) -> None:
        self.release_many((h,))

    def release_many(self, handles: Iterable[Handle]) -> None:
        """Give handles back (one lock for all); a retired one closes when its last user gives it back."""
        close = []
        with self._lock:
            for h in handles:
                h.refs -= 1
                if h.retired and h.refs == 0:
                    close.append(h.obj)
        for obj in close:
            self._close(obj)

    def _retire(self, path: str) -> Any:
        # Lock held: drop the entry; return its object if nobody uses it (the caller closes it).
        h = self._handles.pop(path)
        h.retired = True
        return h.obj if h.refs == 0 else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._handles)

    def close(self) -> None:
        """Close every idle handle; handles in use close when released."""
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
            for h in handles:
                h.retired = True
            idle = [h.obj for h in handles if h.refs == 0]
        for o in idle:
            self._close(o)
