"""Interleaved timing: every variant is measured in every round, in a shuffled order, so drift on
a shared, noisy machine hits all of them alike; the report is the median per variant and ratios
to a baseline."""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def machine() -> dict[str, Any]:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cores": torch.get_num_threads(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"], info["logical_cpus"] = names[0], len(names)
    except (OSError, IndexError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def arguments(doc: str | None, *, rounds: int | None) -> argparse.ArgumentParser:
    """A script's parser with the options every benchmark has: ``--json FILE``, and ``--rounds``
    when it times rounds (default ``rounds``). Scripts add their own options to it."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if rounds is not None:
        parser.add_argument(
            "--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})"
        )
    parser.add_argument("--json", help="also write the results, with the machine, to this JSON file")
    return parser


def interleaved(
    variants: dict[str, Callable[[], Any]],
    *,
    calls: int,
    rounds: int,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Median seconds per call of each variant over ``rounds`` interleaved rounds of ``calls`` calls.

    The objects that exist once the variants are warm are frozen (``gc.freeze``) while they
    are timed: a full collection traverses every object torch has made, ~170,000 of them
    (~120 ms on the 2-core development machine). Every round allocates alike, so full
    collections come back at the same point of the round cycle and land on the same variant,
    call after call: in a run of 1000-leaf calls, 2 replicas took twice as long as 4. Frozen,
    they cost what the variants' own objects cost.
    """
    for fn in variants.values():  # warm-up: caches, workers, lazy imports
        for _ in range(max(3, calls // 10)):
            fn()
    sync()

    def per_call(fn: Callable[[], Any]) -> list[float]:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return [(time.perf_counter() - start) / calls]

    return _medians(variants, rounds, per_call)


def issue_times(
    variants: dict[str, Callable[[], Any]],
    *,
    calls: int,
    rounds: int,
    sync: Callable[[], None],
) -> dict[str, float]:
    """Median seconds from each call's start to its return, with ``sync`` run before every call.

    On a GPU (``sync=torch.cuda.synchronize``) the device is idle when a call starts, so no
    launch waits for room in the queue and no kernel of an earlier call is still running: the
    time is the host's, to issue the step. Beside :func:`interleaved`'s time per step it tells a
    host-bound step (the two about equal) from a device-bound one, and what a variant's Python
    adds on the host. Rounds are interleaved as there; call the variants warm.
    """

    def each_call(fn: Callable[[], Any]) -> list[float]:
        times = []
        for _ in range(calls):
            sync()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times

    medians = _medians(variants, rounds, each_call)
    sync()
    return medians


def orders(names: list[str], rounds: int) -> list[list[str]]:
    """The order of the variants in each round: a new shuffle every round, the same every run.

    A variant runs after whatever the one before it left: its data in the caches, its threads
    still spinning (OpenMP's after a parallel region, gloo's after a step). In a fixed order
    every variant would always follow the same one, and so would it if the order only rotated
    (the same neighbours, cut at another place); shuffled, each follows every other in turn.
    """
    shuffle = random.Random(0)
    return [shuffle.sample(names, len(names)) for _ in range(rounds)]


def _medians(
    variants: dict[str, Callable[[], Any]], rounds: int, measure: Callable[[Callable[[], Any]], list[float]]
) -> dict[str, float]:
    """The median of the samples ``measure(fn)`` takes of each variant, over ``rounds`` rounds
    that each measure every variant in turn, with the objects that exist frozen (see
    :func:`interleaved`).

    The order is shuffled every round (see :func:`orders`).
    """
    samples: dict[str, list[float]] = {name: [] for name in variants}
    gc.collect()
    gc.freeze()
    try:
        for order in orders(list(variants), rounds):
            for name in order:
                samples[name] += measure(variants[name])
    finally:
        gc.unfreeze()
    return {name: statistics.median(values) for name, values in samples.items()}


Parameters = dict[str, torch.Tensor]


def same_parameters(
    copies: dict[str, list[Parameters]], *, baseline: str, initial: Parameters
) -> dict[str, float]:
    """Each variant's largest difference from the baseline's parameters, after the same steps.

    ``copies`` gives every variant's parameters by name, one dict per copy a variant keeps (each
    replica's resident state, say). A variant faster because it computes something else (a
    skipped update, a different loss, a gradient summed rather than averaged) fails here, before
    its time is taken: the difference must be within float32 rounding (the variants add in
    different orders). And the baseline must have moved from ``initial``: steps that change
    nothing would agree too.
    """
    reference = {k: v.detach().cpu() for k, v in copies[baseline][0].items()}
    if all(torch.equal(reference[k], v.detach().cpu()) for k, v in initial.items()):
        raise AssertionError(f"{baseline}: the steps left the parameters as they were")
    differences = {}
    for name, each in copies.items():
        worst = 0.0
        for params in each:
            assert params.keys() == reference.keys(), f"{name}: parameters {sorted(params)}"
            for key, value in params.items():
                value = value.detach().cpu()
                where = functools.partial(_named, f"{name}, {key}")
                torch.testing.assert_close(value, reference[key], msg=where)
                worst = max(worst, (value - reference[key]).abs().max().item())
        differences[name] = worst
    return differences


def _named(where: str, message: str) -> str:
    return f"{where}: {message}"


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return "" if value is None else str(value)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"machine": machine(), **payload}, f, indent=2)
