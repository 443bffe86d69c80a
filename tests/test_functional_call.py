"""fdp.functional_call: torch.func.functional_call's results, safe in threads, never touching the module."""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import functools
import gc
import threading
import warnings
import weakref

import pytest
import torch
from helpers import assert_trees_close, collect_when_workers_rest, cpus
from torch import nn

import fdp
from fdp import _functional_call


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.scale = 1.0

    def forward(self, x):
        return self.norm(self.fc(x)) * self.scale


def random_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: torch.randn_like(v) for k, v in module.named_parameters()}


def test_matches_torch_func() -> None:
    net = Net().eval()
    params = random_params(net)
    x = torch.randn(5, 4)
    torch.testing.assert_close(
        fdp.functional_call(net, params, (x,)), torch.func.functional_call(net, params, (x,))
    )
    torch.testing.assert_close(
        fdp.functional_call(net, params, x), torch.func.functional_call(net, params, x)
    )


def test_module_is_untouched() -> None:
    net = Net()
    before = {k: v for k, v in net.state_dict(keep_vars=True).items()}
    fdp.functional_call(net, random_params(net), (torch.randn(5, 4),))
    after = net.state_dict(keep_vars=True)
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)


def test_threads_never_see_each_others_weights() -> None:
    # torch.func.functional_call swaps into the shared module: 20 of 40 results were wrong.
    net = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    params = [{"weight": torch.full((8, 8), float(i)), "bias": torch.zeros(8)} for i in range(8)]
    failures: list[int] = []
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        barrier.wait()
        for _ in range(50):
            out = fdp.functional_call(net, params[i], (x,))
            if not torch.allclose(out, x @ params[i]["weight"].T):
                failures.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_changes_to_the_module_between_calls_are_seen() -> None:
    net = Net()
    params = random_params(net)
    x = torch.randn(6, 4)
    fdp.functional_call(net, params, (x,))
    net.eval()
    net.scale = 3.0
    torch.testing.assert_close(
        fdp.functional_call(net, params, (x,)), torch.func.functional_call(net, params, (x,))
    )
    net.norm = nn.Identity()  # a replaced submodule: the skeleton is rebuilt
    torch.testing.assert_close(
        fdp.functional_call(net, params, (x,)), (x @ params["fc.weight"].T + params["fc.bias"]) * 3.0
    )


def test_parameters_not_given_come_from_the_module() -> None:
    net = nn.Linear(3, 2)
    weight = torch.zeros(2, 3)
    torch.testing.assert_close(
        fdp.functional_call(net, {"weight": weight}, (torch.ones(1, 3),)), net.bias.detach()[None]
    )


def test_tied_weights_and_strict() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2, bias=False)
            self.b = nn.Linear(2, 2, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    net = Tied()
    w = torch.eye(2) * 2
    torch.testing.assert_close(
        fdp.functional_call(net, {"a.weight": w}, (torch.ones(1, 2),)), torch.full((1, 2), 4.0)
    )
    with pytest.raises(RuntimeError, match="Missing key"):
        fdp.functional_call(net, {}, (torch.ones(1, 2),), strict=True)


# --- the direct swap into the skeleton, and where torch.func.functional_call's own handling runs --


def _both(module: nn.Module, params: dict, *args, **kwargs):
    """fdp's and torch's results (or exceptions) for the same call, each with its own dict."""
    results = []
    for call in (fdp.functional_call, torch.func.functional_call):
        given = dict(params)
        try:
            results.append((call(module, given, args, **kwargs), given))
        except Exception as error:  # noqa: BLE001 - compared below
            results.append((type(error), str(error)))
    return results


def test_a_plain_tree_takes_the_direct_swap_and_matches_torch() -> None:
    net = Net()
    skeleton = _functional_call._checkout(net)
    assert skeleton.by_path is not None and set(skeleton.by_path) == {"", "fc", "norm"}
    _functional_call._release(net, skeleton)
    params = {**random_params(net), "norm.running_mean": torch.randn(3)}
    (ours, ours_given), (theirs, theirs_given) = _both(net, params, torch.randn(5, 4))
    torch.testing.assert_close(ours, theirs)
    # BatchNorm updated the given running statistics in place, in both.
    torch.testing.assert_close(ours_given["norm.running_mean"], theirs_given["norm.running_mean"])


@pytest.mark.parametrize("tied", [False, True])
def test_a_buffer_that_forward_reassigns_comes_back_in_the_callers_dict(tied: bool) -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros(()))
            if tied:
                self.register_buffer("count_too", self.count)

        def forward(self, x):
            self.count = self.count + 1  # a new tensor, not an in-place change
            return x * self.count

    (ours, ours_given), (theirs, theirs_given) = _both(Counter(), {"count": torch.tensor(4.0)}, torch.ones(2))
    torch.testing.assert_close(ours, theirs)
    assert ours_given["count"].item() == theirs_given["count"].item() == 5.0


def test_a_submodule_reached_by_two_paths_takes_the_direct_swap_and_matches_torch() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2, bias=False)
            self.b = self.a  # one module, two names: its weight is tied to itself

        def forward(self, x):
            return self.b(self.a(x))

    net = Shared()
    skeleton = _functional_call._checkout(net)
    assert skeleton.by_path is not None and set(skeleton.tied) == {"a.weight", "b.weight"}
    _functional_call._release(net, skeleton)
    x = torch.ones(1, 2)
    (ours, _), (theirs, _) = _both(net, {"b.weight": torch.eye(2) * 3}, x)
    torch.testing.assert_close(ours, theirs)
    # Two different values for one tied tensor: torch refuses, and so does fdp.
    conflicting = {"a.weight": torch.eye(2), "b.weight": torch.eye(2) * 3}
    ours, theirs = _both(net, conflicting, x)
    assert ours[0] is theirs[0] and issubclass(ours[0], Exception) and ours[1] == theirs[1]


