"""``fdp.parallel_apply``: run prepared per-replica calls on the replica pool."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from . import _devices, _pool, _tree

__all__ = ["parallel_apply"]

R = TypeVar("R")


def _device_of(tree: Any) -> torch.device:
    for leaf in _tree.flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def parallel_apply(
    fns: Callable[..., R] | Sequence[Callable[..., R]],
    inputs: Sequence[Any],
    kwargs: Sequence[Mapping[str, Any] | None] | None = None,
    *,
    devices: Sequence[_devices.DeviceLike] | None = None,
) -> list[R]:
    """Calls ``fns[i](*inputs[i], **kwargs[i])`` for every ``i`` in parallel, one replica each.

    The counterpart of ``torch.nn.parallel.parallel_apply`` on fdp's persistent replica threads:
    the caller's grad mode, inference mode and autocast state (dtype included) apply in every
    replica, and a failing replica's own exception object is re-raised, with notes naming the
    replica, its device and the other replicas' failures.

    Args:
        fns: one callable for every replica, or one callable for all of them.
        inputs: one entry per replica: a tuple of positional arguments, or a single argument.
        kwargs: one dict of keyword arguments (or ``None``) per replica. Default: ``None``.
        devices: the replicas' devices. Keyword-only. Default: ``None``, the device of the first
            tensor in each replica's inputs (CPU if it has none).

    Returns:
        The replicas' results, in order.

    Raises:
        RuntimeError: called inside a mapped function, or under a ``torch.func`` transform
            (whose result the replicas in other threads would silently escape); with several
            inputs, under a tracer of the caller's operations (``torch.func.linearize``,
            ``make_fx``, ``torch.jit.trace``, ``torch.export``), which they would escape too.

    Examples:
        >>> import torch, fdp
        >>> fdp.parallel_apply(torch.square, [(torch.tensor(2.0),), (torch.tensor(3.0),)],
        ...                    devices=["cpu", "cpu"])
        [tensor(4.), tensor(9.)]
    """
    caller = "fdp.parallel_apply"
    if torch._C._functorch.peek_interpreter_stack() is not None:
        # As for fdp.pmap: replica 0 would run under the transform and the others not, so part
        # of the result would silently be wrong (zero gradients), and which part would depend
        # on which replicas the caller happened to run itself. Refused for one input too, so
        # that whether a call works does not depend on how many inputs it gets.
        raise _pool.under_transform_error(
            caller,
            inside="the functions",
            example="fdp.parallel_apply(torch.func.grad(loss_fn), inputs)",
            outputs="the results",
        )
    try:
        n = len(inputs)
    except TypeError:  # a generator, None: said in fdp's words, not as len() says it
        raise TypeError(
            f"{caller}: inputs must be a sequence with one entry per replica (a list of argument "
            f"tuples), got {type(inputs).__name__}: {_tree.short_repr(inputs)}"
        ) from None
    if n == 0:
        raise ValueError(f"{caller} needs at least one input, got an empty sequence")
    if isinstance(fns, (list, tuple, nn.ModuleList)):
        fns = list(fns)
    elif callable(fns):
        fns = [fns] * n
    else:
        raise TypeError(
            f"{caller}: fns must be a callable or a sequence of them, got {type(fns).__name__}: "
            f"{_tree.short_repr(fns)}"
        )
    if len(fns) != n:
        raise ValueError(
            f"{caller}: fns must be one callable, or one per input, got {len(fns)} functions for {n} inputs"
        )
    per_kwargs: Sequence[Mapping[str, Any] | None] = [None] * n if kwargs is None else kwargs
    try:
        given = len(per_kwargs)
    except TypeError:  # a generator: said in fdp's words, not as len() says it
        raise TypeError(
            f"{caller}: kwargs must be a sequence with one dict of keyword arguments per input "
            f"(or None), got {type(kwargs).__name__}: {_tree.short_repr(kwargs)}"
        ) from None
    if given != n:
        _refuse_one_dict_of_kwargs(kwargs, n, caller)
        raise ValueError(
            f"{caller}: kwargs must have one dict of keyword arguments (or None) per input, got "
            f"{given} kwargs for {n} inputs"
        )
    args = [x if isinstance(x, tuple) else (x,) for x in inputs]
    if devices is None:
        resolved = tuple(_device_of((a, k)) for a, k in zip(args, per_kwargs))
    else:
        resolved = _devices.resolve_devices(devices, what=f"{caller} devices")
        if len(resolved) != n:
            raise ValueError(
                f"{caller}: devices must name one device per input, got {len(resolved)} devices for "
                f"{n} inputs"
            )
    try:
        replicas = [functools.partial(fn, *a, **(k or {})) for fn, a, k in zip(fns, args, per_kwargs)]
    except TypeError:
        # functools.partial's words ("the first argument must be callable", "argument after **
        # must be a mapping") name neither the call nor the entry: found here, on failure only.
        _refuse_one_dict_of_kwargs(kwargs, n, caller)
        for i, (fn, k) in enumerate(zip(fns, per_kwargs)):
            if not callable(fn):
                raise TypeError(
                    f"{caller}: fns[{i}] must be callable, got {type(fn).__name__}: {_tree.short_repr(fn)}"
                ) from None
            if k is not None and not isinstance(k, Mapping):
                raise TypeError(
                    f"{caller}: kwargs[{i}] must be a dict of keyword arguments or None, got "
                    f"{type(k).__name__}: {_tree.short_repr(k)}"
                ) from None
        raise
    if n > 1:
        _pool.ensure_not_traced(
            caller,
            advice="Trace it with one input (which runs in the calling thread, where it is "
            "traced), or trace inside the functions",
        )
    tensors: list[list[torch.Tensor]] | None = None
    if any(d.type == "cuda" for d in resolved):
        tensors = [
            [t for t in _tree.flatten((a, k))[0] if isinstance(t, torch.Tensor)]
            for a, k in zip(args, per_kwargs)
        ]
    return _pool.run_replicas(resolved, replicas, caller=caller, inputs=tensors)


def _refuse_one_dict_of_kwargs(kwargs: Any, n: int, caller: str) -> None:
    """Raises if ``kwargs`` is one dict of keyword arguments rather than one per input (as
    ``torch.nn.parallel.parallel_apply`` takes them too): its keys would be taken for the
    replicas' dicts."""
    if isinstance(kwargs, Mapping):
        raise TypeError(
            f"{caller}: kwargs must be a sequence with one dict of keyword arguments per input "
            f"(or None), got one {type(kwargs).__name__}: {_tree.short_repr(kwargs)}; for the same "
            f"keyword arguments in every replica, pass [kwargs] * {n}"
        ) from None
