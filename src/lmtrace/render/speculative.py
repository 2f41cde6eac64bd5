"""Views of speculative decoding (a trace with `speculative` and steps with `draft`): the draft
blocks over the text (accepted proposals marked, a rejected one struck through beside the
target's token, p against q on hover), acceptance by position as bars, a summary line and the
terminal's draft column. Records in, text out: no torch."""

from __future__ import annotations

import math
from typing import Any

from markupsafe import Markup, escape

from lmtrace.render.html.svg import bar_chart
from lmtrace.render.tokens import escape as visible
from lmtrace.render.tokens import show_bytes


def proposed(draft: dict[str, Any]) -> str:
    """The proposal as text, its bytes shown where they are no whole character."""
    raw = draft.get("bytes")
    return show_bytes(raw) if raw is not None else visible(str(draft.get("text", draft["proposed_token_id"])))


def _p(logprob: float | None) -> float:
    return 0.0 if logprob is None or math.isinf(logprob) else math.exp(logprob)


def verdict(draft: dict[str, Any] | None) -> str:
    """One line for a step's draft field: what was proposed, q against p, the verdict."""
    if draft is None:
        return "bonus token (after the block's accepted proposals, no draft proposal)"
    word = "accepted" if draft["accepted"] else "rejected"
    return (
        f"{word} proposal {proposed(draft)!r} (position {draft['position']}): "
        f"q {_p(draft['logprob']):.3f}, p {_p(draft['target_logprob']):.3f}, "
        f"accept prob. {draft['accept_prob']:.3f}"
    )


def recorded(spec: dict[str, Any] | None) -> bool:
    """Whether a trace's steps hold the draft's proposals (model.generate's assisted runs do not)."""
    return isinstance(spec, dict) and spec.get("proposals_recorded", True)


def summary(spec: dict[str, Any]) -> str:
    """The trace's speculative decoding in one line."""
    if not recorded(spec):
        return f"speculative: draft {spec.get('draft')}; {spec.get('note', 'proposals not recorded')}"
    rates = " ".join("–" if r is None else f"{r:.2f}" for r in spec.get("acceptance_by_position") or [])
    mean = spec.get("mean_accepted_per_block")
    mean_text = "–" if mean is None else f"{mean:.2f}"
    return (
        f"speculative: draft {spec.get('draft')}, {spec.get('draft_tokens')} tokens a block; "
        f"acceptance by position {rates}; {mean_text} accepted a block; "
        f"{spec.get('target_forwards')} target and {spec.get('draft_forwards')} draft forwards"
    )


def draft_cell(draft: dict[str, Any] | None) -> tuple[str, str]:
    """(text, style) of the terminal's draft column."""
    if draft is None:
        return "+ bonus", "cyan"
    if draft["accepted"]:
        return f"✓ q {_p(draft['logprob']):.2f}", "green"
    return f"✗ {proposed(draft)} q {_p(draft['logprob']):.2f}", "red"


def blocks_html(steps: list[dict[str, Any]]) -> Markup:
    """The generated text as draft blocks: one box per block, each token marked accepted, the
    rejected proposal struck through before the target's own token, the bonus token apart."""
    out, open_block = [], False
    for s in steps:
        d = s.get("draft")
        if not open_block:
            out.append('<span class="block">')
            open_block = True
        text = escape(visible(s.get("text") or ""))
        if d is None:
            out.append(f'<span class="bonus" title="{escape(verdict(d))}">{text}</span>')
        elif d["accepted"]:
            out.append(f'<span class="acc" title="{escape(verdict(d))}">{text}</span>')
        else:
            out.append(f'<del title="{escape(verdict(d))}">{escape(proposed(d))}</del><span class="rej">{text}</span>')
        if d is None or not d["accepted"]:  # the block ends with the target's own token
            out.append("</span>")
            open_block = False
    if open_block:
        out.append("</span>")
    return Markup('<div class="blocks">' + "".join(out) + "</div>")


def acceptance_chart(spec: dict[str, Any]) -> Markup:
    """Acceptance by position (0-based in the block) as bars."""
    rates = [0.0 if r is None else float(r) for r in spec.get("acceptance_by_position") or []]
    return bar_chart(rates, "acceptance by position", fmt=lambda v: f"{v:.2f}", x_label="position")