class TiedLM(nn.Module):
    """Tied weights as language models tie them (the embedding is the output layer), a buffer
    under two names, a submodule under two names, and a three-way tie."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.proj = nn.Linear(3, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(()))
        self.proj.register_buffer("scale_too", self.scale)
        self.again = self.proj
        self.third = nn.Linear(5, 5, bias=False)
        self.fourth = nn.Linear(5, 5, bias=False)
        self.fourth.weight = self.third.weight
        self.sixth = nn.Linear(5, 5, bias=False)
        self.sixth.weight = self.third.weight

    def forward(self, tokens):
        h = torch.tanh(self.again(self.proj(self.embed(tokens)))) * self.proj.scale_too
        return self.sixth(self.fourth(self.third(self.head(h)))) * self.scale


@pytest.mark.parametrize("tie_weights", [True, False])
def test_tied_weights_take_the_direct_swap_and_match_torch(tie_weights: bool) -> None:
    net = TiedLM()
    tokens = torch.tensor([[0, 1, 4], [2, 3, 3]])
    skeleton = _functional_call._checkout(net)
    assert skeleton.by_path is not None
    assert {"embed.weight", "head.weight", "proj.weight", "again.weight", "scale", "proj.scale_too"} <= set(
        skeleton.tied
    )
    _functional_call._release(net, skeleton)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    w, p, t = torch.randn(5, 3, generator=g), torch.randn(3, 3, generator=g), torch.randn(5, 5, generator=g)
    s, other = torch.tensor(2.0), torch.randn(5, 3, generator=g)
    for params in (
        {"embed.weight": w},
        {"head.weight": w},
        {"embed.weight": w, "head.weight": w},  # every name, one value
        {"embed.weight": w, "head.weight": other},  # torch refuses: two values for one tensor
        {"again.weight": p},
        {"proj.weight": p, "again.weight": p},
        {"proj.scale_too": s},
        {"scale": s, "proj.weight": p},
        {"fourth.weight": t},
        {"third.weight": t, "fourth.weight": t},  # two of three names: left to torch
        {"third.weight": t, "fourth.weight": t, "sixth.weight": t},
    ):
        clones = {id(v): v.clone().requires_grad_(v.dim() > 0) for v in params.values()}
        leaves = {k: clones[id(v)] for k, v in params.items()}  # one tensor given twice stays one
        results = []
        # torch's call gets a twin: on a submodule under two names it leaves the given tensor
        # in the module (torch 2.13 restores the first name, then the second to the given one:
        # pytorch/pytorch#164759).
        for call, module in ((fdp.functional_call, net), (torch.func.functional_call, copy.deepcopy(net))):
            given = dict(leaves)
            try:
                out = call(module, given, (tokens,), tie_weights=tie_weights)
            except Exception as error:  # noqa: BLE001 - compared below
                results.append((type(error), str(error)))
                continue
            wrt = [v for v in leaves.values() if v.requires_grad]
            grads = torch.autograd.grad(out.square().sum(), wrt, allow_unused=True) if wrt else []
            # (The given dicts are not compared: where torch leaves a tensor in the module, it
            # also writes the module's own tensor back into the dict, for a name it restored.)
            results.append((out.detach(), [None if g is None else g.detach() for g in grads]))
        ours, theirs = results
        if isinstance(theirs[0], type):
            assert ours == theirs, params
        else:
            assert_trees_close(ours, theirs, msg=params)
        for k, v in net.state_dict().items():  # fdp's module untouched
            assert torch.equal(v, before[k]), k


def test_tied_tensors_renamed_between_calls_of_one_skeleton_are_seen() -> None:
    class Renamed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2, bias=False)
            self.b = nn.Module()
            self.b.register_parameter("x", self.a.weight)  # tied to a.weight
            self.b.register_parameter("y", nn.Parameter(torch.randn(2, 2)))

        def forward(self, v):
            out = self.a(v)
            for scale, (_, p) in zip((10, 100), sorted(self.b.named_parameters(recurse=False))):
                out = out + scale * v @ p.T  # by name: x, then y
            return out

    net, v = Renamed(), torch.ones(1, 2)
    given = {"a.weight": torch.eye(2)}

    def check() -> None:
        for _ in range(2):
            torch.testing.assert_close(
                fdp.functional_call(net, given, (v,)),
                torch.func.functional_call(copy.deepcopy(net), given, (v,)),
            )

    check()
    x, y = net.b.x, net.b.y
    del net.b.x, net.b.y
    net.b.register_parameter("y", x)  # the same tensors in the same order, the names swapped
    net.b.register_parameter("x", y)
    check()
    del net.b.x  # only one name left in b, the tied one
    check()


def test_a_backward_hook_may_set_attributes_on_a_copy_it_holds() -> None:
    from torch.nn.utils import parametrize

    class Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(0, 1)

    seen: list[torch.Tensor] = []

    def remember(module, grad_input, grad_output):
        module.last_grad = grad_output[0]  # on the copy, which the call has emptied
        seen.append(module.last_grad)

    net = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    parametrize.register_parametrization(net[2], "weight", Symmetric())  # torch's own swap runs
    net[0].register_full_backward_hook(remember)
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    x = torch.ones(3, 2, requires_grad=True)  # else torch warns that the hook fires on outputs
    fdp.functional_call(net, params, (x,)).sum().backward()
    assert len(seen) == 1 and seen[0].shape == (3, 2)


def test_submodules_shared_inside_each_other_too_often_are_left_to_torch() -> None:
    class Pair(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.left = self.right = inner

        def forward(self, x):
            return self.left(x)

    net: nn.Module = nn.Linear(2, 2)
    for _ in range(12):  # 2**12 paths to the Linear
        net = Pair(net)
    skeleton = _functional_call._checkout(net)
    assert skeleton.by_path is None
    _functional_call._release(net, skeleton)
    name = "left." * 12 + "weight"
    ours, theirs = _both(net, {name: torch.eye(2)}, torch.ones(1, 2), tie_weights=False)
    torch.testing.assert_close(ours[0], theirs[0])


def test_a_module_inside_itself_is_left_to_torch() -> None:
    net = Net()
    net.fc.owner = net  # a cycle: torch's walk for tied names never ends
    skeleton = _functional_call._checkout(net)
    assert skeleton.by_path is None
    _functional_call._release(net, skeleton)
    params = {"fc.weight": torch.ones(3, 4)}
    for tie_weights in (True, False):
        ours, theirs = _both(net, params, torch.randn(2, 4), tie_weights=tie_weights)
        if tie_weights:
            assert ours[0] is theirs[0] is RecursionError
        else:
            torch.testing.assert_close(ours[0], theirs[0])


def test_parametrized_modules_and_unusual_arguments_are_left_to_torch() -> None:
    from torch.nn.utils import parametrize

    class Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(0, 1)

    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    parametrize.register_parametrization(net[0], "weight", Symmetric())
    skeleton = _functional_call._checkout(net)
    assert skeleton.by_path is None
    _functional_call._release(net, skeleton)
    x = torch.randn(2, 3)
    (ours, _), (theirs, _) = _both(net, {"0.bias": torch.ones(3)}, x)
    torch.testing.assert_close(ours, theirs)

    plain = Net().eval()
    weights, biases = {"fc.weight": torch.ones(3, 4)}, {"fc.bias": torch.zeros(3)}
    x = torch.randn(2, 4)
    torch.testing.assert_close(  # a sequence of dicts
        fdp.functional_call(plain, (weights, biases), x),
        torch.func.functional_call(plain, (weights, biases), x),
    )
    for params in (
        {"fc.weight": torch.ones(3, 4), "not.a.name": torch.ones(1)},  # set as an attribute
        {"fc.weight": torch.ones(3, 4), "scale": torch.tensor(2.0)},  # an attribute, not a buffer
        {"fc.weight": "not a tensor"},
    ):
        ours, theirs = _both(plain, params, torch.randn(2, 4))
        if isinstance(theirs[0], torch.Tensor):
            torch.testing.assert_close(ours[0], theirs[0])
        else:
            assert ours == theirs
        assert not hasattr(plain, "not") and plain.scale == 1.0  # the module itself untouched


def test_submodules_rearranged_between_calls_are_checked_again() -> None:
    # The skeleton meets its copies in the order the module had when it was built: a module
    # moved under a later one is met before its new parent, and its tensors (here tied to the
    # other module's) must still be looked at.
    net = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Sequential(nn.Linear(2, 2, bias=False)))
    x = torch.randn(3, 2)
    fdp.functional_call(net, random_params(net), (x,))
    a, b = net[0], net[1][0]
    net[0], net[1][0] = b, a
    a.weight = b.weight
    params = {"0.weight": torch.randn(2, 2)}
    torch.testing.assert_close(
        fdp.functional_call(net, params, (x,)), torch.func.functional_call(net, params, (x,))
    )


def test_every_change_to_the_tree_between_calls_of_one_skeleton_is_seen() -> None:
    # The skeleton keeps what it worked out about the tree while the tree's names, submodules
    # and tensors stay the same: each change below must be seen at the next call.
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2, bias=False)
            self.a.inner = nn.Linear(2, 2, bias=False)  # used by no forward
            self.b = nn.Linear(2, 2, bias=False)

        def forward(self, x):
            for layer in self.children():  # whatever their names
                x = layer(x)
            return x

    net, x = Pair(), torch.randn(3, 2)
    given = {"a.weight": torch.randn(2, 2)}
    fdp.functional_call(net, given, (x,))
    (skeleton,) = _functional_call._FREE[net]

    def check(**names: torch.Tensor) -> None:
        for _ in range(2):  # the second call on the skeleton the first one refreshed
            ours, theirs = _both(net, {**given, **names}, x)
            if isinstance(theirs[0], torch.Tensor):
                torch.testing.assert_close(ours[0], theirs[0])
            else:
                assert ours == theirs
        assert _functional_call._FREE[net] == [skeleton]  # not rebuilt: the modules are the same
        assert skeleton.by_path is not None  # ties included

    check()
    net.a, net.b = net.b, net.a  # the names swapped: "a.weight" is the other module's now
    check()
    net.b.weight = net.a.weight  # tied: the given weight is both modules'
    check()
    check(**{"b.weight": torch.eye(2)})
    net.b.weight = nn.Parameter(torch.randn(2, 2))  # untied again
    check()
    net.c = net.a  # one module under two names
    check()
    check(**{"c.weight": torch.eye(2)})
    del net.c
    check()
    del net.a.weight
    net.a.register_buffer("weight", torch.randn(2, 2))  # a buffer now, under the same name
    check()
    inner = next(m.inner for m in (net.a, net.b) if "inner" in m._modules)
    net.a.inner = net.b.inner = None
    check(**{"a.inner.weight": torch.eye(2), "b.inner.weight": torch.eye(2)})
    del net.a.inner, net.b.inner
    net.b.inner = inner  # under the module met after the one it was built under
    check(**{"a.inner.weight": torch.eye(2)})
    check(**{"b.inner.weight": torch.eye(2)})
    net.a.inner = net.b.inner
    del net.b.inner
    check(**{"a.inner.weight": torch.eye(2)})
    check(**{"b.inner.weight": torch.eye(2)})
    net.c = net.b  # renamed, the children's order unchanged
    del net.b
    check(**{"b.weight": torch.eye(2)})
    check(**{"c.weight": torch.eye(2)})


def test_hooks_of_one_call_of_a_skeleton_reach_no_later_call() -> None:
    # A copy's empty hook dicts serve its next call (see _Skeleton.refresh): a hook that a call
    # leaves on a copy must not run in the next, nor keep what it refers to alive, and hooks
    # the module gains or loses between calls must be seen.
    seen: list[str] = []

    class Leaving(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.leave = False

        def forward(self, x):
            if self.leave:  # registered on the copy, never removed
                payload = torch.empty(0)
                self.fc.register_forward_hook(lambda *_: seen.append(f"left {payload.shape}"))
                self.fc.register_forward_pre_hook(lambda *_: None)
            return self.fc(x)

    net, x = Leaving(), torch.randn(3, 2)
    params = random_params(net)
    fdp.functional_call(net, params, (x,))
    (skeleton,) = _functional_call._FREE[net]
    net.leave = True
    fdp.functional_call(net, params, (x,))
    assert seen == ["left torch.Size([0])"]
    net.leave = False
    for _ in range(2):
        fdp.functional_call(net, params, (x,))
    assert seen == ["left torch.Size([0])"]  # the hook left by the second call ran in it alone
    assert _functional_call._FREE[net] == [skeleton]  # the same skeleton, every call
    assert not any(skeleton._kept_hooks)  # idle, it holds no hook

    handle = net.fc.register_forward_hook(lambda *_: seen.append("the module's"))
    fdp.functional_call(net, params, (x,))
    handle.remove()
    fdp.functional_call(net, params, (x,))
    assert seen == ["left torch.Size([0])", "the module's"]
    assert not net.fc._forward_hooks and not net.fc._forward_pre_hooks


def test_a_hook_that_a_call_leaves_keeps_nothing_alive() -> None:
    class Big:
        pass

    class Leaving(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            big = Big()
            refs.append(weakref.ref(big))
            self.fc.register_forward_hook(lambda *_: big)
            return self.fc(x)

    refs: list[weakref.ref[Big]] = []
    net = Leaving()
    for _ in range(2):  # the second call on the skeleton the first one left
        fdp.functional_call(net, random_params(net), (torch.randn(3, 2),))
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_submodule_whose_class_changed_between_calls_runs_its_new_forward() -> None:
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    net, x = nn.Sequential(nn.Linear(2, 2)), torch.randn(3, 2)
    fdp.functional_call(net, {}, (x,))
    net[0].__class__ = Doubled
    torch.testing.assert_close(fdp.functional_call(net, {}, (x,)), torch.func.functional_call(net, {}, (x,)))
    torch.testing.assert_close(fdp.functional_call(net, {}, (x,)), 2 * nn.Linear.forward(net[0], x))


def test_a_scripted_module_gets_torchs_refusal() -> None:
    with warnings.catch_warnings():  # torch.jit is deprecated, and says so
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated")
        scripted = torch.jit.script(nn.Linear(2, 2))
    ours, theirs = _both(scripted, {}, torch.randn(3, 2))
    assert ours == theirs and ours[0] is RuntimeError and "Jitted modules" in ours[1]


def test_a_scripted_submodule_is_refused_saying_why() -> None:
    # torch.func.functional_call swaps into its C++ object, which every copy shares: no
    # private copy of it exists. Refused by name, not with an AttributeError about
    # 'OrderedDictWrapper'.
    with warnings.catch_warnings():  # torch.jit is deprecated, and says so
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated")
        net = nn.Sequential(nn.ReLU(), nn.Sequential(torch.jit.script(nn.Linear(2, 2))))
    with pytest.raises(TypeError, match=r"fdp.functional_call: '1.0' is a scripted module"):
        fdp.functional_call(net, {"1.0.weight": torch.eye(2)}, (torch.randn(3, 2),))


class Checkpointed(nn.Module):
    """Activation checkpointing inside forward: backward calls ``self.a`` again."""

    def __init__(self, checkpoint: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 1)
        self.checkpoint = checkpoint

    def forward(self, x):
        if self.checkpoint:
            h = torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False)
        else:
            h = self.a(x)
        return self.b(torch.tanh(h))


def checkpointed_grads(call, net: nn.Module, seed: int) -> list[torch.Tensor]:
    """Gradients of two calls of ``net`` with different tensors, differentiated together: each
    call's recomputation in backward must use that call's own tensors."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, generator=g)
    p1, p2 = (
        {k: torch.randn(v.shape, generator=g).requires_grad_() for k, v in net.named_parameters()}
        for _ in range(2)
    )
    loss = call(net, p1, (x,)).sum() + call(net, p2, (x,)).sum()
    return list(torch.autograd.grad(loss, [*p1.values(), *p2.values()]))


