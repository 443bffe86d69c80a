"""Beyond one process: the mapped axis across processes and nodes, on ``torch.distributed``.

After :func:`initialize` (from the environment ``torchrun`` sets), the axis of every pmapped call
with an ``axis_name`` spans the replicas of every process: process ``p`` runs its local replicas
as always (threads), their global indices start at the sum of the replica counts of processes
``0..p-1``, and every collective first combines the local replicas (as in one process) and then
the processes, with one process-group call per collective.

Process-group calls are issued by one thread per process, the :class:`_Communicator`, in the
order the collectives are reached, which is the same on every process (SPMD): ranks cannot
deadlock on ordering. While it waits, it watches the store for failures that other ranks record
(:func:`record_failure`), so a rank that raises makes the others fail within seconds with an
error naming it, instead of waiting for the process group's timeout.

Across processes, the autograd graph cannot span the replicas: each process-level step is an
autograd function whose backward is the transposed process-level collective, run by every
rank's backward in the same order (as DDP's all-reduce hooks are).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import enum
import hashlib
import importlib
import json
import math
import numbers
import os
import queue
import re
import struct
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _unflatten_dense_tensors

from . import _scatter, _split, _thread_state, _tree
from ._state import PerReplica

__all__ = [
    "initialize",
    "shutdown",
    "is_initialized",
    "rank",
    "world_size",
    "is_main_process",
    "local_devices",
    "shard_batch",
    "record_failure",
]

_FAILURE_PREFIX = "fdp/failure/"
_LEFT_PREFIX = "fdp/left/"
_POLL = datetime.timedelta(seconds=0.5)
# The descriptor that every process-level collective is checked with (see _agree): 8 bytes of
# payload (a replica count), then the description's text.
_CHECK_BYTES = 256


# A tree whose tensors are replaced by others of the same structure (broadcast, shard_batch).
_Tree = TypeVar("_Tree")


class Layout(NamedTuple):
    """What a collective of a tree packed into the tensor that the processes combine, for them to
    compare: ``signature``, a digest of the tree's structure and of every leaf's dtype and shape
    (equal in processes that passed trees alike: the packed tensors alone may agree in size where
    the trees do not), and ``describe()``, the same spelled out for a message: the structure, and
    every leaf's key path and ``dtype[shape]``."""

    signature: str
    describe: Callable[[], tuple[str, list[tuple[str, str]]]]


# The signatures of the layouts of trees that processes compared: spelling a tree's layout out
# costs ~1 ms for 100 leaves, finding it here ~10 µs.
_SIGNATURES: dict[tuple[Any, tuple[Any, ...]], str] = {}


