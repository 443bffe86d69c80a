"""fdp.optim against torch.optim: 100 steps of the same training, parameters within 1e-6."""

from __future__ import annotations

import dataclasses
import io
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from torch import nn

from fdp import _optim as optim_module
from fdp import _tree as fdp_tree
from fdp import optim

Config = tuple[
    Callable[[list[torch.Tensor]], torch.optim.Optimizer], Callable[[], optim.GradientTransformation]
]

CONFIGS: dict[str, Config] = {
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.1), lambda: optim.sgd(0.1)),
    "sgd_momentum": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        lambda: optim.sgd(0.05, momentum=0.9),
    ),
    "sgd_dampening": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.3),
        lambda: optim.sgd(0.05, momentum=0.9, dampening=0.3),
    ),
    "sgd_nesterov_weight_decay": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
        lambda: optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    ),
    "adam": (lambda p: torch.optim.Adam(p, lr=1e-2), lambda: optim.adam(1e-2)),
    "adam_weight_decay": (
        lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-3),
        lambda: optim.adam(1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-3),
    ),
    "adamw": (
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda: optim.adamw(1e-2, weight_decay=0.1),
    ),
    "sgd_maximize_momentum_weight_decay": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2, maximize=True),
        lambda: optim.sgd(0.05, momentum=0.9, weight_decay=1e-2, maximize=True),
    ),
    "adam_amsgrad_weight_decay": (
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-3, amsgrad=True),
        lambda: optim.adam(1e-2, weight_decay=1e-3, amsgrad=True),
    ),
    "adam_maximize": (
        lambda p: torch.optim.Adam(p, lr=1e-2, maximize=True),
        lambda: optim.adam(1e-2, maximize=True),
    ),
    "adamw_amsgrad_maximize": (
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True),
        lambda: optim.adamw(1e-2, weight_decay=0.1, amsgrad=True, maximize=True),
    ),
}


class Clipped:
    """torch.optim with clip_grad_norm_ before each step, as one 'optimizer'."""

    def __init__(self, inner: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float) -> None:
        self.inner, self.params, self.max_norm = inner, params, max_norm

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.inner.step()


CONFIGS["clip_then_adamw"] = (
    lambda p: Clipped(torch.optim.AdamW(p, lr=1e-2), p, 0.5),  # type: ignore[dict-item]
    lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2)),
)


def warmup_cosine(step: int) -> float:
    """A factor of the learning rate: 10 steps of warm-up, then a cosine decay over 100."""
    return min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / 100))


class Scheduled:
    """torch.optim with a LambdaLR stepped after each step, as one 'optimizer'."""

    def __init__(self, inner: torch.optim.Optimizer, factor: Callable[[int], float]) -> None:
        self.inner = inner
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(inner, factor)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> None:
        self.inner.step()
        self.scheduler.step()


# A schedule gives at step k what LambdaLR gives after k of its steps: base_lr * factor(k).
CONFIGS["sgd_momentum_scheduled"] = (
    lambda p: Scheduled(torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2), warmup_cosine),  # type: ignore[dict-item]
    lambda: optim.sgd(lambda k: 0.05 * warmup_cosine(k), momentum=0.9, weight_decay=1e-2),
)
CONFIGS["adam_scheduled"] = (
    lambda p: Scheduled(torch.optim.Adam(p, lr=1e-2), lambda k: 0.9**k),  # type: ignore[dict-item]
    lambda: optim.adam(lambda k: 1e-2 * 0.9**k),
)
CONFIGS["adamw_scheduled"] = (
    lambda p: Scheduled(torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), warmup_cosine),  # type: ignore[dict-item]
    lambda: optim.adamw(lambda k: 1e-2 * warmup_cosine(k), weight_decay=0.1),
)


def warmup_then_cosine(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """torch's own schedulers, chained: 10 steps of linear warm-up, then a cosine decay (whose
    rates torch computes recursively, step after step, not from a formula of the step)."""
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=10)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=90, eta_min=1e-4)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[10])


def recorded_rates(
    make_scheduler: Callable[[torch.optim.Optimizer], Any], lr: float, steps: int = 100
) -> list[float]:
    """The rates a torch scheduler sets, step by step, recorded from a stand-in optimizer
    (docs/training.md's recipe for schedulers that no formula of the step gives as they do)."""
    holder = torch.optim.SGD([torch.zeros(0)], lr=lr)
    scheduler = make_scheduler(holder)
    rates = []
    for _ in range(steps):
        rates.append(holder.param_groups[0]["lr"])
        holder.step()  # a step of nothing, before the scheduler's, as torch asks
        scheduler.step()
    return rates


class WithScheduler(Scheduled):
    """torch.optim with one of torch's schedulers stepped after each step, as one 'optimizer'."""

    def __init__(
        self, inner: torch.optim.Optimizer, make_scheduler: Callable[[torch.optim.Optimizer], Any]
    ) -> None:
        self.inner = inner
        self.scheduler = make_scheduler(inner)


# Any scheduler that sets the learning rate alone: its recorded rates, as a schedule.
CONFIGS["adamw_torch_scheduler"] = (
    lambda p: WithScheduler(torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), warmup_then_cosine),  # type: ignore[dict-item]
    lambda: optim.adamw(recorded_rates(warmup_then_cosine, 1e-2).__getitem__, weight_decay=0.1),
)


def by_dim(params: dict[str, torch.Tensor]) -> dict[str, str]:
    """The labels of a transformer script's two param groups: weight decay for the matrices,
    none for the biases and norms (the parameters of fewer dims)."""
    return {k: "decay" if v.dim() > 1 else "no_decay" for k, v in params.items()}


def groups(
    params: list[torch.Tensor], decay: dict[str, Any], no_decay: dict[str, Any]
) -> list[dict[str, Any]]:
    """torch.optim's param groups of by_dim's labels, with each group's options."""
    return [
        {"params": [p for p in params if p.dim() > 1], **decay},
        {"params": [p for p in params if p.dim() <= 1], **no_decay},
    ]


class Both:
    """Two torch.optim optimizers over two groups of parameters, as one 'optimizer'."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad()

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


# Parameter groups: torch.optim's param groups, against multi_transform with a transformation
# per label (different weight decay, learning rates, schedules, optimizers).
CONFIGS["adamw_groups"] = (
    lambda p: torch.optim.AdamW(groups(p, {"weight_decay": 0.1}, {"weight_decay": 0.0}), lr=1e-2),
    lambda: optim.multi_transform(
        {"decay": optim.adamw(1e-2, weight_decay=0.1), "no_decay": optim.adamw(1e-2, weight_decay=0.0)},
        by_dim,
    ),
)
CONFIGS["sgd_groups_of_other_lrs"] = (
    lambda p: torch.optim.SGD(
        groups(p, {"lr": 0.05}, {"lr": 0.01, "momentum": 0.5}), lr=0.1, momentum=0.9, weight_decay=1e-2
    ),
    lambda: optim.multi_transform(
        {
            "decay": optim.sgd(0.05, momentum=0.9, weight_decay=1e-2),
            "no_decay": optim.sgd(0.01, momentum=0.5, weight_decay=1e-2),
        },
        by_dim,
    ),
)
# LambdaLR with a factor per group: a schedule for one label, a constant rate for the other.
CONFIGS["adam_groups_one_scheduled"] = (
    lambda p: Scheduled(  # type: ignore[dict-item]
        torch.optim.Adam(groups(p, {}, {"lr": 3e-3}), lr=1e-2, weight_decay=1e-3),
        [warmup_cosine, lambda k: 1.0],  # type: ignore[arg-type]
    ),
    lambda: optim.multi_transform(
        {
            "decay": optim.adam(lambda k: 1e-2 * warmup_cosine(k), weight_decay=1e-3),
            "no_decay": optim.adam(3e-3, weight_decay=1e-3),
        },
        by_dim,
    ),
)
CONFIGS["adamw_and_sgd_groups"] = (
    lambda p: Both(  # type: ignore[dict-item]
        torch.optim.AdamW([t for t in p if t.dim() > 1], lr=1e-2, weight_decay=0.1),
        torch.optim.SGD([t for t in p if t.dim() <= 1], lr=0.05, momentum=0.9),
    ),
    lambda: optim.multi_transform(
        {"decay": optim.adamw(1e-2, weight_decay=0.1), "no_decay": optim.sgd(0.05, momentum=0.9)}, by_dim
    ),
)
CONFIGS["clip_then_adamw_groups"] = (
    lambda p: Clipped(  # type: ignore[dict-item]
        torch.optim.AdamW(groups(p, {"weight_decay": 0.1}, {"weight_decay": 0.0}), lr=1e-2), p, 0.5
    ),
    lambda: optim.chain(
        optim.clip_by_global_norm(0.5),
        optim.multi_transform(
            {"decay": optim.adamw(1e-2, weight_decay=0.1), "no_decay": optim.adamw(1e-2, weight_decay=0.0)},
            by_dim,
        ),
    ),
)


def state_of(state: Any, key: str) -> Any:
    """The state of the optimizer that steps params[key]: ``state`` itself, a chain's last, or
    under multi_transform that of key's label (whose trees hold a tensor at key); None if none."""
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return state_of(state[-1], key)
    if isinstance(state, optim.MultiTransformState):
        for inner in state.inner_states.values():
            mine = state_of(inner, key)
            if any(isinstance(tree, dict) and tree.get(key) is not None for tree in mine[1:]):
                return mine
        return None
    return state


def steps_of(state: Any) -> list[int]:
    """The step counts of ``state``'s optimizers (a chain's last; each label's)."""
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return steps_of(state[-1])
    if isinstance(state, optim.MultiTransformState):
        return [n for inner in state.inner_states.values() for n in steps_of(inner)]
    return [state.step]