def unchecked(net: nn.Module, params: dict, args: tuple) -> torch.Tensor:
    """The oracle: the same computation on a twin of ``net`` that recomputes nothing."""
    twin = copy.deepcopy(net)
    twin.checkpoint = False
    return torch.func.functional_call(twin, params, args)


def test_activation_checkpointing_inside_forward_recomputes_with_the_calls_own_tensors() -> None:
    net = Checkpointed()
    for ours, expected in zip(
        checkpointed_grads(fdp.functional_call, net, 0), checkpointed_grads(unchecked, net, 0)
    ):
        torch.testing.assert_close(ours, expected)


def test_checkpointing_with_tied_weights_and_shared_submodules() -> None:
    net = Checkpointed()
    net.b.weight = nn.Parameter(net.a.weight[:1].detach().clone())
    net.c = net.a  # a submodule under two names
    net.register_parameter("tied", net.b.bias)  # a tensor under two names
    for ours, expected in zip(
        checkpointed_grads(fdp.functional_call, net, 0), checkpointed_grads(unchecked, net, 0)
    ):
        torch.testing.assert_close(ours, expected)


def test_checkpointing_where_torchs_own_swap_runs_raises_in_backward_saying_why() -> None:
    from torch.nn.utils import parametrize

    class Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(0, 1)

    net = Checkpointed()
    parametrize.register_parametrization(net.a, "weight", Symmetric())
    with pytest.raises(AttributeError, match="most likely activation checkpointing"):
        checkpointed_grads(fdp.functional_call, net, 0)
    assert len(_functional_call._FREE.get(net, [])) == 0  # the held skeletons were not reused


