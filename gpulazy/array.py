"""``from_files`` and friends: chunk specs to a Dask array with CuPy (or NumPy) meta.

Every chunk task is ``load_chunk(spec, source)`` (``gpulazy._tasks``, re-exported here):
``spec`` says where the bytes are, ``source`` (a small picklable value) says which device,
backend and cache to use in whatever process runs the task. When a compute culls the graph,
the reads it needs are grouped into ``read_batch`` tasks (``gpulazy._readlayer``).

Streams: a chunk a task returns is complete on every CUDA stream and thread. gpulazy's
own device work runs on this thread's non-blocking ``gpulazy_stream`` and the task waits
for that stream (never the device, never the legacy default stream) before returning;
your current stream is left as it is. See docs/streams.md.
"""

from __future__ import annotations

import bisect
import functools
import gc
import itertools
import math
import numbers
import operator
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Sequence

import numpy as np

from gpulazy import config
from gpulazy.device import Device, get_device
from gpulazy.errors import DeviceError, LayoutError
from gpulazy.spec import ByteRange, ChunkSpec, file_identity

__all__ = ["from_files", "multiscale", "read_file", "read_files", "GpulazyArray", "ChunkSource", "load_chunk",
           "read_batch", "pick", "read_whole"]

# The task functions live below the graph code (``gpulazy._tasks``): the read layer and the
# prefetch planner recognise read tasks by them without importing this module.
from gpulazy._tasks import ChunkSource, load_chunk, pick, read_batch  # noqa: E402
from gpulazy.read.pairs import members  # noqa: E402


# -- from_files ---------------------------------------------------------------------------

def from_files(paths: Any, *, shape: Any = None, dtype: Any = None, offset: int = 0, order: str | None = None,
               chunks: Any = None, device: Any = None, backend: str | None = None, cache: Any = None,
               layout: Any = None, verify: bool = False, **layout_opts: Any) -> Any:
    """A lazy Dask array over files whose chunks read straight into device memory.

    Nothing is read here: the files are indexed (sizes and headers checked) and a
    graph of one read task per chunk is built. Computing reads each chunk's bytes with
    the I/O backend into a NumPy (``device="cpu"``) or CuPy (``"cuda:N"``) array.

    Parameters
    ----------
    paths
        A file, a glob (``"scan/*.raw"``), a directory (its regular, non-hidden files) or
        a sequence of files. Globs and directories are sorted naturally (``z2`` before
        ``z10``). A directory, glob or sequence stacks its files along a new axis 0, even
        when it holds one file; a single path does not (``stack=False``/``True`` overrides).
    shape
        Raw files: the shape of ONE file (default: 1-D from the file size). ``.npy``
        files: optional, checked against the header.
    dtype
        Raw files: required, byte order honoured (``">u2"``); chunks always come back
        in native byte order. ``.npy``: optional, checked against the header.
    offset
        Raw files: bytes of header to skip at the start of every file.
    order
        ``"C"`` (default for raw files) or ``"F"`` element order in the files;
        ``.npy`` files use their header's order. A multi-file Fortran-order stack has
        one file per chunk along axis 0.
    chunks
        Any spelling ``dask.array`` takes: an int, ``-1``, ``"auto"``, a byte size
        (``"16MiB"``: contiguous slabs up to that size), a tuple with one entry per axis
        (ints, ``-1``, ``None``, ``"auto"``, block lengths), a dict ``{axis: ...}``. Default:
        contiguous slabs of whole planes along axis 0 of about ``config chunk_size``
        (128 MiB), several small files per chunk for a stack.
    device
        ``"cpu"``, ``"cuda:N"`` or ``None`` (``config`` device, else a GPU when usable).
    backend
        I/O backend name (``"kvikio"``, ``"posix"``, ...) or ``None``/``"auto"``.
    cache
        ``None``: the default device cache; ``False``: no cache; a ``DeviceCache`` (or
        its name): that cache.
    layout
        Force a layout (``"raw"``, ``"npy"`` or a registered name); default: guessed
        from the first file's magic bytes, raw when ``dtype`` is given.
    verify
        Check every chunk's stored bytes, on every read path, against the block hashes
        of a manifest written by ``gpulazy index --checksum PATH`` (XXH3-128), and
        against Zarr's ``crc32c`` codec where chunks carry it (which alone needs no
        manifest but cannot tell a chunk from another valid one); the blocks holding
        the layout's metadata are checked here. A mismatch raises ``ChunkReadError``.
        Verified reads bypass the cache (``gpulazy.checksums``).
    **layout_opts
        Options of the chosen layout (e.g. ``dataset="/entry/data"`` for HDF5,
        ``missing="error"`` for Zarr: a chunk file that does not exist raises rather than
        reading as the fill value); an option the layout does not know raises
        ``TypeError`` naming it.

    Returns
    -------
    GpulazyArray
        A ``dask.array.Array`` with NumPy or CuPy ``meta``. Its graph name is
        deterministic: the same files (each one's ``FileIdentity``: path, size, mtime,
        inode, ctime) give the same name; a file rewritten or replaced gives another.

    Raises
    ------
    NoFilesError
        Nothing matched ``paths``.
    LayoutError
        A file's size or header does not match ``shape``/``dtype``/``offset`` (the
        message names the file, the expected and the actual bytes); or the array would
        be indexed into more than config ``max_chunks`` pieces (dask chunks, stored
        chunks or byte runs: the message names the count and a chunking that fits),
        checked before any per-piece object is made.

    Examples
    --------
    >>> import gpulazy, numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> for i in range(3):
    ...     np.full((2, 4), i, dtype=">u2").tofile(os.path.join(d, f"z{i}.raw"))
    >>> vol = gpulazy.from_files(os.path.join(d, "z*.raw"), shape=(2, 4), dtype=">u2",
    ...                          device="cpu", cache=False)
    >>> vol.shape, vol.dtype
    ((3, 2, 4), dtype('uint16'))
    >>> vol.sum(axis=(1, 2)).compute().tolist()
    [0, 8, 16]
    """
    from gpulazy import layouts

    dev = get_device(device)
    backend = _check_backend(backend)
    cache_ref = _cache_name(cache, dev)
    with _gc_paused():  # ~3 objects per chunk, none cyclic: collections only cost time here
        idx = layouts.index(paths, layout=layout, shape=shape, dtype=dtype, offset=offset or None, order=order,
                            chunks=chunks, **layout_opts)
        if verify:
            from gpulazy.checksums import require_checksums
            from gpulazy.integrity import check_absent_unlisted

            require_checksums(idx.specs.values())
            check_absent_unlisted(idx.specs.values())  # a chunk file the manifest lists is not the fill value
        return _from_index(idx, dev, backend, cache_ref, verify)


def multiscale(paths: Any, *, chunks: Any = None, device: Any = None, backend: str | None = None,
               cache: Any = None, layout: Any = None, **layout_opts: Any) -> list[Any]:
    """Every resolution level of a pyramid (OME-Zarr, OME-TIFF) as lazy arrays, full resolution first.

    The form napari's multiscale image layers take. Data without a stored pyramid gives
    one level. Each array's ``attrs`` holds what the format says (``axes``, ``scale``,
    ``translation``, ``units``); arguments are those of ``from_files``.
    """
    from gpulazy import layouts

    dev = get_device(device)
    backend = _check_backend(backend)
    cache_ref = _cache_name(cache, dev)
    with _gc_paused():
        levels = layouts.levels(paths, layout=layout, chunks=chunks, **layout_opts)
        return [_from_index(idx, dev, backend, cache_ref) for idx in levels]


def _from_index(idx: Any, dev: Device, backend: str | None, cache_ref: Any, verify: bool = False) -> Any:
    cache_name = getattr(cache_ref, "name", cache_ref)  # a cache object and its name: one graph name
    source = ChunkSource(dev.name, backend, cache_ref, bool(verify))
    from dask.base import tokenize

    name = "from_files-" + tokenize(idx.token(), dev.name, backend, cache_name, *(["verify"] if verify else []))
    graph = _graph(name, idx.specs, source)
    arr = _array_class()(graph, name, idx.chunks, meta=dev.meta(idx.ndim, idx.dtype))
    arr._gl_attach(idx, source)
    return arr


@contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _graph(name: str, specs: dict, source: ChunkSource) -> Any:
    from dask.highlevelgraph import HighLevelGraph

    from gpulazy._readlayer import ReadLayer, ReadTask

    # Built directly, like dask's graph_from_arraylike: one data-producing task per block.
    layer = {}
    for idx, spec in specs.items():
        key = (name, *idx)
        layer[key] = ReadTask(key, load_chunk, spec, source, _data_producer=True)

    return HighLevelGraph({name: ReadLayer(layer)}, {name: set()})




def _check_backend(backend: str | None) -> str | None:
    if backend in (None, "", "auto"):
        return None
    from gpulazy.io import backend_class

    backend_class(backend)  # an unknown name fails now, listing the valid ones
    return backend


def _cache_name(cache: Any, device: Device) -> Any:
    """``ChunkSource.cache`` for the ``cache`` argument: None, False, a name or a ``CacheRef``."""
    if cache is None or cache is False:
        return cache
    if cache is True:
        return None
    if isinstance(cache, str):
        return cache
    name = getattr(cache, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"cache must be None (the default cache), False (none), a DeviceCache or its name; "
                        f"got {cache!r}")
    cdev = getattr(cache, "device", None)
    cdev_name = getattr(cdev, "name", cdev)
    if cdev_name is not None and str(cdev_name) != device.name:
        raise DeviceError(f"cache {name!r} holds arrays on {cdev_name!r} but the array reads onto "
                          f"{device.name!r}; pass a cache created with device={device.name!r}")
    return cache.ref


