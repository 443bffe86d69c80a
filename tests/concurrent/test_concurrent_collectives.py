"""Many threads reducing the same tensors on lone replicas at once: copy-on-write clones."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_concurrent_calls import THREADS, run_in_threads

from fdp import _collectives


def test_threads_cloning_one_tensor_at_once_all_get_copy_on_write_clones() -> None:
    # The first lazy clone of a storage turns it into a copy-on-write one; threads doing that
    # to one storage at once race in torch (one gets an error and would fall back to a copy,
    # or memory is freed twice). A lone replica's reductions in concurrent pmapped calls on one
    # tensor (a broadcast value) take turns.
    device = torch.device("cpu")
    for _ in range(100):
        value = [torch.randn(64) for _ in range(200)]
        expected = [t.clone() for t in value]
        results = run_in_threads(
            lambda i, value=value: _collectives._Packed(value, "fdp.psum", device).private_leaves()
        )
        for leaves in results:
            assert all(torch._C._is_cow_tensor(r) and torch.equal(r, e) for r, e in zip(leaves, expected))
        del results
        [torch.full((64,), 7.0) for _ in range(200 * THREADS)]  # reuse any memory freed
        assert all(torch.equal(t, e) for t, e in zip(value, expected))


def test_lazy_clones_take_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    # The race above is timing-dependent; that fdp's lazy clones never overlap is not.
    inside, most, count = [0], [0], threading.Lock()
    lazy_clone = _collectives._lazy_clone

    def slow_lazy_clone(t: torch.Tensor) -> torch.Tensor:
        with count:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.001)
        with count:
            inside[0] -= 1
        return lazy_clone(t)

    monkeypatch.setattr(_collectives, "_lazy_clone", slow_lazy_clone)
    value = [torch.randn(8) for _ in range(5)]
    run_in_threads(lambda i: _collectives._Packed(value, "fdp.psum", torch.device("cpu")).private_leaves())
    assert most[0] == 1
