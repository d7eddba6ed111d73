"""A STAND-IN for the Windows-only ``dstorage_gpu`` package, for tests on any platform.

The real package (PyPI ``dstorage-gpu``) reads files through Microsoft DirectStorage
into CUDA torch tensors and only ships Windows wheels, so it is out of reach of our
CI. This module implements the surface gpulazy's adapter relies on
(``gpulazy/io/_directstorage.py`` documents it) with NumPy, so the adapter's own logic
(one batch and one fence per submit, copying ranges out of whole-file tensors, short
reads, package errors) runs for real:

- ``DirectStorageLoader()``
- ``loader.load_tensor(path) -> float32 array`` (the whole file)
- ``loader.load_tensors([(path, n_elements), ...]) -> [float32 array, ...]``: one
  batch, one fence; returns once the fence has signalled.

Test hooks (module-level, reset with ``reset()``): ``batches`` (every batch's specs),
``fences`` (fences waited on), ``shrink`` (path -> bytes the next read of it drops, as
if the file were truncated after gpulazy looked at it), ``fail`` (an exception the
next batch raises, like an HRESULT error from the runtime).

Tests install it with ``monkeypatch.setitem(sys.modules, "dstorage_gpu", module)``.
It is never imported by gpulazy itself.
"""

from __future__ import annotations

import os
import threading

import numpy as np

__version__ = "stand-in"

batches: list[list[tuple[str, int]]] = []
fences = 0
shrink: dict[str, int] = {}
fail: BaseException | None = None
_lock = threading.Lock()


def reset() -> None:
    global fences, fail
    with _lock:
        batches.clear()
        shrink.clear()
        fences = 0
        fail = None


class _Fence:
    """Signalled once every request of a batch has completed (here: when they have run)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def signal(self) -> None:
        self._done.set()

    def wait(self, timeout: float = 30.0) -> None:
        global fences
        if not self._done.wait(timeout):
            raise TimeoutError("DirectStorage fence was not signalled")
        with _lock:
            fences += 1


class DirectStorageLoader:
    """Reads whole-file prefixes as float32 arrays, a batch behind one fence."""

    def load_tensor(self, path: str) -> np.ndarray:
        size = os.path.getsize(path)
        return self.load_tensors([(path, size // 4)])[0]

    def load_tensors(self, specs: list[tuple[str, int]]) -> list[np.ndarray]:
        global fail
        with _lock:
            batches.append([(str(p), int(n)) for p, n in specs])
            error, fail = fail, None
        if error is not None:
            raise error
        fence = _Fence()
        arrays = [self._request(str(path), int(n)) for path, n in specs]
        fence.signal()
        fence.wait()
        return arrays

    @staticmethod
    def _request(path: str, n_elements: int) -> np.ndarray:
        if not os.path.isfile(path):
            # Like a native extension: a RuntimeError carrying the Windows error text.
            raise RuntimeError(f"DStorage OpenFile failed for {path}: HRESULT 0x80070002")
        nbytes = n_elements * 4
        with _lock:
            nbytes = max(0, nbytes - shrink.pop(path, 0))
        with open(path, "rb") as fh:
            data = fh.read(nbytes)
        usable = len(data) - len(data) % 4
        return np.frombuffer(data[:usable], dtype=np.float32).copy()
