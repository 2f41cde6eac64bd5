"""The terminal view of a trace (rich): coloured text, then one table row per step."""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.console import Console, Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from lmtrace.records import Step, Trace
from lmtrace.render.speculative import draft_cell, recorded, summary
from lmtrace.render.terminal.structured import FLAG, structured_view
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


def header_lines(trace: Trace) -> list[Text]:
    """The header, a line per fact: the model's name, its architecture, the origin, the decoding
    and its times, the templated prompt's note, the cache, an error."""
    p = trace.params
    t = trace.timing
    mode = _mode(p)
    extras = [
        f"{k} {p[k]}"
        for k, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0))
        if k in p and p[k] != off
    ]
    if p.get("logit_bias"):
        extras.append(f"logit_bias on {len(p['logit_bias'])} tokens")
    lines = [Text(f"{trace.model['source']}", style="bold")]
    if _model_line(trace):
        lines.append(Text(_model_line(trace).strip(), style="dim"))
    origin = _ORIGIN.get(trace.origin)
    if origin or trace.distributions in _HOLDS:
        lines.append(Text(", ".join(x for x in (origin, _HOLDS.get(trace.distributions)) if x), style="bold"))
    run = Text(f"{mode}{', ' if extras else ''}{', '.join(extras)}; ")
    prefill = t.get("prefill_ms")
    timed = f", prefill {prefill:.0f} ms, " if prefill is not None else ", "
    run.append(f"prompt {t['prompt_tokens']} tokens{timed}")
    rate = t.get("decode_tokens_per_s")
    run.append(f"{t['generated_tokens']} tokens at {rate:.1f} tok/s" if rate else f"{t['generated_tokens']} tokens")
    run.append(f", finish: {trace.finish_reason}")
    if trace.stop_reason is not None:
        run.append(f" ({trace.stop_reason!r})")
    lines.append(run)
    if trace.prompt.get("templated"):
        lines.append(Text("the prompt went through the chat template: --show-prompt shows it whole", style="dim"))
    last = trace.steps[-1].kv if trace.steps else None
    if last and last.get("bytes") is not None:
        when = " (measured at the end)" if last.get("measured") == "end" else ""
        lines.append(Text(f"KV cache{when}: {last['seq_len']} positions, {last['bytes']:,} bytes", style="dim"))
    if trace.speculative is not None:
        lines.append(Text(summary(trace.speculative), style="dim"))
    mismatches = (trace.kv_anatomy or {}).get("mismatches")
    if mismatches:
        line = f"warning: measured KV bytes differ from the formula at steps {mismatches} (a failed self-check)"
        lines.append(Text(line, style="bold red"))
    return lines


def header(trace: Trace) -> Text:
    return Text("\n").join(header_lines(trace))


def _header_view(trace: Trace) -> Group:
    """The header with every line after the name indented: a long one wraps under itself."""
    first, *rest = header_lines(trace)
    return Group(first, *(Padding(line, (0, 0, 0, 2)) for line in rest))


def legend() -> Text:
    out = Text("p ≥ ", style="dim")
    for i, (threshold, name) in enumerate(SCALE):
        out.append(f" {threshold:g} " if i < len(SCALE) - 1 else " lower ", style=f"black on {name}")
    return out


def coloured_text(trace: Trace, show_prompt: bool = False) -> Text:
    """The prompt (dim) and the coloured answer; with a chat template, the turns are marked, and
    with `show_prompt` the whole templated prompt is shown (the system prompt it added included)."""
    out = Text()
    chat = bool(trace.params.get("chat"))
    templated = trace.prompt.get("templated")
    if chat and show_prompt and templated:  # exactly what the model saw before its answer
        out.append("prompt as the model saw it ▸\n", style="bold cyan")
        out.append(templated, style="dim")
        out.append("\nassistant ▸ ", style="bold cyan")
    elif chat:  # the turn boundary: the prompt was the user's message, the steps are the answer
        out.append("user ▸ ", style="bold cyan")
        out.append(trace.prompt["text"], style="dim")
        out.append("\nassistant ▸ ", style="bold cyan")
    else:
        out.append(trace.prompt["text"], style="dim")
    for s in trace.steps:
        out.append(s.text, style=colour(prob(_known(s.logprob, s.sampled_logprob))))
    return out


def _known(raw: float | None, processed: float | None) -> float | None:
    """The raw number, or the processed one in a trace that holds only that."""
    return raw if raw is not None else processed


