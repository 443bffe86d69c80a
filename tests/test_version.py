"""fdp's torch floor: refused at import below it, and stated alike in pyproject.toml and the docs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fdp
from fdp._version import OLDEST_TORCH, check_torch

ROOT = Path(__file__).resolve().parents[1]
OLDEST = ".".join(map(str, OLDEST_TORCH))


def test_an_older_torch_is_refused_at_import_before_any_submodule_reads_it() -> None:
    # A fresh interpreter, whose torch claims to be older: `import fdp` raises the clear error,
    # not whatever a submodule's import or a later call would stumble on.
    code = "import sys, torch; torch.__version__ = '2.10.1+cpu'; import fdp"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: fdp needs torch {OLDEST} or newer, but torch 2.10.1+cpu"), last


@pytest.mark.parametrize(
    "version", [OLDEST + ".0", "2.13.0+cpu", "2.16.0a0+git1a2b3c", "3.0.0", "10.1", "dev"]
)
def test_this_and_newer_versions_are_accepted(version: str) -> None:
    check_torch(version)


@pytest.mark.parametrize("version", ["2.4.1", "2.10.0+cu128", "1.13.1", "2.9.0a0+gitabc"])
def test_older_versions_are_refused(version: str) -> None:
    with pytest.raises(ImportError, match=re.escape(f"torch {version} is installed")):
        check_torch(version)


def test_the_installed_torch_is_supported() -> None:
    check_torch(torch.__version__)
    assert fdp.__version__


def test_the_floor_is_the_same_in_the_requirements_and_the_docs() -> None:
    assert f'"torch>={OLDEST}"' in (ROOT / "pyproject.toml").read_text()
    assert f"torch {OLDEST}+" in (ROOT / "docs" / "index.md").read_text()
    assert f"({OLDEST} or newer)" in (ROOT / "README.md").read_text()
