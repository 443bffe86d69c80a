"""``fdp.pmap``: data parallelism as a function transform.

A call goes: check the call site (not inside a replica, not under a torch.func transform) ->
flatten the arguments with optree -> per-leaf axes from ``in_axes`` (cached per tree structure)
-> scatter (``_scatter``) -> run one replica per shard on the pool (``_pool``) -> gather
(``_gather``). One replica (on the CPU or one GPU) whose inputs need no scattering skips the
scatter and the pool's general path (``_pool.LoneReplica``). Each of those steps lives in its
own module; this one only wires them together.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Concatenate, Generic, Never, ParamSpec, TypeGuard, TypeVar, overload

import optree
import torch
from torch import nn

from . import (
    _axes,
    _compile,
    _devices,
    _distributed,
    _functional_call,
    _gather,
    _pool,
    _random,
    _scatter,
    _split,
    _tree,
)

__all__ = ["pmap", "Pmapped"]

P = ParamSpec("P")
R = TypeVar("R")
# A bound method's: what is left of a pmapped function's parameters after the instance.
_BoundP = ParamSpec("_BoundP")
_BoundR = TypeVar("_BoundR")
_Instance = TypeVar("_Instance")

# What a pmapped module takes first: its parameters and buffers, as for functional_call.
_ModuleParams = dict[str, Any] | Sequence[dict[str, Any]]


class _Plan:
    """What one input structure needs: the axis of every leaf."""

    __slots__ = ("axes", "all_zero")

    def __init__(self, axes: list[Any]) -> None:
        self.axes = axes
        self.all_zero = _axes.all_zero(axes)


class Pmapped(Generic[P, R]):
    """A function mapped over devices by :func:`pmap`; call it like the original.

    Made by :func:`pmap`, whose ``Args`` are its options (the constructor is not public API).
    ``devices`` and ``output_device`` are resolved and checked on first use.

    Examples:
        >>> import torch, fdp
        >>> double = fdp.pmap(lambda x: 2 * x, devices=["cpu", "cpu"])
        >>> double.devices, double.output_device
        ((device(type='cpu'), device(type='cpu')), device(type='cpu'))
    """

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        in_axes: Any,
        out_axes: Any,
        axis_name: Hashable | None,
        devices: Sequence[_devices.DeviceLike] | None,
        output_device: _devices.DeviceLike | None,
        static_argnums: int | Sequence[int],
        split: _split.SplitRule,
        check_unmapped_outputs: bool,
        compile: bool | Mapping[str, Any] = False,
    ) -> None:
        if not callable(fn):
            raise TypeError(_not_callable_message(fn))
        self.fn = fn
        self.is_module = isinstance(fn, nn.Module)
        self._caller = _caller_of(fn)
        what = self._caller
        if (deferred := _deferred_body_message(fn, what)) is not None:
            raise TypeError(deferred)
        self.in_axes = _axes.check_spec(in_axes, what="in_axes", caller=what, list_as_tuple=True)
        self.out_axes = _axes.check_spec(out_axes, what="out_axes", caller=what, per_replica=True)
        self.axis_name = axis_name
        self.split = _split.check_split(split, what=f"{what} split")
        self._devices_arg = (
            None
            if devices is None
            else _devices.resolve_devices(devices, what=f"{what} devices", check=False)
        )
        self._output_device_arg = (
            None
            if output_device is None
            else _devices.parse_device(output_device, what=f"{what} output_device")
        )
        argnums: tuple[Any, ...]
        try:
            argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        except TypeError:  # not iterable (None, a float): said below, not as tuple() says it
            argnums = (static_argnums,)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in argnums):
            raise TypeError(
                f"{what}: static_argnums must be an int or a sequence of ints, got "
                f"{type(static_argnums).__name__}: {_tree.short_repr(static_argnums)}"
            )
        self.static_argnums = argnums
        self.check_unmapped_outputs = _tree.check_flag(
            check_unmapped_outputs, f"{what}: check_unmapped_outputs"
        )
        self._compile_options = compile
        # For wrappers built on pmap (fdp.DataParallel): how errors name the call and the inputs.
        self.rename_paths: Callable[[str], str] | None = None
        # ... and what to do about an argument the replicas modified in place.
        self.in_place_advice: str | None = None
        # ... and the part of a replica's output that is the user's, for messages that show its
        # structure (fdp.DataParallel's replicas return (output, state)).
        self.user_output: Callable[[Any], Any] | None = None
        self._start_afresh()
        if not self.is_module:
            # updated=(): copying fn.__dict__ could overwrite this object's own attributes.
            functools.update_wrapper(self, fn, updated=())  # type: ignore[arg-type]

    def _start_afresh(self) -> None:
        """Sets up what calls learn and keep: caches, the lone replica's runner, timings, and
        with compile the compiled function."""
        # With compile: what every replica calls, compiled once and shared by the replicas: fn,
        # or for a module a functional call into a private skeleton of it (made outside the
        # compiled code, so that graph breaks in forward swap tensors into no shared module).
        self._compiled = _compile.compiled(
            _compile.own_code(_functional_call.swapped_call) if self.is_module else self.fn,
            self._compile_options,
            what=self._caller,
        )
        self._resolved: tuple[tuple[torch.device, ...], torch.device] | None = None
        self._lone: _pool.LoneReplica | None = None  # with the devices: one replica's runner
        # Whether the last call's lone replica needed the arguments' exact structure (trees
        # rebuilt with resident values, or the general path): the next call then flattens
        # exactly from the start, not along the last structure first.
        self._lone_exact = False
        self._inputs = _tree.LastStructure()  # calls mostly repeat one argument structure
        self._plans: _tree.SpecCache[_Plan] = _tree.SpecCache()
        self._out_plans: _tree.SpecCache[_gather.OutputPlan] = _tree.SpecCache()
        self._outputs = _tree.LastStructure()  # replica 0's outputs, with their plan kept
        self._timing = _pool.Timing()  # how long replicas run: small ones run inline
        # When the replicas of the compiled function must take turns (while dynamo compiles).
        self._turns = _compile.Turns() if self._compiled is not None else None

    # A copy (copy.deepcopy, pickle, torch.save of a module holding one: an EMA twin of an
    # fdp.DataParallel model, a checkpoint) takes the configuration, not what calls learned,
    # which holds locks and compiled code.
    _LEARNED = (
        "_compiled", "_resolved", "_lone", "_lone_exact", "_inputs", "_plans", "_out_plans",
        "_outputs", "_timing", "_turns",
    )  # fmt: skip

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._LEARNED:
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("user_output", None)  # (saved before it was kept)
        self.__dict__.update(state)
        self._start_afresh()

    def __reduce_ex__(self, protocol: Any) -> str | tuple[Any, ...]:
        # A function decorated with @fdp.pmap pickles as what its module's name refers to,
        # itself, as functions do (its fn, under that name too, could not be found by name).
        qualname = getattr(self, "__qualname__", None)  # from fn (a module has none)
        module = sys.modules.get(getattr(self, "__module__", ""))
        if qualname is not None and module is not None:
            try:
                found = functools.reduce(getattr, qualname.split("."), module)
            except AttributeError:
                found = None
            if found is self:
                return qualname
        return super().__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return f"<{self._caller} in_axes={self.in_axes!r} out_axes={self.out_axes!r}>"

    # Typed so that a checker binds a decorated method as Python does: the instance takes the
    # first parameter, and the bound method has the others (with Any, every call went unchecked).
    @overload
    def __get__(self, instance: None, owner: type | None = None) -> Pmapped[P, R]: ...

    @overload
    def __get__(
        self: Pmapped[Concatenate[_Instance, _BoundP], _BoundR],
        instance: _Instance,
        owner: type | None = None,
    ) -> Callable[_BoundP, _BoundR]: ...

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        # Lets @fdp.pmap decorate methods: the instance becomes the first positional argument,
        # mapped by in_axes as any other (in_axes=(None, ...) gives every replica all of it; a
        # dataclass instance holding tensors under an int axis is split, as jax.pmap would).
        # A pmapped module is not a function but a module: kept as a class attribute, it is
        # called as it is, as the module would be (nn.Module binds to nothing).
        if instance is None or self.is_module:
            return self
        return functools.partial(self, instance)

    @property
    def axis_name(self) -> Hashable | None:
        """The name by which collectives in the mapped function refer to the mapped axis."""
        return self._axis_name

    @axis_name.setter
    def axis_name(self, axis_name: Hashable | None) -> None:
        try:
            hash(axis_name)
        except TypeError:
            raise TypeError(f"{self._caller}: axis_name must be hashable, got {axis_name!r}") from None
        self._axis_name = axis_name
        # A lone replica's runner is built with the name: built again on the next call.
        self._resolved = self._lone = None

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The devices the replicas run on (resolved and checked on first use)."""
        return self._devices_and_output()[0]

    @property
    def output_device(self) -> torch.device:
        """Where outputs are gathered."""
        return self._devices_and_output()[1]

    def _devices_and_output(self) -> tuple[tuple[torch.device, ...], torch.device]:
        if self._resolved is None:
            what = self._caller
            if self._devices_arg is None:
                devices = _devices.default_devices()
            else:
                devices = tuple(
                    _devices.check_available(d, what=f"{what} devices[{i}]", replica=True)
                    for i, d in enumerate(self._devices_arg)
                )
            output = (
                devices[0]
                if self._output_device_arg is None
                else _devices.check_available(self._output_device_arg, what=f"{what} output_device")
            )
            if len(devices) == 1 and devices[0].type in ("cpu", "cuda"):
                self._lone = _pool.LoneReplica(devices[0], axis_name=self.axis_name, caller=what)
            self._resolved = (devices, output)
        return self._resolved

    # --- one call ------------------------------------------------------------------------------

    # Inside code that torch.compile compiles, a call is a graph break and runs eagerly, all of
    # it: dynamo cannot trace the threads, locks and optree structures a call uses.
    @_compile.eager_under_compile
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        caller = self._caller
        try:
            # A call inside a replica is refused by the lone runner (one thread-local read) or
            # before the scatter.
            if torch._C._functorch.peek_interpreter_stack() is not None:
                raise _pool.under_transform_error(
                    caller,
                    inside="the mapped function",
                    example="fdp.pmap(torch.func.grad(loss_fn))",
                    outputs="the pmapped function's output",
                )
            devices, output_device = self._devices_and_output()
            parts, roots, statics = self._parts(args, kwargs)
            lone = self._lone
            # A lone replica takes the argument trees as they are, with nothing rebuilt from
            # their structure, which may then be matched loosely (see _tree.LastStructure).
            leaves, treespec, plan, exact = self._arguments(
                parts, roots, exact=lone is None or self._lone_exact
            )
        except Exception as error:
            self._failed_before_running(error)
            raise
        # Under fdp.distributed a call that fails once it has passed its exchange of replica
        # counts is recorded, wherever it fails: the next call's exchange compares whether the
        # ranks' last calls failed (see _distributed.replica_counts).
        began = _distributed.calls() if self.axis_name is not None else -1
        try:
            row = None
            if lone is not None:
                row = _scatter.one_replica_row(leaves, plan.axes, lone.device, all_zero=plan.all_zero)
                if row is not None and row is not leaves and not exact:
                    # Resident state: the trees are rebuilt with each PerReplica's value, from their
                    # exact structure (a loose match may hold another call's containers).
                    leaves, treespec, plan, exact = self._arguments(parts, roots, exact=True)
                    row = _scatter.one_replica_row(leaves, plan.axes, lone.device, all_zero=plan.all_zero)
                self._lone_exact = row is not leaves
            if lone is not None and row is not None:
                # One replica that scattering would hand every tensor unchanged: it runs on the
                # argument trees as they are (or rebuilt with the resident values), with no general
                # scatter. Around a step of a millisecond, the skipped work would be measurable.
                tree = parts if row is leaves else _tree.unflatten(treespec, row)
                outputs = [lone(self._call_replica, tree, statics)]
                run_on: tuple[torch.device, ...] = devices
            else:
                if not exact:  # the trees are rebuilt from the structure: exactly
                    leaves, treespec, plan, _ = self._arguments(parts, roots, exact=True)
                outputs, run_on = self._scatter_and_run(
                    leaves, treespec, plan, devices, parts, roots, statics
                )
            result = _gather.gather_outputs(
                outputs,
                output_device,
                self.out_axes,
                caller=caller,
                check=self.check_unmapped_outputs,
                plans=self._out_plans,
                structure=self._outputs,
                devices=run_on,
                inputs=leaves,
                rename=self.rename_paths,
                user_output=self.user_output,
            )
            if self.check_unmapped_outputs and began >= 0 and _distributed.calls() != began:
                # The other processes' replicas too, as one process running them all would.
                self._check_unmapped_across_processes(outputs[0])
            return result
        except BaseException as error:
            if began >= 0:
                _distributed.call_failed(error, began)
            raise

    def _check_unmapped_across_processes(self, output: Any) -> None:
        """Under fdp.distributed, with ``check_unmapped_outputs``: that every process's replicas
        returned what this one's did where ``out_axes`` is ``None`` (this process's replicas
        agree: gather_outputs checked them), a ``ValueError`` on every rank otherwise."""
        paths, values, _ = _tree.flatten_with_paths(output, "output")
        axes = _axes.leaf_axes(
            self.out_axes, output, what="out_axes", tree_name="the output", caller=self._caller
        )
        unmapped = [
            (self.rename_paths(path) if self.rename_paths is not None else path, value)
            for path, value, axis in zip(paths, values, axes)
            if axis is _axes.BROADCAST and isinstance(value, torch.Tensor)
        ]
        _distributed.check_same(unmapped, self._caller)

    def _failed_before_running(self, error: BaseException) -> None:
        """A call that failed before its exchange of replica counts (bad arguments, devices this
        process lacks, an empty share of the batch): under fdp.distributed, with an axis name, it
        counts as a call all the same, and the other processes, waiting in that exchange, learn
        of the failure at once rather than at the timeout (see _distributed.skip_call)."""
        if self.axis_name is not None:
            _distributed.skip_call(error)

    def _arguments(
        self, parts: tuple[Any, ...], roots: tuple[str, ...], *, exact: bool
    ) -> tuple[list[Any], optree.PyTreeSpec, _Plan, bool]:
        """The argument trees' leaves and structure (along the last call's where they repeat
        it), the structure's plan, and whether the structure is surely theirs (see
        :meth:`_tree.LastStructure.flatten`)."""
        try:
            leaves, treespec, plan, exact = self._inputs.flatten(parts, exact=exact)
        except _tree.UnplacedError as err:  # said where it was found: in which argument
            raise err.at(self._caller, parts, roots, self.rename_paths) from None
        if plan is None:  # a structure other than the last call's
            plan = self._plans.get(treespec)
            if plan is None:
                plan = self._plans[treespec] = self._make_plan(parts, roots, treespec)
            self._inputs.keep(treespec, plan)
        return leaves, treespec, plan, exact

    def _scatter_and_run(
        self,
        leaves: list[Any],
        treespec: optree.PyTreeSpec,
        plan: _Plan,
        devices: tuple[torch.device, ...],
        parts: tuple[Any, ...],
        roots: tuple[str, ...],
        statics: dict[int, Any],
    ) -> tuple[list[Any], tuple[torch.device, ...]]:
        """The general path: one shard per replica, run on the pool. Returns the replicas'
        outputs and the devices of the replicas that ran."""
        caller = self._caller
        _pool.ensure_not_in_replica(caller)  # before any copy to a device
        if len(devices) > 1:  # (one device runs its replica in this thread, as a plain call)
            _pool.ensure_not_traced(
                caller,
                advice="Trace it on one device (a single replica runs in the calling thread, "
                "where it is traced), or trace inside the mapped function",
            )
        try:
            scattered = _scatter.scatter_leaves(
                leaves,
                plan.axes,
                devices,
                self.split,
                caller=caller,
                paths=lambda: self._paths(parts, roots),
                all_zero=plan.all_zero,
                # Compiled replicas keep the shared tensors themselves: dynamo reads the .grad
                # of every tensor input, which for an alias (not a leaf) warns on each compile.
                share=self._compiled is None,
            )
        except Exception as error:
            self._failed_before_running(error)
            raise
        n = len(scattered.devices)
        replicas = [
            functools.partial(self._call_replica, _tree.unflatten(treespec, row), statics)
            for row in scattered.leaves
        ]
        versions = [[_version(t) for t in copies] for _, copies in scattered.shared] if n > 1 else None

        def run(take_turns: bool = False) -> list[Any]:
            return _pool.run_replicas(
                scattered.devices,
                replicas,
                axis_name=self.axis_name,
                caller=caller,
                inputs=[[t for t in row if isinstance(t, torch.Tensor)] for row in scattered.leaves]
                if any(d.type == "cuda" for d in scattered.devices)
                else None,
                timing=None if take_turns else self._timing,  # turns: no time of a replica's own
                take_turns=take_turns,
            )

        if self._turns is None or _random.active_depth():
            # In fdp.rng_scope every replica runs in a scope of its own, where nothing compiles
            # (see _call_replica): no turns to take, and none to learn from.
            outputs = run()
        else:
            outputs = self._turns.run(
                run,
                treespec=treespec,
                leaves=leaves,
                axes=plan.axes,
                sizes=scattered.sizes,
                statics=statics,
                module=self.fn if self.is_module else None,  # type: ignore[arg-type]
            )
        if versions is not None:
            self._check_unmodified(scattered, versions, parts, roots)
        return outputs, scattered.devices

    def _paths(self, parts: tuple[Any, ...], roots: tuple[str, ...]) -> list[str]:
        """Every input leaf's key path, for messages (``rename_paths`` may rewrite them)."""
        paths = [p for part, root in zip(parts, roots) for p in _tree.flatten_with_paths(part, root)[0]]
        return [self.rename_paths(p) for p in paths] if self.rename_paths is not None else paths

    def _parts(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], tuple[str, ...], dict[int, Any]]:
        """The argument trees to scatter, their names in messages, and the static arguments."""
        if self.is_module:
            if not args:
                raise TypeError(
                    f"{self._caller} takes the module's parameters and buffers as its first "
                    "argument: pmapped_model(params, *args, **kwargs), params as in "
                    "dict(model.named_parameters()) | dict(model.named_buffers())"
                )
            head = args[0]
            # What torch.func.functional_call takes: a dict, or a sequence of dicts. (One type
            # test on the usual call; anything else would fail in every replica, in torch's
            # words, naming neither this call nor the argument.)
            if type(head) is not dict and not isinstance(head, (dict, list, tuple)):
                if isinstance(head, torch.Tensor):
                    got = f"a tensor of type {_tree.describe(head)}"
                elif head is self.fn:
                    got = f"the module itself ({type(head).__name__})"
                elif isinstance(head, nn.Module):
                    got = f"a module ({type(head).__name__})"
                else:
                    got = f"{type(head).__name__}: {_tree.short_repr(head)}"
                raise TypeError(
                    f"{self._caller} takes the module's parameters and buffers as its first "
                    f"argument (params, a dict of tensors by name), but got {got} there: call it "
                    "as pmapped_model(params, *args, **kwargs), with params as in "
                    "dict(model.named_parameters()), or pmapped_model({}, x) for the module's own"
                )
            head, args = (_complete_state(self.fn, args[0]),), args[1:]  # type: ignore[arg-type]
        statics: dict[int, Any] = {}
        if self.static_argnums:
            for i in self.static_argnums:
                position = i + len(args) if i < 0 else i
                if not 0 <= position < len(args):
                    # As jax.pmap does: a static argument passed by keyword would otherwise be
                    # mapped along dim 0 like any keyword argument, its tensors split over the
                    # replicas, silently. (One left to its default is refused alike, as there.)
                    given = f"only {len(args)} positional argument{'s' if len(args) != 1 else ''}"
                    raise ValueError(
                        f"{self._caller} has static_argnums={self.static_argnums!r}, but entry "
                        f"{i} names no positional argument: this call passes {given}"
                        f"{' after params' if self.is_module else ''}. Pass static arguments "
                        "positionally (keyword arguments are mapped along dim 0)."
                    )
                value = args[position]
                try:
                    hash(value)
                except TypeError as err:
                    raise TypeError(
                        f"{self._caller}: static arguments must be hashable, but static_argnums "
                        f"entry {i} is args[{position}] of type {type(value).__name__}: "
                        f"{_tree.short_repr(value)} ({err})"
                    ) from None
                statics[position] = value
            # Static positions stay as None (an empty subtree) so key paths keep their indices.
            args = tuple(None if k in statics else a for k, a in enumerate(args))
        # No keyword arguments: None (an empty subtree) rather than an empty dict, whose
        # structure _tree.LastStructure could not follow along (it is a dict).
        keywords = kwargs or None
        if self.is_module:
            return (head[0], args, keywords), ("params", "args", "kwargs"), statics
        return (args, keywords), ("args", "kwargs"), statics

    def _static_positions(self, count: int) -> set[int]:
        """The positions of the static arguments among ``count`` positional ones (negative
        ``static_argnums`` counted from the end)."""
        return {i + count if i < 0 else i for i in self.static_argnums}

    def _make_plan(
        self, parts: tuple[Any, ...], roots: tuple[str, ...], treespec: optree.PyTreeSpec
    ) -> _Plan:
        in_axes = self.in_axes
        args = parts[-2]
        # jax.pmap reads in_axes[i] for each non-static argument i only, so a tuple there may
        # stop before trailing static arguments: in_axes=(0,) with static_broadcasted_argnums=1
        # runs. (A static argument before a mapped one still needs its entry, there as here.)
        if (
            isinstance(in_axes, tuple)
            and len(in_axes) < len(args)
            and self.static_argnums
            and self._static_positions(len(args)).issuperset(range(len(in_axes), len(args)))
        ):
            in_axes = in_axes + (_axes.BROADCAST,) * (len(args) - len(in_axes))
        if isinstance(in_axes, tuple) and len(in_axes) == len(args) and self.static_argnums:
            in_axes = tuple(_axes.BROADCAST if a is None else ax for a, ax in zip(args, in_axes))
        axes: list[Any] = []
        for part, root in zip(parts, roots):
            if root == "params":
                spec: Any = _axes.BROADCAST
            elif root == "kwargs":
                spec = 0  # keyword arguments are always mapped along dim 0, as in jax.pmap
            else:
                spec = in_axes
            try:
                part_axes = _axes.leaf_axes(
                    spec,
                    part,
                    what="in_axes",
                    caller=self._caller,
                    tree_name=f"the tuple of positional arguments ({len(part)} given)"
                    if root == "args"
                    else root,
                )
            except ValueError as err:
                hint = self._in_axes_hint(spec, part, parts[-1]) if root == "args" else None
                if hint is not None:
                    raise ValueError(f"{err.args[0]}\n{hint}") from None
                raise
            axes.extend(part_axes)
        packed = _tree.packed_sequence_path(parts, roots, axes, treespec)
        if packed is not None:
            # Split field by field, a PackedSequence gives every replica garbage, or fails with
            # "inconsistent sizes" that names its fields, not what to do instead. Refused here,
            # with the structure, on one device too: there the lone path would run one that
            # happens to pass its checks (a single sorted sequence, whose fields agree in
            # length), and code tried on one device must fail as on several.
            path = packed if self.rename_paths is None else self.rename_paths(packed)
            raise TypeError(_scatter.packed_sequence_message(self._caller, path))
        return _Plan(axes)

    def _in_axes_hint(self, spec: Any, args: tuple[Any, ...], keywords: dict[str, Any] | None) -> str | None:
        """What the user likely meant by an ``in_axes`` that is no prefix of the positional
        arguments, where it can be told (the mistakes of jax.pmap's issues #6302 and #26950)."""
        if keywords and isinstance(spec, tuple) and len(spec) > len(args):
            # An argument meant for an in_axes entry was passed by keyword (as in jax.pmap,
            # in_axes covers the positional arguments only).
            return (
                f"Keyword arguments {sorted(keywords)} are not covered by in_axes (they are mapped "
                "along dim 0): pass the arguments that in_axes describes positionally."
            )
        if isinstance(spec, tuple) and len(spec) == len(args) - 1 and self._bound_to(args[0]):
            # A method: bound, its instance is the first positional argument, with an entry of
            # its own (as in jax.pmap), where one per parameter after self was written.
            return (
                f"{self._caller} is a method: its instance is the first positional argument, "
                f"which in_axes describes too, as in jax.pmap: in_axes={(_axes.BROADCAST, *spec)!r} "
                "gives every replica all of it"
            )
        static = self._static_positions(len(args))
        if static and isinstance(spec, tuple) and len(spec) == len(args) - len(static):
            # One entry per argument but the static ones: as in jax.pmap, those before a mapped
            # one have entries too (those after the last may go without: see _make_plan).
            entries = iter(spec)
            full = tuple(_axes.BROADCAST if k in static else next(entries) for k in range(len(args)))
            return (
                "in_axes has an entry for every positional argument up to the last mapped one, the "
                f"static ones among them included (static_argnums={self.static_argnums!r}; their "
                f"entries are not used), as in jax.pmap: in_axes={full!r}"
            )
        if len(args) == 1 and not isinstance(spec, int) and spec is not _axes.BROADCAST:
            # One argument's specification, not wrapped in the tuple of the positional
            # arguments (a dict for a dict argument; a tuple for a tuple; a top-level list,
            # which in_axes reads as that tuple, for a list).
            candidates = [(spec,), *([(list(spec),)] if isinstance(spec, tuple) else [])]
            for candidate in candidates:
                try:
                    _axes.leaf_axes(candidate, args, what="in_axes", tree_name="", caller="")
                except ValueError:
                    continue
                return (
                    "in_axes describes the tuple of positional arguments, as in jax.pmap: for "
                    f"one argument, wrap its specification in a tuple: in_axes={candidate!r}"
                )
        return None

    def _bound_to(self, first: Any) -> bool:
        """Whether ``first`` is an instance of a class that holds this function as a method
        (whose call therefore got it from :meth:`__get__`)."""
        name = getattr(self, "__name__", None)  # from fn (a module has none)
        try:
            return name is not None and getattr(type(first), name, None) is self
        except Exception:  # noqa: BLE001 - whatever a class's own attribute lookup raises
            return False

    def _call_replica(self, tree: tuple[Any, ...], statics: dict[int, Any]) -> Any:
        args, kwargs = tree[-2], tree[-1] or {}
        if statics:
            args = tuple(statics.get(k, a) for k, a in enumerate(args))
        compiled = self._compiled
        if compiled is not None and torch._C._len_torch_dispatch_stack():
            # Under a TorchDispatchMode (fdp.rng_scope around the call, which every replica
            # then runs in) dynamo compiles nothing, and marks the function's code to be run
            # uncompiled for good: later calls outside the mode would never compile. The plain
            # function runs as eagerly, and leaves the compiled one to those calls.
            compiled = None
        if compiled is not None:
            _compile.cudagraph_trees_ready()  # a worker's thread, on torch < 2.13
        if not self.is_module:
            output = (compiled or self.fn)(*args, **kwargs)
        elif compiled is None:
            output = _functional_call.functional_call(self.fn, tree[0], args, kwargs)  # type: ignore[arg-type]
        else:
            with _functional_call.private_module(self.fn) as module:  # type: ignore[arg-type]
                output = compiled(module, tree[0], args, kwargs)
        if type(output) in _tree.DEFERRED_TYPES:
            # A generator or a coroutine (from a function that hides its kind: a lambda or a
            # wrapper around one) holds the replica's work, which would run after the call,
            # outside the replica. Refused in the replica, on any number of replicas.
            self._refuse_deferred(output)
        return output

    def _refuse_deferred(self, output: Any) -> None:
        reason = _tree.deferred_reason(output)
        close = getattr(output, "close", None)
        if close is not None:
            close()  # never run: a coroutine must not warn later that it was never awaited
        raise TypeError(f"{self._caller}: the mapped function {reason}")

    def _check_unmodified(
        self,
        scattered: _scatter.Scattered,
        versions: list[list[int]],
        parts: tuple[Any, ...],
        roots: tuple[str, ...],
    ) -> None:
        for (k, copies), before in zip(scattered.shared, versions):
            if any(_version(t) != v for t, v in zip(copies, before)):
                if _counter_shared_with_a_shard(scattered, copies):
                    continue  # perhaps a shard's own update (see there): nothing to blame
                paths = self._paths(parts, roots)
                advice = self.in_place_advice
                if advice is None and self.is_module and paths[k].startswith("params"):
                    # A pmapped module's tensors: its caller cannot return new values for them
                    # (the module's forward is the whole mapped function), so say what can.
                    # For a parameter (an nn.Embedding with max_norm renormalizes the rows it
                    # looks up, in either mode) the advice for buffers would mislead: evaluation
                    # mode changes nothing, and fdp.DataParallel refuses it too.
                    changed = [leaf for part in parts for leaf in _tree.flatten(part)[0]][k]
                    names = {n for n, _ in self.fn.named_parameters(remove_duplicate=False)}  # type: ignore[attr-defined]
                    given = parts[0].items() if isinstance(parts[0], dict) else ()
                    advice = (
                        _MODULE_PARAMETER_IN_PLACE_ADVICE
                        if any(v is changed and name in names for name, v in given)
                        else _MODULE_IN_PLACE_ADVICE
                    )
                raise RuntimeError(
                    f"{self._caller}: the replicas modified {paths[k]} in place, but it is "
                    f"replicated (axis None) over {len(copies)} replicas, which share it on one "
                    "device or hold copies of it on others: the updates race or are lost. "
                    + (
                        advice
                        or "Return the new value instead (for BatchNorm statistics, pass the buffers "
                        "in and return the updated ones), or map the argument."
                    )
                )


