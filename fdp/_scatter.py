"""Scatter and replicate: from one tree to one tree per replica.

:func:`scatter_leaves` is the one place where inputs are validated and split; ``fdp.pmap`` and
the public :func:`scatter` both use it. Mapped tensor leaves are cut along their axis with the
split rule; ``None``-axis tensors are copied to every device (replicas on one device share the
tensor); every other leaf (numbers, strings, arbitrary objects) reaches every replica as the
same object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from . import _axes, _devices, _split, _state, _transfer, _tree

__all__ = [
    "scatter",
    "replicate",
    "scatter_leaves",
    "Scattered",
    "one_replica_row",
    "packed_sequence_message",
]

T = TypeVar("T")


class Scattered:
    """The result of :func:`scatter_leaves`."""

    __slots__ = ("leaves", "devices", "sizes", "shared")

    def __init__(
        self,
        leaves: list[list[Any]],
        devices: tuple[torch.device, ...],
        sizes: tuple[int, ...],
        shared: list[tuple[int, list[torch.Tensor]]],
    ) -> None:
        self.leaves = leaves  # leaves[r] is replica r's list of leaves
        self.devices = devices  # the devices of the replicas that run
        self.sizes = sizes  # rows per replica
        self.shared = shared  # (leaf index, per-replica copies) of every replicated tensor


def scatter_leaves(
    leaves: Sequence[Any],
    axes: Sequence[Any],
    devices: tuple[torch.device, ...],
    split: _split.SplitRule,
    *,
    caller: str,
    paths: Callable[[], list[str]],
    all_zero: bool = False,
    share: bool = True,
) -> Scattered:
    """Splits mapped tensor leaves and replicates the others; one leaf list per replica.

    ``paths()`` gives every leaf's key path; it is only called to write an error message.
    ``all_zero`` says that every axis is 0, which allows a shorter path for all-tensor inputs.
    ``share`` gives replicas that share a CPU tensor requiring grad aliases of it, whose
    gradients sum in replica order (see ``_transfer.share_for_backward``).
    """
    if all_zero and leaves:
        fast = _split_all_on_cpu(leaves, devices, split)
        if fast is not None:
            return fast
    mapped: list[tuple[int, int]] = []  # (leaf index, non-negative axis)
    replicated: list[int] = []
    resident: list[int] = []  # PerReplica leaves: already one value per replica
    batch: int | None = None
    tensor = torch.Tensor
    broadcast = _axes.BROADCAST
    for k, (leaf, axis) in enumerate(zip(leaves, axes)):
        if not isinstance(leaf, tensor):
            if isinstance(leaf, _state.PerReplica):
                resident.append(k)
            elif axis is not broadcast and (reason := _tree.unsplittable_reason(leaf, caller)):
                raise TypeError(f"{caller}: {paths()[k]}: {reason}")
            continue
        if axis is broadcast:
            replicated.append(k)
            continue
        ndim = leaf.dim()
        if not -ndim <= axis < ndim:
            path = paths()[k]
            raise ValueError(
                f"{caller} was asked to map {path} of type {_tree.describe(leaf)} along "
                f"axis {axis}, so its rank should be at least "
                f"{axis + 1 if axis >= 0 else -axis}, but it is only {ndim}"
                + (f"; {_keyword_advice([path])}" if _is_keyword(caller, path) else "")
            )
        if leaf.is_nested or leaf.layout is not _STRIDED:
            # Refused before any split, so on one replica too, which would otherwise get it
            # whole and run, where several fail: torch has no split of a sparse tensor ("Could
            # not run 'aten::as_strided' with arguments from the 'SparseCPU' backend") nor of a
            # nested one along its batch ("split_with_sizes(): not supported for NestedTensor on
            # dim=0"), and a nested tensor of the strided layout has no shape ("Internal error:
            # NestedTensorImpl doesn't support sizes"): messages that name neither the call nor
            # the argument.
            raise TypeError(_unsplittable_tensor_message(caller, paths()[k], leaf, axis))
        dim = axis % ndim
        size = leaf.shape[dim]
        if batch is None:
            batch = size
        elif size != batch:
            batch = -1  # sizes disagree: reported below with every leaf
        mapped.append((k, dim))
    user_axes = {k: axes[k] for k, _ in mapped}  # as the user wrote them, for messages

    if batch is None and resident:
        # Only resident state: nothing to split, and one replica per device, each on its copy.
        # As with a batch, the state must be held on every device: run on as many replicas as
        # its first leaf holds, a state on fewer devices would run fewer replicas unnoticed (and
        # an empty one none, a call that would wait forever), and another leaf be blamed.
        run_on = devices
        rows: list[list[Any]] = [list(leaves) for _ in run_on]
        _place_resident(leaves, resident, rows, run_on, caller, paths, devices, split, None)
        shared: list[tuple[int, list[torch.Tensor]]] = []
        _place_replicated(leaves, replicated, rows, run_on, shared, caller, paths)
        if share:
            _share_for_backward(leaves, replicated, resident, rows)
        return Scattered(rows, run_on, (), shared)
    if batch is None:
        raise ValueError(
            f"{caller} found no tensor to map: every tensor argument has axis None (or there is "
            "none), so there is no batch to split over the replicas. Give at least one tensor an "
            "int axis in in_axes." + _opaque_holder_note(leaves, axes, paths)
        )
    if batch < 0:
        raise ValueError(_inconsistent_sizes_message(leaves, mapped, user_axes, caller, paths()))
    if batch == 0:
        k, dim = mapped[0]
        raise ValueError(
            f"{caller} got an empty batch: axis {user_axes[k]} of {paths()[k]} of type "
            f"{_tree.describe(leaves[k])} has size 0, and there is nothing to give the replicas"
        )

    sizes = _split.shard_sizes(batch, len(devices), split)
    n = len(sizes)
    run_on = devices[:n]
    rows = [list(leaves) for _ in range(n)]
    _place_resident(leaves, resident, rows, run_on, caller, paths, devices, split, batch)
    on_cpu = all(d.type == "cpu" for d in run_on)
    for k, dim in mapped:
        leaf = leaves[k]
        try:
            if on_cpu and leaf.is_cpu:
                # The common CPU case, inline: one replica keeps the tensor, several get views.
                if n > 1:
                    for r, shard in enumerate(leaf.split_with_sizes(sizes, dim)):
                        rows[r][k] = shard
                continue
            for r, shard in enumerate(_transfer.split_to(leaf, dim, sizes, run_on)):
                rows[r][k] = shard
        except RuntimeError as err:  # NotImplementedError too
            refuse_meta(caller, leaves, [k], paths, run_on, err)
            raise
    shared = []
    _place_replicated(leaves, replicated, rows, run_on, shared, caller, paths)
    if share:
        _share_for_backward(leaves, replicated, resident, rows)
    return Scattered(rows, run_on, sizes, shared)


def _opaque_holder_note(leaves: Sequence[Any], axes: Sequence[Any], paths: Callable[[], list[str]]) -> str:
    """For a call with nothing to map: the first object under an int axis that holds tensors
    among its attributes (a batch class of the user's, a graph library's data object), which
    the user most likely meant to be split. Its tensors are not seen (optree takes it for one
    leaf), so "found no tensor to map" alone reads as wrong: the user gave it axis 0."""
    for k, (leaf, axis) in enumerate(zip(leaves, axes)):
        if axis is _axes.BROADCAST or isinstance(leaf, (torch.Tensor, torch.nn.Module)):
            continue  # (a module's tensors are its parameters: every replica needs them whole)
        names = _tree.tensor_attributes(leaf)
        if names:
            name = type(leaf).__qualname__
            return (
                f" {paths()[k]} is a {name} holding tensors (its attributes {', '.join(names)}), an "
                "object that fdp does not flatten: it reaches every replica whole, whatever its axis. "
                f"To split its tensors, pass them in a dict or a dataclass, or register {name} with "
                f"optree.register_pytree_node(..., namespace={_tree.NAMESPACE!r})."
            )
    return ""


def _whole_advice(caller: str) -> str:
    """How to give every replica all of an argument, for ``caller``'s messages: what the
    caller can say (fdp.DataParallel has no in_axes, and fdp.pmap's keyword arguments are
    always split, so "axis None" alone is no advice for either)."""
    return f"to give every replica all of it, {_tree.whole_advice(caller)}"


def _unsplittable_tensor_message(caller: str, path: str, leaf: torch.Tensor, axis: int) -> str:
    """Why a nested or sparse tensor cannot be split, and what to pass instead."""
    if not leaf.is_nested:
        return (
            f"{caller}: {path} is a tensor of layout {leaf.layout} (type {_tree.describe(leaf)}), "
            f"which fdp cannot split along axis {axis}: {_whole_advice(caller)}, or convert it "
            "with .to_dense() to split it"
        )
    # Not a list of its components: a list is a container, whose every tensor fdp would split
    # along the axis (each component's rows, say each image's boxes, over the replicas), not
    # the list.
    return (
        f"{caller}: {path} is a nested tensor (type {_tree.describe(leaf)}), which fdp cannot "
        f"split along axis {axis}: {_whole_advice(caller)}, or pad it into one tensor "
        "(.to_padded_tensor(0.0)) and pass the components' lengths beside it, to split both "
        "by component (a list of the components would not do: fdp splits each tensor in a "
        "list, not the list)"
    )


def packed_sequence_message(caller: str, path: str) -> str:
    """Why a PackedSequence cannot be split over the replicas, and what to pass instead."""
    return (
        f"{caller}: {path} is a torch.nn.utils.rnn.PackedSequence, which fdp cannot split over "
        "the replicas: its data holds the time steps of all the sequences interleaved "
        "(batch_sizes[t] rows for step t), so its rows do not divide by sequence, and its fields "
        "have different lengths (nn.DataParallel cannot split one either). Pass the padded "
        "batch and the lengths instead (torch.nn.utils.rnn.pad_packed_sequence(packed) gives "
        "both), and pack each replica's share inside "
        f"{'forward' if caller.startswith('fdp.DataParallel') else 'the mapped function'} with "
        "pack_padded_sequence(x, lengths, enforce_sorted=False); to give every replica all of "
        f"it, {_tree.whole_advice(caller)}"
    )


_STRIDED = torch.strided  # (a singleton: tested with `is`, the cheapest test)

# Leaves that every replica gets as they are, mapped or not (a step count in resident state),
# told apart with one set lookup.
_PLAIN_VALUES = frozenset({int, float, bool, complex, str, bytes})


def one_replica_row(
    leaves: Sequence[Any], axes: Sequence[Any], device: torch.device, *, all_zero: bool
) -> Sequence[Any] | None:
    """What one replica on ``device`` gets from ``leaves`` when scattering would hand it every
    tensor unchanged, or None when it would do more (a move, a split, an error to report).

    Every tensor leaf must be a plain tensor on ``device``, and the mapped ones of a valid rank
    with one non-empty batch size; :class:`~fdp.PerReplica` leaves give the replica their value
    there, and other objects (numbers, strings, a module) reach it as they are. Returns
    ``leaves`` itself when nothing is to be replaced, else a new list with each PerReplica's
    value. ``fdp.pmap`` then skips the general scatter; when None, :func:`scatter_leaves`
    handles the input, errors included.
    """
    on_cpu = device == _devices.CPU
    if all_zero and on_cpu and _batch_along_0_on_cpu(leaves) is not None:  # the usual in_axes=0
        return leaves
    # One plain loop: on the one-replica path, right after a step's kernels have evicted this
    # code from the caches, each line counts.
    tensor_types = _tree.TENSOR_TYPES
    per_replica = _state.PerReplica
    broadcast = _axes.BROADCAST
    row: list[Any] | None = None
    batch: int | None = None
    for k, (leaf, axis) in enumerate(zip(leaves, axes)):
        kind = type(leaf)
        if kind is per_replica:  # resident state: the replica's own value, where it lives
            if not (len(leaf.values) == 1 or (leaf.prefix_ok and leaf.values)) or leaf.devices[0] != device:
                return None
            if row is None:
                row = list(leaves)
            row[k] = leaf.values[0]
            continue
        if kind not in tensor_types:
            if kind in _PLAIN_VALUES:  # reaches the replica unchanged, whatever its axis
                continue
            if isinstance(leaf, torch.Tensor) or (axis is not broadcast and _tree.unsplittable_reason(leaf)):
                return None  # a tensor subclass, or an error to report
            continue  # any other object reaches the replica unchanged too
        if not (leaf.is_cpu if on_cpu else leaf.device == device):
            return None
        if axis is broadcast:
            continue
        if leaf.is_nested or leaf.layout is not _STRIDED:  # an error to report
            return None
        ndim = leaf.dim()
        if not -ndim <= axis < ndim:
            return None
        size = leaf.shape[axis]
        if batch is None:
            batch = size
        elif size != batch:
            return None
    if batch is None:  # nothing mapped: runs on resident state alone, else an error
        return row
    if not batch:  # an empty batch: an error
        return None
    return leaves if row is None else row


def _batch_along_0_on_cpu(leaves: Sequence[Any]) -> int | None:
    """The batch size when every leaf is a CPU tensor of rank > 0 and all have one non-zero
    size along axis 0; else None."""
    # One plain loop: on the one-replica path, right after a step's kernels have evicted this
    # code from the caches, it costs half of what the same tests written as comprehensions do.
    tensor_types = _tree.TENSOR_TYPES
    batch = None
    try:
        for t in leaves:
            if type(t) not in tensor_types or not t.is_cpu or t.layout is not _STRIDED:
                return None
            shape = t.shape
            if not shape or (batch is not None and shape[0] != batch):
                return None
            batch = shape[0]
    except RuntimeError:  # a nested tensor, which has no shape: an error for the general path
        return None
    return batch or None  # None: no leaves; 0: an empty batch


def _split_all_on_cpu(
    leaves: Sequence[Any], devices: tuple[torch.device, ...], split: _split.SplitRule
) -> Scattered | None:
    """Every leaf a CPU tensor of one batch size along axis 0, every replica on the CPU: split
    them all with one pass per step, in C where possible. None when that does not hold; the
    general path then handles the input, errors included."""
    cpu = _devices.CPU
    if not leaves or not all([d == cpu for d in devices]):
        return None
    tensor_types = _tree.TENSOR_TYPES
    for t in leaves:  # one plain loop: the cheapest way to test every leaf in Python
        if type(t) not in tensor_types or not t.is_cpu:
            return None
    try:
        shape = leaves[0].shape
    except RuntimeError:  # a nested tensor, which has no shape: an error for the general path
        return None
    if not shape or not shape[0]:
        return None
    sizes = _split.shard_sizes(shape[0], len(devices), split)
    run_on = devices[: len(sizes)]
    if len(sizes) == 1:
        return Scattered([list(leaves)], run_on, sizes, []) if _batch_along_0_on_cpu(leaves) else None
    try:
        # split_with_sizes checks every other leaf's batch: a size that differs, or a rank of
        # 0, raises (no per-leaf test in Python needed).
        pieces = [t.split_with_sizes(sizes) for t in leaves]
    except RuntimeError:
        return None
    return Scattered([list(row) for row in zip(*pieces)], run_on, sizes, [])


def _place_replicated(
    leaves: Sequence[Any],
    replicated: list[int],
    rows: list[list[Any]],
    run_on: tuple[torch.device, ...],
    shared: list[tuple[int, list[torch.Tensor]]],
    caller: str,
    paths: Callable[[], list[str]],
) -> None:
    """Copies the axis-None tensors to every replica's device (shared on one device)."""
    if not replicated:
        return
    try:
        copies = _transfer.alias_shared_leaves(
            _transfer.broadcast([leaves[k] for k in replicated], run_on), run_on
        )
    except RuntimeError as err:  # NotImplementedError too
        refuse_meta(caller, leaves, replicated, paths, run_on, err)
        raise
    for j, k in enumerate(replicated):
        per_replica = [copies[r][j] for r in range(len(run_on))]
        for r, copy in enumerate(per_replica):
            rows[r][k] = copy
        shared.append((k, per_replica))


