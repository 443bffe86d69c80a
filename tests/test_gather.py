"""fdp.gather: concatenation along out_axes, 0-dim stacking, non-tensor leaves, structure checks."""

from __future__ import annotations

import cmath
import collections
import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import fdp


class Out(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor
    tag: str


def test_gather_concatenates_and_stacks() -> None:
    parts = [Out(torch.ones(2, 3), torch.tensor(1.0), "a"), Out(torch.zeros(1, 3), torch.tensor(2.0), "a")]
    out = fdp.gather(parts, "cpu")
    assert isinstance(out, Out) and out.tag == "a"
    torch.testing.assert_close(out.logits, torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]))
    torch.testing.assert_close(out.loss, torch.tensor([1.0, 2.0]))


def test_gather_out_axes_prefix() -> None:
    parts = [(torch.ones(3, 2), torch.full((4,), 5.0)), (torch.zeros(3, 1), torch.full((4,), 5.0))]
    cat, same = fdp.gather(parts, "cpu", out_axes=(1, None))
    assert cat.shape == (3, 3)
    torch.testing.assert_close(same, torch.full((4,), 5.0))


def test_gather_is_differentiable() -> None:
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    (fdp.gather([a, b], "cpu") * torch.arange(5.0)).sum().backward()
    torch.testing.assert_close(a.grad, torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(b.grad, torch.tensor([2.0, 3.0, 4.0]))


@pytest.mark.parametrize(
    "other",
    [
        {"a": {"deeper": torch.ones(1)}, "b": torch.ones(1)},  # a container where a leaf was
        {"a": torch.ones(1), "b": None},  # None where a leaf was
        {"a": torch.ones(1), "c": torch.ones(1)},  # other keys
        {"a": (torch.ones(1),), "b": torch.ones(1)},
    ],
    ids=["subtree", "none", "keys", "tuple"],
)
def test_later_replicas_are_checked_against_the_first_replicas_structure(other: dict) -> None:
    # Later replicas' outputs are flattened along the first one's structure (fast); a subtree
    # where the first has a leaf must still be a structure error, not a leaf.
    first = {"a": torch.ones(1), "b": torch.ones(1)}
    with pytest.raises(ValueError, match="outputs of different structure"):
        fdp.gather([first, other], "cpu")
    same_keys_other_order = {"b": torch.full((1,), 2.0), "a": torch.full((1,), 3.0)}
    gathered = fdp.gather([first, same_keys_other_order], "cpu")
    assert gathered["a"].tolist() == [1.0, 3.0] and gathered["b"].tolist() == [1.0, 2.0]


def test_gather_errors() -> None:
    with pytest.raises(ValueError, match="outputs of different structure"):
        fdp.gather([{"a": torch.ones(1)}, {"b": torch.ones(1)}], "cpu")
    with pytest.raises(ValueError, match=r"different non-tensor values at output\[1\]"):
        fdp.gather([(torch.ones(1), "x"), (torch.ones(1), "y")], "cpu")
    with pytest.raises(
        ValueError, match=r"a mix of tensors and other values at output\[0\] \(float32\[1\], int\)"
    ):
        fdp.gather([[torch.ones(1)], [3]], "cpu")
    with pytest.raises(
        ValueError,
        match=r"cannot concatenate output along axis 0: the replicas returned float32\[1,2\], float32\[1,3\]",
    ):
        fdp.gather([torch.ones(1, 2), torch.ones(1, 3)], "cpu")
    with pytest.raises(ValueError, match="at least one tree"):
        fdp.gather([], "cpu")
    # Only all-0-dim values are stacked; a 0-dim value beside a vector is a rank mismatch.
    with pytest.raises(
        ValueError,
        match=r"cannot concatenate output along out_axes 0: the replicas returned float32\[\], float32\[1\]",
    ):
        fdp.gather([torch.tensor(1.0), torch.ones(1)], "cpu")


@pytest.mark.parametrize(
    ("trees", "got"),
    [(torch.ones(4, 3), r"a tensor of type float32\[4,3\]"), ({"a": torch.ones(4)}, "a dict")],
)
def test_one_tree_in_place_of_the_replicas_trees_is_refused(trees: object, got: str) -> None:
    # A tensor failed on its own truth value (RuntimeError, naming nothing); a dict's keys were
    # taken for the replicas' outputs: fdp.gather({"a": t}, "cpu") returned 'a'.
    with pytest.raises(
        TypeError,
        match=rf"^fdp\.gather: trees must be a sequence of the replicas' trees \(one per replica\), "
        rf"got {got}; for one replica, pass \[tree\]$",
    ):
        fdp.gather(trees, "cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 2])
def test_zero_dim_values_stack_along_the_new_vectors_one_dim_only(n: int) -> None:
    scalars = [torch.tensor(float(r)) for r in range(n)]
    for out_axes in (0, -1):
        assert fdp.gather(scalars, "cpu", out_axes=out_axes).tolist() == [float(r) for r in range(n)]
    # out_axes=1 stacked along 0, silently (torch.nn.parallel.gather raises IndexError).
    with pytest.raises(
        ValueError,
        match=r"^fdp.gather: cannot stack output\[0\] along out_axes 1: the replicas returned "
        + ", ".join([r"float32\[\]"] * n)
        + r"; 0-dim outputs are stacked into a new vector with one entry per replica, and out_axes names "
        r"a dim of it: a dim in \[-1, 0\] fits",
    ):
        fdp.gather([(s, s.expand(2)) for s in scalars], "cpu", out_axes=1)
    stacked, joined = fdp.gather([(s, s.expand(2)[None]) for s in scalars], "cpu", out_axes=(0, 1))
    assert stacked.shape == (n,) and joined.shape == (1, 2 * n)


def test_nan_non_tensor_outputs_are_equal() -> None:
    # Replicas computing the same float NaN agree (float("nan") is a new object each time).
    out = fdp.gather([(torch.ones(1), float("nan")), (torch.ones(1), float("nan"))], "cpu")
    assert math.isnan(out[1])


def test_complex_nan_non_tensor_outputs_are_equal() -> None:
    # As float NaNs: complex("nan") is a new object each time, equal to nothing, itself included.
    out = fdp.gather([(torch.ones(1), complex("nan")), (torch.ones(1), complex("nan"))], "cpu")
    assert cmath.isnan(out[1])


@dataclasses.dataclass
class Stats:
    y: torch.Tensor
    scale: float = dataclasses.field(default=1.0, metadata={"pytree_node": False})


def test_nan_in_a_non_node_field_is_the_same_structure_on_every_replica() -> None:
    # A non-node field is node data, compared with ==: each replica's float("nan") was unequal
    # to the others', and the call failed saying the replicas returned outputs of different
    # structure, printing the same structure twice. NaN leaves agree; so does NaN node data.
    out = fdp.gather([Stats(torch.ones(1), float("nan")), Stats(torch.zeros(2), float("nan"))], "cpu")
    assert isinstance(out, Stats) and math.isnan(out.scale) and out.y.tolist() == [1.0, 0.0, 0.0]
    mapped = fdp.pmap(lambda x: Stats(2 * x, float("nan")), devices=["cpu"] * 2)
    for _ in range(2):  # the structure kept from the first call, too
        out = mapped(torch.arange(3.0))
        assert math.isnan(out.scale) and out.y.tolist() == [0.0, 2.0, 4.0]
    # Other node data that differs still does.
    with pytest.raises(ValueError, match="different structure"):
        fdp.gather([Stats(torch.ones(1), float("nan")), Stats(torch.ones(1), 1.0)], "cpu")


def test_equal_non_tensor_outputs_that_are_other_objects_are_returned_once() -> None:
    first, second = "ab", "".join(["a", "b"])  # equal strings, two objects
    assert first is not second
    out = fdp.gather([(torch.ones(1), first), (torch.ones(1), second)], "cpu")
    assert out[1] is first  # replica 0's


@pytest.mark.parametrize(
    ("first", "second"),
    [(1, 1.0), (True, 1), (1.0, 1 + 0j), (np.float16(1), np.float32(1)), (np.int64(2), 2)],
    ids=["int-float", "bool-int", "float-complex", "np.float16-np.float32", "np.int64-int"],
)
def test_equal_non_tensor_outputs_of_different_types_are_different(first: Any, second: Any) -> None:
    # == holds across these types: replica 0's value came back, its type by chance, where
    # tensors of different dtypes are refused.
    assert first == second
    with pytest.raises(ValueError, match=r"different non-tensor values at output\[1\]: replica 0 returned"):
        fdp.gather([(torch.ones(1), first), (torch.ones(1), second)], "cpu")
    mapped = fdp.pmap(
        lambda x: first if fdp.axis_index("i") == 0 else second, axis_name="i", devices=["cpu"] * 2
    )
    with pytest.raises(ValueError, match=r"different non-tensor values at output: replica 0 returned"):
        mapped(torch.zeros(2))


def test_non_tensor_outputs_whose_equality_raises_are_not_provably_equal() -> None:
    class Ambiguous:
        def __eq__(self, other: object) -> bool:
            raise ValueError("The truth value of an array with more than one element is ambiguous")

        __hash__ = None  # type: ignore[assignment]

    with pytest.raises(ValueError, match=r"different non-tensor values at output\[1\]: replica 0 returned"):
        fdp.gather([(torch.ones(1), Ambiguous()), (torch.ones(1), Ambiguous())], "cpu")


class Encoding(collections.UserDict):  # a Hugging Face BatchEncoding is a UserDict
    pass


class Rows(dict):
    pass


@pytest.mark.parametrize("make", [Encoding, Rows], ids=["UserDict", "dict subclass"])
def test_containers_that_fdp_does_not_flatten_holding_tensors_are_refused_as_outputs(
    make: Callable[..., object],
) -> None:
    # optree leaves them whole: fdp compared the replicas' containers as values. Equal values
    # (one-element tensors that agree) made it return replica 0's tensors for the whole batch;
    # others gave "different non-tensor values ... return a tensor", printing every tensor.
    for second in (torch.ones(1), torch.zeros(1)):
        with pytest.raises(
            TypeError,
            match=rf"^fdp.gather: output\[1\]: the replicas returned a {make.__name__} holding tensors, a "
            r"container of a type that fdp does not flatten .* Return a plain dict \(dict\(obj\)\), or "
            rf"register {make.__name__} with optree.register_pytree_node\(..., namespace='fdp'\)$",
        ):
            fdp.gather([(torch.ones(1), make(a=torch.ones(1))), (torch.ones(1), make(a=second))], "cpu")
    for n in (2, 3):
        with pytest.raises(TypeError, match=rf"output: the replicas returned a {make.__name__} holding"):
            fdp.pmap(lambda x: make(a=x), devices=["cpu"] * n)(torch.zeros(4, 2))
    # One object that every replica returns is returned as it is, as other equal values are.
    shared = make(a=torch.ones(1))
    assert fdp.gather([(torch.ones(1), shared), (torch.ones(1), shared)], "cpu")[1] is shared
    # Without tensors it is a value like any other.
    assert fdp.gather([(torch.ones(1), make(a=1)), (torch.ones(1), make(a=1))], "cpu")[1] == {"a": 1}


def test_checked_unmapped_integer_outputs_that_differ_are_refused() -> None:
    mapped = fdp.pmap(
        lambda x: torch.tensor([fdp.axis_index("i")]),
        axis_name="i",
        out_axes=None,
        devices=["cpu"] * 2,
        check_unmapped_outputs=True,
    )
    with pytest.raises(
        ValueError,
        match=r"replica 0 returned int64\[1\] \(the value returned\) but replica 1 returned "
        r"int64\[1\], which differ first at \[0\]: 0 vs 1$",
    ):
        mapped(torch.ones(4))


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x.to_sparse(),
        lambda x: x.reshape(2, 2).to_sparse_csr(),
        lambda x: torch.nested.nested_tensor([x, x[:1]]),
        lambda x: torch.nested.nested_tensor([x, x[:1]], layout=torch.jagged),
    ],
    ids=["sparse_coo", "sparse_csr", "nested", "nested_jagged"],
)
@pytest.mark.parametrize("agree", [True, False])
def test_checked_unmapped_sparse_and_nested_outputs_are_compared(
    make: Callable[[torch.Tensor], torch.Tensor], agree: bool
) -> None:
    # torch.equal has no sparse kernel (torch's NotImplementedError, naming neither the call nor
    # the output, where the replicas agreed too), a strided nested tensor has no shape
    # ("Internal error: NestedTensorImpl doesn't support sizes"), and two jagged ones of equal
    # components have shapes of different symbolic sizes (j3, j4): called different, always.
    with warnings.catch_warnings():  # the prototype (nested) and beta (CSR) layouts' warnings
        warnings.simplefilter("ignore", UserWarning)
        values = [make(torch.arange(4.0)), make(torch.arange(4.0) + (0 if agree else 1))]
    mapped = fdp.pmap(
        lambda x: values[fdp.axis_index("i")],
        axis_name="i",
        out_axes=None,
        devices=["cpu"] * 2,
        check_unmapped_outputs=True,
    )
    if agree:
        assert mapped(torch.ones(4)) is values[0]
    else:
        with pytest.raises(ValueError, match=r"out_axes is None for output, but the replicas disagree: "):
            mapped(torch.ones(4))


