"""The read engine: chunk specs in, chunks out, each written once into its destination.

``start(specs, backend, outs)`` is the only place in gpulazy that starts, waits for and
settles reads. It

- **allocates** what the caller did not give: a chunk read as it is stored lands in the
  array handed out (``Device.alloc``, the consumer's pool); a chunk made of stored pieces
  (compressed, tiled) reads its stored bytes into one buffer and decodes into its array;
- **executes** one backend submission for the whole batch (``Backend.submit_many``),
  ``verify=True`` checking stored bytes as they land (``gpulazy.checksums.VerifiedRead``);
- **decodes** the batch's stored-piece chunks in one codec call per codec
  (``gpulazy.codecs.assemble_batch``: nvCOMP sees every piece at once), straight into
  their destinations;
- **hands out** on gpulazy's own stream, waited for before a chunk is returned, so a
  chunk is complete on every stream (docs/streams.md);
- checks the files' identities after each read (``gpulazy.integrity``): a file changed
  since indexing, before or during the read, fails its chunks with an error that says what
  changed, also where the read or decode itself failed on the changed bytes (a consumer
  serving a chunk from a cache checks that chunk itself: nothing is read for it); and
  settles every read before raising the first error, so nothing ever writes into a buffer
  that was dropped.

It counts what it allocates and copies (``gpulazy.stats()["buffers"]``): a chunk read as
stored is one allocation (its array; none when the caller gives the destination) and no
copy, unless the caller's destination is not contiguous in the chunk's element order; a
chunk of stored pieces also takes a buffer for its stored bytes (``staging``) and one
copy per piece into place.

>>> import numpy as np, os, tempfile
>>> from gpulazy.io import get_backend
>>> from gpulazy.spec import ByteRange, ChunkSpec
>>> p = os.path.join(tempfile.mkdtemp(), "a.raw"); np.arange(8, dtype=">u2").tofile(p)
>>> specs = [ChunkSpec((ByteRange(p, 8 * i, 8),), (4,), ">u2") for i in range(2)]
>>> [a.tolist() for a in start(specs, get_backend("posix", "cpu")).result()]
[[0, 1, 2, 3], [4, 5, 6, 7]]
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Iterator, Sequence

import numpy as np

from gpulazy.device import Device, own_stream
from gpulazy.integrity import as_read_error, unchanged_each
from gpulazy.io import Backend, ReadFuture
from gpulazy.spec import ChunkSpec, FileIdentity

__all__ = ["Reads", "start", "start_retrying", "read", "reading", "byte_view"]

_PENDING = object()
#: The most chunks after those finishing that ``Reads._check_landed`` checks with their stat.
_LANDED_SCAN = 64


def start(specs: Sequence[ChunkSpec], backend: Backend, outs: Sequence[Any] | None = None, *,
          verify: bool = False, staged: bool | None = None) -> Reads:
    """Start reading ``specs`` in one submission from this thread; returns at once.

    Parameters
    ----------
    specs
        The chunks.
    backend
        The I/O backend (its device is where the chunks land).
    outs
        ``outs[i]``: where chunk ``i`` goes (an array of its shape and native dtype on the
        device, e.g. its slice of a result or a cache slot), or ``None`` to allocate one.
    verify
        Check each chunk's stored bytes against their checksums as they land.
    staged
        As in ``Backend.submit_many``.

    Out of memory raises ``MemoryError``: the consumer, who knows what it can give back,
    retries (``gpulazy.memory.retry_on_oom``).
    """
    return Reads(list(specs), backend, outs, verify, staged)


def start_retrying(specs: Sequence[ChunkSpec], backend: Backend, outs: Sequence[Any] | None = None, *,
                   verify: bool = False, staged: bool | None = None) -> Reads:
    """``start(...)``, retried once after making room when memory runs out (``gpulazy.memory.retry_on_oom``:
    the device's caches emptied, CuPy's pools given back); running out again raises
    ``DeviceMemoryError`` naming the chunks, their file and the device's free and cached bytes."""
    from gpulazy.memory import retry_on_oom

    specs = list(specs)
    return retry_on_oom(lambda: start(specs, backend, outs, verify=verify, staged=staged), device=backend.device,
                        nbytes=sum(s.out_nbytes for s in specs), what=reading(specs))


