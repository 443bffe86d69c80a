"""The caller's thread-local torch state, carried into the replica threads.

Grad mode, inference mode, autocast, the default saved-tensor hooks, the number of intra-op
threads and a few rarer switches (forward-AD enabled, saved-tensor hooks disabled, autograd
multithreading, view replay, disabled ``__torch_function__``: see :class:`Rare`) are
thread-local in torch, and ``contextvars`` values are per thread in Python (user code keeps
settings there, and so does some of torch's configuration).
A worker thread starts with none of them, so each task captures the caller's state and the
worker enters it around the replica. ``nn.DataParallel`` carries only grad mode and the autocast
*enabled* flag, so a bfloat16 autocast region runs in float16 on its replicas; here the dtype,
the cache flag and every device type's autocast go along, and so does an autocast dtype set
while autocast is off (``torch.set_autocast_dtype``), for an autocast the replicas enter
themselves without a dtype.

Not carried (documented in docs/concepts.md): ``torch.set_default_device`` and other
``TorchFunctionMode``/``TorchDispatchMode`` stacks, whose mode objects are not made to be
shared between threads; dispatch-key guards
(``torch._C._DisableTorchDispatch``, ...); the profiler's per-thread ``RecordFunction`` state.
Anomaly mode, deterministic algorithms, the default dtype, ``torch.backends`` flags and the
random generators are process-wide: every thread sees them anyway.

The other way round, a replica may leave state set in its worker's thread, which would reach
the worker's next replicas: each worker compares :func:`leftovers` after every replica with its
fresh value and takes it back (:func:`restore`), or is replaced where it cannot.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, ParamSpec, TypeVar

import torch

__all__ = [
    "ThreadState",
    "capture",
    "applied",
    "saves_in_order",
    "leftovers",
    "fresh",
    "restore",
    "without_autocast",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def without_autocast(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run with autocast off, where its caller has it on.

    For fdp's own tensor work on the user's values (concatenating and stacking the replicas'
    outputs, packing and combining a collective's leaves, averaging buffers), which must keep
    every tensor's dtype and run no user code. Under autocast, ``torch.cat`` and ``torch.stack``
    go through its cast policy, which refuses a ``float16`` tensor in a ``bfloat16`` region and
    the reverse ("Unexpected floating ScalarType in at::autocast::prioritize"): a replica's
    ``float16`` output, which the same computation on one device returns, failed to gather.
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch._C._is_any_autocast_enabled():  # type: ignore[attr-defined]
            with torch._C._DisableAutocast():  # type: ignore[attr-defined]
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


_AUTOCAST_DEVICE_TYPES = tuple(
    t
    for t in ("cpu", "cuda", "xpu", "hpu", "mps", "mtia", "privateuseone")
    if torch._C._is_autocast_available(t)  # type: ignore[attr-defined]
)


# The device types whose autocast dtype, set while autocast is off, is carried to the replicas
# (and taken back from a worker a replica left it set in): the CPU's, and CUDA's in a build
# with CUDA; not the rarer device types', whose reads would cost every call as much again.
_CARRIED_DTYPES = tuple(
    t
    for t in ("cpu", "cuda")
    if t in _AUTOCAST_DEVICE_TYPES and (t != "cuda" or torch.backends.cuda.is_built())
)
_fresh_dtypes: tuple[torch.dtype, ...] | None = None


def _fresh_autocast_dtypes() -> tuple[torch.dtype, ...]:
    """The autocast dtypes of ``_CARRIED_DTYPES`` in a thread that has set none: what a worker
    starts with (autocast's dtypes are thread-local), read once in a thread of its own."""
    global _fresh_dtypes
    if _fresh_dtypes is None:
        found: list[tuple[torch.dtype, ...]] = []
        thread = threading.Thread(
            target=lambda: found.append(tuple(map(torch.get_autocast_dtype, _CARRIED_DTYPES))),
            name="fdp-autocast-defaults",
        )
        thread.start()
        thread.join()
        _fresh_dtypes = found[0]
    return _fresh_dtypes


class Rare(NamedTuple):
    """Thread-local autograd and ``__torch_function__`` switches that are rarely moved from their
    defaults (captured as a whole only when one is): all of them are in what torch itself carries
    into its autograd threads (``at::ThreadLocalState``)."""

    # torch.autograd.forward_ad._set_fwd_grad_enabled (default True).
    fwd_grad_enabled: bool
    # torch.autograd.graph.disable_saved_tensors_hooks: its message, or None (the default).
    saved_tensors_hooks_disabled: str | None
    # torch.autograd.set_multithreading_enabled (default True).
    multithreading_enabled: bool
    # torch.autograd._force_original_view_tracking (default False).
    view_replay_enabled: bool
    # torch._C.DisableTorchFunctionSubclass (1) or DisableTorchFunction (2); 0 by default.
    torch_function_disabled: int


class ThreadState(NamedTuple):  # immutable, and cheap to build on every call
    # Nothing but grad mode, the thread count and the context to enter (the common case).
    plain: bool
    grad_enabled: bool
    inference_mode: bool
    # (device_type, dtype) for every device type whose autocast is enabled.
    autocast: tuple[tuple[str, torch.dtype], ...]
    # (device_type, dtype) for the device types of _CARRIED_DTYPES whose autocast is off but
    # whose dtype was set (torch.set_autocast_dtype): an autocast entered in a replica without
    # a dtype takes it, in the caller's thread as in a worker's.
    autocast_dtypes: tuple[tuple[str, torch.dtype], ...]
    autocast_cache: bool
    saved_tensors_hooks: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None
    # torch.set_num_threads: each thread keeps the value it had when it first ran a parallel
    # kernel, so a worker started earlier would ignore a later call in the caller's thread.
    num_threads: int
    # The caller's contextvars, copied at the call: each replica but 0 (which runs in the
    # caller's own) runs in a copy of its own, since a context is entered by one thread at a time
    # and what one replica sets must not reach another.
    context: contextvars.Context
    rare: Rare | None  # None where every switch has its default


def _rare() -> Rare | None:
    C = torch._C  # noqa: N806
    if (
        C._is_fwd_grad_enabled()
        and C._autograd._saved_tensors_hooks_get_disabled_error_message() is None  # type: ignore[attr-defined]
        and C._is_multithreading_enabled()
        and not C._is_view_replay_enabled()
        and C._is_torch_function_enabled()
    ):
        return None  # the usual case: five reads
    disabled = 0 if C._is_torch_function_enabled() else 2 if C._is_torch_function_all_disabled() else 1
    return Rare(
        fwd_grad_enabled=C._is_fwd_grad_enabled(),
        saved_tensors_hooks_disabled=C._autograd._saved_tensors_hooks_get_disabled_error_message(),  # type: ignore[attr-defined]
        multithreading_enabled=C._is_multithreading_enabled(),
        view_replay_enabled=C._is_view_replay_enabled(),
        torch_function_disabled=disabled,
    )


def capture() -> ThreadState:
    """The calling thread's state."""
    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    any_autocast = torch._C._is_any_autocast_enabled()  # type: ignore[attr-defined]
    if any_autocast:
        autocast = tuple(
            (t, torch.get_autocast_dtype(t)) for t in _AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(t)
        )
    autocast_dtypes: tuple[tuple[str, torch.dtype], ...] = ()
    fresh_dtypes = _fresh_dtypes or _fresh_autocast_dtypes()
    # The CPU's dtype, read alone in a build without CUDA: this runs on every call.
    if torch.get_autocast_dtype("cpu") is not fresh_dtypes[0] or (
        len(fresh_dtypes) > 1 and torch.get_autocast_dtype("cuda") is not fresh_dtypes[1]
    ):  # rare: a dtype set while autocast is off (or on: entered above)
        autocast_dtypes = tuple(
            (t, dtype)
            for t, dtype, fresh_dtype in zip(
                _CARRIED_DTYPES, map(torch.get_autocast_dtype, _CARRIED_DTYPES), fresh_dtypes
            )
            if dtype is not fresh_dtype and not (any_autocast and torch.is_autocast_enabled(t))
        )
    inference_mode = torch.is_inference_mode_enabled()
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)  # type: ignore[attr-defined]
    rare = _rare()
    return ThreadState(
        plain=not (inference_mode or autocast or autocast_dtypes or hooks is not None or rare is not None),
        grad_enabled=torch.is_grad_enabled(),
        inference_mode=inference_mode,
        autocast=autocast,
        autocast_dtypes=autocast_dtypes,
        autocast_cache=torch.is_autocast_cache_enabled() if autocast else True,
        saved_tensors_hooks=hooks,
        num_threads=torch.get_num_threads(),
        context=contextvars.copy_context(),
        rare=rare,
    )


