"""Host decoding: numcodecs for Zarr/HDF5 codecs, imagecodecs for TIFF's, plus a few of our own.

Used for every codec on ``"cpu"``, and on a GPU for what nvCOMP cannot decode. A codec
is built once per distinct ``Codec`` value (they are hashable).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import numpy as np

from gpulazy.spec import Codec

__all__ = ["decode", "unsupported_reason", "SPECIAL"]


def _strip_crc32c(data: np.ndarray, codec: Codec, expected: int) -> np.ndarray:
    # Zarr v3's crc32c codec appends a 4-byte checksum; verification is on demand elsewhere.
    return data[:-4]


def _tiff_predictor(data: np.ndarray, codec: Codec, expected: int) -> np.ndarray:
    # TIFF predictors work along each row of a strip/tile (params dtype, width, samples, kind
    # 2 = horizontal differencing, 3 = floating point; dist). imagecodecs' delta_decode and
    # floatpred_decode are what tifffile uses; they run on native-order values, so the bytes
    # go to native order and back to the file's (the pipeline byte-swaps after decoding).
    import imagecodecs

    dt = np.dtype(codec.get("dtype"))
    width, samples, dist = int(codec.get("width")), int(codec.get("samples")), int(codec.get("dist", 1))
    data = data[:expected]  # a decompressor may return a few bytes more; tifffile drops them too
    values = data.view(dt.newbyteorder("=") if codec.get("kind") == 3 else dt).reshape(-1, width, samples)
    values = values.astype(dt.newbyteorder("="), copy=True)  # writable, native
    undo = imagecodecs.floatpred_decode if codec.get("kind") == 3 else imagecodecs.delta_decode
    values = undo(values, axis=-2, dist=dist, out=values)
    return values.astype(dt, copy=False).reshape(-1).view(np.uint8)


#: Steps gpulazy decodes itself: ``fn(data, codec, expected_nbytes) -> uint8 array``.
SPECIAL: dict[str, Callable[[np.ndarray, Codec, int], np.ndarray]] = {
    "crc32c": _strip_crc32c,
    "tiff_predictor": _tiff_predictor,
}
#: The package a special step needs, for ``unsupported_reason``.
_SPECIAL_NEEDS = {"tiff_predictor": "imagecodecs"}


def decode(data: Any, codec: Sequence[Codec], expected: int | None) -> np.ndarray:
    """``data`` (uint8, host) through every step of ``codec``; a 1-D uint8 array.

    ``expected``: the decoded size in bytes, or ``None`` when unknown (no output buffer is
    given to the last step then).
    """
    out = np.asarray(data).reshape(-1).view(np.uint8)
    for i, c in enumerate(codec):
        last = i == len(codec) - 1
        special = SPECIAL.get(c.id)
        if special is not None:
            out = special(out, c, expected)
        else:
            dec = _build(c).decode(out, out=np.empty(expected, np.uint8)) if (last and expected is not None and _takes_out(c)) \
                else _build(c).decode(out)
            out = _as_bytes(dec)
    # imagecodecs hands back bytes (read-only); assembly byte-swaps big-endian data in place.
    return out if out.flags.writeable else out.copy()


def _takes_out(c: Codec) -> bool:
    # Block codecs that decode into a buffer of the known size avoid a copy.
    return c.id in ("zstd", "lz4", "blosc", "zlib")


def _as_bytes(x: Any) -> np.ndarray:
    from numcodecs.compat import ensure_ndarray

    out = ensure_ndarray(x).reshape(-1).view(np.uint8)
    # Codecs that return ``bytes`` (GZip, Zlib without out=) give a read-only view; the
    # byte swap after decoding works in place.
    return out if out.flags.writeable else out.copy()


@functools.cache
def _build(c: Codec) -> Any:
    if c.id.startswith("imagecodecs_"):
        return _Imagecodec(c.id.removeprefix("imagecodecs_"), dict(c.params))
    import numcodecs

    return numcodecs.get_codec(c.config())


class _Imagecodec:
    """An imagecodecs ``<name>_decode`` function with the numcodecs ``decode`` signature."""

    def __init__(self, name: str, params: dict):
        import imagecodecs

        self.fn = getattr(imagecodecs, f"{name}_decode")
        self.params = params

    def decode(self, buf: Any, out: Any = None) -> Any:
        return self.fn(bytes(buf) if not isinstance(buf, (bytes, np.ndarray)) else buf, **self.params)


def unsupported_reason(c: Codec) -> str:
    """Why ``c`` cannot be decoded on the host here, or ``""`` when it can."""
    if c.id in SPECIAL:
        return _missing(_SPECIAL_NEEDS.get(c.id))
    try:
        _build(c)
    except ImportError as e:
        pkg = "imagecodecs" if c.id.startswith("imagecodecs_") else "numcodecs"
        return f"{e}; install it with: pip install {pkg}"
    except Exception as e:  # numcodecs raises ValueError for an unknown id
        return (f"{type(e).__name__}: {e}; no installed codec library knows it (numcodecs, imagecodecs: "
                "pip install numcodecs imagecodecs)")
    return ""


def _missing(package: str | None) -> str:
    import importlib.util

    if package is None or importlib.util.find_spec(package) is not None:
        return ""
    return f"it needs the package {package!r}; install it with: pip install {package}"