def reading(specs: Sequence[ChunkSpec]) -> str:
    """What reading ``specs`` is, for an out-of-memory error: ``"reading chunk (3, 0) of '/data/a.zarr/3.0'"``,
    ``"reading 16 chunks from (0, 0) of ..."``."""
    first = specs[0]
    if not first.ranges:
        return "reading a chunk" if len(specs) == 1 else "reading chunks"
    if len(specs) == 1:
        return f"reading chunk {first.index} of {first.paths[0]!r}"
    return f"reading {len(specs)} chunks from {first.index} of {first.paths[0]!r}"


def read(specs: Sequence[ChunkSpec], backend: Backend, outs: Sequence[Any] | None = None, *,
         verify: bool = False, staged: bool | None = None) -> list[Any]:
    """``start(...).result()``: the chunks, in order, each complete on every stream."""
    return start(specs, backend, outs, verify=verify, staged=staged).result()


class Reads:
    """Chunks whose reads are in flight, each with its destination.

    ``chunk(i)`` waits for chunk ``i`` only (a chunk of stored pieces: for every
    stored-piece chunk of the batch, which decode together; a verified chunk also finishes
    the verified chunks that have landed, hashed together) and returns it; ``result()``
    returns them all, raising the first error once every read has settled; ``done(i)``
    never blocks. Safe from several threads at once. A ``Reads`` dropped unfinished waits
    for its reads (the backend's batch does) before its buffers go.
    """

    __slots__ = ("specs", "device", "backend", "dests", "bufs", "inplace", "futures", "outcomes", "verify",
                 "checked", "_lock", "__weakref__")

    def __init__(self, specs: list[ChunkSpec], backend: Backend, outs: Sequence[Any] | None, verify: bool,
                 staged: bool | None):
        dev = backend.device
        n = len(specs)
        self.specs, self.device, self.backend, self.verify = specs, dev, backend, verify
        self.dests: list[Any] = [None] * n
        self.bufs: list[Any] = [None] * n
        self.inplace = [False] * n
        self.outcomes: list[Any] = [_PENDING] * n
        #: Chunks whose files were stat'ed after their reads landed, before they finished: their
        #: identity check's outcome (``_check_landed``).
        self.checked: dict[int, Any] = {}
        self._lock = threading.RLock()
        jobs, slots = [], []
        with dev.activate():
            fresh = _outputs(specs, outs, dev)
            for i, spec in enumerate(specs):
                given = None if outs is None else outs[i]
                self.dests[i], self.bufs[i], self.inplace[i] = _targets(spec, given, fresh.get(i))
            own = [i for i in range(n) if self.bufs[i] is None]
            for i, buf in zip(own, _buffers([specs[i].nbytes for i in own], dev)):
                self.bufs[i] = buf
            for i, spec in enumerate(specs):
                if spec.nbytes:
                    jobs.append((spec.ranges, self.bufs[i]))
                    slots.append(i)
            # Files kept open as indexed are read without a stat: ``_check_landed`` stats them after.
            known = {ident.path: ident for i in slots for ident in specs[i].identity
                     if isinstance(ident, FileIdentity) and ident.exists}
            submitted = backend.submit_many(jobs, staged=staged, known=known) if jobs else []
        self.futures: list[Any] = [ReadFuture.completed(0)] * n
        for i, future in zip(slots, submitted):
            self.futures[i] = _verified(future, self.bufs[i], specs[i]) if verify else future

    def __len__(self) -> int:
        return len(self.specs)

    def done(self, i: int) -> bool:
        """Whether chunk ``i``'s bytes are in (never blocks)."""
        return self.outcomes[i] is not _PENDING or self.futures[i].done()

    def pending(self, i: int) -> PendingChunk:
        """Chunk ``i`` as an object of its own (``done()``, ``result()``, ``spec``)."""
        return PendingChunk(self, i)

    def chunk(self, i: int) -> Any:
        """Chunk ``i``, complete on every stream; raises its read's (or decode's) error."""
        outcome = self.outcomes[i]
        if outcome is _PENDING:
            if not self.specs[i].is_assembled and not self.verify:
                _landed(self.futures[i])  # the wait outside the lock: the batch's other chunks go on
            with self._lock:
                if self.outcomes[i] is _PENDING:
                    self._finish(self._together(i))
                outcome = self.outcomes[i]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _together(self, i: int) -> list[int]:
        # Lock held. Chunks of stored pieces decode in one call, so they finish together. A
        # verified chunk read as stored finishes with the others of its kind that have landed:
        # one hash kernel and one wait for all of them, where each pick task of a dask compute
        # would otherwise hash and wait for its own (0.80-0.90 x the plain read through dask's
        # threads, against 0.90-1.10 x together, on an H100). Another chunk read as stored
        # finishes with those after it whose reads are in, up to the first still reading: one
        # finish (and one stat of their files) for the run, where a consumer taking the chunks
        # in order (a streamed map, between calls of its function) paid one each.
        assembled = self.specs[i].is_assembled
        if not assembled and not self.verify:
            return [i, *self._landed_after(i)]
        return [j for j in range(len(self.specs)) if j == i or (
            self.outcomes[j] is _PENDING and self.specs[j].is_assembled == assembled
            and (assembled or self.futures[j].done()))]

    def _landed_after(self, i: int) -> Iterator[int]:
        """The pending chunks read as stored right after ``i`` whose reads are in, up to the first
        that is not (at most ``_LANDED_SCAN``): reads land about in order, so this costs about one
        ``done()`` a chunk."""
        for j in range(i + 1, min(len(self.specs), i + 1 + _LANDED_SCAN)):
            if self.outcomes[j] is not _PENDING or self.specs[j].is_assembled or not self.futures[j].done():
                return
            yield j

    def result(self) -> list[Any]:
        """Every chunk, in order; the first error is raised once every read has settled."""
        self.settle()
        return [self.chunk(i) for i in range(len(self.specs))]

    def settle(self) -> None:
        """Wait for every read and finish every chunk (errors kept for ``chunk``)."""
        with self._lock:
            todo = [i for i in range(len(self.specs)) if self.outcomes[i] is _PENDING]
            self._finish(todo)

    # -- finishing ---------------------------------------------------------------------------

    def _finish(self, idx: list[int]) -> None:
        # Lock held. Wait for the reads of ``idx``, then decode and place them on gpulazy's stream.
        if self.verify:
            _verify_together([self.futures[i] for i in idx])
        for i in idx:
            try:
                self.futures[i].result()
            except BaseException as e:
                self.outcomes[i] = as_read_error(e, self.specs[i])
        ok = [i for i in idx if self.outcomes[i] is _PENDING]
        plain = [i for i in ok if not self.specs[i].is_assembled]
        pieces = [i for i in ok if self.specs[i].is_assembled]
        dev = self.device
        # A chunk that landed in place in native byte order needs no device work of gpulazy's:
        # its staged copy was waited for above. Entering (and waiting for) gpulazy's stream costs
        # tens of microseconds a chunk, the scheduler's thread's time under read-ahead.
        if not pieces and all(self.inplace[i] and not self.specs[i].needs_byteswap for i in plain):
            for i in plain:
                self.outcomes[i] = self.dests[i]  # landed where it lives
        else:
            with dev.activate(), own_stream(dev):  # waited for on leaving
                self._place(plain, pieces)
        for i in pieces:
            if _short_head(self.specs[i], self.outcomes[i]):
                self.outcomes[i] = self._whole_instead(i)
        placed = [i for i in ok if not isinstance(self.outcomes[i], BaseException)]
        self._check_landed([i for i in placed if i not in self.checked])
        for i in ok:
            self.bufs[i] = None  # the stored bytes are not needed once decoded
        self._explain_failed(idx)
        for i in idx:  # a chunk checked early whose read or decode failed drops its entry too
            error = self.checked.pop(i, None)  # written to during the read: bytes may be mixed
            if error is not None and not isinstance(self.outcomes[i], BaseException):
                self.outcomes[i] = error

    def _place(self, plain: list[int], pieces: list[int]) -> None:
        # Lock held, on gpulazy's stream: chunks read as stored put in place (byte-swapped, copied
        # into destinations their bytes did not land in), chunks of stored pieces decoded.
        from gpulazy.read.decode import assemble_into, place_plain

        dev = self.device
        if plain:
            try:
                placed = place_plain([self.bufs[i] for i in plain], [self.dests[i] for i in plain],
                                     [self.specs[i] for i in plain], dev, [self.inplace[i] for i in plain])
            except BaseException as e:  # the launch itself: every chunk of it
                placed = [e] * len(plain)
            for i, arr in zip(plain, placed):
                self.outcomes[i] = arr
        if pieces:
            try:
                arrays = assemble_into([self.bufs[i] for i in pieces], [self.specs[i] for i in pieces],
                                       [self.dests[i] for i in pieces], dev)
            except BaseException as e:  # one chunk alone (several: each gets its own outcome)
                arrays = [e] * len(pieces)
            for i, arr in zip(pieces, arrays):
                self.outcomes[i] = arr

    def _whole_instead(self, i: int) -> Any:
        # Lock held. Head ``i``'s frame cannot serve it (``HeadShort``: it needs more stored bytes, or a
        # whole read to be checked): its whole chunk is read (a submission of its own, waited for
        # here), which decodes it or says what is wrong with it, and its planes go where the head's
        # would have. Every consumer of heads gets this (a box, a streamed map or reduction, napari).
        whole, first = self.specs[i].whole
        try:
            chunk = read([whole], self.backend, verify=self.verify, staged=False)[0]
        except BaseException as e:
            return e
        part = chunk[first:first + self.specs[i].shape[0]]
        dest = self.dests[i]
        if dest is None:
            return part
        with own_stream(self.device):
            dest[...] = part
        return dest

    def _explain_failed(self, idx: list[int]) -> None:
        # Lock held; the outcomes that are errors are the reads' and decodes' (identity checks
        # not applied yet). A read or decode that failed on a file changed since indexing
        # (truncated: a short read; rewritten: a garbled frame; removed) fails with what
        # changed, the failure as its cause. Nothing stats the files before a read, so this is
        # where a change made before it shows; a read that succeeded was checked by
        # ``_check_landed``.
        failed = [i for i in idx if isinstance(self.outcomes[i], Exception)
                  and not isinstance(self.outcomes[i], MemoryError)]  # out of memory: the consumer retries
        if not failed:
            return
        changed = unchanged_each([self.specs[i] for i in failed])
        for i in failed:
            error = changed(self.specs[i])
            if error is not None:
                error.__cause__ = self.outcomes[i]
                self.outcomes[i] = error

    def _check_landed(self, idx: list[int]) -> None:
        # Lock held. The files of ``idx`` are stat'ed now, after their reads landed. The pending
        # chunks right after them whose reads have landed too, of the same files, are checked by
        # the same stats and finish later without one: a dask compute finishes its
        # chunks one pick task at a time, and a stat per chunk cost 0.1-0.2 ms on an H100 host
        # (about a tenth of the main thread's time per chunk of a read + compute pass).
        if idx:
            files = {ident for i in idx for ident in self.specs[i].identity}
            later = []
            for j in range(max(idx) + 1, min(len(self.specs), max(idx) + 1 + _LANDED_SCAN)):
                if self.outcomes[j] is not _PENDING or j in self.checked:
                    continue
                # Reads land about in order: the scan ends at the first chunk still reading or of
                # other files, so it costs about one ``done()`` a chunk, not ``_LANDED_SCAN``.
                if not files.issuperset(self.specs[j].identity) or not self.futures[j].done():
                    break
                later.append(j)
            changed = unchanged_each([self.specs[i] for i in idx])  # after ``done()``: after those reads
            for j in itertools.chain(idx, later):
                self.checked[j] = changed(self.specs[j])


