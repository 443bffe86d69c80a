"""fdp.grad and fdp.value_and_grad: torch.func.grad's gradients (the oracle), by autograd."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from helpers import assert_trees_close
from torch import nn

import fdp


def model_and_batch() -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return model, params, torch.randn(6, 4), torch.randint(0, 3, (6,))


def loss_of(model: nn.Module):  # type: ignore[no-untyped-def]
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(fdp.functional_call(model, params, (x,)), y)

    return loss


def test_gradients_are_torch_func_grads_bit_for_bit() -> None:
    model, params, x, y = model_and_batch()
    loss = loss_of(model)
    got = fdp.grad(loss)(params, x, y)
    assert_trees_close(got, torch.func.grad(loss)(params, x, y), rtol=0, atol=0)
    assert all(not g.requires_grad for g in got.values())
    assert all(not p.requires_grad for p in params.values())  # the caller's tensors are untouched


def test_argnums_has_aux_and_the_value() -> None:
    model, params, x, y = model_and_batch()

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        logits = fdp.functional_call(model, params, (x,))
        return nn.functional.cross_entropy(logits, y), {"logits": logits}

    for argnums in (0, (0, 1), (1,)):
        ours = fdp.value_and_grad(loss, argnums=argnums, has_aux=True)(params, x, y)
        grads, (value, aux) = torch.func.grad_and_value(loss, argnums=argnums, has_aux=True)(params, x, y)
        assert_trees_close(ours, ((value, aux), grads), rtol=0, atol=0)
        assert isinstance(ours[1], tuple) == isinstance(argnums, tuple)
        assert not ours[0][0].requires_grad and not ours[0][1]["logits"].requires_grad
        only_grads, only_aux = fdp.grad(loss, argnums=argnums, has_aux=True)(params, x, y)
        assert_trees_close((only_grads, only_aux), (grads, aux), rtol=0, atol=0)
    value, grads = fdp.value_and_grad(lambda w: (w**2).sum())(torch.tensor([1.0, 2.0]))
    assert value.item() == 5.0 and grads.tolist() == [2.0, 4.0]


def test_unused_inputs_get_zeros_and_no_grad_mode_does_not_matter() -> None:
    params = {"w": torch.ones(2), "unused": torch.ones(3)}
    with torch.no_grad():
        got = fdp.grad(lambda p: (p["w"] * 3).sum())(params)
    assert got["w"].tolist() == [3.0, 3.0] and got["unused"].tolist() == [0.0] * 3
    # A value that depends on none of the inputs: zeros, as torch.func.grad gives.
    got = fdp.grad(lambda p: torch.tensor(1.0))(params)
    assert_trees_close(got, torch.func.grad(lambda p: torch.tensor(1.0))(params), rtol=0, atol=0)


def test_inference_mode_and_inference_tensors_are_differentiated_as_by_torch_func_grad() -> None:
    # Under inference mode autograd records nothing, enable_grad or not: the gradients were
    # zeros. An inference tensor cannot require grad: differentiating one was refused.
    f = lambda w, b: (w**2).sum() + (w * b).sum()  # noqa: E731
    w, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    expected = torch.func.grad(f, argnums=(0, 1))(w, b)
    with torch.inference_mode():
        assert_trees_close(fdp.grad(f, argnums=(0, 1))(w, b), expected, rtol=0, atol=0)
        inference_w, inference_b = w.clone(), b.clone()
    assert_trees_close(fdp.grad(f, argnums=(0, 1))(inference_w, inference_b), expected, rtol=0, atol=0)


def test_a_batch_made_under_inference_mode_is_differentiated_through_as_by_torch_func_grad() -> None:
    # Not differentiated, but saved for the backward of the differentiated argument: autograd
    # refuses that ("Inference tensors cannot be saved for backward"), torch.func.grad does not.
    # Under inference mode the batch is usually an inference tensor, as an argument or closed over.
    f = lambda w, x: ((x @ w) ** 2).sum()  # noqa: E731
    w = torch.tensor([1.0, -2.0, 0.5])
    with torch.inference_mode():
        x = torch.arange(12.0).reshape(4, 3)
        got = [fdp.grad(f)(w, x), fdp.grad(lambda w: f(w, x))(w), fdp.grad(f)(w, x=x)]
    got.append(fdp.grad(f)(w, x))  # an inference tensor outside inference mode
    expected = torch.func.grad(f)(w, x.clone())
    for g in got:
        assert_trees_close(g, expected, rtol=0, atol=0)


def test_a_collective_inside_is_differentiated_as_under_torch_func_grad() -> None:
    # pmean of the loss inside the differentiated function: its backward is the transposed
    # collective on every replica. By plain autograd the collective's own hook would refuse it.
    model, params, x, y = model_and_batch()
    loss = loss_of(model)

    def global_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return fdp.pmean(loss(params, x, y), "i", weight=x.shape[0]) + fdp.psum(params["0.bias"].sum(), "i")

    results = {}
    for name, grad in (("fdp", fdp.grad), ("torch.func", torch.func.grad)):
        step = fdp.pmap(
            lambda p, x, y, grad=grad: grad(global_loss)(p, x, y),
            axis_name="i",
            devices=["cpu"] * 3,
            in_axes=(None, 0, 0),
            out_axes=fdp.PER_REPLICA,
        )
        results[name] = step(params, x[:5], y[:5])  # shards of 2, 2 and 1 rows
    for k in params:
        for ours, theirs in zip(results["fdp"][k].values, results["torch.func"][k].values):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_a_pmap_inside_is_differentiated_as_by_backward() -> None:
    # The pmapped call's replica 0 runs in fdp.grad's own thread: its collectives must take the
    # form of the other replicas' (differentiated as a whole by autograd, as loss.backward()
    # does), not the form of collectives fdp.grad differentiates inside a replica.
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    centred = fdp.pmap(
        lambda w, x: (x @ w) - fdp.pmean((x @ w).mean(), "i"),
        axis_name="i",
        devices=["cpu"] * 2,
        in_axes=(None, 0),
    )

    def one_device(w: torch.Tensor) -> torch.Tensor:  # the shards have 3 and 2 rows
        h = x @ w
        return ((h - (h[:3].mean() + h[3:].mean()) / 2) ** 2).sum()

    w = torch.tensor([1.0, 2.0, 3.0])
    got = fdp.grad(lambda w: (centred(w, x) ** 2).sum())(w)
    torch.testing.assert_close(got, torch.func.grad(one_device)(w))
    # An argument that requires grad makes it torch.func.grad (an outer autograd could follow
    # it), which refuses the pmapped call; under no_grad no outer autograd can, as documented.
    parameter = nn.Parameter(w.clone())
    with pytest.raises(RuntimeError, match=r"was called under a torch.func transform"):
        fdp.grad(lambda w: (centred(w, x) ** 2).sum())(parameter)
    with torch.no_grad():
        got = fdp.grad(lambda w: (centred(w, x) ** 2).sum())(parameter)
    torch.testing.assert_close(got, torch.func.grad(one_device)(w))


def test_gradients_of_gradients_nest() -> None:
    f = lambda w: (w**3).sum()  # noqa: E731
    w = torch.tensor([1.0, 2.0])
    second = fdp.grad(lambda w: fdp.grad(f)(w).sum())(w)
    assert_trees_close(second, torch.func.grad(lambda w: torch.func.grad(f)(w).sum())(w), rtol=0, atol=0)
    assert second.tolist() == [6.0, 12.0]


def test_under_vmap_it_is_torch_func_grad() -> None:
    model, params, x, y = model_and_batch()
    loss = loss_of(model)

    def per_example(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss(params, x[None], y[None])

    ours = torch.func.vmap(fdp.grad(per_example), in_dims=(None, 0, 0))(params, x, y)
    theirs = torch.func.vmap(torch.func.grad(per_example), in_dims=(None, 0, 0))(params, x, y)
    assert_trees_close(ours, theirs, rtol=0, atol=0)


@dataclasses.dataclass
class _Params:  # a plain dataclass: a node for fdp, a leaf for torch.func's pytrees
    w: torch.Tensor
    frozen: None


def test_nested_and_under_vmap_it_takes_the_trees_of_the_autograd_path() -> None:
    # There it is torch.func.grad, whose pytrees would refuse a dataclass or a None ("must be
    # Tensor") and a non-tensor in aux: given fdp's leaves, it takes what fdp.grad takes alone.
    w = torch.tensor([1.0, 2.0])

    def f(p: _Params) -> tuple[torch.Tensor, dict]:
        return (p.w**3).sum(), {"rows": 2, "w": p.w}

    def first(p: _Params) -> torch.Tensor:
        (value, aux), grads = fdp.value_and_grad(f, has_aux=True)(p)
        assert aux["rows"] == 2 and isinstance(grads, _Params) and grads.frozen is None
        return grads.w.sum()

    second = fdp.grad(first)(_Params(w, None))
    assert isinstance(second, _Params) and second.frozen is None
    assert second.w.tolist() == [6.0, 12.0]
    per_row = torch.func.vmap(lambda w: fdp.grad(first)(_Params(w, None)).w)(torch.stack([w, 2 * w]))
    assert per_row.tolist() == [[6.0, 12.0], [12.0, 24.0]]


def test_compiled_it_traces_in_one_graph() -> None:
    model, params, x, y = model_and_batch()
    loss = loss_of(model)
    compiled = torch.compile(fdp.grad(loss), backend="aot_eager", fullgraph=True)
    assert_trees_close(compiled(params, x, y), fdp.grad(loss)(params, x, y), rtol=1e-6, atol=1e-7)


def test_compiled_it_takes_the_trees_it_takes_eagerly() -> None:
    # A None leaf in the argument and a non-tensor in aux, which torch.func.grad given them
    # directly refuses: compiled, it is given fdp's leaves, as nested or under vmap.
    def f(p: dict, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return ((p["w"] * x) ** 2).sum(), {"rows": x.shape[0], "w": p["w"]}

    transform = fdp.value_and_grad(f, has_aux=True)
    compiled = torch.compile(transform, backend="aot_eager", fullgraph=True)
    params, x = {"w": torch.tensor([1.0, 2.0]), "frozen": None}, torch.tensor([[1.0, 3.0]])
    (value, aux), grads = compiled(params, x)
    (want_value, want_aux), want_grads = transform(params, x)
    assert value.item() == want_value.item() and aux["rows"] == want_aux["rows"] == 1
    assert grads["frozen"] is None and grads["w"].tolist() == want_grads["w"].tolist() == [2.0, 36.0]


@pytest.mark.parametrize("argnums", [[0], (), 0.0])
def test_argnums_is_checked_when_the_transform_is_built(argnums: object) -> None:
    with pytest.raises(TypeError, match=r"^fdp.grad: argnums must be an int or a non-empty tuple of ints"):
        fdp.grad(lambda w: w.sum(), argnums=argnums)  # type: ignore[arg-type]


def test_has_aux_needs_a_pair() -> None:
    with pytest.raises(TypeError, match=r"fn must return a \(value, aux\) pair, got"):
        fdp.value_and_grad(lambda w: w.sum(), has_aux=True)(torch.ones(2))


@pytest.mark.parametrize("where", ["alone", "requiring grad", "under vmap"])
def test_the_value_is_checked_wherever_it_runs(where: str) -> None:
    # Where it is torch.func.grad, torch's own check let an integer value through (zero
    # gradients, silently) and refused others in its own words: the same TypeError everywhere.
    w = torch.ones(3, requires_grad=where == "requiring grad")
    for value, got in [
        (lambda w: (w > 0).sum(), r"shape \(\) and dtype torch.int64"),
        (lambda w: w, r"shape \(3,\)"),
    ]:
        with pytest.raises(
            TypeError,
            match=r"^fdp.grad\(fn\)\(\*args\): fn must return a real floating-point scalar tensor "
            r"\(a loss\), got a tensor of " + got,
        ):
            if where == "under vmap":
                torch.func.vmap(fdp.grad(value))(w[None])
            else:
                fdp.grad(value)(w)


def test_an_outer_backward_through_the_gradients_sees_what_it_sees_through_torch_func_grads() -> None:
    # An argument that requires grad (the differentiated one, or one beside it): the gradients
    # are torch.func.grad's, which an outer backward differentiates; by autograd on detached
    # copies that second-order term would be silently missing.
    def f(w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return ((w * c) ** 3).sum()

    def outer(grad: object) -> list[list[float]]:
        w = torch.tensor([1.0, 2.0], requires_grad=True)
        c = torch.tensor([0.5, 3.0], requires_grad=True)
        (grad(f)(w, c).square().sum() + w.sum()).backward()  # type: ignore[operator]
        return [w.grad.tolist(), c.grad.tolist()]  # type: ignore[union-attr]

    assert outer(fdp.grad) == outer(torch.func.grad)
    # Under no_grad no outer autograd can follow: the gradients by autograd, equal.
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    with torch.no_grad():
        assert fdp.grad(f)(w, torch.ones(2)).tolist() == torch.func.grad(f)(w, torch.ones(2)).tolist()


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = nn.Linear(3, 3), nn.Linear(3, 1)
        self.out.register_full_backward_hook(lambda module, grad_in, grad_out: None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.out(checkpoint(lambda h: torch.tanh(self.inner(h)), x, use_reentrant=False))


@pytest.mark.parametrize("why", ["requires grad", "inference mode", "dual level"])
def test_where_torch_func_grad_cannot_run_the_function_the_error_says_why_it_ran(why: str) -> None:
    # Activation checkpointing and full backward hooks, which torch.func.grad does not support
    # yet: by autograd fdp.grad takes them, but as torch.func.grad (parameters passed as they
    # are, requiring grad) it failed in torch.func's words, which named no fdp.grad.
    model, x = _Checkpointed(), torch.randn(4, 3)

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fdp.functional_call(model, params, (x,)).square().sum()

    detached = {k: v.detach() for k, v in model.named_parameters()}
    expected = fdp.grad(loss)(detached, x)  # by autograd
    torch.testing.assert_close(
        expected["inner.bias"],
        torch.autograd.grad(loss(dict(model.named_parameters()), x), model.inner.bias)[0],
    )
    with pytest.raises(RuntimeError, match="torch.func") as caught:
        if why == "requires grad":
            fdp.grad(loss)(dict(model.named_parameters()), x)
        elif why == "inference mode":
            with torch.inference_mode():
                fdp.grad(loss)(detached, x)
        else:
            with torch.autograd.forward_ad.dual_level():
                fdp.grad(loss)(detached, x)
    note = {
        "requires grad": r"fdp.grad ran as torch.func.grad here, as args\[0\]\['\S+'\] requires grad "
        r"under grad mode .*: pass the arguments detached .*, or call it under torch.no_grad\(\), to "
        r"have the gradients taken by torch.autograd.grad",
        "inference mode": r"fdp.grad ran as torch.func.grad here, as it was called under "
        r"torch.inference_mode, .*: call it outside inference mode to have the gradients taken by",
        "dual level": r"fdp.grad ran as torch.func.grad here, as a forward-mode dual level is open "
        r".*: call it outside the level to have the gradients taken by",
    }[why]
    assert any(re.fullmatch(note + ".*", n) for n in caught.value.__notes__), caught.value.__notes__


# (Forward mode loads torch's decompositions once, by torch.jit.script, which warns.)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_forward_mode_through_the_gradients_as_through_torch_func_grads() -> None:
    import torch.autograd.forward_ad as fwAD

    def f(w: torch.Tensor) -> torch.Tensor:
        return (w**3).sum()

    def tangent(grad: object) -> list[float]:
        with fwAD.dual_level():
            dual = fwAD.make_dual(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]))
            return fwAD.unpack_dual(grad(f)(dual)).tangent.tolist()  # type: ignore[operator]

    assert tangent(fdp.grad) == tangent(torch.func.grad) == [6.0, 12.0]