def problem() -> tuple[nn.Module, Callable[[dict[str, torch.Tensor]], torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    x, y = torch.randn(64, 6), torch.randn(64, 2)

    def loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean()

    return model, loss


def train_both(
    name: str,
    initial: dict[str, torch.Tensor],
    loss: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    one_pass: bool,
    steps: int = 100,
) -> tuple[dict[str, torch.Tensor], Any, dict[str, torch.Tensor], Any]:
    """``steps`` steps of config ``name`` from ``initial``: fdp's (``apply_gradients`` with
    ``one_pass``, else ``update`` and ``apply_updates``) and torch.optim's on copies.
    Returns fdp's params and state, torch's params and optimizer."""
    make_torch, make_ours = CONFIGS[name]
    if "maximize" in name:  # both maximize the loss negated: a problem that converges
        minimized = loss

        def loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
            return -minimized(params)

    reference = {k: v.clone().requires_grad_() for k, v in initial.items()}
    torch_opt = make_torch(list(reference.values()))
    opt = make_ours()
    params = {k: v.clone() for k, v in initial.items()}
    state = opt.init(params)
    for _ in range(steps):
        torch_opt.zero_grad()
        loss(reference).backward()
        torch_opt.step()
        grads = torch.func.grad(loss)(params)
        if one_pass:
            params, state = opt.apply_gradients(grads, state, params)
        else:
            updates, state = opt.update(grads, state, params)
            params = optim.apply_updates(params, updates)
    return params, state, reference, torch_opt


@pytest.mark.parametrize("one_pass", [False, True], ids=["update_apply_updates", "apply_gradients"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_torch_optim_over_100_steps(name: str, one_pass: bool) -> None:
    model, loss = problem()
    initial = {k: v.detach() for k, v in model.named_parameters()}
    params, _, reference, _ = train_both(name, initial, loss, one_pass)
    for k in params:
        if one_pass and not name.startswith("clip_then_"):
            # The new parameters as computed, with torch.optim's kernels: the same bits.
            # (clip_grad_norm_ sums its norm in another order: to 1e-6 there, as the updates.)
            assert torch.equal(params[k], reference[k].detach()), k
        else:
            torch.testing.assert_close(params[k], reference[k].detach(), atol=1e-6, rtol=0)


HALF_CONFIGS: dict[
    str, tuple[Callable[..., torch.optim.Optimizer], Callable[[], optim.GradientTransformation]]
] = {
    "sgd_nesterov_weight_decay": (
        lambda p, foreach: torch.optim.SGD(
            p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, foreach=foreach
        ),
        lambda: optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    ),
    "adam_weight_decay": (
        lambda p, foreach: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-3, foreach=foreach),
        lambda: optim.adam(1e-2, weight_decay=1e-3),
    ),
    "adamw": (
        lambda p, foreach: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=foreach),
        lambda: optim.adamw(1e-2, weight_decay=0.1),
    ),
    "adamw_amsgrad_maximize": (
        lambda p, foreach: torch.optim.AdamW(
            p, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True, foreach=foreach
        ),
        lambda: optim.adamw(1e-2, weight_decay=0.1, amsgrad=True, maximize=True),
    ),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(HALF_CONFIGS))
def test_matches_torch_optim_on_half_precision_parameters(name: str, dtype: torch.dtype) -> None:
    # Every op in the parameters' dtype, as torch.optim's single-tensor step: the same bits.
    # torch's foreach step rounds differently in places (its own two paths differ by units in
    # the last place in bfloat16/float16), so against it: to the dtype's rounding.
    make_torch, make_ours = HALF_CONFIGS[name]
    torch.manual_seed(0)
    initial = {"w": torch.randn(6, 4).to(dtype), "b": torch.randn(4).to(dtype)}
    steps = [{k: torch.randn_like(v) for k, v in initial.items()} for _ in range(20)]
    opt = make_ours()
    params, state = dict(initial), opt.init(initial)
    for grads in steps:
        params, state = opt.apply_gradients(grads, state, params)
    via_updates, state = dict(initial), opt.init(initial)
    for grads in steps:
        updates, state = opt.update(grads, state, via_updates)
        via_updates = optim.apply_updates(via_updates, updates)
    for foreach in (False, True):
        reference = {k: v.clone().requires_grad_() for k, v in initial.items()}
        torch_opt = make_torch(list(reference.values()), foreach)
        for grads in steps:
            for k, p in reference.items():
                p.grad = grads[k].clone()
            torch_opt.step()
        for k, p in reference.items():
            assert params[k].dtype == via_updates[k].dtype == dtype
            if not foreach:
                assert torch.equal(params[k], p.detach()), k
            torch.testing.assert_close(params[k], p.detach(), atol=0.05, rtol=0.02)
            torch.testing.assert_close(via_updates[k], p.detach(), atol=0.05, rtol=0.02)


def complex_problem() -> tuple[dict[str, torch.Tensor], Callable[[dict[str, torch.Tensor]], torch.Tensor]]:
    """Complex parameters beside a real one, and a real loss."""
    torch.manual_seed(0)
    params = {
        "w": torch.randn(6, 4, dtype=torch.complex64),
        "v": torch.randn(4, dtype=torch.complex64),
        "b": torch.randn(4),
    }
    x, y = torch.randn(32, 6, dtype=torch.complex64), torch.randn(32, 4)

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return (((x @ p["w"] + p["v"]).abs() + p["b"] - y) ** 2).mean()

    return params, loss


@pytest.mark.parametrize("one_pass", [False, True], ids=["update_apply_updates", "apply_gradients"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_torch_optim_on_complex_parameters(name: str, one_pass: bool) -> None:
    # torch.optim.Adam/AdamW step a complex parameter on view_as_real of it, its gradient and
    # its moments (each part its own second moment); SGD steps it as it is.
    initial, loss = complex_problem()
    params, state, reference, torch_opt = train_both(name, initial, loss, one_pass)
    inner = getattr(torch_opt, "inner", torch_opt)
    for k in params:
        assert params[k].dtype == initial[k].dtype, k
        if one_pass and not name.startswith("clip_then_"):
            assert torch.equal(params[k], reference[k].detach()), k
        else:
            # new - params added back rounds (see the module docstring): over 100 steps of
            # this problem, parameters and moments drift apart to 1e-5.
            torch.testing.assert_close(params[k], reference[k].detach(), atol=1e-5, rtol=0)
        for field, theirs in inner.state[reference[k]].items():
            if field in ("exp_avg", "exp_avg_sq"):  # torch's are complex for a complex parameter
                mine = getattr(state_of(state, k), field)[k]
                assert mine.dtype == theirs.dtype, (k, field)
                torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_steps_sparse_gradients_as_torch_optim_does(momentum: float) -> None:
    # An nn.Embedding(sparse=True)'s gradients; adam, sgd with weight_decay and clipping refuse
    # them, naming the leaf (tests/test_bad_input.py).
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    reference = torch.optim.SGD(emb.parameters(), lr=0.1, momentum=momentum)
    opt = optim.sgd(0.1, momentum=momentum)
    params = {"weight": emb.weight.detach().clone()}
    state = opt.init(params)
    for ids in ([1, 2], [2, 5], [7, 1, 1]):
        emb.zero_grad()
        emb(torch.tensor(ids)).pow(2).sum().backward()
        reference.step()
        leaf = params["weight"].requires_grad_()
        (grad,) = torch.autograd.grad(
            torch.func.functional_call(emb, {"weight": leaf}, (torch.tensor(ids),)).pow(2).sum(), [leaf]
        )
        assert grad.is_sparse
        params, state = opt.apply_gradients({"weight": grad}, state, {"weight": leaf.detach()})
    torch.testing.assert_close(params["weight"], emb.weight.detach())


def test_clipping_a_sparse_gradient_clips_as_the_dense_one_or_is_refused() -> None:
    # torch 2.13 cannot take the norm of a sparse gradient: fdp names the leaf (test_bad_input).
    # torch 2.15 can: the clipped gradient must then be the dense one's, duplicates summed.
    emb = nn.Embedding(10, 3, sparse=True)
    (grad,) = torch.autograd.grad(emb(torch.tensor([1, 2, 2])).sum() * 5, [emb.weight])
    clip = optim.clip_by_global_norm(1.0)
    try:
        clipped, _ = clip.update({"w": grad}, optim.EmptyState())
    except TypeError as error:
        assert "a sparse gradient" in str(error)
        return
    dense, _ = clip.update({"w": grad.to_dense()}, optim.EmptyState())
    torch.testing.assert_close(clipped["w"].to_dense(), dense["w"])


def test_adam_takes_complex_gradients_with_the_conjugate_bit() -> None:
    # autograd returns a lazily conjugated gradient for a loss of z.conj(); view_as_real refuses
    # those, so the step resolves them first (torch.optim.Adam fails on such a .grad in 2.13).
    params = {"w": torch.randn(4, dtype=torch.complex64)}
    c = torch.randn(4, dtype=torch.complex64)
    grads = torch.func.grad(lambda p: (p["w"].conj() * c).real.sum())(params)
    assert grads["w"].is_conj()
    opt = optim.adam(1e-2)
    new, _ = opt.apply_gradients(grads, opt.init(params), params)
    resolved, _ = opt.apply_gradients({"w": grads["w"].resolve_conj()}, opt.init(params), params)
    assert torch.equal(new["w"], resolved["w"])


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.sgd(0.1, momentum=0.9),
        lambda: optim.adamw(),
        lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adam()),
        # Each label's in one pass, a chain's included.
        lambda: optim.multi_transform(
            {
                "w": optim.chain(optim.clip_by_global_norm(0.5), optim.sgd(0.1, momentum=0.9)),
                "b": optim.adamw(),
                "unused": optim.sgd(0.1),
            },
            {"w": "w", "b": "b"},
        ),
    ],
)
def test_apply_gradients_forms_no_updates(make: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # fdp's optimizers, and chains ending in one, never form new - params and add it back.
    def refuse(*args: Any) -> Any:
        raise AssertionError("a second pass over the parameters")

    monkeypatch.setattr(optim_module, "_difference", refuse)
    monkeypatch.setattr(optim_module, "apply_updates", refuse)
    opt = make()
    params = {"w": torch.ones(3), "b": torch.zeros(1)}
    state = opt.init(params)
    for _ in range(2):
        params, state = opt.apply_gradients({"w": torch.ones(3), "b": torch.ones(1)}, state, params)


def test_apply_gradients_of_other_transformations_is_update_then_apply_updates() -> None:
    clip = optim.clip_by_global_norm(1.0)  # updates, no parameters: a chain ending in it too
    double = optim.GradientTransformation(
        lambda p: (), lambda g, s, p=None: (optree.tree_map(lambda t: 2 * t, g), s)
    )
    params = {"w": torch.ones(2)}
    grads = {"w": torch.tensor([3.0, 4.0])}
    for opt in (clip, double, optim.chain(optim.sgd(0.1), clip)):
        updates, expected_state = opt.update(grads, opt.init(params), params)
        new, state = opt.apply_gradients(grads, opt.init(params), params)
        torch.testing.assert_close(new, optim.apply_updates(params, updates))
        assert optree.tree_structure(state) == optree.tree_structure(expected_state)


def test_transformations_whose_update_cannot_be_hashed_or_weakly_referenced() -> None:
    # Any callable may be an update: a callable dataclass (unhashable), a slotted object.
    @dataclasses.dataclass
    class Scale:
        factor: float

        def __call__(self, grads: Any, state: Any, params: Any = None) -> Any:
            return optree.tree_map(lambda t: self.factor * t, grads), state

    class Identity:
        __slots__ = ()

        def __call__(self, grads: Any, state: Any, params: Any = None) -> Any:
            return grads, state

    params = {"w": torch.ones(2)}
    for update in (Scale(2.0), Identity()):
        custom = optim.GradientTransformation(lambda p: (), update)
        for opt in (custom, optim.chain(optim.sgd(0.1), custom)):
            updates, _ = opt.update(params, opt.init(params), params)
            new, _ = opt.apply_gradients(params, opt.init(params), params)
            torch.testing.assert_close(new, optim.apply_updates(params, updates))


def test_apply_gradients_of_an_update_wrapped_with_functools_wraps_runs_the_wrapper() -> None:
    # functools.wraps copies the wrapped function's __dict__ onto the wrapper, the one-pass step
    # of fdp's optimizer among it: that step would skip what the wrapper does (here, halve the
    # gradients), silently, in apply_gradients alone.
    import functools

    inner = optim.sgd(1.0, momentum=0.9)

    @functools.wraps(inner.update)
    def halved(grads: Any, state: Any, params: Any = None) -> Any:
        return inner.update(optree.tree_map(lambda g: 0.5 * g, grads), state, params)

    wrapped = optim.GradientTransformation(inner.init, halved)
    params = {"w": torch.ones(2)}
    grads = {"w": torch.ones(2)}
    for opt in (
        wrapped,
        optim.chain(optim.clip_by_global_norm(10.0), wrapped),
        optim.multi_transform({"mine": wrapped, "other": optim.adam()}, {"w": "mine"}),
    ):
        updates, expected_state = opt.update(grads, opt.init(params), params)
        new, state = opt.apply_gradients(grads, opt.init(params), params)
        assert new["w"].tolist() == [0.5, 0.5]
        assert_trees_equal(new, optim.apply_updates(params, updates))
        assert_trees_equal(state, expected_state)


def test_apply_gradients_keeps_the_params_key_order() -> None:
    params = {"a": torch.ones(1), "b": torch.ones(1)}
    grads = {"b": torch.ones(1), "a": torch.ones(1)}  # another key order: the same structure
    for opt in (optim.sgd(0.1, momentum=0.9), optim.adamw()):
        new, _ = opt.apply_gradients(grads, opt.init(params), params)
        assert list(new) == ["a", "b"]


def test_apply_gradients_with_grads_unlike_params() -> None:
    opt = optim.sgd(0.1)
    with pytest.raises(ValueError, match="fdp.optim.sgd: apply_gradients got params .* but grads"):
        opt.apply_gradients({"v": torch.ones(1)}, opt.init({"w": torch.ones(1)}), {"w": torch.ones(1)})


def test_update_with_grads_unlike_params() -> None:
    # update checks grads against params as apply_gradients does: else a gradient is stepped
    # against another key's parameter (here the weight decay of 'w' would land on 'v').
    opt = optim.sgd(0.1, weight_decay=1.0)
    with pytest.raises(ValueError, match="fdp.optim.sgd: update got params .* but grads"):
        opt.update({"v": torch.ones(1)}, opt.init({"w": torch.ones(1)}), {"w": torch.ones(1)})


@pytest.mark.parametrize("one_pass", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize(
    ("make", "field", "start"),
    [
        (lambda: optim.sgd(0.1, momentum=0.9), "momentum", 0),
        (lambda: optim.sgd(0.1, momentum=0.9), "momentum", 3),
        (lambda: optim.adam(0.1), "exp_avg", 5),
        (lambda: optim.adamw(0.1), "exp_avg_sq", 5),
    ],
)
def test_a_state_for_other_params_is_refused(
    make: Callable[[], Any], field: str, start: int, one_pass: bool
) -> None:
    # A state made for keys a, b given with grads and params for keys b, c: zipped by position,
    # b would be stepped with a's moments and the state silently re-keyed.
    opt = make()
    params = {"b": torch.zeros(2), "c": torch.zeros(2)}
    other = opt.init({"a": torch.zeros(2), "b": torch.zeros(2)})
    state = opt.init(params)._replace(step=start, **{field: getattr(other, field)})
    call = opt.apply_gradients if one_pass else opt.update
    name = "apply_gradients" if one_pass else "update"
    with pytest.raises(
        ValueError, match=rf"fdp\.optim\.\w+: {name} got grads .* but a state whose {field} is"
    ):
        call(params, state, params)
    with pytest.raises(ValueError, match=f"state whose {field} is"):  # in a chain too
        chained = optim.chain(optim.clip_by_global_norm(1.0), opt)
        (chained.apply_gradients if one_pass else chained.update)(params, ((), state), params)


def test_adam_with_amsgrad_refuses_a_state_without_its_largest_moments() -> None:
    params = {"w": torch.ones(2)}
    state = optim.adam().init(params)  # max_exp_avg_sq None
    opt = optim.adam(amsgrad=True)
    # (An old checkpoint resumed with amsgrad on: the state's structure was said to be unlike
    # the grads', as if the parameters were at fault.)
    with pytest.raises(
        ValueError,
        match=r"^fdp\.optim\.adam: apply_gradients got a state whose max_exp_avg_sq is None, as init "
        r"makes it without amsgrad=True, which this optimizer has: its state must come from its own "
        r"init\(params\) \(to go on from a state kept without it, seed the largest second moments with "
        r"the second moments: state\._replace\(max_exp_avg_sq=state\.exp_avg_sq\)\)$",
    ):
        opt.apply_gradients(params, state._replace(step=1), params)
    resumed = state._replace(max_exp_avg_sq=state.exp_avg_sq)  # as the message says
    opt.apply_gradients(params, resumed, params)


def test_sgd_with_momentum_refuses_a_state_without_momentum() -> None:
    params = {"w": torch.ones(2)}
    state = optim.sgd(0.1).init(params)  # momentum None
    opt = optim.sgd(0.1, momentum=0.9)
    with pytest.raises(
        ValueError,
        match=r"^fdp\.optim\.sgd: apply_gradients got a state whose momentum is None, as init makes "
        r"it without momentum, which this optimizer has: its state must come from its own init\(params\)$",
    ):
        opt.apply_gradients(params, state._replace(step=1), params)


@pytest.mark.parametrize("one_pass", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize(
    ("make", "made_with", "field", "option"),
    [
        (lambda: optim.adam(), lambda: optim.adam(amsgrad=True), "max_exp_avg_sq", "amsgrad=True"),
        (lambda: optim.adamw(), lambda: optim.adamw(amsgrad=True), "max_exp_avg_sq", "amsgrad=True"),
        (lambda: optim.sgd(0.1), lambda: optim.sgd(0.1, momentum=0.9), "momentum", "momentum"),
    ],
    ids=["adam", "adamw", "sgd"],
)
def test_a_state_kept_with_an_option_the_optimizer_lacks_is_refused(
    make: Callable[[], Any], made_with: Callable[[], Any], field: str, option: str, one_pass: bool
) -> None:
    # An amsgrad checkpoint resumed by adam() dropped its largest second moments and went on as
    # plain Adam, silently; torch.optim's load_state_dict takes the options saved with the
    # state, and goes on with amsgrad (and SGD with the saved momentum).
    params = {"w": torch.ones(2)}
    state = made_with().init(params)
    opt = make()
    call = opt.apply_gradients if one_pass else opt.update
    name = "apply_gradients" if one_pass else "update"
    with pytest.raises(
        ValueError,
        match=rf"^fdp\.optim\.\w+: {name} got a state whose {field} is not None, as init makes it with "
        rf"{re.escape(option)}, which this optimizer lacks: make the optimizer with {re.escape(option)} to "
        rf"go on as the state was made, or drop them to go on without: "
        rf"state\._replace\({field}=None\)$",
    ):
        call(params, state, params)
    dropped = state._replace(**{field: None})  # as the message says
    fresh = make().init(params)
    assert_same_trees(call(params, dropped, params), call(params, fresh, params))


def assert_same_trees(a: Any, b: Any) -> None:
    a_leaves, a_spec = optree.tree_flatten(a)
    b_leaves, b_spec = optree.tree_flatten(b)
    assert a_spec == b_spec
    for x, y in zip(a_leaves, b_leaves):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


@pytest.mark.parametrize("one_pass", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize(
    ("make", "make_state", "kind"),
    [
        # sgd without momentum read only the step count: another optimizer's state passed silently
        (lambda: optim.sgd(0.1), lambda p: optim.adam().init(p), "AdamState"),
        (lambda: optim.sgd(0.1, momentum=0.9), lambda p: optim.adamw().init(p), "AdamState"),
        (lambda: optim.adam(), lambda p: optim.sgd(0.1, momentum=0.9).init(p), "SgdState"),
        (lambda: optim.adam(), lambda p: optim.chain(optim.adam()).init(p), "tuple"),
        (lambda: optim.adamw(), lambda p: p, "dict"),  # update(grads, params, state)
    ],
    ids=["adam-to-sgd", "adamw-to-sgd-momentum", "sgd-to-adam", "chain-to-adam", "params-to-adamw"],
)
def test_a_state_of_another_kind_is_refused(
    make: Callable[[], Any], make_state: Callable[[Any], Any], kind: str, one_pass: bool
) -> None:
    opt = make()
    params = {"w": torch.ones(2)}
    call = "apply_gradients" if one_pass else "update"
    expected = (
        rf"^fdp\.optim\.\w+: {call} got a state of type {kind}, expected \w+State: the state must come "
    )
    with pytest.raises(ValueError, match=expected):
        getattr(opt, call)(params, make_state(params), params)


@pytest.mark.parametrize("one_pass", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: optim.sgd(0.1, momentum=0.9), "momentum"),
        (lambda: optim.adam(0.1), "exp_avg"),
        (lambda: optim.adamw(0.1), "exp_avg"),
    ],
    ids=["sgd", "adam", "adamw"],
)
@pytest.mark.parametrize(
    ("made_for", "what", "got", "expected"),
    [
        # sgd silently stepped bfloat16 parameters into float32 with a float32 momentum
        (torch.ones(3), "dtype", "torch.float32", "torch.bfloat16"),
        (torch.ones(1, dtype=torch.bfloat16), "shape", r"\(1,\)", r"\(3,\)"),
        (torch.ones(3, 1, dtype=torch.bfloat16), "shape", r"\(3, 1\)", r"\(3,\)"),
    ],
    ids=["dtype", "shape-broadcast", "shape"],
)
def test_a_state_for_params_of_other_shapes_or_dtypes_is_refused(
    make: Callable[[], Any],
    field: str,
    made_for: torch.Tensor,
    what: str,
    got: str,
    expected: str,
    one_pass: bool,
) -> None:
    # A state made for other parameters under the same keys (a model resized or cast after
    # init): torch.optim casts a loaded state to its parameters' dtypes; stepped as it is, the
    # parameters would take the state's dtype or shape, or the step fail inside torch.
    opt = make()
    other = {"b": torch.zeros(2, dtype=torch.bfloat16), "w": made_for}
    state = opt.init(other)
    _, state = opt.update(other, state, other)  # past the first step: the buffers in use
    params = {"b": torch.zeros(2, dtype=torch.bfloat16), "w": torch.ones(3, dtype=torch.bfloat16)}
    call = "apply_gradients" if one_pass else "update"
    message = (
        rf"^fdp\.optim\.\w+: {call} got state\.{field}\['w'\] of {what} {got} for params\['w'\] "
        rf"of {what} {expected}; the state must come from init\(params\) for params of these shapes"
    )
    with pytest.raises(ValueError, match=message):
        getattr(opt, call)(params, state, params)


OPTIMIZERS: dict[str, Callable[[], optim.GradientTransformation]] = {
    "sgd": lambda: optim.sgd(0.1),
    "sgd_momentum": lambda: optim.sgd(0.1, momentum=0.9, weight_decay=0.1),
    "adam": lambda: optim.adam(0.1),
    "adamw": lambda: optim.adamw(0.1),
    "clip_then_adam": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adam(0.1)),
    "groups": lambda: optim.multi_transform(
        {"vector": optim.adam(0.1), "other": optim.sgd(0.1, momentum=0.9)},
        lambda params: optree.tree_map(
            lambda p: "vector" if p.dim() == 1 else "other", params, namespace="fdp"
        ),
    ),
}


@pytest.mark.parametrize("one_pass", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("shape", [(3, 1), (1,), ()])
def test_gradients_of_another_shape_are_refused(name: str, one_pass: bool, shape: tuple[int, ...]) -> None:
    # torch.optim refuses such a .grad; broadcast, it would change the parameter's shape.
    with pytest.raises(RuntimeError, match="different size|same size"):
        torch.zeros(3, requires_grad=True).grad = torch.ones(shape)
    opt = OPTIMIZERS[name]()
    params = {"b": torch.zeros(2), "layer": {"w": torch.zeros(3)}}
    grads = {"b": torch.ones(2), "layer": {"w": torch.ones(shape)}}
    state = opt.init(params)
    for _ in range(2):  # also with a state past its first step (momentum buffers in use)
        params, state = opt.apply_gradients(
            {"b": torch.ones(2), "layer": {"w": torch.ones(3)}}, state, params
        )
    call = "apply_gradients" if one_pass else "update"
    expected = rf"fdp\.optim\.\w+: {call} got grads\['layer'\]\['w'\] of shape {re.escape(str(shape))} "
    expected += r"for params\['layer'\]\['w'\] of shape \(3,\)"
    with pytest.raises(ValueError, match=expected):
        (opt.apply_gradients if one_pass else opt.update)(grads, state, params)


@pytest.mark.parametrize("one_pass", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.complex64])
def test_gradients_of_another_dtype_are_refused(name: str, one_pass: bool, dtype: torch.dtype) -> None:
    # torch.optim refuses such a .grad; fdp would promote the parameters (and the state).
    with pytest.raises(RuntimeError, match="dtype"):
        torch.zeros(3, requires_grad=True).grad = torch.ones(3, dtype=dtype)
    opt = OPTIMIZERS[name]()
    params = {"w": torch.zeros(3)}
    call = "apply_gradients" if one_pass else "update"
    expected = (
        rf"fdp\.optim\.\w+: {call} got grads\['w'\] of dtype {dtype} for params\['w'\] of dtype torch.float32"
    )
    with pytest.raises(ValueError, match=expected):
        (opt.apply_gradients if one_pass else opt.update)(
            {"w": torch.ones(3, dtype=dtype)}, opt.init(params), params
        )


def test_gradients_that_are_not_tensors_are_refused() -> None:
    opt = optim.sgd(0.1)
    params = {"w": torch.zeros(3), "s": torch.zeros(())}
    with pytest.raises(
        ValueError, match=r"got grads\['s'\] of type float for params\['s'\] of type float32\[\]"
    ):
        opt.apply_gradients({"w": torch.ones(3), "s": 1.0}, opt.init(params), params)


@pytest.mark.parametrize(
    "make",
    [lambda: optim.sgd(0.1, momentum=0.9), lambda: optim.adam(), lambda: optim.adamw()],
    ids=["sgd", "adam", "adamw"],
)
def test_init_refuses_leaves_that_are_not_tensors(make: Callable[[], Any]) -> None:
    # A step count kept among the parameters: torch.zeros_like failed on it, naming no leaf.
    opt = make()
    with pytest.raises(
        ValueError,
        match=r"^fdp\.optim\.\w+: init got params\['step'\] of type int; fdp\.optim steps tensors only",
    ):
        opt.init({"w": torch.ones(2), "step": 3})


@pytest.mark.parametrize(
    ("grads", "error", "match"),
    [
        (
            {"w": torch.ones(2), "step": 0},
            ValueError,
            r"grads\['step'\] of type int; fdp\.optim steps tensors only",
        ),
        # torch's norm said "linalg.vector_norm: Expected a floating point or complex tensor as
        # input. Got Long", naming neither the call nor the leaf.
        (
            {"b": torch.ones(2), "w": torch.ones(3, dtype=torch.int64)},
            TypeError,
            r"grads\['w'\] of type int64\[3\]; gradients must be floating point or complex$",
        ),
    ],
    ids=["not a tensor", "integer"],
)
def test_clip_by_global_norm_names_a_leaf_it_cannot_clip(grads: Any, error: type, match: str) -> None:
    clip = optim.clip_by_global_norm(1.0)
    with pytest.raises(error, match=r"^fdp\.optim\.clip_by_global_norm: update got " + match):
        clip.update(grads, clip.init(None))


def test_per_replica_leaves_outside_the_pmapped_function_are_refused_with_a_hint() -> None:
    # Resident state outside the step: each replica's tensors are only seen inside pmap.
    import fdp

    params = {"w": torch.ones(2)}
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adam())
    placed = fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, ["cpu", "cpu"])
    hint = r"of type PerReplica.*; a PerReplica holds one tensor per replica: step inside the pmapped "
    hint += r"function.*init on the parameters before"
    with pytest.raises(ValueError, match=rf"^fdp\.optim\.adam: init got params\['w'\] {hint}"):
        opt.init(placed["params"])
    # A function of the labels that reads the leaves (v.dim()) failed on them, saying only
    # "'PerReplica' object has no attribute 'dim'".
    groups = optim.multi_transform({"decay": optim.adamw(), "no_decay": optim.adam()}, by_dim)
    with pytest.raises(ValueError, match=rf"^fdp\.optim\.multi_transform: init got params\['w'\] {hint}"):
        groups.init(placed["params"])
    with pytest.raises(
        ValueError, match=rf"^fdp\.optim\.clip_by_global_norm: update got grads\['w'\] {hint}"
    ):
        opt.apply_gradients(placed["params"], placed["opt"], placed["params"])
    with pytest.raises(ValueError, match=rf"^fdp\.optim\.adam: update got grads\['w'\] {hint}"):
        optim.adam().update(placed["params"], placed["opt"][1], placed["params"])
    # Only the state resident (the params and grads unwrapped): the hint still, not a word on
    # init(params) for params of other shapes and dtypes, which these are not.
    with pytest.raises(ValueError, match=rf"^fdp\.optim\.adam: update got state\.exp_avg\['w'\] {hint}"):
        optim.adam().update(params, placed["opt"][1], params)


