"""Explicit randomness: seeds derived per replica, and scopes where random ops draw from them.

torch's default CPU generator is one object for the whole process, so replicas running in
threads draw from it in whatever order the scheduler picks: dropout masks would not be
reproducible. Instead, a replica derives its own seed from a base seed and its index
(:func:`replica_seed`, built on :func:`fold_in`) and runs its random code in
:func:`rng_scope`, where dropout and torch's random functions draw from generators seeded with
it (one per device). A run is then reproducible for a given seed and device count, and the
replicas' masks differ.

The scope is a ``TorchFunctionMode`` (thread-local), which routes ``torch.nn.functional.dropout``
and ``dropout1d/2d/3d``, the random factories (``rand``, ``randn``, ``randint``, ``randperm``,
their ``*_like`` forms, ``bernoulli``, ``normal``, ``multinomial``, ``poisson``) and the
in-place samplers (``Tensor.uniform_``, ``normal_``, ``bernoulli_``, ``random_``, ...,
and so ``torch.nn.init``). ``alpha_dropout`` and ``feature_alpha_dropout`` raise inside a scope
rather than silently using the global generator.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import _collectives

__all__ = ["fold_in", "replica_seed", "rng_scope"]

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

    Example:
        >>> import fdp
        >>> fdp.fold_in(0, 1) == fdp.fold_in(0, 1) != fdp.fold_in(1, 0)
        True
    """
    return _splitmix64(_splitmix64(int(seed) & _MASK64) ^ (int(data) & _MASK64)) >> 1


def replica_seed(seed: int, axis_name: Hashable) -> int:
    """This replica's seed: ``fold_in(seed, axis_index(axis_name))``.

    Example:
        >>> import torch, fdp
        >>> seed_of = lambda x: torch.tensor(fdp.replica_seed(7, "i"))
        >>> seeds = fdp.pmap(seed_of, axis_name="i", devices=["cpu"] * 2)
        >>> len(set(seeds(torch.zeros(2)).tolist()))
        2
    """
    return fold_in(seed, _collectives.axis_index(axis_name))


def _feature_mask_shape(input: torch.Tensor, batched_rank: int) -> tuple[int, ...]:
    # (N, C, 1, ...) for batched input, (C, 1, ...) for unbatched: one draw per channel.
    leading = 2 if input.dim() == batched_rank else 1
    return (*input.shape[:leading], *([1] * (input.dim() - leading)))


class _RngMode(TorchFunctionMode):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: Any) -> torch.Generator:
        device = torch.device(device if device is not None else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        g = self.generators.get(device)
        if g is None:
            g = self.generators[device] = torch.Generator(device)
            # crc32, not hash(): str hashes differ between processes, and so would the draws.
            g.manual_seed(fold_in(self.seed, zlib.crc32(str(device).encode())))
        return g

    def dropout(
        self, input: torch.Tensor, p: float, training: bool, inplace: bool, shape: tuple[int, ...]
    ) -> torch.Tensor:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if not training or p == 0.0:
            return input
        if p == 1.0:
            return input.mul_(0.0) if inplace else input * 0.0
        mask = torch.empty(shape, dtype=input.dtype, device=input.device).bernoulli_(
            1 - p, generator=self.generator(input.device)
        )
        scale = 1.0 / (1.0 - p)
        return input.mul_(mask).mul_(scale) if inplace else input * mask * scale

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        route = _DROPOUTS.get(func)
        if route is not None:
            return route(self, *args, **kwargs)
        if func in _REFUSED:
            raise NotImplementedError(
                f"{func.__name__} inside fdp.rng_scope would draw from the global generator; "
                "use dropout, or draw its noise with torch.rand inside the scope"
            )
        device_of = _SAMPLERS.get(func)
        if device_of is not None and kwargs.get("generator") is None:
            kwargs["generator"] = self.generator(device_of(args, kwargs))
        return func(*args, **kwargs)


def _dropout_route(batched_rank: int | None) -> Callable[..., torch.Tensor]:
    def route(
        mode: _RngMode, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        shape = tuple(input.shape) if batched_rank is None else _feature_mask_shape(input, batched_rank)
        return mode.dropout(input, p, training, inplace, shape)

    return route


_DROPOUTS: dict[Any, Callable[..., torch.Tensor]] = {
    F.dropout: _dropout_route(None),
    F.dropout1d: _dropout_route(3),
    F.dropout2d: _dropout_route(4),
    F.dropout3d: _dropout_route(5),
}
_REFUSED = {F.alpha_dropout, F.feature_alpha_dropout}


def _device_kwarg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs.get("device") or torch.get_default_device()


def _device_of_first(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    first = args[0] if args else kwargs.get("input", kwargs.get("mean"))
    if isinstance(first, torch.Tensor):
        return kwargs.get("device") or first.device
    std = args[1] if len(args) > 1 else kwargs.get("std")
    if isinstance(std, torch.Tensor):
        return std.device
    return _device_kwarg(args, kwargs)


_SAMPLERS: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], Any]] = {
    **dict.fromkeys([torch.rand, torch.randn, torch.randint, torch.randperm], _device_kwarg),
    **dict.fromkeys(
        [
            torch.rand_like,
            torch.randn_like,
            torch.randint_like,
            torch.bernoulli,
            torch.normal,
            torch.multinomial,
            torch.poisson,
            torch.Tensor.bernoulli,
            torch.Tensor.multinomial,
            torch.Tensor.uniform_,
            torch.Tensor.normal_,
            torch.Tensor.bernoulli_,
            torch.Tensor.random_,
            torch.Tensor.exponential_,
            torch.Tensor.geometric_,
            torch.Tensor.log_normal_,
            torch.Tensor.cauchy_,
            # These dispatch on the init function itself (the others call Tensor samplers):
            torch.nn.init.uniform_,
            torch.nn.init.normal_,
            torch.nn.init.kaiming_uniform_,
        ],
        _device_of_first,
    ),
}


@contextlib.contextmanager
def rng_scope(seed: int) -> Iterator[None]:
    """Random ops in the block draw from generators seeded with ``seed``, not the global one.

    Works anywhere; inside a mapped function, pass :func:`replica_seed` so that every replica
    draws differently and reproducibly. Affects the current thread only.

    Args:
        seed: the seed of the block's generators (one per device, derived from it).

    Example:
        >>> import torch, fdp
        >>> with fdp.rng_scope(3):
        ...     a = torch.nn.functional.dropout(torch.ones(8), 0.5)
        >>> with fdp.rng_scope(3):
        ...     b = torch.nn.functional.dropout(torch.ones(8), 0.5)
        >>> torch.equal(a, b)
        True
    """
    with _RngMode(int(seed)):
        yield
