"""``fdp.SyncBatchNorm``: batch normalization whose statistics span the replicas of a mapped axis.

A ``BatchNorm`` layer in a pmapped function normalizes each shard with the shard's own mean and
variance, so the outputs, gradients and running statistics differ from one device's on the
whole batch (as with ``nn.DataParallel``). This layer computes them over every replica of an
``axis_name`` (across processes too, under :mod:`fdp.distributed`), as ``nn.SyncBatchNorm``
does over a process group and ``flax.linen.BatchNorm(axis_name=...)`` over a ``jax.pmap`` axis:
the whole batch's statistics, to float rounding.

Each replica contributes its row count, mean and sum of squared deviations per channel; one
``fdp.all_gather`` hands every replica all of them, and each combines them alike (Chan et al.'s
pairwise formula, which keeps the variance accurate where ``E[x²] - E[x]²`` would cancel). The
gather is differentiable, so autograd gives every replica its share of the exact gradient of
the whole batch's normalization.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import _collectives, _replica, _tree
from ._compile import eager_under_compile

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the whole batch of a pmapped call: ``nn.SyncBatchNorm`` for
    :func:`fdp.pmap`.

    In training mode, inside a function mapped with ``axis_name``, the mean and variance are
    those of every replica's rows together (uneven shards weighted by their sizes), and so are
    the updates of the running statistics: outputs, gradients and running statistics are the
    one-device ones on the whole batch, to float rounding. Every replica must run the layer, the
    same number of times, as with any collective. Half-precision inputs get float32 statistics,
    as ``nn.BatchNorm`` computes them.

    Outside any mapped function (a plain call on one device) it is an ordinary batch norm, as
    ``nn.SyncBatchNorm`` is without a process group; in evaluation mode it uses the running
    statistics and exchanges nothing (without running statistics, ``track_running_stats=False``,
    it normalizes with the whole batch's in both modes, as ``nn.BatchNorm`` on one device does,
    where ``nn.SyncBatchNorm`` would use each process's own in evaluation mode). Inside a
    function mapped with another ``axis_name`` (or none), a call that exchanges raises
    ``NameError``, naming the ``axis_name`` to give.

    It takes inputs of shape ``(N, C, *)``, as every ``BatchNorm*d`` does. The running
    statistics change in place, as ``nn.BatchNorm``'s do: run the module with
    :func:`fdp.stateful_call` in a pmapped function (the replicas' updated statistics agree), or
    through :class:`fdp.DataParallel` with the same ``axis_name``. A layer that the replicas
    share (called from the mapped function's closure) gets each update once: every replica
    writes the same new values, computed from the values before the call.

    Checkpoint activations (``torch.utils.checkpoint``) around the pmapped call, not around
    the layer inside the mapped function: the recomputation runs in the backward pass, outside
    the replicas, with no one to share statistics with, and raises ``RuntimeError`` saying so.
    (Alone on one device, outside any pmapped call or in a lone replica, checkpointing the
    layer works as for ``nn.BatchNorm``: nothing was shared.)

    The exchange is a collective, so a graph break for ``torch.compile``: under
    ``fdp.pmap(..., compile=True)`` pmap the module itself (``fdp.pmap(model, compile=True)``,
    without running statistics to update); :func:`fdp.stateful_call` in compiled code needs
    ``forward`` in one graph, and dynamo's ``Unsupported`` error names the break.

    Args:
        num_features: ``C``, the number of channels.
        eps: added to the variance for stability. Default: ``1e-5``.
        momentum: the running statistics' update factor, or ``None`` for a cumulative
            average. Default: ``0.1``.
        affine: learnable per-channel weight and bias. Default: ``True``.
        track_running_stats: keep running statistics. Default: ``True``.
        device: where the parameters and buffers are made. Default: ``None``, torch's default.
        dtype: their dtype. Default: ``None``, torch's default.
        axis_name: the ``axis_name`` of the :func:`fdp.pmap` (or :class:`fdp.DataParallel`)
            whose replicas share their statistics. Keyword-only, required.
        bias: with ``affine``, a learnable bias. Keyword-only. Default: ``True``.
        process_group: ``None`` only, for code ported from ``nn.SyncBatchNorm``: the layer
            shares statistics with the replicas of ``axis_name``, across the processes of
            :mod:`fdp.distributed` too. Keyword-only. Default: ``None``.

    Examples:
        >>> import torch, fdp
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> model = fdp.SyncBatchNorm.convert_sync_batchnorm(model, axis_name="batch")
        >>> params = dict(model.named_parameters())
        >>> buffers = dict(model.named_buffers())
        >>> @fdp.pmap(in_axes=(None, None, 0), out_axes=(0, None), axis_name="batch",
        ...           devices=["cpu", "cpu"])
        ... def forward(params, buffers, x):
        ...     return fdp.stateful_call(model, params, buffers, (x,))
        >>> x = torch.randn(10, 3)
        >>> y, new_buffers = forward(params, buffers, x)
        >>> one_device = torch.nn.functional.batch_norm(
        ...     model[0](x), None, None, params["1.weight"], params["1.bias"], training=True)
        >>> torch.allclose(y, one_device, atol=1e-6)  # the whole batch's statistics
        True
    """

    # Buffers that replicas sharing one layer (in the mapped function's closure) may update in
    # place: each writes the same values, computed before the exchange (see _synced). The check
    # of a module's own buffers in fdp.functional_call leaves them be.
    _replicas_write_alike: ClassVar[tuple[str, ...]] = ("running_mean", "running_var", "num_batches_tracked")

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        axis_name: Hashable,
        bias: bool = True,
        process_group: None = None,
    ) -> None:
        # nn.SyncBatchNorm's sixth positional parameter is process_group, nn.BatchNorm2d's (and
        # this one's) device: a process group passed there got torch's "empty(): argument
        # 'device' must be torch.device", naming neither this layer nor what to do.
        no_group = (
            "fdp.SyncBatchNorm takes no process group, unlike nn.SyncBatchNorm: the replicas of its "
            "axis_name share their statistics, across the processes of fdp.distributed too"
        )
        if isinstance(num_features, bool) or not hasattr(num_features, "__index__"):
            # torch's words: "empty(): argument 'size' (position 1) must be tuple of ints, not str".
            raise TypeError(
                "fdp.SyncBatchNorm: num_features must be an int (C, the channels of an input of shape "
                f"(N, C, *)), got {type(num_features).__name__}: {_tree.short_repr(num_features)}"
            )
        if device is not None and not isinstance(device, str | int | torch.device):
            raise TypeError(
                "fdp.SyncBatchNorm: device (the sixth positional parameter, as in nn.BatchNorm2d) must "
                f"be a torch.device, str or int, got {type(device).__name__}: {device!r}. {no_group}"
            )
        if process_group is not None:
            raise TypeError(
                f"fdp.SyncBatchNorm: process_group must be None, got {process_group!r}. {no_group}"
            )
        if axis_name is None:
            raise ValueError(
                "fdp.SyncBatchNorm: axis_name must name the pmapped axis whose replicas share "
                "their statistics (the axis_name given to fdp.pmap), got None"
            )
        try:
            hash(axis_name)
        except TypeError:
            raise TypeError(
                f"fdp.SyncBatchNorm: axis_name must be hashable, as fdp.pmap's is, got {axis_name!r}"
            ) from None
        # Not bias=bias: only torch 2.12+'s batch norms take it (fdp supports 2.11+). A
        # parameter set to None is registered as absent, as torch's own bias=False does.
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        if affine and not bias:
            self.bias = None  # type: ignore[assignment]
        self.axis_name = axis_name

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, axis_name={self.axis_name!r}"

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"fdp.SyncBatchNorm: expected an input of shape (N, C, *), of 2 or more dims, "
                f"got {input.dim()}D input of shape {tuple(input.shape)}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        batch_statistics = self.training or (self.running_mean is None and self.running_var is None)
        if batch_statistics:
            exchange = _exchanges_statistics(self)
            if exchange is not None:
                return self._synced(input, exchange)
        # Running statistics, or one device's batch: no replica to share with.
        batches = None
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            batches = self.num_batches_tracked
        return F.batch_norm(
            input,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight,
            self.bias,
            batch_statistics,
            self._update_factor(batches),
            self.eps,
        )

    def _update_factor(self, batches: torch.Tensor | None) -> float:
        """The running statistics' update factor, as nn.BatchNorm has it: ``momentum``, or with
        ``momentum=None`` a cumulative average over ``batches``, the count including this one
        (0.0 where no count is kept: nothing is updated then)."""
        if self.momentum is not None:
            return self.momentum
        return 0.0 if batches is None else 1.0 / float(batches)

    def _synced(self, input: torch.Tensor, exchange: bool) -> torch.Tensor:
        """``forward`` with the statistics of every replica's rows, in a mapped function
        (without ``exchange``, of a lone replica's rows: the same ops, but no collective, which
        its recomputation by torch.utils.checkpoint in backward could not run)."""
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"fdp.SyncBatchNorm: expected {self.num_features} channels (dim 1) in an input "
                f"of shape (N, C, *), got shape {tuple(input.shape)}"
            )
        # The buffers' new values are computed from what they hold before the exchange and
        # written after it. Every replica computes the same values, so where the replicas share
        # one layer's buffers (the layer in the mapped function's closure), writing them again
        # changes nothing; read after the exchange, a buffer could already hold another
        # replica's update, applied a second time on top (the exchange waits for every replica
        # to enter it, so none has written yet when any reads).
        tracking = self.training and self.track_running_stats
        batches = None
        if tracking and self.num_batches_tracked is not None:
            batches = self.num_batches_tracked + 1
        factor = self._update_factor(batches)
        running = None
        if tracking and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                running = (self.running_mean * (1 - factor), self.running_var * (1 - factor))
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        statistics = self._whole_batch_statistics(x, exchange)
        with torch.no_grad():
            if batches is not None and self.num_batches_tracked is not None:
                self.num_batches_tracked.copy_(batches)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        if statistics is None:
            # No replica has a row (an empty batch, which fdp.DataParallel runs in one
            # replica of its axis): as nn.BatchNorm has it, the batch is counted, the running
            # statistics are left as they are, and the output is empty, still a function of
            # the input and the affine parameters (their gradients 0, not None).
            centered, scale = x, x.new_ones(x.shape[1])
        else:
            mean, var, count = statistics
            with torch.no_grad():
                if running is not None and self.running_mean is not None and self.running_var is not None:
                    # The unbiased variance, as nn.BatchNorm keeps; count > 1 was checked.
                    unbiased = var * (count / (count - 1))
                    self.running_mean.copy_(mean * factor + running[0])
                    self.running_var.copy_(unbiased * factor + running[1])
            # x - mean first: where the mean is large next to the spread, x * scale - mean *
            # scale would lose the difference to rounding.
            centered, scale = x - mean.view(shape), torch.rsqrt(var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight
        output = centered * scale.view(shape)
        if self.bias is not None:
            output = output + self.bias.view(shape)
        return output.to(input.dtype)

    def _whole_batch_statistics(
        self, x: torch.Tensor, exchange: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The mean and (biased) variance per channel of every replica's rows of ``x``
        together (without ``exchange``, of this lone replica's), and their number per channel
        (a 0-dim tensor); None where no replica has a row."""
        channels = x.shape[1]
        rows = x.numel() // channels if channels else 0
        if rows:
            var, mean = torch.var_mean(x, [0, *range(2, x.dim())], correction=0)
        else:  # an empty shard adds nothing (var_mean would give NaN, and 0 * NaN is NaN)
            var = mean = x.new_zeros(channels)
        # One exchange: (count, mean, sum of squared deviations) from every replica, as a
        # (replicas, 1 + 2C) tensor (a lone replica's own row, with the same ops after it).
        mine = torch.cat([x.new_full((1,), float(rows)), mean, var * rows])
        every = _collectives.all_gather(mine, self.axis_name) if exchange else mine[None]
        counts, means, deviations = every[:, :1], every[:, 1 : 1 + channels], every[:, 1 + channels :]
        count = counts.sum()
        # Only a replica with at most one row of its own can see too few in all: the host
        # reads the count there alone (on a GPU the read waits for the device).
        if rows <= 1 and (total := count.item()) <= 1:
            if total == 0:
                return None  # (every replica sees the same count: all of them return here)
            raise ValueError(
                f"fdp.SyncBatchNorm: expected more than 1 value per channel in training mode over "
                f"the replicas of axis {self.axis_name!r}, got {int(total)} in all (an "
                f"input of shape {tuple(x.shape)} on {every.shape[0]} replica(s))"
            )
        whole_mean = (counts * means).sum(0) / count
        # Chan et al.: the replicas' own squared deviations plus those of their means.
        whole_var = (deviations.sum(0) + (counts * (means - whole_mean) ** 2).sum(0)) / count
        return whole_mean, whole_var, count.detach()

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, axis_name: Hashable) -> nn.Module:
        """``module`` with every ``BatchNorm*d`` (and ``nn.SyncBatchNorm``) layer replaced by a
        :class:`fdp.SyncBatchNorm` over ``axis_name``, as ``nn.SyncBatchNorm.convert_sync_batchnorm``
        does: the new layers hold the same parameter and buffer objects, so ``state_dict`` keys
        and values are unchanged.

        Args:
            module: the module to convert (converted in place, children first; a batch-norm
                module itself is returned as a new layer).
            axis_name: the ``axis_name`` of the pmapped function the module runs in.

        Returns:
            The converted module.

        Raises:
            ValueError: a lazy batch norm whose parameters are not yet initialized (run the
                module once first).

        Examples:
            >>> import torch, fdp
            >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
            >>> fdp.SyncBatchNorm.convert_sync_batchnorm(model, axis_name="batch")[1]
            SyncBatchNorm(8, eps=1e-05, momentum=0.1, ..., axis_name='batch')
        """
        converted = module
        if isinstance(module, _BatchNorm):
            if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
                raise ValueError(
                    f"fdp.SyncBatchNorm.convert_sync_batchnorm: {type(module).__name__} has not "
                    "inferred its number of features yet: run the module once before converting it"
                )
            converted = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                axis_name=axis_name,
                bias=module.bias is not None,
            )
            # The same objects, not copies: optimizers and state_dicts made before still hold.
            converted.weight = module.weight
            converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, axis_name))
        return converted


# Set on the module object that ran (a replica's private copy, or the layer itself) by every
# forward with batch statistics: what _exchanges_statistics returned there. A recomputation in
# backward (torch.utils.checkpoint) reads it to tell a forward it cannot repeat (the replicas
# it exchanged with are gone) from one it can, alone on one device.
_FORWARD_KEY = "_fdp_exchanged_statistics"


def _exchanges_statistics(layer: SyncBatchNorm) -> bool | None:
    """How ``layer`` computes batch statistics: True, over every replica of its axis (a replica
    of a call mapped over it, with others in this process or in others); False, over a lone
    replica's rows, with the same ops but no exchange; None, as a plain batch norm (outside
    any replica: one device's batch). Raises where it can do none of these: a replica mapped
    over another axis, or a backward pass, outside any replica, recomputing a forward that
    exchanged (a forward alone on one device is recomputed as it ran).

    Run eagerly under torch.compile (see the note after the function): dynamo would otherwise
    trace the read of the thread's replica, and torch 2.11's dynamo fails on it while building
    the compiled code's guards (``AssertionError: Unexpected type ReplicaContext``). In a
    replica the graph breaks at the exchange of statistics anyway, next to this.
    """
    state = layer.__dict__
    if _replica.current() is not None:
        try:
            context = _collectives._bound(layer.axis_name, "fdp.SyncBatchNorm", advise=False)
        except NameError as error:
            # Said here, in the layer's words: the exchange beneath would name fdp.all_gather,
            # which the user never called (a converted model under fdp.DataParallel, say).
            raise NameError(
                f"{error}: the layer normalizes over the replicas of its axis_name, so map the "
                f"function with fdp.pmap(..., axis_name={layer.axis_name!r}), or give "
                f"fdp.DataParallel(..., axis_name={layer.axis_name!r})"
            ) from None
        exchange: bool | None = context.group.global_size > 1
    elif torch._C._current_graph_task_id() == -1:
        exchange = None
    else:
        # In a backward pass, outside any replica: a recomputation (torch.utils.checkpoint),
        # done as the forward was, unless that forward exchanged: inside the mapped function,
        # whose replicas are gone. As a plain batch norm it would normalize with the shard's
        # statistics alone, and the gradients would be wrong, silently (reentrant
        # checkpointing) or with an unclear CheckpointError.
        exchange = state.get(_FORWARD_KEY)
        if exchange:
            raise RuntimeError(
                "fdp.SyncBatchNorm ran with batch statistics during a backward pass, outside "
                "any replica: most likely torch.utils.checkpoint inside the mapped function, "
                "recomputing the layer after the replicas returned, where there is no one to "
                "share statistics with. Checkpoint around the whole pmapped call instead (its "
                "recomputation runs the replicas again), or checkpoint only regions without "
                "the layer."
            )
        return exchange
    if state.get(_FORWARD_KEY) is not exchange:
        state[_FORWARD_KEY] = exchange
    return exchange


eager_under_compile(
    _exchanges_statistics,
    why=(
        "fdp runs fdp.SyncBatchNorm's check of the replica it runs in eagerly, as a graph break: "
        "in training mode the layer exchanges statistics with the other replicas, which run in "
        "other threads, and torch.compile cannot trace that. Where the graph may not break "
        "(fullgraph=True, or a module's forward run by fdp.stateful_call or fdp.functional_call "
        "in compiled code, which compiles in one piece), call the module outside that code, put "
        "the layer in eval mode there, or leave that code uncompiled. To compile what the "
        "replicas of a pmapped call run, use fdp.pmap(fn, compile=True)."
    ),
)
