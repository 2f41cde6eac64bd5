"""The terminal view of a trace (rich): coloured text, then one table row per step."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from lmtrace.records import Step, Trace
from lmtrace.render.speculative import draft_cell, recorded, summary
from lmtrace.render.tokens import SCALE, colour, escape, prob, show_bytes

_ORIGIN = {"model.generate": "from model.generate", "watch": "from a watched loop", "vllm": "from vLLM"}
_HOLDS = {"raw": "raw distribution only", "processed": "processed distribution only"}


def _mode(p: dict) -> str:
    if p.get("settings") == "unknown":
        return "decoding settings not recorded"
    if p.get("num_beams"):
        return f"beam search, {p['num_beams']} beams"
    if p.get("temperature") == 0:
        return "greedy"
    return f"temperature {p.get('temperature')}, seed {p.get('seed')}"


def _model_line(trace: Trace) -> str:
    c = trace.model.get("config") or {}
    if not c:
        return ""
    return (
        f"  {c['architecture']}, {c['layers']} layers, {c['attention_heads']} heads, "
        f"{c['kv_heads']} KV heads ({c['attention']}), head_dim {c['head_dim']}, "
        f"{trace.model['dtype']} on {trace.model['device']}"
    )


def header(trace: Trace) -> Text:
    p = trace.params
    t = trace.timing
    mode = _mode(p)
    extras = [
        f"{k} {p[k]}"
        for k, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0))
        if k in p and p[k] != off
    ]
    out = Text()
    out.append(f"{trace.model['source']}", style="bold")
    out.append(_model_line(trace) + "\n", style="dim")
    origin = _ORIGIN.get(trace.origin)
    if origin or trace.distributions in _HOLDS:
        out.append(", ".join(x for x in (origin, _HOLDS.get(trace.distributions)) if x) + "\n", style="bold")
    out.append(f"{mode}{', ' if extras else ''}{', '.join(extras)}; ")
    prefill = t.get("prefill_ms")
    timed = f", prefill {prefill:.0f} ms, " if prefill is not None else ", "
    out.append(f"prompt {t['prompt_tokens']} tokens{timed}")
    rate = t.get("decode_tokens_per_s")
    out.append(f"{t['generated_tokens']} tokens at {rate:.1f} tok/s" if rate else f"{t['generated_tokens']} tokens")
    out.append(f", finish: {trace.finish_reason}")
    if trace.stop_reason is not None:
        out.append(f" ({trace.stop_reason!r})")
    last = trace.steps[-1].kv if trace.steps else None
    if last and last.get("bytes") is not None:
        when = " (measured at the end)" if last.get("measured") == "end" else ""
        out.append(f"\nKV cache{when}: {last['seq_len']} positions, {last['bytes']:,} bytes", style="dim")
    if trace.speculative is not None:
        out.append("\n" + summary(trace.speculative), style="dim")
    mismatches = (trace.kv_anatomy or {}).get("mismatches")
    if mismatches:
        out.append(f"\nerror: measured KV bytes differ from the formula at steps {mismatches}", style="bold red")
    return out


def legend() -> Text:
    out = Text("p ≥ ", style="dim")
    for i, (threshold, name) in enumerate(SCALE):
        out.append(f" {threshold:g} " if i < len(SCALE) - 1 else " lower ", style=f"black on {name}")
    return out


def coloured_text(trace: Trace) -> Text:
    out = Text()
    chat = bool(trace.params.get("chat"))
    if chat:  # the turn boundary: the prompt was the user's message, the steps are the answer
        out.append("user ▸ ", style="bold cyan")
    out.append(trace.prompt["text"], style="dim")
    if chat:
        out.append("\nassistant ▸ ", style="bold cyan")
    for s in trace.steps:
        out.append(s.text, style=colour(prob(_known(s.logprob, s.sampled_logprob))))
    return out


def _known(raw: float | None, processed: float | None) -> float | None:
    """The raw number, or the processed one in a trace that holds only that."""
    return raw if raw is not None else processed


def _num(x: float | int | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def token_cell(s: Step) -> str:
    own = show_bytes(s.bytes)
    return own if escape(s.text) == own else f"{own} → {escape(s.text) or '…'}"


def steps_table(trace: Trace, sampled: bool, width: int = 100) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    fixed = {"no_wrap": True, "justify": "right"}
    table.add_column("#", style="dim", min_width=2, **fixed)
    table.add_column("token", no_wrap=True, min_width=12, overflow="ellipsis")
    table.add_column("prob", min_width=5, **fixed)
    if sampled:
        table.add_column("sampled", min_width=7, **fixed)
    table.add_column("rank", min_width=4, **fixed)
    table.add_column("entropy", min_width=7, **fixed)
    drafted = recorded(trace.speculative)
    if drafted:  # speculative decoding: the draft's proposal and its verdict
        table.add_column("draft", no_wrap=True, min_width=9, max_width=18, overflow="ellipsis")
    # rich squeezes narrow columns away when one cell is too wide: bound the widest one
    used = 2 + 12 + 5 + 4 + 7 + (7 if sampled else 0) + (20 if drafted else 0) + 2 * (6 if sampled else 5)
    table.add_column("alternatives", no_wrap=True, overflow="ellipsis", max_width=max(12, width - used))
    for s in trace.steps:
        p = prob(_known(s.logprob, s.sampled_logprob))
        raw = None if s.logprob is None else prob(s.logprob)
        mark = "!" if s.problems else ""  # a watched loop's problem starts here
        row = [f"{mark}{s.index}", Text(token_cell(s), style=colour(p)), _num(raw, ".3f")]
        if sampled:
            row.append(_num(None if s.sampled_logprob is None else prob(s.sampled_logprob), ".3f"))
        alts = Text()
        for a in s.top:
            if a.token_id == s.token_id:
                continue
            ap = prob(_known(a.logprob, a.sampled_logprob))
            alts.append(show_bytes(a.bytes), style=colour(ap))
            alts.append(f" {ap:.3f}  ", style="dim")
        row += [_num(s.rank, "d"), _num(s.entropy, ".2f")]
        if drafted:
            row.append(Text(*draft_cell(s.draft)))
        row.append(alts)
        table.add_row(*row, style="red" if s.problems else None)
    return table


def problems(trace: Trace) -> Text:
    """A watched loop's problems, each under the step where it starts."""
    out = Text()
    for s in trace.steps:
        for p in s.problems or []:
            out.append(f"step {s.index}: ", style="bold red")
            out.append(f"{p.get('message', p) if isinstance(p, dict) else p}\n", style="red")
    return out


def view(trace: Trace, width: int = 100) -> Group:
    p = trace.params
    if trace.distributions == "both" and "temperature" in p:
        sampled = p["temperature"] != 0 or p.get("repetition_penalty", 1.0) != 1.0
    else:  # shown wherever the trace holds processed numbers and the settings are not known to match
        sampled = trace.distributions != "raw"
    return Group(
        header(trace), Text(), coloured_text(trace), Text(), legend(), Text(), steps_table(trace, sampled, width),
        problems(trace),
    )


def print_trace(trace: Trace, console: Console | None = None) -> None:
    console = console or Console()
    console.print(view(trace, console.width))
