"""The report's sections, one small function each, over the record dicts. A function returns
None when its data is absent, so a new kind of data (a per-layer ledger, a waterfall, ...) is
one more function here and one more line in the list of its page kind."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from markupsafe import Markup

from lmtrace.render import anatomy as kv_anatomy
from lmtrace.render import speculative as spec_view
from lmtrace.render import views
from lmtrace.render.html import attribution as attribution_html
from lmtrace.render.html import facts, inside
from lmtrace.render.html import structured as structured_html
from lmtrace.render.html import uncertainty as confidence
from lmtrace.render.html.svg import Series, bar_chart, human_bytes, line_chart
from lmtrace.render.html.templating import parts
from lmtrace.render.tokens import SCALE

LEGEND = [f"≥ {t:g}" for t, _ in SCALE[:-1]] + [f"< {SCALE[-2][0]:g}"]
# trace-level KV anatomy: the field names the KV ledger may use
ANATOMY_KEYS = ("kv_anatomy", "kv")


@dataclass
class Section:
    id: str
    title: str
    body: Markup


def text_section(
    tv: list[dict[str, Any]],
    prompt: str | None,
    switch: bool,
    unscored: bool = False,
    chat: bool = False,
    templated: str | None = None,
) -> Section:
    p = parts()  # with chat, the user's turn (the prompt) and the assistant's (the answer) are marked
    body = (p.switch() if switch else Markup()) + p.tokens(tv, 0, prompt, chat) + p.legend(LEGEND, unscored)
    if templated:  # what the chat template made of the prompt: its system prompt and turn markers
        body += p.templated(templated)
    return Section("text", "Text", body)


def step_charts(tv: list[dict[str, Any]], sampled: bool, what: str = "step") -> Section:
    """Chosen-token probability and entropy per step, raw and (when different) sampled; only the
    processed ones for a trace that holds no raw distribution."""
    raw = views.raw_known(tv)
    prob = [Series("raw", [v["p"] for v in tv], "c0")] if raw else []
    entropy = [Series("raw", [v["H"] for v in tv], "c0")] if raw else []
    if sampled or not raw:
        prob.append(Series("sampled", [v["sp"] for v in tv], "c1"))
        entropy.append(Series("sampled", [v["sH"] for v in tv], "c1"))
    items = [
        ("probability of the chosen token", line_chart(prob, "probability per step", 1.0, x_label=what)),
        ("entropy (nats)", line_chart(entropy, "entropy per step", x_label=what)),
    ]
    kv = [v["kv"].get("bytes") for v in tv if isinstance(v.get("kv"), dict)]
    if kv and len(kv) == len(tv):
        chart = line_chart([Series("KV cache", kv, "c2")], "KV cache bytes per step", fmt=human_bytes, binary=True)
        items.append(("KV-cache bytes after each step's forward pass", chart))
    return Section("charts", "Per step", parts().charts(items))


def kv_section(d: dict[str, Any]) -> Section | None:
    """The trace-level KV anatomy and the last step's per-layer ledger, when recorded."""
    anatomy = next((d[k] for k in ANATOMY_KEYS if isinstance(d.get(k), dict)), None)
    steps = d.get("steps") or []
    last = steps[-1].get("kv") if steps and isinstance(steps[-1].get("kv"), dict) else {}
    layers = [x for x in last.get("layers") or [] if isinstance(x, dict)]
    if anatomy is None and not layers:
        return None
    p = parts()
    body = Markup()
    if anatomy is not None:  # dimensions, their config fields, the formula with numbers; an alert on mismatch
        body += kv_anatomy.html(anatomy, *kv_anatomy.last_kv(steps))
    if layers:
        rows = [{k: facts.value(v, k) for k, v in layer.items()} for layer in layers]
        columns = list(dict.fromkeys(k for layer in layers for k in layer))
        when = "when model.generate returned (the whole batch)" if last.get("measured") == "end" else None
        body += Markup(f"<h3>By layer, {when or f'after step {len(steps) - 1}'}</h3>") + p.table(rows, columns)
        sizes = [layer.get("bytes") for layer in layers]
        if all(isinstance(b, int | float) for b in sizes):
            body += p.charts([("bytes per layer", bar_chart(sizes, "bytes per layer", human_bytes, "layer"))])
    return Section("kv", "KV cache", body)


def lens_section(d: dict[str, Any], tv: list[dict[str, Any]]) -> Section | None:
    """The logit lens: a layer × step heatmap of the chosen token's probability."""
    svg = inside.lens_heatmap(d["steps"])
    if svg is None:
        return None
    how = (d.get("params") or {}).get("lens") or {}
    settled = [v["lens"]["settled"] for v in tv if "lens" in v]
    return Section("lens", "Logit lens", parts().lens(svg, how, settled, len(settled)))