def test_gather_with_per_replica_out_axes_keeps_each_value_in_memory_of_its_own() -> None:
    # As fdp.pmap's out_axes=fdp.PER_REPLICA: a value sharing memory with an earlier replica's
    # (two views of one tensor here) is copied, so that updating one in place changes no other.
    t = torch.arange(4.0)
    out = fdp.gather([{"x": t[:2], "n": 1}, {"x": t[2:], "n": 1}], "cpu", out_axes=fdp.PER_REPLICA)
    assert isinstance(out["x"], fdp.PerReplica) and isinstance(out["n"], fdp.PerReplica)
    assert out["x"].values[0]._base is t and out["x"].values[1]._base is not t
    assert [v.tolist() for v in out["x"]] == [[0.0, 1.0], [2.0, 3.0]]
    assert out["n"].values == (1, 1) and out["n"].devices == (torch.device("cpu"),) * 2


@pytest.mark.parametrize(
    ("other", "agree"),
    [
        (lambda t: t, True),
        (lambda t: t.expand(3).clone(), False),  # equal values broadcast, not the same shape
        (lambda t: t.double(), False),  # equal values, another dtype
        (lambda t: t + 1, False),
    ],
    ids=["same", "shape", "dtype", "values"],
)
def test_checked_unmapped_outputs_compare_shape_dtype_and_values_nan_equal(
    other: Callable[[torch.Tensor], torch.Tensor], agree: bool
) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nan = x.sum() * float("nan")  # NaN in the same place on every replica: equal
        value = torch.ones(1)
        return nan, value if fdp.axis_index("i") == 0 else other(value)

    mapped = fdp.pmap(f, axis_name="i", out_axes=None, devices=["cpu"] * 2, check_unmapped_outputs=True)
    if agree:
        nan, value = mapped(torch.ones(4))
        assert nan.isnan() and torch.equal(value, torch.ones(1))
    else:
        with pytest.raises(ValueError, match=r"out_axes is None for output\[1\], but the replicas disagree"):
            mapped(torch.ones(4))


