"""mkdocs hooks. The Python API page (reference/api.md) gets its reference at build time from
lmtrace's own list of public names, `lmtrace._NAMES` (public name -> the module that defines it),
so moving a module changes that one mapping and the reference follows. Each name is rendered by
mkdocstrings from its docstring under the name people type, `lmtrace.NAME`."""

from __future__ import annotations

import logging
import posixpath
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("mkdocs.hooks.lmtrace")  # a warning here fails the strict build

# The page's sections, by public name; a name of lmtrace._NAMES that no section lists goes under
# "More" (so a new public name is never left out).
SECTIONS = [
    ("Loading a model", ["load", "LoadOptions", "LM"]),
    ("Generating", ["generate", "stream", "generate_steps", "encode_prompt", "SamplingParams"]),
    ("Records", ["Trace", "Step", "Alternative"]),
    ("Scoring, rescoring, branching", ["score", "score_batch", "ScoreResult", "TokenScore", "Candidate",
                                       "rescore", "branch", "Branches"]),
    ("Other people's decoding", ["from_generate", "watch", "CacheMisuseWarning"]),
    ("KV-cache lab and comparison", ["kvlab", "LabResult", "compare"]),
    ("Errors", ["LmtraceError", "InvalidParameter", "ModelLoadError", "GenerationError"]),
]

# Names below the package's top level that the guides use, by the module that defines them.
# These module paths are written here and nowhere else in the generated page.
MODULES = [
    ("Reports", "lmtrace.render.html.trace", ["write_html", "render_html"]),
    ("Plots", "lmtrace.render.plots.trace", ["write_plot", "plot_png"]),
    ("The server", "lmtrace.server", ["create_app", "ServerOptions"]),
]

MARKER = "<!-- generated: docs/tools/hooks.py writes the reference here -->"


def on_config(config):
    """This checkout's src/ first on the path: mkdocs-click imports lmtrace.cli, and the API page
    reads lmtrace._NAMES, from the code being documented (importing them imports no torch)."""
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return config


def public_names() -> dict[str, str]:
    """lmtrace._NAMES: public name -> the module that defines it."""
    import lmtrace

    return dict(lmtrace._NAMES)


def api_page() -> str:
    names = public_names()
    listed = [n for _, group in SECTIONS for n in group]
    unknown = sorted(set(listed) - set(names))
    if unknown:
        raise ValueError(f"docs/tools/hooks.py lists names lmtrace does not export: {unknown}")
    more = sorted(set(names) - set(listed), key=str.lower)
    parts = []
    for title, group in SECTIONS + ([("More", more)] if more else []):
        parts.append(f"## {title}\n")
        parts += [_block(names[n], n, f"lmtrace.{n}") for n in group]
    parts.append("## Below the top level\n\nUsed by the guides; imported from their modules.\n")
    for title, module, group in MODULES:
        parts.append(f"### {title}: `{module}`\n")
        parts += [_block(module, n, f"{module}.{n}", level=4) for n in group]
    return "\n".join(parts)


def _block(module: str, name: str, heading: str, level: int = 3) -> str:
    return f'::: {module}.{name}\n    options:\n      heading: "{heading}"\n      heading_level: {level}\n'


def on_page_markdown(markdown, page, config, files):
    """Puts the generated reference where reference/api.md has the marker."""
    if page.file.src_uri != "reference/api.md":
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"reference/api.md lost its marker {MARKER!r}")
    return markdown.replace(MARKER, api_page())


LINK = re.compile(r'href="(?![a-z]+:|#|/)([^"#]+\.(?:md|ipynb))(#[^"]*)?"')


def on_post_page(output, page, config):
    """Links in a notebook's markdown name files (`../kv-cache.md`, `tutorial.zh.ipynb`), which
    work on GitHub; mkdocs-jupyter leaves them as they are, so they become the pages' URLs here."""
    if not page.file.src_uri.endswith(".ipynb"):
        return output
    files = _files
    here = posixpath.dirname(page.file.src_uri)

    def url(match: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(here, match.group(1)))
        found = files.get(target)
        if found is None:
            log.warning(f"{page.file.src_uri}: a link to {match.group(1)!r}, which is not a page")
            return match.group(0)
        return f'href="{found.url_relative_to(page.file)}{match.group(2) or ""}"'

    return LINK.sub(url, output)


_files: dict = {}


def on_files(files, config):
    """Remembers the site's files for on_post_page."""
    _files.clear()
    _files.update({f.src_uri: f for f in files})
    return files