def saves_in_order(state: ThreadState) -> bool:
    """Whether the caller's saved-tensor hooks need the replicas' tensors in the same order on
    every run: those of ``torch.utils.checkpoint`` (``use_reentrant=False``), whose
    recomputation hands each saved tensor back by its position among the forward's. Other hooks
    (``torch.autograd.graph.save_on_cpu``, say) see each tensor on its own."""
    hooks = state.saved_tensors_hooks
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


class applied:
    """Enters ``state`` in the current thread for the duration of the block.

    A class with a short path for the usual state (grad mode only, no autocast, inference mode,
    hooks or rare switches): this runs for every replica of every call.

    ``again``: the thread is the caller's, which has run replicas of this call before (replica
    0, or others run inline), and any of them may have left state set there: autocast
    (``torch.set_autocast_enabled``, an autocast never left, ``torch.set_autocast_dtype``,
    the cache flag), saved-tensor hooks pushed and never popped, or a rare switch (forward AD
    or autograd multithreading off, saved-tensor hooks disabled). Entering ``state`` sets only
    what the caller had, so such leftovers are put back to the caller's values too, for the
    block: a replica computes in the caller's precision, with its hooks, whichever thread runs
    it. (A worker's thread is taken back to a fresh one after each replica instead, see
    :func:`restore`.)
    """

    __slots__ = ("_state", "_stack", "_grad", "_again")

    def __init__(self, state: ThreadState, *, again: bool = False) -> None:
        self._state = state
        self._stack: contextlib.ExitStack | None = None
        self._again = again

    def __enter__(self) -> None:
        state = self._state
        if torch.get_num_threads() != state.num_threads:
            torch.set_num_threads(state.num_threads)  # kept: the worker follows its callers
        self._grad = torch.is_grad_enabled()
        moved = self._again and _autocast_moved(state)
        others = self._again and _others_moved(state)
        if state.plain and not (moved or others):
            torch._C._set_grad_enabled(state.grad_enabled)
            return
        stack = self._stack = contextlib.ExitStack()
        if moved:
            _autocast_back(state, stack)
        if others:  # before the caller's hooks are pushed below, which a disabling would refuse
            _others_back(state, stack)
        if state.inference_mode:
            stack.enter_context(torch.inference_mode(True))
        stack.enter_context(torch.set_grad_enabled(state.grad_enabled))
        for device_type, dtype in state.autocast_dtypes:
            stack.callback(torch.set_autocast_dtype, device_type, torch.get_autocast_dtype(device_type))
            torch.set_autocast_dtype(device_type, dtype)
        for device_type, dtype in state.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=state.autocast_cache))
        if state.saved_tensors_hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*state.saved_tensors_hooks))
        if state.rare is not None:
            _enter_rare(state.rare, stack)

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()
        else:
            torch._C._set_grad_enabled(self._grad)


