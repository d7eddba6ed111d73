"""Conformance suites, each the contract of one seam, for tests to subclass (needs pytest and hypothesis).

- ``BackendConformance`` (``backends``): every I/O backend;
- ``LayoutConformance`` (``layouts``): every layout;
- ``ConsumerConformance`` (``consumers``): every way users get chunk values (``CONSUMERS``:
  whole-array compute, dask's path, slices, reductions, caches, regions, prefetch,
  ``read_file``, ``verify``) over every format, equal to each format's own reader.

Import from tests only::

    from gpulazy.testing import BackendConformance, ConsumerConformance, LayoutConformance
"""

from __future__ import annotations

from gpulazy.testing.backends import BackendConformance, file_bytes, wait_for_idle, write_file
from gpulazy.testing.consumers import CONSUMERS, Case, ConsumerConformance, Dataset, Format, flip_byte
from gpulazy.testing.layouts import LayoutConformance

__all__ = ["CONSUMERS", "BackendConformance", "Case", "ConsumerConformance", "Dataset", "Format",
           "LayoutConformance", "file_bytes", "flip_byte", "wait_for_idle", "write_file"]
