"""``in_axes``/``out_axes`` specifications: validation and broadcasting onto a tree's leaves.

A specification is a tree prefix (as in ``jax.pmap``): an int or ``None`` applies to a whole
subtree. ``None`` is an empty node to optree, so it is replaced by the :data:`BROADCAST` leaf
before ``optree.broadcast_prefix`` sees it.
"""

from __future__ import annotations

from typing import Any, Final

import optree

from . import _state, _tree

__all__ = ["BROADCAST", "check_spec", "leaf_axes", "in_tree_order", "shorten", "normalize_axis", "all_zero"]


class _Broadcast:
    __slots__ = ()

    def __repr__(self) -> str:
        return "None"

    def __reduce__(self) -> str:
        return "BROADCAST"


BROADCAST: Final = _Broadcast()
"""The per-leaf axis of a value that every replica gets whole (``None`` in a specification)."""


def all_zero(axes: list[Any]) -> bool:
    """Whether every per-leaf axis is 0 (scatter and gather have a shorter path for that)."""
    return all(type(a) is int and a == 0 for a in axes)


def _check_leaf(value: Any, path: str, per_replica: bool, caller: str) -> Any:
    if value is None:
        return BROADCAST
    if value is _state.PER_REPLICA and per_replica:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        allowed = "an int, None or fdp.PER_REPLICA" if per_replica else "an int or None"
        raise TypeError(f"{caller}: {path} must be {allowed}, got {type(value).__name__}: {value!r}")
    return value


def check_spec(
    spec: Any, *, what: str, caller: str, list_as_tuple: bool = False, per_replica: bool = False
) -> Any:
    """Validates a specification once, when the transform is built; ``None`` becomes BROADCAST.

    Errors name ``caller`` (``fdp.pmap(fn)``), so a program of many mapped functions says which.

    With ``list_as_tuple`` (for ``in_axes``), a top-level list is read as a tuple, the usual
    spelling for positional arguments; ``per_replica`` (for ``out_axes``) allows
    ``fdp.PER_REPLICA`` leaves.
    """
    if list_as_tuple and isinstance(spec, list):
        spec = tuple(spec)
    _tree.flatten(spec)  # registers dataclasses used as prefixes, e.g. in_axes=(Batch(0, None),)
    return optree.tree_map_with_accessor(
        lambda accessor, leaf: _check_leaf(leaf, accessor.codify(what), per_replica, caller),
        spec,
        none_is_leaf=True,
        namespace=_tree.NAMESPACE,
    )


def leaf_axes(spec: Any, tree: Any, *, what: str, tree_name: str, caller: str) -> list[Any]:
    """The axis (an int or BROADCAST) of every leaf of ``tree``, in flattening order.

    ``tree`` must already have gone through ``_tree.flatten`` (dataclasses registered).
    """
    try:
        axes = optree.broadcast_prefix(spec, tree, namespace=_tree.NAMESPACE)
    except ValueError:
        pass
    else:
        if _tree.has_keyed_containers(spec):
            return in_tree_order(spec, tree)
        return axes
    # Slow path, for the message only: optree says where the structures part ways.
    details = [
        shorten(err(what).args[0]) for err in optree.prefix_errors(spec, tree, namespace=_tree.NAMESPACE)
    ]
    _, structure = _tree.flatten(tree)
    raise ValueError(
        f"{caller}: {what} specification must be a tree prefix of {tree_name}, but {what}={spec!r} "
        f"does not match {tree_name} of structure {structure}.\n" + "\n".join(details[:3])
    ) from None


def in_tree_order(spec: Any, tree: Any) -> list[Any]:
    """The leaf of the prefix ``spec`` above each leaf of ``tree`` (its axis, or in
    ``fdp.optim.multi_transform`` its label), matched by key path, in ``tree``'s order.

    ``optree.broadcast_prefix`` lists them in the prefix's order at dict-like nodes, which is
    not the tree's flattening order where an ``OrderedDict``'s keys are not sorted, or where an
    ``OrderedDict`` prefix meets a ``dict``. (``optree.tree_broadcast_prefix`` would rebuild the
    tree's own containers around the axes, running dataclasses' ``__post_init__`` on them.)
    """
    paths, axes, _ = optree.tree_flatten_with_path(spec, namespace=_tree.NAMESPACE)
    by_path = dict(zip(paths, axes))
    result = []
    for path in optree.tree_paths(tree, namespace=_tree.NAMESPACE):
        # The prefix leaf above this leaf: the longest start of its path that the prefix has.
        depth = next(k for k in range(len(path), -1, -1) if path[:k] in by_path)
        result.append(by_path[path[:depth]])
    return result


def shorten(message: str, limit: int = 300) -> str:
    return "\n".join(line if len(line) <= limit else line[:limit] + " ..." for line in message.splitlines())


def normalize_axis(axis: int, ndim: int) -> int | None:
    """``axis`` as a non-negative dim of a tensor of rank ``ndim``; None if out of range."""
    if -ndim <= axis < ndim:
        return axis % ndim
    return None
