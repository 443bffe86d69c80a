"""The private torch internals fdp reads, in one list, checked against the installed torch.

fdp reads torch's private API in a few places (thread-local switches to carry into replicas,
functorch's and autograd's state, dynamo's marks and counters, fused kernels' names). A new
torch release may rename, remove or change one of them without notice. Here each one is named
with what fdp uses it for, so that such a release turns these tests red with a list, before the
failures spread over the suite, and the internals whose change fdp would not notice by itself
(a check that would be skipped, a kernel that would go unrouted) are checked for what fdp
assumes of them. ``test_the_list_holds_every_private_name_fdp_reads`` keeps the list complete:
a new private name in fdp's code must be added here.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
from torch import nn

import fdp
from fdp import _compile, _functional_call, _random, _thread_state

ROOT = Path(__file__).resolve().parents[1]

# Every private torch (and optree) name fdp reads, with what for. Where fdp reads one through an
# alias (C = torch._C; dist.distributed_c10d), it is named here by its full path.
INTERNALS: dict[str, str] = {
    # _thread_state, _gather: the caller's thread-local state, carried into the replicas.
    "torch._C._is_any_autocast_enabled": "autocast on for any device type (every call)",
    "torch._C._DisableAutocast": "fdp's own cat/stack run without the caller's autocast",
    "torch._C._is_autocast_available": "the device types whose autocast is carried (at import)",
    "torch._C._set_grad_enabled": "grad mode set in a replica's thread (every replica)",
    "torch._C._autograd._top_saved_tensors_default_hooks": "the caller's saved-tensor hooks",
    "torch._C._autograd._pop_saved_tensors_default_hooks": "hooks a replica left pushed",
    "torch._C._autograd._push_saved_tensors_default_hooks": "(and pushed again after the next)",
    "torch._C.is_grad_enabled": "a worker's state after a replica, against a fresh thread's",
    "torch._C.is_inference_mode_enabled": "(the same)",
    "torch._C._autograd._saved_tensors_hooks_get_disabled_error_message": "hooks disabled?",
    "torch._C._autograd._saved_tensors_hooks_disable": "hooks disabled in a replica",
    "torch._C._autograd._saved_tensors_hooks_enable": "and enabled again after it",
    "torch._C._is_fwd_grad_enabled": "forward AD switch (read on every call)",
    "torch._C._set_fwd_grad_enabled": "forward AD switch (set in a replica)",
    "torch._C._is_multithreading_enabled": "autograd multithreading switch (every call)",
    "torch._C._set_multithreading_enabled": "autograd multithreading switch (set)",
    "torch._C._is_view_replay_enabled": "view replay switch (every call)",
    "torch._C._set_view_replay_enabled": "view replay switch (set)",
    "torch._C._is_torch_function_enabled": "__torch_function__ disabled? (every call)",
    "torch._C._is_torch_function_all_disabled": "... for subclasses or for all",
    "torch._C.DisableTorchFunction": "entered in a replica",
    "torch._C.DisableTorchFunctionSubclass": "entered in a replica",
    "torch._C._len_torch_function_stack": "modes in the caller: replicas not run inline",
    "torch._C._len_torch_dispatch_stack": "modes in the caller: inline runs, compiled calls",
    # _collectives, _batch_norm, _pmap, _parallel_apply: where a call runs.
    "torch._C._current_graph_task_id": "in a backward pass? (checkpoint recomputation errors)",
    "torch._C._functorch.peek_interpreter_stack": "under a torch.func transform? (refusals)",
    "torch._C._is_tracing": "under torch.jit.trace? (several replicas refused)",
    "torch._C._get_dispatch_mode": "make_fx's proxy mode in the caller? (several replicas refused)",
    "torch._C._TorchDispatchModeKey.PROXY": "(its argument)",
    "torch._C._dispatch_tls_is_dispatch_key_included": "pre-dispatch tracing (torch.export)?",
    "torch._C.DispatchKey.PreDispatch": "(its argument)",
    "torch.autograd.forward_ad._current_level": "fdp.grad: a dual level open? (-1 when none)",
    "torch._C._nn.flatten_dense_tensors": "a collective's leaves packed into one buffer",
    "torch._C._nn.unflatten_dense_tensors": "and unpacked as views of it",
    "torch._utils._unflatten_dense_tensors": "fdp.distributed: broadcast buffers unpacked",
    "torch.distributed.distributed_c10d._get_default_store": "the existing group's store",
    "torch.Tensor._version": "in-place changes of replicated inputs, buffers and shared parameters",
    "torch.Tensor._base": "a view's base (its version counter, its autograd node)",
    "torch.nn.modules.batchnorm._BatchNorm": "fdp.SyncBatchNorm's base class (at import)",
    # _compile: torch.compile.
    "torch._C._dynamo.guards.GlobalStateGuard": "a change of global state: replicas take turns",
    "torch._C._dynamo.eval_frame.set_code_exec_strategy": "collectives never traced (import)",
    "torch._C._dynamo.eval_frame._FrameExecStrategy": "(its argument)",
    "torch._C._dynamo.eval_frame._FrameAction.SKIP": "(its argument)",
    "torch._dynamo.utils.counters": "graphs compiled during a call: replicas take turns",
    "torch._dynamo.eval_frame.OptimizedModule": "a torch.compile'd module is refused",
    "torch._dynamo.error_on_graph_break": "fdp.functional_call traced in one piece",
    "torch._inductor.cudagraph_trees.local": "CUDA graph trees' per-thread state (torch < 2.13)",
    "torch._C._is_key_in_tls": "(set up already, as an autograd thread's is)",
    "torch._C._stash_obj_in_tls": "(for the autograd threads a worker's backward starts)",
    # _random: fdp.rng_scope.
    "torch._cudnn_init_dropout_state": "a cuDNN RNN dropout state seeded from the scope",
    "torch.ops.aten._cudnn_rnn": "a cuDNN RNN's dropout, routed to the scope's state",
    "torch.utils._python_dispatch.TorchDispatchMode": "the scope's mode (at import)",
    "torch.ops.aten.rand.default._schema": "an op's generator, dropout_p, dropout, train, dropout_state",
    # _optim: the transforms' arithmetic, over all leaves at once.
    **{
        f"torch._foreach_{op}": "fdp.optim's updates"
        for op in (
            "add",
            "add_",
            "sub",
            "mul",
            "div",
            "div_",
            "sqrt",
            "lerp",
            "addcmul_",
            "addcdiv",
            "norm",
            "neg",
            "maximum",
        )
    },
    # _tree: optree's registry (not public), for node types registered in other namespaces.
    "optree.registry._NODETYPE_REGISTRY": "types registered in other namespaces are adopted",
}


def resolve(path: str) -> Any:
    """The object at a dotted path, importing modules on the way (torch._dynamo.utils)."""
    parts = path.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def missing(paths: list[str]) -> list[str]:
    """The paths that do not resolve, each with what fdp uses it for."""
    gone = []
    for path in paths:
        try:
            resolve(path)
        except (AttributeError, ImportError):
            gone.append(f"{path} ({INTERNALS.get(path, '?')})")
    return gone


def test_every_internal_fdp_reads_exists() -> None:
    gone = missing(list(INTERNALS))
    assert not gone, f"torch {torch.__version__} lacks internals fdp reads:\n" + "\n".join(gone)


def test_a_missing_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    monkeypatch.delattr(torch._C._dynamo.guards, "GlobalStateGuard")
    assert missing(list(INTERNALS)) == [
        "torch._C._current_graph_task_id (in a backward pass? (checkpoint recomputation errors))",
        "torch._C._dynamo.guards.GlobalStateGuard (a change of global state: replicas take turns)",
    ]
    assert missing(["torch._C._no_such_internal"]) == ["torch._C._no_such_internal (?)"]


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _private_names_in(source: str) -> set[str]:
    """Dotted names rooted at ``torch`` with a private part, as fdp's code (not its comments
    or strings) reads them, longest first, also through an alias (``C = torch._C``, then
    ``C._x``); and private names imported from torch's modules."""
    found: set[str] = set()
    inner: set[int] = set()  # the chains inside a longer one
    tree = ast.parse(source)
    # Names bound to torch or to an object in it, anywhere in the file (fdp's aliases are
    # short-lived locals of one meaning each: C is torch._C wherever it is bound).
    # (Aliases of aliases too: autograd = C._autograd.)
    roots = {"torch": ["torch"]}
    assigned = [
        (node.targets[0].id, _dotted(node.value))
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    ]
    for _ in range(3):
        roots.update(
            {name: [*roots[path[0]], *path[1:]] for name, path in assigned if path and path[0] in roots}
        )
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            for alias in node.names:
                path = f"{node.module}.{alias.name}"
                if any(p.startswith("_") for p in path.split(".")):
                    found.add(path)
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        parts, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            inner.add(id(value))
            parts.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in roots:
            path = ".".join([*roots[value.id], *reversed(parts)])
            if any(p.startswith("_") and not p.startswith("__") for p in path.split(".")):
                found.add(path)
    return found


