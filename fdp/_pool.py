"""The replica thread pool: persistent workers, one per device slot, and the run protocol.

A pool serves one tuple of devices. Replica 0 runs in the caller's thread (a single replica
therefore never leaves it); replica ``i > 0`` runs on worker ``i``, a daemon thread that lives
as long as the process. The replicas of one call are queued on all workers under one lock, so
every worker sees the calls in the same order: concurrent calls from many threads can then never
leave one call's replicas waiting for each other behind another call's (collectives rely on it).

Each replica runs with the caller's thread-local torch state (``_thread_state``), inside its
:class:`~fdp._replica.ReplicaContext`, and on CUDA on its device with the worker's own stream,
ordered after the caller's pending work on that device and before the caller's next.

Failures: the first failing replica aborts the call's :class:`~fdp._replica.CallGroup` (which
releases replicas waiting in collectives); when all replicas have returned, the caller gets the
failing replica's own exception object with notes naming the replica, its device, and what the
other replicas raised. The workers are unaffected and serve the next call.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from . import _replica, _thread_state

__all__ = ["ReplicaPool", "get_pool", "run_replicas", "ensure_not_in_replica"]


class _Latch:
    """Counts replicas down; ``wait`` returns once all have finished."""

    __slots__ = ("_count", "_count_lock", "_done")

    def __init__(self, count: int) -> None:
        self._count = count
        self._count_lock = threading.Lock()
        self._done = threading.Lock()
        self._done.acquire()
        if count == 0:
            self._done.release()

    def count_down(self) -> None:
        with self._count_lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self._done.release()

    def wait(self) -> None:
        self._done.acquire()
        self._done.release()


class _Worker(threading.Thread):
    def __init__(self, device: torch.device, slot: int) -> None:
        super().__init__(name=f"fdp-replica-{slot}-{device}", daemon=True)
        self.device = device
        self.tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.stream: Any = None  # torch.cuda.Stream on CUDA devices

    def run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self.stream = torch.cuda.Stream(self.device)
        while True:
            task = self.tasks.get()
            if task is None:
                return
            task()
            del task  # drop the replica's references before blocking on the queue


class ReplicaPool:
    """Workers for ``devices[1:]``; replica 0 runs in the calling thread."""

    def __init__(self, devices: tuple[torch.device, ...]) -> None:
        self.devices = devices
        self._submit_lock = threading.Lock()
        self._workers = [_Worker(d, slot) for slot, d in enumerate(devices) if slot > 0]
        for worker in self._workers:
            worker.start()
        if any(d.type == "cuda" for d in devices[1:]):
            # The workers create their streams on start; replicas must not run before.
            self._wait_for_streams()

    def _wait_for_streams(self) -> None:
        ready = _Latch(len(self._workers))
        for worker in self._workers:
            worker.tasks.put(ready.count_down)
        ready.wait()

    def run(
        self,
        replicas: Sequence[Callable[[], Any]],
        *,
        axis_name: Hashable | None,
        caller: str,
    ) -> list[Any]:
        """Runs ``replicas[i]()`` as replica ``i`` on ``devices[i]`` and returns their results."""
        n = len(replicas)
        devices = self.devices[:n]
        state = _thread_state.capture()
        group = _replica.CallGroup(n)
        results: list[Any] = [None] * n
        errors: list[BaseException | None] = [None] * n
        latch = _Latch(n - 1)
        cuda_sync = _CudaSync(devices) if any(d.type == "cuda" for d in devices) else None

        def make_task(i: int) -> Callable[[], None]:
            context = _replica.ReplicaContext(axis_name, i, n, devices[i], group)
            worker = self._workers[i - 1] if i > 0 else None

            def task() -> None:
                try:
                    # Replica 0 runs in the caller's thread, which already has the caller's state.
                    with _replica.entered(context), _thread_state.applied(state) if i > 0 else _NULL_CONTEXT:
                        if cuda_sync is not None:
                            with cuda_sync.running(i, worker):
                                results[i] = replicas[i]()
                        else:
                            results[i] = replicas[i]()
                except BaseException as error:  # noqa: BLE001 - every failure goes to the caller
                    errors[i] = error
                    group.abort(i, error)
                finally:
                    if i > 0:
                        latch.count_down()

            return task

        tasks = [make_task(i) for i in range(n)]
        with self._submit_lock:
            for i in range(1, n):
                self._workers[i - 1].tasks.put(tasks[i])
        try:
            tasks[0]()
            latch.wait()
        except BaseException as interrupt:  # KeyboardInterrupt while waiting
            group.abort(0, interrupt)
            latch.wait()
            raise
        if cuda_sync is not None:
            cuda_sync.finish(results, self._workers)
        if any(e is not None for e in errors):
            raise _primary_error(errors, devices, caller)
        return results


class _CudaSync:
    """Stream ordering between the caller and the replica workers on CUDA devices."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = devices
        # The caller's current streams: the transfers into the replicas were issued on them.
        self.caller_streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]

    def running(self, i: int, worker: _Worker | None) -> Any:
        device = self.devices[i]
        if device.type != "cuda":
            return _NULL_CONTEXT
        if worker is None:  # replica 0 runs on the caller's own stream
            return torch.cuda.device(device)
        worker.stream.wait_stream(self.caller_streams[i])
        return torch.cuda.stream(worker.stream)

    def finish(self, results: list[Any], workers: Sequence[_Worker]) -> None:
        """Orders the caller's streams after the workers' and protects their outputs' memory."""
        from . import _tree  # local: avoids an import cycle at module load

        for i in range(1, len(self.devices)):
            caller_stream = self.caller_streams[i]
            if caller_stream is None:
                continue
            caller_stream.wait_stream(workers[i - 1].stream)
            # Memory allocated on the worker's stream is used on the caller's from now on.
            for leaf in _tree.flatten(results[i])[0]:
                if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
                    leaf.record_stream(torch.cuda.current_stream(leaf.device))


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_CONTEXT = _NullContext()