@pytest.mark.parametrize(("params_shape", "updates_shape"), [((1,), (3,)), ((3,), (3, 1)), ((3,), ())])
def test_apply_updates_of_another_shape_are_refused(
    params_shape: tuple[int, ...], updates_shape: tuple[int, ...]
) -> None:
    params = {"a": torch.zeros(2), "w": torch.zeros(params_shape)}
    updates = {"a": torch.ones(2), "w": torch.ones(updates_shape)}
    expected = rf"fdp\.optim\.apply_updates: got updates\['w'\] of shape {re.escape(str(updates_shape))} "
    expected += rf"for params\['w'\] of shape {re.escape(str(params_shape))}"
    with pytest.raises(ValueError, match=expected):
        optim.apply_updates(params, updates)


@pytest.mark.parametrize(
    ("param_dtype", "update_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float64),
        (torch.float64, torch.float32),
        (torch.complex64, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
def test_apply_updates_keeps_the_parameters_dtypes(
    param_dtype: torch.dtype, update_dtype: torch.dtype
) -> None:
    # optax's rule: (p + u).astype(p.dtype), the sum computed as the framework promotes.
    torch.manual_seed(0)
    params = {"a": torch.randn(2), "w": torch.randn(5).to(param_dtype)}
    updates = {"a": torch.randn(2), "w": (1e-3 * torch.randn(5)).to(update_dtype)}
    new = optim.apply_updates(params, updates)
    assert new["w"].dtype == param_dtype and new["a"].dtype == torch.float32
    assert torch.equal(new["w"], (params["w"] + updates["w"]).to(param_dtype))
    assert torch.equal(new["a"], params["a"] + updates["a"])


def test_apply_updates_refuses_a_complex_update_for_a_real_parameter() -> None:
    # The cast to the parameter's dtype would drop the imaginary part.
    with pytest.raises(
        ValueError, match=r"updates\['w'\] of dtype torch.complex64 for params\['w'\] of dtype"
    ):
        optim.apply_updates({"w": torch.zeros(2)}, {"w": torch.ones(2, dtype=torch.complex64)})


def by_dim_or_dtype(params: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: "a" if v.dtype == torch.float32 else "b" for k, v in params.items()}


def test_the_checks_write_key_paths_only_for_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # They run in every training step: the success path reads shapes and dtypes, nothing more.
    def refuse(*args: Any) -> Any:
        raise AssertionError("key paths written on the success path")

    monkeypatch.setattr(fdp_tree, "flatten_with_paths", refuse)
    params = {"w": torch.ones(3), "b": torch.zeros(1, dtype=torch.float64)}
    for opt in (
        optim.sgd(0.1, momentum=0.9),
        optim.adamw(0.1),
        optim.multi_transform({"a": optim.adamw(0.1), "b": optim.sgd(0.1)}, {"w": "a", "b": "b"}),
        optim.multi_transform({"a": optim.adamw(0.1), "b": optim.sgd(0.1)}, by_dim_or_dtype),
    ):
        state = opt.init(params)
        for _ in range(2):
            updates, state = opt.update(params, state, params)
            params = optim.apply_updates(params, updates)
            params, state = opt.apply_gradients(params, state, params)
    optim.apply_updates(params, {"w": torch.ones(3, dtype=torch.float64), "b": torch.zeros(1)})


@pytest.mark.parametrize("empty", [{}, {"frozen": {}}, ()], ids=["dict", "nested", "tuple"])
def test_empty_trees(empty: Any) -> None:
    # A model without trainable parameters, an empty parameter group: optax maps over no leaves.
    assert optim.apply_updates(empty, empty) == empty
    for name, make in {
        **OPTIMIZERS,
        "sgd_nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
    }.items():
        opt = make()
        for one_pass in (False, True):
            state = opt.init(empty)
            for step in (1, 2):
                if one_pass:
                    result, state = opt.apply_gradients(empty, state, empty)
                else:
                    result, state = opt.update(empty, state, empty)
                assert result == empty, name
                assert steps_of(state) and set(steps_of(state)) == {step}, name
            assert optree.tree_structure(state) == optree.tree_structure(opt.init(empty)), name


def test_a_pair_rebuilt_from_the_same_functions_keeps_its_one_pass() -> None:
    opt = optim.adam(0.1)
    init, update = opt  # still a pair
    rebuilt = optim.GradientTransformation(init, update)
    params = {"w": torch.ones(2)}
    grads = {"w": torch.ones(2)}
    a, _ = opt.apply_gradients(grads, opt.init(params), params)
    b, _ = rebuilt.apply_gradients(grads, rebuilt.init(params), params)
    assert torch.equal(a["w"], b["w"])


def test_nothing_is_modified_in_place() -> None:
    params = {"w": torch.ones(3)}
    grads = {"w": torch.ones(3)}
    for opt in (
        optim.sgd(0.1, momentum=0.9),
        optim.adam(),
        optim.adamw(),
        optim.clip_by_global_norm(0.1),
        optim.multi_transform({"a": optim.adam(), "b": optim.sgd(0.1, momentum=0.9)}, {"w": "b"}),
    ):
        state = opt.init(params)
        tensors = [t for t in optree.tree_leaves((params, grads, state)) if isinstance(t, torch.Tensor)]
        snapshot = [t.clone() for t in tensors]
        opt.update(grads, state, params)
        opt.apply_gradients(grads, state, params)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, tensors))


def test_state_structure_is_stable_across_steps() -> None:
    params = {"w": torch.ones(3), "b": torch.zeros(1)}
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1, momentum=0.9), optim.adam())
    state = opt.init(params)
    spec = optree.tree_structure(state)
    for _ in range(2):
        _, state = opt.update(params, state, params)
    assert optree.tree_structure(state) == spec


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: optim.sgd(-1.0), "lr must be non-negative"),
        (
            lambda: optim.sgd(0.1, nesterov=True),
            r"^fdp\.optim\.sgd: nesterov=True needs momentum > 0 and dampening = 0, got momentum=0\.0, "
            r"dampening=0\.0$",
        ),
        # torch.optim.SGD refuses Nesterov with dampening too, and Adam a second beta of 1.
        (
            lambda: optim.sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True),
            r"^fdp\.optim\.sgd: nesterov=True needs momentum > 0 and dampening = 0, got momentum=0\.9, "
            r"dampening=0\.1$",
        ),
        # A NaN dampening poisons every momentum buffer (torch.optim.SGD checks no dampening).
        (
            lambda: optim.sgd(0.1, momentum=0.9, dampening=math.nan),
            r"^fdp\.optim\.sgd: dampening must be a number, got nan$",
        ),
        (lambda: optim.adam(betas=(1.0, 0.9)), r"betas must be in \[0, 1\)"),
        (lambda: optim.adam(betas=(0.9, 1.0)), r"betas must be in \[0, 1\)"),
        (lambda: optim.clip_by_global_norm(0.0), "max_norm must be positive"),
    ],
)
def test_bad_hyperparameters(make: Callable[[], Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        # Compared with 0 as they were, these said only "'>=' not supported between instances
        # of 'str' and 'int'", naming neither the optimizer nor the hyperparameter.
        (
            lambda: optim.sgd("0.1"),
            TypeError,
            r"^fdp\.optim\.sgd: lr must be a non-negative number or a Schedule \(a function of the steps "
            r"taken\), got str: '0\.1'$",
        ),
        (
            lambda: optim.adam(None),
            TypeError,
            r"^fdp\.optim\.adam: lr must be a non-negative number or a Schedule \(a function of the "
            r"steps taken\), got NoneType: None$",
        ),
        (
            lambda: optim.sgd(torch.tensor([0.1])),
            TypeError,
            r"^fdp\.optim\.sgd: lr must be a non-negative number or a Schedule \(a function of the steps "
            r"taken\), got Tensor: ",
        ),
        (
            lambda: optim.adamw([1e-3]),
            TypeError,
            r"^fdp\.optim\.adamw: lr must be a non-negative number or a Schedule \(a function of the "
            r"steps taken\), got list: \[0\.001\]$",
        ),
        # True >= 0: a bool stepped at lr 1 (or momentum 1), as torch.optim takes it.
        (
            lambda: optim.sgd(True),
            TypeError,
            r"^fdp\.optim\.sgd: lr must be a non-negative number or a Schedule \(a function of the steps "
            r"taken\), got bool: True$",
        ),
        (
            lambda: optim.sgd(0.1, momentum=True),
            TypeError,
            r"^fdp\.optim\.sgd: momentum must be a non-negative number, got bool: True$",
        ),
        (
            lambda: optim.sgd(0.1, momentum=0.9, dampening=True),
            TypeError,
            r"^fdp\.optim\.sgd: dampening must be a number, got bool: True$",
        ),
        (
            lambda: optim.sgd(0.1, momentum="0.9"),
            TypeError,
            r"^fdp\.optim\.sgd: momentum must be a non-negative number, got str: '0\.9'$",
        ),
        (
            lambda: optim.adam(eps=torch.ones(2)),
            TypeError,
            r"^fdp\.optim\.adam: eps must be a non-negative number, got Tensor: tensor\(\[1\., 1\.\]\)$",
        ),
        # Unpacked as they were: "cannot unpack non-iterable float object", "too many values".
        (
            lambda: optim.adam(betas=0.9),
            TypeError,
            r"^fdp\.optim\.adam: betas must be a pair of numbers in \[0, 1\), got float: 0\.9$",
        ),
        (
            lambda: optim.adamw(betas=(0.9, 0.99, 0.1)),
            ValueError,
            r"^fdp\.optim\.adamw: betas must be a pair of numbers in \[0, 1\), "
            r"got tuple: \(0\.9, 0\.99, 0\.1\)$",
        ),
        (
            lambda: optim.adam(betas=("0.9", 0.99)),
            TypeError,
            r"^fdp\.optim\.adam: betas must be a pair of numbers in \[0, 1\), got tuple: \('0\.9', 0\.99\)$",
        ),
        # Read as truth values, "no" would have turned them on.
        (
            lambda: optim.adam(amsgrad="no"),
            TypeError,
            r"^fdp\.optim\.adam: amsgrad must be True or False, got str: 'no'$",
        ),
        (
            lambda: optim.sgd(0.1, maximize=1),
            TypeError,
            r"^fdp\.optim\.sgd: maximize must be True or False, got int: 1$",
        ),
        (
            lambda: optim.adamw(maximize=None),
            TypeError,
            r"^fdp\.optim\.adamw: maximize must be True or False, got NoneType: None$",
        ),
        # nesterov="no" turned Nesterov momentum on (with momentum=0: refused for the momentum).
        (
            lambda: optim.sgd(0.1, momentum=0.9, nesterov="no"),
            TypeError,
            r"^fdp\.optim\.sgd: nesterov must be True or False, got str: 'no'$",
        ),
        # Taken, and failed on at the second step in torch's words (as in torch.optim.SGD).
        (
            lambda: optim.sgd(0.1, momentum=0.9, dampening="0.1"),
            TypeError,
            r"^fdp\.optim\.sgd: dampening must be a number, got str: '0\.1'$",
        ),
        (
            lambda: optim.clip_by_global_norm("1"),
            TypeError,
            r"^fdp\.optim\.clip_by_global_norm: max_norm must be a positive number, got str: '1'$",
        ),
        # The factory itself, not called: "'function' object has no attribute 'init'" on first use.
        (
            lambda: optim.chain(optim.clip_by_global_norm, optim.adam()),
            TypeError,
            r"^fdp\.optim\.chain: transforms\[0\] must be a GradientTransformation \(an init, update pair "
            r"such as fdp\.optim\.adam\(1e-3\)\), got function: <function clip_by_global_norm",
        ),
        (
            lambda: optim.chain([optim.sgd(0.1)]),
            TypeError,
            r"^fdp\.optim\.chain: transforms\[0\] must be a GradientTransformation .*, got list: \[",
        ),
    ],
)
def test_hyperparameters_of_the_wrong_type_are_named(
    make: Callable[[], Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-0.1, ValueError, r"^fdp\.optim\.sgd: lr, a schedule, at step 2, must be non-negative, got -0\.1$"),
        (
            math.nan,
            ValueError,
            r"^fdp\.optim\.sgd: lr, a schedule, at step 2, must be non-negative, got nan$",
        ),
        (
            "0.1",
            TypeError,
            r"^fdp\.optim\.sgd: lr, a schedule, at step 2, must be a non-negative number, got str: '0\.1'$",
        ),
        (
            torch.tensor([0.1]),
            TypeError,
            r"^fdp\.optim\.sgd: lr, a schedule, at step 2, must be a non-negative number, got Tensor: ",
        ),
    ],
)
@pytest.mark.parametrize("one_pass", [False, True], ids=["update", "apply_gradients"])
def test_a_schedule_value_torch_optim_would_refuse_is_named_with_its_step(
    value: Any, error: type, match: str, one_pass: bool
) -> None:
    # A negative rate steps uphill and NaN poisons every parameter, silently: the schedule is
    # a function of the step, so its value is checked when the step takes it.
    opt = optim.sgd(lambda step: 0.1 if step < 2 else value)
    params, grads = {"w": torch.ones(2)}, {"w": torch.ones(2)}
    state = opt.init(params)
    for _ in range(2):
        params, state = opt.apply_gradients(grads, state, params)
    with pytest.raises(error, match=match):
        opt.apply_gradients(grads, state, params) if one_pass else opt.update(grads, state, params)


