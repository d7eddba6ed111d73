"""Contiguous slabs: the chunk shapes gpulazy picks when none are asked for.

Pure arithmetic over shapes (no files): both chunk normalisation (``_common``) and the
index limits (``_limits``, which suggests a chunking that fits) build on it.
"""

from __future__ import annotations

import math
from typing import Sequence

from gpulazy import config

__all__ = ["default_chunks", "slab_sizes"]


def _split(n: int, size: int) -> tuple[int, ...]:
    """``n`` in blocks of at most ``size``, evened out (1000 by 130 → 8 × 125)."""
    if n == 0:
        return (0,)
    count = -(-n // max(size, 1))
    size = -(-n // count)
    return (size,) * (n // size) + ((n % size,) if n % size else ())


def slab_sizes(shape: Sequence[int], itemsize: int, target: int) -> tuple[int, ...]:
    """Block sizes per axis making contiguous C-order slabs of about ``target`` bytes.

    Whole planes along axis 0 (several per chunk when small); when one plane is bigger
    than ``target``, one plane per chunk and the same rule along the next axis.
    """
    shape = tuple(shape)
    if 0 in shape:
        return shape
    sizes = []
    for k, n in enumerate(shape):
        inner = math.prod(shape[k + 1:]) * itemsize
        if inner * n <= target:
            return tuple(sizes) + shape[k:]
        if inner <= target:
            return tuple(sizes) + (max(1, target // inner),) + shape[k + 1:]
        sizes.append(1)
    return tuple(sizes)


def default_chunks(shape: Sequence[int], itemsize: int, *, order: str = "C", stacked: bool = False,
                   target: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Chunks of ~``config.chunk_size`` bytes that are contiguous in the files."""
    target = int(target or config.get("chunk_size"))
    shape = tuple(shape)
    if order == "F" and stacked:
        # One file per block along axis 0 (an F-order chunk cannot span files).
        inner = slab_sizes(shape[1:][::-1], itemsize, target)[::-1]
        sizes = (1,) + inner
    elif order == "F":
        sizes = slab_sizes(shape[::-1], itemsize, target)[::-1]
    else:
        sizes = slab_sizes(shape, itemsize, target)
    return tuple(_split(n, s) for n, s in zip(shape, sizes))
