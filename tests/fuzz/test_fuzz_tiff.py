"""Seeded mutations of small tiff samples: equal data or a named gpulazy error (see tests/fuzz/harness.py)."""

import pytest

from .harness import TIMEOUT, params, run_case


@pytest.mark.fuzz
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("seed", params("tiff"))
def test_tiff(seed, tmp_path):
    run_case("tiff", seed, tmp_path)
