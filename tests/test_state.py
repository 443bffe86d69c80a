"""Resident state: PerReplica leaves, device_put_replicated, unreplicate, out_axes=PER_REPLICA."""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
from typing import Any

import optree
import pytest
import torch
from helpers import cpus

import fdp


def test_device_put_replicated_makes_independent_copies() -> None:
    w = torch.ones(3, requires_grad=True)
    state = fdp.device_put_replicated({"w": w, "step": 0, "name": "run"}, cpus(3))
    copies = list(state["w"])
    assert len(copies) == 3 and len({id(c) for c in copies}) == 3 and all(c is not w for c in copies)
    assert not any(c.requires_grad for c in copies)
    copies[0].add_(1)
    assert torch.equal(copies[1], torch.ones(3)) and torch.equal(w.detach(), torch.ones(3))
    assert state["step"] == 0 and state["name"] == "run"


def test_replicas_get_their_own_copy_without_a_transfer() -> None:
    state = fdp.device_put_replicated({"w": torch.zeros(2)}, cpus(3))
    seen: dict[int, torch.Tensor] = {}
    lock = threading.Lock()

    def f(state, x):
        with lock:
            seen[fdp.axis_index("i")] = state["w"]
        return x

    fdp.pmap(f, axis_name="i", devices=cpus(3))(state, torch.zeros(6))
    assert all(seen[r] is state["w"][r] for r in range(3))


def test_per_replica_outputs_stay_put_and_round_trip() -> None:
    step = fdp.pmap(
        lambda s, x: ({"w": s["w"] + x.sum(), "n": s["n"] + 1}, x.sum()),
        devices=cpus(2),
        out_axes=(fdp.PER_REPLICA, 0),
    )
    state = fdp.device_put_replicated({"w": torch.zeros(1), "n": 0}, cpus(2))
    for _ in range(3):
        state, sums = step(state, torch.ones(4))
    assert isinstance(state["w"], fdp.PerReplica) and isinstance(state["n"], fdp.PerReplica)
    assert [float(w) for w in state["w"]] == [6.0, 6.0] and list(state["n"]) == [3, 3]
    assert fdp.unreplicate(state) == {"w": torch.tensor([6.0]), "n": 3}
    assert fdp.unreplicate(state, 1)["n"] == 3


def test_state_alone_runs_one_replica_per_copy() -> None:
    state = fdp.device_put_replicated({"w": torch.ones(2)}, cpus(3))
    out = fdp.pmap(lambda s: s["w"].sum() + fdp.axis_index("i"), axis_name="i", devices=cpus(3))(state)
    assert out.tolist() == [2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    ("split", "rows", "says", "never"),
    [
        # chunk: 10 rows over 8 devices is 5 replicas, though there is a row for every device
        ("chunk", 10, ["split='chunk'", "Use split='balanced'"], None),
        # balanced runs every replica only when there are at least as many rows as devices; the
        # message must not send the caller to split='balanced', which is already the rule used.
        ("balanced", 5, ["with split='balanced' a batch of 5 rows"], "split='chunk'"),
    ],
)
def test_state_needs_every_replica_to_run(split: str, rows: int, says: list[str], never: str | None) -> None:
    state = fdp.device_put_replicated({"w": torch.ones(2)}, cpus(8))
    f = fdp.pmap(lambda s, x: x, devices=cpus(8), split=split)
    with pytest.raises(ValueError) as info:
        f(state, torch.zeros(rows))
    message = str(info.value)
    assert (
        message.startswith("fdp.pmap(")
        and "<lambda>): args[0]['w'] holds 8 values, one per replica" in message
    )
    assert "this call runs 5 replicas" in message
    assert all(s in message for s in says) and (never is None or never not in message)
    assert "at least one row per device (8 rows here)" in message and "drop the last" in message
    fdp.pmap(lambda s, x: x, devices=cpus(8), split="balanced")(state, torch.zeros(10))
    f(state, torch.zeros(8))


@pytest.mark.parametrize("n", [1, 3])
def test_state_on_other_devices_is_an_error(n: int) -> None:
    state = fdp.device_put_replicated({"w": torch.ones(2)}, cpus(2))
    with pytest.raises(ValueError, match=rf"holds 2 values, one per replica .* runs {n} replicas?") as info:
        fdp.pmap(lambda s, x: x, devices=cpus(n))(state, torch.zeros(3))
    assert "fdp.device_put_replicated on the devices the call runs on" in str(info.value)
    assert "split=" not in str(info.value)  # the devices are at fault, not the split
    empty = fdp.PerReplica([], [])
    with pytest.raises(ValueError, match=r"args\[0\] holds 0 values, one per replica on \[\]"):
        fdp.pmap(lambda s, x: x, devices=cpus(n))(empty, torch.zeros(3))


