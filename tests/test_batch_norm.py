"""fdp.SyncBatchNorm: against nn.BatchNorm on the whole batch on one device (outputs, gradients,
running statistics), through fdp.pmap with stateful_call and through fdp.DataParallel."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
from helpers import cpus
from torch import nn

import fdp


def make_model(norm: type[nn.Module] = nn.BatchNorm1d, **options: Any) -> nn.Module:
    torch.manual_seed(0)
    conv = {nn.BatchNorm1d: nn.Conv1d, nn.BatchNorm2d: nn.Conv2d, nn.BatchNorm3d: nn.Conv3d}[norm]
    model = nn.Sequential(conv(3, 4, 1), norm(4, **options), nn.ReLU(), conv(4, 2, 1))
    with torch.no_grad():  # weights and running statistics away from their defaults
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                if m.weight is not None:
                    m.weight.uniform_(0.5, 1.5)
                if m.bias is not None:
                    m.bias.uniform_(-0.5, 0.5)
                if m.running_mean is not None:
                    m.running_mean.uniform_(-1, 1)
                    m.running_var.uniform_(0.5, 2)
    return model


def input_for(norm: type[nn.Module], rows: int) -> torch.Tensor:
    spatial = {nn.BatchNorm1d: (5,), nn.BatchNorm2d: (3, 2), nn.BatchNorm3d: (2, 2, 2)}[norm]
    torch.manual_seed(1)
    # A mean far from 0 next to the spread: a naive E[x^2] - E[x]^2 would lose the variance.
    return torch.randn(rows, 3, *spatial, dtype=torch.float64) * 0.1 + 30.0


def one_device_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
    """The oracle: the module on the whole batch, its input and parameter gradients, its buffers."""
    model = copy.deepcopy(model)
    x = x.clone().requires_grad_()
    y = model(x)
    weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    grads = torch.autograd.grad((y * weights).sum(), [x, *model.parameters()])
    names = ["x", *(n for n, _ in model.named_parameters())]
    return y.detach(), dict(zip(names, grads)), dict(model.named_buffers())


def pmapped_step(
    model: nn.Module, x: torch.Tensor, devices: list[str], split: str = "chunk"
) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
    synced = fdp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), axis_name="batch")
    params = {k: v.detach().requires_grad_() for k, v in synced.named_parameters()}
    buffers = {k: v.clone() for k, v in synced.named_buffers()}

    @fdp.pmap(
        in_axes=(None, None, 0),
        out_axes=(0, fdp.PER_REPLICA),
        axis_name="batch",
        devices=devices,
        split=split,
    )
    def step(params: Any, buffers: Any, x: torch.Tensor) -> Any:
        return fdp.stateful_call(synced, params, buffers, (x,))

    x = x.clone().requires_grad_()
    y, new_buffers = step(params, buffers, x)
    weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    grads = torch.autograd.grad((y * weights).sum(), [x, *params.values()])
    return y.detach(), dict(zip(["x", *params], grads)), new_buffers


def assert_buffers_match(per_replica: dict[str, Any], expected: dict[str, torch.Tensor]) -> None:
    assert set(per_replica) == set(expected)
    for name, value in per_replica.items():
        for replica in value.values:  # every replica holds the whole batch's statistics
            torch.testing.assert_close(replica, expected[name], msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(
    "norm, rows, devices, split",
    [
        (nn.BatchNorm1d, 30, 2, "chunk"),
        (nn.BatchNorm1d, 30, 8, "chunk"),  # shards of 4,4,4,4,4,4,4,2: weighted by their sizes
        (nn.BatchNorm2d, 10, 3, "balanced"),  # 4,3,3
        (nn.BatchNorm3d, 9, 8, "chunk"),  # 2,2,2,2,1: a one-row shard
        (nn.BatchNorm1d, 7, 1, "chunk"),  # a lone replica
    ],
)
def test_matches_batch_norm_on_the_whole_batch(
    norm: type[nn.Module], rows: int, devices: int, split: str
) -> None:
    model = make_model(norm).double()
    x = input_for(norm, rows)
    want_y, want_grads, want_buffers = one_device_step(model, x)
    y, grads, buffers = pmapped_step(model, x, cpus(devices), split)
    torch.testing.assert_close(y, want_y)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], msg=lambda m, name=name: f"{name}: {m}")
    assert_buffers_match(buffers, want_buffers)


@pytest.mark.parametrize(
    "options",
    [
        {"affine": False},
        pytest.param(
            {"bias": False},
            marks=pytest.mark.skipif(
                "bias" not in inspect.signature(nn.BatchNorm1d).parameters,
                reason="the one-device oracle, torch's batch norm without a bias, needs torch 2.12+",
            ),
        ),
        {"momentum": None},  # a cumulative average, counted by num_batches_tracked
        {"track_running_stats": False},
    ],
)
def test_options_match_batch_norm(options: dict[str, Any]) -> None:
    model = make_model(nn.BatchNorm1d, **options).double()
    x = input_for(nn.BatchNorm1d, 13)
    want_y, want_grads, want_buffers = one_device_step(model, x)
    y, grads, buffers = pmapped_step(model, x, cpus(3))
    torch.testing.assert_close(y, want_y)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name])
    assert_buffers_match(buffers, want_buffers)


def test_gradcheck_through_the_exchange() -> None:
    # Second derivatives too: the gather's backward is itself differentiable.
    layer = fdp.SyncBatchNorm(2, axis_name="i").double()
    params = {k: v.detach() for k, v in layer.named_parameters()}
    buffers = dict(layer.named_buffers())

    @fdp.pmap(in_axes=(0, None, None), axis_name="i", devices=cpus(3))
    def f(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        y, _ = fdp.stateful_call(layer, {"weight": weight, "bias": bias}, buffers, (x,))
        return y

    torch.manual_seed(0)
    x = torch.randn(7, 2, 3, dtype=torch.float64, requires_grad=True)
    w = (params["weight"] + torch.rand(2, dtype=torch.float64)).requires_grad_()
    b = torch.rand(2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (x, w, b))
    assert torch.autograd.gradgradcheck(f, (x, w, b))


def test_half_precision_inputs() -> None:
    # bf16 in, bf16 out, as nn.BatchNorm does it (statistics computed in float32 by both).
    model = make_model(nn.BatchNorm1d).bfloat16()
    x = (torch.randn(12, 3, 5) + 2).bfloat16()
    want_y, want_grads, want_buffers = one_device_step(model, x)
    y, grads, buffers = pmapped_step(model, x, cpus(2))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, want_y, atol=0.05, rtol=0.02)
    torch.testing.assert_close(grads["1.weight"], want_grads["1.weight"], atol=0.1, rtol=0.02)
    for name in ("1.running_mean", "1.running_var"):
        assert buffers[name][0].dtype == torch.bfloat16
        torch.testing.assert_close(buffers[name][0], want_buffers[name], atol=0.02, rtol=0.02)


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "on_workers"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_as_batch_norm_on_one_device(
    dtype: torch.dtype, inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # float32 modules under autocast: the convolutions run in `dtype`, the layer gets their
    # output and normalizes it with the whole batch's statistics (kept in float32), as
    # nn.BatchNorm on one device does under the same autocast.
    monkeypatch.setattr(fdp._pool, "INLINE_REPLICAS", inline)
    model = make_model(nn.BatchNorm1d)
    synced = fdp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), axis_name="batch")
    x = input_for(nn.BatchNorm1d, 10).float() - 30.0
    normalized: list[torch.dtype] = []  # each layer's output dtype (the replicas' first)
    for layer in (synced[1], model[1]):
        layer.register_forward_hook(lambda module, args, out: normalized.append(out.dtype))
    with torch.autocast("cpu", dtype=dtype):
        y = fdp.DataParallel(synced, device_ids=cpus(3), axis_name="batch")(x)
        want = model(x)
    assert y.dtype == want.dtype == dtype
    assert set(normalized) == {dtype}, normalized  # in the input's dtype, as nn.BatchNorm's
    ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
    torch.testing.assert_close(y, want, atol=ulp, rtol=ulp)
    for name in ("running_mean", "running_var"):
        assert synced[1].get_buffer(name).dtype == torch.float32
        torch.testing.assert_close(
            synced[1].get_buffer(name), model[1].get_buffer(name), atol=1e-6, rtol=1e-5
        )
    assert synced[1].num_batches_tracked == model[1].num_batches_tracked == 1
    weights = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
    (y.float() * weights).sum().backward()
    (want.float() * weights).sum().backward()
    for (name, got), expected in zip(synced.named_parameters(), model.parameters()):
        assert got.grad is not None and expected.grad is not None
        if name == "0.bias":
            continue  # its true gradient is 0 (the layer subtracts it out): both hold rounding noise
        scale = expected.grad.abs().max().item()
        torch.testing.assert_close(got.grad, expected.grad, atol=4 * ulp * scale, rtol=0, msg=name)


def test_evaluation_mode_uses_the_running_statistics_and_exchanges_nothing() -> None:
    model = make_model(nn.BatchNorm1d).double().eval()
    x = input_for(nn.BatchNorm1d, 10)
    synced = fdp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), axis_name="batch")
    # An axis name the layer does not know: in eval mode it must not reach for it.
    f = fdp.pmap(lambda x: synced(x), axis_name="other", devices=cpus(2))
    torch.testing.assert_close(f(x), model(x))


def test_outside_pmap_it_is_an_ordinary_batch_norm() -> None:
    model = make_model(nn.BatchNorm2d).double()
    x = input_for(nn.BatchNorm2d, 6)
    synced = fdp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), axis_name="batch")
    want = copy.deepcopy(model)
    torch.testing.assert_close(synced(x), want(x))
    torch.testing.assert_close(synced[1].running_mean, want[1].running_mean)
    torch.testing.assert_close(synced[1].running_var, want[1].running_var)


def test_another_axis_name_is_an_error_not_local_statistics() -> None:
    layer = fdp.SyncBatchNorm(3, axis_name="batch")
    f = fdp.pmap(lambda x: layer(x), axis_name="data", devices=cpus(2))
    with pytest.raises(NameError, match=r"unbound axis name: batch .*axis_name='data'"):
        f(torch.randn(4, 3))


def test_one_value_per_channel_in_all_is_refused() -> None:
    layer = fdp.SyncBatchNorm(3, axis_name="i")
    f = fdp.pmap(lambda x: layer(x), axis_name="i", devices=cpus(2))
    with pytest.raises(ValueError, match=r"more than 1 value per channel .*got 1 in all"):
        f(torch.randn(1, 3))
    # Two rows over two replicas, one each: two values per channel in all, as on one device.
    x = torch.randn(2, 3)
    torch.testing.assert_close(f(x), nn.functional.batch_norm(x, None, None, training=True))


def test_a_replica_with_no_rows_adds_nothing() -> None:
    layer = fdp.SyncBatchNorm(3, axis_name="i").double()
    # Replica 0 drops its rows: the others' rows alone make the batch (no NaN from an empty mean).
    f = fdp.pmap(lambda x: layer(x if fdp.axis_index("i") else x[:0]), axis_name="i", devices=cpus(3))
    x = torch.randn(9, 3, 2, dtype=torch.float64)
    want = nn.functional.batch_norm(x[3:], None, None, training=True)
    torch.testing.assert_close(f(x), want)


def test_bad_inputs_and_arguments() -> None:
    with pytest.raises(ValueError, match=r"axis_name must name the pmapped axis"):
        fdp.SyncBatchNorm(3, axis_name=None)
    layer = fdp.SyncBatchNorm(3, axis_name="i")
    with pytest.raises(
        ValueError, match=r"expected an input of shape \(N, C, \*\), of 2 or more dims, got 1D"
    ):
        layer(torch.randn(3))
    f = fdp.pmap(lambda x: layer(x), axis_name="i", devices=cpus(2))
    with pytest.raises(ValueError, match=r"expected 3 channels \(dim 1\) .*got shape \(2, 4\)"):
        f(torch.randn(4, 4))


def test_convert_keeps_the_same_tensors_and_state_dict() -> None:
    model = make_model(nn.BatchNorm2d).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = {k: v for k, v in [*model.named_parameters(), *model.named_buffers()]}
    converted = fdp.SyncBatchNorm.convert_sync_batchnorm(model, axis_name="batch")
    assert isinstance(converted[1], fdp.SyncBatchNorm) and converted[1].axis_name == "batch"
    assert isinstance(converted[1], nn.modules.batchnorm._BatchNorm)  # weight-decay filters see it
    assert not converted[1].training
    assert {
        k: v for k, v in [*converted.named_parameters(), *converted.named_buffers()]
    }.keys() == tensors.keys()
    for k, v in [*converted.named_parameters(), *converted.named_buffers()]:
        assert v is tensors[k], k
    assert all(torch.equal(v, before[k]) for k, v in converted.state_dict().items())
    # A quantization config rides along, as torch's convert_sync_batchnorm keeps it.
    norm = nn.BatchNorm1d(2)
    norm.qconfig = "a qconfig"  # type: ignore[assignment]
    assert fdp.SyncBatchNorm.convert_sync_batchnorm(norm, axis_name="i").qconfig == "a qconfig"
    # A batch norm at the root comes back as a new layer; torch's SyncBatchNorm converts too.
    assert isinstance(
        fdp.SyncBatchNorm.convert_sync_batchnorm(nn.SyncBatchNorm(2), axis_name="i"), fdp.SyncBatchNorm
    )


def test_convert_refuses_an_uninitialized_lazy_batch_norm() -> None:
    with pytest.raises(ValueError, match=r"LazyBatchNorm1d has not inferred its number of features"):
        fdp.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm1d()), axis_name="i")


def test_through_data_parallel_with_the_axis_name() -> None:
    model = make_model(nn.BatchNorm1d).double()
    x = input_for(nn.BatchNorm1d, 30)
    want_y, want_grads, want_buffers = one_device_step(model, x)
    synced = fdp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), axis_name="batch")
    wrapped = fdp.DataParallel(synced, device_ids=cpus(8), axis_name="batch")
    xg = x.clone().requires_grad_()
    y = wrapped(xg)
    weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    grads = torch.autograd.grad((y * weights).sum(), [xg, *synced.parameters()])
    torch.testing.assert_close(y, want_y)
    for name, grad in zip(["x", *(n for n, _ in synced.named_parameters())], grads):
        torch.testing.assert_close(grad, want_grads[name])
    for name, value in synced.named_buffers():
        torch.testing.assert_close(value, want_buffers[name])


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_an_empty_batch_through_data_parallel_with_the_axis_name(n: int, momentum: float | None) -> None:
    # fdp.DataParallel runs an empty batch in one replica of its axis: the layer sees no row
    # on any replica, and does as nn.BatchNorm on one device (an empty output, the batch
    # counted, the running statistics unchanged), not "expected more than 1 value".
    model = make_model(nn.BatchNorm1d, momentum=momentum).double()
    x = input_for(nn.BatchNorm1d, 0)
    want_y, want_grads, want_buffers = one_device_step(model, x)
    synced = fdp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), axis_name="batch")
    xg = x.clone().requires_grad_()
    y = fdp.DataParallel(synced, device_ids=cpus(n), axis_name="batch")(xg)
    grads = torch.autograd.grad(y.sum(), [xg, *synced.parameters()])
    torch.testing.assert_close(y, want_y)
    for name, grad in zip(["x", *(n for n, _ in synced.named_parameters())], grads):
        torch.testing.assert_close(grad, want_grads[name])
    for name, value in synced.named_buffers():
        torch.testing.assert_close(value, want_buffers[name])


@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_layer_shared_by_the_replicas_updates_its_statistics_once(momentum: float | None) -> None:
    # The layer in the mapped function's closure: every replica updates the same buffers in
    # place, with the same whole-batch statistics. Each must apply the update once, to the
    # value from before the call, not on top of another replica's (4 updates, 4 batches).
    layer = fdp.SyncBatchNorm(3, momentum=momentum, axis_name="i").double()
    want = nn.BatchNorm1d(3, momentum=momentum).double()
    f = fdp.pmap(lambda x: layer(x), axis_name="i", devices=cpus(4))
    torch.manual_seed(0)
    for _ in range(3):
        x = torch.randn(8, 3, 2, dtype=torch.float64) * 2 + 5
        torch.testing.assert_close(f(x), want(x))
    torch.testing.assert_close(layer.running_mean, want.running_mean)
    torch.testing.assert_close(layer.running_var, want.running_var)
    assert layer.num_batches_tracked.item() == 3


def test_an_unbound_axis_names_the_layer_and_the_axis_name_to_give() -> None:
    # Through fdp.DataParallel without axis_name: the user never called fdp.all_gather, so the
    # error names the layer and where its axis_name goes.
    model = fdp.SyncBatchNorm.convert_sync_batchnorm(
        nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), "batch"
    )
    wrapped = fdp.DataParallel(model, device_ids=cpus(2))
    with pytest.raises(
        NameError,
        match=r"unbound axis name: batch \(fdp\.SyncBatchNorm: the function being mapped was given no "
        r"axis_name\).*fdp\.DataParallel\(\.\.\., axis_name='batch'\)",
    ):
        wrapped(torch.randn(8, 3))


@pytest.mark.parametrize(
    ("num_features", "got"), [("3", "str: '3'"), (3.0, "float: 3.0"), (True, "bool: True")]
)
def test_num_features_that_is_no_int_is_named(num_features: object, got: str) -> None:
    # torch said "empty(): argument 'size' (position 1) must be tuple of ints, not str", naming
    # neither the layer nor the argument (and took True for one channel).
    with pytest.raises(
        TypeError,
        match=r"^fdp\.SyncBatchNorm: num_features must be an int \(C, the channels of an input of shape "
        rf"\(N, C, \*\)\), got {got}$",
    ):
        fdp.SyncBatchNorm(num_features, axis_name="batch")  # type: ignore[arg-type]


def test_an_unhashable_axis_name_is_refused() -> None:
    with pytest.raises(
        TypeError, match=r"fdp\.SyncBatchNorm: axis_name must be hashable, as fdp\.pmap's is, got \['batch'\]"
    ):
        fdp.SyncBatchNorm(3, axis_name=["batch"])


def test_activation_checkpointing_around_the_pmapped_call() -> None:
    # The documented way to checkpoint SyncBatchNorm layers: the recomputation reruns the
    # pmapped call, so the layers exchange their statistics again (inside the mapped function,
    # the recomputation would run outside the replicas).
    model = make_model(nn.BatchNorm1d).double()
    x = input_for(nn.BatchNorm1d, 11)
    want_y, want_grads, _ = one_device_step(model, x)
    synced = fdp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), axis_name="batch")
    params = {k: v.detach().requires_grad_() for k, v in synced.named_parameters()}
    buffers = {k: v.clone() for k, v in synced.named_buffers()}
    step = fdp.pmap(
        lambda params, buffers, x: fdp.stateful_call(synced, params, buffers, (x,))[0],
        in_axes=(None, None, 0),
        axis_name="batch",
        devices=cpus(3),
    )
    xg = x.clone().requires_grad_()
    y = torch.utils.checkpoint.checkpoint(step, params, buffers, xg, use_reentrant=False)
    weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    grads = torch.autograd.grad((y * weights).sum(), [xg, *params.values()])
    torch.testing.assert_close(y, want_y)
    for name, grad in zip(["x", *params], grads):
        torch.testing.assert_close(grad, want_grads[name], msg=lambda m, name=name: f"{name}: {m}")


class _Checkpointed(nn.Module):
    """``body`` under activation checkpointing, as a block of a model that saves memory."""

    def __init__(self, body: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.body = body
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("where", ["no replica", "a lone pmap replica", "DataParallel on one device"])
def test_activation_checkpointing_alone_on_one_device_is_a_plain_batch_norms(
    reentrant: bool, where: str
) -> None:
    # Alone on one device the layer's batch is the whole batch, and its recomputation in
    # backward can be done as the forward was: a converted model with checkpointed blocks
    # trains there as the unconverted one does (it raised, as inside several replicas).
    model = make_model(nn.BatchNorm2d).double()
    x = input_for(nn.BatchNorm2d, 6)
    synced = fdp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), axis_name="batch")
    results = []
    for module in (_Checkpointed(model, reentrant), _Checkpointed(synced, reentrant)):
        run: Any = module
        if module.body is synced and where == "a lone pmap replica":
            run = fdp.pmap(lambda x, module=module: module(x), axis_name="batch", devices=cpus(1))
        elif module.body is synced and where == "DataParallel on one device":
            run = fdp.DataParallel(module, device_ids=cpus(1), axis_name="batch")
        xg = x.clone().requires_grad_()
        y = run(xg)
        # backward(), not autograd.grad, which reentrant checkpointing refuses.
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
        grads = {"x": xg.grad, **{n: p.grad for n, p in module.body.named_parameters()}}
        # The buffers are updated in the forward and again in the recomputation, as torch's own
        # batch norm's are.
        results.append((y.detach(), grads, dict(module.body.named_buffers())))
    (want_y, want_grads, want_buffers), (y, grads, buffers) = results
    torch.testing.assert_close(y, want_y)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], msg=lambda m, name=name: f"{name}: {m}")
    for name in want_buffers:
        torch.testing.assert_close(buffers[name], want_buffers[name], msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("grad", [torch.func.grad, fdp.grad], ids=["torch.func.grad", "fdp.grad"])
def test_differentiated_inside_the_replicas_on_uneven_shards_with_the_documented_recipe(grad: Any) -> None:
    # docs/training.md: under torch.func.grad or fdp.grad the layer's exchange couples the
    # replicas' losses, so each replica differentiates its share of the whole batch's mean loss
    # and the gradients are summed (a pmean weighted by rows is right for equal shards only).
    model = make_model(nn.BatchNorm2d).double()
    x = input_for(nn.BatchNorm2d, 10)
    target = torch.linspace(-1, 1, 10 * 2 * 3 * 2, dtype=torch.float64).reshape(10, 2, 3, 2)
    want_model = copy.deepcopy(model)
    (want_model(x) - target).square().mean((1, 2, 3)).mean().backward()
    synced = fdp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), axis_name="batch")
    params = {k: v.detach() for k, v in synced.named_parameters()}
    buffers = {k: v.clone() for k, v in synced.named_buffers()}

    @fdp.pmap(in_axes=(None, None, 0, 0), out_axes=None, axis_name="batch", devices=cpus(3), split="balanced")
    def gradient(params: Any, buffers: Any, x: torch.Tensor, target: torch.Tensor) -> Any:
        rows = fdp.psum(x.shape[0], "batch")

        def loss_fn(params: Any) -> torch.Tensor:
            y, _ = fdp.stateful_call(synced, params, buffers, (x,))
            return (y - target).square().mean((1, 2, 3)).sum() / rows

        return fdp.psum(grad(loss_fn)(params), "batch")

    grads = gradient(params, buffers, x, target)  # shards of 4, 3, 3
    for name, p in want_model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_evaluation_mode_without_running_statistics_uses_the_whole_batch() -> None:
    # nn.BatchNorm(track_running_stats=False) normalizes with the batch's statistics in eval
    # mode too: here the whole batch's, exchanged, as on one device.
    model = make_model(nn.BatchNorm1d, track_running_stats=False).double().eval()
    x = input_for(nn.BatchNorm1d, 10)
    synced = fdp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), axis_name="batch")
    f = fdp.pmap(lambda x: synced(x), axis_name="batch", devices=cpus(3))
    torch.testing.assert_close(f(x), model(x))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_of_the_layer_inside_the_mapped_function_is_refused(reentrant: bool) -> None:
    # The recomputation runs in the backward pass, after the replicas returned: as a plain batch
    # norm on the shard it gave wrong input gradients, silently with reentrant checkpointing.
    layer = fdp.SyncBatchNorm(3, axis_name="i").double()
    inner = lambda x: torch.utils.checkpoint.checkpoint(layer, x.sin(), use_reentrant=reentrant)  # noqa: E731
    f = fdp.pmap(inner, axis_name="i", devices=cpus(2))
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    y = f(x)
    with pytest.raises(
        RuntimeError, match=r"fdp.SyncBatchNorm ran with batch statistics during a backward pass"
    ):
        (y * torch.arange(18.0, dtype=torch.float64).reshape(6, 3)).sum().backward()
    # In evaluation mode the layer uses its running statistics: checkpointing it is fine.
    layer.eval()
    f(x).sum().backward()
    assert x.grad is not None


def test_flax_batch_norm_maps_as_docs_migrating_from_jax_says() -> None:
    # docs/migrating/from-jax.md: flax.linen.BatchNorm(axis_name=..., momentum=m) is
    # fdp.SyncBatchNorm(..., momentum=1 - m), whose running variance is unbiased where flax's
    # is not. flax's update, written out: ra = m * ra + (1 - m) * batch statistic, with the
    # biased variance of the whole batch (the mean of squares less the squared mean).
    m, rows = 0.99, 12
    layer = fdp.SyncBatchNorm(3, axis_name="batch", momentum=1 - m)
    buffers = {k: v.clone() for k, v in layer.named_buffers()}
    x = torch.randn(rows, 3, generator=torch.Generator().manual_seed(0)) * 2 + 1

    @fdp.pmap(in_axes=(None, 0), out_axes=(0, None), axis_name="batch", devices=cpus(3))
    def forward(buffers: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        return fdp.stateful_call(layer, dict(layer.named_parameters()), buffers, (x,))

    out, new = forward(buffers, x)
    mean = x.mean(0)
    var = (x * x).mean(0) - mean**2  # flax's: biased
    torch.testing.assert_close(out, (x - mean) / torch.sqrt(var + layer.eps), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new["running_mean"], m * buffers["running_mean"] + (1 - m) * mean)
    torch.testing.assert_close(
        new["running_var"], m * buffers["running_var"] + (1 - m) * var * rows / (rows - 1)
    )
