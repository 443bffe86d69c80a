"""The docs: every public function shows a runnable example, and the site builds with --strict."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


# Public classes that users get from fdp rather than construct: their constructors' options are
# documented where they are made.
MADE_BY_FDP = {"fdp.Pmapped": "fdp.pmap"}
ARGS_HEADER = re.compile(r"^(\s*)Args:\s*$")
ARG_ENTRY = re.compile(r"^(\s*)(\*{0,2}\w+):\s")
DEFAULT = re.compile(r"Default:\s*``(.+?)``")


def _is_record(cls: type) -> bool:
    """A named tuple or a typing protocol: fields or a call shape, not a constructor's options."""
    return (issubclass(cls, tuple) and hasattr(cls, "_fields")) or getattr(cls, "_is_protocol", False)


def documented_callables() -> list[tuple[str, Callable[..., Any], str]]:
    """(name, callable, docstring) for what users call with options: every public function, the
    constructor of every public class that users build, and the public methods fdp defines
    (but a module's ``forward``, which its call runs, and ``extra_repr``, which ``repr`` runs)."""
    found = []
    for name, obj in public_objects():
        if inspect.isfunction(obj):
            found.append((name, obj, inspect.getdoc(obj) or ""))
            continue
        assert isinstance(obj, type)
        if name not in MADE_BY_FDP and not _is_record(obj) and not issubclass(obj, BaseException):
            found.append((name, obj, inspect.getdoc(obj) or ""))
        for attr, value in vars(obj).items():
            function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            if attr.startswith("_") or attr in ("forward", "extra_repr") or not inspect.isfunction(function):
                continue
            found.append((f"{name}.{attr}", getattr(obj, attr), inspect.getdoc(function) or ""))
    return found


def docstring_args(doc: str) -> dict[str, str]:
    """The entries of a Google-style docstring's ``Args:`` section, by name (``*args`` as written)."""
    lines = doc.splitlines()
    starts = [i for i, line in enumerate(lines) if ARGS_HEADER.match(line)]
    if not starts:
        return {}
    header = lines[starts[0]]
    indent = len(header) - len(header.lstrip())
    entries: dict[str, str] = {}
    entry_indent = None
    current = None
    for line in lines[starts[0] + 1 :]:
        if not line.strip():
            continue
        line_indent = len(line) - len(line.lstrip())
        if line_indent <= indent:
            break
        entry = ARG_ENTRY.match(line)
        if entry and (entry_indent is None or line_indent == entry_indent):
            entry_indent = line_indent
            current = entry[2]
            entries[current] = line[entry.end() :].strip()
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def _same_default(written: str, actual: object) -> bool:
    try:
        value = ast.literal_eval(written)
    except (ValueError, SyntaxError):
        return False
    # 1e-3 for 0.001 and 0 for 0.0 are the same default; False for 0 is not.
    return value == actual and (type(value) is type(actual) or {type(value), type(actual)} <= {int, float})


@pytest.mark.parametrize(
    ("name", "fn", "doc"), documented_callables(), ids=[name for name, _, _ in documented_callables()]
)
def test_docstring_args_match_the_signature(name: str, fn: Callable[..., Any], doc: str) -> None:
    """``Args`` lists every parameter, in the signature's order, with its real default, and says
    which are keyword-only (``Keyword-only.``, as ``help()`` and the site's signature show)."""
    parameters = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
    written = {
        ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name: p
        for p in parameters
    }
    entries = docstring_args(doc)
    assert list(entries) == list(written), (
        f"{name}: the docstring's Args lists {list(entries)}, the signature has {list(written)}"
    )
    for key, parameter in written.items():
        entry = entries[key]
        defaults = DEFAULT.findall(entry)
        if parameter.default is parameter.empty:
            assert not defaults, (
                f"{name}: {key} is required, but its Args entry says Default: ``{defaults[0]}``"
            )
        else:
            assert len(defaults) == 1, (
                f"{name}: {key}'s Args entry does not say Default: ``{parameter.default!r}``"
            )
            assert _same_default(defaults[0], parameter.default), (
                f"{name}: {key}'s Args entry says Default: ``{defaults[0]}``, the signature's is "
                f"{parameter.default!r}"
            )
        says_keyword_only = "Keyword-only" in entry
        is_keyword_only = parameter.kind is parameter.KEYWORD_ONLY
        assert says_keyword_only == is_keyword_only, (
            f"{name}: {key} is {'' if is_keyword_only else 'not '}keyword-only, but its Args entry "
            f"{'does not say' if is_keyword_only else 'says'} Keyword-only"
        )


