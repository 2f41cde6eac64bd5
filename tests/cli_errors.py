"""What a command wrote to stderr for bad input."""

from __future__ import annotations


def one_error(err: str) -> str:
    """The error line: the last one, and the only one (a check that needs the model comes after the
    startup lines, "loading" and "ready in")."""
    lines = err.strip().splitlines()
    assert [line for line in lines if "error" in line] == lines[-1:], lines
    assert lines and lines[-1].startswith("lmtrace: error: ") and "Traceback" not in err, lines
    return lines[-1]
