"""The bad-input catalogue (docs/errors.md): every way to call fdp wrongly gets a clear exception of
the right type naming the argument, and the failing call leaves its inputs as they were."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from helpers import cpus, opaque
from torch import nn

import fdp


def pm(fn: Callable[..., Any], **options: Any) -> fdp.Pmapped:
    return fdp.pmap(fn, devices=options.pop("devices", cpus(2)), **options)


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
        "out_axes longer than the output",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda x: (x, x), out_axes=(0, 0, 0))(*a),
        ValueError,
        "out_axes specification must be a tree prefix of the output",
    ),
    (
        "rank too small",
        lambda: (torch.zeros(4),),
        lambda a: pm(lambda x: x, in_axes=1)(*a),
        ValueError,
        r"map args\[0\] of type float32\[4\] along axis 1, so its rank should be at least 2",
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
        "got 1 functions for 2 inputs",
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
        r"(?s)fdp.DataParallel got inconsistent sizes .*inputs\[1\]",
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
]


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
    given = inputs()
    before = snapshot(given)
    with pytest.raises(error, match=match):
        call(given)
    after = optree.tree_leaves(given, namespace=fdp.NAMESPACE, none_is_leaf=True)
    assert len(after) == len(before)
    for now, then in zip(after, before):
        assert now is then[0]
        if len(then) == 3 and name != "in-place update of a replicated input":  # mutated by the user's fn
            assert torch.equal(now, then[1]) and now._version == then[2]


def test_every_catalogue_entry_is_in_the_docs() -> None:
    from pathlib import Path

    errors = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    missing = [name for name, *_ in CASES if name not in errors]
    assert not missing, f"docs/errors.md does not list: {missing}"
