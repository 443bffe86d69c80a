"""Collectives, ported from the behaviour JAX's tests/pmap_test.py checks, on CPU replicas.

Each replica gets one row of ``x`` (``n`` rows, ``n`` replicas), so a collective over the
replicas is a reduction over the rows.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from helpers import cpus, finishes
from torch.utils._python_dispatch import TorchDispatchMode

import fdp
from fdp import _collectives, _replica

N = 4


def per_row(fn: Callable[..., Any], n: int = N, **options: Any) -> Callable[..., Any]:
    """fn mapped with one row per replica; each replica sees its row as a (1, ...) tensor."""
    return fdp.pmap(fn, axis_name="i", devices=cpus(n), **options)


def rows(n: int = N, width: int = 3, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(n * width, dtype=dtype).reshape(n, width) * 0.5 - 2


# --- reductions --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("collective", "reduce"),
    [
        (fdp.psum, lambda x: x.sum(0, keepdim=True)),
        (fdp.pmean, lambda x: x.mean(0, keepdim=True)),
        (fdp.pmax, lambda x: x.amax(0, keepdim=True)),
        (fdp.pmin, lambda x: x.amin(0, keepdim=True)),
    ],
)
def test_reductions_equal_reductions_over_the_batch(collective: Any, reduce: Any) -> None:
    x = rows()
    out = per_row(lambda x: collective(x, "i"))(x)
    torch.testing.assert_close(out, reduce(x).expand(N, -1))


def test_mean_subtraction() -> None:  # JAX: testMean
    x = rows()
    torch.testing.assert_close(per_row(lambda x: x - fdp.pmean(x, "i"))(x), x - x.mean(0))


def test_partially_mapped() -> None:  # JAX: testPartiallyMapped
    x, y = torch.tensor(3.0), rows()
    g = per_row(lambda x, y: x - fdp.psum(y, "i"), in_axes=(None, 0))
    torch.testing.assert_close(g(x, y), (x - y.sum(0, keepdim=True)).expand(N, -1))


def test_in_and_out_axes_other_than_0() -> None:
    x = rows().T.contiguous()  # (3, N): replicas along dim 1
    f = per_row(lambda x: x - fdp.pmean(x, "i"), in_axes=1, out_axes=1)
    torch.testing.assert_close(f(x), x - x.mean(1, keepdim=True))


def test_collectives_over_dicts_with_mixed_dtypes() -> None:
    tree = {
        "a": rows(dtype=torch.float32),
        "b": rows(width=2, dtype=torch.float64),
        "n": torch.arange(N, dtype=torch.int64)[:, None],
        "c": [rows(width=1, dtype=torch.float32)],
    }
    out = per_row(lambda t: fdp.psum(t, "i"))(tree)
    for key in ("a", "b", "n"):
        assert out[key].dtype == tree[key].dtype
        torch.testing.assert_close(out[key], tree[key].sum(0, keepdim=True).expand(N, -1))
    torch.testing.assert_close(out["c"][0], tree["c"][0].sum(0, keepdim=True).expand(N, -1))
    means = per_row(lambda t: fdp.pmean(t, "i"))({k: tree[k] for k in ("a", "b")})
    torch.testing.assert_close(means["b"], tree["b"].mean(0, keepdim=True).expand(N, -1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["eager", "vmap"])
def test_half_precision_sums_round_once_as_over_the_batch(dtype: torch.dtype, mode: str) -> None:
    # torch.sum and torch.mean add float16/bfloat16 values in float32 and round once. Added in
    # their own dtype, replica after replica, the sums of 8 replicas were off by several units
    # in the last place in most elements. Eager, each replica adds the buffers itself
    # (combine_each); under torch.func (vmap), one combine computes every replica's result.
    n = 8
    x = (torch.randn(n, 64) * torch.logspace(-2, 2, 64)).to(dtype)
    tree = {"half": x, "single": x.float() / 3, "double": x.double() / 3}

    def collect(t: Any) -> Any:
        return fdp.psum(t, "i"), fdp.pmean(t, "i"), fdp.pmean(t, "i", weight=1.0)

    sums, means, weighted = per_row(collect if mode == "eager" else torch.func.vmap(collect), n=n)(tree)
    for key, leaf in tree.items():  # each leaf reduced in its own dtype, none cast through another
        for got, expected in ((sums, leaf.sum(0)), (means, leaf.mean(0)), (weighted, leaf.mean(0))):
            assert got[key].dtype == leaf.dtype, key
            torch.testing.assert_close(got[key], expected.expand(n, -1), atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["eager", "vmap"])
@pytest.mark.parametrize(
    ("region", "leaf"), [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)]
)
def test_half_precision_leaves_under_an_autocast_of_the_other(
    region: torch.dtype, leaf: torch.dtype, mode: str
) -> None:
    # Packing (a cat of a dtype's leaves) and combining (stacks) ran under the replica's
    # autocast, whose cast policy refuses a float16 tensor in a bfloat16 region and the reverse.
    x = rows().to(leaf)

    def collect(x: torch.Tensor) -> Any:
        with torch.autocast("cpu", dtype=region):
            tree = {"a": x, "b": 2 * x}
            return fdp.psum(tree, "i"), fdp.pmax(tree, "i"), fdp.all_gather(x, "i")

    sums, maxima, gathered = per_row(collect if mode == "eager" else torch.func.vmap(collect))(x)
    assert sums["a"].dtype == maxima["b"].dtype == gathered.dtype == leaf
    assert torch.equal(sums["b"], (2 * x).sum(0).expand(N, -1))
    assert torch.equal(maxima["a"], x.amax(0).expand(N, -1))

    def gather(x: torch.Tensor) -> torch.Tensor:
        return fdp.all_gather(x, "i")

    reference = per_row(gather if mode == "eager" else torch.func.vmap(gather))(x.float())
    assert torch.equal(gathered, reference.to(leaf))  # exact: these values fit either dtype


def test_second_order_all_gather_of_float16_under_a_bfloat16_autocast() -> None:
    # The backward of all_gather's backward (psum_scatter) is an all_gather, whose combine
    # stacks: reached from autograd, not from the collective's call.
    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):

            def cubes(x: torch.Tensor) -> torch.Tensor:
                return (fdp.all_gather(x.half(), "i").float() ** 3).sum()

            return torch.func.grad(lambda x: torch.func.grad(cubes)(x).sum())(x)

    x = torch.arange(1.0, N + 1).reshape(N, 1)
    # Every replica's loss holds every x_j^3: d/dx_i of sum_r 3 x_i^2 is 6 N x_i.
    assert torch.equal(per_row(f)(x), 6 * N * x)


@pytest.mark.parametrize("mode", ["eager", "vmap"])
def test_float16_means_do_not_overflow_where_the_mean_fits(mode: str) -> None:
    # 40000 + 40000 is past float16's 65504: summed in float16, the mean was inf.
    x = torch.full((2, 3), 40000.0, dtype=torch.float16)

    def collect(x: torch.Tensor) -> Any:
        return fdp.pmean(x, "i"), fdp.pmean(x, "i", weight=x.shape[0]), fdp.psum(x, "i")

    mean, weighted, total = per_row(collect if mode == "eager" else torch.func.vmap(collect), n=2)(x)
    assert torch.equal(mean, x) and torch.equal(weighted, x)
    assert torch.equal(total, x.sum(0).expand(2, -1))  # inf, as torch.sum gives


def test_trees_of_many_shapes_and_layouts_keep_them_and_their_gradients() -> None:
    # Several leaves share one flat buffer per dtype: empty, non-contiguous and 0-dim-per-row
    # leaves must come back in their shapes, with values and gradients as over the batch.
    torch.manual_seed(0)
    tree = {
        "empty": torch.zeros(N, 0, 3),
        "strided": torch.randn(N, 3, 2).transpose(1, 2),  # each replica's row is not contiguous
        "row": torch.randn(N),
        "wide": torch.randn(N, 5, dtype=torch.float64),
        "also": [torch.randn(N, 2, 2), torch.randn(N, 1, dtype=torch.float64)],
    }
    tree = optree.tree_map(lambda t: t.requires_grad_(), tree)
    leaves = optree.tree_leaves(tree)
    weights = [torch.randn(t.shape, dtype=t.dtype) for t in leaves]

    def sums(t: Any) -> Any:
        return optree.tree_map(lambda x: x.sum(0, keepdim=True).expand(x.shape), t)

    for run in (per_row(lambda t: fdp.psum(t, "i")), sums):
        out = run(tree)
        assert optree.tree_structure(out) == optree.tree_structure(tree)
        got = optree.tree_leaves(out)
        assert [t.shape for t in got] == [t.shape for t in leaves]
        loss = sum((t * w).sum() for t, w in zip(got, weights))
        grads = torch.autograd.grad(loss, leaves)
        if run is sums:
            expected_out, expected_grads = got, grads
        else:
            actual_out, actual_grads = got, grads
    torch.testing.assert_close(actual_out, expected_out)
    torch.testing.assert_close(actual_grads, expected_grads)


@pytest.mark.parametrize(
    "collective",
    [fdp.psum, fdp.pmean, fdp.pmax, lambda t, name: fdp.ppermute(t, name, [(0, 1), (1, 2), (2, 3), (3, 0)])],
)
def test_an_empty_leaf_stays_differentiable_on_its_own(collective: Any) -> None:
    # The result of an empty leaf is a view of the flat buffer like any other, so a loss that
    # depends on it alone still reaches the inputs (torch's unflatten gives it a new tensor).
    x = torch.zeros(N, 0, 2, requires_grad=True)
    y = rows().requires_grad_()
    out = per_row(lambda x, y: collective({"empty": x * 2, "full": y}, "i"))(x, y)
    assert out["empty"].shape == x.shape and out["empty"].grad_fn is not None
    (grad,) = torch.autograd.grad(out["empty"].sum(), x)
    assert grad.shape == x.shape


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(
    "collective",
    [
        fdp.psum,
        fdp.pmean,
        lambda t, name: fdp.pmean(t, name, weight=2),
        fdp.pmax,
        fdp.pmin,
        fdp.all_gather,
        lambda t, name: fdp.ppermute(
            t, name, [(i, (i + 1) % fdp.axis_size(name)) for i in range(fdp.axis_size(name))]
        ),
    ],
    ids=["psum", "pmean", "pmean_weighted", "pmax", "pmin", "all_gather", "ppermute"],
)
def test_results_stay_on_the_device_of_their_input(collective: Any, n: int) -> None:
    # A tensor on another device than the replica's (here meta tensors on CPU replicas; on a
    # GPU, a CPU tensor in a CUDA replica) gets its result there, as any op's result would be.
    seen: list[tuple[torch.device, torch.device]] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        out = collective({"elsewhere": torch.ones(2, 3, device="meta"), "here": x}, "i")
        seen.append((out["elsewhere"].device, out["here"].device))
        return x

    fdp.pmap(f, axis_name="i", devices=cpus(n))(torch.ones(n, 2))
    assert seen == [(torch.device("meta"), torch.device("cpu"))] * n


@pytest.mark.parametrize("weighted", [False, True])
def test_pmean_of_python_numbers_is_a_float_mean(weighted: bool) -> None:
    # Ints and bools average to floats, as their mean is one (jax.lax.pmean divides too).
    @fdp.pmap(axis_name="i", devices=cpus(2), out_axes=None)
    def mean(x: torch.Tensor) -> Any:
        numbers = {"int": 3, "bool": True, "float": 2.5}
        return fdp.pmean(numbers, "i", weight=x.shape[0] if weighted else None)

    out = mean(torch.zeros(3))
    assert {k: v.dtype for k, v in out.items()} == dict.fromkeys(out, torch.get_default_dtype())
    assert {k: v.item() for k, v in out.items()} == {"int": 3.0, "bool": 1.0, "float": 2.5}


def test_numpy_scalars_count_as_numbers() -> None:
    # np.float64 subclasses float and always passed; np.float32, np.int64 and np.bool_ did not.
    numpy = pytest.importorskip("numpy")

    @fdp.pmap(axis_name="i", devices=cpus(2), out_axes=None)
    def totals(x: torch.Tensor) -> Any:
        numbers = {"f32": numpy.float32(1.5), "i64": numpy.int64(2), "bool": numpy.bool_(True)}
        return fdp.psum(numbers, "i"), fdp.pmean(numbers, "i")

    sums, means = totals(torch.zeros(2))
    assert {k: v.item() for k, v in sums.items()} == {"f32": 3.0, "i64": 4, "bool": 2}
    assert {k: v.item() for k, v in means.items()} == {"f32": 1.5, "i64": 2.0, "bool": 1.0}


def through_collectives(numbers: dict[str, Any]) -> tuple[Any, ...]:
    """``numbers`` (the same on both of 2 CPU replicas) through psum, pmean, pmax, all_gather
    and a ppermute that swaps the replicas' values."""

    @fdp.pmap(axis_name="i", devices=cpus(2), out_axes=None)
    def combined(x: torch.Tensor) -> Any:
        return (
            fdp.psum(numbers, "i"),
            fdp.pmean(numbers, "i"),
            fdp.pmax(numbers, "i"),
            fdp.all_gather(numbers, "i"),
            fdp.ppermute(numbers, "i", [(0, 1), (1, 0)]),
        )

    return combined(torch.zeros(2))


