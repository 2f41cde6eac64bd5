"""Which Python runs llama.cpp in the benches: $LLAMA_PYTHON, else the venv `make bench-deps`
builds (.venv-llama: llama-cpp-python and its OpenAI-compatible server, kept out of .venv so that
the server's pins never touch lmtrace's), else this Python (where llama-cpp-python may have been
installed by hand). A contender it cannot import is skipped, saying how to install it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOW = "not installed (make bench-deps)"


def llama_python() -> str:
    """The interpreter to run llama.cpp's worker or server with."""
    if os.environ.get("LLAMA_PYTHON"):
        return os.environ["LLAMA_PYTHON"]
    built = ROOT / ".venv-llama" / "bin" / "python"
    return str(built) if built.exists() else sys.executable


def has(module: str) -> bool:
    """Whether llama_python() imports `module` (llama_cpp, llama_cpp.server)."""
    done = subprocess.run([llama_python(), "-c", f"import {module}"], capture_output=True, timeout=120)
    return done.returncode == 0
