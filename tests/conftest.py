"""Shared fixtures. Every multi-device test runs on CPU devices: ``["cpu"] * n``."""

from __future__ import annotations

import threading

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


@pytest.fixture
def on_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas other than 0 run on their workers: the caller never runs them inline."""
    from fdp import _pool

    monkeypatch.setattr(_pool, "INLINE_REPLICAS", False)


@pytest.fixture
def thread_count() -> int:
    return threading.active_count()
