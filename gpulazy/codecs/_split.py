"""Deflate and zstd on a GPU host: which pieces of a batch nvCOMP decodes and which the host's cores do.

The two decoders scale differently. libdeflate (the ``deflate`` package, GIL released) decodes
about 0.45 GB/s of output per core, so the host's time for a share is its bytes over all cores.
nvCOMP decodes the Deflate streams of a batch side by side, each one slowly: 256 streams of
2 MiB decoded at 1.6 to 3.0 GB/s in all on H100s (``benchmarks/bench_codecs.py``), 6 to 12 MB/s
per stream, and fewer streams decode slower in all. So its time for a share is set by the share's
largest piece, not its bytes, until every stream it can run at once is busy (``gpu_streams``).
A few pieces on the GPU cost as long as many; the GPU helps only once the host's share would
take longer than one piece takes nvCOMP. ``plan`` weighs both (with the copies the host's share
costs) and returns the pieces nvCOMP decodes; the rest decode on the host, and a GPU share too
small to pay for itself is none at all.

zstd follows the same model with its own figures (``PRIORS["zstd"]``): nvCOMP decodes a zstd
frame in one thread block, about 154 MB/s each, so the 16 frames of 16 MiB a napari plane of a
(32, 512, 512)-chunked Zarr needs took it 109 ms on an H100, while a batch of hundreds of frames
decodes at 40 GB/s and more. There the GPU alone is kept unless a split is predicted at least
10 % faster (``Rates.margin``), so whole-array reads stay on nvCOMP.

The figures start from ``Rates()`` (the documented priors below), the host's rate per core
replaced before the first plan by one measured on this host (``_beside.calibrate_host``:
hosts differ threefold), and follow what the batches of this process measure (``RECORD``, one
per device): the host's rate per core from batches decoded on the host alone, nvCOMP's rate per
stream and whether the host's threads ran while nvCOMP's call waited (``overlap``) from batches
split between both. Nothing is written to config or disk.

>>> big = [4 << 20] * 4096                      # a batch of 4096 chunks of 4 MiB
>>> len(plan(big, big, cores=16, rates=Rates())) > 0
True
>>> plan([2 << 20] * 256, [2 << 20] * 256, cores=16, rates=Rates())  # nvCOMP alone is slower than the host
[]
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from gpulazy.spec import Codec

__all__ = ["DEFLATE_IDS", "PRIORS", "RECORD", "ROUND", "ZSTD_IDS", "RateRecord", "Rates", "applies", "family",
           "force", "gpu_seconds", "gpu_share", "host_seconds", "makespan", "overlap", "per_stream", "plan"]

#: Decoded bytes per round of a host share (``_beside.HostShare``): each round is copied down and
#: up while the next decodes, so only the first copy down and the last copy up are not hidden.
ROUND = 64 << 20
#: The Deflate family: zlib and gzip framings (numcodecs, HDF5's gzip filter) and TIFF's deflate.
DEFLATE_IDS = frozenset({"zlib", "gzip", "imagecodecs_zlib", "imagecodecs_deflate"})
#: zstd: numcodecs' (Zarr, HDF5 through hdf5plugin) and TIFF's.
ZSTD_IDS = frozenset({"zstd", "imagecodecs_zstd"})


def family(c: Codec) -> str | None:
    """``"deflate"`` or ``"zstd"``: whose figures a batch of step ``c`` is split by (None: not split)."""
    return "deflate" if c.id in DEFLATE_IDS else "zstd" if c.id in ZSTD_IDS else None


def applies(c: Codec) -> bool:
    """Whether a GPU batch of step ``c`` is shared between nvCOMP and the host's cores."""
    return family(c) is not None


