"""Real layers under fdp.pmap: outputs and gradients against the same module on one device."""

from __future__ import annotations

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
