"""Many threads calling pmapped functions at once get what sequential calls get."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from helpers import cpus

import fdp

THREADS = 8


def run_in_threads(work: Callable[[int], Any], threads: int = THREADS) -> list[Any]:
    results: list[Any] = [None] * threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def target(i: int) -> None:
        try:
            start.wait()
            results[i] = work(i)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    pool = [threading.Thread(target=target, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in pool), "a caller thread hung"
    assert errors == []
    return results


def test_one_function_from_eight_threads() -> None:
    w = torch.randn(6, 4)

    @fdp.pmap(in_axes=(0, None), devices=cpus(3))
    def predict(x, w):
        return torch.tanh(x @ w)

    inputs = [torch.randn(5 + i, 6) for i in range(THREADS)]
    expected = [predict(x, w) for x in inputs]
    got = run_in_threads(lambda i: [predict(inputs[i], w) for _ in range(20)])
    for i in range(THREADS):
        for out in got[i]:
            torch.testing.assert_close(out, expected[i])


def test_different_functions_and_device_counts_from_eight_threads() -> None:
    functions = [fdp.pmap(lambda x, k=k: x * k, devices=cpus(1 + k % 4)) for k in range(THREADS)]
    x = torch.arange(12.0)
    got = run_in_threads(lambda i: [functions[i](x) for _ in range(20)])
    for i in range(THREADS):
        assert all(torch.equal(out, x * i) for out in got[i])


def test_concurrent_backward() -> None:
    f = fdp.pmap(lambda x, w: (x @ w).square(), in_axes=(0, None), devices=cpus(2))
    xs = [torch.randn(7, 3) for _ in range(THREADS)]

    def grad_of(i: int) -> torch.Tensor:
        w = torch.ones(3, 2, requires_grad=True)
        f(xs[i], w).sum().backward()
        return w.grad

    got = run_in_threads(grad_of)
    for i in range(THREADS):
        w = torch.ones(3, 2, requires_grad=True)
        (xs[i] @ w).square().sum().backward()
        torch.testing.assert_close(got[i], w.grad)


def test_module_from_eight_threads_with_different_params() -> None:
    model = torch.nn.Linear(4, 4)
    params = [{"weight": torch.full((4, 4), float(i)), "bias": torch.zeros(4)} for i in range(THREADS)]
    f = fdp.pmap(model, devices=cpus(2))
    x = torch.ones(6, 4)
    got = run_in_threads(lambda i: [f(params[i], x) for _ in range(10)])
    for i in range(THREADS):
        assert all(torch.equal(out, torch.full((6, 4), 4.0 * i)) for out in got[i])


def test_collectives_data_parallel_and_resident_state_from_eight_threads() -> None:
    centre = fdp.pmap(
        lambda x: x - fdp.pmean(x.mean(0), "i", weight=x.shape[0]), axis_name="i", devices=cpus(3)
    )
    model = torch.nn.Linear(4, 2)
    wrapped = fdp.DataParallel(model, device_ids=cpus(2))
    state = fdp.device_put_replicated({"w": torch.ones(4)}, cpus(2))
    step = fdp.pmap(
        lambda s, x: ({"w": s["w"] + fdp.psum(x.sum(0), "i")}, x @ s["w"]),
        axis_name="i",
        devices=cpus(2),
        out_axes=(fdp.PER_REPLICA, 0),
    )
    inputs = [torch.randn(7 + i, 4) for i in range(THREADS)]
    expected = [(centre(x), wrapped(x), step(state, x)[1]) for x in inputs]

    def work(i: int) -> list[Any]:
        return [(centre(inputs[i]), wrapped(inputs[i]), step(state, inputs[i])[1]) for _ in range(10)]

    got = run_in_threads(work)
    for i in range(THREADS):
        for outputs in got[i]:
            for a, b in zip(outputs, expected[i]):
                torch.testing.assert_close(a, b)


def test_a_compiled_functional_call_from_eight_threads() -> None:
    """Each thread's own weights, never another's: under torch.compile, fdp.functional_call's
    swap of weights into the module happens only inside the compiled graph's inputs."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    weights = [{k: torch.randn_like(v) for k, v in model.named_parameters()} for _ in range(THREADS)]
    x = torch.randn(3, 4)
    expected = [torch.func.functional_call(model, p, (x,)) for p in weights]
    call = torch.compile(lambda p, x: fdp.functional_call(model, p, (x,)), backend="aot_eager")
    try:
        call(weights[0], x)  # compiled once, before the threads race
        got = run_in_threads(lambda i: [call(weights[i], x) for _ in range(50)])
    finally:
        torch._dynamo.reset()
    for i in range(THREADS):
        for out in got[i]:
            torch.testing.assert_close(out, expected[i])


def test_activation_checkpointing_in_a_functional_call_from_eight_threads() -> None:
    # Each thread's backward recomputes its own forward (torch.utils.checkpoint) while other
    # threads call the same module: the recomputation must use that call's tensors.
    from test_functional_call import Checkpointed, checkpointed_grads, unchecked

    net = Checkpointed()

    def work(i: int) -> bool:
        return all(
            torch.allclose(a, b)
            for k in range(10)
            for a, b in zip(
                checkpointed_grads(fdp.functional_call, net, 100 * i + k),
                checkpointed_grads(unchecked, net, 100 * i + k),
            )
        )

    assert run_in_threads(work) == [True] * THREADS


def test_a_parametrized_tensor_given_by_its_own_name_from_eight_threads() -> None:
    # Each call sets the parametrization's original from its own "weight" (right_inverse):
    # in the skeleton's own tensor, never in the module's that the other threads read.
    from torch.nn.utils import parametrize

    class Symmetric(torch.nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(0, 1)

        def right_inverse(self, w):
            return w.triu()

    net = torch.nn.Linear(4, 4)
    parametrize.register_parametrization(net, "weight", Symmetric())
    weights = [w + w.T for w in torch.randn(THREADS, 4, 4)]
    x = torch.randn(3, 4)

    def work(i: int) -> bool:
        expected = x @ weights[i].T + net.bias
        return all(
            torch.allclose(fdp.functional_call(net, {"weight": weights[i]}, (x,)), expected)
            for _ in range(50)
        )

    assert run_in_threads(work) == [True] * THREADS
