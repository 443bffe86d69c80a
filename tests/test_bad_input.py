"""The bad-input catalogue (docs/errors.md): every way to call fdp wrongly gets a clear exception of
the right type naming the argument, and the failing call leaves its inputs as they were."""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import optree
import pytest
import torch
import torch.distributed as dist
from helpers import cpus, opaque
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import fdp


class ProcessGroup:
    """Stands in for torch.distributed's ProcessGroup in messages."""

    def __repr__(self) -> str:
        return "<ProcessGroup>"


def nested(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A nested tensor of torch's strided layout (its prototype warning silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor(tensors)


def jagged(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A nested tensor of torch's jagged layout (any prototype warning silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor(tensors, layout=torch.jagged)


def quantized(t: torch.Tensor, scale: float = 0.1) -> torch.Tensor:
    """``t`` quantized (torch's deprecation warning for quantized tensors silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(t, scale, 0, torch.quint8)


def packed_sequence(*lengths: int, enforce_sorted: bool = False) -> nn.utils.rnn.PackedSequence:
    """A PackedSequence of sequences of these lengths, of 2 features each."""
    return nn.utils.rnn.pack_sequence([torch.ones(n, 2) for n in lengths], enforce_sorted=enforce_sorted)


def sparse_embedding_gradient() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The params of an ``nn.Embedding(sparse=True)`` and their (sparse) gradients."""
    emb = nn.Embedding(10, 3, sparse=True)
    params = {"emb.weight": emb.weight}
    (grad,) = torch.autograd.grad(
        torch.func.functional_call(emb, {"weight": emb.weight}, (torch.tensor([1, 2]),)).sum(), [emb.weight]
    )
    return {k: v.detach() for k, v in params.items()}, {"emb.weight": grad}


def global_norm_takes_sparse() -> bool:
    """Whether this torch takes the global norm of sparse gradients (fdp refuses them where it
    fails, with a message of its own)."""
    params, grads = sparse_embedding_gradient()
    try:
        fdp.optim.clip_by_global_norm(1.0).update(grads, fdp.optim.EmptyState())
    except TypeError:
        return False
    return True


def pm(fn: Callable[..., Any], **options: Any) -> fdp.Pmapped:
    return fdp.pmap(fn, devices=options.pop("devices", cpus(2)), **options)


def yields_rows(x: torch.Tensor) -> Any:
    yield from x


async def doubles_later(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class YieldingModule(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        yield x


class NormalPolicy(nn.Module):
    """A policy whose forward returns a distribution, as RL code often does."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.distributions.Normal:
        return torch.distributions.Normal(self.mean(x), torch.ones(2))


class Twice:
    """A container registered with optree in two namespaces, neither of them fdp's."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


for _namespace in ("lib-a", "lib-b"):
    optree.register_pytree_node(
        Twice, lambda t: ((t.x,), None), lambda _, children: Twice(*children), namespace=_namespace
    )


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(0, 1)


def checkpointed_and_parametrized() -> nn.Module:
    """Checkpointing inside forward, on a parametrized layer: fdp.functional_call leaves the
    swap to torch.func.functional_call, whose skeleton is released before the recomputation."""
    from torch.nn.utils import parametrize

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False)

    net = Checkpointed()
    parametrize.register_parametrization(net.a, "weight", Symmetric())
    return net


def released_copy_in_backward(x: torch.Tensor) -> None:
    net = checkpointed_and_parametrized()
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    fdp.functional_call(net, params, (x,)).sum().backward()


def grad_through_psum(x: torch.Tensor) -> torch.Tensor:
    total = fdp.psum(x, "i")
    torch.autograd.grad(total.sum(), x)
    return x


class BumpsInPlace(nn.Module):
    """Changes a buffer in place in forward, in any mode."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("high", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.high.add_(1)
        return x


def renormalizing_embedding() -> nn.Embedding:
    """An embedding whose forward renormalizes, in place, the rows it looks up (all of norm > 1)."""
    emb = nn.Embedding(4, 3, max_norm=1.0)
    with torch.no_grad():
        emb.weight.fill_(1.0)
    return emb


class StoresMethods(nn.Module):
    """Keeps bound methods of itself in an OrderedDict, which fdp cannot rebuild around a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.lin.table = collections.OrderedDict(act=self.lin.forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin.table["act"](x)


class Takes2(nn.Linear):
    """A module whose forward takes a second argument, and leaves it alone."""

    def __init__(self) -> None:
        super().__init__(1, 1)

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


@dataclasses.dataclass
class Checked:
    """Checks its field as it is built: its __post_init__ reads the tensor's shape."""

    x: torch.Tensor

    def __post_init__(self) -> None:
        self.rows = self.x.shape[0]


class ListOfRows(list):  # type: ignore[type-arg]
    """A list subclass, which optree does not flatten."""


class EqualByValue(nn.Linear):
    """A module class that compares and hashes by value: two of them are equal."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))


# (id, inputs, call(inputs), exception type, message pattern)
CASES: list[tuple[str, Callable[[], Any], Callable[[Any], Any], type[BaseException], str]] = [
    (
        "mismatched sizes",
        lambda: (torch.zeros(4), {"y": torch.zeros(3)}),
        lambda a: pm(lambda x, d: x)(*a),
        ValueError,
        r"(?s)inconsistent sizes .*axis 0 of args\[1\]\['y'\] of type float32\[3\]",
    ),
    (
        "mismatched sizes",  # a table passed by keyword: mapped all the same (jax.pmap's #10465)
        lambda: (torch.zeros(4), torch.zeros(10, 3)),
        lambda a: pm(lambda x, table: x)(a[0], table=a[1]),
        ValueError,
        r"(?s)axis 0 of kwargs\['table'\] of type float32\[10,3\]\nKeyword arguments \(here "
        r"kwargs\['table'\]\) are always mapped along dim 0, as in jax.pmap: to give every replica all of "
        r"one, pass it positionally with axis None in in_axes; to split one along another dim .*$",
    ),
    (
        # An RNN's initial state by keyword (hx=, batch on axis 1): the advice was axis None,
        # which gives every replica the whole batch's state, for torch to refuse.
        "mismatched sizes",
        lambda: (torch.zeros(6, 5, 3), torch.zeros(1, 6, 4)),
        lambda a: fdp.pmap(nn.GRU(3, 4, batch_first=True), out_axes=(0, 1), devices=cpus(2))(
            {}, a[0], hx=a[1]
        ),
        ValueError,
        r"(?s)axis 0 of kwargs\['hx'\] of type float32\[1,6,4\]\nKeyword arguments \(here "
        r"kwargs\['hx'\]\) are always mapped along dim 0, as in jax.pmap: to give every replica all of "
        r"one, pass it positionally with axis None in in_axes; to split one along another dim \(an RNN's "
        r"initial hidden state, whose batch is on axis 1\), pass it positionally with that axis$",
    ),
    (
        # A causal mask (L, S) as a keyword argument, split along axis 0 like the batch: the
        # message named it, but not how to give it to every replica whole.
        "mismatched sizes",
        lambda: (torch.zeros(4, 5, 8), torch.ones(5, 5, dtype=torch.bool)),
        lambda a: pm(lambda q, attn_mask: q)(a[0], attn_mask=a[1]),
        ValueError,
        r"(?s)inconsistent sizes .*axis 0 of kwargs\['attn_mask'\] of type bool\[5,5\]\nKeyword arguments "
        r"\(here kwargs\['attn_mask'\]\) are always mapped along dim 0, as in jax.pmap: to give every "
        r"replica all of one, pass it positionally with axis None in in_axes; to split one "
        r"along another dim .*$",
    ),
    (
        "mismatched sizes",
        lambda: (torch.zeros(4, 5, 8), torch.ones(5, 5, dtype=torch.bool)),
        lambda a: fdp.DataParallel(Takes2(), device_ids=cpus(2))(a[0], other=a[1]),
        ValueError,
        r"(?s)inconsistent sizes .*kwargs\['other'\] is a keyword argument, which fdp.DataParallel splits as "
        r"it splits the others \(as nn.DataParallel does\): if every replica needs all of it, hold it on "
        r"the module instead of passing it$",
    ),
    (
        "in_axes longer than the arguments",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda x: x, in_axes=(0, 0))(*a),
        ValueError,
        r"in_axes specification must be a tree prefix of the tuple of positional arguments \(1 given\)",
    ),
    (
        "in_axes keys that do not match",
        lambda: ({"b": torch.zeros(4)},),
        lambda a: pm(lambda d: d, in_axes=({"a": 0},))(*a),
        ValueError,
        r"(?s)in_axes\[0\].*missing key\(s\)",
    ),
    (
        # jax.pmap's issue #6302: static arguments have in_axes entries too
        "in_axes without entries for the static arguments before a mapped one",
        lambda: (torch.zeros(4), torch.zeros(()), torch.zeros(4)),
        lambda a: pm(lambda x, w, k, y: x * w * k + y, static_argnums=2, in_axes=(0, None, 0))(
            a[0], a[1], 3, a[2]
        ),
        ValueError,
        r"(?s)\(4 given\).*in_axes has an entry for every positional argument up to the last mapped "
        r"one, the static ones among them included \(static_argnums=\(2,\); their entries are not "
        r"used\), as in jax.pmap: in_axes=\(0, None, None, 0\)$",
    ),
    (
        # jax.pmap's issue #26950: a specification for the one argument, not the tuple of them
        "one argument's in_axes not wrapped in a tuple",
        lambda: ({"a": torch.tensor(2.0), "b": torch.zeros(4)},),
        lambda a: pm(lambda d: d["a"] * d["b"], in_axes={"a": None, "b": 0})(*a),
        ValueError,
        r"(?s)\(1 given\).*in_axes describes the tuple of positional arguments, as in jax.pmap: for one "
        r"argument, wrap its specification in a tuple: in_axes=\(\{'a': None, 'b': 0\},\)$",
    ),
    (
        "one argument's in_axes not wrapped in a tuple",  # a list, which in_axes reads as the tuple
        lambda: ([torch.tensor(2.0), torch.zeros(4)],),
        lambda a: pm(lambda pair: pair[0] * pair[1], in_axes=[None, 0])(*a),
        ValueError,
        r"wrap its specification in a tuple: in_axes=\(\[None, 0\],\)$",
    ),
    (
        "out_axes longer than the output",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda x: (x, x), out_axes=(0, 0, 0))(*a),
        ValueError,
        "out_axes specification must be a tree prefix of the output",
    ),
    (
        # A jax.pmap habit: out_axes=1 there inserts the device axis at dim 1.
        "an int out_axes past an output's dims (`out_axes=1` on a vector, `out_axes=5` on a 0-dim output)",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda x: x, out_axes=1)(*a),
        ValueError,
        r"^fdp.pmap\(\S*<lambda>\): cannot concatenate output along out_axes 1: the replicas returned "
        r"float32\[2\], float32\[2\]; out_axes concatenates along an existing dim \(it inserts no new axis, "
        r"unlike jax.pmap's\): a dim in \[-1, 0\] fits$",
    ),
    (
        # Stacked along 0, silently: the 0-dim output's vector has no dim 5.
        "an int out_axes past an output's dims (`out_axes=1` on a vector, `out_axes=5` on a 0-dim output)",
        lambda: (torch.zeros(4, 2),),
        lambda a: pm(lambda x: {"loss": x.sum(), "y": x}, out_axes=5)(*a),
        ValueError,
        r"^fdp.pmap\(\S*<lambda>\): cannot stack output\['loss'\] along out_axes 5: the replicas returned "
        r"float32\[\], float32\[\]; 0-dim outputs are stacked into a new vector with one entry per replica, "
        r"and out_axes names a dim of it: a dim in \[-1, 0\] fits \(where the other outputs need out_axes 5, "
        r"give this one its own entry in an out_axes tree prefix\)$",
    ),
    (
        "an int out_axes past an output's dims (`out_axes=1` on a vector, `out_axes=5` on a 0-dim output)",
        lambda: (torch.zeros(4, 2),),
        lambda a: pm(lambda x: x.sum(), out_axes=-2, devices=cpus(1))(*a),
        ValueError,
        r"^fdp.pmap\(\S*<lambda>\): cannot stack output along out_axes -2: the replicas returned "
        r"float32\[\];",
    ),
    (
        "rank too small",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda x: x, in_axes=1)(*a),
        ValueError,
        r"map args\[0\] of type float32\[4\] along axis 1, so its rank should be at least 2",
    ),
    (
        "rank too small",  # a 0-dim tensor passed by keyword: mapped all the same
        lambda: (torch.zeros(4), torch.tensor(0.5)),
        lambda a: pm(lambda x, temperature: x / temperature)(a[0], temperature=a[1]),
        ValueError,
        r"map kwargs\['temperature'\] of type float32\[\] along axis 0, so its rank should be at least 1, "
        r"but it is only 0; keyword arguments \(here kwargs\['temperature'\]\) are always mapped along "
        r"dim 0, as in jax.pmap: to give every replica all of one, pass it positionally with axis None in "
        r"in_axes; to split one along another dim .*$",
    ),
    (
        "empty batch",
        lambda: ({"x": torch.zeros(0, 3)},),
        lambda a: pm(lambda d: d)(*a),
        ValueError,
        r"empty batch: axis 0 of args\[0\]\['x'\]",
    ),
    (
        "nothing mapped",
        lambda: (3, "text"),
        lambda a: pm(lambda n, s: n)(*a),
        ValueError,
        "found no tensor to map",
    ),
    (
        "non-tensor leaf in a collective",
        lambda: ({"x": torch.zeros(2), "name": "a"},),
        lambda a: pm(lambda d: fdp.psum(d, "i"), axis_name="i")(*a),
        TypeError,
        r"fdp.psum takes trees of tensors \(and numbers\), but x\['name'\] is a str",
    ),
    (
        "unknown device",
        lambda: (torch.zeros(2),),
        lambda a: fdp.pmap(lambda x: x, devices=["tpu"])(*a),
        ValueError,
        r"devices\[0\] is not a device: 'tpu'",
    ),
    (
        "unavailable device",
        lambda: (torch.zeros(2),),
        lambda a: fdp.pmap(lambda x: x, devices=["cpu", "cuda:7"])(*a),
        ValueError,
        r"devices\[1\] is 'cuda:7', but",
    ),
    (
        "collective outside a mapped function",
        lambda: (torch.zeros(2),),
        lambda a: fdp.psum(a[0], "i"),
        NameError,
        "unbound axis name: i",
    ),
    (
        "unbound axis name",
        lambda: (torch.zeros(2),),
        lambda a: pm(lambda x: fdp.pmean(x, "j"), axis_name="i")(*a),
        NameError,
        r"unbound axis name: j .*axis_name='i'",
    ),
    (
        "unbound axis name",
        lambda: (torch.zeros(2),),
        lambda a: pm(lambda x: fdp.pmean(x, "i"))(*a),
        NameError,
        r"^unbound axis name: i \(fdp.pmean: the function being mapped was given no axis_name: map it with "
        r"fdp.pmap\(..., axis_name='i'\)\)\n",
    ),
    (
        "unbound axis name",
        lambda: (torch.zeros(2),),
        lambda a: pm(lambda x: fdp.psum(x, ("i",)), axis_name="i")(*a),
        NameError,
        r"^unbound axis name: \('i',\) \(fdp.psum: the function being mapped has axis_name='i': collectives "
        r"take one axis name, not a tuple of them \(fdp.pmap maps one axis\): pass 'i'\)\n",
    ),
    (
        "non-hashable static argument",
        lambda: (torch.zeros(2), [1, 2]),
        lambda a: pm(lambda x, opts: x, static_argnums=1)(*a),
        TypeError,
        r"static arguments must be hashable.*args\[1\] of type list",
    ),
    (
        "static argument passed by keyword",
        lambda: (torch.zeros(2), torch.ones(2)),
        lambda a: pm(lambda x, table: x, static_argnums=1)(a[0], table=a[1]),
        ValueError,
        r"static_argnums=\(1,\), but entry 1 names no positional argument: this call passes only 1",
    ),
    (
        "nested pmap",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda x: pm(lambda y: y)(x))(*a),
        RuntimeError,
        "nested pmap",
    ),
    (
        "pmap under an outer torch.func transform",
        lambda: (torch.zeros(4),),
        lambda a: torch.func.grad(lambda x: pm(lambda y: y.sum(), out_axes=None)(x))(*a),
        RuntimeError,
        "called under a torch.func transform",
    ),
    (
        "in_axes leaf of the wrong type",
        lambda: (torch.zeros(2),),
        lambda a: pm(lambda x: x, in_axes=(0.0,))(*a),
        TypeError,
        r"in_axes\[0\] must be an int or None, got float",
    ),
    (
        "a dataclass fdp cannot rebuild, under a mapped axis",
        lambda: (opaque(),),
        lambda a: pm(lambda d: d.x)(*a),
        TypeError,
        r"args\[0\]: fdp cannot split the dataclass .*Opaque",
    ),
    (
        "in-place update of a replicated input",
        lambda: (torch.ones(4), torch.zeros(3)),
        lambda a: pm(lambda x, b: b.add_(1).sum() * 0 + x, in_axes=(0, None))(*a),
        RuntimeError,
        r"modified args\[1\] in place",
    ),
    (
        "replicas returning different non-tensor values",
        lambda: (torch.zeros(30),),
        lambda a: pm(lambda x: x.shape[0], devices=cpus(8))(*a),
        ValueError,
        r"different non-tensor values at output",
    ),
    (
        # Compared as values they never agreed: "different non-tensor values", two equal reprs.
        "replicas returning an object that holds tensors (a `torch.distributions` distribution)",
        lambda: (torch.zeros(4, 3),),
        lambda a: pm(lambda logits: {"pi": torch.distributions.Categorical(logits=logits)})(*a),
        TypeError,
        r"^fdp.pmap\(\S*<lambda>\): output\['pi'\]: the replicas returned a Categorical holding tensors "
        r"\(its attributes logits\), an object that fdp does not flatten, so fdp cannot join the tensors "
        r"in it. Return the tensors \(e.g. logits\) and build the Categorical from them after the call, "
        r"keep each replica's with out_axes=fdp.PER_REPLICA, or register Categorical with "
        r"optree.register_pytree_node\(..., namespace='fdp'\)$",
    ),
    (
        "replicas returning an object that holds tensors (a `torch.distributions` distribution)",
        lambda: (torch.zeros(4, 3),),
        lambda a: fdp.DataParallel(NormalPolicy(), device_ids=cpus(2))(*a),
        TypeError,
        r"^fdp.DataParallel: output: the replicas returned a Normal holding tensors \(its attributes "
        r"loc, scale\), .* build the Normal from them after the call, or register Normal with",
    ),
    (
        "a generator or coroutine function as the function to map",
        lambda: (torch.zeros(4),),
        lambda a: pm(yields_rows)(*a),
        TypeError,
        r"^fdp.pmap\(yields_rows\): the function is a generator function, whose body runs only as the "
        r"generator it returns is iterated: after the pmapped call, in the caller's thread, outside every "
        r"replica \(with no replica index, axis or device of its own\). Map a function that returns the "
        r"values themselves \(a tensor, or a list or tuple of them\), e.g. lambda \*args: "
        r"list\(yields_rows\(\*args\)\)$",
    ),
    (
        "a generator or coroutine function as the function to map",
        lambda: (torch.zeros(4),),
        lambda a: pm(doubles_later)(*a),
        TypeError,
        r"^fdp.pmap\(doubles_later\): the function is a coroutine function \(async def\), whose body "
        r"runs only as the coroutine it returns is awaited: .* Map a plain function \(def\): fdp runs "
        r"the replicas in threads, not on an event loop \(from async code, call the pmapped function in "
        r"a thread: await asyncio.to_thread\(pmapped, ...\)\)$",
    ),
    (
        "a generator or coroutine function as the function to map",
        lambda: (torch.zeros(4),),
        lambda a: pm(YieldingModule())({}, *a),
        TypeError,
        r"^fdp.pmap\(YieldingModule\): its forward is a generator function, .* Have forward return "
        r"the values themselves",
    ),
    (
        # A function that hides its kind (a lambda, a wrapper) is caught by what it returns, in
        # the replica: on one device too, where the generator would have come back as it was.
        "a replica returning a generator, a coroutine or a lazy `map`",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda x: (row for row in x), devices=cpus(1))(*a),
        TypeError,
        r"^fdp.pmap\(\S*<lambda>\): the mapped function returned a generator, whose work runs only when "
        r"it is iterated: after the call, in the caller's thread, outside the replica \(with no replica "
        r"index, axis or device of its own\). Return the values themselves: a tensor, or a list or tuple "
        r"of them \(list\(...\) of it\)\nfdp.pmap\(\S*<lambda>\): raised by replica 0 of 1 \(device cpu\)$",
    ),
    (
        "a replica returning a generator, a coroutine or a lazy `map`",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda x: doubles_later(x))(*a),  # closed, never awaited: no RuntimeWarning
        TypeError,
        r"^fdp.pmap\(\S*<lambda>\): the mapped function returned a coroutine, whose work runs only when "
        r"it is awaited: .* Map a plain function \(def\), not an async one",
    ),
    (
        "a replica returning a generator, a coroutine or a lazy `map`",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda x: map(torch.square, x))(*a),
        TypeError,
        r"^fdp.pmap\(\S*<lambda>\): the mapped function returned a map object, a lazy iterator, whose "
        r"work runs only when it is iterated",
    ),
    (
        # Inside the output, on several replicas: they were "different non-tensor values".
        "a replica returning a generator, a coroutine or a lazy `map`",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda x: {"rows": (row for row in x), "x": x})(*a),
        TypeError,
        r"^fdp.pmap\(\S*<lambda>\): output\['rows'\]: the replicas returned a generator, whose work "
        r"runs only when it is iterated: .* Return the values themselves",
    ),
    (
        "scatter of mismatched leaves",
        lambda: ({"a": torch.zeros(4), "b": torch.zeros(3)},),
        lambda a: fdp.scatter(a[0], cpus(2)),
        ValueError,
        r"axis 0 of tree\['b'\] of type float32\[3\]",
    ),
    (
        "gather of different structures",
        lambda: ([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}],),
        lambda a: fdp.gather(a[0], "cpu"),
        ValueError,
        "outputs of different structure",
    ),
    (
        "replicate onto no devices",
        lambda: ({"w": torch.zeros(1)},),
        lambda a: fdp.replicate(a[0], []),
        ValueError,
        "at least one device",
    ),
    (
        "parallel_apply with fewer functions than inputs",
        lambda: ([torch.zeros(1), torch.zeros(1)],),
        lambda a: fdp.parallel_apply([torch.neg], a[0]),
        ValueError,
        r"^fdp\.parallel_apply: fns must be one callable, or one per input, got 1 functions for 2 inputs$",
    ),
    (
        "parallel_apply under an outer torch.func transform",
        lambda: (torch.zeros(4),),
        lambda a: torch.func.grad(lambda x: fdp.parallel_apply(torch.sum, [x, x], devices=["cpu"] * 2)[0])(
            *a
        ),
        RuntimeError,
        "fdp.parallel_apply was called under a torch.func transform",
    ),
    (
        "ppermute with a repeated destination",
        lambda: (torch.zeros(2),),
        lambda a: pm(lambda x: fdp.ppermute(x, "i", [(0, 1), (1, 1)]), axis_name="i")(*a),
        ValueError,
        "sources and destinations in perm must be unique",
    ),
    (
        "pmean of integers",
        lambda: (torch.arange(4),),
        lambda a: pm(lambda x: fdp.pmean(x, "i"), axis_name="i")(*a),
        TypeError,
        "averages floating-point tensors, but x is int64",
    ),
    (
        "DataParallel inputs of different sizes",
        lambda: (torch.zeros(4, 2), torch.zeros(3, 2)),
        lambda a: fdp.DataParallel(nn.Bilinear(2, 2, 1), device_ids=cpus(2))(*a),
        ValueError,
        r"(?s)fdp.DataParallel got inconsistent sizes .*inputs\[1\] of type float32\[3,2\]\n"
        r"fdp.DataParallel splits every tensor argument along its dim \(as nn.DataParallel does\), so "
        r"all of them must have the batch's size there: one that every replica needs whole .* is "
        r"held on the module instead of passed$",
    ),
    (
        "DataParallel with a bad device",
        lambda: (),
        lambda a: fdp.DataParallel(nn.Linear(1, 1), device_ids=["gpu"]),
        ValueError,
        r"fdp.DataParallel device_ids\[0\] is not a device: 'gpu'",
    ),
    (
        "DataParallel splitting along a dim beyond the inputs' rank",
        lambda: (torch.zeros(4, 2),),
        lambda a: fdp.DataParallel(nn.Identity(), device_ids=cpus(2), dim=2)(*a),
        ValueError,
        r"map inputs\[0\] of type float32\[4,2\] along axis 2",
    ),
    (
        "DataParallel with a dim that is not an int",
        lambda: (),
        lambda a: fdp.DataParallel(nn.Linear(1, 1), device_ids=cpus(2), dim="1"),  # type: ignore[arg-type]
        TypeError,
        r"^fdp.DataParallel: dim must be an int, got str: '1'$",
    ),
    (
        "DataParallel with an unknown split rule",
        lambda: (),
        lambda a: fdp.DataParallel(nn.Linear(1, 1), device_ids=cpus(2), split="even"),  # type: ignore[arg-type]
        ValueError,
        r"^fdp.DataParallel split must be one of \('chunk', 'balanced'\), got 'even'$",
    ),
    (
        "a sparse tensor under an int axis",
        lambda: (torch.zeros(4), torch.eye(4).to_sparse()),
        lambda a: pm(lambda x, s: x)(*a),
        TypeError,
        r"args\[1\] is a tensor of layout torch.sparse_coo \(type float32\[4,4\]\), which fdp cannot split "
        r"along axis 0: to give every replica all of it, pass it positionally with axis None in in_axes",
    ),
    (
        # A keyword argument is always split: "give it axis None" was advice it cannot take.
        "a sparse tensor under an int axis",
        lambda: (torch.zeros(4), torch.eye(4).to_sparse()),
        lambda a: pm(lambda x, s: x)(a[0], s=a[1]),
        TypeError,
        r"kwargs\['s'\] is a tensor of layout torch.sparse_coo .* along axis 0: to give every replica all "
        r"of it, pass it positionally with axis None in in_axes \(keyword arguments are always split\)",
    ),
    (
        # (DataParallel has no in_axes: "give it axis None" would be no advice there.)
        "a sparse tensor under an int axis",
        lambda: (torch.zeros(4, 1), torch.eye(4).to_sparse()),
        lambda a: fdp.DataParallel(Takes2(), device_ids=cpus(2))(*a),
        TypeError,
        r"^fdp.DataParallel: inputs\[1\] is a tensor of layout torch.sparse_coo .* along axis 0: to "
        r"give every replica all of it, hold it on the module instead of passing it \(fdp.DataParallel maps "
        r"every argument\), or convert",
    ),
    (
        "a nested tensor under an int axis",
        lambda: (torch.zeros(2, 1), nested([torch.zeros(3), torch.zeros(2)])),
        lambda a: fdp.DataParallel(Takes2(), device_ids=cpus(2))(*a),
        TypeError,
        r"^fdp.DataParallel: inputs\[1\] is a nested tensor .* along axis 0: to give every replica "
        r"all of it, hold it on the module instead of passing it \(fdp.DataParallel maps every argument\), "
        r"or pad it into one tensor \(.to_padded_tensor\(0.0\)\) and pass the components' lengths beside "
        r"it, to split both by component \(a list of the components would not do: fdp splits each tensor "
        r"in a list, not the list\)$",
    ),
    (
        # One of torch's jagged layout (per-image boxes, say) has a batch size, but torch cannot
        # split it there: the message advised .to_dense(), which the jagged layout has not.
        "a nested tensor under an int axis",
        lambda: (torch.zeros(2), jagged([torch.zeros(3, 4), torch.zeros(1, 4)])),
        lambda a: pm(lambda x, boxes: x)(*a),
        TypeError,
        r"^fdp.pmap\(<lambda>.*\): args\[1\] is a nested tensor \(type float32\[2,j\d+,4\]\), which fdp "
        r"cannot split along axis 0: to give every replica all of it, pass it positionally with axis None "
        r"in in_axes \(keyword arguments are always split\), or pad it into one tensor "
        r"\(.to_padded_tensor\(0.0\)\) and pass the components' lengths beside it",
    ),
    (
        # torch's own error read "Internal error: NestedTensorImpl doesn't support sizes. Please
        # file an issue.", naming neither the call nor the argument.
        "a nested tensor under an int axis",
        lambda: (torch.zeros(2), nested([torch.zeros(3), torch.zeros(2)])),
        lambda a: pm(lambda x, s: x)(*a),
        TypeError,
        r"args\[1\] is a nested tensor \(type float32\[nested tensor of 2 components\]\), which fdp "
        r"cannot split along axis 0: to give every replica all of it, pass it positionally with axis None",
    ),
    (
        "a nested tensor under an int axis",
        lambda: (torch.zeros(2), nested([torch.zeros(3), torch.zeros(2)])),
        lambda a: pm(lambda x, s: x)(a[0], s=a[1]),
        TypeError,
        r"kwargs\['s'\] is a nested tensor .* along axis 0: to give every replica all of it, pass it "
        r"positionally with axis None in in_axes \(keyword arguments are always split\)",
    ),
    (
        # Split field by field, its fields' lengths disagreed: "inconsistent sizes" naming
        # args[1].data and args[1].batch_sizes, with nothing said of what to pass instead.
        "a PackedSequence under an int axis",
        lambda: (packed_sequence(3, 2, 4),),
        lambda a: pm(lambda p: p.data.sum())(*a),
        TypeError,
        r"^fdp.pmap\(\S*<lambda>\): args\[0\] is a torch.nn.utils.rnn.PackedSequence, which fdp cannot "
        r"split over the replicas: .* Pass the padded batch and the lengths instead .*"
        r"pack_padded_sequence\(x, lengths, enforce_sorted=False\); to give every replica all of it, "
        r"pass it positionally with axis None",
    ),
    (
        # One sequence: sorted_indices is None, and data and batch_sizes are as long as the
        # sequence. Split silently into two half sequences, each run as a sequence of its own.
        "a PackedSequence under an int axis",
        lambda: (packed_sequence(4, enforce_sorted=True),),
        lambda a: fdp.DataParallel(nn.LSTM(2, 3), device_ids=cpus(2))(*a),
        TypeError,
        r"^fdp.DataParallel: inputs\[0\] is a torch.nn.utils.rnn.PackedSequence, .* pack each "
        r"replica's share inside forward with pack_padded_sequence",
    ),
    (
        # One sequence, sorted (no sorted_indices): its fields agree in length, so on one device
        # the lone path ran it, where fdp.scatter refused it and two devices refused it.
        "a PackedSequence under an int axis",
        lambda: (packed_sequence(4, enforce_sorted=True),),
        lambda a: pm(lambda p: p.data.sum(), devices=cpus(1))(*a),
        TypeError,
        r"^fdp.pmap\(\S*<lambda>\): args\[0\] is a torch.nn.utils.rnn.PackedSequence, which fdp cannot split",
    ),
    (
        "a PackedSequence under an int axis",
        lambda: (packed_sequence(4, enforce_sorted=True),),
        lambda a: fdp.DataParallel(nn.LSTM(2, 3), device_ids=cpus(1))(*a),
        TypeError,
        r"^fdp.DataParallel: inputs\[0\] is a torch.nn.utils.rnn.PackedSequence, which fdp cannot split",
    ),
    (
        "a PackedSequence under an int axis",
        lambda: ({"p": packed_sequence(4)},),
        lambda a: fdp.scatter(a[0], cpus(3)),
        TypeError,
        r"^fdp.scatter: tree\['p'\] is a torch.nn.utils.rnn.PackedSequence, .* give it axis None",
    ),
    (
        # Concatenated field by field: a corrupt PackedSequence, which pad_packed_sequence read
        # out of bounds (the process aborted).
        "a PackedSequence output under an int out_axes",
        lambda: (torch.zeros(3, 4, 2), torch.tensor([4, 2, 3])),
        lambda a: pm(lambda x, n: {"h": nn.utils.rnn.pack_padded_sequence(x, n, True, False)})(*a),
        TypeError,
        r"^fdp.pmap\(\S*<lambda>\): output\['h'\] is a torch.nn.utils.rnn.PackedSequence, which fdp "
        r"cannot concatenate over the replicas: .* Return the padded output instead, "
        r"torch.nn.utils.rnn.pad_packed_sequence\(output, batch_first=..., total_length=T\)\[0\] with T the "
        r"padded length of the input, so that every replica's has the same length$",
    ),
    (
        # torch's own errors ("reshape is not implemented for sparse tensors", "unsupported memory
        # format option Contiguous") named neither the collective nor the leaf.
        "a sparse or nested tensor in a collective",
        lambda: (torch.zeros(2),),
        lambda a: pm(lambda x: fdp.psum({"d": x, "s": torch.eye(2).to_sparse()}, "i"), axis_name="i")(*a),
        TypeError,
        r"^fdp.psum takes dense tensors, but x\['s'\] is a tensor of layout torch.sparse_coo \(type "
        r"float32\[2,2\]\), which it cannot pack for the exchange: convert it with .to_dense\(\)",
    ),
    (
        # Joined into one tensor, they took the first one's scale: 200 came back as 25.5.
        "quantized tensors of different scales joined by a gather",
        lambda: (torch.zeros(2),),
        # (Quantized before the call: quantized() silences torch's deprecation warning with
        # warnings.catch_warnings, whose filters are the process's, not a thread's: replicas
        # entering and leaving it at once could restore them wrongly, and the warning fail the test.)
        lambda a: (lambda q: pm(lambda x: fdp.all_gather(q[fdp.axis_index("i")], "i"), axis_name="i")(*a))(
            [quantized(torch.ones(3), scale=0.1), quantized(torch.ones(3), scale=10.0)]
        ),
        ValueError,
        r"^fdp.all_gather: the replicas passed quantized tensors of different scales at x: replica 0 passed "
        r"scale 0.1, zero point 0 but replica 1 passed scale 10.0, zero point 0",
    ),
    (
        # On several replicas, torch's kernel refused it after the exchange ("Could not run
        # 'aten::add.out' with arguments from the 'QuantizedCPU' backend"); on one, it passed.
        "a quantized tensor in a reduction",
        lambda: (torch.zeros(2), quantized(torch.ones(3))),
        lambda a: pm(lambda x, q: fdp.pmax(q, "i"), axis_name="i", in_axes=(0, None))(*a),
        TypeError,
        r"^fdp.pmax reduces dense numbers, but x is a quantized tensor \(quint8\[3\]\): dequantize it "
        r"first \(.dequantize\(\)\)",
    ),
    (
        # (torch 2.13 adds no uint32 on the CPU; refused on one replica too, where nothing is added)
        "a dtype that torch cannot add or order in a reduction",
        lambda: (torch.zeros(2), {"count": torch.ones(3, dtype=torch.uint32)}),
        lambda a: pm(lambda x, c: fdp.psum(c, "i"), axis_name="i", in_axes=(0, None), devices=cpus(1))(*a),
        TypeError,
        r"^fdp.psum reduces x\['count'\], of type uint32\[3\], but torch has no sum of torch.uint32 "
        r"tensors on cpu: cast it first \(.to\(torch.int64\)\)\n",
    ),
    (
        "a dtype that torch cannot add or order in a reduction",
        lambda: (torch.zeros(2), torch.ones(3).to(torch.float8_e4m3fn)),
        lambda a: pm(lambda x, q: fdp.pmin(q, "i"), axis_name="i", in_axes=(0, None))(*a),
        TypeError,
        r"^fdp.pmin reduces x, of type float8_e4m3fn\[3\], but torch has no maximum or minimum of "
        r"torch.float8_e4m3fn tensors on cpu: cast it first \(.float\(\)\)\n",
    ),
    (
        "a pmapped module called without a dict of params first (`pmapped(model, x)`)",
        lambda: (torch.zeros(4, 2),),
        lambda a: (lambda m: pm(m)(m, *a))(nn.Linear(2, 2)),
        TypeError,
        r"fdp.pmap\(Linear\) takes the module's parameters and buffers as its first argument .*but got "
        r"the module itself \(Linear\) there",
    ),
    (
        "an option passed positionally (`@fdp.pmap(0)`)",
        lambda: (),
        lambda a: fdp.pmap(0),
        TypeError,
        r"^fdp.pmap: fn must be callable, got int: 0. fdp.pmap's options other than axis_name are "
        r"keyword-only: fdp.pmap\(f, in_axes=0, ...\), or as a decorator @fdp.pmap\(in_axes=0, ...\)$",
    ),
    (
        # "options are keyword-only" was the advice, wrong since the axis name may come second.
        'an axis name where the function belongs (`@fdp.pmap("i")`)',
        lambda: (),
        lambda a: fdp.pmap("i"),  # type: ignore[call-overload]
        TypeError,
        r"^fdp.pmap: fn must be callable, got str: 'i'. fdp.pmap takes the function first and the axis "
        r"name second, as jax.pmap does: fdp.pmap\(f, 'i'\); as a decorator, @fdp.pmap\(axis_name='i'\) "
        r"\(or @functools.partial\(fdp.pmap, axis_name='i'\)\)$",
    ),
    (
        # Taken as a name, in_axes stayed 0: w was split by rows, meant whole for every replica.
        "in_axes passed where the axis name goes (`fdp.pmap(f, (0, None))`, torch.vmap's habit)",
        lambda: (torch.ones(4, 4), torch.ones(4, 4)),
        lambda a: fdp.pmap(lambda x, w: x @ w, (0, None), devices=cpus(2))(*a),
        TypeError,
        r"^fdp.pmap\(\S*<lambda>\): axis_name is \(0, None\), which reads as an in_axes specification: "
        r"fdp.pmap's second argument is the axis name, as jax.pmap's is \(torch.vmap's is in_dims\). "
        r"Pass in_axes=\(0, None\) by keyword, and name the axis with a string if the function calls "
        r"collectives: fdp.pmap\(f, 'i', in_axes=...\)$",
    ),
    (
        # Python's own "pmap() got an unexpected keyword argument" said nothing of static_argnums.
        "another library's option (`static_broadcasted_argnums=`, `donate_argnums=`, torch.vmap's "
        "`in_dims=`, nn.DataParallel's `device_ids=`)",
        lambda: (torch.ones(4), 3),
        lambda a: fdp.pmap(lambda x, k: x * k, static_broadcasted_argnums=1, devices=cpus(2))(*a),  # type: ignore[call-overload]
        TypeError,
        r"^fdp.pmap got an unexpected keyword argument 'static_broadcasted_argnums' \(jax.pmap's\): "
        r"fdp.pmap's is static_argnums$",
    ),
    (
        # Python's own "psum_scatter() got an unexpected keyword argument" said nothing of dim.
        "a `jax.lax` keyword passed to a collective (`scatter_dimension=`, `axis=`, `split_axis=`, "
        "`concat_axis=`, `axis_index_groups=`)",
        lambda: (torch.ones(4),),
        lambda a: fdp.pmap(lambda x: fdp.psum_scatter(x, "i", scatter_dimension=0), "i", devices=cpus(2))(*a),  # type: ignore[call-overload]
        TypeError,
        r"^fdp.psum_scatter got an unexpected keyword argument 'scatter_dimension' "
        r"\(jax.lax.psum_scatter's\): fdp.psum_scatter's is dim: fdp.psum_scatter\(x, axis_name, dim=0\)\n",
    ),
    (
        "gather of one tree (a tensor, a dict) in place of the list of the replicas' trees",
        lambda: ({"y": torch.zeros(2)},),
        lambda a: fdp.gather(a[0], "cpu"),
        TypeError,
        r"^fdp.gather: trees must be a sequence of the replicas' trees \(one per replica\), got a dict; "
        r"for one replica, pass \[tree\]$",
    ),
    (
        "parallel_apply with inputs that are no sequence, a function that is not callable, or one dict of "
        "kwargs for all inputs",
        lambda: ((torch.zeros(2),), (torch.ones(2),)),
        lambda a: fdp.parallel_apply([torch.neg, 3], list(a), devices=cpus(2)),
        TypeError,
        r"^fdp.parallel_apply: fns\[1\] must be callable, got int: 3$",
    ),
    (
        "an `fdp.optim` hyperparameter of the wrong type, or a chain of something that is not a "
        "transformation",
        lambda: (),
        lambda a: fdp.optim.adam("1e-3"),
        TypeError,
        r"^fdp.optim.adam: lr must be a non-negative number or a Schedule \(a function of the steps taken\), "
        r"got str: '1e-3'$",
    ),
    (
        "a learning-rate schedule whose value at a step is negative, NaN or not a number",
        lambda: {"w": torch.ones(2)},
        lambda params: fdp.optim.sgd(lambda step: 0.1 - step * 0.1).apply_gradients(
            params, fdp.optim.SgdState(2, None), params
        ),
        ValueError,
        r"^fdp.optim.sgd: lr, a schedule, at step 2, must be non-negative, got -0.1$",
    ),
    (
        # A discriminator's last bias under a gradient penalty, with allow_unused=True: the
        # message named only the two structures, a None among their leaves.
        "a gradient of None for a tensor parameter given to `fdp.optim`",
        lambda: {"a": torch.ones(2), "b": torch.ones(3)},
        lambda params: fdp.optim.adam().update(
            {"a": torch.ones(2), "b": None}, fdp.optim.adam().init(params), params
        ),
        ValueError,
        r"^fdp.optim.adam: update got grads\['b'\] = None for a tensor parameter: a parameter that the loss "
        r"does not reach .*pass materialize_grads=True to torch.autograd.grad for zero gradients",
    ),
    (
        # torch's own error named neither the call nor the leaf: no 'aten::lerp.Scalar' for 'SparseCPU'
        "a sparse gradient given to `fdp.optim.adam`/`adamw`, `sgd` with `weight_decay`, or "
        "`clip_by_global_norm`",
        lambda: sparse_embedding_gradient(),
        lambda a: fdp.optim.adam().update(a[1], fdp.optim.adam().init(a[0]), a[0]),
        TypeError,
        r"^fdp.optim.adam: update got grads\['emb.weight'\], a sparse gradient \(layout torch.sparse_coo\): "
        r"fdp.optim.adam steps dense gradients only, as torch.optim.Adam does \(torch.optim.SparseAdam steps "
        r"sparse ones\). Give the layer dense gradients \(nn.Embedding\(..., sparse=False\)\), or convert "
        r"the gradient with .to_dense\(\)$",
    ),
    (
        "a sparse gradient given to `fdp.optim.adam`/`adamw`, `sgd` with `weight_decay`, or "
        "`clip_by_global_norm`",
        lambda: sparse_embedding_gradient(),
        lambda a: fdp.optim.sgd(0.1, weight_decay=0.1).apply_gradients(
            a[1], fdp.optim.SgdState(0, None), a[0]
        ),
        TypeError,
        r"^fdp.optim.sgd: apply_gradients got grads\['emb.weight'\], a sparse gradient .*with weight_decay "
        r"adds the parameter to the gradient, which torch cannot do to a sparse one",
    ),
    (
        "a sparse gradient given to `fdp.optim.adam`/`adamw`, `sgd` with `weight_decay`, or "
        "`clip_by_global_norm`",
        lambda: sparse_embedding_gradient(),
        lambda a: fdp.optim.clip_by_global_norm(1.0).update(a[1], fdp.optim.EmptyState()),
        TypeError,
        r"^fdp.optim.clip_by_global_norm: update got grads\['emb.weight'\], a sparse gradient .*the global "
        r"norm is taken of dense gradients only",
    ),
    (
        # torch's own error named neither the call nor the leaf: "For integral input tensors,
        # argument alpha must not be a floating point number"
        "an integer tensor among the parameters of an `fdp.optim` optimizer",
        lambda: (
            {"w": torch.ones(2), "bn": {"num_batches_tracked": torch.tensor(3)}},
            {"w": torch.ones(2), "bn": {"num_batches_tracked": torch.tensor(1)}},
        ),
        lambda a: fdp.optim.sgd(0.1).apply_gradients(a[1], fdp.optim.sgd(0.1).init(a[0]), a[0]),
        TypeError,
        r"^fdp.optim.sgd: apply_gradients got params\['bn'\]\['num_batches_tracked'\] of type int64\[\]; "
        r"fdp.optim steps floating-point and complex tensors only, as torch.optim does \(an integer tensor "
        r"cannot have a gradient\): keep integer tensors such as step counts out of the params, e.g. "
        r"dict\(model.named_parameters\(\)\) rather than model.state_dict\(\)$",
    ),
    (
        "an integer tensor among the parameters of an `fdp.optim` optimizer",
        lambda: ({"w": torch.ones(2), "n": torch.tensor(3)}, {"w": torch.ones(2), "n": torch.tensor(1)}),
        lambda a: fdp.optim.adam(0.1).update(a[1], fdp.optim.adam(0.1).init(a[0]), a[0]),
        TypeError,
        r"^fdp.optim.adam: update got params\['n'\] of type int64\[\]; fdp.optim steps floating-point",
    ),
    (
        # A typo in a label: the parameters labelled with it would be stepped by nothing.
        "a parameter label with no transformation in `fdp.optim.multi_transform`, or labels unlike the "
        "parameters",
        lambda: {"w": torch.ones(2, 2), "b": torch.ones(2)},
        lambda params: fdp.optim.multi_transform(
            {"decay": fdp.optim.adamw(), "no_decay": fdp.optim.adam()},
            lambda p: {k: "decay" if v.dim() > 1 else "nodecay" for k, v in p.items()},
        ).init(params),
        ValueError,
        r"^fdp.optim.multi_transform: init got param_labels\(params\)\['b'\] = 'nodecay', a label with no "
        r"transformation: transforms has the labels \['decay', 'no_decay'\]$",
    ),
    (
        "a parameter label with no transformation in `fdp.optim.multi_transform`, or labels unlike the "
        "parameters",
        lambda: {"encoder": {"w": torch.ones(2), "b": torch.ones(2)}, "head": torch.ones(2)},
        lambda params: fdp.optim.multi_transform(
            {"frozen": fdp.optim.sgd(0.0), "train": fdp.optim.adam()},
            {"encoder": {"w": "frozen"}, "head": "train"},
        ).init(params),
        ValueError,
        r"^fdp.optim.multi_transform: init got param_labels unlike params: the labels must be a tree of "
        r"params' structure with a label at each leaf, or a prefix of it \(one label for a whole "
        r"subtree\)\.\n"
        r"pytree structure error: different pytree keys at key path\n    param_labels\['encoder'\]\n",
    ),
    (
        # Was refused by the pmap beneath, as "fdp.pmap(_forward_replica): axis_name ...".
        "DataParallel with an axis_name that is not hashable",
        lambda: (),
        lambda a: fdp.DataParallel(nn.Linear(1, 1), device_ids=cpus(2), axis_name=["i"]),
        TypeError,
        r"^fdp.DataParallel: axis_name must be hashable, got list: \['i'\]$",
    ),
    (
        "DataParallel of something that is not a module",
        lambda: (),
        lambda a: fdp.DataParallel(torch.tanh, device_ids=cpus(2)),  # type: ignore[arg-type]
        TypeError,
        r"^fdp.DataParallel: module must be a torch.nn.Module, got builtin_function_or_method$",
    ),
    (
        "resident state on fewer replicas than run",
        lambda: (fdp.device_put_replicated({"w": torch.zeros(1)}, cpus(2)), torch.zeros(3)),
        lambda a: pm(lambda s, x: x, devices=cpus(3))(*a),
        ValueError,
        r"args\[0\]\['w'\] holds 2 values, one per replica .* runs 3 replicas .*fdp.device_put_replicated",
    ),
    (
        "resident state and a batch that runs fewer replicas",
        lambda: (fdp.device_put_replicated({"w": torch.zeros(1)}, cpus(8)), torch.zeros(10)),
        lambda a: pm(lambda s, x: x, devices=cpus(8))(*a),
        ValueError,
        r"args\[0\]\['w'\] holds 8 values, one per replica .* runs 5 replicas .*split='chunk'"
        r".*Use split='balanced' .* at least one row per device",
    ),
    (
        "in_axes longer than the arguments",  # the arguments it describes, passed by keyword
        lambda: (torch.zeros(4), torch.zeros(4)),
        lambda a: pm(lambda x, w: x, in_axes=(0, None))(a[0], w=a[1]),
        ValueError,
        r"(?s)\(1 given\).*Keyword arguments \['w'\] are not covered by in_axes \(they are mapped along "
        r"dim 0\): pass the arguments that in_axes describes positionally\.",
    ),
    (
        "unknown device",  # a device torch knows but fdp does not run on
        lambda: (torch.zeros(2),),
        lambda a: fdp.pmap(lambda x: x, devices=["mps"])(*a),
        ValueError,
        r"devices\[0\]: fdp runs on cpu and cuda devices, got 'mps'",
    ),
    (
        # optree takes it for a leaf: every replica got all of it, each with every row (n times
        # the rows in the output), silently.
        "a subclass of dict, list or tuple, or a UserDict or UserList, holding tensors under an int axis",
        lambda: (torch.zeros(4, 1), collections.UserDict(y=torch.zeros(4, 1))),
        lambda a: pm(lambda x, d: x)(*a),
        TypeError,
        r"args\[1\]: a UserDict holding tensors, a container of a type that fdp does not flatten "
        r".* Pass a plain dict \(dict\(obj\)\) to split it, or register UserDict with "
        r"optree.register_pytree_node\(..., namespace='fdp'\); to give every replica all of it, pass it "
        r"positionally with axis None",
    ),
    (
        "a subclass of dict, list or tuple, or a UserDict or UserList, holding tensors under an int axis",
        lambda: (torch.zeros(4, 1), ListOfRows([{"y": torch.zeros(4, 1)}])),
        lambda a: fdp.DataParallel(Takes2(), device_ids=cpus(2))(*a),
        TypeError,
        r"^fdp.DataParallel: inputs\[1\]: a ListOfRows holding tensors, .* Pass a plain list "
        r"\(list\(obj\)\) to split it, .* hold it on the module instead of passing it \(fdp.DataParallel "
        r"maps every argument\)$",
    ),
    (
        # Compared as values: "different non-tensor values ... return a tensor", printing them.
        "a subclass of dict, list or tuple, or a UserDict or UserList, holding tensors under an int axis",
        lambda: (torch.zeros(4, 1),),
        lambda a: pm(lambda x: collections.UserDict(y=x))(*a),
        TypeError,
        r"^fdp.pmap\(\S*<lambda>\): output: the replicas returned a UserDict holding tensors, a container "
        r"of a type that fdp does not flatten .* Return a plain dict \(dict\(obj\)\)",
    ),
    (
        "a NumPy array (or another library's array) under an int axis",
        lambda: (torch.zeros(4, 1), np.zeros((4, 1))),
        lambda a: pm(lambda x, y: x)(*a),
        TypeError,
        r"args\[1\]: a numpy.ndarray of shape \(4, 1\) is not a torch.Tensor, and fdp splits only "
        r"tensors: every replica would get all of it. Convert it with torch.as_tensor",
    ),
    (
        "an `fdp.SyncBatchNorm` in training mode where its axis is not bound",
        lambda: (torch.randn(4, 2),),
        lambda a: pm(fdp.SyncBatchNorm(2, axis_name="batch"))({}, *a),
        NameError,
        r"unbound axis name: batch \(fdp.SyncBatchNorm: the function being mapped was given no "
        r"axis_name\): .* fdp.pmap\(..., axis_name='batch'\), or give "
        r"fdp.DataParallel\(..., axis_name='batch'\)",
    ),
    (
        # nn.SyncBatchNorm's sixth positional parameter (a stand-in for a ProcessGroup: making one
        # needs torch.distributed started)
        "a process group given to `fdp.SyncBatchNorm`",
        lambda: (),
        lambda a: fdp.SyncBatchNorm(2, 1e-5, 0.1, True, True, ProcessGroup(), axis_name="batch"),
        TypeError,
        r"^fdp.SyncBatchNorm: device \(the sixth positional parameter, as in nn.BatchNorm2d\) must be a "
        r"torch.device, str or int, got ProcessGroup: <ProcessGroup>. fdp.SyncBatchNorm takes no process "
        r"group, unlike nn.SyncBatchNorm: the replicas of its axis_name share their statistics, across "
        r"the processes of fdp.distributed too$",
    ),
    (
        "a process group given to `fdp.SyncBatchNorm`",
        lambda: (),
        lambda a: fdp.SyncBatchNorm(2, process_group=ProcessGroup(), axis_name="batch"),  # type: ignore[arg-type]
        TypeError,
        r"^fdp.SyncBatchNorm: process_group must be None, got <ProcessGroup>. fdp.SyncBatchNorm takes no "
        r"process group",
    ),
    (
        "bad `compile` option",
        lambda: (),
        lambda a: pm(lambda x: x, compile="yes"),
        TypeError,
        r"compile must be True, False or a dict of torch.compile options .*got str: 'yes'",
    ),
    (
        "bad `compile` option",
        lambda: (),
        lambda a: pm(lambda x: x, compile={"bogus": 1}),
        TypeError,
        r"torch.compile rejected compile=\{'bogus': 1\}: .*unexpected keyword argument 'bogus'",
    ),
    (
        "an option that is True or False given something else",
        lambda: (),
        lambda a: pm(lambda x: x, check_unmapped_outputs="no"),
        TypeError,
        r"^fdp.pmap\(<lambda>.*\): check_unmapped_outputs must be True or False, got str: 'no'$",
    ),
    (
        "an option that is True or False given something else",
        lambda: (torch.ones(2, 3),),
        lambda a: pm(lambda x: fdp.pmean(x, "i", donate="yes"), axis_name="i")(*a),
        TypeError,
        r"^fdp.pmean: donate must be True or False, got str: 'yes'\n",
    ),
    (
        "an option that is True or False given something else",
        lambda: (torch.ones(2, 3),),
        lambda a: pm(lambda x: fdp.all_gather(x, "i", tiled=1), axis_name="i")(*a),
        TypeError,
        r"^fdp.all_gather: tiled must be True or False, got int: 1\n",
    ),
    (
        "an option that is True or False given something else",
        lambda: (),
        lambda a: fdp.value_and_grad(lambda w: w.sum(), has_aux=1),
        TypeError,
        r"^fdp.value_and_grad: has_aux must be True or False, got int: 1$",
    ),
    (
        "a `torch.compile`d module where a private copy would run it",
        lambda: (torch.zeros(1, 2),),
        lambda a: fdp.functional_call(nn.Sequential(torch.compile(nn.Linear(2, 2))), {}, a),
        TypeError,
        r"fdp.functional_call: '0' is a torch.compile'd module \(OptimizedModule\), whose compiled "
        r"forward belongs to the module it compiled",
    ),
    (
        "a `torch.compile`d module where a private copy would run it",
        lambda: (),
        lambda a: fdp.DataParallel(torch.compile(nn.Linear(2, 2)), device_ids=cpus(2)),
        TypeError,
        r"fdp.DataParallel\(device_ids=\['cpu', 'cpu'\]\): a torch.compile'd module runs on one device "
        r"only",
    ),
    (
        "two distinct submodules that compare equal",
        lambda: (torch.zeros(1, 2),),
        lambda a: fdp.functional_call(nn.Sequential(EqualByValue(2, 2), EqualByValue(2, 2)), {}, a),
        TypeError,
        r"fdp.functional_call: the submodules '0' and '1' are distinct EqualByValue objects that "
        r"compare equal .* the tensors of '1' are missing from named_parameters\(\) and state_dict",
    ),
    (
        "two distinct submodules that compare equal",
        lambda: (torch.zeros(2, 2),),
        lambda a: fdp.DataParallel(nn.Sequential(EqualByValue(2, 2), EqualByValue(2, 2)), device_ids=cpus(2))(
            *a
        ),
        TypeError,
        r"fdp.functional_call: the submodules '0' and '1' are distinct EqualByValue objects",
    ),
    (
        "a bound method of the module kept where fdp cannot rebind it to its private copy",
        lambda: (torch.zeros(1, 2),),
        lambda a: fdp.functional_call(StoresMethods(), {}, a),
        TypeError,
        r"fdp.functional_call: module.lin.table holds a module of the tree, or a bound method, "
        r"functools.partial or closure of one, inside an object of type collections.OrderedDict.*"
        r"Hold it in one of these, or call the method in forward",
    ),
    (
        "a released private copy used after its call (checkpointing where torch's own swap ran)",
        lambda: (torch.randn(2, 3),),
        lambda a: released_copy_in_backward(*a),
        AttributeError,
        r"fdp.functional_call: no attribute '_backward_hooks': this module is a private copy that "
        r"fdp.functional_call lent to a call that has returned",
    ),
    (
        "a type registered with optree in two namespaces",
        lambda: (Twice(torch.zeros(4)),),
        lambda a: pm(lambda t: t.x)(*a),
        TypeError,
        r"^fdp.pmap\(\S*<lambda>\): args\[0\]: \S*Twice is registered with optree in several namespaces "
        r"\['lib-a', 'lib-b'\]",
    ),
    (
        # A bare AttributeError ('PerReplica' object has no attribute 'shape') from inside the
        # user's __post_init__, naming neither the call nor the output.
        "a node type that checks its fields as it is built, under `out_axes=fdp.PER_REPLICA` or placed by "
        "`fdp.device_put_replicated`",
        lambda: (torch.zeros(4, 2),),
        lambda a: pm(lambda x: {"s": Checked(x)}, out_axes=fdp.PER_REPLICA)(*a),
        TypeError,
        r"^fdp.pmap\(\S*<lambda>\): output\['s'\] is a Checked, which cannot hold fdp.PerReplica values in "
        r"place of its tensors: rebuilt with them, it raised AttributeError: 'PerReplica' object has no "
        r"attribute 'shape'. out_axes fdp.PER_REPLICA keeps each of the output's tensors on its replica, "
        r"as a fdp.PerReplica in the output's own containers. Return the Checked's fields in a dict or a "
        r"tuple \(and build a Checked from fdp.unreplicate of them where one is needed\), or give it "
        r"out_axes None or 0 in an out_axes tree prefix$",
    ),
    (
        "a node type that checks its fields as it is built, under `out_axes=fdp.PER_REPLICA` or placed by "
        "`fdp.device_put_replicated`",
        lambda: ({"s": Checked(torch.zeros(4, 2))},),
        lambda a: fdp.device_put_replicated(a[0], cpus(2)),
        TypeError,
        r"^fdp.device_put_replicated: tree\['s'\] is a Checked, which cannot hold fdp.PerReplica values in "
        r"place of its tensors: .* Place its fields \(in a dict or a tuple\), and build the Checked from "
        r"them inside the mapped function$",
    ),
    (
        "replicas returning different structures",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda x: {"a": x} if fdp.axis_index("i") == 0 else {"b": x}, axis_name="i")(*a),
        ValueError,
        r"the replicas returned outputs of different structure: replica 0 returned "
        r"PyTreeSpec\(\{'a': \*\}\) but replica 1 returned",
    ),
    (
        # Joined at replica 0's scale, replica 1's values came back clipped to its range, silently
        # (each replica quantizing its own shard picks a scale of its own).
        "replicas returning quantized tensors of different scales",
        lambda: (torch.tensor([1.0, 2.0, 100.0, 200.0]),),
        # (Each replica quantizes its shard with a scale of its own, as dynamic quantization
        # does; quantized before the call, for the reason above.)
        lambda a: (lambda q: pm(lambda x: q[int(x[0] > 50)])(*a))(
            [quantized(a[0][:2], scale=0.02), quantized(a[0][2:], scale=2.0)]
        ),
        ValueError,
        r"^fdp.pmap\(<lambda>.*\): the replicas returned quantized tensors of different scales at output: "
        r"replica 0 returned scale 0.02, zero point 0 but replica 1 returned scale 2.0, zero point 0; "
        r"joined into one tensor they would take replica 0's, and values outside its range would "
        r"come back clipped: quantize them alike on every replica .*, return them dequantized "
        r"\(.dequantize\(\)\), or keep each replica's with out_axes=fdp.PER_REPLICA$",
    ),
    (
        "`out_axes=None` outputs that disagree (`check_unmapped_outputs=True`)",
        lambda: (torch.arange(4.0),),
        lambda a: pm(lambda x: x.sum(), out_axes=None, check_unmapped_outputs=True)(*a),
        ValueError,
        r"out_axes is None for output, but the replicas disagree",
    ),
    (
        "replicas passing different shapes to a collective",
        lambda: (torch.zeros(30),),
        lambda a: pm(lambda v: fdp.psum({"v": v}, "i"), axis_name="i", devices=cpus(8))(*a),
        ValueError,
        r"fdp.psum: the replicas passed different shapes or dtypes at x\['v'\]: replica 0 passed "
        r"float32\[4\] but replica 7 passed float32\[2\]",
    ),
    (
        "replicas calling different collectives",
        lambda: (torch.zeros(4),),
        lambda a: pm(
            lambda v: fdp.psum(v, "i") if fdp.axis_index("i") == 0 else fdp.pmax(v, "i"), axis_name="i"
        )(*a),
        ValueError,
        # Named in the order the replicas arrived, which the threads decide.
        r"the replicas called different collectives at the same point: "
        r"fdp.(psum|pmax) \(replica (0|1)\) and fdp.(pmax|psum) \(replica (1|0)\)",
    ),
    (
        "replicas calling different collectives",  # one collective, with different options
        lambda: (torch.zeros(4),),
        lambda a: pm(
            lambda v: fdp.ppermute(v, "i", [(0, 1), (1, 0)] if fdp.axis_index("i") == 0 else [(0, 1)]),
            axis_name="i",
        )(*a),
        ValueError,
        r"the replicas called different collectives at the same point: .*"
        r"fdp.ppermute\(perm=\[\(0, 1\), \(1, 0\)\]\) \(replica 0\)",
    ),
    (
        "a replica skipping a collective the others wait in",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda v: fdp.psum(v, "i") if fdp.axis_index("i") == 0 else v, axis_name="i")(*a),
        RuntimeError,
        r"replica 1 returned without calling fdp.psum, which the other replicas are waiting in",
    ),
    (
        "a replica whose differentiated value does not depend on a collective (under `fdp.grad` or "
        "`torch.func` inside the replicas), whose backward the others wait in",
        lambda: (torch.ones(3), torch.ones(4, 3)),
        lambda a: pm(fdp.grad(constant_on_replica_1), in_axes=(None, 0), axis_name="i")(*a),
        RuntimeError,
        r"replica 1 returned without calling fdp.psum \(the backward of collective #0\), which the other "
        r"replicas are waiting in. Replica 1 called the forward collective, but there that collective",
    ),
    (
        "pmap, DataParallel or parallel_apply of several replicas under a tracer "
        "(`torch.func.linearize`, `make_fx`, `torch.jit.trace`, `torch.export` non-strict)",
        lambda: (torch.ones(3), torch.ones(4, 3)),
        lambda a: make_fx(lambda w: pm(lambda x, w: x @ w, in_axes=(0, None))(a[1], w))(a[0]),
        RuntimeError,
        r"fdp.pmap\(.*\) was called under make_fx tracing \(torch.func.linearize, torch.export, "
        r"make_fx\), which records only the calling thread's operations",
    ),
    (
        "`torch.autograd` through a collective inside the replica",
        lambda: (torch.zeros(4, requires_grad=True),),
        lambda a: pm(grad_through_psum, axis_name="i")(*a),
        RuntimeError,
        r"torch.autograd was asked to differentiate through fdp.psum inside the mapped function",
    ),
    (
        "DataParallel on several devices, a buffer changed in place in evaluation mode",
        lambda: (torch.zeros(4, 2),),
        lambda a: fdp.DataParallel(BumpsInPlace().eval(), device_ids=cpus(2))(*a),
        RuntimeError,
        r"fdp.DataParallel: the replicas modified buffers\['high'\] in place.* In evaluation mode the "
        r"replicas share the module's buffers .*: change buffers in place in training mode only, or "
        r"run such a module on one device\.",
    ),
    (
        # The replicas renormalized the one weight they share at once: a row could be scaled
        # twice (to norm 0.03 rather than 1), rarely and silently.
        "DataParallel on several CPU devices, a parameter changed in place by forward",
        lambda: (torch.tensor([0, 1, 2, 3]),),
        lambda a: fdp.DataParallel(renormalizing_embedding(), device_ids=cpus(2))(*a),
        RuntimeError,
        r"^fdp.DataParallel: the replicas modified params\['weight'\] in place, but the 2 replicas on "
        r"cpu, cpu share the module's parameters: their changes race \(on GPUs each replica would "
        r"change a copy of its own, and its change would be lost\)\. Change parameters outside "
        r"forward \(after the optimizer step, under torch.no_grad\(\)\), or run a module whose "
        r"forward changes them \(an nn.Embedding with max_norm\) on one device\.$",
    ),
    (
        # The advice for buffers (evaluation mode, fdp.DataParallel, fdp.stateful_call) was
        # given for a parameter too, where none of it helps.
        "a pmapped module whose forward changes its tensors in place",  # a parameter, in evaluation mode
        lambda: (torch.tensor([0, 1, 2, 3]),),
        lambda a: fdp.pmap(renormalizing_embedding().eval(), devices=cpus(2))({}, *a),
        RuntimeError,
        r"^fdp.pmap\(Embedding\): the replicas modified params\['weight'\] in place, but it is "
        r"replicated \(axis None\) over 2 replicas, .* the updates race or are lost\. It is one of "
        r"the module's parameters, which its forward changes \(an nn.Embedding with max_norm "
        r"renormalizes the rows it looks up, in either mode\): change parameters outside forward "
        r"\(after the optimizer step, under torch.no_grad\(\)\), or run such a module on one device\.$",
    ),
    (
        "DataParallel on several devices of a lazy module not set up yet",
        lambda: (torch.ones(4, 5),),
        lambda a: fdp.DataParallel(nn.Sequential(nn.LazyLinear(3)), device_ids=cpus(2))(*a),
        RuntimeError,
        r"^fdp.DataParallel: module\.0 \(LazyLinear\) is a lazy module whose parameters are not set "
        r"up yet: its first forward sets them up, which the replicas cannot share\. Run that one on "
        r"one device \(module\(x\[:1\]\)\) before the data-parallel calls, as torch's docs ask of "
        r"nn.DataParallel\.$",
    ),
    (
        "a meta tensor among the inputs, or a module's parameters on the meta device",
        lambda: (torch.ones(4, 3), torch.empty(4, 3, device="meta")),
        lambda a: pm(lambda x, y: x + y)(*a),
        ValueError,
        r"fdp.pmap\(.*\): args\[1\] is a meta tensor \(type float32\[4,3\]\), which holds no data to "
        r"give the replicas on cpu, cpu: make it on one of those devices \(a module built on the meta "
        r"device needs module.to_empty\(device=...\)",
    ),
    (
        "a meta tensor among the inputs, or a module's parameters on the meta device",
        lambda: ({"w": torch.empty(3, device="meta")}, torch.ones(4, 3)),
        lambda a: pm(lambda p, x: x * p["w"], in_axes=(None, 0))(*a),
        ValueError,
        r"fdp.pmap\(.*\): args\[0\]\['w'\] is a meta tensor \(type float32\[3\]\)",
    ),
    (
        "a meta tensor among the inputs, or a module's parameters on the meta device",
        lambda: (torch.ones(4, 3),),
        lambda a: fdp.DataParallel(nn.Linear(3, 3, device="meta"), device_ids=cpus(2))(*a),
        ValueError,
        r"fdp.DataParallel: the module's 'weight' is a meta tensor \(type float32\[3,3\]\), which holds "
        r"no data to give the replicas on cpu, cpu",
    ),
    (
        "a meta tensor among the inputs, or a module's parameters on the meta device",
        lambda: ({"w": torch.empty(2, device="meta")},),
        lambda a: fdp.replicate(a[0], cpus(2)),
        ValueError,
        r"fdp.replicate: tree\['w'\] is a meta tensor \(type float32\[2\]\)",
    ),
    (
        "fdp imported with a torch older than 2.11",
        lambda: (),
        lambda a: fdp._version.check_torch("2.10.0+cu128"),
        ImportError,
        r"fdp needs torch 2.11 or newer, but torch 2.10.0\+cu128 is installed: upgrade it with pip "
        r"install 'torch>=2.11'",
    ),
    (
        # torch.func.grad's own words named neither fdp.grad nor what the value was.
        "`fdp.grad` of a function that returns no scalar loss",
        lambda: (torch.ones(2),),
        lambda a: fdp.grad(lambda w: w * 2)(*a),
        TypeError,
        r"^fdp.grad\(fn\)\(\*args\): fn must return a real floating-point scalar tensor \(a loss\), got "
        r"a tensor of shape \(2,\) and dtype torch.float32$",
    ),
    (
        # By autograd, requires_grad_() refused it in torch's words, naming no argument.
        "`fdp.grad` with respect to an argument holding integers",
        lambda: ({"w": torch.ones(2), "step": torch.tensor(3)},),
        lambda a: fdp.grad(lambda s: s["w"].sum())(*a),
        TypeError,
        r"^fdp.grad\(fn\)\(\*args\): args\[0\]\['step'\] is int64\[\]: the differentiated arguments "
        r"must be trees of floating-point or complex tensors$",
    ),
    (
        "`fdp.grad` with argnums of the wrong type or past the arguments",
        lambda: (torch.ones(2), torch.ones(2)),
        lambda a: fdp.grad(lambda w, x: (w * x).sum(), argnums=2)(*a),
        TypeError,
        r"^fdp.grad\(fn\)\(\*args\): argnums=2 is out of range for 2 positional arguments$",
    ),
    (
        "`fdp.grad` of something that is not a function",
        lambda: (),
        lambda a: fdp.grad(torch.ones(2)),
        TypeError,
        r"^fdp.grad: fn must be callable, got float32\[2\]: tensor\(\[1\., 1\.\]\)$",
    ),
    (
        # The second copy of the argument replaced the first: the first's gradient was zeros.
        "`fdp.grad` with argnums naming one argument twice",
        lambda: (torch.ones(2), torch.ones(2)),
        lambda a: fdp.grad(lambda w, x: (w * x).sum(), argnums=(1, -1))(*a),
        ValueError,
        r"^fdp.grad\(fn\)\(\*args\): argnums=\(1, -1\) names args\[1\] twice: each argument is "
        r"differentiated once, so give each position once$",
    ),
    (
        # float("abc") failed in Python's words; a negative timeout in gloo's ("Invalid timeout"),
        # after the store was made; 0 was taken, and every collective failed at once.
        "a bad `timeout`, `rank` or `world_size` for `fdp.distributed.initialize`",
        lambda: (),
        lambda a: fdp.distributed.initialize(
            backend="gloo", rank=0, world_size=1, store=dist.HashStore(), timeout="30"
        ),
        TypeError,
        r"^fdp.distributed.initialize: timeout must be a number of seconds or a datetime.timedelta, "
        r"got str: '30'$",
    ),
    (
        "a bad `timeout`, `rank` or `world_size` for `fdp.distributed.initialize`",
        lambda: (),
        lambda a: fdp.distributed.initialize(
            backend="gloo", rank=0, world_size=1, store=dist.HashStore(), timeout=0
        ),
        ValueError,
        r"^fdp.distributed.initialize: timeout must be positive and finite \(how long a collective may "
        r"wait for the other ranks, in seconds\), got 0$",
    ),
    (
        # gloo's "rank < size. 2 vs 2" (an enforce failure), once the store was made.
        "a bad `timeout`, `rank` or `world_size` for `fdp.distributed.initialize`",
        lambda: (),
        lambda a: fdp.distributed.initialize(backend="gloo", rank=2, world_size=2, store=dist.HashStore()),
        ValueError,
        r"^fdp.distributed.initialize: rank must be an int from 0 to 1 \(world_size is 2\), got 2$",
    ),
]


# Entries of the catalogue that need what this file does not set up, and where they are tested.
TESTED_APART = {
    "a collective differentiated under `fdp.grad` or `torch.func` on replicas that share a GPU": (
        "tests/test_cuda.py",
        "tests/test_collectives.py",
    ),
    "a rank that fails under `fdp.distributed`": ("tests/test_distributed.py",),
    "processes passing different trees to a collective under `fdp.distributed`": (
        "tests/test_distributed.py",
    ),
    "processes starting calls of different pmapped functions under `fdp.distributed`": (
        "tests/test_distributed.py",
    ),
    "pmapped calls with an axis name made at once from several threads under `fdp.distributed`": (
        "tests/test_distributed.py",
    ),
    "a pmapped call that failed on some ranks only, after its last collective, under `fdp.distributed`": (
        "tests/test_distributed.py",
    ),
}


def constant_on_replica_1(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A loss that replica 1 replaces by a constant: its backward never reaches the psum."""
    return fdp.psum((x @ w).sum() if fdp.axis_index("i") == 0 else x.new_zeros(()), "i")


def snapshot(tree: Any) -> list[Any]:
    leaves = optree.tree_leaves(tree, namespace=fdp.NAMESPACE, none_is_leaf=True)
    return [
        (leaf, leaf.clone(), leaf._version)
        if isinstance(leaf, torch.Tensor) and not leaf.is_inference()
        else (leaf,)
        for leaf in leaves
    ]


@pytest.mark.parametrize(("name", "inputs", "call", "error", "match"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(
    name: str, inputs: Callable[[], Any], call: Callable[[Any], Any], error: type, match: str
) -> None:
    if "cuda:7" in match and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    if "the global norm is taken of dense gradients only" in match and global_norm_takes_sparse():
        pytest.skip(
            "this torch takes the norm of sparse gradients (2.15 does): fdp refuses them only where it fails"
        )
    given = inputs()
    before = snapshot(given)
    with pytest.raises(error, match=match):
        call(given)
    after = optree.tree_leaves(given, namespace=fdp.NAMESPACE, none_is_leaf=True)
    assert len(after) == len(before)
    for now, then in zip(after, before):
        assert now is then[0]
        if len(then) == 3 and name != "in-place update of a replicated input":  # mutated by the user's fn
            if not now.is_meta:  # (a meta tensor holds no values to compare; its version counter says)
                dense = now.layout != torch.strided  # torch.equal takes strided tensors only
                if now.is_nested:  # nor nested ones: compared component by component
                    assert all(map(torch.equal, now.unbind(), then[1].unbind()))
                else:
                    assert (
                        torch.equal(now.to_dense(), then[1].to_dense())
                        if dense
                        else torch.equal(now, then[1])
                    )
            assert now._version == then[2]


def catalogue() -> list[str]:
    """The first column of docs/errors.md's table: one mistake per row."""
    from pathlib import Path

    errors = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    rows = [line for line in errors.splitlines() if line.startswith("| ")]
    return [row.split(" | ")[0].removeprefix("| ") for row in rows[2:]]  # after the header and its rule


def test_every_catalogue_entry_is_in_the_docs() -> None:
    missing = [name for name, *_ in CASES if name not in catalogue()]
    assert not missing, f"docs/errors.md does not list: {missing}"


def test_every_entry_of_the_docs_is_run_here_or_apart() -> None:
    # docs/errors.md says that this file runs every entry of its catalogue but those apart.
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    entries = set(catalogue())
    assert "mismatched sizes" in entries and len(entries) > 40, entries
    untested = entries - {name for name, *_ in CASES} - set(TESTED_APART)
    assert not untested, f"docs/errors.md lists entries that no test runs: {sorted(untested)}"
    errors = (root / "docs" / "errors.md").read_text()
    for name, files in TESTED_APART.items():
        assert name in entries, name
        for file in files:
            assert file in errors and (root / file).exists(), (name, file)


def test_options_that_are_true_or_false_take_numpy_bools() -> None:
    # A comparison of NumPy values gives np.bool_, which torch takes for its flags; refused as
    # "must be True or False" before. Each gives what the Python bool gives.
    x = torch.arange(6.0).reshape(2, 3)
    aux = lambda w: ((w**2).sum(), w.sum())  # noqa: E731
    for flag in (np.True_, np.False_):
        assert pm(lambda t: t, check_unmapped_outputs=flag).check_unmapped_outputs is bool(flag)
    assert_same(fdp.value_and_grad(aux, has_aux=np.True_)(x), fdp.value_and_grad(aux, has_aux=True)(x))
    assert_same(fdp.grad(aux, has_aux=np.True_)(x), fdp.grad(aux, has_aux=True)(x))
    for flag in (np.True_, True):
        donated = pm(lambda t, flag=flag: fdp.pmean(t.clone(), "i", donate=flag), axis_name="i")(x)
        assert torch.equal(donated, x.mean(0, keepdim=True).expand(2, 3))
        tiled = pm(lambda t, flag=flag: fdp.all_gather(t, "i", tiled=flag), axis_name="i")(x)
        assert torch.equal(tiled, torch.cat([x, x]))


def assert_same(a: Any, b: Any) -> None:
    a_leaves, a_spec = optree.tree_flatten(a)
    b_leaves, b_spec = optree.tree_flatten(b)
    assert a_spec == b_spec
    assert all(torch.equal(s, t) for s, t in zip(a_leaves, b_leaves))
