"""The caller's thread-local torch state, carried into the replica threads.

Grad mode, inference mode, autocast and the default saved-tensor hooks are thread-local in torch.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ThreadState", "capture", "applied"]

_AUTOCAST_DEVICE_TYPES = tuple(
    t
    for t in ("cpu", "cuda", "xpu", "hpu", "mps", "mtia", "privateuseone")
    if torch._C._is_autocast_available(t)  # type: ignore[attr-defined]
)


@dataclass(frozen=True)
class ThreadState:
    grad_enabled: bool
    inference_mode: bool
    # (device_type, dtype) for every device type whose autocast is enabled.
    autocast: tuple[tuple[str, torch.dtype], ...]
    autocast_cache: bool
    saved_tensors_hooks: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None


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
        autocast_cache=torch.is_autocast_cache_enabled(),
        saved_tensors_hooks=torch._C._autograd._top_saved_tensors_default_hooks(False),  # type: ignore[attr-defined]
    )


@contextlib.contextmanager
def applied(state: ThreadState) -> Iterator[None]:
    """Enters ``state`` in the current thread for the duration of the block."""
    with contextlib.ExitStack() as stack:
        if state.inference_mode:
            stack.enter_context(torch.inference_mode(True))
        stack.enter_context(torch.set_grad_enabled(state.grad_enabled))
        for device_type, dtype in state.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=state.autocast_cache))
        if state.saved_tensors_hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*state.saved_tensors_hooks))
        yield
