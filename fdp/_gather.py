"""Gather: from one output tree per replica to one tree on the output device.

:func:`gather_leaves` is the one place where replica outputs are checked and joined; ``fdp.pmap``
and the public :func:`gather` both use it.

* Tensor leaves with an int axis are concatenated along it on the destination; 0-dim tensors
  are stacked into a vector with one entry per replica, under axis 0 or -1 (another is an
  error, but for ``fdp.DataParallel``'s ``dim``; ``nn.DataParallel`` warns and unsqueezes for
  dim 0 and fails otherwise).
* Tensor leaves with axis ``None`` are taken from one replica: the first on the destination
  device, else replica 0 (moved). With ``check=True`` every replica must hold an equal value.
* Non-tensor leaves are returned once when every replica returned an equal value, and are an
  error otherwise (``nn.DataParallel`` turns a ``str`` into ``"<map object ...>"``).
* Every replica must return the same tree structure; container types are kept.
"""

from __future__ import annotations

import cmath
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch

from . import _axes, _devices, _state, _transfer, _tree

__all__ = ["gather", "gather_outputs"]


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        # 1, 1.0 and True are ==, as np.float16(1) and np.float32(1) are: replicas that return
        # values of different types ran different code, as tensors of different dtypes show
        # (refused too), and which one came back would be replica 0's by chance.
        return False
    numpy = sys.modules.get("numpy")  # only if the program uses it: never imported here
    if numpy is not None and isinstance(a, numpy.ndarray) and isinstance(b, numpy.ndarray):
        # == is elementwise, with no truth value of its own: equal as _same_tensor has it.
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        try:
            return bool(numpy.array_equal(a, b, equal_nan=True))
        except TypeError:  # a dtype without NaN (strings, objects)
            pass
        try:
            return bool(numpy.array_equal(a, b))
        except Exception:  # noqa: BLE001 - e.g. object arrays of arrays: not provably equal
            return False
    try:
        if bool(a == b):
            return True
    except Exception:  # noqa: BLE001 - e.g. an ambiguous truth value: not provably equal
        return False
    # NaN equals nothing, itself included: each replica computing one makes an object of its own.
    return (
        isinstance(a, float | complex)
        and isinstance(b, float | complex)
        and cmath.isnan(a)
        and cmath.isnan(b)
    )


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, dtypes and values, NaNs in the same places counting as equal."""
    if a.is_nested or b.is_nested or a.layout != torch.strided or b.layout != torch.strided:
        # A nested tensor: component by component (one of torch's strided layout has no shape,
        # and equal jagged ones have shapes of different symbolic sizes); a sparse one, dense
        # (torch.equal has no sparse kernel).
        if a.is_nested != b.is_nested or a.layout != b.layout or a.dtype != b.dtype:
            return False
        if a.is_nested:
            parts_a, parts_b = a.unbind(), b.unbind()
            return len(parts_a) == len(parts_b) and all(map(_same_tensor, parts_a, parts_b))
        return _same_tensor(a.to_dense(), b.to_dense())
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


class OutputPlan:
    """Per-leaf out axes for one output structure (cached by ``fdp.pmap``)."""

    __slots__ = ("treespec", "axes", "all_zero", "all_none", "all_per_replica", "packed")

    def __init__(self, treespec: optree.PyTreeSpec, axes: list[Any], packed: str | None = None) -> None:
        self.treespec = treespec
        self.axes = axes
        self.packed = packed  # the key path of a PackedSequence under an int axis, if any
        self.all_zero = _axes.all_zero(axes)
        self.all_none = all(a is _axes.BROADCAST for a in axes)
        self.all_per_replica = bool(axes) and all(a is _state.PER_REPLICA for a in axes)


def gather_outputs(
    outputs: Sequence[Any],
    destination: torch.device,
    out_axes: Any,
    *,
    caller: str,
    check: bool = False,
    plans: dict[optree.PyTreeSpec, OutputPlan] | None = None,
    devices: Sequence[torch.device] | None = None,
    inputs: Sequence[Any] = (),
    structure: _tree.LastStructure | None = None,
    rename: Callable[[str], str] | None = None,
    user_output: Callable[[Any], Any] | None = None,
) -> Any:
    """Joins the replicas' output trees on ``destination``; ``out_axes`` is a checked spec.

    ``plans`` caches the plan of every output structure; ``structure`` flattens replica 0's
    output along the last call's and keeps its plan (both kept by ``fdp.pmap`` per function).
    ``devices`` are the replicas' devices and ``inputs`` the call's input leaves, for
    ``PER_REPLICA`` outputs (see :func:`_own_copies`). ``rename`` rewrites the key paths that
    messages name (a wrapper's own output tree is not the user's), and ``user_output`` picks
    the user's part of a replica's output, for messages that show its structure.
    """
    lone = len(outputs) == 1
    # A lone replica's output is returned as it is where it can be, with nothing rebuilt from
    # its structure, which may then be matched loosely (see _tree.LastStructure); where the
    # last call's output had to be rebuilt (resident state), it is flattened exactly at once.
    exact = not lone or (structure is not None and _rebuilt(structure.kept()))
    leaves, treespec, plan, exact = _flat_output(
        outputs[0], out_axes, plans, structure, exact=exact, caller=caller, rename=rename
    )
    if lone:
        if _whole_as_it_is(leaves, plan, destination):
            return outputs[0]  # one replica, nothing to join, already on the destination
        if not exact:  # to be rebuilt from it
            leaves, treespec, plan, _ = _flat_output(
                outputs[0], out_axes, plans, structure, exact=True, caller=caller, rename=rename
            )
        if plan.all_per_replica and devices is not None:  # resident state
            own = _lone_per_replica(leaves, inputs, devices)
            try:  # (a try costs nothing until it catches: a resident step passes here every call)
                return _tree.unflatten(treespec, own)
            except Exception:
                _refused_per_replica(treespec, own, plan, caller, rename)
                raise
    if torch._C._is_any_autocast_enabled():  # type: ignore[attr-defined]
        # fdp's own cat and stack must keep every dtype (see _thread_state.without_autocast):
        # the call again with autocast off, rather than a wrapper on the usual path.
        with torch._C._DisableAutocast():  # type: ignore[attr-defined]
            return gather_outputs(
                outputs,
                destination,
                out_axes,
                caller=caller,
                check=check,
                plans=plans,
                devices=devices,
                inputs=inputs,
                structure=structure,
                rename=rename,
                user_output=user_output,
            )
    if not lone and plan.packed is not None:
        # Joined field by field, the replicas' PackedSequences make a corrupt one: its
        # batch_sizes no longer describe its data, and pad_packed_sequence on it wrote out of
        # bounds (torch 2.13 on CPU: the process aborted with "free(): invalid size").
        raise TypeError(
            _packed_sequence_message(caller, plan.packed if rename is None else rename(plan.packed))
        )
    flat = [(leaves, treespec)]
    if not lone:
        types = list(map(type, leaves))
        flat += [_tree.flatten_like(out, treespec, types) for out in outputs[1:]]
        for r, (_, other) in enumerate(flat[1:], start=1):
            if not _tree.replicas_agree(other, treespec):
                mine, theirs = treespec, other
                if user_output is not None:
                    # The user's parts, where they differ: a wrapper's own structure around
                    # them (fdp.DataParallel's (output, state)) is none of the user's business.
                    shown = (
                        _tree.flatten(user_output(outputs[0]))[1],
                        _tree.flatten(user_output(outputs[r]))[1],
                    )
                    if not _tree.replicas_agree(*shown):
                        mine, theirs = shown
                raise ValueError(
                    f"{caller}: the replicas returned outputs of different structure: replica 0 "
                    f"returned {mine} but replica {r} returned {theirs}. Every replica must "
                    "return the same structure."
                )
        if plan.all_zero and destination == _devices.CPU:
            fast = _cat_all_on_cpu([leaves for leaves, _ in flat])
            if fast is not None:
                return _tree.unflatten(treespec, fast)
    columns = list(zip(*(leaves for leaves, _ in flat)))
    taken: set[int] | None = None  # storages already used by a PER_REPLICA output, or inputs'
    joined = []
    for k, (values, axis) in enumerate(zip(columns, plan.axes)):
        if axis is _state.PER_REPLICA:
            if taken is None:
                taken = _input_storages(inputs)
            own = _own_copies(values, taken)
            joined.append(_state.PerReplica(own, devices or [_device_of(v, destination) for v in own]))
        else:
            joined.append(
                _join(
                    values, axis, destination, k, caller=caller, check=check, outputs=outputs, rename=rename
                )
            )
    try:
        return _tree.unflatten(treespec, joined)
    except Exception:
        _refused_per_replica(treespec, joined, plan, caller, rename)
        raise


def _refused_per_replica(
    treespec: optree.PyTreeSpec,
    leaves: list[Any],
    plan: OutputPlan,
    caller: str,
    rename: Callable[[str], str] | None,
) -> None:
    """Called where rebuilding the output from its joined ``leaves`` raised: if a node refused
    its fields' fdp.PerReplica values (out_axes fdp.PER_REPLICA), a TypeError naming it, with
    what to return instead; it raised from inside the user's class (a dataclass whose
    ``__post_init__`` reads a field's ``.shape``, a registered node whose unflatten validates),
    naming neither the call nor the output. Returns otherwise, for the caller to re-raise."""
    marked = [axis is _state.PER_REPLICA for axis in plan.axes]
    found = _tree.refusing_node(treespec, leaves, marked, "output") if any(marked) else None
    if found is None:
        return
    path, node_type, error = found
    name = node_type.__qualname__
    # (A PackedSequence under an int axis is refused on several replicas: see _packed_sequence_message.)
    instead = "None" if issubclass(node_type, torch.nn.utils.rnn.PackedSequence) else "None or 0"
    raise TypeError(
        f"{caller}: {_state.refused_by_node(path if rename is None else rename(path), node_type, error)}. "
        "out_axes fdp.PER_REPLICA keeps each of the output's tensors on its replica, as a "
        f"fdp.PerReplica in the output's own containers. Return the {name}'s fields in a dict or "
        f"a tuple (and build a {name} from fdp.unreplicate of them where one is needed), or give "
        f"it out_axes {instead} in an out_axes tree prefix"
    ) from error


def _packed_sequence_message(caller: str, path: str) -> str:
    """Why the replicas' PackedSequences cannot be joined, and what to return instead. (Not
    out_axes fdp.PER_REPLICA: that makes each of its fields a PerReplica, and PackedSequence,
    checking its fields' devices as it is built, refuses them: see _refused_per_replica.)"""
    return (
        f"{caller}: {path} is a torch.nn.utils.rnn.PackedSequence, which fdp cannot concatenate "
        "over the replicas: each replica's interleaves its own sequences' time steps, and joined "
        "field by field they make no PackedSequence of the batch. Return the padded output "
        "instead, torch.nn.utils.rnn.pad_packed_sequence(output, batch_first=..., "
        "total_length=T)[0] with T the padded length of the input, so that every replica's has "
        "the same length"
    )