def layout_of(tree: Any, treespec: Any, leaves: Sequence[Any], root: str = "x") -> Layout:
    """The :class:`Layout` of ``tree``, which flattens (``_tree.flatten``) to ``treespec`` and
    to ``leaves`` (its leaves, or what they become): tensors by dtype and shape, other leaves
    by type. ``root``: what messages call the tree in key paths."""
    key = (
        treespec,
        tuple(
            (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__qualname__ for t in leaves
        ),
    )
    try:
        signature = _SIGNATURES.get(key)
    except TypeError:  # a custom node whose metadata cannot be hashed: computed each time
        signature = None
    if signature is None:
        # From the leaves' path entries (each node's type and the key taken), spelled alike in
        # every process for the same tree: not as their repr, which names a class by its module
        # (__main__ in one process, __mp_main__ in a spawned one) and may show an address (a
        # custom node's entry objects), and which tells apart keys that are one dict key (1,
        # 1.0, True): the cache above keeps one signature for all of them.
        paths = [tuple(map(_entry_text, accessor)) for accessor in treespec.accessors()]
        spelled = repr((paths, key[1])).encode()
        signature = hashlib.blake2b(spelled, digest_size=8).hexdigest()
        if len(_SIGNATURES) >= 256:
            _SIGNATURES.clear()
        with contextlib.suppress(TypeError):
            _SIGNATURES[key] = signature

    def describe() -> tuple[str, list[tuple[str, str]]]:
        paths = _tree.flatten_with_paths(tree, root)[0]
        return str(treespec), [(path, _tree.describe(leaf)) for path, leaf in zip(paths, leaves)]

    return Layout(signature, describe)


def _entry_text(entry: Any) -> str:
    """A path entry of :func:`layout_of`'s tree, spelled the same in every process."""
    return f"{type(entry).__name__}:{entry.type.__qualname__}:{_key_text(entry.entry)}"


def _key_text(key: Any) -> str:
    """A dict key (or a node's entry), spelled the same in every process, and alike for keys
    that are one dict key."""
    if isinstance(key, str):
        return str.__repr__(key)  # (a StrEnum's member is the key its value is)
    if isinstance(key, bytes) or key is None:
        return repr(key)
    if isinstance(key, numbers.Number):
        # 1, 1.0, True and NumPy's 1 are one key.
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            if key == int(key):  # type: ignore[call-overload]
                return str(int(key))  # type: ignore[call-overload]
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            return repr(float(key))  # type: ignore[arg-type]
        return repr(key)
    if isinstance(key, tuple):
        return "(" + ", ".join(map(_key_text, key)) + ")"
    if isinstance(key, enum.Enum):
        return f"{type(key).__qualname__}.{key.name}"
    return type(key).__qualname__  # its repr may show its address, different in each process


class RankFailed(RuntimeError):
    """Another rank failed: raised on the ranks that were waiting for it.

    Its message names the rank that failed, what this rank was waiting in, and the failed rank's
    exception, e.g. ``fdp.distributed: rank 1 failed during fdp.psum (an all_reduce (sum)):
    ValueError: ...``. A subclass of ``RuntimeError``.

    Examples:
        >>> import fdp
        >>> issubclass(fdp.distributed.RankFailed, RuntimeError)
        True
    """


@dataclass
class _State:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    store: Any
    timeout: datetime.timedelta
    communicator: _Communicator
    owns_group: bool
    group: Any  # the default process group joined: one the user destroys is noticed
    attempt: int  # torchrun's restart count: failures recorded by earlier attempts are not news
    # The pmapped calls that spanned the processes so far, the current one included: the same
    # on every rank, as their calls are (SPMD). Failure records name the call they belong to.
    calls: int = 0
    # The last of them that failed on this rank (0: none), and the current one's function (as
    # messages name it): the next call's exchange compares whether the last one failed.
    failed: int = 0
    caller: str = ""
    # The call that spans the processes now: its thread, and a weak reference to its replicas'
    # call group, which is ``done`` once they have all returned (weak: the group holds the
    # call's replicas and their arguments).
    running: tuple[threading.Thread, weakref.ref[Any]] | None = None
    # Set in a process forked from this rank (see _mark_forked_child): not a member of the group.
    forked: bool = False


_STATE: _State | None = None
# How many times initialize() has joined a group in this process (see initialize).
_SESSIONS = [0]
# Held while a pmapped call checks that no other thread's call spans the processes, and notes
# itself (see global_layout).
_STARTING = threading.Lock()


class _Communicator:
    """The one thread of this process that issues process-group calls."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="fdp-communicator", daemon=True)
        # Set at exit: a collective still waited for (its caller was interrupted) stops waiting.
        self.exiting = False
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            work, box, done = item
            del item
            try:
                box.append((True, work()))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                box.append((False, error))
            finally:
                # Dropped before the caller is let go: left in this frame while it waits for
                # the next task, they would hold the last collective's tensors (its packed
                # gradients, what it returned, a failure's traceback) until then, or for good
                # after the last one.
                del work, box
                done.set()

    def call(self, work: Callable[[], Any], device: torch.device | None = None) -> Any:
        """Runs ``work`` on this thread and returns what it did; on ``device``'s tensors, with the
        calling thread's current stream for that device as this thread's.

        NCCL (and gloo, for CUDA tensors) orders a collective after the work queued on the
        issuing thread's current stream, and ``wait()`` orders that stream's later work after
        it. That stream must be the calling replica's, which computed the tensor and reads the
        result: this thread's own default stream would leave both unordered.
        """
        if device is not None and device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            unordered = work

            def work() -> Any:
                with torch.cuda.stream(stream):
                    return unordered()

        # (After the exit has stopped the thread, a later atexit hook's calls run in place.)
        if threading.current_thread() is self._thread or self.exiting:
            return work()
        box: list[Any] = []
        done = threading.Event()
        self._tasks.put((work, box, done))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self, timeout: float = 10.0) -> None:
        self._tasks.put(None)
        self._thread.join(timeout)


def _stop_communicator_at_exit() -> None:
    """At exit: the communicator stops before the interpreter shuts down.

    A caller interrupted in a collective (Ctrl-C) leaves the communicator waiting in it, waking
    every ``_POLL``. A daemon thread that takes the GIL during shutdown is killed on the spot,
    inside C++ code here, and the process aborts ("terminate called without an active
    exception"). (NCCL's waits cannot be cut short: the exit waits 2 s at most for them.)
    """
    state = _STATE
    if state is not None:
        state.communicator.exiting = True
        state.communicator.close(timeout=2.0)


atexit.register(_stop_communicator_at_exit)


def _mark_forked_child() -> None:
    """In a child forked from an initialized rank (``os.fork``, a DataLoader or multiprocessing
    worker started with "fork"): the child is no member of the group.

    Fork copies only the forking thread: the communicator and the process group's threads are
    gone in the child. Its pmapped calls with an axis name would queue for the communicator and
    wait forever, and what it recorded in the store (an uncaught exception, a shutdown) would
    speak for its parent's rank, failing the other ranks' calls.
    """
    global _INHERITED_GROUP
    if _STATE is not None:
        _STATE.forked = True
    if dist.is_available() and dist.is_initialized():
        _INHERITED_GROUP = dist.group.WORLD


# The default process group a forked child inherited from its parent (see initialize): the
# parent's, which the child cannot use, after its shutdown() too.
_INHERITED_GROUP: Any = None

os.register_at_fork(after_in_child=_mark_forked_child)


def _state() -> _State:
    if _STATE is None:
        raise RuntimeError("fdp.distributed is not initialized: call fdp.distributed.initialize() first")
    return _STATE


def _group_alive(state: _State) -> bool:
    """Whether the process group that :func:`initialize` joined is still the default one."""
    return not state.forked and state.group is not None and dist.group.WORLD is state.group


def _live_state() -> _State:
    """The state, for work that talks to the other processes: refused, with a message saying
    why, once the process group was destroyed behind fdp's back."""
    state = _state()
    if state.forked:
        raise RuntimeError(
            f"fdp.distributed: this process was forked from rank {state.rank} after "
            "fdp.distributed.initialize() (os.fork, or a DataLoader or multiprocessing worker "
            "started with 'fork'): it is not a member of the process group, whose threads fork "
            "does not copy, so pmapped calls with an axis name cannot span the processes here. "
            "Make them in the ranks themselves; to run them on this process's replicas alone, "
            "call fdp.distributed.shutdown() in it first (which leaves the parent's group alone)."
        )
    if not _group_alive(state):
        raise RuntimeError(
            "fdp.distributed: the process group that fdp.distributed.initialize() joined no longer "
            "exists (torch.distributed.destroy_process_group() was called, or the group was "
            "replaced): pmapped calls with an axis_name cannot span the processes. Leave with "
            "fdp.distributed.shutdown() instead (it destroys the group it created), or call "
            "fdp.distributed.initialize() again to join a new group."
        )
    return state


# Whether warn_if_group_unjoined has warned (once per process), or found that it never will.
WARNED_UNJOINED = False
_DIST_AVAILABLE = dist.is_available()  # (a torch built without it has no process groups)


def warn_if_group_unjoined(caller: str, axis_name: Any) -> None:
    """Warns, once, where a pmapped call with an axis name runs in a process of a
    ``torch.distributed`` group of several processes that never called :func:`initialize`: a
    script from DDP that keeps its ``init_process_group`` and ``DistributedSampler``, and
    forgets ``initialize``, trains a model of its own in each process, on its own examples,
    with no error."""
    global WARNED_UNJOINED
    if _SESSIONS[0] or _INHERITED_GROUP is not None:
        # fdp.distributed was used here (calls after shutdown() span this process alone, as
        # documented), or this is a forked child of a rank: nothing to warn about, ever.
        WARNED_UNJOINED = True
        return
    if not (_DIST_AVAILABLE and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    WARNED_UNJOINED = True
    warnings.warn(
        f"{caller}: a torch.distributed process group of {dist.get_world_size()} processes "
        f"exists, but fdp.distributed.initialize() was not called in this process, so the axis "
        f"{axis_name!r} spans this process's replicas only: each process trains a model of its "
        "own, its collectives combining its own replicas. Call fdp.distributed.initialize() "
        "(after init_process_group, it joins that group) for the axis to span every process.",
        stacklevel=_tree.stacklevel_outside_fdp(),  # (the user's call, not fdp's line)
    )


def joined() -> bool:
    """Whether pmapped calls with an axis name span the processes: :func:`initialize` has run
    and :func:`shutdown` has not (their collectives fail, saying so, if the group was
    destroyed meanwhile)."""
    return _STATE is not None


def is_initialized() -> bool:
    """Whether :func:`initialize` has run in this process, :func:`shutdown` has not, and the
    process group it joined still exists (``torch.distributed.destroy_process_group()`` ends
    it: call :func:`shutdown` instead, or :func:`initialize` again).

    Examples:
        >>> import fdp
        >>> fdp.distributed.is_initialized()  # a plain process, not launched by torchrun
        False
    """
    return _STATE is not None and _group_alive(_STATE)


def rank() -> int:
    """This process's rank (0 without :func:`initialize`).

    Examples:
        >>> import fdp
        >>> fdp.distributed.rank()  # without initialize(): the only process
        0
    """
    return _STATE.rank if _STATE is not None else 0


def world_size() -> int:
    """The number of processes (1 without :func:`initialize`).

    Examples:
        >>> import fdp
        >>> fdp.distributed.world_size()  # without initialize(): this process alone
        1
    """
    return _STATE.world_size if _STATE is not None else 1


def is_main_process() -> bool:
    """True on rank 0 (and without :func:`initialize`): where to log, show progress, write files.

    Examples:
        >>> import fdp
        >>> fdp.distributed.is_main_process()  # without initialize(): rank 0
        True
    """
    return rank() == 0


def local_devices() -> list[torch.device]:
    """This process's default devices.

    After :func:`initialize`: its one GPU (``cuda:LOCAL_RANK``, modulo the GPUs visible), or the
    CPU on a machine without CUDA. Without it: every visible GPU, or the CPU without CUDA.

    Examples:
        >>> import torch, fdp
        >>> gpus = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        >>> fdp.distributed.local_devices() == (gpus or [torch.device("cpu")])  # without initialize()
        True
    """
    if _STATE is not None:
        if torch.cuda.is_available():
            return [torch.device("cuda", _STATE.local_rank % torch.cuda.device_count())]
        return [torch.device("cpu")]
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(
                f"fdp.distributed.initialize: the environment variable {name} is not set; launch "
                "with torchrun (e.g. torchrun --standalone --nproc-per-node=2 train.py) or pass "
                "rank, world_size and store"
            )
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"fdp.distributed.initialize: the environment variable {name} must be an integer, but "
            f"it is {value!r}"
        ) from None


def initialize(
    *,
    backend: str | None = None,
    timeout: datetime.timedelta | float = 300.0,
    rank: int | None = None,
    world_size: int | None = None,
    store: Any = None,
) -> None:
    """Joins the process group that ``torchrun`` describes in the environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by
    ``torchrun``, single- and multi-node), creates the rendezvous store and the process group
    (NCCL for CUDA tensors where CUDA is available, gloo for the rest), pins this process to
    ``cuda:LOCAL_RANK`` on GPUs, and starts the thread that issues process-group calls. From then
    on, pmapped calls with an ``axis_name`` span the replicas of every process. If a process group
    already exists, it is used as it is.

    Args:
        backend: a ``torch.distributed`` backend: ``"gloo"``, or one per device type
            (``"cpu:gloo,cuda:nccl"``); ``"nccl"`` is taken as ``"cpu:gloo,cuda:nccl"``, as fdp
            exchanges replica counts and weights as CPU tensors. Keyword-only. Default: ``None``,
            ``"cpu:gloo,cuda:nccl"`` where CUDA and NCCL are available (CPU replicas work on GPU
            machines too), else ``"gloo"``.
        timeout: how long a collective may wait for other ranks (seconds or a timedelta).
            Keyword-only. Default: ``300.0``.
        rank: this process's rank. Keyword-only. Default: ``None``, the existing group's, else from
            ``RANK``.
        world_size: the number of processes. Keyword-only. Default: ``None``, the existing group's,
            else from ``WORLD_SIZE``.
        store: a ``torch.distributed`` store (tests pass a ``FileStore``). Keyword-only. Default:
            ``None``, the existing group's store, else a ``TCPStore`` at
            ``MASTER_ADDR:MASTER_PORT``.

    Raises:
        RuntimeError: when ``RANK``, ``WORLD_SIZE`` (or, without ``store``, ``MASTER_PORT``) is
            not set and not passed, as in a process not launched by ``torchrun``; or when
            :func:`initialize` was already called in this process (without :func:`shutdown`); or
            in a process forked from a member of a process group, whose group is its parent's.
        TypeError: ``timeout`` is no number or timedelta, or ``rank`` or ``world_size`` (or the
            environment variable it came from) is no int.
        ValueError: ``timeout`` is not positive, ``world_size`` is not positive, or ``rank`` is
            not from 0 to ``world_size - 1``.

    Examples:
        >>> import fdp
        >>> fdp.distributed.is_initialized(), fdp.distributed.rank(), fdp.distributed.world_size()
        (False, 0, 1)

        Outside ``torchrun`` (nothing in the environment), it says how to launch:

        >>> import os
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, clear=True):  # as in a plain `python train.py`
        ...     fdp.distributed.initialize()
        Traceback (most recent call last):
            ...
        RuntimeError: fdp.distributed.initialize: the environment variable RANK is not set; launch ...
        >>> fdp.distributed.is_initialized()
        False
    """
    global _STATE
    if _INHERITED_GROUP is not None and dist.is_initialized() and dist.group.WORLD is _INHERITED_GROUP:
        raise RuntimeError(
            "fdp.distributed.initialize: this process was forked (os.fork, or a DataLoader or "
            "multiprocessing worker started with 'fork') from a process in a torch.distributed "
            "process group, and the group it would join is its parent's, whose threads fork does "
            "not copy: it would wait forever, or speak for its parent's rank. Call initialize() "
            "in processes started by torchrun (or with multiprocessing's 'spawn' start method)."
        )
    if _STATE is not None:
        if _group_alive(_STATE):
            raise RuntimeError("fdp.distributed.initialize was already called in this process")
        shutdown()  # its group was destroyed behind fdp's back: start again
    timeout = _checked_timeout(timeout)
    owns_group = not dist.is_initialized()
    if owns_group:
        # (torch's own checks name neither the call nor where the value came from.)
        env = "the environment variable "
        named = (
            "rank" if rank is not None else env + "RANK",
            "world_size" if world_size is not None else env + "WORLD_SIZE",
        )
        rank = _env_int("RANK") if rank is None else rank
        world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
        rank, world_size = _checked_ranks(rank, world_size, *named)
    else:
        rank, world_size = _existing_group_ranks(rank, world_size)
    local_rank = _env_int("LOCAL_RANK", rank)
    given_backend = backend
    if backend is None:
        cuda = torch.cuda.is_available() and dist.is_nccl_available()
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    elif backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"
    if "nccl" in backend:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not gpus:
            raise RuntimeError(
                f"fdp.distributed.initialize(backend={given_backend!r}): NCCL needs CUDA GPUs, but "
                "this process sees none (torch.cuda.is_available() is False). Use "
                "backend='gloo' (or leave backend=None, which picks gloo without CUDA) and CPU "
                "replicas."
            )
        torch.cuda.set_device(local_rank % gpus)
    # torchrun's agent keeps its store across restarts (--max-restarts): what attempt 0 left
    # there (its failure records, gloo's addresses) must not reach attempt 1.
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if store is None:
        store = _rendezvous_store(rank, world_size, timeout, attempt, owns_group)
    # Each session of this process (initialize after shutdown, or after the group was destroyed)
    # keeps its keys apart from the last one's, in the same store: torch names the new default
    # group as it named the last ("0/"), so that gloo's rendezvous would find the last session's
    # addresses there and connect to ports that are closed ("Connect timeout", "Connection
    # refused", or a hang); and the last session's failure records and shutdown notes are not
    # news to this one's calls, which count from 0 again. Every rank counts its sessions alike,
    # as it counts its pmapped calls.
    store = dist.PrefixStore(f"fdp/session_{_SESSIONS[0]}", store)
    if owns_group:
        _import_group_defaults()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        backend = str(dist.get_backend())  # what the group runs, for _polls
    _SESSIONS[0] += 1
    _STATE = _State(
        rank,
        world_size,
        local_rank,
        backend,
        store,
        timeout,
        _Communicator(),
        owns_group,
        dist.group.WORLD,
        attempt,
    )
    previous_hook = sys.excepthook

    def record_uncaught(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        record_failure(error)
        previous_hook(kind, error, trace)

    sys.excepthook = record_uncaught


def _checked_timeout(timeout: Any) -> datetime.timedelta:
    """``initialize``'s ``timeout`` as a timedelta: a positive, finite number of seconds."""
    caller = "fdp.distributed.initialize"
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"{caller}: timeout must be a number of seconds or a datetime.timedelta, got "
            f"{type(timeout).__name__}: {_tree.short_repr(timeout)}"
        )
    # (gloo refuses a negative one in its own words; 0 would fail every collective at once.)
    if not (0 < seconds < math.inf):
        raise ValueError(
            f"{caller}: timeout must be positive and finite (how long a collective may wait for "
            f"the other ranks, in seconds), got {_tree.short_repr(timeout)}"
        )
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=seconds)


def _checked_ranks(rank: Any, world_size: Any, rank_name: str, size_name: str) -> tuple[int, int]:
    """``rank`` and ``world_size`` as ints; a ``TypeError`` or ``ValueError`` for values that are
    no rank or size, naming where each came from (an argument, or an environment variable)."""
    caller = "fdp.distributed.initialize"
    for name, value in ((size_name, world_size), (rank_name, rank)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{caller}: {name} must be an int, got {type(value).__name__}: {value!r}")
    rank, world_size = int(rank), int(world_size)
    if world_size < 1:
        raise ValueError(
            f"{caller}: {size_name} must be a positive int (the number of processes), got {world_size}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(
            f"{caller}: {rank_name} must be an int from 0 to {world_size - 1} ({size_name} is "
            f"{world_size}), got {rank}"
        )
    return rank, world_size


def _existing_group_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's rank and the world size in the process group that already exists."""
    actual = (dist.get_rank(), dist.get_world_size())
    given = (actual[0] if rank is None else rank, actual[1] if world_size is None else world_size)
    if given != actual:
        raise ValueError(
            f"fdp.distributed.initialize: rank={given[0]}, world_size={given[1]} were asked for, but "
            f"the existing process group has this process as rank {actual[0]} of {actual[1]}"
        )
    return actual


def _rendezvous_store(
    rank: int, world_size: int, timeout: datetime.timedelta, attempt: int, owns_group: bool
) -> Any:
    """The store fdp talks through: the existing group's, else a new ``TCPStore`` client (or
    server, on rank 0 when torchrun's agent hosts none) at ``MASTER_ADDR:MASTER_PORT``."""
    if not owns_group:
        # A second server on the group's port would fail (EADDRINUSE); fdp's keys ("fdp/...")
        # keep out of the group's own.
        with contextlib.suppress(Exception):  # a private torch function: connect if it is gone
            return dist.distributed_c10d._get_default_store()
    # As torch's own env:// rendezvous: under torchrun the agent may host the store.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        _env_int("MASTER_PORT"),
        world_size,
        is_master=rank == 0 and not agent_store and owns_group,
        timeout=timeout,
    )
    return dist.PrefixStore(f"fdp/attempt_{attempt}", store) if agent_store else store


def _import_group_defaults() -> None:
    """Imports ``torch.distributed.nn.functional`` while no process group exists.

    Its functions take ``group=group.WORLD`` as a default argument, evaluated once, at import:
    imported after ``init_process_group`` (``torch._dynamo`` imports it, and ``torch.func.grad``
    or ``torch.compile`` import ``torch._dynamo``), they hold the default group for the rest of
    the process. ``destroy_process_group`` then frees nothing: gloo's threads keep running until
    the interpreter exits and the group is torn down there, the likely cause of a rare abort of
    a rank that had finished ("terminate called without an active exception", exit code -6).
    Imported first, the defaults are ``None``.
    """
    with contextlib.suppress(ImportError):
        importlib.import_module("torch.distributed.nn.functional")


def shutdown() -> None:
    """Leaves the process group (if :func:`initialize` created it) and stops the communicator.

    Does nothing when :func:`initialize` has not run (or :func:`shutdown` already did), so it
    can be called unconditionally at the end of a program, or in a ``finally:`` block: an
    exception propagating through it is recorded for the other ranks (:func:`record_failure`),
    and a clean exit leaves a note, so that ranks still making pmapped calls with an axis name
    fail at once, naming this rank, instead of waiting for it until the timeout. Inside an
    ``except:`` block, the exception it handles counts as propagating (Python cannot tell the
    two apart): after an expected exception, call it once the block has ended.

    Examples:
        >>> import fdp
        >>> fdp.distributed.shutdown()  # not initialized: nothing to leave
        >>> fdp.distributed.is_initialized()
        False
    """
    global _STATE
    state = _STATE
    if state is None:
        return
    if state.forked:
        # A forked child (see _mark_forked_child) forgets its parent's group: nothing of it is
        # the child's to end (destroying gloo's group there hangs or aborts the child) or to
        # write to the store about.
        _STATE = None
        return
    # Called in a ``finally:`` block while an exception propagates, shutdown runs before
    # sys.excepthook, which would find fdp shut down and tell no one: the other ranks would
    # see only a lost connection. Record the exception here; a clean exit leaves a note instead,
    # so that ranks still making pmapped calls learn that this one has left, and after which.
    # (Python cannot tell a finally block from an except block that handles the exception: in
    # both, it is the one in flight. A generator closed early, or sys.exit(0), is a clean exit.)
    leaving = sys.exc_info()[1]
    if leaving is not None and not (
        isinstance(leaving, GeneratorExit) or (isinstance(leaving, SystemExit) and leaving.code in (None, 0))
    ):
        record_failure(leaving)
    else:
        with contextlib.suppress(Exception):  # the store may be gone already
            state.store.set(_left_key(state, state.rank), str(state.calls))
    _STATE = None
    state.communicator.close()
    destroy = state.owns_group and _group_alive(state)  # not a group made after the user destroyed it
    # Frames of failed collectives (in exceptions' tracebacks, cycles that only the garbage
    # collector frees) hold this state: through it they would keep the group, and its gloo
    # threads, past destroy_process_group, to a collection at interpreter exit. A gloo thread
    # that drops the last reference to a finished collective then takes the GIL of an
    # interpreter that is shutting down, and the process aborts ("terminate called without an
    # active exception"). Destroyed here, the group joins its threads now.
    state.group = None
    if destroy:
        dist.destroy_process_group()


# --- failures --------------------------------------------------------------------------------------
#
# A failure is recorded under the rank's key with the number of the pmapped call it belongs to
# (``_State.calls``, which every rank counts alike). A rank waiting in a collective of call ``c``
# takes a record of call ``c`` or later as news, and older ones as failures that every rank has
# left behind: ranks that all catch a failed call and go on are not failed by it later.


def record_failure(error: BaseException) -> None:
    """Tells the other ranks that this one failed, so their collectives stop waiting for it.

    fdp records failures of pmapped calls itself, and uncaught exceptions; call this for other
    failures you catch before exiting. The other ranks then raise :class:`RankFailed`, naming
    this rank and quoting ``error``. Does nothing when :func:`initialize` has not run, or when
    the store can no longer be reached.

    Args:
        error: the exception that stopped this rank; its type and message (as
            ``traceback.format_exception_only`` writes them) go into the other ranks'
            :class:`RankFailed`.

    Examples:
        >>> import fdp
        >>> try:
        ...     raise ValueError("no data left on this rank")
        ... except ValueError as error:
        ...     fdp.distributed.record_failure(error)  # not initialized: no other rank to tell
    """
    state = _STATE
    if state is not None:
        # Between calls: the ranks waiting in the current call's collectives (its backward)
        # or in the next call's need to know.
        _record(state, error, state.calls + 1)


def record_call_failure(error: BaseException) -> None:
    """Records the failure of the current pmapped call (past its exchange of replica counts):
    news to the ranks still waiting in this call's collectives, not to later calls."""
    state = _STATE
    if state is not None:
        state.failed = state.calls
        _record(state, error, state.calls)


def calls() -> int:
    """How many pmapped calls have spanned the processes (0 without :func:`initialize`)."""
    state = _STATE
    return 0 if state is None else state.calls


def call_failed(error: BaseException, began: int) -> None:
    """A pmapped call with an axis name, made when :func:`calls` was ``began``, failed here. If it
    got past its exchange of replica counts (it has a number of its own) and its failure is not
    recorded yet (one that came after its replicas returned: joining their outputs, say), it is
    recorded now: the next call's exchange compares whether the ranks' last calls failed."""
    state = _STATE
    if state is not None and state.calls != began and state.failed != state.calls:
        record_call_failure(error)


def skip_call(error: BaseException) -> None:
    """A pmapped call with an axis name failed here before its exchange of replica counts (an
    empty share of the batch, say). It counts as a call all the same, as on the ranks that
    reached that exchange, and they learn of the failure at once rather than at the timeout."""
    state = _STATE
    if state is not None:
        state.calls += 1
        state.failed = state.calls
        _record(state, error, state.calls)


def _failure_key(state: _State, rank: int) -> str:
    return f"{_FAILURE_PREFIX}{state.attempt}/{rank}"


def _left_key(state: _State, rank: int) -> str:
    """Where :func:`shutdown` notes after how many pmapped calls ``rank`` left."""
    return f"{_LEFT_PREFIX}{state.attempt}/{rank}"


def _record(state: _State, error: BaseException, call: int) -> None:
    if state.forked:
        return  # a forked child's failure is not its parent's rank's (see _mark_forked_child)
    message = "".join(traceback.format_exception_only(type(error), error)).strip()
    with contextlib.suppress(Exception):  # the store may be gone already: nothing more to tell
        state.store.set(_failure_key(state, state.rank), f"{call}\n{message}")


class _Record(NamedTuple):
    """What another rank left in the store: a recorded failure of its pmapped call ``call``
    (``kind`` ``"failure"``, with its ``message``), or its :func:`shutdown` after ``call``
    pmapped calls (``kind`` ``"left"``, no message)."""

    rank: int
    kind: str
    call: int
    message: str


def _records(state: _State) -> list[_Record]:
    """What the other ranks left in the store for this attempt. (Nothing, once the store is
    gone.)"""
    found: list[_Record] = []
    for other in range(state.world_size):
        if other == state.rank:
            continue
        try:
            left = _left_key(state, other)
            if (failure := _stored_failure(state, other)) is not None:
                found.append(_Record(other, "failure", *failure))
            if state.store.check([left]):
                found.append(_Record(other, "left", int(state.store.get(left).decode()), ""))
        except Exception:  # noqa: BLE001 - a store that is gone tells nothing
            return found
    return found


def _stored_failure(state: _State, rank: int) -> tuple[int, str] | None:
    """The failure that ``rank`` recorded (see :func:`_record`), as its call and message, if
    any; raises if the store is gone."""
    key = _failure_key(state, rank)
    if not state.store.check([key]):
        return None
    call, _, message = state.store.get(key).decode().partition("\n")
    return int(call), message


def _failed_rank(state: _State) -> _Record | None:
    """A rank that recorded a failure of the current call (or a later one), or that left
    (:func:`shutdown`) before the current call: its record."""
    for record in _records(state):
        if record.kind == "failure" and record.call >= state.calls:
            return record
        if record.kind == "left" and record.call < state.calls:
            return record
    return None


def _news(state: _State, record: _Record, what: str) -> str:
    """What a record says, after ``"rank N "``, to a rank waiting in ``what``."""
    if record.kind == "failure":
        return f"failed during {what}: {record.message}"
    call = record.call
    return (
        f"called fdp.distributed.shutdown() after {call} pmapped call{'s' if call != 1 else ''} "
        f"with an axis name, while this rank waits for it in {what} of pmapped call "
        f"#{state.calls}. Every process must make the same pmapped calls with an axis name (each "
        "spans every process): one made on some ranks only, such as an evaluation under `if "
        "fdp.distributed.is_main_process():`, waits for ranks that will not come"
    )


def _last_words(state: _State, what: str, ranks: Sequence[int] | None = None) -> str:
    """What the other ranks (or ``ranks``) left in the store, for a message about a rank that is
    gone or late: a failure, of this call or an earlier one (the ranks are then out of step),
    or its shutdown. Empty when they left nothing."""
    said = []
    for record in _records(state):
        if ranks is not None and record.rank not in ranks:
            continue
        if record.kind == "failure" and record.call < state.calls:
            said.append(
                f"Rank {record.rank} had failed in pmapped call #{record.call}, which this rank "
                "finished (a call that fails on some ranks only leaves the ranks out of step; "
                f"this rank is in pmapped call #{state.calls}): {record.message}"
            )
        else:
            said.append(f"Rank {record.rank} {_news(state, record, what)}")
    return "".join(f" {text}" if text.endswith(".") else f" {text}." for text in said)


def _polls(state: _State, device: torch.device) -> bool:
    """Whether work on ``device``'s tensors runs on gloo, whose work can be waited for in slices
    (to notice a failed rank between them); NCCL's cannot, and its watchdog keeps the timeout."""
    backend = state.backend
    if ":" in backend:  # one per device type, "cpu:gloo,cuda:nccl"
        backend = dict(part.split(":", 1) for part in backend.split(",")).get(device.type, "")
    return backend == "gloo"


def _wait(state: _State, work: Any, what: str, device: torch.device) -> None:
    """Waits for ``work`` on ``device``'s tensors, failing fast when another rank has recorded
    a failure or its connection is lost."""
    if not _polls(state, device):
        work.wait()
        return
    deadline = time.monotonic() + state.timeout.total_seconds()
    grace = True
    while True:
        try:
            work.wait(_POLL)
            return
        except RuntimeError as error:
            if work.is_completed():
                # Not a slice of waiting that ran out (unless the work finished just after it):
                # the work failed, and every later wait would say so again at once
                # ("Connection closed by peer" from a rank that died).
                try:
                    work.wait()
                except RuntimeError as failure:
                    _raise_failure(state, what, failure)
                    raise
                return
            failed = _failed_rank(state)
            if failed is not None:
                if _succeeded(work):  # it finished just now, before the other rank failed
                    return
                if grace and failed.kind == "failure" and failed.call > state.calls:
                    # A failure of a later call: that rank has left this one, perhaps done with
                    # this collective, whose work here completes a moment after its own (an
                    # empty share fails the next call before any exchange). One more slice.
                    grace = False
                    continue
                _raise_rank_failed(state, what, failed, error)
            if time.monotonic() > deadline:
                raise RankFailed(_timed_out(state, what)) from error
            if state.communicator.exiting:
                raise RankFailed(f"fdp.distributed: {what} abandoned: the interpreter is exiting") from error


def _succeeded(work: Any) -> bool:
    if not work.is_completed():
        return False
    try:
        work.wait()
    except RuntimeError:
        return False
    return True


def _timed_out(state: _State, what: str) -> str:
    return (
        f"fdp.distributed: {what} timed out after {state.timeout} on rank {state.rank}; another rank "
        "may be hung." + _last_words(state, what)
    )


def _raise_rank_failed(state: _State, what: str, failed: _Record, error: BaseException) -> None:
    raise RankFailed(f"fdp.distributed: rank {failed.rank} {_news(state, failed, what)}") from error


def _raise_if_rank_failed(state: _State, what: str, error: BaseException) -> None:
    failed = _failed_rank(state)
    if failed is not None:
        _raise_rank_failed(state, what, failed, error)


# How gloo reports a peer that went away, and where it was.
_LOST_PEER = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused", re.IGNORECASE)
_ADDRESS = re.compile(r"\[[^\]]*\]:\d+")


def _raise_failure(state: _State, what: str, error: BaseException) -> None:
    """Raises what a failed process-group call means for the user, if fdp knows: a rank that
    recorded its failure, one that went away without a word, or the group's timeout. (Other
    errors are the caller's to re-raise as they are.)"""
    _raise_if_rank_failed(state, what, error)
    text = str(error)
    if _LOST_PEER.search(text):
        peer = f"rank {1 - state.rank}" if state.world_size == 2 else "another rank"
        address = _ADDRESS.search(text)
        at = f" at {address.group(0)}" if address else ""
        # What the lost rank left in the store (with 2 ranks, the peer is known): an earlier
        # call's failure, or its shutdown after fewer pmapped calls than this rank makes.
        known = _last_words(state, what, [1 - state.rank] if state.world_size == 2 else None)
        raise RankFailed(
            f"fdp.distributed: rank {state.rank} lost its connection to {peer}{at} during {what}"
            + (
                f" (pmapped call #{state.calls}).{known}"
                if known
                else ": that process has probably died without recording a failure (killed, out "
                "of memory, os._exit); see its log."
            )
            + f" gloo: {text.splitlines()[0] if text else ''}"
        ) from error
    if "timed out" in text.lower():
        raise RankFailed(_timed_out(state, what)) from error


# --- checking that every process is at the same collective ---------------------------------------
#
# Before each process-level collective, the processes exchange what they are about to call (one
# all_gather of a fixed size, whatever the collective): the collective's name and options, the
# tensor's dtype and shape, and the number of the pmapped call. Where the entries differ, every
# rank raises the same ValueError before any of them starts a collective that would not match
# (a wrong result, a hang, or an abort in gloo). A small CPU tensor travels in the same exchange:
# its collective then needs no second one, and costs no more than without the check.


def _slot_bytes(world: int) -> int:
    """The room for a tensor in the exchange: 8 KiB between 2 processes, less with more (every
    process receives every other's)."""
    return min(8192, 65536 // world) // 16 * 16


def _describe_tensor(tensor: torch.Tensor, dims: slice = slice(None)) -> str:
    """``tensor``'s dtype and shape (its ``dims`` of it), as ``float32[2, 3]``."""
    return f"{str(tensor.dtype).removeprefix('torch.')}[{', '.join(str(n) for n in tensor.shape[dims])}]"


def _encode(entry: str, payload: int, data: torch.Tensor | None, slot: int) -> torch.Tensor:
    """``payload``, ``entry`` (a long one cut, its digest kept: the comparison still sees all of
    it) and ``data``'s bytes, if given, in a byte tensor of the exchange's fixed size."""
    text = entry.encode()
    room = _CHECK_BYTES - 8
    if len(text) > room:
        text = text[: room - 8] + hashlib.blake2b(text, digest_size=8).digest()
    raw = bytearray(_CHECK_BYTES + slot)
    struct.pack_into("<q", raw, 0, payload)
    raw[8 : 8 + len(text)] = text
    buffer = torch.frombuffer(raw, dtype=torch.uint8)
    if data is not None:
        flat = data.reshape(-1).view(torch.uint8)
        buffer[_CHECK_BYTES : _CHECK_BYTES + flat.numel()] = flat
    return buffer


def _decode(entry: bytes) -> list[str]:
    """The fields of an entry that :func:`_encode` wrote (after its payload)."""
    data = entry.rstrip(b"\0")
    if len(data) == _CHECK_BYTES - 8:  # cut, with a digest at the end
        data = data[:-8] + b"..."
    return data.decode(errors="replace").split("\x1f")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def _disagreement(rows: list[bytes], layouts: Callable[[], list[Any]]) -> str:
    """The message for processes whose entries differ: what each group of ranks called.
    ``layouts()`` gives every process's layout spelled out (a collective: called on every rank
    or none, as the rows, which every rank has, decide)."""
    groups: dict[bytes, list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(row[8:], []).append(r)
    entries = [(_decode(entry) + ["?"] * 7)[:7] for entry in groups]
    ranks = list(groups.values())
    if len({(kind, name, detail, call) for kind, _, _, name, detail, _, call in entries}) == 1 and (
        entries[0][0] == "call"
    ):
        # The starts of calls of different pmapped functions.
        kind, *_, call = entries[0]
        started = "; ".join(f"{_ranks(rs)} {entry[5]}" for entry, rs in zip(entries, ranks))
        return (
            f"fdp.distributed: the processes started calls of different pmapped functions as "
            f"pmapped call #{call}: {started}. Every process must make the same pmapped calls with "
            "an axis name, in the same order (each spans every process): a call made on some ranks "
            "only, such as an evaluation under `if fdp.distributed.is_main_process():`, meets "
            "another call on the others."
        )
    if len({(kind, name, detail, call) for kind, _, _, name, detail, _, call in entries}) == 1:
        kind, _, _, name, detail, _, call = entries[0]
        when = _when(kind, call)
        if len({signature for _, signature, *_ in entries}) > 1:
            return _layout_disagreement(name, detail, when, layouts())
        if len({device for _, _, device, *_ in entries}) > 1:
            # A CPU tensor on one rank and a CUDA one on another would go to gloo on one and
            # to NCCL on the other, which never meet: a hang until the timeout.
            passed = ", ".join(f"{device} on {_ranks(rs)}" for (_, _, device, *_), rs in zip(entries, ranks))
            return (
                f"fdp.distributed: the processes passed {name} ({detail}, {when}) "
                f"tensors on different kinds of device: {passed}. Every process must run its "
                "replicas on the same kind of device (the CPU, or GPUs: "
                "fdp.distributed.local_devices() gives each process its own)."
            )
        passed = ", ".join(f"{tensor} on {_ranks(rs)}" for (*_, tensor, _), rs in zip(entries, ranks))
        return (
            f"fdp.distributed: the processes passed different shapes or dtypes to {name} ({detail}, "
            f"{when}): {passed}. Every process must pass the same shapes and dtypes. "
            + _mismatch_advice(detail, [tensor for (*_, tensor, _) in entries])
        )

    def called(entry: list[str]) -> str:
        kind, _, _, name, detail, tensor, call = entry
        if kind == "call":
            return f"started pmapped call #{call} ({tensor})"
        return f"called {name} ({detail} of {tensor}; {_when(kind, call)})"

    return (
        "fdp.distributed: the processes called different collectives at the same point: "
        + "; ".join(f"{_ranks(rs)} {called(entry)}" for entry, rs in zip(entries, ranks))
        + ". Every process must call the same collectives, with the same options, in the same "
        "order, as every replica must (no collective behind a condition that differs between "
        "processes, and every process making the same pmapped calls)."
    )


def _when(kind: str, call: str) -> str:
    """When a collective of ``kind`` ran, for messages: in which pmapped call (``call``: how
    many had started), or, for one outside them (``"outside"``: ``broadcast``), after which."""
    if kind != "outside":
        return f"pmapped call #{call}"
    return "before any pmapped call" if call == "0" else f"after pmapped call #{call}"


def _layout_disagreement(name: str, detail: str, when: str, layouts: list[Any]) -> str:
    """The message for processes that passed one collective trees of different structures,
    shapes or dtypes (``layouts``: what :meth:`Layout.describe` gave on each rank; ``when``:
    see :func:`_when`)."""
    where = f"{name} ({detail}, {when})"
    groups: dict[str, list[int]] = {}
    for r, layout in enumerate(layouts):
        groups.setdefault(json.dumps(layout), []).append(r)
    spelled = [json.loads(text) for text in groups]
    ranks = list(groups.values())
    if (
        None in spelled
        or len({(structure, tuple(p for p, _ in leaves)) for structure, leaves in spelled}) > 1
    ):
        passed = "; ".join(
            f"{_ranks(rs)} {'passed no tree' if layout is None else 'passed ' + layout[0]}"
            for layout, rs in zip(spelled, ranks)
        )
        return (
            f"fdp.distributed: the processes passed trees of different structure to {where}: "
            f"{passed}. Every process must pass the same structure, shapes and dtypes."
        )
    paths = [p for p, _ in spelled[0][1]]
    k = next(k for k in range(len(paths)) if len({leaves[k][1] for _, leaves in spelled}) > 1)
    values = [leaves[k][1] for _, leaves in spelled]
    passed = ", ".join(f"{value} on {_ranks(rs)}" for value, rs in zip(values, ranks))
    return (
        f"fdp.distributed: the processes passed different shapes or dtypes to {name} at "
        f"{paths[k]} ({detail}, {when}): {passed}. Every process must pass the same "
        "structure, shapes and dtypes. " + _mismatch_advice(detail, values)
    )


def _mismatch_advice(detail: str, described: list[str]) -> str:
    """What to do about values the processes passed as ``described`` (``dtype[shape]`` each) to
    a collective of ``detail``: shapes that differ come from uneven batches, dtypes that
    differ do not (a branch on the data does)."""
    if len({value.partition("[")[2] for value in described}) > 1:
        return _split.equal_shapes_hint(reduction="all_reduce" in detail, among="batches between processes")
    return "Cast to one dtype before the call."


def _travels(data: torch.Tensor, world: int) -> bool:
    """Whether ``data`` rides along in the exchange that checks its collective (a small CPU
    tensor), and is combined from there rather than by a collective of its own."""
    return data.device.type == "cpu" and data.numel() * data.element_size() <= _slot_bytes(world)


def _all_gather(state: _State, parts: list[torch.Tensor], mine: torch.Tensor, what: str) -> None:
    """``dist.all_gather(parts, mine)``, waited for as :func:`_wait` does."""
    try:
        handle = dist.all_gather(parts, mine, async_op=True)
    except RuntimeError as error:
        _raise_failure(state, what, error)
        raise
    _wait(state, handle, what, mine.device)


def _agree(
    state: _State,
    entry: str,
    payload: int | None,
    what: str,
    data: torch.Tensor | None,
    layout: Layout | None = None,
) -> tuple[list[int], list[torch.Tensor] | None]:
    """Every process's ``payload`` (if given) once every process is found at the same
    collective (one all_gather of ``entry``), and every process's ``data`` (in rank order) when it
    is a CPU tensor small enough to travel along; a ValueError naming what each called
    otherwise, on every rank alike."""
    slot = _slot_bytes(state.world_size)
    carried = data is not None and _travels(data, state.world_size)
    mine = _encode(entry, payload or 0, data if carried else None, slot)
    parts = [torch.empty_like(mine) for _ in range(state.world_size)]
    _all_gather(state, parts, mine, what)
    own = mine[8:_CHECK_BYTES]
    if not all(torch.equal(p[8:_CHECK_BYTES], own) for p in parts):
        rows = [p[:_CHECK_BYTES].numpy().tobytes() for p in parts]
        # Every rank has every row, so every rank alike decides whether to spell out the layouts.
        raise ValueError(_disagreement(rows, lambda: _spelled_out(state, layout, what)))
    payloads = [] if payload is None else [int(p[:8].view(torch.int64)) for p in parts]
    if not carried:  # (on no rank: the entries, which hold the shapes and dtypes, agree)
        return payloads, None
    assert data is not None
    size = data.numel() * data.element_size()
    return payloads, [p[_CHECK_BYTES : _CHECK_BYTES + size].view(data.dtype).view(data.shape) for p in parts]


def _spelled_out(state: _State, layout: Layout | None, what: str) -> list[Any]:
    """Every process's ``layout.describe()`` (``None`` for a process without a layout), in rank
    order: two all_gathers, the texts' lengths and then the texts. Only for a message, after the
    entries showed that the layouts differ. (Not ``dist.all_gather_object``, which waits
    without :func:`_wait`'s watch for a failed rank.)"""
    try:
        spelled = None if layout is None else layout.describe()
    except Exception as error:  # noqa: BLE001
        # (A key or node whose repr fails.) Raised here, it would leave the other ranks
        # waiting in this exchange: said in the message instead.
        spelled = (f"a tree that cannot be spelled out ({type(error).__name__}: {error})", [])
    text = json.dumps(spelled).encode()
    size = torch.tensor([len(text)], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(state.world_size)]
    _all_gather(state, sizes, size, what)
    mine = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8)
    mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(state.world_size)]
    _all_gather(state, parts, mine, what)
    return [json.loads(p[: int(s)].numpy().tobytes()) for p, s in zip(parts, sizes)]


def _collective(
    name: str,
    detail: str,
    tensor: torch.Tensor | None,
    issues: Sequence[Callable[[], Any]],
    payload: int | None = None,
    *,
    kind: str = "collective",
    layout: Layout | None = None,
    described: str | None = None,
) -> tuple[list[int], list[torch.Tensor] | None]:
    """Checks that every process is at this collective (:func:`_agree`), with ``layout``'s
    signature if given (the tree that ``tensor`` packs), then, unless
    ``tensor`` travelled along, issues ``issues`` (async process-group calls on ``tensor``'s
    device) on the communicator, all before any is waited for, and waits for them. Returns every
    process's ``payload``, and every process's ``tensor`` if it travelled along.

    ``described``: what the processes compare of ``tensor`` where its size differs between
    them (rows sent to some processes only); such a tensor never travels along. Without a
    tensor: what else they compare (the pmapped function, at the start of a call)."""
    state = _live_state()
    travels = described is None
    if described is None:
        described = "" if tensor is None else _describe_tensor(tensor)
    # The signature and the device type first: an entry too long for the exchange is cut at
    # its end.
    signature = "" if layout is None else layout.signature
    device_type = "" if tensor is None else tensor.device.type
    entry = "\x1f".join((kind, signature, device_type, name, detail, described, str(state.calls)))
    what = f"{name} ({detail})"
    device = torch.device("cpu") if tensor is None else tensor.device

    def work() -> tuple[list[int], list[torch.Tensor] | None]:
        payloads, carried = _agree(
            state, entry, payload, what, tensor if issues and travels else None, layout
        )
        if carried is not None:
            return payloads, carried
        handles = []
        for issue in issues:
            try:
                handles.append(issue())
            except RuntimeError as error:
                _raise_failure(state, what, error)
                raise
        for handle in handles:
            _wait(state, handle, what, device)
        return payloads, None

    done: tuple[list[int], list[torch.Tensor] | None] = state.communicator.call(work, device)
    return done


# --- process-level collectives (differentiable) ----------------------------------------------------


def all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    name: str = "a collective",
    ties: torch.Tensor | None = None,
    layout: Layout | None = None,
) -> torch.Tensor:
    """The elementwise sum/max/min of ``tensor`` over the processes, differentiably.

    ``name``: the collective, for messages. ``ties`` (max/min): how many of this process's
    replicas hold the local extreme value, elementwise; the gradient goes to every replica of
    every process that holds the global one, in equal parts. ``layout``: the tree that
    ``tensor`` packs, which every process must have passed alike.
    """
    result: torch.Tensor = _AllReduce.apply(tensor, op, name, ties, layout)
    return result


