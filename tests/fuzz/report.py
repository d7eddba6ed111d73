"""Run the fuzz cases of every format in a pytest subprocess each, and tally the log by cause.

    PYTHONPATH=$PWD python -m tests.fuzz.report run --n 1000 --log /tmp/fuzz.jsonl
    PYTHONPATH=$PWD python -m tests.fuzz.report tally /tmp/fuzz.jsonl

``run`` resumes after a case that kills the interpreter (a segfault is logged as such).
``tally`` prints, per format, the cases run and the failing ones grouped by cause (which
read, what went wrong, where), with the count and the first seed that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict

from .harness import CAUSES, CI_N

FORMATS = ["tiff", "zarr2", "zarr3", "hdf5", "npy"]


def run(n: int, log: str, formats: list[str], start: int = 0) -> None:
    for fmt in formats:
        begin = start
        while begin < start + n:
            t0 = time.monotonic()
            env = dict(os.environ, GPULAZY_FUZZ_START=str(begin), GPULAZY_FUZZ_N=str(start + n - begin),
                       GPULAZY_FUZZ_LOG=log)
            proc = subprocess.run([sys.executable, "-m", "pytest", f"tests/fuzz/test_fuzz_{fmt}.py", "-q",
                                   "-p", "no:cacheprovider", "--no-header", "-rN"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(f"{fmt} seeds {begin}..{start + n - 1}: pytest exit {proc.returncode} "
                  f"in {time.monotonic() - t0:.0f} s", flush=True)
            if proc.returncode >= 0:
                break
            dead = _unfinished(log, fmt)  # killed by a signal: the case that was running did it
            _append(log, {"fmt": fmt, "seed": dead, "event": "abort", "error": f"signal {-proc.returncode}"})
            begin = dead + 1


def _records(log: str) -> list[dict]:
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()]


def _unfinished(log: str, fmt: str) -> int:
    started, done = {}, set()
    for r in _records(log):
        if r["fmt"] == fmt:
            (done.add(r["seed"]) if r["event"] in ("end", "abort") else started.__setitem__(r["seed"], r))
    return max(s for s in started if s not in done)


def _append(log: str, record: dict) -> None:
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")




def _cause(read: str, problem: str, detail: str, r: dict) -> str:
    """A cause for a problem, by rules checked against representative seeds by hand; '?' where none fits."""
    if problem in ("crash", "unnamed", "memory"):
        head = detail.split(": ")[0]
        return f"{problem}: {re.sub(r'0x[0-9a-f]+|[0-9]+', 'N', head)}"  # type and place, without numbers
    kind, variant, mutation = r["kind"], r["variant"], r["mutation"]
    pages = re.match(r"\w+\[(\d+), 40, 48\]", r["outcomes"].get(read, ""))
    if problem == "verify-missed":
        letter = "C"
    elif problem == "stale-cache":
        letter = "D"
    elif variant in ("multipage", "ome") and not (pages and pages.group(1) == "3"):
        letter = "E"
    elif variant == "blosc" and kind in ("truncate", "shift", "empty-chunk", "append"):
        letter = "B"
    elif r["fmt"] == "zarr3" and "checksum" in r["reference"] and problem == "data-on-rejected":
        letter = "C" if read == "verify" else "G"
    elif r["fmt"] == "tiff" and problem == "data-on-rejected" and kind in ("field", "bitflip", "overwrite", "shift"):
        letter = "F"
    elif r["fmt"] == "hdf5" and problem == "wrong-data":  # seeds 37, 450, 458: B-tree bytes changed
        letter = "H"
    elif kind == "reencode" or (kind == "json" and re.search(r"set (dtype|chunks|shape)", mutation)):
        letter = "A"
    else:
        return f"?: {problem} on the {read} read ({r['fmt']} {variant}, {kind})"
    return f"{letter}: {CAUSES[letter]}"


def tally(log: str) -> None:
    cases: dict[str, set] = defaultdict(set)
    failing: dict[str, set] = defaultdict(set)
    causes: dict[tuple[str, str], list[int]] = defaultdict(list)
    seconds: dict[str, float] = defaultdict(float)
    for r in _records(log):
        fmt = r["fmt"]
        if r["event"] == "end":
            cases[fmt].add(r["seed"])
            seconds[fmt] += r["seconds"]
            for read, problem, detail in r["problems"]:
                failing[fmt].add(r["seed"])
                causes[fmt, _cause(read, problem, detail, r)].append(r["seed"])
        elif r["event"] == "abort":
            cases[fmt].add(r["seed"])
            failing[fmt].add(r["seed"])
            kind = "hang" if "Timeout" in r["error"] else r["error"].split(":")[0]
            causes[fmt, f"abort: {kind}"].append(r["seed"])
    for fmt in sorted(cases, key=FORMATS.index):
        print(f"{fmt}: {len(cases[fmt])} cases, {len(failing[fmt])} failing, {seconds[fmt]:.0f} s in cases")
        for (f, cause), seeds in sorted(causes.items(), key=lambda kv: -len(set(kv[1]))):
            if f == fmt:
                seeds = sorted(set(seeds))
                print(f"  {len(seeds):5d}  {cause}  (seed {seeds[0]}; also {seeds[1:4]})")


def known(log: str) -> None:
    """The ``KNOWN_FAILURES`` table for ``log``: each failing CI seed, and the first seed of each
    (format, cause); a seed with several causes gets them all (``"C+D"``)."""
    letters: dict[tuple[str, int], set[str]] = defaultdict(set)
    for r in _records(log):
        if r["event"] == "end":
            for read, problem, detail in r["problems"]:
                letters[r["fmt"], r["seed"]].add(_cause(read, problem, detail, r).split(":")[0])
        elif r["event"] == "abort":
            letters[r["fmt"], r["seed"]].add("?")
    first: dict[tuple[str, str], int] = {}
    for (fmt, seed), found in sorted(letters.items()):
        for letter in found:
            first.setdefault((fmt, letter), seed)
    keep = sorted({k for k in letters if k[1] < CI_N} | {(fmt, seed) for (fmt, _), seed in first.items()},
                  key=lambda k: (FORMATS.index(k[0]), k[1]))
    print("KNOWN_FAILURES: dict[tuple[str, int], str] = {")
    for fmt, seed in keep:
        print(f'    ("{fmt}", {seed}): "{"+".join(sorted(letters[fmt, seed]))}",')
    print("}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz.report")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--n", type=int, default=1000)
    r.add_argument("--start", type=int, default=0)
    r.add_argument("--log", required=True)
    r.add_argument("--formats", nargs="*", default=FORMATS)
    t = sub.add_parser("tally")
    t.add_argument("log")
    k = sub.add_parser("known")
    k.add_argument("log")
    args = p.parse_args(argv)
    if args.cmd == "run":
        run(args.n, args.log, args.formats, args.start)
        tally(args.log)
    elif args.cmd == "known":
        known(args.log)
    else:
        tally(args.log)


if __name__ == "__main__":
    main()