def _flat_output(
    output: Any,
    out_axes: Any,
    plans: dict[optree.PyTreeSpec, OutputPlan] | None,
    structure: _tree.LastStructure | None,
    *,
    exact: bool,
    caller: str,
    rename: Callable[[str], str] | None = None,
) -> tuple[list[Any], optree.PyTreeSpec, OutputPlan, bool]:
    """Replica 0's output flattened (along the last call's with ``structure``), its plan, and
    whether the structure is surely the output's own (see :meth:`_tree.LastStructure.flatten`)."""
    try:
        if structure is not None:
            leaves, treespec, plan, exact = structure.flatten(output, exact=exact)
        else:
            (leaves, treespec), plan, exact = _tree.flatten(output), None, True
    except _tree.UnplacedError as err:  # said where it was found: in which output
        raise err.at(caller, (output,), ("output",), rename) from None
    if plan is None:
        plan = plans.get(treespec) if plans is not None else None
        if plan is None:
            axes = _axes.leaf_axes(out_axes, output, what="out_axes", tree_name="the output", caller=caller)
            plan = OutputPlan(
                treespec, axes, _tree.packed_sequence_path((output,), ("output",), axes, treespec)
            )
            if plans is not None:
                plans[treespec] = plan
        if structure is not None:
            structure.keep(treespec, plan)
    return leaves, treespec, plan, exact


