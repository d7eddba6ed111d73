"""Seeded mutations of a small sample on disk: one ``random.Random`` per (format, seed).

A ``Sample`` (built by ``formats.py``) says where its files are and what is inside them:
the stored chunk pieces (``Region``), the numeric header fields (``Field``), the metadata
files, the chunk files, and how to store a re-encoded piece. ``mutate(sample, rng)``
applies one mutation to the files in place and returns a ``Mutation`` whose description
is enough to see what was done (it is printed with every failure).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class Region:
    """One stored chunk piece: ``nbytes`` at ``offset`` of ``file``, decoding to ``elements`` values."""

    file: str  # relative to the sample's root
    offset: int
    nbytes: int
    elements: int
    name: str


@dataclass(frozen=True)
class Field:
    """One numeric header field: an unsigned ``size``-byte integer at ``offset`` of ``file``."""

    file: str
    offset: int
    size: int
    byteorder: str  # "little" or "big"
    name: str


@dataclass
class Sample:
    """A pristine sample of one format and what the mutations may aim at."""

    fmt: str
    variant: str
    root: Path
    target: str  # what from_files is given
    data: np.ndarray  # the pristine array, as the reference reader reads it
    regions: list[Region] = field(default_factory=list)
    fields: list[Field] = field(default_factory=list)
    meta_files: list[str] = field(default_factory=list)  # JSON metadata (Zarr)
    chunk_files: list[str] = field(default_factory=list)  # one file per chunk or shard (Zarr)
    header_end: int = 0  # bytes of header at the start of a single-file format (0: unknown)
    encode: Callable[[np.ndarray], bytes] | None = None  # a valid stored encoding of these elements
    store: Callable[["Sample", Region, bytes, random.Random], str | None] | None = None  # put a piece in place
    extra: list[Callable[["Sample", random.Random], "Mutation | None"]] = field(default_factory=list)
    read_kw: dict[str, Any] = field(default_factory=dict)
    piece_fields: list[tuple[Field, Field]] = field(default_factory=list)  # each piece's offset, byte count fields

    def path(self, rel: str) -> Path:
        return self.root / rel

    def files(self) -> list[str]:
        out = []
        for dirpath, dirnames, names in os.walk(self.root):
            dirnames.sort()
            out += [os.path.relpath(os.path.join(dirpath, n), self.root) for n in sorted(names)
                    if not n.startswith((".gpulazy", ".swap"))]  # the checksum manifest is no part of the sample
        return out


@dataclass(frozen=True)
class Mutation:
    """What was done. ``meta_only``: only files no chunk is read from changed (a checksum
    manifest cannot notice it through ``verify=True``)."""

    kind: str
    description: str
    meta_only: bool = False


# -- bytes ------------------------------------------------------------------------------

def read(sample: Sample, rel: str) -> bytearray:
    return bytearray(sample.path(rel).read_bytes())


def write(sample: Sample, rel: str, blob: bytes) -> None:
    sample.path(rel).write_bytes(bytes(blob))


def _pick_file(sample: Sample, rng: random.Random) -> str:
    files = [f for f in sample.files() if os.path.getsize(sample.path(f)) > 0]
    return rng.choice(files)


def _is_meta(sample: Sample, rel: str) -> bool:
    return rel in sample.meta_files


def _position(sample: Sample, rel: str, size: int, rng: random.Random) -> int:
    """Anywhere, the header half the time (where the parsers are), a stored piece otherwise."""
    roll = rng.random()
    if roll < 0.4 and sample.header_end and not sample.chunk_files:
        return rng.randrange(min(size, sample.header_end))
    pieces = [r for r in sample.regions if r.file == rel and r.nbytes]
    if roll < 0.7 and pieces:
        r = rng.choice(pieces)
        return r.offset + rng.randrange(r.nbytes)
    return rng.randrange(size)


def bit_flips(sample: Sample, rng: random.Random) -> Mutation:
    rel = _pick_file(sample, rng)
    blob = read(sample, rel)
    flips = []
    for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
        at, bit = _position(sample, rel, len(blob), rng), rng.randrange(8)
        blob[at] ^= 1 << bit
        flips.append(f"{at}.{bit}")
    write(sample, rel, blob)
    return Mutation("bitflip", f"flip bit(s) {','.join(flips)} (byte.bit) of {rel}", _is_meta(sample, rel))


def overwrite(sample: Sample, rng: random.Random) -> Mutation:
    rel = _pick_file(sample, rng)
    blob = read(sample, rel)
    at = _position(sample, rel, len(blob), rng)
    new = rng.choice([bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))), b"\x00" * rng.randint(1, 64),
                      b"\xff" * rng.randint(1, 8)])
    blob[at: at + len(new)] = new
    write(sample, rel, blob)
    return Mutation("overwrite", f"overwrite {len(new)} byte(s) at {at} of {rel} with {new[:8].hex()}",
                    _is_meta(sample, rel))


def insert_or_delete(sample: Sample, rng: random.Random) -> Mutation:
    rel = _pick_file(sample, rng)
    blob = read(sample, rel)
    at, n = _position(sample, rel, len(blob), rng), rng.choice([1, 2, 4, 8, 100])
    if rng.random() < 0.5:
        blob[at:at] = bytes(rng.randrange(256) for _ in range(n))
        what = f"insert {n} byte(s) at {at}"
    else:
        del blob[at: at + n]
        what = f"delete {n} byte(s) at {at}"
    write(sample, rel, blob)
    return Mutation("shift", f"{what} of {rel}", _is_meta(sample, rel))


def truncate(sample: Sample, rng: random.Random) -> Mutation:
    rel = _pick_file(sample, rng)
    size = os.path.getsize(sample.path(rel))
    at = rng.choice([0, rng.randrange(size), size - 1, max(0, size - rng.randint(1, 16)),
                     _position(sample, rel, size, rng)])
    os.truncate(sample.path(rel), at)
    return Mutation("truncate", f"truncate {rel} from {size} to {at} bytes", _is_meta(sample, rel))


def append(sample: Sample, rng: random.Random) -> Mutation:
    rel = _pick_file(sample, rng)
    extra = bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 512])))
    with open(sample.path(rel), "ab") as f:
        f.write(extra)
    return Mutation("append", f"append {len(extra)} garbage byte(s) to {rel}", _is_meta(sample, rel))


def boundary_values(value: int, size: int, rng: random.Random, file_size: int) -> list[int]:
    top = (1 << (8 * size)) - 1
    cands = [0, 1, value - 1, value + 1, value * 2, value // 2, top, top >> 1, (top >> 1) + 1, file_size,
             file_size + 1, file_size - 1, rng.randrange(max(1, file_size)), rng.randrange(top + 1), value + 4096,
             value ^ (1 << rng.randrange(8 * size))]
    return [c & top for c in cands if c >= 0]


def set_field(sample: Sample, rng: random.Random) -> Mutation | None:
    if not sample.fields:
        return None
    f = rng.choice(sample.fields)
    blob = read(sample, f.file)
    if f.offset + f.size > len(blob):
        return None
    old = int.from_bytes(blob[f.offset: f.offset + f.size], f.byteorder)
    new = rng.choice(boundary_values(old, f.size, rng, len(blob)))
    blob[f.offset: f.offset + f.size] = new.to_bytes(f.size, f.byteorder)
    write(sample, f.file, blob)
    return Mutation("field", f"set {f.name} ({f.size}-byte field at {f.offset} of {f.file}) from {old} to {new}",
                    _is_meta(sample, f.file))


def swap_regions(sample: Sample, rng: random.Random) -> Mutation | None:
    """Two stored pieces of one size trade places (each is valid, in the wrong place)."""
    by_size: dict[int, list[Region]] = {}
    for r in sample.regions:
        by_size.setdefault(r.nbytes, []).append(r)
    groups = [g for g in by_size.values() if len(g) > 1]
    if not groups:
        return None
    a, b = rng.sample(rng.choice(groups), 2)
    blob_a, blob_b = read(sample, a.file), read(sample, b.file)
    piece_a, piece_b = bytes(blob_a[a.offset: a.offset + a.nbytes]), bytes(blob_b[b.offset: b.offset + b.nbytes])
    blob_a[a.offset: a.offset + a.nbytes] = piece_b
    write(sample, a.file, blob_a)
    blob_b = read(sample, b.file)  # the same file, maybe
    blob_b[b.offset: b.offset + b.nbytes] = piece_a
    write(sample, b.file, blob_b)
    return Mutation("swap-pieces", f"swap the stored pieces {a.name} and {b.name} ({a.nbytes} bytes each)")


def swap_keeping_mtime(sample: Sample, rng: random.Random) -> Mutation | None:
    """``swap_regions``, then each changed file's mtime set back (``touch -r``, ``rsync -t``, ``cp -p``):
    same path, size and mtime, other bytes."""
    stamps = {rel: os.stat(sample.path(rel)).st_mtime_ns for rel in sample.files()}
    m = swap_regions(sample, rng)
    if m is None:
        return None
    for rel, ns in stamps.items():
        if os.path.exists(sample.path(rel)):
            os.utime(sample.path(rel), ns=(ns, ns))
    return Mutation("swap-keep-mtime", m.description + ", mtimes set back")


def reencode(sample: Sample, rng: random.Random) -> Mutation | None:
    """A piece replaced by a valid encoding of fewer or more elements than it holds."""
    if sample.encode is None or sample.store is None or not sample.regions:
        return None
    r = rng.choice(sample.regions)
    n = rng.choice([0, 1, r.elements - 1, r.elements // 2, r.elements + 1, r.elements * 2, r.elements + 64])
    values = np.resize(sample.data.reshape(-1), max(n, 0))[::-1].copy()
    where = sample.store(sample, r, sample.encode(values), rng)
    if where is None:
        return None
    return Mutation("reencode", f"piece {r.name} ({r.elements} elements) replaced by a valid encoding of {n} "
                    f"elements ({where})")


def delete_chunk_file(sample: Sample, rng: random.Random) -> Mutation | None:
    if not sample.chunk_files:
        return None
    rel = rng.choice(sample.chunk_files)
    os.remove(sample.path(rel))
    return Mutation("delete-chunk", f"delete the chunk file {rel}")


def empty_chunk_file(sample: Sample, rng: random.Random) -> Mutation | None:
    if not sample.chunk_files:
        return None
    rel = rng.choice(sample.chunk_files)
    os.truncate(sample.path(rel), 0)
    return Mutation("empty-chunk", f"empty the chunk file {rel}")


def swap_chunk_files(sample: Sample, rng: random.Random) -> Mutation | None:
    """Two chunk files renamed into each other's place (mtimes kept, as ``mv`` keeps them)."""
    if len(sample.chunk_files) < 2:
        return None
    a, b = rng.sample(sample.chunk_files, 2)
    tmp = sample.path(a).with_name(".swap")
    os.replace(sample.path(a), tmp)
    os.replace(sample.path(b), sample.path(a))
    os.replace(tmp, sample.path(b))
    return Mutation("swap-chunks", f"swap the chunk files {a} and {b} (renamed)")


