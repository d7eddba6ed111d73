"""Optional packages and output paths are checked before a long command starts its work."""

from __future__ import annotations

import sys

import pytest

from gpulazy import _bench
from gpulazy.cli import main


@pytest.fixture
def no_run(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the benchmark ran before the check")

    monkeypatch.setattr(_bench, "run_suite", fail)
    monkeypatch.setattr(_bench, "generate", fail)


def test_bench_plot_without_matplotlib_fails_before_running(monkeypatch, capsys, tmp_path, no_run):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code = main(["bench", "--generate", "64KiB", "--device", "cpu", "--plot", str(tmp_path / "b.png")])
    err = capsys.readouterr().err
    assert code == 2
    assert "gpulazy bench --plot needs the package 'matplotlib'" in err and "gpulazy[notebook]" in err


@pytest.mark.parametrize("flag", ["--plot", "--json"])
def test_bench_output_into_a_missing_folder_fails_before_running(capsys, tmp_path, no_run, flag):
    target = str(tmp_path / "nope" / "out")
    code = main(["bench", "--generate", "64KiB", "--device", "cpu", flag, target])
    assert code == 2
    assert f"{flag} {target!r}: the folder" in capsys.readouterr().err