def _num(x: float | int | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def token_cells(steps: list[Step]) -> list[str]:
    """Each step's token as a reader sees it: its text; for a token that holds only the first
    bytes of a character (a Chinese character, an emoji), that character then "…"; for the one
    that completes it, "…" then the characters it completes (never <0xE7><0xBA>)."""
    cells = []
    for i, s in enumerate(steps):
        own = show_bytes(s.bytes)
        if escape(s.text) == own:
            cells.append(own)
        elif not s.text:  # the character it starts (or continues) shows on the step that completes it
            coming = next((t.text for t in steps[i + 1 :] if t.text), "")
            before = steps[i - 1] if i else None
            middle = "…" if before is not None and not before.text and show_bytes(before.bytes) != "" else ""
            cells.append(f"{middle}{escape(coming[:1])}…" if coming else own)
        else:
            cells.append(f"…{escape(s.text)}")
    return cells


def _alternative(a: Any) -> str:
    """An alternative token, short: its text, or its bytes as one <E7BA> group where they are no
    whole character."""
    shown = show_bytes(a.bytes)
    return shown if "<0x" not in shown else "<" + "".join(f"{b:02X}" for b in a.bytes) + ">"


def _removed(s: Step) -> Text:
    """The raw probability the grammar removed at a step (red where it removed more than half)."""
    if not s.grammar:
        return Text("")
    mass = s.grammar["removed_mass"]
    return Text(f"{mass:.3f}", style="bold magenta" if mass > FLAG else "dim")


def steps_table(trace: Trace, sampled: bool, width: int = 100) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    fixed = {"no_wrap": True, "justify": "right"}
    constrained = any(s.grammar for s in trace.steps)
    table.add_column("#", style="dim", min_width=2, **fixed)
    table.add_column("token", no_wrap=True, min_width=12, max_width=20, overflow="ellipsis")
    table.add_column("prob", min_width=5, **fixed)
    if sampled:
        table.add_column("sampled", min_width=7, **fixed)
    if constrained:
        table.add_column("grammar removed", min_width=7, **fixed)
    table.add_column("rank", min_width=4, **fixed)
    table.add_column("entropy", min_width=7, **fixed)
    drafted = recorded(trace.speculative)
    if drafted:  # speculative decoding: the draft's proposal and its verdict
        table.add_column("draft", no_wrap=True, min_width=9, max_width=18, overflow="ellipsis")
    # rich squeezes narrow columns away when one cell is too wide: bound the widest one
    longest = min(20, max((cell_len(c) for c in token_cells(trace.steps)), default=12))
    used = 2 + max(12, longest) + 5 + 4 + 7 + (7 if sampled else 0) + (17 if constrained else 0)
    used += 20 if drafted else 0
    used += 2 * (6 if sampled else 5)
    table.add_column("alternatives", no_wrap=True, overflow="ellipsis", max_width=max(12, width - used))
    for s, cell in zip(trace.steps, token_cells(trace.steps)):
        p = prob(_known(s.logprob, s.sampled_logprob))
        raw = None if s.logprob is None else prob(s.logprob)
        mark = "!" if s.problems else ""  # a watched loop's problem starts here
        row = [f"{mark}{s.index}", Text(cell, style=colour(p)), _num(raw, ".3f")]
        if sampled:
            row.append(_num(None if s.sampled_logprob is None else prob(s.sampled_logprob), ".3f"))
        if constrained:
            row.append(_removed(s))
        alts = Text()
        for a in s.top:
            if a.token_id == s.token_id:
                continue
            ap = prob(_known(a.logprob, a.sampled_logprob))
            alts.append(_alternative(a), style=colour(ap))
            alts.append(f" {ap:.3f} ".replace(" 0.", " .") + " ", style="dim")  # ".113": more fit in 80 columns
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


def view(trace: Trace, width: int = 100, show_prompt: bool = False) -> Group:
    p = trace.params
    if trace.distributions == "both" and "temperature" in p:
        processors = p["temperature"] != 0 or p.get("repetition_penalty", 1.0) != 1.0 or bool(p.get("logit_bias"))
        sampled = processors or any(s.grammar for s in trace.steps)
    else:  # shown wherever the trace holds processed numbers and the settings are not known to match
        sampled = trace.distributions != "raw"
    return Group(
        _header_view(trace),
        Text(),
        coloured_text(trace, show_prompt),
        Text(),
        legend(),
        Text(),
        steps_table(trace, sampled, width),
        problems(trace),
    )


def print_trace(trace: Trace, console: Console | None = None, show_prompt: bool = False) -> None:
    """The view, and for a constrained trace its fields, choices and grammar line."""
    console = console or Console()
    console.print(view(trace, console.width, show_prompt))
    structured = structured_view(trace, console.width)
    if structured is not None:
        console.print(structured)
