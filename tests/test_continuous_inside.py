"""The continuous batch runs the logit lens, the attention and a draft on the rows that asked for
them, beside plain rows, rows joining mid-flight: each row's trace is the one it gets alone."""

from __future__ import annotations

import pytest

import lmtrace
from lmtrace import SamplingParams
from lmtrace.decode import tracing
from lmtrace.decode.continuous import ContinuousBatch, RowSpec
from lmtrace.model import draft as drafts
from tests.same_record import assert_same, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

STOP = "L"
GREEDY = {"temperature": 0, "max_new_tokens": 8, "top_logprobs": 3}
SAMPLED = {"temperature": 0.9, "top_k": 30, "seed": 7, "max_new_tokens": 7, "top_logprobs": 2}


def spec(lm, text: str, kw: dict, **extra) -> RowSpec:
    return RowSpec(tracing.encode_prompt(lm, text), SamplingParams(**kw), text, **extra)


def run(batch: ContinuousBatch, waves: list[list[RowSpec]]) -> list:
    """Joins each wave of rows one step after the one before; every row's trace, in join order."""
    rows, traces = [], {}
    for wave in waves:
        rows += batch.join_many(wave)
        for row in batch.step():
            traces[id(row)] = row
    while not batch.empty:
        for row in batch.step():
            traces[id(row)] = row
    for row in rows:
        assert traces[id(row)].error is None, traces[id(row)].error
    return [traces[id(row)].trace for row in rows]


def test_lens_and_attention_rows_beside_plain_rows_are_their_alone_traces(tiny_lm):
    asked = [
        ("Hello world", GREEDY, {"lens": True}),
        ("Once upon a time there was", SAMPLED, {"attention": True}),
        ("The cat", GREEDY, {}),
        ("很久很久以前，", GREEDY, {"lens": True, "attention": "heads"}),
        ("A B C D E F G", SAMPLED, {}),
    ]
    waves = [[spec(tiny_lm, *asked[0][:2], **asked[0][2]), spec(tiny_lm, *asked[2][:2])],
             [spec(tiny_lm, *asked[1][:2], **asked[1][2])],
             [spec(tiny_lm, *asked[3][:2], **asked[3][2]), spec(tiny_lm, *asked[4][:2])]]  # fmt: skip
    order = [asked[0], asked[2], asked[1], asked[3], asked[4]]
    together = run(ContinuousBatch(tiny_lm, max_batch=8), waves)
    for (text, kw, extra), trace in zip(order, together):
        alone = tracing.generate(tiny_lm, text, SamplingParams(**kw), **extra)
        assert trace.token_ids == alone.token_ids, text
        assert_same(trace.to_dict(), alone.to_dict(), tol=5e-5)
        steps = trace.steps
        assert all((s.lens is not None) == bool(extra.get("lens")) for s in steps), text
        assert all((s.attention is not None) == bool(extra.get("attention")) for s in steps), text


def test_a_drafted_row_decodes_its_blocks_beside_the_batch_as_alone(tiny_lm):
    draft = drafts.draft_for(tiny_lm, "layers:1")
    texts = ["Hello world", "The cat", "Once upon a time there was", "A B C"]
    stopping = {**GREEDY, "max_new_tokens": 16, "stop": [STOP]}
    waves = [[spec(tiny_lm, texts[0], GREEDY), spec(tiny_lm, texts[1], SAMPLED, draft=draft, draft_tokens=3)],
             [spec(tiny_lm, texts[2], GREEDY, draft=draft, draft_tokens=2, lens=False),
              spec(tiny_lm, texts[3], stopping, draft=draft, draft_tokens=4)]]  # fmt: skip
    together = run(ContinuousBatch(tiny_lm, max_batch=4), waves)
    alone = [
        tracing.generate(tiny_lm, texts[0], SamplingParams(**GREEDY)),
        tracing.generate(tiny_lm, texts[1], SamplingParams(**SAMPLED), draft=draft, draft_tokens=3),
        tracing.generate(tiny_lm, texts[2], SamplingParams(**GREEDY), draft=draft, draft_tokens=2),
        tracing.generate(tiny_lm, texts[3], SamplingParams(**stopping), draft=draft, draft_tokens=4),
    ]
    assert alone[3].finish_reason == "stop" and alone[3].stop_reason == STOP  # a stop string ends a block
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids
        assert_same(t.to_dict(), a.to_dict(), tol=1e-6)  # a drafted row runs exactly as alone (its tally too)
    assert together[1].speculative["blocks"] > 1 and together[0].speculative is None
    assert any(s.draft is not None for s in together[1].steps)


