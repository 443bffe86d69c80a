"""Explicit randomness: seeds derived per replica, and scopes where random ops draw from them.

torch's default CPU generator is one object for the whole process, so replicas running in
threads draw from it in whatever order the scheduler picks: dropout masks would not be
reproducible. Instead, a replica derives its own seed from a base seed and its index
(:func:`replica_seed`, built on :func:`fold_in`) and runs its random code in
:func:`rng_scope`, where every random op draws from generators seeded with it (one per device).
A run is then reproducible for a given seed and device count, and the replicas' masks differ.

The scope is a ``TorchDispatchMode`` (thread-local): it sees the ATen ops that layers decompose
into, so dropout inside ``nn.MultiheadAttention``, ``scaled_dot_product_attention``'s math path,
``rrelu``, ``gumbel_softmax``, ``torch.nn.init`` and the rest are all routed. Every op with a
``generator`` argument gets the scope's generator for its device; factories without one switch
to their ``generator`` overload; ``native_dropout`` (which has none) is computed from a
Bernoulli mask drawn from the scope; cuDNN's RNN gets a dropout state seeded from it. Fused
attention kernels that draw dropout masks internally (flash, memory-efficient, cuDNN) and the
MIOpen and MPS RNN kernels cannot be routed and raise inside a scope when their dropout is on.

The ``k``-th pmapped call made inside a scope (counting from 0) gives replica ``r`` the scope
``fold_in(fold_in(seed, k), r)``: like the scope's own draws, successive calls draw anew, and a
loop of training steps inside one scope does not repeat its dropout masks.
``torch.utils.checkpoint`` recomputes its region during backward, outside the scope: pass
``context_fn=fdp.rng_checkpoint_context`` (with ``use_reentrant=False``) so the recomputation
draws the same masks.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import threading
import zlib
from collections.abc import Hashable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _collectives
from ._compile import eager_under_compile

__all__ = ["fold_in", "replica_seed", "rng_scope", "rng_checkpoint_context", "call_seed", "active_depth"]

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def fold_in(seed: int, data: int) -> int:
    """A new seed from ``seed`` and an integer ``data`` (a step, a replica), like ``jax.random.fold_in``.

    Different ``(seed, data)`` pairs give unrelated seeds (``fold_in(s, 1)`` has nothing to do
    with ``fold_in(s + 1, 0)``); the result is a valid ``torch.manual_seed`` value.

    Args:
        seed: an integer (any size: it is taken modulo 2**64, as ``torch.manual_seed`` takes it).
        data: an integer to fold in.

    Returns:
        An integer in ``[0, 2**63)``.

    Raises:
        TypeError: ``seed`` or ``data`` is not an integer (a float would be truncated: two
            different values would fold in alike).

    Examples:
        >>> import fdp
        >>> fdp.fold_in(0, 1) == fdp.fold_in(0, 1) != fdp.fold_in(1, 0)
        True
    """
    try:
        seed, data = operator.index(seed), operator.index(data)
    except TypeError:
        raise TypeError(
            f"fdp.fold_in: seed and data must be integers, got seed={seed!r} and data={data!r}"
        ) from None
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (data & _MASK64)) >> 1


def replica_seed(seed: int, axis_name: Hashable) -> int:
    """This replica's seed: ``fold_in(seed, axis_index(axis_name))``.

    Args:
        seed: an integer, the same on every replica.
        axis_name: the ``axis_name`` given to :func:`fdp.pmap`.

    Raises:
        NameError: outside a function mapped with this ``axis_name``.
        TypeError: ``seed`` is not an integer.

    Examples:
        >>> import torch, fdp
        >>> seed_of = lambda x: torch.tensor(fdp.replica_seed(7, "i"))
        >>> seeds = fdp.pmap(seed_of, axis_name="i", devices=["cpu"] * 2)
        >>> len(set(seeds(torch.zeros(2)).tolist()))
        2
    """
    # Checked here, not by fold_in and axis_index, whose errors would name those calls.
    try:
        seed = operator.index(seed)
    except TypeError:
        raise TypeError(f"fdp.replica_seed: seed must be an integer, got {seed!r}") from None
    context = _collectives._bound(axis_name, "fdp.replica_seed")
    return fold_in(seed, context.global_index)


# Traced, fold_in's arithmetic on a Python int that changes per call (the step in
# fold_in(seed, step), inside a compiled step) guarded on its value: a recompilation at every
# step, and past dynamo's recompile limit, eager steps with a warning. Its result seeds an
# rng_scope, which runs eagerly anyway: so fold_in is a graph break, as rng_scope is, and
# replica_seed one break, not two (axis_index is one too).
_SEED_WHY = (
    "fdp.{name} runs eagerly, as a graph break: traced, dynamo would compile it for each value "
    "of its integers (a step count: a recompilation at every step). Its result is a seed for "
    "fdp.rng_scope, which runs eagerly too."
)
eager_under_compile(fold_in, why=_SEED_WHY.format(name="fold_in"))
eager_under_compile(replica_seed, why=_SEED_WHY.format(name="replica_seed"))


# --- routing ATen random ops ---------------------------------------------------------------------


@functools.cache
def _schema_argument(op: Any, name: str) -> tuple[int, Any] | None:
    """The position and schema entry of ``op``'s argument ``name``, or None if it has none."""
    for position, argument in enumerate(op._schema.arguments):
        if argument.name == name:
            return position, argument
    return None