def test_lstm_uses_the_given_weights() -> None:
    lstm = nn.LSTM(3, 4)
    params = random_params(lstm)
    x = torch.randn(2, 5, 3)
    torch.testing.assert_close(
        fdp.functional_call(lstm, params, (x,)), torch.func.functional_call(lstm, params, (x,))
    )


def test_skeletons_hold_no_tensor_memory_and_are_cached() -> None:
    net = Net()
    for _ in range(10):
        fdp.functional_call(net, random_params(net), (torch.randn(5, 4),))
    assert len(_functional_call._FREE[net]) == 1
    skeleton = _functional_call._checkout(net)  # the cached one, refreshed
    try:
        root = skeleton.root
        assert root is not net and root.fc is not net.fc
        assert root.fc._parameters["weight"] is net.fc.weight  # the original tensor, no copy
    finally:
        _functional_call._release(net, skeleton)
    assert all(vars(copy) == {} for _, copy in skeleton._pairs)  # idle: holds nothing


@dataclasses.dataclass(eq=True, unsafe_hash=True)
class _Scaled(nn.Module):
    """A module that == and hash compare by its fields, as a dataclass with unsafe_hash does:
    two of the same factor are equal, whatever their weights."""

    factor: float = 1.0

    def __post_init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.factor


def test_modules_equal_by_value_each_run_as_themselves() -> None:
    # Skeletons are kept by module in a weak dictionary, which finds keys by == and hash: a
    # module equal to another got that one's skeleton, refreshed from that one, and ran with
    # its weights and attributes, silently.
    first, second = _Scaled(2.0), _Scaled(2.0)
    assert first == second and hash(first) == hash(second)
    x = torch.randn(4, 2)
    for _ in range(2):
        for module in (first, second, first):
            torch.testing.assert_close(fdp.functional_call(module, {}, (x,)), module(x))
            params = {"linear.weight": torch.randn(2, 2)}
            torch.testing.assert_close(
                fdp.functional_call(module, params, (x,)), x @ params["linear.weight"].T * 2.0
            )
        for module in (first, second):  # a pmapped module's replicas call it functionally too
            torch.testing.assert_close(fdp.pmap(module, devices=cpus(2))({}, x), module(x))
    # Equal modules collected leave no skeletons behind under the key of the first.
    for _ in range(5):
        fdp.functional_call(_Scaled(2.0), {}, (x,))
    collect_when_workers_rest()
    fdp.functional_call(first, {}, (x,))
    assert all(s.original() is not None for s in _functional_call._FREE[first])


def test_skeletons_die_with_the_module() -> None:
    net = Net()
    fdp.functional_call(net, random_params(net), (torch.randn(5, 4),))
    ref = weakref.ref(net)
    del net
    gc.collect()
    assert ref() is None


def test_skeletons_die_with_a_module_that_refers_to_itself() -> None:
    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.register_forward_pre_hook(self.pre)  # a bound method: refers back to the module

        def pre(self, module, args):
            return None

        def forward(self, x):
            return self.fc(x)

    net = Hooked()
    fdp.functional_call(net, random_params(net), (torch.randn(3, 2),))
    ref = weakref.ref(net)
    del net
    gc.collect()
    assert ref() is None


