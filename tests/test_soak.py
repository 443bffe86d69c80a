"""10 000 pmapped calls (plain, module, collective, failing) with no growth in threads, workers,
caches or memory. The long variant is benchmarks/soak.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # for its `from _harness import ...`
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_ten_thousand_calls_grow_nothing() -> None:
    threads = torch.get_num_threads()
    try:
        result = load_soak().soak(10_000)
    finally:  # the soak runs on one intra-op thread; the tests after it run on the usual number
        torch.set_num_threads(threads)
    before, after = result["before"], result["after"]
    for key in ("plans", "split_cache"):  # the soak's own caches: exactly as after warm-up
        assert after[key] == before[key], (key, before, after)
    for key in ("threads", "workers", "skeletons", "node_types"):  # process-wide: no growth
        assert after[key] <= before[key], (key, before, after)
    assert after["rss_mib"] - before["rss_mib"] < 30, (before, after)
