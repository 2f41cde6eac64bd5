"""`lmtrace kld` and lmtrace.kld: every statistic equal to a hand computation from transformers'
own logits (numpy, float64, llama.cpp's chunking and percentile rule) within 1e-6: on the tiny
model against another tiny model and against its bfloat16 cast, with a BOS-adding tokenizer,
and on the bundled model float32 against its packed weights. The CLI's JSON, HTML (escaped) and
its one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmtrace.cli import main
from lmtrace.model.lm import LM
from lmtrace.scoring.kld import against_model, kld
from tests.cli_errors import one_error
from tests.tiny import CORPUS, bos_tokenizer, tiny_model

TEXT = " ".join(CORPUS)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def hand(a, b, ids: list[int], ctx: int, bos: int | None = None, chunks: int | None = None) -> dict:
    """The statistics by hand: chunks of ctx tokens (the first made the BOS), the second half of
    each scored, from each model's own forward logits."""
    kl, lpa, lpb, same = [], [], [], []
    for c in range(min(len(ids) // ctx, chunks or 10**9)):
        chunk = ids[c * ctx : (c + 1) * ctx]
        if bos is not None:
            chunk[0] = bos
        with torch.no_grad():
            la = a(torch.tensor([chunk])).logits[0].float().double().numpy()
            lb = b(torch.tensor([chunk])).logits[0].float().double().numpy()
        rows = range(ctx // 2, ctx - 1)
        pa_log, pb_log = log_softmax(la[list(rows)]), log_softmax(lb[list(rows)])
        kl += list((np.exp(pa_log) * (pa_log - pb_log)).sum(-1))
        nxt = [chunk[j + 1] for j in rows]
        lpa += [pa_log[k, t] for k, t in enumerate(nxt)]
        lpb += [pb_log[k, t] for k, t in enumerate(nxt)]
        same += list(la[list(rows)].argmax(-1) == lb[list(rows)].argmax(-1))
    kl, lpa, lpb = np.array(kl), np.array(lpa), np.array(lpb)
    dp = np.exp(lpb) - np.exp(lpa)
    pct = {"p1": 1, "p5": 5, "p10": 10, "p25": 25, "p75": 75, "p90": 90, "p95": 95, "p99": 99}
    return {
        "tokens": len(kl),
        "ppl_a": float(np.exp(-lpa.mean())),
        "ppl_b": float(np.exp(-lpb.mean())),
        "ppl_ratio": float(np.exp(-lpb.mean()) / np.exp(-lpa.mean())),
        "kld": {
            "mean": kl.mean(),
            "median": np.median(kl),
            "p99": np.percentile(kl, 99),
            "p99_9": np.percentile(kl, 99.9),
            "max": kl.max(),
        },  # fmt: skip
        "delta_p": {"median": np.median(dp), **{k: np.percentile(dp, q) for k, q in pct.items()}},
        "same_top": float(np.mean(same)),
        "worst_kl": sorted(kl)[::-1],
    }


def check(result: dict, expected: dict) -> None:
    assert result["tokens"] == expected["tokens"]
    for k in ("ppl_a", "ppl_b", "ppl_ratio", "same_top"):
        assert result[k] == pytest.approx(expected[k], abs=1e-6, rel=0), k
    for group in ("kld", "delta_p"):
        for k, v in expected[group].items():
            assert result[group][k] == pytest.approx(float(v), abs=1e-6, rel=0), (group, k)
    worst = [w["kld"] for w in result["worst"]]
    assert worst == pytest.approx(expected["worst_kl"][: len(worst)], abs=1e-6, rel=0)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory, tiny_tok):
    """A second tiny model (another seed), the same tokenizer, as a folder."""
    path = tmp_path_factory.mktemp("other")
    tiny_model(tiny_tok, seed=1).save_pretrained(path)
    tiny_tok.save_pretrained(path)
    return path


def test_tiny_against_another_model(tiny_lm, other_dir):
    b = against_model(tiny_lm, str(other_dir))
    result = kld(tiny_lm, b, TEXT, ctx=32, worst=5)
    ids = list(tiny_lm.tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    check(result, hand(tiny_lm.model, b.model, ids, 32))
    assert result["chunks"] == len(ids) // 32 and result["tokens"] == result["chunks"] * (32 - 1 - 16)
    assert result["kld"]["mean"] > 0.01 and 0 <= result["same_top"] < 1  # two different models
    w = result["worst"][0]
    chunk = ids[w["position"] // 32 * 32 : w["position"] // 32 * 32 + 32]
    assert w["token_id"] == ids[w["position"]] == chunk[w["position"] % 32]
    assert w["delta_p"] == pytest.approx(w["p_b"] - w["p_a"]) and w["context"] in TEXT


def test_tiny_against_its_bfloat16_cast(tiny_lm):
    b = against_model(tiny_lm, "dtype:bfloat16")
    result = kld(tiny_lm, b, TEXT, ctx=48, chunks=3)
    ids = list(tiny_lm.tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    check(result, hand(tiny_lm.model, b.model, ids, 48, chunks=3))
    assert result["chunks"] == 3 and result["kld"]["max"] < 0.05 and "bfloat16" in result["b"]


def test_a_bos_adding_tokenizer_starts_every_chunk_with_its_bos():
    tok = bos_tokenizer()
    a = LM.from_objects(tiny_model(tok, seed=0), tok, source="a")
    b = LM.from_objects(tiny_model(tok, seed=2), tok, source="b")
    result = kld(a, b, TEXT, ctx=40)
    ids = [tok.bos_token_id] + list(tok(TEXT, add_special_tokens=False)["input_ids"])
    check(result, hand(a.model, b.model, ids, 40, bos=tok.bos_token_id))
    assert result["text_tokens"] == len(ids)


def test_the_cli_writes_json_and_escaped_html(capsys, tiny_dir, other_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("<script>alert(1)</script> " + TEXT, encoding="utf-8")
    out, page = tmp_path / "k.json", tmp_path / "k.html"
    code = main(["kld", "--model", str(tiny_dir), "--against", str(other_dir), "--file", str(corpus), "--ctx", "32",
                 "--worst", "40", "--json", str(out), "--html", str(page), "--no-color"])  # fmt: skip
    assert code == 0
    d = json.loads(out.read_text())
    assert {"tokens", "ppl_a", "ppl_b", "ppl_ratio", "kld", "delta_p", "same_top", "worst"} <= set(d)
    assert set(d["kld"]) >= {"mean", "median", "p99", "p99_9", "max"}
    assert set(d["delta_p"]) >= {"p1", "p5", "p10", "p25", "median", "p75", "p90", "p95", "p99"}
    html = page.read_text()
    assert "<script>" not in html and "Same top p" in html and "Worst positions" in html
    shown = capsys.readouterr().out
    assert "Mean PPL(B)/PPL(A)" in shown and "99.9%   KLD" in shown and "Same top p" in shown


@pytest.mark.parametrize("args, message", [
    (["--ctx", "2"], "ctx must be >= 4"),
    (["--ctx", "100000"], "ctx must be at most"),
    (["--against", "dtype:int3"], "against: "),
    (["--against", "packed"], "against: packed"),
    (["--ctx", "4096"], "ctx must be at most"),
])  # fmt: skip
def test_bad_input_is_one_line_exit_2(capsys, tiny_dir, tmp_path, args, message):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    base = {"--against": "dtype:bfloat16", "--ctx": "32"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    code = main(["kld", "--model", str(tiny_dir), "--file", str(corpus), *[x for kv in base.items() for x in kv]])
    line = one_error(capsys.readouterr().err)
    assert code == 2 and message in line, line


def test_a_text_shorter_than_one_chunk(capsys, tiny_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("Hello world", encoding="utf-8")
    code = main(["kld", "--model", str(tiny_dir), "--file", str(corpus), "--against", "dtype:bfloat16", "--ctx", "64"])
    line = one_error(capsys.readouterr().err)
    assert code == 2 and "fewer than one chunk of ctx 64" in line, line


@pytest.mark.integration
@pytest.mark.slow
def test_bundled_float32_against_packed(bundled_lm):
    b = against_model(bundled_lm, "packed")
    text = TEXT
    result = kld(bundled_lm, b, text, ctx=64, chunks=3)
    ids = list(bundled_lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    check(result, hand(bundled_lm.model, b.model, ids, 64, chunks=3))
    assert result["chunks"] == min(3, len(ids) // 64) >= 2 and result["tokens"] == result["chunks"] * 31
    assert "packed" in result["b"]
    assert 0 < result["kld"]["mean"] < 0.5 and result["same_top"] > 0.5


def test_the_terminal_view_fits_80_columns(capsys, monkeypatch, tiny_dir, other_dir, tmp_path):
    from tests.test_terminal_80 import check_80

    corpus = tmp_path / "c.txt"
    corpus.write_text("line one\nline two\t" + TEXT, encoding="utf-8")
    lines = check_80(capsys, monkeypatch, "kld", "--model", tiny_dir, "--against", other_dir, "--file", corpus,
                     "--ctx", "32", "--chunks", "4", "--no-color")  # fmt: skip
    assert lines[0].startswith("A ") and lines[1].startswith("B ") and any("Same top p" in x for x in lines)


def test_model_and_corpus_text_is_not_rich_markup(tiny_lm, other_dir):
    from lmtrace.render.terminal.kld import terminal
    from tests.test_anatomy import plain

    result = kld(tiny_lm, against_model(tiny_lm, str(other_dir)), TEXT, ctx=32, chunks=2, worst=1)
    result["b"] = "model [packed: Q4_K x10]"
    result["worst"][0]["context"] = "[bold]x[/bold]\n"
    shown = plain(terminal(result))
    assert "model [packed: Q4_K x10]" in shown and "[bold]x[/bold]\\n" in shown