def _rebuilt(plan: OutputPlan | None) -> bool:
    """Whether a lone replica's output with this plan is rebuilt rather than returned as it is
    (see :func:`_whole_as_it_is`; a plan of 0 axes on another device than the CPU may be
    either)."""
    return plan is not None and not (plan.all_none or plan.all_zero)


def _whole_as_it_is(leaves: list[Any], plan: OutputPlan, destination: torch.device) -> bool:
    """Whether a lone replica's output leaves are the result as they are: with out axes None,
    every tensor on ``destination``; with out axes 0 and the CPU as destination, every leaf a
    CPU tensor of rank > 0 (what concatenating one piece would return)."""
    # Plain loops: on one replica's path, right after a step's kernels, they cost half of what
    # all() over a comprehension does.
    if plan.all_none:
        if destination == _devices.CPU:  # is_cpu builds no device object: cheaper
            for t in leaves:  # noqa: SIM110
                if isinstance(t, torch.Tensor) and not t.is_cpu:
                    return False
            return True
        return all(t.device == destination for t in leaves if isinstance(t, torch.Tensor))
    if plan.all_zero and destination == _devices.CPU:
        tensor_types = _tree.TENSOR_TYPES
        try:
            for t in leaves:  # noqa: SIM110
                if type(t) not in tensor_types or not t.is_cpu or not t.shape:
                    return False
        except RuntimeError:  # a nested tensor, which has no shape: joined as the others are
            return False
        return True
    return False


