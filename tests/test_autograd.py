"""Gradients through fdp.pmap equal the one-device computation's; torch.func inside replicas."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import cpus
from torch import nn

import fdp


def mlp_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    hidden = torch.tanh(x @ params["w1"] + params["b1"])
    return ((hidden @ params["w2"] - y) ** 2).sum(-1)


def make_params() -> dict[str, torch.Tensor]:
    return {
        "w1": torch.randn(5, 7, requires_grad=True),
        "b1": torch.randn(7, requires_grad=True),
        "w2": torch.randn(7, 3, requires_grad=True),
    }


@pytest.mark.parametrize("batch", [1, 7, 30])
def test_backward_matches_one_device(devices: list[str], batch: int) -> None:
    params = make_params()
    x = torch.randn(batch, 5, requires_grad=True)
    y = torch.randn(batch, 3)

    per_row = fdp.pmap(mlp_loss, in_axes=(None, 0, 0), devices=devices)(params, x, y)
    per_row.mean().backward()
    got = {k: v.grad.clone() for k, v in params.items()} | {"x": x.grad.clone()}

    for t in [*params.values(), x]:
        t.grad = None
    mlp_loss(params, x, y).mean().backward()
    expected = {k: v.grad for k, v in params.items()} | {"x": x.grad}
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=1e-5)


def test_replicated_input_receives_the_sum_over_replicas() -> None:
    w = torch.ones(3, requires_grad=True)
    out = fdp.pmap(lambda x, w: w * 1.0, in_axes=(0, None), out_axes=0, devices=cpus(4))(torch.zeros(8), w)
    assert out.shape == (12,)  # four replicas' (3,) outputs, concatenated
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 4.0))


@pytest.fixture
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_replicated_inputs_get_the_same_gradient_on_every_call(
    n: int, request: pytest.FixtureRequest
) -> None:
    # Replicas on one device share a replicated tensor; autograd's engine would add their
    # gradients in an order set by per-thread sequence numbers, which change from call to call
    # (three replicas, or two that use the tensor twice): identical steps then part in the last
    # bits, and a resumed run is no longer the uninterrupted one. fdp keeps the order under
    # torch.use_deterministic_algorithms(True), as torch does on GPUs.
    request.getfixturevalue("deterministic")
    torch.manual_seed(0)
    w = torch.randn(5, 5, requires_grad=True)
    x = torch.randn(6 * n, 5)
    f = fdp.pmap(lambda w, x: (x @ w).tanh() @ w, in_axes=(None, 0), devices=cpus(n))
    grads = []
    for _ in range(20):
        w.grad = None
        f(w, x).sum().backward()
        grads.append(w.grad)
    assert all(torch.equal(g, grads[0]) for g in grads)
    # In replica order, as a reduction over devices sums: replica r's gradient is that of its rows.
    alone = []
    for rows in x.chunk(n):
        w.grad = None
        ((rows @ w).tanh() @ w).sum().backward()
        alone.append(w.grad)
    expected = alone[0]
    for g in alone[1:]:
        expected = expected + g
    assert torch.equal(grads[0], expected)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.usefixtures("deterministic")
def test_data_parallel_gradients_are_the_same_on_every_call(n: int) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    model = fdp.DataParallel(net, device_ids=cpus(n))
    x = torch.randn(5 * n, 4)
    grads = []
    for _ in range(20):
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        grads.append([p.grad for p in net.parameters()])
    assert all(torch.equal(a, b) for g in grads for a, b in zip(g, grads[0]))


COLLECTIVES = {
    "psum": lambda v: fdp.psum(v, "i"),
    "pmean": lambda v: fdp.pmean(v, "i"),
    "weighted pmean": lambda v: fdp.pmean(v, "i", weight=float(fdp.axis_index("i") + 1)),
    "pmax": lambda v: fdp.pmax(v, "i"),
    "all_gather": lambda v: fdp.all_gather(v, "i").sum(0),
}


class ShuffledEngineOrder:
    """Runs calls whose replicas make their autograd nodes in an order that changes from call
    to call. The engine runs nodes by sequence numbers, which each thread counts for itself:
    every call here runs in new threads (the workers retired, the caller a new thread), and each
    replica first makes a number of nodes that rotates over the replicas from call to call."""

    def __init__(self, axis_name: str) -> None:
        self.axis_name, self.call = axis_name, 0

    def count_nodes(self) -> None:
        """Inside a replica: makes its share of nodes in this call."""
        one = torch.ones((), requires_grad=True)
        for _ in range(100 * ((self.call + fdp.axis_index(self.axis_name)) % 4)):
            one = one * 1.0

    def __call__(self, f: Any, *args: Any) -> Any:
        self.call += 1
        fdp._pool._retire(list(fdp._pool._WORKERS.values()))
        with concurrent.futures.ThreadPoolExecutor(1) as caller:
            return caller.submit(f, *args).result()

    def same_gradient_every_call(self, loss: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> bool:
        """Whether 12 backward passes through ``loss()`` (a pmapped call in it), each call in
        shuffled order, give ``leaves`` the same gradients, bit for bit."""
        grads = []
        for _ in range(12):
            for t in leaves:
                t.grad = None
            self(loss).backward()
            grads.append([t.grad for t in leaves])
        return all(torch.equal(a, b) for g in grads for a, b in zip(g, grads[0]))


@pytest.mark.parametrize("name", list(COLLECTIVES))
@pytest.mark.usefixtures("deterministic")
def test_collectives_differentiated_through_the_call_give_the_same_gradient_every_call(name: str) -> None:
    # Each replica's value feeds every replica's result (or one total feeds them all): the
    # engine would add those gradients in the order it runs the replicas' nodes, which changes
    # from call to call; magnitudes far apart make every order's rounding show.
    collective, shuffled = COLLECTIVES[name], ShuffledEngineOrder("i")
    torch.manual_seed(0)
    x = (torch.randn(16, 64) * torch.logspace(-4, 4, 16)[:, None]).requires_grad_()
    f = fdp.pmap(
        lambda x: shuffled.count_nodes() or (collective(x.tanh()) * x).square(),
        axis_name="i",
        devices=cpus(4),
    )
    assert shuffled.same_gradient_every_call(lambda: f(x).sum(), [x])


TREE_COLLECTIVES = {
    "psum": lambda tree: fdp.psum(tree, "i"),
    "pmean": lambda tree: fdp.pmean(tree, "i"),
    "pmax": lambda tree: fdp.pmax(tree, "i"),
    "all_gather": lambda tree: {k: t.sum(0) for k, t in fdp.all_gather(tree, "i").items()},
}


@pytest.mark.parametrize("name", list(TREE_COLLECTIVES))
@pytest.mark.usefixtures("deterministic")
def test_a_collective_of_leaves_of_two_dtypes_gives_the_same_gradient_every_call(name: str) -> None:
    # The leaves pack into two buffers, each with its chain of aliases; which chain completes
    # first changed from call to call, and h, which feeds both buffers and the output, added
    # its three gradients in that order: 2-4 different gradients in 12 calls.
    collective, shuffled = TREE_COLLECTIVES[name], ShuffledEngineOrder("i")
    torch.manual_seed(0)
    x = (torch.randn(16, 64) * torch.logspace(-2, 1, 16)[:, None]).requires_grad_()

    def f(x: torch.Tensor) -> torch.Tensor:
        shuffled.count_nodes()
        h = x.tanh()
        both = collective({"a": h, "b": h.double()})
        return (both["a"] + both["b"].float()) * x + 2 * h

    mapped = fdp.pmap(f, axis_name="i", devices=cpus(4))
    assert shuffled.same_gradient_every_call(lambda: mapped(x).square().sum(), [x])
    # And still the one-device gradient, to rounding (the flag changes no value but the order).
    ordered = x.grad
    torch.use_deterministic_algorithms(False)
    x.grad = None
    mapped(x).square().sum().backward()
    torch.testing.assert_close(ordered, x.grad)


@pytest.mark.usefixtures("deterministic")
def test_a_collective_keeps_its_leaves_requires_grad_under_deterministic_algorithms() -> None:
    # Only the buffers autograd follows go through the join that orders their gradients.
    x = torch.ones(4, 2, requires_grad=True)
    tree = fdp.pmap(
        lambda v: fdp.psum(
            {"a": v, "h": v.half(), "n": torch.ones(1, dtype=torch.int64), "d": torch.ones(1).double()}, "i"
        ),
        axis_name="i",
        devices=cpus(2),
    )(x)
    assert {k: t.requires_grad for k, t in tree.items()} == {"a": True, "h": True, "n": False, "d": False}


@pytest.mark.usefixtures("deterministic")
def test_sync_batch_norm_gradients_are_the_same_on_every_call() -> None:
    shuffled = ShuffledEngineOrder("b")

    class CountNodes(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shuffled.count_nodes()
            return x

    torch.manual_seed(0)
    net = nn.Sequential(
        CountNodes(), nn.Linear(4, 16), fdp.SyncBatchNorm(16, axis_name="b"), nn.Tanh(), nn.Linear(16, 2)
    )
    model = fdp.DataParallel(net, device_ids=cpus(4), axis_name="b")
    x = torch.randn(24, 4) * torch.logspace(-3, 3, 24)[:, None]
    assert shuffled.same_gradient_every_call(lambda: model(x).square().sum(), list(net.parameters()))


@pytest.mark.parametrize("n", [2, 3])
def test_replicas_get_a_shared_tensor_itself_unless_deterministic_algorithms_are_asked_for(n: int) -> None:
    # The chain of aliases costs ~5-16% of a small step: left out (a replica's tensor is then
    # the caller's leaf) unless asked for, as torch leaves such orders to the engine.
    w = torch.ones(3, requires_grad=True)
    seen = []
    f = fdp.pmap(lambda w, x: seen.append(w.is_leaf) or x * w, in_axes=(None, 0), devices=cpus(n))
    f(w, torch.ones(n, 3))
    assert seen == [True] * n
    torch.use_deterministic_algorithms(True)
    try:
        seen.clear()
        f(w, torch.ones(n, 3))
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen == [False] * n


def test_unused_replicated_input_gets_no_grad() -> None:
    used, unused = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    out = fdp.pmap(lambda x, u, v: x * u.sum(), in_axes=(0, None, None), devices=cpus(2))(
        torch.ones(4), used, unused
    )
    out.sum().backward()
    assert unused.grad is None and used.grad is not None


def test_double_backward_gradient_penalty(devices: list[str]) -> None:
    # float64: the penalty's values are large enough for float32 summation order to show.
    params = {k: v.detach().double().requires_grad_() for k, v in make_params().items()}
    x = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(9, 3, dtype=torch.float64)

    def penalty(loss_of_params):
        (gx,) = torch.autograd.grad(loss_of_params.sum(), x, create_graph=True)
        return (gx**2).sum()

    mapped = fdp.pmap(mlp_loss, in_axes=(None, 0, 0), devices=devices)
    grads = torch.autograd.grad(penalty(mapped(params, x, y)), list(params.values()))
    expected = torch.autograd.grad(penalty(mlp_loss(params, x, y)), list(params.values()))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10)


def test_torch_func_grad_inside_replicas(devices: list[str]) -> None:
    params = {k: v.detach() for k, v in make_params().items()}
    x, y = torch.randn(12, 5), torch.randn(12, 3)

    def grads_of_sum(params, x, y):
        grads = torch.func.grad(lambda p: mlp_loss(p, x, y).sum())(params)
        return {k: g[None] for k, g in grads.items()}  # one row per replica

    per_replica = fdp.pmap(grads_of_sum, in_axes=(None, 0, 0), devices=devices)(params, x, y)
    total = {k: g.sum(0) for k, g in per_replica.items()}
    expected = torch.func.grad(lambda p: mlp_loss(p, x, y).sum())(params)
    for k in expected:
        torch.testing.assert_close(total[k], expected[k], atol=1e-5, rtol=1e-5)


def test_vmap_and_functional_call_inside_replicas(devices: list[str]) -> None:
    model = nn.Linear(4, 2)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(10, 4)

    def per_example(params, x):
        return torch.func.vmap(lambda row: fdp.functional_call(model, params, (row,)))(x)

    out = fdp.pmap(per_example, in_axes=(None, 0), devices=devices)(params, x)
    torch.testing.assert_close(out, model(x), atol=1e-6, rtol=1e-5)


def test_per_example_grads_with_vmap_of_grad(devices: list[str]) -> None:
    params = {k: v.detach() for k, v in make_params().items()}
    x, y = torch.randn(6, 5), torch.randn(6, 3)

    def per_example_grads(params, x, y):
        one = lambda p, xi, yi: mlp_loss(p, xi[None], yi[None]).sum()  # noqa: E731
        return torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))(params, x, y)

    got = fdp.pmap(per_example_grads, in_axes=(None, 0, 0), devices=devices)(params, x, y)
    expected = per_example_grads(params, x, y)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=1e-5, rtol=1e-5)


def test_outer_torch_func_transform_is_refused() -> None:
    f = fdp.pmap(lambda x: x.sum(), devices=cpus(2), out_axes=None)
    with pytest.raises(RuntimeError, match="called under a torch.func transform"):
        torch.func.grad(lambda x: f(x))(torch.ones(4))
    with pytest.raises(RuntimeError, match="called under a torch.func transform"):
        torch.func.vmap(lambda x: f(x))(torch.ones(3, 4))


def _traced(tracer: str, f: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor) -> Callable[..., Any]:
    """``f`` traced at ``w`` by ``tracer``: a function of new inputs (for linearize, of the
    tangent) that replays the trace."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if tracer == "linearize":
        return torch.func.linearize(f, w)[1]
    if tracer == "make_fx":
        return make_fx(f)(w)
    if tracer == "jit.trace":
        return torch.jit.trace(f, (w,))

    class Wrapped(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return f(w)

    return torch.export.export(Wrapped(), (w,), strict=False).module()


# (torch.jit.trace is deprecated in torch 2.13 and warns of every size it sees used as a number,
# forward mode loads decompositions by script, and make_fx warns of the tensors a function
# closes over, which it keeps as constants.)
@pytest.mark.filterwarnings(
    "ignore::DeprecationWarning",
    "ignore::FutureWarning",
    "ignore::torch.jit.TracerWarning",
    "ignore:Attempted to insert a get_attr Node",
)
@pytest.mark.parametrize("tracer", ["linearize", "make_fx", "jit.trace", "export"])
@pytest.mark.parametrize("call", ["pmap", "data_parallel", "parallel_apply"])
def test_tracing_replicas_in_other_threads_is_refused(tracer: str, call: str) -> None:
    # A tracer records the calling thread's ops alone: the trace held the other replicas'
    # results as constants, and replayed them for any input (linearize's tangents were the
    # uninitialized memory it traces with), or failed far from the call (a divmod of traced
    # sizes, a fake tensor among an exported program's constants).
    x = torch.randn(4, 3, dtype=torch.float64)
    layer = nn.Linear(3, 1, bias=False).double().requires_grad_(False)  # (jit.trace: constants)

    def f_on(n: int) -> Callable[[torch.Tensor], torch.Tensor]:
        if call == "pmap":
            mapped = fdp.pmap(lambda w, x: torch.tanh(x @ w), in_axes=(None, 0), devices=cpus(n))
            return lambda w: mapped(w, x)
        if call == "data_parallel":
            wrapper = fdp.DataParallel(layer, device_ids=cpus(n))
            return lambda w: wrapper(x * w).squeeze(1)
        return lambda w: torch.cat(
            fdp.parallel_apply(lambda r: torch.tanh(r @ w), [x[:2], x[2:]][:n], devices=cpus(n))
        )

    def one_device(w: torch.Tensor) -> torch.Tensor:
        return layer(x * w).squeeze(1) if call == "data_parallel" else torch.tanh(x @ w)

    w, other = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    with pytest.raises(
        RuntimeError, match=r"was called under .*(jit.trace|make_fx).*records only the calling thread"
    ):
        _traced(tracer, f_on(2), w)
    if call == "parallel_apply":
        return
    # One replica runs in the calling thread, where it is traced.
    replayed = _traced(tracer, f_on(1), w)(other)
    expected = torch.func.jvp(one_device, (w,), (other,))[1] if tracer == "linearize" else one_device(other)
    torch.testing.assert_close(replayed, expected)


def test_grad_mode_off_gives_no_graph() -> None:
    w = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        out = fdp.pmap(lambda x, w: x * w, in_axes=(0, None), devices=cpus(2))(torch.ones(4, 3), w)
    assert not out.requires_grad


def test_backward_on_a_subset_of_outputs() -> None:
    x = torch.randn(8, 2, requires_grad=True)
    a, b = fdp.pmap(lambda x: (x * 2, x * 3), devices=cpus(3))(x)
    a.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((8, 2), 2.0))