@dataclass(frozen=True)
class Rates:
    """What ``plan`` assumes; every rate in bytes of decoded output per second.

    The priors: ``host_per_core`` libdeflate on one core of the 16-core H100 host (issue 21;
    0.31 on this project's 2-core CI machine, ``bench_codecs.py --host-deflate``);
    ``gpu_per_stream`` nvCOMP Deflate on an H100: 9 MB/s. The fourth session measured 1.6 GB/s
    over 256 streams of 2 MiB (``bench_codecs.py --chunks 256``, 6.3 MB/s a stream); the ninth
    3.0 GB/s over the same (11.7 MB/s), and the rate learnt over a 4 GiB HDF5 gzip-1 read, four
    batches at once, was 9.3 MB/s. ``gpu_streams`` how many streams nvCOMP runs at once before
    its rate stops growing: 1024. On an H100, one nvCOMP call over 1 GiB of zlib-1 pieces gave
    1.54 GB/s for 256 pieces of 4 MiB, 5.11 for 1024 of 1 MiB, 6.62 for 2048 of 512 KiB and
    6.87-7.38 for 4096-8192 of 256 KiB down to 64 KiB, flat after ~1100 streams (the ninth
    session's call: 2 MiB pieces at 10.0 GB/s for 1024 and 12.9 for 2048); ``gpu_call`` what one
    nvCOMP call costs besides decoding (framing checks, the copy of headers, the size read-back); ``link`` the
    host share's copies down and up through pinned memory (54.9 GB/s host to device on that
    host, ``DESIGN.md``), all but one round's each way hidden behind decoding (``ROUND``);
    ``overlap`` 1 when the host's threads decode while the calling thread waits in nvCOMP, 0
    when they stall (the two sides then take the sum of their times, not the larger);
    ``margin``: a split is taken only when predicted to take at most this fraction of nvCOMP
    alone's time (1: any gain, and ties go to the host); ``min_pieces``, ``min_bytes``: a batch
    of fewer pieces or bytes stays on nvCOMP (a dask task decodes its chunk while other threads
    decode theirs on the same GPU, side by side, which one batch's figures cannot see; and what
    a small batch could gain is not worth the host's threads).
    """

    host_per_core: float = 0.45e9
    gpu_per_stream: float = 9e6
    gpu_streams: int = 1024
    gpu_call: float = 2e-3
    link: float = 50e9
    overlap: float = 1.0
    margin: float = 1.0
    min_pieces: int = 0
    min_bytes: int = 0


#: The starting figures per family. zstd on an H100: nvCOMP 16 frames of 16 MiB in 109 ms (154 MB/s
#: a frame; a napari jump, profiled), 128 frames of 8 MiB at 21.3 GB/s and 512 at 44.1
#: (``benchmarks/nvcomp_capi_probe.py``): about 285 frames at once before the rate stops growing;
#: numcodecs' zstd-1 decode 0.50 GB/s on one core, 4.0 on 16 (``bench_codecs.py``): 0.25–0.5 a core.
PRIORS = {"deflate": Rates(),
          "zstd": Rates(host_per_core=0.3e9, gpu_per_stream=1.54e8, gpu_streams=285, margin=0.9, min_pieces=8,
                        min_bytes=64 << 20)}


def host_seconds(decoded: Sequence[int] | np.ndarray, stored: Sequence[int] | np.ndarray, cores: int,
                 rates: Rates) -> float:
    """Seconds for the host to decode these pieces on ``cores`` threads, their copies included."""
    d = np.asarray(decoded, dtype=np.float64)
    if d.size == 0:
        return 0.0
    s = np.asarray(stored, dtype=np.float64)
    return float(_host_time(d.sum(), d.max(), s.sum(), cores, rates))


def gpu_seconds(decoded: Sequence[int] | np.ndarray, rates: Rates) -> float:
    """Seconds for nvCOMP to decode these pieces in one call."""
    d = np.asarray(decoded, dtype=np.float64)
    if d.size == 0:
        return 0.0
    return float(_gpu_time(d.sum(), d.max(), rates))


def makespan(host: float, gpu: float, overlap: float) -> float:
    """The batch's time when the host takes ``host`` seconds and nvCOMP ``gpu``, run side by side
    (``overlap`` 1) or one after the other (0)."""
    return max(host, gpu) + (1.0 - overlap) * min(host, gpu)


def _host_time(total: Any, largest: Any, stored: Any, cores: int, rates: Rates) -> np.ndarray:
    # All cores share the bytes, but no piece is split: the largest one is a floor. The
    # copies of one round overlap the decoding of the next: the first copy down and the
    # last up show (a round is at least a piece), the rest only where they outlast decoding.
    decode = np.maximum(total / (max(1, cores) * rates.host_per_core), largest / rates.host_per_core)
    copies = (total + stored) / rates.link
    ends = 2 * np.minimum(total, np.maximum(ROUND, largest)) / rates.link
    return np.where(total > 0, np.maximum(decode, copies) + ends, 0.0)