def all_gather(
    tensor: torch.Tensor, name: str = "a collective", layout: Layout | None = None
) -> torch.Tensor:
    """Every process's ``tensor`` stacked along a new dim 0 (rank order), differentiably
    (``layout``: as for :func:`all_reduce`)."""
    result: torch.Tensor = _AllGather.apply(tensor, name, layout)
    return result


def reduce_scatter(
    tensor: torch.Tensor, name: str = "a collective", layout: Layout | None = None
) -> torch.Tensor:
    """This process's ``world``-th of the sum over the processes of ``tensor`` (rows
    ``[rank * k, (rank + 1) * k)`` of a ``(world * k, ...)`` tensor), differentiably
    (``layout``: as for :func:`all_reduce`)."""
    result: torch.Tensor = _ReduceScatter.apply(tensor, name, layout)
    return result


def send_rows(
    rows: torch.Tensor,
    sends: list[int],
    receives: list[int],
    name: str = "a collective",
    layout: Layout | None = None,
    *,
    anywhere: bool = True,
) -> torch.Tensor:
    """The rows that every process sends this one (``receives[p]`` from process ``p``, in rank
    order), where this one sends ``sends[q]`` of ``rows`` to process ``q``, in turn,
    differentiably (``layout``: as for :func:`all_reduce`).

    ``anywhere=False``: every process knows that no process sends any row (a ``ppermute`` whose
    pairs all stay within processes), so they only check that they are all at this collective,
    and skip the empty all_to_all."""
    result: torch.Tensor = _SendRows.apply(rows, sends, receives, name, layout, anywhere)
    return result


