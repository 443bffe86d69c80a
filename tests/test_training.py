"""Training with state resident on the replicas equals one-device training on the full batch."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import cpus
from torch import nn
from torch.utils.checkpoint import checkpoint

import fdp
from fdp import _replica, optim


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))


def data(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(steps)
    ]


def mean_loss(
    model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    return F.cross_entropy(fdp.functional_call(model, params, (x,)), y)


@pytest.mark.parametrize(
    ("devices", "batch"), [(4, 64), (8, 30), (3, 20)], ids=["even", "uneven-30-over-8", "uneven-3"]
)
def test_replicated_training_matches_one_device(devices: int, batch: int) -> None:
    model = make_model()
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adam(1e-2))
    params = {k: v.detach() for k, v in model.named_parameters()}
    batches = data(50, batch)

    @fdp.pmap(axis_name="batch", devices=cpus(devices), out_axes=(fdp.PER_REPLICA, None))
    def step(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> Any:
        loss, grads = torch.func.grad_and_value(lambda p: mean_loss(model, p, x, y))(state["params"])[::-1]
        # One exchange: the gradients and the loss, weighted by the shard sizes.
        grads, loss = fdp.pmean((grads, loss), "batch", weight=x.shape[0])
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optim.apply_updates(state["params"], updates), "opt": opt_state}, loss

    state = fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, cpus(devices))
    losses = []
    for x, y in batches:
        state, loss = step(state, x, y)
        losses.append(loss)

    single = {"params": dict(params), "opt": opt.init(params)}
    expected = []
    for x, y in batches:
        loss, grads = torch.func.grad_and_value(lambda p, x=x, y=y: mean_loss(model, p, x, y))(
            single["params"]
        )[::-1]
        updates, single["opt"] = opt.update(grads, single["opt"], single["params"])
        single["params"] = optim.apply_updates(single["params"], updates)
        expected.append(loss)

    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), atol=1e-5, rtol=0)
    for r in range(devices):
        for k, v in fdp.unreplicate(state["params"], r).items():
            torch.testing.assert_close(v, single["params"][k], atol=1e-5, rtol=0)


def test_exact_gradient_under_uneven_split() -> None:
    model = make_model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    ((x, y),) = data(1, 30)  # 30 rows over 8 replicas: seven shards of 4, one of 2

    def gradients(weighted: bool) -> dict[str, torch.Tensor]:
        @fdp.pmap(axis_name="i", in_axes=(None, 0, 0), devices=cpus(8), out_axes=None)
        def grad_step(params, x, y):
            grads = torch.func.grad(lambda p: mean_loss(model, p, x, y))(params)
            return fdp.pmean(grads, "i", weight=x.shape[0] if weighted else None)

        return grad_step(params, x, y)

    full = torch.func.grad(lambda p: mean_loss(model, p, x, y))(params)
    exact, naive = gradients(weighted=True), gradients(weighted=False)
    for k in full:
        torch.testing.assert_close(exact[k], full[k], atol=1e-6, rtol=0)
    assert any(
        not torch.allclose(naive[k], full[k], atol=1e-6, rtol=0) for k in full
    )  # the short shard counts twice


def test_only_the_gradients_cross_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    exchanges: list[str] = []
    exchange = _replica.CallGroup.exchange

    def counting(self, index, what, payload, combine):
        if index == 0:
            exchanges.append(what[0])
        return exchange(self, index, what, payload, combine)

    monkeypatch.setattr(_replica.CallGroup, "exchange", counting)
    model = make_model()
    opt = optim.sgd(0.1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, cpus(2))

    @fdp.pmap(axis_name="batch", devices=cpus(2), out_axes=fdp.PER_REPLICA)
    def step(state, x, y):
        grads = fdp.pmean(torch.func.grad(lambda p: mean_loss(model, p, x, y))(state["params"]), "batch")
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optim.apply_updates(state["params"], updates), "opt": opt_state}

    for x, y in data(3, 8):
        state = step(state, x, y)
    assert exchanges == ["fdp.pmean"] * 3


def test_batchnorm_statistics_come_back_as_state_and_can_be_averaged() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5))
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    x = torch.randn(16, 4)

    @fdp.pmap(axis_name="i", in_axes=(None, None, 0), devices=cpus(4), out_axes=(0, fdp.PER_REPLICA))
    def forward(params, buffers, x):
        out, new = fdp.stateful_call(model, params, buffers, (x,))
        floats = {k: v for k, v in new.items() if v.is_floating_point()}
        return out, {**new, **fdp.pmean(floats, "i")}

    out, new_buffers = forward(params, buffers, x)
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())  # inputs untouched
    replicas = [fdp.unreplicate(new_buffers, r) for r in range(4)]
    assert all(torch.equal(r["1.running_mean"], replicas[0]["1.running_mean"]) for r in replicas)
    assert all(int(r["1.num_batches_tracked"]) == 1 for r in replicas)

    # Each shard's statistics, by hand: the average of the per-shard updates.
    shards = [model[0](x[4 * r : 4 * r + 4]).detach() for r in range(4)]
    mean_update = torch.stack([0.9 * buffers["1.running_mean"] + 0.1 * s.mean(0) for s in shards]).mean(0)
    var_update = torch.stack([0.9 * buffers["1.running_var"] + 0.1 * s.var(0) for s in shards]).mean(0)
    torch.testing.assert_close(replicas[0]["1.running_mean"], mean_update)
    torch.testing.assert_close(replicas[0]["1.running_var"], var_update)
    # With equal shards the averaged running mean is the one-device full-batch running mean.
    model.train()
    model(x)
    torch.testing.assert_close(replicas[0]["1.running_mean"], model[1].running_mean)


def dropout_training(seed: int, devices: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    opt = optim.sgd(0.05)

    @fdp.pmap(axis_name="b", devices=cpus(devices), in_axes=(0, 0, 0, None), out_axes=(fdp.PER_REPLICA, 0))
    def step(state, x, y, step_seed):
        with fdp.rng_scope(fdp.replica_seed(step_seed, "b")):

            def loss(p):
                out = fdp.functional_call(model, p, (x,))
                return ((out - y) ** 2).mean(), out

            grads, out = torch.func.grad(loss, has_aux=True)(state["params"])
        grads = fdp.pmean(grads, "b")
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optim.apply_updates(state["params"], updates), "opt": opt_state}, out

    state = fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, cpus(devices))
    x = torch.ones(8, 6)  # identical rows: only the masks make replicas differ
    for k in range(5):
        state, out = step(state, x, torch.zeros(8, 1), fdp.fold_in(seed, k))
    return torch.cat([v.flatten() for v in fdp.unreplicate(state["params"]).values()]), out


def test_dropout_is_reproducible_and_differs_between_replicas() -> None:
    first, out = dropout_training(seed=42)
    second, _ = dropout_training(seed=42)
    other, _ = dropout_training(seed=43)
    assert torch.equal(first, second)
    assert not torch.equal(first, other)
    assert not torch.equal(out[:4], out[4:])  # replica 0 and replica 1 drew different masks


# --- training programs ported from one device ----------------------------------------------------


class TinyLM(nn.Module):
    """A language model as scripts write them: an embedding tied to the output layer, a learned
    position table, a LayerNorm, a mask and labels among the inputs (labels by keyword, with
    ignore_index=-100), and a dict of outputs that holds a string and a float beside the loss."""

    def __init__(self, vocab: int = 20, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(6, d) * 0.1)
        self.ln = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, *, labels: torch.Tensor) -> dict[str, Any]:
        h = self.emb(ids) + self.pos[: ids.shape[1]]
        h = (h + self.ff(self.ln(h))) * mask.unsqueeze(-1)
        logits = self.head(h)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return {"loss_sum": loss_sum, "tokens": (labels != -100).sum(), "model": "tiny", "scale": 0.5}


def tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM()
    model.pos.requires_grad_(False)  # frozen: torch.optim skips it, its .grad stays None
    return model


def lm_batches(count: int, rows: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, 20, (rows, 6), generator=g)
        mask = (torch.rand(rows, 6, generator=g) > 0.3).float()
        labels = torch.randint(0, 20, (rows, 6), generator=g).masked_fill(mask == 0, -100)
        batches.append({"ids": ids, "mask": mask, "labels": labels})
    return batches


def lm_factor(step: int) -> float:
    return min(1.0, (step + 1) / 2) * 0.5 * (1 + math.cos(math.pi * step / 8))


def decays(name: str, p: torch.Tensor) -> bool:
    return p.dim() > 1  # no weight decay on biases and LayerNorm weights


def lm_torch_training(model: nn.Module, steps: int, micro: int, rows: int) -> list[float]:
    """The one-device script: AdamW with two param groups under a LambdaLR, micro-batches
    accumulated into .grad (each batch's token mean over `micro`), clip_grad_norm_."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if decays(n, p)], "weight_decay": 0.1},
            {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lm_factor)
    batches = lm_batches(steps * micro, rows)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for b in batches[step * micro : (step + 1) * micro]:
            out = model(b["ids"], b["mask"], labels=b["labels"])
            assert (out["model"], out["scale"]) == ("tiny", 0.5)
            loss = out["loss_sum"].sum() / out["tokens"].sum() / micro  # per replica under DataParallel
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        scheduler.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize(("devices", "rows"), [(2, 8), (3, 7)], ids=["2cpu", "3cpu-uneven"])
def test_a_language_model_script_under_data_parallel_matches_one_device(devices: int, rows: int) -> None:
    expected_model = tiny_lm()
    expected = lm_torch_training(expected_model, steps=4, micro=2, rows=rows)
    model = fdp.DataParallel(tiny_lm(), device_ids=cpus(devices))
    losses = lm_torch_training(model, steps=4, micro=2, rows=rows)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=0, rtol=1e-5)
    state, expected_state = model.state_dict(), expected_model.state_dict()
    assert list(state) == [f"module.{k}" for k in expected_state]
    for k, v in expected_state.items():
        torch.testing.assert_close(state[f"module.{k}"], v, atol=1e-6, rtol=1e-5)
    assert model.module.head.weight is model.module.emb.weight and model.module.pos.grad is None


