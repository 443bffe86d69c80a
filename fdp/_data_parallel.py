"""``fdp.DataParallel``: ``nn.DataParallel``'s interface on ``fdp.pmap``, with its known bugs fixed.

The wrapper keeps ``nn.DataParallel``'s constructor, attributes and ``state_dict`` keys (the
``module.`` prefix), so scripts switch by changing one class name and checkpoints load in either
class. Underneath, a forward pass is one pmapped call of the module (``_forward_replica``):
positional and keyword arguments are scattered as one tree along ``dim``, the module runs on
each replica through a private skeleton (so ``self.parameters()`` works inside ``forward``), and
outputs are gathered along ``dim`` with fdp's rules (0-dim outputs stacked, non-tensor outputs
checked). On one device that holds every parameter and buffer, the module itself runs, as
``nn.DataParallel`` runs it on one device, with the same rules for inputs and outputs
(``_call_module``). What ``nn.DataParallel`` gets wrong, and what happens here instead:

* parameters are copied to the devices only when they changed since the last forward (their
  version counters), not on every forward;
* in training mode (of any submodule), every replica updates its own copy of the buffers
  (BatchNorm statistics) and the module's buffers become their average weighted by shard size
  (``buffers="average"``), not replica 0's alone (``buffers="replica0"`` restores that, for
  comparisons);
* unused parameters keep ``grad is None``, as on one device.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Generic, Literal, TypeVar

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from . import (
    _compile,
    _devices,
    _functional_call,
    _gather,
    _pmap,
    _pool,
    _scatter,
    _split,
    _state,
    _thread_state,
    _transfer,
    _tree,
)

__all__ = ["DataParallel"]

# The wrapped module's type, kept in .module's (as nn.DataParallel is generic in it): typed
# nn.Module, dp.module.fc would be nn.Module's __getattr__'s Tensor | Module.
_M = TypeVar("_M", bound=nn.Module)


def _as_device_id(device: torch.device) -> int | torch.device:
    # nn.DataParallel keeps CUDA devices as indices; CPU devices have none.
    return device.index if device.type == "cuda" and device.index is not None else device


class DataParallel(nn.Module, Generic[_M]):
    """Runs ``module`` on several devices, splitting its inputs along ``dim``.

    A drop-in for :class:`torch.nn.DataParallel` built on :func:`fdp.pmap`: same constructor,
    same attributes (``module``, ``device_ids``, ``output_device``, ``dim``), same ``state_dict``
    keys. CPU devices work (``device_ids=["cpu", "cpu"]``), so multi-device code runs and is
    tested without GPUs.

    Args:
        module: the module to run. Its parameters may live on any device.
        device_ids: the devices (CUDA indices, strings, ``torch.device``s; duplicates allowed).
            Default: ``None``, every visible CUDA device, else the CPU.
        output_device: where outputs are gathered. Default: ``None``, the first device.
        dim: the dimension along which inputs (positional and keyword) are split and outputs
            concatenated. Default: ``0``.
        buffers: in training mode (of any submodule), how the module's buffers are updated from the
            replicas' copies: ``"average"`` (floating-point and complex buffers become the average
            of the replicas' updated copies, weighted by their numbers of rows; others, and
            reassigned ones whose replicas' values differ in shape or dtype, take replica 0's) or
            ``"replica0"`` (``nn.DataParallel``'s behaviour). Keyword-only. Default: ``"average"``.
        split: ``"chunk"`` (``nn.DataParallel``'s rule) or ``"balanced"``. Keyword-only. Default:
            ``"chunk"``.
        axis_name: the name the replicas run under, for collectives inside the module:
            :class:`fdp.SyncBatchNorm` layers of this ``axis_name`` then normalize over the
            whole batch. Keyword-only. Default: ``None``, no collectives.

    Examples:
        >>> import torch, fdp
        >>> model = fdp.DataParallel(torch.nn.Linear(5, 2), device_ids=["cpu", "cpu"])
        >>> model(torch.randn(30, 5)).shape
        torch.Size([30, 2])
        >>> list(model.state_dict())
        ['module.weight', 'module.bias']
    """

    def __init__(
        self,
        module: _M,
        device_ids: Sequence[_devices.DeviceLike] | None = None,
        output_device: _devices.DeviceLike | None = None,
        dim: int = 0,
        *,
        buffers: Literal["average", "replica0"] = "average",
        split: Literal["chunk", "balanced"] = "chunk",
        axis_name: Hashable | None = None,
    ) -> None:
        super().__init__()
        # Checked here, in the wrapper's own words: the pmapped function beneath would name
        # itself and its in_axes (a bad dim), or fail on the first call (not a module).
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"fdp.DataParallel: module must be a torch.nn.Module, got {type(module).__name__}"
            )
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"fdp.DataParallel: dim must be an int, got {type(dim).__name__}: {dim!r}")
        _split.check_split(split, what="fdp.DataParallel split")
        if buffers not in ("average", "replica0"):
            raise ValueError(f"fdp.DataParallel: buffers must be 'average' or 'replica0', got {buffers!r}")
        try:
            hash(axis_name)
        except TypeError:  # else refused by the pmap beneath, as "fdp.pmap(_forward_replica)"
            raise TypeError(
                f"fdp.DataParallel: axis_name must be hashable, got {type(axis_name).__name__}: {axis_name!r}"
            ) from None
        self.module: _M = module
        devices = _devices.resolve_devices(device_ids, what="fdp.DataParallel device_ids")
        if len(devices) > 1 and isinstance(module, _functional_call.compiled_module_type()):
            raise TypeError(
                f"fdp.DataParallel(device_ids={device_ids!r}): a torch.compile'd module runs on "
                "one device only, where the module itself runs. On several devices each replica "
                "runs a private copy of the module with its tensors for the device, which the "
                "compiled forward would bypass (it belongs to the module it compiled). Wrap the "
                "module itself, or compile the replicas with fdp.pmap(model, compile=True)."
            )
        output = (
            devices[0]
            if output_device is None
            else _devices.check_available(
                _devices.parse_device(output_device, what="fdp.DataParallel output_device"),
                what="fdp.DataParallel output_device",
            )
        )
        self.device_ids = [_as_device_id(d) for d in devices]
        self.output_device = _as_device_id(output)
        self.dim = dim
        self.buffers_mode = buffers
        self.axis_name = axis_name
        self._devices = devices
        # A module-level function, not a bound method: the wrapper must not refer to itself
        # (a reference cycle would keep every replaced model alive until the next gc run).
        # Pmapped itself, not fdp.pmap: fdp.pmap's check of its positional axis_name (one that
        # reads as in_axes) is for its callers; here it would name fdp.pmap(_forward_replica).
        self._mapped = _pmap.Pmapped(
            _forward_replica,
            in_axes=(None, None, None, None, None, dim, dim),
            out_axes=(dim, _state.PER_REPLICA),
            devices=list(devices),
            output_device=output,
            split=split,
            axis_name=axis_name,
            static_argnums=(),
            check_unmapped_outputs=False,
        )
        self._mapped._caller = "fdp.DataParallel"
        # The user's inputs are the pmapped function's args[5] (positional) and args[6] (keyword).
        self._mapped.rename_paths = functools.partial(  # output: (output, state)
            _user_path, 5, "output[0]", more=(("args[3]", "params"), ("args[4]", "buffers"))
        )
        self._mapped.user_output = operator.itemgetter(0)  # (picklable: the wrapper may be saved)
        self._mapped.in_place_advice = (
            "In evaluation mode the replicas share the module's buffers (in training mode, of any "
            "submodule, each updates a copy of its own, averaged back after the call): change "
            "buffers in place in training mode only, or run such a module on one device."
        )
        # One device that holds the whole module: the module itself runs there, as
        # nn.DataParallel runs it on one device (see forward).
        self._direct: _pmap.Pmapped[..., Any] | None = None
        if len(devices) == 1:
            self._direct = _pmap.Pmapped(
                _call_module,
                in_axes=(None, dim, dim),
                out_axes=dim,
                devices=list(devices),
                output_device=output,
                split=split,
                axis_name=axis_name,
                static_argnums=(),
                check_unmapped_outputs=False,
            )
            self._direct._caller = "fdp.DataParallel"
            self._direct.rename_paths = functools.partial(_user_path, 1, None)
        self._placed: tuple[Any, Any, Any] | None = None  # (key, PerReplica parameters, (param, data)s)
        # Whether a parameter already on the devices is handed to the replicas as it is: one
        # device, or CPU replicas sharing it (no replica gets a view: see
        # _transfer.alias_shared_leaves). In-place changes then reach the replicas by themselves.
        # (One device runs the module itself when it holds every tensor: this serves the rest.)
        self._shared_as_is = len(set(devices)) == 1 and (len(devices) == 1 or devices[0].type == "cpu")

    # Under torch.compile (of the wrapper, or of code that calls it) the forward pass is a
    # graph break and runs eagerly, as pmap's calls do; fdp.DataParallel(torch.compile(model))
    # compiles the module itself.
    @_compile.eager_under_compile
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # One device that holds every parameter and buffer: a functional call of the module
        # with its own tensors is the module's own call, and buffers it updates in place are
        # the module's. So the module itself runs there, as nn.DataParallel runs it on one
        # device; only the inputs and outputs go through pmap (_direct), for the same rules of
        # splitting (and moving) and gathering as on several devices. About a third of a small
        # model's forward on the CPU is spared.
        direct = self._direct if self._direct is not None and _all_on(self.module, self._devices[0]) else None
        first = next((a for a in inputs if isinstance(a, torch.Tensor)), None)
        if first is None:
            # No tensor among the positional arguments themselves (the usual call has one,
            # which spares the flatten of every argument below).
            leaves = _tree.flatten((inputs, kwargs))[0]
            first = next((t for t in leaves if isinstance(t, torch.Tensor)), None)
            # Nothing to split: nn.DataParallel runs such a call on its first device alone. But
            # not rows that fdp refuses to split (a UserDict holding tensors, a NumPy array):
            # the mapped call says so, where running unsplit would silently not split them.
            if first is None and not any(_tree.unsplittable_reason(x, "fdp.DataParallel") for x in leaves):
                return self._run_once(direct, inputs, kwargs)
        if (
            first is not None
            and not first.is_nested  # (no shape: the mapped call refuses it, saying why)
            and -first.dim() <= self.dim < first.dim()
            and first.shape[self.dim] == 0
            and _empty_batch((flat := _tree.flatten((inputs, kwargs)))[0], self.dim)
        ):
            # An empty batch (data-dependent, as a detector's second stage may make): there is
            # nothing to split, so it runs once on the first device, as the module runs on one
            # device (nn.DataParallel runs it on every device, each with no rows); its outputs
            # follow the rules of one replica's (0-dim ones stacked, moved to output_device).
            device = self._devices[0]
            moved = [leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf for leaf in flat[0]]
            inputs, kwargs = _tree.unflatten(flat[1], moved)
            # Joined as the wrapper's calls join them, and named as the wrapper (fdp.gather's
            # rules for 0-dim outputs are fdp.pmap's, which a dim other than 0 would break).
            return _gather.gather_outputs(
                [self._run_once(direct, inputs, kwargs)],
                self._mapped.output_device,
                self.dim,
                caller="fdp.DataParallel",
            )
        if direct is not None:
            return direct(self.module, inputs, kwargs)
        params, buffers, training = _parameters_and_buffers(self.module)
        placed: Any = self._place(params)  # PerReplica values, where the replicas get tensors
        # CPU replicas get the parameters themselves: a forward that changes one in place
        # (nn.Embedding(max_norm=...) renormalizes its rows) has the replicas race on it.
        versions = _versions(params.values()) if self._shared_as_is and len(self._devices) > 1 else None
        outputs, state = self._mapped(self.module, self.dim, training, placed, buffers, inputs, kwargs)
        if versions is not None and first is not None:
            after = _versions(params.values())
            if after != versions:
                self._refuse_changed_parameter(params, versions, after, first)
        if state is not None:
            updated, rows = state
            replicas = [{name: updated[name][r] for name in updated} for r in range(len(rows))]
            self._update_buffers(buffers, replicas, [float(n) for n in rows])
        return outputs

    def _refuse_changed_parameter(
        self, params: dict[str, torch.Tensor], versions: list[int], after: list[int], first: torch.Tensor
    ) -> None:
        """Raises for a parameter that the replicas, sharing it, changed in place (where more
        than one ran: a lone replica's change is the module's own, as on one device)."""
        n = len(_split.shard_sizes(first.shape[self.dim], len(self._devices), self._mapped.split))
        if n < 2:
            return
        for name, version, now in zip(params, versions, after):
            if now == version:
                continue
            devices = ", ".join(str(d) for d in self._devices[:n])
            raise RuntimeError(
                f"fdp.DataParallel: the replicas modified params[{name!r}] in place, but the {n} "
                f"replicas on {devices} share the module's parameters: their changes race (on GPUs "
                "each replica would change a copy of its own, and its change would be lost). "
                "Change parameters outside forward (after the optimizer step, under "
                "torch.no_grad()), or run a module whose forward changes them (an nn.Embedding "
                "with max_norm) on one device."
            )

    def _run_once(self, direct: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The module called once, on the first device, with ``inputs`` and ``kwargs`` as they
        are, for a call with nothing to split; buffers it updates are the module's.

        It runs as the one replica of the wrapper's ``axis_name``, as a call with a batch runs:
        collectives in the module (fdp.SyncBatchNorm's exchange) see one replica rather than
        no axis, and under fdp.distributed the call takes its part in the other processes'
        (which would otherwise wait for it), and a call inside a replica is refused."""
        device = self._devices[0]
        lone = _pool.LoneReplica(device, axis_name=self.axis_name, caller="fdp.DataParallel")
        if direct is not None:
            return lone(_call_module, self.module, inputs, kwargs)
        params, buffers, training = _parameters_and_buffers(self.module)
        params = {name: p.to(device) for name, p in params.items()}
        on_device = {name: b.to(device) for name, b in buffers.items()}
        outputs, state = lone(
            _forward_replica, self.module, self.dim, training, params, on_device, inputs, kwargs
        )
        if state is not None:
            self._update_buffers(buffers, [state[0]], [1.0])
        return outputs

    def __getstate__(self) -> dict[str, Any]:
        # A copy (an EMA twin, torch.save of the model) places its parameters anew: the copies
        # placed for this one's devices are views or outputs of a broadcast on GPUs, which
        # neither deepcopy nor a later call of the copy could use.
        state = super().__getstate__()
        state["_placed"] = None
        return state

    def _place(self, params: dict[str, torch.Tensor]) -> dict[str, _state.PerReplica]:
        """The parameters on every device, copied again only when one of them changed.

        The key holds every parameter's identity, version counter (bumped by optimizer steps and
        any in-place change), data address and dtype, device and ``requires_grad``, and the grad
        mode (copies made under ``no_grad`` carry no graph back to the parameters). The address
        and dtype are for changes that swap a parameter's data and keep its version counter:
        ``model.half()``, ``model.to(dtype)``, ``p.data = t``. (An in-place change through
        ``p.data`` is seen by nothing: its version counter is not the parameter's; nor is
        ``p.data = p.data[:k]`` or ``.t()``, a view at the same address: shapes and strides in
        the key would cost ~30 µs per forward for 100 parameters, on every call.) A parameter
        that the replicas get as it is (see ``_shared_as_is``) needs none of these: its changes
        are theirs already, and an optimizer step does not make the call place the parameters
        again. The parameters, and their data where the key holds its address, are kept with
        the key: the ids of ones replaced since (``model.fc = nn.Linear(...)``), and the
        addresses of data swapped since (``model.half(); model.float()``), cannot be reused by
        new ones while compared.
        """
        home = self._devices[0] if self._shared_as_is else None
        key = (
            torch.is_grad_enabled(),
            tuple(
                (name, id(p), None if p.device == home else _data_key(p), p.device, p.requires_grad)
                for name, p in params.items()
            ),
        )
        if self._placed is not None and self._placed[0] == key:
            return self._placed[1]
        try:
            copies = _scatter.replicate(params, self._devices)
        except ValueError as err:  # a meta tensor, named in fdp.replicate's words: named here in ours
            tensors = list(params.values())
            paths = lambda: [f"the module's {name!r}" for name in params]  # noqa: E731
            _scatter.refuse_meta("fdp.DataParallel", tensors, range(len(tensors)), paths, self._devices, err)
            raise
        rows = _transfer.alias_shared_leaves([[c[name] for name in params] for c in copies], self._devices)
        placed = {
            name: _state.PerReplica._prefix([row[i] for row in rows], self._devices)
            for i, name in enumerate(params)
        }
        # The data only where the key holds its address: kept elsewhere (a parameter shared as
        # it is), it would keep the storage that model.half() or .to() swapped out alive for
        # nothing until the next call.
        self._placed = (key, placed, [(p, None if p.device == home else p.data) for p in params.values()])
        return placed

    @torch.no_grad()
    @_thread_state.without_autocast  # torch.stack keeps the buffers' dtype under any autocast
    def _update_buffers(
        self, buffers: dict[str, torch.Tensor], replicas: list[dict[str, torch.Tensor]], weights: list[float]
    ) -> None:
        """Writes the replicas' updated buffers into the module's, averaged or from replica 0."""
        total = sum(weights)
        for name, buffer in buffers.items():
            values = [r[name].to(buffer.device) for r in replicas]
            new = values[0]
            # A buffer that forward reassigned may come back with another shape or dtype than
            # the module's (a cache that grows with the input): averaged only where the
            # replicas' values agree in both, else replica 0's, as for integer buffers.
            alike = all(v.shape == new.shape and v.dtype == new.dtype for v in values)
            if (
                self.buffers_mode == "average"
                # Complex statistics (a running mean of complex features) average as real ones
                # do: taken from replica 0 alone, they dropped the other shards' rows.
                and (new.is_floating_point() or new.is_complex())
                and alike
                # Replicas that agree (on a buffer that forward leaves alone, say) give their
                # value as it is: shares such as 2/3 and 1/3 need not sum to exactly 1, and the
                # average would make the buffer drift, call after call.
                and not all(torch.equal(v, new) for v in values[1:])
            ):
                # sum_r w_r / W * value_r, in elementwise products: a contraction (tensordot)
                # would run in autocast's lower precision inside an autocast region. In float32
                # at least, rounded to the buffer's dtype once: bfloat16 shares of 2/3 and 1/3
                # sum to 1.002.
                exact = torch.promote_types(new.dtype, torch.float32)
                share = torch.tensor(weights, dtype=exact, device=buffer.device) / total
                stacked = torch.stack(values).to(exact)
                new = (share.view(-1, *[1] * new.dim()) * stacked).sum(0).to(new.dtype)
            if new.shape != buffer.shape or new.dtype != buffer.dtype:
                # Copied into the old buffer it would fail, broadcast or be cast silently: the
                # new tensor takes its place, as `self.buf = ...` does on one device.
                owner, _, leaf = name.rpartition(".")
                setattr(self.module.get_submodule(owner), leaf, new)
            elif not torch.equal(new, buffer):  # untouched buffers keep their version counters
                buffer.copy_(new)


def _data_key(p: torch.Tensor) -> tuple[int, int | None, torch.dtype]:
    """What tells a parameter's placed copies stale: its version counter, and its data's
    address (strided tensors have one) and dtype, which change without it (see ``_place``)."""
    return p._version, p.data_ptr() if p.layout == torch.strided else None, p.dtype


def _versions(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The tensors' version counters (-1 for an inference tensor, which keeps none)."""
    tensors = list(tensors)
    try:
        return [t._version for t in tensors]  # ~60 ns a tensor: a DataParallel call reads two lists
    except RuntimeError:  # an inference tensor among them
        return [_pmap._version(t) for t in tensors]


def _empty_batch(leaves: Sequence[Any], dim: int) -> bool:
    """Whether every tensor among the arguments' ``leaves`` has no rows along ``dim``, and no
    other leaf holds rows that fdp refuses to split (else the pmapped call checks them: sizes
    that differ, a rank too small, a NumPy array or a UserDict holding tensors, refused as beside
    a batch with rows)."""
    return all(
        not t.is_nested and -t.dim() <= dim < t.dim() and t.shape[dim] == 0
        if isinstance(t, torch.Tensor)
        else not _tree.unsplittable_reason(t, "fdp.DataParallel")
        for t in leaves
    )


def _all_on(module: nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``module`` is on ``device``."""
    cpu = device.type == "cpu"  # is_cpu builds no device object: cheaper
    for submodule in module.modules():
        state = submodule.__dict__
        for tensors in (state["_parameters"].values(), state["_buffers"].values()):
            for t in tensors:
                if t is not None and (not t.is_cpu if cpu else t.device != device):
                    return False
    return True


def _parameters_and_buffers(
    module: nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], bool]:
    """``dict(module.named_parameters())`` and ``dict(module.named_buffers())``, from one walk
    over the submodules instead of two: with the names and the skipping of ``None`` and of
    tensors met before (under another name) of those methods. For a module of a few dozen
    submodules the second walk would cost about as much as the rest of a forward's own work.
    Also whether any submodule is in training mode: under ``model.eval()``, a submodule set
    back to ``train()`` (a BatchNorm) updates its buffers, as on one device. (Read on this
    walk: another over a few hundred submodules, in each replica, would cost ~0.4 ms.)"""
    training = False
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    seen_params: set[torch.Tensor] = set()
    seen_buffers: set[torch.Tensor] = set()
    for prefix, submodule in module.named_modules():
        # (torch types the method's self as its _LazyProtocol, which mypy finds no mixin is.)
        if isinstance(submodule, LazyModuleMixin) and submodule.has_uninitialized_params():  # type: ignore[misc]
            # Its first forward sets its parameters up, in place: replicas sharing them would
            # each do it at once (a random weight over another, or torch's own AttributeError).
            where = f"module.{prefix}" if prefix else "the module"
            raise RuntimeError(
                f"fdp.DataParallel: {where} ({type(submodule).__name__}) is a lazy module whose "
                "parameters are not set up yet: its first forward sets them up, which the replicas "
                "cannot share. Run that one on one device (module(x[:1])) before the "
                "data-parallel calls, as torch's docs ask of nn.DataParallel."
            )
        state = submodule.__dict__
        # The attribute, not state["training"]: a scripted module keeps its mode in C++.
        training = training or submodule.training
        for tensors, seen, slots in (
            (params, seen_params, "_parameters"),
            (buffers, seen_buffers, "_buffers"),
        ):
            for name, tensor in state[slots].items():
                if tensor is None or tensor in seen:
                    continue
                seen.add(tensor)
                tensors[f"{prefix}.{name}" if prefix else name] = tensor
    return params, buffers, training


def _forward_replica(
    module: nn.Module,
    dim: int,
    training: bool,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """One replica's forward; in training mode (``training``: of any submodule, not the root's
    alone), with its own copy of the buffers, returned with the number of rows it ran on (else
    None: nothing to update)."""
    if not (training and buffers):
        return _functional_call.functional_call(module, {**params, **buffers}, args, kwargs), None
    output, new_buffers = _functional_call.stateful_call(module, params, buffers, args, kwargs)
    tensors = [t for t in _tree.flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    return output, (new_buffers, tensors[0].shape[dim] if tensors else 1)


def _call_module(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return module(*args, **kwargs)


def _user_path(first: int, output: str | None, path: str, more: tuple[tuple[str, str], ...] = ()) -> str:
    """A key path of the pmapped function's arguments or output as the user's, for messages:
    its ``args[first]`` and ``args[first + 1]`` are the user's positional ``inputs`` and
    keyword ``kwargs``, ``output`` (if given) is the user's ``output``, and ``more`` renames
    other arguments (``params``, ``buffers``). (Bound with functools.partial, which pickles: the
    wrapper may be saved.)"""
    renames = [(f"args[{first}]", "inputs"), (f"args[{first + 1}]", "kwargs"), *more]
    if output is not None:
        renames.append((output, "output"))
    for position, name in renames:
        if path.startswith(position):
            return name + path[len(position) :]
    return path