def test_a_schedule_is_given_the_steps_taken_before() -> None:
    seen: list[int] = []
    opt = optim.adam(lambda step: seen.append(step) or 1e-3)
    params = {"w": torch.ones(2)}
    state = opt.init(params)
    for _ in range(3):
        params, state = opt.apply_gradients({"w": torch.ones(2)}, state, params)
    assert seen == [0, 1, 2] and state.step == 3


_ONE = [torch.zeros(1, requires_grad=True)]


@pytest.mark.parametrize(
    ("make", "make_torch", "match"),
    [
        (
            lambda: optim.sgd(0.1, momentum=-0.5),
            lambda: torch.optim.SGD(_ONE, 0.1, momentum=-0.5),
            "momentum",
        ),
        (
            lambda: optim.sgd(0.1, weight_decay=-1.0),
            lambda: torch.optim.SGD(_ONE, 0.1, weight_decay=-1.0),
            "weight_decay",
        ),
        (lambda: optim.adam(-1e-3), lambda: torch.optim.Adam(_ONE, -1e-3), "lr"),
        (lambda: optim.adam(eps=-1e-8), lambda: torch.optim.Adam(_ONE, eps=-1e-8), "eps"),
        (lambda: optim.adam(eps=float("nan")), lambda: torch.optim.Adam(_ONE, eps=float("nan")), "eps"),
        (
            lambda: optim.adam(weight_decay=-0.1),
            lambda: torch.optim.Adam(_ONE, weight_decay=-0.1),
            "weight_decay",
        ),
        (lambda: optim.adamw(eps=-1e-8), lambda: torch.optim.AdamW(_ONE, eps=-1e-8), "eps"),
        (
            lambda: optim.adamw(weight_decay=-0.1),
            lambda: torch.optim.AdamW(_ONE, weight_decay=-0.1),
            "weight_decay",
        ),
    ],
)
def test_hyperparameters_torch_optim_refuses(
    make: Callable[[], Any], make_torch: Callable[[], Any], match: str
) -> None:
    with pytest.raises(ValueError):
        make_torch()  # the oracle
    with pytest.raises(ValueError, match=rf"fdp\.optim\.\w+: {match} must be non-negative, got "):
        make()


