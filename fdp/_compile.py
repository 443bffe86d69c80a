"""``pmap(compile=...)``: the compiled function the replicas share, and when they take turns.

dynamo (torch.compile's front end) looks up a frame's compiled code before it takes its compile
lock, so replicas that enter a frame together while it is not compiled each compile it: N
compilations of the same graph, and past ``torch._dynamo.config.recompile_limit`` (8) some
replicas run the frame eagerly, with warnings. So while dynamo is likely to compile, the replicas
of a call take turns between collectives (:class:`fdp._replica.Turnstile`): the first compiles
each piece and the others find it compiled. :class:`Turns` decides when.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import optree
import torch

from . import _tree

__all__ = ["compiled", "own_code", "Turns"]

T = TypeVar("T")


def compiled(
    target: Callable[..., Any], options: bool | Mapping[str, Any], *, what: str
) -> Callable[..., Any] | None:
    """``torch.compile(target, **options)`` for ``compile=True`` or a dict; None for False."""
    if options is False:
        return None
    if options is not True and not isinstance(options, Mapping):
        raise TypeError(
            f"{what}: compile must be True, False or a dict of torch.compile options "
            f"(e.g. {{'mode': 'max-autotune'}}), got {type(options).__name__}: {_tree.short_repr(options)}"
        )
    kwargs = {} if options is True else dict(options)
    try:
        return torch.compile(target, **kwargs)
    except (TypeError, ValueError, RuntimeError) as err:
        raise type(err)(f"{what}: torch.compile rejected compile={_tree.short_repr(kwargs)}: {err}") from err


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs, and its limit on
    recompilations, per code object: every pmapped module would otherwise share one."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


class Turns:
    """Whether the replicas of one compiled function should take turns in a call.

    They do when dynamo is likely to compile: on inputs of a new structure, or with a leaf of a
    new shape, dtype, device or ``requires_grad``; when torch's global state that dynamo guards
    on (grad mode, thread count, default dtype, ...) changed since the last call; and after a
    call in which dynamo compiled anything, until a call compiles nothing (a Python number
    that changes between calls, e.g. an optimizer's step count, is recompiled once as a
    dynamic value on the second call).
    """

    # Input signatures remembered; forgetting one costs one call in turns.
    MAX_SIGNATURES = 64

    def __init__(self) -> None:
        self._signatures: set[Any] = set()
        self._state: Any = None
        self._compiled_last_call = True

    def run(self, call: Callable[[bool], T], treespec: optree.PyTreeSpec, leaves: list[Any]) -> T:
        """``call(take_turns)``, noting whether dynamo compiled during it."""
        take_turns = self._new_inputs(treespec, leaves) | self._new_state() | self._compiled_last_call
        before = _graphs_compiled()
        try:
            return call(take_turns)
        finally:
            self._compiled_last_call = _graphs_compiled() != before

    def _new_inputs(self, treespec: optree.PyTreeSpec, leaves: list[Any]) -> bool:
        signature = (
            treespec,
            tuple(
                (t.shape, t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor) else type(t)
                for t in leaves
            ),
        )
        if signature in self._signatures:
            return False
        if len(self._signatures) >= self.MAX_SIGNATURES:
            self._signatures.clear()
        self._signatures.add(signature)
        return True

    def _new_state(self) -> bool:
        if self._state is not None and self._state.check():
            return False
        first = self._state is None
        self._state = _global_state()
        return not first


def _global_state() -> Any:
    """torch's global state that dynamo guards on, captured by dynamo's own guard; on a torch
    without it, a stand-in that never changes."""
    try:
        return torch._C._dynamo.guards.GlobalStateGuard()
    except AttributeError:  # pragma: no cover - older torch
        return _Unchanged()


class _Unchanged:
    def check(self) -> bool:
        return True


def _graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process (any thread, any function)."""
    utils = sys.modules.get("torch._dynamo.utils")  # loaded by torch.compile; never imported here
    if utils is None:
        return 0
    return int(utils.counters["stats"]["unique_graphs"])
