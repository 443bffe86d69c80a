"""Many threads flattening trees at once: fdp's own registrations of node types."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_concurrent_calls import THREADS, run_in_threads

from fdp import _tree


def test_threads_meeting_a_new_dataclass_all_flatten_it_as_a_container(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # fdp registers a plain dataclass the first time it flattens one. A thread whose flatten
    # ran before another thread's registration must flatten again, not keep the dataclass as a
    # leaf (replicas packing one for a collective all meet it at once). (A new class each time,
    # on purpose: not the mistake that fdp warns about after 100 of one name.)
    monkeypatch.setattr(_tree, "REDEFINITIONS_WARNED_AT", 10**9)
    for _ in range(100):

        @dataclasses.dataclass
        class Pair:
            a: torch.Tensor
            b: torch.Tensor

        value = Pair(torch.zeros(1), torch.ones(1))
        assert run_in_threads(lambda i, value=value: len(_tree.flatten(value)[0])) == [2] * THREADS
