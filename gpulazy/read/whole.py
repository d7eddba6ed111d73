"""Every chunk of an array read into one preallocated result (the fast whole-array path).

The result is allocated once; each chunk is a destination of the engine: cache hits are
copied in from the cache, misses read straight into their slice (decoded into it, for
chunks of stored pieces). Submissions of about ``GROUP`` bytes go out in order from this
thread (for chunks that decode, each may double the last, up to ``DECODE_GROUP``: one decode
call per submission wants many pieces). Stored bytes waiting to decode are held to ``STAGED``
bytes, or an eighth of a GPU's free memory (at most 4 GiB) when that is more (a submission is
finished before the next one would pass that), and up to ``SETTLERS`` submissions decode at
once on threads of their own, as the bytes held allow (``STREAM_SETTLERS`` for Deflate,
``settlers``), so reading the next groups overlaps decoding these."""

from __future__ import annotations

import bisect
import concurrent.futures
import functools
import itertools
import math
import threading
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from gpulazy.device import get_device
from gpulazy.spec import ChunkSpec

__all__ = ["read_whole", "read_region", "read_picks", "read_all", "read_in_order", "part_of",
           "groups_by_bytes", "iter_groups", "held_bytes", "inflight_room", "settle_later", "settle_pool",
           "settle_slots", "settlers", "stream_calls",
           "GROUP", "STAGED", "SETTLERS", "STREAM_SETTLERS", "STREAM_PIECES"]

GROUP = 256 << 20
STAGED = 512 << 20
DECODE_GROUP = 1 << 30
SETTLERS = 3
#: Submissions of Deflate chunks (``codecs.stream_bound``) that decode at once: each nvCOMP call
#: takes about one stream's time whatever its size, so four calls of 256 pieces of 4 MiB run in
#: the time of one (an H100 decoded 2 MiB gzip-1 pieces at 5.7 GB/s in one call of 512, 12.6 in
#: four at once); the threads wait on the GPU, holding no GIL.
STREAM_SETTLERS = 4
#: Deflate pieces that keep nvCOMP busy: one call decoded 2 MiB gzip-1 pieces at 10.0 GB/s with
#: 1,024 of them, 12.9 with 2,048 (H100).
STREAM_PIECES = 2048


