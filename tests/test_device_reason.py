"""Why no GPU is used: no driver/device, a driver too old, or no CuPy, each with what to do."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpulazy.device import gpu_count, gpu_unavailable_reason, no_gpu_reason
from gpulazy.errors import DeviceError


def test_no_driver():
    why = no_gpu_reason(error="CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version is "
                              "insufficient for CUDA runtime version", driver=0, runtime=13020)
    assert why.startswith("no NVIDIA driver or GPU found")
    assert "insufficient" not in why and "nvidia-smi" in why and "CPU" in why


def test_driver_without_device():
    why = no_gpu_reason(error="CUDARuntimeError: cudaErrorNoDevice: no CUDA-capable device is detected",
                        driver=13000, runtime=13000)
    assert why.startswith("no NVIDIA GPU found (the driver, for CUDA 13.0, reports no CUDA device)")


def test_hidden_by_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    why = no_gpu_reason(error="CUDARuntimeError: cudaErrorNoDevice", driver=13000, runtime=13000)
    assert "CUDA_VISIBLE_DEVICES" in why and "unset it" in why


def test_driver_too_old_says_both_versions_and_what_to_install():
    why = no_gpu_reason(error="CUDARuntimeError: cudaErrorInsufficientDriver", driver=12020, runtime=13000)
    assert why.startswith("the NVIDIA driver is too old for this CUDA build")
    assert "driver supports CUDA 12.2" in why and "built for CUDA 13.0" in why
    assert "cupy-cuda12x" in why and "update the NVIDIA driver" in why


def test_other_errors_keep_their_text():
    why = no_gpu_reason(error="CUDARuntimeError: cudaErrorUnknown", driver=13000, runtime=13000)
    assert "cudaErrorUnknown" in why


@pytest.mark.skipif(gpu_count() > 0, reason="this host has a usable GPU")
def test_this_hosts_reason_matches_its_driver():
    try:
        import cupy
    except ImportError:
        assert gpu_unavailable_reason().startswith("CuPy is not installed")
        return
    try:
        driver = cupy.cuda.runtime.driverGetVersion()
    except Exception:
        driver = 0
    why = gpu_unavailable_reason()
    if driver == 0:
        assert why.startswith("no NVIDIA driver or GPU found"), why
        assert "insufficient" not in why
    with pytest.raises(DeviceError, match="is not usable: " + why[:20]):
        from gpulazy.device import get_device

        get_device("cuda:0")


def test_cupy_not_installed_in_a_fresh_interpreter():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "from gpulazy.device import gpu_unavailable_reason, get_device\n"
            "print(gpu_unavailable_reason()); print(get_device().name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    reason, device = out.strip().splitlines()
    assert reason.startswith("CuPy is not installed") and "pip install 'gpulazy[gpu]'" in reason
    assert device == "cpu"
