"""Collectives inside mapped functions: psum, pmean, pmax, pmin, all_gather, psum_scatter,
all_to_all, ppermute, axis_index, axis_size.

Every collective takes a pytree. Its tensor leaves are coalesced into one flat buffer per
(device, dtype) (:class:`_Packed`), the replicas meet once in the call group's exchange
(``_replica.CallGroup.exchange``), the last one to arrive combines the buffers for all of them
(:class:`_Op` subclasses), and each replica unpacks its result. Sums over CPU replicas in one
process are the exception: there each replica adds the (private) buffers itself after the
exchange, in parallel with the others (``_Op.combine_each``). A lone replica in one process
meets no one: its sum, mean, maximum or minimum is a private copy of its value, made at once
(``_Op.keeps_lone_value``), or the value itself where the caller gave it up
(``donate=True``). On CUDA the replicas' streams are ordered around the combine (``_streams``).

Differentiation, two ways:

* Through the whole pmapped call (``loss.backward()`` on its output, the usual case): the
  combination is made of ordinary differentiable torch ops on the replicas' actual tensors, so
  the autograd graph spans the replicas and every transpose is exact by construction (under
  deterministic algorithms, a tensor that feeds every replica's result reaches each through an
  alias of its own, so that its gradient adds theirs in replica order: :func:`_in_replica_order`).
  Such results refuse to be differentiated *inside* a replica while the call runs (the graph there
  is only partly built), with an error that says what to do instead.
* Inside a replica, under ``torch.func.grad``/``vjp``/``vmap``: the collective is a custom
  autograd function whose backward is the transposed collective, run by every replica's
  backward together (psum <-> psum, pmean <-> pmean, all_gather <-> psum_scatter,
  all_to_all <-> itself, ppermute <-> the inverse permutation; pmax/pmin send the cotangent to
  the replicas that held the extreme value), as in ``jax.pmap``.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import operator
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar, overload

import torch

from . import _distributed, _grad, _replica, _split, _streams, _thread_state, _transfer, _tree
from ._compile import eager_under_compile, never_compiled

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "axis_index",
    "axis_size",
]


# --- jax.lax's options ---------------------------------------------------------------------------

_F = TypeVar("_F", bound=Callable[..., Any])

# A program ported from jax.pmap passes jax.lax's keywords, and Python's "got an unexpected
# keyword argument" does not say what fdp calls them (see docs/migrating/from-jax.md).
_NO_GROUPS = (
    "fdp's collectives combine every replica of the one axis that fdp.pmap maps; there are no "
    "groups of replicas (map one axis, and fdp.all_gather what another grouping needs)"
)


def _refusing_jax_options(**instead: str) -> Callable[[_F], _F]:
    """A collective that names its own spelling of ``jax.lax``'s keyword options it is passed:
    ``axis_index_groups``, and ``instead``'s (JAX's keyword -> what to write, with ``{value}``
    the value passed); see :func:`_tree.naming_foreign_options`."""

    def decorate(fn: _F) -> _F:
        whose = f"jax.lax.{fn.__name__}'s"
        options = {key: (whose, text) for key, text in {"axis_index_groups": _NO_GROUPS, **instead}.items()}
        return _tree.naming_foreign_options(f"fdp.{fn.__name__}", options)(fn)

    return decorate


# --- binding -----------------------------------------------------------------------------------


def _bound(axis_name: Hashable, caller: str, *, advise: bool = True) -> _replica.ReplicaContext:
    """The replica's context, where ``axis_name`` is bound; else a NameError that says why, and
    with ``advise`` how to bind it (a caller with advice of its own passes False)."""
    context = _replica.current()
    if context is None or axis_name is None or context.axis_name != axis_name:
        if context is None and torch._C._current_graph_task_id() != -1:
            # Outside any replica, but in a backward pass: the mapped function has returned and
            # its replicas are gone, yet its code runs again. Saying that collectives work
            # inside a mapped function would send the user looking for a missing axis_name.
            hint = (
                "called during a backward pass, after the mapped function returned, where no "
                "replica runs and there is no one to meet: most likely torch.utils.checkpoint "
                "inside the mapped function, recomputing a region that holds this collective. "
                "Checkpoint only regions between collectives, or checkpoint around the whole "
                "pmapped call"
            )
        elif context is None:
            hint = "collectives work inside a function mapped with fdp.pmap(..., axis_name=...)"
        elif context.axis_name is None:
            hint = "the function being mapped was given no axis_name"
            if advise:
                hint += f": map it with fdp.pmap(..., axis_name={axis_name!r})"
        else:
            hint = f"the function being mapped has axis_name={context.axis_name!r}"
            if isinstance(axis_name, tuple) and context.axis_name in axis_name:
                # JAX's collectives take a tuple of the axes of nested pmaps; fdp maps one.
                hint += (
                    ": collectives take one axis name, not a tuple of them (fdp.pmap maps one "
                    f"axis): pass {context.axis_name!r}"
                )
        raise NameError(f"unbound axis name: {axis_name} ({caller}: {hint})")
    return context


@eager_under_compile
def axis_index(axis_name: Hashable) -> int:
    """This replica's index along the mapped axis: ``0 <= axis_index < axis_size``.

    Across processes (:mod:`fdp.distributed`), the index counts the replicas of every process
    in rank order.

    Args:
        axis_name: the ``axis_name`` given to :func:`fdp.pmap`.

    Raises:
        NameError: outside a function mapped with this ``axis_name``.

    Examples:
        >>> import torch, fdp
        >>> f = fdp.pmap(lambda x: x * 0 + fdp.axis_index("i"), axis_name="i", devices=["cpu"] * 3)
        >>> f(torch.zeros(6)).tolist()
        [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    """
    context = _bound(axis_name, "fdp.axis_index")
    return context.global_index


@eager_under_compile
def axis_size(axis_name: Hashable) -> int:
    """The number of replicas that run along the mapped axis (not the number of devices).

    With ``split="chunk"``, a batch of 10 on 8 devices runs 5 replicas, and ``axis_size`` is 5.

    Args:
        axis_name: the ``axis_name`` given to :func:`fdp.pmap`.

    Raises:
        NameError: outside a function mapped with this ``axis_name``.

    Examples:
        >>> import torch, fdp
        >>> f = fdp.pmap(lambda x: torch.tensor(fdp.axis_size("i")), axis_name="i", devices=["cpu"] * 8)
        >>> f(torch.zeros(10)).tolist()
        [5, 5, 5, 5, 5]
    """
    return _bound(axis_name, "fdp.axis_size").group.global_size


# --- packing a tree into flat buffers ----------------------------------------------------------

# torch's own packing for coalesced collectives (DDP's and apex's buckets): a cat of flat views,
# and views of a flat buffer shaped like given tensors, each in one call.
_flatten_dense = torch._C._nn.flatten_dense_tensors
_unflatten_dense = torch._C._nn.unflatten_dense_tensors


class _Packed:
    """A tree's tensor leaves as one flat buffer per (device, dtype).

    Numbers become 0-dim tensors on ``device``. ``numbers`` says how the reduction takes them
    (one pass over the leaves does it, rather than a tree map before packing): ``"as_is"``;
    ``"count"`` (``psum``: booleans count, as int64, as in ``torch.sum``; ``jax.lax.psum``
    counts in int32); ``"float"`` (``pmean``: Python's and NumPy's ints and bools average as
    floats of the default dtype, and a tensor that is not floating-point or complex is an
    error); ``"ordered"`` (``pmax``/``pmin``:
    a complex tensor is an error, named here rather than by torch's kernel, which cannot order
    complex numbers and names neither the collective nor the leaf).

    With ``rows`` (``psum_scatter``, ``all_to_all``: every leaf's first dim has that size, one
    row per replica), each buffer is a matrix of ``rows`` rows, the leaves side by side: row
    ``j`` holds what goes to replica ``j``, so that the op hands out rows of one tensor. Slots
    then count columns.

    With ``donated`` (a lone replica's value that its caller gave up: see :func:`_run`), the
    leaves are checked as always but packed only where they are not what packing would hand
    back (see :func:`_kept_as_they_are`); ``self.donated`` says whether they are the result.
    """

    __slots__ = (
        "tree",
        "treespec",
        "leaves",
        "given",
        "slots",
        "members",
        "buffers",
        "aliased",
        "whole",
        "quantization",
        "grad_free",
        "detached",
        "donated",
    )

    def __init__(
        self,
        tree: Any,
        caller: str,
        device: torch.device,
        numbers: str = "as_is",
        *,
        rows: int | None = None,
        given: Sequence[Any] | None = None,
        donated: bool = False,
    ) -> None:
        leaves, treespec = _tree.flatten_for(tree, caller, "x")
        untransformed = torch._C._functorch.peek_interpreter_stack() is None
        self.tree = tree
        self.treespec = treespec
        self.leaves = list(leaves)
        # The leaves as the caller passed them, for messages (psum_scatter and all_to_all pack
        # them reshaped).
        self.given = self.leaves if given is None else given
        # (device, dtype): leaf numbers. Tensors that need nothing done are grouped by calls in
        # C, not a loop in Python (~10 µs less for 50 gradients, warm); any other tree is
        # looked at leaf by leaf, which names the first bad one.
        groups = _plain_tensor_groups(self.leaves, numbers)
        if groups is None:
            groups = self._grouped(caller, device, numbers)
        quantized = not _QUANTIZED.isdisjoint([dtype for _, dtype in groups])  # (rare: tested once)
        if numbers != "as_is" and quantized:
            # Checked once per dtype, not per leaf. A sum or extreme of quantized values has no
            # one scale to hold it: torch's kernels refuse them ("Could not run 'aten::add.out'
            # with arguments from the 'QuantizedCPU' backend"), on several replicas only, and
            # after the exchange.
            k = next(k for (_, dtype), members in groups.items() if dtype in _QUANTIZED for k in members)
            raise TypeError(
                f"{caller} reduces dense numbers, but {self._path(k)} is a quantized tensor "
                f"({_tree.describe(self.leaves[k])}): dequantize it first (.dequantize())"
            )
        if numbers != "as_is":
            for (device, dtype), members in groups.items():
                if dtype not in _QUANTIZED and not _combinable(device, dtype, numbers):
                    # Refused on one replica too, where the value is kept as it is: a program
                    # that runs on one device must run on several.
                    how = "maximum or minimum" if numbers == "ordered" else "sum"
                    cast = "float()" if dtype.is_floating_point else "to(torch.int64)"
                    raise TypeError(
                        f"{caller} reduces {self._path(members[0])}, of type "
                        f"{_tree.describe(self.leaves[members[0]])}, but torch has no {how} of "
                        f"{dtype} tensors on {device.type}: cast it first (.{cast})"
                    )
        # Quantized leaves: a buffer each, and their scales compared between replicas where the
        # op joins their values (see _check_same_layout). Joined (torch.cat, torch.stack),
        # quantized tensors all take the first one's scale and zero point: a leaf of scale 10
        # packed behind one of scale 0.1 came back clipped (200 as 25.5), silently. (Checked
        # once per dtype, not per leaf.)
        self.quantization: tuple[tuple[int, float, int], ...] = ()
        if quantized:
            groups, self.quantization = self._quantized_apart(groups, caller)
        # slots[k] = (buffer number, offset, numel) for tensor leaf k
        self.slots: dict[int, tuple[int, int, int]] = {}
        self.buffers: list[torch.Tensor] = []
        self.aliased: list[bool] = []  # buffer b may share memory with the leaf it holds
        # Whether buffer b holds no empty leaf: unflatten_dense_tensors gives an empty leaf a
        # new tensor, not a view of the buffer, which would cut it from autograd.
        self.whole: list[bool] = []
        self.detached: frozenset[int] = frozenset()
        self.grad_free: tuple[int, ...] = ()
        self.donated = donated and _kept_as_they_are(self.leaves)
        if self.donated:  # nothing to pack: the leaves are the result
            self.members: list[list[int]] = []
            return
        self.members = list(groups.values())  # the leaves of buffer b, in order
        try:
            for b, members in enumerate(self.members):
                offset = 0
                whole = True
                for k in members:
                    numel = self.leaves[k].numel() if rows is None else self.leaves[k].numel() // rows
                    self.slots[k] = (b, offset, numel)
                    offset += numel
                    whole = whole and numel > 0
                self.whole.append(whole)
                if rows is not None:
                    # (An explicit column count: reshape cannot infer it for an empty leaf.)
                    matrices = [self.leaves[k].reshape(rows, self.slots[k][2]) for k in members]
                    self.buffers.append(matrices[0] if len(members) == 1 else torch.cat(matrices, dim=1))
                elif len(members) == 1:
                    self.buffers.append(self.leaves[members[0]].reshape(-1))
                elif untransformed:
                    # One call, one release of the GIL: a reshape and a cat per leaf cost a GIL
                    # hand-over each while another replica runs Python beside this one.
                    self.buffers.append(_flatten_dense([self.leaves[k] for k in members]))
                else:  # torch.func's transforms have no rule for flatten_dense_tensors
                    self.buffers.append(torch.cat([self.leaves[k].reshape(-1) for k in members]))
                self.aliased.append(len(members) == 1)
        except (RuntimeError, NotImplementedError) as err:
            self._refuse_non_dense(caller, err)
            raise
        # Leaves that need no gradient packed beside one that does (gradients from
        # torch.autograd.grad beside their loss): every view of the buffer would require grad,
        # hold the loss's graph, and refuse .numpy(). Those that no replica's needs get detached
        # results (see unpack; decided where every replica's leaves are seen, in _exchange).
        if untransformed:
            self.grad_free = tuple(
                k
                for members, buffer in zip(self.members, self.buffers)
                if len(members) > 1 and buffer.requires_grad
                for k in members
                if not self.leaves[k].requires_grad
            )

    def _refuse_non_dense(self, caller: str, err: BaseException) -> None:
        """Raises a TypeError naming the first sparse or nested leaf, if any, after packing
        failed with ``err``: torch's error ("reshape is not implemented for sparse tensors",
        "unsupported memory format option Contiguous", "For now nested reshape cannot change
        or infer the implicit batch dimension") names neither the collective nor the leaf.
        (Looked for only on failure: no such leaf packs.)"""
        for k, leaf in enumerate(self.leaves):
            if leaf.layout != torch.strided or leaf.is_nested:
                kind = "a nested tensor" if leaf.is_nested else f"a tensor of layout {leaf.layout}"
                fix = (
                    "pass its components as a list of tensors, or a padded tensor (.to_padded_tensor(0.0))"
                    if leaf.is_nested
                    else "convert it with .to_dense()"
                )
                raise TypeError(
                    f"{caller} takes dense tensors, but {self._path(k)} is {kind} (type "
                    f"{_tree.describe(leaf)}), which it cannot pack for the exchange: {fix}"
                ) from err

    def _quantized_apart(
        self, groups: dict[tuple[Any, ...], list[int]], caller: str
    ) -> tuple[dict[tuple[Any, ...], list[int]], tuple[tuple[int, float, int], ...]]:
        """``groups`` with each quantized leaf in a group of its own, and those leaves' numbers,
        scales and zero points."""
        apart: dict[tuple[Any, ...], list[int]] = {}
        scales = []
        for key, members in groups.items():
            if key[1] not in _QUANTIZED:
                apart[key] = members
                continue
            for k in members:
                leaf = self.leaves[k]
                if leaf.qscheme() not in (torch.per_tensor_affine, torch.per_tensor_symmetric):
                    raise TypeError(
                        f"{caller} takes quantized tensors of one scale, but {self._path(k)} "
                        f"({_tree.describe(leaf)}) is quantized {leaf.qscheme()}: dequantize it "
                        "first (.dequantize())"
                    )
                apart[(*key, k)] = [k]
                scales.append((k, leaf.q_scale(), leaf.q_zero_point()))
        return apart, tuple(scales)

    def _path(self, k: int) -> str:
        """Leaf ``k``'s key path, for messages."""
        return _tree.flatten_with_paths(self.tree, "x")[0][k]

    def metadata(self) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
        """Every leaf's dtype and shape (compared between replicas)."""
        return tuple((t.dtype, tuple(t.shape)) for t in self.leaves)

    def across_processes(self) -> _distributed.Layout:
        """This layout as the processes compare it (see :class:`_distributed.Layout`)."""
        layout = _distributed.layout_of(self.tree, self.treespec, self.leaves)
        if self.given is self.leaves:
            return layout
        # Compared as packed (what the processes combine), spelled out as the caller passed the
        # leaves: psum_scatter's float32[4,8] cut into 4 pieces along dim 1 packs as [4,2,4].
        return layout._replace(describe=_distributed.layout_of(self.tree, self.treespec, self.given).describe)

    def _grouped(self, caller: str, device: torch.device, numbers: str) -> dict[tuple[Any, ...], list[int]]:
        """The leaves' numbers by (device, dtype), each leaf looked at (see :func:`_plain_tensor_groups`):
        numbers made tensors, bools counted as ints, a leaf ``numbers`` refuses named."""
        groups: dict[tuple[Any, ...], list[int]] = {}  # (device, dtype): leaf numbers
        for k, leaf in enumerate(self.leaves):
            if isinstance(leaf, torch.Tensor):
                if (
                    numbers == "float"
                    and not (leaf.is_floating_point() or leaf.is_complex())
                    # (refused below with the other reductions': psum, which this one's
                    # message offers, takes no quantized tensor either)
                    and not leaf.is_quantized
                ):
                    raise TypeError(
                        f"{caller} averages floating-point tensors, but {self._path(k)} is "
                        f"{_tree.describe(leaf)}; use fdp.psum for integer counts"
                    )
                if numbers == "ordered" and leaf.is_complex():
                    raise TypeError(
                        f"{caller} takes the elementwise extreme of real values, but {self._path(k)} "
                        f"is {_tree.describe(leaf)}: complex numbers have no order"
                    )
                if numbers == "count" and leaf.dtype == torch.bool:
                    leaf = self.leaves[k] = leaf.to(torch.int64)
            elif _numpy_number(leaf):  # (before Python's numbers: np.float64 is a float too)
                leaf = self.leaves[k] = _numpy_scalar_tensor(leaf, device, numbers)
            elif isinstance(leaf, bool | int | float):
                if numbers == "float":
                    leaf = float(leaf)
                elif numbers == "count" and isinstance(leaf, bool):
                    leaf = int(leaf)
                leaf = self.leaves[k] = torch.as_tensor(leaf, device=device)
            else:
                raise TypeError(
                    f"{caller} takes trees of tensors (and numbers), but {self._path(k)} is a "
                    f"{type(leaf).__name__}: {leaf!r}"
                )
            groups.setdefault((leaf.device, leaf.dtype), []).append(k)
        return groups

    def private_buffers(self) -> list[torch.Tensor]:
        """The buffers, none sharing memory with a leaf: for replicas that read each other's
        buffers after the exchange, when the owner may already be changing its leaves."""
        return [b.clone() if aliased else b for b, aliased in zip(self.buffers, self.aliased)]

    def unpack(self, buffers: Sequence[torch.Tensor], leaf_result: Any = None) -> Any:
        """The tree rebuilt from result buffers laid out like this one's.

        ``leaf_result(leaf, piece)`` turns each leaf's flat piece into its result (default: the
        piece in the leaf's shape). Donated leaves (``self.donated``) are their own results:
        ``buffers`` are then the leaves.
        """
        if self.donated:
            return _tree.unflatten(self.treespec, list(buffers))
        out = list(self.leaves)
        untransformed = torch._C._functorch.peek_interpreter_stack() is None
        for b, members in enumerate(self.members):
            if leaf_result is None and untransformed and self.whole[b]:
                # One call per buffer (see __init__): views of it shaped like its leaves.
                for k, view in zip(members, _unflatten_dense(buffers[b], [self.leaves[k] for k in members])):
                    out[k] = view
                continue
            for k in members:
                _, offset, numel = self.slots[k]
                piece = buffers[b].narrow(-1, offset, numel)
                out[k] = piece.reshape(self.leaves[k].shape) if leaf_result is None else leaf_result(k, piece)
        for k in self.detached:
            out[k] = out[k].detach()
        return _tree.unflatten(self.treespec, out)


@functools.cache
def _combinable(device: torch.device, dtype: torch.dtype, numbers: str) -> bool:
    """Whether torch has the kernel that combines the replicas' ``dtype`` tensors on ``device``
    (a reduction's ``numbers``: see :class:`_Packed`), tried once. (torch 2.13 adds no unsigned
    integers past uint8 and no float8 on the CPU, and orders neither; its error, raised in the
    combine on several replicas only, names neither the collective nor the leaf.)"""
    probe = torch.zeros(2, dtype=dtype, device=device)
    try:
        torch.stack([probe, probe]).amax(0) if numbers == "ordered" else probe.add(probe)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _plain_tensor_groups(leaves: Sequence[Any], numbers: str) -> dict[tuple[Any, ...], list[int]] | None:
    """The leaves' numbers by (device, dtype) where every leaf is a tensor that ``numbers``
    takes as it is (see :class:`_Packed`); else None, for :meth:`_Packed._grouped` to look at
    each leaf. (Quantized tensors are grouped here as there, and refused after, by dtype.)"""
    if not all(map(isinstance, leaves, itertools.repeat(torch.Tensor))):
        return None
    keys = list(zip(map(_DEVICE, leaves), map(_DTYPE, leaves)))
    groups: dict[tuple[Any, ...], list[int]] = {}
    if keys and keys.count(keys[0]) == len(keys):  # one device and dtype: the usual case
        groups[keys[0]] = list(range(len(keys)))
    else:
        for k, key in enumerate(keys):
            groups.setdefault(key, []).append(k)
    for _, dtype in groups:
        if numbers == "float" and not (dtype.is_floating_point or dtype.is_complex):
            return None
        if (numbers == "ordered" and dtype.is_complex) or (numbers == "count" and dtype == torch.bool):
            return None
    return groups


_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")


def _kept_as_they_are(leaves: Sequence[torch.Tensor]) -> bool:
    """Whether a lone replica's donated leaves (all tensors, numbers made tensors) can be its
    result as they are: what packing would hand back, dense and contiguous as on several
    replicas (a sparse or nested leaf is then refused by the packing, naming it, as there), and
    needing no gradient, so that no backward hook lands on a node of the caller's graph (see
    :func:`_run`). A plain loop: it runs right after a step's kernels, where each line is cold."""
    for t in leaves:
        if t.requires_grad or t.is_nested or t.layout != torch.strided or not t.is_contiguous():
            return False
    return True


# The quantized dtypes, which no reduction takes (see _Packed).
_QUANTIZED = _tree.QUANTIZED_DTYPES


def _numpy_number(leaf: Any) -> bool:
    """Whether ``leaf`` is a NumPy bool, integer or floating-point scalar (NumPy is looked up
    only if the program imported it)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(leaf, numpy.generic) and leaf.dtype.kind in "biuf"


def _numpy_scalar_tensor(leaf: Any, device: torch.device, numbers: str) -> torch.Tensor:
    """A NumPy scalar as a 0-dim tensor of its own dtype, as ``torch.as_tensor`` makes it and
    as ``jax.lax``'s collectives keep it (an ``np.float16`` sums as ``float16``). Taken as its
    Python number instead (the default dtypes), they were ``float32`` or ``int64`` whatever
    their dtype, but ``np.float64``, a ``float``, kept ``float64`` in ``psum`` and not in
    ``pmean``. ``numbers`` as for :class:`_Packed`: ``pmean`` averages integers and booleans as
    Python's, in floats of the default dtype; ``psum`` counts booleans as ``int64``."""
    if numbers == "float" and leaf.dtype.kind in "biu":
        return torch.tensor(float(leaf), device=device)
    try:
        tensor = torch.as_tensor(leaf, device=device)
    except TypeError:
        # np.uint64 and np.longdouble, of which torch makes no tensor ("an integer is
        # required", "can't convert np.ndarray of type numpy.longdouble"): as the nearest dtype
        # it has, int64 (as their Python int was taken) and float64.
        if leaf.dtype.kind == "f":
            return torch.tensor(float(leaf), dtype=torch.float64, device=device)
        return torch.as_tensor(int(leaf), device=device)
    if numbers == "count" and tensor.dtype == torch.bool:
        return tensor.to(torch.int64)
    if numbers != "as_is" and not _combinable(tensor.device, tensor.dtype, numbers):
        # np.uint16, np.uint32: torch adds and orders neither on the CPU. As their Python int
        # (int64), rather than refused as a tensor of theirs would be.
        return torch.as_tensor(leaf.item(), device=device)
    return tensor


def _check_same_layout(packs: Sequence[_Packed], caller: str, offset: int = 0, joins: bool = False) -> None:
    """Refuses replicas that passed different trees, shapes or dtypes; with ``joins`` (an op
    that joins the replicas' values into one tensor), quantized tensors of different scales
    too. ``offset`` is this process's first global replica index (fdp.distributed): messages
    name replicas as ``axis_index`` does."""
    first = packs[0]
    for r, packed in enumerate(packs[1:], start=1):
        if not _tree.replicas_agree(packed.treespec, first.treespec):
            raise ValueError(
                f"{caller}: the replicas passed trees of different structure: replica {offset} "
                f"passed {first.treespec} but replica {offset + r} passed {packed.treespec}"
            )
        if joins and packed.quantization != first.quantization:
            for (k, *mine), (_, *theirs) in zip(first.quantization, packed.quantization):
                if mine != theirs:
                    raise ValueError(
                        f"{caller}: the replicas passed quantized tensors of different scales at "
                        f"{first._path(k)}: replica {offset} passed scale {mine[0]}, zero point "
                        f"{mine[1]} but replica {offset + r} passed scale {theirs[0]}, zero point "
                        f"{theirs[1]}; {caller} joins them into one tensor, of one scale. Quantize "
                        "them alike on every replica, or dequantize them first (.dequantize())"
                    )
        if packed.metadata() == first.metadata():
            continue
        paths = _tree.flatten_with_paths(first.tree, "x")[0]
        for k, (a, b) in enumerate(zip(first.given, packed.given)):
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                raise ValueError(
                    f"{caller}: the replicas passed different shapes or dtypes at {paths[k]}: "
                    f"replica {offset} passed {_tree.describe(a)} but replica {offset + r} passed "
                    f"{_tree.describe(b)}. "
                    + (
                        _split.equal_shapes_hint(
                            reduction=caller in ("fdp.psum", "fdp.pmean", "fdp.pmax", "fdp.pmin")
                        )
                        if a.shape != b.shape
                        # Uneven shards change shapes, not dtypes: a branch on the data does.
                        else "Every replica must pass the same dtype there (cast before the call)."
                    )
                )


# --- the operations ----------------------------------------------------------------------------


def _distribute(
    total: torch.Tensor, devices: Sequence[torch.device], inputs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """One tensor per replica with ``total``'s value, none aliasing another or an input.

    Each device's copy feeds every replica on that device: under deterministic algorithms they
    get it through :func:`_transfer.fan_out`, so that its gradient adds theirs in replica order
    (see :func:`_in_replica_order`)."""
    unique = list(dict.fromkeys(devices))
    placed = dict(zip(unique, (row[0] for row in _transfer.broadcast([total], unique))))
    views = None
    if len(unique) < len(devices) and _in_replica_order(total):
        views = {d: iter(_transfer.fan_out(placed[d], devices.count(d))) for d in unique}
    handed: set[int] = {id(t) for t in inputs}
    out = []
    for d in devices:
        copy = placed[d]
        t = copy if views is None else next(views[d])
        if id(copy) in handed:
            t = t.clone()
        handed.add(id(copy))
        out.append(t)
    return out


def _in_replica_order(t: torch.Tensor) -> bool:
    """Whether the gradients that reach ``t`` from several replicas must be added in replica
    order: under ``torch.use_deterministic_algorithms(True)``, for a tensor autograd follows.

    Otherwise the engine adds them in the order it runs the replicas' nodes, which changes from
    call to call (see ``_transfer.share_for_backward``): with three replicas or more, or a
    result used twice, the gradients of a backward through the whole call then differ in the
    last bits between identical calls.
    """
    return t.requires_grad and torch.is_grad_enabled() and torch.are_deterministic_algorithms_enabled()


def _fanned(buffers: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """For each replica, the buffers it combines by itself (``_Op.combine_each``): ``buffers``,
    or under deterministic algorithms aliases of them of its own (see :func:`_in_replica_order`),
    so that each buffer's gradient adds the replicas' in replica order."""
    n = len(buffers)
    if not any(_in_replica_order(b) for b in buffers):
        return [buffers] * n
    views = [_transfer.fan_out(b, n) if b.requires_grad else [b] * n for b in buffers]
    return [[v[r] for v in views] for r in range(n)]


_OpT = TypeVar("_OpT", bound="_Op")


class _Op:
    """A collective over flat buffers: ``combine`` computes every replica's result at once.

    ``combine`` is written with differentiable torch ops (the graph-spanning mode uses it with
    gradients on), and ``transpose`` gives the op whose exchange is this one's backward inside a
    replica (the SPMD mode). ``in_dim``/``out_dim``: where a vmap batch dimension goes.
    """

    name = "collective"
    in_dim = 0
    out_dim = 0
    # Set on a backward's op: the round number of the forward exchange it transposes, so that
    # replicas whose backward passes meet different collectives fail instead of mixing them.
    transposes: int | None = None
    round: int | None = None  # set by the exchange that ran this op
    # Whether the op joins the replicas' values into one tensor (a gather, not a sum or a send).
    joins = False
    # The call's options, as text ("dim=0"), where they decide what each replica sends
    # (psum_scatter's dim, all_to_all's split_dim): replicas or processes that passed different
    # ones exchange buffers of one shape that hold different things (a square leaf's rows on one
    # replica, its columns on another), which no check of the shapes can tell apart.
    options: tuple[str, ...] = ()

    def key(self) -> Hashable:
        return (self.name, *self.options, self.transposes)

    def label(self) -> str:
        """The op as messages name it, with its options (a backward's names the forward
        collective's number). Across processes it is also what the processes compare."""
        return _replica._describe(self.key(), bool(self.options))

    def transposed(self, op: _OpT) -> _OpT:
        """``op`` marked as the backward of this (already run) op."""
        op.transposes = self.round
        return op

    def combine(
        self,
        buffers: list[torch.Tensor],
        extras: list[Any],
        group: _replica.CallGroup,
        layout: _distributed.Layout | None = None,
    ) -> list[torch.Tensor]:
        """Every replica's result from every replica's buffer (``extras``: their extra values;
        ``layout``: across processes, the tree the buffers pack, which the processes compare)."""
        raise NotImplementedError

    def defers(self, group: _replica.CallGroup) -> bool:
        """Whether each replica may compute its own result after the exchange (see
        :meth:`combine_each`); the replicas then exchange private buffers."""
        return False

    def combine_each(
        self, buffers: list[torch.Tensor], extras: list[Any], group: _replica.CallGroup
    ) -> Callable[[int], torch.Tensor] | None:
        """A function giving replica ``r``'s result, which replica ``r`` runs itself once the
        exchange returns, or ``None`` to have :meth:`combine` compute every result at once."""
        return None

    def keeps_lone_value(self, group: _replica.CallGroup, extra: Any) -> bool:
        """Whether the only replica of ``group`` (in this process) gets the value it passed,
        with nothing to exchange: then it gets a private copy of it at once (or the value
        itself, donated)."""
        return False


class _AllReduce(_Op):
    """An elementwise reduction over the replicas, with optional weights.

    ``scaling``: ``"none"``; ``"mean"`` (divide by the replica count); ``"weighted_in"``
    (result = sum_j w_j x_j / sum_j w_j, the weighted mean; ``extras[r]`` is w_r) and its
    transpose ``"weighted_out"`` (result_r = w_r / sum_j w_j * sum_j x_j). Across processes the
    local replicas are combined first, then the processes (``_distributed``).
    """

    in_dim = out_dim = 0
    _TRANSPOSE = {
        "none": "none",
        "mean": "mean",
        "weighted_in": "weighted_out",
        "weighted_out": "weighted_in",
    }

    def __init__(self, reduce: str, scaling: str = "none") -> None:
        self.reduce = reduce
        self.scaling = scaling
        self.name = {
            "sum": "fdp.pmean" if scaling != "none" else "fdp.psum",
            "max": "fdp.pmax",
            "min": "fdp.pmin",
        }[reduce]

    def key(self) -> Hashable:
        # The options as messages show them, when replicas call one collective with different
        # ones (the name and scaling determine the reduction).
        options = {
            "none": "",
            "mean": "weight=None",
            "weighted_in": "weight=a number",
            "weighted_out": "weight=a number, transposed",
        }[self.scaling]
        return (self.name, options, self.transposes)

    def transpose(self) -> _AllReduce:
        return self.transposed(_AllReduce(self.reduce, self._TRANSPOSE[self.scaling]))

    def combine(
        self,
        buffers: list[torch.Tensor],
        extras: list[Any],
        group: _replica.CallGroup,
        layout: _distributed.Layout | None = None,
    ) -> list[torch.Tensor]:
        devices = [b.device for b in buffers]  # each replica's result where its value was
        destination = devices[0]
        if self.reduce != "sum":
            stacked = torch.stack([_transfer.to_device(b, destination) for b in buffers])
            total = stacked.amax(0) if self.reduce == "max" else stacked.amin(0)
            if group.distributed:
                # amax/amin split the gradient among the local replicas that hold the extreme:
                # the processes split it in proportion to how many each has.
                ties = (stacked.detach() == total.detach()).sum(0)
                total = _distributed.all_reduce(total, self.reduce, self.label(), ties, layout)
            # amax/amin keep their output for the backward: handed to a replica, an in-place
            # change of that replica's result would fail the backward through the whole call.
            # Every replica then gets a copy.
            return _distribute(total, devices, [*buffers, total] if total.requires_grad else buffers)
        weight_sum = self._weight_sum(extras, group)
        dtype = buffers[0].dtype
        if self.scaling == "weighted_in":
            total = _summed(buffers, destination, [w / weight_sum for w in extras])
        else:
            total = _summed(buffers, destination)
        # A half-precision total is float32 until the end (see _summed), across processes too:
        # a float16 sum past 65504 that pmean divides back into range must not be inf on the way.
        if group.distributed:
            total = _distributed.all_reduce(total, "sum", self.label(), layout=layout)
        if self.scaling == "mean":
            total = total / group.global_size
        if self.scaling == "weighted_out":
            return [
                (t * (w / weight_sum)).to(dtype) for t, w in zip(_distribute(total, devices, buffers), extras)
            ]
        return _distribute(total.to(dtype), devices, buffers)

    def defers(self, group: _replica.CallGroup) -> bool:
        # Sums of CPU buffers in one process. Computed by the last replica to arrive, a
        # megabyte gradient's sum and its copies for the others keep every replica waiting on
        # one thread; computed by each replica, they run in parallel and need no copies.
        # (A lone replica's sum gets here only with a weight of 0: see
        # keeps_lone_value.)
        return self.reduce == "sum" and not group.distributed and all(d.type == "cpu" for d in group.devices)

    def keeps_lone_value(self, group: _replica.CallGroup, extra: Any) -> bool:
        # The sum, mean, maximum or minimum of one value is that value; so is its weighted
        # mean, w * x / w, for a positive weight (finite: pmean checks; w / w is exactly 1.0).
        # A weight of 0 takes the exchange, which reports it. (Complex values under pmax/pmin
        # are refused when packed, on one replica as on several.)
        if group.distributed:
            return False
        return self.scaling in ("none", "mean") or 0.0 < extra < math.inf

    def combine_each(
        self, buffers: list[torch.Tensor], extras: list[Any], group: _replica.CallGroup
    ) -> Callable[[int], torch.Tensor] | None:
        weight_sum = self._weight_sum(extras, group)  # checked once, in the last replica
        scaling, size = self.scaling, len(buffers)
        if any(b.device.type != "cpu" for b in buffers):
            # CUDA tensors (in CPU replicas): combine, whose streams wait for every replica's.
            return None
        own = _fanned(buffers)
        dtype = buffers[0].dtype

        def result(r: int) -> torch.Tensor:
            # The same operations in the same order on every replica: equal results, bit for
            # bit, and each replica's is a new tensor of its own (several buffers: see
            # _summed). Half-precision buffers are added in float32 and rounded once, at the end.
            buffers = own[r]
            scales = [w / weight_sum for w in extras] if scaling == "weighted_in" else None
            total = _summed(buffers, buffers[0].device, scales)
            if scaling == "mean":
                total = total.div_(size)
            elif scaling == "weighted_out":
                total = total.mul_(extras[r] / weight_sum)
            return total.to(dtype)

        return result

    def _weight_sum(self, extras: list[Any], group: _replica.CallGroup) -> float:
        """The replicas' total weight (1.0 without weights), checked to be positive."""
        if self.scaling not in ("weighted_in", "weighted_out"):
            return 1.0
        weight_sum = float(sum(extras))
        if group.distributed:
            weight_sum = float(
                _distributed.all_reduce(
                    torch.tensor(weight_sum, dtype=torch.float64), "sum", f"{self.label()}'s weights"
                )
            )
        # Finite too: finite weights may sum to inf (1e308 twice), and every w / inf is 0, a
        # silent mean of zeros.
        if not 0 < weight_sum < math.inf:
            raise ValueError(
                f"fdp.pmean: the replicas' weights sum to {weight_sum}; they must sum to more "
                "than 0 and to a finite float"
            )
        return weight_sum


# Half-precision floats are summed in float32 and rounded once, at the end, as torch.sum and
# torch.mean accumulate them on one device. Added in their own dtype, every partial sum rounds
# (an error that grows with the number of replicas), and a float16 sum past 65504 is inf before
# pmean divides it, where the mean itself fits.
_ACCUMULATE_IN = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _summed(
    buffers: list[torch.Tensor], destination: torch.device, scales: list[float] | None = None
) -> torch.Tensor:
    """``sum_r scales[r] * buffers[r]`` (``sum_r buffers[r]`` without ``scales``) on
    ``destination``, accumulated in replica order. Half-precision buffers are accumulated in
    float32, and the total is returned in float32: the caller rounds it once, after its last
    operation on it. Otherwise the total has the buffers' dtype. It is a new tensor, which the
    caller may change in place, but for a single unscaled buffer, returned as it is.

    A buffer scaled by 0 (a replica of weight 0 in a weighted mean) is left out: such a replica
    holds none of the samples that the mean is over, and its value, a mean over none of them
    (a loss over no tokens that count is 0 / 0, NaN), must not make the mean NaN, as 0 * NaN
    would."""
    wide = _ACCUMULATE_IN.get(buffers[0].dtype)
    if scales is not None and 0.0 in scales:
        kept = [r for r, s in enumerate(scales) if s != 0.0]
        if not kept:
            # fdp.distributed: this process's replicas all weigh 0; others do not. Its zeros
            # are still a function of a buffer (masked_fill: the value unread, the gradient
            # 0), as the sum of kept buffers would be: a total made apart from the graph
            # would leave the caller's backward() nothing to differentiate here, and the
            # other processes waiting for this one in the backward's all_reduce.
            first = buffers[0]
            zeros = first.masked_fill(torch.ones((), dtype=torch.bool, device=first.device), 0)
            return _transfer.to_device(zeros if wide is None else zeros.to(wide), destination)
        buffers, scales = [buffers[r] for r in kept], [scales[r] for r in kept]
    if wide is None:
        if scales is None and len(buffers) == 1:
            return buffers[0]
        if any(b.device != destination for b in buffers):
            # Between distinct GPUs, one NCCL-backed reduction (see _transfer.reduce_add).
            return _transfer.reduce_add(
                buffers if scales is None else [b * s for b, s in zip(buffers, scales)], destination
            )
    # One new tensor and one pass per buffer: a gradient buffer is megabytes, and scaling (or
    # widening) each one into a tensor of its own before adding would allocate and write it twice.
    first = _transfer.to_device(buffers[0], destination)
    if scales is not None:
        total, rest = (first if wide is None else first.to(wide)) * scales[0], 1
    elif wide is not None:
        total, rest = first.to(wide), 1  # a new tensor: the buffer is half-precision
    else:  # the sum starts in new memory, not in the first buffer
        total, rest = first + _transfer.to_device(buffers[1], destination), 2
    for r in range(rest, len(buffers)):
        b = _transfer.to_device(buffers[r], destination)
        total = total.add_(b) if scales is None else total.add_(b, alpha=scales[r])
    return total


def _gathered(
    buffers: list[torch.Tensor], group: _replica.CallGroup, caller: str, layout: _distributed.Layout | None
) -> torch.Tensor:
    """Every replica's buffer, stacked in global replica order, on the first one's device."""
    stacked = torch.stack([_transfer.to_device(b, buffers[0].device) for b in buffers])
    if not group.distributed:
        return stacked
    counts = group.counts
    if len(buffers) < max(counts):
        # An all_gather moves parts of one size: a process with fewer replicas than another
        # sends zeros after its rows, which every process drops on arrival (differentiably:
        # this is also psum_scatter's transpose, whose replica counts may differ).
        padding = stacked.new_zeros((max(counts) - len(buffers), *stacked.shape[1:]))
        stacked = torch.cat([stacked, padding])
    gathered = _distributed.all_gather(stacked, caller, layout)
    if len(set(counts)) > 1:
        return torch.cat([rows[:count] for rows, count in zip(gathered.unbind(), counts)])
    # flatten, not reshape(-1, ...): a leaf without elements leaves -1 undetermined.
    return gathered.flatten(0, 1)


class _AllGather(_Op):
    """result_r = stack_j(x_j) along a new leading dim; transpose: psum_scatter."""

    name = "fdp.all_gather"
    in_dim, out_dim = 0, 1
    joins = True

    def combine(
        self,
        buffers: list[torch.Tensor],
        extras: list[Any],
        group: _replica.CallGroup,
        layout: _distributed.Layout | None = None,
    ) -> list[torch.Tensor]:
        return _distribute(_gathered(buffers, group, self.name, layout), [b.device for b in buffers], buffers)


class _ReduceScatter(_Op):
    """result_r = (sum_j x_j)[r] for x_j of shape (n, ...); transpose: all_gather (which
    stacks the replicas' values into the rows of one such tensor)."""

    name = "fdp.psum_scatter"
    in_dim, out_dim = 1, 0

    def __init__(self, *options: str) -> None:
        self.options = options  # none for all_gather's transpose, which its round identifies

    def combine(
        self,
        buffers: list[torch.Tensor],
        extras: list[Any],
        group: _replica.CallGroup,
        layout: _distributed.Layout | None = None,
    ) -> list[torch.Tensor]:
        destination = buffers[0].device
        moved = [_transfer.to_device(b, destination) for b in buffers]
        total = _summed(moved, destination)  # half precision: in float32 (see _summed)
        first = group.offset
        if group.distributed and len(set(group.counts)) == 1:
            # Each process gets the rows of its own replicas, summed over the processes.
            total, first = _distributed.reduce_scatter(total, self.label(), layout), 0
        elif group.distributed:  # (a reduce_scatter cuts equal blocks only)
            total = _distributed.all_reduce(total, "sum", self.label(), layout=layout)
        # Cut by one unbind, whose backward stacks the replicas' cotangents into one tensor: an
        # index per replica has a backward each, every one a zero-filled tensor of the whole sum's
        # size, added up (n times the memory, in every backward through the call).
        pieces = total.to(buffers[0].dtype).unbind()
        return [_transfer.to_device(pieces[first + r], b.device).clone() for r, b in enumerate(buffers)]


class _AllToAll(_Op):
    """result_r[i] = x_i[r] for x_i of shape (n, ...): replica i's row r goes to replica r, as
    its row i; its own transpose."""

    name = "fdp.all_to_all"
    in_dim = out_dim = 1
    joins = True

    def __init__(self, *options: str) -> None:
        self.options = options  # none for its own transpose, which its round identifies

    def combine(
        self,
        buffers: list[torch.Tensor],
        extras: list[Any],
        group: _replica.CallGroup,
        layout: _distributed.Layout | None = None,
    ) -> list[torch.Tensor]:
        if group.distributed:
            return self._across_processes(buffers, group, layout)
        # Each row goes straight to the device of the replica that gets it; stack copies them
        # into a tensor of that replica's own. The rows come from one unbind per buffer (see
        # _ReduceScatter), not from an index per replica.
        rows = [x.unbind() for x in buffers]
        return [
            torch.stack([_transfer.to_device(x[r], b.device) for x in rows]) for r, b in enumerate(buffers)
        ]

    def _across_processes(
        self, buffers: list[torch.Tensor], group: _replica.CallGroup, layout: _distributed.Layout | None
    ) -> list[torch.Tensor]:
        """One all_to_all between the processes: each sends every other only the rows for its
        replicas (any replica counts), rather than gathering every buffer everywhere."""
        n, counts = len(buffers), group.counts
        starts = list(itertools.accumulate(counts, initial=0))
        # [source replica i, destination replica j]: for each process q, the rows of its j's.
        stacked = torch.stack([_transfer.to_device(b, buffers[0].device) for b in buffers])
        rows = torch.cat([stacked[:, starts[q] : starts[q + 1]].flatten(0, 1) for q in range(len(counts))])
        sizes = [n * c for c in counts]  # sent to q: n x counts[q]; received from p: counts[p] x n
        received = _distributed.send_rows(rows, sizes, sizes, self.label(), layout)
        # [global source replica i, destination replica j here]: j's rows, in global order of i.
        # One unbind (see _ReduceScatter), then each replica's rows in memory of its own.
        by_source = torch.cat([part.unflatten(0, (c, n)) for part, c in zip(received.split(sizes), counts)])
        return [
            _transfer.to_device(mine, b.device).clone(memory_format=torch.contiguous_format)
            for mine, b in zip(by_source.unbind(1), buffers)
        ]


class _Permute(_Op):
    """result_dst = x_src for every (src, dst) pair of global indices; zeros where nothing arrives."""

    name = "fdp.ppermute"
    in_dim = out_dim = 0

    def __init__(self, perm: tuple[tuple[int, int], ...]) -> None:
        self.perm = perm
        self.source_of = {dst: src for src, dst in perm}

    def key(self) -> Hashable:
        return (self.name, f"perm={list(self.perm)}", self.transposes)

    def label(self) -> str:
        # With the perm: processes that passed different ones would each send rows that no
        # receiver expects (gloo aborts the process on a size it did not expect).
        return _replica._describe(self.key(), True)

    def inverse(self) -> _Permute:
        return self.transposed(_Permute(tuple((dst, src) for src, dst in self.perm)))

    def combine(
        self,
        buffers: list[torch.Tensor],
        extras: list[Any],
        group: _replica.CallGroup,
        layout: _distributed.Layout | None = None,
    ) -> list[torch.Tensor]:
        arrived, received = (
            self._across_processes(buffers, group, layout) if group.distributed else ({}, None)
        )
        out = []
        for r, device in enumerate(b.device for b in buffers):
            src = self.source_of.get(group.offset + r)
            if src is None:
                # Still a function of the replica's value, as JAX's zeros are: a backward through
                # a call whose only result is these zeros gives zero gradients, not torch's "does
                # not require grad".
                zeros = torch.zeros_like(buffers[r])
                out.append(_ZerosOf.apply(zeros, buffers[r]) if buffers[r].requires_grad else zeros)
            elif r in arrived:
                out.append(_transfer.to_device(arrived[r], device).clone())
            else:  # from a replica of this process
                local = buffers[src - group.offset]
                moved = _transfer.to_device(local, device)
                out.append(moved.clone() if moved is local else moved)
        if received is not None and received.requires_grad:
            # Differentiated through the whole call, every process's backward must reach the
            # exchange's, which sends the cotangents back: also a process that received nothing
            # (its replicas' zeros, or values from its own replicas, depend on no exchange).
            out = [_Tied.apply(o, received) for o in out]
        return out

    def _across_processes(
        self, buffers: list[torch.Tensor], group: _replica.CallGroup, layout: _distributed.Layout | None
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """What the other processes' replicas send this one's, by local replica, and the tensor of
        all of it: one all_to_all in which each process sends only the buffers that another
        one's replicas receive. (Every process works out every pair from the same ``perm`` and
        counts.)"""
        starts = list(itertools.accumulate(group.counts, initial=0))
        owner = lambda j: bisect.bisect_right(starts, j) - 1  # noqa: E731 - the process of replica j
        me, processes = _distributed.rank(), len(group.counts)
        outgoing: list[list[int]] = [[] for _ in range(processes)]  # local sources, by process
        incoming: list[list[int]] = [[] for _ in range(processes)]  # local destinations, by process
        anywhere = False  # whether any pair crosses between processes (the same in every one)
        for src, dst in self.perm:
            sender, receiver = owner(src), owner(dst)
            anywhere = anywhere or sender != receiver
            if sender == me and receiver != me:
                outgoing[receiver].append(src - group.offset)
            elif receiver == me and sender != me:
                incoming[sender].append(dst - group.offset)
        sent = [buffers[i] for part in outgoing for i in part]
        device = buffers[0].device
        # None to send: still a function of a buffer, whose backward receives the cotangents.
        rows = (
            torch.stack([_transfer.to_device(b, device) for b in sent]) if sent else buffers[0][None, ...][:0]
        )
        # Where no pair crosses between processes, no process makes the (empty) all_to_all:
        # they only check that they are all at this ppermute.
        received = _distributed.send_rows(
            rows,
            [len(p) for p in outgoing],
            [len(p) for p in incoming],
            self.label(),
            layout,
            anywhere=anywhere,
        )
        # One unbind, not an index per row (see _ReduceScatter).
        return dict(zip((r for part in incoming for r in part), received.unbind())), received


class _Tied(torch.autograd.Function):
    """``value`` (a tensor of its own) as it is, with ``other`` among its inputs, for the
    backward to reach (its gradient: none)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, other: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # Marked as changed in place, not returned as a view: the caller may change it in place.
        ctx.mark_dirty(value)
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class _ZerosOf(torch.autograd.Function):
    """``zeros`` (of ``value``'s shape and dtype), as a function of ``value`` whose gradient is zero."""

    @staticmethod
    def forward(ctx: Any, zeros: torch.Tensor, value: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.mark_dirty(zeros)  # as in _Tied: returned as it is, and the caller may change it in place
        return zeros

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        # Zeros, not None: None would leave a leaf's .grad None where JAX (and x * 0) give zeros.
        return None, torch.zeros_like(grad)


# --- running an op: the two differentiation modes ----------------------------------------------


# Packing, stacking and combining keep every leaf's dtype under any autocast (see
# _thread_state.without_autocast): _run for the packing, _exchange for the combine, which a
# transposed collective's backward reaches without _run.
@_thread_state.without_autocast
def _exchange(
    op: _Op,
    context: _replica.ReplicaContext,
    buffers: Sequence[torch.Tensor],
    extra: Any,
    layout: _Packed | None,
    *,
    defer: bool = False,
) -> list[torch.Tensor]:
    """Every replica's buffers in, this replica's result buffers out.

    ``layout`` (the packed tree, or None for a backward's cotangents, whose layout is the
    forward's) lets the last replica name the leaf when the replicas' shapes differ. With
    ``defer`` (the buffers are private: no one changes them while others read them), an op may
    leave each replica to compute its own result after the exchange (``_Op.combine_each``).
    """

    def combine(
        payloads: list[tuple[Any, Sequence[torch.Tensor], Any, _streams.Marks | None]],
    ) -> list[tuple[list[Any], _streams.Marks | None]]:
        layout = payloads[0][0]
        if layout is not None:
            _check_same_layout([p[0] for p in payloads], op.name, context.group.offset, op.joins)
            if layout.grad_free and not context.group.distributed:
                # A result needs a gradient where any replica's leaf does. (Across processes the
                # others' leaves are not seen here: their results keep the buffer's.)
                common = frozenset(layout.grad_free).intersection(*(p[0].grad_free for p in payloads[1:]))
                for p in payloads:
                    p[0].detached = common
        if layout is not None and layout.quantization and context.group.distributed:
            # torch.distributed sends no quantized tensors: gloo's copy failed with "Copying from
            # quantized Tensor to non-quantized Tensor is not allowed", naming no leaf.
            raise TypeError(
                f"{op.name} across processes takes no quantized tensors, but "
                f"{layout._path(layout.quantization[0][0])} is "
                f"{_tree.describe(layout.leaves[layout.quantization[0][0]])}: dequantize it first "
                "(.dequantize()), or send its integers (.int_repr()) and its scale"
            )
        # Across processes the packed buffers alone may agree in size where the trees do not.
        checked = layout.across_processes() if layout is not None and context.group.distributed else None
        shapes = [tuple(tuple(b.shape) for b in p[1]) for p in payloads]
        if any(s != shapes[0] for s in shapes):
            # Under torch.func.vmap the buffers carry the vmapped rows: uneven shards show here.
            other = next(r for r, s in enumerate(shapes) if s != shapes[0])
            raise ValueError(
                f"{op.name}: the replicas' values have different shapes ({shapes[0]} on replica "
                f"{context.group.offset}, {shapes[other]} on replica {context.group.offset + other}); "
                "under torch.func.vmap every replica must map over the same number of rows"
            )
        marks = [p[3] for p in payloads]
        for p in payloads:  # on CUDA: combine once every replica's buffers are written
            _streams.wait(p[3], p[1])
        per_buffer: list[list[Any]] = []
        for b in range(len(buffers)):
            inputs, extras = [p[1][b] for p in payloads], [p[2] for p in payloads]
            each = op.combine_each(inputs, extras, context.group) if defer else None
            if each is None:
                per_buffer.append(op.combine(inputs, extras, context.group, checked))
            else:
                per_buffer.append([_Deferred(each, r) for r in range(len(payloads))])
        rows = [[results[r] for results in per_buffer] for r in range(len(payloads))]
        done = None
        if any(m is not None for m in marks):  # CUDA buffers of several replicas
            done = _streams.hand_over([[t for t in row if type(t) is not _Deferred] for row in rows], marks)
        return [(row, done) for row in rows]

    # A lone replica's results are made on its own stream: nothing to order.
    marks = _streams.mark(buffers) if context.group.size > 1 else None
    (results, done), op.round = context.group.exchange(
        context.index, op.key(), (layout, tuple(buffers), extra, marks), combine
    )
    _streams.wait(done)  # on CUDA: use the results once the combine has written them
    return [r() if type(r) is _Deferred else r for r in results]


class _Deferred:
    """Replica ``index``'s result, to be computed by that replica (``_Op.combine_each``)."""

    __slots__ = ("compute", "index")

    def __init__(self, compute: Callable[[int], torch.Tensor], index: int) -> None:
        self.compute, self.index = compute, index

    def __call__(self) -> torch.Tensor:
        return self.compute(self.index)


class _Spmd(torch.autograd.Function):
    """A collective inside a torch.func transform: backward is the transposed collective."""

    @staticmethod
    def forward(
        op: _Op, context: Any, extra: Any, layout: Any, *buffers: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(_exchange(op, context, buffers, extra, layout))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        op, context, extra, _, *buffers = inputs
        ctx.op, ctx.context, ctx.extra = op, context, extra
        if isinstance(op, _AllReduce) and op.reduce != "sum":
            # Where each replica held the extreme value, decided now: later in-place changes to
            # the result must not move the gradient.
            ctx.save_for_backward(*[(x == y).to(x.dtype) for x, y in zip(buffers, output)])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        op, context = ctx.op, ctx.context
        if context.group.done:
            raise RuntimeError(
                f"{op.name}'s backward inside a torch.func transform ran after the pmapped call "
                "returned; every replica must run it together, inside the mapped function"
            )
        device = _backward_device(grads, context.device)
        if _shares_backward_thread(context, device):
            raise RuntimeError(
                f"{op.name}'s backward inside fdp.grad or a torch.func transform cannot run on replicas "
                f"that share {device} (the call's devices: "
                f"{', '.join(str(d) for d in context.group.devices)}): torch's autograd engine "
                f"runs the backward of each {device.type} device on one thread of its own, where "
                f"replica {context.index}'s {op.name} would wait forever for the others' backward "
                "queued behind it. Give each replica a device of its own, differentiate through "
                "the whole pmapped call (backward() on its output), or keep the collective out of "
                f"the differentiated function (take the local gradients, then {op.name} them)."
            )
        if isinstance(op, _AllReduce) and op.reduce == "sum":
            result = _Spmd.apply(op.transpose(), context, ctx.extra, None, *grads)
        elif isinstance(op, _AllReduce):  # max/min: the cotangent goes where the extreme was
            n = len(grads)
            masks = [m.to(g.dtype) for m, g in zip(ctx.saved_tensors, grads)]
            sums = _Spmd.apply(op.transposed(_AllReduce("sum")), context, None, None, *grads, *masks)
            result = tuple(s * m / t for s, t, m in zip(sums[:n], sums[n:], masks))
        elif isinstance(op, _AllGather):
            result = _Spmd.apply(op.transposed(_ReduceScatter()), context, None, None, *grads)
        elif isinstance(op, _ReduceScatter):
            result = _Spmd.apply(op.transposed(_AllGather()), context, None, None, *grads)
        elif isinstance(op, _AllToAll):
            result = _Spmd.apply(op.transposed(_AllToAll()), context, None, None, *grads)
        else:
            assert isinstance(op, _Permute)
            result = _Spmd.apply(op.inverse(), context, None, None, *grads)
        return (None, None, None, None, *result)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        # Without it torch raises NotImplementedError naming no collective. A rule would not
        # help: forward-mode AD inside replicas that run at once is unsafe in torch itself.
        raise RuntimeError(
            f"{ctx.op.name} was differentiated in forward mode (torch.func.jvp, jacfwd, hessian) "
            "inside the mapped function: collectives have no forward-mode rule, and torch keeps "
            "forward-mode AD levels per process, not per thread, so replicas that run it at once "
            "corrupt each other's. Use reverse mode inside the mapped function (vjp, jacrev; "
            "jacrev(jacrev(f)) for a Hessian), or torch.autograd.forward_ad around the whole "
            "pmapped call."
        )

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[Any, ...],
        op: _Op,
        context: Any,
        extra: Any,
        layout: Any,
        *buffers: torch.Tensor,
    ) -> Any:
        moved = [
            b.unsqueeze(op.in_dim).expand(*b.shape[: op.in_dim], info.batch_size, *b.shape[op.in_dim :])
            if d is None
            else b.movedim(d, op.in_dim)
            for b, d in zip(buffers, in_dims[4:])
        ]
        return _Spmd.apply(op, context, extra, layout, *moved), (op.out_dim,) * len(buffers)


for _method in (_Spmd.forward, _Spmd.setup_context, _Spmd.backward, _Spmd.jvp, _Spmd.vmap):
    never_compiled(_method)


def _backward_device(grads: Sequence[torch.Tensor], default: torch.device) -> torch.device:
    """The device whose autograd thread runs a backward given ``grads``: as torch's engine
    picks it (``InputBuffer::device``), the first gradient's device that is not the CPU."""
    return next((g.device for g in grads if g.device.type != "cpu"), grads[0].device if grads else default)


def _shares_backward_thread(context: _replica.ReplicaContext, device: torch.device) -> bool:
    """Whether a backward collective of replica ``context`` on ``device`` would wait on a
    thread that other replicas' backward passes need too.

    torch's autograd engine runs the backward of a CUDA (or other accelerator) device's tensors
    on one thread per device, not in the thread that asked for it; CPU backward runs in the
    asking thread. Replicas that share an accelerator therefore run their backward passes one
    after the other on one thread, and a backward collective, which waits for the others, would
    wait forever there. (When this runs in the replica's own thread, it is not the engine's.)
    A tensor on a device other than its replica's may share it with the other replicas'
    tensors (say CUDA tensors on CPU replicas), which this replica cannot see: refused too.
    """
    if _replica.current() is context or device.type == "cpu":
        return False
    devices = context.group.devices
    return devices.count(device) > 1 or (device != context.device and len(devices) > 1)


def _refuse_inner_backward(group: _replica.CallGroup, name: str) -> Any:
    def hook(grad_outputs: Any) -> None:
        if not group.done:
            raise RuntimeError(
                f"torch.autograd was asked to differentiate through {name} inside the mapped "
                "function, while the other replicas' parts of the graph are still being built. "
                "Differentiate inside the mapped function with fdp.grad or torch.func (grad, "
                "vjp, grad_and_value), where collectives have JAX's transposes, or call "
                "backward() on the pmapped function's output."
            )
        return None

    return hook


class _Join(torch.autograd.Function):
    """Aliases of one replica's buffers whose gradients reach the buffers in one node, so in
    one fixed order (see :func:`_joined`)."""

    @staticmethod
    def forward(*buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(b.view_as(b) for b in buffers)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return grads


def _joined(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """A replica's buffers (several: leaves of several dtypes or devices) as it hands them to
    the exchange: under deterministic algorithms, through :class:`_Join`.

    Each buffer's gradient is complete once every replica's result has its own (the chain of
    :func:`_transfer.fan_out`), and which buffer's completes first depends on the engine's
    order across the replicas' threads, which changes from call to call. A tensor that feeds
    two buffers (``{"a": h, "b": h.float()}``) and is used once more then added the three parts
    of its gradient in a changing order: different gradients, in the last bits, on identical
    calls. Joined, the buffers' gradients leave together, in buffer order.
    """
    if len(buffers) < 2 or not torch.are_deterministic_algorithms_enabled():  # the usual case
        return buffers
    # Only the buffers autograd follows: a joined one would require grad, and so would its
    # results, where the collective's results otherwise keep their leaves' requires_grad.
    followed = [k for k, b in enumerate(buffers) if _in_replica_order(b)]
    if len(followed) < 2:
        return buffers
    joined = list(buffers)
    for k, b in zip(followed, _Join.apply(*(buffers[k] for k in followed))):
        joined[k] = b
    return joined


@_thread_state.without_autocast
def _run(
    op: _Op,
    tree: Any,
    axis_name: Hashable,
    extra: Any = None,
    *,
    numbers: str = "as_is",
    rows: int | None = None,
    given: Sequence[Any] | None = None,
    donate: bool = False,
) -> tuple[_Packed, list[torch.Tensor]]:
    """Packs ``tree`` (``numbers``, ``rows``, ``given``: see :class:`_Packed`) and runs ``op``
    in the mode that fits how the replica differentiates. ``donate``: the caller gives the
    value up (see :func:`psum`); only a lone replica makes use of it."""
    if donate is not False and donate is not True:
        donate = _tree.check_flag(donate, f"{op.name}: donate")  # a NumPy bool, or raises naming the call
    context = _bound(axis_name, op.name)
    # Differentiated inside the replica (torch.func.grad, or fdp.grad by autograd): the form
    # whose backward is the transposed collective, which every replica runs in its own backward.
    transformed = torch._C._functorch.peek_interpreter_stack() is not None or _grad.differentiating()
    lone = not transformed and context.group.size == 1 and op.keeps_lone_value(context.group, extra)
    packed = _Packed(tree, op.name, context.device, numbers, rows=rows, given=given, donated=lone and donate)
    if transformed:
        return packed, list(_Spmd.apply(op, context, extra, packed, *packed.buffers))
    if packed.donated:
        # The only replica, whose caller gave the value up: the value is the result, with no
        # copy (which for a step's gradients is a pass over all of them), and needs no gradient
        # (so no hook, below).
        return packed, packed.leaves
    if lone:
        # The only replica: its result is its own value, in memory of its own; no exchange.
        results = packed.private_buffers()
        packed.detached = frozenset(packed.grad_free)
    elif op.defers(context.group):
        results = _exchange(op, context, _joined(packed.private_buffers()), extra, packed, defer=True)
    else:
        results = _exchange(op, context, _joined(packed.buffers), extra, packed)
    # The results' graph spans every replica and is complete only when the call returns: a
    # backward through them from inside the replica must not start early. The hook sits on the
    # results' own nodes, which in-place ops on the results leave in place upstream; on a view's
    # base's node for a result that is a view (an alias from _transfer.fan_out, under
    # deterministic algorithms): an in-place op on it rebases the base, and the backward then
    # bypasses the view's own node.
    hook = None
    for r in results:
        base = r._base
        node = (r if base is None else base).grad_fn
        if node is not None:
            hook = hook or _refuse_inner_backward(context.group, op.name)
            node.register_prehook(hook)
    return packed, results


# --- the public collectives --------------------------------------------------------------------


# Typed for the usual calls: a tensor gives a tensor, and so does a Python number (the
# reduction is a 0-dim tensor); any other tree gives a tree of that structure, whose numbers
# become tensors (so not of the same type): Any.
@overload
def psum(x: torch.Tensor, axis_name: Hashable, *, donate: bool = False) -> torch.Tensor: ...
@overload
def psum(x: bool | int | float, axis_name: Hashable, *, donate: bool = False) -> torch.Tensor: ...
@overload
def psum(x: Any, axis_name: Hashable, *, donate: bool = False) -> Any: ...


@eager_under_compile
@_refusing_jax_options()
def psum(x: Any, axis_name: Hashable, *, donate: bool = False) -> Any:
    """Sums ``x`` over the replicas of ``axis_name``: every replica gets the total.

    ``x`` is a pytree of tensors (numbers are taken as 0-dim tensors); every replica must pass
    the same structure, shapes and dtypes. All leaves travel in one exchange, coalesced into one
    flat buffer per device and dtype. Differentiable: see ``docs/collectives.md``.

    Args:
        x: a pytree of tensors.
        axis_name: the ``axis_name`` given to :func:`fdp.pmap`.
        donate: whether the caller gives ``x`` up, as ``jax.jit``'s ``donate_argnums`` gives up
            a buffer: it will not use ``x``'s tensors again, so the result may share their memory.
            On a lone replica (one device, outside :mod:`fdp.distributed`) the result then holds
            those tensors themselves rather than a copy of them, which for a step's gradients
            saves a pass over all of them (tensors that require grad, or are not contiguous, are
            still copied). Elsewhere it changes nothing. Keyword-only. Default: ``False``.

    Returns:
        A tree like ``x`` holding the sums, each leaf on the device of ``x``'s leaf.

    Raises:
        NameError: outside a function mapped with this ``axis_name``.
        ValueError: the replicas passed different structures, shapes or dtypes.

    Examples:
        >>> import torch, fdp
        >>> f = fdp.pmap(lambda x: x - fdp.psum(x.sum(), "i"), axis_name="i", devices=["cpu"] * 2)
        >>> f(torch.arange(4.0))
        tensor([-6., -5., -4., -3.])
    """
    packed, results = _run(_AllReduce("sum"), x, axis_name, numbers="count", donate=donate)
    return packed.unpack(results)


@overload
def pmean(
    x: torch.Tensor,
    axis_name: Hashable,
    *,
    weight: float | torch.Tensor | None = None,
    donate: bool = False,
) -> torch.Tensor: ...
@overload
def pmean(
    x: bool | int | float,
    axis_name: Hashable,
    *,
    weight: float | torch.Tensor | None = None,
    donate: bool = False,
) -> torch.Tensor: ...
@overload
def pmean(
    x: Any, axis_name: Hashable, *, weight: float | torch.Tensor | None = None, donate: bool = False
) -> Any: ...


@eager_under_compile
@_refusing_jax_options()
def pmean(
    x: Any, axis_name: Hashable, *, weight: float | torch.Tensor | None = None, donate: bool = False
) -> Any:
    """Averages ``x`` over the replicas of ``axis_name``, optionally weighted.

    With ``weight`` (a number or 0-dim tensor per replica, e.g. the replica's number of rows),
    the result is ``sum_r weight_r * x_r / sum_r weight_r``. That makes the average of
    per-replica mean losses or gradients exact under uneven shards: with ``split="chunk"``, 30
    rows over 8 replicas are 7 shards of 4 and one of 2, and an unweighted mean would count the
    short shard's rows twice.

    Args:
        x: a pytree of floating-point (or complex) tensors and numbers; Python ints and bools
            average as floats of the default dtype.
        axis_name: the ``axis_name`` given to :func:`fdp.pmap`.
        weight: this replica's weight (finite, non-negative; the replicas' weights must sum to
            more than 0, and to a finite float; a number: not differentiated), or ``None`` for
            equal weights. A replica of weight 0 is left out, its value unread (a mean over no
            tokens, NaN, does not make the result NaN). For a loss averaged over the tokens
            that count (``ignore_index``), their number. Keyword-only. Default: ``None``.
        donate: whether the caller gives ``x`` up, as a training step gives up its gradients
            (``grads = fdp.pmean(grads, "i", donate=True)``; see :func:`fdp.psum`). Keyword-only.
            Default: ``False``.

    Returns:
        A tree like ``x`` holding the means.

    Examples:
        >>> import torch, fdp
        >>> @fdp.pmap(axis_name="i", devices=["cpu"] * 2, out_axes=None)
        ... def mean_of_means(x):
        ...     return fdp.pmean(x.mean(), "i", weight=x.shape[0])
        >>> mean_of_means(torch.tensor([1.0, 2.0, 3.0]))  # shards [1, 2] and [3]
        tensor(2.)
    """
    if weight is None:
        packed, results = _run(_AllReduce("sum", "mean"), x, axis_name, numbers="float", donate=donate)
        return packed.unpack(results)
    # A number, not differentiated (as the row counts it usually is): detached first, so a
    # weight that requires grad does not make torch warn about the conversion.
    try:
        if isinstance(weight, torch.Tensor):
            if weight.numel() != 1 or weight.is_complex():
                raise TypeError
            value = float(weight.detach())
        elif isinstance(weight, str | bytes):  # float() would read "2" as 2.0
            raise TypeError
        else:
            value = float(weight)
    except (TypeError, ValueError):
        raise TypeError(
            "fdp.pmean: weight must be a number (e.g. the replica's row count) or a one-element "
            f"real tensor, got {_tree.describe(weight)}: {_tree.short_repr(weight)}"
        ) from None
    # Finite too: an infinite weight makes every w / sum(w) inf / inf, a silent NaN result.
    if not 0 <= value < math.inf:
        raise ValueError(f"fdp.pmean: weight must be a finite non-negative number, got {weight!r}")
    packed, results = _run(
        _AllReduce("sum", "weighted_in"), x, axis_name, value, numbers="float", donate=donate
    )
    return packed.unpack(results)


@overload
def pmax(x: torch.Tensor, axis_name: Hashable, *, donate: bool = False) -> torch.Tensor: ...
@overload
def pmax(x: bool | int | float, axis_name: Hashable, *, donate: bool = False) -> torch.Tensor: ...
@overload
def pmax(x: Any, axis_name: Hashable, *, donate: bool = False) -> Any: ...


@eager_under_compile
@_refusing_jax_options()
def pmax(x: Any, axis_name: Hashable, *, donate: bool = False) -> Any:
    """The elementwise maximum of ``x`` over the replicas of ``axis_name``.

    A NaN on any replica gives NaN there, as ``torch.maximum`` does. The gradient goes to every
    replica holding the maximum, in equal parts where several do, and is NaN where the maximum
    is, as ``torch.amax``'s (see ``docs/collectives.md``).

    Args:
        x: a pytree of real tensors (numbers are taken as 0-dim tensors).
        axis_name: the ``axis_name`` given to :func:`fdp.pmap`.
        donate: whether the caller gives ``x`` up (see :func:`fdp.psum`). Keyword-only. Default:
            ``False``.

    Returns:
        A tree like ``x`` holding the maximums, each leaf on the device of ``x``'s leaf.

    Raises:
        NameError: outside a function mapped with this ``axis_name``.
        TypeError: a complex leaf (complex numbers have no order).
        ValueError: the replicas passed different structures, shapes or dtypes.

    Examples:
        >>> import torch, fdp
        >>> largest = fdp.pmap(lambda x: fdp.pmax(x, "i"), axis_name="i", devices=["cpu"] * 3)
        >>> largest(torch.tensor([3.0, 1.0, 2.0]))
        tensor([3., 3., 3.])
    """
    packed, results = _run(_AllReduce("max"), x, axis_name, numbers="ordered", donate=donate)
    return packed.unpack(results)


@overload
def pmin(x: torch.Tensor, axis_name: Hashable, *, donate: bool = False) -> torch.Tensor: ...
@overload
def pmin(x: bool | int | float, axis_name: Hashable, *, donate: bool = False) -> torch.Tensor: ...
@overload
def pmin(x: Any, axis_name: Hashable, *, donate: bool = False) -> Any: ...


@eager_under_compile
@_refusing_jax_options()
def pmin(x: Any, axis_name: Hashable, *, donate: bool = False) -> Any:
    """The elementwise minimum of ``x`` over the replicas of ``axis_name``.

    :func:`fdp.pmax` with the minimum: the same arguments, errors, NaN rule (as
    ``torch.minimum``) and gradient rule (to every replica holding the minimum, in equal parts).

    Args:
        x: a pytree of real tensors (numbers are taken as 0-dim tensors).
        axis_name: the ``axis_name`` given to :func:`fdp.pmap`.
        donate: whether the caller gives ``x`` up (see :func:`fdp.psum`). Keyword-only. Default:
            ``False``.

    Examples:
        >>> import torch, fdp
        >>> smallest = fdp.pmap(lambda x: fdp.pmin(x, "i"), axis_name="i", devices=["cpu"] * 3)
        >>> smallest(torch.tensor([3.0, 1.0, 2.0]))
        tensor([1., 1., 1.])
    """
    packed, results = _run(_AllReduce("min"), x, axis_name, numbers="ordered", donate=donate)
    return packed.unpack(results)


@overload
def all_gather(
    x: torch.Tensor, axis_name: Hashable, *, dim: int = 0, tiled: bool = False
) -> torch.Tensor: ...
@overload
def all_gather(x: Any, axis_name: Hashable, *, dim: int = 0, tiled: bool = False) -> Any: ...


@eager_under_compile
@_refusing_jax_options(axis="fdp.all_gather's is dim: fdp.all_gather(x, axis_name, dim={value!r})")
def all_gather(x: Any, axis_name: Hashable, *, dim: int = 0, tiled: bool = False) -> Any:
    """Every replica's ``x``, on every replica.

    Args:
        x: a pytree of tensors, of equal shapes on every replica.
        axis_name: the ``axis_name`` given to :func:`fdp.pmap`.
        dim: where the replicas' values go. Untiled, a new dim of size ``axis_size`` is inserted
            at ``dim`` (of the result's rank; ``-1`` is last); tiled, they are concatenated along
            the existing ``dim``. Keyword-only. Default: ``0``.
        tiled: concatenate instead of stacking. Keyword-only. Default: ``False``.

    Returns:
        A tree like ``x``; each leaf with the replicas' values stacked or concatenated.

    Examples:
        >>> import torch, fdp
        >>> f = fdp.pmap(lambda x: fdp.all_gather(x, "i"), axis_name="i", devices=["cpu"] * 2, out_axes=None)
        >>> f(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        tensor([[[1., 2.]],
        <BLANKLINE>
                [[3., 4.]]])
    """
    caller = "fdp.all_gather"
    dim = _dim_argument(dim, caller, "dim")
    tiled = _tree.check_flag(tiled, f"{caller}: tiled")
    context = _bound(axis_name, caller)
    n = context.group.global_size

    packed, results = _run(_AllGather(), x, axis_name)

    def check_dim(k: int, leaf: torch.Tensor) -> int:
        rank = leaf.dim() if tiled else leaf.dim() + 1
        if not -rank <= dim < rank or (tiled and leaf.dim() == 0):
            # Named by its key path: in a tree, the shape alone may not say which leaf it is.
            raise ValueError(
                f"{caller}: dim={dim} is out of range for a {'tiled' if tiled else 'stacked'} "
                f"gather of {packed._path(k)}, of type {_tree.describe(leaf)} ("
                + (
                    "a tiled gather concatenates tensors of rank 1 or more"
                    if rank == 0
                    else f"a dim in [{-rank}, {rank - 1}] fits"
                )
                + ")"
            )
        return dim % rank

    def leaf_result(k: int, piece: torch.Tensor) -> torch.Tensor:
        leaf = packed.leaves[k]
        d = check_dim(k, leaf)
        stacked = piece.reshape(n, *leaf.shape).movedim(0, d)
        return stacked.flatten(d, d + 1) if tiled else stacked

    return packed.unpack(results, leaf_result)


def _dim_argument(dim: Any, caller: str, name: str) -> int:
    """``dim`` as an int (a Python or NumPy integer), or a TypeError naming the call."""
    try:
        if isinstance(dim, bool):  # (an index to operator.index, but no dim)
            raise TypeError
        return operator.index(dim)
    except TypeError:
        raise TypeError(
            f"{caller}: {name} must be an int, got {type(dim).__name__}: {_tree.short_repr(dim)}"
        ) from None


def _in_rows(
    x: Any,
    caller: str,
    n: int,
    axis_name: Hashable,
    dim: int,
    tiled: bool,
    name: str,
    concat_dim: int | None = None,
) -> tuple[Any, list[Any]]:
    """``x`` with each leaf's dim ``dim`` cut into ``n`` rows, one per replica, for
    :class:`_Packed`'s ``rows``; and ``x``'s leaves. Untiled, that dim must have size ``n``;
    tiled, a multiple of it. ``concat_dim`` (all_to_all's) is checked to be a dim of the result.

    Each leaf becomes a tensor of shape ``(n, *chunk)``, ``chunk`` being the leaf with dim
    ``dim`` moved first and cut into ``n`` (tiled), or removed (untiled).
    """
    leaves, spec = _tree.flatten_for(x, caller, "x")

    def path(k: int) -> str:  # (key paths cost a flatten of their own: only for messages)
        return _tree.flatten_with_paths(x, "x")[0][k]

    rows = []
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            what = (
                _tree.describe(leaf)
                if isinstance(leaf, torch.Tensor)
                else f"{_tree.short_repr(leaf)}, of type {type(leaf).__name__}"
            )
            raise TypeError(
                f"{caller} splits tensors into one piece per replica along {name}={dim}, but "
                f"{path(k)} is {what}, which has no dim to split"
            )
        rank = leaf.dim()  # all_to_all's result's rank too
        for option, value in ((name, dim), ("concat_dim", concat_dim)):
            if value is not None and not -rank <= value < rank:
                raise ValueError(
                    f"{caller}: {option}={value} is out of range for {path(k)}, of type "
                    f"{_tree.describe(leaf)} ("
                    + (f"the result has rank {rank}: " if option == "concat_dim" else "")
                    + f"a dim in [{-rank}, {rank - 1}] fits)"
                )
        size = leaf.shape[dim]
        if size % n if tiled else size != n:
            raise ValueError(
                f"{caller}: {path(k)}, of type {_tree.describe(leaf)}, has size {size} along "
                f"{name}={dim}, but "
                + (
                    f"a tiled {caller} cuts it into {n} equal pieces"
                    if tiled
                    else f"an untiled {caller} needs {n}"
                )
                + f", one {'piece' if tiled else 'row'} per replica of axis {axis_name!r} "
                f"(fdp.axis_size({axis_name!r}) is {n})"
                + ("" if tiled else "; with tiled=True any multiple of it fits")
            )
        moved = leaf.movedim(dim, 0)
        rows.append(moved.unflatten(0, (n, size // n)) if tiled else moved)
    return _tree.unflatten(spec, rows), leaves


@overload
def psum_scatter(
    x: torch.Tensor, axis_name: Hashable, *, dim: int = 0, tiled: bool = False
) -> torch.Tensor: ...
@overload
def psum_scatter(x: Any, axis_name: Hashable, *, dim: int = 0, tiled: bool = False) -> Any: ...


@eager_under_compile
@_refusing_jax_options(
    scatter_dimension="fdp.psum_scatter's is dim: fdp.psum_scatter(x, axis_name, dim={value!r})"
)
def psum_scatter(x: Any, axis_name: Hashable, *, dim: int = 0, tiled: bool = False) -> Any:
    """Sums ``x`` over the replicas of ``axis_name`` and gives each replica its piece of the sum.

    The reduce-scatter of ``jax.lax.psum_scatter``: replica ``r`` gets piece ``r`` of the sum
    along ``dim``, where :func:`fdp.psum` would give every replica the whole sum. Its transpose
    is :func:`fdp.all_gather` (with the same ``dim`` and ``tiled``), and the pair is the
    sharded form of a ``psum``: each replica updates its piece, then gathers the others'.

    Args:
        x: a pytree of tensors, of equal shapes on every replica.
        axis_name: the ``axis_name`` given to :func:`fdp.pmap`.
        dim: the dim cut into pieces. Untiled, its size must be :func:`fdp.axis_size` and it
            is removed (replica ``r`` gets ``sum[r]`` along it); tiled, its size must be a
            multiple of the axis size and replica ``r`` gets the ``r``-th of that many equal
            pieces. Keyword-only. Default: ``0``.
        tiled: cut into pieces instead of rows. Keyword-only. Default: ``False``.

    Returns:
        A tree like ``x``: each leaf this replica's piece of the sum, on the device of the leaf.

    Raises:
        NameError: outside a function mapped with this ``axis_name``.
        TypeError: a leaf is not a tensor of rank 1 or more.
        ValueError: ``dim`` is out of range, or of the wrong size for the axis; the replicas
            passed different structures, shapes or dtypes, or a different ``dim`` or ``tiled``.

    Examples:
        >>> import torch, fdp
        >>> f = fdp.pmap(lambda x: fdp.psum_scatter(x[0], "i"), axis_name="i", devices=["cpu"] * 2)
        >>> f(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # sums [4., 6.], one entry per replica
        tensor([4., 6.])
        >>> g = fdp.pmap(lambda x: fdp.psum_scatter(x, "i", tiled=True), axis_name="i", devices=["cpu"] * 2)
        >>> g(torch.arange(8.0))  # each replica sums [0, 1, 2, 3] and [4, 5, 6, 7], keeps a half
        tensor([ 4.,  6.,  8., 10.])
    """
    caller = "fdp.psum_scatter"
    dim = _dim_argument(dim, caller, "dim")
    tiled = _tree.check_flag(tiled, f"{caller}: tiled")
    n = _bound(axis_name, caller).group.global_size
    rows, given = _in_rows(x, caller, n, axis_name, dim, tiled, "dim")
    op = _ReduceScatter(f"dim={dim}", f"tiled={tiled}")
    packed, results = _run(op, rows, axis_name, numbers="count", rows=n, given=given)

    def leaf_result(k: int, piece: torch.Tensor) -> torch.Tensor:
        mine = piece.reshape(packed.leaves[k].shape[1:])  # the leaf's row (tiled: its piece)
        return mine.movedim(0, dim % given[k].dim()) if tiled else mine

    return packed.unpack(results, leaf_result)


@overload
def all_to_all(
    x: torch.Tensor, axis_name: Hashable, split_dim: int, concat_dim: int, *, tiled: bool = False
) -> torch.Tensor: ...
@overload
def all_to_all(
    x: Any, axis_name: Hashable, split_dim: int, concat_dim: int, *, tiled: bool = False
) -> Any: ...


@eager_under_compile
@_refusing_jax_options(
    split_axis="fdp.all_to_all's is split_dim (positionally, the third argument, as in JAX): "
    "split_dim={value!r}",
    concat_axis="fdp.all_to_all's is concat_dim (positionally, the fourth argument, as in JAX): "
    "concat_dim={value!r}",
)
def all_to_all(x: Any, axis_name: Hashable, split_dim: int, concat_dim: int, *, tiled: bool = False) -> Any:
    """Cuts ``x`` into one piece per replica along ``split_dim`` and sends piece ``j`` to replica ``j``.

    As ``jax.lax.all_to_all``: replica ``r`` gets piece ``r`` of every replica's ``x``, in
    replica order along ``concat_dim``. The exchange of expert and sequence parallelism (a
    mixture-of-experts layer sends each token to its expert's replica, and back). Its own
    transpose, with the two dims swapped.

    Args:
        x: a pytree of tensors, of equal shapes on every replica.
        axis_name: the ``axis_name`` given to :func:`fdp.pmap`.
        split_dim: the dim of ``x`` cut into pieces. Untiled, its size must be
            :func:`fdp.axis_size` (one row per replica) and it is removed; tiled, a multiple of
            the axis size.
        concat_dim: where the received pieces go, in replica order. Untiled, a new dim of size
            ``axis_size`` at ``concat_dim`` of the result (which has ``x``'s rank); tiled, the
            pieces are concatenated along the existing ``concat_dim``.
        tiled: cut into pieces and concatenate, instead of removing and inserting a dim.
            Keyword-only. Default: ``False``.

    Returns:
        A tree like ``x``. Untiled, each leaf has the shape of ``x``'s leaf with ``split_dim``
        removed and a dim of size ``axis_size`` inserted at ``concat_dim``; tiled, with
        ``split_dim`` divided by the axis size and ``concat_dim`` multiplied by it.

    Raises:
        NameError: outside a function mapped with this ``axis_name``.
        TypeError: a leaf is not a tensor of rank 1 or more.
        ValueError: a dim is out of range, or ``split_dim`` of the wrong size for the axis;
            the replicas passed different structures, shapes or dtypes, or different dims or
            ``tiled``.

    Examples:
        >>> import torch, fdp
        >>> swap = fdp.pmap(lambda x: fdp.all_to_all(x[0], "i", 0, 0), axis_name="i", devices=["cpu"] * 2)
        >>> swap(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # replica 0 gets [1, 3], replica 1 [2, 4]
        tensor([1., 3., 2., 4.])
    """
    caller = "fdp.all_to_all"
    split_dim = _dim_argument(split_dim, caller, "split_dim")
    concat_dim = _dim_argument(concat_dim, caller, "concat_dim")
    tiled = _tree.check_flag(tiled, f"{caller}: tiled")
    n = _bound(axis_name, caller).group.global_size
    rows, given = _in_rows(x, caller, n, axis_name, split_dim, tiled, "split_dim", concat_dim)
    op = _AllToAll(f"split_dim={split_dim}", f"concat_dim={concat_dim}", f"tiled={tiled}")
    packed, results = _run(op, rows, axis_name, rows=n, given=given)

    def leaf_result(k: int, piece: torch.Tensor) -> torch.Tensor:
        rank = given[k].dim()
        d = concat_dim % rank
        received = piece.reshape(packed.leaves[k].shape)  # (n, *chunk): row i from replica i
        if not tiled:
            return received.movedim(0, d)
        # Each piece back in the leaf's layout, then the pieces side by side along concat_dim.
        return received.movedim(1, split_dim % rank + 1).movedim(0, d).flatten(d, d + 1)

    return packed.unpack(results, leaf_result)


@overload
def ppermute(x: torch.Tensor, axis_name: Hashable, perm: Any) -> torch.Tensor: ...
@overload
def ppermute(x: Any, axis_name: Hashable, perm: Any) -> Any: ...


@eager_under_compile
def ppermute(x: Any, axis_name: Hashable, perm: Any) -> Any:
    """Sends each replica's ``x`` to another: ``perm`` is a sequence of ``(source, destination)`` pairs.

    A replica that is no pair's destination gets zeros (with zero gradient), as in
    ``jax.lax.ppermute``. Sources must be distinct, and so must destinations.

    Args:
        x: a pytree of tensors, of equal shapes on every replica.
        axis_name: the ``axis_name`` given to :func:`fdp.pmap`.
        perm: ``(source, destination)`` pairs of replica indices (integers, each below
            :func:`fdp.axis_size`).

    Returns:
        A tree like ``x``: the ``x`` of the replica that sends to this one, or zeros.

    Raises:
        NameError: outside a function mapped with this ``axis_name``.
        TypeError: ``perm`` is not a sequence of integer pairs.
        ValueError: a repeated source or destination, an index out of range, or replicas that
            passed different structures, shapes or dtypes.

    Examples:
        >>> import torch, fdp
        >>> shift_right = lambda x: fdp.ppermute(x, "i", [(0, 1), (1, 2)])
        >>> shift = fdp.pmap(shift_right, axis_name="i", devices=["cpu"] * 3)
        >>> shift(torch.tensor([1.0, 2.0, 3.0]))
        tensor([0., 1., 2.])
    """
    caller = "fdp.ppermute"
    context = _bound(axis_name, caller)
    try:
        # Read once, here: a one-pass iterable (zip(...), a generator, as in JAX #1703) would be
        # empty for the checks below, which would pass whatever it held.
        perm = list(perm)
        # operator.index, not int: int() would truncate (0.9, 1) into a send from replica 0.
        pairs = tuple((operator.index(src), operator.index(dst)) for src, dst in perm)
        if any(isinstance(i, bool) for pair in perm for i in pair):  # (False, True) is no pair of replicas
            raise TypeError
    except (TypeError, ValueError):
        raise TypeError(
            f"{caller}: perm must be a sequence of (source, destination) pairs, got {perm!r}"
        ) from None
    sources = [src for src, _ in pairs]
    destinations = [dst for _, dst in pairs]
    if len(set(sources)) != len(sources) or len(set(destinations)) != len(destinations):
        raise ValueError(f"{caller}: sources and destinations in perm must be unique, got {list(pairs)}")
    for index in sources + destinations:
        size = context.group.global_size
        if not 0 <= index < size:
            raise ValueError(
                f"{caller}: perm {list(pairs)} names replica {index}, but {size} replicas run "
                f"along axis {axis_name!r} (the batch may have fewer shards than devices)"
            )
    # Sorted: pairs listed in another order (by another replica or process) are the same perm.
    packed, results = _run(_Permute(tuple(sorted(pairs))), x, axis_name)
    return packed.unpack(results)
