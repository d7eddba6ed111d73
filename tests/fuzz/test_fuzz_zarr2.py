"""Seeded mutations of small zarr2 samples: equal data or a named gpulazy error (see tests/fuzz/harness.py)."""

import pytest

from .harness import TIMEOUT, params, run_case


@pytest.mark.fuzz
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("seed", params("zarr2"))
def test_zarr2(seed, tmp_path):
    run_case("zarr2", seed, tmp_path)
