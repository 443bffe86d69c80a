"""The caller's thread-local torch state, carried into the replica threads.

Grad mode, inference mode, autocast, the default saved-tensor hooks and the number of intra-op
threads are thread-local in torch, and ``contextvars`` values are per thread in Python (user code
keeps settings there, and so does some of torch's configuration).
A worker thread starts with none of them, so each task captures the caller's state and the
worker enters it around the replica. ``nn.DataParallel`` carries only grad mode and the autocast
*enabled* flag, so a bfloat16 autocast region runs in float16 on its replicas; here the dtype,
the cache flag and every device type's autocast go along.

Not carried (documented in docs/concepts.md): ``torch.set_default_device`` and other
``TorchFunctionMode``/``TorchDispatchMode`` stacks, whose mode objects are not made to be
shared between threads.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["ThreadState", "capture", "applied", "saves_in_order"]

_AUTOCAST_DEVICE_TYPES = tuple(
    t
    for t in ("cpu", "cuda", "xpu", "hpu", "mps", "mtia", "privateuseone")
    if torch._C._is_autocast_available(t)  # type: ignore[attr-defined]
)


class ThreadState(NamedTuple):  # immutable, and cheap to build on every call
    grad_enabled: bool
    inference_mode: bool
    # (device_type, dtype) for every device type whose autocast is enabled.
    autocast: tuple[tuple[str, torch.dtype], ...]
    autocast_cache: bool
    saved_tensors_hooks: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None
    # torch.set_num_threads: each thread keeps the value it had when it first ran a parallel
    # kernel, so a worker started earlier would ignore a later call in the caller's thread.
    num_threads: int
    # The caller's contextvars, copied at the call: each replica but 0 (which runs in the
    # caller's own) runs in a copy of its own, since a context is entered by one thread at a time
    # and what one replica sets must not reach another.
    context: contextvars.Context


def capture() -> ThreadState:
    """The calling thread's state."""
    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    if torch._C._is_any_autocast_enabled():  # type: ignore[attr-defined]
        autocast = tuple(
            (t, torch.get_autocast_dtype(t)) for t in _AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(t)
        )
    return ThreadState(
        grad_enabled=torch.is_grad_enabled(),
        inference_mode=torch.is_inference_mode_enabled(),
        autocast=autocast,
        autocast_cache=torch.is_autocast_cache_enabled() if autocast else True,
        saved_tensors_hooks=torch._C._autograd._top_saved_tensors_default_hooks(False),  # type: ignore[attr-defined]
        num_threads=torch.get_num_threads(),
        context=contextvars.copy_context(),
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

    A class with a short path for the usual state (grad mode only, no autocast, inference mode
    or hooks): this runs for every replica of every call.
    """

    __slots__ = ("_state", "_stack", "_grad")

    def __init__(self, state: ThreadState) -> None:
        self._state = state
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        state = self._state
        if torch.get_num_threads() != state.num_threads:
            torch.set_num_threads(state.num_threads)  # kept: the worker follows its callers
        self._grad = torch.is_grad_enabled()
        if not (state.inference_mode or state.autocast or state.saved_tensors_hooks is not None):
            torch._C._set_grad_enabled(state.grad_enabled)
            return
        stack = self._stack = contextlib.ExitStack()
        if state.inference_mode:
            stack.enter_context(torch.inference_mode(True))
        stack.enter_context(torch.set_grad_enabled(state.grad_enabled))
        for device_type, dtype in state.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=state.autocast_cache))
        if state.saved_tensors_hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*state.saved_tensors_hooks))

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()
        else:
            torch._C._set_grad_enabled(self._grad)
