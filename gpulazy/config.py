"""Process-wide settings: ``gpulazy.config.set(...)`` globally or as a context manager.

Every key has a ``GPULAZY_<KEY>`` environment variable read when the key is first
looked up (``GPULAZY_THREADS=8``). Unknown keys raise with the list of valid ones.

>>> import gpulazy
>>> with gpulazy.config.set(threads=4):
...     gpulazy.config.get("threads")
4
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

from gpulazy.errors import ConfigError

__all__ = ["get", "set", "reset", "as_dict", "parse_bytes", "KEYS"]


def parse_bytes(value: int | str) -> int:
    """``"8 GiB"``, ``"4MiB"``, ``"1e9"`` or an int, as a number of bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"expected a byte count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"a byte count cannot be negative, got {value!r}")
        return value
    from dask.utils import parse_bytes as _dask_parse_bytes  # well-kept, knows KiB/KB/...

    try:
        return int(_dask_parse_bytes(str(value)))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"cannot read {value!r} as a byte count; write e.g. '8 GiB' or 1048576") from e


def _positive_int(value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"expected a positive integer, got {value!r}") from e
    if n < 1:
        raise ConfigError(f"expected a positive integer, got {value!r}")
    return n


def _optional_str(value: Any) -> str | None:
    return None if value in (None, "", "auto") else str(value)


def _cache_capacity(value: Any) -> str | int | bool:
    # Kept as given ("25%", "8 GiB", 0, False): the cache resolves percentages against
    # the device's free memory when it is created.
    if value in (False, "false", "False", "0", 0, "off"):
        return False
    if isinstance(value, str) and value.strip().endswith("%"):
        return value.strip()
    return parse_bytes(value)


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"expected true or false, got {value!r}")


def _default_threads() -> int:
    # One per core this process may run on (at least 4, at most 32). Twice that oversubscribes
    # the cores the threads that submit and settle reads need: on 16-core H100 hosts, in one
    # process alternating between 16 and 32 KvikIO threads, a 4 GiB Zarr of 256 files read at
    # 40.4 against 32.2 GB/s (median of 5), its MIP 39.8 against 29.3, a folder of 512 TIFFs
    # 43.6 against 32.8; one 4 GiB file alike (best 44.1 and 44.2).
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 4
    return min(max(cores, 4), 32)


# key: (default factory, converter, help)
KEYS: dict[str, tuple[Callable[[], Any], Callable[[Any], Any], str]] = {
    "device": (lambda: None, _optional_str, "'cpu', 'cuda:N' or None (a GPU when one is usable)"),
    "backend": (lambda: None, _optional_str, "I/O backend name or None for 'auto'"),
    "threads": (_default_threads, _positive_int, "I/O threads per backend"),
    "task_size": (lambda: 4 << 20, parse_bytes, "bytes per I/O task a read is split into"),
    "chunk_size": (lambda: 128 << 20, parse_bytes, "target bytes of a default chunk"),
    "cache": (lambda: "25%", _cache_capacity, "capacity of the default device cache ('25%' of free memory, '8 GiB', False)"),
    "prefetch_depth": (lambda: 8, _positive_int, "how many chunk reads the prefetcher runs ahead"),
    "prefetch_inflight": (lambda: 256 << 20, parse_bytes,
                          "bytes of chunks a cache's prefetch threads load at once (one chunk always may)"),
    "gpu_decode": (lambda: True, _flag, "decode compressed chunks on the GPU where nvCOMP/CuPy can (False: on the "
                   "host, e.g. for files you do not trust: nvCOMP assumes valid input)"),
    "batch_size": (lambda: 512 << 20, parse_bytes,
                   "bytes of chunk reads one batched read task submits at once (0: a read task per chunk)"),
    "read_ahead": (lambda: 1 << 30, parse_bytes,
                   "bytes of batched reads a compute starts ahead of the batch task that runs (0: none)"),
    "fused_reductions": (lambda: True, _flag,
                         "max/min/sum/mean/var/std of a gpulazy array (also after astype) run as one task "
                         "folding each chunk as its read lands (False: dask's per-chunk reduction tree)"),
    "streamed_maps": (lambda: True, _flag,
                      "vol.map_blocks(func).compute() of a gpulazy array calls func on each chunk as its read "
                      "lands, into one result (False: dask's task a chunk)"),
    "max_chunks": (lambda: 1_000_000, _positive_int,
                   "the most pieces (dask chunks, stored chunks or byte runs) one array is indexed into; opening "
                   "takes ~11 us and ~450 bytes per piece, and more raise LayoutError naming a chunking that fits"),
    "staging": (lambda: "tasks", lambda v: _choice(v, ("tasks", "always", "never")),
                "KvikIO reads through pinned host buffers and gpulazy's non-blocking streams: in chunk "
                "tasks ('tasks'), always or never (straight into device memory on KvikIO's blocking streams)"),
}


def _choice(value: Any, valid: tuple[str, ...]) -> str:
    text = str(value).strip().lower()
    if text not in valid:
        raise ConfigError(f"expected one of {valid}, got {value!r}")
    return text

_lock = threading.RLock()
_values: dict[str, Any] = {}


def _check_key(key: str) -> None:
    if key not in KEYS:
        raise ConfigError(f"unknown gpulazy config key {key!r}; valid keys: {', '.join(sorted(KEYS))}")


def get(key: str) -> Any:
    """The value of ``key``: set value, else ``GPULAZY_<KEY>`` from the environment, else default."""
    _check_key(key)
    with _lock:
        if key in _values:
            return _values[key]
        default, convert, _ = KEYS[key]
        env = os.environ.get(f"GPULAZY_{key.upper()}")
        if env is not None:
            try:
                return convert(env)
            except ConfigError as e:
                raise ConfigError(f"environment variable GPULAZY_{key.upper()}={env!r}: {e}") from e
        return default()


class _Setter:
    """Applies values at once; restores the previous ones when used as a context manager."""

    def __init__(self, previous: dict[str, Any]):
        self._previous = previous

    def __enter__(self) -> _Setter:
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            for key, value in self._previous.items():
                if value is _UNSET:
                    _values.pop(key, None)
                else:
                    _values[key] = value


_UNSET = object()


def set(**values: Any) -> _Setter:  # noqa: A001 - mirrors dask.config.set / kvikio.defaults.set
    """Set keys for the process; ``with config.set(...)`` restores them on exit."""
    for key in values:
        _check_key(key)
    converted = {key: KEYS[key][1](v) if v is not None or key in ("device", "backend") else KEYS[key][0]()
                 for key, v in values.items()}
    with _lock:
        previous = {key: _values.get(key, _UNSET) for key in converted}
        _values.update(converted)
    return _Setter(previous)


def reset() -> None:
    """Forget every value set in this process (environment variables still apply)."""
    with _lock:
        _values.clear()


def as_dict() -> dict[str, Any]:
    """Every key with its current value."""
    return {key: get(key) for key in KEYS}


