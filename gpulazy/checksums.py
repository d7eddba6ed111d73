"""Checksums on demand: a hash per block of stored bytes, from a sidecar manifest, and Zarr's ``crc32c``.

``gpulazy index --checksum PATH`` (``write_manifest``) writes ``.gpulazy-checksums.json``
in a folder: for each file in it, its size and the XXH3-128 hash of every ``block_size``
bytes (the last block may be shorter). A dotfile, so reading the folder never picks it up;
a file looks for the manifest that lists it in its own folder and then in the folders
above (a Zarr store's chunk files find the store's manifest).

Why XXH3-128 and not a CRC (manifest format version 1 stored CRC32C): a CRC is affine
in the data, so any file that ends with the CRC of the bytes before it has one and the
same CRC for a given length (the CRC residue). A Zarr shard index rewritten with its
crc32c recomputed, or a crc32c-coded chunk file swapped for another of the same
length, therefore gives the CRC32C the manifest holds, and any CRC variant (another
initial value, a salt, the length appended) stays affine and keeps such a constant.
XXH3 is not linear: two different blocks agree on their 128-bit hash with
probability 2**-128, whatever their structure. (It is no cryptographic hash: it
catches accidents and tools, not an adversary who crafts collisions.)

On the host, hashing runs on every core (``gpulazy._hashing``): a chunk's blocks are cut into
jobs of a few MiB that the verify pool and the calling thread hash side by side. A chunk is
verified as its read is awaited, while the reads submitted after it are still landing, so
hashing overlaps reading.

``verify=True`` (``from_files``, ``read_file``) checks every chunk's stored bytes after they
land and before they are decoded, on every read path (``verify_chunk``, called by the
read's future, ``VerifiedRead``): each block the chunk's byte ranges touch is hashed
once, the chunk's own bytes as read plus the rest of the block read from the file.
A chunk encoded with Zarr's ``crc32c`` codec needs no manifest: that codec checks the
checksum it carries on every read, verify or not (``gpulazy.codecs``; it catches random
corruption, not a swap).
``from_files(verify=True)`` also checks, before anything is read, what decided where
the chunks' bytes are and how they decode: the blocks of each file holding bytes no
chunk reads (a shard's index, TIFF IFDs, HDF5 chunk tables), so a rewritten index cannot
point a chunk at other valid bytes, and a Zarr store's metadata files (``zarr.json``,
``.zarray``, ...; the manifest lists them although some are dotfiles). Those blocks are
skipped, with a warning, where they are most of a large file (one dataset of an HDF5
file that holds many). A mismatch raises ``ChunkReadError`` naming the chunk (if any),
the file and the offset.

On a GPU the whole blocks a chunk holds are hashed where they landed, by one kernel per
chunk, or per batch of chunks (``verify_chunks``, ``VerifiedRead.settle_many``), on the
calling thread's non-blocking gpulazy stream (``gpulazy._xxh3_gpu``; only the 16-byte
hashes come down). The rest goes to the host: blocks a chunk only cuts,
a file's last block when it is 240 bytes or fewer, and everything where the kernel is not
usable (it is checked against ``xxhash`` once per process); each job copies just its span
down, into its thread's pinned buffer, on its thread's gpulazy stream.

>>> import numpy as np, os, tempfile, gpulazy
>>> d = tempfile.mkdtemp(); p = os.path.join(d, "a.raw")
>>> np.arange(1000, dtype="<u2").tofile(p)
>>> write_manifest([p], block_size=512)[0].endswith(".gpulazy-checksums.json")
True
>>> int(gpulazy.from_files(p, dtype="<u2", device="cpu", verify=True).sum().compute())
499500
"""

from __future__ import annotations

import functools
import json
import os
import threading
import warnings
from typing import Any, Iterable, Sequence

import numpy as np

from gpulazy._hashing import digests, host_span, read_into, run, run_all, scratch, spans
from gpulazy.codecs._frames import crc32c
from gpulazy.errors import ChunkReadError, LayoutError
from gpulazy.spec import ByteRange, ChunkSpec

__all__ = ["MANIFEST_NAME", "write_manifest", "manifest_entry", "verify_chunk", "require_checksums", "crc32c",
           "block_hash", "VerifiedRead"]

