"""The CUDA transfer functions' autograd wiring, run on a CPU stand-in for torch.cuda.comm.

The real CUDA paths are exercised by tests/test_cuda.py on a GPU machine; here every "device" is
the CPU, so what is checked is that each function's backward is its mirror transfer and that
double backward works (gradcheck and gradgradcheck in float64).
"""

from __future__ import annotations

import pytest
import torch

from fdp import _transfer


class CpuComm:
    """torch.cuda.comm's four calls, on CPU tensors; devices are only labels."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def scatter(self, tensor, devices, chunk_sizes, dim):
        self.calls.append("scatter")
        assert len(devices) == len(chunk_sizes)
        return tuple(c.clone() for c in torch.split(tensor, list(chunk_sizes), dim))

    def gather(self, tensors, dim, destination):
        self.calls.append("gather")
        return torch.cat(list(tensors), dim)

    def broadcast_coalesced(self, tensors, devices):
        self.calls.append("broadcast_coalesced")
        return [list(tensors)] + [[t.clone() for t in tensors] for _ in devices[1:]]

    def reduce_add_coalesced(self, groups, destination):
        self.calls.append("reduce_add_coalesced")
        return [sum(column) for column in zip(*groups)]


@pytest.fixture
def comm(monkeypatch: pytest.MonkeyPatch) -> CpuComm:
    fake = CpuComm()
    monkeypatch.setattr(_transfer, "_comm", fake)
    return fake


# Labels only: the stand-in keeps every tensor on the CPU.
DEVICES = [torch.device("cpu")] * 3


def test_scatter_backward_is_gather(comm: CpuComm) -> None:
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    scatter = lambda x: _transfer._CudaScatter.apply(DEVICES, [3, 3, 1], 0, x)  # noqa: E731
    assert torch.autograd.gradcheck(scatter, (x,))
    assert torch.autograd.gradgradcheck(scatter, (x,))
    assert {"scatter", "gather"} <= set(comm.calls)


def test_gather_backward_is_scatter(comm: CpuComm) -> None:
    parts = [torch.randn(2, n, dtype=torch.float64, requires_grad=True) for n in (3, 1, 2)]
    gather = lambda *p: _transfer._CudaGather.apply(torch.device("cpu"), 1, *p)  # noqa: E731
    assert torch.autograd.gradcheck(gather, parts)
    assert torch.autograd.gradgradcheck(gather, parts)
    assert {"scatter", "gather"} <= set(comm.calls)


def test_broadcast_backward_is_reduce_add(comm: CpuComm) -> None:
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    broadcast = lambda a, b: _transfer._CudaBroadcast.apply(DEVICES, a, b)  # noqa: E731
    assert torch.autograd.gradcheck(broadcast, (a, b))
    assert torch.autograd.gradgradcheck(broadcast, (a, b))
    assert {"broadcast_coalesced", "reduce_add_coalesced"} <= set(comm.calls)


def test_broadcast_of_a_frozen_tensor_is_not_differentiable(comm: CpuComm) -> None:
    w = torch.randn(2, requires_grad=True)
    frozen = torch.randn(2)
    copies = _transfer._CudaBroadcast.apply(DEVICES[:2], w, frozen)
    assert [c.requires_grad for c in copies] == [True, False, True, False]
    sum(c.sum() for c in copies[::2]).backward()
    torch.testing.assert_close(w.grad, torch.full((2,), 2.0))


def test_plain_paths_do_not_copy_on_the_same_device() -> None:
    x = torch.randn(4)
    assert _transfer.to_device(x, torch.device("cpu")) is x
    assert _transfer.broadcast([x], [torch.device("cpu")] * 3) == [[x], [x], [x]]
    assert _transfer.gather_to([x], 0, torch.device("cpu")) is x
    assert _transfer.split_to(x, 0, [4], [torch.device("cpu")])[0] is x


def test_broadcast_of_an_unused_tensor_gives_no_grad(comm: CpuComm) -> None:
    used, unused = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)
    copies = _transfer._CudaBroadcast.apply(DEVICES[:2], used, unused)
    (copies[0].sum() + copies[2].sum()).backward()
    assert unused.grad is None  # nn.DataParallel gives unused parameters zeros
    torch.testing.assert_close(used.grad, torch.full((2,), 2.0))
