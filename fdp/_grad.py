"""``fdp.grad`` and ``fdp.value_and_grad``: ``torch.func.grad``'s gradients, taken by autograd.

``torch.func.grad`` wraps every input and every intermediate tensor for its transform, and pays
for that on every op: for the small models of ``benchmarks/`` on a CPU its gradients cost 40-100%
more than ``torch.autograd.grad``'s (see docs/benchmarks.md), a price a training step pays on
every call. First-order gradients outside other transforms need none of it: these take them with
``torch.autograd.grad`` on detached copies of the differentiated arguments, and are
``torch.func.grad`` itself where its transform is what makes them right: inside
``torch.compile`` (which traces ``torch.func.grad`` in one graph), inside a ``torch.func``
transform (``vmap`` for per-example gradients), inside another ``fdp.grad`` (gradients of
gradients), where an autograd outside the call could differentiate through it, and under
inference mode or of inference tensors (see ``_beyond_autograd``).

Collectives called by the differentiated function take their differentiable form, with JAX's
transposes, as under ``torch.func.grad`` (see ``fdp._collectives._run``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch

from . import _replica, _tree

__all__ = ["grad", "value_and_grad", "differentiating"]


_NONE = object()  # no fdp.grad by autograd is running in this thread


class _Running(threading.local):
    # The replica (None outside mapped functions) in which this thread's innermost fdp.grad by
    # autograd runs its function. A replica, not a count: a pmap (or DataParallel) called inside
    # that function runs its replica 0 in this same thread, and that replica's collectives must
    # take the form of its siblings' on the workers, which fdp.grad does not differentiate (the
    # whole pmapped call is differentiated as by loss.backward()).
    replica: object = _NONE


_local = _Running()
_NOTHING = contextlib.nullcontext()


def differentiating() -> bool:
    """Whether this thread runs, in the current replica, a function that ``fdp.grad``
    differentiates by autograd."""
    return _local.replica is _replica.current()


def grad(
    fn: Callable[..., Any], *, argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """The gradient of ``fn`` with respect to its argument ``argnums``: ``torch.func.grad``,
    faster where it can be.

    ``fn`` returns a real scalar tensor (a loss); the gradient is a tree like the argument
    (``fn(params, x, y)`` with a dict of parameters gives a dict of gradients). Outside other
    transforms the gradients are taken with ``torch.autograd.grad`` on detached copies of the
    argument's tensors, which for a small model costs a fraction of ``torch.func.grad``'s
    per-op wrapping; inside ``torch.compile``, inside ``torch.func`` transforms (``vmap`` over
    it for per-example gradients) and inside another ``fdp.grad`` it is ``torch.func.grad``.
    Collectives in ``fn`` (``fdp.pmean`` of the loss, say) are differentiated as under
    ``torch.func.grad``. A ``fdp.pmap`` or ``fdp.DataParallel`` called by ``fn`` (which
    ``torch.func.grad`` refuses) is differentiated as a whole, as ``loss.backward()`` does,
    wherever ``fdp.grad`` is not ``torch.func.grad`` itself (below; where it is, the call is
    refused as under ``torch.func.grad``: detach the arguments that require grad, or call
    ``fdp.grad`` under ``torch.no_grad()``).

    Where an autograd outside the call could differentiate through it (grad mode is on and a
    tensor among the arguments requires grad, or a forward-mode dual level is open) it is
    ``torch.func.grad`` too, whose gradients, value and ``aux`` that autograd differentiates.
    It is ``torch.func.grad`` as well under ``torch.inference_mode`` and where an argument is
    an inference tensor, which autograd records nothing for or cannot save for backward.
    What ``torch.func.grad`` does not support yet (activation checkpointing, a module's full
    backward hooks) then fails with its error, with a note saying why ``fdp.grad`` ran as
    ``torch.func.grad`` and how to have it take the gradients by autograd.
    Otherwise the gradients are not differentiable further (as ``torch.autograd.grad``'s
    without ``create_graph``), and tensors that ``fn`` reaches other than through its
    arguments (the parameters of a module it calls directly) are constants: an outer
    ``backward()`` through the gradients, for a gradient penalty say, gets no gradient for
    them. Use ``torch.func.grad`` there, or pass them as arguments. For gradients of gradients
    nest ``fdp.grad`` (the inner one is then ``torch.func.grad``).

    Args:
        fn: the function to differentiate, returning a real scalar tensor (and, with
            ``has_aux``, a ``(value, aux)`` pair).
        argnums: the position of the argument to differentiate with respect to, or a tuple of
            positions (the gradient is then a tuple, one tree per position). Its tensors must
            be floating-point or complex. Keyword-only. Default: ``0``.
        has_aux: whether ``fn`` returns ``(value, aux)``; the gradient is then returned as
            ``(grads, aux)``, with ``aux``'s tensors detached (but where an outer autograd
            could differentiate through the call, as above). Keyword-only. Default: ``False``.

    Returns:
        A function of ``fn``'s arguments that returns the gradient (with ``aux``, as above).

    Raises:
        TypeError: ``argnums`` is not an int or a tuple of ints; a differentiated leaf is not a
            floating-point or complex tensor; ``fn`` returns anything but a real scalar tensor
            (or a pair with ``has_aux``).
        ValueError: ``argnums`` names one argument twice (``(1, -1)`` for two arguments).

    Examples:
        >>> import torch, fdp
        >>> def loss_fn(params, x):
        ...     return ((x @ params["w"]) ** 2).sum()
        >>> fdp.grad(loss_fn)({"w": torch.ones(2)}, torch.tensor([[1.0, 2.0]]))
        {'w': tensor([ 6., 12.])}

        In a training step, the replica's gradients, then their mean over the replicas:

        >>> @fdp.pmap(axis_name="i", devices=["cpu"] * 2, in_axes=(None, 0), out_axes=None)
        ... def mean_grads(params, x):
        ...     return fdp.pmean(fdp.grad(loss_fn)(params, x), "i", weight=x.shape[0])
        >>> mean_grads({"w": torch.ones(2)}, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        {'w': tensor([24., 34.])}
    """
    return _transform(fn, argnums, has_aux, with_value=False, name="fdp.grad")


def value_and_grad(
    fn: Callable[..., Any], *, argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """``fn``'s value and its gradient, as ``jax.value_and_grad`` (``torch.func.grad_and_value``
    returns them the other way round): see :func:`grad`.

    Args:
        fn: as for :func:`grad`.
        argnums: as for :func:`grad`. Keyword-only. Default: ``0``.
        has_aux: whether ``fn`` returns ``(value, aux)``: then ``((value, aux), grads)`` is
            returned. Keyword-only. Default: ``False``.

    Returns:
        A function of ``fn``'s arguments that returns ``(value, grads)``, the value detached
        (but where an outer autograd could differentiate through the call: see :func:`grad`).

    Examples:
        >>> import torch, fdp
        >>> loss, grads = fdp.value_and_grad(lambda w: (w**2).sum())(torch.tensor([1.0, 2.0]))
        >>> loss, grads
        (tensor(5.), tensor([2., 4.]))
    """
    return _transform(fn, argnums, has_aux, with_value=True, name="fdp.value_and_grad")


def _transform(
    fn: Callable[..., Any], argnums: int | tuple[int, ...], has_aux: bool, *, with_value: bool, name: str
) -> Callable[..., Any]:
    if not callable(fn):
        raise TypeError(f"{name}: fn must be callable, got {_tree.describe(fn)}: {_tree.short_repr(fn)}")
    positions = _positions(argnums, name)
    has_aux = _tree.check_flag(has_aux, f"{name}: has_aux")  # (a NumPy bool as a bool)

    @functools.wraps(fn)
    def transformed(*args: Any, **kwargs: Any) -> Any:
        # The differentiated arguments, flattened once for whichever way runs.
        where, flat = _differentiated(argnums, positions, args, name)
        # is_compiling first: dynamo then traces torch.func.grad (on fdp's leaves), and none of
        # the tests below.
        if torch.compiler.is_compiling():
            trees, value = _by_func(fn, has_aux, args, kwargs, name, where, flat)
        elif torch._C._functorch.peek_interpreter_stack() is not None or differentiating():
            with _out_of_inference_mode():
                trees, value = _by_func(fn, has_aux, args, kwargs, name, where, flat)
        elif _beyond_autograd(args, kwargs, where, flat):
            try:
                with _out_of_inference_mode():
                    trees, value = _by_func(fn, has_aux, args, kwargs, name, where, flat)
            except Exception as error:
                # What torch.func does not support yet (activation checkpointing's saved-tensor
                # hooks, a module's full backward hooks) fails here with torch.func's words,
                # where the caller asked for fdp.grad and the same call by autograd works.
                text = str(error)
                if "torch.func" in text or "functorch" in text:
                    with contextlib.suppress(Exception):  # an exception type that refuses notes
                        error.add_note(_why_by_func(args, kwargs, where, flat, name))
                raise
        else:
            trees, value = _by_autograd(fn, has_aux, args, kwargs, name, where, flat)
        grads = trees if isinstance(argnums, tuple) else trees[0]
        return (value, grads) if with_value else ((grads, value[1]) if has_aux else grads)

    return transformed


def _beyond_autograd(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    positions: tuple[int, ...],
    flat: list[tuple[list[Any], Any]],
) -> bool:
    """Whether the gradients need torch.func.grad, as autograd on detached copies would get
    them wrong:

    * an autograd outside the call could differentiate through its result (a forward-mode dual
      level is open, or grad mode is on and an argument's tensor requires grad): the gradients
      it should follow back (to the arguments themselves, or to a tensor that requires grad
      passed beside them) would be constants, silently;
    * inference mode, where autograd records no graph, enable_grad or not (the gradients would
      be silently zero), or an argument that is an inference tensor (a batch made under
      inference mode), which autograd cannot save for backward: torch.func.grad differentiates
      both (in inference mode, the inference tensors in ``fn``'s closure too).

    ``positions`` and ``flat``: the differentiated arguments' positions and leaves (see
    :func:`_differentiated`), looked at as they are; only the other arguments are flattened.
    """
    if torch.autograd.forward_ad._current_level >= 0 or torch.is_inference_mode_enabled():
        return True
    outside = torch.is_grad_enabled()
    others = _tree.flatten(([a for k, a in enumerate(args) if k not in positions], kwargs))[0]
    return any(
        isinstance(leaf, torch.Tensor) and ((outside and leaf.requires_grad) or leaf.is_inference())
        for leaf in chain(others, *(leaves for leaves, _ in flat))
    )


def _out_of_inference_mode() -> contextlib.AbstractContextManager[Any]:
    """Out of inference mode, for torch.func.grad: there torch 2.11's records nothing either,
    and its gradients come back as zeros (2.13's are taken)."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else _NOTHING


def _why_by_func(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    positions: tuple[int, ...],
    flat: list[tuple[list[Any], Any]],
    name: str,
) -> str:
    """Why ``name`` ran as torch.func.grad (see :func:`_beyond_autograd`), and how to have it
    take its gradients by autograd: a note on a failure of torch.func's."""
    ran = f"{name} ran as torch.func.grad here, as"
    by_autograd = (
        "to have the gradients taken by torch.autograd.grad, which needs none of torch.func's "
        "support (they are then not differentiable further)"
    )
    if torch.autograd.forward_ad._current_level >= 0:
        return (
            f"{ran} a forward-mode dual level is open (torch.autograd.forward_ad), whose "
            f"tangents it follows: call it outside the level {by_autograd}"
        )
    if torch.is_inference_mode_enabled():
        return (
            f"{ran} it was called under torch.inference_mode, where autograd records nothing: "
            f"call it outside inference mode {by_autograd}"
        )
    paths: list[tuple[str, Any]] = []
    for k, (leaves, _) in zip(positions, flat):
        paths.extend(zip(_tree.flatten_with_paths(args[k], f"args[{k}]")[0], leaves))
    for k, arg in enumerate(args):
        if k not in positions:
            paths.extend(zip(*_tree.flatten_with_paths(arg, f"args[{k}]")[:2]))
    paths.extend(zip(*_tree.flatten_with_paths(kwargs, "kwargs")[:2]))
    tensors = [(path, leaf) for path, leaf in paths if isinstance(leaf, torch.Tensor)]
    inference = next((path for path, leaf in tensors if leaf.is_inference()), None)
    if inference is not None:
        return (
            f"{ran} {inference} is an inference tensor (made under torch.inference_mode), which "
            f"autograd cannot save for backward: pass a clone made outside inference mode {by_autograd}"
        )
    grad = next((path for path, leaf in tensors if leaf.requires_grad), "an argument")
    return (
        f"{ran} {grad} requires grad under grad mode (an autograd outside the call could "
        "differentiate through the gradients): pass the arguments detached ({k: v.detach() for "
        f"k, v in params.items()}}), or call it under torch.no_grad(), {by_autograd}"
    )


def _positions(argnums: Any, name: str) -> tuple[int, ...]:
    """``argnums`` as a tuple of positions, checked."""
    many = isinstance(argnums, tuple)
    positions = argnums if many else (argnums,)
    if (many and not positions) or not all(type(k) is int for k in positions):
        raise TypeError(
            f"{name}: argnums must be an int or a non-empty tuple of ints (the positions of the "
            f"arguments to differentiate), got {_tree.short_repr(argnums)}"
        )
    return positions


def _by_autograd(
    fn: Callable[..., Any],
    has_aux: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    name: str,
    positions: tuple[int, ...],
    flat: list[tuple[list[torch.Tensor], Any]],
) -> tuple[Any, Any]:
    """``(grads, value)`` by autograd: a gradient tree for each argument at ``positions``,
    flattened in ``flat`` (see :func:`_differentiated`), and the value (with ``aux``) as
    ``torch.func.grad_and_value`` returns it."""
    given = list(args)
    trees = []  # each differentiated argument's structure and the detached copies of its leaves
    for k, (leaves, spec) in zip(positions, flat):
        copies = [leaf.detach().requires_grad_() for leaf in leaves]
        trees.append((spec, copies))
        given[k] = _tree.unflatten(spec, copies)
    outer, _local.replica = _local.replica, _replica.current()
    try:
        with torch.enable_grad():
            out = fn(*given, **kwargs)
    finally:
        _local.replica = outer
    value, aux = _value_and_aux(out, has_aux, name)
    inputs = [c for _, copies in trees for c in copies]
    if value.requires_grad and inputs:
        computed = torch.autograd.grad(value, inputs, allow_unused=True, materialize_grads=True)
    else:  # the value depends on none of them (torch.func.grad gives zeros too)
        computed = tuple(torch.zeros_like(c) for c in inputs)
    grads, start = [], 0
    for spec, copies in trees:
        grads.append(_tree.unflatten(spec, list(computed[start : start + len(copies)])))
        start += len(copies)
    value = value.detach()
    return tuple(grads), ((value, _detached(aux)) if has_aux else value)


def _differentiated(
    argnums: int | tuple[int, ...], positions: tuple[int, ...], args: tuple[Any, ...], name: str
) -> tuple[tuple[int, ...], list[tuple[list[torch.Tensor], Any]]]:
    """The differentiated positions, counted from the start, and the leaves and structure of
    each differentiated argument, flattened in fdp's namespace (plain dataclasses and ``None``
    are nodes there), checked."""
    if not all(-len(args) <= k < len(args) for k in positions):
        raise TypeError(
            f"{name}(fn)(*args): argnums={argnums!r} is out of range for {len(args)} positional arguments"
        )
    # Counted from the end or not, each position once: the second copy of a repeated argument
    # would replace the first in fn's arguments, and the first's gradient be silently zero.
    positions = tuple(k % len(args) for k in positions)
    if len(set(positions)) < len(positions):
        twice = next(k for k in positions if positions.count(k) > 1)
        raise ValueError(
            f"{name}(fn)(*args): argnums={argnums!r} names args[{twice}] twice: each argument "
            "is differentiated once, so give each position once"
        )
    flat = []
    for k in positions:
        leaves, spec = _tree.flatten(args[k])
        for i, leaf in enumerate(leaves):
            if not (isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())):
                path = _tree.flatten_with_paths(args[k], f"args[{k}]")[0][i]
                raise TypeError(
                    f"{name}(fn)(*args): {path} is {_tree.describe(leaf)}: the differentiated "
                    "arguments must be trees of floating-point or complex tensors"
                )
        flat.append((leaves, spec))
    return positions, flat


def _value_and_aux(out: Any, has_aux: bool, name: str) -> tuple[Any, Any]:
    """``fn``'s value and aux (None without ``has_aux``), checked: by either path, so that
    which one runs changes no error (torch.func.grad's own would take an integer value's
    gradient for zeros, silently)."""
    if not has_aux:
        value, aux = out, None
    elif not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"{name}(fn, has_aux=True)(*args): fn must return a (value, aux) pair, got "
            f"{_tree.describe(out)}: {_tree.short_repr(out)}"
        )
    else:
        value, aux = out
    if not (isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype.is_floating_point):
        what = (
            f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
            if isinstance(value, torch.Tensor)
            else _tree.describe(value)
        )
        raise TypeError(
            f"{name}(fn)(*args): fn must return a real floating-point scalar tensor (a loss), "
            f"got {what}{' as its value' if has_aux else ''}"
        )
    return value, aux


