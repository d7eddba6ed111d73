"""Seeded mutations of small npy samples: equal data or a named gpulazy error (see tests/fuzz/harness.py)."""

import pytest

from .harness import TIMEOUT, params, run_case


@pytest.mark.fuzz
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("seed", params("npy"))
def test_npy(seed, tmp_path):
    run_case("npy", seed, tmp_path)