def _autocast_moved(state: ThreadState) -> bool:
    """Whether this thread's autocast differs from ``state``'s: enabled device types and their
    dtypes, the cache flag, and the dtypes of ``_CARRIED_DTYPES`` (a handful of reads)."""
    fresh_dtypes = _fresh_dtypes or _fresh_autocast_dtypes()
    if not (state.autocast or state.autocast_dtypes):  # the usual case, read as capture() reads it
        return (
            torch._C._is_any_autocast_enabled()  # type: ignore[attr-defined]
            or not torch.is_autocast_cache_enabled()
            or torch.get_autocast_dtype("cpu") is not fresh_dtypes[0]
            or (len(fresh_dtypes) > 1 and torch.get_autocast_dtype("cuda") is not fresh_dtypes[1])
        )
    if torch._C._is_any_autocast_enabled():  # type: ignore[attr-defined]
        enabled = tuple(
            (t, torch.get_autocast_dtype(t)) for t in _AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(t)
        )
        if enabled != state.autocast:
            return True
    elif state.autocast:
        return True
    if torch.is_autocast_cache_enabled() != state.autocast_cache:
        return True
    wanted = dict(state.autocast_dtypes)
    return any(
        torch.get_autocast_dtype(t) is not wanted.get(t, fresh)
        for t, fresh in zip(_CARRIED_DTYPES, fresh_dtypes)
        if not torch.is_autocast_enabled(t)
    )