@pytest.mark.parametrize(("devices", "rows"), [(2, 8), (3, 7)], ids=["2cpu", "3cpu-uneven"])
def test_a_language_model_script_with_resident_state_matches_one_device(devices: int, rows: int) -> None:
    """The same script as a resident step: the tied weight once in the params (as
    named_parameters() lists it), the frozen table beside them and not differentiated, param
    groups as multi_transform under a clip in a chain, the LambdaLR as a schedule, and the
    micro-batches' token means weighted by the whole batch's tokens inside the step."""
    expected_model = tiny_lm()
    expected = lm_torch_training(expected_model, steps=4, micro=2, rows=rows)

    model = tiny_lm()
    trainable = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    assert "head.weight" not in trainable and list(frozen) == ["pos"]
    labels = lambda params: {k: "decay" if decays(k, v) else "no_decay" for k, v in params.items()}  # noqa: E731
    opt = optim.chain(
        optim.clip_by_global_norm(0.5),
        optim.multi_transform(
            {
                "decay": optim.adamw(lambda k: 1e-2 * lm_factor(k), weight_decay=0.1),
                "no_decay": optim.adamw(lambda k: 1e-2 * lm_factor(k), weight_decay=0.0),
            },
            labels,
        ),
    )

    @fdp.pmap(axis_name="b", devices=cpus(devices), out_axes=(fdp.PER_REPLICA, None))
    def step(state: dict[str, Any], micro: list[dict[str, torch.Tensor]]) -> Any:
        tokens = [fdp.psum((b["labels"] != -100).sum(), "b") for b in micro]

        def loss_fn(params: dict[str, torch.Tensor]) -> torch.Tensor:
            loss = torch.zeros(())
            for b, n in zip(micro, tokens):
                out = fdp.functional_call(
                    model, {**state["frozen"], **params}, (b["ids"], b["mask"]), {"labels": b["labels"]}
                )
                loss = loss + out["loss_sum"] / n / len(micro)
            return loss

        loss, grads = fdp.value_and_grad(loss_fn)(state["params"])
        grads, loss = fdp.psum((grads, loss), "b")  # each replica's share of the whole batch's loss
        params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
        return {"params": params, "frozen": state["frozen"], "opt": opt_state}, loss

    state = fdp.device_put_replicated(
        {"params": trainable, "frozen": frozen, "opt": opt.init(trainable)}, cpus(devices)
    )
    batches = lm_batches(8, rows)
    losses = []
    for k in range(4):
        state, loss = step(state, batches[2 * k : 2 * k + 2])
        losses.append(float(loss))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=0, rtol=1e-5)
    final = fdp.unreplicate(state)
    # Back into a module, as docs/training.md copies them: by name, which fills both names of
    # the tied weight (a strict load_state_dict of the params misses head.weight).
    trained = tiny_lm()
    with torch.no_grad():
        for name, value in {**final["frozen"], **final["params"]}.items():
            trained.get_parameter(name).copy_(value)
    assert trained.head.weight is trained.emb.weight
    for k, v in expected_model.state_dict().items():
        torch.testing.assert_close(trained.state_dict()[k], v, atol=1e-6, rtol=1e-5)


