"""A row of a batch decodes as it would alone: per-row generators, the row's own KV record."""

from __future__ import annotations

import pytest
import torch

from lmtrace import SamplingParams
from lmtrace.decode import tracing
from lmtrace.kv.row_part import own_part
from lmtrace.logits import sampling
from tests.same_record import assert_same, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["Hello world", "Once upon a time there was", "很久很久以前，", "🙂"]


def test_one_generator_per_row_draws_what_each_row_draws_alone():
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0)
    together = sampling.choose(logits, p, [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    alone = [sampling.choose(logits[r : r + 1], p, torch.Generator().manual_seed(s)) for r, s in enumerate((1, 2, 3))]
    assert together.tolist() == torch.cat(alone).tolist()


@pytest.mark.parametrize("kwargs", [{"temperature": 0}, {"temperature": 0.9, "top_k": 20}], ids=["greedy", "sampled"])
def test_each_row_of_a_batch_gets_the_trace_it_gets_alone(tiny_lm, kwargs):
    params = [SamplingParams(max_new_tokens=10, seed=10 + i, **kwargs) for i in range(len(PROMPTS))]
    ids = [tracing.encode_prompt(tiny_lm, p) for p in PROMPTS]
    together = tracing.generate_each(tiny_lm, PROMPTS, ids, params)
    for prompt, p, trace in zip(PROMPTS, params, together):
        alone = tracing.generate(tiny_lm, prompt, p)
        assert trace.token_ids == alone.token_ids
        assert_same(trace.to_dict(), alone.to_dict())  # the KV record too: seq_len = prompt + i, batch 1


def test_rows_may_differ_only_in_seed(tiny_lm):
    ids = [tracing.encode_prompt(tiny_lm, p) for p in PROMPTS[:2]]
    with pytest.raises(ValueError, match="differ only in their seed"):
        tracing.generate_each(
            tiny_lm, PROMPTS[:2], ids, [SamplingParams(temperature=0), SamplingParams(temperature=0.5)]
        )


def test_own_part_of_a_one_row_batch_is_the_record_itself():
    kv = {"seq_len": 5, "bytes": 80, "layers": [{"keys": [1, 2, 5, 4], "values": [1, 2, 5, 4], "bytes": 80}]}
    assert own_part(kv, pad=0, rows=1) is kv


def test_own_part_drops_the_other_rows_and_the_padding():
    layer = {"layer": 0, "keys": [2, 2, 6, 4], "values": [2, 2, 6, 4], "bytes": 768, "bytes_used": 768}
    part = own_part({"seq_len": 6, "bytes": 768, "layers": [layer]}, pad=2, rows=2, expected=lambda n: 64 * n)
    # 2 rows x 2 heads x 6 positions x 4 dims x 4 bytes x (keys, values) = 768; one row, 4 positions: 256
    assert part["seq_len"] == 4 and part["bytes"] == 256 and part["expected_bytes"] == 256
    assert part["layers"][0]["keys"] == [1, 2, 4, 4] and part["layers"][0]["bytes_used"] == 256