def _autocast_back(state: ThreadState, stack: contextlib.ExitStack) -> None:
    """Puts this thread's autocast back to ``state``'s where a replica left it otherwise, each
    change undone by ``stack``: the device types ``state`` has off are switched off, and the
    dtypes and the cache flag go back to ``state``'s (or a fresh thread's), so that an autocast
    the replica enters without them takes the caller's. ``applied`` then enters the device
    types ``state`` has on."""
    enabled = dict(state.autocast)
    wanted: dict[str, torch.dtype] = dict(zip(_CARRIED_DTYPES, _fresh_dtypes or _fresh_autocast_dtypes()))
    wanted.update(state.autocast_dtypes)
    for t in _AUTOCAST_DEVICE_TYPES:
        if t not in enabled and torch.is_autocast_enabled(t):
            stack.callback(torch.set_autocast_enabled, t, True)
            torch.set_autocast_enabled(t, False)
        dtype = wanted.get(t)
        if dtype is not None and t not in enabled and torch.get_autocast_dtype(t) is not dtype:
            stack.callback(torch.set_autocast_dtype, t, torch.get_autocast_dtype(t))
            torch.set_autocast_dtype(t, dtype)
    if torch.is_autocast_cache_enabled() != state.autocast_cache:
        stack.callback(torch.set_autocast_cache_enabled, not state.autocast_cache)
        torch.set_autocast_cache_enabled(state.autocast_cache)


# The rare switches at their defaults: what a caller whose ``ThreadState.rare`` is None has.
_DEFAULT_RARE = Rare(
    fwd_grad_enabled=True,
    saved_tensors_hooks_disabled=None,
    multithreading_enabled=True,
    view_replay_enabled=False,
    torch_function_disabled=0,
)


def _others_moved(state: ThreadState) -> bool:
    """Whether this thread's saved-tensor hooks or rare switches differ from ``state``'s."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)  # type: ignore[attr-defined]
    return top != state.saved_tensors_hooks or _rare() != state.rare


def _others_back(state: ThreadState, stack: contextlib.ExitStack) -> None:
    """Puts this thread's saved-tensor hooks and rare switches back to ``state``'s where a
    replica left them otherwise, each change undone by ``stack``: hooks pushed above the
    caller's are popped (and pushed again after the block), the switches set to ``state``'s.
    (A ``DisableTorchFunction`` left entered cannot be left from here; it stays.)"""
    autograd = torch._C._autograd
    message = autograd._saved_tensors_hooks_get_disabled_error_message()  # type: ignore[attr-defined]
    wanted = state.rare or _DEFAULT_RARE
    if message is not None and wanted.saved_tensors_hooks_disabled is None:
        autograd._saved_tensors_hooks_enable()  # type: ignore[attr-defined]
        stack.callback(autograd._saved_tensors_hooks_disable, message, False)  # type: ignore[attr-defined]
    popped: list[tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = []
    while True:
        top = autograd._top_saved_tensors_default_hooks(False)  # type: ignore[attr-defined]
        if top is None or top == state.saved_tensors_hooks:
            break
        popped.append(top)
        autograd._pop_saved_tensors_default_hooks()  # type: ignore[attr-defined]

    def push_back() -> None:
        for pack, unpack in reversed(popped):
            autograd._push_saved_tensors_default_hooks(pack, unpack)  # type: ignore[attr-defined]

    if popped:
        stack.callback(push_back)
    _enter_rare(wanted, stack)


# The rare switches that are plain booleans, as (read, write): in Rare's and Fresh's order.
_SWITCHES: tuple[tuple[Callable[[], bool], Callable[[bool], None]], ...] = (
    (torch._C._is_fwd_grad_enabled, torch._C._set_fwd_grad_enabled),
    (torch._C._is_multithreading_enabled, torch._C._set_multithreading_enabled),
    (torch._C._is_view_replay_enabled, torch._C._set_view_replay_enabled),
)


def _enter_rare(rare: Rare, stack: contextlib.ExitStack) -> None:
    """Sets the rare switches in this thread, each restored by ``stack``."""
    C = torch._C  # noqa: N806
    wanted = (rare.fwd_grad_enabled, rare.multithreading_enabled, rare.view_replay_enabled)
    for (read, write), value in zip(_SWITCHES, wanted):
        if read() != value:
            write(value)
            stack.callback(write, not value)
    message = rare.saved_tensors_hooks_disabled
    if message is not None:  # after the hooks are pushed, as in the caller
        autograd = C._autograd
        previous = autograd._saved_tensors_hooks_get_disabled_error_message()  # type: ignore[attr-defined]
        autograd._saved_tensors_hooks_disable(message, False)  # type: ignore[attr-defined]
        if previous is None:
            stack.callback(autograd._saved_tensors_hooks_enable)  # type: ignore[attr-defined]
        else:
            stack.callback(autograd._saved_tensors_hooks_disable, previous, False)  # type: ignore[attr-defined]
    if rare.torch_function_disabled:
        stack.enter_context(
            C.DisableTorchFunction()
            if rare.torch_function_disabled == 2
            else C.DisableTorchFunctionSubclass()
        )


def leftovers() -> tuple[object, ...]:
    """What a replica may leave set in its thread (``torch.set_autocast_enabled``, an autocast
    or ``saved_tensors_hooks`` entered and never left, ``torch.set_default_device``, ...).

    A worker compares it after each replica with its value in the fresh thread: a worker that
    kept such state would run the next call's replicas (of any pmapped function) with it, where
    the caller has none. About a microsecond, after the replica has been counted as done.
    """
    C = torch._C  # noqa: N806
    autograd = C._autograd
    return (
        C.is_grad_enabled(),
        C.is_inference_mode_enabled(),
        C._is_any_autocast_enabled(),  # type: ignore[attr-defined]
        # A dtype set while autocast is off, which later replicas would enter autocast with
        # where their caller set none (see _CARRIED_DTYPES).
        *map(torch.get_autocast_dtype, _CARRIED_DTYPES),
        C._is_fwd_grad_enabled(),
        C._is_multithreading_enabled(),
        C._is_view_replay_enabled(),
        C._is_torch_function_enabled(),
        C._len_torch_function_stack(),
        C._len_torch_dispatch_stack(),
        autograd._top_saved_tensors_default_hooks(False),  # type: ignore[attr-defined]
        autograd._saved_tensors_hooks_get_disabled_error_message(),  # type: ignore[attr-defined]
    )


class Fresh(NamedTuple):
    """A fresh thread's state (taken by each worker when it starts), to go back to."""

    leftovers: tuple[object, ...]
    grad_enabled: bool
    switches: tuple[bool, ...]  # the values of _SWITCHES
    autocast_dtypes: tuple[tuple[str, torch.dtype], ...]
    autocast_cache: bool