@pytest.mark.parametrize(
    ("momentum", "dampening"),
    [(0.0, 0.0), (-0.0, 0.0), (0.9, 0.1), (0.9, -0.1), (0.9, -0.0), (0.9, math.nan), (1e-9, 0.0)],
)
def test_nesterov_is_refused_where_torch_optim_refuses_it(momentum: float, dampening: float) -> None:
    one = [torch.zeros(1, requires_grad=True)]
    try:
        torch.optim.SGD(one, 0.1, momentum=momentum, dampening=dampening, nesterov=True)
    except ValueError:
        with pytest.raises(ValueError, match=r"^fdp\.optim\.sgd: (nesterov=True needs|dampening must be)"):
            optim.sgd(0.1, momentum=momentum, dampening=dampening, nesterov=True)
    else:
        optim.sgd(0.1, momentum=momentum, dampening=dampening, nesterov=True)


def test_flags_take_numpy_bools_as_torch_optim_does() -> None:
    # A comparison of NumPy values (maximize=score_sign < 0) gives np.bool_, which torch.optim
    # takes and fdp refused as "not True or False".
    numpy = pytest.importorskip("numpy")
    for name in ("sgd_nesterov_weight_decay", "sgd_maximize_momentum_weight_decay", "adamw_amsgrad_maximize"):
        make_torch, _ = CONFIGS[name]
        flags = {"nesterov": "nesterov" in name, "maximize": "maximize" in name, "amsgrad": "amsgrad" in name}
        flags = {k: v for k, v in flags.items() if v}
        numpy_flags = {k: numpy.bool_(v) for k, v in flags.items()}
        if name.startswith("sgd"):
            opt = optim.sgd(0.05, momentum=0.9, weight_decay=1e-2, **numpy_flags)
        else:
            opt = optim.adamw(1e-2, weight_decay=0.1, **numpy_flags)
        torch.manual_seed(0)
        initial = {"w": torch.randn(3, 2), "b": torch.randn(2)}
        reference = {k: v.clone().requires_grad_() for k, v in initial.items()}
        torch_opt = make_torch(list(reference.values()))
        params, state = dict(initial), opt.init(initial)
        for _ in range(5):
            grads = {k: torch.randn_like(v) for k, v in initial.items()}
            for k, p in reference.items():
                p.grad = grads[k].clone()
            torch_opt.step()
            params, state = opt.apply_gradients(grads, state, params)
        for k in params:
            assert torch.equal(params[k], reference[k].detach()), (name, k)
    assert fdp_tree.check_flag(numpy.bool_(False), "f: x") is False  # a bool, not a NumPy one


