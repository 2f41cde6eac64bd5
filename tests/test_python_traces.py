"""Traces made in Python: named by the model (a GGUF's converted copy by its file, not its sha256
folder), with their times (or a plain word where none were taken), and a readable repr / str."""

from __future__ import annotations

import json
import re

import torch

import lmtrace
from lmtrace.model.lm import LM, model_name
from lmtrace.render.html.trace import render_html
from lmtrace.render.terminal.trace import header


def test_a_converted_copy_is_named_by_its_gguf(tiny_lm, tmp_path, monkeypatch):
    folder = tmp_path / ("ab" * 32)
    folder.mkdir()
    (folder / "lmtrace-cache.json").write_text(json.dumps({"source": "SmolLM2-135M-Instruct.Q4_1.gguf"}))
    monkeypatch.setattr(tiny_lm.model.config, "_name_or_path", str(folder))
    assert model_name(tiny_lm.model) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert LM.from_objects(tiny_lm.model, tiny_lm.tokenizer).source == "SmolLM2-135M-Instruct.Q4_1.gguf"
    ids = tiny_lm.tokenizer("Hello world", return_tensors="pt")
    with torch.no_grad():
        out = tiny_lm.model.generate(**ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                                     output_logits=True, output_scores=True, pad_token_id=0)  # fmt: skip
    trace = lmtrace.from_generate(out, tiny_lm.tokenizer, model=tiny_lm.model)[0]
    assert trace.model["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    page = render_html(trace)
    assert "ab" * 32 not in page and "<title>lmtrace · trace · SmolLM2-135M-Instruct.Q4_1.gguf</title>" in page
    assert "prefill – ms" not in page and "total</dt><dd>– ms" not in page
    assert "not recorded (the trace was made after the run)" in page
    assert str(header(trace)).startswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_repr_is_one_line_and_str_a_short_table(tiny_lm):
    trace = lmtrace.generate(tiny_lm, "Hello world", max_new_tokens=25, temperature=0, stop_on_eos=False)
    line = repr(trace)
    assert "\n" not in line and len(line) < 160
    assert re.fullmatch(r"Trace\('tiny', 25 steps, finish_reason='length', text='.*'\)", line)
    table = str(trace).splitlines()
    assert table[0] == line and table[1] == "prompt: 'Hello world'" and table[2].split()[:3] == ["#", "token", "prob"]
    assert len(table) == 3 + 20 + 1 and table[-1] == "   … 5 more steps"
    assert repr(trace.steps[0]).startswith("Step(0, ") and "\n" not in repr(trace.steps[0])