def test_numpy_scalars_keep_their_dtype() -> None:
    # As torch.as_tensor makes them, and as jax.lax's collectives keep them. Taken as Python
    # numbers, they came back float32 or int64 whatever their dtype, but np.float64 (a float)
    # kept float64 in psum and not in pmean.
    numpy = pytest.importorskip("numpy")
    numbers = {
        "f16": numpy.float16(1.5),
        "f32": numpy.float32(1.5),
        "f64": numpy.float64(1.5),
        "i16": numpy.int16(2),
        "u8": numpy.uint8(2),
        "bool": numpy.bool_(True),
        "u32": numpy.uint32(2),  # torch adds no uint32 on the CPU: as its int
    }

    sums, means, maxima, gathered, permuted = through_collectives(numbers)
    own = {k: torch.as_tensor(v).dtype for k, v in numbers.items()}
    counted = {**own, "bool": torch.int64, "u32": torch.int64}
    assert {k: v.dtype for k, v in sums.items()} == counted
    assert {k: v.item() for k, v in sums.items()} == {k: 2 * v.item() for k, v in numbers.items()}
    # pmean averages integers and booleans as floats of the default dtype, as Python's.
    floats = dict.fromkeys(["i16", "u8", "bool", "u32"], torch.get_default_dtype())
    assert {k: v.dtype for k, v in means.items()} == {**own, **floats}
    assert {k: v.item() for k, v in means.items()} == {k: float(v.item()) for k, v in numbers.items()}
    assert {k: v.dtype for k, v in maxima.items()} == {**own, "u32": torch.int64}
    for tree in (gathered, permuted):
        assert {k: v.dtype for k, v in tree.items()} == own
    assert {k: v.tolist() for k, v in gathered.items()} == {k: [v.item()] * 2 for k, v in numbers.items()}


def test_numpy_scalars_torch_has_no_tensor_of_are_taken_as_the_nearest_dtype() -> None:
    # torch.as_tensor refuses np.uint64 ("an integer is required") and np.longdouble: taken as
    # Python numbers, they ran (np.uint64 as int64; np.longdouble in pmean), and keeping the
    # NumPy dtype must not make them fail with torch's words, naming neither call nor leaf.
    numpy = pytest.importorskip("numpy")
    numbers = {"u64": numpy.uint64(3), "long": numpy.longdouble(1.5)}

    sums, means, maxima, gathered, permuted = through_collectives(numbers)
    nearest = {"u64": torch.int64, "long": torch.float64}
    for tree in (sums, maxima, gathered, permuted):
        assert {k: v.dtype for k, v in tree.items()} == nearest
    assert {k: v.dtype for k, v in means.items()} == {"u64": torch.get_default_dtype(), "long": torch.float64}
    assert {k: v.tolist() for k, v in sums.items()} == {"u64": 6, "long": 3.0}
    assert {k: v.tolist() for k, v in means.items()} == {"u64": 3.0, "long": 1.5}
    assert {k: v.tolist() for k, v in gathered.items()} == {"u64": [3, 3], "long": [1.5, 1.5]}


def test_psum_of_numbers_counts_replicas() -> None:
    out = fdp.pmap(lambda x: fdp.psum(1, "i") + x * 0, axis_name="i", devices=cpus(8))(torch.zeros(10))
    assert out.tolist() == [5.0] * 10  # 10 rows over 8 devices: 5 replicas


def test_one_exchange_per_call_with_one_buffer_per_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    exchange = _replica.CallGroup.exchange

    def counting(self, index, what, payload, combine):
        calls.append(len(payload[1]))  # buffers this replica brought
        return exchange(self, index, what, payload, combine)

    monkeypatch.setattr(_replica.CallGroup, "exchange", counting)
    tree = {f"w{k}": torch.randn(N, 3) for k in range(10)} | {
        f"d{k}": torch.randn(N, 2).double() for k in range(5)
    }
    per_row(lambda t: fdp.psum(t, "i"))(tree)
    assert calls == [2] * N  # one exchange per replica, two flat buffers (float32, float64)


# --- all_gather --------------------------------------------------------------------------------


def test_all_gather_untiled() -> None:  # JAX: testGather
    x = rows()
    out = per_row(lambda x: fdp.all_gather(x[0], "i"))(x)
    torch.testing.assert_close(out, torch.stack([x] * N).reshape(N * N, -1))


def test_all_gather_bool() -> None:  # JAX: testGatherBool
    x = rows() > 0
    out = per_row(lambda x: fdp.all_gather(x[0], "i"), out_axes=None)(x)
    assert torch.equal(out, x)


def test_all_gather_negative_dim() -> None:  # JAX: testGatherNegativeAxis
    x = rows()
    out = per_row(lambda x: fdp.all_gather(x[0], "i", dim=-1), out_axes=None)(x)
    torch.testing.assert_close(out, x.T)


def test_all_gather_tiled() -> None:  # JAX: testGatherTiled
    x = rows()
    out = per_row(lambda x: fdp.all_gather(x, "i", tiled=True), out_axes=None)(x)
    torch.testing.assert_close(out, x)


def test_all_gather_tiled_negative_dim() -> None:  # JAX: testGatherTiledNegativeAxis
    x = torch.arange(N * 4 * 3, dtype=torch.float32).reshape(N, 4, 3)
    out = per_row(lambda x: fdp.all_gather(x[0], "i", dim=-1, tiled=True), out_axes=None)(x)
    torch.testing.assert_close(out, x.permute(1, 0, 2).reshape(4, -1))


def test_all_gather_bad_dim() -> None:
    with pytest.raises(ValueError, match="dim=3 is out of range for a stacked gather"):
        per_row(lambda x: fdp.all_gather(x[0], "i", dim=3))(rows())


def test_all_gather_bad_dim_names_the_leaf() -> None:
    with pytest.raises(
        ValueError, match=re.escape("gather of x['n'], of type float32[] (a tiled gather concatenates")
    ):
        per_row(lambda x: fdp.all_gather({"x": x, "n": x.sum()}, "i", dim=1, tiled=True))(rows())
    with pytest.raises(
        ValueError, match=re.escape("gather of x[1], of type float32[3] (a dim in [-2, 1] fits)")
    ):
        per_row(lambda x: fdp.all_gather((x, x[0]), "i", dim=-3))(rows())


# --- psum_scatter and all_to_all -----------------------------------------------------------------
#
# Oracles: the replicas' values stacked into one tensor (replica i's is values[i]), cut and
# summed or swapped with torch ops on one device, as jax.lax.psum_scatter and all_to_all define.


def scattered_sums(values: torch.Tensor, dim: int, tiled: bool) -> list[torch.Tensor]:
    """Each replica's piece of the sum (psum_scatter's oracle)."""
    total = values.sum(0)
    return list(total.chunk(len(values), dim) if tiled else total.unbind(dim))


def swapped(values: torch.Tensor, split: int, concat: int, tiled: bool) -> list[torch.Tensor]:
    """Each replica's result of an all_to_all (its oracle)."""
    n = len(values)
    pieces = [[v.chunk(n, split)[r] if tiled else v.select(split, r) for v in values] for r in range(n)]
    return [torch.cat(p, concat) if tiled else torch.stack(p, concat) for p in pieces]


def values_for(shape: list[int], dim: int, tiled: bool, n: int = 3) -> torch.Tensor:
    """n replicas' random values of ``shape``, with ``dim`` of size n (tiled: 2 n)."""
    shape = list(shape)
    shape[dim] = 2 * n if tiled else n
    return torch.randn(n, *shape, dtype=torch.float64, requires_grad=True)


def check_against(
    oracle: Callable[[torch.Tensor], list[torch.Tensor]],
    collective: Callable[[Any], Any],
    values: torch.Tensor,
) -> None:
    """``collective`` in n replicas against ``oracle``: values, the gradient of a backward
    through the call, and the gradient inside the replicas under torch.func.grad (the transpose)."""
    n = len(values)
    mapped = fdp.pmap(lambda v: collective(v[0])[None], axis_name="i", devices=cpus(n))
    out, expected = mapped(values), torch.stack(oracle(values))
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected)
    weights = torch.randn_like(expected)
    (grad,) = torch.autograd.grad((out * weights).sum(), values)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), values)
    torch.testing.assert_close(grad, expected_grad)

    def inner(v: torch.Tensor) -> torch.Tensor:
        # Replica r weighs its result by weights[r]: the transpose must route each cotangent back.
        loss = lambda v: (collective(v) * weights[fdp.axis_index("i")]).sum()  # noqa: E731
        return torch.func.grad(loss)(v[0])[None]

    inside = fdp.pmap(inner, axis_name="i", devices=cpus(n))(values.detach())
    torch.testing.assert_close(inside, expected_grad)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_psum_scatter_is_the_sum_cut_into_pieces(dim: int, tiled: bool) -> None:  # JAX: testReduceScatter*
    values = values_for([2, 5, 4], dim, tiled)
    check_against(
        lambda v: scattered_sums(v, dim, tiled),
        lambda x: fdp.psum_scatter(x, "i", dim=dim, tiled=tiled),
        values,
    )


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize(("split", "concat"), [(0, 0), (0, 2), (2, 0), (1, -1), (-1, 1)])
def test_all_to_all_swaps_pieces_between_replicas(
    split: int, concat: int, tiled: bool
) -> None:  # JAX: testAllToAll*
    values = values_for([2, 5, 4], split, tiled)
    check_against(
        lambda v: swapped(v, split, concat, tiled),
        lambda x: fdp.all_to_all(x, "i", split, concat, tiled=tiled),
        values,
    )


@pytest.mark.parametrize("collective", ["psum_scatter", "all_to_all"])
def test_psum_scatter_and_all_to_all_under_vmap_inside_the_replicas(collective: str) -> None:
    values = values_for([3, 4], 0, False)
    if collective == "psum_scatter":
        op, oracle = (lambda x: fdp.psum_scatter(x, "i")), scattered_sums(values, 0, False)
    else:
        op, oracle = (lambda x: fdp.all_to_all(x, "i", 0, 1)), swapped(values, 0, 1, False)
    # vmap over 2 rows (the values, then twice them) inside each replica.
    mapped = fdp.pmap(
        lambda v: torch.func.vmap(op)(torch.stack([v[0], 2 * v[0]]))[None], axis_name="i", devices=cpus(3)
    )
    out = mapped(values.detach())
    expected = torch.stack(oracle).detach()
    torch.testing.assert_close(out, torch.stack([expected, 2 * expected], 1))


def test_psum_scatter_of_a_tree_sums_each_leaf_in_its_dtype() -> None:
    # Leaves of three dtypes packed in one exchange (two float32 leaves share a buffer), booleans
    # counted as in psum, an empty leaf.
    def f(x: torch.Tensor) -> Any:
        r = fdp.axis_index("i")
        tree = {
            "a": x[0].reshape(2, 2),
            "b": torch.arange(6).reshape(2, 3) * (r + 1),
            "flags": torch.tensor([[True], [r == 0]]),
            "c": x[0].reshape(2, 2) * 10,
            "empty": torch.zeros(2, 0),
        }
        return {k: v[None] for k, v in fdp.psum_scatter(tree, "i").items()}

    x = torch.arange(8.0).reshape(2, 4)
    out = fdp.pmap(f, axis_name="i", devices=cpus(2))(x)
    total = x.sum(0).reshape(2, 2)
    torch.testing.assert_close(out["a"], total)
    torch.testing.assert_close(out["c"], total * 10)
    assert torch.equal(out["b"], torch.arange(6).reshape(2, 3) * 3)
    assert torch.equal(out["flags"], torch.tensor([[2], [1]]))
    assert out["empty"].shape == (2, 0)


def test_psum_scatter_then_all_gather_is_psum() -> None:
    # The sharded form of a psum (ZeRO's gradient reduction): each replica reduces its piece,
    # then gathers the others'.
    x = torch.randn(4, 8)

    def sharded(x: torch.Tensor) -> torch.Tensor:
        piece = fdp.psum_scatter(x[0], "i", tiled=True)
        return fdp.all_gather(piece, "i", tiled=True)[None]

    out = fdp.pmap(sharded, axis_name="i", devices=cpus(4))(x)
    torch.testing.assert_close(out, x.sum(0, keepdim=True).expand(4, -1))


def test_all_to_all_twice_with_dims_swapped_is_the_identity() -> None:
    x = torch.randn(3, 3, 6)  # each replica: (1, 3, 6)
    back_and_forth = lambda x: fdp.all_to_all(fdp.all_to_all(x, "i", 1, 2, tiled=True), "i", 2, 1, tiled=True)  # noqa: E731
    assert torch.equal(fdp.pmap(back_and_forth, axis_name="i", devices=cpus(3))(x), x)


