"""``gpulazy info PATH --dataset NAME``: one dataset of an HDF5 file that holds several (CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpulazy.cli import main


@pytest.fixture
def run_h5(tmp_path):
    h5py = pytest.importorskip("h5py")
    p = str(tmp_path / "run.h5")
    with h5py.File(p, "w") as f:
        f.create_dataset("entry/data", data=np.zeros((8, 32, 24), "f4"), chunks=(2, 32, 24))
        f.create_dataset("entry/dark", data=np.zeros((32, 24), "u2"))
    return p


def test_info_dataset_describes_that_dataset(run_h5, capsys):
    assert main(["info", run_h5, "--dataset", "entry/data", "--json", "--device", "cpu"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layout"] == "hdf5" and d["shape"] == [8, 32, 24] and d["dtype"] == "float32"
    assert d["stored_chunk_shape"] == [2, 32, 24]
    assert main(["info", run_h5, "--dataset", "/entry/dark", "--device", "cpu"]) == 0
    assert "shape: (32, 24)  dtype: uint16" in capsys.readouterr().out


def test_info_without_dataset_names_the_option_and_the_datasets(run_h5, capsys):
    assert main(["info", run_h5, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert run_h5 in err and "--dataset NAME" in err and "/entry/data (8, 32, 24) float32" in err


def test_info_dataset_errors_name_the_file_or_ask_for_it(run_h5, capsys):
    assert main(["info", run_h5, "--dataset", "entry/missing", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert run_h5 in err and "no dataset 'entry/missing'" in err
    assert main(["info", "--dataset", "entry/data"]) == 2
    assert "give the file too" in capsys.readouterr().err