MANIFEST_NAME = ".gpulazy-checksums.json"
FORMAT = "gpulazy-checksums"
VERSION = 2            # 1: CRC32C per block, which a file ending in its own CRC defeats
ALGORITHM = "xxh3_128"
DIGEST = 16            # bytes of one block's hash
DEFAULT_BLOCK = 256 << 10
_SEARCH_DEPTH = 16     # folders above a file searched for a manifest
_READ_BYTES = 1 << 20  # a job hashing a file reads this much at a time (in the core's cache as it is hashed)
# The blocks of layout metadata checked by ``from_files(verify=True)`` before anything is
# read: up to this many bytes, or this fraction of the file, whichever is more.
_METADATA_BYTES, _METADATA_FRACTION = 64 << 20, 0.25
# Files of a store that say how to read its chunk files (Zarr's; some are dotfiles, listed all the same).
_STORE_METADATA = ("zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata")


def block_hash(*parts: Any) -> bytes:
    """The manifest's hash (XXH3-128, 16 bytes) of ``parts`` (bytes or contiguous arrays) one after another."""
    import xxhash

    h = xxhash.xxh3_128()
    for part in parts:
        if len(part):
            h.update(part)
    return h.digest()


# -- writing ----------------------------------------------------------------------------

def write_manifest(paths: Any, *, block_size: int = DEFAULT_BLOCK) -> list[str]:
    """Write (or update) the checksum manifests for ``paths``; returns the manifests written.

    ``paths``: a file, a glob, a sequence of files, or a folder (every regular,
    non-hidden file under it, recursively, listed in one manifest in that folder).
    Files given otherwise go into the manifest of their own folder, merged with the
    entries already there. A manifest of an older format is replaced, not merged: its
    entries are dropped (a file it listed has no checksums until indexed again).
    """
    if int(block_size) <= 0:
        raise ValueError(f"block_size must be a positive number of bytes, got {block_size!r}")
    groups = _group(paths)
    written = []
    for folder, files in groups.items():
        manifest = os.path.join(folder, MANIFEST_NAME)
        doc = _load_for_update(manifest)
        for path in files:
            doc["files"][os.path.relpath(path, folder)] = _file_entry(path, int(block_size))
        _atomic_write(manifest, doc)
        written.append(manifest)
    return written


def _group(paths: Any) -> dict[str, list[str]]:
    if isinstance(paths, (str, os.PathLike)) and os.path.isdir(paths):
        root = os.path.abspath(paths)
        files = []
        for dirpath, dirnames, names in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            files += [os.path.join(dirpath, n) for n in sorted(names)
                      if not n.startswith(".") or n in _STORE_METADATA]
        files = [p for p in files if os.path.isfile(p)]
        if not files:
            raise LayoutError(f"folder {root!r} holds no regular (non-hidden) files to checksum")
        return {root: files}
    from gpulazy.layouts import resolve_paths

    groups: dict[str, list[str]] = {}
    for p in resolve_paths(paths):
        p = os.path.abspath(p)
        groups.setdefault(os.path.dirname(p), []).append(p)
    return groups


