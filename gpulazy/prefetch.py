"""Placeholder: read-ahead is being written (issue 3)."""
from __future__ import annotations


class prefetch:  # noqa: N801
    pass


class Prefetcher:
    pass
