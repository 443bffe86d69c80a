"""The examples run as scripts and print what the seed tutorial shows for 2 and 8 GPUs."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return result.stdout


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
