"""Functional optimizers on pytrees, optax-style: ``init``/``update`` pairs, matching torch.optim.

A :class:`GradientTransformation` is a pair of pure functions. ``init(params)`` makes the state;
``update(grads, state, params)`` returns ``(updates, new_state)``, and
:func:`apply_updates` adds the updates to the parameters. Nothing is modified in place, so the
state can live on the devices as :class:`fdp.PerReplica` leaves and pass through a pmapped
training step.

Each optimizer follows its ``torch.optim`` counterpart's single-tensor algorithm op by op, with
the ``torch._foreach_*`` version of each op (the same kernels, over all leaves at once), and
computes the new parameters as torch does; its update is ``new - params``. Where a parameter is
large next to its step (the usual case) that difference is exact and :func:`apply_updates`
gives back torch's parameters bit for bit; where it is not, they differ by rounding (one unit in
the last place), far less than a naively composed update (``-lr * direction``), whose rounding
Adam's normalisation amplifies. The tests hold 100 steps to 1e-6 of ``torch.optim`` (1e-5 for
complex parameters). A parameter that is infinite (a step diverged) takes ``inf - inf``, NaN, as
its next update, where torch's stays infinite: :meth:`GradientTransformation.apply_gradients`
gives torch's.

Like ``torch.optim``, updates are computed without autograd (``torch.no_grad``): parameters
that require grad do not grow a graph step after step.

:meth:`GradientTransformation.apply_gradients` does ``update`` and :func:`apply_updates` in one:
for these optimizers (and a :func:`chain` ending in one, and :func:`multi_transform`'s labels
stepped by them) it returns the new parameters as computed, torch's own, without the two
extra passes over every parameter that forming ``new - params`` and adding it back take. For a
model of a few megabytes, those passes cost as much as its forward pass on a small batch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, Generic, NamedTuple, NoReturn, Protocol

import optree
import torch
from typing_extensions import TypeVar

from . import _axes, _tree
from ._compile import eager_under_compile
from ._state import PerReplica

__all__ = [
    "GradientTransformation",
    "TransformUpdateFn",
    "Schedule",
    "EmptyState",
    "SgdState",
    "AdamState",
    "MultiTransformState",
    "sgd",
    "adam",
    "adamw",
    "clip_by_global_norm",
    "chain",
    "multi_transform",
    "apply_updates",
]

Tree = Any

# A transformation's state type. Defaulting to Any (PEP 696), a bare ``GradientTransformation``
# in user code stays what it was before the class was generic, under ``mypy --strict`` too.
StateT = TypeVar("StateT", default=Any)

Schedule = Callable[[int], float]
"""A learning rate that changes with the step (optax's ``Schedule``): called with the number of
steps taken before the one it is for (0 for the first), as ``torch.optim.lr_scheduler.LambdaLR``
gives ``lr_lambda`` the count of its ``step()`` calls."""


class TransformUpdateFn(Protocol[StateT]):
    """The type of :class:`GradientTransformation`'s ``update``: ``update(grads, state,
    params=None)`` returns ``(updates, new_state)`` (optax's ``TransformUpdateFn``).

    ``params`` may be left out where the transformation needs none (:func:`clip_by_global_norm`);
    an ``update`` must therefore take it as optional. The parameters are positional-only here,
    so that an ``update`` may name them as it likes (``updates``, ``s``, ``p``).

    Examples:
        >>> import torch
        >>> from fdp import optim
        >>> def halve(grads, state, params=None):
        ...     return {k: g / 2 for k, g in grads.items()}, state
        >>> update: optim.TransformUpdateFn = halve
        >>> optim.GradientTransformation(lambda params: (), update).update({"w": torch.ones(1)}, ())[0]
        {'w': tensor([0.5000])}
    """

    def __call__(self, grads: Tree, state: StateT, params: Tree | None = None, /) -> tuple[Tree, StateT]: ...


class GradientTransformation(NamedTuple, Generic[StateT]):
    """An optimizer as a pair of pure functions (optax's interface).

    ``init(params)`` returns the optimizer state; ``update(grads, state, params)`` returns
    ``(updates, new_state)``. Generic in the state's type, for type checkers:
    ``sgd(...)`` is a ``GradientTransformation[SgdState]``, so a state from another optimizer
    is a type error before it is a ``ValueError``.

    Examples:
        >>> import torch
        >>> from fdp import optim
        >>> double = lambda grads, state, params=None: ({"w": 2 * grads["w"]}, state)
        >>> scale_by_two = optim.GradientTransformation(lambda params: (), double)
        >>> scale_by_two.update({"w": torch.ones(1)}, scale_by_two.init(None))[0]
        {'w': tensor([2.])}
    """

    init: Callable[[Tree], StateT]
    update: TransformUpdateFn[StateT]

    def apply_gradients(self, grads: Tree, state: StateT, params: Tree) -> tuple[Tree, StateT]:
        """One optimizer step: the new parameters and the new state (flax's
        ``TrainState.apply_gradients``, functionally).

        The result of ``update`` followed by :func:`apply_updates`. fdp's optimizers, a
        :func:`chain` that ends in one, and :func:`multi_transform` (for each label stepped by
        one of them) compute it in one pass: the parameters come back as
        ``torch.optim`` computes them, bit for bit where it runs the same kernels, with no
        update tensors formed and added back (two passes over every parameter, without autograd).

        Args:
            grads: the gradients, a tree like ``params``.
            state: the optimizer state (from ``init`` or the last step).
            params: the parameters.

        Returns:
            ``(new_params, new_state)``.

        Examples:
            >>> import torch
            >>> from fdp import optim
            >>> opt = optim.sgd(0.1)
            >>> params = {"w": torch.ones(2)}
            >>> params, state = opt.apply_gradients({"w": torch.ones(2)}, opt.init(params), params)
            >>> params
            {'w': tensor([0.9000, 0.9000])}
        """
        fused = _fused(self.update)
        if fused is not None:
            return fused(grads, state, params)
        updates, new_state = self.update(grads, state, params)
        return apply_updates(params, updates), new_state


# The one-pass apply_gradients of an update function is an attribute of the function: kept beside
# the pair, not in it, so that a GradientTransformation stays a pair (code unpacks it as
# ``init, update = opt``), and found again when a pair is rebuilt from the same functions. An
# attribute rather than a registry keyed by the function: under torch.compile dynamo guards an
# attribute read on its source (the optimizer passed in), where it took a registry lookup for a
# constant and ran the first optimizer's step for every later one (adam's for an adamw).
_ONE_PASS = "_fdp_one_pass"


def _fused(update: Callable[..., Any]) -> Callable[[Tree, Any, Tree], tuple[Tree, Any]] | None:
    """The one-pass step attached to ``update``, if any. An ``update`` may be any callable,
    including one that takes no attributes (a slotted object): it has none."""
    attached = getattr(update, _ONE_PASS, None)
    # Only the function it was attached to: functools.wraps copies a function's __dict__, this
    # attribute among it, onto a wrapper of the user's, whose changes to the gradients the
    # wrapped optimizer's one-pass step would skip, silently.
    if attached is None or attached[0] is not update:
        return None
    return attached[1]  # type: ignore[no-any-return]


def _attach(update: Callable[..., Any], apply: Callable[[Tree, Any, Tree], tuple[Tree, Any]]) -> None:
    setattr(update, _ONE_PASS, (update, apply))


# step(grads, params, spec, state, buffers, lr) -> (new parameters, new state), on leaf lists;
# spec is the gradients' structure, for trees in the new state; buffers holds the leaves of the
# state's trees named by the optimizer (momentum, moments), checked to have that structure; lr
# is the learning rate of this step.
_Step = Callable[[Any, Any, optree.PyTreeSpec, Any, list[Any], float | torch.Tensor], tuple[Any, Any]]


class _Counted(Protocol):
    """The state of an optimizer made by :func:`_optimizer`: it counts the steps taken."""

    @property
    def step(self) -> int: ...


_CountedT = TypeVar("_CountedT", bound=_Counted)


def _optimizer(
    init: Callable[[Tree], _CountedT],
    step: _Step,
    name: str,
    state_type: type[_CountedT],
    buffers: tuple[str, ...],
    learning_rate: Callable[[int], float | torch.Tensor],
    sparse_why: str,
    unkept: tuple[str, ...] = (),
) -> GradientTransformation[_CountedT]:
    """The pair for an optimizer that computes new parameters (as torch.optim does), with its
    one-pass ``apply_gradients``. Its state is a ``state_type``; ``buffers`` names the state's
    fields that hold trees like the gradients, and ``unkept`` those it keeps None, without the
    option that needs them (see :data:`_KEPT_WITH`); ``learning_rate`` gives each step's rate from the
    steps taken (:func:`_learning_rate`); ``sparse_why`` says why a sparse gradient
    cannot be stepped (see :func:`_refuse_sparse`)."""

    def checked(grads: Tree, state: Any, params: Tree, call: str) -> tuple[Any, ...]:
        """The leaves and structures of grads and params, and the leaves of the state's trees,
        once they are known to match, and this step's learning rate."""
        if not isinstance(state, state_type):
            # Another optimizer's state, a chain's, or the arguments in another order: its
            # fields would be read as this optimizer's (an AttributeError, or a step count taken
            # silently from a state of another kind).
            raise ValueError(
                f"fdp.optim.{name}: {call} got a state of type {type(state).__qualname__}, expected "
                f"{state_type.__qualname__}: the state must come from this optimizer's init(params) "
                f"or its last step, passed as {call}(grads, state, params)"
            )
        for field in unkept:
            if getattr(state, field) is not None:
                _refuse_unkept(name, call, field)
        # Before any tree is flattened: compiled, a schedule that dynamo cannot trace breaks the
        # graph, and dynamo rebuilt a tree structure that lived across that break and the one
        # after it wrongly (a step failed with "length mismatch: [2, 1]" in unflatten).
        lr = learning_rate(state.step)
        g, spec = _leaves(grads)
        p, params_spec = _leaves(params)
        flat = [_leaves(getattr(state, field)) for field in buffers]
        state_leaves = [leaves for leaves, _ in flat]
        specs = [own for _, own in flat]
        if not torch.compiler.is_compiling():
            _verify(name, call, grads, params, state, g, p, spec, params_spec, buffers, specs, state_leaves)
        elif not _agree_compiled(spec, [params_spec, *specs], g, [p, *state_leaves]):
            # (Traced, the test above decides once per compiled graph, which guards on what it
            # read; only trees that differ break the graph, to be refused with _verify's words.)
            _verify_eagerly(name, call, grads, params, state, buffers)
        return g, spec, p, params_spec, state_leaves, lr

    def stepped(call: str, grads: Tree, g: Leaves, *args: Any) -> tuple[Leaves, Any]:
        """``step(g, *args)``, and on failure the sparse gradient it failed on, named (see
        _refuse_sparse)."""
        try:
            return step(g, *args)
        except RuntimeError:  # NotImplementedError among them
            _refuse_sparse(f"fdp.optim.{name}: {call}", grads, g, sparse_why)
            _refuse_integers(f"fdp.optim.{name}: {call}", grads, g, args[0])
            raise

    @torch.no_grad()
    def update(grads: Tree, state: Any, params: Tree | None = None) -> tuple[Tree, Any]:
        if params is None:
            raise ValueError(f"fdp.optim.{name} needs the params: call update(grads, state, params)")
        g, spec, p, _, state_leaves, lr = checked(grads, state, params, "update")
        new, new_state = stepped("update", grads, g, p, spec, state, state_leaves, lr)
        return _tree.unflatten(spec, _difference(new, p)), new_state

    @torch.no_grad()
    def apply(grads: Tree, state: Any, params: Tree) -> tuple[Tree, Any]:
        g, spec, p, params_spec, state_leaves, lr = checked(grads, state, params, "apply_gradients")
        new, new_state = stepped("apply_gradients", grads, g, p, spec, state, state_leaves, lr)
        # The params' structure, as apply_updates gives: dicts compare equal in any key order.
        return _tree.unflatten(params_spec, new), new_state

    _attach(update, apply)
    return GradientTransformation(init, update)


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none."""


class SgdState(NamedTuple):
    """The state of :func:`sgd`: the steps taken, and the momentum buffers (a tree like the
    parameters, or ``None`` without momentum), as ``torch.optim.SGD`` keeps them.

    Examples:
        >>> import torch
        >>> from fdp import optim
        >>> optim.sgd(0.1, momentum=0.9).init({"w": torch.ones(2)})
        SgdState(step=0, momentum={'w': tensor([0., 0.])})
    """

    step: int
    momentum: Tree


class AdamState(NamedTuple):
    """The state of :func:`adam` and :func:`adamw`: the steps taken, the first and second
    moment estimates (trees like the parameters), and with ``amsgrad`` the largest second
    moments yet (``None`` without it), as ``torch.optim.Adam`` keeps them.

    Examples:
        >>> import torch
        >>> from fdp import optim
        >>> optim.adam().init({"w": torch.ones(2)}).exp_avg
        {'w': tensor([0., 0.])}
    """

    step: int
    exp_avg: Tree
    exp_avg_sq: Tree
    # (Last, with a default: a state saved before it existed loads, with the default.)
    max_exp_avg_sq: Tree = None


class MultiTransformState(NamedTuple):
    """The state of :func:`multi_transform` (optax's ``MultiTransformState``): each label's
    transformation's state, in a dict by label. Each was made by its transformation's ``init``
    for the parameters of its label, with ``None`` in place of each part of the tree that holds
    none of them (another label's leaf, or a whole subtree of them).

    Examples:
        >>> import torch
        >>> from fdp import optim
        >>> labels = {"w": "a", "v": "b"}
        >>> opt = optim.multi_transform({"a": optim.sgd(0.1, momentum=0.9), "b": optim.adam()}, labels)
        >>> opt.init({"w": torch.ones(2), "v": torch.ones(1)}).inner_states["a"]
        SgdState(step=0, momentum={'w': tensor([0., 0.]), 'v': None})
    """

    inner_states: dict[Any, Any]


# Checkpoints hold these states, and torch.load(weights_only=True), torch's default since 2.6,
# rebuilds only the types it was told are safe: without this, every fdp.optim state (a named
# tuple of ints and trees of tensors, which constructing runs no code of ours) fails to load
# with an UnpicklingError. torch.optim's state_dict loads; so must ours.
torch.serialization.add_safe_globals([EmptyState, SgdState, AdamState, MultiTransformState])


Leaves = Any  # a list or tuple of tensors, as torch._foreach_* take and return them


def _leaves(tree: Tree) -> tuple[Leaves, optree.PyTreeSpec]:
    return _tree.flatten(tree)


def _differing(spec_a: optree.PyTreeSpec, spec_b: optree.PyTreeSpec) -> tuple[str, str] | None:
    """The two structures written out if they differ, else None."""
    return None if _tree.same_structure(spec_a, spec_b) else (str(spec_a), str(spec_b))


def _same_leaves(a: Leaves, b: Leaves) -> bool:
    """Whether the tensors ``a`` have the shapes and dtypes of the tensors ``b``, position by
    position. It runs in every training step: one pass of attribute reads over the leaf lists
    (a few microseconds for tens of leaves), none over tensor memory."""
    try:
        for x, y in zip(a, b):
            # dtypes are singletons, and ``is`` the cheapest test (the reads dominate anyway)
            if x.dtype is not y.dtype or x.shape != y.shape:
                return False
    except AttributeError:  # a leaf that is not a tensor: _refuse_unlike says which
        return False
    return True


_GRADIENT_DTYPES = "; as torch.optim, fdp.optim takes gradients of their parameters' dtypes"


def _refuse_unlike(
    where: str,
    root: str,
    tree: Tree,
    params: Tree,
    leaves: Leaves,
    p: Leaves,
    *,
    cast: bool,
    hint: str | None = None,
) -> None:
    """Raises for the first leaf of ``tree`` (``root``: grads, updates or a state's tree, of
    ``params``' structure) that is not a tensor of its parameter's shape and, unless ``cast``,
    dtype. With ``cast``, only a complex leaf for a real parameter is refused for its dtype: the
    cast would drop its imaginary part. ``hint``, if given, ends every message. Key paths are
    written here only, on the way to an error."""
    got: object
    expected: object
    for i, (x, q) in enumerate(zip(leaves, p)):
        if not (isinstance(x, torch.Tensor) and isinstance(q, torch.Tensor)):
            kind, why = "type", "; both must be tensors"
            if isinstance(x, PerReplica) or isinstance(q, PerReplica):
                why += _PER_REPLICA_HINT
            got, expected = _tree.describe(x), _tree.describe(q)
        elif x.shape != q.shape:
            kind, why, got, expected = "shape", "", tuple(x.shape), tuple(q.shape)
        elif x.dtype != q.dtype and not cast:
            kind, got, expected = "dtype", x.dtype, q.dtype
            why = _GRADIENT_DTYPES
        elif x.dtype != q.dtype and x.is_complex() and not q.is_complex():
            kind, got, expected = "dtype", x.dtype, q.dtype
            why = "; a real parameter cannot take a complex update"
        else:
            continue
        if hint is not None and not why.endswith(_PER_REPLICA_HINT):  # that one says more
            why = hint
        path = _tree.flatten_with_paths(tree, root)[0][i]
        param = _tree.flatten_with_paths(params, "params")[0][i]
        raise ValueError(f"{where} got {path} of {kind} {got} for {param} of {kind} {expected}{why}")


def _refuse_none_gradients(where: str, grads: Tree, params: Tree) -> None:
    """Raises for the first gradient that is None where the params hold a tensor (a parameter
    the loss does not reach, from ``torch.autograd.grad(..., allow_unused=True)``), if any,
    naming it: the structures alone differ by a None somewhere among many leaves. Called only
    once the structures differ."""
    try:
        accessors, leaves, spec = optree.tree_flatten_with_accessor(
            grads, none_is_leaf=True, namespace=_tree.NAMESPACE
        )
        params_leaves = spec.flatten_up_to(params)
    except (ValueError, TypeError):  # another difference: the structures say which
        return
    for accessor, g, p in zip(accessors, leaves, params_leaves):
        if g is None and isinstance(p, torch.Tensor):
            raise ValueError(
                f"{where} got {accessor.codify('grads')} = None for a tensor parameter: a parameter "
                "that the loss does not reach (torch.autograd.grad(..., allow_unused=True) gives None "
                "for it). "
                "torch.optim skips a parameter whose .grad is None; fdp.optim steps every "
                "parameter it is given: pass materialize_grads=True to torch.autograd.grad for "
                "zero gradients, or leave the parameter out of the params and grads"
            )


def _refuse_grads_unlike_params(
    where: str, grads: Tree, params: Tree, spec: optree.PyTreeSpec, params_spec: optree.PyTreeSpec
) -> NoReturn:
    """Raises for grads (of structure ``spec``) unlike the params (``params_spec``): naming a
    None gradient if that is the difference, else writing out both structures."""
    _refuse_none_gradients(where, grads, params)
    raise ValueError(f"{where} got params {params_spec} but grads {spec}")


# The state's trees that an optimizer keeps only with an option (None without it): the option,
# and how to go on from a state kept without it.
_KEPT_WITH = {
    "momentum": ("momentum", ""),
    "max_exp_avg_sq": (
        "amsgrad=True",
        " (to go on from a state kept without it, seed the largest second moments with the "
        "second moments: state._replace(max_exp_avg_sq=state.exp_avg_sq))",
    ),
}


def _refuse_unkept(name: str, call: str, field: str) -> NoReturn:
    """Raises for a state whose ``field`` holds a tree where this optimizer, made without the
    option that keeps it, would drop it: ``torch.optim``'s ``load_state_dict`` takes the
    options saved with the state (an amsgrad checkpoint goes on with amsgrad in an
    ``Adam(amsgrad=False)``), so a checkpoint resumed by an optimizer made with other options
    would go on as another optimizer, silently. Leaving the option out on purpose is one
    ``_replace`` away, which the message gives."""
    option = _KEPT_WITH[field][0]
    raise ValueError(
        f"fdp.optim.{name}: {call} got a state whose {field} is not None, as init makes it with "
        f"{option}, which this optimizer lacks: make the optimizer with {option} to go on as the "
        f"state was made, or drop them to go on without: state._replace({field}=None)"
    )


def _verify(
    name: str,
    call: str,
    grads: Tree,
    params: Tree,
    state: Any,
    g: Leaves,
    p: Leaves,
    spec: optree.PyTreeSpec,
    params_spec: optree.PyTreeSpec,
    fields: tuple[str, ...],
    specs: list[optree.PyTreeSpec],
    state_leaves: list[Leaves],
) -> None:
    """Refuses grads (leaves ``g``, structure ``spec``) unlike the params (``p``,
    ``params_spec``), in structure or a leaf's shape or dtype (torch.optim refuses such a
    ``.grad``), and a state whose trees (in ``fields``, of structures ``specs`` and leaves
    ``state_leaves``) are unlike the grads in structure or a leaf's shape or dtype: zipped by
    position, their leaves would pair a parameter with another's gradient or moments, broadcast
    into a new shape, or promote the parameter to the state's dtype, silently (torch.optim
    casts a loaded state to its parameters' dtypes)."""
    if not _tree.same_structure(params_spec, spec):
        _refuse_grads_unlike_params(f"fdp.optim.{name}: {call}", grads, params, spec, params_spec)
    for field, own in zip(fields, specs):
        mismatch = _differing(spec, own)
        if mismatch is not None and getattr(state, field) is None and field in _KEPT_WITH:
            # A state made without the option (an old checkpoint, resumed with amsgrad turned
            # on): "the state must come from init(params) for params of the grads' structure"
            # would send the caller looking at the parameters.
            option, advice = _KEPT_WITH[field]
            raise ValueError(
                f"fdp.optim.{name}: {call} got a state whose {field} is None, as init makes it "
                f"without {option}, which this optimizer has: its state must come from its own "
                f"init(params){advice}"
            )
        if mismatch is not None:
            raise ValueError(
                f"fdp.optim.{name}: {call} got grads {mismatch[0]} but a state whose {field} is "
                f"{mismatch[1]}; the state must come from init(params) for params of the grads' structure"
            )
    if not _same_leaves(g, p):
        _refuse_unlike(f"fdp.optim.{name}: {call}", "grads", grads, params, g, p, cast=False)
    for field, leaves in zip(fields, state_leaves):
        if not _same_leaves(leaves, p):
            _refuse_unlike(
                f"fdp.optim.{name}: {call}",
                f"state.{field}",
                getattr(state, field),
                params,
                leaves,
                p,
                cast=False,
                hint="; the state must come from init(params) for params of these shapes and dtypes",
            )


def _agree_compiled(spec: Any, others: list[Any], g: Leaves, others_leaves: list[Leaves]) -> bool:
    """Whether trees of structures ``others`` and leaves ``others_leaves`` are like the grads
    (``spec``, ``g``), as :func:`_verify` requires, tested in a way dynamo traces: compiled,
    the check is then part of the graph's guards instead of a graph break (each break in an
    optimizer step, called inside a step function, made a resumed frame, with its own guards on
    every tensor, of each function around it: on a CPU, the compiled one-replica step of a
    small transformer took 2.5 ms against the eager step's 2.9 ms and 1.8 ms for the plain
    step on ``torch.compile(model)``).

    The structures are compared by node type and keys (:func:`_same_layout`), not by ``==``:
    torch 2.11's dynamo cannot compare two specs (its stand-in for them compares their node
    types' functions, which it cannot trace). Node data beyond the keys (a ``defaultdict``'s
    factory, a custom node's metadata) is not compared, and changes no leaf's place."""
    return all(_same_layout(spec, other) for other in others) and all(
        _same_leaves(leaves, g) for leaves in others_leaves
    )


def _same_layout(a: Any, b: Any) -> bool:
    """Whether the tree structures ``a`` and ``b`` have the same node types and keys, node by
    node: the same leaves at the same places. (Public ``PyTreeSpec`` methods, which dynamo's
    stand-in for optree's specs has too.)"""
    if a.num_nodes != b.num_nodes or a.num_leaves != b.num_leaves or a.type is not b.type:
        return False
    if a.num_nodes == 1:
        return True
    return a.entries() == b.entries() and all(map(_same_layout, a.children(), b.children()))


@eager_under_compile
def _verify_eagerly(
    name: str, call: str, grads: Tree, params: Tree, state: Any, fields: tuple[str, ...]
) -> None:
    """:func:`_verify` outside the graph, on the trees, where :func:`_agree_compiled` found
    them unlike, for its messages."""
    g, spec = _leaves(grads)
    p, params_spec = _leaves(params)
    flat = [_leaves(getattr(state, field)) for field in fields]
    specs = [own for _, own in flat]
    _verify(name, call, grads, params, state, g, p, spec, params_spec, fields, specs, [t for t, _ in flat])


def _verify_updates(
    params: Tree, updates: Tree, p: Leaves, u: Leaves, spec: optree.PyTreeSpec, other: optree.PyTreeSpec
) -> bool:
    """Refuses updates unlike the params in structure or a leaf's shape (or complex for a real
    parameter); returns whether every update has its parameter's dtype."""
    mismatch = _differing(spec, other)
    if mismatch is not None:
        raise ValueError(f"fdp.optim.apply_updates: params are {mismatch[0]} but updates are {mismatch[1]}")
    if _same_leaves(u, p):
        return True
    _refuse_unlike("fdp.optim.apply_updates:", "updates", updates, params, u, p, cast=True)
    return False


@eager_under_compile
def _verify_updates_eagerly(params: Tree, updates: Tree) -> bool:
    """:func:`_verify_updates` outside the graph, as :func:`_verify_eagerly`."""
    p, spec = _leaves(params)
    u, other = _leaves(updates)
    return _verify_updates(params, updates, p, u, spec, other)


_PER_REPLICA_HINT = (
    "; a PerReplica holds one tensor per replica: step inside the pmapped function, where each "
    "replica sees its own tensors, and call init on the parameters before fdp.device_put_replicated"
)


def _refuse_non_tensors(where: str, root: str, tree: Tree, leaves: Leaves, *, inexact: bool = False) -> None:
    """Raises for the first leaf of ``tree`` (written ``root``) that is not a tensor (a step
    count kept among the parameters, a PerReplica outside the pmapped function), or with
    ``inexact`` not a floating-point or complex one, rather than let a torch op fail on it
    without naming it. One isinstance per leaf; key paths are written only on the way to an
    error."""
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            path = _tree.flatten_with_paths(tree, root)[0][i]
            hint = _PER_REPLICA_HINT if isinstance(x, PerReplica) else "; keep other values out of the tree"
            raise ValueError(
                f"{where} got {path} of type {_tree.describe(x)}; fdp.optim steps tensors only{hint}"
            )
        if inexact and not (x.is_floating_point() or x.is_complex()):  # as torch's norm requires
            path = _tree.flatten_with_paths(tree, root)[0][i]
            raise TypeError(
                f"{where} got {path} of type {_tree.describe(x)}; gradients must be floating point or complex"
            )


def _refuse_sparse(where: str, tree: Tree, leaves: Leaves, why: str) -> None:
    """Raises for the first leaf of the gradients ``tree`` that is not a dense tensor (an
    ``nn.Embedding(sparse=True)``'s), whose step failed: torch's error names neither the call nor
    the leaf, and says the operator has no sparse kernel. ``why`` says what needs dense ones.
    Looked for only on failure."""
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.layout is not torch.strided:
            path = _tree.flatten_with_paths(tree, "grads")[0][i]
            raise TypeError(
                f"{where} got {path}, a sparse gradient (layout {x.layout}): {why}. Give the layer "
                "dense gradients (nn.Embedding(..., sparse=False)), or convert the gradient with "
                ".to_dense()"
            )


def _refuse_integers(where: str, grads: Tree, g: Leaves, p: Leaves) -> None:
    """Raises for the first parameter or gradient that is an integer or boolean tensor (a step
    count, BatchNorm's ``num_batches_tracked`` from a ``state_dict()``), whose step failed:
    torch's error names neither the call nor the leaf (``For integral input tensors, argument
    alpha must not be a floating point number``). Looked for only on failure. The params'
    paths are the grads' (their structures were checked to match)."""
    for root, leaves in (("params", p), ("grads", g)):
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex()):
                path = _tree.flatten_with_paths(grads, root)[0][i]
                raise TypeError(
                    f"{where} got {path} of type {_tree.describe(x)}; fdp.optim steps floating-point "
                    "and complex tensors only, as torch.optim does (an integer tensor cannot have a "
                    "gradient): keep integer tensors such as step counts out of the params, e.g. "
                    "dict(model.named_parameters()) rather than model.state_dict()"
                )


def _zeros_like(tree: Tree, name: str) -> Tree:
    leaves, spec = _leaves(tree)
    _refuse_non_tensors(f"fdp.optim.{name}: init", "params", tree, leaves)
    return _tree.unflatten(spec, [torch.zeros_like(t, memory_format=torch.preserve_format) for t in leaves])


def _non_negative(value: Any) -> bool | None:
    """Whether ``value`` is non-negative (NaN is not: ``not >= 0``, as ``torch.optim.Adam``
    writes its checks), or None where it is not one number: a str, None, a tensor of several
    values, or one of shape [1] (which passes the comparison, then fails in
    ``torch._foreach_*`` in torch's words; one number is a 0-dim tensor)."""
    if isinstance(value, bool):  # True >= 0: sgd(True) stepped at lr 1, as torch.optim does
        return None
    try:
        if isinstance(value, torch.Tensor) and value.dim():
            return None
        return bool(value >= 0)
    except (TypeError, RuntimeError):
        return None


def _check_non_negative(name: str, values: dict[str, Any], *, number: str = "a non-negative number") -> None:
    """Refuses what torch.optim refuses among ``values`` (by name): negative values and NaN, and
    what is not ``number`` (see :func:`_non_negative`)."""
    for what, value in values.items():
        fine = _non_negative(value)
        if fine is None:
            raise TypeError(
                f"fdp.optim.{name}: {what} must be {number}, got "
                f"{type(value).__name__}: {_tree.short_repr(value)}"
            )
        if not fine:
            raise ValueError(f"fdp.optim.{name}: {what} must be non-negative, got {value!r}")


def _number(value: Any) -> bool:
    """Whether ``value`` is one real number, not NaN (infinities are numbers): one that
    :func:`_non_negative` takes (so not a bool either), and compares as one sign or the other."""
    fine = _non_negative(value)
    return fine is not None and (fine or bool(value < 0))


def _refuse_not_a_number(name: str, what: str, value: Any) -> NoReturn:
    """Raises for ``value`` of hyperparameter ``what``, found not :func:`_number`: a ValueError
    for NaN, a TypeError for anything else."""
    if _non_negative(value) is not None:  # a number that compares as none: NaN
        raise ValueError(f"fdp.optim.{name}: {what} must be a number, got {value!r}")
    raise TypeError(
        f"fdp.optim.{name}: {what} must be a number, got {type(value).__name__}: {_tree.short_repr(value)}"
    )


def _learning_rate(lr: float | torch.Tensor | Schedule, name: str) -> Callable[[int], float | torch.Tensor]:
    """``lr`` as a schedule: a number, checked now, or a schedule, each of whose values is
    checked when a step takes it (a negative or NaN one would step uphill, or poison every
    parameter, silently)."""
    if not callable(lr):
        number = "a non-negative number or a Schedule (a function of the steps taken)"
        _check_non_negative(name, {"lr": lr}, number=number)
        return lambda step: lr
    schedule = lr

    def scheduled(step: int) -> float:
        value = schedule(step)
        if not _non_negative(value):
            # The message only on the way to the error: compiled, the comparison is a guard on
            # the step count that holds for every step (a value the schedule computes from it),
            # where formatting the count would specialize it and recompile every step.
            _check_non_negative(name, {f"lr, a schedule, at step {step},": value})
        return value

    return scheduled


def sgd(
    lr: float | torch.Tensor | Schedule,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> GradientTransformation[SgdState]:
    """Stochastic gradient descent, as ``torch.optim.SGD``.

    Args:
        lr: the learning rate: a number (a float, or a 0-dim tensor, whose changes in place
            compiled steps follow), or a :data:`Schedule`, a function of the steps taken before
            this one (``lambda step: 0.1 * 0.9**step``), as a ``LambdaLR`` would set it.
        momentum: the momentum factor, non-negative. Keyword-only. Default: ``0.0``.
        dampening: dampening for momentum (not applied on the first step, as in torch), any
            number but NaN. Keyword-only. Default: ``0.0``.
        nesterov: Nesterov momentum, which needs ``momentum > 0`` and ``dampening = 0`` (as in
            torch). Keyword-only. Default: ``False``.
        weight_decay: L2 penalty added to the gradient, non-negative. Keyword-only. Default:
            ``0.0``.
        maximize: step up the gradient, to maximize the objective (the gradient is negated
            before anything else, as in torch). Keyword-only. Default: ``False``.

    Raises:
        ValueError: a hyperparameter ``torch.optim.SGD`` refuses (a negative ``lr``, ``momentum``
            or ``weight_decay``; ``nesterov`` without momentum or with dampening), or NaN.
        TypeError: a hyperparameter that is not a number, or a flag that is not ``True`` or
            ``False`` (or a NumPy bool).

    Examples:
        >>> import torch
        >>> from fdp import optim
        >>> opt = optim.sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> optim.apply_updates(params, updates)
        {'w': tensor([0.9000, 0.9000])}
    """
    learning_rate = _learning_rate(lr, "sgd")
    _check_non_negative("sgd", {"momentum": momentum, "weight_decay": weight_decay})
    # torch.optim.SGD checks no dampening: any number, negative or above 1 included, but NaN
    # (which poisons every momentum buffer, silently) and what is not a number (a str, which
    # torch takes and fails on at its second step).
    if not _number(dampening):
        _refuse_not_a_number("sgd", "dampening", dampening)
    maximize = _tree.check_flag(maximize, "fdp.optim.sgd: maximize")
    nesterov = _tree.check_flag(nesterov, "fdp.optim.sgd: nesterov")
    if nesterov and (momentum <= 0 or dampening != 0):  # as torch.optim.SGD refuses it
        raise ValueError(
            "fdp.optim.sgd: nesterov=True needs momentum > 0 and dampening = 0, got "
            f"momentum={momentum!r}, dampening={dampening!r}"
        )

    def init(params: Tree) -> SgdState:
        return SgdState(0, _zeros_like(params, "sgd") if momentum else None)

    def step(
        g: Leaves,
        p: Leaves,
        spec: optree.PyTreeSpec,
        state: SgdState,
        state_leaves: list[Leaves],
        lr: float | torch.Tensor,
    ) -> tuple[Leaves, SgdState]:
        if not g:  # no parameters (torch._foreach_* refuse empty lists): only the count advances
            return [], SgdState(state.step + 1, _tree.unflatten(spec, []) if momentum else None)
        if maximize:
            g = torch._foreach_neg(g)
        if weight_decay:
            g = torch._foreach_add(g, p, alpha=weight_decay)
        buffers: Leaves = None
        if momentum:
            if state.step == 0:
                buffers = [t.detach().clone() for t in g]
            else:
                buffers = torch._foreach_mul(state_leaves[0], momentum)
                torch._foreach_add_(buffers, g, alpha=1 - dampening)
            g = torch._foreach_add(g, buffers, alpha=momentum) if nesterov else buffers
        new_momentum = None if buffers is None else _tree.unflatten(spec, buffers)
        if _compiled_tensor(lr):  # as torch.optim.SGD does there
            return torch._foreach_add(p, torch._foreach_mul(g, -lr)), SgdState(state.step + 1, new_momentum)
        # Eagerly, a 0-dim tensor lr is taken as the number it holds (torch.optim passes it so).
        return torch._foreach_add(p, g, alpha=-lr), SgdState(state.step + 1, new_momentum)  # type: ignore[arg-type]

    # (Without weight decay, the update is the gradient scaled: sparse gradients step as in torch.optim.SGD.)
    sparse_why = (
        "fdp.optim.sgd with weight_decay adds the parameter to the gradient, which torch cannot do "
        "to a sparse one (torch.optim.SGD neither); without weight_decay, sgd steps sparse gradients"
    )
    kept = ("momentum",) if momentum else ()
    return _optimizer(
        init, step, "sgd", SgdState, kept, learning_rate, sparse_why, () if momentum else ("momentum",)
    )


def _compiled_tensor(lr: Any) -> bool:
    """Whether ``lr`` is a tensor in code that torch.compile traces, where it cannot be a factor
    given as ``alpha=``/``value=`` (a Python number: dynamo breaks the graph to read it).
    torch.optim multiplies by such a tensor there, and eagerly passes it as a number."""
    return isinstance(lr, torch.Tensor) and torch.compiler.is_compiling()


def _difference(new: Leaves, old: Leaves) -> Leaves:
    """``new - old``: the update that takes ``old`` to exactly ``new`` (see the module docstring)."""
    return torch._foreach_sub(new, old) if new else []


def _as_real(leaves: Leaves) -> Leaves:
    """The complex tensors of ``leaves`` as real ones with a last axis of 2 (views, no copies,
    but for a gradient with torch's lazy conjugate bit, as autograd returns for a loss of
    ``z.conj()``: resolved first, since view_as_real refuses it)."""
    return [torch.view_as_real(t.resolve_conj()) if t.is_complex() else t for t in leaves]


def _as_complex(leaves: Leaves, like: Leaves) -> Leaves:
    """:func:`_as_real` undone: the tensors of ``leaves`` whose counterpart in ``like`` is complex,
    viewed as complex again."""
    return [torch.view_as_complex(t) if q.is_complex() else t for t, q in zip(leaves, like)]


def _adam(
    lr: float | torch.Tensor | Schedule,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    *,
    decoupled: bool,
    name: str,
) -> GradientTransformation[AdamState]:
    learning_rate = _learning_rate(lr, name)
    _check_non_negative(name, {"eps": eps, "weight_decay": weight_decay})
    amsgrad = _tree.check_flag(amsgrad, f"fdp.optim.{name}: amsgrad")
    maximize = _tree.check_flag(maximize, f"fdp.optim.{name}: maximize")
    try:
        beta1, beta2 = betas
        in_range = 0 <= beta1 < 1 and 0 <= beta2 < 1
    except (TypeError, ValueError, RuntimeError) as err:
        # Not a pair (betas=0.9, or three values), or not numbers: unpacked or compared, they
        # said only "cannot unpack non-iterable float object" and the like.
        raise (ValueError if isinstance(err, ValueError) else TypeError)(
            f"fdp.optim.{name}: betas must be a pair of numbers in [0, 1), got "
            f"{type(betas).__name__}: {_tree.short_repr(betas)}"
        ) from None
    if not in_range:
        raise ValueError(f"fdp.optim.{name}: betas must be in [0, 1), got {betas!r}")

    def init(params: Tree) -> AdamState:
        most = _zeros_like(params, name) if amsgrad else None
        return AdamState(0, _zeros_like(params, name), _zeros_like(params, name), most)

    def step(
        g: Leaves,
        p: Leaves,
        spec: optree.PyTreeSpec,
        state: AdamState,
        state_leaves: list[Leaves],
        lr: float | torch.Tensor,
    ) -> tuple[Leaves, AdamState]:
        number = state.step + 1
        if not g:  # no parameters (torch._foreach_* refuse empty lists): only the count advances
            empty = _tree.unflatten(spec, [])
            return [], AdamState(number, empty, empty, empty if amsgrad else None)
        if maximize:
            g = torch._foreach_neg(g)
        if weight_decay and not decoupled:
            g = torch._foreach_add(g, p, alpha=weight_decay)
        # torch.optim.AdamW first scales the parameter by (1 - lr * weight_decay).
        start = torch._foreach_mul(p, 1 - lr * weight_decay) if weight_decay and decoupled else p
        exp_avg, exp_avg_sq = state_leaves[:2]
        most = state_leaves[2] if amsgrad else []  # the largest second moments yet
        complex_params = any(t.dtype.is_complex for t in p)
        if complex_params:
            # torch.optim steps a complex parameter as the pairs of reals it holds (the
            # view_as_real of gradient, parameter and moments): each part gets its own second
            # moment, where complex g * g would mix them. The state stays complex, as torch's.
            g, start, exp_avg, exp_avg_sq, most = map(_as_real, (g, start, exp_avg, exp_avg_sq, most))
        exp_avg = torch._foreach_lerp(exp_avg, g, 1 - beta1)
        exp_avg_sq = torch._foreach_mul(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1**number
        bias_correction2 = 1 - beta2**number
        step_size = lr / bias_correction1
        if amsgrad:  # normalized by the largest second moment yet, as torch.optim's amsgrad
            most = torch._foreach_maximum(most, exp_avg_sq)
        denom = torch._foreach_sqrt(most if amsgrad else exp_avg_sq)
        torch._foreach_div_(denom, bias_correction2**0.5)
        torch._foreach_add_(denom, eps)
        if _compiled_tensor(step_size):
            new = torch._foreach_add(
                start, torch._foreach_mul(torch._foreach_div(exp_avg, denom), -step_size)
            )
        else:
            new = torch._foreach_addcdiv(start, exp_avg, denom, value=-step_size)  # type: ignore[arg-type]
        if complex_params:
            new, exp_avg, exp_avg_sq = (_as_complex(leaves, p) for leaves in (new, exp_avg, exp_avg_sq))
            most = _as_complex(most, p) if amsgrad else most
        return new, AdamState(
            number,
            _tree.unflatten(spec, exp_avg),
            _tree.unflatten(spec, exp_avg_sq),
            _tree.unflatten(spec, most) if amsgrad else None,
        )

    sparse_why = (
        f"fdp.optim.{name} steps dense gradients only, as torch.optim.{'AdamW' if decoupled else 'Adam'} "
        "does (torch.optim.SparseAdam steps sparse ones)"
    )
    buffers = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    unkept = () if amsgrad else ("max_exp_avg_sq",)
    return _optimizer(init, step, name, AdamState, buffers, learning_rate, sparse_why, unkept)


def adam(
    lr: float | torch.Tensor | Schedule = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
) -> GradientTransformation[AdamState]:
    """Adam, as ``torch.optim.Adam`` (``weight_decay`` is an L2 penalty on the gradient).

    Args:
        lr: the learning rate: a number (a float or a 0-dim tensor), or a :data:`Schedule` of
            the steps taken before this one, as a ``LambdaLR`` would set it (see :func:`sgd`).
            Default: ``1e-3``.
        betas: the averaging coefficients. Keyword-only. Default: ``(0.9, 0.999)``.
        eps: added to the denominator, non-negative. Keyword-only. Default: ``1e-8``.
        weight_decay: L2 penalty, non-negative. Keyword-only. Default: ``0.0``.
        amsgrad: normalize by the largest second moment estimate seen so far (the AMSGrad
            variant), kept in the state's ``max_exp_avg_sq``. Keyword-only. Default: ``False``.
        maximize: step up the gradient, to maximize the objective. Keyword-only. Default:
            ``False``.

    Examples:
        >>> import torch
        >>> from fdp import optim
        >>> opt = optim.adam(0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -1.0])}, opt.init(params), params)
        >>> optim.apply_updates(params, updates)
        {'w': tensor([-0.1000,  0.1000])}
    """
    return _adam(lr, betas, eps, weight_decay, amsgrad, maximize, decoupled=False, name="adam")


def adamw(
    lr: float | torch.Tensor | Schedule = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
) -> GradientTransformation[AdamState]:
    """AdamW, as ``torch.optim.AdamW`` (decoupled weight decay).

    Args:
        lr: the learning rate: a number (a float or a 0-dim tensor), or a :data:`Schedule` of
            the steps taken before this one, as a ``LambdaLR`` would set it (see :func:`sgd`).
            Default: ``1e-3``.
        betas: the averaging coefficients. Keyword-only. Default: ``(0.9, 0.999)``.
        eps: added to the denominator, non-negative. Keyword-only. Default: ``1e-8``.
        weight_decay: decoupled weight decay, non-negative. Keyword-only. Default: ``1e-2``.
        amsgrad: normalize by the largest second moment estimate seen so far (the AMSGrad
            variant), kept in the state's ``max_exp_avg_sq``. Keyword-only. Default: ``False``.
        maximize: step up the gradient, to maximize the objective. Keyword-only. Default:
            ``False``.

    Examples:
        >>> import torch
        >>> from fdp import optim
        >>> opt = optim.adamw(0.1, weight_decay=0.5)
        >>> params = {"w": torch.ones(2)}
        >>> updates, state = opt.update({"w": torch.zeros(2)}, opt.init(params), params)
        >>> optim.apply_updates(params, updates)  # decay only: 1 - 0.1 * 0.5
        {'w': tensor([0.9500, 0.9500])}
    """
    return _adam(lr, betas, eps, weight_decay, amsgrad, maximize, decoupled=True, name="adamw")


def clip_by_global_norm(max_norm: float) -> GradientTransformation[EmptyState]:
    """Scales the updates so that their global L2 norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_`` (norm type 2): the scale is
    ``min(1, max_norm / (total_norm + 1e-6))``.

    Args:
        max_norm: the largest global norm let through, positive.

    Raises:
        ValueError: ``max_norm`` is not positive.

    Examples:
        >>> import torch
        >>> from fdp import optim
        >>> clip = optim.clip_by_global_norm(1.0)
        >>> clipped, _ = clip.update({"g": torch.tensor([3.0, 4.0])}, clip.init(None))
        >>> clipped["g"]
        tensor([0.6000, 0.8000])
    """
    try:
        positive = max_norm > 0
    except (TypeError, RuntimeError):  # a str, None, a tensor of several values
        raise TypeError(
            "fdp.optim.clip_by_global_norm: max_norm must be a positive number, got "
            f"{type(max_norm).__name__}: {_tree.short_repr(max_norm)}"
        ) from None
    if not positive:
        raise ValueError(f"fdp.optim.clip_by_global_norm: max_norm must be positive, got {max_norm!r}")

    def init(params: Tree) -> EmptyState:
        return EmptyState()

    @torch.no_grad()
    def update(grads: Tree, state: EmptyState, params: Tree | None = None) -> tuple[Tree, EmptyState]:
        g, spec = _leaves(grads)
        if not g:
            return grads, state
        try:
            norms = torch._foreach_norm(g, 2.0)
        except (TypeError, RuntimeError):
            # Named only on failure, as below: torch's error names neither the call nor the leaf.
            _refuse_non_tensors("fdp.optim.clip_by_global_norm: update", "grads", grads, g, inexact=True)
            _refuse_sparse(
                "fdp.optim.clip_by_global_norm: update",
                grads,
                g,
                "the global norm is taken of dense gradients only (torch.nn.utils.clip_grad_norm_ "
                "fails on a sparse one too)",
            )
            raise
        total = torch.linalg.vector_norm(torch.stack([n.to(g[0].device) for n in norms]), 2.0)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        try:
            clipped: Leaves = torch._foreach_mul(g, scale)
        except RuntimeError:
            # Gradients on several devices (a model split over GPUs, or partly on the CPU): a
            # CUDA scale times a tensor on another device is a device mismatch. The scale is
            # copied once to each device, as clip_grad_norm_ does. (Tested only on failure:
            # reading every leaf's device on each step would cost more than the product.)
            first = g[0].device
            if all(t.device == first for t in g):
                raise
            scales = {first: scale}
            for t in g:
                if t.device not in scales:
                    scales[t.device] = scale.to(t.device)
            clipped = [t * scales[t.device] for t in g]
        # clip_grad_norm_ scales in place, so every gradient keeps its dtype. Out of place, a
        # 0-dim gradient promotes with the 0-dim scale, of the widest dtype among the norms
        # (a float32 scalar beside float64 gradients would come back float64, which the
        # optimizer after it refuses): cast back, as the in-place product is.
        clipped = [c if c.dtype is t.dtype else c.to(t.dtype) for c, t in zip(clipped, g)]
        return _tree.unflatten(spec, clipped), state

    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation[Any]) -> GradientTransformation[tuple[Any, ...]]:
    """Applies ``transforms`` in order; the state is the tuple of their states.

    Args:
        *transforms: the transformations, first applied first (e.g. clipping before the
            optimizer).

    Examples:
        >>> import torch
        >>> from fdp import optim
        >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.5))
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = opt.update({"w": torch.tensor([3.0, 4.0])}, opt.init(params), params)
        >>> optim.apply_updates(params, updates)  # clipped to norm 1, then a step of 0.5
        {'w': tensor([-0.3000, -0.4000])}
    """
    for i, transform in enumerate(transforms):
        if not (callable(getattr(transform, "init", None)) and callable(getattr(transform, "update", None))):
            # A factory not called (chain(clip_by_global_norm, ...)), or a list of transforms:
            # it would fail on first use with "... object has no attribute 'init'".
            raise TypeError(
                f"fdp.optim.chain: transforms[{i}] must be a GradientTransformation (an init, "
                f"update pair such as fdp.optim.adam(1e-3)), got {type(transform).__name__}: "
                f"{_tree.short_repr(transform)}"
            )

    def init(params: Tree) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def through(
        count: int, grads: Tree, state: tuple[Any, ...], params: Tree | None, call: str
    ) -> tuple[Tree, list[Any]]:
        """The gradients through the first ``count`` transforms, and their new states."""
        if not isinstance(state, tuple) or hasattr(state, "_fields"):
            # Not a chain's state (one optimizer's named tuple, None, the params): refused here,
            # where len() would fail, or the states be dealt out a named tuple's fields.
            raise ValueError(
                f"fdp.optim.chain: {call} got a state of type {type(state).__qualname__}, expected a "
                f"tuple of {len(transforms)} states (one per transformation): the state must come "
                "from this chain's init(params) or its last step"
            )
        if len(state) != len(transforms):
            raise ValueError(
                f"fdp.optim.chain: {call} got a state of {len(state)} states, expected {len(transforms)} "
                "(one per transformation): the state must come from this chain's init(params) or its "
                "last step"
            )
        new_states = []
        for t, s in zip(transforms[:count], state):
            grads, s = t.update(grads, s, params)
            new_states.append(s)
        return grads, new_states

    def update(
        grads: Tree, state: tuple[Any, ...], params: Tree | None = None
    ) -> tuple[Tree, tuple[Any, ...]]:
        grads, new_states = through(len(transforms), grads, state, params, "update")
        return grads, tuple(new_states)

    fused_last = _fused(transforms[-1].update) if transforms else None
    if fused_last is not None:

        def apply(grads: Tree, state: tuple[Any, ...], params: Tree) -> tuple[Tree, tuple[Any, ...]]:
            # The transforms before the last one change the gradients; the last one steps.
            grads, new_states = through(len(transforms) - 1, grads, state, params, "apply_gradients")
            new_params, s = fused_last(grads, state[-1], params)
            return new_params, (*new_states, s)

        _attach(update, apply)
    return GradientTransformation(init, update)


def multi_transform(
    transforms: Mapping[Hashable, GradientTransformation[Any]],
    param_labels: Tree | Callable[[Tree], Tree],
) -> GradientTransformation[MultiTransformState]:
    """Parameter groups: each parameter is stepped by the transformation of its label (optax's
    ``multi_transform``; the param groups of ``torch.optim``).

    ``torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay,
    "weight_decay": 0.0}], lr=1e-3)`` is ``multi_transform({"decay": adamw(1e-3,
    weight_decay=0.1), "no_decay": adamw(1e-3, weight_decay=0.0)}, labels)``: its
    ``apply_gradients`` gives torch's parameters bit for bit (``update`` and
    :func:`apply_updates` to rounding, as each optimizer's). Each label's transformation gets
    the tree of the gradients (and parameters) with ``None`` in place of each part that holds
    none of its leaves, another label's leaf or a whole subtree of them (optax's masked trees,
    but with one ``None`` for a subtree: ``{"backbone": None, "head": {"w": ...}}``), so its
    state is a tree like the parameters too, and its errors name leaves by their key paths in
    the whole tree. Where every label's transformation steps in one pass (fdp's optimizers, a
    :func:`chain` ending in one), :meth:`GradientTransformation.apply_gradients` does too, label
    by label; any other label's parameters get ``update`` and :func:`apply_updates`. Each
    transformation keeps its own step count (and schedule), and is stepped at every step, a
    label that labels no parameter included, as ``torch.optim`` steps every group.

    Args:
        transforms: the transformation of each label, e.g. ``{"decay": adamw(...),
            "no_decay": adam(...)}``. A label that labels no parameter is allowed (its
            transformation steps an empty tree).
        param_labels: the label of each parameter: a tree like the parameters with a label at
            each leaf, or a prefix of it (one label for a whole subtree: ``{"backbone":
            "frozen", "head": "train"}``); or a function of the parameters that returns such a
            tree, called with the parameters by ``init`` and at every step (with the gradients
            where ``update`` gets no parameters). Every label must be a key of ``transforms``.

    Returns:
        The transformation, whose state is a :class:`MultiTransformState`.

    Raises:
        TypeError: ``transforms`` is not a mapping of transformations.
        ValueError: ``transforms`` is empty; a label has no transformation, or the labels are
            not a tree like the parameters nor a prefix of it (raised when the labels are given,
            or for a function, when it returns them).

    Examples:
        >>> import torch
        >>> from fdp import optim
        >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> def labels(params):  # no weight decay on biases (and norms): the 1-dim parameters
        ...     return {k: "decay" if v.dim() > 1 else "no_decay" for k, v in params.items()}
        >>> opt = optim.multi_transform(
        ...     {"decay": optim.adamw(0.1, weight_decay=0.5), "no_decay": optim.adamw(0.1, weight_decay=0.0)},
        ...     labels,
        ... )
        >>> grads = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
        >>> params, state = opt.apply_gradients(grads, opt.init(params), params)
        >>> params  # decay only, and only for w: 1 - 0.1 * 0.5
        {'w': tensor([[0.9500, 0.9500],
                [0.9500, 0.9500]]), 'b': tensor([1., 1.])}
    """
    where = "fdp.optim.multi_transform"
    if not isinstance(transforms, Mapping):
        raise TypeError(
            f"{where}: transforms must be a mapping from labels to GradientTransformations "
            f"(e.g. {{'decay': fdp.optim.adamw(1e-3)}}), got {type(transforms).__name__}: "
            f"{_tree.short_repr(transforms)}"
        )
    if not transforms:
        raise ValueError(f"{where}: transforms is empty: give the transformation of each label")
    for label, transform in transforms.items():
        if not (callable(getattr(transform, "init", None)) and callable(getattr(transform, "update", None))):
            raise TypeError(
                f"{where}: transforms[{label!r}] must be a GradientTransformation (an init, update "
                f"pair such as fdp.optim.adam(1e-3)), got {type(transform).__name__}: "
                f"{_tree.short_repr(transform)}"
            )
    # A copy: the transformations (and the labels the state is checked against) are those given
    # now, whatever happens to the caller's mapping later.
    transforms = dict(transforms)
    labelled = callable(param_labels)
    if not labelled:
        # Refused now, not at the first step: the labels are known.
        _refuse_unknown_labels(where, transforms, param_labels, "param_labels")

    # Each label's group (its leaves, and the shape of its masked tree), by the params'
    # structure (and, for a function, the labels it returned): matching labels to leaves by key
    # path costs as much as a small model's whole step, and the answer repeats every step.
    known: _tree.SpecCache[tuple[optree.PyTreeSpec, list[Any], dict[Hashable, _Group]]]
    known = _tree.SpecCache()
    fixed = None if labelled else _tree.flatten(param_labels)

    def groups(
        tree: Tree, leaves: Leaves, spec: optree.PyTreeSpec, root: str, call: str
    ) -> dict[Hashable, _Group]:
        """The group of each label among the leaves of ``tree`` (the params, or the grads
        without them, written ``root``; of leaves ``leaves`` and structure ``spec``)."""
        try:
            labels = param_labels(tree) if labelled else param_labels
        except Exception:
            # A function that reads its leaves (v.dim()) fails on resident state outside the
            # pmapped function, in words that do not say so: the PerReplica leaf is named.
            _refuse_non_tensors(f"{where}: {call}", root, tree, leaves)
            raise
        label_leaves, labels_spec = _tree.flatten(labels) if fixed is None else fixed
        cached = known.get(spec)
        if (
            cached is not None
            and _tree.same_structure(cached[0], labels_spec)
            and _equal(cached[1], label_leaves)
        ):
            return cached[2]
        name = f"param_labels({root})" if labelled else "param_labels"
        positions: dict[Hashable, list[int]] = {label: [] for label in transforms}
        try:
            for i, label in enumerate(_leaf_labels(where, call, labels, name, tree, root)):
                positions[label].append(i)
        except (KeyError, TypeError):  # a label without a transformation, or unhashable
            _refuse_unknown_labels(f"{where}: {call}", transforms, labels, name)
            raise
        by_label = {label: _group(leaves, spec, mine) for label, mine in positions.items()}
        known[spec] = (labels_spec, label_leaves, by_label)
        return by_label

    def parts(grads: Tree, state: Any, params: Tree | None, call: str) -> tuple[Any, Any]:
        """:func:`groups`, and each label's masked grads and params (None without params), once
        grads, params and state agree (see :func:`split`)."""
        if not isinstance(state, MultiTransformState):
            raise ValueError(
                f"{where}: {call} got a state of type {type(state).__qualname__}, expected "
                f"MultiTransformState: the state must come from this transformation's init(params) or "
                f"its last step, passed as {call}(grads, state, params)"
            )
        inner = state.inner_states
        if not isinstance(inner, dict) or inner.keys() != transforms.keys():
            got = (
                f"a state for the labels {_tree.short_repr(list(inner))}"
                if isinstance(inner, dict)
                else f"inner_states of type {type(inner).__qualname__}"
            )
            raise ValueError(
                f"{where}: {call} got {got}, expected one for the labels "
                f"{_tree.short_repr(list(transforms))}: the state must come from this transformation's "
                "init(params)"
            )
        if torch.compiler.is_compiling():
            return _split_eagerly(split, grads, params, call)
        return split(grads, params, call)

    def split(grads: Tree, params: Tree | None, call: str) -> tuple[dict[Hashable, _Group], Any]:
        """The checks and groups of :func:`parts`, and the masked trees. Compiled, all of it runs
        outside the graph (:func:`_split_eagerly`), before any transformation runs: the labels
        (a function of the user's, matched by key path); the masked trees, whose layouts are
        structures made outside the graph, where dynamo would have to make them from trees of
        constants, which it cannot flatten (see :class:`_Group`); and no structure lives on in
        the graph across a transformation's graph breaks (dynamo rebuilt one wrongly: its
        unflatten failed with "length mismatch")."""
        labelled_tree, root = (grads, "grads") if params is None else (params, "params")
        g, spec = _leaves(grads)
        p, params_spec = (g, spec) if params is None else _leaves(params)
        if not _tree.same_structure(spec, params_spec):
            _refuse_grads_unlike_params(f"{where}: {call}", grads, params, spec, params_spec)
        by_label = groups(labelled_tree, p, params_spec, root, call)
        masked_trees = {
            label: (_masked(g, group), None if params is None else _masked(p, group))
            for label, group in by_label.items()
        }
        return by_label, masked_trees

    def merged(tree: Tree, by_label: Any, results: dict[Hashable, Tree], call: str) -> Tree:
        """The labels' ``results``, trees like their masked trees of ``tree``, as one tree like
        ``tree`` (flattened again here: see :func:`parts`)."""
        leaves, spec = _leaves(tree)
        out: list[Any] = [None] * len(leaves)
        for label, result in results.items():
            positions, given = by_label[label].positions, by_label[label].structure
            got, structure = _leaves(result)
            if given is not None and not _tree.same_structure(structure, given):
                # A transformation of the user's that returns another tree: its leaves, placed
                # by position, would land on other parameters.
                raise ValueError(
                    f"{where}: {call}: transforms[{label!r}] returned {structure} for the masked tree "
                    f"{given}; a transformation must return a tree like the one it is given"
                )
            for i, leaf in zip(positions, got):
                out[i] = leaf
        return _tree.unflatten(spec, out)

    def init(params: Tree) -> MultiTransformState:
        p, spec = _leaves(params)
        by_label = groups(params, p, spec, "params", "init")
        return MultiTransformState(
            {label: transforms[label].init(_masked(p, by_label[label])) for label in transforms}
        )

    def update(
        grads: Tree, state: MultiTransformState, params: Tree | None = None
    ) -> tuple[Tree, MultiTransformState]:
        by_label, masked_trees = parts(grads, state, params, "update")
        results, new_states = {}, {}
        for label, transform in transforms.items():
            mine, params_mine = masked_trees[label]
            results[label], new_states[label] = transform.update(mine, state.inner_states[label], params_mine)
        return merged(grads, by_label, results, "update"), MultiTransformState(new_states)

    def apply(grads: Tree, state: MultiTransformState, params: Tree) -> tuple[Tree, MultiTransformState]:
        by_label, masked_trees = parts(grads, state, params, "apply_gradients")
        results, new_states = {}, {}
        for label, transform in transforms.items():
            mine, params_mine = masked_trees[label]
            fused = _fused(transform.update)
            if fused is not None:  # fdp's optimizers, and chains ending in one: one pass
                results[label], new_states[label] = fused(mine, state.inner_states[label], params_mine)
            else:
                updates, new_states[label] = transform.update(mine, state.inner_states[label], params_mine)
                results[label] = apply_updates(params_mine, updates)
        # The params' structure, as apply_updates gives: dicts compare equal in any key order.
        return merged(params, by_label, results, "apply_gradients"), MultiTransformState(new_states)

    _attach(update, apply)
    return GradientTransformation(init, update)


class _Group(NamedTuple):
    """One label's share of a tree's leaves, for :func:`multi_transform`, and the layout of its
    masked tree: the tree with None in place of each largest part that holds none of the
    label's leaves, a leaf or a whole subtree (the root excepted: it stays the tree's own).

    A None for a whole subtree, not one per leaf, for ``torch.compile``: with torch 2.13 and
    optree 0.20, dynamo fails on a dict that holds only Nones (of another label's subtree).
    Rebuilding one from the structure of the dict of tensors it masks, it folds the rebuild
    into a call of optree's own unflatten with the node data of its stand-in for optree, which
    optree cannot read ("unhashable type: 'list'", "length mismatch"); flattening one, it cannot
    hold the node data optree gives (a graph break, then frames run eagerly on its stand-in's
    structures, which fail alike). Each label's transformation flattens its masked trees and
    rebuilds its results and state from their structure, so a dict of Nones in them failed every
    compiled step. In these trees, every dict below the root holds a leaf of the label.
    """

    positions: list[int]  # the label's leaves, by position among the tree's leaves, ascending
    sources: list[int | None]  # for each leaf of ``layout``: the position of its leaf, or None
    layout: optree.PyTreeSpec | None  # the masked tree's, each None a leaf (None in a graph)
    structure: optree.PyTreeSpec | None  # the masked tree's, to check results by (None in a graph)


def _group(leaves: Leaves, spec: optree.PyTreeSpec, positions: list[int]) -> _Group:
    """The group of the leaves at ``positions`` among ``leaves``, of structure ``spec``. The
    parts that hold none of them are the leaves that optree finds in the tree with None at
    every other position, flattened with the parts that hold no leaf (but the root) taken as
    leaves. Once per structure: it flattens each part it looks at (leaves times depth)."""
    kept: list[Any] = [None] * len(leaves)
    for i in positions:
        kept[i] = leaves[i]
    full = _tree.unflatten(spec, kept)

    def empty(node: Tree) -> bool:
        return not optree.tree_leaves(node, is_leaf=_tree.is_leaf(), namespace=_tree.NAMESPACE)

    parts, layout = optree.tree_flatten(
        full, is_leaf=lambda node: node is not full and empty(node), namespace=_tree.NAMESPACE
    )
    owned = iter(positions)  # in the order of the leaves: pruning keeps that order
    sources = [None if empty(part) else next(owned) for part in parts]
    group = _Group(positions, sources, layout, None)
    return group._replace(structure=_leaves(_masked(leaves, group))[1])


def _masked(leaves: Leaves, group: _Group) -> Tree:
    """The masked tree of ``group`` holding ``leaves`` (a tree's, or of a tree like it's)."""
    assert group.layout is not None  # (None only in the groups handed to a graph, which masks nothing)
    return _tree.unflatten(group.layout, [None if i is None else leaves[i] for i in group.sources])


def _leaf_labels(where: str, call: str, labels: Tree, name: str, tree: Tree, root: str) -> list[Any]:
    """The label of each leaf of ``tree`` (written ``root``), in its flattening order, from
    ``labels`` (written ``name``), a tree like it or a prefix of it."""
    _tree.flatten(labels)  # registers dataclasses among the labels, as flattening the tree did its own
    try:
        leaf_labels: list[Any] = optree.broadcast_prefix(labels, tree, namespace=_tree.NAMESPACE)
    except ValueError:
        pass
    else:
        if _tree.has_keyed_containers(labels):  # broadcast_prefix lists them in the labels' order
            return _axes.in_tree_order(labels, tree)
        return leaf_labels
    # Where the structures part ways, by key path, as optree says it (the first place only:
    # the others follow from it more often than not).
    (detail, *_) = optree.prefix_errors(labels, tree, namespace=_tree.NAMESPACE)
    message = detail(name).args[0]
    raise ValueError(
        f"{where}: {call} got {name} unlike {root}: the labels must be a tree of {root}' structure "
        f"with a label at each leaf, or a prefix of it (one label for a whole subtree).\n"
        f"{_axes.shorten(message)}"
    ) from None


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` for two lists of labels, False where a label's ``==`` has no truth value."""
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def _refuse_unknown_labels(where: str, transforms: dict[Hashable, Any], labels: Tree, name: str) -> None:
    """Raises for the first leaf of ``labels`` (written ``name``) that is not a label of
    ``transforms``, if any. Key paths are written only on the way to the error."""
    leaves, _ = _tree.flatten(labels)
    for i, label in enumerate(leaves):
        try:
            known = label in transforms
        except TypeError:  # unhashable
            known = False
        if not known:
            path = _tree.flatten_with_paths(labels, name)[0][i]
            raise ValueError(
                f"{where} got {path} = {_tree.short_repr(label)}, a label with no transformation: "
                f"transforms has the labels {_tree.short_repr(list(transforms))}"
            )


@eager_under_compile
def _split_eagerly(
    split: Callable[..., tuple[dict[Hashable, _Group], Any]], grads: Tree, params: Tree | None, call: str
) -> tuple[dict[Hashable, _Group], Any]:
    """``multi_transform``'s ``split`` outside the graph: its groups without their structures
    (which would live on in the graph: see ``split``), and the masked trees."""
    by_label, masked_trees = split(grads, params, call)
    return {
        label: group._replace(layout=None, structure=None) for label, group in by_label.items()
    }, masked_trees


@torch.no_grad()
def apply_updates(params: Tree, updates: Tree) -> Tree:
    """``params + updates``, leaf by leaf (in one ``torch._foreach_add``), without autograd.

    Each update must have its parameter's shape exactly (no broadcasting). An update of another
    dtype is added as torch promotes and the sum cast to the parameter's dtype, as optax does
    (``(p + u).astype(p.dtype)``): parameters keep their dtypes, e.g. ``bfloat16`` parameters
    with ``float32`` updates. A complex update for a real parameter is refused.

    Args:
        params: the parameters, a tree of tensors.
        updates: the updates, a tree of tensors of the same structure and shapes.

    Returns:
        The new parameters, with the structure and dtypes of ``params``.

    Examples:
        >>> import torch
        >>> from fdp import optim
        >>> optim.apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), 0.5)})
        {'w': tensor([1.5000, 1.5000])}
        >>> optim.apply_updates({"w": torch.ones(2, dtype=torch.bfloat16)}, {"w": torch.full((2,), 0.5)})
        {'w': tensor([1.5000, 1.5000], dtype=torch.bfloat16)}
    """
    p, spec = _leaves(params)
    u, other = _leaves(updates)
    if torch.compiler.is_compiling():
        # (As in an optimizer's step: traced, only trees that differ break the graph, and
        # updates of another dtype than their parameters, which the eager check casts.)
        agree = _same_layout(spec, other) and _same_leaves(u, p)
        same_dtypes = agree or _verify_updates_eagerly(params, updates)
    else:
        same_dtypes = _verify_updates(params, updates, p, u, spec, other)
    new: Leaves = torch._foreach_add(p, u) if p else []  # torch._foreach_* refuse empty lists
    if not same_dtypes:  # optax's rule: the sum, computed as torch promotes, in the parameter's dtype
        new = [t if t.dtype == q.dtype else t.to(q.dtype) for t, q in zip(new, p)]
    return _tree.unflatten(spec, new)