@pytest.mark.parametrize("shape", [(2,), ()])
def test_different_dtypes_are_refused_not_promoted(shape: tuple[int, ...]) -> None:
    # torch.cat would promote float32 and float64 (or int64) to one dtype, silently.
    for other in (torch.float64, torch.int64):
        with pytest.raises(ValueError, match=r"different dtypes at output\['y'\] \(float32"):
            fdp.gather([{"y": torch.ones(shape)}, {"y": torch.ones(shape, dtype=other)}], "cpu")
    f = fdp.pmap(lambda x: x if fdp.axis_index("i") == 0 else x.double(), axis_name="i", devices=["cpu"] * 2)
    with pytest.raises(ValueError, match=r"<lambda>\): the replicas returned different dtypes at output \("):
        f(torch.ones(4))


@pytest.mark.parametrize(
    ("region", "output"), [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)]
)
def test_half_precision_outputs_gather_under_an_autocast_of_the_other(
    region: torch.dtype, output: torch.dtype
) -> None:
    # Under autocast, torch.cat and torch.stack refuse a float16 tensor in a bfloat16 region
    # (and the reverse): outputs the same computation returns on one device failed to gather.
    f = fdp.pmap(lambda x: (x.to(output), x.sum().to(output)), devices=["cpu"] * 2)
    x = torch.arange(8.0).reshape(4, 2)
    with torch.autocast("cpu", dtype=region):
        rows, sums = f(x)
        joined = fdp.gather([{"y": x[:2].to(output)}, {"y": x[2:].to(output)}], "cpu")
    assert rows.dtype == sums.dtype == joined["y"].dtype == output
    assert torch.equal(rows, x.to(output)) and torch.equal(joined["y"], x.to(output))
    assert torch.equal(sums, torch.tensor([1.0 + 2 + 3, 4.0 + 5 + 6 + 7]).to(output))