def test_mixture_of_experts_layer_of_the_docs() -> None:
    # docs/collectives.md: each replica holds one expert; tokens[i, j] (replica i's slot for
    # expert j) goes to replica j, through its expert, and back.
    @fdp.pmap(axis_name="experts", in_axes=(0, 0), devices=cpus(4))
    def moe_layer(expert_w: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        arrived = fdp.all_to_all(tokens[0], "experts", 0, 0)
        processed = arrived @ expert_w[0]
        return fdp.all_to_all(processed, "experts", 0, 0)[None]

    weights, tokens = torch.randn(4, 5, 5), torch.randn(4, 4, 3, 5)
    torch.testing.assert_close(moe_layer(weights, tokens), torch.einsum("ijcd,jde->ijce", tokens, weights))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda x: fdp.psum_scatter(x, "i"),
            ValueError,
            (
                "x, of type float32[3,2], has size 3 along dim=0, but an untiled "
                "fdp.psum_scatter needs 2, one row per replica of axis 'i' (fdp.axis_size('i') is 2); "
                "with tiled=True"
            ),
        ),
        (
            lambda x: fdp.psum_scatter({"w": x[:, :1]}, "i", dim=1, tiled=True),
            ValueError,
            "x['w'], of type float32[3,1], has size 1 along dim=1, but a tiled",
        ),
        (
            lambda x: fdp.psum_scatter({"w": x}, "i", tiled=True),
            ValueError,
            (
                "x['w'], of type float32[3,2], has size 3 along dim=0, but a tiled "
                "fdp.psum_scatter cuts it into 2 equal pieces"
            ),
        ),
        (
            lambda x: fdp.psum_scatter([x.sum()], "i"),
            TypeError,
            (
                "fdp.psum_scatter splits tensors into one piece per replica along dim=0, but "
                "x[0] is float32[], which has no dim to split"
            ),
        ),
        (
            lambda x: fdp.psum_scatter(2.0, "i"),
            TypeError,
            "but x is 2.0, of type float, which has no dim to split",
        ),
        (
            lambda x: fdp.psum_scatter(x, "i", dim=2),
            ValueError,
            "fdp.psum_scatter: dim=2 is out of range for x, of type float32[3,2] (a dim in [-2, 1] fits)",
        ),
        (
            lambda x: fdp.psum_scatter(x, "i", dim="0"),
            TypeError,
            "fdp.psum_scatter: dim must be an int, got str: '0'",
        ),
        (
            lambda x: fdp.all_to_all(x, "i", 1, 2),
            ValueError,
            (
                "fdp.all_to_all: concat_dim=2 is out of range for x, of type float32[3,2] (the "
                "result has rank 2: a dim in [-2, 1] fits)"
            ),
        ),
        (
            lambda x: fdp.all_to_all(x, "i", -3, 0),
            ValueError,
            "fdp.all_to_all: split_dim=-3 is out of range for x",
        ),
        (
            lambda x: fdp.all_to_all(x, "i", 0, 0),
            ValueError,
            "x, of type float32[3,2], has size 3 along split_dim=0, but an untiled fdp.all_to_all needs 2",
        ),
        (
            lambda x: fdp.all_to_all(x, "i", 0, True),
            TypeError,
            "fdp.all_to_all: concat_dim must be an int, got bool: True",
        ),
    ],
)
def test_psum_scatter_and_all_to_all_bad_input(call: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=re.escape(match)):
        fdp.pmap(call, axis_name="i", devices=cpus(2))(torch.ones(6, 2))


