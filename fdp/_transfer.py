"""Differentiable moves of tensors between devices.

Three shapes of traffic, each with a CUDA path and a plain path:

* :func:`split_to` cuts one tensor into shards, one per device (scatter);
* :func:`broadcast` gives several devices a copy of several tensors (replicate);
* :func:`gather_to` joins shards on one device (gather).

Between CUDA devices they use the primitives made for this, ``torch.cuda.comm`` (scatter, gather,
NCCL-backed coalesced broadcast and coalesced reduce-add), wrapped in autograd functions whose
backward is the mirror transfer, so double backward works. Everywhere else (CPU, mixed targets)
they are plain ``torch.split``/``Tensor.to``/``torch.cat``, which autograd already differentiates.
A tensor whose target is the device it is on is never copied: replicas that share a device
share the tensor (in a pmapped call, replicas on a worker's CUDA stream get a view of a leaf
that requires grad: see :func:`alias_shared_leaves`; under deterministic algorithms, CPU
replicas get aliases of a tensor that requires grad, whose gradients a chain of aliases sums in
replica order: see :func:`share_for_backward`).

The transfers into and out of the replicas are issued from the caller's thread on the current
stream of each device; the replica workers wait on those streams before they start (see
``_pool``). Inside a collective they run in the combining replica's thread (see ``_streams``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.cuda.comm
from torch.autograd import Function

__all__ = [
    "to_device",
    "split_to",
    "broadcast",
    "alias_shared_leaves",
    "share_for_backward",
    "gather_to",
    "reduce_add",
]

# Indirection so tests can exercise the autograd wiring with a CPU stand-in for torch.cuda.comm.
_comm: Any = torch.cuda.comm


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor.to(device)``, non-blocking when the source is pinned host memory."""
    if tensor.device == device:
        return tensor
    non_blocking = device.type == "cuda" and tensor.device.type == "cpu" and tensor.is_pinned()
    return tensor.to(device, non_blocking=non_blocking)


def _all_cuda(devices: Sequence[torch.device]) -> bool:
    return all(d.type == "cuda" for d in devices)


def _any_cuda(devices: Sequence[torch.device]) -> bool:
    return any(d.type == "cuda" for d in devices)


def _comm_can_move(tensors: Sequence[torch.Tensor]) -> bool:
    # torch.cuda.comm hands complex tensors back as real views (view_as_real); those take the
    # plain path, which keeps them complex.
    return not any(t.is_complex() for t in tensors)


class _CudaScatter(Function):
    """Splits one tensor (CPU or CUDA) into shards on CUDA devices; backward gathers."""

    @staticmethod
    def forward(ctx, devices, sizes, dim, tensor):  # type: ignore[override]
        ctx.dim = dim
        ctx.source = tensor.device
        return tuple(_comm.scatter(tensor, devices=devices, chunk_sizes=sizes, dim=dim))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return None, None, None, _CudaGather.apply(ctx.source, ctx.dim, *grads)


class _CudaGather(Function):
    """Joins CUDA shards on one device (CUDA or CPU); backward scatters."""

    @staticmethod
    def forward(ctx, destination, dim, *tensors):  # type: ignore[override]
        ctx.dim = dim
        ctx.devices = [t.device for t in tensors]
        ctx.sizes = [t.size(dim) for t in tensors]
        return _comm.gather(tensors, dim=dim, destination=destination)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return (None, None) + _CudaScatter.apply(ctx.devices, ctx.sizes, ctx.dim, grad)


class _CudaBroadcast(Function):
    """Copies tensors that live on ``devices[0]`` to every device in ``devices`` (distinct GPUs).

    Returns the copies device-major: all tensors for ``devices[0]``, then for ``devices[1]``...
    Backward sums the gradients back onto ``devices[0]`` with one coalesced reduction; a tensor
    none of whose copies received a gradient gets ``None``, as on one device (``nn.DataParallel``
    gives unused parameters zeros).
    """

    @staticmethod
    def forward(ctx, devices, *tensors):  # type: ignore[override]
        ctx.source = devices[0]
        ctx.devices = list(devices)
        ctx.count = len(tensors)
        ctx.set_materialize_grads(False)
        copies = _comm.broadcast_coalesced(tensors, devices)
        frozen = [
            per_device[i]
            for i, needs_grad in enumerate(ctx.needs_input_grad[1:])
            if not needs_grad
            for per_device in copies
        ]
        ctx.mark_non_differentiable(*frozen)
        ctx.like = [(t.shape, t.dtype) for t in tensors]
        return tuple(t for per_device in copies for t in per_device)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        count = ctx.count
        used = [any(grads[r * count + i] is not None for r in range(len(ctx.devices))) for i in range(count)]
        if not any(used):
            return (None,) * (count + 1)
        filled = []
        for r, device in enumerate(ctx.devices):
            group = grads[r * count : (r + 1) * count]
            # Zeros where a copy got no gradient, on the device its siblings' gradients are on.
            where = next((g.device for g in group if g is not None), device)
            filled.extend(
                torch.zeros(shape, dtype=dtype, device=where) if g is None else g
                for g, (shape, dtype) in zip(group, ctx.like)
            )
        summed = _CudaReduceAdd.apply(ctx.source, count, *filled)
        return (None, *(s if u else None for s, u in zip(summed, used)))