def _short_head(spec: ChunkSpec, outcome: Any) -> bool:
    """Whether ``outcome`` is head ``spec``'s decode running short (``HeadShort``), its whole chunk known."""
    from gpulazy.codecs.host import HeadShort

    return spec.whole is not None and isinstance(outcome, BaseException) and isinstance(outcome.__cause__, HeadShort)


class PendingChunk:
    """One chunk of a ``Reads``: ``done()`` never blocks, ``result()`` waits and returns it."""

    __slots__ = ("reads", "i")

    def __init__(self, reads: Reads, i: int):
        self.reads, self.i = reads, i

    @property
    def spec(self) -> ChunkSpec:
        return self.reads.specs[self.i]

    def done(self) -> bool:
        return self.reads.done(self.i)

    def result(self) -> Any:
        return self.reads.chunk(self.i)


def _landed(future: Any) -> None:
    """Wait for ``future``'s read; its error, if any, is raised where the chunk is finished."""
    try:
        future.result()
    except Exception:
        pass


def _verify_together(futures: list[Any]) -> None:
    """Verified reads of one submission checked together: one XXH3 kernel (or one set of host
    jobs) for all their blocks instead of one per chunk (``checksums.VerifiedRead.settle_many``)."""
    from gpulazy.checksums import VerifiedRead

    batch = [f for f in futures if isinstance(f, VerifiedRead)]
    if len(batch) > 1:
        VerifiedRead.settle_many(batch)


