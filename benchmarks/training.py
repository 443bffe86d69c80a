"""Training-step throughput (samples/s) on the same model and global batch, measured side by side.

    python benchmarks/training.py [--model mlp|transformer|both] [--rounds 7] [--compile] [--json F]

Variants, interleaved round by round:

* ``single``: one process, the plain module and torch.optim on the whole batch;
* ``fdp resident (2 cpu)``: fdp.pmap over 2 CPU replicas, state resident on both, gradients by
  torch.autograd inside each replica, one pmean;
* ``fdp resident, torch.func (2 cpu)``: the same step with torch.func.grad;
* ``fdp resident, fdp.grad (2 cpu)``: the same step with fdp.grad (torch.func.grad's gradients,
  taken by autograd);
* ``fdp DataParallel (2 cpu)``: fdp.DataParallel with torch.optim;
* ``DDP gloo (2 procs)``: DistributedDataParallel in 2 processes (kept alive, driven by pipes);
* ``DDP gloo, tuned (2 procs)``: the same with ``gradient_as_bucket_view=True`` and
  ``static_graph=True``, the options DDP's documentation gives for speed.

With ``--compile``, two more, each compiled with torch.compile (inductor) before the timed rounds:

* ``fdp resident, torch.func, compiled (2 cpu)``: the torch.func step with ``pmap(compile=True)``;
* ``DDP gloo, compiled (2 procs)``: ``torch.compile`` of the DDP model, what a DDP user would do.

Every variant gets the machine's 2 cores: one intra-op thread per replica or process, 2 for the
single process. All take the same SGD steps on the same global batch of 64 (cross-entropy, mean
over the batch) from the same initial parameters; after the 3 untimed warm-up steps every copy of
every variant's parameters must match the single process's (``max_param_diff``). Besides
throughput, the table gives each variant's first 3 steps in seconds (where the compiled variants
compile).
"""

from __future__ import annotations

import copy
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _harness import arguments, orders, same_parameters, table, write_json
from torch import nn

import fdp
from fdp import optim

BATCH = 64


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
    return nn.Sequential(
        nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True), 2),
        nn.Flatten(),
        nn.Linear(64 * 16, 10),
    )


def make_batch(kind: str, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 256, generator=g) if kind == "mlp" else torch.randn(rows, 16, 64, generator=g)
    return x, torch.randint(0, 10, (rows,), generator=g)