# DDP's bucket sizes: a small first bucket, so that communication starts early, then 25 MiB.
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


def _buckets(flat: torch.Tensor) -> list[torch.Tensor]:
    """Contiguous views of ``flat`` of at most DDP's bucket sizes."""
    per_element = flat.element_size()
    pieces, start = [], 0
    limit = max(1, FIRST_BUCKET_BYTES // per_element)
    while start < flat.numel():
        pieces.append(flat[start : start + limit])
        start += limit
        limit = max(1, BUCKET_BYTES // per_element)
    return pieces


def _reduce(tensor: torch.Tensor, op: str, name: str, layout: Layout | None = None) -> torch.Tensor:
    """The all-reduce of ``tensor``, done as DDP does it: buckets of at most 25 MiB (1 MiB first),
    one all_reduce each, all launched before any is waited for. (A small CPU tensor travels in
    the exchange that checks the collective, and is reduced here.)"""
    result = tensor.detach().clone().contiguous()
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    wire = _widened(result)
    issues = [
        lambda bucket=bucket: dist.all_reduce(bucket, op=reduce_op, async_op=True)
        for bucket in _buckets(wire.view(-1))
    ]
    # Whether this process's value holds a NaN rides in the check's exchange: gloo's (and
    # NCCL's) MAX and MIN keep whichever operand comes first where one is NaN, so the result
    # would hang on rank order, where torch.maximum, the local replicas' amax and the small
    # tensors below all give NaN. (A small tensor that travels with the check needs no flag.)
    nan = (
        op != "sum"
        and result.is_floating_point()
        and not _travels(result, world_size())
        and bool(result.isnan().any())
    )
    flags, carried = _collective(
        name, f"an all_reduce ({op})", result, issues, payload=int(nan), layout=layout
    )
    if carried is None and wire is not result:
        result.copy_(wire)
    if carried is None and any(flags):
        mask = _reduce(tensor.detach().isnan().to(torch.uint8), "max", name)  # (no NaN in a mask)
        result.masked_fill_(mask.bool(), float("nan"))
    if carried is not None:
        # In rank order, one elementwise operation at a time: the same bits on every rank.
        result = carried[0].clone()
        for other in carried[1:]:
            if op == "sum":
                result.add_(other)
            elif op == "max":
                torch.maximum(result, other, out=result)
            else:
                torch.minimum(result, other, out=result)
    return result


# reduce_scatter_tensor's new name since torch 2.13, which deprecates the old one.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _widened(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the processes reduce it: int16 as int32 (a new tensor, which the caller
    copies back), which gloo and NCCL reduce, where int16 they refuse ("Invalid scalar type");
    the sum is the same once narrowed back, wrapped as int16 arithmetic wraps it. Any other
    tensor as it is."""
    return tensor.to(torch.int32) if tensor.dtype == torch.int16 else tensor


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor``'s memory as bytes, one row of them per row of it (dim 0): what
    the processes send where they only move values (gathers, all_to_all, broadcast), which gloo
    then carries for every dtype, as it carries the small tensors of the check. (gloo refuses
    int16, the unsigned types past uint8 and float8: "Invalid scalar type".)"""
    rows = tensor.shape[0] if tensor.dim() else 1
    return tensor.view(rows, math.prod(tensor.shape[1:])).view(torch.uint8)


def _as_real(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as pairs of reals (gloo and NCCL reduce no complex numbers; a sum of
    pairs is the complex sum), split along the same dim 0; other tensors as they are."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _scatter_sum(tensor: torch.Tensor, name: str, layout: Layout | None = None) -> torch.Tensor:
    """Rows ``[rank * k, (rank + 1) * k)`` of the sum over the processes of ``tensor``, of
    shape ``(world * k, ...)``: one reduce_scatter, which moves a ``world``-th of what an
    all_reduce of the whole would. (A small CPU tensor travels in the check's exchange, and is
    summed here, in rank order.)"""
    source = tensor.detach().contiguous()
    rows = source.shape[0] // world_size()
    result = source.new_empty((rows, *source.shape[1:]))
    sent, received = _widened(source), _widened(result)
    issue = lambda: _reduce_scatter_single(_as_real(received), _as_real(sent), async_op=True)  # noqa: E731
    _, carried = _collective(name, "a reduce_scatter (sum)", source, [issue], layout=layout)
    if carried is None and received is not result:
        result.copy_(received)
    if carried is not None:
        start = rank() * rows
        mine = [c[start : start + rows] for c in carried]
        result.copy_(mine[0])
        for other in mine[1:]:
            result.add_(other)
    return result


def _send_rows(
    rows: torch.Tensor,
    sends: list[int],
    receives: list[int],
    name: str,
    layout: Layout | None,
    anywhere: bool = True,
) -> torch.Tensor:
    """The rows that the processes send here: ``receives[p]`` from process ``p``, in rank order,
    where this one sends the first ``sends[0]`` rows of ``rows`` to process 0, the next
    ``sends[1]`` to process 1, and so on (one all_to_all of uneven parts; the counts may be 0)."""
    source = rows.detach().contiguous()
    result = source.new_empty((sum(receives), *source.shape[1:]))
    issue = lambda: dist.all_to_all_single(_bytes(result), _bytes(source), receives, sends, async_op=True)  # noqa: E731
    # The processes compare the rows' shape, not the count of them, which each decides for itself.
    row = f"rows of {_describe_tensor(source, slice(1, None))}"
    _collective(name, "an all_to_all", source, [issue] if anywhere else [], layout=layout, described=row)
    return result


def _gather(tensor: torch.Tensor, name: str, layout: Layout | None = None) -> torch.Tensor:
    source = tensor.detach().contiguous()
    parts = [torch.empty_like(source) for _ in range(world_size())]
    _, carried = _collective(
        name,
        "an all_gather",
        source,
        [lambda: dist.all_gather([_bytes(p) for p in parts], _bytes(source), async_op=True)],
        layout=layout,
    )
    return torch.stack(parts if carried is None else carried)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tensor: torch.Tensor, op: str, name: str, ties: torch.Tensor | None, layout: Layout | None
    ) -> torch.Tensor:
        result = _reduce(tensor, op, name, layout)
        ctx.op, ctx.name = op, name
        if op != "sum":
            # Where this process holds the extreme value, weighted by how many of its replicas
            # hold it (the local max/min splits its gradient among them in equal parts).
            mask = (tensor == result).to(tensor.dtype)
            ctx.save_for_backward(mask if ties is None else mask * ties.to(tensor.dtype))
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        # (The forward checked the layout: the cotangents are laid out alike.)
        name = f"the backward of {ctx.name}"
        if ctx.op == "sum":
            # Every process's cotangent, for every process's input.
            return all_reduce(grad, "sum", name), None, None, None, None
        (mask,) = ctx.saved_tensors
        # The cotangents and the tied replicas' counts, summed in one collective: each tied
        # replica of every process gets an equal part of the total.
        both = all_reduce(torch.stack([grad, mask.to(grad.dtype)]), "sum", name)
        return both[0] * mask / both[1], None, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str, layout: Layout | None) -> torch.Tensor:  # type: ignore[override]
        ctx.name = name
        return _gather(tensor, name, layout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        # Every process's cotangent of this process's row: a reduce_scatter, not a whole all_reduce.
        return reduce_scatter(grad, f"the backward of {ctx.name}")[0], None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str, layout: Layout | None) -> torch.Tensor:  # type: ignore[override]
        ctx.name = name
        return _scatter_sum(tensor, name, layout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        # Row block p of every process's input went to process p's output: its cotangent.
        # flatten, not reshape(-1, ...): a tensor without elements leaves -1 undetermined.
        return all_gather(grad, f"the backward of {ctx.name}").flatten(0, 1), None, None


class _SendRows(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        rows: torch.Tensor,
        sends: list[int],
        receives: list[int],
        name: str,
        layout: Layout | None,
        anywhere: bool,
    ) -> torch.Tensor:
        ctx.sends, ctx.receives, ctx.name, ctx.anywhere = sends, receives, name, anywhere
        return _send_rows(rows, sends, receives, name, layout, anywhere)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:  # type: ignore[override]
        # Each row's cotangent goes back to the process that sent the row.
        name = f"the backward of {ctx.name}"
        return (
            send_rows(grad, ctx.receives, ctx.sends, name, anywhere=ctx.anywhere),
            None,
            None,
            None,
            None,
            None,
        )


def check_same(values: Sequence[tuple[str, torch.Tensor]], caller: str) -> None:
    """That every process holds the same tensors as ``values`` (key path, tensor: a pmapped
    call's outputs with out_axes None, under ``check_unmapped_outputs``), compared by digest in
    one all_gather: a ``ValueError`` naming the first that differs, on every rank alike."""
    digests = b"".join(_digest(value) for _, value in values)
    if not digests:
        return
    mine = torch.frombuffer(bytearray(digests), dtype=torch.uint8)
    rows = _gather(mine, f"{caller} (check_unmapped_outputs)")
    for k, (path, value) in enumerate(values):
        groups: dict[bytes, list[int]] = {}
        for r, row in enumerate(rows):
            groups.setdefault(row[16 * k : 16 * (k + 1)].numpy().tobytes(), []).append(r)
        if len(groups) > 1:
            first, second = list(groups.values())[:2]
            raise ValueError(
                f"{caller}: out_axes is None for {path}, but the processes' replicas disagree: "
                f"those of {_ranks(first)} returned one value, those of {_ranks(second)} another "
                f"({_tree.describe(value)} on rank {rank()}; check_unmapped_outputs compares the "
                "replicas of every process, as one process running them all would)"
            )


def _digest(tensor: torch.Tensor) -> bytes:
    """16 bytes that tell apart tensors of different dtypes, shapes or values (NaNs equal, and
    -0.0 and 0.0, as ``check_unmapped_outputs`` compares them in one process)."""
    t = tensor.detach()
    if t.is_nested or t.is_quantized:
        t = torch.tensor([])  # (not compared: a digest of nothing, alike on every rank)
    elif t.layout != torch.strided:
        t = t.to_dense()
    # (A conjugate or negative view holds its values lazily: view_as_real and numpy refuse it.)
    t = t.cpu().resolve_conj().resolve_neg().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        with contextlib.suppress(RuntimeError, NotImplementedError):  # (float8: no arithmetic)
            t = torch.where(t.isnan(), torch.full_like(t, math.nan), t + 0)  # one NaN, +0.0
    spelled = f"{tensor.dtype}{list(tensor.shape)}".encode()
    return hashlib.blake2b(
        spelled + t.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=16
    ).digest()


# The Python numbers that broadcast sends, as tensors of these dtypes.
_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64}


