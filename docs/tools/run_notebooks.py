"""Executes the tutorial notebooks in place, so that the committed files carry their outputs (the
site shows them as they are; tests/test_tutorial.py executes them again and checks them).

    python docs/tools/run_notebooks.py [NOTEBOOK ...]     # default: docs/tutorials/*.ipynb

Each runs in a fresh kernel in a temporary folder (the report it writes is not kept), with this
checkout's src/ first on the kernel's path."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]


def execute(path: Path, cwd: Path, timeout: int = 300) -> nbformat.NotebookNode:
    """The notebook at `path`, executed in `cwd`; outputs in the returned notebook."""
    nb = nbformat.read(path, as_version=4)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONWARNINGS")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), saved["PYTHONPATH"]) if p)
    # tqdm's "IProgress not found" (no ipywidgets): about Jupyter, not about the tutorial
    os.environ["PYTHONWARNINGS"] = "ignore:IProgress not found"
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    for cell in nb.cells:  # timings change at every run; the diff should show only what changed
        cell.metadata.pop("execution", None)
    return nb


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or sorted((ROOT / "docs" / "tutorials").glob("*.ipynb"))
    for path in paths:
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            nb = execute(path, Path(tmp))
        nbformat.write(nb, path)
        print(f"{path}: executed in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