def test_psum_scatter_names_different_shapes_as_the_replicas_passed_them() -> None:
    # Packed as (n, ...) rows, the message still shows the shapes the replicas passed.
    f = lambda x: fdp.psum_scatter(torch.ones(3, 2 + 2 * fdp.axis_index("i")), "i", dim=1, tiled=True)  # noqa: E731
    message = (
        "fdp.psum_scatter: the replicas passed different shapes or dtypes at x: replica "
        "0 passed float32[3,2] but replica 1 passed float32[3,4]"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        fdp.pmap(f, axis_name="i", devices=cpus(2))(torch.ones(2))


@pytest.mark.parametrize(
    ("call", "shown"),
    [
        # A square leaf summed along dim 0 on one replica and dim 1 on the other packs alike:
        # replica 0 got the sum of its rows and the other's columns.
        (
            lambda x, r: fdp.psum_scatter(x[:4].reshape(2, 2), "i", dim=r),
            ["fdp.psum_scatter(dim=0, tiled=False)", "fdp.psum_scatter(dim=1, tiled=False)"],
        ),
        # Cut along dims of equal size, pieces of shape [3, 2] and [2, 3] pack alike: each
        # replica read the other's pieces in its own layout, scrambled.
        (
            lambda x, r: fdp.all_to_all(x.reshape(2, 3, 2), "i", 2 * r, 0),
            [
                "fdp.all_to_all(split_dim=0, concat_dim=0, tiled=False)",
                "fdp.all_to_all(split_dim=2, concat_dim=0, tiled=False)",
            ],
        ),
    ],
)
def test_replicas_that_cut_along_different_dims_are_refused(call: Any, shown: list[str]) -> None:
    f = lambda x: call(x[0], fdp.axis_index("i"))[None]  # noqa: E731
    with pytest.raises(ValueError, match="the replicas called different collectives") as caught:
        fdp.pmap(f, axis_name="i", devices=cpus(2))(torch.arange(24.0).reshape(2, 12))
    for r, called in enumerate(shown):
        assert f"{called} (replica {r})" in str(caught.value)


class _Allocated(TorchDispatchMode):
    """Counts the bytes of the new tensors that the ops run under it allocate."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        held = {
            t.untyped_storage().data_ptr()
            for t in optree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held:
                held.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize(
    ("collective", "extra"),
    [
        (lambda x: fdp.all_to_all(x, "i", 0, 0), 3),  # each buffer's gradient, stacked once
        (lambda x: fdp.psum_scatter(x, "i"), 0),  # the sum's, likewise (smaller than x)
    ],
)
def test_the_backward_of_psum_scatter_and_all_to_all_allocates_the_gradient_once(
    collective: Any, extra: int
) -> None:
    # Indexed once per replica, every buffer got n gradients of its full size, mostly zeros,
    # added up: over 8 replicas, all_to_all's backward allocated 16 times the data more than a
    # copy's; psum_scatter's, the whole sum 8 times.
    n = 8
    x = torch.randn(n, n, 100, dtype=torch.float64, requires_grad=True)

    def allocated(f: Any) -> int:
        out = per_row(lambda v: f(v[0])[None], n=n)(x)
        with _Allocated() as counted:
            out.backward(torch.ones_like(out))
        return counted.bytes

    copied = allocated(torch.clone)  # what the call itself allocates in the backward
    assert allocated(collective) <= copied + extra * x.nbytes


# --- ppermute, axis_index, axis_size ------------------------------------------------------------


def test_ppermute_rotation() -> None:  # JAX: testCollectivePermute
    rotation = [(i, (i + 1) % N) for i in range(N)]
    x = rows()
    torch.testing.assert_close(per_row(lambda x: fdp.ppermute(x, "i", rotation))(x), x.roll(1, 0))


def test_ppermute_pairs_in_any_order_are_one_perm() -> None:
    # A perm is a set of pairs: replicas that list them in different orders call one collective.
    rotation = [(i, (i + 1) % N) for i in range(N)]
    x = rows()
    out = per_row(
        lambda x: fdp.ppermute(x, "i", rotation[fdp.axis_index("i") :] + rotation[: fdp.axis_index("i")])
    )(x)
    torch.testing.assert_close(out, x.roll(1, 0))


def test_ppermute_destination_without_source_gets_zeros() -> None:
    shift = [(i, i + 1) for i in range(N - 1)]
    x = rows() + 10
    out = per_row(lambda x: fdp.ppermute(x, "i", zip(*zip(*shift))))(x)  # any iterable of pairs
    torch.testing.assert_close(out[0], torch.zeros(3))
    torch.testing.assert_close(out[1:], x[:-1])


@pytest.mark.parametrize(
    ("perm", "match"),
    [
        ([(0, 1), (0, 2)], "sources and destinations in perm must be unique"),
        ([(0, 7)], r"names replica 7, but 4 replicas run"),
        ([(0,)], "perm must be a sequence of"),
        ([(0.9, 1)], "perm must be a sequence of"),  # not truncated into a send from replica 0
        ([("0", "1")], "perm must be a sequence of"),
    ],
)
def test_ppermute_bad_perm(perm: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        per_row(lambda x: fdp.ppermute(x, "i", perm))(rows())


def test_axis_index_and_size() -> None:
    out = fdp.pmap(
        lambda x: torch.stack([torch.tensor(fdp.axis_index("i")), torch.tensor(fdp.axis_size("i"))])[None],
        axis_name="i",
        devices=cpus(8),
    )(torch.zeros(10))
    assert out.tolist() == [[r, 5] for r in range(5)]  # five replicas of 2 rows


# --- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
def test_axis_name_set_after_a_call_is_used_from_the_next_call(n: int) -> None:
    mapped = fdp.pmap(lambda x: x, devices=cpus(n))
    mapped(torch.ones(2))
    mapped.fn = lambda x: fdp.psum(x, "i")
    mapped.axis_name = "i"
    torch.testing.assert_close(mapped(torch.ones(2)), torch.full((2,), float(n)))
    with pytest.raises(TypeError, match=r"axis_name must be hashable, got \[\]"):
        mapped.axis_name = []


def test_unbound_axis_names() -> None:
    with pytest.raises(NameError, match="unbound axis name: i"):
        fdp.psum(torch.ones(1), "i")
    with pytest.raises(NameError, match=r"unbound axis name: j .*axis_name='i'"):
        per_row(lambda x: fdp.psum(x, "j"))(rows())
    with pytest.raises(NameError, match="unbound axis name: i .*no axis_name"):
        fdp.pmap(lambda x: fdp.axis_index("i") + x, devices=cpus(2))(torch.zeros(2))


@pytest.mark.parametrize(
    ("name", "call", "option", "advice"),
    [
        (
            "psum",
            lambda x: fdp.psum(x, "i", axis_index_groups=[[0, 1], [2, 3]]),
            "axis_index_groups",
            "no groups",
        ),
        ("pmean", lambda x: fdp.pmean(x, "i", axis_index_groups=[[0, 1]]), "axis_index_groups", "no groups"),
        ("pmax", lambda x: fdp.pmax(x, "i", axis_index_groups=[[0, 1]]), "axis_index_groups", "no groups"),
        ("pmin", lambda x: fdp.pmin(x, "i", axis_index_groups=[[0, 1]]), "axis_index_groups", "no groups"),
        (
            "all_gather",
            lambda x: fdp.all_gather(x, "i", axis=1),
            "axis",
            "fdp.all_gather's is dim: fdp.all_gather(x, axis_name, dim=1)",
        ),
        (
            "psum_scatter",
            lambda x: fdp.psum_scatter(x, "i", scatter_dimension=1, tiled=True),
            "scatter_dimension",
            "fdp.psum_scatter's is dim: fdp.psum_scatter(x, axis_name, dim=1)",
        ),
        (
            "all_to_all",
            lambda x: fdp.all_to_all(x, "i", split_axis=1, concat_axis=0),
            "split_axis",
            "split_dim=1",
        ),
        ("all_to_all", lambda x: fdp.all_to_all(x, "i", 1, concat_axis=0), "concat_axis", "concat_dim=0"),
    ],
)
def test_jax_lax_keywords_say_what_fdp_calls_them(name: str, call: Any, option: str, advice: str) -> None:
    # A port of jax.lax code passes JAX's keywords; Python's "psum_scatter() got an unexpected
    # keyword argument 'scatter_dimension'" did not say that fdp's is dim.
    with pytest.raises(TypeError) as info:
        per_row(call)(rows())
    assert str(info.value).startswith(
        f"fdp.{name} got an unexpected keyword argument '{option}' (jax.lax.{name}'s): "
    ), str(info.value)
    assert advice in str(info.value), str(info.value)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'typo'"):  # others: Python's error
        per_row(lambda x: fdp.psum(x, "i", typo=1))(rows())  # type: ignore[call-overload]


# --- differentiation through the whole call -----------------------------------------------------


@pytest.mark.parametrize(
    "collective",
    [
        lambda x: fdp.psum(x, "i"),
        lambda x: fdp.pmean(x, "i"),
        lambda x: fdp.pmax(x, "i"),
        lambda x: fdp.pmin(x, "i"),
        lambda x: fdp.all_gather(x[0], "i"),
        lambda x: fdp.all_gather(x, "i", tiled=True, dim=-1),
        lambda x: fdp.ppermute(x, "i", [(0, 2), (2, 1), (1, 0)]),
        lambda x: fdp.pmean(x.sin(), "i", weight=float(fdp.axis_index("i") + 1)),
    ],
    ids=["psum", "pmean", "pmax", "pmin", "all_gather", "all_gather_tiled", "ppermute", "pmean_weighted"],
)
def test_gradcheck_of_the_pmapped_function(collective: Any) -> None:  # JAX: testGradOfPsum, ...
    x = torch.randn(N, 3, dtype=torch.float64, requires_grad=True)
    f = per_row(lambda x: collective(x) * (1 + x.sum()))
    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


def test_inner_autograd_through_a_collective_is_refused() -> None:
    def f(x):
        total = fdp.psum(x.square().sum(), "i")
        (g,) = torch.autograd.grad(total, x)
        return g

    with pytest.raises(RuntimeError, match="differentiate through fdp.psum inside the mapped function"):
        per_row(f)(rows().requires_grad_())


@pytest.mark.parametrize(
    "name, collective",
    [
        ("fdp.psum", lambda x: fdp.psum(x, "i")),
        ("fdp.pmax", lambda x: fdp.pmax(x, "i")),
        ("fdp.all_gather", lambda x: fdp.all_gather(x, "i")),
        ("fdp.all_gather", lambda x: fdp.all_gather({"a": x, "b": x * 2}, "i")["a"]),
        ("fdp.ppermute", lambda x: fdp.ppermute(x, "i", [(0, 2), (2, 1), (1, 0), (3, 3)])),
    ],
)
@pytest.mark.parametrize("deterministic", [False, True])
def test_inner_autograd_through_a_collective_changed_in_place_is_refused(
    name: str, collective: Any, deterministic: bool
) -> None:
    # An in-place change of a result moves its node off the path of the backward; the refusal
    # must sit where the change leaves it upstream. (Under deterministic algorithms the first
    # replica's all_gather result was an alias of the gathered tensor, whose in-place change
    # rebases that tensor: the refusal was skipped, the graph half freed.)
    def f(x):
        result = collective(x.sin())
        result.mul_(2)
        if fdp.axis_index("i") > 0:  # the first replica's result is the one that differed
            return x
        (g,) = torch.autograd.grad(result.sum(), x)
        return g

    torch.use_deterministic_algorithms(deterministic)
    try:
        with pytest.raises(RuntimeError, match=f"differentiate through {name} inside the mapped function"):
            per_row(f)(rows().requires_grad_())
    finally:
        torch.use_deterministic_algorithms(False)


# --- differentiation inside replicas: JAX's transposes -------------------------------------------


def test_grad_of_psum_inside_replicas() -> None:
    # psum's transpose is psum: each replica's gradient is the sum of the cotangents, n * 2x.
    x = rows()
    out = per_row(lambda x: torch.func.grad(lambda x: fdp.psum((x**2).sum(), "i"))(x))(x)
    torch.testing.assert_close(out, N * 2 * x)


def test_grad_inside_pmap_with_psum_in_between() -> None:
    w = torch.randn(3)

    def step(x):
        def loss(x):
            h = torch.tanh(x) * w
            total = fdp.psum(h, "i")  # every replica sees the whole sum
            return (total**2).sum()

        return torch.func.grad(loss)(x)

    x = rows()
    out = per_row(step)(x)
    # d/dx_r of sum_j loss_j where loss_j = |sum_k tanh(x_k) w|^2 on every replica (n copies).
    total = (torch.tanh(x) * w).sum(0)
    expected = N * 2 * total * w * (1 - torch.tanh(x) ** 2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_grad_of_all_gather_is_psum_scatter() -> None:
    weights = torch.randn(N, 3)
    out = per_row(lambda x: torch.func.grad(lambda x: (fdp.all_gather(x[0], "i") * weights).sum())(x))(rows())
    torch.testing.assert_close(out, N * weights)


def test_grad_of_ppermute_is_the_inverse_permutation() -> None:  # JAX: testCollectivePermuteGrad
    shift = [(i, i + 1) for i in range(N - 1)]
    y = torch.pi + torch.arange(N, dtype=torch.float32)

    def f(x):
        mine = y[fdp.axis_index("i")]
        return torch.func.grad(lambda x: (mine * fdp.ppermute(x, "i", shift)).sum())(x)

    out = per_row(f)(torch.arange(N, dtype=torch.float32))
    torch.testing.assert_close(out, torch.cat([torch.pi + torch.arange(1, N), torch.zeros(1)]))


@pytest.mark.parametrize("devices", [["cpu"], ["cpu"] * 2])
def test_backward_through_a_call_whose_ppermute_sends_nothing_gives_zeros(devices: list[str]) -> None:
    # As jax.grad of a pmapped ppermute with perm=[]: the zeros are a function of x, with zero
    # gradient (torch raised "does not require grad"), an inf among them included (not x * 0).
    x = torch.tensor([1.0, float("inf")] * len(devices), requires_grad=True)
    out = fdp.pmap(lambda x: fdp.ppermute(x, "i", []), axis_name="i", devices=devices)(x)
    assert out.requires_grad
    torch.testing.assert_close(out.detach(), torch.zeros_like(x), rtol=0, atol=0)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.zeros_like(x), rtol=0, atol=0)


def test_grad_of_pmax_goes_to_the_largest() -> None:
    x = torch.tensor([1.0, 5.0, 3.0, 5.0])
    out = per_row(lambda x: torch.func.grad(lambda x: fdp.pmax(x, "i").sum())(x))(x)
    torch.testing.assert_close(out, torch.tensor([0.0, 2.0, 0.0, 2.0]))  # n cotangents, split over the tie


@pytest.mark.parametrize("collective", [fdp.pmax, fdp.pmin])
def test_grad_of_pmax_is_nan_where_the_extreme_is_nan(collective: Any) -> None:
    # As torch.amax's gradient, for every replica, the ones holding a number too (jax.grad has
    # no rule for pmax; of jnp.max over the gathered values, it gives 0 there).
    nan = float("nan")
    x = torch.tensor([[nan, 1.0], [2.0, 1.0], [nan, 3.0], [0.0, 3.0]])
    out = per_row(lambda x: torch.func.grad(lambda x: collective(x, "i").sum())(x))(x)
    whole = torch.func.grad(lambda x: (x.amax(0) if collective is fdp.pmax else x.amin(0)).sum())(x)
    torch.testing.assert_close(out, N * whole, equal_nan=True)
    assert out[:, 0].isnan().all() and not out[:, 1].isnan().any()


def test_double_grad_inside_replicas() -> None:
    x = rows()
    second = per_row(
        lambda x: torch.func.grad(lambda x: torch.func.grad(lambda x: fdp.psum((x**3).sum(), "i"))(x).sum())(
            x
        )
    )(x)
    # The inner grad is psum(1) * 3x^2 = 3n x^2 (the transpose sums constant cotangents).
    torch.testing.assert_close(second, N * 6 * x)


def test_grad_of_weighted_pmean_inside_replicas() -> None:
    # The transpose of a weighted mean sums the cotangents and gives each replica its own share
    # w_r / sum(w): the gradient of sum_s pmean_s = N * sum_j w_j x_j^2 / sum(w).
    x = rows(dtype=torch.float64)
    weights = [1.0, 2.0, 3.0, 4.0]
    out = per_row(
        lambda x: torch.func.grad(
            lambda x: fdp.pmean((x**2).sum(), "i", weight=weights[fdp.axis_index("i")])
        )(x)
    )(x)
    expected = torch.stack([N * w / sum(weights) * 2 * x[r] for r, w in enumerate(weights)])
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replica_of_weight_0_leaves_its_value_out_of_the_weighted_mean(n: int, dtype: torch.dtype) -> None:
    # A language model's loss averaged over the tokens that count (cross_entropy with
    # ignore_index), weighted by their number: a shard with none of them has a loss of 0 / 0,
    # NaN, which 0 * NaN carried into the mean. One device's loss over the batch is finite.
    torch.manual_seed(0)
    logits = torch.randn(2 * n, 5, dtype=torch.float64)
    targets = torch.randint(0, 5, (2 * n,))
    targets[-2:] = -100  # the last replica's shard counts no token

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100).to(dtype)

    @fdp.pmap(axis_name="i", devices=cpus(n), out_axes=None)
    def mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counted = (targets != -100).sum()
        value, grad = torch.func.grad_and_value(
            lambda z: fdp.pmean(loss(z, targets), "i", weight=counted), argnums=0
        )(logits)[::-1]
        return value, fdp.all_gather(grad, "i", tiled=True)

    value, grad = mean_loss(logits, targets)
    expected = loss(logits, targets)
    torch.testing.assert_close(value, expected)
    # (Each replica differentiates the sum of all replicas' means, as under jax.pmap: n times it.)
    one_device = torch.func.grad(lambda z: loss(z, targets).float())(logits)
    torch.testing.assert_close(grad, n * one_device, atol=1e-2, rtol=1e-2)
    # The same through the whole call, differentiated outside.
    z = logits.clone().requires_grad_()
    whole = per_row(lambda z, t: fdp.pmean(loss(z, t), "i", weight=(t != -100).sum()), n=n, out_axes=None)
    out = whole(z, targets)
    torch.testing.assert_close(out, expected)
    out.float().backward()
    assert torch.isfinite(z.grad).all() and not z.grad[-2:].any()


@pytest.mark.parametrize("n", [2, 3])
def test_a_class_weighted_segmentation_loss_is_weighted_by_its_counted_pixels_class_weights(n: int) -> None:
    # docs/collectives.md: cross_entropy(weight=..., ignore_index=...) divides by the counted
    # pixels' class weights, so that sum, not their count, weighs the shards (7 maps: uneven).
    torch.manual_seed(0)
    logits = torch.randn(7, 4, 3, 3, dtype=torch.float64)
    labels = torch.randint(0, 4, (7, 3, 3))
    labels[torch.rand(7, 3, 3) < 0.3] = 255
    class_weights = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits, labels, weight=class_weights, ignore_index=255)

    @fdp.pmap(axis_name="i", devices=cpus(n), out_axes=None)
    def mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return fdp.pmean(loss(logits, labels), "i", weight=class_weights[labels[labels != 255]].sum())

    torch.testing.assert_close(mean_loss(logits, labels), loss(logits, labels))


def test_double_grad_through_all_gather_inside_replicas() -> None:
    # The inner grad goes through all_gather's transpose (psum_scatter), whose own transpose,
    # all_gather, the outer grad goes through: d/dx_r of sum_s 2N w_s . x_s is 2N w_r.
    x = rows(dtype=torch.float64)
    w = torch.randn(N, 3, dtype=torch.float64)
    second = per_row(
        lambda x: torch.func.grad(
            lambda x: torch.func.grad(lambda x: (fdp.all_gather(x[0], "i") ** 2 * w).sum())(x).sum()
        )(x)
    )(x)
    torch.testing.assert_close(second, 2 * N * w)


def test_a_backward_kept_past_the_call_is_refused_not_left_waiting() -> None:
    # A vjp function returned out of the call would run psum's transpose alone, with no other
    # replica ever to meet it: refused at once.
    f = per_row(lambda x: torch.func.vjp(lambda x: fdp.psum(x, "i"), x)[1], n=2, out_axes=fdp.PER_REPLICA)
    vjp_fn = f(rows(2)).values[0]
    with pytest.raises(
        RuntimeError, match="backward inside a torch.func transform ran after the pmapped call"
    ):
        finishes(lambda: vjp_fn(torch.ones(1, 3)))


def test_vmap_inside_replicas() -> None:
    x = torch.randn(N * 2, 3)  # two rows per replica, one vmap lane each
    out = fdp.pmap(
        lambda x: torch.func.vmap(lambda row: fdp.psum(row, "i"))(x), axis_name="i", devices=cpus(N)
    )(x)
    lanes = x.reshape(N, 2, 3).sum(0)
    torch.testing.assert_close(out, lanes.repeat(N, 1))


# --- no deadlock, ever ---------------------------------------------------------------------------


class Boom(Exception):
    pass


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_failing_replica_releases_the_others(where: str) -> None:
    def f(x):
        if where == "before" and fdp.axis_index("i") == 2:
            raise Boom("before the psum")
        y = fdp.psum(x, "i")
        if where == "after" and fdp.axis_index("i") == 2:
            raise Boom("after the psum")
        return fdp.psum(y, "i")

    with pytest.raises(Boom, match=f"{where} the psum") as info:
        finishes(lambda: per_row(f)(rows()))
    assert any("raised by replica 2 of 4" in note for note in info.value.__notes__)
    torch.testing.assert_close(
        finishes(lambda: per_row(lambda x: fdp.psum(x, "i"))(rows()))[0], rows().sum(0)
    )


@pytest.mark.parametrize("grad", [torch.func.grad, fdp.grad], ids=["torch.func.grad", "fdp.grad"])
def test_a_backward_collective_that_would_wait_on_its_own_thread_raises(
    monkeypatch: pytest.MonkeyPatch, grad: Any
) -> None:
    # Replicas sharing a GPU run their backward passes on one engine thread (see test_cuda);
    # here the check is forced on CPU replicas: every replica fails cleanly, none waits.
    monkeypatch.setattr(_collectives, "_shares_backward_thread", lambda context, device: True)
    step = per_row(lambda x: grad(lambda x: fdp.psum((x**2).sum(), "i"))(x))
    with pytest.raises(
        RuntimeError,
        match=r"fdp.psum's backward inside fdp.grad or a torch.func transform cannot run on replicas",
    ):
        finishes(lambda: step(rows()))
    monkeypatch.undo()
    torch.testing.assert_close(finishes(lambda: step(rows())), N * 2 * rows())


@pytest.mark.parametrize(
    ("devices", "index", "shared"),
    [
        (["cuda:0", "cuda:0"], 0, True),
        (["cuda:0", "cuda:1", "cuda:0"], 2, True),
        (["cuda:0", "cuda:1", "cuda:0"], 1, False),
        (["cuda:0", "cuda:1"], 0, False),
        (["cpu", "cpu"], 0, False),  # CPU backward runs in each replica's own thread
    ],
)
def test_which_replicas_share_a_backward_thread(devices: list[str], index: int, shared: bool) -> None:
    on = [torch.device(d) for d in devices]
    group = _replica.CallGroup(len(on), on)
    context = _replica.ReplicaContext("i", index, len(on), on[index], group)
    # Asked from another thread than the replica's (here: none is current), as the engine's is.
    assert _collectives._shares_backward_thread(context, on[index]) is shared
    assert not _collectives._shares_backward_thread(context, torch.device("cpu"))  # CPU tensors
    with _replica.entered(context):  # in the replica's own thread: no engine thread involved
        assert not _collectives._shares_backward_thread(context, on[index])


def test_a_replica_that_skips_a_collective() -> None:
    def f(x):
        if fdp.axis_index("i") == 1:
            return x
        return fdp.psum(x, "i")

    with pytest.raises(RuntimeError, match=r"replica 1 returned without calling fdp.psum"):
        finishes(lambda: per_row(f)(rows()))


@pytest.mark.parametrize("then", ["returns", "sums its gradients"])
@pytest.mark.parametrize("grad", [fdp.grad, torch.func.grad], ids=["fdp.grad", "torch.func.grad"])
def test_a_replica_whose_backward_skips_a_collective_is_told_why(grad: Any, then: str) -> None:
    # Every replica called the forward psum, but replica 1's loss is a constant there: its
    # backward never reaches the psum. The messages said to call the same collectives (which
    # every replica did) and to put none behind a condition.
    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        local = (x @ w).square().sum() if fdp.axis_index("i") == 0 else x.new_zeros(())
        return fdp.psum(local, "i")

    def step(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        grads = grad(loss)(w, x)
        return grads if then == "returns" else fdp.psum(grads, "i")

    mapped = fdp.pmap(step, axis_name="i", devices=cpus(2), in_axes=(None, 0))
    error, seen = (
        (RuntimeError, "replica 1 returned without calling fdp.psum \\(the backward of collective #0\\)")
        if then == "returns"
        else (ValueError, "the replicas called different collectives at the same point")
    )
    with pytest.raises(
        error,
        match=seen + r".* Replica 1 called the forward collective, but there that collective lies "
        r"on no path from the differentiated arguments to the differentiated value",
    ):
        finishes(lambda: mapped(torch.ones(3), torch.randn(4, 3)))


def test_replicas_calling_different_collectives() -> None:
    def f(x):
        return fdp.psum(x, "i") if fdp.axis_index("i") == 0 else fdp.pmax(x, "i")

    with pytest.raises(ValueError, match="the replicas called different collectives") as info:
        finishes(lambda: per_row(f)(rows()))
    # Both sides of the mismatch are named with a replica that called them, whichever came first.
    assert "fdp.psum (replica 0)" in str(info.value)
    assert re.search(r"fdp\.pmax \(replica [1-3]\)", str(info.value)), str(info.value)


@pytest.mark.parametrize(
    ("one", "other", "names"),
    [
        (
            lambda x: fdp.ppermute(x, "i", [(0, 1), (1, 0)]),
            lambda x: fdp.ppermute(x, "i", [(0, 1)]),
            (r"fdp\.ppermute\(perm=\[\(0, 1\), \(1, 0\)\]\)", r"fdp\.ppermute\(perm=\[\(0, 1\)\]\)"),
        ),
        (
            lambda x: fdp.pmean(x, "i"),
            lambda x: fdp.pmean(x, "i", weight=1.0),
            (r"fdp\.pmean\(weight=None\)", r"fdp\.pmean\(weight=a number\)"),
        ),
    ],
    ids=["ppermute", "pmean"],
)
def test_replicas_calling_one_collective_with_different_options_are_told_which(
    one: Callable[..., Any], other: Callable[..., Any], names: tuple[str, str]
) -> None:
    # By name alone the message would read "fdp.ppermute (replica 0) and fdp.ppermute (replica
    # 1)": the options say what differs.
    with pytest.raises(ValueError, match="the replicas called different collectives") as info:
        finishes(lambda: per_row(lambda x: one(x) if fdp.axis_index("i") == 0 else other(x))(rows()))
    assert re.search(names[0] + r" \(replica 0\)", str(info.value)), str(info.value)
    assert re.search(names[1] + r" \(replica [1-3]\)", str(info.value)), str(info.value)


def test_trees_with_a_tensor_in_a_non_node_field() -> None:
    # Structures compare node data with ==, which a tensor answers elementwise: the same tensor
    # object on every replica is the same structure; a tensor of each replica's own cannot be
    # told equal, which is a structure error rather than torch's "ambiguous" RuntimeError.
    @dataclasses.dataclass
    class Tagged:
        x: torch.Tensor
        tag: torch.Tensor = dataclasses.field(metadata={"pytree_node": False})

    shared = torch.tensor([1.0, 2.0])
    out = per_row(lambda x: fdp.psum(Tagged(x, shared), "i").x)(rows())
    torch.testing.assert_close(out, rows().sum(0, keepdim=True).expand(N, -1))
    with pytest.raises(ValueError, match="the replicas passed trees of different structure"):
        finishes(lambda: per_row(lambda x: fdp.psum(Tagged(x, torch.tensor([1.0, 2.0])), "i").x)(rows()))


def test_trees_with_nan_in_a_non_node_field() -> None:
    # Each replica's float("nan") is unequal to the others' (and to itself): node data compared
    # with == alone made the same tree "of different structure", printed twice alike.
    @dataclasses.dataclass
    class Scaled:
        x: torch.Tensor
        scale: float = dataclasses.field(metadata={"pytree_node": False})

    out = per_row(lambda x: fdp.psum(Scaled(x, float("nan")), "i").x)(rows())
    torch.testing.assert_close(out, rows().sum(0, keepdim=True).expand(N, -1))


def test_replicas_passing_different_shapes() -> None:
    with pytest.raises(
        ValueError, match=r"different shapes or dtypes at x\['v'\]: replica 0 passed float32\[4\]"
    ):
        finishes(
            lambda: fdp.pmap(lambda x: fdp.psum({"v": x}, "i"), axis_name="i", devices=cpus(8))(
                torch.zeros(30)
            )
        )
    # A dtype difference gets no advice about uneven shards.
    with pytest.raises(
        ValueError, match=r"replica 1 passed float64\[1\]\. Every replica must pass the same dtype"
    ):
        finishes(
            lambda: fdp.pmap(
                lambda x: fdp.psum(x if fdp.axis_index("i") == 0 else x.double(), "i"),
                axis_name="i",
                devices=cpus(2),
            )(torch.zeros(2))
        )
    # Leaves that agree come first: the one that differs is named, not the first.
    with pytest.raises(
        ValueError, match=r"at x\['b'\]: replica 0 passed float32\[1\] but replica 1 passed float32\[2\]"
    ):
        finishes(
            lambda: per_row(lambda x: fdp.psum({"a": x, "b": torch.ones(1 + fdp.axis_index("i"))}, "i"), n=2)(
                rows(2)
            )
        )
    # The advice fits the collective: a reduction can take a sum first, a gather cannot.
    with pytest.raises(ValueError, match=r"replica 1 passed float32\[1\]\. .*pad per-replica values"):
        finishes(
            lambda: fdp.pmap(lambda x: fdp.all_gather(x, "i"), axis_name="i", devices=cpus(2))(torch.zeros(3))
        )
    # The hint blames uneven shards, not a split rule: "balanced" cuts 7 rows into 4 and 3 too.
    with pytest.raises(ValueError) as caught:
        finishes(
            lambda: fdp.pmap(
                lambda x: fdp.all_gather(x, "i"), axis_name="i", devices=cpus(2), split="balanced"
            )(torch.zeros(7))
        )
    message = str(caught.value)
    assert "split='chunk'" not in message
    assert "With uneven shards (a batch that does not divide evenly over the replicas), pad" in message


def test_pmean_of_integers_is_refused() -> None:
    with pytest.raises(TypeError, match=r"fdp.pmean averages floating-point tensors, but x is int64\[1\]"):
        per_row(lambda x: fdp.pmean(x, "i"))(torch.arange(N))


def test_concurrent_calls_with_collectives_do_not_deadlock() -> None:
    f = per_row(lambda x: x - fdp.pmean(x, "i"))
    g = fdp.pmap(lambda x: fdp.psum(x, "i"), axis_name="i", devices=cpus(3))
    results: list[Any] = []
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(10):
                results.append((f if k % 2 else g)(rows(4 if k % 2 else 3)))
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors and len(results) == 80


# --- regressions from review -----------------------------------------------------------------------


def test_backward_through_different_collectives_is_an_error() -> None:
    def f(x):
        first = fdp.axis_index("i") == 0

        def loss(x):
            a, b = fdp.psum(x, "i"), fdp.psum(2 * x, "i")
            return a.sum() if first else b.sum()

        return torch.func.grad(loss)(x)

    with pytest.raises(ValueError, match="the backward of collective #"):
        finishes(lambda: fdp.pmap(f, axis_name="i", devices=cpus(2))(torch.ones(2)))


def test_vmap_over_uneven_shards_is_an_error() -> None:
    f = fdp.pmap(lambda x: torch.func.vmap(lambda r: fdp.psum(r, "i"))(x), axis_name="i", devices=cpus(2))
    with pytest.raises(ValueError, match="every replica must map over the same number of rows") as info:
        finishes(lambda: f(torch.ones(3)))
    # Both replicas named, with their buffers' shapes (the vmapped rows lead).
    assert re.search(r"\(\(\(2, 1\),\) on replica 0, \(\(1, 1\),\) on replica 1\)", str(info.value))


def test_in_place_ops_on_differentiable_results() -> None:
    x = rows().requires_grad_()
    out = per_row(lambda x: fdp.psum(x, "i").div_(2) * x)(x)
    out.sum().backward()
    # d/dx_j of sum_r (S / 2) * x_r, with S = sum_j x_j: S / 2 + (sum_r x_r) / 2 = S
    torch.testing.assert_close(x.grad, x.detach().sum(0).expand(N, -1))
    g = per_row(lambda x: torch.func.grad(lambda x: fdp.pmax(x, "i").mul_(2).sum())(x))(
        torch.tensor([1.0, 3, 2, 0])
    )
    torch.testing.assert_close(g, torch.tensor([0.0, 2 * N, 0, 0]))


@pytest.mark.parametrize("collective", [fdp.pmax, fdp.pmin])
@pytest.mark.parametrize("tree", ["one leaf", "several leaves"])
def test_in_place_ops_on_extremes_keep_the_backward_through_the_call(collective: Any, tree: str) -> None:
    """Every replica changes its pmax/pmin result in place, then backward() on the call's
    output: the gradient is the one-device one (amax's output, kept for its backward, is no
    replica's result)."""
    x = rows().requires_grad_()

    def f(x: torch.Tensor) -> torch.Tensor:
        value = x * x if tree == "one leaf" else (x * x, x[:, :1])
        out = collective(value, "i")
        out = out if tree == "one leaf" else out[0]
        return out.mul_(3) * x

    per_row(f)(x).sum().backward()
    expected = x.detach().clone().requires_grad_()
    extreme = (expected * expected).amax(0) if collective is fdp.pmax else (expected * expected).amin(0)
    (3 * extreme * expected).sum().backward()
    torch.testing.assert_close(x.grad, expected.grad)


def test_psum_of_booleans_counts() -> None:
    out = per_row(lambda x: fdp.psum(x > 0, "i") + fdp.psum(True, "i"))(torch.tensor([1.0, -1, 2, 3]))
    assert out.dtype == torch.int64 and out.tolist() == [3 + N] * N


def test_weights_summing_to_zero() -> None:
    with pytest.raises(ValueError, match="weights sum to 0.0"):
        per_row(lambda x: fdp.pmean(x, "i", weight=0.0))(rows())
    alone = fdp.pmap(lambda x: fdp.pmean(x, "i", weight=0.0), axis_name="i", devices=cpus(1))
    with pytest.raises(ValueError, match="weights sum to 0.0"):  # one replica has no exchange
        alone(rows())


@pytest.mark.parametrize("n", [1, 2])
def test_an_infinite_weight_is_refused_not_a_nan_mean(n: int) -> None:
    """inf / inf would make the weighted mean NaN, silently (with one replica too)."""
    f = per_row(lambda x: fdp.pmean(x, "i", weight=float("inf") if fdp.axis_index("i") == 0 else 1.0), n=n)
    with pytest.raises(ValueError, match=r"weight must be a finite non-negative number, got inf"):
        f(rows(n))


def test_finite_weights_whose_sum_overflows_are_refused_not_a_mean_of_zeros() -> None:
    """1e308 twice sums to inf: every w / inf is 0, a silent mean of zeros."""
    with pytest.raises(ValueError, match=r"weights sum to inf; they must sum to more than 0 and to a finite"):
        per_row(lambda x: fdp.pmean(x, "i", weight=1e308), n=2)(rows(2))


@pytest.mark.parametrize(
    ("weight", "described"),
    [
        ("2", r"str: '2'"),  # was taken as 2.0
        (torch.ones(2), r"float32\[2\]: tensor\(\[1., 1.\]\)"),
        (torch.tensor(1j), r"complex64\[\]"),
        ([2], r"list: \[2\]"),
    ],
)
def test_a_weight_that_is_not_one_real_number_is_refused_naming_it(weight: object, described: str) -> None:
    f = per_row(lambda x: fdp.pmean(x, "i", weight=weight), n=2)
    with pytest.raises(
        TypeError,
        match=r"^fdp.pmean: weight must be a number \(e.g. the replica's row count\) or "
        r"a one-element real tensor, got " + described,
    ):
        f(rows(2))


def test_weights_of_numpy_and_one_element_tensors_are_numbers() -> None:
    import numpy as np

    for weight in (np.float32(2.0), np.array(2.0), torch.tensor([2]), torch.tensor(2, dtype=torch.int64)):
        out = per_row(lambda x, w=weight: fdp.pmean(x, "i", weight=w), n=2)(torch.tensor([[1.0], [3.0]]))
        torch.testing.assert_close(out, torch.tensor([[2.0], [2.0]]))


def test_all_gather_takes_a_numpy_integer_dim() -> None:
    import numpy as np

    out = per_row(lambda x: fdp.all_gather(x, "i", dim=np.int64(1)), n=2)(rows(2))
    torch.testing.assert_close(out, per_row(lambda x: fdp.all_gather(x, "i", dim=1), n=2)(rows(2)))


def test_all_gather_dim_and_ppermute_indices_must_be_ints() -> None:
    with pytest.raises(TypeError, match=r"^fdp.all_gather: dim must be an int, got str: '0'\n"):
        per_row(lambda x: fdp.all_gather(x, "i", dim="0"), n=2)(rows(2))
    with pytest.raises(TypeError, match=r"^fdp.all_gather: dim must be an int, got bool: True\n"):
        per_row(lambda x: fdp.all_gather(x, "i", dim=True), n=2)(rows(2))
    with pytest.raises(
        TypeError, match=r"^fdp.ppermute: perm must be a sequence of \(source, destination\) pairs"
    ):
        per_row(lambda x: fdp.ppermute(x, "i", perm=[(False, True)]), n=2)(rows(2))


def test_ppermute_checks_a_one_pass_perm_as_a_list() -> None:
    # zip(...) and generators are read once (JAX #1703 was a zip read twice): the checks after
    # the first read found them empty, and passed (False, True) as a send from replica 0 to 1.
    with pytest.raises(
        TypeError,
        match=r"^fdp.ppermute: perm must be a sequence of \(source, destination\) pairs, "
        r"got \[\(False, True\)\]",
    ):
        per_row(lambda x: fdp.ppermute(x, "i", perm=((s, d) for s, d in [(False, True)])), n=2)(rows(2))
    with pytest.raises(TypeError, match=r"perm must be a sequence of .* got \[\(0, 1, 2\)\]"):
        per_row(lambda x: fdp.ppermute(x, "i", perm=iter([(0, 1, 2)])), n=2)(rows(2))


def test_a_weight_that_requires_grad_is_taken_as_a_number_without_a_warning() -> None:
    # (warnings are errors here: torch warns when a tensor that requires grad becomes a float)
    w = torch.tensor(2.0, requires_grad=True)
    f = fdp.pmap(
        lambda x, w: fdp.pmean(x, "i", weight=w * (1 + fdp.axis_index("i"))),
        in_axes=(0, None),
        axis_name="i",
        devices=cpus(2),
    )
    out = f(torch.tensor([[1.0], [4.0]]), w)
    torch.testing.assert_close(out, torch.tensor([[3.0], [3.0]]))  # (2 * 1 + 4 * 4) / 6


@pytest.mark.parametrize("n", [1, 3])
def test_weighted_pmean_of_a_tree_is_the_row_weighted_average(n: int) -> None:
    """Oracle: the mean over all rows, from per-replica means of uneven shards (7 rows over 3
    replicas: 3, 3, 1); every replica gets its own result, not a shared tensor."""
    x = torch.randn(7, 5, dtype=torch.float64)

    @fdp.pmap(axis_name="i", devices=cpus(n), out_axes=fdp.PER_REPLICA)
    def f(x: torch.Tensor) -> Any:
        means = {"a": x.mean(0), "b": [x.square().mean(0), x.sum() / x.shape[0]]}
        return fdp.pmean(means, "i", weight=x.shape[0])

    out = f(x)
    expected = {"a": x.mean(0), "b": [x.square().mean(0), x.sum() / 7]}
    for r in range(n):
        torch.testing.assert_close(fdp.unreplicate(out, r), expected)
    if n > 1:
        out["a"][0].add_(1.0)  # a replica changing its result in place changes no other
        torch.testing.assert_close(out["a"][1], expected["a"])


# --- each replica computes its own sum (CPU replicas in one process) ----------------------------


@pytest.mark.parametrize(
    ("reduce", "oracle"),
    [
        (lambda t: fdp.psum(t, "i"), lambda x: x.sum(0)),
        (lambda t: fdp.pmean(t, "i"), lambda x: x.mean(0)),
        (lambda t: fdp.pmean(t, "i", weight=2.0), lambda x: x.mean(0)),
    ],
    ids=["psum", "pmean", "weighted"],
)
@pytest.mark.parametrize("tree", ["one leaf", "several leaves"])
def test_sums_are_equal_on_every_replica_bit_for_bit(reduce: Any, oracle: Any, tree: str) -> None:
    """Each replica adds the buffers itself, in the same order: the results agree exactly with
    each other, match the one-device reduction, and share memory with no other replica's."""
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    storages: dict[int, set[int]] = {}

    @fdp.pmap(axis_name="i", devices=cpus(3), out_axes=fdp.PER_REPLICA)
    def f(x: torch.Tensor) -> Any:
        row = x[0]
        out = reduce(row if tree == "one leaf" else {"a": row, "b": [2 * row[0], row.sum()]})
        leaves = optree.tree_leaves(out, namespace="fdp")
        storages[fdp.axis_index("i")] = {t.untyped_storage().data_ptr() for t in leaves}
        return out

    out = f(x)
    total = oracle(x)
    expected = total if tree == "one leaf" else {"a": total, "b": [2 * total[0], total.sum()]}
    torch.testing.assert_close(fdp.unreplicate(out, 0), expected)
    leaves = [optree.tree_leaves(fdp.unreplicate(out, r), namespace="fdp") for r in range(3)]
    for r in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(leaves[0], leaves[r]))
    assert not storages[0] & storages[1] and not storages[1] & storages[2] and not storages[0] & storages[2]


def test_a_replica_changing_its_input_after_psum_does_not_change_another_replicas_sum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replica 0 returns from psum and zeroes its input in place before replica 1 has read it.

    The replicas read each other's buffers after the exchange; a one-leaf tree's buffer would
    be the leaf itself, so they must exchange copies.
    """
    zeroed = threading.Event()
    compute = _collectives._Deferred.__call__

    def late_for_replica_1(self: Any) -> torch.Tensor:
        if self.index == 1:
            assert zeroed.wait(10)
        return compute(self)

    monkeypatch.setattr(_collectives._Deferred, "__call__", late_for_replica_1)

    @fdp.pmap(axis_name="i", devices=cpus(2), out_axes=fdp.PER_REPLICA)
    def f(x: torch.Tensor) -> torch.Tensor:
        mine = x[0].clone()
        total = fdp.psum(mine, "i")
        if fdp.axis_index("i") == 0:
            mine.zero_()
            zeroed.set()
        return total

    out = f(torch.tensor([[1.0, 2.0], [10.0, 20.0]]))
    for r in range(2):
        torch.testing.assert_close(fdp.unreplicate(out, r), torch.tensor([11.0, 22.0]))


@pytest.mark.parametrize(
    "reduce", [fdp.psum, fdp.pmean, lambda t, name: fdp.pmean(t, name, weight=3.0), fdp.pmax, fdp.pmin]
)
@pytest.mark.parametrize("tree", ["one leaf", "several leaves"])
def test_one_replica_gets_its_value_in_memory_of_its_own(reduce: Any, tree: str) -> None:
    """One replica's sum (mean, maximum, ...) is its own value, handed back without arithmetic
    or exchange, in a buffer that is not its input's: changing the result in place leaves the
    input alone."""
    x = torch.randn(1, 6)

    @fdp.pmap(axis_name="i", devices=cpus(1), out_axes=None)
    def f(x: torch.Tensor) -> Any:
        value = x[0] if tree == "one leaf" else {"a": x[0], "b": x[0, :2]}
        out = reduce(value, "i")
        for leaf in optree.tree_leaves(out, namespace="fdp"):
            assert leaf.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
            leaf.add_(1.0)
        return out

    expected = x[0] + 1 if tree == "one leaf" else {"a": x[0] + 1, "b": x[0, :2] + 1}
    before = x.clone()
    torch.testing.assert_close(f(x), expected)
    assert torch.equal(x, before)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gradients_reduced_beside_their_loss_need_no_gradient_themselves(n: int) -> None:
    """torch.autograd.grad's gradients packed in one buffer with the loss that requires grad:
    their results require none (no graph of the loss's held, .numpy() works), the loss's does,
    and its gradient through the call is one device's."""
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(6, 3)

    @fdp.pmap(axis_name="i", devices=cpus(n), out_axes=None)
    def step(x: torch.Tensor) -> Any:
        loss = (x @ w).square().mean()
        (grad,) = torch.autograd.grad(loss, [w], retain_graph=True)  # the loss is differentiated again
        grad, loss = fdp.pmean((grad, loss), "i", weight=x.shape[0])
        assert not grad.requires_grad and grad.grad_fn is None
        return grad.numpy().copy(), loss

    grad, loss = step(x)
    (expected,) = torch.autograd.grad((x @ w).square().mean(), [w])
    torch.testing.assert_close(torch.from_numpy(grad), expected)
    assert loss.requires_grad
    torch.testing.assert_close(torch.autograd.grad(loss, [w])[0], expected)


def test_a_leaf_that_one_replica_differentiates_keeps_its_gradient_on_every_replica() -> None:
    # Replica 0's leaf is a constant, replica 1's depends on w: their sum depends on w on both.
    w = torch.tensor(2.0, requires_grad=True)

    @fdp.pmap(axis_name="i", devices=cpus(2))
    def f(x: torch.Tensor) -> torch.Tensor:
        value = x.sum() * w if fdp.axis_index("i") == 1 else torch.tensor(1.0)
        total, anchor = fdp.psum((value, x.sum() * w), "i")
        assert total.requires_grad
        return total[None] + 0 * anchor

    out = f(torch.ones(4, 1))
    assert out.tolist() == [5.0, 5.0]  # replica 0's 1, plus replica 1's 2 rows x w = 4
    (grad,) = torch.autograd.grad(out.sum(), [w])
    assert grad.item() == 2 * 2.0  # each replica's total holds replica 1's 2 * w


def test_one_replica_result_shares_nothing_with_the_value_even_through_numpy() -> None:
    """A lone replica's reduction copies its value at once. (A copy-on-write clone would be
    cheaper, but memory that NumPy or DLPack also points at would then be written behind torch's
    back: the result would change with the value, and the NumPy view stop following it.)"""
    x = torch.zeros(4)
    view = x.numpy()

    @fdp.pmap(axis_name="i", devices=cpus(1), in_axes=(None, 0), out_axes=None)
    def f(x: torch.Tensor, rows: torch.Tensor) -> Any:
        return {"sum": fdp.psum(x, "i"), "mean": fdp.pmean(x, "i"), "max": fdp.pmax(x, "i")}

    out = f(x, torch.zeros(1))
    view += 1  # the value changes through NumPy: the results keep theirs
    assert all(torch.equal(r, torch.zeros(4)) for r in out.values())
    x.add_(1)  # and through torch: NumPy's view follows
    assert (view == 2).all()


def _lone(fn: Callable[..., Any]) -> Any:
    """``fn`` on a lone CPU replica, its argument not mapped (a row count is)."""
    mapped = fdp.pmap(lambda x, rows: fn(x), axis_name="i", devices=cpus(1), in_axes=(None, 0), out_axes=None)
    return lambda x: mapped(x, torch.zeros(1))


@pytest.mark.parametrize(
    "reduce",
    [
        lambda x, donate: fdp.psum(x, "i", donate=donate),
        lambda x, donate: fdp.pmean(x, "i", donate=donate),
        lambda x, donate: fdp.pmean(x, "i", weight=3, donate=donate),
        lambda x, donate: fdp.pmax(x, "i", donate=donate),
        lambda x, donate: fdp.pmin(x, "i", donate=donate),
    ],
    ids=["psum", "pmean", "pmean weighted", "pmax", "pmin"],
)
def test_one_replica_donated_value_is_its_own_result(reduce: Callable[[Any, bool], Any]) -> None:
    """A value given up (donate=True) on a lone replica comes back as itself: no copy, where
    the same call otherwise copies (see the tests above). Numbers still become tensors."""
    value = {"w": torch.randn(3, 2), "b": torch.randn(2, dtype=torch.float64), "n": 2.0}
    seen: dict[bool, Any] = {}

    def f(x: Any, donate: bool) -> Any:
        out = reduce(x, donate)
        seen[donate] = ({k: out[k] is x[k] for k in ("w", "b")}, out["n"])
        return out

    for donate in (True, False):
        _lone(lambda x, donate=donate: f(x, donate))(value)
    assert seen[True][0] == {"w": True, "b": True}
    assert seen[False][0] == {"w": False, "b": False}
    assert all(isinstance(n, torch.Tensor) and n.item() == 2.0 for _, n in seen.values())


def test_one_replica_donation_still_copies_what_packing_changes() -> None:
    """Donated leaves that require grad, or are not contiguous, come back as without donation:
    copied (contiguous, as on several replicas), the gradient flowing through; in a tree that
    holds one, every leaf is packed as usual. A count of booleans is a new int64 tensor."""
    base = torch.randn(4, 3)
    w = torch.randn(3, requires_grad=True)
    seen: dict[str, Any] = {}

    def f(x: Any) -> Any:
        transposed = fdp.psum(x["t"], "i", donate=True)
        seen["t"] = (transposed is x["t"], transposed.is_contiguous(), torch.equal(transposed, x["t"]))
        both = fdp.pmean({"w": x["w"] * 2, "b": x["b"]}, "i", donate=True)
        seen["b"] = both["b"] is x["b"]
        counted = fdp.psum(x["t"] > 0, "i", donate=True)
        seen["count"] = (counted.dtype, torch.equal(counted, (x["t"] > 0).long()))
        return both["w"]

    out = _lone(f)({"t": base.t(), "w": w, "b": torch.ones(2)})
    out.sum().backward()
    assert seen["t"] == (False, True, True)
    assert seen["b"] is False  # packed beside the leaf that requires grad
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))
    assert seen["count"] == (torch.int64, True)