@functools.cache
def _array_class() -> type:
    # dask.array imports CuPy when it is installed (dask/array/chunk_types.py), so the
    # subclass is made on first use: ``import gpulazy`` stays numpy + dask core.
    import dask.array as da

    class GpulazyArray(da.Array):
        """The array ``from_files`` returns: a ``dask.array.Array`` with a fast whole-array ``compute``.

        ``compute()`` of the whole array on a local scheduler (no distributed client, no
        options other than ``scheduler="threads"``/``"sync"`` and ``callbacks``)
        allocates the result once on the device and reads every chunk straight into its
        slice, all reads in flight together: peak device memory is about the result's
        size. Active dask callbacks (progress bars, your own) see every chunk task start
        and finish, as on dask's scheduler (``gpulazy.prefetch`` has nothing to do there). Otherwise, and for everything derived from it (slices, reductions), dask
        computes as usual. ``compute_path`` tells which way the last ``compute()`` went
        (``"fast"`` or ``"dask"``). ``persist()`` computes by the same path and holds the result as
        dask's blocks, views of one array.
        """

        compute_path: str | None = None

        @property
        def chunk_index(self) -> Any:
            """The layout's ``Index``: ``specs`` (block index -> ``ChunkSpec``), ``attrs``, ``paths``.

            ``None`` once the array no longer is the files as they are (changed in place).
            """
            return getattr(self, "_gl_index", None) if getattr(self, "_gl_name", None) == self.name else None

        @property
        def attrs(self) -> dict:
            """What the format says about the array (``axes``, ``scale``, ...); see ``Index.attrs``."""
            idx = getattr(self, "_gl_index", None)
            return dict(idx.attrs) if idx is not None else {}

        @property
        def chunk_source(self) -> ChunkSource:
            """Where this array's chunk tasks read through (device, backend, cache)."""
            return self._gl_source

        def _gl_attach(self, idx: Any, source: ChunkSource) -> None:
            self._gl_index = idx
            self._gl_specs = idx.specs
            self._gl_source = source
            self._gl_name = self.name
            self._gl_order = "F" if idx.order == "F" and not idx.stacked else "C"

        def __reduce__(self):
            if getattr(self, "_gl_name", None) != self.name:  # no longer the files as they are
                return super().__reduce__()
            return (_rebuild, (self.dask, self.name, self.chunks, self._meta, self._gl_index, self._gl_source,
                               self._gl_order))

        def __getitem__(self, index: Any) -> Any:
            """A slice on chunk boundaries stays a gpulazy array over the same chunks; a box off
            them, or a plane (``vol[5]``, ``vol[:, 0]``: integers among step-1 slices), keeps a
            ``compute()`` that reads only the box; so does a list of planes (``_pick``); any other
            index is dask's."""
            within = _in_base(self, index)
            if within is not None:  # a box of a box: the box of the files it is (``vol[100:200][5]``)
                return self._gl_box_of[0][within]
            found = _box(self, index)
            region, dropped = found if found is not None else (None, ())
            blocks = _aligned_blocks(self, region) if region is not None and not dropped else None
            if blocks is not None:
                return _block_slice(self, blocks)
            picked = _picked(self, index) if region is None else None
            if picked is not None:
                return _pick(self, *picked)
            out = super().__getitem__(index)
            if out is not self and region is None and config.get("streamed_maps"):
                strided = _strided(self, index)
                # (dask's blocks: one a chunk picked from, unless it keeps an empty one: then dask's own)
                if strided is not None and out.chunks == tuple(
                        tuple(n for _, _, n in _along(a, b, k, c))
                        for axis, ((a, b), k, c) in enumerate(zip(strided[0], strided[1], self.chunks))
                        if axis not in strided[2]):
                    view = _array_class()(out.dask, out.name, out.chunks, meta=out._meta)
                    view._gl_box_of = (self, *strided)  # a streamed map of the chunks it picks from
                    return view
                if strided is not None:  # (dask's slicing kept an empty block, which its own operations mishandle)
                    return _strided_view(self, *strided)
            if out is self or region is None or out.shape != _kept_shape(region, dropped):
                return out  # (the whole array: dask hands back the array itself)
            box = _array_class()(out.dask, out.name, out.chunks, meta=out._meta)
            # Its compute() reads the box alone, at the read rate; what is made of it streams (``_map_of``).
            box._gl_box_of = (self, region, (1,) * self.ndim, dropped)
            return box

        def compute(self, **kwargs: Any) -> Any:
            """The whole array on its device; see the class docstring for the fast path."""
            out = self._gl_compute(kwargs)
            if out is not _NOT_FAST:
                return out
            self.compute_path = "dask"
            return super().compute(**kwargs)

        def persist(self, **kwargs: Any) -> Any:
            """``dask.array.Array.persist``: where ``compute()`` takes a fast path, the array is computed that
            way (at the read rate, not dask's per-task pace) and its blocks are views of the result, in
            ``self.chunks``, under ``self``'s keys (one allocation, what dask's blocks would hold
            together). A cluster, other options or no fast path: dask's own."""
            out = self._gl_compute(kwargs) if _local_compute(kwargs) else _NOT_FAST
            if out is _NOT_FAST:
                self.compute_path = "dask"
                return super().persist(**kwargs)
            return _held(self, out)

        def _gl_compute(self, kwargs: dict) -> Any:
            """The result by the fast path ``compute(**kwargs)`` takes (``compute_path`` set), or ``_NOT_FAST``."""
            box = getattr(self, "_gl_box_of", None)
            if (box is not None and all(k == 1 for k in box[2]) and box[0]._fast_path_ok(kwargs)
                    and not _active_callbacks(kwargs)):
                self.compute_path = "fast"
                base, region, _, dropped = box
                from gpulazy.read.whole import read_region

                out = read_region(base._gl_specs, base._gl_source, base.chunks, base.dtype, region, base._gl_order)
                return out.reshape(_kept_shape(region, dropped))  # (a plane: the axes its integers index dropped)
            pick = getattr(self, "_gl_pick_of", None)
            if pick is not None and pick[0]._fast_path_ok(kwargs) and not _active_callbacks(kwargs):
                self.compute_path = "fast"
                base, axis, positions, region, dropped = pick
                from gpulazy.read.whole import read_picks

                out = read_picks(base._gl_specs, base._gl_source, base.chunks, base.dtype, region, axis, positions,
                                 base._gl_order)
                return out.reshape(self.shape)  # (the axes its integers index dropped)
            chain = getattr(self, "_gl_stream_of", None)
            if chain is not None and _local_compute(kwargs) and not _active_callbacks(kwargs):
                self.compute_path = "fast"
                from gpulazy.read.reduce import run_stream

                return run_stream(chain, threaded=_threaded(kwargs))
            mapped = _map_of(self)
            if mapped is not None and _local_compute(kwargs):
                self.compute_path = "fast"
                return self._map_with_hooks(mapped, kwargs)
            if self._fast_path_ok(kwargs):
                self.compute_path = "fast"
                return self._read_whole_with_hooks(kwargs.get("callbacks"))
            return _NOT_FAST

        def _read_whole_with_hooks(self, callbacks: Any) -> Any:
            # Active callbacks (a progress bar, a user's own) are driven from the fast
            # path rather than turning it off (that made a whole read ~3x slower).
            from gpulazy._hooks import FastPathHooks, active_callbacks

            cbs = active_callbacks(callbacks)
            hooks = FastPathHooks(cbs, dict(self.__dask_graph__())) if cbs else None
            if hooks is None:
                return read_whole(self._gl_specs, self._gl_source, self.chunks, self.dtype, self._gl_order)
            hooks.start()
            try:
                out = read_whole(self._gl_specs, self._gl_source, self.chunks, self.dtype, self._gl_order,
                                 hooks=hooks, name=self.name)
            except BaseException:
                hooks.finish(True)
                raise
            hooks.finish(False)
            return out

        def _map_with_hooks(self, mapped: tuple, kwargs: dict) -> Any:
            # As for the whole read: active callbacks are told of each chunk's read and map tasks by
            # the streamed map (through dask's tasks a map took 1.8 x as long: RESULTS, s25).
            from gpulazy._hooks import ChunkHooks, FastPathHooks, active_callbacks
            from gpulazy.read.mapped import run_map

            name, specs, source, chunks, func, given, read_names = mapped
            cbs = active_callbacks(kwargs.get("callbacks"))
            if not cbs:
                return run_map(specs, source, chunks, func, given, self.dtype, threaded=_threaded(kwargs))
            hooks = FastPathHooks(cbs, dict(self.__dask_graph__()))
            hooks.start()
            try:
                out = run_map(specs, source, chunks, func, given, self.dtype, threaded=_threaded(kwargs),
                              hooks=ChunkHooks(hooks, read_names))
            except BaseException:
                hooks.finish(True)
                raise
            hooks.finish(False)
            return out

        def map_blocks(self, func: Any, *args: Any, **kwargs: Any) -> Any:
            """``dask.array.Array.map_blocks``; its ``compute()`` calls ``func`` on each chunk as its read
            lands (``gpulazy.read.mapped``) when the map is one call per chunk with nothing else to know."""
            out = super().map_blocks(func, *args, **kwargs)
            given = {k: v for k, v in kwargs.items() if k not in _MAP_OPTIONS}
            if _files_of(self) is None or not _streams_map(self, func, args, kwargs, given, out):
                return out
            return self._gl_as_map(out, func, given)

        def _gl_as_map(self, out: Any, func: Any, given: dict) -> Any:
            """``out`` (dask's array of ``func(block, **given)`` for each block of ``self``) as a gpulazy
            array whose ``compute()`` streams (``_gl_map_of``); ``self`` is the files or a streamed map."""
            specs, source, before = _files_of(self)
            if before is not None:  # a map of a map: one call a chunk, the functions in turn
                func, given = _Then(before, (func, given)), {}
            mapped = _array_class()(out.dask, out.name, out.chunks, meta=out._meta)
            mapped._gl_map_of = (out.name, specs, source, out.chunks, func, given, _read_names(self))
            return mapped

        # -- elementwise operations with scalars and arrays in memory stream as maps -------------

        def _gl_elementwise(self, out: Any, op: Any, args: tuple, kwargs: dict) -> Any:
            """``out``, dask's ``op(*args, **kwargs)`` a block at a time, streamed when it is ``op`` of this
            array's blocks, scalars, arrays in memory that broadcast to a part of it (``vol * 2``,
            ``np.sqrt(vol)``, ``(vol - dark) / gain`` with ``dark`` a plane) and other gpulazy arrays whose
            chunks stream beside this one's (``a - b``, ``np.where(a > 5, a, b)``, ``_streams_with``): values,
            dtype and name are dask's own, each block's ``op`` called with what dask's task for it gets (an
            array's part of that block)."""
            if (out is NotImplemented or kwargs or not config.get("streamed_maps") or _files_of(self) is None
                    or getattr(out, "numblocks", None) != self.numblocks or out.shape != self.shape):
                return _sharing(out)
            others = list({id(a): a for a in args
                           if not (a is self or _scalar(a) or _in_memory(a, self.shape))}.values())
            if others and not _streams_with(self, others):
                return _sharing(out)
            side = {id(a): _Side(k) for k, a in enumerate(others, 1)}
            marked = tuple(_BLOCK if a is self else side[id(a)] if id(a) in side else a if _scalar(a) else _Part(a)
                           for a in args)
            func = _Elementwise(op, marked, self.chunks)
            return self._gl_as_group(out, others, func) if others else self._gl_as_map(out, func, {})

        def _gl_as_group(self, out: Any, others: list, func: Any) -> Any:
            """``out``, dask's array of ``func`` of this array's and ``others``' blocks (``_streams_with``), as
            a streamed map whose blocks are tuples of chunks read in one pass (``gpulazy.read.pairs``): a
            chunk of each, or of each array an operand is made of (``(a - b) + c``: three)."""
            specs, source, first = _files_of(self)
            operands = [(specs, first)] + [(files[0], files[2]) for files in map(_files_of, others)]
            # Others' chunks as objects of their own (same bytes, same keys): a block tells its chunks apart
            # by identity; a file's chunk the block has already is that object, read once, as dask's tasks
            # share the one read (``vol - vol.map_blocks(f)``, ``(a - b) / (a + b)``). Each operand's own map
            # first (``vol * 2 - other``, ``(a - b) + c``).
            units = {i: functools.reduce(lambda mine, files: _joined(mine, files[0][i], i), operands[1:], unit)
                     for i, unit in specs.items()}
            counts = [len(_places(next(iter(files.values())))) for files, _ in operands]
            maps = [mapping for _, mapping in operands]
            plain = all(m is None for m in maps) and all(n == 1 for n in counts)
            mapped = _array_class()(out.dask, out.name, out.chunks, meta=out._meta)
            func = func if plain else _Then((_Sides(maps, counts), {}), (func, {}))
            names = sum(map(_read_names, others), _read_names(self))  # (a name a place: ``ChunkHooks``)
            mapped._gl_map_of = (out.name, units, source, out.chunks, func, {}, names)
            return mapped

        @property
        def _elemwise(self) -> Any:
            # What dask's ufunc wrappers call (``da.sqrt(vol)``: ``vol._elemwise(np.sqrt, vol)``).
            from dask.array.core import elemwise

            def streamed(op: Any, *args: Any, **kwargs: Any) -> Any:
                return self._gl_elementwise(elemwise(op, *args, **kwargs), op, args, kwargs)

            return streamed

        def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
            # ``np.max(vol, axis=0)`` is ``vol.max(axis=0)``, streamed; dask's ``__array_function__`` would
            # call ``da.max``, which builds dask's tasks (0.6 x the read rate for a MIP on an H100).
            method = _numpy_reduction(self, func, args, kwargs)
            if method is not None:
                return method()
            out = super().__array_function__(func, types, args, kwargs)
            if func in _NUMPY_ELEMENTWISE and not kwargs:  # ``np.where(vol > 5, vol, 0)``, ``np.clip``: maps
                return self._gl_elementwise(out, func, args, {})
            if func is np.histogram:  # (dask's first: its errors, its edges)
                counts = _streamed_histogram(self, out, args, kwargs)
                return out if counts is None else (counts, out[1])
            return out

        def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
            out = super().__array_ufunc__(ufunc, method, *inputs, **kwargs)
            if method != "__call__" or ufunc.nout != 1 or ufunc.signature is not None or ufunc is np.matmul:
                return out
            return self._gl_elementwise(out, ufunc, inputs, kwargs)

        # -- reductions that run as the reads land (gpulazy.read.reduce) ----------------------

        def astype(self, dtype: Any, **kwargs: Any) -> Any:
            """``dask.array.Array.astype``; its ``compute()`` and a reduction of it still run as the reads land."""
            if kwargs or _files_of(self) is None or np.dtype(dtype) == self.dtype:
                return super().astype(dtype, **kwargs)
            cast = _cast(self, np.dtype(dtype))
            if config.get("streamed_maps"):
                astype = _Elementwise(operator.methodcaller("astype", cast.dtype), (_BLOCK,), self.chunks)
                cast = self._gl_as_map(cast, astype, {})
            cast._gl_cast_of = (self, cast.dtype)  # a reduction casts as it folds (``gpulazy.read.reduce``)
            return cast

        def max(self, axis=None, keepdims=False, split_every=None, out=None):
            return self._reduce("max", axis, keepdims, out=out, split_every=split_every)

        def min(self, axis=None, keepdims=False, split_every=None, out=None):
            return self._reduce("min", axis, keepdims, out=out, split_every=split_every)

        def sum(self, axis=None, dtype=None, keepdims=False, split_every=None, out=None):
            return self._reduce("sum", axis, keepdims, dtype=dtype, out=out, split_every=split_every)

        def mean(self, axis=None, dtype=None, keepdims=False, split_every=None, out=None):
            return self._reduce("mean", axis, keepdims, dtype=dtype, out=out, split_every=split_every)

        def var(self, axis=None, dtype=None, keepdims=False, ddof=0, split_every=None, out=None):
            return self._reduce("var", axis, keepdims, dtype=dtype, out=out, split_every=split_every, ddof=ddof)

        def std(self, axis=None, dtype=None, keepdims=False, ddof=0, split_every=None, out=None):
            return self._reduce("std", axis, keepdims, dtype=dtype, out=out, split_every=split_every, ddof=ddof)

        def argmax(self, axis=None, *, keepdims=False, split_every=None, out=None):
            return self._reduce("argmax", axis, keepdims, out=out, split_every=split_every)

        def argmin(self, axis=None, *, keepdims=False, split_every=None, out=None):
            return self._reduce("argmin", axis, keepdims, out=out, split_every=split_every)

        def any(self, axis=None, keepdims=False, split_every=None, out=None):
            return self._reduce("any", axis, keepdims, out=out, split_every=split_every)

        def all(self, axis=None, keepdims=False, split_every=None, out=None):
            return self._reduce("all", axis, keepdims, out=out, split_every=split_every)

        def _reduce(self, op: str, axis: Any, keepdims: bool, **kwargs: Any) -> Any:
            """``op`` streamed: a chain of steps reading and folding the chunks (``gpulazy.read.reduce``),
            when it can; otherwise dask's own reduction."""
            dtype = kwargs.get("dtype")
            if (dtype is not None and config.get("fused_reductions") and _files_of(self) is not None
                    and _accumulates_in(op, np.dtype(dtype))):
                # ``vol.sum(dtype="f8")`` is ``vol.astype("f8").sum()``: the same values, streamed.
                return self.astype(dtype)._reduce(op, axis, keepdims, **{**kwargs, "dtype": None})
            base, cast = getattr(self, "_gl_cast_of", (self, None))
            extra = {k: v for k, v in kwargs.items() if k != "ddof"}
            files = _files_of(base)
            if (not config.get("fused_reductions") or any(v is not None for v in extra.values())
                    or files is None or 0 in self.shape or _distributed_client_active()
                    or op in ("argmax", "argmin") and (isinstance(axis, tuple) or self.dtype.kind == "c")):
                return getattr(super(), op)(axis=axis, keepdims=keepdims, **kwargs)
            return _streamed(base, files, op, axis, keepdims, int(kwargs.get("ddof", 0)), cast)

        @staticmethod
        def __dask_optimize__(dsk: Any, keys: Any, **kwargs: Any) -> Any:
            """dask's array optimisation (as configured), after the chains of reductions that read the same
            chunks are made one (``gpulazy.read.reduce.share_reads``): dask groups the collections of a
            ``dask.compute(...)`` by this function, so the chains of ``dask.compute(vol.min(), vol.max())``
            meet here."""
            from gpulazy.read.reduce import share_reads

            optimize = da.Array.__dask_optimize__  # (config ``array_optimize``, as dask's own arrays)
            return optimize(share_reads(dsk) if hasattr(dsk, "layers") else dsk, keys, **kwargs)

        def _fast_path_ok(self, kwargs: dict) -> bool:
            if getattr(self, "_gl_name", None) != self.name:  # changed in place (vol[...] = x)
                return False
            return _local_compute(kwargs)

    for name, (op, reflected) in _OPERATORS.items():
        setattr(GpulazyArray, name, _streamed_operator(name, op, reflected))
    GpulazyArray.__module__ = __name__
    GpulazyArray.__qualname__ = "GpulazyArray"
    return GpulazyArray


