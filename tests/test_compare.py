"""compare: other engines' logprobs against the model's own."""

from __future__ import annotations

import json

import pytest

import lmtrace
from lmtrace.cli import main
from lmtrace.comparison import parse_response


@pytest.fixture(scope="module")
def tempered(tiny_lm):
    """A sampled generation at temperature 0.5: its sampled logprobs are the processed ones."""
    return lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=24, temperature=0.5, seed=3, stop_on_eos=False)


def chat_response(trace, sampled: bool) -> dict:
    choices = [{"index": 0, "logprobs": trace.to_openai(sampled)}]
    return {"request": {"prompt": trace.prompt["text"]}, "response": {"object": "chat.completion", "choices": choices}}


def token_string(raw: bytes) -> str:
    """A token as OpenAI's completions logprobs write it: its text, or `bytes:\\x..` for a piece."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def completions_response(trace, lm, echo: bool = False) -> dict:
    from lmtrace.detokenize import TokenBytes

    tb = TokenBytes(lm.tokenizer)
    steps = trace.steps
    tokens = [token_string(bytes(s.bytes)) for s in steps]
    lps = [s.logprob for s in steps]
    tops = [{token_string(bytes(a.bytes)): a.logprob for a in s.top} for s in steps]
    prompt = trace.prompt["text"]
    if echo:  # the prompt's tokens first; only the first has no logprob
        import torch

        ids = trace.prompt["token_ids"] + trace.token_ids
        with torch.no_grad():
            lp = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), -1)
        n = len(trace.prompt["token_ids"])
        head = [token_string(tb(i)) for i in trace.prompt["token_ids"]]
        head_lps = [None] + [float(lp[j - 1, ids[j]]) for j in range(1, n)]
        tokens, lps, tops = head + tokens, head_lps + lps, [None] * n + tops
    return {"request": {} if echo else {"prompt": prompt},
            "response": {"object": "text_completion",
                         "choices": [{"text": trace.text, "logprobs": {"tokens": tokens, "token_logprobs": lps,
                                                                       "top_logprobs": tops}}]}}  # fmt: skip


def llama_cpp_response(trace) -> dict:
    def entry(t):
        return {"id": t.token_id, "token": t.text, "bytes": t.bytes, "logprob": t.logprob}

    rows = [{**entry(s), "top_logprobs": [entry(a) for a in s.top]} for s in trace.steps]
    return {"content": trace.text, "prompt": trace.prompt["text"], "completion_probabilities": rows}


def test_raw_numbers_are_recognised_as_raw(tiny_lm, tempered):
    result = lmtrace.compare(tiny_lm, chat_response(tempered, sampled=False))
    s = result.summary
    assert result.kind == "openai-chat" and s["compared"] == 24
    assert s["verdict"] == "raw" and s["max_abs_diff"] < 1e-5 and s["mean_kl_top"] < 1e-6
    assert s["top1_agreement"] == sum(st.rank == 1 for st in tempered.steps) / 24


def test_tempered_numbers_are_recognised_as_processed(tiny_lm, tempered):
    result = lmtrace.compare(tiny_lm, chat_response(tempered, sampled=True))
    s = result.summary
    assert s["verdict"] == "processed" and abs(s["best_temperature"]["temperature"] - 0.5) < 0.02
    assert s["mean_abs_diff"] > 0.1
    told = lmtrace.compare(tiny_lm, chat_response(tempered, sampled=True), temperature=0.5)
    assert told.summary["verdict"] == "processed" and told.summary["mean_abs_diff_processed"] < 1e-5


def test_completions_shape_with_and_without_echo(tiny_lm, tempered):
    plain = lmtrace.compare(tiny_lm, completions_response(tempered, tiny_lm))
    assert plain.kind == "openai-completions" and plain.summary["max_abs_diff"] < 1e-5
    assert plain.summary["compared"] == 24 and plain.unmapped == []
    echoed = lmtrace.compare(tiny_lm, completions_response(tempered, tiny_lm, echo=True))
    n = len(tempered.prompt["token_ids"])
    assert echoed.summary["compared"] == 24 + n - 1 and echoed.summary["max_abs_diff"] < 1e-5


def test_llama_cpp_server_shape(tiny_lm, tempered):
    result = lmtrace.compare(tiny_lm, llama_cpp_response(tempered))
    assert result.kind == "llama.cpp" and result.summary["verdict"] == "raw"
    legacy = {"completion_probabilities": [{"content": "Hi", "probs": [{"tok_str": "Hi", "prob": 0.5}]}]}
    rep = parse_response(legacy)
    assert rep.tokens[0].logprob == pytest.approx(-0.6931, abs=1e-4)


def test_lmtrace_trace_shape(tiny_lm, tempered):
    result = lmtrace.compare(tiny_lm, tempered.to_dict())
    assert result.kind == "lmtrace" and result.summary["verdict"] == "raw"


def test_an_unmappable_token_is_reported_not_guessed(tiny_lm, tempered):
    d = chat_response(tempered, sampled=False)
    d["response"]["choices"][0]["logprobs"]["content"][5]["bytes"] = [0xFF, 0xFE, 0xFD, 0xFC, 0xFB]
    result = lmtrace.compare(tiny_lm, d)
    assert result.unmapped[0]["index"] == 5 and result.summary["compared"] == 5


def test_unknown_shape_is_refused(tiny_dir, tmp_path, capsys):
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"choices": [{"text": "no logprobs"}]}))
    assert main(["compare", str(f), "--model", str(tiny_dir)]) == 2
    assert "response: no logprobs found" in capsys.readouterr().err


def test_cli_writes_json_and_html(tiny_dir, tiny_lm, tempered, tmp_path, capsys):
    f = tmp_path / "r.json"
    f.write_text(json.dumps(chat_response(tempered, sampled=True)))
    out, page = tmp_path / "c.json", tmp_path / "c.html"
    assert main(["compare", str(f), "--model", str(tiny_dir), "--json", str(out), "--html", str(page)]) == 0
    d = json.loads(out.read_text())
    assert d["summary"]["verdict"] == "processed" and len(d["tokens"]) == 24
    for key in ("top1_agreement", "mean_abs_diff", "max_abs_diff", "verdict"):
        assert key in d["summary"]
    assert "verdict: processed" in capsys.readouterr().out
    assert "processed" in page.read_text()
