"""The kvikio backend: conformance on a GPU; on a machine without one, honest unavailability."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gpulazy.device import Device, gpu_count
from gpulazy.errors import BackendUnavailableError
from gpulazy.io import _kvikio, get_backend, select_backend
from gpulazy.spec import ByteRange
from gpulazy.testing import BackendConformance, write_file

HAS_GPU = gpu_count() > 0

MODES = {"gds", "compat", "gds+compat"}


@pytest.mark.gpu
class TestKvikioCUDA(BackendConformance):
    __test__ = True
    backend_name = "kvikio"
    device = "cuda:0"

    def test_mode_is_gds_or_compat(self, backend, tmp_path):
        data = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
        path = write_file(tmp_path / "m.bin", data)
        self.read(backend, [ByteRange(path, 0, 4 << 20)])
        assert backend.mode in MODES
        assert backend.device_direct

    def test_availability_says_which_mode(self):
        ok, reason = _kvikio.KvikioBackend.availability(Device("cuda", 0))
        assert ok, reason
        assert "probe read" in reason and any(f"{m} mode" in reason for m in MODES)

    def test_auto_picks_kvikio_on_a_gpu(self):
        name, because = select_backend(Device("cuda", 0))
        assert name == "kvikio" and "KvikIO" in because

    def test_thread_count_reaches_kvikio(self):
        import kvikio.defaults

        own = _kvikio.KvikioBackend(Device("cuda", 0), threads=5, task_size=1 << 20)
        try:
            assert int(kvikio.defaults.get("num_threads")) == 5
        finally:
            own.close()


@pytest.mark.skipif(HAS_GPU, reason="checks the answer on a machine without a usable GPU")
def test_unavailable_without_a_gpu_says_why():
    ok, reason = _kvikio.KvikioBackend.availability(Device("cuda", 0))
    assert not ok
    assert "cuda:0" in reason and len(reason) > 20
    hits = _kvikio._probe.cache_info().hits
    assert _kvikio.KvikioBackend.availability(Device("cuda", 0)) == (ok, reason)
    assert _kvikio._probe.cache_info().hits == hits + 1  # probed once per device, then cached


def test_never_available_on_cpu():
    ok, reason = _kvikio.KvikioBackend.availability(Device("cpu"))
    assert not ok and "CUDA" in reason
    with pytest.raises(BackendUnavailableError, match="kvikio"):
        get_backend("kvikio", "cpu")


def test_cpu_reads_never_import_kvikio_or_cupy(tmp_path):
    path = write_file(tmp_path / "a.bin", np.arange(4096, dtype=np.uint16))
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import gpulazy
        from gpulazy.io import get_backend, read_chunk, select_backend
        from gpulazy.device import Device, gpu_count
        from gpulazy.spec import ByteRange, ChunkSpec
        backend = get_backend(None, "cpu")
        assert backend.name == "posix", backend
        assert select_backend(Device("cpu"))[0] == "posix"
        spec = ChunkSpec((ByteRange({path!r}, 0, 8192),), (64, 64), "<u2")
        arr = read_chunk(spec, backend)
        assert isinstance(arr, np.ndarray) and int(arr[63, 63]) == 4095
        leaked = [m for m in ("kvikio", "cupy") if m in sys.modules]
        print("LEAKED", leaked)
        sys.exit(1 if leaked else 0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LEAKED []" in proc.stdout


def test_mode_from_kvikio_counters():
    class Summary:
        def __init__(self, gds, posix):
            self.by_backend = {"GDS": {"num_ops": gds}, "POSIX": {"num_ops": posix}, "MMAP": {"num_ops": 0}}

    assert _kvikio._mode_from_summary(Summary(2, 0)) == "gds"
    assert _kvikio._mode_from_summary(Summary(0, 3)) == "compat"
    assert _kvikio._mode_from_summary(Summary(1, 1)) == "gds+compat"
    assert _kvikio._mode_from_summary(Summary(0, 0)) is None


def test_kvikio_eof_error_becomes_a_short_read(tmp_path):
    # KvikIO raises "POSIX error on pread: EOF" instead of returning a short count.
    path = write_file(tmp_path / "a.bin", b"x" * 1000)
    err = _kvikio._read_failure(ByteRange(path, 900, 300), RuntimeError("POSIX error on pread: EOF"))
    assert (err.path, err.offset, err.expected, err.got) == (path, 1000, 300, 100)
    assert isinstance(err.__cause__, RuntimeError)
    other = _kvikio._read_failure(ByteRange(path, 0, 10), RuntimeError("cuFileRead failed"))
    assert "cuFileRead failed" in str(other) and other.path == path