def _cast(arr: Any, dtype: np.dtype) -> Any:
    """``arr.astype(dtype)`` as dask builds it (``chunk.astype`` on each block), named and typed here:
    dask's own ``astype`` (``map_blocks``) tokenised its function and probed it for its meta and
    keywords, 0.38 ms of host time before a streamed ``astype(...).sum()`` could submit a read (a
    2-core CPU host; 0.07 ms this way)."""
    import dask.array as da
    from dask.array import chunk
    from dask.base import tokenize

    ind = tuple(range(arr.ndim))
    out = da.blockwise(chunk.astype, ind, arr, ind, dtype=dtype, astype_dtype=dtype, concatenate=None,
                       name="astype-" + tokenize(arr.name, dtype.str), meta=arr._meta.astype(dtype))
    return _array_class()(out.dask, out.name, out.chunks, meta=out._meta)


def _files_of(arr: Any) -> tuple[dict, ChunkSource, tuple | None] | None:
    """``(specs, source, mapping)`` when each block of ``arr`` is a chunk of files as they are
    (``mapping`` ``None``) or a streamed map's function of one (``mapping`` ``(func, kwargs)``,
    ``GpulazyArray.map_blocks``); ``None`` for anything else (also an array changed in place)."""
    if getattr(arr, "_gl_name", None) == arr.name:
        return arr._gl_specs, arr._gl_source, None
    mapped = _map_of(arr)
    return None if mapped is None else (mapped[1], mapped[2], (mapped[4], mapped[5]))


