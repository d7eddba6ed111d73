"""``gpulazy.cluster()``: a local dask.distributed cluster sized to this machine, ready for gpulazy.

With GPUs and dask-cuda installed it is dask-cuda's ``LocalCUDACluster``: one worker
process per GPU (each sees its GPU as ``cuda:0``, so graphs built with
``device="cuda:0"`` run on every worker), each with its own device cache and the
read-ahead worker plugin. Without GPUs it is a ``LocalCluster`` of worker processes.
Chunks are read by the worker that runs the task reading them: a graph carries file
paths and byte ranges, never bytes, so no data passes through the scheduler.

On several machines start the scheduler and workers yourself (``dask scheduler``, then
``dask cuda worker tcp://HOST:8786`` on each GPU machine, or ``dask worker`` without
GPUs), connect with ``distributed.Client("tcp://HOST:8786")`` and call
``gpulazy.prefetch.install(client)``: every path must name the same file on every
machine (a shared file system), the rest is unchanged.
"""

from __future__ import annotations

from typing import Any

from gpulazy.device import gpu_count
from gpulazy.errors import missing_dependency

__all__ = ["cluster"]


def cluster(n_workers: int | None = None, *, threads_per_worker: int | None = None, gpus: bool | None = None,
            prefetch: bool = True, processes: bool = True, **kwargs: Any) -> Any:
    """Start a local cluster and return a connected ``distributed.Client``.

    Parameters
    ----------
    n_workers
        Workers: default one per GPU (``LocalCUDACluster``), else one per two cores, at least 2.
    threads_per_worker
        Threads per worker (default: dask's choice).
    gpus
        ``True``: GPUs required (raises without them or without dask-cuda); ``False``:
        a CPU ``LocalCluster`` even where GPUs exist; ``None``: GPUs when present.
    prefetch
        Install gpulazy's read-ahead worker plugin (``gpulazy.prefetch.install``).
    processes
        Worker processes (``True``) or threads in this process (``False``, CPU only).
    **kwargs
        Passed to ``LocalCUDACluster`` or ``LocalCluster``.

    Returns
    -------
    distributed.Client
        ``client.close()`` and ``client.cluster.close()`` (or ``with`` on both) end it.

    Examples
    --------
    >>> import gpulazy, numpy as np, tempfile, os                    # doctest: +SKIP
    >>> client = gpulazy.cluster(n_workers=2, gpus=False)           # doctest: +SKIP
    >>> vol = gpulazy.from_files(path, shape=..., dtype="uint16")   # doctest: +SKIP
    >>> vol.max(axis=0).compute()       # read and reduced on the workers  # doctest: +SKIP
    """
    try:
        import distributed
    except ImportError as e:  # pragma: no cover - distributed is a dependency
        raise missing_dependency("distributed", "gpu", "gpulazy.cluster") from e
    use_gpus = _want_gpus(gpus)
    if use_gpus:
        cluster_ = _cuda_cluster(n_workers, threads_per_worker, **kwargs)
    else:
        n = n_workers if n_workers is not None else max(2, _cores() // 2)
        cluster_ = distributed.LocalCluster(n_workers=n, threads_per_worker=threads_per_worker,
                                            processes=processes, **kwargs)
    client = distributed.Client(cluster_)
    if prefetch:
        import gpulazy

        gpulazy.prefetch.install(client)
    return client


def _want_gpus(gpus: bool | None) -> bool:
    if gpus is False:
        return False
    have = gpu_count() > 0
    if gpus and not have:
        from gpulazy.device import gpu_unavailable_reason

        raise RuntimeError(f"gpulazy.cluster(gpus=True) found no usable GPU: {gpu_unavailable_reason()}")
    return have


def _cuda_cluster(n_workers: int | None, threads_per_worker: int | None, **kwargs: Any) -> Any:
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as e:
        raise missing_dependency("dask-cuda", "cluster", "gpulazy.cluster() on GPUs") from e
    if n_workers is not None:
        kwargs["n_workers"] = n_workers
    if threads_per_worker is not None:
        kwargs["threads_per_worker"] = threads_per_worker
    # gpulazy's cache bounds device memory itself; dask-cuda's spilling would copy our
    # cached chunks to the host behind its back (and its limit does not bound real use).
    kwargs.setdefault("device_memory_limit", 0)
    return LocalCUDACluster(**kwargs)


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
