"""One fuzz case: build a sample, mutate it by seed, read it three ways, judge each outcome.

The reads (all on ``device="cpu"``):

- ``whole``: ``from_files(path, cache=False).compute()``, the fast whole-array path;
- ``dask``: ``from_files(path, chunks=16)`` through dask's scheduler (``map_blocks``) with the
  default cache, which read the pristine files just before they were changed in place;
- ``verify``: ``from_files(path, chunks=16, cache=False, verify=True).compute()`` with a
  checksum manifest written over the pristine files (one block per file);
- ``planes``: ``from_files(path, cache=False)[[n - 1, 0, n // 2, n // 2 + 1, n - 1]].compute()``, a
  list of planes (boxes cutting chunks: parts read alone, heads of zstd chunks), judged against the
  same planes of the reference;
- ``step``: ``from_files(path, cache=False)[1::2].compute()``, every other plane (a streamed map of the
  chunks' parts: the planes alone of chunks stored as is, ``ChunkSpec.leading`` with a step), judged
  against the same planes of the reference.

The rule for each: EITHER data equal to what the format's reference reader reads from
the mutated files (where it rejects them: equal to the pristine data, i.e. nothing the
damage changed reached the result) OR a ``GpulazyError`` whose message names the sample's
folder. For ``verify`` the data must be the pristine data unless the mutation touched only
metadata files the manifest cannot guard (Zarr JSON) or deleted a chunk file (Zarr reads it
as fill). Never another exception, never more memory than the files justify (traced with
``tracemalloc``), never a hang (each case has a ``pytest-timeout``). A ``dask`` read that
breaks the rule is read again without the cache: where that one obeys it, the problem is
named ``stale-cache``.
"""

from __future__ import annotations

import json
import os
import random
import time
import traceback
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from .formats import LARGE, VARIANTS, Rejected, TooLarge, build, reference
from .mutate import Mutation, Sample, mutate

CI_N = 12  # seeds per format in CI (plus the known failures' seeds); GPULAZY_FUZZ_N overrides
TIMEOUT = 30  # seconds per case: a read that takes longer is a hang
MEMORY_SLACK = 16 << 20  # tracemalloc peak allowed over 16 x the sample's bytes (dask and numpy bookkeeping)

# The causes of the failures found on the code of 2f3a4d7 (``report.py`` assigns them by
# rules checked against representative seeds by hand).
CAUSES = {
    "A": "a chunk that decodes to the wrong number of bytes is not refused",
    "B": "a blosc frame's own length is not checked against its stored piece",
    "C": "verify=True is skipped on the whole-array path",
    "D": "a chunk changed in place is served stale from the cache",
    "E": "a damaged multi-page TIFF opens with fewer pages",
    "F": "a TIFF whose IFDs or tags are malformed or disagree (a tag's count, type or value offset; an IFD "
         "shifted by inserted or deleted bytes; strips vs image size) is read, not refused",
    "G": "Zarr's crc32c codec is checked only with verify=True: a corrupt chunk reads as data",
    "H": "HDF5 with a damaged chunk B-tree: the HDF5 library's own calls disagree (seed 37: H5Dchunk_iter and "
         "H5Dget_chunk_info_by_coord find an edge chunk at its offset, which gpulazy reads; the storage-size "
         "lookup h5py's reads use finds none, so h5py gives the fill value); fixed: every listed chunk is looked "
         "up as the reads look it up when the file is opened (hdf5._check_found)",
}

# The reproducer seeds of every cause found on 2f3a4d7 (the CI seeds that failed and one per
# (format, cause)): run in CI as plain cases, so a cause that comes back fails CI.
REGRESSIONS: dict[tuple[str, int], str] = {
    ("tiff", 2): "C",
    ("tiff", 5): "E",
    ("tiff", 10): "F",
    ("tiff", 14): "A",
    ("tiff", 32): "C+D",
    ("tiff", 171): "F",  # a Predictor tag tifffile cannot read: its pixels came back un-predicted
    ("zarr2", 3): "D",
    ("zarr2", 4): "C",
    ("zarr2", 8): "B",
    ("zarr2", 11): "B",
    ("zarr2", 43): "A",
    ("zarr3", 14): "C+G",
    ("zarr3", 29): "A",
    ("zarr3", 48): "D",
    ("hdf5", 22): "C",
    ("hdf5", 37): "H",
    ("hdf5", 10007): "H",  # a key inside the index damaged: every listed chunk in order, one not found
}

