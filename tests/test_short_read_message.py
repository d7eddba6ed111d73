"""A short read says which byte range was asked for and where the file ended, once each."""

from __future__ import annotations

import re

import numpy as np
import pytest

import gpulazy
from gpulazy.errors import ChunkReadError
from gpulazy.io import get_backend
from gpulazy.spec import ByteRange


def test_short_read_names_the_range_and_the_end_of_file(tmp_path):
    # (Through from_files a truncation is caught earlier, as "the file changed since it was
    # indexed"; the backend's own message is what a read that races a truncation reports.)
    p = tmp_path / "vol.raw"
    np.zeros((4, 1000), "u1").tofile(p)
    with open(p, "r+b") as f:
        f.truncate(2500)  # bytes 2000 to 4000 now have 500 bytes
    be = get_backend("posix", gpulazy.get_device("cpu"))
    with pytest.raises(ChunkReadError) as info:
        be.submit([ByteRange(str(p), 2000, 2000)], np.empty(2000, np.uint8)).result(timeout=30)
    message, err = str(info.value), info.value
    assert f"short read of {str(p)!r}: asked for bytes 2000 to 4000 (2000 bytes) but the file ends at byte 2500, " \
           "so 500 were read" in message
    assert (err.path, err.offset, err.expected, err.got) == (str(p), 2500, 2000, 500)
    assert message.count("2500") == 1 and "at offset" not in message


def test_pieces_of_one_range_report_the_same_figures(tmp_path):
    # Read in 4 KiB tasks: every piece past the end reports the file's end, not its own offset.
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(10_000))
    be = get_backend("posix", gpulazy.get_device("cpu"))
    with gpulazy.config.set(task_size=4096), pytest.raises(ChunkReadError) as info:
        be.submit([ByteRange(str(p), 1000, 50_000)], np.empty(50_000, np.uint8)).result(timeout=30)
    assert re.search(r"asked for bytes 1000 to 51000 \(50000 bytes\) but the file ends at byte 10000, "
                     r"so 9000 were read", str(info.value))
