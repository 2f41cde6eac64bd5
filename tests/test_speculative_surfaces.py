"""Speculative decoding on every surface: `lmtrace generate --draft`, `branch --draft`, `batch
--draft`, `lmtrace serve --draft` (and a request's draft_tokens); bad input is one line and
exit 2 on the command line, a 400 naming the field on the server."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import lmtrace
from lmtrace.cli import main
from lmtrace.model.draft import draft_for
from lmtrace.server import create_app
from tests.cli_errors import one_error

GREEDY = ["--max-new-tokens", "12", "--temperature", "0", "--top-logprobs", "2"]


def _run(capsys, args: list[str]) -> tuple[int, str, str]:
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_generate_with_a_draft(capsys, tiny_dir):
    code, out, _ = _run(capsys, ["generate", "Hello world", "--model", str(tiny_dir), *GREEDY, "--json", "-"])
    plain = json.loads(out)
    args = ["generate", "Hello world", "--model", str(tiny_dir), *GREEDY, "--draft", "layers:1", "--draft-tokens", "3"]
    code, out, err = _run(capsys, [*args, "--json", "-", "--no-color"])
    fast = json.loads(out)
    assert code == 0 and fast["token_ids"] == plain["token_ids"]
    assert fast["speculative"]["draft"] == "layers:1" and fast["speculative"]["draft_tokens"] == 3
    assert "draft layers:1: 1 layers" in err
    assert "draft" in err.lower()  # the terminal view's draft column (on stderr with --json -)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--draft", "layers:1", "--draft-tokens", "0"], "must be an integer in [1, 16] or 'auto', got 0"),
        (
            ["--draft", "layers:1", "--draft-tokens", "17"],
            "draft_tokens must be an integer in [1, 16] or 'auto', got 17",
        ),
        (["--draft", "layers:1", "--draft-tokens", "many"], "or 'auto', got 'many'"),
        (["--draft-tokens", "2"], "draft_tokens: only with --draft, got 2"),
        (["--draft", "packed"], "draft: 'packed' runs the target's own GGUF file at 4 bits"),
        (["--draft", "layers:9"], "draft: 'layers:N' takes N in [1, 1] for this 2-layer model, got 9"),
    ],
)
def test_cli_bad_drafts_are_one_line(capsys, tiny_dir, extra, message):
    code, _, err = _run(capsys, ["generate", "Hello", "--model", str(tiny_dir), *GREEDY, *extra])
    assert code == 2 and message in one_error(err), err


def test_cli_another_vocabulary_is_one_line(capsys, tiny_dir, tmp_path):
    from tests.test_speculative import other_vocabulary_lm

    other = other_vocabulary_lm()
    other.model.save_pretrained(tmp_path)
    other.tokenizer.save_pretrained(tmp_path)
    code, _, err = _run(capsys, ["generate", "Hello", "--model", str(tiny_dir), *GREEDY, "--draft", str(tmp_path)])
    assert code == 2 and "has another vocabulary than the target" in one_error(err), err


def test_cli_branch_and_batch_with_a_draft(capsys, tiny_dir, tmp_path):
    base = ["--model", str(tiny_dir), *GREEDY]
    code, out, _ = _run(capsys, ["branch", "Hello world", "--at", "2", *base, "--json", "-"])
    plain = json.loads(out)
    code, out, _ = _run(capsys, ["branch", "Hello world", "--at", "2", *base, "--draft", "layers:1", "--json", "-"])
    fast = json.loads(out)
    assert code == 0
    assert [b["token_ids"] for b in fast["branches"]] == [b["token_ids"] for b in plain["branches"]]
    assert all("speculative" in b for b in fast["branches"])
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"id": 1, "prompt": "Hello world"}\n{"id": 2, "prompt": "Once", "draft_tokens": 2}\n')
    code, _, err = _run(capsys, ["batch", str(lines), str(tmp_path / "out.jsonl"), *base, "--draft", "layers:1"])
    assert code == 0, err
    got = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    by_id = {g["id"]: g["trace"] for g in got}
    assert by_id[1]["speculative"]["draft_tokens"] == 4 and by_id[2]["speculative"]["draft_tokens"] == 2
    want = lmtrace.generate(lmtrace.load(str(tiny_dir)), "Hello world", max_new_tokens=12, temperature=0)
    assert by_id[1]["token_ids"] == want.token_ids


@pytest.fixture(scope="module")
def pair(tiny_lm):
    """A plain server and one with the self-speculative draft, on the same tiny model."""
    with TestClient(create_app(tiny_lm, name="tiny")) as plain:
        draft = draft_for(tiny_lm, "layers:1")
        with TestClient(create_app(tiny_lm, name="tiny", draft=draft, draft_tokens=3)) as fast:
            yield plain, fast


def test_server_with_a_draft(pair):
    plain, fast = pair
    body = {"prompt": "Hello world", "max_tokens": 10, "temperature": 0, "logprobs": 2}
    a, b = plain.post("/v1/completions", json=body).json(), fast.post("/v1/completions", json=body).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    lp_a, lp_b = a["choices"][0]["logprobs"]["token_logprobs"], b["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-4
    trace = fast.post("/v1/traces", json={"prompt": "Hello world", "max_tokens": 8, "temperature": 0,
                                          "draft_tokens": 2}).json()  # fmt: skip
    assert trace["speculative"]["draft_tokens"] == 2 and all("draft" in s for s in trace["steps"])


@pytest.mark.parametrize("k", [-1, 17])
def test_server_bad_draft_tokens_is_a_400(pair, k):
    plain, fast = pair
    r = fast.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "draft_tokens": k})
    assert r.status_code == 400 and r.json()["error"]["param"] == "draft_tokens"
    assert f"draft_tokens must be in [0, 16], got {k}" in r.json()["error"]["message"]
    r = plain.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "draft_tokens": 2})
    assert r.status_code == 400 and "runs no draft model" in r.json()["error"]["message"]


def test_server_draft_with_lens_attention_and_attribution(pair, tiny_lm):
    """A drafted request records its own verify forwards' lens, attention and attribution: the
    trace generate gives with the same draft; a drafted branch still refuses the lens (a 400)."""
    _, fast = pair
    kw = {"temperature": 0, "lens": True, "attention": True, "attribution": True}
    trace = fast.post("/v1/traces", json={"prompt": "Hello world", "max_tokens": 8, **kw}).json()
    alone = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=8, draft="layers:1", draft_tokens=3, **kw)
    assert trace["token_ids"] == alone.token_ids and trace["speculative"]["blocks"] > 1
    for got, want in zip(trace["steps"], alone.to_dict()["steps"]):
        assert got["draft"] == want["draft"]
        for name in ("lens", "attention"):
            a, b = got[name]["layers"], want[name]["layers"]
            assert [[t["token_id"] for t in x["top"]] for x in a] == [[t["token_id"] for t in x["top"]] for x in b]
        a, b = got["attribution"], want["attribution"]
        assert all(abs(x["value"] - y["value"]) < 1e-5 for x, y in zip(a["parts"], b["parts"]))
    r = fast.post("/v1/branch", json={"prompt": "Hello", "at": 1, "max_tokens": 2, "lens": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lens"
    assert "lens: cannot be combined with this server's draft" in r.json()["error"]["message"]


def test_server_draft_tokens_0_decodes_a_request_without_the_draft(pair, tiny_lm):
    _, fast = pair
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "lens": True, "draft_tokens": 0}
    trace = fast.post("/v1/traces", json=body).json()
    alone = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=4, temperature=0, lens=True)
    assert trace["token_ids"] == alone.token_ids and trace.get("speculative") is None
    assert all(s["lens"] is not None and "draft" not in s for s in trace["steps"])


def test_views_show_the_draft(tiny_lm):
    """The report's draft blocks (accepted, rejected struck through, bonus) and acceptance bars;
    the terminal's draft column and summary line."""
    from rich.console import Console

    from lmtrace.render.html.trace import render_html
    from lmtrace.render.terminal.trace import print_trace

    trace = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=16, temperature=0, draft="layers:1",
                             draft_tokens=3, stop_on_eos=False)  # fmt: skip
    html = render_html(trace.to_dict())
    assert 'id="speculative"' in html and 'class="block"' in html and "acceptance by position" in html
    rejected = sum(1 for s in trace.steps if s.draft and not s.draft["accepted"])
    assert html.count("<del title=") == rejected and html.count('class="bonus"') >= 1
    console = Console(record=True, width=140)
    print_trace(trace, console)
    text = console.export_text()
    assert "speculative: draft layers:1, 3 tokens a block" in text
    assert any(line.split()[:6] == ["#", "token", "prob", "rank", "entropy", "draft"] for line in text.splitlines())
    assert "✗" in text and "+ bonus" in text


