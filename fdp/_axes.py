"""``in_axes``/``out_axes`` specifications: validation and broadcasting onto a tree's leaves.

A specification is a tree prefix (as in ``jax.pmap``): an int or ``None`` applies to a whole
subtree. ``None`` is an empty node to optree, so it is replaced by the :data:`BROADCAST` leaf
before ``optree.broadcast_prefix`` sees it.
"""

from __future__ import annotations

from typing import Any, Final

import optree

from . import _state, _tree

__all__ = ["BROADCAST", "check_spec", "leaf_axes", "normalize_axis", "all_zero"]


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


def _check_leaf(value: Any, path: str, per_replica: bool) -> Any:
    if value is None:
        return BROADCAST
    if value is _state.PER_REPLICA and per_replica:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        allowed = "an int, None or fdp.PER_REPLICA" if per_replica else "an int or None"
        raise TypeError(f"{path} must be {allowed}, got {type(value).__name__}: {value!r}")
    return value


def check_spec(spec: Any, *, what: str, list_as_tuple: bool = False, per_replica: bool = False) -> Any:
    """Validates a specification once, when the transform is built; ``None`` becomes BROADCAST.

    With ``list_as_tuple`` (for ``in_axes``), a top-level list is read as a tuple, the usual
    spelling for positional arguments; ``per_replica`` (for ``out_axes``) allows
    ``fdp.PER_REPLICA`` leaves.
    """
    if list_as_tuple and isinstance(spec, list):
        spec = tuple(spec)
    _tree.flatten(spec)  # registers dataclasses used as prefixes, e.g. in_axes=(Batch(0, None),)
    return optree.tree_map_with_accessor(
        lambda accessor, leaf: _check_leaf(leaf, accessor.codify(what), per_replica),
        spec,
        none_is_leaf=True,
        namespace=_tree.NAMESPACE,
    )


def leaf_axes(spec: Any, tree: Any, *, what: str, tree_name: str) -> list[Any]:
    """The axis (an int or BROADCAST) of every leaf of ``tree``, in flattening order.

    ``tree`` must already have gone through ``_tree.flatten`` (dataclasses registered).
    """
    try:
        return optree.broadcast_prefix(spec, tree, namespace=_tree.NAMESPACE)
    except ValueError:
        pass
    # Slow path, for the message only: optree says where the structures part ways.
    details = [
        _shorten(err(what).args[0]) for err in optree.prefix_errors(spec, tree, namespace=_tree.NAMESPACE)
    ]
    _, structure = _tree.flatten(tree)
    raise ValueError(
        f"{what} specification must be a tree prefix of {tree_name}, but {what}={spec!r} "
        f"does not match {tree_name} of structure {structure}.\n" + "\n".join(details[:3])
    ) from None


def _shorten(message: str, limit: int = 300) -> str:
    return "\n".join(line if len(line) <= limit else line[:limit] + " ..." for line in message.splitlines())


def normalize_axis(axis: int, ndim: int) -> int | None:
    """``axis`` as a non-negative dim of a tensor of rank ``ndim``; None if out of range."""
    if -ndim <= axis < ndim:
        return axis % ndim
    return None