# ONE table of the seeds known to fail now, each run in CI as a non-strict xfail. Remove an
# entry once its fix is merged (it then XPASSes); ``python -m tests.fuzz.report known LOG``
# prints the table for a log.
KNOWN_FAILURES: dict[tuple[str, int], str] = {}


# -- which seeds ------------------------------------------------------------------------

def _parse_seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.replace(" ", "").split(","):
        if "-" in part:
            a, b = part.split("-")
            out += range(int(a), int(b) + 1)
        elif part:
            out.append(int(part))
    return out


def seeds(fmt: str) -> list[int]:
    """``GPULAZY_FUZZ_SEEDS`` (``"17,40-45"``) if set; else ``GPULAZY_FUZZ_N`` seeds from
    ``GPULAZY_FUZZ_START`` (default ``CI_N`` from 0) plus the format's regression and known-failure seeds."""
    if os.environ.get("GPULAZY_FUZZ_SEEDS"):
        return _parse_seeds(os.environ["GPULAZY_FUZZ_SEEDS"])
    start = int(os.environ.get("GPULAZY_FUZZ_START", "0"))
    n = int(os.environ.get("GPULAZY_FUZZ_N", str(CI_N)))
    known = {s for (f, s) in {**REGRESSIONS, **KNOWN_FAILURES} if f == fmt} if start == 0 else set()
    return sorted(set(range(start, start + n)) | known)


def params(fmt: str) -> list:
    out = []
    for s in seeds(fmt):
        letters = KNOWN_FAILURES.get((fmt, s))
        reason = "; ".join(f"{c}: {CAUSES.get(c, 'unclassified')}" for c in letters.split("+")) if letters else ""
        marks = [pytest.mark.xfail(reason=f"known: {reason}", strict=False)] if letters else []
        out.append(pytest.param(s, id=f"seed{s:04d}", marks=marks))
    return out


# -- reading ----------------------------------------------------------------------------

def _open(sample: Sample, **kw):
    import gpulazy

    return gpulazy.from_files(sample.target, device="cpu", **sample.read_kw, **kw)


def _compute(vol, how):
    if vol.nbytes > LARGE:
        return Huge(int(vol.nbytes), tuple(vol.shape))  # not read: judged by what the files justify
    return how(vol)


def read_whole(sample: Sample):
    return _compute(_open(sample, cache=False), lambda v: v.compute())


def read_dask(sample: Sample):
    return _compute(_open(sample, chunks=16), lambda v: v.map_blocks(np.copy, dtype=v.dtype).compute(scheduler="threads"))


def read_dask_uncached(sample: Sample):
    return _compute(_open(sample, chunks=16, cache=False),
                    lambda v: v.map_blocks(np.copy, dtype=v.dtype).compute(scheduler="threads"))


def _stale_or(problem: tuple[str, str], uncached: tuple[str, str] | None) -> tuple[str, str]:
    """The dask read's problem, named ``stale-cache`` where the same read without the cache is fine."""
    if uncached is None:
        return "stale-cache", f"served from the cache the pristine read filled ({problem[1]})"
    return problem


def read_verify(sample: Sample):
    return _compute(_open(sample, chunks=16, cache=False, verify=True), lambda v: v.compute())