def test_equal_numpy_outputs_are_returned_once() -> None:
    np = pytest.importorskip("numpy")
    f = fdp.pmap(lambda x: (2 * x, np.array([1.0, np.nan]), np.array(["a"])), devices=["cpu"] * 2)
    doubled, numbers, words = f(torch.ones(4))
    assert np.array_equal(numbers, np.array([1.0, np.nan]), equal_nan=True) and words.tolist() == ["a"]
    for first, second in [
        (np.array([1, 2]), np.array([1, 3])),
        (np.array([1, 2]), np.array([1.0, 2.0])),  # another dtype
        (np.array([1, 2]), np.array([[1, 2]])),  # another shape
    ]:
        with pytest.raises(ValueError, match="different non-tensor values"):
            fdp.gather([(torch.ones(1), first), (torch.ones(1), second)], "cpu")
    # Object arrays of arrays have no elementwise truth value either: refused with fdp's message.
    ragged = np.array([np.arange(2), np.arange(3)], dtype=object)
    with pytest.raises(ValueError, match=r"different non-tensor values at output\[1\]"):
        fdp.gather([(torch.ones(1), ragged), (torch.ones(1), ragged.copy())], "cpu")


# --- the all-tensor CPU path gives what the general path gives ----------------------------------


@pytest.mark.parametrize("empty_first", [True, False])
def test_empty_1d_piece_is_not_silently_dropped_by_cat(empty_first: bool) -> None:
    # torch.cat skips 1-d empty tensors next to others of any rank; a replica's rank must match.
    pieces = [{"y": torch.zeros(0)}, {"y": torch.ones(2, 3)}]
    with pytest.raises(ValueError, match="cannot concatenate"):
        fdp.gather(pieces if empty_first else pieces[::-1], "cpu")