def _cat_all_on_cpu(per_replica: list[list[Any]]) -> list[Any] | None:
    """Every leaf of every replica a CPU tensor, all of one rank > 0, all concatenated along
    axis 0 on the CPU: join them with one pass per step. None when that does not hold (or a
    ``cat`` fails); the general path then handles the output, errors included."""
    # Replica 0's leaves are tested for their device here; the others' device is left to
    # torch.cat, which refuses tensors on different devices (the general path then moves
    # them). Every leaf's type is tested: cat would hand a non-tensor with __torch_function__
    # the call. The ranks must be compared: cat skips an empty 1-D tensor beside tensors of
    # another rank, for backward compatibility.
    # The dtypes too: cat would promote different ones, silently.
    tensor_types = _tree.TENSOR_TYPES
    ranks = []
    dtypes = []
    for t in per_replica[0]:
        if type(t) not in tensor_types or not t.is_cpu:
            return None
        ranks.append(t.dim())
        dtypes.append(t.dtype)
    if not ranks or 0 in ranks or not _tree.QUANTIZED_DTYPES.isdisjoint(dtypes):
        return None  # (quantized tensors: their scales are checked on the general path)
    for leaves in per_replica[1:]:
        for t, rank, dtype in zip(leaves, ranks, dtypes):
            if type(t) not in tensor_types or t.dim() != rank or t.dtype is not dtype:
                return None
    try:
        return [torch.cat(column) for column in zip(*per_replica)]
    except RuntimeError:
        return None


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except NotImplementedError:  # a tensor without one storage (sparse): told apart by identity
        return id(t)


def _own_copies(values: Sequence[Any], taken: set[int]) -> list[Any]:
    """Per-replica values that share no memory with each other, with the call's tensor inputs,
    or with earlier per-replica outputs: resident state may be updated in place, replica by
    replica. A value that would share (a replicated input returned as is, a shard of the
    caller's batch) is copied; a replica's own fresh tensor is kept as it is. Resident inputs
    (``PerReplica`` leaves) returned as they are stay as they are: the new state then shares
    them with the old, which a loop drops (copying frozen state on every step would cost a pass
    over it). The memory of each value returned is added to ``taken``."""
    # One plain loop, not a helper called per value: a resident step returns every parameter and
    # optimizer state, and right after its kernels each line runs cold.
    own = []
    tensor = torch.Tensor
    for value in values:
        if isinstance(value, tensor) and value.numel() > 0:
            storage = _storage(value)
            if storage in taken:
                value = value.clone()
                storage = _storage(value)
            taken.add(storage)
        own.append(value)
    return own


def _lone_per_replica(
    leaves: Sequence[Any], inputs: Sequence[Any], devices: Sequence[torch.device]
) -> list[_state.PerReplica]:
    """A lone replica's output leaves as :class:`~fdp.PerReplica` leaves, each value in memory
    of its own (see :func:`_own_copies`).

    A resident training step returns every parameter and optimizer state, and right after the
    step's kernels each call per leaf runs cold (see docs/benchmarks.md, "One replica, after
    real work"): the leaves are wrapped in one loop (``PerReplica._each``).
    """
    return _state.PerReplica._each(_own_copies(leaves, _input_storages(inputs)), tuple(devices))


