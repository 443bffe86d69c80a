"""The replica threads: persistent workers, one per device slot, and the run protocol.

Replica 0 runs in the caller's thread (a single replica therefore never leaves it). Replica
``i > 0`` runs on a worker: a daemon thread that serves one device and lives as long as the
process. Workers are shared by every pmapped function and started on first need: a call that
runs ``k`` replicas on a device (replica 0 included) uses that device's first ``k - 1`` workers
(the ``j``-th occurrence of a device among replicas ``1..`` uses its ``j``-th worker). So a batch
of 3 on 2000 devices starts 2 threads, and ``["cpu"] * 8`` anywhere shares the same 7.

The replicas of one call are queued on their workers under one process-wide lock, so every
worker sees the calls in the same order: concurrent calls from many threads can never leave one
call's replicas waiting for each other behind another call's (collectives rely on it).

Each replica runs with the caller's thread-local torch state (``_thread_state``), inside its
:class:`~fdp._replica.ReplicaContext`, and on CUDA on its device with the worker's own stream,
ordered after the caller's pending work on that device and before the caller's next. Tensors
cross between the caller's and a worker's streams with ``record_stream``, so the caching
allocator never hands their memory out while the other stream may still use it.

Failures: the first failing replica aborts the call's :class:`~fdp._replica.CallGroup` (which
releases replicas waiting in collectives); when all replicas have returned, the caller gets the
failing replica's own exception object with notes naming the replica, its device, and what the
other replicas raised. The workers are unaffected and serve the next call.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from . import _devices, _distributed, _random, _replica, _thread_state, _tree

__all__ = ["run_replicas", "LoneReplica", "ensure_not_in_replica"]


class _Latch:
    """Counts replicas down; ``wait`` returns once all have finished.

    An Event rather than a bare lock: a ``KeyboardInterrupt`` that lands in ``wait`` must leave
    it waitable again (the caller then waits for the replicas before re-raising).
    """

    __slots__ = ("_count", "_count_lock", "_done")

    def __init__(self, count: int) -> None:
        self._count = count
        self._count_lock = threading.Lock()
        self._done = threading.Event()
        if count == 0:
            self._done.set()

    def count_down(self) -> None:
        with self._count_lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self._done.set()

    def wait(self) -> None:
        self._done.wait()


class _Worker(threading.Thread):
    def __init__(self, device: torch.device, number: int) -> None:
        super().__init__(name=f"fdp-worker-{device}-{number}", daemon=True)
        self.device = device
        self.number = number
        self.tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.stream: Any = None  # torch.cuda.Stream on CUDA devices
        self.init_error: BaseException | None = None
        self.busy = False  # running a replica (for idle(): nothing may be left blocked)
        self._ready = threading.Event()

    def wait_ready(self) -> None:
        self._ready.wait()

    def run(self) -> None:
        try:
            _resolve_math_kernels()  # while the caller waits for this worker: in no race
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                self.stream = torch.cuda.Stream(self.device)
        except BaseException as error:  # noqa: BLE001 - every task reports it instead
            self.init_error = error
        finally:
            self._ready.set()
        fresh = _thread_state.fresh()
        dirty = False  # left with state it could not take back: see _clean
        while True:
            task = self.tasks.get()
            if task is None:
                with _SUBMIT_LOCK:
                    _RETIRED.discard(self)
                return
            self.busy = True
            try:
                if dirty:
                    self._run_in_fresh_thread(task)
                else:
                    task()
            finally:
                del task  # drop the replica's references before blocking on the queue
                # The replica has been counted as done: the caller no longer waits for this.
                if not dirty and _thread_state.leftovers() != fresh.leftovers:
                    dirty = not self._clean(fresh)
                self.busy = False

    def _clean(self, fresh: _thread_state.Fresh) -> bool:
        """Takes back the thread-local state a replica left set, which would reach the next
        replicas this worker runs; whether that made the thread fresh again. A worker that
        cannot be made fresh leaves the pool (later calls start a new worker); the replicas
        already queued on it (a concurrent call's, submitted while the replica ran) each run in
        a fresh thread of their own (see :meth:`_run_in_fresh_thread`), not with that state."""
        try:
            if _thread_state.restore(fresh):
                return True
        except Exception:  # noqa: BLE001 - the worker must keep serving its queue
            pass
        _retire([self])
        return False

    def _run_in_fresh_thread(self, task: Callable[[], None]) -> None:
        """Runs ``task`` in a new thread and waits for it: a retired worker's queue, in order,
        without the state its own thread was left with."""

        def run() -> None:
            if self.device.type == "cuda":
                with contextlib.suppress(Exception):  # the task must run: it counts itself done
                    torch.cuda.set_device(self.device)
            task()

        thread = threading.Thread(target=run, name=f"{self.name}-fresh", daemon=True)
        try:
            thread.start()
        except Exception:  # noqa: BLE001 - no thread to be had: run it here rather than never
            task()
            return
        thread.join()


# torch runs these float unary ops through MKL's vector math library (VML), which picks each
# function's kernel (instruction set, accuracy) on its first call. First calls racing in several
# threads can run a low-accuracy kernel on one thread's data, silently: errors of thousands of
# ulps in that one call (pytorch/pytorch#188792, oneMKL 2024.2). Replicas in threads make the
# race likely on a process's first calls, so the first worker calls each function once, before
# any replica runs beside another. (A superset of the ops torch routes there, across versions.)
_VML_OPS = (
    "abs", "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "expm1",
    "log", "log10", "log1p", "log2", "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip
_math_kernels_resolved = False


def _resolve_math_kernels() -> None:
    """Calls each VML function once (float and double), the first time a worker starts."""
    global _math_kernels_resolved
    if _math_kernels_resolved:
        return
    _math_kernels_resolved = True
    if not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)  # inside every function's domain
        for name in _VML_OPS:
            getattr(torch, name)(one)


_WORKERS: dict[tuple[torch.device, int], _Worker] = {}
# Workers taken out of the pool whose replica has not returned yet: the exit waits for them too.
_RETIRED: set[_Worker] = set()
_SUBMIT_LOCK = threading.Lock()  # guards _WORKERS and keeps every worker's queue in one order


def _workers_for(devices: Sequence[torch.device]) -> list[_Worker]:
    """The workers of replicas ``1..len(devices)-1`` (call with ``_SUBMIT_LOCK`` held)."""
    seen: dict[torch.device, int] = {}
    workers = []
    for i, device in enumerate(devices):
        number = seen.get(device, 0)
        seen[device] = number + 1
        if i == 0:
            continue
        worker = _WORKERS.get((device, number))
        if worker is None:
            worker = _WORKERS[(device, number)] = _Worker(device, number)
            try:
                worker.start()
            except Exception:
                # Its thread did not start (the process or its container is at its thread
                # limit): no worker may stay that would never take the tasks queued on it,
                # which every later call's caller would wait for forever. (An interrupt is no
                # Exception: it lands in start's wait for the thread, which then runs, and stays.)
                del _WORKERS[(device, number)]
                raise
            worker.wait_ready()
        workers.append(worker)
    return workers


def _retire(workers: Sequence[_Worker]) -> None:
    """Takes ``workers`` out of the pool: the next call that needs one starts a new worker.

    Each leaves its loop once it has run what is already queued on it (if its replica ever
    returns); tasks of a call whose caller stopped waiting return at once.
    """
    with _SUBMIT_LOCK:
        for worker in workers:
            key = (worker.device, worker.number)
            if _WORKERS.get(key) is worker:
                del _WORKERS[key]
            _RETIRED.add(worker)
            worker.tasks.put(None)


def idle() -> bool:
    """Whether every worker thread is waiting for work (none running or blocked in a replica)."""
    return all(not w.busy and w.tasks.empty() and w.is_alive() for w in list(_WORKERS.values()))


def worker_count() -> int:
    """How many worker threads have been started in this process."""
    return len(_WORKERS)


def _forget_workers_after_fork() -> None:
    # Threads do not survive fork (DataLoader workers, multiprocessing): a child starts afresh.
    global _SUBMIT_LOCK
    _WORKERS.clear()
    _RETIRED.clear()
    _SUBMIT_LOCK = threading.Lock()
    # A child forked by a replica (a DataLoader iterated in the mapped function) runs no
    # replica: none of the call's others is in it. Its own pmapped calls were refused as nested,
    # and a collective there would wait for replicas that are not in the process.
    _replica.swap_current(None)


os.register_at_fork(after_in_child=_forget_workers_after_fork)


def _stop_workers() -> None:
    """At exit: every worker leaves its loop before the interpreter shuts down.

    A worker can still be waking up for a replica that the caller ran itself, and a retired
    worker (:func:`_retire`) can still be running the replica its caller stopped waiting for.
    A daemon thread that takes the GIL during shutdown is killed on the spot, and if that
    happens inside C++ code the process aborts ("terminate called without an active
    exception").
    """
    with _SUBMIT_LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()  # a call made after this (from a later atexit hook) starts new ones
        for worker in workers:
            worker.tasks.put(None)
        workers += _RETIRED  # already told to leave once their replica returns
    deadline = time.monotonic() + 2.0  # a worker stuck in a replica must not block the exit
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))


atexit.register(_stop_workers)


class _CudaSync:
    """Stream ordering and memory safety between the caller and the workers on CUDA devices."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = devices
        # The caller's current streams: the transfers into the replicas were issued on them.
        self.caller_streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]

    def running(self, i: int, worker: _Worker | None, inputs: Sequence[torch.Tensor]) -> Any:
        device = self.devices[i]
        if device.type != "cuda":
            return _NULL_CONTEXT
        if worker is None:  # replica 0 runs on the caller's own stream
            return torch.cuda.device(device)
        worker.stream.wait_stream(self.caller_streams[i])
        # The inputs were allocated on the caller's stream; the worker's stream reads them, in
        # the forward and again in the backward (saved tensors).
        for t in inputs:
            if t.device.type == "cuda":
                t.record_stream(worker.stream)
        return torch.cuda.stream(worker.stream)

    def finish(self, results: list[Any], workers: Sequence[_Worker]) -> None:
        """Orders the caller's streams after the workers' and protects their outputs' memory."""
        for i in range(1, len(self.devices)):
            caller_stream = self.caller_streams[i]
            stream = workers[i - 1].stream
            if caller_stream is None or stream is None:
                continue
            caller_stream.wait_stream(stream)
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


def _note(error: BaseException, caller: str, text: str) -> None:
    # An exception may refuse notes (a __notes__ that is not a list, an add_note of its own
    # that raises): the failure being reported must still be the one raised, without them.
    with contextlib.suppress(Exception):  # whatever a user's exception type does
        error.add_note(f"{caller}: {text}")


def _clear_old_notes(error: BaseException) -> None:
    # An exception object raised again in a later call (a module-level instance) keeps the
    # notes of the first; only this call's should show. Notes need not be strings (a user may
    # append anything to __notes__), nor __notes__ a list: those are left as they are.
    with contextlib.suppress(Exception):  # a __notes__ property of a user's exception type
        notes = getattr(error, "__notes__", None)
        if isinstance(notes, list) and notes:
            notes[:] = [n for n in notes if not (isinstance(n, str) and n.startswith("fdp."))]


# torch keeps forward-mode AD's levels per process, not per thread: replicas that run
# torch.func.jvp, jacfwd or hessian at once use each other's levels, and torch's errors about
# them read as a misuse in the replica's own code (which runs fine on one device).
_FORWARD_AD_IN_REPLICAS = (
    "forward-mode AD (torch.func.jvp, jacfwd, hessian, torch.autograd.forward_ad) inside "
    "replicas that run at once is unsafe: torch keeps its levels per process, not per thread, "
    "so the replicas corrupt each other's, and calls that raise nothing can return wrong "
    "tangents. Use reverse mode inside the mapped function (vjp, jacrev; jacrev(jacrev(f)) for a "
    "Hessian), or torch.autograd.forward_ad around the whole pmapped call"
)

_EMBEDDING_BAG_SPLIT = (
    "an nn.EmbeddingBag's 1-D input with offsets is no batch of rows: split over the "
    "replicas, each shard's offsets point into the whole input (and where the bags before "
    "a shard are empty, its bags come out wrong without this error). Pass the bags in the "
    "2-D form, a [bags, max_len] tensor of indices padded with padding_idx, with no offsets"
)

# Notes for torch errors whose message misleads in a replica: (exception type, a phrase of
# torch's message, whether only a call of several replicas gets the note, the note).
_NOTES_ON_TORCH_ERRORS: tuple[tuple[type[BaseException], str, bool, str], ...] = (
    (
        RuntimeError,
        "Trying to access a forward AD level with an invalid index",
        True,
        _FORWARD_AD_IN_REPLICAS,
    ),
    (RuntimeError, "Nested forward mode AD is not supported", True, _FORWARD_AD_IN_REPLICAS),
    (RuntimeError, "Exiting a forward AD level that is not the last", True, _FORWARD_AD_IN_REPLICAS),
    (RuntimeError, "Entering a new forward AD level but the current level", True, _FORWARD_AD_IN_REPLICAS),
    (
        # torch's message names SplitWithSizes, which the user never called.
        RuntimeError,
        "output of a function that returns multiple views",
        False,
        "the replicas' shards of a mapped input that requires grad are views of it (one "
        "split_with_sizes), which autograd lets no one change in place: use the out-of-place "
        "op (nn.ReLU(inplace=False), x = x.relu()) on the shard, or clone it first",
    ),
    (
        # torch's message names the shard's size, where the caller gave a batch that one
        # device normalizes fine (a batch of 3 over 3 replicas: a (1, C) input to each).
        ValueError,
        "Expected more than 1 value per channel when training",
        True,
        "each replica's batch norm normalizes its own shard, which here holds too few rows "
        "(one device would see the whole batch): give every replica at least 2 rows (a "
        "larger batch, fewer devices), or normalize over the whole batch with "
        "fdp.SyncBatchNorm.convert_sync_batchnorm(model, axis_name=...)",
    ),
    # An nn.EmbeddingBag's 1-D input and offsets, split by rows: a shard's offsets still
    # point into the whole input. torch's message reads as a mistake in the offsets given.
    # Replica 0's offsets start at 0, so where it fails (bags of several indices before empty
    # ones), it is that their last points past its shard, the error that comes first.
    (RuntimeError, "offsets[0] has to be 0", True, _EMBEDDING_BAG_SPLIT),
    (RuntimeError, "offsets[-1] can not be greater than input's length", True, _EMBEDDING_BAG_SPLIT),
)


def _primary_error(
    errors: Sequence[BaseException | None], devices: Sequence[torch.device], caller: str
) -> BaseException:
    """The first replica's own failure, with notes on where it happened and what else failed."""
    failed = [(i, e) for i, e in enumerate(errors) if e is not None]
    own = [(i, e) for i, e in failed if not isinstance(e, _replica.ReplicaAborted)]
    index, error = (own or failed)[0]
    _clear_old_notes(error)
    same = [i for i, e in failed if e is error and i != index]
    where = f"replica {index} of {len(errors)} (device {devices[index]})"
    if same:
        where += f", and the same object by replica(s) {same}"
    _note(error, caller, f"raised by {where}")
    text = _replica.error_text(error)  # a user's __str__ that fails must not replace the error
    for kind, phrase, several, note in _NOTES_ON_TORCH_ERRORS:
        if isinstance(error, kind) and phrase in text and (len(errors) > 1 or not several):
            _note(error, caller, note)
    # The other failures, one note per distinct error: on 8 replicas that each raise the same
    # error (a model bug every shard meets), one line, not seven copies of the message.
    described: dict[str, list[int]] = {}
    for i, other in failed:
        if other is not error:
            described.setdefault(f"{type(other).__name__}: {_replica.error_text(other)}", []).append(i)
    primary = f"{type(error).__name__}: {text}"
    for description, indices in described.items():
        on = sorted({str(devices[i]) for i in indices}, key=[str(d) for d in devices].index)
        who = (
            f"replica {indices[0]}"
            if len(indices) == 1
            else f"replicas {', '.join(map(str, indices[:-1]))} and {indices[-1]}"
        )
        what = f" with the same {type(error).__name__}" if description == primary else f": {description}"
        _note(error, caller, f"{who} (device{'s' if len(on) > 1 else ''} {', '.join(on)}) also failed{what}")
    return error


def ensure_not_in_replica(caller: str) -> None:
    """Refuses dispatch from inside a replica (it would wait on its own workers)."""
    context = _replica.current()
    if context is not None:
        raise RuntimeError(
            f"{caller} was called inside a function that is already running as replica "
            f"{context.index} of {context.size} (device {context.device}); nested pmap and "
            "parallel_apply inside mapped functions are not supported. Call the inner function "
            "directly: it already runs on its replica's device."
        )


def under_transform_error(caller: str, *, inside: str, example: str, outputs: str) -> RuntimeError:
    """The refusal of a call under a torch.func transform (``fdp.pmap``, ``fdp.parallel_apply``):
    the replicas run in other threads, where the transform cannot follow. Built only to be
    raised (the check, one C call, stays inline on the callers' paths)."""
    return RuntimeError(
        f"{caller} was called under a torch.func transform (grad, vjp, vmap, jacrev, ...). The "
        "replicas run in other threads, where the transform cannot follow, and its result would "
        f"be silently wrong (zero gradients). Apply the transform inside {inside} instead, e.g. "
        f"{example}, or use torch.autograd (loss.backward()) on {outputs}."
    )


def ensure_not_traced(caller: str, *, advice: str) -> None:
    """Refuses a call whose replicas would run in other threads while a tracer records the
    caller's operations: ``torch.jit.trace``, or ``make_fx`` (``torch.func.linearize``,
    ``torch.export``'s non-strict tracing, AOT tracing), whose modes are thread-local.

    The replicas on workers run untraced: the trace held their results as constants, which it
    replayed whatever its inputs were (``linearize``'s tangents came back as the uninitialized
    memory it traces with), or failed far from the call (a ``divmod`` of traced sizes, a fake
    tensor among an exported program's constants). A single replica runs in the calling
    thread, where the tracer sees it, so callers check only where several may run. Three C
    calls, on the path of calls that run several replicas only.
    """
    C = torch._C  # noqa: N806
    if C._is_tracing():
        tracer = "torch.jit.trace"
    elif (
        C._get_dispatch_mode(C._TorchDispatchModeKey.PROXY) is not None
        or C._dispatch_tls_is_dispatch_key_included(C.DispatchKey.PreDispatch)  # torch.export
    ):
        tracer = "make_fx tracing (torch.func.linearize, torch.export, make_fx)"
    else:
        return
    raise RuntimeError(
        f"{caller} was called under {tracer}, which records only the calling thread's "
        "operations: the replicas run in other threads, so the trace would hold their results "
        f"as constants and be silently wrong when run on other inputs. {advice}. For the "
        "call's forward-mode derivatives (linearize's), use torch.autograd.forward_ad around "
        "it, with dual inputs."
    )


class Timing:
    """How long replica 0 of one function's recent calls took (an exponential moving average).

    :func:`run_replicas` uses it to run small replicas inline; see there.
    """

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: float | None = None

    def record(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds is None else 0.75 * self.seconds + 0.25 * seconds


# What waking a worker costs here: from a task's submission to its start, averaged as workers
# start tasks. The first guess is a typical Linux futex wake-up across cores.
_wake_seconds = 50e-6
_MAX_WAKE_SECONDS = 500e-6
# Whether the caller may run replicas other than 0 (benchmarks turn it off to measure hand-offs).
INLINE_REPLICAS = True


def _may_run_inline(on_cpu: bool) -> bool:
    """Whether replicas other than 0 may run in the caller's thread.

    Only on CPU, and only without function or dispatch modes in the caller's thread other than
    fdp's own rng scopes: a worker does not see those modes, so a replica must not see them
    depending on which thread happened to run it.
    """
    return (
        INLINE_REPLICAS
        and on_cpu
        and torch._C._len_torch_function_stack() == 0
        and torch._C._len_torch_dispatch_stack() == _random.active_depth()
    )


def run_replicas(
    devices: Sequence[torch.device],
    replicas: Sequence[Callable[[], Any]],
    *,
    axis_name: Hashable | None = None,
    caller: str,
    inputs: Sequence[Sequence[torch.Tensor]] | None = None,
    timing: Timing | None = None,
    take_turns: bool = False,
) -> list[Any]:
    """Runs ``replicas[i]()`` as replica ``i`` on ``devices[i]`` and returns their results.

    ``inputs[i]`` are the tensors replica ``i`` was given (for CUDA stream bookkeeping). With
    ``take_turns``, one replica at a time runs between collectives (while a compiled function
    is being compiled: see :class:`fdp._replica.Turnstile`).

    Replica 0 runs in the calling thread, the others on workers. Waking a sleeping worker costs
    tens to hundreds of microseconds, more than a small replica takes, so on CPU the caller
    runs replicas itself where that is faster and cannot change a result:

    * **Inline**: when ``timing`` says this function's replicas take less than a worker's
      wake-up, the others are not handed over at first. If replica 0 returns without meeting
      the others in a collective, no replica may call one (SPMD), so the caller runs them one
      after another; if it enters a collective, the others go to their workers right then.
      Without an axis name no replica can call a collective at all: the caller runs them one
      after another from the start, with none of the hand-over machinery (:func:`_run_in_caller`).
    * **Stealing**: otherwise, once replica 0 returns without having met the others, the caller
      runs the replicas that no worker has started yet.

    Replicas must therefore not wait for each other except through fdp's collectives.
    """
    ensure_not_in_replica(caller)
    n = len(replicas)
    if n == 1:
        return [LoneReplica(devices[0], axis_name=axis_name, caller=caller)(replicas[0])]
    devices = tuple(devices[:n])
    if (
        axis_name is None
        and timing is not None
        and not take_turns
        and _is_small(timing, n)
        and _may_run_inline(all([d == _devices.CPU for d in devices]))
    ):
        return _run_in_caller(devices, replicas, caller=caller, timing=timing)
    rng_seed = _random.call_seed()  # a call inside fdp.rng_scope: each replica gets its own
    group = _call_group(n, devices, axis_name, caller)
    state = _thread_state.capture()
    # Under torch.utils.checkpoint the replicas save their tensors through the caller's hooks,
    # which match a recomputation's tensors to the forward's by order: run at once, replicas
    # would save in a different order each time, and tensors of equal shapes would be swapped
    # (silently wrong gradients). In turns, in index order, they save in the same order on
    # every run, the order the caller running them one after another (above) gives too.
    ordered = _thread_state.saves_in_order(state)
    if take_turns or ordered:
        group.turnstile = _replica.Turnstile(n, ordered=ordered)
        replicas = [functools.partial(_in_turn, group, i, r) for i, r in enumerate(replicas)]
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    # The caller waits on a latch for the replicas handed to workers, made at the hand-over. No
    # replica but 0 has run by then: the hand-over happens before replica 0 starts, or in its
    # first collective, and never once the caller has begun to run the others.
    latch: list[_Latch] = []
    stolen: list[int] = []  # replicas the caller claimed, and those it has counted down
    counted: set[int] = set()
    types = {d.type for d in devices}
    cuda_sync = _CudaSync(devices) if "cuda" in types else None
    workers: list[_Worker] = []
    # Whoever acquires replica i's claim runs it: its worker, or the caller.
    claims = [threading.Lock() for _ in range(n)]
    submitted_at: list[float] = []

    def make_task(i: int) -> Callable[..., None]:
        context = _replica.ReplicaContext(axis_name, i, n, devices[i], group)

        def task(*, inline: bool = False) -> None:
            global _wake_seconds
            if i > 0 and not inline:
                if not claims[i].acquire(blocking=False):
                    return  # the caller ran it
                # Capped: time queued behind other calls' replicas is not a wake-up, and an
                # estimate stuck high would keep large replicas inline (no new samples come then).
                waited = min(time.perf_counter() - submitted_at[0], _MAX_WAKE_SECONDS)
                _wake_seconds = 0.9 * _wake_seconds + 0.1 * waited
            worker = workers[i - 1] if i > 0 and not inline else None
            if group.done:
                return  # the caller stopped waiting for this call (see _retire): nothing to run for
            try:
                if worker is not None and worker.init_error is not None:
                    raise RuntimeError(
                        f"the worker thread for {worker.device} could not start"
                    ) from worker.init_error
                # Replica 0 runs in the caller's thread, which already has the caller's state;
                # a replica run inline enters it again, in case replica 0 changed it.
                with (
                    _replica.entered(context),
                    _thread_state.applied(state, again=inline) if i > 0 else _NULL_CONTEXT,
                    # The replica's global index: across processes, each replica draws its own.
                    _random.replica_scope(rng_seed, group.offset + i),
                ):
                    # Replica 0 runs in the caller's own context; the others each in a copy
                    # of it as it was at the call (see _thread_state.ThreadState.context).
                    run = replicas[i] if i == 0 else functools.partial(state.context.copy().run, replicas[i])
                    if cuda_sync is not None:
                        with cuda_sync.running(i, worker, inputs[i] if inputs is not None else ()):
                            results[i] = run()
                    else:
                        results[i] = run()
            except BaseException as error:  # noqa: BLE001 - every failure goes to the caller
                errors[i] = error
                group.abort(i, error)
            finally:
                group.finish(i)
                if i > 0:
                    if latch:
                        latch[0].count_down()
                    counted.add(i)

        return task

    tasks = [make_task(i) for i in range(n)]

    gave_up: list[BaseException] = []  # the interrupt that ended the wait

    def give_up(again: BaseException) -> None:
        """The caller, interrupted again, stops waiting for the replicas handed to workers: one
        still running (blocked in user code, say) may never return. Their workers are retired
        (see :func:`_retire`), so that later calls get new ones rather than queue behind them
        and wait forever, silently."""
        gave_up.append(again)
        group.abort(0, again)
        # Only replicas handed to workers (all of them, if any), not those the caller ran.
        running = [i for i in range(1, n) if i not in counted and i not in stolen] if latch else []
        if not running:
            return
        _retire([workers[i - 1] for i in running])
        _note(
            again,
            caller,
            "interrupted again: stopped waiting for "
            + ", ".join(f"replica {i} (device {devices[i]})" for i in running)
            + ", which had not returned; the worker threads running them were replaced, and "
            "they end in the background if they ever return",
        )

    def wait_for_workers(*, interrupted: bool) -> None:
        """Waits for the replicas handed to workers; once the caller has been interrupted,
        another interrupt ends the wait (:func:`give_up`)."""
        if not latch:
            return
        if not interrupted:
            latch[0].wait()
            return
        try:
            # The replicas that no worker has started never start now (the call is over), and
            # no one else counts them down: nor those that the hand-over never queued, which an
            # interrupt between two of its puts left unqueued, and which the wait below would
            # otherwise wait for forever.
            for i in range(1, n):
                if i not in counted and claims[i].acquire(blocking=False):
                    group.finish(i)
                    latch[0].count_down()
                    counted.add(i)
            latch[0].wait()
        except BaseException as again:
            give_up(again)
            raise

    def submit() -> None:
        with _SUBMIT_LOCK:
            found = _workers_for(devices)
            workers.extend(found)
            latch.append(_Latch(n - 1))
            submitted_at.append(time.perf_counter())
            for i in range(1, n):
                workers[i - 1].tasks.put(tasks[i])

    inline_ok = _may_run_inline(types == {"cpu"})
    if inline_ok and _is_small(timing, n):

        def hand_over() -> None:  # replica 0 entered a collective: the others must run now
            try:
                submit()
            except BaseException as error:
                group.abort(0, error)  # a retried collective fails instead of waiting forever
                raise

        group.before_wait = hand_over
    else:
        try:
            submit()
        except BaseException as error:
            # Nothing runs replica 0 now: release whatever was queued, which would wait for it.
            group.abort(0, error)
            group.finish(0)
            group.done = True
            raise
    try:
        start = time.perf_counter()
        tasks[0]()
        if timing is not None:
            timing.record(time.perf_counter() - start)
        # Not handed over (inline, or the hand-over failed): nobody else will run them.
        take_all = not submitted_at
        if take_all or (inline_ok and group.exchanges(0) == 0):
            group.before_wait = None
            for i in range(1, n):
                if group.failed is not None:
                    break  # the call has failed: the caller runs nothing more
                if claims[i].acquire(blocking=False):
                    stolen.append(i)
                    tasks[i](inline=True)
        # An interrupt that landed in a replica the caller ran (replica 0 waiting in a
        # collective, say) was the first: the next one ends the wait.
        wait_for_workers(
            interrupted=isinstance(errors[0], _INTERRUPTS)
            or any(isinstance(errors[i], _INTERRUPTS) for i in stolen)
        )
    except BaseException as interrupt:  # KeyboardInterrupt while waiting
        if gave_up:
            raise  # the caller has stopped waiting
        try:
            group.abort(0, interrupt)
            for i in stolen:  # interrupted around a replica the caller ran: no one else counts it
                if i not in counted:
                    group.finish(i)
                    if latch:
                        latch[0].count_down()
            wait_for_workers(interrupted=True)  # the replicas that never ran were never handed over
        except BaseException as again:
            if not gave_up:  # interrupted again on the way to the wait
                give_up(again)
            raise
        for i, failure in enumerate(errors):
            if (
                failure is not None
                and failure is not interrupt
                and not isinstance(failure, _replica.ReplicaAborted)
            ):
                _note(
                    interrupt,
                    caller,
                    f"replica {i} (device {devices[i]}) had failed: "
                    f"{type(failure).__name__}: {_replica.error_text(failure)}",
                )
        raise
    finally:
        group.done = True
        if cuda_sync is not None:
            cuda_sync.finish(results, workers)
    if any(e is not None for e in errors):
        if group.failed is not None and all(
            e is None or isinstance(e, _replica.ReplicaAborted) for e in errors
        ):
            # Only aborted replicas: the failure that aborted them (a failed hand-over) is the news.
            errors[group.failed_index or 0] = group.failed
        failure = _reported_failure(errors, devices, caller, group)
        # Every replica has returned: the call's own references to its failures go. Its
        # traceback holds this frame and each replica's task, whose lists and call group held
        # it: a cycle that only the garbage collector frees, and with it the frames' tensors
        # (the replicas' activations), long after the caller lets the error go (a retry after
        # running out of memory finds the memory still taken).
        errors[:] = [None] * n
        group.forget_failure()
        try:
            raise failure
        finally:
            del failure
    return results


# What a signal raises in the caller's thread: Ctrl-C's KeyboardInterrupt, or the SystemExit of
# a SIGTERM handler that calls sys.exit (torchrun stops its workers with SIGTERM).
_INTERRUPTS = (KeyboardInterrupt, SystemExit)


def _is_small(timing: Timing | None, n: int) -> bool:
    """Whether running ``n - 1`` replicas of this function one after another takes less time
    than waking a worker (see :func:`run_replicas`)."""
    return timing is not None and timing.seconds is not None and timing.seconds * (n - 1) < _wake_seconds


def _run_in_caller(
    devices: tuple[torch.device, ...],
    replicas: Sequence[Callable[[], Any]],
    *,
    caller: str,
    timing: Timing,
) -> list[Any]:
    """Small CPU replicas without an axis name, one after another in the caller's thread.

    No collective can name their axis, so none waits for another: this is what
    :func:`run_replicas` does for them, without the call group, claims and latch that replicas
    handed to workers need (tens of microseconds on a call that may take a hundred).
    """
    n = len(replicas)
    rng_seed = _random.call_seed()
    state = _thread_state.capture()
    results = []
    for i, replica in enumerate(replicas):
        start = time.perf_counter()
        previous = _replica.swap_current(_replica.ReplicaContext(None, i, n, devices[i], _NO_COLLECTIVES))
        try:
            # Every replica but the first enters the caller's state again, in case the one
            # before changed it, as a worker would.
            with (
                _thread_state.applied(state, again=True) if i else _NULL_CONTEXT,
                _random.replica_scope(rng_seed, i),
            ):
                results.append(state.context.copy().run(replica) if i else replica())
        except BaseException as error:
            errors: list[BaseException | None] = [None] * n
            errors[i] = error
            _reported_failure(errors, devices, caller, _NO_COLLECTIVES)  # notes on the error
            errors[i] = None  # (this frame is in its traceback: see run_replicas)
            raise
        finally:
            _replica.swap_current(previous)
            if not i:  # replica 0's whole run, failed or not, as run_replicas times it
                timing.record(time.perf_counter() - start)
    return results


def _reported_failure(
    errors: Sequence[BaseException | None],
    devices: Sequence[torch.device],
    caller: str,
    group: _replica.CallGroup,
) -> BaseException:
    """The call's primary failure (see :func:`_primary_error`), told to the other processes."""
    failure = _primary_error(errors, devices, caller)
    if group.distributed:
        _distributed.record_call_failure(failure)  # other processes stop waiting for this one
    return failure


def _call_group(
    n: int, devices: tuple[torch.device, ...], axis_name: Hashable | None, caller: str
) -> _replica.CallGroup:
    """The replicas' shared state; with an axis name under fdp.distributed, placed among every
    process's replicas (``caller``: the pmapped function, which every process must be calling)."""
    group = _replica.CallGroup(n, devices)
    if axis_name is not None:
        if _distributed.joined():
            # The axis spans every process: one exchange of replica counts places this one's.
            group.offset, group.global_size, group.counts = _distributed.global_layout(n, caller, group)
            group.distributed = True
        elif not _distributed.WARNED_UNJOINED:
            _distributed.warn_if_group_unjoined(caller, axis_name)
    return group


def _in_turn(group: _replica.CallGroup, index: int, replica: Callable[[], Any]) -> Any:
    """``replica()`` in replica ``index``'s turns (see :class:`fdp._replica.Turnstile`)."""
    assert group.turnstile is not None
    group.turnstile.enter(index, group)
    try:
        return replica()
    except BaseException as error:
        # Before the turn passes on: the next replica must find the call failed, not run (and
        # perhaps compile) its part of a call that is over.
        group.abort(index, error)
        raise
    finally:
        group.turnstile.leave(index)


class LoneReplica:
    """Runs the only replica of a call on ``device``, in the caller's thread.

    There is nothing to hand over or wait for: this is :func:`run_replicas` for one replica,
    prepared once (per pmapped function) so that a call runs as little code as possible. A step
    of a millisecond notices every microsecond, and right after a step's kernels have evicted
    this code from the caches each line costs several times its warm cost.
    """

    __slots__ = ("device", "axis_name", "caller", "_plain", "_context")

    def __init__(self, device: torch.device, *, axis_name: Hashable | None, caller: str) -> None:
        self.device = device
        self.axis_name = axis_name
        self.caller = caller
        self._plain = device == _devices.CPU  # no device to make current
        # Without an axis name no collective can reach the replica: it needs no call group of
        # its own (one is built per call otherwise), and one context serves every call.
        self._context = (
            _replica.ReplicaContext(None, 0, 1, device, _NO_COLLECTIVES) if axis_name is None else None
        )

    def __call__(self, replica: Callable[..., Any], *args: Any) -> Any:
        """``replica(*args)`` as the only replica."""
        rng_seed = _random.call_seed()
        context = self._context
        group = None
        if context is None:
            # Before the group: under fdp.distributed, making one talks to the other processes.
            ensure_not_in_replica(self.caller)
            group = _call_group(1, (self.device,), self.axis_name, self.caller)
            context = _replica.ReplicaContext(self.axis_name, 0, 1, self.device, group)
        previous = _replica.swap_current(context)
        if previous is not None:  # called inside a replica: refused (one thread-local read)
            _replica.swap_current(previous)
            ensure_not_in_replica(self.caller)
        try:
            if rng_seed is None and self._plain:
                return replica(*args)
            with (
                _random.replica_scope(rng_seed, context.group.offset),
                torch.cuda.device(self.device) if self.device.type == "cuda" else _NULL_CONTEXT,
            ):
                return replica(*args)
        except BaseException as error:
            if group is not None:
                group.abort(0, error)
            _reported_failure([error], (self.device,), self.caller, context.group)  # notes on the error
            if group is not None:
                group.forget_failure()  # (this frame is in its traceback: see run_replicas)
            raise
        finally:
            _replica.swap_current(previous)
            if group is not None:
                group.finish(0)
                group.done = True


# The group of lone replicas without an axis name, which no collective can name: never changed
# (its devices are left empty: it belongs to no one device).
_NO_COLLECTIVES = _replica.CallGroup(1, ())
