"""Seeded fuzzing of every format gpulazy reads: damaged files give equal data or a named error.

Each test case builds a small pristine sample of one format (``formats.py``), applies one
mutation chosen by its seed (``mutate.py``: header fields, offsets, byte counts,
truncation, bit flips, chunks re-encoded with too few or too many elements, swapped and
deleted chunk files), reads it through gpulazy three ways and judges the outcome against
the format's reference reader (``harness.py``). The rule, and how to run it::

    PYTHONPATH=$PWD pytest tests/fuzz -p no:cacheprovider              # CI: a few seeds per format
    GPULAZY_FUZZ_N=1000 PYTHONPATH=$PWD pytest tests/fuzz/test_fuzz_tiff.py   # 1000 seeds of one format
    GPULAZY_FUZZ_SEEDS=17,40-45 PYTHONPATH=$PWD pytest tests/fuzz/test_fuzz_tiff.py  # given seeds
    PYTHONPATH=$PWD python -m tests.fuzz.report run --n 1000 --log /tmp/fuzz.jsonl  # tallied by cause
    PYTHONPATH=$PWD python -m tests.fuzz.report known /tmp/fuzz.jsonl   # the KNOWN_FAILURES table for a log

Seeds known to fail on the unfixed code are listed, with their cause, in ONE table:
``harness.KNOWN_FAILURES`` (non-strict xfail; remove a cause's entries once it is fixed).
"""
