"""Shared fixtures. Every multi-device test runs on CPU devices: ``["cpu"] * n``."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from helpers import cpus

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=[1, 2, 3, 8], ids=lambda n: f"{n}cpu")
def devices(request: pytest.FixtureRequest) -> list[str]:
    """1, 2, 3 and 8 replicas on the CPU."""
    return cpus(request.param)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _global_state() -> dict[str, object]:
    """torch's process-wide settings (and the caller thread's) that a test may change."""
    return {
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
        "torch.is_grad_enabled()": torch.is_grad_enabled(),
        "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled(),
        "torch.is_autocast_enabled('cpu')": torch.is_autocast_enabled("cpu"),
        "torch.get_autocast_dtype('cpu')": torch.get_autocast_dtype("cpu"),
    }


@pytest.fixture(autouse=True)
def _no_state_left_behind() -> Iterator[None]:
    # A test that changes one of these and leaves it changed makes later tests pass or fail by
    # the order they run in (test_soak left one intra-op thread, and a tolerance of
    # test_layers failed after it): restored here, and the test that left it fails. (Inference
    # mode has no setter, only a guard to enter: left on, it is reported, not restored.)
    before = _global_state()
    yield
    after = _global_state()
    if after != before:
        torch.set_num_threads(before["torch.get_num_threads()"])  # type: ignore[arg-type]
        torch.set_default_dtype(before["torch.get_default_dtype()"])  # type: ignore[arg-type]
        torch.use_deterministic_algorithms(before["torch.are_deterministic_algorithms_enabled()"])  # type: ignore[arg-type]
        torch.set_grad_enabled(before["torch.is_grad_enabled()"])  # type: ignore[arg-type]
        torch.set_autocast_enabled("cpu", before["torch.is_autocast_enabled('cpu')"])  # type: ignore[arg-type]
        torch.set_autocast_dtype("cpu", before["torch.get_autocast_dtype('cpu')"])  # type: ignore[arg-type]
        changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
        pytest.fail(f"the test left torch's state changed (before, after): {changed}")


@pytest.fixture
def on_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas other than 0 run on their workers: the caller never runs them inline."""
    from fdp import _pool

    monkeypatch.setattr(_pool, "INLINE_REPLICAS", False)


@pytest.fixture
def thread_count() -> int:
    return threading.active_count()
