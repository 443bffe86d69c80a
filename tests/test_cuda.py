"""CUDA paths: two replicas on one GPU everywhere, distinct GPUs where there are several.

Marked ``cuda``: skipped on machines without CUDA (CI). Run them on a GPU machine with
``python -m pytest -m cuda``.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import finishes, sgd_steps
from torch import nn

import fdp
from fdp import optim

pytestmark = pytest.mark.cuda

TWO_ON_ONE = ["cuda:0", "cuda:0"]


def run_fresh(code: str) -> None:
    """Runs ``code`` in a new interpreter with warnings as errors: torch gives some warnings
    once per process, so an earlier test in this one could have used them up."""
    package_root = str(Path(fdp.__file__).resolve().parents[1])  # the fdp this process tests
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr


def several_gpus() -> list[str]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        pytest.skip("needs two CUDA devices")
    return [f"cuda:{i}" for i in range(count)]


def test_cpu_input_is_scattered_to_the_gpu_and_gathered_there() -> None:
    x = torch.randn(30, 5, requires_grad=True)
    out = fdp.pmap(lambda x: x * 2 + 1, devices=TWO_ON_ONE)(x)
    assert out.device == torch.device("cuda", 0)
    torch.testing.assert_close(out.cpu(), x.detach() * 2 + 1)
    out.sum().backward()
    assert x.grad.device == torch.device("cpu")
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_output_device_cpu() -> None:
    out = fdp.pmap(lambda x: x.square(), devices=TWO_ON_ONE, output_device="cpu")(torch.arange(6.0))
    assert out.device == torch.device("cpu")
    torch.testing.assert_close(out, torch.arange(6.0).square())


def test_pinned_input() -> None:
    x = torch.randn(64, 8).pin_memory()
    torch.testing.assert_close(fdp.pmap(lambda x: x + 1, devices=TWO_ON_ONE)(x).cpu(), x + 1)


@pytest.mark.parametrize("devices", ["two_on_one", "several"])
def test_module_outputs_and_grads_match_one_gpu(devices: str) -> None:
    targets = TWO_ON_ONE if devices == "two_on_one" else several_gpus()
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)).cuda()
    params = dict(model.named_parameters())
    x = torch.randn(30, 8, device="cuda")
    out = fdp.pmap(model, devices=targets)(params, x)
    out.square().sum().backward()
    grads = {k: p.grad.clone() for k, p in params.items()}
    model.zero_grad()
    expected = model(x)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    for k, p in params.items():
        assert grads[k].device == p.device
        torch.testing.assert_close(grads[k], p.grad, atol=1e-5, rtol=1e-4)


def test_lstm_on_two_replicas_of_one_gpu() -> None:
    lstm = nn.LSTM(4, 8, batch_first=True).cuda()
    params = dict(lstm.named_parameters())
    x = torch.randn(10, 6, 4, device="cuda")
    out, (h, c) = fdp.pmap(lstm, devices=TWO_ON_ONE, out_axes=(0, 1))(params, x)
    expected, (eh, ec) = lstm(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(h, eh, atol=1e-5, rtol=1e-4)


def test_lstm_dropout_between_layers_draws_from_the_scope() -> None:
    # cuDNN draws the masks between an RNN's layers from a state it keeps, seeded from the
    # global generator: inside fdp.rng_scope it gets a state seeded from the scope.
    lstm = nn.LSTM(16, 32, num_layers=3, dropout=0.5).cuda()
    x = torch.randn(5, 4, 16, device="cuda")

    def run(seed: int) -> torch.Tensor:
        with fdp.rng_scope(seed):
            return lstm(x)[0]

    first = run(1)
    torch.manual_seed(5)  # the global generators play no part
    assert torch.equal(run(1), first) and not torch.equal(run(2), first)
    with fdp.rng_scope(1):
        assert torch.equal(lstm(x)[0], first) and not torch.equal(lstm(x)[0], first)  # draws anew
    with torch.no_grad():
        assert not torch.equal(lstm.eval()(x)[0], first)  # the dropout was on
    lstm.train()

    def replica(x: torch.Tensor) -> torch.Tensor:
        with fdp.rng_scope(fdp.replica_seed(3, "i")):
            return lstm(x)[0]

    mapped = fdp.pmap(replica, axis_name="i", devices=TWO_ON_ONE, in_axes=1, out_axes=1)
    out = mapped(x.repeat(1, 2, 1))
    assert torch.equal(mapped(x.repeat(1, 2, 1)), out)
    assert not torch.equal(out[:, :4], out[:, 4:])  # the replicas draw differently


def test_lstm_dropout_in_the_scope_has_the_gradient_of_its_masks() -> None:
    # The backward replays the forward's masks: gradcheck evaluates the function many times,
    # each in the same scope, so with the same masks.
    lstm = nn.LSTM(3, 4, num_layers=2, dropout=0.5).cuda().double()
    x = torch.randn(5, 2, 3, device="cuda", dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        with fdp.rng_scope(3):
            return lstm(x)[0]

    with torch.no_grad():
        without_dropout = lstm.eval()(x)[0]
    lstm.train()
    assert not torch.equal(f(x), without_dropout)
    assert torch.autograd.gradcheck(f, (x,))


def test_workers_run_on_their_own_streams() -> None:
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def f(x):
        with lock:
            seen.append((threading.current_thread().name, torch.cuda.current_stream().cuda_stream))
        return x

    fdp.pmap(f, devices=["cuda:0"] * 3)(torch.zeros(3, device="cuda"))
    caller = threading.current_thread().name
    default = torch.cuda.current_stream().cuda_stream
    worker_streams = {stream for name, stream in seen if name != caller}
    assert len(worker_streams) == 2 and default not in worker_streams


def test_bfloat16_autocast_reaches_the_replicas() -> None:
    dtypes: list[torch.dtype] = []
    lock = threading.Lock()

    def f(x):
        y = x @ x.T
        with lock:
            dtypes.append(y.dtype)
        return y

    with torch.autocast("cuda", dtype=torch.bfloat16):
        fdp.pmap(f, devices=["cuda:0"] * 3)(torch.randn(6, 4, device="cuda"))
    assert dtypes == [torch.bfloat16] * 3


def test_long_running_replica_results_are_synchronised() -> None:
    # Heavy work on the worker streams: the gathered result must not be read before it is written.
    a = torch.randn(8, 1024, 1024, device="cuda")

    def f(x):
        for _ in range(20):
            x = x @ x.transpose(1, 2) / 1024
        return x

    out = fdp.pmap(f, devices=TWO_ON_ONE)(a)
    torch.testing.assert_close(out, f(a), atol=1e-3, rtol=1e-3)


def test_distinct_gpus_scatter_gather_replicate() -> None:
    devices = several_gpus()
    x = torch.randn(10, 3, device="cuda:0", requires_grad=True)
    shards = fdp.scatter(x, devices)
    assert [s.device for s in shards] == [torch.device(d) for d in devices][: len(shards)]
    joined = fdp.gather(shards, "cuda:0")
    torch.testing.assert_close(joined, x)
    w = torch.randn(4, device="cuda:0", requires_grad=True)
    copies = fdp.replicate({"w": w}, devices)
    sum(c["w"].sum().to("cuda:0") for c in copies).backward()
    torch.testing.assert_close(w.grad, torch.full_like(w, float(len(devices))))


def test_gpu_backward_runs_on_the_engines_device_thread() -> None:
    # The premise of fdp's refusal below: torch runs a CUDA tensor's backward on the engine's
    # thread for the device, not in the replica's thread that asked for the gradient.
    seen: list[int] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def setup_context(ctx: object, inputs: object, output: object) -> None:
            pass

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            seen.append(threading.get_ident())
            return grad

    torch.func.grad(lambda x: Probe.apply(x).sum())(torch.ones(3, device="cuda"))
    assert seen and seen[0] != threading.get_ident()


@pytest.mark.parametrize("grad", [torch.func.grad, fdp.grad], ids=["torch.func.grad", "fdp.grad"])
def test_grad_of_psum_on_two_replicas_of_one_gpu_raises_instead_of_hanging(grad: Any) -> None:
    step = fdp.pmap(
        lambda x: grad(lambda x: fdp.psum((x**2).sum(), "i"))(x), axis_name="i", devices=TWO_ON_ONE
    )
    with pytest.raises(RuntimeError, match="cannot run on replicas that share cuda:0"):
        finishes(lambda: step(torch.ones(2, 3, device="cuda")))
    # The same collective on CPU tensors runs its backward in each replica's own thread.
    on_cpu = fdp.pmap(
        lambda x: grad(lambda x: fdp.psum((x.cpu() ** 2).sum(), "i"))(x),
        axis_name="i",
        devices=TWO_ON_ONE,
    )
    x = torch.arange(6.0, device="cuda").reshape(2, 3)
    torch.testing.assert_close(finishes(lambda: on_cpu(x)), 2 * 2 * x)


def test_grad_of_psum_on_distinct_gpus() -> None:
    devices = several_gpus()
    step = fdp.pmap(
        lambda x: torch.func.grad(lambda x: fdp.psum((x**2).sum(), "i"))(x), axis_name="i", devices=devices
    )
    x = torch.arange(len(devices) * 3.0, device="cuda").reshape(len(devices), 3)
    torch.testing.assert_close(finishes(lambda: step(x)), len(devices) * 2 * x)


@pytest.mark.parametrize("caller_stream", ["default", "side"])
def test_collectives_wait_for_every_replicas_kernels(caller_stream: str) -> None:
    # Replica r queues 1 + 2r long matrix products on its stream before the collective and uses
    # the result at once after it. Without stream ordering, whichever replica combines reads
    # another's buffer before it is written, or another reads its result too early. (On an
    # H100 the code without ordering failed with the caller on a side stream and passed, by
    # timing or by the legacy default stream's implicit ordering, with it on the default one.)
    a = torch.randn(3, 4096, 4096, device="cuda")

    def heavy(x: torch.Tensor, times: int) -> torch.Tensor:
        for _ in range(times):
            x = torch.tanh(x @ x / 64)
        return x

    def f(x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = heavy(x, 1 + 2 * fdp.axis_index("i"))
        return {"sum": fdp.psum(y, "i") * 2, "mean": fdp.pmean(y[0, :8], "i", weight=3) + 1}

    stream = torch.cuda.Stream() if caller_stream == "side" else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        out = fdp.pmap(f, axis_name="i", devices=["cuda:0"] * 3, out_axes=None)(a)
    torch.cuda.current_stream().wait_stream(stream)
    shards = [heavy(x, 1 + 2 * r) for r, x in enumerate(a.chunk(3))]
    torch.testing.assert_close(out["sum"], (shards[0] + shards[1] + shards[2]) * 2)
    torch.testing.assert_close(out["mean"], sum(s[0, :8] for s in shards) / 3 + 1)


@pytest.mark.parametrize("devices", [["cuda:0"], TWO_ON_ONE], ids=["one", "two_on_one"])
def test_resident_training_matches_one_device(devices: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU benchmark's step (resident state, pmean of the gradients, SGD), against
    # torch.optim on the whole batch on one device. One replica runs it without the general
    # scatter: every input is already on its GPU.
    from fdp import _scatter

    scattered: list[int] = []
    scatter = _scatter.scatter_leaves
    monkeypatch.setattr(_scatter, "scatter_leaves", lambda *a, **k: scattered.append(1) or scatter(*a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).cuda()
    x, y = torch.randn(96, 64, device="cuda"), torch.randint(0, 10, (96,), device="cuda")
    opt = optim.sgd(0.1, momentum=0.9)

    @fdp.pmap(axis_name="b", devices=devices, out_axes=fdp.PER_REPLICA)
    def step(state, x, y):
        leaves = {k: v.requires_grad_() for k, v in state["params"].items()}
        loss = F.cross_entropy(fdp.functional_call(model, leaves, (x,)), y)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        grads = fdp.pmean(grads, "b", weight=x.shape[0])
        params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
        return {"params": params, "opt": opt_state}

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, devices)
    reference = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(5):
        state = step(state, x, y)
        reference.zero_grad()
        F.cross_entropy(model(x), y).backward()
        reference.step()
    assert len(scattered) == (0 if len(devices) == 1 else 5)
    for r in range(len(devices)):
        for k, v in fdp.unreplicate(state["params"], r).items():
            torch.testing.assert_close(v, dict(model.named_parameters())[k].detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("devices", [["cuda:0"], TWO_ON_ONE], ids=["one", "two_on_one"])
def test_cuda_graph_resident_step_matches_the_eager_step(devices: list[str]) -> None:
    # benchmarks/gpu.py's step with compile={"mode": "reduce-overhead"} (CUDA graph trees),
    # against the same step run eagerly. On two replicas of one GPU, replica 1 runs its graphs
    # in a worker thread: torch < 2.13 sets up the trees' per-thread state only in the thread
    # that imported them (pytorch/pytorch#123177), which fdp does for it (_compile.cudagraph_trees_ready).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).cuda()
    x, y = torch.randn(24, 16, device="cuda"), torch.randint(0, 4, (24,), device="cuda")
    opt = optim.sgd(0.1, momentum=0.9)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fdp.functional_call(model, p, (x,)), y)

    def run(compile: Any) -> list[dict[str, torch.Tensor]]:
        @fdp.pmap(axis_name="b", devices=devices, out_axes=fdp.PER_REPLICA, compile=compile)
        def step(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
            grads = torch.func.grad(loss_fn)(state["params"], x, y)
            grads = fdp.pmean(grads, "b", weight=x.shape[0], donate=True)
            params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
            return {"params": params, "opt": opt_state}

        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        state = fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, devices)
        for _ in range(5):  # warm-up, recording, then replays
            torch.compiler.cudagraph_mark_step_begin()
            state = step(state, x, y)
        return [
            {k: v.clone() for k, v in fdp.unreplicate(state["params"], r).items()}
            for r in range(len(devices))
        ]

    try:
        eager, graphed = run(False), run({"mode": "reduce-overhead"})
    finally:
        torch._dynamo.reset()
    for want, got in zip(eager, graphed):
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_workers_make_the_cuda_context_current() -> None:
    # cuBLAS warns on its first call in a thread with no current CUDA context.
    run_fresh(
        """
        import torch, fdp
        x = torch.randn(9, 16, device="cuda")
        out = fdp.pmap(lambda x: x @ x.T, devices=["cuda:0"] * 3)(x)
        torch.testing.assert_close(out, torch.cat([s @ s.T for s in x.chunk(3)]))
        """
    )


def test_shared_leaf_gets_its_gradient_from_one_stream() -> None:
    # torch warns when a gradient reaches a leaf's AccumulateGrad from another stream than the
    # node's: replicas on two streams of one GPU would do that without an alias per replica.
    run_fresh(
        """
        import torch, fdp
        model = torch.nn.Linear(8, 4).cuda()
        params = dict(model.named_parameters())
        out = fdp.pmap(model, devices=["cuda:0", "cuda:0"])(params, torch.randn(6, 8, device="cuda"))
        out.sum().backward()
        assert params["weight"].grad is not None
        """
    )


def test_replicate_hands_out_a_shared_leaf_as_it_is() -> None:
    # The view that keeps a leaf's gradient on one stream is for the replicas of a call only.
    w = torch.ones(3, device="cuda", requires_grad=True)
    copies = fdp.replicate({"w": w}, TWO_ON_ONE)
    assert copies[0]["w"] is w and copies[1]["w"] is w


def test_data_parallel_on_two_replicas_of_one_gpu_matches_the_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).cuda()
    x = torch.randn(12, 8, device="cuda")
    wrapped = fdp.DataParallel(model, device_ids=TWO_ON_ONE)
    wrapped(x).square().sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model(x).square().sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("devices", [["cuda:0"], TWO_ON_ONE], ids=["one", "two_on_one"])
def test_data_parallel_training_steps_match_the_module(
    devices: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # One device that holds the whole module runs the module itself: nothing is placed, and
    # inputs already on the GPU skip the general scatter too. Two replicas of one GPU give the
    # second a view of each parameter (see alias_shared_leaves), made again after each
    # optimizer step.
    from fdp import _data_parallel

    placed: list[int] = []
    scattered: list[int] = []
    replicate = _data_parallel._scatter.replicate
    scatter = _data_parallel._pmap._scatter.scatter_leaves
    monkeypatch.setattr(
        _data_parallel._scatter, "replicate", lambda *a, **k: placed.append(1) or replicate(*a, **k)
    )
    monkeypatch.setattr(
        _data_parallel._pmap._scatter,
        "scatter_leaves",
        lambda *a, **k: scattered.append(1) or scatter(*a, **k),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).cuda()
    reference = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).cuda()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(12, 8, device="cuda"), torch.randn(12, 4, device="cuda")
    wrapped = fdp.DataParallel(model, device_ids=devices)
    for net in (wrapped, reference):
        sgd_steps(net, x, y)
    assert len(placed) == (0 if len(devices) == 1 else 3)
    assert len(scattered) == (0 if len(devices) == 1 else 3)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_grad_of_psum_with_a_cpu_leaf_first_still_refuses_a_shared_gpu() -> None:
    # The engine runs this backward on cuda:0's thread (its first non-CPU gradient), which the
    # two replicas share: refused, not left waiting forever.
    def loss(p, x):
        out = fdp.psum({"a": p["a"].sum(), "b": p["b"] * x.sum()}, "i")
        return out["b"].sum().cpu() + out["a"]

    def f(x):
        return torch.func.grad(loss)({"a": torch.ones(2), "b": torch.ones(2, device="cuda")}, x)["b"]

    step = fdp.pmap(f, axis_name="i", devices=TWO_ON_ONE)
    with pytest.raises(RuntimeError, match="cannot run on replicas that share cuda:0"):
        finishes(lambda: step(torch.ones(2, 3, device="cuda")))


def batch_norm_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
    with torch.no_grad():  # running statistics away from their defaults
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    return model.double().cuda()


def weighted_sum(y: torch.Tensor) -> torch.Tensor:
    return (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape)).sum()


@pytest.mark.parametrize("devices", ["one", "two_on_one", "several"])
def test_sync_batch_norm_matches_batch_norm_on_the_whole_batch(devices: str) -> None:
    # The replicas' statistics meet in one all_gather: a lone replica's, two replicas' on two
    # streams of one GPU (each one's kernels ordered around the exchange), replicas across GPUs.
    targets = {"one": ["cuda:0"], "two_on_one": TWO_ON_ONE}.get(devices) or several_gpus()
    model = batch_norm_model()
    torch.manual_seed(1)
    x = torch.randn(10, 3, 3, 2, dtype=torch.float64, device="cuda") * 0.1 + 30.0
    reference = copy.deepcopy(model)
    xr = x.clone().requires_grad_()
    want_y = reference(xr)
    want_grads = torch.autograd.grad(weighted_sum(want_y), [xr, *reference.parameters()])

    synced = fdp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), axis_name="batch")
    params = {k: v.detach().requires_grad_() for k, v in synced.named_parameters()}
    buffers = {k: v.clone() for k, v in synced.named_buffers()}

    @fdp.pmap(in_axes=(None, None, 0), out_axes=(0, fdp.PER_REPLICA), axis_name="batch", devices=targets)
    def step(params, buffers, x):
        return fdp.stateful_call(synced, params, buffers, (x,))

    xs = x.clone().requires_grad_()
    y, new_buffers = step(params, buffers, xs)
    grads = torch.autograd.grad(weighted_sum(y), [xs, *params.values()])
    assert y.device == torch.device("cuda", 0)
    torch.testing.assert_close(y, want_y.detach())
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want)
    for name, want in reference.named_buffers():
        for value in new_buffers[name].values:  # every replica holds the whole batch's statistics
            torch.testing.assert_close(value.to(want.device), want)


def test_sync_batch_norm_shared_by_replicas_on_two_streams_updates_its_statistics_once() -> None:
    # The layer in the mapped function's closure: each replica reads the running statistics
    # before the exchange and writes them after it, on its own stream of the one GPU. The
    # exchange orders every read before any write (a write first would be applied twice).
    layer = fdp.SyncBatchNorm(3, axis_name="i").double().cuda()
    want = nn.BatchNorm1d(3).double().cuda()
    f = fdp.pmap(lambda x: layer(x), axis_name="i", devices=["cuda:0"] * 3)
    torch.manual_seed(0)
    for _ in range(3):
        x = torch.randn(12, 3, 2, dtype=torch.float64, device="cuda") * 2 + 5
        torch.testing.assert_close(f(x), want(x))
    torch.testing.assert_close(layer.running_mean, want.running_mean)
    torch.testing.assert_close(layer.running_var, want.running_var)
    assert layer.num_batches_tracked.item() == 3


@pytest.mark.parametrize("devices", [["cuda:0"], TWO_ON_ONE], ids=["one", "two_on_one"])
def test_sync_batch_norm_through_data_parallel(devices: list[str]) -> None:
    # One device runs the module itself, its lone replica exchanging with no one; two replicas
    # of one GPU exchange their statistics, and their buffers come back to the module.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).double().cuda()
    reference = copy.deepcopy(model)
    synced = fdp.SyncBatchNorm.convert_sync_batchnorm(model, axis_name="batch")
    wrapped = fdp.DataParallel(synced, device_ids=devices, axis_name="batch")
    x = torch.randn(12, 6, dtype=torch.float64, device="cuda")
    y = torch.randn(12, 2, dtype=torch.float64, device="cuda")
    for net in (wrapped, reference):
        sgd_steps(net, x, y)
    for (name, a), b in zip(synced.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


def test_clip_by_global_norm_with_gradients_on_several_devices() -> None:
    # The first gradient (by key) on the GPU: the scale, computed there, must reach the others.
    clip = optim.clip_by_global_norm(1.0)
    for other in ["cpu"] + (["cuda:1"] if torch.cuda.device_count() > 1 else []):
        grads = {"a": torch.tensor([3.0, 0.0], device="cuda:0"), "b": torch.tensor([0.0, 4.0], device=other)}
        clipped, _ = clip.update(grads, clip.init(None))
        assert clipped["a"].device == grads["a"].device and clipped["b"].device == grads["b"].device
        torch.testing.assert_close(clipped["a"].cpu(), torch.tensor([0.6, 0.0]))
        torch.testing.assert_close(clipped["b"].cpu(), torch.tensor([0.0, 0.8]))


def test_one_gpu_replica_runs_without_the_general_scatter(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every tensor already on the replica's GPU: the arguments reach it as they are (numbers
    # and other objects too). A CPU tensor among them takes the general path, which moves it.
    from fdp import _scatter

    scattered: list[int] = []
    scatter = _scatter.scatter_leaves
    monkeypatch.setattr(_scatter, "scatter_leaves", lambda *a, **k: scattered.append(1) or scatter(*a, **k))
    seen: list[torch.device] = []

    @fdp.pmap(in_axes=(0, None, None), devices=["cuda:0"])
    def f(x, w, scale):
        seen.append(w.device)
        return x @ w * scale

    x, w = torch.randn(6, 4, device="cuda"), torch.randn(4, 2, device="cuda")
    torch.testing.assert_close(f(x, w, 2.0), x @ w * 2.0)
    assert scattered == [] and seen == [torch.device("cuda", 0)]
    torch.testing.assert_close(f(x, w.cpu(), 2.0), x @ w * 2.0)
    assert scattered == [1] and seen[-1] == torch.device("cuda", 0)
    on_cpu = fdp.pmap(lambda x: x + 1, devices=["cuda:0"], output_device="cpu")(x)
    assert on_cpu.device == torch.device("cpu")
    torch.testing.assert_close(on_cpu, x.cpu() + 1)


def test_data_parallel_on_one_gpu_with_the_module_on_the_cpu() -> None:
    # The module is not on its one device: its parameters are placed there (again after each
    # optimizer step), gradients flow back to them, and BatchNorm's statistics come back.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    wrapped = fdp.DataParallel(model, device_ids=["cuda:0"], output_device="cpu")
    x, y = torch.randn(12, 6), torch.randn(12, 2)
    for net in (wrapped, reference):
        sgd_steps(net, x, y)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert a.device == torch.device("cpu")
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
