"""Decoding for chunks that live on a GPU: one batch per pipeline step.

Every step of a pipeline runs over all pieces of a batch at once: compressors nvCOMP
knows in one nvCOMP call (``gpulazy.codecs.nvcomp``), shuffle/delta/crc32c in one
CuPy kernel launch (``gpulazy.codecs.filters``). A step with no GPU implementation
runs on the host for those pieces: one copy down, numcodecs/imagecodecs on a thread
pool, one copy up, with one ``PerformanceWarning`` per codec. Pieces nvCOMP does not
take (unusual framing) or decodes to the wrong size go through the host too, which
decodes them or raises the ``ChunkDecodeError`` that names the file and offset.
Deflate (zlib, gzip, TIFF deflate) is the exception: nvCOMP decodes each stream slowly, so a
Deflate batch is shared between nvCOMP and libdeflate on every host core, by rates this
process measures (``gpulazy.codecs._split``, ``gpulazy.codecs._beside``); a batch with too few
pieces for nvCOMP to pay off decodes on the host alone, with no warning.
Where each step ran is recorded in ``gpulazy.stats()`` (``decode`` figures).
``gpulazy.config.set(gpu_decode=False)`` decodes every step on the host (for files you
do not trust: nvCOMP assumes valid input, see ``gpulazy.codecs.nvcomp``).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from gpulazy.codecs._frames import step_sizes
from gpulazy.codecs.pieces import Pieces
from gpulazy.device import Device
from gpulazy.spec import ByteRange, Codec

__all__ = ["decode_pieces", "runs_on_gpu", "step_sizes"]


def runs_on_gpu(c: Codec) -> bool:
    """Whether step ``c`` decodes on the GPU here (never with ``config gpu_decode=False``)."""
    from gpulazy import config
    return bool(config.get("gpu_decode")) and (_batch_decoder(c) is not None or _filters().handles(c))


def _filters() -> Any:
    from gpulazy.codecs import filters

    return filters


def _batch_decoder(c: Codec) -> Any:
    """The function decoding a batch of ``c`` pieces on the GPU (``nvcomp.decode``'s signature, ``Pieces``
    in and out), or None."""
    from gpulazy.codecs import bitshuffle, blosc, nvcomp

    if nvcomp.handles(c):
        return nvcomp.decode
    if blosc.handles(c):  # blosc framing read here, its LZ4/zstd streams through nvCOMP
        return blosc.decode
    if bitshuffle.handles(c):  # HDF5 bitshuffle: its LZ4 blocks through nvCOMP, a kernel unshuffles
        return bitshuffle.decode
    return None


def decode_pieces(pieces: Sequence[Any], codec: tuple[Codec, ...], expected: Sequence[int], device: Device, *,
                  where: Sequence[ByteRange | None] = ()) -> Pieces:
    """Each piece (``Pieces``, or CuPy arrays) decoded through ``codec`` on ``device``, a batch per step."""
    from gpulazy.codecs._run import _pad

    from gpulazy import config
    from gpulazy.codecs._run import _record

    where = _pad(where, len(pieces))
    current = Pieces.of(pieces)
    if not config.get("gpu_decode"):  # asked for: every step on the host, no warning
        started = time.perf_counter()
        current = Pieces.of(_on_host(list(current), codec, list(expected), where))
        _record(int(current.sizes.sum()), started, codec, "host", device)
        return current
    for c, sizes in zip(codec, step_sizes(codec, expected)):
        current = _step(current, c, sizes, device, where)
    return current


def _step(pieces: Pieces, c: Codec, sizes: list[int] | None, device: Device, where: list[Any]) -> Pieces:
    from gpulazy.codecs import _split, filters
    from gpulazy.codecs._run import _record, warn_host_fallback

    started = time.perf_counter()
    decoder = _batch_decoder(c) if sizes is not None else None
    if decoder is not None and sizes is not None:
        if _split.applies(c):  # Deflate, zstd: nvCOMP is slow per stream, the host's cores may take a share
            from gpulazy.codecs._beside import beside_host

            return beside_host(pieces, c, sizes, device, where, lambda *a: _batched(decoder, *a))
        return _batched(decoder, pieces, c, sizes, device, where)
    if filters.handles(c):
        try:
            out = Pieces.of(filters.decode(list(pieces), c))
        except ValueError:  # a piece the kernel cannot take (e.g. a ragged delta): the host says why
            pass
        else:
            import cupy

            cupy.cuda.get_current_stream().synchronize()  # so the recorded time is the kernel's, not its launch
            _record(int(out.sizes.sum()), started, (c,), "gpu", device)
            return out
    warn_host_fallback(c, device)
    out = Pieces.of(_on_host(list(pieces), c, sizes, where))
    _record(int(out.sizes.sum()), started, (c,), "host", device)
    return out


def _batched(decoder: Any, pieces: Pieces, c: Codec, sizes: list[int], device: Device, where: list[Any]
             ) -> Pieces:
    """Step ``c`` over every piece in one call of its GPU batch decoder; the pieces it refuses on the host."""
    from gpulazy.codecs._run import _record, warn_host_fallback

    started = time.perf_counter()
    res = decoder(pieces, c, sizes, device.index)
    out = res.out
    if len(res.host) < len(pieces):
        _record(sum(sizes) - sum(sizes[i] for i in res.host), started, (c,), "gpu", device)
    if res.slow:  # e.g. blosc whose inner codec has no GPU decoder
        warn_host_fallback(c, device)
    if res.host:  # framing nvCOMP does not take, or a result that failed a check
        started = time.perf_counter()
        redo = res.host_codec or c
        out = out.replaced(res.host, _on_host([pieces[i] for i in res.host], redo, [sizes[i] for i in res.host],
                                              [where[i] for i in res.host]))
        _record(sum(sizes[i] for i in res.host), started, (c,), "host", device)
    return out


def _on_host(pieces: list[Any], c: Codec | tuple[Codec, ...], sizes: list[int] | None, where: list[Any]
             ) -> list[Any]:
    """Step (or pipeline) ``c`` on the host: one copy down, decode on a thread pool, one copy up.

    With the decoded sizes known, in rounds through pinned buffers, each piece decoded into its
    slot of a buffer that goes up in one copy per round (``_beside.HostShare``).
    """
    from gpulazy.codecs._run import _host_one, host_map

    if not pieces:
        return []
    if sizes is not None:
        from gpulazy.codecs._beside import HostShare

        return HostShare(pieces, c if isinstance(c, tuple) else (c,), sizes, where).run()
    down = _download(pieces)
    sz = sizes if sizes is not None else [None] * len(pieces)
    jobs = [(p, n, w) for p, n, w in zip(down, sz, where)]
    steps = c if isinstance(c, tuple) else (c,)
    decoded = host_map(lambda j: _host_one(j[0], steps, j[1], j[2]), jobs)
    return _upload(decoded)


def _download(pieces: list[Any]) -> list[np.ndarray]:
    import cupy

    lengths = [int(p.size) for p in pieces]
    host = cupy.concatenate(pieces).get() if sum(lengths) else np.empty(0, np.uint8)
    cuts = np.cumsum([0, *lengths])
    return [host[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def _upload(arrays: list[np.ndarray]) -> list[Any]:
    """One copy up; each piece starts 256-byte aligned, so any dtype can view it."""
    import cupy

    flat = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    offsets = np.cumsum([0, *(-(-a.size // 256) * 256 for a in flat)])
    staged = np.empty(max(int(offsets[-1]), 1), np.uint8)
    for a, at in zip(flat, offsets):
        staged[at:at + a.size] = a
    dev = cupy.asarray(staged)
    return [dev[at:at + a.size] for a, at in zip(flat, offsets)]
