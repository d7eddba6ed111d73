"""The ``.npy`` header under attack: corrupt input gives a ``LayoutError`` naming the file, or a correct read.

Real headers (versions 1.0, 2.0, 3.0; C and F order; several dtypes) are corrupted by
hypothesis: bytes overwritten, inserted, deleted, the file cut short, the header-length
field set to anything. Whatever comes out is either a ``LayoutError`` that names the
file or an array equal to what ``numpy.load`` reads; never another exception, never a
hang (each example is timed), and never a header allocation beyond the file's size.
"""

from __future__ import annotations

import io
import os
import struct
import time
import tracemalloc

import numpy as np
import numpy.lib.format as npformat
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpulazy
from gpulazy.errors import LayoutError
from gpulazy.layouts.npy import read_npy_header

DTYPES = ["<u2", ">i4", "<f8", "|u1", "<c8"]


@st.composite
def real_npy(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    order = draw(st.sampled_from("CF"))
    version = draw(st.sampled_from([(1, 0), (2, 0), (3, 0)]))
    arr = np.asarray(np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape), order=order)
    buf = io.BytesIO()
    npformat.write_array(buf, arr, version=version)
    return buf.getvalue(), arr


@st.composite
def corruption(draw, blob_len):
    kind = draw(st.sampled_from(["overwrite", "insert", "delete", "truncate", "length", "dict"]))
    return kind, draw(st.integers(0, max(0, blob_len - 1))), draw(st.binary(min_size=1, max_size=8)), \
        draw(st.integers(0, 2 ** 32 - 1))


def _corrupt(blob: bytes, kind, at, data, number) -> bytes:
    header_end = min(len(blob), 10 + (blob[8] | blob[9] << 8) if blob[6] == 1 else 12 + struct.unpack("<I", blob[8:12])[0])
    at = at % max(1, header_end)  # aim at the header, where the parser is
    if kind == "overwrite":
        return blob[:at] + data + blob[at + len(data):]
    if kind == "insert":
        return blob[:at] + data + blob[at:]
    if kind == "delete":
        return blob[:at] + blob[at + len(data):]
    if kind == "truncate":
        return blob[:at]
    if kind == "length":  # any header length, up to 4 GiB for versions 2 and 3
        if blob[6] == 1:
            return blob[:8] + struct.pack("<H", number & 0xFFFF) + blob[10:]
        return blob[:8] + struct.pack("<I", number) + blob[12:]
    # "dict": the dict literal cut open (the unterminated literal that once escaped as TokenError)
    text = blob[:header_end].replace(b"}", data[:1] if data[:1] != b"}" else b" ", 1)
    return text + blob[header_end:]


@pytest.mark.timeout(300)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupt_npy_header_is_a_layout_error_or_a_correct_read(tmp_path_factory, data):
    blob, arr = data.draw(real_npy())
    bad = _corrupt(blob, *data.draw(corruption(len(blob))))
    path = str(tmp_path_factory.mktemp("npy") / "x.npy")
    with open(path, "wb") as f:
        f.write(bad)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        read_npy_header(path)
        parsed = True
    except LayoutError as e:
        assert path in str(e)
        parsed = False
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.monotonic() - t0 < 10
    # The header parser allocates a few times the header, which the file's size bounds.
    assert peak < (256 << 10) + 8 * len(bad), peak  # a fixed overhead (the error), never the claimed length
    try:
        result = gpulazy.from_files(path, device="cpu", cache=False).compute()
    except LayoutError as e:
        assert not parsed and path in str(e)
        return
    # It parsed: the values are what numpy reads from the same bytes.
    np.testing.assert_array_equal(result, np.load(path, allow_pickle=False))


@pytest.mark.timeout(30)
def test_unterminated_dict_literal_names_the_file(tmp_path):
    path = str(tmp_path / "broken.npy")
    np.save(path, np.arange(10))
    blob = open(path, "rb").read()
    i = blob.index(b"}")
    with open(path, "wb") as f:
        f.write(blob[:i] + b" " + blob[i + 1:])
    with pytest.raises(LayoutError, match="broken.npy.*TokenError"):
        read_npy_header(path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("version", [(2, 0), (3, 0)])
def test_a_4_gib_header_length_is_refused_before_reading(tmp_path, version):
    path = str(tmp_path / "huge.npy")
    buf = io.BytesIO()
    npformat.write_array(buf, np.zeros(3), version=version)
    blob = bytearray(buf.getvalue())
    blob[8:12] = struct.pack("<I", 2 ** 32 - 1)
    with open(path, "wb") as f:
        f.write(blob)
    tracemalloc.start()
    try:
        with pytest.raises(LayoutError, match="huge.npy.*header is 4294967295 bytes long"):
            read_npy_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert os.path.getsize(path) < 200


@pytest.mark.timeout(30)
def test_negative_shape_is_refused(tmp_path):
    path = str(tmp_path / "neg.npy")
    header = "{'descr': '<u2', 'fortran_order': False, 'shape': (-1, 0), }"
    header += " " * (64 - 10 - len(header) - 1) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
    with pytest.raises(LayoutError, match="neg.npy.*negative shape"):
        read_npy_header(path)
