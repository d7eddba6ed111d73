"""Backend registry: names, entry points, deterministic ``"auto"`` selection, cached instances."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import gpulazy
from gpulazy import io as gio
from gpulazy.device import Device, gpu_count
from gpulazy.errors import BackendUnavailableError, ConfigError
from gpulazy.io import Backend, ReadFuture, backend_class, backend_names, get_backend, select_backend
from gpulazy.spec import ByteRange
from gpulazy.testing import file_bytes, write_file

HAS_GPU = gpu_count() > 0


class BytesBackend(Backend):
    """A third-party backend: serves reads from an in-memory dict ``{path: bytes}``."""

    name = "bytes"
    devices = frozenset({"cpu"})
    files: dict[str, bytes] = {}

    @classmethod
    def availability(cls, device):
        return True, "always"

    def submit(self, ranges, out):
        self._check_open()
        self._check_out(ranges, out)
        dst = 0
        for r in ranges:
            out[dst: dst + r.nbytes] = np.frombuffer(self.files[r.path][r.offset: r.offset + r.nbytes], np.uint8)
            dst += r.nbytes
        return ReadFuture.completed(dst)


@pytest.fixture
def plugin(monkeypatch):
    module = types.ModuleType("gpulazy_test_plugin")
    module.BytesBackend = BytesBackend
    monkeypatch.setitem(sys.modules, "gpulazy_test_plugin", module)
    monkeypatch.setattr(gio, "_entry_points", lambda: {"bytes": "gpulazy_test_plugin:BytesBackend",
                                                       "posix": "gpulazy_test_plugin:BytesBackend"})
    yield
    for key, b in list(gio._instances.items()):
        if b.name == "bytes":
            gio._instances.pop(key)


def test_builtin_names_first():
    assert backend_names()[:3] == ["kvikio", "posix", "directstorage"]


def test_unknown_backend_lists_valid_ones():
    with pytest.raises(ConfigError) as info:
        get_backend("nvme-magic", "cpu")
    message = str(info.value)
    for name in ("'nvme-magic'", "'auto'", "'kvikio'", "'posix'", "'directstorage'"):
        assert name in message


def test_entry_point_backends_are_found(plugin, tmp_path):
    assert backend_names() == ["kvikio", "posix", "directstorage", "bytes"]
    assert backend_class("bytes") is BytesBackend
    # An entry point cannot shadow a built-in.
    assert backend_class("posix").__module__ == "gpulazy.io._posix"
    BytesBackend.files = {"mem://a": bytes(range(200))}
    out = np.empty(5, np.uint8)
    assert get_backend("bytes", "cpu").read_into([ByteRange("mem://a", 10, 5)], out) == 5
    assert out.tolist() == [10, 11, 12, 13, 14]


def test_entry_point_backend_refuses_other_devices(plugin):
    # A Device object passes through get_device unchecked, so this runs without a GPU.
    with pytest.raises(BackendUnavailableError, match=r"cannot read into device 'cuda:0'; it supports \['cpu'\]"):
        get_backend("bytes", Device("cuda", 0))


def test_auto_on_cpu_is_posix_with_a_reason():
    first = select_backend(Device("cpu"))
    assert first == select_backend(Device("cpu"))  # deterministic
    name, reason = first
    assert name == "posix" and "cpu" in reason


@pytest.mark.skipif(HAS_GPU, reason="checks the fallback on a machine without a usable GPU")
def test_auto_on_cuda_without_kvikio_falls_back_with_kvikios_reason():
    name, reason = select_backend(Device("cuda", 0))
    assert name == "posix"
    assert "KvikIO is not usable" in reason and "pinned host buffers" in reason
    assert select_backend(Device("cuda", 0)) == (name, reason)


@pytest.mark.gpu
def test_auto_on_cuda_picks_kvikio_when_its_probe_works():
    name, reason = select_backend(Device("cuda", 0))
    assert name == "kvikio", reason
    backend = get_backend(None, "cuda:0")
    assert backend.name == "kvikio" and backend.selected_because == reason


def test_get_backend_follows_config_and_says_why(tmp_path):
    backend = get_backend(None, "cpu")
    assert backend.name == "posix"
    assert backend.selected_because == select_backend(Device("cpu"))[1]
    with gpulazy.config.set(backend="posix"):
        named = get_backend(None, "cpu")
    assert named.name == "posix"
    with gpulazy.config.set(backend="nope"), pytest.raises(ConfigError, match="nope"):
        get_backend(None, "cpu")


def test_instances_are_shared_per_settings(tmp_path):
    a = get_backend("posix", "cpu", threads=2, task_size=1 << 16)
    assert get_backend("posix", "cpu", threads=2, task_size=1 << 16) is a
    b = get_backend("posix", "cpu", threads=3, task_size=1 << 16)
    assert b is not a and (b.threads, b.task_size) == (3, 1 << 16)
    with gpulazy.config.set(threads=2, task_size="64 KiB"):
        assert get_backend("posix", "cpu") is a
    path = write_file(tmp_path / "a.bin", np.arange(100, dtype=np.uint8))
    out = np.empty(10, np.uint8)
    b.read_into([ByteRange(path, 90, 10)], out)
    np.testing.assert_array_equal(out, file_bytes(path, 90, 10))


def test_kvikio_refused_on_cpu_says_why():
    with pytest.raises(BackendUnavailableError, match="cannot read into device 'cpu'"):
        get_backend("kvikio", "cpu")


@pytest.mark.parametrize("cores, threads", [(1, 4), (6, 6), (16, 16), (128, 32)])
def test_default_io_threads_are_one_per_core_this_process_may_use(monkeypatch, cores, threads):
    """Two threads a core oversubscribed a 16-core host (KvikIO's 32 threads against the threads
    that submit and settle reads); at least 4, at most 32."""
    import os

    from gpulazy import config

    monkeypatch.delenv("GPULAZY_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 1000)  # the affinity counts, not the machine's cores
    default, _, _ = config.KEYS["threads"]
    assert default() == threads
    with config.set(threads=None):  # back to the default
        assert config.get("threads") == threads
