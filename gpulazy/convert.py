"""Hand chunks to torch, JAX or NumPy without copying them when that is possible.

CuPy arrays go through DLPack, so a torch tensor or JAX array made from a chunk on
``cuda:N`` is on ``cuda:N`` and shares its memory; NumPy arrays become CPU tensors
that share their memory. ``to_numpy`` is the way back to the host (a device-to-host
copy for CuPy, the same array for NumPy).

Every function takes a ``copy`` flag with the array-API meaning: ``None`` (default)
shares memory when it can and copies when it must (a read-only, byte-swapped or
negatively strided NumPy array), ``True`` always copies, ``False`` never copies and
raises ``ValueError`` when sharing is impossible.

Lazy (dask) arrays are refused with a ``TypeError``: converting one would read the
whole array behind the caller's back. Call ``.compute()`` first, or convert chunk by
chunk with ``vol.map_blocks(...)``.

>>> import numpy as np, gpulazy
>>> a = np.arange(6, dtype="float32").reshape(2, 3)
>>> t = gpulazy.to_torch(a)          # doctest: +SKIP
>>> t[0, 0] = 7; float(a[0, 0])       # doctest: +SKIP
7.0
>>> gpulazy.to_numpy(a) is a
True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpulazy.errors import missing_dependency

__all__ = ["to_torch", "to_jax", "to_numpy", "to_cupy", "on"]


# --- what kind of array is this? (without importing cupy, torch, jax or dask) ---

def _module_of(x: Any) -> str:
    return type(x).__module__.split(".", 1)[0]


def _is_cupy(x: Any) -> bool:
    return _module_of(x) == "cupy" and hasattr(x, "__dlpack__")


def _is_torch(x: Any) -> bool:
    return _module_of(x) == "torch" and hasattr(x, "__dlpack__")


def _is_dask(x: Any) -> bool:
    return hasattr(x, "__dask_graph__") and callable(getattr(x, "__dask_graph__"))


def _refuse_lazy(x: Any, func: str) -> None:
    """Raise the ``TypeError`` that tells the user how to convert a dask array."""
    if not _is_dask(x):
        return
    shape = getattr(x, "shape", "?")
    raise TypeError(
        f"gpulazy.{func} got a lazy dask array (shape {shape}); converting it would read all of it. "
        f"Call .compute() first (gpulazy.{func}(vol.compute())), or convert each chunk with "
        f"vol.map_blocks(gpulazy.{func}, ...) inside your own pipeline."
    )


def _numpy_needs_copy(a: np.ndarray) -> str:
    """Why ``a`` cannot be shared with torch as it is, or ``""`` if it can."""
    if not a.flags.writeable:
        # torch tensors are always writable: sharing would let a write corrupt the owner.
        return "it is read-only"
    if not a.dtype.isnative:
        return f"its byte order ({a.dtype.str}) is not native"
    if any(s < 0 for s in a.strides):
        return "it has negative strides"
    return ""


def _no_copy_error(kind: str, why: str) -> ValueError:
    return ValueError(
        f"cannot hand this {kind} over without a copy: {why}; pass copy=None (copy only when needed) "
        f"or copy=True"
    )


# --- torch ---

def _require(module: str, extra: str, feature: str) -> Any:
    """``module`` imported, or the ImportError that names the extra installing it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise missing_dependency(module.partition(".")[0], extra, feature) from e


def _torch_from_numpy(torch: Any, a: np.ndarray, copy: bool | None) -> Any:
    why = _numpy_needs_copy(a)
    if copy is False and why:
        raise _no_copy_error("NumPy array", why)
    if copy or why:
        a = np.array(a, dtype=a.dtype.newbyteorder("="), order="C", copy=True)
    return torch.from_numpy(a)


def _negative_strides(x: Any) -> bool:
    return any(s < 0 for s in (getattr(x, "strides", None) or ()))


def _contiguous(x: Any) -> Any:
    """A C-contiguous copy of a CuPy (or other array-API) array."""
    if _is_cupy(x):
        import cupy

        return cupy.ascontiguousarray(x)
    return x.copy()