def test_skeletons_die_with_a_parametrized_module() -> None:
    # torch.nn.utils.parametrize gives the module a class of its own whose properties close
    # over it: a skeleton's copy, of that class, refers to the module through its type.
    net = nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))
    fdp.functional_call(net, dict(net.named_parameters()), (torch.randn(2, 4),)).sum().backward()
    refs = [weakref.ref(net), weakref.ref(net.parametrizations.weight.original0)]
    del net
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_parametrized_modules_skeleton_is_reused_and_dies_with_it() -> None:
    # Idle, its copy sheds the class parametrize made for the module (which refers to it);
    # rebuilt on every call instead, the skeleton cost a parametrized model half as much again.
    net = nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))
    params, x = dict(net.named_parameters()), torch.randn(2, 4)
    fdp.functional_call(net, params, (x,))
    (skeleton,) = _functional_call._FREE[net]
    for _ in range(2):
        torch.testing.assert_close(fdp.functional_call(net, params, (x,)), net(x))
        assert _functional_call._FREE[net] == [skeleton]
    ref = weakref.ref(net)
    del net, params, skeleton
    gc.collect()
    assert ref() is None


def test_a_parametrization_removed_and_registered_again_between_calls() -> None:
    net = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 3)), nn.Tanh())
    x = torch.randn(2, 4)
    torch.testing.assert_close(fdp.functional_call(net, {}, (x,)), net(x))
    nn.utils.parametrize.remove_parametrizations(net[0], "weight")
    assert type(net[0]) is nn.Linear
    torch.testing.assert_close(fdp.functional_call(net, {}, (x,)), net(x))
    nn.utils.parametrizations.spectral_norm(net[0]).eval()
    torch.testing.assert_close(fdp.functional_call(net, {}, (x,)), net(x))
    nn.utils.parametrize.remove_parametrizations(net[0], "weight")
    torch.testing.assert_close(fdp.functional_call(net, {}, (x,)), net(x))
    assert not hasattr(net[0], "parametrizations")


def test_grad_through_functional_call() -> None:
    net = nn.Linear(3, 1)
    params = {k: v.detach().requires_grad_() for k, v in net.named_parameters()}
    x = torch.randn(4, 3)
    grads = torch.func.grad(lambda p: fdp.functional_call(net, p, (x,)).sum())(params)
    torch.testing.assert_close(grads["weight"], x.sum(0, keepdim=True))


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        fdp.functional_call(lambda x: x, {}, ())  # type: ignore[arg-type]


def test_stateful_call_never_modifies_the_module() -> None:
    bn = nn.BatchNorm1d(3)
    before = {k: v.clone() for k, v in bn.named_buffers()}
    out, new = fdp.stateful_call(bn, dict(bn.named_parameters()), {}, (torch.randn(6, 3),))
    assert all(torch.equal(before[k], v) for k, v in bn.named_buffers())
    assert set(new) == set(before) and int(new["num_batches_tracked"]) == 1


def test_stateful_call_returns_a_buffer_that_forward_reassigns() -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x):
            self.steps = self.steps + 1  # a new tensor, not an in-place change
            return x

    net = Counting()
    _, new = fdp.stateful_call(net, {}, {"steps": torch.tensor(4.0)}, (torch.ones(2),))
    assert new["steps"].item() == 5.0 and net.steps.item() == 0.0


def test_under_torch_compile_it_is_one_graph_of_the_given_tensors() -> None:
    """Traced, the call is torch.func.functional_call's: one graph whose inputs are the given
    tensors (the skeleton cache's lock would break it), and the module keeps its own."""
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    params = {k: torch.randn_like(v) for k, v in model.named_parameters()}
    x = torch.randn(5, 3)
    call = torch.compile(lambda p, x: 2 * fdp.functional_call(model, p, (x,)), backend=record)
    try:
        torch.testing.assert_close(call(params, x), 2 * torch.func.functional_call(model, params, (x,)))
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1  # the caller's code and the module's forward, unbroken
    torch.testing.assert_close(dict(model.named_parameters()), before)


def test_under_torch_compile_a_graph_break_in_forward_is_refused() -> None:
    """Broken, the compiled call would swap the given tensors into the module that other
    threads use: torch.compile raises instead, and the module keeps its own tensors."""
    torch._dynamo.reset()

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return h * 2 if h.sum() > 0 else h  # data-dependent: a graph break

    model = Branchy()
    weight = model.lin.weight
    params = {k: torch.randn_like(v) for k, v in model.named_parameters()}
    call = torch.compile(lambda p, x: fdp.functional_call(model, p, (x,)), backend="eager")
    try:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="Data-dependent branching"):
            call(params, torch.randn(2, 3))
    finally:
        torch._dynamo.reset()
    assert model.lin.weight is weight


def test_stateful_call_uses_buffers_given_in_params() -> None:
    # A dict of parameters and buffers, as torch.func.functional_call takes: its buffers are
    # the ones to run with (and to update), not the module's own.
    bn = nn.BatchNorm1d(3).eval()
    given = {"running_mean": torch.randn(3), "running_var": torch.rand(3) + 0.5}
    params = {**dict(bn.named_parameters()), **given}
    x = torch.randn(6, 3)
    out, new = fdp.stateful_call(bn, params, {}, (x,))
    torch.testing.assert_close(out, torch.func.functional_call(bn, params, (x,)))
    torch.testing.assert_close(new["running_mean"], given["running_mean"])
    assert new["running_mean"] is not given["running_mean"]  # a copy, as for ``buffers``
    _, new = fdp.stateful_call(bn.train(), params, {}, (x,))
    expected = 0.9 * given["running_mean"] + 0.1 * x.mean(0)
    torch.testing.assert_close(new["running_mean"], expected)
    assert int(new["num_batches_tracked"]) == 1


def test_stateful_call_runs_without_buffers_given_as_none_in_params() -> None:
    # As torch.func.functional_call takes them: BatchNorm without running statistics uses the
    # batch's. (Taken from params, None was cloned: AttributeError.)
    bn = nn.BatchNorm1d(3).eval()
    params = {**dict(bn.named_parameters()), "running_mean": None, "running_var": None}
    x = torch.randn(6, 3)
    out, new = fdp.stateful_call(bn, params, {}, (x,))
    torch.testing.assert_close(out, torch.func.functional_call(bn, params, (x,)))
    assert new["running_mean"] is None and new["running_var"] is None
    with pytest.raises(TypeError, match="is not an instance of torch.Tensor"):
        fdp.stateful_call(bn, {**params, "num_batches_tracked": 5}, {}, (x,))


def symmetric_linear() -> nn.Sequential:
    """A Linear(3, 3) in a Sequential, its weight parametrized to be symmetric."""
    from torch.nn.utils import parametrize

    class Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(0, 1)

        def right_inverse(self, w):
            return w.triu()

    net = nn.Sequential(nn.Linear(3, 3))
    parametrize.register_parametrization(net[0], "weight", Symmetric())
    return net