def test_one_replica_donation_keeps_every_check() -> None:
    """What a reduction refuses on several replicas, it refuses donated on one too."""
    with pytest.raises(TypeError, match=r"fdp.pmean averages floating-point tensors, but x\['n'\]"):
        _lone(lambda x: fdp.pmean(x, "i", donate=True))({"n": torch.arange(3)})
    with pytest.raises(TypeError, match=r"fdp.pmax .* but x is .*complex"):
        _lone(lambda x: fdp.pmax(x, "i", donate=True))(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"fdp.psum takes dense tensors, but x\[0\] is a tensor of layout"):
        _lone(lambda x: fdp.psum(x, "i", donate=True))([torch.eye(2).to_sparse()])
    with pytest.raises(ValueError, match="weights sum to 0.0"):
        _lone(lambda x: fdp.pmean(x, "i", weight=0.0, donate=True))(torch.ones(2))


@pytest.mark.parametrize("n", [2, 3])
def test_donation_changes_nothing_on_several_replicas(n: int) -> None:
    """Donation is used by a lone replica only: on several, the results are those without it,
    bit for bit, in memory of their own, and the donated values are left as they were."""
    x = torch.randn(6, 5)

    def f(x: torch.Tensor, donate: bool) -> Any:
        value = {"a": x * 1.5, "b": x.sum(0)}
        before = {k: v.clone() for k, v in value.items()}
        out = {
            "sum": fdp.psum(value, "i", donate=donate),
            "mean": fdp.pmean(value, "i", weight=x.shape[0], donate=donate),
            "max": fdp.pmax(value["a"], "i", donate=donate),
        }
        assert all(torch.equal(value[k], before[k]) for k in value)
        assert out["sum"]["a"] is not value["a"] and out["mean"]["b"] is not value["b"]
        return out

    def run(donate: bool) -> Any:
        return fdp.pmap(f, axis_name="i", devices=cpus(n), in_axes=(0, None), static_argnums=1)(x, donate)

    donated, kept = run(True), run(False)
    assert optree.tree_all(optree.tree_map(torch.equal, donated, kept, namespace="fdp"))


