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
import threading
import types
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import optree
import torch

from . import _axes, _tree

__all__ = ["compiled", "own_code", "Turns", "eager_under_compile", "never_compiled", "cudagraph_trees_ready"]

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
    except (TypeError, ValueError, RuntimeError, AssertionError) as err:
        # Raised as the builtin type it is: a subclass may build its own message from its
        # argument (dynamo's InvalidBackend wrapped this one in "Invalid backend: ..." again).
        # dynamo checks some options' types with assert ("Expected enable to be a bool, got
        # <class 'str'>" for dynamic='x'): a TypeError, as a wrong type is elsewhere.
        kind = next((k for k in (TypeError, ValueError, RuntimeError) if isinstance(err, k)), TypeError)
        # (torch 2.11's assert for dynamic='x' has no message.)
        detail = (
            str(err) or f"a bare {type(err).__name__} (is an option of another type than torch.compile's?)"
        )
        raise kind(f"{what}: torch.compile rejected compile={_tree.short_repr(kwargs)}: {detail}") from err


def cudagraph_trees_ready() -> None:
    """Sets up CUDA graph trees' per-thread state in this thread, where this torch leaves it to
    the thread that imported them: before each call of a compiled pmapped function.

    ``compile={"mode": "reduce-overhead"}`` (or ``max-autotune``) runs the graphs through
    inductor's CUDA graph trees, which keep their tree managers in a ``threading.local`` that
    torch fills in only in the thread that imports the module (and in the autograd threads
    started from it). Before torch 2.13 (pytorch/pytorch#123177) a compiled call in any other
    Python thread, a replica's worker, failed with a bare ``AssertionError`` in
    ``cudagraph_trees.get_obj``. This does what torch 2.13 does on a thread's first use: an
    empty set of tree managers and locks of the thread's own, stashed where the autograd
    threads it starts find them. A few attribute reads where there is nothing to do.
    """
    trees = sys.modules.get("torch._inductor.cudagraph_trees")  # imported by inductor, not here
    if trees is None or hasattr(trees, "_initialize_tls"):  # none in use, or it sets itself up
        return
    local = trees.local
    if hasattr(local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    local.tree_manager_containers = {}
    local.tree_manager_locks = defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs, and its limit on
    recompilations, per code object: every pmapped module would otherwise share one."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


class Turns:
    """Whether the replicas of one compiled function should take turns in a call.

    They do when dynamo is likely to compile, as far as that is cheap to tell:

    * inputs of a new structure, split into new shard sizes, or with a mapped tensor of a new
      shape or dtype, a new value of a static argument or of a boolean, string, dtype or device
      leaf, or (for a pmapped module) a submodule switched between ``train()`` and ``eval()``;
    * the first change of a Python ``int`` or ``float`` leaf, which dynamo compiles as a
      constant and, once it changes, as a dynamic value;
    * torch's global state that dynamo guards on (grad mode, thread count, default dtype, ...)
      unlike that of recent calls;
    * the call after one in which dynamo compiled anything, or which failed (a compilation
      that failed or was interrupted may run again); so changes not seen above cost at most
      one call of racing compilations.

    Wrong guesses are cheap either way: a call in turns runs its replicas one at a time between
    collectives, once.
    """

    MAX_KEYS = 64  # input keys remembered (least recently seen are forgotten first)
    MAX_STATES = 8  # global states remembered (a loop may alternate grad and no_grad calls)

    def __init__(self) -> None:
        self._keys: OrderedDict[Any, None] = OrderedDict()
        self._layouts: _tree.SpecCache[_Layout] = _tree.SpecCache()
        self._states: list[Any] = []
        self._compiled_last_call = True

    def run(
        self,
        call: Callable[[bool], T],
        *,
        treespec: optree.PyTreeSpec,
        leaves: Sequence[Any],
        axes: Sequence[Any],
        sizes: tuple[int, ...],
        statics: Mapping[int, Any],
        module: torch.nn.Module | None,
    ) -> T:
        """``call(take_turns)``, noting whether dynamo compiled during it."""
        layout = self._layout(treespec, leaves, axes)
        # `|`, not `or`: every check must run, as each one records what it saw.
        take_turns = (
            self._new_inputs(layout, leaves, sizes, statics, module)
            | self._changed_number(layout, leaves)
            | self._new_state()
            | self._compiled_last_call
        )
        before = _graphs_compiled()
        try:
            result = call(take_turns)
        except BaseException:
            self._compiled_last_call = True
            raise
        self._compiled_last_call = _graphs_compiled() != before  # != : also after a reset
        return result

    def _layout(self, treespec: optree.PyTreeSpec, leaves: Sequence[Any], axes: Sequence[Any]) -> _Layout:
        """Which leaves the checks read, for inputs of this structure and these leaf types.

        Found once: a call then reads a few leaves, not all of them (a resident training state
        has a leaf per parameter and optimizer buffer, and the compiled step is the fast one).
        """
        types = tuple(map(type, leaves))
        layout = self._layouts.get(treespec)
        if layout is None or layout.types != types:
            if len(self._layouts) >= self.MAX_KEYS:
                self._layouts.clear()
            layout = self._layouts[treespec] = _Layout(types, axes)
        return layout

    def _new_inputs(
        self,
        layout: _Layout,
        leaves: Sequence[Any],
        sizes: tuple[int, ...],
        statics: Mapping[int, Any],
        module: torch.nn.Module | None,
    ) -> bool:
        key = (
            layout,
            sizes,
            tuple(statics.items()),
            tuple((leaves[i].shape, leaves[i].dtype) for i in layout.mapped_tensors),
            tuple(leaves[i] for i in layout.specialized),
            tuple(m.training for m in module.modules()) if module is not None else (),
        )
        if key in self._keys:
            self._keys.move_to_end(key)
            return False
        if len(self._keys) >= self.MAX_KEYS:
            self._keys.popitem(last=False)
        self._keys[key] = None
        return True

    def _changed_number(self, layout: _Layout, leaves: Sequence[Any]) -> bool:
        changed = False
        for i in layout.numbers:
            seen, value = layout.seen[i], leaves[i]
            if seen is _UNSEEN:
                layout.seen[i] = value
            elif seen is not _DYNAMIC and seen != value:
                layout.seen[i] = _DYNAMIC  # dynamo's automatic dynamic from now on
                changed = True
        return changed

    def _new_state(self) -> bool:
        if any(state.check() for state in self._states):
            return False
        if len(self._states) >= self.MAX_STATES:
            self._states.pop(0)
        self._states.append(_global_state())
        return True


class _Layout:
    """Where the leaves that :class:`Turns` reads are, for one structure and its leaf types;
    also the first value of every Python number leaf (or _DYNAMIC once it has changed)."""

    __slots__ = ("types", "mapped_tensors", "specialized", "numbers", "seen")

    def __init__(self, types: tuple[type, ...], axes: Sequence[Any]) -> None:
        self.types = types
        # Mapped tensors only: few, and the ones whose shapes change (the last, smaller batch);
        # replicated ones are mostly parameters, many and fixed.
        tensors = _tree.TENSOR_TYPES
        self.mapped_tensors = [
            i for i, (t, axis) in enumerate(zip(types, axes)) if t in tensors and axis is not _axes.BROADCAST
        ]
        self.specialized = [i for i, t in enumerate(types) if t in _SPECIALIZED]
        self.numbers = [i for i, t in enumerate(types) if t is int or t is float]
        self.seen: dict[int, Any] = dict.fromkeys(self.numbers, _UNSEEN)


# Leaf types whose values dynamo specializes on (compiles one graph per value).
_SPECIALIZED = frozenset({bool, str, bytes, torch.dtype, torch.device})
_UNSEEN, _DYNAMIC = object(), object()


def _global_state() -> Any:
    """torch's global state that dynamo guards on, captured by dynamo's own guard (every
    supported torch has it: tests/test_torch_internals.py checks that it tells a change)."""
    return torch._C._dynamo.guards.GlobalStateGuard()


def _graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process (any thread, any function).

    Graphs, not frames: dynamo also converts frames that yield no graph, some on every call,
    and counting those would keep a function in turns for good.
    """
    utils = sys.modules.get("torch._dynamo.utils")  # loaded by torch.compile; never imported here
    if utils is None:
        return 0
    return int(utils.counters["stats"]["unique_graphs"])


# --- code torch.compile must not trace ----------------------------------------------------------

_F = TypeVar("_F", bound=Callable[..., Any])


def eager_under_compile(fn: _F, *, why: str | None = None) -> _F:
    """Keeps ``fn`` out of ``torch.compile``'s graphs: a public collective, or a check that
    dynamo cannot trace (see ``fdp._optim``). ``why`` replaces the reason dynamo gives for the
    break (by default: ``fn`` waits for or runs replicas in other threads).

    A collective waits on a condition variable for the other replicas' threads. Dynamo cannot
    trace that: it would fall back to eager for the whole enclosing frame, then compile the
    collective's internals as frames of their own and recompile them on every call. Marked
    here as ``torch.compiler.disable`` would mark it, a collective is one clean graph break:
    the compiled function runs its graph up to the call, the collective and everything it
    calls run eagerly, and a second graph takes over after it.

    ``torch.compiler.disable`` itself would wrap every call and import the compiler (seconds)
    with fdp; the same two marks are set on ``fn`` directly instead (the attributes that
    ``torch._dynamo.disable(fn, recursive=False)`` sets), and its code is marked through the
    compiler's C extension. tests/test_torch_internals.py checks that torch still reads both.
    """
    never_compiled(fn)
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]  # callers' graphs break here
    # What dynamo says of the break, e.g. to torch.compile(..., fullgraph=True).
    # Where the graph may not break, dynamo raises Unsupported with this: it must also cover a
    # collective inside fdp.pmap(..., compile=True), reached in code that compiles in one piece
    # (fdp.SyncBatchNorm under fdp.stateful_call), where "use fdp.pmap(compile=True)" is no help.
    fn._torchdynamo_disable_msg = why or (  # type: ignore[attr-defined]
        f"fdp runs {fn.__qualname__} eagerly, as a graph break: it waits for or runs "
        "replicas in other threads, which torch.compile cannot trace. Where the graph may not "
        "break (fullgraph=True, or a module's forward run by fdp.stateful_call or "
        "fdp.functional_call in compiled code, which compiles in one piece: an fdp.SyncBatchNorm "
        "layer in training mode, say), call it outside that code, or leave that code "
        "uncompiled. To compile what the replicas of a pmapped call run, use "
        "fdp.pmap(fn, compile=True)."
    )
    return fn


def never_compiled(fn: Callable[..., Any]) -> None:
    """Has dynamo run frames of ``fn``, and every Python frame they call, as they are.

    Also for functions that torch calls from C++ inside a collective (an autograd Function's
    forward and backward, under ``torch.func.grad`` in compiled code): a skip does not reach
    through C++ frames. Called at import on fdp's own functions: a torch without the C
    extension's strategy fails ``import fdp`` naming it, rather than compile collectives wrongly.
    """
    from torch._C._dynamo import eval_frame

    skip = eval_frame._FrameAction.SKIP
    eval_frame.set_code_exec_strategy(fn.__code__, eval_frame._FrameExecStrategy(skip, skip))
