"""Every ```python block of the docs runs: README.md and docs/**/*.md, page by page.

A page's blocks run in order in one namespace, as a notebook's cells do: a block may use what
the page's earlier blocks defined. HTML comments, which neither the site nor GitHub shows, give
what a block needs that the page does not show:

- ``<!-- hidden python`` ... ``-->``: code run in its place among the blocks, for the context a
  fragment assumes (a model, a batch) or to check what a block claims.
- ``<!-- run in replicas: NAMES -->``, on the line before a fence: the block is the body of a
  mapped function. Each replica of ``fdp.pmap(axis_name="batch", devices=["cpu", "cpu"],
  split="balanced")`` runs it in a copy of the namespace in which the comma-separated NAMES
  are its own arguments: its shard, or its copy of resident state.
- ``<!-- not run: REASON -->``, on the line before a fence: the block is not run. NOT_RUN counts
  them per page, so that leaving a block out is a visible decision.

A page's namespace starts with ``tmp_path``, a folder of its own. A top-level expression or
``print(...)`` of a block whose comment begins like a value (``# [4, 4, 2]``,
``# torch.Size([30, 2]), 15 rows per replica``) is checked: the comment must begin with the
value's repr (with what ``print`` writes, for ``print``).

The pages in TWO_RANKS are the script of both processes of a two-rank job, this module their
``__main__``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import os
import re
import socket
import subprocess
import sys
import tokenize
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]

# Blocks a page leaves out, each with its reason in the page: (page, count).
NOT_RUN = {
    "docs/training.md": 1,
    "docs/migrating/from-dataparallel.md": 1,
}
# Pages whose blocks are the script of each process of a two-rank fdp.distributed job.
TWO_RANKS = {"docs/distributed.md"}

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^\s`]*)")
MARKER = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")
NOT_RUN_MARKER = re.compile(r"not run:\s*(\S.*)")
REPLICAS_MARKER = re.compile(r"run in replicas:\s*(\w+(?:\s*,\s*\w+)*)")
# The beginnings of a comment that states a value: a list, a dict, a tensor, a size, a bool.
CLAIM = re.compile(r"^(\[|\{|tensor\(|torch\.Size\(|True\b|False\b|None\b)")


@dataclasses.dataclass
class Block:
    page: str
    line: int  # of the opening fence (or of "<!-- hidden python"), 1-based
    code: str  # padded with blank lines, so that its line numbers are the page's
    hidden: bool = False
    replicas: tuple[str, ...] | None = None  # the names mapped, for "run in replicas"
    not_run: str | None = None  # the reason

    @property
    def where(self) -> str:
        kind = "hidden python" if self.hidden else "```python block"
        return f"{self.page}:{self.line} ({kind})"


def _language(line: str) -> str | None:
    fence = FENCE.match(line)
    return None if fence is None else fence[3]


def blocks(page: str) -> list[Block]:
    """The page's python blocks, shown and hidden, in order; their markers checked."""
    lines = (ROOT / page).read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == "<!-- hidden python":
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->"), None)
            assert end is not None, f"{page}:{i + 1}: '<!-- hidden python' is never closed by a '-->' line"
            found.append(Block(page, i + 1, "\n" * (i + 1) + "\n".join(lines[i + 1 : end]), hidden=True))
            i = end + 1
            continue
        fence = FENCE.match(line)
        if fence is None:
            marker = MARKER.match(line)
            if marker and re.match(r"(not run|run in)\b", marker[1]):
                assert i + 1 < len(lines) and _language(lines[i + 1]) == "python", (
                    f"{page}:{i + 1}: {line.strip()} must be on the line right before a ```python fence"
                )
            i += 1
            continue
        indent, ticks, language = fence.groups()
        ends = (
            j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks and lines[j].startswith(indent)
        )
        end = next(ends, None)
        assert end is not None, f"{page}:{i + 1}: the fence is never closed"
        assert language == "python" or not language.lower().startswith("py"), (
            f"{page}:{i + 1}: spell the language 'python', not {language!r}, or the block is not run"
        )
        if language == "python":
            code = "\n" * (i + 1) + "\n".join(text[len(indent) :] for text in lines[i + 1 : end])
            block = Block(page, i + 1, code)
            marker = MARKER.match(lines[i - 1]) if i else None
            if marker:
                if not_run := NOT_RUN_MARKER.fullmatch(marker[1]):
                    block.not_run = not_run[1]
                elif replicas := REPLICAS_MARKER.fullmatch(marker[1]):
                    block.replicas = tuple(name.strip() for name in replicas[1].split(","))
                else:
                    raise AssertionError(
                        f"{block.where}: unknown marker {lines[i - 1].strip()!r} before the fence: "
                        "write '<!-- not run: REASON -->' or '<!-- run in replicas: NAMES -->'"
                    )
            found.append(block)
        i = end + 1
    return found


def _comments(code: str) -> dict[int, str]:
    tokens = tokenize.generate_tokens(io.StringIO(code).readline)
    return {token.start[0]: token.string for token in tokens if token.type == tokenize.COMMENT}