def test_donated_reduction_under_torch_func_on_one_replica() -> None:
    """Inside torch.func's transforms the reductions have JAX's transposes; donation changes
    nothing there (the gradient of a donated pmean is as without)."""

    def loss(w: torch.Tensor, x: torch.Tensor, donate: bool) -> torch.Tensor:
        return fdp.pmean((x * w).sum(), "i", donate=donate)

    x = torch.randn(4, 3)
    grad = fdp.pmap(
        torch.func.grad(loss), axis_name="i", devices=cpus(1), in_axes=(None, 0, None), static_argnums=2
    )
    donated, kept = grad(torch.ones(3), x, True), grad(torch.ones(3), x, False)
    torch.testing.assert_close(donated, kept)
    torch.testing.assert_close(kept, x.sum(0))


def test_one_replica_copies_are_contiguous_as_on_several() -> None:
    base = torch.randn(6, 4)
    before = base.clone()
    value = {"slice": base[2:4], "transposed": base.t(), "row": base[0], "strided": base[:, 1]}

    @fdp.pmap(axis_name="i", devices=cpus(1), in_axes=(None, 0), out_axes=None)
    def f(x: Any, rows: torch.Tensor) -> Any:
        out = fdp.psum(x, "i")  # one buffer for the four
        out["alone"] = fdp.psum(x["transposed"], "i")  # a buffer of its own
        for name, leaf in out.items():
            assert torch.equal(leaf, x.get(name, x["transposed"])) and leaf.is_contiguous()
            leaf.zero_()
        return out

    f(value, torch.zeros(1))
    assert torch.equal(base, before)


