"""The benchmark scripts stay runnable: each one, at its smallest, runs and writes its JSON.

This times nothing (speed is read off the scripts' own side-by-side ratios, never asserted in a
test); it fails when a script breaks, e.g. on a change of fdp's API.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    assert payload["machine"]["torch"] == torch.__version__
    return payload


def test_dispatch_measures_every_variant(tmp_path: Path) -> None:
    rows = run_script("dispatch", "--rounds", "1", tmp_path=tmp_path)["rows"]
    measured = {(row["input"], row["variant"]) for row in rows}
    for given in ("1 tensor", "100 leaves", "1000 leaves"):
        assert {(given, f"{n} replicas") for n in (1, 2, 4)} <= measured
    assert ("1000 leaves", "bare chunk+cat (2)") in measured
    assert ("1000 leaves", "bare split+cat (2)") in measured
    assert all(
        "ratio_to_bare_split" in row
        for row in rows
        if row["variant"] == "2 replicas" and "leaves" in row["input"]
    )
    assert ("~1 ms step", "1 replicas") in measured
    assert ("~1 ms resident step", "1 replicas") in measured
    assert ("~1 ms resident step", "1 replicas, pmean donated") in measured
    assert ("~1 ms module step", "fdp.DataParallel (1 cpu)") in measured
    host_bound = {variant for given, variant in measured if given == "host-bound step"}
    assert host_bound == {
        "direct",
        "torch.func.functional_call step",
        "fdp.functional_call step",
        "1 replicas, resident, pmean donated",
        "fdp.DataParallel (1 cpu)",
    }
    assert all(row["us_per_call"] > 0 for row in rows)


def test_dispatch_compiles_the_host_bound_step_beside_the_compiled_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dispatch.py --compile``'s rows, with aot_eager rather than inductor (seconds, not a
    minute): both compiled steps run, leave the plain step's parameters, and are timed."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("dispatch", ROOT / "benchmarks" / "dispatch.py")
    assert spec is not None and spec.loader is not None
    dispatch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dispatch)
    torch._dynamo.reset()
    try:
        rows = dispatch.host_bound_rows(1, {"backend": "aot_eager"})
    finally:
        torch._dynamo.reset()
    assert {row["variant"] for row in rows} >= {
        "direct",
        "direct, torch.compile",
        "1 replicas, resident, torch.func, compiled, pmean donated",
    }
    assert all(row["us_per_call"] > 0 for row in rows)


def test_training_measures_fdp_beside_ddp(tmp_path: Path) -> None:
    payload = run_script("training", "--model", "mlp", "--rounds", "1", "--steps", "1", tmp_path=tmp_path)
    variants = {row["variant"] for row in payload["rows"]}
    assert {
        "single",
        "fdp resident (2 cpu)",
        "fdp DataParallel (2 cpu)",
        "DDP gloo (2 procs)",
        "DDP gloo, tuned (2 procs)",
    } <= variants
    assert all(row["samples_per_s"] > 0 and row["first_3_steps_s"] > 0 for row in payload["rows"])
    # The variants took the same steps: DDP's processes and fdp's replicas included.
    assert all(row["max_param_diff"] < 1e-5 for row in payload["rows"])


def test_soak_reports_before_and_after(tmp_path: Path) -> None:
    payload = run_script("soak", "--calls", "200", tmp_path=tmp_path)
    assert payload["calls"] == 200
    assert payload["before"].keys() == payload["after"].keys()


def test_issue_times_time_each_call_alone_after_a_sync() -> None:
    """The GPU script's host time per step: every call starts right after a sync (an idle
    device), and only the call itself is timed, not the sync before it."""
    spec = importlib.util.spec_from_file_location("_harness", ROOT / "benchmarks" / "_harness.py")
    assert spec is not None and spec.loader is not None
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    log: list[str] = []

    def sync() -> None:
        log.append("sync")
        time.sleep(0.01)  # a device still busy: not part of any call's time

    def call(name: str, seconds: float) -> Callable[[], None]:
        def run() -> None:
            log.append(name)
            time.sleep(seconds)

        return run

    variants = {"slow": call("slow", 0.002), "fast": call("fast", 0.0)}
    times = harness.issue_times(variants, calls=2, rounds=3, sync=sync)
    assert set(times) == {"slow", "fast"}
    assert times["slow"] >= 0.002
    assert times["fast"] < 0.01  # the sync's 10 ms are not counted (sleep(0) returns at once)
    calls = [entry for entry in log if entry != "sync"]
    # Interleaved rounds, in the harness's order: each round measures each variant once.
    assert calls == [
        name for order in harness.orders(["slow", "fast"], 3) for name in order for _ in range(2)
    ]
    assert all(log[i - 1] == "sync" for i, entry in enumerate(log) if entry != "sync")
    assert log[-1] == "sync"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the script runs in full")
def test_gpu_script_says_it_needs_cuda() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "benchmarks/gpu.py needs a CUDA device" in result.stderr


@pytest.mark.cuda
def test_gpu_script_runs(tmp_path: Path) -> None:
    payload = run_script("gpu", "--rounds", "1", "--compile", tmp_path=tmp_path)
    assert {row["variant"] for row in payload["steps"]} >= {
        "plain cuda:0",
        "fdp resident ['cuda:0']",
        "plain cuda:0, torch.compile",
        "fdp resident torch.func, compile=True",
        "fdp resident torch.func, reduce-overhead",  # timed, or a row with its error
    }
    assert all(row["host_ms_per_step"] > 0 for row in payload["steps"] if "note" not in row)
    assert all(row["GB_per_s"] > 0 for row in payload["transfers"])


def load_script(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A benchmark script as a module (its own imports of ``_harness`` found), not run."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_transfers_count_the_bytes_they_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU script's bandwidth counts what a transfer copied, read off its result: replicating
    a tensor to the device it is on (the script's ``fdp.replicate`` row once did, on one GPU)
    copies nothing, and neither do a scatter's views of it."""
    import fdp

    gpu = load_script("gpu", monkeypatch)
    source = torch.randn(64, 4)
    assert gpu.moved_bytes(fdp.replicate({"w": source}, ["cpu", "cpu"]), source) == 0
    assert gpu.moved_bytes(fdp.scatter(source, ["cpu", "cpu"]), source) == 0
    assert gpu.moved_bytes(source.clone(), source) == source.nbytes
    assert gpu.moved_bytes([source, source.clone(), source.clone()], source) == 2 * source.nbytes


