"""A GPU batch decoded on the host's cores, alone or beside nvCOMP.

``HostShare`` decodes pieces that live in device memory on ``_run.host_pool``, in rounds of
at most ``_split.ROUND`` decoded bytes: each round's stored bytes go down in one transfer
(gathered on the device) into a pinned buffer, each piece is decoded by a thread into its
slot of a pinned buffer laid out like the device buffer it goes to (every slot 256-byte
aligned, so any dtype can view it), and the round goes up in one transfer. Two pinned pairs
take turns, so one round is copied down and another up while a third decodes, and the
pinned memory held stays bounded. So a host share costs two transfers per round (one
round for up to 64 MiB of output), never one per piece, plus, for Deflate, one copy per
piece in host memory (libdeflate through the ``deflate`` package returns a buffer of its
own, copied into the slot by the thread that decoded it).

``beside_host`` runs a Deflate batch on both: ``_split.gpu_share`` picks the pieces nvCOMP
decodes; a thread of ``_drivers`` runs the host's share while nvCOMP decodes its share in
the calling thread. Each side's time is folded into ``_split.RECORD`` so the next batch's
split follows this machine. The host's threads need the GIL between pieces: if nvCOMP's
call held it while waiting for the GPU they would stall, the batch would take the sum of
both sides' times, and ``_split.overlap`` measures exactly that, so the next plans treat
the two sides as running one after the other.

Every piece is checked as on the host alone: a corrupt one, or one that decodes to another
size, raises the ``ChunkDecodeError`` naming its file and offset (``_run.decode_error``,
``_run.size_error``). Before any error is raised, every host thread of the batch has finished,
so none writes into a buffer that is handed back.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from gpulazy.codecs import _split
from gpulazy.codecs._run import _host_one, _record, cores, host_pool, size_error
from gpulazy.codecs.pieces import Pieces
from gpulazy.device import Device
from gpulazy.spec import ByteRange, Codec

__all__ = ["CALIBRATE_BYTES", "CALIBRATE_PIECES", "CupySide", "HostDecode", "HostShare", "beside_host",
           "calibrate_host", "rounds", "size_class"]


def beside_host(pieces: Sequence[Any], c: Codec, sizes: list[int], device: Device, where: list[Any],
                on_gpu: Callable[[Pieces, Codec, list[int], Device, list[Any]], Pieces]) -> Pieces:
    """Step ``c`` (Deflate, zstd) over ``pieces`` (on the device): ``on_gpu`` decodes the GPU's
    share (nvCOMP, its own fallbacks) in the calling thread, the host's cores the rest, driven by
    a thread of its own (``_run_on``)."""
    pieces = Pieces.of(pieces)
    if not len(pieces):
        return pieces
    stored = pieces.sizes.tolist()
    kind = _split.family(c) or "deflate"
    calibrate_host(pieces, c, sizes, where, device.name, kind)
    rates = _split.RECORD.rates(device.name, kind)

    def share(backlog: float) -> tuple[list[int], float]:
        gpu = _split.gpu_share(sizes, stored, cores(), device.name, kind, backlog=backlog)
        picked = set(gpu)
        host = [i for i in range(len(pieces)) if i not in picked]
        return gpu, _split.host_seconds([sizes[i] for i in host], [stored[i] for i in host], cores(), rates)

    gpu, queued, backlog = _BACKLOG.plan(device.name, share)
    try:
        return _decode(pieces, c, sizes, device, where, on_gpu, gpu, stored, kind, backlog)
    finally:
        _BACKLOG.add(device.name, -queued)


class _Backlog:
    """Seconds of host decoding queued by the batches in flight, per device, as their plans
    predicted. Batches decode side by side (``gpulazy.read.whole.settlers``) and each plan
    counts on every host core: without this, four batches would each hand the host the share
    it could decode alone, and each would wait for all four."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}

    def seconds(self, device: str) -> float:
        with self._lock:
            return self._seconds.get(device, 0.0)

    def plan(self, device: str, share: Callable[[float], tuple[list[int], float]]) -> tuple[list[int], float, float]:
        """``share(backlog)`` -> (the GPU's pieces, the host share's seconds), run under the lock so
        that batches planning at the same moment each see the others' shares; the share's seconds
        are queued (``add`` them back, negated, once the share is done). Returns
        ``(pieces, seconds queued, backlog planned behind)``."""
        with self._lock:
            backlog = self._seconds.get(device, 0.0)
            gpu, queued = share(backlog)
            self._seconds[device] = backlog + queued
            return gpu, queued, backlog

    def add(self, device: str, seconds: float) -> None:
        with self._lock:
            self._seconds[device] = max(0.0, self._seconds.get(device, 0.0) + seconds)


