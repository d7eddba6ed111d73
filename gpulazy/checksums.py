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
catches accidents and tools, not an adversary who crafts collisions.) XXH3 hashes at
about 15 GB/s on one core and releases the GIL, so a chunk's blocks hash in parallel
threads.

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

On a GPU the hash runs on the host: the chunk's stored bytes are copied down, then
hashed.

>>> import numpy as np, os, tempfile, gpulazy
>>> d = tempfile.mkdtemp(); p = os.path.join(d, "a.raw")
>>> np.arange(1000, dtype="<u2").tofile(p)
>>> write_manifest([p], block_size=512)[0].endswith(".gpulazy-checksums.json")
True
>>> int(gpulazy.from_files(p, dtype="<u2", device="cpu", verify=True).sum().compute())
499500
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import numpy as np

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
_PARALLEL_BYTES = 8 << 20  # a chunk with more bytes than this hashes its blocks in threads
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
    digests = bytearray()
    buf = np.empty(block_size, np.uint8)
    with open(path, "rb", buffering=0) as f:
        for i in range(-(-st.st_size // block_size)):
            n = f.readinto(buf)
            if n != min(block_size, st.st_size - i * block_size):
                raise ChunkReadError(f"{path!r} changed size while its checksums were computed", path=path,
                                     offset=i * block_size)
            digests += block_hash(buf[:n])
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "block_size": block_size, ALGORITHM: digests.hex()}


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
    _run([lambda b=b: _check_block(path, entry, b, [], None, None) for b in blocks], nbytes)


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
                    _run([lambda b=b, m=meta, e=listed: _check_block(m, e, b, [], None, None)
                          for b in range(listed.nblocks)], listed.size)
            folder = os.path.dirname(folder)


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
    decodes them, once, whichever thread asks first.
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
        if isinstance(self._outcome, Exception):
            raise self._outcome
        return self._outcome


def verify_chunk(buf: Any, spec: ChunkSpec) -> None:
    """Check ``buf`` (the chunk's stored bytes as read, 1-D uint8, host or device) against checksums.

    The one check every verified read runs: the manifest's block hashes for every
    listed file the chunk reads (a crc32c-coded chunk's own checksum is its codec's to check).
    Raises ``ChunkReadError`` naming the chunk, the file and the offset on a mismatch,
    ``LayoutError`` when nothing is known to check against.
    """
    step = _crc_step(spec)
    entries = {r.path: manifest_entry(r.path) for r in spec.ranges}
    if step is None:
        for path, entry in entries.items():
            if entry is None:
                raise LayoutError(f"verify=True but no checksums are known for {path!r}: write them with "
                                  "gpulazy index --checksum")
    if any(e is not None for e in entries.values()):
        _verify_blocks(_on_host(buf), spec, entries)
    # A crc32c-coded chunk (``step``) is checked by its codec on every read, verify or not.


def _verify_blocks(host: np.ndarray, spec: ChunkSpec, entries: dict[str, _Entry | None]) -> None:
    """Hash each manifest block the chunk's ranges touch, once: the chunk's own bytes where
    it read them, the rest of the block from the file."""
    pieces: dict[tuple[str, int], list[tuple[int, int, int]]] = {}  # (path, block) -> (lo, hi, at in host)
    at = 0
    for r in spec.ranges:
        entry = entries[r.path]
        if entry is not None:
            if r.offset + r.nbytes > entry.size:
                raise _mismatch(spec, r.path, r.offset, r.nbytes, f"the manifest {entry.manifest!r} covers only "
                                f"{entry.size} bytes of it")
            for b in entry.blocks(r.offset, r.nbytes):
                start, end = entry.bounds(b)
                lo, hi = max(r.offset, start), min(r.offset + r.nbytes, end)
                pieces.setdefault((r.path, b), []).append((lo, hi, at + lo - r.offset))
        at += r.nbytes
    jobs = []
    for (path, b), ps in pieces.items():
        ps.sort()
        groups = [ps] if all(p[1] <= q[0] for p, q in zip(ps, ps[1:])) else [[p] for p in ps]  # overlaps: each alone
        jobs += [lambda path=path, b=b, g=g: _check_block(path, entries[path], b, g, host, spec) for g in groups]
    _run(jobs, sum(hi - lo for ps in pieces.values() for lo, hi, _ in ps))


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
    got, want = block_hash(*parts), entry.digest(b)
    if got != want:
        lo, hi = (pieces[0][0], pieces[-1][1]) if pieces else (start, end)
        why = (f"{ALGORITHM} {got.hex()} of bytes {start}..{end} (block {b}) differs from {want.hex()} in "
               f"{entry.manifest!r}")
        if spec is None:
            raise ChunkReadError(f"{path!r} failed verification at offset {start} ({end - start} bytes of the metadata "
                                 f"that describes or locates chunks): {why}; the file is corrupt or was changed since "
                                 "it was indexed with gpulazy index --checksum", path=path, offset=start,
                                 expected=end - start)
        raise _mismatch(spec, path, lo, hi - lo, why)


def _run(jobs: list, nbytes: int) -> None:
    """Run the block checks ``jobs``: in threads when there are many bytes (XXH3 releases the GIL).

    The threads are this call's own (starting them costs ~0.1 ms, hashing 8 MiB ~0.5 ms):
    nothing is left running between reads."""
    if len(jobs) < 2 or nbytes < _PARALLEL_BYTES:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(min(len(jobs), 8, os.cpu_count() or 2), thread_name_prefix="gpulazy-verify") as pool:
        futures = [pool.submit(job) for job in jobs]
    first = next((f.exception() for f in futures if f.exception() is not None), None)
    if first is not None:
        raise first


def _on_host(buf: Any) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    import cupyx

    flat = buf.reshape(-1).view("uint8")
    host = cupyx.empty_pinned(flat.shape, np.uint8)  # pinned: a faster copy than to pageable memory
    flat.get(out=host)
    return host


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
