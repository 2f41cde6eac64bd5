"""The logit lens, the attention over the cache and the attribution (an observer of the row's,
decode/attribution.py) for the rows of a continuous batch that asked for them (`RowSpec.lens`,
`RowSpec.attention`, `RowSpec.observers`), beside rows that did not.

While any row of a forward wants them, the forward runs with the lens's hooks and the capturing
attention function (lmtrace.inside.lens, lmtrace.inside.attention): neither changes the logits (the
hooks copy the last position's residual rows; the attention output is the model's own kernel's),
so the other rows' numbers are what they are without them. Right after the forward each asking
row keeps its own residual rows and its attention summarized over its own columns (its left
padding at that forward skipped); at the next step, once its token is chosen, the lens reads the
row's residuals through the model's own head, as lmtrace.inside.probe.Probe does for a static batch.
A row's records are those of the same request alone, within batched float noise."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from lmtrace.decode.attribution import Attribution
from lmtrace.inside import attention, lens
from lmtrace.inside import attribution as dla
from lmtrace.inside.probe import DEFAULT_TOP, name_positions


class RowInside:
    """What one row captured at the forward that produced its next distribution."""

    def __init__(self) -> None:
        self.residuals: list[torch.Tensor] | None = None  # per layer (hidden,), embedding output first
        self.attention: list[dict] | None = None  # per layer, positions not yet named by token


def wants(spec: Any) -> bool:
    """Whether the row hooks its forwards: the lens, the attention, the attribution."""
    return bool(getattr(spec, "lens", False) or getattr(spec, "attention", False) or attributing(spec))


def attributing(spec: Any) -> list[Attribution]:
    """The row's attribution observer (decode/attribution.py), if it asked for one."""
    return [o for o in getattr(spec, "observers", ()) if isinstance(o, Attribution)]


def top_n(spec: Any) -> int:
    return spec.params.top_logprobs or DEFAULT_TOP


@contextmanager
def around(model: Any, rows: Sequence[Any], mask: torch.Tensor) -> Iterator[None]:
    """Runs one forward of `rows` (each with `.spec` and `.inside`), left-padded by `mask`
    (batch, width); afterwards each asking row holds its captures in `row.inside`."""
    asking = [r for r, row in enumerate(rows) if wants(row.spec)]
    if not asking:
        yield
        return
    attributed = [(r, o) for r in asking for o in attributing(rows[r].spec)]
    anatomy = attributed[0][1].prepared(model) if attributed else None  # before any hook goes on
    with ExitStack() as stack:
        specs = [rows[r].spec for r in asking]
        residuals = stack.enter_context(lens.capturing(model)) if any(s.lens for s in specs) else None
        weights = stack.enter_context(attention.capturing(model)) if any(s.attention for s in specs) else None
        parts = stack.enter_context(dla.capturing(anatomy)) if anatomy is not None else None
        yield
    for r, o in attributed:  # the last position of each row: its next distribution's
        o.keep(dla.row_of(parts, r))
    total = mask.shape[1]
    for r in asking:
        row, spec, own = rows[r], rows[r].spec, RowInside()
        if spec.lens:
            own.residuals = [h[r] for h in residuals]
        if spec.attention:
            pad = int((mask[r] == 0).sum())
            mine = {layer: (w[r : r + 1], vw[r : r + 1]) for layer, (w, vw) in weights.items()}
            own.attention = attention.summarize(mine, total, [pad], top_n(spec), spec.attention == "heads")[0]
        row.inside = own


def take(
    model: Any, rows: Sequence[Any], logits: torch.Tensor, tokens: torch.Tensor
) -> tuple[list | None, list | None]:
    """(lens records, attention records) of this step, one per row (None for a row that did not
    ask; the lists themselves None when no row did). `logits` (batch, vocab) are the rows' raw
    logits, `tokens` (batch,) their chosen tokens; a row's generated tokens so far are its
    records' steps."""
    if not any(wants(row.spec) for row in rows):
        return None, None
    lens_rows: list | None = None
    att_rows: list | None = None
    un = lens.unembedding(model) if any(getattr(row.spec, "lens", False) for row in rows) else None
    for r, row in enumerate(rows):
        own = getattr(row, "inside", None)
        if own is None:
            continue
        if own.residuals is not None:
            lens_rows = lens_rows or [None] * len(rows)
            hidden = [h[None] for h in own.residuals]  # per layer (1, hidden)
            lens_rows[r] = lens.measure(un, hidden, logits[r : r + 1], tokens[r : r + 1], top_n(row.spec))[0]
        if own.attention is not None:
            att_rows = att_rows or [None] * len(rows)
            seq = list(row.spec.ids) + [s.token_id for s in row.steps]
            att_rows[r] = {"layers": name_positions(own.attention, seq)}
    return lens_rows, att_rows
