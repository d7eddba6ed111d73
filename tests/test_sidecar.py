"""The raw sidecar ``<file>.json``: from_files reads a raw file without dtype= through it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gpulazy
from gpulazy import layouts
from gpulazy.errors import LayoutError
from gpulazy.layouts.raw import read_sidecar, write_sidecar


def _raw(tmp_path, data, name="v.raw", offset=0, order="C"):
    p = str(tmp_path / name)
    with open(p, "wb") as f:
        f.write(b"\xab" * offset)
        f.write(np.asarray(data).tobytes(order=order))
    return p


def test_from_files_reads_raw_through_its_sidecar(tmp_path):
    data = np.arange(4 * 5 * 6, dtype=">u2").reshape(4, 5, 6)
    p = _raw(tmp_path, data, offset=16)
    write_sidecar(p, shape=data.shape, dtype=">u2", offset=16, axes=["z", "y", "x"], scale=[2, 0.5, 0.5])
    assert layouts.guess_layout(p).name == "raw"
    vol = gpulazy.from_files(p, device="cpu", cache=False)
    assert vol.shape == (4, 5, 6) and vol.dtype == np.dtype("uint16")
    np.testing.assert_array_equal(vol.compute(), data)
    assert vol.attrs["axes"] == ("z", "y", "x") and vol.attrs["scale"] == (2.0, 0.5, 0.5)


def test_sidecar_fortran_order_and_explicit_options_win(tmp_path):
    data = np.arange(12, dtype="<f4").reshape(3, 4)
    p = _raw(tmp_path, data, order="F")
    write_sidecar(p, shape=(3, 4), dtype="<f4", order="F")
    np.testing.assert_array_equal(gpulazy.from_files(p, device="cpu", cache=False).compute(), data)
    # dtype= given: the sidecar is not used at all (the caller describes the file).
    flat = gpulazy.from_files(p, dtype="<f4", device="cpu", cache=False)
    assert flat.shape == (12,) and flat.attrs == {}


def test_sidecar_of_the_first_file_describes_a_stack(tmp_path):
    planes = [np.full((2, 3), i, dtype="u1") for i in range(3)]
    paths = [_raw(tmp_path, a, name=f"z{i}.raw") for i, a in enumerate(planes)]
    write_sidecar(paths[0], shape=(2, 3), dtype="u1", axes=["y", "x"], scale=[0.5, 0.25])
    vol = gpulazy.from_files(str(tmp_path / "z*.raw"), device="cpu", cache=False)
    np.testing.assert_array_equal(vol.compute(), np.stack(planes))
    assert vol.attrs["axes"] == ("file", "y", "x") and vol.attrs["scale"] == (1.0, 0.5, 0.25)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not readable JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"shape": [2, 3]}', r"lacks the required keys \['dtype'\]"),
    ('{"dtype": "u1"}', r"lacks the required keys \['shape'\]"),
    ('{"shape": [2, 3], "dtype": "u1", "dtpye": "u1"}', r"unknown keys \['dtpye'\]"),
    ('{"shape": [2, 3], "dtype": "nonsense"}', "unknown dtype 'nonsense'"),
    ('{"shape": [2, 3], "dtype": "u1", "offset": -1}', "offset must be a non-negative integer"),
    ('{"shape": [2, 3], "dtype": "u1", "order": "X"}', "order must be 'C'"),
    ('{"shape": [2, 3], "dtype": "u1", "scale": [1]}', "scale must be a list of 2 values"),
    ('{"shape": "big", "dtype": "u1"}', "shape must be"),
])
def test_bad_sidecar_raises_layout_error_naming_it(tmp_path, text, message):
    p = _raw(tmp_path, np.zeros((2, 3), "u1"))
    (tmp_path / "v.raw.json").write_text(text)
    with pytest.raises(LayoutError, match=message) as info:
        gpulazy.from_files(p, device="cpu", cache=False)
    assert repr(p + ".json") in str(info.value)


def test_sidecar_that_does_not_fit_the_file_size_names_the_file(tmp_path):
    p = _raw(tmp_path, np.zeros((2, 3), "u2"))
    write_sidecar(p, shape=(2, 4), dtype="u2")
    with pytest.raises(LayoutError, match=r"has 12 bytes but 16 were expected"):
        gpulazy.from_files(p, device="cpu", cache=False)


def test_raw_without_dtype_or_sidecar_says_how_to_fix(tmp_path):
    p = _raw(tmp_path, np.zeros(4, "u1"))
    with pytest.raises(LayoutError, match=r"write a sidecar '.*v\.raw\.json'"):
        gpulazy.from_files(p, device="cpu", cache=False)
    with pytest.raises(LayoutError, match=r"dtype is required.*v\.raw\.json"):
        gpulazy.from_files(p, layout="raw", device="cpu", cache=False)


def test_write_sidecar_rejects_what_read_would(tmp_path):
    p = _raw(tmp_path, np.zeros(4, "u1"))
    with pytest.raises(LayoutError, match="axes must be a list of 1 values"):
        write_sidecar(p, shape=(4,), dtype="u1", axes=["y", "x"])
    assert json.loads((tmp_path / "v.raw.json").read_text())["axes"] == ["y", "x"]  # written, then refused


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), dtype=st.sampled_from(["u1", "<i2", ">f4", "<c8"]),
       offset=st.integers(0, 9), order=st.sampled_from(["C", "F"]))
def test_sidecar_round_trip(tmp_path_factory, shape, dtype, offset, order):
    tmp = tmp_path_factory.mktemp("side")
    data = (np.arange(np.prod(shape)) % 7).astype(dtype).reshape(shape)
    p = _raw(tmp, data, offset=offset, order=order)
    write_sidecar(p, shape=shape, dtype=dtype, offset=offset, order=order)
    s = read_sidecar(p)
    assert (s.shape, s.dtype, s.offset, s.order) == (tuple(shape), np.dtype(dtype), offset, order)
    got = gpulazy.from_files(p, device="cpu", cache=False).compute()
    assert got.dtype == np.dtype(dtype).newbyteorder("=")
    np.testing.assert_array_equal(got, data)
    os.remove(p + ".json")
