"""Many threads flattening trees at once: fdp's own registrations of node types."""

from __future__ import annotations

import dataclasses

import torch
from test_concurrent_calls import THREADS, run_in_threads

from fdp import _tree


def test_threads_meeting_a_new_dataclass_all_flatten_it_as_a_container() -> None:
    # fdp registers a plain dataclass the first time it flattens one. A thread whose flatten
    # ran before another thread's registration must flatten again, not keep the dataclass as a
    # leaf (replicas packing one for a collective all meet it at once).
    for _ in range(100):

        @dataclasses.dataclass
        class Pair:
            a: torch.Tensor
            b: torch.Tensor

        value = Pair(torch.zeros(1), torch.ones(1))
        assert run_in_threads(lambda i, value=value: len(_tree.flatten(value)[0])) == [2] * THREADS
