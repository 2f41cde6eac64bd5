"""--uncertainty: every per-token and per-sequence score equals the hand computation from
transformers' logits (tests/uncertainty_oracle.py) within 1e-6, raw and processed."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

import lmtrace
from lmtrace.decode.uncertainty import Uncertainty
from lmtrace.errors import InvalidParameter
from tests import uncertainty_oracle as oracle

TOL = 1e-6


def _check(lm, trace, k, window, tail, processed=None):
    ids = [s.token_id for s in trace.steps]
    logits = oracle.step_logits(lm.model, trace.prompt["token_ids"], ids)  # (T, vocab)
    raw = torch.log_softmax(logits, dim=-1)
    conf, sconf = [], []
    for i, step in enumerate(trace.steps):
        want = oracle.token_scores(raw[i], ids[i], k) | oracle.distances(raw[i])
        got = step.uncertainty
        for name in ("confidence", "margin", "varentropy", "renyi", "fisher_rao"):
            assert got[name] == pytest.approx(want[name], abs=TOL), (i, name)
        conf.append(want["confidence"])
        if processed is not None:
            lp = torch.log_softmax(processed(logits[i : i + 1])[0], dim=-1)
            swant = oracle.token_scores(lp, ids[i], k)
            for name in ("confidence", "margin", "varentropy"):
                assert got[f"sampled_{name}"] == pytest.approx(swant[name], abs=TOL), (i, name)
            sconf.append(swant["confidence"])
        else:
            assert "sampled_confidence" not in got
    u = trace.uncertainty
    lps = [float(raw[i, t]) for i, t in enumerate(ids)]
    ents = [oracle.token_scores(raw[i], t, k)["entropy"] for i, t in enumerate(ids)]
    assert u["msp"] == pytest.approx(-sum(lps), abs=TOL)
    assert u["mean_nll"] == pytest.approx(-sum(lps) / len(lps), abs=TOL)
    assert u["perplexity"] == pytest.approx(math.exp(-sum(lps) / len(lps)), rel=TOL)
    assert u["mean_entropy"] == pytest.approx(sum(ents) / len(ents), abs=TOL)
    assert u["max_entropy"] == pytest.approx(max(ents), abs=TOL)
    for name, value in oracle.deepconf(conf, window, tail).items():
        assert u["deepconf"][name] == pytest.approx(value, abs=TOL), name
    lowest = min(range(len(lps)), key=lambda j: lps[j])
    assert u["lowest_token"]["index"] == lowest and u["lowest_token"]["token_id"] == ids[lowest]
    d = [oracle.distances(raw[i]) for i in range(len(ids))]
    assert u["renyi_neg"] == pytest.approx(-sum(x["renyi"] for x in d) / len(d), abs=TOL)
    assert u["fisher_rao"] == pytest.approx(-sum(x["fisher_rao"] for x in d) / len(d), abs=TOL)
    if processed is not None:
        slps = [s.sampled_logprob for s in trace.steps]
        assert u["sampled_msp"] == pytest.approx(-sum(slps), abs=TOL)
        for name, value in oracle.deepconf(sconf, window, tail).items():
            assert u["sampled_deepconf"][name] == pytest.approx(value, abs=TOL), name
    else:
        assert "sampled_msp" not in u


def test_greedy_scores_equal_the_hand_computation(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=12, temperature=0, uncertainty=True)
    _check(tiny_lm, trace, 20, 2048, 2048)


def test_sampled_scores_raw_and_processed(tiny_lm):
    obs = Uncertainty(k=7, window=5, tail=3)
    trace = lmtrace.generate(tiny_lm, "Once upon", max_new_tokens=14, temperature=0.8, top_k=40, seed=3,
                             observers=[obs])  # fmt: skip
    warp_t, warp_k = TemperatureLogitsWarper(0.8), TopKLogitsWarper(40)
    _check(tiny_lm, trace, 7, 5, 3, processed=lambda x: warp_k(None, warp_t(None, x)))


def test_window_and_tail_capped_at_the_length(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=4, temperature=0,
                             uncertainty=Uncertainty(k=3, window=50, tail=9))  # fmt: skip
    dc = trace.uncertainty["deepconf"]
    conf = [s.uncertainty["confidence"] for s in trace.steps]
    assert len(dc["groups"]) == 1 and dc["lowest_group"] == pytest.approx(sum(conf) / len(conf))
    assert dc["tail"] == pytest.approx(dc["mean"])


def test_round_trip_json(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=5, temperature=0.7, seed=1, uncertainty=True)
    back = lmtrace.Trace.from_json(trace.to_json())
    assert back.uncertainty == trace.uncertainty
    assert [s.uncertainty for s in back.steps] == [s.uncertainty for s in trace.steps]


@pytest.mark.parametrize("kw, name", [({"window": 0}, "confidence_window"), ({"k": 0}, "confidence_k"),
                                      ({"tail": -1}, "confidence_tail")])  # fmt: skip
def test_bad_settings_name_the_parameter(kw, name):
    with pytest.raises(InvalidParameter, match=name):
        Uncertainty(**kw)


def test_k_above_the_vocabulary(tiny_lm):
    with pytest.raises(InvalidParameter, match=r"confidence_k .* got 100000"):
        lmtrace.generate(tiny_lm, "Hello", max_new_tokens=2, uncertainty=Uncertainty(k=100000))


@pytest.mark.integration
def test_bundled_model_scores(bundled_lm):
    trace = lmtrace.generate(bundled_lm, "The capital of France is", max_new_tokens=6, temperature=0,
                             uncertainty=Uncertainty(k=20, window=4, tail=3))  # fmt: skip
    _check(bundled_lm, trace, 20, 4, 3)


def test_cli_generate_uncertainty(tiny_dir, tmp_path, capsys):
    from lmtrace.cli import main

    out = tmp_path / "t.json"
    code = main(["generate", "Hello", "--model", str(tiny_dir), "--max-new-tokens", "5", "--uncertainty",
                 "--confidence-k", "4", "--confidence-window", "3", "--json", str(out)])  # fmt: skip
    assert code == 0
    trace = lmtrace.Trace.from_json(out.read_text())
    assert trace.uncertainty["settings"] == {"k": 4, "window": 3, "tail": 2048}
    assert all(set(s.uncertainty) >= {"confidence", "margin", "varentropy"} for s in trace.steps)
    assert main(["generate", "Hello", "--model", str(tiny_dir), "--uncertainty", "--confidence-k", "999999"]) == 2
    assert "confidence_k must be at most the vocabulary size" in capsys.readouterr().err


def test_report_shows_the_scores_and_the_confidence_view(tiny_lm):
    from lmtrace.render.html.trace import render_html

    trace = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=6, temperature=0.7, seed=4, uncertainty=True)
    html = render_html(trace)
    assert "How sure was the model?" in html and "DeepConf lowest group" in html and "(processed " in html
    assert html.count("confidence ") >= len(trace.steps)  # one shaded span per token, with its title
    plain = render_html(lmtrace.generate(tiny_lm, "Hello", max_new_tokens=3, temperature=0))
    assert "How sure was the model?" not in plain


def test_server_traces_take_uncertainty(tiny_lm):
    from fastapi.testclient import TestClient

    from lmtrace.server import create_app

    with TestClient(create_app(tiny_lm, name="tiny")) as c:
        found = c.post("/v1/traces", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                           "uncertainty": True}).json()  # fmt: skip
    alone = lmtrace.generate(tiny_lm, "Hello", max_new_tokens=4, temperature=0, uncertainty=True)
    assert [s["uncertainty"] for s in found["steps"]] == [s.uncertainty for s in alone.steps]
    assert found["uncertainty"]["msp"] == pytest.approx(alone.uncertainty["msp"], abs=1e-9)