_BACKLOG = _Backlog()


def _decode(pieces: Pieces, c: Codec, sizes: list[int], device: Device, where: list[Any],
            on_gpu: Callable[[Pieces, Codec, list[int], Device, list[Any]], Pieces], gpu: list[int],
            stored: list[int], kind: str, backlog: float) -> Pieces:
    """``beside_host`` once the pieces nvCOMP decodes (``gpu``) are picked."""
    picked = set(gpu)
    host = [i for i in range(len(pieces)) if i not in picked]
    started = time.perf_counter()
    share = HostShare([pieces[i] for i in host], (c,), [sizes[i] for i in host], [where[i] for i in host]) \
        if host else None
    if share is not None and not gpu:  # the host alone: no thread to hand it to
        out_host = Pieces.of(share.run())
        _record(sum(sizes), started, (c,), "host", device)
        _learn(device.name, kind, sizes, stored, [], share, 0.0, time.perf_counter() - started)
        return out_host
    driven = None
    if share is not None:
        import cupy

        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())  # the pieces and the carved output are ordered before it
        driven = _drivers().submit(_run_on, device, ready, share)
    parts: list[tuple[list[int], Pieces]] = []
    gpu_seconds = 0.0
    try:
        g0 = time.perf_counter()
        if gpu:
            parts.append((gpu, on_gpu(pieces.take(gpu), c, [sizes[i] for i in gpu], device,
                                      [where[i] for i in gpu])))
        gpu_seconds = time.perf_counter() - g0
    finally:
        if driven is not None:
            concurrent.futures.wait([driven])  # even when nvCOMP raised: the host share is over
    both_done = time.perf_counter()
    if driven is not None:
        parts.append((host, Pieces.of(driven.result())))  # the first failing piece's error, naming its file
        _record(sum(sizes[i] for i in host), started, (c,), "host", device)
    _learn(device.name, kind, [sizes[i] for i in host], [stored[i] for i in host], [sizes[i] for i in gpu],
           share, gpu_seconds, both_done - started, backlog)
    return Pieces.gather(len(pieces), parts)


#: Decoded bytes (at most ``CALIBRATE_PIECES`` pieces) that ``calibrate_host`` times.
CALIBRATE_BYTES = 4 << 20
CALIBRATE_PIECES = 8