def test_a_head_that_some_steps_leave_out_matches_torch_optim_with_an_optimizer_of_its_own() -> None:
    """torch.optim skips a parameter whose .grad is None (a task head no loss of the step
    reaches); fdp.grad gives it zeros, which AdamW still steps (weight decay, and the moments
    of earlier steps), one step count for all. docs/training.md's recipe: the head gets a state
    of its own, stepped on the steps that use it, as torch.optim's per-parameter state is."""

    def make() -> nn.ModuleDict:
        torch.manual_seed(0)
        return nn.ModuleDict({"body": nn.Linear(6, 16), "a": nn.Linear(16, 3), "b": nn.Linear(16, 2)})

    def loss_of(call: Any, x: torch.Tensor, y: torch.Tensor, uses_b: bool) -> torch.Tensor:
        h = torch.tanh(call("body", x))
        loss = F.cross_entropy(call("a", h), y % 3)
        return loss + F.cross_entropy(call("b", h), y % 2) if uses_b else loss

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 6, (8,), generator=g)) for _ in range(6)]
    reference = make()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for k, (x, y) in enumerate(batches):
        torch_opt.zero_grad()
        loss_of(lambda name, t: reference[name](t), x, y, k % 2 == 1).backward()
        torch_opt.step()

    model, opt = make(), optim.adamw(1e-2, weight_decay=0.1)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def call_with(params: dict[str, torch.Tensor]) -> Any:
        def call(name: str, t: torch.Tensor) -> torch.Tensor:
            own = {k.partition(".")[2]: v for k, v in params.items() if k.startswith(name + ".")}
            return fdp.functional_call(model[name], own, (t,))

        return call

    def run(separate: bool) -> dict[str, torch.Tensor]:
        head = {k: v for k, v in params.items() if separate and k.startswith("b.")}
        rest = {k: v for k, v in params.items() if k not in head}
        state = fdp.device_put_replicated(
            {"rest": rest, "head": head, "opt": opt.init(rest), "head_opt": opt.init(head)}, cpus(2)
        )

        @fdp.pmap(axis_name="i", devices=cpus(2), in_axes=(0, 0, 0, None), out_axes=fdp.PER_REPLICA)
        def step(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor, uses_b: bool) -> Any:
            loss = lambda rest, head: loss_of(call_with({**rest, **head}), x, y, uses_b)  # noqa: E731
            grads, head_grads = fdp.pmean(fdp.grad(loss, argnums=(0, 1))(state["rest"], state["head"]), "i")
            new = dict(state)
            new["rest"], new["opt"] = opt.apply_gradients(grads, state["opt"], state["rest"])
            if uses_b:  # the head's loss is part of this step's
                new["head"], new["head_opt"] = opt.apply_gradients(
                    head_grads, state["head_opt"], state["head"]
                )
            return new

        for k, (x, y) in enumerate(batches):
            state = step(state, x, y, k % 2 == 1)
        final = fdp.unreplicate(state)
        return {**final["rest"], **final["head"]}

    separate, together = run(separate=True), run(separate=False)
    for k, v in reference.named_parameters():
        torch.testing.assert_close(separate[k], v.detach(), atol=1e-6, rtol=1e-5)
    # One state for all steps the head on the steps that leave it out: it moves.
    assert not torch.allclose(together["b.weight"], reference["b"].weight.detach(), atol=1e-3)