def _input_storages(inputs: Sequence[Any]) -> set[int]:
    """The memory of the call's tensor inputs, which per-replica outputs must not share (see
    :func:`_own_copies`). Resident (``PerReplica``) inputs, usually most of them, are passed
    over with one type test each."""
    per_replica = _state.PerReplica
    taken = set()
    for t in inputs:
        if type(t) is not per_replica and isinstance(t, torch.Tensor):
            taken.add(_storage(t))
    return taken


def _device_of(value: Any, default: torch.device) -> torch.device:
    return value.device if isinstance(value, torch.Tensor) else default


def _join(
    values: Sequence[Any],
    axis: Any,
    destination: torch.device,
    k: int,
    *,
    caller: str,
    check: bool,
    outputs: Sequence[Any],
    rename: Callable[[str], str] | None = None,
) -> Any:
    """One output leaf from every replica's value at position ``k``."""
    first = values[0]
    if type(axis) is int and isinstance(first, torch.Tensor):
        # The common case, kept short: tensors of one rank > 0, concatenated.
        ndim = first.dim()
        if (
            ndim
            and not first.is_quantized  # (scales checked below)
            and -ndim <= axis < ndim
            and all(
                isinstance(v, torch.Tensor) and v.dim() == ndim and v.dtype is first.dtype for v in values
            )
        ):
            try:
                return _transfer.gather_to(values, axis % ndim, destination)
            except RuntimeError:
                pass  # reported below, with the leaf's path

    # Everything else, checked: non-tensor values, mixes, 0-dim, axis None, errors.
    def path() -> str:
        found: str = _tree.flatten_with_paths(outputs[0], "output")[0][k]
        return found if rename is None else rename(found)

    tensors = [isinstance(v, torch.Tensor) for v in values]
    if not any(tensors):
        # An object holding tensors is refused where the replicas returned objects of their own,
        # not one that they share (a closure's, returned once, as equal non-tensor values are).
        # A lone replica's is returned as it is, and holds the whole batch's tensors: nothing
        # tells it from a shared one, so refusing it too (as PackedSequence inputs are refused
        # on one device) would refuse, on one device, programs that run on several.
        if any(v is not first for v in values[1:]) and (reason := _tree.unjoinable_reason(first, caller)):
            raise TypeError(f"{caller}: {path()}: {reason}")
        for r, v in enumerate(values[1:], start=1):
            if not _equal(first, v):
                raise ValueError(
                    f"{caller}: the replicas returned different non-tensor values at {path()}: "
                    f"replica 0 returned {first!r} but replica {r} returned {v!r}. Non-tensor "
                    "outputs are returned once and must agree; return a tensor to get one "
                    "value per replica."
                )
        return first
    if not all(tensors):
        kinds = ", ".join(_tree.describe(v) for v in values)
        raise ValueError(
            f"{caller}: the replicas returned a mix of tensors and other values at {path()} "
            f"({kinds}); each output leaf must be a tensor on every replica or on none"
        )
    if axis is _axes.BROADCAST:
        return _unmapped(values, destination, caller=caller, check=check, path=path)
    if any(v.dtype is not first.dtype for v in values):
        # torch.cat would promote them, silently: every replica runs the same program, so a
        # difference is a bug in the function (a branch on the replica's data, say).
        kinds = ", ".join(_tree.describe(v) for v in values)
        raise ValueError(
            f"{caller}: the replicas returned different dtypes at {path()} ({kinds}); every "
            "replica must return the same dtype there"
        )
    if first.is_quantized:
        _check_one_scale(values, caller, path)
    if all(v.dim() == 0 for v in values):
        if axis not in (0, -1) and not caller.startswith("fdp.DataParallel"):
            # The stack makes a vector, with one dim: out_axes=5 was taken for 0, silently, where
            # out_axes=1 on a vector (and jax.pmap's out_axes past the rank) is an error.
            # (fdp.DataParallel's dim is its inputs' too, with no entry per output to give a
            # loss computed in forward 0: it stacks them along any dim, where nn.DataParallel
            # raised IndexError for every dim but 0.)
            kinds = ", ".join(_tree.describe(v) for v in values)
            raise ValueError(
                f"{caller}: cannot stack {path()} along out_axes {axis}: the replicas returned "
                f"{kinds}; 0-dim outputs are stacked into a new vector with one entry per replica, "
                "and out_axes names a dim of it: a dim in [-1, 0] fits (where the other outputs "
                f"need out_axes {axis}, give this one its own entry in an out_axes tree prefix)"
            )
        return _transfer.gather_to([v.unsqueeze(0) for v in values], 0, destination)
    ranks = {v.dim() for v in values}
    dim = _axes.normalize_axis(axis, values[0].dim()) if len(ranks) == 1 else None
    if dim is None:
        kinds = ", ".join(_tree.describe(v) for v in values)
        # An axis past the rank is what a jax.pmap habit gives (out_axes=1 on a vector there
        # inserts a device axis): say which dims exist.
        rank = values[0].dim()
        # fdp.DataParallel's option is nn.DataParallel's dim, with no jax.pmap habit behind it.
        option, habit = (
            ("dim", "as nn.DataParallel's gather does")
            if caller.startswith("fdp.DataParallel")
            else ("out_axes", "it inserts no new axis, unlike jax.pmap's")
        )
        if len(ranks) == 1:
            fits = (
                f"; {option} concatenates along an existing dim ({habit}): a dim in "
                f"[{-rank}, {rank - 1}] fits"
            )
        else:
            # Every replica runs the same code, so ranks that differ come from the shards: most
            # often `model(x).squeeze()`, which drops the batch dim too where a replica got one
            # row (a batch that does not divide evenly leaves such a shard), and which the whole
            # batch on one device keeps. nn.DataParallel fails there alike, in torch.cat's words.
            fits = (
                ": their ranks differ, where every replica runs the same code. A squeeze() that "
                "drops the batch dim of a replica's shard of one row (which uneven shards leave) "
                "is the usual cause, where the whole batch on one device keeps it: squeeze the "
                "dim meant instead (e.g. .squeeze(-1))"
            )
        raise ValueError(
            f"{caller}: cannot concatenate {path()} along {option} {axis}: the replicas "
            f"returned {kinds}{fits}"
        )
    try:
        return _transfer.gather_to(values, dim, destination)
    except RuntimeError as err:
        kinds = ", ".join(_tree.describe(v) for v in values)
        raise ValueError(
            f"{caller}: cannot concatenate {path()} along axis {dim}: the replicas returned {kinds} ({err})"
        ) from err


