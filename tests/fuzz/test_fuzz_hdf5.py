"""Seeded mutations of small hdf5 samples: equal data or a named gpulazy error (see tests/fuzz/harness.py)."""

import pytest

from .harness import TIMEOUT, params, run_case


@pytest.mark.fuzz
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("seed", params("hdf5"))
def test_hdf5(seed, tmp_path):
    run_case("hdf5", seed, tmp_path)
