"""Every Python block in the docs (docs/**/*.md, README.md, README.zh-CN.md) runs: the blocks of a
page in order, in one namespace, in a temporary folder, as a reader would paste them. A block that
cannot run here says why in an HTML comment on the line before its fence:
`<!-- not-run: needs a running lmtrace serve -->`. `lmtrace.load()` without arguments (or with `weights="packed"`)
returns the bundled model the session already loaded (tests/conftest.py's shared_bundled: a page
that loads it again would only cost time).
No block may raise a deprecation warning (transformers 5.24 warns on `past_key_values=`: the
examples say `cache=`)."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(ROOT.glob("docs/**/*.md")) + [ROOT / "README.md", ROOT / "README.zh-CN.md"]
FENCE = re.compile(r"^```[ \t]*([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(\S.*?)\s*-->$")
PYTHON = {"python", "py", "python3"}
# raised by torch or transformers while they import, whatever the examples do
UPSTREAM = ("`torch.jit.script_method` is deprecated",)


@dataclass
class Block:
    page: Path
    line: int
    code: str
    not_run: str | None  # the reason, for a block that is shown but not run


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for m in FENCE.finditer(text):
        if m.group(1).lower() not in PYTHON:
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        reason = NOT_RUN.match(before)
        line = text.count("\n", 0, m.start()) + 1
        found.append(Block(page, line, m.group(2), reason.group(1) if reason else None))
    return found


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


RUNNABLE = [p for p in PAGES if any(b.not_run is None for b in blocks(p))]


def test_every_python_block_is_found_and_every_skip_says_why():
    """An indented fence (in a list item) or a marker that precedes no Python block would let a
    block escape the runner; neither is allowed."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        indented = re.findall(r"^[ \t]+```[ \t]*(?:python|py)\b", text, re.M)
        assert not indented, f"{name(page)}: an indented Python fence the runner would not see"
        markers = len(re.findall(r"^<!--\s*not-run:", text, re.M))
        assert markers == sum(b.not_run is not None for b in blocks(page)), (
            f"{name(page)}: a not-run marker that is not on the line just before a Python block"
        )
    assert len(RUNNABLE) >= 10, [name(p) for p in RUNNABLE]


@pytest.mark.integration
@pytest.mark.parametrize("page", RUNNABLE, ids=name)
def test_the_python_blocks_of_a_page_run(page, shared_bundled, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for block in blocks(page):
            if block.not_run is None:
                exec(compile(block.code, f"{name(page)}:{block.line}", "exec"), namespace)
    kinds = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
    found = [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, kinds)]
    assert [w for w in found if not any(u in w for u in UPSTREAM)] == [], found


def test_the_examples_say_cache_not_past_key_values():
    code = "\n".join(b.code for page in PAGES for b in blocks(page))
    assert "past_key_values=" not in code and "out.past_key_values" not in code
