"""GPU benchmark: fdp against the plain single-device step and nn.DataParallel, and transfer bandwidth.

    python benchmarks/gpu.py [--rounds 9] [--json gpu.json]

Needs a CUDA device. Step time (ms) for one training step of an MLP and a small transformer, and
the host's time to issue it (from the call to its return, the GPU idle before it), on:
the plain module on ``cuda:0``; ``fdp.pmap`` with resident state and ``fdp.DataParallel`` on
``["cuda:0"]`` and on two replicas of ``cuda:0``; ``nn.DataParallel`` on ``[0]``, on ``[0, 0]``
(reported as unsupported, with torch's error, if this torch refuses a device twice) and on every
GPU when there are several. Bandwidth (GB/s) of ``fdp.scatter`` and ``fdp.replicate`` against a
plain device-to-device copy of the same bytes (host-to-device when there is one GPU).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _harness import arguments, interleaved, issue_times, table, write_json
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


def steps(kind: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The timed step of every variant, and the variants that failed to run (with the error)."""
    model, x, y = make(kind)
    variants: dict[str, Any] = {}
    unsupported: dict[str, str] = {}

    variants["plain cuda:0"] = module_step(copy.deepcopy(model), x, y)

    opt = optim.sgd(0.01)
    for devices in (["cuda:0"], ["cuda:0", "cuda:0"]):
        params = {k: v.detach() for k, v in model.named_parameters()}

        @fdp.pmap(axis_name="b", devices=devices, split="balanced", out_axes=fdp.PER_REPLICA)
        def step(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
            leaves = {k: v.requires_grad_() for k, v in state["params"].items()}
            loss = F.cross_entropy(fdp.functional_call(model, leaves, (x,)), y)
            grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
            grads = fdp.pmean(grads, "b", weight=x.shape[0])
            new_params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
            return {"params": new_params, "opt": opt_state}

        box = {"state": fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, devices)}

        def resident(step: Any = step, box: dict[str, Any] = box) -> None:
            box["state"] = step(box["state"], x, y)

        variants[f"fdp resident {devices}"] = resident

        wrapped = fdp.DataParallel(copy.deepcopy(model), device_ids=devices)
        variants[f"fdp.DataParallel {devices}"] = module_step(wrapped, x, y)

    several = [list(range(torch.cuda.device_count()))] if torch.cuda.device_count() > 1 else []
    for ids in ([0], [0, 0], *several):
        legacy = module_step(nn.DataParallel(copy.deepcopy(model), device_ids=ids), x, y)
        try:
            legacy()
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - reported in the table instead of timed
            unsupported[f"nn.DataParallel {ids}"] = f"{type(err).__name__}: {err}".splitlines()[0]
            continue
        variants[f"nn.DataParallel {ids}"] = legacy
    return variants, unsupported


def bandwidth(rounds: int) -> list[dict[str, Any]]:
    source = torch.randn(64 << 20 >> 2, device="cuda")  # 64 MiB
    gbytes = source.numel() * 4 / 1e9
    others = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    devices = others if len(others) > 1 else ["cuda:0", "cuda:0"]
    pinned = source.cpu().pin_memory()
    variants = {
        "plain copy (same bytes)": (lambda: source.to(devices[-1], copy=True))
        if len(others) > 1
        else (lambda: pinned.to("cuda:0", non_blocking=True)),
        "fdp.scatter": lambda: fdp.scatter(source if len(others) > 1 else pinned, devices),
        "fdp.replicate": lambda: fdp.replicate({"w": source}, devices),
    }
    times = interleaved(variants, calls=10, rounds=rounds, sync=torch.cuda.synchronize)
    return [{"transfer": name, "GB_per_s": gbytes / seconds} for name, seconds in times.items()]


def main() -> None:
    parser = arguments(__doc__, rounds=9)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device")
    rows = []
    for kind in ("mlp", "transformer"):
        variants, unsupported = steps(kind)
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
            }
            for n, t in times.items()
        ]
        rows += [{"model": kind, "variant": n, "note": why} for n, why in unsupported.items()]
    print(table(rows, ["model", "variant", "ms_per_step", "vs_plain", "host_ms_per_step", "note"]))
    transfers = bandwidth(args.rounds)
    print(table(transfers, ["transfer", "GB_per_s"]))
    write_json(args.json, {"benchmark": "gpu", "steps": rows, "transfers": transfers})


if __name__ == "__main__":
    main()