def _check_claim(block: Block, statement: ast.Expr, comment: str, namespace: dict[str, Any]) -> None:
    filename = str(ROOT / block.page)
    call = statement.value
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print":
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(ast.Module([statement], []), filename, "exec"), namespace)
        shown = printed.getvalue().rstrip("\n")
        sys.stdout.write(printed.getvalue())
    else:
        shown = repr(eval(compile(ast.Expression(call), filename, "eval"), namespace))
    claimed = comment.lstrip("#").strip()
    if not claimed.startswith(shown) or claimed[len(shown) : len(shown) + 1] not in ("", " ", ",", ";", ":"):
        raise AssertionError(
            f"{block.page}:{statement.lineno}: the comment says {claimed!r}, but the value is {shown!r}"
        )


def run_block(block: Block, namespace: dict[str, Any]) -> None:
    filename = str(ROOT / block.page)  # tracebacks then show the page's lines
    if block.replicas is not None:
        import fdp

        code = compile(block.code, filename, "exec")
        names = block.replicas

        @fdp.pmap(axis_name="batch", devices=["cpu", "cpu"], split="balanced")
        def replica(*arguments: Any) -> None:
            exec(code, {**namespace, **dict(zip(names, arguments))})

        replica(*(namespace[name] for name in names))
        return
    comments = _comments(block.code)
    for statement in ast.parse(block.code, filename).body:
        comment = comments.get(statement.end_lineno or statement.lineno, "")
        if isinstance(statement, ast.Expr) and CLAIM.match(comment.lstrip("#").strip()):
            _check_claim(block, statement, comment, namespace)
        else:
            exec(compile(ast.Module([statement], []), filename, "exec"), namespace)


def run_page(page: str, tmp_path: Path) -> None:
    namespace: dict[str, Any] = {"__name__": "__docs__", "tmp_path": tmp_path}
    for block in blocks(page):
        if block.not_run is not None:
            continue
        try:
            run_block(block, namespace)
        except Exception as error:
            # Python's traceback, one line a frame, rather than pytest's, which shows a page from
            # its first line down to the failing one.
            trace = "".join(traceback.format_exception(error))
            raise AssertionError(
                f"{block.where} failed: {type(error).__name__}: {error}\n\n{trace}"
            ) from None


def run_two_ranks(page: str, tmp_path: Path) -> None:
    """Runs the page in two processes, with the environment torchrun gives its workers.

    Not under torchrun itself: its agent hosts the store, which keeps the first process group's
    keys, and the page's second fdp.distributed.initialize() (after a shutdown()) then finds
    them and fails, now and then, to connect ("Connection refused"). Rank 0 hosts the store here,
    anew for each initialize().
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # CUDA hidden: NCCL wants a GPU of its own per process, and the page's devices are the CPU.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]  # (a pipe that fills would block)
    ranks = []
    for rank, log in enumerate(logs):
        with log.open("w") as output:
            ranks.append(
                subprocess.Popen(
                    [sys.executable, __file__, page, str(tmp_path)],
                    cwd=ROOT,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=output,
                    stderr=subprocess.STDOUT,
                )
            )
    hung = False
    try:
        ranks[0].wait(timeout=120)
        ranks[1].wait(timeout=10)
    except subprocess.TimeoutExpired:
        hung = True
    finally:
        for process in ranks:
            process.kill()  # (nothing, once it has exited)
            process.wait()
    report = "".join(f"--- rank {rank}:\n{log.read_text()}" for rank, log in enumerate(logs))
    assert not hung, f"{page} in two processes: a rank still ran after 120 s, a hang:\n{report}"
    assert [process.returncode for process in ranks] == [0, 0], f"{page} in two processes:\n{report}"


@pytest.mark.parametrize(
    "page",
    [pytest.param(page, marks=pytest.mark.distributed) if page in TWO_RANKS else page for page in PAGES],
)
def test_page_runs(page: str, tmp_path: Path) -> None:
    if page in TWO_RANKS:
        run_two_ranks(page, tmp_path)
    else:
        run_page(page, tmp_path)


def test_blocks_not_run_are_counted() -> None:
    skipped = {page: [b for b in blocks(page) if b.not_run is not None] for page in PAGES}
    counts = {page: len(found) for page, found in skipped.items() if found}
    listed = "\n".join(f"  {b.where}: {b.not_run}" for found in skipped.values() for b in found)
    assert counts == NOT_RUN, f"update NOT_RUN; the blocks not run are:\n{listed}"


def test_every_python_fence_is_found() -> None:
    for page in PAGES:
        fences = re.findall(r"^\s*```python", (ROOT / page).read_text(), re.M)
        assert len([b for b in blocks(page) if not b.hidden]) == len(fences), page


if __name__ == "__main__":  # one rank of a page in TWO_RANKS: test_docs_examples.py PAGE FOLDER
    warnings.simplefilter("error")  # as pytest's filterwarnings
    run_page(sys.argv[1], Path(sys.argv[2]))