def test_a_parametrized_tensor_given_by_its_own_name_never_touches_the_module() -> None:
    # Given "weight" (not "parametrizations.weight.original"), torch's swap sets the
    # parametrization's original through right_inverse, in place (Tensor.set_): in the module's
    # own tensor, which other threads were reading (wrong results, or a crash), unless the
    # skeleton holds one of its own.
    net = symmetric_linear()
    original = net[0].parametrizations.weight.original
    before, version = original.detach().clone(), original._version
    seen_during_the_call: list[bool] = []
    net[0].register_forward_hook(lambda *_: seen_during_the_call.append(torch.equal(original, before)))
    weight = torch.randn(3, 3)
    weight = weight + weight.T
    x = torch.randn(2, 3)
    out = fdp.functional_call(net, {"0.weight": weight}, (x,))
    torch.testing.assert_close(out, x @ weight.T + net[0].bias)
    assert seen_during_the_call == [True]
    assert original._version == version and torch.equal(original, before)
    torch.testing.assert_close(net(x), x @ before.triu().add(before.triu(1).T).T + net[0].bias)


def test_a_parametrized_tensor_given_with_its_originals_leaves_them_as_they_were() -> None:
    # A full state dict with "weight" added (fdp.pmap(module) completes params so): torch swaps
    # the given original in, sets it in place through right_inverse, and puts back by value
    # only what the skeleton held. A fresh original there left the given one, the module's
    # own here, holding the given weight for good.
    net = symmetric_linear()
    original = net[0].parametrizations.weight.original
    before = original.detach().clone()
    weight = torch.randn(3, 3)
    weight = weight + weight.T
    x = torch.randn(2, 3)
    out = fdp.functional_call(net, {**dict(net.named_parameters()), "0.weight": weight}, (x,))
    torch.testing.assert_close(out, x @ weight.T + net[0].bias)
    assert torch.equal(original, before)


def test_replicas_changing_the_modules_own_buffers_in_place_is_an_error() -> None:
    # BatchNorm in training mode, its buffers not given: every replica updated the module's own
    # running statistics, shared by all, on top of the others' (2 replicas: 2 batches counted).
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    params = dict(model.named_parameters())
    x = torch.randn(8, 3)
    f = fdp.pmap(lambda p, x: fdp.functional_call(model, p, (x,)), in_axes=(None, 0), devices=["cpu"] * 2)
    with pytest.raises(
        RuntimeError,
        match=r"fdp.functional_call: forward changed the module's own buffer '1.num_batches_tracked' "
        r"in place, in replica \d of 2, but the replicas share .*fdp.stateful_call",
    ):
        f(params, x)
    # Given, the buffers are the caller's to share or not: each replica gets its own copies here.
    model[1].reset_running_stats()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    g = fdp.pmap(
        lambda p, b, x: fdp.stateful_call(model, p, b, (x,))[1]["1.num_batches_tracked"],
        in_axes=(None, None, 0),
        devices=["cpu"] * 2,
    )
    assert g(params, buffers, x).tolist() == [1, 1]
    # One replica shares with no one; in evaluation mode nothing changes.
    one = fdp.pmap(lambda p, x: fdp.functional_call(model, p, (x,)), in_axes=(None, 0), devices=["cpu"])
    model[1].reset_running_stats()
    one(params, x)
    assert int(model[1].num_batches_tracked) == 1
    model.eval()
    f(params, x)
    assert int(model[1].num_batches_tracked) == 1


def test_a_parametrization_changing_the_modules_own_buffers_in_place_is_an_error() -> None:
    # A parametrized module goes through torch.func.functional_call's own swap: spectral_norm's
    # power iteration, in training mode, updated the shared _u and _v from every replica at once,
    # with no error (each replica's outputs then depended on how many iterations the others ran).
    model = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(3, 4))
    params = dict(model.named_parameters())
    x = torch.randn(8, 3)
    f = fdp.pmap(lambda p, x: fdp.functional_call(model, p, (x,)), in_axes=(None, 0), devices=["cpu"] * 2)
    with pytest.raises(
        RuntimeError,
        match=r"fdp.functional_call: forward changed the module's own buffers "
        r"'parametrizations\.weight\.0\._u', 'parametrizations\.weight\.0\._v' in place, in replica \d of 2",
    ):
        f(params, x)
    # Given (here in a sequence of dicts), they are the caller's: pmap's own check names them.
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    with pytest.raises(
        RuntimeError, match=r"modified args\[0\]\[1\]\['parametrizations\.weight\.0\._u'\] in place"
    ):
        f([params, buffers], x)
    model.eval()  # no power iteration
    torch.testing.assert_close(f(params, x), model(x))


@pytest.mark.parametrize("given", ["a sequence of dicts", "a name that is no tensor's"])
def test_own_buffers_changed_in_place_are_an_error_where_torch_swaps_too(given: str) -> None:
    # Such params go through torch.func.functional_call's own swap, as a parametrized module
    # does: the check covers every module there, not only parametrized ones.
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    own = dict(model.named_parameters())
    params = [own] if given == "a sequence of dicts" else {**own, "extra": None}
    f = fdp.pmap(lambda p, x: fdp.functional_call(model, p, (x,)), in_axes=(None, 0), devices=["cpu"] * 2)
    with pytest.raises(
        RuntimeError, match=r"forward changed the module's own buffer '1\.num_batches_tracked'"
    ):
        f(params, torch.randn(8, 3))


def test_own_buffers_made_in_inference_mode_are_no_error_in_replicas() -> None:
    # Inference tensors keep no version counter: reading one raised "Inference tensors do not
    # track version counter" on every call of several replicas, where fdp's check looked.
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()
    params = {k: v.clone() for k, v in model.named_parameters()}
    x = torch.randn(8, 3)
    f = fdp.pmap(lambda p, x: fdp.functional_call(model, p, (x,)), in_axes=(None, 0), devices=["cpu"] * 2)
    with torch.no_grad():
        torch.testing.assert_close(f(params, x), torch.func.functional_call(model, params, (x,)))


def test_a_shared_sync_batch_norm_updating_its_own_buffers_is_no_error() -> None:
    # fdp.SyncBatchNorm shared by the replicas writes one update, the same on every replica:
    # nothing races, and its statistics are the whole batch's, as on one device.
    model = fdp.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), "i")
    reference = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    reference.load_state_dict(model.state_dict())
    params = dict(model.named_parameters())
    x = torch.randn(8, 3)
    f = fdp.pmap(
        lambda p, x: fdp.functional_call(model, p, (x,)),
        in_axes=(None, 0),
        axis_name="i",
        devices=["cpu"] * 2,
    )
    torch.testing.assert_close(f(params, x), reference(x))
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buffer)


