"""Real layers under fdp.pmap: outputs and gradients against the same module on one device."""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from helpers import assert_trees_close, cpus
from torch import nn

import fdp


def scalar_loss(tree: Any) -> torch.Tensor:
    leaves = [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum((t.sin() * (1 + torch.arange(t.numel()).reshape(t.shape) % 3)).sum() for t in leaves)


def check_against_one_device(
    module: nn.Module,
    make_input: Callable[[], torch.Tensor],
    devices: list[str],
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    atol: float = 1e-5,
) -> None:
    module.zero_grad()
    params = dict(module.named_parameters()) | dict(module.named_buffers())
    x = make_input()
    x_ref = x.detach().clone().requires_grad_(x.is_floating_point())
    if x.is_floating_point():
        x.requires_grad_()

    out = fdp.pmap(module, in_axes=in_axes, out_axes=out_axes, devices=devices)(params, x)
    scalar_loss(out).backward()
    grads = {k: p.grad.clone() for k, p in module.named_parameters()}
    module.zero_grad()

    expected = module(x_ref)
    scalar_loss(expected).backward()
    assert_trees_close(out, expected, atol=atol, rtol=1e-4)
    for name, p in module.named_parameters():
        # A gradient is a sum over the batch, rounded in another order on each side: by ulps of
        # its largest entries, which a small entry's rtol does not cover (a conv weight's, ~80).
        scale = max(1.0, p.grad.abs().max().item())
        torch.testing.assert_close(grads[name], p.grad, atol=atol * scale, rtol=1e-4, msg=name)
    if x.is_floating_point():
        torch.testing.assert_close(x.grad, x_ref.grad, atol=atol, rtol=1e-4)


def test_linear(devices: list[str]) -> None:
    check_against_one_device(nn.Linear(5, 3), lambda: torch.randn(30, 5), devices)


def test_conv2d(devices: list[str]) -> None:
    check_against_one_device(nn.Conv2d(3, 4, 3, padding=1), lambda: torch.randn(10, 3, 8, 8), devices)


def test_lstm_time_major_maps_axis_1(devices: list[str]) -> None:
    lstm = nn.LSTM(4, 6, num_layers=2)
    # output (T, B, H) and (h, c) of shape (layers, B, H): the batch is axis 1 everywhere.
    check_against_one_device(lstm, lambda: torch.randn(5, 11, 4), devices, in_axes=1, out_axes=1)


def test_lstm_batch_first(devices: list[str]) -> None:
    lstm = nn.LSTM(4, 6, batch_first=True)
    check_against_one_device(lstm, lambda: torch.randn(11, 5, 4), devices, out_axes=(0, 1))


class PackedEncoder(nn.Module):
    """What docs/errors.md tells users of PackedSequence to write: padded tokens and lengths in,
    packed inside forward, padded back to the input's length (so the replicas' outputs join)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4, padding_idx=0)
        self.rnn = nn.LSTM(4, 6, batch_first=True, bidirectional=True)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(tokens), lengths, True, enforce_sorted=False)
        out, (h, _) = self.rnn(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        return padded, h  # h is (directions, B, H): its batch is axis 1


def test_packed_lstm_from_padded_batch_and_lengths(devices: list[str]) -> None:
    torch.manual_seed(0)
    net = PackedEncoder()
    lengths = torch.tensor([5, 2, 7, 1, 3, 6, 4])  # the longest is shorter than the padding
    tokens = torch.randint(1, 20, (7, 8)) * (torch.arange(8) < lengths[:, None])
    out = fdp.pmap(net, out_axes=(0, 1), devices=devices)({}, tokens, lengths)
    scalar_loss(out).backward()
    grads = {k: p.grad.clone() for k, p in net.named_parameters()}
    net.zero_grad()
    expected = net(tokens, lengths)
    scalar_loss(expected).backward()
    assert_trees_close(out, expected, atol=1e-5, rtol=1e-4)
    for name, p in net.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_sequence_passes_whole_under_axis_none() -> None:
    lstm = nn.LSTM(2, 3)
    packed = nn.utils.rnn.pack_sequence([torch.randn(n, 2) for n in (3, 1, 2)], enforce_sorted=False)
    expected = lstm(packed)[1][0]
    both = fdp.pmap(lambda x, p: x + lstm(p)[1][0], in_axes=(0, None), out_axes=None, devices=cpus(2))
    torch.testing.assert_close(both(torch.zeros(2), packed), expected)
    # A lone replica's output is returned as it is: a PackedSequence, which it need not join.
    out = fdp.pmap(lambda x, p: lstm(p)[0], in_axes=(0, None), devices=cpus(1))(torch.zeros(2), packed)
    assert isinstance(out, nn.utils.rnn.PackedSequence)
    torch.testing.assert_close(out.data, lstm(packed)[0].data)


def test_transformer_encoder_layer(devices: list[str]) -> None:
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    check_against_one_device(layer, lambda: torch.randn(9, 7, 16), devices)


def test_embedding(devices: list[str]) -> None:
    check_against_one_device(nn.Embedding(20, 6), lambda: torch.randint(0, 20, (13, 4)), devices)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_in_the_2d_form_splits_by_bags(mode: str) -> None:
    # The form docs/concepts.md points to, where a 1-D input with offsets would be split into
    # no bags at all: the bags padded with padding_idx, no offsets. One device's bags from the
    # 1-D form are the oracle.
    bag = nn.EmbeddingBag(10, 3, mode=mode, padding_idx=0)
    flat, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 7, 9]), torch.tensor([0, 2, 5, 5, 7])
    padded = torch.tensor([[1, 2, 0], [4, 5, 4], [0, 0, 0], [3, 2, 0], [7, 9, 0]])
    weights = torch.rand(9) if mode == "sum" else None
    padded_weights = None
    if weights is not None:
        padded_weights = torch.zeros(5, 3)
        for row, (start, end) in enumerate(zip(offsets.tolist(), offsets.tolist()[1:] + [9])):
            padded_weights[row, : end - start] = weights[start:end]
    expected = bag(flat, offsets, per_sample_weights=weights)
    for devices in (cpus(2), cpus(3)):
        got = fdp.pmap(bag, devices=devices)({}, padded, per_sample_weights=padded_weights)
        torch.testing.assert_close(got, expected)
        got = fdp.DataParallel(bag, device_ids=devices)(padded, per_sample_weights=padded_weights)
        torch.testing.assert_close(got, expected)
        # The 1-D form run by one replica (a batch of one bag) is no split: allowed.
        one = fdp.pmap(bag, devices=devices)({}, torch.tensor([4]), torch.tensor([0]))
        torch.testing.assert_close(one, bag(torch.tensor([4]), torch.tensor([0])))


@pytest.mark.parametrize("make_layer", [nn.BatchNorm1d, nn.BatchNorm2d], ids=["1d", "2d"])
def test_batchnorm_eval(devices: list[str], make_layer: Callable[[int], nn.Module]) -> None:
    layer = make_layer(5)
    layer.running_mean.uniform_(-1, 1)
    layer.running_var.uniform_(0.5, 2)
    layer.eval()
    shape = (12, 5) if isinstance(layer, nn.BatchNorm1d) else (12, 5, 3, 3)
    check_against_one_device(layer, lambda: torch.randn(*shape), devices)


def test_batchnorm_train_mode_is_refused_not_corrupted() -> None:
    layer = nn.BatchNorm1d(5)
    params = dict(layer.named_parameters()) | dict(layer.named_buffers())
    with pytest.raises(
        RuntimeError, match=r"modified params\['(running_mean|running_var|num_batches_tracked)'\] in place"
    ):
        fdp.pmap(layer, devices=cpus(2))(params, torch.randn(8, 5))


@pytest.mark.parametrize("sync", [False, True], ids=["BatchNorm1d", "fdp.SyncBatchNorm"])
def test_pmapped_module_updating_its_buffers_is_told_what_works_instead(sync: bool) -> None:
    # A pmapped module cannot return new buffers: "return the new value instead" would be no
    # advice. The error names what works (eval mode, fdp.DataParallel, fdp.stateful_call).
    model: nn.Module = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5))
    if sync:
        model = fdp.SyncBatchNorm.convert_sync_batchnorm(model, axis_name="batch")
    pmapped = fdp.pmap(model, axis_name="batch", devices=cpus(3))
    with pytest.raises(RuntimeError, match=r"modified params\['1\.\w+'\] in place") as raised:
        pmapped({}, torch.randn(8, 3))
    message = str(raised.value)
    assert "cannot hand back" in message
    assert "evaluation mode" in message
    assert "fdp.DataParallel(model" in message
    assert "fdp.stateful_call(model" in message
    assert "Return the new value instead" not in message
    model.eval()  # what the message offers first works
    x = torch.randn(8, 3)
    torch.testing.assert_close(pmapped({}, x), model(x))


# ---------------------------------------------------------------------------------------------
# The layer zoo: each layer through the three ways in (a module pmapped; fdp.functional_call in
# a pmapped step that differentiates inside; fdp.DataParallel with backward), on 2 and 3
# replicas of a batch of 7 (shards 4+3 and 3+3+1), in training and evaluation mode, against
# the same module on one device: outputs, gradients (of the parameters and inputs) and buffers.


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class ModelOutput(collections.OrderedDict):
    """What Hugging Face models return: a dataclass that is also an OrderedDict of its fields
    that are not None."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)


@dataclasses.dataclass
class EncoderOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None
    pooler_output: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


Returned = collections.namedtuple("Returned", "logits hidden loss")


class Returns(nn.Module):
    """A linear layer whose output comes back in a container, with None fields."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin, self.kind = nn.Linear(3, 4), kind

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        if self.kind == "dict":
            return {"logits": h, "hidden": None, "aux": (h * 2, None)}
        if self.kind == "namedtuple":
            return Returned(h, None, None)
        if self.kind == "dataclass":
            return Output(h, None, (h.relu(),))
        return EncoderOutput(last_hidden_state=h, hidden_states=(h, h.tanh()))


class PoolUnpool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pool, self.unpool = nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, indices = self.pool(x)
        return self.unpool(y, indices), indices


def old_weight_norm() -> nn.Module:
    with warnings.catch_warnings():  # deprecated for the parametrization, still used
        warnings.simplefilter("ignore", FutureWarning)
        return nn.utils.weight_norm(nn.Linear(3, 4))


def padding_mask(rows: int, length: int) -> torch.Tensor:
    mask = torch.zeros(rows, length, dtype=torch.bool)
    mask[::2, length - 2 :] = True  # every other sequence ends two steps early
    return mask


def causal(n: int) -> torch.Tensor:
    return torch.triu(torch.ones(n, n, dtype=torch.bool), 1)


B = 7
r = torch.randn
P = nn.utils.parametrizations


@dataclasses.dataclass
class Case:
    make: Callable[[], nn.Module]
    inputs: Callable[[], tuple[Any, ...]]
    in_axes: Any = 0
    out_axes: Any = 0
    # fdp.DataParallel splits and joins every input and output along one dim: not a layer
    # whose inputs or outputs hold the batch on different dims (an RNN's h_0 with batch_first).
    data_parallel: bool = True
    updates_buffers: bool = False  # in training mode


ZOO: dict[str, Case] = {
    "RNN time-major, 2 layers": Case(lambda: nn.RNN(3, 4, num_layers=2), lambda: (r(5, B, 3),), 1, 1),
    "GRU batch-first bidirectional, h_0 given": Case(
        lambda: nn.GRU(3, 4, batch_first=True, bidirectional=True),
        lambda: (r(B, 5, 3), r(2, B, 4)),
        (0, 1),
        (0, 1),
        data_parallel=False,
    ),
    "GRU batch-first, no h_0": Case(
        lambda: nn.GRU(3, 4, batch_first=True), lambda: (r(B, 5, 3),), 0, (0, 1), False
    ),
    "LSTM time-major bidirectional, (h_0, c_0) given": Case(
        lambda: nn.LSTM(3, 4, bidirectional=True), lambda: (r(5, B, 3), (r(2, B, 4), r(2, B, 4))), 1, 1
    ),
    "RNNCell": Case(lambda: nn.RNNCell(3, 4), lambda: (r(B, 3), r(B, 4))),
    "GRUCell, no h": Case(lambda: nn.GRUCell(3, 4), lambda: (r(B, 3),)),
    "LSTMCell": Case(lambda: nn.LSTMCell(3, 4), lambda: (r(B, 3), (r(B, 4), r(B, 4)))),
    "MultiheadAttention batch-first, need_weights=False, key_padding_mask": Case(
        lambda: nn.MultiheadAttention(8, 2, batch_first=True),
        lambda: (r(B, 4, 8), r(B, 5, 8), r(B, 5, 8), padding_mask(B, 5), False),  # output (out, None)
    ),
    "MultiheadAttention time-major, per-head weights, masks": Case(
        lambda: nn.MultiheadAttention(8, 2),
        # The weights come back batch-first: (B, heads, L, S).
        lambda: (r(4, B, 8), r(5, B, 8), r(5, B, 8), padding_mask(B, 5), True, causal(5)[:4], False),
        (1, 1, 1, 0, None, None, None),
        (1, 0),
        data_parallel=False,
    ),
    "Transformer, masks": Case(
        lambda: nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True),
        lambda: (r(B, 5, 8), r(B, 4, 8), None, causal(4), None, padding_mask(B, 5), None, padding_mask(B, 5)),
        (0, 0, None, None, None, 0, None, 0),
        data_parallel=False,  # the (T, T) mask would be split
    ),
    "TransformerDecoderLayer, masks": Case(
        lambda: nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
        lambda: (r(B, 4, 8), r(B, 5, 8), causal(4), None, padding_mask(B, 4)),
        (0, 0, None, None, 0),
        data_parallel=False,
    ),
    "Conv1d": Case(lambda: nn.Conv1d(3, 4, 3, padding=1, padding_mode="circular"), lambda: (r(B, 3, 6),)),
    "Conv3d": Case(lambda: nn.Conv3d(2, 3, 2), lambda: (r(B, 2, 3, 3, 3),)),
    "ConvTranspose2d, output_size": Case(
        lambda: nn.ConvTranspose2d(3, 2, 3, stride=2), lambda: (r(B, 3, 3, 3), [8, 8]), (0, None)
    ),
    "GroupNorm": Case(lambda: nn.GroupNorm(2, 4), lambda: (r(B, 4, 3),)),
    "LayerNorm": Case(lambda: nn.LayerNorm(4), lambda: (r(B, 3, 4),)),
    "RMSNorm": Case(lambda: nn.RMSNorm(4), lambda: (r(B, 3, 4),)),
    # Running statistics that are means over the rows of per-row statistics: fdp.DataParallel's
    # row-weighted average of the replicas' updates is one device's, exactly.
    "InstanceNorm1d, track_running_stats": Case(
        lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
        lambda: (r(B, 3, 5) * 3 + 1,),
        updates_buffers=True,
    ),
    "InstanceNorm2d, track_running_stats": Case(
        lambda: nn.InstanceNorm2d(3, track_running_stats=True),
        lambda: (r(B, 3, 4, 4) * 3 + 1,),
        updates_buffers=True,
    ),
    "LocalResponseNorm": Case(lambda: nn.LocalResponseNorm(2), lambda: (r(B, 5, 3, 3),)),
    "Embedding, padding_idx": Case(
        lambda: nn.Embedding(10, 3, padding_idx=0), lambda: (torch.randint(0, 10, (B, 4)),)
    ),
    "Bilinear": Case(lambda: nn.Bilinear(3, 4, 2), lambda: (r(B, 3), r(B, 4))),
    "PReLU": Case(lambda: nn.PReLU(3), lambda: (r(B, 3, 4),)),
    "Upsample": Case(lambda: nn.Upsample(scale_factor=2, mode="bilinear"), lambda: (r(B, 2, 3, 3),)),
    "PixelShuffle": Case(lambda: nn.PixelShuffle(2), lambda: (r(B, 8, 2, 2),)),
    "Unfold": Case(lambda: nn.Unfold(2), lambda: (r(B, 2, 4, 4),)),
    "Fold": Case(lambda: nn.Fold((3, 3), 2), lambda: (r(B, 8, 4),)),
    "AdaptiveMaxPool2d, return_indices": Case(
        lambda: nn.AdaptiveMaxPool2d(2, return_indices=True), lambda: (r(B, 2, 5, 5),)
    ),
    "MaxPool2d, return_indices, MaxUnpool2d": Case(PoolUnpool, lambda: (r(B, 2, 4, 4),)),
    "parametrizations.weight_norm": Case(lambda: P.weight_norm(nn.Conv1d(2, 3, 2)), lambda: (r(B, 2, 4),)),
    # In training mode its power iteration updates its buffers _u and _v in forward.
    "parametrizations.spectral_norm": Case(
        lambda: P.spectral_norm(nn.Linear(3, 4)), lambda: (r(B, 3),), updates_buffers=True
    ),
    "parametrizations.orthogonal": Case(lambda: P.orthogonal(nn.Linear(4, 4)), lambda: (r(B, 4),)),
    "nn.utils.weight_norm": Case(old_weight_norm, lambda: (r(B, 3),)),
    "a dict with None": Case(lambda: Returns("dict"), lambda: (r(B, 3),)),
    "a namedtuple with None": Case(lambda: Returns("namedtuple"), lambda: (r(B, 3),)),
    "a dataclass with None": Case(lambda: Returns("dataclass"), lambda: (r(B, 3),)),
    "a ModelOutput with None": Case(lambda: Returns("ModelOutput"), lambda: (r(B, 3),)),
}


def zoo_loss(tree: Any) -> torch.Tensor:
    """A sum over rows, so that the shards' losses add up to the batch's."""
    leaves = fdp._tree.flatten(tree)[0]
    floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(((t.sin() + 0.1 * t * t).sum() for t in floats), torch.zeros((), dtype=torch.float64))


def float_inputs(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Fresh copies of ``inputs`` in float64, those of floating point requiring grad."""

    def fresh(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().double().requires_grad_() if t.is_floating_point() else t.clone()

    return optree.tree_map(fresh, inputs, none_is_leaf=True)


def tensors_requiring_grad(tree: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


def build(case: Case, train: bool) -> nn.Module:
    torch.manual_seed(0)  # the same initial values in every run
    return case.make().double().train(train)


def batch_axis(case: Case) -> int:
    return case.in_axes if isinstance(case.in_axes, int) else case.in_axes[0]


def functional_step(case: Case, model: nn.Module, way: str, devices: list[str]) -> Callable[..., Any]:
    """A pmapped step that differentiates inside each replica, by ``fdp.grad`` (a sum of the
    shards' summed losses) or ``torch.autograd.grad`` (their mean losses, weighted by rows), and
    returns the output, one device's gradients and the row-weighted mean of the new buffers."""

    def step(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *x: Any) -> Any:
        rows = optree.tree_leaves(x)[0].shape[batch_axis(case)]

        def loss_fn(p: dict[str, torch.Tensor]) -> Any:
            out, new_buffers = fdp.stateful_call(model, p, buffers, x)
            return zoo_loss(out), (out, new_buffers)

        if way == "functional_call, fdp.grad":
            grads, (out, new_buffers) = fdp.grad(loss_fn, has_aux=True)(params)
            grads = fdp.psum(grads, "batch")
        else:
            params = {k: p.requires_grad_() for k, p in params.items()}
            loss, (out, new_buffers) = loss_fn(params)
            grads = (
                dict(zip(params, torch.autograd.grad(loss / rows, list(params.values())))) if params else {}
            )
            grads = {k: g * B for k, g in fdp.pmean(grads, "batch", weight=rows).items()}  # B: back to sums
        floats = {k: v for k, v in new_buffers.items() if v.is_floating_point()}
        return out, grads, new_buffers | fdp.pmean(floats, "batch", weight=rows)

    axes = case.in_axes if isinstance(case.in_axes, tuple) else (case.in_axes,) * len(case.inputs())
    return fdp.pmap(
        step, "batch", in_axes=(None, None, *axes), out_axes=(case.out_axes, None, None), devices=devices
    )


def run_way(case: Case, way: str, model: nn.Module, x: tuple[Any, ...], devices: list[str]) -> Any:
    """(output, gradients by name, the inputs' gradients or None, buffers by name)."""
    wrt = [*model.parameters(), *tensors_requiring_grad(x)]
    if way == "pmap(module)":
        out = fdp.pmap(model, in_axes=case.in_axes, out_axes=case.out_axes, devices=devices)({}, *x)
    elif way == "DataParallel":
        out = fdp.DataParallel(model, device_ids=devices, dim=batch_axis(case))(*x)
    else:
        buffers = {k: b.clone() for k, b in model.named_buffers()}
        detached = {k: p.detach() for k, p in model.named_parameters()}
        out, grads, buffers = functional_step(case, model, way, devices)(detached, buffers, *x)
        return out, grads, None, buffers
    got = torch.autograd.grad(zoo_loss(out), wrt)
    grads = dict(zip(dict(model.named_parameters()), got))
    return out, grads, list(got[len(grads) :]), dict(model.named_buffers())


WAYS = ["pmap(module)", "functional_call, fdp.grad", "functional_call, autograd.grad", "DataParallel"]


# DataParallel's one dim cannot split or join a layer whose batch is on different dims of its
# inputs or outputs (docs/migrating/from-dataparallel.md): such pairs are not run.
@pytest.mark.parametrize(
    ("way", "name"),
    [
        (way, name)
        for name, case in ZOO.items()
        for way in WAYS
        if way != "DataParallel" or case.data_parallel
    ],
)
def test_layer_zoo_against_one_device(name: str, way: str) -> None:
    case = ZOO[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # oneDNN's notes about RNN kernels
        raw = case.inputs()
    for train in (True, False):
        reference = build(case, train)
        x = float_inputs(raw)
        expected = reference(*x)
        grads = torch.autograd.grad(zoo_loss(expected), [*reference.parameters(), *tensors_requiring_grad(x)])
        expected_grads = dict(zip(dict(reference.named_parameters()), grads))
        expected_x_grads = list(grads[len(expected_grads) :])
        expected_buffers = dict(reference.named_buffers())
        for devices in (cpus(2), cpus(3)):
            where = (
                f"{name} through {way}, {'training' if train else 'evaluation'} mode, {len(devices)} replicas"
            )
            model, x = build(case, train), float_inputs(raw)
            if way == "pmap(module)" and train and case.updates_buffers:
                # A pmapped module cannot hand back the buffers that its forward updates.
                with pytest.raises(RuntimeError, match=r"modified params\[.*\] in place.*stateful_call"):
                    run_way(case, way, model, x, devices)
                continue
            out, grads, x_grads, buffers = run_way(case, way, model, x, devices)
            close = functools.partial(assert_trees_close, atol=1e-10, rtol=1e-8, msg=where)
            close(out, expected)
            close(grads, expected_grads)
            if x_grads is not None:
                close(x_grads, expected_x_grads)
            close(buffers, expected_buffers)


@pytest.mark.parametrize(
    "make",
    [lambda: nn.Dropout(0.5), lambda: nn.AlphaDropout(0.5), lambda: nn.Dropout2d(0.5)],
    ids=["Dropout", "AlphaDropout", "Dropout2d"],
)
def test_dropout_in_rng_scope_through_the_three_ways(make: Callable[[], nn.Module]) -> None:
    # No one device's answer to compare with: each replica draws its own masks. What holds is
    # what the docs promise: a seed gives the same masks again, another seed others, replicas
    # masks of their own, and evaluation mode no dropout at all.
    layer = make()
    x = torch.ones(8, 3, 2, 2, requires_grad=True)
    params = dict(layer.named_parameters())

    def step(x: torch.Tensor) -> torch.Tensor:  # the functional way: a scope per replica
        with fdp.rng_scope(fdp.replica_seed(0, "batch")):
            return fdp.functional_call(layer, params, (x,))

    for devices in (cpus(2), cpus(3)):
        ways = {
            "pmap(module)": functools.partial(fdp.pmap(layer, devices=devices), {}, x),
            "DataParallel": functools.partial(fdp.DataParallel(layer, device_ids=devices), x),
        }
        for name, call in ways.items():
            with fdp.rng_scope(0):
                first = call()
            with fdp.rng_scope(0):
                again = call()
            with fdp.rng_scope(1):
                other = call()
            assert torch.equal(first, again), name
            assert not torch.equal(first, other), name
            size = -(-8 // len(devices))  # replica 0's rows and replica 1's, of equal inputs
            assert not torch.equal(first[:size], first[size : 2 * size]), name
            if isinstance(layer, nn.Dropout):  # the gradient is the mask's
                (grad,) = torch.autograd.grad(first.sum(), x)
                torch.testing.assert_close(grad, (first != 0).float() * 2)
        mapped = fdp.pmap(step, "batch", devices=devices)
        torch.testing.assert_close(mapped(x), mapped(x))
        layer.eval()
        torch.testing.assert_close(fdp.pmap(layer, devices=devices)({}, x), x)
        torch.testing.assert_close(fdp.DataParallel(layer, device_ids=devices)(x), x)
        torch.testing.assert_close(mapped(x), x)
        layer.train()


class PerSampleAttentionMask(nn.Module):
    """Takes the mask as (B, heads, L, S), which splits by samples, as docs/concepts.md says."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.attention(q, q, q, attn_mask=mask.flatten(0, 1), need_weights=False)[0]


def test_a_3d_attention_mask_splits_by_samples_passed_4d() -> None:
    model = PerSampleAttentionMask()
    q, mask = torch.randn(7, 4, 8), torch.rand(7, 2, 4, 4) > 0.7
    mask[..., 0] = False  # every query sees a key
    with pytest.raises(ValueError, match=r"one axis had size 14: axis 0 of args\[5\] of type bool\[14,4,4\]"):
        fdp.pmap(model.attention, in_axes=(0, 0, 0, None, None, 0), devices=cpus(2))(
            {}, q, q, q, None, False, mask.flatten(0, 1)
        )
    for devices in (cpus(2), cpus(3)):
        torch.testing.assert_close(fdp.pmap(model, devices=devices)({}, q, mask), model(q, mask))
