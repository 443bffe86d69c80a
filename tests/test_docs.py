"""The docs: every public function shows a runnable example, and the site builds with --strict."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import fdp
from fdp import distributed, optim

ROOT = Path(__file__).resolve().parents[1]
STATE_TUPLES = {"AdamState", "SgdState", "EmptyState"}  # plain records, documented by their optimizers


def public_objects() -> list[tuple[str, object]]:
    objects = [(f"fdp.{name}", getattr(fdp, name)) for name in fdp.__all__]
    objects += [
        (f"fdp.optim.{name}", getattr(optim, name)) for name in optim.__all__ if name not in STATE_TUPLES
    ]
    objects += [(f"fdp.distributed.{name}", getattr(distributed, name)) for name in distributed.__all__]
    return [(name, obj) for name, obj in objects if inspect.isfunction(obj) or inspect.isclass(obj)]


@pytest.mark.parametrize(("name", "obj"), public_objects(), ids=[name for name, _ in public_objects()])
def test_public_docstrings_have_a_runnable_example(name: str, obj: object) -> None:
    doc = inspect.getdoc(obj) or ""
    assert ">>> " in doc, f"{name} has no example in its docstring (they run as doctests)"


def test_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("fdp.pmap") > 3
