"""Checksums on demand: CRC32C of stored bytes, from a sidecar manifest or Zarr's ``crc32c`` codec.

``gpulazy index --checksum PATH`` (``write_manifest``) writes ``.gpulazy-checksums.json``
in a folder: for each file in it, its size and the CRC32C of every ``block_size`` bytes
(the last block may be shorter). A dotfile, so reading the folder never picks it up;
a file looks for the manifest that lists it in its own folder and then in the folders
above (a Zarr store's chunk files find the store's manifest).

``verify=True`` (``from_files``, ``read_file``) checks every chunk's stored bytes before
they are decoded (``verify_chunk``): each block a byte range overlaps is checked, the
range's own bytes as read plus, for a block the range covers only in part, the rest of
that block read on the host (at most two blocks per range); a stored chunk encoded
with Zarr's ``crc32c`` codec is checked against the checksum it carries. A mismatch raises
``ChunkReadError`` naming the chunk, the file and the offset.

On a GPU the chunk's bytes are hashed where they are, by CuPy kernels
(``gpulazy._crc32c_cuda``: every 4 KiB piece in parallel, folded per block), checked once
per process against google-crc32c; where they do not compile or disagree, the bytes are
copied to the host and hashed there (google-crc32c, about 9 GB/s on one core), with a
warning. On the host the CRC32C is google-crc32c's (installed with zarr), which uses the
CPU's crc32 instruction.

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
from typing import Any, Iterable, Sequence

import numpy as np

from gpulazy.errors import ChunkReadError, LayoutError
from gpulazy.spec import ByteRange, ChunkSpec

__all__ = ["MANIFEST_NAME", "write_manifest", "manifest_entry", "verify_chunk", "require_checksums", "crc32c"]

MANIFEST_NAME = ".gpulazy-checksums.json"
FORMAT = "gpulazy-checksums"
DEFAULT_BLOCK = 256 << 10
_SEARCH_DEPTH = 16  # folders above a file searched for a manifest


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C of ``data`` (bytes or a contiguous NumPy array), continuing from ``crc``."""
    import google_crc32c

    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8)
    return google_crc32c.extend(crc, data)


# -- writing ----------------------------------------------------------------------------