def _verified(future: Any, buf: Any, spec: ChunkSpec) -> Any:
    from gpulazy.checksums import VerifiedRead

    return VerifiedRead(future, buf, spec)


def _outputs(specs: list[ChunkSpec], outs: Sequence[Any] | None, dev: Device) -> dict[int, Any]:
    """``{i: array}`` for the chunks read as stored that were given no destination: each lands
    in a new array, allocated here together (``Device.alloc_many``: one event for all)."""
    from gpulazy.read.decode import count

    need = [i for i, spec in enumerate(specs) if (outs is None or outs[i] is None)
            and not spec.is_assembled and spec.nbytes == spec.out_nbytes]
    if not need:
        return {}
    made = dev.alloc_many([(specs[i].shape, specs[i].out_dtype, "F" if specs[i].order == "F" else "C")
                           for i in need])
    count("outputs", len(need))
    return dict(zip(need, made))


def _targets(spec: ChunkSpec, out: Any, fresh: Any) -> tuple[Any, Any, bool]:
    """``(destination, buffer the bytes land in, whether that buffer is the destination's
    memory)`` for one chunk: ``out``, the caller's destination, else ``fresh`` (``_outputs``), else
    none (the chunk is made by its decode or from its buffer). The buffer is ``None`` when the
    chunk needs one of its own (``_buffers`` makes them for the whole submission).

    A chunk read as it is stored lands straight in its destination when the destination's
    memory is contiguous in the chunk's element order (a given slice of a result, a new
    array); otherwise in a buffer of its own, copied into the destination after. Stored
    pieces always land in a buffer of their own: they decode into the destination.
    """
    if out is not None and (tuple(out.shape) != tuple(spec.shape) or np.dtype(out.dtype) != spec.out_dtype):
        raise ValueError(f"the destination of chunk {spec.index} is {tuple(out.shape)} {out.dtype}, "
                         f"but the chunk is {tuple(spec.shape)} {spec.out_dtype}")
    if spec.is_assembled:
        return out, None, False
    if out is None:
        out = fresh
    flat = byte_view(out, spec.order) if out is not None else None
    if flat is not None and flat.nbytes == spec.nbytes:
        return out, flat, True
    return out, None, False


def _buffers(sizes: list[int], dev: Device) -> list[Any]:
    """A buffer of each size for the stored bytes of a submission's chunks: views of one
    allocation, each starting on a 4 KiB boundary. One allocation, not one per chunk: each
    costs a pool lookup and an event on the consumer's stream (``Device.alloc``), tens of
    microseconds for the thousands of small chunks of a Zarr."""
    from gpulazy.read.decode import count

    if not sizes:
        return []
    starts = list(itertools.accumulate((-(-n // _ALIGN) * _ALIGN for n in sizes[:-1]), initial=0))
    whole = dev.empty(starts[-1] + sizes[-1])
    count("staging", len(sizes))
    return [whole[a:a + n] for a, n in zip(starts, sizes)]


_ALIGN = 4096


def byte_view(view: Any, order: str) -> Any:
    """A 1-D uint8 view of ``view``'s memory in the chunk's element order, or ``None``."""
    if order == "F":
        if not view.flags.f_contiguous:
            return None
        view = view.T
    elif not view.flags.c_contiguous:
        return None
    return view.reshape(-1).view(np.uint8)
