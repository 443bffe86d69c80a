"""State resident on the devices: one value per replica, placed once, kept across calls.

A :class:`PerReplica` leaf holds one value per replica, each on its replica's device: what
``jax.pmap`` keeps as an array with a leading device axis. Passed to a pmapped function (under
any ``in_axes``), replica ``r`` gets ``values[r]`` as it is, with no copy and no transfer; with
``out_axes=fdp.PER_REPLICA`` a function's outputs stay where the replicas made them. A training
step that takes and returns its state that way moves only what its collectives move.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any, Final

import optree
import torch

from . import _devices, _tree

__all__ = ["PerReplica", "PER_REPLICA", "device_put_replicated", "unreplicate"]


class PerReplica:
    """One value per replica, each on its replica's device.

    Args:
        values: the replicas' values, in replica order.
        devices: their devices (one ``torch.device`` per value).

    Examples:
        >>> import torch, fdp
        >>> state = fdp.device_put_replicated({"w": torch.zeros(2)}, ["cpu", "cpu"])
        >>> state["w"]
        PerReplica(2 replicas on cpu, cpu: float32[2])
        >>> state["w"][1]
        tensor([0., 0.])
    """

    __slots__ = ("values", "devices", "prefix_ok")

    def __init__(self, values: Sequence[Any], devices: Sequence[torch.device]) -> None:
        try:
            sizes = len(values), len(devices)
        except TypeError:
            # len()'s words ("object of type 'generator' has no len()") name neither the call
            # nor the argument: found here, on failure only.
            for name, given in (("values", values), ("devices", devices)):
                if not hasattr(given, "__len__"):
                    raise TypeError(
                        f"fdp.PerReplica: {name} must be a sequence with one entry per replica, got "
                        f"{type(given).__name__}: {_tree.short_repr(given)}"
                    ) from None
            raise
        if sizes[0] != sizes[1]:
            raise ValueError(
                f"fdp.PerReplica: values and devices must have one entry per replica each, got "
                f"{sizes[0]} values and {sizes[1]} devices"
            )
        self.values = tuple(values)
        self.devices = tuple(devices)
        # Whether a call that runs fewer replicas may use the first values (read-only copies,
        # e.g. fdp.DataParallel's placed parameters); resident state must have every replica run.
        self.prefix_ok = False

    @classmethod
    def _prefix(cls, values: Sequence[Any], devices: Sequence[torch.device]) -> PerReplica:
        """Copies of which a call running fewer replicas uses the first ones.

        fdp.DataParallel's placed parameters: read-only, so a small batch may run on the first
        devices alone. Private, as ``prefix_ok`` is: resident state must have every replica run.
        """
        placed = cls(values, devices)
        placed.prefix_ok = True
        return placed

    @classmethod
    def _each(cls, values: Sequence[Any], devices: tuple[torch.device, ...]) -> list[PerReplica]:
        """One PerReplica of one replica on ``devices`` per value: a lone replica's outputs.

        Made without ``__init__`` and its checks, in one loop: a resident training step
        returns every parameter and optimizer state this way, call after call.
        """
        if len(devices) != 1:
            raise ValueError(f"PerReplica._each makes one-replica values, got {len(devices)} devices")
        new = object.__new__
        out = []
        for v in values:
            placed = new(cls)
            placed.values = (v,)
            placed.devices = devices
            placed.prefix_ok = False
            out.append(placed)
        return out

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: int) -> Any:
        return self.values[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.values)

    def __repr__(self) -> str:
        if not self.values:  # one that no call can use, but that may still be printed
            return "PerReplica(0 replicas)"
        described = _tree.describe(self.values[0])
        return f"PerReplica({len(self.values)} replicas on {_names(self.devices)}: {described})"


_tree.always_leaf(PerReplica)  # never a container: flattening needs no registry check for it


class _PerReplicaAxis:
    __slots__ = ()

    def __repr__(self) -> str:
        return "fdp.PER_REPLICA"

    def __reduce__(self) -> str:
        return "PER_REPLICA"


PER_REPLICA: Final = _PerReplicaAxis()
"""An ``out_axes`` entry: keep every replica's value on its device, as :class:`PerReplica` leaves."""


def refused_by_node(path: str, node_type: type, error: Exception) -> str:
    """Why a node of a tree cannot hold :class:`PerReplica` values in place of its tensors: its
    type checks its fields as it is built (a dataclass whose ``__post_init__`` reads a field's
    ``.shape``, ``PackedSequence``, a registered node whose unflatten validates). Each tensor
    leaf becomes a ``PerReplica`` inside the tree's own containers, so the type meets an object
    it never expected, and raised from inside the user's class, naming nothing of fdp's."""
    name = node_type.__qualname__
    raised = f"{type(error).__name__}: {error}"
    if len(raised) > 200:
        raised = raised[:200] + "..."
    return (
        f"{path} is a {name}, which cannot hold fdp.PerReplica values in place of its tensors: "
        f"rebuilt with them, it raised {raised}"
    )


def refuse_spelled_devices(leaf: PerReplica, caller: str, path: str, remedy: str = "") -> None:
    """Raises ``TypeError`` if ``leaf`` (written ``path``) was built by hand with devices spelled
    as strings: ``"cpu" != torch.device("cpu")``, so it fits no call's devices, and the
    message that says so would name the same devices twice. ``remedy`` ends the message."""
    spelled = [d for d in leaf.devices if not isinstance(d, torch.device)]
    if spelled:
        raise TypeError(
            f"{caller}: {path} is a PerReplica whose devices must be torch.device objects, got "
            f"{type(spelled[0]).__name__}s: {list(leaf.devices)!r}. Build it as "
            f"fdp.PerReplica(values, [torch.device(d) for d in devices]){remedy}"
        )