@_thread_state.without_autocast  # torch.cat keeps every dtype under any autocast
def broadcast(tree: _Tree, *, src: int = 0) -> _Tree:
    """Every tensor and Python number of ``tree`` with process ``src``'s value, in every process.

    What DDP does to a model's parameters and buffers when it wraps it, and what
    ``jax.experimental.multihost_utils.broadcast_one_to_all`` does: processes that built their
    training state each on its own (a model initialized without a common seed) start from one
    process's. Every process must call it, with trees of the same structure, shapes and dtypes;
    otherwise every process raises the same ``ValueError``, naming the first leaf that differs.
    Without :func:`initialize`, ``tree`` itself is returned (a world of one process).

    Args:
        tree: a pytree of tensors (on the CPU or this process's GPU) and Python numbers
            (``bool``, ``int`` within int64's range, ``float``: an optimizer's step count). Other
            leaves (strings, ``None``, other objects) are kept as they are, each process's own.
        src: the rank whose values every process gets. Keyword-only. Default: ``0``.

    Returns:
        ``tree`` with every tensor replaced by a new tensor of its own with ``src``'s value and
        the leaf's dtype, shape, device and ``requires_grad`` (an ``nn.Parameter`` by a new
        ``nn.Parameter``), and every number by ``src``'s, of the leaf's type.

    Raises:
        ValueError: ``src`` is not a rank (out of range), the processes passed different trees,
            or an ``int`` does not fit in an int64.
        TypeError: ``src`` is not an ``int``; a leaf is a :class:`fdp.PerReplica` (broadcast
            before :func:`fdp.device_put_replicated`).

    Examples:
        >>> import torch, fdp
        >>> params = {"w": torch.randn(3, 2), "b": torch.zeros(2)}
        >>> params = fdp.distributed.broadcast(params)  # every process now has rank 0's
        >>> sorted(params)
        ['b', 'w']
    """
    if isinstance(src, bool) or not isinstance(src, int):  # a TypeError, as initialize's rank
        raise TypeError(
            f"fdp.distributed.broadcast: src must be a rank, an int from 0 to {world_size() - 1}, "
            f"got {type(src).__name__}: {_tree.short_repr(src)}"
        )
    if not 0 <= src < world_size():
        raise ValueError(
            f"fdp.distributed.broadcast: src must be a rank, an int from 0 to {world_size() - 1}, got {src}"
        )
    if _STATE is None:
        return tree
    paths, leaves, treespec = _tree.flatten_with_paths(tree, "tree", caller="fdp.distributed.broadcast")
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, PerReplica):
            raise TypeError(
                f"fdp.distributed.broadcast: {path} is a PerReplica, a value per replica already; "
                "broadcast the state before fdp.device_put_replicated, or fdp.unreplicate it first"
            )
    layout = layout_of(tree, treespec, leaves, "tree")
    # One broadcast per device and dtype (the leaves packed in one buffer), as DDP's is.
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    # Python numbers too, as 0-dim CPU tensors (small: they travel with the check), as
    # jax's broadcast_one_to_all sends every leaf: an optimizer's step count (an int, which a
    # schedule and Adam's bias corrections read) left each process's own made a rank that
    # resumed from a fresh opt.init step from 0 and drift apart, silently.
    sent = list(leaves)
    for k, leaf in enumerate(leaves):
        if type(leaf) in _NUMBER_DTYPES:
            try:
                sent[k] = torch.tensor(leaf, dtype=_NUMBER_DTYPES[type(leaf)])
            except (RuntimeError, ValueError, OverflowError):  # an int past int64's range
                raise ValueError(
                    f"fdp.distributed.broadcast: {paths[k]} = {leaf} does not fit in an int64, "
                    "as which it would be sent: send it as a tensor of your own encoding"
                ) from None
        if isinstance(sent[k], torch.Tensor):
            groups.setdefault((sent[k].device, sent[k].dtype), []).append(k)
    out = list(leaves)
    what = ("fdp.distributed.broadcast", f"a broadcast from rank {src}")
    if not groups:
        # Nothing to send, but the trees are still compared: a process whose tree holds no
        # tensor would otherwise return while one whose tree holds some waits for it.
        _collective(*what, None, [], kind="outside", layout=layout)
    with torch.no_grad():
        for members in groups.values():
            tensors = [sent[k].detach() for k in members]
            # cat, not _flatten_dense_tensors, which hands one tensor back as a view of it: the
            # broadcast would write into the caller's leaf.
            buffer = torch.cat([t.reshape(-1) for t in tensors])

            def issue(buffer: torch.Tensor = buffer) -> Any:
                return dist.broadcast(_bytes(buffer), src, async_op=True)

            _, carried = _collective(*what, buffer, [issue], kind="outside", layout=layout)
            if carried is not None:
                buffer = carried[src]
            for k, piece in zip(members, _unflatten_dense_tensors(buffer, tensors)):
                if not isinstance(leaves[k], torch.Tensor):
                    out[k] = type(leaves[k])(piece.item())  # a number of the leaf's type
                    continue
                value = piece.clone()  # a tensor of its own, not a view of the buffer
                if isinstance(leaves[k], nn.Parameter):  # a model's parameter stays one
                    out[k] = nn.Parameter(value, requires_grad=leaves[k].requires_grad)
                else:
                    out[k] = value.requires_grad_() if leaves[k].requires_grad else value
    return _tree.unflatten(treespec, out)