def fresh() -> Fresh:
    """The calling thread's state, taken before it runs anything."""
    return Fresh(
        leftovers(),
        torch.is_grad_enabled(),
        tuple(read() for read, _ in _SWITCHES),
        tuple((t, torch.get_autocast_dtype(t)) for t in _AUTOCAST_DEVICE_TYPES),
        torch.is_autocast_cache_enabled(),
    )


def restore(fresh: Fresh) -> bool:
    """Puts back what a replica left set in this thread (see :func:`leftovers`); whether that
    made the thread as fresh. Function and dispatch modes (``torch.set_default_device``) and
    guards still held cannot be taken back from outside: the worker is then replaced."""
    C = torch._C  # noqa: N806
    autograd = C._autograd
    C._set_grad_enabled(fresh.grad_enabled)
    for (_, write), value in zip(_SWITCHES, fresh.switches):
        write(value)
    for device_type, dtype in fresh.autocast_dtypes:
        torch.set_autocast_enabled(device_type, False)
        torch.set_autocast_dtype(device_type, dtype)
    torch.set_autocast_cache_enabled(fresh.autocast_cache)
    # An autocast entered and never left keeps its nesting level, and the cache of casts (of
    # weights that may change since) is cleared only when that level goes back to 0.
    nesting = torch.autocast_increment_nesting()
    while nesting > 0:
        nesting = torch.autocast_decrement_nesting()
    torch.clear_autocast_cache()
    while autograd._top_saved_tensors_default_hooks(False) is not None:  # type: ignore[attr-defined]
        autograd._pop_saved_tensors_default_hooks()  # type: ignore[attr-defined]
    if autograd._saved_tensors_hooks_get_disabled_error_message() is not None:  # type: ignore[attr-defined]
        autograd._saved_tensors_hooks_enable()  # type: ignore[attr-defined]
    return leftovers() == fresh.leftovers