def test_one_replica_copies_in_one_pass_per_dtype() -> None:
    # A lone replica's reduction copies the tensors of one device and dtype together, into one
    # buffer: one kernel on a GPU rather than one per tensor. An empty one keeps its autograd
    # history.
    base = torch.randn(5, 4, requires_grad=True)

    @fdp.pmap(axis_name="i", devices=cpus(1), in_axes=(None, 0), out_axes=None)
    def f(base: torch.Tensor, rows: torch.Tensor) -> Any:
        tensors = [base[1:3], base.t(), base[0], torch.arange(3), base[:0]]
        copies = fdp.psum(tensors, "i")
        for original, copy in zip(tensors, copies):
            assert torch.equal(copy, original) and copy.is_contiguous() and copy.dtype == original.dtype
        storages = {c.untyped_storage().data_ptr() for c in copies[:3]}
        assert len(storages) == 1 and base.untyped_storage().data_ptr() not in storages
        return copies

    copies = f(base, torch.zeros(1))
    sum(c.sum() for c in copies if c.is_floating_point()).backward()
    expected = torch.ones(5, 4)  # every element once, through the transpose
    expected[:3] += 1  # rows 0, 1 and 2 once more, through the slices
    assert torch.equal(base.grad, expected) and copies[4].grad_fn is not None


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("collective", [fdp.pmax, fdp.pmin])
def test_complex_maximum_is_refused_on_one_replica_as_on_several(n: int, collective: Any) -> None:
    # torch cannot order complex numbers: one replica must not hand the value back where two
    # would fail. The error names the collective and the leaf, not torch's kernel.
    f = fdp.pmap(
        lambda x: collective({"r": x, "c": x.to(torch.complex64)}, "i"), axis_name="i", devices=cpus(n)
    )
    name = collective.__name__
    with pytest.raises(
        TypeError,
        match=re.escape(f"fdp.{name} takes the elementwise extreme of real values, but x['c'] is complex64["),
    ):
        f(torch.arange(4.0))


def _nested(layout: torch.layout) -> torch.Tensor:
    with warnings.catch_warnings():  # the strided layout's prototype warning
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.ones(3, 2), torch.ones(2, 2)], layout=layout)


@pytest.mark.parametrize(
    ("n", "donate", "collective"),
    [
        *((n, False, c) for n in (1, 2) for c in (fdp.psum, fdp.pmean, fdp.pmax, fdp.all_gather)),
        *((1, True, c) for c in (fdp.psum, fdp.pmean, fdp.pmax)),  # all_gather takes no donation
    ],
)
@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda: torch.eye(2).to_sparse(), "a tensor of layout torch.sparse_coo (type float32[2,2])"),
        (lambda: torch.eye(2).to_sparse_csr(), "a tensor of layout torch.sparse_csr (type float32[2,2])"),
        (lambda: _nested(torch.strided), "a nested tensor (type float32[nested tensor of 2 components])"),
        (lambda: _nested(torch.jagged), "a nested tensor (type float32[2,j"),  # j1, j2, ...: per tensor
    ],
    ids=["coo", "csr", "nested", "jagged"],
)
def test_sparse_and_nested_leaves_are_refused_by_name(
    n: int, donate: bool, collective: Any, make: Callable[[], torch.Tensor], what: str
) -> None:
    # torch's errors ("reshape is not implemented for sparse tensors", "unsupported memory format
    # option Contiguous", "Sparse CSR tensors do not have is_contiguous", "For now nested reshape
    # cannot change or infer the implicit batch dimension") named neither the collective nor the
    # leaf, alone in the tree or beside a dense leaf of the same dtype. A lone replica's donated
    # value, which is not packed, is refused alike.
    with warnings.catch_warnings():  # sparse CSR support "is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        leaf = make()
    options = {"donate": True} if donate else {}
    f = fdp.pmap(lambda x: collective({"d": x, "s": leaf}, "i", **options), axis_name="i", devices=cpus(n))
    name = collective.__name__
    with pytest.raises(TypeError, match=re.escape(f"fdp.{name} takes dense tensors, but x['s'] is {what}")):
        f(torch.ones(n))


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("collective", [fdp.psum, fdp.pmean, fdp.pmax, fdp.pmin])
def test_quantized_tensors_are_refused_by_reductions_on_one_replica_as_on_several(
    n: int, collective: Any
) -> None:
    # Several replicas failed in torch's kernel after the exchange, naming neither the collective
    # nor the leaf ("Could not run 'aten::add.out' with arguments from the 'QuantizedCPU'
    # backend"); one replica handed the value back. fdp.pmean said "use fdp.psum for integer
    # counts", which refuses them too. Gathering and permuting take them.
    q = quantized(torch.ones(3), 0.1)
    f = fdp.pmap(lambda x: collective({"d": x, "q": q}, "i"), axis_name="i", devices=cpus(n))
    name = collective.__name__
    with pytest.raises(
        TypeError, match=re.escape(f"fdp.{name} reduces dense numbers, but x['q'] is a quantized")
    ):
        f(torch.ones(n))
    gathered = fdp.pmap(lambda x: fdp.all_gather(q, "i"), axis_name="i", devices=cpus(n), out_axes=None)
    assert torch.equal(gathered(torch.ones(n)).dequantize(), torch.ones(n, 3))


def quantized(values: Any, scale: float) -> torch.Tensor:
    with warnings.catch_warnings():  # torch deprecates quantized tensors
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(torch.as_tensor(values, dtype=torch.float32), scale, 0, torch.quint8)


def test_quantized_leaves_of_different_scales_keep_their_values() -> None:
    # Packed into one buffer, quantized leaves took the first one's scale: 200 at scale 10
    # behind a leaf at scale 0.1 came back clipped to 25.5, silently, from all_gather, all_to_all
    # and ppermute. A replica's own scale travels with ppermute's value.
    def f(x: torch.Tensor) -> Any:
        r = fdp.axis_index("i")
        tree = {"small": quantized([1.0, 2.0], 0.1), "large": quantized([200.0, 100.0], 10.0)}
        sent = quantized([[5.0, 7.0], [200.0, 210.0]][r], [0.1, 10.0][r])
        return (
            fdp.all_gather(tree, "i"),
            fdp.all_to_all(tree, "i", 0, 0, tiled=True),
            fdp.ppermute(sent, "i", [(0, 1), (1, 0)]),
        )

    gathered, swapped, sent = fdp.pmap(f, axis_name="i", devices=cpus(2), out_axes=fdp.PER_REPLICA)(
        torch.ones(2)
    )
    for r in range(2):
        assert torch.equal(gathered["small"].values[r].dequantize(), torch.tensor([[1.0, 2.0]] * 2))
        assert torch.equal(gathered["large"].values[r].dequantize(), torch.tensor([[200.0, 100.0]] * 2))
        assert torch.equal(swapped["large"].values[r].dequantize(), torch.tensor([[200.0, 100.0][r]] * 2))
    assert torch.equal(sent.values[0].dequantize(), torch.tensor([200.0, 210.0]))
    assert torch.equal(sent.values[1].dequantize(), torch.tensor([5.0, 7.0]))