class _CudaReduceAdd(Function):
    """Sums device-major groups of ``count`` tensors onto ``destination``; backward broadcasts."""

    @staticmethod
    def forward(ctx, destination, count, *grads):  # type: ignore[override]
        groups = [grads[i : i + count] for i in range(0, len(grads), count)]
        ctx.devices = [group[0].device for group in groups]
        return tuple(_comm.reduce_add_coalesced(groups, destination))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, None) + _CudaBroadcast.apply(ctx.devices, *grads)


def split_to(
    tensor: torch.Tensor, dim: int, sizes: Sequence[int], devices: Sequence[torch.device]
) -> list[torch.Tensor]:
    """Shards of ``tensor`` along ``dim`` with the given sizes, shard ``i`` on ``devices[i]``."""
    if len(sizes) == 1:
        return [to_device(tensor, devices[0])]
    if _all_cuda(devices) and tensor.device.type in ("cpu", "cuda") and _comm_can_move([tensor]):
        return list(_CudaScatter.apply(list(devices), list(sizes), dim, tensor))
    return [to_device(shard, d) for shard, d in zip(tensor.split_with_sizes(sizes, dim), devices)]


def broadcast(tensors: Sequence[torch.Tensor], devices: Sequence[torch.device]) -> list[list[torch.Tensor]]:
    """A copy of every tensor on every device: ``result[r][i]`` is tensor ``i`` on ``devices[r]``.

    Duplicate devices share one copy; a tensor already on a target device is used as it is.
    """
    unique = list(dict.fromkeys(devices))
    placed: dict[torch.device, list[torch.Tensor | None]] = {d: [None] * len(tensors) for d in unique}
    cuda_targets = [d for d in unique if d.type == "cuda"]
    if len(cuda_targets) >= 2 and _comm_can_move(tensors):
        _broadcast_cuda(tensors, cuda_targets, placed)
    for d in unique:
        slots = placed[d]
        for i, t in enumerate(tensors):
            if slots[i] is None:
                slots[i] = to_device(t, d)
    return [placed[d] for d in devices]  # type: ignore[misc]


def alias_shared_leaves(rows: list[list[Any]], devices: Sequence[torch.device]) -> list[list[Any]]:
    """``rows`` (one list of values per replica, from :func:`broadcast`) with every replica but
    the first given a view of each CUDA leaf that requires grad, in place of the leaf itself.
    For the replicas of a call, issued from the caller's thread (not for ``fdp.replicate``,
    which hands out the tensors as they are).

    Replica 0 runs on the caller's stream, the others on their workers' (see ``_pool``). A leaf
    accumulates its gradient on the stream its AccumulateGrad node was made on, and torch warns
    when a gradient reaches that node from another stream. A view made here, on the caller's
    stream, puts a node of the caller's stream between each other replica and the leaf: the
    engine orders the streams there, as between any two nodes, and the leaf's gradient arrives
    from one stream. The view shares the leaf's memory and version counter.
    """
    if not (torch.is_grad_enabled() and _any_cuda(devices)):
        return rows
    rows = list(rows)
    for r in range(1, len(rows)):
        row = None
        for i, t in enumerate(rows[r]):
            if isinstance(t, torch.Tensor) and t.is_cuda and t.requires_grad and t.grad_fn is None:
                if row is None:
                    row = rows[r] = list(rows[r])  # replicas on one device share the list
                row[i] = t.view_as(t)
    return rows