@pytest.mark.parametrize(("params", "got"), [(None, "NoneType: None"), ("module", "Linear: Linear(")])
def test_params_that_are_no_dict_are_named(params: object, got: str) -> None:
    # torch.func.functional_call's words, "Expected parameter_and_buffer_dicts to be a dict, or a
    # list/tuple of dicts", named neither the call nor the argument.
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError) as info:
        fdp.functional_call(model, model if params == "module" else params, (torch.ones(1, 3),))
    message = str(info.value)
    assert message.startswith(
        "fdp.functional_call: params must be a dict of tensors by name (or a sequence of such "
        f"dicts), got {got}"
    ), message
    # A sequence of dicts is torch's other form, and stays allowed.
    params_and_buffers = ({"weight": torch.ones(2, 3)}, {"bias": torch.zeros(2)})
    torch.testing.assert_close(
        fdp.functional_call(model, params_and_buffers, (torch.ones(1, 3),)), torch.full((1, 2), 3.0)
    )


@pytest.mark.parametrize("layer", [nn.BatchNorm1d, nn.Linear], ids=["with buffers", "without"])
@pytest.mark.parametrize(
    ("which", "value", "got"),
    [
        ("params", None, "NoneType: None"),
        ("buffers", None, "NoneType: None"),
        ("params", [{}], r"list: \[\{\}\]"),
    ],
)
def test_stateful_call_names_params_or_buffers_that_are_no_dict(
    layer: type[nn.Module], which: str, value: object, got: str
) -> None:
    # {**None} said only "'NoneType' object is not a mapping" (for params, of a module without
    # buffers or a list of dicts, even where the check stood).
    module = layer(2, 2) if layer is nn.Linear else layer(2)
    given = {"params": dict(module.named_parameters()), "buffers": dict(module.named_buffers()), which: value}
    with pytest.raises(
        TypeError, match=rf"^fdp\.stateful_call: {which} must be a dict of tensors by name, got {got}$"
    ):
        fdp.stateful_call(module, given["params"], given["buffers"], (torch.randn(4, 2),))  # type: ignore[arg-type]


class _NoClone(torch.Tensor):
    def clone(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise TypeError("_NoClone cannot be cloned")


def test_stateful_call_leaves_a_buffers_own_type_error_as_it_is() -> None:
    # A TypeError from a buffer's clone() was taken for params or buffers that are no dict,
    # where params are a mapping that is no Mapping (nn.ParameterDict, which ** takes).
    bn = nn.BatchNorm1d(2)
    buffers = dict(bn.named_buffers())
    buffers["running_mean"] = torch.zeros(2).as_subclass(_NoClone)
    with pytest.raises(TypeError, match=r"^_NoClone cannot be cloned$"):
        fdp.stateful_call(bn, nn.ParameterDict(dict(bn.named_parameters())), buffers, (torch.randn(4, 2),))  # type: ignore[arg-type]


def test_stateful_call_names_a_module_that_is_no_module() -> None:
    # module.named_buffers() said "'function' object has no attribute 'named_buffers'".
    with pytest.raises(
        TypeError, match=r"^fdp\.stateful_call: module must be a torch.nn.Module, got function$"
    ):
        fdp.stateful_call(lambda x: x, {}, {}, (torch.ones(1),))  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "got"), [([1], r"list: \[1\]"), (3, "int: 3")])
def test_functional_call_names_kwargs_that_are_no_dict(kwargs: object, got: str) -> None:
    # Refused by forward's call as "Linear(...) argument after ** must be a mapping, not list",
    # naming neither the call nor the argument.
    model = nn.Linear(3, 2)
    with pytest.raises(
        TypeError,
        match=r"^fdp\.functional_call: kwargs must be a dict of keyword arguments for forward or None, "
        rf"got {got}$",
    ):
        fdp.functional_call(model, dict(model.named_parameters()), (torch.ones(1, 3),), kwargs)  # type: ignore[arg-type]