def test_the_list_holds_every_private_name_fdp_reads() -> None:
    read = set().union(*(_private_names_in(p.read_text()) for p in sorted((ROOT / "fdp").glob("*.py"))))
    # A name is listed, or is a module or object on the way to one that is (torch._C, for C).
    unlisted = sorted(
        name for name in read if not any(path == name or path.startswith(name + ".") for path in INTERNALS)
    )
    assert not unlisted, f"private torch names fdp reads, missing from INTERNALS: {unlisted}"
    assert "torch._C._functorch.peek_interpreter_stack" in read  # the walk finds them at all


# --- what fdp assumes of them, where fdp would not notice a change itself -----------------------


def test_saved_tensor_hooks_are_read_back_as_pushed() -> None:
    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    top = torch._C._autograd._top_saved_tensors_default_hooks
    assert top(False) is None
    with torch.autograd.graph.saved_tensors_hooks(pack, pack):
        assert top(False) == (pack, pack)
    assert top(False) is None


def test_checkpoints_hooks_are_told_apart() -> None:
    # fdp runs replicas in index order under torch.utils.checkpoint's hooks, which match
    # recomputed tensors by order; it tells them by the module that defines them. If torch moved
    # them, replicas would save in racing orders and gradients would be silently swapped.
    from torch.utils.checkpoint import checkpoint

    seen: list[bool] = []

    def region(x: torch.Tensor) -> torch.Tensor:
        seen.append(_thread_state.saves_in_order(_thread_state.capture()))
        return x.sin()

    x = torch.ones(2, requires_grad=True)
    checkpoint(region, x, use_reentrant=False)
    with torch.autograd.graph.save_on_cpu():
        region(x)
    region(x)
    assert seen == [True, False, False]


