"""Reliability tests: after each one, no thread, child process or file descriptor is left behind."""

from __future__ import annotations

import pytest

from leaks import Snapshot


@pytest.fixture(autouse=True)
def _no_leaks():
    before = Snapshot()
    yield
    # Backends keep file handles open between reads on purpose (gpulazy.io._handles); closing
    # them is what ends their use, so the descriptors must all be gone after that.
    from gpulazy import io

    io._close_all()
    before.assert_no_leaks()
