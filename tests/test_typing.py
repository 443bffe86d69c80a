"""The public API as a type checker sees it from user code: ``mypy --strict`` on a snippet.

fdp ships ``py.typed``, so users' checkers read its annotations: a wrong one rejects correct
user code, or types a result ``Any`` and checks nothing after it. The snippet below is user
code; each line that ends in ``# reveals: T`` must reveal ``T`` exactly, each that ends in
``# error: code`` must be reported with that error code, and no other line may be reported.
mypy runs once for all of them, with fdp's own modules silent, as for an installed package
(whose errors mypy does not report in its users' runs).
"""

from __future__ import annotations

import gc
import os
import re
import sys
import textwrap
from pathlib import Path

import mypy.api
import pytest

ROOT = Path(__file__).resolve().parents[1]

SNIPPET = textwrap.dedent(
    """
    import functools
    from typing import Any

    import torch
    from torch import nn

    import fdp

    def f(x: torch.Tensor, n: int = 1) -> tuple[torch.Tensor, int]:
        return x, n

    x = torch.zeros(4, 2)
    model = nn.Linear(2, 3)
    params = dict(model.named_parameters())

    # --- fdp.pmap: as a function, as @pmap, as @pmap(...) ------------------------------------
    pf = fdp.pmap(f, in_axes=(0, None), devices=["cpu", 0, torch.device("cpu")])
    reveal_type(pf)  # reveals: Pmapped[[x: Tensor, n: int =], tuple[Tensor, int]]
    reveal_type(pf(x, 2))  # reveals: tuple[Tensor, int]
    pf(x, "2")  # error: arg-type
    pf(x, m=2)  # error: call-arg
    reveal_type(pf.devices)  # reveals: tuple[device, ...]
    fdp.pmap(f, split="even")  # error: call-overload
    # The axis name second, positionally, as in jax.pmap; it is no function.
    named = fdp.pmap(f, "i", in_axes=(0, None))
    reveal_type(named)  # reveals: Pmapped[[x: Tensor, n: int =], tuple[Tensor, int]]
    fdp.pmap("i")  # error: call-overload
    fdp.pmap(f, ["i"])  # error: call-overload

    @fdp.pmap
    def double(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    reveal_type(double)  # reveals: Pmapped[[x: Tensor], Tensor]

    @fdp.pmap(axis_name="i", devices=["cpu", "cpu"], out_axes=(fdp.PER_REPLICA, None))
    def step(state: dict[str, Any], x: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        return state, x

    reveal_type(step)  # reveals: Pmapped[[state: dict[str, Any], x: Tensor], tuple[dict[str, Any], Tensor]]
    reveal_type(step({}, x))  # reveals: tuple[dict[str, Any], Tensor]

    # A module is called with its parameters (and buffers) first.
    pm = fdp.pmap(model, devices=["cpu", "cpu"])
    reveal_type(pm)  # reveals: Pmapped[[dict[str, Any] | Sequence[dict[str, Any]], *Any, **Any], Any]
    pmi = fdp.pmap(model, "i")
    reveal_type(pmi)  # reveals: Pmapped[[dict[str, Any] | Sequence[dict[str, Any]], *Any, **Any], Any]
    pm(params, x)
    pm([params, dict(model.named_buffers())], x)
    pm(x)  # error: arg-type

    # A decorated method: bound, it takes what follows self.
    class Scaler:
        @fdp.pmap(in_axes=(None, 0))
        def scale(self, x: torch.Tensor) -> torch.Tensor:
            return x

    reveal_type(Scaler.scale)  # reveals: Pmapped[[self: Scaler, x: Tensor], Tensor]
    reveal_type(Scaler().scale)  # reveals: def (x: Tensor) -> Tensor
    reveal_type(Scaler().scale(x))  # reveals: Tensor
    Scaler().scale(3)  # error: arg-type

    # JAX's decorator, a partial of fdp.pmap: mypy types a partial of an overloaded function
    # by one overload, whatever it decorates; unchecked then, but no call refused.
    @functools.partial(fdp.pmap, axis_name="i", devices=["cpu", "cpu"])
    def jax_style(x: torch.Tensor) -> torch.Tensor:
        return x

    reveal_type(jax_style)  # reveals: Any
    jax_style(x)
    jax_style(x=x)

    class PartialScaler:
        @functools.partial(fdp.pmap, in_axes=(None, 0))
        def scale(self, x: torch.Tensor) -> torch.Tensor:
            return x

    PartialScaler().scale(x)
    PartialScaler.scale(PartialScaler(), x)

    # @classmethod or @staticmethod over @fdp.pmap run (tests/test_pmap.py), but mypy types them
    # wrong, and fdp's annotations cannot help it: mypy binds cls for (and binds nothing under
    # @staticmethod for) a function only, and calls a Pmapped's __get__ as for a method; no
    # overload of __get__ can tell cls from self, as mypy drops a Concatenate's prefix from a
    # self type. So Maker.make(x) and Maker().double(x) are refused. Pinned, to see mypy change;
    # as calls, classmethod(fdp.pmap(...)) and staticmethod(fdp.pmap(...)) are typed right.
    class Maker:
        @classmethod
        @fdp.pmap(in_axes=(None, 0))
        def make(cls, x: torch.Tensor) -> torch.Tensor:
            return x

        @staticmethod
        @fdp.pmap
        def double(x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    reveal_type(Maker.make)  # reveals: Pmapped[[cls: type[Maker], x: Tensor], Tensor]
    reveal_type(Maker().make)  # reveals: def (x: Tensor) -> Tensor
    reveal_type(Maker.double)  # reveals: Pmapped[[x: Tensor], Tensor]
    reveal_type(Maker().double)  # reveals: def () -> Tensor

    def make(cls: type[Made], x: torch.Tensor) -> torch.Tensor:
        return x

    def triple(x: torch.Tensor) -> torch.Tensor:
        return 3 * x

    class Made:
        make = classmethod(fdp.pmap(make, in_axes=(None, 0)))
        triple = staticmethod(fdp.pmap(triple))

    reveal_type(Made.make)  # reveals: def (x: Tensor) -> Tensor
    reveal_type(Made().make)  # reveals: def (x: Tensor) -> Tensor
    reveal_type(Made.make(x))  # reveals: Tensor
    Made.make(3)  # error: arg-type
    reveal_type(Made().triple)  # reveals: def (x: Tensor) -> Tensor

    # --- fdp.DataParallel: the wrapped module keeps its type, as in nn.DataParallel -----------
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 3)

    dp = fdp.DataParallel(Net(), device_ids=["cpu", "cpu"], buffers="average", split="balanced")
    reveal_type(dp)  # reveals: DataParallel[Net]
    reveal_type(dp.module.fc)  # reveals: Linear
    dp(x)
    fdp.DataParallel(model, device_ids=[0, 1], buffers="replica1")  # error: arg-type

    # --- inside a mapped function: collectives, randomness, functional calls --------------------
    @fdp.pmap(axis_name="i", devices=["cpu", "cpu"])
    def inside(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        fdp.pmean(x, "i", weight=x.shape[0])
        fdp.pmean(x, "i", weight=0.5)
        fdp.pmean(x, "i", weight=torch.tensor(2.0))
        reveal_type(fdp.psum(x, "i"))  # reveals: Tensor
        reveal_type(fdp.psum(3.0, "i"))  # reveals: Tensor
        reveal_type(fdp.pmean(x, "i", weight=2))  # reveals: Tensor
        reveal_type(fdp.pmean(x, "i", weight=2, donate=True))  # reveals: Tensor
        reveal_type(fdp.pmax(x, "i", donate=True))  # reveals: Tensor
        fdp.psum(x, "i", True)  # error: call-overload
        reveal_type(fdp.psum({"x": x}, "i"))  # reveals: Any
        reveal_type(fdp.pmax(x, "i"))  # reveals: Tensor
        reveal_type(fdp.pmin(1, "i"))  # reveals: Tensor
        reveal_type(fdp.all_gather(x, "i", dim=0, tiled=True))  # reveals: Tensor
        reveal_type(fdp.ppermute(x, "i", [(0, 1), (1, 0)]))  # reveals: Tensor
        reveal_type(fdp.axis_index("i"))  # reveals: int
        reveal_type(fdp.axis_size("i"))  # reveals: int
        with fdp.rng_scope(fdp.replica_seed(fdp.fold_in(0, 1), "i")) as nothing:
            reveal_type(nothing)  # reveals: None
            y: torch.Tensor = fdp.functional_call(model, params, (x,))  # Any: as torch.func's
        out, buffers = fdp.stateful_call(model, params, {}, (x,))
        reveal_type(buffers)  # reveals: dict[str, Tensor]
        return y

    # --- resident state ---------------------------------------------------------------------
    resident = fdp.device_put_replicated({"params": params}, ["cpu", "cpu"])
    fdp.unreplicate(resident, 1)
    pr = fdp.PerReplica([x, x], [torch.device("cpu")] * 2)
    reveal_type(pr.devices)  # reveals: tuple[device, ...]

    # --- fdp.distributed ----------------------------------------------------------------------
    fdp.distributed.initialize(backend="gloo", timeout=30.0, rank=0, world_size=1)
    reveal_type(fdp.distributed.local_devices())  # reveals: list[device]
    reveal_type(fdp.distributed.rank())  # reveals: int
    reveal_type(fdp.distributed.is_main_process())  # reveals: bool
    reveal_type(fdp.distributed.broadcast({"w": x}))  # reveals: dict[str, Tensor]
    reveal_type(fdp.distributed.shard_batch((x, x)))  # reveals: tuple[Tensor, Tensor]
    fdp.distributed.shutdown()

    # --- the nn.parallel primitives ------------------------------------------------------------
    reveal_type(fdp.replicate(params, ["cpu", "cpu"]))  # reveals: list[dict[str, Parameter]]
    shards = fdp.scatter({"x": x}, ["cpu", "cpu"], split="balanced")
    reveal_type(fdp.parallel_apply(f, [(s["x"],) for s in shards]))  # reveals: list[tuple[Tensor, int]]
    outputs = fdp.parallel_apply([model, model], [(s["x"],) for s in shards], devices=["cpu", "cpu"])
    fdp.gather(outputs, "cpu", out_axes=0)

    # --- fdp.optim ----------------------------------------------------------------------------
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(1e-3))
    state = opt.init(params)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    new_params, state = opt.apply_gradients(grads, state, params)
    updates, state = opt.update(grads, state, params)
    new_params = fdp.optim.apply_updates(params, updates)
    # params left out, where the transformation needs none (clip_by_global_norm's example)
    clip = fdp.optim.clip_by_global_norm(1.0)
    clipped, _ = clip.update(grads, clip.init(None))
    opt.update(grads)  # error: call-arg
    init, update = fdp.optim.sgd(0.1, momentum=0.9)
    # Generic in the state: another optimizer's state is caught before it runs.
    # (mypy reveals a named tuple as its fields, the class named as the fallback.)
    reveal_type(fdp.optim.adam().init(params))  # reveals: tuple[int, Any, Any, Any, fallback=AdamState]
    reveal_type(clip.init(None))  # reveals: tuple[(), fallback=EmptyState]
    reveal_type(state)  # reveals: tuple[Any, ...]
    sgd = fdp.optim.sgd(0.1)
    sgd.apply_gradients(grads, fdp.optim.adam().init(params), params)  # error: arg-type
    sgd.update(grads, fdp.optim.adam().init(params), params)  # error: arg-type
    _, sgd_state = sgd.apply_gradients(grads, sgd.init(params), params)
    reveal_type(sgd_state)  # reveals: tuple[int, Any, fallback=SgdState]

    def make_optimizer(lr: float) -> fdp.optim.GradientTransformation:  # bare: any state
        return fdp.optim.adam(lr) if lr else fdp.optim.sgd(lr)
    fdp.optim.adam(torch.tensor(1e-3))  # a 0-dim tensor, as torch.optim takes
    # Parameter groups: a transformation per label, whatever its state.
    groups = fdp.optim.multi_transform(
        {"decay": fdp.optim.adamw(1e-3, weight_decay=0.1), "no_decay": fdp.optim.sgd(0.1)},
        lambda p: {k: "decay" if v.dim() > 1 else "no_decay" for k, v in p.items()},
    )
    reveal_type(groups.init(params))  # reveals: tuple[dict[Any, Any], fallback=MultiTransformState]
    groups.apply_gradients(grads, sgd.init(params), params)  # error: arg-type
    fdp.optim.sgd(lambda step: 0.1 * 0.9**step)

    # A transformation of one's own: the update's parameters may have any names.
    def scale(updates: Any, s: Any, p: Any = None) -> tuple[Any, Any]:
        return updates, s

    def needs_params(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        return grads, state

    fdp.optim.chain(fdp.optim.GradientTransformation(lambda p: (), scale), fdp.optim.sgd(0.1))
    fdp.optim.GradientTransformation(lambda p: (), lambda g, s, params=None: (g, s))
    fdp.optim.GradientTransformation(lambda p: (), needs_params)  # error: arg-type
    """
)