def replica_counts(local: int, caller: str) -> list[int]:
    """Every process's number of local replicas for a new pmapped call of ``caller`` (the
    pmapped function, as messages name it: ``fdp.pmap(train_step)``): one small all_gather,
    which also checks that every process starts a call of that function here."""
    state = _live_state()
    # Whether this rank's last call failed travels in the payload, beside the count: a call
    # that failed on some ranks only after its last collective had returned on the others,
    # which went on with what it returned (a training step's new state) while the failed ranks
    # went on without it, silently out of step. One process running every replica fails the
    # whole call instead.
    failed_last = state.calls > 0 and state.failed == state.calls
    last, last_caller = state.calls, state.caller
    state.calls += 1
    state.caller = caller
    try:
        # The function is compared too: calls of different functions whose collectives agree
        # in kind and layout (a pmean of a scalar loss in an evaluation on rank 0 alone and in
        # the training step on the others) would otherwise be combined, silently.
        payloads, _ = _collective(
            "the start of a pmapped call",
            "an exchange of replica counts",
            None,
            [],
            local | int(failed_last) << 32,
            kind="call",
            described=caller,
        )
    except BaseException as error:
        # As a failure in the call's collectives is: the other ranks, waiting in this exchange
        # (an interrupt landed here while they were late), learn of it at once.
        record_call_failure(error)
        raise
    failed = [r for r, payload in enumerate(payloads) if payload >> 32]
    if 0 < len(failed) < len(payloads):
        # Every rank raises it, here: no one waits to be told, and the failed ranks' records of
        # their last call, which the others quote, stay.
        state.failed = state.calls
        raise RankFailed(_failed_on_some_ranks(state, failed, last, last_caller))
    return [payload & 0xFFFFFFFF for payload in payloads]