def _read_names(arr: Any) -> tuple[str, ...]:
    """The names of the read tasks of ``arr``'s graph that a streamed map of it reads (a progress bar
    hears of each, ``ChunkHooks``): its own for an array of files, its map's for a streamed map."""
    if getattr(arr, "_gl_name", None) == arr.name:
        return (arr.name,)
    return _map_of(arr)[6]


def _map_of(arr: Any) -> tuple | None:
    """``arr``'s streamed map (``_gl_map_of``) when it is one, not changed in place; a box's or a list of
    planes' is made on first use (``_box_as_map``, ``_pick_as_map``: their own ``compute()`` needs none)."""
    mapped = getattr(arr, "_gl_map_of", None)
    if mapped is None and getattr(arr, "_gl_box_of", None) is not None:
        mapped = arr._gl_map_of = _box_as_map(arr)
    elif mapped is None and getattr(arr, "_gl_pick_of", None) is not None:
        mapped = arr._gl_map_of = _pick_as_map(arr)
    return mapped if mapped is not None and mapped[0] == arr.name else None


def _box_as_map(box: Any) -> tuple | None:
    """A box (``vol[3:40, 100:900]``), a plane (``vol[5]``) or a strided box (``vol[::4, ::4]``,
    ``vol[::-1]``) as a streamed map (``_gl_map_of``): its block ``i`` is its part of the ``i``-th chunk it
    meets (``_Cut``; a plane's integers index the chunk, dropping its axes; a negative step takes the
    chunks from the last and flips each), so its reductions, maps and elementwise operations (and a
    strided box's ``compute()``) stream as a map's do. ``None`` where dask's blocks of it are not one a
    chunk met."""
    base, region, steps, dropped = box._gl_box_of
    return _cuts_as_map(box, base, *_strided_met(base, region, steps, dropped), dropped)


def _strided_met(arr: Any, region: tuple, steps: tuple[int, ...], dropped: tuple[int, ...]) -> tuple[list, tuple | None]:
    """``(met, flip)`` of a strided box: along each axis the chunks it takes from (``_along``), and the flip
    each block gets where a step is negative (``None``: none is)."""
    met = [_along(lo, hi, step, chunks) for (lo, hi), step, chunks in zip(region, steps, arr.chunks)]
    kept = [a for a in range(arr.ndim) if a not in dropped]
    flip = tuple(slice(None, None, -1 if steps[a] < 0 else 1) for a in kept) if min(steps) < 0 else None
    return met, flip


def _pick_as_map(view: Any) -> tuple | None:
    """A list of planes (``_pick``) as a streamed map, as a box is (``_box_as_map``): its block ``i`` is the
    part of a chunk the ``i``-th stretch of the list in one chunk takes (``_stretches``), so
    ``vol[[3, 9, 27]].max(axis=0)`` streams and reads those planes alone where the chunks are stored as is."""
    base, axis, positions, region, dropped = view._gl_pick_of
    return _cuts_as_map(view, base, _pick_met(base, axis, positions, region), None, dropped, once=True,
                        planes_only=axis == 0)


def _cuts_as_map(view: Any, base: Any, met: list, flip: tuple | None, dropped: tuple[int, ...],
                 once: bool = False, planes_only: bool = False) -> tuple | None:
    """``view`` of ``base`` (its files' array) as a streamed map whose blocks are, along each axis, the
    chunks ``met`` lists (``(chunk, its slice, elements)``) and their parts; ``None`` where those are not
    ``view``'s blocks, or, with ``once``, where two blocks would read a chunk, or one part of it, each
    (``planes_only``: blocks whose parts are their own planes alone may share them)."""
    from gpulazy.read.whole import part_of

    if tuple(tuple(n for _, _, n in axis) for a, axis in enumerate(met) if a not in dropped) != view.chunks:
        return None
    specs, cuts = {}, {}
    source = base._gl_source
    cache = source.cache_instance()
    read: set[str] = set()  # (``once``) what the blocks read
    for picks in itertools.product(*(list(enumerate(axis)) for axis in met)):
        new = tuple(j for a, (j, _) in enumerate(picks) if a not in dropped)
        spec = base._gl_specs[tuple(i for _, (i, _, _) in picks)]
        cut = tuple(c for _, (_, c, _) in picks)
        # Cut along axis 0, a chunk stored as is reads the planes the view needs alone, and a zstd chunk
        # the view ends inside decodes its planes up to the view's end from a head of its stored bytes
        # (as ``read_region``; not with ``verify``: checksums cover whole chunks), unless the cache holds
        # the chunk now (the map is made as the computation is built); same bytes, same key.
        part = None
        if not source.verify and not (cache is not None and (spec in cache or cache.holds(spec))):
            rows, part = part_of(spec, cut[0])
        if once:
            # A list that comes back to a chunk it left would read it again, whole or from a head (a
            # compressed chunk), or the same part of it (a list along a later axis): dask's graph, which
            # reads each chunk once, is kept instead. (Planes of a chunk stored as is: read again.)
            as_is = (part if part is not None else spec).stored_as_is
            key = part.key if as_is and part is not None else spec.key
            if not (as_is and planes_only) and key in read:
                return None
            read.add(key)
        if part is not None:
            spec, cut = part, (rows,) + cut[1:]
        specs[new] = spec.at(new)
        cuts[new] = _block_cut(cut, dropped)
    return view.name, specs, source, view.chunks, _Cut(cuts, flip), {}, (view.name,)


def _along(lo: int, hi: int, step: int, chunks: tuple[int, ...]) -> list[tuple[int, slice, int]]:
    """``_met`` in the order a step of that sign picks the chunks (a negative one: from the last)."""
    met = _met(lo, hi, abs(step), chunks)
    return met[::-1] if step < 0 else met