def _primary_error(
    errors: Sequence[BaseException | None], devices: Sequence[torch.device], caller: str
) -> BaseException:
    """The first replica's own failure, with notes on where it happened and what else failed."""
    failed = [(i, e) for i, e in enumerate(errors) if e is not None]
    own = [(i, e) for i, e in failed if not isinstance(e, _replica.ReplicaAborted)]
    index, error = (own or failed)[0]
    error.add_note(f"{caller}: raised by replica {index} of {len(errors)} (device {devices[index]})")
    for i, other in failed:
        if other is error:
            continue
        error.add_note(
            f"{caller}: replica {i} (device {devices[i]}) also failed: {type(other).__name__}: {other}"
        )
    return error


_POOLS: dict[tuple[torch.device, ...], ReplicaPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(devices: tuple[torch.device, ...]) -> ReplicaPool:
    """The process-wide pool for ``devices``, started on first use."""
    pool = _POOLS.get(devices)
    if pool is None:
        with _POOLS_LOCK:
            pool = _POOLS.get(devices)
            if pool is None:
                pool = _POOLS[devices] = ReplicaPool(devices)
    return pool


def _forget_pools_after_fork() -> None:
    # Threads do not survive fork (DataLoader workers, multiprocessing): a child starts afresh.
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_after_fork)


def ensure_not_in_replica(caller: str) -> None:
    """Refuses dispatch from inside a replica (it would wait on its own pool)."""
    context = _replica.current()
    if context is not None:
        raise RuntimeError(
            f"{caller} was called inside a function that is already running as replica "
            f"{context.index} of {context.size} (device {context.device}); nested pmap and "
            "parallel_apply inside mapped functions are not supported. Call the inner function "
            "directly: it already runs on its replica's device."
        )


def run_replicas(
    devices: tuple[torch.device, ...],
    replicas: Sequence[Callable[[], Any]],
    *,
    axis_name: Hashable | None = None,
    caller: str,
) -> list[Any]:
    """Runs ``replicas[i]`` on ``devices[i]`` (the pool for ``devices``); see :class:`ReplicaPool`."""
    ensure_not_in_replica(caller)
    return get_pool(devices).run(replicas, axis_name=axis_name, caller=caller)
