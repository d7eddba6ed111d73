"""``gpulazy --version`` and ``gpulazy index PATH`` without options (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import gpulazy
from gpulazy.checksums import MANIFEST_NAME
from gpulazy.cli import main


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"gpulazy {gpulazy.__version__}"


def test_python_dash_m_version():
    r = subprocess.run([sys.executable, "-m", "gpulazy", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"gpulazy {gpulazy.__version__}"


@pytest.mark.parametrize("argv", [[], ["--checksum"]], ids=["default", "--checksum"])
def test_index_path_writes_the_manifest_with_or_without_checksum(tmp_path, capsys, argv):
    for i in range(2):
        np.full(1000, i, "u1").tofile(tmp_path / f"s{i}.raw")
    assert main(["index", str(tmp_path), *argv, "--block-size", "300"]) == 0
    out = capsys.readouterr().out
    assert f"checksumming {tmp_path} in blocks of 300" in out and f"wrote {tmp_path / MANIFEST_NAME}" in out
    files = json.loads((tmp_path / MANIFEST_NAME).read_text())["files"]
    assert sorted(files) == ["s0.raw", "s1.raw"] and files["s0.raw"]["block_size"] == 300
    # and the manifest is what verified reads check against
    vol = gpulazy.from_files(str(tmp_path), shape=(1000,), dtype="u1", device="cpu", verify=True)
    assert np.array_equal(vol.compute(), np.repeat(np.arange(2, dtype="u1")[:, None], 1000, axis=1))


def test_index_of_a_missing_path_fails_naming_it(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert main(["index", missing]) == 2
    assert "nope" in capsys.readouterr().err
