"""Long-run check: many pmapped calls with no growth in threads, memory or caches.

    python benchmarks/soak.py --calls 200000          # the long variant
    python benchmarks/soak.py --calls 10000 --json out.json

tests/test_soak.py runs the short variant (10 000 calls) in CI.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from typing import Any

import torch
from _harness import arguments, write_json
from torch import nn

import fdp
from fdp import _functional_call, _pool, _split, _tree


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def footprint(functions: list[fdp.Pmapped]) -> dict[str, Any]:
    """Everything that could grow: threads, workers, caches, memory."""
    return {
        "threads": threading.active_count(),
        "workers": _pool.worker_count(),
        "plans": sum(len(f._plans) + len(f._out_plans) for f in functions),
        "skeletons": sum(len(v) for v in list(_functional_call._FREE.values())),
        "node_types": len(_tree._REGISTERED) + len(_tree._SEEN_LEAF_TYPES),
        "split_cache": _split.shard_sizes.cache_info().currsize,
        "rss_mib": round(rss_mib(), 1),
    }


def workload() -> tuple[list[fdp.Pmapped], Any]:
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    params = {k: v.detach() for k, v in model.named_parameters()}
    plain = fdp.pmap(lambda x: x * 2, devices=["cpu"] * 2)
    mapped_model = fdp.pmap(model, devices=["cpu"] * 3)
    collective = fdp.pmap(
        lambda x: x - fdp.pmean(x.mean(0), "i", weight=x.shape[0]), axis_name="i", devices=["cpu"] * 2
    )
    failing = fdp.pmap(lambda x: (_ for _ in ()).throw(ValueError("injected")), devices=["cpu"] * 2)

    def call(k: int) -> None:
        x = torch.randn(6 + k % 5, 8)  # a few batch sizes: a few split plans
        plain(x)
        if k % 4 == 0:
            mapped_model(params, x)
        if k % 4 == 1:
            collective(x)
        if k % 50 == 2:
            with contextlib.suppress(ValueError):
                failing(x)

    return [plain, mapped_model, collective, failing], call


def soak(calls: int, warmup: int = 500) -> dict[str, Any]:
    functions, call = workload()
    for k in range(warmup):
        call(k)
    gc.collect()  # what earlier work left for the collector is not the soak's growth
    before = footprint(functions)
    started = time.perf_counter()
    for k in range(warmup, warmup + calls):
        call(k)
    seconds = time.perf_counter() - started
    after = footprint(functions)
    return {"calls": calls, "seconds": round(seconds, 2), "before": before, "after": after}


def main() -> None:
    parser = arguments(__doc__, rounds=None)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    result = soak(args.calls)
    print(f"{'':12}{'before':>12}{'after':>12}")
    for key in result["before"]:
        print(f"{key:12}{result['before'][key]:>12}{result['after'][key]:>12}")
    print(f"{result['calls']} calls in {result['seconds']} s")
    write_json(args.json, {"benchmark": "soak", **result})


if __name__ == "__main__":
    main()