def _torch_from_dlpack(torch: Any, x: Any, copy: bool | None) -> Any:
    # torch 2.13 aborts the whole process (an uncaught C++ error) on a DLPack
    # tensor with negative strides, so such arrays never reach it.
    if _negative_strides(x):
        if copy is False:
            raise _no_copy_error(type(x).__name__, "it has negative strides")
        return torch.from_dlpack(_contiguous(x))
    return torch.from_dlpack(x.copy() if copy else x)


def to_torch(x: Any, *, device: Any = None, copy: bool | None = None) -> Any:
    """A ``torch.Tensor`` sharing ``x``'s memory: CUDA for CuPy, CPU for NumPy.

    With ``device=`` (``"cpu"``, ``"cuda:1"``, ...) the tensor lands there: zero-copy
    when ``x`` already is on that device, one copy otherwise.

    Parameters
    ----------
    x
        A CuPy array (DLPack, stays on its GPU), a NumPy array (``torch.from_numpy``),
        or a torch tensor (returned as is, unless ``copy=True``).
    device
        Where the tensor must be (``"cpu"``, ``"cuda:N"``, a ``torch.device``); ``None``:
        where ``x`` is.
    copy
        ``None``: share when possible; ``True``: always copy; ``False``: raise
        ``ValueError`` rather than copy.

    Raises
    ------
    TypeError
        For a dask array (compute it first) or an object torch cannot take.
    OptionalDependencyError
        If torch is not installed (``pip install 'gpulazy[torch]'``).

    Examples
    --------
    >>> import numpy as np, gpulazy
    >>> t = gpulazy.to_torch(np.ones((2, 2), dtype="uint16"))   # doctest: +SKIP
    >>> t.dtype, t.device                                       # doctest: +SKIP
    (torch.uint16, device(type='cpu'))
    """
    _refuse_lazy(x, "to_torch")
    torch = _require("torch", "torch", "gpulazy.to_torch")
    target = _target(device)
    if target is not None and _device_of(x) != target.name:
        return _moved(to_torch(x), target, copy)  # share where it is, then one copy to the target
    if isinstance(x, torch.Tensor):
        return x.clone() if copy else x
    if isinstance(x, np.ndarray):
        return _torch_from_numpy(torch, x, copy)
    if hasattr(x, "__dlpack__"):  # CuPy and any other DLPack producer
        return _torch_from_dlpack(torch, x, copy)
    raise TypeError(
        f"gpulazy.to_torch expects a CuPy or NumPy array (or any DLPack producer), got {type(x).__name__}"
    )


# --- jax ---

def to_jax(x: Any, *, device: Any = None, copy: bool | None = None) -> Any:
    """A ``jax.Array`` from a CuPy array (DLPack, same GPU) or a NumPy array (CPU).

    JAX arrays are immutable, so a shared buffer must not be written through ``x``
    afterwards; pass ``copy=True`` when ``x`` will change.

    Parameters
    ----------
    x
        A CuPy or NumPy array, or any DLPack producer.
    device
        Where the result must be (``"cpu"``, ``"cuda:N"``); moved there if ``x`` is elsewhere.
    copy
        ``None``: share when possible; ``True``: always copy; ``False``: raise
        ``ValueError`` rather than copy.

    Raises
    ------
    TypeError
        For a dask array (compute it first).
    OptionalDependencyError
        If JAX is not installed (``pip install 'gpulazy[jax]'``).
    """
    _refuse_lazy(x, "to_jax")
    _require("jax.dlpack", "jax", "gpulazy.to_jax")
    jax = _require("jax", "jax", "gpulazy.to_jax")
    target = _target(device)
    if target is not None and _device_of(x) != target.name:
        # JAX moves arrays between its own devices; hand it over where it is, then move.
        if copy is False:
            raise _no_copy_error(type(x).__name__, f"it is on {_device_of(x)}, not {target.name}")
        return jax.device_put(to_jax(x), _jax_device(jax, target))
    if isinstance(x, jax.Array):
        return jax.numpy.array(x, copy=True) if copy else x
    if isinstance(x, np.ndarray):
        return _jax_from_numpy(jax, x, copy)
    if _negative_strides(x):
        if copy is False:
            raise _no_copy_error(type(x).__name__, "it has negative strides")
        x = _contiguous(x)
    elif copy:
        x = x.copy()
    return jax.dlpack.from_dlpack(x)