def _argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """The value passed for ``func``'s argument ``name`` (its default where none was passed;
    None if ``func`` has no such argument)."""
    found = _schema_argument(func, name)
    if found is None:
        return None
    position, argument = found
    return args[position] if len(args) > position else kwargs.get(name, argument.default_value)


@functools.cache
def _generator_slot(op: Any) -> tuple[int, bool] | None:
    """(position, keyword-only) of ``op``'s generator argument, or None."""
    found = _schema_argument(op, "generator")
    return None if found is None else (found[0], found[1].kwarg_only)


@functools.cache
def _generator_overload(op: Any) -> Any:
    """The overload of ``op`` that takes the same arguments plus a generator (``rand.generator``)."""
    names = [a.name for a in op._schema.arguments]
    packet = op.overloadpacket
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        arguments = [a.name for a in candidate._schema.arguments]
        if "generator" in arguments and [a for a in arguments if a != "generator"] == names:
            return candidate
    return None


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.get_default_device()


_aten = torch.ops.aten
# Kernels that draw their dropout masks internally, from the device's default generator: every
# attention kernel torch tags nondeterministic_seeded that takes a dropout_p and no generator,
# and may draw with it (tests/test_torch_internals.py checks that a new torch adds none
# unlisted). One that a torch no longer has is skipped: nothing can call it there.
_INTERNAL_DROPOUT = {
    getattr(_aten, name)
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",  # a PrivateUse1 or XPU backend's
        "_scaled_dot_product_attention_math_for_mps",
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "_cudnn_attention_forward",
        "_triton_scaled_dot_attention",
    )
    if hasattr(_aten, name)
}
# RNN kernels whose dropout between layers draws from a state buffer the kernel advances:
# cuDNN's comes in as ``dropout_state``, which a scope replaces with one seeded from its
# generator (see _RngMode.cudnn_rnn); MIOpen's and MPS's keep theirs out of reach, so a scope
# refuses them with their dropout on (no such machine here to test routing them on).
_KEPT_STATE_RNN = {getattr(_aten, name) for name in ("miopen_rnn", "_lstm_mps") if hasattr(_aten, name)}
_RANDOM_OPS_WITHOUT_GENERATOR = {
    "rand",
    "randn",
    "randint",
    "randperm",
    "rand_like",
    "randn_like",
    "randint_like",
}


