"""The tutorial notebooks (docs/tutorials/, English and Chinese) are committed with their outputs,
so the site shows them as they ran, and they still run: each is executed again, offline, into a
temporary folder, and the re-feeding loop's problem must appear at the round where it starts
(round 1: the prefill is right, the first call that feeds the whole sequence again is not)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the docs extra (nbformat, nbclient, ipykernel) is not installed")
pytest.importorskip("nbclient", reason="the docs extra (nbclient) is not installed")
pytest.importorskip("ipykernel", reason="the docs extra (ipykernel) is not installed")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "docs" / "tutorials").glob("*.ipynb"))
PROBLEM = re.compile(
    r"^round (\d+): fed (\d+) tokens(?:, the loop's whole sequence)?, "
    r"but the cache already holds the first (\d+) of them",
    re.M,
)


def stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("name") == "stdout")


def refeed_cell(nb):
    cells = [c for c in nb.cells if "refeed" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "one cell is tagged `refeed`: the loop that feeds the whole sequence again"
    return cells[0]


def check_refeed(nb) -> None:
    printed = stdout(refeed_cell(nb))
    problems = PROBLEM.findall(printed)
    assert problems, f"no re-feeding problem printed:\n{printed}"
    first_round, fed, held = map(int, problems[0])
    assert first_round == 1, f"the problem starts at round 1, printed at round {first_round}"
    assert held == fed - 1, "round 1 feeds the prompt and one new token; the cache holds the prompt"


def test_there_are_an_english_and_a_chinese_tutorial():
    assert {p.name for p in NOTEBOOKS} == {"tutorial.ipynb", "tutorial.zh.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_committed_notebook_carries_its_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), (
        f"{path.name} is committed unexecuted: run `python docs/tools/run_notebooks.py`"
    )
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), "executed top to bottom in one run"
    check_refeed(nb)


@pytest.mark.integration
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_notebook_runs_and_catches_the_refeeding_at_round_1(path, tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "tools"))
    try:
        from run_notebooks import execute
    finally:
        sys.path.remove(str(ROOT / "docs" / "tools"))
    nb = execute(path, tmp_path)  # an error in any cell raises here, naming the cell
    nbformat.write(nb, tmp_path / path.name)
    check_refeed(nb)
    assert (tmp_path / "report.html").stat().st_size > 10_000, "the last part writes the report"
    ranks = [stdout(c) for c in nb.cells if c.cell_type == "code" and "topk(2)" in c.source]
    assert ranks and re.search(r"\[2, 2, 2, 2, 2, 2\]", ranks[0]), "the topk(2) loop picks rank 2 every time"