class Stored(nn.Module):
    """A module whose forward runs ``self.act``: an attribute that reaches the module's tree."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.out = nn.Linear(2, 1)
        self.kind = kind
        self.act = STORED[kind](self)

    def _impl(self, x, scale=1.0):
        return self.out(torch.tanh(self.lin(x))) * scale

    def forward(self, x):
        override = self.__dict__.get("override")
        if override is not None:
            return override(x)
        act = self.act
        if self.kind in ("list", "tuple"):
            act = act[1]
        elif self.kind in ("dict", "nested"):
            act = act["f"]
        elif self.kind == "modules":
            return self._impl(x) + act[0](x).sum(-1, keepdim=True)
        elif self.kind == "method of a submodule":
            return self.out(act(x))
        return act(x)


STORED = {
    "method of self": lambda m: m._impl,
    "method of a submodule": lambda m: m.lin.forward,
    "partial": lambda m: functools.partial(m._impl, scale=2.0),
    "closure": lambda m: lambda x: m._impl(x) * 3,
    "list": lambda m: [torch.relu, m._impl],
    "tuple": lambda m: (None, m._impl),
    "dict": lambda m: {"f": m._impl, "n": 3},
    "nested": lambda m: {"f": functools.partial(functools.partial(m._impl), scale=[0.5][0])},
    "modules": lambda m: [m.lin],  # a module of the tree in a plain list
}


@pytest.mark.parametrize("kind", list(STORED))
def test_attributes_that_reach_the_modules_tree_run_on_the_given_tensors(kind: str) -> None:
    # They ran the original module, on its own tensors: nonzero where torch gives zero.
    net = Stored(kind)
    x = torch.randn(5, 2)
    zeros = {k: torch.zeros_like(v) for k, v in net.named_parameters()}
    assert fdp.functional_call(net, zeros, (x,)).abs().sum() == 0
    params = {k: torch.randn_like(v).requires_grad_() for k, v in net.named_parameters()}
    ours = fdp.functional_call(net, params, (x,))
    expected = torch.func.functional_call(net, params, (x,))
    torch.testing.assert_close(ours, expected)
    # Gradients reach the given tensors, as torch's, and none reaches the module's own.
    grads = torch.autograd.grad(ours.sum(), list(params.values()))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), list(params.values())))
    assert all(p.grad is None for p in net.parameters())
    assert net.act is not None and all(p is not params[k] for k, p in net.named_parameters())


def double(x):
    return 2 * x


def test_attributes_that_reach_the_tree_set_between_calls_are_seen() -> None:
    # What was found is kept while the attributes stay the same: every kind of change is seen.
    net = Stored("list")
    net.act = [None, double]
    x = torch.randn(5, 2)
    zeros = {k: torch.zeros_like(v) for k, v in net.named_parameters()}

    def check() -> None:
        torch.testing.assert_close(
            fdp.functional_call(net, zeros, (x,)), torch.func.functional_call(net, zeros, (x,))
        )

    check()
    net.act[1] = net._impl  # changed in place: the same list
    check()
    net.act = [None, torch.sin]
    check()
    net.act = (None, net._impl)  # the same attribute given another value
    check()
    net.act = [None, double]
    check()
    check()  # (from here on compared with what was kept, not looked at)
    net.override = net._impl  # a new attribute
    check()
    del net.override
    net.spare = 1
    check()
    check()  # (from here on compared with what was kept, not looked at)
    del net.spare
    net.override = functools.partial(net._impl)  # as many attributes as before, one of them new
    check()
    del net.override
    net.lin.scale = torch.ones(1)  # a value that cannot be kept: lin is looked at on every call
    check()
    net.kind = "method of a submodule"
    net.lin.alias = net.lin.forward
    net.act = lambda x: net.lin.alias(x)
    check()


def test_containers_inside_themselves_or_shared_many_times_are_looked_into_once() -> None:
    net = Stored("list")
    net.act = [None, net._impl]
    net.act += [net.act] * 20  # a list inside itself
    shared: list = [net._impl]
    for _ in range(40):  # 20**40 ways to the innermost list
        shared = [shared] * 20
    net.shared = shared
    x = torch.randn(5, 2)
    zeros = {k: torch.zeros_like(v) for k, v in net.named_parameters()}
    assert fdp.functional_call(net, zeros, (x,)).abs().sum() == 0


def test_a_stored_bound_method_keeps_no_module_alive() -> None:
    net = Stored("method of self")
    fdp.functional_call(net, {}, (torch.randn(3, 2),))
    ref = weakref.ref(net)
    del net
    gc.collect()
    assert ref() is None


def test_a_container_that_cannot_be_rebuilt_around_a_copy_is_refused() -> None:
    net = Stored("dict")
    net.lin.act = collections.OrderedDict(f=net._impl)
    with pytest.raises(
        TypeError,
        match=r"fdp.functional_call: module.lin.act holds a module of the tree.*collections.OrderedDict",
    ):
        fdp.functional_call(net, {}, (torch.randn(3, 2),))


def test_replicas_each_run_a_stored_bound_method_on_their_own_tensors() -> None:
    # Each replica is given a weight of its own: one that ran on another replica's (or on the
    # module's own) would show.
    net = Stored("partial")
    x = torch.randn(2, 3, 2)
    weights = torch.randn(2, 2, 2)

    def step(weight, x):
        return fdp.functional_call(net, {"lin.weight": weight[0]}, (x[0],))

    mapped = fdp.pmap(step, devices=["cpu", "cpu"])
    expected = torch.cat(
        [torch.func.functional_call(net, {"lin.weight": weights[i]}, (x[i],)) for i in range(2)]
    )
    for _ in range(20):
        torch.testing.assert_close(mapped(weights, x), expected)
    # A pmapped module: every replica runs on the given tensors.
    zeros = {k: torch.zeros_like(v) for k, v in net.named_parameters()}
    assert fdp.pmap(net, devices=["cpu", "cpu"])(zeros, x.flatten(0, 1)).abs().sum() == 0


class CheckpointedStored(Stored):
    checkpoint = True

    def forward(self, x):
        if not self.checkpoint:
            return self.act(x)
        return torch.utils.checkpoint.checkpoint(self.act, x, use_reentrant=False)


def test_checkpointing_a_stored_bound_method_with_tied_weights() -> None:
    # The recomputation in backward runs the rebound method again, on the call's own tensors.
    net = CheckpointedStored("partial")
    net.register_parameter("tied", net.lin.weight)  # a tensor under two names
    net.again = net.lin  # a submodule under two names
    x = torch.randn(4, 2)
    p1, p2 = ({k: torch.randn_like(v).requires_grad_() for k, v in net.named_parameters()} for _ in range(2))

    def grads(call):
        loss = call(net, p1, (x,)).sum() + call(net, p2, (x,)).sum()
        return torch.autograd.grad(loss, [*p1.values(), *p2.values()])

    ours = grads(fdp.functional_call)
    # The oracle recomputes nothing (torch's own call would recompute with the module's own
    # tensors) and runs on a twin per call (torch 2.13 leaves a tensor in a submodule under
    # two names: pytorch/pytorch#164759).
    net.checkpoint = False
    torch.testing.assert_close(ours, grads(lambda *a: torch.func.functional_call(copy.deepcopy(net), *a[1:])))


class Unprintable:
    """A dict key whose repr fails (as a costly one would take long): only a message may ask."""

    def __repr__(self) -> str:
        raise AssertionError("a key spelled out on a call that succeeds")


def test_attributes_are_looked_at_without_spelling_out_where_they_are() -> None:
    # A module holding tensors in a plain dict is looked at on every call: the key paths are
    # for the error message, not worked out for every item of every call.
    net = Stored("dict")
    net.table = {Unprintable(): torch.ones(1), "items": [torch.ones(1)] * 3, "f": net._impl}
    net.act = {"f": net.table["f"], "n": [(Unprintable(), torch.zeros(1))]}
    x = torch.randn(3, 2)
    zeros = {k: torch.zeros_like(v) for k, v in net.named_parameters()}
    for _ in range(2):
        assert fdp.functional_call(net, zeros, (x,)).abs().sum() == 0
    # The message still names where.
    net.table = {Unprintable(): collections.OrderedDict(f=net._impl)}
    with pytest.raises(TypeError, match=r"module\.table\[<Unprintable>\] holds a module of the tree"):
        fdp.functional_call(net, zeros, (x,))


class Helper:
    """An object outside the module's tree, with a method a module may store."""

    factor = 3.0

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Kind(enum.Enum):
    DOUBLE = 2.0


Pair = collections.namedtuple("Pair", ["f", "k"])


def closure_of(k: float):
    return lambda x: x * k


UNRELATED = {
    "method of another object": (lambda: Helper().scale, lambda v, y: v(y)),
    "enum": (lambda: Kind.DOUBLE, lambda v, y: y * v.value),
    "class": (lambda: nn.Tanh, lambda v, y: v()(y)),
    "partial of a function": (lambda: functools.partial(torch.mul, other=2.0), lambda v, y: v(y)),
    "closure": (lambda: closure_of(2.0), lambda v, y: v(y)),
    "namedtuple": (lambda: Pair(torch.tanh, 2.0), lambda v, y: v.f(y) * v.k),
    "OrderedDict": (lambda: collections.OrderedDict(f=torch.tanh, k=2.0), lambda v, y: v["f"](y) * v["k"]),
}


@pytest.mark.parametrize("kind", list(UNRELATED))
def test_attributes_that_reach_nothing_of_the_tree_reach_the_copy_as_they_are(kind: str) -> None:
    # Nothing in them to bind to the copy: the very object, not one rebuilt around it.
    make, use = UNRELATED[kind]
    seen = []

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.value = make()

        def forward(self, x):
            seen.append(self.value)
            return use(self.value, self.lin(x))

    net = Holder()
    x = torch.randn(5, 2)
    params = random_params(net)
    for _ in range(2):  # built, then kept
        torch.testing.assert_close(
            fdp.functional_call(net, params, (x,)), torch.func.functional_call(net, params, (x,))
        )
    assert all(value is net.value for value in seen)
