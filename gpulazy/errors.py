"""One error hierarchy; every class also inherits the builtin a caller would catch.

Messages say what went wrong, with which value (``{path!r}``), what was expected
and how to fix it. Chain the cause with ``raise ... from e``.
"""

from __future__ import annotations

__all__ = [
    "GpulazyError",
    "LayoutError",
    "TooManyChunksError",
    "NoFilesError",
    "ChunkReadError",
    "ChunkDecodeError",
    "PerformanceWarning",
    "ChunksEnlargedWarning",
    "BackendUnavailableError",
    "DeviceError",
    "DeviceMemoryError",
    "ConfigError",
    "OptionalDependencyError",
]


class GpulazyError(Exception):
    """Base of every error gpulazy raises on purpose."""


class LayoutError(GpulazyError, ValueError):
    """Files do not match what was asked of them (size, header, shape, dtype)."""


class TooManyChunksError(LayoutError):
    """More pieces than config ``max_chunks``; ``where`` is the file or store (``None``: not known yet)."""

    def __init__(self, message: str, where: str | None = None):
        super().__init__(f"{where!r}: {message}" if where else message)
        self.message, self.where = message, where

    def __reduce__(self):
        return (type(self), (self.message, self.where))

    def at(self, where: str) -> TooManyChunksError:
        """This error naming ``where`` (itself when it names a path already)."""
        return self if self.where else TooManyChunksError(self.message, where)


class NoFilesError(GpulazyError, FileNotFoundError):
    """A path, glob or directory named no readable file."""


class ChunkReadError(GpulazyError, OSError):
    """A read failed or came back short. Never returned as zeros."""

    def __init__(self, message: str, *, path: str | None = None, offset: int | None = None,
                 expected: int | None = None, got: int | None = None):
        super().__init__(message)
        self.path = path
        self.offset = offset
        self.expected = expected
        self.got = got

    def __reduce__(self):
        # Picklable with its fields, so it crosses dask.distributed workers intact.
        return (_rebuild_read_error, (str(self), self.path, self.offset, self.expected, self.got))


def _rebuild_read_error(message, path, offset, expected, got):
    return ChunkReadError(message, path=path, offset=offset, expected=expected, got=got)


class ChunkDecodeError(ChunkReadError):
    """A stored chunk's bytes could not be decoded (corrupt data, wrong codec in the metadata)."""

    def __reduce__(self):
        return (_rebuild_decode_error, (str(self), self.path, self.offset, self.expected, self.got))


def _rebuild_decode_error(message, path, offset, expected, got):
    return ChunkDecodeError(message, path=path, offset=offset, expected=expected, got=got)


class PerformanceWarning(UserWarning):
    """Work takes a slower path than it could (e.g. a codec decoding on the host for a GPU array)."""


class ChunksEnlargedWarning(UserWarning):
    """``chunks=`` asked for blocks that cut stored chunks; they were enlarged to whole ones (the message says to what)."""


class BackendUnavailableError(GpulazyError, RuntimeError):
    """The I/O backend asked for cannot run here; the message says why and what to install."""


class DeviceError(GpulazyError, ValueError):
    """An unknown or unusable device name."""


class DeviceMemoryError(GpulazyError, MemoryError):
    """Device memory ran out even after gpulazy evicted its caches; the message gives the figures."""


class ConfigError(GpulazyError, ValueError):
    """An unknown configuration key or a value of the wrong kind."""


class OptionalDependencyError(GpulazyError, ImportError):
    """An optional package is missing; the message names the extra that installs it."""


def missing_dependency(package: str, extra: str, feature: str) -> OptionalDependencyError:
    """The error to raise when ``feature`` needs ``package`` (installed by ``extra``)."""
    return OptionalDependencyError(
        f"{feature} needs the package {package!r}, which is not installed; "
        f"install it with: pip install 'gpulazy[{extra}]'"
    )
