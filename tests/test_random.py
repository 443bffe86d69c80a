"""Explicit randomness: fold_in, replica_seed, rng_scope."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import cpus
from torch import nn

import fdp


def draws() -> list[torch.Tensor]:
    x = torch.ones(4, 3, 5, 5)
    return [
        F.dropout(torch.ones(64), 0.5),
        F.dropout2d(x, 0.5),
        F.dropout1d(torch.ones(4, 3, 5), 0.5),
        F.dropout3d(torch.ones(2, 3, 2, 2, 2), 0.5),
        torch.rand(5),
        torch.randn(2, 2),
        torch.randint(0, 10, (5,)),
        torch.randperm(7),
        torch.rand_like(torch.zeros(3)),
        torch.bernoulli(torch.full((6,), 0.5)),
        torch.normal(torch.zeros(3), torch.ones(3)),
        torch.multinomial(torch.ones(5), 3),
        torch.empty(4).uniform_(),
        torch.empty(4).normal_(),
        nn.Linear(3, 3).weight.detach(),
        nn.init.xavier_normal_(torch.empty(3, 3)),
        # Layers that decompose into random ATen ops: all of them must be routed.
        attention(torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))),
        F.scaled_dot_product_attention(*[torch.ones(2, 4, 8)] * 3, dropout_p=0.5),
        F.rrelu(torch.ones(20) * -1.0, training=True),
        F.gumbel_softmax(torch.zeros(3, 4)),
        F.alpha_dropout(torch.ones(16), 0.5, training=True),
        torch.dropout(torch.ones(16), 0.5, True),
        F.fractional_max_pool2d(torch.arange(64.0).reshape(1, 1, 8, 8), 2, output_size=4),
    ]


_ATTENTION = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)


def attention(x: torch.Tensor) -> torch.Tensor:
    return _ATTENTION(x, x, x, need_weights=False)[0].detach()


def test_scope_makes_every_draw_reproducible() -> None:
    with fdp.rng_scope(11):
        first = draws()
    torch.manual_seed(123)  # the global generator has no say inside the scope
    with fdp.rng_scope(11):
        second = draws()
    with fdp.rng_scope(12):
        other = draws()
    assert [k for k, (a, b) in enumerate(zip(first, second)) if not torch.equal(a, b)] == []
    assert sum(not torch.equal(a, b) for a, b in zip(first, other)) >= len(first) - 2


def test_draws_inside_torch_func_grad() -> None:
    x = torch.ones(32, requires_grad=True)

    def grads() -> torch.Tensor:
        with fdp.rng_scope(4):
            return torch.func.grad(lambda x: F.dropout(x, 0.5).sum())(x)

    assert torch.equal(grads(), grads())


def test_a_pmapped_call_inside_a_scope_gives_each_replica_its_own() -> None:
    f = fdp.pmap(lambda x: F.dropout(x, 0.5), devices=cpus(2))
    with fdp.rng_scope(5):
        first = f(torch.ones(2, 64))
    with fdp.rng_scope(5):
        second = f(torch.ones(2, 64))
    assert torch.equal(first, second)
    assert not torch.equal(first[0], first[1])
    with fdp.rng_scope(fdp.fold_in(fdp.fold_in(5, 0), 1)):
        replica_1 = F.dropout(torch.ones(1, 64), 0.5)
    assert torch.equal(first[1:], replica_1)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_successive_calls_in_one_scope_draw_anew(n: int) -> None:
    # As successive draws on one device do: a training loop inside one scope must not repeat
    # its dropout masks from step to step.
    f = fdp.pmap(lambda x: F.dropout(x, 0.5), devices=cpus(n))
    x = torch.ones(n, 64)
    with fdp.rng_scope(5):
        first, second = f(x), f(x)
        between = torch.rand(8)
    assert not torch.equal(first, second)
    with fdp.rng_scope(5):
        assert torch.equal(f(x), first) and torch.equal(f(x), second)  # reproducible
        assert torch.equal(torch.rand(8), between)  # the calls leave the scope's draws alone
    for r in range(n):
        with fdp.rng_scope(fdp.fold_in(fdp.fold_in(5, 1), r)):
            assert torch.equal(second[r : r + 1], F.dropout(torch.ones(1, 64), 0.5))


def test_data_parallel_forwards_in_one_scope_draw_anew() -> None:
    model = fdp.DataParallel(torch.nn.Dropout(0.5), device_ids=cpus(2))
    with fdp.rng_scope(0):
        masks = [model(torch.ones(4, 32)) for _ in range(3)]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


def test_checkpoint_recomputes_the_same_masks() -> None:
    from torch.utils.checkpoint import checkpoint

    layer = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5))
    x = torch.randn(8, 16, requires_grad=True)
    with fdp.rng_scope(9):
        plain = layer(x)
    plain.sum().backward()
    expected = x.grad.clone()
    x.grad = None
    with fdp.rng_scope(9):
        recomputed = checkpoint(layer, x, use_reentrant=False, context_fn=fdp.rng_checkpoint_context)
    recomputed.sum().backward()
    assert torch.equal(plain, recomputed) and torch.equal(x.grad, expected)


@pytest.mark.parametrize("axis_name", [None, "i"])
def test_checkpoint_around_a_whole_pmapped_call_replays_the_masks(axis_name: str | None) -> None:
    from torch.utils.checkpoint import checkpoint

    f = fdp.pmap(lambda x: F.dropout(x, 0.5) * x, axis_name=axis_name, devices=["cpu", "cpu"])
    for trial in range(30):
        x = torch.ones(8, 16, requires_grad=True)
        with fdp.rng_scope(trial):
            y = checkpoint(f, x, use_reentrant=False, context_fn=fdp.rng_checkpoint_context)
        y.sum().backward()
        # d/dx of dropout(x) * x at x = 1 is 2 * mask / (1 - p) = 2 * y: the forward's masks.
        assert torch.equal(x.grad, 2 * y.detach()), trial


def test_checkpoint_after_a_draw_in_the_scope_replays_the_masks_from_where_the_generator_was() -> None:
    # The generator the scope made for the first draw is saved with the region and restored for
    # the recomputation: the masks are the forward's, not the next ones.
    from torch.utils.checkpoint import checkpoint

    for trial in range(10):
        x = torch.ones(64, requires_grad=True)
        with fdp.rng_scope(trial):
            torch.rand(3)  # the CPU generator of the scope, drawn from before the region
            y = checkpoint(
                lambda t: F.dropout(t, 0.5) * t, x, use_reentrant=False, context_fn=fdp.rng_checkpoint_context
            )
        y.sum().backward()
        assert torch.equal(x.grad, 2 * y.detach()), trial  # d/dx dropout(x) * x = 2 mask / (1 - p) at 1


def test_checkpoint_context_outside_a_scope_leaves_the_replay_to_torch() -> None:
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(64, requires_grad=True)
    y = checkpoint(
        lambda t: F.dropout(t, 0.5) * t, x, use_reentrant=False, context_fn=fdp.rng_checkpoint_context
    )
    y.sum().backward()
    assert torch.equal(x.grad, 2 * y.detach())


def test_checkpoint_recomputes_the_same_masks_on_every_backward_pass() -> None:
    # Each backward pass recomputes the region (retain_graph=True, or torch.autograd.grad
    # twice): each must replay the forward's masks, not fail on a used-up context.
    from torch.utils.checkpoint import checkpoint

    layer = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5))
    x = torch.randn(8, 16, requires_grad=True)
    with fdp.rng_scope(9):
        plain = layer(x)
    (expected,) = torch.autograd.grad(plain.sum(), x)
    with fdp.rng_scope(9):
        y = checkpoint(layer, x, use_reentrant=False, context_fn=fdp.rng_checkpoint_context)
    for _ in range(3):
        (grad,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
        assert torch.equal(grad, expected)


_Q = torch.ones(1, 1, 4, 8)
# One call with dropout_p=0.5 per fused attention kernel that draws its mask inside; refused by
# the scope before any kernel runs, so the CUDA, MPS and XPU ones are reached with CPU tensors.
# (The cuDNN, Triton, MPS and overrideable ones were let through to the global generator.)
_INTERNAL_DROPOUT_CALLS = {
    "flash_for_cpu": lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(_Q, _Q, _Q, 0.5),
    "flash": lambda: torch.ops.aten._scaled_dot_product_flash_attention(_Q, _Q, _Q, 0.5),
    "efficient": lambda: torch.ops.aten._scaled_dot_product_efficient_attention(_Q, _Q, _Q, None, False, 0.5),
    "cudnn": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(_Q, _Q, _Q, None, False, 0.5),
    "cudnn_forward": lambda: torch.ops.aten._cudnn_attention_forward(
        _Q, _Q, _Q, None, None, None, 4, 4, False, 0.5
    ),
    "overrideable": lambda: torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        _Q, _Q, _Q, None, 0.5
    ),
    "math_for_mps": lambda: torch.ops.aten._scaled_dot_product_attention_math_for_mps(_Q, _Q, _Q, None, 0.5),
    "triton": lambda: torch.ops.aten._triton_scaled_dot_attention(_Q, _Q, _Q, 0.5),
}


@pytest.mark.parametrize("kernel", list(_INTERNAL_DROPOUT_CALLS))
def test_fused_attention_kernels_with_internal_dropout_refuse(kernel: str) -> None:
    with (
        fdp.rng_scope(0),
        pytest.raises(NotImplementedError, match="draws its dropout mask inside the kernel"),
    ):
        _INTERNAL_DROPOUT_CALLS[kernel]()


_H = torch.zeros(2, 1, 3)
# An RNN's dropout between layers on MIOpen and MPS, which draws from a state the kernel keeps:
# refused by the scope before any kernel runs, so they are reached with CPU tensors.
_KEPT_STATE_RNN_CALLS = {
    "miopen": lambda dropout, train: torch.ops.aten.miopen_rnn(
        torch.ones(4, 1, 3), [], 0, _H, _H, 2, 3, 2, False, dropout, train, False, [], None
    ),
    "mps": lambda dropout, train: torch.ops.aten._lstm_mps(
        torch.ones(4, 1, 3), [_H, _H], [], True, 2, dropout, train, False, False
    ),
}


@pytest.mark.parametrize("kernel", list(_KEPT_STATE_RNN_CALLS))
def test_rnn_kernels_that_keep_their_dropout_state_refuse(kernel: str) -> None:
    with (
        fdp.rng_scope(0),
        pytest.raises(NotImplementedError, match=r"an RNN's dropout between layers, dropout=0\.5"),
    ):
        _KEPT_STATE_RNN_CALLS[kernel](0.5, True)
    # Without dropout, or in eval mode, the scope lets the kernel run (here: it has none for
    # the CPU).
    for dropout, train in ((0.0, True), (0.5, False)):
        with fdp.rng_scope(0), pytest.raises(NotImplementedError, match="CPU"):
            _KEPT_STATE_RNN_CALLS[kernel](dropout, train)


def test_draws_repeat_across_processes() -> None:
    script = (
        "import torch, fdp\n"
        "with fdp.rng_scope(5):\n"
        "    print(torch.rand(4).tolist(), torch.nn.functional.dropout(torch.ones(6), 0.5).tolist())"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
        ).stdout
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and runs[0]


def test_dropout_semantics_in_the_scope() -> None:
    x = torch.ones(10_000)
    with fdp.rng_scope(0):
        y = F.dropout(x, 0.25)
        assert torch.equal(F.dropout(x, 0.25, training=False), x)
        assert torch.equal(F.dropout(x, 0.0), x)
        assert torch.equal(F.dropout(x, 1.0), torch.zeros_like(x))
        z = x.clone()
        F.dropout(z, 0.5, inplace=True)
        with pytest.raises(ValueError, match="between 0 and 1"):
            F.dropout(x, 1.5)
    kept = y[y != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / 0.75))
    assert 0.72 < kept.numel() / x.numel() < 0.78
    assert set(z.unique().tolist()) <= {0.0, 2.0}
    mask = F.dropout2d(torch.ones(2, 3, 4, 4), 0.5)
    assert all(len(channel.unique()) == 1 for channel in mask.reshape(6, 16))  # one draw per channel


def test_random_ops_on_the_meta_device_in_the_scope() -> None:
    # Meta tensors hold no values and torch has no generator for them: building a model on the
    # meta device inside a scope must work as outside one, not fail naming the META device.
    with fdp.rng_scope(0):
        layer = nn.Linear(3, 4, device="meta")
        dropped = F.dropout(torch.ones(8, device="meta"), 0.5)
        native = torch.ops.aten.native_dropout(torch.ones(8, device="meta"), 0.5, True)
        drawn = torch.rand(2, device="meta")
    assert layer.weight.is_meta and dropped.shape == (8,) and native[1].dtype == torch.bool
    assert drawn.is_meta


def test_scope_is_per_thread() -> None:
    inside = threading.Event()
    release = threading.Event()

    def other_thread() -> None:
        with fdp.rng_scope(5):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other_thread)
    t.start()
    inside.wait(10)
    torch.manual_seed(7)
    a = torch.rand(3)
    torch.manual_seed(7)
    b = torch.rand(3)
    release.set()
    t.join()
    assert torch.equal(a, b)  # this thread still uses the global generator


def test_fold_in() -> None:
    assert fdp.fold_in(0, 1) == fdp.fold_in(0, 1)
    assert len({fdp.fold_in(s, d) for s in range(20) for d in range(20)}) == 400
    assert all(0 <= fdp.fold_in(s, 3) < 2**63 for s in (-1, 0, 2**70))
    # Integers of any kind fold in as their value.
    assert fdp.fold_in(np.int64(4), torch.tensor(2)) == fdp.fold_in(4, 2)


@pytest.mark.parametrize("seed, data", [(0.5, 1), (0, 1.5), (1.0, 0)])
def test_fold_in_refuses_a_float_rather_than_truncating_it(seed: object, data: object) -> None:
    # int(0.5) == int(0.7) == 0: truncated, different seeds would draw alike, silently.
    with pytest.raises(TypeError, match=r"fdp.fold_in: seed and data must be integers, got seed=.*"):
        fdp.fold_in(seed, data)  # type: ignore[arg-type]


def test_rng_scope_refuses_a_float_seed() -> None:
    with pytest.raises(TypeError, match=r"fdp.rng_scope: seed must be an integer, got 0.5"):
        fdp.rng_scope(0.5)  # type: ignore[arg-type]
    with fdp.rng_scope(np.int64(3)):
        a = torch.rand(3)
    with fdp.rng_scope(3):
        assert torch.equal(torch.rand(3), a)


def test_replica_seeds_differ_and_repeat() -> None:
    f = fdp.pmap(lambda x: torch.tensor([fdp.replica_seed(9, "i")]), axis_name="i", devices=cpus(4))
    first, second = f(torch.zeros(4)), f(torch.zeros(4))
    assert torch.equal(first, second) and len(set(first.tolist())) == 4
    assert first.tolist() == [fdp.fold_in(9, r) for r in range(4)]


def test_replica_seed_names_itself_in_its_errors() -> None:
    # The errors named fdp.axis_index ("unbound axis name: i (fdp.axis_index: ...)") and
    # fdp.fold_in ("fdp.fold_in: seed and data must be integers"), which the user never called.
    with pytest.raises(
        NameError, match=r"^unbound axis name: i \(fdp\.replica_seed: collectives work inside"
    ):
        fdp.replica_seed(9, "i")
    with pytest.raises(
        NameError,
        match=r"^unbound axis name: j \(fdp\.replica_seed: the function being mapped has axis_name='i'\)",
    ):
        fdp.pmap(lambda x: x + fdp.replica_seed(9, "j"), axis_name="i", devices=cpus(2))(torch.zeros(2))
    with pytest.raises(TypeError, match=r"^fdp\.replica_seed: seed must be an integer, got 1\.5\n"):
        fdp.pmap(lambda x: x + fdp.replica_seed(1.5, "i"), axis_name="i", devices=cpus(2))(torch.zeros(2))  # type: ignore[arg-type]


def test_dataloader_workers_forked_in_a_scope_draw_differently() -> None:
    # Each worker forked in a scope held a copy of its generators in one state: the workers drew
    # the same numbers (the same augmentations, item 0 and item 1 alike), and again in every
    # epoch, silently, where DataLoader seeds each worker's global generator differently. So did
    # pmapped calls in a worker, whose replicas got their seeds from the copied scope. (The
    # workers' seeds come from the scope: a run is reproducible for a given seed.)
    script = textwrap.dedent(
        """
        import torch, fdp
        from torch.utils.data import DataLoader, Dataset
        pmapped = fdp.pmap(lambda x: x + torch.rand(1), devices=["cpu", "cpu"])
        class Random(Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return [torch.rand(1).item(), pmapped(torch.zeros(2)).tolist()]
        for run in range(2):
            with fdp.rng_scope(0):
                for epoch in range(2):
                    loader = DataLoader(Random(), None, num_workers=2, multiprocessing_context="fork")
                    print([item for item in loader])
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    epochs = [ast.literal_eval(line) for line in result.stdout.splitlines()]
    assert len(epochs) == 4, result.stdout
    # Items 0 and 2 come from worker 0, 1 and 3 from worker 1: every draw differs from the others.
    flat = [value for epoch in epochs[:2] for item in epoch for value in (item[0], *item[1])]
    assert len(set(flat)) == len(flat) == 24, epochs
    assert [[item[0] for item in epoch] for epoch in epochs[:2]] == [
        [item[0] for item in epoch] for epoch in epochs[2:]
    ]