def refuse_meta(
    caller: str,
    leaves: Sequence[Any],
    indices: Sequence[int],
    paths: Callable[[], Sequence[str]],
    devices: Sequence[torch.device],
    err: BaseException,
) -> None:
    """Raises a ValueError naming the first meta tensor among ``leaves[k]`` for ``k`` in
    ``indices``, if any, after a copy to ``devices`` failed with ``err``: torch refuses to copy
    one ("Cannot copy out of meta tensor; no data!") without naming the call or the argument."""
    for k in indices:
        leaf = leaves[k]
        if isinstance(leaf, torch.Tensor) and leaf.is_meta:
            raise ValueError(
                f"{caller}: {paths()[k]} is a meta tensor (type {_tree.describe(leaf)}), which holds "
                f"no data to give the replicas on {', '.join(map(str, devices))}: make it on one of "
                "those devices (a module built on the meta device needs module.to_empty(device=...) "
                "and its parameters initialized first)"
            ) from err


def _share_for_backward(
    leaves: Sequence[Any], replicated: list[int], resident: list[int], rows: list[list[Any]]
) -> None:
    """Gives the replicas that share a CPU tensor requiring grad aliases of it whose gradients
    are summed in replica order (see ``_transfer.share_for_backward``), under
    ``torch.use_deterministic_algorithms(True)``. Only replicated tensors and the copies of a
    prefix PerReplica (``fdp.DataParallel``'s parameters) can be shared: resident state holds a
    copy per replica."""
    # Checked first, on every call with several replicas: when off, nothing else is looked at.
    # The chain costs ~5% of a small model's step on 2 CPU replicas, ~11-16% on 3: as torch
    # leaves such orders to the engine (atomic adds on GPUs) unless deterministic algorithms are
    # asked for, so does fdp. (Two replicas' gradients sum alike in either order anyway, a + b
    # being b + a bit for bit, but for a tensor that each uses more than once.)
    if len(rows) < 2 or not torch.are_deterministic_algorithms_enabled() or not torch.is_grad_enabled():
        return
    indices = replicated + [k for k in resident if leaves[k].prefix_ok]
    if indices:
        _transfer.share_for_backward(rows, indices)