def _jax_from_numpy(jax: Any, a: np.ndarray, copy: bool | None) -> Any:
    why = _numpy_needs_copy(a)
    if copy is False and why:
        raise _no_copy_error("NumPy array", why)
    if copy or why:
        a = np.array(a, dtype=a.dtype.newbyteorder("="), order="C", copy=True)
    try:
        return jax.dlpack.from_dlpack(a)
    except (BufferError, RuntimeError, TypeError) as e:
        # Some JAX builds cannot import host buffers (alignment, platform).
        if copy is False:
            raise _no_copy_error("NumPy array", f"JAX refused to share it ({e})") from e
        return jax.numpy.array(a)


# --- numpy ---

def to_numpy(x: Any, *, device: Any = None, copy: bool | None = None) -> np.ndarray:
    """A NumPy array on the host: ``x`` itself for NumPy, a device-to-host copy for CuPy.

    Parameters
    ----------
    x
        A NumPy, CuPy, torch (CPU or CUDA) or JAX array, or anything ``np.asarray`` takes.
    copy
        ``None``: share when possible (NumPy, CPU tensors); ``True``: always a new array;
        ``False``: raise ``ValueError`` for a device array, which cannot be shared.

    Raises
    ------
    TypeError
        For a dask array (compute it first).

    Examples
    --------
    >>> import numpy as np, gpulazy
    >>> a = np.arange(3)
    >>> gpulazy.to_numpy(a) is a, gpulazy.to_numpy(a, copy=True) is a
    (True, False)
    """
    _refuse_lazy(x, "to_numpy")
    if device is not None and str(device) != "cpu":
        from gpulazy.errors import DeviceError

        raise DeviceError(f"to_numpy(device={device!r}): NumPy arrays live on the host ('cpu'); "
                          "use to_cupy/to_torch/to_jax for a GPU")
    if isinstance(x, np.ndarray):
        return x.copy() if copy else x
    if _is_cupy(x):
        if copy is False:
            raise _no_copy_error("CuPy array", "it lives in GPU memory")
        return x.get()
    if _is_torch(x):
        t = x.detach()
        if t.device.type != "cpu":
            if copy is False:
                raise _no_copy_error("torch tensor", f"it lives on {t.device}")
            return t.cpu().numpy()
        out = t.numpy()
        return out.copy() if copy else out
    return np.array(x, copy=True) if copy else np.asarray(x)


# --- cupy ---

def to_cupy(x: Any, *, device: Any = None, copy: bool | None = None) -> Any:
    """A CuPy array: zero-copy through DLPack for CUDA arrays on the same GPU, else a copy.

    Parameters
    ----------
    x
        A CuPy, NumPy, torch or JAX array (any DLPack producer or ``np.asarray`` input).
    device
        ``"cuda:N"`` (default: ``x``'s GPU, or the current one for host arrays).
    copy
        ``None``: share when possible; ``True``: always copy; ``False``: raise
        ``ValueError`` rather than copy (a host array always needs one).

    Raises
    ------
    OptionalDependencyError
        Without CuPy (``pip install 'gpulazy[gpu]'``).
    DeviceError
        For ``device="cpu"`` (CuPy arrays live on GPUs: use ``to_numpy``).
    """
    _refuse_lazy(x, "to_cupy")
    if _names_host(device):  # before CuPy is needed: no install makes a CuPy array on the host
        _refuse_host_for_cupy(device)
    cupy = _require("cupy", "gpu", "gpulazy.to_cupy")
    target = _target(device)
    if target is not None and not target.is_gpu:
        _refuse_host_for_cupy(device)
    where = _device_of(x)
    if not where.startswith("cuda"):
        if copy is False:
            raise _no_copy_error(type(x).__name__, "it lives in host memory")
        with (target or _current_gpu()).activate():
            return cupy.asarray(to_numpy(x))
    if target is not None and where != target.name:
        if copy is False:
            raise _no_copy_error(type(x).__name__, f"it is on {where}, not {target.name}")
        src = x if _is_cupy(x) else cupy.from_dlpack(x)
        with target.activate():
            return cupy.array(src, copy=True)  # a peer copy between GPUs
    if _is_cupy(x):
        return x.copy() if copy else x
    out = cupy.from_dlpack(x)
    return out.copy() if copy else out


# --- devices ---