def attribution_section(d: dict[str, Any]) -> Section | None:
    """Attribution: a layer × step heatmap of the attention and MLP parts of the logit difference."""
    svg = attribution_html.attribution_heatmap(d["steps"])
    if svg is None:
        return None
    body = attribution_html.attribution_note(attribution_html.heatmap_top(d["steps"]))
    return Section(
        "attribution",
        "Attribution: why this token and not that one",
        body + Markup("<div class='lens-heatmap'>") + svg + Markup("</div>"),
    )


def attention_section(d: dict[str, Any], tv: list[dict[str, Any]]) -> Section | None:
    """The prompt and generated text, shaded by the hovered step's attention (script)."""
    shown = inside.positions(d, tv)
    layers = next((len(v["att"]["layers"]) for v in tv if "att" in v), 0)
    if shown is None or not layers:
        return None
    heads = next((len(x["heads"]) for v in tv if "att" in v for x in v["att"]["layers"] if x.get("heads")), 0)
    recent = ((d.get("params") or {}).get("attention") or {}).get("recent", 32)
    valued = any("vw" in x for v in tv if "att" in v for x in v["att"]["layers"])
    how = {
        "layers": layers,
        "heads": heads,
        "valued": valued,
        "recent": recent if len(shown) > recent else None,
        "sinks": sum(p["sink"] for p in shown),
    }
    return Section("attention", "Attention over the cache", parts().attention(shown, how))


def problems_section(tv: list[dict[str, Any]]) -> Section | None:
    """A watched loop's cache problems, each at the step (round) where it starts."""
    found = [(v["i"], m) for v in tv for m in v.get("problems") or []]
    if not found:
        return None
    p = parts()
    body = Markup().join(p.error(f"step {i}: {m}") for i, m in found)
    return Section("problems", f"Problems ({len(found)}, from step {found[0][0]})", body)


def speculative_section(d: dict[str, Any]) -> Section | None:
    """Speculative decoding: the draft blocks over the text and acceptance by position."""
    spec = d.get("speculative")
    if not isinstance(spec, dict):
        return None
    if not spec_view.recorded(spec):
        return Section(
            "speculative", "Speculative decoding", Markup('<p class="meta">') + spec_view.summary(spec) + Markup("</p>")
        )
    note = (
        Markup('<p class="meta">')
        + spec_view.summary(spec)
        + Markup(
            '; <span class="acc">accepted</span>, <del>rejected</del> beside the target\'s '
            '<span class="rej">token</span>, <span class="bonus">bonus</span>; hover for q and p</p>'
        )
    )
    chart = parts().charts([("acceptance by position in the block", spec_view.acceptance_chart(spec))])
    return Section("speculative", "Speculative decoding", note + spec_view.blocks_html(d["steps"]) + chart)


def origin_note(d: dict[str, Any]) -> str | None:
    """Where a trace came from and which distributions it holds, in words (None for lmtrace's own)."""
    origin, dist = d.get("origin", "lmtrace"), d.get("distributions", "both")
    if origin == "lmtrace" and dist == "both":
        return None
    where = {
        "model.generate": "from model.generate (lmtrace.from_generate)",
        "watch": "from a watched loop (lmtrace.watch, record=True)",
        "vllm": "from vLLM (batch --engine vllm)",
    }.get(origin, f"from {origin}")
    holds = {
        "both": "raw and processed distributions",
        "raw": "raw distribution only (no processed scores)",
        "processed": "processed distribution only (no raw logits)",
    }.get(dist, dist)
    return f"{where}; {holds}"


def steps_table(tv: list[dict[str, Any]], sampled: bool) -> Section:
    """Every step's numbers in one table, folded away by default."""
    lensed = any("lens" in v for v in tv)
    sampled = sampled or not views.raw_known(tv)
    columns = ["#", "token", "prob", *(["sampled"] if sampled else []), "rank", "entropy"]
    columns += [*(["settled at layer"] if lensed else []), "KV positions", "ms"]
    if any(v.get("problems") for v in tv):
        columns.append("problem")
    rows = []
    for v in tv:
        kv = v.get("kv") or {}
        row = {"#": v["i"], "token": v["shown"], "prob": facts.value(v["p"]), "rank": facts.value(v["rank"])}
        row |= {"sampled": facts.value(v["sp"]), "entropy": facts.value(v["H"])}
        row |= {"KV positions": facts.value(kv.get("seq_len")), "ms": facts.value(v.get("ms"))}
        if lensed:
            row["settled at layer"] = facts.value((v.get("lens") or {}).get("settled"))
        row["problem"] = "; ".join(v.get("problems") or [])
        rows.append(row)
    body = Markup("<details><summary>show all steps</summary>") + parts().table(rows, columns) + Markup("</details>")
    return Section("steps", "All steps", body)


