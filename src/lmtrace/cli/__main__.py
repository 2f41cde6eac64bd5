"""`python -m lmtrace.cli ...`, the same as the `lmtrace` command."""

from lmtrace.cli import entry

if __name__ == "__main__":
    entry()