def test_drafted_rows_record_their_own_lens_attention_and_attribution(tiny_lm):
    """A drafted row's lens, attention and attribution are its own forwards' (the prefill, then
    each step's position of its verify forward), beside a row whose hooks capture the batch's
    forward: each trace is generate's alone (the drafted rows' with the same draft), and the
    hooks are off the model between the rows' own forwards."""
    from lmtrace.decode.attribution import Attribution

    draft = drafts.draft_for(tiny_lm, "layers:1")
    texts = ["Hello world", "The cat", "Once upon a time there was"]
    inside = {"lens": True, "attention": "heads"}
    hooked = []  # at each of the plain row's steps: whether any hook of ours is left on the model

    def hooks() -> set:
        return {(id(m), h) for m in tiny_lm.model.modules() for h in (*m._forward_hooks, *m._forward_pre_hooks)}

    theirs = hooks()  # transformers' own, kept once a forward recorded its outputs (output_attentions)

    def look(step) -> None:
        hooked.append(bool(hooks() - theirs))

    waves = [
        [
            spec(tiny_lm, texts[0], GREEDY, lens=True, attention=True, on_step=look),
            spec(tiny_lm, texts[1], GREEDY, draft=draft, draft_tokens=3, **inside),
        ],
        [
            spec(
                tiny_lm,
                texts[2],
                SAMPLED,
                draft=draft,
                draft_tokens=2,
                lens=True,
                observers=[Attribution(tiny_lm, "rank:3")],
            )
        ],
    ]
    together = run(ContinuousBatch(tiny_lm, max_batch=4), waves)
    alone = [
        tracing.generate(tiny_lm, texts[0], SamplingParams(**GREEDY), lens=True, attention=True),
        tracing.generate(tiny_lm, texts[1], SamplingParams(**GREEDY), draft=draft, draft_tokens=3, **inside),
        tracing.generate(
            tiny_lm,
            texts[2],
            SamplingParams(**SAMPLED),
            draft=draft,
            draft_tokens=2,
            lens=True,
            attribution=True,
            against="rank:3",
        ),
    ]
    for a, t, tol in zip(alone, together, (5e-5, 1e-6, 1e-6)):
        assert t.token_ids == a.token_ids
        assert_same(t.to_dict(), a.to_dict(), tol=tol)
    assert together[1].speculative["blocks"] > 1 and together[2].speculative["blocks"] > 1
    assert all(s.lens is not None and s.attention is not None for s in together[1].steps)
    assert all(s.attribution is not None and s.lens is not None for s in together[2].steps)
    assert len(hooked) == len(together[0].steps) and not any(hooked)


def test_a_drafted_constrained_row_keeps_its_grammar(tiny_lm):
    draft = drafts.draft_for(tiny_lm, "layers:1")
    kw = {**GREEDY, "max_new_tokens": 10, "regex": "[0-9]{3}-[0-9]{4}"}
    [trace] = run(ContinuousBatch(tiny_lm, max_batch=2), [[spec(tiny_lm, "Call", kw, draft=draft, draft_tokens=3)]])
    alone = lmtrace.generate(tiny_lm, "Call", SamplingParams(**kw), draft=draft, draft_tokens=3)
    assert trace.token_ids == alone.token_ids
    assert all(s.grammar is not None for s in trace.steps)


def test_prefilled_rows_cannot_carry_a_draft_or_the_lens(tiny_lm):
    batch = ContinuousBatch(tiny_lm, max_batch=2)
    with pytest.raises(ValueError, match="join_many"):
        batch.join_prefilled([spec(tiny_lm, "Hi", GREEDY, lens=True)], [None])


def test_a_batch_job_decodes_lens_drafted_and_plain_lines_together(tiny_lm, tmp_path):
    """`lmtrace batch` (the local engine): every line a row of one continuous batch, whatever it
    asks for; each line's trace is the one `generate` gives it alone."""
    import json

    from lmtrace.batch.job import run_job
    from lmtrace.batch.local import local_engine

    lines = [
        {"id": "plain", "prompt": "Hello world", **GREEDY},
        {"id": "lens", "prompt": "The cat", **GREEDY, "lens": True, "attention": "heads"},
        {"id": "draft", "prompt": "Once upon a time there was", **SAMPLED, "draft": "layers:1", "draft_tokens": 2},
        {"id": "both", "prompt": "Hi", **GREEDY, "draft": "layers:1", "lens": True},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    run_job(src, out, local_engine(lambda: tiny_lm, {}, 4))
    got = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    for line in lines:
        kw = {k: v for k, v in line.items() if k not in ("id", "prompt")}
        params = SamplingParams(**{k: v for k, v in kw.items() if k in SamplingParams.__dataclass_fields__})
        extra = {k: v for k, v in kw.items() if k not in SamplingParams.__dataclass_fields__}
        alone = lmtrace.generate(tiny_lm, line["prompt"], params, **extra).to_dict()
        assert "trace" in got[line["id"]], got[line["id"]]
        assert got[line["id"]]["trace"]["token_ids"] == alone["token_ids"], line["id"]
        assert_same(got[line["id"]]["trace"], json.loads(json.dumps(alone)), tol=5e-5)
    assert all(s["lens"] is not None for s in got["both"]["trace"]["steps"])


def test_drafted_rows_leave_no_inference_mode_behind(tiny_lm):
    """A drafted row holds nothing suspended inside torch.inference_mode between steps: after rows
    that finish, one whose consumer stops it, and a batch dropped mid-way and collected, the
    caller's thread is not in inference mode (it was, once: models built after it were broken)."""
    import gc

    import torch

    draft = drafts.draft_for(tiny_lm, "layers:1")

    def stop(step):
        if step.index == 2:
            raise RuntimeError("client gone")

    rows = [spec(tiny_lm, "Hello world", GREEDY, draft=draft, draft_tokens=2),
            spec(tiny_lm, "The cat", GREEDY, draft=draft, draft_tokens=3, on_step=stop)]  # fmt: skip
    batch = ContinuousBatch(tiny_lm, max_batch=2)
    batch.join_many(rows)
    while not batch.empty:
        batch.step()
    assert not torch.is_inference_mode_enabled()
    dropped = ContinuousBatch(tiny_lm, max_batch=2)
    dropped.join(spec(tiny_lm, "Once upon a time", GREEDY, draft=draft, draft_tokens=2))
    dropped.step()
    del dropped
    gc.collect()
    assert not torch.is_inference_mode_enabled()