@pytest.mark.parametrize("collective", ["all_gather", "all_to_all"])
def test_joining_quantized_values_of_different_scales_is_refused(collective: str) -> None:
    def f(x: torch.Tensor) -> Any:
        r = fdp.axis_index("i")
        q = {"w": quantized([1.0, 200.0][r] * torch.ones(2), [0.1, 10.0][r])}
        return fdp.all_gather(q, "i") if collective == "all_gather" else fdp.all_to_all(q, "i", 0, 0)

    message = (
        f"fdp.{collective}: the replicas passed quantized tensors of different scales at x['w']: replica 0 "
        "passed scale 0.1, zero point 0 but replica 1 passed scale 10.0, zero point 0"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        fdp.pmap(f, axis_name="i", devices=cpus(2), out_axes=None)(torch.ones(2))


def test_per_channel_quantized_tensors_are_refused_by_name() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(
            torch.ones(2, 3), torch.tensor([0.1, 1.0]), torch.tensor([0, 0]), 0, torch.quint8
        )
    f = fdp.pmap(lambda x: fdp.all_gather({"q": q}, "i"), axis_name="i", devices=cpus(2))
    with pytest.raises(
        TypeError, match=re.escape("fdp.all_gather takes quantized tensors of one scale, but x['q']")
    ):
        f(torch.ones(2))


def test_one_replica_reduces_without_an_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing to meet: the lone replica's reductions skip the exchange (a step's worth of
    # Python on the one-replica path); other collectives still take it.
    exchanges: list[Any] = []
    exchange = _replica.CallGroup.exchange
    monkeypatch.setattr(
        _replica.CallGroup,
        "exchange",
        lambda self, *a, **k: exchanges.append(a[1]) or exchange(self, *a, **k),
    )

    @fdp.pmap(axis_name="i", devices=cpus(1), out_axes=None)
    def f(x: torch.Tensor) -> Any:
        return fdp.psum(x, "i"), fdp.pmean(x, "i", weight=2), fdp.pmax(x, "i"), fdp.all_gather(x, "i")

    x = torch.arange(3.0)
    total, mean, largest, gathered = f(x)
    assert all(torch.equal(t, x) for t in (total, mean, largest)) and torch.equal(gathered, x[None])
    assert [name for name, *_ in exchanges] == ["fdp.all_gather"]


def test_a_backward_collective_is_placed_where_the_engine_runs_it() -> None:
    # torch's autograd engine runs a backward on the thread of its first gradient that is not
    # on the CPU: a CPU leaf first in the tree must not hide a GPU shared by the replicas.
    cpu, elsewhere = torch.zeros(1), torch.zeros(1, device="meta")
    assert _collectives._backward_device([cpu, elsewhere], torch.device("cpu")) == torch.device("meta")
    assert _collectives._backward_device([cpu], torch.device("meta")) == torch.device("cpu")


@pytest.mark.parametrize(
    ("devices", "grad_device", "refused"),
    [
        (["cuda:0", "cuda:0"], "cuda:0", True),  # replicas share the GPU's engine thread
        (["cuda:0", "cuda:1"], "cuda:0", False),  # each its own
        (["cpu", "cpu"], "cuda:0", True),  # CUDA tensors in CPU replicas: may all be there
        (["cpu"], "cuda:0", False),  # a lone replica waits for no one
        (["cpu", "cpu"], "cpu", False),  # CPU backward runs in each replica's own thread
    ],
)
def test_backward_collectives_refuse_a_shared_engine_thread(
    devices: list[str], grad_device: str, refused: bool
) -> None:
    group = _replica.CallGroup(len(devices), [torch.device(d) for d in devices])
    context = _replica.ReplicaContext("i", 0, len(devices), group.devices[0], group)
    assert _collectives._shares_backward_thread(context, torch.device(grad_device)) is refused


# --- programs built on the collectives, against the same computation on one device --------------


def _grads(loss: torch.Tensor, tree: Any) -> Any:
    """The gradient of ``loss`` with respect to every leaf of ``tree``, as a tree like it."""
    leaves, spec = optree.tree_flatten(tree, namespace="fdp")
    return optree.tree_unflatten(spec, torch.autograd.grad(loss, leaves))


def _requiring_grad(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.clone().requires_grad_(), tree, namespace="fdp")


@pytest.mark.parametrize("n", [2, 3])
def test_a_contrastive_loss_over_uneven_shards_has_one_devices_value_and_gradients(n: int) -> None:
    # CLIP/SimCLR: each replica embeds its rows, gathers both towers' embeddings (padded to one
    # shape: the shards are uneven), scores its rows against the whole batch, with labels offset
    # by the rows of the replicas before it, and sums its rows' loss over the batch's size.
    torch.manual_seed(0)
    params = {"image": torch.randn(5, 4, dtype=torch.float64), "text": torch.randn(3, 4, dtype=torch.float64)}
    image, text = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    cross_entropy = torch.nn.functional.cross_entropy

    def embed(params: Any, image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normalize = torch.nn.functional.normalize
        return normalize(image @ params["image"], dim=-1), normalize(text @ params["text"], dim=-1)

    def one_device(params: Any, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        zi, zt = embed(params, image, text)
        logits, labels = zi @ zt.T * 10, torch.arange(len(image))
        return (cross_entropy(logits, labels) + cross_entropy(logits.T, labels)) / 2

    def replica_loss(params: Any, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        zi, zt = embed(params, image, text)
        rows = len(image)
        sizes = fdp.all_gather(torch.tensor(rows), "i")
        most, first = int(sizes.max()), int(sizes[: fdp.axis_index("i")].sum())
        real = torch.cat([torch.arange(most) < size for size in sizes])
        padded = [torch.nn.functional.pad(z, (0, 0, 0, most - rows)) for z in (zi, zt)]
        every_zi = fdp.all_gather(padded[0], "i", tiled=True)[real]  # one all_gather twice ...
        every_zt = fdp.all_gather(padded[1], "i", tiled=True)[real]
        both = fdp.all_gather(padded, "i", tiled=True)  # ... or one of both
        assert torch.equal(both[0][real], every_zi) and torch.equal(both[1][real], every_zt)
        labels = torch.arange(rows) + first
        total = cross_entropy(zi @ every_zt.T * 10, labels, reduction="sum")
        total = total + cross_entropy(zt @ every_zi.T * 10, labels, reduction="sum")
        return total / 2 / fdp.psum(rows, "i")

    params_ = _requiring_grad(params)
    image_, text_ = image.clone().requires_grad_(), text.clone().requires_grad_()
    expected = one_device(params_, image_, text_)
    expected_grads = _grads(expected, (params_, image_, text_))

    # Through the whole call: the replicas' losses add up to one device's.
    mapped = fdp.pmap(replica_loss, axis_name="i", in_axes=(None, 0, 0), devices=cpus(n), split="balanced")
    params_ = _requiring_grad(params)
    image_, text_ = image.clone().requires_grad_(), text.clone().requires_grad_()
    loss = mapped(params_, image_, text_).sum()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(_grads(loss, (params_, image_, text_)), expected_grads)

    # Inside the replicas: all_gather's transpose hands each replica the cotangents of every
    # replica's loss for its rows, so the parameters' gradients are summed, the inputs' whole.
    def inside(params: Any, image: torch.Tensor, text: torch.Tensor) -> Any:
        grads, image_grad, text_grad = torch.func.grad(replica_loss, argnums=(0, 1, 2))(params, image, text)
        return fdp.psum(grads, "i"), image_grad, text_grad

    grads = fdp.pmap(
        inside, axis_name="i", in_axes=(None, 0, 0), out_axes=(None, 0, 0), devices=cpus(n), split="balanced"
    )(params, image, text)
    torch.testing.assert_close(grads, expected_grads)


@pytest.mark.parametrize("n", [2, 3])
def test_zero_style_sharded_adam_steps_match_torch_optim(n: int) -> None:
    # ZeRO: every replica reduces only its piece of the gradients (psum_scatter), keeps Adam's
    # state for that piece alone, updates it, and gathers the others' pieces (all_gather). On
    # leaves of different ranks, an uneven batch, several steps: torch.optim.Adam's parameters.
    torch.manual_seed(0)
    params = {
        "w1": torch.randn(6, 3, dtype=torch.float64),
        "b1": torch.randn(6, dtype=torch.float64),
        "w2": torch.randn(6, 6, dtype=torch.float64),
    }
    batches = [
        (torch.randn(7, 3, dtype=torch.float64), torch.randn(7, 6, dtype=torch.float64)) for _ in range(3)
    ]

    def model(params: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ params["w1"].T + params["b1"]) @ params["w2"].T

    opt = fdp.optim.adam(0.01)

    def step(state: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        def summed_loss(params: Any) -> torch.Tensor:
            return torch.nn.functional.mse_loss(model(params, x), y, reduction="sum")

        grads = torch.func.grad(summed_loss)(state["params"])
        total = fdp.psum(y.numel(), "i")  # the mean over the whole batch, on uneven shards
        mine = fdp.psum_scatter({k: g / total for k, g in grads.items()}, "i", tiled=True)
        i, size = fdp.axis_index("i"), fdp.axis_size("i")
        pieces = {k: p.chunk(size)[i] for k, p in state["params"].items()}
        pieces, opt_state = opt.apply_gradients(mine, state["opt"], pieces)
        return {"params": fdp.all_gather(pieces, "i", tiled=True), "opt": opt_state}

    # Each replica's Adam state covers its piece: zeros of a piece's shapes to start.
    pieces = {k: p.chunk(n)[0] for k, p in params.items()}
    state = fdp.device_put_replicated({"params": params, "opt": opt.init(pieces)}, cpus(n))
    mapped = fdp.pmap(step, axis_name="i", out_axes=fdp.PER_REPLICA, devices=cpus(n), split="balanced")
    for x, y in batches:
        state = mapped(state, x, y)

    expected = _requiring_grad(params)
    torch_opt = torch.optim.Adam(expected.values(), lr=0.01)
    for x, y in batches:
        torch_opt.zero_grad()
        torch.nn.functional.mse_loss(model(expected, x), y).backward()
        torch_opt.step()
    for r in range(n):
        torch.testing.assert_close(fdp.unreplicate(state, r)["params"], expected)


@pytest.mark.parametrize("n", [2, 3])
def test_ring_attention_with_ppermute_has_one_devices_values_and_gradients(n: int) -> None:
    # Ring attention: each replica holds a block of the sequence; its keys and values go round
    # the ring (one ppermute of both per step, n - 1 steps), and each replica accumulates its
    # queries' causal attention block by block, with a running log-sum-exp.
    torch.manual_seed(0)
    d, block = 4, 2
    weights = [torch.randn(d, d, dtype=torch.float64) for _ in range(3)]
    x, cotangent = (
        torch.randn(n * block, d, dtype=torch.float64),
        torch.randn(n * block, d, dtype=torch.float64),
    )

    def one_device(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        scores = (x @ wq) @ (x @ wk).T / d**0.5
        causal = torch.ones(len(x), len(x), dtype=torch.bool).triu(1)
        return scores.masked_fill(causal, float("-inf")).softmax(-1) @ (x @ wv)

    def ring(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        i, size = fdp.axis_index("i"), fdp.axis_size("i")
        q, k, v = x @ wq, x @ wk, x @ wv
        out, lse = torch.zeros_like(q), torch.full((block,), float("-inf"), dtype=x.dtype)
        positions = i * block + torch.arange(block)
        for step in range(size):
            source = (i - step) % size  # whose keys and values this replica holds now
            seen = source * block + torch.arange(block)[None, :] <= positions[:, None]
            scores = (q @ k.T / d**0.5).masked_fill(~seen, float("-inf"))
            # (Finite from the first step on, where each row sees its own position.)
            new_lse = torch.logaddexp(lse, scores.logsumexp(-1))
            out = out * (lse - new_lse).exp()[:, None] + (scores - new_lse[:, None]).exp() @ v
            lse = new_lse
            if step < size - 1:
                k, v = fdp.ppermute((k, v), "i", [(j, (j + 1) % size) for j in range(size)])
        return out

    expected_inputs = [*_requiring_grad(weights), x.clone().requires_grad_()]
    expected = one_device(*expected_inputs)
    expected_grads = torch.autograd.grad((expected * cotangent).sum(), expected_inputs)

    inputs = [*_requiring_grad(weights), x.clone().requires_grad_()]
    out = fdp.pmap(ring, axis_name="i", in_axes=(None, None, None, 0), devices=cpus(n))(*inputs)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad((out * cotangent).sum(), inputs), expected_grads)

    # Inside the replicas: each ppermute's transpose sends the cotangents back round the ring.
    def inside(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, x: torch.Tensor, c: torch.Tensor) -> Any:
        grads = torch.func.grad(lambda *a: (ring(*a) * c).sum(), argnums=(0, 1, 2, 3))(wq, wk, wv, x)
        return fdp.psum(grads[:3], "i"), grads[3]

    weight_grads, x_grad = fdp.pmap(
        inside, axis_name="i", in_axes=(None, None, None, 0, 0), out_axes=(None, 0), devices=cpus(n)
    )(*weights, x, cotangent)
    torch.testing.assert_close((*weight_grads, x_grad), expected_grads)


def test_mixture_of_experts_gradients_match_one_device() -> None:
    # The layer of docs/collectives.md, differentiated: through the whole call, and inside the
    # replicas, where all_to_all's transpose returns each token's cotangent to the replica that
    # sent it and each expert's to the replica that holds it.
    torch.manual_seed(0)
    weights, tokens = torch.randn(4, 5, 5, dtype=torch.float64), torch.randn(4, 4, 3, 5, dtype=torch.float64)
    cotangent = torch.randn(4, 4, 3, 5, dtype=torch.float64)

    def layer(expert_w: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        arrived = fdp.all_to_all(tokens[0], "experts", 0, 0)
        processed = torch.tanh(arrived @ expert_w[0])
        return fdp.all_to_all(processed, "experts", -3, -3)[None]  # (the same dims, from the end)

    inputs = _requiring_grad((weights, tokens))
    expected = torch.tanh(torch.einsum("ijcd,jde->ijce", inputs[1], inputs[0]))
    expected_grads = torch.autograd.grad((expected * cotangent).sum(), inputs)

    mapped = fdp.pmap(layer, axis_name="experts", devices=cpus(4))
    inputs = _requiring_grad((weights, tokens))
    out = mapped(*inputs)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad((out * cotangent).sum(), inputs), expected_grads)

    def inside(expert_w: torch.Tensor, tokens: torch.Tensor, c: torch.Tensor) -> Any:
        return torch.func.grad(lambda w, t: (layer(w, t) * c).sum(), argnums=(0, 1))(expert_w, tokens)

    grads = fdp.pmap(inside, axis_name="experts", devices=cpus(4))(weights, tokens, cotangent)
    torch.testing.assert_close(grads, expected_grads)
