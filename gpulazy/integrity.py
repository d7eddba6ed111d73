"""Every byte handed out is the file's, as it was indexed, or the read raises.

A ``ChunkSpec`` carries the ``FileIdentity`` (path, size, mtime, inode, ctime) of each
file it depends on, taken when the files were indexed: the files it reads, the files whose
absence made a piece its fill value (a Zarr chunk never written: it must still be absent)
and metadata files that describe its bytes. The read engine (``gpulazy.read``) stats
those files after each read (a file changed before the read or written during it may
have given other or mixed bytes; a read or decode that failed on a changed file says
what changed), and a consumer serving a chunk from a cache stats them before serving it
(a cached or prefetched chunk of a file that changed since is never served); each raises
``ChunkReadError`` naming the file, offset and byte count when anything differs. (The
backends themselves never open a FIFO or a directory.) It also turns an ``OSError`` a
backend let through (``EIO`` from a failing disk) into a ``ChunkReadError`` that says where.

A read does one stat per file of the chunk (chunks of one file that landed together share
it), a cache hit one.

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

from typing import Any, Callable, Iterable

from gpulazy.errors import ChunkReadError
from gpulazy.spec import ChunkSpec, FileIdentity

__all__ = ["check_unchanged", "check_all_unchanged", "unchanged_each", "check_absent_unlisted", "as_read_error"]

def check_unchanged(spec: ChunkSpec) -> None:
    """Raise ``ChunkReadError`` if a file of ``spec`` is gone, differs from its indexed identity,
    or (indexed as absent: a piece read as the fill value) exists now."""
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


def unchanged_each(specs: Iterable[ChunkSpec]) -> Callable[[ChunkSpec], ChunkReadError | None]:
    """``check_unchanged`` for many specs that each get their own outcome: each file is stat'ed
    once now, and the function returned gives a spec's error (or ``None``) from those stats.
    (The whole-array path finishes thousands of single-file chunks at a time: a stat each.)"""
    found: dict = {}
    for spec in specs:
        for ident in spec.identity:
            if ident not in found:
                found[ident] = _changes(ident)

    def error(spec: ChunkSpec) -> ChunkReadError | None:
        for ident in spec.identity:
            path, what = found[ident] if ident in found else _changes(ident)
            if what is not None:
                return _changed(spec, path, what)
        return None

    return error


def check_absent_unlisted(specs: Iterable[ChunkSpec]) -> None:
    """Raise ``ChunkReadError`` for a file indexed as absent (read as the fill value) that a
    checksum manifest lists: the manifest says it held bytes, so it was lost (``verify=True``)."""
    from gpulazy.checksums import manifest_entry

    seen: set[str] = set()
    for spec in specs:
        for ident in spec.identity:
            if isinstance(ident, FileIdentity) and not ident.exists and ident.path not in seen:
                seen.add(ident.path)
                entry = manifest_entry(ident.path)
                if entry is not None:
                    raise _lost(spec, ident.path, entry)


def _check_identity(ident: tuple, spec: ChunkSpec) -> None:
    path, what = _changes(ident)
    if what is not None:
        raise _changed(spec, path, what)


def _changes(ident: tuple) -> tuple[str, str | None]:
    """``(path, what changed or None)`` for one indexed identity, from one stat."""
    if not isinstance(ident, FileIdentity):  # specs made by hand may carry a plain tuple, even a shorter one
        ident = _as_identity(ident)
    return ident.path, ident.changes()


def _as_identity(ident: tuple) -> FileIdentity:
    try:
        now = FileIdentity.of(ident[0])
    except OSError:
        return FileIdentity(ident[0], *ident[1:], *(0,) * (5 - len(ident)))  # gone: ``changes`` says so
    return FileIdentity(*ident, *now[len(ident):])  # the fields it lacks are taken as they are now


def _range_of(spec: ChunkSpec, path: str) -> tuple[int | None, int | None]:
    r = next((r for r in spec.ranges if r.path == path), None)
    return (r.offset, r.nbytes) if r is not None else (None, None)


def _changed(spec: ChunkSpec, path: str, what: str) -> ChunkReadError:
    offset, nbytes = _range_of(spec, path)
    where = f"chunk {spec.index} " if spec.index else ""
    which = f"(offset {offset}, {nbytes} bytes)" if offset is not None else "(a file the chunk depends on)"
    return ChunkReadError(
        f"{where}of {path!r} {which}: the file changed since it was indexed ({what}); "
        "nothing was served from it. Call from_files again to read the file as it is now",
        path=path, offset=offset, expected=nbytes)


def _lost(spec: ChunkSpec, path: str, entry: Any) -> ChunkReadError:
    where = f"chunk {spec.index}" if spec.index else "a chunk"
    return ChunkReadError(
        f"{where} needs {path!r}, which does not exist, but the checksum manifest {entry.manifest!r} lists it "
        f"with {entry.size} bytes: the file was lost (without verify=True it would read as the fill value). "
        "Restore it, or write the manifest again with gpulazy index --checksum if its absence is intended",
        path=path, expected=entry.size)


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
