"""Dask scheduler callbacks driven by gpulazy's fast whole-array read.

A ``compute()`` of a whole gpulazy array reads every chunk straight into one buffer
(``array.read_whole``) instead of running dask's scheduler. Callbacks that are active
(a ``ProgressBar``, a user's ``dask.callbacks.Callback``) used to turn that path off,
which made a whole read several times slower. Instead the fast path now calls their
hooks itself, in the order dask's local scheduler does: ``start(dsk)``,
``start_state(dsk, state)``, ``pretask(key, dsk, state)`` as each chunk read is
submitted, ``posttask(key, result, dsk, state, worker_id)`` as it lands, and
``finish(dsk, state, errored)``. ``state`` has the keys dask's scheduler state has
(``ready``, ``running``, ``finished``, ...) so progress bars count as usual; ``result``
is the chunk's slice of the output.

``gpulazy.prefetch`` callbacks are skipped: the fast path has every read in flight at
once already, so there is nothing to read ahead.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["active_callbacks", "FastPathHooks", "ChunkHooks"]


def active_callbacks(extra: Iterable[Any] | None = None) -> list[tuple]:
    """The 5-tuples of hooks a local dask compute would call: ``Callback.active`` plus ``extra``."""
    from dask.callbacks import Callback

    cbs = list(Callback.active)
    for cb in extra or ():
        cbs.append(cb._callback if hasattr(cb, "_callback") else tuple(cb))
    return [cb for cb in dict.fromkeys(cbs) if not _is_prefetch(cb)]


def _is_prefetch(cb: tuple) -> bool:
    from gpulazy.prefetch.local import prefetch

    return any(isinstance(getattr(h, "__self__", None), prefetch) for h in cb if h is not None)


class FastPathHooks:
    """Calls ``callbacks``' hooks for a graph of independent chunk tasks run by the fast path.

    Parameters
    ----------
    callbacks
        5-tuples ``(start, start_state, pretask, posttask, finish)`` (``None`` for a hook
        not used), as ``active_callbacks`` returns them.
    dsk
        The array's graph as a dict (what the hooks are shown).

    Examples
    --------
    >>> seen = []
    >>> cb = (None, None, lambda k, d, s: seen.append(("pre", k)),
    ...       lambda k, r, d, s, w: seen.append(("post", k, len(s["finished"]))), None)
    >>> hooks = FastPathHooks([cb], {("x", 0): None})
    >>> hooks.start(); hooks.pretask(("x", 0)); hooks.posttask(("x", 0), None); hooks.finish(False)
    >>> seen
    [('pre', ('x', 0)), ('post', ('x', 0), 1)]
    """

    def __init__(self, callbacks: list[tuple], dsk: dict):
        self.callbacks = callbacks
        self.dsk = dsk
        keys = list(dsk)
        # The scheduler state of a graph whose tasks have no dependencies (dask.local).
        self.state: dict[str, Any] = {
            "cache": {}, "dependencies": {k: set() for k in keys}, "dependents": {k: set() for k in keys},
            "waiting": {}, "waiting_data": {}, "ready": keys[::-1], "running": set(), "finished": set(),
            "released": set(),
        }
        self._pre = [cb[2] for cb in callbacks if cb[2] is not None]
        self._post = [cb[3] for cb in callbacks if cb[3] is not None]

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def start(self) -> None:
        for cb in self.callbacks:
            if cb[0] is not None:
                cb[0](self.dsk)
        for cb in self.callbacks:
            if cb[1] is not None:
                cb[1](self.dsk, self.state)

    def pretask(self, key: Any) -> None:
        st = self.state
        ready = st["ready"]
        if ready and ready[-1] == key:  # the usual case: chunks start in graph order (O(1))
            ready.pop()
        elif key in st["dependencies"]:
            try:
                ready.remove(key)
            except ValueError:
                pass
        st["running"].add(key)
        for f in self._pre:
            f(key, self.dsk, st)

    def posttask(self, key: Any, result: Any) -> None:
        st = self.state
        st["running"].discard(key)
        st["finished"].add(key)
        for f in self._post:
            f(key, result, self.dsk, st, 0)

    def finish(self, errored: bool) -> None:
        for cb in self.callbacks:
            if cb[4] is not None:
                cb[4](self.dsk, self.state, errored)


class ChunkHooks:
    """``FastPathHooks`` told chunk by chunk by a streamed map (``gpulazy.read.mapped``): a block's read
    tasks ``(name, *index)`` (one of each name of ``read_names`` the graph has: a block of several
    arrays' chunks is a read of each) as the block is handed out, then the tasks computed from it (the
    map's, and an inner map's for a map of a map: every other key of the graph with that block index,
    in the graph's order) around the call. Thread-safe: on the CPU the calls run on several threads,
    and the hooks a dask scheduler calls are never called concurrently."""

    def __init__(self, hooks: FastPathHooks, read_names: tuple[str, ...]):
        import threading

        self.hooks, self.read_names = hooks, read_names
        self.derived: dict[tuple, list] = {}
        for key in hooks.dsk:
            if isinstance(key, tuple) and key[0] not in read_names:
                self.derived.setdefault(key[1:], []).append(key)
        self.lock = threading.Lock()

    def read(self, index: tuple, block: Any) -> None:
        """``block``: the chunk, or the tuple of a block's chunks (one of each read name, in order)."""
        parts = block if isinstance(block, tuple) else (block,) * len(self.read_names)
        told = set()  # (an array twice among the operands, ``(a - b) / (a + b)``: one read task)
        with self.lock:
            for name, part in zip(self.read_names, parts):
                key = (name, *index)
                if key in self.hooks.dsk and key not in told:
                    told.add(key)
                    self.hooks.pretask(key)
                    self.hooks.posttask(key, part)

    def calling(self, index: tuple) -> None:
        with self.lock:
            for key in self.derived.get(index, ()):
                self.hooks.pretask(key)

    def called(self, index: tuple, block: Any) -> None:
        with self.lock:
            for key in self.derived.get(index, ()):
                self.hooks.posttask(key, block)
