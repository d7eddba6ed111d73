"""The fuzz harness itself: mutations repeat per seed, and the judge flags each kind of problem."""

import hashlib
import random

import numpy as np
import pytest

from gpulazy.errors import ChunkDecodeError

from .formats import VARIANTS, build
from .harness import Huge, judge
from .mutate import Mutation, mutate


def _mutated_digest(fmt: str, seed: int, folder) -> tuple[str, str]:
    sample = build(fmt, VARIANTS[fmt][seed % len(VARIANTS[fmt])], folder)
    m = mutate(sample, random.Random(f"{fmt}/{seed}"))
    h = hashlib.sha256()
    for rel in sample.files():
        h.update(rel.encode() + b"\0" + sample.path(rel).read_bytes())
    return m.description, h.hexdigest()


@pytest.mark.fuzz
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", list(VARIANTS))
def test_the_same_seed_makes_the_same_files(fmt, tmp_path):
    for seed in range(3):
        assert _mutated_digest(fmt, seed, tmp_path / f"a{seed}") == _mutated_digest(fmt, seed, tmp_path / f"b{seed}")


@pytest.mark.fuzz
@pytest.mark.timeout(60)
def test_the_judge_flags_each_problem(tmp_path):
    sample = build("npy", VARIANTS["npy"][0], tmp_path)
    flip = Mutation("bitflip", "a flipped bit")
    wrong = sample.data.copy()
    wrong.reshape(-1)[3] += 1
    ref = [sample.data]
    assert judge("whole", sample.data.copy(), ref, "reads", sample, flip) is None
    assert judge("whole", wrong, ref, "reads", sample, flip)[0] == "wrong-data"
    assert judge("whole", sample.data.astype("<u4"), ref, "reads", sample, flip)[0] == "wrong-data"
    assert judge("whole", ValueError("x"), ref, "reads", sample, flip)[0] == "crash"
    assert judge("whole", ChunkDecodeError("no path here"), ref, "reads", sample, flip)[0] == "unnamed"
    assert judge("whole", ChunkDecodeError(f"{sample.target!r} is bad"), ref, "reads", sample, flip) is None
    assert judge("whole", Huge(1 << 40, (1 << 39,)), ref, "reads", sample, flip)[0] == "memory"
    # Rejected by the reference reader: only the pristine data may come back.
    assert judge("dask", sample.data.copy(), None, "rejected", sample, flip) is None
    assert judge("dask", wrong, None, "rejected", sample, flip)[0] == "data-on-rejected"
    # verify=True with a manifest of the pristine files: the pristine data or an error.
    assert judge("verify", wrong, [wrong], "reads", sample, flip)[0] == "verify-missed"
    assert judge("verify", wrong, [wrong], "reads", sample, Mutation("json", "metadata", meta_only=True)) is None
    assert np.array_equal(sample.data, build("npy", VARIANTS["npy"][0], tmp_path / "again").data)