class _RngMode(TorchDispatchMode):
    def __init__(
        self, seed: int, states: dict[torch.device, torch.Tensor] | None = None, calls: int = 0
    ) -> None:
        super().__init__()
        self.seed = seed
        self.calls = calls  # pmapped calls made in this scope so far (see call_seed)
        self.forked = False  # inherited by a forked child: draws nothing (see _off_after_fork)
        self.generators: dict[torch.device, torch.Generator] = {}
        for device, state in (states or {}).items():
            self.generators[device] = torch.Generator(device)
            self.generators[device].set_state(state)

    def generator(self, device: torch.device) -> torch.Generator | None:
        if device.type == "meta":
            # Meta tensors hold no values: their random ops draw nothing, and torch has no
            # generator for them (torch.Generator("meta") raises). None leaves the op as it was.
            return None
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        g = self.generators.get(device)
        if g is None:
            g = self.generators[device] = torch.Generator(device)
            # crc32, not hash(): str hashes differ between processes, and so would the draws.
            g.manual_seed(fold_in(self.seed, zlib.crc32(str(device).encode())))
        return g

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if self.forked:
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        packet = func.overloadpacket
        if packet is _aten.native_dropout:
            return self.native_dropout(*args, **kwargs)
        if packet in _INTERNAL_DROPOUT and _dropout_p(func, args, kwargs) > 0:
            raise NotImplementedError(
                f"{packet.__name__} draws its dropout mask inside the kernel, from the device's "
                "global generator, which fdp.rng_scope cannot reach. Inside a scope, use the math "
                "attention backend (torch.nn.attention.sdpa_kernel(SDPBackend.MATH)) or dropout_p=0."
            )
        if packet is _aten._cudnn_rnn or packet in _KEPT_STATE_RNN:
            dropout, train = _argument(func, args, kwargs, "dropout"), _argument(func, args, kwargs, "train")
            if train and dropout > 0:
                if packet is _aten._cudnn_rnn:
                    return self.cudnn_rnn(func, args, kwargs, dropout)
                raise NotImplementedError(
                    f"{packet.__name__} (an RNN's dropout between layers, dropout={dropout}) draws "
                    "its masks from a state the kernel keeps, which fdp.rng_scope cannot reach. "
                    "Inside a scope, run the RNN one layer at a time with nn.Dropout between the "
                    "layers, or with dropout=0."
                )
        slot = _generator_slot(func)
        if slot is None and packet.__name__ in _RANDOM_OPS_WITHOUT_GENERATOR:
            overload = _generator_overload(func)
            if overload is not None:
                func, slot = overload, _generator_slot(overload)
        if slot is not None:
            position, kwarg_only = slot
            if not kwarg_only and len(args) > position:
                if args[position] is None:
                    args = (*args[:position], self.generator(_device_of(args, kwargs)), *args[position + 1 :])
            elif kwargs.get("generator") is None:
                kwargs["generator"] = self.generator(_device_of(args, kwargs))
        return func(*args, **kwargs)

    def cudnn_rnn(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dropout: float) -> Any:
        """cuDNN's RNN with its dropout state seeded from the scope.

        cuDNN draws the masks between layers from ``dropout_state``, an RNG state that the
        kernel advances; torch passes one per device, seeded once from the global generator
        (and again after ``torch.manual_seed``). A fresh one seeded from a draw of the scope's
        generator makes the masks follow the scope. The draw is read on the host, as torch
        reads its own seed: one synchronisation per call. The backward replays the masks
        from the reserve space that the forward returns, not from the state.
        """
        device = args[0].device
        seed = int(
            torch.empty((), dtype=torch.int64, device=device).random_(generator=self.generator(device))
        )
        state = torch._cudnn_init_dropout_state(dropout, True, seed, dtype=torch.uint8, device=device)
        found = _schema_argument(func, "dropout_state")
        assert found is not None, func  # (tests/test_torch_internals.py checks the name)
        position = found[0]
        if len(args) > position:
            args = (*args[:position], state, *args[position + 1 :])
        else:
            kwargs["dropout_state"] = state
        return func(*args, **kwargs)

    def native_dropout(
        self, input: torch.Tensor, p: float, train: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if train is False or p == 0.0:
            return input.clone(), torch.ones_like(input, dtype=torch.bool)
        mask = torch.empty_like(input).bernoulli_(1.0 - p, generator=self.generator(input.device)).bool()
        scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
        return input * mask * scale, mask


def _dropout_p(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    return float(_argument(func, args, kwargs, "dropout_p") or 0.0)


class _Active(threading.local):
    def __init__(self) -> None:
        self.modes: list[_RngMode] = []


_ACTIVE = _Active()


def _off_after_fork() -> None:
    """In a forked child, the scopes the forking thread was in stop drawing.

    Every child forked in a scope (DataLoader workers started with "fork", one per worker and
    epoch) holds a copy of its generators, in the same state: each would draw the same numbers,
    the same augmentations in every worker, silently. DataLoader reseeds torch's global
    generator in each worker, differently, for that reason: the child's random ops (and its
    pmapped calls' replicas) draw from it, as outside any scope. (The scopes stay entered, for
    the forking code's ``with`` blocks to leave.)
    """
    for mode in _ACTIVE.modes:
        mode.forked = True


os.register_at_fork(after_in_child=_off_after_fork)


def call_seed() -> int | None:
    """The seed of a pmapped call made now, or None outside any :func:`rng_scope`.

    Inside a scope of seed ``s``, the ``k``-th call gets ``fold_in(s, k)`` (and its replica ``r``
    the scope ``fold_in(fold_in(s, k), r)``: :func:`replica_scope`). The scope's own generators
    are left where they are: a call in the scope changes none of the block's other draws.
    """
    if not _ACTIVE.modes or _ACTIVE.modes[-1].forked:
        return None
    mode = _ACTIVE.modes[-1]
    k, mode.calls = mode.calls, mode.calls + 1
    return fold_in(mode.seed, k)


def active_depth() -> int:
    """How many :func:`rng_scope` modes are on this thread's dispatch mode stack."""
    return len(_ACTIVE.modes)


@contextlib.contextmanager
def _entered(mode: _RngMode) -> Iterator[None]:
    _ACTIVE.modes.append(mode)
    try:
        with mode:
            yield
    finally:
        _ACTIVE.modes.pop()


def rng_scope(seed: int) -> contextlib.AbstractContextManager[None]:
    """Random ops in the block draw from generators seeded with ``seed``, not the global one.

    Works anywhere and affects the current thread only. Inside a mapped function, pass
    :func:`replica_seed` so that every replica draws differently and reproducibly. The ``k``-th
    pmapped call made inside a scope (counting from 0) gives replica ``r`` the scope
    ``fold_in(fold_in(seed, k), r)``: successive calls draw anew, as successive draws do.
    A process forked inside the scope (a DataLoader worker started with "fork") draws from
    torch's global generator, which DataLoader seeds differently in each worker (from the
    scope, so reproducibly): copies of the scope's generators would draw alike in every worker.

    Args:
        seed: the seed of the block's generators (one per device, derived from it).

    Examples:
        >>> import torch, fdp
        >>> with fdp.rng_scope(3):
        ...     a = torch.nn.functional.dropout(torch.ones(8), 0.5)
        >>> with fdp.rng_scope(3):
        ...     b = torch.nn.functional.dropout(torch.ones(8), 0.5)
        >>> torch.equal(a, b)
        True
    """
    try:
        seed = operator.index(seed)
    except TypeError:
        # int() would truncate: rng_scope(0.5) and rng_scope(0.7) would draw alike.
        raise TypeError(f"fdp.rng_scope: seed must be an integer, got {seed!r}") from None
    return _entered(_RngMode(seed))


# Traced, entering the scope reaches TorchDispatchMode.__enter__, whose C++ builtin dynamo cannot
# trace: it warns (an InternalTorchDynamoError where warnings are errors) before it breaks the
# graph. Nothing compiles in the scope anyway (dynamo skips frames under a dispatch mode).
eager_under_compile(
    rng_scope,
    why="fdp.rng_scope is a TorchDispatchMode, under which torch.compile compiles nothing: "
    "entering it is a graph break, and the code in the scope runs eagerly.",
)


def rng_checkpoint_context() -> tuple[
    contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]
]:
    """A ``context_fn`` for ``torch.utils.checkpoint`` inside :func:`rng_scope`.

    The checkpointed region is recomputed during backward, outside the scope; this replays it
    in a scope whose generators are where they were when the region first ran, so it draws the
    same dropout masks. Use with ``use_reentrant=False``, on a region inside the mapped function,
    outside any, or around a whole pmapped call (whose replicas then run one at a time:
    docs/concepts.md).

    Examples:
        >>> import torch, fdp
        >>> from torch.utils.checkpoint import checkpoint
        >>> x = torch.ones(6, requires_grad=True)
        >>> with fdp.rng_scope(0):
        ...     y = checkpoint(torch.nn.functional.dropout, x, 0.5, use_reentrant=False,
        ...                    context_fn=fdp.rng_checkpoint_context)
        >>> y.sum().backward()
        >>> torch.equal(x.grad, y.detach())  # the recomputed mask is the forward's
        True
    """
    if not _ACTIVE.modes:
        return contextlib.nullcontext(), contextlib.nullcontext()
    mode = _ACTIVE.modes[-1]
    states = {device: g.get_state() for device, g in mode.generators.items()}
    # The call count too: a pmapped call in the region gets its seed again.
    return contextlib.nullcontext(), _Replay(mode.seed, states, mode.calls)


class _Replay(contextlib.AbstractContextManager[None]):
    """The scope a checkpointed region is recomputed in, from the same generator states every
    time it is entered: torch.utils.checkpoint enters it once per backward pass through the
    region (twice for two passes with ``retain_graph=True``, or two ``torch.autograd.grad``
    calls), and each recomputation must draw the forward's masks again."""

    def __init__(self, seed: int, states: dict[torch.device, torch.Tensor], calls: int) -> None:
        self._seed, self._states, self._calls = seed, states, calls
        self._scopes: list[contextlib.AbstractContextManager[None]] = []  # entered, innermost last

    def __enter__(self) -> None:
        scope = _entered(_RngMode(self._seed, self._states, self._calls))
        scope.__enter__()
        self._scopes.append(scope)

    def __exit__(self, *exc: Any) -> bool | None:
        return self._scopes.pop().__exit__(*exc)


def replica_scope(seed: int | None, index: int) -> contextlib.AbstractContextManager[None]:
    """The scope replica ``index`` runs in, for a call whose :func:`call_seed` is ``seed``."""
    if seed is None:
        return contextlib.nullcontext()
    return rng_scope(fold_in(seed, index))