def test_gpu_check_reports_a_failing_compiled_variant_instead_of_timing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where compiling fails on a GPU (CUDA graphs, say), the GPU script still times the other
    variants and reports that one's error; a compiled step that computes something else is
    reported alike, and a failure of an eager variant stops the run."""
    gpu = load_script("gpu", monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def fails() -> None:
        raise RuntimeError("no graph for you\nsecond line")

    initial, moved, other = {"w": torch.zeros(2)}, {"w": torch.ones(2)}, {"w": torch.full((2,), 2.0)}
    variants = {"plain cuda:0": lambda: None, "a, reduce-overhead": fails, "b, compile=True": lambda: None}
    readers = {
        "plain cuda:0": lambda: [moved],
        "a, reduce-overhead": lambda: [moved],
        "b, compile=True": lambda: [other],
    }
    unsupported: dict[str, str] = {}
    assert gpu.check(variants, readers, initial, unsupported) == {"plain cuda:0": 0.0}
    assert list(variants) == ["plain cuda:0"]
    assert unsupported["a, reduce-overhead"] == "RuntimeError: no graph for you"
    assert unsupported["b, compile=True"].startswith(
        "AssertionError: b, compile=True, w: Tensor-likes are not close"
    )
    with pytest.raises(RuntimeError, match="no graph"):
        gpu.check({"plain cuda:0": fails}, readers, initial, {})


def test_same_parameters_refuses_a_variant_that_computes_something_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check every benchmark runs before timing: all copies of all variants match the
    baseline's parameters after the same steps; a gradient summed over 2 replicas instead of
    averaged (twice the step) fails, and so do steps that left the parameters as they were."""
    harness = load_script("_harness", monkeypatch)
    initial = {"w": torch.zeros(3)}
    step = {"w": torch.full((3,), -0.1)}
    close = {"w": step["w"] + 1e-8}
    differences = harness.same_parameters(
        {"plain": [step], "fdp": [close, step]}, baseline="plain", initial=initial
    )
    assert differences["plain"] == 0 and 0 < differences["fdp"] < 1e-7
    with pytest.raises(AssertionError, match="summed, w"):
        harness.same_parameters(
            {"plain": [step], "summed": [step, {"w": 2 * step["w"]}]}, baseline="plain", initial=initial
        )
    with pytest.raises(AssertionError, match="left the parameters as they were"):
        harness.same_parameters({"plain": [initial], "fdp": [initial]}, baseline="plain", initial=initial)


def test_rounds_put_every_variant_after_every_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variant runs after what the one before it left (its data in the caches, its threads
    spinning). In a fixed order, or one that only rotates, each always follows the same
    neighbours; the harness's rounds put each after every other, in the same order every run."""
    harness = load_script("_harness", monkeypatch)
    names = ["a", "b", "c", "d"]
    rounds = harness.orders(names, 40)
    assert all(sorted(order) == names for order in rounds)
    assert rounds == harness.orders(names, 40)
    sequence = [name for order in rounds for name in order]
    followed = {(before, after) for before, after in zip(sequence, sequence[1:]) if before != after}
    assert followed == {(x, y) for x in names for y in names if x != y}