def _by_func(
    fn: Callable[..., Any],
    has_aux: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    name: str,
    positions: tuple[int, ...],
    flat: list[tuple[list[torch.Tensor], Any]],
) -> tuple[Any, Any]:
    """``(grads, value)`` by ``torch.func.grad_and_value``, on trees as fdp flattens them (as
    :func:`_by_autograd` returns them).

    torch.func flattens with torch's pytrees, where a plain dataclass or ``None`` is a leaf it
    refuses ("must be Tensor"), and takes only tensors in ``aux``: given the leaves of fdp's
    trees, it differentiates the arguments and returns the ``aux`` that the autograd path does.
    (``positions``, ``flat``: as for :func:`_by_autograd`.)
    """
    # Compiled, a graph break inside fn (fdp.rng_scope, a collective) makes dynamo run
    # grad_and_value eagerly, and a tree structure made in the graph that lived across it came
    # back wrongly rebuilt (unflatten failed with "length mismatch: [2, 4]"). So the arguments'
    # structures are made where they are used: on_leaves and the grads flatten them again.
    # (aux's is made in on_leaves, after fn, on the same side of its breaks as its use.)
    aux_rest: list[tuple[Any, list[Any], list[bool]]] = []  # aux's structure and non-tensor leaves

    def on_leaves(*leaf_lists: list[torch.Tensor]) -> Any:
        given = list(args)
        for k, leaves in zip(positions, leaf_lists):
            given[k] = _tree.unflatten(_tree.flatten(args[k])[1], leaves)
        value, aux = _value_and_aux(fn(*given, **kwargs), has_aux, name)
        if not has_aux:
            return value
        leaves, spec = _tree.flatten(aux)
        tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        aux_rest.append((spec, leaves, tensor))
        return value, [leaf for leaf, t in zip(leaves, tensor) if t]

    grads, value = torch.func.grad_and_value(on_leaves, argnums=tuple(range(len(flat))), has_aux=has_aux)(
        *(leaves for leaves, _ in flat)
    )
    trees = tuple(_tree.unflatten(_tree.flatten(args[k])[1], list(g)) for k, g in zip(positions, grads))
    if has_aux:
        value, tensors = value
        spec, leaves, tensor = aux_rest[-1]
        returned = iter(tensors)
        value = (
            value,
            _tree.unflatten(spec, [next(returned) if t else leaf for leaf, t in zip(leaves, tensor)]),
        )
    return trees, value


def _detached(tree: Any) -> Any:
    leaves, spec = _tree.flatten(tree)
    return _tree.unflatten(spec, [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves])
