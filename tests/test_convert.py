"""DLPack hand-off: zero-copy where possible, clear errors where not."""

from __future__ import annotations

import sys

import dask.array as da
import numpy as np
import pytest

import gpulazy
from gpulazy.convert import to_jax, to_numpy, to_torch
from gpulazy.errors import OptionalDependencyError



@pytest.fixture
def torch():
    """torch, or a visible skip where it is not installed."""
    return pytest.importorskip("torch")


# --- NumPy -> torch (CPU) ---

@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32", "float32", "float64", "bool"])
def test_to_torch_numpy_shares_memory(dtype, torch):
    a = np.zeros((3, 4), dtype=dtype)
    t = to_torch(a)
    assert t.device.type == "cpu"
    assert tuple(t.shape) == (3, 4)
    assert t.data_ptr() == a.ctypes.data
    t[1, 2] = 1
    assert a[1, 2] == 1
    a[0, 0] = 1
    assert bool(t[0, 0])


def test_to_torch_reexported_from_package():
    assert gpulazy.to_torch is to_torch
    assert gpulazy.to_numpy is to_numpy
    assert gpulazy.to_jax is to_jax


def test_to_torch_copy_true_does_not_share(torch):
    a = np.arange(6, dtype="float32")
    t = to_torch(a, copy=True)
    t[0] = 42
    assert a[0] == 0
    np.testing.assert_array_equal(t.numpy()[1:], a[1:])


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: np.arange(5, dtype="int32")[::-1], "negative strides"),
        (lambda: np.arange(5, dtype=">u2"), "byte order"),
        (lambda: _readonly(np.arange(5, dtype="int16")), "read-only"),
    ],
    ids=["negative-strides", "big-endian", "read-only"],
)
def test_to_torch_copies_only_when_it_must(make, why, torch):
    a = make()
    t = to_torch(a)
    np.testing.assert_array_equal(t.numpy(), a)
    assert t.numpy().dtype.isnative
    assert t.data_ptr() != a.ctypes.data
    with pytest.raises(ValueError, match=why):
        to_torch(a, copy=False)


def _readonly(a):
    a.flags.writeable = False
    return a


def test_to_torch_tensor_passthrough(torch):
    t = torch.arange(4)
    assert to_torch(t) is t
    c = to_torch(t, copy=True)
    assert c is not t and torch.equal(c, t)


def test_to_torch_rejects_dask_array_with_advice(torch):
    vol = da.zeros((4, 4), chunks=2)
    with pytest.raises(TypeError, match=r"\.compute\(\)") as e:
        to_torch(vol)
    assert "map_blocks" in str(e.value)
    assert "(4, 4)" in str(e.value)


@pytest.mark.parametrize("func", [to_numpy, to_jax])
def test_other_converters_reject_dask_array(func):
    with pytest.raises(TypeError, match=r"\.compute\(\)"):
        func(da.ones(3, chunks=1))


def test_to_torch_rejects_unknown_type(torch):
    with pytest.raises(TypeError, match="CuPy or NumPy"):
        to_torch(object())


def test_to_torch_missing_torch_names_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(OptionalDependencyError, match=r"pip install 'gpulazy\[torch\]'") as e:
        to_torch(np.zeros(2))
    assert isinstance(e.value, ImportError)


# --- JAX (not installed here: its error must say what to install) ---

def test_to_jax_missing_jax_names_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)
    with pytest.raises(ImportError, match=r"pip install 'gpulazy\[jax\]'") as e:
        to_jax(np.zeros(2))
    assert "jax" in str(e.value)
    assert isinstance(e.value, OptionalDependencyError)


def test_to_jax_numpy_when_installed():
    jax = pytest.importorskip("jax")
    a = np.arange(6, dtype="float32").reshape(2, 3)
    j = to_jax(a)
    assert isinstance(j, jax.Array)
    np.testing.assert_array_equal(np.asarray(j), a)
    np.testing.assert_array_equal(np.asarray(to_jax(a[:, ::-1])), a[:, ::-1])


# --- to_numpy ---

def test_to_numpy_numpy_is_identity_unless_copy():
    a = np.arange(3)
    assert to_numpy(a) is a
    b = to_numpy(a, copy=True)
    assert b is not a
    np.testing.assert_array_equal(a, b)


def test_to_numpy_from_cpu_tensor_shares_memory(torch):
    t = torch.arange(4, dtype=torch.float32)
    a = to_numpy(t)
    a[0] = 9
    assert float(t[0]) == 9
    c = to_numpy(t, copy=True)
    c[1] = 5
    assert float(t[1]) == 1


def test_to_numpy_array_like():
    np.testing.assert_array_equal(to_numpy([1, 2, 3]), np.array([1, 2, 3]))


# --- CuPy (real GPU only) ---

@pytest.mark.gpu
def test_cupy_to_torch_shares_cuda_memory(torch):
    import cupy as cp

    x = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    t = to_torch(x)
    assert t.is_cuda
    assert t.device.index == x.device.id
    assert t.data_ptr() == x.data.ptr
    t[1, 1] = -5.0  # write through torch ...
    torch.cuda.synchronize()
    assert float(x[1, 1]) == -5.0  # ... seen by CuPy
    x[2, 3] = 100.0  # and the other way round
    cp.cuda.get_current_stream().synchronize()
    assert float(t[2, 3]) == 100.0


@pytest.mark.gpu
def test_cupy_to_torch_copy_and_strides(torch):
    import cupy as cp

    x = cp.arange(10, dtype=cp.uint16)
    t = to_torch(x, copy=True)
    assert t.data_ptr() != x.data.ptr
    np.testing.assert_array_equal(t.cpu().numpy(), x.get())
    r = x[::-2]
    np.testing.assert_array_equal(to_torch(r).cpu().numpy(), r.get())


@pytest.mark.gpu
def test_cupy_to_numpy_copies_to_host(torch):
    import cupy as cp

    x = cp.arange(5, dtype=cp.int64)
    a = to_numpy(x)
    assert isinstance(a, np.ndarray)
    np.testing.assert_array_equal(a, np.arange(5))
    with pytest.raises(ValueError, match="GPU memory"):
        to_numpy(x, copy=False)
    t = torch.arange(3, device="cuda")
    np.testing.assert_array_equal(to_numpy(t), np.arange(3))


class _Producer:
    """A bare DLPack producer (not NumPy, not CuPy), like other array libraries."""

    def __init__(self, a):
        self._a = a
        self.strides = a.strides

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    def copy(self):
        return _Producer(np.ascontiguousarray(self._a))


def test_to_torch_other_dlpack_producer(torch):
    a = np.arange(6, dtype="int32")
    t = to_torch(_Producer(a))
    t[0] = 7
    assert a[0] == 7
    # negative strides would abort torch's DLPack import: gpulazy copies instead
    r = to_torch(_Producer(a[::-2]))
    np.testing.assert_array_equal(r.numpy(), a[::-2])
    with pytest.raises(ValueError, match="negative strides"):
        to_torch(_Producer(a[::-1]), copy=False)