def test_clip_by_global_norm_matches_clip_grad_norm_for_tiny_norms() -> None:
    # Where the norm is of the order of clip_grad_norm_'s 1e-6, its exact formula shows.
    grads = {"g": torch.tensor([3e-6, 4e-6])}
    clip = optim.clip_by_global_norm(1e-6)
    clipped, _ = clip.update(grads, clip.init(None))
    reference = torch.zeros(2, requires_grad=True)
    reference.grad = grads["g"].clone()
    torch.nn.utils.clip_grad_norm_([reference], 1e-6)
    torch.testing.assert_close(clipped["g"], reference.grad, atol=0, rtol=1e-5)


@pytest.mark.parametrize(
    ("scalar", "wide"),
    [
        (torch.float32, torch.float64),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.complex64, torch.float64),
    ],
    ids=["float32-float64", "bfloat16-float32", "float16-float32", "complex64-float64"],
)
def test_clip_by_global_norm_keeps_each_gradients_dtype(scalar: torch.dtype, wide: torch.dtype) -> None:
    # clip_grad_norm_ scales in place: a 0-dim gradient beside gradients of a wider dtype keeps
    # its dtype (out of place, it would promote with the 0-dim scale, and an optimizer after the
    # clip refuse a gradient of another dtype than its parameter's).
    torch.manual_seed(0)
    grads = {"scale": torch.randn((), dtype=scalar), "w": 3 * torch.randn(4, dtype=wide)}
    clip = optim.clip_by_global_norm(0.5)
    clipped, _ = clip.update(grads, clip.init(None))
    references = [torch.zeros_like(g).requires_grad_() for g in grads.values()]
    for reference, g in zip(references, grads.values()):
        reference.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(references, 0.5)
    for (k, mine), reference in zip(clipped.items(), references):
        assert mine.dtype == grads[k].dtype, k
        assert torch.equal(mine, reference.grad), k
    params = {k: torch.zeros_like(g) for k, g in grads.items()}
    opt = optim.chain(clip, optim.sgd(0.1))
    new, _ = opt.apply_gradients(grads, opt.init(params), params)
    assert {k: v.dtype for k, v in new.items()} == {k: v.dtype for k, v in params.items()}


def test_chain_refuses_a_state_of_another_length() -> None:
    params = {"w": torch.ones(2)}
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1))
    short = opt.init(params)[1:]
    # "fdp.optim.chain: expected 2 states, got 1" named neither the call nor the state.
    for call in ("update", "apply_gradients"):
        with pytest.raises(
            ValueError,
            match=rf"^fdp\.optim\.chain: {call} got a state of 1 states, expected 2 \(one per "
            r"transformation\): the state must come from this chain's init\(params\) or its last step$",
        ):
            getattr(opt, call)(params, short, params)


@pytest.mark.parametrize("one_pass", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize(
    ("make_state", "kind"),
    [
        (lambda p: optim.adam().init(p), "AdamState"),  # a named tuple of 4 for a chain of 4
        (lambda p: None, "NoneType"),
        (lambda p: p, "dict"),
    ],
    ids=["an-optimizers-state", "none", "params"],
)
def test_chain_refuses_a_state_that_is_not_a_chains(
    make_state: Callable[[Any], Any], kind: str, one_pass: bool
) -> None:
    # len() of None failed naming nothing; an AdamState was dealt out to the transforms field by field.
    params = {"w": torch.ones(2)}
    opt = optim.chain(
        optim.clip_by_global_norm(1.0), optim.sgd(0.1, momentum=0.9), optim.sgd(0.1), optim.sgd(0.2)
    )
    call = "apply_gradients" if one_pass else "update"
    with pytest.raises(
        ValueError,
        match=rf"^fdp\.optim\.chain: {call} got a state of type {kind}, expected a tuple of 4 states "
        r"\(one per transformation\): the state must come from this chain's init\(params\) or its last "
        r"step$",
    ):
        (opt.apply_gradients if one_pass else opt.update)(params, make_state(params), params)


@pytest.mark.parametrize("path", ["update", "apply_gradients"])
def test_first_momentum_is_a_copy_of_the_gradients(path: str) -> None:
    # As torch.optim.SGD's momentum_buffer (torch.clone(grad)): zeroing the gradients in place
    # afterwards, as zero_grad(set_to_none=False) does, leaves the momentum alone.
    params, grads = {"w": torch.ones(2)}, {"w": torch.ones(2)}
    opt = optim.sgd(0.1, momentum=0.9)
    if path == "update":
        _, state = opt.update(grads, opt.init(params), params)
    else:
        _, state = opt.apply_gradients(grads, opt.init(params), params)
    weight = torch.ones(2, requires_grad=True)
    reference = torch.optim.SGD([weight], 0.1, momentum=0.9)
    weight.grad = torch.ones(2)
    reference.step()
    grads["w"].zero_()
    weight.grad.zero_()
    assert torch.equal(state.momentum["w"], reference.state[weight]["momentum_buffer"])


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.sgd(0.1, momentum=0.9),
        optim.adam,
        optim.adamw,
        lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1)),
        lambda: optim.multi_transform({"a": optim.adam(), "b": optim.sgd(0.1)}, lambda params: "a"),
    ],
)
@pytest.mark.parametrize("path", ["update", "apply_gradients"])
def test_one_step_from_params_that_require_grad_records_no_graph(make: Callable[[], Any], path: str) -> None:
    # Each way of stepping on its own: the first step's outputs no longer require grad, so a
    # loop of steps would test only its first.
    params = {"w": torch.ones(3, requires_grad=True)}
    opt = make()
    step = getattr(opt, path)
    out, state = step({"w": torch.ones(3)}, opt.init(params), params)
    leaves = [t for t in optree.tree_leaves((out, state)) if isinstance(t, torch.Tensor)]
    assert leaves and all(t.grad_fn is None and not t.requires_grad for t in leaves)


def test_update_needs_params() -> None:
    opt = optim.adam()
    with pytest.raises(ValueError, match="fdp.optim.adam needs the params"):
        opt.update({"w": torch.ones(1)}, opt.init({"w": torch.ones(1)}))


def test_params_that_require_grad_grow_no_graph() -> None:
    model, loss = problem()
    params = dict(model.named_parameters())  # requires_grad=True
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1, momentum=0.9))
    state = opt.init(params)
    for k in range(4):
        grads = torch.func.grad(loss)(params)
        if k % 2:
            params, state = opt.apply_gradients(grads, state, params)
        else:
            updates, state = opt.update(grads, state, params)
            params = optim.apply_updates(params, updates)
    leaves = [t for t in optree.tree_leaves((params, state)) if isinstance(t, torch.Tensor)]
    assert all(t.grad_fn is None for t in leaves)


def test_structure_check_runs_outside_the_graph_under_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    # While compiling, the check runs on the trees in eager code (torch 2.11's dynamo cannot
    # compare two specs); it must still catch a mismatch there.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    params = {"a": torch.ones(2), "b": torch.ones(3)}
    assert optim.apply_updates(params, {"a": torch.ones(2), "b": torch.ones(3)})["b"].tolist() == [2.0] * 3
    with pytest.raises(ValueError, match="apply_updates: params are"):
        optim.apply_updates(params, {"a": torch.ones(2), "c": torch.ones(3)})
    opt = optim.sgd(0.1, momentum=0.9)
    with pytest.raises(ValueError, match="apply_gradients got params"):
        opt.apply_gradients({"a": torch.ones(2), "c": torch.ones(3)}, opt.init(params), params)
    with pytest.raises(ValueError, match="update got params"):
        opt.update({"a": torch.ones(2), "c": torch.ones(3)}, opt.init(params), params)
    with pytest.raises(ValueError, match="state whose momentum is"):
        opt.apply_gradients(params, opt.init({"a": torch.ones(2)}), params)
    # Trees alike in keys and leaf count but not in node types, node by node.
    for unlike in (
        OrderedDict(params),
        {"a": torch.ones(2), "b": (torch.ones(3),)},
        {"a": [torch.ones(2)], "b": torch.ones(3)},
    ):
        with pytest.raises(ValueError, match="apply_gradients got params"):
            opt.apply_gradients(unlike, opt.init(params), params)
    nested = {"a": {"x": torch.ones(2)}, "b": None, "c": torch.ones(3)}
    for unlike in (
        {"a": {"y": torch.ones(2)}, "b": None, "c": torch.ones(3)},
        {"a": {"x": torch.ones(2)}, "b": torch.ones(3), "c": None},
    ):
        with pytest.raises(ValueError, match="apply_gradients got (params|grads)"):
            opt.apply_gradients(unlike, opt.init(nested), nested)
    with pytest.raises(
        ValueError, match=r"apply_gradients got state\.momentum\['a'\] of dtype torch\.float64"
    ):
        opt.apply_gradients(params, opt.init({k: v.double() for k, v in params.items()}), params)
    with pytest.raises(ValueError, match="update got a state of type AdamState"):
        opt.update(params, optim.adam().init(params), params)
    with pytest.raises(ValueError, match=r"apply_gradients got grads\['b'\] of shape \(3, 1\)"):
        opt.apply_gradients({"a": torch.ones(2), "b": torch.ones(3, 1)}, opt.init(params), params)
    with pytest.raises(ValueError, match=r"update got grads\['b'\] of dtype torch.float64"):
        opt.update({"a": torch.ones(2), "b": torch.ones(3, dtype=torch.float64)}, opt.init(params), params)
    with pytest.raises(ValueError, match=r"apply_updates: got updates\['a'\] of shape \(1,\)"):
        optim.apply_updates(params, {"a": torch.ones(1), "b": torch.ones(3)})
    cast = optim.apply_updates(params, {"a": torch.ones(2), "b": torch.ones(3, dtype=torch.float64)})
    assert cast["b"].dtype == torch.float32 and cast["b"].tolist() == [2.0] * 3
    new, state = opt.apply_gradients(params, opt.init(params), params)
    torch.testing.assert_close(new["b"], torch.full((3,), 0.9))
    torch.testing.assert_close(state.momentum["b"], torch.ones(3))