def _deep(x: torch.Tensor) -> torch.Tensor:
    for _ in range(4):  # several saved tensors of one shape per replica, which could be swapped
        x = (x.sin() * x).exp().cos()
    return x


@pytest.mark.parametrize(
    "kind", ["plain", "collective", "data_parallel"], ids=["plain", "collective", "data_parallel"]
)
def test_checkpoint_around_a_pmapped_call_gives_the_plain_gradients(kind: str) -> None:
    # torch.utils.checkpoint hands the recomputed tensors back by the order in which they were
    # saved. Replicas running at once saved theirs in a different order in the forward and the
    # recomputation, about one time in five, and the swapped tensors gave wrong gradients.
    from torch.utils.checkpoint import checkpoint

    if kind == "plain":
        f = fdp.pmap(_deep, devices=cpus(2))
    elif kind == "collective":
        f = fdp.pmap(lambda x: _deep(x) * fdp.psum(_deep(x).sum(), "i"), axis_name="i", devices=cpus(2))
    else:
        f = fdp.DataParallel(
            nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)), device_ids=cpus(2)
        )
    for trial in range(30):
        x = torch.randn(8, 16, requires_grad=True)
        checkpoint(f, x, use_reentrant=False).square().sum().backward()
        recomputed = x.grad
        x.grad = None
        f(x).square().sum().backward()
        torch.testing.assert_close(recomputed, x.grad, msg=lambda m, trial=trial: f"trial {trial}: {m}")


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_collective_names_the_recomputation(reentrant: bool) -> None:
    # torch.utils.checkpoint inside the mapped function recomputes its region in backward, after
    # the replicas have returned: a collective there cannot meet anyone. The error used to say
    # that collectives work inside a mapped function, which this one is.
    from torch.utils.checkpoint import checkpoint

    def region(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * fdp.psum(x.sum(), "i")

    f = fdp.pmap(lambda x: checkpoint(region, x, use_reentrant=reentrant), axis_name="i", devices=cpus(2))
    x = torch.randn(4, requires_grad=True)
    out = f(x)
    with pytest.raises(
        NameError, match=r"unbound axis name: i \(fdp.psum: called during a backward pass.*checkpoint"
    ):
        out.sum().backward()


def test_a_checkpointed_region_that_ends_in_its_collective_is_not_recomputed_past_it() -> None:
    # use_reentrant=False stops recomputing once backward has what it saved (sin's input):
    # the psum after it never runs again, so the gradients are the plain ones (docs/collectives.md).
    from torch.utils.checkpoint import checkpoint

    f = fdp.pmap(
        lambda x: checkpoint(lambda x: fdp.psum(x.sin(), "i"), x, use_reentrant=False),
        axis_name="i",
        devices=cpus(2),
    )
    x = torch.randn(4, requires_grad=True)
    f(x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


# Forward-mode AD loads torch's decompositions through torch.jit.script once, which warns (a
# DeprecationWarning in torch 2.13, a FutureWarning in 2.15).
_JIT_SCRIPT_DEPRECATED = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")


@_JIT_SCRIPT_DEPRECATED
@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian"])
def test_forward_mode_through_a_collective_is_refused_by_name(transform: str) -> None:
    # Collectives have no forward-mode rule: torch raised NotImplementedError ("You must
    # implement the jvp function for custom autograd.Function"), naming no collective.
    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return fdp.psum(((x @ w).tanh() ** 2).sum(), "i")

    def differentiate(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if transform == "jvp":
            return torch.func.jvp(lambda w: loss(w, x), (w,), (torch.ones_like(w),))[1]
        return getattr(torch.func, transform)(loss)(w, x)

    # One replica: forward-mode AD is not run by several threads at once, and only the missing
    # rule can fail.
    f = fdp.pmap(differentiate, in_axes=(None, 0), axis_name="i", devices=cpus(1), out_axes=None)
    with pytest.raises(RuntimeError, match=r"fdp.psum was differentiated in forward mode .*jacrev"):
        f(torch.randn(3), torch.randn(4, 3))


@_JIT_SCRIPT_DEPRECATED
def test_forward_mode_around_the_call_gives_the_one_device_tangents(devices: list[str]) -> None:
    # docs/concepts.md: forward-mode AD is unsafe inside replicas, but works around the call.
    import torch.autograd.forward_ad as fwad

    x, w = torch.randn(9, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    tx, tw = torch.randn_like(x), torch.randn_like(w)
    mapped = fdp.pmap(
        lambda x, w: torch.tanh(x @ w) * fdp.psum(x.sum(), "i"),
        in_axes=(0, None),
        axis_name="i",
        devices=devices,
    )
    with fwad.dual_level():
        got = fwad.unpack_dual(mapped(fwad.make_dual(x, tx), fwad.make_dual(w, tw))).tangent
        xd, wd = fwad.make_dual(x, tx), fwad.make_dual(w, tw)
        expected = fwad.unpack_dual(torch.tanh(xd @ wd) * xd.sum()).tangent
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
