"""fdp.DataParallel: nn.DataParallel's interface, its known bugs fixed, and PyTorch's own test cases.

The ports of PyTorch's ``test/distributed/test_data_parallel.py`` run on CPU devices, against
fdp.DataParallel and the fdp primitives. Where a test pins a fixed ``nn.DataParallel`` bug, its
docstring says what ``nn.DataParallel`` does (on GPUs; on a CPU build it only calls the module).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import threading
import weakref
from collections import OrderedDict, UserDict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import collect_when_workers_rest, cpus, sgd_steps
from torch import nn
from torch.utils.checkpoint import checkpoint

import fdp
from fdp import _data_parallel

torch.set_default_dtype(torch.float32)


def assert_grads_match(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            torch.testing.assert_close(pa.grad, pb.grad, atol=atol, rtol=1e-5, msg=name)


# --- the interface -----------------------------------------------------------------------------


def test_attributes_and_state_dict_match_nn_data_parallel() -> None:
    inner = nn.Linear(5, 2)
    ours = fdp.DataParallel(inner, device_ids=cpus(2))
    theirs = nn.DataParallel(copy.deepcopy(inner))
    assert ours.module is inner and ours.dim == 0
    assert ours.device_ids == [torch.device("cpu")] * 2 and ours.output_device == torch.device("cpu")
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["module.weight", "module.bias"]
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    buffer.seek(0)
    theirs.load_state_dict(torch.load(buffer, weights_only=True))
    buffer = io.BytesIO()
    torch.save(theirs.state_dict(), buffer)
    buffer.seek(0)
    ours.load_state_dict(torch.load(buffer, weights_only=True))


def test_without_device_ids_every_visible_gpu_else_the_cpu() -> None:
    # As nn.DataParallel(model): every visible CUDA device; without one, the CPU (where torch's
    # runs the module itself, with device_ids=[]).
    inner = nn.Linear(5, 2)
    ours = fdp.DataParallel(inner)
    # CUDA devices as indices, as nn.DataParallel keeps them (which has none without CUDA).
    expected = nn.DataParallel(nn.Linear(5, 2)).device_ids or [torch.device("cpu")]
    assert ours.device_ids == expected and ours.output_device == expected[0]
    x = torch.randn(6, 5)
    torch.testing.assert_close(ours(x).cpu(), inner.cpu()(x), atol=1e-5, rtol=1e-4)


def test_seed_tutorial_with_only_the_class_name_changed(capsys: pytest.CaptureFixture[str]) -> None:
    # The tutorial's code, with nn.DataParallel replaced by fdp.DataParallel (and CPU devices,
    # since this machine has no GPU).
    class Model(nn.Module):
        def __init__(self, input_size: int, output_size: int) -> None:
            super().__init__()
            self.fc = nn.Linear(input_size, output_size)

        def forward(self, input):
            output = self.fc(input)
            print(f"\tIn Model: input size {input.size()} output size {output.size()}\n", end="")
            return output

    model = fdp.DataParallel(Model(5, 2), device_ids=cpus(8))
    output = model(torch.randn(30, 5))
    assert output.size() == (30, 2)
    sizes = sorted(int(line.split("[")[1].split(",")[0]) for line in capsys.readouterr().out.splitlines())
    assert sizes == [2, 4, 4, 4, 4, 4, 4, 4]


def test_seed_data_parallel_model_wrapping_one_block() -> None:
    class DataParallelModel(nn.Module):
        def __init__(self, wrap: bool) -> None:
            super().__init__()
            self.block1 = nn.Linear(10, 20)
            self.block2 = nn.Linear(20, 20)
            if wrap:
                self.block2 = fdp.DataParallel(self.block2, device_ids=cpus(3))
            self.block3 = nn.Linear(20, 20)

        def forward(self, x):
            return self.block3(self.block2(self.block1(x)))

    plain = DataParallelModel(wrap=False)
    wrapped = DataParallelModel(wrap=True)
    wrapped.load_state_dict(
        {k.replace("block2.", "block2.module."): v for k, v in plain.state_dict().items()}
    )
    x = torch.randn(7, 10)
    torch.testing.assert_close(wrapped(x), plain(x))
    wrapped(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert_grads_match(plain, wrapped)


# --- nn.DataParallel's bugs, fixed -------------------------------------------------------------


@pytest.mark.parametrize("split", ["chunk", "balanced"])
def test_a_batch_smaller_than_the_devices_runs_on_the_first_copies_of_the_parameters(split: str) -> None:
    """A batch that runs fewer replicas than devices (2 rows over 4), as nn.DataParallel allows:
    the parameters placed on every device serve the replicas that run, call after call."""
    net = nn.Linear(3, 2)
    model = fdp.DataParallel(net, device_ids=cpus(4), split=split)
    for rows in (4, 2, 1, 4):
        x = torch.randn(rows, 3)
        torch.testing.assert_close(model(x), net(x))


def test_kwargs_scatter_with_the_positional_args() -> None:
    """nn.DataParallel builds 8 replicas here, 5 of them with no positional args (TypeError)."""

    class Scale(nn.Module):
        def forward(self, x, *, factor, name):
            assert name == "scale"
            return x * factor

    out = fdp.DataParallel(Scale(), device_ids=cpus(8))(torch.ones(3, 2), factor=2.0, name="scale")
    torch.testing.assert_close(out, torch.full((3, 2), 2.0))


@dataclasses.dataclass
class Batch:
    features: torch.Tensor
    mask: torch.Tensor


@dataclasses.dataclass
class Prediction:
    scores: torch.Tensor
    rows: torch.Tensor


def test_dataclass_inputs_split_and_outputs_gathered() -> None:
    """nn.DataParallel passes dataclasses whole (unsplit, unmoved) and cannot gather them."""

    class Net(nn.Module):
        def forward(self, batch: Batch) -> Prediction:
            return Prediction(batch.features.sum(1) * batch.mask, torch.tensor(batch.features.shape[0]))

    batch = Batch(torch.randn(10, 3), torch.ones(10))
    out = fdp.DataParallel(Net(), device_ids=cpus(4))(batch)
    assert isinstance(out, Prediction)
    torch.testing.assert_close(out.scores, batch.features.sum(1))
    assert out.rows.tolist() == [3, 3, 3, 1]


@pytest.mark.parametrize("n", [1, 2])
def test_zero_dim_outputs_with_dim_1(n: int) -> None:
    """nn.DataParallel raises IndexError gathering 0-dim outputs along dim 1. fdp.DataParallel
    stacks them, for any dim: its one dim splits the inputs too, so that a loss computed in
    forward has no out_axes entry of its own to take (fdp.pmap's out_axes past the stacked
    vector's one dim is an error)."""

    class Loss(nn.Module):
        def forward(self, x):
            return x.sum()

    for dim in (1, -1):
        model = fdp.DataParallel(Loss(), device_ids=cpus(n), dim=dim)
        torch.testing.assert_close(model(torch.ones(2, 6)), torch.full((n,), 12.0 / n))
        # An empty batch runs once, and its output is joined by the wrapper's rules, not
        # fdp.gather's (which refuse out_axes 1 for a 0-dim output).
        torch.testing.assert_close(model(torch.ones(2, 0)), torch.zeros(1))


def test_non_tensor_outputs() -> None:
    """nn.DataParallel returns "<map object ...>" for a str and raises for an int."""

    class Net(nn.Module):
        def forward(self, x):
            return {"out": x * 2, "kind": "double", "version": 3}

    out = fdp.DataParallel(Net(), device_ids=cpus(3))(torch.ones(6))
    assert out["kind"] == "double" and out["version"] == 3


def test_unused_parameters_keep_no_grad() -> None:
    """nn.DataParallel gives unused parameters zero gradients (its Broadcast materialises them)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(3, 3)
            self.unused = nn.Linear(3, 3)

        def forward(self, x):
            return self.used(x)

    net = Net()
    fdp.DataParallel(net, device_ids=cpus(2))(torch.randn(4, 3)).sum().backward()
    assert net.unused.weight.grad is None and net.used.weight.grad is not None


def test_batchnorm_statistics_are_averaged_not_replica_0s() -> None:
    """nn.DataParallel keeps replica 0's running statistics and drops the others'."""
    torch.manual_seed(0)
    x = torch.randn(12, 4) + torch.arange(12.0)[:, None]  # shards with very different means
    reference = nn.BatchNorm1d(4)
    shards = x.split([4, 4, 4])
    expected_mean = torch.stack([0.9 * reference.running_mean + 0.1 * s.mean(0) for s in shards]).mean(0)
    expected_var = torch.stack([0.9 * reference.running_var + 0.1 * s.var(0) for s in shards]).mean(0)

    averaged = fdp.DataParallel(copy.deepcopy(reference), device_ids=cpus(3))
    averaged(x)
    torch.testing.assert_close(averaged.module.running_mean, expected_mean)
    torch.testing.assert_close(averaged.module.running_var, expected_var)
    assert int(averaged.module.num_batches_tracked) == 1

    first = fdp.DataParallel(copy.deepcopy(reference), device_ids=cpus(3), buffers="replica0")
    first(x)
    torch.testing.assert_close(
        first.module.running_mean, 0.9 * reference.running_mean + 0.1 * shards[0].mean(0)
    )


def count_replications(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets an entry for every placement of the parameters on the devices."""
    calls: list[int] = []
    replicate = _data_parallel._scatter.replicate

    def counting(tree, devices):
        calls.append(1)
        return replicate(tree, devices)

    monkeypatch.setattr(_data_parallel._scatter, "replicate", counting)
    return calls


def test_no_replication_while_parameters_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """nn.DataParallel replicates the module (and broadcasts every parameter) on every forward."""
    calls = count_replications(monkeypatch)
    model = fdp.DataParallel(nn.Linear(3, 3), device_ids=cpus(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for _ in range(3):
        model(x)
    assert len(calls) == 1
    model(x).sum().backward()
    assert len(calls) == 1
    opt.step()  # changes the parameters in place, which the CPU replicas share: nothing to copy
    model(x)
    assert len(calls) == 1
    with torch.no_grad():  # copies made without a graph are kept apart from those with one
        model(x)
        model(x)
    assert len(calls) == 2
    model.module.weight = nn.Parameter(torch.zeros(3, 3))  # a new parameter is placed anew
    torch.testing.assert_close(model(x), model.module(x))
    assert len(calls) == 3


def test_parameters_whose_data_is_replaced_are_placed_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.half()``/``.double()`` after wrapping, or ``p.data = t``, swap a parameter's data
    without a change of identity or version counter: on GPUs, replicas whose copies were placed
    before would run on the old values (or dtype)."""
    calls = count_replications(monkeypatch)
    model = fdp.DataParallel(nn.Linear(3, 3), device_ids=cpus(2))
    model._shared_as_is = False  # as on several GPUs: the replicas get copies, placed by version
    x = torch.randn(4, 3)
    model(x)
    model(x)
    assert len(calls) == 1
    model.module.double()
    torch.testing.assert_close(model(x.double()), model.module(x.double()))
    assert len(calls) == 2
    model.module.weight.data = torch.zeros(3, 3, dtype=torch.float64)
    torch.testing.assert_close(model(x.double()), model.module(x.double()))
    assert len(calls) == 3


def test_data_swapped_out_of_parameters_shared_as_they_are_is_not_kept_alive() -> None:
    """CPU replicas get the parameters as they are (no address in the placement key): their
    data kept with the key would hold what model.half() (or .to()) swapped out until the next
    call, for nothing."""
    from torch.multiprocessing.reductions import StorageWeakRef

    model = fdp.DataParallel(nn.Linear(64, 64), device_ids=cpus(2))
    model(torch.randn(4, 64))
    old = [StorageWeakRef(p.untyped_storage()) for p in model.module.parameters()]
    model.module.half()
    collect_when_workers_rest()
    assert all(ref.expired() for ref in old)


def test_a_parametrized_module_dies_with_its_data_parallel() -> None:
    # The module goes to the replicas as a leaf of the arguments' tree, and its class, made by
    # parametrize for it alone, closes over it: fdp's cache of leaf types must not keep it.
    net = nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))
    model = fdp.DataParallel(net, device_ids=cpus(2))
    model(torch.randn(6, 4)).sum().backward()
    refs = [weakref.ref(net), weakref.ref(net.parametrizations.weight.original1)]
    del net, model
    collect_when_workers_rest()
    assert [r() for r in refs] == [None, None]


def test_parameters_are_visible_inside_forward() -> None:
    """nn.DataParallel's replicas have empty _parameters: self.parameters() yields nothing."""
    seen: list[int] = []
    lock = threading.Lock()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            with lock:
                seen.append(len(list(self.parameters())))
            return self.fc(x)

    fdp.DataParallel(Net(), device_ids=cpus(2))(torch.randn(4, 2))
    assert seen == [2, 2]


def test_hooks_that_forward_registers_stay_with_the_replica() -> None:
    """nn.DataParallel's replicas share the module's hook dicts (pytorch#128272): a hook that a
    replica registers in forward runs in the other replicas' forwards too, and one registered
    once (behind a flag set on self, dropped with the replica) piles up on the module."""
    calls: list[int] = []
    lock = threading.Lock()

    def count(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        with lock:
            calls.append(output.shape[0])

    class Hooking(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.register_forward_pre_hook(lambda module, args: None)  # the module's own: kept

        def forward(self, x):
            if not hasattr(self, "handle"):
                self.handle = self.fc.register_forward_hook(count)
            return self.fc(x)

    net = Hooking()
    model = fdp.DataParallel(net, device_ids=cpus(2))
    for _ in range(3):
        model(torch.randn(4, 2))
    assert calls == [2] * 6  # once per replica and call, on its own rows
    assert not net.fc._forward_hooks and len(net._forward_pre_hooks) == 1


def test_matches_one_device_for_a_training_step() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    dp_net = fdp.DataParallel(copy.deepcopy(net), device_ids=cpus(3))
    x, y = torch.randn(10, 6), torch.randn(10, 2)
    for model in (net, dp_net):
        sgd_steps(model, x, y)
    for a, b in zip(net.parameters(), dp_net.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_one_device_matches_the_module_without_the_general_scatter(monkeypatch: pytest.MonkeyPatch) -> None:
    # One device that holds the parameters, with the inputs already there: the parameters, the
    # module and the buffers reach the replica as they are, with no general scatter and nothing
    # placed; BatchNorm's statistics still come back to the module.
    scattered: list[str] = []
    for owner, name in (
        (_data_parallel._pmap._scatter, "scatter_leaves"),
        (_data_parallel._scatter, "replicate"),
    ):
        original = getattr(owner, name)
        monkeypatch.setattr(
            owner, name, lambda *a, _n=name, _f=original, **k: scattered.append(_n) or _f(*a, **k)
        )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    dp_net = fdp.DataParallel(copy.deepcopy(net), device_ids=["cpu"])
    x, y = torch.randn(10, 6), torch.randn(10, 2)
    for model in (net, dp_net):
        sgd_steps(model, x, y)
    for model in (net, dp_net):
        model.eval()
    torch.testing.assert_close(dp_net(x), net(x), atol=1e-6, rtol=1e-5)
    assert scattered == []
    for a, b in zip(net.state_dict().values(), dp_net.module.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_one_device_that_holds_the_module_runs_the_module_itself() -> None:
    """As nn.DataParallel on one device: the module's own forward, so what it sets on ``self``
    stays, while inputs and outputs keep fdp's rules (checked sizes, 0-dim outputs stacked)."""

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 1)
            self.calls = 0
            self.selves: list[nn.Module] = []

        def forward(self, x, y=None):
            self.calls += 1
            self.selves.append(self)
            return {"out": self.fc(x), "total": x.sum(), "kind": "linear"}

    net = Counting()
    model = fdp.DataParallel(net, device_ids=["cpu"])
    out = model(torch.ones(3, 2))
    torch.testing.assert_close(out["out"], net.fc(torch.ones(3, 2)))
    torch.testing.assert_close(out["total"], torch.tensor([6.0]))  # one replica's 0-dim, stacked
    assert out["kind"] == "linear"
    assert net.calls == 1 and net.selves == [net]
    with pytest.raises(ValueError, match=r"axis 0 of kwargs\['y'\] of type float32\[2\]"):
        model(torch.ones(3, 2), y=torch.ones(2))
    with pytest.raises(ValueError, match=r"axis 0 of inputs\[1\] of type float32\[2\]"):
        model(torch.ones(3, 2), torch.ones(2))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_an_empty_batch_runs_as_on_one_device(n: int) -> None:
    """A batch with no rows (a detector's data-dependent second stage; pytorch#12013) runs as
    the module runs on one device, and as nn.DataParallel runs it (each device gets no rows)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x, boxes=None):
            self.seen += x.shape[0]
            return {"out": self.fc(x), "boxes": boxes * 2, "total": x.sum(), "kind": "empty"}

    net = Net()
    reference = copy.deepcopy(net)
    x = torch.zeros(0, 3, requires_grad=True)
    out = fdp.DataParallel(net, device_ids=cpus(n))(x, boxes=torch.zeros(0, 4))
    expected = reference(x, boxes=torch.zeros(0, 4))
    assert out["out"].shape == (0, 2) and out["boxes"].shape == (0, 4) and out["kind"] == "empty"
    torch.testing.assert_close(out["total"], torch.zeros(1))  # one replica's 0-dim, stacked
    out["out"].sum().backward()
    expected["out"].sum().backward()
    assert_grads_match(net, reference)
    with pytest.raises(ValueError, match=r"inconsistent sizes"):
        fdp.DataParallel(net, device_ids=cpus(n))(torch.zeros(0, 3), boxes=torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"rank should be at least"):
        fdp.DataParallel(net, device_ids=cpus(n), dim=1)(torch.zeros(0, 3), boxes=torch.zeros(0))
    # Rows that fdp refuses to split beside an empty batch: refused as beside rows.
    with pytest.raises(TypeError, match=r"kwargs\['boxes'\]: a UserDict holding tensors"):
        fdp.DataParallel(net, device_ids=cpus(n))(torch.zeros(0, 3), boxes=UserDict(b=torch.zeros(0, 4)))


@pytest.mark.parametrize("n", [1, 2])
def test_an_empty_batch_or_a_call_without_tensors_runs_in_a_replica_of_the_axis(n: int) -> None:
    """Run once on the first device, the call is still a replica of the wrapper's axis_name: a
    module that calls a collective runs as on a batch (it raised 'unbound axis name'), and a
    call inside a replica is refused as on a batch."""

    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x=None):
            rows = fdp.psum(torch.tensor(0.0 if x is None else float(x.shape[0])), "batch")
            return {"rows": rows, "replicas": fdp.axis_size("batch")}

    model = fdp.DataParallel(Counted(), device_ids=cpus(n), axis_name="batch")
    torch.testing.assert_close(model(torch.zeros(4, 3))["rows"], torch.full((min(n, 4),), 4.0))
    empty = model(torch.zeros(0, 3))
    torch.testing.assert_close(empty["rows"], torch.zeros(1))
    assert empty["replicas"] == 1
    assert model()["replicas"] == 1
    inner = fdp.DataParallel(nn.Linear(3, 2), device_ids=cpus(n))
    with pytest.raises(RuntimeError, match=r"^fdp.DataParallel was called inside a function that is already"):
        fdp.pmap(lambda x: inner(x[:0]), devices=cpus(2))(torch.zeros(2, 3))


@pytest.mark.parametrize("n", [1, 2])
def test_a_call_without_tensors_runs_once_on_the_first_device(n: int) -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.calls = 0

        def forward(self, k=2):
            self.calls += 1  # on one device the module itself runs, as with a tensor
            return self.w * k

    net = Scaled()
    model = fdp.DataParallel(net, device_ids=cpus(n))
    torch.testing.assert_close(model(), torch.full((3,), 2.0))
    torch.testing.assert_close(model(3), torch.full((3,), 3.0))
    assert net.calls == (2 if n == 1 else 0)


class Encoding(UserDict):  # a Hugging Face BatchEncoding, as a DataCollator returns it
    pass


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (
            lambda: Encoding(input_ids=torch.ones(4, 3)),
            r"inputs\[0\]: a Encoding holding tensors, .* Pass a plain dict",
        ),
        (lambda: {"input_ids": np.ones((4, 3), np.float32)}, r"inputs\[0\]\['input_ids'\]: a numpy.ndarray"),
    ],
    ids=["UserDict", "numpy"],
)
def test_rows_fdp_does_not_split_are_refused_when_no_tensor_is_passed(n: int, batch: Any, match: str) -> None:
    # With no tensor leaf among the inputs, the call ran unsplit on the first device, as a call
    # without tensors does: the batch of a UserDict or NumPy array given alone was silently not
    # split (nor moved), where beside a tensor it is refused.
    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, batch: Any) -> torch.Tensor:
            return self.lin(torch.as_tensor(batch["input_ids"]))

    with pytest.raises(TypeError, match=rf"^fdp.DataParallel: {match}"):
        fdp.DataParallel(Reads(), device_ids=cpus(n))(batch())


@pytest.mark.parametrize("n", [1, 2])
def test_a_call_without_tensors_keeps_the_buffers_it_updates(n: int) -> None:
    # Run on the first device alone (as nn.DataParallel runs it), through fdp's functional call
    # where the module is not run itself: the running statistics it updates reach the module.
    class Sampled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(3)

        def forward(self, rows: int = 8) -> torch.Tensor:
            return self.norm(torch.arange(rows * 3.0).reshape(rows, 3))

    net, alone = Sampled(), Sampled()
    model = fdp.DataParallel(net, device_ids=cpus(n))
    for rows in (8, 5):
        torch.testing.assert_close(model(rows), alone(rows))
    for name, buffer in alone.named_buffers():
        torch.testing.assert_close(net.get_buffer(name), buffer)


@pytest.mark.parametrize("n", [1, 2])
def test_a_module_written_as_a_dataclass_runs_with_its_own_weights(n: int) -> None:
    @dataclasses.dataclass(eq=False)
    class Dense(nn.Module):
        width: int = 3

        def __post_init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(self.width, 1)

        def forward(self, x):
            return self.fc(x)

    class Marked(torch.Tensor):  # a subclass: not the one-replica fast path of plain tensors
        pass

    net, x = Dense(), torch.randn(4, 3)
    out = fdp.DataParallel(net, device_ids=cpus(n))(x.as_subclass(Marked))
    torch.testing.assert_close(out.as_subclass(torch.Tensor), net(x))
    out.sum().backward()
    assert net.fc.weight.grad is not None


@pytest.mark.parametrize("n", [1, 2])
def test_a_buffer_that_forward_reassigns_is_kept_in_training(n: int) -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x):
            self.steps = self.steps + 1  # a new tensor, not an in-place change
            return self.fc(x)

    model = fdp.DataParallel(Counting(), device_ids=cpus(n))
    for _ in range(3):
        model(torch.randn(4, 2))
    assert model.module.steps.item() == 3.0


@pytest.mark.parametrize("n", [1, 2])
def test_a_submodule_in_training_under_a_root_in_evaluation(n: int) -> None:
    """``model.eval(); model.norm.train()``: the norm's statistics update, as on one device
    (nn.DataParallel keeps replica 0's); the replicas must not update shared buffers."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.norm = nn.BatchNorm1d(3)

        def forward(self, x):
            return self.norm(self.fc(x))

    net = Net()
    net.eval()
    net.norm.train()
    oracle = copy.deepcopy(net)
    x = torch.randn(8, 3) * 2 + 1
    fdp.DataParallel(net, device_ids=cpus(n))(x)
    means = []
    for shard in x.chunk(n):  # each replica's update of its own copy, then their average
        twin = copy.deepcopy(oracle)
        twin(shard)
        means.append(twin.norm.running_mean)
    torch.testing.assert_close(net.norm.running_mean, torch.stack(means).mean(0))
    assert int(net.norm.num_batches_tracked) == 1


@pytest.mark.parametrize("n", [1, 2])
def test_a_buffer_that_forward_reassigns_with_another_shape_or_dtype(n: int) -> None:
    """As on one device, the module's buffer becomes the new tensor: not copied into the old
    one (which fails for a cache that grows, or broadcasts silently) nor cast to its dtype."""

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("table", torch.zeros(2, 4), persistent=False)  # a RoPE-like cache
            self.register_buffer("scale", torch.ones(2))
            self.register_buffer("mask", torch.zeros(4))

        def forward(self, x):
            length = x.shape[1]
            if self.table.shape[0] < length:
                self.table = torch.arange(length * 4.0).view(length, 4)
            self.scale = torch.tensor(2.0)  # 0-dim, not broadcast into the old shape
            self.mask = torch.ones(4, dtype=torch.bool)
            return self.fc(x) * self.scale + self.table[:length]

    net = Cached()
    oracle = copy.deepcopy(net)
    x = torch.randn(4, 3, 4)
    model = fdp.DataParallel(net, device_ids=cpus(n))
    for _ in range(2):
        torch.testing.assert_close(model(x), oracle(x))
        for name, expected in oracle.named_buffers():
            torch.testing.assert_close(net.get_buffer(name), expected, msg=name)
    assert list(model.state_dict()) == [f"module.{name}" for name in oracle.state_dict()]


def test_buffers_are_averaged_at_full_precision_under_autocast() -> None:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4)
    with torch.no_grad():
        norm.running_mean.fill_(1.2345678)
    oracle = copy.deepcopy(norm)
    x = torch.randn(8, 4) * 3 + 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fdp.DataParallel(norm, device_ids=cpus(2))(x)
    # The oracle: each shard's update on its own copy, then the average in float32.
    shards = []
    for shard in x.chunk(2):
        twin = copy.deepcopy(oracle)
        twin(shard)
        shards.append(twin.running_mean)
    torch.testing.assert_close(norm.running_mean, (shards[0] + shards[1]) / 2, atol=1e-6, rtol=1e-6)


def test_float16_buffers_are_averaged_under_a_bfloat16_autocast() -> None:
    # The average stacks the replicas' buffers: under autocast, torch.stack refuses float16
    # tensors in a bfloat16 region, so a float16 BatchNorm's forward failed after the replicas ran.
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4).half()
    oracle = copy.deepcopy(norm)
    x = (torch.randn(8, 4) * 3 + 1).half()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fdp.DataParallel(norm, device_ids=cpus(2))(x)
        shards = [copy.deepcopy(oracle) for _ in range(2)]
        expected = [twin(shard) for twin, shard in zip(shards, x.chunk(2))]
    assert out.dtype == norm.running_mean.dtype == torch.float16
    assert torch.equal(out, torch.cat(expected))
    average = (shards[0].running_mean.float() + shards[1].running_mean.float()) / 2
    assert torch.equal(norm.running_mean, average.half())


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "on_workers"])
def test_grad_scaler_steps_and_skips_as_on_one_device(inline: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.amp.GradScaler over float16 autocast: the same scales and parameters as the plain
    module, step after step, through steps the scaler skips for inf gradients: the first (a
    scale of 2**30 overflows float16) and one whose inf comes from replica 1's shard alone."""
    monkeypatch.setattr(fdp._pool, "INLINE_REPLICAS", inline)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    plain = copy.deepcopy(net)
    model = fdp.DataParallel(net, device_ids=cpus(2))
    runs = [
        (
            model,
            net,
            torch.optim.SGD(net.parameters(), lr=0.1),
            torch.amp.GradScaler("cpu", init_scale=2.0**30),
        ),
        (
            plain,
            plain,
            torch.optim.SGD(plain.parameters(), lr=0.1),
            torch.amp.GradScaler("cpu", init_scale=2.0**30),
        ),
    ]
    for step in range(5):
        x, y = torch.randn(6, 4), torch.randn(6, 2)
        if step == 3:
            x[4, 0] = float("inf")  # a row of replica 1's shard (rows 3-5)
        scales, skipped = [], []
        for call, module, opt, scaler in runs:
            before = [p.detach().clone() for p in module.parameters()]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(call(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            # Then a scale that overflows neither: near the edge, a shard's float16 partial sum
            # of a gradient may overflow where the whole batch's cancels (as with DDP).
            scaler.update(2.0**16 if step == 0 else None)
            scales.append(scaler.get_scale())
            skipped.append(all(torch.equal(b, p) for b, p in zip(before, module.parameters())))
        assert scales[0] == scales[1], step
        assert skipped[0] == skipped[1] == (step in (0, 3)), step
        for p, q in zip(net.parameters(), plain.parameters()):
            # float16 products over a shard or the whole batch: equal to float16 rounding.
            torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-3)


def test_averaging_leaves_untouched_buffers_alone_and_rounds_once() -> None:
    """Shares of 2/3 and 1/3 (batch 3 on 2 replicas) do not sum to exactly 1: averaged anyway, a
    buffer that forward never touches (a RoPE table) drifted call after call (by ~2% in
    bfloat16 after 100 calls), with its version counter bumped; and bfloat16 shares summing to
    1.002 biased every average."""

    class Tracking(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("table", torch.randn(256))  # forward only reads it
            self.register_buffer("level", torch.zeros(()))

        def forward(self, x):
            self.level.copy_(x.mean())
            return self.fc(x)

    for dtype in (torch.float32, torch.bfloat16):
        net = Tracking().to(dtype)
        table, version = net.table.clone(), net.table._version
        model = fdp.DataParallel(net, device_ids=cpus(2))
        for _ in range(20):
            model(torch.randn(3, 4, dtype=dtype))
        assert torch.equal(net.table, table) and net.table._version == version, dtype
    # Rows of 10 and a row of 11: the average, 10.33, is 10.3125 in bfloat16 (not 10.375).
    x = torch.tensor([[10.0] * 4, [10.0] * 4, [11.0] * 4], dtype=torch.bfloat16)
    model(x)
    assert net.level.item() == 10.3125


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.complex128])
def test_complex_buffers_are_averaged_as_real_ones(dtype: torch.dtype) -> None:
    """A running mean of complex features took replica 0's value alone, silently: only
    floating-point buffers were averaged. It is the one-device full-batch mean, as a real one."""

    class Running(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.zeros(3, dtype=dtype))
            self.fc = nn.Linear(3, 3, dtype=dtype)

        def forward(self, x):
            y = self.fc(x - self.mean)  # before the update: each shard sees the same mean
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
            return y

    torch.manual_seed(0)
    plain = Running()
    net = copy.deepcopy(plain)
    model = fdp.DataParallel(net, device_ids=cpus(2))
    for _ in range(3):
        x = torch.randn(6, 3, dtype=dtype)  # equal shards: the average is the full batch's mean
        torch.testing.assert_close(model(x), plain(x))
        torch.testing.assert_close(net.mean, plain.mean)


@pytest.mark.parametrize("n", [1, 2])
def test_a_wrapper_that_has_run_can_be_copied_and_saved(n: int) -> None:
    import pickle

    model = fdp.DataParallel(nn.Linear(3, 2), device_ids=cpus(n))
    x = torch.randn(4, 3)
    model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (
        copy.deepcopy(model),
        pickle.loads(pickle.dumps(model)),
        torch.load(buffer, weights_only=False),
    ):
        assert twin.module is not model.module
        assert twin._placed is None  # placed anew: on GPUs the placed copies are not leaves
        torch.testing.assert_close(twin(x), model(x))


@pytest.mark.parametrize("n", [1, 2])
def test_activation_checkpointing_inside_forward(n: int) -> None:
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 1)
            self.norm = nn.BatchNorm1d(3)

        def forward(self, x):
            h = torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False)
            return self.b(torch.tanh(self.norm(h)))

    torch.manual_seed(0)
    net = Checkpointed()
    oracle = copy.deepcopy(net)
    x = torch.randn(8, 3)
    fdp.DataParallel(net, device_ids=cpus(n))(x).square().sum().backward()
    for shard in x.chunk(n):  # BatchNorm normalizes each replica's shard apart
        oracle(shard).square().sum().backward()
    assert_grads_match(net, oracle, atol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_buffers_changed_in_a_checkpointed_segment_are_updated_once_per_step_on_several_devices(
    n: int,
) -> None:
    # As docs/concepts.md says: torch's recomputation runs forward's buffer updates again (a
    # module run by itself, as on one device, counts the batch twice); on several devices the
    # recomputation writes to the call's copies, written back already.
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))

    class Segmented(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.net, x, use_reentrant=False)

    model = fdp.DataParallel(Segmented(), device_ids=cpus(n))
    model(torch.randn(6, 3)).square().sum().backward()
    assert net[1].num_batches_tracked.item() == (2 if n == 1 else 1)


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "on_workers"])
@pytest.mark.parametrize("n", [2, 3])
def test_activation_checkpointing_around_the_wrapper(
    n: int, inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``checkpoint(model, x, use_reentrant=False)`` with ``model`` an fdp.DataParallel (a block of
    a larger model). torch's checkpoint matches the tensors its hooks save in the forward to
    those of the recomputation by the order they are saved in: replicas running side by side
    did not keep one, and with tensors of equal shapes the gradients were silently wrong (they
    now take turns in index order)."""
    monkeypatch.setattr(fdp._pool, "INLINE_REPLICAS", inline)

    class Elementwise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            for _ in range(12):
                x = torch.sin(x) * self.scale  # every saved tensor has the shard's shape
            return x

    net = Elementwise()
    model = fdp.DataParallel(net, device_ids=cpus(n))
    for _ in range(3):
        x = torch.randn(2 * n, 2048, requires_grad=True)
        checkpoint(model, x, use_reentrant=False).square().sum().backward()
        expected = x.detach().clone().requires_grad_()
        twin = copy.deepcopy(net)
        twin.scale.grad = None
        twin(expected).square().sum().backward()
        torch.testing.assert_close(x.grad, expected.grad)
        torch.testing.assert_close(net.scale.grad, twin.scale.grad)
        net.scale.grad = None


@pytest.mark.parametrize("training", [True, False])
def test_a_scripted_module_on_several_devices_gets_torchs_refusal(training: bool) -> None:
    """As documented (docs/migrating/from-dataparallel.md): torch refuses a functional call of a
    scripted module, and says so. Reading its training mode must not fail first (a
    RecursiveScriptModule keeps no 'training' in its __dict__: KeyError: 'training')."""
    import warnings

    with warnings.catch_warnings():  # torch.jit is deprecated, and says so
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated")
        scripted = torch.jit.script(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    scripted.train(training)
    assert _data_parallel._parameters_and_buffers(scripted)[2] is training
    with pytest.raises(RuntimeError, match="Jitted modules"):
        fdp.DataParallel(scripted, device_ids=cpus(2))(torch.randn(4, 3))


def test_one_walk_lists_what_named_parameters_and_named_buffers_list() -> None:
    class Tricky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2, bias=False)  # a None parameter
            self.b = nn.Linear(2, 2)
            self.b.weight = self.a.weight  # tied: listed once, under its first name
            self.shared = nn.BatchNorm1d(2)
            self.again = self.shared  # one submodule under two names: listed once
            self.register_buffer("nothing", None)
            self.register_buffer("step", torch.zeros(()))
            self.b.register_buffer("step_too", self.step)  # a tied buffer

    for module in (Tricky(), nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Sequential(nn.LayerNorm(3)))):
        params, buffers, training = _data_parallel._parameters_and_buffers(module)
        assert list(params.items()) == list(module.named_parameters())
        assert list(buffers.items()) == list(module.named_buffers())
        assert training
        module.eval()
        assert not _data_parallel._parameters_and_buffers(module)[2]
        module[-1].train() if isinstance(module, nn.Sequential) else module.again.train()
        assert _data_parallel._parameters_and_buffers(module)[2]


def test_bad_buffers_mode() -> None:
    with pytest.raises(ValueError, match="buffers must be 'average' or 'replica0'"):
        fdp.DataParallel(nn.Linear(1, 1), buffers="mean")  # type: ignore[arg-type]


# --- PyTorch's test_data_parallel.py, on CPU devices -----------------------------------------------


def test_multiple_input() -> None:  # test_data_parallel_multiple_input
    class TestModule(nn.Module):
        def forward(self, var1, var2, float1, var3=None):
            if var3 is None:
                return float1 * (var1 * var2)
            return float1 * (var1 * var2 + var3)

    var1 = torch.randn(5, 5, requires_grad=True)
    var2 = torch.randn(5, 5, requires_grad=True)
    var3 = torch.randn(5, 5)
    float1 = torch.randn(1).item()
    for kwargs in ({}, {"var3": var3}):
        expected = TestModule()(var1, var2, float1, **kwargs)
        expected.sum().backward()
        grads = (var1.grad.clone(), var2.grad.clone())
        var1.grad = var2.grad = None
        out = fdp.DataParallel(TestModule(), device_ids=cpus(2))(var1, var2, float1, **kwargs)
        out.sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close((var1.grad, var2.grad), grads)
        var1.grad = var2.grad = None


def test_nested_output() -> None:  # test_data_parallel_nested_output
    def fn(input):
        return [
            input,
            (input.sin(), input.cos(), [input.add(1)]),
            input,
            OrderedDict(a=input, b=[input.sin()]),
        ]

    class Net(nn.Module):
        def forward(self, input):
            return fn(input)

    i = torch.randn(2, 2)
    output = fdp.DataParallel(Net(), device_ids=cpus(2))(i)
    expected = fn(i)
    assert (
        isinstance(output[1], tuple) and isinstance(output[1][2], list) and isinstance(output[3], OrderedDict)
    )
    torch.testing.assert_close(output[1][2][0], expected[1][2][0])
    torch.testing.assert_close(output[3]["b"][0], expected[3]["b"][0])


def test_nested_input() -> None:  # test_data_parallel_nested_input
    class Net(nn.Module):
        def forward(self, *input):
            return input[1][0]

    i = torch.randn(20, 3)
    input = (i.cos(), (i.sin(), i), i.sin())
    torch.testing.assert_close(fdp.DataParallel(Net(), device_ids=cpus(3))(*input), i.sin())


def test_zero_inputs() -> None:  # test_data_parallel_module_zero_inputs
    class TestModule(nn.Module):
        def forward(self):
            return torch.eye(2, 3)

    out = fdp.DataParallel(TestModule(), device_ids=cpus(2))()
    torch.testing.assert_close(out, torch.eye(2, 3))


@pytest.mark.parametrize("unused", [[], {}, ()], ids=["list", "dict", "tuple"])
def test_kwargs_only_with_empty_containers(unused: Any) -> None:  # ..._kwargs_only_empty_*
    l = nn.Linear(10, 5)  # noqa: E741 - PyTorch's name

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = l

        def forward(self, input):
            return self.l(input["data"])

    i = torch.randn(20, 10)
    out = fdp.DataParallel(Net(), device_ids=cpus(2))(input={"data": i, "unused": unused})
    torch.testing.assert_close(out, l(i))


def test_no_grad_propagates() -> None:  # test_data_parallel_no_grad
    seen: list[bool] = []

    class Layer(nn.Module):
        def forward(self, x):
            seen.append(torch.is_grad_enabled())
            return x

    layer = fdp.DataParallel(Layer(), device_ids=cpus(2))
    with torch.no_grad():
        layer(torch.randn(20, 10))
    layer(torch.randn(20, 10))
    assert seen == [False, False, True, True]


def test_rnn_with_flatten_parameters() -> None:  # test_data_parallel_rnn
    class TestModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(30, 16, 1, batch_first=True, bidirectional=True)

        def forward(self, x):
            self.rnn.flatten_parameters()
            return self.rnn(x)

    def step(model: nn.Module) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=10)
        output = model(torch.ones(4, 4, 30))
        F.mse_loss(output[0], torch.zeros_like(output[0])).backward()
        opt.step()

    with torch.no_grad():
        model = TestModule()
        model_dp = fdp.DataParallel(copy.deepcopy(model), device_ids=cpus(2))
        model_dp(torch.rand(2, 4, 30))  # must not crash with grad disabled (PyTorch #21108)
    step(model)
    step(model_dp)
    for p1, p2 in zip(model.parameters(), model_dp.parameters()):
        torch.testing.assert_close(p1, p2, atol=1e-5, rtol=1e-5)


def test_buffers_requiring_grad() -> None:  # test_data_parallel_buffers_requiring_grad
    class TestModule(nn.Module):
        def __init__(self, t: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("t_rg", t)
            self.register_buffer("t_not_rg", t.clone().detach())

        def forward(self, x):
            return x * self.t_rg + self.t_not_rg

    m = TestModule(torch.randn(10, dtype=torch.float64, requires_grad=True))
    dpm = fdp.DataParallel(m, device_ids=cpus(2))
    inp = torch.randn(2, 10, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: dpm(inp), (m.t_rg,))


def test_sparse_embedding_gradients() -> None:  # test_data_parallel_sparse
    layer = nn.Embedding(10, 5, sparse=True)
    i = torch.randint(10, (20, 5))
    expected = layer(i)
    expected.sum().backward()
    expected_grad = layer.weight.grad.to_dense().clone()
    layer.zero_grad()
    out = fdp.DataParallel(layer, device_ids=cpus(2))(i)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    assert layer.weight.grad.is_sparse
    torch.testing.assert_close(layer.weight.grad.to_dense(), expected_grad)


def test_gradient_penalty_with_create_graph() -> None:  # test_data_parallel_function_deletion
    def penalty(model: nn.Module) -> None:
        x = torch.ones(2, 4, requires_grad=True)
        output = model(x)
        torch.autograd.grad(output, x, grad_outputs=x.new_ones(output.size()), create_graph=True)[
            0
        ].mean().backward()

    net = nn.Linear(4, 1)
    penalty(fdp.DataParallel(net, device_ids=cpus(2)))
    torch.testing.assert_close(net.weight.grad, torch.full((1, 4), 0.25))
    # The bias does not reach the penalty: None, as on one device (PyTorch's test expects the
    # zeros that nn.DataParallel's broadcast makes up).
    assert net.bias.grad is None
    alone = copy.deepcopy(net)
    alone.zero_grad(set_to_none=True)
    penalty(alone)
    assert alone.bias.grad is None


def test_namedtuple_scatter_and_gather() -> None:
    Pair = namedtuple("Pair", ["a", "b"])
    tree = Pair(torch.arange(4.0), torch.arange(8.0).reshape(4, 2))
    shards = fdp.scatter(tree, cpus(2))
    assert all(isinstance(s, Pair) for s in shards)
    joined = fdp.gather(shards, "cpu")
    assert isinstance(joined, Pair)
    torch.testing.assert_close(joined.b, tree.b)


def test_parallel_apply_passes_the_exception() -> None:  # test_parallel_apply_passes_exception
    class TestModule(nn.Module):
        def forward(self, *args):
            return {}["wonderful"]

    module = TestModule()
    with pytest.raises(KeyError, match="wonderful") as info:
        fdp.parallel_apply((module, module), (None, None), devices=cpus(2))
    assert any("raised by replica 0 of 2 (device cpu)" in note for note in info.value.__notes__)


def test_parallel_apply() -> None:  # test_parallel_apply
    l1, l2 = nn.Linear(10, 5), nn.Linear(10, 5)
    i1, i2 = torch.randn(2, 10), torch.randn(2, 10)
    for inputs in [((i1,), (i2,)), (i1, i2)]:
        outputs = fdp.parallel_apply((l1, l2), inputs, None, devices=cpus(2))
        torch.testing.assert_close(outputs[0], l1(i1))
        torch.testing.assert_close(outputs[1], l2(i2))


def test_device_objects_as_arguments() -> None:  # test_data_parallel_device_args
    l = nn.Linear(10, 5)  # noqa: E741
    i = torch.randn(20, 10, requires_grad=True)
    cpu = torch.device("cpu")
    out = fdp.DataParallel(l, device_ids=[cpu, cpu], output_device=cpu)(i)
    torch.testing.assert_close(out, l(i))


def test_scatter_and_gather_gradients() -> None:  # _test_scatter, _test_gather
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    result = fdp.scatter(x, cpus(2))
    torch.testing.assert_close(result[0], x[:2])
    torch.testing.assert_close(result[1], x[2:])
    assert torch.autograd.gradcheck(lambda y: tuple(fdp.scatter(y, cpus(2))), (x,))
    assert torch.autograd.gradgradcheck(lambda y: tuple(fdp.scatter(y, cpus(2))), (x,))
    parts = (
        torch.randn(2, 4, dtype=torch.float64, requires_grad=True),
        torch.randn(2, 4, dtype=torch.float64, requires_grad=True),
    )
    assert torch.autograd.gradcheck(lambda a, b: fdp.gather([a, b], "cpu"), parts)
    scalars = (
        torch.randn((), dtype=torch.float64, requires_grad=True),
        torch.randn((), dtype=torch.float64, requires_grad=True),
    )
    stacked = fdp.gather(list(scalars), "cpu")
    assert stacked.shape == (2,)
    assert torch.autograd.gradgradcheck(lambda a, b: fdp.gather([a, b], "cpu"), scalars)


def test_gather_different_len_dicts() -> None:  # test_gather_different_len_dicts
    with pytest.raises(ValueError, match="different structure"):
        fdp.gather([{"a": torch.randn(1, 2)}, {"b": torch.randn(1, 2), "a": torch.randn(1, 2)}], "cpu")


def test_no_reference_cycles() -> None:  # test_data_parallel_model_no_refcycles
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, x):
            return self.linear(x)

    model = fdp.DataParallel(Model(), device_ids=cpus(2))
    data = torch.randn(2, 1)
    model(data)
    for _ in range(10):  # earlier tests' garbage: after torch.compile, each pass frees more
        if gc.collect() == 0:
            break
    model(data)
    assert gc.collect() == 0


def test_errors_name_the_inputs() -> None:
    model = fdp.DataParallel(nn.Bilinear(2, 2, 1), device_ids=cpus(2))
    with pytest.raises(
        ValueError,
        match=r"(?s)fdp.DataParallel got inconsistent sizes .* axis 0 of inputs\[1\] of type float32\[3,2\]",
    ):
        model(torch.zeros(4, 2), torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"axis 0 of kwargs\['input2'\] of type float32\[3,2\]"):
        model(torch.zeros(4, 2), input2=torch.zeros(3, 2))


def test_errors_name_the_outputs_as_the_module_returned_them() -> None:
    class Signed(nn.Module):
        def forward(self, x):
            return {"x": x, "sign": "+" if x.sum() > 0 else "-"}

    with pytest.raises(ValueError, match=r"different non-tensor values at output\['sign'\]: replica 0"):
        fdp.DataParallel(Signed(), device_ids=cpus(2))(torch.tensor([1.0, -1.0]))


def test_a_buffer_changed_in_place_in_evaluation_mode_is_named_as_the_users() -> None:
    class Observer(nn.Module):  # a quantization observer, calibrated under model.eval()
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("high", torch.zeros(()))
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            self.high.copy_(torch.maximum(self.high, x.max().detach()))
            return self.lin(x)

    model = fdp.DataParallel(Observer().eval(), device_ids=cpus(2))
    with pytest.raises(RuntimeError, match=r"modified buffers\['high'\] in place.*training mode only"):
        model(torch.randn(4, 4))


@pytest.mark.parametrize("rows", [1, 4], ids=["one-replica", "two-replicas"])
def test_a_parameter_changed_in_place_by_forward_is_refused_where_replicas_share_it(rows: int) -> None:
    """nn.Embedding(max_norm=...) renormalizes the rows it looks up, in place: CPU replicas,
    which share the weight, raced on it (a row scaled twice, rarely and silently). A lone
    replica (one row) changes it as the module on one device does."""
    emb = nn.Embedding(4, 3, max_norm=1.0)
    with torch.no_grad():
        emb.weight.mul_(10)
    expected = copy.deepcopy(emb)
    x = torch.arange(rows)
    model = fdp.DataParallel(emb, device_ids=cpus(2))
    if rows > 1:
        with pytest.raises(
            RuntimeError, match=r"modified params\['weight'\] in place.*with max_norm\) on one device\."
        ):
            model(x)
        return
    torch.testing.assert_close(model(x), expected(x))
    torch.testing.assert_close(emb.weight, expected.weight)


def test_a_lazy_module_is_refused_until_one_forward_set_it_up() -> None:
    """nn.LazyLinear sets its weight up in its first forward: replicas sharing it each did,
    at once (one's random weight over the other's, or torch's AttributeError from the second).
    Refused before any runs, saying what to do; once one forward on one device has set it up,
    it runs as the module does."""
    torch.manual_seed(0)
    lazy = nn.Sequential(nn.LazyLinear(3))
    model = fdp.DataParallel(lazy, device_ids=cpus(2))
    with pytest.raises(RuntimeError, match=r"module\.0 \(LazyLinear\) is a lazy module.*module\(x\[:1\]\)"):
        model(torch.randn(4, 5))
    assert lazy[0].has_uninitialized_params()  # (nothing ran)
    lazy = nn.Sequential(nn.LazyLinear(3))
    x = torch.randn(4, 5)
    lazy(x[:1])
    torch.testing.assert_close(fdp.DataParallel(lazy, device_ids=cpus(2))(x), lazy(x))


def test_a_module_made_under_inference_mode_runs_on_several_cpu_replicas() -> None:
    # Its parameters are inference tensors, which keep no version counter to read.
    with torch.inference_mode():
        model = nn.Linear(3, 2)
        expected = model(torch.ones(4, 3))
        torch.testing.assert_close(fdp.DataParallel(model, device_ids=cpus(2))(torch.ones(4, 3)), expected)


def test_an_output_without_the_dim_to_concatenate_along_is_named_with_dim_not_out_axes() -> None:
    class ColumnSums(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(0)  # a vector: it has no dim 1 to concatenate the replicas' along

    with pytest.raises(ValueError) as info:
        fdp.DataParallel(ColumnSums(), device_ids=cpus(2), dim=1)(torch.randn(4, 3))
    assert str(info.value) == (
        "fdp.DataParallel: cannot concatenate output along dim 1: the replicas returned float32[2], "
        "float32[1]; dim concatenates along an existing dim (as nn.DataParallel's gather does): a dim "
        "in [-1, 0] fits"
    )


def test_a_squeeze_that_drops_a_one_row_shards_batch_dim_is_explained() -> None:
    # A regression head's `.squeeze()`: 3 rows over 2 devices leave replica 1 one row, whose
    # output lost its batch dim. The error listed the shapes alone; it says why now.
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).squeeze()

    with pytest.raises(
        ValueError,
        match=r"^fdp.DataParallel: cannot concatenate output along dim 0: the replicas returned "
        r"float32\[2\], float32\[\]: their ranks differ, .* A squeeze\(\) that drops the batch dim of a "
        r"replica's shard of one row .* \(e.g. .squeeze\(-1\)\)$",
    ):
        fdp.DataParallel(Head(), device_ids=cpus(2))(torch.ones(3, 3))


@pytest.mark.parametrize("training", [False, True])
def test_outputs_of_different_structure_are_shown_as_the_module_returned_them(training: bool) -> None:
    # The replicas' outputs are (output, state) to the pmapped call beneath: the message showed
    # PyTreeSpec(((*,), None)), the wrapper's pair, where the module returned (*,).
    class Moody(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(2)  # (in training mode, its buffers are the state)

        def forward(self, x: torch.Tensor) -> Any:
            y = self.bn(x)
            return (y,) if x.shape[0] == 3 else [y]

    model = fdp.DataParallel(Moody().train(training), device_ids=cpus(2))
    message = (
        r"^fdp.DataParallel: the replicas returned outputs of different structure: replica 0 "
        r"returned PyTreeSpec\(\(\*,\)\) but replica 1 returned PyTreeSpec\(\[\*\]\)\. "
    )
    with pytest.raises(ValueError, match=message):
        model(torch.randn(5, 2))  # shards of 3 and 2 rows
    copied = copy.deepcopy(model)  # (a copy of the wrapper, as saved, says so too)
    with pytest.raises(ValueError, match=message):
        copied(torch.randn(5, 2))