class CheckpointedBlock(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(6, 32), nn.Linear(32, 3)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.3))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.checkpointed:
            h = checkpoint(self.block, h, use_reentrant=False, context_fn=fdp.rng_checkpoint_context)
        else:
            h = self.block(h)
        return self.last(h)


@pytest.mark.parametrize("devices", [2, 3])
def test_activation_checkpointing_inside_a_step_differentiated_by_fdp_grad(devices: int) -> None:
    """A checkpointed block with dropout, recomputed inside the replica's backward (fdp.grad
    by autograd, use_reentrant=False): the unchecked step's losses and parameters, bit for bit,
    on uneven shards."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(7, 6, generator=g), torch.randint(0, 3, (7,), generator=g)) for _ in range(4)]

    def train(checkpointed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model, opt = CheckpointedBlock(checkpointed), optim.adam(1e-2)
        params = {k: v.detach() for k, v in model.named_parameters()}

        @fdp.pmap(
            axis_name="i", devices=cpus(devices), in_axes=(0, 0, 0, None), out_axes=(fdp.PER_REPLICA, None)
        )
        def step(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor, seed: int) -> Any:
            with fdp.rng_scope(fdp.replica_seed(seed, "i")):
                loss, grads = fdp.value_and_grad(
                    lambda p: F.cross_entropy(fdp.functional_call(model, p, (x,)), y)
                )(state["params"])
            grads, loss = fdp.pmean((grads, loss), "i", weight=x.shape[0])
            new_params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
            return {"params": new_params, "opt": opt_state}, loss

        state = fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, cpus(devices))
        losses = []
        for k, (x, y) in enumerate(batches):
            state, loss = step(state, x, y, fdp.fold_in(7, k))
            losses.append(loss)
        return torch.stack(losses), fdp.unreplicate(state)["params"]

    (losses, params), (expected_losses, expected) = train(True), train(False)
    assert torch.equal(losses, expected_losses)
    assert all(torch.equal(params[k], expected[k]) for k in expected)


class ClampGradient(torch.autograd.Function):
    """The identity, whose backward clamps the gradient it is handed (not linear in it)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.clamp(-0.01, 0.01)


class ClampedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(ClampGradient.apply(torch.tanh(self.first(x))))


def test_a_backward_that_clamps_its_gradient_needs_each_replicas_share_of_the_batchs_loss() -> None:
    """docs/collectives.md: a shard's mean loss hands the clamp B/b times one device's gradient,
    so the average of the shards' gradients is another step; each replica's share of the batch's
    loss (a sum over its rows divided by the batch's rows), psummed, is one device's."""
    torch.manual_seed(0)
    model = ClampedNet()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
        return F.cross_entropy(fdp.functional_call(model, p, (x,)), y, reduction=reduction)

    expected = fdp.grad(loss)(params, x, y, "mean")

    @fdp.pmap(axis_name="i", devices=cpus(3), in_axes=(None, 0, 0, None), out_axes=None)
    def gradients(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, share: bool) -> Any:
        if share:
            rows = fdp.psum(x.shape[0], "i")
            return fdp.psum(fdp.grad(lambda p: loss(p, x, y, "sum") / rows)(p), "i")
        return fdp.pmean(fdp.grad(loss)(p, x, y, "mean"), "i", weight=x.shape[0])

    shared, averaged = gradients(params, x, y, True), gradients(params, x, y, False)
    for k in expected:
        torch.testing.assert_close(shared[k], expected[k], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(averaged["first.weight"], expected["first.weight"], atol=1e-4)


@pytest.mark.parametrize("devices", [2, 3])
def test_float16_loss_scaling_of_fdp_optim_skips_and_scales_as_grad_scaler_on_one_device(
    devices: int,
) -> None:
    """docs/training.md's float16 step for fdp.optim (each replica's share of the batch's loss,
    scaled; the psummed gradients unscaled; a non-finite step skipped, the scale halved) against
    torch.amp.GradScaler over torch.optim.Adam on the whole batch: the same skips and scales
    step after step, through a scale that overflows float16 and an inf in the last replica's
    shard alone, and the same parameters to float16's precision. (A large first scale backed
    off by 2**-8, and growth every 3 steps, keep the other steps off float16's edge, where a
    shard's partial sums may stay finite when the batch's overflow.)"""
    init_scale, backoff, growth_interval = 2.0**24, 2.0**-8, 3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
    reference = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
    reference.load_state_dict(model.state_dict())
    batches = data(8, 7)
    batches[5][0][-1, 0] = float("inf")  # a row of the last replica's shard

    torch_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=init_scale, backoff_factor=backoff, growth_interval=growth_interval
    )
    expected = []
    for x, y in batches:
        before = [p.detach().clone() for p in reference.parameters()]
        torch_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = reference(x)
        scaler.scale(F.cross_entropy(logits.float(), y)).backward()
        scaler.step(torch_opt)
        scaler.update()
        skipped = all(torch.equal(b, p) for b, p in zip(before, reference.parameters()))
        expected.append((skipped, scaler.get_scale()))
    assert [skipped for skipped, _ in expected] == [True, False, False, False, False, True, False, False]

    opt = optim.adam(1e-2)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = fdp.device_put_replicated(
        {
            "params": params,
            "opt": opt.init(params),
            "scale": torch.tensor(init_scale),
            "good_steps": torch.tensor(0),
        },
        cpus(devices),
    )

    @fdp.pmap(axis_name="batch", devices=cpus(devices), split="balanced", out_axes=(fdp.PER_REPLICA, None))
    def train_step(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> Any:
        scale, rows = state["scale"], fdp.psum(x.shape[0], "batch")

        def scaled_loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.float16):
                logits = fdp.functional_call(model, params, (x,))
            return F.cross_entropy(logits.float(), y, reduction="sum") / rows * scale

        grads = fdp.psum(fdp.grad(scaled_loss)(state["params"]), "batch")
        grads = {k: g / scale for k, g in grads.items()}
        if not all(bool(g.isfinite().all()) for g in grads.values()):
            return {
                **state,
                "scale": scale * backoff,
                "good_steps": torch.zeros_like(state["good_steps"]),
            }, False
        params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
        good_steps = state["good_steps"] + 1
        if good_steps == growth_interval:
            scale, good_steps = scale * 2, torch.zeros_like(good_steps)
        return {"params": params, "opt": opt_state, "scale": scale, "good_steps": good_steps}, True

    for step, ((x, y), (skipped, scale)) in enumerate(zip(batches, expected)):
        state, stepped = train_step(state, x, y)
        assert stepped is not skipped, step
        for r in range(devices):
            assert float(fdp.unreplicate(state, r)["scale"]) == scale, (step, r)
    for r in range(devices):
        final = fdp.unreplicate(state, r)["params"]
        for k, v in reference.named_parameters():
            torch.testing.assert_close(final[k], v.detach(), atol=2e-4, rtol=1e-3, msg=k)