# -- JSON metadata ----------------------------------------------------------------------

_STRINGS = ["<u2", ">u2", "<i2", "<u4", "<f4", "<f8", "|u1", "|b1", "<U4", "|O", "bool", "uint16", "int64", "float32",
            "C", "F", "end", "start", "zstd", "blosc", "gzip", "lz4", "bytes", "crc32c", "", "x", "NaN", "little", "big"]


def _leaves(doc: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(doc, dict):
        return [path] + [p for k, v in doc.items() for p in _leaves(v, path + (k,))]
    if isinstance(doc, list):
        return [path] + [p for i, v in enumerate(doc) for p in _leaves(v, path + (i,))]
    return [path]


def _new_value(old: Any, rng: random.Random) -> Any:
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return rng.choice([0, -1, 1, old - 1, old + 1, old * 2, old * 1000, 2 ** 31, 2 ** 63 - 1, None, str(old)])
    if isinstance(old, float):
        return rng.choice([0, -1.5, 1e308, "NaN", None])
    if isinstance(old, str):
        return rng.choice(_STRINGS + [None, 1])
    if isinstance(old, list):
        return rng.choice([old[:-1], old + old[-1:], old[::-1], [], None, 2])
    if isinstance(old, dict):
        return rng.choice([{}, None, [], dict(list(old.items())[:-1])])
    return rng.choice([0, "x", [], {}])


def json_edit(sample: Sample, rng: random.Random) -> Mutation | None:
    if not sample.meta_files:
        return None
    rel = rng.choice(sample.meta_files)
    text = sample.path(rel).read_text()
    if rng.random() < 0.1:
        at = rng.randrange(len(text))
        sample.path(rel).write_text(text[:at])
        return Mutation("json", f"truncate the JSON of {rel} at character {at}", True)
    doc = json.loads(text)
    if not _leaves(doc)[1:]:
        return None  # an empty document ({} in .zattrs)
    where = rng.choice(_leaves(doc)[1:])
    parent = doc
    for k in where[:-1]:
        parent = parent[k]
    old = parent[where[-1]]
    if isinstance(parent, dict) and rng.random() < 0.15:
        del parent[where[-1]]
        what = f"delete {'/'.join(map(str, where))}"
    else:
        parent[where[-1]] = _new_value(old, rng)
        what = f"set {'/'.join(map(str, where))} from {json.dumps(old)} to {json.dumps(parent[where[-1]])}"
    sample.path(rel).write_text(json.dumps(doc, indent=2))
    return Mutation("json", f"{what} in {rel}", True)


GENERIC = [bit_flips, bit_flips, overwrite, insert_or_delete, truncate, truncate, append, set_field, set_field,
           set_field, swap_regions, swap_keeping_mtime, reencode, reencode, delete_chunk_file, empty_chunk_file, swap_chunk_files,
           json_edit, json_edit]


def mutate(sample: Sample, rng: random.Random) -> Mutation:
    """Apply one mutation picked by ``rng`` (format-specific ones as often as generic ones)."""
    choices = GENERIC + sample.extra * max(1, len(GENERIC) // max(1, len(sample.extra)) // 2)
    for _ in range(100):
        m = rng.choice(choices)(sample, rng)
        if m is not None:
            return m
    raise AssertionError(f"no mutation applies to the {sample.fmt} sample {sample.variant}")
