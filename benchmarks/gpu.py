"""GPU benchmark: fdp against the plain single-device step and nn.DataParallel, and transfer bandwidth.

    python benchmarks/gpu.py [--rounds 9] [--json gpu.json]

Needs a CUDA device. Step time (ms) for one training step of an MLP and a small transformer, and
the host's time to issue it (from the call to its return, the GPU idle before it), on:
the plain module on ``cuda:0``; ``fdp.pmap`` with resident state and ``fdp.DataParallel`` on
``["cuda:0"]``, on two replicas of ``cuda:0`` and on every GPU when there are several (on
``["cuda:0"]`` also with the gradients donated to the ``pmean``, ``donate=True``);
``nn.DataParallel`` on ``[0]``, on ``[0, 0]`` (reported as unsupported, with torch's error, if
this torch refuses a device twice) and on every GPU when there are several. Before the timing,
two steps of every variant must leave the parameters the plain step's two leave
(``max_param_diff``; see ``_harness.same_parameters``). Bandwidth (GB/s) of ``fdp.scatter``
and ``fdp.replicate`` against a plain copy, each counted by the bytes it moves (see
:func:`bandwidth`).

With ``--compile``, on one replica, the compiled paths against the plain step compiled as a
module user would compile it (``torch.compile(model)``): the resident step with
``torch.func.grad`` and ``pmap(compile=True)``, and with ``compile={"mode":
"reduce-overhead"}`` (CUDA graphs), each step begun with
``torch.compiler.cudagraph_mark_step_begin()``. They compile in two warm-up steps; one that
fails there, or leaves other parameters than the plain step, is reported with its error
rather than timed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.nn.functional as F
from _harness import arguments, interleaved, issue_times, same_parameters, table, write_json
from torch import nn

import fdp
from fdp import optim


def make(kind: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "mlp":
        model = nn.Sequential(
            nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 10)
        )
        x = torch.randn(512, 1024, device="cuda")
    else:
        layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
        model = nn.Sequential(nn.TransformerEncoder(layer, 4), nn.Flatten(), nn.Linear(512 * 64, 10))
        x = torch.randn(64, 64, 512, device="cuda")
    return model.cuda(), x, torch.randint(0, 10, (x.shape[0],), device="cuda")


def module_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """The usual step of a module-based trainer: zero the grads, backward, SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def steps(
    kind: str, *, compiled: bool = False
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str], dict[str, torch.Tensor]]:
    """The timed step of every variant, a reader of each variant's parameters (one dict per
    copy it keeps), the variants that failed to run (with the error), and the initial
    parameters. ``compiled``: the compiled variants too (see :func:`compiled_steps`)."""
    model, x, y = make(kind)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    variants: dict[str, Any] = {}
    readers: dict[str, Any] = {}
    unsupported: dict[str, str] = {}

    def module_params(module: nn.Module) -> Callable[[], list[dict[str, torch.Tensor]]]:
        return lambda: [dict(module.named_parameters())]

    plain = copy.deepcopy(model)
    variants["plain cuda:0"], readers["plain cuda:0"] = module_step(plain, x, y), module_params(plain)

    opt = optim.sgd(0.01)
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for devices in (["cuda:0"], ["cuda:0", "cuda:0"], *([gpus] if len(gpus) > 1 else [])):
        params = {k: v.detach() for k, v in model.named_parameters()}

        # On one replica also with the gradients donated to the pmean (its copy skipped).
        for donate in (False, True) if len(devices) == 1 else (False,):

            @fdp.pmap(axis_name="b", devices=devices, split="balanced", out_axes=fdp.PER_REPLICA)
            def step(
                state: dict[str, Any], x: torch.Tensor, y: torch.Tensor, donate: bool = donate
            ) -> dict[str, Any]:
                leaves = {k: v.requires_grad_() for k, v in state["params"].items()}
                loss = F.cross_entropy(fdp.functional_call(model, leaves, (x,)), y)
                grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
                grads = fdp.pmean(grads, "b", weight=x.shape[0], donate=donate)
                new_params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
                return {"params": new_params, "opt": opt_state}

            box = {"state": fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, devices)}

            def resident(step: Any = step, box: dict[str, Any] = box) -> None:
                box["state"] = step(box["state"], x, y)

            def resident_params(
                box: dict[str, Any] = box, n: int = len(devices)
            ) -> list[dict[str, torch.Tensor]]:
                return [{k: v[r] for k, v in box["state"]["params"].items()} for r in range(n)]

            name = f"fdp resident {devices}" + (", donated" if donate else "")
            variants[name], readers[name] = resident, resident_params

        wrapped = fdp.DataParallel(copy.deepcopy(model), device_ids=devices)
        variants[f"fdp.DataParallel {devices}"] = module_step(wrapped, x, y)
        readers[f"fdp.DataParallel {devices}"] = module_params(wrapped.module)

    for ids in ([0], [0, 0], *([list(range(len(gpus)))] if len(gpus) > 1 else [])):
        try:  # on a copy of its own: the timed variant starts at the same step as the others
            module_step(nn.DataParallel(copy.deepcopy(model), device_ids=ids), x, y)()
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - reported in the table instead of timed
            unsupported[f"nn.DataParallel {ids}"] = f"{type(err).__name__}: {err}".splitlines()[0]
            continue
        legacy = nn.DataParallel(copy.deepcopy(model), device_ids=ids)
        variants[f"nn.DataParallel {ids}"] = module_step(legacy, x, y)
        readers[f"nn.DataParallel {ids}"] = module_params(legacy.module)
    if compiled:
        for name, (step, read) in compiled_steps(model, x, y).items():
            variants[name], readers[name] = step, read
    return variants, readers, unsupported, initial