@pytest.mark.parametrize("n", [1, 2])
def test_state_held_on_another_kind_of_device_is_an_error(n: int) -> None:
    """State held on as many devices as the call runs, but not on the call's devices (here the
    meta device), is refused, by one replica as by several: never handed to the replicas where
    it is."""
    state = fdp.PerReplica([torch.zeros(2, device="meta") for _ in range(n)], [torch.device("meta")] * n)
    with pytest.raises(
        ValueError, match=rf"args\[0\] holds {n} values, one per replica on \['meta'.* runs {n} replicas? on"
    ):
        fdp.pmap(lambda s, x: x, devices=cpus(n))(state, torch.zeros(4))


def test_per_replica_outputs_of_a_call_that_runs_fewer_replicas_than_devices() -> None:
    """A batch that runs fewer replicas than devices (10 rows over 8 with split='chunk') gives
    PerReplica outputs of the replicas that ran, on their devices."""
    out = fdp.pmap(lambda x: x.sum(), devices=cpus(8), out_axes=fdp.PER_REPLICA)(torch.ones(10))
    assert isinstance(out, fdp.PerReplica)
    assert [float(v) for v in out] == [2.0] * 5 and out.devices == (torch.device("cpu"),) * 5


@pytest.mark.parametrize("n", [1, 3])
def test_state_alone_on_other_devices_is_an_error(n: int) -> None:
    # With nothing mapped as with a batch: a state on 2 devices must not run 2 of the call's 3
    # replicas, an empty one no replica at all (a call that waited forever), and the leaf
    # blamed is the one that does not fit, not the first.
    f = fdp.pmap(lambda s: s, devices=cpus(n), out_axes=fdp.PER_REPLICA)
    with pytest.raises(ValueError, match=rf"args\[0\]\['w'\] holds 2 values, .* runs {n} replicas?"):
        f({"w": fdp.device_put_replicated(torch.ones(2), cpus(2))})
    state = {
        "a": fdp.device_put_replicated(torch.ones(1), cpus(2)),
        "b": fdp.device_put_replicated(torch.ones(1), cpus(3)),
    }
    with pytest.raises(ValueError, match=r"args\[0\]\['a'\] holds 2 values"):
        fdp.pmap(lambda s: s, devices=cpus(3))(state)
    with pytest.raises(ValueError, match=r"args\[0\] holds 0 values, one per replica on \[\]"):
        f(fdp.PerReplica([], []))


@pytest.mark.parametrize("n", [1, 2])
def test_resident_state_reaches_the_replicas_in_each_calls_containers(n: int) -> None:
    # One replica takes resident state without the general scatter: its trees are rebuilt with
    # each PerReplica's value, from each call's own structure (dict types and key orders), as
    # several replicas' are; so are the PER_REPLICA outputs made from them.
    state = fdp.device_put_replicated({"a": torch.zeros(2), "b": torch.ones(2)}, cpus(n))
    seen: list[tuple[type, list[str], bool]] = []
    lock = threading.Lock()

    def f(s, x):
        r = fdp.axis_index("i")
        with lock:
            seen.append((type(s), list(s), all(s[k] is state[k][r] for k in s)))
        return s, x.sum()

    mapped = fdp.pmap(f, axis_name="i", devices=cpus(n), out_axes=(fdp.PER_REPLICA, 0))
    calls = [
        dict(state),
        dict(state),
        {"b": state["b"], "a": state["a"]},
        collections.OrderedDict(b=state["b"], a=state["a"]),
        collections.defaultdict(list, a=state["a"], b=state["b"]),
    ]
    for tree in calls:
        seen.clear()
        out, sums = mapped(tree, torch.ones(2 * n))
        assert seen == [(type(tree), list(tree), True)] * n
        assert type(out) is type(tree) and list(out) == list(tree)
        assert all(out[k][r] is state[k][r] for k in tree for r in range(n))  # passed through
        assert sums.tolist() == [2.0] * n