def write_manifest(paths: Any, *, block_size: int = DEFAULT_BLOCK) -> list[str]:
    """Write (or update) the checksum manifests for ``paths``; returns the manifests written.

    ``paths``: a file, a glob, a sequence of files, or a folder (every regular,
    non-hidden file under it, recursively, listed in one manifest in that folder).
    Files given otherwise go into the manifest of their own folder, merged with the
    entries already there.
    """
    if int(block_size) <= 0:
        raise ValueError(f"block_size must be a positive number of bytes, got {block_size!r}")
    groups = _group(paths)
    written = []
    for folder, files in groups.items():
        manifest = os.path.join(folder, MANIFEST_NAME)
        doc = _load(manifest) if os.path.exists(manifest) else _empty()
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
            files += [os.path.join(dirpath, n) for n in sorted(names) if not n.startswith(".")]
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
    crcs = np.empty(-(-st.st_size // block_size), dtype="<u4")
    buf = np.empty(block_size, np.uint8)
    with open(path, "rb", buffering=0) as f:
        for i in range(len(crcs)):
            n = f.readinto(buf)
            if n != min(block_size, st.st_size - i * block_size):
                raise ChunkReadError(f"{path!r} changed size while its checksums were computed", path=path,
                                     offset=i * block_size)
            crcs[i] = crc32c(buf[:n])
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "block_size": block_size, "crc32c": crcs.tobytes().hex()}


def _empty() -> dict:
    return {"format": FORMAT, "version": 1, "algorithm": "crc32c", "files": {}}


def _atomic_write(path: str, doc: dict) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # readers see the old manifest or the new one, never half of one


# -- reading ----------------------------------------------------------------------------

class _Entry:
    """One file's checksums: ``block_size`` and the CRC32C of each block."""

    __slots__ = ("manifest", "size", "block_size", "crcs")

    def __init__(self, manifest: str, raw: dict):
        self.manifest = manifest
        self.size = int(raw["size"])
        self.block_size = int(raw["block_size"])
        self.crcs = np.frombuffer(bytes.fromhex(raw["crc32c"]), dtype="<u4")
        if self.block_size <= 0 or len(self.crcs) != -(-self.size // self.block_size):
            raise ValueError("block_size and the number of checksums do not match the size")


_manifests: dict[str, tuple[int, dict]] = {}
_lock = threading.Lock()


def _load(manifest: str) -> dict:
    st = os.stat(manifest)
    with _lock:
        hit = _manifests.get(manifest)
        if hit is not None and hit[0] == st.st_mtime_ns:
            return hit[1]
    try:
        with open(manifest) as f:
            doc = json.load(f)
        if doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
            raise ValueError(f"not a {FORMAT} manifest")
    except (OSError, ValueError) as e:
        raise LayoutError(f"cannot read the checksum manifest {manifest!r}: {e}; write it again with "
                          f"gpulazy index --checksum {os.path.dirname(manifest)!r}") from e
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
            raw = _load(manifest)["files"].get(os.path.relpath(path, folder))
            if raw is not None:
                try:
                    return _Entry(manifest, raw)
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
    """Raise ``LayoutError`` unless every chunk of ``specs`` has checksums to verify against."""
    seen: set[str] = set()
    for spec in specs:
        if _crc_step(spec) is not None:
            continue
        for path in spec.paths:
            if path in seen:
                continue
            entry = manifest_entry(path)
            if entry is None:
                raise LayoutError(f"verify=True but no checksums are known for {path!r}: write them with "
                                  f"gpulazy index --checksum {os.path.dirname(os.path.abspath(path))!r}")
            size = os.stat(path).st_size
            if entry.size != size:
                raise LayoutError(f"the checksum manifest {entry.manifest!r} lists {path!r} with {entry.size} bytes "
                                  f"but it has {size}: the file changed since; check it, then write the manifest "
                                  "again with gpulazy index --checksum")
            seen.add(path)


# -- verifying --------------------------------------------------------------------------

def verify_chunk(buf: Any, spec: ChunkSpec) -> None:
    """Check ``buf`` (the chunk's stored bytes as read, 1-D uint8, host or device) against checksums.

    Raises ``ChunkReadError`` naming the chunk, the file and the offset on a mismatch,
    ``LayoutError`` when nothing is known to check against.
    """
    step = _crc_step(spec)
    on_gpu = not isinstance(buf, np.ndarray) and _gpu_kernel_ok(buf)
    if step is not None and step > 0:  # steps to decode before the checksum: on the host
        _verify_codec(_on_host(buf)[: spec.nbytes], spec, step)
        return
    checks = _codec_checks(buf, spec) if step is not None else _manifest_checks(spec)
    if on_gpu:
        from gpulazy._crc32c_cuda import segment_crcs

        crcs = segment_crcs(buf, *(np.array([getattr(c, f) for c in checks]) for f in ("start", "length", "init")))
    else:
        host = _on_host(buf)
        crcs = [crc32c(host[c.start: c.start + c.length], c.init) for c in checks]
    for check, crc in zip(checks, crcs):
        crc = crc32c(check.suffix, int(crc)) if check.suffix else int(crc)
        if crc != check.expected:
            raise _mismatch(spec, check.path, check.offset, check.length, check.why(crc))


def _on_host(buf: Any) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return buf.reshape(-1).view("uint8").get()  # CuPy without a usable kernel: hashed on the host


def _gpu_kernel_ok(buf: Any) -> bool:
    from gpulazy._crc32c_cuda import usable

    return usable(int(buf.device.id))


class _Check:
    """``length`` bytes of the buffer from ``start``, hashed from ``init`` then over ``suffix``, must give ``expected``."""

    __slots__ = ("start", "length", "init", "suffix", "expected", "path", "offset", "why")

    def __init__(self, start, length, init, suffix, expected, path, offset, why):
        self.start, self.length, self.init, self.suffix = start, length, init, suffix
        self.expected, self.path, self.offset, self.why = expected, path, offset, why


def _manifest_checks(spec: ChunkSpec) -> list[_Check]:
    """One check per manifest block each range overlaps; the parts of a block outside the range
    are read on the host (``_pread``), at most two per range."""
    checks, at = [], 0
    for r in spec.ranges:
        entry = manifest_entry(r.path)
        if entry is None:
            raise LayoutError(f"verify=True but no checksums are known for {r.path!r}: write them with "
                              "gpulazy index --checksum")
        if r.offset + r.nbytes > entry.size:
            raise _mismatch(spec, r.path, r.offset, r.nbytes, f"the manifest {entry.manifest!r} covers only "
                            f"{entry.size} bytes of it")
        bs = entry.block_size
        for b in range(r.offset // bs, -(-(r.offset + r.nbytes) // bs)):
            start, end = b * bs, min((b + 1) * bs, entry.size)
            lo, hi = max(r.offset, start), min(r.offset + r.nbytes, end)
            init = crc32c(_pread(r.path, start, lo - start)) if lo > start else 0
            suffix = _pread(r.path, hi, end - hi) if hi < end else b""
            want = int(entry.crcs[b])
            checks.append(_Check(at + lo - r.offset, hi - lo, init, suffix, want, r.path, lo,
                                 lambda crc, start=start, end=end, b=b, want=want, m=entry.manifest:
                                 f"CRC32C 0x{crc:08x} of bytes {start}..{end} (block {b}) differs from "
                                 f"0x{want:08x} in {m!r}"))
        at += r.nbytes
    return checks


def _codec_checks(buf: Any, spec: ChunkSpec) -> list[_Check]:
    """Zarr's crc32c as the first decode step: each stored piece's last 4 bytes are its CRC32C."""
    segments = spec.tile_segments() if spec.tiles else [(None, 0, spec.nbytes)]
    ranges = [tile.range if tile is not None else spec.ranges[0] for tile, _, _ in segments]
    for r, (_, _, n) in zip(ranges, segments):
        if n < 4:
            raise _too_short(spec, r, n)
    flat = buf.reshape(-1).view("uint8")
    index = [start + n - 4 + i for _, start, n in segments for i in range(4)]
    stored = _on_host(flat[index]) if index else np.zeros(0, np.uint8)  # one small copy from a GPU
    checks = []
    for k, (r, (_, start, n)) in enumerate(zip(ranges, segments)):
        want = int(stored[4 * k: 4 * k + 4].view("<u4")[0])
        checks.append(_Check(start, n - 4, 0, b"", want, r.path, r.offset, lambda crc, want=want: _carried(crc, want)))
    return checks


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


def _verify_codec(host: np.ndarray, spec: ChunkSpec, step: int) -> None:
    """Each stored piece's embedded crc32c (the 4 little-endian bytes Zarr appends), after the
    decode steps that come before it."""
    segments = spec.tile_segments() if spec.tiles else [(None, 0, spec.nbytes)]
    for tile, start, n in segments:
        r = tile.range if tile is not None else spec.ranges[0]
        data = _decode_steps(host[start: start + n], spec.codec[:step], r, spec)
        if data.size < 4:
            raise _too_short(spec, r, data.size)
        stored = int(data[-4:].view("<u4")[0])
        crc = crc32c(data[:-4])
        if crc != stored:
            raise _mismatch(spec, r.path, r.offset, r.nbytes, _carried(crc, stored))


def _carried(crc: int, stored: int) -> str:
    return f"CRC32C 0x{crc:08x} of the stored chunk differs from the 0x{stored:08x} it carries (Zarr crc32c codec)"


def _too_short(spec: ChunkSpec, r: ByteRange, n: int) -> ChunkReadError:
    return _mismatch(spec, r.path, r.offset, r.nbytes, f"a crc32c-encoded piece of {n} bytes cannot hold its "
                     "4-byte checksum")


def _decode_steps(data: np.ndarray, steps: Sequence[Any], r: ByteRange, spec: ChunkSpec) -> np.ndarray:
    # Steps before crc32c in decode order (rare: Zarr appends the checksum last when
    # encoding, so it is usually checked first): decoded here once more, on the host.
    if not steps:
        return data
    from gpulazy.codecs import host

    try:
        for c in steps:
            data = host._as_bytes(host._build(c).decode(data))
    except Exception as e:
        raise _mismatch(spec, r.path, r.offset, r.nbytes, f"cannot decode it up to its crc32c step: {e}") from e
    return data


def _mismatch(spec: ChunkSpec, path: str, offset: int, nbytes: int, why: str) -> ChunkReadError:
    where = f"chunk {spec.index}" if spec.index else "a chunk"
    return ChunkReadError(f"{where} of {path!r} failed verification at offset {offset} ({nbytes} bytes): {why}; "
                          "the file is corrupt or the read was", path=path, offset=offset, expected=nbytes)
