"""A folder, glob or list always stacks along a new axis 0 (even of one file); one path never does."""

from __future__ import annotations

import numpy as np
import pytest

import gpulazy
from gpulazy import layouts
from gpulazy.cli import main
from gpulazy.errors import LayoutError
from gpulazy.layouts._common import names_collection


def _raw(tmp_path, n):
    data = np.arange(n * 12, dtype="<u2").reshape(n, 3, 4)
    paths = []
    for i in range(n):
        p = tmp_path / f"z{i}.raw"
        data[i].tofile(p)
        paths.append(str(p))
    return data, paths


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("spelling", ["folder", "glob", "list"])
def test_a_collection_stacks_whatever_its_length(tmp_path, n, spelling):
    data, paths = _raw(tmp_path, n)
    arg = {"folder": str(tmp_path), "glob": str(tmp_path / "z*.raw"), "list": paths}[spelling]
    vol = gpulazy.from_files(arg, shape=(3, 4), dtype="<u2", device="cpu", cache=False)
    assert vol.shape == (n, 3, 4)
    np.testing.assert_array_equal(vol.compute(), data)
    assert vol.chunk_index.stacked


def test_a_single_path_does_not_stack(tmp_path):
    data, paths = _raw(tmp_path, 1)
    vol = gpulazy.from_files(paths[0], shape=(3, 4), dtype="<u2", device="cpu", cache=False)
    assert vol.shape == (3, 4)
    np.testing.assert_array_equal(vol.compute(), data[0])


@pytest.mark.parametrize("arg", ["dir", "glob", "list"])
def test_npy_collection_of_one_stacks(tmp_path, arg):
    a = np.arange(6, dtype="f4").reshape(2, 3)
    np.save(tmp_path / "a.npy", a)
    spelled = {"dir": str(tmp_path), "glob": str(tmp_path / "*.npy"), "list": [str(tmp_path / "a.npy")]}[arg]
    vol = gpulazy.from_files(spelled, device="cpu", cache=False)
    assert vol.shape == (1, 2, 3)
    np.testing.assert_array_equal(vol.compute(), a[None])
    assert gpulazy.from_files(str(tmp_path / "a.npy"), device="cpu").shape == (2, 3)


def test_stack_option_overrides_and_is_checked(tmp_path):
    _, paths = _raw(tmp_path, 2)
    assert layouts.index(paths[:1], dtype="<u2", shape=(3, 4), stack=False).shape == (3, 4)
    assert layouts.index(paths[0], dtype="<u2", shape=(3, 4), stack=True).shape == (1, 3, 4)
    with pytest.raises(LayoutError, match="stack=False needs exactly one file"):
        layouts.index(paths, dtype="<u2", shape=(3, 4), stack=False)


def test_names_collection(tmp_path):
    f = tmp_path / "weird[1].raw"
    f.write_bytes(b"\0\0")
    assert names_collection(str(tmp_path)) and names_collection([str(f)]) and names_collection((str(f),))
    assert names_collection(str(tmp_path / "*.raw"))
    assert not names_collection(str(f))  # exists as a file: not a glob even with brackets
    assert not names_collection(tmp_path / "missing.raw")


def test_demo_with_one_slice(capsys):
    # 8 KiB is one 64 x 64 slice: the demo's projection over a stack of one must hold.
    assert main(["demo", "--size", "8KiB", "--device", "cpu"]) == 0
    assert "checked against the generated pattern" in capsys.readouterr().out