def device_put_replicated(tree: Any, devices: Sequence[_devices.DeviceLike]) -> Any:
    """Places an independent copy of every tensor of ``tree`` on every device, once.

    The resident form of training state (``jax.device_put_replicated``, flax's ``replicate``):
    each tensor leaf becomes a :class:`PerReplica` leaf. Every replica's copy is its own tensor,
    detached from ``tree``, also for duplicate devices such as ``["cpu", "cpu"]``, so replicas
    may update their state in place without touching each other's. Non-tensor leaves stay as
    they are (every replica gets them anyway), and so do :class:`PerReplica` leaves already on
    ``devices``, in that order; one on other devices is an error (:func:`unreplicate` it first).

    Args:
        tree: a pytree, e.g. ``{"params": ..., "opt_state": ...}``.
        devices: one device per replica (duplicates allowed).

    Returns:
        ``tree`` with every tensor leaf replaced by a :class:`PerReplica`.

    Raises:
        ValueError: a :class:`PerReplica` leaf of ``tree`` is placed on other devices.
        TypeError: a node of ``tree`` cannot hold :class:`PerReplica` values in place of its
            tensors (a dataclass whose ``__post_init__`` reads a field's ``.shape``): placed
            state goes in dicts, tuples and dataclasses that take any value.

    Examples:
        >>> import torch, fdp
        >>> state = fdp.device_put_replicated({"w": torch.ones(2), "step": 0}, ["cpu"] * 3)
        >>> len(state["w"]), state["step"]
        (3, 0)
    """
    resolved = _devices.resolve_devices(devices, what="fdp.device_put_replicated devices")

    def place(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        source = leaf.detach()
        copies = [source.to(d, copy=True) for d in resolved]
        return PerReplica(copies, resolved)

    leaves, _ = _tree.flatten_for(tree, "fdp.device_put_replicated", "tree")  # registers dataclasses
    for i, leaf in enumerate(leaves):
        # Placed already: kept where the devices match; elsewhere its replicas would not be
        # the ones asked for, and a call over ``devices`` would find too many or too few.
        if isinstance(leaf, PerReplica) and leaf.devices != resolved:
            path = _tree.flatten_with_paths(tree, "tree")[0][i]
            # (Rebuilt from a checkpoint of every replica's copy, say: the message below would
            # read "placed on 2 devices (cpu, cpu), not on the 2 devices given (cpu, cpu)".)
            refuse_spelled_devices(leaf, "fdp.device_put_replicated", path)
            raise ValueError(
                f"fdp.device_put_replicated: {path} is already placed, on {len(leaf.devices)} "
                f"devices ({_names(leaf.devices)}), not on the {len(resolved)} devices given "
                f"({_names(resolved)}); pass fdp.unreplicate(tree) to place one replica's copy"
            )
    try:
        return optree.tree_map(place, tree, namespace=_tree.NAMESPACE)
    except Exception:
        leaves, spec = _tree.flatten(tree)
        marked = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        found = _tree.refusing_node(spec, [place(leaf) for leaf in leaves], marked, "tree")
        if found is None:
            raise
        path, node_type, error = found
        raise TypeError(
            f"fdp.device_put_replicated: {refused_by_node(path, node_type, error)}. Place its fields "
            f"(in a dict or a tuple), and build the {node_type.__qualname__} from them inside the "
            "mapped function"
        ) from error


def _names(devices: Sequence[torch.device]) -> str:
    return ", ".join(str(d) for d in devices)


def unreplicate(tree: Any, index: int = 0) -> Any:
    """One replica's copy of a tree of :class:`PerReplica` leaves (flax's ``unreplicate``).

    Args:
        tree: a pytree whose leaves may be :class:`PerReplica`; other leaves are kept.
        index: which replica's copy, from ``0``; negative indices count from the last, as in
            Python. Default: ``0``.

    Returns:
        ``tree`` with every :class:`PerReplica` replaced by its ``index``-th value (on that
        replica's device). These are that replica's own tensors, not copies (nothing is copied,
        as flax's unreplicate copies nothing): a tensor changed in place (a model that takes
        them with ``load_state_dict(..., assign=True)`` and trains on) changes that replica's
        state alone, and the replicas part. ``.clone()`` the ones to modify.

    Examples:
        >>> import torch, fdp
        >>> fdp.unreplicate(fdp.device_put_replicated({"w": torch.ones(2)}, ["cpu"] * 2))
        {'w': tensor([1., 1.])}
    """
    try:
        index = operator.index(index)
    except TypeError:
        raise TypeError(f"fdp.unreplicate: index must be an int, got {_tree.short_repr(index)}") from None
    leaves, _ = _tree.flatten(tree)  # registers dataclasses
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, PerReplica) and not -len(leaf.values) <= index < len(leaf.values):
            path = _tree.flatten_with_paths(tree, "tree")[0][i]
            raise IndexError(
                f"fdp.unreplicate: index {index} is out of range: {path} holds "
                f"{len(leaf.values)} replicas ({_names(leaf.devices)})"
            )
    return optree.tree_map(
        lambda leaf: leaf.values[index] if isinstance(leaf, PerReplica) else leaf,
        tree,
        namespace=_tree.NAMESPACE,
    )