def _failed_on_some_ranks(state: _State, failed: list[int], call: int, caller: str) -> str:
    """The message for ranks whose pmapped call ``call`` (of ``caller``) failed on the ranks
    ``failed`` only, and returned on the others: the same on every rank."""
    returned = [r for r in range(state.world_size) if r not in failed]
    # (Last: a quoted failure may span lines, fdp's notes on which replica raised it.)
    said = "".join(
        f" Rank {r} failed with {message}"
        for r in failed
        if (message := _recorded_failure(state, r, call)) is not None
    )
    return (
        f"fdp.distributed: pmapped call #{call} ({caller}) failed on {_ranks(failed)} but returned on "
        f"{_ranks(returned)}: the ranks are out of step (what the call returned, a training step's "
        f"new state, exists on {_ranks(returned)} only), and every rank raises this error at the "
        f"start of pmapped call #{state.calls} ({state.caller}). A call that fails on some ranks "
        "only, after its last collective, has already returned on the others, which cannot fail "
        "it any more: let the processes end (torchrun --max-restarts starts them again, from the "
        f"last checkpoint) rather than catch such a failure and go on.{said}"
    )


def _recorded_failure(state: _State, rank: int, call: int) -> str | None:
    """The failure that ``rank`` (this one too) recorded for pmapped call ``call``, if any."""
    try:
        failure = _stored_failure(state, rank)
    except Exception:  # noqa: BLE001 - a store that is gone tells nothing
        return None
    return failure[1] if failure is not None and failure[0] == call else None


