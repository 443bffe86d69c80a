"""Functional data-parallel training with fdp: state resident on every device.

An MLP (with BatchNorm and dropout) learns to tell three interleaved spirals apart, on a data
set generated here from the seed (nothing is downloaded). The training state (parameters,
optimizer state, BatchNorm statistics) is placed on every device once; each step is pmapped:
every replica computes the gradients of its shard, one collective averages gradients, loss and
statistics (weighted by shard size, so uneven shards are exact), and every replica applies the
same update. Only that one exchange crosses devices.

    python examples/train.py                         # every GPU, else two CPU replicas
    python examples/train.py --devices 'cpu*4' --steps 600
    python examples/train.py --steps 600 --resume    # continue from the last checkpoint
    torchrun --standalone --nproc-per-node=2 examples/train.py   # one replica per process

Under torchrun the same step spans every process (fdp.distributed): each process takes its
share of every global batch, logs, shows progress and writes checkpoints only on rank 0, and the
run prints the same final line as one process with as many replicas.

Checkpoints are written atomically (to a temporary file, then renamed) and loaded with
``torch.load(weights_only=True)``; a resumed run ends exactly where an uninterrupted one does.
The last line printed is the final loss and a checksum of the parameters.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import fdp
from fdp import optim

CLASSES = 3


def make_data(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three noisy spirals in the plane, lifted to 8 features."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (size,), generator=g)
    radius = torch.rand(size, generator=g)
    angle = radius * 3 * math.pi + labels * (2 * math.pi / CLASSES) + 0.25 * torch.randn(size, generator=g)
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    features = torch.cat(
        [points, points**2, points.prod(1, keepdim=True), (3 * points).sin(), radius[:, None]], 1
    )
    return features, labels


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, CLASSES),
    )


def parse_devices(text: str | None) -> list[str]:
    """``"cpu,cpu"``, ``"cpu*4"``, ``"cuda:0,cuda:1"``; default: every GPU, else two CPU replicas.

    Under torchrun the default is the process's own device (its GPU, or the CPU).
    """
    if text is None:
        if fdp.distributed.is_initialized():
            return [str(d) for d in fdp.distributed.local_devices()]
        if torch.cuda.is_available():
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        return ["cpu", "cpu"]
    devices: list[str] = []
    for item in text.split(","):
        name, _, count = item.strip().partition("*")
        devices += [name] * (int(count) if count else 1)
    return devices


def build_steps(model: nn.Module, opt: optim.GradientTransformation, devices: list[str]) -> tuple[Any, Any]:
    """The pmapped training and evaluation steps."""

    @fdp.pmap(
        axis_name="batch",
        devices=devices,
        in_axes=(0, 0, 0, None),
        out_axes=(fdp.PER_REPLICA, None),
        split="balanced",  # every replica must run: each holds a copy of the state
    )
    def train_step(state: dict[str, Any], x: torch.Tensor, y: torch.Tensor, seed: int) -> Any:
        def loss_fn(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            # Dropout masks from this replica's own generator: reproducible, different per replica.
            with fdp.rng_scope(fdp.replica_seed(seed, "batch")):
                logits, buffers = fdp.stateful_call(model, params, state["buffers"], (x,))
            return F.cross_entropy(logits, y), buffers

        # JAX's order: the value (here with the new buffers), then the gradients.
        (loss, buffers), grads = fdp.value_and_grad(loss_fn, has_aux=True)(state["params"])
        statistics = {k: v for k, v in buffers.items() if v.is_floating_point()}
        # The one exchange of the step: gradients, loss and BatchNorm statistics, averaged with
        # each replica weighted by its number of rows.
        grads, loss, statistics = fdp.pmean((grads, loss, statistics), "batch", weight=x.shape[0])
        params, opt_state = opt.apply_gradients(grads, state["opt"], state["params"])
        new_state = {
            "params": params,
            "opt": opt_state,
            "buffers": {**buffers, **statistics},
        }
        return new_state, loss

    @fdp.pmap(axis_name="batch", devices=devices, in_axes=(0, 0, 0), out_axes=None, split="balanced")
    def eval_step(
        state: dict[str, Any], x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = fdp.functional_call(model, {**state["params"], **state["buffers"]}, (x,))
        loss_sum = F.cross_entropy(logits, y, reduction="sum")
        correct = (logits.argmax(1) == y).sum()
        return fdp.psum((loss_sum, correct), "batch")

    return train_step, eval_step


def batch_for(
    step: int, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of a step: the data order depends only on the seed and the step."""
    per_epoch = len(x) // batch_size
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(fdp.fold_in(seed, epoch)))
    rows = order[index * batch_size : (index + 1) * batch_size]
    return x[rows], y[rows]


def checksum(params: dict[str, torch.Tensor]) -> float:
    return float(sum(p.double().sum() for p in params.values()))


