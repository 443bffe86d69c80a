"""fdp.parallel_apply: per-replica calls on the persistent pool, with the caller's state and errors."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from helpers import cpus
from torch import nn

import fdp


def test_applies_each_function_to_its_inputs() -> None:
    mods = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    inputs = [torch.randn(3, 2), torch.randn(4, 2)]
    out = fdp.parallel_apply(mods, inputs, devices=cpus(2))
    for o, m, x in zip(out, mods, inputs):
        torch.testing.assert_close(o, m(x))


def test_one_function_kwargs_and_inferred_devices() -> None:
    out = fdp.parallel_apply(lambda x, *, k: x * k, [(torch.ones(1),), torch.ones(2)], [{"k": 2}, {"k": 3}])
    torch.testing.assert_close(out[0], torch.full((1,), 2.0))
    torch.testing.assert_close(out[1], torch.full((2,), 3.0))
    # No tensor in an entry's arguments: it runs on the CPU.
    assert fdp.parallel_apply(lambda k: k * 2, [(1,), ("a",)]) == [2, "aa"]


def test_only_a_tuple_spreads_into_arguments() -> None:
    # As documented: a tuple is the positional arguments, anything else (a list of tensors
    # included) is the one argument.
    pieces = [torch.ones(2), torch.ones(3)]
    out = fdp.parallel_apply(len, [pieces, (pieces,)], devices=cpus(2))
    assert out == [len(pieces), len(pieces)]


def test_runs_in_parallel_threads_with_caller_grad_mode() -> None:
    seen: list[tuple[str, bool]] = []
    lock = threading.Lock()
    # Replicas that wait for each other: the caller cannot run them one after another.
    together = threading.Barrier(3, timeout=30)

    def f(x):
        with lock:
            seen.append((threading.current_thread().name, torch.is_grad_enabled()))
        together.wait()
        return x

    with torch.no_grad():
        fdp.parallel_apply(f, [torch.ones(1)] * 3, devices=cpus(3))
    assert len({name for name, _ in seen}) == 3 and not any(grad for _, grad in seen)


def test_exception_is_the_original_object() -> None:
    error = RuntimeError("replica 1 failed")

    def f(x):
        if x.item() == 1:
            raise error
        return x

    with pytest.raises(RuntimeError) as info:
        fdp.parallel_apply(f, [torch.tensor(0), torch.tensor(1)], devices=cpus(2))
    assert info.value is error
    assert "fdp.parallel_apply: raised by replica 1 of 2 (device cpu)" in info.value.__notes__


def test_length_mismatches() -> None:
    # Each names the argument whose length is wrong ("got 1 functions for 2 inputs" did not).
    with pytest.raises(
        ValueError,
        match=r"^fdp\.parallel_apply: fns must be one callable, or one per input, got 1 functions for 2 "
        r"inputs$",
    ):
        fdp.parallel_apply([abs], [1, 2])
    with pytest.raises(
        ValueError,
        match=r"^fdp\.parallel_apply: kwargs must have one dict of keyword arguments \(or None\) per "
        r"input, got 1 kwargs for 2 inputs$",
    ):
        fdp.parallel_apply(abs, [1, 2], [{}])
    with pytest.raises(
        ValueError,
        match=r"^fdp\.parallel_apply: devices must name one device per input, got 3 devices for 2 inputs$",
    ):
        fdp.parallel_apply(abs, [1, 2], devices=cpus(3))
    with pytest.raises(ValueError, match="at least one input"):
        fdp.parallel_apply(abs, [])
    with pytest.raises(
        TypeError, match=r"^fdp\.parallel_apply: fns must be a callable or a sequence of them, got int: 3$"
    ):
        fdp.parallel_apply(3, [1])  # type: ignore[arg-type]


def test_kwargs_that_are_no_sequence_are_named() -> None:
    # len() said "object of type 'generator' has no len()", naming neither call nor argument.
    with pytest.raises(
        TypeError,
        match=r"^fdp\.parallel_apply: kwargs must be a sequence with one dict of keyword arguments per "
        r"input \(or None\), got generator: <generator",
    ):
        fdp.parallel_apply(abs, [1, 2], (k for k in [{}, {}]))  # type: ignore[arg-type]


def test_inputs_that_are_no_sequence_are_named() -> None:
    # len() said "object of type 'generator' has no len()", naming neither call nor argument.
    with pytest.raises(
        TypeError,
        match=r"^fdp\.parallel_apply: inputs must be a sequence with one entry per replica \(a list "
        r"of argument tuples\), got generator: <generator",
    ):
        fdp.parallel_apply(abs, (x for x in [1, 2]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"inputs must be a sequence .*, got NoneType: None$"):
        fdp.parallel_apply(abs, None)  # type: ignore[arg-type]


def test_an_entry_of_fns_that_is_not_callable_is_named() -> None:
    # functools.partial said only "the first argument must be callable".
    with pytest.raises(TypeError, match=r"^fdp\.parallel_apply: fns\[1\] must be callable, got int: 3$"):
        fdp.parallel_apply([abs, 3], [1, 2], devices=cpus(2))  # type: ignore[list-item]


def test_one_dict_of_kwargs_for_all_inputs_is_refused() -> None:
    # With as many keys as inputs, each key was taken for a replica's dict ("argument after **
    # must be a mapping, not str"); with another number, "got 1 kwargs for 2 inputs".
    for kwargs in ({"a": 1, "b": 2}, {"a": 1}):
        with pytest.raises(
            TypeError,
            match=r"^fdp\.parallel_apply: kwargs must be a sequence with one dict of keyword arguments "
            rf"per input \(or None\), got one dict: {re.escape(repr(kwargs))}; for the same keyword "
            r"arguments in every replica, pass \[kwargs\] \* 2$",
        ):
            fdp.parallel_apply(lambda x, **k: x, [1, 2], kwargs, devices=cpus(2))  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"^fdp\.parallel_apply: kwargs\[1\] must be a dict of keyword arguments or None, "
        r"got tuple: \(1,\)$",
    ):
        fdp.parallel_apply(lambda x, **k: x, [1, 2], [{}, (1,)], devices=cpus(2))  # type: ignore[list-item]


@pytest.mark.usefixtures("on_workers")  # replica 1 on its worker, outside the transform
@pytest.mark.parametrize("n", [1, 2])
def test_outer_torch_func_transform_is_refused(n: int) -> None:
    # Replica 1's part of the gradient came back as zeros (silently) when its worker ran it.
    def loss(x: torch.Tensor) -> torch.Tensor:
        return sum(fdp.parallel_apply(lambda v: (v**2).sum(), list(x.chunk(n)), devices=cpus(n)))

    with pytest.raises(RuntimeError, match="fdp.parallel_apply was called under a torch.func transform"):
        torch.func.grad(loss)(torch.arange(4.0))
    with pytest.raises(RuntimeError, match="fdp.parallel_apply was called under a torch.func transform"):
        torch.func.vmap(loss)(torch.ones(3, 4))
    torch.testing.assert_close(
        torch.func.grad(lambda x: (x**2).sum())(torch.arange(4.0)), 2 * torch.arange(4.0)
    )