# What a pmapped module that changes its own tensors (BatchNorm's running statistics in training
# mode) can do instead: it returns only forward's output, so "return the new value" is no advice.
_MODULE_IN_PLACE_ADVICE = (
    "A pmapped module returns only its forward's output, so it cannot hand back new values of "
    "its tensors (BatchNorm's running statistics in training mode, fdp.SyncBatchNorm's too): call it in "
    "evaluation mode; or use fdp.DataParallel(model, device_ids=...), whose replicas each update "
    "a copy of the buffers, written back after the call (give it axis_name= for fdp.SyncBatchNorm "
    "layers); or pmap a function that calls the module with fdp.stateful_call(model, params, "
    "buffers, args) and returns the new buffers with its output."
)

# What a pmapped module whose forward changes one of its parameters in place can do instead.
_MODULE_PARAMETER_IN_PLACE_ADVICE = (
    "It is one of the module's parameters, which its forward changes (an nn.Embedding with "
    "max_norm renormalizes the rows it looks up, in either mode): change parameters outside "
    "forward (after the optimizer step, under torch.no_grad()), or run such a module on one device."
)


def _complete_state(module: nn.Module, params: Any) -> Any:
    """``params`` plus the module's own parameters and buffers that it does not name.

    torch.func.functional_call would take those from the module object itself, shared by all
    replicas: here they become replicated inputs like the rest (moved to each replica's device,
    and checked for in-place updates). Names tied to a given one are left out (tie_weights).
    """
    if not isinstance(params, dict):
        return params
    groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ):
        groups.setdefault(id(tensor), []).append((name, tensor))
    missing = {
        name: tensor
        for group in groups.values()
        if not any(name in params for name, _ in group)
        for name, tensor in group[:1]
    }
    return {**missing, **params} if missing else params