def _planes(n: int) -> list[int]:
    """Planes a ``planes`` read picks of ``n``: the last, the first, two in the middle (out of order, runs
    of neighbours and repeats, each a box of its own: ``read_picks``)."""
    return [p for p in (n - 1, 0, n // 2, n // 2 + 1, n - 1) if p < n]


def read_planes(sample: Sample):
    def pick(v):
        return v[_planes(v.shape[0])].compute() if v.ndim and v.shape[0] else v.compute()
    return _compute(_open(sample, cache=False), pick)


def _every_other(n: int) -> slice:
    """The planes a ``step`` read takes of ``n``: every other one from the second (from the first of one)."""
    return slice(1 if n > 1 else 0, None, 2)


def read_step(sample: Sample):
    def step(v):
        return v[_every_other(v.shape[0])].compute() if v.ndim and v.shape[0] else v.compute()
    return _compute(_open(sample, cache=False), step)


def picked(read: str, arr: np.ndarray) -> np.ndarray | None:
    """What ``read`` reads of ``arr`` (a reference, the pristine data): all of it, or its planes."""
    if read not in ("planes", "step") or not arr.ndim or not arr.shape[0]:
        return arr
    return arr[_planes(arr.shape[0])] if read == "planes" else arr[_every_other(arr.shape[0])]


READS = {"whole": read_whole, "dask": read_dask, "verify": read_verify, "planes": read_planes, "step": read_step}


class Huge:
    """gpulazy's lazy array is larger than ``LARGE``: computing it would allocate that much."""

    def __init__(self, nbytes: int, shape: tuple):
        self.nbytes, self.shape = nbytes, shape


def attempt(read, sample: Sample):
    try:
        return read(sample)
    except Exception as e:  # noqa: BLE001 -- judged below: a GpulazyError or a crash
        return e


# -- judging ----------------------------------------------------------------------------

def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal shape, dtype (byte order aside) and bytes."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype.newbyteorder("=") != b.dtype.newbyteorder("="):
        return False
    native = a.dtype.newbyteorder("=")
    return np.ascontiguousarray(a, native).tobytes() == np.ascontiguousarray(b, native).tobytes()


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "/gpulazy/" in f.filename]
    last = frames[-1] if frames else None
    parts = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in (ours[-1:] + [last]) if f is not None]
    return " / ".join(dict.fromkeys(parts))


def _describe(a) -> str:
    if isinstance(a, Huge):
        return f"a lazy array of {a.nbytes} bytes {a.shape}"
    a = np.asarray(a)
    return f"{a.dtype}{list(a.shape)}"


def judge(read: str, got, refs, ref_state: str, sample: Sample, mutation: Mutation,
          lenient: list[np.ndarray] = ()) -> tuple[str, str] | None:
    """``None`` when ``got`` obeys the rule, else (problem, detail)."""
    from gpulazy.errors import GpulazyError

    if isinstance(got, BaseException):
        if not isinstance(got, GpulazyError):
            return "crash", f"{type(got).__name__} at {_where(got)}: {str(got)[:300]}"
        if str(sample.root) not in str(got):
            return "unnamed", f"{type(got).__name__} whose message lacks the path: {str(got)[:300]}"
        return None
    if isinstance(got, Huge):
        if ref_state.startswith("large") and refs is None:
            return None  # the metadata describes that much (a sparse Zarr array, say): justified
        return "memory", f"{_describe(got)} from {_sample_bytes(sample)} bytes of files; reference: {ref_state}"
    if read == "verify" and not mutation.meta_only and mutation.kind != "delete-chunk" and sample.fmt != "zarr3":
        if not same(got, sample.data):
            return "verify-missed", f"verify=True returned {_describe(got)} differing from the checksummed data"
        return None
    if refs is not None:
        refs = [picked(read, r) for r in refs]
        if any(same(got, r) for r in refs):
            return None
        return "wrong-data", f"{_describe(got)} differs from the reference's {_describe(refs[0])}: {_diff(got, refs[0])}"
    if same(got, picked(read, sample.data)) or any(same(got, picked(read, r)) for r in lenient):
        return None  # the reference rejects the files, but nothing the damage changed came through
    return "data-on-rejected", f"{_describe(got)} returned where the reference reader says: {ref_state}"


def _diff(a, b) -> str:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return "shape or dtype"
    bad = np.flatnonzero(a.reshape(-1) != b.reshape(-1))
    return f"{bad.size} of {a.size} elements differ, first at flat index {bad[0] if bad.size else '-'}"


