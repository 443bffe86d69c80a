"""The examples run as scripts and print what the seed tutorial shows for 2 and 8 GPUs."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str, stderr: bool = False) -> str:
    result = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return result.stdout + result.stderr if stderr else result.stdout


def replica_rows_per_batch(stdout: str) -> list[tuple[int, Counter[int]]]:
    """(outside batch size, multiset of per-replica sizes) for every batch printed."""
    batches: list[tuple[int, Counter[int]]] = []
    inside: Counter[int] = Counter()
    for line in stdout.splitlines():
        if match := re.match(
            r"\tIn Model: input size torch\.Size\(\[(\d+), 5\]\) output size torch\.Size\(\[\1, 2\]\)$", line
        ):
            inside[int(match[1])] += 1
        elif match := re.match(
            r"Outside: input size torch\.Size\(\[(\d+), 5\]\) output_size torch\.Size\(\[\1, 2\]\)$", line
        ):
            batches.append((int(match[1]), inside))
            inside = Counter()
    return batches


@pytest.mark.parametrize(
    ("devices", "full_batch", "last_batch"),
    [
        ("cpu,cpu", {15: 2}, {5: 2}),
        ("cpu*8", {4: 7, 2: 1}, {2: 5}),
    ],
)
def test_tutorial_prints_the_seed_sizes(
    devices: str, full_batch: dict[int, int], last_batch: dict[int, int]
) -> None:
    stdout = run_example("data_parallel_tutorial.py", "--devices", devices)
    assert stdout.startswith(f"Let's use {2 if devices == 'cpu,cpu' else 8} devices!")
    assert replica_rows_per_batch(stdout) == [(30, Counter(full_batch))] * 3 + [(10, Counter(last_batch))]


def run_train(tmp_path: Path, *args: str) -> str:
    checkpoint = tmp_path / "run" / "train.pt"
    stdout = run_example("train.py", "--checkpoint", str(checkpoint), "--eval-every", "10", *args)
    return stdout.strip().splitlines()[-1]


def test_train_resumes_to_the_identical_result(tmp_path: Path) -> None:
    common = ("--checkpoint-every", "10", "--batch-size", "48")
    uninterrupted = run_train(tmp_path / "a", "--steps", "30", *common)
    assert re.fullmatch(r"final: step=30 loss=\d+\.\d{6} params_checksum=-?\d+\.\d{6}", uninterrupted)
    run_train(tmp_path / "b", "--steps", "20", *common)  # stops after its checkpoint at step 20
    resumed = run_train(tmp_path / "b", "--steps", "30", "--resume", *common)
    assert resumed == uninterrupted
    assert not list((tmp_path / "b" / "run").glob("*.tmp"))  # atomic writes leave no temporary files


def test_train_on_three_cpu_replicas_learns(tmp_path: Path) -> None:
    output = run_example(
        "train.py",
        "--devices",
        "cpu*3",
        "--steps",
        "150",
        "--checkpoint",
        str(tmp_path / "t.pt"),
        stderr=True,
    )
    assert "training on 3 replicas" in output and "samples_per_s=" in output
    accuracies = [float(a) for a in re.findall(r"eval loss \d+\.\d+, accuracy (\d\.\d+)", output)]
    assert len(accuracies) == 2 and accuracies[-1] > 0.9
    assert "\nfinal: step=150 " in output