def test_an_adam_state_saved_before_amsgrad_loads_and_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # AdamState had three fields before max_exp_avg_sq: a checkpoint of one holds three.
    params = {"w": torch.tensor([1.0, -2.0])}
    opt = optim.adam(0.1)
    _, state = opt.apply_gradients({"w": torch.tensor([0.5, 0.5])}, opt.init(params), params)
    buffer = io.BytesIO()
    with monkeypatch.context() as patched:
        patched.setattr(optim.AdamState, "__getnewargs__", lambda self: tuple(self)[:3])
        torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded.step == state.step and loaded.max_exp_avg_sq is None
    assert torch.equal(loaded.exp_avg["w"], state.exp_avg["w"])
    assert torch.equal(loaded.exp_avg_sq["w"], state.exp_avg_sq["w"])
    grads = {"w": torch.tensor([1.0, 1.0])}
    assert torch.equal(
        opt.apply_gradients(grads, loaded, params)[0]["w"], opt.apply_gradients(grads, state, params)[0]["w"]
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_states_round_trip_through_torch_save_with_weights_only(name: str) -> None:
    # torch.load's default since torch 2.6 is weights_only=True: a checkpoint of fdp.optim's
    # state must load with it, and the resumed steps continue the uninterrupted ones bit for bit.
    model, loss = problem()
    opt = CONFIGS[name][1]()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    params["0.weight"] = params["0.weight"].to(torch.bfloat16)  # dtypes survive the round trip
    bf16_loss = lambda p: loss({**p, "0.weight": p["0.weight"].float()})  # noqa: E731
    state = opt.init(params)
    for _ in range(3):
        params, state = opt.apply_gradients(torch.func.grad(bf16_loss)(params), state, params)
    buffer = io.BytesIO()
    torch.save({"params": params, "opt": state}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded["opt"]) is type(state)
    leaves, spec = optree.tree_flatten(state, namespace="fdp")
    loaded_leaves, loaded_spec = optree.tree_flatten(loaded["opt"], namespace="fdp")
    assert loaded_spec == spec
    for a, b in zip(leaves, loaded_leaves):
        assert type(a) is type(b)
        assert torch.equal(a, b) and a.dtype == b.dtype if isinstance(a, torch.Tensor) else a == b
    resumed, resumed_state = loaded["params"], loaded["opt"]
    for _ in range(3):
        params, state = opt.apply_gradients(torch.func.grad(bf16_loss)(params), state, params)
        resumed, resumed_state = opt.apply_gradients(
            torch.func.grad(bf16_loss)(resumed), resumed_state, resumed
        )
    assert all(torch.equal(params[k], resumed[k]) for k in params)
    assert optree.tree_all(
        optree.tree_map(
            lambda a, b: a == b if not isinstance(a, torch.Tensor) else torch.equal(a, b),
            state,
            resumed_state,
            namespace="fdp",
        )
    )


# --- parameter groups: multi_transform ------------------------------------------------------


def nested_problem() -> tuple[dict[str, dict[str, torch.Tensor]], Callable[[Any], torch.Tensor]]:
    """A backbone and a head, as nested dicts of parameters."""
    torch.manual_seed(0)
    params = {
        "backbone": {"w": torch.randn(6, 8), "b": torch.randn(8)},
        "head": {"w": torch.randn(8, 2), "b": torch.randn(2)},
    }
    x, y = torch.randn(16, 6), torch.randn(16, 2)

    def loss(p: Any) -> torch.Tensor:
        hidden = torch.tanh(x @ p["backbone"]["w"] + p["backbone"]["b"])
        return ((hidden @ p["head"]["w"] + p["head"]["b"] - y) ** 2).mean()

    return params, loss


def run(
    opt: optim.GradientTransformation, params: Any, loss: Callable[[Any], torch.Tensor], steps: int = 5
) -> Any:
    """``steps`` one-pass steps of ``opt`` from ``params``: the params and the state."""
    state = opt.init(params)
    for _ in range(steps):
        params, state = opt.apply_gradients(torch.func.grad(loss)(params), state, params)
    return params, state


def assert_trees_equal(a: Any, b: Any) -> None:
    leaves, spec = optree.tree_flatten(a, namespace="fdp")
    other, other_spec = optree.tree_flatten(b, namespace="fdp")
    assert spec == other_spec
    for x, y in zip(leaves, other):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


@pytest.mark.parametrize(
    "labels",
    [
        {"backbone": {"w": "slow", "b": "slow"}, "head": {"w": "fast", "b": "fast"}},
        {"backbone": "slow", "head": "fast"},  # a prefix: one label for a whole subtree
        lambda params: {name: "slow" if name == "backbone" else "fast" for name in params},
    ],
    ids=["tree", "prefix", "function"],
)
def test_multi_transform_labels_as_a_tree_a_prefix_or_a_function(labels: Any) -> None:
    # A smaller rate for a pretrained backbone: each part steps as its optimizer alone would.
    params, loss = nested_problem()
    opt = optim.multi_transform({"slow": optim.adamw(1e-3), "fast": optim.sgd(0.1, momentum=0.9)}, labels)
    new, state = run(opt, params, loss)
    assert isinstance(state, optim.MultiTransformState) and list(state.inner_states) == ["slow", "fast"]
    # Each part stepped by its optimizer alone, with its share of the whole loss's gradients.
    slow, fast = optim.adamw(1e-3), optim.sgd(0.1, momentum=0.9)
    expected, slow_state, fast_state = params, slow.init(params["backbone"]), fast.init(params["head"])
    for _ in range(5):
        grads = torch.func.grad(loss)(expected)
        backbone, slow_state = slow.apply_gradients(grads["backbone"], slow_state, expected["backbone"])
        head, fast_state = fast.apply_gradients(grads["head"], fast_state, expected["head"])
        expected = {"backbone": backbone, "head": head}
    assert_trees_equal(new, expected)
    assert state.inner_states["slow"].step == state.inner_states["fast"].step == 5
    assert_trees_equal(state.inner_states["slow"].exp_avg["backbone"], slow_state.exp_avg)
    assert optree.tree_leaves(state.inner_states["slow"].exp_avg["head"]) == []  # None at its leaves
    assert_trees_equal(state.inner_states["fast"].momentum["head"], fast_state.momentum)


@pytest.mark.parametrize("one_pass", [False, True], ids=["update_apply_updates", "apply_gradients"])
def test_multi_transform_of_one_label_for_all_is_that_transformation(one_pass: bool) -> None:
    params, loss = nested_problem()
    alone, inner = optim.adam(1e-2, weight_decay=1e-3), optim.adam(1e-2, weight_decay=1e-3)
    opt = optim.multi_transform({"all": inner}, "all")  # a label at the root: a prefix of any tree
    a, a_state, b, b_state = params, alone.init(params), params, opt.init(params)
    for _ in range(5):
        if one_pass:
            a, a_state = alone.apply_gradients(torch.func.grad(loss)(a), a_state, a)
            b, b_state = opt.apply_gradients(torch.func.grad(loss)(b), b_state, b)
        else:
            updates, a_state = alone.update(torch.func.grad(loss)(a), a_state, a)
            a = optim.apply_updates(a, updates)
            updates, b_state = opt.update(torch.func.grad(loss)(b), b_state, b)
            b = optim.apply_updates(b, updates)
    assert_trees_equal(a, b)
    assert_trees_equal(a_state, b_state.inner_states["all"])


def test_multi_transform_masks_each_part_without_a_labels_leaves_with_one_none() -> None:
    # A whole subtree of the other labels' leaves is one None in a label's trees (and state), not
    # a dict of Nones, which compiled steps failed to rebuild (tests/test_compile.py); the root
    # stays a dict, for a label that labels nothing too.
    seen: dict[str, list[Any]] = {}

    def recording(label: str) -> optim.GradientTransformation:
        def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
            seen.setdefault(label, []).extend([grads, params])
            return optree.tree_map(torch.zeros_like, grads, namespace="fdp"), state

        return optim.GradientTransformation(lambda params: seen.setdefault(label, []).append(params), update)

    def tree(value: float) -> Any:
        def full(size: int) -> torch.Tensor:
            return torch.full((size,), value)

        return {
            "backbone": {"stem": {"w": full(2), "b": full(1)}, "block": {"w": full(3), "b": full(1)}},
            "head": {"w": full(4)},
        }

    params, grads = tree(1.0), tree(2.0)
    labels = {"backbone": {"stem": "a", "block": {"w": "b", "b": "a"}}, "head": "b"}
    opt = optim.multi_transform({"a": recording("a"), "b": recording("b"), "c": recording("c")}, labels)
    opt.apply_gradients(grads, opt.init(params), params)

    def masked(t: Any, label: str) -> Any:
        stem, block = t["backbone"]["stem"], t["backbone"]["block"]
        if label == "a":
            return {"backbone": {"stem": stem, "block": {"w": None, "b": block["b"]}}, "head": None}
        if label == "b":
            return {"backbone": {"stem": None, "block": {"w": block["w"], "b": None}}, "head": t["head"]}
        return {"backbone": None, "head": None}

    for label in "abc":
        init_params, step_grads, step_params = seen[label]
        assert_trees_equal(init_params, masked(params, label))
        assert_trees_equal(step_grads, masked(grads, label))
        assert_trees_equal(step_params, masked(params, label))
    # fdp's optimizers keep their state in the same shape.
    momentum = optim.multi_transform(
        {
            "a": optim.sgd(0.1, momentum=0.9),
            "b": optim.sgd(0.1, momentum=0.9),
            "c": optim.sgd(0.1, momentum=0.9),
        },
        labels,
    )
    zeros = optree.tree_map(torch.zeros_like, params, namespace="fdp")
    for label, inner in momentum.init(params).inner_states.items():
        assert_trees_equal(inner.momentum, masked(zeros, label))


def test_multi_transform_steps_a_label_that_labels_no_parameter() -> None:
    # As torch.optim steps every group: its count (and schedule) go on with the others'.
    seen: list[int] = []
    opt = optim.multi_transform(
        {"train": optim.sgd(0.1), "unused": optim.adam(lambda step: seen.append(step) or 1e-3)},
        lambda params: "train",
    )
    params = {"w": torch.ones(2)}
    new, state = run(opt, params, lambda p: p["w"].sum(), steps=3)
    assert seen == [0, 1, 2] and state.inner_states["unused"].step == 3
    assert optree.tree_leaves(state.inner_states["unused"]) == [3]  # no moments: no parameters
    torch.testing.assert_close(new["w"], torch.full((2,), 0.7))


def test_multi_transform_matches_labels_to_parameters_by_key() -> None:
    # An OrderedDict's leaves come in its order, not sorted: labels in another order, or in a
    # plain dict, must still reach their parameters by key.
    from collections import OrderedDict

    params = OrderedDict([("z", torch.ones(2)), ("a", torch.ones(3))])
    grads = OrderedDict([("z", torch.ones(2)), ("a", torch.ones(3))])
    transforms = {"move": optim.sgd(1.0), "keep": optim.sgd(0.0)}
    for labels in (OrderedDict([("a", "move"), ("z", "keep")]), {"a": "move", "z": "keep"}):
        opt = optim.multi_transform(transforms, labels)
        new, _ = opt.apply_gradients(grads, opt.init(params), params)
        assert type(new) is OrderedDict and list(new) == ["z", "a"]
        assert new["z"].tolist() == [1.0, 1.0] and new["a"].tolist() == [0.0, 0.0, 0.0]
        updates, _ = opt.update(grads, opt.init(params), params)
        assert updates["z"].tolist() == [0.0, 0.0] and updates["a"].tolist() == [-1.0] * 3


def test_multi_transform_with_a_transformation_of_ones_own_in_a_group() -> None:
    # A label whose transformation has no one-pass step gets update then apply_updates; the
    # others still step in one pass.
    halve = optim.GradientTransformation(
        lambda params: optim.EmptyState(),
        lambda grads, state, params=None: (
            optree.tree_map(lambda g: -0.5 * g, grads, namespace="fdp"),
            state,
        ),
    )
    opt = optim.multi_transform({"mine": halve, "adam": optim.adam(0.1)}, {"w": "mine", "b": "adam"})
    params, grads = {"w": torch.ones(2), "b": torch.ones(1)}, {"w": torch.ones(2), "b": torch.ones(1)}
    new, state = opt.apply_gradients(grads, opt.init(params), params)
    updates, expected_state = opt.update(grads, opt.init(params), params)
    assert_trees_equal(new, optim.apply_updates(params, updates))
    assert_trees_equal(state, expected_state)
    assert new["w"].tolist() == [0.5, 0.5]
    torch.testing.assert_close(new["b"], torch.full((1,), 0.9))


def test_multi_transform_update_without_params() -> None:
    # Transformations that need no parameters (clipping): a function of the labels is then
    # called with the gradients, and each label's gradients are clipped on their own norm.
    called_with: list[Any] = []

    def labels(tree: Any) -> dict[str, str]:
        called_with.append(tree)
        return {"w": "tight", "b": "loose"}

    opt = optim.multi_transform(
        {"tight": optim.clip_by_global_norm(1.0), "loose": optim.clip_by_global_norm(100.0)}, labels
    )
    grads = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([3.0, 4.0])}
    clipped, _ = opt.update(grads, opt.init(grads))
    assert called_with[-1] is grads
    torch.testing.assert_close(clipped["w"], torch.tensor([0.6, 0.8]))
    assert torch.equal(clipped["b"], grads["b"])