def _sample_bytes(sample: Sample) -> int:
    return sum(os.path.getsize(sample.path(f)) for f in sample.files())


# -- one case ---------------------------------------------------------------------------

def run_case(fmt: str, seed: int, tmp_path: Path) -> None:
    """Build, mutate, read, judge; an ``AssertionError`` saying how to reproduce on any problem."""
    variant = VARIANTS[fmt][seed % len(VARIANTS[fmt])]
    _log({"fmt": fmt, "seed": seed, "variant": variant, "event": "start"})
    try:
        _run_case(fmt, seed, variant, tmp_path)
    except AssertionError:
        raise
    except BaseException as e:  # a hang (pytest-timeout's Failed) or a harness error: logged, then raised
        _log({"fmt": fmt, "seed": seed, "variant": variant, "event": "abort", "error": f"{type(e).__name__}: {e}"[:500]})
        raise


def _run_case(fmt: str, seed: int, variant: str, tmp_path: Path) -> None:
    from gpulazy.checksums import write_manifest

    rng = random.Random(f"{fmt}/{seed}")
    t0 = time.monotonic()
    sample = build(fmt, variant, tmp_path / "s")
    write_manifest(str(sample.root), block_size=1 << 24)  # one block per file: any changed byte is caught
    warm = read_dask(sample)  # the default cache now holds the pristine chunks
    assert same(warm, sample.data), f"the pristine {fmt} sample {variant} reads wrong: harness bug"
    mutation = mutate(sample, rng)
    refs, ref_state, lenient, described = _reference(sample)
    problems, outcomes = [], {}
    tracemalloc.start()
    try:
        for name, read in READS.items():
            got = attempt(read, sample)
            outcomes[name] = type(got).__name__ if isinstance(got, BaseException) else _describe(got)
            problem = judge(name, got, refs, ref_state, sample, mutation, lenient)
            if problem and name == "dask":
                problem = _stale_or(problem, judge(name, attempt(read_dask_uncached, sample), refs, ref_state,
                                                   sample, mutation, lenient))
            if problem:
                problems.append((name, *problem))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        _close_handles()
    # A chunk index costs memory per chunk the metadata describes (a Zarr shape made 1000x larger
    # is a legal sparse array): the described bytes count, a few times over.
    budget = MEMORY_SLACK + 16 * (_sample_bytes(sample) + sample.data.nbytes) + 4 * described
    if peak > budget:
        problems.append(("all", "memory", f"tracemalloc peak {peak} bytes over the budget {budget}"))
    _log({"fmt": fmt, "seed": seed, "variant": variant, "event": "end", "kind": mutation.kind,
          "mutation": mutation.description, "reference": ref_state, "outcomes": outcomes,
          "problems": problems, "seconds": round(time.monotonic() - t0, 3)})
    if problems:
        raise AssertionError(failure_message(fmt, seed, variant, mutation, ref_state, problems))


def _reference(sample: Sample):
    try:
        refs = reference(sample)
        return refs, f"reads {_describe(refs[0])}", [], max(r.nbytes for r in refs)
    except Rejected as e:
        return None, f"rejected ({e})", e.lenient, 0
    except TooLarge as e:
        return None, f"large ({e})", [], e.nbytes


def failure_message(fmt, seed, variant, mutation, ref_state, problems) -> str:
    lines = [f"fuzz {fmt} seed {seed} (variant {variant}): {mutation.description}", f"  reference reader: {ref_state}"]
    lines += [f"  {read} read: {problem}: {detail}" for read, problem, detail in problems]
    lines.append(f"  reproduce: GPULAZY_FUZZ_SEEDS={seed} PYTHONPATH=$PWD python -m pytest "
                 f"tests/fuzz/test_fuzz_{fmt}.py -p no:cacheprovider")
    return "\n".join(lines)


def _close_handles() -> None:
    # Backends keep file handles open between reads; thousands of cases would run out of them.
    from gpulazy import io

    io._close_all()


def _log(record: dict) -> None:
    path = os.environ.get("GPULAZY_FUZZ_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