def _names_host(device: Any) -> bool:
    """Whether a ``device=`` argument plainly names the host (``"cpu"``, a ``cpu`` Device or torch device)."""
    text = str(getattr(device, "name", device)) if device is not None else ""
    return text.partition(":")[0].lower() == "cpu"


def _refuse_host_for_cupy(device: Any) -> None:
    from gpulazy.errors import DeviceError

    raise DeviceError(f"to_cupy(device={device!r}): CuPy arrays live on a GPU; use gpulazy.to_numpy for the host")


def _target(device: Any) -> Any:
    """The ``gpulazy.device.Device`` for a ``device=`` argument, or ``None``."""
    if device is None:
        return None
    from gpulazy.device import Device, get_device

    if isinstance(device, Device):
        return device
    text = str(device)  # also a torch.device or a jax Device's "cuda:0" / "gpu:0"
    return get_device(text.replace("gpu:", "cuda:") if text.startswith("gpu:") else text)


def _current_gpu() -> Any:
    from gpulazy.device import get_device

    import cupy

    return get_device(f"cuda:{cupy.cuda.runtime.getDevice()}")


def _device_of(x: Any) -> str:
    """``"cpu"`` or ``"cuda:N"``: where ``x``'s memory is (without importing anything)."""
    if isinstance(x, np.ndarray):
        return "cpu"
    if _is_cupy(x):
        return f"cuda:{x.device.id}"
    dev = getattr(x, "device", None)
    if _is_torch(x):
        return "cpu" if dev.type == "cpu" else f"cuda:{dev.index or 0}"
    devices = getattr(x, "devices", None)  # jax.Array
    if callable(devices):
        (d,) = tuple(devices())
        return "cpu" if d.platform == "cpu" else f"cuda:{d.id}"
    return "cpu"


def _moved(t: Any, target: Any, copy: bool | None) -> Any:
    if copy is False:
        raise _no_copy_error("array", f"it is on {t.device}, not {target.name}")
    return t.to(target.name, non_blocking=False)


def _jax_device(jax: Any, target: Any) -> Any:
    if not target.is_gpu:
        return jax.devices("cpu")[0]
    return jax.devices("gpu")[target.index]


# --- decorator ---

_CONVERTERS = {"torch": "to_torch", "jax": "to_jax", "cupy": "to_cupy", "numpy": "to_numpy"}


def _is_array(x: Any) -> bool:
    return (isinstance(x, np.ndarray) or _is_cupy(x) or _is_torch(x)
            or (hasattr(x, "__dlpack__") and hasattr(x, "shape") and not _is_dask(x)))


def on(framework: str, device: Any = None, *, result: str | None = None) -> Any:
    """Decorator: a function's array arguments arrive as ``framework`` arrays on ``device``.

    ``@gpulazy.on("torch", device="cuda:0")`` converts every positional and keyword
    argument that is an array (NumPy, CuPy, torch, JAX) with ``to_torch(x, device=...)``
    — zero-copy where the array already is on that device — and leaves other arguments
    alone. ``result="cupy"`` (or ``"numpy"``, ``"torch"``, ``"jax"``) converts the
    returned array (or each array in a returned tuple/list) back; ``None`` leaves it.

    Examples
    --------
    >>> import numpy as np, gpulazy
    >>> @gpulazy.on("numpy")
    ... def total(a, scale=1):
    ...     return a.sum() * scale
    >>> int(total(np.arange(4), scale=2))
    12
    """
    if framework not in _CONVERTERS or (result is not None and result not in _CONVERTERS):
        bad = framework if framework not in _CONVERTERS else result
        raise ValueError(f"gpulazy.on: unknown framework {bad!r}; valid: {', '.join(map(repr, _CONVERTERS))}")
    import functools

    def convert_in(x: Any) -> Any:
        if not _is_array(x):
            return x
        fn = globals()[_CONVERTERS[framework]]
        return fn(x) if framework == "numpy" else fn(x, device=device)

    def convert_out(x: Any) -> Any:
        if result is None:
            return x
        if isinstance(x, (tuple, list)):
            return type(x)(convert_out(v) for v in x)
        return globals()[_CONVERTERS[result]](x) if _is_array(x) else x

    def wrap(func: Any) -> Any:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            args = tuple(convert_in(a) for a in args)
            kwargs = {k: convert_in(v) for k, v in kwargs.items()}
            return convert_out(func(*args, **kwargs))

        return inner

    return wrap
