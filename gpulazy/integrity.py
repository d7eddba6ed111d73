"""Every byte handed out is the file's, as it was indexed, or the read raises.

A ``ChunkSpec`` carries the ``file_identity`` (path, size, mtime, inode, ctime) of each
file it reads, taken when the files were indexed. ``checked_read`` stats those files
before a read (a cached or prefetched chunk of a file that changed since is never
served, and a file replaced by a FIFO is never opened) and again after it (a file
written during the read may have given mixed bytes), and raises ``ChunkReadError``
naming the file, offset and byte count when anything differs. It also turns an ``OSError``
a backend let through (``EIO`` from a failing disk) into a ``ChunkReadError`` that says
where, and, with ``verify=True``, checks each chunk's stored bytes against their
checksums (``gpulazy.checksums``) before they are decoded.

A stat costs about a microsecond; a read does two per file of the chunk, a cache hit one.

>>> import numpy as np, os, tempfile, gpulazy
>>> p = os.path.join(tempfile.mkdtemp(), "a.raw"); np.arange(4, dtype="u1").tofile(p)
>>> vol = gpulazy.from_files(p, dtype="u1", device="cpu", cache=False)
>>> np.arange(4, 8, dtype="u1").tofile(p)          # rewritten after indexing
>>> try:
...     vol.compute()
... except gpulazy.errors.ChunkReadError as e:
...     print("changed since" in str(e), e.path == p)
True True
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from gpulazy.errors import ChunkReadError
from gpulazy.spec import ChunkSpec, identity_from_stat

__all__ = ["check_unchanged", "check_all_unchanged", "as_read_error", "checked_read", "checked_start"]

_FIELDS = ("path", "size", "mtime_ns", "inode", "ctime_ns")


def check_unchanged(spec: ChunkSpec) -> None:
    """Raise ``ChunkReadError`` if a file of ``spec`` is gone or differs from its indexed identity."""
    for ident in spec.identity:
        _check_identity(ident, spec)


def check_all_unchanged(specs: Iterable[ChunkSpec]) -> None:
    """``check_unchanged`` for many specs, each file stat'ed once."""
    seen: set = set()
    for spec in specs:
        for ident in spec.identity:
            if ident not in seen:
                _check_identity(ident, spec)
                seen.add(ident)


def _check_identity(ident: tuple, spec: ChunkSpec) -> None:
    path = ident[0]
    try:
        st = os.stat(path)
    except OSError as e:
        raise _changed(spec, path, f"it can no longer be found ({type(e).__name__}: {e.strerror or e})") from e
    now = identity_from_stat(path, st)[: len(ident)]  # specs made by hand may carry fewer fields
    if now != tuple(ident):
        what = ", ".join(f"{name} {a} -> {b}" for name, a, b in zip(_FIELDS, ident, now) if a != b)
        raise _changed(spec, path, what)


def _changed(spec: ChunkSpec, path: str, what: str) -> ChunkReadError:
    r = next((r for r in spec.ranges if r.path == path), spec.ranges[0] if spec.ranges else None)
    offset, nbytes = (r.offset, r.nbytes) if r is not None else (None, None)
    where = f"chunk {spec.index} " if spec.index else ""
    return ChunkReadError(
        f"{where}of {path!r} (offset {offset}, {nbytes} bytes): the file changed since it was indexed ({what}); "
        "nothing was served from it. Call from_files again to read the file as it is now",
        path=path, offset=offset, expected=nbytes)


def as_read_error(error: BaseException, spec: ChunkSpec) -> BaseException:
    """``error`` itself, or for a bare ``OSError`` a ``ChunkReadError`` naming ``spec``'s file and bytes."""
    if isinstance(error, ChunkReadError) or not isinstance(error, OSError):
        return error
    path = getattr(error, "filename", None) or (spec.ranges[0].path if spec.ranges else None)
    r = next((r for r in spec.ranges if r.path == path), spec.ranges[0] if spec.ranges else None)
    offset, nbytes = (r.offset, r.nbytes) if r is not None else (None, spec.nbytes)
    err = ChunkReadError(
        f"reading {nbytes} bytes of {path!r} at offset {offset} failed: {type(error).__name__}: {error}; "
        "nothing was returned for this chunk", path=path, offset=offset, expected=nbytes)
    err.errno = getattr(error, "errno", None)
    err.__cause__ = error
    return err


def checked_read(spec: ChunkSpec, backend: Any, *, verify: bool = False, check_before: bool = True,
                 staged: bool | None = None) -> Any:
    """Read and decode ``spec`` through ``backend``: identity checked around the read,
    stored bytes verified before decoding when ``verify``; raises ``ChunkReadError``.

    ``staged``: as in ``gpulazy.io.start_chunks``."""
    from gpulazy.io import start_chunks

    if check_before:
        check_unchanged(spec)
    # The checks after the read are ``CheckedPending``'s, shared with read-ahead; the
    # verification is the read's own (``start_chunks(verify=...)``), as on every path.
    return CheckedPending(start_chunks([spec], backend, staged=staged, verify=verify)[0]).result()


class CheckedPending:
    """A ``PendingChunk`` whose ``result()`` applies ``checked_read``'s checks after the read."""

    __slots__ = ("pending",)

    def __init__(self, pending: Any):
        self.pending = pending

    @property
    def spec(self) -> ChunkSpec:
        return self.pending.spec

    def done(self) -> bool:
        return self.pending.done()

    def result(self) -> Any:
        spec = self.pending.spec
        try:
            arr = self.pending.result()
        except OSError as e:
            raise as_read_error(e, spec) from e
        check_unchanged(spec)  # written to during the read: the bytes may be half old, half new
        return arr


def checked_start(specs: list[ChunkSpec], backend: Any, *, staged: bool | None = None,
                  verify: bool = False) -> list[CheckedPending]:
    """Start reading ``specs`` now (``gpulazy.io.start_chunks``), checked as ``checked_read`` checks.

    The files are stat'ed before the reads are submitted and again by each ``result()``.
    """
    from gpulazy.io import start_chunks

    check_all_unchanged(specs)
    return [CheckedPending(p) for p in start_chunks(specs, backend, staged=staged, verify=verify)]
