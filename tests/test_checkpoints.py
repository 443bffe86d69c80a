"""Stopping and resuming: a run stopped after k steps (its state saved with ``torch.save``,
everything dropped, a fresh pmapped step, model and optimizer built, the state loaded with
``torch.load(weights_only=True)``) ends bit for bit where the uninterrupted run ends: its losses,
parameters, optimizer state and buffers. Killing the training process (SIGKILL) while it writes
a checkpoint leaves the previous one loadable. (Across processes: tests/test_distributed.py.)"""

from __future__ import annotations

import io
import math
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from helpers import cpus
from torch import nn

import fdp
from fdp import optim

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--batch-size", "48", "--checkpoint-every", "10", "--eval-every", "10"]


def train(checkpoint: Path, *args: str) -> list[str]:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train.py"),
            "--checkpoint",
            str(checkpoint),
            *COMMON,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return result.stdout.strip().splitlines() + [
        line for line in result.stderr.splitlines() if "eval loss" in line
    ]


def test_sigkill_while_writing_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    checkpoint = tmp_path / "run" / "train.pt"
    train(checkpoint, "--steps", "20")  # checkpoints at steps 10 and 20
    assert torch.load(checkpoint, weights_only=True)["step"] == 20

    # Continue to step 30, but hang inside the write of the step-30 checkpoint and get killed there.
    driver = textwrap.dedent(
        f"""
        import runpy, sys, time, torch
        def stuck_save(obj, f, *args, **kwargs):
            f.write(b"half a checkpoint")
            f.flush()
            print("WRITING", flush=True)
            time.sleep(120)
        torch.save = stuck_save
        sys.argv = ["train.py", "--checkpoint", {str(checkpoint)!r}, *{COMMON!r}, "--steps", "30", "--resume"]
        runpy.run_path({str(ROOT / "examples" / "train.py")!r}, run_name="__main__")
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as process:
        try:
            for line in process.stdout:  # type: ignore[union-attr]
                if "WRITING" in line:
                    break
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert list(checkpoint.parent.glob("*.tmp"))  # the half-written file is there...
    payload = torch.load(checkpoint, weights_only=True)  # ...and the checkpoint is still whole
    assert payload["step"] == 20

    resumed = train(checkpoint, "--steps", "30", "--resume")
    uninterrupted = train(tmp_path / "other" / "train.pt", "--steps", "30")
    assert resumed[-2:] == uninterrupted[-2:]  # the final line and the last evaluation, exactly
    assert not list(checkpoint.parent.glob("*.tmp"))  # the next write cleared the leftover


SEED, STEPS, STOP = 0, 6, 2


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    # As docs/training.md asks of reproducible runs on several CPU replicas.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of a step: it depends on the step alone, as examples/train.py's does."""
    g = torch.Generator().manual_seed(fdp.fold_in(1, step))
    return torch.randn(rows, 5, generator=g), torch.randint(0, 3, (rows,), generator=g)


def net(sync: bool = False) -> nn.Module:
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    return fdp.SyncBatchNorm.convert_sync_batchnorm(model, axis_name="batch") if sync else model


def saved_and_loaded(payload: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_identical(actual: Any, expected: Any) -> None:
    """The same tree, every tensor equal bit for bit (and of one dtype), every other leaf equal."""
    a_leaves, a_spec = optree.tree_flatten(actual, namespace=fdp.NAMESPACE)
    e_leaves, e_spec = optree.tree_flatten(expected, namespace=fdp.NAMESPACE)
    assert a_spec == e_spec, (a_spec, e_spec)
    for path, a, e in zip(optree.treespec_paths(e_spec), a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            assert a.dtype == e.dtype and torch.equal(a, e), (path, a, e)
        else:
            assert type(a) is type(e) and a == e, (path, a, e)


def resident_training(devices: list[str], *, sync: bool = False, average: bool = True) -> Any:
    """A fresh model, optimizer and pmapped step (examples/train.py's), with a schedule and
    clipping in a chain, dropout under a per-step scope and the BatchNorm statistics averaged
    (or kept per replica); returns the initial state and ``run(state, start, stop, losses)``."""
    model = net(sync).train()
    schedule = lambda step: 1e-2 * min(1.0, (step + 1) / 3) * 0.5 * (1 + math.cos(math.pi * step / 10))  # noqa: E731
    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(schedule, weight_decay=1e-2))

    @fdp.pmap(
        axis_name="batch",
        devices=devices,
        split="balanced",
        in_axes=(0, 0, 0, None),
        out_axes=(fdp.PER_REPLICA, None),
    )
    def train_step(state: Any, x: torch.Tensor, y: torch.Tensor, seed: int) -> Any:
        def loss_fn(params: Any) -> Any:
            with fdp.rng_scope(fdp.replica_seed(seed, "batch")):
                logits, buffers = fdp.stateful_call(model, params, state["buffers"], (x,))
            return F.cross_entropy(logits, y), buffers

        grads, (loss, buffers) = torch.func.grad_and_value(loss_fn, has_aux=True)(state["params"])
        statistics = {k: v for k, v in buffers.items() if v.is_floating_point() and average}
        grads, loss, statistics = fdp.pmean((grads, loss, statistics), "batch", weight=x.shape[0])
        params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
        return {"params": params, "opt": opt_state, "buffers": {**buffers, **statistics}}, loss

    def run(state: Any, start: int, stop: int, losses: list[torch.Tensor]) -> Any:
        for step in range(start, stop):
            x, y = batch(step, 4 * len(devices))
            state, loss = train_step(state, x, y, fdp.fold_in(SEED, step))
            losses.append(loss)
        return state

    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    return {"params": params, "buffers": buffers, "opt": opt.init(params)}, run


@pytest.mark.parametrize(
    ("n", "sync"), [(2, False), (3, False), (3, True)], ids=["2cpu", "3cpu", "3cpu-sync"]
)
def test_resident_state_resumes_bit_for_bit(n: int, sync: bool) -> None:
    # The optimizer states saved as they are (a chain's tuple of EmptyState and AdamState, whose
    # step count the schedule reads), with a schedule, clipping, dropout and BatchNorm statistics
    # (averaged with pmean, or the whole batch's through fdp.SyncBatchNorm) on 2 and 3 replicas.
    devices = cpus(n)
    initial, run = resident_training(devices, sync=sync)
    expected_losses: list[torch.Tensor] = []
    state = run(fdp.device_put_replicated(initial, devices), 0, STEPS, expected_losses)
    expected = [fdp.unreplicate(state, r) for r in range(n)]
    del initial, run, state

    initial, run = resident_training(devices, sync=sync)
    losses: list[torch.Tensor] = []
    state = run(fdp.device_put_replicated(initial, devices), 0, STOP, losses)
    payload = saved_and_loaded({"step": STOP, "state": fdp.unreplicate(state), "losses": losses})
    del initial, run, state

    _, run = resident_training(devices, sync=sync)
    state = run(
        fdp.device_put_replicated(payload["state"], devices), payload["step"], STEPS, payload["losses"]
    )
    assert_identical(payload["losses"], expected_losses)
    assert expected[0]["opt"][1].step == STEPS
    for r in range(n):
        assert_identical(fdp.unreplicate(state, r), expected[r])


def test_state_kept_per_replica_resumes_from_every_replicas_copy() -> None:
    # BatchNorm statistics kept per replica (docs/training.md, "Buffers"): replica 0's copy
    # alone would resume replica 1 with replica 0's statistics; every replica's copy, rebuilt
    # into PerReplica leaves as docs/training.md ("Checkpoints") shows, resumes each.
    devices = cpus(2)
    initial, run = resident_training(devices, average=False)
    state = run(fdp.device_put_replicated(initial, devices), 0, STEPS, [])
    expected = [fdp.unreplicate(state, r) for r in range(2)]
    assert not torch.equal(expected[0]["buffers"]["1.running_mean"], expected[1]["buffers"]["1.running_mean"])
    del initial, run, state

    initial, run = resident_training(devices, average=False)
    state = run(fdp.device_put_replicated(initial, devices), 0, STOP, [])
    copies = saved_and_loaded([fdp.unreplicate(state, r) for r in range(len(devices))])
    del initial, run, state

    _, run = resident_training(devices, average=False)
    placed = [torch.device(d) for d in devices]
    state = optree.tree_map(lambda *values: fdp.PerReplica(values, placed), *copies, namespace=fdp.NAMESPACE)
    state = run(state, STOP, STEPS, [])
    for r in range(2):
        assert_identical(fdp.unreplicate(state, r), expected[r])


def data_parallel_training(
    devices: list[str], sync: bool
) -> tuple[fdp.DataParallel[nn.Module], torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """A fresh fdp.DataParallel model with torch.optim.AdamW and a LambdaLR schedule."""
    model = fdp.DataParallel(net(sync), device_ids=devices, axis_name="batch" if sync else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
    return model, opt, scheduler


def data_parallel_run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    start: int,
    stop: int,
    losses: list[torch.Tensor],
) -> None:
    """Steps with clip_grad_norm_, and dropout under a scope seeded with the step."""
    model.train()
    for step in range(start, stop):
        x, y = batch(step, 12)
        with fdp.rng_scope(fdp.fold_in(SEED, step)):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        scheduler.step()
        losses.append(loss.detach())


@pytest.fixture
def deterministic() -> Iterator[None]:
    # fdp.DataParallel's parameters are shared by the replicas: on three CPU replicas their
    # gradients sum in replica order only under this flag (docs/training.md, "Checkpoints").
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize(
    ("before", "after", "sync"),
    [(2, 2, False), (2, 3, False), (2, 3, True)],
    ids=["2to2", "2to3", "2to3-sync"],
)
def test_data_parallel_resumes_from_state_dicts_bit_for_bit(before: int, after: int, sync: bool) -> None:
    # Its checkpoint is the module's state_dict (with the optimizer's and the scheduler's),
    # which holds no device count: resumed on 3 replicas, the run ends where one that wraps
    # its module and optimizer anew on 3 replicas at that step ends.
    model, opt, scheduler = data_parallel_training(cpus(before), sync)
    expected_losses: list[torch.Tensor] = []
    data_parallel_run(model, opt, scheduler, 0, STOP, expected_losses)
    model = fdp.DataParallel(model.module, device_ids=cpus(after), axis_name=model.axis_name)
    data_parallel_run(model, opt, scheduler, STOP, STEPS, expected_losses)
    expected = {"model": model.state_dict(), "opt": opt.state_dict()}
    del model, opt, scheduler

    model, opt, scheduler = data_parallel_training(cpus(before), sync)
    losses: list[torch.Tensor] = []
    data_parallel_run(model, opt, scheduler, 0, STOP, losses)
    payload = saved_and_loaded(
        {"model": model.state_dict(), "opt": opt.state_dict(), "scheduler": scheduler.state_dict()}
    )
    del model, opt, scheduler

    model, opt, scheduler = data_parallel_training(cpus(after), sync)
    model.load_state_dict(payload["model"])
    opt.load_state_dict(payload["opt"])
    scheduler.load_state_dict(payload["scheduler"])
    data_parallel_run(model, opt, scheduler, STOP, STEPS, losses)
    assert_identical(losses, expected_losses)
    assert_identical({"model": model.state_dict(), "opt": opt.state_dict()}, expected)