def share_for_backward(rows: list[list[Any]], indices: Sequence[int]) -> None:
    """Replaces, in ``rows`` (one list of leaves per replica), every CPU tensor that requires
    grad and that several replicas got as the same object (at the given leaf ``indices``) by one
    view of it per replica, made so that the tensor's gradient is the sum of the replicas' in
    replica order, the same on every call. Issued from the caller's thread, by a caller that
    checked that it is wanted (see ``_scatter._share_for_backward``: several replicas, grad mode,
    ``torch.use_deterministic_algorithms(True)``). (On CUDA devices, see
    :func:`alias_shared_leaves`.)

    Why: replicas that share one tensor each feed its gradient accumulator, which adds what
    reaches it in the order the engine runs the replicas' nodes, by their sequence numbers,
    which each thread counts for itself: they depend on which thread ran which replica and on
    what it ran before. Three replicas, or a tensor used twice in each, then sum in an order
    that changes from call to call, and two identical runs (a run and its resumed twin) part in
    the last bits, which training amplifies. (``torch.cuda.comm``'s reduction sums GPUs in
    device order.)

    How: a chain of aliases, ``link_0 = alias(t)``, ``link_i = alias(link_(i-1))``;
    replica ``m-1-i`` of the ``m`` sharing ``t`` gets a view of ``link_i`` of its own, and
    replica 0 the last link. Every link's gradient is then the sum of exactly two: what its
    own replica's view collects (that replica's uses, in an order its own graph fixes) and
    what the rest of the chain below it collects, and two addends sum alike in either order.
    The engine adds them as it adds any gradients, in place where it can (a node that summed
    the replicas' gradients itself would write each sum to new memory). The links are
    ``aten.alias``, whose backward hands the gradient on as it is (sparse ones too).
    """
    everyone = list(range(len(rows)))
    strided = torch.strided
    for k in indices:
        first = rows[0][k]
        # Most replicated leaves need no gradient (a batch of constants, parameters under
        # torch.func.grad): one test each. (Replica 0's copy requires grad as the others do.)
        if type(first) is not torch.Tensor and not isinstance(first, torch.Tensor) or not first.requires_grad:
            continue
        # Usually every replica holds the same tensor (CPU replicas): one test per replica.
        if all(row[k] is first for row in rows):
            groups = [(first, everyone)]
        else:  # several devices: replicas on each share their device's copy
            by_id: dict[int, tuple[Any, list[int]]] = {}
            for r, row in enumerate(rows):
                by_id.setdefault(id(row[k]), (row[k], []))[1].append(r)
            groups = list(by_id.values())
        for t, group in groups:
            if (
                len(group) > 1
                and isinstance(t, torch.Tensor)
                and t.requires_grad
                and t.is_cpu
                and t.layout == strided
            ):
                for r, view in zip(group, fan_out(t, len(group))):
                    rows[r][k] = view


def fan_out(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` aliases of ``t``, one for each of ``n`` consumers (replicas), whose gradients
    reach ``t`` summed in a fixed order: ``g_(n-1) + (g_(n-2) + (... + g_0))``, whatever order
    the engine runs the consumers' nodes in (see :func:`share_for_backward`, which explains
    the chain). Each alias shares ``t``'s memory and version counter."""
    alias = torch.ops.aten.alias.default
    views: list[torch.Tensor] = [t] * n
    link = alias(t)
    for r in reversed(range(1, n)):  # the first link's branch sums last
        views[r] = alias(link)
        link = alias(link)
    views[0] = link
    return views


def _broadcast_cuda(
    tensors: Sequence[torch.Tensor],
    targets: list[torch.device],
    placed: dict[torch.device, list[torch.Tensor | None]],
) -> None:
    """Fills ``placed`` for the CUDA targets with one coalesced broadcast per source device."""
    by_source: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        # A tensor on a CUDA target is broadcast from there; any other is first moved to the
        # first target (one host-to-device copy) and broadcast from that device.
        source = t.device if t.device in targets else targets[0]
        by_source.setdefault(source, []).append(i)
    for source, indices in by_source.items():
        order = [source] + [d for d in targets if d != source]
        inputs = [to_device(tensors[i], source) for i in indices]
        copies = _CudaBroadcast.apply(order, *inputs)
        for r, d in enumerate(order):
            for j, i in enumerate(indices):
                placed[d][i] = copies[r * len(indices) + j]


def gather_to(tensors: Sequence[torch.Tensor], dim: int, destination: torch.device) -> torch.Tensor:
    """Concatenates ``tensors`` along ``dim`` on ``destination``."""
    if len(tensors) == 1:
        return to_device(tensors[0], destination)
    if destination.type == "cpu" and all(t.is_cpu for t in tensors):
        return torch.cat(list(tensors), dim)  # the common CPU case
    if (
        _all_cuda([t.device for t in tensors])
        and destination.type in ("cpu", "cuda")
        and _comm_can_move(tensors)
    ):
        return _CudaGather.apply(destination, dim, *tensors)
    return torch.cat([to_device(t, destination) for t in tensors], dim)


def reduce_add(tensors: Sequence[torch.Tensor], destination: torch.device) -> torch.Tensor:
    """The sum of ``tensors`` (of one shape and dtype, on any devices) on ``destination``.

    Between distinct GPUs this is one coalesced NCCL-backed reduction; otherwise the tensors
    are moved and added in order, so the result does not depend on thread timing.
    """
    devices = [t.device for t in tensors]
    distinct_gpus = _all_cuda(devices) and len(set(devices)) == len(devices)
    # comm.reduce_add needs the destination among the sources; put it first, where the
    # backward's broadcast starts from.
    if len(tensors) > 1 and distinct_gpus and destination in devices and _comm_can_move(tensors):
        ordered = sorted(tensors, key=lambda t: t.device != destination)
        return _CudaReduceAdd.apply(destination, 1, *ordered)[0]
    total = to_device(tensors[0], destination)
    for t in tensors[1:]:
        total = total + to_device(t, destination)
    return total