def _gpu_time(total: Any, largest: Any, rates: Rates) -> np.ndarray:
    # Streams decode side by side: the longest one sets the time, until they outnumber nvCOMP's slots.
    decode = np.maximum(largest, total / rates.gpu_streams) / rates.gpu_per_stream
    return np.where(total > 0, rates.gpu_call + decode, 0.0)


def plan(decoded: Sequence[int], stored: Sequence[int], cores: int, rates: Rates, backlog: float = 0.0) -> list[int]:
    """Indices of the pieces nvCOMP decodes (ascending); the others decode on the host.

    ``backlog``: seconds of host decoding other batches have queued ahead of this one's (batches
    decode side by side: ``gpulazy.read.whole.settlers``); a host share ends that much later.

    Tries every split that gives nvCOMP the ``k`` smallest or the ``k`` largest pieces (its
    time follows its largest piece, the host's its bytes) and keeps the one with the
    shortest ``makespan``; on a tie, the one with fewer pieces on the GPU (libdeflate
    checks every checksum, nvCOMP none). So the result is never slower, by the model, than
    either side alone.
    """
    n = len(decoded)
    if n == 0:
        return []
    if n < rates.min_pieces or sum(decoded) < rates.min_bytes:
        return list(range(n))
    order = np.argsort(np.asarray(decoded, dtype=np.int64), kind="stable")
    d = np.asarray(decoded, dtype=np.float64)[order]
    s = np.asarray(stored, dtype=np.float64)[order]
    cd, cs = np.concatenate([[0.0], np.cumsum(d)]), np.concatenate([[0.0], np.cumsum(s)])
    k = np.arange(n + 1)
    # nvCOMP takes the k smallest: its largest is d[k-1]; the host keeps d[k:], largest d[-1].
    small = _makespans(
        _queued(_host_time(cd[-1] - cd, np.where(k < n, d[-1], 0.0), cs[-1] - cs, cores, rates), backlog),
        _gpu_time(cd, np.where(k > 0, d[np.maximum(k - 1, 0)], 0.0), rates), rates.overlap)
    # nvCOMP takes the k largest: the host keeps d[:n-k], largest d[n-k-1].
    rest = n - k
    large = _makespans(
        _queued(_host_time(cd[rest], np.where(rest > 0, d[np.maximum(rest - 1, 0)], 0.0), cs[rest], cores, rates),
                backlog),
        _gpu_time(cd[-1] - cd[rest], np.where(k > 0, d[-1], 0.0), rates), rates.overlap)
    ks, kl = int(np.argmin(small)), int(np.argmin(large))  # argmin: the first (fewest on the GPU) of equals
    if min(small[ks], large[kl]) > rates.margin * small[n]:  # small[n]: every piece to nvCOMP
        return list(range(n))
    chosen = order[:ks] if (small[ks], ks) <= (large[kl], kl) else order[n - kl:]
    return sorted(int(i) for i in chosen)


def _queued(host: np.ndarray, backlog: float) -> np.ndarray:
    # A host share waits for the host work queued before it; no share waits for nothing.
    return np.where(host > 0, host + max(0.0, backlog), 0.0)


def _makespans(host: np.ndarray, gpu: np.ndarray, overlap: float) -> np.ndarray:
    # ``makespan`` over arrays: one value per candidate split.
    return np.maximum(host, gpu) + (1.0 - overlap) * np.minimum(host, gpu)


# -- measuring: what a batch says about the rates ------------------------------------------------

def per_stream(decoded: Sequence[int], seconds: float, rates: Rates) -> float | None:
    """nvCOMP's rate per stream that a call decoding ``decoded`` in ``seconds`` shows (None: no measure)."""
    if not decoded or seconds <= 0:
        return None
    span = max(max(decoded), sum(decoded) / rates.gpu_streams)
    return span / max(seconds - rates.gpu_call, seconds / 2)


def overlap(host_predicted: float, gpu: float, wall: float) -> float | None:
    """How far the two sides ran at once: 1 when the batch took the longer side's time, 0 when
    it took their sum (the host's threads stalled while nvCOMP's call held the GIL)."""
    shorter = min(host_predicted, gpu)
    if shorter <= 0 or wall <= 0:
        return None
    return float(min(1.0, max(0.0, (host_predicted + gpu - wall) / shorter)))