API_PAGE = ROOT / "docs" / "api.md"
# A code span of the table's first column: fdp.NAME or fdp.A/B/C (names in one module), with or
# without its parameters.
SPAN = re.compile(r"`(fdp(?:\.\w+)*)\.(\w+(?:/\w+)*)(\(([^`]*)\))?`")


def api_table() -> dict[str, list[str | None]]:
    """What the first column of docs/api.md's table shows: for each name, the parameter lists
    it is shown with (``None`` where it is named without them)."""
    shown: dict[str, list[str | None]] = {}
    for row in API_PAGE.read_text().splitlines():
        if row.startswith("| `"):
            for span in SPAN.finditer(row.split(" | ")[0]):
                for name in span[2].split("/"):
                    shown.setdefault(f"{span[1]}.{name}", []).append(span[4])
    return shown


def _shown_parameters(listing: str) -> list[str]:
    """The entries of a shown parameter list, split on the commas between them."""
    entries, depth, current = [], 0, ""
    for char in listing:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            entries.append(current.strip())
            current = ""
        else:
            current += char
    return [*entries, current.strip()] if current.strip() else entries


def check_shown_signature(shown: str, signature: inspect.Signature) -> None:
    """``shown``, ``name(parameters)``, has the signature's parameters in order, with their
    defaults, and ``/`` and ``*`` where the signature has them; ``...`` stands for parameters
    left out."""
    parameters = [p for p in signature.parameters.values() if p.name not in ("self", "cls")]
    names = [p.name for p in parameters]
    listing = shown[shown.index("(") + 1 : -1]
    position, skipping, keyword_only = 0, False, False
    for entry in _shown_parameters(listing):
        if entry == "...":
            skipping = True
        elif entry == "/":
            assert position and parameters[position - 1].kind is inspect.Parameter.POSITIONAL_ONLY, (
                f"docs/api.md shows {shown}: '/' after parameters that are not positional-only"
            )
        elif entry == "*":
            keyword_only = True
        else:
            key, equals, default = (part.strip() for part in entry.partition("="))
            variadic = key.startswith("*")
            key = key.lstrip("*")
            assert key in names[position:], f"docs/api.md shows {shown}: no parameter {key} there"
            index = names.index(key, position)
            assert skipping or index == position, (
                f"docs/api.md shows {shown}: {names[position:index]} left out before {key}, with no '...'"
            )
            parameter = parameters[index]
            is_keyword_only = parameter.kind is parameter.KEYWORD_ONLY
            assert is_keyword_only == keyword_only, (
                f"docs/api.md shows {shown}: {key} is {'' if is_keyword_only else 'not '}keyword-only"
            )
            if equals:
                assert parameter.default is not parameter.empty and _same_default(
                    default, parameter.default
                ), (
                    f"docs/api.md shows {shown}: {key}={default}, the signature's default is "
                    f"{'none' if parameter.default is parameter.empty else repr(parameter.default)}"
                )
            else:
                assert parameter.default is parameter.empty or variadic, (
                    f"docs/api.md shows {shown}: {key} without its default, {parameter.default!r}"
                )
            keyword_only = keyword_only or variadic
            position, skipping = index + 1, False
    assert skipping or position == len(parameters), (
        f"docs/api.md shows {shown}: {names[position:]} left out, with no '...'"
    )


def test_api_table_shows_every_public_function_with_its_signature() -> None:
    """docs/api.md's table names every public function and class, each function with its
    parameters, and every parameter list it shows is the real one."""
    shown = api_table()
    state_tuples = [(f"fdp.optim.{name}", getattr(optim, name)) for name in sorted(STATE_TUPLES)]
    problems = []
    for name, obj in [*public_objects(), *state_tuples]:
        if name not in shown:
            problems.append(f"docs/api.md's table does not name {name}")
            continue
        if inspect.isfunction(obj) and all(listing is None for listing in shown[name]):
            problems.append(f"docs/api.md's table names {name} without its parameters")
        for listing in shown[name]:
            if listing is not None:
                try:
                    check_shown_signature(f"{name}({listing})", inspect.signature(obj))
                except AssertionError as error:
                    problems.append(str(error).partition("\nassert")[0])
    assert not problems, "\n".join(problems)