def _counter_shared_with_a_shard(scattered: _scatter.Scattered, copies: list[torch.Tensor]) -> bool:
    """Whether a replicated input's change of version may be a mapped input's shard's: views
    of one tensor share its counter, so ``f(data[:, :2], data[0, 2:])`` with the second
    replicated bumps it when a replica updates its own shard of the first in place (which is
    allowed). Only where the replicated input shares no byte with those shards: where it does
    (``f(x, x)``), a shard's update changes it under the replicas too. (A change of a
    byte-disjoint replicated view itself then goes unseen: the counter cannot tell them apart.
    Only looked at once a change is seen.)"""
    shared = {k for k, _ in scattered.shared}
    shards: dict[int, list[torch.Tensor]] = {}
    for row in scattered.leaves:
        for j, t in enumerate(row):
            if j not in shared and isinstance(t, torch.Tensor):
                shards.setdefault(id(_root(t)), []).append(t)
    for t in copies:
        same = shards.get(id(_root(t)))
        if same is not None and not _shares_bytes(t, same):
            return True
    return False


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter ``t`` uses: its base if it is a view."""
    return t if t._base is None else t._base


def _shares_bytes(t: torch.Tensor, others: list[torch.Tensor]) -> bool:
    """Whether ``t`` shares a byte of memory with any of ``others`` (views of its storage),
    exactly, strides and all: a mark per byte of the storage (a rare path, see above)."""
    marks = torch.zeros(t.untyped_storage().nbytes(), dtype=torch.bool, device=t.device)

    def covered(v: torch.Tensor) -> torch.Tensor:
        size = v.element_size()
        return marks.as_strided(
            (*v.shape, size), (*(s * size for s in v.stride()), 1), v.storage_offset() * size
        )

    for other in others:
        covered(other).fill_(True)
    return bool(covered(t).any())


def _version(t: torch.Tensor) -> int:
    # Inference tensors keep no version counter; they cannot be modified outside inference mode.
    return -1 if t.is_inference() else t._version


def _caller_of(fn: Callable[..., Any]) -> str:
    """How messages name a pmapped function: ``fdp.pmap(name)``, a module by its class."""
    name = type(fn).__name__ if isinstance(fn, nn.Module) else getattr(fn, "__qualname__", None)
    return f"fdp.pmap({name or type(fn).__name__})"


def _deferred_body_message(fn: Callable[..., Any], caller: str) -> str | None:
    """Why ``fn`` cannot be mapped, where it is a generator or coroutine function (a module's
    ``forward`` too): calling it runs none of its body, which would run after the call, as the
    caller iterates or awaits what it returned, outside every replica."""
    module = isinstance(fn, nn.Module)
    target = type(fn).forward if isinstance(fn, nn.Module) else fn  # (isinstance: for mypy)
    if inspect.isasyncgenfunction(target):
        what = "an asynchronous generator function (async def with yield)"
        when = "the asynchronous generator it returns is iterated with async for"
    elif inspect.iscoroutinefunction(target):
        what, when = "a coroutine function (async def)", "the coroutine it returns is awaited"
    elif inspect.isgeneratorfunction(target):
        what, when = "a generator function", "the generator it returns is iterated"
    else:
        return None
    if module and what == "a generator function":
        advice = "Have forward return the values themselves (a tensor, or a list or tuple of them)"
    elif what == "a generator function":
        name = getattr(fn, "__name__", "f")
        name = name if name.isidentifier() else "f"  # (a partial has no name)
        advice = (
            "Map a function that returns the values themselves (a tensor, or a list or tuple of "
            f"them), e.g. lambda *args: list({name}(*args))"
        )
    else:
        advice = f"Map a plain function (def): {_tree.NOT_ON_AN_EVENT_LOOP}"
    return (
        f"{caller}: {'its forward' if module else 'the function'} is {what}, whose body runs only "
        f"as {when}: after the pmapped call, in the caller's thread, outside every replica (with "
        f"no replica index, axis or device of its own). {advice}"
    )


def _not_callable_message(fn: Any) -> str:
    """Why ``fn``, not callable, cannot be pmapped, and what was likely meant."""
    got = f"fdp.pmap: fn must be callable, got {type(fn).__name__}: {_tree.short_repr(fn)}"
    if isinstance(fn, str):
        # @fdp.pmap("i"): an axis name where the function goes. (jax.pmap's decorator with an
        # axis name is @functools.partial(jax.pmap, axis_name="i"), which works here as well.)
        return (
            f"{got}. fdp.pmap takes the function first and the axis name second, as jax.pmap "
            f"does: fdp.pmap(f, {fn!r}); as a decorator, @fdp.pmap(axis_name={fn!r}) (or "
            f"@functools.partial(fdp.pmap, axis_name={fn!r}))"
        )
    # Most often an option passed positionally, @fdp.pmap(0) for in_axes=0 (torch.vmap's
    # in_dims is its second parameter): all but axis_name are keyword-only.
    return (
        f"{got}. fdp.pmap's options other than axis_name are keyword-only: fdp.pmap(f, "
        "in_axes=0, ...), or as a decorator @fdp.pmap(in_axes=0, ...)"
    )


def _axes_as_axis_name(axis_name: Any) -> TypeGuard[tuple[Any, ...] | list[Any]]:
    """Whether ``axis_name`` is a tuple or list of ints and Nones (nested ones too), which is an
    ``in_axes`` specification rather than a name: what ``fdp.pmap(f, (0, None))`` passes, in
    torch.vmap's habit (its second parameter is ``in_dims``), now that the second parameter is
    the axis name, as in ``jax.pmap``. As a name it would bind no collective that anyone writes,
    and ``in_axes`` would stay 0, splitting the argument meant to go whole to every replica."""
    if not isinstance(axis_name, (tuple, list)) or not axis_name:
        return False
    return all(
        _axes_as_axis_name(a) if isinstance(a, (tuple, list)) else a is None or type(a) is int
        for a in axis_name
    )


# Options of jax.pmap, torch.vmap and nn.DataParallel that fdp.pmap spells otherwise or does
# without, by name: (whose option it is, what fdp.pmap takes instead). Ported code passes them,
# and Python's "got an unexpected keyword argument" does not say what to write.
_FOREIGN_OPTIONS = {
    "static_broadcasted_argnums": ("jax.pmap's", "fdp.pmap's is static_argnums"),
    "donate_argnums": (
        "jax.pmap's",
        "fdp.pmap donates no argument; the reductions take donate=True for the value they "
        "reduce: fdp.pmean(grads, 'i', donate=True)",
    ),
    "axis_size": (
        "jax.pmap's",
        "the replicas are the batch's shards, at most one per device (fdp.axis_size(axis_name) "
        "counts them inside the function)",
    ),
    "backend": ("jax.pmap's", "name the devices: devices=['cuda:0', 'cuda:1'], or ['cpu', 'cpu']"),
    "global_arg_shapes": ("jax.pmap's", "fdp.pmap needs no shapes: the arguments are split as they come"),
    "in_dims": ("torch.vmap's", "fdp.pmap's is in_axes, as jax.pmap's"),
    "out_dims": ("torch.vmap's", "fdp.pmap's is out_axes, as jax.pmap's"),
    "device_ids": ("nn.DataParallel's", "fdp.pmap's is devices (fdp.DataParallel takes device_ids)"),
    "dim": (
        "nn.DataParallel's",
        "fdp.pmap splits along in_axes and joins along out_axes (fdp.DataParallel takes dim)",
    ),
}


# First, for @functools.partial(fdp.pmap, axis_name="i"), JAX's decorator: mypy's partial plugin
# skips overloaded functions, and typeshed's partial then returns what the first overload returns,
# whatever function the partial decorates. From the module's overload, every call of a function
# so decorated was refused (it expected the parameters first). This overload, which no argument
# matches (no value is a Never), types it Any: unchecked, but nothing refused. Not Pmapped[...,
# Any]: bound as a method, mypy takes *args away with the instance, and refuses the arguments.
@overload
def pmap(
    fn: Never,
    /,
    axis_name: Hashable | None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    devices: Sequence[_devices.DeviceLike] | None = None,
    output_device: _devices.DeviceLike | None = None,
    static_argnums: int | Sequence[int] = (),
    split: _split.SplitRule = "chunk",
    check_unmapped_outputs: bool = False,
    compile: bool | Mapping[str, Any] = False,
) -> Any: ...


# A module before a function: nn.Module's __call__ takes anything, which would type the pmapped module's call
# as taking anything, where it takes the parameters and buffers first.
@overload
def pmap(
    fn: nn.Module,
    /,
    axis_name: Hashable | None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    devices: Sequence[_devices.DeviceLike] | None = None,
    output_device: _devices.DeviceLike | None = None,
    static_argnums: int | Sequence[int] = (),
    split: _split.SplitRule = "chunk",
    check_unmapped_outputs: bool = False,
    compile: bool | Mapping[str, Any] = False,
) -> Pmapped[Concatenate[_ModuleParams, ...], Any]: ...


@overload
def pmap(
    fn: Callable[P, R],
    /,
    axis_name: Hashable | None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    devices: Sequence[_devices.DeviceLike] | None = None,
    output_device: _devices.DeviceLike | None = None,
    static_argnums: int | Sequence[int] = (),
    split: _split.SplitRule = "chunk",
    check_unmapped_outputs: bool = False,
    compile: bool | Mapping[str, Any] = False,
) -> Pmapped[P, R]: ...


@overload
def pmap(
    fn: None = None,
    /,
    axis_name: Hashable | None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    devices: Sequence[_devices.DeviceLike] | None = None,
    output_device: _devices.DeviceLike | None = None,
    static_argnums: int | Sequence[int] = (),
    split: _split.SplitRule = "chunk",
    check_unmapped_outputs: bool = False,
    compile: bool | Mapping[str, Any] = False,
) -> Callable[[Callable[P, R]], Pmapped[P, R]]: ...


@_tree.naming_foreign_options("fdp.pmap", _FOREIGN_OPTIONS)
def pmap(
    fn: Callable[P, R] | None = None,
    /,
    axis_name: Hashable | None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    devices: Sequence[_devices.DeviceLike] | None = None,
    output_device: _devices.DeviceLike | None = None,
    static_argnums: int | Sequence[int] = (),
    split: _split.SplitRule = "chunk",
    check_unmapped_outputs: bool = False,
    compile: bool | Mapping[str, Any] = False,
) -> Pmapped[P, R] | Callable[[Callable[P, R]], Pmapped[P, R]]:
    """Maps ``fn`` over devices: splits the batch, runs one replica per device, joins the results.

    Each call scatters the arguments (split along ``in_axes``, moved to each replica's device),
    runs ``fn`` on every shard in parallel on persistent worker threads (one per device; the
    first replica runs in the calling thread), and gathers the outputs on ``output_device``
    (concatenated along ``out_axes``). Everything is differentiable: ``backward()`` on a loss of
    the output puts into the original tensors the gradient of the one-device computation, up
    to floating-point summation order. Usable as ``@fdp.pmap`` and as ``@fdp.pmap(...)``. As in
    ``jax.pmap``, the axis name may come second, positionally (``fdp.pmap(f, "i")``); the other
    options are keyword-only.

    Unlike ``jax.pmap`` the batch need not be a multiple of the device count, and there is no
    extra device axis: shards are pieces of the batch, as in ``nn.DataParallel``.

    Args:
        fn: the function to map, or an ``nn.Module``; a module is called as
            ``pmapped(params, *args, **kwargs)`` with ``params`` (names to parameters and
            buffers, as for :func:`torch.func.functional_call`) given whole to every replica
            and ``in_axes`` applying to ``args``. Default: ``None``, for ``@fdp.pmap(...)``: the
            call then returns a decorator, which maps the function it is given.
        axis_name: a name for the mapped axis, for collectives and :func:`fdp.axis_index`
            inside ``fn``; positional or keyword, as in ``jax.pmap``: ``fdp.pmap(f, "i")`` is
            ``fdp.pmap(f, axis_name="i")`` (as a decorator, ``@fdp.pmap(axis_name="i")``).
            Default: ``None``.
        in_axes: how each positional argument is mapped: an int (negative allowed) splits
            every tensor below it along that dim; ``None`` gives every replica the whole value
            on its device; a tuple with one entry per positional argument (or any tree prefix
            of the arguments) mixes them (as in ``jax.pmap``, it may stop before static
            arguments that come after the last mapped one). Keyword arguments are always split
            along dim 0. Non-tensor leaves reach every replica unchanged. Keyword-only.
            Default: ``0``.
        out_axes: a tree prefix of the output: an int concatenates the replicas' tensors along
            that dim on ``output_device`` (0-dim outputs are stacked into a vector, whose one
            dim only ``0`` or ``-1`` names); ``None`` returns the value of the replica on
            ``output_device`` (else the first replica's); :data:`fdp.PER_REPLICA` keeps every
            replica's value on its device, as :class:`fdp.PerReplica` leaves (resident state)
            in the output's containers (a ``TypeError`` names a node type that refuses them,
            checking its fields as it is built). Keyword-only. Default: ``0``.
        devices: where the replicas run: CUDA indices, strings, ``torch.device``s; duplicates
            allowed (``["cpu", "cpu"]`` is two replicas on the CPU). Keyword-only. Default:
            ``None``, all visible CUDA devices, else ``["cpu"]``.
        output_device: where outputs are gathered (``"cpu"`` allowed). Keyword-only. Default:
            ``None``, the first device.
        static_argnums: positional arguments passed unchanged to every replica (not scattered, not
            moved); they must be hashable and given positionally (as in ``jax.pmap``, an index past
            the call's positional arguments is a ``ValueError``: by keyword, the argument would be
            mapped). Negative indices count from the last. Keyword-only. Default: ``()``.
        split: ``"chunk"`` follows ``torch.chunk`` like ``nn.DataParallel`` (30 rows over 8 devices:
            4,4,4,4,4,4,4,2; 10 over 8: five replicas of 2); ``"balanced"`` gives sizes that differ
            by at most one and never an empty shard. Keyword-only. Default: ``"chunk"``.
        check_unmapped_outputs: check that outputs with ``out_axes`` ``None`` are equal on every
            replica, and raise ``ValueError`` if not; under :mod:`fdp.distributed`, on every
            replica of every process (one more small exchange per call, of a digest of each
            such output). Keyword-only. Default: ``False``.
        compile: compile what every replica runs with :func:`torch.compile`, once, shared by
            the replicas: ``True``, or a dict of ``torch.compile`` options (``backend``,
            ``mode``, ``dynamic``, ...). The first call compiles; collectives are graph breaks
            (they run eagerly between two graphs); a module is called through
            :func:`torch.func.functional_call` on a private copy of its structure, so graph
            breaks in its ``forward`` are safe. While dynamo compiles (the first call, new
            input shapes, ...), the replicas take turns between collectives, so that each
            piece is compiled once rather than once per replica. See ``docs/concepts.md`` for
            when it pays. Keyword-only. Default: ``False``.

    Returns:
        A callable with ``fn``'s signature.

    Raises:
        ValueError: (at call time) mapped sizes disagree, a rank is too small, the batch is
            empty, nothing is mapped, ``in_axes``/``out_axes`` is not a prefix of the
            arguments/output, a static argument is not given positionally, devices are
            unavailable, or replicas return different structures or non-tensor values.
        TypeError: ``fn`` is not callable (an axis name or an option passed in its place), or
            is a generator or coroutine function; ``axis_name`` is unhashable or reads as an
            ``in_axes`` specification (``fdp.pmap(f, (0, None))``, torch.vmap's habit); an
            option is another library's (``static_broadcasted_argnums``, ``in_dims``,
            ``device_ids``, ...); (at call time) a NumPy array (or another library's array)
            under an int axis (convert it with ``torch.as_tensor``), an unhashable static
            argument, or a replica returns a generator, a coroutine or a lazy ``map``/``filter``.
        RuntimeError: called inside a mapped function, or under a ``torch.func`` transform;
            on several devices, under a tracer of the caller's operations
            (``torch.func.linearize``, ``make_fx``, ``torch.jit.trace``, ``torch.export``).

    Examples:
        A plain map: the batch is split over the devices and the results are concatenated.

        >>> import torch, fdp
        >>> double = fdp.pmap(lambda x: 2 * x, devices=["cpu", "cpu"])
        >>> double(torch.arange(5.0))
        tensor([0., 2., 4., 6., 8.])

        Broadcasting with ``in_axes``: ``w`` goes whole to every replica.

        >>> @fdp.pmap(in_axes=(None, 0), devices=["cpu"] * 3)
        ... def predict(w, x):
        ...     return x @ w
        >>> predict(torch.ones(2, 1), torch.ones(7, 2)).shape
        torch.Size([7, 1])

        An axis name (second, as in ``jax.pmap``) for collectives: each replica centers its
        shard on the mean of the whole batch.

        >>> center = fdp.pmap(lambda x: x - fdp.pmean(x.mean(), "i"), "i", devices=["cpu", "cpu"])
        >>> center(torch.arange(4.0))
        tensor([-1.5000, -0.5000,  0.5000,  1.5000])

        Nested inputs, and shapes per replica:

        >>> shapes = fdp.pmap(lambda batch: torch.tensor(batch["x"].shape[0]), devices=["cpu"] * 8)
        >>> shapes({"x": torch.zeros(30, 5)}).tolist()
        [4, 4, 4, 4, 4, 4, 4, 2]

        Gradients flow back to the inputs, as on one device:

        >>> w = torch.ones(2, requires_grad=True)
        >>> fdp.pmap(lambda x, w: x @ w, in_axes=(0, None), devices=["cpu", "cpu"])(
        ...     torch.ones(4, 2), w).sum().backward()
        >>> w.grad
        tensor([4., 4.])

        Errors name the argument:

        >>> fdp.pmap(lambda x, y: x + y, devices=["cpu", "cpu"])(torch.zeros(4), torch.zeros(3))
        Traceback (most recent call last):
        ...
        ValueError: fdp.pmap(<lambda>) got inconsistent sizes for array axes to be mapped:
          * one axis had size 4: axis 0 of args[0] of type float32[4];
          * one axis had size 3: axis 0 of args[1] of type float32[3]
        Every positional argument is split along its in_axes entry (0 unless given): ...
    """
    if _axes_as_axis_name(axis_name) and (fn is None or callable(fn)):  # (else: fn is the error)
        caller = "fdp.pmap" if fn is None else _caller_of(fn)
        raise TypeError(
            f"{caller}: axis_name is {axis_name!r}, which reads as an in_axes specification: "
            "fdp.pmap's second argument is the axis name, as jax.pmap's is (torch.vmap's is "
            f"in_dims). Pass in_axes={tuple(axis_name)!r} by keyword, and name the axis with a "
            "string if the function calls collectives: fdp.pmap(f, 'i', in_axes=...)"
        )
    options = dict(
        in_axes=in_axes,
        out_axes=out_axes,
        axis_name=axis_name,
        devices=devices,
        output_device=output_device,
        static_argnums=static_argnums,
        split=split,
        check_unmapped_outputs=check_unmapped_outputs,
        compile=compile,
    )
    if fn is None:
        return lambda f: Pmapped(f, **options)  # type: ignore[arg-type]
    return Pmapped(fn, **options)  # type: ignore[arg-type]