def test_one_replica_takes_resident_state_without_the_general_scatter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fdp import _scatter

    scattered: list[int] = []
    scatter = _scatter.scatter_leaves
    monkeypatch.setattr(_scatter, "scatter_leaves", lambda *a, **k: scattered.append(1) or scatter(*a, **k))
    state = fdp.device_put_replicated({"w": torch.ones(2)}, ["cpu"])
    step = fdp.pmap(lambda s, x: {"w": s["w"] + x.sum()}, devices=["cpu"], out_axes=fdp.PER_REPLICA)
    for _ in range(3):
        state = step(state, torch.ones(4, 2))
    assert scattered == [] and state["w"][0].tolist() == [25.0, 25.0]
    step({**state, "n": 0}, torch.ones(4, 2))  # numbers reach the replica as they are
    assert scattered == []
    step({**state, "tag": object()}, torch.ones(4, 2))  # and other objects
    assert scattered == []

    class Marked(torch.Tensor):
        pass

    step(state, torch.ones(4, 2).as_subclass(Marked))  # a tensor subclass: the general path
    assert scattered == [1]


def test_a_sparse_input_returned_per_replica_is_copied() -> None:
    # Outputs are told apart from the inputs by their memory; a sparse tensor has no one
    # storage to compare (torch raises for it), and is told apart by identity.
    sparse = torch.ones(4, 2).to_sparse()
    out = fdp.pmap(lambda _, x: (x, x * 2), in_axes=(0, None), devices=["cpu"], out_axes=fdp.PER_REPLICA)(
        torch.zeros(1), sparse
    )
    assert out[0][0] is not sparse and torch.equal(out[0][0].to_dense(), torch.ones(4, 2))
    assert torch.equal(out[1][0].to_dense(), torch.full((4, 2), 2.0))


def test_per_replica_repr_and_checks() -> None:
    value = fdp.PerReplica([torch.zeros(2), torch.zeros(2)], [torch.device("cpu")] * 2)
    assert repr(value) == "PerReplica(2 replicas on cpu, cpu: float32[2])"
    with pytest.raises(
        ValueError,
        match=r"^fdp\.PerReplica: values and devices must have one entry per replica each, got 2 values "
        r"and 1 devices$",
    ):
        fdp.PerReplica([1, 2], [torch.device("cpu")])
    # len() said only "object of type 'generator' has no len()", naming neither the call nor the argument.
    with pytest.raises(
        TypeError,
        match=r"^fdp\.PerReplica: values must be a sequence with one entry per replica, got generator: ",
    ):
        fdp.PerReplica((torch.zeros(2) for _ in range(2)), [torch.device("cpu")] * 2)
    with pytest.raises(
        TypeError,
        match=r"^fdp\.PerReplica: devices must be a sequence with one entry per replica, got device: ",
    ):
        fdp.PerReplica([torch.zeros(2)], torch.device("cpu"))  # type: ignore[arg-type]
    # An empty one fits no call (refused there), but prints: repr raised IndexError.
    assert repr(fdp.PerReplica([], [])) == "PerReplica(0 replicas)"


@pytest.mark.parametrize("n", [1, 2])
def test_a_per_replica_built_with_devices_spelled_as_strings_says_so(n: int) -> None:
    # "cpu" != torch.device("cpu"): the state fitted no call, and the message read "holds 2
    # values, one per replica on ['cpu', 'cpu'], but this call runs 2 replicas on ['cpu', 'cpu']".
    state = fdp.PerReplica([torch.ones(3)] * n, ["cpu"] * n)  # type: ignore[list-item]
    with pytest.raises(TypeError) as info:
        fdp.pmap(lambda x, s: x + s, devices=cpus(n))(torch.zeros(4, 3), state)
    message = str(info.value)
    assert message.startswith(
        "fdp.pmap(test_a_per_replica_built_with_devices_spelled_as_strings_says_so.<locals>.<lambda>): "
        f"args[1] is a PerReplica whose devices must be torch.device objects, got strs: {['cpu'] * n!r}. "
    ), message
    assert "[torch.device(d) for d in devices]" in message


def test_device_put_replicated_of_a_per_replica_with_devices_spelled_as_strings_says_so() -> None:
    # A PerReplica rebuilt from a checkpoint of every replica's copy: the message read "already
    # placed, on 2 devices (cpu, cpu), not on the 2 devices given (cpu, cpu)".
    state = {"w": fdp.PerReplica([torch.ones(3)] * 2, ["cpu"] * 2)}  # type: ignore[list-item]
    with pytest.raises(TypeError) as info:
        fdp.device_put_replicated(state, cpus(2))
    assert str(info.value) == (
        "fdp.device_put_replicated: tree['w'] is a PerReplica whose devices must be torch.device "
        "objects, got strs: ['cpu', 'cpu']. Build it as fdp.PerReplica(values, [torch.device(d) "
        "for d in devices])"
    )