def _met(lo: int, hi: int, step: int, chunks: tuple[int, ...]) -> list[tuple[int, slice, int]]:
    """Along one axis, ``(chunk, its slice, elements)`` for each chunk that ``lo:hi:step`` selects from."""
    out, start = [], 0
    for i, n in enumerate(chunks):
        end = start + n
        first = lo if start <= lo else lo + -(-(start - lo) // step) * step
        last_bound = min(hi, end)
        if first < last_bound:
            count = (last_bound - 1 - first) // step + 1
            out.append((i, slice(first - start, first - start + (count - 1) * step + 1, step), count))
        start = end
    return out


class _Cut:
    """A view's part of each chunk it meets (``_cuts_as_map``): block ``index``'s cut of its chunk
    (``_block_cut``), then ``flip``'s (a negative step's: its axes reversed, a view)."""

    takes_index = True
    __name__ = "cut"

    def __init__(self, cuts: dict[tuple[int, ...], tuple[tuple, tuple | None]], flip: tuple[slice, ...] | None = None):
        self.cuts, self.flip = cuts, flip

    def __call__(self, chunk: Any, index: tuple[int, ...]) -> Any:
        part = _take(chunk, *self.cuts[index])
        return part if self.flip is None else part[self.flip]


def _block_cut(cut: Sequence[Any], dropped: tuple[int, ...]) -> tuple[tuple, tuple | None]:
    """``(index, then)`` that ``_take`` cuts a block from its chunk with: ``cut`` (a slice of the chunk per
    axis, or an array of its planes along one) with the axes ``dropped`` indexed by their one element.
    With an array, those are taken as slices and dropped after (``then``): NumPy would move the array's
    axis first where an integer and the array are apart (``vol[0, :, [1, 2]]``), dask keeps it in place."""
    if not any(isinstance(c, np.ndarray) for c in cut) or not dropped:
        return tuple(c.start if a in dropped else c for a, c in enumerate(cut)), None
    return tuple(cut), tuple(0 if a in dropped else slice(None) for a in range(len(cut)))


def _take(chunk: Any, index: tuple, then: tuple | None = None) -> Any:
    """``chunk[index]``, then ``[then]`` (``_block_cut``); an array of planes goes where the chunk lives."""
    if not isinstance(chunk, np.ndarray) and any(isinstance(i, np.ndarray) for i in index):
        import cupy

        index = tuple(cupy.asarray(i) if isinstance(i, np.ndarray) else i for i in index)
    part = chunk[index]
    return part if then is None else part[then]


class _BlockMark:
    """Where an elementwise operation's block goes among its arguments (``_Elementwise``): this array's,
    or the other array's of a pair (``a - b``)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"

    def __reduce__(self):
        return self.name  # one mark in every process


_BLOCK = _BlockMark("_BLOCK")


class _Side:
    """The ``k``-th other gpulazy array among an elementwise operation's operands: each block gets that
    array's block (the block is then the tuple of every operand's, this array's first)."""

    def __init__(self, k: int):
        self.k = k


class _Part:
    """An array in memory among an elementwise operation's operands: each block gets the part of it
    that broadcasts to that block, as dask's task for the block does."""

    def __init__(self, array: Any):
        self.array = array

    def of(self, edges: list, index: tuple[int, ...]) -> Any:
        lead = len(edges) - self.array.ndim  # (it broadcasts from the trailing axes)
        return self.array[tuple(slice(None) if n == 1 else slice(edges[lead + j][index[lead + j]],
                                                                 edges[lead + j][index[lead + j] + 1])
                                for j, n in enumerate(self.array.shape))]


class _Elementwise:
    """``op(*args)`` with each ``_BLOCK`` the block, each ``_Side`` another array's block (the block is
    then the tuple of the operands' blocks) and each ``_Part`` its part of the block: what dask's
    elementwise task of the block calls. Called with the block's ``index`` (``takes_index``)."""

    takes_index = True

    def __init__(self, op: Any, args: tuple, chunks: tuple):
        self.op, self.args = op, args
        self.grouped = any(isinstance(a, _Side) for a in args)
        self.edges = [list(itertools.accumulate(c, initial=0)) for c in chunks]
        self.__name__ = getattr(op, "__name__", "elementwise")

    def __call__(self, block: Any, index: tuple[int, ...]) -> Any:
        blocks = block if self.grouped else (block,)
        return self.op(*(blocks[0] if a is _BLOCK else blocks[a.k] if isinstance(a, _Side) else
                         a.of(self.edges, index) if isinstance(a, _Part) else a for a in self.args))


def _streams_with(arr: Any, others: list) -> bool:
    """Whether ``others``' blocks can stream beside ``arr``'s in one pass (``a - b``, ``(a - b) + c``,
    ``np.where(a > 5, a, b)``): gpulazy arrays of files (or streamed maps of them, maybe themselves of
    several arrays) with ``arr``'s chunks, read through the same source (device, backend, cache,
    ``verify``), all of them together of at most ``_MOST_ARRAYS`` arrays' chunks."""
    if not all(isinstance(other, _array_class()) and other.chunks == arr.chunks for other in others):
        return False
    files = [_files_of(a) for a in (arr, *others)]
    if any(f is None or f[1] != files[0][1] for f in files):
        return False
    first = next(iter(files[0][0]), None)
    if first is None:
        return True
    # (chunks a block holds in flight: a file's chunk among several operands is one)
    block = functools.reduce(lambda mine, f: _joined(mine, f[0][first], first), files[1:], files[0][0][first])
    return len(members(block)) <= _MOST_ARRAYS


def _places(unit: Any) -> tuple:
    """A block's chunks in its operands' order, a chunk once for each place (``members``: once)."""
    return unit if isinstance(unit, tuple) else (unit,)


def _joined(mine: Any, theirs: Any, index: tuple[int, ...]) -> tuple:
    """The block of ``mine``'s chunks then ``theirs``' (block ``index``), each of theirs the chunk already in
    the block with its key where there is one (read once), else an object of its own."""
    have = {spec.key: spec for spec in _places(mine)}
    added = []
    for spec in _places(theirs):
        if spec.key not in have:
            have[spec.key] = spec.at(index)
        added.append(have[spec.key])
    return (*_places(mine), *added)


#: The most chunks a streamed block is read from (``a + b + c + ...``: one of each array, a file's chunk
#: among several operands once): a block in flight holds them all; dask's tasks read an operation of more.
_MOST_ARRAYS = 8


def _in_memory(value: Any, shape: tuple[int, ...]) -> bool:
    """An array in host or device memory (NumPy, CuPy) that broadcasts to ``shape`` without growing it."""
    cupy = type(value).__module__.startswith("cupy") and hasattr(value, "__cuda_array_interface__")
    if not (isinstance(value, np.ndarray) or cupy):
        return False
    return 0 < value.ndim <= len(shape) and all(
        n in (1, m) for n, m in zip(value.shape, shape[len(shape) - value.ndim:]))


def _scalar(value: Any) -> bool:
    """A value dask hands to every block's task as it is: a number or a 0-d NumPy array."""
    return isinstance(value, (bool, int, float, complex, np.generic)) or (
        isinstance(value, np.ndarray) and value.ndim == 0)


#: dask's operators of an array (name -> (the operation, whether ``self`` is its second operand)).
_BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
           "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow, "and": operator.and_,
           "or": operator.or_, "xor": operator.xor, "lshift": operator.lshift, "rshift": operator.rshift}
_OPERATORS: dict[str, tuple[Any, bool]] = {
    **{f"__{n}__": (op, False) for n, op in _BINARY.items()},
    **{f"__r{n}__": (op, True) for n, op in _BINARY.items()},
    **{f"__{n}__": (getattr(operator, n), False) for n in ("eq", "ne", "lt", "le", "gt", "ge")},
    **{f"__{n}__": (getattr(operator, n), False) for n in ("neg", "pos", "abs", "invert")},
}


#: NumPy's functions that are a gpulazy array's streamed reductions, and the method each is.
_NUMPY_REDUCTIONS = {"max": "max", "amax": "max", "min": "min", "amin": "min", "sum": "sum", "mean": "mean",
                     "var": "var", "std": "std", "argmax": "argmax", "argmin": "argmin", "any": "any", "all": "all"}
#: Their parameters the methods take (the others, ``out``, ``initial``, ``where``, ...: dask's).
_REDUCTION_PARAMETERS = {"axis", "dtype", "keepdims", "ddof"}

#: NumPy's functions (not ufuncs) that dask computes block by block, each block of the result from the
#: same block of every array argument: streamed maps as ufuncs are (``GpulazyArray._gl_elementwise``).
_NUMPY_ELEMENTWISE = (np.where, np.clip)


