"""Bad input gets a clear error naming the argument; a failing replica's own exception reaches the caller."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from helpers import cpus
from torch import nn

import fdp

# --- validation --------------------------------------------------------------------------------


def test_inconsistent_sizes_name_every_group() -> None:
    f = fdp.pmap(lambda x, y, z: x, devices=cpus(2))
    with pytest.raises(ValueError) as info:
        f(torch.zeros(8, 4), {"a": torch.zeros(8), "b": torch.zeros(7)}, z=torch.zeros(8))
    assert str(info.value) == (
        "fdp.pmap(test_inconsistent_sizes_name_every_group.<locals>.<lambda>) got inconsistent "
        "sizes for array axes to be mapped:\n"
        "  * most axes (3 of them) had size 8, e.g. axis 0 of args[0] of type float32[8,4];\n"
        "  * one axis had size 7: axis 0 of args[1]['b'] of type float32[7]\n"
        "Every positional argument is split along its in_axes entry (0 unless given): one that every "
        "replica needs whole (a model's parameters, a lookup table) takes None there, e.g. "
        "in_axes=(None, 0) for f(params, x); state kept on every device is placed once with "
        "fdp.device_put_replicated"
    )


def test_inconsistent_sizes_of_parameters_left_under_axis_0_say_to_give_them_none() -> None:
    # The README's first example with in_axes left out: the parameters are split like the batch,
    # and JAX's message alone (which sizes disagree) did not say what to change.
    model = nn.Linear(5, 2)
    f = fdp.pmap(lambda params, x: fdp.functional_call(model, params, (x,)), devices=cpus(2))
    with pytest.raises(ValueError) as info:
        f(dict(model.named_parameters()), torch.zeros(30, 5))
    assert (
        str(info.value)
        .splitlines()[-1]
        .startswith(
            "Every positional argument is split along its in_axes entry (0 unless given): one that "
            "every replica needs whole (a model's parameters, a lookup table) takes None there, e.g. "
            "in_axes=(None, 0)"
        )
    )
    # Not where a keyword argument is the odd one out (that advice is its own), nor for
    # fdp.DataParallel, which has no in_axes.
    with pytest.raises(ValueError) as info:
        f(torch.zeros(4), x=torch.zeros(3))
    assert "in_axes entry" not in str(info.value)
    with pytest.raises(ValueError) as info:
        fdp.DataParallel(nn.Bilinear(2, 2, 1), device_ids=cpus(2))(torch.zeros(4, 2), torch.zeros(3, 2))
    assert "in_axes" not in str(info.value)


def test_inconsistent_sizes_list_the_groups_largest_first() -> None:
    # As JAX does: the most common size first whatever the argument order, and only that group
    # called "most".
    f = fdp.pmap(lambda *args: args[0], devices=cpus(2))
    with pytest.raises(ValueError) as info:
        f(
            torch.zeros(7),
            torch.zeros(6),
            {"a": torch.zeros(8), "b": torch.zeros(8), "c": torch.zeros(8)},
            torch.zeros(6),
        )
    assert str(info.value).splitlines()[1:4] == [
        "  * most axes (3 of them) had size 8, e.g. axis 0 of args[2]['a'] of type float32[8];",
        "  * some axes (2 of them) had size 6, e.g. axis 0 of args[1] of type float32[6];",
        "  * one axis had size 7: axis 0 of args[0] of type float32[7]",
    ]


def test_rank_too_small_names_the_leaf_and_axis() -> None:
    f = fdp.pmap(lambda x, s: x, in_axes=(1, 0), devices=cpus(2))
    with pytest.raises(
        ValueError,
        match=r"map args\[1\]\['s'\] of type float32\[\] along axis 0, "
        r"so its rank should be at least 1, but it is only 0",
    ):
        f(torch.zeros(3, 4), {"s": torch.tensor(1.0)})
    with pytest.raises(
        ValueError, match=r"map args\[0\] of type float32\[3\] along axis 1, so its rank should be at least 2"
    ):
        f(torch.zeros(3), {"s": torch.zeros(3)})
    g = fdp.pmap(lambda x: x, in_axes=-3, devices=cpus(2))
    with pytest.raises(ValueError, match="along axis -3, so its rank should be at least 3, but it is only 2"):
        g(torch.zeros(3, 4))


def test_empty_batch_is_an_error() -> None:
    f = fdp.pmap(lambda x: x, devices=cpus(2))
    with pytest.raises(
        ValueError, match=r"empty batch: axis 0 of args\[0\] of type float32\[0,5\] has size 0"
    ):
        f(torch.zeros(0, 5))


def test_nothing_mapped_is_an_error() -> None:
    f = fdp.pmap(lambda x, n: x, in_axes=None, devices=cpus(2))
    with pytest.raises(ValueError, match="found no tensor to map"):
        f(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="found no tensor to map"):
        fdp.pmap(lambda: 1, devices=cpus(2))()
    with pytest.raises(ValueError, match="found no tensor to map"):
        fdp.pmap(lambda n: n, devices=cpus(2))(5)


def test_nothing_mapped_names_an_object_holding_tensors_under_an_int_axis() -> None:
    # A batch class of the user's (or a graph library's data object) is one leaf to optree: its
    # tensors are not seen, and "found no tensor to map" alone read as wrong, the object having
    # axis 0. The message names it, and how to have it split.
    class Batch:
        def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            self.x, self.y, self.name = x, y, "train"

    f = fdp.pmap(lambda b: b.x, devices=cpus(2))
    with pytest.raises(
        ValueError,
        match=r"found no tensor to map: .* args\[0\] is a .*Batch holding tensors \(its attributes "
        r"x, y\), an object that fdp does not flatten: it reaches every replica whole, whatever its "
        r"axis. To split its tensors, pass them in a dict or a dataclass, or register .*Batch with "
        r"optree.register_pytree_node\(..., namespace='fdp'\).$",
    ):
        f(Batch(torch.zeros(4), torch.ones(4)))
    # Under axis None it is whole by request: no note.
    with pytest.raises(ValueError, match="found no tensor to map") as info:
        fdp.pmap(lambda b: b.x, in_axes=None, devices=cpus(2))(Batch(torch.zeros(4), torch.ones(4)))
    assert "Batch" not in str(info.value)


@pytest.mark.parametrize("devices", [1, 2])
def test_an_array_that_is_not_a_tensor_under_an_int_axis_is_refused(devices: int) -> None:
    # A JAX user passes NumPy arrays (jax.pmap splits them). fdp splits tensors only: passed
    # whole, every replica would get every row, a wrong shape or a silent broadcast. On one
    # replica too, so that a program does not change meaning with the device count.
    np = pytest.importorskip("numpy")
    f = fdp.pmap(lambda x, y: x - torch.as_tensor(y["y"]), devices=cpus(devices))
    message = (
        r"fdp.pmap\(.*<lambda>\): kwargs\['y'\]\['y'\]: a numpy.ndarray of shape \(4, 1\) is not a "
        r"torch.Tensor, and fdp splits only tensors: every replica would get all of it. Convert it "
        r"with torch.as_tensor to split it; to give every replica all of it, pass it positionally "
        r"with axis None"
    )
    with pytest.raises(TypeError, match=message):
        f(torch.zeros(4, 1), y={"y": np.zeros((4, 1))})
    with pytest.raises(TypeError, match=r"args\[0\]: a numpy.ndarray of shape \(4, 3\)"):
        fdp.pmap(lambda x: x, devices=cpus(devices))(np.zeros((4, 3)))
    # Given axis None, an array reaches every replica whole; a 0-dim array is a number.
    g = fdp.pmap(
        lambda x, table, s: x + torch.as_tensor(table)[:1] * float(s),
        in_axes=(0, None, 0),
        devices=cpus(devices),
    )
    assert g(torch.zeros(4, 2), np.ones((3, 2)), np.array(2.0)).tolist() == [[2.0, 2.0]] * 4
    # An array given axis None is whole by request, and maps nothing: no hint about arrays.
    nothing = fdp.pmap(lambda x, y: x, in_axes=(None, 0), devices=cpus(devices))
    with pytest.raises(ValueError, match="found no tensor to map") as info:
        nothing(np.zeros((4, 3)), 1.0)
    assert "numpy" not in str(info.value)


@pytest.mark.parametrize("devices", [1, 2])
def test_an_object_with_a_shape_that_is_no_array_reaches_every_replica_whole(devices: int) -> None:
    """Only arrays (objects with ``__array__``) under an int axis are refused: any other object
    that has a ``shape`` (a config, a shape record) reaches every replica as it is."""

    class Geometry:
        shape = (4, 3)

    geometry = Geometry()
    seen: list[Any] = []
    fdp.pmap(lambda x, g: seen.append(g) or x, devices=cpus(devices))(torch.zeros(4), geometry)
    assert len(seen) == devices and all(g is geometry for g in seen)


@pytest.mark.parametrize("devices", [1, 2])
def test_an_array_refused_by_data_parallel_or_scatter_gets_their_way_out(devices: int) -> None:
    # Neither has pmap's positional in_axes: fdp.DataParallel maps every argument (the advice
    # to give the array axis None in fdp.pmap's in_axes was of no use there), and fdp.scatter
    # takes in_axes of its own.
    np = pytest.importorskip("numpy")

    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor, scale: Any) -> torch.Tensor:
            return x * torch.as_tensor(scale).sum()

    model = fdp.DataParallel(Scaled(), device_ids=cpus(devices))
    with pytest.raises(TypeError) as info:
        model(torch.zeros(4, 3), np.ones(3))
    message = str(info.value)
    assert message.startswith("fdp.DataParallel: inputs[1]: a numpy.ndarray of shape (3,)"), message
    assert "hold it on the module instead of passing it" in message
    assert "in_axes" not in message
    with pytest.raises(TypeError) as info:
        fdp.scatter((torch.zeros(4, 3), np.ones(3)), devices=cpus(devices))
    message = str(info.value)
    assert message.startswith("fdp.scatter: tree[1]: a numpy.ndarray of shape (3,)"), message
    assert message.endswith("to give every replica all of it, give it axis None in in_axes")
    assert "fdp.pmap" not in message and "positionally" not in message


def test_in_axes_not_a_prefix_names_the_key_path() -> None:
    f = fdp.pmap(lambda x, y: x, in_axes=(0, 0, 0), devices=cpus(2))
    with pytest.raises(
        ValueError,
        match=r"^fdp\.pmap\(.*<lambda>\): in_axes specification must be a tree prefix of the tuple of "
        r"positional arguments \(2 given\)",
    ) as info:
        f(torch.zeros(2), torch.zeros(2))
    assert "in_axes tree root" in str(info.value)
    g = fdp.pmap(lambda x, y: x, in_axes=(0, {"a": 0}), devices=cpus(2))
    with pytest.raises(ValueError, match=r"(?s)in_axes\[1\].*missing key\(s\):\n    \['a'\]"):
        g(torch.zeros(2), {"b": torch.zeros(2)})


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("0", r"in_axes must be an int or None, got str: '0'"),
        ((0, 1.0), r"in_axes\[1\] must be an int or None, got float"),
        ((True,), r"in_axes\[0\] must be an int or None, got bool"),
        # PER_REPLICA is an out_axes leaf only: an input's placement comes from its PerReplica
        # leaves, not from the specification.
        ((0, fdp.PER_REPLICA), r"in_axes\[1\] must be an int or None, got _PerReplicaAxis: fdp.PER_REPLICA"),
    ],
)
def test_in_axes_leaves_must_be_ints_or_none(spec: object, match: str) -> None:
    # Named: a program of many mapped functions must say which one was given the bad spec.
    with pytest.raises(TypeError, match=r"^fdp\.pmap\(.*<lambda>\): " + match):
        fdp.pmap(lambda x: x, in_axes=spec)
    with pytest.raises(TypeError, match=r"^fdp\.scatter: " + match):
        fdp.scatter(torch.zeros(2), ["cpu"] * 2, in_axes=spec)


def test_not_a_prefix_error_spells_broadcast_as_none_and_shortens_long_lines() -> None:
    # The specification is printed as the caller wrote it (None, not fdp's internal marker);
    # optree's details list every key, which for a state dict of many entries must not flood
    # the message.
    f = fdp.pmap(lambda x, w: x, in_axes=(0, {"a": None}), devices=cpus(2))
    many = {f"layer{i}.weight": torch.zeros(2) for i in range(100)}
    with pytest.raises(ValueError, match=r"in_axes=\(0, \{'a': None\}\) does not match") as info:
        f(torch.zeros(2), many)
    details = str(info.value).splitlines()[1:]
    assert any(line.endswith(" ...") for line in details)
    assert max(len(line) for line in details) <= 300 + len(" ...")
    assert "in_axes=(0, {'a': None})" in repr(f)


def test_out_axes_leaves_must_be_ints_or_none() -> None:
    with pytest.raises(
        TypeError, match=r"^fdp\.pmap\(.*<lambda>\): out_axes\['y'\] must be an int, None or fdp.PER_REPLICA"
    ):
        fdp.pmap(lambda x: x, out_axes={"y": "0"})
    with pytest.raises(TypeError, match=r"^fdp\.gather: out_axes must be an int, None or fdp.PER_REPLICA"):
        fdp.gather([torch.zeros(1)], "cpu", out_axes="0")


def test_out_axes_not_a_prefix_names_the_call() -> None:
    def two(x):
        return x

    with pytest.raises(
        ValueError, match=r"^fdp\.pmap\(.*two\): out_axes specification must be a tree prefix"
    ):
        fdp.pmap(two, out_axes=(0, 0), devices=cpus(2))(torch.zeros(2))
    with pytest.raises(ValueError, match=r"^fdp\.gather: out_axes specification must be a tree prefix"):
        fdp.gather([torch.zeros(1)], "cpu", out_axes=(0, 0))


def test_unhashable_axis_name() -> None:
    with pytest.raises(TypeError, match="axis_name must be hashable"):
        fdp.pmap(lambda x: x, axis_name=["i"])


def test_nested_pmap_is_refused() -> None:
    inner = fdp.pmap(lambda x: x, devices=cpus(2))
    outer = fdp.pmap(lambda x: inner(x), devices=cpus(2))
    with pytest.raises(
        RuntimeError,
        match=r"called inside a function that is already running as replica \d of 2.*nested pmap",
    ) as info:
        outer(torch.zeros(4))
    assert "fdp.pmap(test_nested_pmap_is_refused.<locals>.<lambda>)" in str(info.value)


def test_nested_pmap_is_refused_before_its_scatter(monkeypatch: pytest.MonkeyPatch) -> None:
    from fdp import _scatter

    scattered: list[int] = []
    scatter = _scatter.scatter_leaves
    monkeypatch.setattr(_scatter, "scatter_leaves", lambda *a, **k: scattered.append(1) or scatter(*a, **k))
    inner = fdp.pmap(lambda x: x, devices=cpus(2))
    outer = fdp.pmap(lambda x: inner(x), devices=["cpu"])
    with pytest.raises(RuntimeError, match="already running as replica 0 of 1"):
        outer(torch.zeros(4))
    assert scattered == []  # the inner call moved nothing to its devices


def test_failing_call_does_not_mutate_inputs() -> None:
    x = torch.arange(6.0)
    tree = {"x": x, "y": torch.zeros(5)}
    before = {k: v.clone() for k, v in tree.items()}
    with pytest.raises(ValueError):
        fdp.pmap(lambda t: t, devices=cpus(2))(tree)
    assert tree.keys() == before.keys() and all(torch.equal(tree[k], before[k]) for k in tree)


# --- failures inside replicas ------------------------------------------------------------------


class ReplicaError(Exception):
    pass


def test_original_exception_object_with_replica_note() -> None:
    raised: list[BaseException] = []

    def f(x):
        if x[0] >= 2:  # only the second replica (rows 2, 3)
            error = ReplicaError("boom")
            raised.append(error)
            raise error
        return x

    with pytest.raises(ReplicaError) as info:
        fdp.pmap(f, devices=cpus(2))(torch.arange(4.0))
    assert info.value is raised[0]
    assert any("raised by replica 1 of 2 (device cpu)" in note for note in info.value.__notes__)


def test_other_replicas_failures_are_reported_too() -> None:
    def f(x):
        raise ValueError(f"bad shard starting at {int(x[0])}")

    with pytest.raises(ValueError, match="bad shard starting at 0") as info:
        fdp.pmap(f, devices=cpus(3))(torch.arange(6.0))
    notes = "\n".join(info.value.__notes__)
    assert "raised by replica 0 of 3" in notes
    assert "replica 1 (device cpu) also failed: ValueError: bad shard starting at 2" in notes
    assert "replica 2 (device cpu) also failed: ValueError: bad shard starting at 4" in notes


def test_replicas_that_fail_alike_get_one_note() -> None:
    # A model bug that every shard meets: one line for the others, not a copy of the message each.
    def f(x):
        if int(x[0]) == 6:
            raise KeyError("other")
        raise ValueError("the same message")

    with pytest.raises(ValueError, match="the same message") as info:
        fdp.pmap(f, devices=cpus(4))(torch.arange(8.0))
    assert [note.partition("): ")[2] for note in info.value.__notes__] == [
        "raised by replica 0 of 4 (device cpu)",
        "replicas 1 and 2 (device cpu) also failed with the same ValueError",
        "replica 3 (device cpu) also failed: KeyError: 'other'",
    ]


def test_pool_is_usable_after_a_failure(devices: list[str]) -> None:
    calls = {"n": 0}

    def flaky(x):
        if calls["n"] == 0:
            raise ReplicaError("first call fails")
        return x * 2

    f = fdp.pmap(flaky, devices=devices)
    with pytest.raises(ReplicaError):
        f(torch.ones(8))
    calls["n"] = 1
    torch.testing.assert_close(f(torch.ones(8)), torch.full((8,), 2.0))


def test_keyboard_interrupt_in_a_replica_surfaces_as_itself() -> None:
    # nn.DataParallel turns this into "KeyError: 1".
    def f(x):
        if x[0] > 0:
            raise KeyboardInterrupt
        return x

    with pytest.raises(KeyboardInterrupt):
        fdp.pmap(f, devices=cpus(2))(torch.arange(4.0))
    torch.testing.assert_close(fdp.pmap(lambda x: x, devices=cpus(2))(torch.ones(2)), torch.ones(2))


def test_slow_replica_is_waited_for() -> None:
    def f(x):
        if x[0] > 0:
            time.sleep(0.2)
        return x + 1

    torch.testing.assert_close(fdp.pmap(f, devices=cpus(2))(torch.arange(4.0)), torch.arange(4.0) + 1)


def test_failure_does_not_leak_threads(devices: list[str]) -> None:
    f = fdp.pmap(lambda x: (_ for _ in ()).throw(ReplicaError("x")), devices=devices)
    with pytest.raises(ReplicaError):
        f(torch.ones(16))
    count = threading.active_count()
    for _ in range(5):
        with pytest.raises(ReplicaError):
            f(torch.ones(16))
    assert threading.active_count() == count


def test_an_in_place_op_on_a_shard_that_requires_grad_says_why() -> None:
    # torch refuses it (the shards are outputs of one split) naming SplitWithSizes: the note
    # says where that comes from and what to write instead.
    x = torch.randn(6, 4) * torch.ones(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="returns multiple views") as caught:
        fdp.pmap(lambda x: torch.relu_(x), devices=cpus(2))(x)
    assert any("shards of a mapped input that requires grad are views" in n for n in caught.value.__notes__)


def test_a_batch_norm_given_one_row_per_replica_says_why() -> None:
    # Three rows train on one device; over three replicas each batch norm gets a (1, C)
    # input, and torch's message names that size alone: the note says where it comes from.
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    x = torch.randn(3, 4)
    model(x)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as caught:
        fdp.DataParallel(model, device_ids=cpus(3))(x)
    assert any(
        "each replica's batch norm normalizes its own shard" in n
        and "fdp.SyncBatchNorm.convert_sync_batchnorm" in n
        for n in caught.value.__notes__
    )


# (Forward mode loads torch's decompositions once, by torch.jit.script, which warns.)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_forward_mode_ad_in_replicas_running_at_once_says_why() -> None:
    # torch keeps forward-mode AD's levels per process: replicas that each enter one collide,
    # and torch's message reads as a misuse of nesting in code that runs fine on one device.
    import torch.autograd.forward_ad as fwad

    def tangent(x: torch.Tensor) -> torch.Tensor:
        with fwad.dual_level():
            dual = fwad.make_dual(x, torch.ones_like(x))
            scale = fdp.psum(x.sum(), "i")  # replica 0 waits here, inside its level
            return fwad.unpack_dual(dual.sin() * scale).tangent

    with pytest.raises(RuntimeError, match="Nested forward mode AD is not supported") as caught:
        fdp.pmap(tangent, axis_name="i", devices=cpus(2))(torch.randn(4))
    assert any("forward-mode AD" in n and "per process, not per thread" in n for n in caught.value.__notes__)


@pytest.mark.parametrize(
    "message",
    [
        # what torch.func.jvp and hessian raise most often, at random, in replicas run at once
        "Trying to access a forward AD level with an invalid index. This index was either not "
        "created or is already deleted.",
        "Exiting a forward AD level that is not the last that was created is not support.",
        "Entering a new forward AD level but the current level is not valid. Make sure you did "
        "not modified it directly.",
    ],
)
def test_forward_mode_ad_errors_of_torch_get_the_note_on_several_replicas_only(message: str) -> None:
    def fails(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(message)

    for n, noted in ((2, True), (1, False)):
        with pytest.raises(RuntimeError, match="forward AD level") as caught:
            fdp.pmap(fails, devices=cpus(n))(torch.randn(4))
        notes = getattr(caught.value, "__notes__", [])
        assert any("per process, not per thread" in note for note in notes) is noted


def test_an_embedding_bag_given_1d_input_and_offsets_split_by_rows_says_why() -> None:
    # Split, each shard's offsets point into the whole input: torch's message reads as a
    # mistake in the offsets given, which are right for the whole batch.
    bag = torch.nn.EmbeddingBag(10, 3)
    indices, offsets = torch.tensor([1, 2, 4, 5]), torch.tensor([0, 1, 2, 3])
    bag(indices, offsets)
    with pytest.raises(RuntimeError, match=r"offsets\[0\] has to be 0") as caught:
        fdp.pmap(bag, devices=cpus(2))({}, indices, offsets)
    assert any("is no batch of rows" in n and "the 2-D form" in n for n in caught.value.__notes__)


def test_an_embedding_bag_whose_first_shard_fails_first_says_why_too() -> None:
    # Bags of two indices before empty ones: replica 0's offsets start at 0, but its last
    # points past its shard of the input, and torch's error there is another one, raised first.
    bag = torch.nn.EmbeddingBag(10, 3)
    indices, offsets = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 2, 4, 6, 6, 6])
    bag(indices, offsets)
    with pytest.raises(RuntimeError, match=r"offsets\[-1\] can not be greater") as caught:
        fdp.pmap(bag, devices=cpus(2))({}, indices, offsets)
    assert any("is no batch of rows" in n and "the 2-D form" in n for n in caught.value.__notes__)