# --- data ------------------------------------------------------------------------------------------


def shard_batch(batch: _Tree, *, local_replicas: int = 1, split: _split.SplitRule = "balanced") -> _Tree:
    """This process's share of a global batch: the rows of its replicas.

    Every process holds the same global batch (same seed, same data order); each takes the
    rows that its replicas would get if one process ran all ``world_size * local_replicas``
    replicas with ``split``. A pmapped call on the share (with the same ``split``) then gives
    every replica exactly the rows it would have had in one process, so results match a
    single-process run with as many replicas. (For a ``Dataset``, ``DistributedSampler`` is the
    usual alternative; see docs/distributed.md.)

    Args:
        batch: a pytree whose tensors share dim 0.
        local_replicas: the replicas each process runs. Keyword-only. Default: ``1``.
        split: ``"balanced"`` or ``"chunk"``. Keyword-only. Default: ``"balanced"``.

    Returns:
        ``batch`` restricted to this process's rows (the whole batch without :func:`initialize`).

    Examples:
        >>> import torch, fdp
        >>> fdp.distributed.shard_batch({"x": torch.arange(5)})  # one process: everything
        {'x': tensor([0, 1, 2, 3, 4])}
    """
    from . import _tree  # local: _tree imports nothing from here, but keep this module light

    caller = "fdp.distributed.shard_batch"
    # Checked in one process too: a script that runs alone must not change its meaning (nor
    # start failing) under torchrun.
    split = _split.check_split(split, what=f"{caller} split")
    if isinstance(local_replicas, bool) or not isinstance(local_replicas, int):
        raise TypeError(
            f"{caller}: local_replicas must be a positive int, got {type(local_replicas).__name__}: "
            f"{_tree.short_repr(local_replicas)}"
        )
    if local_replicas < 1:
        raise ValueError(f"{caller}: local_replicas must be a positive int, got {local_replicas}")
    paths, leaves, spec = _tree.flatten_with_paths(batch, "batch", caller=caller)
    # Rows that fdp does not split (a UserDict such as a BatchEncoding, a NumPy array) would go
    # to every process whole, and every process would train on the whole batch, silently; a
    # PackedSequence would be cut field by field. Refused as fdp.pmap refuses them.
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor) and (reason := _tree.unsplittable_reason(leaf, caller)):
            raise TypeError(f"{caller}: {path}: {reason}")
    packed = _tree.packed_sequence_path((batch,), ("batch",), [0] * len(leaves), spec)
    if packed is not None:
        raise TypeError(_scatter.packed_sequence_message(caller, packed))
    rows_of = {p: t.shape[0] for p, t in zip(paths, leaves) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(set(rows_of.values())) > 1:
        # Each tensor would be cut at the same rows whatever its length: some rows of the
        # longer ones would reach no process, silently.
        shown = ", ".join(f"{p}: {n}" for p, n in rows_of.items())
        raise ValueError(
            f"{caller}: the batch's tensors must share dim 0 (every process takes the same rows "
            f"of each), got {shown}. Pass the per-example tensors alone; give the others to every "
            "process as they are."
        )
    if not rows_of or world_size() == 1:
        return batch
    rows = next(iter(rows_of.values()))
    if rows == 0:
        raise ValueError(f"{caller}: the batch is empty (dim 0 of {next(iter(rows_of))} has size 0)")
    replicas = world_size() * local_replicas
    sizes = list(_split.shard_sizes(rows, replicas, split)) + [0] * replicas
    if split == "chunk":
        _check_chunks(rows, sizes, local_replicas)
    start = sum(sizes[: rank() * local_replicas])
    stop = start + sum(sizes[rank() * local_replicas : (rank() + 1) * local_replicas])
    return _tree.unflatten(
        spec, [t[start:stop] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in leaves]
    )


def _check_chunks(rows: int, sizes: list[int], local_replicas: int) -> None:
    """Refuses a ``"chunk"`` split whose shares ``fdp.pmap(split="chunk")`` would cut otherwise
    than one process cuts the whole batch: a process's pmapped call sees only its share, and
    chunks it by its own size. (Every rank finds the same, from the same global batch.)"""
    for process in range(world_size()):
        own = [s for s in sizes[process * local_replicas : (process + 1) * local_replicas] if s]
        local = list(_split.shard_sizes(sum(own), local_replicas, "chunk")) if own else []
        if local != own:
            raise ValueError(
                f"fdp.distributed.shard_batch: with split='chunk', one process running all "
                f"{world_size()} x {local_replicas} replicas would give process {process}'s replicas "
                f"{own} rows, but fdp.pmap(split='chunk') cuts that process's {sum(own)} rows into "
                f"{local}: its replicas would not get the rows (nor see the axis_size) they would in "
                f"one process. Use split='balanced' in shard_batch and fdp.pmap (sizes that differ "
                f"by at most one), or a batch of a multiple of {world_size() * local_replicas} rows."
            )


def global_layout(local: int, caller: str, group: Any) -> tuple[int, int, list[int]]:
    """(offset of this process's first replica, global replica count, every process's count)
    for a new pmapped call of ``caller`` (see :func:`replica_counts`), whose replicas' call
    group is ``group``."""
    state = _live_state()
    with _STARTING:  # (two threads starting calls at once: one of them is refused)
        thread, running = state.running or (None, None)
        group_running = running() if running is not None else None
        if (
            thread is not None
            and thread is not threading.current_thread()
            and thread.is_alive()
            and group_running is not None
            and not group_running.done
        ):
            # Each rank would order its threads' calls as they happen to run, and the calls of
            # different threads would meet on the ranks, their collectives combined where they
            # agree: silently wrong results. (Refused before the exchange: this call counts for
            # nothing, on no rank.)
            raise RuntimeError(
                f"{caller}: under fdp.distributed, pmapped calls with an axis name span the "
                "processes and must be made one at a time, in the same order on every rank, but "
                f"this call started in thread {threading.current_thread().name!r} while pmapped "
                f"call #{state.calls} ({state.caller}) runs in thread {thread.name!r}. Calls made "
                "at once from several threads would meet other threads' calls on the other "
                "ranks, each rank ordering them as its threads happen to run: make them from one "
                "thread, or one after another (a call's backward included)."
            )
        state.running = (threading.current_thread(), weakref.ref(group))
    try:
        counts = replica_counts(local, caller)
    except BaseException:
        state.running = None  # the call ends here
        raise
    return sum(counts[: rank()]), sum(counts), counts