def compiled_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """The compiled variants on one replica, each a step and a reader of its parameters: the
    plain module step on ``torch.compile(model)``, and the resident ``torch.func`` step with
    ``pmap(compile=...)``, by inductor and with CUDA graphs ("reduce-overhead"), its gradients
    donated to the ``pmean`` (which runs eagerly between two graphs: donated, the first graph's
    outputs go to the second as they are)."""
    plain = copy.deepcopy(model)
    out: dict[str, Any] = {
        "plain cuda:0, torch.compile": (
            module_step(torch.compile(plain), x, y),
            lambda: [dict(plain.named_parameters())],
        )
    }
    opt = optim.sgd(0.01)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fdp.functional_call(model, p, (x,)), y)

    for label, options in (("compile=True", True), ("reduce-overhead", {"mode": "reduce-overhead"})):

        @fdp.pmap(axis_name="b", devices=["cuda:0"], out_axes=fdp.PER_REPLICA, compile=options)
        def step(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
            grads = torch.func.grad(loss_fn)(state["params"], x, y)
            grads = fdp.pmean(grads, "b", weight=x.shape[0], donate=True)
            new_params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
            return {"params": new_params, "opt": opt_state}

        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        box = {"state": fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, ["cuda:0"])}

        def resident(step: Any = step, box: dict[str, Any] = box) -> None:
            # CUDA graphs: a new iteration, whose replay may overwrite the last one's outputs
            # (the old state, dropped here).
            torch.compiler.cudagraph_mark_step_begin()
            box["state"] = step(box["state"], x, y)

        def read(box: dict[str, Any] = box) -> list[dict[str, torch.Tensor]]:
            return [{k: v[0].clone() for k, v in box["state"]["params"].items()}]

        out[f"fdp resident torch.func, {label}"] = (resident, read)
    return out


def check(
    variants: dict[str, Any],
    readers: dict[str, Any],
    initial: dict[str, torch.Tensor],
    unsupported: dict[str, str],
) -> dict[str, float]:
    """Two steps of every variant, then the same parameters in every copy of every variant.

    A compiled variant (named with "compile" or "reduce-overhead") that fails in its steps or
    its comparison is moved from ``variants`` to ``unsupported``, with its error: where
    compilation fails, the other variants are still timed.
    """
    for name, fn in list(variants.items()):
        try:
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
        except Exception as err:
            if not _compiled(name):
                raise
            _refused(name, err, variants, unsupported)
    for name in [n for n in variants if _compiled(n)]:
        try:
            same_parameters(
                {n: readers[n]() for n in ("plain cuda:0", name)}, baseline="plain cuda:0", initial=initial
            )
        except Exception as err:  # noqa: BLE001 - reported in the table instead of timed
            _refused(name, err, variants, unsupported)
    return same_parameters({n: readers[n]() for n in variants}, baseline="plain cuda:0", initial=initial)


def _compiled(name: str) -> bool:
    return "compile" in name or "reduce-overhead" in name


