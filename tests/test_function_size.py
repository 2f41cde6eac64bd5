"""No function in src/ over 60 lines of code (its docstring not counted): a loop, a route or a
command that grows past it is split into functions that each say one thing."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "lmtrace"
LIMIT = 60


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    doc = 0
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        doc = first.end_lineno - first.lineno + 1
    return node.end_lineno - node.lineno + 1 - doc


def test_no_function_is_over_60_lines_of_code():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and code_lines(node) > LIMIT:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({code_lines(node)} lines)")
    assert not long, "functions over 60 lines of code:\n" + "\n".join(long)