_EXPECTATION = re.compile(r"#\s*(reveals|error):\s*(.+)$")


def _expectations() -> dict[int, tuple[str, str]]:
    """Line number -> (kind, what), from the snippet's comments."""
    found = {}
    for number, line in enumerate(SNIPPET.splitlines(), start=1):
        match = _EXPECTATION.search(line)
        if match:
            found[number] = (match.group(1), match.group(2).strip())
    return found


def _short(revealed: str) -> str:
    # mypy names types by their defining modules (fdp._pmap.Pmapped, torch._tensor.Tensor):
    # compared by their last parts, as a user reads them.
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", revealed)


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[str]]:
    """What mypy reports on each line of the snippet: revealed types and error codes."""
    folder = tmp_path_factory.mktemp("typing")
    (folder / "user_code.py").write_text(SNIPPET)
    (folder / "mypy.ini").write_text(
        "[mypy]\n"
        "strict = True\n"
        "python_version = 3.11\n"
        f"mypy_path = {ROOT}\n"
        # fdp read from the source tree, as an installed package is read: its own errors (under
        # options stricter than its own) are not the user's.
        "[mypy-fdp.*]\n"
        "follow_imports = silent\n"
    )
    # In this process, mypy raises the gc thresholds and the recursion limit for good: put back,
    # so that the tests after this one run as they would without it.
    thresholds, limit = gc.get_threshold(), sys.getrecursionlimit()
    try:
        # No cache (os.devnull): written, it costs more than it saves in one run.
        stdout, stderr, _ = mypy.api.run(
            [
                "--config-file",
                str(folder / "mypy.ini"),
                "--cache-dir",
                os.devnull,
                str(folder / "user_code.py"),
            ]
        )
    finally:
        gc.set_threshold(*thresholds)
        sys.setrecursionlimit(limit)
    assert not stderr, stderr
    found: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        match = re.match(r".*user_code\.py:(\d+): (note|error): (.*)$", line)
        if match is None:
            continue
        number, kind, message = int(match.group(1)), match.group(2), match.group(3)
        revealed = re.match(r'Revealed type is "(.*)"$', message)
        if revealed:
            found.setdefault(number, []).append("reveals: " + _short(revealed.group(1)))
        elif kind == "error":
            code = re.search(r"\[([a-z-]+)\]$", message)
            found.setdefault(number, []).append("error: " + (code.group(1) if code else message))
    return found


EXPECTED = _expectations()


@pytest.mark.parametrize("number", sorted(EXPECTED), ids=lambda n: SNIPPET.splitlines()[n - 1].strip())
def test_user_code_line(reports: dict[int, list[str]], number: int) -> None:
    kind, what = EXPECTED[number]
    assert reports.get(number, []) == [f"{kind}: {what}"]


def test_nothing_else_is_reported(reports: dict[int, list[str]]) -> None:
    unexpected = {n: r for n, r in reports.items() if n not in EXPECTED}
    assert not unexpected, "\n".join(
        f"{SNIPPET.splitlines()[n - 1]}\n  -> {r}" for n, r in unexpected.items()
    )