def test_multi_transform_under_pmap_with_resident_state_matches_one_device() -> None:
    # The state lives on the replicas (PerReplica), goes through pmap and back to one device
    # with fdp.unreplicate; inside a chain, with a schedule for one label.
    from helpers import cpus

    import fdp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    params = {k: v.detach() for k, v in model.named_parameters()}
    batches = [(torch.randn(32, 6), torch.randn(32, 2)) for _ in range(10)]
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.multi_transform(
            {
                "decay": optim.adamw(lambda k: 1e-2 * warmup_cosine(k), weight_decay=0.1),
                "no_decay": optim.sgd(0.05, momentum=0.9),
            },
            by_dim,
        ),
    )

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # (fdp's functional_call: torch.func's swaps the module's parameters, which the
        # replicas' threads share.)
        return ((fdp.functional_call(model, p, (x,)) - y) ** 2).mean()

    @fdp.pmap(axis_name="batch", devices=cpus(2), out_axes=fdp.PER_REPLICA)
    def step(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> Any:
        grads = fdp.pmean(torch.func.grad(loss)(state["params"], x, y), "batch", weight=x.shape[0])
        new, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
        return {"params": new, "opt": opt_state}

    resident = fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, cpus(2))
    single, single_state = params, opt.init(params)
    for x, y in batches:
        resident = step(resident, x, y)
        single, single_state = opt.apply_gradients(torch.func.grad(loss)(single, x, y), single_state, single)
    replicas = [fdp.unreplicate(resident, r) for r in range(2)]
    assert_trees_equal(replicas[0], replicas[1])  # the replicas agree bit for bit
    ours = replicas[0]
    assert isinstance(ours["opt"][1], optim.MultiTransformState)
    assert steps_of(ours["opt"]) == [10, 10]
    assert optree.tree_structure(ours["opt"], namespace="fdp") == optree.tree_structure(
        single_state, namespace="fdp"
    )
    # The mean of the shards' gradients is the whole batch's to rounding.
    for mine, theirs in zip(
        optree.tree_leaves(ours, namespace="fdp"),
        optree.tree_leaves({"params": single, "opt": single_state}, namespace="fdp"),
    ):
        if isinstance(mine, torch.Tensor):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
        else:
            assert mine == theirs


TWO = {"slow": optim.adamw(1e-3), "fast": optim.sgd(0.1)}


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: optim.multi_transform([optim.adam()], {"w": 0}),  # type: ignore[arg-type]
            TypeError,
            r"^fdp\.optim\.multi_transform: transforms must be a mapping from labels to "
            r"GradientTransformations \(e\.g\. \{'decay': fdp\.optim\.adamw\(1e-3\)\}\), got list: \[",
        ),
        (
            lambda: optim.multi_transform({"decay": optim.adamw}, "decay"),  # the factory, not called
            TypeError,
            r"^fdp\.optim\.multi_transform: transforms\['decay'\] must be a GradientTransformation "
            r"\(an init, update pair such as fdp\.optim\.adam\(1e-3\)\), got function: <function adamw",
        ),
        (
            lambda: optim.multi_transform({}, "decay"),
            ValueError,
            r"^fdp\.optim\.multi_transform: transforms is empty: give the transformation of each label$",
        ),
        # A typo in a label: known when the labels are given.
        (
            lambda: optim.multi_transform(TWO, {"backbone": "slow", "head": {"w": "fats", "b": "fast"}}),
            ValueError,
            r"^fdp\.optim\.multi_transform got param_labels\['head'\]\['w'\] = 'fats', a label with no "
            r"transformation: transforms has the labels \['slow', 'fast'\]$",
        ),
        (
            lambda: optim.multi_transform(TWO, {"backbone": "slow", "head": {"slow"}}),  # unhashable
            ValueError,
            r"^fdp\.optim\.multi_transform got param_labels\['head'\] = \{'slow'\}, a label with no ",
        ),
    ],
    ids=["not-a-mapping", "not-a-transformation", "empty", "unknown-label", "unhashable-label"],
)
def test_multi_transform_refuses_what_cannot_be_groups(
    make: Callable[[], Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("call", ["init", "update", "apply_gradients"])
@pytest.mark.parametrize(
    ("labels", "match"),
    [
        (
            lambda params: {"backbone": "slow", "head": "fats"},
            r"got param_labels\(params\)\['head'\] = 'fats', a label with no transformation: transforms "
            r"has the labels \['slow', 'fast'\]$",
        ),
        (
            lambda params: {"backbone": "slow", "head": {"w": "fast"}},
            r"got param_labels\(params\) unlike params: the labels must be a tree of params' structure "
            r"with a label at each leaf, or a prefix of it \(one label for a whole subtree\)\.\n"
            r"pytree structure error: different pytree keys at key path\n"
            r"    param_labels\(params\)\['head'\]",
        ),
        (
            {"backbone": "slow", "head": {"w": "fast"}},
            r"got param_labels unlike params: .*\n.*\n    param_labels\['head'\]\n",
        ),
        (
            {"backbone": "slow", "head": None},  # None is no label (an empty node to optree)
            r"got param_labels unlike params: .*\n.*different types at key path\n    param_labels\['head'\]",
        ),
    ],
    ids=["function-unknown-label", "function-unlike-params", "tree-unlike-params", "none-as-a-label"],
)
def test_multi_transform_names_the_label_that_does_not_fit(labels: Any, match: str, call: str) -> None:
    params, _ = nested_problem()
    if call == "init":
        opt = optim.multi_transform(TWO, labels)
        with pytest.raises(ValueError, match=r"^fdp\.optim\.multi_transform: init " + match):
            opt.init(params)
        return
    # Labels that fit at init and not later (a function that changed its mind).
    calls = iter([{"backbone": "slow", "head": "fast"}])
    opt = optim.multi_transform(
        TWO, lambda p: next(calls, None) or (labels(p) if callable(labels) else labels)
    )
    state = opt.init(params)
    with pytest.raises(
        ValueError,
        match=rf"^fdp\.optim\.multi_transform: {call} "
        + match.replace("param_labels unlike", r"param_labels\(params\) unlike").replace(
            r"param_labels\[", r"param_labels\(params\)\["
        ),
    ):
        getattr(opt, call)(params, state, params)


@pytest.mark.parametrize("one_pass", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize(
    ("make_state", "match"),
    [
        (
            lambda p: optim.adamw().init(p),
            r"got a state of type AdamState, expected MultiTransformState: the state must come from this "
            r"transformation's init\(params\) or its last step, passed as {call}\(grads, state, params\)$",
        ),
        (
            lambda p: optim.chain(optim.multi_transform(TWO, "slow")).init(p),
            r"got a state of type tuple, expected MultiTransformState",
        ),
        # Another multi_transform's: its states would be dealt out to other transformations.
        (
            lambda p: optim.multi_transform({"slow": optim.adamw(), "other": optim.sgd(0.1)}, "slow").init(p),
            r"got a state for the labels \['slow', 'other'\], expected one for the labels "
            r"\['slow', 'fast'\]: the state must come from this transformation's init\(params\)$",
        ),
        (
            lambda p: optim.MultiTransformState([optim.adamw().init(p), optim.sgd(0.1).init(p)]),  # type: ignore[arg-type]
            r"got inner_states of type list, expected one for the labels \['slow', 'fast'\]",
        ),
    ],
    ids=["an-optimizers-state", "a-chains-state", "other-labels", "not-a-dict"],
)
def test_multi_transform_refuses_a_state_of_another_kind(
    make_state: Callable[[Any], Any], match: str, one_pass: bool
) -> None:
    params, _ = nested_problem()
    opt = optim.multi_transform(TWO, {"backbone": "slow", "head": "fast"})
    call = "apply_gradients" if one_pass else "update"
    with pytest.raises(
        ValueError, match=r"^fdp\.optim\.multi_transform: " + call + " " + match.format(call=call)
    ):
        getattr(opt, call)(params, make_state(params), params)


@pytest.mark.parametrize("one_pass", [False, True], ids=["update", "apply_gradients"])
def test_multi_transform_refuses_grads_unlike_params(one_pass: bool) -> None:
    # Checked before the labels split them: else the transformations' own messages would show
    # masked trees, with None in the places of other labels' leaves.
    params, _ = nested_problem()
    opt = optim.multi_transform(TWO, {"backbone": "slow", "head": "fast"})
    call = getattr(opt, "apply_gradients" if one_pass else "update")
    name = "apply_gradients" if one_pass else "update"
    state = opt.init(params)
    with pytest.raises(
        ValueError,
        match=rf"^fdp\.optim\.multi_transform: {name} got params PyTreeSpec\(.*\) but grads "
        r"PyTreeSpec\(\{'backbone'",
    ):
        call({"backbone": params["backbone"]}, state, params)
    unused = {**params, "head": {"w": params["head"]["w"], "b": None}}  # allow_unused=True's None
    with pytest.raises(
        ValueError,
        match=rf"^fdp\.optim\.multi_transform: {name} got grads\['head'\]\['b'\] = None for a tensor ",
    ):
        call(unused, state, params)
    # A leaf of another shape: the label's optimizer names it by its path in the whole tree.
    wrong = {**params, "head": {"w": params["head"]["w"], "b": torch.ones(3)}}
    with pytest.raises(
        ValueError,
        match=rf"^fdp\.optim\.sgd: {name} got grads\['head'\]\['b'\] of shape \(3,\) for "
        r"params\['head'\]\['b'\] ",
    ):
        call(wrong, state, params)


@pytest.mark.parametrize("one_pass", [False, True], ids=["update", "apply_gradients"])
def test_multi_transform_refuses_a_transformation_that_returns_another_tree(one_pass: bool) -> None:
    # Its leaves, placed by position, would land on other parameters.
    drops_none = optim.GradientTransformation(
        lambda params: optim.EmptyState(),
        lambda grads, state, params=None: ({k: v for k, v in grads.items() if v is not None}, state),
    )
    opt = optim.multi_transform({"mine": drops_none, "sgd": optim.sgd(0.1)}, {"a": "sgd", "b": "mine"})
    params = {"a": torch.ones(1), "b": torch.ones(2)}
    call = "apply_gradients" if one_pass else "update"
    error = ValueError
    match = (
        r"^fdp\.optim\.multi_transform: update: transforms\['mine'\] returned PyTreeSpec\(\{'b': \*\}\) "
        r"for the masked tree PyTreeSpec\(\{'a': None, 'b': \*\}\); a transformation must return a tree "
        r"like the one it is given$"
    )
    if one_pass:  # apply_updates refuses the updates first
        match = (
            r"^fdp\.optim\.apply_updates: params are PyTreeSpec\(\{'a': None, 'b': \*\}\) but updates are "
        )
    with pytest.raises(error, match=match):
        getattr(opt, call)(params, opt.init(params), params)