def _refused(name: str, err: BaseException, variants: dict[str, Any], unsupported: dict[str, str]) -> None:
    del variants[name]
    unsupported[name] = f"{type(err).__name__}: {err}".splitlines()[0][:300]


def moved_bytes(result: Any, source: torch.Tensor) -> int:
    """The bytes of memory that ``result``'s tensors hold apart from ``source``'s: what a
    transfer of ``source`` moved. A tensor already on a target device is used as it is
    (``fdp.replicate`` hands it out, ``fdp.scatter`` cuts views of it) and duplicate devices
    share one copy, so this is counted from the result, not from the devices asked for."""
    seen = {source.untyped_storage().data_ptr()}
    total = 0
    for leaf in optree.tree_leaves(result):
        if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in seen:
            seen.add(leaf.untyped_storage().data_ptr())
            total += leaf.untyped_storage().nbytes()
    return total


def bandwidth(rounds: int) -> list[dict[str, Any]]:
    """GB/s of the bytes each transfer moves (:func:`moved_bytes`), beside a plain copy.

    With one GPU, every transfer starts from 64 MiB of pinned host memory: from ``cuda:0`` to
    ``["cuda:0", "cuda:0"]`` nothing would move. With several, from ``cuda:0`` to every GPU:
    scatter moves every shard but the first, replicate one copy to each other GPU (over
    several links at once: the rate is their sum).
    """
    source = torch.randn(64 << 20 >> 2, device="cuda")  # 64 MiB
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    pinned = source.cpu().pin_memory()
    variants: dict[str, Callable[[], Any]]
    if len(gpus) > 1:
        start, devices = source, gpus
        variants = {"plain copy cuda:0 to cuda:1": lambda: source.to(gpus[1], copy=True)}
    else:
        start, devices = pinned, ["cuda:0", "cuda:0"]
        variants = {"plain copy host to cuda:0": lambda: pinned.to("cuda:0", non_blocking=True)}
    variants["fdp.scatter"] = lambda: fdp.scatter(start, devices)
    variants["fdp.replicate"] = lambda: fdp.replicate({"w": start}, devices)
    # The results are right and on the devices asked for; each transfer moves bytes.
    shards = fdp.scatter(start, devices)
    assert [s.device for s in shards] == [torch.device(d) for d in devices]
    assert torch.equal(torch.cat([s.cpu() for s in shards]), pinned)
    copies = fdp.replicate({"w": start}, devices)
    assert all(
        c["w"].device == torch.device(d) and torch.equal(c["w"].cpu(), pinned)
        for c, d in zip(copies, devices)
    )
    del shards, copies
    moved = {name: moved_bytes(fn(), start) for name, fn in variants.items()}
    assert all(moved.values()), f"a transfer that moves nothing times only its call: {moved}"
    times = interleaved(variants, calls=10, rounds=rounds, sync=torch.cuda.synchronize)
    return [
        {"transfer": name, "MB_moved": moved[name] / 1e6, "GB_per_s": moved[name] / 1e9 / seconds}
        for name, seconds in times.items()
    ]


def main() -> None:
    parser = arguments(__doc__, rounds=9)
    parser.add_argument("--compile", action="store_true", help="add the compiled variants")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device")
    rows = []
    for kind in ("mlp", "transformer"):
        variants, readers, unsupported, initial = steps(kind, compiled=args.compile)
        differences = check(variants, readers, initial, unsupported)
        times = interleaved(variants, calls=10, rounds=args.rounds, sync=torch.cuda.synchronize)
        issued = issue_times(variants, calls=10, rounds=args.rounds, sync=torch.cuda.synchronize)
        base = times["plain cuda:0"]
        rows += [
            {
                "model": kind,
                "variant": n,
                "ms_per_step": t * 1e3,
                "vs_plain": t / base,
                "host_ms_per_step": issued[n] * 1e3,
                "max_param_diff": differences[n],
            }
            for n, t in times.items()
        ]
        rows += [{"model": kind, "variant": n, "note": why} for n, why in unsupported.items()]
    print(
        table(
            rows,
            ["model", "variant", "ms_per_step", "vs_plain", "host_ms_per_step", "max_param_diff", "note"],
        )
    )
    transfers = bandwidth(args.rounds)
    print(table(transfers, ["transfer", "MB_moved", "GB_per_s"]))
    write_json(args.json, {"benchmark": "gpu", "steps": rows, "transfers": transfers})


if __name__ == "__main__":
    main()