@pytest.mark.parametrize("n", [1, 2])
def test_per_replica_outputs_never_alias_inputs_or_each_other(n: int) -> None:
    w = torch.zeros(3)
    step = fdp.pmap(lambda w, x: (w, x), in_axes=(None, 0), devices=cpus(n), out_axes=fdp.PER_REPLICA)
    batch = torch.zeros(2, 3)
    state, shards = step(w, batch)
    state[0].add_(1)
    shards[-1].add_(5)
    assert torch.equal(state[-1], torch.ones(3) if n == 1 else torch.zeros(3))
    assert torch.equal(w, torch.zeros(3)) and torch.equal(batch, torch.zeros(2, 3))


@pytest.mark.parametrize("n", [1, 2])
def test_one_fresh_tensor_returned_twice_per_replica_becomes_two_states(n: int) -> None:
    # Resident state may be updated in place, one leaf at a time: two leaves made from one
    # tensor must not move together.
    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y, y

    first, second = fdp.pmap(step, devices=cpus(n), out_axes=fdp.PER_REPLICA)(torch.ones(2 * n, 3))
    for r in range(n):
        first[r].add_(1)
        assert torch.equal(first[r], torch.full((2, 3), 3.0)) and torch.equal(
            second[r], torch.full((2, 3), 2.0)
        )


@pytest.mark.parametrize("n", [1, 2])
def test_per_replica_pass_through_is_not_copied(n: int) -> None:
    state = fdp.device_put_replicated({"w": torch.zeros(2)}, cpus(n))
    new = fdp.pmap(lambda s, x: s, devices=cpus(n), out_axes=fdp.PER_REPLICA)(state, torch.zeros(2))
    assert all(a is b for a, b in zip(new["w"], state["w"]))


def test_unreplicate_takes_replica_0_by_default_and_counts_back_to_minus_n() -> None:
    # Replicas holding different values tell the indices apart (as a Python list would).
    values = [torch.full((2,), float(r)) for r in range(3)]
    state = {"w": fdp.PerReplica(values, [torch.device("cpu")] * 3), "n": 7}
    assert fdp.unreplicate(state)["w"] is values[0] and fdp.unreplicate(state)["n"] == 7
    for index in range(-3, 3):
        assert fdp.unreplicate(state, index)["w"] is values[index]


def test_copies_and_pickles_keep_per_replica_outputs_per_replica() -> None:
    # PER_REPLICA is one marker object that fdp compares by identity: a copied or unpickled
    # pmap must get that very object back, not a lookalike read as something else.
    import copy
    import pickle

    mapped = fdp.pmap(torch.neg, devices=cpus(2), out_axes=fdp.PER_REPLICA)
    x = torch.randn(4, 3)
    for twin in (copy.deepcopy(mapped), pickle.loads(pickle.dumps(mapped))):
        out = twin(x)
        assert isinstance(out, fdp.PerReplica)
        torch.testing.assert_close(torch.cat(list(out)), -x)


def test_unreplicate_out_of_range_names_the_index_and_replica_count() -> None:
    state = fdp.device_put_replicated({"opt": {"w": torch.ones(2)}, "n": 0}, cpus(2))
    assert torch.equal(fdp.unreplicate(state, -1)["opt"]["w"], state["opt"]["w"][1])  # as Python counts
    for index in (2, 5, -3):
        with pytest.raises(
            IndexError,
            match=rf"fdp\.unreplicate: index {index} is out of range: tree\['opt'\]\['w'\] holds 2 replicas",
        ):
            fdp.unreplicate(state, index)
    with pytest.raises(TypeError, match="fdp.unreplicate: index must be an int, got slice"):
        fdp.unreplicate(state, slice(0, 1))  # type: ignore[arg-type]


def test_device_put_replicated_keeps_state_placed_on_the_same_devices() -> None:
    state = fdp.device_put_replicated({"w": torch.ones(2)}, cpus(2))
    again = fdp.device_put_replicated({**state, "b": torch.zeros(1)}, cpus(2))
    assert again["w"] is state["w"] and len(again["b"]) == 2


@pytest.mark.parametrize("n", [1, 3])
def test_device_put_replicated_refuses_state_placed_on_other_devices(n: int) -> None:
    # Kept, its 2 replicas would reach a call over n devices, which refuses them only then.
    state = fdp.device_put_replicated({"w": torch.ones(2)}, cpus(2))
    with pytest.raises(
        ValueError,
        match=rf"fdp\.device_put_replicated: tree\['w'\] is already placed, on 2 devices \(cpu, cpu\), "
        rf"not on the {n} devices given .*fdp\.unreplicate",
    ):
        fdp.device_put_replicated(state, cpus(n))
    placed = fdp.device_put_replicated(fdp.unreplicate(state), cpus(n))  # the way out
    assert len(placed["w"]) == n