def _file_entry(path: str, block_size: int) -> dict:
    st = os.stat(path)
    hashes = run([functools.partial(_hash_file_span, path, st.st_size, block_size, b0, b1)
                  for b0, b1 in spans(-(-st.st_size // block_size), block_size, st.st_size)], st.st_size)
    now = os.stat(path)
    if (now.st_size, now.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
        raise ChunkReadError(f"{path!r} changed while its checksums were computed; write them again when it is "
                             "no longer being written", path=path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "block_size": block_size,
            ALGORITHM: b"".join(hashes).hex()}


def _hash_file_span(path: str, size: int, block_size: int, b0: int, b1: int) -> bytes:
    """The hashes of blocks ``b0 .. b1`` of ``path`` (``size`` bytes), read about ``_READ_BYTES``
    of whole blocks at a time into this thread's scratch buffer: hashed while still in the
    core's cache, and no fresh pages to fault in (a new 16 MiB buffer per job halved the rate)."""
    start, end = b0 * block_size, min(b1 * block_size, size)
    step = max(1, _READ_BYTES // block_size) * block_size
    buf = scratch(min(step, end - start))
    out = []
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        for at in range(start, end, step):
            n = min(step, end - at)
            got = read_into(fd, buf[:n], at)
            if got != n:
                raise ChunkReadError(f"short read of {path!r} at offset {at} while its checksums were computed: "
                                     f"expected {n} bytes, got {got}", path=path, offset=at, expected=n, got=got)
            out.append(digests(buf[:n], block_size))
    finally:
        os.close(fd)
    return b"".join(out)


def _empty() -> dict:
    return {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM, "files": {}}


def _load_for_update(manifest: str) -> dict:
    if not os.path.exists(manifest):
        return _empty()
    try:
        return _load(manifest)
    except _OldFormat:
        return _empty()


def _atomic_write(path: str, doc: dict) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # readers see the old manifest or the new one, never half of one


# -- reading ----------------------------------------------------------------------------

class _OldFormat(LayoutError):
    """A manifest written by an older gpulazy, in a format this one no longer trusts."""


class _Entry:
    """One file's checksums: ``block_size`` and the hash of each block (``digest(b)``, 16 bytes)."""

    __slots__ = ("manifest", "size", "block_size", "nblocks", "_blob")

    def __init__(self, manifest: str, raw: dict):
        self.manifest = manifest
        self.size = int(raw["size"])
        self.block_size = int(raw["block_size"])
        self._blob = bytes.fromhex(raw[ALGORITHM])
        self.nblocks = len(self._blob) // DIGEST
        if self.block_size <= 0 or len(self._blob) != DIGEST * -(-self.size // self.block_size):
            raise ValueError("block_size and the number of hashes do not match the size")

    def digest(self, b: int) -> bytes:
        return self._blob[b * DIGEST: (b + 1) * DIGEST]

    def blocks(self, offset: int, nbytes: int) -> range:
        """The blocks that bytes ``offset .. offset + nbytes`` touch."""
        return range(offset // self.block_size, -(-(offset + nbytes) // self.block_size))

    def bounds(self, b: int) -> tuple[int, int]:
        return b * self.block_size, min((b + 1) * self.block_size, self.size)


_manifests: dict[str, tuple[int, dict]] = {}
_entries: dict[tuple[str, str], tuple[dict, _Entry]] = {}  # parsed once per manifest document
_lock = threading.Lock()


def _load(manifest: str) -> dict:
    st = os.stat(manifest)
    with _lock:
        hit = _manifests.get(manifest)
        if hit is not None and hit[0] == st.st_mtime_ns:
            return hit[1]
    again = f"write it again with gpulazy index --checksum {os.path.dirname(manifest)!r}"
    try:
        with open(manifest) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
            raise ValueError(f"not a {FORMAT} manifest")
    except (OSError, ValueError) as e:
        raise LayoutError(f"cannot read the checksum manifest {manifest!r}: {e}; {again}") from e
    if doc.get("version") != VERSION or doc.get("algorithm") != ALGORITHM:
        raise _OldFormat(
            f"the checksum manifest {manifest!r} is format version {doc.get('version')!r} "
            f"({doc.get('algorithm')!r}); this gpulazy reads version {VERSION} ({ALGORITHM}: a CRC cannot tell a "
            f"file that ends in its own CRC from another of the same length); re-run gpulazy index --checksum "
            f"{os.path.dirname(manifest)!r}")
    with _lock:
        _manifests[manifest] = (st.st_mtime_ns, doc)
    return doc


def manifest_entry(path: str) -> _Entry | None:
    """The checksums listed for ``path`` (nearest manifest up its folders), or ``None``."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    for _ in range(_SEARCH_DEPTH):
        manifest = os.path.join(folder, MANIFEST_NAME)
        if os.path.exists(manifest):
            doc = _load(manifest)
            rel = os.path.relpath(path, folder)
            raw = doc["files"].get(rel)
            if raw is not None:
                hit = _entries.get((manifest, rel))
                if hit is not None and hit[0] is doc:
                    return hit[1]
                try:
                    entry = _Entry(manifest, raw)
                    _entries[(manifest, rel)] = (doc, entry)  # a file's hashes parsed once, not per chunk
                    return entry
                except (KeyError, TypeError, ValueError) as e:
                    raise LayoutError(f"the checksum manifest {manifest!r} has a bad entry for {path!r}: {e}; "
                                      f"write it again with gpulazy index --checksum") from e
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return None


def _crc_step(spec: ChunkSpec) -> int | None:
    """Where Zarr's crc32c codec sits in ``spec``'s decode steps, or ``None``."""
    for i, c in enumerate(spec.codec or ()):
        if c.id == "crc32c":
            return i
    return None


def require_checksums(specs: Iterable[ChunkSpec]) -> None:
    """Check that every chunk of ``specs`` has checksums, and verify the layout's metadata.

    Raises ``LayoutError`` for a file listed nowhere (unless its chunks carry Zarr's
    crc32c) or listed with another size, ``ChunkReadError`` when a block holding bytes no
    chunk reads (the metadata the layout parsed) differs from its hash.
    """
    entries: dict[str, _Entry] = {}
    covered: dict[str, list[tuple[int, int]]] = {}
    unlisted: set[str] = set()
    for spec in specs:
        carried = _crc_step(spec) is not None
        for r in spec.ranges:
            if r.path not in entries and r.path not in unlisted:
                entry = _listed(r.path, required=not carried)
                if entry is None:
                    unlisted.add(r.path)
                else:
                    entries[r.path] = entry
            if r.path in entries:
                covered.setdefault(r.path, []).append((r.offset, r.offset + r.nbytes))
    for path, entry in entries.items():
        _verify_metadata_blocks(path, entry, covered[path])
    _verify_store_metadata(entries)


def _listed(path: str, *, required: bool) -> _Entry | None:
    entry = manifest_entry(path)
    if entry is None:
        if required:
            raise LayoutError(f"verify=True but no checksums are known for {path!r}: write them with "
                              f"gpulazy index --checksum {os.path.dirname(os.path.abspath(path))!r}")
        return None
    size = os.stat(path).st_size
    if entry.size != size:
        raise LayoutError(f"the checksum manifest {entry.manifest!r} lists {path!r} with {entry.size} bytes "
                          f"but it has {size}: the file changed since; check it, then write the manifest "
                          "again with gpulazy index --checksum")
    return entry


def _verify_metadata_blocks(path: str, entry: _Entry, covered: list[tuple[int, int]]) -> None:
    """Hash the blocks of ``path`` that hold a byte no chunk reads: what the layout parsed.

    Chunk reads verify the bytes they read; these blocks hold what decided where those
    bytes are. Skipped, with a warning, when they are most of a large file (a dataset
    of an HDF5 file that holds many, a TIFF whose page headers sit in every block).
    """
    blocks = _uncovered_blocks(entry, covered)
    nbytes = sum(min(entry.block_size, entry.size - b * entry.block_size) for b in blocks)
    if nbytes > max(_METADATA_BYTES, _METADATA_FRACTION * entry.size):
        warnings.warn(f"gpulazy verify: {nbytes} bytes of {path!r} hold no chunk of this array (its metadata and "
                      "whatever else the file holds); only the chunks' own bytes are verified, not the metadata "
                      "that locates them", stacklevel=3)
        return
    _check_file_blocks(path, entry, blocks)


def _verify_store_metadata(entries: dict[str, _Entry]) -> None:
    """Hash the store metadata files (``zarr.json``, ``.zarray``, ...) listed in the manifests
    of ``entries``, in the folders from each chunk file's up to its manifest's."""
    folders: set[str] = set()
    for path, entry in entries.items():
        top = os.path.dirname(entry.manifest)
        folder = os.path.dirname(os.path.abspath(path))
        while folder not in folders and (folder == top or folder.startswith(top + os.sep)):
            folders.add(folder)
            for name in _STORE_METADATA:
                meta = os.path.join(folder, name)
                listed = _listed(meta, required=False) if os.path.isfile(meta) else None
                if listed is not None:  # a manifest written for chunk files only lists none
                    _check_file_blocks(meta, listed, range(listed.nblocks))
            folder = os.path.dirname(folder)


def _check_file_blocks(path: str, entry: _Entry, blocks: Sequence[int]) -> None:
    """Hash ``blocks`` (sorted) of ``path`` as the file holds them, on every core: runs of
    consecutive blocks, a job's bytes each, read in one ``pread`` per job."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    bs = entry.block_size
    nbytes = sum(min(b1 * bs, entry.size) - b0 * bs for b0, b1 in runs)
    jobs = [functools.partial(_check_file_run, path, entry, b0, b1)
            for r0, r1 in runs for b0, b1 in spans(r1 - r0, bs, nbytes, r0)]
    run(jobs, nbytes)


def _check_file_run(path: str, entry: _Entry, b0: int, b1: int) -> None:
    got = _hash_file_span(path, entry.size, entry.block_size, b0, b1)
    _compare(got, path, entry, b0, b1, None)


def _uncovered_blocks(entry: _Entry, covered: list[tuple[int, int]]) -> list[int]:
    """The blocks holding a byte outside every ``(start, end)`` of ``covered``."""
    out, at = [], 0
    for lo, hi in sorted(covered) + [(entry.size, entry.size)]:
        if lo > at:  # a gap: bytes at .. lo are read by no chunk
            out.extend(entry.blocks(at, lo - at))
        at = max(at, hi)
    return sorted(set(out))


# -- verifying --------------------------------------------------------------------------

_PENDING = object()


class VerifiedRead:
    """A read's future whose ``result()`` also verifies the bytes that landed (``verify_chunk``).

    Every read path with ``verify=True`` gets this future from ``gpulazy.io.submit_chunk``
    or ``start_chunks``, so the bytes are checked after they land and before anything
    decodes them, once, whichever thread asks first. ``settle_many`` checks the chunks of
    a batch together (on a GPU, one kernel for all of them).
    """

    __slots__ = ("future", "buf", "spec", "_lock", "_outcome")

    def __init__(self, future: Any, buf: Any, spec: ChunkSpec):
        self.future, self.buf, self.spec = future, buf, spec
        self._lock = threading.Lock()
        self._outcome: Any = _PENDING  # the byte count once verified, or the mismatch raised

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> int:
        with self._lock:
            if self._outcome is _PENDING:
                # A failed read raises here, every time (the read's future keeps its error).
                n = self.future.result() if timeout is None else self.future.result(timeout)
                try:
                    verify_chunk(self.buf, self.spec)
                except Exception as e:
                    self._outcome = e
                    raise
                self._outcome = n
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    @staticmethod
    def settle_many(reads: Sequence[VerifiedRead]) -> None:
        """Wait for each of ``reads`` and verify those that landed together (``verify_chunks``);
        their ``result()`` then returns (or raises its mismatch) at once. A read that failed
        is left to raise its error in its own ``result()``."""
        landed, counts = [], []
        for r in reads:
            if r._outcome is _PENDING:
                try:
                    counts.append(r.future.result())
                except BaseException:
                    continue
                landed.append(r)
        errors = verify_chunks([r.buf for r in landed], [r.spec for r in landed])
        for r, n, error in zip(landed, counts, errors):
            with r._lock:
                if r._outcome is _PENDING:  # (a thread in its result() may have verified it meanwhile)
                    r._outcome = error or n


def verify_chunk(buf: Any, spec: ChunkSpec) -> None:
    """Check ``buf`` (the chunk's stored bytes as read, 1-D uint8, host or device) against checksums.

    The one check every verified read runs: the manifest's block hashes for every
    listed file the chunk reads (a crc32c-coded chunk's own checksum is its codec's to check).
    Raises ``ChunkReadError`` naming the chunk, the file and the offset on a mismatch,
    ``LayoutError`` when nothing is known to check against.
    """
    error = verify_chunks([buf], [spec])[0]
    if error is not None:
        raise error


def verify_chunks(bufs: Sequence[Any], specs: Sequence[ChunkSpec]) -> list[BaseException | None]:
    """``verify_chunk`` for many chunks at once; each chunk's error (``None``: verified), not raised.

    Every block of every chunk is hashed in one go: on a GPU, one kernel for the whole
    blocks of all the chunks; on the host, one set of jobs on every core.
    """
    errors: list[BaseException | None] = [None] * len(specs)
    plans = []
    for k, (buf, spec) in enumerate(zip(bufs, specs)):
        try:
            entries = _entries_to_check(spec)
            if entries:
                plans.append(_plan(k, buf.reshape(-1).view(np.uint8), spec, entries))
        except Exception as e:
            errors[k] = e
    for k, e in _check_on_device([p for p in plans if not isinstance(p.flat, np.ndarray)]):
        errors[k] = e
    jobs, owners, nbytes = [], [], 0
    for plan in plans:
        if errors[plan.k] is None:
            mine, n = _host_jobs(plan)
            jobs += mine
            owners += [plan.k] * len(mine)
            nbytes += n
    for k, e in zip(owners, run_all(jobs, nbytes)[1]):
        if e is not None and errors[k] is None:  # a chunk's first failing job, in order
            errors[k] = e
    return errors


def _entries_to_check(spec: ChunkSpec) -> dict[str, _Entry | None]:
    """The manifest entry of each file ``spec`` reads; ``{}`` when none is listed and the chunk
    carries Zarr's crc32c (its codec checks it on every read, verify or not)."""
    entries = {r.path: manifest_entry(r.path) for r in spec.ranges}
    if _crc_step(spec) is None:
        for path, entry in entries.items():
            if entry is None:
                raise LayoutError(f"verify=True but no checksums are known for {path!r}: write them with "
                                  "gpulazy index --checksum")
    return entries if any(e is not None for e in entries.values()) else {}


class _Plan:
    """What checking one chunk takes: ``runs`` of blocks its ranges hold whole, ``(path, entry,
    b0, b1, at in flat of block b0)``, and ``edges``, the blocks they only cut, ``(path, block)
    -> [(lo, hi, at in flat)]``."""

    __slots__ = ("k", "flat", "spec", "entries", "runs", "edges")

    def __init__(self, k: int, flat: Any, spec: ChunkSpec, entries: dict[str, _Entry | None]):
        self.k, self.flat, self.spec, self.entries = k, flat, spec, entries
        self.runs: list[tuple[str, _Entry, int, int, int]] = []
        self.edges: dict[tuple[str, int], list[tuple[int, int, int]]] = {}


def _plan(k: int, flat: Any, spec: ChunkSpec, entries: dict[str, _Entry | None]) -> _Plan:
    """The blocks chunk ``spec`` touches, each once. ``flat`` (1-D uint8, host or device) holds
    the ranges' bytes one after another."""
    plan = _Plan(k, flat, spec, entries)
    at = 0
    for r in spec.ranges:
        entry = entries[r.path]
        if entry is not None:
            if r.offset + r.nbytes > entry.size:
                raise _mismatch(spec, r.path, r.offset, r.nbytes, f"the manifest {entry.manifest!r} covers only "
                                f"{entry.size} bytes of it")
            whole0, whole1 = _whole_blocks(entry, r.offset, r.nbytes)
            if whole1 > whole0:
                plan.runs.append((r.path, entry, whole0, whole1, at + whole0 * entry.block_size - r.offset))
            for b in entry.blocks(r.offset, r.nbytes):
                if not whole0 <= b < whole1:
                    start, end = entry.bounds(b)
                    lo, hi = max(r.offset, start), min(r.offset + r.nbytes, end)
                    plan.edges.setdefault((r.path, b), []).append((lo, hi, at + lo - r.offset))
        at += r.nbytes
    return plan


def _host_jobs(plan: _Plan) -> tuple[list, int]:
    """The host's jobs for ``plan`` and the bytes they hash: its runs (those the GPU left) cut
    into jobs of about ``gpulazy._hashing.JOB_BYTES`` (``_check_run``), one job per edge block (``_check_edge``:
    the chunk's bytes of it from ``flat``, the rest from the file)."""
    jobs, nbytes = [], 0
    for path, entry, w0, w1, first in plan.runs:
        run_bytes = entry.bounds(w1 - 1)[1] - entry.bounds(w0)[0]
        for b0, b1 in spans(w1 - w0, entry.block_size, run_bytes, w0):
            jobs.append(functools.partial(_check_run, plan.flat, plan.spec, path, entry, b0, b1,
                                          first + (b0 - w0) * entry.block_size))
        nbytes += run_bytes
    for (path, b), ps in plan.edges.items():
        ps.sort()
        groups = [ps] if all(p[1] <= q[0] for p, q in zip(ps, ps[1:])) else [[p] for p in ps]  # overlaps: each alone
        jobs += [functools.partial(_check_edge, plan.flat, plan.spec, path, plan.entries[path], b, g) for g in groups]
        nbytes += sum(hi - lo for lo, hi, _ in ps)
    return jobs, nbytes


def _check_on_device(plans: list[_Plan]) -> list[tuple[int, BaseException]]:
    """Hash the whole blocks of ``plans`` (chunks in CuPy buffers) where they landed, one kernel
    per device for all of them (``gpulazy._xxh3_gpu``), and compare the 16-byte hashes that
    come down; each plan keeps the runs left to the host (``_device_plan``: all of them where
    the kernel is not usable). Returns ``(chunk, error)`` for each chunk with a mismatch."""
    from gpulazy import _xxh3_gpu

    errors: list[tuple[int, BaseException]] = []
    for device_index in sorted({p.flat.device.id for p in plans}):
        mine = [p for p in plans if p.flat.device.id == device_index and p.runs]
        if not mine or not _xxh3_gpu.usable(device_index):
            continue
        from gpulazy.device import Device, gpulazy_stream

        work, ptrs, lengths = [], [], []
        for plan in mine:
            on_device, starts, n, plan.runs = _device_plan(plan.runs, _xxh3_gpu.MIN_BYTES)
            work.append((plan, on_device))
            ptrs.append(plan.flat.data.ptr + starts.astype(np.uint64))
            lengths.append(n)
        got = _xxh3_gpu.block_digests(device_index, np.concatenate(ptrs), np.concatenate(lengths),
                                      gpulazy_stream(Device("cuda", device_index)))
        at = 0
        for plan, on_device in work:
            for path, entry, b0, b1 in on_device:
                try:
                    _compare(got[at * DIGEST: (at + b1 - b0) * DIGEST], path, entry, b0, b1, plan.spec)
                except ChunkReadError as e:
                    if all(k != plan.k for k, _ in errors):
                        errors.append((plan.k, e))
                at += b1 - b0
    return errors


def _device_plan(runs: list, min_bytes: int) -> tuple[list, np.ndarray, np.ndarray, list]:
    """``(on_device, starts, lengths, left)``: the blocks of ``runs`` (``(path, entry, b0, b1, at)``)
    the kernel hashes, as ``(path, entry, b0, b1)`` with each block's start in the buffer and
    length, in order; and the runs left to the host: blocks shorter than ``min_bytes`` (a
    file's last block; every block of a manifest of tiny blocks)."""
    on_device, left, starts, lengths = [], [], [], []
    for path, entry, b0, b1, at in runs:
        if entry.block_size < min_bytes:
            left.append((path, entry, b0, b1, at))
            continue
        last = entry.bounds(b1 - 1)
        if last[1] - last[0] < min_bytes:
            left.append((path, entry, b1 - 1, b1, at + (b1 - 1 - b0) * entry.block_size))
            b1 -= 1
        if b1 > b0:
            offsets = np.arange(b1 - b0, dtype=np.int64) * entry.block_size
            starts.append(at + offsets)
            lengths.append(np.minimum(entry.block_size, entry.size - b0 * entry.block_size - offsets))
            on_device.append((path, entry, b0, b1))
    empty = np.zeros(0, np.int64)
    return on_device, np.concatenate(starts or [empty]), np.concatenate(lengths or [empty]), left


def _whole_blocks(entry: _Entry, offset: int, nbytes: int) -> tuple[int, int]:
    """``(b0, b1)``: the blocks that bytes ``offset .. offset + nbytes`` hold whole (``b0 == b1``: none)."""
    b0 = -(-offset // entry.block_size)
    end = offset + nbytes
    b1 = entry.nblocks if end == entry.size else end // entry.block_size  # the file's last block may be shorter
    return b0, max(b0, b1)


def _check_run(flat: Any, spec: ChunkSpec, path: str, entry: _Entry, b0: int, b1: int, at: int) -> None:
    """Hash blocks ``b0 .. b1`` of ``path``, held whole in ``flat`` from ``at`` on."""
    start, end = entry.bounds(b0)[0], entry.bounds(b1 - 1)[1]
    _compare(digests(host_span(flat, at, at + end - start), entry.block_size), path, entry, b0, b1, spec)


def _compare(got: bytes, path: str, entry: _Entry, b0: int, b1: int, spec: ChunkSpec | None) -> None:
    """Raise ``_block_error`` for the first of blocks ``b0 .. b1`` whose hash (in ``got``, joined) differs."""
    want = entry._blob[b0 * DIGEST: b1 * DIGEST]
    if got != want:
        i = next(i for i in range(b1 - b0) if got[i * DIGEST: (i + 1) * DIGEST] != want[i * DIGEST: (i + 1) * DIGEST])
        lo, hi = entry.bounds(b0 + i)
        raise _block_error(path, entry, b0 + i, got[i * DIGEST: (i + 1) * DIGEST], lo, hi, spec)


def _check_edge(flat: Any, spec: ChunkSpec, path: str, entry: _Entry, b: int,
                pieces: Sequence[tuple[int, int, int]]) -> None:
    """``_check_block`` for a block the chunk holds only pieces of: just those pieces' span of ``flat``
    comes to the host."""
    lo = min(at for _, _, at in pieces)
    hi = max(at + h - l for l, h, at in pieces)
    _check_block(path, entry, b, [(l, h, at - lo) for l, h, at in pieces], host_span(flat, lo, hi), spec)


def _check_block(path: str, entry: _Entry, b: int, pieces: Sequence[tuple[int, int, int]], host: Any,
                 spec: ChunkSpec | None) -> None:
    """Hash block ``b`` of ``path``: ``pieces`` (file bytes ``lo .. hi`` at ``host[at:]``, sorted,
    disjoint) from the buffer, the bytes between and around them read from the file."""
    start, end = entry.bounds(b)
    parts, cursor = [], start
    for lo, hi, at in pieces:
        if lo > cursor:
            parts.append(_pread(path, cursor, lo - cursor))
        parts.append(host[at: at + hi - lo])
        cursor = hi
    if cursor < end:
        parts.append(_pread(path, cursor, end - cursor))
    got = block_hash(*parts)
    if got != entry.digest(b):
        lo, hi = (pieces[0][0], pieces[-1][1]) if pieces else (start, end)
        raise _block_error(path, entry, b, got, lo, hi, spec)


def _block_error(path: str, entry: _Entry, b: int, got: bytes, lo: int, hi: int, spec: ChunkSpec | None
                 ) -> ChunkReadError:
    """The mismatch of block ``b`` of ``path``, whose bytes ``lo .. hi`` the chunk ``spec`` read
    (``None``: bytes no chunk reads, the layout's metadata)."""
    start, end = entry.bounds(b)
    why = (f"{ALGORITHM} {got.hex()} of bytes {start}..{end} (block {b}) differs from {entry.digest(b).hex()} in "
           f"{entry.manifest!r}")
    if spec is None:
        return ChunkReadError(f"{path!r} failed verification at offset {start} ({end - start} bytes of the metadata "
                              f"that describes or locates chunks): {why}; the file is corrupt or was changed since "
                              "it was indexed with gpulazy index --checksum", path=path, offset=start,
                              expected=end - start)
    return _mismatch(spec, path, lo, hi - lo, why)


def _pread(path: str, offset: int, nbytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        data = os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)
    if len(data) != nbytes:
        raise ChunkReadError(f"short read of {path!r} at offset {offset} while verifying: expected {nbytes} bytes, "
                             f"got {len(data)}", path=path, offset=offset, expected=nbytes, got=len(data))
    return data


def _mismatch(spec: ChunkSpec, path: str, offset: int, nbytes: int, why: str) -> ChunkReadError:
    where = f"chunk {spec.index}" if spec.index else "a chunk"
    return ChunkReadError(f"{where} of {path!r} failed verification at offset {offset} ({nbytes} bytes): {why}; "
                          "the file is corrupt or the read was", path=path, offset=offset, expected=nbytes)
