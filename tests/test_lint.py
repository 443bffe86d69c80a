"""Static checks as tests, so CI runs them: ruff (lint and format) and mypy on the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["fdp", "tests", "examples", "benchmarks"]


def run_module(module: str, *args: str) -> None:
    pytest.importorskip(module)
    result = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_lint() -> None:
    run_module("ruff", "check", *SOURCES)


def test_ruff_format() -> None:
    run_module("ruff", "format", "--check", *SOURCES)


def test_mypy() -> None:
    run_module("mypy", "fdp")
