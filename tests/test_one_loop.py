"""One decoding loop, one place that makes a Choosing (issue #49): across src/, the step's body
(decode/loop.py `advance`, its halves `settle` and `recorded`) is called only by the loop itself
(`drive` and its `beside` mode), and `Choosing(...)` is constructed only in decode/choosing.py.
A loop that calls the step itself, or a site that builds its own Choosing, fails here."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "lmtrace"


def calls(name: str) -> list[tuple[str, str]]:
    """(file, innermost enclosing function) of every call of `name` (a bare name, or an attribute
    of a module imported under the name `one_step`, `step` or `loop`) in src/."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            inner = [n for n in ast.walk(fn) if n is not fn and isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            nested = {id(x) for n in inner for x in ast.walk(n)}
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and id(node) not in nested and named(node.func, name):
                    found.append((str(path.relative_to(SRC)), fn.name))
    return sorted(set(found))


def named(f: ast.expr, name: str) -> bool:
    if isinstance(f, ast.Name):
        return f.id == name
    return (
        isinstance(f, ast.Attribute)
        and f.attr == name
        and isinstance(f.value, ast.Name)
        and (f.value.id in ("one_step", "step", "loop"))
    )


def test_the_step_is_called_by_the_one_loop_only():
    assert calls("advance") == [("decode/loop.py", "drive")]
    assert calls("settle") == [("decode/loop.py", "measure")]  # `drive`'s beside mode
    # other modules name functions of their own `recorded` (a server's observers, a render's summary)
    assert [c for c in calls("recorded") if c[0].startswith("decode/")] == [("decode/loop.py", "drive")]
    assert calls("take") == [("decode/loop.py", "advance")]


def test_choosing_is_constructed_in_one_place():
    assert calls("Choosing") == [("decode/choosing.py", "choosing")]