def test_a_proposal_the_targets_top_k_removes_is_written_as_null(tiny_lm):
    """p = -inf for a proposed token outside the target's top-k: JSON has no -inf, so it is null,
    and it reads back as -inf (it was a trace that could not be written at all)."""
    trace = lmtrace.generate(tiny_lm, "Once upon a time there was", temperature=0.9, top_k=30, seed=7,
                             max_new_tokens=7, draft="layers:1", draft_tokens=2)  # fmt: skip
    filtered = [s for s in trace.steps if s.draft and s.draft["target_logprob"] == float("-inf")]
    assert filtered, "the case needs a proposal outside the target's top-k"
    data = json.loads(trace.to_json())
    assert data["steps"][filtered[0].index]["draft"]["target_logprob"] is None
    back = lmtrace.Trace.from_json(trace.to_json())
    assert back.steps[filtered[0].index].draft["target_logprob"] == float("-inf")


def test_server_branch_decodes_with_the_servers_draft(pair, tiny_lm):
    """/v1/branch on a drafted server: its branches decode speculatively (draft_tokens as on the
    other routes; 0 without the draft); a plain server refuses draft_tokens (it was ignored)."""
    plain, fast = pair
    body = {"prompt": "Hello world", "at": 1, "max_tokens": 6, "temperature": 0}
    drafted = fast.post("/v1/branch", json={**body, "draft_tokens": 2}).json()
    without = fast.post("/v1/branch", json={**body, "draft_tokens": 0}).json()
    alone = lmtrace.branch(tiny_lm, "Hello world", 1, max_new_tokens=6, temperature=0)
    assert [b["token_ids"] for b in drafted["branches"]] == [t.token_ids for t in alone.traces]
    assert all(b["speculative"]["draft_tokens"] == 2 for b in drafted["branches"])
    assert all("speculative" not in b for b in without["branches"])
    r = plain.post("/v1/branch", json={**body, "draft_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "draft_tokens"


def test_cli_draft_tokens_auto(capsys, tiny_dir):
    """`--draft-tokens auto`: each block's K chosen by the run; the tokens are plain decoding's."""
    code, out, _ = _run(capsys, ["generate", "Hello world", "--model", str(tiny_dir), *GREEDY, "--json", "-"])
    plain = json.loads(out)
    args = [
        "generate",
        "Hello world",
        "--model",
        str(tiny_dir),
        *GREEDY,
        "--draft",
        "layers:1",
        "--draft-tokens",
        "auto",
    ]
    code, out, _ = _run(capsys, [*args, "--json", "-", "--no-color"])
    fast = json.loads(out)
    assert code == 0 and fast["token_ids"] == plain["token_ids"]
    assert fast["speculative"]["draft_tokens"] == "auto" and fast["speculative"]["proposed_per_block"]


def test_a_server_whose_draft_chooses_its_block_size(tiny_lm):
    """`lmtrace serve --draft layers:1 --draft-tokens auto`: plain decoding's tokens, the trace says auto."""
    draft = draft_for(tiny_lm, "layers:1")
    body = {"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "logprobs": 1}
    with TestClient(create_app(tiny_lm, name="tiny")) as plain:
        want = plain.post("/v1/completions", json=body).json()
    with TestClient(create_app(tiny_lm, name="tiny", draft=draft, draft_tokens="auto")) as fast:
        got = fast.post("/v1/completions", json=body).json()
        trace = fast.post("/v1/traces", json={"prompt": "Hello world", "max_tokens": 12, "temperature": 0}).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert trace["speculative"]["draft_tokens"] == "auto" and trace["speculative"]["proposed_per_block"]
    with pytest.raises(lmtrace.InvalidParameter, match="draft_tokens must be an integer"):
        create_app(tiny_lm, name="tiny", draft=draft, draft_tokens="many")