def _place_resident(
    leaves: Sequence[Any],
    resident: list[int],
    rows: list[list[Any]],
    run_on: tuple[torch.device, ...],
    caller: str,
    paths: Callable[[], list[str]],
    devices: tuple[torch.device, ...],
    split: _split.SplitRule,
    batch: int | None,
) -> None:
    """Gives replica r the r-th value of every PerReplica leaf, after checking where they live.

    ``devices`` are the call's devices, ``batch`` the rows split over them (None when nothing
    is mapped); both only go into the error message.
    """
    for k in resident:
        leaf: _state.PerReplica = leaves[k]
        n = len(run_on)
        if leaf.devices[:n] != run_on or not (len(leaf) == n or (leaf.prefix_ok and len(leaf) > n)):
            # (The message below would read "one per replica on ['cpu'], but this call runs 1
            # replica on ['cpu']".)
            remedy = ", or place the state with fdp.device_put_replicated."
            _state.refuse_spelled_devices(leaf, caller, paths()[k], remedy)
            raise ValueError(_resident_message(leaf, paths()[k], run_on, caller, devices, split, batch))
        for r in range(len(run_on)):
            rows[r][k] = leaf.values[r]


def _resident_message(
    leaf: _state.PerReplica,
    path: str,
    run_on: tuple[torch.device, ...],
    caller: str,
    devices: tuple[torch.device, ...],
    split: _split.SplitRule,
    batch: int | None,
) -> str:
    """Why resident state does not fit the replicas a call runs, and what to change."""
    n, held, d = len(run_on), len(leaf), len(devices)
    head = (
        f"{caller}: {path} holds {held} values, one per replica on {[str(x) for x in leaf.devices]}, "
        f"but this call runs {n} {'replica' if n == 1 else 'replicas'} on {[str(x) for x in run_on]}. "
        "Resident state needs every replica to run on every call"
    )
    fits_devices = leaf.devices[:d] == devices and (held == d or leaf.prefix_ok)
    if batch is None or not fits_devices:
        return (
            f"{head}, on the devices it was placed on: this call's devices are "
            f"{[str(x) for x in devices]}. Place the state with fdp.device_put_replicated on the "
            "devices the call runs on (or give the call the devices the state is on)."
        )
    fix = (
        f"give every batch at least one row per device ({d} rows here), e.g. drop the last "
        "partial batch (DataLoader(..., drop_last=True))"
    )
    rows = f"{batch} row" if batch == 1 else f"{batch} rows"
    if split == "chunk":
        piece = -(-batch // d)
        return (
            f"{head}: with split='chunk' (torch.chunk's rule: pieces of {piece} "
            f"{'row' if piece == 1 else 'rows'}) a batch of {rows} over {d} devices runs "
            f"only {n}. Use split='balanced' (one replica per device whenever there are at least "
            f"as many rows as devices) and {fix}."
        )
    return (
        f"{head}: with split='balanced' a batch of {rows}, fewer than the {d} devices, "
        f"runs one replica per row. Keep split='balanced' and {fix}."
    )


def _is_keyword(caller: str, path: str) -> bool:
    """Whether ``path`` is in a keyword argument of a pmapped function (which fdp.pmap maps
    along dim 0 whatever in_axes says; fdp.DataParallel maps every argument alike)."""
    return caller.startswith("fdp.pmap") and path.startswith("kwargs")


def _keyword_advice(paths: list[str]) -> str:
    """Why a keyword argument was mapped, and how not to (jax.pmap's issue #10465: a table
    passed by keyword gave a size error that did not say so)."""
    return (
        f"keyword arguments (here {', '.join(paths)}) are always mapped along dim 0, as in "
        "jax.pmap: to give every replica all of one, pass it positionally with axis None in in_axes; "
        "to split one along another dim (an RNN's initial hidden state, whose batch is on axis 1), "
        "pass it positionally with that axis"
    )


def _inconsistent_sizes_message(
    leaves: Sequence[Any],
    mapped: list[tuple[int, int]],
    user_axes: dict[int, int],
    caller: str,
    paths: list[str],
) -> str:
    """JAX's message: the most common size first, then each other size with its leaves."""
    by_size: dict[int, list[tuple[int, int]]] = {}
    for k, dim in mapped:
        by_size.setdefault(leaves[k].shape[dim], []).append((k, dim))
    groups = sorted(by_size.items(), key=lambda item: -len(item[1]))

    def where(k: int, dim: int) -> str:
        return f"axis {user_axes[k]} of {paths[k]} of type {_tree.describe(leaves[k])}"

    lines = [f"{caller} got inconsistent sizes for array axes to be mapped:"]
    for rank, (size, members) in enumerate(groups):
        count = len(members)
        if rank == 0 and count > 1:
            lines.append(f"  * most axes ({count} of them) had size {size}, e.g. {where(*members[0])};")
        elif count == 1:
            lines.append(f"  * one axis had size {size}: {where(*members[0])};")
        else:
            lines.append(f"  * some axes ({count} of them) had size {size}, e.g. {where(*members[0])};")
    lines[-1] = lines[-1].rstrip(";")
    # A keyword argument off the batch size is most often one that every replica needs whole (a
    # causal attn_mask of shape (L, S), a table), which only positional arguments can be given as.
    keywords = [paths[k] for _, members in groups[1:] for k, _ in members if paths[k].startswith("kwargs")]
    if keywords and caller.startswith("fdp.DataParallel"):
        lines.append(
            f"{keywords[0]} is a keyword argument, which fdp.DataParallel splits as it splits the "
            "others (as nn.DataParallel does): if every replica needs all of it, hold it on the "
            "module instead of passing it"
        )
    elif caller.startswith("fdp.DataParallel"):
        # (No in_axes to give: the same way out as for a keyword argument.)
        lines.append(
            "fdp.DataParallel splits every tensor argument along its dim (as nn.DataParallel "
            "does), so all of them must have the batch's size there: one that every replica needs "
            "whole (an attention mask of shape (L, S), a table) is held on the module instead of "
            "passed"
        )
    elif keywords and _is_keyword(caller, keywords[0]):
        advice = _keyword_advice(keywords)
        lines.append(advice[0].upper() + advice[1:])
    elif caller.startswith("fdp.pmap") and any(paths[k].startswith("args") for k, _ in mapped):
        # The commonest mistake of all: an argument that every replica needs whole (a model's
        # parameters, a table) left under in_axes' default 0. The sizes alone do not say which
        # argument is the odd one out (two leaves of different sizes tie), so this names the fix
        # rather than an argument.
        lines.append(
            "Every positional argument is split along its in_axes entry (0 unless given): one that "
            "every replica needs whole (a model's parameters, a lookup table) takes None there, e.g. "
            "in_axes=(None, 0) for f(params, x); state kept on every device is placed once with "
            "fdp.device_put_replicated"
        )
    return "\n".join(lines)


def scatter(
    tree: Any,
    devices: Sequence[_devices.DeviceLike],
    *,
    in_axes: Any = 0,
    split: _split.SplitRule = "chunk",
) -> list[Any]:
    """Splits a tree over devices: one tree per replica, differentiably.

    The pytree-generic, CPU-capable counterpart of ``torch.nn.parallel.scatter``. Tensor leaves
    with an int axis are cut along it by the split rule and moved to the replica's device;
    tensor leaves with axis ``None`` are copied whole to every device; other leaves reach every
    replica unchanged, but for arrays of other libraries (a NumPy array of rank 1 or more), which
    under an int axis are refused rather than given whole to every replica. Gradients flow back
    to the original tensors.

    Args:
        tree: any pytree: dicts, lists, tuples, namedtuples, plain dataclasses, optree-registered
            types.
        devices: the devices to split over (ints are CUDA indices; duplicates allowed).
        in_axes: an int, ``None``, or a tree prefix of ``tree`` of them. Keyword-only. Default:
            ``0``.
        split: ``"chunk"`` (``torch.chunk``'s rule, fewer replicas than devices for small batches)
            or ``"balanced"`` (sizes differ by at most one). Keyword-only. Default: ``"chunk"``.

    Returns:
        A list with one tree per replica that runs (``len <= len(devices)``).

    Raises:
        ValueError: mapped leaves disagree in size, a leaf's rank is too small, the batch is
            empty, or ``in_axes`` is not a prefix of ``tree``.
        TypeError: a NumPy array (or another library's array) under an int axis.

    Examples:
        >>> import torch, fdp
        >>> shards = fdp.scatter({"x": torch.arange(5), "tag": "a"}, ["cpu", "cpu"])
        >>> [s["x"].tolist() for s in shards], [s["tag"] for s in shards]
        ([[0, 1, 2], [3, 4]], ['a', 'a'])
    """
    caller = "fdp.scatter"
    resolved = _devices.resolve_devices(devices, what=f"{caller} devices")
    split = _split.check_split(split, what=f"{caller} split")
    # A list of axes may spell a tuple's (as pmap's in_axes do for its arguments), but a list
    # tree's axes are a list: read as a tuple, they would match no list at all.
    spec = _axes.check_spec(in_axes, what="in_axes", caller=caller, list_as_tuple=not isinstance(tree, list))
    leaves, treespec = _tree.flatten_for(tree, caller, "tree")
    axes = _axes.leaf_axes(spec, tree, what="in_axes", tree_name="the tree", caller=caller)
    if packed := _tree.packed_sequence_path((tree,), ("tree",), axes, treespec):
        raise TypeError(packed_sequence_message(caller, packed))
    result = scatter_leaves(
        leaves,
        axes,
        resolved,
        split,
        caller=caller,
        paths=lambda: _tree.flatten_with_paths(tree, "tree")[0],
    )
    return [_tree.unflatten(treespec, row) for row in result.leaves]


def replicate(tree: T, devices: Sequence[_devices.DeviceLike]) -> list[T]:
    """One copy of ``tree`` per device, differentiably.

    The pytree counterpart of ``torch.nn.parallel.replicate``: every tensor leaf is copied to
    each device (between GPUs with one coalesced broadcast); a tensor already on a device is
    used as it is there, and duplicate devices share one copy. Gradients of the copies sum into
    the original. Non-tensor leaves are shared.

    Args:
        tree: any pytree, e.g. ``dict(model.named_parameters())``.
        devices: the target devices (ints are CUDA indices; duplicates allowed).

    Returns:
        A list with one tree per device.

    Examples:
        >>> import torch, fdp
        >>> w = torch.ones(2, requires_grad=True)
        >>> copies = fdp.replicate({"w": w}, ["cpu", "cpu"])
        >>> copies[0]["w"] is w, len(copies)
        (True, 2)
    """
    resolved = _devices.resolve_devices(devices, what="fdp.replicate devices")
    leaves, treespec = _tree.flatten_for(tree, "fdp.replicate", "tree")
    tensor_slots = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    try:
        copies = _transfer.broadcast([leaves[k] for k in tensor_slots], resolved)
    except RuntimeError as err:  # NotImplementedError too
        paths = lambda: _tree.flatten_with_paths(tree, "tree")[0]  # noqa: E731
        refuse_meta("fdp.replicate", leaves, tensor_slots, paths, resolved, err)
        raise
    result = []
    for r in range(len(resolved)):
        row = list(leaves)
        for j, k in enumerate(tensor_slots):
            row[k] = copies[r][j]
        result.append(_tree.unflatten(treespec, row))
    return result
