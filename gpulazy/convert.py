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

__all__ = ["to_torch", "to_jax", "to_numpy"]


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


def to_torch(x: Any, *, copy: bool | None = None) -> Any:
    """A ``torch.Tensor`` sharing ``x``'s memory: CUDA for CuPy, CPU for NumPy.

    Parameters
    ----------
    x
        A CuPy array (DLPack, stays on its GPU), a NumPy array (``torch.from_numpy``),
        or a torch tensor (returned as is, unless ``copy=True``).
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

def to_jax(x: Any, *, copy: bool | None = None) -> Any:
    """A ``jax.Array`` from a CuPy array (DLPack, same GPU) or a NumPy array (CPU).

    JAX arrays are immutable, so a shared buffer must not be written through ``x``
    afterwards; pass ``copy=True`` when ``x`` will change.

    Parameters
    ----------
    x
        A CuPy or NumPy array, or any DLPack producer.
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

def to_numpy(x: Any, *, copy: bool | None = None) -> np.ndarray:
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