def uncertainty_section(d: dict[str, Any]) -> Section | None:
    """--uncertainty: the text shaded by each token's DeepConf confidence and the confidence
    chart with the group window (render/html/uncertainty.py)."""
    u, steps = d.get("uncertainty"), d.get("steps") or []
    if not isinstance(u, dict) or not steps or not all(isinstance(s.get("uncertainty"), dict) for s in steps):
        return None
    conf = [s["uncertainty"]["confidence"] for s in steps]
    low, high = min(conf), max(conf)
    spans = Markup("").join(
        Markup('<span style="background:{}" title="step {}: confidence {:.3f}">{}</span>').format(
            confidence.shade(c, low, high), s["index"], c, s["text"]
        )
        for s, c in zip(steps, conf)
    )
    window = (u.get("settings") or {}).get("window", len(conf))
    note = Markup(
        '<p class="meta">tokens shaded by DeepConf confidence (red: the least confident); chart: token '
        "confidence (dots) and group confidence (line)</p>"
    )
    body = note + Markup('<div class="tokens" style="white-space:pre-wrap">') + spans + Markup("</div>")
    return Section("uncertainty", "How sure was the model?", body + confidence.confidence_svg(conf, window))


def trace_page(d: dict[str, Any]) -> tuple[list[Section], list[dict[str, Any]], bool]:
    """(sections, the script's views, whether sampled differs from raw) for one trace."""
    tv = views.token_views(d["steps"])
    sampled = views.sampling_differs(tv)
    constrained = [
        f(d) for f in (structured_html.fields_section, structured_html.choices_section, structured_html.grammar_section)
    ]
    found = [
        problems_section(tv),
        text_section(
            tv,
            (d.get("prompt") or {}).get("text"),
            sampled,
            chat=bool((d.get("params") or {}).get("chat")),
            templated=(d.get("prompt") or {}).get("templated"),
        ),
        *[Section(*c) for c in constrained if c],
        speculative_section(d),
        uncertainty_section(d),
        lens_section(d, tv),
        attribution_section(d),
        attention_section(d, tv),
        step_charts(tv, sampled),
        kv_section(d),
        steps_table(tv, sampled),
    ]
    return [s for s in found if s], [{"label": "trace", "steps": views.for_script(tv)}], sampled


def score_page(d: dict[str, Any]) -> tuple[list[Section], list[dict[str, Any]], bool]:
    tokens = d["tokens"]
    tv = views.token_views(tokens)
    found = [text_section(tv, None, False, unscored=True), step_charts(tv, False, "token"), steps_table(tv, False)]
    return found, [{"label": "score", "steps": views.for_script(tv)}], False


def branches_page(d: dict[str, Any]) -> tuple[list[Section], list[dict[str, Any]], bool]:
    """The branches side by side, marked from where each leaves the first, with charts."""
    traces = d["branches"]
    tvs = [views.token_views(t["steps"]) for t in traces]
    prefixes = views.mark_divergence(tvs, [[s["token_id"] for s in t["steps"]] for t in traces])
    sampled = any(views.sampling_differs(tv) for tv in tvs)
    columns, script = [], []
    for k, (t, tv, n) in enumerate(zip(traces, tvs, prefixes)):
        label = t.get("label") or ("original" if k == 0 else f"branch {k}")
        total = views.cumulative_logprob(t["steps"])
        meta = f"{len(tv)} tokens, cumulative logprob {total:.3f}, finish {t.get('finish_reason', '–')}"
        if k > 0:
            meta = f"leaves the original at step {n}; " + meta
        columns.append({"label": label, "meta": meta, "views": tv})
        script.append({"label": label, "steps": views.for_script(tv)})
    prompt = (traces[0].get("prompt") or {}).get("text", "")
    body = (parts().switch() if sampled else Markup()) + parts().branch_columns(columns, prompt)
    body += parts().legend(LEGEND)
    css = [f"c{k % 6}" for k in range(len(traces))]
    prob = [Series(c["label"], [v["p"] for v in tv], s, k) for k, (c, tv, s) in enumerate(zip(columns, tvs, css))]
    cumulative = []
    for k, (c, tv, s) in enumerate(zip(columns, tvs, css)):
        run = list(accumulate(-(v["lp"] or 0.0) for v in tv))
        cumulative.append(Series(c["label"], run, s, k))
    items = [
        ("probability of the chosen token", line_chart(prob, "probability per step", 1.0)),
        ("cumulative negative logprob", line_chart(cumulative, "cumulative negative logprob")),
    ]
    sections = [Section("branches", "Branches", body), Section("charts", "Per step", parts().charts(items))]
    return sections, script, sampled
