"""The docs site builds with `mkdocs build --strict` (no broken link or anchor, no warning) and
holds what it promises: at least 12 pages, an API reference generated from the docstrings of every
public name, a CLI reference generated from every command, Chinese pages linked both ways, no
resource fetched from the network. The landing README stays short with the two commands first."""

from __future__ import annotations

import html
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def text_of(page: str) -> str:
    """A built page's visible text, whitespace collapsed."""
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", page, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", body)).split())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra (mkdocs, mkdocs-material, ...) is not installed")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stderr[-6000:]}"
    return out


def page(site: Path, path: str) -> str:
    return (site / path / "index.html").read_text(encoding="utf-8")


def test_the_site_has_at_least_12_pages(site):
    pages = [p for p in site.rglob("index.html") if "search" not in p.parts]
    assert len(pages) >= 12, [str(p.relative_to(site)) for p in pages]


def test_the_api_reference_shows_every_public_name_with_its_docstring(site):
    import lmtrace

    shown = text_of(page(site, "reference/api"))
    words_shown = " ".join(re.findall(r"\w+", shown))
    for name in lmtrace._NAMES:
        assert f"lmtrace.{name}" in shown, f"lmtrace.{name} is missing from the API reference"
        doc = inspect.getdoc(getattr(lmtrace, name))
        if doc:  # the docstring's first words, as rendered (markup and punctuation aside)
            words = " ".join(re.findall(r"\w+", doc)[:8])
            assert words in words_shown, f"lmtrace.{name}: its docstring ({words!r}) is not on the page"


def test_the_cli_reference_shows_every_command(site):
    from lmtrace.cli import cli

    shown = text_of(page(site, "reference/cli"))
    for command in cli.commands:
        assert f"lmtrace {command}" in shown, f"`lmtrace {command}` is missing from the CLI reference"
    assert "--max-new-tokens" in shown and "--top-logprobs" in shown


def test_the_tutorials_show_their_outputs(site):
    for path, words in (("tutorials/tutorial", "the problem starts at round 1"),
                        ("tutorials/tutorial.zh", "问题从第 1 轮开始")):
        assert words in text_of(page(site, path))


def test_english_and_chinese_pages_link_to_each_other(site):
    english = page(site, "getting-started")
    chinese = page(site, "zh")
    assert 'href="../zh/"' in english
    assert 'href="../getting-started/"' in chinese and 'href="../tutorials/tutorial.zh/"' in chinese
    readme, readme_zh = (ROOT / "README.md").read_text(), (ROOT / "README.zh-CN.md").read_text()
    assert "(README.zh-CN.md)" in readme and "(README.md)" in readme_zh


def test_nothing_is_fetched_from_the_network(site):
    for built in site.rglob("*.html"):
        text = built.read_text(encoding="utf-8")
        remote = re.findall(r"""<(?:script|img|iframe)\b[^>]*\bsrc=["']https?://[^"']+|"""
                            r"""<link\b[^>]*\bhref=["']https?://[^"']+""", text)
        assert not remote, f"{built.relative_to(site)} loads {remote[:3]}"


def test_the_pictures_are_small():
    pictures = sorted((ROOT / "docs" / "images").glob("*.png"))
    assert pictures
    for p in pictures:
        assert p.stat().st_size < 300_000, f"{p.name}: {p.stat().st_size:,} bytes"


def test_the_readme_is_a_short_landing_page_with_the_two_commands_first():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    first = [line for line in lines[:8] if line.startswith("make ")]
    assert [line.split()[:2] for line in first] == [["make", "run"], ["make", "test"]]