class RateRecord:
    """The rates of this process, one ``Rates`` per device and family (``PRIORS`` until measured),
    each measure folded in with weight ``weight`` (a moving average: a batch slowed by other work
    moves it, but not all the way). Keyed ``device`` for Deflate, ``device/zstd`` for zstd."""

    def __init__(self, weight: float = 0.3):
        self.weight = weight
        self._lock = threading.Lock()
        self._rates: dict[str, Rates] = {}
        self._counts: dict[str, dict[str, int]] = {}
        self._calibrated: set[str] = set()

    def calibrated(self, device: str, kind: str = "deflate") -> bool:
        """Whether ``calibrate`` has set ``device``'s rates for ``kind`` in this process."""
        with self._lock:
            return _key(device, kind) in self._calibrated

    def calibrate(self, device: str, kind: str = "deflate", **measured: float) -> Rates:
        """Replace the prior's fields with these measures (not a moving average: the prior is one
        host's figure, not a measure of this one); later measures fold in as usual."""
        with self._lock:
            key = _key(device, kind)
            self._rates[key] = dataclasses.replace(self._rates.get(key, PRIORS[kind]),
                                                   **{k: float(v) for k, v in measured.items()})
            self._calibrated.add(key)
            return self._rates[key]

    def rates(self, device: str, kind: str = "deflate") -> Rates:
        with self._lock:
            return self._rates.get(_key(device, kind), PRIORS[kind])

    def fold(self, device: str, kind: str = "deflate", **measured: float | None) -> Rates:
        """Fold the measured fields (``None`` ones skipped) into ``device``'s rates; the new rates."""
        with self._lock:
            key = _key(device, kind)
            old = self._rates.get(key, PRIORS[kind])
            new = {k: (1 - self.weight) * getattr(old, k) + self.weight * float(v)
                   for k, v in measured.items() if v is not None}
            self._rates[key] = dataclasses.replace(old, **new)
            return self._rates[key]

    def count(self, device: str, kind: str = "deflate", **amounts: int) -> None:
        """Add to ``device``'s tallies (batches, pieces and bytes each side took, bytes copied)."""
        with self._lock:
            tally = self._counts.setdefault(_key(device, kind), {})
            for k, v in amounts.items():
                tally[k] = tally.get(k, 0) + int(v)

    def snapshot(self) -> dict[str, dict]:
        """``{device: {"rates": {...}, "counts": {...}}}``: what the split runs on now."""
        with self._lock:
            devices = set(self._rates) | set(self._counts)
            return {d: {"rates": dataclasses.asdict(self._rates.get(d, PRIORS[_kind_of(d)])),
                        "counts": dict(self._counts.get(d, {}))} for d in sorted(devices)}

    def reset(self) -> None:
        with self._lock:
            self._rates.clear()
            self._counts.clear()
            self._calibrated.clear()


def _key(device: str, kind: str) -> str:
    return device if kind == "deflate" else f"{device}/{kind}"


def _kind_of(key: str) -> str:
    return key.rpartition("/")[2] if "/" in key else "deflate"


#: This process's rates (per device name and family).
RECORD = RateRecord()

_forced: list[str] = []
_MODES = ("auto", "host", "gpu", "alternate")


@contextlib.contextmanager
def force(mode: str) -> Iterator[None]:
    """Within the block, every Deflate or zstd batch on a GPU goes ``"host"`` (all pieces), ``"gpu"``
    (all to nvCOMP), ``"alternate"`` (odd pieces to nvCOMP, even ones to the host) or
    ``"auto"`` (``plan``). For benchmarks and tests; process-wide."""
    if mode not in _MODES:
        raise ValueError(f"split mode {mode!r}: expected one of {', '.join(_MODES)}")
    _forced.append(mode)
    try:
        yield
    finally:
        _forced.pop()


def gpu_share(decoded: Sequence[int], stored: Sequence[int], cores: int, device: str, kind: str = "deflate",
              backlog: float = 0.0) -> list[int]:
    """The pieces of this batch nvCOMP decodes on ``device``: ``plan`` on its recorded rates for
    ``kind`` (``family``) behind ``backlog`` seconds of host work, or what ``force`` says."""
    forced = _forced[-1] if _forced else "auto"
    if forced == "host":
        return []
    if forced == "gpu":
        return list(range(len(decoded)))
    if forced == "alternate":
        return list(range(1, len(decoded), 2))
    return plan(decoded, stored, cores, RECORD.rates(device, kind), backlog)