def _numpy_reduction(arr: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``arr``'s method for NumPy's ``func(*args, **kwargs)`` (``np.max(arr, axis=0)``: ``arr.max(axis=0)``)
    as a call with no argument, or ``None`` when ``func`` is not one of its reductions of ``arr``
    alone with parameters the method takes."""
    import inspect

    name = _NUMPY_REDUCTIONS.get(getattr(func, "__name__", ""))
    if name is None or getattr(np, func.__name__, None) is not func:
        return None
    try:
        given = inspect.signature(func).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None  # (dask's call raises as NumPy's would)
    if given.pop("a", None) is not arr:
        return None
    passed = {k: v for k, v in given.items() if v is not None and v is not np._NoValue}
    if not set(passed) <= _REDUCTION_PARAMETERS:
        return None
    if "keepdims" in passed:
        passed["keepdims"] = bool(passed["keepdims"])
    return functools.partial(getattr(arr, name), **passed)


def _accumulates_in(op: str, dtype: np.dtype) -> bool:
    """Whether NumPy's ``op`` of an array of ``dtype`` accumulates in ``dtype`` and returns it, so that
    ``op(x, dtype=dtype)`` is ``op(x.astype(dtype))`` (``float64``, ``int64``; not ``uint8``, whose sum
    NumPy accumulates in ``uint64``)."""
    try:
        return getattr(np, op)(np.zeros(2, dtype)).dtype == dtype
    except TypeError:
        return False


def _streamed_operator(name: str, op: Any, reflected: bool) -> Any:
    """``GpulazyArray.<name>``: dask's operator, streamed when its other operand is a scalar or an array in
    memory (``GpulazyArray._gl_elementwise``)."""
    import dask.array as da

    base = getattr(da.Array, name)
    if name in ("__neg__", "__pos__", "__abs__", "__invert__"):
        def unary(self: Any) -> Any:
            return self._gl_elementwise(base(self), op, (self,), {})
        unary.__name__ = name
        return unary

    def binary(self: Any, other: Any) -> Any:
        return self._gl_elementwise(base(self, other), op, (other, self) if reflected else (self, other), {})
    binary.__name__ = name
    return binary


class _Then:
    """A map's function after another's (``vol.map_blocks(f).map_blocks(g)``): ``g(f(chunk, **fkw), **gkw)``;
    each of gpulazy's own that ``takes_index`` gets the block's ``index``."""

    takes_index = True

    def __init__(self, first: tuple, then: tuple):
        self.first, self.then = first, then
        self.__name__ = f"{getattr(then[0], '__name__', 'func')}-of-{getattr(first[0], '__name__', 'func')}"

    def __call__(self, chunk: Any, index: tuple[int, ...]) -> Any:
        return _apply(self.then, _apply(self.first, chunk, index), index)


class _Sides:
    """Each operand's own streamed map of a block of several arrays' chunks (``vol * 2 - other``,
    ``(a - b) + c``): ``(f(first), g(second), ...)``, each operand its next ``counts[k]`` chunks of the
    block (one chunk, or the tuple of them: an operand that is itself an operation of arrays), one
    without a map (``None``) as it is."""

    takes_index = True

    def __init__(self, maps: list, counts: list[int]):
        self.maps, self.counts = maps, counts
        self.starts = list(itertools.accumulate(counts, initial=0))
        self.__name__ = "sides"

    def __call__(self, block: Any, index: tuple[int, ...]) -> tuple:
        chunks = [block[s] if n == 1 else block[s:s + n] for s, n in zip(self.starts, self.counts)]
        return tuple(chunk if mapping is None else _apply(mapping, chunk, index)
                     for mapping, chunk in zip(self.maps, chunks))


def _apply(mapping: tuple, chunk: Any, index: tuple[int, ...]) -> Any:
    """``f(chunk, **kwargs)`` of a map's ``(f, kwargs)``, given ``index`` too when it ``takes_index``."""
    f, kwargs = mapping
    return f(chunk, index=index, **kwargs) if getattr(f, "takes_index", False) else f(chunk, **kwargs)


def _streamed(base: Any, files: tuple, op: str, axis: Any, keepdims: bool, ddof: int, cast: Any) -> Any:
    """A dask array whose graph is one chain (start, a step per group of chunks, the result): ``op`` of
    ``base`` (cast to ``cast`` first) folded as its chunks are read (``files``: ``_files_of(base)``;
    a streamed map's function called on each first). A gpulazy array, for its ``compute()``
    without dask (``_gl_stream_of``) and for the chains of several reductions of the same chunks
    computed together to share their reads (``__dask_optimize__``)."""
    from dask.array.utils import validate_axis
    from dask.base import tokenize

    from gpulazy.read.reduce import result_dtype

    ndim = base.ndim
    if axis is None:
        axis = tuple(range(ndim))
    elif not isinstance(axis, tuple):
        axis = (axis,)
    axis = tuple(sorted({validate_axis(a, ndim) for a in axis}))
    shape = tuple(1 if a in axis else n for a, n in enumerate(base.shape)) if keepdims else tuple(
        n for a, n in enumerate(base.shape) if a not in axis)
    dtype = result_dtype(op, base.dtype, ndim, axis, cast)
    name = f"{op}-streamed-" + tokenize(base.name, op, axis, keepdims, ddof, None if cast is None else str(cast))
    key = (name,) + (0,) * len(shape)
    return _chain_array(name, base, files, (op, axis, ddof, cast), key, keepdims, tuple((n,) for n in shape), dtype)


def _chain_array(name: str, base: Any, files: tuple, op: tuple, key: tuple, keepdims: bool, chunks: tuple,
                 dtype: Any) -> Any:
    """A gpulazy array of one chunk, ``key``: the reduction ``op`` (``(op, axis, ddof, cast)``) of ``base``'s
    chunks (``files``: ``_files_of(base)``) as a chain (``gpulazy.read.reduce.Chain``)."""
    from gpulazy.read.reduce import Chain, chain_graph, groups_of

    specs, source, mapping = files
    chain = Chain(specs, groups_of(specs), source, base.chunks, base.dtype, mapping, [op], {key: (0, keepdims)})
    meta = get_device(source.device).meta(len(chunks), dtype)
    out = _array_class()(chain_graph(name, chain), name, chunks, meta=meta)
    # Its compute() on a local scheduler with no callback runs this chain without dask (``run_stream``);
    # dask.compute, callbacks (progress bars, the prefetcher) and clusters run the graph.
    out._gl_stream_of = chain
    return out


def _streamed_histogram(arr: Any, dasks: tuple, args: tuple, kwargs: dict) -> Any:
    """``np.histogram(arr, bins, range)``'s counts streamed: a chain that counts each chunk's values as its
    read lands (``np.histogram`` of the chunk with ``bins`` and ``range``, as dask's task for its block
    counts them) and adds them up; ``dasks``: dask's ``(counts, edges)``. ``None`` (dask's) for
    ``density``, ``weights`` or ``bins``/``range`` that are dask collections."""
    import inspect

    from dask.base import is_dask_collection, tokenize

    try:
        given = inspect.signature(np.histogram).bind(*args, **kwargs).arguments
    except TypeError:
        return None
    base, cast = getattr(arr, "_gl_cast_of", (arr, None))
    bins, limits = given.get("bins", 10), given.get("range")
    files = _files_of(base)
    if (given.get("a") is not arr or given.get("density") or given.get("weights") is not None or files is None
            or is_dask_collection(bins) or is_dask_collection(limits) or not config.get("fused_reductions")
            or 0 in arr.shape or _distributed_client_active()):
        return None
    bins = bins if np.ndim(bins) == 0 else np.asarray(bins)
    op = ("histogram", bins, None if limits is None else tuple(limits))
    name = "histogram-streamed-" + tokenize(base.name, bins, op[2], None if cast is None else str(cast))
    return _chain_array(name, base, files, (op, tuple(range(arr.ndim)), 0, cast), (name, 0), False,
                        dasks[0].chunks, dasks[0].dtype)


#: ``map_blocks`` keywords that are dask's, not the function's.
_MAP_OPTIONS = ("name", "token", "dtype", "chunks", "drop_axis", "new_axis", "enforce_ndim", "meta")


def _streams_map(arr: Any, func: Any, args: tuple, kwargs: dict, given: dict, out: Any) -> bool:
    """Whether ``arr.map_blocks(func, *args, **kwargs)`` (giving ``out``) of ``arr``, whose blocks are
    chunks of files or a streamed map of them (``_files_of``), is one call per block with nothing but
    the block and ``given`` keywords to pass: the calls ``gpulazy.read.mapped`` makes."""
    from dask.base import is_dask_collection
    from dask.utils import has_keyword

    # ``chunks=`` may give the blocks other lengths (a thumbnail, a statistic a chunk), not other
    # axes: block (i, j, k) of the map is still made of chunk (i, j, k) alone.
    return (bool(config.get("streamed_maps")) and not args
            and not kwargs.get("drop_axis") and not kwargs.get("new_axis")
            and not kwargs.get("enforce_ndim") and callable(func)
            and not any(has_keyword(func, k) for k in ("block_info", "block_id"))
            and not any(is_dask_collection(v) for v in given.values())
            and out.numblocks == arr.numblocks and all(all(c) for c in out.chunks))


def _threaded(kwargs: dict) -> bool:
    """Whether a local ``compute(**kwargs)`` runs on dask's threaded scheduler (its default for arrays)."""
    import dask

    scheduler = kwargs.get("scheduler") or dask.config.get("scheduler", None) or "threads"
    return scheduler.lower() in ("threads", "threading")


#: ``GpulazyArray._gl_compute``'s answer where no fast path applies.
_NOT_FAST = object()


def _held(arr: Any, out: Any) -> Any:
    """``arr`` persisted: a dask array under ``arr``'s name and chunks whose blocks are views of ``out``,
    ``arr`` computed (a block is what dask's task for it would give)."""
    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph

    out = out.reshape(arr.shape)  # (a 0-d result of a reduction: one block)
    edges = [list(itertools.accumulate(c, initial=0)) for c in arr.chunks]
    layer = {(arr.name, *index): out[tuple(slice(e[i], e[i + 1]) for e, i in zip(edges, index)) + (Ellipsis,)]
             for index in itertools.product(*(range(len(c)) for c in arr.chunks))}
    return da.Array(HighLevelGraph.from_collections(arr.name, layer, dependencies=()), arr.name, arr.chunks,
                    meta=arr._meta)


def _sharing(out: Any) -> Any:
    """``out`` (dask's array) as a gpulazy array with no fast path of its own when its graph holds streamed
    reductions (``vol.max() - vol.min()``): computed, its optimisation makes the chains that read the same
    chunks one (``GpulazyArray.__dask_optimize__``)."""
    import dask.array as da

    from gpulazy.read.reduce import holds_chains

    if type(out) is not da.Array or not holds_chains(out.dask):
        return out
    return _array_class()(out.dask, out.name, out.chunks, meta=out._meta)


def _local_compute(kwargs: dict) -> bool:
    """Whether a ``compute(**kwargs)`` runs on a local scheduler of this process, with no other option."""
    import dask

    if set(kwargs) - {"scheduler", "callbacks"}:
        return False
    scheduler = kwargs.get("scheduler")
    if scheduler is None:
        if dask.config.get("get", None) is not None:
            return False
        scheduler = dask.config.get("scheduler", None)
    if scheduler is None:
        return not _distributed_client_active()
    return isinstance(scheduler, str) and scheduler.lower() in _LOCAL_SCHEDULERS


def _active_callbacks(kwargs: dict) -> bool:
    from gpulazy._hooks import active_callbacks

    return bool(active_callbacks(kwargs.get("callbacks")))


def _box(arr: Any, index: Any) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]] | None:
    """``(region, dropped)`` when ``index`` is step-1 slices and integers selecting a non-empty box of
    more than one element: ``(start, stop)`` per axis, and the axes an integer indexes (dropped from
    the result); else ``None`` (also for an array changed in place; an index dask refuses is left to
    dask's own error; a single element is dask's, which gives a scalar)."""
    if getattr(arr, "_gl_name", None) != arr.name or getattr(arr, "_gl_index", None) is None:
        return None
    return _parse_box(index, arr.shape)


