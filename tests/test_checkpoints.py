"""Killing the training process (SIGKILL) while it writes a checkpoint leaves the previous one
loadable, and resuming from it reproduces the uninterrupted run exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--batch-size", "48", "--checkpoint-every", "10", "--eval-every", "10"]


def train(checkpoint: Path, *args: str) -> list[str]:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train.py"),
            "--checkpoint",
            str(checkpoint),
            *COMMON,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return result.stdout.strip().splitlines() + [
        line for line in result.stderr.splitlines() if "eval loss" in line
    ]


def test_sigkill_while_writing_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    checkpoint = tmp_path / "run" / "train.pt"
    train(checkpoint, "--steps", "20")  # checkpoints at steps 10 and 20
    assert torch.load(checkpoint, weights_only=True)["step"] == 20

    # Continue to step 30, but hang inside the write of the step-30 checkpoint and get killed there.
    driver = textwrap.dedent(
        f"""
        import runpy, sys, time, torch
        def stuck_save(obj, f, *args, **kwargs):
            f.write(b"half a checkpoint")
            f.flush()
            print("WRITING", flush=True)
            time.sleep(120)
        torch.save = stuck_save
        sys.argv = ["train.py", "--checkpoint", {str(checkpoint)!r}, *{COMMON!r}, "--steps", "30", "--resume"]
        runpy.run_path({str(ROOT / "examples" / "train.py")!r}, run_name="__main__")
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as process:
        try:
            for line in process.stdout:  # type: ignore[union-attr]
                if "WRITING" in line:
                    break
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert list(checkpoint.parent.glob("*.tmp"))  # the half-written file is there...
    payload = torch.load(checkpoint, weights_only=True)  # ...and the checkpoint is still whole
    assert payload["step"] == 20

    resumed = train(checkpoint, "--steps", "30", "--resume")
    uninterrupted = train(tmp_path / "other" / "train.pt", "--steps", "30")
    assert resumed[-2:] == uninterrupted[-2:]  # the final line and the last evaluation, exactly
    assert not list(checkpoint.parent.glob("*.tmp"))  # the next write cleared the leftover