def test_a_tensor_like_object_beside_tensors_is_refused_not_concatenated() -> None:
    # torch.cat would hand the call to the object's __torch_function__, which could accept it.
    class TensorLike:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def dim(self) -> int:
            return self.t.dim()

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.cat:
                return torch.cat([a.t if isinstance(a, TensorLike) else a for a in args[0]])
            return NotImplemented

    with pytest.raises(ValueError, match="a mix of tensors and other values"):
        fdp.gather([{"y": torch.zeros(2)}, {"y": TensorLike(torch.ones(1))}], "cpu")


def test_scalars_and_mixed_leaves_take_the_general_path() -> None:
    out = fdp.gather(
        [
            {"loss": torch.tensor(1.0), "y": torch.ones(1, 2)},
            {"loss": torch.tensor(2.0), "y": torch.zeros(2, 2)},
        ],
        "cpu",
    )
    assert out["loss"].tolist() == [1.0, 2.0] and out["y"].shape == (3, 2)


def test_all_tensor_outputs_keep_gradients_and_parameters() -> None:
    w = torch.nn.Parameter(torch.ones(4, 2))
    pieces = fdp.scatter({"w": w}, ["cpu", "cpu"])
    joined = fdp.gather([{"w": p["w"] * 2} for p in pieces], "cpu")
    joined["w"].sum().backward()
    assert torch.equal(w.grad, torch.full((4, 2), 2.0))