def test_the_graph_task_id_tells_a_backward_pass() -> None:
    # fdp.SyncBatchNorm and the collectives refuse to run in a backward pass outside a replica
    # (a checkpoint's recomputation): a different value outside one would skip that refusal.
    inside: list[int] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: inside.append(torch._C._current_graph_task_id()) or g)
    y.sum().backward()
    assert torch._C._current_graph_task_id() == -1
    assert inside and inside[0] != -1


def test_the_interpreter_stack_tells_a_torch_func_transform() -> None:
    # fdp.pmap and fdp.parallel_apply refuse to run under torch.func (replicas in other threads
    # would escape the transform, silently); the collectives switch to their batching rules.
    peek = torch._C._functorch.peek_interpreter_stack
    inside: list[bool] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        inside.append(peek() is not None)
        return x.sum()

    assert peek() is None
    torch.func.grad(f)(torch.ones(2))
    torch.func.vmap(f)(torch.ones(2, 2))
    assert inside == [True, True]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (torch.jit.trace, in torch 2.13)
def test_tracers_of_the_callers_operations_are_seen() -> None:
    # fdp.pmap refuses several replicas under them (the replicas in other threads would be
    # traced as constants, silently): a tracer these no longer see would be let through.
    from torch.fx.experimental.proxy_tensor import make_fx

    from fdp import _pool

    seen: list[str] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        try:
            _pool.ensure_not_traced("f", advice="")
            seen.append("none")
        except RuntimeError as error:
            seen.append(str(error).split(",")[0])
        return x * 2

    class Wrapped(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return f(x)

    x = torch.ones(2)
    f(x)
    make_fx(f)(x)
    make_fx(f, pre_dispatch=True)(x)
    torch.jit.trace(f, (x,))
    torch.export.export(Wrapped(), (x,), strict=False)
    assert seen[0] == "none" and len(seen) >= 5
    assert all(s.startswith("f was called under make_fx") for s in seen[1:3]), seen
    assert seen[3].startswith("f was called under torch.jit.trace"), seen
    assert seen[-1].startswith("f was called under make_fx"), seen


def test_mode_stacks_are_counted() -> None:
    class Mode(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    assert (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()) == (0, 0)
    with Mode(), torch.device("cpu"):
        assert (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()) == (1, 1)


def test_unflatten_dense_tensors_gives_views_of_the_buffer() -> None:
    # A collective's results are views of its result buffer (their gradients flow to it).
    a, b = torch.ones(2, 3), torch.zeros(4)
    buffer = torch._C._nn.flatten_dense_tensors([a, b])
    assert buffer.shape == (10,)
    for piece, like in zip(torch._C._nn.unflatten_dense_tensors(buffer, [a, b]), [a, b]):
        assert piece.shape == like.shape and piece._base is buffer


def test_disable_autocast_keeps_dtypes() -> None:
    x = torch.ones(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch._C._is_any_autocast_enabled()
        assert torch.mm(x, x).dtype == torch.bfloat16
        with torch._C._DisableAutocast():
            assert torch.mm(x, x).dtype == torch.float32
    assert not torch._C._is_any_autocast_enabled()


def test_the_global_state_guard_sees_grad_mode() -> None:
    guard = _compile._global_state()
    assert guard.check()
    with torch.no_grad():
        assert not guard.check()


def test_dynamo_reads_the_disable_marks_fdp_sets() -> None:
    # fdp sets on its functions the two attributes torch._dynamo.disable(recursive=False) sets:
    # the same names, or dynamo would trace into fdp's calls (tests/test_compile.py checks the
    # whole behaviour, with fullgraph=True).
    marked = torch._dynamo.disable(lambda: None, recursive=False, reason="why")
    assert marked._torchdynamo_disable is True and marked._torchdynamo_disable_msg == "why"


def test_compiled_graphs_are_counted_and_compiled_modules_recognized() -> None:
    torch._dynamo.reset()
    try:
        before = _compile._graphs_compiled()
        torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
        assert _compile._graphs_compiled() == before + 1
        compiled = torch.compile(nn.Linear(2, 2), backend="eager")
        assert isinstance(compiled, _functional_call.compiled_module_type())
    finally:
        torch._dynamo.reset()


def test_a_compiled_module_check_without_optimized_module_fails_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Not a check skipped in silence (it used to be): the compiled module would run on its own
    # module's tensors, not the call's.
    import torch._dynamo.eval_frame

    monkeypatch.delattr(torch._dynamo.eval_frame, "OptimizedModule")
    with pytest.raises(AttributeError, match="OptimizedModule"):
        fdp.functional_call(nn.Linear(2, 2), {}, (torch.ones(1, 2),))


def test_optrees_registry_is_a_dict_of_registrations() -> None:
    class Node:
        pass

    optree.register_pytree_node(Node, lambda n: ((), None), lambda _, c: Node(), namespace="canary")
    try:
        assert ("canary", Node) in fdp._tree._registrations()
    finally:
        optree.unregister_pytree_node(Node, namespace="canary")


# --- random ops: every kernel that draws is routed by fdp.rng_scope, refused, or accounted for ---

# Ops tagged nondeterministic_seeded that take no generator, and that fdp.rng_scope neither
# routes nor refuses, with why. A new torch's new seeded op fails the test below until it is
# routed, refused (fdp._random._INTERNAL_DROPOUT, _KEPT_STATE_RNN) or listed here.
NOT_ROUTED = {
    "_fused_sdp_choice": "picks a backend, draws nothing",
    "_fill_mem_eff_dropout_mask_": "takes its seed and offset as arguments",
    "_flash_attention_forward_no_dropout_inplace": "no dropout",
    "_cudnn_attention_forward_no_dropout_inplace": "no dropout",
    "_nested_tensor_softmax_with_shape": "draws nothing",
    # Backward kernels replay the forward's mask from the seed and offset it returned.
    "_cudnn_attention_backward": "backward",
    "_scaled_dot_product_cudnn_attention_backward": "backward",
    "_scaled_dot_product_efficient_attention_backward": "backward",
    # The state that the scope builds for _cudnn_rnn, from a seed it draws.
    "_cudnn_init_dropout_state": "takes its seed as an argument",
}


def _seeded_ops_without_generator() -> set[tuple[str, Any]]:
    found = set()
    for schema in torch._C._jit_get_all_schemas():
        namespace, _, name = schema.name.partition("::")
        if namespace != "aten" or any(a.name == "generator" for a in schema.arguments):
            continue
        op = getattr(getattr(torch.ops.aten, name), schema.overload_name or "default")
        if torch.Tag.nondeterministic_seeded in op.tags:
            found.add((name, op))
    return found


def test_every_seeded_op_is_routed_refused_or_accounted_for() -> None:
    unaccounted = []
    for name, op in sorted(_seeded_ops_without_generator(), key=lambda pair: str(pair[1])):
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
            continue  # decomposed before it reaches the scope's mode, which sees what it calls
        routed = op.overloadpacket in (torch.ops.aten.native_dropout, torch.ops.aten._cudnn_rnn) or (
            name in _random._RANDOM_OPS_WITHOUT_GENERATOR and _random._generator_overload(op) is not None
        )
        refused = op.overloadpacket in _random._INTERNAL_DROPOUT | _random._KEPT_STATE_RNN
        if not (routed or refused or name in NOT_ROUTED):
            unaccounted.append(str(op))
    assert not unaccounted, (
        f"torch {torch.__version__} has seeded ops that fdp.rng_scope neither routes nor refuses: "
        f"{unaccounted}"
    )


def test_refused_kernels_name_their_dropout_p() -> None:
    # The refusal reads dropout_p by name: a kernel that renamed it would be let through.
    for packet in _random._INTERNAL_DROPOUT:
        for overload in packet.overloads():
            names = [a.name for a in getattr(packet, overload)._schema.arguments]
            assert "dropout_p" in names, f"{packet}.{overload}: {names}"


def test_rnn_kernels_name_their_dropout_arguments() -> None:
    # The scope reads an RNN kernel's dropout and train, and replaces cuDNN's dropout_state, by
    # name: a kernel that renamed one would fail inside every scope.
    for packet in {torch.ops.aten._cudnn_rnn} | _random._KEPT_STATE_RNN:
        for overload in packet.overloads():
            names = [a.name for a in getattr(packet, overload)._schema.arguments]
            assert {"dropout", "train"} <= set(names), f"{packet}.{overload}: {names}"
    for overload in torch.ops.aten._cudnn_rnn.overloads():
        assert "dropout_state" in [
            a.name for a in getattr(torch.ops.aten._cudnn_rnn, overload)._schema.arguments
        ]


def test_random_ops_take_their_generator_by_name() -> None:
    assert _random._generator_slot(torch.ops.aten.bernoulli.default) is not None
    assert _random._generator_overload(torch.ops.aten.rand.default) is torch.ops.aten.rand.generator