def _check_one_scale(values: Sequence[torch.Tensor], caller: str, path: Callable[[], str]) -> None:
    """Refuses quantized tensors of different scales or zero points, which a concatenation
    joins at the first one's: the others' values came back clipped to its range, silently (a
    replica's 200 at scale 10 came back as 25.5 at scale 0.1). Each replica quantizing its own
    shard picks a scale of its own, where one device quantizing the batch picks one."""
    first = values[0]
    if first.qscheme() not in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return  # per-channel: torch's cat refuses them, and the error below names the output
    mine = (first.q_scale(), first.q_zero_point())
    for r, v in enumerate(values[1:], start=1):
        theirs = (v.q_scale(), v.q_zero_point())
        if theirs != mine:
            remedies = [
                "quantize them alike on every replica (with one scale, e.g. from fdp.pmax of the "
                "shards' ranges)",
                "return them dequantized (.dequantize())",
            ]
            if caller.startswith(("fdp.pmap", "fdp.gather")):  # (fdp.DataParallel has no out_axes)
                remedies.append("keep each replica's with out_axes=fdp.PER_REPLICA")
            raise ValueError(
                f"{caller}: the replicas returned quantized tensors of different scales at {path()}: "
                f"replica 0 returned scale {mine[0]}, zero point {mine[1]} but replica {r} returned "
                f"scale {theirs[0]}, zero point {theirs[1]}; joined into one tensor they would take "
                f"replica 0's, and values outside its range would come back clipped: "
                f"{', '.join(remedies[:-1])}, or {remedies[-1]}"
            )