def _strided(arr: Any, index: Any) -> tuple[tuple, tuple[int, ...], tuple[int, ...]] | None:
    """``(region, steps, dropped)`` (``_parse_index``) when ``index`` is integers and slices, one of them
    of a step other than 1, selecting a non-empty part of ``arr``, the files as they are (``vol[::4,
    ::4]``, ``vol[5, ::2, ::2]``, ``vol[::-1]``); else ``None``."""
    if getattr(arr, "_gl_name", None) != arr.name or getattr(arr, "_gl_index", None) is None:
        return None
    found = _parse_index(index, arr.shape)
    if found is None or all(k == 1 for k in found[2]):
        return None
    region, dropped, steps = found
    return region, steps, dropped


def _strided_view(arr: Any, region: tuple, steps: tuple[int, ...], dropped: tuple[int, ...]) -> Any:
    """A strided box of ``arr`` (``_strided``'s ``(region, steps, dropped)``) with a graph of its own: a block
    for each chunk it takes from along each axis (``_along``), cut from that chunk's task (and flipped
    where its step is negative), and a streamed map of those chunks' parts (``_gl_box_of``). For where
    dask's slicing keeps an empty block (``vol[9:11:2]`` of chunks of 2 planes: blocks of 1 and 0 planes):
    dask's own operations over such blocks fail or give the wrong shape (dask 2026.8: ``max(axis=0)``
    raises in its concatenate, ``vol[5:9:2, 4:7:3, 0] * 2`` has shape ``(2, 2)`` for ``(2, 1)``)."""
    from dask.base import tokenize

    met, flip = _strided_met(arr, region, steps, dropped)
    view = _cut_view(arr, "strided-" + tokenize(arr.name, region, steps, dropped), met, flip, dropped)
    view._gl_box_of = (arr, region, steps, dropped)  # a streamed map of the chunks it takes from
    return view


def _cut_view(arr: Any, name: str, met: list, flip: tuple | None, dropped: tuple[int, ...]) -> Any:
    """A gpulazy array named ``name`` whose blocks are, along each axis, the chunks of ``arr`` that ``met``
    lists (``(chunk, its slice or planes, elements)``), each cut from that chunk's task (``_block_cut``,
    then ``flip``)."""
    from dask._task_spec import Task, TaskRef
    from dask.array.utils import meta_from_array
    from dask.highlevelgraph import HighLevelGraph

    layer = {}
    for pieces in itertools.product(*(list(enumerate(along)) for along in met)):
        key = (name, *(j for a, (j, _) in enumerate(pieces) if a not in dropped))
        index, then = _block_cut([piece[1] for _, piece in pieces], dropped)
        if flip is not None:  # (a step has no array of planes: nothing to drop after the cut)
            then = flip
        layer[key] = Task(key, _take, TaskRef((arr.name, *(piece[0] for _, piece in pieces))), index, then)
    chunks = tuple(tuple(n for _, _, n in along) for a, along in enumerate(met) if a not in dropped)
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[arr])
    return _array_class()(graph, name, chunks, meta=meta_from_array(arr._meta, ndim=len(chunks)))


def _picked(arr: Any, index: Any) -> tuple[int, tuple[int, ...], tuple, tuple[int, ...]] | None:
    """``(axis, positions, region, dropped)`` when ``index`` picks planes of ``arr`` (the files as they
    are) by a list of integers or a mask along one axis, the others step-1 slices and integers
    (``vol[[3, 9, 27]]``, ``vol[:, [0, 5], 10:20]``, ``vol[mask]``): the positions picked along ``axis``
    (as given, repeats too), the box the others select (``(start, stop)`` per axis; ``(0, n)`` at
    ``axis``) and the axes an integer indexes; else ``None``. The picked axis stays where it is, as dask
    has it (``vol[0, :, [1, 2]]`` is of shape ``(n, 2)``; NumPy's would be ``(2, n)``)."""
    if getattr(arr, "_gl_name", None) != arr.name or getattr(arr, "_gl_index", None) is None:
        return None
    from dask.array.slicing import normalize_index

    try:
        index = normalize_index(index, arr.shape)
    except Exception:
        return None
    lists = [a for a, ix in enumerate(index) if isinstance(ix, np.ndarray)]
    if len(index) != arr.ndim or len(lists) != 1 or index[lists[0]].ndim != 1:
        return None
    axis = lists[0]
    picks = index[axis]
    n = arr.shape[axis]
    if picks.dtype == bool:
        picks = np.flatnonzero(picks) if len(picks) == n else None
    if picks is None or picks.dtype.kind not in "iu" or not len(picks) or not ((-n <= picks) & (picks < n)).all():
        return None
    positions = tuple(int(p) % n for p in picks)
    rest = index[:axis] + (slice(0, n),) + index[axis + 1:]
    found = _parse_box(rest, arr.shape)
    if found is None:
        return None
    region, dropped = found
    return axis, positions, region, dropped


def _pick(arr: Any, axis: int, positions: tuple[int, ...], region: tuple, dropped: tuple[int, ...]) -> Any:
    """``arr[index]`` for a list of planes (``_picked``), as a gpulazy array whose ``compute()`` reads them
    alone (``_gl_pick_of``: ``read_picks``) and whose dask graph cuts each block from a chunk of ``arr``:
    a block for each stretch of the list in one chunk, along ``axis`` (``_stretches``), and each chunk
    the box meets along the others. dask's own graph for a list index (its ``take``) took 4 ms to build for 64
    planes, longer than reading them from the page cache; this one, values the same, a tenth of that."""
    from dask.base import tokenize

    name = "pick-" + tokenize(arr.name, axis, positions, region, dropped)
    view = _cut_view(arr, name, _pick_met(arr, axis, positions, region), None, dropped)
    view._gl_pick_of = (arr, axis, positions, region, dropped)
    return view


def _pick_met(arr: Any, axis: int, positions: tuple[int, ...], region: tuple) -> list[list[tuple[int, Any, int]]]:
    """``_met`` of a list of planes (``_pick``) along each axis: along ``axis`` a block for each stretch of
    the list whose positions lie in one chunk (neighbours as a slice of it, else an array of its planes),
    in the list's order; along the others the box's."""
    edges = [list(itertools.accumulate(c, initial=0)) for c in arr.chunks]
    return [_stretches(positions, ends) if a == axis else _span(lo, hi, ends)
            for a, ((lo, hi), ends) in enumerate(zip(region, edges))]


def _stretches(positions: Sequence[int], edges: list[int]) -> list[tuple[int, Any, int]]:
    """``(chunk, its planes, how many)`` for each stretch of ``positions`` in one chunk of ``edges``:
    a chunk read once for all of them, its planes a slice where they are neighbours in order."""
    out: list[tuple[int, list[int]]] = []
    for p in positions:
        i = bisect.bisect_right(edges, p) - 1
        if out and out[-1][0] == i:
            out[-1][1].append(p - edges[i])
        else:
            out.append((i, [p - edges[i]]))
    return [(i, slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1))
             else np.asarray(rows, dtype=np.intp), len(rows)) for i, rows in out]


def _span(lo: int, hi: int, edges: list[int]) -> list[tuple[int, slice, int]]:
    """``_met`` of ``lo:hi`` (step 1) along an axis of chunk ``edges``, found by bisection: a list of many
    planes looks up each run's chunks, not every chunk of the axis."""
    out = []
    for i in range(bisect.bisect_right(edges, lo) - 1, bisect.bisect_left(edges, hi)):
        s0, s1 = max(edges[i], lo), min(edges[i + 1], hi)
        if s0 < s1:
            out.append((i, slice(s0 - edges[i], s1 - edges[i]), s1 - s0))
    return out


def _in_base(box: Any, index: Any) -> tuple | None:
    """For a box (``_gl_box_of``, every step 1, no axis dropped), the index of its files' array that
    ``box[index]`` is, when ``index`` is a box, a plane or a step of it (``_parse_index``); else ``None``."""
    of = getattr(box, "_gl_box_of", None)
    if of is None or any(k != 1 for k in of[2]) or of[3]:
        return None
    found = _parse_index(index, box.shape)
    if found is None or min(found[2]) < 0:  # (a negative step of a box: dask's, as of the files)
        return None
    region, dropped, steps = found
    return tuple(b0 + r0 if axis in dropped else slice(b0 + r0, b0 + r1, step)
                 for axis, ((r0, r1), step, (b0, _)) in enumerate(zip(region, steps, of[1])))


