"""watch(model, record=True) and w.trace(tokenizer): a hand-written loop as a Trace. The loop
that re-feeds the whole sequence and picks the second most likely token shows rank 2 at every
step, the cache sizes n, 2n+1, 3n+3, ... and the re-feeding flagged at step 1, in the report's
data and in headless Chromium; a right greedy loop equals lmtrace.generate."""

from __future__ import annotations

import io
import re
import warnings

import pytest
import torch
from rich.console import Console

import lmtrace
from lmtrace.kv import ledger as kv
from lmtrace.records import Trace
from lmtrace.render.html.trace import page_data, render_html, write_html
from lmtrace.render.plots.trace import plot_png
from lmtrace.render.terminal.trace import print_trace
from tests.server.cdp import find_browser
from tests.test_from_generate import assert_equal

PROMPT = "Hello world, the quick"


def second_best_refeeding_loop(model, ids: torch.Tensor, rounds: int) -> torch.Tensor:
    """The mistake: the whole sequence fed again with the cache, and topk(2)[-1] picked."""
    cache = kv.new_cache(model)
    seq = ids
    for _ in range(rounds):
        logits = model(seq, **kv.cache_kwargs(model, cache)).logits[:, -1]
        seq = torch.cat([seq, logits.topk(2).indices[:, -1:]], dim=1)
    return seq


def right_greedy_loop(model, ids: torch.Tensor, rounds: int) -> torch.Tensor:
    cache = kv.new_cache(model)
    seq, step_input = ids, ids
    for _ in range(rounds):
        logits = model(step_input, **kv.cache_kwargs(model, cache)).logits[:, -1]
        step_input = logits.argmax(-1, keepdim=True)
        seq = torch.cat([seq, step_input], dim=1)
    return seq


