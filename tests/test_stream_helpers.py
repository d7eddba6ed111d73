"""Picklable loaders for the Prefetcher's process-mode tests (spawned children import this module)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np


class Counter:
    """``loader()`` returning arrays filled with 0, 1, 2, ... and StopIteration after ``n``.

    ``shared`` (a ``multiprocessing`` Value, handed over when processes are spawned)
    makes every worker, thread or process, draw from one count, so each value is
    loaded exactly once however many workers there are.
    """

    def __init__(self, n=None, shape=(4, 8), dtype="float32", shared=None, delay=0.0):
        self.n, self.shape, self.dtype, self.shared, self.delay = n, shape, dtype, shared, delay
        self._local = 0
        self._lock = threading.Lock()

    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _draw(self) -> int:
        if self.shared is not None:
            with self.shared.get_lock():
                i = self.shared.value
                self.shared.value += 1
            return i
        with self._lock:
            i = self._local
            self._local += 1
        return i

    def __call__(self):
        i = self._draw()
        if self.n is not None and i >= self.n:
            raise StopIteration
        if self.delay:
            time.sleep(self.delay)
        return np.full(self.shape, i, dtype=self.dtype)


def broken_loader_helper(path):
    raise ValueError(f"cannot decode {path!r}: bad magic bytes")


class FailAfter(Counter):
    """Counts, then raises a ValueError naming a file after ``k`` arrays."""

    def __init__(self, k, path="/data/broken.tif", **kw):
        super().__init__(**kw)
        self.k, self.path = k, path

    def __call__(self):
        if self._local >= self.k:
            broken_loader_helper(self.path)
        return super().__call__()


class Crash(Counter):
    """Kills its process without a word after ``k`` arrays."""

    def __init__(self, k, **kw):
        super().__init__(**kw)
        self.k = k

    def __call__(self):
        if self._local >= self.k:
            os._exit(3)
        return super().__call__()


def test_counter_counts():
    c = Counter(n=2, shape=(2,))
    assert [int(c()[0]), int(c()[0])] == [0, 1]
