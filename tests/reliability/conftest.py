"""Reliability tests: after each one, no thread, child process or file descriptor is left behind."""

from __future__ import annotations

import pytest

from leaks import Snapshot


@pytest.fixture(autouse=True)
def _no_leaks():
    before = Snapshot()
    yield
    before.assert_no_leaks()