def calibrate_host(pieces: Sequence[Any], c: Codec, sizes: Sequence[int], where: Sequence[Any], device: str,
                   kind: str) -> None:
    """Before the first plan for ``kind`` on ``device`` in this process: the host's rate per core,
    from pieces of this very batch decoded on this thread (their results dropped).

    The prior (``_split.Rates``) is one host's figure, and hosts differ: libdeflate decoded the
    benchmark's gzip-1 chunks at 0.45 GB/s a core on the H100 host the prior came from, 0.15 to
    0.17 on the H100 hosts of 2026-11-25 (0.36 on a workstation). Three times too fast, the
    prior sent the first batches of each process to the host alone: a 4 GiB HDF5 gzip-1 read
    took 2.4 GB/s where the split, once learnt, gave 3.9. Middling pieces are timed, about
    ``CALIBRATE_BYTES``; a piece that fails is left for the batch to report (with its file).
    """
    if _split.RECORD.calibrated(device, kind) or not pieces:
        return
    order = np.argsort(np.asarray(sizes, dtype=np.int64), kind="stable")
    picked, total = [], 0
    for k in order[len(order) // 2:]:
        if total >= CALIBRATE_BYTES or len(picked) >= CALIBRATE_PIECES:
            break
        picked.append(int(k))
        total += int(sizes[k])
    host = [_to_host(pieces[k]) for k in picked]
    started = time.perf_counter()
    try:
        for k, piece in zip(picked, host):
            _host_one(piece, (c,), int(sizes[k]), where[k])
    except Exception:  # noqa: BLE001 (the batch decodes it again and raises its error, naming the file)
        return
    seconds = time.perf_counter() - started
    if seconds > 0 and total:
        _split.RECORD.calibrate(device, kind, host_per_core=total / seconds)


def _to_host(piece: Any) -> np.ndarray:
    return piece.get() if hasattr(piece, "get") else np.asarray(piece)


def _learn(device: str, kind: str, host_sizes: list[int], host_stored: list[int], gpu_sizes: list[int],
           share: HostShare | None, gpu_seconds: float, wall: float, backlog: float = 0.0) -> None:
    """Fold what this batch measured into the device's rates for ``kind`` (``_split.RECORD``);
    ``backlog``: seconds of other batches' host work its host share was planned behind."""
    record = _split.RECORD
    rates = record.rates(device, kind)
    transfers = 2 * len(share.rounds) if share is not None else 0
    record.count(device, kind, batches=1, host_pieces=len(host_sizes), gpu_pieces=len(gpu_sizes),
                 host_bytes=sum(host_sizes), gpu_bytes=sum(gpu_sizes),
                 copied_down=sum(host_stored), copied_up=sum(host_sizes), transfers=transfers)
    if not gpu_sizes:
        # The host alone: its threads' own times give the rate per core. (Not from split
        # batches: a thread stalled behind nvCOMP's call would make the host look slow.)
        if share is not None and share.busy > 0:
            record.fold(device, kind, host_per_core=sum(host_sizes) / share.busy)
        return
    together = None
    if host_sizes:
        predicted = _split.host_seconds(host_sizes, host_stored, cores(), rates) + backlog
        together = _split.overlap(predicted, gpu_seconds, wall)
    record.fold(device, kind, gpu_per_stream=_split.per_stream(gpu_sizes, gpu_seconds, rates), overlap=together)


class HostDecode:
    """Host pieces decoded through ``steps`` on ``_run.host_pool``, each into its slot of ``out``
    (``out[starts[i]:starts[i] + sizes[i]]``), all queued at once.

    ``wait`` waits for every thread; ``check`` then raises the first failing piece's error
    (in piece order), naming its file.
    """

    def __init__(self, pieces: Sequence[np.ndarray], steps: tuple[Codec, ...], sizes: Sequence[int],
                 where: Sequence[ByteRange | None], out: np.ndarray, starts: Sequence[int]):
        pool = host_pool()
        self.futures = [pool.submit(_decode_into, piece, steps, int(n), w, out[at:at + int(n)])
                        for piece, n, w, at in zip(pieces, sizes, where, starts)]

    def wait(self) -> None:
        concurrent.futures.wait(self.futures)

    def check(self) -> None:
        self.wait()
        for f in self.futures:
            f.result()  # raises the first failing piece's error

    def busy_seconds(self) -> float:
        """Seconds the threads spent decoding, summed (after ``wait``)."""
        return sum(b - a for a, b in (f.result() for f in self.futures if f.exception() is None))


class HostShare:
    """Pieces (device arrays) decoded through ``steps`` on the host's cores; ``run`` does it.

    ``sizes`` are the decoded sizes, known before decoding: the device buffer the decoded
    bytes go to is carved per piece at once (on the caller's stream), and its layout is what
    the host buffers copy byte for byte. The pieces go in rounds of at most ``_split.ROUND``
    decoded bytes (``rounds``) through two pinned buffer pairs, down and up: while the threads
    decode one round, the next is copied down and the last one up, so the copies hide behind
    decoding and the pinned memory held stays bounded, whatever the batch's size.
    """

    def __init__(self, pieces: Sequence[Any], steps: tuple[Codec, ...], sizes: Sequence[int],
                 where: Sequence[ByteRange | None], side: Any = None):
        self.side = side if side is not None else CupySide()
        self.pieces, self.steps, self.where = list(pieces), steps, list(where)
        self.sizes = [int(n) for n in sizes]
        carved: tuple[Any, list[Any], list[int]] = self.side.carve(self.sizes)
        self.device_buf, self.views, self.starts = carved
        self.rounds = rounds(self.sizes, _split.ROUND)
        self.busy = 0.0  # seconds the threads spent decoding, summed

    def run(self) -> list[Any]:
        """Decode every round; a device view per piece. The copies run on the current stream
        (of the current device); every thread of the batch is done before an error is raised."""
        stream = self.side.stream()
        ring = [self._buffers(k) for k in range(min(2, len(self.rounds)))]
        started: list[_Round] = []
        try:
            for k, span in enumerate(self.rounds):
                started.append(self._start(span, ring[k % 2], stream))  # round k-2 is up: its buffers are free
                if k:
                    self._finish(started[k - 1], stream)
            if started:
                self._finish(started[-1], stream)
        finally:
            for r in started:
                r.decode.wait()  # no thread may still write into a pinned buffer handed back to the pool
        return self.views

    def _buffers(self, parity: int) -> tuple[np.ndarray, np.ndarray]:
        """The pinned (down, up) pair for every round of this parity, sized for the largest."""
        mine = self.rounds[parity::2]
        down = max(sum(int(p.size) for p in self.pieces[a:b]) for a, b in mine)
        up = max(self._span(a, b)[1] for a, b in mine)
        return self.side.pinned(down), self.side.pinned(up)

    def _span(self, a: int, b: int) -> tuple[int, int]:
        """Where pieces ``a:b`` sit in the device buffer: (offset, bytes), padding included."""
        return self.starts[a], self.starts[b - 1] + self.sizes[b - 1] - self.starts[a]

    def _start(self, span: tuple[int, int], buffers: tuple[np.ndarray, np.ndarray], stream: Any) -> _Round:
        a, b = span
        down, up = buffers
        pieces = self.side.download(self.pieces[a:b], down, stream)
        at = self.starts[a]
        decode = HostDecode(pieces, self.steps, self.sizes[a:b], self.where[a:b], up,
                            [s - at for s in self.starts[a:b]])
        return _Round(a, b, decode, up)

    def _finish(self, r: _Round, stream: Any) -> None:
        r.decode.check()  # the first failing piece's error, naming its file
        self.busy += r.decode.busy_seconds()
        at, n = self._span(r.a, r.b)
        if n:  # done before the next round but one writes into these pinned bytes
            self.side.upload(self.device_buf[at:at + n], r.up[:n], stream)


class CupySide:
    """Where a host share's pieces live and its decoded bytes go: CuPy device memory, through
    pinned host buffers, copies on the current stream. (The tests run ``HostShare`` on a
    NumPy side of the same shape.)"""

    def carve(self, sizes: list[int]) -> tuple[Any, list[Any], list[int]]:
        """One device buffer, a view per piece (``filters.carve``: 256-byte aligned), their offsets."""
        from gpulazy.codecs import filters

        buf, views = filters.carve(sizes)
        return buf, views, [int(v.data.ptr - buf.data.ptr) for v in views]

    def stream(self) -> Any:
        import cupy

        return cupy.cuda.get_current_stream()

    def pinned(self, nbytes: int) -> np.ndarray:
        return _pinned(nbytes)

    def download(self, pieces: Sequence[Any], into: np.ndarray, stream: Any) -> list[np.ndarray]:
        """The pieces' bytes in ``into`` (host): gathered on the device, one transfer."""
        import cupy

        lengths = [int(p.size) for p in pieces]
        total = sum(lengths)
        if total:
            flat = cupy.concatenate([p.reshape(-1).view(np.uint8) for p in pieces])
            flat.get(stream=stream, out=into[:total])  # blocking: the bytes are there on return
        cuts = np.cumsum([0, *lengths])
        return [into[a:b] for a, b in itertools.pairwise(cuts)]

    def upload(self, dst: Any, src: np.ndarray, stream: Any) -> None:
        """``src`` into ``dst`` (device), in one transfer, over when this returns."""
        dst.set(src, stream=stream)
        stream.synchronize()


@dataclass
class _Round:
    a: int  # the round's pieces are a:b of its share
    b: int
    decode: HostDecode
    up: np.ndarray


def rounds(sizes: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive pieces, ``(start, stop)``, in rounds of at most ``limit`` bytes (a piece
    bigger than that alone); none empty."""
    out: list[tuple[int, int]] = []
    start, held = 0, 0
    for i, n in enumerate(sizes):
        if i > start and held + n > limit:
            out.append((start, i))
            start, held = i, 0
        held += n
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


@functools.cache
def _drivers() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that drive a host share's rounds while the calling thread waits in nvCOMP."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=cores(), thread_name_prefix="gpulazy-host-share")


_local = threading.local()


def _run_on(device: Device, ready: Any, share: HostShare) -> list[Any]:
    """``share.run()`` on a driver thread, on a stream of its own that waits for ``ready``.

    Not the caller's stream: its copies synchronise their stream, and nvCOMP's kernels are
    queued on the caller's at the same time; the host's copies must not wait for them.
    """
    import cupy

    with device.activate():  # a new thread's CuPy starts on device 0
        streams = _local.__dict__.setdefault("streams", {})
        if device.index not in streams:
            streams[device.index] = cupy.cuda.Stream(non_blocking=True)
        stream = streams[device.index]
        stream.wait_event(ready)
        with stream:
            return share.run()  # every copy up synchronised: the bytes are in place on return


def _decode_into(piece: np.ndarray, steps: tuple[Codec, ...], want: int, where: ByteRange | None,
                 slot: np.ndarray) -> tuple[float, float]:
    """Decode one piece into its slot; when it started and ended (the thread's busy time)."""
    started = time.perf_counter()
    if len(steps) == 1 and steps[0].id == "head" and want == slot.size:
        # Straight into the slot, not into a buffer a head copied in after: 64 one-plane heads on
        # gpulazy's 16 host threads took 4.1 ms against 4.9, and a plane of a zstd Zarr in the engine
        # 0.8 x the time (H200 host, RESULTS.md, thirty-third session).
        _host_one(piece, steps, want, where, into=slot)
        return started, time.perf_counter()
    arr = _host_one(piece, steps, want, where)
    if int(arr.size) != slot.size:  # a step whose output size was unknown decoded to another size
        raise size_error(where, steps, want, int(arr.size), f"it decoded to {int(arr.size)} bytes")
    np.copyto(slot, arr.reshape(-1).view(np.uint8))
    return started, time.perf_counter()


def _pinned(nbytes: int) -> np.ndarray:
    """``nbytes`` of host memory the GPU copies to and from at full speed, or pageable memory
    where pinned memory cannot be had.

    From CuPy's pinned pool, in sizes rounded up to a power of two: the pool reuses a freed
    block only for a request of the same size, so batches of ever different sizes would each
    pin new memory (slow) and leave the old blocks held.
    """
    size = size_class(nbytes)
    try:
        import cupyx

        return cupyx.empty_pinned((size,), np.uint8)[:max(1, nbytes)]
    except Exception:  # out of pinned memory, or a CuPy without it: slower copies, same bytes
        return np.empty(max(1, nbytes), np.uint8)


def size_class(nbytes: int) -> int:
    """The pinned block that holds ``nbytes``: a power of two, at least 1 MiB."""
    return max(1 << 20, 1 << max(0, int(nbytes) - 1).bit_length())