def save_checkpoint(
    path: Path, step: int, loss: float, state: dict[str, Any], settings: dict[str, Any]
) -> None:
    """Writes the checkpoint next to ``path``, then renames it over: a crash never leaves half a file."""
    single = fdp.unreplicate(state)  # every replica holds the same state
    payload = {
        "step": step,
        "loss": loss,
        "settings": settings,
        "params": {k: v.cpu() for k, v in single["params"].items()},
        "buffers": {k: v.cpu() for k, v in single["buffers"].items()},
        # The optimizer state as a flat list; its structure comes back from opt.init.
        "opt": [v.cpu() if isinstance(v, torch.Tensor) else v for v in optree.tree_leaves(single["opt"])],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(path.name + ".*.tmp"):
        stale.unlink()  # left by a writer that was killed mid-write; the checkpoint itself is whole
    with tempfile.NamedTemporaryFile(
        dir=path.parent, prefix=path.name + ".", suffix=".tmp", delete=False
    ) as f:
        try:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            os.unlink(f.name)
            raise
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(f.name, 0o666 & ~umask)  # NamedTemporaryFile creates 0600; a checkpoint is a normal file
    os.replace(f.name, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


def load_checkpoint(
    path: Path, opt: optim.GradientTransformation, settings: dict[str, Any]
) -> tuple[int, float, dict[str, Any]]:
    payload = torch.load(path, weights_only=True)
    if payload["settings"] != settings:
        changed = {
            k: (payload["settings"].get(k), v) for k, v in settings.items() if payload["settings"].get(k) != v
        }
        raise SystemExit(
            f"{path} was written with other settings (checkpoint's, now): {changed}; resuming would "
            "not continue that run. Use the same settings, or another --checkpoint."
        )
    structure = optree.tree_structure(opt.init(payload["params"]))
    state = {
        "params": payload["params"],
        "buffers": payload["buffers"],
        "opt": optree.tree_unflatten(structure, payload["opt"]),
    }
    return payload["step"], payload["loss"], state


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--devices",
        help="comma-separated devices, e.g. cpu,cpu or 'cpu*4' (default: every GPU, else cpu,cpu)",
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the devices")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/train.pt"))
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    args = parser.parse_args(argv)

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fdp.distributed.initialize()  # launched by torchrun: one step across every process
    main_process = fdp.distributed.is_main_process()
    devices = parse_devices(args.devices)
    replicas = len(devices) * fdp.distributed.world_size()
    if replicas > 1 and all(d.startswith("cpu") for d in devices):
        # The replica threads are the parallelism. Intra-op threads on top would oversubscribe
        # the cores, and replicas competing for them change how float sums are split, so two
        # runs (or a resumed one) would drift apart in the last bits.
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train_x, train_y = make_data(args.seed, 4096)
    eval_x, eval_y = make_data(fdp.fold_in(args.seed, 1), 1024)
    model = make_model()
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(args.lr, weight_decay=1e-4))
    train_step, eval_step = build_steps(model, opt, devices)

    # What the run's numbers depend on: resuming with other values would silently change them.
    settings = {"seed": args.seed, "batch_size": args.batch_size, "lr": args.lr, "replicas": replicas}
    start, last_loss = 0, float("nan")
    if args.resume and args.checkpoint.exists():
        start, last_loss, single = load_checkpoint(args.checkpoint, opt, settings)
        if main_process:
            print(f"resumed from {args.checkpoint} at step {start}", file=sys.stderr)
    else:
        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = {k: v.detach() for k, v in model.named_buffers()}
        single = {"params": params, "buffers": buffers, "opt": opt.init(params)}
    state = fdp.device_put_replicated(single, devices)  # placed once; stays on the devices

    def evaluate() -> tuple[float, float]:
        model.eval()
        loss_sum, correct = 0.0, 0
        for i in range(0, len(eval_x), 256):
            x, y = fdp.distributed.shard_batch(
                (eval_x[i : i + 256], eval_y[i : i + 256]), local_replicas=len(devices)
            )
            s, c = eval_step(state, x, y)
            loss_sum, correct = loss_sum + float(s), correct + int(c)
        model.train()
        return loss_sum / len(eval_x), correct / len(eval_x)

    model.train()
    loss = torch.tensor(last_loss)
    progress = tqdm(
        total=args.steps,
        initial=start,
        desc=f"training on {replicas} replicas",
        file=sys.stderr,
        mininterval=0.5,
        disable=not main_process,  # one progress bar, rank 0's
    )
    started, seen = time.perf_counter(), 0
    for step in range(start, args.steps):
        batch = batch_for(step, train_x, train_y, args.batch_size, args.seed)
        seen += len(batch[0])  # the global batch
        x, y = fdp.distributed.shard_batch(batch, local_replicas=len(devices))  # this process's rows
        state, loss = train_step(state, x, y, fdp.fold_in(args.seed, step))
        done = step + 1
        progress.update(1)
        rate = seen / (time.perf_counter() - started)
        progress.set_postfix(loss=f"{float(loss):.4f}", samples_per_s=f"{rate:.0f}", refresh=False)
        if done % args.eval_every == 0 or done == args.steps:
            eval_loss, accuracy = evaluate()  # every process evaluates its share
            if main_process:
                progress.write(f"step {done}: eval loss {eval_loss:.4f}, accuracy {accuracy:.3f}")
        if (done % args.checkpoint_every == 0 or done == args.steps) and main_process:
            save_checkpoint(args.checkpoint, done, float(loss), state, settings)
    progress.close()
    fdp.distributed.shutdown()
    if not main_process:
        return
    params = fdp.unreplicate(state)["params"]
    print(
        f"final: step={max(start, args.steps)} loss={float(loss):.6f} params_checksum={checksum(params):.6f}"
    )


if __name__ == "__main__":
    main()
