"""The Jinja2 environment (autoescaping on), the report's static CSS/JS, and JSON made safe
to embed in a <script> element."""

from __future__ import annotations

import base64
import hashlib
import json
import math
from functools import lru_cache
from importlib import resources
from typing import Any

from jinja2 import Environment, PackageLoader
from markupsafe import Markup

# In a <script> element the HTML parser only looks for "</script"; JSON.parse reads \uXXXX.
# Escaping these also keeps "<!--" and U+2028/U+2029 (line ends to old JS parsers) harmless.
_SCRIPT_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_SCRIPT_TABLE = str.maketrans(_SCRIPT_ESCAPES)


@lru_cache(maxsize=1)
def env() -> Environment:
    return Environment(
        loader=PackageLoader("lmtrace.render", "templates"),
        autoescape=True,  # every value from a record is text, never markup
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def parts() -> Any:
    """The macros of _parts.html.j2, callable from Python; each returns Markup."""
    return env().get_template("_parts.html.j2").module


@lru_cache(maxsize=4)
def static(name: str) -> str:
    return resources.files("lmtrace.render").joinpath("templates", name).read_text(encoding="utf-8")


def script_hash(script: str) -> str:
    """The CSP source that allows exactly this inline script."""
    digest = hashlib.sha256(script.encode("utf-8")).digest()
    return "sha256-" + base64.b64encode(digest).decode("ascii")


def script_json(data: Any) -> Markup:
    """JSON for <script type="application/json">: no "<", ">", "&", U+2028 or U+2029 left
    raw, so model text such as "</script><img onerror=...>" stays a string in the data."""
    text = json.dumps(_finite(data), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return Markup(text.translate(_SCRIPT_TABLE))


def _finite(x: Any) -> Any:
    """JSON has no infinities or NaN: they become null, as in the trace JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