def ddp_worker(rank: int, kind: str, store_path: str, conn: Any, compiled: bool, tuned: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    # Tuned: the options DDP's documentation gives for speed, which fit this static model: the
    # gradients live in the all-reduce buckets (no copy into them and out), and the graph is
    # declared static (no search for unused parameters or re-bucketing after the first steps).
    ddp = nn.parallel.DistributedDataParallel(
        make_model(kind), gradient_as_bucket_view=tuned, static_graph=tuned
    )
    model: Any = torch.compile(ddp) if compiled else ddp
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = make_batch(kind)
    x, y = x.chunk(2)[rank], y.chunk(2)[rank]
    while True:
        steps = conn.recv()
        if steps is None:
            break
        if steps == "params":  # by value: a tensor sent as such would share this process's memory
            buffer = io.BytesIO()
            torch.save({k: v.detach() for k, v in ddp.module.named_parameters()}, buffer)
            conn.send(buffer.getvalue())
            continue
        dist.barrier()  # both start together
        start = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        # No barrier at the end: the last step's all-reduce already waits for the other rank,
        # and the parent takes the longer of the two times; a barrier would add a round trip
        # of gloo that fdp's steps have no counterpart of.
        conn.send(time.perf_counter() - start)
    dist.destroy_process_group()


class DDP:
    """Two DDP processes that run ``steps`` steps whenever asked."""

    def __init__(self, kind: str, *, compiled: bool = False, tuned: bool = False) -> None:
        self.folder = tempfile.mkdtemp()
        context = mp.get_context("spawn")
        pipes = [context.Pipe() for _ in range(2)]
        self.conns = [parent for parent, _ in pipes]
        self.procs = [
            context.Process(
                target=ddp_worker,
                args=(r, kind, os.path.join(self.folder, "store"), pipes[r][1], compiled, tuned),
            )
            for r in range(2)
        ]
        for p in self.procs:
            p.start()

    def run(self, steps: int) -> float:
        for c in self.conns:
            c.send(steps)
        return max(c.recv() for c in self.conns)

    def params(self) -> list[dict[str, torch.Tensor]]:
        """Each process's parameters."""
        for c in self.conns:
            c.send("params")
        return [torch.load(io.BytesIO(c.recv())) for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(30)


Params = dict[str, torch.Tensor]


def fdp_variants(
    kind: str, *, compiled: bool
) -> tuple[dict[str, Any], dict[str, Callable[[], list[Params]]]]:
    """Each in-process variant's step, and a reader of its parameters (one dict per copy)."""
    model = make_model(kind)
    x, y = make_batch(kind)
    params = {k: v.detach() for k, v in model.named_parameters()}
    opt = optim.sgd(0.01)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fdp.functional_call(model, p, (x,)), y)

    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)

    def single() -> None:
        plain_opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()

    def autograd_grads(
        p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        leaves = {k: v.requires_grad_() for k, v in p.items()}  # this replica's own copies
        return dict(zip(leaves, torch.autograd.grad(loss_fn(leaves, x, y), list(leaves.values()))))

    def make_step(grad_fn: Any, compile: bool = False) -> Any:
        @fdp.pmap(
            axis_name="b", devices=["cpu", "cpu"], split="balanced", out_axes=fdp.PER_REPLICA, compile=compile
        )
        def step(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
            grads = fdp.pmean(grad_fn(state["params"], x, y), "b", weight=x.shape[0])
            new_params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
            return {"params": new_params, "opt": opt_state}

        resident = {
            "state": fdp.device_put_replicated({"params": params, "opt": opt.init(params)}, ["cpu", "cpu"])
        }

        def run() -> None:
            resident["state"] = step(resident["state"], x, y)

        def read() -> list[Params]:
            return [{k: v[r] for k, v in resident["state"]["params"].items()} for r in range(2)]

        return run, read

    wrapped = fdp.DataParallel(copy.deepcopy(model), device_ids=["cpu", "cpu"])
    dp_opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)

    def data_parallel() -> None:
        dp_opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        dp_opt.step()

    variants = {"single": single, "fdp DataParallel (2 cpu)": data_parallel}
    readers: dict[str, Callable[[], list[Params]]] = {
        "single": lambda: [dict(plain.named_parameters())],
        "fdp DataParallel (2 cpu)": lambda: [dict(wrapped.module.named_parameters())],
    }
    resident = {
        "fdp resident (2 cpu)": make_step(autograd_grads),
        "fdp resident, torch.func (2 cpu)": make_step(torch.func.grad(loss_fn)),
        "fdp resident, fdp.grad (2 cpu)": make_step(fdp.grad(loss_fn)),
    }
    if compiled:
        resident["fdp resident, torch.func, compiled (2 cpu)"] = make_step(torch.func.grad(loss_fn), True)
    for name, (run, read) in resident.items():
        variants[name], readers[name] = run, read
    order = ["single", *resident, "fdp DataParallel (2 cpu)"]  # the table's order
    return {n: variants[n] for n in order}, readers


def initial(kind: str) -> Params:
    return {k: v.detach() for k, v in make_model(kind).named_parameters()}


def threads(variant: str) -> None:
    """The single process gets the machine's 2 threads for its one replica; fdp one per replica."""
    torch.set_num_threads(2 if variant == "single" else 1)


def measure(kind: str, rounds: int, steps: int, *, compiled: bool = False) -> list[dict[str, Any]]:
    variants, readers = fdp_variants(kind, compiled=compiled)
    ddps = {"DDP gloo (2 procs)": DDP(kind), "DDP gloo, tuned (2 procs)": DDP(kind, tuned=True)}
    if compiled:
        ddps["DDP gloo, compiled (2 procs)"] = DDP(kind, compiled=True)
    warm_up: dict[str, float] = {}  # seconds for the first 3 steps, compilation included
    try:
        for name, ddp in ddps.items():
            ddp.run(0)  # waits for the processes to start: not part of their first steps
            start = time.perf_counter()
            ddp.run(3)
            warm_up[name] = time.perf_counter() - start
        for name, fn in variants.items():
            threads(name)  # as in the timed rounds: dynamo compiles for a thread count
            start = time.perf_counter()
            for _ in range(3):
                fn()
            warm_up[name] = time.perf_counter() - start
        # Every variant has taken the same 3 steps from the same start: the same parameters.
        copies = {name: read() for name, read in readers.items()}
        copies.update((name, ddp.params()) for name, ddp in ddps.items())
        differences = same_parameters(copies, baseline="single", initial=initial(kind))
        names = [*variants, *ddps]
        samples: dict[str, list[float]] = {name: [] for name in names}
        for order in orders(names, rounds):  # shuffled: see _harness.orders
            for name in order:
                if name in ddps:
                    samples[name].append(steps * BATCH / ddps[name].run(steps))
                    continue
                threads(name)
                fn = variants[name]
                start = time.perf_counter()
                for _ in range(steps):
                    fn()
                samples[name].append(steps * BATCH / (time.perf_counter() - start))
    finally:
        for ddp in ddps.values():
            ddp.close()
    medians = {name: statistics.median(v) for name, v in samples.items()}
    return [
        {
            "model": kind,
            "variant": name,
            "samples_per_s": value,
            "vs_ddp": value / medians["DDP gloo (2 procs)"],
            "vs_tuned_ddp": value / medians["DDP gloo, tuned (2 procs)"],
            "vs_single": value / medians["single"],
            "first_3_steps_s": warm_up[name],
            "max_param_diff": differences[name],
        }
        for name, value in medians.items()
    ]


def main() -> None:
    parser = arguments(__doc__, rounds=7)
    parser.add_argument("--model", choices=["mlp", "transformer", "both"], default="both")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="add the compiled variants")
    args = parser.parse_args()
    rows = []
    for kind in ["mlp", "transformer"] if args.model == "both" else [args.model]:
        rows += measure(kind, args.rounds, args.steps, compiled=args.compile)
    columns = ["model", "variant", "samples_per_s", "vs_ddp", "vs_tuned_ddp", "vs_single", "first_3_steps_s"]
    print(table(rows, [*columns, "max_param_diff"]))
    write_json(args.json, {"benchmark": "training", "batch": BATCH, "rows": rows})


if __name__ == "__main__":
    main()
