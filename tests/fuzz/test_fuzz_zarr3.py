"""Seeded mutations of small zarr3 samples: equal data or a named gpulazy error (see tests/fuzz/harness.py)."""

import pytest

from .harness import TIMEOUT, params, run_case


@pytest.mark.fuzz
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("seed", params("zarr3"))
def test_zarr3(seed, tmp_path):
    run_case("zarr3", seed, tmp_path)
