"""Helpers shared by the tests."""

from __future__ import annotations

import torch


def cpus(n: int) -> list[str]:
    """``n`` replicas on the CPU: how every multi-device test runs without GPUs."""
    return ["cpu"] * n


def assert_trees_close(actual, expected, *, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    import optree

    a_leaves, a_spec = optree.tree_flatten(actual, namespace="fdp")
    e_leaves, e_spec = optree.tree_flatten(expected, namespace="fdp")
    assert a_spec == e_spec, (a_spec, e_spec)
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, atol=atol, rtol=rtol)
        else:
            assert a == e
