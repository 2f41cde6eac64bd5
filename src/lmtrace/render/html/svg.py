"""Charts as inline SVG, drawn here on the server side: the page needs no chart library and
no request anywhere, and the charts show without script (in a notebook too)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

W, H = 560, 170  # the viewBox; the SVG itself scales to its container's width
LEFT, RIGHT, TOP, BOTTOM = 60, 10, 22, 24  # room on the left for a tick such as "1000 KiB"


@dataclass
class Series:
    """One line: a name for the legend, a value per step (None: no value), a CSS class for
    its colour, and the view (branch) its points select in the page."""

    name: str
    values: Sequence[float | None]
    css: str = "c0"
    view: int = 0


def nice_ticks(top: float, most: int = 5, binary: bool = False) -> list[float]:
    """0 and round steps (1, 2, 5 × 10^k) up to at least `top`; with `binary`, round in the
    largest power of 1024 below `top` (so byte axes read 2 MiB, not 1.91 MiB)."""
    if not top or top <= 0 or not math.isfinite(top):
        return [0.0, 1.0]
    if binary:
        unit = 1024 ** max(0, min(3, int(math.log(top, 1024))))
        return [t * unit for t in nice_ticks(top / unit, most)]
    raw = top / most
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(math.ceil(top / step - 1e-9)) + 1)]


def signed_ticks(low: float, high: float, most: int = 6) -> list[float]:
    """Round steps from below `low` (negative) to above `high`, 0 among them (a logprob change)."""
    high = max(high, 0.0)
    step = nice_ticks(high - low, most)[1]
    first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    return [k * step for k in range(first, max(last, 0) + 1)]


def human_bytes(n: float) -> str:
    """Bytes in binary units for an axis or a tip: 512 B, 1.5 KiB, 1000 KiB (never 1e+03 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


def _fmt(v: float) -> str:
    return f"{v:g}"


class _Frame:
    """Maps step index and value to SVG coordinates (values from `y_bottom`, 0 unless some are
    negative, up to `y_top`)."""

    def __init__(self, n: int, y_top: float, y_bottom: float = 0.0):
        self.n, self.y_top, self.y_bottom = max(n, 1), y_top, y_bottom
        if self.y_top == self.y_bottom:
            self.y_top = self.y_bottom + 1.0
        self.dx = (W - LEFT - RIGHT) / max(self.n - 1, 1)

    def x(self, i: float) -> float:
        return LEFT + i * self.dx

    def y(self, v: float) -> float:
        return TOP + (H - TOP - BOTTOM) * (self.y_top - v) / (self.y_top - self.y_bottom)


def _axes(f: _Frame, ticks: list[float], fmt: Callable[[float], str], x_label: str, shift: float = 0) -> list[str]:
    out = []
    for t in ticks:
        y = f.y(t)
        out.append(f'<line class="grid" x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(f'<text class="tick" x="{LEFT - 4}" y="{y + 3:.1f}" text-anchor="end">{escape(fmt(t))}</text>')
    count = f.n - (1 if shift else 0)
    every = max(1, math.ceil(count / 8))
    for i in range(0, count, every):
        out.append(f'<text class="tick" x="{f.x(i) + shift:.1f}" y="{H - 8}" text-anchor="middle">{i}</text>')
    out.append(f'<text class="tick" x="{LEFT - 12}" y="{H - 8}" text-anchor="end">{escape(x_label)}</text>')
    return out


def _legend(series: Sequence[Series]) -> list[str]:
    out, x = [], LEFT
    for s in series:
        out.append(f'<rect class="{s.css}" x="{x}" y="6" width="10" height="10"/>')
        out.append(f'<text class="key" x="{x + 14}" y="15">{escape(s.name)}</text>')
        x += 22 + 7 * len(s.name)
    return out


def line_chart(
    series: Sequence[Series],
    label: str,
    y_top: float | None = None,
    fmt: Callable[[float], str] = _fmt,
    x_label: str = "step",
    binary: bool = False,
    labels: Sequence[str] | None = None,
) -> Markup:
    """Lines (with a clickable point per step when there are few enough) over the step index;
    `labels` (each step's token) name the steps in the points' tips."""
    n = max((len(s.values) for s in series), default=0)
    finite = [v for s in series for v in s.values if v is not None and math.isfinite(v)]
    top = y_top if y_top is not None else max(finite, default=1.0)
    low = min(finite, default=0.0)
    ticks = nice_ticks(top, binary=binary) if low >= 0 else signed_ticks(low, top)
    f = _Frame(n, ticks[-1], ticks[0])
    parts = _axes(f, ticks, fmt, x_label) + _legend(series)
    for s in series:
        points = [(i, v) for i, v in enumerate(s.values) if v is not None and math.isfinite(v)]
        path = " ".join(f"{'M' if k == 0 else 'L'}{f.x(i):.1f},{f.y(v):.1f}" for k, (i, v) in enumerate(points))
        parts.append(f'<path class="line {s.css}" d="{path}"/>')
        if len(points) <= 400:
            for i, v in points:
                token = f" {labels[i]!r}" if labels is not None and i < len(labels) else ""
                tip = escape(f"{s.name}, step {i}{token}: {fmt(v)}")
                parts.append(
                    f'<circle class="pt {s.css}" cx="{f.x(i):.1f}" cy="{f.y(v):.1f}" r="2.5" '
                    f'data-v="{s.view}" data-i="{i}"><title>{tip}</title></circle>'
                )
    return _svg(parts, label, f)


def bar_chart(values: Sequence[float], label: str, fmt: Callable[[float], str] = _fmt, x_label: str = "") -> Markup:
    """One bar per entry (for example bytes per layer)."""
    ticks = nice_ticks(max(values, default=1.0), binary=fmt is human_bytes)
    f = _Frame(len(values) + 1, ticks[-1])
    parts = _axes(f, ticks, fmt, x_label, shift=f.dx / 2)
    width = max(1.0, f.dx * 0.8)
    for i, v in enumerate(values):
        y = f.y(v)
        parts.append(
            f'<rect class="bar c0" x="{f.x(i) + (f.dx - width) / 2:.1f}" y="{y:.1f}" width="{width:.1f}" '
            f'height="{H - BOTTOM - y:.1f}"><title>{escape(f"{x_label} {i}: {fmt(v)}")}</title></rect>'
        )
    return _svg(parts, label, f, cursor=False)


def _svg(parts: list[str], label: str, f: _Frame, cursor: bool = True) -> Markup:
    # data-x0/data-dx let the page's script place the cursor of the selected step
    line = f'<line class="cursor" x1="0" x2="0" y1="{TOP}" y2="{H - BOTTOM}" visibility="hidden"/>'
    return Markup(
        f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="{escape(label)}" '
        f'data-x0="{LEFT}" data-dx="{f.dx:.4f}">' + (line if cursor else "") + "".join(parts) + "</svg>"
    )