def _unmapped(
    values: Sequence[torch.Tensor], destination: torch.device, *, caller: str, check: bool, path: Any
) -> torch.Tensor:
    chosen = next((r for r, v in enumerate(values) if v.device == destination), 0)
    try:
        result = _transfer.to_device(values[chosen], destination)
    except torch.OutOfMemoryError:
        raise  # (a RuntimeError) as it is: callers that shrink the batch on it catch it by type
    except (RuntimeError, NotImplementedError) as err:
        # A meta tensor, say ("Cannot copy out of meta tensor; no data!"): torch's error names
        # neither the call nor the output, as the concatenation's (for int axes) does.
        raise ValueError(
            f"{caller}: cannot move {path()} ({_tree.describe(values[chosen])} on "
            f"{values[chosen].device}), whose out_axes is None, to {destination} ({err})"
        ) from err
    if check:
        for r, v in enumerate(values):
            if r == chosen:
                continue
            other = _transfer.to_device(v, destination)
            if not _same_tensor(other, result):
                raise ValueError(
                    f"{caller}: out_axes is None for {path()}, but the replicas disagree: "
                    f"replica {chosen} returned {_tree.describe(result)} (the value returned) but "
                    f"replica {r} returned {_tree.describe(other)}{_first_difference(result, other)}"
                )
    return result


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where two tensors of one shape and dtype, unequal as :func:`_same_tensor` has it, differ
    first, with both values there, for a message (nothing for other shapes or dtypes, which
    their descriptions show)."""
    try:
        if a.is_nested or a.layout != torch.strided or a.shape != b.shape or a.dtype != b.dtype:
            return ""
        a, b = a.detach(), b.detach()
        unequal = a != b
        if a.is_floating_point() or a.is_complex():
            unequal &= ~(a.isnan() & b.isnan())
        where = tuple(int(i) for i in unequal.nonzero()[0]) if a.dim() else ()
        values = f"{a[where].item()!r} vs {b[where].item()!r}"
    except Exception:  # noqa: BLE001 - a dtype without these ops (quantized, on some devices)
        return ""
    return f": {values}" if not where else f", which differ first at {list(where)}: {values}"


def gather(
    trees: Sequence[Any],
    device: _devices.DeviceLike,
    *,
    out_axes: Any = 0,
) -> Any:
    """Joins one tree per replica into one tree on ``device``, differentiably.

    The pytree-generic, CPU-capable counterpart of ``torch.nn.parallel.gather``.

    Args:
        trees: the replicas' trees, all of the same structure.
        device: where the result goes (``"cpu"`` allowed).
        out_axes: an int, ``None``, :data:`fdp.PER_REPLICA`, or a tree prefix of the trees.
            Int: tensors are concatenated along that dim (0-dim tensors are stacked into a
            vector, whose one dim only ``0`` or ``-1`` names). ``None``: the value of the
            replica on ``device`` (else the first replica's, moved) is returned.
            ``PER_REPLICA``: each leaf becomes a :class:`fdp.PerReplica` of the replicas'
            values, left where they are (a value that shares memory with an
            earlier replica's is copied). Keyword-only. Default: ``0``.

    Returns:
        One tree with the replicas' structure. Non-tensor leaves are returned once, and must
        be equal on every replica.

    Raises:
        ValueError: the structures differ, non-tensor leaves differ, or tensors cannot be
            concatenated.
        TypeError: ``trees`` is one tree (a tensor or a dict) rather than a sequence of them.

    Examples:
        >>> import torch, fdp
        >>> fdp.gather([{"y": torch.zeros(2), "n": 1}, {"y": torch.ones(1), "n": 1}], "cpu")
        {'y': tensor([0., 0., 1.]), 'n': 1}
    """
    caller = "fdp.gather"
    if isinstance(trees, (torch.Tensor, Mapping)):
        # One replica's output rather than the list of them: a tensor's truth value is an
        # error of torch's own, and a dict's keys were gathered as if they were the replicas'.
        got = (
            f"tensor of type {_tree.describe(trees)}"
            if isinstance(trees, torch.Tensor)
            else type(trees).__name__
        )
        raise TypeError(
            f"{caller}: trees must be a sequence of the replicas' trees (one per replica), got "
            f"a {got}; for one replica, pass [tree]"
        )
    if not trees:
        raise ValueError(f"{caller} needs at least one tree, got an empty sequence")
    destination = _devices.check_available(
        _devices.parse_device(device, what=f"{caller} device"), what=f"{caller} device"
    )
    spec = _axes.check_spec(out_axes, what="out_axes", caller=caller, per_replica=True)
    return gather_outputs(list(trees), destination, spec, caller=caller)
