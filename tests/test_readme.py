"""The README's example runs, and .ci/run runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_example_runs(capsys) -> None:
    code = re.search(r"```python\n(.*?)```", README, re.S)[1]
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "[4, 4, 4, 4, 4, 4, 4, 2]"


def test_ci_runs_the_readme_test_command() -> None:
    commands = [
        line
        for line in re.search(r"```bash\n(.*?)```", README, re.S)[1].splitlines()
        if line and not line.startswith("#")
    ]
    assert len(commands) == 2
    test_command = commands[1]
    assert "pytest" in test_command and "torch==2.13.0" in test_command
    assert test_command in (ROOT / ".ci" / "run").read_text()
