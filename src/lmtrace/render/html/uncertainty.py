"""Per-token confidence as colour and as a chart: the shading used by the sample page and the
trace report (red: the least confident tokens, clear: the most), and an SVG of the token
confidences with DeepConf's group confidence (the sliding window's mean) and a threshold."""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup

WIDTH, HEIGHT, PAD = 520, 120, 34


def shade(value: float | None, low: float, high: float) -> str:
    """Red with an opacity that falls from 0.6 at `low` to 0 at `high`; clear where unknown."""
    if value is None or high <= low:
        return "transparent"
    frac = min(1.0, max(0.0, (value - low) / (high - low)))
    return f"rgba(220,38,38,{0.6 * (1 - frac):.3f})"


def groups(confidences: Sequence[float], window: int) -> list[float]:
    """The group confidence at each token from the window's end on (window capped at the length)."""
    w = min(window, len(confidences))
    return [sum(confidences[i - w + 1 : i + 1]) / w for i in range(w - 1, len(confidences))] if w else []


def confidence_svg(
    confidences: Sequence[float], window: int, threshold: float | None = None, width: int = WIDTH, height: int = HEIGHT
) -> Markup:
    """Token confidences (grey dots), the group confidence (blue line, from token window-1 on)
    and the early stop's threshold (red dashes), step on x."""
    values = list(confidences)
    if not values:
        return Markup("")
    g = groups(values, window)
    w = min(window, len(values))
    top = max(values + ([threshold] if threshold is not None else []))
    bottom = min(values + ([threshold] if threshold is not None else []))
    span = (top - bottom) or 1.0
    n = len(values)
    x = lambda i: PAD + (width - PAD - 8) * (i / max(1, n - 1))  # noqa: E731
    y = lambda v: height - 16 - (height - 26) * ((v - bottom) / span)  # noqa: E731
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
        f'<text x="2" y="{y(top) + 4:.1f}" font-size="10">{top:.2f}</text>',
        f'<text x="2" y="{y(bottom) + 4:.1f}" font-size="10">{bottom:.2f}</text>',
    ]
    for i, v in enumerate(values):
        parts.append(
            f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="2" fill="#888"><title>token {i}: confidence '
            f"{v:.3f}</title></circle>"
        )
    line = " ".join(f"{x(i + w - 1):.1f},{y(v):.1f}" for i, v in enumerate(g))
    parts.append(f'<polyline fill="none" stroke="#2563eb" stroke-width="1.5" points="{line}"/>')
    if threshold is not None:
        parts.append(
            f'<line x1="{PAD}" x2="{width - 8}" y1="{y(threshold):.1f}" y2="{y(threshold):.1f}" '
            'stroke="#dc2626" stroke-dasharray="4 3"/>'
        )
    parts.append(f'<text x="{PAD}" y="{height - 2}" font-size="10">group window {w}</text></svg>')
    return Markup("".join(parts))