def _parse_box(index: Any, shape: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]] | None:
    """``_box``'s reading of ``index`` against ``shape``: ``_parse_index``'s, every step 1."""
    found = _parse_index(index, shape)
    if found is None or any(k != 1 for k in found[2]):
        return None
    return found[0], found[1]


def _parse_index(index: Any, shape: tuple[int, ...]) -> tuple[tuple, tuple[int, ...], tuple[int, ...]] | None:
    """``(region, dropped, steps)`` for ``index`` of integers and slices selecting a non-empty part of
    ``shape`` of more than one element: ``(start, stop)`` per axis (from the first element it picks
    on, whatever the step's sign), the axes an integer indexes, each axis's step (1 for an integer;
    negative: the axis is picked from its end); else ``None``."""
    from dask.array.slicing import normalize_index

    try:
        index = normalize_index(index, shape)
    except Exception:
        return None
    if len(index) != len(shape):
        return None
    region, dropped, steps = [], [], []
    for axis, (ix, n) in enumerate(zip(index, shape)):
        if isinstance(ix, numbers.Integral) and not isinstance(ix, bool) and 0 <= ix < n:
            region.append((int(ix), int(ix) + 1))
            dropped.append(axis)
            steps.append(1)
            continue
        if not isinstance(ix, slice):
            return None
        picked = range(*ix.indices(n))
        if not picked:
            return None
        ends = sorted((picked[0], picked[-1]))
        region.append((ends[0], ends[1] + 1))
        steps.append(picked.step)
    if len(dropped) == len(shape):
        return None
    return tuple(region), tuple(dropped), tuple(steps)


def _kept_shape(region: tuple[tuple[int, int], ...], dropped: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(b - a for axis, (a, b) in enumerate(region) if axis not in dropped)


def _aligned_blocks(arr: Any, region: tuple[tuple[int, int], ...]) -> tuple[range, ...] | None:
    """The blocks the box ``region`` (``_box``) selects when it lies on chunk boundaries, else ``None``.

    ``None`` too for the whole array (dask returns the array itself).
    """
    blocks = []
    for (start, stop), chunks in zip(region, arr.chunks):
        edges = list(itertools.accumulate(chunks, initial=0))
        if start not in edges or stop not in edges:
            return None
        blocks.append(range(edges.index(start), edges.index(stop)))
    if all(len(r) == len(c) for r, c in zip(blocks, arr.chunks)):
        return None
    return tuple(blocks)


def _block_slice(arr: Any, blocks: tuple[range, ...]) -> Any:
    """The blocks ``blocks`` of ``arr`` as an array of their own, over the same chunk specs."""
    import dataclasses

    from dask.base import tokenize

    idx = arr._gl_index
    specs = {}
    for k in itertools.product(*blocks):  # the selected blocks only, in C order
        new = tuple(b - r.start for b, r in zip(k, blocks))
        specs[new] = arr._gl_specs[k].at(new)  # same bytes, same key: the cache is shared
    chunks = tuple(c[r.start:r.stop] for c, r in zip(arr.chunks, blocks))
    starts = [sum(c[:r.start]) for c, r in zip(arr.chunks, blocks)]
    attrs = dict(idx.attrs)
    if "translation" in attrs and "scale" in attrs:  # where the slice's first element sits
        attrs["translation"] = tuple(t + s0 * sc for t, s0, sc in zip(attrs["translation"], starts, attrs["scale"]))
    sub = dataclasses.replace(idx, shape=tuple(sum(c) for c in chunks), chunks=chunks, specs=specs, attrs=attrs,
                              paths=tuple(dict.fromkeys(p for spec in specs.values() for p in spec.paths)),
                              _token=[])
    name = "from_files-" + tokenize(arr.name, [(r.start, r.stop) for r in blocks])
    out = _array_class()(_graph(name, specs, arr._gl_source), name, chunks, meta=arr._meta)
    out._gl_attach(sub, arr._gl_source)
    return out


def __getattr__(name: str) -> Any:
    if name == "GpulazyArray":
        return _array_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_LOCAL_SCHEDULERS = {"threads", "threading", "sync", "synchronous", "single-threaded"}


def _rebuild(graph, name, chunks, meta, idx, source, order) -> Any:
    arr = _array_class()(graph, name, chunks, meta=meta)
    arr._gl_index, arr._gl_specs, arr._gl_source, arr._gl_name, arr._gl_order = idx, idx.specs, source, name, order
    return arr


def _distributed_client_active() -> bool:
    # Only look if distributed is already imported: without it no client can exist,
    # and importing it costs a second.
    mod = sys.modules.get("distributed")
    if mod is None:
        return False
    try:
        mod.get_client()
    except (ValueError, AttributeError):
        return False
    return True


# -- the fast whole-array read: the engine's (``gpulazy.read.whole``) -------------------------

def read_whole(specs: dict, source: ChunkSource, chunks: tuple, dtype: Any, order: str = "C", *,
               hooks: Any = None, name: str = "") -> Any:
    """Every chunk of ``specs`` read into one preallocated array; see ``gpulazy.read.whole.read_whole``."""
    from gpulazy.read.whole import read_whole as whole

    return whole(specs, source, chunks, dtype, order, hooks=hooks, name=name)


# -- read_file / read_files -----------------------------------------------------------------

def read_file(path: Any, *, dtype: Any = "uint8", shape: Any = None, offset: int = 0, device: Any = None,
              backend: str | None = None, timed: bool = False, verify: bool = False) -> Any:
    """Read one whole file (after ``offset``) onto the device, eagerly.

    Parameters
    ----------
    path
        The file.
    dtype
        Element type; byte order honoured (the result is native).
    shape
        Shape of the result; default 1-D. ``offset + prod(shape) * itemsize`` must be
        the file's size.
    offset
        Bytes to skip at the start.
    device, backend
        As in ``from_files``.
    timed
        Return ``(array, seconds)``: the time from the first byte asked for until the
        array is ready on the device.
    verify
        Check the bytes against the file's checksum manifest (``gpulazy index --checksum``).

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        (with ``timed=True``, a tuple ``(array, seconds)``).

    Raises
    ------
    LayoutError
        The file's size does not match ``shape``/``dtype``/``offset``.
    ChunkReadError
        The read failed or came back short.

    Examples
    --------
    >>> import gpulazy, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a.bin")
    >>> np.arange(6, dtype="<f4").tofile(p)
    >>> gpulazy.read_file(p, dtype="float32", shape=(2, 3), device="cpu")
    array([[0., 1., 2.],
           [3., 4., 5.]], dtype=float32)
    """
    dev = get_device(device)
    spec = _whole_file_spec(_one_file(path), dtype, shape, offset)
    from gpulazy.io import get_backend
    from gpulazy.read.whole import read_all

    be = get_backend(_check_backend(backend), dev)
    started = time.perf_counter()
    (arr,) = read_all([spec], be, verify)
    return (arr, time.perf_counter() - started) if timed else arr


def read_files(paths: Any, *, dtype: Any = "uint8", shape: Any = None, offset: int = 0, device: Any = None,
               backend: str | None = None, timed: bool = False, verify: bool = False) -> Any:
    """Read several whole files onto the device, every read in flight before any is awaited.

    ``paths`` is resolved like ``from_files`` (glob, directory, sequence). ``shape``
    (default 1-D per file) and ``offset`` apply to every file; ``verify`` as in ``read_file``. Returns a list of arrays
    in the order of the files (with ``timed=True``, ``(list, seconds)``).

    Examples
    --------
    >>> import gpulazy, numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> for i in range(2):
    ...     np.full(3, i, dtype="int16").tofile(os.path.join(d, f"s{i}.bin"))
    >>> [a.tolist() for a in gpulazy.read_files(d, dtype="int16", device="cpu")]
    [[0, 0, 0], [1, 1, 1]]
    """
    from gpulazy.layouts import resolve_paths

    dev = get_device(device)
    specs = [_whole_file_spec(p, dtype, shape, offset) for p in resolve_paths(paths)]
    from gpulazy.io import get_backend
    from gpulazy.read.whole import read_all

    be = get_backend(_check_backend(backend), dev)
    started = time.perf_counter()
    arrays = read_all(specs, be, verify)
    return (arrays, time.perf_counter() - started) if timed else arrays


def _one_file(path: Any) -> str:
    from gpulazy.layouts import resolve_paths

    p = os.fspath(path)
    if os.path.isdir(p):
        raise LayoutError(f"{p!r} is a directory; read_file reads one file (use read_files for a directory)")
    files = resolve_paths(p)
    if len(files) != 1:
        raise LayoutError(f"{p!r} names {len(files)} files; read_file reads one (use read_files)")
    return files[0]


def _whole_file_spec(path: str, dtype: Any, shape: Any, offset: int) -> ChunkSpec:
    from gpulazy.layouts._common import check_dtype, check_shape
    from gpulazy.layouts.raw import _check_offset, _shape_from_size, _size_error

    dt = check_dtype(dtype)
    offset = _check_offset(offset)
    ident = file_identity(path)
    size = ident[1]
    shp = _shape_from_size(path, size, offset, dt.itemsize) if shape is None else check_shape(shape)
    nbytes = math.prod(shp) * dt.itemsize
    if offset + nbytes != size:
        raise _size_error(path, size, offset + nbytes, shp, dt, offset, 1)
    return ChunkSpec((ByteRange(path, offset, nbytes),), shp, dt.str, "C", None, (ident,), ())
