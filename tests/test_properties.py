"""Property tests over random nested trees: exact scatter/gather round trips, one-device gradients."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import optree
import torch
from helpers import cpus
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fdp

Pair = collections.namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Box:
    content: Any
    label: str = "box"


DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool]


@st.composite
def tensor_leaf(draw: st.DrawFn, batch: int, axis: int) -> torch.Tensor:
    rest = draw(st.lists(st.integers(1, 3), max_size=2))
    shape = [batch, *rest] if axis == 0 else [*rest, batch]
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * 10
    return values.to(dtype)


def trees(batch: int, axis: int) -> st.SearchStrategy[Any]:
    leaves = st.one_of(
        tensor_leaf(batch, axis),
        tensor_leaf(batch, axis),
        st.integers(-5, 5),
        st.text(max_size=3),
        st.none(),
    )
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.tuples(children, children),
            st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
            st.builds(Pair, children, children),
            st.builds(Box, children),
            st.builds(
                lambda d: collections.OrderedDict(sorted(d.items(), reverse=True)),
                st.dictionaries(st.sampled_from("xyz"), children, max_size=3),
            ),
        ),
        max_leaves=8,
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[Any, int, int, str]:
    batch = draw(st.integers(1, 20))
    axis = draw(st.sampled_from([0, -1]))
    tree = draw(trees(batch, axis))
    # At least one mapped floating-point tensor: a batch to split and something to differentiate.
    tree = (tree, draw(tensor_leaf(batch, axis)).double())
    return tree, axis, draw(st.integers(1, 8)), draw(st.sampled_from(["chunk", "balanced"]))


def assert_same(actual: Any, expected: Any) -> None:
    a_leaves, a_spec = optree.tree_flatten(actual, namespace=fdp.NAMESPACE)
    e_leaves, e_spec = optree.tree_flatten(expected, namespace=fdp.NAMESPACE)
    assert a_spec == e_spec
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            assert a.dtype == e.dtype and torch.equal(a, e)
        else:
            assert a == e


PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(cases())
def test_scatter_then_gather_is_exact(case: tuple[Any, int, int, str]) -> None:
    tree, axis, n, split = case
    shards = fdp.scatter(tree, cpus(n), in_axes=axis, split=split)
    assert 1 <= len(shards) <= n
    assert_same(fdp.gather(shards, "cpu", out_axes=axis), tree)


@PROPERTY_SETTINGS
@given(cases())
def test_pmap_identity_is_exact(case: tuple[Any, int, int, str]) -> None:
    tree, axis, n, split = case
    out = fdp.pmap(lambda t: t, in_axes=axis, out_axes=axis, devices=cpus(n), split=split)(tree)
    assert_same(out, tree)


@PROPERTY_SETTINGS
@given(cases())
def test_gradients_match_one_device(case: tuple[Any, int, int, str]) -> None:
    tree, axis, n, split = case
    floats = optree.tree_map(
        lambda x: x.double().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        tree,
        namespace=fdp.NAMESPACE,
    )

    def f(t: Any) -> Any:
        return optree.tree_map(
            lambda x: x.sin() * 2 if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
            t,
            namespace=fdp.NAMESPACE,
        )

    def loss(out: Any) -> torch.Tensor:
        tensors = [
            x
            for x in optree.tree_leaves(out, namespace=fdp.NAMESPACE)
            if isinstance(x, torch.Tensor) and x.is_floating_point()
        ]
        return sum((x * x).sum() for x in tensors) + torch.zeros((), dtype=torch.float64)

    inputs = [
        x
        for x in optree.tree_leaves(floats, namespace=fdp.NAMESPACE)
        if isinstance(x, torch.Tensor) and x.requires_grad
    ]
    got = torch.autograd.grad(
        loss(fdp.pmap(f, in_axes=axis, out_axes=axis, devices=cpus(n), split=split)(floats)),
        inputs,
        allow_unused=True,
    )
    expected = torch.autograd.grad(loss(f(floats)), inputs, allow_unused=True)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@st.composite
def mixed_axis_cases(draw: st.DrawFn) -> tuple[tuple[Any, ...], tuple[Any, ...], int, str]:
    """Positional arguments, each with its own axis: 0, -1 or None (broadcast)."""
    batch = draw(st.integers(1, 12))
    axes = tuple(draw(st.lists(st.sampled_from([0, -1, None]), min_size=1, max_size=3)))
    if all(a is None for a in axes):
        axes = (0, *axes[1:])
    args = tuple(draw(trees(batch, a if a is not None else 0)) for a in axes)
    args = (*args, draw(tensor_leaf(batch, 0)).double())  # one mapped float, to have a batch
    return args, (*axes, 0), draw(st.integers(1, 8)), draw(st.sampled_from(["chunk", "balanced"]))


@PROPERTY_SETTINGS
@given(mixed_axis_cases())
def test_per_argument_axes_round_trip(case: tuple[tuple[Any, ...], tuple[Any, ...], int, str]) -> None:
    args, axes, n, split = case
    # None out: the replica's own copy of a broadcast argument, which is the argument.
    out = fdp.pmap(lambda *a: a, in_axes=axes, out_axes=axes, devices=cpus(n), split=split)(*args)
    assert_same(out, args)


@PROPERTY_SETTINGS
@given(cases())
def test_replicate_gives_every_device_the_tree(case: tuple[Any, int, int, str]) -> None:
    tree, _, n, _ = case
    copies = fdp.replicate(tree, cpus(n))
    assert len(copies) == n
    for copy in copies:
        assert_same(copy, tree)


@dataclasses.dataclass
class Scaled:
    content: Any
    scale: Any = dataclasses.field(default=1, metadata={"pytree_node": False})


# Non-node values that are equal by == (and hash alike) but not the same: a structure kept from
# an earlier call must not lend its value to a later one (2 for 2.0, True for 1, 0.0 for -0.0).
EQUAL_BUT_NOT_SAME = [1, 1.0, True, 2, 2.0, 0.0, -0.0, "s", (1, 2), (1.0, 2), float("nan")]


def assert_strictly_same(actual: Any, expected: Any) -> None:
    """assert_same, with non-tensor leaves of the same type, and node data (a non-node field's
    value) of the same type and sign, as ``str`` of the structure spells it."""
    assert str(optree.tree_structure(actual, namespace=fdp.NAMESPACE)) == str(
        optree.tree_structure(expected, namespace=fdp.NAMESPACE)
    )
    assert_same(actual, expected)
    for a, e in zip(
        optree.tree_leaves(actual, namespace=fdp.NAMESPACE),
        optree.tree_leaves(expected, namespace=fdp.NAMESPACE),
    ):
        assert type(a) is type(e)


def double_and_describe(*args: Any) -> Any:
    """Row-wise: tensors doubled, and the structure (with every non-node value) as a string leaf."""
    doubled = optree.tree_map(
        lambda x: x * 2 if isinstance(x, torch.Tensor) and x.dtype != torch.bool else x,
        args,
        namespace=fdp.NAMESPACE,
    )
    return doubled, str(optree.tree_structure(args, namespace=fdp.NAMESPACE))


@st.composite
def call_sequences(draw: st.DrawFn) -> tuple[list[tuple[Any, ...]], int, str]:
    """Calls of one pmapped function: trees of several structures, then repeated with other
    values, dict keys in another order, or a non-node value swapped for an equal one."""
    calls: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(2, 6))):
        if calls and draw(st.booleans()):
            # Mostly the last call's structure: the one a pmapped function keeps to follow.
            tree, scale, rows = calls[-1 if draw(st.booleans()) else draw(st.integers(0, len(calls) - 1))]
            if isinstance(tree, dict):
                tree = dict(reversed(list(tree.items())))
            scale = draw(st.sampled_from(EQUAL_BUT_NOT_SAME))
        else:
            rows = draw(st.integers(1, 7))
            tree = draw(st.one_of(trees(rows, 0), tensor_leaf(rows, 0)))  # some with no dict
            scale = draw(st.sampled_from(EQUAL_BUT_NOT_SAME))
        calls.append((tree, scale, rows))
    sequence = [(Scaled(tree, scale), torch.arange(rows, dtype=torch.float64)) for tree, scale, rows in calls]
    return sequence, draw(st.sampled_from([1, 2, 2, 3])), draw(st.sampled_from(["chunk", "balanced"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call_sequences())
def test_call_sequences_match_one_device(case: tuple[list[tuple[Any, ...]], int, str]) -> None:
    # One pmapped function for the whole sequence, so that what it keeps between calls (the last
    # structure, plans by structure, the output's structure) is exercised.
    sequence, n, split = case
    mapped = fdp.pmap(double_and_describe, devices=cpus(n), split=split)
    for args in sequence:
        assert_strictly_same(mapped(*args), double_and_describe(*args))