@pytest.mark.parametrize("n", [1, 2])
def test_a_meta_output_is_named_under_out_axes_none_as_under_an_int_axis(n: int) -> None:
    # Under out_axes=None torch's own NotImplementedError ("Cannot copy out of meta tensor; no
    # data!") came through, naming neither the call nor the output.
    f = fdp.pmap(lambda x: (x, torch.empty(2, 3, device="meta")), devices=["cpu"] * n, out_axes=(0, None))
    for _ in range(3):
        with pytest.raises(
            ValueError,
            match=r"^fdp.pmap\(.*<lambda>\): cannot move output\[1\] \(float32\[2,3\] on meta\), whose "
            r"out_axes is None, to cpu \(Cannot copy out of meta tensor",
        ):
            f(torch.ones(4))
    with pytest.raises(ValueError, match=r"cannot concatenate output\[1\] along axis 0"):
        fdp.pmap(lambda x: (x, torch.empty(2, 3, device="meta")), devices=["cpu"] * n)(torch.ones(4))


def test_running_out_of_memory_moving_an_unmapped_output_stays_an_out_of_memory_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Callers that shrink the batch on torch.OutOfMemoryError (a batch-size finder) must see it
    # as such: it was turned into a ValueError naming the output, which they do not catch.
    from fdp import _gather

    def out_of_memory(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(_gather._transfer, "to_device", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        fdp.gather([torch.ones(2), torch.ones(2)], "cpu", out_axes=None)


def quantized(values: list[float], scale: float) -> torch.Tensor:
    with warnings.catch_warnings():  # torch's deprecation warning for quantized tensors
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(torch.tensor(values), scale, 0, torch.quint8)


@pytest.mark.parametrize("shape", [(2,), ()], ids=["rows", "0-dim"])
def test_quantized_outputs_of_different_scales_are_refused_not_clipped(shape: tuple[int, ...]) -> None:
    # Concatenated, they took replica 0's scale: replica 1's 200.0 came back as 25.5, silently
    # (each replica quantizing its own shard picks a scale of its own).
    small, large = [1.0, 2.0][: shape[0] if shape else 1], [100.0, 200.0][: shape[0] if shape else 1]
    parts = [quantized(small, 0.1).reshape(shape), quantized(large, 10.0).reshape(shape)]
    with pytest.raises(
        ValueError,
        match=r"^fdp.gather: the replicas returned quantized tensors of different scales at "
        r"output\['q'\]: replica 0 returned scale 0.1, zero point 0 but replica 1 returned scale 10.0",
    ):
        fdp.gather([{"q": q} for q in parts], "cpu")
    # Of one scale, they are joined as before.
    same = [quantized(small, 10.0).reshape(shape), quantized(large, 10.0).reshape(shape)]
    out = fdp.gather([{"q": q} for q in same], "cpu")["q"]
    assert out.q_scale() == 10.0
    assert out.dequantize().tolist() == [v for q in same for v in q.dequantize().reshape(-1).tolist()]
