"""A GPU batch decoded on the host's cores, alone or beside nvCOMP.

``HostShare`` decodes pieces that live in device memory on ``_run.host_pool``: one copy of
their stored bytes down (gathered on the device, one transfer into a pinned buffer), each piece
decoded by its own thread into its slot of one pinned buffer laid out like the device buffer
it goes to (every slot 256-byte aligned, so any dtype can view it), and one copy up. So a
host share costs two transfers per batch, whatever its number of pieces, plus, for Deflate,
one copy per piece in host memory (libdeflate through the ``deflate`` package returns a
buffer of its own, copied into the slot by the thread that decoded it).

``beside_host`` runs a Deflate batch on both: ``_split.gpu_share`` picks the pieces nvCOMP
decodes; the host's share is copied down and queued first, nvCOMP decodes its share in the
calling thread meanwhile, then the host's pieces go up. Each side's time is folded into
``_split.RECORD`` so the next batch's split follows this machine. The host's threads need
the GIL between pieces: if nvCOMP's call held it while waiting for the GPU they would stall,
the batch would take the sum of both sides' times, and ``_split.overlap`` measures exactly
that, so the next plans treat the two sides as running one after the other.

Every piece is checked as on the host alone: a corrupt one, or one that decodes to another
size, raises the ``ChunkDecodeError`` naming its file and offset (``_run.decode_error``,
``_run.size_error``). Before any error is raised, every host thread of the batch has finished,
so none writes into a buffer that is handed back.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from typing import Any, Callable, Sequence

import numpy as np

from gpulazy.codecs import _split
from gpulazy.codecs._run import _host_one, _record, cores, host_pool, size_error
from gpulazy.device import Device
from gpulazy.spec import ByteRange, Codec

__all__ = ["HostDecode", "HostShare", "beside_host"]


def beside_host(pieces: list[Any], c: Codec, sizes: list[int], device: Device, where: list[Any],
                on_gpu: Callable[[list[Any], Codec, list[int], Device, list[Any]], list[Any]]) -> list[Any]:
    """Step ``c`` (Deflate) over ``pieces`` (device arrays): ``on_gpu`` decodes the GPU's share
    (nvCOMP, its own fallbacks), the host's cores the rest."""
    stored = [int(p.size) for p in pieces]
    gpu = _split.gpu_share(sizes, stored, cores(), device.name)
    picked = set(gpu)
    host = [i for i in range(len(pieces)) if i not in picked]
    started = time.perf_counter()
    share = HostShare([pieces[i] for i in host], (c,), [sizes[i] for i in host], [where[i] for i in host]) \
        if host else None
    out: list[Any] = [None] * len(pieces)
    gpu_seconds = 0.0
    try:
        if gpu:
            g0 = time.perf_counter()
            for i, arr in zip(gpu, on_gpu([pieces[i] for i in gpu], c, [sizes[i] for i in gpu], device,
                                          [where[i] for i in gpu])):
                out[i] = arr
            gpu_seconds = time.perf_counter() - g0
    finally:
        if share is not None:
            share.wait()  # even when nvCOMP raised: no thread may still write into the pinned buffers
    both_done = time.perf_counter()
    if share is not None:
        for i, arr in zip(host, share.result()):  # the first failing piece's error, naming its file
            out[i] = arr
        _record(sum(sizes[i] for i in host), started, (c,), "host", device)
    _learn(device.name, [sizes[i] for i in host], [stored[i] for i in host], [sizes[i] for i in gpu],
           share, gpu_seconds, both_done - started)
    return out


def _learn(device: str, host_sizes: list[int], host_stored: list[int], gpu_sizes: list[int],
           share: HostShare | None, gpu_seconds: float, wall: float) -> None:
    """Fold what this batch measured into the device's rates (``_split.RECORD``)."""
    record = _split.RECORD
    rates = record.rates(device)
    record.count(device, batches=1, host_pieces=len(host_sizes), gpu_pieces=len(gpu_sizes),
                 host_bytes=sum(host_sizes), gpu_bytes=sum(gpu_sizes),
                 copied_down=sum(host_stored), copied_up=sum(host_sizes), transfers=2 if host_sizes else 0)
    if not gpu_sizes:
        # The host alone: its threads' own times give the rate per core. (Not from split
        # batches: a thread stalled behind nvCOMP's call would make the host look slow.)
        if share is not None and share.busy_seconds() > 0:
            record.fold(device, host_per_core=sum(host_sizes) / share.busy_seconds())
        return
    together = None
    if host_sizes:
        predicted = _split.host_seconds(host_sizes, host_stored, cores(), rates)
        together = _split.overlap(predicted, gpu_seconds, wall)
    record.fold(device, gpu_per_stream=_split.per_stream(gpu_sizes, gpu_seconds, rates), overlap=together)


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
    """Pieces (device arrays) decoded through ``steps`` on the host's cores, started at once.

    ``sizes`` are the decoded sizes, known before decoding: each piece's slot is laid out
    from them. ``wait`` waits for every thread; ``result`` raises the first failing piece's
    error (in piece order) or copies the decoded bytes up and returns a device view per piece.
    """

    def __init__(self, pieces: Sequence[Any], steps: tuple[Codec, ...], sizes: Sequence[int],
                 where: Sequence[ByteRange | None]):
        from gpulazy.codecs import filters

        # The device buffer first: the host buffer copies its layout byte for byte.
        self.device_buf, self.views = filters.carve([int(n) for n in sizes])
        starts = [int(v.data.ptr - self.device_buf.data.ptr) for v in self.views]
        self.down = _download(pieces)  # kept alive until the threads are done with it
        self.up = _pinned(int(self.device_buf.size))
        self.decode = HostDecode(self.down, steps, sizes, where, self.up, starts)
        self.wait, self.busy_seconds = self.decode.wait, self.decode.busy_seconds

    def result(self) -> list[Any]:
        import cupy

        self.decode.check()
        stream = cupy.cuda.get_current_stream()
        self.device_buf.set(self.up[:self.device_buf.size], stream=stream)
        stream.synchronize()  # the pinned buffer goes back to CuPy's pool: the copy must be over
        return self.views


def _decode_into(piece: np.ndarray, steps: tuple[Codec, ...], want: int, where: ByteRange | None,
                 slot: np.ndarray) -> tuple[float, float]:
    """Decode one piece into its slot; when it started and ended (the thread's busy time)."""
    started = time.perf_counter()
    arr = _host_one(piece, steps, want, where)
    if int(arr.size) != slot.size:  # a step whose output size was unknown decoded to another size
        raise size_error(where, steps, want, int(arr.size), f"it decoded to {int(arr.size)} bytes")
    np.copyto(slot, arr.reshape(-1).view(np.uint8))
    return started, time.perf_counter()


def _download(pieces: Sequence[Any]) -> list[np.ndarray]:
    """The pieces' bytes on the host: gathered on the device, one transfer into a pinned buffer."""
    import cupy

    lengths = [int(p.size) for p in pieces]
    host = _pinned(sum(lengths))
    if sum(lengths):
        flat = cupy.concatenate([p.reshape(-1).view(np.uint8) for p in pieces])
        flat.get(stream=cupy.cuda.get_current_stream(), out=host[:flat.size])
    cuts = np.cumsum([0, *lengths])
    return [host[a:b] for a, b in itertools.pairwise(cuts)]


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
