"""Helpers shared by the tests."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import fdp


@dataclasses.dataclass(init=False)
class Opaque:
    """A dataclass fdp cannot rebuild (no generated ``__init__``), holding a tensor."""

    x: torch.Tensor


def opaque() -> Opaque:
    value = Opaque()
    value.x = torch.zeros(4)
    return value


def cpus(n: int) -> list[str]:
    """``n`` replicas on the CPU: how every multi-device test runs without GPUs."""
    return ["cpu"] * n


def assert_trees_close(actual, expected, *, atol: float = 1e-6, rtol: float = 1e-5, msg: Any = None) -> None:
    import optree

    a_leaves, a_spec = optree.tree_flatten(actual, namespace="fdp")
    e_leaves, e_spec = optree.tree_flatten(expected, namespace="fdp")
    assert a_spec == e_spec, (a_spec, e_spec)
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(
                a, e, atol=atol, rtol=rtol, msg=None if msg is None else lambda found: f"{found}\n{msg}"
            )
        else:
            assert a == e, msg


def finishes(call: Callable[[], Any], seconds: float = 20.0) -> Any:
    """Runs ``call`` in a thread and returns (or raises) what it did; fails if it hangs."""
    outcome: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as error:  # noqa: BLE001
            outcome.append((False, error))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call did not end within {seconds} s"
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def sgd_steps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 3) -> None:
    """``steps`` steps of ``torch.optim.SGD`` (lr 0.1) on the mean squared error of ``model(x)``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def collect_when_workers_rest(timeout: float = 30.0) -> None:
    """``gc.collect()`` once every worker thread has dropped its replicas' references.

    A replica counts as done (and the pmapped call returns) just before its worker drops the
    task that holds them, and a task that the calling thread took over from a busy worker stays
    in that worker's queue until the worker reaches it: under load, a test that counts
    references right after a call could find them still held for a moment."""
    deadline = time.monotonic() + timeout
    while any(worker.busy or not worker.tasks.empty() for worker in list(fdp._pool._WORKERS.values())):
        assert time.monotonic() < deadline, "fdp's worker threads stayed busy"
        time.sleep(0.001)
    gc.collect()
