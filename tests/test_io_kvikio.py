"""The kvikio backend: conformance on a GPU; on a machine without one, honest unavailability."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from gpulazy.device import Device, gpu_count
from gpulazy.errors import BackendUnavailableError, ChunkReadError
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

    def test_reads_leave_the_cufile_driver_alone_and_info_asks_it(self, monkeypatch):
        # Asking the cuFile driver whether GDS is available opens it: 0.23 s of a process's first
        # read on an H100 host. Only ``gpulazy info`` asks.
        import kvikio.cufile_driver

        from gpulazy.cli import collect_info

        asked: list[str] = []
        real = kvikio.cufile_driver.get
        monkeypatch.setattr(kvikio.cufile_driver, "get", lambda name: asked.append(name) or real(name))
        _kvikio._probe.cache_clear()
        ok, reason = _kvikio.KvikioBackend.availability(Device("cuda", 0))
        assert ok and "cuFile GDS available" not in reason and asked == []
        info = collect_info("cuda:0")
        assert "is_gds_available" in asked and "cuFile GDS available" in info["gds"]["reason"]

    def test_auto_picks_kvikio_on_a_gpu(self):
        name, because = select_backend(Device("cuda", 0))
        assert name == "kvikio" and "KvikIO" in because

    @pytest.mark.parametrize("staged", [True, False])
    def test_batch_is_finished_by_polling_or_by_another_thread(self, backend, tmp_path, staged):
        """Submitted by this thread, no waiting thread of the backend's: done() alone
        completes a job (staged: issues its copy), result() from another thread the rest."""
        import cupy as cp

        data = np.random.default_rng(1).integers(0, 256, 6 << 20, dtype=np.uint8)
        path = write_file(tmp_path / "b.bin", data)
        outs = [cp.zeros(2 << 20, np.uint8) for _ in range(3)]
        futs = backend.submit_many([([ByteRange(path, i << 21, 2 << 20)], o) for i, o in enumerate(outs)],
                                   staged=staged)
        deadline = time.monotonic() + 30
        while not futs[0].done():
            assert time.monotonic() < deadline, "job 0 never completed by polling"
        got: list = []
        t = threading.Thread(target=lambda: got.extend(f.result() for f in futs[1:]))
        t.start()
        t.join(30)
        assert futs[0].result() == 2 << 20 and got == [2 << 20, 2 << 20]
        for i, o in enumerate(outs):
            np.testing.assert_array_equal(cp.asnumpy(o), data[i << 21:(i + 1) << 21])
        assert not backend._batches                      # every batch closed: handles given back

    def test_a_job_finishes_while_a_thread_holds_another_job_of_its_batch(self, backend, tmp_path):
        """Each job of a batch is waited for under its own lock: while a thread is inside job 0
        (held here by the test, as a thread blocked on job 0's read would hold it), job 1 is
        moved on by polling and finished by another thread."""
        import cupy as cp

        data = np.random.default_rng(2).integers(0, 256, 4 << 20, dtype=np.uint8)
        path = write_file(tmp_path / "j.bin", data)
        outs = [cp.zeros(2 << 20, np.uint8) for _ in range(2)]
        futs = backend.submit_many([([ByteRange(path, i << 21, 2 << 20)], o) for i, o in enumerate(outs)],
                                   staged=True)
        batch = futs[0]._parts[0].batch
        with batch._locks[0]:
            deadline = time.monotonic() + 30
            while not futs[1].done():
                assert time.monotonic() < deadline, "job 1 never completed by polling"
            got: list = []
            t = threading.Thread(target=lambda: got.append(futs[1].result()))
            t.start()
            t.join(30)
            assert got == [2 << 20]
            np.testing.assert_array_equal(cp.asnumpy(outs[1]), data[2 << 20:])
        assert futs[0].result() == 2 << 20
        np.testing.assert_array_equal(cp.asnumpy(outs[0]), data[:2 << 20])
        assert not backend._batches

    def test_one_failing_job_leaves_the_others(self, backend, tmp_path):
        import cupy as cp

        data = np.arange(1 << 20, dtype=np.uint8)
        path = write_file(tmp_path / "short.bin", data)
        outs = [cp.zeros(1 << 19, np.uint8), cp.zeros(1 << 20, np.uint8)]
        futs = backend.submit_many([([ByteRange(path, 0, 1 << 19)], outs[0]),
                                    ([ByteRange(path, 1 << 19, 1 << 20)], outs[1])], staged=True)
        with pytest.raises(ChunkReadError, match="short.bin"):
            futs[1].result()
        assert futs[0].result() == 1 << 19
        np.testing.assert_array_equal(cp.asnumpy(outs[0]), data[: 1 << 19])

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
        from gpulazy.io import get_backend, select_backend
        from gpulazy.read import read
        from gpulazy.device import Device, gpu_count
        from gpulazy.spec import ByteRange, ChunkSpec
        backend = get_backend(None, "cpu")
        assert backend.name == "posix", backend
        assert select_backend(Device("cpu"))[0] == "posix"
        spec = ChunkSpec((ByteRange({path!r}, 0, 8192),), (64, 64), "<u2")
        arr = read([spec], backend)[0]
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