@dataclasses.dataclass
class Checked:
    """Checks its field as it is built: its __post_init__ reads the tensor's shape."""

    x: torch.Tensor

    def __post_init__(self) -> None:
        self.rows = self.x.shape[0]


class Validated:
    """A node registered with optree whose unflatten refuses anything but a tensor."""

    def __init__(self, w: torch.Tensor) -> None:
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"w must be a tensor, got {type(w).__name__}")
        self.w = w


optree.register_pytree_node(
    Validated, lambda v: ((v.w,), None), lambda _, children: Validated(*children), namespace=fdp.NAMESPACE
)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(
    ("make", "path", "name", "raised"),
    [
        (lambda x: {"s": [Checked(x)], "y": x}, r"output\['s'\]\[0\]", "Checked", "AttributeError: 'Per"),
        (lambda x: (x, Validated(x)), r"output\[1\]", "Validated", "TypeError: w must be a tensor, got Per"),
        (lambda x: Checked(x), "output", "Checked", "AttributeError"),
    ],
    ids=["dataclass", "registered node", "root"],
)
def test_a_node_that_checks_its_fields_under_per_replica_is_named(
    n: int, make: Any, path: str, name: str, raised: str
) -> None:
    # It raised a bare AttributeError ('PerReplica' object has no attribute 'shape') from inside
    # the user's class, naming neither the call nor the output.
    f = fdp.pmap(make, out_axes=fdp.PER_REPLICA, devices=cpus(n))
    with pytest.raises(TypeError) as info:
        f(torch.ones(4))
    assert re.match(
        rf"fdp.pmap\(\S*<lambda>\): {path} is a {name}, which cannot hold fdp.PerReplica values in place of "
        rf"its tensors: rebuilt with them, it raised {raised}.*\. out_axes fdp.PER_REPLICA keeps each of the "
        rf"output's tensors on its replica, as a fdp.PerReplica in the output's own containers. Return the "
        rf"{name}'s fields in a dict or a tuple \(and build a {name} from fdp.unreplicate of them where one "
        rf"is needed\), or give it out_axes None or 0 in an out_axes tree prefix$",
        str(info.value),
    ), str(info.value)
    # What the message advises works.
    fields = fdp.pmap(lambda x: {"x": x}, out_axes=fdp.PER_REPLICA, devices=cpus(n))(torch.ones(4))
    assert Checked(**fdp.unreplicate(fields)).rows == 4 // n
    out = fdp.pmap(lambda x: (x, Validated(x)), out_axes=(fdp.PER_REPLICA, 0), devices=cpus(n))(torch.ones(4))
    assert isinstance(out[1], Validated) and out[1].w.shape == (4,)


def test_a_packed_sequence_under_per_replica_is_named() -> None:
    # PackedSequence checks its fields' devices as it is built: "'PerReplica' object has no
    # attribute 'device'" before. (Under an int axis its own error says why it cannot be joined.)
    packed = fdp.pmap(
        lambda x, n: {"h": torch.nn.utils.rnn.pack_padded_sequence(x, n, True, False)},
        out_axes=fdp.PER_REPLICA,
        devices=cpus(2),
    )
    with pytest.raises(TypeError, match=r"output\['h'\] is a PackedSequence, .* give it out_axes None in an"):
        packed(torch.zeros(3, 4, 2), torch.tensor([4, 2, 3]))


def test_device_put_replicated_names_a_node_that_checks_its_fields() -> None:
    with pytest.raises(TypeError) as info:
        fdp.device_put_replicated({"s": Checked(torch.ones(3))}, cpus(2))
    assert str(info.value) == (
        "fdp.device_put_replicated: tree['s'] is a Checked, which cannot hold fdp.PerReplica values in "
        "place of its tensors: rebuilt with them, it raised AttributeError: 'PerReplica' object has no "
        "attribute 'shape'. Place its fields (in a dict or a tuple), and build the Checked from them "
        "inside the mapped function"
    )
    with pytest.raises(
        TypeError, match=r"^fdp.device_put_replicated: tree\[0\] is a Validated, .*got PerReplica"
    ):
        fdp.device_put_replicated([Validated(torch.ones(3))], cpus(2))