def inflight_room(dev: Any) -> int:
    """Bytes of reads a pipeline may hold in flight on ``dev`` beyond its own minimum: an eighth
    of the device's free memory, at most 4 GiB. On an H100, 4 GiB of a streamed reduction's reads
    in flight instead of 1 GiB took ``astype("f8").sum()`` from 0.77 to 0.90 and ``mean()`` from
    0.85 to 0.94 of the whole read. 0 on ``"cpu"``, where the host's page cache, not a device,
    is what reads fill."""
    if not dev.is_gpu:
        return 0
    try:
        free, _ = dev.memory()
    except Exception:
        return 0
    return min(free // 8, 4 << 30)


def read_whole(specs: dict, source: Any, chunks: tuple, dtype: Any, order: str = "C", *,
               hooks: Any = None, name: str = "") -> Any:
    """Every chunk of ``specs`` read into one array with dask ``chunks`` on ``source``'s device.

    ``hooks`` (a ``gpulazy._hooks.FastPathHooks``) hears of each chunk task ``(name, *index)``
    as its read is submitted and as it lands. Hits are copied from ``source``'s cache, each
    file of theirs stat'ed (a file changed since indexing raises); misses are not inserted in
    it, and the engine checks their files after their reads. The first error is raised once
    every submitted read has settled.
    """
    from gpulazy.memory import retry_on_oom

    dev = get_device(source.device)
    backend = source.backend_instance()
    cache = source.cache_instance()
    shape = tuple(sum(c) for c in chunks)
    edges = [list(itertools.accumulate(c, initial=0)) for c in chunks]
    with dev.activate():
        out = retry_on_oom(lambda: dev.alloc(shape, dtype, order), device=dev,
                           nbytes=math.prod(shape) * np.dtype(dtype).itemsize, what=f"allocating a {shape} result")
    todo: list[tuple[ChunkSpec, Any]] = []
    with dev.activate():
        for spec in specs.values():
            # (the Ellipsis keeps a 0-d result a view, not a scalar copy)
            view = out[tuple(slice(edges[a][i], edges[a][i + 1]) for a, i in enumerate(spec.index)) + (Ellipsis,)]
            if hooks:
                hooks.pretask((name, *spec.index))
            if view.size == 0 or (cache is not None and _hit(cache, spec, view)):
                if hooks:
                    hooks.posttask((name, *spec.index), view)
                continue
            todo.append((spec, view))
        _read_in_groups(todo, backend, source.verify, hooks, name)  # each read checked as it settles
    return out


def read_region(specs: dict, source: Any, chunks: tuple, dtype: Any, region: tuple[tuple[int, int], ...],
                order: str = "C") -> Any:
    """The box ``region`` (``(start, stop)`` per axis) of the array ``specs`` describes, read into one array.

    A chunk wholly inside the box reads straight into its slice of the result; so do the
    bytes of a chunk the box cuts along axis 0 only, when they are stored as is (a slab of
    planes is one span of its bytes), and the first planes of zstd chunks the box ends inside
    (``ChunkSpec.head``: they decode from a head of the stored bytes). Another chunk the box
    cuts reads into an array of its own (its planes up to the box's end only, where heads
    apply; from the cache when it is there), whose overlap is copied in as it lands.
    Chunks outside the box are not read.
    """
    out = _result(tuple(b - a for a, b in region), dtype, order, get_device(source.device))
    _read_boxes(specs, source, chunks, [(region, out)])
    return out


def read_picks(specs: dict, source: Any, chunks: tuple, dtype: Any, region: tuple[tuple[int, int], ...], axis: int,
               positions: Sequence[int], order: str = "C") -> Any:
    """The planes ``positions`` along ``axis`` (in their order, repeats too) of the box ``region`` gives on
    the other axes (its entry at ``axis`` is not used), stacked along ``axis`` into one array: what
    ``vol[[3, 4, 5, 9]]`` is. Each run of consecutive positions is a box (here two: ``[3:6]`` and
    ``[9:10]``), read straight into its part of the result as ``read_region`` reads a box, every box
    in the same pass; a chunk two boxes cut is read once."""
    shape = tuple(len(positions) if a == axis else hi - lo for a, (lo, hi) in enumerate(region))
    out = _result(shape, dtype, order, get_device(source.device))
    boxes = []
    for at, first, n in _runs(positions):
        box = region[:axis] + ((first, first + n),) + region[axis + 1:]
        boxes.append((box, out[(slice(None),) * axis + (slice(at, at + n),)]))
    _read_boxes(specs, source, chunks, boxes)
    return out


def _runs(positions: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(where in the result, first position, how many)`` for each run of consecutive positions."""
    at = 0
    for _, run in itertools.groupby(enumerate(positions), lambda item: item[1] - item[0]):
        run = list(run)
        yield at, run[0][1], len(run)
        at += len(run)


def _result(shape: tuple[int, ...], dtype: Any, order: str, dev: Any) -> Any:
    from gpulazy.memory import retry_on_oom

    with dev.activate():
        return retry_on_oom(lambda: dev.alloc(shape, dtype, order), device=dev,
                            nbytes=math.prod(shape) * np.dtype(dtype).itemsize, what=f"allocating a {shape} result")


def _meeting(specs: dict, edges: list, region: tuple[tuple[int, int], ...]) -> list[ChunkSpec]:
    """The chunks (``specs``: block index -> chunk) the box ``region`` meets, in block order."""
    blocks = [range(bisect.bisect_right(e, lo) - 1, bisect.bisect_left(e, hi)) for e, (lo, hi) in zip(edges, region)]
    return [specs[k] for k in itertools.product(*blocks) if k in specs]


def _read_boxes(specs: dict, source: Any, chunks: tuple, boxes: list[tuple[tuple, Any]]) -> None:
    """Read each box ``(region, where it goes)`` of the array ``specs`` describes, all in one pass (see
    ``read_region``)."""
    from gpulazy.integrity import check_unchanged

    dev = get_device(source.device)
    cache = source.cache_instance()
    edges = [list(itertools.accumulate(c, initial=0)) for c in chunks]
    met = [(_meeting(specs, edges, region), region, target) for region, target in boxes]
    # Keys name content, not place: two chunks of the same bytes (pieces never written, read as the
    # fill value: an HDF5 chunk table's missing chunks share one key) are one key at two places; so
    # is a chunk two boxes cut.
    cuts: dict[str, list[tuple]] = {}  # key of a chunk (or of the part read of it) -> [(slices in it, place)]

    def copy_hit(spec: ChunkSpec, entry: Any, src: tuple, place: tuple) -> None:
        check_unchanged(spec)  # a cached chunk of a file changed since indexing is never served
        _copy_part(place, entry, src, dev)

    with dev.activate():
        cut = []  # (chunk, slices in it, (its box's array, slices in that)) of each cut chunk the cache lacks

        def wholes():
            """The chunks wholly inside a box, each with its place (those the cache holds copied there
            instead); the chunks a box cuts go to ``cut``."""
            for needed, region, target in met:
                for spec in needed:
                    src, dst, whole = _overlap(spec.index, edges, region)
                    if whole:
                        view = target[dst + (Ellipsis,)]
                        if not (cache is not None and _hit(cache, spec, view)):
                            yield spec, view
                    elif cache is None or cache.visit([spec], lambda spec, entry, src=src, place=(target, dst):
                                                      copy_hit(spec, entry, src, place)):
                        cut.append((spec, src, (target, dst)))  # else cached: its part copied straight out of it

        def parts():
            """What is read of each chunk a box cuts: the part it needs, or all of it. A chunk several
            boxes cut (planes of a list) whose bytes are not stored as is gives one part for all of
            them, read once: the planes up to the last one's from a head, or the whole chunk, where a
            part each would decode its first planes again for every box."""
            by_chunk: dict[str, list[tuple]] = {}
            for entry in cut:
                by_chunk.setdefault(entry[0].key, []).append(entry)
            for entries in by_chunk.values():
                spec = entries[0][0]
                shared = None
                if len(entries) > 1 and not source.verify and not spec.stored_as_is:
                    lo, hi = min(src[0].start for _, src, _ in entries), max(src[0].stop for _, src, _ in entries)
                    rows, part = part_of(spec, slice(lo, hi))
                    shared = (part or spec, rows.start - lo)
                for spec, src, (target, dst) in entries:
                    if shared is not None:
                        part, shift = shared
                        src = (slice(src[0].start + shift, src[0].stop + shift),) + src[1:]
                    else:
                        rows, part = part_of(spec, src[0]) if not source.verify else (src[0], None)
                        src = (rows,) + src[1:]
                        if part is not None and part.shape == tuple(s.stop - s.start for s in src):
                            yield part, target[dst + (Ellipsis,)]  # its bytes alone, or its planes from a head
                            continue
                        part = part or spec
                    seen = part.key in cuts
                    cuts.setdefault(part.key, []).append((src, (target, dst)))
                    if not seen:
                        yield part, None  # one read of the bytes, copied to every place they belong

        def landed(spec: ChunkSpec, arr: Any) -> None:
            for src, place in cuts.get(spec.key, ()):
                _copy_part(place, arr, src, dev)

        like = [spec for needed, _, _ in met for spec in needed]
        if any(spec.codec is not None for spec in like):
            # The chunks a box cuts first: each is copied in part as it lands (``landed``, on this
            # thread), while the later submissions decode, not after the last. Heads last, in a
            # submission of their own (``read_in_order``) that takes no settle slot: they decode on the
            # host's cores once the other reads have landed, beside nvCOMP's calls. First, they decoded
            # while KvikIO's threads held every core (35 ms for 64 heads on an H200, the submission after
            # them 24 ms instead of 1.4) and kept a slot the last nvCOMP call waited for: [1:129] of a
            # 2 GiB zstd Zarr took 60-62 ms that way, 53-57 with heads last (RESULTS.md, nineteenth session).
            todo = list(wholes())
            todo.extend(parts())
            todo.sort(key=lambda item: 2 if item[0].is_head else 0 if item[1] is None else 1)
            reads: Iterable[tuple[ChunkSpec, Any]] = todo
            sizing: list[ChunkSpec] | None = None
        else:
            # The whole chunks go first, and what is read of the cut ones is worked out as the
            # submissions reach them, while the first reads are in flight: a slice of a Zarr volume of
            # 16 stored chunks a block spent most of its time before its first read on eight blocks'
            # parts. The whole ones' places too are made as the submissions take them: a list of 64
            # planes made a view of the result for each before its first read.
            reads, sizing = itertools.chain(wholes(), parts()), like
        # Each read's files are stat'ed again as it settles (``Reads``): written to meanwhile, it raises.
        # (A head whose frame cannot serve it is read whole by the engine: ``Reads._whole_instead``.)
        read_in_order(reads, source.backend_instance(), source.verify, landed, max(STAGED, inflight_room(dev)),
                      like=sizing)


def _hit(cache: Any, spec: ChunkSpec, out: Any) -> bool:
    """Whether ``spec`` was cached and copied into ``out``; raises if a file of it changed since
    indexing. Reads are checked by the engine after they land, so only hits are stat'ed here: a
    stat of every file before the first read was submitted held a read of thousands of chunk
    files up by one stat per file."""
    from gpulazy.integrity import check_unchanged

    if not cache.read_into(spec, out):
        return False
    check_unchanged(spec)  # ``out`` is not handed out if this raises
    return True


def part_of(spec: ChunkSpec, rows: Any) -> tuple[Any, ChunkSpec | None]:
    """``(rows in it, part)``: what to read of ``spec`` for its planes ``rows`` along axis 0 (a slice
    ``start:stop:step`` with a positive step, or an array of planes, in their order), as a chunk of its
    own, and which of its planes ``rows`` are: those planes alone when its bytes are stored as is
    (``ChunkSpec.planes``: a plane of a Zarr chunk of 64 is 1/64 of its bytes, whatever is cut along the
    later axes; every fourth plane a quarter), else the planes up to the last one decoded from a head of
    a zstd chunk's stored bytes (``ChunkSpec.head``); ``(rows, None)``: the whole chunk. For a box's
    read (``read_region``) and the streamed map of a box or a list (``array._cuts_as_map``); not with
    ``verify`` (checksums cover whole chunks)."""
    if isinstance(rows, slice):
        start, stop, step = rows.indices(spec.shape[0])
        if start == 0 and stop == spec.shape[0] and step == 1:
            return rows, None
        picked: Sequence[int] = range(start, stop, step)
    else:
        picked = [int(r) for r in rows]
    part = spec.planes(picked)
    if part is not None:
        return slice(0, part.shape[0]), part
    head = spec.head(min(picked), max(picked) + 1) if len(picked) else None
    if head is None:
        return rows, None
    first, part = head
    if isinstance(rows, slice):
        return slice(start - first, stop - first, step), part
    return np.asarray(picked) - first, part


def _overlap(index: tuple, edges: list, region: tuple) -> tuple[tuple, tuple, bool]:
    """``(slices in the chunk, slices in the result, whether the chunk lies wholly inside)``."""
    src, dst, whole = [], [], True
    for a, (i, (lo, hi)) in enumerate(zip(index, region)):
        c0, c1 = edges[a][i], edges[a][i + 1]
        s0, s1 = max(c0, lo), min(c1, hi)
        src.append(slice(s0 - c0, s1 - c0))
        dst.append(slice(s0 - lo, s1 - lo))
        whole = whole and s0 == c0 and s1 == c1
    return tuple(src), tuple(dst), whole


def _copy_part(place: tuple, chunk: Any, src: tuple, dev: Any) -> None:
    """Copy ``chunk[src]`` to ``place``, ``(an array, slices in it)``."""
    from gpulazy.device import own_stream
    from gpulazy.read.decode import count

    out, dst = place
    with own_stream(dev):  # waited for: the chunk goes back to the pool only after the copy
        out[dst + (Ellipsis,)] = chunk[src + (Ellipsis,)]
    count("copies")


def _read_in_groups(todo: list[tuple[ChunkSpec, Any]], backend: Any, verify: bool, hooks: Any, name: str) -> None:
    """Read ``todo``'s chunks into their views (hooks told as each lands)."""
    def landed(spec: ChunkSpec, view: Any) -> None:
        if hooks:
            hooks.posttask((name, *spec.index), view)

    read_in_order(todo, backend, verify, landed, max(STAGED, inflight_room(backend.device)))


def read_in_order(todo: Iterable[tuple[ChunkSpec, Any]], backend: Any, verify: bool, landed: Any, limit: int, *,
                  like: list[ChunkSpec] | None = None, each: bool = False) -> None:
    """Read ``todo``'s chunks in order, a submission per ``GROUP`` bytes (growing for chunks that
    decode, see ``_decode_group``), calling ``landed(spec, arr)``
    for each as its submission is finished (in order); ``each=True``: for each chunk read as
    stored as soon as its own read is in (the rest of its submission may still be reading),
    so what ``landed`` does with one chunk overlaps the reads of the next.

    A destination of ``None`` is allocated by the engine. Bytes held by chunks not yet handed
    to ``landed`` (stored bytes waiting to decode, arrays the engine allocated) stay within
    ``limit``: the oldest submission is finished before the next would pass it, so reading the
    next submissions overlaps what ``landed`` does with this one. The first error is raised
    once every submitted read has settled; ``landed`` is not called after it (an error ``landed``
    raises is one of them).

    ``todo`` may be an iterator whose chunks are made as submissions need them (each group once
    the next chunk is seen not to fit in it); then ``like``, the chunks they are made of, sizes
    the submissions and the threads that settle them, and holds no head (``ChunkSpec.head``).
    """
    from gpulazy.read.engine import start_retrying

    sizing = [s for s, _ in todo] if like is None else like
    grow_to = _decode_group(sizing, limit)
    # A submission of heads (``ChunkSpec.head``) holds heads alone: they decode on the host's
    # cores, and beside them whole zstd chunks went to those cores too (of nvCOMP's share).
    apart = (lambda item: item[0].is_head) if any(spec.is_head for spec in sizing) else None
    groups = iter_groups(todo, lambda item: item[0].nbytes, grow_to=grow_to, apart=apart)
    several = len(sizing) > 1 and (apart is not None or sum(s.nbytes for s in sizing) > GROUP)
    threaded = several and grow_to is not None
    workers = settlers(sizing, limit, _largest_group(sizing, grow_to) if threaded else GROUP)
    settler = _Settler(threaded=threaded, workers=workers)
    inflight: deque = deque()  # (reads, its wait, group, bytes held) submitted and not yet handed out
    held = 0
    errors: list[BaseException] = []

    # Chunks that decode are finished by the settle threads, a submission at a time.
    one_by_one = each and not threaded

    def hand_out() -> None:
        nonlocal held
        reads, settled, group, nbytes = inflight.popleft()
        if not one_by_one:
            settled()
        for k, (spec, _) in enumerate(group):
            if errors and one_by_one:
                break  # (settled below)
            try:
                arr = reads.chunk(k)
                if not errors:
                    landed(spec, arr)
            except BaseException as e:  # kept; raised once every read has settled
                errors.append(e)
        if one_by_one:
            settled()  # what an error left reading
        held -= nbytes

    try:
        for group in groups:
            if errors:
                break
            nbytes = sum(held_bytes(spec, dest) for spec, dest in group)
            while inflight and held + nbytes > limit:
                hand_out()
            try:
                reads = start_retrying([s for s, _ in group], backend, [d for _, d in group], verify=verify,
                                       staged=False)
            except BaseException as e:
                errors.append(e)
                break
            # Heads decode on the host's cores and hold no nvCOMP scratch: they take no settle slot.
            inflight.append((reads, settler.add(reads, slot=not group[0][0].is_head), group, nbytes))
            held += nbytes
        while inflight:
            hand_out()
    finally:
        settler.close()  # every submitted read settles, on an error or Ctrl-C too
    if errors:
        raise errors[0]


class _Settler:
    """Settles submissions (waits for their reads, decodes and places them) on the threads of
    ``settle_pool`` when there are several that decode, at most ``workers`` at a time, so the
    thread that submits the next reads is not held up meanwhile and consecutive submissions
    decode at once; chunks read as stored have nothing to decode and settle inline. Chunks are
    still handed out (``landed``) on the caller's thread, in order.

    Why several (``SETTLERS``; Deflate may take ``STREAM_SETTLERS``, see ``settlers``): a settle
    thread waits on each submission's nvCOMP call, so the next submission's framing, walks and
    placement go on meanwhile. On an H100 a 4 GiB zstd Zarr (8 MiB chunks) read at 23.7 and 19.3
    GB/s with one settle thread and 24.4 and 20.7 with two (two calls, 1 GiB submissions); four
    threads with 512 MiB submissions gave 18–19, and LZ4 fell from 10.8 to 9.4: the settle threads'
    Python then holds up the thread submitting reads (its 512 ``pread`` calls took 240 ms instead
    of 55). Three, as the bytes held allow, for a read of a few submissions: an 8 MiB zstd frame
    takes nvCOMP 18 ms however many decode beside it (H200), so a submission that waits for a slot
    adds its whole call to the read ([0:128] of a 2 GiB Zarr, three submissions: 53 ms with two at
    once, 47 with three); larger reads make submissions too large for a third to fit.
    The threads outlive a read: each keeps its CUDA stream (``gpulazy_stream``) for the next.
    """

    def __init__(self, threaded: bool, workers: int = 1):
        self._slots = threading.BoundedSemaphore(max(1, workers)) if threaded else None
        self._waits: list[Callable[[], None]] = []

    def add(self, reads: Any, slot: bool = True) -> Callable[[], Any]:
        """Queue ``reads``; returns what to call to wait until it is settled (with no thread, that
        call settles it). ``slot=False``: it settles at once, outside the bound of ``workers``."""
        if self._slots is None:
            return reads.settle
        wait = settle_later(reads, self._slots if slot else None)
        self._waits.append(wait)
        return wait

    def close(self) -> None:
        """Wait until every submission added has settled."""
        for wait in self._waits:
            wait()


def settle_later(reads: Any, slots: threading.Semaphore | None = None) -> Callable[[], None]:
    """Settle ``reads`` (wait for its reads, decode and place its chunks) on a ``settle_pool``
    thread, holding one of ``slots`` meanwhile; returns what to call to wait for it. Its errors
    stay with its chunks (``Reads.chunk`` raises them)."""

    def settle() -> None:
        if slots is not None:
            slots.acquire()
        try:
            reads.settle()
        except BaseException:  # noqa: S110 (its chunks raise it again to the caller: ``Reads.chunk``)
            pass
        finally:
            if slots is not None:
                slots.release()

    future = settle_pool().submit(settle)

    def wait() -> None:
        concurrent.futures.wait([future])

    return wait


@functools.cache
def settle_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that settle submissions (as many as ``settlers`` allows any reader), kept for the process."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=max(SETTLERS, STREAM_SETTLERS),
                                                 thread_name_prefix="gpulazy-settle")


def settlers(specs: list[ChunkSpec], limit: int, group: int) -> int:
    """How many submissions of about ``group`` stored bytes of ``specs`` may decode at once within
    ``limit`` bytes held: as many as fit twice (nvCOMP's scratch for a zstd submission is about
    three times its decoded bytes), up to ``SETTLERS``; for Deflate, more where its pieces are
    too few per submission to keep nvCOMP busy (``stream_calls``), as many as fit."""
    fit = max(1, min(SETTLERS, limit // (2 * max(1, group))))
    return max(fit, min(stream_calls(specs, group), limit // max(1, group)))


def stream_calls(specs: list[ChunkSpec], group: int) -> int:
    """Submissions of about ``group`` stored bytes of ``specs`` to decode at once so that nvCOMP has
    about ``STREAM_PIECES`` Deflate pieces in hand, at most ``STREAM_SETTLERS``; 0 when no chunk of
    ``specs`` is Deflate (``codecs.stream_bound``). A 4 GiB HDF5 file of 4 MiB gzip chunks, 1 GiB
    submissions: four at once. A TIFF of 512 KiB deflate tiles: one holds enough."""
    from gpulazy.codecs import stream_bound

    bound = [s for s in specs if stream_bound(s)]
    if not bound:
        return 0
    pieces = sum(max(1, len(s.tiles)) for s in bound)
    per_piece = max(1, sum(s.nbytes for s in bound) // pieces)
    return max(1, min(STREAM_SETTLERS, -(-STREAM_PIECES * per_piece // max(1, group))))


@functools.cache
def settle_slots(n: int) -> threading.BoundedSemaphore:
    """A process-wide bound of ``n`` submissions settling at once (for readers that settle one
    submission per call, ``gpulazy.read.reduce``)."""
    return threading.BoundedSemaphore(n)


def _largest_group(specs: list[ChunkSpec], grow_to: int | None) -> int:
    """Stored bytes of the largest submission ``read_in_order`` makes of ``specs`` that takes a settle
    slot (heads take none). A read of half an array makes smaller submissions than ``grow_to``: more
    of them settle at once within the same bytes."""
    sizes = [sum(s.nbytes for s in group) for group in iter_groups(specs, lambda s: s.nbytes, grow_to=grow_to,
                                                                   apart=lambda s: s.is_head) if not group[0].is_head]
    return max(sizes, default=GROUP)


def _decode_group(specs: list[ChunkSpec], limit: int) -> int | None:
    """How large submissions of chunks of stored pieces may grow: a quarter of ``limit``, at most
    ``DECODE_GROUP``; None when no chunk is decoded. nvCOMP decodes one stream per thread block, so
    a call needs hundreds of pieces to fill a GPU: in 256 MiB groups, 8 MiB zstd pieces went 32 to
    a call and a 4 GiB Zarr decoded at 9.9 GB/s against nvCOMP's 35 on 256 pieces."""
    if not any(spec.is_assembled for spec in specs):
        return None
    return max(GROUP, min(limit // 4, DECODE_GROUP))


def groups_by_bytes(items: Iterable, nbytes: Any, size: int | None = None, grow_to: int | None = None,
                    bound: tuple[Any, int] | None = None, apart: Any = None) -> list[list]:
    """Consecutive ``items`` in groups of about ``size`` bytes (default ``GROUP``; ``nbytes(item)``
    each), none empty. With ``grow_to``, each group may be twice its predecessor, up to
    ``grow_to`` bytes: the first lands soon, the later ones are large. With ``bound`` (``(measure,
    most)``), a group also holds at most ``most`` of ``measure(item)`` (one item always). With
    ``apart``, consecutive items for which it differs are in different groups."""
    return list(iter_groups(items, nbytes, size, grow_to, bound, apart))


def iter_groups(items: Iterable, nbytes: Any, size: int | None = None, grow_to: int | None = None,
                bound: tuple[Any, int] | None = None, apart: Any = None) -> Iterator[list]:
    """``groups_by_bytes``, each group handed on as soon as the item after it is seen."""
    size = GROUP if size is None else size
    measure, most = bound if bound is not None else (lambda item: 0, math.inf)
    kind = apart or (lambda item: None)
    group: list = []
    held = other = 0
    last = None
    for item in items:
        n, m, k = nbytes(item), measure(item), kind(item)
        if group and (held + n > size or other + m > most or k != last):
            yield group
            group = []
            held = other = 0
            size = max(size, min(2 * size, grow_to or 0))
        last = k
        group.append(item)
        held += n
        other += m
    if group:
        yield group


def held_bytes(spec: ChunkSpec, dest: Any = None) -> int:
    """Bytes a chunk holds until it is handed on: its stored bytes when they land in a buffer of
    their own, and its array when the engine allocates it (0 for a read landing in place)."""
    from gpulazy.read.engine import byte_view

    if dest is None:
        return spec.out_nbytes + (spec.nbytes if spec.is_assembled else 0)
    if spec.is_assembled:
        return spec.nbytes
    flat = byte_view(dest, spec.order)
    return 0 if flat is not None and flat.nbytes == spec.nbytes else spec.nbytes


def read_all(specs: list[ChunkSpec], backend: Any, verify: bool = False) -> list[Any]:
    """Whole files (``read_file(s)``): every read in flight before any is awaited."""
    from gpulazy.read.engine import read

    if verify:
        from gpulazy.checksums import require_checksums

        require_checksums(specs)
    with backend.device.activate():
        return read(specs, backend, verify=verify, staged=False)