def watched(lm, loop, rounds: int = 5) -> tuple[lmtrace.watch, torch.Tensor]:
    ids = torch.tensor([lmtrace.encode_prompt(lm, PROMPT)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lmtrace.CacheMisuseWarning)
        with lmtrace.watch(lm.model, record=True) as w, torch.no_grad():
            seq = loop(lm.model, ids, rounds)
    return w, seq


@pytest.fixture(scope="module")
def refeed(tiny_lm) -> tuple[Trace, int]:
    w, seq = watched(tiny_lm, second_best_refeeding_loop)
    return w.trace(tiny_lm.tokenizer, tokens=seq), len(lmtrace.encode_prompt(tiny_lm, PROMPT))


def test_second_best_refeeding_loop_reads_right(refeed):
    trace, n = refeed
    assert trace.origin == "watch" and trace.distributions == "raw"
    assert [s.rank for s in trace.steps] == [2] * 5
    assert [s.kv["seq_len"] for s in trace.steps] == [n, 2 * n + 1, 3 * n + 3, 4 * n + 6, 5 * n + 10]
    assert [s.kv["expected_seq_len"] for s in trace.steps] == [n + i for i in range(5)]
    assert trace.steps[0].problems is None
    first = trace.steps[1].problems[0]
    assert (first["round"], first["kind"]) == (1, "refed_tokens")
    assert (first["expected_cache_len"], first["actual_cache_len"]) == (n + 1, 2 * n + 1)
    assert all(s.problems and s.problems[0]["round"] == s.index for s in trace.steps[1:])
    for s in trace.steps:  # the chosen token is the loop's logits' second: the top list says so too
        assert s.top[1].token_id == s.token_id and s.top[0].logprob > s.logprob
        assert s.sampled_logprob is None and s.kv["bytes"] > 0


def test_choices_are_read_from_the_next_round_without_tokens(tiny_lm):
    w, seq = watched(tiny_lm, second_best_refeeding_loop, rounds=4)
    trace = w.trace(tiny_lm.tokenizer)
    n = len(lmtrace.encode_prompt(tiny_lm, PROMPT))
    assert trace.token_ids == seq[0, n : n + 3].tolist()  # the last round's choice was never fed
    assert [s.rank for s in trace.steps] == [2, 2, 2]


def test_report_data_shows_the_problem_where_it_starts(refeed):
    trace, n = refeed
    page = render_html(trace)
    data = page_data(page)
    steps = data["views"][0]["steps"]
    assert [s["rank"] for s in steps] == [2] * 5
    assert [s["kv"]["seq_len"] for s in steps] == [n, 2 * n + 1, 3 * n + 3, 4 * n + 6, 5 * n + 10]
    assert "problems" not in steps[0] and "round 1: fed" in steps[1]["problems"][0]
    marked = re.findall(r'class="tok[^"]*\bproblem\b[^"]*" data-i="(\d+)"', page)
    assert marked[0] == "1" and marked == ["1", "2", "3", "4"]
    assert "Problems (4, from step 1)" in page
    assert "a watched loop (watch, record=True)" in page and "raw only" in page
    assert "nan" not in page.lower()


def test_terminal_notebook_plot_and_json(refeed):
    trace, _ = refeed
    console = Console(file=io.StringIO(), width=140)
    print_trace(trace, console)
    out = console.file.getvalue()
    assert "from a watched loop" in out and "step 1: round 1: fed" in out and "!1" in out
    assert "problem" in trace._repr_html_()
    assert plot_png(trace).startswith(b"\x89PNG")
    back = Trace.from_json(trace.to_json())
    assert back.to_dict() == trace.to_dict() and back.steps[1].problems == trace.steps[1].problems


def test_rescore_finds_where_the_refeeding_loop_goes_wrong(tiny_lm, refeed):
    trace, _ = refeed
    r = lmtrace.rescore(tiny_lm, trace)
    assert r["max_abs_diff_sampled"] is None  # the loop's processing is not known
    assert r["worst_step"] >= 1 and r["max_abs_diff"] > 1e-3
    assert abs(r["logprobs"][0] - trace.steps[0].logprob) < 1e-5  # round 0 (the prompt) is right


def test_right_loop_equals_lmtrace_generate(tiny_lm):
    w, seq = watched(tiny_lm, right_greedy_loop, rounds=6)
    assert w.problems == []
    trace = w.trace(tiny_lm.tokenizer, tokens=seq)
    want = lmtrace.generate(tiny_lm, PROMPT, max_new_tokens=6, temperature=0, stop_on_eos=False)
    for s in want.steps:  # the loop's processing is not known: compare the raw numbers only
        s.sampled_logprob = s.sampled_entropy = None
        for a in s.top:
            a.sampled_logprob = None
    trace.params, want.params = {}, {}
    assert_equal(trace, want)
    n = len(trace.prompt["token_ids"])
    assert [s.kv["seq_len"] for s in trace.steps] == [n + i for i in range(6)]
    assert all(s.problems is None for s in trace.steps)
    assert lmtrace.rescore(tiny_lm, trace)["max_abs_diff"] < 1e-4


def test_bad_use_is_one_clear_error(tiny_lm):
    ids = torch.tensor([lmtrace.encode_prompt(tiny_lm, PROMPT)])
    with lmtrace.watch(tiny_lm.model) as w, torch.no_grad():
        right_greedy_loop(tiny_lm.model, ids, 2)
    with pytest.raises(lmtrace.InvalidParameter, match=r"record=True"):
        w.trace(tiny_lm.tokenizer)
    w, seq = watched(tiny_lm, right_greedy_loop, rounds=3)
    with pytest.raises(lmtrace.InvalidParameter, match="tokens: expected the loop.s whole sequence"):
        w.trace(tiny_lm.tokenizer, tokens=[1, 2, 3, 4, 5])
    from tests.test_from_generate import other_vocab_tokenizer

    with pytest.raises(lmtrace.InvalidParameter, match="tokenizer: has 2000 tokens"):
        w.trace(other_vocab_tokenizer())
    with lmtrace.watch(tiny_lm.model, record=True) as empty:
        pass
    with pytest.raises(lmtrace.InvalidParameter, match="no forward call"):
        empty.trace(tiny_lm.tokenizer)


BROWSER = find_browser()


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine")
def test_problem_is_visible_at_its_step_in_chromium(refeed, tmp_path):
    from tests.test_report_browser import hover, open_report
    from tests.test_report_browser import problems as page_errors

    trace, n = refeed
    report = tmp_path / "loop.html"
    write_html(report, trace)
    browser = open_report(report, tmp_path / "profile")
    try:
        first = browser.js("document.querySelector('.tok.problem').dataset.i")
        assert first == "1"
        red = browser.js("getComputedStyle(document.querySelector('.tok.problem')).borderTopColor")
        clean = browser.js("getComputedStyle(document.querySelector('.tok[data-i=\"0\"]')).borderTopColor")
        assert red == "rgb(220, 38, 38)" and red != clean
        heading = browser.js("document.querySelector('#problems h2').textContent")
        assert heading == "Problems (4, from step 1)"
        hover(browser, '.tok[data-i="1"]')
        browser.wait_for("document.querySelectorAll('#panel .panel-problem').length > 0", timeout=10)
        panel = browser.js("document.getElementById('panel').textContent")
        assert "step 1" in panel and "round 1: fed" in panel and f"{2 * n + 1} positions" in panel
        assert "rank2" in panel.replace(" ", "")
        assert page_errors(browser) == []
    finally:
        browser.close()
